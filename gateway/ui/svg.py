"""Line charts as inline SVG, drawn on the server: no script and no third-party library in the browser.

A chart is one `<svg>` with a polyline per series, its y range labelled, the x range under it, and a
legend; points of short series carry a `<title>` (the browser's tooltip) with their values. Points that
are not finite (a step without validation episodes: NaN) are left out; long series are thinned to
`MAX_POINTS` evenly spaced points, the last one kept.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from gateway.ui.html import Html, num, tag

PALETTE = ("#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#0891b2")
MAX_POINTS = 400
_DOTS_BELOW = 60  # series shorter than this get a dot (and tooltip) per point

Series = tuple[str, Sequence[tuple[float | None, float | None]]]  # a missing value is left out


def _thin(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    if len(points) <= MAX_POINTS:
        return points
    step = len(points) / (MAX_POINTS - 1)
    return [points[int(i * step)] for i in range(MAX_POINTS - 1)] + [points[-1]]


def _finite(points: Sequence[tuple[float | None, float | None]]) -> list[tuple[float, float]]:
    out = []
    for x, y in points:
        if x is None or y is None:
            continue
        x, y = float(x), float(y)
        if math.isfinite(x) and math.isfinite(y):
            out.append((x, y))
    return out


def line_chart(
    title: str,
    series: Sequence[Series],
    *,
    x_label: str = "",
    width: int = 520,
    height: int = 190,
    chart_id: str | None = None,
) -> Html:
    cleaned = [(name, _thin(_finite(points))) for name, points in series]
    cleaned = [(name, points) for name, points in cleaned if points]
    figure_id = chart_id or "chart-" + "".join(c if c.isalnum() else "-" for c in title.lower())
    if not cleaned:
        return tag("figure", tag("figcaption", title), tag("p", "no data yet", class_="empty"), id=figure_id)
    xs = [x for _, points in cleaned for x, _ in points]
    ys = [y for _, points in cleaned for _, y in points]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    if y1 == y0:
        pad = abs(y0) * 0.1 or 1.0
        y0, y1 = y0 - pad, y1 + pad
    left, right, top, bottom = 56, 10, 10, 24
    plot_w, plot_h = width - left - right, height - top - bottom

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * plot_w

    def sy(y: float) -> float:
        return top + (1 - (y - y0) / (y1 - y0)) * plot_h

    parts: list[Html] = [tag("title", title)]
    for frac in (0.0, 0.5, 1.0):  # horizontal grid lines, labelled with their value
        y = y0 + frac * (y1 - y0)
        parts.append(
            tag("line", x1=left, x2=width - right, y1=f"{sy(y):.1f}", y2=f"{sy(y):.1f}", class_="grid")
        )
        parts.append(tag("text", num(y), x=left - 4, y=f"{sy(y) + 4:.1f}", class_="ylabel"))
    parts.append(tag("text", num(x0), x=left, y=height - 6, class_="xlabel"))
    parts.append(tag("text", num(x1), x=width - right, y=height - 6, class_="xlabel end"))
    if x_label:
        parts.append(tag("text", x_label, x=left + plot_w / 2, y=height - 6, class_="xlabel mid"))
    legend = []
    for i, (name, points) in enumerate(cleaned):
        color = PALETTE[i % len(PALETTE)]
        coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in points)
        parts.append(tag("polyline", points=coords, fill="none", stroke=color, stroke_width=1.8))
        if len(points) < _DOTS_BELOW:
            for x, y in points:
                parts.append(
                    tag(
                        "circle",
                        tag("title", f"{name}: {num(y)} at {num(x)}"),
                        cx=f"{sx(x):.1f}",
                        cy=f"{sy(y):.1f}",
                        r=2.6,
                        fill=color,
                    )
                )
        legend.append(tag("span", tag("i", class_=f"swatch c{i % len(PALETTE)}"), name))
    svg = tag(
        "svg",
        parts,
        xmlns="http://www.w3.org/2000/svg",
        viewBox=f"0 0 {width} {height}",
        width=width,
        height=height,
        role="img",
        aria_label=title,
    )
    return tag("figure", tag("figcaption", title), svg, tag("div", legend, class_="legend"), id=figure_id)
