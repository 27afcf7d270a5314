//! The one interface every backend implements, the way the conformance suite and the command line see it.

use std::time::{Duration, Instant};

use crate::step::{PoolOptions, Step, TensorMut};
use crate::{Layer, Result, StepArgs};

/// How long one step call takes, measured the backend's own way.
#[derive(Clone, Debug)]
pub struct StepTiming {
    /// Median time of one call over the timed repetitions.
    pub per_call: Duration,
    /// Host time spent issuing one call, where the backend can tell it apart from the device work.
    pub host_per_call: Option<Duration>,
    /// How it was measured, e.g. `host clock` or `CUDA graph replay, events`.
    pub method: String,
}

/// Median of host-clock timings of `f`, `rounds` rounds of `iters` calls each, after one warm-up round.
pub fn time_host(
    rounds: usize,
    iters: usize,
    mut f: impl FnMut() -> Result<()>,
) -> Result<Duration> {
    for _ in 0..iters.max(1) {
        f()?;
    }
    let mut times = Vec::with_capacity(rounds);
    for _ in 0..rounds.max(1) {
        let t0 = Instant::now();
        for _ in 0..iters.max(1) {
            f()?;
        }
        times.push(t0.elapsed() / iters.max(1) as u32);
    }
    times.sort();
    Ok(times[times.len() / 2])
}

/// A place the step can run: the CPU, a CUDA device, a wgpu adapter.
pub trait Backend {
    /// A short name with the device, e.g. `cpu (avx2+fma, 2 threads)`.
    fn name(&self) -> String;
    /// Loads a layer's parameters and makes a state pool of `slots` zeroed slots for it, f32 and key-major.
    fn create_pool(&self, layer: &Layer, slots: usize) -> Result<Box<dyn LayerPool>> {
        self.create_pool_with(layer, slots, PoolOptions::default())
    }
    /// The same with the state's dtype and layout chosen; one the backend lacks is `Error::Unsupported`.
    fn create_pool_with(
        &self,
        layer: &Layer,
        slots: usize,
        options: PoolOptions,
    ) -> Result<Box<dyn LayerPool>>;
    /// The memory ceiling of this backend for a state of `bytes` bytes updated in place, in bytes read plus
    /// bytes written per second, measured now: one read-modify-write pass over a buffer of `bytes` bytes, the
    /// access pattern of the step's state (a copy into a second buffer would also pay, on x86, a read for
    /// ownership of every destination line). Device backends measure a large device copy instead.
    fn copy_ceiling(&self, bytes: usize) -> Result<f64> {
        let mut buf = vec![1.0f32; (bytes / 4).max(1)];
        let t = time_host(7, 8, || {
            touch_in_place(&mut buf);
            Ok(())
        })?;
        Ok(2.0 * (buf.len() * 4) as f64 / t.as_secs_f64())
    }

    /// The memory ceiling for a state of `bytes` bytes that is one of `parts` such states used in turn (a benchmark
    /// rotating among slot sets so that no state stays in a cache between its calls): the in-place pass of
    /// [`Backend::copy_ceiling`] over one part per call, the parts taken in turn. The default measures
    /// `copy_ceiling(bytes)`, right for backends whose ceiling already uses a footprint larger than their caches.
    fn copy_ceiling_rotating(&self, bytes: usize, _parts: usize) -> Result<f64> {
        self.copy_ceiling(bytes)
    }

    /// The read ceiling of this backend in bytes read per second, measured now, for a read-only stream (a matrix
    /// product over weights from memory reads and barely writes): a summing pass over one of `parts` buffers of
    /// `bytes` bytes per call, taken in turn. `None` where the backend does not measure one.
    fn read_ceiling_rotating(&self, _bytes: usize, _parts: usize) -> Result<Option<f64>> {
        Ok(None)
    }

    /// The arithmetic ceiling of this backend in f32 FLOP per second (an FMA counts two), measured now: all its
    /// threads issuing independent FMAs and nothing else. `None` where the backend does not measure one. Windows
    /// of several tokens are bound by arithmetic, not memory, so `gdn bench` sets them against this.
    fn fma_ceiling(&self) -> Result<Option<f64>> {
        Ok(None)
    }
}

/// One read-modify-write pass: every element read and written back (adding 0.0 is exact and keeps the compiler
/// from removing the pass), with a software prefetch 8 KiB ahead as the CPU step does, so that the ceiling is
/// the best streaming the machine does, not what its hardware prefetcher alone does.
#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512vl+fma",
    "x86_64+avx2+fma",
    "aarch64+neon"
))]
pub fn touch_in_place(buf: &mut [f32]) {
    const AHEAD: usize = 8192 / 4;
    let buf = std::hint::black_box(buf);
    let end = buf.as_ptr_range().end;
    let (lines, rest) = buf.as_chunks_mut::<16>();
    for line in lines.iter_mut() {
        let p = line.as_ptr().wrapping_add(AHEAD);
        if p < end {
            prefetch(p);
        }
        for x in line.iter_mut() {
            *x += 0.0;
        }
    }
    for x in rest {
        *x += 0.0;
    }
    std::hint::black_box(buf);
}

/// A read-only pass over `buf` (a read ceiling's work): its sum in four 16-lane accumulators, lines fetched
/// 8 KiB ahead as `touch_in_place` does.
#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512vl+fma",
    "x86_64+avx2+fma",
    "aarch64+neon"
))]
pub fn sum_read(buf: &[f32]) -> f32 {
    const AHEAD: usize = 8192 / 4;
    let end = buf.as_ptr_range().end;
    let (blocks, rest) = buf.as_chunks::<64>();
    let mut acc = [[0.0f32; 16]; 4];
    for block in blocks {
        for k in 0..4 {
            let p = block[16 * k..].as_ptr().wrapping_add(AHEAD);
            if p < end {
                prefetch(p);
            }
        }
        for (k, a) in acc.iter_mut().enumerate() {
            for (e, x) in a.iter_mut().enumerate() {
                *x += block[16 * k + e];
            }
        }
    }
    let mut t: f32 = acc.iter().flatten().sum();
    for x in rest {
        t += x;
    }
    std::hint::black_box(t)
}

/// Independent FMA chains an FMA ceiling keeps in flight: more than latency x issue ports on the cores we know
/// (Zen 3 and Intel: 4 x 2 = 8), few enough to stay in registers with AVX2's 16.
const FMA_CHAINS: usize = 10;

/// `iters` rounds of `FMA_CHAINS` independent `W`-lane FMAs; returns the FLOPs done. The multiplier and addend
/// come through `black_box`, so the compiler can neither fold the chains nor drop them.
#[inline(always)]
fn fma_chains<const W: usize>(iters: usize) -> f64 {
    let (m, a) = std::hint::black_box((0.999_f32, 1e-3_f32));
    let mut acc = [[1.0f32; W]; FMA_CHAINS];
    for _ in 0..iters {
        for chain in acc.iter_mut() {
            for x in chain.iter_mut() {
                *x = x.mul_add(m, a);
            }
        }
    }
    std::hint::black_box(acc);
    (2 * iters * FMA_CHAINS * W) as f64
}

/// [`fma_chains`] in 8 lanes (AVX2's ymm, two NEON registers per chain) for every instruction set...
#[multiversion::multiversion(targets("x86_64+avx2+fma", "aarch64+neon"))]
pub(crate) fn fma_burst_8(iters: usize) -> f64 {
    fma_chains::<8>(iters)
}

/// ... and in 16 lanes where AVX-512 registers hold them.
#[multiversion::multiversion(targets("x86_64+avx512f+avx512vl+fma"))]
pub(crate) fn fma_burst_16(iters: usize) -> f64 {
    fma_chains::<16>(iters)
}

/// A hint to bring the cache line at `p` into L1.
#[inline(always)]
pub(crate) fn prefetch<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: PREFETCHT0 belongs to SSE, which every x86_64 CPU has; it is a hint that neither reads memory in the
    // language's sense nor faults, whatever the address, so any pointer (even one past an allocation) is sound.
    unsafe {
        core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(p.cast())
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// One layer on one backend: its parameters and its pool of per-sequence states (S and the conv history),
/// resident where the backend computes. The history's double buffering, where a backend needs one, is inside.
pub trait LayerPool {
    fn layer(&self) -> &Layer;
    fn slots(&self) -> usize;
    /// The state's dtype and layout.
    fn options(&self) -> PoolOptions;
    /// Sets one slot's S (`d * h_v * d`, in the pool's layout) and H (`C * 3`, SPEC.md's). A bf16 pool rounds
    /// S to nearest even.
    fn write_slot(&mut self, slot: usize, state: &[f32], hist: &[f32]) -> Result<()>;
    /// Reads one slot's S (in the pool's layout) and H (SPEC.md's), as committed.
    fn read_slot(&mut self, slot: usize, state: &mut [f32], hist: &mut [f32]) -> Result<()>;
    /// Zeroes one slot's S and H: a new sequence starts there. Backends may override this to stay on the device.
    fn reset_slot(&mut self, slot: usize) -> Result<()> {
        let sh = *self.layer().shape();
        self.write_slot(slot, &vec![0.0; sh.state_len()], &vec![0.0; sh.hist_len()])
    }
    /// Copies slot `from` onto slot `to` (a sequence forked, e.g. for beam or tree speculation). Backends may
    /// override this to stay on the device.
    fn copy_slot(&mut self, from: usize, to: usize) -> Result<()> {
        let sh = *self.layer().shape();
        let (mut s, mut h) = (vec![0.0; sh.state_len()], vec![0.0; sh.hist_len()]);
        check_slot_io(self.layer(), self.slots(), to, s.len(), h.len())?;
        self.read_slot(from, &mut s, &mut h)?;
        self.write_slot(to, &s, &h)
    }
    /// Advances every sequence of a varlen step by its window, commits each as its entry says, and writes `out`
    /// (see [`crate::OutputLayout`] over the step's rows; rows of skipped sequences and rows no sequence names
    /// are left as they were). Every check ([`Step::validate`], then the dtypes the backend takes) runs
    /// before any state is touched: on error, the pool and `out` are as they were.
    fn step_varlen(&mut self, step: &Step<'_>, out: TensorMut<'_>) -> Result<()>;
    /// Every check `step_varlen` runs on `step` before it touches anything ([`Step::validate`] and the
    /// backend's own), without running it: adapters that run a step in parts (such as
    /// [`crate::spec::TwoPass`]) call it first. Backends with checks of their own override it.
    fn check_step(&self, step: &Step<'_>, out_len: usize) -> Result<()> {
        step.validate(self.layer(), self.slots(), out_len)
            .map(|_| ())
    }
    /// The speculative step (SPEC.md, "Speculative steps"): for each sequence, the window held on its slot (if
    /// any) first keeps its first `accept[i]` tokens (as a k-token commit would; 0 drops it), then the sequence's
    /// window runs; a window whose commit is `Verify` is *held* (a later `step_spec` or
    /// [`LayerPool::commit_held`] keeps a prefix of it), one that commits commits as in `step_varlen`. Outputs,
    /// committed states and histories are bitwise those of the seed's flow (verify, commit the prefix, verify
    /// the next window) on the same backend. Every check runs first. Backends without a native path return
    /// `Unsupported`; wrap them in [`crate::spec::TwoPass`].
    fn step_spec(&mut self, step: &Step<'_>, accept: &[usize], out: TensorMut<'_>) -> Result<()> {
        let _ = (step, accept, out);
        Err(crate::Error::Unsupported(
            "a native speculative step (wrap the pool in gdn::spec::TwoPass)".into(),
        ))
    }
    /// The length of the window held on `slot` (0: none).
    fn held(&self, slot: usize) -> usize {
        let _ = slot;
        0
    }
    /// Keeps the first `accept` tokens of the window held on `slot` and drops the rest (a request's end, or
    /// before a plain `step_varlen` on the slot; `read_slot` returns the committed state without the held window,
    /// `copy_slot` carries it). Nothing held: `accept` must be 0.
    fn commit_held(&mut self, slot: usize, accept: usize) -> Result<()> {
        crate::spec::slot_in_range(slot, self.slots())?;
        if accept > 0 {
            return Err(crate::Error::Param {
                name: "accept",
                why: format!("{accept} tokens, but slot {slot} holds no window"),
            });
        }
        Ok(())
    }
    /// A uniform batch of f32 windows with one commit mode (a convenience over [`LayerPool::step_varlen`]).
    fn step(&mut self, args: &StepArgs<'_>, out: &mut [f32]) -> Result<()> {
        let seqs = args.seqs(self.layer().shape())?;
        self.step_varlen(&args.varlen(&seqs), TensorMut::F32(out))
    }
    /// Times repeated steps of a varlen step into an output of `out_dtype` (the pool's slots evolve as the
    /// steps commit). Device backends override this to keep inputs resident and time the device work alone.
    fn time_varlen(
        &mut self,
        step: &Step<'_>,
        out_dtype: crate::DType,
        iters: usize,
    ) -> Result<StepTiming> {
        time_steps_host(self, std::slice::from_ref(step), out_dtype, iters)
    }
    /// [`LayerPool::time_varlen`] for a uniform f32 batch.
    fn time_step(&mut self, args: &StepArgs<'_>, iters: usize) -> Result<StepTiming> {
        let seqs = args.seqs(self.layer().shape())?;
        self.time_varlen(&args.varlen(&seqs), crate::DType::F32, iters)
    }
}

/// Host-clock timing of repeated steps that take `steps` in turn, one per call (one entry: the same step over and
/// over), each round making at least one call per entry; the default [`LayerPool::time_varlen`], and `gdn bench`'s
/// rotation among slot sets. All entries share the first one's rows and planes.
pub fn time_steps_host<P: LayerPool + ?Sized>(
    pool: &mut P,
    steps: &[Step<'_>],
    out_dtype: crate::DType,
    iters: usize,
) -> Result<StepTiming> {
    let first = steps.first().ok_or_else(|| crate::Error::Param {
        name: "steps",
        why: "nothing to time".into(),
    })?;
    let layout = first.layout(pool.layer().shape())?;
    let mut out = crate::TensorData::filled(layout.len(), 0.0, out_dtype);
    let mut next = 0;
    let per_call = time_host(7, iters.max(steps.len()), || {
        let step = &steps[next];
        next = (next + 1) % steps.len();
        pool.step_varlen(step, out.view_mut())
    })?;
    Ok(StepTiming {
        per_call,
        host_per_call: None,
        method: "host clock".into(),
    })
}

/// Checks a slot index and the lengths of a slot's S and H, for `write_slot` and `read_slot`.
pub fn check_slot_io(
    layer: &Layer,
    slots: usize,
    slot: usize,
    state: usize,
    hist: usize,
) -> Result<()> {
    let s = layer.shape();
    if slot >= slots {
        return Err(crate::Error::SlotRange {
            index: slot as i64,
            slots,
        });
    }
    for (name, expected, got) in [
        ("state", s.state_len(), state),
        ("hist", s.hist_len(), hist),
    ] {
        if got != expected {
            return Err(crate::Error::Length {
                name,
                expected,
                got,
            });
        }
    }
    Ok(())
}

/// The conv history laid out with a private copy per value head, `[h_v][3 (q, k, v)][d][3]`, as the GPU
/// backends keep it: every head's block then owns all the history it reads and can commit it in place (SPEC.md
/// forbids updating a q/k channel in place that other heads' blocks may still read). All copies of a q/k
/// channel stay equal because every value head of a slot is stepped together.
pub mod head_history {
    use crate::Layer;

    /// Floats of one slot's history in this layout.
    pub fn len(layer: &Layer) -> usize {
        let sh = layer.shape();
        sh.h_v * 9 * sh.d
    }

    /// The channel (SPEC.md's order) that value head `h`'s copy holds in `role` (0 q, 1 k, 2 v) at offset `e`.
    fn channel(layer: &Layer, h: usize, role: usize, e: usize) -> usize {
        let sh = layer.shape();
        let g = layer.config.head_map.qk_head(sh, h);
        match role {
            0 => g * sh.d + e,
            1 => (sh.h_k + g) * sh.d + e,
            _ => (2 * sh.h_k + h) * sh.d + e,
        }
    }

    /// SPEC.md's `[C][3]` history of one slot into `out` (`len(layer)` floats).
    pub fn from_spec(layer: &Layer, hist: &[f32], out: &mut [f32]) {
        let sh = layer.shape();
        for h in 0..sh.h_v {
            for role in 0..3 {
                for e in 0..sh.d {
                    let (c, at) = (channel(layer, h, role, e), ((h * 3 + role) * sh.d + e) * 3);
                    out[at..at + 3].copy_from_slice(&hist[c * 3..c * 3 + 3]);
                }
            }
        }
    }

    /// Back to SPEC.md's `[C][3]`: a q/k channel from the first value head that reads it, v from its own head.
    pub fn to_spec(layer: &Layer, pooled: &[f32], hist: &mut [f32]) {
        let sh = layer.shape();
        let mut done = vec![false; sh.h_k];
        for h in 0..sh.h_v {
            let first = !std::mem::replace(&mut done[layer.config.head_map.qk_head(sh, h)], true);
            for role in 0..3 {
                if role < 2 && !first {
                    continue;
                }
                for e in 0..sh.d {
                    let (c, at) = (channel(layer, h, role, e), ((h * 3 + role) * sh.d + e) * 3);
                    hist[c * 3..c * 3 + 3].copy_from_slice(&pooled[at..at + 3]);
                }
            }
        }
    }
}

/// A boxed pool is a pool (so adapters such as [`crate::spec::TwoPass`] wrap what `create_pool_with` returns).
impl<P: LayerPool + ?Sized> LayerPool for Box<P> {
    fn layer(&self) -> &Layer {
        (**self).layer()
    }
    fn slots(&self) -> usize {
        (**self).slots()
    }
    fn options(&self) -> PoolOptions {
        (**self).options()
    }
    fn write_slot(&mut self, slot: usize, state: &[f32], hist: &[f32]) -> Result<()> {
        (**self).write_slot(slot, state, hist)
    }
    fn read_slot(&mut self, slot: usize, state: &mut [f32], hist: &mut [f32]) -> Result<()> {
        (**self).read_slot(slot, state, hist)
    }
    fn reset_slot(&mut self, slot: usize) -> Result<()> {
        (**self).reset_slot(slot)
    }
    fn copy_slot(&mut self, from: usize, to: usize) -> Result<()> {
        (**self).copy_slot(from, to)
    }
    fn step_varlen(&mut self, step: &Step<'_>, out: TensorMut<'_>) -> Result<()> {
        (**self).step_varlen(step, out)
    }
    fn step_spec(&mut self, step: &Step<'_>, accept: &[usize], out: TensorMut<'_>) -> Result<()> {
        (**self).step_spec(step, accept, out)
    }
    fn check_step(&self, step: &Step<'_>, out_len: usize) -> Result<()> {
        (**self).check_step(step, out_len)
    }
    fn held(&self, slot: usize) -> usize {
        (**self).held(slot)
    }
    fn commit_held(&mut self, slot: usize, accept: usize) -> Result<()> {
        (**self).commit_held(slot, accept)
    }
    fn time_varlen(
        &mut self,
        step: &Step<'_>,
        out_dtype: crate::DType,
        iters: usize,
    ) -> Result<StepTiming> {
        (**self).time_varlen(step, out_dtype, iters)
    }
}

#[cfg(test)]
mod tests {
    use super::head_history;
    use crate::synth::Synth;
    use crate::{Config, HeadMap, Shape};

    #[test]
    fn the_read_pass_reads_every_element_once() {
        // lengths around the 64-float blocks, values whose sums are exact in f32 whatever the order
        for len in [0, 1, 63, 64, 65, 1000, 4096 + 17] {
            let buf: Vec<f32> = (0..len).map(|i| (i % 7) as f32).collect();
            let want: f32 = buf.iter().sum();
            assert_eq!(super::sum_read(&buf), want, "len {len}");
        }
    }

    #[test]
    fn head_history_round_trips_and_copies_each_qk_channel_per_head() {
        for map in [HeadMap::Tiled, HeadMap::Grouped] {
            let mut config = Config::new(Shape::new(16, 2, 6).unwrap());
            config.head_map = map;
            let mut rng = Synth::new(9);
            let layer = rng.layer(config).unwrap();
            let (_, hist) = rng.seq_state(&layer);
            let mut pooled = vec![0.0; head_history::len(&layer)];
            head_history::from_spec(&layer, &hist, &mut pooled);
            let mut back = vec![0.0; hist.len()];
            head_history::to_spec(&layer, &pooled, &mut back);
            assert_eq!(back, hist, "{map:?}");
            // value head h's q copy is q/k head g(h)'s history
            let (d, sh) = (16, *layer.shape());
            for h in 0..sh.h_v {
                let g = map.qk_head(&sh, h);
                assert_eq!(
                    &pooled[h * 9 * d..h * 9 * d + 3 * d],
                    &hist[g * d * 3..(g + 1) * d * 3]
                );
            }
        }
    }
}
