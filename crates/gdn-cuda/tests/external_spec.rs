//! The speculative step on memory the caller owns (`CudaLayer::step_spec_raw`, `commit_held_raw`) against the
//! pool's one-pass `step_spec` (`CudaPool`), bitwise: every step's output, and every slot's committed state,
//! history and held length, over hundreds of random steps (windows 1..=8, random acceptances, held, committing
//! and skipped sequences side by side, commit-what-is-pending, forks and resets done the engine's way), f32 and
//! bf16 states in both layouts, f32 and bf16 activations and conv states, a head over a cluster of two blocks;
//! graph replays; bad input rejected (host) or skipped and reported (device) with nothing changed. The engine's
//! buffers are allocated here with cudarc. Without a GPU, driver or libnvrtc every test is skipped with a
//! message on stderr.

use gdn::synth::Synth;
use gdn::{
    Commit, Config, DType, Layer, LayerPool, PoolOptions, RowsData, Seq, Shape, StateLayout, Step,
    TensorData,
};
use gdn_cuda::cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use gdn_cuda::{
    pending_bytes, pending_row_bytes, Cuda, CudaLayer, CudaPool, RawConv, RawSpec, RawState,
    RawStep, RawTensor, SeqRows,
};
use std::sync::Arc;

mod common;

/// The backend with the window kernel off (the pool's speculative step needs the token-serial kernels).
fn cuda_or_skip(test: &str) -> Option<Cuda> {
    common::cuda_or_skip(test).map(|mut c| {
        c.set_window_kernel(false);
        c
    })
}

fn bytes_of(t: &TensorData) -> Vec<u8> {
    match t {
        TensorData::F32(x) => x.iter().flat_map(|v| v.to_le_bytes()).collect(),
        TensorData::Bf16(x) => x.iter().flat_map(|v| v.to_bits().to_le_bytes()).collect(),
        TensorData::F16(x) => x.iter().flat_map(|v| v.to_bits().to_le_bytes()).collect(),
    }
}

fn elt(dt: DType, x: f32) -> Vec<u8> {
    match dt {
        DType::F32 => x.to_le_bytes().to_vec(),
        DType::Bf16 => gdn::bf16::from_f32(x).to_bits().to_le_bytes().to_vec(),
        DType::F16 => gdn::f16::from_f32(x).to_bits().to_le_bytes().to_vec(),
    }
}

fn widen(dt: DType, b: &[u8]) -> Vec<u32> {
    match dt {
        DType::F32 => b
            .chunks(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        DType::Bf16 => b
            .chunks(2)
            .map(|c| {
                gdn::bf16::from_bits(u16::from_le_bytes(c.try_into().unwrap()))
                    .to_f32()
                    .to_bits()
            })
            .collect(),
        DType::F16 => b
            .chunks(2)
            .map(|c| {
                gdn::f16::from_bits(u16::from_le_bytes(c.try_into().unwrap()))
                    .to_f32()
                    .to_bits()
            })
            .collect(),
    }
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

fn ints(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

#[derive(Clone, Copy, Debug)]
struct Case {
    name: &'static str,
    shape: Shape,
    state: PoolOptions,
    io: DType,
    conv: DType,
    slots: usize,
    steps: usize,
}

const STATE: usize = 0;
const CONV: usize = 1;
const PEND: usize = 2;
const HELD: usize = 3;

/// The engine's buffers: state pool `[slot][d * h_v * d]`, conv state `[slot][C][3]`, the pending region and
/// the held words (`i32 [slot]`), all owned here, in that order.
struct Engine {
    s: Arc<CudaStream>,
    layer: CudaLayer,
    c: Case,
    bufs: [CudaSlice<u8>; 4],
}

fn addr(s: &Arc<CudaStream>, b: &CudaSlice<u8>) -> u64 {
    b.device_ptr(s).0
}

impl Engine {
    fn new(cuda: &Cuda, layer: &Layer, c: Case, init: &[(Vec<f32>, Vec<f32>)]) -> Engine {
        let s = cuda.context().new_stream().unwrap();
        let mut st = Vec::new();
        let mut cv = Vec::new();
        for (x, h) in init {
            st.extend(x.iter().flat_map(|&v| elt(c.state.state, v)));
            cv.extend(h.iter().flat_map(|&v| elt(c.conv, v)));
        }
        let pl = pending_bytes(&c.shape, c.slots).unwrap();
        assert_eq!(pl, c.slots * pending_row_bytes(&c.shape).unwrap());
        let bufs = [
            s.clone_htod(&st).unwrap(),
            s.clone_htod(&cv).unwrap(),
            s.alloc_zeros::<u8>(pl).unwrap(),
            s.alloc_zeros::<u8>(4 * c.slots).unwrap(),
        ];
        Engine {
            layer: CudaLayer::new(cuda, layer, 16).unwrap(),
            bufs,
            s,
            c,
        }
    }

    fn ptr(&self, which: usize) -> u64 {
        addr(&self.s, &self.bufs[which])
    }

    fn raw_state(&self) -> RawState {
        RawState {
            ptr: self.ptr(STATE),
            dtype: self.c.state.state,
            layout: self.c.state.layout,
            slots: self.c.slots,
            slot_stride: self.c.shape.state_len(),
        }
    }

    fn raw_conv(&self) -> RawConv {
        RawConv {
            ptr: self.ptr(CONV),
            dtype: self.c.conv,
            width: 3,
            slot_stride: 3 * self.c.shape.channels(),
            chan_stride: 3,
            col_stride: 1,
        }
    }

    fn spec(&self, accept: u64) -> RawSpec {
        RawSpec {
            pending: self.ptr(PEND),
            held: self.ptr(HELD),
            accept,
        }
    }

    fn down(&self, which: usize) -> Vec<u8> {
        let b = &self.bufs[which];
        let mut v = vec![0u8; b.len()];
        self.s.memcpy_dtoh(b, &mut v).unwrap();
        self.s.synchronize().unwrap();
        v
    }

    /// Everything the engine owns, as bytes.
    fn snapshot(&self) -> Vec<Vec<u8>> {
        (0..4).map(|w| self.down(w)).collect()
    }

    fn held_lens(&self) -> Vec<usize> {
        self.down(HELD)
            .chunks(4)
            .map(|c| (i32::from_le_bytes(c.try_into().unwrap()) & 0xff) as usize)
            .collect()
    }

    /// Bytes of one slot's row of each buffer.
    fn row(&self, which: usize) -> usize {
        let sh = self.c.shape;
        match which {
            STATE => sh.state_len() * self.c.state.state.size(),
            CONV => sh.hist_len() * self.c.conv.size(),
            PEND => pending_row_bytes(&sh).unwrap(),
            _ => 4,
        }
    }

    /// Slot `i`'s state (f32 bits) and history (SPEC's [C][3], f32 bits).
    fn read(&self, i: usize) -> (Vec<u32>, Vec<u32>) {
        let (rs, rc) = (self.row(STATE), self.row(CONV));
        (
            widen(self.c.state.state, &self.down(STATE)[i * rs..(i + 1) * rs]),
            widen(self.c.conv, &self.down(CONV)[i * rc..(i + 1) * rc]),
        )
    }

    /// A fork the engine's way: slot `from`'s state, conv, held word and pending rows copied to `to`.
    fn fork(&mut self, from: usize, to: usize) {
        for w in 0..4 {
            let r = self.row(w);
            let src = self.down(w)[from * r..(from + 1) * r].to_vec();
            self.s
                .memcpy_htod(&src, &mut self.bufs[w].slice_mut(to * r..(to + 1) * r))
                .unwrap();
        }
        self.s.synchronize().unwrap();
    }

    /// A reset the engine's way: the slot's state and conv rows zeroed, its held word zeroed (the held
    /// window dropped; its pending row may keep what it had).
    fn reset(&mut self, slot: usize) {
        for w in [STATE, CONV, HELD] {
            let r = self.row(w);
            self.s
                .memset_zeros(&mut self.bufs[w].slice_mut(slot * r..(slot + 1) * r))
                .unwrap();
        }
        self.s.synchronize().unwrap();
    }
}

/// One step's device arrays and rows, kept alive while it runs.
struct Staged {
    _keep: Vec<CudaSlice<u8>>,
    out: CudaSlice<u8>,
    step: RawStep,
    accept: u64,
}

fn stage(
    e: &Engine,
    rows: &RowsData,
    r: usize,
    seqs: &[Seq],
    accept: &[usize],
    uniform: bool,
) -> Staged {
    let commits: Vec<i32> = seqs.iter().map(|q| q.commit_at().unwrap() as i32).collect();
    stage_with(e, rows, r, seqs, &commits, accept, uniform)
}

/// `stage` with the commit points given as the device will see them.
fn stage_with(
    e: &Engine,
    rows: &RowsData,
    r: usize,
    seqs: &[Seq],
    commits: &[i32],
    accept: &[usize],
    uniform: bool,
) -> Staged {
    let s = &e.s;
    let sh = e.c.shape;
    let up = |b: Vec<u8>| s.clone_htod(&b).unwrap();
    let bufs = [
        up(bytes_of(&rows.qkv)),
        up(bytes_of(&rows.alpha)),
        up(bytes_of(&rows.beta)),
        up(bytes_of(&rows.z)),
        up(ints(&seqs.iter().map(|q| q.slot).collect::<Vec<_>>())),
        up(ints(
            &seqs.iter().map(|q| q.start as i32).collect::<Vec<_>>(),
        )),
        up(ints(&seqs.iter().map(|q| q.len as i32).collect::<Vec<_>>())),
        up(ints(commits)),
        up(ints(&accept.iter().map(|&a| a as i32).collect::<Vec<_>>())),
    ];
    let out = s.alloc_zeros::<u8>(4 * r.max(1) * sh.n()).unwrap();
    let p = |i: usize| addr(s, &bufs[i]);
    let t = |i: usize, w: usize| RawTensor {
        ptr: p(i),
        dtype: e.c.io,
        row_stride: w,
    };
    let len0 = seqs[0].len;
    let step = RawStep {
        rows: r,
        qkv: t(0, sh.channels()),
        alpha: t(1, sh.h_v),
        beta: t(2, sh.h_v),
        z: t(3, sh.n()),
        out: RawTensor {
            ptr: addr(s, &out),
            dtype: DType::F32,
            row_stride: sh.n(),
        },
        plane_stride: None,
        state: e.raw_state(),
        conv: e.raw_conv(),
        seqs: seqs.len(),
        slot: p(4),
        seq_rows: SeqRows::StartLen {
            start: p(5),
            len: p(6),
        },
        commit_at: Some(p(7)),
        uniform_len: (uniform && seqs.iter().all(|q| q.len == len0) && len0 <= 8).then_some(len0),
        commits: true,
        max_len: None,
    };
    Staged {
        accept: p(8),
        _keep: bufs.into(),
        out,
        step,
    }
}

fn rows_of(rng: &mut Synth, layer: &Layer, r: usize, io: DType) -> RowsData {
    let b = rng.batch(layer, r, 1);
    RowsData::from_f32(&b.qkv, &b.alpha, &b.beta, &b.z, [io; 4])
}

fn init_states(rng: &mut Synth, layer: &Layer, c: &Case) -> Vec<(Vec<f32>, Vec<f32>)> {
    (0..c.slots)
        .map(|_| {
            let (st, mut h) = rng.seq_state(layer);
            // the conv state holds what its dtype holds; the pool gets the same values
            h.iter_mut().for_each(|x| *x = c.conv.round(*x));
            (st, h)
        })
        .collect()
}

fn compare_slots(pool: &mut CudaPool, e: &Engine, what: &str) {
    let sh = e.c.shape;
    let held = e.held_lens();
    for (i, &h) in held.iter().enumerate() {
        let (mut st, mut hi) = (vec![0.0; sh.state_len()], vec![0.0; sh.hist_len()]);
        pool.read_slot(i, &mut st, &mut hi).unwrap();
        let (est, ehi) = e.read(i);
        assert!(
            bits(&st) == est,
            "{}: {what}: slot {i} state differs",
            e.c.name
        );
        assert!(
            bits(&hi) == ehi,
            "{}: {what}: slot {i} history differs",
            e.c.name
        );
        assert_eq!(
            h,
            pool.held(i),
            "{}: {what}: slot {i} held length",
            e.c.name
        );
    }
}

/// One case: `c.steps` random speculative steps on the pool and on the engine's buffers, compared bitwise.
fn run_case(cuda: &Cuda, c: Case, seed: u64) {
    let mut rng = Synth::new(seed);
    let layer = rng.layer(Config::new(c.shape)).unwrap();
    let init = init_states(&mut rng, &layer, &c);
    let mut pool = cuda.create_cuda_pool(&layer, c.slots, c.state).unwrap();
    for (i, (st, h)) in init.iter().enumerate() {
        pool.write_slot(i, st, h).unwrap();
    }
    let mut e = Engine::new(cuda, &layer, c, &init);
    compare_slots(&mut pool, &e, "initial");
    let sh = c.shape;
    let (mut held_steps, mut accepted, mut forks, mut resets, mut commits_held) = (0, 0, 0, 0, 0);
    for step_i in 0..c.steps {
        // a random set of distinct slots, one sequence each, windows 1..=8, and maybe a skipped one
        let mut slots: Vec<usize> = (0..c.slots).collect();
        for i in (1..slots.len()).rev() {
            slots.swap(i, rng.index(0, i));
        }
        let n = rng.index(1, c.slots.min(4));
        let mut seqs = Vec::new();
        let mut accept = Vec::new();
        let mut r = 0;
        let uniform_len = rng.index(0, 3) == 0;
        let ulen = rng.index(1, 8);
        for (k, &slot) in slots.iter().take(n).enumerate() {
            r += rng.index(0, 1); // a row no sequence covers, now and then
            let len = if uniform_len { ulen } else { rng.index(1, 8) };
            let commit = match rng.index(0, 9) {
                0..=5 => Commit::Verify,
                6 => Commit::All,
                _ => Commit::First(rng.index(1, len)),
            };
            let h = pool.held(slot);
            let a = match rng.index(0, 3) {
                0 => 0,
                1 => h,
                _ => rng.index(0, h),
            };
            let skipped = k == 1 && rng.index(0, 5) == 0;
            seqs.push(Seq {
                slot: if skipped { -1 } else { slot as i32 },
                start: r,
                len,
                commit,
            });
            accept.push(if skipped { 0 } else { a });
            if !skipped {
                held_steps += (commit == Commit::Verify) as usize;
                accepted += a;
            }
            r += len;
        }
        r += rng.index(0, 2);
        let rows = rows_of(&mut rng, &layer, r, c.io);
        let mut out = TensorData::filled(r * sh.n(), 0.0, DType::F32);
        let step = Step {
            rows: rows.view(),
            seqs: &seqs,
            plane_stride: None,
        };
        pool.step_spec(&step, &accept, out.view_mut()).unwrap();
        let st = stage(&e, &rows, r, &seqs, &accept, uniform_len);
        // SAFETY: every address is a live allocation of this context with the extents the step names; the
        // slots are distinct; nothing the step writes overlaps anything else; the stream is the engine's.
        unsafe {
            e.layer
                .step_spec_raw(&st.step, &e.spec(st.accept), e.s.cu_stream())
                .unwrap()
        };
        let mut y = vec![0u8; st.out.len()];
        e.s.memcpy_dtoh(&st.out, &mut y).unwrap();
        e.s.synchronize().unwrap();
        let y = widen(DType::F32, &y);
        let py = bits(&out.to_f32());
        assert!(
            py[..] == y[..r * sh.n()],
            "{}: step {step_i}: the outputs differ ({seqs:?}, accept {accept:?})",
            c.name
        );
        drop(st);
        // the engine's own slot operations, mirrored on the pool
        match rng.index(0, 19) {
            0 | 1 => {
                // commit what is pending on the slots that hold a window
                let lens = e.held_lens();
                let holding: Vec<usize> = (0..c.slots).filter(|&i| lens[i] > 0).collect();
                if !holding.is_empty() {
                    let ks: Vec<usize> = holding.iter().map(|&i| rng.index(0, lens[i])).collect();
                    for (&i, &k) in holding.iter().zip(&ks) {
                        pool.commit_held(i, k).unwrap();
                    }
                    let sl =
                        e.s.clone_htod(&ints(
                            &holding.iter().map(|&i| i as i32).collect::<Vec<_>>(),
                        ))
                        .unwrap();
                    let ac =
                        e.s.clone_htod(&ints(&ks.iter().map(|&k| k as i32).collect::<Vec<_>>()))
                            .unwrap();
                    // SAFETY: as above; no rows.
                    unsafe {
                        e.layer
                            .commit_held_raw(
                                &e.raw_state(),
                                &e.raw_conv(),
                                &e.spec(addr(&e.s, &ac)),
                                holding.len(),
                                addr(&e.s, &sl),
                                e.s.cu_stream(),
                            )
                            .unwrap()
                    };
                    e.s.synchronize().unwrap();
                    commits_held += holding.len();
                }
            }
            2 => {
                let (a, b) = (rng.index(0, c.slots - 1), rng.index(0, c.slots - 1));
                pool.copy_slot(a, b).unwrap();
                if a != b {
                    e.fork(a, b);
                }
                forks += 1;
            }
            3 => {
                let a = rng.index(0, c.slots - 1);
                pool.reset_slot(a).unwrap();
                e.reset(a);
                resets += 1;
            }
            _ => {}
        }
        if step_i % 8 == 7 || step_i + 1 == c.steps {
            compare_slots(&mut pool, &e, &format!("after step {step_i}"));
        } else {
            let lens = e.held_lens();
            for (i, &l) in lens.iter().enumerate() {
                assert_eq!(
                    l,
                    pool.held(i),
                    "{}: step {step_i}: slot {i} held length",
                    c.name
                );
            }
        }
    }
    e.layer.take_fault().unwrap();
    pool.take_fault().unwrap();
    println!(
        "ok: {}: {} steps bitwise ({held_steps} windows held, {accepted} tokens accepted, {commits_held} \
         commit-held, {forks} forks, {resets} resets)",
        c.name, c.steps
    );
}

fn small() -> Shape {
    Shape::new(64, 2, 4).unwrap()
}

#[test]
fn the_external_speculative_step_is_bitwise_the_pools() {
    let Some(cuda) = cuda_or_skip("the_external_speculative_step_is_bitwise_the_pools") else {
        return;
    };
    let opt = |state, layout| PoolOptions { state, layout };
    let case = |name, shape, state, io, conv, steps| Case {
        name,
        shape,
        state,
        io,
        conv,
        slots: 6,
        steps,
    };
    let cases = [
        case(
            "f32 key-major, f32 io",
            small(),
            opt(DType::F32, StateLayout::KeyMajor),
            DType::F32,
            DType::F32,
            160,
        ),
        case(
            "f32 value-major, f32 io",
            small(),
            opt(DType::F32, StateLayout::ValueMajor),
            DType::F32,
            DType::F32,
            120,
        ),
        case(
            "bf16 value-major, bf16 io and conv",
            small(),
            opt(DType::Bf16, StateLayout::ValueMajor),
            DType::Bf16,
            DType::Bf16,
            160,
        ),
        case(
            "bf16 key-major, f32 io",
            small(),
            opt(DType::Bf16, StateLayout::KeyMajor),
            DType::F32,
            DType::F32,
            120,
        ),
        case(
            "seed shape, f32 value-major",
            Shape::SEED,
            opt(DType::F32, StateLayout::ValueMajor),
            DType::F32,
            DType::F32,
            40,
        ),
        case(
            "seed shape, bf16 value-major, bf16 io and conv",
            Shape::SEED,
            opt(DType::Bf16, StateLayout::ValueMajor),
            DType::Bf16,
            DType::Bf16,
            40,
        ),
        case(
            "d 256 over a cluster of two blocks",
            Shape::new(256, 2, 4).unwrap(),
            opt(DType::F32, StateLayout::KeyMajor),
            DType::F32,
            DType::F32,
            40,
        ),
    ];
    for (i, c) in cases.into_iter().enumerate() {
        run_case(&cuda, c, 1000 + i as u64);
    }
}

/// A speculative step captured once into a CUDA graph and replayed, the accepted counts rewritten on the device
/// between replays (as an engine computes them on the GPU): the same bits as the pool's steps.
#[test]
fn graph_replays_of_the_external_speculative_step_equal_the_pools_steps() {
    let Some(cuda) =
        cuda_or_skip("graph_replays_of_the_external_speculative_step_equal_the_pools_steps")
    else {
        return;
    };
    use gdn_cuda::cudarc::driver::sys;
    let c = Case {
        name: "graph",
        shape: small(),
        state: PoolOptions {
            state: DType::Bf16,
            layout: StateLayout::ValueMajor,
        },
        io: DType::F32,
        conv: DType::F32,
        slots: 4,
        steps: 0,
    };
    let mut rng = Synth::new(77);
    let layer = rng.layer(Config::new(c.shape)).unwrap();
    let init = init_states(&mut rng, &layer, &c);
    let mut pool = cuda.create_cuda_pool(&layer, c.slots, c.state).unwrap();
    for (i, (st, h)) in init.iter().enumerate() {
        pool.write_slot(i, st, h).unwrap();
    }
    let mut e = Engine::new(&cuda, &layer, c, &init);
    let sh = c.shape;
    // slots 2 and 0 hold a window of 3 every step; slot 3 commits 2 of its 4 tokens every step
    let seqs = [
        Seq {
            slot: 2,
            start: 0,
            len: 3,
            commit: Commit::Verify,
        },
        Seq {
            slot: 0,
            start: 3,
            len: 3,
            commit: Commit::Verify,
        },
        Seq {
            slot: 3,
            start: 6,
            len: 4,
            commit: Commit::First(2),
        },
    ];
    let r = 10;
    let rows = rows_of(&mut rng, &layer, r, c.io);
    let accepts = [[0, 0, 0], [2, 3, 0], [1, 0, 0], [3, 3, 0], [0, 2, 0]];
    let st = stage(&e, &rows, r, &seqs, &accepts[0], false);
    e.layer.prepare(&st.step.spec_kind()).unwrap();
    let mut acc_buf = e.s.clone_htod(&ints(&[0, 0, 0])).unwrap();
    let spec = e.spec(addr(&e.s, &acc_buf));
    e.s.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .unwrap();
    // SAFETY: as in `run_case`.
    let res = unsafe { e.layer.step_spec_raw(&st.step, &spec, e.s.cu_stream()) };
    let graph = e.s.end_capture(sys::CUgraphInstantiate_flags(0)).unwrap();
    res.unwrap();
    let graph = graph.expect("a graph");
    let mut out = TensorData::filled(r * sh.n(), 0.0, DType::F32);
    for a in &accepts {
        let acc: Vec<usize> = a.to_vec();
        let step = Step {
            rows: rows.view(),
            seqs: &seqs,
            plane_stride: None,
        };
        pool.step_spec(&step, &acc, out.view_mut()).unwrap();
        e.s.memcpy_htod(&ints(&a.map(|x| x as i32)), &mut acc_buf)
            .unwrap();
        graph.launch().unwrap();
        e.s.synchronize().unwrap();
        let mut y = vec![0u8; st.out.len()];
        e.s.memcpy_dtoh(&st.out, &mut y).unwrap();
        e.s.synchronize().unwrap();
        assert!(
            bits(&out.to_f32()) == widen(DType::F32, &y),
            "graph: outputs differ at {a:?}"
        );
        compare_slots(&mut pool, &e, &format!("graph replay with {a:?}"));
    }
    e.layer.take_fault().unwrap();
    let _ = &mut e;
    println!("ok: graph replays: {} steps bitwise", accepts.len());
}

/// Bad host-visible arguments of a speculative step are named errors and touch nothing; bad per-sequence values
/// (an accepted count above the held length, a held window above 16 tokens, a commit point past the window) are
/// skipped on the device, touch nothing and are reported by take_fault.
#[test]
fn bad_speculative_input_is_rejected_with_nothing_changed() {
    let Some(cuda) = cuda_or_skip("bad_speculative_input_is_rejected_with_nothing_changed") else {
        return;
    };
    let c = Case {
        name: "bad input",
        shape: small(),
        state: PoolOptions {
            state: DType::F32,
            layout: StateLayout::KeyMajor,
        },
        io: DType::F32,
        conv: DType::F32,
        slots: 4,
        steps: 0,
    };
    let mut rng = Synth::new(5);
    let layer = rng.layer(Config::new(c.shape)).unwrap();
    let init = init_states(&mut rng, &layer, &c);
    let e = Engine::new(&cuda, &layer, c, &init);
    // slot 1 holds a window of 2
    let seqs = [Seq {
        slot: 1,
        start: 0,
        len: 2,
        commit: Commit::Verify,
    }];
    let rows = rows_of(&mut rng, &layer, 20, c.io);
    let st = stage(&e, &rows, 20, &seqs, &[0], false);
    // SAFETY: as in `run_case`.
    unsafe {
        e.layer
            .step_spec_raw(&st.step, &e.spec(st.accept), e.s.cu_stream())
    }
    .unwrap();
    e.layer.take_fault().unwrap();
    assert_eq!(e.held_lens(), vec![0, 2, 0, 0]);
    let before = e.snapshot();
    let out_before = {
        let mut y = vec![0u8; st.out.len()];
        e.s.memcpy_dtoh(&st.out, &mut y).unwrap();
        e.s.synchronize().unwrap();
        y
    };
    let unchanged = |what: &str| {
        e.s.synchronize().unwrap();
        assert!(
            e.snapshot() == before,
            "{what}: the engine's buffers changed"
        );
        let mut y = vec![0u8; st.out.len()];
        e.s.memcpy_dtoh(&st.out, &mut y).unwrap();
        e.s.synchronize().unwrap();
        assert!(y == out_before, "{what}: the output changed");
    };
    // host-visible: named errors
    let good = e.spec(st.accept);
    let host_bad: Vec<(&str, RawStep, RawSpec)> = vec![
        (
            "commits",
            RawStep {
                commits: false,
                ..st.step
            },
            good,
        ),
        ("pending", st.step, RawSpec { pending: 0, ..good }),
        (
            "pending",
            st.step,
            RawSpec {
                pending: good.pending + 4,
                ..good
            },
        ),
        (
            "pending",
            st.step,
            RawSpec {
                pending: (i64::MAX as u64) & !15,
                ..good
            },
        ),
        ("held", st.step, RawSpec { held: 0, ..good }),
        (
            "held",
            st.step,
            RawSpec {
                held: good.held + 2,
                ..good
            },
        ),
        ("accept", st.step, RawSpec { accept: 0, ..good }),
        (
            "accept",
            st.step,
            RawSpec {
                accept: u64::MAX - 3,
                ..good
            },
        ),
        (
            "state.slot_stride",
            RawStep {
                state: RawState {
                    slot_stride: 3,
                    ..st.step.state
                },
                ..st.step
            },
            good,
        ),
    ];
    for (name, step, spec) in &host_bad {
        // SAFETY: the call must fail its host checks before touching anything.
        let r = unsafe { e.layer.step_spec_raw(step, spec, e.s.cu_stream()) };
        match r {
            Err(gdn::Error::Param { name: n, .. }) => assert_eq!(n, *name, "{r:?}"),
            other => panic!("{name}: expected a parameter error, got {other:?}"),
        }
        unchanged(name);
    }
    // commit_held_raw: too many sequences
    assert!(unsafe {
        // SAFETY: fails its checks first.
        e.layer
            .commit_held_raw(&e.raw_state(), &e.raw_conv(), &good, 17, 8, e.s.cu_stream())
    }
    .is_err());
    unchanged("commit_held_raw seqs");
    e.layer.take_fault().unwrap();
    // device-side: skipped and reported
    let dev_bad: Vec<(&str, Vec<Seq>, usize)> = vec![
        // 3 accepted of a held window of 2
        (
            "an accepted count above",
            vec![Seq {
                slot: 1,
                start: 0,
                len: 2,
                commit: Commit::Verify,
            }],
            3,
        ),
        // a window of 17 that would be held
        (
            "a held window longer than 16",
            vec![Seq {
                slot: 1,
                start: 0,
                len: 17,
                commit: Commit::Verify,
            }],
            1,
        ),
        // an accepted count on a slot that holds nothing
        (
            "an accepted count above",
            vec![Seq {
                slot: 2,
                start: 0,
                len: 2,
                commit: Commit::All,
            }],
            1,
        ),
    ];
    let mut dev_bad: Vec<(&str, Staged)> = dev_bad
        .iter()
        .map(|(what, seqs, a)| (*what, stage(&e, &rows, 20, seqs, &[*a], false)))
        .collect();
    // a commit point past the window (device data)
    dev_bad.push((
        "a commit point outside",
        stage_with(&e, &rows, 20, &seqs, &[5], &[0], false),
    ));
    // a length below 0 through cu-less start / len (a window of no rows is valid here: it only accepts)
    dev_bad.push((
        "rows outside",
        stage_with(
            &e,
            &rows,
            20,
            &[Seq {
                slot: 1,
                start: 19,
                len: 2,
                commit: Commit::Verify,
            }],
            &[0],
            &[0],
            false,
        ),
    ));
    for (what, bad) in &dev_bad {
        let step = RawStep {
            out: RawTensor {
                ptr: addr(&e.s, &st.out),
                ..bad.step.out
            },
            ..bad.step
        };
        // SAFETY: as in `run_case`; the bad values are device data, which the kernel bounds.
        unsafe {
            e.layer
                .step_spec_raw(&step, &e.spec(bad.accept), e.s.cu_stream())
        }
        .unwrap();
        let err = e.layer.take_fault().expect_err(what).to_string();
        assert!(err.contains(what), "{what}: {err}");
        unchanged(what);
    }
    println!(
        "ok: bad speculative input: {} host errors, {} device skips",
        host_bad.len(),
        dev_bad.len()
    );
}
