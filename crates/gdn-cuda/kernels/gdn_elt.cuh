// gdn_elt.cuh: prepended (after the specialisation's #define lines) to every kernel source of this crate
// (src/spec.rs, src/chunk.rs, src/quant.rs), so that one definition of the element types, the gates and the
// fixed-order sums serves every kernel.
//
// Element types, by code: storage type, exact widening to f32, rounding from f32 to nearest even. The
// conversions are PTX instructions (no CUDA header needed): bf16 widening is a shift, bf16 rounding
// cvt.rn.bf16.f32 (sm_80+), f16 both ways cvt; NaN stays NaN.
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

// The math the step kernels share (gdn_step.cu, gdn_window.cu, gdn_chunk.cu): the gates and a fixed-order sum.
__device__ __forceinline__ float sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }

__device__ __forceinline__ float softplus_decay(float u, float a) {
    const float ex = expf(u);
    const float w = 1.0f + ex;
    const float sp = u > 20.0f ? u : (w == 1.0f ? ex : logf(w) * ex / (w - 1.0f));
    return expf(sp * a);
}

// the largest power of two below n (n >= 2)
constexpr int below_pow2(int n) { return n <= 2 ? 1 : 2 * below_pow2((n + 1) / 2); }

// p[0] + ... + p[N - 1] as a fixed pairwise tree (the first power-of-two part, then the rest)
template <int N> struct Tree {
    static __device__ __forceinline__ float sum(const float* p) {
        constexpr int H = below_pow2(N);
        return Tree<H>::sum(p) + Tree<N - H>::sum(p + H);
    }
};
template <> struct Tree<1> {
    static __device__ __forceinline__ float sum(const float* p) { return p[0]; }
};
