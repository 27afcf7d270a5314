// quant_read_probe.cu: what a B 1 out_proj's weight bytes cost to read, beside the one-token kernel itself.
//
// The one-token kernel `q1` (kernels/quant.cu, compiled here with the crate's default shape: 2 rows a warp, 4 chunks
// in flight, 2 blocks an SM) reads three arrays (fields, scales, zero terms; [row][group] each). This program
// times, in CUDA graphs over weight copies rotated through 256+ MiB (every launch's bytes come from HBM):
//   q1       the real kernel (planes path), 2-bit and 8-bit u32;
//   pattern  q1's loads and grid exactly, the arithmetic replaced by one integer add a word;
//   inter    the same loads from a layout with each row's chunk (32 groups: fields, scales, zero terms) contiguous;
//   stream   the same bytes as one contiguous array, 16-byte loads, 4 in flight a thread, at several grids;
//   empty    an empty kernel (the graph node's own cost);
// Build and run on the device: nvcc -O3 -arch=sm_90 -o probe tools/device/quant_read_probe.cu && ./probe
#define TT 1
#define R1_0 2
#define R1_1 2
#define R1_2 2
#define D1_0 4
#define D1_1 4
#define D1_2 4
#include "../../crates/gdn-cuda/kernels/quant.cu"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x)                                                                       \
    do {                                                                            \
        cudaError_t e_ = (x);                                                       \
        if (e_ != cudaSuccess) {                                                    \
            printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_));       \
            exit(1);                                                                \
        }                                                                           \
    } while (0)

// q1 compiled for two resident blocks of up to 320 threads (the launch's shape at the seed's size). nvcc gives the
// 8-bit q1 98 registers, so one block of the two fits; the crate's NVRTC build of the same code takes 96 and fits
// both (tests/nvrtc.rs's quant_kernels_compile prints it), so this row, not "q1", is the crate's kernel
#define ENTRY1B(name, PACK)                                                                                  \
    extern "C" __global__ void __launch_bounds__(320, 2)                                                     \
        name(const u32* __restrict__ words, const float* __restrict__ scale, const float* __restrict__ zs,  \
             const float* __restrict__ x, const float* __restrict__ gsum, float* __restrict__ out, int hidden, \
             int n) {                                                                                        \
        product_one<PACK, false>(words, scale, zs, x, gsum, out, hidden, n);                                 \
    }
ENTRY1B(q1_two_0, 0)
ENTRY1B(q1_two_1, 1)

// a warp's R row sums (lane l's part each) met in a butterfly and stored by lane 0, rows past hidden dropped
template <int R, class T>
__device__ __forceinline__ void store_rows(T (&acc)[R], T* out, int o0, int hidden, int lane) {
#pragma unroll
    for (int r = 0; r < R; r++) {
        T a = acc[r];
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) a += __shfl_xor_sync(0xffffffffu, a, off);
        if (lane == 0 && o0 + r < hidden) out[o0 + r] = a;
    }
}

// registers, local (spill) bytes and resident blocks an SM of a kernel at a launch shape
static void occupancy(const char* name, const void* f, int threads, size_t shm) {
    cudaFuncAttributes a;
    CK(cudaFuncGetAttributes(&a, f));
    int nb = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&nb, f, threads, shm));
    printf("  %-26s %3d registers, %4zu local bytes, %d blocks an SM at %d threads + %zu B shared\n", name, a.numRegs,
           a.localSizeBytes, nb, threads, shm);
}

// q1's loads (same rows, chunks, slots, depth, refills), each word consumed by one add
template <int WPG, int R, int D, bool INTER>
__global__ void __launch_bounds__(512) pattern(const u32* __restrict__ words, const u32* __restrict__ scale,
                                               const u32* __restrict__ zs, u32* __restrict__ out, int hidden,
                                               int groups) {
    const int chunks = (groups + 31) >> 5;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int sets = (hidden + R - 1) / R;
    const int s0 = (int)((long long)blockIdx.x * sets / gridDim.x);
    const int s1 = (int)((long long)(blockIdx.x + 1) * sets / gridDim.x);
    const bool wrap = chunks % D == 0;
    u32 wb[D][R][WPG], sb[D][R], zb[D][R];
    // a group's WPG words (one load)
    auto load_words = [&](u32* dst, const u32* p) {
        if (WPG == 1) {
            dst[0] = ld_w1(p);
        } else {
            uint4 q = ld_w4(p);
            dst[0] = q.x;
            dst[WPG > 1 ? 1 : 0] = q.y;
            dst[WPG > 2 ? 2 : 0] = q.z;
            dst[WPG > 3 ? 3 : 0] = q.w;
        }
    };
    // INTER: row o's chunk c is (32 WPG words, 32 scales, 32 zero terms) at (o chunks + c) (32 WPG + 64)
    auto load = [&](int d, int o0, int c) {
        const int g = 32 * c + lane;
        if (g < groups) {
#pragma unroll
            for (int r = 0; r < R; r++) {
                if (INTER) {
                    const u32* b = words + (size_t)((o0 + r) * chunks + c) * (32 * WPG + 64);
                    load_words(wb[d][r], b + WPG * lane);
                    sb[d][r] = ld_w1(b + 32 * WPG + lane);
                    zb[d][r] = ld_w1(b + 32 * WPG + 32 + lane);
                } else {
                    const unsigned at = (unsigned)((o0 + r) * groups + g);
                    load_words(wb[d][r], words + WPG * at);
                    sb[d][r] = ld_w1(scale + at);
                    zb[d][r] = ld_w1(zs + at);
                }
            }
        }
    };
    int s = s0 + warp;
    if (s < s1)
#pragma unroll
        for (int d = 0; d < D; d++)
            if (d < chunks) load(d, s * R, d);
    bool first = true;
    for (; s < s1; s += nw) {
        const int o0 = s * R;
        const bool next = s + nw < s1;
        if (!first && !wrap)
#pragma unroll
            for (int d = 0; d < D; d++)
                if (d < chunks) load(d, o0, d);
        first = false;
        u32 acc[R];
#pragma unroll
        for (int r = 0; r < R; r++) acc[r] = 0;
        for (int c0 = 0; c0 < chunks; c0 += D) {
#pragma unroll
            for (int d = 0; d < D; d++) {
                const int c = c0 + d;
                if (c < chunks) {
                    if (32 * c + lane < groups)
#pragma unroll
                        for (int r = 0; r < R; r++) {
                            u32 a = sb[d][r] + zb[d][r];
#pragma unroll
                            for (int k = 0; k < WPG; k++) a += wb[d][r][k];
                            acc[r] += a;
                        }
                    if (c + D < chunks)
                        load(d, o0, c + D);
                    else if (wrap && next)
                        load(d, o0 + nw * R, c + D - chunks);
                }
            }
        }
        store_rows<R>(acc, out, o0, hidden, lane);
    }
}

// one contiguous array of n16 16-byte pieces, 4 loads in flight a thread
__global__ void stream(const uint4* __restrict__ p, long long n16, u32* __restrict__ out) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    u32 acc = 0;
    for (; i + 3 * stride < n16; i += 4 * stride) {
        uint4 a = ld_w4(reinterpret_cast<const u32*>(p + i));
        uint4 b = ld_w4(reinterpret_cast<const u32*>(p + i + stride));
        uint4 c = ld_w4(reinterpret_cast<const u32*>(p + i + 2 * stride));
        uint4 d = ld_w4(reinterpret_cast<const u32*>(p + i + 3 * stride));
        acc += a.x + a.y + a.z + a.w + b.x + b.y + b.z + b.w + c.x + c.y + c.z + c.w + d.x + d.y + d.z + d.w;
    }
    for (; i < n16; i += stride) {
        uint4 a = ld_w4(reinterpret_cast<const u32*>(p + i));
        acc += a.x + a.y + a.z + a.w;
    }
    if (acc == 0x9e3779b9u) out[0] = acc;  // never, in practice; keeps the loads
}

__global__ void empty() {}

struct Bench {
    cudaStream_t st;
    cudaEvent_t a, b;
    Bench() {
        CK(cudaStreamCreate(&st));
        CK(cudaEventCreate(&a));
        CK(cudaEventCreate(&b));
    }
    // launch(i) enqueues the i-th call on st; a graph of `per` calls replayed `reps` times; us a call (best of 5)
    template <class F>
    double time(F launch, int per = 48, int reps = 10) {
        cudaGraph_t g;
        cudaGraphExec_t ge;
        CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
        for (int i = 0; i < per; i++) launch(i);
        CK(cudaStreamEndCapture(st, &g));
        CK(cudaGraphInstantiate(&ge, g, 0));
        CK(cudaGraphLaunch(ge, st));
        CK(cudaStreamSynchronize(st));
        double best = 1e30;
        for (int t = 0; t < 5; t++) {
            CK(cudaEventRecord(a, st));
            for (int r = 0; r < reps; r++) CK(cudaGraphLaunch(ge, st));
            CK(cudaEventRecord(b, st));
            CK(cudaEventSynchronize(b));
            float ms;
            CK(cudaEventElapsedTime(&ms, a, b));
            best = std::min(best, 1000.0 * ms / (per * reps));
        }
        CK(cudaGraphExecDestroy(ge));
        CK(cudaGraphDestroy(g));
        return best;
    }
};

int main() {
    const int hidden = 5120, n = 6144, groups = n / 16, chunks = groups / 32;
    int sms;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("device %s, %d SMs; hidden %d, n %d\n", prop.name, sms, hidden, n);
    Bench B;
    u32* out;
    CK(cudaMalloc(&out, 4 * (hidden + 64)));
    float *x, *gs;
    CK(cudaMalloc(&x, 4 * n));
    CK(cudaMalloc(&gs, 4 * groups));
    CK(cudaMemset(x, 0, 4 * n));
    CK(cudaMemset(gs, 0, 4 * groups));
    printf("empty kernel %.2f us\n", B.time([&](int) { empty<<<2 * sms, 320, 0, B.st>>>(); }));
    printf("%-10s %-28s %10s %10s %8s\n", "packing", "kernel", "us", "MB", "GB/s");
    for (int wpg : {1, 4}) {
        const size_t rows = hidden + 7;  // q1 reads 7 rows of padding
        const size_t wbytes = rows * groups * 4 * wpg, sbytes = rows * groups * 4;
        const size_t copy = wbytes + 2 * sbytes;
        const int copies = (int)((320ull << 20) / copy) + 1;
        std::vector<u32*> w(copies), s(copies), z(copies), in(copies);
        for (int c = 0; c < copies; c++) {
            CK(cudaMalloc(&w[c], wbytes));
            CK(cudaMalloc(&s[c], sbytes));
            CK(cudaMalloc(&z[c], sbytes));
            CK(cudaMalloc(&in[c], rows * chunks * (32 * wpg + 64) * 4));
            CK(cudaMemset(w[c], 0x11, wbytes));
            CK(cudaMemset(s[c], 0, sbytes));
            CK(cudaMemset(z[c], 0, sbytes));
            CK(cudaMemset(in[c], 0x11, rows * chunks * (32 * wpg + 64) * 4));
        }
        const double mb = (double)hidden * groups * 4 * (wpg + 2) / 1e6;  // what a product must read
        const char* pk = wpg == 1 ? "2-bit" : "8-bit u32";
        auto row = [&](const char* k, double us) { printf("%-10s %-28s %10.2f %10.1f %8.0f\n", pk, k, us, mb, mb * 1e3 / us); };
        const int sets = hidden / 2, blocks = 2 * sms, warps = std::min(16, (sets + blocks - 1) / blocks);
        const size_t shm = groups * 68;
        auto q1 = wpg == 1 ? q1_planes_0 : q1_planes_1;
        auto q2 = wpg == 1 ? q1_two_0 : q1_two_1;
        // a one-token kernel's row: its dynamic shared memory allowed, then timed at the crate's launch
        auto one = [&](const char* name, decltype(q1) k) {
            CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)shm));
            row(name, B.time([&](int i) {
                    const int c = i % copies;
                    k<<<blocks, 32 * warps, shm, B.st>>>(w[c], (const float*)s[c], (const float*)z[c], x, gs,
                                                         (float*)out, hidden, n);
                }));
        };
        one("q1 (planes)", q1);
        one("q1, two blocks' registers", q2);
        auto pat = wpg == 1 ? pattern<1, 2, 4, false> : pattern<4, 2, 4, false>;
        occupancy("q1", (const void*)q1, 32 * warps, shm);
        occupancy("q1, two blocks' registers", (const void*)q2, 32 * warps, shm);
        occupancy("pattern", (const void*)pat, 32 * warps, 0);
        row("pattern (q1's loads)", B.time([&](int i) {
                const int c = i % copies;
                pat<<<blocks, 32 * warps, 0, B.st>>>(w[c], s[c], z[c], out, hidden, groups);
            }));
        auto pin = wpg == 1 ? pattern<1, 2, 4, true> : pattern<4, 2, 4, true>;
        row("inter (chunk-interleaved)", B.time([&](int i) {
                const int c = i % copies;
                pin<<<blocks, 32 * warps, 0, B.st>>>(in[c], nullptr, nullptr, out, hidden, groups);
            }));
        auto p12 = wpg == 1 ? pattern<1, 2, 12, false> : pattern<4, 2, 6, false>;
        row(wpg == 1 ? "pattern depth 12" : "pattern depth 6", B.time([&](int i) {
                const int c = i % copies;
                p12<<<blocks, 32 * warps, 0, B.st>>>(w[c], s[c], z[c], out, hidden, groups);
            }));
        auto i12 = wpg == 1 ? pattern<1, 2, 12, true> : pattern<4, 2, 6, true>;
        row(wpg == 1 ? "inter depth 12" : "inter depth 6", B.time([&](int i) {
                const int c = i % copies;
                i12<<<blocks, 32 * warps, 0, B.st>>>(in[c], nullptr, nullptr, out, hidden, groups);
            }));
        for (int bps : {1, 2, 4})
            for (int th : {256, 512}) {
                char name[64];
                snprintf(name, sizeof name, "stream %d blk/SM x %d", bps, th);
                const long long n16 = (long long)(mb * 1e6) / 16;
                row(name, B.time([&](int i) {
                        const int c = i % copies;
                        stream<<<bps * sms, th, 0, B.st>>>(reinterpret_cast<const uint4*>(in[c]), n16, out);
                    }));
            }
        for (int c = 0; c < copies; c++) {
            CK(cudaFree(w[c]));
            CK(cudaFree(s[c]));
            CK(cudaFree(z[c]));
            CK(cudaFree(in[c]));
        }
    }
    CK(cudaDeviceSynchronize());
    return 0;
}
