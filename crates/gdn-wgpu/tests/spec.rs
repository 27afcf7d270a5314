//! The native speculative step (`step_spec`) in every pool option (f32 / bf16 state, key- / value-major), with
//! 16-bit activations and outputs, on both reduction paths: bitwise against `gdn::spec::TwoPass` around the same
//! backend over random windows of 1 to 16 tokens (the longest a slot holds), acceptances, plain commits beside
//! held windows, skipped sequences, forks, resets and `commit_held`; a window past 16 tokens refused with
//! nothing touched. (The conformance suite checks the key-major f32-activation case and the oracle.) Skipped
//! without an adapter unless `GDN_WGPU_REQUIRE=1`.

use gdn::spec::TwoPass;
use gdn::step::{RowsData, Seq, Step, TensorData};
use gdn::synth::Synth;
use gdn::{
    Backend, Commit, Config, DType, Error, Layer, LayerPool, OutputLayout, PoolOptions, Shape,
    StateLayout,
};
use gdn_wgpu::{Options, Subgroups, Wgpu};

mod common;

fn backends() -> Vec<Wgpu> {
    [Subgroups::Require, Subgroups::Off]
        .into_iter()
        .filter_map(|subgroups| {
            let options = Options {
                subgroups,
                ..common::env_options()
            };
            common::backend_or_skip(options, "wgpu spec test")
        })
        .collect()
}

fn layer(seed: u64) -> Layer {
    layer_of(Shape::new(32, 2, 4).unwrap(), seed)
}

/// A layer whose head map alternates with the seed (tiled, grouped): the value heads that share a q/k head, and
/// which of them writes their shared held records, differ.
fn layer_of(shape: Shape, seed: u64) -> Layer {
    let mut config = Config::new(shape);
    config.gate = gdn::Gate::Silu;
    if seed % 2 == 1 {
        config.head_map = gdn::HeadMap::Grouped;
    }
    Synth::new(seed).layer(config).unwrap()
}

fn bits(t: &TensorData) -> Vec<u32> {
    match t {
        TensorData::F32(x) => x.iter().map(|v| v.to_bits()).collect(),
        TensorData::Bf16(x) => x.iter().map(|v| v.to_bits() as u32).collect(),
        TensorData::F16(x) => x.iter().map(|v| v.to_bits() as u32).collect(),
    }
}

fn slot_bits(pool: &mut dyn LayerPool, slot: usize) -> (Vec<u32>, Vec<u32>) {
    let sh = *pool.layer().shape();
    let (mut s, mut h) = (vec![0.0f32; sh.state_len()], vec![0.0f32; sh.hist_len()]);
    pool.read_slot(slot, &mut s, &mut h).unwrap();
    (
        s.iter().map(|v| v.to_bits()).collect(),
        h.iter().map(|v| v.to_bits()).collect(),
    )
}

/// A small deterministic generator for the plan of each step.
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

#[test]
fn native_speculative_steps_match_the_two_pass_flow_in_every_option() {
    let small = Shape::new(32, 2, 4).unwrap();
    use DType::{Bf16, F16, F32};
    use StateLayout::{KeyMajor, ValueMajor};
    // (shape, state, layout, input dtypes, output dtype, steps): the seed shape's unrolled pipelines once
    let cases = [
        (small, F32, KeyMajor, [Bf16; 4], Bf16, 40),
        (small, F32, ValueMajor, [F16, F32, Bf16, F32], F32, 40),
        (small, Bf16, KeyMajor, [F32; 4], F16, 40),
        (small, Bf16, ValueMajor, [Bf16, Bf16, F32, F16], Bf16, 40),
        (Shape::SEED, Bf16, ValueMajor, [Bf16; 4], Bf16, 6),
    ];
    for backend in backends() {
        for (ci, &(shape, state, layout, dtypes, out_dt, steps)) in cases.iter().enumerate() {
            let layer = layer_of(shape, 40 + ci as u64);
            let sh = *layer.shape();
            let slots = 5;
            let options = PoolOptions { state, layout };
            let mut native = backend.create_pool_with(&layer, slots, options).unwrap();
            let mut flow = TwoPass::new(backend.create_pool_with(&layer, slots, options).unwrap());
            let mut rng = Synth::new(7 + ci as u64);
            for slot in 0..slots {
                let (s, h) = rng.seq_state(&layer);
                native.write_slot(slot, &s, &h).unwrap();
                flow.write_slot(slot, &s, &h).unwrap();
            }
            let mut plan = Plan(99 + ci as u64);
            for step_i in 0..steps {
                match plan.below(12) {
                    0 => {
                        let (a, b) = (plan.below(slots), plan.below(slots));
                        native.copy_slot(a, b).unwrap();
                        flow.copy_slot(a, b).unwrap();
                    }
                    1 => {
                        let a = plan.below(slots);
                        let k = plan.below(flow.held(a) + 1);
                        native.commit_held(a, k).unwrap();
                        flow.commit_held(a, k).unwrap();
                    }
                    2 => {
                        let a = plan.below(slots);
                        native.reset_slot(a).unwrap();
                        flow.reset_slot(a).unwrap();
                    }
                    _ => {}
                }
                // three distinct slots and one skipped sequence, rows packed with a gap
                let first = plan.below(slots);
                let mut seqs = Vec::new();
                let mut accept = Vec::new();
                let mut row = 0;
                for k in 0..4 {
                    let len = if plan.below(5) == 0 {
                        16
                    } else {
                        1 + plan.below(8)
                    };
                    let slot = if k == 3 {
                        -1
                    } else {
                        ((first + k) % slots) as i32
                    };
                    let commit = match plan.below(6) {
                        0 => Commit::All,
                        1 => Commit::First(1 + plan.below(len)),
                        _ => Commit::Verify,
                    };
                    seqs.push(Seq {
                        slot,
                        start: row,
                        len,
                        commit,
                    });
                    let held = if slot >= 0 {
                        flow.held(slot as usize)
                    } else {
                        0
                    };
                    accept.push(match plan.below(3) {
                        0 => held,
                        _ => plan.below(held + 1),
                    });
                    row += len + plan.below(2);
                }
                let data = rng.batch(&layer, 1, row);
                let rows = RowsData::from_f32(&data.qkv, &data.alpha, &data.beta, &data.z, dtypes);
                let step = Step {
                    rows: rows.view(),
                    seqs: &seqs,
                    plane_stride: None,
                };
                let n = OutputLayout::for_rows(&sh, row, None).unwrap().len();
                let mut y_nat = TensorData::from_f32(&vec![0.0; n], out_dt);
                let mut y_flow = y_nat.clone();
                native.step_spec(&step, &accept, y_nat.view_mut()).unwrap();
                flow.step_spec(&step, &accept, y_flow.view_mut()).unwrap();
                assert!(
                    bits(&y_nat) == bits(&y_flow),
                    "case {ci} step {step_i}: outputs differ"
                );
                for slot in 0..slots {
                    assert_eq!(
                        native.held(slot),
                        flow.held(slot),
                        "case {ci} step {step_i}"
                    );
                }
                if step_i % 8 == 7 || step_i + 1 == steps {
                    for slot in 0..slots {
                        assert!(
                            slot_bits(native.as_mut(), slot) == slot_bits(&mut flow, slot),
                            "case {ci} step {step_i}: slot {slot} differs"
                        );
                    }
                }
            }
            for slot in 0..slots {
                let k = flow.held(slot);
                native.commit_held(slot, k).unwrap();
                flow.commit_held(slot, k).unwrap();
                assert!(
                    slot_bits(native.as_mut(), slot) == slot_bits(&mut flow, slot),
                    "case {ci}: slot {slot} differs after commit_held"
                );
            }
        }
    }
}

#[test]
fn a_window_past_sixteen_tokens_is_not_held() {
    for backend in backends() {
        let layer = layer(3);
        let sh = *layer.shape();
        let mut pool = backend.create_pool(&layer, 2).unwrap();
        let data = Synth::new(5).batch(&layer, 1, 17);
        let rows = RowsData::from_f32(&data.qkv, &data.alpha, &data.beta, &data.z, [DType::F32; 4]);
        let mut y = vec![0.0f32; 17 * sh.n()];
        let seq = |len, commit| {
            [Seq {
                slot: 0,
                start: 0,
                len,
                commit,
            }]
        };
        let held = seq(4, Commit::Verify);
        fn step<'a>(rows: &'a RowsData, seqs: &'a [Seq]) -> Step<'a> {
            Step {
                rows: rows.view(),
                seqs,
                plane_stride: None,
            }
        }
        pool.step_spec(&step(&rows, &held), &[0], (&mut y[..]).into())
            .unwrap();
        let before = slot_bits(pool.as_mut(), 0);
        // a plain step on the holding slot: check_step says what step_varlen would, and neither touches it
        let plain = seq(4, Commit::All);
        let checked = pool
            .check_step(&step(&rows, &plain), y.len())
            .map_err(|e| e.to_string());
        let ran = pool
            .step_varlen(&step(&rows, &plain), (&mut y[..]).into())
            .map_err(|e| e.to_string());
        assert!(
            checked.is_err(),
            "check_step let a plain step on a holding slot through"
        );
        assert_eq!(checked, ran);
        let long = seq(17, Commit::Verify);
        match pool.step_spec(&step(&rows, &long), &[3], (&mut y[..]).into()) {
            Err(Error::Unsupported(_)) => {}
            other => panic!("a 17-token held window: {other:?}"),
        }
        assert_eq!(pool.held(0), 4, "the refused call dropped the held window");
        assert!(slot_bits(pool.as_mut(), 0) == before);
        // a 17-token window that commits is no held window
        let all = seq(17, Commit::All);
        pool.step_spec(&step(&rows, &all), &[3], (&mut y[..]).into())
            .unwrap();
        assert_eq!(pool.held(0), 0);
    }
}
