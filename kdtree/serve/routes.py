"""The HTTP routes (FastAPI): operator endpoints, the OpenAI endpoints, the exception handlers and middleware. Thin:
parse (pydantic) -> ServeApp's checks -> a Generation -> kdtree/serve/generation.py's respond (submission, then the
response or the SSE stream), the one path both generation APIs share. Tokenizing, rendering a chat template and
submitting run in a worker thread (asyncio.to_thread), never on the event loop: a request of 20000 prompts must not
keep /health (or anyone else) waiting."""
from __future__ import annotations

import asyncio
import sys
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kdtree.serve import protocol as P
from kdtree.serve.chat_template import ChatTemplateError
from kdtree.serve.errors import ERRORS, validation_error
from kdtree.serve.generation import Generation, respond
from kdtree.serve.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from kdtree.serve.output_plan import chat_plan, completion_plan
from kdtree.serve.status import describe
from kdtree.serve.transport import Access, ApiError, Guard, log_safe


def build_app(serve) -> FastAPI:
    app = FastAPI(title="kdtree", version="1", description="OpenAI-compatible completions served with DDTree "
                  "speculative decoding", docs_url=None, redoc_url=None)
    _error_handlers(app)
    _operator_routes(app, serve)
    _openai_routes(app, serve)
    # -- middleware (the last added is the outermost) --------------------------------------------------
    app.add_middleware(Guard, serve=serve)
    if serve.cors_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(serve.cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type", "X-Request-Id"],
                           expose_headers=["X-Request-Id"])
    app.add_middleware(Access, serve=serve)
    return app


def _error_handlers(app: FastAPI) -> None:
    """Every error, whoever raised it, answers as OpenAI-shaped JSON (ApiError)."""
    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):
        if exc.status >= 500 and exc.status != 503:
            print(f"[serve] {request.method} {log_safe(request.url.path)} -> {exc.status} {log_safe(exc.message)}",
                  file=sys.stderr, flush=True)
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        path = request.url.path
        if exc.status_code == 404:
            msg = (f"no endpoint {path}; the endpoints are POST /v1/completions, POST /v1/chat/completions, "
                   f"GET /v1/models, /health, /ready, /status, /metrics, /openapi.json")
        elif exc.status_code == 405:
            allow = (exc.headers or {}).get("Allow", "")
            msg = f"{path} takes {allow or 'another method'}, not {request.method}"
        elif exc.status_code == 400 and exc.detail == "There was an error parsing the body":
            cause = exc.__cause__
            msg = (f"request body is not valid JSON: {type(cause).__name__}"
                   + (": nested too deeply" if isinstance(cause, RecursionError) else f": {cause}"))[:300]
        else:
            msg = str(exc.detail)
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return ApiError(exc.status_code, msg, kind, headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def _crash(request, exc: Exception):
        print(f"[serve] {request.method} {log_safe(request.url.path)} -> 500 {type(exc).__name__}: {log_safe(exc)}",
              file=sys.stderr, flush=True)
        return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error").response()


def _operator_routes(app: FastAPI, serve) -> None:
    """/health, /ready, /status, /metrics: open without a key (monitors and load balancers poll them)."""
    @app.api_route("/health", methods=["GET", "HEAD"], tags=["operator"])
    async def health():
        snap = serve.status.snapshot()
        code = 503 if snap.get("phase") == "failed" else 200
        return JSONResponse({"status": "ok" if code == 200 else "failed", "phase": snap.get("phase"),
                             "pid": snap.get("pid"), "uptime_s": round(time.time() - snap["started_at"], 3)}, code)

    @app.api_route("/ready", methods=["GET", "HEAD"], tags=["operator"])
    async def ready():
        snap = serve.status.snapshot()
        if serve.ready:
            return {"ready": True, "phase": snap["phase"]}
        return JSONResponse({"ready": False, "phase": snap.get("phase"), "status": describe(snap)}, 503,
                            headers={"Retry-After": "1"})

    @app.get("/status", tags=["operator"])
    async def status():
        snap = serve.status.snapshot()
        snap["queue_depth"] = serve.worker.depth if serve.worker else 0
        snap["in_flight"] = serve.worker.in_flight if serve.worker else 0
        snap["batch"] = serve.worker.snapshot() if serve.worker else {}   # running, waiting, batch_size, kv pool
        return snap

    @app.post("/prefix_cache", tags=["operator"])
    async def prefix_cache(request: Request):
        """{"enabled": bool}: the prefix cache on/off for new requests (the API key when one is set)."""
        try:
            body = await request.json()
        except (ValueError, RecursionError):          # not JSON, or nested past the parser's depth: no body
            body = None
        return serve.set_prefix_cache(body, request.headers.get("authorization", ""))

    @app.get("/metrics", tags=["operator"], response_class=Response)
    async def metrics():
        return Response(serve.metrics.render(), media_type=METRICS_CONTENT_TYPE)


def _openai_routes(app: FastAPI, serve) -> None:
    """/v1/models, /v1/completions, /v1/chat/completions (behind the key when one is set)."""
    def card() -> P.ModelCard:
        return P.ModelCard(id=serve.model_name, created=serve.created, max_model_len=serve.max_model_len,
                           root=serve.model_name)

    @app.get("/v1/models", response_model=P.ModelList, responses=ERRORS)
    async def models():
        return P.ModelList(data=[card()])

    @app.get("/v1/models/{model_id:path}", response_model=P.ModelCard, responses=ERRORS)
    async def model(model_id: str):
        serve._check_model(model_id)
        return card()

    # each server-sent event: `data: <a JSON chunk>` (the last one `data: [DONE]`)
    event_schema = {"type": "object", "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
                    "required": ["data"]}
    stream_doc = {200: {"content": {"text/event-stream": {"schema": event_schema}}}}

    @app.post("/v1/completions", response_model=P.CompletionResponse, responses={**ERRORS, **stream_doc})
    async def completions(req: P.CompletionRequest, request: Request):
        sp = serve.admit(req, chat=False)
        serve._check_fan_out(len(req.prompts()), sp.n)          # before any tokenizing
        plan = completion_plan(serve, req)
        max_tokens = P.DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens   # null: the default
        def encode():
            encoded = [serve._token_ids(p) for p in req.prompts()]
            for ids, _ in encoded:
                serve._check_context(ids, max_tokens, "prompt")
            return encoded

        encoded = await asyncio.to_thread(encode)
        return await respond(serve, request, Generation(
            chat=False, prompts=[ids for ids, _ in encoded], texts=[text for _, text in encoded],
            max_tokens=max_tokens, stops=req.stops(), sampling=sp, stream=bool(req.stream), echo=bool(req.echo),
            include_usage=bool(req.stream_options and req.stream_options.include_usage), plan=plan))

    @app.post("/v1/chat/completions", response_model=P.ChatCompletionResponse, responses={**ERRORS, **stream_doc})
    async def chat_completions(req: P.ChatCompletionRequest, request: Request):
        sp = serve.admit(req, chat=True)
        tpl = serve.chat_template
        if isinstance(tpl, Exception):
            raise ApiError(400, str(tpl), param="messages", code="no_chat_template")
        plan = chat_plan(serve, req)                            # tools, tool_choice, response_format: a 400 here
        try:                    # k26: the template's markers are their ids, a user's written marker plain text
            ids, text = await asyncio.to_thread(
                tpl.encode, serve.engine.tokenizer, [m.for_template() for m in req.messages],
                req.add_generation_prompt, req.tool_dicts(), **(req.chat_template_kwargs or {}))
        except ChatTemplateError as e:
            raise ApiError(400, str(e), param="messages") from None
        limit = req.limit()
        # no limit given: the rest of the context, capped by what the latent-cache pool can ever hold for one request
        # (it ends with finish_reason "length" there) -- never refused for a default
        max_tokens = limit if limit is not None else min(serve.max_model_len, serve.pool_tokens) - len(ids) - \
            serve._headroom()
        serve._check_context(ids, max(1, max_tokens), "messages")
        return await respond(serve, request, Generation(
            chat=True, prompts=[ids], texts=[text], max_tokens=max_tokens, stops=req.stops() + list(tpl.stops),
            sampling=sp, stream=bool(req.stream), plan=plan, stop_ids=tpl.end_of_turn_ids(serve.engine.tokenizer),
            include_usage=bool(req.stream_options and req.stream_options.include_usage)))
