// The fused GDN window step (SPEC.md), one workgroup per (sequence, value head).
//
// This file is a template: `kernel.rs` prepends the launch constants (D, IB, RPT, RPT4, W, CPT, SCALE) and
// expands the directives below before handing the text to wgpu, so every loop over state rows has constant
// bounds and constant indices and the state array lives in registers. The head counts, conventions and planes are
// uniforms: one pipeline serves every layer of a head dim.
//   //#if NAME / //#else / //#endif       kept or dropped by a host flag (SUBGROUPS)
//   //#for v COUNT ... //#endfor         the block repeated COUNT times with `$v` replaced by 0, 1, ...
//                                        (or a real loop when COUNT is large); each copy gets its own braces
//
// Thread layout: thread `tid = ib * D + j` owns column j of the head's state and the RPT rows
// `ib * RPT .. + RPT`. The first 3 D threads (or all of them, several channels each when the workgroup is
// smaller) run the conv of one channel: q and k of the value head's q/k head, then its own v. The gates and
// write strengths are computed W tokens at a time, one token a thread from the last thread down.
//
// The q/k conv history is private to each value head (layout [slot][h_v][3][D][3], see pool.rs), so the
// workgroup owns everything it reads and writes its committed history in place: no double buffer and no
// dependency between workgroups.
//
// A token takes four barriers (five without subgroups). The readout's RMS norm and the planes of token t run
// inside token t + 1 (after its first and second barriers), and after the last token in a short tail.

struct Params {
    // tokens in the window
    t: u32,
    // 0: verify, else the state and history after token commit_at - 1 are written back
    commit_at: u32,
    // plane stride P in floats (planes on) or 0
    plane: u32,
    // offsets of qkv, alpha, beta and z inside `inp`
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
    pad: u32,
}

// [slot][D][h_v][D]: SPEC.md's S per slot
@group(0) @binding(0) var<storage, read_write> state: array<f32>;
// [slot][h_v][3][D][3]: each value head's own copy of the q, k and v history it reads
@group(0) @binding(1) var<storage, read_write> hist: array<f32>;
// qkv [B][T][C] | alpha [B][T][h_v] | beta [B][T][h_v] | z [B][T][n]
@group(0) @binding(2) var<storage, read> inp: array<f32>;
// conv_w [C][4] | dt [h_v] | a [h_v] | gamma [D]
@group(0) @binding(3) var<storage, read> lw: array<f32>;
// gdn::OutputLayout: y at 0, planes at P, 2P, 3P, group sums at 4P
@group(0) @binding(4) var<storage, read_write> out: array<f32>;
// (sequence index b, pool slot) of each live sequence: workgroup_id.y indexes it
@group(0) @binding(5) var<storage, read> jobs: array<vec2<u32>>;
@group(0) @binding(6) var<uniform> prm: Params;

// raw conv outputs of the token: q [0, D), k [D, 2D), v [2D, 3D); the readout o of the previous token at [3D, 4D);
// four values a vector (element x at vals[x / 4][x % 4]), so the norms read them four at a time
var<workgroup> vals: array<vec4<f32>, D>;
// normalized q and k, four rows a vector
//#if ONEPASS
// two tokens' worth (by token parity) of the normalized q and k, and of the per row block partials (kv, sq)
var<workgroup> qh: array<vec4<f32>, D / 2>;
var<workgroup> kh: array<vec4<f32>, D / 2>;
var<workgroup> red: array<vec2<f32>, 2 * IB * D>;
//#else
var<workgroup> qh: array<vec4<f32>, D / 4>;
var<workgroup> kh: array<vec4<f32>, D / 4>;
// per row block partials of kv and of the readout
var<workgroup> red: array<f32, IB * D>;
var<workgroup> red2: array<f32, IB * D>;
//#endif
// gate and write strength of the window's tokens, W at a time (token t at t % W)
var<workgroup> gates: array<vec2<f32>, W>;
// y of the previous token, for the group sums
var<workgroup> ys: array<f32, D>;
//#if !SUBGROUPS
//#if ONEPASS
// 16-element partial sums: squares of q [0, D/16), k [D/16, 2D/16), o [2D/16, 3D/16); q . k [3D/16, 4D/16)
var<workgroup> parts: array<f32, 4 * D / 16>;
//#else
// 16-element partial sums of squares: q [0, D/16), k [D/16, 2D/16), o [2D/16, 3D/16)
var<workgroup> parts: array<f32, 3 * D / 16>;
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
//#if ONEPASS
// as sumsq3, and q . k in w
fn sums4(lane: u32, sg: u32) -> vec4<f32> {
    var acc = vec4<f32>(0.0);
    for (var c = lane; c < D / 4u; c += sg) {
        let q = vals[c];
        let k = vals[D / 4u + c];
        let o = vals[3u * D / 4u + c];
        acc += vec4<f32>(dot(q, q), dot(k, k), dot(o, o), dot(q, k));
    }
    return subgroupAdd(acc);
}
//#endif
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

//#if ONEPASS
// as partial_sumsq, and threads 3 D / 16 .. 4 D / 16 sum 16 products q_i k_i
fn partial_sums4(p: u32) {
    if (p < 3u * D / 16u) {
        partial_sumsq(p);
    } else if (p < 4u * D / 16u) {
        let base = 4u * (p - 3u * D / 16u);
        var acc = vec4<f32>(0.0);
        for (var e = 0u; e < 4u; e++) {
            acc = fma(vals[base + e], vals[D / 4u + base + e], acc);
        }
        parts[p] = (acc.x + acc.y) + (acc.z + acc.w);
    }
}
//#endif

// the sum of the D / 16 partials from `first`, in order
fn sum_parts(first: u32) -> f32 {
    var acc = 0.0;
    for (var p = 0u; p < D / 16u; p++) {
        acc += parts[first + p];
    }
    return acc;
}
//#endif

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
    let job = jobs[wg.y];
    let b = job.x;
    let slot = job.y;
    let nt = prm.t;
    let commit_at = prm.commit_at;
    let plane = prm.plane;
    let h_k = prm.h_k;
    let h_v = prm.h_v;
    let cc = prm.c;
    var g = h % h_k;
    if (prm.grouped != 0u) {
        g = h / (h_v / h_k);
    }
    let ib = tid / D;
    let j = tid % D;
    let i0 = ib * RPT;
    let row0 = b * nt;

    // conv channels of this thread: local index cl = tid + m W < 3 D
    var cw: array<vec4<f32>, CPT>;
    var h0: array<f32, CPT>;
    var h1: array<f32, CPT>;
    var h2: array<f32, CPT>;
    var xin: array<f32, CPT>;
    var chan: array<u32, CPT>;
    let hist_base = (slot * h_v + h) * (9u * D);
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
            xin[$m] = inp[prm.qkv_off + row0 * cc + ch];
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
        alpha0 = inp[prm.alpha_off + (row0 + gp) * h_v + h];
        beta0 = inp[prm.beta_off + (row0 + gp) * h_v + h];
    }

    // the state rows, once, four rows a vector
    var st: array<vec4<f32>, RPT4>;
    let s_stride = h_v * D;
    let s_base = slot * (D * s_stride) + h * D + j;
    //#for q RPT4
    {
        let at = s_base + (i0 + 4u * $q) * s_stride;
        st[$q] = vec4<f32>(state[at], state[at + s_stride], state[at + 2u * s_stride], state[at + 3u * s_stride]);
    }
    //#endfor

    // z of the token whose y is written next (z_emit) and of the one after (z_load), a token ahead of its use
    let z_base = prm.z_off + row0 * prm.n + h * D + j;
    var z_load = 0.0;
    var z_emit = 0.0;
    if (ib == 0u) {
        z_load = inp[z_base];
    }

//#if ONEPASS
    // One pass over the state a token (NOTES.md, "one-pass variant"). Iteration t runs the conv and norms of
    // token t, then one sweep over the state registers: the update of token t - 1 fused with the partial sums
    // kv = S^T k and sq = S^T q of token t, both against the state before token t's update. Token t - 1's
    // readout comes from the state before its update: o = g (S^T q) + delta (k . q). An extra iteration
    // t = nt finishes the last token (its update only where the window commits after it). Two barriers a
    // token (three without subgroups). Parities: qh/kh and red alternate between two halves by token.
    var v_cur = 0.0;
    var g_cur = vec2<f32>(0.0);
    var kq_cur = 0.0;
    for (var t = 0u; t <= nt; t++) {
        if (t % W == 0u) {
            let k = t + gp;
            if (k < nt) {
                var al = alpha0;
                var be = beta0;
                if (t > 0u) {
                    al = inp[prm.alpha_off + (row0 + k) * h_v + h];
                    be = inp[prm.beta_off + (row0 + k) * h_v + h];
                }
                gates[gp] = vec2<f32>(decay(al, dt_h, a_h), sigmoid(be));
            }
        }
        // conv + SiLU of token t; the history shifted, and written back at the commit point
        if (t < nt) {
            let commit = t + 1u == commit_at;
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
                    if (t + 1u < nt) {
                        xin[$m] = inp[prm.qkv_off + (row0 + t + 1u) * cc + chan[$m]];
                    }
                }
            }
            //#endfor
        }
        workgroupBarrier();

        // L2 norms of q and k of token t and their dot product; the readout norm of token t - 2 (nothing of
        // this in the extra iteration of a one-token window)
        let par = t % 2u;
        var v_nxt = 0.0;
        var g_nxt = vec2<f32>(0.0);
        var kq_nxt = 0.0;
        if (t < nt || t >= 2u) {
//#if SUBGROUPS
            let sums = sums4(lane, sg_size);
            let ssq = sums.x;
            let ssk = sums.y;
            let sso = sums.z;
            let sqk = sums.w;
//#else
            partial_sums4(tid);
            workgroupBarrier();
            let ssq = sum_parts(0u);
            let ssk = sum_parts(D / 16u);
            let sso = sum_parts(2u * D / 16u);
            let sqk = sum_parts(3u * D / 16u);
//#endif
            if (t < nt) {
                let rq = inverseSqrt(ssq / f32(D) + prm.eps / f32(D));
                let rk = inverseSqrt(ssk / f32(D) + prm.eps / f32(D));
                if (tid < 2u * D) {
                    var r = rq;
                    if (tid >= D) {
                        r = rk;
                    }
                    let xh = (r * val(tid)) * SCALE;
                    if (tid < D) {
                        qh[par * (D / 4u) + tid / 4u][tid % 4u] = xh;
                    } else {
                        kh[par * (D / 4u) + (tid - D) / 4u][tid % 4u] = xh;
                    }
                }
                kq_nxt = ((rq * SCALE) * (rk * SCALE)) * sqk;
                v_nxt = val(2u * D + j);
                g_nxt = gates[t % W];
            }
            if (t >= 2u) {
                emit_y(sso, ib, j, h, row0 + t - 2u, z_emit, gam);
            }
            workgroupBarrier();
        }
        if (ib == 0u && t >= 1u) {
            z_emit = z_load;
            if (t < nt) {
                z_load = inp[z_base + t * prm.n];
            }
        }

        // token t - 1: delta and readout from the sums over the row blocks
        let old = (1u - par) * (IB * D);
        var delta = 0.0;
        if (t > 0u) {
            var r = vec2<f32>(0.0);
            //#for k IB
            {
                r += red[old + $k * D + j];
            }
            //#endfor
            let gate = g_cur.x;
            delta = (v_cur - gate * r.x) * g_cur.y;
            if (ib == 0u) {
                set_val(3u * D + j, fma(delta, kq_cur, gate * r.y) * SCALE);
            }
        }
        let gate4 = vec4<f32>(g_cur.x);
        let ko = (1u - par) * (D / 4u) + i0 / 4u;
        let kn = par * (D / 4u) + i0 / 4u;
        var kv4 = vec4<f32>(0.0);
        var sq4 = vec4<f32>(0.0);
        if (t > 0u && t < nt) {
            // token t - 1's update fused with token t's partial sums
            //#for q RPT4
            {
                st[$q] = fma(gate4, st[$q], kh[ko + $q] * delta);
                kv4 = fma(st[$q], kh[kn + $q], kv4);
                sq4 = fma(st[$q], qh[kn + $q], sq4);
            }
            //#endfor
        } else if (t == 0u) {
            //#for q RPT4
            {
                kv4 = fma(st[$q], kh[kn + $q], kv4);
                sq4 = fma(st[$q], qh[kn + $q], sq4);
            }
            //#endfor
        } else if (t == commit_at) {
            // the last token's update, only where the window commits after it
            //#for q RPT4
            {
                st[$q] = fma(gate4, st[$q], kh[ko + $q] * delta);
            }
            //#endfor
        }
        if (t < nt) {
            red[par * (IB * D) + tid] =
                vec2<f32>((kv4.x + kv4.y) + (kv4.z + kv4.w), (sq4.x + sq4.y) + (sq4.z + sq4.w));
        }
        if (t > 0u && t == commit_at) {
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
        }
        if (t >= 2u && plane != 0u) {
            emit_group_sums(tid, h, row0 + t - 2u);
        }
        v_cur = v_nxt;
        g_cur = g_nxt;
        kq_cur = kq_nxt;
    }
//#else
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
                    al = inp[prm.alpha_off + (row0 + k) * h_v + h];
                    be = inp[prm.beta_off + (row0 + k) * h_v + h];
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
                if (t + 1u < nt) {
                    xin[$m] = inp[prm.qkv_off + (row0 + t + 1u) * cc + chan[$m]];
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
            z_load = inp[z_base + (t + 1u) * prm.n];
        }
        workgroupBarrier();

        // kv_j over this thread's rows: four independent sums (rows i0 + 4q + c for c = 0..3), then added
        var kv4 = vec4<f32>(0.0);
        //#for q RPT4
        {
            kv4 = fma(st[$q], kh[i0 / 4u + $q], kv4);
        }
        //#endfor
        red[tid] = (kv4.x + kv4.y) + (kv4.z + kv4.w);
        if (t > 0u && plane != 0u) {
            emit_group_sums(tid, h, row0 + t - 1u);
        }
        workgroupBarrier();

        // the delta rule and this thread's part of the readout
        var kvs = 0.0;
        //#for k IB
        {
            kvs += red[$k * D + j];
        }
        //#endfor
        let gbeta = gates[t % W];
        let gate = gbeta.x;
        let delta = (val(2u * D + j) - gate * kvs) * gbeta.y;
        let gate4 = vec4<f32>(gate);
        var o4 = vec4<f32>(0.0);
        //#for q RPT4
        {
            st[$q] = fma(gate4, st[$q], kh[i0 / 4u + $q] * delta);
            o4 = fma(st[$q], qh[i0 / 4u + $q], o4);
        }
        //#endfor
        red2[tid] = (o4.x + o4.y) + (o4.z + o4.w);
        if (commit) {
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
        }
        workgroupBarrier();

        // the readout of token t, for the norm inside the next token
        if (ib == 0u) {
            var os = 0.0;
            //#for k IB
            {
                os += red2[$k * D + j];
            }
            //#endfor
            set_val(3u * D + j, os * SCALE);
        }
    }

//#endif

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
    if (plane != 0u) {
        workgroupBarrier();
        emit_group_sums(tid, h, row0 + nt - 1u);
    }
}

// SPEC.md step 7 for the token whose readout sits in vals[3D..4D), row `row` of the output; the planes
fn emit_y(sso: f32, ib: u32, j: u32, h: u32, row: u32, zz: f32, gam: f32) {
    if (ib == 0u) {
        let rs = inverseSqrt(sso / f32(D) + prm.eps);
        var act = sigmoid(zz);
        if (prm.silu != 0u) {
            act = zz * act;
        }
        let y = ((rs * val(3u * D + j)) * gam) * act;
        let at = row * prm.n + h * D + j;
        out[at] = y;
        let plane = prm.plane;
        if (plane != 0u) {
            out[plane + at] = y * pow2_neg(2u * (j % 8u));
            out[2u * plane + at] = y * pow2_neg(8u * (j % 4u));
            out[3u * plane + at] = y * pow2_neg(8u * (j % 2u));
            ys[j] = y;
        }
    }
}

// the group sums of the token whose y sits in ys: even and odd partials in increasing order, then added
fn emit_group_sums(tid: u32, h: u32, row: u32) {
    if (tid < D / 16u) {
        var s0 = 0.0;
        var s1 = 0.0;
        for (var e = 0u; e < 16u; e += 2u) {
            s0 += ys[16u * tid + e];
            s1 += ys[16u * tid + e + 1u];
        }
        out[4u * prm.plane + row * (prm.n / 16u) + (h * D) / 16u + tid] = s0 + s1;
    }
}
