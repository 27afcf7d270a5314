#!/bin/bash
# Kernel variants side by side in one device call: each folder .devbin/var/<name> holds the same benchmark
# binaries (xz-compressed, stripped) built from one variant of the kernels; the benchmarks run alternately,
# variant after variant, REPS times, so drift between reps shows beside the differences between variants.
# Prepared on a build machine, per variant: `cargo build --release -p gdn-cuda --example spec_bench --example
# external_bench`, then strip + xz into .devbin/var/<name>. device run from the repo root, carry [".devbin/var"]:
#   VARIANTS="base v1" REPS=2 SPEC_ARGS="64,256 4" EXT_ARGS="spec 64,256 4" bash tools/device/h200_variants.sh
# (EXT_ARGS= or SPEC_ARGS= empty skips that benchmark.)
set -u
. tools/device/setup.sh
V=.devbin/var
W=/tmp/variant_runs  # every run's whole output, one file a run (only rows.txt comes back)
mkdir -p "$W"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee -a "$S"
for f in $V/*/*.xz; do xz -dkf "$f"; chmod +x "${f%.xz}"; done
VARIANTS=${VARIANTS:-$(ls $V)}
SPEC_ARGS=${SPEC_ARGS-64,256 4}
EXT_ARGS=${EXT_ARGS-spec 64,256 4}
for r in $(seq 1 ${REPS:-2}); do
  for v in $VARIANTS; do
    if [ -n "$SPEC_ARGS" ]; then
      stamp "spec_bench $v rep $r"
      timeout 120 $V/$v/spec_bench $SPEC_ARGS >"$W/spec_${v}_$r.txt" 2>&1; echo "rc $?" | tee -a "$S"
    fi
    if [ -n "$EXT_ARGS" ]; then
      stamp "external_bench $v rep $r"
      timeout 150 $V/$v/external_bench $EXT_ARGS >"$W/ext_${v}_$r.txt" 2>&1; echo "rc $?" | tee -a "$S"
    fi
  done
done
stamp done
cat "$S"
# the table rows of every run, tagged with the run (the last lines printed)
for f in "$W"/spec_*.txt "$W"/ext_*.txt; do
  [ -f "$f" ] || continue
  grep -E '^\| (f32|bf16)|warning|rror' "$f" | cut -c1-100 | sed "s/^/$(basename $f .txt) /"
done | tee "$OUT/rows.txt"
