"""Pictures of what the ``graphrt`` command prints as tables (``--plot FILE.png``).

* :func:`plot_plan` -- ``graphrt plan``: padding waste per bucket policy, and the size each
  policy pads every batch size of the trace to;
* :func:`plot_warmup` -- ``graphrt demo``: capture / compile time and bytes per key of the
  warm-up report.

matplotlib is an optional extra (``pip install 'graphrt[plot]'``); without it
:func:`require_matplotlib` raises a one-line :class:`~graphrt.ConfigError`. Figures are drawn
with matplotlib's object API (no pyplot), so plotting never changes the caller's matplotlib
backend or opens a window. The format follows the file's suffix (``.png``, ``.svg``, ``.pdf``).
"""

from __future__ import annotations

import os
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np

from graphrt.core.errors import ConfigError

#: Resolution of written raster files (dots per inch).
PLOT_DPI = 110
#: Figure width and the plan figure's height, inches.
FIGURE_WIDTH = 12.0
PLAN_HEIGHT = 5.0
#: Warm-up figure: inches per key row, plus room for titles and axes; capped.
WARMUP_ROW_INCHES = 0.24
WARMUP_MARGIN_INCHES = 1.6
WARMUP_MAX_HEIGHT = 60.0
#: The install hint of the message without matplotlib.
INSTALL_HINT = "pip install 'graphrt[plot]'"


class PolicyWaste(NamedTuple):
    """One row of ``graphrt plan``'s table: a bucket policy and its padding of the trace."""

    name: str
    sizes: tuple[int, ...]        # the policy's bucket sizes, ascending
    padded_tokens: int
    waste_percent: float          # padded tokens that are padding, percent
    eager_steps: int              # steps above the largest bucket (run unpadded)


def require_matplotlib(flag: str = "--plot") -> Any:
    """matplotlib's ``Figure`` class; ConfigError naming ``flag`` where matplotlib is missing."""
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ConfigError(f"{flag} needs matplotlib, which is not installed ({exc}): {INSTALL_HINT}") from None
    return Figure


def check_path(path: str | os.PathLike[str], flag: str = "--plot") -> str:
    """``path`` as a string, if its directory exists (ConfigError naming ``flag`` otherwise)."""
    text = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(directory):
        raise ConfigError(f"{flag}: directory {directory} does not exist")
    return text


def padded_sizes(sizes: Sequence[int], batch_sizes: np.ndarray) -> np.ndarray:
    """The bucket each batch size pads to (itself above the largest bucket: run eagerly)."""
    ordered = np.asarray(sorted(sizes), dtype=np.int64)
    if ordered.size == 0:
        return batch_sizes.copy()
    idx = np.searchsorted(ordered, batch_sizes, side="left")
    out = ordered[np.minimum(idx, ordered.size - 1)]
    return np.where(idx < ordered.size, out, batch_sizes)


def plot_plan(rows: Sequence[PolicyWaste], counts: Mapping[int, int], path: str | os.PathLike[str],
              title: str) -> str:
    """``graphrt plan``'s table as a picture: waste % per policy (bars, with bucket counts and
    eager steps), and the padded size of every batch size the trace has (one step line per
    policy over the trace's histogram). Returns the path written."""
    figure_cls = require_matplotlib()
    target = check_path(path)
    fig = figure_cls(figsize=(FIGURE_WIDTH, PLAN_HEIGHT), layout="constrained")
    waste_ax, pad_ax = fig.subplots(1, 2, width_ratios=(1, 1.3))
    names = [r.name for r in rows]
    y = np.arange(len(rows))
    bars = waste_ax.barh(y, [r.waste_percent for r in rows], color="tab:orange")
    waste_ax.set_yticks(y, names)
    waste_ax.invert_yaxis()
    waste_ax.set_xlabel("padding waste, % of padded tokens")
    waste_ax.set_title("padding waste per bucket policy")
    labels = [f"{r.waste_percent:.2f}%  {len(r.sizes)} buckets" + (f", {r.eager_steps} eager" if r.eager_steps else "")
              for r in rows]
    waste_ax.bar_label(bars, labels, padding=3, fontsize=8)
    waste_ax.set_xlim(0, max([r.waste_percent for r in rows] + [1.0]) * 1.6)

    batch = np.asarray(sorted(counts), dtype=np.int64)
    steps = np.asarray([counts[int(b)] for b in batch], dtype=np.float64)
    hist_ax = pad_ax.twinx()
    hist_ax.bar(batch, steps, width=1.0, color="0.85", label="steps in the trace")
    hist_ax.set_ylabel("steps in the trace")
    pad_ax.set_zorder(hist_ax.get_zorder() + 1)
    pad_ax.patch.set_visible(False)
    pad_ax.plot(batch, batch, color="black", linewidth=0.8, linestyle=":", label="no padding")
    for row in rows:
        pad_ax.step(batch, padded_sizes(row.sizes, batch), where="post", linewidth=1.2, label=row.name)
    pad_ax.set_xlabel("batch size (requests in a decode step)")
    pad_ax.set_ylabel("padded to")
    pad_ax.set_title("bucket each batch size is padded to")
    pad_ax.legend(fontsize=8, loc="upper left")
    fig.suptitle(title, fontsize=10)
    fig.savefig(target, dpi=PLOT_DPI)
    return target


def plot_warmup(report: Sequence[Mapping[str, Any]], path: str | os.PathLike[str], title: str) -> str:
    """A runner's warm-up report as a picture: build (capture / compile) seconds and KiB per
    key, in warm-up order (largest first); keys whose build failed in red. Returns the path."""
    figure_cls = require_matplotlib()
    target = check_path(path)
    n = len(report)
    height = min(WARMUP_MAX_HEIGHT, WARMUP_MARGIN_INCHES + WARMUP_ROW_INCHES * max(n, 1))
    fig = figure_cls(figsize=(FIGURE_WIDTH, height), layout="constrained")
    time_ax, bytes_ax = fig.subplots(1, 2, sharey=True)
    y = np.arange(n)
    colors = ["tab:red" if row.get("failed") else "tab:blue" for row in report]
    time_ax.barh(y, [float(row["seconds"]) for row in report], color=colors)
    bytes_ax.barh(y, [float(row["bytes"]) / 1024 for row in report], color=colors)
    time_ax.set_yticks(y, [str(row["key"]) for row in report], fontsize=7)
    time_ax.invert_yaxis()
    time_ax.set_xlabel("capture / compile time, s")
    bytes_ax.set_xlabel("graph memory, KiB")
    time_ax.set_title("build time per key")
    bytes_ax.set_title("bytes per key" + ("  (red: build failed, runs eagerly)" if "tab:red" in colors else ""))
    fig.suptitle(title, fontsize=10)
    fig.savefig(target, dpi=PLOT_DPI)
    return target


__all__ = ["PolicyWaste", "check_path", "padded_sizes", "plot_plan", "plot_warmup", "require_matplotlib"]
