#!/usr/bin/env bash
# The CPU kernels' generated code, checked in every instruction-set clone that multiversion compiled into a
# binary (argument: the binary, default target/release/gdn). Each row of 16 lanes must be one vector (or two on
# AVX2) of FMAs: LLVM's loop vectorizer once took 16 rows at a time in the AVX-512 clone of `head_window`, with a
# gather and a scatter per lane, 1.2-2.3x slower on an AVX-512 machine (CPU-NOTES 32). This machine cannot run
# that clone, so the check reads its code instead.
set -euo pipefail
bin="${1:-target/release/gdn}"
dis=$(mktemp)
objdump -d --no-show-raw-insn "$bin" >"$dis"
status=0
for fn in head_window head_window_bf16 conv_block; do
  for clone in avx2_fma avx512f; do
    body=$(awk -v fn="$fn" -v clone="$clone" '
      /^[0-9a-f]+ <.*>:$/ { on = index($0, length(fn) fn) && index($0, clone) && index($0, "version") }
      on' "$dis")
    if [ -z "$body" ]; then
      echo "codegen: no $clone clone of $fn in $bin"; status=1; continue
    fi
    wide=$([ "$clone" = avx512f ] && echo zmm || echo ymm)
    fmas=$(grep -c "vfmadd[0-9]*ps.*%$wide" <<<"$body" || true)
    gathers=$(grep -cE "vgather|vscatter|vpgather|vpscatter" <<<"$body" || true)
    echo "codegen: $fn ($clone): $fmas $wide FMAs, $gathers gathers/scatters"
    if [ "$fmas" -eq 0 ] || [ "$gathers" -ne 0 ]; then status=1; fi
  done
done
rm -f "$dis"
exit $status
