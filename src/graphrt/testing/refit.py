"""The refit property (issue 43): weights refit in place in the middle of traffic serve every
request as an engine built fresh with the weights of each of its tokens.

:func:`refit_under_traffic` serves a :class:`RefitTraffic` -- greedy requests arriving at given
steps -- on ``engine(model_dir)``, refits random weights (:func:`random_weights`, written as a
checkpoint) after a given step, and checks every request: the tokens it had at the refit equal
a fresh ``reference(model_dir)``'s for its prompt, and the rest equal a fresh
``reference(new checkpoint)``'s for its prompt plus those tokens (the refit recomputes the KV of
running requests). Tokens are compared exactly up to a near tie of the reference's two most
likely tokens (:data:`TIE_LOGPROB`): past one, a request may follow either and is not compared
further. :func:`refit_traffic` draws the traffic (hypothesis); tests/kit runs it on ``cpu`` and
the CUDA adapter over the recording graph.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

#: Two candidate tokens whose logprobs differ by less than this are a tie: a batch of another
#: shape may order them either way (sums reassociate), so tokens are compared up to it.
TIE_LOGPROB = 1e-4
#: The first ordinary token id of graphrt's tiny test models (0 padding, 1 BOS, 2 EOS).
FIRST_ORDINARY_ID = 3


@dataclass(frozen=True)
class RefitTraffic:
    """Greedy requests: ``prompts[i]`` joins before step ``arrivals[i]`` and generates
    ``max_tokens[i]`` tokens (EOS ignored); the weights are refit after ``refit_step`` steps to
    random ones drawn with ``seed``, given as tensors or (``as_path``) a checkpoint directory;
    ``overlap``: the engine keeps a step in flight across the refit."""

    prompts: tuple[tuple[int, ...], ...]
    arrivals: tuple[int, ...]
    max_tokens: tuple[int, ...]
    refit_step: int
    seed: int
    as_path: bool = False
    overlap: bool = False


def refit_traffic(vocab_size: int, *, max_requests: int = 4, max_prompt: int = 12, max_tokens: int = 6,
                  max_arrival: int = 4, max_refit_step: int = 8) -> Any:
    """A hypothesis strategy of :class:`RefitTraffic` over token ids ``[3, vocab_size)``."""
    from hypothesis import strategies as st

    @st.composite
    def draw(draw: Callable[[Any], Any]) -> RefitTraffic:
        n = draw(st.integers(1, max_requests))
        prompt = st.lists(st.integers(FIRST_ORDINARY_ID, vocab_size - 1), min_size=1, max_size=max_prompt)
        return RefitTraffic(tuple(tuple(draw(prompt)) for _ in range(n)),
                            tuple(draw(st.integers(0, max_arrival)) for _ in range(n)),
                            tuple(draw(st.integers(1, max_tokens)) for _ in range(n)),
                            draw(st.integers(0, max_refit_step)), draw(st.integers(0, 2**16)),
                            draw(st.booleans()), draw(st.booleans()))
    return draw()


def random_weights(model_dir: str | os.PathLike, seed: int) -> dict[str, Any]:
    """Random tensors of ``model_dir``'s checkpoint names, shapes and dtypes, each drawn around its
    own tensor's mean with its spread (so logits stay of the checkpoint's size), from ``seed``."""
    import torch
    from safetensors import safe_open

    from graphrt.models.checkpoint import safetensors_files

    gen = torch.Generator().manual_seed(seed)
    out = {}
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                if not t.is_floating_point():
                    out[name] = t
                    continue
                x = t.float()
                spread = x.std() if x.numel() > 1 else x.abs().mean()
                noise = torch.randn(x.shape, generator=gen)
                out[name] = (x.mean() + noise * spread).to(t.dtype)
    return out


def write_checkpoint(model_dir: str | os.PathLike, tensors: dict[str, Any], out_dir: str | os.PathLike) -> str:
    """``tensors`` as a checkpoint directory beside ``model_dir``'s config (one safetensors file)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in os.listdir(model_dir):
        if not name.endswith(".safetensors") and name != "model.safetensors.index.json":
            src = Path(model_dir) / name
            if src.is_file():
                shutil.copy(src, out / name)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    return str(out)


def _serve(llm: Any, traffic: RefitTraffic, new: dict[str, Any], new_dir: str) -> tuple[dict[int, list[int]],
                                                                                     dict[int, int]]:
    """Serve ``traffic`` on ``llm`` with the refit: each request's tokens, and its tokens at the
    refit (those finished before it: all of them; those not yet added: none)."""
    from graphrt.engine.sampling_params import SamplingParams

    llm.overlap = traffic.overlap
    ids: dict[int, int] = {}
    done: dict[int, list[int]] = {}
    added: dict[int, int] | None = None         # the requests added before the refit
    unfinished: dict[int, int] = {}             # ... unfinished then, and their tokens
    step = 0
    while len(ids) < len(traffic.prompts) or llm.has_unfinished() or added is None:
        for i, (prompt, arrival) in enumerate(zip(traffic.prompts, traffic.arrivals)):
            if i not in ids and arrival <= step:
                ids[i] = llm.add_request(list(prompt), SamplingParams(max_tokens=traffic.max_tokens[i],
                                                                      ignore_eos=True))
        if step == traffic.refit_step:
            added = dict(ids)
            unfinished = llm.update_weights(new_dir if traffic.as_path else new)["requests"]
        done.update((o.request_id, list(o.token_ids)) for o in llm.step())
        step += 1
    outs = {i: done[rid] for i, rid in ids.items()}
    at_refit = {i: unfinished.get(rid, len(outs[i])) if i in added else 0 for i, rid in ids.items()}
    return outs, at_refit


def _check(got: list[int], ref: Any, what: str) -> None:
    """``got`` equals the reference output's tokens up to a near tie of its two likeliest tokens."""
    want = list(ref.token_ids)
    for j, (g, w) in enumerate(zip(got, want)):
        if g == w:
            continue
        top = sorted((lp.logprob for lp in ref.logprobs[j].values()), reverse=True)
        if len(top) > 1 and top[0] - top[1] < TIE_LOGPROB:
            return                          # a near tie: either token is right, and what follows differs
        raise AssertionError(f"{what}: token {j} is {g}, a fresh engine gives {w} (tokens {got} against {want})")
    if len(got) != len(want):
        raise AssertionError(f"{what}: {len(got)} tokens, a fresh engine gives {len(want)}")


def refit_under_traffic(engine: Callable[[str], Any], reference: Callable[[str], Any], model_dir: str,
                        traffic: RefitTraffic, workdir: str | os.PathLike) -> None:
    """The property (module docstring): ``engine`` and ``reference`` build a ``graphrt.LLM`` of a
    checkpoint directory (``reference`` may return one it keeps: it is only read through
    ``generate``); the new weights' checkpoint goes under ``workdir``."""
    from graphrt.engine.sampling_params import SamplingParams

    new = random_weights(model_dir, traffic.seed)
    new_dir = write_checkpoint(model_dir, new, Path(workdir) / f"refit-{traffic.seed}")
    llm = engine(model_dir)
    try:
        got, at_refit = _serve(llm, traffic, new, new_dir)
    finally:
        llm.close()
    n = range(len(traffic.prompts))
    heads = [got[i][:at_refit[i]] for i in n]
    for weights, prompts, counts, when in (
            (model_dir, [list(traffic.prompts[i]) for i in n], [at_refit[i] for i in n], "before the refit"),
            (new_dir, [list(traffic.prompts[i]) + heads[i] for i in n],
             [len(got[i]) - at_refit[i] for i in n], "after the refit")):
        asked = [i for i in n if counts[i] > 0]
        if not asked:
            continue
        ref = reference(weights)
        outs = ref.generate([prompts[i] for i in asked],
                            [SamplingParams(max_tokens=counts[i], ignore_eos=True, logprobs=2) for i in asked])
        for i, out in zip(asked, outs):
            tokens = got[i][:at_refit[i]] if when == "before the refit" else got[i][at_refit[i]:]
            _check(tokens, out, f"request {i} (prompt {list(traffic.prompts[i])}), {when} at step "
                                f"{traffic.refit_step}")


__all__ = ["RefitTraffic", "TIE_LOGPROB", "random_weights", "refit_traffic", "refit_under_traffic",
           "write_checkpoint"]
