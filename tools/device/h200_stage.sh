#!/bin/bash
# An f32 state staged through shared memory at T 1 (`Cuda::set_stage_f32`) in one call: the staged path against
# the register path bitwise (`device_step_matches_host_step_bitwise`, f32 and bf16, both layouts), memcheck and
# racecheck on it, then `bench decode` (examples/bench.rs: the variants old / default / staged / staged-noahead,
# in cache and rotated) of this build and of a baseline build (bench_base, optional), and the out_proj read
# probe (tools/device/quant_read_probe.cu, built here by nvcc).
# Prepared on a build machine: `cargo test --release -p gdn-cuda --no-run` (tests/conformance.rs's binary as
# conformance, tests/external.rs's as external) and `cargo build --release -p gdn-cuda --example bench` (as bench; a baseline's as bench_base),
# stripped and xz-compressed into .devbin/stage. device run from the repo root, carry [".devbin/stage"]:
#   bash tools/device/h200_stage.sh   (PROBE=0 skips the probe, SAN=0 the sanitizers)
set -u
. tools/device/setup.sh
B=.devbin/stage
for f in $B/*.xz; do xz -dkf "$f"; chmod +x "${f%.xz}"; done
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee -a "$S"
stamp "staged against registers, bitwise"
timeout 300 $B/conformance device_step_matches_host_step_bitwise memory_hints 2>&1 | grep -E "test |result|panicked" | tee -a "$S"
timeout 200 $B/external staged_f32 2>&1 | grep -E "test |result|panicked" | tee -a "$S"
stamp "bench decode (this build)"
GDN_CUDA_VARIANTS=${VARIANTS:-default,staged,staged-noahead} timeout 300 $B/bench decode >"$OUT/decode_new.txt" 2>&1; echo "rc $?" | tee -a "$S"
if [ -x $B/bench_base ]; then
  stamp "bench decode (baseline)"
  GDN_CUDA_VARIANTS=default timeout 200 $B/bench_base decode >"$OUT/decode_base.txt" 2>&1; echo "rc $?" | tee -a "$S"
fi
if [ "${PROBE:-1}" = 1 ]; then
  stamp "out_proj read probe"
  nvcc -O3 -arch=sm_90 -o /tmp/probe tools/device/quant_read_probe.cu 2>&1 | grep -iE "error" | tee -a "$S"
  timeout 120 /tmp/probe >"$OUT/probe.txt" 2>&1; echo "rc $?" | tee -a "$S"
fi
if [ "${SAN:-1}" = 1 ]; then
  stamp "memcheck"
  timeout 200 compute-sanitizer --tool memcheck $B/conformance device_step_matches_host_step_bitwise 2>&1 | grep -E "SUMMARY|test result" | tee -a "$S"
  for tool in memcheck racecheck; do
    stamp "$tool (engine memory)"
    timeout 150 compute-sanitizer --tool $tool $B/external staged_f32 2>&1 | grep -E "SUMMARY|test result" | tee -a "$S"
  done
fi
stamp done
cat "$S"
grep -E "^\| state|^copy|^empty" "$OUT/decode_new.txt" | cut -c1-150
[ -f "$OUT/decode_base.txt" ] && grep -E "^\| state" "$OUT/decode_base.txt" | cut -c1-150
[ -f "$OUT/probe.txt" ] && cat "$OUT/probe.txt"
