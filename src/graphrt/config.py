"""``GraphConfig``: the flags engine authors know from vLLM and sglang-jax, validated.

Graph backends read ``mode`` and the capture sizes; XLA reads the ``precompile_*`` paddings (its
grid is built in ``backends/xla/buckets.py``). ``add_cli_args`` / ``from_cli_args`` expose every
field as ``--kebab-case`` flags.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import operator
import typing
from typing import Annotated, Any, Literal, Optional, Sequence

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, Strict, ValidationError, field_validator, model_validator

from graphrt.core import defaults
from graphrt.core.buckets import BucketPolicy
from graphrt.core.dispatch import Dispatcher
from graphrt.core.errors import ConfigError
from graphrt.core.graph_modes import GraphMode
from graphrt.core.kv_spec import blocks_for, kv_cache_dtype_name

logger = logging.getLogger(__name__)


def _whole_number(value: Any) -> int:
    """A count or size as an int (or numpy integer), never a float, a string or a bool."""
    if isinstance(value, bool):
        raise ValueError(f"must be an integer, got the bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"must be an integer, got {type(value).__name__} {value!r}") from None


#: An int field that takes ints only (GraphConfig's counts and sizes).
Count = Annotated[int, BeforeValidator(_whole_number)]
#: A list of counts: any sequence of ints (a tuple too); each element a :data:`Count`.
Sizes = Annotated[list[Count], Strict(False)]


def _sizes(name: str, values: Optional[list[int]]) -> Optional[list[int]]:
    if values is None:
        return None
    if not values:
        raise ValueError(f"{name} is empty; leave it unset for the default")
    bad = [v for v in values if v <= 0]
    if bad:
        raise ValueError(f"{name} must be positive, got {bad}")
    return sorted(set(values))


def check_flags(**flags: Any) -> None:
    """Refuse a boolean keyword that is not a bool (``"yes"``, 0, 1, None are not): ConfigError
    naming it. graphrt.LLM's and ModelRunner's keywords go through here."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ConfigError(f"{name}: Input should be a valid boolean, got {value!r}")


def close_names(name: str, known: Sequence[str]) -> str:
    """``"; did you mean a or b?"`` for the names of ``known`` close to ``name`` ("" if none)."""
    close = difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.6)
    return f"; did you mean {' or '.join(close)}?" if close else ""


def check_unknown_fields(fields: Any, keywords: Sequence[str] | Any, owner: str) -> None:
    """Refuse keywords of ``owner`` (``graphrt.LLM``, ``ModelRunner``) that are neither its own
    (``keywords``: names, or ``inspect.signature(...).parameters``) nor :class:`GraphConfig`
    fields: a ConfigError naming each and the close names it may have meant, before pydantic's
    bare "Extra inputs are not permitted"."""
    unknown = [name for name in fields if name not in GraphConfig.model_fields]
    if unknown:
        if hasattr(keywords, "items"):          # a signature's parameters: not self, not **fields
            keywords = [name for name, p in keywords.items()
                        if name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        known = [*GraphConfig.model_fields, *keywords]
        raise ConfigError("; ".join(f"{name}: not a keyword {owner} or GraphConfig takes{close_names(name, known)}"
                                    for name in unknown) + " (docs/api.md lists them)")


def _describe(err: Any) -> str:
    """One pydantic error as ``field: what, got value``; a check of several fields (whose
    message names them) as its message alone."""
    if not err["loc"]:
        return err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":            # an unknown field: name the close ones
        name = str(err["loc"][0])
        return f"{name}: not a GraphConfig field{close_names(name, list(GraphConfig.model_fields))}"
    got = (f", got {err['input']!r}" if err["type"] in ("bool_type", "int_type", "int_parsing", "less_than_equal",
                                                   "greater_than", "greater_than_equal", "string_type",
                                                   "list_type") else "")
    return f"{'.'.join(map(str, err['loc']))}: {err['msg']}{got}"


def covering_padding(sizes: Optional[Sequence[int]], bound: int) -> Optional[int]:
    """The padding a step at the limit ``bound`` runs at: the first of ``sizes`` >= ``bound``;
    ``bound`` when ``sizes`` is unset; None when none covers it. The one rule validation and
    ``backends/xla/buckets.py`` share for XLA's largest batch size and token bucket."""
    if sizes is None:
        return bound
    return min((s for s in sizes if s >= bound), default=None)


def _refuse_unusable(name: str, values: Optional[list[int]], cover: int, limit: str, bound: int,
                     cost: str) -> None:
    """Refuse XLA paddings past ``cover`` (the first covering ``bound``): no step uses them, yet
    each costs an executable (``[4, 2**24]`` with ``max_num_seqs=4`` once ran out of memory)."""
    if values is None:
        return
    unused = [v for v in values if v > cover]
    if unused:
        raise ValueError(f"{name}: {unused} above {cover}, the first padding that covers {limit} ({bound}): "
                         f"no step can use them and {cost}; drop them")


class GraphConfig(BaseModel):
    """Graph capture / precompile and scheduler limits, validated together."""

    #: Strict: no field takes ``"5"`` or ``True`` for a number, or a number for a bool (pydantic's
    #: lax mode took ``refit_interval="5"`` as 5); ``mode`` and the size lists convert on purpose.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False, strict=True)

    mode: GraphMode = Field(GraphMode.FULL_AND_PIECEWISE, strict=False,
                            description="graph mode (vLLM's cudagraph_mode; a GraphMode or its name)")
    cudagraph_capture_sizes: Optional[Sizes] = Field(
        None, description="token counts to capture; default vLLM's list up to max_cudagraph_capture_size, in "
                          "multiples of 1 + num_speculative_tokens")
    max_cudagraph_capture_size: Optional[Count] = Field(
        None, description="largest captured size; default (1 + num_speculative_tokens) * max(max_num_seqs, "
                          "min(2 * max_num_seqs, 512)), at most max_num_batched_tokens")
    precompile_token_paddings: Optional[Sizes] = Field(
        None, description="XLA token buckets of prefill/mixed steps; default powers of two to max_num_batched_tokens")
    precompile_bs_paddings: Optional[Sizes] = Field(
        None, description="XLA batch-size buckets of decode steps; default powers of two to max_num_seqs")
    disable_precompile: bool = Field(False, strict=True, description="XLA: compile lazily instead of before serving")
    enforce_eager: bool = Field(False, strict=True, description="never capture or compile graphs; run eagerly")
    strict: bool = Field(False, strict=True, description="after warm-up, a step without a graph raises CacheMissError")
    max_num_seqs: Count = Field(defaults.DEFAULT_MAX_NUM_SEQS, gt=0, description="requests per step")
    max_num_batched_tokens: Count = Field(defaults.DEFAULT_MAX_NUM_BATCHED_TOKENS, gt=0,
                                        description="tokens per step (the scheduler's budget)")
    max_model_len: Count = Field(defaults.DEFAULT_MAX_MODEL_LEN, gt=0, description="tokens per request")
    allow_long_max_model_len: bool = Field(
        False, strict=True, description="accept a max_model_len above the model's max_position_embeddings "
                                        "(vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN): positions past it are outside "
                                        "what the model was trained on")
    block_size: Count = Field(defaults.DEFAULT_BLOCK_SIZE, gt=0, description="tokens per KV block")
    kv_cache_dtype: str = Field(
        "auto", description="KV cache dtype (vLLM's kv_cache_dtype): auto (the model's KV cache spec, else the "
                            "weights' dtype), fp8 / fp8_e4m3 (float8_e4m3fn), fp8_e5m2, bfloat16, float16, float32; "
                            "fp8 stores value / scale, a per-tensor scale per layer (the checkpoint's k_scale / "
                            "v_scale, else 1.0)")
    compilation_cache_dir: Optional[str] = Field(
        None, description="XLA persistent compilation cache directory (reused across restarts)")
    disable_capture_plan: bool = Field(
        False, strict=True, description="with compilation_cache_dir: neither read nor save the capture plan (the "
                                        "keys, their order and observed demand, keyed by model, config and device) "
                                        "that lets a restart build in demand order")
    refit_interval: Count = Field(
        0, ge=0, description="re-fit the bucket sizes to the step sizes served every this many steps (exact fit "
                             "under the graph budget; new keys built in the background, unused ones retired); 0: off, "
                             f"else at least {defaults.MIN_REFIT_INTERVAL}")
    refit_max_buckets: Optional[Count] = Field(
        None, gt=0, description="graph budget of a re-fit: bucket sizes per family (decode batch sizes, token "
                                "sizes); default: as many as the starting policy has")
    check_baked_values: bool = Field(
        False, strict=True, description="torch graph backends: record each FULL key's forward under two steps it holds and "
                           "report host values the graph bakes in that differ (always on in strict mode, "
                           "where such a key fails its capture)")
    debug_check_addresses: bool = Field(
        False, strict=True, description="verify on every replay that inputs are read from the captured buffers")
    compile_model: bool = Field(
        False, strict=True, description="torch graph backends: torch.compile the pieces between attention calls "
                           "(static shapes, one compile per bucket) before capturing them")
    piecewise_capture: Literal["auto", "fx", "breakable"] = Field(
        "auto", description="how PIECEWISE graphs are captured: fx (split the traced model at attention), "
                            "breakable (capture the forward once, breaking at each attention call; no tracing), "
                            "or auto (fx when the model traces, else breakable)")
    collectives: Literal["captured", "eager"] = Field(
        "captured", description="tensor parallelism: collectives inside the captured graphs (captured), or run "
                                "eagerly between PIECEWISE pieces, capture stopping and resuming around each one "
                                "(eager: for fabrics whose collectives cannot be captured; no FULL graphs; torch "
                                "backends with the fx split; the xla backend refuses it)")
    context_buckets: Optional[Sizes] = Field(
        None, description="context buckets (tokens) of the keys whose attention reads each step's longest "
                          "context as a host value (graphrt's reference kernels; not Triton): a step runs under "
                          "the smallest bucket holding its longest request; default powers of two from 256 to "
                          "min(max_model_len, 512) on graph backends (longer steps run PIECEWISE), and up to "
                          "max_model_len by factors of 4 on XLA")
    compile_max_size: Count = Field(defaults.DEFAULT_COMPILE_MAX_SIZE, gt=0,
                                  description="largest bucket (tokens) compiled when compile_model is set")
    num_speculative_tokens: Count = Field(
        0, ge=0, description="draft tokens verified per request in a decode step (vLLM's num_speculative_tokens): "
                             "decode graphs hold 1 + k tokens per request")
    host_kernel: Optional[Literal["auto", "numba", "numpy"]] = Field(
        None, description="input preparation and padding: numba (compiled loops), numpy, or auto "
                          "(numba when it imports); unset: $GRAPHRT_HOST_KERNEL or auto")
    enable_lora: Optional[bool] = Field(
        None, strict=True, description="LoRA adapters (vLLM's enable_lora); alone it means max_loras=1; unset: on when "
                          "max_loras > 0")
    max_loras: Count = Field(defaults.DEFAULT_MAX_LORAS, ge=0,
                           description="LoRA adapter slots, the most distinct adapters in one step (vLLM's "
                                       "max_loras); 0: LoRA off. Keys get an adapter-count dimension: 0, 1, 2, 4, "
                                       "..., max_loras")
    max_lora_rank: Count = Field(defaults.DEFAULT_MAX_LORA_RANK, gt=0, le=defaults.MAX_LORA_RANK,
                               description="rank of every adapter slot (vLLM's max_lora_rank, at most vLLM's "
                                           "largest, 512); lower ranks are zero-padded")
    max_logprobs: Count = Field(defaults.DEFAULT_MAX_LOGPROBS, ge=0,
                              description="most top logprobs a request may ask for (vLLM's max_logprobs); the "
                                          "logprobs graphs compute this many per row; 0: logprobs off")
    enable_penalties: bool = Field(
        False, strict=True, description="build the penalised sampler graphs (repetition / presence / frequency "
                                        "penalties) at warm-up and keep their token counts from the start; off, a "
                                        "batch with penalties still samples (eagerly on torch backends, its "
                                        "counts made on first use)")
    model_impl: Literal["auto", "graphrt", "transformers"] = Field(
        "auto", description="which implementation runs a checkpoint directory (vLLM's model_impl): graphrt (its own "
                            "Llama / Mistral / Qwen3 decoder), transformers (the transformers model through graphrt's "
                            "paged attention; torch backends; pip install graphrt[transformers]), or auto (graphrt's "
                            "where it implements the checkpoint, else transformers)")
    trust_remote_code: bool = Field(
        False, strict=True, description="run a checkpoint's own Python code where its config.json's auto_map names "
                                        "some (vLLM's trust_remote_code; transformers backend); off, such a checkpoint "
                                        "is a ConfigError saying so -- never a question on stdin")
    tensor_parallel_size: Count = Field(
        defaults.DEFAULT_TENSOR_PARALLEL_SIZE, ge=1,
        description="ranks the model is sharded over (vLLM's tensor_parallel_size; docs/distributed.md): "
                    "torch backends start or join that many ranks, xla a mesh of that many devices (across "
                    "jax.distributed processes: process 0 leads, the others run follower.serve()); 1: unsharded")

    _check_sizes = field_validator("cudagraph_capture_sizes", "precompile_token_paddings",
                                   "precompile_bs_paddings", "context_buckets")(
        classmethod(lambda cls, v, info: _sizes(info.field_name, v)))

    @field_validator("refit_interval")
    @classmethod
    def _check_refit_interval(cls, value: int) -> int:
        """0 (off) or at least ``defaults.MIN_REFIT_INTERVAL``: a shorter window never re-fits."""
        if 0 < value < defaults.MIN_REFIT_INTERVAL:
            raise ValueError(f"must be 0 (off) or at least {defaults.MIN_REFIT_INTERVAL} steps "
                             f"(graphrt.core.defaults.MIN_REFIT_INTERVAL: each re-fit fits the buckets to the "
                             f"last interval's steps, and fewer are noise), got {value}")
        return value

    @field_validator("kv_cache_dtype")
    @classmethod
    def _check_kv_cache_dtype(cls, value: str) -> str:
        try:
            kv_cache_dtype_name(value)
        except ConfigError:
            raise ValueError(f"{value!r} is not one of {sorted(defaults.KV_CACHE_DTYPE_NAMES)}") from None
        return value

    @model_validator(mode="after")
    def _consistent(self) -> "GraphConfig":
        if self.max_num_seqs > self.max_num_batched_tokens:
            raise ValueError(f"max_num_seqs ({self.max_num_seqs}) exceeds max_num_batched_tokens "
                             f"({self.max_num_batched_tokens}): every request needs a token per step")
        if self.max_cudagraph_capture_size is not None and self.max_cudagraph_capture_size <= 0:
            raise ValueError(f"max_cudagraph_capture_size must be > 0, got {self.max_cudagraph_capture_size}")
        sizes, cap = self.cudagraph_capture_sizes, self.max_cudagraph_capture_size
        if sizes is not None and cap is not None and max(sizes) != cap:
            raise ValueError(f"max_cudagraph_capture_size ({cap}) must equal the largest of "
                             f"cudagraph_capture_sizes ({max(sizes)}); set one of them")
        if sizes is not None and max(sizes) > self.max_num_batched_tokens:
            raise ValueError(f"cudagraph_capture_sizes up to {max(sizes)} exceed max_num_batched_tokens "
                             f"({self.max_num_batched_tokens}): such graphs could never run")
        tok, top_tokens = self.precompile_token_paddings, covering_padding(self.precompile_token_paddings,
                                                                           self.max_num_batched_tokens)
        if top_tokens is None:
            raise ValueError(f"precompile_token_paddings end at {max(tok)} below max_num_batched_tokens "
                             f"({self.max_num_batched_tokens}): XLA has no eager escape, so every step "
                             f"the scheduler can form needs a bucket; add {self.max_num_batched_tokens}")
        if self.decode_query_len > self.max_num_batched_tokens:
            raise ValueError(f"num_speculative_tokens={self.num_speculative_tokens}: a decode step of one request "
                             f"verifies {self.decode_query_len} tokens, above max_num_batched_tokens "
                             f"({self.max_num_batched_tokens})")
        bs, max_reqs = self.precompile_bs_paddings, covering_padding(self.precompile_bs_paddings, self.max_num_seqs)
        if max_reqs is None:
            raise ValueError(f"precompile_bs_paddings end at {max(bs)} below max_num_seqs "
                             f"({self.max_num_seqs}); add {self.max_num_seqs}")
        _refuse_unusable("precompile_token_paddings", tok, top_tokens, "max_num_batched_tokens",
                         self.max_num_batched_tokens, "each is compiled at that many tokens")
        _refuse_unusable("precompile_bs_paddings", bs, max_reqs, "max_num_seqs", self.max_num_seqs,
                         "the largest is the batch size every mixed step is padded to")
        if self.enable_lora is not None and self.enable_lora != (self.max_loras > 0):
            raise ValueError(f"enable_lora={self.enable_lora} contradicts max_loras={self.max_loras}: "
                             "LoRA is on exactly when max_loras > 0")
        if self.max_loras > self.max_num_seqs:
            raise ValueError(f"max_loras ({self.max_loras}) exceeds max_num_seqs ({self.max_num_seqs}): "
                             "a step runs at most one adapter per request")
        return self

    @model_validator(mode="before")
    @classmethod
    def _lora_default(cls, data: Any) -> Any:
        """``enable_lora=True`` without ``max_loras`` means vLLM's default of one slot."""
        if isinstance(data, dict) and data.get("enable_lora") and data.get("max_loras") is None:
            data = {**data, "max_loras": defaults.DEFAULT_MAX_LORAS_WHEN_ENABLED}
        return data

    def check_model_len(self, model_len: int | None) -> None:
        """Refuse a ``max_model_len`` above the model's ``max_position_embeddings`` (None:
        unknown) unless ``allow_long_max_model_len``, as vLLM does; a default one is only logged."""
        if model_len is None or self.max_model_len <= model_len or self.allow_long_max_model_len:
            return
        if "max_model_len" not in self.model_fields_set:
            logger.info("graphrt: max_model_len defaults to %d, above the model's max_position_embeddings (%d); "
                        "set max_model_len", self.max_model_len, model_len)
            return
        raise ConfigError(f"max_model_len: {self.max_model_len} exceeds the model's max_position_embeddings "
                          f"({model_len}), positions it was never trained on; lower it, or set "
                          "allow_long_max_model_len=True (--allow-long-max-model-len) to run past it anyway")

    @property
    def lora_enabled(self) -> bool:
        """Whether steps may run LoRA adapters (``max_loras > 0``)."""
        return self.max_loras > 0

    @classmethod
    def create(cls, **kwargs: Any) -> "GraphConfig":
        """Like the constructor, but raises :class:`ConfigError` with pydantic's messages."""
        try:
            return cls(**kwargs)
        except ValidationError as e:
            raise ConfigError("; ".join(map(_describe, e.errors()))) from None

    @property
    def max_blocks_per_req(self) -> int:
        return blocks_for(self.max_model_len, self.block_size)

    @property
    def decode_query_len(self) -> int:
        """Tokens each request schedules in a uniform decode step: 1 + num_speculative_tokens."""
        return 1 + self.num_speculative_tokens

    @property
    def max_decode_batch(self) -> int:
        """The most requests one uniform decode step can hold within the token budget."""
        return min(self.max_num_seqs, self.max_num_batched_tokens // self.decode_query_len)

    def capture_policy(self) -> BucketPolicy:
        """Token buckets of graph backends (capture sizes).

        Unset: vLLM's sizes in requests times ``q = 1 + num_speculative_tokens`` (each a decode
        batch exactly), up to ``min(2 * max_num_seqs, 512)`` requests and never below
        ``max_num_seqs``, so the largest decode batch always has a FULL graph.
        ``max_cudagraph_capture_size`` alone sets the largest size in tokens."""
        if self.cudagraph_capture_sizes is not None:
            return BucketPolicy(self.cudagraph_capture_sizes)
        q, tokens = self.decode_query_len, self.max_num_batched_tokens
        cap = min(tokens, self.max_cudagraph_capture_size or self.default_capture_tokens)
        if cap < q:      # smaller than one decode request: no grid of multiples to keep
            return BucketPolicy.vllm_default(cap)
        return BucketPolicy([q * s for s in BucketPolicy.vllm_default(cap // q)] + [cap])

    @property
    def default_capture_tokens(self) -> int:
        """The largest default capture size before the token budget caps it: ``1 + k`` tokens
        times ``max(min(2 * max_num_seqs, 512), max_num_seqs)`` requests."""
        reqs = max(min(2 * self.max_num_seqs, defaults.VLLM_DEFAULT_MAX_CAPTURE_SIZE), self.max_num_seqs)
        return self.decode_query_len * reqs

    def context_policy(self, largest: int | None = None, growth: int = 2) -> BucketPolicy:
        """Context buckets: ``context_buckets`` as given (capped at ``max_model_len``, which is
        added unless ``largest`` is given), else ``DEFAULT_MIN_CONTEXT_BUCKET`` times powers of
        ``growth`` up to ``largest`` (default ``max_model_len``), always the last bucket."""
        top = self.max_model_len if largest is None else min(largest, self.max_model_len)
        if self.context_buckets is not None:
            sizes = [c for c in self.context_buckets if c <= top]
            return BucketPolicy(sizes + [top] if largest is None or not sizes else sizes)
        sizes, c = [], defaults.DEFAULT_MIN_CONTEXT_BUCKET
        while c < top:
            sizes.append(c)
            c *= growth
        return BucketPolicy(sizes + [top])

    def graph_dispatcher(self, mode: GraphMode | None = None, token_buckets: BucketPolicy | None = None,
                         keyed_context: bool = False) -> Dispatcher:
        """The dispatcher of graph backends (eager above the largest capture size) over
        ``token_buckets`` (default: capture sizes); with ``keyed_context`` every FULL key once per
        context bucket up to ``DEFAULT_MAX_GRAPH_CONTEXT``."""
        m = GraphMode.NONE if self.enforce_eager else (mode or self.mode)
        buckets = token_buckets if token_buckets is not None else self.capture_policy()
        contexts = self.context_policy(largest=defaults.DEFAULT_MAX_GRAPH_CONTEXT) if keyed_context else None
        return Dispatcher(m, token_buckets=None if m is GraphMode.NONE else buckets,
                          max_num_seqs=self.max_num_seqs, decode_query_len=self.decode_query_len,
                          max_loras=self.max_loras, context_buckets=contexts, max_context=self.max_model_len)


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add one ``--flag`` per :class:`GraphConfig` field (defaults left to the config)."""
    group = parser.add_argument_group("graphrt")
    for name, info in GraphConfig.model_fields.items():
        flag = "--" + name.replace("_", "-")
        ann = info.annotation
        base = typing.get_args(ann)[0] if typing.get_origin(ann) is typing.Union else ann
        while typing.get_origin(base) is Annotated:     # Count, Sizes: the type they annotate
            base = typing.get_args(base)[0]
        help_text = f"{info.description} (default: {info.default if info.default is not None else 'auto'})"
        if base is bool:
            group.add_argument(flag, dest=name, action="store_true", default=None, help=help_text)
        elif typing.get_origin(base) is list:
            group.add_argument(flag, dest=name, type=int, nargs="+", default=None, help=help_text)
        elif base is GraphMode:
            group.add_argument(flag, dest=name, choices=[m.value for m in GraphMode], default=None,
                               help=help_text)
        elif typing.get_origin(base) is Literal:
            group.add_argument(flag, dest=name, choices=list(typing.get_args(base)), default=None,
                               help=help_text)
        else:
            group.add_argument(flag, dest=name, type=base, default=None, help=help_text)
    return parser


def from_cli_args(args: argparse.Namespace, **overrides: Any) -> GraphConfig:
    """Build a validated config from parsed flags; flags not given keep the defaults."""
    values = {k: getattr(args, k) for k in GraphConfig.model_fields
              if getattr(args, k, None) is not None}
    values.update(overrides)
    return GraphConfig.create(**values)
