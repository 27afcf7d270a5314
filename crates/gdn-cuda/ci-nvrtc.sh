#!/usr/bin/env bash
# Makes libnvrtc (CUDA 13) loadable for gdn-cuda's tests on a machine without the CUDA toolkit.
# Source it (`. crates/gdn-cuda/ci-nvrtc.sh`): it pip-installs nvidia-cuda-nvrtc into a --target folder
# (once; reused while it is there) and prepends that folder's lib to LD_LIBRARY_PATH, where cudarc's dynamic
# loading finds libnvrtc.so.13. No GPU or driver is needed to compile the kernels.
GDN_NVRTC_DIR="${GDN_NVRTC_DIR:-${HOME:-/tmp}/.cache/gdn-nvrtc}"
if ! ls "$GDN_NVRTC_DIR"/nvidia/cu13/lib/libnvrtc.so.13* >/dev/null 2>&1; then
    python3 -m pip install --quiet --disable-pip-version-check --target "$GDN_NVRTC_DIR" "nvidia-cuda-nvrtc>=13,<14" ||
        echo "ci-nvrtc.sh: pip could not install nvidia-cuda-nvrtc; the NVRTC test will skip" >&2
fi
export LD_LIBRARY_PATH="$GDN_NVRTC_DIR/nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
