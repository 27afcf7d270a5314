#!/bin/bash
# One device run on the H200 for the reliability work: both GPU suites (every shape models use included),
# compute-sanitizer's four tools over the checks that reach every kernel specialisation the suite builds (every
# dtype, state, layout, commit kind, planes, and the shapes d 64/128/256), and 10^5 decode steps per backend and
# state against the float64 oracle (`gdn drift`, the four runs side by side). Prepared on a build machine:
#   cargo build --release -p gdn-cli; cargo test --release --no-run -p gdn-cuda -p gdn-wgpu
#   copy target/release/gdn and the `conformance-*` test binaries of gdn-cuda and gdn-wgpu and the wgpu `varlen-*`
#   one to .devbin/final/{gdn,cuda_conformance,wgpu_conformance,wgpu_varlen}, strip them; Vulkan loaders in .gl
#   device run from the repo root, carry [".devbin/final", ".gl"]: bash tools/device/h200_reliability.sh
set -u
. tools/device/setup.sh
mkdir -p /work && ln -sfn "$PWD" /work/main
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$S"

# the drift runs start first, in the background: they are bound by the host's float64 oracle
stamp "drift: 10^5 decode steps, cuda and wgpu, f32 and bf16 state"
for be in cuda wgpu; do
  for st in f32 bf16; do
    (timeout 400 $B/gdn drift --backend $be --state $st --steps 100000 >"$OUT/drift_${be}_$st.txt" 2>&1;
     echo "drift $be $st rc $?" >>"$OUT/drift_${be}_$st.txt") &
  done
done

for t in cuda_conformance wgpu_conformance wgpu_varlen; do
  stamp "$t"
  timeout 200 $B/$t --nocapture --test-threads 8 >"$OUT/$t.log" 2>&1
  echo "$t rc $? $(grep 'test result' "$OUT/$t.log")" | tee -a "$S"
  grep -E "FAILED|panicked|SKIPPED" "$OUT/$t.log" | cut -c1-300 | sort | uniq | tee -a "$S"
done

# the checks that reach every specialisation, without the long runs (drift, 300 steps) and the random 48 cases
checks="every_shape every_dtype varlen_sequence_bits bf16_state_invariants commit_first_k verify_mutates \
untouched_slots planes_and_group nan_inputs bad_varlen invariants_hold dtypes_and_layouts const_length \
device_step hf_fixtures"
for tool in memcheck racecheck synccheck initcheck; do
  stamp "compute-sanitizer $tool"
  timeout 90 compute-sanitizer --tool $tool --error-exitcode 9 $B/cuda_conformance --test-threads 4 $checks \
    >"$OUT/san.log" 2>&1
  echo "sanitizer $tool rc $? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|test result' "$OUT/san.log" | sort | uniq -c | tr '\n' ' ')" | tee -a "$S"
  grep -E "^=========" "$OUT/san.log" | grep -vE "SUMMARY|COMPUTE-SANITIZER" | head -20 | tee -a "$S"
done
rm -f "$OUT/san.log"
stamp "waiting for the drift runs"
wait
for f in "$OUT"/drift_*.txt; do echo "== $(basename "$f")"; tail -4 "$f"; done | tee -a "$S"
cat "$OUT"/drift_*.txt >"$OUT/drift.txt" && rm -f "$OUT"/drift_*.txt
stamp done
