"""Every number graphrt chooses for you, in one place.

Fill values for padding, default bucket lists, limits. Change a value here and every
module that depends on it follows.
"""

from __future__ import annotations

#: Padding fill per field (see docs/padding.md). Attention backends may override the
#: table through ``Padder(fill_values=...)``.
PAD_FILL_VALUES: dict[str, int] = {
    "input_ids": 0,            # any valid id: finite activations
    "positions": 0,            # a valid rotary index
    "slot_mapping": -1,        # KV writes skip negative slots: a padded token writes no real slot
    "seq_lens": 0,             # a padded request attends to nothing
    "num_computed_tokens": 0,
    "block_table": 0,          # the null block, never handed to a request
    "state_slots": -1,         # recurrent states: a padded request reads and writes the trash slot
}
#: A padding fill that is not a value: the field's last real row is repeated.
PAD_REPEAT_LAST = "repeat_last"
#: query_start_loc is padded by repeating its last value (keeps it non-decreasing).
QUERY_START_LOC_FILL = PAD_REPEAT_LAST

#: Block 0 of every KV cache is reserved: it is the fill for unused block-table entries.
NULL_BLOCK = 0

#: vLLM caps the default largest capture size at this many tokens (times 1 + num_speculative_tokens
#: with speculative decoding: decode requests, not tokens); graphrt never caps it below max_num_seqs,
#: so the configured largest decode batch always has a FULL graph.
VLLM_DEFAULT_MAX_CAPTURE_SIZE = 512


#: Default serving limits (vLLM's flag names).
DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
DEFAULT_MAX_MODEL_LEN = 4096
#: Context buckets (the key's ``max_seq_len``) where the attention reads the context length as
#: a host value (graphrt's reference kernels): powers of two from this many tokens ...
DEFAULT_MIN_CONTEXT_BUCKET = 256
#: ... up to this many on graph backends (and max_model_len where it is smaller): a FULL graph
#: of the reference kernel holds its whole bucket's gather, so longer steps run PIECEWISE (their
#: attention eager, at its exact length), and the graphs do not grow with max_model_len.
DEFAULT_MAX_GRAPH_CONTEXT = 512
#: XLA has no eager path: its context buckets grow by this factor up to max_model_len, so a
#: step attends over at most this many times its longest request (and a few executables per key).
XLA_CONTEXT_BUCKET_GROWTH = 4
DEFAULT_BLOCK_SIZE = 16
#: Fraction of free device memory the KV cache may take when sized from a budget.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


#: Background warm-up (graphrt/background.py): after a step, the builder keeps building for this
#: long (at least one key) before the next step may run ...
BACKGROUND_SLICE_S = 0.05
#: ... and builds without waiting for a step once the runner has been idle this long (this long
#: before its first step: a request that comes right after the engine is built runs first).
BACKGROUND_IDLE_S = 0.05
BACKGROUND_START_IDLE_S = 1.0
#: How often the builder thread checks its tasks (traffic re-fits) once nothing is pending.
BACKGROUND_TASK_S = 0.25
DEFAULT_LLM_WARMUP = "upfront"

#: Traffic re-fit (graphrt/traffic.py): the step-size histogram of earlier windows is weighted
#: by this at each re-fit (0: only the last window counts) ...
TRAFFIC_DECAY = 0.5
#: ... a re-fit needs this many steps in its window, and installs the new buckets only when they
#: pad the window's steps by this fraction less than the current ones (no churn on noise).
TRAFFIC_MIN_STEPS = 32
TRAFFIC_MIN_GAIN = 0.05


#: KV cache budget on devices that cannot report free memory (the CPU backends). A KV size,
#: not a device budget: graph memory is deducted only from a given ``kv_cache_memory`` or
#: from the device's free memory.
DEFAULT_HOST_KV_CACHE_BYTES = 256 * 2**20
#: Graph memory in the KV budget (core/graph_memory.py): keys captured per family (the
#: largest, the smallest, evenly spaced between) before the KV cache is sized; the rest are
#: extrapolated along a line through them.
GRAPH_MEMORY_SAMPLES_PER_FAMILY = 3
#: ... and this fraction of the estimate is kept out of the KV cache on top of it, for what
#: the line misses (allocator fragmentation, a key that allocates more than its neighbours).
#: vLLM's misses ran both ways -- 3x over (#45178: a linear sum over a shared pool), 3.6x
#: under (#51590: per-mode deltas of one shared pool, two samples per mode); measuring the
#: samples in one warm-up-order span removes both causes, so the margin covers the residue
#: only; the runner logs estimate against actual after warm-up to check it.
GRAPH_MEMORY_MARGIN = 0.10

#: XLA backend: the smallest default token padding (the default paddings are powers of two
#: from here up to ``max_num_batched_tokens``; sglang-jax starts its token paddings at 16 too).
XLA_MIN_TOKEN_PADDING = 16
#: XLA backend: most threads compiling precompile buckets at once (one per CPU core up to
#: this; lowering stays on the caller's thread, XLA's compile releases the GIL). Measured on
#: 2 cores: 15 buckets in 10.1 s with one thread, 5.1 s with two (no gain while other jobs
#: kept the second core busy; see docs/benchmarks.md).
XLA_MAX_COMPILE_WORKERS = 8
#: Compiles at least this long are written to the persistent compilation cache; JAX's own
#: default (1 s) would skip every bucket of a small model.
XLA_PERSISTENT_CACHE_MIN_COMPILE_SECONDS = 0.0
#: Name of the XLA backend's tensor-parallel mesh axis.
XLA_TP_AXIS = "tp"
#: Environment variable choosing graphrt's attention kernel (torch: auto / reference / triton;
#: the JAX decoder: auto / reference / pallas).
ATTENTION_ENV = "GRAPHRT_ATTENTION"
#: The JAX decoder's choices under ``GRAPHRT_ATTENTION``.
XLA_ATTENTION_CHOICES = ("auto", "reference", "pallas")
#: The Pallas ragged paged attention kernel needs head_dim a multiple of the TPU lane width.
PALLAS_HEAD_DIM_MULTIPLE = 128
#: Activation dtypes the Pallas kernel accumulates from (it folds float32 / bfloat16 rows only).
PALLAS_Q_DTYPES = ("float32", "bfloat16")
#: Sampler rows with a temperature below this are greedy.
SAMPLER_MIN_TEMPERATURE = 1e-5
#: A padded sampler row (request rows past a step's real ones): greedy, no top-k / top-p
#: filter (its top_k is the vocabulary size). Its token is discarded.
SAMPLER_PAD_TEMPERATURE = 0.0
SAMPLER_PAD_TOP_P = 1.0
#: The random sampler finds each row's top-k threshold among its ``SAMPLER_TOP_K_CANDIDATES``
#: most likely tokens (``topk``, no sort of the vocabulary). A batch with a row whose top_k lies
#: between this and the vocabulary runs the exact wide-top-k sampler instead (a counting
#: threshold search; captured on demand, or eagerly where the backend can). 256: topk of 256
#: of 151,936 costs about as much as one pass over the row on a CPU.
SAMPLER_TOP_K_CANDIDATES = 256
#: The sampler's threshold search (top-p, wide top-k) over a row's probabilities: float32 bits
#: of values in [0, 1] fit in 30 bits, chosen ``SAMPLER_RADIX_BITS`` at a time (3 passes of a
#: 1024-bucket histogram on torch backends).
SAMPLER_RADIX_BITS = 10
SAMPLER_PROB_BITS = 30
#: Exponential noise is clamped to at least this before the race divides by it.
SAMPLER_MIN_NOISE = 1e-10
#: Seed of the XLA sampler's host generator that keys requests without their own seed
#: (None: fresh entropy per executor, like the torch device RNG).
XLA_SAMPLER_HOST_SEED: int | None = None

#: Torch graph backends: eager runs of a forward before it is captured (allocator warm-up,
#: lazy initialisation, cuBLAS workspaces); a compiled forward gets one more (it compiles).
CAPTURE_WARMUP_RUNS = 1
#: ``compile_model``: largest bucket (tokens) whose pieces are compiled before capture
#: (SGLang's default ``torch_compile_max_bs``); larger buckets are captured uncompiled.
DEFAULT_COMPILE_MAX_SIZE = 32
#: Ascend fused attention (``torch_npu.npu_fused_infer_attention_score``, models/torch/ascend_attention.py),
#: as torch_npu documents it: ``sparse_mode`` 3 is the bottom-right-aligned causal mask, passed as a
#: compressed upper-triangular ``[2048, 2048]`` bool mask; paged KV blocks of a multiple of 128 tokens,
#: at most 512; float16 / bfloat16 heads 16-aligned. Checked where the tensors are on an NPU.
ASCEND_FIA_SPARSE_MODE = 3
ASCEND_FIA_MASK_SIZE = 2048
ASCEND_FIA_BLOCK_MULTIPLE = 128
ASCEND_FIA_MAX_BLOCK_SIZE = 512
ASCEND_FIA_HEAD_DIM_MULTIPLE = 16

#: LoRA (vLLM's names): adapters resident at once, 0 = LoRA off; the rank of every adapter
#: slot (an adapter of a lower rank is zero-padded to it); ``enable_lora`` alone gives
#: vLLM's default of one adapter slot.
DEFAULT_MAX_LORAS = 0
DEFAULT_MAX_LORA_RANK = 16
#: The largest ``max_lora_rank`` (vLLM's largest supported rank): a rank beyond it is refused,
#: not allocated (``max_lora_rank=10**7`` was an out-of-memory kill).
MAX_LORA_RANK = 512
DEFAULT_MAX_LORAS_WHEN_ENABLED = 1
#: A request's or token's adapter slot when it runs without an adapter.
NO_LORA = -1
#: Fill of the adapter-group table past a step's active adapters: a slot no token holds.
LORA_GROUP_PAD = -2

#: Distinct (tokens, requests) shapes whose output views an InputPreparer keeps.
PREPARE_VIEW_MEMO_LIMIT = 1 << 12

#: The weights' dtype (``dtype=`` of graphrt.LLM, ModelRunner and the backends' load_model): the
#: names users write (vLLM's ``--dtype`` choices, torch's and numpy's spellings; case-insensitive)
#: and the dtype each means; "auto" is the checkpoint's ``torch_dtype``; unset, this default.
MODEL_DTYPE_NAMES: dict[str, str] = {"float32": "float32", "float": "float32", "fp32": "float32",
                                     "float16": "float16", "half": "float16", "fp16": "float16",
                                     "bfloat16": "bfloat16", "bf16": "bfloat16",
                                     "float64": "float64", "double": "float64", "fp64": "float64"}

#: ``graphrt.tolerance``: a step's real outputs at two padded sizes may differ by this many
#: eps of the accumulation dtype (float32; float64 for float64): another row count makes
#: the CPU GEMM / GPU BLAS pick another kernel, which sums the same products in another
#: order. Measured up to 14 eps (1.7e-6) on an AMD EPYC (MKL, every ATEN_CPU_CAPABILITY);
#: 64 eps is 7.6e-6, within the 1e-5 the tests allowed before this bound had one home.
TOLERANCE_ACCUMULATION_EPS = 64
#: ... or this many eps of a low-precision output dtype (bfloat16, float16), whichever is
#: larger: a reordered float32 sum can round to the neighbouring value of the output dtype,
#: once per op, and those one-eps flips carry through the layers.
TOLERANCE_ROUNDING_EPS = 4
#: ``graphrt.reduction_tolerance``: the reduced width ``TOLERANCE_ACCUMULATION_EPS`` was
#: calibrated on (the test models' hidden sizes); a wider reduction scales the bound by
#: sqrt(width / this), the growth of a reordered sum's rounding with its length.
TOLERANCE_CALIBRATION_WIDTH = 256


#: ``kv_cache_dtype`` (GraphConfig, graphrt.LLM, ``--kv-cache-dtype``): vLLM's spellings and the
#: KV-cache dtype each means; "auto" is the KV cache spec's own dtype, else the weights'. The fp8
#: formats store value / scale with a per-tensor scale per layer (1.0, or the checkpoint's).
KV_CACHE_DTYPE_NAMES: dict[str, str] = {**MODEL_DTYPE_NAMES,     # every spelling `dtype` takes ("bf16", ...)
                                        "auto": "auto", "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn",
                                        "fp8_e5m2": "float8_e5m2", "float8_e4m3fn": "float8_e4m3fn",
                                        "float8_e5m2": "float8_e5m2"}
#: A Qwen3 config.json without ``max_window_layers`` slides (with ``use_sliding_window``) the layers
#: from this one on: transformers' Qwen3Config default, read by models/hf_config.py.
QWEN3_MAX_WINDOW_LAYERS = 28

#: Sampling seeds are integers in [0, SAMPLING_SEED_LIMIT): 64 bits, the XLA sampler's whole
#: threefry2x32 key (two 32-bit halves), a CUDA Philox seed, and the key of the numpy Philox
#: generator the torch sampler draws a CPU request's noise from. No seed is truncated or wrapped.
SAMPLING_SEED_LIMIT = 2**64
#: Largest top_k: the XLA sampler holds top_k as int32. Any value at or above the vocabulary
#: keeps every token; a SamplingBatch stores -1 (disabled) as this value.
SAMPLING_MAX_TOP_K = 2**31 - 1
#: A SamplingBatch takes the min / max of its columns as Python lists (``tolist``, ``min``,
#: ``max``) up to this many rows, with two numpy reductions above: each numpy call costs about
#: 1 us whatever the size, the lists ~40 ns a value (measured on a 2-core x86 VM).
SAMPLING_CHECK_LIST_ROWS = 16
#: Penalty bounds (vLLM's): presence and frequency penalties in [-PENALTY_LIMIT, PENALTY_LIMIT].
SAMPLING_PENALTY_LIMIT = 2.0
#: Most top logprobs a request may ask for (``GraphConfig.max_logprobs``, vLLM's default 20): the
#: logprobs graphs compute this many top entries per row; 0 turns logprobs off (no such graphs).
DEFAULT_MAX_LOGPROBS = 20
#: Prompt logprobs are computed from the forward's hidden rows this many positions at a time
#: (a chunk's logits are ``rows x vocab`` floats: 256 x 152k is 156 MB).
PROMPT_LOGPROBS_CHUNK_ROWS = 256
#: Torch backends that dispatch asynchronously keep this many host copies of a step's sampled
#: outputs, so step n + 1's copy never overwrites step n's before the host has read it.
SAMPLED_OUTPUT_SLOTS = 2

#: graphrt.LLM logs a decode line every this many decode steps (SGLang's ``decode_log_interval``).
DEFAULT_DECODE_LOG_INTERVAL = 40
#: graphrt.LLM: the prefix cache (vLLM's ``enable_prefix_caching``) is on unless turned off.
DEFAULT_ENABLE_PREFIX_CACHING = True
#: graphrt.LLM: the order waiting requests are admitted in (SGLang's ``schedule_policy``).
DEFAULT_SCHEDULE_POLICY = "fcfs"
#: Admission's KV estimate (SGLang's ``schedule_conservativeness``): 0 admits a request while
#: the blocks of this step's chunk are free (running requests preempt the newest when short);
#: c > 0 also requires its remaining input plus c * min(max_tokens, clip) estimated output to
#: fit the free KV after every running request's own c-scaled estimate.
DEFAULT_SCHEDULE_CONSERVATIVENESS = 1.0
#: The output estimate of that budget is clipped at this many tokens (SGLang's
#: CLIP_MAX_NEW_TOKENS_ESTIMATION): a huge max_tokens must not make admission refuse everything.
CLIP_MAX_NEW_TOKENS_ESTIMATION = 4096
#: "lpm" sorts by prefix match only while at most this many requests wait (SGLang: the
#: matching costs a tree walk per request per step), and serves first-come-first-served above.
LPM_MAX_WAITING = 128
#: "lpm" in-batch prefix sharing (SGLang's thresholds, in tokens): a waiting request that
#: matches at most CHECK tokens of the cache but at least DEPRIORITIZE tokens of a request
#: ahead of it in the queue waits, so that it finds the prefix cached one step later.
IN_BATCH_PREFIX_CHECK_THRESHOLD = 32
IN_BATCH_PREFIX_DEPRIORITIZE_THRESHOLD = 32
#: Seed of the "random" schedule policy's generator (reproducible orders).
SCHEDULE_RANDOM_SEED = 0
#: graphrt.LLM's watchdog (SGLang's ``watchdog_timeout`` and its default, in seconds): a forward
#: (one ``runner.execute``) still running after this long fails its step with WatchdogTimeout,
#: after every thread's stack is logged. None or 0: no watchdog thread at all.
DEFAULT_WATCHDOG_TIMEOUT = 300.0
#: SGLang's ``disable_overlap_schedule``: False schedules step n + 1 while the device runs step n
#: on backends that dispatch asynchronously (xla); the others always run the plain loop.
DEFAULT_DISABLE_OVERLAP_SCHEDULE = False
#: What a firing watchdog does after logging: "raise" (the step fails; the engine refuses to
#: step until ``llm.watchdog.reset()``) or "kill" (SIGKILL its own process, as SGLang does).
DEFAULT_WATCHDOG_ACTION = "raise"
#: ``graphrt.LLM.close()`` waits this long for a step running on another thread to end (the
#: watchdog's and the tensor-parallel timeout: a step still running then is hung); past it, or
#: at once after the watchdog fired, it closes under the step, which then fails.
LLM_CLOSE_WAIT_S = 300.0

#: Tensor-parallel step channel (graphrt.backends.torch.parallel.tp_channel): data bytes of the shared-memory
#: segment (a 256-request step with a 512-column block table is about 0.6 MiB), arrays per
#: step, and how long rank 0 / a worker waits for the other side before calling it dead.
STEP_CHANNEL_BYTES = 8 << 20
STEP_CHANNEL_MAX_ARRAYS = 16
STEP_CHANNEL_TIMEOUT_S = 30.0
#: ... the most readers one channel takes: each costs a named semaphore (a file in /dev/shm and a
#: mapping of its own), and a channel's readers are one host's tensor-parallel workers -- far
#: fewer than this, which stays far below the semaphores and mappings a process may hold.
STEP_CHANNEL_MAX_READERS = 1024
#: ``StepChannel.receive(spin=...)``'s default: how long a reader polls for the next step
#: (``os.sched_yield`` between polls) before it sleeps on its semaphore. Polled, rank 0's post
#: is an atomic add; asleep, it is a system call plus an interrupt to the reader's core, and the
#: reader gets the step later (docs/benchmarks.md). A plain reader sleeps at once ...
STEP_CHANNEL_SPIN_S = 0.0
#: ... a tensor-parallel worker on an accelerator polls this long after each call: the forward
#: runs on the device, so its host core is idle between steps (vLLM's shared-memory readers poll
#: too). Workers on the CPU (``cpu``, ``eager``) use STEP_CHANNEL_SPIN_S: their forwards run on
#: the host's cores, which a polling worker would take from the other ranks.
TP_WORKER_SPIN_S = 0.05
#: Tensor-parallel workers driven by rank 0 (backends/torch/parallel/tensor_parallel.py). A worker that
#: dies is seen at once (its process sentinel, the collective's closed connection); one that
#: hangs is seen when a collective or a step-channel wait exceeds TP_TIMEOUT_S -- the process
#: group's timeout, long enough for the ranks to drift apart while each compiles a bucket.
TP_TIMEOUT_S = 300.0
#: ... seconds for every worker to start, load its shard and build its executor.
TP_WORKER_START_TIMEOUT_S = 600.0
#: ... close() waits this long for workers to exit after the shutdown call, then terminates,
#: then kills, waiting this long after each.
TP_WORKER_JOIN_TIMEOUT_S = 10.0
#: ... an idle worker checks that rank 0 is alive this often (seconds).
TP_WORKER_POLL_S = 1.0
#: ... while the process group forms, rank 0 checks for a rendezvous key this often (seconds),
#: and between checks whether a worker has exited: a dead worker fails start-up at once.
TP_RENDEZVOUS_POLL_S = 0.01
#: ... after a failed collective, how long rank 0 waits for a worker's exit to show before
#: calling the others hung.
TP_FAULT_GRACE_S = 1.0
#: ... how workers start: "forkserver" (Linux: torch is imported once, in the fork server, so
#: later engines' workers start in milliseconds) or "spawn" (where forkserver is missing).
TP_WORKER_START_METHOD = "forkserver"

#: Tensor parallelism of the torch backends (vLLM's ``tensor_parallel_size``): the ranks each
#: model is sharded over (models/torch/parallel.py); 1 runs the unsharded model and needs no
#: process group.
DEFAULT_TENSOR_PARALLEL_SIZE = 1

DP_WORKER_JOIN_TIMEOUT_S = 10.0
DP_POLL_INTERVAL_S = 0.1

#: Memory bounds checked before allocating (graphrt.core.memory_bounds): where shared-memory
#: segments live (a tmpfs), and the bytes assumed where the system cannot report its RAM.
SHARED_MEMORY_DIR = "/dev/shm"

#: FlashInfer attention (models/torch/flashinfer_attention.py): the float workspace its wrappers
#: share (FlashInfer's recommended 128 MiB), and the kernel backend asked for. "fa2": its
#: scheduler's CUDA-graph mode fixes the tile size and padded grid from a wrapper's tokens and
#: requests (include/flashinfer/attention/scheduler.cuh, PrefillSplitQOKVIndptr), which is what
#: replaying one graph under later plans relies on.
FLASHINFER_WORKSPACE_BYTES = 128 * 1024 * 1024
FLASHINFER_KERNEL_BACKEND = "fa2"
