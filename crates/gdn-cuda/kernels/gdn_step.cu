// gdn_step.cu: the whole GDN window step (SPEC.md) in one launch.
//
// Specialised by the host through macros (see src/spec.rs):
//   GDN_D, GDN_HK, GDN_HV   shape (head dim, q/k heads, value heads)
//   GDN_T                   window length, or 0 for a run-time length
//   GDN_SILU                output gate: 0 sigmoid, 1 silu
//   GDN_GROUPED             head map: 0 tiled (h % h_k), 1 grouped (h / (h_v / h_k))
//   GDN_PLANES              0: y only; 1: y, three prepared planes and group sums
//   GDN_COMMIT              0: verify (nothing written back); 1: commit after token `commit_at - 1`
//   GDN_NCB                 column blocks per value head = thread-block cluster size (1, 2, 4, 8)
//   GDN_RG                  row groups: a thread holds D / RG rows of one column of the state
//   GDN_MINB                minimum resident blocks per multiprocessor (register budget)
//
// Work split. Grid (H_V * NCB, B). The NCB blocks of one value head form a cluster; block `rank` owns the
// state columns [rank * COLS, (rank + 1) * COLS) of its head, COLS = D / NCB. Thread (col, rg) holds rows
// [rg * RPT, (rg + 1) * RPT) of column rank * COLS + col in registers: read once before the token loop,
// written once at the commit. Columns are independent in the delta rule and the readout; only the output
// RMS norm couples them: its per-16-column partial sums are exchanged through distributed shared memory.
//
// Every reduction runs in a fixed order (no atomics), so the same inputs give the same bits, and the
// arithmetic of one token does not depend on the window length: a commit after k tokens of a longer window
// is bitwise a k-token commit. The program is compiled with --fmad=false; every fused multiply-add is an
// explicit fmaf.
//
// Conv history: each value head has a private copy of the q/k history it reads, laid out
// [slot][H_V][3 (q, k, v)][D][3]; the blocks of a head read it before the token loop and write it back after
// a cluster barrier that follows those reads, so no other head's blocks ever read what a block writes.

#ifndef GDN_D
#error "GDN_D must be defined"
#endif

#define D GDN_D
#define HK GDN_HK
#define HV GDN_HV
#define NCB GDN_NCB
#define RG GDN_RG
#define COLS (D / NCB)
#define NT (COLS * RG)
#define RPT (D / RG)
#define C_ALL ((2 * HK + HV) * D)
#define N_OUT (HV * D)
#define NE (2 * D + COLS)
#define NCH ((NE + NT - 1) / NT)
#define QK_PER_RANK (2 * D / NCB)

static_assert(D % 16 == 0, "d must be a multiple of 16");
static_assert(COLS % 16 == 0, "a column block must hold whole groups of 16");
static_assert(D % RG == 0 && RPT % 4 == 0, "rows per thread must be a multiple of 4");
static_assert(NT % 32 == 0 && NT <= 1024, "threads per block");
static_assert(HV % HK == 0, "h_v must be a multiple of h_k");

__device__ __forceinline__ float sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }

__device__ __forceinline__ void cluster_sync_all() {
#if GDN_NCB > 1
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#else
    __syncthreads();
#endif
}

#if GDN_NCB > 1
// Reads a float from the shared memory of block `rank` of this cluster, at the address `p` has here.
__device__ __forceinline__ float ld_cluster(const float* p, unsigned rank) {
    unsigned local = (unsigned)__cvta_generic_to_shared(p);
    unsigned remote;
    float v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
    return v;
}
#endif

extern "C" __global__ void __launch_bounds__(NT, GDN_MINB)
#if GDN_NCB > 1
__cluster_dims__(GDN_NCB, 1, 1)
#endif
gdn_step(float* __restrict__ state, float* __restrict__ hist, const float* __restrict__ qkv,
         const float* __restrict__ alpha, const float* __restrict__ beta, const float* __restrict__ z,
         const float* __restrict__ conv_w, const float* __restrict__ dt, const float* __restrict__ ssm_a,
         const float* __restrict__ gamma, float* __restrict__ out, const int* __restrict__ slots, int n_slots, int t_rt,
         int commit_at, long long plane, float eps) {
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
    __shared__ __align__(16) float qs[D];
    __shared__ __align__(16) float ks[D];
    __shared__ float vs[COLS];
    __shared__ float part_qk[2 * D / 16];
    __shared__ float red[RG][COLS];
    __shared__ float red2[RG][COLS];
    __shared__ float part_o[2][COLS / 16];
    __shared__ float gb[2];

    const int tid = threadIdx.x;
    const int h = blockIdx.x / NCB;
    const int rank = blockIdx.x % NCB;
    const int b = blockIdx.y;
    const int slot = slots[b];
    if (slot < 0 || slot >= n_slots) return;  // uniform over the cluster: its blocks share b

#if GDN_GROUPED
    const int g = h / (HV / HK);
#else
    const int g = h % HK;
#endif
    const int col = tid % COLS;
    const int rg = tid / COLS;
    const int j = rank * COLS + col;  // column of the head's state
    const int i0 = rg * RPT;
    const float inv_sqrt_d = 1.0f / sqrtf((float)D);

    // this thread's conv channels: list entry e (q 0..D, k D..2D, v of this block's columns 2D..NE)
    float* hist_head = hist + ((size_t)slot * HV + h) * (3 * D * 3);
    const float* qkv_b = qkv + (size_t)b * T * C_ALL;
    int chan[NCH];
    int hoff[NCH];
    float hst[NCH][3];
    float cw[NCH][4];
    float in[NCH];
#pragma unroll
    for (int m = 0; m < NCH; ++m) {
        const int e = tid + m * NT;
        chan[m] = -1;
        hoff[m] = 0;
        if (e < D) {
            chan[m] = g * D + e;
            hoff[m] = e * 3;
        } else if (e < 2 * D) {
            chan[m] = HK * D + g * D + (e - D);
            hoff[m] = (D + (e - D)) * 3;
        } else if (e < NE) {
            const int jv = rank * COLS + (e - 2 * D);
            chan[m] = 2 * HK * D + h * D + jv;
            hoff[m] = (2 * D + jv) * 3;
        }
        if (chan[m] >= 0) {
            in[m] = qkv_b[chan[m]];
            hst[m][0] = hist_head[hoff[m]];
            hst[m][1] = hist_head[hoff[m] + 1];
            hst[m][2] = hist_head[hoff[m] + 2];
            const float4 w = *reinterpret_cast<const float4*>(conv_w + (size_t)chan[m] * 4);
            cw[m][0] = w.x;
            cw[m][1] = w.y;
            cw[m][2] = w.z;
            cw[m][3] = w.w;
        } else {
            in[m] = 0.0f;
            hst[m][0] = hst[m][1] = hst[m][2] = 0.0f;
            cw[m][0] = cw[m][1] = cw[m][2] = cw[m][3] = 0.0f;
        }
    }
    const float gam = rg == 0 ? gamma[j] : 0.0f;
    const float dth = dt[h];
    const float ah = ssm_a[h];

    // the state: RPT rows of column j, read once
    float* st_base = state + (size_t)slot * D * HV * D + ((size_t)i0 * HV + h) * D + j;
    float st[RPT];
#pragma unroll
    for (int r = 0; r < RPT; ++r) st[r] = st_base[(size_t)r * HV * D];

    for (int t = 0; t < T; ++t) {
        const size_t row = (size_t)b * T + t;
        const float zz = rg == 0 ? z[row * N_OUT + h * D + j] : 0.0f;
        // 1. conv + SiLU; raw q, k, v to shared memory; per-16-channel sums of squares of q and k
#pragma unroll
        for (int m = 0; m < NCH; ++m) {
            const int e = tid + m * NT;
            float cv = 0.0f;
            if (chan[m] >= 0) {
                float s = 0.0f;
                s = fmaf(hst[m][0], cw[m][0], s);
                s = fmaf(hst[m][1], cw[m][1], s);
                s = fmaf(hst[m][2], cw[m][2], s);
                s = fmaf(in[m], cw[m][3], s);
                cv = s / (1.0f + expf(-s));
                hst[m][0] = hst[m][1];
                hst[m][1] = hst[m][2];
                hst[m][2] = in[m];
                in[m] = t + 1 < T ? qkv_b[(size_t)(t + 1) * C_ALL + chan[m]] : 0.0f;
                if (e < D) qs[e] = cv;
                else if (e < 2 * D) ks[e - D] = cv;
                else vs[e - 2 * D] = cv;
            }
            float sq = e < 2 * D ? cv * cv : 0.0f;
            sq += __shfl_xor_sync(0xffffffffu, sq, 8);
            sq += __shfl_xor_sync(0xffffffffu, sq, 4);
            sq += __shfl_xor_sync(0xffffffffu, sq, 2);
            sq += __shfl_xor_sync(0xffffffffu, sq, 1);
            if (e < 2 * D && (e & 15) == 0) part_qk[e >> 4] = sq;
        }
        // gate and write strength
        if (tid == NT - 1) {
            const float u = alpha[row * HV + h] + dth;
            const float ex = expf(u);
            const float w = 1.0f + ex;
            const float sp = u > 20.0f ? u : (w == 1.0f ? ex : logf(w) * ex / (w - 1.0f));
            gb[0] = expf(sp * ah);
        } else if (tid == NT - 2) {
            gb[1] = sigmoid_f(beta[row * HV + h]);
        }
        __syncthreads();

        // 2. L2 norms of q and k (partials summed in chunk order), kv_j partial over this thread's rows
        float tot_q = 0.0f, tot_k = 0.0f;
#pragma unroll
        for (int c = 0; c < D / 16; ++c) {
            tot_q += part_qk[c];
            tot_k += part_qk[D / 16 + c];
        }
        const float rsq = rsqrtf(tot_q / (float)D + eps / (float)D);
        const float rsk = rsqrtf(tot_k / (float)D + eps / (float)D);
        float kv = 0.0f;
#pragma unroll
        for (int r = 0; r < RPT; r += 4) {
            const float4 k4 = *reinterpret_cast<const float4*>(&ks[i0 + r]);
            kv = fmaf(st[r + 0], (rsk * k4.x) * inv_sqrt_d, kv);
            kv = fmaf(st[r + 1], (rsk * k4.y) * inv_sqrt_d, kv);
            kv = fmaf(st[r + 2], (rsk * k4.z) * inv_sqrt_d, kv);
            kv = fmaf(st[r + 3], (rsk * k4.w) * inv_sqrt_d, kv);
        }
        red[rg][col] = kv;
        __syncthreads();

        // 3. delta rule and readout partial
        kv = 0.0f;
#pragma unroll
        for (int q = 0; q < RG; ++q) kv += red[q][col];
        const float gt = gb[0], bt = gb[1];
        const float delta = (vs[col] - gt * kv) * bt;
        float o = 0.0f;
#pragma unroll
        for (int r = 0; r < RPT; r += 4) {
            const float4 k4 = *reinterpret_cast<const float4*>(&ks[i0 + r]);
            const float4 q4 = *reinterpret_cast<const float4*>(&qs[i0 + r]);
            const float kk[4] = {k4.x, k4.y, k4.z, k4.w};
            const float qq[4] = {q4.x, q4.y, q4.z, q4.w};
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const float kh = (rsk * kk[u]) * inv_sqrt_d;
                const float qh = (rsq * qq[u]) * inv_sqrt_d;
                st[r + u] = fmaf(gt, st[r + u], kh * delta);
                o = fmaf(st[r + u], qh, o);
            }
        }
        red2[rg][col] = o;
#if GDN_COMMIT
        if (t + 1 == commit_at) {
#pragma unroll
            for (int r = 0; r < RPT; ++r) st_base[(size_t)r * HV * D] = st[r];
        }
#endif
        __syncthreads();

        // 4. column j's readout, the output norm's per-16-column partials
        o = 0.0f;
        if (rg == 0) {
#pragma unroll
            for (int q = 0; q < RG; ++q) o += red2[q][col];
            o = o * inv_sqrt_d;
        }
        float osq = o * o;
        osq += __shfl_xor_sync(0xffffffffu, osq, 8);
        osq += __shfl_xor_sync(0xffffffffu, osq, 4);
        osq += __shfl_xor_sync(0xffffffffu, osq, 2);
        osq += __shfl_xor_sync(0xffffffffu, osq, 1);
        if (rg == 0 && (col & 15) == 0) part_o[t & 1][col >> 4] = osq;
        cluster_sync_all();

        // 5. gated RMS norm, y, planes
        float tot = 0.0f;
#pragma unroll
        for (int c = 0; c < D / 16; ++c) {
#if GDN_NCB > 1
            const int owner = c / (COLS / 16);
            tot += owner == rank ? part_o[t & 1][c % (COLS / 16)]
                                 : ld_cluster(&part_o[t & 1][c % (COLS / 16)], (unsigned)owner);
#else
            tot += part_o[t & 1][c];
#endif
        }
        const float rs = rsqrtf(tot / (float)D + eps);
#if GDN_SILU
        const float act = zz * sigmoid_f(zz);
#else
        const float act = sigmoid_f(zz);
#endif
        const float yv = ((rs * o) * gam) * act;
        const size_t yi = row * N_OUT + h * D + j;
        if (rg == 0) out[yi] = yv;
#if GDN_PLANES
        {
            const int jj = j & 15;
            const float p1 = yv * __int_as_float((127 - 2 * (jj & 7)) << 23);
            const float p2 = yv * __int_as_float((127 - 8 * (jj & 3)) << 23);
            const float p3 = (jj & 1) ? yv * 0.00390625f : yv;
            if (rg == 0) {
                out[plane + yi] = p1;
                out[2 * plane + yi] = p2;
                out[3 * plane + yi] = p3;
            }
            const int base = (tid & 31) & ~15;
            float s_even = 0.0f, s_odd = 0.0f;
#pragma unroll
            for (int e = 0; e < 16; e += 2) {
                s_even += __shfl_sync(0xffffffffu, yv, base + e);
                s_odd += __shfl_sync(0xffffffffu, yv, base + e + 1);
            }
            if (rg == 0 && jj == 0) out[4 * plane + row * (N_OUT / 16) + (h * D + j) / 16] = s_even + s_odd;
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
                    hist_head[hoff[m]] = hst[m][0];
                    hist_head[hoff[m] + 1] = hst[m][1];
                    hist_head[hoff[m] + 2] = hst[m][2];
                }
            }
        }
#endif
    }
#if GDN_NCB > 1
    // no block leaves while another may still read its shared memory
    cluster_sync_all();
#endif
}
