#!/bin/bash
# The quantized out_proj's closing run in one call: the crate's product tests (odd widths, both kernels), the
# conformance suite's out_proj tests, compute-sanitizer memcheck on the odd widths, the tensor-core kernel against
# the CUDA-core kernels at the seed's out_proj (`quant_mma_sweep`), then `gdn bench --backend cuda --out-proj 5120`.
# Prepared on a build machine: `cargo test --release -p gdn-cuda --no-run` and `cargo build --release -p gdn-cli`,
# the unit-test binary as gdn_cuda, tests/conformance.rs's as conformance and target/release/gdn as gdn, stripped
# and xz-compressed into .devbin/quant. device run from the repo root, carry [".devbin/quant"]:
#   bash tools/device/h200_quant.sh   (BENCH=0 skips the CLI's tail table, SWEEP=0 the tensor-core sweep; NCU=1
#   profiles the tensor-core kernel at 64 rows, 2-bit and 8-bit in u32: ncu's details page and the SASS source page
#   as CSV, for tools/ncu_segments.py; NCU1=1 the one-token kernels the same way; SAN=1 adds racecheck and synccheck;
#   TUNE=1 runs quant_tune_sweep, the one-token kernels)
set -u
. tools/device/setup.sh
Q=.devbin/quant
for f in $Q/*.xz; do xz -dkf "$f"; chmod +x "${f%.xz}"; done
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee -a "$S"
stamp "unit tests (quant)"
timeout 200 $Q/gdn_cuda quant:: 2>&1 | tail -5 | tee -a "$S"
stamp "conformance out_proj"
timeout 200 $Q/conformance out_proj quant_device 2>&1 | grep -E "test |result" | tee -a "$S"
stamp "memcheck odd widths"
timeout 200 compute-sanitizer --tool memcheck $Q/gdn_cuda odd_widths 2>&1 | grep -E "ERROR SUMMARY|test result" | tee -a "$S"
if [ "${SAN:-0}" = 1 ]; then
  for tool in racecheck synccheck; do
    stamp "$tool odd widths"
    timeout 240 compute-sanitizer --tool $tool $Q/gdn_cuda odd_widths 2>&1 | grep -E "SUMMARY|test result" | tee -a "$S"
  done
fi
if [ "${SWEEP:-1}" = 1 ]; then
  stamp "quant_mma_sweep"
  timeout 240 $Q/gdn_cuda quant_mma_sweep --ignored --nocapture >"$OUT/mma_sweep.txt" 2>&1
  echo "rc $?" | tee -a "$S"
fi
if [ "${TUNE:-0}" = 1 ]; then
  stamp "quant_tune_sweep"
  timeout 240 $Q/gdn_cuda quant_tune_sweep --ignored --nocapture >"$OUT/tune_sweep.txt" 2>&1
  echo "rc $?" | tee -a "$S"
fi
if [ "${BENCH:-1}" = 1 ]; then
  stamp "gdn bench out-proj"
  timeout 200 $Q/gdn bench --backend cuda --out-proj 5120 >"$OUT/bench_out_proj.txt" 2>&1
  echo "rc $?" | tee -a "$S"
fi
if [ "${NCU:-0}" = 1 ]; then
  stamp "ncu qm (64 rows)"
  timeout 240 ncu --set full --import-source no -k regex:qm_ --launch-count 2 -o "$OUT/qm" \
    $Q/gdn_cuda quant_profile_target --ignored >"$OUT/ncu_qm_run.log" 2>&1
  echo "rc $?" | tee -a "$S"
  ncu --import "$OUT/qm.ncu-rep" --page details >"$OUT/ncu_qm.txt" 2>&1
  ncu --import "$OUT/qm.ncu-rep" --page source --csv --print-source sass >"$OUT/ncu_qm_src.csv" 2>/dev/null
  rm -f "$OUT/qm.ncu-rep"
  grep -E "Duration|Warp Cycles Per Issued|Issued Warp Per|Achieved Occupancy|Registers Per|DRAM Throughput|Stall" \
    "$OUT/ncu_qm.txt" | head -30 | tee -a "$S"
fi
if [ "${NCU1:-0}" = 1 ]; then
  stamp "ncu q1 (1 row)"
  timeout 240 ncu --set full --import-source no -k regex:q1_ --launch-count 2 -o "$OUT/q1" \
    $Q/gdn_cuda quant_profile_target --ignored >"$OUT/ncu_q1_run.log" 2>&1
  echo "rc $?" | tee -a "$S"
  ncu --import "$OUT/q1.ncu-rep" --page details >"$OUT/ncu_q1.txt" 2>&1
  ncu --import "$OUT/q1.ncu-rep" --page source --csv --print-source sass >"$OUT/ncu_q1_src.csv" 2>/dev/null
  rm -f "$OUT/q1.ncu-rep"
  grep -E "Duration|Warp Cycles Per Issued|Issued Warp Per|Achieved Occupancy|DRAM Throughput" "$OUT/ncu_q1.txt" | tee -a "$S"
fi
stamp done
cat "$S"
[ -f "$OUT/mma_sweep.txt" ] && grep -E '^\|' "$OUT/mma_sweep.txt"
[ -f "$OUT/tune_sweep.txt" ] && grep -E '^\| (packing|[^|]+\| 1 \|)' "$OUT/tune_sweep.txt"
[ -f "$OUT/bench_out_proj.txt" ] && grep -E '^\|' "$OUT/bench_out_proj.txt"
