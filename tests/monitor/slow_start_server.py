"""A minimal OpenAI-compatible server with a cold start, standing in for SGLang/vLLM in the watch tests:
it reads a file slowly with its port closed (like a weight load), logs a line per chunk, then serves
/v1/models and /v1/completions. It has no /status: the monitor must work from generic evidence.

    python slow_start_server.py --port P --read FILE --seconds S --log LOG [--go FILE] [--workers N]

With --go it waits (silently, port closed) until FILE exists, so a test can start watching first.
With --workers N the main process reads nothing itself: N worker processes, each in its OWN session (outside
the main process's group, as SGLang/vLLM schedulers and TP workers started from a script are), page the file
in through mmap after dropping it from the page cache (so the pages come from disk: /proc/PID/io read_bytes),
and the port opens when they are done. With --early-port the port opens at once and completions answer 503
until the load is done (as kdtree's own engine does).
"""
import os
import argparse
import json
import mmap
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PAGE = 4096


def mmap_worker(path: str, part: int, parts: int, seconds: float) -> None:
    fd = os.open(path, os.O_RDONLY)
    size = os.fstat(fd).st_size
    lo, hi = size * part // parts, size * (part + 1) // parts
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)     # the load reads from disk, as a cold start does
    m = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
    m.madvise(mmap.MADV_RANDOM)                             # no readahead: the bytes arrive as the pages are touched
    steps = 40
    touched = 0
    for i in range(steps):
        end = lo + (hi - lo) * (i + 1) // steps
        for off in range(lo + touched, end, PAGE):
            touched += PAGE
            _ = m[off]
        time.sleep(seconds / steps)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--read", required=True)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--log", required=True)
    ap.add_argument("--go", default="")
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--early-port", action="store_true")
    ap.add_argument("--worker", type=int, default=-1, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker >= 0:
        return mmap_worker(a.read, a.worker, a.workers, a.seconds)
    loaded = threading.Event()

    class H(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _json(self, code, body):
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/v1/models":
                return self._json(200, {"object": "list", "data": [{"id": "stand-in", "object": "model"}]})
            self._json(404, {"detail": "Not Found"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path == "/v1/completions" and not loaded.is_set():
                return self._json(503, {"error": {"message": "loading"}})
            if self.path == "/v1/completions" and body.get("model") == "stand-in":
                return self._json(200, {"object": "text_completion", "choices": [{"text": "4", "index": 0}]})
            self._json(404, {"detail": "Not Found"})

    server = ThreadingHTTPServer(("127.0.0.1", a.port), H) if a.early_port else None
    if server is not None:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    while a.go and not os.path.exists(a.go):
        time.sleep(0.05)
    log = open(a.log, "a", buffering=1)
    if a.workers:
        with open(a.read, "rb+") as f:
            os.fsync(f.fileno())                               # clean pages, so they can be dropped
        workers = [subprocess.Popen([sys.executable, __file__, "--port", "0", "--read", a.read, "--log", a.log,
                                     "--seconds", str(a.seconds), "--workers", str(a.workers), "--worker", str(i)],
                                    start_new_session=True) for i in range(a.workers)]
        for w in workers:
            w.wait()
    else:
        chunks = 20
        with open(a.read, "rb") as f:
            size = f.seek(0, 2)
            f.seek(0)
            for i in range(chunks):
                f.read(size // chunks)
                log.write(f"loading chunk {i + 1}/{chunks}\n")
                time.sleep(a.seconds / chunks)

    loaded.set()
    log.write("ready\n")
    if server is None:
        server = ThreadingHTTPServer(("127.0.0.1", a.port), H)
        server.serve_forever()
    else:
        threading.Event().wait()


if __name__ == "__main__":
    sys.exit(main())
