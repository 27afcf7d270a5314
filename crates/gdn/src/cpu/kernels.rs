//! The f32 inner loops of the CPU backend. Each is plain Rust over contiguous columns in groups of 16 lanes,
//! compiled once per instruction set by `multiversion` and chosen at run time; the lane order of every
//! reduction is fixed, so every instruction set gives the same bits.

use multiversion::multiversion;

use crate::Gate;

/// Lanes of the fixed-order partial sums.
pub const LANES: usize = 16;

/// `sum x_i^2` with 16 partial sums combined in a fixed tree.
#[inline(always)]
pub fn sum_squares(x: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    for c in x.as_chunks::<LANES>().0 {
        for l in 0..LANES {
            acc[l] = c[l].mul_add(c[l], acc[l]);
        }
    }
    let mut w = LANES;
    while w > 1 {
        w /= 2;
        for l in 0..w {
            acc[l] += acc[l + w];
        }
    }
    acc[0]
}

pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `gate = exp(softplus(alpha + dt) * a)` with SPEC.md's accurate softplus and its cut-over at 20.
pub fn decay(alpha: f32, dt: f32, a: f32) -> f32 {
    let u = alpha + dt;
    let e = u.exp();
    let w = 1.0 + e;
    let sp = if u > 20.0 {
        u
    } else if w == 1.0 {
        e
    } else {
        w.ln() * e / (w - 1.0)
    };
    (sp * a).exp()
}

/// Conv + SiLU of one head block (`d` channels) over a window, SPEC.md step 1, and for q/k blocks the L2 norm
/// of step 2. `hist` is the block's history [d][3]; `out` gets [t][d]; `commit_hist` receives the history after
/// `commit_at` tokens when that is non-zero.
#[multiversion(targets("x86_64+avx512f+avx512vl+fma", "x86_64+avx2+fma", "aarch64+neon"))]
#[allow(clippy::too_many_arguments)]
pub fn conv_block(
    d: usize,
    t: usize,
    qkv: &[f32],
    qkv_stride: usize,
    w: &[f32],
    hist: &[f32],
    out: &mut [f32],
    normalize: Option<f32>,
) {
    for c in 0..d {
        let wc = &w[c * 4..c * 4 + 4];
        let mut x = [hist[c * 3], hist[c * 3 + 1], hist[c * 3 + 2], 0.0];
        for tok in 0..t {
            x[3] = qkv[tok * qkv_stride + c];
            let mut s = 0.0f32;
            for k in 0..4 {
                s = x[k].mul_add(wc[k], s);
            }
            out[tok * d + c] = s / (1.0 + (-s).exp());
            x = [x[1], x[2], x[3], 0.0];
        }
    }
    if let Some(eps) = normalize {
        let inv_sqrt_d = 1.0 / (d as f32).sqrt();
        for row in out[..t * d].chunks_exact_mut(d) {
            let r = 1.0 / (sum_squares(row) / d as f32 + eps / d as f32).sqrt();
            for x in row.iter_mut() {
                *x = (r * *x) * inv_sqrt_d;
            }
        }
    }
}

/// The history of a block after its first `k` tokens: the last three raw inputs of (old history, inputs).
pub fn shifted_hist(d: usize, k: usize, qkv: &[f32], qkv_stride: usize, hist: &mut [f32]) {
    for c in 0..d {
        let mut x = [hist[c * 3], hist[c * 3 + 1], hist[c * 3 + 2]];
        for tok in 0..k {
            x = [x[1], x[2], qkv[tok * qkv_stride + c]];
        }
        hist[c * 3..c * 3 + 3].copy_from_slice(&x);
    }
}

/// What one value head reads for a window.
pub struct HeadInputs<'a> {
    pub d: usize,
    pub t: usize,
    /// Normalized q and k of the head's q/k head, raw SiLU'd v: [t][d] each.
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    /// Per token: alpha, beta logit ([t], already picked out for this head), and z [t][d].
    pub alpha: &'a [f32],
    pub beta: &'a [f32],
    pub z: &'a [f32],
    pub z_stride: usize,
    pub dt: f32,
    pub a: f32,
    pub gamma: &'a [f32],
    pub gate: Gate,
    pub eps: f32,
    pub commit_at: usize,
}

/// Column starts of a row of `d` floats cut in blocks of `W` while they fit, then in blocks of `LANES`.
#[inline(always)]
fn blocks<const W: usize>(d: usize) -> (impl Iterator<Item = usize>, impl Iterator<Item = usize>) {
    let wide_end = d / W * W;
    ((0..wide_end).step_by(W), (wide_end..d).step_by(LANES))
}

/// Where an update pass reads the head's state and where it writes the updated rows.
#[derive(Clone, Copy)]
struct Flow {
    /// Read from the pool (the window's first token) rather than from `work`.
    from_pool: bool,
    /// Write to `work`: a later token reads it.
    to_work: bool,
    /// Write to the pool: this is the commit token.
    to_pool: bool,
}

#[inline(always)]
fn load<const W: usize>(
    pool: &[f32],
    work: &[f32],
    from_pool: bool,
    d: usize,
    i: usize,
    c0: usize,
) -> [f32; W] {
    if from_pool {
        pool[i * d + c0..i * d + c0 + W].try_into().expect("block")
    } else {
        work[i * d + c0..i * d + c0 + W].try_into().expect("block")
    }
}

/// `kv = S^T k` and `sq = S^T q` over columns c0..c0 + W, accumulators in registers, rows in order.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn read_block<const W: usize>(
    pool: &[f32],
    work: &[f32],
    from_pool: bool,
    k: &[f32],
    q: &[f32],
    kv: &mut [f32],
    sq: &mut [f32],
    c0: usize,
) {
    let (mut ak, mut aq) = ([0.0f32; W], [0.0f32; W]);
    for i in 0..k.len() {
        let (ki, qi) = (k[i], q[i]);
        let s = load::<W>(pool, work, from_pool, k.len(), i, c0);
        for l in 0..W {
            ak[l] = s[l].mul_add(ki, ak[l]);
            aq[l] = s[l].mul_add(qi, aq[l]);
        }
    }
    kv[c0..c0 + W].copy_from_slice(&ak);
    sq[c0..c0 + W].copy_from_slice(&aq);
}

/// The delta-rule update `S = g S + k delta^T` of columns c0..c0 + W, fused with the next token's read
/// (`kv = S^T k'`, `sq = S^T q'` of the updated rows) when there is a next token.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn update_block<const W: usize>(
    pool: &mut [f32],
    work: &mut [f32],
    flow: Flow,
    g: f32,
    k: &[f32],
    delta: &[f32],
    next: Option<(&[f32], &[f32])>,
    kv: &mut [f32],
    sq: &mut [f32],
    c0: usize,
) {
    let d = k.len();
    let dl: [f32; W] = delta[c0..c0 + W].try_into().expect("block");
    let (mut ak, mut aq) = ([0.0f32; W], [0.0f32; W]);
    for i in 0..d {
        let ki = k[i];
        let mut x = load::<W>(pool, work, flow.from_pool, d, i, c0);
        for l in 0..W {
            x[l] = g.mul_add(x[l], ki * dl[l]);
        }
        if let Some((kn, qn)) = next {
            let (kni, qni) = (kn[i], qn[i]);
            for l in 0..W {
                ak[l] = x[l].mul_add(kni, ak[l]);
                aq[l] = x[l].mul_add(qni, aq[l]);
            }
        }
        if flow.to_work {
            work[i * d + c0..i * d + c0 + W].copy_from_slice(&x);
        }
        if flow.to_pool {
            pool[i * d + c0..i * d + c0 + W].copy_from_slice(&x);
        }
    }
    if next.is_some() {
        kv[c0..c0 + W].copy_from_slice(&ak);
        sq[c0..c0 + W].copy_from_slice(&aq);
    }
}

/// Floats of scratch `head_window` needs.
pub fn head_scratch_len(d: usize) -> usize {
    d * d + 4 * d
}

/// Column block width of the state passes: 8 AVX2 registers of accumulators, the rest for the row.
const BLOCK: usize = 32;

/// SPEC.md steps 3 to 7 for one value head over a window, with one pass over the state per token.
///
/// The readout uses `o = S_new^T q = g (S^T q) + delta (k . q)`, equal in exact arithmetic to SPEC.md's sum
/// over the updated rows, so `S^T k` and `S^T q` come from the same read of S, and the update of token t is
/// fused with the read for token t + 1. The state is read from the pool once, carried in `work` between
/// tokens, and written back at token `commit_at - 1`; an update nobody reads (after the last token, no commit)
/// is skipped. y goes to `y` [t][d].
#[multiversion(targets("x86_64+avx512f+avx512vl+fma", "x86_64+avx2+fma", "aarch64+neon"))]
pub fn head_window<'a>(inp: &HeadInputs<'a>, pool: &mut [f32], work: &mut [f32], y: &mut [f32]) {
    let d = inp.d;
    let (work, rest) = work.split_at_mut(d * d);
    let (kv, rest) = rest.split_at_mut(d);
    let (sq, rest) = rest.split_at_mut(d);
    let (delta, rest) = rest.split_at_mut(d);
    let o = &mut rest[..d];
    let inv_sqrt_d = 1.0 / (d as f32).sqrt();
    let tok_slice = |x: &'a [f32], tok: usize| &x[tok * d..(tok + 1) * d];
    let (wide, narrow) = blocks::<BLOCK>(d);
    for c0 in wide {
        read_block::<BLOCK>(
            pool,
            work,
            true,
            tok_slice(inp.k, 0),
            tok_slice(inp.q, 0),
            kv,
            sq,
            c0,
        );
    }
    for c0 in narrow {
        read_block::<LANES>(
            pool,
            work,
            true,
            tok_slice(inp.k, 0),
            tok_slice(inp.q, 0),
            kv,
            sq,
            c0,
        );
    }
    for tok in 0..inp.t {
        let (q, k, v) = (
            tok_slice(inp.q, tok),
            tok_slice(inp.k, tok),
            tok_slice(inp.v, tok),
        );
        let g = decay(inp.alpha[tok], inp.dt, inp.a);
        let b = sigmoid(inp.beta[tok]);
        let kq = dot(k, q);
        for j in 0..d {
            delta[j] = (v[j] - g * kv[j]) * b;
            o[j] = g.mul_add(sq[j], delta[j] * kq) * inv_sqrt_d;
        }
        // gated RMS norm
        let rs = 1.0 / (sum_squares(o) / d as f32 + inp.eps).sqrt();
        let z = &inp.z[tok * inp.z_stride..tok * inp.z_stride + d];
        let yt = &mut y[tok * d..(tok + 1) * d];
        for j in 0..d {
            let act = match inp.gate {
                Gate::Sigmoid => sigmoid(z[j]),
                Gate::Silu => z[j] * sigmoid(z[j]),
            };
            yt[j] = ((rs * o[j]) * inp.gamma[j]) * act;
        }
        // the update, fused with the next token's read
        let more = tok + 1 < inp.t;
        let flow = Flow {
            from_pool: tok == 0,
            to_work: more,
            to_pool: tok + 1 == inp.commit_at,
        };
        if !flow.to_work && !flow.to_pool {
            continue;
        }
        let next = more.then(|| (tok_slice(inp.k, tok + 1), tok_slice(inp.q, tok + 1)));
        let (wide, narrow) = blocks::<BLOCK>(d);
        for c0 in wide {
            update_block::<BLOCK>(pool, work, flow, g, k, delta, next, kv, sq, c0);
        }
        for c0 in narrow {
            update_block::<LANES>(pool, work, flow, g, k, delta, next, kv, sq, c0);
        }
    }
}

/// `x . y` with 16 partial sums in a fixed order.
#[inline(always)]
fn dot(x: &[f32], y: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    for (a, b) in x
        .as_chunks::<LANES>()
        .0
        .iter()
        .zip(y.as_chunks::<LANES>().0)
    {
        for l in 0..LANES {
            acc[l] = a[l].mul_add(b[l], acc[l]);
        }
    }
    let mut w = LANES;
    while w > 1 {
        w /= 2;
        for l in 0..w {
            acc[l] += acc[l + w];
        }
    }
    acc[0]
}
