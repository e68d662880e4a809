#!/usr/bin/env bash
# The GPU measurements in one device call each (the device tool: <= 10 minutes a call, at most 8
# files back; the host keeps /tmp only ~30 s between calls).
#
# On the GPU host, after ../shared/tools/gpu-host-prep.sh made .gpu1 here (carry [".gpu1"],
# timeout_s 600), the commit written in (the device's copy of the tree has no .git):
#   . .gpu1/host.sh && STARONNX_COMMIT=<git rev-parse HEAD> bash benchmarks/gpu_session.sh
#
# Each step runs under its own limit (printed before it starts, its time after), so one that
# hangs cannot take the others' time; its output goes to $OUT/logs/<step>.txt and a line to
# $OUT/summary.txt; a step that would start with under 30 s left is skipped and says so. The
# call returns at most 6 files: summary.txt, the step logs and traces as one logs.tgz, and what
# the mode writes (gpu.json and gpu-table.md for the table).
#
# `gpu_session.sh` (or `gpu_session.sh table`): issue 48's table, 480 s of steps (SESSION_SECONDS),
# which leaves the call >= 90 s under its 600 s for host.sh's unpacking and the transfers:
#   1. models      50 s  googlenet, resnet50 and the encoder exported with the host's torch
#                        (benchmarks/gpu_models.py; ~5-15 s each)
#   2. table      400 s  benchmarks/gpu.py over the matrix, most important rows first, continuing
#                        from the newest committed benchmarks/results/gpu-*.json of this GPU model;
#                        each row lands in $OUT/gpu.json as it is measured; the harness's own
#                        --budget (30 s under the limit) starts no row the slowest so far says
#                        would overrun, so the limit never cuts a row in half
#   3. table-md    10 s  benchmarks/gpu_table.py: $OUT/gpu-table.md from $OUT/gpu.json
# 460 s, plus <= 5 s of --kill-after each: 475 s. Sized from the H200 run of 2026-11-28: its
# googlenet table (3 batch sizes, ~20 figures of 1.5 s each, one sample, ~20 sessions opened per
# batch size) took ~165 s, about 1 s per session opened. A K = 16 row now measures 13 figures
# x 3 repeats x 2 s = 78 s; its 16 plain sessions and four runtimes are opened once for the
# three batch sizes of its model (~45 s, the CPU-help plans calibrated), its 8 tuned lanes per
# row (~10 s): ~90 s a row, ~50 s at K = 4 (7 figures). One call measures googlenet at K = 16
# and part of resnet50; the next continues from the committed JSON (--resume).
#
# `gpu_session.sh tests`: what issue 19 measures on a GPU, in a call of its own:
#   pytest -m gpu (90 s) over the modules that hold GPU tests (the host has only its own
#   packages: no tritonclient, no ray, maybe no pynvml, and what a test cannot run it skips),
#   then host_overhead --device cuda (40 s).
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
mkdir -p "$OUT/logs"
MODE="${1:-table}"
case "$MODE" in  # the table's call keeps >= 90 s of its 600 s; the other modes' steps add up to 560
  table|gpu) BUDGET="${SESSION_SECONDS:-480}" ;;
  *) BUDGET="${SESSION_SECONDS:-560}" ;;
esac
START=$(date +%s)
PY="${PYTHON:-python3}"
: > "$OUT/summary.txt"
# the GPU in the summary's first line
gpu=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -n 1)
echo "gpu: ${gpu:-none}" >> "$OUT/summary.txt"
echo "commit: $(git rev-parse HEAD 2>/dev/null || echo "${STARONNX_COMMIT:-unknown (set STARONNX_COMMIT)}")" \
  >> "$OUT/summary.txt"

step() {  # step NAME SECONDS COMMAND...: at most SECONDS (and what is left), output in logs/NAME.txt
  local name="$1" limit="$2"; shift 2
  local left=$((BUDGET - ($(date +%s) - START)))
  if [ "$left" -lt 30 ]; then
    echo "$name: skipped ($left s of the session's budget left)" | tee -a "$OUT/summary.txt"
    return
  fi
  [ "$limit" -gt "$left" ] && limit="$left"
  echo "$name: budget $limit s" >&2
  local t0=$(date +%s)
  timeout --kill-after=5 "$limit" "$@" > "$OUT/logs/$name.txt" 2>&1
  local rc=$?
  echo "$name: exit $rc in $(($(date +%s) - t0)) s (limit $limit s)" | tee -a "$OUT/summary.txt"
  tail -n 4 "$OUT/logs/$name.txt"
}

finish() {  # the logs (and traces) as one file, then the total
  tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
  echo "total: $(($(date +%s) - START)) s" | tee -a "$OUT/summary.txt"
}

if [ "$MODE" = serve ]; then
  nproc > "$OUT/logs/cores.txt"
  if [ -d .serve-whl ] && [ ! -f /tmp/site/.serve ]; then
    mkdir -p /tmp/site
    for w in .serve-whl/*.whl; do "$PY" -m zipfile -e "$w" /tmp/site; done && touch /tmp/site/.serve
  fi
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  step serve-tail 300 "$PY" benchmarks/serve.py --suite tail --rounds 3 --json "$OUT/serve-tail.json"
  step serve-googlenet 240 "$PY" benchmarks/serve.py --suite googlenet --rounds 2 --seconds 6 \
    --json "$OUT/serve-googlenet.json"
  finish
  exit 0
fi
if [ "$MODE" = predictions ]; then  # issue 40 on two of the device's 16 quiet cores (carry [".predict"])
  nproc > "$OUT/logs/cores.txt"
  if [ -d .predict/whl ] && [ ! -f /tmp/site/.predict ]; then
    mkdir -p /tmp/site
    for w in .predict/whl/*.whl; do "$PY" -m zipfile -e "$w" /tmp/site; done && touch /tmp/site/.predict
  fi
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  cores="${CORES:-2,3}"  # two one-core groups, as on the development VM; the other cores stay idle
  step steadiness 80 taskset -c "$cores" "$PY" benchmarks/steadiness.py --seconds 45 --json "$OUT/steadiness.json"
  step simulator 450 taskset -c "$cores" "$PY" benchmarks/simulator.py --steadiness 30 --json "$OUT/simulator.json"
  finish
  exit 0
fi
if [ "$MODE" = host ]; then
  nproc > "$OUT/logs/cores.txt"
  step host-overhead-host 150 "$PY" benchmarks/host_overhead.py --device host --seconds 2 --rounds 3
  step serving-path 240 "$PY" benchmarks/serving_path.py --seconds 3 --rounds 3
  finish
  exit 0
fi
if [ "$MODE" = tests ]; then
  gpu_tests=$(grep -l "pytest.mark.gpu" tests/test_*.py)
  step pytest-gpu 90 "$PY" -m pytest -m gpu -q -p no:cacheprovider -rs $gpu_tests
  step host-overhead 40 "$PY" benchmarks/host_overhead.py --device cuda --seconds 1 --rounds 2
  finish
  exit 0
fi
if [ "$MODE" != table ] && [ "$MODE" != gpu ]; then
  echo "gpu_session.sh: unknown mode $MODE (table, tests, host, serve, predictions)" >&2
  exit 2
fi
models="${MODELS_DIR:-/tmp/staronnx-gpu-models}"
step models 50 "$PY" benchmarks/gpu_models.py --out "$models"
step table 400 "$PY" benchmarks/gpu.py --models-dir "$models" --budget 370 --resume benchmarks/results \
  --trace "$OUT/logs/traces" --json "$OUT/gpu.json"
step table-md 10 "$PY" benchmarks/gpu_table.py "$OUT/gpu.json" -o "$OUT/gpu-table.md"
finish
