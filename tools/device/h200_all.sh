#!/bin/bash
# One device run on the H200 for every GPU result of the project: the conformance suite (HF fixtures included)
# on the CUDA backend and on wgpu through NVIDIA's Vulkan driver, compute-sanitizer on the fixture replay,
# `gdn bench` for both backends side by side, FLA against the float64 spec (tools/conformance/fla_cases.py), and
# FLA's whole-step anchor. Prepared on a build machine (no CUDA there needed):
#   cargo build --release -p gdn-cli; cargo test --release --no-run -p gdn-cuda -p gdn-wgpu
#   copy target/release/gdn and the two `conformance-*` test binaries to .devbin/final/{gdn,cuda_conformance,
#   wgpu_conformance}, strip them, add ../shared/anchors/fla_*.py; FLA wheels in .whl, Vulkan loaders in .gl
#   device run from the repo root, carry [".devbin/final", ".whl", ".gl"]: bash tools/device/h200_all.sh
set -u
. tools/device/setup.sh
# the test binaries find the HF fixtures through the path they were built at
mkdir -p /work && ln -sfn "$PWD" /work/main
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee -a "$S"
git log -1 --format='commit %h %s' 2>/dev/null | tee -a "$S"

stamp "cuda conformance"
timeout 150 $B/cuda_conformance --nocapture --test-threads 8 >"$OUT/cuda_tests.log" 2>&1
echo "cuda tests rc $? $(grep 'test result' "$OUT/cuda_tests.log")" | tee -a "$S"
grep -E "worst|FAILED|panicked|SKIPPED" "$OUT/cuda_tests.log" | sort | uniq | tee -a "$S"
grep -E "^cuda.*: (win|fwd)_" "$OUT/cuda_tests.log" | tee -a "$S"

stamp "wgpu conformance (NVIDIA Vulkan)"
timeout 100 $B/wgpu_conformance --nocapture --test-threads 8 >"$OUT/wgpu_tests.log" 2>&1
echo "wgpu tests rc $? $(grep 'test result' "$OUT/wgpu_tests.log")" | tee -a "$S"
grep -E "worst|FAILED|panicked|SKIPPED" "$OUT/wgpu_tests.log" | sort | uniq | tee -a "$S"

stamp "gdn bench cuda, wgpu"
for be in cuda wgpu; do
  timeout 150 $B/gdn bench --backend $be >"$OUT/bench_$be.txt" 2>"$OUT/bench_$be.err"
  echo "bench $be rc $?" | tee -a "$S"
done
timeout 60 $B/gdn bench --backend cuda --gate silu --head-map grouped --batch 1,256 --tokens 1,8 >"$OUT/bench_cuda_silu.txt" 2>&1

stamp "compute-sanitizer on the HF fixture replay and the invariants (cuda)"
for tool in memcheck racecheck synccheck initcheck; do
  timeout 90 compute-sanitizer --tool $tool --error-exitcode 9 $B/cuda_conformance --test-threads 4 \
    hf_fixtures_replay commit_first_k verify_mutates untouched_slots >"$OUT/san_$tool.log" 2>&1
  echo "sanitizer $tool rc $? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|test result' "$OUT/san_$tool.log" | sort | uniq -c | tr '\n' ' ')" | tee -a "$S"
done

stamp "FLA against the spec (fla_cases.py)"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
PYTHONUNBUFFERED=1 timeout 150 python3 tools/conformance/fla_cases.py --out "$OUT/fla_cases" >"$OUT/fla_cases.log" 2>&1
echo "fla_cases rc $?" | tee -a "$S"
tail -25 "$OUT/fla_cases.log" | tee -a "$S"
rm -rf "$OUT/fla_cases"

stamp "FLA whole step anchor"
PYTHONUNBUFFERED=1 timeout 150 python3 $B/fla_full_step_bench.py >"$OUT/fla_full_step.log" 2>&1
echo "fla_full_step rc $?" | tee -a "$S"
stamp done
echo "===== bench cuda"; cat "$OUT/bench_cuda.txt"
echo "===== bench cuda silu grouped"; cat "$OUT/bench_cuda_silu.txt"
echo "===== bench wgpu"; cat "$OUT/bench_wgpu.txt"
echo "===== FLA whole step"; tail -16 "$OUT/fla_full_step.log"
