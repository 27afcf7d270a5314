#!/bin/bash
# A short device call: every CUDA test binary named in CHECK_TESTS, compute-sanitizer memcheck on the window
# kernel's invariant test and the external speculative step (racecheck too with RACECHECK=1), then the window
# kernel's A/B: the binaries in
# CLOSE_BINS (gdn builds to compare, e.g. the last measured one and a candidate), each with the window kernel on,
# and the token-serial kernel (window off) once, on the same cases, in cache.
# Prepared on a build machine: test binaries (cargo test --release -p gdn-cuda --no-run) stripped and xz-compressed
# into $B/tests/, gdn builds into $B/; carry the folders named. Run: B=.devbin/x bash tools/device/h200_close.sh
set -u
BB=${B:?the binaries folder}
. tools/device/setup.sh
B=$BB
mkdir -p /work && ln -sfn "$PWD" /work/main
for f in $B/*.xz $B/tests/*.xz ${CLOSE_EXTRA_XZ:-}; do xz -dkf "$f"; chmod +x "${f%.xz}"; done
stamp "cuda tests"
for name in ${CHECK_TESTS:-conformance conformance_window gdn_cuda external external_spec}; do
  timeout ${TEST_TIMEOUT:-120} $B/tests/$name --test-threads 8 >"$OUT/test_$name.log" 2>&1
  echo "test $name rc $? $(grep 'test result' "$OUT/test_$name.log" | tail -1)" | tee -a "$S"
  grep -E "FAILED|panicked|errors out" "$OUT/test_$name.log" | head -6 | cut -c1-300 | tee -a "$S"
done
stamp "memcheck"
for args in "conformance_window window_kernel_invariants" "external_spec bad"; do
  set -- $args; bin=$B/tests/$1; shift
  timeout 90 compute-sanitizer --tool memcheck --error-exitcode 9 $bin "$@" >"$OUT/san.log" 2>&1
  echo "memcheck $args rc $? $(grep -E 'ERROR SUMMARY|test result' "$OUT/san.log" | tr '\n' ' ')" | tee -a "$S"
done
if [ "${RACECHECK:-0}" = 1 ]; then
  timeout 90 compute-sanitizer --tool racecheck --error-exitcode 9 $B/tests/conformance_window --test-threads 1 \
    window_kernel_invariants >"$OUT/san.log" 2>&1
  echo "racecheck rc $? $(grep -E 'RACECHECK SUMMARY|test result' "$OUT/san.log" | tr '\n' ' ')" | tee -a "$S"
fi
declare -A opt=([f32-km]="--state f32 --layout key-major" [bf16-vm]="--state bf16 --layout value-major")
first=1
for bin in ${CLOSE_BINS:-$B/gdn}; do
  for name in f32-km bf16-vm; do
    for win in 1 $([ $first = 1 ] && echo 0); do
      tag=$(basename $(dirname $bin))_$(basename $bin)_${name}_w$win
      stamp "bench $tag"
      GDN_CUDA_WINDOW=$win timeout 60 $bin bench --backend cuda --io bf16 --tokens ${AB_T:-4,6,8} --batch ${AB_B:-1,256} \
        ${opt[$name]} >"$OUT/ab_$tag.txt" 2>&1
      echo "rc $?" | tee -a "$S"
    done
  done
  first=0
done
for f in "$OUT"/ab_*.txt; do echo "===== $(basename $f)"; grep -E "^ +[0-9]+ +[0-9]+ " "$f" | cut -c1-28; done
echo "===== summary"; cat "$S"
