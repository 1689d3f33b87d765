"""Issue 42: the collectives of compiled XLA programs, agreed across ``jax.distributed``
processes. Two processes on 127.0.0.1 (gloo CPU collectives) compile a matmul sharded over the
two-process mesh; where process 1's program reduces once more, both raise
``CollectiveMismatchError`` naming each one's first differing collective; where the programs
match, both get the same list."""

from __future__ import annotations

import multiprocessing as mp

from graphrt.backends.torch.parallel.tp_protocol import free_port
from graphrt.backends.xla.collective_check import program_collectives


def _process(rank: int, port: int, diverge: bool, results) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from graphrt.backends.xla.collective_check import check_processes_agree

    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=rank,
                                   initialization_timeout=60)
        mesh = Mesh(np.asarray(jax.devices()), ("tp",))
        w = jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=NamedSharding(mesh, P("tp", None)))
        x = jax.ShapeDtypeStruct((4, 8), jnp.float32, sharding=NamedSharding(mesh, P()))

        def forward(x, w):
            y = x @ w.T @ w
            return y + w.sum() if diverge and rank == 1 else y
        compiled = jax.jit(forward, out_shardings=NamedSharding(mesh, P())).lower(x, w).compile()
        try:
            entries = check_processes_agree(compiled, "forward(4 tokens)")
            results.put((rank, ("agreed", len(entries), [e[0] for e in entries])))
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            results.put((rank, (type(exc).__name__, str(exc), getattr(exc, "first", None))))
        jax.distributed.shutdown()
    except BaseException as exc:  # noqa: BLE001 - never leave the parent waiting
        results.put((rank, ("crashed", repr(exc), None)))


def _run(diverge: bool) -> dict[int, tuple]:
    ctx = mp.get_context("spawn")
    port, results = free_port(), ctx.Queue()
    procs = [ctx.Process(target=_process, args=(rank, port, diverge, results), daemon=True) for rank in (0, 1)]
    for proc in procs:
        proc.start()
    try:
        return dict(results.get(timeout=120) for _ in procs)
    finally:
        for proc in procs:
            proc.join(20)
            if proc.exitcode is None:
                proc.kill()


def test_processes_with_different_collectives_are_refused_on_both():
    got = _run(diverge=True)
    for rank in (0, 1):
        name, message, first = got[rank]
        assert name == "CollectiveMismatchError", got
        assert set(first) == {0, 1} and first[0] != first[1], first
    assert got[0][1] == got[1][1]
    same = _run(diverge=False)
    assert same[0] == same[1] and same[0][0] == "agreed" and same[0][1] >= 1, same


def test_hlo_and_stablehlo_collectives_are_read_in_order():
    hlo = """
  %all-reduce = f32[4,8]{1,0} all-reduce(%fusion), channel_id=1, replica_groups={{0,1}}, to_apply=%add, metadata={op_name="a"}
  %ag = f32[8,8]{1,0} all-gather-start(%p), channel_id=2, replica_groups=[1,2]<=[2], dimensions={0}
  %agd = f32[8,8]{1,0} all-gather-done(%ag)
  %x = f32[4,8]{1,0} add(%a, %b)
"""
    found = program_collectives(hlo)
    assert [e[0] for e in found] == ["all-reduce", "all-gather"]
    assert found[0][1] == ("f32[4,8]{1,0}", "{{0,1}}") and found[1][1] == ("f32[8,8]{1,0}", "[1,2]<=[2]")
    stable = '%1 = "stablehlo.all_reduce"(%0) ({ ... }) {replica_groups = dense<[[0, 1]]> : tensor<1x2xi64>} : (tensor<4x8xf32>) -> tensor<4x8xf32>'
    assert [e[0] for e in program_collectives(stable)] == ["all-reduce"]
