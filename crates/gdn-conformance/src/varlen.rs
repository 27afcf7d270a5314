//! The varlen checks: mixed window lengths and commits in one call, every activation dtype, the bf16 state and
//! both state layouts, against the oracle and bitwise against themselves.

use proptest::prelude::*;
use proptest::test_runner::{Config as PropConfig, TestRunner};

use gdn::{DType, PoolOptions, RowsData, Seq, StateLayout, Step, TensorData};

use crate::*;

/// The bound on an output rounded to bf16 (or f16) and on a bf16 state, against the oracle's values rounded
/// the same way: the two differ only where the f32 and the float64 result round to neighbouring values, one
/// ulp (2^-8 relative for bf16) in a small fraction of the elements.
pub const ROUNDED_BOUND: f64 = 2e-3;

/// The bound for a tensor of this dtype (f32: [`F32_BOUND`]).
pub fn bound(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => F32_BOUND,
        DType::Bf16 | DType::F16 => ROUNDED_BOUND,
    }
}

/// One varlen step to check: a layer, a pool's options and initial slots (S key-major, already representable in
/// the pool's state dtype), packed rows in their dtypes, the sequences, the output's dtype and planes.
#[derive(Clone, Debug)]
pub struct VarCase {
    pub layer: Layer,
    pub options: PoolOptions,
    /// Initial (state key-major, hist) of every pool slot.
    pub init: Vec<(Vec<f32>, Vec<f32>)>,
    pub rows: RowsData,
    pub seqs: Vec<Seq>,
    pub out_dtype: DType,
    pub plane_stride: Option<usize>,
}

/// What varies between varlen cases.
#[derive(Clone, Debug)]
pub struct VarSpec {
    pub shape: Shape,
    pub head_map: HeadMap,
    pub gate: Gate,
    pub options: PoolOptions,
    /// dtypes of qkv, alpha, beta, z.
    pub inputs: [DType; 4],
    pub out_dtype: DType,
    /// Per sequence: length, commit, whether it is skipped (slot -1), rows of gap before it.
    pub seqs: Vec<(usize, Commit, bool, usize)>,
    pub planes: bool,
    pub spare_slots: usize,
    pub seed: u64,
}

impl VarSpec {
    /// Sequences of these lengths, each committed in full, f32 everything.
    pub fn new(shape: Shape, lens: &[usize], seed: u64) -> Self {
        VarSpec {
            shape,
            head_map: HeadMap::Grouped,
            gate: Gate::Silu,
            options: PoolOptions::default(),
            inputs: [DType::F32; 4],
            out_dtype: DType::F32,
            seqs: lens.iter().map(|&l| (l, Commit::All, false, 0)).collect(),
            planes: false,
            spare_slots: 1,
            seed,
        }
    }

    pub fn build(&self) -> VarCase {
        let mut rng = Synth::new(self.seed);
        let layer = random_layer(&mut rng, self.shape, self.head_map, self.gate);
        let n_slots = self.seqs.len() + self.spare_slots;
        let init = (0..n_slots)
            .map(|_| {
                let (s, h) = rng.seq_state(&layer);
                (s.iter().map(|&x| self.options.state.round(x)).collect(), h)
            })
            .collect();
        let mut seqs = Vec::new();
        let mut row = 0;
        // slots in reverse order of the sequences, so that call order and pool order differ
        for (i, &(len, commit, skip, gap)) in self.seqs.iter().enumerate() {
            row += gap;
            let slot = if skip {
                -1
            } else {
                (self.seqs.len() - 1 - i) as i32
            };
            seqs.push(Seq {
                slot,
                start: row,
                len,
                commit,
            });
            row += len;
        }
        let data = rng.batch(&layer, 1, row.max(1));
        let keep = |v: &[f32], w: usize| v[..row * w].to_vec();
        let sh = self.shape;
        let rows = RowsData::from_f32(
            &keep(&data.qkv, sh.channels()),
            &keep(&data.alpha, sh.h_v),
            &keep(&data.beta, sh.h_v),
            &keep(&data.z, sh.n()),
            self.inputs,
        );
        VarCase {
            layer,
            options: self.options,
            init,
            rows,
            seqs,
            out_dtype: self.out_dtype,
            plane_stride: self.planes.then_some(row * sh.n() + 16),
        }
    }
}

impl VarCase {
    pub fn step(&self) -> Step<'_> {
        Step {
            rows: self.rows.view(),
            seqs: &self.seqs,
            plane_stride: self.plane_stride,
        }
    }

    pub fn rows(&self) -> usize {
        self.rows.view().count(self.layer.shape()).expect("rows")
    }

    pub fn layout(&self) -> OutputLayout {
        OutputLayout::for_rows(self.layer.shape(), self.rows(), self.plane_stride).expect("layout")
    }

    /// A pool with the case's options on `backend`, loaded with the initial slots.
    pub fn pool(&self, backend: &dyn Backend) -> Box<dyn LayerPool> {
        let mut pool = backend
            .create_pool_with(&self.layer, self.init.len(), self.options)
            .expect("create_pool_with");
        self.load_slots(pool.as_mut());
        pool
    }

    /// Writes the initial slots into `pool` (made for this case's layer, slots and options).
    pub fn load_slots(&self, pool: &mut dyn LayerPool) {
        let sh = *self.layer.shape();
        for (i, (s, h)) in self.init.iter().enumerate() {
            let s = StateLayout::KeyMajor.convert(self.options.layout, &sh, s);
            pool.write_slot(i, &s, h).expect("write_slot");
        }
    }

    pub fn named_slots(&self) -> Vec<usize> {
        self.seqs
            .iter()
            .filter(|s| s.slot >= 0)
            .map(|s| s.slot as usize)
            .collect()
    }

    /// Output elements a step must write: the rows of live sequences in y, every plane and the group sums.
    pub fn written(&self) -> Vec<bool> {
        let lay = self.layout();
        let n = lay.n;
        let mut w = vec![false; lay.len()];
        for s in self.seqs.iter().filter(|s| s.slot >= 0) {
            let rows = s.start..s.start + s.len;
            w[rows.start * n..rows.end * n].fill(true);
            if let Some(p) = lay.plane_stride {
                for plane in 1..4 {
                    w[plane * p + rows.start * n..plane * p + rows.end * n].fill(true);
                }
                w[4 * p + rows.start * (n / 16)..4 * p + rows.end * (n / 16)].fill(true);
            }
        }
        w
    }
}

/// Slots read back key-major.
pub fn read_slots_key_major(pool: &mut dyn LayerPool) -> Vec<(Vec<f32>, Vec<f32>)> {
    let sh = *pool.layer().shape();
    let layout = pool.options().layout;
    read_slots(pool)
        .into_iter()
        .map(|(s, h)| (layout.convert(StateLayout::KeyMajor, &sh, &s), h))
        .collect()
}

/// The output (in its dtype, widened) and every slot (key-major) after one step.
#[derive(Clone, Debug, PartialEq)]
pub struct VarOutcome {
    pub out: TensorData,
    pub slots: Vec<(Vec<f32>, Vec<f32>)>,
}

pub fn run_var(backend: &dyn Backend, case: &VarCase) -> VarOutcome {
    let mut pool = case.pool(backend);
    run_var_on(pool.as_mut(), case)
}

/// One step of `case` on a pool that already holds its slots.
pub fn run_var_on(pool: &mut dyn LayerPool, case: &VarCase) -> VarOutcome {
    let mut out = TensorData::filled(case.layout().len(), POISON, case.out_dtype);
    pool.step_varlen(&case.step(), out.view_mut())
        .expect("step_varlen");
    VarOutcome {
        slots: read_slots_key_major(pool),
        out,
    }
}

/// The oracle's output (rounded to the case's dtype, unwritten elements 0) and slots.
pub fn oracle_var(case: &VarCase) -> (Vec<f64>, Vec<SeqState>) {
    let mut states: Vec<SeqState> = oracle_states(&case.init);
    let out = oracle::step_varlen(
        &case.layer,
        &mut states,
        &case.step(),
        case.options.state,
        case.out_dtype,
    )
    .expect("oracle step");
    (out, states)
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Checks a case against the oracle: the written outputs within the output dtype's bound, the committed states
/// within the state dtype's, unwritten outputs and unnamed (or verify-only) slots untouched bitwise. Returns the
/// errors (output, state, hist).
pub fn check_var(backend: &dyn Backend, case: &VarCase) -> (f64, f64, f64) {
    check_var_within(
        backend,
        case,
        bound(case.out_dtype),
        bound(case.options.state),
    )
}

/// [`check_var`] with the bounds on the outputs and the committed states given (a backend mode with its own
/// stated bound, e.g. CUDA's one-TF32 chunk products); the history's stays [`F32_BOUND`].
pub fn check_var_within(
    backend: &dyn Backend,
    case: &VarCase,
    b_out: f64,
    b_s: f64,
) -> (f64, f64, f64) {
    let got = run_var(backend, case);
    let (want, states) = oracle_var(case);
    let written = case.written();
    let out = got.out.to_f32();
    let poison = case.out_dtype.round(POISON).to_bits();
    let (mut g, mut w) = (Vec::new(), Vec::new());
    for (i, &wr) in written.iter().enumerate() {
        if wr {
            assert!(
                out[i].to_bits() != poison,
                "output element {i} was not written"
            );
            g.push(out[i]);
            w.push(want[i]);
        } else {
            assert!(
                out[i].to_bits() == poison,
                "output element {i} (a skipped row, a row of no sequence, or padding) was written"
            );
        }
    }
    let e_out = gdn::relative_error(&g, &w);
    let (mut e_s, mut e_h) = (0.0f64, 0.0f64);
    for (slot, ((s, h), st)) in got.slots.iter().zip(&states).enumerate() {
        e_s = e_s.max(gdn::relative_error(s, &st.s));
        e_h = e_h.max(gdn::relative_error(h, &st.h));
        let committed = case
            .seqs
            .iter()
            .any(|q| q.slot == slot as i32 && q.commit != Commit::Verify);
        if !committed {
            assert!(
                bits(s) == bits(&case.init[slot].0) && bits(h) == bits(&case.init[slot].1),
                "slot {slot} changed though no sequence committed it"
            );
        }
    }
    assert!(
        e_out < b_out && e_s < b_s && e_h < F32_BOUND,
        "errors out {e_out:.2e} (bound {b_out:e}) state {e_s:.2e} (bound {b_s:e}) hist {e_h:.2e} for {:?} {:?} inputs {:?} out {:?} seqs {:?}",
        case.layer.shape(),
        case.options,
        case.rows.view().dtypes(),
        case.out_dtype,
        case.seqs
    );
    (e_out, e_s, e_h)
}

fn dtype() -> impl Strategy<Value = DType> {
    prop::sample::select(vec![DType::F32, DType::Bf16, DType::F16])
}

fn var_spec() -> impl Strategy<Value = VarSpec> {
    let seq = (1usize..=12, 0usize..3, 0usize..=100, 0usize..8, 0usize..3);
    (
        (
            prop::sample::select(vec![16usize, 32, 48]),
            1usize..=2,
            1usize..=3,
        ),
        prop::collection::vec(seq, 1..=5),
        (
            prop::bool::ANY,
            prop::bool::ANY,
            prop::bool::ANY,
            prop::bool::ANY,
        ),
        (dtype(), dtype(), dtype(), dtype(), dtype()),
        any::<u64>(),
    )
        .prop_map(
            |((d, h_k, r), seqs, (grouped, silu, bf16, vmajor), dt, seed)| {
                let shape = Shape::new(d, h_k, h_k * r).expect("valid");
                let mut spec = VarSpec::new(shape, &[], seed);
                spec.head_map = if grouped {
                    HeadMap::Grouped
                } else {
                    HeadMap::Tiled
                };
                spec.gate = if silu { Gate::Silu } else { Gate::Sigmoid };
                spec.options = PoolOptions {
                    state: if bf16 { DType::Bf16 } else { DType::F32 },
                    layout: if vmajor {
                        StateLayout::ValueMajor
                    } else {
                        StateLayout::KeyMajor
                    },
                };
                spec.inputs = [dt.0, dt.1, dt.2, dt.3];
                spec.out_dtype = dt.4;
                spec.planes = seed % 3 == 0;
                spec.seqs = seqs
                    .into_iter()
                    .enumerate()
                    .map(|(i, (len, mode, kf, skip, gap))| {
                        // one sequence in eight a long window (prefill chunk); every commit kind
                        let len = if skip == 7 { 40 + kf % 31 } else { len };
                        let commit = match mode {
                            0 => Commit::Verify,
                            1 => Commit::All,
                            _ => Commit::First(1 + kf % len),
                        };
                        (len, commit, skip == 0 && i > 0, gap / 2)
                    })
                    .collect();
                spec
            },
        )
}

/// Random mixed batches: 1 to 5 sequences of 1 to 12 tokens (one in eight of 40 to 70), every commit kind in one
/// call, skipped sequences and rows of no sequence between them, random dtypes for every input and the output, a
/// bf16 or f32 state, either layout, planes; against the oracle.
pub fn varlen_mixed_batches_match_oracle(backend: &dyn Backend, cases: u32) {
    let mut runner = TestRunner::new(PropConfig {
        cases,
        failure_persistence: None,
        ..PropConfig::default()
    });
    let worst = std::cell::Cell::new([0.0f64; 6]);
    runner
        .run(&var_spec(), |spec| {
            let case = spec.build();
            let e = check_var(backend, &case);
            let mut w = worst.get();
            let at = if case.out_dtype == DType::F32 { 0 } else { 3 };
            w[at] = w[at].max(e.0);
            let at = if case.options.state == DType::F32 {
                1
            } else {
                4
            };
            w[at] = w[at].max(e.1);
            w[2] = w[2].max(e.2);
            worst.set(w);
            Ok(())
        })
        .unwrap();
    let w = worst.get();
    eprintln!(
        "{}: worst over {cases} mixed batches: f32 y {:.2e}, f32 state {:.2e}, hist {:.2e}; 16-bit y {:.2e}, bf16 state {:.2e}",
        backend.name(),
        w[0],
        w[1],
        w[2],
        w[3],
        w[4]
    );
}

/// A sequence's y and committed state are the same bits run alone as inside a mixed call (other lengths, other
/// commits, skipped neighbours), for an f32 and a bf16 state.
pub fn varlen_sequence_bits_do_not_depend_on_the_batch(backend: &dyn Backend) {
    for (i, state) in [DType::F32, DType::Bf16].into_iter().enumerate() {
        let mut spec = VarSpec::new(Shape::new(32, 2, 4).unwrap(), &[], 300 + i as u64);
        spec.options.state = state;
        spec.options.layout = if i == 0 {
            StateLayout::KeyMajor
        } else {
            StateLayout::ValueMajor
        };
        spec.inputs = [DType::Bf16, DType::F32, DType::F32, DType::Bf16];
        spec.out_dtype = DType::Bf16;
        spec.planes = true;
        spec.seqs = vec![
            (1, Commit::All, false, 0),
            (5, Commit::First(2), false, 1),
            (3, Commit::Verify, true, 0),
            (8, Commit::All, false, 2),
            (1, Commit::Verify, false, 0),
            (17, Commit::First(9), false, 0),
        ];
        let mixed = spec.build();
        let got = run_var(backend, &mixed);
        let n = mixed.layer.shape().n();
        let lay = mixed.layout();
        let out = got.out.to_f32();
        for (q, seq) in mixed.seqs.iter().enumerate().filter(|(_, s)| s.slot >= 0) {
            // the same sequence alone: its rows only, from row 0
            let mut alone = mixed.clone();
            let take = |t: &TensorData, w: usize| {
                let v = t.to_f32();
                TensorData::from_f32(&v[seq.start * w..(seq.start + seq.len) * w], t.dtype())
            };
            let sh = *mixed.layer.shape();
            alone.rows = RowsData {
                qkv: take(&mixed.rows.qkv, sh.channels()),
                alpha: take(&mixed.rows.alpha, sh.h_v),
                beta: take(&mixed.rows.beta, sh.h_v),
                z: take(&mixed.rows.z, n),
            };
            alone.seqs = vec![Seq { start: 0, ..*seq }];
            alone.plane_stride = Some(seq.len * n);
            let one = run_var(backend, &alone);
            let one_out = one.out.to_f32();
            let ps = lay.plane_stride.unwrap();
            let ps1 = seq.len * n;
            for plane in 0..4 {
                let a = &out[plane * ps + seq.start * n..plane * ps + (seq.start + seq.len) * n];
                let b = &one_out[plane * ps1..plane * ps1 + seq.len * n];
                assert!(
                    bits(a) == bits(b),
                    "sequence {q}: plane {plane} differs between the mixed call and the sequence alone"
                );
            }
            let g = n / 16;
            let a = &out[4 * ps + seq.start * g..4 * ps + (seq.start + seq.len) * g];
            let b = &one_out[4 * ps1..4 * ps1 + seq.len * g];
            assert!(bits(a) == bits(b), "sequence {q}: group sums differ");
            let slot = seq.slot as usize;
            assert!(
                bits(&got.slots[slot].0) == bits(&one.slots[slot].0)
                    && bits(&got.slots[slot].1) == bits(&one.slots[slot].1),
                "sequence {q}: committed state differs between the mixed call and the sequence alone"
            );
        }
        check_var(backend, &mixed);
    }
}

/// Every dtype of every input, every output dtype, both state dtypes and both layouts, on one mixed batch each.
pub fn every_dtype_and_layout_matches_oracle(backend: &dyn Backend) {
    let dts = [DType::F32, DType::Bf16, DType::F16];
    let inputs: Vec<[DType; 4]> = dts
        .iter()
        .map(|&d| [d; 4])
        .chain([
            [DType::Bf16, DType::F32, DType::F16, DType::F32],
            [DType::F32, DType::F16, DType::Bf16, DType::F16],
        ])
        .collect();
    let mut k = 0;
    for state in [DType::F32, DType::Bf16] {
        for layout in [StateLayout::KeyMajor, StateLayout::ValueMajor] {
            for inp in &inputs {
                let mut spec = VarSpec::new(Shape::new(32, 1, 2).unwrap(), &[], 400 + k);
                spec.options = PoolOptions { state, layout };
                spec.inputs = *inp;
                spec.out_dtype = dts[k as usize % 3];
                spec.planes = k % 2 == 0;
                spec.seqs = vec![
                    (1, Commit::All, false, 0),
                    (4, Commit::First(3), false, 0),
                    (2, Commit::Verify, false, 1),
                ];
                check_var(backend, &spec.build());
                k += 1;
            }
        }
    }
}

/// The bitwise invariants with a bf16 state in the value-major layout: commit first k equals a k-token step
/// (also right after a one-token commit, which a backend may leave deferred), verify changes nothing, and a
/// one-token commit followed by a read gives the oracle's rounded state.
pub fn bf16_state_invariants_hold(backend: &dyn Backend) {
    let options = PoolOptions {
        state: DType::Bf16,
        layout: StateLayout::ValueMajor,
    };
    let sh = Shape::new(32, 2, 4).unwrap();
    for k in [1, 3, 5] {
        for after_decode in [false, true] {
            let mut spec = VarSpec::new(sh, &[5, 5], 500 + k as u64);
            spec.options = options;
            spec.spare_slots = 0;
            spec.seqs = vec![
                (5, Commit::First(k), false, 0),
                (5, Commit::First(k), false, 0),
            ];
            let full = spec.build();
            let mut short = full.clone();
            let sh2 = *full.layer.shape();
            let n = sh2.n();
            let take = |t: &TensorData, w: usize| {
                let v = t.to_f32();
                let mut o = Vec::new();
                for s in &full.seqs {
                    o.extend_from_slice(&v[s.start * w..(s.start + k) * w]);
                }
                TensorData::from_f32(&o, t.dtype())
            };
            short.rows = RowsData {
                qkv: take(&full.rows.qkv, sh2.channels()),
                alpha: take(&full.rows.alpha, sh2.h_v),
                beta: take(&full.rows.beta, sh2.h_v),
                z: take(&full.rows.z, n),
            };
            short.seqs = (0..2)
                .map(|i| Seq {
                    slot: full.seqs[i].slot,
                    start: i * k,
                    len: k,
                    commit: Commit::All,
                })
                .collect();
            let (mut a, mut b) = (full.pool(backend), full.pool(backend));
            if after_decode {
                let mut decode = VarSpec::new(sh, &[1, 1], 600 + k as u64);
                decode.options = options;
                decode.spare_slots = 0;
                let dcase = decode.build();
                // the decode case's own layer would differ: run its rows through this layer
                let dcase = VarCase {
                    layer: full.layer.clone(),
                    init: full.init.clone(),
                    ..dcase
                };
                run_var_on(a.as_mut(), &dcase);
                run_var_on(b.as_mut(), &dcase);
                let before = read_slots_key_major(a.as_mut());
                let mut verify = full.clone();
                verify
                    .seqs
                    .iter_mut()
                    .for_each(|s| s.commit = Commit::Verify);
                run_var_on(a.as_mut(), &verify);
                assert!(
                    read_slots_key_major(a.as_mut()) == before,
                    "bf16 state: a verify after a one-token commit changed the pool"
                );
            }
            let ga = run_var_on(a.as_mut(), &full);
            let gb = run_var_on(b.as_mut(), &short);
            for (i, (x, y)) in ga.slots.iter().zip(&gb.slots).enumerate() {
                assert!(
                    bits(&x.0) == bits(&y.0) && bits(&x.1) == bits(&y.1),
                    "bf16 state, k {k}, after decode {after_decode}: slot {i} differs from a {k}-token step"
                );
            }
            let (ya, yb) = (ga.out.to_f32(), gb.out.to_f32());
            for (i, s) in full.seqs.iter().enumerate() {
                assert!(
                    bits(&ya[s.start * n..(s.start + k) * n])
                        == bits(&yb[i * k * n..(i + 1) * k * n]),
                    "bf16 state, k {k}: y of the first {k} tokens differs"
                );
            }
            if !after_decode {
                check_var(backend, &full);
            }
        }
    }
}

/// `write_slot`/`read_slot` in each layout and state dtype: f32 round trips exactly, bf16 reads back the value
/// rounded to nearest even, and the value-major layout holds the key-major state transposed per head.
pub fn slot_io_in_every_layout(backend: &dyn Backend) {
    let mut rng = Synth::new(700);
    let layer = rng
        .layer(Config::new(Shape::new(16, 1, 2).unwrap()))
        .unwrap();
    let sh = *layer.shape();
    let (s_km, h) = rng.seq_state(&layer);
    for state in [DType::F32, DType::Bf16] {
        for layout in [StateLayout::KeyMajor, StateLayout::ValueMajor] {
            let mut pool = backend
                .create_pool_with(&layer, 2, PoolOptions { state, layout })
                .expect("create_pool_with");
            assert_eq!(pool.options(), PoolOptions { state, layout });
            let s = StateLayout::KeyMajor.convert(layout, &sh, &s_km);
            pool.write_slot(1, &s, &h).unwrap();
            let (mut s2, mut h2) = (vec![0.0; s.len()], vec![0.0; h.len()]);
            pool.read_slot(1, &mut s2, &mut h2).unwrap();
            let want: Vec<f32> = s.iter().map(|&x| state.round(x)).collect();
            assert!(
                bits(&s2) == bits(&want),
                "{state:?} {layout:?}: S did not round-trip"
            );
            assert!(
                bits(&h2) == bits(&h),
                "{state:?} {layout:?}: H did not round-trip"
            );
            pool.read_slot(0, &mut s2, &mut h2).unwrap();
            assert!(s2.iter().all(|&x| x == 0.0), "slot 0 is not zero");
        }
    }
    assert!(matches!(
        backend.create_pool_with(
            &layer,
            2,
            PoolOptions {
                state: DType::F16,
                layout: StateLayout::KeyMajor
            }
        ),
        Err(Error::Unsupported(_))
    ));
}

/// Every class of bad varlen input gets its error naming it, and the pool and the output are as they were.
pub fn bad_varlen_input_is_rejected_and_changes_nothing(backend: &dyn Backend) {
    let mut spec = VarSpec::new(Shape::new(16, 1, 2).unwrap(), &[2, 3, 1], 800);
    spec.options.state = DType::Bf16;
    spec.inputs = [DType::Bf16; 4];
    spec.out_dtype = DType::Bf16;
    let case = spec.build();
    type Mutate = Box<dyn Fn(&mut Vec<Seq>, &mut usize)>;
    type Expect = fn(&Error) -> bool;
    let n_slots = case.init.len() as i32;
    let cases: Vec<(&str, Mutate, Expect)> = vec![
        ("length 0", Box::new(|s, _| s[1].len = 0), |e| {
            matches!(e, Error::EmptySeq { seq: 1 })
        }),
        ("rows past the end", Box::new(|s, _| s[2].start += 1), |e| {
            matches!(e, Error::SeqRows { seq: 2, .. })
        }),
        (
            "rows that overflow",
            Box::new(|s, _| s[0].start = usize::MAX - 1),
            |e| matches!(e, Error::SeqRows { seq: 0, .. }),
        ),
        ("overlapping rows", Box::new(|s, _| s[1].start -= 1), |e| {
            matches!(e, Error::SeqOverlap { a: 0, b: 1 })
        }),
        (
            "overlapping a skipped sequence",
            Box::new(|s, _| {
                s[0].slot = -1;
                s[1].start -= 1
            }),
            |e| matches!(e, Error::SeqOverlap { .. }),
        ),
        (
            "commit first 0",
            Box::new(|s, _| s[1].commit = Commit::First(0)),
            |e| matches!(e, Error::SeqCommit { seq: 1, .. }),
        ),
        (
            "commit past the length",
            Box::new(|s, _| s[0].commit = Commit::First(3)),
            |e| matches!(e, Error::SeqCommit { seq: 0, .. }),
        ),
        (
            "slot named twice",
            Box::new(|s, _| s[2].slot = s[0].slot),
            |e| matches!(e, Error::SlotTwice(_)),
        ),
        (
            "slot out of range",
            Box::new(move |s, _| s[1].slot = n_slots),
            |e| matches!(e, Error::SlotRange { .. }),
        ),
        ("output too short", Box::new(|_, len| *len -= 1), |e| {
            matches!(e, Error::Length { name: "output", .. })
        }),
    ];
    for (what, mutate, expect) in cases {
        let mut pool = case.pool(backend);
        let before = read_slots(pool.as_mut());
        let mut seqs = case.seqs.clone();
        let mut len = case.layout().len();
        mutate(&mut seqs, &mut len);
        let mut out = TensorData::filled(len, POISON, case.out_dtype);
        let step = Step {
            seqs: &seqs,
            ..case.step()
        };
        let err = pool.step_varlen(&step, out.view_mut()).expect_err(what);
        assert!(expect(&err), "{what}: unexpected error {err}");
        assert!(!err.to_string().is_empty());
        assert!(
            read_slots(pool.as_mut()) == before,
            "{what}: the pool changed"
        );
        assert!(
            out == TensorData::filled(len, POISON, case.out_dtype),
            "{what}: the output changed"
        );
    }
    // rows that disagree between tensors
    let mut pool = case.pool(backend);
    let before = read_slots(pool.as_mut());
    let mut rows = case.rows.clone();
    if let TensorData::Bf16(v) = &mut rows.z {
        v.pop();
    }
    let step = Step {
        rows: rows.view(),
        ..case.step()
    };
    let mut out = TensorData::filled(case.layout().len(), POISON, case.out_dtype);
    let err = pool
        .step_varlen(&step, out.view_mut())
        .expect_err("short z");
    assert!(
        matches!(err, Error::Length { name: "z", .. }),
        "short z: {err}"
    );
    assert!(
        read_slots(pool.as_mut()) == before,
        "short z: the pool changed"
    );
}

/// 10^4 decode steps with a bf16 state against the float64 oracle carrying the exact (unrounded) state: the error
/// a user of a bf16 state sees, printed at checkpoints. It must not drift (the state forgets old rounding errors
/// through its decay): S within 1e-2 at every checkpoint, the median step's y within 5e-3. Single steps are
/// worse where o = S^T q nearly cancels (the RMS norm then magnifies S's rounding), hence the median.
pub fn bf16_state_drift_is_bounded(backend: &dyn Backend, steps: usize) {
    let mut spec = VarSpec::new(Shape::new(32, 1, 2).unwrap(), &[1], 900);
    spec.options.state = DType::Bf16;
    spec.spare_slots = 0;
    let case = spec.build();
    let mut pool = case.pool(backend);
    let mut exact: Vec<SeqState> = oracle_states(&case.init);
    let mut rng = Synth::new(901);
    let (mut worst_y, mut worst_s) = (0.0f64, 0.0f64);
    let mut all_y = Vec::with_capacity(steps);
    let mut report = Vec::new();
    for step in 1..=steps {
        let b = rng.batch(&case.layer, 1, 1);
        let seqs = [Seq {
            slot: 0,
            start: 0,
            len: 1,
            commit: Commit::All,
        }];
        let st = Step {
            rows: b.view().rows(),
            seqs: &seqs,
            plane_stride: None,
        };
        let mut out = TensorData::filled(case.layer.shape().n(), 0.0, DType::F32);
        pool.step_varlen(&st, out.view_mut()).expect("step");
        let want =
            oracle::step_varlen(&case.layer, &mut exact, &st, DType::F32, DType::F32).unwrap();
        let e_y = gdn::relative_error(&out.to_f32(), &want);
        worst_y = worst_y.max(e_y);
        all_y.push(e_y);
        if step.is_power_of_two() || step == steps || step % 1000 == 0 {
            let got = read_slots_key_major(pool.as_mut());
            let e_s = gdn::relative_error(&got[0].0, &exact[0].s);
            worst_s = worst_s.max(e_s);
            report.push(format!("{step}: y {e_y:.1e} S {e_s:.1e}"));
        }
    }
    all_y.sort_by(f64::total_cmp);
    let median_y = all_y[all_y.len() / 2];
    let p99_y = all_y[all_y.len() * 99 / 100];
    eprintln!(
        "{}: bf16 state over {steps} decode steps against the exact float64 state (step: errors): {}; y median {median_y:.2e}, 99th percentile {p99_y:.2e}, worst {worst_y:.2e}; worst S {worst_s:.2e}",
        backend.name(),
        report.join(", ")
    );
    assert!(
        median_y < 5e-3 && worst_s < 1e-2,
        "bf16 state drift: y median {median_y:.2e}, worst S {worst_s:.2e}"
    );
}

/// The shapes models use, on one mixed batch each (a decode token, a partial commit, a verify): d 64, 128 and 256
/// with h_v / h_k 1 to 4, and Qwen3-Next's 16 q/k and 32 value heads at d 128; f32 key-major and bf16
/// value-major states in turn.
pub fn every_shape_matches_oracle(backend: &dyn Backend) {
    let mut shapes = Vec::new();
    for d in [64, 128, 256] {
        for (h_k, h_v) in [(2, 2), (2, 4), (1, 3), (1, 4)] {
            shapes.push(Shape::new(d, h_k, h_v).expect("valid"));
        }
    }
    shapes.push(Shape::new(128, 16, 32).expect("valid"));
    for (i, shape) in shapes.into_iter().enumerate() {
        let mut spec = VarSpec::new(shape, &[], 1000 + i as u64);
        if i % 2 == 1 {
            spec.options = PoolOptions {
                state: DType::Bf16,
                layout: StateLayout::ValueMajor,
            };
        }
        spec.seqs = vec![
            (1, Commit::All, false, 0),
            (3, Commit::First(2), false, 0),
            (2, Commit::Verify, false, 1),
        ];
        check_var(backend, &spec.build());
    }
}

/// Tensor-parallel shards: every rank's step on its slice of the rows and of the state, placed side by side,
/// equals the unsharded step (y and committed states within 1e-6, bitwise where a backend's launch split does
/// not depend on the head count), for both head maps and a varlen batch with every commit kind.
pub fn shards_side_by_side_equal_the_unsharded_step(backend: &dyn Backend) {
    for (head_map, world) in [
        (HeadMap::Grouped, 2),
        (HeadMap::Tiled, 2),
        (HeadMap::Grouped, 4),
    ] {
        let mut spec = VarSpec::new(Shape::new(32, 4, 12).unwrap(), &[3, 1, 5], 91);
        spec.head_map = head_map;
        spec.seqs[0].1 = Commit::First(2);
        spec.seqs[1].1 = Commit::Verify;
        let case = spec.build();
        let full = run_var(backend, &case);
        let sh = *case.layer.shape();
        let rows = case.rows();
        let (mut y, mut states) = (vec![0.0f32; rows * sh.n()], full.slots.clone());
        for (s, _) in states.iter_mut() {
            s.fill(0.0);
        }
        let mut placed = vec![0usize; sh.n()];
        for rank in 0..world {
            let (layer, map) = case.layer.shard(rank, world).expect("shard");
            let ssh = *layer.shape();
            let (chans, cols) = (map.channels(), map.columns());
            let gather = |x: &TensorData, width: usize, idx: &[usize]| {
                let x = x.to_f32();
                let v: Vec<f32> = (0..rows)
                    .flat_map(|r| idx.iter().map(move |&c| r * width + c))
                    .map(|i| x[i])
                    .collect();
                TensorData::from_f32(&v, DType::F32)
            };
            // the state's key-major [i][h][j] rows, of this shard's value heads
            let state_of = |s: &[f32]| -> Vec<f32> {
                (0..sh.d)
                    .flat_map(|i| {
                        map.value_heads
                            .iter()
                            .flat_map(move |&h| (0..sh.d).map(move |j| (i * sh.h_v + h) * sh.d + j))
                    })
                    .map(|k| s[k])
                    .collect()
            };
            let init = case
                .init
                .iter()
                .map(|(s, h)| {
                    let hist = chans
                        .iter()
                        .flat_map(|&c| h[c * 3..c * 3 + 3].to_vec())
                        .collect();
                    (state_of(s), hist)
                })
                .collect();
            let shard_case = VarCase {
                layer,
                init,
                rows: RowsData {
                    qkv: gather(&case.rows.qkv, sh.channels(), &chans),
                    alpha: gather(&case.rows.alpha, sh.h_v, &map.value_heads),
                    beta: gather(&case.rows.beta, sh.h_v, &map.value_heads),
                    z: gather(&case.rows.z, sh.n(), &cols),
                },
                ..case.clone()
            };
            let got = run_var(backend, &shard_case);
            let out = got.out.to_f32();
            for r in 0..rows {
                for (cs, &c) in cols.iter().enumerate() {
                    y[r * sh.n() + c] = out[r * ssh.n() + cs];
                }
            }
            for &c in &cols {
                placed[c] += 1;
            }
            for (slot, (s, _)) in got.slots.iter().enumerate() {
                for i in 0..sh.d {
                    for (hs, &h) in map.value_heads.iter().enumerate() {
                        for j in 0..sh.d {
                            states[slot].0[(i * sh.h_v + h) * sh.d + j] =
                                s[(i * ssh.h_v + hs) * sh.d + j];
                        }
                    }
                }
            }
        }
        assert!(
            placed.iter().all(|&n| n == 1),
            "every output column from one shard"
        );
        let want: Vec<f64> = full.out.to_f32()[..rows * sh.n()]
            .iter()
            .map(|&v| v as f64)
            .collect();
        let e_y = gdn::relative_error(&y, &want);
        let mut e_s = 0.0f64;
        for (got, want) in states.iter().zip(&full.slots) {
            let w: Vec<f64> = want.0.iter().map(|&v| v as f64).collect();
            e_s = e_s.max(gdn::relative_error(&got.0, &w));
        }
        assert!(
            e_y <= 1e-6 && e_s <= 1e-6,
            "{head_map:?} world {world}: shards side by side differ from the unsharded step: y {e_y:.2e}, state {e_s:.2e}"
        );
    }
}
