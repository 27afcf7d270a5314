#!/bin/bash
# The second H200 run of 2026-11-29: the one-pass kernels (CUDA v3, wgpu one-pass) beside the defaults. Both
# backends' suites (the CUDA binary runs the suite on v2b and on v3; the wgpu one on both kernels and both
# reduction paths), compute-sanitizer on v3, `gdn bench` for each kernel, and two more FLA cases. Prepared as
# tools/device/h200_all.sh says; run from the repo root, carry [".devbin/final", ".whl", ".gl"].
set -u
. tools/device/setup.sh
mkdir -p /work && ln -sfn "$PWD" /work/main
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$S"

stamp "cuda conformance (v2b and v3)"
timeout 150 $B/cuda_conformance --nocapture --test-threads 8 >"$OUT/cuda_tests.log" 2>&1
echo "cuda tests rc $? $(grep 'test result' "$OUT/cuda_tests.log")" | tee -a "$S"
grep -E "worst|FAILED|panicked|SKIPPED|errors out" "$OUT/cuda_tests.log" | sort | uniq | tee -a "$S"

stamp "wgpu conformance (both kernels, both paths)"
timeout 100 $B/wgpu_conformance --nocapture --test-threads 8 >"$OUT/wgpu_tests.log" 2>&1
echo "wgpu tests rc $? $(grep 'test result' "$OUT/wgpu_tests.log")" | tee -a "$S"
grep -E "worst|FAILED|panicked|SKIPPED|errors out" "$OUT/wgpu_tests.log" | sort | uniq | tee -a "$S"

stamp "compute-sanitizer on v3"
for tool in racecheck synccheck memcheck; do
  timeout 60 compute-sanitizer --tool $tool --error-exitcode 9 $B/cuda_conformance --test-threads 4 \
    v3::hf_fixtures_replay v3::commit_first_k v3::verify_mutates v3::planes_and_group v3::untouched >"$OUT/san_$tool.log" 2>&1
  echo "sanitizer $tool rc $? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|test result' "$OUT/san_$tool.log" | sort | uniq -c | tr '\n' ' ')" | tee -a "$S"
done

stamp "gdn bench: cuda v2b, cuda v3, wgpu, wgpu one-pass"
timeout 80 $B/gdn bench --backend cuda >"$OUT/bench_cuda.txt" 2>&1; echo "bench cuda rc $?" | tee -a "$S"
GDN_CUDA_KERNEL=v3 timeout 80 $B/gdn bench --backend cuda >"$OUT/bench_cuda_v3.txt" 2>&1; echo "bench cuda v3 rc $?" | tee -a "$S"
timeout 80 $B/gdn bench --backend wgpu >"$OUT/bench_wgpu.txt" 2>&1; echo "bench wgpu rc $?" | tee -a "$S"
GDN_WGPU_KERNEL=onepass timeout 80 $B/gdn bench --backend wgpu >"$OUT/bench_wgpu_onepass.txt" 2>&1; echo "bench wgpu onepass rc $?" | tee -a "$S"

stamp "FLA against the spec, two more cases"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
PYTHONUNBUFFERED=1 timeout 110 python3 tools/conformance/fla_cases.py --out /tmp/fla_cases --cases rec_d128_r3_t16,chunk_d64_r2_t256 >"$OUT/fla_cases.log" 2>&1
echo "fla_cases rc $?" | tee -a "$S"
grep -E "^\[fla\]" "$OUT/fla_cases.log" | tee -a "$S"
stamp done
for f in bench_cuda bench_cuda_v3 bench_wgpu bench_wgpu_onepass; do echo "===== $f"; cat "$OUT/$f.txt"; done
