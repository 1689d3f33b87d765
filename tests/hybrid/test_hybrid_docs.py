"""docs/hybrid.md's examples run as written, and the own-mixer path it documents is checked (issue 47).

* Every ``python`` block of docs/hybrid.md is either run here (the runnable ones: they call
  ``graphrt.LLM``) or compiled (the sketches); the quick start and the Transformers backend's
  example run on ``cpu`` with tiny random checkpoints in place of ``path/to/...``.
* "A recurrent layer of your own": its torch block (an RWKV / GLA-style mixer on ``cpu`` graphs
  with chunked prefills and shared steps, against each request alone on ``eager``) and its JAX
  block (the same model on ``xla``, the torch model's tokens) run as written; its ring is
  written newest first, so rejected drafts roll back (oldest first, planted, does not).
* A state spec that contradicts what its layer keeps is a ConfigError naming the group, the
  tensor, the layer and both shapes, when the runner is built: on torch (the layer's
  ``state_shapes()``: the docs' mixer and graphrt's own Mamba2 mixer) and on ``xla`` (what the
  forward writes through ``write_states``, traced once at build). A JAX config without
  ``state_layers`` is a ConfigError naming it.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import graphrt
from graphrt import ConfigError, StateSpec, StateTensor
from support.hybrid_models import hybrid_model_dir
from support.parity import assert_close_across_shapes

DOC = Path(__file__).resolve().parents[2] / "docs" / "hybrid.md"
OWN = "## A recurrent layer of your own"
#: Where the runnable examples name a checkpoint, the tiny random one that stands for it.
PATHS = {"path/to/granite-4.0-h-tiny": "granite", "path/to/qwen3-next": "qwen3_next"}


def blocks(text: str | None = None) -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text() if text is None else text, flags=re.S)


def own_blocks() -> list[str]:
    text = DOC.read_text()
    section = text[text.index(OWN):]
    return blocks(section[:section.index("\n## ", 1)])


def run(code: str, name: str, namespace: dict | None = None) -> dict:
    for path, arch in PATHS.items():
        code = code.replace(f'"{path}"', repr(str(hybrid_model_dir(arch))))
    namespace = {"__name__": "docs_example"} if namespace is None else namespace
    exec(compile(code, f"docs/hybrid.md: {name}", "exec", dont_inherit=True), namespace)
    return namespace


def definitions() -> dict:
    """The own-mixer torch block's definitions (its classes and helpers), without its runs."""
    code = own_blocks()[0]
    return run(code[:code.index("torch.manual_seed(0)")], "own mixer (definitions)")


def test_every_block_is_run_or_a_compiled_sketch():
    """The cheapest test of the file: the blocks are what the tests below run, and the sketches
    (which name objects of a model of one's own) compile and import what they use."""
    found = blocks()
    runnable = [b for b in found if "graphrt.LLM(" in b]
    assert runnable == [found[0], *[b for b in found if "transformers_impl import" in b], *own_blocks()]
    for i, code in enumerate(found):
        compile(code, f"docs/hybrid.md block {i}", "exec")
        if "torch." in code:
            assert "import torch" in code, f"block {i} uses torch without importing it"
    assert "backend=\"cuda\"" not in "".join(runnable)


def test_the_quick_start_runs_on_cpu():
    ns = run(blocks()[0], "quick start")
    assert ns["llm"].runner.backend.name == "cpu" and len(ns["out"][0].token_ids) == 32


def test_the_transformers_backend_example_runs_on_cpu():
    code = next(b for b in blocks() if "transformers_impl import" in b)
    ns = run(code, "Transformers backend")
    assert ns["llm"].runner.backend.name == "cpu" and len(ns["out"][0].token_ids) == 8
    assert ns["llm"].runner.executor.num_state_slots == 4


def test_the_own_mixer_runs_as_written_on_cpu_and_xla():
    torch_block, jax_block = own_blocks()
    ns = run(torch_block, "own mixer (torch)")
    assert ns["llm"].runner.backend.name == "cpu" and ns["alone"].runner.backend.name == "eager"
    assert [len(t) for t in ns["together"]] == [8, 8, 8]
    assert ns["llm"].runner.executor.state_caches[1].shape == (5, 1, 16, 3)      # conv: [slots + 1, C, *shape]
    pytest.importorskip("jax")
    ns = run(jax_block, "own mixer (JAX)", ns)
    assert ns["on_xla"].runner.backend.name == "xla"


def _lying(spec: StateSpec, tensor: int, shape: tuple[int, ...]) -> StateSpec:
    group = spec.groups[0]
    tensors = list(group.tensors)
    tensors[tensor] = StateTensor(tensors[tensor].name, shape)
    return StateSpec((dataclasses.replace(group, tensors=tuple(tensors)),))


LIMITS = dict(max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64, kv_cache_memory=1 << 20, progress=False)


@pytest.mark.parametrize("backend", ["cpu", "eager"])
def test_a_spec_that_contradicts_its_layer_is_refused_at_build_on_torch(backend):
    """issue 47: conv declared [16, 2] where the layer keeps [16, 3] built, every capture failed
    ("index 2 is out of bounds") and the first step died inside a GenerationError."""
    ns = definitions()
    torch.manual_seed(0)
    model = ns["TinyRecurrentLM"]()
    lie = _lying(model.state_spec(), 1, (16, 2))
    model.state_spec = lambda: lie
    with pytest.raises(ConfigError, match=re.escape(
            "state_spec.groups[0].tensors[1] ('conv').shape: (16, 2), but recurrent layer 0 (ShiftConvDecay) "
            "keeps (16, 3) per request (its state_shapes())")):
        graphrt.ModelRunner(model, backend=backend, **LIMITS)
    fewer = StateSpec((dataclasses.replace(lie.groups[0], tensors=lie.groups[0].tensors[:2]),))
    model.state_spec = lambda: fewer
    with pytest.raises(ConfigError, match=r"state_spec.groups\[0\].tensors: 2 state tensors \(shift, conv\), but "
                                          r"recurrent layer 0 \(ShiftConvDecay\) keeps 3"):
        graphrt.ModelRunner(model, backend=backend, **LIMITS)


def test_graphrts_own_mamba2_mixer_says_what_it_keeps():
    """The same check on graphrt's Mamba2 mixer (and so the Transformers backend's routed ones)."""
    granite = graphrt.select_backend("eager").load_model(str(hybrid_model_dir("granite")))
    spec = granite.state_spec()
    assert [m.state_shapes() for m in granite.state_layers()] == [
        tuple(t.shape for t in spec.layer_tensors(i)) for i in range(spec.num_layers)]
    conv = spec.groups[0].tensors[0].shape
    lie = _lying(spec, 0, (conv[0], conv[1] - 1))
    granite.state_spec = lambda: lie
    with pytest.raises(ConfigError, match=re.escape(
            f"state_spec.groups[0].tensors[0] ('conv').shape: {(conv[0], conv[1] - 1)}, but recurrent layer 0 "
            f"(Mamba2Mixer) keeps {conv} per request")):
        graphrt.ModelRunner(granite, backend="cpu", progress=False, max_num_seqs=2, max_num_batched_tokens=8,
                            max_model_len=32, block_size=4)


def _jax_model(spec_of=None, config_of=None):
    pytest.importorskip("jax")
    import jax.numpy as jnp

    ns = definitions()
    torch.manual_seed(0)
    model = ns["TinyRecurrentLM"]()
    jax_code = own_blocks()[1]
    run(jax_code[:jax_code.index("jax_model = ")], "own mixer (JAX definitions)", ns)
    spec = model.state_spec() if spec_of is None else spec_of(model.state_spec())
    config = ns["TinyRecurrentConfig"]() if config_of is None else config_of(ns["TinyRecurrentConfig"])
    params = {n: jnp.asarray(t.detach().numpy()) for n, t in model.state_dict().items()}
    return ns["XlaModel"](config, params, forward=ns["forward"], compute_logits=ns["compute_logits"], state=spec)


def test_a_spec_that_contradicts_what_the_jax_layer_writes_is_refused_at_build_on_xla():
    model = _jax_model(spec_of=lambda spec: _lying(spec, 1, (16, 2)))
    with pytest.raises(ConfigError, match=re.escape(
            "state_spec.groups[0].tensors[1] ('conv').shape: (16, 2), but recurrent layer 0 keeps (16, 3) per "
            "request (the states its forward writes through write_states)")):
        graphrt.ModelRunner(model, backend="xla", disable_precompile=True, **LIMITS)   # refused before compiling


def test_a_jax_config_without_state_layers_is_a_config_error_naming_it():
    """issue 47: a raw AttributeError in backends/xla/programs.py."""
    def without(cls):
        fields = [(f.name, f.type, f.default) for f in dataclasses.fields(cls) if f.name != "state_layers"]
        return dataclasses.make_dataclass("NoStateLayers", fields, frozen=True)(num_hidden_layers=1)

    model = _jax_model(config_of=without)
    with pytest.raises(ConfigError, match=r"model.config.state_layers: .* \(NoStateLayers\) has no state_layers"):
        graphrt.ModelRunner(model, backend="xla", disable_precompile=True, **LIMITS)


def _continue_after(runner, history: list[int], drafts: list[int] | None, tail: list[int]) -> np.ndarray:
    """``history`` computed -- prefilled whole, or (``drafts``) prefilled but its last token, which
    a verification step of ``[history[-1], *drafts]`` then computes with drafts all rejected --
    then a verification step of ``tail`` (1 + k tokens): its position logits."""
    tokens = np.zeros((1, 64), np.int32)
    table = np.arange(1, 17, dtype=np.int32).reshape(1, 16)

    def step(seq: list[int], computed: int, scheduled: int) -> None:
        tokens[0] = 0
        tokens[0, :len(seq)] = seq
        runner.execute(token_ids=tokens, block_table=table, req_rows=np.array([0]),
                       num_computed_tokens=np.array([computed]), num_scheduled_tokens=np.array([scheduled]))

    n = len(history)
    if drafts is None:
        step(history, 0, n)
    else:
        step(history, 0, n - 1)
        step(history + drafts, n - 1, 1 + len(drafts))
    step(history + tail, n, len(tail))
    return runner.outputs.position_logits()[0].copy()


def test_the_own_mixer_rolls_back_rejected_drafts_newest_first():
    """The docs' mixer writes its ring newest first: after a verification step whose drafts are
    all rejected, the next verification continues from the state after the last accepted token
    (the ring's oldest entry of that step) and gives the logits of a history without the drafts.
    Written oldest first (the natural guess the docs warn about), it does not."""
    ns = definitions()
    torch.manual_seed(0)
    model = ns["TinyRecurrentLM"]()
    limits = dict(num_speculative_tokens=2, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64,
                  block_size=4, num_kv_blocks=17, progress=False)
    history, drafts, tail = [5, 9, 17, 33, 2, 7, 11], [40, 41], [3, 8, 13]

    def logits(drafts):
        return _continue_after(graphrt.ModelRunner(model, backend="eager", **limits), history, drafts, tail)

    want = logits(None)
    assert_close_across_shapes(logits(drafts), want, np.float32, "after the rejected drafts")
    write = ns["write_states"]
    ns["write_states"] = lambda cache, meta, states: write(cache, meta, states.flip(1))   # planted: oldest first
    assert not np.allclose(logits(drafts), want, atol=1e-2)
