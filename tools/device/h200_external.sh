#!/bin/bash
# One device run on the H200 for the step on memory the caller owns (CudaLayer::step_raw): the external tests,
# the CUDA conformance suite but its two long runs (the pool path's host code was refactored), and
# compute-sanitizer memcheck and racecheck on the external tests, the four in parallel (one GPU, separate
# processes) so that the run stays short. Prepared on a build machine:
#   cargo test --release -p gdn-cuda --no-run
#   copy the `external-*` and `conformance-*` test binaries, stripped, to .devbin/ext/{external,cuda_conformance}
#   and this script to .devbin/ext/ (the device gets the session's checkout, not a helper's worktree)
#   device run from the repo root, carry [".devbin/ext"]: bash .devbin/ext/h200_external.sh
#   `h200_external.sh bench`: the external_bench example twice, alone on the GPU
#   `h200_external.sh more` instead: the external tests, then the `external_bench` example (copied stripped to
#   .devbin/ext/external_bench) alone on the GPU, then synccheck, initcheck and racecheck on the external tests
set -u
B=$(dirname "$0")  # the folder this copy of the script lies in, with the binaries
S=$OUT/summary.txt
t0=$(date +%s)
stamp() { echo "-- t=$(( $(date +%s) - t0 ))s $*" | tee -a "$S"; }
L=$(dirname "$(find / -name 'libnvrtc.so.13*' -not -path '/proc/*' 2>/dev/null | grep -v builtins | head -1)")
export LD_LIBRARY_PATH="$L:${LD_LIBRARY_PATH:-}"
# the conformance binary finds the HF fixtures through the path it was built at
mkdir -p /work && for w in /work/main /work/wt-cuda; do [ -e $w ] || ln -sfn "$PWD" $w; done
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$S"
git log -1 --oneline 2>/dev/null | tee -a "$S"
stamp start
if [ "${1:-}" = bench ]; then
  for round in 1 2; do
    stamp "external_bench round $round"
    timeout 120 $B/external_bench 2>&1 | tee -a "$OUT/bench.md" | tee -a "$S"
  done
  exit 0
fi
if [ "${1:-}" = more ]; then
  timeout 100 $B/external --test-threads 1 --nocapture >"$OUT/external.log" 2>&1
  echo "external rc $? $(grep 'test result' "$OUT/external.log")" | tee -a "$S"
  grep -E "ok:|FAILED|panicked|SKIPPED" "$OUT/external.log" | cut -c1-300 | tee -a "$S"
  stamp "external_bench (alone on the GPU)"
  timeout 120 $B/external_bench 2>&1 | tee "$OUT/bench.md" | tee -a "$S"
  stamp "sanitizers"
  i=0
  for tool in synccheck initcheck racecheck; do
    timeout 200 compute-sanitizer --tool $tool --error-exitcode 9 $B/external --test-threads 1 \
      >"$OUT/$tool.log" 2>&1 &
    pids[$i]=$!; i=$((i + 1))
  done
  i=0
  for tool in synccheck initcheck racecheck; do
    wait ${pids[$i]}; rc=$?; i=$((i + 1))
    echo "sanitizer $tool rc $rc $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|test result' "$OUT/$tool.log" | sort | uniq -c | tr '\n' ' ')" | tee -a "$S"
    grep -E "^=========" "$OUT/$tool.log" | grep -vE "SUMMARY|COMPUTE-SANITIZER" | head -10 | tee -a "$S"
  done
  stamp done
  exit 0
fi
timeout 200 $B/external --test-threads 1 --nocapture >"$OUT/external.log" 2>&1 &
p1=$!
timeout 230 $B/cuda_conformance --test-threads 4 --skip bf16_state_drift --skip no_drift_over_long_runs \
  >"$OUT/conformance.log" 2>&1 &
p2=$!
timeout 260 compute-sanitizer --tool memcheck --error-exitcode 9 $B/external --test-threads 1 \
  >"$OUT/memcheck.log" 2>&1 &
p3=$!
timeout 260 compute-sanitizer --tool racecheck --racecheck-report all --error-exitcode 9 $B/external \
  --test-threads 1 external_step_matches_the_pool_bitwise graph_replays >"$OUT/racecheck.log" 2>&1 &
p4=$!
wait $p1; echo "external rc $? $(grep 'test result' "$OUT/external.log")" | tee -a "$S"
grep -E "^ok:|FAILED|panicked|SKIPPED" "$OUT/external.log" | cut -c1-300 | tee -a "$S"
wait $p2; echo "conformance rc $? $(grep 'test result' "$OUT/conformance.log")" | tee -a "$S"
grep -E "FAILED|panicked|SKIPPED" "$OUT/conformance.log" | cut -c1-300 | sort | uniq | head -20 | tee -a "$S"
for t in memcheck racecheck; do
  [ $t = memcheck ] && wait $p3 || wait $p4
  echo "sanitizer $t rc $? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|test result' "$OUT/$t.log" | sort | uniq -c | tr '\n' ' ')" | tee -a "$S"
  grep -E "^=========" "$OUT/$t.log" | grep -vE "SUMMARY|COMPUTE-SANITIZER" | head -10 | tee -a "$S"
  grep -E "panicked|FAILED" "$OUT/$t.log" | head -5 | tee -a "$S"
done
stamp done
