#!/usr/bin/env bash
# The GPU check, for one run on a GPU machine (an H200 with torch 2.11, no
# network): build the extension there, run the GPU tests, the kernel benchmark
# and the peak-memory benchmark (1.3b preset, bf16 with and without master
# weights, and fp32), and print a short table last. Logs and JSON go to $OUT
# (8 files at most). Each stage has its own time limit so the whole script ends
# within about 8 minutes and always prints what it has.
#
#   OUT=/tmp/gpu_out bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS="${MAX_JOBS:-16}" TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
PY="${PYTHON:-python3}"
status=0
stage() {  # stage NAME SECONDS LOG COMMAND...: runs one stage, records its exit status
  local name=$1 limit=$2 log=$3; shift 3
  echo "== $name (limit ${limit}s) $(date -u +%H:%M:%S)"
  timeout "$limit" "$@" >"$log" 2>&1
  local rc=$?
  echo "   exit $rc"
  [ $rc -eq 0 ] || status=1
  return $rc
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

# Offline: no dependency resolution, build against the torch that is there.
stage build 180 "$OUT/build.log" "$PY" -m pip install -v --no-build-isolation --no-deps --no-index . \
  || { tail -30 "$OUT/build.log"; exit 1; }
"$PY" -c "import swap_optimizer as so; assert so.built_with_cuda(), 'no CUDA kernels in this build'"

# The suite's CUDA variants (ids ending in cuda) and the GPU-only tests, from
# the tests folder so the installed package is imported.
stage gpu-tests 90 "$OUT/gpu_tests.log" "$PY" -m pytest -q -p no:cacheprovider tests -k "cuda or gpu" -rs
tail -3 "$OUT/gpu_tests.log"

stage kernel-bench 45 "$OUT/kernel_bench.log" "$PY" benchmarks/kernel_bench.py --device cuda --json "$OUT/kernel_bench.json"

# 1.3b: 5.3 GB of bf16 state, 15.8 GB with fp32 masters and states, 10.5 GB in
# fp32, moved each way every step; host stores are pinned afresh for each mode.
BENCH=(--device cuda --preset 1.3b --num-arenas 2,3 --warmup 2 --repeats 10)
stage bench-bf16 110 "$OUT/bench.log" "$PY" -P -m swap_optimizer.bench "${BENCH[@]}" --dtype bf16 --swap-times 8 \
  --json "$OUT/bench_bf16.json" --plot "$OUT/bench_bf16.png"
stage bench-fp32 100 "$OUT/bench_fp32.log" "$PY" -P -m swap_optimizer.bench "${BENCH[@]}" --dtype fp32 \
  --swap-times 8,16 --json "$OUT/bench_fp32.json"
cat "$OUT/bench_fp32.log" >>"$OUT/bench.log" && rm -f "$OUT/bench_fp32.log"

"$PY" - "$OUT" <<'PYEOF' | tee "$OUT/summary.txt"
import json, os, sys
out = sys.argv[1]
print("\n== summary")
for name in ("bench_bf16.json", "bench_fp32.json"):
    path = os.path.join(out, name)
    if not os.path.exists(path):
        print(f"{name}: missing (see bench.log)")
        continue
    report = json.load(open(path))
    env, model = report["environment"], report["model"]
    bw = env["bandwidth_bytes_per_s"]
    print(f"\n{model['preset']} {model['dtype']} on {env.get('device_name')} (torch {env['torch']}, CUDA {env['cuda']}); "
          f"H2D {bw['host_to_device']/1e9:.1f} GB/s, D2H {bw['device_to_host']/1e9:.1f} GB/s, both {bw['both_directions']/1e9:.1f} GB/s")
    resident = next(r for r in report["modes"] if r["kind"] == "resident")
    print(f"{'mode':<22}{'peak GiB':>10}{'vs resident':>13}{'step ms':>10}{'floor ms':>10}{'step/floor':>12}")
    for r in report["modes"]:
        floor = "-" if r["floor_ms"] is None else f"{r['floor_ms']:.1f}"
        over = "-" if r["step_over_floor"] is None else f"{r['step_over_floor']:.2f}"
        print(f"{r['mode']:<22}{r['peak_train_bytes']/2**30:>10.2f}{r['peak_train_bytes']/resident['peak_train_bytes']:>13.2f}"
              f"{r['step_ms']:>10.1f}{floor:>10}{over:>12}")
PYEOF
ls "$OUT"
exit $status
