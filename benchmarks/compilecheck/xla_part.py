"""The XLA part: graphrt's XLA programs of a representative configuration compiled for TPU v5e
and v6e with no TPU (``libtpu``'s compiler on deviceless topologies,
``jax.experimental.topologies.get_topology_desc``), each executable's ``memory_analysis()``
asserted (:mod:`compilecheck.xla_checks`).

The programs are graphrt's own: :class:`~graphrt.backends.xla.programs.XlaPrograms` built on the
topology's devices with abstract weights, and each key's jitted function and arguments from
:func:`~graphrt.backends.xla.abstract_inputs.abstract_inputs`, as warm-up lowers them. Compiled:
the decode and mixed forwards of a Qwen3-shaped decoder (reference and Pallas attention, and
Pallas again at ``block_size=128``), its greedy and random samplers, a Granite-4-H hybrid
model's forwards (KV cache and Mamba2 state donated together), and the decoder's forwards with
tensor parallelism over two chips of a ``v5e:2x2`` slice -- every forward at two cache sizes.

``python -m compilecheck.xla_part --json OUT [--plant]``; exits 1 when a program fails to
compile or breaks an assertion.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import json
import multiprocessing
import os
import sys
import time
from typing import Any, Iterator, Sequence

from compilecheck import xla_checks

#: The single-chip topologies and the tensor-parallel one (two of its four chips).
CHIPS = {"v5e": "v5e:1x1", "v6e": "v6e:1x1"}
TP_TOPOLOGY, TP_SIZE = "v5e:2x2", 2
#: A Qwen3-0.6B-shaped decoder (its attention and MLP widths), 4 layers (the layers are one
#: ``lax.scan``: compile time and temp bytes do not grow with their count), a 32K vocabulary.
DECODER = dict(architectures=["Qwen3ForCausalLM"], vocab_size=32768, hidden_size=1024, intermediate_size=3072,
               num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
               rope_theta=1e6, max_position_embeddings=40960, tie_word_embeddings=True, torch_dtype="bfloat16",
               eos_token_id=1)
#: A Granite-4-H-shaped hybrid: graphrt's testing kit's random Granite-4-H checkpoint
#: (``graphrt.testing.state_sweep.hybrid_checkpoint``) with these transformers config overrides --
#: Mamba2 layers (state 128) and an attention layer, shared MLP and experts -- loaded by
#: ``XlaBackend.load_model``, its weights then made abstract (bfloat16).
HYBRID = dict(vocab_size=8192, hidden_size=512, intermediate_size=256, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=4, layer_types=["mamba", "attention", "mamba", "mamba"], mamba_n_heads=16,
              mamba_d_state=128, mamba_n_groups=1, mamba_chunk_size=256, shared_intermediate_size=512,
              max_position_embeddings=4096)
#: The engine limits of the configuration (graphrt's own bucket grid is built from them).
GRAPH = dict(max_num_seqs=16, max_num_batched_tokens=256, max_model_len=2048, block_size=16)
#: The smaller cache size (blocks); each forward is also compiled at ``CACHE_GROWTH`` times it.
NUM_BLOCKS = 256


def groups(plant: bool = False) -> list[dict[str, Any]]:
    """The compile groups (one XlaPrograms each), largest first."""
    out = []
    for chip, topo in CHIPS.items():
        out += [dict(chip=chip, topology=topo, tp=1, config="decoder", attention="reference", role="forward"),
                dict(chip=chip, topology=topo, tp=1, config="decoder", attention="pallas", role="forward"),
                dict(chip=chip, topology=topo, tp=1, config="decoder", attention="pallas", role="forward",
                     block_size=128),
                dict(chip=chip, topology=topo, tp=1, config="hybrid", attention="auto", role="forward"),
                dict(chip=chip, topology=topo, tp=1, config="decoder", attention="reference", role="sampler")]
    out.append(dict(chip=f"v5e tp{TP_SIZE}", topology=TP_TOPOLOGY, tp=TP_SIZE, config="decoder",
                    attention="reference", role="forward"))
    if plant:
        out.append(dict(chip="v5e", topology=CHIPS["v5e"], tp=1, config="decoder", attention="reference",
                        role="forward", plant="no-donation", programs=("decode",), sizes=1))
    return out


def topology(name: str) -> Any:
    """A deviceless TPU topology (one host of ``name``'s chips)."""
    from jax.experimental import topologies

    kwargs = {"chips_per_host_bounds": (1, 1, 1)} if name.endswith(":1x1") else {}
    return topologies.get_topology_desc(platform="tpu", topology_name=name, **kwargs)


@contextlib.contextmanager
def tpu_lookups(device: Any) -> Iterator[None]:
    """Lowering for ``device`` (a compile-only TPU) in a process whose default backend is the
    CPU: JAX's Pallas TPU lowering reads the chip from the default device, and the ragged paged
    attention's tuned block sizes from ``jax.devices()[0]``; both are pointed at ``device`` (the
    block-size table is the one a real chip of that kind reads)."""
    import jax
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import tuned_block_sizes as tbs

    kind = device.device_kind                      # "TPU v5 lite", "TPU v6 lite"
    saved = tbs.get_tpu_version, tbs.get_device_name
    tbs.get_tpu_version = lambda: int(kind.removesuffix(" lite")[-1])
    tbs.get_device_name = lambda num_devices=None: " ".join(kind.split()[:2]) + (
        f"-{num_devices}" if num_devices is not None else "")
    try:
        with jax.default_device(device):
            yield
    finally:
        tbs.get_tpu_version, tbs.get_device_name = saved


@contextlib.contextmanager
def no_donation() -> Iterator[None]:
    """The planted regression: programs jitted without ``donate_argnums`` (the forward then
    copies its KV cache every step instead of updating it in place)."""
    import jax

    real = jax.jit

    def jit(fn: Any, **kwargs: Any) -> Any:
        kwargs.pop("donate_argnums", None)
        return real(fn, **kwargs)
    jax.jit = jit
    try:
        yield
    finally:
        jax.jit = real


def build_model(name: str) -> Any:
    """The configuration's :class:`XlaModel`, weights abstract (as ``XlaBackend.load_model``
    wraps a checkpoint's)."""
    import jax
    import jax.numpy as jnp

    from graphrt.backends.xla.backend import XlaBackend
    from graphrt.backends.xla.programs import XlaModel
    from graphrt.models.hf_config import DecoderConfig
    from graphrt.models.jax.loader import abstract_params
    from graphrt.testing.state_sweep import hybrid_checkpoint

    if name == "decoder":
        cfg = DecoderConfig.from_dict(DECODER)
        return XlaModel(cfg, abstract_params(cfg, jnp.bfloat16))
    model = XlaBackend().load_model(str(hybrid_checkpoint("granite", **HYBRID)), jnp.bfloat16)
    weights = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), model.params)
    return dataclasses.replace(model, params=weights)


def keys(buckets: Any) -> dict[str, Any]:
    """The largest decode and mixed keys of graphrt's grid, at its largest context bucket."""
    from graphrt.core.dispatch import BatchDescriptor

    ctx = buckets.contexts.max_size
    r = buckets.max_reqs
    return {"decode": BatchDescriptor(r * buckets.decode_query_len, r, True, max_seq_len=ctx),
            "mixed": BatchDescriptor(buckets.tokens.max_size, r, False, max_seq_len=ctx)}


def _nbytes(shape: Sequence[int], dtype: Any) -> int:
    import numpy as np

    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


def compile_one(jitted: Any, args: tuple[Any, ...]) -> dict[str, Any]:
    """Lower and compile; memory figures, the optimised HLO's text and the seconds taken."""
    t0 = time.perf_counter()
    lowered = jitted.lower(*args)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    m = compiled.memory_analysis()
    return {"lower_seconds": round(t1 - t0, 2), "compile_seconds": round(t2 - t1, 2),
            "alias_bytes": int(m.alias_size_in_bytes), "temp_bytes": int(m.temp_size_in_bytes),
            "argument_bytes": int(m.argument_size_in_bytes), "output_bytes": int(m.output_size_in_bytes),
            "code_bytes": int(m.generated_code_size_in_bytes), "hlo": compiled.as_text()}


def run_group(group: dict[str, Any]) -> list[dict[str, Any]]:
    """Build one XlaPrograms on the group's topology and compile its programs (worker process)."""
    os.environ["GRAPHRT_ATTENTION"] = group["attention"]
    import jax

    from graphrt.backends.xla import sharding as shd
    from graphrt.backends.xla.abstract_inputs import abstract_inputs
    from graphrt.backends.xla.buckets import XlaBuckets
    from graphrt.backends.xla.programs import XlaPrograms
    from graphrt.config import GraphConfig
    from graphrt.core.dispatch import SamplerKey
    from graphrt.core.graph_modes import RuntimeMode
    from graphrt.core.kv_spec import blocks_for

    base = {k: group[k] for k in ("chip", "config", "role")}
    base["kernel"] = "sampler" if group["role"] == "sampler" else group["attention"]
    if group.get("block_size"):
        base["config"] += f" block_size={group['block_size']}"
    if group.get("plant"):
        base["config"] += f" (PLANTED {group['plant']})"
    base["planted"] = bool(group.get("plant"))
    records = []
    try:
        devices = topology(group["topology"]).devices
        config = GraphConfig.create(**dict(GRAPH, block_size=group.get("block_size", GRAPH["block_size"])))
        buckets = XlaBuckets.from_config(config)
        model = build_model(group["config"])
        with tpu_lookups(devices[0]):
            with no_donation() if group.get("plant") else contextlib.nullcontext():
                programs = XlaPrograms(model, config.block_size, shd.make_mesh(group["tp"], devices),
                                       config.decode_query_len, max_reqs=buckets.max_reqs, config=config)
            if group["role"] == "sampler":
                for name, key in (("greedy", SamplerKey(buckets.max_reqs, True)),
                                  ("random", SamplerKey(buckets.max_reqs, False))):
                    jitted, _, args = abstract_inputs(programs, RuntimeMode.FULL, key, None, [], None, None)
                    rec = dict(base, program=name, num_reqs=key.num_reqs)
                    rec.update(_safe(compile_one, jitted, args))
                    rec.pop("hlo", None)
                    records.append(rec)
                    _say(rec)
                return records
            if base["kernel"] != "auto" and programs.attention.kernel != base["kernel"]:
                raise RuntimeError(f"GRAPHRT_ATTENTION={base['kernel']} gave {programs.attention.kernel}: "
                                   f"{programs.attention.reason}")
            base["kernel"] = programs.attention.kernel
            c = programs.model_config
            sharded = shd.kv_heads_sharded(c, programs.tp_size)
            kv_heads = c.num_key_value_heads // programs.tp_size if sharded else c.num_key_value_heads
            states = [jax.ShapeDtypeStruct(s, d) for s, d in programs.state_shapes()]
            state_bytes = sum(_nbytes(s.shape, s.dtype) for s in states)
            sizes = [NUM_BLOCKS * xla_checks.CACHE_GROWTH ** i for i in range(group.get("sizes", 2))]
            for num_blocks in sizes:
                shape = programs.kv_shape(num_blocks, config.block_size)
                kv = jax.ShapeDtypeStruct(shape, programs.kv_dtype)
                local = list(shape)
                if sharded:
                    local[3] //= programs.tp_size
                for name, key in keys(buckets).items():
                    if name not in group.get("programs", ("decode", "mixed")):
                        continue
                    width = min(config.max_blocks_per_req, max(blocks_for(key.max_seq_len, config.block_size), 1))
                    rec = dict(base, program=name, num_blocks=num_blocks, num_tokens=key.num_tokens,
                               num_reqs=key.num_reqs, context=width * config.block_size, kv_heads=kv_heads,
                               head_dim=c.head_dim, kv_bytes=_nbytes(local, programs.kv_dtype),
                               state_bytes=state_bytes, cache_bytes=_nbytes(local, programs.kv_dtype) + state_bytes)
                    jitted, _, args = abstract_inputs(programs, RuntimeMode.FULL, key, kv, states,
                                                      programs.extra_inputs, lambda _k, w=width: w)
                    rec.update(_safe(compile_one, jitted, args))
                    rec["copies"] = xla_checks.cache_copies(rec.pop("hlo", ""), [local] + [s.shape for s in states])
                    records.append(rec)
                    _say(rec)
    except Exception as exc:  # noqa: BLE001 - a group that cannot be built is its result
        records.append(dict(base, program="(build)", error=f"{type(exc).__name__}: {str(exc)[:1500]}"))
        _say(records[-1])
    return records


def _safe(fn: Any, *args: Any) -> dict[str, Any]:
    """``fn(*args)``, or its error (the TPU compiler's RESOURCE_EXHAUSTED, say) as a record field."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {str(exc).strip()[:1500]}"}


def _say(rec: dict[str, Any]) -> None:
    what = (f"error: {rec['error'][:200]}" if rec.get("error") else
            f"temp {rec['temp_bytes'] / xla_checks.MiB:.1f} MiB, alias {rec['alias_bytes'] / xla_checks.MiB:.1f} MiB, "
            f"compile {rec['compile_seconds']} s")
    print(f"xla {rec['chip']} {rec['config']} {rec['kernel']} {rec['program']} "
          f"{rec.get('num_blocks', '')}: {what}", flush=True)


def _init_worker() -> None:
    # libtpu holds /tmp/libtpu_lockfile for its process unless told that several may load it
    # (these only compile: no chip is shared); quiet its complaints about the host it is not on.
    os.environ["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="compilecheck.xla_part", description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--plant", action="store_true", help="add the planted no-donation program (must FAIL)")
    parser.add_argument("--only-planted", action="store_true")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    todo = groups(plant=args.plant or args.only_planted)
    if args.only_planted:
        todo = [g for g in todo if g.get("plant")]
    problem = libtpu_problem()
    if problem:
        data = {"skipped": problem, "records": [], "seconds": 0.0}
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)
        print(f"xla: skipped: {problem}")
        return 1
    print(f"xla: {len(todo)} program groups on {args.workers} processes", flush=True)
    records: list[dict[str, Any]] = []
    with concurrent.futures.ProcessPoolExecutor(args.workers, mp_context=multiprocessing.get_context("spawn"),
                                                initializer=_init_worker) as pool:
        for recs in pool.map(run_group, todo):
            records += recs
    records = xla_checks.judge(records)
    import jax
    import libtpu  # noqa: F401 - its version, for the report

    from importlib.metadata import version

    data = {"jax": jax.__version__, "libtpu": version("libtpu"), "seconds": round(time.perf_counter() - t0, 1),
            "workers": args.workers, "configuration": {"decoder": DECODER, "hybrid (granite overrides)": HYBRID, "graph": GRAPH,
                                                       "num_blocks": NUM_BLOCKS, "growth": xla_checks.CACHE_GROWTH},
            "bounds": {"temp_growth_fraction": xla_checks.TEMP_GROWTH_FRACTION,
                       "pallas_temp_bound": xla_checks.PALLAS_TEMP_BOUND,
                       "reference_factor": xla_checks.REFERENCE_FACTOR, "temp_slack": xla_checks.TEMP_SLACK},
            "records": records}
    with open(args.json, "w") as f:
        json.dump(data, f, indent=1)
    failed = [r for r in records if not r["ok"]]
    for r in failed:
        print(f"xla FAIL {r['chip']} {r['config']} {r['kernel']} {r['program']} {r.get('num_blocks', '')}: "
              f"{'; '.join(r['problems'])[:400]}")
    print(f"xla: {len(records)} programs compiled, {len(failed)} failed, in {data['seconds']} s")
    return 1 if failed else 0


def libtpu_problem() -> str | None:
    """Why deviceless TPU compiles cannot run here (None: they can)."""
    try:
        import libtpu  # noqa: F401
    except ImportError as exc:
        return f"libtpu does not import ({exc}); `make compile-check` installs it into .venv-compile"
    return None


if __name__ == "__main__":
    sys.exit(main())
