"""The FastAPI app (routes, error mapping) and ``run_server`` (engine process, uvicorn, SIGTERM).

    tailserve serve [MODEL] [engine flags] [--host --port --api-key ...]
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import sys
import tempfile
import time
import uuid
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from uvicorn.protocols.http.auto import AutoHTTPProtocol

import tailserve
from tailserve.config import EngineArgs
from tailserve.engine.client import EngineClient, EngineStartupError
from tailserve.engine.mp_client import MPEngineClient
from tailserve.errors import ConfigError, InvalidRequestError
from tailserve.obs.metrics import ServerMetrics
from tailserve.obs.timeline import Timeline
from tailserve.server.context import ServerContext, served_names
from tailserve.server.dashboard import page_html
from tailserve.server.errors import (
    APIError,
    bad_request,
    document_400_for_validation,
    error_body,
    error_response,
)
from tailserve.server.heap import TrimAfterLargeRequests
from tailserve.server.middleware import (
    EdgeMiddleware,
    SheddingMiddleware,
    header_timeout_protocol,
)
from tailserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from tailserve.server.responses import ResponsesRequest
from tailserve.server.serving import OpenAIServing
from tailserve.server.serving_responses import OpenAIServingResponses
from tailserve.server.settings import ServerSettings
from tailserve.server.tenants import load_api_keys

logger = logging.getLogger("tailserve.server")

_REJECT_REASONS = {400: "invalid_request", 404: "invalid_request", 429: "queue_full"}
_SLO_REASONS = ("ttft_slo", "ttft_slo_unattainable")  # TTFT SLO refusals (429 / 400)


def create_app(ctx: ServerContext) -> Any:
    app = FastAPI(title="tailserve", version=tailserve.__version__)
    serving = OpenAIServing(ctx)
    responses = OpenAIServingResponses(serving)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        reason = _REJECT_REASONS.get(exc.status)
        if exc.code in _SLO_REASONS:
            reason = exc.code
        if exc.status == 503:
            reason = exc.code or "unavailable"
        if reason is not None:
            tenant = request.scope.get("state", {}).get("tenant")
            ctx.metrics.on_rejected(reason, tenant.name if tenant is not None else None)
        return error_response(exc)

    @app.exception_handler(InvalidRequestError)
    async def _invalid_request(request: Request, exc: InvalidRequestError) -> Response:
        # A user mistake found by SamplingParams or the input processor: the OpenAI 400.
        return await _api_error(request, bad_request(exc.message, exc.param))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        ctx.metrics.on_rejected("invalid_request")
        return error_response(_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        return JSONResponse(
            error_body(str(exc.detail), "invalid_request_error", None, str(exc.status_code)),
            status_code=exc.status_code, headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error on %s", request.url.path)
        return JSONResponse(
            error_body("internal server error", "internal_error", None, "internal_error"),
            status_code=500,
        )

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await serving.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await serving.chat(body, request)

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        return await responses.create(body, request)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{
                "id": ctx.model_names[0], "object": "model", "created": int(ctx.started),
                # The served name, never the weights' install path (which tells a client
                # nothing it may use and tells an attacker where things live).
                "owned_by": "tailserve", "root": ctx.model_names[0],
                "max_model_len": ctx.config.scheduler.max_model_len,
            }],
        }

    @app.get("/health")
    async def health() -> Response:
        if not ctx.client.healthy():  # dead, process gone, or no progress (watchdog)
            reason = ctx.client.dead_reason or "the engine loop is not making progress"
            return JSONResponse(
                error_body(f"unhealthy: {reason}", "service_unavailable", None, "engine_dead"),
                status_code=503,
            )
        if ctx.draining:
            return JSONResponse(
                error_body("draining", "service_unavailable", None, "draining"), status_code=503
            )
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = ctx.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": tailserve.__version__}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        ctx.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of prompt or messages", "prompt")
        inputs = ctx.input_processor
        if body.messages is not None:
            messages = [m.model_dump(include={"role", "content"}) for m in body.messages]
            ids = (await ctx.off_loop(inputs.chat, messages, body.add_generation_prompt)).token_ids
        else:
            assert body.prompt is not None
            ids = await ctx.off_loop(inputs.tokenize, body.prompt, body.add_special_tokens)
        return {
            "tokens": ids, "count": len(ids),
            "max_model_len": ctx.config.scheduler.max_model_len,
        }

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        ctx.check_model(body.model)
        vocab_size = ctx.config.model.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab_size]
        if bad:
            raise bad_request(f"token ids must be in [0, {vocab_size}); got {bad[:5]}",
                              "tokens")
        return {"prompt": ctx.tokenizer.decode(body.tokens)}

    @app.get("/debug/timeline")
    async def timeline(since: float | None = None, limit: int | None = None) -> dict[str, Any]:
        if limit is not None and limit < 1:
            raise bad_request(f"limit must be >= 1, got {limit}", "limit")
        return {"now": time.time(), "records": ctx.timeline.since(since, limit)}

    # A debug control, off unless --enable-profiling: kept out of /openapi.json.
    @app.post("/debug/profile", include_in_schema=False)
    async def profile(seconds: float = 5.0) -> dict[str, Any]:
        if not ctx.settings.enable_profiling:
            raise APIError(404, "profiling is off; start the server with --enable-profiling",
                           "invalid_request_error", None, "profiling_disabled")
        if not 0 < seconds <= 300:
            raise bad_request(f"seconds must be in (0, 300], got {seconds}", "seconds")
        directory = ctx.settings.profile_dir or os.path.join(
            tempfile.gettempdir(), "tailserve-profiles"
        )
        name = f"tailserve-engine-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}.json"
        path = os.path.abspath(os.path.join(directory, name))
        try:
            written = await ctx.client.profile(seconds, path)
        except RuntimeError as exc:
            raise APIError(409, str(exc), "invalid_request_error", None,
                           "profile_failed") from None
        return {"path": written, "seconds": seconds}

    # Not API operations (a page and an endless stream): kept out of /openapi.json.
    @app.get("/dashboard", include_in_schema=False)
    async def dashboard() -> Response:
        return HTMLResponse(page_html(), headers={"Cache-Control": "no-store"})

    @app.get("/dashboard/events", include_in_schema=False)
    async def dashboard_events() -> Response:
        return StreamingResponse(
            ctx.dashboard.events(), media_type="text/event-stream",
            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
        )

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = document_400_for_validation(
                get_openapi(title=app.title, version=app.version, routes=app.routes,
                            openapi_version=app.openapi_version,
                            separate_input_output_schemas=app.separate_input_output_schemas)
            )
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    # A declared large body takes the chain with the heap trimmer's count; the edge, which
    # reads Content-Length anyway, sends every other request past that hop.
    large = (
        (ctx.heap.large_bytes, SheddingMiddleware(TrimAfterLargeRequests(app, ctx.heap), ctx))
        if ctx.heap.available else None
    )
    return EdgeMiddleware(
        SheddingMiddleware(app, ctx),
        api_key=ctx.settings.api_key,
        tenants=ctx.tenant_keys,
        tenant_header=ctx.settings.tenant_header,
        max_request_bytes=ctx.settings.max_request_bytes,
        max_header_bytes=ctx.settings.max_header_bytes,
        on_reject=ctx.metrics.on_rejected,
        large=large,
    )


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return bad_request("the request body is not valid JSON", code="invalid_json")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    # Unions report every branch; the field name and pydantic's own words are enough.
    param = loc[0] if loc else None
    where = ".".join(loc) if loc else "body"
    return bad_request(f"{where}: {first.get('msg', 'invalid value')}", param)


class _Server(uvicorn.Server):
    """SIGTERM / SIGINT start the drain instead of an immediate stop; a second one forces."""

    def __init__(self, config: uvicorn.Config, ctx: ServerContext) -> None:
        super().__init__(config)
        self.ctx = ctx
        self._loop: asyncio.AbstractEventLoop | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.ctx.draining or self._loop is None:
            self.should_exit = True
            if self.ctx.draining and sig == signal.SIGINT:
                self.force_exit = True
            return
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self.ctx.drain()))

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)


def run_server(engine_args: EngineArgs, settings: ServerSettings) -> int:
    """Start the engine process and the HTTP server; return the exit status.

    On uvloop where it is installed (uvicorn[standard] brings it), as ``uvicorn.run`` would
    choose: ``asyncio.run`` alone gives the stock loop, whose per-connection and per-callback
    costs are what a burst of connections pays for.
    """
    try:
        import uvloop
    except ImportError:
        return asyncio.run(_serve(engine_args, settings))
    return int(uvloop.run(_serve(engine_args, settings)))


async def _serve(engine_args: EngineArgs, settings: ServerSettings) -> int:
    from tailserve.model.loader import resolve_model_path
    from tailserve.obs.tracing import make_tracer
    from tailserve.server.structured import load_tokenizers

    tracer = make_tracer(settings.otlp_traces_endpoint)  # fails fast if the extra is missing
    try:
        tenant_keys = load_api_keys(settings.api_keys) if settings.api_keys else None
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    source = resolve_model_path(engine_args.model)
    busy = _cannot_listen(settings.host, settings.port)
    if busy is not None:  # before the engine loads a model for a server that cannot listen
        print(f"error: cannot listen on {settings.host}:{settings.port} (--host / --port): "
              f"{busy}", file=sys.stderr)
        return 1
    client: EngineClient = MPEngineClient(
        engine_args, watchdog_timeout_s=settings.watchdog_timeout,
        log_level=settings.log_level.upper(),
    )
    # Both tokenizers while the engine starts: llguidance's (0.3-1 s here) is built now so that
    # the first constrained request does not wait for it.
    tokenizer_task = asyncio.create_task(asyncio.to_thread(load_tokenizers, engine_args.model))
    try:
        info = await client.start()
    except EngineStartupError as exc:
        print(f"error: the engine could not start: {exc}", file=sys.stderr)
        await client.shutdown(timeout_s=5)
        return 1
    tokenizer, lltokenizer = await tokenizer_task
    names = served_names(engine_args.model, source, settings.served_model_name)
    # The vllm: aliases carry the name clients send as "model", as vLLM's model_name label does.
    metrics = ServerMetrics(model_name=names[0], enable_vllm_metrics=settings.enable_vllm_metrics,
                            tenant_names=[t.name for t in (tenant_keys or {}).values()])
    timeline = Timeline(settings.timeline, maxlen=settings.timeline_buffer)
    ctx = ServerContext(settings, client, tokenizer, names, metrics, timeline, tracer,
                        tenant_keys=tenant_keys, lltokenizer=lltokenizer)
    config = uvicorn.Config(
        create_app(ctx), host=settings.host, port=settings.port, log_level=settings.log_level,
        access_log=False, lifespan="off", timeout_graceful_shutdown=5,
        # uvicorn never closes a connection that drips its headers (slowloris).
        http=header_timeout_protocol(AutoHTTPProtocol, settings.header_timeout),
        # Our middleware answers oversized headers with 431; the parser must let them through.
        h11_max_incomplete_event_size=max(settings.max_header_bytes * 4, 64 << 10),
    )
    server = _Server(config, ctx)

    def request_exit() -> None:
        ctx.dashboard.close()  # open dashboard streams would hold up the shutdown
        server.should_exit = True

    ctx.request_exit = request_exit
    _print_ready(settings, ctx.model_names[0], info.model)
    try:
        await server.serve()
    finally:
        ctx.tokenize_pool.shutdown(wait=False, cancel_futures=True)
        ctx.grammar.close()
        timeline.close()
        if tracer is not None:
            tracer.shutdown()
        code = await client.shutdown(timeout_s=10)
        logger.info("engine stopped (exit code %s)", code)
    if not server.started:
        return 1
    return ctx.exit_code


def _cannot_listen(host: str, port: int) -> str | None:
    """Why uvicorn could not bind ``host:port`` (a port in use, an address not on this host),
    found by binding as it does and letting go; None when it can. Another process may take the
    port in the moment between: then uvicorn's own bind error still stops the server."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def _print_ready(settings: ServerSettings, name: str, source: str) -> None:
    host = settings.host if settings.host not in ("0.0.0.0", "::") else "127.0.0.1"
    url = f"http://{host}:{settings.port}"
    auth = ' -H "Authorization: Bearer $TAILSERVE_API_KEY"' if settings.api_key else ""
    body = json.dumps({
        "model": name, "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 32,
    })
    print(
        f"tailserve: serving {name} ({source})\n"
        f"  OpenAI base URL: {url}/v1   metrics: {url}/metrics   health: {url}/health\n"
        f"  try: curl -s {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} "
        f"-d '{body}'",
        flush=True,
    )
