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
    POST /prefix_cache  {"enabled": bool}: the prefix cache on/off for new requests (the key, when one is set)
/v1/* needs `Authorization: Bearer <key>` when a key is set (KDTREE_API_KEY or serve.api_key_file), checked
before the body is read; the operator endpoints stay open (monitors and load balancers poll them without
secrets), but POST /prefix_cache checks the key too. Every error, whatever its status and whoever raised it (a
route, the router, the body limit, the HTTP parser), is OpenAI-shaped JSON:
{"error": {"message", "type", "param", "code"}}.

Streaming is live: the engine worker hands each commit's tokens to the request, which sends them as SSE chunks
(never splitting a UTF-8 character, holding back text that could still start a stop string), then a chunk with
finish_reason, the usage chunk when stream_options.include_usage, and `data: [DONE]`. An error before the first
token answers as JSON; one after the stream started (the engine failed, the server stopped before the request
finished) is an SSE `{"error": ...}` event before [DONE]: a stream never just ends.
"""
from __future__ import annotations

import hmac
import socket
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from kdtree.decode.request import ContextLengthExceeded, Request
from kdtree.decode.sampling import SamplingError, SamplingParams
from kdtree.errors import KdtreeError
from kdtree.serve import protocol as P
from kdtree.serve.batch_worker import BatchWorker
from kdtree.serve.bridge import wired
from kdtree.serve.chat_template import ChatTemplate, ChatTemplateError
from kdtree.serve.errors import request_error
from kdtree.serve.metrics import Metrics
from kdtree.serve.request_queue import Draining, QueueFull
from kdtree.serve.sse import seed_of
from kdtree.serve.status import StatusFile, describe
from kdtree.serve.transport import (MAX_CONNECTIONS, MAX_CONNECTIONS_PER_CLIENT, REQUEST_READ_TIMEOUT_S, ApiError,
                                    JsonH11Protocol)

MAX_BODY_BYTES = 8 << 20          # 8 MiB: a prompt as long as any context, JSON-encoded, fits with room
MAX_HEADER_BYTES = 16 << 10       # 16 KiB of request line + headers (h11's buffer limit; more is a 431)
KEEPALIVE_S = 5.0                 # an idle connection (also one that never sends a request) is closed after this


class ServeApp:
    def __init__(self, status: StatusFile, host: str = "127.0.0.1", port: int = 30001, model_name: str = "model",
                 api_key: str = "", max_queue: int = 256, cors_origins: Tuple[str, ...] = (),
                 max_body_bytes: int = MAX_BODY_BYTES, max_header_bytes: int = MAX_HEADER_BYTES,
                 max_connections: int = MAX_CONNECTIONS, keepalive_s: float = KEEPALIVE_S,
                 max_connections_per_client: int = MAX_CONNECTIONS_PER_CLIENT,
                 request_read_timeout_s: float = REQUEST_READ_TIMEOUT_S, tool_call_parser: str = "kimi_k2",
                 reasoning_parser: str = "auto"):
        self.status = status
        self.tool_call_parser, self.reasoning_parser = tool_call_parser, reasoning_parser  # output_plan.py
        self.host, self.port = host, int(port)
        self.model_name = model_name
        self.api_key = api_key or ""
        self.max_queue = int(max_queue)
        self.cors_origins = tuple(cors_origins or ())
        self.max_body_bytes, self.max_header_bytes = int(max_body_bytes), int(max_header_bytes)
        self.max_connections, self.keepalive_s = int(max_connections), float(keepalive_s)
        self.max_connections_per_client = int(max_connections_per_client)
        self.request_read_timeout_s = float(request_read_timeout_s)
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
        from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT   # more is paused until the app reads it

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
        protocol = type("_Protocol", (JsonH11Protocol,), {"max_connections": self.max_connections,
                                                     "max_connections_per_client": self.max_connections_per_client,
                                                     "read_timeout_s": self.request_read_timeout_s,
                                                     "whole_body_bytes": min(HIGH_WATER_LIMIT, self.max_body_bytes),
                                                     "api_key": self.api_key,
                                                     "closed": self.metrics.connections_closed})
        from kdtree.serve.routes import build_app      # the routes import this module's ServeApp helpers only
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
        # continuous batching: the engine's own scheduler (serve.max_batch_tokens, kv_pool_tokens, ...)
        self.worker = BatchWorker(engine, self.max_queue, on_done=self.metrics.generation)

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
                "speculating": float(snap["speculating"]),
                "prefix_cache_pages": {k: snap[f"prefix_cache_pages_{k}"] for k in ("used", "cached", "free")
                                       if f"prefix_cache_pages_{k}" in snap}}

    def set_prefix_cache(self, body: Any, authorization: str) -> Dict[str, Any]:
        """POST /prefix_cache {"enabled": bool}: the prefix cache on/off for new requests (behind the API key when
        one is set); its state and pages after."""
        if self.api_key and not hmac.compare_digest(authorization.encode(), f"Bearer {self.api_key}".encode()):
            raise ApiError(401, "missing or wrong API key; send 'Authorization: Bearer <key>'", code="invalid_api_key")
        if not isinstance(body, dict) or not isinstance(body.get("enabled"), bool):
            raise ApiError(400, 'send {"enabled": true} or {"enabled": false}', param="enabled")
        if self.worker is None:
            raise self.not_ready_error()
        try:
            self.worker.scheduler.set_prefix_cache(body["enabled"])
        except KdtreeError as e:
            raise ApiError(409, str(e), param="enabled", code="no_prefix_cache") from None
        snap = self.worker.snapshot()
        return {"enabled": snap["prefix_cache_enabled"],
                **{k[len("prefix_cache_"):]: v for k, v in snap.items() if k.startswith("prefix_cache_pages_")}}

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
        """Context the decoder needs past the last token: the tree's verify block (budget + root). Kept per engine:
        reading an OmegaConf key costs ~40 us, and a request of 60000 prompts checks every one."""
        engine = self.engine
        cached = getattr(self, "_headroom_of", None)
        if cached is not None and cached[0] is engine:
            return cached[1]
        cfg = getattr(engine, "cfg", None)
        head = 0 if getattr(engine, "drafter", None) is None or cfg is None else int(cfg.tree.budget) + 1
        if engine is not None:
            self._headroom_of = (engine, head)
        return head

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
            param = "max_tokens" if max_tokens + head >= ctx else param    # no prompt could fit beside it
            raise ApiError(400, f"this model's maximum context length is {ctx} tokens, however you requested "
                                f"{len(ids) + max_tokens + head} tokens ({len(ids)} in the prompt, {max_tokens} for the "
                                f"completion, {head} for the speculative tree's verify block); shorten the prompt "
                                f"or lower max_tokens", param=param, code="context_length_exceeded")

    @property
    def pool_tokens(self) -> int:
        """Latent rows of the engine's cache pool (serve.kv_pool_tokens): the most one request can ever hold."""
        sched = getattr(self.engine, "scheduler", None)
        return int(sched.pool_tokens) if sched is not None else self.max_model_len

    def _check_fan_out(self, prompts: int, n: int) -> None:
        """len(prompt) x n requests that could never all be queued (serve.max_queue) are a 400, not a 429 forever."""
        if prompts * n > self.max_queue:
            param = "n" if n > 1 else "prompt"
            raise ApiError(400, f"{prompts} prompt(s) x n={n} = {prompts * n} completions exceed this server's queue of "
                                f"{self.max_queue} (serve.max_queue); send at most {self.max_queue} per request",
                           param=param, code="too_many_completions")

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

    def submit(self, prompts: List[List[int]], max_tokens: int, stops: List[str], loop, stream: bool,
               sampling: Optional[SamplingParams] = None, grammar: Any = None,
               extra_stop_ids: Sequence[int] = ()) -> List[Request]:
        """One Request per prompt and sample, wired to this loop (kdtree/serve/bridge.py): prompt-major, so request k
        is choice index k (prompt k // n, sample k % n, whose seed is sampling.for_sample(k % n).seed). All of them
        or none: a refusal cancels the ones already queued. `grammar` (a GrammarSpec): each its own matcher."""
        if not self.ready:
            raise self.not_ready_error()
        stop_ids, reqs = tuple(dict.fromkeys(self._stop_ids(stops) + tuple(extra_stop_ids))), []
        n = sampling.n if sampling is not None else 1
        try:
            for ids, i in [(ids, i) for ids in prompts for i in range(n)]:
                req = Request(ids, max_tokens, sampling=sampling.for_sample(i) if sampling is not None else None,
                              stop_ids=stop_ids, stop_strings=tuple(stops),
                              grammar=grammar.start() if grammar is not None else None)
                reqs.append(self.worker.submit(wired(req, loop, stream)))
        except QueueFull:
            self._cancel(reqs)
            raise ApiError(429, f"request queue is full ({self.max_queue} waiting, serve.max_queue); retry later",
                           "rate_limit_error", code="queue_full") from None
        except Draining:
            self._cancel(reqs)
            raise self.not_ready_error() from None
        except ContextLengthExceeded as e:            # larger than the whole cache pool (serve.kv_pool_tokens)
            self._cancel(reqs)
            raise ApiError(400, str(e), param="prompt", code=e.code) from None
        return reqs

    @staticmethod
    def _cancel(reqs: List[Request]) -> None:
        for r in reqs:
            r.cancel()

    @staticmethod
    def request_error(req: Request) -> ApiError:
        return request_error(req)

    def stats(self, results, sampling: Optional[SamplingParams] = None) -> P.KdtreeStats:
        accepted = [a for r in results for a in r.acceptance_lengths]
        return P.KdtreeStats(target_forwards=sum(r.target_forwards for r in results),
                             mean_acceptance_length=sum(accepted) / len(accepted) if accepted else 0.0,
                             seconds=round(sum(r.seconds for r in results), 4), seed=seed_of(sampling))
