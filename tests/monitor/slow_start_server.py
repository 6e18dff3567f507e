"""A minimal OpenAI-compatible server with a cold start, standing in for SGLang/vLLM in the watch tests:
it reads a file slowly with its port closed (like a weight load), logs a line per chunk, then serves
/v1/models and /v1/completions. It has no /status: the monitor must work from generic evidence.

    python slow_start_server.py --port P --read FILE --seconds S --log LOG [--go FILE]

With --go it waits (silently, port closed) until FILE exists, so a test can start watching first.
"""
import os
import argparse
import json
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--read", required=True)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--log", required=True)
    ap.add_argument("--go", default="")
    a = ap.parse_args()
    while a.go and not os.path.exists(a.go):
        time.sleep(0.05)
    log = open(a.log, "a", buffering=1)
    chunks = 20
    with open(a.read, "rb") as f:
        size = f.seek(0, 2)
        f.seek(0)
        for i in range(chunks):
            f.read(size // chunks)
            log.write(f"loading chunk {i + 1}/{chunks}\n")
            time.sleep(a.seconds / chunks)

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
            if self.path == "/v1/completions" and body.get("model") == "stand-in":
                return self._json(200, {"object": "text_completion", "choices": [{"text": "4", "index": 0}]})
            self._json(404, {"detail": "Not Found"})

    log.write("ready\n")
    ThreadingHTTPServer(("127.0.0.1", a.port), H).serve_forever()


if __name__ == "__main__":
    sys.exit(main())
