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
// Threads: see `product` (a block of WARPS warps owns ROWS output rows and TT tokens; the warps split the
// columns). The fields are decoded once for the TT tokens, each token's activations loaded once for the ROWS
// rows.
//
// Compiled by NVRTC with -DROWS=.. -DTT=.. (see src/quant.rs).

typedef unsigned int u32;
typedef unsigned short u16;

#ifndef ROWS
#define ROWS 4
#endif
#ifndef TT
#define TT 8
#endif
#define WARPS 4
// blocks an SM should hold (a register cap for ptxas): the decode tile keeps several blocks' loads in flight
#if TT == 1
#define MIN_BLOCKS 4
#else
#define MIN_BLOCKS 2
#endif
// spans of 512 columns a warp loads at once: 2-bit, whose span is 1.5 KB a row, all 3 a warp has at n 6144;
// 8-bit (3 KB a span and row) one
#define SPANS_2BIT 3

__device__ __forceinline__ float from_masked(u32 bits) {
    return __uint_as_float(0x4B000000u | bits) - 8388608.0f;
}

// the same, times 2^16: (2^23 + v) 2^16 - 2^39 = v 2^16, one FMA, exact
__device__ __forceinline__ float from_masked_hi(u32 bits) {
    return fmaf(__uint_as_float(0x4B000000u | bits), 65536.0f, -549755813888.0f);
}

// The 4 fields of one lane's u32 `raw` (its 4 consecutive columns, the first at field e0 of their group) as
// floats: planes path (masked in place; a 2-bit lane's fields sit in the low or high u16, `half` 0 or 16, from
// bit `sh`) or shift path (each shifted down). PACK 0: 2-bit, eight to a u16; 1: 8-bit four to a u32; 2: 8-bit
// two to a u16.
template <int PACK, bool SHIFT>
__device__ __forceinline__ void decode4(u32 raw, int half, int sh, float v[4]) {
    if (PACK == 0) {
        if (SHIFT) {
#pragma unroll
            for (int j = 0; j < 4; j++) v[j] = from_masked((raw >> (half + sh + 2 * j)) & 3u);
        } else {
            const u32 w = raw >> half;
#pragma unroll
            for (int j = 0; j < 4; j++) v[j] = from_masked(w & (3u << (sh + 2 * j)));
        }
    } else if (SHIFT) {
#pragma unroll
        for (int j = 0; j < 4; j++) v[j] = from_masked((raw >> (8 * j)) & 255u);
    } else {
        const u32 hi = raw >> 16;
        v[0] = from_masked(raw & 0xFFu);
        v[1] = from_masked(raw & 0xFF00u);
        if (PACK == 1) {
            v[2] = from_masked_hi(hi & 0xFFu);
            v[3] = from_masked_hi(hi & 0xFF00u);
        } else {
            v[2] = from_masked(hi & 0xFFu);
            v[3] = from_masked(hi & 0xFF00u);
        }
    }
}

// A block owns ROWS output rows and TT tokens (blockIdx.y); its WARPS warps split the columns in spans of 512
// (32 groups; warp w takes spans w, w + WARPS, ..., SPANS of them at a time), and in a span lane l takes
// columns 4 l + 128 k (k = 0..3): each 16-byte activation load of a warp is 512 contiguous bytes, an 8-bit row's
// words 128 contiguous bytes. A span's 32 scales, zero terms and (2-bit) words of a row are loaded one a lane,
// coalesced, and handed to the lanes that use them by shuffles (so a register holds 4 distinct bytes in flight,
// not 1). A lane's 4 columns lie in one group (the scale multiplies their partial sum); the lane holding a
// group's first 4 columns adds its zero term. Partial sums meet by shuffles, then across the warps in a fixed
// order through shared memory (no atomics: the same bits on every run, and a token's arithmetic does not depend
// on the tile).
template <int PACK, bool SHIFT>
__device__ __forceinline__ void product(const u32* __restrict__ words, const float* __restrict__ scale,
                                        const float* __restrict__ zs, const float* __restrict__ x,
                                        const float* __restrict__ gsum, float* __restrict__ out, int hidden,
                                        int n, int tokens) {
    __shared__ float part[WARPS][ROWS][TT];
    const int groups = n / 16;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int o0 = blockIdx.x * ROWS;
    const int t0 = blockIdx.y * TT;
    const int nt = min(TT, tokens - t0);
    const int e0 = 4 * (lane & 3);
    const int half = e0 >= 8 ? 16 : 0;
    const int sh = 2 * (e0 & 7);
    const bool zero_lane = e0 == 0;
    float acc[ROWS][TT];
#pragma unroll
    for (int r = 0; r < ROWS; r++)
#pragma unroll
        for (int t = 0; t < TT; t++) acc[r][t] = 0.0f;
    constexpr int SPANS = PACK == 0 ? SPANS_2BIT : 1;
    for (int base = warp * 512; base < n; base += WARPS * 512 * SPANS) {
        // every load of SPANS spans first, then the arithmetic
        u32 wl[SPANS][ROWS];          // 2-bit: the lane's group's word
        u32 raw[SPANS][4][ROWS];      // 8-bit: the lane's own words
        float sl[SPANS][ROWS], zl[SPANS][ROWS];
#pragma unroll
        for (int q = 0; q < SPANS; q++) {
            const int span = base + q * WARPS * 512;
            // past n: clamped loads, no arithmetic
            const int g = min(span / 16 + lane, groups - 1);
#pragma unroll
            for (int r = 0; r < ROWS; r++) {
                const size_t o = (size_t)min(o0 + r, hidden - 1);
                const size_t gi = o * groups + g;
                sl[q][r] = __ldg(scale + gi);
                zl[q][r] = __ldg(zs + gi);
                if (PACK == 0) {
                    wl[q][r] = __ldg(words + gi);
                } else {
#pragma unroll
                    for (int k = 0; k < 4; k++) {
                        const int col = min(span + 128 * k + 4 * lane, n - 4);
                        raw[q][k][r] = __ldg(words + o * (size_t)(n / 4) + col / 4);
                    }
                }
            }
        }
#pragma unroll
        for (int q = 0; q < SPANS; q++) {
            const int span = base + q * WARPS * 512;
            if (span >= n) break;
#pragma unroll
            for (int k = 0; k < 4; k++) {
                // the lane holding this lane's group (8 k + l / 4 of the span)
                const int src = 8 * k + (lane >> 2);
                const int col = span + 128 * k + 4 * lane;
                float v[ROWS][4], s[ROWS], z[ROWS];
#pragma unroll
                for (int r = 0; r < ROWS; r++) {
                    s[r] = __shfl_sync(0xffffffffu, sl[q][r], src);
                    z[r] = __shfl_sync(0xffffffffu, zl[q][r], src);
                    const u32 w = PACK == 0 ? __shfl_sync(0xffffffffu, wl[q][r], src) : raw[q][k][r];
                    decode4<PACK, SHIFT>(w, half, sh, v[r]);
                }
                if (col >= n) continue;
                const int g = col / 16;
#pragma unroll
                for (int t = 0; t < TT; t++) {
                    if (t < nt) {
                        const float4 xv =
                            __ldg(reinterpret_cast<const float4*>(x + (size_t)(t0 + t) * n + col));
                        const float gs = zero_lane ? __ldg(gsum + (size_t)(t0 + t) * groups + g) : 0.0f;
#pragma unroll
                        for (int r = 0; r < ROWS; r++) {
                            float a = v[r][0] * xv.x;
                            a = fmaf(v[r][1], xv.y, a);
                            a = fmaf(v[r][2], xv.z, a);
                            a = fmaf(v[r][3], xv.w, a);
                            const float c = fmaf(s[r], a, acc[r][t]);
                            acc[r][t] = zero_lane ? fmaf(-z[r], gs, c) : c;
                        }
                    }
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS; r++)
#pragma unroll
        for (int t = 0; t < TT; t++) {
            float a = acc[r][t];
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) a += __shfl_xor_sync(0xffffffffu, a, off);
            if (lane == 0) part[warp][r][t] = a;
        }
    __syncthreads();
    if (threadIdx.x < ROWS * TT) {
        const int r = threadIdx.x / TT;
        const int t = threadIdx.x % TT;
        float a = part[0][r][t];
#pragma unroll
        for (int w = 1; w < WARPS; w++) a += part[w][r][t];
        if (t < nt && o0 + r < hidden) out[(size_t)(t0 + t) * hidden + o0 + r] = a;
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
// 16-byte load a row) at a time; the same warp layout as above.
extern "C" __global__ void __launch_bounds__(32 * WARPS)
    bf16_product(const u16* __restrict__ w, const float* __restrict__ x, float* __restrict__ out, int hidden,
                 int n, int tokens) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int o0 = (blockIdx.x * WARPS + warp) * ROWS;
    const int t0 = blockIdx.y * TT;
    if (o0 >= hidden) return;
    const int nt = min(TT, tokens - t0);
    const int chunks = n / 8;
    float acc[ROWS][TT];
#pragma unroll
    for (int r = 0; r < ROWS; r++)
#pragma unroll
        for (int t = 0; t < TT; t++) acc[r][t] = 0.0f;
#pragma unroll 2
    for (int c = lane; c < chunks; c += 32) {
        float v[ROWS][8];
#pragma unroll
        for (int r = 0; r < ROWS; r++) {
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
                for (int r = 0; r < ROWS; r++) {
                    float a = acc[r][t];
#pragma unroll
                    for (int e = 0; e < 8; e++) a = fmaf(v[r][e], xv[e], a);
                    acc[r][t] = a;
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS; r++)
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
