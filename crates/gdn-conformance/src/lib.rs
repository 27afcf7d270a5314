//! The conformance suite: every backend runs these same checks on the same cases (the way ggml's
//! test-backend-ops checks every backend against the CPU). A backend's test file is one line:
//! `gdn_conformance::conformance_tests!(|| make_backend());` where `make_backend()` returns
//! `gdn::Result<Box<dyn gdn::Backend>>`; an `Error::Unavailable` skips each test with a message on stderr.

pub mod fixtures;
pub mod quant;
pub mod spec;

pub use gdn;
pub use proptest;

use gdn::oracle::{self, SeqState};
use gdn::synth::Synth;
use gdn::{
    Backend, BatchData, Commit, Config, Error, Gate, HeadMap, Layer, LayerPool, OutputLayout,
    Shape, StepArgs,
};

/// The bound on `||out - ref|| / ||ref||` per tensor for an f32 backend against the float64 oracle.
/// SPEC.md asks for "far under 1e-4"; measured CPU errors are around 1e-7 (see BENCHMARKS.md / README).
pub const F32_BOUND: f64 = 1e-5;

/// Builds the backend or says on stderr (past the test harness's capture) why this test is skipped.
pub fn backend_or_skip(
    make: impl FnOnce() -> gdn::Result<Box<dyn Backend>>,
    test: &str,
) -> Option<Box<dyn Backend>> {
    match make() {
        Ok(b) => Some(b),
        Err(Error::Unavailable(why)) => {
            use std::io::Write;
            let _ = writeln!(
                std::io::stderr(),
                "SKIPPED {test}: backend unavailable: {why}"
            );
            None
        }
        Err(e) => panic!("{test}: backend failed to start: {e}"),
    }
}

/// A random layer of this shape and these conventions (eps 1e-6).
pub fn random_layer(rng: &mut Synth, shape: Shape, head_map: HeadMap, gate: Gate) -> Layer {
    let config = Config {
        shape,
        head_map,
        gate,
        eps: 1e-6,
    };
    rng.layer(config).expect("valid random layer")
}

/// One step to check: a layer, the pool's initial slots, a batch and its arguments.
#[derive(Clone, Debug)]
pub struct Case {
    pub layer: Layer,
    /// Initial (state, hist) of every pool slot.
    pub init: Vec<(Vec<f32>, Vec<f32>)>,
    pub batch: BatchData,
    pub slots: Vec<i32>,
    pub commit: Commit,
    pub plane_stride: Option<usize>,
}

/// What varies between random cases.
#[derive(Clone, Copy, Debug)]
pub struct CaseSpec {
    pub shape: Shape,
    pub head_map: HeadMap,
    pub gate: Gate,
    pub b: usize,
    pub t: usize,
    pub commit: Commit,
    pub planes: bool,
    /// Pool slots beyond the batch's, left untouched by the step.
    pub spare_slots: usize,
    /// Skip one sequence of the batch (slot -1).
    pub skip_one: bool,
    pub seed: u64,
}

impl CaseSpec {
    pub fn new(shape: Shape, b: usize, t: usize, seed: u64) -> Self {
        CaseSpec {
            shape,
            head_map: HeadMap::Tiled,
            gate: Gate::Sigmoid,
            b,
            t,
            commit: Commit::All,
            planes: false,
            spare_slots: 1,
            skip_one: false,
            seed,
        }
    }

    pub fn build(&self) -> Case {
        let mut rng = Synth::new(self.seed);
        let layer = random_layer(&mut rng, self.shape, self.head_map, self.gate);
        let n_slots = self.b + self.spare_slots;
        let init = (0..n_slots).map(|_| rng.seq_state(&layer)).collect();
        let batch = rng.batch(&layer, self.b, self.t);
        // slots in reverse order (sequence b in slot b_n - 1 - b), so batch order and pool order differ; spare
        // slots sit after them
        let mut slots: Vec<i32> = (0..self.b as i32).rev().collect();
        if self.skip_one && self.b > 1 {
            slots[self.b / 2] = -1;
        }
        let rows_n = self.b * self.t * self.shape.n();
        let plane_stride = self.planes.then_some(rows_n + 16);
        Case {
            layer,
            init,
            batch,
            slots,
            commit: self.commit,
            plane_stride,
        }
    }
}

impl Case {
    pub fn args(&self) -> StepArgs<'_> {
        StepArgs {
            batch: self.batch.view(),
            slots: &self.slots,
            commit: self.commit,
            plane_stride: self.plane_stride,
        }
    }

    /// The pool slots the batch names (skipped sequences left out).
    pub fn named_slots(&self) -> Vec<usize> {
        self.slots
            .iter()
            .filter(|&&s| s >= 0)
            .map(|&s| s as usize)
            .collect()
    }

    pub fn layout(&self) -> OutputLayout {
        OutputLayout::new(
            self.layer.shape(),
            self.batch.b,
            self.batch.t,
            self.plane_stride,
        )
        .expect("valid layout")
    }

    /// A pool on `backend` loaded with the case's initial slots.
    pub fn pool(&self, backend: &dyn Backend) -> Box<dyn LayerPool> {
        let mut pool = backend
            .create_pool(&self.layer, self.init.len())
            .expect("create_pool");
        for (i, (s, h)) in self.init.iter().enumerate() {
            pool.write_slot(i, s, h).expect("write_slot");
        }
        pool
    }
}

/// Output buffer filled with a value no step writes, so unwritten elements show.
pub const POISON: f32 = -1.2345e30;

/// The output and every slot after one step on a backend.
#[derive(Clone, Debug, PartialEq)]
pub struct Outcome {
    pub out: Vec<f32>,
    pub slots: Vec<(Vec<f32>, Vec<f32>)>,
}

pub fn read_slots(pool: &mut dyn LayerPool) -> Vec<(Vec<f32>, Vec<f32>)> {
    let sh = *pool.layer().shape();
    (0..pool.slots())
        .map(|i| {
            let mut s = vec![0.0; sh.state_len()];
            let mut h = vec![0.0; sh.hist_len()];
            pool.read_slot(i, &mut s, &mut h).expect("read_slot");
            (s, h)
        })
        .collect()
}

pub fn run_backend(backend: &dyn Backend, case: &Case) -> Outcome {
    let mut pool = case.pool(backend);
    let mut out = vec![POISON; case.layout().len()];
    pool.step(&case.args(), &mut out).expect("step");
    Outcome {
        slots: read_slots(pool.as_mut()),
        out,
    }
}

/// Slots (S key-major, H) as the oracle's float64 states.
pub fn oracle_states(slots: &[(Vec<f32>, Vec<f32>)]) -> Vec<SeqState> {
    slots
        .iter()
        .map(|(s, h)| SeqState::from_f32(s, h))
        .collect()
}

/// The oracle's output (f64, skipped rows and unused plane padding at 0) and slots.
pub fn run_oracle(case: &Case) -> (Vec<f64>, Vec<SeqState>) {
    let mut states: Vec<SeqState> = oracle_states(&case.init);
    let out = oracle::step(
        &case.layer,
        &mut states,
        &case.batch.view(),
        &case.slots,
        case.commit,
        case.plane_stride,
    )
    .expect("oracle step");
    (out, states)
}

/// Indices of the output buffer a step must write (rows of live sequences, in every plane).
pub fn written_indices(case: &Case) -> Vec<usize> {
    let lay = case.layout();
    let (t, n) = (case.batch.t, lay.n);
    let live_rows: Vec<usize> = (0..lay.rows).filter(|r| case.slots[r / t] >= 0).collect();
    let mut idx = Vec::new();
    let planes = if lay.plane_stride.is_some() { 4 } else { 1 };
    for p in 0..planes {
        let base = p * lay.plane_stride.unwrap_or(0);
        for &r in &live_rows {
            idx.extend(base + r * n..base + (r + 1) * n);
        }
    }
    if let Some(ps) = lay.plane_stride {
        for &r in &live_rows {
            idx.extend(4 * ps + r * (n / 16)..4 * ps + (r + 1) * (n / 16));
        }
    }
    idx
}

/// Relative errors of a backend's outcome against the oracle: (output, worst state, worst hist).
pub fn errors_against_oracle(case: &Case, got: &Outcome) -> (f64, f64, f64) {
    let (want, states) = run_oracle(case);
    let idx = written_indices(case);
    let out_g: Vec<f32> = idx.iter().map(|&i| got.out[i]).collect();
    let out_w: Vec<f64> = idx.iter().map(|&i| want[i]).collect();
    assert!(
        out_g.iter().all(|&x| x != POISON),
        "the step left output elements unwritten"
    );
    let e_out = gdn::relative_error(&out_g, &out_w);
    let mut e_s: f64 = 0.0;
    let mut e_h: f64 = 0.0;
    for ((s, h), st) in got.slots.iter().zip(&states) {
        e_s = e_s.max(gdn::relative_error(s, &st.s));
        e_h = e_h.max(gdn::relative_error(h, &st.h));
    }
    (e_out, e_s, e_h)
}

/// Checks one case against the oracle within [`F32_BOUND`], and that the slots not named are untouched.
pub fn check_against_oracle(backend: &dyn Backend, case: &Case) -> (f64, f64, f64) {
    let got = run_backend(backend, case);
    let errs = errors_against_oracle(case, &got);
    let (e_out, e_s, e_h) = errs;
    assert!(
        e_out < F32_BOUND && e_s < F32_BOUND && e_h < F32_BOUND,
        "errors out {e_out:.2e} state {e_s:.2e} hist {e_h:.2e} over {F32_BOUND:e} for {:?} b {} t {} {:?} {:?} {:?} planes {:?}",
        case.layer.shape(),
        case.batch.b,
        case.batch.t,
        case.commit,
        case.layer.config.head_map,
        case.layer.config.gate,
        case.plane_stride
    );
    let named = case.named_slots();
    for (i, slot) in got.slots.iter().enumerate() {
        if !named.contains(&i) || case.commit == Commit::Verify {
            let same =
                |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(
                same(&slot.0, &case.init[i].0) && same(&slot.1, &case.init[i].1),
                "slot {i} changed though the step did not commit it"
            );
        }
    }
    errs
}

pub mod checks;
pub mod prefill;
pub mod varlen;
