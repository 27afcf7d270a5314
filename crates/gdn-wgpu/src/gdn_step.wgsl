// The fused GDN window step (SPEC.md), one workgroup per (sequence, value head) of a varlen step.
//
// This file is a template: `kernel.rs` prepends the launch constants (D, IB, RPT, RPT4, W, CPT, GW, HOLD, SCALE) and
// the input loaders (`ld_qkv`, `ld_alpha`, `ld_beta`, `ld_z`, `enc16`: one per dtype of the pipeline), and
// expands the directives below before handing the text to wgpu, so every loop over state rows has constant
// bounds and constant indices and the state array lives in registers. The head counts, conventions and planes
// are uniforms; each sequence's slot, rows, length and commit point come from the job list.
//   //#if NAME / //#else / //#endif       kept or dropped by a host flag (SUBGROUPS, VMAJOR, SBF16, OUT16)
//   //#for v COUNT ... //#endfor         the block repeated COUNT times with `$v` replaced by 0, 1, ...
//                                        (or a real loop when COUNT is large); each copy gets its own braces
//   //#define NAME ... //#enddef, //#include NAME   a block written once, pasted where it is included
//
// Thread layout: thread `tid = ib * D + j` owns column j of the head's state and the RPT rows
// `ib * RPT .. + RPT` (value-major pools: `tid = j * IB + ib`, rows interleaved by four, see below). The first 3 D threads (or all of them, several channels each when the workgroup is
// smaller) run the conv of one channel: q and k of the value head's q/k head, then its own v. The gates and
// write strengths are computed W tokens at a time, one token a thread from the last thread down.
//
// The q/k conv history is private to each value head (layout [slot][h_v][3][D][3], see pool.rs), so the
// workgroup owns everything it reads and writes its committed history in place: no double buffer and no
// dependency between workgroups. Nothing a workgroup computes depends on another job of the dispatch. (A held
// window's shared records are read from an earlier dispatch, and written in the other half: see `pend`.)
//
// Speculative steps: a held window's per-token records are stored as its tokens run; the accepted prefix of the
// previous one is applied to the state rows and the history registers right after they are loaded (see the
// comment there), so the state is read once and written once.
//
// A token takes four barriers (five without subgroups). The readout's RMS norm and the planes of token t run
// inside token t + 1 (after its first and second barriers), and after the last token in a short tail.
// 16-bit outputs: the y of a token goes through workgroup memory (`ys`) and is stored a barrier later, two
// adjacent columns packed in one u32.

struct Params {
    // the output's plane stride P in elements (even; planes on) or 0
    plane: u32,
    // offsets of qkv, alpha, beta and z inside `inp`, in u32 words
    qkv_off: u32,
    alpha_off: u32,
    beta_off: u32,
    z_off: u32,
    // q/k heads, value heads, conv channels (2 h_k + h_v) D, output width h_v D
    h_k: u32,
    h_v: u32,
    c: u32,
    n: u32,
    // head map grouped (1) or tiled (0); gate silu (1) or sigmoid (0)
    grouped: u32,
    silu: u32,
    eps: f32,
}

//#if SBF16
//#if VMAJOR
// [slot][h_v][D][D] bf16, keys contiguous: four keys a vector
@group(0) @binding(0) var<storage, read_write> state: array<vec2<u32>>;
//#else
// [slot][D][h_v][D] bf16, values contiguous: two a word
@group(0) @binding(0) var<storage, read_write> state: array<u32>;
//#endif
//#else
//#if VMAJOR
// [slot][h_v][D][D] f32, keys contiguous
@group(0) @binding(0) var<storage, read_write> state: array<vec4<f32>>;
//#else
// [slot][D][h_v][D] f32: SPEC.md's S per slot
@group(0) @binding(0) var<storage, read_write> state: array<f32>;
//#endif
//#endif
// [slot][h_v][3][D][3]: each value head's own copy of the q, k and v history it reads
@group(0) @binding(1) var<storage, read_write> hist: array<f32>;
// qkv [R][C] | alpha [R][h_v] | beta [R][h_v] | z [R][n], each in its own dtype (16-bit: two a word)
@group(0) @binding(2) var<storage, read> inp: array<u32>;
// conv_w [C][4] | dt [h_v] | a [h_v] | gamma [D]
@group(0) @binding(3) var<storage, read> lw: array<f32>;
// y [R][n] at 0, planes at P, 2P, 3P, group sums [R][h_v][GW] at 4P; f32 as bits, 16-bit two a word
@group(0) @binding(4) var<storage, read_write> out: array<u32>;
// two vectors per live sequence, workgroup_id.y indexes them: (pool slot, first row, length, commit point: 0
// verify), then (accepted tokens of the slot's held window, 1 where this window is held, the half of the shared
// held records the slot's held window is in, 0)
@group(0) @binding(5) var<storage, read> jobs: array<vec4<u32>>;
@group(0) @binding(6) var<uniform> prm: Params;
// held windows (speculative steps), per slot: what a held token's commit applies and shifts in. What the value
// heads of one q/k head share (its normalized key, its raw q and k inputs) is written once, by its first value
// head, into the half of the slot's shared records the next held window does not read (the halves alternate, so
// a head writing a new window never overwrites what another head of the slot is still applying); what is each
// value head's own (its raw v inputs, delta vector and gate) is private. Layout: `pend_base`, `at_*` below.
@group(0) @binding(7) var<storage, read_write> pend: array<f32>;

// raw conv outputs of the token: q [0, D), k [D, 2D), v [2D, 3D); the readout o of the previous token at [3D, 4D);
// four values a vector (element x at vals[x / 4][x % 4]), so the norms read them four at a time
var<workgroup> vals: array<vec4<f32>, D>;
// normalized q and k, four rows a vector
var<workgroup> qh: array<vec4<f32>, D / 4>;
var<workgroup> kh: array<vec4<f32>, D / 4>;
// per row block partials of kv and of the readout
var<workgroup> red: array<f32, IB * D>;
var<workgroup> red2: array<f32, IB * D>;
// gate and write strength of the window's tokens, W at a time (token t at t % W)
var<workgroup> gates: array<vec2<f32>, W>;
// y of the previous token, for the group sums (and the packed stores of 16-bit outputs)
var<workgroup> ys: array<f32, D>;
//#if !SUBGROUPS
// 16-element partial sums of squares: q [0, D/16), k [D/16, 2D/16), o [2D/16, 3D/16)
var<workgroup> parts: array<f32, 3 * D / 16>;
//#endif
//#if SBF16
//#if !VMAJOR
// the committed bf16 rows of odd columns, for the even column's thread to pack (two halves, used in turn)
var<workgroup> xs: array<vec2<u32>, W>;
//#endif
//#endif

fn sigmoid(x: f32) -> f32 {
    return 1.0 / (1.0 + exp(-x));
}

// log(1 + e) for e = exp(u) >= 0, accurate to a few ulps also where log's absolute error bound would not be:
// for e < 1 an odd series in s = e / (2 + e) (s <= 1/3), else log(1 + e) (>= log 2, where log is accurate).
// NaN stays NaN.
fn log1p_exp(e: f32) -> f32 {
    let w = 1.0 + e;
    if (w == 1.0) {
        return e;
    }
    if (e < 1.0) {
        let s = e / (2.0 + e);
        let s2 = s * s;
        var p = 1.0 / 17.0;
        p = fma(p, s2, 1.0 / 15.0);
        p = fma(p, s2, 1.0 / 13.0);
        p = fma(p, s2, 1.0 / 11.0);
        p = fma(p, s2, 1.0 / 9.0);
        p = fma(p, s2, 1.0 / 7.0);
        p = fma(p, s2, 1.0 / 5.0);
        p = fma(p, s2, 1.0 / 3.0);
        return 2.0 * fma(s * s2, p, s);
    }
    return log(w);
}

// SPEC.md step 3: exp(softplus(alpha + dt) * a)
fn decay(alpha: f32, dt: f32, a: f32) -> f32 {
    let u = alpha + dt;
    var sp = u;
    if (!(u > 20.0)) {
        sp = log1p_exp(exp(u));
    }
    return exp(sp * a);
}

// 2^-k for 0 <= k < 127, exactly
fn pow2_neg(k: u32) -> f32 {
    return bitcast<f32>((127u - k) << 23u);
}

// A bf16 (in the low or high half of a word) widened to f32: exact.
fn bf16_lo(w: u32) -> f32 {
    return bitcast<f32>(w << 16u);
}

fn bf16_hi(w: u32) -> f32 {
    return bitcast<f32>(w & 0xffff0000u);
}

// f32 to bf16 bits, to nearest even on the bits (WGSL promises no rounding mode); NaN stays NaN (quieted).
fn bf16_bits(x: f32) -> u32 {
    let b = bitcast<u32>(x);
    if ((b & 0x7fffffffu) > 0x7f800000u) {
        return (b >> 16u) | 0x40u;
    }
    return (b + 0x7fffu + ((b >> 16u) & 1u)) >> 16u;
}

// f16 bits (low 16 bits of h) to f32, exactly, subnormals included (by hand: WGSL leaves subnormal handling to
// the implementation)
fn f16_f32(h: u32) -> f32 {
    let s = (h & 0x8000u) << 16u;
    let e = (h >> 10u) & 0x1fu;
    let m = h & 0x3ffu;
    if (e == 0u) {
        // m 2^-24: exact in f32
        return bitcast<f32>(bitcast<u32>(f32(m) * 5.9604644775390625e-8) | s);
    }
    if (e == 31u) {
        return bitcast<f32>(s | 0x7f800000u | (m << 13u));
    }
    return bitcast<f32>(s | ((e + 112u) << 23u) | (m << 13u));
}

// f32 to f16 bits, to nearest even on the bits (WGSL's pack2x16float promises neither the rounding direction nor
// a result outside f16's range); overflow to infinity, NaN stays NaN, subnormals rounded like the rest.
fn f16_bits(x: f32) -> u32 {
    let b = bitcast<u32>(x);
    let s = (b >> 16u) & 0x8000u;
    let a = b & 0x7fffffffu;
    if (a > 0x7f800000u) {
        return s | 0x7e00u | ((a >> 13u) & 0x3ffu);
    }
    // 65520 and above round to infinity
    if (a >= 0x477ff000u) {
        return s | 0x7c00u;
    }
    // normal f16 from 2^-14: rebias the exponent by 112, round the mantissa from 23 to 10 bits
    if (a >= 0x38800000u) {
        let r = a - 0x38000000u;
        return s | ((r + 0xfffu + ((r >> 13u) & 1u)) >> 13u);
    }
    // 2^-25 and below round to zero (2^-25 itself is a tie, to the even zero)
    if (a <= 0x33000000u) {
        return s;
    }
    // subnormal f16: the value in units of 2^-24 is m >> (126 - e), rounded to nearest even
    let e = a >> 23u;
    let m = (a & 0x7fffffu) | 0x800000u;
    let sh = 126u - e;
    let q = m >> sh;
    let rem = m & ((1u << sh) - 1u);
    let hw = 1u << (sh - 1u);
    var up = 0u;
    if (rem > hw || (rem == hw && (q & 1u) == 1u)) {
        up = 1u;
    }
    return s | (q + up);
}

// where row block ib's partial for column j sits in `red` and `red2`: the writing thread's own index, so that
// neither the writes nor the reads (the same address for a column's row blocks) conflict on banks
fn red_at(ib: u32, j: u32) -> u32 {
//#if VMAJOR
    return j * IB + ib;
//#else
    return ib * D + j;
//#endif
}

fn val(x: u32) -> f32 {
    return vals[x / 4u][x % 4u];
}

fn set_val(x: u32, v: f32) {
    vals[x / 4u][x % 4u] = v;
}

//#if SUBGROUPS
// the sums of squares of q, k and o (the previous token's readout), the same in every subgroup: the lanes
// stride the vectors four values at a time, then subgroupAdd
fn sumsq3(lane: u32, sg: u32) -> vec3<f32> {
    var acc = vec3<f32>(0.0);
    for (var c = lane; c < D / 4u; c += sg) {
        let q = vals[c];
        let k = vals[D / 4u + c];
        let o = vals[3u * D / 4u + c];
        acc += vec3<f32>(dot(q, q), dot(k, k), dot(o, o));
    }
    return subgroupAdd(acc);
}
//#else
// thread p < 3 D / 16 sums the squares of 16 consecutive values of q, k or o
fn partial_sumsq(p: u32) {
    if (p < 3u * D / 16u) {
        // q and k: vectors 4p .. 4p + 4; o: from D / 4 + 4p (o starts at vector 3 D / 4 = D / 4 + 4 (2 D / 16))
        var base = 4u * p;
        if (p >= 2u * D / 16u) {
            base = D / 4u + 4u * p;
        }
        var acc = vec4<f32>(0.0);
        for (var e = 0u; e < 4u; e++) {
            let x = vals[base + e];
            acc = fma(x, x, acc);
        }
        parts[p] = (acc.x + acc.y) + (acc.z + acc.w);
    }
}

// the sum of the D / 16 partials from `first`, in order
fn sum_parts(first: u32) -> f32 {
    var acc = 0.0;
    for (var p = 0u; p < D / 16u; p++) {
        acc += parts[first + p];
    }
    return acc;
}
//#endif

// A slot's held region: [2][HOLD][h_k][D] normalized keys, [2][HOLD][h_k][2 D] raw q, k inputs, [HOLD][h_v][D]
// raw v inputs, [HOLD][h_v][D + 1] delta vectors and gates (the pool's `pending_len`).
fn pend_base(slot: u32) -> u32 {
    return slot * (6u * HOLD * prm.h_k * D + HOLD * prm.h_v * (2u * D + 1u));
}

fn at_kh(base: u32, half: u32, t: u32, g: u32) -> u32 {
    return base + ((half * HOLD + t) * prm.h_k + g) * D;
}

fn at_rqk(base: u32, half: u32, t: u32, g: u32) -> u32 {
    return base + 2u * HOLD * prm.h_k * D + ((half * HOLD + t) * prm.h_k + g) * (2u * D);
}

fn at_rv(base: u32, t: u32, h: u32) -> u32 {
    return base + 6u * HOLD * prm.h_k * D + (t * prm.h_v + h) * D;
}

fn at_dg(base: u32, t: u32, h: u32) -> u32 {
    return base + 6u * HOLD * prm.h_k * D + HOLD * prm.h_v * D + (t * prm.h_v + h) * (D + 1u);
}

// The committed state stored from `st` (the commit point of the token loop, and an accepted prefix applied at a
// window's start): text pasted where `//#include STORE` stands.
//#define STORE
//#if VMAJOR
            //#for q RPT4
            {
                let v = st[$q];
//#if SBF16
                state[v_base + $q * RS] = vec2<u32>(bf16_bits(v.x) | (bf16_bits(v.y) << 16u),
                                               bf16_bits(v.z) | (bf16_bits(v.w) << 16u));
//#else
                state[v_base + $q * RS] = v;
//#endif
            }
            //#endfor
//#else
//#if SBF16
            // an odd column's thread hands its rounded rows to the even column's thread, which stores the
            // packed words; the two halves of `xs` alternate, so one barrier a row group suffices
            //#for q RPT4
            {
                let v = st[$q];
                let r01 = bf16_bits(v.x) | (bf16_bits(v.y) << 16u);
                let r23 = bf16_bits(v.z) | (bf16_bits(v.w) << 16u);
                let xb = ($q % 2u) * (W / 2u) + tid / 2u;
                if (odd) {
                    xs[xb] = vec2<u32>(r01, r23);
                }
                workgroupBarrier();
                if (!odd) {
                    let o = xs[xb];
                    let at = (s_base + (i0 + 4u * $q) * s_stride) >> 1u;
                    state[at] = (r01 & 0xffffu) | (o.x << 16u);
                    state[at + w_stride] = (r01 >> 16u) | (o.x & 0xffff0000u);
                    state[at + 2u * w_stride] = (r23 & 0xffffu) | (o.y << 16u);
                    state[at + 3u * w_stride] = (r23 >> 16u) | (o.y & 0xffff0000u);
                }
            }
            //#endfor
//#else
            //#for q RPT4
            {
                let at = s_base + (i0 + 4u * $q) * s_stride;
                let v = st[$q];
                state[at] = v.x;
                state[at + s_stride] = v.y;
                state[at + 2u * s_stride] = v.z;
                state[at + 3u * s_stride] = v.w;
            }
            //#endfor
//#endif
//#endif
//#enddef

@compute @workgroup_size(W)
fn gdn_step(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(local_invocation_index) tid: u32,
//#if SUBGROUPS
    @builtin(subgroup_size) sg_size: u32,
    @builtin(subgroup_invocation_id) lane: u32,
//#endif
) {
    let h = wg.x;
    let job = jobs[2u * wg.y];
    let slot = job.x;
    let row0 = job.y;
    let nt = job.z;
    let commit_at = job.w;
    let spec = jobs[2u * wg.y + 1u];
    let accept = spec.x;
    let hold = spec.y != 0u;
    // the half of the shared records the held window is in (read), and the one a window held now goes to
    let rd = spec.z;
    let wr = 1u - rd;
    let h_k = prm.h_k;
    let h_v = prm.h_v;
    let cc = prm.c;
    var g = h % h_k;
    // the first value head of its q/k head writes what they share of a held window
    var first = h < h_k;
    if (prm.grouped != 0u) {
        g = h / (h_v / h_k);
        first = h % (h_v / h_k) == 0u;
    }
//#if VMAJOR
    // value-major: a column's row blocks are adjacent threads and a thread's row groups are interleaved (group
    // q holds rows 4 (q IB + ib) ..), so adjacent threads read adjacent keys of one column
    let ib = tid % IB;
    let j = tid / IB;
    let r0 = ib;
//#else
    let ib = tid / D;
    let j = tid % D;
    let i0 = ib * RPT;
    let r0 = i0 / 4u;
//#endif

    // conv channels of this thread: local index cl = tid + m W < 3 D
    var cw: array<vec4<f32>, CPT>;
    var h0: array<f32, CPT>;
    var h1: array<f32, CPT>;
    var h2: array<f32, CPT>;
    var xin: array<f32, CPT>;
    var chan: array<u32, CPT>;
    let hist_base = (slot * h_v + h) * (9u * D);
    let pb = pend_base(slot);
    //#for m CPT
    {
        let cl = tid + $m * W;
        if (cl < 3u * D) {
            let role = cl / D;
            let e = cl % D;
            var ch = 2u * h_k * D + h * D + e;
            if (role == 0u) {
                ch = g * D + e;
            } else if (role == 1u) {
                ch = h_k * D + g * D + e;
            }
            chan[$m] = ch;
            cw[$m] = vec4<f32>(lw[4u * ch], lw[4u * ch + 1u], lw[4u * ch + 2u], lw[4u * ch + 3u]);
            let hb = hist_base + 3u * cl;
            h0[$m] = hist[hb];
            h1[$m] = hist[hb + 1u];
            h2[$m] = hist[hb + 2u];
            // the accepted prefix of the held window shifted in, as its commit shifts it token by token
            for (var r = 0u; r < accept; r++) {
                h0[$m] = h1[$m];
                h1[$m] = h2[$m];
                if (cl < 2u * D) {
                    h2[$m] = pend[at_rqk(pb, rd, r, g) + cl];
                } else {
                    h2[$m] = pend[at_rv(pb, r, h) + cl - 2u * D];
                }
            }
            if (accept > 0u && commit_at == 0u) {
                hist[hb] = h0[$m];
                hist[hb + 1u] = h1[$m];
                hist[hb + 2u] = h2[$m];
            }
            if (nt > 0u) {
                xin[$m] = ld_qkv(row0 * cc + ch);
            }
        }
    }
    //#endfor

    let dt_h = lw[4u * cc + h];
    let a_h = lw[4u * cc + h_v + h];
    let gam = lw[4u * cc + 2u * h_v + j];
    // alpha and beta of the first W tokens, issued before the state's loads (see the token loop)
    let gp = W - 1u - tid;
    var alpha0 = 0.0;
    var beta0 = 0.0;
    if (gp < nt) {
        alpha0 = ld_alpha((row0 + gp) * h_v + h);
        beta0 = ld_beta((row0 + gp) * h_v + h);
    }

    // the state rows, once, four rows a vector (widened from bf16 where the pool keeps bf16)
    var st: array<vec4<f32>, RPT4>;
//#if VMAJOR
    // S[i][h][j] at (h D + j) D + i: this thread's rows are contiguous, four keys a vector
    let v_base = slot * (h_v * D * D / 4u) + (h * D + j) * (D / 4u) + r0;
    //#for q RPT4
    {
//#if SBF16
        let w = state[v_base + $q * RS];
        st[$q] = vec4<f32>(bf16_lo(w.x), bf16_hi(w.x), bf16_lo(w.y), bf16_hi(w.y));
//#else
        st[$q] = state[v_base + $q * RS];
//#endif
    }
    //#endfor
//#else
    let s_stride = h_v * D;
    let s_base = slot * (D * s_stride) + h * D + j;
//#if SBF16
    // two adjacent columns share a word: both threads read it and keep their half
    let odd = (j & 1u) == 1u;
    let w_stride = s_stride / 2u;
    //#for q RPT4
    {
        let at = (s_base + (i0 + 4u * $q) * s_stride) >> 1u;
        let w = vec4<u32>(state[at], state[at + w_stride], state[at + 2u * w_stride], state[at + 3u * w_stride]);
        let lo = vec4<f32>(bf16_lo(w.x), bf16_lo(w.y), bf16_lo(w.z), bf16_lo(w.w));
        let hi = vec4<f32>(bf16_hi(w.x), bf16_hi(w.y), bf16_hi(w.z), bf16_hi(w.w));
        st[$q] = select(lo, hi, odd);
    }
    //#endfor
//#else
    //#for q RPT4
    {
        let at = s_base + (i0 + 4u * $q) * s_stride;
        st[$q] = vec4<f32>(state[at], state[at + s_stride], state[at + 2u * s_stride], state[at + 3u * s_stride]);
    }
    //#endfor
//#endif
//#endif

    // the accepted prefix of the slot's held window, applied as the state is first loaded: token r's update with
    // the operations of the token loop below (so bitwise what the k-token commit computes), then a bf16 state
    // rounded once, where that commit rounds it; written back at once when this window commits nothing itself
    if (accept > 0u) {
        for (var r = 0u; r < accept; r++) {
            let dg = at_dg(pb, r, h);
            let gate4 = vec4<f32>(pend[dg + D]);
            let delta = pend[dg + j];
            let kr = at_kh(pb, rd, r, g);
            //#for q RPT4
            {
                let kb = kr + 4u * (r0 + $q * RS);
                let kq = vec4<f32>(pend[kb], pend[kb + 1u], pend[kb + 2u], pend[kb + 3u]);
                st[$q] = fma(gate4, st[$q], kq * delta);
            }
            //#endfor
        }
//#if SBF16
        //#for q RPT4
        {
            let v = st[$q];
            st[$q] = vec4<f32>(bf16_lo(bf16_bits(v.x)), bf16_lo(bf16_bits(v.y)), bf16_lo(bf16_bits(v.z)),
                               bf16_lo(bf16_bits(v.w)));
        }
        //#endfor
//#endif
        if (commit_at == 0u) {
//#include STORE
        }
        // the records just read are overwritten by this window's own (a held one) further down
        storageBarrier();
    }
    // a commit of held tokens alone (commit_held): no window
    if (nt == 0u) {
        return;
    }

    // z of the token whose y is written next (z_emit) and of the one after (z_load), a token ahead of its use
    let z_base = row0 * prm.n + h * D + j;
    var z_load = 0.0;
    var z_emit = 0.0;
    if (ib == 0u) {
        z_load = ld_z(z_base);
    }

    for (var t = 0u; t < nt; t++) {
        let commit = t + 1u == commit_at;
        // the gates of the next W tokens in parallel, from the last thread down (past the conv threads where
        // the workgroup has more than 3 D threads), so that their exp/log chain is paid once per W tokens
        if (t % W == 0u) {
            let k = t + gp;
            if (k < nt) {
                var al = alpha0;
                var be = beta0;
                if (t > 0u) {
                    al = ld_alpha((row0 + k) * h_v + h);
                    be = ld_beta((row0 + k) * h_v + h);
                }
                gates[gp] = vec2<f32>(decay(al, dt_h, a_h), sigmoid(be));
            }
        }
        // conv + SiLU of token t; the history shifted, and written back at the commit point
        //#for m CPT
        {
            let cl = tid + $m * W;
            if (cl < 3u * D) {
                let w = cw[$m];
                var s = fma(h0[$m], w.x, 0.0);
                s = fma(h1[$m], w.y, s);
                s = fma(h2[$m], w.z, s);
                s = fma(xin[$m], w.w, s);
                set_val(cl, s / (1.0 + exp(-s)));
                h0[$m] = h1[$m];
                h1[$m] = h2[$m];
                h2[$m] = xin[$m];
                if (commit) {
                    let hb = hist_base + 3u * cl;
                    hist[hb] = h0[$m];
                    hist[hb + 1u] = h1[$m];
                    hist[hb + 2u] = h2[$m];
                }
                if (hold) {
                    if (cl >= 2u * D) {
                        pend[at_rv(pb, t, h) + cl - 2u * D] = h2[$m];
                    } else if (first) {
                        pend[at_rqk(pb, wr, t, g) + cl] = h2[$m];
                    }
                }
                if (t + 1u < nt) {
                    xin[$m] = ld_qkv((row0 + t + 1u) * cc + chan[$m]);
                }
            }
        }
        //#endfor
        workgroupBarrier();

        // L2 norms of q and k; the readout norm of the previous token
//#if SUBGROUPS
        let sums = sumsq3(lane, sg_size);
        let ssq = sums.x;
        let ssk = sums.y;
        let sso = sums.z;
//#else
        partial_sumsq(tid);
        workgroupBarrier();
        let ssq = sum_parts(0u);
        let ssk = sum_parts(D / 16u);
        let sso = sum_parts(2u * D / 16u);
//#endif
        if (tid < 2u * D) {
            var r = inverseSqrt(ssq / f32(D) + prm.eps / f32(D));
            if (tid >= D) {
                r = inverseSqrt(ssk / f32(D) + prm.eps / f32(D));
            }
            let xh = (r * val(tid)) * SCALE;
            if (tid < D) {
                qh[tid / 4u][tid % 4u] = xh;
            } else {
                kh[(tid - D) / 4u][tid % 4u] = xh;
            }
        }
        if (t > 0u) {
            emit_y(sso, ib, j, h, row0 + t - 1u, z_emit, gam);
        }
        z_emit = z_load;
        if (ib == 0u && t + 1u < nt) {
            z_load = ld_z(z_base + (t + 1u) * prm.n);
        }
        workgroupBarrier();

        // kv_j over this thread's rows: four independent sums (rows i0 + 4q + c for c = 0..3), then added
        var kv4 = vec4<f32>(0.0);
        //#for q RPT4
        {
            kv4 = fma(st[$q], kh[r0 + $q * RS], kv4);
        }
        //#endfor
        red[red_at(ib, j)] = (kv4.x + kv4.y) + (kv4.z + kv4.w);
        if (t > 0u) {
            emit_late(tid, h, row0 + t - 1u);
        }
        workgroupBarrier();

        // the delta rule and this thread's part of the readout
        var kvs = 0.0;
        //#for k IB
        {
            kvs += red[red_at($k, j)];
        }
        //#endfor
        let gbeta = gates[t % W];
        let gate = gbeta.x;
        let delta = (val(2u * D + j) - gate * kvs) * gbeta.y;
        let gate4 = vec4<f32>(gate);
        var o4 = vec4<f32>(0.0);
        //#for q RPT4
        {
            st[$q] = fma(gate4, st[$q], kh[r0 + $q * RS] * delta);
            o4 = fma(st[$q], qh[r0 + $q * RS], o4);
        }
        //#endfor
        red2[red_at(ib, j)] = (o4.x + o4.y) + (o4.z + o4.w);
        if (hold && ib == 0u) {
            // what this token's commit would apply, for the step that accepts it
            let dg = at_dg(pb, t, h);
            pend[dg + j] = delta;
            if (j == 0u) {
                pend[dg + D] = gate;
            }
            if (first) {
                pend[at_kh(pb, wr, t, g) + j] = kh[j / 4u][j % 4u];
            }
        }
        if (commit) {
            // the state after token commit_at - 1, rounded once to bf16 where the pool keeps bf16
//#include STORE
        }
        workgroupBarrier();

        // the readout of token t, for the norm inside the next token
        if (ib == 0u) {
            var os = 0.0;
            //#for k IB
            {
                os += red2[red_at($k, j)];
            }
            //#endfor
            set_val(3u * D + j, os * SCALE);
        }
    }

    // the tail: the last token's output norm, y and planes
    workgroupBarrier();
//#if SUBGROUPS
    let sso = sumsq3(lane, sg_size).z;
//#else
    partial_sumsq(tid);
    workgroupBarrier();
    let sso = sum_parts(2u * D / 16u);
//#endif
    emit_y(sso, ib, j, h, row0 + nt - 1u, z_emit, gam);
//#if OUT16
    workgroupBarrier();
    emit_late(tid, h, row0 + nt - 1u);
//#else
    if (prm.plane != 0u) {
        workgroupBarrier();
        emit_late(tid, h, row0 + nt - 1u);
    }
//#endif
}

// SPEC.md step 7 for the token whose readout sits in vals[3D..4D), row `row` of the output; f32 outputs store
// y and the planes here, 16-bit ones leave y in `ys` for `emit_late`
fn emit_y(sso: f32, ib: u32, j: u32, h: u32, row: u32, zz: f32, gam: f32) {
    if (ib == 0u) {
        let rs = inverseSqrt(sso / f32(D) + prm.eps);
        var act = sigmoid(zz);
        if (prm.silu != 0u) {
            act = zz * act;
        }
        let y = ((rs * val(3u * D + j)) * gam) * act;
//#if OUT16
        ys[j] = y;
//#else
        let at = row * prm.n + h * D + j;
        out[at] = bitcast<u32>(y);
        let plane = prm.plane;
        if (plane != 0u) {
            out[plane + at] = bitcast<u32>(y * pow2_neg(2u * (j % 8u)));
            out[2u * plane + at] = bitcast<u32>(y * pow2_neg(8u * (j % 4u)));
            out[3u * plane + at] = bitcast<u32>(y * pow2_neg(8u * (j % 2u)));
            ys[j] = y;
        }
//#endif
    }
}

// the group sum g of the token whose y sits in ys: even and odd partials in increasing order, then added
fn group_sum(g: u32) -> f32 {
    var s0 = 0.0;
    var s1 = 0.0;
    for (var e = 0u; e < 16u; e += 2u) {
        s0 += ys[16u * g + e];
        s1 += ys[16u * g + e + 1u];
    }
    return s0 + s1;
}

// a barrier after emit_y: the group sums (and, for 16-bit outputs, y and the planes, two columns a word)
fn emit_late(tid: u32, h: u32, row: u32) {
    let plane = prm.plane;
    let gs_at = 4u * plane + (row * prm.h_v + h) * GW;
//#if OUT16
    if (tid < D / 2u) {
        let j = 2u * tid;
        let y0 = ys[j];
        let y1 = ys[j + 1u];
        let at = (row * prm.n + h * D) / 2u + tid;
        out[at] = enc16(y0) | (enc16(y1) << 16u);
        if (plane != 0u) {
            let pw = plane / 2u;
            out[pw + at] = enc16(y0 * pow2_neg(2u * (j % 8u))) | (enc16(y1 * pow2_neg(2u * ((j + 1u) % 8u))) << 16u);
            out[2u * pw + at] = enc16(y0 * pow2_neg(8u * (j % 4u))) | (enc16(y1 * pow2_neg(8u * ((j + 1u) % 4u))) << 16u);
            out[3u * pw + at] = enc16(y0) | (enc16(y1 * pow2_neg(8u)) << 16u);
        }
    } else if (plane != 0u && tid - D / 2u < GW / 2u) {
        // two group sums a word (GW is D / 16 rounded up to even; a missing odd one is 0)
        let g2 = tid - D / 2u;
        let s0 = group_sum(2u * g2);
        var s1 = 0.0;
        if (2u * g2 + 1u < D / 16u) {
            s1 = group_sum(2u * g2 + 1u);
        }
        out[gs_at / 2u + g2] = enc16(s0) | (enc16(s1) << 16u);
    }
//#else
    if (plane != 0u && tid < D / 16u) {
        out[gs_at + tid] = bitcast<u32>(group_sum(tid));
    }
//#endif
}
