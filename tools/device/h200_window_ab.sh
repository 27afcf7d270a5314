#!/bin/bash
# The window kernel on the H200: the conformance suite with it on (tests/conformance_window.rs), compute-sanitizer
# memcheck and racecheck on a small window case, then `gdn bench` with the window kernel on and off
# (GDN_CUDA_WINDOW=1 / 0) on the same cases, in cache.
# Prepared on a build machine: target/release/gdn and the test binaries of `cargo test --release -p gdn-cuda
# --no-run`, stripped and xz-compressed into .devbin/win/ and .devbin/win/tests/; carry [".devbin/win"].
set -u
. tools/device/setup.sh
B=${AB_DIR:-.devbin/win}
mkdir -p /work && ln -sfn "$PWD" /work/main
xz -dkf $B/gdn.xz; chmod +x $B/gdn
for name in ${AB_TESTS:-conformance_window}; do
  t=$B/tests/$name; xz -dkf "$t.xz"; chmod +x "$t"
  stamp "test $name"
  timeout ${TEST_TIMEOUT:-150} "$t" --test-threads 8 >"$OUT/test_$name.log" 2>&1
  echo "test $name rc $? $(grep 'test result' "$OUT/test_$name.log" | tail -1)" | tee -a "$S"
  grep -E "FAILED|panicked|errors out" "$OUT/test_$name.log" | head -8 | cut -c1-400 | tee -a "$S"
done
t=$B/tests/conformance_window
for tool in memcheck racecheck; do
  stamp "$tool"
  timeout 90 compute-sanitizer --tool $tool --error-exitcode 9 "$t" --test-threads 1 commit_first_k >"$OUT/san_$tool.log" 2>&1
  echo "$tool rc $? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|test result' "$OUT/san_$tool.log" | tr '\n' ' ')" | tee -a "$S"
done
declare -A opt=([f32-km]="--state f32 --layout key-major" [bf16-vm]="--state bf16 --layout value-major")
for name in ${AB_CONFIGS:-f32-km bf16-vm}; do
  for win in 1 0; do
    stamp "bench $name window $win"
    GDN_CUDA_WINDOW=$win timeout 100 $B/gdn bench --backend cuda --io bf16 --tokens ${AB_T:-2,4,8,16} --batch ${AB_B:-1,256} \
      ${opt[$name]} >"$OUT/ab_${name}_w$win.txt" 2>&1
    echo "rc $?" | tee -a "$S"
  done
done
for f in "$OUT"/ab_*.txt; do echo "===== $(basename $f)"; sed -n 2,12p "$f" | cut -c1-60; done
echo "===== summary"; cat "$S"
