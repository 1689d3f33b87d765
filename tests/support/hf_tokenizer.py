"""A tokenizer for the tiny checkpoints of :mod:`support.hf_models`, for engines that load one
from the model directory (nano-vllm, vLLM). No network: a word-level ``tokenizers`` model whose
token ``i`` is the word ``t{i}``, with the checkpoints' special ids (0 padding, 1 BOS, 2 EOS).
"""

from __future__ import annotations

from pathlib import Path

SPECIAL = {0: "<pad>", 1: "<s>", 2: "</s>"}


def save_tiny_tokenizer(model_dir: str | Path, vocab_size: int = 128) -> Path:
    """Write ``tokenizer.json`` and its config into ``model_dir`` (a copy the caller owns:
    :func:`support.hf_models.make_tiny_hf_model`); returns ``model_dir``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {SPECIAL.get(i, f"t{i}"): i for i in range(vocab_size)}
    core = Tokenizer(models.WordLevel(vocab, unk_token=SPECIAL[0]))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=SPECIAL[0], bos_token=SPECIAL[1],
                                        eos_token=SPECIAL[2], unk_token=SPECIAL[0])
    tokenizer.save_pretrained(model_dir)
    return Path(model_dir)
