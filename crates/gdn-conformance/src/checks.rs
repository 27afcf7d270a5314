//! The checks, each a function of a backend; `conformance_tests!` turns each into a `#[test]`.

use proptest::prelude::*;
use proptest::test_runner::{Config as PropConfig, TestRunner};

use crate::*;

fn small_shape() -> impl Strategy<Value = Shape> {
    (
        prop::sample::select(vec![16usize, 32, 48, 64]),
        1usize..=3,
        1usize..=4,
    )
        .prop_map(|(d, h_k, r)| Shape::new(d, h_k, h_k * r).expect("valid"))
}

fn case_spec() -> impl Strategy<Value = CaseSpec> {
    (
        small_shape(),
        1usize..=3,
        1usize..=12,
        any::<u64>(),
        prop::bool::ANY,
        prop::bool::ANY,
        prop::bool::ANY,
        prop::bool::ANY,
        0usize..3,
        0usize..=100,
    )
        .prop_map(
            |(shape, b, t, seed, grouped, silu, planes, skip, mode, kf)| {
                let mut c = CaseSpec::new(shape, b, t, seed);
                c.head_map = if grouped {
                    HeadMap::Grouped
                } else {
                    HeadMap::Tiled
                };
                c.gate = if silu { Gate::Silu } else { Gate::Sigmoid };
                c.planes = planes;
                c.skip_one = skip;
                c.commit = match mode {
                    0 => Commit::Verify,
                    1 => Commit::All,
                    _ => Commit::First(1 + kf % t),
                };
                c
            },
        )
}

/// Random shapes, inputs, commit modes, head maps, gates, planes and batches with skipped slots, against the
/// oracle within F32_BOUND.
pub fn matches_oracle_on_random_cases(backend: &dyn Backend, cases: u32) {
    let mut runner = TestRunner::new(PropConfig {
        cases,
        failure_persistence: None,
        ..PropConfig::default()
    });
    let worst = std::cell::Cell::new((0.0f64, 0.0f64, 0.0f64));
    runner
        .run(&case_spec(), |spec| {
            let e = check_against_oracle(backend, &spec.build());
            let w = worst.get();
            worst.set((w.0.max(e.0), w.1.max(e.1), w.2.max(e.2)));
            Ok(())
        })
        .unwrap();
    let worst = worst.get();
    eprintln!(
        "{}: worst relative error over {cases} random cases: y/planes {:.2e}, state {:.2e}, hist {:.2e}",
        backend.name(),
        worst.0,
        worst.1,
        worst.2
    );
}

/// The seed's shape, a few windows, each mode.
pub fn matches_oracle_at_seed_shape(backend: &dyn Backend) {
    for (i, (b, t, commit)) in [
        (1, 1, Commit::All),
        (2, 4, Commit::First(3)),
        (1, 8, Commit::Verify),
    ]
    .into_iter()
    .enumerate()
    {
        let mut spec = CaseSpec::new(Shape::SEED, b, t, 100 + i as u64);
        spec.commit = commit;
        spec.planes = i == 1;
        check_against_oracle(backend, &spec.build());
    }
}

/// A 256-token window, then hundreds of consecutive steps of 1 to 4 tokens (committed in full, in part or not at
/// all, with a slot forked now and then) against the oracle carried in float64 alongside: the error must not grow.
pub fn no_drift_over_long_runs(backend: &dyn Backend, steps: usize) {
    let shape = Shape::new(32, 2, 4).unwrap();
    let mut spec = CaseSpec::new(shape, 2, 256, 7);
    spec.head_map = HeadMap::Grouped;
    spec.spare_slots = 0;
    let case = spec.build();
    let mut pool = case.pool(backend);
    let mut states: Vec<SeqState> = oracle_states(&case.init);
    let mut rng = gdn::synth::Synth::new(99);
    let mut worst: f64 = 0.0;
    for step in 0..=steps {
        let t = if step == 0 { 256 } else { rng.index(1, 4) };
        // mostly decode-like commits, with verifies and partial commits in between (a backend that defers a
        // one-token update must apply it before whatever comes next), and now and then a fork
        let commit = match rng.index(0, 7) {
            _ if step == 0 => Commit::All,
            0 | 1 => Commit::Verify,
            2 => Commit::First(rng.index(1, t)),
            _ => Commit::All,
        };
        if step % 61 == 60 {
            pool.copy_slot(0, 1).unwrap();
            states[1] = states[0].clone();
        }
        let batch = rng.batch(&case.layer, 2, t);
        let slots = [1, 0];
        let args = StepArgs {
            batch: batch.view(),
            slots: &slots,
            commit,
            plane_stride: None,
        };
        let mut out = vec![0.0; 2 * t * shape.n()];
        pool.step(&args, &mut out).unwrap();
        let want = gdn::oracle::step(
            &case.layer,
            &mut states,
            &batch.view(),
            &slots,
            commit,
            None,
        )
        .unwrap();
        let e = gdn::relative_error(&out, &want);
        let got = read_slots(pool.as_mut());
        let e_s = got
            .iter()
            .zip(&states)
            .map(|((s, _), st)| gdn::relative_error(s, &st.s))
            .fold(0.0, f64::max);
        worst = worst.max(e).max(e_s);
        assert!(
            e < F32_BOUND && e_s < F32_BOUND,
            "step {step}: y {e:.2e} state {e_s:.2e}"
        );
    }
    eprintln!(
        "{}: worst error over {steps} steps after a 256-token window: {worst:.2e}",
        backend.name()
    );
}

/// `commit first k` equals a k-token `commit all` step, bitwise: y of the first k tokens, S and H.
pub fn commit_first_k_equals_k_token_step(backend: &dyn Backend) {
    for (seed, t) in [(1u64, 4usize), (2, 7), (3, 1)] {
        let mut spec = CaseSpec::new(Shape::new(48, 2, 6).unwrap(), 2, t, seed);
        spec.head_map = HeadMap::Grouped;
        for k in 1..=t {
            spec.commit = Commit::First(k);
            let full = spec.build();
            let got = run_backend(backend, &full);
            let mut short = full.clone();
            short.commit = Commit::All;
            short.batch = truncate(&full.batch, k, full.layer.shape());
            let want = run_backend(backend, &short);
            for (g, w) in got.slots.iter().zip(&want.slots) {
                assert!(
                    bits(&g.0) == bits(&w.0) && bits(&g.1) == bits(&w.1),
                    "t {t} k {k}: committed slots differ from a {k}-token step"
                );
            }
            let n = full.layer.shape().n();
            for b in 0..full.batch.b {
                let g = &got.out[(b * t) * n..(b * t + k) * n];
                let w = &want.out[(b * k) * n..(b * k + k) * n];
                assert!(
                    bits(g) == bits(w),
                    "t {t} k {k}: y of the first {k} tokens differs"
                );
            }
        }
    }
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// The first `k` tokens of every sequence of a batch.
pub fn truncate(batch: &BatchData, k: usize, shape: &Shape) -> BatchData {
    let t = batch.t;
    let take = |v: &[f32], w: usize| -> Vec<f32> {
        (0..batch.b)
            .flat_map(|b| v[b * t * w..(b * t + k) * w].to_vec())
            .collect()
    };
    BatchData {
        b: batch.b,
        t: k,
        qkv: take(&batch.qkv, shape.channels()),
        alpha: take(&batch.alpha, shape.h_v),
        beta: take(&batch.beta, shape.h_v),
        z: take(&batch.z, shape.n()),
    }
}

/// `verify` leaves every slot untouched, bitwise, and still writes y.
pub fn verify_mutates_nothing(backend: &dyn Backend) {
    let mut spec = CaseSpec::new(Shape::new(64, 2, 4).unwrap(), 3, 5, 11);
    spec.commit = Commit::Verify;
    let case = spec.build();
    let got = run_backend(backend, &case);
    for (i, (g, w)) in got.slots.iter().zip(&case.init).enumerate() {
        assert!(
            bits(&g.0) == bits(&w.0) && bits(&g.1) == bits(&w.1),
            "verify changed slot {i}"
        );
    }
    assert!(got.out.iter().all(|&x| x != POISON && x.is_finite()));
}

/// The invariants again on slots that have just committed a one-token window (a backend may keep that update
/// deferred until the next window reads the state): a verify of 1 or 5 tokens then changes no slot (bitwise) and
/// its y follows the oracle, and a 5-token window committed after k tokens (k 1 or 2) equals a k-token window, in
/// S, H and y, bitwise.
pub fn invariants_hold_after_a_one_token_commit(backend: &dyn Backend) {
    let mut spec = CaseSpec::new(Shape::new(32, 2, 4).unwrap(), 2, 5, 23);
    spec.spare_slots = 0;
    let case = spec.build();
    let n = case.layer.shape().n();
    let mut rng = gdn::synth::Synth::new(77);
    let decode = rng.batch(&case.layer, 2, 1);
    let window = rng.batch(&case.layer, 2, 5);
    let slots = [1, 0];
    let run = |pool: &mut dyn LayerPool, batch: &BatchData, commit: Commit| -> Vec<f32> {
        let mut out = vec![POISON; batch.b * batch.t * n];
        let args = StepArgs {
            batch: batch.view(),
            slots: &slots,
            commit,
            plane_stride: None,
        };
        pool.step(&args, &mut out).expect("step");
        out
    };
    for k in [1, 2] {
        let (mut a, mut b) = (case.pool(backend), case.pool(backend));
        for pool in [&mut a, &mut b] {
            run(pool.as_mut(), &decode, Commit::All);
        }
        let before = read_slots(a.as_mut());
        for verify in [&decode, &window] {
            let y = run(a.as_mut(), verify, Commit::Verify);
            let mut states: Vec<SeqState> = oracle_states(&before);
            let want = gdn::oracle::step(
                &case.layer,
                &mut states,
                &verify.view(),
                &slots,
                Commit::Verify,
                None,
            )
            .unwrap();
            let e = gdn::relative_error(&y, &want);
            assert!(
                e < F32_BOUND,
                "a {}-token verify after a one-token commit: y error {e:.2e}",
                verify.t
            );
            for (i, (g, w)) in read_slots(a.as_mut()).iter().zip(&before).enumerate() {
                assert!(
                    bits(&g.0) == bits(&w.0) && bits(&g.1) == bits(&w.1),
                    "a {}-token verify after a one-token commit changed slot {i}",
                    verify.t
                );
            }
        }
        let got = run(a.as_mut(), &window, Commit::First(k));
        let want = run(
            b.as_mut(),
            &truncate(&window, k, case.layer.shape()),
            Commit::All,
        );
        let (sa, sb) = (read_slots(a.as_mut()), read_slots(b.as_mut()));
        for (i, (g, w)) in sa.iter().zip(&sb).enumerate() {
            assert!(
                bits(&g.0) == bits(&w.0) && bits(&g.1) == bits(&w.1),
                "slot {i}: commit first {k} after a one-token commit differs from a {k}-token step"
            );
        }
        for row in 0..2 {
            assert!(
                bits(&got[row * 5 * n..(row * 5 + k) * n])
                    == bits(&want[row * k * n..(row + 1) * k * n]),
                "row {row}: y of the first {k} tokens differs"
            );
        }
    }
}

/// The same inputs give the same bits, run after run and pool after pool.
pub fn identical_inputs_identical_bits(backend: &dyn Backend) {
    let mut spec = CaseSpec::new(Shape::new(32, 3, 6).unwrap(), 3, 6, 5);
    spec.planes = true;
    spec.commit = Commit::First(4);
    let case = spec.build();
    let a = run_backend(backend, &case);
    for _ in 0..3 {
        let b = run_backend(backend, &case);
        assert!(
            bits(&a.out) == bits(&b.out),
            "outputs differ between identical runs"
        );
        for (x, y) in a.slots.iter().zip(&b.slots) {
            assert!(
                bits(&x.0) == bits(&y.0) && bits(&x.1) == bits(&y.1),
                "states differ between identical runs"
            );
        }
    }
}

/// Slots not named in a batch (and named with -1) stay bit-identical; skipped sequences' rows are not written.
pub fn untouched_slots_stay_untouched(backend: &dyn Backend) {
    let mut spec = CaseSpec::new(Shape::new(32, 2, 4).unwrap(), 4, 3, 21);
    spec.spare_slots = 3;
    spec.skip_one = true;
    spec.planes = true;
    let case = spec.build();
    let got = run_backend(backend, &case);
    let named = case.named_slots();
    for (i, slot) in got.slots.iter().enumerate() {
        if !named.contains(&i) {
            assert!(
                bits(&slot.0) == bits(&case.init[i].0),
                "untouched slot {i}: state changed"
            );
            assert!(
                bits(&slot.1) == bits(&case.init[i].1),
                "untouched slot {i}: hist changed"
            );
        }
    }
    let written = written_indices(&case);
    let mut is_written = vec![false; got.out.len()];
    for i in written {
        is_written[i] = true;
    }
    for (i, &x) in got.out.iter().enumerate() {
        if !is_written[i] {
            assert!(
                x.to_bits() == POISON.to_bits(),
                "output element {i} of a skipped row or padding was written"
            );
        }
    }
    check_against_oracle(backend, &case);
}

/// `reset_slot` zeroes one slot and `copy_slot` duplicates one, bitwise, touching no other slot; a forked
/// sequence then steps exactly like its original.
pub fn reset_and_copy_slots(backend: &dyn Backend) {
    let mut spec = CaseSpec::new(Shape::new(32, 2, 4).unwrap(), 2, 3, 71);
    spec.spare_slots = 2;
    let case = spec.build();
    let mut pool = case.pool(backend);
    pool.copy_slot(0, 3).unwrap();
    pool.reset_slot(2).unwrap();
    assert!(matches!(pool.copy_slot(0, 4), Err(Error::SlotRange { .. })));
    assert!(matches!(pool.copy_slot(4, 0), Err(Error::SlotRange { .. })));
    assert!(matches!(pool.reset_slot(4), Err(Error::SlotRange { .. })));
    let slots = read_slots(pool.as_mut());
    for (i, (s, h)) in slots.iter().enumerate() {
        let (ws, wh) = match i {
            2 => (vec![0.0; s.len()], vec![0.0; h.len()]),
            3 => case.init[0].clone(),
            _ => case.init[i].clone(),
        };
        assert!(
            bits(s) == bits(&ws) && bits(h) == bits(&wh),
            "slot {i} after reset_slot(2), copy_slot(0, 3)"
        );
    }
    // the fork steps like the original, bit for bit
    let batch = gdn::synth::Synth::new(72).batch(&case.layer, 2, 3);
    let mut out = vec![0.0; 2 * 3 * case.layer.shape().n()];
    let args = StepArgs {
        batch: batch.view(),
        slots: &[0, 3],
        commit: Commit::All,
        plane_stride: None,
    };
    // both sequences get the same window
    let mut same = batch.clone();
    let (c, hv, n) = (
        case.layer.shape().channels(),
        case.layer.shape().h_v,
        case.layer.shape().n(),
    );
    same.qkv.copy_within(0..3 * c, 3 * c);
    same.alpha.copy_within(0..3 * hv, 3 * hv);
    same.beta.copy_within(0..3 * hv, 3 * hv);
    same.z.copy_within(0..3 * n, 3 * n);
    let args = StepArgs {
        batch: same.view(),
        ..args
    };
    pool.step(&args, &mut out).unwrap();
    assert!(
        bits(&out[..3 * n]) == bits(&out[3 * n..]),
        "a forked sequence stepped differently"
    );
    let after = read_slots(pool.as_mut());
    assert!(
        bits(&after[0].0) == bits(&after[3].0),
        "a forked state diverged"
    );
}

/// The head map matters: a backend run with one map matches the oracle with that map and not with the other.
pub fn head_map_is_honoured(backend: &dyn Backend) {
    for map in [HeadMap::Tiled, HeadMap::Grouped] {
        let mut spec = CaseSpec::new(Shape::new(32, 2, 6).unwrap(), 1, 3, 31);
        spec.head_map = map;
        let case = spec.build();
        let got = run_backend(backend, &case);
        let (e, _, _) = errors_against_oracle(&case, &got);
        assert!(e < F32_BOUND, "{map:?}: {e:.2e}");
        let mut other = case.clone();
        other.layer.config.head_map = if map == HeadMap::Tiled {
            HeadMap::Grouped
        } else {
            HeadMap::Tiled
        };
        let (e_other, _, _) = errors_against_oracle(&other, &got);
        assert!(
            e_other > 1e-2,
            "{map:?}: the other map's oracle agrees ({e_other:.2e}): the map is not honoured"
        );
    }
}

/// Planes are y times their scales, and group sums are the even and odd partial sums of y, per row.
pub fn planes_and_group_sums_follow_y(backend: &dyn Backend) {
    let mut spec = CaseSpec::new(Shape::new(48, 1, 3).unwrap(), 2, 3, 41);
    spec.planes = true;
    let case = spec.build();
    let got = run_backend(backend, &case);
    let lay = case.layout();
    let ps = lay.plane_stride.unwrap();
    let n = lay.n;
    // each plane and the group sums against the oracle on their own (a combined norm would hide small planes)
    let (want, _) = run_oracle(&case);
    let y_len = lay.rows * n;
    for (what, at, len) in [
        ("y", 0, y_len),
        ("plane 1", ps, y_len),
        ("plane 2", 2 * ps, y_len),
        ("plane 3", 3 * ps, y_len),
        ("group sums", 4 * ps, y_len / 16),
    ] {
        let e = gdn::relative_error(&got.out[at..at + len], &want[at..at + len]);
        assert!(
            e < F32_BOUND,
            "{what}: relative error {e:.2e} against the oracle"
        );
    }
    for r in 0..lay.rows {
        for m in 0..n {
            let y = got.out[r * n + m];
            for p in 1..4 {
                let v = got.out[p * ps + r * n + m];
                assert!(
                    v == y * gdn::plane_scale(p, m),
                    "plane {p} row {r} col {m}: {v} vs y {y}"
                );
            }
        }
        for q in 0..n / 16 {
            let g = &got.out[r * n + 16 * q..r * n + 16 * q + 16];
            let even: f64 = g.iter().step_by(2).map(|&x| x as f64).sum();
            let odd: f64 = g.iter().skip(1).step_by(2).map(|&x| x as f64).sum();
            let scale: f64 = g.iter().map(|&x| (x as f64).abs()).sum::<f64>().max(1e-30);
            let s = got.out[4 * ps + r * (n / 16) + q] as f64;
            assert!(
                ((even + odd) - s).abs() / scale < 1e-6,
                "group sum row {r} group {q}: {s} vs {}",
                even + odd
            );
        }
    }
}

/// A NaN in an input reaches the output: the library never turns it into a finite number.
pub fn nan_inputs_are_not_hidden(backend: &dyn Backend) {
    let spec = CaseSpec::new(Shape::new(16, 1, 2).unwrap(), 1, 2, 51);
    let mut case = spec.build();
    case.batch.qkv[5] = f32::NAN; // a q channel of the first token
    let got = run_backend(backend, &case);
    let n = case.layer.shape().n();
    assert!(
        got.out[..n].iter().any(|x| x.is_nan()),
        "a NaN in q did not reach y"
    );
    let mut case2 = spec.build();
    case2.batch.alpha[0] = f32::NAN;
    let got2 = run_backend(backend, &case2);
    assert!(
        got2.out[..16].iter().any(|x| x.is_nan()),
        "a NaN in alpha did not reach y"
    );
    // an infinite v channel, and a NaN in a stored state: neither may come out finite
    let mut case3 = spec.build();
    case3.batch.qkv[2 * 16 + 3] = f32::INFINITY;
    let got3 = run_backend(backend, &case3);
    assert!(
        got3.out[..16].iter().any(|x| !x.is_finite()),
        "an infinite v did not reach y"
    );
    let mut case4 = spec.build();
    let slot = case4.slots[0] as usize;
    case4.init[slot].0[0] = f32::NAN;
    let got4 = run_backend(backend, &case4);
    assert!(
        got4.out[..n].iter().any(|x| x.is_nan()),
        "a NaN in the state did not reach y"
    );
    assert!(
        got4.slots[slot].0.iter().any(|x| x.is_nan()),
        "a NaN in the state was not carried into the committed state"
    );
}

/// Every class of bad input gets its error, and the pool and the output are left as they were.
pub fn bad_input_is_rejected_and_changes_nothing(backend: &dyn Backend) {
    let spec = CaseSpec::new(Shape::new(16, 1, 2).unwrap(), 2, 3, 61);
    let case = spec.build();
    let layout = case.layout();
    let short = |v: &[f32]| v[..v.len() - 1].to_vec();
    struct Call {
        batch: BatchData,
        slots: Vec<i32>,
        commit: Commit,
        planes: Option<usize>,
        out_len: usize,
    }
    type Mutate = Box<dyn Fn(&mut Call)>;
    type Expect = fn(&Error) -> bool;
    let n_slots = case.init.len() as i32;
    let cases: Vec<(&str, Mutate, Expect)> = vec![
        (
            "qkv too short",
            Box::new(move |c| c.batch.qkv = short(&c.batch.qkv)),
            |e| matches!(e, Error::Length { name: "qkv", .. }),
        ),
        (
            "alpha too short",
            Box::new(move |c| c.batch.alpha = short(&c.batch.alpha)),
            |e| matches!(e, Error::Length { name: "alpha", .. }),
        ),
        (
            "beta too short",
            Box::new(move |c| c.batch.beta = short(&c.batch.beta)),
            |e| matches!(e, Error::Length { name: "beta", .. }),
        ),
        (
            "z too short",
            Box::new(move |c| c.batch.z = short(&c.batch.z)),
            |e| matches!(e, Error::Length { name: "z", .. }),
        ),
        (
            "commit first 0",
            Box::new(|c| c.commit = Commit::First(0)),
            |e| matches!(e, Error::CommitRange { .. }),
        ),
        (
            "commit first T+1",
            Box::new(|c| c.commit = Commit::First(c.batch.t + 1)),
            |e| matches!(e, Error::CommitRange { .. }),
        ),
        (
            "plane stride too small",
            Box::new(|c| {
                let rows_n = c.batch.b * c.batch.t * 32;
                c.planes = Some(rows_n - 1);
                c.out_len = 4 * (rows_n - 1) + rows_n / 16;
            }),
            |e| matches!(e, Error::PlaneStride { .. }),
        ),
        (
            "plane stride that overflows",
            Box::new(|c| {
                c.planes = Some(usize::MAX / 2);
                c.out_len = 4;
            }),
            |e| matches!(e, Error::Param { name: "output", .. }),
        ),
        (
            "slot out of range",
            Box::new(move |c| c.slots[0] = n_slots),
            |e| matches!(e, Error::SlotRange { .. }),
        ),
        (
            "slot named twice",
            Box::new(|c| c.slots[1] = c.slots[0]),
            |e| matches!(e, Error::SlotTwice(_)),
        ),
        (
            "too few slot indices",
            Box::new(|c| {
                c.slots.pop();
            }),
            |e| matches!(e, Error::SlotCount { .. }),
        ),
        ("output too short", Box::new(|c| c.out_len -= 1), |e| {
            matches!(e, Error::Length { name: "output", .. })
        }),
        (
            "empty window",
            Box::new(|c| {
                c.batch = BatchData {
                    b: c.batch.b,
                    ..BatchData::default()
                }
            }),
            |e| matches!(e, Error::EmptyWindow),
        ),
    ];
    for (what, mutate, expect) in cases {
        let mut pool = case.pool(backend);
        let before = read_slots(pool.as_mut());
        let mut call = Call {
            batch: case.batch.clone(),
            slots: case.slots.clone(),
            commit: case.commit,
            planes: case.plane_stride,
            out_len: layout.len(),
        };
        mutate(&mut call);
        let mut out = vec![POISON; call.out_len];
        let args = StepArgs {
            batch: call.batch.view(),
            slots: &call.slots,
            commit: call.commit,
            plane_stride: call.planes,
        };
        let err = pool.step(&args, &mut out).expect_err(what);
        assert!(expect(&err), "{what}: unexpected error {err}");
        assert!(!err.to_string().is_empty());
        assert!(
            read_slots(pool.as_mut()) == before,
            "{what}: the pool changed"
        );
        assert!(
            out.iter().all(|x| x.to_bits() == POISON.to_bits()),
            "{what}: the output changed"
        );
    }
    // slot io
    let mut pool = case.pool(backend);
    let sh = *case.layer.shape();
    let mut s = vec![0.0; sh.state_len()];
    let mut h = vec![0.0; sh.hist_len()];
    assert!(matches!(
        pool.read_slot(case.init.len(), &mut s, &mut h),
        Err(Error::SlotRange { .. })
    ));
    assert!(matches!(
        pool.write_slot(0, &s[1..], &h),
        Err(Error::Length { name: "state", .. })
    ));
    assert!(matches!(
        pool.write_slot(0, &s, &h[1..]),
        Err(Error::Length { name: "hist", .. })
    ));
    assert!(
        read_slots(pool.as_mut()) == case.init,
        "failed slot writes changed the pool"
    );
}

/// Instantiates every check as a `#[test]` for one backend.
#[macro_export]
macro_rules! conformance_tests {
    // with a quantized out_proj (`|| -> gdn::Result<Box<dyn gdn::quant::QuantBackend>>`): its checks too
    ($make:expr, quant: $qmake:expr) => {
        $crate::conformance_tests!($make);
        $crate::conformance_tests!(@quant $qmake, out_proj_matches_the_dequantized_product, $crate::quant::out_proj_matches_the_dequantized_product);
        $crate::conformance_tests!(@quant $qmake, bad_out_proj_input_is_rejected, $crate::quant::bad_out_proj_input_is_rejected);
    };
    ($make:expr) => {
        $crate::conformance_tests!(@one $make, matches_oracle_on_random_cases, |b| $crate::checks::matches_oracle_on_random_cases(b, 48));
        $crate::conformance_tests!(@one $make, matches_oracle_at_seed_shape, $crate::checks::matches_oracle_at_seed_shape);
        $crate::conformance_tests!(@one $make, no_drift_over_long_runs, |b| $crate::checks::no_drift_over_long_runs(b, 300));
        $crate::conformance_tests!(@one $make, commit_first_k_equals_k_token_step, $crate::checks::commit_first_k_equals_k_token_step);
        $crate::conformance_tests!(@one $make, verify_mutates_nothing, $crate::checks::verify_mutates_nothing);
        $crate::conformance_tests!(@one $make, invariants_hold_after_a_one_token_commit, $crate::checks::invariants_hold_after_a_one_token_commit);
        $crate::conformance_tests!(@one $make, identical_inputs_identical_bits, $crate::checks::identical_inputs_identical_bits);
        $crate::conformance_tests!(@one $make, untouched_slots_stay_untouched, $crate::checks::untouched_slots_stay_untouched);
        $crate::conformance_tests!(@one $make, head_map_is_honoured, $crate::checks::head_map_is_honoured);
        $crate::conformance_tests!(@one $make, reset_and_copy_slots, $crate::checks::reset_and_copy_slots);
        $crate::conformance_tests!(@one $make, planes_and_group_sums_follow_y, $crate::checks::planes_and_group_sums_follow_y);
        $crate::conformance_tests!(@one $make, nan_inputs_are_not_hidden, $crate::checks::nan_inputs_are_not_hidden);
        $crate::conformance_tests!(@one $make, bad_input_is_rejected_and_changes_nothing, $crate::checks::bad_input_is_rejected_and_changes_nothing);
        $crate::conformance_tests!(@one $make, hf_fixtures_replay, $crate::fixtures::replay_all);
        $crate::conformance_tests!(@one $make, varlen_mixed_batches_match_oracle, |b| $crate::varlen::varlen_mixed_batches_match_oracle(b, 48));
        $crate::conformance_tests!(@one $make, varlen_sequence_bits_do_not_depend_on_the_batch, $crate::varlen::varlen_sequence_bits_do_not_depend_on_the_batch);
        $crate::conformance_tests!(@one $make, every_dtype_and_layout_matches_oracle, $crate::varlen::every_dtype_and_layout_matches_oracle);
        $crate::conformance_tests!(@one $make, bf16_state_invariants_hold, $crate::varlen::bf16_state_invariants_hold);
        $crate::conformance_tests!(@one $make, slot_io_in_every_layout, $crate::varlen::slot_io_in_every_layout);
        $crate::conformance_tests!(@one $make, bad_varlen_input_is_rejected_and_changes_nothing, $crate::varlen::bad_varlen_input_is_rejected_and_changes_nothing);
        $crate::conformance_tests!(@one $make, bf16_state_drift_is_bounded, |b| $crate::varlen::bf16_state_drift_is_bounded(b, 10_000));
        $crate::conformance_tests!(@one $make, every_shape_matches_oracle, $crate::varlen::every_shape_matches_oracle);
        $crate::conformance_tests!(@one $make, shards_side_by_side_equal_the_unsharded_step, $crate::varlen::shards_side_by_side_equal_the_unsharded_step);
        $crate::conformance_tests!(@one $make, speculative_steps_match_the_two_pass_flow, $crate::spec::speculative_steps_match_the_two_pass_flow);
        $crate::conformance_tests!(@one $make, bad_speculative_input_is_rejected, $crate::spec::bad_speculative_input_is_rejected);
        $crate::conformance_tests!(@one $make, prefill_long_windows_match_oracle, $crate::prefill::prefill_long_windows_match_oracle);
        $crate::conformance_tests!(@one $make, prefill_invariants_hold, $crate::prefill::prefill_invariants_hold);
    };
    (@quant $make:expr, $name:ident, $check:expr) => {
        #[test]
        fn $name() {
            if let Some(b) = $crate::quant::quant_or_skip($make, stringify!($name)) {
                let check: &dyn Fn(&dyn $crate::gdn::quant::QuantBackend) = &$check;
                check(b.as_ref());
            }
        }
    };
    (@one $make:expr, $name:ident, $check:expr) => {
        #[test]
        fn $name() {
            if let Some(b) = $crate::backend_or_skip($make, stringify!($name)) {
                let check: &dyn Fn(&dyn $crate::gdn::Backend) = &$check;
                check(b.as_ref());
            }
        }
    };
}
