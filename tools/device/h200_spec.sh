#!/bin/bash
# Issue 15's closing run in one device call: the CUDA conformance suite (with the pool's bitwise speculative test)
# and the engine-memory speculative tests, then the speculative step against the two-pass flow REPS times on a pool
# (`spec_bench`), on engine memory (`external_bench spec`) and through the CLI (f32 and bf16 state).
# Prepared on a build machine (`cargo build --release -p gdn-cuda --examples -p gdn-cli`, `cargo test --release
# -p gdn-cuda --no-run`): spec_bench, external_bench, gdn and the conformance / external_spec test binaries,
# stripped and xz-compressed into .devbin/spec. device run from the repo root, carry [".devbin/spec"]:
#   bash tools/device/h200_spec.sh   (TEST_FILTER="a b" passes test-name filters; TESTS=0 skips the tests)
set -u
. tools/device/setup.sh
B=.devbin/spec
mkdir -p /work && ln -sfn "$PWD" /work/main
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee -a "$S"
for f in $B/*.xz; do xz -dkf "$f"; chmod +x "${f%.xz}"; done
if [ "${TESTS:-1}" != 0 ]; then
  for name in ${TEST_BINS:-conformance external_spec}; do
    stamp "test $name"
    timeout ${TEST_TIMEOUT:-300} $B/$name --test-threads 8 ${TEST_FILTER:-} >"$OUT/test_$name.log" 2>&1
    echo "test $name rc $? $(grep 'test result' "$OUT/test_$name.log" | tail -1)" | tee -a "$S"
    grep -E "FAILED|panicked" "$OUT/test_$name.log" | head -6 | cut -c1-300 | tee -a "$S"
  done
fi
for r in $(seq 1 ${REPS:-3}); do  # REPS=0: none
  stamp "spec_bench rep $r"
  timeout 100 $B/spec_bench 64,256 4,8 >"$OUT/spec_bench_$r.txt" 2>&1; echo "spec_bench rc $?" | tee -a "$S"
done
[ "${BENCH:-1}" = 0 ] && exit 0  # BENCH=0: the tests alone
stamp "external_bench spec"
timeout 150 $B/external_bench spec >"$OUT/external_spec.txt" 2>&1; echo "external spec rc $?" | tee -a "$S"
for st in f32 bf16; do
  stamp "gdn bench --spec $st"
  timeout 100 $B/gdn bench --backend cuda --spec 4,8 --batch 64,256 --state $st --io $st >"$OUT/cli_spec_$st.txt" 2>&1
  echo "cli spec $st rc $?" | tee -a "$S"
done
stamp done
for f in "$OUT"/spec_bench_*.txt "$OUT"/external_spec.txt "$OUT"/cli_spec_*.txt; do
  echo "===== $(basename $f)"; grep -E '^\| (f32|bf16|[0-9])' "$f" | cut -c1-160
done
echo "===== summary"; cat "$S"
