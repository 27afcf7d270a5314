// gdn_chunk.cu: the GDN window step (SPEC.md) of long windows in the chunked (WY / UT) form (see NOTES.md,
// "Chunked windows"). Four kernels, launched in this order on one stream:
//   gdn_chunk_plan   one block: splits the call's sequences by length (below GDN_MIN_LEN: left to the
//                    token-serial kernel, whose slot array it writes with the long ones skipped), checks the
//                    long ones and lists them and their chunks of L tokens
//   gdn_chunk_prep   one block a (chunk, value head): conv + SiLU (with the history), L2 norms, gates, the
//                    chunk's decays, A = strictly-lower(b_t D[t][s] k_t . k_s), M = lower(D[t][s] q_t . k_s),
//                    and by forward substitution W = (I + A)^-1 diag(b gamma) K, U = (I + A)^-1 diag(b) V
//   gdn_chunk_state  one block a (sequence, value head, block of CB value columns): the state slice, chunk after
//                    chunk: delta = U - W S, o = (gamma Q) S + M delta, S <- gamma_n S + sum_s D[n-1][s] k_s
//                    delta_s^T; the committed state (and the history) at the commit point
//   gdn_chunk_out    one block a (chunk, value head): the gated RMS norm of o, y, planes, group sums
//
// Macros (src/chunk.rs): GDN_D, GDN_HK, GDN_HV, GDN_SILU, GDN_GROUPED, GDN_PLANES, the element types
// GDN_QKV_DT .. GDN_OUT_DT (0 f32, 1 bf16, 2 f16), GDN_STATE_DT (0 f32, 1 bf16), GDN_VMAJOR (state layout),
// GDN_L (chunk length), GDN_CB (value columns a state block owns).
//
// Bits. Chunk boundaries are at multiples of L from the window start, and every value of token t of a chunk
// depends only on the chunk's tokens up to t (loops over earlier tokens end at t, never at the chunk's
// length), so the first n tokens of a chunk compute the same bits whatever follows them. The state after the
// first n tokens of a chunk is one function, upd(n), used both for a chunk's end and for a commit point inside
// it: a commit after k tokens of a longer window is bitwise the state of a k-token window through this path.
// Every reduction has a fixed order (no atomics in sums), the program is compiled with --fmad=false and every
// fused multiply-add is an explicit fmaf.
//
// Scratch (floats, row r of the call, value head h): W, U, Q (gamma_t q_t), K (k_t), O (o before the norm)
// [r][HV][D] each, M [r][HV][L], G (gates) [r][HV]; rc rows each. The plan (ints): [0] long sequences, [1]
// chunks, then the token-serial slot array [n_seqs], per long sequence (slot, start, len, commit) [cap_long][4],
// per chunk (long sequence, chunk index) [cap_ent][2].

#define D GDN_D
#define HK GDN_HK
#define HV GDN_HV
#define L GDN_L
#define CB GDN_CB
#define NCB2 (D / CB)
#define C_ALL ((2 * HK + HV) * D)
#define N_OUT (HV * D)
#define DP (D + 1)
#define LP (L + 1)
#define NT_PREP 256
#define NT_STATE 256
#define NT_OUT 128
#define PAIRS_STATE ((L * CB + NT_STATE - 1) / NT_STATE)

static_assert(D % 16 == 0, "d must be a multiple of 16");
static_assert(D % CB == 0, "whole column blocks");
static_assert(HV % HK == 0, "h_v must be a multiple of h_k");

template <int K> struct Elt;
template <> struct Elt<0> {
    typedef float T;
    static __device__ __forceinline__ float ld(float x) { return x; }
    static __device__ __forceinline__ float st(float v) { return v; }
};
template <> struct Elt<1> {
    typedef unsigned short T;
    static __device__ __forceinline__ float ld(unsigned short b) { return __uint_as_float((unsigned)b << 16); }
    static __device__ __forceinline__ unsigned short st(float v) {
        unsigned short r;
        asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(v));
        return r;
    }
};
template <> struct Elt<2> {
    typedef unsigned short T;
    static __device__ __forceinline__ float ld(unsigned short b) {
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(b));
        return f;
    }
    static __device__ __forceinline__ unsigned short st(float v) {
        unsigned short r;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(v));
        return r;
    }
};
typedef Elt<GDN_QKV_DT> EQ;
typedef Elt<GDN_ALPHA_DT> EA;
typedef Elt<GDN_BETA_DT> EB;
typedef Elt<GDN_Z_DT> EZ;
typedef Elt<GDN_OUT_DT> EO;
typedef Elt<GDN_STATE_DT> ES;

__device__ __forceinline__ float sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }

__device__ __forceinline__ float softplus_decay(float u, float a) {
    const float ex = expf(u);
    const float w = 1.0f + ex;
    const float sp = u > 20.0f ? u : (w == 1.0f ? ex : logf(w) * ex / (w - 1.0f));
    return expf(sp * a);
}

// Row t of the chunk's decays: out[s] = D[t][s] = g_{s+1} ... g_t for s <= t (D[t][t] = 1), from the chunk's
// gates g[0..t]; returns gamma_t = D[t][0] g_0 (the decay of the chunk's initial state through token t).
// One sequential product a row, the same code in the prep and state kernels, so both get the same bits.
__device__ __forceinline__ float decay_row(const float* g, int t, float* out) {
    float p = 1.0f;
    out[t] = p;
    for (int s = t - 1; s >= 0; --s) {
        p = p * g[s + 1];
        out[s] = p;
    }
    return p * g[0];
}

// the key head of value head h
__device__ __forceinline__ int key_head(int h) {
#if GDN_GROUPED
    return h / (HV / HK);
#else
    return h % HK;
#endif
}

// channel of entry e of value head h's list: q 0..D, k D..2D, v 2D..3D (the history's [3][D] order)
__device__ __forceinline__ int channel(int h, int e) {
    const int g = key_head(h);
    return e < D ? g * D + e : e < 2 * D ? HK * D + g * D + (e - D) : 2 * HK * D + h * D + (e - 2 * D);
}

#define PLAN_SLOT 2
#define PLAN_LONG(n_seqs) (2 + (n_seqs))
#define PLAN_ENT(n_seqs, cap_long) (2 + (n_seqs) + 4 * (cap_long))

// ---------------------------------------------------------------------------------------------------------
// The plan. One block of 1024 threads; thread i takes a contiguous run of sequences, so the lists keep the
// call's order. A long sequence whose slot is past the pool, whose rows leave the call's or whose commit point
// is outside 0..=len is skipped (its commit, for the last) and reported in the fault word, as the token-serial
// kernel does for the others. More long sequences or chunks than the caps (only possible with overlapping rows,
// which the host path rejects) are dropped and reported as rows outside the step's.
extern "C" __global__ void __launch_bounds__(1024) gdn_chunk_plan(
    const int* __restrict__ seq_slot, const int* __restrict__ seq_start, const int* __restrict__ seq_len,
    const int* __restrict__ seq_commit, int commits, int n_seqs, int n_slots, int n_rows, int min_len,
    int cap_long, int cap_ent, int* __restrict__ plan, unsigned* __restrict__ fault) {
    __shared__ long long warp_l[32], warp_e[32];
    __shared__ int keep_l, keep_e;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int per = (n_seqs + 1023) / 1024;
    const int s0 = min(tid * per, n_seqs), s1 = min(s0 + per, n_seqs);
    unsigned bad = 0;
    long long nl = 0, ne = 0;
    // pass 1: count (and write the token-serial slot array)
    for (int s = s0; s < s1; ++s) {
        const int slot = seq_slot[s], len = seq_len[s];
        const bool is_long = slot >= 0 && len >= min_len;
        plan[PLAN_SLOT + s] = is_long ? -1 : slot;
        if (!is_long) continue;
        const int start = seq_start[s];
        if (slot >= n_slots) {
            bad |= 1u;
            continue;
        }
        if (start < 0 || start > n_rows - len) {
            bad |= 4u;
            continue;
        }
        nl += 1;
        ne += (len + L - 1) / L;
    }
    // exclusive scan of (nl, ne) over threads, in thread order
    long long il = nl, ie = ne;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        const long long a = __shfl_up_sync(0xffffffffu, il, off), b = __shfl_up_sync(0xffffffffu, ie, off);
        if (lane >= off) {
            il += a;
            ie += b;
        }
    }
    if (lane == 31) {
        warp_l[warp] = il;
        warp_e[warp] = ie;
    }
    if (tid == 0) {
        keep_l = 0x7fffffff;
        keep_e = 0x7fffffff;
    }
    __syncthreads();
    long long bl = 0, be = 0, tl = 0, te = 0;
    for (int w = 0; w < 32; ++w) {
        if (w < warp) {
            bl += warp_l[w];
            be += warp_e[w];
        }
        tl += warp_l[w];
        te += warp_e[w];
    }
    long long ol = bl + il - nl, oe = be + ie - ne;
    // pass 2: write the lists
    int* const longs = plan + PLAN_LONG(n_seqs);
    int* const ents = plan + PLAN_ENT(n_seqs, cap_long);
    for (int s = s0; s < s1; ++s) {
        const int slot = seq_slot[s], len = seq_len[s];
        if (!(slot >= 0 && len >= min_len)) continue;
        const int start = seq_start[s];
        if (slot >= n_slots || start < 0 || start > n_rows - len) continue;
        const int nch = (len + L - 1) / L;
        if (ol >= cap_long || oe + nch > cap_ent) {
            bad |= 4u;
            atomicMin(&keep_l, (int)min(ol, (long long)cap_long));
            atomicMin(&keep_e, (int)min(oe, (long long)cap_ent));
            ol += 1;
            oe += nch;
            continue;
        }
        int commit = 0;
        if (commits) {
            const int c = seq_commit[s];
            if (c >= 0 && c <= len) commit = c;
            else bad |= 8u;
        }
        int* li = longs + 4 * ol;
        li[0] = slot;
        li[1] = start;
        li[2] = len;
        li[3] = commit;
        for (int c = 0; c < nch; ++c) {
            ents[2 * (oe + c)] = (int)ol;
            ents[2 * (oe + c) + 1] = c;
        }
        ol += 1;
        oe += nch;
    }
    if (bad) atomicOr(fault, bad);
    __syncthreads();
    if (tid == 0) {
        plan[0] = (int)min(tl, (long long)keep_l);
        plan[1] = (int)min(te, (long long)keep_e);
    }
}

// ---------------------------------------------------------------------------------------------------------
// Everything of one chunk that does not depend on the state. Shared memory (floats): q, k, v [L][DP], A [L][LP]
// (first the decays D[t][s], then A in place), gates, write strengths, gamma [L] each.
#define PREP_SMEM (3 * L * DP + L * LP + 3 * L)
extern "C" __global__ void __launch_bounds__(NT_PREP) gdn_chunk_prep(
    const EQ::T* __restrict__ qkv, const EA::T* __restrict__ alpha, const EB::T* __restrict__ beta,
    const float* __restrict__ hist, const float* __restrict__ conv_w, const float* __restrict__ dt,
    const float* __restrict__ ssm_a, const int* __restrict__ plan, int n_seqs, int cap_long, float eps,
    float* __restrict__ scr, long long rc) {
    extern __shared__ float sm[];
    float* const qs = sm;
    float* const ks = qs + L * DP;
    float* const vs = ks + L * DP;
    float* const as = vs + L * DP;
    float* const gs = as + L * LP;
    float* const bs = gs + L;
    float* const gam = bs + L;

    const int ent = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
    if (ent >= plan[1]) return;
    const int* e2 = plan + PLAN_ENT(n_seqs, cap_long) + 2 * ent;
    const int li = e2[0], c = e2[1];
    const int* inf = plan + PLAN_LONG(n_seqs) + 4 * li;
    const int slot = inf[0], start = inf[1], len = inf[2];
    const int t0 = c * L;
    const int n = min(L, len - t0);
    const size_t rbase = (size_t)start + t0;
    const float* hh = hist + ((size_t)slot * HV + h) * (3 * D * 3);
    const float inv_sqrt_d = 1.0f / sqrtf((float)D);

    float* const W = scr;
    float* const U = W + (size_t)rc * HV * D;
    float* const Q = U + (size_t)rc * HV * D;
    float* const K = Q + (size_t)rc * HV * D;
    float* const M = K + 2 * (size_t)rc * HV * D;  // after O
    float* const G = M + (size_t)rc * HV * L;

    // 1. conv + SiLU of the head's 3 D channels, token by token as the spec's step 1
    for (int idx = tid; idx < n * 3 * D; idx += NT_PREP) {
        const int t = idx / (3 * D), e = idx % (3 * D);
        const int ch = channel(h, e);
        const float4 w = __ldg(reinterpret_cast<const float4*>(conv_w) + ch);
        const int tau = t0 + t;
        float x[4];
#pragma unroll
        for (int m = 0; m < 4; ++m) {
            const int u = tau - 3 + m;
            x[m] = u >= 0 ? EQ::ld(qkv[((size_t)start + u) * C_ALL + ch]) : hh[e * 3 + 3 + u];
        }
        float s = 0.0f;
        s = fmaf(x[0], w.x, s);
        s = fmaf(x[1], w.y, s);
        s = fmaf(x[2], w.z, s);
        s = fmaf(x[3], w.w, s);
        const float cv = s / (1.0f + expf(-s));
        float* dst = e < D ? qs : e < 2 * D ? ks : vs;
        dst[t * DP + e % D] = cv;
    }
    if (tid < n) {
        const size_t r = rbase + tid;
        gs[tid] = softplus_decay(EA::ld(alpha[r * HV + h]) + dt[h], ssm_a[h]);
        bs[tid] = sigmoid_f(EB::ld(beta[r * HV + h]));
    }
    __syncthreads();

    // 2. L2 norms of q and k: a warp a (token, q or k); lane-strided partial sums, then an xor butterfly
    {
        const int lane = tid & 31, warp = tid >> 5;
        for (int p = warp; p < 2 * n; p += NT_PREP / 32) {
            float* x = (p & 1 ? ks : qs) + (p >> 1) * DP;
            float acc = 0.0f;
            for (int i = lane; i < D; i += 32) acc = fmaf(x[i], x[i], acc);
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
            const float r = rsqrtf(acc / (float)D + eps / (float)D);
            for (int i = lane; i < D; i += 32) x[i] = (r * x[i]) * inv_sqrt_d;
        }
    }
    // 3. the decay rows, one thread a token
    if (tid < n) gam[tid] = decay_row(gs, tid, as + tid * LP);
    __syncthreads();

    // 4. A and M over the pairs s <= t (any thread may take a pair: its value depends on the pair only)
    for (int p = tid; p < n * n; p += NT_PREP) {
        const int t = p / n, s = p % n;
        const size_t r = rbase + t;
        if (s > t) {
            M[(r * HV + h) * L + s] = 0.0f;
            continue;
        }
        float kk = 0.0f, qk = 0.0f;
        for (int i = 0; i < D; ++i) {
            kk = fmaf(ks[t * DP + i], ks[s * DP + i], kk);
            qk = fmaf(qs[t * DP + i], ks[s * DP + i], qk);
        }
        const float dd = as[t * LP + s];
        M[(r * HV + h) * L + s] = dd * qk;
        as[t * LP + s] = s < t ? bs[t] * (dd * kk) : 0.0f;
    }
    if (tid < n) G[(rbase + tid) * HV + h] = gs[tid];
    __syncthreads();

    // 5. Q = gamma q, K = k to the scratch; the right-hand sides (b gamma) k and b v in place
    for (int idx = tid; idx < n * D; idx += NT_PREP) {
        const int t = idx / D, i = idx % D;
        const size_t o = ((rbase + t) * HV + h) * D + i;
        const float kt = ks[t * DP + i];
        Q[o] = gam[t] * qs[t * DP + i];
        K[o] = kt;
        ks[t * DP + i] = (bs[t] * gam[t]) * kt;
        vs[t * DP + i] = bs[t] * vs[t * DP + i];
    }
    __syncthreads();

    // 6. forward substitution, one thread a column of [W | U]: x_t - sum_{s<t} A[t][s] x_s, rows in order
    for (int col = tid; col < 2 * D; col += NT_PREP) {
        float* x = col < D ? ks : vs;
        float* dst = col < D ? W : U;
        const int ci = col % D;
        for (int t = 0; t < n; ++t) {
            float acc = x[t * DP + ci];
            for (int s = 0; s < t; ++s) acc = fmaf(-as[t * LP + s], x[s * DP + ci], acc);
            x[t * DP + ci] = acc;
            dst[((rbase + t) * HV + h) * D + ci] = acc;
        }
    }
}

// ---------------------------------------------------------------------------------------------------------
// The recurrence over chunks for one column block of one value head. Shared memory (floats): S [D][CB], W, Q, K
// tiles [L][D], U and delta [L][CB], M [L][L], gates and two decay rows [L].
#define STATE_SMEM (D * CB + 3 * L * D + 2 * L * CB + L * L + 3 * L)
extern "C" __global__ void __launch_bounds__(NT_STATE) gdn_chunk_state(
    ES::T* __restrict__ state, float* __restrict__ hist, const EQ::T* __restrict__ qkv,
    const int* __restrict__ plan, int n_seqs, int cap_long, float* __restrict__ scr, long long rc) {
    extern __shared__ float sm[];
    float* const ss = sm;
    float* const wt = ss + D * CB;
    float* const qt = wt + L * D;
    float* const kt = qt + L * D;
    float* const ut = kt + L * D;
    float* const dl = ut + L * CB;
    float* const mt = dl + L * CB;
    float* const gsm = mt + L * L;
    float* const dec = gsm + L;
    float* const decc = dec + L;
    __shared__ float gam_s[2];

    const int li = blockIdx.y, tid = threadIdx.x;
    if (li >= plan[0]) return;
    const int h = blockIdx.x / NCB2, cb = blockIdx.x % NCB2;
    const int* inf = plan + PLAN_LONG(n_seqs) + 4 * li;
    const int slot = inf[0], start = inf[1], len = inf[2], commit = inf[3];
    const float inv_sqrt_d = 1.0f / sqrtf((float)D);

    const float* const W = scr;
    const float* const U = W + (size_t)rc * HV * D;
    const float* const Q = U + (size_t)rc * HV * D;
    const float* const K = Q + (size_t)rc * HV * D;
    float* const O = scr + 4 * (size_t)rc * HV * D;
    const float* const M = O + (size_t)rc * HV * D;
    const float* const G = M + (size_t)rc * HV * L;

    ES::T* const sbase = state + (size_t)slot * D * HV * D;
#if GDN_VMAJOR
#define SIDX(i, j) (((size_t)h * D + (j)) * D + (i))
#else
#define SIDX(i, j) (((size_t)(i) * HV + h) * D + (j))
#endif
    for (int idx = tid; idx < D * CB; idx += NT_STATE) {
        const int i = idx / CB, cc = idx % CB;
        ss[idx] = ES::ld(sbase[SIDX(i, cb * CB + cc)]);
    }

    const int nch = (len + L - 1) / L;
    const int cchunk = commit > 0 ? (commit - 1) / L : -1;
    const int ncommit = commit - cchunk * L;
    for (int c = 0; c < nch; ++c) {
        const int t0 = c * L;
        const int n = min(L, len - t0);
        const size_t rbase = (size_t)start + t0;
        // the chunk's tiles
        for (int idx = tid; idx < n * D; idx += NT_STATE) {
            const int t = idx / D, i = idx % D;
            const size_t o = ((rbase + t) * HV + h) * D + i;
            wt[idx] = W[o];
            qt[idx] = Q[o];
            kt[idx] = K[o];
        }
        for (int idx = tid; idx < n * CB; idx += NT_STATE) {
            const int t = idx / CB, cc = idx % CB;
            ut[idx] = U[((rbase + t) * HV + h) * D + cb * CB + cc];
        }
        for (int idx = tid; idx < n * n; idx += NT_STATE) {
            const int t = idx / n, s = idx % n;
            mt[t * L + s] = M[((rbase + t) * HV + h) * L + s];
        }
        if (tid < n) gsm[tid] = G[(rbase + tid) * HV + h];
        __syncthreads();
        // the decay rows of the chunk's end and of a commit inside it (read only after the next barrier)
        const bool need_upd = c + 1 < nch || c == cchunk;
        if (tid == 0 && need_upd) gam_s[0] = decay_row(gsm, n - 1, dec);
        if (tid == 32 && c == cchunk) gam_s[1] = decay_row(gsm, ncommit - 1, decc);

        // delta = U - W S and the inter-chunk readout (gamma q) S, a thread a few (token, column) pairs
        float oreg[PAIRS_STATE];
#pragma unroll
        for (int k = 0; k < PAIRS_STATE; ++k) {
            const int p = tid + k * NT_STATE;
            oreg[k] = 0.0f;
            if (p < n * CB) {
                const int t = p / CB, cc = p % CB;
                float aw = 0.0f, aq = 0.0f;
                for (int i = 0; i < D; ++i) {
                    const float sv = ss[i * CB + cc];
                    aw = fmaf(wt[t * D + i], sv, aw);
                    aq = fmaf(qt[t * D + i], sv, aq);
                }
                dl[p] = ut[p] - aw;
                oreg[k] = aq;
            }
        }
        __syncthreads();
        // the intra-chunk readout: o_t = ((gamma q) S + sum_{s<=t} M[t][s] delta_s) / sqrt(d)
#pragma unroll
        for (int k = 0; k < PAIRS_STATE; ++k) {
            const int p = tid + k * NT_STATE;
            if (p < n * CB) {
                const int t = p / CB, cc = p % CB;
                float acc = oreg[k];
                for (int s = 0; s <= t; ++s) acc = fmaf(mt[t * L + s], dl[s * CB + cc], acc);
                O[((rbase + t) * HV + h) * D + cb * CB + cc] = acc * inv_sqrt_d;
            }
        }
        // the state after the first m tokens of the chunk: upd(m) = gamma S + sum_{s<m} (D[m-1][s] k_s) delta_s
        if (need_upd) {
            for (int idx = tid; idx < D * CB; idx += NT_STATE) {
                const int i = idx / CB, cc = idx % CB;
                const float so = ss[idx];
                if (c == cchunk) {
                    float acc = 0.0f;
                    for (int s = 0; s < ncommit; ++s) acc = fmaf(decc[s] * kt[s * D + i], dl[s * CB + cc], acc);
                    sbase[SIDX(i, cb * CB + cc)] = ES::st(fmaf(gam_s[1], so, acc));
                }
                if (c + 1 < nch) {
                    float acc = 0.0f;
                    for (int s = 0; s < n; ++s) acc = fmaf(dec[s] * kt[s * D + i], dl[s * CB + cc], acc);
                    ss[idx] = fmaf(gam_s[0], so, acc);
                }
            }
        }
        __syncthreads();
    }

    // the conv history after the commit token: the last three of (old history, the window's raw inputs)
    if (commit > 0 && cb == 0) {
        float* hh = hist + ((size_t)slot * HV + h) * (3 * D * 3);
        for (int e = tid; e < 3 * D; e += NT_STATE) {
            const int ch = channel(h, e);
            const float o0 = hh[e * 3], o1 = hh[e * 3 + 1], o2 = hh[e * 3 + 2];
            float nv[3];
#pragma unroll
            for (int m = 0; m < 3; ++m) {
                const int u = commit - 3 + m;
                const int oi = m + commit;
                nv[m] = u >= 0 ? EQ::ld(qkv[((size_t)start + u) * C_ALL + ch]) : (oi == 0 ? o0 : oi == 1 ? o1 : o2);
            }
            hh[e * 3] = nv[0];
            hh[e * 3 + 1] = nv[1];
            hh[e * 3 + 2] = nv[2];
        }
    }
}

// ---------------------------------------------------------------------------------------------------------
// The gated RMS norm, y, planes and group sums of one chunk of one value head: a warp a token.
extern "C" __global__ void __launch_bounds__(NT_OUT) gdn_chunk_out(
    const EZ::T* __restrict__ z, const float* __restrict__ gamma, EO::T* __restrict__ out, long long plane,
    const int* __restrict__ plan, int n_seqs, int cap_long, float eps, const float* __restrict__ scr,
    long long rc) {
#if GDN_PLANES
    __shared__ float ys[NT_OUT / 32][D];
#endif
    const int ent = blockIdx.x, h = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    if (ent >= plan[1]) return;
#if GDN_PLANES == 0
    (void)plane;
#endif
    const int* e2 = plan + PLAN_ENT(n_seqs, cap_long) + 2 * ent;
    const int li = e2[0], c = e2[1];
    const int* inf = plan + PLAN_LONG(n_seqs) + 4 * li;
    const int start = inf[1], len = inf[2];
    const int t0 = c * L;
    const int n = min(L, len - t0);
    const float* const O = scr + 4 * (size_t)rc * HV * D;
    for (int t = warp; t < n; t += NT_OUT / 32) {
        const size_t r = (size_t)start + t0 + t;
        const float* o = O + (r * HV + h) * D;
        float acc = 0.0f;
        for (int j = lane; j < D; j += 32) acc = fmaf(o[j], o[j], acc);
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
        const float rs = rsqrtf(acc / (float)D + eps);
        for (int j = lane; j < D; j += 32) {
            const float zt = EZ::ld(z[r * N_OUT + h * D + j]);
#if GDN_SILU
            const float act = zt * sigmoid_f(zt);
#else
            const float act = sigmoid_f(zt);
#endif
            const float yv = ((rs * o[j]) * gamma[j]) * act;
            const size_t yi = r * N_OUT + h * D + j;
            out[yi] = EO::st(yv);
#if GDN_PLANES
            const int jj = j & 15;
            out[plane + yi] = EO::st(yv * __int_as_float((127 - 2 * (jj & 7)) << 23));
            out[2 * plane + yi] = EO::st(yv * __int_as_float((127 - 8 * (jj & 3)) << 23));
            out[3 * plane + yi] = EO::st((jj & 1) ? yv * 0.00390625f : yv);
            ys[warp][j] = yv;
#endif
        }
#if GDN_PLANES
        __syncwarp();
        for (int q = lane; q < D / 16; q += 32) {
            float s_even = 0.0f, s_odd = 0.0f;
#pragma unroll
            for (int e = 0; e < 16; e += 2) {
                s_even += ys[warp][16 * q + e];
                s_odd += ys[warp][16 * q + e + 1];
            }
            out[4 * plane + r * (N_OUT / 16) + (h * D) / 16 + q] = EO::st(s_even + s_odd);
        }
        __syncwarp();
#endif
    }
}
