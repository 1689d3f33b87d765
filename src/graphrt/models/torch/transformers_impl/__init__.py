"""The Transformers modeling backend: any transformers causal LM under graphrt's graphs.

``graphrt.LLM(model_dir, model_impl="transformers")`` (or ``"auto"`` for an architecture graphrt has
no implementation of) loads the checkpoint with transformers' own ``from_pretrained`` and runs it
through graphrt's paged attention, registered with transformers' ``AttentionInterface``
(docs/transformers-models.md). Importing this package does not import transformers; loading does.

* :func:`load_transformers_model` -- a checkpoint directory to a graphrt model;
* :func:`wrap_transformers_model` -- a transformers model already loaded with
  ``attn_implementation="graphrt"`` (:data:`ATTENTION_NAME`) to a graphrt model;
* :class:`TransformersForCausalLM` -- the model (docs/models.md's protocol).
"""

from graphrt.models.torch.transformers_impl.interface import ATTENTION_NAME, register_attention
from graphrt.models.torch.transformers_impl.loader import load_transformers_model, wrap_transformers_model
from graphrt.models.torch.transformers_impl.model import TransformersForCausalLM

__all__ = ["ATTENTION_NAME", "TransformersForCausalLM", "load_transformers_model", "register_attention",
           "wrap_transformers_model"]
