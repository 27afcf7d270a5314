#!/bin/bash
# Splits of a head (the token-serial kernel's `Plan`) side by side in one device call: `bench decode` (every variant,
# in cache and rotated), `bench windows` under the planner's split and under each split in PLANS, and the speculative
# step (`spec_bench`) under the same splits, alternated REPS times so the call-to-call spread shows.
# Prepared on a build machine: `cargo build --release -p gdn-cuda --examples`; strip target/release/examples/{bench,
# spec_bench} and xz them into .devbin/plans. device run from the repo root, carry [".devbin/plans"]:
#   PLANS="8,8,8" bash tools/device/h200_plans.sh
# DECODE=0 / WINDOWS=0 leave those parts out; DECODE_PLANS="8,8,8 .." times `bench decode` under those splits too
# (GDN_CUDA_VARIANTS=default: the planner's memory hints alone); BIN_DIR names another binaries' folder; PLANS= (empty) times the planner's split alone, e.g. the speculative
# step's call-to-call spread: DECODE=0 WINDOWS=0 PLANS= REPS=3 bash tools/device/h200_plans.sh
set -u
. tools/device/setup.sh
B=${BIN_DIR:-.devbin/plans}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee -a "$S"
for f in $B/*.xz; do xz -dkf "$f"; chmod +x "${f%.xz}"; done
PLANS=${PLANS-8,8,8}  # empty: the planner's split alone
if [ "${DECODE:-1}" != 0 ]; then
  for p in default ${DECODE_PLANS:-}; do
    stamp "bench decode $p"
    if [ $p = default ]; then e=; else e="GDN_CUDA_PLAN=$p"; fi
    env $e timeout 200 $B/bench decode >"$OUT/decode_${p//,/-}.txt" 2>&1; echo "decode $p rc $?" | tee -a "$S"
  done
fi
if [ "${WINDOWS:-1}" != 0 ]; then
  for p in default $PLANS; do
    stamp "bench windows $p"
    if [ $p = default ]; then e=; else e="GDN_CUDA_PLAN=$p"; fi
    env $e timeout 150 $B/bench windows >"$OUT/windows_${p//,/-}.txt" 2>&1; echo "windows $p rc $?" | tee -a "$S"
  done
fi
for r in $(seq 1 ${REPS:-2}); do
  for p in default $PLANS; do
    stamp "spec_bench $p rep $r"
    if [ $p = default ]; then e=; else e="GDN_CUDA_PLAN=$p"; fi
    env $e timeout 100 $B/spec_bench ${SPEC_B:-64,256} ${SPEC_W:-4,8} >"$OUT/spec_${p//,/-}_$r.txt" 2>&1
    echo "spec $p rep $r rc $?" | tee -a "$S"
  done
done
stamp done
for f in "$OUT"/decode_*.txt; do [ -f "$f" ] && { echo "===== $(basename $f)"; grep -E '^\||empty kernel' "$f"; }; done
for f in "$OUT"/windows_*.txt; do [ -f "$f" ] && { echo "===== $(basename $f)"; grep -E '^\|' "$f"; }; done
for f in "$OUT"/spec_*.txt; do echo "===== $(basename $f)"; grep -E '^\| (f32|bf16)' "$f"; done
echo "===== summary"; cat "$S"
