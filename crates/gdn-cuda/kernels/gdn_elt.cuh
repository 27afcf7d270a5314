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

// The gates with the fast division (__fdividef: the quotient within 2 ulp; 0 once the divisor passes 2^126, where
// the exact sigmoid underflows too, while SiLU's exact value for x below about -87 is a normal number near 1e-36
// that comes out 0): the window and chunked kernels' SiLU and sigmoid.
__device__ __forceinline__ float silu_w(float x) { return __fdividef(x, 1.0f + expf(-x)); }
__device__ __forceinline__ float sigmoid_w(float x) { return __fdividef(1.0f, 1.0f + expf(-x)); }

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

// Tensor-core products in 3xTF32 (mma.sync m16n8k8, sm_80+; gdn_chunk.cu, gdn_window.cu): each f32 operand x is
// split into x_hi and x_lo (split2_fast), and a product is a_lo b_hi + a_hi b_lo + a_hi b_hi (the small terms
// first), which keeps about f32 accuracy. Fragments (lane = 4 g + q): A 16 x 8 row-major a0 (g, k q),
// a1 (g + 8, k q), a2 (g, k q + 4), a3 (g + 8, k q + 4); B 8 x 8 b0 (k q, n g), b1 (k q + 4, n g); C c0 (g, 2 q),
// c1 (g, 2 q + 1), c2 (g + 8, 2 q), c3 (g + 8, 2 q + 1). Each element of C depends only on its row of A and its
// column of B.
__device__ __forceinline__ void mma_tf32(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                                         unsigned b1) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// The split of x in two integer steps and a subtraction (cvt.rna.tf32 is emulated in about five instructions on
// sm_90, and the profiles showed it as the kernels' largest instruction block): hi = x rounded to tf32 (half away
// from zero), lo = x - hi exactly, left for the mma to truncate (|error| <= 2^-21 |x|; a product a_lo b_hi +
// a_hi b_lo + a_hi b_hi keeps about f32 accuracy). For |x| below 2^128 (1 - 2^-12) (every finite x but the last
// 2^-12 of the range, where hi would round to infinity) and NaN (stays NaN); an infinity becomes NaN.
__device__ __forceinline__ void split2_fast(float x, unsigned& hi, unsigned& lo) {
    hi = (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
    lo = __float_as_uint(x - __uint_as_float(hi));
}
__device__ __forceinline__ void split4(const float* a, unsigned* h, unsigned* l) {
#pragma unroll
    for (int x = 0; x < 4; ++x) split2_fast(a[x], h[x], l[x]);
}
// c += A B for one k step, A already split (ah, al; split4), b[2] the f32 fragment values of B
__device__ __forceinline__ void mma3p(float* c, const unsigned* ah, const unsigned* al, const float* b) {
    unsigned bh[2], bl[2];
    split2_fast(b[0], bh[0], bl[0]);
    split2_fast(b[1], bh[1], bl[1]);
    mma_tf32(c, al[0], al[1], al[2], al[3], bh[0], bh[1]);
    mma_tf32(c, ah[0], ah[1], ah[2], ah[3], bl[0], bl[1]);
    mma_tf32(c, ah[0], ah[1], ah[2], ah[3], bh[0], bh[1]);
}

// An L2 prefetch of `bytes` (a multiple of 16) from p (16-byte aligned), sm_90's bulk form; a hint only, it
// changes no value (gdn_step.cu, gdn_window.cu).
__device__ __forceinline__ void prefetch_l2(const void* p, unsigned bytes) {
#if __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes));
#endif
}

// Element strides of rows and state slots for the step kernels (gdn_step.cu, gdn_chunk.cu; expanded where the
// kernel uses them, after its own D, HV, C_ALL and N_OUT): the pool's packed layout, or with GDN_EXT the engine's
// (run-time arguments, GdnExt: src/external.rs ExtArgs field for field) and its conv state in GDN_CONV_DT.
#ifndef GDN_EXT
#define GDN_EXT 0
#endif
#if GDN_EXT
typedef Elt<GDN_CONV_DT> EC;
struct GdnExt {
    void* conv;                                              // the engine's conv state, in GDN_CONV_DT
    unsigned* ctr;                                           // [S][HK] last-reader counters, 0 between calls
    unsigned long long state_ss;                             // elements between state slots
    unsigned long long conv_ss, conv_cs, conv_ls, conv_off;  // conv: slot, channel, column strides; column w - 3
    unsigned long long qkv_rs, a_rs, b_rs, z_rs, o_rs;       // row strides of the inputs and of y
};
#define QKV_RS ext.qkv_rs
#define A_RS ext.a_rs
#define B_RS ext.b_rs
#define Z_RS ext.z_rs
#define O_RS ext.o_rs
#define SLOT_OFF(s) ((size_t)(s) * ext.state_ss)
#else
#define QKV_RS C_ALL
#define A_RS HV
#define B_RS HV
#define Z_RS N_OUT
#define O_RS N_OUT
#define SLOT_OFF(s) ((size_t)(s) * D * HV * D)
#endif

// y of output element yi (column jc of its head) and, with PLANES, its three prepared planes (SPEC.md's scales:
// 4^-(jc mod 8), 256^-(jc mod 4), 1 or 1/256 by parity), each computed in f32 and rounded once to E's type
template <typename E, bool PLANES>
__device__ __forceinline__ void store_y(typename E::T* out, long long plane, size_t yi, int jc, float yv) {
    out[yi] = E::st(yv);
    if (PLANES) {
        const int jj = jc & 15;
        out[plane + yi] = E::st(yv * __int_as_float((127 - 2 * (jj & 7)) << 23));
        out[2 * plane + yi] = E::st(yv * __int_as_float((127 - 8 * (jj & 3)) << 23));
        out[3 * plane + yi] = E::st((jj & 1) ? yv * 0.00390625f : yv);
    }
}
