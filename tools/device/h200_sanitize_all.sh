#!/bin/bash
# compute-sanitizer's four tools over the whole CUDA conformance suite but its two long runs (the bf16 drift over
# 10^4 steps and the 300-step run, which reach no specialisation the rest does not), so that every kernel
# specialisation the suite builds (random shapes and window lengths, every dtype, state, layout, commit kind,
# planes, every shape models use, the seed's, the device-native step and its faults) runs under each tool.
# Prepared like h200_reliability.sh (.devbin/final/cuda_conformance); carry [".devbin/final", ".gl"].
set -u
. tools/device/setup.sh
mkdir -p /work && ln -sfn "$PWD" /work/main
for tool in memcheck synccheck initcheck racecheck; do
  stamp "compute-sanitizer $tool"
  timeout 150 compute-sanitizer --tool $tool --error-exitcode 9 $B/cuda_conformance --test-threads 4 \
    --skip bf16_state_drift --skip no_drift_over_long_runs >"$OUT/san_$tool.log" 2>&1
  echo "sanitizer $tool rc $? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|test result' "$OUT/san_$tool.log" | sort | uniq -c | tr '\n' ' ')" | tee -a "$S"
  grep -E "^=========" "$OUT/san_$tool.log" | grep -vE "SUMMARY|COMPUTE-SANITIZER" | head -10 | tee -a "$S"
done
stamp done
