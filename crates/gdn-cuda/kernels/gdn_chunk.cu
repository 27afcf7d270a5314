// gdn_chunk.cu: the GDN window step (SPEC.md) of long windows in the chunked (WY / UT) form (see NOTES.md,
// "Chunked windows"). Four kernels, launched in this order on one stream:
//   gdn_chunk_plan   one block: splits the call's sequences by length and commit point (below min_len: left
//                    to the token-serial kernel, whose slot array it writes with the long ones skipped), checks the
//                    long ones and lists them and their chunks of L tokens
//   gdn_chunk_prep   one block a (chunk, value head): conv + SiLU (with the history), L2 norms, gates, the
//                    chunk's decays, A = strictly-lower(b_t D[t][s] k_t . k_s), M = lower(D[t][s] q_t . k_s),
//                    and by forward substitution W = (I + A)^-1 diag(b gamma) K, U = (I + A)^-1 diag(b) V
//   gdn_chunk_state  one block a (sequence, value head, block of CB value columns): the state slice, chunk after
//                    chunk: delta = U - W S, o = (gamma Q) S + M delta, S <- gamma_n S + sum_s D[n-1][s] k_s
//                    delta_s^T; the committed state (and the history) at the commit point
//   gdn_chunk_out    one block a (chunk, value head): the gated RMS norm of o, y, planes, group sums
//
// Macros (src/chunk.rs): GDN_D, GDN_HK, GDN_HV, GDN_SILU, GDN_GROUPED, GDN_PLANES, GDN_NT_OUT (threads of an out
// block: ChunkSpec::out_threads), the element types
// GDN_QKV_DT .. GDN_OUT_DT (0 f32, 1 bf16, 2 f16), GDN_STATE_DT (0 f32, 1 bf16), GDN_VMAJOR (state layout),
// GDN_L (chunk length), GDN_CB (value columns a state block owns), GDN_TF32X1 (one TF32 product a step),
// GDN_NARROW (1: also the narrow state kernel, 16 columns a block),
// GDN_EXT (1: memory an engine owns, as gdn_step.cu's EXTERNAL: row and slot strides, the engine's conv state
// in GDN_CONV_DT; 0: the pool's packed rows and private history).
//
// EXTERNAL (GDN_EXT 1). The conv state holds one copy of each channel's history per slot, read by the prep
// blocks of chunk 0 (every value head of a key head reads its q / k history). The state kernel starts after the
// prep kernel has finished (stream order), so its blocks may overwrite the history freely: at the commit point
// the first value head of each key head writes the new q / k history, each value head its v history (the block
// of column block 0), rounded to GDN_CONV_DT. Sequences: seq_start / seq_len, or seq_start = cu_seqlens and
// seq_len = null, or seq_start = null (rows packed in sequence order from row 0; the plan sums the lengths);
// seq_commit null: every sequence commits its whole window.
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
#define C_ALL ((2 * HK + HV) * D)
#define N_OUT (HV * D)
#define NT_PREP 256
#define NT_STATE 256
#define NT_OUT GDN_NT_OUT

static_assert(D % 16 == 0, "d must be a multiple of 16");
static_assert(D % GDN_CB == 0, "whole column blocks");
static_assert(HV % HK == 0, "h_v must be a multiple of h_k");

// Element types (Elt<code>): kernels/gdn_elt.cuh, prepended to this source.
typedef Elt<GDN_QKV_DT> EQ;
typedef Elt<GDN_ALPHA_DT> EA;
typedef Elt<GDN_BETA_DT> EB;
typedef Elt<GDN_Z_DT> EZ;
typedef Elt<GDN_OUT_DT> EO;
typedef Elt<GDN_STATE_DT> ES;

// engine memory's strides (GdnExt, QKV_RS .. SLOT_OFF): kernels/gdn_elt.cuh; its ctr is not used here
#if GDN_EXT
#define EXT_PARAM , const GdnExt ext
#define EXT_ARG , ext
#else
#define EXT_PARAM
#define EXT_ARG
#endif

// A sequence's history before its window: column col (0 oldest) of entry e (channel ch) of value head h's list.
struct HistIn {
#if GDN_EXT
    const EC::T* base;  // the slot's column w - 3
    unsigned long long cs, ls;
    __device__ __forceinline__ float at(int ch, int, int col) const { return EC::ld(base[ch * cs + col * ls]); }
#else
    const float* hh;  // the value head's private [3 D][3]
    __device__ __forceinline__ float at(int, int e, int col) const { return hh[e * 3 + col]; }
#endif
};

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

// dec[s] = g[m-1] g[m-2] ... g[s+1] for s < m: decay_row's row m - 1, the same products in the same order, one
// entry (a thread each; unrolled, so the gates' loads wait for no product)
__device__ __forceinline__ float decay_of(const float* g, int m, int s) {
    float gr[L];
#pragma unroll
    for (int r = 0; r < L; ++r) gr[r] = g[r];
    float p = 1.0f;
#pragma unroll
    for (int r = L - 1; r >= 1; --r)
        if (r < m && r > s) p = p * gr[r];
    return p;
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

// whether value head h is the first of its key head's (the one that writes the shared q / k history)
__device__ __forceinline__ bool first_of_key_head(int h) {
#if GDN_GROUPED
    return h % (HV / HK) == 0;
#else
    return h < HK;
#endif
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
// A window runs chunked when it has at least min_len tokens and so has its commit point, if it commits inside
// the window: a commit after k < min_len tokens keeps the whole window token-serial, so its committed state is
// bitwise that of a k-token window (which runs token-serial). A commit point outside 0..=len runs chunked and is
// reported below. With a uniform length (the call's hint, 0: none) a live sequence of another length is skipped
// and reported (fault 2) by the plan, as the token-serial kernel compiled for that length would.
__device__ __forceinline__ int commit_of(const int* seq_commit, int s, int len) {
    return seq_commit ? seq_commit[s] : len;
}
__device__ __forceinline__ bool runs_chunked(const int* seq_commit, int commits, int s, int slot, int len,
                                             int min_len, int uniform) {
    if (slot < 0 || len < min_len || (uniform > 0 && len != uniform)) return false;
    if (!commits) return true;
    const int c = commit_of(seq_commit, s, len);
    return c <= 0 || c > len || c >= min_len;
}

// Sequence s's rows: start / len arrays, cu_seqlens (seq_len null) or lengths alone (seq_start null: `pos`, the
// lengths before s summed, and `pos_bad`, whether one of them is not positive, which makes the start invalid;
// both advanced past s, so a thread calls it for its sequences in order).
__device__ __forceinline__ void rows_of(const int* seq_start, const int* seq_len, int s, long long& pos,
                                        bool& pos_bad, int& start, int& len) {
    if (!seq_len) {
        start = seq_start[s];
        len = seq_start[s + 1] - start;
    } else if (seq_start) {
        start = seq_start[s];
        len = seq_len[s];
    } else {
        len = seq_len[s];
        start = pos_bad || pos > 0x7fffffff ? -1 : (int)pos;
        pos += len;
        pos_bad |= len < 1;
    }
}

// exclusive scan over the block's 1024 threads, in thread order, of two counts; also their totals
__device__ __forceinline__ void scan2(long long a, long long b, long long* wa, long long* wb, long long& oa,
                                     long long& ob, long long& ta, long long& tb) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    long long ia = a, ib = b;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        const long long x = __shfl_up_sync(0xffffffffu, ia, off), y = __shfl_up_sync(0xffffffffu, ib, off);
        if (lane >= off) {
            ia += x;
            ib += y;
        }
    }
    if (lane == 31) {
        wa[warp] = ia;
        wb[warp] = ib;
    }
    __syncthreads();
    long long ba = 0, bb = 0;
    ta = tb = 0;
    for (int w = 0; w < 32; ++w) {
        if (w < warp) {
            ba += wa[w];
            bb += wb[w];
        }
        ta += wa[w];
        tb += wb[w];
    }
    oa = ba + ia - a;
    ob = bb + ib - b;
    __syncthreads();  // wa / wb may be reused
}

extern "C" __global__ void __launch_bounds__(1024) gdn_chunk_plan(
    const int* __restrict__ seq_slot, const int* __restrict__ seq_start, const int* __restrict__ seq_len,
    const int* __restrict__ seq_commit, int commits, int n_seqs, int n_slots, int n_rows, int min_len,
    int uniform, int cap_long, int cap_ent, int* __restrict__ plan, unsigned* __restrict__ fault) {
    __shared__ long long warp_l[32], warp_e[32];
    __shared__ int keep_l, keep_e;
    const int tid = threadIdx.x;
    const int per = (n_seqs + 1023) / 1024;
    const int s0 = min(tid * per, n_seqs), s1 = min(s0 + per, n_seqs);
    if (tid == 0) {
        keep_l = 0x7fffffff;
        keep_e = 0x7fffffff;
    }
    // lengths alone: the rows before this thread's run, and whether a length among them is not positive
    long long pos0 = 0;
    bool bad0 = false;
    if (!seq_start) {
        long long sum = 0, nbad = 0;
        for (int s = s0; s < s1; ++s) {
            const int l = seq_len[s];
            sum += l;
            nbad += l < 1;
        }
        long long tot_a, tot_b, nb;
        scan2(sum, nbad, warp_l, warp_e, pos0, nb, tot_a, tot_b);
        bad0 = nb > 0;
    }
    unsigned bad = 0;
    long long nl = 0, ne = 0;
    // pass 1: count (and write the token-serial slot array)
    {
        long long pos = pos0;
        bool pbad = bad0;
        for (int s = s0; s < s1; ++s) {
            int start, len;
            rows_of(seq_start, seq_len, s, pos, pbad, start, len);
            const int slot = seq_slot[s];
            if (slot >= 0 && uniform > 0 && len != uniform) {
                // not the call's uniform length: skipped and reported here (the token-serial kernel may not run)
                plan[PLAN_SLOT + s] = -1;
                bad |= slot >= n_slots ? 1u : 2u;
                continue;
            }
            const bool is_long = runs_chunked(seq_commit, commits, s, slot, len, min_len, uniform);
            plan[PLAN_SLOT + s] = is_long ? -1 : slot;
            if (!is_long) continue;
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
    }
    long long ol, oe, tl, te;
    scan2(nl, ne, warp_l, warp_e, ol, oe, tl, te);
    // pass 2: write the lists
    int* const longs = plan + PLAN_LONG(n_seqs);
    int* const ents = plan + PLAN_ENT(n_seqs, cap_long);
    long long pos = pos0;
    bool pbad = bad0;
    for (int s = s0; s < s1; ++s) {
        int start, len;
        rows_of(seq_start, seq_len, s, pos, pbad, start, len);
        const int slot = seq_slot[s];
        if (!runs_chunked(seq_commit, commits, s, slot, len, min_len, uniform)) continue;
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
            const int c = commit_of(seq_commit, s, len);
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
// Tensor-core products: 3xTF32 (split4, mma3p: gdn_elt.cuh), or with GDN_TF32X1 (the opt-in fast mode) one TF32
// product of the high parts (each operand rounded to TF32, half away from zero; the remainders, never read, fold
// away). A step's logical k q and q + 4 are taken from memory columns 4 q, 4 q + 1 (first step of 16) or 4 q + 2,
// 4 q + 3 (second step), for A and B alike, so that one float4 of a row feeds two steps; the sum over k is the
// same set of products.
__device__ __forceinline__ void prod_step(float* c, const unsigned* ah, const unsigned* al, const float* b) {
#if GDN_TF32X1
    unsigned bh[2], bl[2];
    split2_fast(b[0], bh[0], bl[0]);
    split2_fast(b[1], bh[1], bl[1]);
    mma_tf32(c, ah[0], ah[1], ah[2], ah[3], bh[0], bh[1]);
#else
    mma3p(c, ah, al, b);
#endif
}

// ---------------------------------------------------------------------------------------------------------
// Everything of one chunk that does not depend on the state. Shared memory (floats): q (then b v, once Q is out),
// k [L][DP4], the decays D[t][s] and A^T [L][LP4] each, gates, write strengths, gamma [L] each; v takes q's place
// so that two blocks fit an SM.
#define DP4 (D + 4)
#define LP4 (L + 4)
#define PREP_SMEM (2 * L * DP4 + 2 * L * LP4 + 3 * L)
static_assert(L % 16 == 0 && L <= 64, "chunk length");
// Channel e's conv + SiLU for the chunk's tokens ta .. ta + SPAN - 1 (those below n), into dst (row stride DP4),
// each times scale[t] where given; every token's input in flight at once (8 at once on engine memory), the inputs
// before token ta from the history at the window's start, else from the window's rows. Tokens at or past n are
// computed from zeros and not stored (a store under a predicate, not a break, so the compiler may overlap the
// tokens' work).
template <int SPAN>
__device__ __forceinline__ void conv_channel(const EQ::T* __restrict__ qkv, size_t qrs, const HistIn& hin,
                                             const float* __restrict__ conv_w, int h, int e, int t0, int ta, int n,
                                             size_t rbase, float* dst, const float* scale) {
    if (ta >= n) return;
    const int ch = channel(h, e);
    const float4 w = __ldg(reinterpret_cast<const float4*>(conv_w) + ch);
    float x0, x1, x2;
    if (t0 + ta == 0) {
        x0 = hin.at(ch, e, 0);
        x1 = hin.at(ch, e, 1);
        x2 = hin.at(ch, e, 2);
    } else {
        // t0 + ta >= 3: t0 is a multiple of L, ta of SPAN >= 8
        x0 = EQ::ld(qkv[(rbase + ta - 3) * qrs + ch]);
        x1 = EQ::ld(qkv[(rbase + ta - 2) * qrs + ch]);
        x2 = EQ::ld(qkv[(rbase + ta - 1) * qrs + ch]);
    }
    // a run-time row stride (engine memory) needs an address register a load: 8 loads in flight, not SPAN (more
    // spill)
    constexpr int G = GDN_EXT ? 8 : SPAN;
#pragma unroll
    for (int tb = ta; tb < ta + SPAN; tb += G) {
        if (tb >= n) break;
        EQ::T raw[G];
#pragma unroll
        for (int t = 0; t < G; ++t) raw[t] = tb + t < n ? qkv[(rbase + tb + t) * qrs + ch] : (EQ::T)0;
#pragma unroll
        for (int t = 0; t < G; ++t) {
            const float x = EQ::ld(raw[t]);
            float s = 0.0f;
            s = fmaf(x0, w.x, s);
            s = fmaf(x1, w.y, s);
            s = fmaf(x2, w.z, s);
            s = fmaf(x, w.w, s);
            const float a = silu_w(s);
            if (tb + t < n) dst[(tb + t) * DP4] = scale ? scale[tb + t] * a : a;
            x0 = x1;
            x1 = x2;
            x2 = x;
        }
    }
}

extern "C" __global__ void __launch_bounds__(NT_PREP, 2) gdn_chunk_prep(
    const EQ::T* __restrict__ qkv, const EA::T* __restrict__ alpha, const EB::T* __restrict__ beta,
    const float* __restrict__ hist, const float* __restrict__ conv_w, const float* __restrict__ dt,
    const float* __restrict__ ssm_a, const int* __restrict__ plan, int n_seqs, int cap_long, float eps,
    float* __restrict__ scr, long long rc EXT_PARAM) {
    extern __shared__ __align__(16) float sm[];
    float* const qs = sm;
    float* const ks = qs + L * DP4;
    float* const as = ks + L * DP4;
    float* const at = as + L * LP4;  // A^T, for the substitution
    float* const gs = at + L * LP4;
    float* const bs = gs + L;
    float* const gam = bs + L;

    const int ent = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5, g8 = lane >> 2, q4 = lane & 3;
    if (ent >= plan[1]) return;
    const int* e2 = plan + PLAN_ENT(n_seqs, cap_long) + 2 * ent;
    const int li = e2[0], c = e2[1];
    const int* inf = plan + PLAN_LONG(n_seqs) + 4 * li;
    const int slot = inf[0], start = inf[1], len = inf[2];
    const int t0 = c * L;
    const int n = min(L, len - t0);
    const size_t rbase = (size_t)start + t0;
#if GDN_EXT
    (void)hist;
    const HistIn hin{reinterpret_cast<const EC::T*>(ext.conv) + (size_t)slot * ext.conv_ss + ext.conv_off, ext.conv_cs,
                     ext.conv_ls};
#else
    const HistIn hin{hist + ((size_t)slot * HV + h) * (3 * D * 3)};
#endif
    const size_t qrs = QKV_RS;
    const float inv_sqrt_d = 1.0f / sqrtf((float)D);

    float* const W = scr;
    float* const U = W + (size_t)rc * HV * D;
    float* const Q = U + (size_t)rc * HV * D;
    float* const K = Q + (size_t)rc * HV * D;
    float* const M = K + 2 * (size_t)rc * HV * D;  // after O
    float* const G = M + (size_t)rc * HV * L;

    // 1. conv + SiLU of q and k, a thread a channel (v waits for q's place, step 5)
    for (int e = tid; e < 2 * D; e += NT_PREP)
        conv_channel<L>(qkv, qrs, hin, conv_w, h, e, t0, 0, n, rbase, (e < D ? qs : ks) + e % D, nullptr);
    if (tid < n) {
        const size_t r = rbase + tid;
        gs[tid] = softplus_decay(EA::ld(alpha[r * A_RS + h]) + dt[h], ssm_a[h]);
        bs[tid] = sigmoid_f(EB::ld(beta[r * B_RS + h]));
    }
    __syncthreads();

    // 2. L2 norms of q and k: a warp a (token, q or k); lane-strided partial sums, then an xor butterfly
    for (int p = warp; p < 2 * n; p += NT_PREP / 32) {
        float* x = (p & 1 ? ks : qs) + (p >> 1) * DP4;
        float acc = 0.0f;
        for (int i = lane; i < D; i += 32) acc = fmaf(x[i], x[i], acc);
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
        const float r = rsqrtf(acc / (float)D + eps / (float)D);
        for (int i = lane; i < D; i += 32) x[i] = (r * x[i]) * inv_sqrt_d;
    }
    // 3. the decay rows, one thread a token
    if (tid < n) gam[tid] = decay_row(gs, tid, as + tid * LP4);
    __syncthreads();

    // 4. k_t . k_s and q_t . k_s on tensor cores, a warp a 16 x 8 tile (t, s) at a time; then
    //    M[t][s] = D[t][s] (q_t . k_s) for s <= t, 0 past it, and A[t][s] = b_t (D[t][s] (k_t . k_s)) for s < t
    //    A warp a row tile and every wpr-th column tile of it up to the diagonal, the row tile's operands split
    //    once a step for all of them. Row tile r has 2 r + 2 column tiles: at L 64 its warps are 1 / 2 / 2 / 3 (at
    //    most 3 tiles a warp), else the same number a row tile. Which warp computes a tile changes no bit.
    {
        constexpr int RT = L / 16;
#if L == 64 && NT_PREP == 256
        constexpr int SPW = 3;
        const int rt = warp == 0 ? 0 : warp <= 4 ? (warp + 1) / 2 : 3;
        const int wpr = rt == 0 ? 1 : rt == 3 ? 3 : 2;
        const int sw = warp - (rt == 0 ? 0 : 2 * rt - 1);
#else
        constexpr int WPR = (NT_PREP / 32) / RT, SPW = (L / 8 + WPR - 1) / WPR;
        static_assert((NT_PREP / 32) % RT == 0, "whole warps a row tile");
        const int rt = warp / WPR, wpr = WPR, sw = warp % WPR;
#endif
        const int r0 = rt * 16;
        if (r0 < n) {
            float ck[SPW][4], cq[SPW][4];
#pragma unroll
            for (int j = 0; j < SPW; ++j)
#pragma unroll
                for (int x = 0; x < 4; ++x) ck[j][x] = cq[j][x] = 0.0f;
#pragma unroll 2
            for (int k0 = 0; k0 < D; k0 += 16) {
                const float4 kl = *reinterpret_cast<const float4*>(ks + (r0 + g8) * DP4 + k0 + 4 * q4);
                const float4 kh = *reinterpret_cast<const float4*>(ks + (r0 + g8 + 8) * DP4 + k0 + 4 * q4);
                const float4 ql = *reinterpret_cast<const float4*>(qs + (r0 + g8) * DP4 + k0 + 4 * q4);
                const float4 qh = *reinterpret_cast<const float4*>(qs + (r0 + g8 + 8) * DP4 + k0 + 4 * q4);
                const float a_k0[4] = {kl.x, kh.x, kl.y, kh.y}, a_k1[4] = {kl.z, kh.z, kl.w, kh.w};
                const float a_q0[4] = {ql.x, qh.x, ql.y, qh.y}, a_q1[4] = {ql.z, qh.z, ql.w, qh.w};
                unsigned hk0[4], lk0[4], hk1[4], lk1[4], hq0[4], lq0[4], hq1[4], lq1[4];
                split4(a_k0, hk0, lk0);
                split4(a_k1, hk1, lk1);
                split4(a_q0, hq0, lq0);
                split4(a_q1, hq1, lq1);
#pragma unroll
                for (int j = 0; j < SPW; ++j) {
                    const int s0 = (sw + j * wpr) * 8;
                    if (s0 >= L || s0 > r0 + 15) continue;  // tiles above the diagonal are 0
                    const float4 kb = *reinterpret_cast<const float4*>(ks + (s0 + g8) * DP4 + k0 + 4 * q4);
                    const float b0[2] = {kb.x, kb.y}, b1[2] = {kb.z, kb.w};
                    prod_step(ck[j], hk0, lk0, b0);
                    prod_step(ck[j], hk1, lk1, b1);
                    prod_step(cq[j], hq0, lq0, b0);
                    prod_step(cq[j], hq1, lq1, b1);
                }
            }
#pragma unroll
            for (int j = 0; j < SPW; ++j) {
                const int s0 = (sw + j * wpr) * 8;
                if (s0 >= L || s0 > r0 + 15) continue;
#pragma unroll
                for (int x = 0; x < 4; ++x) {
                    const int t = r0 + g8 + (x >> 1) * 8, s = s0 + 2 * q4 + (x & 1);
                    if (t >= n) continue;
                    const size_t r = rbase + t;
                    const float dd = s <= t ? as[t * LP4 + s] : 0.0f;
                    M[(r * HV + h) * L + s] = s <= t ? dd * cq[j][x] : 0.0f;
                    at[s * LP4 + t] = s < t ? bs[t] * (dd * ck[j][x]) : 0.0f;
                }
            }
        }
    }
    // M past the tiles computed above (above the diagonal) is zeros. A^T is read only at s < t (A's strict lower
    // part, all written above); the last block's columns past n are read too, and their sums dropped.
    for (int p = tid; p < n * L; p += NT_PREP) {
        const int t = p / L, s = p % L;
        if ((s / 8) * 8 > (t / 16) * 16 + 15) M[((rbase + t) * HV + h) * L + s] = 0.0f;
    }
    if (tid < n) G[(rbase + tid) * HV + h] = gs[tid];
    __syncthreads();

    // 5. Q = gamma q, K = k to the scratch; the right-hand side (b gamma) k in place; then b v in q's place
    for (int idx = tid; idx < n * D; idx += NT_PREP) {
        const int t = idx / D, i = idx % D;
        const size_t o = ((rbase + t) * HV + h) * D + i;
        const float kt = ks[t * DP4 + i];
        Q[o] = gam[t] * qs[t * DP4 + i];
        K[o] = kt;
        ks[t * DP4 + i] = (bs[t] * gam[t]) * kt;
    }
    __syncthreads();
    // v's D channels in two halves of the chunk's tokens, so that every thread has work (D = NT_PREP / 2 at d 128)
    for (int p = tid; p < 2 * D; p += NT_PREP) {
        const int e = p % D, ta = (p / D) * (L / 2);
        conv_channel<L / 2>(qkv, qrs, hin, conv_w, h, 2 * D + e, t0, ta, n, rbase, qs + e, bs);
    }
    __syncthreads();

    // 6. forward substitution, a thread a column of [W | U], in blocks of 8 rows, the solution replacing the
    //    right-hand side in shared memory: x_t = rhs_t - sum_{s<t} A[t][s] x_s, one sum a row in order of s (the
    //    rows before the block from A^T, 8 rows at a time, then the block's own)
    for (int col = tid; col < 2 * D; col += NT_PREP) {
        float* x = (col < D ? ks : qs) + col % D;
        float* dst = (col < D ? W : U) + col % D;
        for (int tb = 0; tb < n; tb += 8) {
            float acc[8], xr[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[i] = 0.0f;
#pragma unroll 4
            for (int s = 0; s < tb; ++s) {
                const float xs = x[s * DP4];
                const float4 a0 = *reinterpret_cast<const float4*>(at + s * LP4 + tb);
                const float4 a1 = *reinterpret_cast<const float4*>(at + s * LP4 + tb + 4);
                acc[0] = fmaf(a0.x, xs, acc[0]);
                acc[1] = fmaf(a0.y, xs, acc[1]);
                acc[2] = fmaf(a0.z, xs, acc[2]);
                acc[3] = fmaf(a0.w, xs, acc[3]);
                acc[4] = fmaf(a1.x, xs, acc[4]);
                acc[5] = fmaf(a1.y, xs, acc[5]);
                acc[6] = fmaf(a1.z, xs, acc[6]);
                acc[7] = fmaf(a1.w, xs, acc[7]);
            }
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                // rows at or past n are computed (from whatever their rows hold) and not stored: no break, so the
                // block's A^T loads need not wait for the rows before them; no row below n reads them
                const int t = tb + i;
                float a = acc[i];
#pragma unroll
                for (int j = 0; j < i; ++j) a = fmaf(at[(tb + j) * LP4 + t], xr[j], a);
                xr[i] = x[t * DP4] - a;
                if (t < n) {
                    x[t * DP4] = xr[i];
                    dst[((rbase + t) * HV + h) * D] = xr[i];
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------------------
// The recurrence over chunks for one block of CB value columns of one value head, on tensor cores. Warp w owns
// row tile w of [W; Q] (2 L rows: W's tiles first): P1 [delta | o] = [U | 0] -+ [W; Q] S; then the Q warps add
// P2 M delta to o and store it; then every warp takes 16-row tiles of the state update P3 S' = gamma S + Kd^T
// delta (Kd[s][i] = D[m-1][s] k_s[i] for s < m, 0 past m; m the chunk's length, and again with the commit
// point's m inside the commit chunk). The W, Q, M, U, K operands come straight from the scratch (each row tile
// has one owner, so nothing is staged); S (two buffers: read one, write the other) and delta live in shared
// memory. Shared memory (floats): S [2][D][CBP], delta [L][CBP], gates and two decay rows [L]. While a chunk
// runs, its successor's gates are loaded into registers.
// The body is a template over the block's column count CB_ (CB, CBP, NT8, NCB2 below are its macros): the kernel
// gdn_chunk_state takes GDN_CB columns a block, two blocks an SM; gdn_chunk_state_narrow 16, three an SM, for calls
// too small to fill the device in equal shares (compiled where the host sets GDN_NARROW, src/chunk.rs `has_narrow`,
// and launched where it picks it, `narrow_state`). Every value column's arithmetic is the same in both (the
// products' rows and columns are independent), so the choice changes no bits.
#define CB CB_
#define CBP (CB + 2)
#define NT8 (CB / 8)
#define NCB2 (D / CB)
// acc[nt] += one 16-wide k step of a 16-row tile (lo: its row g, hi: row g + 8, columns 4 q .. 4 q + 3 of the
// step) times B's rows of the step (bp: row 4 q of the step, column g of tile 0; rows CBP apart) for NT8 column
// tiles: the tile split once, two mma steps a column tile
template <int CB_>
__device__ __forceinline__ void tile_step(float (*acc)[4], float4 lo, float4 hi, const float* bp) {
    const float a0[4] = {lo.x, hi.x, lo.y, hi.y}, a1[4] = {lo.z, hi.z, lo.w, hi.w};
    unsigned h0[4], l0[4], h1[4], l1[4];
    split4(a0, h0, l0);
    split4(a1, h1, l1);
#pragma unroll
    for (int nt = 0; nt < NT8; ++nt) {
        const float* sp = bp + nt * 8;
        const float b0[2] = {sp[0], sp[CBP]}, b1[2] = {sp[2 * CBP], sp[3 * CBP]};
        prod_step(acc[nt], h0, l0, b0);
        prod_step(acc[nt], h1, l1, b1);
    }
}
#define STATE_SMEM (2 * D * CBP + L * CBP + 3 * L)
static_assert(2 * L / 16 <= NT_STATE / 32, "a warp a row tile of [W; Q]");
static_assert(2 * L <= NT_STATE, "a thread a decay");
template <int CB_>
__device__ __forceinline__ void state_body(ES::T* __restrict__ state, float* __restrict__ hist,
                                           const EQ::T* __restrict__ qkv, const int* __restrict__ plan, int n_seqs,
                                           int cap_long, float* __restrict__ scr, long long rc EXT_PARAM) {
    static_assert(D % CB == 0 && CB % 16 == 0, "whole column blocks of 16");
    extern __shared__ __align__(16) float sm[];
    float* const ssb = sm;  // [2][D][CBP]
    float* const dl = ssb + 2 * D * CBP;
    float* const gsm = dl + L * CBP;
    float* const dec = gsm + L;
    float* const decc = dec + L;

    const int li = blockIdx.y, tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5, g8 = lane >> 2, q4 = lane & 3;
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

    ES::T* const sbase = state + SLOT_OFF(slot);
#if GDN_VMAJOR
#define SIDX(i, j) (((size_t)h * D + (j)) * D + (i))
#else
#define SIDX(i, j) (((size_t)(i) * HV + h) * D + (j))
#endif
    for (int idx = tid; idx < D * CB; idx += NT_STATE) {
#if GDN_VMAJOR
        const int cc = idx / D, i = idx % D;  // keys contiguous in memory
#else
        const int i = idx / CB, cc = idx % CB;
#endif
        ssb[i * CBP + cc] = ES::ld(sbase[SIDX(i, cb * CB + cc)]);
    }

    const int nch = (len + L - 1) / L;
    const int cchunk = commit > 0 ? (commit - 1) / L : -1;
    const int ncommit = commit - cchunk * L;
    const bool is_q = warp >= L / 16;             // this warp's row tile is one of Q's
    const int r0 = (warp % (L / 16)) * 16;        // its first row in the chunk
    const bool has_tile = warp < 2 * L / 16;
    float g_next = tid < L && tid < len ? G[((size_t)start + tid) * HV + h] : 1.0f;
    for (int c = 0; c < nch; ++c) {
        const int t0 = c * L;
        const int n = min(L, len - t0);
        const size_t rbase = (size_t)start + t0;
        const float* ss = ssb + (c & 1) * D * CBP;
        float* sn = ssb + ((c + 1) & 1) * D * CBP;
        if (tid < L) gsm[tid] = g_next;
        if (c + 1 < nch && tid < L) {
            const int n1 = min(L, len - t0 - L);
            g_next = tid < n1 ? G[(rbase + L + tid) * HV + h] : 1.0f;
        }
        __syncthreads();
        // the decay rows of the chunk's end and of a commit inside it (read only after the next barrier)
        const bool need_upd = c + 1 < nch;
        const bool need_commit = c == cchunk;
        if (tid < L) {
            if (need_upd && tid < n) dec[tid] = decay_of(gsm, n, tid);
        } else if (tid < 2 * L) {
            if (need_commit && tid - L < ncommit) decc[tid - L] = decay_of(gsm, ncommit, tid - L);
        }

        // P1: this warp's 16 rows of W (or Q) times S
        float acc[NT8][4];
#pragma unroll
        for (int nt = 0; nt < NT8; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
        if (has_tile) {
            const float* X = is_q ? Q : W;
            const bool lo_ok = r0 + g8 < n, hi_ok = r0 + g8 + 8 < n;
            const float* xl = X + ((rbase + r0 + g8) * HV + h) * D + 4 * q4;
            const float* xh = xl + (size_t)8 * HV * D;
            // the operands of PG steps of 16 loaded at once, each split once for its products
            constexpr int PG = 4;
#pragma unroll
            for (int kg = 0; kg < D; kg += 16 * PG) {
                float4 al[PG], ah[PG];
                const float4 zero4 = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
                for (int j = 0; j < PG; ++j) {
                    if (kg + 16 * j < D) {
                        al[j] = lo_ok ? *reinterpret_cast<const float4*>(xl + kg + 16 * j) : zero4;
                        ah[j] = hi_ok ? *reinterpret_cast<const float4*>(xh + kg + 16 * j) : zero4;
                    }
                }
#pragma unroll
                for (int j = 0; j < PG; ++j) {
                    const int k0 = kg + 16 * j;
                    if (k0 < D) tile_step<CB_>(acc, al[j], ah[j], ss + (k0 + 4 * q4) * CBP + g8);
                }
            }
            if (!is_q) {
                // delta = U - W S (rows past the window: 0)
#pragma unroll
                for (int nt = 0; nt < NT8; ++nt) {
#pragma unroll
                    for (int hf = 0; hf < 2; ++hf) {
                        const int t = r0 + g8 + 8 * hf, col = nt * 8 + 2 * q4;
                        float2 d2 = make_float2(0.0f, 0.0f);
                        if (t < n) {
                            const float2 u2 =
                                *reinterpret_cast<const float2*>(U + ((rbase + t) * HV + h) * D + cb * CB + col);
                            d2 = make_float2(u2.x - acc[nt][2 * hf], u2.y - acc[nt][2 * hf + 1]);
                        }
                        *reinterpret_cast<float2*>(dl + t * CBP + col) = d2;
                    }
                }
            }
        }
        __syncthreads();
        // P2: o = ((gamma q) S + M delta) / sqrt(d) for the Q warps' rows
        if (has_tile && is_q && r0 < n) {
            const bool lo_ok = r0 + g8 < n, hi_ok = r0 + g8 + 8 < n;
            const float* ml = M + ((rbase + r0 + g8) * HV + h) * L + 4 * q4;
            const float* mh = ml + (size_t)8 * HV * L;
#pragma unroll
            for (int k0 = 0; k0 < L; k0 += 16) {
                const float4 zero4 = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                const float4 al = lo_ok ? *reinterpret_cast<const float4*>(ml + k0) : zero4;
                const float4 ah = hi_ok ? *reinterpret_cast<const float4*>(mh + k0) : zero4;
                tile_step<CB_>(acc, al, ah, dl + (k0 + 4 * q4) * CBP + g8);
            }
#pragma unroll
            for (int nt = 0; nt < NT8; ++nt) {
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    const int t = r0 + g8 + 8 * hf, col = nt * 8 + 2 * q4;
                    if (t < n)
                        *reinterpret_cast<float2*>(O + ((rbase + t) * HV + h) * D + cb * CB + col) =
                            make_float2(acc[nt][2 * hf] * inv_sqrt_d, acc[nt][2 * hf + 1] * inv_sqrt_d);
                }
            }
        }
        // P3: the state after the chunk (into the other buffer) and at a commit point inside it (to the pool):
        // upd(m) = gamma_{m-1} S + sum_{s<m} (D[m-1][s] k_s) delta_s, the terms past m exactly 0 (both operands)
        const int items = (D / 16) * ((int)need_upd + (int)need_commit);
        for (int it = warp; it < items; it += NT_STATE / 32) {
            const bool cm = !need_upd || it >= D / 16;  // this item is the commit point's
            const int i0 = (it % (D / 16)) * 16;
            const int m = cm ? ncommit : n;
            const float* dv = cm ? decc : dec;
            const float gm = dv[0] * gsm[0];  // gamma_{m-1}, as decay_row returns it
            float u[NT8][4];
#pragma unroll
            for (int nt = 0; nt < NT8; ++nt) {
                const int col = nt * 8 + 2 * q4;
                u[nt][0] = gm * ss[(i0 + g8) * CBP + col];
                u[nt][1] = gm * ss[(i0 + g8) * CBP + col + 1];
                u[nt][2] = gm * ss[(i0 + g8 + 8) * CBP + col];
                u[nt][3] = gm * ss[(i0 + g8 + 8) * CBP + col + 1];
            }
            const float* kb = K + (rbase * HV + h) * D + i0 + g8;
            // every step's keys loaded at once; steps past m have A and B exactly 0, as a loop to m would leave them
            float ka[L / 16][8];
#pragma unroll
            for (int s0 = 0; s0 < L; s0 += 16) {
#pragma unroll
                for (int x = 0; x < 4; ++x) {
                    const int s = s0 + 4 * q4 + x;
                    const bool ok = s < m;
                    ka[s0 / 16][2 * x] = ok ? kb[(size_t)s * HV * D] : 0.0f;          // row i0 + g8
                    ka[s0 / 16][2 * x + 1] = ok ? kb[(size_t)s * HV * D + 8] : 0.0f;  // row i0 + g8 + 8
                }
            }
#pragma unroll
            for (int s0 = 0; s0 < L; s0 += 16) {
                if (s0 >= m) break;
                float a[8], bm[4];
#pragma unroll
                for (int x = 0; x < 4; ++x) {
                    const int s = s0 + 4 * q4 + x;
                    const bool ok = s < m;
                    const float ds = ok ? dv[s] : 0.0f;
                    a[2 * x] = ds * ka[s0 / 16][2 * x];  // exactly 0 past m (both factors)
                    a[2 * x + 1] = ds * ka[s0 / 16][2 * x + 1];
                    bm[x] = ok ? 1.0f : 0.0f;
                }
                const float a0[4] = {a[0], a[1], a[2], a[3]}, a1[4] = {a[4], a[5], a[6], a[7]};
                unsigned h0[4], l0[4], h1[4], l1[4];
                split4(a0, h0, l0);
                split4(a1, h1, l1);
#pragma unroll
                for (int nt = 0; nt < NT8; ++nt) {
                    const float* dp = dl + (s0 + 4 * q4) * CBP + nt * 8 + g8;
                    const float b0[2] = {bm[0] != 0.0f ? dp[0] : 0.0f, bm[1] != 0.0f ? dp[CBP] : 0.0f};
                    const float b1[2] = {bm[2] != 0.0f ? dp[2 * CBP] : 0.0f, bm[3] != 0.0f ? dp[3 * CBP] : 0.0f};
                    prod_step(u[nt], h0, l0, b0);
                    prod_step(u[nt], h1, l1, b1);
                }
            }
#pragma unroll
            for (int nt = 0; nt < NT8; ++nt) {
                const int col = nt * 8 + 2 * q4;
#pragma unroll
                for (int x = 0; x < 4; ++x) {
                    const int i = i0 + g8 + (x >> 1) * 8, cc = col + (x & 1);
                    if (cm) sbase[SIDX(i, cb * CB + cc)] = ES::st(u[nt][x]);
                    else sn[i * CBP + cc] = u[nt][x];
                }
            }
        }
        __syncthreads();
    }

    // the conv history after the commit token: the last three of (old history, the window's raw inputs)
    if (commit > 0 && cb == 0) {
#if GDN_EXT
        // the engine's one copy: q / k by the key head's first value head, v by its own (the prep has read them all)
        (void)hist;
        EC::T* const hb = reinterpret_cast<EC::T*>(ext.conv) + (size_t)slot * ext.conv_ss + ext.conv_off;
        const bool qk_writer = first_of_key_head(h);
#else
        float* hh = hist + ((size_t)slot * HV + h) * (3 * D * 3);
#endif
        for (int e = tid; e < 3 * D; e += NT_STATE) {
            const int ch = channel(h, e);
#if GDN_EXT
            if (e < 2 * D && !qk_writer) continue;
            EC::T* const p = hb + (size_t)ch * ext.conv_cs;
            const float o0 = EC::ld(p[0]), o1 = EC::ld(p[ext.conv_ls]), o2 = EC::ld(p[2 * ext.conv_ls]);
#else
            const float o0 = hh[e * 3], o1 = hh[e * 3 + 1], o2 = hh[e * 3 + 2];
#endif
            float nv[3];
#pragma unroll
            for (int m = 0; m < 3; ++m) {
                const int u = commit - 3 + m;
                const int oi = m + commit;
                nv[m] = u >= 0 ? EQ::ld(qkv[((size_t)start + u) * QKV_RS + ch]) : (oi == 0 ? o0 : oi == 1 ? o1 : o2);
            }
#if GDN_EXT
            p[0] = EC::st(nv[0]);
            p[ext.conv_ls] = EC::st(nv[1]);
            p[2 * ext.conv_ls] = EC::st(nv[2]);
#else
            hh[e * 3] = nv[0];
            hh[e * 3 + 1] = nv[1];
            hh[e * 3 + 2] = nv[2];
#endif
        }
    }
}

#undef CB
#undef CBP
#undef NT8
#undef NCB2
#define STATE_ARGS state, hist, qkv, plan, n_seqs, cap_long, scr, rc EXT_ARG
#define STATE_PARAMS                                                                                          \
    ES::T *__restrict__ state, float *__restrict__ hist, const EQ::T *__restrict__ qkv,                       \
        const int *__restrict__ plan, int n_seqs, int cap_long, float *__restrict__ scr, long long rc EXT_PARAM
extern "C" __global__ void __launch_bounds__(NT_STATE, 2) gdn_chunk_state(STATE_PARAMS) {
    state_body<GDN_CB>(STATE_ARGS);
}
#if GDN_NARROW
extern "C" __global__ void __launch_bounds__(NT_STATE, 3) gdn_chunk_state_narrow(STATE_PARAMS) {
    state_body<16>(STATE_ARGS);
}
#endif

// ---------------------------------------------------------------------------------------------------------
// The gated RMS norm, y, planes and group sums of one chunk of one value head: a warp a token, 16 warps up to d 256
// (at L 64 four tokens a warp one after another: with four warps, sixteen made one chunk's block take ~40 us).
extern "C" __global__ void __launch_bounds__(NT_OUT) gdn_chunk_out(
    const EZ::T* __restrict__ z, const float* __restrict__ gamma, EO::T* __restrict__ out, long long plane,
    const int* __restrict__ plan, int n_seqs, int cap_long, float eps, const float* __restrict__ scr,
    long long rc EXT_PARAM) {
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
            const float zt = EZ::ld(z[r * Z_RS + h * D + j]);
#if GDN_SILU
            const float act = zt * sigmoid_f(zt);
#else
            const float act = sigmoid_f(zt);
#endif
            const float yv = ((rs * o[j]) * gamma[j]) * act;
            const size_t yi = r * O_RS + h * D + j;
            store_y<EO, GDN_PLANES != 0>(out, plane, yi, j, yv);
#if GDN_PLANES
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
