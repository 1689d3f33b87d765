"""Any JAX function compiled ahead of time once per key: the XLA piece an engine with its own
model runner takes instead of :class:`graphrt.ModelRunner`.

:meth:`XlaGraphs.build` compiles the function for a key's example arguments; a call runs that
executable, which refuses other shapes, so nothing compiles behind the caller's back. Calls are
counted in the :class:`graphrt.GraphCache` as the runner counts steps; no eager path."""

from __future__ import annotations

import time
from typing import Any, Callable, Generic, Hashable, Sequence, TypeVar

import jax

from graphrt.core.cache import GraphCache
from graphrt.core.errors import GraphrtError, InputError

T = TypeVar("T")


class XlaGraphs(Generic[T]):
    """``fn`` compiled once per key (``jit(fn).lower(*args).compile()``), then called.

    ``donate_argnums`` names arguments XLA may overwrite in place (a KV cache): pass the
    returned value back in on the next call. Entries live in ``cache`` (a
    :class:`graphrt.GraphCache`: statistics, strict mode).
    """

    def __init__(self, fn: Callable[..., T], cache: GraphCache | None = None, *,
                 donate_argnums: Sequence[int] = ()) -> None:
        self._jitted = jax.jit(fn, donate_argnums=tuple(donate_argnums))
        self.cache: GraphCache = cache if cache is not None else GraphCache()

    def build(self, key: Hashable, *example_args: Any) -> None:
        """Compile ``fn`` for ``key``: ``example_args`` (arrays or ``jax.ShapeDtypeStruct``)
        give the shapes every later call with this key must have."""
        t0 = time.perf_counter()
        shapes = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), example_args)
        executable = self._jitted.lower(*shapes).compile()
        self.cache.put(key, (executable, shapes), seconds=time.perf_counter() - t0)

    def __call__(self, key: Hashable, *args: Any, num_tokens: int | None = None,
                 num_reqs: int | None = None) -> T:
        """Run the executable of ``key``; arguments of other shapes or dtypes than it was built
        for raise :class:`~graphrt.InputError` naming the first that differs. Counted in the
        cache: a hit, or a miss (strict and sealed: :class:`~graphrt.CacheMissError`, else an
        error: nothing compiles on a call); ``num_tokens`` / ``num_reqs``, the call's real sizes,
        count its padding to the key's (a ``BatchDescriptor`` or a token count)."""
        entry = self.cache.lookup(key, reason="not compiled")
        if entry is None:
            self.cache.count(key, False)
            raise GraphrtError(f"no executable for {key}: build it first (XlaGraphs.build)")
        self.cache.record_call(key, hit=True, num_tokens=num_tokens, num_reqs=num_reqs)
        executable, shapes = entry
        try:
            return executable(*args)
        except TypeError as exc:
            raise _mismatch(key, shapes, args) from exc


def _mismatch(key: Hashable, shapes: Any, args: Any) -> Exception:
    """The :class:`InputError` for arguments the executable of ``key`` refused."""
    want, _ = jax.tree_util.tree_flatten_with_path(shapes)
    got = jax.tree_util.tree_leaves(args)
    if len(got) != len(want):
        return InputError("args", f"{key} was built for {len(want)} arrays, got {len(got)}")
    for (path, spec), arg in zip(want, got):
        shape, dtype = tuple(getattr(arg, "shape", ())), getattr(arg, "dtype", type(arg))
        if shape != spec.shape or jax.dtypes.canonicalize_dtype(dtype) != spec.dtype:
            return InputError(f"args{jax.tree_util.keystr(path)}",
                              f"{key} was built for {spec.dtype}{list(spec.shape)}, got {dtype}{list(shape)}")
    return InputError("args", f"{key}'s executable refused the arguments")
