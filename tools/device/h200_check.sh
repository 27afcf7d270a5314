#!/bin/bash
# A session's closing device call without the peers: every CUDA test binary (the conformance suite with the window
# kernel off and on, the chunked path, the external step, the crate's own tests), compute-sanitizer memcheck on
# the speculative kernel, the quantized product and the window kernel, then device-time benchmarks: the
# speculative step against the two-pass flow (spec_bench, gdn bench --spec), the quantized product's launch
# shapes (the crate's ignored quant_tune_sweep test) and out_proj bench, the window kernel against the token-serial
# kernel. Prepared on a build machine: the test binaries of `cargo test --release -p gdn-cuda --no-run`,
# target/release/gdn and target/release/examples/spec_bench, stripped and xz-compressed into .devbin/final/tests/
# and .devbin/final/. device run from the repo root, carry [".devbin/final"]:  bash tools/device/h200_check.sh
set -u
. tools/device/setup.sh
mkdir -p /work && ln -sfn "$PWD" /work/main
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$S"
for f in $B/*.xz $B/tests/*.xz; do xz -dkf "$f"; chmod +x "${f%.xz}"; done
T=$B/tests
stamp "cuda tests"
for name in ${CHECK_TESTS:-conformance conformance_window gdn_cuda external chunk}; do
  timeout ${TEST_TIMEOUT:-120} $T/$name --test-threads 8 >"$OUT/test_$name.log" 2>&1
  echo "test $name rc $? $(grep 'test result' "$OUT/test_$name.log" | tail -1)" | tee -a "$S"
  grep -E "FAILED|panicked|errors out" "$OUT/test_$name.log" | head -6 | cut -c1-300 | tee -a "$S"
done
stamp "memcheck"
for args in "spec_bench 8 4 profile" "tests/gdn_cuda odd_widths" "tests/conformance_window window_kernel_invariants"; do
  set -- $args; bin=$B/$1; shift
  timeout 90 compute-sanitizer --tool memcheck --error-exitcode 9 $bin "$@" >"$OUT/san.log" 2>&1
  echo "memcheck $args rc $? $(grep -E 'ERROR SUMMARY' "$OUT/san.log" | tr '\n' ' ')" | tee -a "$S"
done
stamp "speculative steps"
timeout 60 $B/spec_bench 64,256 4,8 >"$OUT/spec_bench.txt" 2>&1; echo "spec_bench rc $?" | tee -a "$S"
timeout 40 $B/gdn bench --backend cuda --spec 4,8 --batch 64,256 >"$OUT/cli_spec.txt" 2>&1; echo "cli spec rc $?" | tee -a "$S"
stamp "quantized product"
timeout 90 $T/gdn_cuda quant_tune_sweep --ignored --nocapture >"$OUT/quant_sweep.txt" 2>&1
echo "quant sweep rc $? $(grep 'test result' "$OUT/quant_sweep.txt")" | tee -a "$S"
grep -E "panicked|changes bits" "$OUT/quant_sweep.txt" | head -5 | tee -a "$S"
timeout 90 $B/gdn bench --backend cuda --out-proj 5120 --batch 1,64 --tokens 1 >"$OUT/quant_bench.txt" 2>&1
echo "quant bench rc $?" | tee -a "$S"
stamp "window kernel"
for win in 1 0; do
  GDN_CUDA_WINDOW=$win timeout 60 $B/gdn bench --backend cuda --io bf16 --tokens 2,4,8 --batch 1,256 >"$OUT/window_w$win.txt" 2>&1
  echo "window $win rc $?" | tee -a "$S"
done
stamp done
echo "===== spec_bench"; tail -12 "$OUT/spec_bench.txt"
echo "===== gdn bench --spec"; tail -8 "$OUT/cli_spec.txt"
echo "===== quant sweep"; grep -E "^\|" "$OUT/quant_sweep.txt" | tail -30
echo "===== quant bench"; grep -E "^\| (2-bit|8-bit)|^ *(2-bit|8-bit)" "$OUT/quant_bench.txt" | head -12 | cut -c1-170
for win in 1 0; do echo "===== window $win"; sed -n 2,9p "$OUT/window_w$win.txt" | cut -c1-40; done
echo "===== summary"; cat "$S"
(cd "$OUT" && tar czf /tmp/all_logs.tgz --exclude summary.txt . && find . -mindepth 1 ! -name summary.txt -delete && mv /tmp/all_logs.tgz .)
