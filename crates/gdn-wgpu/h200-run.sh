#!/bin/bash
# The device run of gdn-wgpu (what produced measurements/h200-run2-*.log). Prepare it here, then run it there:
#   cargo test --release --no-run -p gdn-wgpu; cargo build --release --example timing -p gdn-wgpu
#   mkdir -p /work/main/.devbin/wgpu; cp target/release/deps/conformance-<newest> /work/main/.devbin/wgpu/conformance
#   (and target/release/deps/varlen-<newest> as .devbin/wgpu/varlen, spec-<newest> as .devbin/wgpu/spec: the
#   crate's own varlen and speculative-step tests, run if present)
#   cp target/release/examples/timing /work/main/.devbin/wgpu/; strip /work/main/.devbin/wgpu/{conformance,timing}
#   cp crates/gdn-wgpu/h200-run.sh /work/main/.devbin/wgpu/run.sh   (and the Vulkan loaders in /work/main/.gl)
#   device run, carry [".devbin/wgpu", ".gl"]:
#     for f in .gl/*.deb; do dpkg -x $f /; done; ldconfig; bash .devbin/wgpu/run.sh
# gdn-wgpu on the H200 through NVIDIA's Vulkan driver: the conformance suite (kernel built without and with
# wgpu's runtime checks), then the seed-shape timings. Run from the repository root after the loaders are
# unpacked (see the device README).
set -u
D=.devbin/wgpu
icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
[ -f "$icd" ] && export VK_DRIVER_FILES="$icd"
export XDG_RUNTIME_DIR=/tmp GDN_WGPU_ADAPTER=${GDN_WGPU_ADAPTER:-nvidia}
# the suite's HF fixtures are found through the path the test binary was built at
mkdir -p /work/wt-wgpu/crates/gdn-conformance
[ -e /work/wt-wgpu/crates/gdn-conformance/fixtures ] || ln -s "$PWD/crates/gdn-conformance/fixtures" /work/wt-wgpu/crates/gdn-conformance/fixtures
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for checks in 0 1; do
  echo "== conformance, GDN_WGPU_CHECKS=$checks"
  GDN_WGPU_CHECKS=$checks timeout 200 $D/conformance --nocapture --test-threads 8 >$OUT/tests$checks.log 2>&1
  echo "rc $?"
  grep -E "test result|worst|SKIPPED|panicked|FAILED" $OUT/tests$checks.log | sort | uniq | head -30
done
if [ -x $D/varlen ]; then
  echo "== varlen tests"
  timeout 100 $D/varlen --test-threads 8 >$OUT/varlen.log 2>&1
  echo "rc $?"
  grep -E "test result|SKIPPED|panicked|FAILED" $OUT/varlen.log | head -10
fi
if [ -x $D/spec ]; then
  echo "== speculative-step tests (native against the two-pass flow, bitwise, every pool option)"
  timeout 100 $D/spec --test-threads 8 >$OUT/spec.log 2>&1
  echo "rc $?"
  grep -E "test result|SKIPPED|panicked|FAILED" $OUT/spec.log | head -10
fi
echo "== timing"
[ -n "${SKIP_TIMING:-}" ] || {
  timeout 200 $D/timing --row-blocks 4,8 --checks off --both 2>&1 | tee $OUT/timing.log
  timeout 100 $D/timing --row-blocks 4 --checks on 2>&1 | tee -a $OUT/timing.log
  # the pool options and 16-bit activations of the varlen kernel
  timeout 100 $D/timing --state bf16 2>&1 | tee -a $OUT/timing.log
  timeout 100 $D/timing --state bf16 --io bf16 2>&1 | tee -a $OUT/timing.log
  timeout 100 $D/timing --layout value-major 2>&1 | tee -a $OUT/timing.log
  timeout 100 $D/timing --state bf16 --layout value-major --io bf16 2>&1 | tee -a $OUT/timing.log
}
