//! The f32 inner loops of the CPU backend. Each is plain Rust over contiguous columns in groups of 16 lanes,
//! compiled once per instruction set by `multiversion` and chosen at run time; the lane order of every
//! reduction is fixed, so every instruction set gives the same bits.

use multiversion::multiversion;

use crate::backend::prefetch;
use crate::Gate;

/// Lanes of the fixed-order partial sums.
pub const LANES: usize = 16;

/// `sum x_i^2` with 16 partial sums combined in a fixed tree.
#[inline(always)]
pub fn sum_squares(x: &[f32]) -> f32 {
    dot(x, x)
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

/// `exp(x)` lane by lane, for the logistic functions only: below -86 it returns 0 (where `1 + exp(x)` is 1
/// anyway). Cody-Waite reduction to r in [-ln2/2, ln2/2] and a degree-7 Taylor polynomial: within 2 ulp of the
/// exact value. NaN stays NaN, +inf and anything above 88.7 give +inf. Written so it vectorizes.
#[inline(always)]
fn exp_lanes(x: &[f32; LANES]) -> [f32; LANES] {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    let mut out = [0.0f32; LANES];
    for l in 0..LANES {
        let v = x[l];
        // clamp keeps NaN (f32::min/max would replace it)
        let c = v.clamp(-86.0, 88.7);
        // n = round(c log2 e) by the 1.5 * 2^23 trick: the integer lands in the low mantissa bits of `m`, read
        // back with a bit cast (a float-to-int cast would be scalarized for its saturation rules)
        const MAGIC: f32 = 12_582_912.0;
        let m = c.mul_add(LOG2E, MAGIC);
        let n = m - MAGIC;
        let r = n.mul_add(-LN2_LO, n.mul_add(-LN2_HI, c));
        let mut p: f32 = 1.0 / 5040.0;
        p = p.mul_add(r, 1.0 / 720.0);
        p = p.mul_add(r, 1.0 / 120.0);
        p = p.mul_add(r, 1.0 / 24.0);
        p = p.mul_add(r, 1.0 / 6.0);
        p = p.mul_add(r, 0.5);
        p = p.mul_add(r, 1.0);
        p = p.mul_add(r, 1.0);
        // 2^n as 2 * 2^(n - 1), so n = 128 stays a normal exponent
        let scale =
            f32::from_bits(m.to_bits().wrapping_sub(MAGIC.to_bits()).wrapping_add(126) << 23);
        let e = p * scale * 2.0;
        out[l] = if v > 88.7 {
            f32::INFINITY
        } else if v < -86.0 {
            0.0
        } else {
            e
        };
    }
    out
}

/// `x / (1 + exp(-x))` over 16 lanes.
#[inline(always)]
fn silu_lanes(x: &[f32; LANES]) -> [f32; LANES] {
    let neg = x.map(|v| -v);
    let e = exp_lanes(&neg);
    let mut out = [0.0f32; LANES];
    for l in 0..LANES {
        out[l] = x[l] / (1.0 + e[l]);
    }
    out
}

/// The output gate `act(z)` over 16 lanes.
#[inline(always)]
fn gate_lanes(z: &[f32; LANES], gate: Gate) -> [f32; LANES] {
    let neg = z.map(|v| -v);
    let e = exp_lanes(&neg);
    // the gate is chosen outside the lane loops: a `match` inside one kept LLVM from vectorizing its division
    let sig: [f32; LANES] = std::array::from_fn(|l| 1.0 / (1.0 + e[l]));
    match gate {
        Gate::Sigmoid => sig,
        Gate::Silu => std::array::from_fn(|l| z[l] * sig[l]),
    }
}

/// How many tokens ahead the conv and the output gate prefetch their input rows. A head's row of a token is
/// d floats at a stride of a whole token's row (40 KiB for the seed's qkv), a new page every token, which the
/// hardware prefetchers do not follow, so without it a long window's conv and gate wait on memory every token.
const ROWS_AHEAD: usize = 6;

/// Prefetches the cache lines of `x[at..at + len]`, or nothing where that lies past `x`.
#[inline(always)]
fn prefetch_row(x: &[f32], at: usize, len: usize) {
    if let Some(row) = x.get(at..at + len) {
        for i in (0..len).step_by(LANES) {
            prefetch(row[i..].as_ptr());
        }
    }
}

/// Position `pos` of a conv block's input sequence (3 history entries, then the window's input rows) from
/// group 0 on, and the distance between groups of 16 channels: the history is [g][3][16], an input row [g][16].
#[inline(always)]
fn conv_input<'a>(
    hist: &'a [f32],
    qkv: &'a [f32],
    stride: usize,
    d: usize,
    pos: usize,
) -> (&'a [f32], usize) {
    if pos < 3 {
        (&hist[pos * LANES..], 3 * LANES)
    } else {
        (&qkv[(pos - 3) * stride..(pos - 3) * stride + d], LANES)
    }
}

/// Group `g` (16 channels) of a position returned by [`conv_input`].
#[inline(always)]
fn group((v, stride): (&[f32], usize), g: usize) -> &[f32; LANES] {
    v[g * stride..g * stride + LANES].try_into().expect("lanes")
}

/// Conv + SiLU of one head block (`d` channels, 16 at a time) over a window, SPEC.md step 1, and for q/k
/// blocks the L2 norm of step 2. `w` and `hist` are the block's taps and history in lanes ([d / 16][4 or 3][16]);
/// `hist` is replaced by the history after `commit_at` tokens when that is non-zero; `out` gets [t][d].
#[multiversion(targets("x86_64+avx512f+avx512vl+fma", "x86_64+avx2+fma", "aarch64+neon"))]
#[allow(clippy::too_many_arguments)]
pub fn conv_block(
    d: usize,
    t: usize,
    qkv: &[f32],
    qkv_stride: usize,
    w: &[f32],
    hist: &mut [f32],
    out: &mut [f32],
    normalize: Option<f32>,
    commit_at: usize,
) {
    // The conv reads the sequence x = [history (3 entries), the window's inputs (t rows)] at positions tok..tok + 4
    // for token tok: the taps come straight from the history or from the input rows (still in cache), so there
    // is no shift register to zero, fill and move. Token by token, each token's inputs being one contiguous row.
    let inv_sqrt_d = 1.0 / (d as f32).sqrt();
    for tok in 0..t {
        prefetch_row(qkv, (tok + ROWS_AHEAD) * qkv_stride, d);
        // written out rather than `[0, 1, 2, 3].map(..)`: LLVM left those array maps as calls, one per group
        let input = |j| conv_input(hist, qkv, qkv_stride, d, tok + j);
        let taps = [input(0), input(1), input(2), input(3)];
        for g in 0..d / LANES {
            let wg = &w[g * 4 * LANES..(g + 1) * 4 * LANES];
            let x = [
                group(taps[0], g),
                group(taps[1], g),
                group(taps[2], g),
                group(taps[3], g),
            ];
            let mut s = [0.0f32; LANES];
            for l in 0..LANES {
                s[l] = x[0][l].mul_add(wg[l], s[l]);
                s[l] = x[1][l].mul_add(wg[LANES + l], s[l]);
                s[l] = x[2][l].mul_add(wg[2 * LANES + l], s[l]);
                s[l] = x[3][l].mul_add(wg[3 * LANES + l], s[l]);
            }
            out[tok * d + g * LANES..tok * d + (g + 1) * LANES].copy_from_slice(&silu_lanes(&s));
        }
        // the L2 norm of the token's row while it is in L1 (after the whole window it came back from memory at
        // long windows: 2 MB a block at T 4096)
        if let Some(eps) = normalize {
            let row = &mut out[tok * d..(tok + 1) * d];
            let r = 1.0 / (sum_squares(row) / d as f32 + eps / d as f32).sqrt();
            for x in row.iter_mut() {
                *x = (r * *x) * inv_sqrt_d;
            }
        }
    }
    // the history after `commit_at` tokens is x at positions commit_at..commit_at + 3; written in increasing
    // order, each entry reads a position past the one it overwrites, so no old entry is lost too early
    if commit_at > 0 {
        for g in 0..d / LANES {
            for m in 0..3 {
                let e = *group(conv_input(hist, qkv, qkv_stride, d, commit_at + m), g);
                hist[(g * 3 + m) * LANES..(g * 3 + m + 1) * LANES].copy_from_slice(&e);
            }
        }
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
    /// Per token: alpha and the beta logit at `[tok * gate_stride]` (slices starting at this head's entry of the
    /// first token), and z [t][d].
    pub alpha: &'a [f32],
    pub beta: &'a [f32],
    pub gate_stride: usize,
    pub z: &'a [f32],
    pub z_stride: usize,
    pub dt: f32,
    pub a: f32,
    pub gamma: &'a [f32],
    pub gate: Gate,
    pub eps: f32,
    pub commit_at: usize,
    /// How many deferred updates (the first entries of the head's pending region) the stored rows still owe
    /// (see `head_window`).
    pub owed: usize,
    /// Hold the window (a speculative verify window): keep every token's update in the pending region for a
    /// later step to apply a prefix of.
    pub hold: bool,
}

/// The most tokens a held window may have on the CPU (its updates are applied from registers at the next read).
pub const MAX_HELD: usize = 16;

/// Floats of one head's deferred update: the gate, then k [d], then delta [d].
pub fn pending_len(d: usize) -> usize {
    1 + 2 * d
}

/// Whether a window of `t` tokens committed after `commit_at` leaves its update deferred: a one-token commit
/// (decode), see `head_window`.
pub fn defers_update(t: usize, commit_at: usize) -> bool {
    t == 1 && commit_at == 1
}

/// One head's deferred update as (gate, k, delta).
pub fn pending_parts(p: &[f32], d: usize) -> (f32, &[f32], &[f32]) {
    (p[0], &p[1..1 + d], &p[1 + d..1 + 2 * d])
}

/// A row with the deferred update `S = g S + k delta^T` applied: the same operations as a token's update in
/// `update_rows`, so a deferred update gives the bits an applied one would have.
#[inline(always)]
pub fn apply_pending(g: f32, src: &[f32; LANES], ki: f32, delta: &[f32; LANES]) -> [f32; LANES] {
    std::array::from_fn(|l| g.mul_add(src[l], ki * delta[l]))
}

/// Tokens of a window that run through every column block before the next ones do: a segment's q, k and v rows
/// and its readouts stay in L2 while the head's blocks take their turns (each block re-reads them), where a whole
/// long window's would come from memory once a block.
pub const SEGMENT: usize = 256;

/// Floats of scratch `head_window` needs for a window of `t` tokens.
pub fn head_scratch_len(d: usize, t: usize) -> usize {
    let work_rows = if t <= SEGMENT { d } else { d * d / LANES };
    // a held or deferring window's deltas (such a window has at most `MAX_HELD` tokens); growing with t, so that
    // a scratch sized for a call's longest window fits its shorter ones
    let held = t.min(MAX_HELD) * d;
    work_rows * LANES + 2 * (d / LANES) * LANES + t.min(SEGMENT) * d + 3 * t + held
}

/// Deferred updates of one column block: (gate, k [d], the block's 16 lanes of delta), at most `N` (1 for
/// decode's deferred update, so that it costs what it did before windows could be held; [`MAX_HELD`] else).
struct Owed<'a, const N: usize> {
    n: usize,
    u: [(f32, &'a [f32], Lanes); N],
}

impl<'a, const N: usize> Owed<'a, N> {
    #[inline(always)]
    fn of(pending: &'a [f32], n: usize, d: usize, c0: usize) -> Owed<'a, N> {
        debug_assert!(n <= N);
        let pl = pending_len(d);
        let mut u = [(1.0f32, &pending[..0], [0.0f32; LANES]); N];
        for (j, e) in u.iter_mut().enumerate().take(n) {
            let (g, k, delta) = pending_parts(&pending[j * pl..(j + 1) * pl], d);
            *e = (g, k, block_lanes(delta, c0));
        }
        Owed { n, u }
    }
    /// `row` of the block with every owed update applied in order, in f32.
    #[inline(always)]
    fn apply(&self, x: Lanes, row: usize) -> Lanes {
        let mut x = x;
        for (g, k, delta) in &self.u[..self.n] {
            x = apply_pending(*g, &x, k[row], delta);
        }
        x
    }
}

type Lanes = [f32; LANES];

/// Rows of a column block the update loop takes per opaque step (4: 2% slower at T 512, the bookkeeping of twice
/// the steps).
const ROWS: usize = 8;

/// The update of one column block's rows, `S = g S + k delta^T`, for every row in order, reading the rows from
/// the pool (`FROM_POOL`: the window's first token when no deferred update is owed) or from `work`; with `MORE`
/// it also accumulates the next token's `S^T k'` and `S^T q'` from the updated rows and keeps them in `work`,
/// with `COMMIT` it writes them to the pool. The flags are constants so each combination compiles to a loop
/// without branches.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn update_rows<E: StateElem, const FROM_POOL: bool, const MORE: bool, const COMMIT: bool>(
    pool: &mut [E::Row],
    work: &mut [Lanes],
    g: f32,
    delta: &Lanes,
    k: &[f32],
    kn: &[f32],
    qn: &[f32],
) -> (Lanes, Lanes) {
    let d = pool.len();
    // rows eight at a time (d is a multiple of 16), even rows into one accumulator pair and odd rows into the
    // other, so consecutive rows do not wait on one FMA chain; the pairs are added once at the end
    let (mut kv, mut sq) = ([[0.0f32; LANES]; 2], [[0.0f32; LANES]; 2]);
    let steps = pool
        .as_chunks_mut::<ROWS>()
        .0
        .iter_mut()
        .zip(work[..d].as_chunks_mut::<ROWS>().0)
        .zip(k[..d].as_chunks::<ROWS>().0)
        .zip(
            kn[..d]
                .as_chunks::<ROWS>()
                .0
                .iter()
                .zip(qn[..d].as_chunks::<ROWS>().0),
        );
    for (((prows, wrows), kq), (knq, qnq)) in steps {
        // opaque to the optimizer, so that each row stays one vector of 16 lanes: left to itself, LLVM's loop
        // vectorizer took 16 rows at a time in the AVX-512 clone, with a gather and a scatter per lane
        // (CPU-NOTES.md); the AVX2 clone never did
        let wrows = std::hint::black_box(wrows);
        for r in 0..ROWS {
            let src = if FROM_POOL {
                E::load(&prows[r])
            } else {
                wrows[r]
            };
            let x = apply_pending(g, &src, kq[r], delta);
            if MORE {
                let (kni, qni) = (knq[r], qnq[r]);
                let (kv, sq) = (&mut kv[r % 2], &mut sq[r % 2]);
                for l in 0..LANES {
                    kv[l] = x[l].mul_add(kni, kv[l]);
                    sq[l] = x[l].mul_add(qni, sq[l]);
                }
                wrows[r] = x;
            }
            if COMMIT {
                prows[r] = E::store(&x);
            }
        }
    }
    (add_lanes(&kv[0], &kv[1]), add_lanes(&sq[0], &sq[1]))
}

#[inline(always)]
fn add_lanes(a: &Lanes, b: &Lanes) -> Lanes {
    std::array::from_fn(|l| a[l] + b[l])
}

/// 16 lanes of `x` from `c0`.
#[inline(always)]
fn block_lanes(x: &[f32], c0: usize) -> Lanes {
    x[c0..c0 + LANES].try_into().expect("block")
}

/// The window's first read of a block: `S^T k` and `S^T q` of its first token, two rows at a time with an
/// accumulator pair each. With `APPLY` the rows first get the deferred update `owed` (gate, k, the block's
/// delta); `TO_POOL` writes the updated rows back, `TO_WORK` keeps them for the window's later tokens. The next
/// block in memory (past a head's last block: the next head's first, which this thread likely runs next) is
/// fetched row by row, so memory streams while this block computes. Always: in an engine a layer's state is not
/// in cache at its next call (the other layers' states pass through in between), and where it is, in a
/// benchmark stepping one layer over and over, its cost was within this VM's noise (CPU-NOTES.md).
#[inline(always)]
fn first_read<
    E: StateElem,
    const N: usize,
    const APPLY: bool,
    const TO_POOL: bool,
    const TO_WORK: bool,
>(
    inp: &HeadInputs<'_>,
    pool: &mut [E::Row],
    work: &mut [Lanes],
    owed: &Owed<'_, N>,
) -> ([Lanes; 2], [Lanes; 2]) {
    let d = inp.d;
    let (k0, q0) = (&inp.k[..d], &inp.q[..d]);
    let work = &mut work[..d];
    let (mut kv2, mut sq2) = ([[0.0f32; LANES]; 2], [[0.0f32; LANES]; 2]);
    let ahead = pool.as_ptr().wrapping_add(d);
    for i in (0..d).step_by(2) {
        for r in 0..2 {
            let row = i + r;
            prefetch(ahead.wrapping_add(row));
            // an owed update gives the state as it was committed: rounded to the pool's element (once: the
            // rounded row is what is written back and what this window reads)
            let s = if APPLY {
                let packed = E::store(&owed.apply(E::load(&pool[row]), row));
                if TO_POOL {
                    pool[row] = packed;
                }
                E::load(&packed)
            } else {
                E::load(&pool[row])
            };
            for l in 0..LANES {
                kv2[r][l] = s[l].mul_add(k0[row], kv2[r][l]);
                sq2[r][l] = s[l].mul_add(q0[row], sq2[r][l]);
            }
            if TO_WORK {
                work[row] = s;
            }
        }
    }
    (kv2, sq2)
}

/// One block of 16 columns of one head over the whole window. Columns are independent until the output norm,
/// so the block reads its rows from the pool once (the pool keeps them contiguous, [d][16]), keeps them in
/// `work` (8 KiB at d 128, in L1) between tokens with kv, sq and delta in registers, writes them back after token
/// `commit_at - 1` (a one-token commit instead writes them during the first read, with the owed update applied,
/// and leaves its own update owed in `new_delta`), and leaves the block's readout in `o` ([t][d]).
///
/// The readout uses `o = S_new^T q = g (S^T q) + delta (k . q)`, equal in exact arithmetic to SPEC.md's sum over
/// the updated rows, so `S^T k` and `S^T q` come from one read of S and each token's update is fused with the
/// next token's read; an update nobody reads (after the last token, no commit) is skipped.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn column_block<E: StateElem, const N: usize>(
    inp: &HeadInputs<'_>,
    gates: &[f32],
    betas: &[f32],
    kqs: &[f32],
    pool: &mut [E::Row],
    work: &mut [Lanes],
    o: &mut [f32],
    c0: usize,
    pending: &[f32],
    new_delta: &mut [f32],
    toks: std::ops::Range<usize>,
    // the block's S^T k and S^T q for the segment's first token, left there for the next segment's
    carry: &mut [Lanes],
) {
    let d = inp.d;
    let inv_sqrt_d = 1.0 / (d as f32).sqrt();
    let seg = toks.start;
    // the window's first read: the block's rows with the deferred updates applied when some are owed (kept in
    // `work` for the window's later tokens, and written back where this window replaces the pending updates:
    // a one-token commit that defers its own, or a held window)
    let deferred = defers_update(inp.t, inp.commit_at);
    let owed = Owed::<N>::of(pending, inp.owed, d, c0);
    let replaces = deferred || inp.hold;
    let (mut kv, mut sq) = if seg == 0 {
        let (kv2, sq2) = match (inp.owed > 0, replaces, inp.t > 1) {
            (false, _, _) => first_read::<E, N, false, false, false>(inp, pool, work, &owed),
            (true, false, false) => first_read::<E, N, true, false, false>(inp, pool, work, &owed),
            (true, true, false) => first_read::<E, N, true, true, false>(inp, pool, work, &owed),
            (true, false, true) => first_read::<E, N, true, false, true>(inp, pool, work, &owed),
            (true, true, true) => first_read::<E, N, true, true, true>(inp, pool, work, &owed),
        };
        (add_lanes(&kv2[0], &kv2[1]), add_lanes(&sq2[0], &sq2[1]))
    } else {
        (carry[0], carry[1])
    };
    for tok in toks {
        // this block's lanes of v, a line every d floats: a token's delta waits on them, and every update of the
        // block waits on the delta
        prefetch_row(inp.v, (tok + ROWS_AHEAD) * d + c0, LANES);
        let (g, b, kq) = (gates[tok], betas[tok], kqs[tok]);
        let v: &Lanes = inp.v[tok * d + c0..tok * d + c0 + LANES]
            .try_into()
            .expect("block");
        let ot: &mut Lanes = (&mut o[(tok - seg) * d + c0..(tok - seg) * d + c0 + LANES])
            .try_into()
            .expect("block");
        // lane-wise array expressions, one operation each: written as one loop over lanes, LLVM scalarized it
        // (16 extracts and scalar stores a token and block); the same operations in the same order either way
        let gkv: Lanes = std::array::from_fn(|l| g * kv[l]);
        let delta: Lanes = std::array::from_fn(|l| (v[l] - gkv[l]) * b);
        let dkq: Lanes = std::array::from_fn(|l| delta[l] * kq);
        let read: Lanes = std::array::from_fn(|l| g.mul_add(sq[l], dkq[l]) * inv_sqrt_d);
        *ot = read;
        let k = &inp.k[tok * d..(tok + 1) * d];
        let (kn, qn) = if tok + 1 < inp.t {
            (
                &inp.k[(tok + 1) * d..(tok + 2) * d],
                &inp.q[(tok + 1) * d..(tok + 2) * d],
            )
        } else {
            (k, k)
        };
        if deferred || inp.hold {
            // a one-token commit: this token's update is owed by the stored rows until the next read; a held
            // window: every token's update is kept for a later step to apply a prefix of
            new_delta[tok * d + c0..tok * d + c0 + LANES].copy_from_slice(&delta);
        }
        if deferred {
            break;
        }
        // rows come from the pool on the first token unless the first read put them (updated) in `work`
        let first = tok == 0 && inp.owed == 0;
        let more = tok + 1 < inp.t;
        let commit = tok + 1 == inp.commit_at;
        let (w, dl) = (&mut *work, &delta);
        (kv, sq) = match (first, more, commit) {
            (_, false, false) => break,
            (true, true, true) => update_rows::<E, true, true, true>(pool, w, g, dl, k, kn, qn),
            (true, true, false) => update_rows::<E, true, true, false>(pool, w, g, dl, k, kn, qn),
            (true, false, true) => update_rows::<E, true, false, true>(pool, w, g, dl, k, kn, qn),
            (false, true, true) => update_rows::<E, false, true, true>(pool, w, g, dl, k, kn, qn),
            (false, true, false) => update_rows::<E, false, true, false>(pool, w, g, dl, k, kn, qn),
            (false, false, true) => update_rows::<E, false, false, true>(pool, w, g, dl, k, kn, qn),
        };
    }
    (carry[0], carry[1]) = (kv, sq);
}

/// SPEC.md steps 3 to 7 for one value head over a window. `pool` is the head's state in the CPU pool's
/// blocked layout [d / 16][d][16] (16-column blocks, rows contiguous inside a block); y goes to `y` [t][d].
///
/// A one-token window that commits (decode) defers its update: the first read is then the only pass over the
/// state, and the head's `pending` region ([`pending_len`]) keeps the update, `S = g S + k delta^T`, until the
/// next window's first read applies it (with the same operations a token's update uses, so the bits are those
/// of the update applied at once). `inp.owed` says how many the stored rows owe now; a held window (`inp.hold`)
/// keeps all of its tokens' updates there.
#[multiversion(targets("x86_64+avx512f+avx512vl+fma", "x86_64+avx2+fma", "aarch64+neon"))]
pub fn head_window<'a>(
    inp: &HeadInputs<'a>,
    pool: &mut [f32],
    pending: &mut [f32],
    scratch: &mut [f32],
    y: &mut [f32],
) {
    head_window_body::<f32, 1>(inp, pool.as_chunks_mut::<LANES>().0, pending, scratch, y)
}

/// [`head_window`] where the state owes more than one update (a held window's accepted prefix): its own
/// instances, so that the decode and window paths compile as they did before windows could be held.
#[multiversion(targets("x86_64+avx512f+avx512vl+fma", "x86_64+avx2+fma", "aarch64+neon"))]
pub fn head_window_owed<'a>(
    inp: &HeadInputs<'a>,
    pool: &mut [f32],
    pending: &mut [f32],
    scratch: &mut [f32],
    y: &mut [f32],
) {
    head_window_body::<f32, MAX_HELD>(inp, pool.as_chunks_mut::<LANES>().0, pending, scratch, y)
}

/// [`head_window_owed`] on a bf16 state.
#[multiversion(targets("x86_64+avx512f+avx512vl+fma", "x86_64+avx2+fma", "aarch64+neon"))]
pub fn head_window_owed_bf16<'a>(
    inp: &HeadInputs<'a>,
    pool: &mut [[u32; LANES / 2]],
    pending: &mut [f32],
    scratch: &mut [f32],
    y: &mut [f32],
) {
    head_window_body::<Bf16, MAX_HELD>(inp, pool, pending, scratch, y)
}

/// [`head_window`] on a bf16 state (bits in u16).
#[multiversion(targets("x86_64+avx512f+avx512vl+fma", "x86_64+avx2+fma", "aarch64+neon"))]
pub fn head_window_bf16<'a>(
    inp: &HeadInputs<'a>,
    pool: &mut [[u32; LANES / 2]],
    pending: &mut [f32],
    scratch: &mut [f32],
    y: &mut [f32],
) {
    head_window_body::<Bf16, 1>(inp, pool, pending, scratch, y)
}

#[inline(always)]
fn head_window_body<E: StateElem, const N: usize>(
    inp: &HeadInputs<'_>,
    pool: &mut [E::Row],
    pending: &mut [f32],
    scratch: &mut [f32],
    y: &mut [f32],
) {
    let (d, t) = (inp.d, inp.t);
    let (work, rest) = scratch.split_at_mut(if t <= SEGMENT { d * LANES } else { d * d });
    let (carry, rest) = rest.split_at_mut(2 * (d / LANES) * LANES);
    let (o, rest) = rest.split_at_mut(t.min(SEGMENT) * d);
    let (gates, rest) = rest.split_at_mut(t);
    let (betas, rest) = rest.split_at_mut(t);
    let (kqs, rest) = rest.split_at_mut(t);
    // written only by a one-token commit or a held window (at most `MAX_HELD` tokens)
    let new_delta = &mut rest[..if t <= MAX_HELD { t * d } else { 0 }];
    let work = work.as_chunks_mut::<LANES>().0;
    let carry = carry.as_chunks_mut::<LANES>().0;
    // a window of one segment runs each block to its end before the next starts, so the blocks share one work
    // copy (8 KiB, in L1); a longer one keeps each block's rows between its segments
    let one_segment = t <= SEGMENT;
    for seg in (0..t).step_by(SEGMENT) {
        let toks = seg..t.min(seg + SEGMENT);
        // a segment's gates and k . q just before its blocks: its k and q rows then come from memory once, for
        // these dots, and stay in L2 for the blocks (a whole window's first, 4 MB at T 4096, were read twice)
        for tok in toks.clone() {
            gates[tok] = decay(inp.alpha[tok * inp.gate_stride], inp.dt, inp.a);
            betas[tok] = sigmoid(inp.beta[tok * inp.gate_stride]);
            kqs[tok] = dot(
                &inp.k[tok * d..(tok + 1) * d],
                &inp.q[tok * d..(tok + 1) * d],
            );
        }
        for (cb, (block, carry)) in pool
            .chunks_exact_mut(d)
            .zip(carry.chunks_exact_mut(2))
            .enumerate()
        {
            let w = if one_segment { 0 } else { cb * d };
            let work = &mut work[w..w + d];
            column_block::<E, N>(
                inp,
                gates,
                betas,
                kqs,
                block,
                work,
                o,
                cb * LANES,
                pending,
                new_delta,
                toks.clone(),
                carry,
            );
        }
        gated_norm(inp, toks, o, y);
    }
    // the updates this window leaves pending (after every block has read the ones it owed)
    let kept = if inp.hold {
        t
    } else if defers_update(t, inp.commit_at) {
        1
    } else {
        0
    };
    let pl = pending_len(d);
    for tok in 0..kept {
        let e = &mut pending[tok * pl..(tok + 1) * pl];
        let (g, rest) = e.split_first_mut().expect("pending_len");
        let (k, delta) = rest.split_at_mut(d);
        *g = gates[tok];
        k.copy_from_slice(&inp.k[tok * d..(tok + 1) * d]);
        delta.copy_from_slice(&new_delta[tok * d..(tok + 1) * d]);
    }
}

/// SPEC.md step 7 for the tokens `toks` of a head's window: their rows of y [t][d] from their readouts `o`
/// ([toks.len()][d]).
#[inline(always)]
fn gated_norm(inp: &HeadInputs<'_>, toks: std::ops::Range<usize>, o: &[f32], y: &mut [f32]) {
    let d = inp.d;
    for tok in toks.clone() {
        prefetch_row(inp.z, (tok + ROWS_AHEAD) * inp.z_stride, d);
        let ot = &o[(tok - toks.start) * d..(tok - toks.start + 1) * d];
        let rs = 1.0 / (sum_squares(ot) / d as f32 + inp.eps).sqrt();
        let z = &inp.z[tok * inp.z_stride..tok * inp.z_stride + d];
        let yt = &mut y[tok * d..(tok + 1) * d];
        // whole 16-lane chunks (d is a multiple of 16), so the loop vectorizes with no bounds checks
        debug_assert!(
            ot.len() == d && z.len() == d && inp.gamma.len() == d && d.is_multiple_of(LANES)
        );
        for (((yc, oc), gc), zc) in yt
            .as_chunks_mut::<LANES>()
            .0
            .iter_mut()
            .zip(ot.as_chunks::<LANES>().0)
            .zip(inp.gamma.as_chunks::<LANES>().0)
            .zip(z.as_chunks::<LANES>().0)
        {
            let act = gate_lanes(zc, inp.gate);
            for l in 0..LANES {
                yc[l] = ((rs * oc[l]) * gc[l]) * act[l];
            }
        }
    }
}

/// How a pool keeps S: f32, or bf16. Rows of 16 values are widened to f32 as they are read and rounded to
/// nearest even where they are committed (SPEC.md, "The state's element type").
pub trait StateElem: Send + Sync + 'static {
    /// One row of 16 values as the pool stores it.
    type Row: bytemuck::Pod + Send + Sync;
    fn load(x: &Self::Row) -> Lanes;
    fn store(x: &Lanes) -> Self::Row;
    /// `x` as it reads back after a store.
    #[inline(always)]
    fn roundtrip(x: Lanes) -> Lanes {
        Self::load(&Self::store(&x))
    }
    /// [`head_window`] on a state of these rows.
    fn head_window(
        inp: &HeadInputs<'_>,
        pool: &mut [Self::Row],
        pending: &mut [f32],
        scratch: &mut [f32],
        y: &mut [f32],
    );
}

impl StateElem for f32 {
    type Row = Lanes;
    #[inline(always)]
    fn load(x: &Lanes) -> Lanes {
        *x
    }
    #[inline(always)]
    fn store(x: &Lanes) -> Lanes {
        *x
    }
    #[inline(always)]
    fn roundtrip(x: Lanes) -> Lanes {
        x
    }
    fn head_window(
        inp: &HeadInputs<'_>,
        pool: &mut [Lanes],
        pending: &mut [f32],
        scratch: &mut [f32],
        y: &mut [f32],
    ) {
        if inp.owed <= 1 {
            head_window(inp, pool.as_flattened_mut(), pending, scratch, y)
        } else {
            head_window_owed(inp, pool.as_flattened_mut(), pending, scratch, y)
        }
    }
}

/// A bf16 state. A row's 16 values sit in 8 words, word w holding lane w in its low half and lane w + 8 in its
/// high half: packing and unpacking are then shifts and masks within vector lanes, no shuffles (a packing store,
/// AVX-512's `vpmovdw` to memory, took a third of a decode step on Zen 4). Rounding is `(b + 0x7fff + lsb) >> 16`
/// with NaN kept quiet: the bits of `half::bf16::from_f32`.
pub struct Bf16;

impl StateElem for Bf16 {
    type Row = [u32; LANES / 2];
    #[inline(always)]
    fn load(x: &[u32; LANES / 2]) -> Lanes {
        std::array::from_fn(|l| {
            let w = x[l % (LANES / 2)];
            f32::from_bits(if l < LANES / 2 {
                w << 16
            } else {
                w & 0xffff_0000
            })
        })
    }
    #[inline(always)]
    fn store(x: &Lanes) -> [u32; LANES / 2] {
        std::array::from_fn(|w| {
            (bf16_bits(x[w]) as u32) | ((bf16_bits(x[w + LANES / 2]) as u32) << 16)
        })
    }
    fn head_window(
        inp: &HeadInputs<'_>,
        pool: &mut [[u32; LANES / 2]],
        pending: &mut [f32],
        scratch: &mut [f32],
        y: &mut [f32],
    ) {
        if inp.owed <= 1 {
            head_window_bf16(inp, pool, pending, scratch, y)
        } else {
            head_window_owed_bf16(inp, pool, pending, scratch, y)
        }
    }
}

/// `x` rounded to bf16 (nearest, ties to even; a NaN stays a quiet NaN), as its bits.
#[inline(always)]
pub fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    let rounded = b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16;
    let nan = (b & 0x7fff_ffff) > 0x7f80_0000;
    (if nan { (b >> 16) | 0x40 } else { rounded }) as u16
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
    // opaque, so that the reduction below does not make LLVM build the loop's 16 lanes from two-lane pieces
    let mut acc = std::hint::black_box(acc);
    let mut w = LANES;
    while w > 1 {
        w /= 2;
        for l in 0..w {
            acc[l] += acc[l + w];
        }
    }
    acc[0]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_lanes_is_within_two_ulp_and_keeps_specials() {
        let mut worst: f64 = 0.0;
        let mut x = -86.0f32;
        while x < 88.7 {
            let lanes: [f32; LANES] = std::array::from_fn(|l| x + l as f32 * 0.0013);
            let got = exp_lanes(&lanes);
            for l in 0..LANES {
                if lanes[l] >= 88.7 {
                    continue;
                }
                let want = (lanes[l] as f64).exp();
                let ulp = (want as f32).abs() as f64 * f32::EPSILON as f64;
                worst = worst.max((got[l] as f64 - want).abs() / ulp);
            }
            x += 0.0173;
        }
        assert!(worst <= 2.0, "worst error {worst} ulp");
        let mut sp = [0.0f32; LANES];
        sp[..5].copy_from_slice(&[f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 100.0, -100.0]);
        let e = exp_lanes(&sp);
        assert!(e[0].is_nan());
        assert_eq!(e[1], f32::INFINITY);
        assert_eq!(e[2], 0.0);
        assert_eq!(e[3], f32::INFINITY);
        assert_eq!(e[4], 0.0);
        assert_eq!(e[5], 1.0);
        let s = silu_lanes(&sp);
        assert!(s[0].is_nan());
        assert_eq!(s[1], f32::INFINITY);
        assert_eq!(s[4], -0.0);
    }
}
