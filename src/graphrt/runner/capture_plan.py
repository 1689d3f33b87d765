"""The saved capture plan: which keys a runner built, in which order, and how many steps wanted
each -- stored beside the XLA persistent cache so a restart builds in demand order.

Read from ``<compilation_cache_dir>/graphrt-plans/<backend>-<fingerprint>.json`` at start and
written when background warm-up completes, after a re-fit and at ``close()``. The fingerprint
covers what makes the plan mean the same keys; another fingerprint's plan is never read. A file
is validated against :class:`PlanFile` (pydantic, strict types): one that is not JSON, or not a
plan, is logged (the file and the field) and ignored. A plan path that cannot be written turns
the plan off for the runner, with a warning: it never fails a step, the builder or ``close()``.
Format: docs/api.md, "Capture plans".
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Callable, Literal, Optional, Sequence, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from graphrt.backends.base import Executor
from graphrt.config import GraphConfig
from graphrt.core import __version__
from graphrt.core.buckets import BucketPolicy
from graphrt.core.dispatch import BatchDescriptor, Dispatcher, SamplerKey
from graphrt.core.errors import ConfigError
from graphrt.core.graph_modes import RuntimeMode
from graphrt.runner.background import BackgroundWarmup, demand_of
from graphrt.runner.keys import Job, ServingKeys

logger = logging.getLogger(__name__)

PLAN_FORMAT = 1
PLAN_DIR = "graphrt-plans"
#: GraphConfig fields that do not change which keys a plan names.
_NOT_FINGERPRINTED = frozenset({"compilation_cache_dir", "disable_capture_plan", "refit_interval",
                                "refit_max_buckets", "strict", "debug_check_addresses", "host_kernel"})


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class ForwardKeyJson(_Strict):
    """A forward key in a plan file (:class:`~graphrt.core.dispatch.BatchDescriptor`'s fields)."""

    kind: Literal["forward"]
    num_tokens: int = Field(ge=1)
    num_reqs: Optional[int] = Field(ge=1)
    uniform_decode: bool
    num_loras: int = Field(0, ge=0)
    max_seq_len: Optional[int] = None

    def key(self) -> BatchDescriptor:
        return BatchDescriptor(self.num_tokens, self.num_reqs, self.uniform_decode, self.num_loras, self.max_seq_len)


class SamplerKeyJson(_Strict):
    """A sampler key in a plan file (:class:`~graphrt.core.dispatch.SamplerKey`'s fields)."""

    kind: Literal["sampler"]
    num_reqs: int = Field(ge=1)
    greedy: bool
    logprobs: bool = False
    wide_top_k: bool = False
    penalties: bool = False

    def key(self) -> SamplerKey:
        return SamplerKey(self.num_reqs, self.greedy, self.logprobs, self.wide_top_k, self.penalties)


class PlanJobJson(_Strict):
    """One planned key: its mode, the key, its demand, and what building it cost."""

    mode: RuntimeMode
    key: Annotated[Union[ForwardKeyJson, SamplerKeyJson], Field(discriminator="kind")]
    demand: int = Field(ge=0)
    bytes: int = Field(0, ge=0)
    seconds: float = Field(0.0, ge=0, allow_inf_nan=False)


class PlanFile(_Strict):
    """The schema of a capture plan file (what :meth:`CapturePlanStore.save` writes)."""

    format: int
    fingerprint: str
    backend: str = ""
    device: str = ""
    decode_buckets: Optional[list[Annotated[int, Field(ge=1)]]] = None
    token_buckets: Optional[list[Annotated[int, Field(ge=1)]]] = None
    jobs: list[PlanJobJson]

    @field_validator("format")
    @classmethod
    def _this_format(cls, value: int) -> int:
        if value != PLAN_FORMAT:
            raise ValueError(f"format {value} is not the one this graphrt reads ({PLAN_FORMAT})")
        return value


def _first_problem(error: ValidationError) -> str:
    """A plan file's first schema error: the field (``jobs.3.key.num_tokens``) and what is wrong."""
    e = error.errors()[0]
    where = ".".join(map(str, e["loc"])) or "the top level"
    more = f" (and {error.error_count() - 1} more)" if error.error_count() > 1 else ""
    return f"{where}: {e['msg']}{more}"


@dataclass
class SavedPlan:
    """A plan read from disk: bucket sizes and the jobs in build order with their demand."""

    decode_buckets: list[int] | None
    token_buckets: list[int] | None
    jobs: list[tuple[Job, int]] = field(default_factory=list)

    @property
    def demand(self) -> dict[Job, int]:
        """Demand per job (background warm-up's prior)."""
        return dict(self.jobs)

    def dispatcher(self, base: Dispatcher) -> Dispatcher:
        """``base`` over the plan's bucket sizes (its own where the plan has none)."""
        return base.with_buckets(
            token_buckets=BucketPolicy(self.token_buckets) if self.token_buckets else None,
            decode_buckets=BucketPolicy(self.decode_buckets) if self.decode_buckets else None)


def _plain(value: Any) -> Any:
    """A JSON-able description of a config object (HF config, dataclass, pydantic, anything)."""
    for attr in ("to_dict", "model_dump"):
        fn = getattr(value, attr, None)
        if callable(fn):
            try:
                return fn()
            except Exception:  # noqa: BLE001 - fall through to a cruder description
                pass
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return repr(value)


def describe_device(executor: Any) -> str:
    """The device(s) an executor runs on: its torch device or its mesh's device kinds, and the host."""
    mesh = executor.mesh
    if mesh is not None:
        devices = sorted({f"{d.platform}:{getattr(d, 'device_kind', '')}" for d in mesh.devices.flat})
        where = f"{len(mesh.devices.flat)}x {', '.join(devices)}"
    else:
        where = str(executor.device if executor.device is not None else "unknown")
    return f"{where} on {platform.machine()}"


def fingerprint(backend: str, device: str, model: Any, config: Any) -> str:
    """The hash a plan is stored under (module docstring: what it covers)."""
    fields = {k: v for k, v in config.model_dump(mode="json").items() if k not in _NOT_FINGERPRINTED}
    model_config = getattr(model, "config", None)
    described = {"graphrt": __version__, "backend": backend, "device": device, "model": type(model).__name__,
                 "model_config": _plain(model_config) if model_config is not None else None, "config": fields}
    text = json.dumps(described, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _key_json(key: BatchDescriptor | SamplerKey) -> dict[str, Any]:
    kind = "sampler" if isinstance(key, SamplerKey) else "forward"
    return {"kind": kind, **dataclasses.asdict(key)}


class CapturePlanStore:
    """One runner's plan file: :meth:`load` on start, :meth:`save` when there is news.

    :attr:`off` says why the plan is not kept (its path is taken by something that is not a plan
    file, or a save failed: logged once), else None."""

    def __init__(self, directory: str | os.PathLike, *, backend: str, device: str, model: Any, config: Any) -> None:
        self.backend = backend
        self.device = device
        self.fingerprint = fingerprint(backend, device, model, config)
        self.path = Path(os.path.expanduser(os.fspath(directory))) / PLAN_DIR / f"{backend}-{self.fingerprint}.json"
        self.saves = 0
        self.off: str | None = None
        for where, taken in ((self.path.parent, lambda p: p.exists() and not p.is_dir()),
                             (self.path, lambda p: p.exists() and not p.is_file())):
            if taken(where):
                self._turn_off(f"{where} is in the way (not a {'directory' if where != self.path else 'file'}); "
                               "remove it to keep plans")
                break

    def _turn_off(self, why: str) -> None:
        self.off = why
        logger.warning("graphrt: the capture plan is off for this runner (nothing read or saved): %s", why)

    def load(self) -> SavedPlan | None:
        """The saved plan, or None (none yet, another fingerprint's, or not a plan: logged with
        the file and the field)."""
        if self.off is not None or not self.path.is_file():
            return None
        try:
            data = PlanFile.model_validate_json(self.path.read_bytes())
        except OSError as exc:
            logger.warning("graphrt: ignoring the capture plan %s: cannot read it: %s", self.path, exc)
            return None
        except ValidationError as exc:
            logger.warning("graphrt: ignoring the capture plan %s: not a capture plan: %s", self.path,
                           _first_problem(exc))
            return None
        if data.fingerprint != self.fingerprint:
            return None
        jobs = [((j.mode, j.key.key()), j.demand) for j in data.jobs]
        plan = SavedPlan(data.decode_buckets, data.token_buckets, jobs)
        logger.info("graphrt: capture plan %s: %d keys, %d steps of demand", self.path.name, len(plan.jobs),
                    sum(d for _, d in plan.jobs))
        return plan

    def save(self, dispatcher: Dispatcher, jobs: Sequence[Job], demand: Callable[[Job], int],
             cost: Callable[[Job], tuple[int, float]]) -> Path | None:
        """Write the plan: ``dispatcher``'s bucket sizes and ``jobs`` most demanded first (ties in
        their given order), each with its demand and its build bytes and seconds. Its path, or
        None when the plan is :attr:`off` (a failed write turns it off: it runs on the builder's
        thread and in ``close()``, which it must never fail)."""
        if self.off is not None:
            return None
        ranked = sorted(enumerate(jobs), key=lambda ij: (-demand(ij[1]), ij[0]))
        rows = []
        for _, job in ranked:
            nbytes, seconds = cost(job)
            rows.append({"mode": job[0].value, "key": _key_json(job[1]), "demand": demand(job), "bytes": nbytes,
                         "seconds": round(seconds, 6)})
        data = {"format": PLAN_FORMAT, "fingerprint": self.fingerprint, "backend": self.backend,
                "device": self.device,
                "decode_buckets": list(dispatcher.decode_buckets) if dispatcher.decode_buckets else None,
                "token_buckets": list(dispatcher.token_buckets) if dispatcher.token_buckets else None,
                "jobs": rows}
        tmp = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".plan-", suffix=".json")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1)
            os.replace(tmp, self.path)           # atomic: a reader never sees half a plan
        except OSError as exc:
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)
            self._turn_off(f"cannot write {self.path}: {exc.strerror or exc}")
            return None
        self.saves += 1
        return self.path


def open_plan_store(config: GraphConfig, *, backend: str, executor: Executor, model: Any) -> CapturePlanStore | None:
    """A runner's capture plan store (with ``compilation_cache_dir``, one process, the plan not
    disabled), or None: no plan kept, or its path is taken by something that is not a plan file
    (logged)."""
    if not config.compilation_cache_dir or config.disable_capture_plan or config.tensor_parallel_size != 1:
        return None
    store = CapturePlanStore(config.compilation_cache_dir, backend=backend, device=describe_device(executor),
                             model=model, config=config)
    return store if store.off is None else None


def read_plan(store: CapturePlanStore | None, keys: ServingKeys) -> SavedPlan | None:
    """The saved plan, with its bucket sizes served by ``keys`` (None: no store, no plan, or its
    buckets do not fit this config: logged, the config's kept)."""
    saved = store.load() if store is not None else None
    if saved is not None and (saved.decode_buckets or saved.token_buckets):
        try:
            keys.serve(saved.dispatcher(keys.dispatcher))
        except ConfigError as exc:
            logger.warning("graphrt: the capture plan's buckets do not fit this config (%s); using the "
                           "config's", exc)
    return saved


def save_plan(store: CapturePlanStore, keys: ServingKeys, background: BackgroundWarmup | None = None) -> Path | None:
    """Save the plan of ``keys``: its dispatcher's buckets and keys, each key's demand (hits plus
    steps that wanted it while ``background`` warm-up lacked it) and build cost. None when the
    plan is off."""

    def cost(job: Job) -> tuple[int, float]:
        target, cache_key = keys.target(job)
        e = target.stats.per_key.get(cache_key)
        return (e.build_bytes, e.build_seconds) if e is not None else (0, 0.0)

    return store.save(keys.dispatcher, keys.jobs(), lambda job: demand_of(job, background, keys), cost)


__all__ = ["CapturePlanStore", "PlanFile", "PLAN_DIR", "SavedPlan", "describe_device", "fingerprint",
           "open_plan_store", "read_plan", "save_plan"]
