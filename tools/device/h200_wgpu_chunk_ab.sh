#!/bin/bash
# gdn-wgpu's chunked kernels, one build against another, on NVIDIA's Vulkan driver (H200 or H100): the bits of both
# builds compared (`examples/chunk_bits`, so a change meant to keep every sum is checked on the GPU too), per-kernel
# times at T 512 and 4096 (L 16 and 32, BV 16; base, new, new, base), B windows of 2048 in one call (B 1 and 4: does
# chunk_run have idle capacity?), BV 8 / 32 and the measured crossover for the new build, its chunked tests.
#
# Here (no GPU needed):  bash tools/device/h200_wgpu_chunk_ab.sh prepare BASE_COMMIT
#   builds examples/prefill and examples/chunk_bits at BASE_COMMIT (a worktree in /tmp, the checkout's chunk_bits
#   copied in) and at the checkout, and the checkout's chunked test, stripped and xz'd into .devbin/wgpu-ab (about
#   9 MB); fetch the Vulkan loaders into .gl first (/work/.library/device/README.md).
# Device, carry [".devbin/wgpu-ab", ".gl"]:
#   for f in .gl/*.deb; do dpkg -x $f /; done; ldconfig; bash tools/device/h200_wgpu_chunk_ab.sh
# About 3-4 minutes of work. Logs in $OUT; the tables printed last.
set -u
S=.devbin/wgpu-ab
if [ "${1:-}" = prepare ]; then
  set -e
  base=${2:?base commit}
  rm -rf $S && mkdir -p $S
  rm -rf /tmp/wgpu-ab-base && git worktree add -f --detach /tmp/wgpu-ab-base "$base" >/dev/null
  cp crates/gdn-wgpu/examples/chunk_bits.rs /tmp/wgpu-ab-base/crates/gdn-wgpu/examples/
  (cd /tmp/wgpu-ab-base && CARGO_TARGET_DIR=/tmp/wgpu-ab-target cargo build --release -q -p gdn-wgpu \
    --example prefill --example chunk_bits)
  cp /tmp/wgpu-ab-target/release/examples/prefill $S/prefill_base
  cp /tmp/wgpu-ab-target/release/examples/chunk_bits $S/bits_base
  git worktree remove --force /tmp/wgpu-ab-base
  cargo build --release -q -p gdn-wgpu --example prefill --example chunk_bits
  cp target/release/examples/prefill $S/prefill_new
  cp target/release/examples/chunk_bits $S/bits_new
  t=$(cargo test --release -q -p gdn-wgpu --test chunked --no-run --message-format=json |
    grep -o '"executable":"[^"]*chunked-[^"]*"' | tail -1 | cut -d'"' -f4)
  [ -n "$t" ] && cp "$t" $S/chunked_new
  for b in prefill_base prefill_new bits_base bits_new chunked_new; do strip $S/$b; xz -T2 $S/$b; done
  ls -la $S
  exit 0
fi
D=/tmp/wgpu-ab; mkdir -p $D
for b in prefill_base prefill_new bits_base bits_new chunked_new; do
  xz -dc $S/$b.xz >$D/$b || { echo "missing $S/$b.xz: run prepare"; exit 1; }
  chmod +x $D/$b
done
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json XDG_RUNTIME_DIR=/tmp
export GDN_WGPU_ADAPTER=${GDN_WGPU_ADAPTER:-nvidia} GDN_WGPU_REQUIRE=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for v in base new; do timeout 60 $D/bits_$v $D/bits_$v.bin >$OUT/bits_$v.log 2>&1; echo "bits $v rc $?"; done
cmp -s $D/bits_base.bin $D/bits_new.bin && echo "chunk_bits: the same bits" || echo "chunk_bits: BITS DIFFER"
for v in base new new base; do
  timeout 40 $D/prefill_$v --t 512,4096 --len 16,32 --columns 16 --oracle-t 512 --kernels 1 >>$OUT/t4096_$v.log 2>&1
  echo "T 512/4096 $v rc $?"
done
for v in base new; do for b in 1 4; do
  timeout 30 $D/prefill_$v --t 2048 --len 32 --columns 16 --oracle-t 0 --kernels 1 --seqs $b >$OUT/seqs${b}_$v.log 2>&1
  echo "seqs $b $v rc $?"
done; done
timeout 40 $D/prefill_new --t 4096 --len 16,32 --columns 8,32 --oracle-t 0 --kernels 1 >$OUT/columns_new.log 2>&1
echo "columns rc $?"
timeout 60 $D/prefill_new --t 1024 --len 32 --columns 16 --oracle-t 0 --crossover 32,64,128,256,512,1024,2048 \
  >$OUT/crossover_new.log 2>&1
echo "crossover rc $?"
timeout 60 $D/chunked_new --test-threads 4 >$OUT/chunked.log 2>&1
echo "chunked tests rc $?"; grep -E "test result|FAILED|panicked" $OUT/chunked.log | head
for f in $OUT/t4096_*.log $OUT/seqs*.log $OUT/columns_new.log $OUT/crossover_new.log; do
  echo "== $(basename $f)"
  grep -E "^ +[0-9]+ +[0-9]" $f
done
grep -i crossover $OUT/crossover_new.log | tail -9
