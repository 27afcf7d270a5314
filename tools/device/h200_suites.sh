#!/bin/bash
# The conformance suites of both GPU backends on the H200 (CUDA, and wgpu through NVIDIA's Vulkan driver), for a
# change to the suite or the core that CI cannot run on a GPU. Prepared on a build machine:
#   cargo test --release --no-run -p gdn-cuda -p gdn-wgpu; copy the two `conformance-*` test binaries to
#   .devbin/suite/{cuda,wgpu}_conformance (strip them); Vulkan loaders in .gl
#   device run from the repo root, carry [".devbin/suite", ".gl"]: bash tools/device/h200_suites.sh
set -u
. tools/device/setup.sh
B=.devbin/suite
mkdir -p /work && ln -sfn "$PWD" /work/main
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$S"
for be in cuda wgpu; do
  stamp "$be conformance"
  timeout 200 $B/${be}_conformance --nocapture --test-threads 8 >"$OUT/${be}_tests.log" 2>&1
  echo "$be tests rc $? $(grep 'test result' "$OUT/${be}_tests.log")" | tee -a "$S"
  grep -E "worst|FAILED|panicked|SKIPPED" "$OUT/${be}_tests.log" | sort | uniq | tee -a "$S"
done
stamp done
