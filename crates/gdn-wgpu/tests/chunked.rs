//! The chunked form of long windows (WY / UT, `chunk.wgsl`) against the float64 oracle and its invariants:
//! windows up to a few thousand tokens at d 16, every commit kind, commit first k against the k-token window
//! bitwise (chunk boundaries, inside a chunk, in the first three tokens), verify writing nothing, each window of a
//! mixed call alone, every pool option with 16-bit activations and outputs, planes. Skipped without an adapter
//! unless `GDN_WGPU_REQUIRE=1`.

use gdn::oracle::{self, SeqState};
use gdn::step::{RowsData, Seq, Step, TensorData};
use gdn::synth::Synth;
use gdn::{
    Backend, Commit, Config, DType, Layer, LayerPool, OutputLayout, PoolOptions, Shape, StateLayout,
};
use gdn_wgpu::{Options, Wgpu};

mod common;

fn backend(chunk_from: usize) -> Option<Wgpu> {
    backend_with(
        chunk_from,
        gdn_wgpu::DEFAULT_CHUNK_LEN,
        gdn_wgpu::DEFAULT_CHUNK_COLUMNS,
    )
}

fn backend_with(chunk_from: usize, chunk_len: usize, chunk_columns: usize) -> Option<Wgpu> {
    let options = Options {
        chunk_len,
        chunk_columns,
        chunk_from: Some(chunk_from),
        ..common::env_options()
    };
    common::backend_or_skip(options, "chunked wgpu test")
}

fn backend_default() -> Wgpu {
    Wgpu::with_options(common::env_options()).unwrap()
}

/// The bound on f32 outputs and an f32 state against the float64 oracle (issue 14).
const BOUND: f64 = 2e-6;

fn layer(seed: u64, shape: Shape, grouped: bool) -> Layer {
    let mut config = Config::new(shape);
    config.gate = gdn::Gate::Silu;
    if grouped {
        config.head_map = gdn::HeadMap::Grouped;
    }
    Synth::new(seed).layer(config).unwrap()
}

struct Case {
    layer: Layer,
    init: Vec<(Vec<f32>, Vec<f32>)>,
    rows: RowsData,
}

fn case(seed: u64, shape: Shape, rows: usize, slots: usize, dtypes: [DType; 4]) -> Case {
    let layer = layer(seed, shape, seed % 2 == 1);
    let mut rng = Synth::new(seed + 100);
    let init = (0..slots).map(|_| rng.seq_state(&layer)).collect();
    let b = rng.batch(&layer, 1, rows);
    Case {
        layer,
        init,
        rows: RowsData::from_f32(&b.qkv, &b.alpha, &b.beta, &b.z, dtypes),
    }
}

fn pool(b: &Wgpu, c: &Case, options: PoolOptions) -> Box<dyn LayerPool> {
    let mut p = b.create_pool_with(&c.layer, c.init.len(), options).unwrap();
    for (i, (s, h)) in c.init.iter().enumerate() {
        p.write_slot(i, s, h).unwrap();
    }
    p
}

/// Every slot's (state, history).
type Slots = Vec<(Vec<f32>, Vec<f32>)>;

fn read_all(p: &mut dyn LayerPool) -> Slots {
    let sh = *p.layer().shape();
    (0..p.slots())
        .map(|i| {
            let (mut s, mut h) = (vec![0.0; sh.state_len()], vec![0.0; sh.hist_len()]);
            p.read_slot(i, &mut s, &mut h).unwrap();
            (s, h)
        })
        .collect()
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Runs `seqs` on a fresh pool; returns the output (f32 view) and every slot after.
fn run(
    b: &Wgpu,
    c: &Case,
    options: PoolOptions,
    seqs: &[Seq],
    planes: bool,
    out_dt: DType,
) -> (Vec<f32>, Slots) {
    let sh = *c.layer.shape();
    let rows = c.rows.view().count(&sh).unwrap();
    let stride = planes.then_some(rows * sh.n() + 1);
    let layout = OutputLayout::for_rows(&sh, rows, stride).unwrap();
    let step = Step {
        rows: c.rows.view(),
        seqs,
        plane_stride: stride,
    };
    let mut p = pool(b, c, options);
    let mut out = TensorData::filled(layout.len(), 0.0, out_dt);
    p.step_varlen(&step, out.view_mut()).unwrap();
    (out.to_f32(), read_all(p.as_mut()))
}

/// The oracle for `seqs` from the case's initial states (as the pool holds them: bf16 rounded).
fn oracle_run(
    c: &Case,
    options: PoolOptions,
    seqs: &[Seq],
    planes: bool,
    out_dt: DType,
) -> (Vec<f64>, Vec<SeqState>) {
    let sh = *c.layer.shape();
    let rows = c.rows.view().count(&sh).unwrap();
    let stride = planes.then_some(rows * sh.n() + 1);
    let step = Step {
        rows: c.rows.view(),
        seqs,
        plane_stride: stride,
    };
    let mut states: Vec<SeqState> = c
        .init
        .iter()
        .map(|(s, h)| {
            let s = if options.state == DType::Bf16 {
                s.iter().map(|&x| DType::Bf16.round(x)).collect()
            } else {
                s.clone()
            };
            let km = options.layout.convert(StateLayout::KeyMajor, &sh, &s);
            SeqState::from_f32(&km, h)
        })
        .collect();
    let want = oracle::step_varlen(&c.layer, &mut states, &step, options.state, out_dt).unwrap();
    (want, states)
}

fn seq(slot: i32, start: usize, len: usize, commit: Commit) -> Seq {
    Seq {
        slot,
        start,
        len,
        commit,
    }
}

/// Rows of `seqs` in y.
fn y_rows(sh: &Shape, seqs: &[Seq]) -> Vec<usize> {
    seqs.iter()
        .filter(|s| s.slot >= 0)
        .flat_map(|s| s.start * sh.n()..(s.start + s.len) * sh.n())
        .collect()
}

#[test]
fn long_windows_match_the_oracle() {
    let shape = Shape::new(16, 2, 4).unwrap();
    let cases = [1usize, 2, 5, 31, 32, 33, 100, 1000, 3000]
        .into_iter()
        .map(|t| (t, 32, 16))
        .chain([
            (17, 16, 16),
            (100, 16, 32),
            (63, 16, 16),
            (65, 32, 16),
            (1000, 16, 16),
        ]);
    for (k, (len, l, cols)) in cases.enumerate() {
        let Some(b) = backend_with(1, l, cols) else {
            return;
        };
        let probe = b
            .pool(&layer(0, shape, false), 1, PoolOptions::default())
            .unwrap();
        assert_eq!(
            probe.chunk_from(),
            1,
            "the adapter runs the chunked kernels"
        );
        assert_eq!(probe.chunk_geometry().0, l);
        let c = case(k as u64, shape, len, 1, [DType::F32; 4]);
        let seqs = [seq(0, 0, len, Commit::All)];
        let (y, st) = run(&b, &c, PoolOptions::default(), &seqs, false, DType::F32);
        let (want, ost) = oracle_run(&c, PoolOptions::default(), &seqs, false, DType::F32);
        let ey = gdn::relative_error(&y, &want);
        let es = gdn::relative_error(&st[0].0, &ost[0].s);
        let eh = gdn::relative_error(&st[0].1, &ost[0].h);
        eprintln!("T {len} (L {l}, BV {cols}): y {ey:.2e}, state {es:.2e}, hist {eh:.1e}");
        assert!(
            ey < BOUND && es < BOUND && eh == 0.0,
            "T {len}: y {ey:.2e} state {es:.2e} hist {eh:.2e}"
        );
    }
}

#[test]
fn chunked_and_token_serial_agree_at_the_seed_shape() {
    let (Some(ch), Some(ts)) = (backend(1), backend(usize::MAX)) else {
        return;
    };
    let c = case(7, Shape::SEED, 70, 1, [DType::F32; 4]);
    let seqs = [seq(0, 0, 70, Commit::All)];
    let (yc, sc) = run(&ch, &c, PoolOptions::default(), &seqs, false, DType::F32);
    let (yt, st) = run(&ts, &c, PoolOptions::default(), &seqs, false, DType::F32);
    let (want, ost) = oracle_run(&c, PoolOptions::default(), &seqs, false, DType::F32);
    let (ec, et) = (
        gdn::relative_error(&yc, &want),
        gdn::relative_error(&yt, &want),
    );
    let (sc_e, st_e) = (
        gdn::relative_error(&sc[0].0, &ost[0].s),
        gdn::relative_error(&st[0].0, &ost[0].s),
    );
    eprintln!(
        "seed shape T 70: chunked y {ec:.2e} S {sc_e:.2e}; token-serial y {et:.2e} S {st_e:.2e}"
    );
    assert!(ec < BOUND && sc_e < BOUND, "{ec:.2e} {sc_e:.2e}");
    assert_eq!(bits(&sc[0].1), bits(&st[0].1), "history");
}

#[test]
fn commit_first_k_is_the_k_token_window_bitwise_and_verify_writes_nothing() {
    for (l, c) in [(32, 16), (16, 16), (16, 32)] {
        let Some(b) = backend_with(1, l, c) else {
            return;
        };
        commit_first_k(&b, l);
    }
}

fn commit_first_k(b: &Wgpu, l: usize) {
    let b = b.clone();
    let shape = Shape::new(16, 1, 2).unwrap();
    let total = 200;
    for options in [
        PoolOptions::default(),
        PoolOptions {
            state: DType::Bf16,
            layout: StateLayout::ValueMajor,
        },
        PoolOptions {
            state: DType::Bf16,
            layout: StateLayout::KeyMajor,
        },
    ] {
        let c = case(
            3,
            shape,
            total + 5,
            2,
            [DType::Bf16, DType::F32, DType::F16, DType::Bf16],
        );
        let sh = *c.layer.shape();
        for k in [1usize, 2, 3, l - 1, l, l + 1, 2 * l, 100, 199, 200] {
            let (y1, s1) = run(
                &b,
                &c,
                options,
                &[seq(1, 3, total, Commit::First(k))],
                false,
                DType::Bf16,
            );
            let (y2, s2) = run(
                &b,
                &c,
                options,
                &[seq(1, 3, k, Commit::All)],
                false,
                DType::Bf16,
            );
            assert_eq!(bits(&s1[1].0), bits(&s2[1].0), "{options:?} k {k}: state");
            assert_eq!(bits(&s1[1].1), bits(&s2[1].1), "{options:?} k {k}: history");
            let r = 3 * sh.n()..(3 + k) * sh.n();
            assert_eq!(bits(&y1[r.clone()]), bits(&y2[r]), "{options:?} k {k}: y");
            assert_eq!(
                bits(&s1[0].0),
                bits(&s2[0].0),
                "{options:?} k {k}: untouched slot"
            );
        }
        // verify: nothing written
        let mut p = pool(&b, &c, options);
        let before = read_all(p.as_mut());
        let seqs = [seq(0, 0, total, Commit::Verify)];
        let step = Step {
            rows: c.rows.view(),
            seqs: &seqs,
            plane_stride: None,
        };
        let mut out = vec![0.0f32; (total + 5) * sh.n()];
        p.step_varlen(&step, (&mut out[..]).into()).unwrap();
        let after = read_all(p.as_mut());
        for (a, z) in before.iter().zip(&after) {
            assert_eq!(
                bits(&a.0),
                bits(&z.0),
                "{options:?}: verify wrote the state"
            );
            assert_eq!(
                bits(&a.1),
                bits(&z.1),
                "{options:?}: verify wrote the history"
            );
        }
        // identical inputs, identical bits
        let mut out2 = vec![0.0f32; out.len()];
        p.step_varlen(&step, (&mut out2[..]).into()).unwrap();
        assert_eq!(bits(&out), bits(&out2));
    }
}

#[test]
fn mixed_calls_in_every_pool_option_match_the_oracle_and_each_window_alone() {
    use DType::{Bf16, F16, F32};
    // chunked from 40 tokens: the batch mixes both paths
    let Some(b) = backend(40) else { return };
    let shape = Shape::new(16, 2, 4).unwrap();
    let seqs = [
        seq(0, 0, 130, Commit::First(77)),
        seq(1, 130, 5, Commit::All),
        seq(2, 136, 64, Commit::Verify),
        seq(-1, 200, 50, Commit::All),
        seq(3, 250, 41, Commit::All),
        seq(4, 291, 90, Commit::First(20)),
    ];
    let rows = 381;
    for (oi, options) in [
        PoolOptions::default(),
        PoolOptions {
            state: Bf16,
            layout: StateLayout::KeyMajor,
        },
        PoolOptions {
            state: F32,
            layout: StateLayout::ValueMajor,
        },
        PoolOptions {
            state: Bf16,
            layout: StateLayout::ValueMajor,
        },
    ]
    .into_iter()
    .enumerate()
    {
        let (dtypes, out_dt) = [
            ([F32; 4], F32),
            ([Bf16; 4], Bf16),
            ([F16, Bf16, F32, F16], F16),
        ][oi % 3];
        let planes = oi % 2 == 0;
        let c = case(20 + oi as u64, shape, rows, 5, dtypes);
        let sh = *c.layer.shape();
        let (y, st) = run(&b, &c, options, &seqs, planes, out_dt);
        let (want, ost) = oracle_run(&c, options, &seqs, planes, out_dt);
        let what = format!("{options:?} {dtypes:?} -> {out_dt:?}");
        // outputs against the oracle's rounded values: f32 within the chunked bound, 16-bit as the suite
        let idx: Vec<usize> = if planes {
            let p = rows * sh.n() + 1;
            let mut v = y_rows(&sh, &seqs);
            let y0 = v.clone();
            for k in 1..4 {
                v.extend(y0.iter().map(|&i| i + k * p));
            }
            v
        } else {
            y_rows(&sh, &seqs)
        };
        let g: Vec<f32> = idx.iter().map(|&i| y[i]).collect();
        let w: Vec<f64> = idx.iter().map(|&i| want[i]).collect();
        let e = gdn::relative_error(&g, &w);
        let bound = if out_dt == F32 { BOUND } else { 2e-3 };
        assert!(e < bound, "{what}: output {e:.2e}");
        for (slot, ((s, h), o)) in st.iter().zip(&ost).enumerate() {
            let km = options.layout.convert(StateLayout::KeyMajor, &sh, s);
            let es = gdn::relative_error(&km, &o.s);
            let sb = if options.state == Bf16 { 2e-3 } else { BOUND };
            assert!(es < sb, "{what}: slot {slot} state {es:.2e}");
            assert_eq!(
                gdn::relative_error(h, &o.h),
                0.0,
                "{what}: slot {slot} history"
            );
        }
        // every live window alone: the same bits
        for q in seqs.iter().filter(|q| q.slot >= 0) {
            let (y1, s1) = run(&b, &c, options, &[*q], planes, out_dt);
            let i1 = y_rows(&sh, &[*q]);
            assert!(
                i1.iter().all(|&i| y1[i].to_bits() == y[i].to_bits()),
                "{what}: {q:?} alone"
            );
            let sl = q.slot as usize;
            assert_eq!(
                bits(&s1[sl].0),
                bits(&st[sl].0),
                "{what}: {q:?} state alone"
            );
        }
    }
}

#[test]
fn crossover_is_set_through_the_builder() {
    let Some(b) = backend(usize::MAX) else { return };
    assert_eq!(b.chunk_from(), usize::MAX);
    let b2 = b.clone().with_chunk_from(16);
    assert_eq!(b2.chunk_from(), 16);
    assert_eq!(Options::default().chunk_from, None);
    let default = backend_default();
    let want = if default.adapter_info().device_type == wgpu::DeviceType::Cpu {
        gdn_wgpu::CPU_CHUNK_FROM
    } else {
        gdn_wgpu::DEFAULT_CHUNK_FROM
    };
    assert_eq!(default.chunk_from(), want);
}

/// Windows whose scratch does not fit one round run in several (one submission each), with the bits of one round;
/// a window that alone does not fit is refused before anything is touched.
#[test]
fn rounds_split_the_scratch_and_a_window_too_long_is_refused() {
    let Some(b) = backend(1) else { return };
    let shape = Shape::new(16, 1, 2).unwrap();
    // one 100-token window's scratch: 100 (2 h_k d + 2 h_v d + 2 h_v) + 4 chunks h_v (L^2 + 3 L) floats
    let one = 4 * (100 * (2 * 16 + 2 * 2 * 16 + 4) + 4 * 2 * (32 * 32 + 96)) as u64;
    let capped = Wgpu::with_options(Options {
        chunk_from: Some(1),
        chunk_scratch_bytes: Some(2 * one + 64),
        ..common::env_options()
    })
    .unwrap();
    let c = case(9, shape, 400, 4, [DType::F32; 4]);
    let seqs = [
        seq(0, 0, 100, Commit::All),
        seq(1, 100, 100, Commit::First(50)),
        seq(2, 200, 100, Commit::Verify),
    ];
    let (y1, s1) = run(&b, &c, PoolOptions::default(), &seqs, true, DType::F32);
    let (y2, s2) = run(&capped, &c, PoolOptions::default(), &seqs, true, DType::F32);
    assert_eq!(bits(&y1), bits(&y2), "outputs in one round and in two");
    for (a, z) in s1.iter().zip(&s2) {
        assert_eq!(bits(&a.0), bits(&z.0));
        assert_eq!(bits(&a.1), bits(&z.1));
    }
    // a 400-token window alone is past the cap: refused, nothing touched
    let mut p = pool(&capped, &c, PoolOptions::default());
    let before = read_all(p.as_mut());
    let long = [seq(3, 0, 400, Commit::All)];
    let step = Step {
        rows: c.rows.view(),
        seqs: &long,
        plane_stride: None,
    };
    let mut out = vec![0.0f32; 400 * shape.n()];
    let err = p.step_varlen(&step, (&mut out[..]).into()).unwrap_err();
    assert!(err.to_string().contains("400 tokens"), "{err}");
    assert!(p.check_step(&step, out.len()).is_err());
    let after = read_all(p.as_mut());
    for (a, z) in before.iter().zip(&after) {
        assert_eq!(bits(&a.0), bits(&z.0));
        assert_eq!(bits(&a.1), bits(&z.1));
    }
}

/// The crossover measured on this adapter: both paths timed per length, the result at least 17 or never.
#[test]
fn the_crossover_is_measured() {
    let Some(b) = backend(usize::MAX) else { return };
    let layer = layer(2, Shape::new(16, 1, 2).unwrap(), false);
    let c = b.measure_crossover(&layer, &[16, 64, 256], 1).unwrap();
    eprintln!("{:?}", c);
    assert_eq!(c.points.len(), 3);
    assert!(c.points.iter().all(|p| p.1 > 0.0 && p.2 > 0.0));
    assert!(c.chunk_from == usize::MAX || c.chunk_from >= 17);
}

/// The chunked epilogue's 16-bit outputs (y, planes, group sums) are its f32 outputs rounded once to nearest even.
#[test]
fn chunked_16_bit_outputs_are_the_f32_outputs_rounded() {
    let Some(b) = backend(1) else { return };
    // d 48: three group sums a head, padded to four on the device for 16-bit outputs
    for shape in [Shape::new(16, 1, 2).unwrap(), Shape::new(48, 1, 3).unwrap()] {
        let c = case(31, shape, 75, 1, [DType::Bf16; 4]);
        let seqs = [seq(0, 0, 75, Commit::Verify)];
        let (y32, _) = run(&b, &c, PoolOptions::default(), &seqs, true, DType::F32);
        for dt in [DType::Bf16, DType::F16] {
            let (y16, _) = run(&b, &c, PoolOptions::default(), &seqs, true, dt);
            let want = TensorData::from_f32(&y32, dt).to_f32();
            assert_eq!(bits(&y16), bits(&want), "d {} {dt:?}", shape.d);
        }
    }
}

/// A window of 65536 tokens: past lavapipe's 65535 iterations a loop, which the chunked kernels never reach
/// (their loops over a chunk's rows have constant trip counts), against the oracle.
#[test]
fn a_window_of_65536_tokens() {
    let Some(b) = backend(1) else { return };
    let shape = Shape::new(16, 1, 2).unwrap();
    let c = case(5, shape, 65536, 1, [DType::F32; 4]);
    let seqs = [seq(0, 0, 65536, Commit::First(65000))];
    let (y, st) = run(&b, &c, PoolOptions::default(), &seqs, false, DType::F32);
    let (want, ost) = oracle_run(&c, PoolOptions::default(), &seqs, false, DType::F32);
    let ey = gdn::relative_error(&y, &want);
    let es = gdn::relative_error(&st[0].0, &ost[0].s);
    let eh = gdn::relative_error(&st[0].1, &ost[0].h);
    eprintln!("T 65536: y {ey:.2e}, S {es:.2e}, H {eh:.1e}");
    assert!(
        ey < BOUND && es < BOUND && eh == 0.0,
        "y {ey:.2e} S {es:.2e} H {eh:.2e}"
    );
}
