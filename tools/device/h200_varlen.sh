#!/bin/bash
# One device run on the H200 for the varlen / dtype / bf16-state work: the conformance suite on the CUDA backend
# and on wgpu through NVIDIA's Vulkan driver, compute-sanitizer on the varlen checks (cuda), and `gdn bench` of
# the binary before the work (.devbin/final/base_gdn) and after it side by side, then the new cases (bf16 state,
# bf16 activations, the mixed batch). Prepared on a build machine:
#   cargo build --release -p gdn-cli; cargo test --release --no-run -p gdn-cuda -p gdn-wgpu
#   copy target/release/gdn, the baseline's gdn (as base_gdn) and the two `conformance-*` test binaries to
#   .devbin/final/{gdn,base_gdn,cuda_conformance,wgpu_conformance}, strip them; Vulkan loaders in .gl
#   copy the wgpu `varlen-*` test binary too, as wgpu_varlen
#   device run from the repo root, carry [".devbin/final", ".gl"]: bash tools/device/h200_varlen.sh tests, then
#   the same with bench (two calls, each well inside the 10-minute limit of one)
set -u
. tools/device/setup.sh
# the test binaries find the HF fixtures through the path they were built at
mkdir -p /work && ln -sfn "$PWD" /work/main
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee -a "$S"
# every table goes to one file (at most 8 files come back): bench NAME BIN ARGS...
bench() {
  local name=$1 bin=$2; shift 2
  echo "===== $name: $bin bench $*" >>"$OUT/bench.txt"
  timeout 120 "$B/$bin" bench "$@" >>"$OUT/bench.txt" 2>&1
  echo "bench $name rc $?" | tee -a "$S"
}

if [ "${1:-tests}" = tests ]; then

for t in cuda_conformance wgpu_conformance wgpu_varlen; do
  stamp "$t"
  timeout 200 $B/$t --nocapture --test-threads 8 >"$OUT/$t.log" 2>&1
  echo "$t rc $? $(grep 'test result' "$OUT/$t.log")" | tee -a "$S"
  grep -E "worst|FAILED|panicked|SKIPPED|bf16 state over" "$OUT/$t.log" | cut -c1-300 | sort | uniq | tee -a "$S"
done

stamp "compute-sanitizer on the varlen checks and the invariants (cuda)"
for tool in memcheck racecheck; do
  timeout 120 compute-sanitizer --tool $tool --error-exitcode 9 $B/cuda_conformance --test-threads 4 \
    varlen_sequence_bits every_dtype bf16_state_invariants bad_varlen commit_first_k untouched_slots \
    >"$OUT/san.log" 2>&1
  echo "sanitizer $tool rc $? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|test result' "$OUT/san.log" | sort | uniq -c | tr '\n' ' ')" | tee -a "$S"
  cat "$OUT/san.log" >>"$OUT/sanitizer.log"; rm "$OUT/san.log"
done
stamp "gdn bench wgpu: before and after, then a bf16 state"
bench "wgpu before" base_gdn --backend wgpu --batch 1,256 --tokens 1,8
bench "wgpu after" gdn --backend wgpu --batch 1,256 --tokens 1,8 --mixed 0:0
bench "wgpu bf16 state" gdn --backend wgpu --batch 1,256 --tokens 1,8 --state bf16
else
stamp "gdn bench cuda: before and after, alternating"
for round in 1 2; do
  bench "cuda before, round $round" base_gdn --backend cuda
  bench "cuda after, round $round" gdn --backend cuda --mixed 0:0
done
stamp "gdn bench cuda: bf16 state, bf16 activations, value-major, the mixed batch"
bench "cuda bf16 state" gdn --backend cuda --state bf16
bench "cuda bf16 state, bf16 activations, value-major" gdn --backend cuda --state bf16 --io bf16 --layout value-major --mixed 0:0
bench "cuda bf16 activations" gdn --backend cuda --io bf16 --batch 1,256 --tokens 1,8 --mixed 0:0
fi
stamp done
grep -vE "^(state GB/s|GFLOP/s counts)" "$OUT/bench.txt"
