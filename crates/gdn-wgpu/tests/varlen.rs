//! The wgpu backend's varlen step against the float64 oracle in every pool option (f32 / bf16 state, key- /
//! value-major) and a spread of activation dtypes, on both reduction paths; each sequence of a mixed call
//! against itself alone (bitwise); the exact rounding of 16-bit outputs; per-call buffers released above the
//! keep cap; sizes beyond the kernel's 32-bit indices refused. Skipped without an adapter unless
//! `GDN_WGPU_REQUIRE=1`.

use gdn::oracle::{self, SeqState};
use gdn::step::{RowsData, Seq, Step, TensorData};
use gdn::synth::Synth;
use gdn::{
    Backend, Commit, Config, DType, Error, Layer, LayerPool, OutputLayout, PoolOptions, Shape,
    StateLayout,
};
use gdn_wgpu::{Options, Subgroups, Wgpu};

mod common;

fn backend(subgroups: Subgroups, keep_bytes: u64) -> Option<Wgpu> {
    let options = Options {
        subgroups,
        keep_bytes,
        ..common::env_options()
    };
    common::backend_or_skip(options, "wgpu varlen test")
}

fn backends() -> Vec<Wgpu> {
    [Subgroups::Require, Subgroups::Off]
        .into_iter()
        .filter_map(|s| backend(s, gdn_wgpu::DEFAULT_KEEP_BYTES))
        .collect()
}

/// A value no step writes, exact in every output dtype.
const FILL: f32 = 1280.0;

fn layer(seed: u64) -> Layer {
    let mut config = Config::new(Shape::new(32, 2, 4).unwrap());
    config.gate = gdn::Gate::Silu;
    Synth::new(seed).layer(config).unwrap()
}

/// Seven live sequences of lengths 1 to 12 with every kind of commit, one skipped, rows left unused between them.
fn mixed_seqs() -> (Vec<Seq>, usize) {
    let spec: [(i32, usize, Commit); 8] = [
        (5, 1, Commit::All),
        (0, 5, Commit::First(2)),
        (7, 1, Commit::Verify),
        (-1, 2, Commit::All),
        (2, 9, Commit::First(4)),
        (3, 3, Commit::Verify),
        (8, 1, Commit::All),
        (1, 12, Commit::First(12)),
    ];
    let mut seqs = Vec::new();
    let mut row = 0;
    for (i, (slot, len, commit)) in spec.into_iter().enumerate() {
        seqs.push(Seq {
            slot,
            start: row,
            len,
            commit,
        });
        row += len + (i % 3 == 1) as usize;
    }
    (seqs, row)
}

struct Setup {
    layer: Layer,
    init: Vec<(Vec<f32>, Vec<f32>)>,
    rows: RowsData,
}

fn setup(seed: u64, rows: usize, slots: usize, dtypes: [DType; 4]) -> Setup {
    let layer = layer(seed);
    let mut rng = Synth::new(seed + 1);
    let init = (0..slots).map(|_| rng.seq_state(&layer)).collect();
    let b = rng.batch(&layer, 1, rows);
    let rows = RowsData::from_f32(&b.qkv, &b.alpha, &b.beta, &b.z, dtypes);
    Setup { layer, init, rows }
}

fn pool(b: &Wgpu, s: &Setup, options: PoolOptions) -> Box<dyn LayerPool> {
    let mut p = b
        .create_pool_with(&s.layer, s.init.len(), options)
        .expect("pool");
    for (i, (st, h)) in s.init.iter().enumerate() {
        p.write_slot(i, st, h).expect("write_slot");
    }
    p
}

fn read_all(p: &mut dyn LayerPool) -> Vec<(Vec<f32>, Vec<f32>)> {
    let sh = *p.layer().shape();
    (0..p.slots())
        .map(|i| {
            let (mut s, mut h) = (vec![0.0; sh.state_len()], vec![0.0; sh.hist_len()]);
            p.read_slot(i, &mut s, &mut h).expect("read_slot");
            (s, h)
        })
        .collect()
}

/// Output indices a step writes: the live sequences' rows in y, every plane and the group sums.
fn written(layout: &OutputLayout, seqs: &[Seq]) -> Vec<usize> {
    let n = layout.n;
    let mut idx = Vec::new();
    for s in seqs.iter().filter(|s| s.slot >= 0) {
        let r = s.start * n..(s.start + s.len) * n;
        idx.extend(r.clone());
        if let Some(p) = layout.plane_stride {
            for k in 1..4 {
                idx.extend(r.start + k * p..r.end + k * p);
            }
            idx.extend(4 * p + s.start * (n / 16)..4 * p + (s.start + s.len) * (n / 16));
        }
    }
    idx
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

fn out_bound(dt: DType) -> f64 {
    match dt {
        DType::F32 => 1e-5,
        DType::F16 => 2e-3,
        DType::Bf16 => 1e-2,
    }
}

fn all_options() -> Vec<PoolOptions> {
    let mut v = Vec::new();
    for state in [DType::F32, DType::Bf16] {
        for layout in [StateLayout::KeyMajor, StateLayout::ValueMajor] {
            v.push(PoolOptions { state, layout });
        }
    }
    v
}

#[test]
fn mixed_calls_match_the_oracle_and_each_sequence_alone_bitwise() {
    use DType::{Bf16, F16, F32};
    let io: [([DType; 4], DType); 3] = [
        ([F32; 4], F32),
        ([Bf16; 4], Bf16),
        ([F16, Bf16, F32, F16], F16),
    ];
    let (seqs, rows) = mixed_seqs();
    for b in backends() {
        for (oi, options) in all_options().into_iter().enumerate() {
            for (k, (dtypes, out_dt)) in io.into_iter().enumerate() {
                let s = setup(10 + k as u64, rows, 10, dtypes);
                let sh = *s.layer.shape();
                // an odd plane stride: the device's own layout is remapped on the way back
                let plane_stride = ((oi + k) % 2 == 0).then_some(rows * sh.n() + 3);
                let step = Step {
                    rows: s.rows.view(),
                    seqs: &seqs,
                    plane_stride,
                };
                let layout = OutputLayout::for_rows(&sh, rows, plane_stride).unwrap();
                let what = format!("{} {options:?} {dtypes:?} -> {out_dt:?}", b.name());
                let mut p = pool(&b, &s, options);
                let before = read_all(p.as_mut());
                let mut out = TensorData::filled(layout.len(), FILL, out_dt);
                p.step_varlen(&step, out.view_mut()).expect(&what);
                let after = read_all(p.as_mut());
                // the oracle from what the pool holds (bf16 already rounded), in SPEC's key-major layout
                let mut states: Vec<SeqState> = before
                    .iter()
                    .map(|(st, h)| {
                        let km = options.layout.convert(StateLayout::KeyMajor, &sh, st);
                        SeqState::from_f32(&km, h)
                    })
                    .collect();
                let want = oracle::step_varlen(&s.layer, &mut states, &step, options.state, out_dt)
                    .unwrap();
                let got = out.to_f32();
                let idx = written(&layout, &seqs);
                let g: Vec<f32> = idx.iter().map(|&i| got[i]).collect();
                let w: Vec<f64> = idx.iter().map(|&i| want[i]).collect();
                let e = gdn::relative_error(&g, &w);
                assert!(e < out_bound(out_dt), "{what}: output error {e:.2e}");
                let mut mask = vec![false; got.len()];
                idx.iter().for_each(|&i| mask[i] = true);
                assert!(
                    got.iter().zip(&mask).all(|(&x, &m)| m || x == FILL),
                    "{what}: an element no sequence covers was written"
                );
                let s_bound = if options.state == Bf16 { 1e-2 } else { 1e-5 };
                for (slot, ((st, h), o)) in after.iter().zip(&states).enumerate() {
                    let km = options.layout.convert(StateLayout::KeyMajor, &sh, st);
                    let es = gdn::relative_error(&km, &o.s);
                    let eh = gdn::relative_error(h, &o.h);
                    assert!(
                        es < s_bound && eh < 1e-6,
                        "{what}: slot {slot} state {es:.2e} hist {eh:.2e}"
                    );
                    let committed = seqs
                        .iter()
                        .any(|q| q.slot == slot as i32 && q.commit != Commit::Verify);
                    if !committed {
                        assert_eq!(bits(st), bits(&before[slot].0), "{what}: slot {slot}");
                        assert_eq!(bits(h), bits(&before[slot].1), "{what}: slot {slot}");
                    }
                }
                // every live sequence alone, in a fresh pool: the same bits
                if k == 2 || oi == 3 {
                    for q in seqs.iter().filter(|q| q.slot >= 0) {
                        let mut alone = pool(&b, &s, options);
                        let one = [*q];
                        let step1 = Step { seqs: &one, ..step };
                        let mut out1 = TensorData::filled(layout.len(), FILL, out_dt);
                        alone.step_varlen(&step1, out1.view_mut()).unwrap();
                        let got1 = out1.to_f32();
                        let idx1 = written(&layout, &one);
                        assert!(
                            idx1.iter().all(|&i| got1[i].to_bits() == got[i].to_bits()),
                            "{what}: sequence {q:?} alone gives other output bits"
                        );
                        let a = read_all(alone.as_mut());
                        let sl = q.slot as usize;
                        assert_eq!(bits(&a[sl].0), bits(&after[sl].0), "{what}: {q:?} state");
                        assert_eq!(bits(&a[sl].1), bits(&after[sl].1), "{what}: {q:?} hist");
                    }
                }
            }
        }
    }
}

#[test]
fn commit_first_k_is_a_k_token_step_in_every_pool_option() {
    for b in backends() {
        for options in all_options() {
            let s = setup(3, 16, 2, [DType::Bf16, DType::F32, DType::F16, DType::Bf16]);
            let sh = *s.layer.shape();
            let layout = OutputLayout::for_rows(&sh, 16, None).unwrap();
            let run = |seq: Seq| {
                let mut p = pool(&b, &s, options);
                let one = [seq];
                let step = Step {
                    rows: s.rows.view(),
                    seqs: &one,
                    plane_stride: None,
                };
                let mut out = TensorData::filled(layout.len(), FILL, DType::Bf16);
                p.step_varlen(&step, out.view_mut()).unwrap();
                (out.to_f32(), read_all(p.as_mut()))
            };
            let seq = |len, commit| Seq {
                slot: 1,
                start: 2,
                len,
                commit,
            };
            let (y7, s7) = run(seq(7, Commit::First(3)));
            let (y3, s3) = run(seq(3, Commit::All));
            assert_eq!(bits(&s7[1].0), bits(&s3[1].0), "{options:?}");
            assert_eq!(bits(&s7[1].1), bits(&s3[1].1), "{options:?}");
            let r = 2 * sh.n()..5 * sh.n();
            assert_eq!(bits(&y7[r.clone()]), bits(&y3[r]), "{options:?}");
        }
    }
}

/// 16-bit outputs are the f32 outputs of the same kernel rounded once to nearest even (the host's `half`
/// conversions): planes and group sums included, values in f16's subnormal range and beyond its finite range
/// included (gamma scaled to push y there).
#[test]
fn sixteen_bit_outputs_are_the_f32_outputs_rounded_to_nearest_even() {
    for b in backends() {
        for scale in [1.0f32, 3e-6, 4e4] {
            let mut s = setup(21, 6, 1, [DType::F32; 4]);
            let mut params = s.layer.params.clone();
            params.gamma.iter_mut().for_each(|g| *g *= scale);
            s.layer = Layer::new(s.layer.config, params).unwrap();
            let sh = *s.layer.shape();
            let seqs = [Seq {
                slot: 0,
                start: 0,
                len: 6,
                commit: Commit::Verify,
            }];
            let stride = Some(6 * sh.n() + 16);
            let step = Step {
                rows: s.rows.view(),
                seqs: &seqs,
                plane_stride: stride,
            };
            let layout = OutputLayout::for_rows(&sh, 6, stride).unwrap();
            let mut p = pool(&b, &s, PoolOptions::default());
            let mut o32 = TensorData::filled(layout.len(), 0.0, DType::F32);
            p.step_varlen(&step, o32.view_mut()).unwrap();
            let o32 = o32.to_f32();
            for dt in [DType::Bf16, DType::F16] {
                let mut o16 = TensorData::filled(layout.len(), 0.0, dt);
                p.step_varlen(&step, o16.view_mut()).unwrap();
                let want = TensorData::from_f32(&o32, dt);
                let bad = o16
                    .to_f32()
                    .iter()
                    .zip(want.to_f32())
                    .filter(|(a, b)| a.to_bits() != b.to_bits())
                    .count();
                assert_eq!(
                    bad,
                    0,
                    "{} {dt:?} scale {scale}: {bad} elements differ",
                    b.name()
                );
            }
        }
    }
}

#[test]
fn per_call_buffers_are_released_above_the_keep_cap() {
    let keep = 64 << 10;
    let Some(b) = backend(Subgroups::Auto, keep) else {
        return;
    };
    let rows = 64;
    let s = setup(5, rows, 3, [DType::F32; 4]);
    let sh = *s.layer.shape();
    let mut big = b.pool(&s.layer, 3, PoolOptions::default()).unwrap();
    let mut small = b.pool(&s.layer, 3, PoolOptions::default()).unwrap();
    for (i, (st, h)) in s.init.iter().enumerate() {
        big.write_slot(i, st, h).unwrap();
        small.write_slot(i, st, h).unwrap();
    }
    let layout = OutputLayout::for_rows(&sh, rows, Some(rows * sh.n())).unwrap();
    let long = [Seq {
        slot: 0,
        start: 0,
        len: rows,
        commit: Commit::All,
    }];
    let step = Step {
        rows: s.rows.view(),
        seqs: &long,
        plane_stride: layout.plane_stride,
    };
    // the inputs alone are 64 rows of C f32 (40 KiB), the output with planes 4 x 64 x 128 floats (128 KiB)
    let mut out = vec![0.0f32; layout.len()];
    big.step_varlen(&step, (&mut out[..]).into()).unwrap();
    assert!(
        big.scratch_bytes() <= 2 * keep,
        "{} bytes of per-call buffers kept after a large call (cap {keep} each)",
        big.scratch_bytes()
    );
    // later small calls still work, and give what a pool that never saw the large call gives
    let short = [Seq {
        slot: 1,
        start: 3,
        len: 2,
        commit: Commit::All,
    }];
    let step = Step {
        seqs: &short,
        plane_stride: None,
        ..step
    };
    let n = OutputLayout::for_rows(&sh, rows, None).unwrap().len();
    let (mut o1, mut o2) = (vec![0.0f32; n], vec![0.0f32; n]);
    big.step_varlen(&step, (&mut o1[..]).into()).unwrap();
    small.step_varlen(&step, (&mut o2[..]).into()).unwrap();
    assert_eq!(bits(&o1), bits(&o2));
    assert!(small.scratch_bytes() <= 4 * keep);
}

#[test]
fn sizes_beyond_32_bit_indices_are_errors() {
    let Some(b) = backend(Subgroups::Auto, gdn_wgpu::DEFAULT_KEEP_BYTES) else {
        return;
    };
    let layer = layer(1);
    // past u32 indices, past usize in elements, past usize in bytes
    let past_u32 = (u32::MAX as usize) / layer.shape().state_len() + 1;
    for slots in [past_u32, usize::MAX / 2, usize::MAX] {
        for state in [DType::F32, DType::Bf16] {
            let options = PoolOptions {
                state,
                ..PoolOptions::default()
            };
            match b.create_pool_with(&layer, slots, options) {
                Err(Error::Backend(why)) => assert!(why.contains("state pool"), "{why}"),
                Err(e) => panic!("unexpected error {e}"),
                Ok(_) => panic!("a pool of {slots} slots was accepted"),
            }
        }
    }
    // a row-block count whose products overflow is lowered to one that fits, not wrapped
    let odd = Wgpu::with_options(Options {
        row_blocks: usize::MAX,
        ..common::env_options()
    });
    if let Ok(odd) = odd {
        let pool = odd.create_pool_with(&layer, 2, PoolOptions::default());
        assert!(pool.is_ok(), "{:?}", pool.err());
    }
    let err = b
        .create_pool_with(
            &layer,
            1,
            PoolOptions {
                state: DType::F16,
                ..PoolOptions::default()
            },
        )
        .err()
        .expect("f16 state refused");
    assert!(matches!(err, Error::Unsupported(_)), "{err}");
}

/// The seed's shape (d 128: the unrolled pipelines an H200 runs) in every pool option, f32 and bf16 activations,
/// against the oracle.
#[test]
fn seed_shape_in_every_pool_option() {
    let seqs = [
        Seq {
            slot: 1,
            start: 0,
            len: 3,
            commit: Commit::First(2),
        },
        Seq {
            slot: 0,
            start: 3,
            len: 1,
            commit: Commit::All,
        },
    ];
    for b in backends() {
        for (k, options) in all_options().into_iter().enumerate() {
            let (dtypes, out_dt) = if k % 2 == 0 {
                ([DType::F32; 4], DType::F32)
            } else {
                ([DType::Bf16; 4], DType::Bf16)
            };
            let mut rng = Synth::new(40 + k as u64);
            let layer = rng.layer(Config::new(Shape::SEED)).unwrap();
            let sh = *layer.shape();
            let init: Vec<_> = (0..2).map(|_| rng.seq_state(&layer)).collect();
            let bd = rng.batch(&layer, 1, 4);
            let s = Setup {
                layer,
                init,
                rows: RowsData::from_f32(&bd.qkv, &bd.alpha, &bd.beta, &bd.z, dtypes),
            };
            let step = Step {
                rows: s.rows.view(),
                seqs: &seqs,
                plane_stride: None,
            };
            let layout = OutputLayout::for_rows(&sh, 4, None).unwrap();
            let what = format!("{} {options:?} {dtypes:?}", b.name());
            let mut p = pool(&b, &s, options);
            let before = read_all(p.as_mut());
            let mut out = TensorData::filled(layout.len(), FILL, out_dt);
            p.step_varlen(&step, out.view_mut()).expect(&what);
            let after = read_all(p.as_mut());
            let mut states: Vec<SeqState> = before
                .iter()
                .map(|(st, h)| {
                    SeqState::from_f32(&options.layout.convert(StateLayout::KeyMajor, &sh, st), h)
                })
                .collect();
            let want =
                oracle::step_varlen(&s.layer, &mut states, &step, options.state, out_dt).unwrap();
            let e = gdn::relative_error(&out.to_f32(), &want);
            assert!(e < out_bound(out_dt), "{what}: output error {e:.2e}");
            let s_bound = if options.state == DType::Bf16 {
                1e-2
            } else {
                1e-5
            };
            for ((st, _), o) in after.iter().zip(&states) {
                let km = options.layout.convert(StateLayout::KeyMajor, &sh, st);
                let es = gdn::relative_error(&km, &o.s);
                assert!(es < s_bound, "{what}: state error {es:.2e}");
            }
        }
    }
}

/// Odd sizes where 16-bit tensors do not fill whole words: d 48 (three group sums a head, padded to four on
/// the device), h_v 3 and an odd row count (alpha and beta end in half a word), an odd plane stride; 16-bit
/// outputs equal the f32 ones rounded to nearest even, and match the oracle.
#[test]
fn odd_sizes_with_16_bit_tensors() {
    for b in backends() {
        let mut rng = Synth::new(77);
        let layer = rng
            .layer(Config::new(Shape::new(48, 1, 3).unwrap()))
            .unwrap();
        let sh = *layer.shape();
        let rows = 7;
        let init: Vec<_> = (0..2).map(|_| rng.seq_state(&layer)).collect();
        let bd = rng.batch(&layer, 1, rows);
        let seqs = [
            Seq {
                slot: 1,
                start: 0,
                len: 3,
                commit: Commit::Verify,
            },
            Seq {
                slot: 0,
                start: 3,
                len: 4,
                commit: Commit::Verify,
            },
        ];
        let stride = Some(rows * sh.n() + 5);
        let layout = OutputLayout::for_rows(&sh, rows, stride).unwrap();
        for dtypes in [[DType::Bf16; 4], [DType::F16; 4]] {
            let s = Setup {
                layer: layer.clone(),
                init: init.clone(),
                rows: RowsData::from_f32(&bd.qkv, &bd.alpha, &bd.beta, &bd.z, dtypes),
            };
            let step = Step {
                rows: s.rows.view(),
                seqs: &seqs,
                plane_stride: stride,
            };
            let mut p = pool(&b, &s, PoolOptions::default());
            let mut o32 = TensorData::filled(layout.len(), FILL, DType::F32);
            p.step_varlen(&step, o32.view_mut()).unwrap();
            let o32 = o32.to_f32();
            for out_dt in [DType::Bf16, DType::F16] {
                let what = format!("{} {dtypes:?} -> {out_dt:?}", b.name());
                let mut o16 = TensorData::filled(layout.len(), FILL, out_dt);
                p.step_varlen(&step, o16.view_mut()).unwrap();
                let want = TensorData::from_f32(&o32, out_dt).to_f32();
                let got = o16.to_f32();
                assert_eq!(
                    bits(&got),
                    bits(&want),
                    "{what}: not the f32 outputs rounded"
                );
                let mut states: Vec<SeqState> = init
                    .iter()
                    .map(|(st, h)| SeqState::from_f32(st, h))
                    .collect();
                let oracle_out =
                    oracle::step_varlen(&layer, &mut states, &step, DType::F32, out_dt).unwrap();
                let idx = written(&layout, &seqs);
                let g: Vec<f32> = idx.iter().map(|&i| got[i]).collect();
                let w: Vec<f64> = idx.iter().map(|&i| oracle_out[i]).collect();
                let e = gdn::relative_error(&g, &w);
                assert!(e < out_bound(out_dt), "{what}: output error {e:.2e}");
            }
        }
    }
}

/// `copy_slot` and `reset_slot` stay on the device: a copy is bitwise in every pool option (a forked sequence
/// then steps to the same bits), a reset zeroes, other slots are untouched; bad slots are errors.
#[test]
fn copy_and_reset_slots_on_the_device() {
    for b in backends() {
        for options in all_options() {
            let s = setup(8, 2, 3, [DType::F32; 4]);
            let sh = *s.layer.shape();
            let mut p = pool(&b, &s, options);
            let before = read_all(p.as_mut());
            p.copy_slot(0, 1).unwrap();
            p.reset_slot(2).unwrap();
            let after = read_all(p.as_mut());
            assert_eq!(bits(&after[1].0), bits(&before[0].0), "{options:?}");
            assert_eq!(bits(&after[1].1), bits(&before[0].1), "{options:?}");
            assert_eq!(bits(&after[0].0), bits(&before[0].0), "{options:?}");
            assert!(after[2]
                .0
                .iter()
                .chain(&after[2].1)
                .all(|&x| x.to_bits() == 0));
            let layout = OutputLayout::for_rows(&sh, 2, None).unwrap();
            let run = |p: &mut dyn LayerPool, slot| {
                let one = [Seq {
                    slot,
                    start: 0,
                    len: 2,
                    commit: Commit::All,
                }];
                let step = Step {
                    rows: s.rows.view(),
                    seqs: &one,
                    plane_stride: None,
                };
                let mut out = vec![0.0f32; layout.len()];
                p.step_varlen(&step, (&mut out[..]).into()).unwrap();
                out
            };
            let y0 = run(p.as_mut(), 0);
            let y1 = run(p.as_mut(), 1);
            assert_eq!(bits(&y0), bits(&y1), "{options:?}");
            let fin = read_all(p.as_mut());
            assert_eq!(bits(&fin[0].0), bits(&fin[1].0), "{options:?}");
            assert!(matches!(p.copy_slot(0, 3), Err(Error::SlotRange { .. })));
            assert!(matches!(p.reset_slot(3), Err(Error::SlotRange { .. })));
        }
    }
}
