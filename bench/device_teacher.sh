#!/usr/bin/env bash
# The `teacher` benchmark group on an accelerator machine (e.g. one H200), from a fresh checkout:
#   bash bench/device_teacher.sh [OUT_DIR]
# Installs the project and jax[cuda12] into .venv-device, checks the GPU is seen, then runs
# `python -m bench.run --device --only teacher`: a 1.7B-parameter Qwen3-style teacher with random
# bfloat16 weights, 8 x 4096 tokens a step, through the dump's own teacher step (attention auto =
# the Pallas flash kernel; vocabulary-chunked selection), timed alternately with an 8192^3 bfloat16
# matmul in the same process. Reports tokens/s and MFU against both that measured dense bfloat16
# peak and the data-sheet peak. If the Pallas kernel fails to compile, reruns with --attention blocked.
# Then the mixture of experts: Qwen3-30B-A3B's shapes (48 layers, 128 experts top-8, 3.3B active of 30.5B
# parameters, 61 GB of random bfloat16 weights: an 80 GB+ device), 8 x 4096 tokens a step through the same
# teacher step (experts auto = ragged_dot grouped matmuls), tokens/s and active-parameter MFU.
# Results: OUT_DIR/results-device-*.json (+ logs); about 8-12 minutes including the install.
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
DENSE_KEYS=teacher_flop_utilization_4096,attention_temp_bytes_ratio_8192_over_2048,load_over_read_ratio
run() {
  LOGIT_DISTILL_BENCH_ATTENTION="$1" timeout 480 "$PY" -m bench.run --device --only "$DENSE_KEYS" --no-doc \
    --results "$OUT/results-device-$1.json" 2>&1 | tee "$OUT/bench-$1.log"
}
run_moe() {
  LOGIT_DISTILL_BENCH_ATTENTION="$1" timeout 600 "$PY" -m bench.run --device --only moe_teacher_flop_utilization \
    --no-doc --results "$OUT/results-device-moe-$1.json" 2>&1 | tee "$OUT/bench-moe-$1.log"
}
run auto || run blocked
run_moe auto || run_moe blocked || true
"$PY" - "$OUT" <<'PYEOF'
import json, glob, sys
for path in sorted(glob.glob(f"{sys.argv[1]}/results-device-*.json")):
    doc = json.load(open(path))
    r = doc.get("teacher_flop_utilization_4096") or doc.get("moe_teacher_flop_utilization")
    if not r:
        print(path, "no utilization figure", doc.get("meta", {}).get("errors"))
        continue
    d = r["details"]
    print(f"{path}: {d['teacher']}: {d['device_kind']}, attention {d['attention']}, batch {d['batch']} x "
          f"{d['seq_len']}, {d['dtype']}: {d['tokens_per_s']:.0f} tokens/s, {d['teacher_gflops_per_s'] / 1e3:.1f} "
          f"TFLOP/s; MFU vs measured bf16 matmul peak ({d['matmul_gflops_per_s'] / 1e3:.0f} TFLOP/s) "
          f"{r['value']:.3f}; vs data-sheet peak {d.get('mfu_vs_datasheet_bf16_peak', float('nan')):.3f}")
PYEOF
