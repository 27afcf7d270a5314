#!/bin/bash
# One device call for a session's end: every CUDA test binary of the crate (the conformance suite, the chunked
# path, the quantized out_proj, ...), then the side by side with FlashInfer (h200_side_by_side.sh).
# Prepared on a build machine: `cargo test --release -p gdn-cuda --no-run`, the test binaries stripped and
# xz-compressed into .devbin/side/tests/ (named by their test target), plus what h200_side_by_side.sh needs.
# device run from the repo root, carry [".devbin/side", ".fi"]:
#   SBS_CONFIGS="f32-km bf16-vm" SBS_FLA=0 SBS_FI_BUDGET=230 bash tools/device/h200_check_and_compare.sh
set -u
. tools/device/setup.sh
mkdir -p /work && ln -sfn "$PWD" /work/main
stamp "cuda tests"
for x in .devbin/side/tests/*.xz; do
  t=${x%.xz}; xz -dkf "$x"; chmod +x "$t"; name=$(basename "$t")
  timeout ${TEST_TIMEOUT:-150} "$t" --test-threads 8 >"$OUT/test_$name.log" 2>&1
  echo "test $name rc $? $(grep 'test result' "$OUT/test_$name.log" | tail -1)" | tee -a "$S"
  grep -E "FAILED|panicked" "$OUT/test_$name.log" | head -5 | tee -a "$S"
done
stamp "compute-sanitizer memcheck on the chunked path's tests"
[ -f .devbin/side/tests/chunk ] && timeout 90 compute-sanitizer --tool memcheck --error-exitcode 9 \
  .devbin/side/tests/chunk --test-threads 1 small_mixed_call_for_the_sanitizer >"$OUT/san_chunk.log" 2>&1
echo "memcheck chunk rc $? $(grep -E 'ERROR SUMMARY|test result' "$OUT/san_chunk.log" | tr '\n' ' ')" | tee -a "$S"
bash tools/device/h200_side_by_side.sh "$@"
echo "===== summary"; cat "$S"
# at most 8 files come back: everything in one archive beside the summary
(cd "$OUT" && tar czf /tmp/all_logs.tgz --exclude summary.txt . && find . -mindepth 1 ! -name summary.txt -delete \
  && mv /tmp/all_logs.tgz .)
