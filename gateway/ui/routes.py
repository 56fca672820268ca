"""The dashboard's routes, under /ui on the operator surface (`gateway.app` serves them only there: on the
control port when there is one, 404 on the agent port).

Who may see it: the operator, as on every operator route. The routes are added as checking their own
credential (`Gateway.add_routes(signed=True)`), since a browser sends a cookie rather than a Bearer
header: a request passes with `Authorization: Bearer OPERATOR_TOKEN`, or with the session cookie that the
login form or `?token=` sets (`gateway.ui.session`); without either, pages redirect to the login form and
the refreshing fragments answer 401. A gateway without an operator token serves the dashboard as it serves
its other operator routes on that listener: to whoever reaches it. Every page is read-only.

Reads are bounded: the listing reads at most `LIST_MAX` index entries a page, a rollout page at most
`CALLS_MAX` calls, the training page at most `STEPS_MAX` steps; pages are rendered in a worker thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import parse_qs, urlencode, urlsplit

from fastapi import APIRouter, Request
from fastapi.responses import Response

from gateway.ui import overview, rollouts, session, training
from gateway.ui.html import join, page, tag
from rlgate import episodes
from rlgate.episodes.overview import StoreOverview
from rlgate.episodes.records import RolloutStatus

if TYPE_CHECKING:
    from gateway.app import Gateway

router = APIRouter(prefix="/ui", include_in_schema=False)

LIST_MAX = 200  # index entries one listing page reads
CALLS_MAX = 50  # calls one rollout page shows
CALLS_DEFAULT = 20
STEPS_DEFAULT = 200
REFRESH_S = 3.0  # how often the overview refreshes itself
RECENT = 10  # rollouts on the overview
_HEADERS = {
    # no inline script or style: markup that slipped through could not run
    "content-security-policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-store",
}
_STATIC = {
    "dashboard.css": "text/css; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "favicon.svg": "image/svg+xml",
}


class Dashboard:
    """What the dashboard's handlers share, kept on the management app's state (`dashboard(request)`)."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.store = gateway.store
        settings = gateway.settings
        self.overview = StoreOverview(gateway.store, settings.reward_queue, settings.learner_group)
        self.rates = overview.Rates()
        self.static = {
            name: resources.files("gateway.ui").joinpath("static", name).read_bytes() for name in _STATIC
        }

    @property
    def token(self) -> bytes | None:
        return self.gateway.credentials.operator_token

    def authorized(self, request: Request) -> bool:
        if self.token is None:
            return True
        authorization = request.headers.get("authorization", "").encode("latin-1", "replace")
        if self.gateway.credentials.is_operator(authorization):
            return True
        return session.valid(self.token, request.cookies.get(session.COOKIE))


def install(gateway: Gateway) -> APIRouter:
    """Keep the dashboard's state on the gateway's management app; the router to add (as signed)."""
    gateway.api.state.dashboard = Dashboard(gateway)
    return router


def dashboard(request: Request) -> Dashboard:
    return cast(Dashboard, request.app.state.dashboard)


class BadParam(ValueError):
    pass


def _html(body: bytes, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(body, status, {**_HEADERS, **(headers or {})}, media_type="text/html; charset=utf-8")


def _message_page(status: int, title: str, text: str) -> Response:
    return _html(page(title, join([tag("h1", title), tag("p", text, class_="error")])), status)


def _param(request: Request, name: str) -> str | None:
    value = request.query_params.get(name)
    return value.strip() or None if value is not None else None


def _number(request: Request, name: str, kind: type, lo: float | None = None, hi: float | None = None) -> Any:
    raw = _param(request, name)
    if raw is None:
        return None
    try:
        value = kind(raw)
    except ValueError:
        raise BadParam(f"{name} must be {'an integer' if kind is int else 'a number'}, not {raw!r}") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise BadParam(f"{name} must be a finite number, not {raw!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f"at least {lo}" if hi is None else f"between {lo} and {hi}"
        raise BadParam(f"{name} must be {bounds}, not {raw!r}")
    return value


def _secure(request: Request) -> bool:
    """The session cookie is `Secure` when the browser reached the dashboard over https: directly, or
    through a TLS-terminating proxy that says so (`X-Forwarded-Proto: https` or `Forwarded: proto=https`).
    The headers are taken from anyone: a false one only makes the cookie Secure on a plain connection,
    where the browser then does not send it back (a failed login, never a leaked cookie)."""
    if request.url.scheme == "https":
        return True
    forwarded_proto = request.headers.get("x-forwarded-proto", "").split(",")[0].strip().lower()
    forwarded = request.headers.get("forwarded", "").split(",")[0].lower().replace(" ", "")
    return forwarded_proto == "https" or "proto=https" in forwarded.split(";")


def _safe_next(target: str | None) -> str:
    """Where to go after login: a dashboard path on this gateway only (never another site)."""
    if not target or not target.startswith("/ui") or "//" in target or "\\" in target:
        return "/ui"
    return target


async def _gate(request: Request, fragment: bool = False) -> Response | None:
    """None when the request may see the page; else the answer: the login form (or 401 for a fragment),
    or, for `?token=`, the cookie and a redirect to the same URL without the token."""
    d = dashboard(request)
    token = request.query_params.get("token")
    if token is not None and d.token is not None:
        if not session.token_matches(d.token, token):
            return _login_page(request.url.path, "That is not the operator token.", 401)
        rest = urlencode([(k, v) for k, v in request.query_params.multi_items() if k != "token"])
        location = request.url.path + (f"?{rest}" if rest else "")
        cookie = session.set_cookie(session.issue(d.token), _secure(request))
        return Response(status_code=303, headers={**_HEADERS, "location": location, "set-cookie": cookie})
    if d.authorized(request):
        return None
    if fragment:
        return Response(b"log in again", 401, _HEADERS, media_type="text/plain")
    target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    return Response(
        status_code=303, headers={**_HEADERS, "location": "/ui/login?" + urlencode({"next": target})}
    )


def _login_page(target: str, problem: str = "", status: int = 200) -> Response:
    form = tag(
        "form",
        tag(
            "label", "Operator token", tag("input", type="password", name="token", id="token", autofocus=True)
        ),
        tag("input", type="hidden", name="next", value=_safe_next(target)),
        tag("button", "Log in", type="submit", id="login"),
        method="post",
        action="/ui/login",
        class_="login",
    )
    body = join([tag("h1", "rlgate dashboard"), tag("p", problem, class_="error") if problem else None, form])
    return _html(page("log in", body, logout=False), status)


@router.get("/login")
async def login_form(request: Request) -> Response:
    if dashboard(request).token is None:
        return Response(status_code=303, headers={**_HEADERS, "location": "/ui"})
    return _login_page(request.query_params.get("next") or "/ui")


def _cross_site(request: Request) -> Response | None:
    """A 403 page for a form posted from another site (the state-changing routes: login and logout), else
    None. The browser says where a request comes from: `Sec-Fetch-Site` (same-origin, or none when the user
    typed it) and `Origin`, whose host must be the one the request was sent to (our pages' `no-referrer`
    policy makes a browser send `Origin: null` for their own forms, so that one says nothing). A request
    with neither (a script, curl) is let through: it cannot carry the operator's browser session."""
    site = request.headers.get("sec-fetch-site")
    if site is not None and site not in ("same-origin", "none"):
        return _message_page(403, "Forbidden", f"a form posted from another site ({site}) is refused")
    origin = request.headers.get("origin")  # "null" from our own pages too (their referrer policy)
    if origin not in (None, "null") and urlsplit(origin).netloc != request.headers.get("host"):
        return _message_page(403, "Forbidden", "a form posted from another origin is refused")
    return None


@router.post("/login")
async def login(request: Request) -> Response:
    if (refused := _cross_site(request)) is not None:
        return refused
    d = dashboard(request)
    try:
        form = parse_qs((await request.body()).decode("utf-8", "replace"), max_num_fields=4)
    except ValueError:  # more fields than the form has
        return _message_page(400, "Bad request", "the login form has two fields: token and next")
    target = _safe_next((form.get("next") or ["/ui"])[0])
    if d.token is None:
        return Response(status_code=303, headers={**_HEADERS, "location": target})
    if not session.token_matches(d.token, (form.get("token") or [""])[0]):
        return _login_page(target, "That is not the operator token.", 401)
    cookie = session.set_cookie(session.issue(d.token), _secure(request))
    return Response(status_code=303, headers={**_HEADERS, "location": target, "set-cookie": cookie})


@router.post("/logout")
async def logout(request: Request) -> Response:
    if (refused := _cross_site(request)) is not None:
        return refused
    cookie = session.clear_cookie(_secure(request))
    return Response(status_code=303, headers={**_HEADERS, "location": "/ui/login", "set-cookie": cookie})


@router.get("/static/{name}")
async def static(name: str, request: Request) -> Response:
    if name not in _STATIC:
        return Response(b"not found", 404, _HEADERS, media_type="text/plain")
    headers = {**_HEADERS, "cache-control": "max-age=300"}
    return Response(dashboard(request).static[name], 200, headers, media_type=_STATIC[name])


Render = Callable[[Request, bool], Awaitable[Response]]


def _page(path: str, live: bool = False) -> Callable[[Render], Render]:
    """Register `render(request, fragment)` as the page at `path`, behind the login gate (a `live` page's
    `?fragment=1`, its refreshing part, gets 401 rather than the login form); a bad parameter (BadParam)
    answers a 400 page, Redis down a 503 page."""

    def register(render: Render) -> Render:
        async def serve(request: Request) -> Response:
            fragment = live and request.query_params.get("fragment") == "1"
            if (answer := await _gate(request, fragment)) is not None:
                return answer
            try:
                return await render(request, fragment)
            except BadParam as exc:
                return _message_page(400, "Bad request", str(exc))
            except episodes.StoreUnavailable as exc:
                return _message_page(503, "Redis unavailable", str(exc))

        router.add_api_route(path, serve, methods=["GET"], name=render.__name__)
        return render

    return register


@_page("", live=True)
async def overview_page(request: Request, fragment: bool) -> Response:
    d = dashboard(request)
    metrics = d.gateway.metrics
    counts, steps, recent = await asyncio.gather(
        d.overview.counts(), d.overview.learner_steps(STEPS_DEFAULT), d.store.list_rollouts(limit=RECENT)
    )
    # with several workers this reads every worker's metric files: off the event loop
    calls, errors = await asyncio.to_thread(
        lambda: (
            overview.counter_values(metrics.registry, metrics.calls, "outcome"),
            overview.counter_values(metrics.registry, metrics.errors, "kind"),
        )
    )
    rates = d.rates.add(
        {
            "calls": sum(calls.values()),
            "closed": counts.closed_total,
            **{f"error:{k}": v for k, v in errors.items()},
        }
    )
    watch = d.gateway.proxy.watch
    servers = d.gateway.servers
    snap = overview.Snapshot(
        counts,
        steps,
        calls,
        errors,
        rates,
        recent.rollouts,
        watch.backlog,
        watch.holding,
        servers.report() if servers.several else (),
    )
    if fragment:
        return _html((await asyncio.to_thread(overview.live, snap)).encode())
    body = await asyncio.to_thread(overview.render, snap, REFRESH_S)
    return _html(page("overview", body, "overview"))


@_page("/rollouts")
async def rollouts_page(request: Request, fragment: bool) -> Response:
    d = dashboard(request)
    status = _param(request, "status")
    mode = _param(request, "mode")
    if status is not None and status not in {s.value for s in RolloutStatus}:
        raise BadParam(f"status must be one of {', '.join(s.value for s in RolloutStatus)}")
    if mode not in (None, "train", "val"):
        raise BadParam("mode must be train or val")
    f = rollouts.Filters(
        task=_param(request, "task"),
        status=RolloutStatus(status) if status else None,
        mode=mode,
        agent=_param(request, "agent"),
        version=_number(request, "version", int, 0),
        min_reward=_number(request, "min_reward", float),
        max_reward=_number(request, "max_reward", float),
        since=_number(request, "since", float, 0),
        until=_number(request, "until", float, 0),
        limit=_number(request, "limit", int, 1, LIST_MAX) or 50,
    )
    cursor = _param(request, "cursor")
    try:
        listing = await d.store.list_rollouts(
            task_id=f.task, status=f.status, since=f.since, until=f.until, limit=f.limit, cursor=cursor
        )
    except ValueError as exc:
        raise BadParam(str(exc)) from exc
    body = await asyncio.to_thread(
        rollouts.listing, f, listing.rollouts, listing.next_cursor, len(listing.rollouts)
    )
    return _html(page("rollouts", body, "rollouts"))


@_page("/rollouts/{rollout_id}")
async def rollout_page(request: Request, fragment: bool) -> Response:
    rollout_id = request.path_params["rollout_id"]
    d = dashboard(request)
    try:
        episodes.validate_episode_id(rollout_id)
    except episodes.InvalidId as exc:
        raise BadParam(str(exc)) from exc
    offset = _number(request, "offset", int, 0, 2**62) or 0
    limit = _number(request, "limit", int, 1, CALLS_MAX) or CALLS_DEFAULT
    view, total = await asyncio.gather(
        d.store.get_rollout_view(rollout_id, offset, limit), d.overview.call_count(rollout_id)
    )
    if view is None:
        return _message_page(404, "No such rollout", f"no rollout {rollout_id!r}")
    body = await asyncio.to_thread(rollouts.rollout, view, offset, limit, total)
    return _html(page(f"rollout {rollout_id}", body, "rollouts"))


@_page("/training", live=True)
async def training_page(request: Request, fragment: bool) -> Response:
    d = dashboard(request)
    count = _number(request, "steps", int, 1, 2000) or STEPS_DEFAULT
    steps = await d.overview.learner_steps(count)
    if fragment:
        return _html((await asyncio.to_thread(training.live, steps)).encode())
    body = await asyncio.to_thread(training.render, steps, REFRESH_S * 3, count)
    return _html(page("training", body, "training"))
