"""Every compile target's limits in one table, and the checks of a compiled kernel against them.

Plain Python (no triton): the Triton part records what the compiler reports per kernel (shared
memory, registers, spills), and :func:`check_kernel` says which limit a record breaks. Figures
are the vendors' published per-block maxima (CUDA programming guide, "Technical specifications
per compute capability"; AMD CDNA3 ISA guide): a kernel over them fails to launch on that chip
(Triton raises ``OutOfResources``) or, for spills, runs with local-memory traffic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GpuTarget:
    """One compile target: Triton's ``GPUTarget(backend, arch, warp_size)`` and its limits."""

    name: str               #: how the report names it: sm_80, gfx942
    backend: str            #: Triton backend: cuda, hip
    arch: Any               #: 80 / "gfx942"
    warp_size: int
    chips: str              #: example chips, for the report
    shared_bytes: int       #: dynamic shared memory (LDS) one block may use (opt-in maximum)
    regs_per_thread: int    #: 32-bit registers a thread may hold (VGPRs on AMD, AGPRs included)
    regs_per_block: int     #: registers of one block (registers x threads); 0: not a per-block limit
    max_spill_bytes: int    #: spill stores allowed per thread (:data:`SPILL_BUDGET`)
    fp8_e4m3: bool          #: takes an float8_e4m3fn KV cache (graphrt: compute capability >= 8.9)


#: Spill stores a kernel may make per thread: a few registers spilled at the 255-register ceiling
#: is usual for a flash-attention tile (ptxas keeps them in L1); kilobytes are local-memory
#: traffic on every KV tile, the sign of a plan too large for the chip.
SPILL_BUDGET = 512
#: The targets ``make compile-check`` compiles for (NVIDIA: Triton's bundled ptxas; AMD: Triton's
#: own LLVM and linker, no ROCm needed).
TARGETS: dict[str, GpuTarget] = {t.name: t for t in (
    GpuTarget("sm_80", "cuda", 80, 32, "A100", 163 * 1024, 255, 65536, SPILL_BUDGET, False),
    GpuTarget("sm_89", "cuda", 89, 32, "L40S, RTX 4090", 99 * 1024, 255, 65536, SPILL_BUDGET, True),
    GpuTarget("sm_90", "cuda", 90, 32, "H100, H200", 227 * 1024, 255, 65536, SPILL_BUDGET, True),
    GpuTarget("gfx942", "hip", "gfx942", 64, "MI300X", 64 * 1024, 512, 0, SPILL_BUDGET, False),
)}
NVIDIA = ("sm_80", "sm_89", "sm_90")
AMD = ("gfx942",)


def check_kernel(record: dict[str, Any], target: GpuTarget) -> list[str]:
    """The limits ``record`` breaks on ``target``, one sentence each (empty: it fits).

    ``record`` has ``shared`` (bytes), ``registers`` (per thread), ``spill_bytes`` (stores per
    thread; on AMD VGPR spills to scratch) and ``num_warps`` as the compiler reported them.
    """
    problems = []
    shared, regs = int(record["shared"]), int(record["registers"])
    if shared > target.shared_bytes:
        problems.append(f"shared memory {shared} B > {target.shared_bytes} B per block on {target.name}")
    if regs > target.regs_per_thread:
        problems.append(f"{regs} registers per thread > {target.regs_per_thread} on {target.name}")
    threads = int(record["num_warps"]) * target.warp_size
    if target.regs_per_block and regs * threads > target.regs_per_block:
        problems.append(f"{regs} registers x {threads} threads = {regs * threads} > {target.regs_per_block} "
                        f"per block on {target.name}")
    spills = int(record.get("spill_bytes", 0))
    if spills > target.max_spill_bytes:
        problems.append(f"{spills} B of register spills per thread on {target.name} (budget "
                        f"{target.max_spill_bytes} B: local-memory traffic on every tile)")
    return problems


__all__ = ["AMD", "GpuTarget", "NVIDIA", "SPILL_BUDGET", "TARGETS", "check_kernel"]
