#!/usr/bin/env bash
# The one prepared script for the GPU machine: run from the repository root with $OUT set to a folder
# whose files come back. It installs the wheels carried in .whl/ (the Python packages our import chain
# needs that the machine's image lacks) into /tmp/site, records the device, runs tests/gpu and then
# `pdserve bench gpu`, each under its own timeout so the whole script ends within 8 minutes, and goes on
# to the bench when the tests fail. Exit status: 0 when both passed, 1 otherwise.
#
# What comes back in $OUT: device.txt, wheels.txt (the wheels installed), pip.log, tests_gpu.log,
# tests_gpu.xml (junit), bench_gpu.log, bench_gpu.json, bench_transfer_gpu.log/.json (nixl's VRAM page lists
# against the GPU's own copy), and whatever tests/gpu writes under $PDSERVE_GPU_RESULTS (tests/gpu/test_pd.py:
# PD on the one GPU over nixl against a colocated CUDA node). The wheels and the default model's tokenizer:
# `make gpu-wheels` puts them into .whl/ (name it in the run's carry).
set -u

if [ -z "${OUT:-}" ]; then
  echo "check.sh: \$OUT must name the folder the results go to" >&2
  exit 2
fi
mkdir -p "$OUT"

TESTS_TIMEOUT=${TESTS_TIMEOUT:-240}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-150}
TRANSFER_TIMEOUT=${TRANSFER_TIMEOUT:-45}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1  # the machine has no network
export TRITON_INTERPRET=0  # compiled for the GPU (tests/conftest.py chooses the interpreter only where it sees none)

shopt -s nullglob
wheels=(.whl/*.whl)
shopt -u nullglob
: > "$OUT/wheels.txt"
if [ ${#wheels[@]} -gt 0 ]; then
  if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      "${wheels[@]}" > "$OUT/pip.log" 2>&1; then
    for w in "${wheels[@]}"; do basename "$w"; done > "$OUT/wheels.txt"
  else
    echo "check.sh: installing the carried wheels failed (pip.log):" >&2
    tail -n 20 "$OUT/pip.log" >&2
  fi
  export PYTHONPATH="/tmp/site:$PWD"
else
  export PYTHONPATH="$PWD"
fi
echo "== wheels installed: $(wc -l < "$OUT/wheels.txt")"
cat "$OUT/wheels.txt"

{
  echo "== nvidia-smi -L"
  nvidia-smi -L 2>&1
  echo "== python / torch / triton"
  python3 - <<'EOF' 2>&1
import sys

import torch

print("python", sys.version.split()[0])
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", torch.cuda.get_device_name(0), f"{p.total_memory / 2**30:.1f} GiB", f"sm_{p.major}{p.minor}")
try:
    import triton

    print("triton", triton.__version__)
except ImportError as e:
    print("triton missing:", e)
try:
    import flashinfer

    print("flashinfer", flashinfer.__version__)
except ImportError as e:
    print("flashinfer missing:", e)
EOF
} > "$OUT/device.txt"
cat "$OUT/device.txt"

echo "== tests/gpu (timeout ${TESTS_TIMEOUT} s)"
PDSERVE_GPU_RESULTS="$OUT" timeout -k 5 "$TESTS_TIMEOUT" python3 -m pytest -q -p no:cacheprovider tests/gpu \
  --junitxml="$OUT/tests_gpu.xml" > "$OUT/tests_gpu.log" 2>&1
tests_rc=$?
tail -n 30 "$OUT/tests_gpu.log"
echo "== tests/gpu exit $tests_rc"

echo "== pdserve bench gpu (timeout ${BENCH_TIMEOUT} s)"
timeout -k 5 "$BENCH_TIMEOUT" python3 -m deploy.cli bench gpu --json "$OUT/bench_gpu.json" \
  > "$OUT/bench_gpu.log" 2>&1
bench_rc=$?
tail -n 45 "$OUT/bench_gpu.log"
echo "== bench gpu exit $bench_rc"

echo "== pdserve bench transfer --device cuda (timeout ${TRANSFER_TIMEOUT} s)"
timeout -k 5 "$TRANSFER_TIMEOUT" python3 -m deploy.cli bench transfer --device cuda --backend nixl --tokens 4096 \
  --repeats 3 --json "$OUT/bench_transfer_gpu.json" > "$OUT/bench_transfer_gpu.log" 2>&1
transfer_rc=$?
tail -n 20 "$OUT/bench_transfer_gpu.log"
echo "== bench transfer exit $transfer_rc"

echo "== summary: tests/gpu $tests_rc, bench gpu $bench_rc, bench transfer $transfer_rc"
if [ "$tests_rc" -ne 0 ] || [ "$bench_rc" -ne 0 ] || [ "$transfer_rc" -ne 0 ]; then
  exit 1
fi
exit 0
