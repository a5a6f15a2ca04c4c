"""The HTTP service: ``create_app(config)``.

OpenAI-compatible chat completions (plain and SSE streaming) served by the
agent loop, plus feedback, turns, tools, models, health and metrics. Every
error a client can cause comes back as a 4xx with an OpenAI-style
``{"error": {"message", "type", "param", "code"}}`` body.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from importlib import resources
from typing import Annotated, Any, Literal

import structlog
from fastapi import Depends, FastAPI, Header, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from whet.config.settings import WhetConfig
from whet.memory.bus import LESSON_DELETED
from whet.memory.store import StoreFull, StoreUnavailable
from whet.memory.tables import TurnPublic
from whet.runtime.agent import AgentResult, Delta, TurnRequest, conversation_hash, reply_tip, resumed_request
from whet.runtime.approvals import DECISIONS, approval_view, expire_due
from whet.runtime.chat import (
    choice_logprobs,
    completion_body,
    new_session_messages,
    sse_chunk,
    stream_tool_calls,
)
from whet.runtime.forget import forget_user
from whet.runtime.limits import GENERATING, AdmissionMiddleware, body_limit
from whet.runtime.metrics import RequestTimer
from whet.runtime.middleware import (
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    RequestContextMiddleware,
    UnexpectedErrorMiddleware,
    key_user,
)
from whet.runtime.policy import BackendError, PromptTooLong, SamplingParams
from whet.runtime.schemas import (
    ApprovalDecision,
    ApprovalView,
    ChatCompletion,
    ChatCompletionRequest,
    ErrorBody,
    FeedbackAck,
    FeedbackRequest,
    LearningView,
    LessonView,
    ModelCard,
    ModelList,
    SessionDetail,
    SessionSummary,
    ToolPublic,
    TrainAck,
    invalid_text_at,
    refused_field,
)
from whet.runtime.state import Resources, open_resources
from whet.runtime.views import learning_view, session_detail, session_list

log = structlog.get_logger()


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


def error_response(status: int, message: str, code: str | None = None, param: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = ErrorBody(message=message, type=kind, param=param, code=code)
    return JSONResponse({"error": body.model_dump()}, status_code=status)


ERRORS = {
    400: "Invalid request: the message and param name the field",
    403: "Not this key's to do",
    404: "Not found (or another user's)",
    409: "Already decided",
    410: "Expired",
    413: "Request body over server.max_body_bytes",
    500: "Internal error: the server log has details",
    502: "The model backend (or a tool server) failed",
    503: "The store is unreachable; retry shortly",
    507: "The data directory's disk is full",
}


ERROR_BODY = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The ``responses`` a route declares for the errors it can answer, each an OpenAI-style body."""
    return {status: {"description": ERRORS[status], **ERROR_BODY} for status in statuses}


# a generating route answers a chat completion, or with ``stream: true`` its SSE chunks
ANSWER: dict[int | str, dict[str, Any]] = {200: {"model": ChatCompletion, "description": "The answer", "content": {
    "text/event-stream": {"schema": {  # one event (OpenAPI 3.1: the schema of a stream describes each event)
        "type": "object", "required": ["data"], "properties": {"event": {"type": "string"}, "data": {
            "type": "string", "description": "a chat.completion.chunk as JSON; the last event is [DONE]"}}}},
}}}  # fmt: skip


def get_resources(request: Request) -> Resources:
    return request.app.state.resources


ResourcesDep = Annotated[Resources, Depends(get_resources)]


def authenticated_user(request: Request, res: ResourcesDep) -> str | None:
    """The user a bearer key maps to; None when no keys are configured (auth off)."""
    keys = res.config.server.api_keys
    if not keys:
        return None
    user = key_user(keys, request.headers.get("authorization", ""))
    if user is not None:
        structlog.contextvars.bind_contextvars(user=user)
        return user
    raise ApiError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")


AuthDep = Annotated[str | None, Depends(authenticated_user)]


def is_admin(res: Resources, auth_user: str | None) -> bool:
    """An operator key (its user is in server.admin_users), or auth off (whoever reaches the port)."""
    return auth_user is None or auth_user in res.config.server.admin_users


def create_app(config: WhetConfig, **twins: Any) -> FastAPI:
    """Build the service. ``twins`` (backend=, tools=, embedder=) replace real resources in tests."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with open_resources(config, **twins) as resources:
            app.state.resources = resources
            yield

    app = FastAPI(title="whet", version="0.1.0", lifespan=lifespan)
    app.state.api_keys = bool(config.server.api_keys)
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.server.max_body_bytes)
    app.add_middleware(AdmissionMiddleware, server=config.server, keys=config.server.api_keys)  # after the 401
    app.add_middleware(ApiKeyMiddleware, keys=config.server.api_keys, public=WEB_PAGE)  # before the body: 401 first
    app.add_middleware(UnexpectedErrorMiddleware)  # inside the request context, so its log line has the ids
    app.add_middleware(RequestContextMiddleware)
    app.add_middleware(RequestTimer)
    _install_error_handlers(app)
    _install_routes(app)
    _install_approval_routes(app)
    app.openapi = lambda: _openapi(app, config)  # type: ignore[method-assign]
    _install_web_routes(app)
    return app


def _openapi(app: FastAPI, config: WhetConfig) -> dict[str, Any]:
    """FastAPI's schema, saying what the API really answers: bad input is a 400 with an OpenAI-style
    error body (never FastAPI's 422), any route may answer 500, one with a body 413, and with keys
    configured every route needs the bearer key (401 without). The limits set in ``server`` are in it."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = schema.setdefault("components", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components["schemas"].pop(name, None)
    components["schemas"]["ErrorBody"] = ErrorBody.model_json_schema()
    components["schemas"]["ErrorResponse"] = {
        "type": "object", "required": ["error"], "properties": {"error": {"$ref": "#/components/schemas/ErrorBody"}},
    }  # fmt: skip
    error = ERROR_BODY
    retry_after = {"Retry-After": {"description": "seconds to wait", "schema": {"type": "integer"}}}
    if app.state.api_keys:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        schema["security"] = [{"bearer": []}]
    for path, operations in schema.get("paths", {}).items():
        for method, operation in operations.items():
            responses = operation.setdefault("responses", {})
            if responses.pop("422", None) is not None:
                responses["400"] = {"description": ERRORS[400], **error}
            if "requestBody" in operation:
                responses["413"] = {"description": ERRORS[413], **error}
            responses["500"] = {"description": ERRORS[500], **error}
            if app.state.api_keys:
                responses["401"] = {"description": "Missing or invalid API key", **error}
            if method == "post" and GENERATING.match(path):  # see whet.runtime.limits
                responses["429"] = {"description": "Too many requests in flight or in the last minute for this "
                                    "key", "headers": retry_after, **error}  # fmt: skip
    chat = components["schemas"]["ChatCompletionRequest"]["properties"]
    chat["messages"] |= {"minItems": 1, "maxItems": config.server.max_messages}
    for name in ("max_tokens", "max_completion_tokens"):  # see whet.runtime.limits.body_limit
        chat[name]["anyOf"][0]["maximum"] = config.server.max_tokens_cap
    app.openapi_schema = schema
    return schema


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.code, exc.param)

    @app.exception_handler(BackendError)
    async def _backend(request: Request, exc: BackendError) -> JSONResponse:
        log.warning("backend error", error=str(exc))
        return error_response(502, f"the model backend failed: {exc}", code="backend_error")

    @app.exception_handler(StoreUnavailable)
    async def _store_down(request: Request, exc: StoreUnavailable) -> JSONResponse:
        log.warning("store unavailable", error=str(exc))
        response = error_response(503, f"{exc}; retry shortly", code="store_unavailable")
        response.headers["Retry-After"] = "5"
        return response

    @app.exception_handler(StoreFull)
    async def _store_full(request: Request, exc: StoreFull) -> JSONResponse:
        log.error("store disk full", error=str(exc))
        return error_response(507, f"{exc}; free space in the data directory", code="store_full")

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        # a field this server does not read is named first: it is the likeliest cause of the rest
        first = next((e for e in errors if e.get("type") == "extra_forbidden"), errors[0])
        loc = tuple(first.get("loc", ()))
        loc = loc[1:] if loc and loc[0] in ("body", "path", "query", "header") else loc  # the field, as OpenAI names it
        if first.get("type") == "json_invalid":
            return error_response(400, f"request body is not valid JSON: {first.get('msg')}", code="invalid_json")
        where = ".".join(str(p) for p in loc) or "body"
        if first.get("type") == "extra_forbidden":
            return error_response(400, f"{_echo(where)}: {refused_field(loc)}", code="unsupported_field",
                                  param=_echo(where))  # fmt: skip
        message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
        return error_response(400, f"{where}: {message}", code="invalid_value", param=where)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        response = error_response(exc.status_code, str(exc.detail))
        response.headers.update(exc.headers or {})
        if exc.status_code == 405:  # Allow names every method of the path, not only the first route's
            response.headers["Allow"] = ", ".join(_allowed_methods(app, request))
        return response


def _allowed_methods(app: FastAPI, request: Request) -> list[str]:
    methods: set[str] = set()
    for route in app.router.routes:
        if route.matches(request.scope)[0] is not Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    return sorted(methods)


def _install_routes(app: FastAPI) -> None:
    @app.post("/v1/chat/completions", responses=ANSWER | errors(403, 404, 502, 503, 507))
    async def chat_completions(
        body: ChatCompletionRequest,
        res: ResourcesDep,
        auth_user: AuthDep,
        x_whet_session: Annotated[str | None, Header(max_length=128)] = None,
    ) -> Response:
        _refuse_invalid_text(body)
        _check_request(res, body)
        request = await _turn_request(res, body, auth_user, x_whet_session)
        headers = {"X-Whet-Session": request.session_id, "X-Whet-Request": request.request_id}
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            stream = _stream(res, request, res.agent.events(request), bool(body.logprobs), include_usage)
            return StreamingResponse(stream, media_type="text/event-stream", headers=headers)
        started = time.perf_counter()
        try:
            result = await res.agent.run(request)
        except ValueError as exc:  # the backend refuses bad input (e.g. a prompt over the context)
            raise _refused_input(exc) from None
        res.metrics.latency.observe(time.perf_counter() - started)
        await _remember_tip(res, request, result)
        headers["X-Whet-Turn"] = result.turn.id
        logprobs = choice_logprobs(result.turn, res.backend) if body.logprobs else None
        return JSONResponse(completion_body(result, res.model_name, logprobs), headers=headers)

    @app.post("/v1/feedback", status_code=201, responses=errors(404, 503, 507))
    async def feedback(body: FeedbackRequest, res: ResourcesDep, auth_user: AuthDep) -> FeedbackAck:
        _refuse_invalid_text(body)
        turn = await _owned_turn(res, body.turn_id, auth_user)
        row, closed = await res.experience.feedback(turn, body.numeric_score(), body.text)
        res.metrics.feedback.inc()
        return FeedbackAck(id=row.id, turn_id=turn.id, score=row.score, closed_turn=closed)

    @app.get("/v1/turns", responses=errors(503))
    async def list_turns(
        res: ResourcesDep,
        auth_user: AuthDep,
        session: str | None = None,
        user: str | None = None,
        limit: Annotated[int, Query(ge=1, le=500)] = 50,
    ) -> list[TurnPublic]:
        if not is_admin(res, auth_user):
            user = auth_user
        turns = await res.store.list_turns(session_id=session, user_id=user, limit=limit)
        return [TurnPublic.model_validate(t, from_attributes=True) for t in turns]

    @app.get("/v1/turns/{turn_id}", responses=errors(404, 503))
    async def get_turn(turn_id: str, res: ResourcesDep, auth_user: AuthDep) -> TurnPublic:
        turn = await _owned_turn(res, turn_id, None if is_admin(res, auth_user) else auth_user)
        return TurnPublic.model_validate(turn, from_attributes=True)

    @app.delete("/v1/users/{user_id}", responses=errors(403, 502, 503, 507))
    async def forget(user_id: str, res: ResourcesDep, auth_user: AuthDep) -> dict[str, Any]:
        """Forget a user: the user themselves, or an admin key."""
        if "\x00" in user_id:
            raise ApiError(400, "user_id: a user id cannot contain NUL bytes", code="invalid_value", param="user_id")
        if auth_user != user_id and not is_admin(res, auth_user):
            raise ApiError(403, f"only user '{_echo(user_id)}' or an admin key may forget that user",
                           code="forbidden", param="user_id")  # fmt: skip
        # this replica's index at once (the bus event reaches the others, and this one again, idempotently)
        report = await forget_user(user_id, store=res.store, bus=res.bus, tools=res.tools,
                                   adapters_root=res.config.data_path / "adapters", index=res.index)  # fmt: skip
        await res.adapters.deactivate(user_id)
        if not report.complete:
            failed = "; ".join(f"{server}: {why}" for server, why in report.failed.items())
            raise ApiError(502, f"user '{_echo(user_id)}' is forgotten in the store, index and adapter files, but not yet "
                           f"by tool servers ({failed}); call again to finish", code="forget_incomplete")  # fmt: skip
        return report.public()

    @app.get("/v1/models")
    async def models(res: ResourcesDep, auth_user: AuthDep) -> ModelList:
        return ModelList(data=[_model_card(res, auth_user)])

    @app.get("/v1/models/{model_id:path}", responses=errors(404))
    async def model(model_id: str, res: ResourcesDep, auth_user: AuthDep) -> ModelCard:
        if model_id not in (res.model_name, res.backend.model_name):
            raise ApiError(404, f"model '{model_id}' not found; this server serves '{res.model_name}'",
                           code="model_not_found", param="model")  # fmt: skip
        return _model_card(res, auth_user)

    @app.get("/v1/tools")
    async def tools(res: ResourcesDep, auth_user: AuthDep) -> list[ToolPublic]:
        """The ready tools; right after start, once the servers still starting are ready (as a chat sees them)."""
        await res.tools.settle()
        return [ToolPublic.model_validate(t, from_attributes=True) for t in res.tools.tools()]

    @app.get("/health")
    async def health(res: ResourcesDep, auth_user: AuthDep) -> dict[str, Any]:
        """200 while serving, at once (never waits for tool servers); ``status`` is "starting" while a
        tool server is on its first start, "degraded" while one failed or is restarting (each reason
        in ``server_errors``), so its tools are missing from answers, else "ok"."""
        servers, errors = res.tools.status(), res.tools.errors()
        return {
            "status": _overall(servers),
            "model": res.model_name,
            "adapter": res.adapters.live_version(),
            "servers": servers,
            "server_errors": errors,
            "uptime_s": round(time.time() - res.started_at, 1),
            "learner": await res.learner.status() if res.learner else None,
        }

    @app.get("/metrics", response_class=PlainTextResponse, responses=errors(503))
    async def metrics(res: ResourcesDep, auth_user: AuthDep) -> Response:
        res.metrics.tools_available.set(len(res.tools.tools()))
        res.metrics.tool_servers(res.tools.status())
        steps = (await res.learner.status())["steps"] if res.learner else None
        res.metrics.learning(await res.store.learning_counts(), res.adapters.live_version(), steps)
        return Response(res.metrics.render(), media_type="text/plain; version=0.0.4")


def _overall(servers: dict[str, str]) -> str:
    """The service's status from its tool servers' states: a broken one outweighs a starting one."""
    if any(state in ("failed", "restarting") for state in servers.values()):
        return "degraded"
    return "starting" if "starting" in servers.values() else "ok"


def _install_approval_routes(app: FastAPI) -> None:
    """Held steps (see ``whet.runtime.approvals``): list them, and decide one to continue its request."""

    @app.get("/v1/approvals", responses=errors(503, 507))
    async def approvals(
        res: ResourcesDep, auth_user: AuthDep, user: str | None = None,
        status: Literal["pending", "approved", "rejected", "expired", "all"] = "pending",
        limit: Annotated[int, Query(ge=1, le=500)] = 100,
    ) -> list[ApprovalView]:  # fmt: skip
        """The caller's approvals (an admin key: every user's, or ``user``'s), newest first."""
        await expire_due(res.experience)
        owner = user if is_admin(res, auth_user) else auth_user
        rows = await res.store.list_approvals(owner, None if status == "all" else status, limit)
        return [approval_view(row) for row in rows]

    @app.get("/v1/approvals/{approval_id}", responses=errors(404, 503, 507))
    async def approval(approval_id: str, res: ResourcesDep, auth_user: AuthDep) -> ApprovalView:
        await expire_due(res.experience)
        return approval_view(await _owned_approval(res, approval_id, auth_user))

    @app.post("/v1/approvals/{approval_id}", responses=ANSWER | errors(404, 409, 410, 502, 503, 507))
    async def decide(approval_id: str, body: ApprovalDecision, res: ResourcesDep, auth_user: AuthDep) -> Response:
        """Approve or reject; the answer is the held request's continuation, as a chat completion."""
        _refuse_invalid_text(body)
        await expire_due(res.experience)
        found = await _owned_approval(res, approval_id, auth_user)
        decided = await res.store.decide_approval(found.id, DECISIONS[body.decision], by=auth_user, reason=body.reason)
        if decided is None:
            now = await res.store.get_approval(found.id)
            if now is None or now.status in ("expired", "pending"):
                raise ApiError(410, f"approval '{found.id}' expired at {found.expires_at.isoformat(timespec='seconds')}; "
                               "its calls did not run (ask again)", code="approval_expired", param="approval_id")  # fmt: skip
            raise ApiError(409, f"approval '{found.id}' was already {now.status}", code="approval_decided",
                           param="approval_id")  # fmt: skip
        log.info("approval.decided", approval=decided.id, decision=decided.status, by=auth_user)
        request = resumed_request(decided)
        structlog.contextvars.bind_contextvars(session=request.session_id)
        headers = {"X-Whet-Session": request.session_id, "X-Whet-Request": request.request_id}
        events = res.agent.events(request, decided)
        if body.stream:
            return StreamingResponse(_stream(res, request, events, False, False), media_type="text/event-stream",
                                     headers=headers)  # fmt: skip
        try:
            result = await res.agent.run(request, decided)
        except (ValueError, LookupError) as exc:
            raise _refused_input(exc) from None
        await _remember_tip(res, request, result)
        headers["X-Whet-Turn"] = result.turn.id
        return JSONResponse(completion_body(result, res.model_name), headers=headers)


async def _owned_approval(res: Resources, approval_id: str, auth_user: str | None):
    """The approval, when the caller owns its turn or holds an admin key (else 404, as for turns)."""
    found = await res.store.get_approval(approval_id)
    if found is None or not (is_admin(res, auth_user) or found.user_id == auth_user):
        raise ApiError(404, f"approval '{_echo(approval_id)}' not found", code="approval_not_found",
                       param="approval_id")  # fmt: skip
    return found


def _refused_input(exc: Exception) -> ApiError:
    """The 400 for input the agent or the backend refused; a prompt over the context names that limit."""
    if isinstance(exc, PromptTooLong):
        return ApiError(400, str(exc), code="context_length_exceeded", param="messages")
    return ApiError(400, str(exc), code="invalid_request")


def _echo(text: str, limit: int = 80) -> str:
    """A client's value as an error message may repeat it: never more than ``limit`` characters."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _refuse_invalid_text(body: Any) -> None:
    if (path := invalid_text_at(body)) is not None:
        message = f"{path}: not valid Unicode (a lone surrogate such as \\ud800); send UTF-8 text"
        raise ApiError(400, message, code="invalid_value", param=path)


def _model_card(res: Resources, auth_user: str | None) -> ModelCard:
    return ModelCard(
        id=res.model_name, created=int(res.started_at), backend=res.config.model.backend,
        adapter=res.adapters.current(auth_user or res.config.server.default_user),
    )


def _check_request(res: Resources, body: ChatCompletionRequest) -> None:
    """Refuse, by field, what this server would otherwise have to ignore."""
    if res.config.server.strict_model_names and body.model not in (res.model_name, res.backend.model_name):
        raise ApiError(
            404, f"model '{_echo(body.model)}' not found; this server serves '{res.model_name}'", code="model_not_found",
            param="model",
        )
    refused = body.unsupported()
    if refused is not None:
        field, why = refused
        raise ApiError(400, f"{field}: {why}", code="unsupported_value", param=field)
    tokens = {"max_tokens": body.max_tokens, "max_completion_tokens": body.max_completion_tokens}
    if (limit := body_limit(res.config.server, len(body.messages), tokens)) is not None:
        raise ApiError(limit.status, limit.message, code=limit.code, param=limit.param)


LessonId = Annotated[int, Path(ge=1, le=2**63 - 1)]  # a row id: what a store's INTEGER holds
WEB_PAGE = ("/", "/web/*")  # the page's static files: no data, served without a key (the page asks for one)


def _install_web_routes(app: FastAPI) -> None:
    """The page at ``/`` (static files, no data: it asks for a key) and the JSON it reads."""
    web = resources.files("whet.runtime") / "web"
    app.mount("/web", StaticFiles(directory=str(web)), name="web")

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(str(web / "index.html"), headers={"Cache-Control": "no-cache"})

    @app.get("/v1/sessions", responses=errors(503))
    async def sessions(
        res: ResourcesDep, auth_user: AuthDep, user: str | None = None,
        limit: Annotated[int, Query(ge=1, le=200)] = 50,
    ) -> list[SessionSummary]:
        return await session_list(res.store, _page_user(res, auth_user, user), limit)

    @app.get("/v1/sessions/{session_id}", responses=errors(404, 503, 507))
    async def session(session_id: str, res: ResourcesDep, auth_user: AuthDep, user: str | None = None) -> SessionDetail:
        found = await res.store.get_session(session_id)
        if found is None or found.user_id != _page_user(res, auth_user, user):
            raise ApiError(404, f"session '{session_id}' not found", code="session_not_found", param="session_id")
        await expire_due(res.experience)
        return await session_detail(res.store, session_id)

    @app.get("/v1/learning", responses=errors(503))
    async def learning(res: ResourcesDep, auth_user: AuthDep, user: str | None = None) -> LearningView:
        status = await res.learner.status() if res.learner else None
        return await learning_view(res.store, res.config.learner.scope, status, _page_user(res, auth_user, user))

    @app.post("/v1/learning/train", status_code=202, responses=errors(403, 409, 503))
    async def train(res: ResourcesDep, auth_user: AuthDep, user: str | None = None) -> TrainAck:
        """Train what the user's lineage has waiting now, in one step, instead of at a full batch or its timeout."""
        learner = res.learner
        if learner is None:
            raise ApiError(409, "this server runs no learner (learner.enabled is false; `whet learn` may run it elsewhere)",
                           code="learner_off")  # fmt: skip
        if not learner.config.train:
            raise ApiError(409, "this server's learner trains no weights (learner.train is false): lessons are kept as "
                           "they come", code="learner_not_training")  # fmt: skip
        user_id = _page_user(res, auth_user, user)
        if not learner.trains(user_id):
            raise ApiError(403, f"user '{_echo(user_id)}' does not train the shared adapter (learner.trusted_users)",
                           code="user_not_trusted")  # fmt: skip
        owner = learner.train_now(user_id)
        waiting = (await res.store.untrained_counts()).items()
        count = sum(n for u, n in waiting if owner is None or u == owner)
        return TrainAck(lineage="global" if owner is None else f"user:{owner}", waiting=count)

    @app.get("/v1/lessons", responses=errors(503))
    async def lessons(res: ResourcesDep, auth_user: AuthDep, user: str | None = None) -> list[LessonView]:
        rows = await res.store.list_lessons(_page_user(res, auth_user, user))
        return [LessonView.model_validate(row, from_attributes=True) for row in rows]

    @app.delete("/v1/lessons/{lesson_id}", status_code=204, responses=errors(404, 503, 507))
    async def delete_lesson(lesson_id: LessonId, res: ResourcesDep, auth_user: AuthDep, user: str | None = None) -> Response:
        lesson = await res.store.get_lesson(lesson_id)
        if lesson is None or lesson.user_id != _page_user(res, auth_user, user):
            raise ApiError(404, f"lesson {lesson_id} not found", code="lesson_not_found", param="lesson_id")
        await res.store.delete_lesson(lesson_id)
        res.index.remove(lesson_id)  # retrieval stops offering it with the very next request
        await res.bus.publish(LESSON_DELETED, {"lesson_id": lesson_id})  # ...on every other replica too
        return Response(status_code=204)


def _page_user(res: Resources, auth_user: str | None, asked: str | None) -> str:
    """The key's user; with keys off, the ``user`` asked for or the default user."""
    return auth_user or asked or res.config.server.default_user


async def _owned_turn(res: Resources, turn_id: str, auth_user: str | None):
    turn = await res.store.get_turn(turn_id)
    if turn is None or (auth_user is not None and turn.user_id != auth_user):
        raise ApiError(404, f"turn '{_echo(turn_id)}' not found", code="turn_not_found", param="turn_id")
    return turn


async def _turn_request(
    res: Resources, body: ChatCompletionRequest, auth_user: str | None, explicit_session: str | None
) -> TurnRequest:
    user_id = auth_user or body.user or res.config.server.default_user
    structlog.contextvars.bind_contextvars(user=user_id)
    messages = [m.to_openai() for m in body.messages]
    # the new messages are the next state of whatever this session left open
    trailing = new_session_messages(messages)
    history = messages[: len(messages) - len(trailing)]
    session_id, made = await _session_for(res, user_id, explicit_session, history)
    structlog.contextvars.bind_contextvars(session=session_id)
    if not made:  # a session this request made has no turns to close
        kind = "tool_result" if trailing[0]["role"] == "tool" else "user_message"
        await res.experience.close_open(session_id, kind, {"messages": trailing})
    model = res.config.model
    params = SamplingParams(
        max_new_tokens=min(body.max_completion_tokens or body.max_tokens or model.max_new_tokens, model.max_new_tokens),
        temperature=model.temperature if body.temperature is None else body.temperature,
        top_p=model.top_p if body.top_p is None else body.top_p,
        seed=body.seed,
        stop=body.stop_list,
    )
    client_tools = [t.model_dump() for t in body.tools or []]
    # no adapter here: the agent pins one when the request starts and holds it to the end
    tool_choice = "none" if body.tool_choice == "none" else "auto"
    return TurnRequest(user_id, session_id, messages, client_tools, params, tool_choice=tool_choice,
                       learn=body.store is not False)


async def _session_for(res: Resources, user_id: str, explicit: str | None,
                       history: list[dict[str, Any]]) -> tuple[str, bool]:  # fmt: skip
    """The session a request continues: named explicitly, or the one whose last reply ends ``history``;
    and whether this request made it."""
    if explicit:
        try:
            row, made = await res.store.open_session(user_id, explicit)
        except PermissionError:
            raise ApiError(403, f"session '{explicit}' belongs to another user", code="session_forbidden") from None
        return row.id, made
    if any(m["role"] == "assistant" for m in history):
        found = await res.store.find_session_by_tip(user_id, conversation_hash(user_id, history))
        if found is not None:
            return found.id, False
    row, made = await res.store.open_session(user_id)
    return row.id, made


async def _remember_tip(res: Resources, request: TurnRequest, result: AgentResult) -> None:
    """Remember how the conversation stands, so the client's next request finds this session
    (the agent wrote it with the answer's turn where it could)."""
    tip = reply_tip(request, result.content, result.client_tool_calls)
    if tip != result.tip:
        await res.store.set_session_tip(request.session_id, tip)


async def _stream(
    res: Resources, request: TurnRequest, agent_events: AsyncIterator[Delta | AgentResult], logprobs_asked: bool,
    include_usage: bool,
) -> AsyncIterator[str]:
    chunk_id = request.answer_turn_id  # one id for the whole stream: the turn that answers
    created = int(time.time())
    started = time.perf_counter()

    def chunk(delta: dict[str, Any] | None, finish: str | None = None, logprobs=None, **extra: Any) -> str:
        return sse_chunk(chunk_id, created, res.model_name, delta, finish, logprobs, **extra)

    def failed(message: str, kind: str, code: str | None = None) -> str:
        return chunk(None, error={"message": message, "type": kind, "code": code})

    opened = False
    try:
        # aclosing: however this stream ends, the agent's adapter lease ends with it
        async with aclosing(agent_events) as events:
            async for event in events:
                if not opened:  # the first chunk names the role, under the id of the turn that speaks
                    opened = True
                    yield chunk({"role": "assistant", "content": ""})
                if isinstance(event, Delta):
                    yield chunk({"content": event.text})
                    continue
                result: AgentResult = event
                if result.client_tool_calls:
                    yield chunk({"tool_calls": stream_tool_calls(result.client_tool_calls)})
                logprobs = choice_logprobs(result.turn, res.backend) if logprobs_asked else None
                yield chunk({}, result.finish_reason, logprobs, system_fingerprint=result.turn.policy_version)
                if include_usage:
                    yield chunk(None, usage=result.usage)
                await _remember_tip(res, request, result)
    except (ValueError, LookupError) as exc:  # bad input (a prompt over the context), a forgotten turn
        yield failed(str(exc), "invalid_request_error", _refused_input(exc).code)
    except BackendError as exc:
        yield failed(f"the model backend failed: {exc}", "server_error")
    except (StoreUnavailable, StoreFull) as exc:  # the answer was not recorded: say so, not "internal error"
        yield failed(str(exc), "server_error")
    except Exception as exc:  # the stream has started: report in-band, never drop the connection silently
        log.exception("stream failed")
        yield failed(f"internal error ({type(exc).__name__}); the server log has details", "server_error")
    res.metrics.latency.observe(time.perf_counter() - started)
    yield "data: [DONE]\n\n"
