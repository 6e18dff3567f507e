"""The HTTP server: the OpenAI completions and chat completions APIs plus the endpoints an operator watches during
a cold start, on FastAPI + uvicorn + pydantic. kdtree/serve/protocol.py holds the request/response models,
kdtree/serve/transport.py the limits, the key check, the access log and the one error shape (ApiError).

    app = ServeApp(status, host="127.0.0.1", port=30001, model_name="tiny").start()   # port open, status only
    app.attach(engine)        # when the load stage is done: completions start being served
    app.mark_ready()          # phase=ready (sd_notify READY=1 through the status listener)
    app.drain(timeout_s)      # SIGTERM: phase=draining, finish accepted requests (new ones 503), close, stopped

Endpoints (the schema is at GET /openapi.json)
    POST /v1/completions, /v1/chat/completions   generation (greedy at temperature 0, else sampled losslessly:
                                                 kdtree/decode/sampling.py), streamed as SSE with `stream: true`
    GET  /v1/models, /v1/models/{id}             the one served model, with max_model_len
    GET  /health    liveness: 200 while the process answers (also while loading), 503 once failed
    GET  /ready     readiness: 200 when completions are served, else 503 with the phase
    GET  /status    the engine status (status.json) + queue depth
    GET  /metrics   Prometheus text (kdtree/serve/metrics.py)
/v1/* needs `Authorization: Bearer <key>` when a key is set (KDTREE_API_KEY or serve.api_key_file), checked
before the body is read; the operator endpoints stay open (monitors and load balancers poll them without
secrets). Every error, whatever its status and whoever raised it (a route, the router, the body limit, the
HTTP parser), is OpenAI-shaped JSON: {"error": {"message", "type", "param", "code"}}.

Streaming is live: the engine worker hands each commit's tokens to the request, which sends them as SSE chunks
(never splitting a UTF-8 character, holding back text that could still start a stop string), then a chunk with
finish_reason, the usage chunk when stream_options.include_usage, and `data: [DONE]`. An error before the first
token answers as JSON; one after the stream started (the engine failed, the server stopped before the request
finished) is an SSE `{"error": ...}` event before [DONE]: a stream never just ends.
"""
from __future__ import annotations

import asyncio
import json
import socket
import sys
import threading
import time
import uuid
import weakref
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional, Tuple

from fastapi import FastAPI, Request
from omegaconf import OmegaConf
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kdtree.config.schema import ServeConfig
from kdtree.decode.sampling import SamplingError, SamplingParams
from kdtree.errors import KdtreeError
from kdtree.serve import protocol as P
from kdtree.serve.chat_template import ChatTemplate, ChatTemplateError
from kdtree.serve.logprobs import chat_logprobs, completion_logprobs
from kdtree.serve.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from kdtree.serve.metrics import Metrics
from kdtree.decode.batch import ContextLengthExceeded, RequestTimeout
from kdtree.serve.batch_worker import BatchWorker
from kdtree.serve.request_queue import Cancelled, Draining, Job, QueueFull
from kdtree.serve.status import StatusFile, describe
from kdtree.serve.text_stream import TextStream, cut_at_stop
from kdtree.serve.transport import MAX_CONNECTIONS, Access, ApiError, Guard, JsonH11Protocol

MAX_BODY_BYTES = 8 << 20          # 8 MiB: a prompt as long as any context, JSON-encoded, fits with room
MAX_HEADER_BYTES = 16 << 10       # 16 KiB of request line + headers (h11's buffer limit; more is a 431)
KEEPALIVE_S = 5.0                 # an idle connection (also one that never sends a request) is closed after this


class ServeApp:
    def __init__(self, status: StatusFile, host: str = "127.0.0.1", port: int = 30001, model_name: str = "model",
                 api_key: str = "", max_queue: int = 256, cors_origins: Tuple[str, ...] = (),
                 max_body_bytes: int = MAX_BODY_BYTES, max_header_bytes: int = MAX_HEADER_BYTES,
                 max_connections: int = MAX_CONNECTIONS, keepalive_s: float = KEEPALIVE_S):
        self.status = status
        self.host, self.port = host, int(port)
        self.model_name = model_name
        self.api_key = api_key or ""
        self.max_queue = int(max_queue)
        self.cors_origins = tuple(cors_origins or ())
        self.max_body_bytes, self.max_header_bytes = int(max_body_bytes), int(max_header_bytes)
        self.max_connections, self.keepalive_s = int(max_connections), float(keepalive_s)
        self.engine: Any = None
        self.worker: Optional[BatchWorker] = None
        self.chat_template = None
        self.metrics = Metrics(status, self._load)
        self.created = int(time.time())
        self.draining = False
        self.active = 0                     # completion requests whose response is not fully sent yet
        self._active_lock = threading.Lock()
        self._server = None
        self._thread: Optional[threading.Thread] = None
        self._closed = False

    # -- lifecycle -------------------------------------------------------------------------------------
    def start(self) -> "ServeApp":
        import uvicorn

        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as e:
            sock.close()
            raise KdtreeError(f"cannot listen on {self.host}:{self.port} ({e.strerror}); "
                              f"set serve.port to a free port or stop the process holding it") from None
        sock.listen(128)                  # 16+ clients connecting at once must not overflow the listen backlog
        sock.set_inheritable(True)
        self.port = sock.getsockname()[1]              # serve.port=0 picks a free port
        protocol = type("_Protocol", (JsonH11Protocol,), {"max_connections": self.max_connections})
        config = uvicorn.Config(build_app(self), lifespan="off", log_level="warning", access_log=False,
                                server_header=False, date_header=True, http=protocol,
                                timeout_keep_alive=max(1, int(round(self.keepalive_s))),
                                h11_max_incomplete_event_size=self.max_header_bytes, timeout_graceful_shutdown=5)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, name="http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self._server.started:
            raise KdtreeError(f"the HTTP server on {self.host}:{self.port} did not start; see the engine log")
        self.status.update(url=self.url, port=self.port, model_name=self.model_name)
        return self

    @property
    def listening(self) -> bool:
        """The port is open (started, not yet closed by drain)."""
        return self._server is not None and not self._closed

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def attach(self, engine: Any) -> None:
        self.engine = engine
        try:
            self.chat_template = ChatTemplate.for_checkpoint(getattr(engine, "checkpoint", None),
                                                             getattr(getattr(engine, "cfg", None), "model", {}).get("name", ""))
        except ChatTemplateError as e:           # completions still work; chat answers why it cannot
            self.chat_template = e
            print(f"[serve] /v1/chat/completions disabled: {e}", file=sys.stderr, flush=True)
        # continuous batching (decode/batch.py): the engine's serve section; ServeConfig is the one home of the
        # defaults (an engine without a config, in tests, gets them)
        knobs = OmegaConf.merge(OmegaConf.structured(ServeConfig), getattr(getattr(engine, "cfg", None), "serve", None) or {})
        self.worker = BatchWorker(engine, self.max_queue, on_done=self.metrics.generation,
                                  max_batch_tokens=int(knobs.max_batch_tokens),
                                  kv_pool_tokens=int(knobs.kv_pool_tokens),
                                  request_timeout_s=float(knobs.request_timeout_s),
                                  speculate_max_batch=int(knobs.speculate_max_batch))

    def mark_ready(self) -> None:
        if self.worker is None:
            raise KdtreeError("serve: no engine attached; the load stage must run before serve")
        self.status.update(phase="ready")

    @property
    def ready(self) -> bool:
        return self.worker is not None and self.status.phase == "ready" and not self.draining

    @property
    def max_model_len(self) -> int:
        if self.engine is not None:
            return int(self.engine.max_context)
        return 0

    def drain(self, timeout: Optional[float] = None) -> Dict[str, Any]:
        """Stop taking completions (503 + Retry-After, port still open), finish every accepted request and send
        its response, then close the port. {'drained': finished during the drain, 'cut': ended unfinished,
        'finished': True when nothing was cut}."""
        t0 = time.monotonic()
        self.draining = True
        self.status.update(phase="draining")
        w = self.worker
        pending = (w.depth + w.in_flight) if w is not None else 0
        done0 = w.finished if w is not None else 0
        finished = w.drain(timeout) if w is not None else True
        drained = (w.finished - done0) if w is not None else 0
        left = None if timeout is None else max(1.0, timeout - (time.monotonic() - t0))
        end = None if left is None else time.monotonic() + left
        while self.active and (end is None or time.monotonic() < end):     # the last bytes of every response
            time.sleep(0.02)
        cut = max(0, pending - drained) if not finished else 0
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(15)
            self._closed = True
        self.status.update(phase="stopped", drained=drained, cut=cut)
        return {"drained": drained, "cut": cut, "finished": finished and cut == 0}

    def _load(self) -> Dict[str, float]:
        w = self.worker
        if w is None:
            return {}
        snap = w.snapshot()
        return {"running": snap["running"], "waiting": snap["waiting"], "batch_size": snap["batch_size"],
                "kv_cache_usage": snap["kv_pool_used"] / max(1, snap["kv_pool_tokens"]),
                "speculating": float(snap["speculating"])}

    # -- requests --------------------------------------------------------------------------------------
    def not_ready_error(self) -> ApiError:
        snap = self.status.snapshot()
        phase = snap.get("phase")
        if self.draining or phase in ("draining", "stopped"):
            return ApiError(503, f"server is {phase} (shutting down); not accepting new completions; retry on "
                                 f"another replica or after the restart", "service_unavailable", code="draining")
        return ApiError(503, f"model is not ready: {describe(snap)}; completions are served once the engine is "
                             f"ready (poll GET /ready or /status)", "service_unavailable", code="not_ready")

    def _check_model(self, model: Optional[str]) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(404, f"model {model!r} is not served here; this server serves {self.model_name!r} "
                                f"(GET /v1/models)", param="model", code="model_not_found")

    def _headroom(self) -> int:
        """Context the decoder needs past the last token: the tree's verify block (budget + root)."""
        cfg = getattr(self.engine, "cfg", None)
        if getattr(self.engine, "drafter", None) is None or cfg is None:
            return 0
        return int(cfg.tree.budget) + 1

    def _encode(self, text: str) -> List[int]:
        tok = self.engine.tokenizer
        try:
            return list(tok.encode(text, allow_special=True))   # template text names special tokens (k26)
        except TypeError:
            return list(tok.encode(text))

    def _token_ids(self, p) -> Tuple[List[int], str]:
        if isinstance(p, str):
            return list(self.engine.tokenizer.encode(p)), p
        vocab = getattr(self.engine.tokenizer, "vocab_size", None)
        bad = [t for t in p if vocab is not None and t >= vocab]
        if bad:
            raise ApiError(400, f"prompt token id {bad[0]!r} is not an id of this model (0..{vocab - 1})",
                           param="prompt")
        return list(p), self.engine.tokenizer.decode(p)

    def _check_context(self, ids: List[int], max_tokens: int, param: str) -> None:
        ctx, head = self.max_model_len, self._headroom()
        if not ids:
            raise ApiError(400, "prompt is empty (0 tokens); give at least one token", param=param)
        if len(ids) + max_tokens + head > ctx:
            raise ApiError(400, f"this model's maximum context length is {ctx} tokens, however you requested "
                                f"{len(ids) + max_tokens + head} tokens ({len(ids)} in the prompt, {max_tokens} for the "
                                f"completion, {head} for the speculative tree's verify block); shorten the prompt "
                                f"or lower max_tokens", param=param, code="context_length_exceeded")

    def _stop_ids(self, stops: List[str]) -> Tuple[int, ...]:
        # a stop string that is exactly one token lets the engine stop early; longer ones are cut from the text
        out = []
        for s in stops:
            ids = self.engine.tokenizer.encode(s)
            if len(ids) == 1:
                out.append(int(ids[0]))
        return tuple(out)

    def admit(self, req, chat: bool) -> SamplingParams:
        """What both generation routes check before encoding anything: the model name, the fields kdtree does not
        support (400), readiness (503, Retry-After); then the request's sampling parameters (400 when invalid)."""
        self._check_model(req.model)
        bad = req.unsupported()
        if bad:
            raise ApiError(400, bad[1], param=bad[0])
        if not self.ready:
            raise self.not_ready_error()
        return self.sampling(req, chat=chat)

    def sampling(self, req: Any, chat: bool) -> SamplingParams:
        """The request's sampling fields over the engine's defaults, seed resolved; a bad value is a 400 naming it."""
        get = getattr(self.engine, "sampling_defaults", None)
        defaults = get() if callable(get) else {"temperature": 1.0}
        try:
            return SamplingParams.from_openai(req.model_dump(exclude_none=True), defaults, chat=chat).resolved()
        except SamplingError as e:
            raise ApiError(400, str(e), param=e.param) from None

    def _submit(self, prompts: List[List[int]], max_tokens: int, stops: List[str], loop, stream: bool,
                sampling: Optional[SamplingParams] = None) -> List[Job]:
        """One job per prompt and sample: prompt-major, so job k is choice index k (prompt k // n, sample k % n,
        whose seed is sampling.for_sample(k % n).seed)."""
        if not self.ready:
            raise self.not_ready_error()
        stop_ids, jobs = self._stop_ids(stops), []
        n = sampling.n if sampling is not None else 1
        try:
            for ids, i in [(ids, i) for ids in prompts for i in range(n)]:
                fut = loop.create_future()
                q: Optional[asyncio.Queue] = asyncio.Queue() if stream else None
                box = _Mailbox.of(loop)
                job = Job(ids, max_tokens, stop_ids, stops=tuple(stops), stream=_LoopSink(box, q) if stream else None)
                job.sampling = sampling.for_sample(i) if sampling is not None else None
                job.notify = _notifier(box, fut)
                job.future, job.aqueue = fut, q
                jobs.append(self.worker.submit(job))
        except QueueFull:
            for job in jobs:
                job.cancel()
            raise ApiError(429, f"request queue is full ({self.max_queue} waiting, serve.max_queue); retry later",
                           "rate_limit_error", code="queue_full") from None
        except Draining:
            for job in jobs:
                job.cancel()
            raise self.not_ready_error() from None
        except ContextLengthExceeded as e:            # larger than the whole cache pool (serve.kv_pool_tokens)
            for job in jobs:
                job.cancel()
            raise ApiError(400, str(e), param="prompt", code=e.code) from None
        return jobs

    @staticmethod
    def job_error(job: Job) -> ApiError:
        if isinstance(job.error, Cancelled):
            return ApiError(503, "the server stopped before this completion finished (drain timeout, "
                                 "serve.drain_timeout_s); retry", "service_unavailable", code="cut_by_shutdown")
        if isinstance(job.error, RequestTimeout):
            return ApiError(408, str(job.error), "timeout_error", code="request_timeout")
        if isinstance(job.error, KdtreeError):
            return ApiError(400, str(job.error), param="prompt")
        return ApiError(500, f"engine error: {type(job.error).__name__}: {job.error}", "server_error")

    def stats(self, results, sampling: Optional[SamplingParams] = None) -> P.KdtreeStats:
        accepted = [a for r in results for a in r.acceptance_lengths]
        return P.KdtreeStats(target_forwards=sum(r.target_forwards for r in results),
                             mean_acceptance_length=sum(accepted) / len(accepted) if accepted else 0.0,
                             seconds=round(sum(r.seconds for r in results), 4), seed=_seed(sampling))


def _seed(sampling: Optional[SamplingParams]) -> Optional[int]:
    """The seed to report: the request's (sample 0's) when it samples; None for greedy (no draw, nothing to replay)."""
    return None if sampling is None or sampling.greedy else int(sampling.seed)


class _Mailbox:
    """The engine thread's way into the event loop, one wake-up per burst: a batch step commits tokens for every
    running request, and a call_soon_threadsafe each would write the loop's self-pipe once per request and
    step. put() queues the callback and wakes the loop only when the box was empty; the loop runs everything
    queued since, in order (a job's last tokens before its end). One box per loop."""
    _boxes: "weakref.WeakKeyDictionary[Any, _Mailbox]"

    def __init__(self, loop):
        self.loop, self._lock, self._items = loop, threading.Lock(), []

    @classmethod
    def of(cls, loop) -> "_Mailbox":
        box = cls._boxes.get(loop)
        if box is None:
            box = cls._boxes[loop] = cls(loop)
        return box

    def put(self, fn: Callable[..., Any], *args: Any) -> None:
        with self._lock:
            wake = not self._items
            self._items.append((fn, args))
        if wake:
            try:
                self.loop.call_soon_threadsafe(self._run)
            except RuntimeError:             # the loop is closed: the server is gone, nobody reads any more
                pass

    def _run(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for fn, args in items:
            try:
                fn(*args)
            except Exception as e:           # one job's callback must not drop the other jobs' tokens
                print(f"[serve] delivering to a request failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)


_Mailbox._boxes = weakref.WeakKeyDictionary()


class _LoopSink:
    """The worker thread's side of a streamed job: token lists (then None) into an asyncio.Queue of the loop."""

    def __init__(self, box: _Mailbox, q: asyncio.Queue):
        self.box, self.q = box, q

    def put(self, item) -> None:
        self.box.put(self.q.put_nowait, item)


def _notifier(box: _Mailbox, fut):
    def done():
        box.put(lambda: fut.done() or fut.set_result(None))
    return done


def _sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


async def _pieces(job: Job, first: Any = ...):
    """The token-id lists a streamed job commits, each holding all that arrived since the last; ends with the job.
    first: an item already taken from the job's queue."""
    q = job.aqueue
    item = await q.get() if first is ... else first
    while item is not None:
        batch = list(item)
        while not q.empty():
            item = q.get_nowait()
            if item is None:
                break
            batch.extend(item)
        else:
            item = ...
        yield batch
        if item is ...:
            item = await q.get()


# -- the FastAPI application ---------------------------------------------------------------------------
def _param_and_message(err: Dict[str, Any]) -> Tuple[Optional[str], str]:
    loc = [x for x in err.get("loc", ()) if x != "body"]
    # union branches add their type as a location part ("str", "list[int]", "function-after[...]"): not a field
    path = [x for x in loc if isinstance(x, int) or ("[" not in x and x not in ("str", "int", "float", "bool"))]
    param = ".".join(str(x) for x in path) or None
    kind = err.get("type", "")
    if kind == "missing":
        return param, f"missing required field '{param}'"
    if kind == "extra_forbidden":
        return param, (f"unknown parameter '{param}': not part of the OpenAI API or not supported by this server; "
                       f"remove it")
    if not path and kind in ("model_attributes_type", "dict_type", "model_type"):
        return None, "request body must be a JSON object (send Content-Type: application/json)"
    try:
        got = json.dumps(err.get("input"), allow_nan=False)[:80]
    except (TypeError, ValueError):
        got = repr(err.get("input"))[:80]
    msg = err.get("msg", "invalid value")
    if isinstance(err.get("ctx"), dict) and isinstance(err["ctx"].get("error"), ValueError):
        msg = str(err["ctx"]["error"])
    return param, f"{param or 'body'}: {msg}; got {got}"


def _validation_error(exc: RequestValidationError) -> ApiError:
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        e = next(e for e in errors if e.get("type") == "json_invalid")
        return ApiError(400, f"request body is not valid JSON: {e.get('ctx', {}).get('error', e.get('msg'))}")
    own = [e for e in errors if e.get("type") == "value_error"]      # our validators' messages say the most
    if own:
        param, msg = _param_and_message(own[0])
        return ApiError(400, msg, param=param)
    params = {_param_and_message(e)[0] for e in errors}
    if params == {"prompt"} and len(errors) > 1:       # every branch of prompt's union failed
        return ApiError(400, "prompt must be a non-empty string, a list of token ids, or a list of those; got "
                             + _param_and_message(errors[0])[1].rsplit("got ", 1)[-1], param="prompt")
    param, msg = _param_and_message(errors[0])
    return ApiError(400, msg, param=param)


ERRORS = {code: {"model": P.ErrorResponse} for code in (400, 401, 404, 413, 429, 500, 503)}


def build_app(serve: ServeApp) -> FastAPI:
    app = FastAPI(title="kdtree", version="1", description="OpenAI-compatible completions served with DDTree "
                  "speculative decoding", docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):
        if exc.status >= 500 and exc.status != 503:
            print(f"[serve] {request.method} {request.url.path} -> {exc.status} {exc.message}", file=sys.stderr,
                  flush=True)
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        return _validation_error(exc).response()

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
        print(f"[serve] {request.method} {request.url.path} -> 500 {type(exc).__name__}: {exc}", file=sys.stderr,
              flush=True)
        return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error").response()

    # -- operator endpoints ----------------------------------------------------------------------------
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

    @app.get("/metrics", tags=["operator"], response_class=Response)
    async def metrics():
        return Response(serve.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    # -- OpenAI API ------------------------------------------------------------------------------------
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
        encoded = [serve._token_ids(p) for p in req.prompts()]
        for ids, _ in encoded:
            serve._check_context(ids, req.max_tokens, "prompt")
        stops = req.stops()
        loop = asyncio.get_running_loop()
        jobs = serve._submit([ids for ids, _ in encoded], req.max_tokens, stops, loop, req.stream, sp)
        texts = [encoded[k // sp.n][1] for k in range(len(jobs))]
        n_prompt = sum(len(ids) for ids, _ in encoded)
        if req.stream:
            return await _stream(serve, jobs, stops, "text_completion", req.echo, texts, n_prompt,
                                 bool(req.stream_options and req.stream_options.include_usage), sp)
        choices, results = [], []
        await _until_done_or_gone(request, jobs)
        tok = serve.engine.tokenizer
        for i, job in enumerate(jobs):
            if job.error is not None:
                raise serve.job_error(job)
            text, finish = _final_text(serve, job, stops)
            lp = None
            if sp.logprobs is not None:
                lp = completion_logprobs(tok, job.result, prompt_ids=job.prompt_ids if req.echo else None,
                                         text_offset=0 if req.echo else len(texts[i]))
            choices.append(P.CompletionChoice(index=i, text=(texts[i] + text) if req.echo else text, logprobs=lp,
                                              finish_reason=finish))
            results.append(job.result)
        n_out = sum(len(r.tokens) for r in results)
        resp = P.CompletionResponse(id=f"cmpl-{uuid.uuid4().hex[:24]}", model=serve.model_name, choices=choices,
                                    usage=P.Usage(prompt_tokens=n_prompt, completion_tokens=n_out,
                                                  total_tokens=n_prompt + n_out), kdtree=serve.stats(results, sp))
        return JSONResponse(P.dump(resp))

    @app.post("/v1/chat/completions", response_model=P.ChatCompletionResponse, responses={**ERRORS, **stream_doc})
    async def chat_completions(req: P.ChatCompletionRequest, request: Request):
        sp = serve.admit(req, chat=True)
        tpl = serve.chat_template
        if isinstance(tpl, Exception):
            raise ApiError(400, str(tpl), param="messages", code="no_chat_template")
        messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                    for m in req.messages]
        try:
            text = tpl.render(messages, add_generation_prompt=req.add_generation_prompt)
        except ChatTemplateError as e:
            raise ApiError(400, str(e), param="messages") from None
        ids = serve._encode(text)
        limit = req.limit()
        max_tokens = limit if limit is not None else serve.max_model_len - len(ids) - serve._headroom()
        serve._check_context(ids, max(1, max_tokens), "messages")
        stops = req.stops() + list(tpl.stops)
        loop = asyncio.get_running_loop()
        jobs = serve._submit([ids], max_tokens, stops, loop, req.stream, sp)
        if req.stream:
            return await _stream(serve, jobs, stops, "chat.completion.chunk", False, [text] * len(jobs), len(ids),
                                 bool(req.stream_options and req.stream_options.include_usage), sp)
        await _until_done_or_gone(request, jobs)
        choices = []
        for i, job in enumerate(jobs):
            if job.error is not None:
                raise serve.job_error(job)
            out, finish = _final_text(serve, job, stops)
            lp = chat_logprobs(serve.engine.tokenizer, job.result) if sp.logprobs is not None else None
            choices.append(P.ChatChoice(index=i, message=P.AssistantMessage(content=out), logprobs=lp,
                                        finish_reason=finish))
        results = [job.result for job in jobs]
        n_out = sum(len(r.tokens) for r in results)
        resp = P.ChatCompletionResponse(id=f"chatcmpl-{uuid.uuid4().hex[:24]}", model=serve.model_name,
                                        choices=choices,
                                        usage=P.Usage(prompt_tokens=len(ids), completion_tokens=n_out,
                                                      total_tokens=len(ids) + n_out), kdtree=serve.stats(results, sp))
        return JSONResponse(P.dump(resp))

    # -- middleware (the last added is the outermost) --------------------------------------------------
    app.add_middleware(Guard, serve=serve)
    if serve.cors_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(serve.cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type", "X-Request-Id"],
                           expose_headers=["X-Request-Id"])
    app.add_middleware(Access, serve=serve)
    return app


async def _until_done_or_gone(request: Request, jobs: List[Job], poll_s: float = 0.05) -> None:
    """Wait for every job; a client that disconnects first cancels them (they leave the batch at the next step)."""
    waiting = asyncio.ensure_future(asyncio.gather(*(job.future for job in jobs)))
    try:
        while not waiting.done():
            await asyncio.wait([waiting], timeout=poll_s)
            if not waiting.done() and await request.is_disconnected():
                for job in jobs:
                    job.cancel()
                await waiting                         # each job ends at the next step boundary
                return
    finally:
        if not waiting.done():                    # the handler itself was cancelled
            for job in jobs:
                job.cancel()


def _final_text(serve: ServeApp, job: Job, stops: List[str]) -> Tuple[str, str]:
    text, stopped = cut_at_stop(serve.engine.tokenizer.decode(job.result.tokens), stops)
    return text, "stop" if stopped or job.result.finish_reason in ("stop", "eos") else "length"


async def _stream(serve: ServeApp, jobs: List[Job], stops: List[str], kind: str, echo: bool, texts: List[str],
                  n_prompt: int, include_usage: bool, sampling: Optional[SamplingParams] = None) -> Response:
    first = await jobs[0].aqueue.get()                 # the first tokens, or the end of a job that failed
    if first is None and jobs[0].error is not None:
        for job in jobs:
            job.cancel()
        raise serve.job_error(jobs[0])                 # nothing sent yet: a JSON error like a non-streamed one
    chat = kind == "chat.completion.chunk"
    cid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    created = int(time.time())
    tok = serve.engine.tokenizer
    want_lp = sampling is not None and sampling.logprobs is not None
    seed = _seed(sampling)

    def event(index: int, text: Optional[str], finish: Optional[str], role: bool = False, lp: Any = None) -> bytes:
        if chat:
            delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text or "", "logprobs": lp, "finish_reason": finish}
        out = {"id": cid, "object": kind, "created": created, "model": serve.model_name, "choices": [choice]}
        if seed is not None:
            out["kdtree"] = {"seed": seed}
        return _sse(out)

    async def body():
        t0, n_out = time.monotonic(), 0
        try:
            for index, job in enumerate(jobs):
                ts = TextStream(tok, stops)
                sent, offset = 0, 0 if chat else len(texts[index])   # logprob entries sent; completions' text_offset

                def logprobs(final: bool = False):
                    nonlocal sent, offset
                    if not want_lp or job.live is None:
                        return None
                    have = job.live.logprobs or []
                    entries = have[sent:] if final else have[sent:len(ts.tokens)]
                    sent += len(entries)
                    part = SimpleNamespace(logprobs=entries, prompt_logprobs=None)
                    if chat:
                        return chat_logprobs(tok, part)
                    out = completion_logprobs(tok, part, text_offset=offset)
                    offset += sum(len(t) for t in out["tokens"])
                    return out

                if chat:
                    yield event(index, None, None, role=True)
                pre = first if index == 0 else ...
                if echo and want_lp and index > 0:
                    pre = await job.aqueue.get()       # its prefill is done: the prompt's logprobs are in
                if echo:
                    lp = None
                    if want_lp and job.live is not None:
                        prompt = SimpleNamespace(logprobs=[], prompt_logprobs=job.live.prompt_logprobs)
                        lp = completion_logprobs(tok, prompt, prompt_ids=job.prompt_ids)
                        offset = sum(len(t) for t in lp["tokens"])
                    yield event(index, texts[index], None, lp=lp)
                async for ids in _pieces(job, pre):
                    piece = ts.push(ids)
                    if piece:
                        yield event(index, piece, None, lp=logprobs())
                    if ts.stopped:
                        job.cancel()                # the text is over; free the engine for the next request
                        break
                if not ts.stopped:
                    await job.future
                if not ts.stopped and job.error is not None:
                    e = serve.job_error(job)
                    print(f"[serve] stream ended early: {e.message}", file=sys.stderr, flush=True)
                    yield _sse(e.body())
                    yield b"data: [DONE]\n\n"
                    return
                piece = ts.finish()
                if piece:
                    yield event(index, piece, None, lp=logprobs())
                r = job.result
                finish = "stop" if ts.stopped or (r is not None and r.finish_reason in ("stop", "eos")) else "length"
                rest = logprobs(final=True)
                if rest is not None and not (rest.get("content") if chat else rest["tokens"]):
                    rest = None
                yield event(index, None if chat else "", finish, lp=rest)
                n_out += len(ts.tokens)
            if include_usage:
                yield _sse({"id": cid, "object": kind, "created": created, "model": serve.model_name, "choices": [],
                            "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out,
                                      "total_tokens": n_prompt + n_out}})
            yield b"data: [DONE]\n\n"
            print(f"[serve] stream {n_prompt}+{n_out} tokens {time.monotonic() - t0:.3f} s", file=sys.stderr,
                  flush=True)
        finally:                                        # a stop string, an error, the client gone: stop the rest
            for job in jobs:
                job.cancel()

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
