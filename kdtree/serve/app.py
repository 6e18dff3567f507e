"""The HTTP server: OpenAI-compatible completions plus the endpoints an operator watches during a cold start.

    app = ServeApp(status, host="127.0.0.1", port=30001, model_name="tiny").start()   # port open, status only
    app.attach(engine)        # when the load stage is done: completions start being served
    app.mark_ready()          # phase=ready (sd_notify READY=1 through the status listener)
    app.drain()               # SIGTERM: phase=draining, finish accepted requests, close, phase=stopped

Endpoints
    POST /v1/completions   prompt (string | token ids | a list of either), max_tokens (default 16), temperature
                           (0 or absent = greedy; >0 is refused with 400: kdtree decodes greedily only, that is
                           what makes speculative decoding lossless), stop (string | list), stream (SSE), echo
    GET  /v1/models        the one served model
    GET  /health           liveness: 200 while the process answers (also while loading), 503 once failed
    GET  /ready            readiness: 200 when completions are served, else 503 with the phase
    GET  /status           the engine status (status.json) + queue depth
    GET  /metrics          Prometheus text
/v1/* needs `Authorization: Bearer <serve.api_key>` when serve.api_key is set; the operator endpoints do not
(monitors and load balancers poll them without secrets). Errors are OpenAI-shaped:
{"error": {"message", "type", "param", "code"}}.

Streaming (`stream: true`) is live: the engine worker hands each commit's tokens (engine.generate's
on_tokens: the prefill token, each AR step, each DDTree round's path + bonus) to the request's handler, which
sends them as SSE chunks as they arrive: never splitting a UTF-8 character, holding back only text that could
still be the start of a stop string, then a chunk with finish_reason, the usage chunk when
stream_options.include_usage, and `data: [DONE]`. The streamed text equals the non-streamed text. A stop
string, or the client going away, cancels the rest of the generation. An error before the first token
answers as JSON (4xx/5xx); one after the stream started is sent as an SSE `{"error": ...}` event.
The wire format is OpenAI's, so every client streams it.
"""
from __future__ import annotations

import hmac
import json
import queue
import socket
import socketserver
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, List, Optional, Tuple

from kdtree.errors import KdtreeError
from kdtree.serve.metrics import Metrics
from kdtree.serve.request_queue import Draining, EngineWorker, Job, QueueFull
from kdtree.serve.status import StatusFile, describe

MAX_BODY_BYTES = 8 << 20          # 8 MiB: a prompt as long as any context, JSON-encoded, fits with room
DEFAULT_MAX_TOKENS = 16           # OpenAI's default for /v1/completions


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class CompletionRequest:
    prompts: List[List[int]]          # one token-id list per choice
    prompt_texts: List[str]
    max_tokens: int
    stop: List[str]
    stop_ids: Tuple[int, ...]
    stream: bool
    echo: bool
    include_usage: bool


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_completion(body: Any, model_name: str, engine: Any) -> CompletionRequest:
    """Validate an OpenAI /v1/completions body against the served engine; raises ApiError (4xx)."""
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != model_name:
        raise ApiError(404, f"model {model!r} is not served here; this server serves {model_name!r} "
                            f"(GET /v1/models)", param="model", code="model_not_found")
    if "prompt" not in body or body["prompt"] is None:
        raise ApiError(400, "missing required field 'prompt' (a string or a list of token ids)", param="prompt")
    raw = body["prompt"]
    if isinstance(raw, str) or (isinstance(raw, list) and raw and all(_is_int(t) for t in raw)):
        raws = [raw]
    elif isinstance(raw, list) and raw and all(isinstance(p, (str, list)) for p in raw):
        raws = raw
    else:
        raise ApiError(400, "prompt must be a non-empty string, a list of token ids, or a list of those; "
                            f"got {type(raw).__name__} {json.dumps(raw)[:80]}", param="prompt")
    vocab = getattr(engine, "vocab_size", None) or getattr(getattr(engine, "tokenizer", None), "vocab_size", None)
    prompts, texts = [], []
    for p in raws:
        if isinstance(p, str):
            ids = list(engine.tokenizer.encode(p))
            text = p
        else:
            bad = [t for t in p if not _is_int(t) or t < 0 or (vocab is not None and t >= vocab)]
            if bad:
                raise ApiError(400, f"prompt token id {bad[0]!r} is not an id of this model "
                                    f"(0..{vocab - 1 if vocab else 'vocab-1'})", param="prompt")
            ids = list(p)
            text = engine.tokenizer.decode(ids)
        if not ids:
            raise ApiError(400, "prompt is empty (0 tokens); give at least one token", param="prompt")
        prompts.append(ids)
        texts.append(text)

    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    if not _is_int(max_tokens) or max_tokens < 0:
        raise ApiError(400, f"max_tokens must be an integer >= 0; got {json.dumps(max_tokens)}", param="max_tokens")
    ctx = int(engine.max_context)
    for ids in prompts:
        if len(ids) + max_tokens > ctx:
            raise ApiError(400, f"this model's maximum context length is {ctx} tokens, however you requested "
                                f"{len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} for the "
                                f"completion); shorten the prompt or lower max_tokens",
                           param="prompt", code="context_length_exceeded")

    temperature = body.get("temperature")
    if temperature is not None:
        if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or temperature < 0:
            raise ApiError(400, f"temperature must be a number >= 0; got {json.dumps(temperature)}",
                           param="temperature")
        if temperature > 0:
            raise ApiError(400, f"only greedy decoding is supported: send temperature=0 (got {temperature}); "
                                f"greedy is what keeps speculative decoding lossless", param="temperature")
    for key in ("n", "best_of"):
        v = body.get(key)
        if v is not None and v != 1:
            raise ApiError(400, f"{key}={json.dumps(v)} is not supported; greedy decoding has one answer, use {key}=1",
                           param=key)
    if body.get("logprobs") not in (None, 0, False):
        raise ApiError(400, "logprobs are not supported by this server", param="logprobs")

    stop = body.get("stop")
    if stop is None:
        stops: List[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = list(stop)
    else:
        raise ApiError(400, f"stop must be a string or a list of strings; got {json.dumps(stop)[:80]}", param="stop")
    if any(s == "" for s in stops):
        raise ApiError(400, "stop strings must be non-empty", param="stop")
    # A stop string that is exactly one token lets the engine stop early; longer ones are cut from the text.
    stop_ids = []
    for s in stops:
        ids = engine.tokenizer.encode(s)
        if len(ids) == 1:
            stop_ids.append(int(ids[0]))

    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, f"stream must be true or false; got {json.dumps(stream)}", param="stream")
    opts = body.get("stream_options") or {}
    return CompletionRequest(prompts, texts, int(max_tokens), stops, tuple(stop_ids), stream,
                             bool(body.get("echo", False)), bool(isinstance(opts, dict) and opts.get("include_usage")))


def cut_at_stop(text: str, stops: List[str]) -> Tuple[str, bool]:
    """Text up to (excluding) the earliest stop string, and whether one was found."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


class TextStream:
    """The text of one streamed choice, piece by piece as tokens arrive, equal in the end to the non-streamed
    text (cut_at_stop(decode(tokens), stops)).

        ts = TextStream(tokenizer, stops)
        ts.push([ids...]) -> str      text that is final now ("" while it could still change)
        ts.finish()       -> str      the rest, once generation ended
        ts.stopped                    a stop string was reached: nothing more will be emitted

    Held back: a trailing incomplete UTF-8 character (decodes to U+FFFD until its bytes arrive), and a tail
    that could still be the start of a stop string. A stop string ends the text at its earliest start, as
    cut_at_stop does, once no earlier-starting stop string can still complete.
    """

    def __init__(self, tokenizer, stops: List[str]):
        self.tokenizer, self.stops = tokenizer, [s for s in stops if s]
        self.tokens: List[int] = []
        self.emitted = 0                  # characters of the text already returned (no stop starts before)
        self.stopped = False

    def push(self, ids: List[int]) -> str:
        self.tokens.extend(int(t) for t in ids)
        return self._advance(final=False)

    def finish(self) -> str:
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self.stopped:
            return ""
        text = self.tokenizer.decode(self.tokens)
        if not final:
            text = text.rstrip("\ufffd")          # maybe an incomplete multi-byte character: wait for more
        e = self.emitted
        cut = min((i for i in (text.find(s, e) for s in self.stops) if i >= 0), default=-1)
        pending = None                          # earliest start of a stop string that may still complete
        if not final and self.stops:
            longest = max(len(s) for s in self.stops)
            for i in range(max(e, len(text) - longest + 1), len(text)):
                tail = text[i:]
                if any(len(s) > len(tail) and s.startswith(tail) for s in self.stops):
                    pending = i
                    break
        if cut >= 0 and (pending is None or pending >= cut):
            self.stopped = True
            end = cut
        else:
            end = min(x for x in (len(text), cut if cut >= 0 else None, pending) if x is not None)
        piece = text[e:end] if end > e else ""
        self.emitted = max(e, end)
        return piece


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128          # 16+ clients connecting at once must not overflow the listen backlog
    allow_reuse_address = True

    def server_bind(self):
        socketserver.TCPServer.server_bind(self)      # HTTPServer's getfqdn() can stall on reverse DNS
        self.server_name, self.server_port = self.server_address[:2]


class ServeApp:
    def __init__(self, status: StatusFile, host: str = "127.0.0.1", port: int = 30001, model_name: str = "model",
                 api_key: str = "", max_queue: int = 256):
        self.status = status
        self.host, self.port = host, int(port)
        self.model_name = model_name
        self.api_key = api_key or ""
        self.max_queue = int(max_queue)
        self.metrics = Metrics()
        self.engine: Any = None
        self.worker: Optional[EngineWorker] = None
        self.created = int(time.time())
        self._server: Optional[_Server] = None
        self._thread: Optional[threading.Thread] = None
        self._closed = False

    # -- lifecycle -------------------------------------------------------------------------------------
    def start(self) -> "ServeApp":
        try:
            self._server = _Server((self.host, self.port), _handler_for(self))
        except OSError as e:
            raise KdtreeError(f"cannot listen on {self.host}:{self.port} ({e.strerror}); "
                              f"set serve.port to a free port or stop the process holding it") from None
        self.port = self._server.server_address[1]        # serve.port=0 picks a free port
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="http", daemon=True)
        self._thread.start()
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
        self.worker = EngineWorker(engine, self.max_queue, on_done=self._count)

    def mark_ready(self) -> None:
        if self.worker is None:
            raise KdtreeError("serve: no engine attached; the load stage must run before serve")
        self.status.update(phase="ready")

    @property
    def ready(self) -> bool:
        return self.worker is not None and self.status.phase == "ready"

    def drain(self, timeout: Optional[float] = None) -> bool:
        """Stop taking completions, finish the accepted ones, close the port. True when all finished."""
        self.status.update(phase="draining")
        finished = self.worker.drain(timeout) if self.worker is not None else True
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._closed = True
        self.status.update(phase="stopped")
        return finished

    def _count(self, job: Job) -> None:
        self.metrics.generation(job.result, len(job.prompt_ids), job.started_at - job.submitted_at)

    # -- endpoints -------------------------------------------------------------------------------------
    def not_ready_error(self) -> ApiError:
        snap = self.status.snapshot()
        phase = snap.get("phase")
        if phase in ("draining", "stopped"):
            return ApiError(503, f"server is {phase} (shutting down); not accepting new completions",
                            "service_unavailable", code="draining")
        return ApiError(503, f"model is not ready: {describe(snap)}; completions are served once the engine is "
                             f"ready (poll GET /ready or /status)", "service_unavailable", code="not_ready")

    def complete(self, body: Any) -> Tuple[CompletionRequest, List[Job]]:
        if not self.ready:
            raise self.not_ready_error()
        req = parse_completion(body, self.model_name, self.engine)
        jobs = []
        try:
            for ids in req.prompts:
                jobs.append(self.worker.submit(Job(ids, req.max_tokens, req.stop_ids,
                                                   stream=queue.Queue() if req.stream else None)))
        except QueueFull:
            for job in jobs:
                job.cancel()
            raise ApiError(429, f"request queue is full ({self.max_queue} waiting, serve.max_queue); retry later",
                           "rate_limit_error", code="queue_full") from None
        except Draining:
            for job in jobs:
                job.cancel()
            raise self.not_ready_error() from None
        return req, jobs

    @staticmethod
    def job_error(job: Job) -> ApiError:
        if isinstance(job.error, KdtreeError):
            return ApiError(400, str(job.error), param="prompt")
        return ApiError(500, f"engine error: {type(job.error).__name__}: {job.error}", "server_error")

    def finish(self, req: CompletionRequest, job: Job, index: int) -> Dict[str, Any]:
        job.wait()
        if job.error is not None:
            raise self.job_error(job)
        r = job.result
        text = self.engine.tokenizer.decode(r.tokens)
        text, stopped = cut_at_stop(text, req.stop)
        finish = "stop" if stopped or r.finish_reason in ("stop", "eos") else "length"
        if req.echo:
            text = req.prompt_texts[index] + text
        return {"text": text, "index": index, "logprobs": None, "finish_reason": finish,
                "_tokens": r.tokens, "_result": r}

    def completion_response(self, req: CompletionRequest, choices: List[Dict[str, Any]]) -> Dict[str, Any]:
        prompt_tokens = sum(len(p) for p in req.prompts)
        completion_tokens = sum(len(c["_tokens"]) for c in choices)
        results = [c["_result"] for c in choices]
        accepted = [a for r in results for a in r.acceptance_lengths]
        return {
            "id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion", "created": int(time.time()),
            "model": self.model_name,
            "choices": [{k: v for k, v in c.items() if not k.startswith("_")} for c in choices],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens},
            "kdtree": {"target_forwards": sum(r.target_forwards for r in results),
                       "mean_acceptance_length": sum(accepted) / len(accepted) if accepted else 0.0,
                       "seconds": round(sum(r.seconds for r in results), 4)},
        }

    def status_body(self) -> Dict[str, Any]:
        snap = self.status.snapshot()
        snap["queue_depth"] = self.worker.depth if self.worker else 0
        snap["in_flight"] = self.worker.in_flight if self.worker else 0
        return snap

    def models_body(self) -> Dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "kdtree"}]}


def _handler_for(app: ServeApp):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"     # keep-alive for clients that pool connections (openai, httpx)
        server_version = "kdtree"

        def log_message(self, fmt, *args):
            # No per-request access log: the monitor polls every second and its lines must not read as
            # "log growth" (a progress signal) while the engine itself is stuck.
            pass

        # -- plumbing ----------------------------------------------------------------------------------
        def _send(self, code: int, body: Any, content_type: str = "application/json",
                  headers: Optional[Dict[str, str]] = None) -> None:
            data = body if isinstance(body, bytes) else (json.dumps(body) + "\n").encode()
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
            app.metrics.request(self.path.split("?")[0] if self._known() else "other", code)

        def _error(self, e: ApiError) -> None:
            headers = {"Retry-After": "1"} if e.status in (429, 503) else None
            if e.status >= 500 and e.status != 503:
                print(f"[serve] {self.command} {self.path} -> {e.status} {e.message}", file=sys.stderr, flush=True)
            self._send(e.status, e.body(), headers=headers)

        def _known(self) -> bool:
            return self.path.split("?")[0] in ROUTES_GET or self.path.split("?")[0] in ROUTES_POST

        def _read_json(self) -> Any:
            length = self.headers.get("Content-Length")
            if length is None:
                self.close_connection = True
                raise ApiError(411, "Content-Length header is required")
            try:
                n = int(length)
            except ValueError:
                self.close_connection = True
                raise ApiError(400, f"Content-Length {length!r} is not a number") from None
            if n > MAX_BODY_BYTES:
                self.close_connection = True
                raise ApiError(413, f"request body of {n} bytes exceeds {MAX_BODY_BYTES} bytes")
            raw = self.rfile.read(n)
            try:
                return json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ApiError(400, f"request body is not valid JSON: {e}") from None

        def _require_auth(self) -> None:
            """/v1/* needs `Authorization: Bearer <serve.api_key>` when a key is set; monitors' endpoints stay open."""
            if not app.api_key or not self.path.startswith("/v1/"):
                return
            got = self.headers.get("Authorization", "")
            if not hmac.compare_digest(got.encode(), f"Bearer {app.api_key}".encode()):
                raise ApiError(401, "missing or wrong API key; send 'Authorization: Bearer <serve.api_key>'",
                               code="invalid_api_key")

        # -- verbs -------------------------------------------------------------------------------------
        def do_GET(self):
            path = self.path.split("?")[0]
            try:
                self._require_auth()
                fn = ROUTES_GET.get(path)
                if fn is None:
                    if path in ROUTES_POST:
                        raise ApiError(405, f"{path} takes POST")
                    raise ApiError(404, f"no endpoint {path}; try /v1/completions, /v1/models, /health, /ready, "
                                        f"/status, /metrics")
                fn(self)
            except ApiError as e:
                self._error(e)

        def do_HEAD(self):
            self.do_GET()

        def do_POST(self):
            path = self.path.split("?")[0]
            try:
                body = self._read_json() if self.headers.get("Content-Length") != "0" else None
                self._require_auth()
                fn = ROUTES_POST.get(path)
                if fn is None:
                    if path in ROUTES_GET:
                        raise ApiError(405, f"{path} takes GET")
                    raise ApiError(404, f"no endpoint {path}; completions are POST /v1/completions")
                fn(self, body)
            except ApiError as e:
                self._error(e)
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True

        # -- endpoints ---------------------------------------------------------------------------------
        def health(self):
            snap = app.status.snapshot()
            code = 503 if snap.get("phase") == "failed" else 200
            self._send(code, {"status": "ok" if code == 200 else "failed", "phase": snap.get("phase"),
                              "pid": snap.get("pid"), "uptime_s": round(time.time() - snap["started_at"], 3)})

        def ready(self):
            snap = app.status.snapshot()
            if app.ready:
                self._send(200, {"ready": True, "phase": snap["phase"]})
            else:
                self._send(503, {"ready": False, "phase": snap.get("phase"), "status": describe(snap)},
                           headers={"Retry-After": "1"})

        def status(self):
            self._send(200, app.status_body())

        def metrics(self):
            w = app.worker
            text = app.metrics.render(app.status.snapshot(), w.depth if w else 0, w.in_flight if w else 0)
            self._send(200, text.encode(), "text/plain; version=0.0.4; charset=utf-8")

        def models(self):
            self._send(200, app.models_body())

        def completions(self, body):
            req, jobs = app.complete(body)
            if req.stream:
                return self._stream(req, jobs)
            choices = [app.finish(req, job, i) for i, job in enumerate(jobs)]
            resp = app.completion_response(req, choices)
            self._send(200, resp)
            k = resp["kdtree"]
            print(f"[serve] completion {resp['usage']['prompt_tokens']}+{resp['usage']['completion_tokens']} tokens "
                  f"{k['seconds']:.3f} s, acceptance {k['mean_acceptance_length']:.2f}", file=sys.stderr, flush=True)

        def _stream(self, req: CompletionRequest, jobs: List[Job]):
            try:
                self._stream_live(req, jobs)
            finally:                                    # a stop string, an error, the client gone: stop the rest
                for job in jobs:
                    job.cancel()

        def _stream_live(self, req: CompletionRequest, jobs: List[Job]):
            first = jobs[0].stream.get()                # the first tokens, or the end of a job that failed
            if first is None and jobs[0].error is not None:
                raise app.job_error(jobs[0])            # nothing sent yet: a JSON error like a non-streamed one
            cid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")       # the body ends when the connection closes
            self.end_headers()
            self.close_connection = True
            app.metrics.request("/v1/completions", 200)

            def send(obj) -> None:
                self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
                self.wfile.flush()

            def event(choice_index: int, text: str, finish: Optional[str]) -> None:
                send({"id": cid, "object": "text_completion", "created": created, "model": app.model_name,
                      "choices": [{"text": text, "index": choice_index, "logprobs": None, "finish_reason": finish}]})

            completion_tokens, t0 = 0, time.monotonic()
            for index, job in enumerate(jobs):
                ts = TextStream(app.engine.tokenizer, req.stop)
                if req.echo:
                    event(index, req.prompt_texts[index], None)
                for ids in _batches(job, first if index == 0 else _NOTHING):
                    piece = ts.push(ids)
                    if piece:
                        event(index, piece, None)
                    if ts.stopped:
                        job.cancel()                    # the text is over; free the engine for the next request
                        break
                if not ts.stopped and job.error is not None:
                    e = app.job_error(job)
                    print(f"[serve] stream failed after it started: {e.message}", file=sys.stderr, flush=True)
                    send(e.body())
                    self.wfile.write(b"data: [DONE]\n\n")
                    return
                piece = ts.finish()
                if piece:
                    event(index, piece, None)
                r = job.result
                finish = "stop" if ts.stopped or (r is not None and r.finish_reason in ("stop", "eos")) else "length"
                event(index, "", finish)
                completion_tokens += len(ts.tokens)
            if req.include_usage:
                prompt_tokens = sum(len(p) for p in req.prompts)
                send({"id": cid, "object": "text_completion", "created": created, "model": app.model_name,
                      "choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                               "total_tokens": prompt_tokens + completion_tokens}})
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
            print(f"[serve] stream {sum(len(p) for p in req.prompts)}+{completion_tokens} tokens "
                  f"{time.monotonic() - t0:.3f} s", file=sys.stderr, flush=True)

    ROUTES_GET = {"/health": Handler.health, "/ready": Handler.ready, "/status": Handler.status,
                  "/metrics": Handler.metrics, "/v1/models": Handler.models}
    ROUTES_POST = {"/v1/completions": Handler.completions}
    return Handler


_NOTHING = object()


def _batches(job: Job, first: Any = _NOTHING):
    """The token ids a streamed job commits, as lists, each holding all that arrived since the previous one;
    ends when the job does (its None)."""
    item = job.stream.get() if first is _NOTHING else first
    while item is not None:
        batch = list(item)
        while True:
            try:
                item = job.stream.get_nowait()
            except queue.Empty:
                item = _NOTHING
                break
            if item is None:
                break
            batch.extend(item)
        yield batch
        if item is _NOTHING:
            item = job.stream.get()
