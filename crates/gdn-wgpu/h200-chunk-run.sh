#!/bin/bash
# gdn-wgpu's chunked long windows on the H200 through NVIDIA's Vulkan driver (issue 14 item 4): the chunked tests,
# the conformance suite's module with windows from 17 tokens chunked, after the prefill timings (token-serial vs chunked per T and column block, seed shape, B 1). A copy of this script is
# crates/gdn-wgpu/h200-chunk-run.sh.
# Prepare here: cargo test --release --no-run -p gdn-wgpu (builds the example too); copy the newest
#   target/release/deps/{chunked,conformance}-* and target/release/examples/prefill into /work/main/.devbin/chunk-wgpu/,
#   strip and xz them (chunked.xz, conformance.xz, prefill.xz), and this script as run.sh there.
# Device run (about 1.5 min of work after the start), carry [".devbin/chunk-wgpu", ".gl"]:
#   for f in .gl/*.deb; do dpkg -x $f /; done; ldconfig; bash .devbin/chunk-wgpu/run.sh
# The last table: token-serial vs chunked per T, L and BV (with the speed-up), the measured crossover, bf16 runs.
set -u
S=.devbin/chunk-wgpu
D=/tmp/chunk-wgpu
mkdir -p $D
for b in chunked conformance prefill; do xz -dc $S/$b.xz >$D/$b; chmod +x $D/$b; done
icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
[ -f "$icd" ] && export VK_DRIVER_FILES="$icd"
export XDG_RUNTIME_DIR=/tmp GDN_WGPU_ADAPTER=${GDN_WGPU_ADAPTER:-nvidia} GDN_WGPU_REQUIRE=1
mkdir -p /work/wt-chunk-wgpu/crates/gdn-conformance
[ -e /work/wt-chunk-wgpu/crates/gdn-conformance/fixtures ] || ln -s "$PWD/crates/gdn-conformance/fixtures" /work/wt-chunk-wgpu/crates/gdn-conformance/fixtures
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "== prefill, f32"
timeout 100 $D/prefill --t 16,32,64,128,256,512,4096 --len 16,32 --columns 8,16,32 --oracle-t 512 --kernels 1 --crossover 16,24,32,48,64,96,128 >$OUT/prefill.log 2>&1
echo "rc $?"
echo "== prefill, bf16 activations and output"
timeout 40 $D/prefill --t 512,4096 --len 16,32 --columns 16,32 --io bf16 --oracle-t 0 >$OUT/prefill-bf16.log 2>&1
echo "rc $?"
echo "== chunked tests"
timeout 60 $D/chunked --test-threads 4 --nocapture >$OUT/chunked.log 2>&1
echo "rc $?"
grep -E "test result|^T [0-9]+|seed shape|panicked|FAILED" $OUT/chunked.log | head -20
echo "== conformance"
timeout 80 $D/conformance --test-threads 8 chunked:: >$OUT/conformance.log 2>&1
echo "rc $?"
grep -E "test result|panicked|FAILED" $OUT/conformance.log | head -12
echo "== tables"
head -1 $OUT/prefill.log
sed -n '/^ *T /,$p' $OUT/prefill.log | grep -v '^crossover'
grep crossover $OUT/prefill.log
sed -n '/^ *T /,$p' $OUT/prefill-bf16.log
tail -3 $OUT/prefill.log $OUT/prefill-bf16.log | grep -i "error\|prefill:" 
