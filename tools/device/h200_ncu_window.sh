#!/bin/bash
# Profiles the window kernel on the H200 with ncu: B 1 T 8 and B 256 T 8 (f32 key-major state, bf16 io), full
# set with per-instruction stall samples (the source page, SASS, as CSV) for B 1, the summary sections for both.
# Carry the directory holding gdn.xz (NCU_DIR, default .devbin/win3); NCU_T the window length, NCU_B the batches.
# Read the CSVs with tools/ncu_segments.py (stall samples and instructions between block barriers).
set -u
. tools/device/setup.sh
B=${NCU_DIR:-.devbin/win3}
xz -dkf $B/gdn.xz; chmod +x $B/gdn
for b in ${NCU_B:-1 256}; do
  stamp "ncu B $b"
  GDN_CUDA_WINDOW=1 timeout 200 ncu --set full --import-source no -k regex:gdn_step --launch-skip 3 --launch-count 1 \
    -o "$OUT/win_b$b" $B/gdn bench --backend cuda --io bf16 --tokens ${NCU_T:-8} --batch $b --state f32 --layout key-major \
    >"$OUT/ncu_run_b$b.log" 2>&1
  echo "ncu B $b rc $?" | tee -a "$S"
  ncu --import "$OUT/win_b$b.ncu-rep" --page details >"$OUT/ncu_b$b.txt" 2>&1
  ncu --import "$OUT/win_b$b.ncu-rep" --page source --csv --print-source sass >"$OUT/ncu_src_b$b.csv" 2>"$OUT/ncu_src_b$b.err"
  echo "source page rc $? $(wc -l <"$OUT/ncu_src_b$b.csv") lines" | tee -a "$S"
  rm -f "$OUT/win_b$b.ncu-rep"
  grep -E "Duration|Warp Cycles Per Issued|Issued Warp Per|Achieved Occupancy|Registers Per|DRAM Throughput|Stall" "$OUT/ncu_b$b.txt" | head -20
done
echo "===== summary"; cat "$S"
