#!/bin/bash
# H200: the chunked path on engine memory (CudaLayer::step_raw, the Python package): the external tests, the
# pool's chunk tests, pytest, memcheck on the external tests, then alone on the GPU external_bench (pool against
# engine memory, decode to prefill) and tools/device/h200_prefill_py.py (gdn.vllm against FLA's prefill).
# Build here: cargo test --release -p gdn-cuda --no-run and cargo build --release -p gdn-cuda --example
# external_bench; copy the external-* and chunk-* test binaries and external_bench, stripped and xz-compressed,
# with this script into one ignored folder, the abi3 wheel (maturin build --release -m python/Cargo.toml) into
# its py/, and carry that folder and .whl (FLA wheels). `h200_engine_prefill.sh [all|tests|bench|hints|python]`
# (all: tests, bench, python; python's f32 half needs PY_TIMEOUT=400 or so, a call of its own).
set -u
B=$(dirname "$0")
S=$OUT/summary.txt
t0=$(date +%s)
stamp() { echo "-- t=$(( $(date +%s) - t0 ))s $*" | tee -a "$S"; }
L=$(dirname "$(find / -name 'libnvrtc.so.13*' -not -path '/proc/*' 2>/dev/null | grep -v builtins | head -1)")
export LD_LIBRARY_PATH="$L:${LD_LIBRARY_PATH:-}"
mkdir -p /work && [ -e /work/main ] || ln -sfn "$PWD" /work/main
for f in $B/*.xz; do xz -d -k -f "$f"; chmod +x "${f%.xz}"; done
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$S"
stamp start
MODE=${1:-all}
if [ "$MODE" = all ] || [ "$MODE" = tests ]; then
rm -rf /tmp/gdnpy /tmp/site && mkdir -p /tmp/gdnpy /tmp/site
python3 -m zipfile -e $B/py/*.whl /tmp/gdnpy
for w in .whl/*.whl; do python3 -m zipfile -e "$w" /tmp/site; done
timeout 300 $B/external --test-threads 2 --nocapture >"$OUT/external.log" 2>&1 &
p1=$!
timeout 300 $B/chunk --test-threads 2 --nocapture >"$OUT/chunk.log" 2>&1 &
p2=$!
PYTHONPATH=/tmp/gdnpy timeout 300 python3 -m pytest -q python/tests >"$OUT/pytest.log" 2>&1 &
p3=$!
timeout 330 compute-sanitizer --tool memcheck --error-exitcode 9 $B/external --test-threads 1 external_step_matches >"$OUT/memcheck.log" 2>&1 &
p4=$!
wait $p1; echo "external rc $? $(grep 'test result' "$OUT/external.log")" | tee -a "$S"
grep -E "^ok:|FAILED|panicked|SKIPPED" "$OUT/external.log" | cut -c1-300 | tee -a "$S"
wait $p2; echo "chunk rc $? $(grep 'test result' "$OUT/chunk.log")" | tee -a "$S"
grep -E "FAILED|panicked|SKIPPED|worst" "$OUT/chunk.log" | cut -c1-300 | head -20 | tee -a "$S"
wait $p3; echo "pytest rc $?" | tee -a "$S"; tail -5 "$OUT/pytest.log" | tee -a "$S"
stamp "tests done"
wait $p4; echo "memcheck rc $? $(grep -E 'ERROR SUMMARY|test result' "$OUT/memcheck.log" | sort | uniq -c | tr '\n' ' ')" | tee -a "$S"
grep -E "^=========" "$OUT/memcheck.log" | grep -vE "SUMMARY|COMPUTE-SANITIZER" | head -10 | tee -a "$S"
stamp "memcheck done"
fi
if [ "$MODE" = all ] || [ "$MODE" = bench ]; then
stamp "external_bench alone"
timeout 200 $B/external_bench 2>&1 | tee "$OUT/external_bench.md" | tee -a "$S"
fi
if [ "$MODE" = hints ]; then
stamp "external_bench hints"
timeout 100 $B/external_bench hints 2>&1 | tee "$OUT/external_bench_hints.md" | tee -a "$S"
fi
if [ "$MODE" = all ] || [ "$MODE" = python ]; then
[ -d /tmp/site/fla ] || { mkdir -p /tmp/gdnpy /tmp/site; python3 -m zipfile -e $B/py/*.whl /tmp/gdnpy
  for w in .whl/*.whl; do python3 -m zipfile -e "$w" /tmp/site; done; }
stamp "prefill through python vs FLA"
PYTHONPATH=/tmp/gdnpy:/tmp/site timeout ${PY_TIMEOUT:-200} python3 tools/device/h200_prefill_py.py 2>&1 | grep -v Warn | tail -16 | tee -a "$S"
fi
stamp done
