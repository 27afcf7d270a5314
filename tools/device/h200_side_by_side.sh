#!/bin/bash
# gdn beside FlashInfer 0.7.2 and FLA 0.6 on the H200 in one device run (issue 13 item 5): the same cases
# (B 1, 8, 32, 128, 256; T 1, 4, 8; f32 and bf16 state; in cache and with states rotated from DRAM), then one
# table (tools/side_by_side.py). gdn times its whole fused step, the peers their recurrence alone.
# Prepared on a build machine:
#   cargo build --release -p gdn-cli; strip a copy of target/release/gdn; xz it to .devbin/side/gdn.xz;
#   likewise target/release/examples/spec_bench (cargo build --release -p gdn-cuda --example spec_bench);
#   cp ../shared/anchors/fla_bench.py .devbin/side/;  FLA wheels in .whl (shared/anchors/README.md);
#   FlashInfer's bundle + fi_run.sh + fi_bench.py in .fi (shared/anchors/flashinfer/README.md)
# device run from the repo root, carry [".devbin/side", ".whl", ".fi"] (about 61 MiB with the bundle):
#   bash tools/device/h200_side_by_side.sh [fi_bench.py options, e.g. --sections copy,a,b,c]
# Environment: SBS_CONFIGS (the gdn pool options to run, default all three below), SBS_WINDOW=1 also runs each
# with the window kernel on (GDN_CUDA_WINDOW=1: columns `<config>-win`, the table's ratio takes gdn's best),
# SBS_FLA=0 skips FLA (its
# numbers from an earlier run are in ../shared/anchors/README.md), SBS_FI_BUDGET (seconds, default 330).
set -u
. tools/device/setup.sh
B=.devbin/side
[ -f $B/gdn ] || xz -dk $B/gdn.xz
chmod +x $B/gdn
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee -a "$S"
git log -1 --format='commit %h %s' 2>/dev/null | tee -a "$S"

# gdn: the peers' activations are bf16; FlashInfer's pool is value-major (keys contiguous)
runs=()
declare -A opt=([f32-km]="--state f32 --layout key-major" [f32-vm]="--state f32 --layout value-major"
                [bf16-vm]="--state bf16 --layout value-major" [bf16-km]="--state bf16 --layout key-major")
for name in ${SBS_CONFIGS:-f32-km f32-vm bf16-vm}; do
  opts=${opt[$name]}
  for win in 0 $([ "${SBS_WINDOW:-0}" = 1 ] && echo 1); do
  for rot in 0 256; do
    tag=$name; [ $win = 1 ] && tag=$tag-win; [ $rot -gt 0 ] && tag=$tag-rot
    stamp "gdn bench $tag"
    GDN_CUDA_WINDOW=$win timeout 120 $B/gdn bench --backend cuda --io bf16 --mixed 0:0 --rotate-mib $rot $opts \
      >"$OUT/gdn_$tag.txt" 2>&1
    echo "gdn $tag rc $?" | tee -a "$S"
    runs+=(--gdn "$tag=$OUT/gdn_$tag.txt")
  done
  done
done

stamp "gdn speculative steps, device time (issue 15)"
# `gdn bench --spec` times host-slice calls (uploads, downloads, the host's bookkeeping) on a GPU backend; the
# crate's spec_bench example times the one-pass kernel and the two-pass flow's kernels in CUDA graphs
if [ -f $B/spec_bench.xz ]; then
  xz -dkf $B/spec_bench.xz; chmod +x $B/spec_bench
  timeout 120 $B/spec_bench 64,256 4,8 >"$OUT/gdn_spec.txt" 2>&1
else
  echo "no .devbin/side/spec_bench.xz: build it with cargo build --release -p gdn-cuda --example spec_bench" >"$OUT/gdn_spec.txt"
fi
echo "gdn spec rc $?" | tee -a "$S"

stamp "FLA fused recurrence + chunk prefill"
[ "${SBS_FLA:-1}" = 1 ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 timeout 150 python3 $B/fla_bench.py >"$OUT/fla.log" 2>&1
echo "fla rc $?" | tee -a "$S"

stamp "FlashInfer"
# the anchor's rotated timing takes each call's slot indices as a slice of one tensor, 4 bytes apart at B 1,
# which FlashInfer refuses (16-byte alignment): give each call its own tensor
sed -i 's/perm\[i \* B:(i + 1) \* B\]\.contiguous()/perm[i * B:(i + 1) * B].clone()/' .fi/fi_bench.py
timeout 400 bash .fi/fi_run.sh all --budget ${SBS_FI_BUDGET:-330} "$@" >"$OUT/fi_run.log" 2>&1
echo "flashinfer rc $?" | tee -a "$S"

stamp "FlashInfer speculative flows (issue 15)"
SITE=${FI_SITE:-/tmp/fi_site}
PYTHONPATH="$SITE/nvidia_cutlass_dsl/dsl_packages:$SITE" FLASHINFER_WORKSPACE_BASE=/tmp/fi_ws CUTE_DSL_CACHE_DIR=/tmp/fi_cute_cache \
  PYTHONUNBUFFERED=1 timeout 150 python3 tools/device/fi_spec_flow.py --out "$OUT" >"$OUT/fi_spec.log" 2>&1
echo "fi spec rc $?" | tee -a "$S"
stamp done

echo "===== speculative steps: gdn (one pass vs two pass) and FlashInfer's flows" | tee -a "$S"
tail -8 "$OUT/gdn_spec.txt" | tee -a "$S"
tail -6 "$OUT/fi_spec.log" | tee -a "$S"

echo "===== FLA"; grep -A20 "fused_recurrent" "$OUT/fla.log" | head -40
echo "===== side by side" | tee -a "$S"
python3 tools/side_by_side.py "${runs[@]}" --fi "$OUT/fi_bench.json" --fla "$OUT/anchor_fla.json" | tee -a "$S"
