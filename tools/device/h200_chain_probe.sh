#!/bin/bash
# Issue 14: the chunk chain's cost with wgmma products (tools/device/chunk_chain_probe.py, Triton) beside gdn's own
# chunked path in the same call (prefill_bench cases, and ncu's per-kernel durations at B 1 T 8192); issue 17: the
# out_proj read probe with the cp.async one-token variant (tools/device/quant_read_probe.cu).
# Carry .devbin/s22 (prefill_bench.xz). Run: bash tools/device/h200_chain_probe.sh
set -u
. tools/device/setup.sh
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader | tee -a "$S"
stamp "chain probe (Triton)"
PYTHONUNBUFFERED=1 timeout ${CP_TIMEOUT:-200} python3 tools/device/chunk_chain_probe.py >"$OUT/chain_probe.txt" 2>&1
echo "rc $?" | tee -a "$S"
grep -E "^(\||check|best)" "$OUT/chain_probe.txt" | tee -a "$S"
stamp "out_proj read probe"
nvcc -O3 -std=c++17 -arch=sm_90 -o /tmp/probe tools/device/quant_read_probe.cu 2>&1 | grep -v "^$" | head -20
timeout 100 /tmp/probe >"$OUT/quant_probe.txt" 2>&1
echo "rc $?" | tee -a "$S"
grep -E "q1|pattern|stream|empty" "$OUT/quant_probe.txt" | tee -a "$S"
stamp "gdn prefill"
PF_BINS=".devbin/s22/prefill_bench" PF_CASES="1 8192;1 512;1 32768" PF_NCU="${PF_NCU:-}" bash tools/device/h200_prefill.sh
stamp "done"
