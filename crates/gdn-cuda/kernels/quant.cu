// The quantized out_proj (SPEC.md, "The quantized out_proj"): out[r][o] = sum_g scale[o][g] (sum_{m in g}
// field(word, m) x[r][m]) - zs[o][g] gsum[r][g], affine groups of 16 input columns.
//
// Planes path: a field is masked in place, never shifted; x is the plane whose scale undoes the field's bit
// position within its 16- or 32-bit word, so (word & mask_m) x[m] = q_m y_m. Shift path: x is y itself and each
// field is shifted down first; its group sums come from a pass of their own (group_sums below).
//
// A masked field becomes a float without a conversion instruction (16 a clock per SM on sm_90, against 64
// logic and 128 FP32 ops): its bits are ORed under the exponent of 2^23 and 2^23 subtracted, exact for any
// value below 2^23. A 16-bit packing's words come two to a u32; the upper word is moved down once per u32 (one
// shift per 8 or 2 fields, the fields in it still masked in place). For 8-bit fields four to a u32, fields 2
// and 3 are masked in the upper half moved down and take their 2^16 back in the same FMA that removes 2^23
// (exact: the product is a representable integer).
//
// Compiled by NVRTC with TT (tokens a block), ROWS_0..2 (output rows a block, by packing), WARPS (most warps a
// block), MIN_BLOCKS (the occupancy asked of ptxas) and STREAM_HINT defined ahead of this source (src/quant.rs).

typedef unsigned int u32;
typedef unsigned short u16;

#ifndef TT
#define TT 8
#endif
#ifndef ROWS_0
#define ROWS_0 4
#endif
#ifndef ROWS_1
#define ROWS_1 2
#endif
#ifndef ROWS_2
#define ROWS_2 2
#endif
#ifndef WARPS
#define WARPS 4
#endif
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 1
#endif
#ifndef STREAM_HINT
#define STREAM_HINT 1
#endif
// the bf16 baseline's layout: 4 warps a block, 4 rows a warp
#define BF_ROWS 4
#define BF_WARPS 4

__device__ __forceinline__ float from_masked(u32 bits) {
    return __uint_as_float(0x4B000000u | bits) - 8388608.0f;
}

// the same, times 2^16: (2^23 + v) 2^16 - 2^39 = v 2^16, one FMA, exact
__device__ __forceinline__ float from_masked_hi(u32 bits) {
    return fmaf(__uint_as_float(0x4B000000u | bits), 65536.0f, -549755813888.0f);
}

// A row's groups on the device are padded to a multiple of 4 (zero words, scales and zero terms, never
// summed): a lane's quad of 4 consecutive groups is then one 16-byte load of scales, one of zero terms and,
// 2-bit, one of words; an 8-bit group's 4 words are one 16-byte load, and the host permutes them so that a
// warp's j-th group loads are 512 contiguous bytes (see src/quant.rs, `device_words`).
//
// Order of a row's sum (fixed by n alone, so the same in every module, tile and launch): quad q = 32 i + l goes
// to lane l of part i; a lane sums its quad's groups in order from 0 (per group two chains of 8 products, then
// the scale and the zero term); the part's 32 lane sums meet in a butterfly (offsets 16, 8, 4, 2, 1); the parts'
// sums are added in order of i. A block owns ROWS rows and TT tokens; its warps take the parts (warp w: parts
// w, w + warps, ...), so every 16-byte load of a warp is issued before its first use and no warp loops over
// more than a third of a seed row (n 6144: 3 parts, 3 warps a block).

__device__ __forceinline__ uint4 ld_stream(const u32* p) {
#if STREAM_HINT
    // weights are read once a step: keep them out of L1 (the activations live there), fetch 256-byte runs
    uint4 r;
    asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p));
    return r;
#else
    return __ldg(reinterpret_cast<const uint4*>(p));
#endif
}

__device__ __forceinline__ u32 part_of(uint4 q, int j) {
    return j == 0 ? q.x : j == 1 ? q.y : j == 2 ? q.z : q.w;
}

// One group's 16 fields into v: planes path (masked in place) or shift path (shifted down). PACK 0: 2-bit,
// eight to a u16, the group's u32 `word`; 1: 8-bit four to a u32; 2: 8-bit two to a u16 (the group's 4 u32 in q).
template <int PACK, bool SHIFT>
__device__ __forceinline__ void decode(u32 word, uint4 q, float v[16]) {
    if (PACK == 0) {
        u32 hi = word >> 16;
#pragma unroll
        for (int e = 0; e < 8; e++) {
            if (SHIFT) {
                v[e] = from_masked((word >> (2 * e)) & 3u);
                v[8 + e] = from_masked((word >> (16 + 2 * e)) & 3u);
            } else {
                v[e] = from_masked(word & (3u << (2 * e)));
                v[8 + e] = from_masked(hi & (3u << (2 * e)));
            }
        }
    } else {
#pragma unroll
        for (int k = 0; k < 4; k++) {
            u32 w = part_of(q, k);
            if (SHIFT) {
#pragma unroll
                for (int e = 0; e < 4; e++) v[4 * k + e] = from_masked((w >> (8 * e)) & 255u);
            } else {
                u32 hi = w >> 16;
                v[4 * k + 0] = from_masked(w & 0xFFu);
                v[4 * k + 1] = from_masked(w & 0xFF00u);
                if (PACK == 1) {
                    v[4 * k + 2] = from_masked_hi(hi & 0xFFu);
                    v[4 * k + 3] = from_masked_hi(hi & 0xFF00u);
                } else {
                    v[4 * k + 2] = from_masked(hi & 0xFFu);
                    v[4 * k + 3] = from_masked(hi & 0xFF00u);
                }
            }
        }
    }
}

template <int PACK>
struct Rows {
    static constexpr int value = PACK == 0 ? ROWS_0 : PACK == 1 ? ROWS_1 : ROWS_2;
};

template <int PACK, bool SHIFT>
__device__ __forceinline__ void product(const u32* __restrict__ words, const float* __restrict__ scale,
                                        const float* __restrict__ zs, const float* __restrict__ x,
                                        const float* __restrict__ gsum, float* __restrict__ out, int hidden,
                                        int n, int tokens) {
    constexpr int R = Rows<PACK>::value;
    constexpr int WQ = PACK == 0 ? 1 : 4;
    const int groups = n / 16;
    const int gp = (groups + 3) & ~3;
    const int quads = gp >> 2;
    const int parts = (quads + 31) >> 5;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int nw = blockDim.x >> 5;
    const int o0 = blockIdx.x * R;
    const int t0 = blockIdx.y * TT;
    const int nt = min(TT, tokens - t0);
    // [parts][R][TT]: each part's butterflied sums, added in order of the part at the end
    extern __shared__ float part_sums[];
    for (int i = warp; i < parts; i += nw) {
        const int q = 32 * i + lane;
        const int width = min(32, quads - 32 * i);
        float acc[R][TT];
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int t = 0; t < TT; t++) acc[r][t] = 0.0f;
        if (q < quads) {
            uint4 wq[R][WQ], sq[R], zq[R];
#pragma unroll
            for (int r = 0; r < R; r++) {
                // rows past hidden repeat the last row (their sums are not stored)
                const size_t row = (size_t)min(o0 + r, hidden - 1) * gp;
                if (PACK == 0) {
                    wq[r][0] = ld_stream(words + row + 4 * q);
                } else {
                    const u32* base = words + 4 * (row + 128 * i + lane);
#pragma unroll
                    for (int j = 0; j < 4; j++) wq[r][j] = ld_stream(base + 4 * j * width);
                }
                sq[r] = ld_stream(reinterpret_cast<const u32*>(scale) + row + 4 * q);
                zq[r] = ld_stream(reinterpret_cast<const u32*>(zs) + row + 4 * q);
            }
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int g = 4 * q + j;
                if (g < groups) {
                    float v[R][16];
#pragma unroll
                    for (int r = 0; r < R; r++)
                        decode<PACK, SHIFT>(part_of(wq[r][0], j), wq[r][PACK == 0 ? 0 : j], v[r]);
#pragma unroll
                    for (int t = 0; t < TT; t++) {
                        if (t < nt) {
                            const float4* xp = reinterpret_cast<const float4*>(x + (size_t)(t0 + t) * n + 16 * g);
                            float xv[16];
#pragma unroll
                            for (int k = 0; k < 4; k++) {
                                float4 f = __ldg(xp + k);
                                xv[4 * k] = f.x;
                                xv[4 * k + 1] = f.y;
                                xv[4 * k + 2] = f.z;
                                xv[4 * k + 3] = f.w;
                            }
                            const float gs = __ldg(gsum + (size_t)(t0 + t) * groups + g);
#pragma unroll
                            for (int r = 0; r < R; r++) {
                                // two chains of 8 for latency, then the group's scale and zero term
                                float a = 0.0f, b = 0.0f;
#pragma unroll
                                for (int e = 0; e < 16; e += 2) {
                                    a = fmaf(v[r][e], xv[e], a);
                                    b = fmaf(v[r][e + 1], xv[e + 1], b);
                                }
                                const float s = __uint_as_float(part_of(sq[r], j));
                                const float z = __uint_as_float(part_of(zq[r], j));
                                acc[r][t] = fmaf(-z, gs, fmaf(s, a + b, acc[r][t]));
                            }
                        }
                    }
                }
            }
        }
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int t = 0; t < TT; t++) {
                float a = acc[r][t];
#pragma unroll
                for (int off = 16; off > 0; off >>= 1) a += __shfl_xor_sync(0xffffffffu, a, off);
                if (lane == 0) part_sums[(i * R + r) * TT + t] = a;
            }
    }
    __syncthreads();
    for (int k = threadIdx.x; k < R * TT; k += blockDim.x) {
        const int r = k / TT, t = k % TT;
        if (t < nt && o0 + r < hidden) {
            float s = part_sums[r * TT + t];
            for (int i = 1; i < parts; i++) s += part_sums[(i * R + r) * TT + t];
            out[(size_t)(t0 + t) * hidden + o0 + r] = s;
        }
    }
}

#define ENTRY(name, PACK, SHIFT)                                                                              \
    extern "C" __global__ void __launch_bounds__(32 * WARPS, MIN_BLOCKS)                                      \
        name(const u32* __restrict__ words, const float* __restrict__ scale, const float* __restrict__ zs,   \
             const float* __restrict__ x, const float* __restrict__ gsum, float* __restrict__ out, int hidden, \
             int n, int tokens) {                                                                             \
        product<PACK, SHIFT>(words, scale, zs, x, gsum, out, hidden, n, tokens);                              \
    }

ENTRY(q_planes_0, 0, false)
ENTRY(q_planes_1, 1, false)
ENTRY(q_planes_2, 2, false)
ENTRY(q_shift_0, 0, true)
ENTRY(q_shift_1, 1, true)
ENTRY(q_shift_2, 2, true)

// The shift path's own pass: group sums of y [rows][n] as the step writes them (even columns' sum plus odd
// columns', each in increasing order), one thread a group.
extern "C" __global__ void group_sums(const float* __restrict__ y, float* __restrict__ gsum, int count) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= count) return;
    const float4* p = reinterpret_cast<const float4*>(y + (size_t)i * 16);
    float even = 0.0f, odd = 0.0f;
#pragma unroll
    for (int k = 0; k < 4; k++) {
        float4 f = __ldg(p + k);
        even += f.x;
        odd += f.y;
        even += f.z;
        odd += f.w;
    }
    gsum[i] = even + odd;
}

// Plain bf16 weights [hidden][n] against f32 y [tokens][n]: the unquantized tail. A lane takes 8 columns (one
// 16-byte load a row) at a time; a warp owns BF_ROWS rows, a block BF_WARPS warps.
extern "C" __global__ void __launch_bounds__(32 * BF_WARPS)
    bf16_product(const u16* __restrict__ w, const float* __restrict__ x, float* __restrict__ out, int hidden,
                 int n, int tokens) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int o0 = (blockIdx.x * BF_WARPS + warp) * BF_ROWS;
    const int t0 = blockIdx.y * TT;
    if (o0 >= hidden) return;
    const int nt = min(TT, tokens - t0);
    const int chunks = n / 8;
    float acc[BF_ROWS][TT];
#pragma unroll
    for (int r = 0; r < BF_ROWS; r++)
#pragma unroll
        for (int t = 0; t < TT; t++) acc[r][t] = 0.0f;
#pragma unroll 2
    for (int c = lane; c < chunks; c += 32) {
        float v[BF_ROWS][8];
#pragma unroll
        for (int r = 0; r < BF_ROWS; r++) {
            const int o = min(o0 + r, hidden - 1);
            uint4 q = __ldg(reinterpret_cast<const uint4*>(w + (size_t)o * n) + c);
            u32 words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
            for (int k = 0; k < 4; k++) {
                v[r][2 * k] = __uint_as_float(words[k] << 16);
                v[r][2 * k + 1] = __uint_as_float(words[k] & 0xFFFF0000u);
            }
        }
#pragma unroll
        for (int t = 0; t < TT; t++) {
            if (t < nt) {
                const float4* xp = reinterpret_cast<const float4*>(x + (size_t)(t0 + t) * n + 8 * c);
                float4 f0 = __ldg(xp), f1 = __ldg(xp + 1);
                float xv[8] = {f0.x, f0.y, f0.z, f0.w, f1.x, f1.y, f1.z, f1.w};
#pragma unroll
                for (int r = 0; r < BF_ROWS; r++) {
                    float a = acc[r][t];
#pragma unroll
                    for (int e = 0; e < 8; e++) a = fmaf(v[r][e], xv[e], a);
                    acc[r][t] = a;
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < BF_ROWS; r++)
#pragma unroll
        for (int t = 0; t < TT; t++) {
            float a = acc[r][t];
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) a += __shfl_xor_sync(0xffffffffu, a, off);
            if (lane == 0 && t < nt && o0 + r < hidden) out[(size_t)(t0 + t) * hidden + o0 + r] = a;
        }
}

// Launch latency reference for the benchmark.
extern "C" __global__ void empty_kernel() {}
