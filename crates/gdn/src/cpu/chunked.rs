//! The chunked (WY / UT) form of a long window's recurrence (SPEC.md, "Chunked windows"). Everything around the
//! recurrence (conv, SiLU, L2 norms, gates, the gated RMS norm, planes, dtypes) is the token-serial path's own
//! code; only a value head's pass over its window changes.
//!
//! Within a chunk of [`CHUNK`] tokens starting from state `S0`, with `c_t` the running sum of the log gates from
//! the chunk's start, `G_t = exp(c_t)`, `r(t, s) = exp(c_t - c_s)` (s <= t):
//! - `A[t][s] = b_t r(t, s) (k_t . k_s)` for s < t, `T = (I + A)^-1` (unit lower, by rows);
//! - `Delta = T R`, `R_t = b_t (v_t - G_t S0^T k_t)`: every token's delta, the rank-1 updates solved at once;
//! - `o_t = (G_t S0^T q_t + sum_{s <= t} r(t, s) (q_t . k_s) Delta_s) / sqrt(d)`;
//! - `S <- G_last S0 + sum_s r(last, s) k_s Delta_s^T`.
//!
//! `T`, the decayed `q . k` matrix and the decayed keys depend on the head only, not on the value columns; each
//! block of 16 value columns then runs its own products (columns evolve independently). Partial chunks (a
//! window's tail, the tokens up to a commit point) run token after token with the token-serial path's exact
//! arithmetic, so a commit point splits no chunk and commit-first-k equals a k-token window bitwise.

use multiversion::multiversion;

use super::kernels::{self, add_lanes, apply_pending, HeadInputs, Lanes, StateElem, LANES};

/// `$body` once for each listed value of `$r`, written out: the register groups' loops over their tokens or rows,
/// which LLVM's loop vectorizer would otherwise vectorize across the group (a gather and a scatter per
/// accumulator lane) instead of across the 16 lanes of each accumulator.
macro_rules! each {
    ($r:ident: $($n:literal)* => $body:block) => {
        $( { let $r: usize = $n; $body } )*
    };
}

/// Tokens per chunk. 32 makes the chunked form's FLOPs per token, `6 d^2 + 4 L d`, equal the `7 d^2` that
/// `gdn bench` counts at d 128 (the token-serial path's own are `6 d^2`).
pub const CHUNK: usize = 32;
/// 16-lane vectors across a chunk.
const SB: usize = CHUNK / LANES;
/// Tokens a register group of the products holds (8 accumulators of 16 lanes).
const G: usize = 4;

/// The window length from which the CPU pool takes the chunked path by default: never (`usize::MAX`). Measured
/// on the development VM (AMD EPYC, Zen 5 class, AVX-512; 2026-12-01, single thread, cycle samples so that the
/// neighbours' load does not count): at the seed's shape the chunked recurrence costs 1.21x (T 4096) to 1.27x
/// (T 512) the token-serial one (its chunk products run ~1.2x faster than the token-serial updates, but the
/// per-chunk operands, the decay ratios, `T` and the key transpose, add a third); by wall clock, 2 threads, the
/// best of 3 noisy runs: 31 K tokens/s against 37 K (0.83x) from T 1024 to 16384, and at no length measured
/// (128 to 4096) was it faster. The delta rule's chunked form saves no FLOPs (`6 d^2 + 4 L d` per token and head against the
/// token-serial path's `6 d^2`), and the token-serial path already streams its state from L1, so on a CPU the
/// form can only win on the efficiency of its products. [`crate::cpu::Cpu::chunked_from`] turns it on.
pub const CHUNKED_FROM: usize = usize::MAX;

/// A run of a window's tokens: one whole chunk in the chunked form, or tokens run one after another.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    pub start: usize,
    pub end: usize,
    pub chunk: bool,
}

/// How a window of `t` tokens committed after `commit_at` (0: verify) runs on the chunked path (`from`: the
/// crossover). Chunks sit at multiples of [`CHUNK`] from the window's start; a chunk that a commit point would
/// split runs token-serially, up to the commit point and then to the chunk's end; a commit point below `from`
/// runs all its tokens token-serially (as a window of that length would). So the tokens before the commit point
/// run exactly as they do in a window of `commit_at` tokens.
pub fn segments(t: usize, commit_at: usize, from: usize) -> Vec<Segment> {
    let serial_prefix = commit_at > 0 && commit_at < from;
    let mut out = Vec::with_capacity(t / CHUNK + 3);
    let mut p = 0;
    while p < t {
        let whole = p % CHUNK == 0 && p + CHUNK <= t;
        let split = p < commit_at && commit_at < p + CHUNK;
        let chunk = whole && !split && !(serial_prefix && p < commit_at);
        let mut end = if chunk {
            p + CHUNK
        } else {
            ((p / CHUNK + 1) * CHUNK).min(t)
        };
        if !chunk && p < commit_at && commit_at < end {
            end = commit_at;
        }
        out.push(Segment {
            start: p,
            end,
            chunk,
        });
        p = end;
    }
    out
}

/// Floats of scratch [`head_window`] needs for a window of `t` tokens at head dim `d`.
pub fn scratch_len(d: usize, t: usize) -> usize {
    2 * d * d + t * d + 4 * t + shared_len(d)
}

/// One value head's window on the chunked path: the state's rows from the pool (the owed updates applied and
/// rounded as the token-serial path's first read does), the window in f32, the state after `commit_at` tokens
/// rounded once to the pool's element and written back (nothing under verify), y [t][d] to `y`. Never for a
/// held window (those stay token-serial, at most [`kernels::MAX_HELD`] tokens) nor for one token.
pub(crate) fn head_window<E: StateElem>(
    inp: &HeadInputs<'_>,
    pool: &mut [E::Row],
    pending: &[f32],
    scratch: &mut [f32],
    y: &mut [f32],
    from: usize,
) {
    let d = inp.d;
    let (s, rest) = scratch.split_at_mut(d * d);
    let (committed, rest) = rest.split_at_mut(d * d);
    let s = s.as_chunks_mut::<LANES>().0;
    let committed = committed.as_chunks_mut::<LANES>().0;
    let pl = kernels::pending_len(d);
    // pool rows are [d / 16][d][16]: row r is key row r % d of column block r / d
    for (r, (x, src)) in s.iter_mut().zip(pool.iter()).enumerate() {
        let (i, c0) = (r % d, (r / d) * LANES);
        *x = if inp.owed > 0 {
            let mut v = E::load(src);
            for u in 0..inp.owed {
                let (g, k, delta) = kernels::pending_parts(&pending[u * pl..(u + 1) * pl], d);
                let delta: &Lanes = delta[c0..c0 + LANES].try_into().expect("lanes");
                v = apply_pending(g, &v, k[i], delta);
            }
            E::roundtrip(v)
        } else {
            E::load(src)
        };
    }
    window_f32(inp, s, committed, rest, y, from);
    if inp.commit_at > 0 {
        for (dst, x) in pool.iter_mut().zip(committed.iter()) {
            *dst = E::store(x);
        }
    }
}

/// The window on an f32 state `s` ([d / 16][d][16]); `committed` gets the state after `commit_at` tokens.
#[multiversion(targets("x86_64+avx512f+avx512vl+fma", "x86_64+avx2+fma", "aarch64+neon"))]
fn window_f32<'a>(
    inp: &HeadInputs<'a>,
    s: &mut [Lanes],
    committed: &mut [Lanes],
    scratch: &mut [f32],
    y: &mut [f32],
    from: usize,
) {
    let (d, t) = (inp.d, inp.t);
    let (o, rest) = scratch.split_at_mut(t * d);
    let (gates, rest) = rest.split_at_mut(t);
    let (betas, rest) = rest.split_at_mut(t);
    let (kqs, rest) = rest.split_at_mut(t);
    let (logs, rest) = rest.split_at_mut(t);
    let mut sh = Shared::of(&mut rest[..shared_len(d)], d);
    for tok in 0..t {
        let (al, be) = (
            inp.alpha[tok * inp.gate_stride],
            inp.beta[tok * inp.gate_stride],
        );
        logs[tok] = kernels::log_decay(al, inp.dt, inp.a);
        betas[tok] = kernels::sigmoid(be);
    }
    let blocks = d / LANES;
    for seg in segments(t, inp.commit_at, from) {
        if !seg.chunk {
            // what the token-serial arithmetic reads: the gate (`kernels::decay` is exp of the log gate) and k . q
            for tok in seg.start..seg.end {
                gates[tok] = logs[tok].exp();
                kqs[tok] = kernels::dot(
                    &inp.k[tok * d..(tok + 1) * d],
                    &inp.q[tok * d..(tok + 1) * d],
                );
            }
        }
        // the state after the window's last token is needed only where it is committed
        let update = seg.end < t || seg.end == inp.commit_at;
        if seg.chunk {
            prepare(inp, seg.start, logs, betas, &mut sh);
            for cb in 0..blocks {
                let blk = &mut s[cb * d..(cb + 1) * d];
                chunk_block(inp, seg.start, cb, blk, &sh, betas, o, update);
            }
        } else {
            for cb in 0..blocks {
                serial_block(
                    inp,
                    gates,
                    betas,
                    kqs,
                    &mut s[cb * d..(cb + 1) * d],
                    o,
                    cb * LANES,
                    seg.start..seg.end,
                    update,
                );
            }
        }
        if seg.end == inp.commit_at {
            committed.copy_from_slice(s);
        }
    }
    kernels::gated_norm(inp, o, y);
}

/// Tokens `toks` of one block of 16 columns, one after another, from the state `s` (d rows): the token-serial
/// path's arithmetic operation for operation (`kernels::column_block`: the first read's paired accumulators,
/// `delta = (v - g kv) b`, `o = fma(g, sq, delta kq) / sqrt(d)`, the update `fma(g, S, k delta)` fused with the next
/// token's reads), so a run from a window's start gives that path's bits. `update_last`: apply the last
/// token's update too.
#[multiversion(targets("x86_64+avx512f+avx512vl+fma", "x86_64+avx2+fma", "aarch64+neon"))]
#[allow(clippy::too_many_arguments)]
fn serial_block<'a>(
    inp: &HeadInputs<'a>,
    gates: &[f32],
    betas: &[f32],
    kqs: &[f32],
    s: &mut [Lanes],
    o: &mut [f32],
    c0: usize,
    toks: std::ops::Range<usize>,
    update_last: bool,
) {
    let d = inp.d;
    let s = &mut s[..d];
    let inv_sqrt_d = 1.0 / (d as f32).sqrt();
    let (k0, q0) = (
        &inp.k[toks.start * d..(toks.start + 1) * d],
        &inp.q[toks.start * d..(toks.start + 1) * d],
    );
    let (mut kv2, mut sq2) = ([[0.0f32; LANES]; 2], [[0.0f32; LANES]; 2]);
    for i in (0..d).step_by(2) {
        let i = std::hint::black_box(i);
        for r in 0..2 {
            let x = s[i + r];
            for l in 0..LANES {
                kv2[r][l] = x[l].mul_add(k0[i + r], kv2[r][l]);
                sq2[r][l] = x[l].mul_add(q0[i + r], sq2[r][l]);
            }
        }
    }
    let (mut kv, mut sq) = (add_lanes(&kv2[0], &kv2[1]), add_lanes(&sq2[0], &sq2[1]));
    for tok in toks.clone() {
        let (g, b, kq) = (gates[tok], betas[tok], kqs[tok]);
        let v: &Lanes = inp.v[tok * d + c0..tok * d + c0 + LANES]
            .try_into()
            .expect("block");
        let ot: &mut Lanes = (&mut o[tok * d + c0..tok * d + c0 + LANES])
            .try_into()
            .expect("block");
        let mut delta = [0.0f32; LANES];
        for l in 0..LANES {
            delta[l] = (v[l] - g * kv[l]) * b;
            ot[l] = g.mul_add(sq[l], delta[l] * kq) * inv_sqrt_d;
        }
        let more = tok + 1 < toks.end;
        if !more && !update_last {
            break;
        }
        let k = &inp.k[tok * d..(tok + 1) * d];
        let (kn, qn) = if more {
            (
                &inp.k[(tok + 1) * d..(tok + 2) * d],
                &inp.q[(tok + 1) * d..(tok + 2) * d],
            )
        } else {
            (k, k)
        };
        let (mut a, mut c) = ([[0.0f32; LANES]; 2], [[0.0f32; LANES]; 2]);
        for i in (0..d).step_by(2) {
            // as in `kernels::update_rows`: each row one vector
            let i = std::hint::black_box(i);
            for r in 0..2 {
                let x = apply_pending(g, &s[i + r], k[i + r], &delta);
                for l in 0..LANES {
                    a[r][l] = x[l].mul_add(kn[i + r], a[r][l]);
                    c[r][l] = x[l].mul_add(qn[i + r], c[r][l]);
                }
                s[i + r] = x;
            }
        }
        (kv, sq) = (add_lanes(&a[0], &a[1]), add_lanes(&c[0], &c[1]));
    }
}

/// Tokens per register group of the products `S0^T k`, `S0^T q` (8 accumulators of 16 lanes; LLVM's SLP
/// vectorizer left 16 of them scalar).
const GA: usize = 8;
/// State rows per register group of the update.
const RG: usize = 8;
// the register groups' `each!` lists name 4 and 8 values
const _: () = assert!(G == 4 && GA == 8 && RG == 8 && CHUNK.is_multiple_of(GA));

type Row = [f32; CHUNK];

/// A chunk's head-wide operands (scratch buffers): the keys transposed `kt` [d][L] and decayed to the chunk's
/// end `ktd` [d][L]; `T = (I + A)^-1` and the decayed, scaled `q . k` matrix `M`, both
/// [L][L] lower (zeros above); `rr` the decay ratios; `gam` the gates' products from the chunk's start,
/// `gq = gam / sqrt(d)`.
struct Shared<'a> {
    kt: &'a mut [Row],
    qt: &'a mut [Row],
    ktd: &'a mut [Row],
    tm: &'a mut [Row],
    mm: &'a mut [Row],
    rr: &'a mut [Row],
    gam: &'a mut [f32],
    gq: &'a mut [f32],
}

/// Floats of the buffers of [`Shared`].
const fn shared_len(d: usize) -> usize {
    3 * d * CHUNK + 3 * CHUNK * CHUNK + 2 * CHUNK
}

impl<'a> Shared<'a> {
    fn of(buf: &'a mut [f32], d: usize) -> Shared<'a> {
        let (kt, rest) = buf.split_at_mut(d * CHUNK);
        let (qt, rest) = rest.split_at_mut(d * CHUNK);
        let (ktd, rest) = rest.split_at_mut(d * CHUNK);
        let (tm, rest) = rest.split_at_mut(CHUNK * CHUNK);
        let (mm, rest) = rest.split_at_mut(CHUNK * CHUNK);
        let (rr, rest) = rest.split_at_mut(CHUNK * CHUNK);
        let (gam, rest) = rest.split_at_mut(CHUNK);
        Shared {
            kt: kt.as_chunks_mut().0,
            qt: qt.as_chunks_mut().0,
            ktd: ktd.as_chunks_mut().0,
            tm: tm.as_chunks_mut().0,
            mm: mm.as_chunks_mut().0,
            rr: rr.as_chunks_mut().0,
            gam,
            gq: &mut rest[..CHUNK],
        }
    }
}

/// `k_t . k_s` and `q_t . k_s` for the [`G`] tokens from `t0` and the first `NB` 16-lane blocks of s.
#[inline(always)]
fn dots<const NB: usize>(
    k: &[f32],
    q: &[f32],
    kt: &[Row],
    d: usize,
    t0: usize,
    kk: &mut [Row; CHUNK],
    qk: &mut [Row; CHUNK],
) {
    let mut ak = [[[0.0f32; LANES]; NB]; G];
    let mut aq = [[[0.0f32; LANES]; NB]; G];
    let kr: [&[f32]; G] = std::array::from_fn(|r| &k[(t0 + r) * d..(t0 + r + 1) * d]);
    let qr: [&[f32]; G] = std::array::from_fn(|r| &q[(t0 + r) * d..(t0 + r + 1) * d]);
    for i in 0..d {
        let i = std::hint::black_box(i);
        let row = &kt[i];
        each!(r: 0 1 2 3 => {
            let (ki, qi) = (kr[r][i], qr[r][i]);
            for b in 0..NB {
                for l in 0..LANES {
                    ak[r][b][l] = ki.mul_add(row[b * LANES + l], ak[r][b][l]);
                    aq[r][b][l] = qi.mul_add(row[b * LANES + l], aq[r][b][l]);
                }
            }
        });
    }
    for r in 0..G {
        for b in 0..NB {
            kk[t0 + r][b * LANES..(b + 1) * LANES].copy_from_slice(&ak[r][b]);
            qk[t0 + r][b * LANES..(b + 1) * LANES].copy_from_slice(&aq[r][b]);
        }
    }
}

/// Fills `sh` for the chunk of tokens `p0 .. p0 + CHUNK`.
#[multiversion(targets("x86_64+avx512f+avx512vl+fma", "x86_64+avx2+fma", "aarch64+neon"))]
fn prepare<'a, 'b>(
    inp: &HeadInputs<'a>,
    p0: usize,
    logs: &[f32],
    betas: &[f32],
    sh: &mut Shared<'b>,
) {
    let d = inp.d;
    let inv_sqrt_d = 1.0 / (d as f32).sqrt();
    // the running sums of the log gates in f64: a ratio exp(c_t - c_s) near 1 from two sums far from 0 keeps its
    // digits (in f32 the sums' own rounding would reach 1e-6 of a ratio after a few dozen strong decays)
    let mut cum = [0.0f64; CHUNK];
    let mut acc = 0.0f64;
    for (tok, c) in cum.iter_mut().enumerate() {
        acc += logs[p0 + tok] as f64;
        *c = acc;
    }
    for ((g, gq), c) in sh.gam.iter_mut().zip(sh.gq.iter_mut()).zip(&cum) {
        *g = c.exp() as f32;
        *gq = *g * inv_sqrt_d;
    }
    for (tok, rrow) in sh.rr.iter_mut().enumerate() {
        let mut x = [f32::NEG_INFINITY; CHUNK];
        for (xs, &cs) in x.iter_mut().zip(&cum).take(tok + 1) {
            *xs = (cum[tok] - cs) as f32;
        }
        for (dst, src) in rrow
            .as_chunks_mut::<LANES>()
            .0
            .iter_mut()
            .zip(x.as_chunks::<LANES>().0)
        {
            *dst = kernels::exp_lanes(src);
        }
    }
    let k = &inp.k[p0 * d..(p0 + CHUNK) * d];
    let q = &inp.q[p0 * d..(p0 + CHUNK) * d];
    // by rows of the transpose, each one gather at most (left to itself LLVM vectorized across rows, with a
    // scatter per lane)
    for i in 0..d {
        let i = std::hint::black_box(i);
        let row = &mut sh.kt[i];
        for (s, x) in row.iter_mut().enumerate() {
            *x = k[s * d + i];
        }
        let row = &mut sh.qt[i];
        for (s, x) in row.iter_mut().enumerate() {
            *x = q[s * d + i];
        }
    }
    let last = sh.rr[CHUNK - 1];
    for i in 0..d {
        // opaque: vectorized across rows, this loop was all gathers and scatters
        let i = std::hint::black_box(i);
        let (kt, ktd) = (&sh.kt[i], &mut sh.ktd[i]);
        for s in 0..CHUNK {
            ktd[s] = kt[s] * last[s];
        }
    }
    // k_t . k_s and q_t . k_s, s up to the group's last token (whole blocks of 16)
    let mut kk = [[0.0f32; CHUNK]; CHUNK];
    let mut qk = [[0.0f32; CHUNK]; CHUNK];
    for t0 in (0..CHUNK).step_by(G) {
        if t0 + G <= LANES {
            dots::<1>(k, q, sh.kt, d, t0, &mut kk, &mut qk);
        } else {
            dots::<SB>(k, q, sh.kt, d, t0, &mut kk, &mut qk);
        }
    }
    // M, and T by rows: T[t] = e_t - sum_{m < t} A[t][m] T[m] (two partial sums, even and odd m); masked by
    // selection, so a NaN above the diagonal never reaches an earlier token
    for tok in 0..CHUNK {
        let (rrow, qrow) = (&sh.rr[tok], &qk[tok]);
        let mrow = &mut sh.mm[tok];
        for s in 0..CHUNK {
            mrow[s] = if s <= tok {
                rrow[s] * qrow[s] * inv_sqrt_d
            } else {
                0.0
            };
        }
        let b = betas[p0 + tok];
        let mut row = [[0.0f32; CHUNK]; 2];
        row[0][tok] = 1.0;
        for m in 0..tok {
            let m = std::hint::black_box(m);
            let a = b * sh.rr[tok][m] * kk[tok][m];
            let tmr = sh.tm[m];
            let acc = &mut row[m % 2];
            for s in 0..CHUNK {
                acc[s] = (-a).mul_add(tmr[s], acc[s]);
            }
        }
        let [even, odd] = &row;
        for (t, (e, o)) in sh.tm[tok].iter_mut().zip(even.iter().zip(odd)) {
            *t = e + o;
        }
    }
}

/// One block of 16 value columns through the chunk `p0 .. p0 + CHUNK`: its readout into `o` and (with
/// `update`) its state `s` (d rows) carried to the chunk's end.
#[multiversion(targets("x86_64+avx512f+avx512vl+fma", "x86_64+avx2+fma", "aarch64+neon"))]
#[allow(clippy::too_many_arguments)]
fn chunk_block<'a, 'b>(
    inp: &HeadInputs<'a>,
    p0: usize,
    cb: usize,
    s: &mut [Lanes],
    sh: &Shared<'b>,
    betas: &[f32],
    o: &mut [f32],
    update: bool,
) {
    let d = inp.d;
    let c0 = cb * LANES;
    let s = &mut s[..d];
    let mut rhs = [[0.0f32; LANES]; CHUNK];
    let mut oq = [[0.0f32; LANES]; CHUNK];
    // S0^T k_t and S0^T q_t, GA tokens at a time over one pass of the block's rows
    for g in 0..CHUNK / GA {
        let (mut ap, mut aq) = ([[0.0f32; LANES]; GA], [[0.0f32; LANES]; GA]);
        for i in 0..d {
            // opaque, so that LLVM keeps each accumulator one vector of 16 lanes (left to itself it vectorized
            // across rows, with a gather and a scatter per lane, as in `kernels::update_rows`); the keys and
            // queries from the chunk's transposes, so a row's GA operands sit at fixed offsets of one pointer
            let i = std::hint::black_box(i);
            let x = &s[i];
            let (kr, qr) = (
                &sh.kt[i][g * GA..g * GA + GA],
                &sh.qt[i][g * GA..g * GA + GA],
            );
            each!(r: 0 1 2 3 4 5 6 7 => {
                let (kv, qv) = (kr[r], qr[r]);
                for l in 0..LANES {
                    ap[r][l] = kv.mul_add(x[l], ap[r][l]);
                    aq[r][l] = qv.mul_add(x[l], aq[r][l]);
                }
            });
        }
        for r in 0..GA {
            let tok = g * GA + r;
            let v: &Lanes = inp.v[(p0 + tok) * d + c0..(p0 + tok) * d + c0 + LANES]
                .try_into()
                .expect("block");
            let (b, gm, gq) = (betas[p0 + tok], sh.gam[tok], sh.gq[tok]);
            for l in 0..LANES {
                rhs[tok][l] = b * (-gm).mul_add(ap[r][l], v[l]);
                oq[tok][l] = gq * aq[r][l];
            }
        }
    }
    // Delta = T R, then o += M Delta; T and M are zero above the diagonal, so a group reads up to its last token
    let mut dl = [[0.0f32; LANES]; CHUNK];
    for t0 in (0..CHUNK).step_by(G) {
        let tr: [&Row; G] = std::array::from_fn(|r| &sh.tm[t0 + r]);
        let mut acc = [[0.0f32; LANES]; G];
        for m in 0..t0 + G {
            let m = std::hint::black_box(m);
            let rm = &rhs[m];
            each!(r: 0 1 2 3 => {
                let c = tr[r][m];
                for l in 0..LANES {
                    acc[r][l] = c.mul_add(rm[l], acc[r][l]);
                }
            });
        }
        dl[t0..t0 + G].copy_from_slice(&acc);
    }
    for t0 in (0..CHUNK).step_by(G) {
        let mr: [&Row; G] = std::array::from_fn(|r| &sh.mm[t0 + r]);
        let mut acc: [Lanes; G] = std::array::from_fn(|r| oq[t0 + r]);
        for m in 0..t0 + G {
            let m = std::hint::black_box(m);
            let dm = &dl[m];
            each!(r: 0 1 2 3 => {
                let c = mr[r][m];
                for l in 0..LANES {
                    acc[r][l] = c.mul_add(dm[l], acc[r][l]);
                }
            });
        }
        for (r, a) in acc.iter().enumerate() {
            let at = (p0 + t0 + r) * d + c0;
            o[at..at + LANES].copy_from_slice(a);
        }
    }
    if !update {
        return;
    }
    // S <- G_last S0 + sum_s ktd[.][s] Delta_s^T, RG rows at a time (the sum first, then one fma per element)
    let gl = sh.gam[CHUNK - 1];
    for (rows, krows) in s.chunks_exact_mut(RG).zip(sh.ktd.chunks_exact(RG)) {
        let rows: &mut [Lanes; RG] = rows.try_into().expect("rows");
        let krows: &[Row; RG] = krows.try_into().expect("rows");
        let mut acc = [[0.0f32; LANES]; RG];
        for m in 0..CHUNK {
            let m = std::hint::black_box(m);
            let dm = &dl[m];
            each!(r: 0 1 2 3 4 5 6 7 => {
                let c = krows[r][m];
                for l in 0..LANES {
                    acc[r][l] = c.mul_add(dm[l], acc[r][l]);
                }
            });
        }
        each!(r: 0 1 2 3 4 5 6 7 => {
            for l in 0..LANES {
                rows[r][l] = gl.mul_add(rows[r][l], acc[r][l]);
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(t: usize, k: usize, from: usize) {
        let segs = segments(t, k, from);
        let mut p = 0;
        for s in &segs {
            assert_eq!(s.start, p);
            assert!(s.end > s.start && s.end <= t);
            if s.chunk {
                assert!(s.start % CHUNK == 0 && s.end == s.start + CHUNK);
            }
            p = s.end;
        }
        assert_eq!(p, t);
        if k > 0 {
            assert!(segs.iter().any(|s| s.end == k), "t {t} k {k}");
            // the prefix runs as a k-token window does
            let pre: Vec<Segment> = segs.iter().copied().take_while(|s| s.end <= k).collect();
            let alone = if k >= from {
                segments(k, k, from)
            } else {
                vec![]
            };
            if k >= from {
                assert_eq!(pre, alone, "t {t} k {k}");
            } else {
                assert!(pre.iter().all(|s| !s.chunk));
            }
        }
    }

    #[test]
    fn segments_tile_the_window_and_keep_the_prefix() {
        for t in [1, 2, 31, 32, 33, 64, 100, 129, 200] {
            for k in 0..=t {
                for from in [2, 33, 64, 128] {
                    check(t, k, from);
                }
            }
        }
    }
}
