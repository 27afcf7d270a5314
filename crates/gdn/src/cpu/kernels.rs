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

/// The rows of one value head's state inside a pool slot: row i at `base + i * stride`, `d` floats each.
pub struct HeadRows {
    base: *mut f32,
    stride: usize,
    d: usize,
}

// SAFETY: a HeadRows is only created (unsafely, below) for rows no other live reference or HeadRows reaches,
// so moving it to another thread cannot create shared mutable access.
unsafe impl Send for HeadRows {}

impl HeadRows {
    /// # Safety
    /// For every i < d, `base + i * stride .. + d` must be valid for reads and writes for the life of the value,
    /// and no other reference or `HeadRows` may reach those floats meanwhile.
    pub unsafe fn new(base: *mut f32, stride: usize, d: usize) -> Self {
        HeadRows { base, stride, d }
    }
    #[inline(always)]
    fn row(&self, i: usize) -> &[f32] {
        debug_assert!(i < self.d);
        // SAFETY: row i lies in the region `new`'s contract makes valid and exclusive to self.
        unsafe { std::slice::from_raw_parts(self.base.add(i * self.stride), self.d) }
    }
    #[inline(always)]
    fn row_mut(&mut self, i: usize) -> &mut [f32] {
        debug_assert!(i < self.d);
        // SAFETY: as in `row`; `&mut self` makes this the only live borrow of the row.
        unsafe { std::slice::from_raw_parts_mut(self.base.add(i * self.stride), self.d) }
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

/// Where a pass reads the head's state and where it writes the updated rows.
#[derive(Clone, Copy)]
struct Flow {
    /// Read from the pool (the window's first token) rather than from `work`.
    from_pool: bool,
    /// Write to `work`: a later pass reads it.
    to_work: bool,
    /// Write to the pool: this is the commit token.
    to_pool: bool,
}

/// kv[c0..c0 + W] = sum_i S[i][c0..c0 + W] k_i with the accumulators in registers. Rows read from the pool are
/// copied into `work` on the way when `flow.to_work`.
#[inline(always)]
fn kv_block<const W: usize>(
    rows: &HeadRows,
    flow: Flow,
    work: &mut [f32],
    k: &[f32],
    kv: &mut [f32],
    c0: usize,
) {
    let d = k.len();
    let mut acc = [0.0f32; W];
    for (i, &ki) in k.iter().enumerate() {
        let s: [f32; W] = if flow.from_pool {
            rows.row(i)[c0..c0 + W].try_into().expect("block")
        } else {
            work[i * d + c0..i * d + c0 + W].try_into().expect("block")
        };
        if flow.from_pool && flow.to_work {
            work[i * d + c0..i * d + c0 + W].copy_from_slice(&s);
        }
        for l in 0..W {
            acc[l] = s[l].mul_add(ki, acc[l]);
        }
    }
    kv[c0..c0 + W].copy_from_slice(&acc);
}

/// The delta-rule update of columns c0..c0 + W and their readout: `S = g S + k delta^T`, `o = S^T q`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn update_block<const W: usize>(
    rows: &mut HeadRows,
    flow: Flow,
    work: &mut [f32],
    k: &[f32],
    q: &[f32],
    g: f32,
    delta: &[f32],
    o: &mut [f32],
    c0: usize,
) {
    let d = k.len();
    let dl: [f32; W] = delta[c0..c0 + W].try_into().expect("block");
    let mut acc = [0.0f32; W];
    for i in 0..d {
        let (ki, qi) = (k[i], q[i]);
        let mut x: [f32; W] = if flow.from_pool {
            rows.row(i)[c0..c0 + W].try_into().expect("block")
        } else {
            work[i * d + c0..i * d + c0 + W].try_into().expect("block")
        };
        for l in 0..W {
            x[l] = g.mul_add(x[l], ki * dl[l]);
            acc[l] = x[l].mul_add(qi, acc[l]);
        }
        if flow.to_work {
            work[i * d + c0..i * d + c0 + W].copy_from_slice(&x);
        }
        if flow.to_pool {
            rows.row_mut(i)[c0..c0 + W].copy_from_slice(&x);
        }
    }
    o[c0..c0 + W].copy_from_slice(&acc);
}

/// Floats of scratch `head_window` needs.
pub fn head_scratch_len(d: usize) -> usize {
    d * d + 4 * d
}

/// SPEC.md steps 3 to 7 for one value head over a window. The state is read from the pool once, carried in
/// `work` between tokens, and written back after token `commit_at - 1`. y goes to `y` [t][d].
#[multiversion(targets("x86_64+avx512f+avx512vl+fma", "x86_64+avx2+fma", "aarch64+neon"))]
pub fn head_window<'a>(inp: &HeadInputs<'a>, rows: &mut HeadRows, work: &mut [f32], y: &mut [f32]) {
    let d = inp.d;
    let (work, rest) = work.split_at_mut(d * d);
    let (kv, rest) = rest.split_at_mut(d);
    let (delta, rest) = rest.split_at_mut(d);
    let o = &mut rest[..d];
    let inv_sqrt_d = 1.0 / (d as f32).sqrt();
    for tok in 0..inp.t {
        let q = &inp.q[tok * d..(tok + 1) * d];
        let k = &inp.k[tok * d..(tok + 1) * d];
        let v = &inp.v[tok * d..(tok + 1) * d];
        let g = decay(inp.alpha[tok], inp.dt, inp.a);
        let b = sigmoid(inp.beta[tok]);
        // kv_j = sum_i S[i][j] k_i, rows in order. The first token reads the pool; later ones read `work`,
        // which the first pass fills only when later tokens need it.
        let more = tok + 1 < inp.t;
        let read = Flow {
            from_pool: tok == 0,
            to_work: tok == 0 && more,
            to_pool: false,
        };
        let (wide, narrow) = blocks::<64>(d);
        for c0 in wide {
            kv_block::<64>(rows, read, work, k, kv, c0);
        }
        for c0 in narrow {
            kv_block::<LANES>(rows, read, work, k, kv, c0);
        }
        for j in 0..d {
            delta[j] = (v[j] - g * kv[j]) * b;
        }
        // S = g S + k delta^T, then o_j = sum_i S[i][j] q_i with the updated rows
        let update = Flow {
            from_pool: tok == 0 && !more,
            to_work: more,
            to_pool: tok + 1 == inp.commit_at,
        };
        let (wide, narrow) = blocks::<32>(d);
        for c0 in wide {
            update_block::<32>(rows, update, work, k, q, g, delta, o, c0);
        }
        for c0 in narrow {
            update_block::<LANES>(rows, update, work, k, q, g, delta, o, c0);
        }
        // gated RMS norm
        for x in o.iter_mut() {
            *x *= inv_sqrt_d;
        }
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
    }
}
