#!/usr/bin/env bash
# Makes libnvrtc (CUDA 13) loadable for gdn-cuda's tests on a machine without the CUDA toolkit.
# Source it (`. crates/gdn-cuda/ci-nvrtc.sh`), also under `set -euo pipefail`: it pip-installs
# nvidia-cuda-nvrtc into a --target folder (once; reused while it is there) and prepends that folder's lib to
# LD_LIBRARY_PATH, where cudarc's dynamic loading finds libnvrtc.so.13. No GPU or driver is needed to compile
# the kernels; without libnvrtc the NVRTC test skips with a message instead of failing.
GDN_NVRTC_DIR="${GDN_NVRTC_DIR:-${HOME:-/tmp}/.cache/gdn-nvrtc}"
if ! ls "$GDN_NVRTC_DIR"/nvidia/cu13/lib/libnvrtc.so.13* >/dev/null 2>&1; then
    gdn_nvrtc_pip="python3 -m pip install --quiet --disable-pip-version-check --target $GDN_NVRTC_DIR nvidia-cuda-nvrtc>=13,<14"
    # an externally managed Python (PEP 668) may want the flag even for --target; older pips do not know it
    $gdn_nvrtc_pip 2>/dev/null || $gdn_nvrtc_pip --break-system-packages ||
        echo "ci-nvrtc.sh: pip could not install nvidia-cuda-nvrtc; the NVRTC test will skip" >&2
    unset gdn_nvrtc_pip
fi
export LD_LIBRARY_PATH="$GDN_NVRTC_DIR/nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
