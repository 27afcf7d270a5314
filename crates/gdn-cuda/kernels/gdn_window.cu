// gdn_window.cu: the GDN window step (SPEC.md) of windows of a few tokens (the host's window_range), eight tokens
// at a time in the chunked (WY) form with the state in registers (see NOTES.md, "Windows in chunks of eight").
//
// Specialised by the same macros as gdn_step.cu (src/spec.rs writes one header for both): GDN_D, GDN_HK,
// GDN_HV, GDN_T (0: each sequence's own length), GDN_SILU, GDN_GROUPED, GDN_PLANES, GDN_COMMIT, the element types,
// GDN_STATE_DT, GDN_VMAJOR, GDN_AHEAD (an L2 prefetch distance in blocks, its own: `Spec::with_window`),
// GDN_WSPLIT (the per-column work on two threads a column: `Spec::window_split`); one block
// a value head (GDN_NCB 1), D 64 or 128 (its own split, below: GDN_RG and GDN_MINB are the token-serial
// kernel's).
//
// Which sequences. This kernel takes a sequence whose effective length (its commit point, or its length if it
// commits nothing) is in GDN_WMIN ..= GDN_WMAX (the host's window_range, where it measured faster); the
// token-serial kernel (gdn_step.cu, compiled with GDN_ROUTE) takes the others of the same call. A commit after k
// tokens of a longer window therefore runs in the kernel a k-token window runs in: bitwise the same state,
// history and outputs for its first k tokens.
//
// The form. For a chunk of c <= 8 tokens starting from S0 (keys i, value columns j), with gates g_t, write
// strengths b_t, normalized keys k_t and queries q_t (t = 0 .. c-1), r(t, s) = g_{s+1} ... g_t (r(t, t) = 1) and
// G_t = g_0 ... g_t:
//   S_t = G_t S0 + sum_{s <= t} r(t, s) k_s d_s^T
//   d_t = ((v_t - G_t (S0^T k_t)) - sum_{s < t} r(t, s) (k_s . k_t) d_s) b_t        (forward substitution)
//   o_t = (G_t (S0^T q_t) + sum_{s <= t} r(t, s) (k_s . q_t) d_s) / sqrt(D)
// so the state is read once a chunk for the products [K; Q] S0 (S0^T k_t and S0^T q_t of all its tokens in one
// tensor-core pass) and once for the update, with no barrier between tokens. The update after k
// tokens is S = fmaf(G_{k-1}, S0, k_0 w_0 + k_1 w_1 + ...), w_s = r(k-1, s) d_s. Every sum has one fixed order,
// so a chunk's bits depend only on its own tokens: the committed state after k tokens equals a k-token window's,
// and a sequence's bits do not depend on the call.
//
// Work split: block (value head, sequence) of 2 D threads, D / 16 warps; the state stays in registers for the
// whole window, laid out as the accumulator fragments of the update's product S^T += W^T K (mma.sync m16n8k8,
// 3xTF32, gdn_elt.cuh): warp w holds value columns 16 w .. 16 w + 15 (fragment row r < 8 is column 16 w + 2 r,
// row r + 8 is 16 w + 2 r + 1) over every key, lane (g, q) = (lane / 4, lane % 4) of key tile s (keys 8 s ..
// 8 s + 7) st[s] = S[8 s + 2 q][c0], S[8 s + 2 q + 1][c0], S[8 s + 2 q][c0 + 1], S[8 s + 2 q + 1][c0 + 1] with
// c0 = 16 w + 2 g. The same registers are the B fragments of the chunk's products [K; Q] S0 (8 key rows and 8
// query rows against the warp's 16 columns), with the products' k index q read from key 2 q of the tile and
// q + 4 from key 2 q + 1 (the A fragments are loaded in that order: a sum over the same products). The small
// per-column work (the deltas' forward substitution, the readout, the norm) runs on one thread a column, or two
// (GDN_WSPLIT: each half of the chunk's tokens, the same arithmetic), through shared memory. A commit after n tokens gives the update's mma the weights and keys of tokens >= n as zeros
// (selects), so it sees exactly the inputs an n-token chunk gives it; each product element depends only on its own
// row and column, so a token's products do not depend on the tokens after it.

#define D GDN_D
#ifndef GDN_AHEAD
#define GDN_AHEAD 0
#endif
#define HK GDN_HK
#define HV GDN_HV
#define NT (2 * D)
#define NW (NT / 32)
#define KT (D / 8)   // key tiles
#define KP (D + 8)   // padded row of the keys and queries in shared memory: fragment loads without bank conflicts
#define C_ALL ((2 * HK + HV) * D)
#define N_OUT (HV * D)
#define NE (3 * D)
#define NCH ((NE + NT - 1) / NT)
#define CH 8
#ifndef GDN_WSPLIT
#define GDN_WSPLIT 0
#endif
#define PCW (GDN_WSPLIT ? 2 : 1)  // threads a column for the per-column work (no bits depend on it)
#define TH (CH / PCW)             // the chunk's tokens each one reads out

static_assert(GDN_NCB == 1, "one block a value head");
static_assert(D == 64 || D == 128, "d 64 or 128");
static_assert(NT == 2 * D, "a warp per 16 columns; up to two threads a column for the per-column work");
static_assert(HV % HK == 0, "h_v must be a multiple of h_k");

typedef Elt<GDN_QKV_DT> EQ;
typedef Elt<GDN_ALPHA_DT> EA;
typedef Elt<GDN_BETA_DT> EB;
typedef Elt<GDN_Z_DT> EZ;
typedef Elt<GDN_OUT_DT> EO;
typedef Elt<GDN_STATE_DT> ES;


extern "C" __global__ void __launch_bounds__(NT, 2)
gdn_step(ES::T* __restrict__ state, float* __restrict__ hist, const EQ::T* __restrict__ qkv,
         const EA::T* __restrict__ alpha, const EB::T* __restrict__ beta, const EZ::T* __restrict__ z,
         const float* __restrict__ conv_w, const float* __restrict__ dt, const float* __restrict__ ssm_a,
         const float* __restrict__ gamma, EO::T* __restrict__ out, const int* __restrict__ seq_slot,
         const int* __restrict__ seq_start, const int* __restrict__ seq_len, const int* __restrict__ seq_commit,
         int n_slots, int n_rows, long long plane, float eps, unsigned* __restrict__ fault) {
#if GDN_COMMIT == 0
    (void)seq_commit;
#endif
#if GDN_PLANES == 0
    (void)plane;
#endif
    // the normalized queries and keys as their splits for the tensor cores (split2_fast, made once for every
    // warp): x = hi + lo exactly
    __shared__ __align__(16) unsigned qh[CH][KP], ql[CH][KP], kh[CH][KP], kl[CH][KP];
    __shared__ float vs[CH][D];
    __shared__ float zs[CH][D];                 // the output gate's input, widened
    __shared__ __align__(16) float pks[CH][D];  // S0^T k_t
    __shared__ __align__(16) float pqs[CH][D];  // S0^T q_t, then (the same thread, the same column) the readout
    float(*const os)[D] = pqs;                  // before the norm
    __shared__ __align__(16) float wsc[CH][D];  // the commit's update weights w_s
    __shared__ __align__(16) float wse[CH][D];  // the chunk end's (a window that goes on)
    __shared__ float gts[CH], bts[CH], gcum[CH];
    __shared__ float rat[CH][CH];
    __shared__ float part_qk[CH][2 * D / 16];
    __shared__ float akk[CH][CH], aqk[CH][CH];
    __shared__ float part_o[CH][D / 32];
#if GDN_PLANES
    __shared__ float ys[CH][D];
#endif

    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int h = blockIdx.x;
    const int sq_i = blockIdx.y;
#if GDN_GROUPED
    const int g = h / (HV / HK);
#else
    const int g = h % HK;
#endif
    const int fg = lane >> 2, fq = lane & 3;       // the lane's fragment row group and column pair
    const int c0 = 16 * warp + 2 * fg;             // its two state columns c0, c0 + 1
    const float inv_sqrt_d = 1.0f / sqrtf((float)D);

    int chan[NCH];
#pragma unroll
    for (int m = 0; m < NCH; ++m) {
        const int e = tid + m * NT;
        chan[m] = e < D ? g * D + e : e < 2 * D ? HK * D + g * D + (e - D) : e < NE ? 2 * HK * D + h * D + (e - 2 * D) : -1;
    }
    // the per-column work: column jc, the chunk's tokens TH hf .. TH hf + TH - 1 (threads hf < PCW)
    const int jc = PCW == 1 ? tid : tid % D, hf = PCW == 1 ? 0 : tid / D;
    const bool pcw = PCW == 1 ? tid < D : true;
    const float gam = pcw ? gamma[jc] : 0.0f;
    const float dth = dt[h];
    const float ah = ssm_a[h];

#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;");
#endif

    const int slot = seq_slot[sq_i];
    const int start = seq_start[sq_i];
    const int len = seq_len[sq_i];
#if GDN_COMMIT
    const int commit_in = seq_commit[sq_i];
#endif
    if (slot < 0) return;
    const bool report = tid == 0 && h == 0;
    if (slot >= n_slots) {
        if (report) atomicOr(fault, 1u);
        return;
    }
#if GDN_T > 0
    constexpr int T = GDN_T;
    if (len != T) {
        if (report) atomicOr(fault, 2u);
        return;
    }
#else
    const int T = len;
#endif
    if (T < 1 || start < 0 || start > n_rows - T) {
        if (report) atomicOr(fault, 4u);
        return;
    }
#if GDN_COMMIT
    const bool commit_ok = commit_in >= 0 && commit_in <= T;
    if (!commit_ok && report) atomicOr(fault, 8u);
    const int commit_at = commit_ok ? commit_in : 0;
#else
    constexpr int commit_at = 0;
#endif
    // the token-serial kernel's sequences (it reports their faults too): effective length outside the range
    {
        const int eff = commit_at > 0 ? commit_at : T;
        if (eff < GDN_WMIN || eff > GDN_WMAX || T < 2) return;
    }

    const EQ::T* qkv_b = qkv + (size_t)start * C_ALL;
    float* hist_head = hist + ((size_t)slot * HV + h) * (3 * D * 3);
    float hst[NCH][3];
#pragma unroll
    for (int m = 0; m < NCH; ++m) {
        if (chan[m] >= 0) {
            const int o = 3 * (tid + m * NT);
            hst[m][0] = hist_head[o];
            hst[m][1] = hist_head[o + 1];
            hst[m][2] = hist_head[o + 2];
        } else {
            hst[m][0] = hst[m][1] = hst[m][2] = 0.0f;
        }
    }

    // the state fragments (see the work split): st[s][0..3] = S[i][c0], S[i + 1][c0], S[i][c0 + 1], S[i + 1][c0 + 1],
    // i = 8 s + 2 fq
    ES::T* const sbase = state + (size_t)slot * D * HV * D;
    // element offsets of the pair (S[i][c], S[i + 1][c]) (value-major: contiguous) or (S[i][c0], S[i][c0 + 1])
    // (key-major: contiguous) of tile s
#if GDN_VMAJOR
    auto at = [&](int s, int c) { return ((size_t)h * D + c0 + c) * D + 8 * s + 2 * fq; };
#else
    auto at = [&](int s, int r) { return ((size_t)(8 * s + 2 * fq + r) * HV + h) * D + c0; };
#endif
    float st[KT][4];
#pragma unroll
    for (int s = 0; s < KT; ++s) {
#pragma unroll
        for (int p = 0; p < 2; ++p) {
#if GDN_STATE_DT == 0
            const float2 w = *reinterpret_cast<const float2*>(sbase + at(s, p));
            const float lo = w.x, hi = w.y;
#else
            const unsigned w = *reinterpret_cast<const unsigned*>(sbase + at(s, p));
            const float lo = __uint_as_float(w << 16), hi = __uint_as_float(w & 0xffff0000u);
#endif
#if GDN_VMAJOR
            st[s][2 * p] = lo;  // column c0 + p, keys i and i + 1
            st[s][2 * p + 1] = hi;
#else
            st[s][p] = lo;  // key i + p, columns c0 and c0 + 1
            st[s][p + 2] = hi;
#endif
        }
    }
#if GDN_AHEAD
    // the state of the block GDN_AHEAD places later in launch order into L2 (a block lives long: its successor
    // half a wave later then finds its state there); a hint only. Thread tid < D: key tid's row (key-major) or
    // column tid's keys (value-major) of that block's head
    {
        const unsigned lin = blockIdx.y * gridDim.x + blockIdx.x + GDN_AHEAD;
        const unsigned ay = lin / gridDim.x, ax = lin % gridDim.x;
        const int aslot = ay < gridDim.y ? seq_slot[ay] : -1;
        if (aslot >= 0 && aslot < n_slots && tid < D) {
            const ES::T* ab = state + (size_t)aslot * D * HV * D;
#if GDN_VMAJOR
            prefetch_l2(ab + ((size_t)ax * D + tid) * D, D * sizeof(ES::T));
#else
            prefetch_l2(ab + ((size_t)tid * HV + ax) * D, D * sizeof(ES::T));
#endif
        }
    }
#endif
    // stores tile s (v[0..3] in st's order), rounded once for a bf16 pool
    auto store_tile = [&](int s, const float* v) {
#pragma unroll
        for (int p = 0; p < 2; ++p) {
#if GDN_VMAJOR
            const float lo = v[2 * p], hi = v[2 * p + 1];
#else
            const float lo = v[p], hi = v[p + 2];
#endif
#if GDN_STATE_DT == 0
            *reinterpret_cast<float2*>(sbase + at(s, p)) = make_float2(lo, hi);
#else
            *reinterpret_cast<unsigned*>(sbase + at(s, p)) = (unsigned)ES::st(lo) | ((unsigned)ES::st(hi) << 16);
#endif
        }
    };

    for (int cb = 0; cb < T; cb += CH) {
        const int tc = T - cb < CH ? T - cb : CH;  // tokens of this chunk
        const size_t row0 = (size_t)start + cb;
        // the commit inside this chunk, as a count of its tokens (0: none here)
        const int cl = commit_at > cb && commit_at <= cb + CH ? commit_at - cb : 0;
        const bool more = cb + CH < T;

        // 1. every token's inputs in flight at once; conv + SiLU per channel, token after token
        EQ::T in[NCH][CH];
#pragma unroll
        for (int m = 0; m < NCH; ++m)
#pragma unroll
            for (int t = 0; t < CH; ++t)
                in[m][t] = chan[m] >= 0 && t < tc ? qkv_b[(size_t)(cb + t) * C_ALL + chan[m]] : (EQ::T)0;
        {
            constexpr int ZPT = (CH * D + NT - 1) / NT;
            EZ::T zv[ZPT];
#pragma unroll
            for (int u = 0; u < ZPT; ++u) {
                const int p = tid + u * NT;
                zv[u] = p < tc * D ? z[(row0 + p / D) * N_OUT + h * D + p % D] : (EZ::T)0;
            }
#pragma unroll
            for (int u = 0; u < ZPT; ++u) {
                const int p = tid + u * NT;
                if (p < tc * D) zs[p / D][p % D] = EZ::ld(zv[u]);
            }
        }
        if (tid >= NT - 2 * CH) {
            const int t = (tid - (NT - 2 * CH)) % CH;
            if (t < tc) {
                if (tid < NT - CH) gts[t] = softplus_decay(EA::ld(alpha[(row0 + t) * HV + h]) + dth, ah);
                else bts[t] = sigmoid_f(EB::ld(beta[(row0 + t) * HV + h]));
            }
        }
        float cvs[NCH][CH];
#pragma unroll
        for (int m = 0; m < NCH; ++m) {
            const int e = tid + m * NT;
            float4 w = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (chan[m] >= 0) w = __ldg(reinterpret_cast<const float4*>(conv_w) + chan[m]);
#pragma unroll
            for (int t = 0; t < CH; ++t) {
                float cv = 0.0f;
                if (chan[m] >= 0 && t < tc) {
                    float s = 0.0f;
                    s = fmaf(hst[m][0], w.x, s);
                    s = fmaf(hst[m][1], w.y, s);
                    s = fmaf(hst[m][2], w.z, s);
                    const float x = EQ::ld(in[m][t]);
                    s = fmaf(x, w.w, s);
                    cv = silu_w(s);
                    hst[m][0] = hst[m][1];
                    hst[m][1] = hst[m][2];
                    hst[m][2] = x;
                    if (e >= 2 * D) vs[t][e - 2 * D] = cv;
#if GDN_COMMIT
                    // the history after the commit token: this head's private copy, read only at the start
                    if (t + 1 == cl) {
                        hist_head[3 * e] = hst[m][0];
                        hist_head[3 * e + 1] = hst[m][1];
                        hist_head[3 * e + 2] = hst[m][2];
                    }
#endif
                }
                cvs[m][t] = cv;
                if (t < tc) {
                    float sq = e < 2 * D ? cv * cv : 0.0f;
                    sq += __shfl_xor_sync(0xffffffffu, sq, 8);
                    sq += __shfl_xor_sync(0xffffffffu, sq, 4);
                    sq += __shfl_xor_sync(0xffffffffu, sq, 2);
                    sq += __shfl_xor_sync(0xffffffffu, sq, 1);
                    if (e < 2 * D && (e & 15) == 0) part_qk[t][e >> 4] = sq;
                }
            }
        }
        __syncthreads();

        // 2. L2 norms, gate products
#pragma unroll
        for (int m = 0; m < NCH; ++m) {
            const int e = tid + m * NT;
            if (e < 2 * D) {
                const int base = e < D ? 0 : D / 16;
#pragma unroll
                for (int t = 0; t < CH; ++t) {
                    if (t < tc) {
                        float tot = 0.0f;
#pragma unroll
                        for (int c = 0; c < D / 16; ++c) tot += part_qk[t][base + c];
                        const float r = rsqrtf(tot / (float)D + eps / (float)D);
                        const float x = (r * cvs[m][t]) * inv_sqrt_d;
                        unsigned hi, lo;
                        split2_fast(x, hi, lo);
                        if (e < D) {
                            qh[t][e] = hi;
                            ql[t][e] = lo;
                        } else {
                            kh[t][e - D] = hi;
                            kl[t][e - D] = lo;
                        }
                    }
                }
            }
        }
        for (int p = tid; p < CH * CH + CH; p += NT) {
            if (p < CH * CH) {
                // r(t, s) = g_{s+1} ... g_t, in that order; r(t, t) = 1
                const int t = p / CH, s = p % CH;
                if (t < tc && s <= t) {
                    float q = 1.0f;
                    if (s < t) {
                        q = gts[s + 1];
                        for (int u = s + 2; u <= t; ++u) q = q * gts[u];
                    }
                    rat[t][s] = q;
                }
            } else {
                // G_t = g_0 ... g_t
                const int t = p - CH * CH;
                if (t < tc) {
                    float q = gts[0];
                    for (int u = 1; u <= t; ++u) q = q * gts[u];
                    gcum[t] = q;
                }
            }
        }
        __syncthreads();

        // 3. S0^T k_t and S0^T q_t for every token of the chunk on tensor cores: A = [K; Q] (rows fg and fg + 8:
        // the key and the query of token fg), B = the warp's state fragments; the big terms in two accumulators
        // (even and odd key tiles) and the small ones in a third, so the dependent chains are short, summed in
        // one fixed order. With the same A, B = K^T gives the chunk's dot products k_t . k_s and q_t . k_s (every
        // warp computes them, warp 0 stores them, times r(t, s))
        {
            float pb[2][2][4] = {}, ps[2][4] = {}, db[4] = {}, ds[4] = {};
            const bool live = fg < tc;
#pragma unroll
            for (int s = 0; s < KT; ++s) {
                const int i = 8 * s + 2 * fq;
                const uint2 z2 = make_uint2(0u, 0u);
                const uint2 kh2 = live ? *reinterpret_cast<const uint2*>(&kh[fg][i]) : z2;
                const uint2 kl2 = live ? *reinterpret_cast<const uint2*>(&kl[fg][i]) : z2;
                const uint2 qh2 = live ? *reinterpret_cast<const uint2*>(&qh[fg][i]) : z2;
                const uint2 ql2 = live ? *reinterpret_cast<const uint2*>(&ql[fg][i]) : z2;
                const unsigned ah[4] = {kh2.x, qh2.x, kh2.y, qh2.y}, al[4] = {kl2.x, ql2.x, kl2.y, ql2.y};
#pragma unroll
                for (int n = 0; n < 2; ++n) {
                    unsigned bh[2], bl[2];
                    split2_fast(st[s][2 * n], bh[0], bl[0]);
                    split2_fast(st[s][2 * n + 1], bh[1], bl[1]);
                    mma_tf32(ps[n], al[0], al[1], al[2], al[3], bh[0], bh[1]);
                    mma_tf32(ps[n], ah[0], ah[1], ah[2], ah[3], bl[0], bl[1]);
                    mma_tf32(pb[n][s & 1], ah[0], ah[1], ah[2], ah[3], bh[0], bh[1]);
                }
                // B = K^T: column g is token g's key, its k index q key i, q + 4 key i + 1 (the A loads above)
                mma_tf32(ds, al[0], al[1], al[2], al[3], kh2.x, kh2.y);
                mma_tf32(ds, ah[0], ah[1], ah[2], ah[3], kl2.x, kl2.y);
                mma_tf32(db, ah[0], ah[1], ah[2], ah[3], kh2.x, kh2.y);
            }
            float pr[2][4];
#pragma unroll
            for (int n = 0; n < 2; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) pr[n][e] = ps[n][e] + (pb[n][0][e] + pb[n][1][e]);
            // n-tile n, element e: row fg (e < 2: the key) or fg + 8 (the query), column 16 w + 2 (2 fq + e % 2) + n
            if (live) {
                const int j = 16 * warp + 4 * fq;
                *reinterpret_cast<float4*>(&pks[fg][j]) = make_float4(pr[0][0], pr[1][0], pr[0][1], pr[1][1]);
                *reinterpret_cast<float4*>(&pqs[fg][j]) = make_float4(pr[0][2], pr[1][2], pr[0][3], pr[1][3]);
            }
            // element e: k_t . k_s (e < 2) or q_t . k_s, t = fg, s = 2 fq + e % 2
            if (warp == 0 && live) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int t = fg, s = 2 * fq + e;
                    if (s < t) akk[t][s] = rat[t][s] * (ds[e] + db[e]);
                    if (s <= t) aqk[t][s] = rat[t][s] * (ds[2 + e] + db[2 + e]);
                }
            }
        }
        __syncthreads();

        // 4. PCW threads a column: the deltas by forward substitution (each), the readout and its squares of its
        // own tokens, the update weights (the first thread those of the commit, the last those of a chunk end the
        // window goes on from)
        if (pcw) {
            float dl[CH];
#pragma unroll
            for (int t = 0; t < CH; ++t) {
                dl[t] = 0.0f;
                if (t < tc) {
                    float x = vs[t][jc] - gcum[t] * pks[t][jc];
#pragma unroll
                    for (int s = 0; s < t; ++s) x = fmaf(-akk[t][s], dl[s], x);
                    dl[t] = x * bts[t];
                }
            }
#pragma unroll
            for (int u = 0; u < TH; ++u) {
                const int t = PCW == 1 ? u : TH * hf + u;
                if (t < tc) {
                    float x = gcum[t] * pqs[t][jc];
#pragma unroll
                    for (int s = 0; s < CH; ++s)
                        if (s <= t) x = fmaf(aqk[t][s], dl[s], x);
                    const float ov = x * inv_sqrt_d;
                    os[t][jc] = ov;
                    float osq = ov * ov;
#pragma unroll
                    for (int off = 16; off > 0; off >>= 1) osq += __shfl_xor_sync(0xffffffffu, osq, off);
                    if (lane == 0) part_o[t][jc / 32] = osq;
                }
            }
            // w_s = r(n - 1, s) d_s for the commit (n = cl) and for a chunk end the window goes on from
            auto weights = [&](int n, float (*ws)[D]) {
#pragma unroll
                for (int s = 0; s < CH; ++s)
                    if (s < n) ws[s][jc] = s + 1 < n ? rat[n - 1][s] * dl[s] : dl[s];
            };
            if (hf == 0 && cl > 0) weights(cl, wsc);
            if (hf == PCW - 1 && more && cl != tc) weights(tc, wse);
        }
        __syncthreads();

        // 5. gated RMS norm, y, planes (each thread its column and tokens; each in f32, rounded once)
        if (pcw) {
#pragma unroll
            for (int u = 0; u < TH; ++u) {
                const int t = PCW == 1 ? u : TH * hf + u;
                if (t < tc) {
                    const float tot = Tree<D / 32>::sum(part_o[t]);
                    const float rs = rsqrtf(tot / (float)D + eps);
                    const float zt = zs[t][jc];
#if GDN_SILU
                    const float act = zt * sigmoid_w(zt);
#else
                    const float act = sigmoid_w(zt);
#endif
                    const float yv = ((rs * os[t][jc]) * gam) * act;
                    const size_t yi = (row0 + t) * N_OUT + h * D + jc;
                    store_y<EO, GDN_PLANES != 0>(out, plane, yi, jc, yv);
#if GDN_PLANES
                    ys[t][jc] = yv;
#endif
                }
            }
        }

        // 6. the state after n tokens of the chunk, fmaf(G_{n-1}, S0, k_0 w_0 + ... + k_{n-1} w_{n-1}), the sum on
        // tensor cores (A = W^T: the warp's columns x tokens; B = K: tokens x the tile's keys; tokens >= n zero):
        // stored (the commit) and / or kept in the registers (the next chunk starts from it)
        auto advance = [&](int n, const float (*ws)[D], bool keep, bool store) {
            const float gn = gcum[n - 1];
            unsigned ah[4], al[4];
            {
                const float2 w0 = fq < n ? *reinterpret_cast<const float2*>(&ws[fq][c0]) : make_float2(0.0f, 0.0f);
                const float2 w1 = fq + 4 < n ? *reinterpret_cast<const float2*>(&ws[fq + 4][c0]) : make_float2(0.0f, 0.0f);
                split2_fast(w0.x, ah[0], al[0]);
                split2_fast(w0.y, ah[1], al[1]);
                split2_fast(w1.x, ah[2], al[2]);
                split2_fast(w1.y, ah[3], al[3]);
            }
#pragma unroll
            for (int s = 0; s < KT; ++s) {
                const int i = 8 * s + fg;
                const unsigned bh[2] = {fq < n ? kh[fq][i] : 0u, fq + 4 < n ? kh[fq + 4][i] : 0u};
                const unsigned bl[2] = {fq < n ? kl[fq][i] : 0u, fq + 4 < n ? kl[fq + 4][i] : 0u};
                float u[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                mma_tf32(u, al[0], al[1], al[2], al[3], bh[0], bh[1]);
                mma_tf32(u, ah[0], ah[1], ah[2], ah[3], bl[0], bl[1]);
                mma_tf32(u, ah[0], ah[1], ah[2], ah[3], bh[0], bh[1]);
#pragma unroll
                for (int e = 0; e < 4; ++e) u[e] = fmaf(gn, st[s][e], u[e]);
                if (store) store_tile(s, u);
                if (keep) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) st[s][e] = u[e];
                }
            }
        };
        // a commit inside a window that goes on is stored; the registers keep S0 until the chunk end's update
        if (cl > 0 && cl != tc) advance(cl, wsc, false, true);
        if (more || cl == tc) advance(tc, cl == tc ? wsc : wse, more, cl == tc);

#if GDN_PLANES
        __syncthreads();
        for (int p = tid; p < tc * (D / 16); p += NT) {
            const int t = p / (D / 16), q = p % (D / 16);
            float s_even = 0.0f, s_odd = 0.0f;
#pragma unroll
            for (int e = 0; e < 16; e += 2) {
                s_even += ys[t][16 * q + e];
                s_odd += ys[t][16 * q + e + 1];
            }
            out[4 * plane + (row0 + t) * (N_OUT / 16) + (h * D) / 16 + q] = EO::st(s_even + s_odd);
        }
#endif
        // the next chunk rewrites what this one's last steps read
        if (more) __syncthreads();
    }
}
