#!/bin/bash
# The CPU backend on the GPU machine's host CPU: a second x86 machine (more cores, and AVX-512 where it has it,
# which the development VM lacks, so the kernels' AVX-512 clones run nowhere else). Prepared on a build machine:
#   cargo build --release -p gdn-cli; cargo test --release --no-run -p gdn -p gdn-conformance -p gdn-cli;
#   strip and copy to .devbin/cpuhost/: target/release/gdn as gdn, and the test binaries under the names before
#   their hash: `cpu-*` (gdn-conformance) as cpu, `step_command-*` and `bench_command-*` (gdn-cli), and the
#   gdn library's unit tests (`gdn-*` of src/lib.rs) as gdn_lib.
#   device run from the repo root, carry [".devbin/cpuhost"]: bash tools/device/cpu_on_host.sh
set -u
B=.devbin/cpuhost
S=$OUT/summary.txt
t0=$(date +%s)
stamp() { echo "-- t=$(( $(date +%s) - t0 ))s $*" | tee -a "$S"; }
# the CLI tests name the gdn binary and the fixtures by the paths they had where they were built
mkdir -p /work && ln -sfn "$PWD" /work/main
mkdir -p target/release && cp "$B/gdn" target/release/gdn
{ grep -m1 "model name" /proc/cpuinfo; echo "cpus: $(nproc)"; grep -m1 -o "avx512f" /proc/cpuinfo; \
  grep -m1 "cache size" /proc/cpuinfo; } | tee -a "$S"
"$B/gdn" bench --batch 1 --tokens 1 --round-ms 5 2>/dev/null | head -1 | tee -a "$S"
for t in "$B"/cpu "$B"/step_command "$B"/bench_command "$B"/gdn_*; do
  [ -x "$t" ] || continue
  stamp "tests $(basename "$t")"
  timeout 300 "$t" --test-threads 8 >"$OUT/$(basename "$t").log" 2>&1
  echo "$(basename "$t") rc $? $(grep 'test result' "$OUT/$(basename "$t").log")" | tee -a "$S"
  grep -E "FAILED|panicked" "$OUT/$(basename "$t").log" | sort | uniq | head -20 | tee -a "$S"
done
# the benchmark at 2 threads (the bar's setting) and at all 16, in cache and rotated over 512 MiB; where a
# baseline binary $B/base_gdn is there too, the two alternate, two rounds each
bins="gdn"; [ -x "$B/base_gdn" ] && bins="base_gdn gdn"
for round in $(seq "${ROUNDS:-2}"); do
  for bin in $bins; do
    for threads in 2 16; do
      batches=1,8; [ "$threads" = 16 ] && batches=1,8,32
      for rot in 0 512; do
        f="$OUT/bench_${bin}_${threads}t_rot${rot}_r${round}.txt"
        stamp "$bin bench, $threads threads, rotate-mib $rot, round $round"
        RAYON_NUM_THREADS=$threads timeout 150 "$B/$bin" bench --batch $batches --rotate-mib "$rot" >"$f" 2>/dev/null
        grep -E "^ +[0-9]" "$f" | awk '{printf "%s/%s %s  ", $1, $2, $3} END {print ""}' | tee -a "$S"
      done
    done
  done
done
stamp done
