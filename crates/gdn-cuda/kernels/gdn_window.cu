// gdn_window.cu: the GDN window step (SPEC.md) of windows of a few tokens (the host's window_range), eight tokens
// at a time in the chunked (WY) form with the state in registers (see NOTES.md, "Windows in chunks of eight").
//
// Specialised by the same macros as gdn_step.cu (src/spec.rs writes one header for both): GDN_D, GDN_HK,
// GDN_HV, GDN_T (0: each sequence's own length), GDN_SILU, GDN_GROUPED, GDN_PLANES, GDN_COMMIT, the element types,
// GDN_STATE_DT, GDN_VMAJOR; one block a value head (GDN_NCB 1), D 64 or 128 (its own split, below: GDN_RG
// and GDN_MINB are the token-serial kernel's).
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
// so the state is swept twice a chunk for the two products S0^T k_t and S0^T q_t (all tokens at once: 16
// independent sums a thread) and once for the update, with no barrier between tokens. The update after k
// tokens is S = fmaf(G_{k-1}, S0, k_0 w_0 + k_1 w_1 + ...), w_s = r(k-1, s) d_s. Every sum has one fixed order,
// so a chunk's bits depend only on its own tokens: the committed state after k tokens equals a k-token window's,
// and a sequence's bits do not depend on the call.
//
// Work split: block (value head, sequence) of D * D / 64 threads; a thread holds a tile of 16 rows (keys) x 4
// columns of the state in registers for the whole window, so every key it loads from shared memory feeds four
// columns (shared-memory bandwidth bounds a split of one column a thread: one 16-byte load a 4 multiply-adds).
// Lane l of warp w: row group l / CQ (rows 16 g .. 16 g + 15), columns 4 (w CQ + l % CQ) .. + 3, CQ = 32 / RG
// column quads a warp, RG = D / 16 row groups. Sums over rows are butterflies over the RG lanes of a column; the
// per-column work (the deltas' forward substitution, the readout, the norm) runs on one thread a column, through
// shared memory.

#define D GDN_D
#define HK GDN_HK
#define HV GDN_HV
#define RG (D / 16)
#define CQ (32 / RG)
#define NT (D * D / 64)
#define NW (NT / 32)
#define C_ALL ((2 * HK + HV) * D)
#define N_OUT (HV * D)
#define NE (3 * D)
#define NCH ((NE + NT - 1) / NT)
#define CH 8

static_assert(GDN_NCB == 1, "one block a value head");
static_assert(D == 64 || D == 128, "d 64 or 128");
static_assert(HV % HK == 0, "h_v must be a multiple of h_k");

typedef Elt<GDN_QKV_DT> EQ;
typedef Elt<GDN_ALPHA_DT> EA;
typedef Elt<GDN_BETA_DT> EB;
typedef Elt<GDN_Z_DT> EZ;
typedef Elt<GDN_OUT_DT> EO;
typedef Elt<GDN_STATE_DT> ES;

// the sum over the RG lanes of a column (the row groups), the same bits in each
__device__ __forceinline__ float rows_sum(float x) {
#pragma unroll
    for (int off = CQ; off < 32; off <<= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
    return x;
}

// the pair (t, s) of dot product number p: p < 28 the keys' k_t . k_s (s < t), else q_t . k_s (s <= t)
__device__ __forceinline__ void dot_pair(int p, int& t, int& s, bool& qk) {
    qk = p >= CH * (CH - 1) / 2;
    int q = qk ? p - CH * (CH - 1) / 2 : p;
    int row = qk ? 0 : 1;
    while (q >= (qk ? row + 1 : row)) {
        q -= qk ? row + 1 : row;
        ++row;
    }
    t = row;
    s = q;
}

__device__ __forceinline__ float4 ld4(const float* p) { return *reinterpret_cast<const float4*>(p); }

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
    __shared__ __align__(16) float qn[CH][D];
    __shared__ __align__(16) float kn[CH][D];
    __shared__ float vs[CH][D];
    __shared__ float zs[CH][D];                 // the output gate's input, widened
    __shared__ __align__(16) float pks[CH][D];  // S0^T k_t
    __shared__ __align__(16) float pqs[CH][D];  // S0^T q_t
    __shared__ float os[CH][D];                 // the readout before the norm
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
    const int rg = lane / CQ;                      // row group: rows 16 rg .. + 15
    const int j0 = 4 * (warp * CQ + lane % CQ);    // the tile's first column
    const float inv_sqrt_d = 1.0f / sqrtf((float)D);

    int chan[NCH];
#pragma unroll
    for (int m = 0; m < NCH; ++m) {
        const int e = tid + m * NT;
        chan[m] = e < D ? g * D + e : e < 2 * D ? HK * D + g * D + (e - D) : e < NE ? 2 * HK * D + h * D + (e - 2 * D) : -1;
    }
    // the per-column work's column (threads below D)
    const int jc = tid;
    const float gam = jc < D ? gamma[jc] : 0.0f;
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

    // the state tile: st[r][c] = S[key 16 rg + r][column j0 + c]
    ES::T* const sbase = state + (size_t)slot * D * HV * D;
    float st[16][4];
#if GDN_VMAJOR
    // S[h][j][i]: each column's 16 keys contiguous
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        const ES::T* p = sbase + ((size_t)h * D + j0 + c) * D + 16 * rg;
#if GDN_STATE_DT == 0
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const float4 w = ld4(p + 4 * q);
            st[4 * q][c] = w.x;
            st[4 * q + 1][c] = w.y;
            st[4 * q + 2][c] = w.z;
            st[4 * q + 3][c] = w.w;
        }
#else
#pragma unroll
        for (int q = 0; q < 2; ++q) {
            const uint4 w = *reinterpret_cast<const uint4*>(p + 8 * q);
            const unsigned u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                st[8 * q + 2 * e][c] = __uint_as_float(u[e] << 16);
                st[8 * q + 2 * e + 1][c] = __uint_as_float(u[e] & 0xffff0000u);
            }
        }
#endif
    }
#else
    // S[i][h][j]: each key's 4 columns contiguous
#pragma unroll
    for (int r = 0; r < 16; ++r) {
        const ES::T* p = sbase + ((size_t)(16 * rg + r) * HV + h) * D + j0;
#if GDN_STATE_DT == 0
        const float4 w = ld4(p);
        st[r][0] = w.x;
        st[r][1] = w.y;
        st[r][2] = w.z;
        st[r][3] = w.w;
#else
        const uint2 w = *reinterpret_cast<const uint2*>(p);
        st[r][0] = __uint_as_float(w.x << 16);
        st[r][1] = __uint_as_float(w.x & 0xffff0000u);
        st[r][2] = __uint_as_float(w.y << 16);
        st[r][3] = __uint_as_float(w.y & 0xffff0000u);
#endif
    }
#endif

    // stores rows 4 q .. 4 q + 3 of the tile (v[r][c]), rounded once for a bf16 pool
    auto store4 = [&](int q, const float (*v)[4]) {
#if GDN_VMAJOR
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            ES::T* p = sbase + ((size_t)h * D + j0 + c) * D + 16 * rg + 4 * q;
#if GDN_STATE_DT == 0
            *reinterpret_cast<float4*>(p) = make_float4(v[0][c], v[1][c], v[2][c], v[3][c]);
#else
            *reinterpret_cast<uint2*>(p) = make_uint2((unsigned)ES::st(v[0][c]) | ((unsigned)ES::st(v[1][c]) << 16),
                                                      (unsigned)ES::st(v[2][c]) | ((unsigned)ES::st(v[3][c]) << 16));
#endif
        }
#else
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            ES::T* p = sbase + ((size_t)(16 * rg + 4 * q + r) * HV + h) * D + j0;
#if GDN_STATE_DT == 0
            *reinterpret_cast<float4*>(p) = make_float4(v[r][0], v[r][1], v[r][2], v[r][3]);
#else
            *reinterpret_cast<uint2*>(p) = make_uint2((unsigned)ES::st(v[r][0]) | ((unsigned)ES::st(v[r][1]) << 16),
                                                      (unsigned)ES::st(v[r][2]) | ((unsigned)ES::st(v[r][3]) << 16));
#endif
        }
#endif
    };

    for (int c0 = 0; c0 < T; c0 += CH) {
        const int tc = T - c0 < CH ? T - c0 : CH;  // tokens of this chunk
        const size_t row0 = (size_t)start + c0;
        // the commit inside this chunk, as a count of its tokens (0: none here)
        const int cl = commit_at > c0 && commit_at <= c0 + CH ? commit_at - c0 : 0;
        const bool more = c0 + CH < T;

        // 1. every token's inputs in flight at once; conv + SiLU per channel, token after token
        EQ::T in[NCH][CH];
#pragma unroll
        for (int m = 0; m < NCH; ++m)
#pragma unroll
            for (int t = 0; t < CH; ++t)
                in[m][t] = chan[m] >= 0 && t < tc ? qkv_b[(size_t)(c0 + t) * C_ALL + chan[m]] : (EQ::T)0;
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
                    cv = s / (1.0f + expf(-s));
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
                        if (e < D) qn[t][e] = x;
                        else kn[t][e - D] = x;
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

        // 3. S0^T k_t and S0^T q_t for every token of the chunk: each key read once from shared memory for the
        // tile's four columns, one sum a column over the tile's rows (in row order), then over the row groups
        for (int t = 0; t < tc; ++t) {
            float ak[4] = {0.0f, 0.0f, 0.0f, 0.0f}, aq[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const float4 k4 = ld4(&kn[t][16 * rg + 4 * q]);
                const float4 q4 = ld4(&qn[t][16 * rg + 4 * q]);
                const float kk[4] = {k4.x, k4.y, k4.z, k4.w}, qq[4] = {q4.x, q4.y, q4.z, q4.w};
#pragma unroll
                for (int r = 0; r < 4; ++r)
#pragma unroll
                    for (int c = 0; c < 4; ++c) {
                        ak[c] = fmaf(st[4 * q + r][c], kk[r], ak[c]);
                        aq[c] = fmaf(st[4 * q + r][c], qq[r], aq[c]);
                    }
            }
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                ak[c] = rows_sum(ak[c]);
                aq[c] = rows_sum(aq[c]);
            }
            if (rg == 0) {
                *reinterpret_cast<float4*>(&pks[t][j0]) = make_float4(ak[0], ak[1], ak[2], ak[3]);
                *reinterpret_cast<float4*>(&pqs[t][j0]) = make_float4(aq[0], aq[1], aq[2], aq[3]);
            }
        }
        // the chunk's dot products k_t . k_s (s < t) and q_t . k_s (s <= t), times r(t, s): warp-strided pairs,
        // each a lane-strided sum and a butterfly (a fixed order)
        for (int p = warp; p < CH * (CH - 1) / 2 + CH * (CH + 1) / 2; p += NW) {
            int t, s;
            bool isq;
            dot_pair(p, t, s, isq);
            if (t >= tc) continue;  // uniform over the warp
            const float* a = isq ? qn[t] : kn[t];
            float acc = 0.0f;
#pragma unroll
            for (int i = lane; i < D; i += 32) acc = fmaf(a[i], kn[s][i], acc);
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
            if (lane == 0) {
                if (isq) aqk[t][s] = rat[t][s] * acc;
                else akk[t][s] = rat[t][s] * acc;
            }
        }
        __syncthreads();

        // 4. one thread a column: the deltas by forward substitution, the readout and its squares, the update
        // weights
        if (jc < D) {
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
            for (int t = 0; t < CH; ++t) {
                if (t < tc) {
                    float x = gcum[t] * pqs[t][jc];
#pragma unroll
                    for (int s = 0; s <= t; ++s) x = fmaf(aqk[t][s], dl[s], x);
                    const float ov = x * inv_sqrt_d;
                    os[t][jc] = ov;
                    float osq = ov * ov;
#pragma unroll
                    for (int off = 16; off > 0; off >>= 1) osq += __shfl_xor_sync(0xffffffffu, osq, off);
                    if (lane == 0) part_o[t][warp] = osq;
                }
            }
            // w_s = r(n - 1, s) d_s for the commit (n = cl) and for a chunk end the window goes on from
            auto weights = [&](int n, float (*ws)[D]) {
#pragma unroll
                for (int s = 0; s < CH; ++s)
                    if (s < n) ws[s][jc] = s + 1 < n ? rat[n - 1][s] * dl[s] : dl[s];
            };
            if (cl > 0) weights(cl, wsc);
            if (more && cl != tc) weights(tc, wse);
        }
        __syncthreads();

        // 5. gated RMS norm, y, planes (one thread a column; each in f32, rounded once)
        if (jc < D) {
#pragma unroll
            for (int t = 0; t < CH; ++t) {
                if (t < tc) {
                    const float tot = Tree<D / 32>::sum(part_o[t]);
                    const float rs = rsqrtf(tot / (float)D + eps);
                    const float zt = zs[t][jc];
#if GDN_SILU
                    const float act = zt * sigmoid_f(zt);
#else
                    const float act = sigmoid_f(zt);
#endif
                    const float yv = ((rs * os[t][jc]) * gam) * act;
                    const size_t yi = (row0 + t) * N_OUT + h * D + jc;
                    out[yi] = EO::st(yv);
#if GDN_PLANES
                    const int jj = jc & 15;
                    out[plane + yi] = EO::st(yv * __int_as_float((127 - 2 * (jj & 7)) << 23));
                    out[2 * plane + yi] = EO::st(yv * __int_as_float((127 - 8 * (jj & 3)) << 23));
                    out[3 * plane + yi] = EO::st((jj & 1) ? yv * 0.00390625f : yv);
                    ys[t][jc] = yv;
#endif
                }
            }
        }

        // 6. the state after n tokens of the chunk, fmaf(G_{n-1}, S0, k_0 w_0 + ... + k_{n-1} w_{n-1}): stored
        // (the commit) and / or kept in the registers (the next chunk starts from it)
        auto advance = [&](int n, const float (*ws)[D], bool keep, bool store) {
            const float gn = gcum[n - 1];
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                float u[4][4];
                {
                    const float4 k4 = ld4(&kn[0][16 * rg + 4 * q]);
                    const float4 w4 = ld4(&ws[0][j0]);
                    const float kk[4] = {k4.x, k4.y, k4.z, k4.w}, ww[4] = {w4.x, w4.y, w4.z, w4.w};
#pragma unroll
                    for (int r = 0; r < 4; ++r)
#pragma unroll
                        for (int c = 0; c < 4; ++c) u[r][c] = kk[r] * ww[c];
                }
                for (int s = 1; s < n; ++s) {
                    const float4 k4 = ld4(&kn[s][16 * rg + 4 * q]);
                    const float4 w4 = ld4(&ws[s][j0]);
                    const float kk[4] = {k4.x, k4.y, k4.z, k4.w}, ww[4] = {w4.x, w4.y, w4.z, w4.w};
#pragma unroll
                    for (int r = 0; r < 4; ++r)
#pragma unroll
                        for (int c = 0; c < 4; ++c) u[r][c] = fmaf(kk[r], ww[c], u[r][c]);
                }
#pragma unroll
                for (int r = 0; r < 4; ++r)
#pragma unroll
                    for (int c = 0; c < 4; ++c) u[r][c] = fmaf(gn, st[4 * q + r][c], u[r][c]);
                if (store) store4(q, u);
                if (keep) {
#pragma unroll
                    for (int r = 0; r < 4; ++r)
#pragma unroll
                        for (int c = 0; c < 4; ++c) st[4 * q + r][c] = u[r][c];
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
