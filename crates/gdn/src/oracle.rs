//! The float64 oracle: SPEC.md as plain code. Obviously right, never optimised; every backend is checked
//! against it. Inputs are the same f32 values a backend sees, widened exactly.

use crate::{Batch, Commit, Gate, Layer, OutputLayout, Result};

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

/// Runs one sequence's window (a batch of one) and returns y [t][n].
/// The state is replaced by the committed one (unchanged under `Verify`).
pub fn window(
    layer: &Layer,
    st: &mut SeqState,
    win: &Batch<'_>,
    commit: Commit,
) -> Result<Vec<f64>> {
    assert_eq!(win.b, 1, "oracle::window takes one sequence");
    let (t, qkv, alpha, beta, z) = (win.t, win.qkv, win.alpha, win.beta, win.z);
    let sh = *layer.shape();
    let (d, h_k, h_v, c_n, n) = (sh.d, sh.h_k, sh.h_v, sh.channels(), sh.n());
    let p = &layer.params;
    let eps = layer.config.eps as f64;
    let commit_at = commit.commit_at(t)?;
    let mut s = st.s.clone();
    let mut h = st.h.clone();
    let mut y = vec![0.0; t * n];
    for tok in 0..t {
        // 1. conv + SiLU of every channel, then the history shift (each channel once per token)
        let mut cv = vec![0.0; c_n];
        for c in 0..c_n {
            let x = [
                h[c * 3],
                h[c * 3 + 1],
                h[c * 3 + 2],
                qkv[tok * c_n + c] as f64,
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
            let u = alpha[tok * h_v + hv] as f64 + p.dt[hv] as f64;
            let gate = (softplus(u) * p.a[hv] as f64).exp();
            let b = sigmoid(beta[tok * h_v + hv] as f64);
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
                let zz = z[tok * n + hv * d + j] as f64;
                let act = match layer.config.gate {
                    Gate::Sigmoid => sigmoid(zz),
                    Gate::Silu => zz * sigmoid(zz),
                };
                y[tok * n + hv * d + j] = rs * o[j] * p.gamma[j] as f64 * act;
            }
        }
        if tok + 1 == commit_at {
            st.s.copy_from_slice(&s);
            st.h.copy_from_slice(&h);
        }
    }
    Ok(y)
}

/// Runs a batch the way a backend's step does: `states[slot]` per sequence (negative slots skipped, their
/// rows left at 0) and the whole output buffer in [`OutputLayout`] order, planes and group sums included.
pub fn step(
    layer: &Layer,
    states: &mut [SeqState],
    batch: &Batch<'_>,
    slots: &[i32],
    commit: Commit,
    plane_stride: Option<usize>,
) -> Result<Vec<f64>> {
    let sh = layer.shape();
    let (t, c_n, h_v, n) = (batch.t, sh.channels(), sh.h_v, sh.n());
    let layout = OutputLayout::new(sh, batch.b, t, plane_stride)?;
    // the reference rejects what every backend rejects
    let args = crate::StepArgs {
        batch: *batch,
        slots,
        commit,
        plane_stride,
    };
    args.validate(layer, states.len(), layout.len())?;
    let mut out = vec![0.0; layout.len()];
    for (b, &slot) in slots.iter().enumerate() {
        if slot < 0 {
            continue;
        }
        let win = Batch {
            b: 1,
            t,
            qkv: &batch.qkv[b * t * c_n..(b + 1) * t * c_n],
            alpha: &batch.alpha[b * t * h_v..(b + 1) * t * h_v],
            beta: &batch.beta[b * t * h_v..(b + 1) * t * h_v],
            z: &batch.z[b * t * n..(b + 1) * t * n],
        };
        let y = window(layer, &mut states[slot as usize], &win, commit)?;
        let row0 = b * t;
        out[row0 * n..(row0 + t) * n].copy_from_slice(&y);
        if let Some(p) = plane_stride {
            for (r, yr) in y.chunks(n).enumerate() {
                let row = row0 + r;
                for (m, &v) in yr.iter().enumerate() {
                    for plane in 1..4 {
                        out[plane * p + row * n + m] = v * crate::plane_scale(plane, m) as f64;
                    }
                }
                for (q, g) in yr.chunks(16).enumerate() {
                    let even: f64 = g.iter().step_by(2).sum();
                    let odd: f64 = g.iter().skip(1).step_by(2).sum();
                    out[4 * p + row * (n / 16) + q] = even + odd;
                }
            }
        }
    }
    Ok(out)
}
