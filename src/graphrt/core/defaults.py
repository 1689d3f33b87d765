"""The numbers graphrt chooses for you that a user can override or several modules share.

Fill values for padding, the flags' defaults, default bucket lists, limits. Change a value
here and every module that depends on it follows. A subsystem's own tuning constant (a poll
interval, a kernel's block multiple, a re-fit threshold) lives beside its only user instead,
named in capitals at the top of that module.
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

#: Blocks of the throwaway KV cache graph-memory samples are built against before the real cache
#: is sized (core/graph_memory.py): the null block and one (torch captures, XLA compiles).
SAMPLE_KV_BLOCKS = 2

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
#: Where a step's attention reads all of its cache tokens through one padded index
#: (transformers' continuous batching), its context buckets step by DEFAULT_MIN_CONTEXT_BUCKET
#: tokens this many times before they double: on a CPU padded cache tokens cost as much as real
#: ones (doubling alone left 36 % of them padding, docs/benchmarks.md), and the key set stays
#: logarithmic in the cache size beyond.
LINEAR_CONTEXT_BUCKETS = 32
DEFAULT_BLOCK_SIZE = 16
#: Fraction of free device memory the KV cache may take when sized from a budget.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


DEFAULT_LLM_WARMUP = "upfront"

#: The shortest ``refit_interval`` (steps) a traffic re-fit honours: each re-fit fits the bucket
#: sizes to the steps of its last interval (graphrt/traffic.py), and fewer steps than this are
#: noise, not traffic. GraphConfig refuses a shorter interval (0 turns re-fits off).
MIN_REFIT_INTERVAL = 32


#: KV cache budget on devices that cannot report free memory (the CPU backends). A KV size,
#: not a device budget: graph memory is deducted only from a given ``kv_cache_memory`` or
#: from the device's free memory.
DEFAULT_HOST_KV_CACHE_BYTES = 256 * 2**20

#: Environment variable choosing graphrt's attention kernel (torch: auto / reference / triton;
#: the JAX decoder: auto / reference / pallas).
ATTENTION_ENV = "GRAPHRT_ATTENTION"
#: Bytes of VMEM the Pallas ragged paged attention's double-buffered KV block may take: jax's
#: default block (128 pages x 16 tokens x 16 combined heads x 128 in bf16, twice: 16 MiB) does
#: not fit v5e's 16 MiB scoped VMEM (a compile error); graphrt halves the pages per block to fit.
PALLAS_KV_VMEM_BYTES = 8 << 20
#: Sampler rows with a temperature below this are greedy.
SAMPLER_MIN_TEMPERATURE = 1e-5
#: The random sampler finds each row's top-k threshold among its ``SAMPLER_TOP_K_CANDIDATES``
#: most likely tokens (``topk``, no sort of the vocabulary). A batch with a row whose top_k lies
#: between this and the vocabulary runs the exact wide-top-k sampler instead (a counting
#: threshold search; captured on demand, or eagerly where the backend can). 256: topk of 256
#: of 151,936 costs about as much as one pass over the row on a CPU.
SAMPLER_TOP_K_CANDIDATES = 256
SAMPLER_PROB_BITS = 30
#: Exponential noise is clamped to at least this before the race divides by it.
SAMPLER_MIN_NOISE = 1e-10

#: Torch graph backends: eager runs of a forward before it is captured (allocator warm-up,
#: lazy initialisation, cuBLAS workspaces); a compiled forward gets one more (it compiles).
CAPTURE_WARMUP_RUNS = 1
#: ``compile_model``: largest bucket (tokens) whose pieces are compiled before capture
#: (SGLang's default ``torch_compile_max_bs``); larger buckets are captured uncompiled.
DEFAULT_COMPILE_MAX_SIZE = 32

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


#: ``kv_cache_dtype`` (GraphConfig, graphrt.LLM, ``--kv-cache-dtype``): vLLM's spellings and the
#: KV-cache dtype each means; "auto" is the KV cache spec's own dtype, else the weights'. The fp8
#: formats store value / scale with a per-tensor scale per layer (1.0, or the checkpoint's).
KV_CACHE_DTYPE_NAMES: dict[str, str] = {**MODEL_DTYPE_NAMES,     # every spelling `dtype` takes ("bf16", ...)
                                        "auto": "auto", "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn",
                                        "fp8_e5m2": "float8_e5m2", "float8_e4m3fn": "float8_e4m3fn",
                                        "float8_e5m2": "float8_e5m2"}

#: Most top logprobs a request may ask for (``GraphConfig.max_logprobs``, vLLM's default 20): the
#: logprobs graphs compute this many top entries per row; 0 turns logprobs off (no such graphs).
DEFAULT_MAX_LOGPROBS = 20
#: Prompt logprobs are computed from the forward's hidden rows this many positions at a time
#: (a chunk's logits are ``rows x vocab`` floats: 256 x 152k is 156 MB).
PROMPT_LOGPROBS_CHUNK_ROWS = 256

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

#: Tensor-parallel step channel (graphrt.backends.torch.parallel.tp_channel): data bytes of the shared-memory
#: segment (a 256-request step with a 512-column block table is about 0.6 MiB), arrays per
#: step, and how long rank 0 / a worker waits for the other side before calling it dead.
STEP_CHANNEL_BYTES = 8 << 20
STEP_CHANNEL_MAX_ARRAYS = 16
#: ... how long rank 0 waits for a reader's start-up handshake (``StepChannel.wait_ready``: the
#: reader attached, after its process started and imported what it needs -- torch, tens of
#: seconds on a loaded machine). Generous: a reader process that dies meanwhile is named at
#: once (its liveness is polled); only a live reader that never attaches waits this out. The
#: per-step timeout starts after the handshake and covers reading a step only.
STEP_CHANNEL_START_TIMEOUT_S = 300.0
#: ... and how often it checks the handshake and the readers' processes meanwhile (seconds).
STEP_CHANNEL_START_POLL_S = 0.01
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

#: Tensor parallelism of the torch backends (vLLM's ``tensor_parallel_size``): the ranks each
#: model is sharded over (models/torch/parallel.py); 1 runs the unsharded model and needs no
#: process group.
DEFAULT_TENSOR_PARALLEL_SIZE = 1


#: Memory bounds checked before allocating (graphrt.core.memory_bounds): where shared-memory
#: segments live (a tmpfs), and the bytes assumed where the system cannot report its RAM.
SHARED_MEMORY_DIR = "/dev/shm"


#: graphrt.engine.launch: the rendezvous port when the launcher names none (torchrun's default).
LAUNCH_MASTER_PORT = 29500

#: Ranks of a tensor-parallel group launched outside graphrt (torchrun, graphrt.engine.launch) each
#: bump a counter in the job's store this often (seconds), so that after a failed collective
#: the survivors can name the rank that is gone (backends/torch/parallel/tp_liveness.py) ...
RANK_HEARTBEAT_S = 1.0
#: ... for this long after a failed collective they watch the counters: a rank whose counter
#: did not move is named lost (RankLostError). A killed process fails the collective at once
#: (its connections close), so the error comes within about this bound; a node that goes
#: silent without closing its connections is seen at the process group's timeout (TP_TIMEOUT_S).
RANK_LOST_NAMING_S = 3.0

#: Multi-controller XLA led by process 0 (backends/xla/lockstep.py): a follower waits for the
#: next call in slices of this many seconds (between them it notices process 0's coordination
#: service gone) ...
XLA_LOCKSTEP_POLL_S = 1.0
#: ... process 0 deletes the calls every follower has read once per this many calls ...
XLA_LOCKSTEP_GC_EVERY = 64
#: ... and each side keeps the device results (logits, sampled tokens) of this many recent
#: calls, the ones later calls may take as arguments.
XLA_LOCKSTEP_RESULTS_KEPT = 4
#: A follower's ``serve()`` waits this long for process 0's engine (its setup) before it fails.
XLA_LOCKSTEP_SETUP_TIMEOUT_S = 600.0
#: ``llm.close()`` on process 0 waits this long for every follower to read the close.
XLA_LOCKSTEP_CLOSE_WAIT_S = 30.0
