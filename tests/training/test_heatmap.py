"""The expert-load heatmap figure: its size and cell size measured on the rendered image,
its labels, the colours of known shares at the right cells, and what the training
observer hands the logger (shares of routed assignments, the layer numbers, the
iteration; nothing, with one warning, without matplotlib)."""

from __future__ import annotations

import sys
import warnings
from types import SimpleNamespace

import numpy as np
import pytest

from megamoe.training import metrics
from megamoe.training.heatmap import (
    COLOURBAR_LABEL,
    MAX_WIDTH_PX,
    expert_load_heatmap,
    heatmap_figure,
    heatmap_geometry,
    rasterise,
    routed_shares,
)
from megamoe.training.metrics import TrainingObserver

pytest.importorskip("matplotlib")


def _viridis(v: float) -> np.ndarray:
    from matplotlib import colormaps

    return np.round(np.array(colormaps["viridis"](v)[:3]) * 255)


def _checkerboard(n_layers: int, n_experts: int) -> np.ndarray:
    """Half of every row's share on alternate experts: those cells are 2x uniform (top
    colour), the others 0 (bottom colour), and neighbours always differ."""
    board = (np.add.outer(np.arange(n_layers), np.arange(n_experts)) % 2).astype(float)
    return routed_shares(board)


def _runs(line_N3: np.ndarray) -> list[int]:
    """Lengths of the runs of the top or bottom colour along a line of pixels, from the
    first such pixel to the last (the plot area's cells; anything else between them, such
    as a blended pixel, ends a run and starts none)."""
    top, bottom = _viridis(1.0), _viridis(0.0)
    is_top = (np.abs(line_N3 - top) <= 1).all(axis=1)
    is_bottom = (np.abs(line_N3 - bottom) <= 1).all(axis=1)
    label = np.where(is_top, 1, np.where(is_bottom, 0, -1))
    idx = np.flatnonzero(label >= 0)
    label = label[idx[0]: idx[-1] + 1]
    runs, current, length = [], label[0], 0
    for v in label:
        if v == current:
            length += 1
        else:
            runs.append(length) if current >= 0 else None
            current, length = v, 1
    runs.append(length)
    return runs


@pytest.mark.parametrize("n_layers,n_experts", [(64, 256), (2, 4)])
def test_every_cell_measured_on_the_image(n_layers, n_experts):
    img = expert_load_heatmap(_checkerboard(n_layers, n_experts),
                              list(range(n_layers)), 10)
    g = heatmap_geometry(n_layers, n_experts)
    assert img.shape == (g.height, g.width, 3) and img.dtype == np.uint8
    assert img.shape[1] <= MAX_WIDTH_PX
    across = _runs(img[img.shape[0] // 2].astype(float))  # a row of pixels through the plot
    down = _runs(img[:, g.width // 2 - g.width // 8].astype(float))  # a column through it
    assert len(across) == n_experts and len(down) == n_layers
    assert min(across) >= 2 and min(down) >= 2
    if n_layers * n_experts <= 16:  # a small model's heatmap stays readable
        assert min(across) >= 40 and min(down) >= 40
        assert img.shape[0] >= 200 and img.shape[1] >= 350


def test_64x256_geometry_from_the_figure():
    fig = heatmap_figure(_checkerboard(64, 256), list(range(64)), 10)
    rasterise(fig)
    width, _ = fig.canvas.get_width_height()
    box = fig.axes[0].get_window_extent()
    assert width <= MAX_WIDTH_PX
    assert box.width / 256 >= 2 and box.height / 64 >= 2


def _texts(fig):
    """Every visible text of the figure with its box in pixels (after drawing)."""
    renderer = fig.canvas.get_renderer()
    out = []
    for ax in fig.axes:
        texts = [ax.title, ax.xaxis.label, ax.yaxis.label,
                 *ax.get_xticklabels(), *ax.get_yticklabels()]
        out.extend((t, t.get_window_extent(renderer)) for t in texts
                   if t.get_visible() and t.get_text())
    return out


def test_figure_carries_the_labels():
    share = routed_shares(np.ones((3, 8)))
    fig = heatmap_figure(share, [1, 5, 9], 1234)  # --moe-layer-freq: layers 1, 5, 9 are MoE
    img = rasterise(fig)
    ax, bar = fig.axes
    assert ax.get_title() == "expert load, iteration 1234"
    assert ax.get_xlabel() == "expert" and ax.get_ylabel() == "MoE layer"
    assert bar.get_ylabel() == COLOURBAR_LABEL == "share of routed tokens"
    assert [t.get_text() for t in ax.get_yticklabels()] == ["1", "5", "9"]
    assert [t.get_text() for t in ax.get_xticklabels()] == [str(e) for e in range(8)]
    labels = [t.get_text() for t in bar.get_yticklabels()]
    ticks = list(bar.get_yticks())
    assert labels.count("1/E") == 1 and ticks[labels.index("1/E")] == 1 / 8  # fair share
    round_ticks = [float(t) for t in labels if t != "1/E"]
    assert round_ticks[0] == 0.0 and max(round_ticks) <= 2 / 8 and len(round_ticks) >= 2
    for t in round_ticks:  # 1, 2, 2.5 or 5 x a power of ten: short labels
        assert len(f"{t:g}".lstrip("0.")) <= 2, t
    fair = [ln for ln in bar.lines if list(ln.get_ydata()) == [1 / 8, 1 / 8]]
    assert fair and fair[0].get_color() == "red"  # the marked line
    height, width = img.shape[:2]
    for text, box in _texts(fig):  # all drawn inside the image
        assert box.x0 >= 0 and box.y0 >= 0 and box.x1 <= width and box.y1 <= height, \
            text.get_text()


@pytest.mark.parametrize("n_experts", [3, 8, 64, 256])
def test_colour_bar_ticks_are_round_apart_and_mark_the_fair_share(n_experts):
    fig = heatmap_figure(routed_shares(np.ones((2, n_experts))), [0, 1], 1)
    rasterise(fig)
    bar = fig.axes[1]
    renderer = fig.canvas.get_renderer()
    boxes = sorted((t.get_window_extent(renderer) for t in bar.get_yticklabels()),
                   key=lambda b: b.y0)
    assert not any(a.overlaps(b) for a, b in zip(boxes, boxes[1:]))
    assert "1/E" in [t.get_text() for t in bar.get_yticklabels()]


def test_tick_labels_thinned_without_overlap_for_64x256():
    fig = heatmap_figure(_checkerboard(64, 256), list(range(0, 128, 2)), 10)
    rasterise(fig)
    ax = fig.axes[0]
    renderer = fig.canvas.get_renderer()
    for labels in (ax.get_xticklabels(), ax.get_yticklabels()):
        boxes = [t.get_window_extent(renderer) for t in labels]
        assert 8 <= len(boxes) < 256
        assert not any(a.overlaps(b) for a, b in zip(boxes, boxes[1:]))
    assert ax.get_yticklabels()[1].get_text() != "1"  # real layer numbers, thinned


def test_known_shares_map_to_the_colormap_at_their_cells():
    share = np.array([[1.0, 0.0, 0.0, 0.0],  # all of layer 0's tokens on expert 0
                      [0.25, 0.25, 0.25, 0.25],  # uniform: mid-scale
                      [0.0, 0.0, 0.5, 0.5]])  # two experts at 2x uniform
    fig = heatmap_figure(share, [0, 1, 2], 3)
    img = rasterise(fig).astype(float)
    box = fig.axes[0].get_window_extent()
    height = img.shape[0]
    for layer in range(3):
        for expert in range(4):
            x = int(box.x0 + (expert + 0.5) * box.width / 4)
            y = int(height - (box.y1 - (layer + 0.5) * box.height / 3))
            want = _viridis(min(share[layer, expert] / 0.5, 1.0))
            assert np.abs(img[y, x] - want).max() <= 1, (layer, expert, img[y, x], want)


def test_routed_shares_rows_sum_to_one():
    share = routed_shares(np.array([[3.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]))
    assert share.tolist() == [[0.75, 0.25, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]


class _Logger:
    def __init__(self):
        self.images = []

    def log_image(self, name, image, step):
        self.images.append((name, image, step))


def _observer(routed: dict[int, np.ndarray]) -> TrainingObserver:
    obs = TrainingObserver.__new__(TrainingObserver)  # only the interval's counts matter
    obs._routed_LE = routed
    return obs


def test_observer_logs_shares_with_layer_numbers_and_iteration():
    obs = _observer({5: np.array([3.0, 1.0, 0.0, 0.0]), 1: np.array([2.0, 2.0, 2.0, 2.0])})
    logger = _Logger()
    share = obs.write_heatmap(logger, 7)
    want = np.array([[0.25, 0.25, 0.25, 0.25], [0.75, 0.25, 0.0, 0.0]])  # layers 1, 5
    np.testing.assert_array_equal(share, want)
    [(name, img, step)] = logger.images
    assert name == "moe/expert_load_heatmap" and step == 7
    np.testing.assert_array_equal(img, expert_load_heatmap(want, [1, 5], 7))
    assert obs.write_heatmap(logger, 8) is None and len(logger.images) == 1  # interval reset


def test_shares_count_the_routers_choice_before_capacity(monkeypatch):
    kept, routed = np.array([2.0, 2.0, 0.0, 0.0]), np.array([4.0, 2.0, 1.0, 1.0])
    monkeypatch.setattr(metrics, "reduced_routing_stats",
                        lambda *a: {3: {"kept": kept, "routed": routed}})
    obs = _observer({})
    obs.model, obs.dp_group, obs.device, obs.per_layer = None, None, "cpu", False
    obs.run = SimpleNamespace(model=SimpleNamespace(moe=None))
    obs.after_step()
    obs.after_step()
    share = obs.write_heatmap(None, 2)
    np.testing.assert_array_equal(share, [[0.5, 0.25, 0.125, 0.125]])


def test_without_matplotlib_the_heatmap_is_skipped_with_one_warning(monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)  # importing any of them now fails
    monkeypatch.setattr(metrics, "_WARNED", set())
    logger = _Logger()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in (2, 4):
            share = _observer({0: np.ones(4)}).write_heatmap(logger, step)
            assert share.shape == (1, 4)
    assert logger.images == []
    assert [str(w.message) for w in caught if "heatmap" in str(w.message)] != []
    assert len([w for w in caught if "heatmap" in str(w.message)]) == 1
