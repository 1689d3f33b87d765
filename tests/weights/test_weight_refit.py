"""In-place weight refit (issue 43): ``LLM.update_weights`` / ``ModelRunner.update_weights``.

* ``cpu`` graphs and the CUDA adapter over the recording graph (``cuda-sim``): generate, refit to
  new weights (a checkpoint directory), generate again: the tokens equal an engine built fresh
  with the new weights, and no key was captured again (stats);
* a partial refit of one layer (an iterator of ``(name, tensor)``, fused q/k/v and gate/up
  names) equals a fresh engine of the old checkpoint with that layer replaced;
* a refit with an unknown name, a wrong shape or a dtype that does not cast is one InputError
  naming the tensor, and nothing is written (every parameter bit for bit as before, the same
  tokens); a refit while steps are in flight (overlap) resolves them first;
* ``recompute=False`` keeps running requests' old KV; the default recomputes them.
"""

from __future__ import annotations

import pytest
import torch

import graphrt
from graphrt import InputError
from support.hf_models import tiny_hf_model_dir
from support.refit_models import (ENGINE, GREEDY, PROMPTS, backend, fresh_tokens, greedy_tokens, mixed_checkpoint,
                                  tensors)

OLD, NEW = (str(tiny_hf_model_dir("qwen3", seed=s)) for s in (0, 1))


def _snapshot(llm: graphrt.LLM) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in llm.runner.model.named_parameters()}


@pytest.mark.parametrize("name", ["cpu", "cuda-sim"])
def test_refit_equals_a_fresh_engine_without_recapture(name: str) -> None:
    want = fresh_tokens(NEW, name)
    with graphrt.LLM(OLD, backend=backend(name), **ENGINE) as llm:
        before = greedy_tokens(llm)
        assert before != want                    # the two checkpoints differ where it shows
        stats = llm.runner.stats
        compiles, entries, unplanned, hits = stats.compiles, stats.entries, stats.unplanned_builds, stats.hits
        params = {n: p.data_ptr() for n, p in llm.runner.model.named_parameters()}
        report = llm.update_weights(NEW)
        assert report["tensors"] == len(tensors(NEW)) and report["bytes"] > 0
        assert greedy_tokens(llm) == want
        after = llm.runner.stats
        assert (after.compiles, after.entries, after.unplanned_builds, after.recaptured) == \
               (compiles, entries, unplanned, 0)
        assert {n: p.data_ptr() for n, p in llm.runner.model.named_parameters()} == params
        assert llm.stats["weights"]["refits"] == 1 and llm.runner.stats.hits > hits


def test_partial_refit_of_one_layer(tmp_path) -> None:
    layer = {n: t for n, t in tensors(NEW).items() if n.startswith("model.layers.1.")}
    assert any(".q_proj." in n for n in layer) and any(".up_proj." in n for n in layer)   # fused targets
    want = fresh_tokens(mixed_checkpoint(tmp_path, OLD, NEW, layer), "cpu")
    with graphrt.LLM(OLD, backend="cpu", **ENGINE) as llm:
        greedy_tokens(llm)
        compiles = llm.runner.stats.compiles
        report = llm.update_weights(iter(layer.items()))           # an iterator, read once
        assert report["tensors"] == len(layer)
        assert greedy_tokens(llm) == want
        assert llm.runner.stats.compiles == compiles


BAD = {"unknown name": ("model.layers.7.mlp.up_proj.weight", lambda t: t),
       "wrong shape": ("model.layers.0.self_attn.k_proj.weight", lambda t: t[:-1]),
       "dtype that does not cast": ("model.norm.weight", lambda t: t.to(torch.complex64)),
       "integer into float": ("lm_head.weight", lambda t: t.to(torch.int64))}


def test_a_refused_refit_writes_nothing() -> None:
    """Each bad tensor among the good ones (before and after it in the checkpoint's order)."""
    new = tensors(NEW)
    with graphrt.LLM(OLD, backend="cpu", **ENGINE) as llm:
        before, params = greedy_tokens(llm), _snapshot(llm)
        for kind, (name, spoil) in BAD.items():
            bad = dict(new)
            bad[name] = spoil(new.get(name, new["model.layers.0.mlp.up_proj.weight"]))
            with pytest.raises(InputError, match="nothing was written") as err:
                llm.update_weights(bad)
            assert err.value.field == name and name in str(err.value), kind
            for n, p in llm.runner.model.named_parameters():
                assert torch.equal(p, params[n]), (kind, n)
        assert greedy_tokens(llm) == before
        assert llm.stats["weights"]["refits"] == 0


def test_refit_resolves_steps_in_flight_and_recomputes_running_requests() -> None:
    """Overlap keeps a step in flight between ``step()`` calls: a refit resolves it, then every
    running request recomputes its KV, so the tokens after the refit are the new weights' for
    the prompt plus the tokens before."""
    with graphrt.LLM(OLD, backend="cpu", **ENGINE) as llm:
        llm.overlap = True
        rid = llm.add_request(PROMPTS[2], GREEDY)
        for _ in range(3):
            llm.step()
        report = llm.update_weights(NEW)
        assert report["recomputed"] == [rid]
        done = {}
        while llm.has_unfinished():
            done.update((o.request_id, o.token_ids) for o in llm.step())
    got = done[rid]
    # Three steps launched (a prefill, two decodes): the refit resolves the one in flight.
    head = fresh_tokens(OLD, "cpu", [PROMPTS[2]])[0][:3]
    assert got[:3] == head
    assert got[3:] == fresh_tokens(NEW, "cpu", [PROMPTS[2] + head])[0][:len(got) - 3]


def test_refit_without_recompute_keeps_the_old_kv() -> None:
    with graphrt.LLM(OLD, backend="cpu", **ENGINE) as llm:
        rid = llm.add_request(PROMPTS[2], GREEDY)
        llm.step()
        assert llm.update_weights(NEW, recompute=False)["recomputed"] == []
        done = {}
        while llm.has_unfinished():
            done.update((o.request_id, o.token_ids) for o in llm.step())
    head = fresh_tokens(OLD, "cpu", [PROMPTS[2]])[0][:1]
    assert done[rid][:1] == head
    # Its later tokens read the prompt's KV from the old weights: not what a fresh engine gives.
    assert done[rid][1:] != fresh_tokens(NEW, "cpu", [PROMPTS[2] + head])[0][:5]


def test_runner_refit_takes_numpy_and_a_safetensors_file() -> None:
    with graphrt.ModelRunner(OLD, backend="cpu", num_kv_blocks=16, **{k: v for k, v in ENGINE.items()
                                                                        if k != "num_kv_blocks"}) as runner:
        one = {"model.norm.weight": tensors(NEW)["model.norm.weight"].numpy()}
        assert runner.update_weights(one)["tensors"] == 1
        assert torch.equal(runner.model.model.norm.weight, torch.from_numpy(one["model.norm.weight"]))
        assert runner.update_weights(f"{NEW}/model.safetensors")["tensors"] == len(tensors(NEW))
        with pytest.raises(InputError, match="neither a checkpoint directory"):
            runner.update_weights(f"{NEW}/config.json")
        with pytest.raises(InputError, match="a torch tensor or numpy array"):
            runner.update_weights([("model.norm.weight", [1.0] * 64)])


def test_refit_of_a_transformers_model() -> None:
    """``model_impl="transformers"``: the checkpoint's names are its parameters' (under ``hf``)."""
    want = fresh_tokens(NEW, "cpu", model_impl="transformers")
    with graphrt.LLM(OLD, backend="cpu", model_impl="transformers", **ENGINE) as llm:
        greedy_tokens(llm)
        compiles = llm.runner.stats.compiles
        assert llm.update_weights(NEW)["tensors"] == len(tensors(NEW))
        assert greedy_tokens(llm) == want and llm.runner.stats.compiles == compiles
