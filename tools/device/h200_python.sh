#!/usr/bin/env bash
# H200, the Python package (issue 12): its tests on the GPU, HF generate with and without gdn.hf.patch (and
# with FLA's kernels inside HF), the vLLM-shaped core against FLA, the host cost of one call.
# Carry: .devbin/py (the abi3 wheel built here: `maturin build --release -m python/Cargo.toml -o .devbin/py`)
# and .whl (FLA 0.6 wheels, shared/anchors/README.md). Run from the repo root; results in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
S=$OUT/summary.txt
L=$(dirname "$(find / -name 'libnvrtc.so.13*' -not -path '/proc/*' 2>/dev/null | grep -v builtins | head -1)")
export LD_LIBRARY_PATH="$L:${LD_LIBRARY_PATH:-}"
rm -rf /tmp/gdnpy /tmp/site && mkdir -p /tmp/gdnpy /tmp/site
python3 -m zipfile -e .devbin/py/*.whl /tmp/gdnpy
for w in .whl/*.whl; do python3 -m zipfile -e "$w" /tmp/site; done
python3 -c "import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, transformers.__version__)" | tee -a "$S"
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader | tee -a "$S"

echo "== pytest (CUDA tests included)" | tee -a "$S"
if python3 -c "import pytest" 2>/dev/null; then
  PYTHONPATH=/tmp/gdnpy python3 -m pytest -q python/tests 2>&1 | tail -15 | tee -a "$S"
else
  echo "pytest not installed here: skipped" | tee -a "$S"
fi

echo "== HF end to end (torch path for HF)" | tee -a "$S"
PYTHONPATH=/tmp/gdnpy python3 tools/device/h200_hf_e2e.py 2>&1 | grep -v Warning | tail -8 | tee -a "$S"
cp "$OUT/hf_e2e.json" "$OUT/hf_e2e_torch.json" 2>/dev/null

echo "== vLLM-shaped core against FLA" | tee -a "$S"
PYTHONPATH=/tmp/gdnpy:/tmp/site python3 tools/device/h200_vllm_fla.py 2>&1 | tail -8 | tee -a "$S"

echo "== HF end to end with FLA installed (HF's GDN uses FLA's kernels)" | tee -a "$S"
PYTHONPATH=/tmp/gdnpy:/tmp/site python3 tools/device/h200_hf_e2e.py 2>&1 | grep -v Warning | tail -8 | tee -a "$S"

if [ "${SANITIZE:-0}" = 1 ]; then
  echo "== compute-sanitizer racecheck and memcheck on gdn.step through torch" | tee -a "$S"
  for tool in racecheck memcheck; do
    PYTHONPATH=/tmp/gdnpy compute-sanitizer --tool $tool --kernel-name kns=gdn_step --target-processes all python3 tools/device/h200_hf_e2e.py --quick 2>&1 \
      | grep -E "ERROR SUMMARY|RACECHECK SUMMARY|hazard" | tail -3 | tee -a "$S"
  done
fi
