"""The export part: graphrt's XLA programs exported with ``jax.export`` for ``cpu``, ``cuda`` and
``tpu`` at once, serialized, deserialized and run on this CPU, their outputs equal to the jitted
program's on the same inputs (the same XLA:CPU kernels: bitwise).

Programs: the decode and mixed forwards of a tiny Qwen3 and a tiny Granite-4-H hybrid (graphrt's
testing kit's random checkpoints, loaded by ``XlaBackend.load_model``), and the greedy and random
samplers. An exported program's arguments are pytrees; graphrt's step inputs (``XlaBatch``,
``SamplingMetadata``) must be registered for export serialization: :func:`ensure_serializable`
uses graphrt's registration where it has one and registers them here otherwise (saying which).

``python -m compilecheck.export_part --json OUT``; exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Sequence

PLATFORMS = ("cpu", "cuda", "tpu")
GRAPH = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, block_size=4)
NUM_BLOCKS = 32


def ensure_serializable() -> str:
    """Register graphrt's pytree step inputs for ``jax.export`` serialization unless graphrt
    already did; says who registered them."""
    import jax
    from jax._src.export import _export

    from graphrt.backends.xla.batch import SamplingMetadata, XlaBatch

    missing = [c for c in (XlaBatch, SamplingMetadata) if c not in _export.serialization_registry]
    for cls in missing:
        jax.export.register_pytree_node_serialization(
            cls, serialized_name=f"graphrt.{cls.__name__}",
            serialize_auxdata=lambda aux: json.dumps(list(aux)).encode(),
            deserialize_auxdata=lambda data: tuple(json.loads(data)))
    if not missing:
        return "graphrt registers its step inputs for export serialization"
    return (f"graphrt registers none of {[c.__name__ for c in missing]} for export serialization; "
            "compile-check registered them itself (benchmarks/compilecheck/export_part.py)")


def _step(num_tokens: int, num_reqs: int, uniform: bool, width: int, block_size: int, rng: Any) -> Any:
    """A real padded step: requests of random lengths, their tokens' slots in distinct blocks."""
    import numpy as np

    from graphrt.backends.xla.batch import XlaBatch

    if uniform:
        lens = np.ones(num_reqs, np.int32)
    else:
        cuts = np.sort(rng.choice(np.arange(1, num_tokens), num_reqs - 1, replace=False))
        lens = np.diff(np.concatenate([[0], cuts, [num_tokens]])).astype(np.int32)
    ctx = lens + (rng.integers(0, 8, num_reqs) if uniform else 0)
    qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    table = (1 + np.arange(num_reqs * width, dtype=np.int32)).reshape(num_reqs, width)
    pos = np.concatenate([np.arange(c - n, c) for n, c in zip(lens, ctx)]).astype(np.int32)
    req = np.repeat(np.arange(num_reqs), lens)
    slots = (table[req, pos // block_size] * block_size + pos % block_size).astype(np.int32)
    ids = rng.integers(0, 100, num_tokens).astype(np.int32)
    return XlaBatch(ids, pos, slots, qsl, ctx.astype(np.int32), np.arange(num_reqs, dtype=np.int32), table,
                    num_tokens, num_reqs, uniform)


def check(name: str, jitted: Any, abstract: tuple[Any, ...], concrete: Any) -> dict[str, Any]:
    """Export ``jitted`` for every platform, round-trip it through bytes, run it on CPU and
    compare with ``jitted`` on the same inputs (``concrete()`` makes a fresh set: the forward
    donates its cache)."""
    import jax
    import numpy as np

    rec: dict[str, Any] = {"program": name, "platforms": list(PLATFORMS)}
    t0 = time.perf_counter()
    try:
        exported = jax.export.export(jitted, platforms=PLATFORMS)(*abstract)
        blob = exported.serialize()
        back = jax.export.deserialize(blob)
        got = jax.tree_util.tree_leaves(back.call(*concrete()))
        want = jax.tree_util.tree_leaves(jitted(*concrete()))
        rec.update(bytes=len(blob), outputs=len(got))
        diff = [i for i, (a, b) in enumerate(zip(got, want)) if not np.array_equal(np.asarray(a), np.asarray(b))]
        if len(got) != len(want) or diff:
            rec["error"] = f"the reloaded program's outputs {diff} differ from the jitted program's"
    except Exception as exc:  # noqa: BLE001
        rec["error"] = f"{type(exc).__name__}: {str(exc).strip()[:1200]}"
    rec["seconds"] = round(time.perf_counter() - t0, 2)
    rec["ok"] = "error" not in rec
    return rec


def run() -> tuple[list[dict[str, Any]], str]:
    import jax
    import numpy as np

    from graphrt.backends.xla import sharding as shd
    from graphrt.backends.xla.abstract_inputs import abstract_inputs
    from graphrt.backends.xla.backend import XlaBackend
    from graphrt.backends.xla.buckets import XlaBuckets
    from graphrt.backends.xla.programs import XlaPrograms
    from graphrt.config import GraphConfig
    from graphrt.core.dispatch import BatchDescriptor, SamplerKey
    from graphrt.core.graph_modes import RuntimeMode
    from graphrt.testing.state_sweep import hybrid_checkpoint
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))     # the zoo: a developer tool
    from transformers_zoo import tiny_checkpoint

    who = ensure_serializable()
    config = GraphConfig.create(**GRAPH)
    buckets = XlaBuckets.from_config(config)
    rng = np.random.default_rng(0)
    records = []
    models = {"qwen3": tiny_checkpoint("qwen3"), "granite hybrid": hybrid_checkpoint("granite")}
    for label, path in models.items():
        model = XlaBackend().load_model(str(path))
        programs = XlaPrograms(model, config.block_size, shd.make_mesh(1), config.decode_query_len,
                               max_reqs=buckets.max_reqs, config=config)
        shape = programs.kv_shape(NUM_BLOCKS, config.block_size)
        kv = jax.ShapeDtypeStruct(shape, programs.kv_dtype)
        states = [jax.ShapeDtypeStruct(s, d) for s, d in programs.state_shapes()]
        width = config.max_blocks_per_req
        for name, key in (("decode", BatchDescriptor(buckets.max_reqs, buckets.max_reqs, True, max_seq_len=64)),
                          ("mixed", BatchDescriptor(buckets.tokens.max_size, buckets.max_reqs, False, max_seq_len=64))):
            jitted, spec, args = abstract_inputs(programs, RuntimeMode.FULL, key, kv, states, programs.extra_inputs,
                                                 lambda _k: width)
            batch = _step(key.num_tokens, key.num_reqs, key.uniform_decode, width, config.block_size, rng)
            cache_values = rng.normal(0, 1, shape).astype(np.dtype(programs.kv_dtype))
            state_values = [rng.normal(0, 0.1, s.shape).astype(np.dtype(s.dtype)) for s in states]

            def concrete(batch: Any = batch, cache_values: Any = cache_values, state_values: Any = state_values,
                         n: int = key.num_reqs) -> tuple[Any, ...]:
                kv_now = jax.numpy.asarray(cache_values)
                cache = (kv_now, tuple(jax.numpy.asarray(s) for s in state_values)) if state_values else kv_now
                return (programs.weights, cache, batch, np.zeros(programs.max_reqs, np.int32),
                        np.full(n, -1, np.int32))
            records.append(check(f"{label} {name} forward", jitted, args, concrete))
        if label != "qwen3":
            continue
        logits = rng.normal(0, 3, (buckets.max_reqs, int(programs.model_config.vocab_size))).astype(np.float32)
        for greedy in (True, False):
            key = SamplerKey(buckets.max_reqs, greedy)
            jitted, _, args = abstract_inputs(programs, RuntimeMode.FULL, key, None, [], None, None)
            if greedy:
                concrete = lambda: (logits,)  # noqa: E731
            else:
                meta = _sampling_metadata(buckets.max_reqs, rng)
                concrete = lambda meta=meta: (logits, meta)  # noqa: E731
            records.append(check(f"qwen3 {'greedy' if greedy else 'random'} sampler", jitted, args, concrete))
    return records, who


def _sampling_metadata(num_reqs: int, rng: Any) -> Any:
    """The random sampler's inputs for ``num_reqs`` seeded rows with temperature, top-k and top-p."""
    import numpy as np

    from graphrt.backends.xla.batch import SamplingMetadata

    return SamplingMetadata(np.full(num_reqs, 0.8, np.float32), np.full(num_reqs, 20, np.int32),
                            np.full(num_reqs, 0.9, np.float32), rng.integers(0, 2**31, (num_reqs, 2)).astype(np.uint32),
                            np.arange(num_reqs, dtype=np.uint32), np.zeros(num_reqs, np.float32))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="compilecheck.export_part", description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    records, who = run()
    data = {"seconds": round(time.perf_counter() - t0, 1), "platforms": list(PLATFORMS), "registration": who,
            "records": records}
    with open(args.json, "w") as f:
        json.dump(data, f, indent=1)
    for r in records:
        print(f"export {r['program']}: {'ok' if r['ok'] else 'FAIL: ' + r['error'][:300]} ({r['seconds']} s)")
    failed = sum(not r["ok"] for r in records)
    print(f"export: {len(records)} programs exported for {'/'.join(PLATFORMS)} and reloaded, {failed} failed; {who}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
