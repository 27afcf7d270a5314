// The chunked (WY / UT) form of the GDN window step, for long windows (NOTES.md "Chunked windows").
//
// A template like gdn_step.wgsl: `chunk.rs` prepends the constants (KT, EPT, D, L, BV, NCB, NT, CG, IP1, UI, RSN, CP1,
// CP2, CPE, GW, PB, TB, LB, SB, ZE, SCALE), the input loaders and the scalar helpers of gdn_step.wgsl (decay, sigmoid,
// the bf16 / f16 conversions), and expands the same directives (SBF16, VMAJOR, OUT16; `//#for` blocks over LB4, SB,
// UI, TB, ZE, L and L8). Four entry points, dispatched in this order by the pool,
// each a pass over every chunk of every chunked window of the call:
//   chunk_pre  (q/k head or value head, chunk): conv + SiLU with the history, the L2 norms of q and k, the gates
//              and write strengths, into the scratch buffer `cs`;
//   chunk_wy   (value head, chunk): the chunk's decayed products and its triangular solve by forward
//              substitution: W = T (b gamma k), U = T (b v) with T = (I + A)^-1, A[r][s] = b_r G[r][s] (k_r . k_s)
//              for s < r, and P[r][s] = G[r][s] (q_r . k_s) for s <= r, where G[r][s] = g_{s+1} ... g_r;
//   chunk_run  (value head x column block, window): the recurrence over the chunks, the state's column block in
//              workgroup memory: delta = U - W S, o = scale (gamma q S + P delta), S <- gamma_end S + K~^T delta;
//              the committed state (and, column block 0, the history) stored where the window commits;
//   chunk_out  (value head, chunk): the gated RMS norm, y, planes and group sums from the readouts o.
// Chunks start at multiples of L from the window's start. Every row r of a chunk is computed from rows <= r only,
// with loops in a fixed order, so a chunk cut short (the last of a window) computes its rows with the very
// operations the full chunk uses; the state committed inside a chunk uses the update of a chunk ending there.
// No subgroup operations and no atomics: every reduction goes through workgroup memory in a fixed order.

struct CParams {
    plane: u32,
    qkv_off: u32,
    alpha_off: u32,
    beta_off: u32,
    z_off: u32,
    h_k: u32,
    h_v: u32,
    c: u32,
    n: u32,
    grouped: u32,
    silu: u32,
    eps: f32,
    // where the chunk entries start in `jobs` (vectors)
    centry: u32,
    // scratch regions in `cs` (floats): normalized q [tok][h_k][D], normalized k, v then U then the readouts o
    // [tok][h_v][D] (o_o == o_u), W, the gates [tok][h_v], the write strengths, per chunk and value head the
    // decayed q.k products [L][L] and three decay vectors
    o_qh: u32,
    o_kh: u32,
    o_u: u32,
    o_w: u32,
    o_o: u32,
    o_g: u32,
    o_b: u32,
    o_p: u32,
    // the round's first window (chunk_run's workgroup y counts from it)
    seq0: u32,
    pad1: u32,
    pad2: u32,
}

//#if SBF16
@group(0) @binding(0) var<storage, read_write> state: array<u32>;
//#else
@group(0) @binding(0) var<storage, read_write> state: array<f32>;
//#endif
// [slot][h_v][3 D][3]: each value head's own copy of the q, k and v history it reads (pool.rs)
@group(0) @binding(1) var<storage, read_write> hist: array<f32>;
@group(0) @binding(2) var<storage, read> inp: array<u32>;
@group(0) @binding(3) var<storage, read> lw: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<u32>;
// per chunked window two vectors: (slot, first row, length, commit point: 0 verify), (first scratch token, first
// chunk, 0, 0); from `centry` one vector per chunk: (window, chunk of it, 0, 0)
@group(0) @binding(5) var<storage, read> jobs: array<vec4<u32>>;
@group(0) @binding(6) var<uniform> prm: CParams;
@group(0) @binding(7) var<storage, read_write> cs: array<f32>;
// the same scratch as vectors, chunk_run's only name for it (its W, q, U and readout rows start on multiples of
// four floats); an entry point may use one name of a binding, not both
@group(0) @binding(7) var<storage, read_write> cs4: array<vec4<f32>>;

fn qk_head(h: u32) -> u32 {
    if (prm.grouped != 0u) {
        return h / (prm.h_v / prm.h_k);
    }
    return h % prm.h_k;
}

// the first value head reading q/k head g (whose history copy the prologue reads)
fn first_head(g: u32) -> u32 {
    if (prm.grouped != 0u) {
        return g * (prm.h_v / prm.h_k);
    }
    return g;
}

// ---------------------------------------------------------------------------------------------------------------
// chunk_pre

// conv outputs of TB tokens, [TB][2 D], and their 16-value partial sums of squares
var<workgroup> pv: array<f32, TB * 2 * D>;
var<workgroup> pparts: array<f32, TB * 2 * D / 16>;

@compute @workgroup_size(NT)
fn chunk_pre(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
    let ce = jobs[prm.centry + wg.y];
    let job = jobs[2u * ce.x];
    let slot = job.x;
    let row0 = job.y;
    let t0 = ce.y * L;
    let nl = min(L, job.z - t0);
    let tokb = jobs[2u * ce.x + 1u].x + t0;
    let h_k = prm.h_k;
    let h_v = prm.h_v;
    let cc = prm.c;
    let is_qk = wg.x < h_k;
    // q/k head g: its 2 D channels; value head h: its D v channels
    let g = wg.x;
    let h = wg.x - h_k;
    var nch = D;
    var hh = h;
    if (is_qk) {
        nch = 2u * D;
        hh = first_head(g);
    }
    var cw: array<vec4<f32>, CP1>;
    var h0: array<f32, CP1>;
    var h1: array<f32, CP1>;
    var h2: array<f32, CP1>;
    var chan: array<u32, CP1>;
    for (var m = 0u; m < CP1; m++) {
        let cl = tid + m * NT;
        if (cl < nch) {
            var ch = 2u * h_k * D + h * D + cl;
            var lc = 2u * D + cl;
            if (is_qk) {
                lc = cl;
                ch = (cl / D) * h_k * D + g * D + cl % D;
            }
            chan[m] = ch;
            cw[m] = vec4<f32>(lw[4u * ch], lw[4u * ch + 1u], lw[4u * ch + 2u], lw[4u * ch + 3u]);
            if (t0 == 0u) {
                let hb = (slot * h_v + hh) * (9u * D) + 3u * lc;
                h0[m] = hist[hb];
                h1[m] = hist[hb + 1u];
                h2[m] = hist[hb + 2u];
            } else {
                // t0 >= L >= 3: the three raw inputs before the chunk are rows of the window
                h0[m] = ld_qkv((row0 + t0 - 3u) * cc + ch);
                h1[m] = ld_qkv((row0 + t0 - 2u) * cc + ch);
                h2[m] = ld_qkv((row0 + t0 - 1u) * cc + ch);
            }
        }
    }
    if (!is_qk && tid < nl) {
        // the gate and write strength of token tid, as the token-serial kernel computes them
        let dt_h = lw[4u * cc + h];
        let a_h = lw[4u * cc + h_v + h];
        let row = row0 + t0 + tid;
        let at = (tokb + tid) * h_v + h;
        cs[prm.o_g + at] = decay(ld_alpha(row * h_v + h), dt_h, a_h);
        cs[prm.o_b + at] = sigmoid(ld_beta(row * h_v + h));
    }
    // TB tokens at a time: their conv outputs into workgroup memory, then all their partial sums of squares at
    // once, then the normalised values (three barriers a batch, not a token)
    for (var tb = 0u; tb < nl; tb += TB) {
        let nb = min(TB, nl - tb);
        // the batch's raw inputs, every load in flight before the first is used (loaded one token ahead, each
        // token waited on a round trip to memory)
        var xb: array<f32, TB * CP1>;
        for (var m = 0u; m < CP1; m++) {
            if (tid + m * NT < nch) {
                //#for u TB
                if ($u < nb) {
                    xb[$u * CP1 + m] = ld_qkv((row0 + t0 + tb + $u) * cc + chan[m]);
                }
                //#endfor
            }
        }
        //#for u TB
        if ($u < nb) {
            let t = tb + $u;
            for (var m = 0u; m < CP1; m++) {
                let cl = tid + m * NT;
                if (cl < nch) {
                    let x = xb[$u * CP1 + m];
                    let w = cw[m];
                    var s = fma(h0[m], w.x, 0.0);
                    s = fma(h1[m], w.y, s);
                    s = fma(h2[m], w.z, s);
                    s = fma(x, w.w, s);
                    let cv = s / (1.0 + exp(-s));
                    h0[m] = h1[m];
                    h1[m] = h2[m];
                    h2[m] = x;
                    if (is_qk) {
                        pv[$u * (2u * D) + cl] = cv;
                    } else {
                        cs[prm.o_u + ((tokb + t) * h_v + h) * D + cl] = cv;
                    }
                }
            }
        }
        //#endfor
        if (is_qk) {
            workgroupBarrier();
            // 16-value partial sums of squares: token u's q partials, then its k partials
            for (var p = tid; p < nb * (2u * D / 16u); p += NT) {
                let u = p / (2u * D / 16u);
                let q = p % (2u * D / 16u);
                var acc = 0.0;
                for (var e = 0u; e < 16u; e++) {
                    let x = pv[u * (2u * D) + 16u * q + e];
                    acc = fma(x, x, acc);
                }
                pparts[p] = acc;
            }
            workgroupBarrier();
            for (var m = 0u; m < CP1; m++) {
                let cl = tid + m * NT;
                if (cl < 2u * D) {
                    let role = cl / D;
                    var base = prm.o_qh;
                    if (role == 1u) {
                        base = prm.o_kh;
                    }
                    for (var u = 0u; u < nb; u++) {
                        var ss = 0.0;
                        for (var p = 0u; p < D / 16u; p++) {
                            ss += pparts[u * (2u * D / 16u) + role * (D / 16u) + p];
                        }
                        let r = inverseSqrt(ss / f32(D) + prm.eps / f32(D));
                        let xh = (r * pv[u * (2u * D) + cl]) * SCALE;
                        cs[base + ((tokb + tb + u) * h_k + g) * D + cl % D] = xh;
                    }
                }
            }
            workgroupBarrier();
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------
// chunk_wy

// k_r . k_s, then A in place
var<workgroup> wam: array<f32, L * L>;
// q_r . k_s, decayed in place, then copied to P in the scratch (the decays' read-modify-writes stay on chip)
var<workgroup> wpq: array<f32, L * L>;
// the chunk's k and q rows, KT columns at a time, rows KT + 1 apart: the dots' lanes read rows s of one column,
// and at a stride of KT (16 or 32 floats) those fell on one or two banks (16-way conflicts: most of chunk_wy's
// time on NVIDIA)
var<workgroup> wkt: array<f32, L * (KT + 1u)>;
var<workgroup> wqt: array<f32, L * (KT + 1u)>;
var<workgroup> wgs: array<f32, L>;
var<workgroup> wbs: array<f32, L>;
var<workgroup> wgam: array<f32, L>;

@compute @workgroup_size(NT)
fn chunk_wy(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
    let ce = jobs[prm.centry + wg.y];
    let job = jobs[2u * ce.x];
    let ex = jobs[2u * ce.x + 1u];
    let t0 = ce.y * L;
    let nl = min(L, job.z - t0);
    let tokb = ex.x + t0;
    let pbase = prm.o_p + ((ex.y + ce.y) * prm.h_v + wg.x) * PB;
    let h = wg.x;
    let h_k = prm.h_k;
    let h_v = prm.h_v;
    let g = qk_head(h);
    if (tid < nl) {
        let at = (tokb + tid) * h_v + h;
        wgs[tid] = cs[prm.o_g + at];
        wbs[tid] = cs[prm.o_b + at];
    }
    // k_r . k_s (s < r) into wam, q_r . k_s (s <= r) into wpq: the chunk's k and q rows staged KT columns at a
    // time, each entry's sum over i in order (the same sums as one row pair at a time from the scratch)
    var kd: array<f32, EPT>;
    var qd: array<f32, EPT>;
    for (var m = 0u; m < EPT; m++) {
        kd[m] = 0.0;
        qd[m] = 0.0;
    }
    for (var i0 = 0u; i0 < D; i0 += KT) {
        for (var e = tid; e < L * KT; e += NT) {
            let r = e / KT;
            let i = i0 + e % KT;
            var kv = 0.0;
            var qv = 0.0;
            if (r < nl && i < D) {
                kv = cs[prm.o_kh + ((tokb + r) * h_k + g) * D + i];
                qv = cs[prm.o_qh + ((tokb + r) * h_k + g) * D + i];
            }
            wkt[r * (KT + 1u) + e % KT] = kv;
            wqt[r * (KT + 1u) + e % KT] = qv;
        }
        workgroupBarrier();
        for (var m = 0u; m < EPT; m++) {
            let idx = tid + m * NT;
            let r = idx / L;
            let s = idx % L;
            if (idx < L * L && r < nl && s <= r) {
                for (var i = 0u; i < KT; i++) {
                    if (i0 + i < D) {
                        let kv = wkt[s * (KT + 1u) + i];
                        kd[m] = fma(wkt[r * (KT + 1u) + i], kv, kd[m]);
                        qd[m] = fma(wqt[r * (KT + 1u) + i], kv, qd[m]);
                    }
                }
            }
        }
        workgroupBarrier();
    }
    for (var m = 0u; m < EPT; m++) {
        let idx = tid + m * NT;
        if (idx < L * L && idx / L < nl && idx % L <= idx / L) {
            wam[idx] = kd[m];
            wpq[idx] = qd[m];
        }
    }
    workgroupBarrier();
    // the decays: column s walks down its rows, G = g_{s+1} ... g_r; gamma_r = g_0 ... g_r
    if (tid < nl) {
        let s = tid;
        var gd = 1.0;
        for (var r = s + 1u; r < nl; r++) {
            gd = gd * wgs[r];
            let bs = wbs[r];
            wpq[r * L + s] = gd * wpq[r * L + s];
            wam[r * L + s] = bs * (gd * wam[r * L + s]);
        }
    }
    // gamma_r, and the end decays g_{s+1} ... g_e of the chunk's last row and of the commit row where the window
    // commits inside the chunk, for chunk_run (after P in the chunk's block): each a product in a fixed order
    // from rows of the chunk up to its end only
    let commit_at = job.w;
    let has_commit = commit_at > t0 && commit_at <= t0 + nl;
    if (tid == NT - 1u) {
        var gm = 1.0;
        for (var r = 0u; r < nl; r++) {
            gm = gm * wgs[r];
            wgam[r] = gm;
            cs[pbase + L * L + r] = gm;
        }
    } else if (tid == NT - 2u || (tid == NT - 3u && has_commit)) {
        var e = nl - 1u;
        var at = pbase + L * L + L;
        if (tid == NT - 3u) {
            e = commit_at - t0 - 1u;
            at = pbase + L * L + 2u * L;
        }
        var gd = 1.0;
        var x = 0u;
        loop {
            let s = e - x;
            cs[at + s] = gd;
            if (s == 0u) {
                break;
            }
            gd = gd * wgs[s];
            x++;
        }
    }
    workgroupBarrier();
    // P to the scratch: the entries s <= r of the chunk's rows, as the dots and decays left them
    for (var idx = tid; idx < L * L; idx += NT) {
        if (idx / L < nl && idx % L <= idx / L) {
            cs[pbase + idx] = wpq[idx];
        }
    }
    // forward substitution, one column of [W | U] a thread: x_r = x0_r - sum_{s<r} A[r][s] x_s, in place of v for U;
    // eight rows at a time: the rows before the block taken once for all eight (each row's terms still in order of
    // s, so the same sums as one row after another), then the block's own triangle
    for (var m = 0u; m < CP2; m++) {
        let col = tid + m * NT;
        if (col < 2u * D) {
            var xs: array<f32, L>;
            let is_w = col < D;
            let e = col % D;
            var base = prm.o_u;
            if (is_w) {
                base = prm.o_w;
            }
            // the column's inputs, all loaded before the first block (a load after the block's stores below would
            // wait for them: the driver cannot tell the rows apart), then solved in place
            //#for r L
            if ($r < nl) {
                if (is_w) {
                    xs[$r] = cs[prm.o_kh + ((tokb + $r) * h_k + g) * D + e];
                } else {
                    xs[$r] = cs[prm.o_u + ((tokb + $r) * h_v + h) * D + e];
                }
            }
            //#endfor
            // the blocks and the rows before each unrolled, so that every index into xs is a constant (NVIDIA's
            // Vulkan compiler kept xs in local memory where a loop's variable indexed it)
            //#for b L8
            {
                var acc: array<f32, 8>;
                for (var i = 0u; i < 8u; i++) {
                    let r = $b * 8u + i;
                    acc[i] = 0.0;
                    if (r < nl) {
                        if (is_w) {
                            acc[i] = (wbs[r] * wgam[r]) * xs[r];
                        } else {
                            acc[i] = wbs[r] * xs[r];
                        }
                    }
                }
                //#for s L
                if ($s < $b * 8) {
                    let xv = xs[$s];
                    for (var i = 0u; i < 8u; i++) {
                        acc[i] = fma(-wam[($b * 8u + i) * L + $s], xv, acc[i]);
                    }
                }
                //#endfor
                for (var i = 0u; i < 8u; i++) {
                    let r = $b * 8u + i;
                    for (var j = 0u; j < 8u; j++) {
                        if (j < i) {
                            acc[i] = fma(-wam[r * L + $b * 8u + j], xs[$b * 8u + j], acc[i]);
                        }
                    }
                    xs[r] = acc[i];
                    if (r < nl) {
                        cs[base + ((tokb + r) * h_v + h) * D + e] = acc[i];
                    }
                }
            }
            //#endfor
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------
// chunk_run

// the state's column block, four columns a vector: S[i][cb BV + 4 c + x] at [i CG + c][x]
var<workgroup> sv: array<vec4<f32>, D * CG>;
// delta of the chunk's rows, [L][CG] vectors
var<workgroup> dl: array<vec4<f32>, L * CG>;
var<workgroup> rgam: array<f32, L>;
// the end decays g_{s+1} ... g_e of the chunk's last row e, then those of the commit row inside the chunk
var<workgroup> rends: array<f32, 2 * L>;

// scratch element e, for chunk_run (which reads the scratch through `cs4` only)
fn csr(e: u32) -> f32 {
    return cs4[e / 4u][e % 4u];
}

// element e = i BV + j of the column block
fn sv_at(e: u32) -> f32 {
    return sv[e / 4u][e % 4u];
}

// index of S[i][h][j] in the pool (elements)
fn s_index(slot: u32, h: u32, i: u32, j: u32) -> u32 {
//#if VMAJOR
    return ((slot * prm.h_v + h) * D + j) * D + i;
//#else
    return (slot * D + i) * (prm.h_v * D) + h * D + j;
//#endif
}

// the block in `sv` stored to the pool (bf16: rounded to nearest even, two elements a word: the even one of a
// pair, adjacent columns key-major, adjacent rows value-major, writes the word)
fn store_block(slot: u32, h: u32, cb: u32, tid: u32) {
    for (var m = 0u; m < RSN; m++) {
        let e = tid + m * NT;
        let i = e / BV;
        let j = e % BV;
        let at = s_index(slot, h, i, cb * BV + j);
//#if SBF16
//#if VMAJOR
        if ((i & 1u) == 0u) {
            state[at >> 1u] = bf16_bits(sv_at(e)) | (bf16_bits(sv_at(e + BV)) << 16u);
        }
//#else
        if ((j & 1u) == 0u) {
            state[at >> 1u] = bf16_bits(sv_at(e)) | (bf16_bits(sv_at(e + 1u)) << 16u);
        }
//#endif
//#else
        state[at] = sv_at(e);
//#endif
    }
}

// acc[m] += (rends[dec0 + s] k_s[i_m]) delta_s over the chunk's rows s <= last, in order: the update's sums for the
// state after row `last` (the chunk's end, dec0 0, or the commit row inside it, dec0 L). The keys of SB rows are
// loaded before their FMAs (rows past `last` read row `last`, unused).
fn add_rows(
    acc: ptr<function, array<vec4<f32>, UI>>,
    dec0: u32,
    last: u32,
    kb0: u32,
    ui0: u32,
    uc: u32,
) {
    for (var s0 = 0u; s0 < L; s0 += SB) {
        var kv: array<f32, SB * UI>;
        //#for x SB
        //#for m UI
        if (ui0 + $m * (NT / CG) < D) {
            kv[$x * UI + $m] = csr(kb0 + min(s0 + $x, last) * prm.h_k * D + $m * (NT / CG));
        }
        //#endfor
        //#endfor
        //#for x SB
        if (s0 + $x <= last) {
            let dv = dl[(s0 + $x) * CG + uc];
            let ge = rends[dec0 + s0 + $x];
            //#for m UI
            (*acc)[$m] = fma(vec4<f32>(ge * kv[$x * UI + $m]), dv, (*acc)[$m]);
            //#endfor
        }
        //#endfor
    }
}

// The chunk's three products as register tiles: a thread takes four adjacent columns of a row (one state vector
// from workgroup memory for four FMAs, one scratch element for four), where a thread a column issued a load per
// FMA; each element's sums run over the same terms in the same order as one column at a time.
@compute @workgroup_size(NT)
fn chunk_run(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
    let k = prm.seq0 + wg.y;
    let job = jobs[2u * k];
    let ex = jobs[2u * k + 1u];
    let slot = job.x;
    let row0 = job.y;
    let len = job.z;
    let commit_at = job.w;
    let h = wg.x / NCB;
    let cb = wg.x % NCB;
    let h_k = prm.h_k;
    let h_v = prm.h_v;
    let g = qk_head(h);
    // the column block, widened: thread tid owns elements tid + m NT (row e / BV, column e % BV)
    for (var m = 0u; m < RSN; m++) {
        let e = tid + m * NT;
        let at = s_index(slot, h, e / BV, cb * BV + e % BV);
//#if SBF16
        let w = state[at >> 1u];
        sv[e / 4u][e % 4u] = select(bf16_lo(w), bf16_hi(w), (at & 1u) != 0u);
//#else
        sv[e / 4u][e % 4u] = state[at];
//#endif
    }
    // the committed history (column block 0): the three raw inputs before the commit point, from the old history
    // and the window's rows; read before written, by the same thread
    if (cb == 0u && commit_at > 0u) {
        for (var cl = tid; cl < 3u * D; cl += NT) {
            let role = cl / D;
            let e = cl % D;
            var ch = 2u * h_k * D + h * D + e;
            if (role == 0u) {
                ch = g * D + e;
            } else if (role == 1u) {
                ch = h_k * D + g * D + e;
            }
            let hb = (slot * h_v + h) * (9u * D) + 3u * cl;
            var nh: array<f32, 3>;
            for (var q = 0u; q < 3u; q++) {
                let x = commit_at + q;
                if (x < 3u) {
                    nh[q] = hist[hb + x];
                } else {
                    nh[q] = ld_qkv((row0 + x - 3u) * prm.c + ch);
                }
            }
            hist[hb] = nh[0];
            hist[hb + 1u] = nh[1];
            hist[hb + 2u] = nh[2];
        }
    }
    workgroupBarrier();
    // the update's elements: rows ui0 + m NT / CG, column vector uc
    let uc = tid % CG;
    let ui0 = tid / CG;
    let nchunks = (len + L - 1u) / L;
    for (var c = 0u; c < nchunks; c++) {
        let t0 = c * L;
        let nl = min(L, len - t0);
        let tokb = ex.x + t0;
        let pbase = prm.o_p + ((ex.y + c) * h_v + h) * PB;
        // the commit inside this chunk: its last row pe
        let has_commit = commit_at > t0 && commit_at <= t0 + nl;
        let pe = commit_at - t0 - 1u;
        // gamma_r = g_0 ... g_r and the end decays of the chunk's end and of the commit row, from chunk_wy
        if (tid < nl) {
            rgam[tid] = csr(pbase + L * L + tid);
            rends[tid] = csr(pbase + L * L + L + tid);
            if (has_commit && tid <= pe) {
                rends[L + tid] = csr(pbase + L * L + 2u * L + tid);
            }
        }
        // delta = U - W S (items e < L CG) and q S (items L CG <= e < 2 L CG): row (e / CG) % L, column vector
        // e % CG; q S stays in the thread for its readout
        var qs: array<vec4<f32>, IP1>;
        for (var m = 0u; m < IP1; m++) {
            let e = tid + m * NT;
            let is_q = e >= L * CG;
            let r = (e / CG) % L;
            let c4 = e % CG;
            if (e < 2u * L * CG && r < nl) {
                var base = prm.o_w + ((tokb + r) * h_v + h) * D;
                if (is_q) {
                    base = prm.o_qh + ((tokb + r) * h_k + g) * D;
                }
                // LB scratch elements loaded before their FMAs: NVIDIA's Vulkan compiler left the loop's loads one
                // at a time on the chain (a chunk took about one L2 round trip an FMA step)
                var acc = vec4<f32>(0.0);
                for (var i0 = 0u; i0 < D; i0 += LB) {
                    var w: array<vec4<f32>, LB / 4u>;
                    //#for x LB4
                    w[$x] = cs4[(base + i0) / 4u + $x];
                    //#endfor
                    //#for x LB4
                    acc = fma(vec4<f32>(w[$x].x), sv[(i0 + 4u * $x) * CG + c4], acc);
                    acc = fma(vec4<f32>(w[$x].y), sv[(i0 + 4u * $x + 1u) * CG + c4], acc);
                    acc = fma(vec4<f32>(w[$x].z), sv[(i0 + 4u * $x + 2u) * CG + c4], acc);
                    acc = fma(vec4<f32>(w[$x].w), sv[(i0 + 4u * $x + 3u) * CG + c4], acc);
                    //#endfor
                }
                if (is_q) {
                    qs[m] = acc;
                } else {
                    let ub = prm.o_u + ((tokb + r) * h_v + h) * D + cb * BV + 4u * c4;
                    dl[r * CG + c4] = cs4[ub / 4u] - acc;
                }
            }
        }
        // the readouts below overwrite U elements other threads read above
        storageBarrier();
        workgroupBarrier();
        // the readouts o_r = scale (gamma_r q_r S + sum_{s <= r} P[r][s] delta_s), by the q S items' threads
        for (var m = 0u; m < IP1; m++) {
            let e = tid + m * NT;
            let r = (e / CG) % L;
            let c4 = e % CG;
            if (e >= L * CG && e < 2u * L * CG && r < nl) {
                var o = rgam[r] * qs[m];
                // constant trip counts here and below (a guard inside): lavapipe limits each loop of an
                // invocation to 65535 iterations in all, counted across re-entries, unless it is unrolled; the
                // row's P entries loaded SB at a time (all inside the chunk's block), used up to the diagonal
                for (var s0 = 0u; s0 < L; s0 += SB) {
                    var prow: array<f32, SB>;
                    //#for x SB
                    prow[$x] = csr(pbase + r * L + s0 + $x);
                    //#endfor
                    //#for x SB
                    if (s0 + $x <= r) {
                        o = fma(vec4<f32>(prow[$x]), dl[(s0 + $x) * CG + c4], o);
                    }
                    //#endfor
                }
                let ob = prm.o_o + ((tokb + r) * h_v + h) * D + cb * BV + 4u * c4;
                let os = o * SCALE;
                cs4[ob / 4u] = os;
            }
        }
        // the state after the chunk (and after the commit row, where it lies inside the chunk):
        // gamma_e S + sum_{s <= e} (G[e][s] k_s) delta_s, each element's sum over s in order
        var nsv: array<vec4<f32>, UI>;
        var csv: array<vec4<f32>, UI>;
        let inner = has_commit && pe + 1u < nl;
        let kb0 = prm.o_kh + (tokb * h_k + g) * D + ui0;
        for (var m = 0u; m < UI; m++) {
            let i = ui0 + m * (NT / CG);
            if (i < D) {
                nsv[m] = rgam[nl - 1u] * sv[i * CG + uc];
                if (inner) {
                    csv[m] = rgam[pe] * sv[i * CG + uc];
                }
            }
        }
        add_rows(&nsv, 0u, nl - 1u, kb0, ui0, uc);
        // the commit row's sums in a call of their own: one loop with both (the second under a guard) was not
        // unrolled by lavapipe, whose loop limit then cut a 65536-token window short
        if (inner) {
            add_rows(&csv, L, pe, kb0, ui0, uc);
        }
        workgroupBarrier();
        if (inner) {
            for (var m = 0u; m < UI; m++) {
                let i = ui0 + m * (NT / CG);
                if (i < D) {
                    sv[i * CG + uc] = csv[m];
                }
            }
            workgroupBarrier();
            store_block(slot, h, cb, tid);
            workgroupBarrier();
        }
        for (var m = 0u; m < UI; m++) {
            let i = ui0 + m * (NT / CG);
            if (i < D) {
                sv[i * CG + uc] = nsv[m];
            }
        }
        workgroupBarrier();
        if (has_commit && !inner) {
            store_block(slot, h, cb, tid);
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------
// chunk_out

// readouts and outputs of TB tokens, [TB][D], and their partial sums of squares
var<workgroup> eo: array<f32, TB * D>;
var<workgroup> ey: array<f32, TB * D>;
var<workgroup> eparts: array<f32, TB * D / 16>;

// group sum q of the token whose y starts at ey[b]: even and odd partials in increasing order, then added
fn egroup_sum(b: u32, q: u32) -> f32 {
    var s0 = 0.0;
    var s1 = 0.0;
    for (var e = 0u; e < 16u; e += 2u) {
        s0 += ey[b + 16u * q + e];
        s1 += ey[b + 16u * q + e + 1u];
    }
    return s0 + s1;
}

@compute @workgroup_size(NT)
fn chunk_out(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
    let ce = jobs[prm.centry + wg.y];
    let job = jobs[2u * ce.x];
    let t0 = ce.y * L;
    let nl = min(L, job.z - t0);
    let tokb = jobs[2u * ce.x + 1u].x + t0;
    let h = wg.x;
    let n = prm.n;
    let plane = prm.plane;
    // TB tokens at a time, every step over all of them at once (four barriers a batch)
    for (var tb = 0u; tb < nl; tb += TB) {
        let nb = min(TB, nl - tb);
        // every global value this thread's elements need, loaded up front: a load after one of the y stores
        // below waits for it (the driver cannot tell the output from the inputs), one round trip an element
        var zv: array<f32, ZE>;
        var gv: array<f32, ZE>;
        //#for k ZE
        {
            let e = tid + $k * NT;
            if (e < nb * D) {
                eo[e] = cs[prm.o_o + ((tokb + tb + e / D) * prm.h_v + h) * D + e % D];
                zv[$k] = ld_z((job.y + t0 + tb + e / D) * n + h * D + e % D);
                gv[$k] = lw[4u * prm.c + 2u * prm.h_v + e % D];
            }
        }
        //#endfor
        workgroupBarrier();
        for (var p = tid; p < nb * (D / 16u); p += NT) {
            let b = (p / (D / 16u)) * D + 16u * (p % (D / 16u));
            var acc = 0.0;
            for (var e = 0u; e < 16u; e++) {
                let x = eo[b + e];
                acc = fma(x, x, acc);
            }
            eparts[p] = acc;
        }
        workgroupBarrier();
        //#for k ZE
        if (tid + $k * NT < nb * D) {
            let e = tid + $k * NT;
            let u = e / D;
            let j = e % D;
            let row = job.y + t0 + tb + u;
            var sso = 0.0;
            for (var p = 0u; p < D / 16u; p++) {
                sso += eparts[u * (D / 16u) + p];
            }
            let rs = inverseSqrt(sso / f32(D) + prm.eps);
            let zz = zv[$k];
            var act = sigmoid(zz);
            if (prm.silu != 0u) {
                act = zz * act;
            }
            let gam = gv[$k];
            let y = ((rs * eo[e]) * gam) * act;
            ey[e] = y;
//#if !OUT16
            let at = row * n + h * D + j;
            out[at] = bitcast<u32>(y);
            if (plane != 0u) {
                out[plane + at] = bitcast<u32>(y * pow2_neg(2u * (j % 8u)));
                out[2u * plane + at] = bitcast<u32>(y * pow2_neg(8u * (j % 4u)));
                out[3u * plane + at] = bitcast<u32>(y * pow2_neg(8u * (j % 2u)));
            }
//#endif
        }
        //#endfor
        workgroupBarrier();
//#if OUT16
        for (var p = tid; p < nb * (D / 2u); p += NT) {
            let u = p / (D / 2u);
            let j = 2u * (p % (D / 2u));
            let row = job.y + t0 + tb + u;
            let y0 = ey[u * D + j];
            let y1 = ey[u * D + j + 1u];
            let at = (row * n + h * D + j) / 2u;
            out[at] = enc16(y0) | (enc16(y1) << 16u);
            if (plane != 0u) {
                let pw = plane / 2u;
                out[pw + at] = enc16(y0 * pow2_neg(2u * (j % 8u))) | (enc16(y1 * pow2_neg(2u * ((j + 1u) % 8u))) << 16u);
                out[2u * pw + at] = enc16(y0 * pow2_neg(8u * (j % 4u))) | (enc16(y1 * pow2_neg(8u * ((j + 1u) % 4u))) << 16u);
                out[3u * pw + at] = enc16(y0) | (enc16(y1 * pow2_neg(8u)) << 16u);
            }
        }
        if (plane != 0u) {
            for (var p = tid; p < nb * (GW / 2u); p += NT) {
                let u = p / (GW / 2u);
                let q2 = p % (GW / 2u);
                let row = job.y + t0 + tb + u;
                let s0 = egroup_sum(u * D, 2u * q2);
                var s1 = 0.0;
                if (2u * q2 + 1u < D / 16u) {
                    s1 = egroup_sum(u * D, 2u * q2 + 1u);
                }
                out[(4u * plane + (row * prm.h_v + h) * GW) / 2u + q2] = enc16(s0) | (enc16(s1) << 16u);
            }
        }
//#else
        if (plane != 0u) {
            for (var p = tid; p < nb * (D / 16u); p += NT) {
                let u = p / (D / 16u);
                let row = job.y + t0 + tb + u;
                out[4u * plane + (row * prm.h_v + h) * GW + p % (D / 16u)] = bitcast<u32>(egroup_sum(u * D, p % (D / 16u)));
            }
        }
//#endif
        workgroupBarrier();
    }
}
