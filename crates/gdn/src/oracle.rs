//! The float64 oracle: SPEC.md as plain code. Obviously right, never optimised; every backend is checked
//! against it. Inputs are the same f32 values a backend sees, widened exactly.

use crate::{Batch, Commit, DType, Gate, Layer, Result, Rows, Step, Tensor};

/// One sequence's state in float64: S [d][h_v][d] and H [C][3], SPEC.md's layouts.
#[derive(Clone, Debug, PartialEq)]
pub struct SeqState {
    pub s: Vec<f64>,
    pub h: Vec<f64>,
}

impl SeqState {
    pub fn zeros(layer: &Layer) -> Self {
        let sh = layer.shape();
        SeqState {
            s: vec![0.0; sh.state_len()],
            h: vec![0.0; sh.hist_len()],
        }
    }
    pub fn from_f32(state: &[f32], hist: &[f32]) -> Self {
        SeqState {
            s: state.iter().map(|&x| x as f64).collect(),
            h: hist.iter().map(|&x| x as f64).collect(),
        }
    }
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

fn softplus(u: f64) -> f64 {
    if u > 20.0 {
        u
    } else {
        u.exp().ln_1p()
    }
}

/// `x / sqrt(sum x^2 + eps)`: the L2 norm of SPEC.md step 2 in exact arithmetic.
fn l2_normalize(x: &[f64], eps: f64) -> Vec<f64> {
    let ss: f64 = x.iter().map(|v| v * v).sum();
    let r = 1.0 / (ss + eps).sqrt();
    x.iter().map(|v| v * r).collect()
}

/// Runs one sequence's window, `len` rows of `rows` from row `start`, and returns y [len][n] unrounded. The
/// state is replaced by the one after `commit_at` tokens (unchanged for 0: verify); with a bf16 `state` dtype,
/// the committed S is rounded once to bf16 (the history stays f32, it holds raw inputs).
pub fn window_rows(
    layer: &Layer,
    st: &mut SeqState,
    rows: &Rows<'_>,
    start: usize,
    len: usize,
    commit_at: usize,
    state: DType,
) -> Vec<f64> {
    let sh = *layer.shape();
    let (d, h_k, h_v, c_n, n) = (sh.d, sh.h_k, sh.h_v, sh.channels(), sh.n());
    let p = &layer.params;
    let eps = layer.config.eps as f64;
    let input = |x: &Tensor<'_>, i: usize| x.get(i) as f64;
    let mut s = st.s.clone();
    let mut h = st.h.clone();
    let mut y = vec![0.0; len * n];
    for tok in 0..len {
        let row = start + tok;
        // 1. conv + SiLU of every channel, then the history shift (each channel once per token)
        let mut cv = vec![0.0; c_n];
        for c in 0..c_n {
            let x = [
                h[c * 3],
                h[c * 3 + 1],
                h[c * 3 + 2],
                input(&rows.qkv, row * c_n + c),
            ];
            let acc: f64 = (0..4).map(|k| x[k] * p.conv_w[c * 4 + k] as f64).sum();
            cv[c] = acc * sigmoid(acc);
            h[c * 3] = x[1];
            h[c * 3 + 1] = x[2];
            h[c * 3 + 2] = x[3];
        }
        for hv in 0..h_v {
            let g = layer.config.head_map.qk_head(&sh, hv);
            // 2. L2 norms of q and k
            let q = l2_normalize(&cv[g * d..(g + 1) * d], eps);
            let k = l2_normalize(&cv[(h_k + g) * d..(h_k + g + 1) * d], eps);
            let v = &cv[(2 * h_k + hv) * d..(2 * h_k + hv + 1) * d];
            // 3. decay, 4. write strength
            let u = input(&rows.alpha, row * h_v + hv) + p.dt[hv] as f64;
            let gate = (softplus(u) * p.a[hv] as f64).exp();
            let b = sigmoid(input(&rows.beta, row * h_v + hv));
            let at = |i: usize, j: usize| (i * h_v + hv) * d + j;
            // 5. delta rule
            for j in 0..d {
                let kv: f64 = (0..d).map(|i| s[at(i, j)] * k[i]).sum();
                let delta = (v[j] - gate * kv) * b;
                for i in 0..d {
                    s[at(i, j)] = gate * s[at(i, j)] + k[i] * delta;
                }
            }
            // 6. readout, 7. gated RMS norm
            let o: Vec<f64> = (0..d)
                .map(|j| (0..d).map(|i| s[at(i, j)] * q[i]).sum::<f64>() / (d as f64).sqrt())
                .collect();
            let rs = 1.0 / (o.iter().map(|x| x * x).sum::<f64>() / d as f64 + eps).sqrt();
            for j in 0..d {
                let zz = input(&rows.z, row * n + hv * d + j);
                let act = match layer.config.gate {
                    Gate::Sigmoid => sigmoid(zz),
                    Gate::Silu => zz * sigmoid(zz),
                };
                y[tok * n + hv * d + j] = rs * o[j] * p.gamma[j] as f64 * act;
            }
        }
        if tok + 1 == commit_at {
            st.s.iter_mut()
                .zip(&s)
                .for_each(|(a, &b)| *a = state.round_f64(b));
            st.h.copy_from_slice(&h);
        }
    }
    y
}

/// Runs one sequence's f32 window (a batch of one) and returns y [t][n]; the state is replaced by the
/// committed one (unchanged under `Verify`).
pub fn window(
    layer: &Layer,
    st: &mut SeqState,
    win: &Batch<'_>,
    commit: Commit,
) -> Result<Vec<f64>> {
    assert_eq!(win.b, 1, "oracle::window takes one sequence");
    let commit_at = commit.commit_at(win.t)?;
    Ok(window_rows(
        layer,
        st,
        &win.rows(),
        0,
        win.t,
        commit_at,
        DType::F32,
    ))
}

/// Runs a varlen step the way a backend's does: `states[slot]` per sequence (S key-major; negative slots
/// skipped, their rows left at 0) and the whole output buffer in [`crate::OutputLayout`] order, planes and group sums
/// included, each value rounded once to `out` (bf16 or f16; f32 values are left exact).
pub fn step_varlen(
    layer: &Layer,
    states: &mut [SeqState],
    step: &Step<'_>,
    state: DType,
    out: DType,
) -> Result<Vec<f64>> {
    let n = layer.shape().n();
    let layout = step.layout(layer.shape())?;
    // the reference rejects what every backend rejects
    let checked = step.validate(layer, states.len(), layout.len())?;
    let mut buf = vec![0.0; layout.len()];
    for (seq, &commit_at) in step.seqs.iter().zip(&checked.commit_at) {
        if seq.slot < 0 {
            continue;
        }
        let st = &mut states[seq.slot as usize];
        let y = window_rows(layer, st, &step.rows, seq.start, seq.len, commit_at, state);
        for (r, yr) in y.chunks(n).enumerate() {
            let row = seq.start + r;
            for (m, &v) in yr.iter().enumerate() {
                buf[row * n + m] = out.round_f64(v);
            }
            if let Some(p) = step.plane_stride {
                for (m, &v) in yr.iter().enumerate() {
                    for plane in 1..4 {
                        buf[plane * p + row * n + m] =
                            out.round_f64(v * crate::plane_scale(plane, m) as f64);
                    }
                }
                for (q, g) in yr.chunks(16).enumerate() {
                    let even: f64 = g.iter().step_by(2).sum();
                    let odd: f64 = g.iter().skip(1).step_by(2).sum();
                    buf[4 * p + row * (n / 16) + q] = out.round_f64(even + odd);
                }
            }
        }
    }
    Ok(buf)
}

/// A uniform f32 batch, as [`step_varlen`] runs it (an f32 state, f32 outputs).
pub fn step(
    layer: &Layer,
    states: &mut [SeqState],
    batch: &Batch<'_>,
    slots: &[i32],
    commit: Commit,
    plane_stride: Option<usize>,
) -> Result<Vec<f64>> {
    let args = crate::StepArgs {
        batch: *batch,
        slots,
        commit,
        plane_stride,
    };
    let seqs = args.seqs(layer.shape())?;
    step_varlen(layer, states, &args.varlen(&seqs), DType::F32, DType::F32)
}
