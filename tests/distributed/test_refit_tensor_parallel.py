"""In-place refit under tensor parallelism (issue 43): ``graphrt.LLM(tensor_parallel_size=2)`` on
``cpu`` (recording graphs, gloo) refits every rank's shard -- a full checkpoint given as tensors
(staged once, each rank reading its rows or columns) and one layer given as a safetensors
file -- with the tokens of an engine built fresh with those weights and no key captured
again; a tensor no rank can take is refused on every rank with nothing written."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch
from safetensors.torch import save_file

import graphrt
from graphrt import InputError
from support.hf_models import tiny_hf_model_dir
from support.refit_models import ENGINE, fresh_tokens, greedy_tokens, mixed_checkpoint, tensors

OLD, NEW = (str(tiny_hf_model_dir("qwen3", seed=s)) for s in (0, 1))


@pytest.fixture(autouse=True, scope="module")
def fork_server_and_one_thread():
    """One intra-op thread per rank; workers start from a fork server (as the TP engine tests do)."""
    from multiprocessing import forkserver

    mp.get_context("forkserver").set_forkserver_preload(["graphrt.backends.torch.parallel.tp_worker"])
    forkserver.ensure_running()
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def test_tp2_refit_full_and_one_layer(tmp_path) -> None:
    layer = {n: t for n, t in tensors(NEW).items() if n.startswith("model.layers.0.")}
    mixed = mixed_checkpoint(tmp_path, OLD, NEW, layer)
    save_file(layer, str(tmp_path / "layer0.safetensors"))
    with graphrt.LLM(OLD, backend="cpu", tensor_parallel_size=2, **ENGINE) as llm:
        greedy_tokens(llm)
        compiles = llm.runner.stats.compiles
        with pytest.raises(InputError, match="nothing was written"):
            llm.update_weights({**tensors(NEW), "model.norm.weight": torch.zeros(3)})
        assert greedy_tokens(llm) == fresh_tokens(OLD, "cpu")
        llm.update_weights(str(tmp_path / "layer0.safetensors"))       # one layer, in a file
        assert greedy_tokens(llm) == fresh_tokens(mixed, "cpu")
        llm.update_weights(tensors(NEW))               # tensors: staged once for every rank
        assert greedy_tokens(llm) == fresh_tokens(NEW, "cpu")
        assert llm.runner.stats.compiles == compiles and llm.runner.stats.recaptured == 0
