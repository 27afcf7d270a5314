#!/bin/bash
# The chunked (prefill) path on the H200: prefill_bench over its cases (PF_ARGS, e.g. quick) for each binary in
# PF_BINS, then ncu (launch stats, occupancy, speed of light, warp states) of each chunked kernel of one case
# (PF_NCU "B T", empty: none) of the first binary, a summary line a kernel printed last.
# Carry the binaries (prefill_bench builds, xz-compressed or not). Run: PF_BINS="a/prefill_bench b/prefill_bench"
# bash tools/device/h200_prefill.sh
set -u
. tools/device/setup.sh
bins=()
for bin in ${PF_BINS:?prefill_bench builds}; do
  [ -f "$bin.xz" ] && xz -dkf "$bin.xz"
  chmod +x "$bin"; bins+=("$bin")
done
i=0
for bin in "${bins[@]}"; do
  i=$((i + 1)); tag=$i-$(basename "$(dirname "$bin")")
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
for bin in "${bins[@]}"; do i=$((i + 1)); tag=$i-$(basename "$(dirname "$bin")"); echo "===== $tag"; grep "^|" "$OUT/prefill_$tag.txt"; done
