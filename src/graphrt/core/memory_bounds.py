"""What a setting will allocate, checked against what the machine has before anything is allocated.

Each allocation is a :class:`Need` (the setting behind it, what it is, its bytes);
:func:`check_needs` refuses them with a :class:`ConfigError` naming the setting of the largest,
the bytes and what is available, instead of a raw ``MemoryError`` / OOM naming nothing. The
bound is where it lands: physical RAM, ``/dev/shm``'s free space, or the device's memory. The
standard library only."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

from graphrt.core import defaults
from graphrt.core.errors import ConfigError

UNKNOWN_MEMORY_BYTES = 2**40


@dataclass(frozen=True)
class Need:
    """One allocation graphrt will make: the setting that sizes it (named in the error), what
    it is, and its bytes."""

    field: str
    what: str
    nbytes: int


@dataclass(frozen=True)
class ModelShape:
    """What a model's allocations scale with, as a backend reads it off a loaded model: the KV
    cache per block (its KV cache spec, core/kv_spec.py), static and activation buffers per
    token / request, LoRA slots per rank."""

    kv_bytes_per_block: int  # one KV block over every layer
    kv_row_bytes: int        # one token slot over every layer: each layer's trash row (0: the model owns its cache)
    itemsize: int            # bytes of one weight / activation element
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    lora_features: int = 0   # in + out features summed over the LoRA-capable linears of every layer

    def kv_cache_bytes(self, num_blocks: int) -> int:
        """Bytes of a KV cache of ``num_blocks`` blocks (and the trash rows)."""
        return int(num_blocks) * self.kv_bytes_per_block + self.kv_row_bytes

    @property
    def activation_bytes_per_token(self) -> int:
        """A lower bound on a forward's live activations per token: the residual stream and a
        normed copy (2 x hidden) and the gated MLP's gate / up / product (3 x intermediate)."""
        return self.itemsize * (2 * self.hidden_size + 3 * self.intermediate_size)


def physical_memory_bytes() -> int:
    """Total physical RAM of this machine; ``UNKNOWN_MEMORY_BYTES`` where the system
    cannot say."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):
        return UNKNOWN_MEMORY_BYTES


def available_memory_bytes(meminfo: str = "/proc/meminfo") -> int:
    """RAM a new allocation can take now: the kernel's ``MemAvailable`` (free pages plus what
    it can reclaim), else the free pages, else physical RAM where the system cannot say."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):
        return physical_memory_bytes()


def shared_memory_bytes(path: str = defaults.SHARED_MEMORY_DIR) -> int:
    """Bytes a new shared-memory segment can take: the free space of ``path`` (a tmpfs whose
    pages are RAM; touching a page past it is SIGBUS, not an error), at most physical RAM."""
    ram = physical_memory_bytes()
    try:
        st = os.statvfs(path)
    except OSError:
        return ram
    return min(ram, int(st.f_bavail) * int(st.f_frsize))


def _size(nbytes: int) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def check_needs(needs: Sequence[Need], available: int, where: str) -> None:
    """Refuse ``needs`` whose bytes together exceed ``available`` (the memory ``where`` names):
    :class:`ConfigError` naming the setting of the largest need first, its bytes, the total and
    what is available."""
    total = sum(n.nbytes for n in needs)
    if total <= available:
        return
    ranked = sorted((n for n in needs if n.nbytes), key=lambda n: n.nbytes, reverse=True)
    worst = ranked[0]
    parts = "; ".join(f"{n.what} ({n.field}) {_size(n.nbytes)}" for n in ranked)
    raise ConfigError(f"{worst.field}: implies {worst.nbytes} bytes ({_size(worst.nbytes)}) of {worst.what}; "
                      f"with the rest {total} bytes ({parts}), above the {available} bytes "
                      f"({_size(available)}) of {where}: lower {worst.field}")


__all__ = ["ModelShape", "Need", "available_memory_bytes", "check_needs", "physical_memory_bytes",
           "shared_memory_bytes"]
