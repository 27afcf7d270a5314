// gdn_step.cu: the whole GDN window step (SPEC.md) in one launch (kernel versions 2b and 3, see NOTES.md).
//
// Specialised by the host through macros (see src/spec.rs):
//   GDN_D, GDN_HK, GDN_HV   shape (head dim, q/k heads, value heads)
//   GDN_T                   window length, or 0 for a run-time length
//   GDN_SILU                output gate: 0 sigmoid, 1 silu
//   GDN_GROUPED             head map: 0 tiled (h % h_k), 1 grouped (h / (h_v / h_k))
//   GDN_PLANES              0: y only; 1: y, three prepared planes and group sums
//   GDN_COMMIT              0: verify (nothing written back); 1: commit after token `commit_at - 1`
//   GDN_NCB                 column blocks per value head = thread-block cluster size (1, 2, 4, 8)
//   GDN_RG                  row groups (1, 2, 4, 8, 16, 32): a thread holds D / RG rows of one column
//   GDN_MINB                minimum resident blocks per multiprocessor (register budget)
//   GDN_V3                  0: kernel v2b's token loop; 1: kernel v3's (readout from the state before the update,
//                           one fused sweep over the registers and two block barriers a token)
//
// Work split. Grid (H_V * NCB, B). The NCB blocks of one value head form a cluster; block `rank` owns the
// state columns [rank * COLS, (rank + 1) * COLS) of its head, COLS = D / NCB. Inside a warp, lane l holds row
// group l % RG of column (warp * CPW + l / RG), CPW = 32 / RG columns a warp: its RPT = D / RG rows of that
// column live in registers, read once before the token loop and written once at the commit. The sums over
// rows (kv_j and o_j) are butterflies over the RG lanes of a column: no shared memory, no barrier. Columns
// are independent in the delta rule and the readout; only the output RMS norm couples them: its per-warp
// partial sums meet in shared memory, and across the cluster through distributed shared memory.
//
// Every reduction runs in a fixed order (no atomics; an xor butterfly gives every lane the same bits), so
// the same inputs give the same bits, and the arithmetic of one token does not depend on the window length:
// a commit after k tokens of a longer window is bitwise a k-token commit. The program is compiled with
// --fmad=false; every fused multiply-add is an explicit fmaf.
//
// Conv history: each value head has a private copy of the q/k history it reads, laid out
// [slot][H_V][3 (q, k, v)][D][3]; the blocks of a head read it before the token loop and write it back after
// a cluster barrier that follows those reads, so no other head's blocks ever read what a block writes.
//
// Launch: with programmatic dependent launch the kernel loads a few of the layer's weights, then waits for
// the previous kernel in the stream (griddepcontrol.wait) before it reads anything a previous kernel may write.

#ifndef GDN_D
#error "GDN_D must be defined"
#endif

#ifndef GDN_V3
#define GDN_V3 0
#endif

#define D GDN_D
#define HK GDN_HK
#define HV GDN_HV
#define NCB GDN_NCB
#define RG GDN_RG
#define COLS (D / NCB)
#define NT (COLS * RG)
#define NW (NT / 32)
#define CPW (32 / RG)
#define RPT (D / RG)
#define KPAD (RPT + 4)
#define C_ALL ((2 * HK + HV) * D)
#define N_OUT (HV * D)
#define NE (2 * D + COLS)
#define NCH ((NE + NT - 1) / NT)
#define QK_PER_RANK (2 * D / NCB)

static_assert(D % 16 == 0, "d must be a multiple of 16");
static_assert(COLS % 16 == 0, "a column block must hold whole groups of 16");
static_assert(32 % RG == 0, "a column's row groups must share a warp");
static_assert(COLS % CPW == 0, "whole warps of columns");
static_assert(D % RG == 0 && RPT % 4 == 0, "rows per thread must be a multiple of 4");
static_assert(NT % 32 == 0 && NT <= 1024, "threads per block");
static_assert(HV % HK == 0, "h_v must be a multiple of h_k");

__device__ __forceinline__ float sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }

__device__ __forceinline__ float softplus_decay(float u, float a) {
    const float ex = expf(u);
    const float w = 1.0f + ex;
    const float sp = u > 20.0f ? u : (w == 1.0f ? ex : logf(w) * ex / (w - 1.0f));
    return expf(sp * a);
}

#if GDN_NCB > 1
__device__ __forceinline__ void cluster_sync_all() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// Reads a float from the shared memory of block `rank` of this cluster, at the address `p` has here. Only
// called after a cluster barrier (which orders it); not volatile, so several can be in flight at once.
__device__ __forceinline__ float ld_cluster(const float* p, unsigned rank) {
    unsigned local = (unsigned)__cvta_generic_to_shared(p);
    unsigned remote;
    float v;
    asm("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
    asm("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote));
    return v;
}
#endif

__device__ __forceinline__ float row_sum(float x) {
#pragma unroll
    for (int off = 1; off < RG; off <<= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
    return x;
}

// offset of list entry e's history inside its value head's private [3][D][3] copy
__device__ __forceinline__ int hist_off(int e, int rank) {
    return e < 2 * D ? e * 3 : (2 * D + rank * COLS + (e - 2 * D)) * 3;
}

// index of row i of a normalized q or k vector in shared memory: the rows of one row group contiguous, the
// groups KPAD apart, so the RG different 16-byte loads of a warp fall in different banks
__device__ __forceinline__ int kidx(int i) { return (i / RPT) * KPAD + (i % RPT); }

extern "C" __global__ void __launch_bounds__(NT, GDN_MINB)
#if GDN_NCB > 1
__cluster_dims__(GDN_NCB, 1, 1)
#endif
gdn_step(float* __restrict__ state, float* __restrict__ hist, const float* __restrict__ qkv,
         const float* __restrict__ alpha, const float* __restrict__ beta, const float* __restrict__ z,
         const float* __restrict__ conv_w, const float* __restrict__ dt, const float* __restrict__ ssm_a,
         const float* __restrict__ gamma, float* __restrict__ out, const int* __restrict__ slots, int n_slots,
         int t_rt, int commit_at, long long plane, float eps) {
#if GDN_T > 0
    constexpr int T = GDN_T;
    (void)t_rt;
#else
    const int T = t_rt;
#endif
#if GDN_COMMIT == 0
    (void)commit_at;
#endif
#if GDN_PLANES == 0
    (void)plane;
#endif
#if GDN_V3
    // double-buffered by token parity: token u's inputs are prepared while token u - 1 is finished
    __shared__ float vs[2][COLS];
    __shared__ __align__(16) float qn[2][RG * KPAD];
    __shared__ __align__(16) float kn[2][RG * KPAD];
    __shared__ float gb[2][2];
#else
    __shared__ float vs[COLS];
    __shared__ __align__(16) float qn[RG * KPAD];
    __shared__ __align__(16) float kn[RG * KPAD];
    __shared__ float gb[2];
#endif
    __shared__ float part_qk[2 * D / 16];
    __shared__ float part_o[2][NW];
#if GDN_NCB > 1
    __shared__ float blk_o[2];
#endif
#if GDN_PLANES
    __shared__ float ys[COLS];
#endif

    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int h = blockIdx.x / NCB;
    const int rank = blockIdx.x % NCB;
    const int b = blockIdx.y;
#if GDN_GROUPED
    const int g = h / (HV / HK);
#else
    const int g = h % HK;
#endif
    const int rg = lane % RG;
    const int col = warp * CPW + lane / RG;
    const int j = rank * COLS + col;  // column of the head's state
    const int i0 = rg * RPT;
    const float inv_sqrt_d = 1.0f / sqrtf((float)D);

    // This thread's conv channels (list entry e: q 0..D, k D..2D, v of this block's columns 2D..NE). Their
    // weights are read again each token (a cache hit after the first) rather than held in registers.
    int chan[NCH];
#pragma unroll
    for (int m = 0; m < NCH; ++m) {
        const int e = tid + m * NT;
        chan[m] = e < D ? g * D + e
                : e < 2 * D ? HK * D + g * D + (e - D)
                : e < NE ? 2 * HK * D + h * D + rank * COLS + (e - 2 * D)
                : -1;
    }
    const float gam = rg == 0 ? gamma[j] : 0.0f;
    const float dth = dt[h];
    const float ah = ssm_a[h];

#if __CUDA_ARCH__ >= 900
    // everything below may read what the previous kernel in the stream wrote; let the next one start
    // meanwhile
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;");
#endif

    // inputs of the first token (indexed by sequence, not slot) in flight with the slot index
    const float* qkv_b = qkv + (size_t)b * T * C_ALL;
    float in[NCH];
#pragma unroll
    for (int m = 0; m < NCH; ++m) in[m] = chan[m] >= 0 ? qkv_b[chan[m]] : 0.0f;
    const size_t row0 = (size_t)b * T;
    float zz = rg == 0 ? z[row0 * N_OUT + h * D + j] : 0.0f;
    float ab = 0.0f;
    if (tid == NT - 1) ab = alpha[row0 * HV + h];
    else if (tid == NT - 2) ab = beta[row0 * HV + h];

    const int slot = slots[b];
    if (slot < 0 || slot >= n_slots) return;  // uniform over the cluster: its blocks share b

    float* hist_head = hist + ((size_t)slot * HV + h) * (3 * D * 3);
    float hst[NCH][3];
#pragma unroll
    for (int m = 0; m < NCH; ++m) {
        if (chan[m] >= 0) {
            const int o = hist_off(tid + m * NT, rank);
            hst[m][0] = hist_head[o];
            hst[m][1] = hist_head[o + 1];
            hst[m][2] = hist_head[o + 2];
        } else {
            hst[m][0] = hst[m][1] = hst[m][2] = 0.0f;
        }
    }

    // the state: RPT rows of column j, read once
    float* st_base = state + (size_t)slot * D * HV * D + ((size_t)i0 * HV + h) * D + j;
    float st[RPT];
#pragma unroll
    for (int r = 0; r < RPT; ++r) st[r] = st_base[(size_t)r * HV * D];

#if GDN_V3
    // Kernel v3 (NOTES.md): the readout from the state before the update,
    //   o_j = sum_i S'[i][j] q_i = g (S^T q)_j + delta_j (k . q),   S' = g S + k delta^T,
    // so one pass over the registers accumulates kv = S^T k and sq = S^T q together, and that pass is fused
    // with the previous token's update (update a row, then FMA it into the next token's kv and sq). Iteration
    // u prepares token u (conv, norms, gates, k . q) and finishes token u - 1 (butterflies, delta, readout,
    // y, history), then sweeps the registers once: update by token u - 1, accumulate for token u. Two block
    // barriers a token. The arithmetic of a token does not depend on T: token u - 1's update is the same
    // fmaf whether or not token u's sums ride along, and the last token's update runs only when it commits.
    float kv0 = 0.0f, kv1 = 0.0f, sq0 = 0.0f, sq1 = 0.0f;  // partial S^T k and S^T q of the token prepared
    float kq = 0.0f;                                       // k . q of the token prepared
    // The history after token t is committed before the conv of token u shifts it once more. With one block a
    // head each thread writes back only the entries it read itself (before the loop): it writes them right
    // there, in the conv. A cluster's blocks share the q/k history, so they wait for a cluster barrier (in
    // step 4), and carry the value the shift dropped until then.
#define V3_HIST_IN_CONV (GDN_NCB == 1)
#if GDN_COMMIT && !V3_HIST_IN_CONV
    float hdrop[NCH];
#pragma unroll
    for (int m = 0; m < NCH; ++m) hdrop[m] = 0.0f;
#endif
#pragma unroll 1
    for (int u = 0; u <= T; ++u) {
        const int t = u - 1;       // the token finished in this iteration
        const bool prep = u < T;   // token u is prepared
        const bool fin = u > 0;    // token t is finished
        const int pu = u & 1, pt = t & 1;
        float gt = 0.0f, bt = 0.0f, vv = 0.0f;
        if (fin) {
            // read now: the buffers of parity pt are rewritten (token u + 1) after this iteration's barriers
            gt = gb[pt][0];
            bt = gb[pt][1];
            vv = vs[pt][col];
        }
        // 1. token u: conv + SiLU; v to shared memory, q and k kept in registers; per-16-channel sums of squares
        float cvs[NCH];
        if (prep) {
            const size_t row = row0 + u;
            const bool more = u + 1 < T;
#pragma unroll
            for (int m = 0; m < NCH; ++m) {
                const int e = tid + m * NT;
                float cv = 0.0f;
                if (chan[m] >= 0) {
                    const float4 w = __ldg(reinterpret_cast<const float4*>(conv_w) + chan[m]);
                    float s = 0.0f;
                    s = fmaf(hst[m][0], w.x, s);
                    s = fmaf(hst[m][1], w.y, s);
                    s = fmaf(hst[m][2], w.z, s);
                    s = fmaf(in[m], w.w, s);
                    cv = s / (1.0f + expf(-s));
#if GDN_COMMIT && V3_HIST_IN_CONV
                    if (u == commit_at) {
                        const int o3 = hist_off(e, rank);
                        hist_head[o3] = hst[m][0];
                        hist_head[o3 + 1] = hst[m][1];
                        hist_head[o3 + 2] = hst[m][2];
                    }
#elif GDN_COMMIT
                    hdrop[m] = hst[m][0];
#endif
                    hst[m][0] = hst[m][1];
                    hst[m][1] = hst[m][2];
                    hst[m][2] = in[m];
                    in[m] = more ? qkv_b[(size_t)(u + 1) * C_ALL + chan[m]] : 0.0f;
                    if (e >= 2 * D) vs[pu][e - 2 * D] = cv;
                }
                cvs[m] = cv;
                float sq = e < 2 * D ? cv * cv : 0.0f;
                sq += __shfl_xor_sync(0xffffffffu, sq, 8);
                sq += __shfl_xor_sync(0xffffffffu, sq, 4);
                sq += __shfl_xor_sync(0xffffffffu, sq, 2);
                sq += __shfl_xor_sync(0xffffffffu, sq, 1);
                if (e < 2 * D && (e & 15) == 0) part_qk[e >> 4] = sq;
            }
            // gate and write strength of token u, and token u + 1's alpha / beta
            if (tid == NT - 1) {
                gb[pu][0] = softplus_decay(ab + dth, ah);
                ab = more ? alpha[(row + 1) * HV + h] : 0.0f;
            } else if (tid == NT - 2) {
                gb[pu][1] = sigmoid_f(ab);
                ab = more ? beta[(row + 1) * HV + h] : 0.0f;
            }
        }
        // 2. token t: column sums over the RG lanes of the column, delta, the readout
        float o = 0.0f, zt = 0.0f;
        if (fin) {
            const float kv = row_sum(kv0 + kv1);
            const float sq = row_sum(sq0 + sq1);
            const float delta = (vv - gt * kv) * bt;
            o = fmaf(gt, sq, delta * kq) * inv_sqrt_d;
            bt = delta;  // bt now carries delta into the update sweep
            // the output norm: per-warp partial of sum_j o_j^2 (each column once: its rg 0 lane)
            float osq = rg == 0 ? o * o : 0.0f;
#pragma unroll
            for (int off = RG; off < 32; off <<= 1) osq += __shfl_xor_sync(0xffffffffu, osq, off);
            zt = zz;
            if (rg == 0) zz = u < T ? z[(row0 + u) * N_OUT + h * D + j] : 0.0f;
            if (lane == 0) part_o[pt][warp] = osq;
        }
        __syncthreads();

        // 3. token u: L2 norms, each q / k channel's thread scales its value, in the spec's two roundings
        if (prep) {
#pragma unroll
            for (int m = 0; m < NCH; ++m) {
                const int e = tid + m * NT;
                if (e < 2 * D) {
                    const int base = e < D ? 0 : D / 16;
                    float tot = 0.0f;
#pragma unroll
                    for (int c = 0; c < D / 16; ++c) tot += part_qk[base + c];
                    const float r = rsqrtf(tot / (float)D + eps / (float)D);
                    const float x = (r * cvs[m]) * inv_sqrt_d;
                    if (e < D) qn[pu][kidx(e)] = x;
                    else kn[pu][kidx(e - D)] = x;
                }
            }
        }
        // 4. token t: gated RMS norm, y, planes, the committed history
        if (fin) {
            const size_t row = row0 + t;
            float tot = 0.0f;
#pragma unroll
            for (int w = 0; w < NW; ++w) tot += part_o[pt][w];
#if GDN_NCB > 1
            if (tid == 0) blk_o[pt] = tot;
            cluster_sync_all();
            tot = 0.0f;
            float rem[NCB];
#pragma unroll
            for (int c = 0; c < NCB; ++c) rem[c] = c == rank ? blk_o[pt] : ld_cluster(&blk_o[pt], (unsigned)c);
#pragma unroll
            for (int c = 0; c < NCB; ++c) tot += rem[c];
#endif
            const float rs = rsqrtf(tot / (float)D + eps);
#if GDN_SILU
            const float act = zt * sigmoid_f(zt);
#else
            const float act = sigmoid_f(zt);
#endif
            const float yv = ((rs * o) * gam) * act;
            const size_t yi = row * N_OUT + h * D + j;
            if (rg == 0) {
                out[yi] = yv;
#if GDN_PLANES
                const int jj = j & 15;
                out[plane + yi] = yv * __int_as_float((127 - 2 * (jj & 7)) << 23);
                out[2 * plane + yi] = yv * __int_as_float((127 - 8 * (jj & 3)) << 23);
                out[3 * plane + yi] = (jj & 1) ? yv * 0.00390625f : yv;
                ys[col] = yv;
#endif
            }
#if GDN_COMMIT
            // the history after token t, unless the conv of token u wrote it already (one block a head); in a
            // cluster, after the barrier above (every block has read its own before the loop), taking the value
            // the conv of token u shifted out when there was one
            if (u == commit_at && (!V3_HIST_IN_CONV || !prep)) {
#pragma unroll
                for (int m = 0; m < NCH; ++m) {
                    const int e = tid + m * NT;
                    const bool mine = e < 2 * D ? (e / QK_PER_RANK) == rank : chan[m] >= 0;
                    if (mine) {
                        const int o3 = hist_off(e, rank);
#if V3_HIST_IN_CONV
                        hist_head[o3] = hst[m][0];
                        hist_head[o3 + 1] = hst[m][1];
                        hist_head[o3 + 2] = hst[m][2];
#else
                        hist_head[o3] = prep ? hdrop[m] : hst[m][0];
                        hist_head[o3 + 1] = prep ? hst[m][0] : hst[m][1];
                        hist_head[o3 + 2] = prep ? hst[m][1] : hst[m][2];
#endif
                    }
                }
            }
#endif
        }
        // q̂ / k̂ of token u for the sweep below; ys for the group sums (after the last token: only the latter)
        if (prep || GDN_PLANES) __syncthreads();
#if GDN_PLANES
        if (fin && tid < COLS / 16) {
            float s_even = 0.0f, s_odd = 0.0f;
#pragma unroll
            for (int e = 0; e < 16; e += 2) {
                s_even += ys[16 * tid + e];
                s_odd += ys[16 * tid + e + 1];
            }
            out[4 * plane + (row0 + t) * (N_OUT / 16) + (h * D + rank * COLS) / 16 + tid] = s_even + s_odd;
        }
#endif
        // 5. the sweep over the registers: update by token t, then sums for token u
        const float* kt = &kn[pt][rg * KPAD];  // pt is 1 at u = 0 (t = -1), unused there
        const float* ku = &kn[pu][rg * KPAD];
        const float* qu = &qn[pu][rg * KPAD];
        if (prep) {
            // k . q of token u, in every warp alike (fixed order: the same bits in every lane of every warp)
            float d0 = 0.0f;
            for (int c = lane; c < D / 4; c += 32) {
                const float4 k4 = *reinterpret_cast<const float4*>(&kn[pu][kidx(4 * c)]);
                const float4 q4 = *reinterpret_cast<const float4*>(&qn[pu][kidx(4 * c)]);
                d0 = fmaf(k4.x, q4.x, d0);
                d0 = fmaf(k4.y, q4.y, d0);
                d0 = fmaf(k4.z, q4.z, d0);
                d0 = fmaf(k4.w, q4.w, d0);
            }
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) d0 += __shfl_xor_sync(0xffffffffu, d0, off);
            kq = d0;
            kv0 = kv1 = sq0 = sq1 = 0.0f;
            if (fin) {
                const float delta = bt;
#pragma unroll
                for (int r = 0; r < RPT; r += 4) {
                    const float4 k4 = *reinterpret_cast<const float4*>(&kt[r]);
                    const float4 n4 = *reinterpret_cast<const float4*>(&ku[r]);
                    const float4 q4 = *reinterpret_cast<const float4*>(&qu[r]);
                    st[r + 0] = fmaf(gt, st[r + 0], k4.x * delta);
                    kv0 = fmaf(st[r + 0], n4.x, kv0);
                    sq0 = fmaf(st[r + 0], q4.x, sq0);
                    st[r + 1] = fmaf(gt, st[r + 1], k4.y * delta);
                    kv0 = fmaf(st[r + 1], n4.y, kv0);
                    sq0 = fmaf(st[r + 1], q4.y, sq0);
                    st[r + 2] = fmaf(gt, st[r + 2], k4.z * delta);
                    kv1 = fmaf(st[r + 2], n4.z, kv1);
                    sq1 = fmaf(st[r + 2], q4.z, sq1);
                    st[r + 3] = fmaf(gt, st[r + 3], k4.w * delta);
                    kv1 = fmaf(st[r + 3], n4.w, kv1);
                    sq1 = fmaf(st[r + 3], q4.w, sq1);
                    if ((r & 7) == 4) __syncwarp();  // keeps ptxas from loading all of q and k ahead (registers)
                }
            } else {
#pragma unroll
                for (int r = 0; r < RPT; r += 4) {
                    const float4 n4 = *reinterpret_cast<const float4*>(&ku[r]);
                    const float4 q4 = *reinterpret_cast<const float4*>(&qu[r]);
                    kv0 = fmaf(st[r + 0], n4.x, kv0);
                    sq0 = fmaf(st[r + 0], q4.x, sq0);
                    kv0 = fmaf(st[r + 1], n4.y, kv0);
                    sq0 = fmaf(st[r + 1], q4.y, sq0);
                    kv1 = fmaf(st[r + 2], n4.z, kv1);
                    sq1 = fmaf(st[r + 2], q4.z, sq1);
                    kv1 = fmaf(st[r + 3], n4.w, kv1);
                    sq1 = fmaf(st[r + 3], q4.w, sq1);
                    if ((r & 7) == 4) __syncwarp();
                }
            }
        }
#if GDN_COMMIT
        else if (u == commit_at) {
            // the last token's update, only when it commits (verify and later commits never need it)
            const float delta = bt;
#pragma unroll
            for (int r = 0; r < RPT; r += 4) {
                const float4 k4 = *reinterpret_cast<const float4*>(&kt[r]);
                st[r + 0] = fmaf(gt, st[r + 0], k4.x * delta);
                st[r + 1] = fmaf(gt, st[r + 1], k4.y * delta);
                st[r + 2] = fmaf(gt, st[r + 2], k4.z * delta);
                st[r + 3] = fmaf(gt, st[r + 3], k4.w * delta);
                if ((r & 7) == 4) __syncwarp();
            }
        }
        if (fin && u == commit_at) {
#pragma unroll
            for (int r = 0; r < RPT; ++r) st_base[(size_t)r * HV * D] = st[r];
        }
#endif
    }
#else
    for (int t = 0; t < T; ++t) {
        const size_t row = row0 + t;
        const bool more = t + 1 < T;
        // 1. conv + SiLU; v to shared memory, q and k kept in registers; per-16-channel sums of squares of q and k
        float cvs[NCH];
#pragma unroll
        for (int m = 0; m < NCH; ++m) {
            const int e = tid + m * NT;
            float cv = 0.0f;
            if (chan[m] >= 0) {
                const float4 w = __ldg(reinterpret_cast<const float4*>(conv_w) + chan[m]);
                float s = 0.0f;
                s = fmaf(hst[m][0], w.x, s);
                s = fmaf(hst[m][1], w.y, s);
                s = fmaf(hst[m][2], w.z, s);
                s = fmaf(in[m], w.w, s);
                cv = s / (1.0f + expf(-s));
                hst[m][0] = hst[m][1];
                hst[m][1] = hst[m][2];
                hst[m][2] = in[m];
                in[m] = more ? qkv_b[(size_t)(t + 1) * C_ALL + chan[m]] : 0.0f;
                if (e >= 2 * D) vs[e - 2 * D] = cv;
            }
            cvs[m] = cv;
            float sq = e < 2 * D ? cv * cv : 0.0f;
            sq += __shfl_xor_sync(0xffffffffu, sq, 8);
            sq += __shfl_xor_sync(0xffffffffu, sq, 4);
            sq += __shfl_xor_sync(0xffffffffu, sq, 2);
            sq += __shfl_xor_sync(0xffffffffu, sq, 1);
            if (e < 2 * D && (e & 15) == 0) part_qk[e >> 4] = sq;
        }
        // gate and write strength, and the next token's alpha / beta
        if (tid == NT - 1) {
            gb[0] = softplus_decay(ab + dth, ah);
            ab = more ? alpha[(row + 1) * HV + h] : 0.0f;
        } else if (tid == NT - 2) {
            gb[1] = sigmoid_f(ab);
            ab = more ? beta[(row + 1) * HV + h] : 0.0f;
        }
        __syncthreads();

        // 2. L2 norms: each q / k channel's thread scales its value, in the spec's two roundings
#pragma unroll
        for (int m = 0; m < NCH; ++m) {
            const int e = tid + m * NT;
            if (e < 2 * D) {
                const int base = e < D ? 0 : D / 16;
                float tot = 0.0f;
#pragma unroll
                for (int c = 0; c < D / 16; ++c) tot += part_qk[base + c];
                const float r = rsqrtf(tot / (float)D + eps / (float)D);
                const float x = (r * cvs[m]) * inv_sqrt_d;
                if (e < D) qn[kidx(e)] = x;
                else kn[kidx(e - D)] = x;
            }
        }
        __syncthreads();

        // 3. kv_j, the delta rule and the readout: column sums over the RG lanes of the column
        // two partial sums (rows 4q.. and 4q+2..) halve the dependent chain; combined in a fixed order
        float kv0 = 0.0f, kv1 = 0.0f;
#pragma unroll
        for (int r = 0; r < RPT; r += 4) {
            const float4 k4 = *reinterpret_cast<const float4*>(&kn[rg * KPAD + r]);
            kv0 = fmaf(st[r + 0], k4.x, kv0);
            kv0 = fmaf(st[r + 1], k4.y, kv0);
            kv1 = fmaf(st[r + 2], k4.z, kv1);
            kv1 = fmaf(st[r + 3], k4.w, kv1);
        }
        float kv = kv0 + kv1;
        kv = row_sum(kv);
        // read k again below rather than keep RPT values of it live across the butterfly (registers)
        __syncwarp();
        const float gt = gb[0], bt = gb[1];
        const float delta = (vs[col] - gt * kv) * bt;
        float o0 = 0.0f, o1 = 0.0f;
#pragma unroll
        for (int r = 0; r < RPT; r += 4) {
            const float4 k4 = *reinterpret_cast<const float4*>(&kn[rg * KPAD + r]);
            const float4 q4 = *reinterpret_cast<const float4*>(&qn[rg * KPAD + r]);
            st[r + 0] = fmaf(gt, st[r + 0], k4.x * delta);
            o0 = fmaf(st[r + 0], q4.x, o0);
            st[r + 1] = fmaf(gt, st[r + 1], k4.y * delta);
            o0 = fmaf(st[r + 1], q4.y, o0);
            st[r + 2] = fmaf(gt, st[r + 2], k4.z * delta);
            o1 = fmaf(st[r + 2], q4.z, o1);
            st[r + 3] = fmaf(gt, st[r + 3], k4.w * delta);
            o1 = fmaf(st[r + 3], q4.w, o1);
            if ((r & 7) == 4) __syncwarp();  // keeps ptxas from loading all of q and k ahead (registers)
        }
        float o = o0 + o1;
        o = row_sum(o) * inv_sqrt_d;
#if GDN_COMMIT
        if (t + 1 == commit_at) {
#pragma unroll
            for (int r = 0; r < RPT; ++r) st_base[(size_t)r * HV * D] = st[r];
        }
#endif
        // 4. the output norm: per-warp partial of sum_j o_j^2 (each column once: its rg 0 lane)
        float osq = rg == 0 ? o * o : 0.0f;
#pragma unroll
        for (int off = RG; off < 32; off <<= 1) osq += __shfl_xor_sync(0xffffffffu, osq, off);
        const float zt = zz;
        if (rg == 0) zz = more ? z[(row + 1) * N_OUT + h * D + j] : 0.0f;
        if (lane == 0) part_o[t & 1][warp] = osq;
        __syncthreads();
        float tot = 0.0f;
#pragma unroll
        for (int w = 0; w < NW; ++w) tot += part_o[t & 1][w];
#if GDN_NCB > 1
        if (tid == 0) blk_o[t & 1] = tot;
        cluster_sync_all();
        tot = 0.0f;
        float rem[NCB];
#pragma unroll
        for (int c = 0; c < NCB; ++c) rem[c] = c == rank ? blk_o[t & 1] : ld_cluster(&blk_o[t & 1], (unsigned)c);
#pragma unroll
        for (int c = 0; c < NCB; ++c) tot += rem[c];
#endif

        // 5. gated RMS norm, y, planes
        const float rs = rsqrtf(tot / (float)D + eps);
#if GDN_SILU
        const float act = zt * sigmoid_f(zt);
#else
        const float act = sigmoid_f(zt);
#endif
        const float yv = ((rs * o) * gam) * act;
        const size_t yi = row * N_OUT + h * D + j;
        if (rg == 0) {
            out[yi] = yv;
#if GDN_PLANES
            const int jj = j & 15;
            out[plane + yi] = yv * __int_as_float((127 - 2 * (jj & 7)) << 23);
            out[2 * plane + yi] = yv * __int_as_float((127 - 8 * (jj & 3)) << 23);
            out[3 * plane + yi] = (jj & 1) ? yv * 0.00390625f : yv;
            ys[col] = yv;
#endif
        }
#if GDN_PLANES
        __syncthreads();
        if (tid < COLS / 16) {
            float s_even = 0.0f, s_odd = 0.0f;
#pragma unroll
            for (int e = 0; e < 16; e += 2) {
                s_even += ys[16 * tid + e];
                s_odd += ys[16 * tid + e + 1];
            }
            out[4 * plane + row * (N_OUT / 16) + (h * D + rank * COLS) / 16 + tid] = s_even + s_odd;
        }
#endif
#if GDN_COMMIT
        // the history after this token, once every block of the cluster has read its own (before the loop)
        if (t + 1 == commit_at) {
#pragma unroll
            for (int m = 0; m < NCH; ++m) {
                const int e = tid + m * NT;
                const bool mine = e < 2 * D ? (e / QK_PER_RANK) == rank : chan[m] >= 0;
                if (mine) {
                    const int o = hist_off(e, rank);
                    hist_head[o] = hst[m][0];
                    hist_head[o + 1] = hst[m][1];
                    hist_head[o + 2] = hst[m][2];
                }
            }
        }
#endif
    }
#endif  // GDN_V3
#if GDN_NCB > 1
    // no block leaves while another may still read its shared memory
    cluster_sync_all();
#endif
}
