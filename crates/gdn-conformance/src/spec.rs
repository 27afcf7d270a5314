//! Speculative steps (SPEC.md, "Speculative steps"): a backend's native `step_spec` bitwise against the seed's
//! flow on the same backend ([`gdn::spec::TwoPass`]), and that flow against the float64 oracle, over hundreds of
//! steps of random windows, acceptances, plain commits, skipped slots, forks and resets.

use gdn::spec::TwoPass;
use gdn::{DType, PoolOptions, RowsData, Seq, StateLayout, Step, TensorData};

use crate::varlen::bound;
use crate::*;

/// A small deterministic generator of the step plan (Synth makes the values).
struct Plan(u64);

impl Plan {
    fn below(&mut self, n: usize) -> usize {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 33) % n.max(1) as u64) as usize
    }
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// The oracle's seed flow: held rows per slot; a step first commits each accepted prefix, then runs the windows.
struct OracleFlow {
    states: Vec<SeqState>,
    held: Vec<Option<(RowsData, usize)>>,
}

fn oracle_run(layer: &Layer, states: &mut [SeqState], step: &Step<'_>, state: DType) -> Vec<f64> {
    oracle::step_varlen(layer, states, step, state, DType::F32).expect("oracle step")
}

fn slice_rows(r: &RowsData, sh: &Shape, start: usize, len: usize) -> RowsData {
    let cut = |t: &TensorData, w: usize| t.to_f32()[start * w..(start + len) * w].to_vec();
    RowsData::from_f32(
        &cut(&r.qkv, sh.channels()),
        &cut(&r.alpha, sh.h_v),
        &cut(&r.beta, sh.h_v),
        &cut(&r.z, sh.n()),
        [DType::F32; 4],
    )
}

/// Native `step_spec` against `TwoPass` on the same backend, bitwise, and `TwoPass` against the oracle.
pub fn speculative_steps_match_the_two_pass_flow(backend: &dyn Backend) {
    for (shape, state, steps, seed) in [
        (Shape::new(32, 2, 4).unwrap(), DType::F32, 240, 5u64),
        (Shape::new(32, 2, 4).unwrap(), DType::Bf16, 120, 6),
        (Shape::SEED, DType::F32, 12, 7),
    ] {
        let mut rng = Synth::new(seed);
        let mut plan = Plan(seed);
        let layer = random_layer(&mut rng, shape, HeadMap::Grouped, Gate::Silu);
        let slots = 6;
        let options = PoolOptions {
            state,
            layout: StateLayout::KeyMajor,
        };
        let mut native = backend
            .create_pool_with(&layer, slots, options)
            .expect("pool");
        let mut flow = TwoPass::new(
            backend
                .create_pool_with(&layer, slots, options)
                .expect("pool"),
        );
        let mut oracle = OracleFlow {
            states: Vec::new(),
            held: vec![None; slots],
        };
        for slot in 0..slots {
            let (s, h) = rng.seq_state(&layer);
            let s: Vec<f32> = s.iter().map(|&x| state.round(x)).collect();
            native.write_slot(slot, &s, &h).unwrap();
            flow.write_slot(slot, &s, &h).unwrap();
            oracle.states.push(SeqState::from_f32(&s, &h));
        }
        let empty = RowsData::from_f32(&[], &[], &[], &[], [DType::F32; 4]);
        let native_ok = {
            let probe = Step {
                rows: empty.view(),
                seqs: &[],
                plane_stride: None,
            };
            match native.step_spec(&probe, &[], gdn::TensorMut::F32(&mut [])) {
                Err(Error::Unsupported(why)) => {
                    use std::io::Write;
                    let _ = writeln!(
                        std::io::stderr(),
                        "note: no native step_spec on this backend ({why}): its two-pass flow is checked"
                    );
                    false
                }
                _ => true,
            }
        };
        let (mut worst_y, mut worst_s) = (0.0f64, 0.0f64);
        for step_i in 0..steps {
            // a fork or a reset now and then (held windows travel with a fork, a reset drops them)
            match plan.below(12) {
                0 => {
                    let (a, b) = (plan.below(slots), plan.below(slots));
                    if a != b {
                        if native_ok {
                            native.copy_slot(a, b).unwrap();
                        }
                        flow.copy_slot(a, b).unwrap();
                        oracle.states[b] = oracle.states[a].clone();
                        oracle.held[b] = oracle.held[a].clone();
                    }
                }
                1 => {
                    let a = plan.below(slots);
                    if native_ok {
                        native.reset_slot(a).unwrap();
                    }
                    flow.reset_slot(a).unwrap();
                    let sh = *layer.shape();
                    oracle.states[a] = SeqState::zeros(&layer);
                    let _ = sh;
                    oracle.held[a] = None;
                }
                _ => {}
            }
            // the call: a few slots, each a window of 1..=6 tokens; most verify (held), some commit plainly
            let n = 1 + plan.below(4);
            let mut chosen: Vec<usize> = Vec::new();
            while chosen.len() < n {
                let s = plan.below(slots);
                if !chosen.contains(&s) {
                    chosen.push(s);
                }
            }
            let mut seqs = Vec::new();
            let mut accept = Vec::new();
            let mut row = 0;
            for (i, &slot) in chosen.iter().enumerate() {
                let len = 1 + plan.below(6);
                let commit = match plan.below(8) {
                    0 => Commit::All,
                    1 => Commit::First(1 + plan.below(len)),
                    _ => Commit::Verify,
                };
                let skip = i == 0 && plan.below(10) == 0;
                let held = flow.held(slot);
                seqs.push(Seq {
                    slot: if skip { -1 } else { slot as i32 },
                    start: row,
                    len,
                    commit,
                });
                // fully rejected, fully accepted, or anything between
                accept.push(match plan.below(4) {
                    0 => 0,
                    1 => held,
                    _ => plan.below(held + 1),
                });
                row += len;
            }
            let data = rng.batch(&layer, 1, row);
            let sh = *layer.shape();
            let rows =
                RowsData::from_f32(&data.qkv, &data.alpha, &data.beta, &data.z, [DType::F32; 4]);
            let step = Step {
                rows: rows.view(),
                seqs: &seqs,
                plane_stride: None,
            };
            let mut y_flow = vec![0.0f32; row * sh.n()];
            flow.step_spec(&step, &accept, gdn::TensorMut::F32(&mut y_flow))
                .expect("two-pass step_spec");
            if native_ok {
                let mut y_nat = vec![0.0f32; row * sh.n()];
                native
                    .step_spec(&step, &accept, gdn::TensorMut::F32(&mut y_nat))
                    .expect("native step_spec");
                assert_eq!(
                    bits(&y_nat),
                    bits(&y_flow),
                    "step {step_i}: y differs from the two-pass flow"
                );
                for slot in 0..slots {
                    assert_eq!(
                        native.held(slot),
                        flow.held(slot),
                        "step {step_i}: slot {slot} held"
                    );
                }
            }
            // the oracle: accepted prefixes first, then the windows
            for (s, &a) in seqs.iter().zip(&accept) {
                if s.slot < 0 {
                    continue;
                }
                let slot = s.slot as usize;
                if let Some((held_rows, len)) = oracle.held[slot].take() {
                    if a > 0 {
                        let one = [Seq {
                            slot: slot as i32,
                            start: 0,
                            len,
                            commit: Commit::First(a),
                        }];
                        oracle_run(
                            &layer,
                            &mut oracle.states,
                            &Step {
                                rows: held_rows.view(),
                                seqs: &one,
                                plane_stride: None,
                            },
                            state,
                        );
                    }
                }
            }
            let want = oracle_run(&layer, &mut oracle.states, &step, state);
            for s in seqs
                .iter()
                .filter(|s| s.slot >= 0 && s.commit == Commit::Verify)
            {
                oracle.held[s.slot as usize] =
                    Some((slice_rows(&rows, &sh, s.start, s.len), s.len));
            }
            let live: Vec<usize> = seqs
                .iter()
                .filter(|s| s.slot >= 0)
                .flat_map(|s| s.start * sh.n()..(s.start + s.len) * sh.n())
                .collect();
            let g: Vec<f32> = live.iter().map(|&i| y_flow[i]).collect();
            let w: Vec<f64> = live.iter().map(|&i| want[i]).collect();
            worst_y = worst_y.max(gdn::relative_error(&g, &w));
        }
        // every slot's committed state and history, native against the flow bitwise, the flow against the oracle
        let sh = *layer.shape();
        for slot in 0..slots {
            let (mut s1, mut h1) = (vec![0.0; sh.state_len()], vec![0.0; sh.hist_len()]);
            flow.read_slot(slot, &mut s1, &mut h1).unwrap();
            if native_ok {
                let (mut s2, mut h2) = (vec![0.0; sh.state_len()], vec![0.0; sh.hist_len()]);
                native.read_slot(slot, &mut s2, &mut h2).unwrap();
                assert_eq!(bits(&s2), bits(&s1), "slot {slot}: committed state differs");
                assert_eq!(bits(&h2), bits(&h1), "slot {slot}: history differs");
                // a held window committed the same way
                let a = flow.held(slot);
                native.commit_held(slot, a).unwrap();
                flow.commit_held(slot, a).unwrap();
                native.read_slot(slot, &mut s2, &mut h2).unwrap();
                flow.read_slot(slot, &mut s1, &mut h1).unwrap();
                assert_eq!(
                    bits(&s2),
                    bits(&s1),
                    "slot {slot}: state after commit_held differs"
                );
                assert_eq!(
                    bits(&h2),
                    bits(&h1),
                    "slot {slot}: history after commit_held differs"
                );
                assert_eq!(native.held(slot), 0);
                flow.read_slot(slot, &mut s1, &mut h1).unwrap();
                if let Some((held_rows, len)) = oracle.held[slot].take() {
                    let one = [Seq {
                        slot: slot as i32,
                        start: 0,
                        len,
                        commit: Commit::First(a.max(1)),
                    }];
                    if a > 0 {
                        oracle_run(
                            &layer,
                            &mut oracle.states,
                            &Step {
                                rows: held_rows.view(),
                                seqs: &one,
                                plane_stride: None,
                            },
                            state,
                        );
                    }
                }
            }
            let (ws, wh) = (&oracle.states[slot].s, &oracle.states[slot].h);
            worst_s = worst_s.max(gdn::relative_error(&s1, ws));
            assert_eq!(
                bits(&h1),
                bits(&wh.iter().map(|&x| x as f32).collect::<Vec<_>>()),
                "slot {slot}: history differs from the oracle's"
            );
        }
        // a bf16 state: both sides round the committed state to bf16, now and then to neighbouring values
        let b = bound(state);
        assert!(
            worst_y <= b && worst_s <= b,
            "{shape:?} {state:?}: the speculative flow against the oracle: y {worst_y:.2e}, state {worst_s:.2e}"
        );
    }
}

/// Bad speculative input: an acceptance past the held window, a plain step on a slot that holds one, a window
/// too long to hold: each an error that changes nothing.
pub fn bad_speculative_input_is_rejected(backend: &dyn Backend) {
    let mut rng = Synth::new(9);
    let layer = random_layer(
        &mut rng,
        Shape::new(32, 2, 4).unwrap(),
        HeadMap::Grouped,
        Gate::Silu,
    );
    let sh = *layer.shape();
    let mut pool = backend.create_pool(&layer, 3).expect("pool");
    let empty = RowsData::from_f32(&[], &[], &[], &[], [DType::F32; 4]);
    let probe = Step {
        rows: empty.view(),
        seqs: &[],
        plane_stride: None,
    };
    if let Err(Error::Unsupported(_)) = pool.step_spec(&probe, &[], gdn::TensorMut::F32(&mut [])) {
        pool = Box::new(TwoPass::new(pool));
    }
    let data = rng.batch(&layer, 1, 4);
    let rows = RowsData::from_f32(&data.qkv, &data.alpha, &data.beta, &data.z, [DType::F32; 4]);
    let seqs = [Seq {
        slot: 1,
        start: 0,
        len: 4,
        commit: Commit::Verify,
    }];
    let step = Step {
        rows: rows.view(),
        seqs: &seqs,
        plane_stride: None,
    };
    let mut y = vec![0.0f32; 4 * sh.n()];
    // nothing held: accepting anything is an error
    assert!(pool
        .step_spec(&step, &[1], gdn::TensorMut::F32(&mut y))
        .is_err());
    assert!(pool
        .step_spec(&step, &[], gdn::TensorMut::F32(&mut y))
        .is_err());
    pool.step_spec(&step, &[0], gdn::TensorMut::F32(&mut y))
        .unwrap();
    assert_eq!(pool.held(1), 4);
    let before = read_slots(pool.as_mut());
    assert!(pool
        .step_spec(&step, &[5], gdn::TensorMut::F32(&mut y))
        .is_err());
    assert!(pool
        .step_varlen(&step, gdn::TensorMut::F32(&mut y))
        .is_err());
    assert!(pool.commit_held(1, 5).is_err());
    assert!(pool.commit_held(3, 0).is_err());
    assert_eq!(
        read_slots(pool.as_mut()),
        before,
        "a rejected call changed a slot"
    );
    assert_eq!(pool.held(1), 4, "a rejected call dropped the held window");
    pool.copy_slot(1, 1).unwrap();
    assert_eq!(
        pool.held(1),
        4,
        "copying a slot onto itself dropped its held window"
    );
    pool.commit_held(1, 2).unwrap();
    assert_eq!(pool.held(1), 0);
    pool.step_varlen(&step, gdn::TensorMut::F32(&mut y))
        .unwrap();
}
