"""nano-vllm's ``LLMEngine`` with graphrt's runner: ``LLM`` / ``LLMEngine``.

Imports nano-vllm. Its scheduler, block manager, sequences, ``step`` and ``generate`` run
unchanged; what differs is the construction (``LLMEngine.__init__`` makes nano-vllm's CUDA runner
and its tensor-parallel processes: here :class:`~.runner.GraphrtModelRunner` is made instead) and
two hooks: the block manager tells the runner when a sequence's blocks are freed (so its row is),
and ``add_request`` takes graphrt's ``SamplingParams`` too, where temperature 0 is greedy.

**Importing nano-vllm without flash-attn.** Any ``nanovllm`` import runs its package
``__init__``, which imports ``llm_engine``, which imports nano-vllm's model runner, whose model
imports flash-attn (a CUDA build). Where flash-attn is installed nano-vllm is imported as it is.
Where it is not (a CPU machine), nano-vllm's model runner module -- the one part this integration
replaces -- is stood in for while nano-vllm is imported: its ``ModelRunner`` then raises
:class:`~graphrt.core.errors.BackendUnavailableError` saying why, which is what nano-vllm's own
``LLM`` would have failed with anyway. The stand-in leaves ``sys.modules`` once the import is
done, flash-attn itself is never faked (other libraries probe for it), and nano-vllm's own files
are not modified.
"""

from __future__ import annotations

import atexit
import dataclasses
import importlib
import importlib.util
import sys
import types
from typing import Any

from graphrt.config import GraphConfig
from graphrt.core import defaults
from graphrt.core.errors import BackendUnavailableError, ConfigError, InputError
from graphrt.engine.sampling_params import SamplingParams
from graphrt.integrations.nanovllm.runner import GraphrtModelRunner

#: nano-vllm's module that needs flash-attn, stood in for while nano-vllm imports without it.
NANO_RUNNER_MODULE = "nanovllm.engine.model_runner"


class NanoRunnerUnavailable:
    """What nano-vllm's own ``LLM`` finds in place of its CUDA model runner without flash-attn."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise BackendUnavailableError(
            "nano-vllm's own model runner needs flash-attn (CUDA), which is not installed; "
            "graphrt.integrations.nanovllm.LLM runs nano-vllm's engine on graphrt's runner instead")


def import_llm_engine() -> types.ModuleType:
    """nano-vllm's ``nanovllm.engine.llm_engine``, imported as the module docstring says."""
    name = "nanovllm.engine.llm_engine"
    if importlib.util.find_spec("flash_attn") is not None or NANO_RUNNER_MODULE in sys.modules:
        return importlib.import_module(name)
    stand_in = types.ModuleType(NANO_RUNNER_MODULE, "graphrt's stand-in: flash-attn is not installed")
    stand_in.ModelRunner = NanoRunnerUnavailable
    sys.modules[NANO_RUNNER_MODULE] = stand_in
    try:
        return importlib.import_module(name)
    finally:
        if sys.modules.get(NANO_RUNNER_MODULE) is stand_in:
            del sys.modules[NANO_RUNNER_MODULE]


_llm_engine = import_llm_engine()
from nanovllm import LLM as NanoLLM  # noqa: E402 - after the import above, which may need the stand-in
from nanovllm.config import Config  # noqa: E402
from nanovllm.engine.block_manager import BlockManager  # noqa: E402
from nanovllm.engine.scheduler import Scheduler  # noqa: E402
from nanovllm.engine.sequence import Sequence  # noqa: E402

#: ``GraphConfig`` fields nano-vllm's ``Config`` sets (under the same names; the block size is its
#: ``kvcache_block_size``): passed to nano-vllm, which hands them to graphrt.
NANO_OWNS = frozenset({"max_num_seqs", "max_num_batched_tokens", "max_model_len", "enforce_eager",
                       "tensor_parallel_size", "block_size"})
#: What nano-vllm's ``Sequence`` keeps of a request's sampling parameters.
CARRIED = frozenset({"temperature", "max_tokens", "ignore_eos"})
_DEFAULT_PARAMS = SamplingParams()


class RowReleasingBlockManager(BlockManager):
    """nano-vllm's ``BlockManager``; when it frees a sequence's blocks (the sequence finished or
    was preempted) the runner frees the sequence's row too."""

    def __init__(self, num_blocks: int, block_size: int, runner: GraphrtModelRunner) -> None:
        super().__init__(num_blocks, block_size)
        self.runner = runner

    def deallocate(self, seq: Sequence) -> None:
        super().deallocate(seq)
        self.runner.release(seq.seq_id)


def check_params(params: Any) -> None:
    """graphrt's ``SamplingParams`` may set only what a nano-vllm ``Sequence`` carries
    (temperature, 0 included, ``max_tokens``, ``ignore_eos``); nano-vllm's own pass as they are."""
    if not isinstance(params, SamplingParams):
        return
    for f in dataclasses.fields(params):
        value, default = getattr(params, f.name), getattr(_DEFAULT_PARAMS, f.name)
        if f.name not in CARRIED and value != default:
            raise InputError(f"sampling_params.{f.name}",
                             f"{value!r}: nano-vllm's Sequence carries only {', '.join(sorted(CARRIED))}; "
                             f"leave it at {default!r}")


class LLMEngine(_llm_engine.LLMEngine):
    """nano-vllm's engine on graphrt's runner.

    ``model``: a Hugging Face directory with its tokenizer (nano-vllm's rule). ``kwargs``: fields
    of nano-vllm's ``Config`` (``max_num_seqs``, ``max_num_batched_tokens``, ``max_model_len``,
    ``kvcache_block_size``, ``num_kvcache_blocks``, ``enforce_eager``) and of graphrt's
    ``GraphConfig`` that nano-vllm has no name for (``mode``, ``strict``,
    ``cudagraph_capture_sizes``, ``precompile_token_paddings``, ...); anything else is a
    ``ConfigError`` (nano-vllm drops unknown keywords silently). ``backend``: graphrt's
    (``"cpu"``, ``"xla"``, ``"cuda"``, ... or ``"auto"``).
    """

    def __init__(self, model: str, *, backend: Any = "auto", **kwargs: Any) -> None:
        nano_fields = {f.name for f in dataclasses.fields(Config)} - {"model", "hf_config", "eos"}
        graph_fields = set(GraphConfig.model_fields) - NANO_OWNS
        unknown = sorted(kwargs.keys() - nano_fields - graph_fields)
        if unknown:
            raise ConfigError(f"{', '.join(unknown)}: neither a field of nano-vllm's Config ({sorted(nano_fields)}) "
                              "nor of graphrt's GraphConfig; the block size is nano-vllm's kvcache_block_size")
        utilization = kwargs.get("gpu_memory_utilization", defaults.DEFAULT_GPU_MEMORY_UTILIZATION)
        if utilization != defaults.DEFAULT_GPU_MEMORY_UTILIZATION:
            raise ConfigError(f"gpu_memory_utilization={utilization}: graphrt sizes the KV cache "
                              f"({defaults.DEFAULT_GPU_MEMORY_UTILIZATION} of free memory, graphs deducted); "
                              "set num_kvcache_blocks for another size")
        config = Config(model, **{k: v for k, v in kwargs.items() if k in nano_fields})
        if config.tensor_parallel_size != 1:
            raise ConfigError(f"tensor_parallel_size={config.tensor_parallel_size}: nano-vllm's ranks are "
                              "processes running its CUDA runner; on graphrt only 1 is supported")
        Sequence.block_size = config.kvcache_block_size      # as nano-vllm's LLMEngine sets it
        self.ps, self.events = [], []                         # no worker processes (nano-vllm's names)
        self.model_runner = GraphrtModelRunner(
            config, backend=backend, **{k: v for k, v in kwargs.items() if k not in nano_fields})
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(config.model, use_fast=True)
        config.eos = self.tokenizer.eos_token_id
        self.scheduler = Scheduler(config)
        self.scheduler.block_manager = RowReleasingBlockManager(
            config.num_kvcache_blocks, config.kvcache_block_size, self.model_runner)
        atexit.register(self.exit)

    @property
    def runner(self) -> Any:
        """graphrt's :class:`~graphrt.ModelRunner` (``runner.stats``, ``runner.last_step``)."""
        return self.model_runner.runner

    def add_request(self, prompt: str | list[int], sampling_params: Any) -> None:
        """nano-vllm's ``add_request``; graphrt's ``SamplingParams`` (temperature 0: greedy)
        are checked first (:func:`check_params`)."""
        check_params(sampling_params)
        super().add_request(prompt, sampling_params)

    def exit(self) -> None:
        """nano-vllm's ``exit`` (graphrt's runner closed), once: later calls and the one
        registered at interpreter exit do nothing."""
        if "model_runner" in self.__dict__:
            super().exit()
        atexit.unregister(self.exit)


class LLM(LLMEngine, NanoLLM):
    """nano-vllm's ``LLM`` on graphrt's runner (nano-vllm's ``LLM`` is its ``LLMEngine``)."""


__all__ = ["LLM", "LLMEngine", "RowReleasingBlockManager", "check_params", "import_llm_engine",
           "NanoRunnerUnavailable"]
