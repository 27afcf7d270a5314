//! The f32 CPU backend: rayon threads over (sequence, head block) for the conv and over (sequence, value head)
//! for the recurrence; each q/k channel is convolved and normalized once per token, and each head's state is
//! read from the pool once per window and written once at the commit.

mod aligned;
pub mod kernels;

use std::sync::Arc;

use rayon::prelude::*;

use crate::backend::check_slot_io;
use crate::step::{Checked, DType, PoolOptions, Step, TensorMut};
use crate::{Backend, Error, Layer, LayerPool, OutputLayout, Result};
use aligned::LineVec;
use kernels::{Bf16, HeadInputs, StateElem, LANES};

/// Elements of a 16-bit input a thread widens at a time (a decode step's qkv is one piece).
const WIDEN_PIECE: usize = 1 << 15;

/// The CPU backend. By default it uses rayon's global thread pool (or, called from a thread of another rayon
/// pool, that pool).
#[derive(Clone, Default)]
pub struct Cpu {
    threads: Option<Arc<rayon::ThreadPool>>,
    /// Whether the thread that built the backend is one of its pool's threads (`with_calling_thread`).
    calling_thread: bool,
}

impl Cpu {
    /// A ceiling's timing: `parts` buffers of `bytes` bytes on cache lines (as the pool's state is), `pass` run on
    /// one part per timed call, the parts in turn, each split into one piece a thread; the part's length in
    /// floats and the seconds a pass.
    fn time_rotating(
        &self,
        bytes: usize,
        parts: usize,
        mut pass: impl FnMut(&mut [f32], usize) + Send,
    ) -> Result<(usize, f64)> {
        let len = (bytes / 4).max(1);
        let parts = parts.max(1);
        let too_large = || Error::Param {
            name: "parts",
            why: format!("{parts} buffers of {bytes} bytes do not fit in this machine's memory"),
        };
        let total = len.checked_mul(parts).ok_or_else(too_large)?;
        let mut buf = LineVec::zeroed(total).map_err(|_| too_large())?;
        buf.fill(1.0);
        let chunk = len.div_ceil(self.thread_count().max(1)).max(1);
        let mut next = 0;
        let t = in_pool(&self.threads, || {
            crate::backend::time_host(7, 8 * parts, || {
                pass(&mut buf[next * len..(next + 1) * len], chunk);
                next = (next + 1) % parts;
                Ok(())
            })
        })?;
        Ok((len, t.as_secs_f64()))
    }

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
        let (len, t) = self.time_rotating(bytes, parts, |part, chunk| {
            part.par_chunks_mut(chunk)
                .for_each(crate::backend::touch_in_place)
        })?;
        Ok(2.0 * (len * 4) as f64 / t)
    }

    /// The summing pass of `crate::backend::sum_read` over one part per call, split over the pool's threads as
    /// `copy_ceiling_rotating` splits its pass.
    fn read_ceiling_rotating(&self, bytes: usize, parts: usize) -> Result<Option<f64>> {
        let (len, t) = self.time_rotating(bytes, parts, |part, chunk| {
            let s: f32 = part.par_chunks(chunk).map(crate::backend::sum_read).sum();
            std::hint::black_box(s);
        })?;
        Ok(Some((len * 4) as f64 / t))
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

    fn create_pool_with(
        &self,
        layer: &Layer,
        slots: usize,
        options: PoolOptions,
    ) -> Result<Box<dyn LayerPool>> {
        Ok(Box::new(self.create_cpu_pool(layer, slots, options)?))
    }
}

impl Cpu {
    /// A pool with the concrete type.
    pub fn create_cpu_pool(
        &self,
        layer: &Layer,
        slots: usize,
        options: PoolOptions,
    ) -> Result<CpuPool> {
        layer.validate()?;
        options.validate()?;
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
        // a bf16 state packs two elements in each f32 of its buffer (state_len is even: d is a multiple of 16)
        let state_floats = sh.state_len() * options.state.size() / 4;
        Ok(CpuPool {
            layer: layer.clone(),
            options,
            slots,
            state: zeros(state_floats)?,
            hist: zeros(sh.hist_len())?,
            conv_w_lanes: LineVec::from_slice(&to_lanes(&layer.params.conv_w, 4)),
            work: Work::default(),
            scratch: Vec::new(),
            threads: self.threads.clone(),
            pending: (0..slots)
                .map(|_| LineVec::zeroed(sh.h_v * kernels::pending_len(sh.d)))
                .collect::<std::result::Result<_, _>>()
                .map_err(|_| Error::Param {
                    name: "slots",
                    why: format!("{slots} slots do not fit in this machine's memory"),
                })?,
            owes: vec![0; slots],
            held: vec![0; slots],
            held_rows: vec![Vec::new(); slots],
        })
    }
}

/// Buffers a step works in, sized to each step: a buffer holding more than twice a step's need and more than
/// [`Work::KEEP`] floats is released at that step, so a pool does not keep a long prefill's buffers for the
/// decode steps that follow, and steps of one size reuse theirs (freeing them after every large step cost 10% at
/// B 8 T 64 in zeroing and page faults).
#[derive(Default)]
struct Work {
    /// Conv outputs per live sequence [block][t][d] (q/k blocks normalized), sequences end to end.
    conv: LineVec,
    /// Head outputs per live sequence [h][t][d] before they are laid out as rows.
    heads_y: LineVec,
    /// Inputs given in bf16 or f16, widened: qkv, alpha, beta, z.
    widened: [LineVec; 4],
}

impl Work {
    /// 16 MiB of floats: a B 64 T 4 step's conv and head outputs at the seed's shape.
    const KEEP: usize = 4 << 20;

    fn floats(&self) -> usize {
        self.conv.capacity()
            + self.heads_y.capacity()
            + self.widened.iter().map(|w| w.capacity()).sum::<usize>()
    }

    /// `buf` resized to `need` floats, released first where it holds far more.
    fn fit(buf: &mut LineVec, need: usize) {
        if buf.capacity() > Self::KEEP.max(need.saturating_mul(2)) {
            *buf = LineVec::default();
        }
        buf.resize(need);
    }
}

/// One live sequence of a step: where its rows, conv outputs and head outputs are.
#[derive(Clone, Copy)]
struct LiveSeq {
    slot: usize,
    start: usize,
    len: usize,
    commit_at: usize,
    /// A speculative verify window, held on its slot.
    hold: bool,
    /// Offsets of its conv outputs and head outputs in `Work`.
    conv: usize,
    y: usize,
}

/// A layer's state pool in host memory: per slot, S in blocks of 16 columns per head ([h][j / 16][i][16], see
/// `for_each_row`), f32 or bf16, and H in lanes of 16 channels (see `to_lanes`). The history is updated in place:
/// on the CPU every q/k channel is convolved once, before any head reads it, so no double buffer is needed.
pub struct CpuPool {
    layer: Layer,
    options: PoolOptions,
    slots: usize,
    state: LineVec,
    hist: LineVec,
    /// conv_w in the pool's lane layout (see `to_lanes`).
    conv_w_lanes: LineVec,
    work: Work,
    /// Per-thread scratch of the head tasks, kept across steps (zeroing fresh buffers every step cost ~7% of
    /// a B 1 T 1 step). Indexed by the rayon thread; the lock is never contended (a head task runs on one
    /// thread and starts no nested parallel work).
    scratch: Vec<std::sync::Mutex<LineVec>>,
    threads: Option<Arc<rayon::ThreadPool>>,
    /// Per slot, per value head, updates kept for a later read ([`kernels::pending_len`] floats each: the gate,
    /// k, delta; [h][cap][..], cap growing to the longest window held there). A one-token commit defers its
    /// update there: the next window applies it while it first reads S, so decode reads and writes the state
    /// once per token. A held window (a speculative verify) keeps every token's update there: the next step
    /// applies the accepted prefix the same way. `owes[slot]` updates are owed by the stored S (`read_slot`
    /// applies them too); `held[slot]` are a held window's, not yet accepted (never both).
    pending: Vec<LineVec>,
    owes: Vec<usize>,
    held: Vec<usize>,
    /// Per slot, a held window's qkv rows (widened), for the conv history of its accepted prefix.
    held_rows: Vec<Vec<f32>>,
}

impl CpuPool {
    /// Floats of work buffers the pool holds now between steps (besides its states), per-thread scratch included:
    /// per buffer at most the larger of [`CpuPool::WORK_KEEP`] and twice the last step's need.
    pub fn work_floats(&self) -> usize {
        let scratch: usize = self
            .scratch
            .iter()
            .map(|m| m.lock().map_or(0, |b| b.capacity()))
            .sum();
        self.work.floats() + scratch
    }

    /// The floats a work buffer may keep whatever the steps need.
    pub const WORK_KEEP: usize = Work::KEEP;

    /// One slot's S from `state` in the pool's public layout into its rows of `E`.
    fn write_state<E: StateElem>(&mut self, slot: usize, state: &[f32]) {
        let sh = *self.layer.shape();
        let layout = self.options.layout;
        let rows = sh.state_len() / LANES;
        let dst = &mut rows_of::<E>(&mut self.state)[slot * rows..(slot + 1) * rows];
        for_each_row(&sh, |(i, h, j0), pool| {
            let row: [f32; LANES] = std::array::from_fn(|l| state[layout.index(&sh, i, h, j0 + l)]);
            dst[pool / LANES] = E::store(&row);
        });
    }

    /// One slot's S as committed (a deferred update applied and rounded as the next window would) into `state`
    /// in the pool's public layout.
    fn read_state<E: StateElem>(&self, slot: usize, state: &mut [f32]) {
        let sh = *self.layer.shape();
        let layout = self.options.layout;
        let rows = sh.state_len() / LANES;
        let src = &bytemuck::cast_slice::<f32, E::Row>(&self.state)[slot * rows..(slot + 1) * rows];
        let pend_len = kernels::pending_len(sh.d);
        let pending = &self.pending[slot];
        let cap = pending.len() / (sh.h_v * pend_len);
        let owes = self.owes[slot];
        for_each_row(&sh, |(i, h, j0), pool| {
            let stored = E::load(&src[pool / LANES]);
            let row = if owes > 0 {
                let mut x = stored;
                for u in 0..owes {
                    let at = (h * cap + u) * pend_len;
                    let (g, k, delta) = kernels::pending_parts(&pending[at..at + pend_len], sh.d);
                    let delta = delta[j0..j0 + LANES].try_into().expect("lanes");
                    x = kernels::apply_pending(g, &x, k[i], delta);
                }
                E::roundtrip(x)
            } else {
                stored
            };
            for (l, &x) in row.iter().enumerate() {
                state[layout.index(&sh, i, h, j0 + l)] = x;
            }
        });
    }

    fn run_step<E: kernels::StateElem>(
        &mut self,
        state: &mut [E::Row],
        step: &Step<'_>,
        checked: &Checked,
        out: TensorMut<'_>,
        spec: bool,
    ) {
        let layer = &self.layer;
        let sh = *layer.shape();
        let (d, h_k, h_v, c_n, n) = (sh.d, sh.h_k, sh.h_v, sh.channels(), sh.n());
        let blocks = 2 * h_k + h_v;
        let eps = layer.config.eps;
        let p = &layer.params;

        // the live sequences and where their intermediate outputs go
        let mut live = Vec::with_capacity(step.seqs.len());
        let (mut conv_len, mut y_len) = (0, 0);
        for (seq, &commit_at) in step.seqs.iter().zip(&checked.commit_at) {
            if seq.slot < 0 {
                continue;
            }
            live.push(LiveSeq {
                slot: seq.slot as usize,
                start: seq.start,
                len: seq.len,
                commit_at,
                hold: spec && commit_at == 0,
                conv: conv_len,
                y: y_len,
            });
            conv_len += blocks * seq.len * d;
            y_len += h_v * seq.len * d;
        }
        let Work {
            conv: conv_buf,
            heads_y,
            widened,
        } = &mut self.work;
        Work::fit(conv_buf, conv_len);
        Work::fit(heads_y, y_len);

        // inputs in bf16 or f16 are widened once (exactly): the kernels read f32 rows
        let tensors = [step.rows.qkv, step.rows.alpha, step.rows.beta, step.rows.z];
        for (t, buf) in tensors.iter().zip(widened.iter_mut()) {
            if t.as_f32().is_none() {
                Work::fit(buf, t.len());
                // in pieces over the pool's threads: on one thread a long window's widening left the others
                // idle (9% of a bf16 T 4096 step's samples)
                buf[..t.len()]
                    .par_chunks_mut(WIDEN_PIECE)
                    .enumerate()
                    .for_each(|(i, piece)| t.widen_into(i * WIDEN_PIECE, piece));
            }
        }
        // f32 views: the caller's slices where they are f32, else the widened copies
        let [qkv, alpha, beta, z]: [&[f32]; 4] =
            std::array::from_fn(|i| tensors[i].as_f32().unwrap_or(&widened[i][..]));

        // Phase 1: conv + SiLU (+ L2 norm for q/k) per (sequence, head block); history committed in place.
        let hist_len = sh.hist_len();
        let mut hist_of_slot: Vec<Option<&mut [f32]>> =
            self.hist.chunks_mut(hist_len).map(Some).collect();
        let mut conv_tasks = Vec::with_capacity(live.len() * blocks);
        let mut conv_rest: &mut [f32] = conv_buf;
        for s in &live {
            let (conv_s, rest) = std::mem::take(&mut conv_rest).split_at_mut(blocks * s.len * d);
            conv_rest = rest;
            // validated: in range and named once
            let hist = hist_of_slot[s.slot].take().expect("slot named once");
            for (blk, (out_blk, hist_blk)) in conv_s
                .chunks_mut(s.len * d)
                .zip(hist.chunks_mut(3 * d))
                .enumerate()
            {
                conv_tasks.push((*s, blk, out_blk, hist_blk));
            }
        }
        // longest windows first, so that a long window's tasks do not start last (the order of independent tasks
        // changes no bits)
        conv_tasks.sort_by_key(|task| std::cmp::Reverse(task.0.len));
        let conv_w_lanes = &self.conv_w_lanes;
        // Windows of different lengths: one task per split, or rayon runs a quarter of the list as one piece and
        // a piece holding the long window's tasks runs on alone (a mixed batch of 7 decode sequences and a
        // 64-token window took 1.8x its two halves; 1.2x so). Uniform windows keep rayon's own splitting,
        // which costs fewer joins.
        let split = if live.iter().all(|s| s.len == checked.max_len) {
            usize::MAX
        } else {
            1
        };
        conv_tasks.into_par_iter().with_max_len(split).for_each(
            |(s, blk, out_blk, hist_blk): (LiveSeq, usize, &mut [f32], &mut [f32])| {
                let c0 = blk * d;
                let qkv = &qkv[s.start * c_n + c0..];
                let w = &conv_w_lanes[c0 * 4..(c0 + d) * 4];
                let normalize = (blk < 2 * h_k).then_some(eps);
                kernels::conv_block(
                    d,
                    s.len,
                    qkv,
                    c_n,
                    w,
                    hist_blk,
                    out_blk,
                    normalize,
                    s.commit_at,
                );
            },
        );

        // Phase 2: the recurrence per (sequence, value head); each task owns its head's contiguous state.
        // rows of 16 values per head and per slot
        let head_len = d * d / LANES;
        let pend_len = kernels::pending_len(d);
        // every held window's updates fit its slot's region (`CpuPool::fit_pending` ran before)
        let mut state_of_slot: Vec<Option<_>> = state
            .chunks_mut(sh.state_len() / LANES)
            .zip(self.pending.iter_mut())
            .map(Some)
            .collect();
        let mut head_tasks = Vec::with_capacity(live.len() * h_v);
        let mut y_rest: &mut [f32] = heads_y;
        for s in &live {
            let (y_s, rest) = std::mem::take(&mut y_rest).split_at_mut(h_v * s.len * d);
            y_rest = rest;
            let (st, pend) = state_of_slot[s.slot].take().expect("slot named once");
            let owes = self.owes[s.slot];
            let cap = pend.len() / (h_v * pend_len);
            for (h, ((st_h, pend_h), y_h)) in st
                .chunks_mut(head_len)
                .zip(pend.chunks_mut(cap * pend_len))
                .zip(y_s.chunks_mut(s.len * d))
                .enumerate()
            {
                head_tasks.push(HeadTask {
                    seq: *s,
                    h,
                    state: st_h,
                    pending: pend_h,
                    owes,
                    y: y_h,
                });
            }
        }
        head_tasks.sort_by_key(|task| std::cmp::Reverse(task.seq.len));
        let conv = &*conv_buf;
        let head_stage = |task: HeadTask<'_, E>, scratch: &mut [f32]| {
            let (s, h) = (task.seq, task.h);
            let g = layer.config.head_map.qk_head(&sh, h);
            let blk = |x: usize| &conv[s.conv + x * s.len * d..s.conv + (x + 1) * s.len * d];
            let first = s.start * h_v + h;
            let hi = HeadInputs {
                d,
                t: s.len,
                q: blk(g),
                k: blk(h_k + g),
                v: blk(2 * h_k + h),
                alpha: &alpha[first..],
                beta: &beta[first..],
                gate_stride: h_v,
                z: &z[s.start * n + h * d..],
                z_stride: n,
                dt: p.dt[h],
                a: p.a[h],
                gamma: &p.gamma,
                gate: layer.config.gate,
                eps,
                commit_at: s.commit_at,
                owed: task.owes,
                hold: s.hold,
            };
            E::head_window(&hi, task.state, task.pending, scratch, task.y);
        };
        let scratch_len = kernels::head_scratch_len(d, checked.max_len);
        let threads = rayon::current_num_threads();
        if self.scratch.len() < threads {
            self.scratch.resize_with(threads, Default::default);
        }
        let scratch = &self.scratch;
        head_tasks
            .into_par_iter()
            .with_max_len(split)
            .for_each(|task| {
                let i = rayon::current_thread_index().unwrap_or(0) % scratch.len();
                let mut buf = scratch[i]
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner());
                // sized to this step: a long window's scratch is not kept for the short ones after it
                if buf.len() > scratch_len.max(Work::KEEP / 16) {
                    *buf = LineVec::default();
                }
                if buf.len() < scratch_len {
                    buf.resize(scratch_len);
                }
                head_stage(task, &mut buf[..scratch_len]);
            });

        // a committed one-token window left its update owed (see `kernels::head_window`); a longer committed
        // window wrote its state in full; a held window left all of its updates pending, its owed ones applied
        // and written; a plain verify changed nothing
        for s in &live {
            if s.hold {
                self.owes[s.slot] = 0;
                self.held[s.slot] = s.len;
                self.held_rows[s.slot] = qkv[s.start * c_n..(s.start + s.len) * c_n].to_vec();
            } else if s.commit_at > 0 {
                self.owes[s.slot] = usize::from(kernels::defers_update(s.len, s.commit_at));
            }
        }

        // Phase 3: rows of y, and the planes, in the output's dtype.
        let heads_y = &*heads_y;
        let mut row_seq = vec![usize::MAX; checked.rows];
        for (i, s) in live.iter().enumerate() {
            row_seq[s.start..s.start + s.len].fill(i);
        }
        let fill_row = |row: usize, y: &mut [f32]| {
            let s = &live[row_seq[row]];
            let tok = row - s.start;
            for h in 0..h_v {
                let src = &heads_y[s.y + (h * s.len + tok) * d..][..d];
                y[h * d..(h + 1) * d].copy_from_slice(src);
            }
        };
        let is_live = |row: usize| row_seq[row] != usize::MAX;
        match out {
            TensorMut::F32(o) => write_rows(o, checked.layout, &is_live, &fill_row),
            TensorMut::Bf16(o) => write_rows(o, checked.layout, &is_live, &fill_row),
            TensorMut::F16(o) => write_rows(o, checked.layout, &is_live, &fill_row),
        }
    }
}

/// An element of an output buffer: f32, bf16 or f16, rounded once from the f32 result.
trait OutElem: Copy + Send + Sync {
    fn from_f32(x: f32) -> Self;
    /// The buffer itself where it is f32 (y is then written in place, with no copy).
    fn as_f32(_: &mut [Self]) -> Option<&mut [f32]> {
        None
    }
}
impl OutElem for f32 {
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
    fn as_f32(x: &mut [f32]) -> Option<&mut [f32]> {
        Some(x)
    }
}
impl OutElem for half::bf16 {
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        half::bf16::from_f32(x)
    }
}
impl OutElem for half::f16 {
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        half::f16::from_f32(x)
    }
}

/// The live rows of the output (`fill_row` gives a row's y in f32), and with planes their prepared copies and
/// group sums, each rounded once to the output's element.
fn write_rows<T: OutElem>(
    out: &mut [T],
    layout: OutputLayout,
    is_live: &(dyn Fn(usize) -> bool + Sync),
    fill_row: &(dyn Fn(usize, &mut [f32]) + Sync),
) {
    let n = layout.n;
    match layout.plane_stride {
        None => out[..layout.rows * n]
            .par_chunks_mut(n)
            .enumerate()
            .filter(|(r, _)| is_live(*r))
            .for_each_init(Vec::new, |tmp: &mut Vec<f32>, (r, dst)| {
                match T::as_f32(dst) {
                    Some(d) => fill_row(r, d),
                    None => {
                        tmp.resize(n, 0.0);
                        fill_row(r, tmp);
                        for (d, &s) in dst.iter_mut().zip(tmp.iter()) {
                            *d = T::from_f32(s);
                        }
                    }
                }
            }),
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
                .filter(|(r, _)| is_live(*r))
                .for_each_init(
                    || vec![0.0f32; n],
                    |y, (r, ((((dy, d1), d2), d3), gs))| {
                        // the planes read y in f32: the row goes through `y` whatever the output type
                        fill_row(r, y);
                        for (d, &s) in dy.iter_mut().zip(y.iter()) {
                            *d = T::from_f32(s);
                        }
                        for m in 0..n {
                            d1[m] = T::from_f32(y[m] * crate::plane_scale(1, m));
                            d2[m] = T::from_f32(y[m] * crate::plane_scale(2, m));
                            d3[m] = T::from_f32(y[m] * crate::plane_scale(3, m));
                        }
                        for (q, g) in y.chunks_exact(16).enumerate() {
                            let (mut even, mut odd) = (0.0f32, 0.0f32);
                            for e in (0..16).step_by(2) {
                                even += g[e];
                                odd += g[e + 1];
                            }
                            gs[q] = T::from_f32(even + odd);
                        }
                    },
                );
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

/// One value head of one sequence for the recurrence phase: its state, its pending updates and how many of them
/// the state owes, and its outputs [t][d].
struct HeadTask<'s, E: StateElem> {
    seq: LiveSeq,
    h: usize,
    state: &'s mut [E::Row],
    pending: &'s mut [f32],
    owes: usize,
    y: &'s mut [f32],
}

/// Calls `f((i, h, j0), pool)` with the offset of each 16-column piece of each state row (value head h, row i,
/// columns j0..j0 + 16) in the CPU pool's layout [h][j / 16][i][16]: each head's state is one contiguous slice its
/// task owns, and each 16-column block of it is contiguous, rows in order, so the block streams from memory and
/// stays in L1 over a window.
fn for_each_row(sh: &crate::Shape, mut f: impl FnMut((usize, usize, usize), usize)) {
    let d = sh.d;
    for i in 0..d {
        for h in 0..sh.h_v {
            for j0 in (0..d).step_by(LANES) {
                f((i, h, j0), h * d * d + j0 * d + i * LANES);
            }
        }
    }
}

/// The pool's state buffer as rows of `E` (16 f32 values, or 16 bf16 in 8 words: both whole numbers of the f32s a
/// `LineVec` holds, since a slot's state is d x h_v x d with d a multiple of 16).
fn rows_of<E: StateElem>(state: &mut [f32]) -> &mut [E::Row] {
    bytemuck::cast_slice_mut(state)
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

    fn options(&self) -> PoolOptions {
        self.options
    }

    fn write_slot(&mut self, slot: usize, state: &[f32], hist: &[f32]) -> Result<()> {
        check_slot_io(&self.layer, self.slots, slot, state.len(), hist.len())?;
        match self.options.state {
            DType::Bf16 => self.write_state::<Bf16>(slot, state),
            _ => self.write_state::<f32>(slot, state),
        }
        self.owes[slot] = 0;
        self.held[slot] = 0;
        let hl = hist.len();
        self.hist[slot * hl..(slot + 1) * hl].copy_from_slice(&to_lanes(hist, 3));
        Ok(())
    }

    fn read_slot(&mut self, slot: usize, state: &mut [f32], hist: &mut [f32]) -> Result<()> {
        check_slot_io(&self.layer, self.slots, slot, state.len(), hist.len())?;
        match self.options.state {
            DType::Bf16 => self.read_state::<Bf16>(slot, state),
            _ => self.read_state::<f32>(slot, state),
        }
        let hl = hist.len();
        hist.copy_from_slice(&from_lanes(&self.hist[slot * hl..(slot + 1) * hl], 3));
        Ok(())
    }

    fn check_step(&self, step: &Step<'_>, out_len: usize) -> Result<()> {
        step.validate(&self.layer, self.slots, out_len)?;
        self.no_held(step)
    }

    fn step_varlen(&mut self, step: &Step<'_>, out: TensorMut<'_>) -> Result<()> {
        let checked = step.validate(&self.layer, self.slots, out.len())?;
        self.no_held(step)?;
        self.run(step, &checked, out, false);
        Ok(())
    }

    fn step_spec(&mut self, step: &Step<'_>, accept: &[usize], out: TensorMut<'_>) -> Result<()> {
        let checked = step.validate(&self.layer, self.slots, out.len())?;
        let held = |slot| self.held[slot];
        crate::spec::check_spec(
            step,
            &checked.commit_at,
            accept,
            held,
            kernels::MAX_HELD,
            "the CPU",
        )?;
        // every check passed: accept the held prefixes (owed by the stored S from now on, applied by the
        // window's first read), then make room for the windows to be held
        for (s, &a) in step.seqs.iter().zip(accept) {
            if s.slot >= 0 {
                self.accept_held(s.slot as usize, a);
            }
        }
        for (s, &at) in step.seqs.iter().zip(&checked.commit_at) {
            if s.slot >= 0 && at == 0 {
                self.fit_pending(s.slot as usize, s.len);
            }
        }
        self.run(step, &checked, out, true);
        Ok(())
    }

    fn held(&self, slot: usize) -> usize {
        self.held.get(slot).copied().unwrap_or(0)
    }

    fn commit_held(&mut self, slot: usize, accept: usize) -> Result<()> {
        crate::spec::check_commit_held(slot, self.slots, accept, self.held(slot))?;
        self.accept_held(slot, accept);
        Ok(())
    }

    fn reset_slot(&mut self, slot: usize) -> Result<()> {
        let sh = *self.layer.shape();
        self.write_slot(slot, &vec![0.0; sh.state_len()], &vec![0.0; sh.hist_len()])
    }

    fn copy_slot(&mut self, from: usize, to: usize) -> Result<()> {
        let sh = *self.layer.shape();
        let (mut st, mut hi) = (vec![0.0; sh.state_len()], vec![0.0; sh.hist_len()]);
        check_slot_io(&self.layer, self.slots, to, st.len(), hi.len())?;
        check_slot_io(&self.layer, self.slots, from, st.len(), hi.len())?;
        if from == to {
            return Ok(());
        }
        self.read_slot(from, &mut st, &mut hi)?;
        self.write_slot(to, &st, &hi)?;
        // a fork keeps the held window (the stored S of a slot holding one owes nothing)
        if self.held[from] > 0 {
            self.pending[to] = self.pending[from].clone();
            self.held[to] = self.held[from];
            self.held_rows[to] = self.held_rows[from].clone();
        }
        Ok(())
    }
}

impl CpuPool {
    /// A plain step may not name a slot that holds a window.
    fn no_held(&self, step: &Step<'_>) -> Result<()> {
        for s in step.seqs.iter().filter(|s| s.slot >= 0) {
            let h = self.held[s.slot as usize];
            if h > 0 {
                return Err(crate::spec::held_error(s.slot as usize, h));
            }
        }
        Ok(())
    }

    fn run(&mut self, step: &Step<'_>, checked: &Checked, out: TensorMut<'_>, spec: bool) {
        // the whole step on one pool thread: its phases' parallel loops then split work among the pool's threads
        // without a hand-off from the calling thread for each
        let threads = self.threads.clone();
        let mut state = std::mem::take(&mut self.state);
        in_pool(&threads, || match self.options.state {
            DType::Bf16 => {
                self.run_step::<Bf16>(rows_of::<Bf16>(&mut state), step, checked, out, spec)
            }
            _ => self.run_step::<f32>(rows_of::<f32>(&mut state), step, checked, out, spec),
        });
        self.state = state;
    }

    /// The first `a` tokens of the window held on `slot` become owed by its stored S (the next read applies
    /// them) and its history takes their inputs; the rest of the window is dropped. Nothing held: no change.
    fn accept_held(&mut self, slot: usize, a: usize) {
        let h = std::mem::take(&mut self.held[slot]);
        if h == 0 {
            return;
        }
        self.owes[slot] = a;
        let sh = *self.layer.shape();
        let c_n = sh.channels();
        let rows = std::mem::take(&mut self.held_rows[slot]);
        let hl = sh.hist_len();
        let hist = &mut self.hist[slot * hl..(slot + 1) * hl];
        // the history in lanes of 16 channels: [c / 16][3][16]; shift each accepted token's input in
        for row in rows.chunks_exact(c_n).take(a) {
            for (c, &x) in row.iter().enumerate() {
                let (g, l) = (c / LANES, c % LANES);
                let at = g * 3 * LANES + l;
                hist[at] = hist[at + LANES];
                hist[at + LANES] = hist[at + 2 * LANES];
                hist[at + 2 * LANES] = x;
            }
        }
    }

    /// Floats of a held window in [`CpuPool::save_held`]'s form at `shape`: its length, then per value head and
    /// token its update (gate, k, delta), then its rows of qkv, for windows of up to [`kernels::MAX_HELD`] tokens.
    pub fn held_floats(shape: &crate::Shape) -> usize {
        1 + kernels::MAX_HELD * (shape.h_v * kernels::pending_len(shape.d) + shape.channels())
    }

    /// Writes the window `slot` holds into `out` (an opaque form for [`CpuPool::load_held`], at least
    /// [`CpuPool::held_floats`] floats), so that a caller who keeps the states (the Python package's CPU path,
    /// which stages slots through a scratch pool) can keep the held window too. Returns its length (0: nothing
    /// held; `out[0]` is then 0 and the rest untouched).
    pub fn save_held(&self, slot: usize, out: &mut [f32]) -> Result<usize> {
        let sh = *self.layer.shape();
        let need = Self::held_floats(&sh);
        if slot >= self.slots || out.len() < need {
            return Err(crate::Error::Param {
                name: "held",
                why: format!(
                    "slot {slot} of {} and {} floats (a held window takes {need})",
                    self.slots,
                    out.len()
                ),
            });
        }
        let t = self.held[slot];
        out[0] = t as f32;
        let pl = kernels::pending_len(sh.d);
        let pend = &self.pending[slot];
        let cap = pend.len() / (sh.h_v * pl);
        let mut at = 1;
        for h in 0..sh.h_v {
            out[at..at + t * pl].copy_from_slice(&pend[h * cap * pl..(h * cap + t) * pl]);
            at += t * pl;
        }
        let rows = &self.held_rows[slot];
        out[at..at + rows.len()].copy_from_slice(rows);
        Ok(t)
    }

    /// Makes `slot` hold the window `data` describes ([`CpuPool::save_held`]'s form, from a pool of the same
    /// layer and options; a length of 0 holds nothing). The slot's stored state is the held window's committed
    /// state (write it first with `write_slot`, which drops what the slot held).
    pub fn load_held(&mut self, slot: usize, data: &[f32]) -> Result<()> {
        let sh = *self.layer.shape();
        let bad = |why: String| crate::Error::Param { name: "held", why };
        if slot >= self.slots {
            return Err(bad(format!(
                "slot {slot} is out of range ({} slots)",
                self.slots
            )));
        }
        let t = match data.first() {
            Some(&x) if x >= 0.0 && x <= kernels::MAX_HELD as f32 && x.fract() == 0.0 => x as usize,
            _ => {
                return Err(bad(format!(
                    "a held window's data starts with its length, 0..={} tokens",
                    kernels::MAX_HELD
                )))
            }
        };
        let pl = kernels::pending_len(sh.d);
        let c_n = sh.channels();
        let need = 1 + t * (sh.h_v * pl + c_n);
        if data.len() < need {
            return Err(bad(format!(
                "{} floats for a held window of {t} tokens, which takes {need}",
                data.len()
            )));
        }
        self.owes[slot] = 0;
        self.held[slot] = 0;
        if t == 0 {
            return Ok(());
        }
        self.fit_pending(slot, t);
        let cap = self.pending[slot].len() / (sh.h_v * pl);
        let mut at = 1;
        for h in 0..sh.h_v {
            self.pending[slot][h * cap * pl..(h * cap + t) * pl]
                .copy_from_slice(&data[at..at + t * pl]);
            at += t * pl;
        }
        self.held_rows[slot] = data[at..at + t * c_n].to_vec();
        self.held[slot] = t;
        Ok(())
    }

    /// Grows `slot`'s pending region to hold `n` updates per head, keeping the ones there.
    fn fit_pending(&mut self, slot: usize, n: usize) {
        let sh = *self.layer.shape();
        let pl = kernels::pending_len(sh.d);
        let old = &self.pending[slot];
        let cap = old.len() / (sh.h_v * pl);
        if cap >= n {
            return;
        }
        let mut new = LineVec::default();
        new.resize(sh.h_v * n * pl);
        for h in 0..sh.h_v {
            new[h * n * pl..(h * n + cap) * pl]
                .copy_from_slice(&old[h * cap * pl..(h + 1) * cap * pl]);
        }
        self.pending[slot] = new;
    }
}
