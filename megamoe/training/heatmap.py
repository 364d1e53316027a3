"""The expert-load heatmap: a labelled matplotlib figure (MoE layers down, experts across,
a colour bar in share of routed tokens, the iteration in the title), rasterised to the RGB
image TensorBoard and W&B show.

matplotlib is optional (the `logging` extra): it is imported inside the functions that
draw, and a missing matplotlib raises ImportError there, which the caller turns into a
skipped heatmap. The figure is a `matplotlib.figure.Figure` drawn by the Agg canvas, never
pyplot, so no global figure state or GUI backend is involved.

Geometry is chosen in pixels (72 dpi, so a point is a pixel) from the matrix shape: every
cell is at least MIN_CELL_PX wide and tall, the figure at most MAX_WIDTH_PX across as long
as that leaves MIN_CELL_PX per expert (up to about 900 experts; beyond that the minimum
cell wins and the figure grows), and small matrices get big cells and a minimum plot size
so the labels fit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

DPI = 72
MAX_WIDTH_PX = 2000
MAX_PLOT_H_PX = 1000
MIN_CELL_PX = 2
MAX_CELL_PX = 48
MIN_PLOT_W_PX, MIN_PLOT_H_PX = 240, 160
# Margins around the plot area: y tick labels and label | plot | gap, colour bar, its
# tick labels and label; x tick labels and label below, title above.
LEFT_PX, BOTTOM_PX, TOP_PX = 56, 44, 28
CBAR_GAP_PX, CBAR_W_PX, CBAR_LABELS_PX = 12, 14, 80
RIGHT_PX = CBAR_GAP_PX + CBAR_W_PX + CBAR_LABELS_PX
TICK_FONT_PX, LABEL_FONT_PX, TITLE_FONT_PX = 8, 10, 11
COLOURBAR_LABEL = "share of routed tokens"
FAIR_SHARE_LABEL, FAIR_SHARE_COLOUR = "1/E", "red"  # the balanced share, on the colour bar


@dataclass(frozen=True)
class HeatmapGeometry:
    """Pixel sizes: one cell, the plot area (cells only) and the whole figure."""

    cell_w: int
    cell_h: int
    plot_w: int
    plot_h: int
    width: int
    height: int


def heatmap_geometry(n_layers: int, n_experts: int) -> HeatmapGeometry:
    """Square cells as big as the width budget (MAX_WIDTH_PX less the margins) and the
    height budget allow, within [MIN_CELL_PX, MAX_CELL_PX]; a plot smaller than
    MIN_PLOT_W_PX x MIN_PLOT_H_PX stretches its cells to that size."""
    budget_w = MAX_WIDTH_PX - LEFT_PX - RIGHT_PX
    cell = min(budget_w // n_experts, MAX_PLOT_H_PX // n_layers, MAX_CELL_PX)
    cell = max(cell, MIN_CELL_PX)
    cell_w = max(cell, -(-MIN_PLOT_W_PX // n_experts))
    cell_h = max(cell, -(-MIN_PLOT_H_PX // n_layers))
    plot_w, plot_h = cell_w * n_experts, cell_h * n_layers
    return HeatmapGeometry(cell_w, cell_h, plot_w, plot_h,
                           LEFT_PX + plot_w + RIGHT_PX, BOTTOM_PX + plot_h + TOP_PX)


def tick_step(cell_px: int, min_spacing_px: float) -> int:
    """Label every step-th cell (a power of two) so labels are min_spacing_px apart."""
    step = 1
    while step * cell_px < min_spacing_px:
        step *= 2
    return step


def routed_shares(counts_LE: np.ndarray) -> np.ndarray:
    """[layers, experts] routed-assignment counts -> each expert's share of its layer's
    routed assignments (a row sums to 1; a layer that routed nothing is all zeros).

    Shares, not counts or load relative to the layer mean (what this heatmap showed
    before): counts grow with the interval and the batch, and relative load has no top,
    while a share is bounded, compares across runs with the same number of experts, and
    reads directly as "expert e took this fraction of layer l's tokens" (uniform: 1/E).
    """
    counts_LE = np.asarray(counts_LE, dtype=np.float64)
    total_L1 = counts_LE.sum(axis=1, keepdims=True)
    return np.divide(counts_LE, total_L1, out=np.zeros_like(counts_LE), where=total_L1 > 0)


def heatmap_figure(share_LE: np.ndarray, layer_numbers: Sequence[int], iteration: int):
    """The labelled matplotlib Figure of `share_LE` [layers, experts] (see routed_shares).

    Rows are the MoE layers, labelled with their layer numbers (`layer_numbers`, one per
    row: with --moe-layer-freq they skip the dense layers), columns the experts. Colours
    run from 0 to 2/E (viridis), so uniform routing is mid-scale and any share of 2x
    uniform or more is the top colour (the colour bar's arrow): a collapsing router shows
    as a few bright cells in a dark row. The colour bar has round ticks and the fair
    share 1/E marked (a red line, labelled "1/E").
    """
    from matplotlib.figure import Figure

    n_layers, n_experts = share_LE.shape
    if len(layer_numbers) != n_layers:
        raise ValueError(f"{len(layer_numbers)} layer numbers for {n_layers} rows")
    g = heatmap_geometry(n_layers, n_experts)
    fig = Figure(figsize=(g.width / DPI, g.height / DPI), dpi=DPI)
    ax = fig.add_axes((LEFT_PX / g.width, BOTTOM_PX / g.height,
                       g.plot_w / g.width, g.plot_h / g.height))
    cax = fig.add_axes(((LEFT_PX + g.plot_w + CBAR_GAP_PX) / g.width, BOTTOM_PX / g.height,
                        CBAR_W_PX / g.width, g.plot_h / g.height))
    uniform = 1.0 / n_experts
    image = ax.imshow(share_LE, cmap="viridis", vmin=0.0, vmax=2.0 * uniform,
                      interpolation="nearest", aspect="auto")
    x_step = tick_step(g.cell_w, TICK_FONT_PX * (0.6 * len(str(n_experts - 1)) + 1.5))
    y_step = tick_step(g.cell_h, TICK_FONT_PX * 1.5)
    ax.set_xticks(range(0, n_experts, x_step))
    ax.set_yticks(range(0, n_layers, y_step),
                  [str(layer_numbers[i]) for i in range(0, n_layers, y_step)])
    ax.tick_params(labelsize=TICK_FONT_PX)
    ax.set_xlabel("expert", fontsize=LABEL_FONT_PX, labelpad=2)
    ax.set_ylabel("MoE layer", fontsize=LABEL_FONT_PX, labelpad=2)
    ax.set_title(f"expert load, iteration {iteration}", fontsize=TITLE_FONT_PX, pad=6)
    bar = fig.colorbar(image, cax=cax, extend="max")
    ticks = colourbar_ticks(n_experts, g.plot_h)
    bar.set_ticks(ticks, labels=[FAIR_SHARE_LABEL if t == uniform else f"{t:.6g}"
                                 for t in ticks])
    bar.ax.axhline(uniform, color=FAIR_SHARE_COLOUR, linewidth=1.5)
    bar.ax.tick_params(labelsize=TICK_FONT_PX)
    bar.set_label(COLOURBAR_LABEL, fontsize=LABEL_FONT_PX, labelpad=4)
    return fig


def colourbar_ticks(n_experts: int, bar_px: int) -> list[float]:
    """Round ticks over the colour scale [0, 2/E] (1, 2, 2.5 or 5 times a power of ten,
    at most 5 of them), plus the fair share 1/E itself (labelled FAIR_SHARE_LABEL and
    marked by a line); a round tick closer than 1.25 label heights to 1/E is dropped so
    no two labels overlap."""
    from matplotlib.ticker import MaxNLocator

    top, uniform = 2.0 / n_experts, 1.0 / n_experts
    values = MaxNLocator(nbins=4, steps=[1, 2, 2.5, 5, 10]).tick_values(0.0, top)
    min_gap = 1.25 * TICK_FONT_PX * top / bar_px  # in share units
    rounded = [float(f"{v:.6g}") for v in values if -1e-12 <= v <= top * (1 + 1e-9)]
    return sorted([v for v in rounded if abs(v - uniform) >= min_gap] + [uniform])


def heatmap_png_dir(save: Optional[str], tensorboard_dir: Optional[str]) -> Optional[str]:
    """Where the heatmap PNGs go (written when the heatmap is drawn, i.e. with
    --tensorboard-dir or --wandb-project): <--save>/expert_load, else
    <--tensorboard-dir>/expert_load, else nowhere (None: W&B alone keeps its copy)."""
    base = save or tensorboard_dir
    return None if not base else os.path.join(base, "expert_load")


def write_png(image_HW3: np.ndarray, directory: str, iteration: int) -> str:
    """`image_HW3` as <directory>/iter_NNNNNNN.png (the iteration as Megatron names
    checkpoints), written to a temporary name and renamed, so a reader never sees half a
    file; returns the path."""
    from matplotlib.image import imsave

    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"iter_{iteration:07d}.png")
    tmp = f"{path}.tmp-{os.getpid()}"
    imsave(tmp, image_HW3, format="png")
    os.replace(tmp, path)
    return path


def rasterise(fig) -> np.ndarray:
    """A matplotlib Figure drawn by the Agg canvas -> RGB uint8 [H, W, 3]."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def expert_load_heatmap(share_LE: np.ndarray, layer_numbers: Sequence[int],
                        iteration: int) -> np.ndarray:
    """The heatmap of `share_LE` as an RGB uint8 image [H, W, 3] (ImportError without
    matplotlib)."""
    return rasterise(heatmap_figure(share_LE, layer_numbers, iteration))
