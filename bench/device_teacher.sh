#!/usr/bin/env bash
# The `teacher` benchmark group on an accelerator machine (e.g. one H200), from a fresh checkout:
#   bash bench/device_teacher.sh [OUT_DIR]
# Installs the project and jax[cuda12] into .venv-device, checks the GPU is seen, then runs
# `python -m bench.run --device --only teacher`: a 1.7B-parameter Qwen3-style teacher with random
# bfloat16 weights, 8 x 4096 tokens a step, through the dump's own teacher step (attention auto =
# the Pallas flash kernel; vocabulary-chunked selection), timed alternately with an 8192^3 bfloat16
# matmul in the same process. Reports tokens/s and MFU against both that measured dense bfloat16
# peak and the data-sheet peak. If the Pallas kernel fails to compile, reruns with --attention blocked.
# Results: OUT_DIR/results-device.json (+ a log); about 5-8 minutes including the install.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-${OUT:-bench/out/device}}"
mkdir -p "$OUT"
PY=.venv-device/bin/python
if [ ! -x "$PY" ]; then
  python3 -m venv .venv-device
  "$PY" -m pip install --quiet --upgrade pip
  JAX_VERSION="$(grep -oE '"jax==[0-9.]+"' pyproject.toml | grep -oE '[0-9.]+[0-9]' || echo 0.10.2)"
  "$PY" -m pip install --quiet -e . "jax[cuda12]==${JAX_VERSION}"
fi
"$PY" -c "import jax; print('devices:', jax.devices()); assert jax.default_backend() != 'cpu', 'no accelerator'"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv 2>/dev/null | tee "$OUT/gpu.csv" || true
run() {
  LOGIT_DISTILL_BENCH_ATTENTION="$1" timeout 480 "$PY" -m bench.run --device --only teacher --no-doc \
    --results "$OUT/results-device-$1.json" 2>&1 | tee "$OUT/bench-$1.log"
}
run auto || run blocked
"$PY" - "$OUT" <<'PYEOF'
import json, glob, sys
for path in sorted(glob.glob(f"{sys.argv[1]}/results-device-*.json")):
    doc = json.load(open(path))
    r = doc.get("teacher_flop_utilization_4096")
    if not r:
        print(path, "no utilization figure", doc.get("meta", {}).get("errors"))
        continue
    d = r["details"]
    print(f"{path}: {d['device_kind']}, attention {d['attention']}, batch {d['batch']} x {d['seq_len']}, "
          f"{d['dtype']}: {d['tokens_per_s']:.0f} tokens/s, {d['teacher_gflops_per_s'] / 1e3:.1f} TFLOP/s; "
          f"MFU vs measured bf16 matmul peak ({d['matmul_gflops_per_s'] / 1e3:.0f} TFLOP/s) {r['value']:.3f}; "
          f"vs data-sheet peak {d.get('mfu_vs_datasheet_bf16_peak', float('nan')):.3f}")
PYEOF
