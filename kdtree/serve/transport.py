"""What happens to a request before a route sees it, and to errors that no route raises: the HTTP/1.1 protocol
with kdtree's limits (header size 431, connection count 503, idle sockets closed), the API key and body limit
checked before the body is read (_Guard), request ids, the `Server` header, the request counter and the access
log (_Access), and ApiError, the one shape of every error: {"error": {"message", "type", "param", "code"}}.
"""
from __future__ import annotations

import asyncio
import functools
import hmac
import json
import sys
import time
import uuid
from typing import Any, Dict, Optional

import h11
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

MAX_CONNECTIONS = 1024            # open sockets; one more is answered 503 and closed
MAX_CONNECTIONS_PER_CLIENT = 256  # open sockets of one client address; one more is answered 503 and closed
REQUEST_READ_TIMEOUT_S = 10.0     # a request head must arrive whole within this of its first byte; a body may
                                  # pause no longer than this between chunks (else 408, closed)
MONITOR_AGENT = "kdtree-monitor"  # the health monitor's User-Agent: its probes are not access-logged (see Access)
COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")
DISCARD_BYTES = 64 << 20          # a body over the limit is read and dropped up to this much past the limit before the
                                  # 413, so that the client, still sending, reads the 413 instead of a connection reset


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None, headers: Optional[Dict[str, str]] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = dict(self.headers or {})
        if self.status in (429, 503):
            headers.setdefault("Retry-After", "1")
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


@functools.lru_cache(maxsize=64)
def _error_bytes(status: int, message: str, type_: str, extra_headers: str = "") -> bytes:
    """A whole HTTP/1.1 error response, for the places below the ASGI app (the HTTP parser, the socket limit); the
    few that a flood gets again and again (503 at a cap or to make room, 408) are made once."""
    body = json.dumps({"error": {"message": message, "type": type_, "param": None, "code": None}}).encode()
    reason = _REASONS.get(status, "Error")
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n{extra_headers}\r\n").encode() + body


_REASONS = {400: "Bad Request", 408: "Request Timeout", 431: "Request Header Fields Too Large", 501: "Not Implemented",
            503: "Service Unavailable"}


HOARDER = 8          # an address with this many sockets open: its silent ones may be closed to make room


class _WholeBody:
    """JsonH11Protocol's app when whole_body_bytes is set: the app itself, started once a small body came whole."""

    def __init__(self, app, most: int, api_key: str):
        self.app, self.most, self.api_key = app, most, api_key

    async def __call__(self, scope, receive, send) -> None:
        """The app, once a small body (Content-Length up to `whole_body_bytes`, within serve.max_body_bytes) has come
        whole: a request whose body stalls until the read deadline (408) or until it is closed to make room never
        runs the app's middleware and route for nothing (under a flood of stalled bodies that was most of the event
        loop's time, ahead of every other client). A request that the Guard answers from its head alone starts the
        app at once: over the body limit by Content-Length (413), chunked, `Expect: 100-continue`, a /v1/ request
        without the key (401)."""
        cycle = getattr(receive, "__self__", None)          # the RequestResponseCycle whose receive this is
        # uvicorn's cycle internals (more_body, message_event, disconnected); another uvicorn: the app starts at once
        if getattr(cycle, "more_body", False) and hasattr(cycle, "message_event") and self._body_may_wait(scope):
            event = cycle.message_event
            while cycle.more_body and not cycle.disconnected:
                await event.wait()
                if cycle.more_body and not cycle.disconnected:
                    event.clear()
            event.set()                       # the app's first receive() returns the whole body (or the disconnect)
            if cycle.disconnected:            # closed before its body came (408, made room): nobody to answer
                return
        await self.app(scope, receive, send)

    def _body_may_wait(self, scope) -> bool:
        length = expect = auth = None
        for name, value in scope["headers"]:
            if name == b"content-length":
                length = value
            elif name == b"expect":
                expect = value
            elif name == b"authorization":
                auth = value
        if length is None or expect is not None or not length.isdigit() or int(length) > self.most:
            return False
        if self.api_key and scope["path"].startswith("/v1/"):
            return auth is not None and hmac.compare_digest(auth, b"Bearer " + self.api_key.encode())
        return True


class JsonH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with kdtree's limits and JSON errors where uvicorn answers plain text itself:
    a request the parser refuses (400; 431 when its head exceeds MAX_HEADER_BYTES; 501 for a transfer coding
    h11 does not implement), a socket over the connection limit or over the per-client limit (503), a connection
    idle for KEEPALIVE_S before its first request (closed), and the read deadline (408, closed): a request head
    must arrive whole within `read_timeout_s` of its first byte (a slowloris that trickles or stalls a head is
    cut), and a body may not pause longer than that between two chunks. uvicorn itself cancels its keep-alive
    timer at the first byte and arms nothing while a request is read."""

    max_connections = MAX_CONNECTIONS
    max_connections_per_client = MAX_CONNECTIONS_PER_CLIENT
    read_timeout_s = REQUEST_READ_TIMEOUT_S
    whole_body_bytes = 0              # a body of at most this many bytes (by Content-Length) is read whole before
                                      # the app starts (see _WholeBody); 0: the app starts at the head always
    api_key = ""                      # serve's key: a /v1/ request without it starts the app at once (its 401)
    closed = None                     # metrics: kdtree_connections_closed{reason} (a prometheus Counter), or None

    def _count_closed(self, reason: str) -> None:
        if self.closed is not None:
            self.closed.labels(reason).inc()

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._read_timer = None
        self._reading = None                   # "head" | "body" while a request is being read, else None
        host = self.client[0] if self.client else None
        self._client_host = host
        per_client = getattr(self.server_state, "kdtree_per_client", None)
        if per_client is None:
            per_client = self.server_state.kdtree_per_client = {}
        over = reason = None
        self._closing = False                  # refused or evicted: closed, not yet lost (not an open slot)
        st = self.server_state
        st.kdtree_closing = getattr(st, "kdtree_closing", 0)
        if not hasattr(st, "kdtree_reading"):
            st.kdtree_reading = {}             # connections without a whole request yet (ordered: oldest first)
        if len(self.connections) - st.kdtree_closing > self.max_connections and \
                not self._evict_a_slow_reader(per_client):
            over, reason = (f"too many open connections (serve.max_connections={self.max_connections}); retry "
                            f"later"), "max_connections"
        elif host is not None and self.max_connections_per_client > 0 and \
                per_client.get(host, 0) >= self.max_connections_per_client:
            reason = "max_connections_per_client"
            over = (f"too many open connections from {host} (serve.max_connections_per_client="
                    f"{self.max_connections_per_client}); close some or retry later")
        if over is not None:
            self._count_closed(reason)
            self._client_host = None           # not counted
            self._mark_closing()
            transport.write(_error_bytes(503, over, "service_unavailable", "retry-after: 1\r\n"))
            transport.close()
            return
        if host is not None:
            per_client[host] = per_client.get(host, 0) + 1
        st.kdtree_reading[self] = None
        if self.whole_body_bytes > 0:
            gate = getattr(st, "kdtree_whole_body", None)
            if gate is None:                   # one per server: a bound method here would tie the protocol in a cycle
                gate = st.kdtree_whole_body = _WholeBody(self.app, self.whole_body_bytes, self.api_key)
            self.app = gate
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)
        self._h11_error: Optional[h11.RemoteProtocolError] = None
        next_event = self.conn.next_event

        def remember_error():                 # uvicorn drops the exception; its status hint says 400 or 431
            try:
                return next_event()
            except h11.RemoteProtocolError as e:
                self._h11_error = e
                raise

        self.conn.next_event = remember_error

    def _evict_a_slow_reader(self, per_client) -> bool:
        """Over serve.max_connections: close one connection still reading its request (part of a head or of a
        body came, then it stalls or trickles: what a slowloris holds), never a lone client's; or one that sent
        nothing yet from an address holding HOARDER sockets or more (a flood's, before its heads are read), so
        that a new client (a /health probe, a completion) is served instead of refused while many addresses stall
        their requests. The oldest such one is taken from the server's set of unfinished reads (no scan of every
        connection per connect under a flood)."""
        victim = None
        for c in self.server_state.kdtree_reading:
            n = per_client.get(getattr(c, "_client_host", None), 0)
            if c is not self and not c.transport.is_closing() and \
                    ((getattr(c, "_reading", None) and n > 1) or (getattr(c, "cycle", 1) is None and n >= HOARDER)):
                victim = c
                break
        if victim is None:
            return False
        victim._mark_closing()
        victim._count_closed("made_room")
        victim._cancel_read_timer()
        self.server_state.kdtree_reading.pop(victim, None)
        victim.transport.write(_error_bytes(503, f"closed to make room: over serve.max_connections="
                                            f"{self.max_connections} while this request was still being sent",
                                            "service_unavailable", "retry-after: 1\r\n"))
        victim.transport.close()
        return True

    def _mark_closing(self) -> None:
        if not getattr(self, "_closing", False):
            self._closing = True
            self.server_state.kdtree_closing = getattr(self.server_state, "kdtree_closing", 0) + 1

    def connection_lost(self, exc) -> None:
        getattr(self.server_state, "kdtree_reading", {}).pop(self, None)
        self.conn.__dict__.pop("next_event", None)   # remember_error (it holds self): no cycle left for the collector
        if getattr(self, "_closing", False):
            self._closing = False
            self.server_state.kdtree_closing -= 1
        self._cancel_read_timer()
        host, self._client_host = getattr(self, "_client_host", None), None
        if host is not None:
            per_client = self.server_state.kdtree_per_client
            left = per_client.get(host, 1) - 1
            if left > 0:
                per_client[host] = left
            else:
                per_client.pop(host, None)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.transport.is_closing():
            self._cancel_read_timer()
            return
        theirs = self.conn.their_state
        reading = self.server_state.kdtree_reading
        if theirs is h11.SEND_BODY:            # a body being read: each chunk restarts the pause deadline
            self._arm_read_timer("body", restart=True)
            reading.setdefault(self, None)
        elif theirs is h11.IDLE and self.conn.trailing_data[0]:
            self._arm_read_timer("head", restart=False)   # part of a head: one deadline from its first byte
            reading.setdefault(self, None)
        else:
            self._cancel_read_timer()
            reading.pop(self, None)

    def _arm_read_timer(self, what: str, restart: bool) -> None:
        if self._read_timer is not None and not restart and self._reading == what:
            return
        self._cancel_read_timer()
        self._reading = what
        self._read_timer = self.loop.call_later(self.read_timeout_s, self._read_timed_out)

    def _cancel_read_timer(self) -> None:
        timer = getattr(self, "_read_timer", None)
        if timer is not None:
            timer.cancel()
        self._read_timer, self._reading = None, None

    def _read_timed_out(self) -> None:
        what, self._read_timer, self._reading = self._reading, None, None
        if self.transport.is_closing():
            return
        if what == "body" and self.flow.read_paused:      # the app has not taken what arrived: not the client's
            self._arm_read_timer("body", restart=True)    # pause, so no deadline while reading is paused
            return
        if self.cycle is None or self.cycle.response_complete or not self.cycle.response_started:
            self._count_closed("read_timeout")
            part = "request line and headers" if what == "head" else "request body"
            self.transport.write(_error_bytes(
                408, f"the {part} did not arrive in time (serve.request_read_timeout_s={self.read_timeout_s:g}: "
                     f"a head must arrive whole within it, a body may not pause longer); send the request at once",
                "invalid_request_error"))
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        err = getattr(self, "_h11_error", None)
        status = err.error_status_hint if err is not None and err.error_status_hint in _REASONS else 400
        if status == 431:
            text = (f"request line and headers exceed {self.conn._max_incomplete_event_size} bytes "
                    f"(serve.max_header_bytes); send fewer or shorter headers")
        elif status == 501:
            text = f"not implemented by this server: {err}; send an identity or chunked body"
        else:
            text = f"malformed HTTP request: {err or msg}"
        self.transport.write(_error_bytes(status, text, "invalid_request_error"))
        self.transport.close()


async def _discard(receive, most: int, idle_s: float = 0.5) -> None:
    """Read and drop up to `most` bytes of a request body; its end, a disconnect, or a pause of `idle_s` (a client
    that waits for the answer before it sends the rest) end it. Closing a socket with unread bytes resets it: the
    client, still sending, would see a reset instead of the 413."""
    while most > 0:
        try:
            message = await asyncio.wait_for(receive(), idle_s)
        except asyncio.TimeoutError:
            return
        if message["type"] != "http.request":
            return
        most -= len(message.get("body", b""))
        if not message.get("more_body"):
            return


class Guard:
    """Before the body is read: the API key (401), the body limit (413 from Content-Length, or while reading a
    chunked body)."""

    def __init__(self, app, serve: Any):       # serve: the ServeApp (api_key, limits, metrics, active)
        self.app, self.serve = app, serve

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        serve = self.serve
        head = sum(len(k) + len(v) + 4 for k, v in scope["headers"]) + len(scope.get("raw_path") or b"")
        if head > serve.max_header_bytes:    # h11 enforces its limit only on a head that arrives in pieces
            return await ApiError(431, f"request line and headers of {head} bytes exceed {serve.max_header_bytes} "
                                       f"bytes (serve.max_header_bytes); send fewer or shorter headers",
                                  headers={"Connection": "close"}).response()(scope, receive, send)
        headers = dict(scope["headers"])
        if serve.api_key and scope["path"].startswith("/v1/"):
            got = headers.get(b"authorization", b"")
            if not hmac.compare_digest(got, b"Bearer " + serve.api_key.encode()):
                return await ApiError(401, "missing or wrong API key; send 'Authorization: Bearer <key>' (the key "
                                           "of KDTREE_API_KEY or serve.api_key_file)", code="invalid_api_key",
                                      headers={"WWW-Authenticate": "Bearer"}).response()(scope, receive, send)
        limit = serve.max_body_bytes
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            msg = (f"request body of {length.decode(errors='replace')} bytes exceeds {limit} bytes "
                   f"(serve.max_body_bytes)" if length.isdigit() else "Content-Length is not a number")
            if length.isdigit() and int(length) <= limit + DISCARD_BYTES and b"expect" not in headers:
                await _discard(receive, int(length))      # (a client that expects 100-continue has sent none)
            return await ApiError(413 if length.isdigit() else 400, msg,
                                  headers={"Connection": "close"}).response()(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    if message.get("more_body"):
                        await _discard(receive, limit + DISCARD_BYTES - seen)
                    raise StarletteHTTPException(413, f"request body exceeds {limit} bytes (serve.max_body_bytes)")
            return message

        return await self.app(scope, counted, send)


def log_safe(value: Any) -> str:
    """`value` for one field of a log line: every control character (C0, DEL, C1, and the Unicode line and paragraph
    separators), a backslash and a double quote escaped as \\xNN / \\uNNNN, so that no request (a `%0a` in its
    path, a CR in a header) can end a log line or forge one, nor close the quoted request field."""
    text = str(value)
    if text.isprintable() and '"' not in text and "\\" not in text:
        return text
    return "".join(c if c.isprintable() and c not in '"\\' else
                   (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}") for c in text)


class Access:
    """X-Request-Id (echoed, or made), `Server: kdtree`, the request counter, one access-log line per request
    (stderr = the engine log), and the count of completion responses still being sent (the drain waits for it).
    The health monitor's own probes (User-Agent kdtree-monitor) are counted but not logged: its once-a-second
    lines would read as log growth, the monitor's evidence that a stuck engine still makes progress."""

    def __init__(self, app, serve: Any):       # serve: the ServeApp (api_key, limits, metrics, active)
        self.app, self.serve = app, serve

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        serve = self.serve
        headers = dict(scope["headers"])
        rid = headers.get(b"x-request-id", b"").decode("latin-1")
        if not rid or len(rid) > 128 or not rid.isprintable():
            rid = uuid.uuid4().hex
        t0 = time.monotonic()
        state = {"code": 500, "bytes": 0}
        path = scope["path"]
        completion = path in COMPLETION_PATHS and scope["method"] == "POST"
        if completion:
            with serve._active_lock:
                serve.active += 1

        async def wrapped(message):
            if message["type"] == "http.response.start":
                state["code"] = message["status"]
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid.encode()),
                                      (b"server", b"kdtree")]
            elif message["type"] == "http.response.body":
                state["bytes"] += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, wrapped)
        finally:
            if completion:
                with serve._active_lock:
                    serve.active -= 1
            known = path in COMPLETION_PATHS or path in ("/health", "/ready", "/status", "/metrics", "/v1/models",
                                                         "/openapi.json") or path.startswith("/v1/models/")
            serve.metrics.request(path if known and not path.startswith("/v1/models/") else
                                  ("/v1/models/{id}" if known else "other"), state["code"])
            if not headers.get(b"user-agent", b"").startswith(MONITOR_AGENT.encode()):
                client = scope.get("client") or ("-", 0)
                version = "HTTP/" + scope.get("http_version", "1.1")
                line = " ".join(log_safe(f) for f in (scope["method"], path, version))
                print(f"[access] {log_safe(client[0])} \"{line}\" {state['code']} {state['bytes']} "
                      f"{time.monotonic() - t0:.3f}s rid={log_safe(rid)}", file=sys.stderr, flush=True)
