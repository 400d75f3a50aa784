"""`vllm-dedup scan --plot FILE.png`: the shared-bytes report as a picture.

Left, a heatmap of the bytes each pair of models shares (`Report.pair_shared_bytes`; the
diagonal is left blank: a model shares everything with itself).  Right, row for row with the
heatmap, each model's bytes split into content another scanned model also holds and content
only it holds (`Report.shared_with_others_bytes`).  Models are labelled ``[i] name``, ``i``
as in the text report (which prints the full paths) and ``name`` the folder or file name.
Sizes, fonts and cell labels adapt to the number of models (readable from 2 to about 30).

matplotlib is an optional dependency (``pip install "vllm-dedup[plot]"``), imported only
when a plot is drawn; the figure is rendered by the non-interactive Agg canvas, without pyplot.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from pathlib import Path

from ..text import size_text
from .report import Report

__all__ = ["PlotData", "plot_data", "require_matplotlib", "short_labels", "write_plot"]

INSTALL_HINT = 'pip install "vllm-dedup[plot]"'
_LABEL_CHARS = 36  # longer model names are shortened in the middle
_UNITS = (("GB", 1e9), ("MB", 1e6), ("kB", 1e3))


def require_matplotlib():
    """Import the parts of matplotlib the plot uses: its ``Figure`` and the non-interactive Agg
    canvas (no pyplot, so no global backend or figure state is touched).

    Returns:
        ``(Figure, FigureCanvasAgg)``.

    Raises:
        ImportError: matplotlib is not installed; the message says how to install it.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError(f"--plot needs matplotlib, which is not installed: {INSTALL_HINT}") from None
    return Figure, FigureCanvasAgg


def short_labels(paths: list[str]) -> list[str]:
    """Short names of model paths: the folder or file name (a Hugging Face hub snapshot,
    ``.../models--org--name/snapshots/<hash>``, is named ``org/name``), with parent folders
    added where two models would otherwise get the same name, shortened in the middle to
    36 characters."""
    parts = [Path(os.path.abspath(p)).parts for p in paths]

    def name(p: tuple[str, ...], depth: int) -> str:
        hub = next((i for i in range(len(p) - 1, -1, -1) if p[i].startswith("models--")), None)
        if hub is not None and hub + 1 < len(p) and p[hub + 1] == "snapshots":
            return p[hub].removeprefix("models--").replace("--", "/")
        return "/".join(p[max(len(p) - depth, 1):]) or p[-1]

    depth = [1] * len(paths)
    for _ in range(3):  # add a parent folder to names that collide, up to three times
        names = [name(p, d) for p, d in zip(parts, depth)]
        clash = {n for n in names if names.count(n) > 1}
        if not clash:
            break
        depth = [d + (n in clash) for n, d in zip(names, depth)]
    names = [name(p, d) for p, d in zip(parts, depth)]
    head = (_LABEL_CHARS - 1) // 2
    tail = _LABEL_CHARS - 1 - head
    return [n if len(n) <= _LABEL_CHARS else n[:head] + "…" + n[-tail:] for n in names]


@dataclass(frozen=True)
class PlotData:
    """What the picture shows, in bytes.

    Attributes:
        labels: ``[i] name`` per model (`short_labels`).
        pair_bytes: ``[i][j]``, bytes of the distinct contents models i and j both hold.
        model_bytes: each model's bytes, as the text report counts them.
        shared_bytes: per model, bytes of its tensors whose content another model also holds.
        total_bytes, unique_bytes, saved_bytes: the report's totals.
    """

    labels: list[str]
    pair_bytes: list[list[int]]
    model_bytes: list[int]
    shared_bytes: list[int]
    total_bytes: int
    unique_bytes: int
    saved_bytes: int

    @property
    def only_bytes(self) -> list[int]:
        """Per model, bytes of content no other scanned model holds."""
        return [m - s for m, s in zip(self.model_bytes, self.shared_bytes)]


def plot_data(report: Report) -> PlotData:
    """The figures `write_plot` draws, taken from ``report``."""
    names = short_labels([m.path for m in report.models])
    return PlotData(
        labels=[f"[{i}] {n}" for i, n in enumerate(names)],
        pair_bytes=report.pair_shared_bytes(),
        model_bytes=[report.model_bytes(m) for m in report.models],
        shared_bytes=report.shared_with_others_bytes(),
        total_bytes=report.total_bytes,
        unique_bytes=report.unique_bytes,
        saved_bytes=report.saved_bytes,
    )


def _unit(largest: int) -> tuple[str, float]:
    """The unit every figure of the picture is given in: the largest that ``largest`` reaches."""
    return next(((name, scale) for name, scale in _UNITS if largest >= scale), _UNITS[-1])


def _short(value: float) -> str:
    return f"{value:.0f}" if value >= 100 or value == 0 else f"{value:.1f}" if value >= 10 else f"{value:.2f}"


@dataclass(frozen=True)
class _Layout:
    """Sizes in inches and points for ``n`` models: cells near 0.75 in for a few models, down
    to 0.36 in from 14 on; fonts follow the cells; values written in cells up to 12 models."""

    n: int
    cell: float
    tick_font: float
    label_in: float
    annotate: bool

    @classmethod
    def for_models(cls, labels: list[str]) -> _Layout:
        n = len(labels)
        cell = min(0.75, max(0.36, 5.0 / n))
        tick_font = max(6.5, min(10.0, cell * 17))
        return cls(n, cell, tick_font, max(map(len, labels)) * tick_font * 0.55 / 72, n <= 12)

    @property
    def heat_in(self) -> float:
        return max(2.2, self.n * self.cell)


_BARS_IN = 4.2
_SHARED_COLOR, _ONLY_COLOR, _DIAGONAL_COLOR = "#2a788e", "#f4a259", "#dddddd"


def _draw_heatmap(fig, ax, data: PlotData, unit: str, scale: float, layout: _Layout) -> None:
    import matplotlib

    n = layout.n
    matrix = [[float("nan") if i == j else b / scale for j, b in enumerate(row)] for i, row in enumerate(data.pair_bytes)]
    largest = max((v for row in matrix for v in row if v == v), default=0.0)
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad=_DIAGONAL_COLOR)
    image = ax.imshow(matrix, cmap=cmap, vmin=0, vmax=largest or 1.0, aspect="auto", interpolation="nearest")
    fig.colorbar(image, ax=ax, label=f"bytes shared ({unit})", aspect=20 + n, pad=0.02)
    ax.set_xticks(range(n), [f"[{i}]" for i in range(n)], fontsize=layout.tick_font)
    ax.set_yticks(range(n), data.labels, fontsize=layout.tick_font, parse_math=False)  # a path may hold $...$
    ax.tick_params(top=True, labeltop=True, bottom=False, labelbottom=False)
    ax.set_ylim(n - 0.5, -0.5)
    ax.set_title(f"bytes each pair of models shares ({unit})", fontsize=11)
    if layout.annotate:
        font = max(6.5, min(10.0, layout.cell * 13))
        for i, row in enumerate(matrix):
            for j, v in enumerate(row):
                text, color = ("-", "#555555") if v != v else (_short(v), "black" if v > 0.6 * largest else "white")
                ax.text(j, i, text, ha="center", va="center", fontsize=font, color=color)


def _draw_bars(fig, ax, data: PlotData, unit: str, scale: float, layout: _Layout) -> None:
    rows = range(layout.n)
    shared = [b / scale for b in data.shared_bytes]
    ax.barh(rows, shared, color=_SHARED_COLOR, label="content another model also holds")
    ax.barh(rows, [b / scale for b in data.only_bytes], left=shared, color=_ONLY_COLOR,
            label="content only this model holds")
    ax.tick_params(labelleft=False, labelsize=layout.tick_font)
    ax.set_xlabel(f"bytes per model ({unit})")
    ax.set_title("each model: shared vs unique bytes", fontsize=11)
    ax.grid(axis="x", alpha=0.3)
    fig.legend(loc="outside lower right", fontsize=9, frameon=False, ncols=2)
    if layout.annotate:
        for i, (s, m) in enumerate(zip(data.shared_bytes, data.model_bytes)):
            ax.text(m / scale, i, f" {100 * s / max(m, 1):.0f}%", va="center", fontsize=layout.tick_font)
        ax.set_xlim(0, max(data.model_bytes) / scale * 1.18 or 1.0)


def write_plot(report: Report, path: str | os.PathLike) -> Path:
    """Draw the heatmap and the per-model bars of ``report`` and write them to ``path`` as PNG
    (whatever its suffix).  Returns the path written.

    Raises:
        ImportError: matplotlib is not installed (`require_matplotlib`).
        ValueError: the report holds no model.
        OSError: the file cannot be written.
    """
    Figure, FigureCanvasAgg = require_matplotlib()
    if not report.models:
        raise ValueError("the report holds no model to plot")
    data = plot_data(report)
    layout = _Layout.for_models(data.labels)
    unit, scale = _unit(max(data.model_bytes))
    fig = Figure(figsize=(layout.label_in + layout.heat_in + 1.4 + _BARS_IN, layout.heat_in + 2.2), dpi=100,
                 layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(1, 2, width_ratios=[layout.heat_in + 1.0, _BARS_IN])
    heat = fig.add_subplot(grid[0])
    _draw_heatmap(fig, heat, data, unit, scale, layout)
    _draw_bars(fig, fig.add_subplot(grid[1], sharey=heat), data, unit, scale, layout)
    saved = 100 * data.saved_bytes / max(data.total_bytes, 1)
    fig.suptitle(f"vllm-dedup scan: {layout.n} model{'s' * (layout.n != 1)}, {size_text(data.total_bytes)} loaded alone, "
                 f"{size_text(data.unique_bytes)} stored once, {size_text(data.saved_bytes)} saved ({saved:.0f}%)",
                 fontsize=12)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    out = Path(path)
    out.write_bytes(buf.getvalue())
    return out
