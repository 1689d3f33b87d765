"""Models and references the conformance kit's tests hand in by name, as a user would
(``--model support.kit_models:item_reading_model``, ``--reference support.kit_models:hf_reference``): the
tests' directory is on ``sys.path``, so this module imports by name.

* :func:`model_dir` -- graphrt's tiny reference Qwen3 checkpoint (:mod:`hf_models`);
* :func:`hf_reference` / :func:`hf_reference_tokens` -- a user's plain eager loop through
  transformers, the kit's ``reference(step)``;
* :func:`recording_model` -- the reference model, noting torch's threads when it is built;
* :func:`item_reading_model` -- the same with a ``.item()`` in its forward (every capture fails);
* :func:`docs_example_code` -- docs/testing.md's complete example (a user's model and attention).
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

from graphrt.models.torch.loader import load_torch_model
from support.hf_models import load_hf_model, tiny_hf_model_dir


def model_dir() -> str:
    return str(tiny_hf_model_dir("qwen3"))


@functools.lru_cache(maxsize=None)
def hf_model() -> torch.nn.Module:
    return load_hf_model(model_dir())


def hf_reference(step) -> torch.Tensor:
    """A user's plain eager loop: transformers' forward of each request's tokens so far, the
    logits of its last token (``--reference support.kit_models:hf_reference``)."""
    with torch.no_grad():
        return torch.stack([hf_model()(input_ids=torch.as_tensor(seq, dtype=torch.long)[None]).logits[0, -1]
                            for seq in step.sequences()])


def hf_reference_tokens(step) -> np.ndarray:
    """The same loop's greedy tokens only."""
    return hf_reference(step).argmax(-1).numpy()


class ItemReadingModel(torch.nn.Module):
    """graphrt's reference Qwen3 plus a ``.item()`` in its forward: a host sync no graph can
    hold, so every capture fails (strict mode raises GraphCaptureError at warm-up)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner, self.config = inner, inner.config

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.inner(input_ids, positions)
        return hidden * (1.0 if positions.max().item() >= 0 else 0.0)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.inner.compute_logits(hidden)

    def attention_layers(self) -> list[torch.nn.Module]:
        return self.inner.attention_layers()

    def kv_cache_spec(self):
        return self.inner.kv_cache_spec()


#: torch's intra-op threads at each build of :func:`recording_model` / :func:`item_reading_model`
#: (the kit builds a runner's model inside its warm-up).
THREADS_SEEN: list[int] = []


def recording_model() -> torch.nn.Module:
    """``--model support.kit_models:recording_model``: the
    reference Qwen3, noting torch's threads as it is built."""
    THREADS_SEEN.append(torch.get_num_threads())
    return load_torch_model(model_dir(), dtype=torch.float32, device="cpu")


def item_reading_model() -> torch.nn.Module:
    """``--model support.kit_models:item_reading_model``: :class:`ItemReadingModel`."""
    return ItemReadingModel(recording_model())


def docs_example_code() -> str:
    """docs/testing.md's complete example: a user's model with its own attention."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "testing.md").read_text()
    return text.split("## A complete example", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
