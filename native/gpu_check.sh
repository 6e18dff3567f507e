#!/usr/bin/env bash
# GPU check of the native library, < 5 min on one H200: rebuild libkdtree_cuda.so (sm_90 + compute_90 PTX) here,
# run the parity suite's gpu cases (tests/native, -m gpu: every op x shape on "cuda" vs numpy, guard regions,
# batch invariance, tree row == AR step) and the CUDA kernel benchmarks (time + GB/s).
#
#   native/gpu_check.sh                       # from anywhere; PYTHON=... to pick the interpreter
#   device tool: run(command="native/gpu_check.sh", carry=[".whl"], timeout_s=420)
#
# The device image's python3 has numpy/pytest/pytest-benchmark but no cffi: put cffi + pycparser wheels in .whl/
# (see /work/.library/device/README.md) and carry it; they are installed into /tmp/kd_site for this run only.
# Results: stdout, and $OUT/kd_gpu_bench.json (pytest-benchmark JSON) when $OUT is set.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
if ! "$PY" -c "import cffi" 2>/dev/null; then
  if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/kd_site .whl/*.whl
    export PYTHONPATH=/tmp/kd_site${PYTHONPATH:+:$PYTHONPATH}
  else
    echo "gpu_check: $PY cannot import cffi; pip install cffi, or carry cffi/pycparser wheels in .whl/" >&2
    exit 2
  fi
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
# -B: a library built on another image may not load or match here
time make -B -C native NVCC="$NVCC"
"$PY" - <<'PY'
from kdtree.backends import native
n = native.cuda_device_count()
print(f"libkdtree_cuda.so: ABI {native.load_library('cuda').version}, cuda devices: {n} {native.CUDA_REASON}")
raise SystemExit(0 if n > 0 else 3)
PY
timeout 240 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/native -rs
timeout 150 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/bench/test_native_bench.py \
  --benchmark-enable --benchmark-only --benchmark-columns=min,median,mean,rounds \
  --benchmark-json="${OUT:-/tmp}/kd_gpu_bench.json"
"$PY" - "${OUT:-/tmp}/kd_gpu_bench.json" <<'PY'
import json, sys
for b in json.load(open(sys.argv[1]))["benchmarks"]:
    print(f"{b['name']:50s} median {b['stats']['median'] * 1e6:9.1f} us  {b['extra_info'].get('GB/s', '?')} GB/s")
PY
