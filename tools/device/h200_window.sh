#!/bin/bash
# The window kernel on the H200 (issue 13 item 2): the CUDA test binaries (the conformance suite with the window
# kernel on and off, the crate's own tests), then `gdn bench` with the window kernel on and off (GDN_CUDA_WINDOW=0)
# for T 1, 2, 4, 8 (and 16, 64) at B 1..256, in cache and rotated, f32 key-major and bf16 value-major states.
# Prepared on a build machine: the test binaries of `cargo test --release -p gdn-cuda --no-run` and
# target/release/gdn, stripped and xz-compressed into .devbin/win/tests/ and .devbin/win/.
# device run from the repo root, carry [".devbin/win"]:  bash tools/device/h200_window.sh
set -u
. tools/device/setup.sh
B=.devbin/win
mkdir -p /work && ln -sfn "$PWD" /work/main
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader | tee -a "$S"
xz -dkf $B/gdn.xz; chmod +x $B/gdn
stamp "cuda tests"
for name in ${WIN_TESTS:-conformance conformance_serial gdn_cuda}; do
  t=$B/tests/$name; xz -dkf "$t.xz"; chmod +x "$t"
  timeout ${TEST_TIMEOUT:-150} "$t" --test-threads 8 >"$OUT/test_$name.log" 2>&1
  echo "test $name rc $? $(grep 'test result' "$OUT/test_$name.log" | tail -1)" | tee -a "$S"
  grep -E "FAILED|panicked" "$OUT/test_$name.log" | head -8 | tee -a "$S"
done
declare -A opt=([f32-km]="--state f32 --layout key-major" [bf16-vm]="--state bf16 --layout value-major")
for name in ${WIN_CONFIGS:-f32-km bf16-vm}; do
  for win in 1 0; do
    stamp "gdn bench $name window $win"
    GDN_CUDA_WINDOW=$win timeout 150 $B/gdn bench --backend cuda --io bf16 --tokens ${WIN_T:-1,2,4,8,16} \
      --batch ${WIN_B:-1,8,32,128,256} --rotate-mib 256 ${opt[$name]} >"$OUT/bench_${name}_w$win.txt" 2>&1
    echo "bench $name window $win rc $?" | tee -a "$S"
  done
done
stamp done
for f in "$OUT"/bench_*.txt; do echo "===== $(basename $f)"; tail -30 "$f"; done
echo "===== summary"; cat "$S"
