#!/usr/bin/env bash
# Every GPU measurement issues 19 and 20 wait for, in one device call (the device tool allows
# 10 minutes a call and 30 a session; the host keeps /tmp only ~30 s between calls).
#
# On the GPU host, after ../shared/tools/gpu-host-prep.sh's install runs:
#   . /tmp/gpuhost/host.sh && bash benchmarks/gpu_session.sh        (writes under $OUT)
#
# Steps, each under its own time limit so one that hangs cannot take the others' time, each
# with its output in $OUT/<step>.txt and a line in $OUT/summary.txt (exit code, seconds); what
# the issues need first, the optional measurements after:
#   1. pytest -m gpu                        the GPU tests (issue 19's acceptance), over the
#                                           modules that hold them: the GPU host has only its
#                                           own packages (no tritonclient, no ray, maybe no
#                                           pynvml), and what a test cannot run there it skips
#   2. gpu.py                               staronnx vs ORT on googlenet (issue 35's table, 4
#                                           streams; each row lands in $OUT/gpu.json as it is
#                                           measured)
#   3. gpu.py --streams 8                   the setups that 8 streams moved on the H200 (graphs,
#                                           gpu+cpu) and a driver thread per stream (gpu+tps); a
#                                           Perfetto trace of graphs and gpu+cpu per batch size
#                                           ($OUT/traces.tgz: each stream's tasks and the gaps)
#   4. host_overhead --device cuda          host us/task, 1/2/4 streams, plain and colocated,
#                                           against ORT's CUDA provider in threads
# (benchmarks/colocation.py --device cuda and host_overhead --cuda-graphs run by hand.)
# SESSION_SECONDS (default 560) bounds the whole; the step limits add up to 540 s, so all of it
# also fits run.sh's session step (540 s). A step that would start with too little left is
# skipped and says so.
#
# `bash benchmarks/gpu_session.sh host` (a second device call, after the first) runs instead
# what issue 19 measures without a GPU, on the device's 16 idle cores, where the 2-core
# development VM's own stalls and wake-up costs cannot decide the figure:
#   5. host_overhead --device host          host us/task on HostRuntime (goal <= 40, 4 >= 1)
#   6. serving_path                         us/request through Server, open-loop tail at 25-75 %
#
# `bash benchmarks/gpu_session.sh serve` (carry [".serve-whl"], made here by
# benchmarks/device_serve_wheels.sh) runs issue 21's serve benchmark on those 16 cores, where the
# clients no longer compete with the server for two: the tail set (p99 at 64 clients, open loop
# at 25/50/75 %) and the googlenet set (JSON against binary HTTP).
#   7. serve.py --suite tail                8. serve.py --suite googlenet
#
# `bash benchmarks/gpu_session.sh predictions` (carry [".predict"], made here by
# benchmarks/device_predictions_prep.sh; no GPU library needed) runs issue 40's simulator
# benchmark on two of the device's cores (CORES, default 2,3), the others idle: the quiet
# machine its goals are stated for, which the development VM is not.
#   9. steadiness.py                        plain ONNX Runtime on the two cores: how steady
#  10. simulator.py                         googlenet, crnn_ocr, unet_seg: simulator vs live
set -u
OUT="${OUT:-gpu-session}"
mkdir -p "$OUT"
BUDGET="${SESSION_SECONDS:-560}"
START=$(date +%s)
PY="${PYTHON:-python3}"
: > "$OUT/summary.txt"
# the GPU in the summary's first line (a call brings back at most 8 files)
gpu=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -n 1)
echo "gpu: ${gpu:-none}" >> "$OUT/summary.txt"

step() {  # step NAME SECONDS COMMAND...
  local name="$1" limit="$2"; shift 2
  local left=$((BUDGET - ($(date +%s) - START)))
  if [ "$left" -lt 30 ]; then
    echo "$name: skipped ($left s of the session's budget left)" | tee -a "$OUT/summary.txt"
    return
  fi
  [ "$limit" -gt "$left" ] && limit="$left"
  local t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.txt" 2>&1
  local rc=$?
  echo "$name: exit $rc in $(($(date +%s) - t0)) s (limit $limit s)" | tee -a "$OUT/summary.txt"
  tail -n 4 "$OUT/$name.txt"
}

if [ "${1:-gpu}" = serve ]; then
  nproc > "$OUT/cores.txt"
  if [ -d .serve-whl ] && [ ! -f /tmp/site/.serve ]; then
    mkdir -p /tmp/site
    for w in .serve-whl/*.whl; do "$PY" -m zipfile -e "$w" /tmp/site; done && touch /tmp/site/.serve
  fi
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  step serve-tail 300 "$PY" benchmarks/serve.py --suite tail --rounds 3 --json "$OUT/serve-tail.json"
  step serve-googlenet 240 "$PY" benchmarks/serve.py --suite googlenet --rounds 2 --seconds 6 \
    --json "$OUT/serve-googlenet.json"
  echo "total: $(($(date +%s) - START)) s" | tee -a "$OUT/summary.txt"
  exit 0
fi
if [ "${1:-gpu}" = predictions ]; then  # issue 40 on two of the device's 16 quiet cores (carry [".predict"])
  nproc > "$OUT/cores.txt"
  if [ -d .predict/whl ] && [ ! -f /tmp/site/.predict ]; then
    mkdir -p /tmp/site
    for w in .predict/whl/*.whl; do "$PY" -m zipfile -e "$w" /tmp/site; done && touch /tmp/site/.predict
  fi
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  cores="${CORES:-2,3}"  # two one-core groups, as on the development VM; the other cores stay idle
  step steadiness 80 taskset -c "$cores" "$PY" benchmarks/steadiness.py --seconds 45 --json "$OUT/steadiness.json"
  step simulator 450 taskset -c "$cores" "$PY" benchmarks/simulator.py --steadiness 30 --json "$OUT/simulator.json"
  echo "total: $(($(date +%s) - START)) s" | tee -a "$OUT/summary.txt"
  exit 0
fi
if [ "${1:-gpu}" = host ]; then
  nproc > "$OUT/cores.txt"
  step host-overhead-host 150 "$PY" benchmarks/host_overhead.py --device host --seconds 2 --rounds 3
  step serving-path 240 "$PY" benchmarks/serving_path.py --seconds 3 --rounds 3
  echo "total: $(($(date +%s) - START)) s" | tee -a "$OUT/summary.txt"
  exit 0
fi
gpu_tests=$(grep -l "pytest.mark.gpu" tests/test_*.py)
step pytest-gpu 90 "$PY" -m pytest -m gpu -q -p no:cacheprovider -rs $gpu_tests
step gpu-table 280 "$PY" benchmarks/gpu.py --models googlenet --batches 1,8,32 --seconds 1.5 --json "$OUT/gpu.json"
step gpu-table-8streams 130 "$PY" benchmarks/gpu.py --models googlenet --batches 1,8 --seconds 1 --streams 8 \
  --setups graphs,gpu+cpu,gpu+tps --trace "$OUT/traces" --trace-setups graphs,gpu+cpu --json "$OUT/gpu-8streams.json"
step host-overhead 40 "$PY" benchmarks/host_overhead.py --device cuda --seconds 1 --rounds 2
# the Perfetto traces of the 8-stream step (where the time goes), as one file
[ -d "$OUT/traces" ] && tar czf "$OUT/traces.tgz" -C "$OUT" traces && rm -rf "$OUT/traces"
echo "total: $(($(date +%s) - START)) s" | tee -a "$OUT/summary.txt"
