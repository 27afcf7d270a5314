#!/bin/bash
# The window kernel against the token-serial kernel (GDN_CUDA_WINDOW=1 / 0) on a few cases, in cache, then an
# ncu profile of each at B 256 T 8 and B 1 T 8 (warp stall reasons, issue, occupancy, memory throughput).
# carry [".devbin/win"] (target/release/gdn, stripped, xz'd into .devbin/win/gdn.xz)
set -u
. tools/device/setup.sh
B=.devbin/win
xz -dkf $B/gdn.xz; chmod +x $B/gdn
for win in 1 0; do
  stamp "bench window $win"
  GDN_CUDA_WINDOW=$win timeout 100 $B/gdn bench --backend cuda --io bf16 --tokens ${AB_T:-2,4,8} --batch ${AB_B:-1,256} \
    --state f32 --layout key-major >"$OUT/ab_w$win.txt" 2>&1
  echo "rc $?" | tee -a "$S"
done
for win in 1 0; do
  for b in 256 1; do
    stamp "ncu window $win B $b T 8"
    GDN_CUDA_WINDOW=$win timeout 120 ncu --kernel-name gdn_step --launch-skip 3 --launch-count 1 \
      --section SpeedOfLight --section WarpStateStats --section Occupancy --section SchedulerStats --section LaunchStats \
      $B/gdn bench --backend cuda --io bf16 --tokens 8 --batch $b --state f32 --layout key-major --round-ms 1 \
      >"$OUT/ncu_w${win}_b$b.txt" 2>&1
    echo "rc $?" | tee -a "$S"
  done
done
for win in 1 0; do echo "===== window $win"; head -12 "$OUT/ab_w$win.txt"; done
for f in "$OUT"/ncu_*.txt; do echo "===== $(basename $f)"; grep -E "Duration|Throughput|Issued Ipc|No Eligible|Active Warps|Eligible Warps|Registers|Theoretical Occ|Achieved Occ|Stall|Warp Cycles" "$f" | head -30; done
