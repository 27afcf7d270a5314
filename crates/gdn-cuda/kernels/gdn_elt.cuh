// gdn_elt.cuh: prepended (after the specialisation's #define lines) to every kernel source of this crate
// (src/spec.rs, src/chunk.rs), so that one definition of the element types serves every kernel.
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
