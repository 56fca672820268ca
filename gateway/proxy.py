"""The hot path: forward one agent call upstream, record it in Redis, release the answer.

A call is committed to Redis before its response (or its stream's final event) is released to the agent:
an agent never holds an answer that was not recorded (unless `on_store_error=pass` says otherwise).
This module speaks raw ASGI: the per-call cost of a web framework is most of the gateway's budget. For
the same reason its log lines carry rollout_id, task_id and policy_version as explicit keys instead of
binding them with structlog's contextvars (measured: 3% of the gateway's CPU per call).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, NoReturn

import orjson
import structlog

from gateway import capture, errors, messages, responses
from gateway._asgi import disconnected, error_event, read_json, send_body
from gateway._http import BodyTooLarge
from gateway.air import AutomaticRewards
from gateway.auth import Credentials
from gateway.metrics import GatewayMetrics
from gateway.servers import Server, Servers
from gateway.settings import GatewaySettings
from gateway.streaming import DONE, StreamRelay, TranslatedRelay
from gateway.watch import StoreWatch
from rlgate import episodes
from rlgate.episodes import CallError, CallRecord, Endpoint, EpisodeStore
from rlgate.episodes.api_error import from_store

log = structlog.get_logger("rlgate.gateway")

UPSTREAM_PATHS: dict[str, str] = {
    "chat.completions": "/chat/completions",
    "completions": "/completions",
}
_JSON = (b"content-type", b"application/json")


AGENT_NAME_MAX = 256  # characters of an X-Agent-Name header


@dataclass(slots=True)
class Call:
    """What the gateway knows about one agent call while serving it."""

    rollout_id: str
    task_id: str | None
    agent_name: str | None
    endpoint: Endpoint
    request: dict[str, Any]
    policy_version: int
    started_at: float
    t0: float
    rollout_header: tuple[bytes, bytes]
    served_model: str | None = None  # the adapter the call was sent to, when the policy pointer named one
    keyed: bool = False  # a rollout key named the rollout: it must exist (POST /rollouts made it)
    mode: episodes.Mode | None = None  # the mode the call's URL names (Agent Lightning's), None: any
    alias_of: str | None = None  # the model name the alias resolved to (model_aliases)
    agent_api: episodes.AgentApi | None = None  # the API the agent spoke, when translated to chat
    asked: responses.Request | None = None  # a Responses call: what its answer echoes of the request
    server: Server | None = None  # the inference server it goes to (`gateway.servers`)
    rerouted_from: str | None = None  # the server the rollout's earlier calls went to, when moved

    @property
    def stream(self) -> bool:
        return capture.is_true(self.request.get("stream"))

    @property
    def model(self) -> str | None:
        if self.alias_of is not None:
            return self.alias_of
        model = self.request.get("model")
        return model if isinstance(model, str) else None

    def log_keys(self) -> dict[str, Any]:
        return {"rollout_id": self.rollout_id, "task_id": self.task_id, "policy_version": self.policy_version}


class Caller(NamedTuple):
    """Who a call is from (`Proxy._identify`): its rollout (an attempt's episode id for a later attempt), task,
    agent name, whether a rollout key named the rollout, the mode its URL names, whether the agent named the
    rollout (a made-up id sticks to no server), and whether the agent keeps the token ids."""

    rollout_id: str
    task_id: str | None
    agent_name: str | None
    keyed: bool
    mode: episodes.Mode | None
    named: bool
    keep_token_ids: bool


class Proxy:
    def __init__(
        self,
        settings: GatewaySettings,
        store: EpisodeStore,
        servers: Servers,
        metrics: GatewayMetrics,
        credentials: Credentials,
    ) -> None:
        self.settings = settings
        self.store = store
        self.servers = servers
        self.metrics = metrics
        self.inject = settings.upstream_kind == "vllm"
        self.watch = StoreWatch(settings, store, metrics)
        self.credentials = credentials
        self.check_credentials = credentials.agent_checked  # False: the open development mode
        self.air = (
            AutomaticRewards(store, settings.air_reward, settings.air_error_patterns)
            if settings.air
            else None
        )
        self.aliases = settings.model_aliases
        self._background: set[asyncio.Task[Any]] = set()

    @property
    def policy(self) -> episodes.Policy:
        """The policy pointer as last read from Redis (`watch.StoreWatch`)."""
        return self.watch.policy

    @property
    def policy_version(self) -> int:
        return self.watch.policy.version

    # -----------------------------------------------------------------------------------------------------
    # Entry points

    async def models(self, scope: dict[str, Any], send: Any, rollout_id: str | None) -> None:
        self._authorize_unrecorded(scope, rollout_id)
        status, body = await self._ask_any("GET", "/models", None, "model list")
        if status != 200:
            body = orjson.dumps({"error": errors.upstream_error_payload(status, body)})
        await send_body(send, status, body, [_JSON])

    def _authorize_unrecorded(self, scope: dict[str, Any], rollout_id: str | None) -> None:
        """The agent's credential for a request that records nothing (the model list, a token count), for
        the rollout its path or X-Rollout-Id names; 401/403 as for a call."""
        if self.check_credentials:
            headers = scope["headers"]
            named = next((v.decode("latin-1") for k, v in headers if k == b"x-rollout-id"), None)
            self.credentials.authorize_agent(_authorization(headers), rollout_id or named)

    async def _ask_any(
        self, method: str, path: str, body: bytes | None, what: str, root: bool = False
    ) -> tuple[int, bytes]:
        """(status, body) of a request that is no rollout's call (the model list, a token count), to any
        healthy server, read up to max_answer_bytes."""
        try:
            async with self.servers.any().upstream.request(method, path, body, root=root) as response:
                return response.status, await response.read(limit=self.settings.max_answer_bytes)
        except BodyTooLarge as exc:
            raise errors.BadUpstreamAnswer(
                f"the inference server's {what} is over {exc.limit} bytes (max_answer_bytes)"
            ) from exc

    async def count_tokens(
        self, scope: dict[str, Any], receive: Any, send: Any, rollout_id: str | None
    ) -> None:
        """`POST .../v1/messages/count_tokens`: the prompt's length as the policy's chat template renders
        it (the upstream's `/tokenize`, as vLLM counts); nothing is recorded."""
        self._authorize_unrecorded(scope, rollout_id)
        try:
            chat = messages.to_chat(await read_json(receive, self.settings.max_body_bytes), count_only=True)
        except capture.InvalidField as exc:
            raise _refused(exc) from exc
        model = self.aliases.get(chat["model"], chat["model"]) if self.aliases else chat["model"]
        request = {"model": model, "messages": chat["messages"], "add_generation_prompt": True}
        for name in ("tools", "chat_template_kwargs"):  # as vLLM renders the prompt it counts
            if name in chat:
                request[name] = chat[name]
        status, raw = await self._ask_any(
            "POST", "/tokenize", orjson.dumps(request), "token count", root=True
        )
        if status != 200:
            payload = errors.upstream_error_payload(status, raw)
            await send_body(
                send, status, messages.error_body(status, str(payload.get("message") or "")), [_JSON]
            )
            return
        try:
            answer = messages.count(orjson.loads(raw))
        except (ValueError, KeyError, TypeError) as exc:
            raise errors.BadUpstreamAnswer(
                f"unreadable token count from the inference server: {raw[:200]!r}"
            ) from exc
        await send_body(send, 200, orjson.dumps(answer), [_JSON])

    async def call(
        self,
        scope: dict[str, Any],
        receive: Any,
        send: Any,
        endpoint: Endpoint | Literal["messages"],
        rollout_id: str | None,
        task_id: str | None,
        attempt: tuple[str, episodes.Mode] | None = None,
    ) -> None:
        """A recorded call, in four steps: who calls (`_identify`: credentials, ids), whether it may
        (`_admit_call`: lost rollouts, the backlog hold, the body read and bounded, a push's drain), what
        goes upstream (`_upstream_request`: injection, aliases, the adapter, the record's size), then routed,
        served and committed (`_dispatch`)."""
        started_at, t0 = time.time(), time.perf_counter()
        caller = self._identify(scope, rollout_id, task_id, attempt)
        body, endpoint, agent_api, asked, policy = await self._admit_call(
            receive, endpoint, caller.rollout_id
        )
        call = Call(
            caller.rollout_id,
            caller.task_id,
            caller.agent_name,
            endpoint,
            body,
            policy.version,
            started_at,
            t0,
            (b"x-rollout-id", caller.rollout_id.encode()),
            keyed=caller.keyed,
            mode=caller.mode,
            agent_api=agent_api,
            asked=asked,
        )
        upstream_raw, injected = self._upstream_request(call, policy, caller.keep_token_ids)
        await self._dispatch(call, policy, upstream_raw, injected, receive, send, sticky=caller.named)

    def _identify(
        self,
        scope: dict[str, Any],
        rollout_id: str | None,
        task_id: str | None,
        attempt: tuple[str, episodes.Mode] | None,
    ) -> Caller:
        """The call's rollout, task, agent name and credential, from its path and headers: checked before
        anything is read, recorded or sent upstream (401/403, 400 for an id no rollout can have)."""
        agent_name = None
        authorization = b""
        keep_token_ids = (
            self.settings.keep_token_ids or attempt is not None
        )  # Agent Lightning's agents read them
        for name, value in scope["headers"]:
            if name == b"x-rollout-id":
                rollout_id = rollout_id or value.decode("latin-1")
            elif name == b"x-task-id":
                task_id = task_id or value.decode("latin-1")
            elif name == b"x-agent-name":
                agent_name = value.decode("utf-8", "replace")
            elif name == b"authorization":
                authorization = value
            elif name == b"x-api-key" and not authorization:  # Anthropic's SDKs send their key so
                authorization = b"Bearer " + value
            elif name == b"x-rlgate-keep-token-ids":
                keep_token_ids = capture.is_true(value.decode("latin-1"))
        keyed = False
        if self.check_credentials:
            rollout_id, keyed = self.credentials.authorize_agent(authorization, rollout_id)
        named = rollout_id is not None  # a rollout id made up here is nobody's to stick to a server
        mode = None
        try:
            if rollout_id is None:
                if self.settings.require_rollout_id:
                    raise errors.BadRequest(
                        "no rollout id: call through /rollouts/{rollout_id}/v1 or send X-Rollout-Id",
                        code="missing_rollout_id",
                    )
                rollout_id = uuid.uuid4().hex
            else:
                episodes.validate_id(rollout_id, "rollout id")
            if task_id is not None:
                episodes.validate_id(task_id, "task id")
            if attempt is not None:  # Agent Lightning: a later attempt of a rollout is an episode of its own
                attempt_id, mode = attempt
                rollout_id = episodes.attempt_episode(rollout_id, attempt_id)
        except episodes.InvalidId as exc:
            raise from_store(exc) from exc
        if agent_name is not None and len(agent_name) > AGENT_NAME_MAX:  # kept in every record and listing
            raise errors.BadRequest(
                f"X-Agent-Name is {len(agent_name)} characters: at most {AGENT_NAME_MAX}",
                code="invalid_agent_name",
                param="X-Agent-Name",
            )
        return Caller(rollout_id, task_id, agent_name, keyed, mode, named, keep_token_ids)

    async def _admit_call(
        self, receive: Any, endpoint: Endpoint | Literal["messages"], rollout_id: str
    ) -> tuple[dict[str, Any], Endpoint, episodes.AgentApi | None, responses.Request | None, episodes.Policy]:
        """(body, endpoint, the API the agent spoke, what a Responses answer echoes, the policy it is served
        by) once the call may go on: not a rollout Redis lost (409), held while new rollouts are
        (`max_backlog`, Redis memory), its body read within `max_body_bytes` (a Messages or Responses request
        translated to chat as vLLM does), its fields and answer bounds checked (400), and after a push's
        drain."""
        watch = self.watch
        if watch.lost and rollout_id in watch.lost:
            self.metrics.calls.labels(endpoint, "rollout_data_lost").inc()
            watch.refuse_lost(rollout_id)
        if watch.holding and rollout_id not in watch.recent and not await self._rollout_exists(rollout_id):
            await self._after_backlog(endpoint)
        body = await read_json(receive, self.settings.max_body_bytes)
        agent_api: episodes.AgentApi | None = None
        asked = None
        if endpoint == "messages":  # served as the chat completion vLLM's /v1/messages would make of it
            try:
                body = messages.to_chat(body)
            except capture.InvalidField as exc:
                raise _refused(exc) from exc
            endpoint, agent_api = "chat.completions", "anthropic.messages"
        elif endpoint == "responses":  # served as the chat completion vLLM's /v1/responses renders
            self._check(endpoint, body)  # first in its own fields, so that an error names them
            try:
                body, asked = responses.to_chat(body)
            except capture.InvalidField as exc:
                raise _refused(exc) from exc
            endpoint, agent_api = "chat.completions", "openai.responses"
        self._check(endpoint, body)
        policy = self.policy  # one read: the version tag and the adapter the call goes to agree
        if policy.draining:
            policy = await self._after_push()
        return body, endpoint, agent_api, asked, policy

    def _upstream_request(
        self, call: Call, policy: episodes.Policy, keep_token_ids: bool
    ) -> tuple[bytes, capture.Injected]:
        """The body sent upstream (what the learner needs injected: token ids, log-probs; a model alias
        resolved; the base model replaced by the policy's adapter) and what was injected, to strip from the
        agent's answer. 413 before the upstream when its record could not be kept."""
        body = call.request
        upstream_body, injected = (
            capture.inject(call.endpoint, body) if self.inject else (body, capture.Injected())
        )
        if keep_token_ids:
            injected.token_ids = False  # left in the answer for the agent
        requested = body.get("model")
        if self.aliases and isinstance(requested, str) and requested in self.aliases:
            call.alias_of = self.aliases[requested]
            upstream_body = {**upstream_body, "model": call.alias_of}
        if policy.adapter is not None and call.model == policy.base_model:
            # The agent names the base model; the learner's latest weights are served as an adapter.
            upstream_body = {**upstream_body, "model": policy.adapter}
            call.served_model = policy.adapter
        try:  # the body is written once anyway; what orjson cannot write back cannot be stored either
            upstream_raw = orjson.dumps(upstream_body)
        except orjson.JSONEncodeError as exc:
            raise errors.BadRequest(
                f"request body cannot be stored: {exc} (JSON nested more than 254 levels)",
                code="invalid_json",
            ) from exc
        if len(upstream_raw) > self.settings.max_record_bytes:  # its record could not be kept: not sent
            self.metrics.calls.labels(call.endpoint, "record_too_large").inc()
            raise errors.PayloadTooLarge(
                f"this request ({len(upstream_raw)} bytes) is larger than a call's record may be "
                f"(max_record_bytes {self.settings.max_record_bytes})",
                code="record_too_large",
                headers={"x-rollout-id": call.rollout_id},
            )
        return upstream_raw, injected

    async def _dispatch(
        self,
        call: Call,
        policy: episodes.Policy,
        upstream_raw: bytes,
        injected: capture.Injected,
        receive: Any,
        send: Any,
        sticky: bool,
    ) -> None:
        """Route the call to a server (`gateway.servers`), serve it (streamed or not) and record it; an
        upstream that cannot be reached or times out is recorded as the call's error (502/504). The errors
        raised here name the rollout (`x-rollout-id`), so the agent can find its failed call."""
        # Resolves when the agent hangs up: its call is then recorded as failed (it never saw the answer)
        # and a stream stops reading upstream, which makes vLLM abort the request.
        disconnect = asyncio.ensure_future(disconnected(receive))
        serve = self._stream if call.stream else self._unary
        try:
            call.server, call.rerouted_from = await self.servers.pick(call.rollout_id, policy, sticky=sticky)
            call.server.in_flight += 1
            try:
                await serve(call, upstream_raw, injected, send, disconnect)
            finally:
                call.server.in_flight -= 1
            if self.air is not None:  # only for a call that was recorded: the rollout takes rewards
                self._automatic_rewards(call.rollout_id, call.request)
        except errors.UpstreamError as exc:
            # Unreachable or timed out before any answer: the agent gets 502/504, the call is kept.
            if call.server is not None and type(exc) is errors.UpstreamError:  # it could not be reached
                self.servers.failed(call.server)
            exc.headers.setdefault("x-rollout-id", call.rollout_id)
            error = CallError(status=exc.status, type=exc.type, message=exc.message, code=exc.code)
            latency_ms = (time.perf_counter() - call.t0) * 1000
            try:
                await self._commit(
                    call, self._records(call, [], error, latency_ms, None), "upstream_unreachable"
                )
            except errors.ApiError as failed:  # not recorded either (Redis): that is what the agent hears
                failed.headers.setdefault("x-rollout-id", call.rollout_id)
                raise
            raise
        except errors.ApiError as exc:
            exc.headers.setdefault("x-rollout-id", call.rollout_id)
            raise
        finally:
            disconnect.cancel()

    def _check(self, endpoint: Endpoint, body: dict[str, Any]) -> None:
        """The fields the gateway reads (400 invalid_value) and the answer's bounds (`_admit`)."""
        try:
            capture.check_read_fields(endpoint, body)
            self._admit(endpoint, body)
        except capture.InvalidField as exc:
            raise _refused(exc) from exc

    def _admit(self, endpoint: Endpoint, body: dict[str, Any]) -> None:
        """Refuse (400 limit_exceeded, before the upstream is called) a call whose answer could grow past
        the gateway's bounds: `max_n` choices, `max_tokens_per_choice`, `max_tokens_per_call` together."""
        n, prompts, tokens, field = capture.answer_bounds(endpoint, body)
        choices = n * prompts
        what = "n" if prompts == 1 else f"n x prompts ({n} x {prompts})"
        settings = self.settings
        problem = param = None
        if n > settings.max_n:
            problem, param = f"n is {n}: at most {settings.max_n} choices per call (RLGATE_MAX_N)", "n"
        elif tokens is not None and tokens > settings.max_tokens_per_choice:
            problem, param = (
                f"{field} is {tokens}: at most {settings.max_tokens_per_choice} tokens per choice "
                "(RLGATE_MAX_TOKENS_PER_CHOICE)",
                field,
            )
        elif tokens is not None and choices * tokens > settings.max_tokens_per_call:
            problem, param = (
                f"{what} x {field} is {choices} x {tokens} = {choices * tokens}: at most "
                f"{settings.max_tokens_per_call} tokens per call (RLGATE_MAX_TOKENS_PER_CALL)",
                field,
            )
        if problem is not None:
            self.metrics.calls.labels(endpoint, "limit_exceeded").inc()
            raise errors.BadRequest(problem, param=param, code="limit_exceeded")

    async def _rollout_exists(self, rollout_id: str) -> bool:
        try:
            return await self.store.rollout_exists(rollout_id)
        except episodes.StoreUnavailable as exc:
            raise errors.StoreUnavailable(
                "the gateway cannot reach Redis; retry later", headers={"retry-after": "1"}
            ) from exc

    async def _after_backlog(self, endpoint: str) -> None:
        """A new rollout while new rollouts are held (the backlog over `max_backlog`, Redis's memory above
        `redis_memory_high`): held until that ends (up to `backlog_wait_s`), then 429 with Retry-After.
        Calls of rollouts under way are never held."""
        self.metrics.calls.labels(endpoint, "held_for_backlog").inc()
        try:
            await asyncio.wait_for(self.watch.backlog_clear.wait(), self.settings.backlog_wait_s)
        except TimeoutError:
            self.metrics.calls.labels(endpoint, "backlog_rejected").inc()
            raise self.watch.backlog_full() from None

    async def _after_push(self) -> episodes.Policy:
        """The policy once the full-weight push under way is over (wait), or 429 (reject, or too long)."""
        if self.settings.on_push == "reject":
            raise errors.PolicyPushing(
                "a new policy is being pushed to the inference servers; retry shortly",
                headers={"retry-after": "1"},
            )
        deadline = time.perf_counter() + self.settings.push_wait_s
        while self.policy.draining:
            if time.perf_counter() > deadline:
                raise errors.PolicyPushing(
                    "a policy push took longer than this gateway waits; retry shortly",
                    headers={"retry-after": "1"},
                )
            await asyncio.sleep(self.settings.policy_poll_s / 2)
        return self.policy

    def _automatic_rewards(self, rollout_id: str, request: dict[str, Any]) -> None:
        """AIR for the tool calls whose failed results this request sends back; off the answer's path."""
        assert self.air is not None
        failed_tool_calls = self.air.failed_tool_calls(request)
        if failed_tool_calls:
            task = asyncio.create_task(self.air.apply(rollout_id, failed_tool_calls))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    # -----------------------------------------------------------------------------------------------------
    # Non-streaming

    async def _unary(
        self,
        call: Call,
        upstream_body: bytes,
        injected: capture.Injected,
        send: Any,
        disconnect: asyncio.Future[None],
    ) -> None:
        try:
            assert call.server is not None
            async with call.server.upstream.request(
                "POST", UPSTREAM_PATHS[call.endpoint], upstream_body
            ) as response:
                raw = await response.read(limit=self.settings.max_answer_bytes)
                status = response.status
        except BodyTooLarge as exc:
            await self._answer_too_large(call, exc.limit, None)
        latency_ms = (time.perf_counter() - call.t0) * 1000
        if status != 200:
            await self._upstream_failed(call, status, raw, send)
            return
        try:
            payload = orjson.loads(raw)
            if not isinstance(payload, dict):
                raise ValueError("not a JSON object")
            records = self._records(
                call,
                capture.transitions(call.endpoint, payload, injected, self.settings.record_token_text),
                None,
                latency_ms,
                None,
            )
        except ValueError as exc:  # includes JSON and record validation errors
            error = CallError(
                status=502,
                type="upstream_error",
                message=f"unreadable answer from the inference server: {str(exc)[:300]}",
            )
            await self._commit(call, self._records(call, [], error, latency_ms, None), "bad_upstream_answer")
            raise errors.BadUpstreamAnswer(error.message) from exc
        if disconnect.done():
            for record in records:
                record.error = _client_gone()
            await self._commit(call, records, "client_disconnected")
            return
        if call.agent_api is not None:
            raw = await self._translated(call, records, payload)
        elif injected.any:
            capture.strip_response(call.endpoint, payload, injected)
            raw = orjson.dumps(payload)
        logged = await self._commit(call, records, "ok", write_log=False)
        await send_body(send, 200, raw, [_JSON, call.rollout_header])
        self._log_call(call, records, *logged)  # after the answer: off the agent's latency

    async def _translated(self, call: Call, records: list[CallRecord], payload: dict[str, Any]) -> bytes:
        """The answer in the API the agent spoke; one that API cannot carry (Messages: tool arguments that
        are not a JSON object) is recorded as failed, with what the model sampled, and is 400 as from vLLM."""
        if call.asked is not None:
            try:
                return orjson.dumps(responses.response(payload, call.asked))
            except (TypeError, AttributeError, KeyError, ValueError) as exc:  # a chat answer off its shape
                error = CallError(
                    status=502,
                    type="upstream_error",
                    message=f"unreadable answer from the inference server: {str(exc)[:300]}",
                )
                for record in records:
                    record.error = error
                await self._commit(call, records, "bad_upstream_answer")
                raise errors.BadUpstreamAnswer(error.message) from exc
        try:
            answer = messages.message(payload)
        except capture.InvalidField as exc:
            error = CallError(
                status=400, type="invalid_request_error", message=str(exc), code="invalid_tool_call"
            )
            for record in records:
                record.error = error
            await self._commit(call, records, "untranslatable_answer")
            raise errors.BadRequest(str(exc), code="invalid_tool_call") from exc
        try:
            return orjson.dumps(answer)
        except TypeError:  # an integer past 64 bits in a tool's input, as vLLM's parser passes it on
            return json.dumps(answer, ensure_ascii=False).encode()

    async def _answer_too_large(self, call: Call, limit: int, ttfb_ms: float | None) -> NoReturn:
        """The upstream's answer passed `max_answer_bytes` while it was read: reading stopped there (the
        connection closed: a stream is aborted upstream), the call is recorded as failed, the agent gets 413."""
        message = (
            f"the inference server's answer is over {limit} bytes, more than the gateway reads of one "
            "(max_answer_bytes): ask for fewer choices (n) or fewer tokens (max_tokens)"
        )
        error = CallError(status=413, type="invalid_request_error", message=message, code="record_too_large")
        latency_ms = (time.perf_counter() - call.t0) * 1000
        await self._commit(
            call, self._records(call, [], error, latency_ms, ttfb_ms), "record_too_large", limit=False
        )
        raise errors.PayloadTooLarge(message, code="record_too_large")

    async def _upstream_failed(self, call: Call, status: int, raw: bytes, send: Any) -> None:
        """An upstream error answer: recorded as a failed call, passed on with its status. A 404 for the
        adapter the gateway put in place of the base model the agent named is a server that has not
        loaded it (restarted: the learner loads it again within `server_check_s`): 503 with Retry-After,
        which the SDKs retry, not a 404 for a model the agent never asked for."""
        payload = errors.upstream_error_payload(status, raw)
        headers = [_JSON, call.rollout_header]
        said = str(payload.get("message") or "")
        if status == 404 and call.served_model is not None and f"`{call.served_model}`" in said:
            status = 503
            payload = {
                "message": f"the inference server has not loaded the policy's adapter {call.served_model} "
                f"(it restarted?); the learner loads it again within seconds: retry. "
                f"The server said: {said[:300]}",
                "type": "service_unavailable_error",
                "param": None,
                "code": "policy_not_loaded",
            }
            headers.append((b"retry-after", b"1"))
        error = CallError(
            status=status,
            type=str(payload.get("type") or "upstream_error"),
            message=str(payload.get("message") or ""),
            code=_code(payload.get("code")),
        )
        latency_ms = (time.perf_counter() - call.t0) * 1000
        await self._commit(call, self._records(call, [], error, latency_ms, None), "upstream_error")
        body = (
            messages.error_body(status, error.message)
            if call.agent_api == "anthropic.messages"
            else orjson.dumps({"error": payload})
        )
        await send_body(send, status, body, headers)

    # -----------------------------------------------------------------------------------------------------
    # Streaming: chunks pass through as they arrive; the final event waits for the commit.

    async def _stream(
        self,
        call: Call,
        upstream_body: bytes,
        injected: capture.Injected,
        send: Any,
        disconnect: asyncio.Future[None],
    ) -> None:
        endpoint = call.endpoint
        relay: StreamRelay | TranslatedRelay = StreamRelay(
            endpoint, injected, self.settings.record_token_text
        )
        if call.asked is not None:
            relay = responses.ResponsesRelay(relay.assembler, call.asked)
        elif call.agent_api is not None:
            relay = messages.MessagesRelay(relay.assembler)
        assembler = relay.assembler
        limit = self.settings.max_answer_bytes
        assert call.server is not None
        upstream = call.server.upstream
        async with upstream.request("POST", UPSTREAM_PATHS[endpoint], upstream_body) as response:
            if response.status != 200:
                try:
                    raw = await response.read(limit=limit)
                except BodyTooLarge as exc:
                    await self._answer_too_large(call, exc.limit, None)
                await self._upstream_failed(call, response.status, raw, send)
                return
            content_type = response.headers.get("content-type", "text/event-stream").encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", content_type), call.rollout_header],
                }
            )
            # leaving the block closes the upstream connection: vLLM aborts the request
            failure, ttfb_ms, too_large = await self._relay(call, response, relay, send, disconnect)
        client_gone = disconnect.done()
        if too_large and not client_gone:
            try:
                await self._answer_too_large(call, limit, ttfb_ms)
            except errors.ApiError as exc:  # the agent has part of the content: it sees the error last
                tail = _error_tail(call, exc.status, exc.type, exc.message, exc.code, done=True)
                await send({"type": "http.response.body", "body": tail})
                return
        if client_gone:
            assembler.error = _client_gone()
        elif failure is None and relay.held is None and assembler.error is None:
            failure = CallError(
                status=502, type="upstream_error", message="the upstream stream ended before its final event"
            )
        if failure is not None and not client_gone:
            assembler.error = failure
        latency_ms = (time.perf_counter() - call.t0) * 1000
        try:
            records = self._records(call, assembler.transitions(), assembler.error, latency_ms, ttfb_ms)
        except (ValueError, TypeError, AttributeError, KeyError) as exc:  # a malformed chunk's leftovers
            failure = failure or CallError(
                status=502,
                type="upstream_error",
                message=f"unreadable stream from the inference server: {str(exc)[:300]}",
            )
            records = self._records(call, [], failure, latency_ms, ttfb_ms)
        outcome = (
            "client_disconnected" if client_gone else "ok" if records[0].error is None else "stream_error"
        )
        try:
            logged = await self._commit(call, records, outcome, write_log=False)
        except errors.ApiError as exc:
            # The agent has the content but not the end of the stream: it sees an error, never a success.
            await send(
                {
                    "type": "http.response.body",
                    "body": _error_tail(call, exc.status, exc.type, exc.message, exc.code, done=False),
                }
            )
            return
        if client_gone:
            self._log_call(call, records, *logged)
            return
        if failure is not None:  # recorded as failed; the agent learns it the way vLLM would tell it
            tail = _error_tail(call, failure.status, failure.type, failure.message, failure.code, done=True)
        else:
            tail = b"" if relay.held is None else relay.held + b"\n\n"
        await send({"type": "http.response.body", "body": tail})
        self._log_call(call, records, *logged)  # after the answer: off the agent's latency

    async def _relay(
        self,
        call: Call,
        response: Any,
        relay: StreamRelay | TranslatedRelay,
        send: Any,
        disconnect: asyncio.Future[None],
    ) -> tuple[CallError | None, float | None, bool]:
        """Relay the upstream's stream to the agent chunk by chunk (the relay strips what was injected and
        keeps what the record needs) until it ends, the agent hangs up, or it passes `max_answer_bytes`.
        Returns (what went wrong on our side of the stream, if anything; time to the first chunk; whether
        it passed the bound: its reading stopped there)."""
        assert call.server is not None
        upstream, limit, received, ttfb_ms = call.server.upstream, self.settings.max_answer_bytes, 0, None
        try:
            async for data in upstream.chunks(response):
                if disconnect.done():
                    break
                if ttfb_ms is None:
                    ttfb_ms = (time.perf_counter() - call.t0) * 1000
                received += len(data)
                if received > limit:  # more than is read of an answer: stop here, vLLM aborts it
                    return None, ttfb_ms, True
                out = relay.relay(data)
                if out:
                    await send({"type": "http.response.body", "body": out, "more_body": True})
        except errors.ApiError as exc:
            return CallError(status=exc.status, type=exc.type, message=exc.message), ttfb_ms, False
        except (ValueError, AttributeError, TypeError) as exc:
            message = f"malformed stream chunk from upstream: {str(exc)[:300]}"
            return CallError(status=502, type="upstream_error", message=message), ttfb_ms, False
        return None, ttfb_ms, False

    # -----------------------------------------------------------------------------------------------------
    # Records

    def _records(
        self,
        call: Call,
        transitions: list[capture.Transition],
        error: CallError | None,
        latency_ms: float,
        ttfb_ms: float | None,
    ) -> list[CallRecord]:
        common = dict(
            rollout_id=call.rollout_id,
            task_id=call.task_id,
            agent_name=call.agent_name,
            endpoint=call.endpoint,
            model=call.served_model or call.model,
            policy_version=call.policy_version,
            stream=call.stream,
            request=call.request,
            started_at=call.started_at,
            latency_ms=latency_ms,
            ttfb_ms=ttfb_ms,
            error=error,
            agent_api=call.agent_api,
            server=call.server.name if call.server is not None and self.servers.several else None,
            rerouted_from=call.rerouted_from,
        )
        if not transitions:
            return [CallRecord(**common)]
        records = [
            CallRecord(
                choice_index=t.choice_index,
                response=t.response,
                prompt_token_ids=t.prompt_token_ids,
                completion_token_ids=t.completion_token_ids,
                completion_logprobs=t.completion_logprobs,
                completion_token_texts=t.completion_token_texts,
                **common,
            )
            for t in transitions
        ]
        # n > 1: the request is stored once per call, with choice 0 (the choices are appended together, in
        # choice order, by one script); the store fills it in for the other choices when it reads them
        if len(records) > 1 and [r.choice_index for r in records] == list(range(len(records))):
            for record in records[1:]:
                record.request = {}
                record.request_shared = True
        return records

    async def _commit(
        self, call: Call, records: list[CallRecord], outcome: str, write_log: bool = True, limit: bool = True
    ) -> tuple[str, int | None]:
        """Record the call in Redis, or raise: the caller releases the answer only after this returns.

        Returns (outcome, index) for the call's log line; with `write_log=False` the caller writes that line
        (`_log_call`) once the answer is out."""
        t = time.perf_counter()
        try:
            index = await self.store.record_calls(
                call.rollout_id,
                call.task_id,
                records,
                must_exist=call.keyed,
                max_bytes=self.settings.max_record_bytes if limit else None,
                max_calls=self.settings.max_calls_per_rollout,
                mode=call.mode,
                max_attempts=self.settings.max_attempts_per_rollout,
            )
            self.watch.recorded(call.rollout_id)
        except episodes.RecordTooLarge as exc:
            if any(r.completion_token_texts for r in records):  # display only: never the reason a call fails
                for record in records:
                    record.completion_token_texts = None
                return await self._commit(call, records, outcome, write_log, limit)
            # The answer is dropped, the call kept as failed (its request fits: checked before the upstream).
            error = CallError(
                status=413, type="invalid_request_error", message=str(exc), code="record_too_large"
            )
            await self._commit(
                call,
                self._records(call, [], error, records[0].latency_ms, records[0].ttfb_ms),
                "record_too_large",
                limit=False,
            )
            raise from_store(exc) from exc
        except episodes.RolloutMissing as exc:
            if not call.keyed:  # an attempt of a rollout nobody created
                self.metrics.calls.labels(call.endpoint, "rollout_not_found").inc()
                raise errors.NotFound(
                    f"no rollout {exc.rollout_id!r} to make an attempt of: create it first "
                    "(POST /rollouts) or call attempt 0",
                    code="rollout_not_found",
                ) from exc
            self.metrics.errors.labels("rollout_data_lost").inc()
            raise self._refused(call, exc) from exc
        except episodes.StoreUnavailable as exc:
            self.metrics.errors.labels("store").inc()
            if self.settings.on_store_error == "pass":
                log.error(
                    "call_not_recorded",
                    **call.log_keys(),
                    endpoint=call.endpoint,
                    error=str(exc),
                    hint="on_store_error=pass: the agent got an answer that is not in Redis",
                )
                if write_log:
                    self._log_call(call, records, "not_recorded", None)
                return "not_recorded", None
            self.metrics.calls.labels(call.endpoint, "store_unavailable").inc()
            log.error(
                "call_rejected_store_unavailable", **call.log_keys(), endpoint=call.endpoint, error=str(exc)
            )
            raise errors.StoreUnavailable(
                "the gateway cannot record this call (Redis unavailable); retry later",
                headers={"retry-after": "1"},
            ) from exc
        except episodes.StoreError as exc:  # refused: the rollout is full, closed, of another task, ...
            raise self._refused(call, exc) from exc
        finally:
            self.metrics.store_latency.observe(time.perf_counter() - t)
        if write_log:
            self._log_call(call, records, outcome, index)
        return outcome, index

    def _refused(self, call: Call, exc: episodes.StoreError) -> errors.ApiError:
        """The store refused the call's records: counted under the error's code, answered as every route
        answers that store outcome (`rlgate.episodes.api_error.STORE_ERRORS`)."""
        error = from_store(exc)
        self.metrics.calls.labels(call.endpoint, error.code).inc()
        return error

    def _log_call(self, call: Call, records: list[CallRecord], outcome: str, index: int | None) -> None:
        first = records[0]
        usage = (first.response.usage if first.response is not None else None) or {}
        prompt_tokens = usage.get("prompt_tokens") or len(first.prompt_token_ids or ())
        completion_tokens = usage.get("completion_tokens") or sum(
            len(r.completion_token_ids or ()) for r in records
        )
        m = self.metrics
        m.calls.labels(call.endpoint, outcome).inc()
        m.latency.labels(call.endpoint, "true" if call.stream else "false").observe(first.latency_ms / 1000)
        m.prompt_tokens.inc(prompt_tokens)
        m.completion_tokens.inc(completion_tokens)
        if first.error is not None:
            m.errors.labels(outcome).inc()
        log.info(
            "call",
            **call.log_keys(),
            endpoint=call.endpoint,
            model=first.model,
            agent=call.agent_name,
            stream=call.stream,
            outcome=outcome,
            status=first.error.status if first.error else 200,
            index=index,
            choices=len(records),
            latency_ms=round(first.latency_ms, 2),
            ttfb_ms=None if first.ttfb_ms is None else round(first.ttfb_ms, 2),
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
        )


def _refused(exc: capture.InvalidField) -> errors.ApiError:
    """A field vLLM would refuse, read or translated by the gateway, as the agent's answer: 400 invalid_value
    (404 for a Responses request's unknown previous response), naming the field."""
    error = errors.NotFound if exc.status == 404 else errors.BadRequest
    return error(str(exc), param=exc.param, code="invalid_value")


def _error_tail(call: Call, status: int, type_: str, message: str, code: Any, done: bool) -> bytes:
    """The error event that ends a stream in the agent's own dialect (with `done`, chat's and completions'
    `[DONE]` after it, as vLLM ends a stream that failed)."""
    if call.agent_api == "anthropic.messages":
        return messages.error_event(status, message) + b"\n\n"
    if call.agent_api == "openai.responses":
        return error_event("responses", status, type_, message, code)
    tail = error_event(call.endpoint, status, type_, message, code)
    if done:
        tail += DONE + b"\n\n"
    return tail


def _authorization(headers: list[tuple[bytes, bytes]]) -> bytes:
    """The agent's credential: its Authorization header, else Anthropic's `x-api-key` as a Bearer token."""
    authorization = next((v for k, v in headers if k == b"authorization"), b"")
    if not authorization:
        api_key = next((v for k, v in headers if k == b"x-api-key"), None)
        authorization = b"Bearer " + api_key if api_key else b""
    return authorization


def _client_gone() -> CallError:
    return CallError(
        status=499,
        type="client_disconnected",
        message="the client closed the connection before the answer was complete",
    )


def _code(value: Any) -> str | int | None:
    return value if value is None or isinstance(value, (str, int)) else str(value)
