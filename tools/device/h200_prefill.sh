#!/bin/bash
# The chunked (prefill) path on the H200: prefill_bench over its cases (PF_ARGS, e.g. quick) for each binary in
# PF_BINS, then ncu (launch stats, occupancy, speed of light, warp states) of each chunked kernel of one case
# (PF_NCU "B T", empty: none) of the first binary, a summary line a kernel printed last.
# PF_DUMP "B T" (empty: none) first checks that every build gives the first one's bits on that case (`prefill_bench
# dump`, cmp of y, committed states and histories); PF_CASES ("B T;B T;..", empty: none) times those cases alone
# (`prefill_bench case`, 3xTF32 and one-TF32) for each build, one line each, instead of needing PF_ARGS's table.
# Carry the binaries (prefill_bench builds, xz-compressed or not). Run: PF_BINS="a/prefill_bench b/prefill_bench"
# bash tools/device/h200_prefill.sh (session 9's A/B: PF_DUMP="3 1000" PF_CASES="1 512;1 8192;1 32768;2 8192;4 8192")
set -u
. tools/device/setup.sh
bins=()
for bin in ${PF_BINS:?prefill_bench builds}; do
  [ -f "$bin.xz" ] && xz -dkf "$bin.xz"
  chmod +x "$bin"; bins+=("$bin")
done
if [ -n "${PF_DUMP:-}" ]; then
  stamp "bits, case ${PF_DUMP}"
  i=0
  for bin in "${bins[@]}"; do
    i=$((i + 1))
    timeout 60 "$bin" dump /tmp/pf_dump_$i.bin ${PF_DUMP} >/dev/null 2>&1 || echo "dump $bin failed" | tee -a "$S"
    [ $i -gt 1 ] && { cmp -s /tmp/pf_dump_1.bin /tmp/pf_dump_$i.bin && r="same bits" || r="BITS DIFFER"; echo "$bin: $r as ${bins[0]}" | tee -a "$S"; }
  done
fi
if [ -n "${PF_CASES:-}" ]; then
  stamp "cases ${PF_CASES}"
  IFS=';' read -ra cs <<<"$PF_CASES"
  for c in "${cs[@]}"; do
    for bin in "${bins[@]}"; do
      three=$(timeout 60 "$bin" case $c | grep '^| B' | awk -F'|' '{print $4}')
      one=$(timeout 60 "$bin" case $c fast | grep '^| B' | awk -F'|' '{print $7}')
      echo "case $c $bin: 3xTF32 $three us, one-TF32 $one us" | tee -a "$S"
    done
  done
fi
i=0
for bin in "${bins[@]}"; do
  i=$((i + 1)); tag=$i-$(basename "$(dirname "$bin")")
  [ -z "${PF_ARGS:-}" ] && [ -n "${PF_CASES:-}" ] && continue
  stamp "prefill_bench $tag ${PF_ARGS:-}"
  timeout ${PF_TIMEOUT:-120} "$bin" ${PF_ARGS:-} >"$OUT/prefill_$tag.txt" 2>&1
  echo "rc $?" | tee -a "$S"
done
if [ -n "${PF_NCU:-}" ]; then
  stamp "ncu case ${PF_NCU}"
  timeout 240 ncu -k regex:gdn_chunk_ --launch-count 4 --section LaunchStats --section Occupancy \
    --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis --csv --page details \
    "${bins[0]}" case ${PF_NCU} >"$OUT/ncu_prefill.csv" 2>"$OUT/ncu_prefill.err"
  echo "ncu rc $?" | tee -a "$S"
  python3 - "$OUT/ncu_prefill.csv" <<'PY' | tee -a "$S"
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 14]
if not rows:
    sys.exit("ncu wrote no table")
head, rows = rows[0], rows[1:]
ki, mi, vi, ui = head.index("Kernel Name"), head.index("Metric Name"), head.index("Metric Value"), head.index("Metric Unit")
want = ["Duration", "Registers Per Thread", "Achieved Occupancy", "Compute (SM) Throughput", "Memory Throughput",
        "DRAM Throughput", "Warp Cycles Per Issued Instruction", "Block Limit Shared Mem", "Grid Size"]
seen = {}
for r in rows:
    k = r[ki].split("(")[0]
    if r[mi] in want:
        seen.setdefault(k, {})[r[mi]] = r[vi] + " " + r[ui]
for k, m in seen.items():
    print(k, "; ".join(f"{w}: {m[w]}" for w in want if w in m))
PY
fi
i=0
for bin in "${bins[@]}"; do
  i=$((i + 1)); tag=$i-$(basename "$(dirname "$bin")")
  [ -f "$OUT/prefill_$tag.txt" ] && { echo "===== $tag"; grep "^|" "$OUT/prefill_$tag.txt"; }
done
