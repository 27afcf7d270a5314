//! The whole conformance suite on the CUDA backend, and the CUDA-specific checks; without a GPU, driver or
//! libnvrtc every test is skipped with a message on stderr.
gdn_conformance::conformance_tests!(
    || gdn_cuda::Cuda::new().map(|c| Box::new(c) as Box<dyn gdn::Backend>),
    quant: || gdn_cuda::Cuda::new().map(|c| Box::new(c) as Box<dyn gdn::quant::QuantBackend>)
);

use gdn::synth::Synth;
use gdn::{
    Commit, Config, DType, LayerPool, PoolOptions, RowsData, Seq, Shape, StateLayout, Step,
    TensorData,
};
use gdn_cuda::{Cuda, CudaPool, DeviceStep, DeviceTensor, DeviceTensorMut};

mod common;
use common::cuda_or_skip;

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

struct Setup {
    layer: gdn::Layer,
    init: Vec<(Vec<f32>, Vec<f32>)>,
    rows: RowsData,
}

fn setup(shape: Shape, slots: usize, rows: usize, io: DType, seed: u64) -> Setup {
    let mut rng = Synth::new(seed);
    let layer = rng.layer(Config::new(shape)).unwrap();
    let init = (0..slots).map(|_| rng.seq_state(&layer)).collect();
    let b = rng.batch(&layer, rows, 1);
    let rows = RowsData::from_f32(&b.qkv, &b.alpha, &b.beta, &b.z, [io; 4]);
    Setup { layer, init, rows }
}

fn pool(cuda: &Cuda, s: &Setup, opts: PoolOptions) -> CudaPool {
    let mut p = cuda.create_cuda_pool(&s.layer, s.init.len(), opts).unwrap();
    for (i, (st, h)) in s.init.iter().enumerate() {
        p.write_slot(i, st, h).unwrap();
    }
    p
}

fn slot_bits(p: &mut CudaPool) -> Vec<u32> {
    let sh = *p.layer().shape();
    let mut out = Vec::new();
    for i in 0..p.slots() {
        let (mut s, mut h) = (vec![0.0; sh.state_len()], vec![0.0; sh.hist_len()]);
        p.read_slot(i, &mut s, &mut h).unwrap();
        out.extend(bits(&s));
        out.extend(bits(&h));
    }
    out
}

fn run(p: &mut CudaPool, rows: &RowsData, seqs: &[Seq], planes: bool, out: DType) -> Vec<u32> {
    let sh = *p.layer().shape();
    let r = rows.view().count(&sh).unwrap();
    let stride = planes.then_some(r * sh.n() + 16);
    let len = gdn::OutputLayout::for_rows(&sh, r, stride).unwrap().len();
    let mut buf = TensorData::filled(len, 0.0, out);
    let step = Step {
        rows: rows.view(),
        seqs,
        plane_stride: stride,
    };
    p.step_varlen(&step, buf.view_mut()).unwrap();
    bits(&buf.to_f32())
}

/// A sequence's bits are the same whether it runs alone (uniform length: the compile-time-length kernel,
/// and for a bf16 state at T 1 the packed-register variant) or inside a call of mixed lengths (the
/// run-time-length kernel): y, planes and the committed state and history, for every window length 1..=9,
/// every commit kind, f32 and bf16 states, both layouts, bf16 and f16 activations.
#[test]
fn const_length_and_run_time_kernels_agree_bitwise() {
    let Some(cuda) = cuda_or_skip("const_length_and_run_time_kernels_agree_bitwise") else {
        return;
    };
    for (state, layout, io) in [
        (DType::F32, StateLayout::KeyMajor, DType::F32),
        (DType::Bf16, StateLayout::KeyMajor, DType::Bf16),
        (DType::F32, StateLayout::ValueMajor, DType::F16),
        (DType::Bf16, StateLayout::ValueMajor, DType::Bf16),
    ] {
        let opts = PoolOptions { state, layout };
        for shape in [Shape::SEED, Shape::new(32, 2, 4).unwrap()] {
            let lens = [1usize, 2, 3, 4, 5, 6, 7, 8, 9];
            let total: usize = lens.iter().sum();
            let s = setup(shape, lens.len() + 1, total + 2, io, 11);
            let mut seqs = Vec::new();
            let mut at = 1; // row 0 and the last row belong to no sequence
            for (i, &len) in lens.iter().enumerate() {
                let commit = match i % 3 {
                    0 => Commit::All,
                    1 => Commit::First(1 + i % len),
                    _ => Commit::Verify,
                };
                seqs.push(Seq {
                    slot: (lens.len() - i) as i32,
                    start: at,
                    len,
                    commit,
                });
                at += len;
            }
            let mut mixed = pool(&cuda, &s, opts);
            let y_mixed = run(&mut mixed, &s.rows, &seqs, true, io);
            let st_mixed = slot_bits(&mut mixed);
            let mut alone = pool(&cuda, &s, opts);
            let mut y_alone = vec![0u32; y_mixed.len()];
            let n = shape.n();
            let rows_total = total + 2;
            let stride = rows_total * n + 16;
            for q in &seqs {
                let y = run(&mut alone, &s.rows, std::slice::from_ref(q), true, io);
                // copy this sequence's rows of y, the planes and the group sums
                for plane in 0..4 {
                    let r = plane * stride + q.start * n..plane * stride + (q.start + q.len) * n;
                    y_alone[r.clone()].copy_from_slice(&y[r]);
                }
                let g = 4 * stride + q.start * n / 16..4 * stride + (q.start + q.len) * n / 16;
                y_alone[g.clone()].copy_from_slice(&y[g]);
            }
            assert_eq!(
                y_mixed, y_alone,
                "{opts:?} {io:?} {shape:?}: outputs differ"
            );
            assert_eq!(
                st_mixed,
                slot_bits(&mut alone),
                "{opts:?} {io:?} {shape:?}: states differ"
            );
        }
    }
}

/// The device-native step: the same call through `step_device` with and without the uniform-length hint,
/// and through `step_varlen`, gives the same bits (bf16 state, both layouts, bf16 activations, T 1 and 4). At
/// T 1 the call is large enough (7 sequences x 48 heads) that the hinted kernel stages the state through
/// shared memory, so this also checks the staged path against the register path of the run-time length.
#[test]
fn device_step_matches_host_step_bitwise() {
    let Some(cuda) = cuda_or_skip("device_step_matches_host_step_bitwise") else {
        return;
    };
    for layout in [StateLayout::KeyMajor, StateLayout::ValueMajor] {
        device_step_case(&cuda, layout);
    }
}

fn device_step_case(cuda: &Cuda, layout: StateLayout) {
    let opts = PoolOptions {
        state: DType::Bf16,
        layout,
    };
    for t in [1usize, 4] {
        let b = 8;
        let s = setup(Shape::SEED, b, b * t, DType::Bf16, 5 + t as u64);
        let seqs: Vec<Seq> = (0..b)
            .map(|i| Seq {
                slot: if i == 3 { -1 } else { i as i32 },
                start: i * t,
                len: t,
                commit: if i == 2 { Commit::Verify } else { Commit::All },
            })
            .collect();
        let mut host = pool(cuda, &s, opts);
        let y_host = run(&mut host, &s.rows, &seqs, false, DType::F32);
        let st_host = slot_bits(&mut host);
        for hint in [Some(t), None] {
            let mut dev = pool(cuda, &s, opts);
            let st = cuda.stream();
            let up = |x: &TensorData| match x {
                TensorData::Bf16(v) => st.clone_htod(v).unwrap(),
                _ => unreachable!(),
            };
            let (q, a, bb, z) = (
                up(&s.rows.qkv),
                up(&s.rows.alpha),
                up(&s.rows.beta),
                up(&s.rows.z),
            );
            let live: Vec<&Seq> = seqs.iter().filter(|q| q.slot >= 0).collect();
            let ints = |f: &dyn Fn(&Seq) -> i32| {
                st.clone_htod(&live.iter().map(|q| f(q)).collect::<Vec<i32>>())
                    .unwrap()
            };
            let slot = ints(&|q| q.slot);
            let start = ints(&|q| q.start as i32);
            let len = ints(&|q| q.len as i32);
            let commit = ints(&|q| q.commit.commit_at(q.len).unwrap() as i32);
            let (qv, av, bv, zv) = (q.as_view(), a.as_view(), bb.as_view(), z.as_view());
            let (sv, tv, lv, cv) = (
                slot.as_view(),
                start.as_view(),
                len.as_view(),
                commit.as_view(),
            );
            let n_out = b * t * Shape::SEED.n();
            let mut out = st.alloc_zeros::<f32>(n_out).unwrap();
            let ds = DeviceStep {
                rows: b * t,
                qkv: DeviceTensor::Bf16(&qv),
                alpha: DeviceTensor::Bf16(&av),
                beta: DeviceTensor::Bf16(&bv),
                z: DeviceTensor::Bf16(&zv),
                slot: &sv,
                start: &tv,
                len: &lv,
                commit_at: &cv,
                uniform_len: hint,
                commits: true,
                plane_stride: None,
            };
            dev.step_device(&ds, &mut DeviceTensorMut::F32(&mut out.as_view_mut()))
                .unwrap();
            let y = st.clone_dtoh(&out).unwrap();
            assert_eq!(bits(&y), y_host, "T {t} hint {hint:?}: outputs differ");
            assert_eq!(
                slot_bits(&mut dev),
                st_host,
                "T {t} hint {hint:?}: states differ"
            );
        }
    }
}

/// bf16/f16 activations, a bf16 state and the value-major layout against the float64 oracle (with its own
/// roundings), at the seed shape, mixed lengths: a coarse bound here; the suite holds the stated ones.
#[test]
fn dtypes_and_layouts_follow_the_oracle() {
    let Some(cuda) = cuda_or_skip("dtypes_and_layouts_follow_the_oracle") else {
        return;
    };
    for (state, layout, io, out, bound) in [
        (
            DType::F32,
            StateLayout::KeyMajor,
            DType::F32,
            DType::F32,
            1e-5,
        ),
        (
            DType::F32,
            StateLayout::ValueMajor,
            DType::F32,
            DType::F32,
            1e-5,
        ),
        (
            DType::Bf16,
            StateLayout::KeyMajor,
            DType::Bf16,
            DType::Bf16,
            1e-2,
        ),
        (
            DType::Bf16,
            StateLayout::ValueMajor,
            DType::F16,
            DType::F16,
            1e-2,
        ),
    ] {
        let opts = PoolOptions { state, layout };
        let lens = [1usize, 7, 1, 12];
        let total: usize = lens.iter().sum();
        let s = setup(Shape::SEED, 4, total, io, 3);
        let mut at = 0;
        let seqs: Vec<Seq> = lens
            .iter()
            .enumerate()
            .map(|(i, &len)| {
                let q = Seq {
                    slot: i as i32,
                    start: at,
                    len,
                    commit: if i == 1 {
                        Commit::First(3)
                    } else {
                        Commit::All
                    },
                };
                at += len;
                q
            })
            .collect();
        let sh = Shape::SEED;
        // the pool gets the initial states in its layout and dtype; the oracle the same values, key-major
        let mut p = cuda.create_cuda_pool(&s.layer, 4, opts).unwrap();
        let mut states = Vec::new();
        for (i, (st, h)) in s.init.iter().enumerate() {
            let rounded: Vec<f32> = st.iter().map(|&x| state.round(x)).collect();
            let pooled = StateLayout::KeyMajor.convert(layout, &sh, &rounded);
            p.write_slot(i, &pooled, h).unwrap();
            states.push(gdn::oracle::SeqState {
                s: rounded.iter().map(|&x| x as f64).collect(),
                h: h.iter().map(|&x| x as f64).collect(),
            });
        }
        let step = Step {
            rows: s.rows.view(),
            seqs: &seqs,
            plane_stride: None,
        };
        let mut buf = TensorData::filled(total * sh.n(), 0.0, out);
        p.step_varlen(&step, buf.view_mut()).unwrap();
        let want = gdn::oracle::step_varlen(&s.layer, &mut states, &step, state, out).unwrap();
        let got = buf.to_f32();
        let rel = |g: &[f32], w: &[f64]| {
            let num: f64 = g.iter().zip(w).map(|(&a, &b)| (a as f64 - b).powi(2)).sum();
            let den: f64 = w.iter().map(|b| b * b).sum();
            (num / den.max(1e-300)).sqrt()
        };
        let ey = rel(&got, &want);
        let mut es: f64 = 0.0;
        for (i, w) in states.iter().enumerate() {
            let (mut st, mut h) = (vec![0.0; sh.state_len()], vec![0.0; sh.hist_len()]);
            p.read_slot(i, &mut st, &mut h).unwrap();
            let km = layout.convert(StateLayout::KeyMajor, &sh, &st);
            es = es.max(rel(&km, &w.s));
        }
        eprintln!("{opts:?} io {io:?} out {out:?}: y rel err {ey:.2e}, state {es:.2e}");
        assert!(
            ey < bound && es < bound,
            "{opts:?} {io:?}: y {ey:e} state {es:e}"
        );
    }
}

/// A device-native step that names sequences out of range fails closed: those sequences (or their commit) are
/// skipped, the valid one runs as it would alone, and the pool's next host call reports every kind of fault
/// once, then works again.
#[test]
fn device_step_faults_are_reported_by_the_next_host_call() {
    let Some(cuda) = cuda_or_skip("device_step_faults_are_reported_by_the_next_host_call") else {
        return;
    };
    let shape = Shape::new(32, 1, 2).unwrap();
    let s = setup(shape, 3, 8, DType::F32, 41);
    // the valid sequence alone, through the host path
    let valid = Seq {
        slot: 0,
        start: 0,
        len: 2,
        commit: Commit::All,
    };
    let mut host = pool(&cuda, &s, PoolOptions::default());
    let y_host = run(&mut host, &s.rows, &[valid], false, DType::F32);
    let want = slot_bits(&mut host);
    let mut dev = pool(&cuda, &s, PoolOptions::default());
    let st = cuda.stream();
    let f = |x: &TensorData| match x {
        TensorData::F32(v) => st.clone_htod(v).unwrap(),
        _ => unreachable!(),
    };
    let (q, a, b, z) = (
        f(&s.rows.qkv),
        f(&s.rows.alpha),
        f(&s.rows.beta),
        f(&s.rows.z),
    );
    // slot 0 valid; slot 7 past the pool; rows 7..10 outside the 8 rows; slot 2 with a commit point of 5 > 2
    let ints = |v: &[i32]| st.clone_htod(v).unwrap();
    let (slot, start, len, commit) = (
        ints(&[0, 7, 1, 2]),
        ints(&[0, 2, 7, 4]),
        ints(&[2, 2, 3, 2]),
        ints(&[2, 2, 3, 5]),
    );
    let (qv, av, bv, zv) = (q.as_view(), a.as_view(), b.as_view(), z.as_view());
    let (sv, tv, lv, cv) = (
        slot.as_view(),
        start.as_view(),
        len.as_view(),
        commit.as_view(),
    );
    let mut out = st.alloc_zeros::<f32>(8 * shape.n()).unwrap();
    let ds = DeviceStep {
        rows: 8,
        qkv: DeviceTensor::F32(&qv),
        alpha: DeviceTensor::F32(&av),
        beta: DeviceTensor::F32(&bv),
        z: DeviceTensor::F32(&zv),
        slot: &sv,
        start: &tv,
        len: &lv,
        commit_at: &cv,
        uniform_len: None,
        commits: true,
        plane_stride: None,
    };
    dev.step_device(&ds, &mut DeviceTensorMut::F32(&mut out.as_view_mut()))
        .unwrap();
    let sh = shape;
    let (mut s0, mut h0) = (vec![0.0; sh.state_len()], vec![0.0; sh.hist_len()]);
    let err = dev.read_slot(0, &mut s0, &mut h0).unwrap_err();
    let msg = err.to_string();
    for what in [
        "a slot past the pool",
        "rows outside",
        "a commit point outside",
    ] {
        assert!(msg.contains(what), "the fault report lacks '{what}': {msg}");
    }
    // reported once; then the pool works, the valid sequence ran as alone, the others touched nothing
    dev.take_fault().unwrap();
    assert_eq!(
        slot_bits(&mut dev),
        want,
        "states after the faulty device step"
    );
    let y = st.clone_dtoh(&out).unwrap();
    let n = sh.n();
    assert_eq!(bits(&y[..2 * n]), y_host[..2 * n], "the valid sequence's y");
}

/// Pool sizes that overflow, or that the kernel's 32-bit slot index cannot reach, are errors before anything is
/// allocated, not wraps.
#[test]
fn pool_sizes_that_overflow_are_errors() {
    let Some(cuda) = cuda_or_skip("pool_sizes_that_overflow_are_errors") else {
        return;
    };
    let layer = Synth::new(3).layer(Config::new(Shape::SEED)).unwrap();
    for slots in [usize::MAX / 2, usize::MAX, 1 << 31] {
        match cuda.create_cuda_pool(&layer, slots, PoolOptions::default()) {
            Err(gdn::Error::Param { .. }) => {}
            Err(e) => panic!("{slots} slots: the wrong error: {e}"),
            Ok(_) => panic!("{slots} slots: a pool was made"),
        }
    }
}

/// The native speculative step against the two-pass flow on the same pool kind, bitwise (y with planes, every
/// slot's state and history), beyond the suite's cases: both state dtypes and layouts, 16-bit activations, a
/// tiled head map with the sigmoid gate, a head split over a cluster (d 256: the accepted history's
/// cross-block barrier), windows up to the 16 a slot holds, mixed held / committing / skipped sequences (every
/// third step all of one length: the kernel of a constant length, in three phases),
/// `commit_held` (the kernel's window-less sequence), forks and resets of slots holding windows.
#[test]
fn speculative_steps_are_bitwise_the_two_pass_flow_in_every_pool_kind() {
    let Some(mut cuda) =
        cuda_or_skip("speculative_steps_are_bitwise_the_two_pass_flow_in_every_pool_kind")
    else {
        return;
    };
    // the one-pass kernel replays token-serial windows (the window kernel's pools run the two-pass flow)
    cuda.set_window_kernel(false);
    let mut cases = Vec::new();
    for (state, layout, io) in [
        (DType::F32, StateLayout::KeyMajor, DType::F32),
        (DType::Bf16, StateLayout::KeyMajor, DType::Bf16),
        (DType::F32, StateLayout::ValueMajor, DType::F16),
        (DType::Bf16, StateLayout::ValueMajor, DType::Bf16),
    ] {
        cases.push((
            Config::new(Shape::new(32, 2, 4).unwrap()),
            state,
            layout,
            io,
            60,
        ));
    }
    let mut tiled = Config::new(Shape::new(64, 3, 12).unwrap());
    tiled.gate = gdn::Gate::Sigmoid;
    tiled.head_map = gdn::HeadMap::Tiled;
    cases.push((tiled, DType::Bf16, StateLayout::ValueMajor, DType::F32, 30));
    for state in [DType::F32, DType::Bf16] {
        cases.push((
            Config::new(Shape::new(256, 4, 8).unwrap()),
            state,
            StateLayout::KeyMajor,
            DType::F32,
            20,
        ));
    }
    cases.push((
        Config::new(Shape::SEED),
        DType::Bf16,
        StateLayout::ValueMajor,
        DType::Bf16,
        8,
    ));
    for (ci, (config, state, layout, io, steps)) in cases.into_iter().enumerate() {
        let opts = PoolOptions { state, layout };
        let what = format!("case {ci}: {:?} {opts:?} {io:?}", config.shape);
        let mut rng = Synth::new(100 + ci as u64);
        let layer = rng.layer(config).unwrap();
        let sh = *layer.shape();
        let slots = 5;
        let mut native = cuda.create_cuda_pool(&layer, slots, opts).unwrap();
        let mut flow = gdn::spec::TwoPass::new(cuda.create_cuda_pool(&layer, slots, opts).unwrap());
        for i in 0..slots {
            let (st, h) = rng.seq_state(&layer);
            let st: Vec<f32> = st.iter().map(|&x| state.round(x)).collect();
            native.write_slot(i, &st, &h).unwrap();
            flow.write_slot(i, &st, &h).unwrap();
        }
        let mut lcg = 0x9e37_79b9_7f4a_7c15u64 ^ ci as u64;
        let mut below = |n: usize| {
            lcg = lcg
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((lcg >> 33) % n.max(1) as u64) as usize
        };
        let read = |p: &mut dyn LayerPool| {
            let mut out = Vec::new();
            for i in 0..slots {
                let (mut s, mut h) = (vec![0.0; sh.state_len()], vec![0.0; sh.hist_len()]);
                p.read_slot(i, &mut s, &mut h).unwrap();
                out.extend(bits(&s));
                out.extend(bits(&h));
            }
            out
        };
        for step_i in 0..steps {
            // now and then a slot operation on both pools
            match below(8) {
                0 => {
                    let (slot, held) = (below(slots), native.held(0));
                    let slot = if held > 0 { 0 } else { slot };
                    let k = below(native.held(slot) + 1);
                    native.commit_held(slot, k).unwrap();
                    flow.commit_held(slot, k).unwrap();
                }
                1 => {
                    let (from, to) = (below(slots), below(slots));
                    native.copy_slot(from, to).unwrap();
                    flow.copy_slot(from, to).unwrap();
                }
                2 => {
                    let slot = below(slots);
                    native.reset_slot(slot).unwrap();
                    flow.reset_slot(slot).unwrap();
                }
                _ => {}
            }
            for slot in 0..slots {
                assert_eq!(
                    native.held(slot),
                    flow.held(slot),
                    "{what} step {step_i}: held"
                );
            }
            let mut seqs = Vec::new();
            let mut accept = Vec::new();
            let mut at = 0;
            // every third step one window length for all (a kernel of that constant length: the phased form)
            let uniform = (step_i % 3 == 2).then(|| 2 + below(7));
            for slot in 0..slots {
                let len = if let Some(u) = uniform {
                    u
                } else if below(6) == 0 {
                    9 + below(8)
                } else {
                    1 + below(8)
                };
                let skip = below(7) == 0;
                let commit = match below(6) {
                    0 => Commit::All,
                    1 => Commit::First(1 + below(len)),
                    _ => Commit::Verify,
                };
                seqs.push(Seq {
                    slot: if skip { -1 } else { slot as i32 },
                    start: at,
                    len,
                    commit,
                });
                at += len;
                let h = native.held(slot);
                accept.push(match below(4) {
                    0 => 0,
                    1 => h,
                    _ => below(h + 1),
                });
            }
            let b = rng.batch(&layer, at, 1);
            let rows = RowsData::from_f32(&b.qkv, &b.alpha, &b.beta, &b.z, [io; 4]);
            let stride = at * sh.n() + 16;
            let len = gdn::OutputLayout::for_rows(&sh, at, Some(stride))
                .unwrap()
                .len();
            let step = Step {
                rows: rows.view(),
                seqs: &seqs,
                plane_stride: Some(stride),
            };
            let mut y1 = TensorData::filled(len, 0.0, io);
            let mut y2 = TensorData::filled(len, 0.0, io);
            native.step_spec(&step, &accept, y1.view_mut()).unwrap();
            flow.step_spec(&step, &accept, y2.view_mut()).unwrap();
            assert_eq!(
                bits(&y1.to_f32()),
                bits(&y2.to_f32()),
                "{what} step {step_i}: outputs"
            );
            if step_i % 4 == 3 {
                assert_eq!(
                    read(&mut native),
                    read(&mut flow),
                    "{what} step {step_i}: slots"
                );
            }
        }
        for slot in 0..slots {
            let k = native.held(slot);
            native.commit_held(slot, k).unwrap();
            flow.commit_held(slot, k).unwrap();
        }
        assert_eq!(read(&mut native), read(&mut flow), "{what}: final slots");
        // a plain step on every slot again (nothing is held now), the same on both
        let b = rng.batch(&layer, slots * 2, 1);
        let rows = RowsData::from_f32(&b.qkv, &b.alpha, &b.beta, &b.z, [io; 4]);
        let seqs: Vec<Seq> = (0..slots)
            .map(|i| Seq {
                slot: i as i32,
                start: 2 * i,
                len: 2,
                commit: Commit::All,
            })
            .collect();
        let step = Step {
            rows: rows.view(),
            seqs: &seqs,
            plane_stride: None,
        };
        let mut y1 = TensorData::filled(slots * 2 * sh.n(), 0.0, io);
        let mut y2 = TensorData::filled(slots * 2 * sh.n(), 0.0, io);
        native.step_varlen(&step, y1.view_mut()).unwrap();
        flow.step_varlen(&step, y2.view_mut()).unwrap();
        assert_eq!(
            bits(&y1.to_f32()),
            bits(&y2.to_f32()),
            "{what}: plain step after"
        );
        assert_eq!(
            read(&mut native),
            read(&mut flow),
            "{what}: slots after the plain step"
        );
    }
}

/// The quantized out_proj's device entries give the host path's bits, and a row's bits do not depend on the
/// rest of the call among calls on the same kernel (calls of `QuantTune::mma_from` rows or more run on tensor
/// cores): part calls against the whole call, on the CUDA cores (rows 0..3, 3..6 and 4..7 of 7 rows; 0..4, 4..8
/// and 5..9 of 9: a token tile and a remainder) and on tensor cores (0..8, 8..16 and 12..20 of 20: n-tiles and a
/// remainder), wherever both sides of a case take the same kernel under the default; every packing, both paths,
/// at n 6144.
#[test]
fn quant_device_entries_and_tiles_agree_bitwise() {
    use gdn::quant::{OutProj, Packing, QuantWeights};
    let Some(cuda) = cuda_or_skip("quant_device_entries_and_tiles_agree_bitwise") else {
        return;
    };
    let sh = Shape::SEED;
    let (n, hidden, total) = (sh.n(), 200, 20);
    let g = n / 16;
    let mut rng = Synth::new(31);
    let y = rng.uniform(total * n, -2.0, 2.0);
    let w = rng.uniform(hidden * n, -0.05, 0.05);
    let gs = gdn::quant::group_sums(&y);
    // a step output with planes built from rows r..r + k of y (SPEC's scales), stride k n
    let step_out = |r: usize, k: usize| {
        let lay = gdn::OutputLayout::for_rows(&sh, k, Some(k * n)).unwrap();
        let mut buf = vec![0.0f32; lay.len()];
        let p = k * n;
        for (i, &v) in y[r * n..(r + k) * n].iter().enumerate() {
            buf[i] = v;
            for j in 1..4 {
                buf[j * p + i] = v * gdn::plane_scale(j, i % n);
            }
        }
        buf[4 * p..4 * p + k * g].copy_from_slice(&gs[r * g..(r + k) * g]);
        (buf, lay)
    };
    let from = gdn_cuda::quant::QuantTune::DEFAULT.mma_from;
    let tensor = |rows: usize| rows >= from;
    // (whole call's rows, part length, part starts), where the parts and the whole take the same kernel
    let cases: Vec<(usize, usize, [usize; 3])> =
        [(7, 3, [0, 3, 4]), (9, 4, [0, 4, 5]), (20, 8, [0, 8, 12])]
            .into_iter()
            .filter(|&(rows, k, _)| tensor(rows) == tensor(k))
            .collect();
    assert!(!cases.is_empty(), "mma_from {from} splits every case");
    let s = cuda.stream();
    for pk in Packing::ALL {
        let q = QuantWeights::quantize(&w, hidden, n, pk).unwrap();
        let mut prod = cuda.load_out_proj(&q).unwrap();
        for &(rows, k, starts) in &cases {
            let what = format!(
                "{pk:?} {rows} rows ({})",
                if tensor(rows) { "tensor" } else { "CUDA cores" }
            );
            let (buf, lay) = step_out(0, rows);
            let mut all = vec![0.0f32; rows * hidden];
            prod.product_planes(&buf, &lay, &mut all).unwrap();
            let mut all_shift = vec![0.0f32; rows * hidden];
            prod.product_shift(&y[..rows * n], rows, &mut all_shift)
                .unwrap();
            for r in starts {
                let (sub, part_lay) = step_out(r, k);
                let mut o = vec![0.0f32; k * hidden];
                prod.product_planes(&sub, &part_lay, &mut o).unwrap();
                assert_eq!(
                    bits(&o),
                    bits(&all[r * hidden..(r + k) * hidden]),
                    "{what}: rows {r}..{} alone against inside the call",
                    r + k
                );
                prod.product_shift(&y[r * n..(r + k) * n], k, &mut o)
                    .unwrap();
                assert_eq!(
                    bits(&o),
                    bits(&all_shift[r * hidden..(r + k) * hidden]),
                    "{what}: rows {r}..{} shift path alone against inside the call",
                    r + k
                );
            }
            // the device entries on device buffers
            let dbuf = s.clone_htod(&buf).unwrap();
            let mut dout = s.alloc_zeros::<f32>(rows * hidden).unwrap();
            prod.product_planes_device(&dbuf.as_view(), &lay, &mut dout.as_view_mut())
                .unwrap();
            assert_eq!(
                bits(&s.clone_dtoh(&dout).unwrap()),
                bits(&all),
                "{what}: device planes"
            );
            prod.reserve(rows).unwrap();
            let dy = dbuf.slice(0..rows * n);
            prod.product_shift_device(&dy, rows, &mut dout.as_view_mut())
                .unwrap();
            assert_eq!(
                bits(&s.clone_dtoh(&dout).unwrap()),
                bits(&all_shift),
                "{what}: device shift"
            );
        }
    }
}

/// The memory hints (L2 prefetch ahead, the own state before the wait), the loop form (token by token, or in
/// three phases) and the head split over a cluster change no bits: a call of 24 sequences (more blocks than the
/// device holds at once, so the prefetch ahead runs) under no hints, one block a head and the token loop, under
/// both hints and the phases, under the planner's, and split over clusters of 2 and 4 blocks, gives the same
/// outputs, states and histories (f32 and bf16 states, both layouts, T 1, where a bf16 state is staged, and T 3
/// with the planes), 1 sequence in 5 verify-only and at T 3 one in 5 committing after 2 tokens.
#[test]
fn memory_hints_and_head_splits_change_no_bits() {
    let Some(cuda) = cuda_or_skip("memory_hints_and_head_splits_change_no_bits") else {
        return;
    };
    let one = gdn_cuda::Plan::choose(128, 48, 256, cuda.multiprocessors()).unwrap();
    let ahead_prewait = gdn_cuda::Tune {
        ahead_half_waves: 1,
        prewait: true,
        phased: true,
    };
    // (plan override, hints override): None is the planner's
    let variants = [
        (Some(one), Some(gdn_cuda::Tune::NONE)),
        (Some(one), Some(ahead_prewait)),
        (None, None),
        (Some(gdn_cuda::Plan::with_rg(128, 2, one.rg)), None),
        (
            Some(gdn_cuda::Plan::with_rg(128, 4, one.rg)),
            Some(gdn_cuda::Tune::NONE),
        ),
    ];
    for (state, layout, io) in [
        (DType::F32, StateLayout::KeyMajor, DType::F32),
        (DType::Bf16, StateLayout::KeyMajor, DType::F32),
        (DType::Bf16, StateLayout::ValueMajor, DType::Bf16),
        (DType::F32, StateLayout::ValueMajor, DType::F32),
    ] {
        let opts = PoolOptions { state, layout };
        for t in [1usize, 3] {
            let b = 24;
            let s = setup(Shape::SEED, b, b * t, io, 5 + t as u64);
            let seqs: Vec<Seq> = (0..b)
                .map(|i| Seq {
                    slot: (b - 1 - i) as i32,
                    start: i * t,
                    len: t,
                    commit: match i % 5 {
                        4 => Commit::Verify,
                        2 if t > 1 => Commit::First(t - 1),
                        _ => Commit::All,
                    },
                })
                .collect();
            let mut first: Option<(Vec<u32>, Vec<u32>)> = None;
            for (plan, tune) in variants {
                let mut cu = cuda.clone();
                cu.set_plan_override(plan);
                cu.set_tune_override(tune);
                let mut p = pool(&cu, &s, opts);
                let y = run(&mut p, &s.rows, &seqs, t > 1, io);
                let st = slot_bits(&mut p);
                match &first {
                    None => first = Some((y, st)),
                    Some((y0, st0)) => {
                        assert!(y == *y0, "{opts:?} T {t} {plan:?} {tune:?}: outputs differ");
                        assert!(
                            st == *st0,
                            "{opts:?} T {t} {plan:?} {tune:?}: states differ"
                        );
                    }
                }
            }
        }
    }
}
