#!/usr/bin/env bash
# bench/README.md's side-by-side run against vLLM CPU, scripted: three rounds; in each, vLLM (bound to cores
# 0-1 with VLLM_CPU_OMP_THREADS_BIND, as pdserve uses both), `pdserve serve` and `pdserve serve --quantization
# w8a8_int8`, one at a time on port 30100, each started afresh and given the README's three workloads through
# `pdserve bench serve` with the same prompts. Writes <server>-<workload>-r<round>.json and every log into
# $OUT (default /tmp/sbs). VLLM_PY: the python of the vLLM venv (default /tmp/vllm/bin/python); PDSERVE: the
# pdserve command (default .venv/bin/pdserve). Check each vLLM log's "OpenMP thread binding info" lines:
# "core ids=[0, 1]" says it ran on both cores.
set -u
OUT=${OUT:-/tmp/sbs}; mkdir -p "$OUT"
M=~/.cache/pdserve/SmolLM2-135M-Instruct
PD=${PDSERVE:-.venv/bin/pdserve}
VLLM_PY=${VLLM_PY:-/tmp/vllm/bin/python}
PORT=30100
wait_up() { for i in $(seq 1 300); do curl -sf "http://127.0.0.1:$PORT/v1/models" >/dev/null && return 0; sleep 1; done; return 1; }
run_workloads() {  # name round
  local n=$1 r=$2 base="--base-url http://127.0.0.1:$PORT --tokenizer $M --disable-tqdm"
  $PD bench serve $base --num-prompts 4 --random-input-len 512 --random-output-len 64 --random-range-ratio 1 \
    --max-concurrency 1 --json "$OUT/$n-single-r$r.json" > "$OUT/$n-single-r$r.log" 2>&1
  $PD bench serve $base --num-prompts 32 --random-input-len 256 --random-output-len 64 --random-range-ratio 1 \
    --max-concurrency 16 --json "$OUT/$n-batch16-r$r.json" > "$OUT/$n-batch16-r$r.log" 2>&1
  $PD bench serve $base --num-prompts 40 --random-input-len 256 --random-output-len 32 --random-range-ratio 0.5 \
    --max-concurrency 8 --json "$OUT/$n-serving-r$r.json" > "$OUT/$n-serving-r$r.log" 2>&1
}
start() {  # name -> pid
  case $1 in
    vllm) VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 OMP_NUM_THREADS=2 setsid "$VLLM_PY" \
            -m vllm.entrypoints.openai.api_server --model $M --dtype float32 --port $PORT --max-model-len 2048 \
            > "$OUT/vllm-server-r$2.log" 2>&1 & ;;
    pdserve) setsid $PD serve --model default --port $PORT > "$OUT/pdserve-server-r$2.log" 2>&1 & ;;
    pdserve_w8a8) setsid $PD serve --model default --port $PORT --quantization w8a8_int8 \
            > "$OUT/pdserve_w8a8-server-r$2.log" 2>&1 & ;;
  esac
  echo $!
}
for r in 1 2 3; do
  for n in vllm pdserve pdserve_w8a8; do
    pid=$(start $n $r)
    if wait_up; then
      echo "$(date +%T) round $r $n up"; run_workloads $n $r; echo "$(date +%T) round $r $n done"
    else
      echo "$(date +%T) round $r $n did not start"
    fi
    kill -TERM -- -$pid 2>/dev/null; sleep 3; kill -KILL -- -$pid 2>/dev/null; sleep 2
  done
done
echo all done
