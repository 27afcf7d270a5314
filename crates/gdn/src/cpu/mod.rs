//! The f32 CPU backend: rayon threads over (sequence, head block) for the conv and over (sequence, value head)
//! for the recurrence; each q/k channel is convolved and normalized once per token, and each head's state is
//! read from the pool once per window and written once at the commit.

mod aligned;
pub mod kernels;

use std::sync::Arc;

use rayon::prelude::*;

use crate::backend::check_slot_io;
use crate::{Backend, Error, Layer, LayerPool, OutputLayout, Result, StepArgs};
use aligned::LineVec;
use kernels::{HeadInputs, LANES};

/// The CPU backend. By default it uses rayon's global thread pool (or, called from a thread of another rayon
/// pool, that pool).
#[derive(Clone, Default)]
pub struct Cpu {
    threads: Option<Arc<rayon::ThreadPool>>,
    /// Whether the thread that built the backend is one of its pool's threads (`with_calling_thread`).
    calling_thread: bool,
}

impl Cpu {
    pub fn new() -> Self {
        Cpu::default()
    }

    /// A backend with its own pool of `n` threads.
    pub fn with_threads(n: usize) -> Result<Self> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build()
            .map_err(|e| Error::Backend(e.to_string()))?;
        Ok(Cpu {
            threads: Some(Arc::new(pool)),
            calling_thread: false,
        })
    }

    /// A backend with its own pool of `n` threads (at least 2), the calling thread being one of them (rayon's
    /// `use_current_thread`). A step called from this thread runs on it and the `n - 1` others without handing
    /// the call to the pool: on the development VM that hand-off, waking a pool thread and then the caller, cost
    /// 10-20 us per call, about a tenth of a B 1 T 1 step (see CPU-NOTES.md). For engines that drive their layers
    /// from one thread. What it costs:
    /// - a step from any other thread still works, but only the `n - 1` other threads compute it;
    /// - rayon cannot release a pool that a thread joined this way, so the pool is kept for the life of the
    ///   process (its other threads asleep when idle) and this thread cannot join another pool (a second call on
    ///   the same thread is an error); rayon work started on this thread, e.g. by a `Cpu::new()` backend, runs on
    ///   this pool from then on.
    pub fn with_calling_thread(n: usize) -> Result<Self> {
        if n < 2 {
            // with one thread, a step from another thread would wait for this thread to enter the pool
            return Err(Error::Backend(format!(
                "a pool with the calling thread needs at least 2 threads, got {n} (use Cpu::with_threads)"
            )));
        }
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .use_current_thread()
            .build()
            .map_err(|e| Error::Backend(e.to_string()))?;
        let pool = Arc::new(pool);
        // dropping it would end the other threads while this one stays registered in it, leaving this thread's
        // later rayon work to run alone
        std::mem::forget(Arc::clone(&pool));
        Ok(Cpu {
            threads: Some(pool),
            calling_thread: true,
        })
    }

    fn thread_count(&self) -> usize {
        self.threads
            .as_ref()
            .map_or_else(rayon::current_num_threads, |p| p.current_num_threads())
    }

    /// The instruction set the kernels dispatch to on this machine.
    pub fn isa() -> &'static str {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512vl")
                && std::arch::is_x86_feature_detected!("fma")
            {
                return "avx512+fma";
            }
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                return "avx2+fma";
            }
        }
        #[cfg(target_arch = "aarch64")]
        {
            if std::arch::is_aarch64_feature_detected!("neon") {
                return "neon";
            }
        }
        "generic"
    }
}

impl Backend for Cpu {
    fn name(&self) -> String {
        let caller = if self.calling_thread {
            ", the caller one of them"
        } else {
            ""
        };
        format!(
            "cpu ({}, {} threads{caller})",
            Cpu::isa(),
            self.thread_count()
        )
    }

    /// The trait's in-place pass (with the step's software prefetch), by all the backend's threads, each on its
    /// own contiguous part, timed inside the pool (the ceiling is the memory's, not a thread hand-off's).
    fn copy_ceiling(&self, bytes: usize) -> Result<f64> {
        self.copy_ceiling_rotating(bytes, 1)
    }

    /// As `copy_ceiling`, over one of `parts` buffers of `bytes` bytes per timed pass, taken in turn.
    fn copy_ceiling_rotating(&self, bytes: usize, parts: usize) -> Result<f64> {
        let len = (bytes / 4).max(1);
        let parts = parts.max(1);
        let too_large = || Error::Param {
            name: "parts",
            why: format!("{parts} buffers of {bytes} bytes do not fit in this machine's memory"),
        };
        let total = len.checked_mul(parts).ok_or_else(too_large)?;
        // on cache lines, as the pool's state is
        let mut buf = LineVec::zeroed(total).map_err(|_| too_large())?;
        buf.fill(1.0);
        let chunk = len.div_ceil(self.thread_count().max(1)).max(1);
        let mut next = 0;
        let t = in_pool(&self.threads, || {
            crate::backend::time_host(7, 8 * parts, || {
                let part = &mut buf[next * len..(next + 1) * len];
                next = (next + 1) % parts;
                part.par_chunks_mut(chunk)
                    .for_each(crate::backend::touch_in_place);
                Ok(())
            })
        })?;
        Ok(2.0 * (len * 4) as f64 / t.as_secs_f64())
    }

    /// Every thread of the backend's pool runs FMA chains in the widest registers the kernels dispatch to; rounds
    /// of ~20 ms (wall time of the whole pool, so a thread that starts late counts against it), best of 5.
    fn fma_ceiling(&self) -> Result<Option<f64>> {
        let burst: fn(usize) -> f64 = match Cpu::isa() {
            "avx512+fma" => crate::backend::fma_burst_16,
            // without vector FMAs the chains would call a library fma per lane: no ceiling worth the name
            "generic" => return Ok(None),
            _ => crate::backend::fma_burst_8,
        };
        let rate = in_pool(&self.threads, || {
            let round = |iters: usize| {
                let t0 = std::time::Instant::now();
                let flops: f64 = rayon::broadcast(|_| burst(iters)).iter().sum();
                (flops, t0.elapsed().as_secs_f64())
            };
            // grow the rounds until waking the threads is a small part of one, then size them to ~20 ms
            let mut iters = 10_000;
            let mut secs = round(iters).1;
            while secs < 0.005 && iters < 1 << 30 {
                iters *= 4;
                secs = round(iters).1;
            }
            let iters = ((iters as f64) * 0.020 / secs.max(1e-9)).clamp(1e4, 1e9) as usize;
            (0..5)
                .map(|_| {
                    let (flops, secs) = round(iters);
                    flops / secs
                })
                .fold(0.0, f64::max)
        });
        Ok(Some(rate))
    }

    fn create_pool(&self, layer: &Layer, slots: usize) -> Result<Box<dyn LayerPool>> {
        layer.validate()?;
        let sh = layer.shape();
        // zeroed per-slot arrays; a pool too large for this machine is an error, not an abort
        let zeros = |per: usize| {
            let too_large = || Error::Param {
                name: "slots",
                why: format!("{slots} slots do not fit in this machine's memory"),
            };
            let len = slots.checked_mul(per).ok_or_else(too_large)?;
            LineVec::zeroed(len).map_err(|_| too_large())
        };
        Ok(Box::new(CpuPool {
            layer: layer.clone(),
            slots,
            state: zeros(sh.state_len())?,
            hist: zeros(sh.hist_len())?,
            conv_w_lanes: LineVec::from_slice(&to_lanes(&layer.params.conv_w, 4)),
            conv: LineVec::default(),
            heads_y: LineVec::default(),
            scratch: Vec::new(),
            threads: self.threads.clone(),
            pending: zeros(sh.h_v * kernels::pending_len(sh.d))?,
            owes: vec![false; slots],
        }))
    }
}

/// A layer's state pool in host memory: per slot, S in blocks of 16 columns per head ([h][j / 16][i][16], see
/// `for_each_row`) and H in lanes of 16 channels (see `to_lanes`). The history is updated in place: on the CPU every q/k channel is
/// convolved once, before any head reads it, so no double buffer is needed.
pub struct CpuPool {
    layer: Layer,
    slots: usize,
    state: LineVec,
    hist: LineVec,
    /// conv_w in the pool's lane layout (see `to_lanes`).
    conv_w_lanes: LineVec,
    /// Conv outputs [b][block][t][d] (q/k blocks normalized); grown on demand, reused across steps.
    conv: LineVec,
    /// Head outputs [b][h][t][d] before they are laid out as rows.
    heads_y: LineVec,
    /// Per-thread scratch of the head tasks, kept across steps (zeroing fresh buffers every step cost ~7% of
    /// a B 1 T 1 step). Indexed by the rayon thread; the lock is never contended (a head task runs on one
    /// thread and starts no nested parallel work).
    scratch: Vec<std::sync::Mutex<LineVec>>,
    threads: Option<Arc<rayon::ThreadPool>>,
    /// Per slot and value head, the update a one-token commit deferred ([`kernels::pending_len`] floats: the
    /// gate, k, delta), and per slot whether its stored S still owes it: the next window applies it while it
    /// first reads S, so decode reads and writes the state once per token instead of reading it, then updating
    /// it. `read_slot` applies it too; `write_slot` clears it.
    pending: LineVec,
    owes: Vec<bool>,
}

impl CpuPool {
    fn run_step(
        &mut self,
        args: &StepArgs<'_>,
        layout: OutputLayout,
        commit_at: usize,
        out: &mut [f32],
    ) {
        let layer = &self.layer;
        let sh = *layer.shape();
        let (d, h_k, h_v, c_n, n) = (sh.d, sh.h_k, sh.h_v, sh.channels(), sh.n());
        let batch = &args.batch;
        let (b_n, t) = (batch.b, batch.t);
        let blocks = 2 * h_k + h_v;
        let eps = layer.config.eps;
        let p = &layer.params;
        self.conv.resize(b_n * blocks * t * d);
        self.heads_y.resize(b_n * h_v * t * d);

        // Phase 1: conv + SiLU (+ L2 norm for q/k) per (sequence, head block); history committed in place.
        let hist_len = sh.hist_len();
        let mut hist_of_slot: Vec<Option<&mut [f32]>> =
            self.hist.chunks_mut(hist_len).map(Some).collect();
        let mut conv_tasks = Vec::with_capacity(b_n * blocks);
        for (b, (conv_b, &slot)) in self
            .conv
            .chunks_mut(blocks * t * d)
            .zip(args.slots)
            .enumerate()
        {
            if slot < 0 {
                continue;
            }
            // validated: in range and named once
            let hist = hist_of_slot[slot as usize].take().expect("slot named once");
            for (blk, (out_blk, hist_blk)) in conv_b
                .chunks_mut(t * d)
                .zip(hist.chunks_mut(3 * d))
                .enumerate()
            {
                conv_tasks.push((b, blk, out_blk, hist_blk));
            }
        }
        let conv_w_lanes = &self.conv_w_lanes;
        let conv_stage = |(b, blk, out_blk, hist_blk): (usize, usize, &mut [f32], &mut [f32])| {
            let c0 = blk * d;
            let qkv = &batch.qkv[b * t * c_n + c0..];
            let w = &conv_w_lanes[c0 * 4..(c0 + d) * 4];
            let normalize = (blk < 2 * h_k).then_some(eps);
            kernels::conv_block(d, t, qkv, c_n, w, hist_blk, out_blk, normalize, commit_at);
        };

        conv_tasks.into_par_iter().for_each(conv_stage);

        // Phase 2: the recurrence per (sequence, value head); each task owns its head's contiguous state.
        let head_len = d * d;
        let pend_len = kernels::pending_len(d);
        let mut state_of_slot: Vec<Option<(&mut [f32], &mut [f32])>> = self
            .state
            .chunks_mut(sh.state_len())
            .zip(self.pending.chunks_mut(h_v * pend_len))
            .map(Some)
            .collect();
        let mut head_tasks = Vec::with_capacity(b_n * h_v);
        for (b, y_b) in self.heads_y.chunks_mut(h_v * t * d).enumerate() {
            let slot = args.slots[b];
            if slot < 0 {
                continue;
            }
            let (st, pend) = state_of_slot[slot as usize]
                .take()
                .expect("slot named once");
            let owes = self.owes[slot as usize];
            for (h, ((st_h, pend_h), y_h)) in st
                .chunks_mut(head_len)
                .zip(pend.chunks_mut(pend_len))
                .zip(y_b.chunks_mut(t * d))
                .enumerate()
            {
                head_tasks.push(HeadTask {
                    b,
                    h,
                    state: st_h,
                    pending: pend_h,
                    owes,
                    y: y_h,
                });
            }
        }
        let conv = &self.conv;
        let head_stage = |task: HeadTask<'_>, work: &mut [f32]| {
            let (b, h) = (task.b, task.h);
            let g = layer.config.head_map.qk_head(&sh, h);
            let blk = |x: usize| &conv[((b * blocks) + x) * t * d..((b * blocks) + x + 1) * t * d];
            let first = b * t * h_v + h;
            let inp = HeadInputs {
                d,
                t,
                q: blk(g),
                k: blk(h_k + g),
                v: blk(2 * h_k + h),
                alpha: &batch.alpha[first..],
                beta: &batch.beta[first..],
                gate_stride: h_v,
                z: &batch.z[b * t * n + h * d..],
                z_stride: n,
                dt: p.dt[h],
                a: p.a[h],
                gamma: &p.gamma,
                gate: layer.config.gate,
                eps,
                commit_at,
                owes: task.owes,
            };
            kernels::head_window(&inp, task.state, task.pending, work, task.y);
        };
        let scratch_len = kernels::head_scratch_len(d, t);
        let threads = rayon::current_num_threads();
        if self.scratch.len() < threads {
            self.scratch.resize_with(threads, Default::default);
        }
        let scratch = &self.scratch;
        head_tasks.into_par_iter().for_each(|task| {
            let i = rayon::current_thread_index().unwrap_or(0) % scratch.len();
            let mut work = scratch[i]
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            if work.len() < scratch_len {
                work.resize(scratch_len);
            }
            head_stage(task, &mut work[..scratch_len]);
        });

        // a committed one-token window left its update owed (see `kernels::head_window`); a longer committed
        // window wrote its state in full; a verify changed nothing
        if commit_at > 0 {
            for &slot in args.slots.iter().filter(|&&s| s >= 0) {
                self.owes[slot as usize] = kernels::defers_update(t, commit_at);
            }
        }

        // Phase 3: rows of y, and the planes.
        let heads_y = &self.heads_y;
        let fill_row = |row: usize, y: &mut [f32]| {
            let (b, tok) = (row / t, row % t);
            for h in 0..h_v {
                let src = &heads_y[((b * h_v + h) * t + tok) * d..][..d];
                y[h * d..(h + 1) * d].copy_from_slice(src);
            }
        };
        let live = |row: usize| args.slots[row / t] >= 0;
        match layout.plane_stride {
            None => out
                .par_chunks_mut(n)
                .enumerate()
                .filter(|(r, _)| live(*r))
                .for_each(|(r, y)| fill_row(r, y)),
            Some(ps) => {
                let (y_all, rest) = out.split_at_mut(ps);
                let (p1, rest) = rest.split_at_mut(ps);
                let (p2, rest) = rest.split_at_mut(ps);
                let (p3, sums) = rest.split_at_mut(ps);
                y_all[..layout.rows * n]
                    .par_chunks_mut(n)
                    .zip(p1.par_chunks_mut(n))
                    .zip(p2.par_chunks_mut(n))
                    .zip(p3.par_chunks_mut(n))
                    .zip(sums.par_chunks_mut(n / 16))
                    .enumerate()
                    .filter(|(r, _)| live(*r))
                    .for_each(|(r, ((((y, p1), p2), p3), gs))| {
                        fill_row(r, y);
                        for m in 0..n {
                            p1[m] = y[m] * crate::plane_scale(1, m);
                            p2[m] = y[m] * crate::plane_scale(2, m);
                            p3[m] = y[m] * crate::plane_scale(3, m);
                        }
                        for (q, g) in y.chunks_exact(16).enumerate() {
                            let (mut even, mut odd) = (0.0f32, 0.0f32);
                            for e in (0..16).step_by(2) {
                                even += g[e];
                                odd += g[e + 1];
                            }
                            gs[q] = even + odd;
                        }
                    });
            }
        }
    }
}

/// Per-channel rows of `w` values ([C][w], SPEC.md) regrouped as [C / 16][w][16]: for 16 channels at a time
/// each tap (or history entry) is one vector. The CPU pool keeps the history and the conv weights so.
fn to_lanes(x: &[f32], w: usize) -> Vec<f32> {
    let mut out = vec![0.0; x.len()];
    for (c, row) in x.chunks_exact(w).enumerate() {
        let (g, l) = (c / LANES, c % LANES);
        for (k, &v) in row.iter().enumerate() {
            out[g * w * LANES + k * LANES + l] = v;
        }
    }
    out
}

/// The inverse of [`to_lanes`].
fn from_lanes(x: &[f32], w: usize) -> Vec<f32> {
    let mut out = vec![0.0; x.len()];
    for (c, row) in out.chunks_exact_mut(w).enumerate() {
        let (g, l) = (c / LANES, c % LANES);
        for (k, v) in row.iter_mut().enumerate() {
            *v = x[g * w * LANES + k * LANES + l];
        }
    }
    out
}

/// One value head of one sequence for the recurrence phase: its state, its deferred update and whether the state
/// owes it, and its outputs [t][d].
struct HeadTask<'s> {
    b: usize,
    h: usize,
    state: &'s mut [f32],
    pending: &'s mut [f32],
    owes: bool,
    y: &'s mut [f32],
}

/// Calls `f((i, h, j0), spec, pool)` with the offsets of each 16-column piece of each state row (value head h, row i,
/// columns j0..j0 + 16) in SPEC.md's layout [i][h][j] and in the CPU pool's layout [h][j / 16][i][16]: each head's
/// state is one contiguous slice its task owns, and each 16-column block of it is contiguous, rows in order, so
/// the block streams from memory and stays in L1 over a window.
fn for_each_row(sh: &crate::Shape, mut f: impl FnMut((usize, usize, usize), usize, usize)) {
    let d = sh.d;
    for i in 0..d {
        for h in 0..sh.h_v {
            for j0 in (0..d).step_by(LANES) {
                f(
                    (i, h, j0),
                    (i * sh.h_v + h) * d + j0,
                    h * d * d + j0 * d + i * LANES,
                );
            }
        }
    }
}

/// Runs `f` on a thread of the backend's own pool if it has one, else of rayon's global pool.
fn in_pool<R: Send>(threads: &Option<Arc<rayon::ThreadPool>>, f: impl FnOnce() -> R + Send) -> R {
    match threads {
        Some(pool) => pool.install(f),
        None => rayon::scope(|_| f()),
    }
}

impl LayerPool for CpuPool {
    fn layer(&self) -> &Layer {
        &self.layer
    }

    fn slots(&self) -> usize {
        self.slots
    }

    fn write_slot(&mut self, slot: usize, state: &[f32], hist: &[f32]) -> Result<()> {
        check_slot_io(&self.layer, self.slots, slot, state.len(), hist.len())?;
        let (sl, hl) = (state.len(), hist.len());
        let sh = *self.layer.shape();
        let dst = &mut self.state[slot * sl..(slot + 1) * sl];
        for_each_row(&sh, |_, spec, pool| {
            dst[pool..pool + LANES].copy_from_slice(&state[spec..spec + LANES])
        });
        self.owes[slot] = false;
        self.hist[slot * hl..(slot + 1) * hl].copy_from_slice(&to_lanes(hist, 3));
        Ok(())
    }

    fn read_slot(&mut self, slot: usize, state: &mut [f32], hist: &mut [f32]) -> Result<()> {
        check_slot_io(&self.layer, self.slots, slot, state.len(), hist.len())?;
        let (sl, hl) = (state.len(), hist.len());
        let sh = *self.layer.shape();
        let src = &self.state[slot * sl..(slot + 1) * sl];
        let pend_len = kernels::pending_len(sh.d);
        let pending = &self.pending[slot * sh.h_v * pend_len..(slot + 1) * sh.h_v * pend_len];
        let owes = self.owes[slot];
        for_each_row(&sh, |(i, h, j0), spec, pool| {
            let row: &[f32; LANES] = src[pool..pool + LANES].try_into().expect("lanes");
            let out = if owes {
                // the deferred update, applied as the next window would apply it
                let (g, k, delta) =
                    kernels::pending_parts(&pending[h * pend_len..(h + 1) * pend_len], sh.d);
                let delta = delta[j0..j0 + LANES].try_into().expect("lanes");
                kernels::apply_pending(g, row, k[i], delta)
            } else {
                *row
            };
            state[spec..spec + LANES].copy_from_slice(&out);
        });
        hist.copy_from_slice(&from_lanes(&self.hist[slot * hl..(slot + 1) * hl], 3));
        Ok(())
    }

    fn step(&mut self, args: &StepArgs<'_>, out: &mut [f32]) -> Result<()> {
        let (layout, commit_at) = args.validate(&self.layer, self.slots, out.len())?;
        // the whole step on one pool thread: its phases' parallel loops then split work among the pool's threads
        // without a hand-off from the calling thread for each
        let threads = self.threads.clone();
        in_pool(&threads, || self.run_step(args, layout, commit_at, out));
        Ok(())
    }
}
