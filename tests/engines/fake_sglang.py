"""An SGLang-shaped stand-in for the engine tests: it takes SGLang's launch_server flags (the ones kdtree/engines
builds), then cold-starts as SGLang does: worker processes in their own sessions page the checkpoint's largest file
in through mmap slowly, the port stays closed until they are done, then /v1/models and /v1/completions answer
(tests/monitor/slow_start_server.py does the serving). KDTREE_STANDIN_SECONDS sets the load time (default 4 s).

    fake_sglang.py --model-path DIR --port P --served-model-name NAME [any other SGLang flag]
"""
import argparse
import os
import sys
from pathlib import Path

SERVER = Path(__file__).resolve().parents[1] / "monitor" / "slow_start_server.py"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--served-model-name", default="stand-in")
    a, _unknown = ap.parse_known_args()                      # the speculative flags, --context-length, ...
    files = [p for p in Path(a.model_path).rglob("*") if p.is_file()]
    biggest = max(files, key=lambda p: p.stat().st_size)
    print(f"fake sglang: tp {a.tp_size}, loading {biggest} ({biggest.stat().st_size} B) on port {a.port}", flush=True)
    seconds = os.environ.get("KDTREE_STANDIN_SECONDS", "4")
    os.execv(sys.executable, [sys.executable, str(SERVER), "--port", str(a.port), "--read", str(biggest),
                              "--seconds", seconds, "--log", "/dev/stdout", "--workers", "2"])


if __name__ == "__main__":
    main()
