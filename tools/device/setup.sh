# Sourced from the repo root by the H200 scripts beside it: the binaries' folder ($B), the summary file ($S), a
# `stamp` for timed section headers, the Vulkan loaders from .gl with NVIDIA's ICD (for wgpu), and the machine's
# NVRTC 13 on the loader path (for the CUDA backend's dynamic loading).
B=.devbin/final
S=$OUT/summary.txt
t0=$(date +%s)
stamp() { echo "-- t=$(( $(date +%s) - t0 ))s $*" | tee -a "$S"; }
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
[ -f "$icd" ] && export VK_DRIVER_FILES="$icd"
export XDG_RUNTIME_DIR=/tmp GDN_WGPU_ADAPTER=nvidia GDN_WGPU_REQUIRE=1
L=$(dirname "$(find / -name 'libnvrtc.so.13*' -not -path '/proc/*' 2>/dev/null | grep -v builtins | head -1)")
export LD_LIBRARY_PATH="$L:${LD_LIBRARY_PATH:-}"
