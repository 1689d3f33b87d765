"""In-place refit and sleep / wake on ``xla`` (issue 43): new parameter buffers of the same
shapes, dtypes and shardings replace the refit's, and a wake re-creates the deleted ones, so
executables compiled before run them with nothing recompiled (the runner's compile count)."""

from __future__ import annotations

import pytest

import graphrt
from graphrt import EngineAsleepError, InputError
from support.hf_models import tiny_hf_model_dir
from support.refit_models import XLA_ENGINE, fresh_tokens, greedy_tokens, mixed_checkpoint, tensors

pytest.importorskip("jax")

OLD, NEW = (str(tiny_hf_model_dir("qwen3", seed=s)) for s in (0, 1))


def test_xla_refit_sleep_and_wake_without_recompiling(tmp_path) -> None:
    layer = {n: t for n, t in tensors(NEW).items() if n.startswith("model.layers.1.")}
    with graphrt.LLM(OLD, backend="xla", **XLA_ENGINE) as llm:
        before = greedy_tokens(llm)
        norm = "model.layers.1.input_layernorm.weight"
        with pytest.raises(InputError, match="nothing was written") as err:
            llm.update_weights({**layer, norm: layer[norm][:-1]})
        assert err.value.field == norm
        assert greedy_tokens(llm) == before             # its prefixes cached: other step shapes
        compiles = llm.runner.stats.compiles
        llm.update_weights(iter(layer.items()))              # one layer: rows of the stacked leaves
        assert greedy_tokens(llm) == fresh_tokens(mixed_checkpoint(tmp_path, OLD, NEW, layer), "xla")
        llm.update_weights(NEW)
        want = fresh_tokens(NEW, "xla")
        assert greedy_tokens(llm) == want
        report = llm.sleep(1)
        assert report["released_bytes"] == report["weight_bytes"] + report["cache_bytes"] > 0
        with pytest.raises(EngineAsleepError):
            llm.generate([[5, 6]])
        assert llm.wake()["recaptured"] == 0
        assert greedy_tokens(llm) == want
        assert llm.sleep(2)["offloaded_bytes"] == 0
        llm.wake()
        with pytest.raises(EngineAsleepError, match="level-2"):
            llm.generate([[5, 6]])
        llm.update_weights(NEW)
        assert greedy_tokens(llm) == want
        assert llm.runner.stats.compiles == compiles


def test_xla_refit_of_a_hybrid_model() -> None:
    """Granite-4-H on xla: its params are checkpoint names, refit whole leaves."""
    from support.hybrid_models import hybrid_model_dir

    old, new = (str(hybrid_model_dir("granite", seed=s)) for s in (0, 1))
    kw = dict(precompile_token_paddings=(16,), max_num_batched_tokens=16, max_model_len=32, num_kv_blocks=24,
              max_num_seqs=3)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    want = fresh_tokens(new, "xla", prompts, **kw)
    with graphrt.LLM(old, backend="xla", **{**XLA_ENGINE, **kw}) as llm:
        greedy_tokens(llm, prompts)
        compiles = llm.runner.stats.compiles
        llm.update_weights(new)
        assert greedy_tokens(llm, prompts) == want and llm.runner.stats.compiles == compiles
