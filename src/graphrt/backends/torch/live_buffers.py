"""The live-buffer check: every buffer a captured graph reads that is not a step input is still
the one it captured.

A device graph reads fixed addresses: the model's parameters and module buffers (LoRA slots among
them), the KV and state caches (the executor's tensors and each layer's views), the static
inputs and outputs and the sampler's workspaces. :class:`LiveBuffers` records their identity at
each capture -- a :class:`Snapshot` of (address, storage bytes, dtype, shape) by name, shared by
every graph captured while nothing moved -- and says which buffers of a graph moved since: a
parameter re-bound by its module (``model.lm_head.weight = nn.Parameter(...)``,
``load_state_dict(assign=True)``), converted by ``.to()``, a reallocated cache. The runner asks
at every refit, wake and LoRA load, and before a step whose :meth:`LiveBuffers.watch` is
``due``; ``debug_check_addresses`` asks before every replay.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterable, NamedTuple

import torch
from torch.nn.modules import module as nn_module

from graphrt.core.weight_reports import stale_error

#: Every live :class:`LiveBuffers`: a parameter, buffer or submodule registered on any module of
#: the process (a re-binding: ``module.weight = nn.Parameter(...)``, ``load_state_dict(assign=True)``)
#: makes each one's check due, so a step tells by reading one flag whether a full check is.
_LIVE: "weakref.WeakSet[LiveBuffers]" = weakref.WeakSet()


def _registered(*args: Any) -> None:
    for live in _LIVE:
        live.due = True


for _register in (nn_module.register_module_parameter_registration_hook,
                  nn_module.register_module_buffer_registration_hook,
                  nn_module.register_module_module_registration_hook):
    _register(_registered)


class BufferId(NamedTuple):
    """What a graph binds of one buffer: its address, its storage's bytes, dtype and shape."""

    ptr: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def buffer_id(t: torch.Tensor) -> BufferId:
    return BufferId(t.data_ptr(), t.untyped_storage().nbytes(), t.dtype, tuple(t.shape))


@dataclass(frozen=True, eq=False)
class Snapshot:
    """The buffers one or more graphs read, by name, and the module owning each."""

    buffers: dict[str, BufferId]
    modules: dict[str, str]


class LiveBuffers:
    """Reads the buffers an executor's graphs bind (:meth:`read`), snapshots them at capture and
    names what moved since (:meth:`moved`). ``caches()`` gives the executor's KV and state tensors
    by name, ``device_buffers()`` its static inputs, outputs and sampler workspaces by name."""

    def __init__(self, model: torch.nn.Module, caches: Callable[[], dict[str, torch.Tensor]],
                 device_buffers: Callable[[], dict[str, torch.Tensor]]) -> None:
        self.model = model
        self._caches, self._device_buffers = caches, device_buffers
        self._last: dict[bool, Snapshot] = {}
        #: Whether a full check is due: a module anywhere registered a parameter, buffer or
        #: submodule, or the executor allocated its caches again (graphs hold the old ones), since
        #: the last check or capture.
        self.due = False
        _LIVE.add(self)
        self._watch: list[tuple[torch.Tensor, int]] = []     # (tensor, address) of the last check

    def watch(self, thorough: bool = False) -> Any:
        """What the runner reads before each step (a ``BufferWatch``): these buffers, whose ``due``
        is a flag; ``thorough`` (strict mode), a watch that also compares the address of every
        parameter, buffer and cache view seen at the last check (a ``.to()`` of a submodule moves
        them without registering anything)."""
        return ThoroughWatch(self) if thorough else self

    def moved_in_place(self) -> bool:
        """Whether a parameter, buffer or cache view seen at the last check is at another address."""
        return any(t.data_ptr() != ptr for t, ptr in self._watch)

    def _checked(self) -> None:
        """A full check (or a capture) read every buffer: remember what it saw."""
        self.due = False
        model = self.model
        tensors = [t for _, t in model.named_parameters(remove_duplicate=False)]
        tensors += [t for _, t in model.named_buffers(remove_duplicate=False)]
        for attr, layers in (("kv_cache", _layers(model, "attention_layers")),
                             ("state_cache", _layers(model, "state_layers"))):
            for layer in layers:
                views = getattr(layer, attr, None)
                tensors += [t for t in (views if isinstance(views, (tuple, list)) else (views,))
                            if isinstance(t, torch.Tensor)]
        self._watch = [(t, t.data_ptr()) for t in tensors]

    def read(self, sampler: bool = False) -> Snapshot:
        """The buffers a forward graph reads now (a sampler graph's: the logits and the sampler's)."""
        buffers: dict[str, BufferId] = {}
        modules: dict[str, str] = {}
        device = self._device_buffers()
        if sampler:
            for name, t in device.items():
                if name == "logits_out" or name.startswith("sampler."):
                    buffers[name], modules[name] = buffer_id(t), "sampler"
            return Snapshot(buffers, modules)
        model = self.model
        for kind, named in (("parameter", model.named_parameters(remove_duplicate=False)),
                            ("buffer", model.named_buffers(remove_duplicate=False))):
            for name, t in named:
                buffers[name] = buffer_id(t)
                modules[name] = name.rpartition(".")[0] or type(model).__name__
        names = {id(m): n for n, m in model.named_modules()}
        for attr, layers in (("kv_cache", _layers(model, "attention_layers")),
                             ("state_cache", _layers(model, "state_layers"))):
            for layer in layers:
                views = getattr(layer, attr, None)
                owner = names.get(id(layer), type(layer).__name__)
                for i, t in enumerate(views if isinstance(views, (tuple, list)) else (views,)):
                    if isinstance(t, torch.Tensor):
                        name = f"{owner}.{attr}" + (f"[{i}]" if isinstance(views, (tuple, list)) else "")
                        buffers[name], modules[name] = buffer_id(t), owner
        for name, t in {**self._caches(), **device}.items():
            buffers[name], modules[name] = buffer_id(t), "executor"
        return Snapshot(buffers, modules)

    def snapshot(self, sampler: bool = False) -> Snapshot:
        """:meth:`read`, as the same object while nothing moved (graphs share it)."""
        if not sampler:
            self._checked()
        now = self.read(sampler)
        last = self._last.get(sampler)
        if last is not None and last.buffers == now.buffers:
            return last
        self._last[sampler] = now
        return now

    def moved(self, snapshot: Snapshot, now: Snapshot | None = None) -> list[str]:
        """Each buffer of ``snapshot`` that is gone or not where it was, as ``name (module m:
        what changed)``."""
        now = now if now is not None else self.read(sampler=_is_sampler(snapshot))
        out = []
        for name, was in snapshot.buffers.items():
            got = now.buffers.get(name)
            if got == was:
                continue
            module = snapshot.modules.get(name, "?")
            if got is None:
                change = "no longer there"
            elif got.ptr != was.ptr:
                change = f"address {was.ptr:#x} -> {got.ptr:#x}"
            else:
                change = f"{was.dtype} {list(was.shape)} ({was.nbytes} bytes) -> {got.dtype} {list(got.shape)} " \
                         f"({got.nbytes} bytes)"
            out.append(f"{name} (module {module}: {change})")
        return out

    def stale(self, entries: Iterable[tuple[Hashable, Any]]) -> dict[Hashable, list[str]]:
        """For every ``(cache key, entry)`` whose recorded buffers moved, what moved; each distinct
        snapshot is compared once."""
        self._checked()
        now: dict[bool, Snapshot] = {}
        done: dict[int, list[str]] = {}
        out: dict[Hashable, list[str]] = {}
        for key, entry in entries:
            snap = getattr(entry, "buffers", None)
            if not isinstance(snap, Snapshot):
                continue
            if id(snap) not in done:
                sampler = _is_sampler(snap)
                if sampler not in now:
                    now[sampler] = self.read(sampler)
                done[id(snap)] = self.moved(snap, now[sampler])
            if done[id(snap)]:
                out[key] = done[id(snap)]
        return out

    def check_entry(self, entry: Any, key: Any) -> None:
        """Debug mode, before one replay: :class:`StaleBufferError` if ``entry``'s buffers moved."""
        snap = getattr(entry, "buffers", None)
        if isinstance(snap, Snapshot):
            moved = self.moved(snap)
            if moved:
                raise stale_error({key: moved})


class ThoroughWatch:
    """Strict mode's watch over ``live``: due when its flag is, or when a buffer it saw moved."""

    def __init__(self, live: LiveBuffers) -> None:
        self.live = live

    @property
    def due(self) -> bool:
        return self.live.due or self.live.moved_in_place()


def _layers(model: torch.nn.Module, method: str) -> list[Any]:
    get = getattr(model, method, None)
    return list(get()) if callable(get) else []


def _is_sampler(snapshot: Snapshot) -> bool:
    return all(m == "sampler" for m in snapshot.modules.values())


__all__ = ["BufferId", "LiveBuffers", "Snapshot", "ThoroughWatch", "buffer_id"]
