"""Reading the charts back: what each bar and segment holds, in bytes converted to the chart's unit."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from vramlab.app.views.bars import StackedBarPlot


def drawn_heights(plot: StackedBarPlot) -> dict[float, dict[str, float]]:
    """{bar x: {segment key: height}} read from the BarGraphItems themselves (what is painted)."""
    out: dict[float, dict[str, float]] = {}
    for key, item in plot.bar_items().items():
        xs = np.atleast_1d(np.asarray(item.opts["x"], dtype=float))
        hs = np.atleast_1d(np.asarray(item.opts["height"], dtype=float))
        for x, h in zip(xs, hs):
            out.setdefault(round(float(x), 3), {})[key] = float(h)
    return out


def drawn_bottoms(plot: StackedBarPlot) -> dict[float, dict[str, float]]:
    out: dict[float, dict[str, float]] = {}
    for key, item in plot.bar_items().items():
        xs = np.atleast_1d(np.asarray(item.opts["x"], dtype=float))
        ys = np.atleast_1d(np.asarray(item.opts["y0"], dtype=float))
        for x, y in zip(xs, ys):
            out.setdefault(round(float(x), 3), {})[key] = float(y)
    return out


def expected(components: Mapping, factor: int) -> dict[str, float]:
    return {f"kind:{k.value}": v / factor for k, v in components.items() if v}
