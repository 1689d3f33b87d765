"""graphrt's Triton kernels under Triton's interpreter, launched so that recording graphs replay
them (:func:`interpreted`).

Compiled (CUDA tensors), a launch ``kernel[grid](*args)`` is a kernel that a CUDA graph captures
with its arguments. Interpreted (CPU tensors, ``TRITON_INTERPRET=1``), a launch is Python running
numpy over the tensors' memory: no aten op, so graphrt's CPU recording graph (backend ``cpu``, and
the simulated device adapters over it) recorded nothing of it, and a replay left the outputs of
the capture's step in place -- wrong results, silently. :func:`interpreted` wraps a kernel so that
each launch is one opaque op, ``torch.ops.graphrt.interpreted_triton``: the recording graph
records it with its arguments (the same tensors; grid and host numbers baked, as a device graph
bakes a kernel's) and re-runs the interpreter on them at each replay. Nothing here imports
triton until a kernel is wrapped.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

#: Interpreted kernels by name (``module.function``), for the op to find at a replay.
_INTERPRETED: dict[str, Any] = {}


def _encode(values: list[Any]) -> tuple[str, list[torch.Tensor], list[int], list[float], list[str]]:
    """Kernel arguments as the op's lists: a layout letter each (``t`` tensor, ``i`` int, ``b``
    bool, ``f`` float, ``n`` None, ``d`` a ``tl.dtype``) and the values by kind."""
    layout, tensors, ints, floats, dtypes = [], [], [], [], []
    for value in values:
        if isinstance(value, torch.Tensor):
            layout.append("t")
            tensors.append(value)
        elif isinstance(value, bool):
            layout.append("b")
            ints.append(int(value))
        elif isinstance(value, int):
            layout.append("i")
            ints.append(value)
        elif isinstance(value, float):
            layout.append("f")
            floats.append(value)
        elif value is None:
            layout.append("n")
        elif type(value).__module__.startswith("triton") and type(value).__name__ == "dtype":
            layout.append("d")
            dtypes.append(value.name)
        else:
            raise TypeError(f"a Triton kernel argument of type {type(value).__name__} cannot cross "
                            f"torch.ops.graphrt.interpreted_triton (tensors, ints, bools, floats, None, tl dtypes)")
    return "".join(layout), tensors, ints, floats, dtypes


def _decode(layout: str, tensors: list[torch.Tensor], ints: list[int], floats: list[float],
            dtypes: list[str]) -> list[Any]:
    """:func:`_encode`'s arguments back, in order."""
    import triton.language as tl

    numbers = iter(ints)
    its = {"t": iter(tensors), "i": numbers, "b": numbers, "f": iter(floats), "d": iter(dtypes)}
    out: list[Any] = []
    for kind in layout:
        if kind == "n":
            out.append(None)
        elif kind == "b":
            out.append(bool(next(numbers)))
        elif kind == "d":
            out.append(tl.dtype(next(its["d"])))
        else:
            out.append(next(its[kind]))
    return out


@torch.library.custom_op("graphrt::interpreted_triton", mutates_args=("tensors",))
def interpreted_triton(kernel: str, grid: list[int], layout: str, keywords: str, tensors: list[torch.Tensor],
                       ints: list[int], floats: list[float], dtypes: str) -> None:
    """``torch.ops.graphrt.interpreted_triton``: run the interpreted kernel ``kernel`` over
    ``grid`` on the arguments :func:`_encode` laid out, the last ones by the names in
    ``keywords`` (comma-separated, as ``dtypes``: a custom op takes no list of strings). Every
    tensor counts as written (a kernel's stores are not declared)."""
    names = keywords.split(",") if keywords else []
    values = _decode(layout, tensors, ints, floats, dtypes.split(",") if dtypes else [])
    split = len(values) - len(names)
    _INTERPRETED[kernel][tuple(grid)](*values[:split], **dict(zip(names, values[split:])))


@interpreted_triton.register_fake
def _interpreted_triton_fake(kernel: str, grid: list[int], layout: str, keywords: str,
                             tensors: list[torch.Tensor], ints: list[int], floats: list[float], dtypes: str) -> None:
    return None


class InterpretedKernel:
    """A kernel function under Triton's interpreter, launched like a jitted one (``k[grid](...)``)
    through :func:`interpreted_triton`."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        from triton.runtime.interpreter import InterpretedFunction

        self.name = f"{fn.__module__}.{fn.__qualname__}"
        _INTERPRETED[self.name] = InterpretedFunction(fn)

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        def run(*args: Any, **kwargs: Any) -> None:
            layout, tensors, ints, floats, dtypes = _encode([*args, *kwargs.values()])
            torch.ops.graphrt.interpreted_triton(self.name, [int(g) for g in grid], layout, ",".join(kwargs), tensors,
                                                 ints, floats, ",".join(dtypes))
        return run


def interpreted(fn: Callable[..., Any]) -> InterpretedKernel:
    """``fn`` (a plain Triton kernel function) under Triton's interpreter, each launch one op that
    recording graphs record and replay (the module docstring)."""
    return InterpretedKernel(fn)


__all__ = ["InterpretedKernel", "interpreted", "interpreted_triton"]
