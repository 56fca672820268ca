"""HTML built in Python with escaping by default: everything that is not `Html` is text, escaped.

The dashboard shows what agents sent (an agent under training is adversarial): a message is text, never
markup. `tag` escapes every child that is not `Html` and every attribute value, so markup only comes from
this package's own code; `page` wraps a body in the dashboard's layout.
"""

from __future__ import annotations

import html
import math
import time
from collections.abc import Iterable
from typing import Any

__all__ = ["Html", "escape", "tag", "join", "page", "num", "when", "truncate"]


class Html(str):
    """Markup already escaped or built by `tag`: inserted as it is."""

    __slots__ = ()


def escape(value: Any) -> Html:
    return value if isinstance(value, Html) else Html(html.escape(str(value), quote=True))


def _children(children: Iterable[Any]) -> Iterable[str]:
    for child in children:
        if child is None or child is False:
            continue
        if isinstance(child, (list, tuple)) or (
            not isinstance(child, (str, bytes, int, float)) and isinstance(child, Iterable)
        ):
            yield from _children(child)
        else:
            yield escape(child)


def tag(element: str, /, *children: Any, **attrs: Any) -> Html:
    """`<element attrs>children</element>`. Attribute names: a trailing `_` is dropped (`class_`), `_` becomes
    `-` (`data_refresh`); None or False leaves the attribute out, True writes it bare."""
    parts = [element]
    for key, value in attrs.items():
        if value is None or value is False:
            continue
        key = key.rstrip("_").replace("_", "-")
        parts.append(key if value is True else f'{key}="{escape(value)}"')
    head = "<" + " ".join(parts) + ">"
    if element in ("br", "meta", "link", "input", "img", "hr"):
        return Html(head)
    return Html(head + "".join(_children(children)) + f"</{element}>")


def join(items: Iterable[Any]) -> Html:
    return Html("".join(_children(items)))


def num(value: Any) -> str:
    """A number as the dashboard shows it: integers whole, floats to 4 significant digits, — for none."""
    if value is None or isinstance(value, bool):
        return "—" if value is None else str(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return "—" if not math.isfinite(value) else f"{value:.4g}"
    return str(value)


def when(ts: float | None) -> str:
    """Unix seconds as UTC `YYYY-MM-DD HH:MM:SS`."""
    if ts is None or not math.isfinite(ts):
        return "—"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ts))


def truncate(text: str, limit: int) -> tuple[str, int]:
    """`text` cut to `limit` characters, and how many were cut."""
    return (text, 0) if len(text) <= limit else (text[:limit], len(text) - limit)


_NAV = (
    ("overview", "/ui", "Overview"),
    ("rollouts", "/ui/rollouts", "Rollouts"),
    ("training", "/ui/training", "Training"),
)


def page(title: str, body: Any, active: str = "", logout: bool = True) -> bytes:
    """A whole page: the layout, its navigation, the stylesheet and script (served under /ui/static)."""
    nav = [
        tag("a", label, href=href, class_="active" if key == active else None, id=f"nav-{key}")
        for key, href, label in _NAV
    ]
    if logout:
        nav.append(tag("form", tag("button", "Log out", type="submit"), method="post", action="/ui/logout"))
    document = tag(
        "html",
        tag(
            "head",
            tag("meta", charset="utf-8"),
            tag("meta", name="viewport", content="width=device-width, initial-scale=1"),
            tag("title", f"rlgate · {title}"),
            tag("link", rel="stylesheet", href="/ui/static/dashboard.css"),
            tag("link", rel="icon", href="/ui/static/favicon.svg", type="image/svg+xml"),
            tag("script", src="/ui/static/dashboard.js", defer=True),
        ),
        tag("body", tag("header", tag("strong", "rlgate"), tag("nav", nav)), tag("main", body)),
        lang="en",
    )
    return ("<!doctype html>\n" + document).encode()
