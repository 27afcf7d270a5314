// gdn_step.cu: the whole GDN window step (SPEC.md) of every sequence of a varlen call in one launch (kernel
// v2b, see NOTES.md).
//
// Specialised by the host through macros (see src/spec.rs):
//   GDN_D, GDN_HK, GDN_HV   shape (head dim, q/k heads, value heads)
//   GDN_T                   window length of every sequence of the call, or 0 for each sequence's own length
//   GDN_SILU                output gate: 0 sigmoid, 1 silu
//   GDN_GROUPED             head map: 0 tiled (h % h_k), 1 grouped (h / (h_v / h_k))
//   GDN_PLANES              0: y only; 1: y, three prepared planes and group sums
//   GDN_COMMIT              0: verify only (nothing written back); 1: each sequence commits after its token
//                           `commit_at - 1` (its own commit_at, 0: it writes nothing)
//   GDN_QKV_DT, GDN_ALPHA_DT, GDN_BETA_DT, GDN_Z_DT, GDN_OUT_DT
//                           element type of each input and of the output (y, planes, group sums):
//                           0 f32, 1 bf16, 2 f16. Inputs widen exactly; outputs round once, to nearest even.
//   GDN_STATE_DT            0: S in f32; 1: S in bf16 (widened at the window start, updated in f32, rounded
//                           to nearest even once, at the commit token)
//   GDN_STAGE               1: a bf16 state at T 1 goes through shared memory (see STAGE below)
//   GDN_VMAJOR              0: S[i][h][j] at (i * HV + h) * D + j (key-major, SPEC.md); 1: at (h * D + j) * D + i
//                           (value-major, keys contiguous)
//   GDN_NCB                 column blocks per value head = thread-block cluster size (1, 2, 4, 8)
//   GDN_RG                  row groups (1, 2, 4, 8, 16, 32): a thread holds D / RG rows of one column
//   GDN_MINB                minimum resident blocks per multiprocessor (register budget)
//   GDN_EXT                 0: the pool's own buffers (packed rows, S slots contiguous, the private history
//                           below); 1: memory an engine owns (see EXTERNAL below): row strides, a free state slot
//                           stride, the engine's conv state [slot][C][w] with free strides, cu_seqlens or
//                           start / len, commit_at optional
//   GDN_CONV_DT             (GDN_EXT) element type of the engine's conv state: 0 f32, 1 bf16, 2 f16
//   GDN_SPEC                1: the speculative step (see SPECULATIVE below; needs GDN_COMMIT 1), on the pool or
//                           with GDN_EXT on memory an engine owns (EXTERNAL SPECULATIVE below)
//   GDN_AHEAD               0, or a distance in blocks: each block prefetches into L2 the state of the block that
//                           many blocks after it in launch order (its loads then hit L2); a hint, no value changes
//   GDN_PREWAIT             1: before waiting for the previous kernel, prefetch the block's own state into L2
//                           (the slot read only for that, as a relaxed load; see Launch below)
//   GDN_ROUTE               1: the window kernel (gdn_window.cu) runs in the same call; leave it the sequences whose
//                           effective length (commit point, or length without one) is in GDN_WMIN ..= GDN_WMAX
//                           (after the checks: faults reported alike)
//
// Sequences. Sequence s of the call has pool slot seq_slot[s], rows seq_start[s] .. + seq_len[s] of the packed
// inputs and of the output, and commit point seq_commit[s]. A sequence whose slot is outside the pool, whose
// length is not positive (or not GDN_T) or whose rows leave the n_rows given is skipped.
//
// Work split. Grid (H_V * NCB, S). The NCB blocks of one value head form a cluster; block `rank` owns the
// state columns [rank * COLS, (rank + 1) * COLS) of its head, COLS = D / NCB. Inside a warp, lane l holds row
// group l % RG of column (warp * CPW + l / RG), CPW = 32 / RG columns a warp: its RPT = D / RG rows of that
// column live in registers, read once before the token loop and written once at the commit. The sums over
// rows (kv_j and o_j) are butterflies over the RG lanes of a column: no shared memory, no barrier. Columns
// are independent in the delta rule and the readout; only the output RMS norm couples them: its per-warp
// partial sums meet in shared memory, and across the cluster through distributed shared memory.
//
// Every reduction runs in a fixed order (no atomics; an xor butterfly gives every lane the same bits), so
// the same inputs give the same bits, and the arithmetic of one token depends neither on the window length
// nor on whether the length is a compile-time constant (the token loop's body is the same code; only loads
// of the next token are guarded by it): a commit after k tokens of a longer window is bitwise a k-token
// commit, and a sequence's bits do not depend on the rest of the call. The program is compiled with
// --fmad=false; every fused multiply-add is an explicit fmaf.
//
// Conv history (always f32): each value head has a private copy of the q/k history it reads, laid out
// [slot][H_V][3 (q, k, v)][D][3]; the blocks of a head read it before the token loop and write it back after
// a cluster barrier that follows those reads, so no other head's blocks ever read what a block writes.
//
// EXTERNAL (GDN_EXT 1). The conv state is the engine's, one copy of every channel's history per slot:
// element (slot, c, col) at slot * conv_ss + c * conv_cs + col * conv_ls, the history in the last three columns
// (oldest first; ext.conv_off points at column w - 3), stored in GDN_CONV_DT (read widened, written rounded to
// nearest even). A value channel is read and written by the one block that owns its column. The q / k history
// of key head g is read by every block of every value head that maps to g (READERS blocks), so no block may
// overwrite it before the others have read it. Each committing block, after its history reads and a barrier,
// counts itself in ext.ctr[sequence * HK + g] (thread 0: fence, atomicAdd); the block that sees READERS - 1
// readers before it is the last, resets the counter to 0 (so the next call, or a graph replay, starts from 0)
// and alone writes the new q / k history, at its commit token. The fence before the count orders the block's
// reads before it (release), the fence after the last count orders its writes after everyone's reads
// (acquire). A decode call of one wave with one block a head and h_v / h_k <= 8 (GDN_RCL below) uses a cluster
// barrier instead.
// Verify sequences neither count nor write. Sequences: seq_start and seq_len (start / len), or
// seq_start = cu_seqlens [S + 1] and seq_len = null; seq_commit null: every sequence commits its whole window.
//
// SPECULATIVE (GDN_SPEC 1). A sequence whose commit point is 0 is *held*: besides its verify outputs it keeps,
// per token t (< MAXH) of its window, what a commit of that token would apply: the gate g_t (per value head),
// the normalized key k_t (per key head, written by the first value head of the key head), the delta vector
// (per value head and column) and the raw (widened) qkv row (q / k by that first value head, v by each head's
// column owners). Per slot two buffers of that pending region: seq_acc[s] = acc | (buf << 8) names the buffer
// holding the slot's held window and how many of its tokens are accepted; a window held now is written to the
// other buffer, so no block ever writes what any block of the launch reads. The accepted prefix's keys, deltas
// and gates, and the raw rows the history keeps, are copied into shared memory (cp.async) as soon as the block
// knows its sequence; after its state load the block applies the first acc updates in order with the token
// update's own operations (st = fmaf(g, st, k * delta)), rounds a bf16 state once (as the k-token commit stores
// it and the next window loads it), shifts the last accepted rows into the history, and runs its window from
// there; if that window is held too, the accepted state and history are written back first (a committing window
// writes them at its commit). A sequence of length 0 only accepts (commit_held). One state read and one write
// per speculative step.
//
// EXTERNAL SPECULATIVE (GDN_SPEC 1 and GDN_EXT 1). The engine owns the pending region ([slot][2][PEND_PB] floats,
// zeros: nothing held) and a held word per slot (held_w[slot] = held length | buffer << 8, 0: nothing held); each
// sequence names its accepted count in seq_acc[s] (the count alone). Every block reads the slot's held word and
// skips the sequence (fault bit 16) where the count is outside 0 ..= the held length, or (bit 32) where the window
// would be held and is longer than MAXH; a bad commit point skips it too (bit 8). The held word is rewritten by the
// last of the sequence's HV * NCB blocks to read it (a per-sequence counter seq_ctr[s], counted by thread 0 at token
// 0 after its first barrier as the q / k counter is, reset by that last block). The accepted q / k history of a
// window that runs held is written by the last reader of the key head's history after the verdict (token 0, after
// the output norm's barrier; the values kept in acc_r), its v history by each column's owner before the loop.
//
// Launch: with programmatic dependent launch the kernel loads a few of the layer's weights, then waits for
// the previous kernel in the stream (griddepcontrol.wait) before it reads anything a previous kernel may write.
// The one exception (GDN_PREWAIT) is the block's slot, read with a relaxed load to prefetch its state into L2
// during the previous kernel's tail: the value read serves as a prefetch address and nothing else (a stale
// slot prefetches lines no one needs; the L2 is coherent, so a prefetched line is never stale).

#ifndef GDN_D
#error "GDN_D must be defined"
#endif
#ifndef GDN_QKV_DT
#define GDN_QKV_DT 0
#endif
#ifndef GDN_ALPHA_DT
#define GDN_ALPHA_DT 0
#endif
#ifndef GDN_BETA_DT
#define GDN_BETA_DT 0
#endif
#ifndef GDN_Z_DT
#define GDN_Z_DT 0
#endif
#ifndef GDN_OUT_DT
#define GDN_OUT_DT 0
#endif
#ifndef GDN_STATE_DT
#define GDN_STATE_DT 0
#endif
#ifndef GDN_VMAJOR
#define GDN_VMAJOR 0
#endif
#ifndef GDN_EXT
#define GDN_EXT 0
#endif
#ifndef GDN_CONV_DT
#define GDN_CONV_DT 0
#endif
#ifndef GDN_SPEC
#define GDN_SPEC 0
#endif
#ifndef GDN_AHEAD
#define GDN_AHEAD 0
#endif
#ifndef GDN_PREWAIT
#define GDN_PREWAIT 0
#endif
#ifndef GDN_ROUTE
#define GDN_ROUTE 0
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
static_assert(GDN_STATE_DT == 0 || GDN_STATE_DT == 1, "the state is f32 or bf16");
#if GDN_EXT
static_assert(!GDN_SPEC || GDN_COMMIT, "the speculative step commits");
#else
static_assert(!GDN_SPEC || (GDN_COMMIT && !GDN_EXT), "the speculative step is the pool's, with commits");
#endif

#if GDN_SPEC
// the pending region of one (slot, buffer), floats: gates [HV][MAXH], keys [HK][MAXH][D], deltas [HV][MAXH][D],
// raw rows [MAXH][C_ALL] (every part a multiple of 16 bytes, so the key rows take float4 loads)
#define MAXH 16
#define PG_OFF 0
#define PK_OFF (HV * MAXH)
#define PD_OFF (PK_OFF + HK * MAXH * D)
#define PR_OFF (PD_OFF + HV * MAXH * D)
#define PEND_PB (PR_OFF + MAXH * C_ALL)
// offsets inside one buffer are int arithmetic (cheaper addressing for the per-token stores)
static_assert((long long)PEND_PB < 0x7fffffffLL, "a pending buffer's offsets fit an int");
#endif

// Element types (Elt<code>): kernels/gdn_elt.cuh, prepended to this source.
typedef Elt<GDN_QKV_DT> EQ;
typedef Elt<GDN_ALPHA_DT> EA;
typedef Elt<GDN_BETA_DT> EB;
typedef Elt<GDN_Z_DT> EZ;
typedef Elt<GDN_OUT_DT> EO;
typedef Elt<GDN_STATE_DT> ES;

// The element strides of rows and state slots (GdnExt, QKV_RS .. SLOT_OFF): kernels/gdn_elt.cuh.
#if GDN_EXT
// blocks that read one key head's q / k history in one sequence
#define READERS ((HV / HK) * NCB)
#endif
// GDN_RCL (the host sets it to h_v / h_k for external commit steps at T 1 in a call of one wave, with one block a
// head, h_v / h_k <= 8; Spec::readers_cluster says where it measured slower): the
// READERS blocks of a key head's history in a sequence form a thread-block cluster (block x = key head x
// RCL + member), so the cluster barrier orders every reader's history reads (arrive, release, at token 0 once the
// conv has consumed them) before member 0 writes the new q / k history (wait, acquire, at the commit token),
// instead of the last-reader count: no global atomics and no fence on the token's critical path (the count
// cost about 1 us a call at B 1 T 1, measured with it removed). 1: the block is the history's only reader.
#ifndef GDN_RCL
#define GDN_RCL 0
#endif
#if GDN_RCL
static_assert(GDN_EXT && GDN_COMMIT && !GDN_SPEC && GDN_NCB == 1 && GDN_RCL == HV / HK && GDN_RCL <= 8,
              "the readers' cluster is for external commit steps with one block a head");
#endif

// With GDN_STAGE (the host sets it for calls that fill the device), a bf16 state at T 1 with one block a head
// (STAGE) is not held in registers: the block copies its head's
// state into shared memory with cp.async as soon as the slot is known, computes the conv and the norms while
// the copies are in flight, and both sweeps read the state from there; the updated state is rounded and
// stored straight from the update sweep. No registers hold data in flight, so more blocks fit on a
// multiprocessor and each block's load overlaps its own prologue. The arithmetic (values, operations and
// their order) is that of the register path, so the bits are those of the run-time-length kernel.
#ifndef GDN_STAGE
#define GDN_STAGE 0
#endif
#define STAGE (GDN_STAGE && !GDN_SPEC && GDN_STATE_DT == 1 && GDN_T == 1 && GDN_NCB == 1 && D <= 128 && RPT % 8 == 0)
// With GDN_PHASED (the host sets it for a constant window of 2 tokens or more), the window runs in
// three phases with block barriers only between them, instead of three barriers a token: A, every token's conv,
// SiLU, gates and L2 norms (a thread's channels carry their history in registers from token to token, all rows'
// loads in flight at once); B, each column's recurrence over all tokens (its sums are butterflies inside the warp,
// so no barrier: the warps run through it unhindered); C, every token's output norm and gate, y, planes and group
// sums, spread over all threads. Every value is computed by the same operations in the same order as in the token
// loop (the q / k / v of all tokens wait in shared memory), so no bit depends on the form.
#ifndef GDN_PHASED
#define GDN_PHASED 0
#endif
// The phases' per-token arrays are static shared memory, which has to stay within 48 KiB with the speculative
// kernel's (where it would not, the token loop runs): bytes, as laid out below
#define PHASED_SMEM (4 * (GDN_T * (2 * RG * KPAD + 2 * COLS + 2 + 2 * D / 16 + NW + 1 + GDN_PLANES * COLS) + 3 * NE))
#if GDN_SPEC
#define SPEC_SMEM (4 * (MAXH * RG * KPAD + MAXH * COLS + MAXH + 3 * NE) + 8 * NW)
#else
#define SPEC_SMEM 0
#endif
#define PHASED (GDN_PHASED && GDN_T >= 2 && PHASED_SMEM + SPEC_SMEM + 1024 <= 48 * 1024)
#if PHASED && GDN_RCL
#error "the readers' cluster is for T 1"
#endif
#define SPITCH (2 * D + 16)  // bytes of one staged row (16-byte aligned; the skew spreads a warp's loads)
// Which keys a thread holds. Key-major: row group g holds the keys g * RPT .. + RPT (a warp's load of one
// register row reads CPW consecutive columns of RG rows). Value-major (a column's keys contiguous): the keys
// are dealt in chunks of VCH (16 bytes) round the RG row groups, so the RG lanes of a column read RG adjacent
// chunks with one 16-byte load each. Register row r of row group g holds key KEY(g, r); the q / k vectors in
// shared memory follow the same map (kidx), so a thread's rows are contiguous there too.
#if GDN_VMAJOR
#define VCH (GDN_STATE_DT == 0 || RPT % 8 != 0 ? 4 : 8)
#define KEY(g, r) (((r) / VCH) * (VCH * RG) + (g) * VCH + (r) % VCH)
#define VEC_STATE (VCH * (GDN_STATE_DT == 0 ? 4 : 2) == 16)
#else
#define KEY(g, r) ((g) * RPT + (r))
#define VEC_STATE 0
#endif

#if GDN_SPEC
__device__ __forceinline__ float* pend_new(const unsigned long long* p) {
    unsigned long long v;
    asm volatile("ld.shared.u64 %0, [%1];" : "=l"(v) : "r"((unsigned)__cvta_generic_to_shared(p)));
    return reinterpret_cast<float*>(v);
}
#endif

#if GDN_RCL > 1
// Thread 0's fence after a block barrier orders every thread's earlier reads before its own arrival (as the
// count's fence did); the others arrive relaxed, so only warp 0 waits on the fence.
__device__ __forceinline__ void cluster_arrive_release(int tid) {
    if (tid == 0) asm volatile("fence.acq_rel.cluster;" ::: "memory");
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait_acquire() {
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
#endif

// threadIdx.x read anew (a volatile read is not hoisted out of the token loop), so that shared-memory addresses
// derived from it are recomputed where they are used instead of held in registers across the loop
__device__ __forceinline__ int fresh_tid() {
    int t;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
    return t;
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

// L2 prefetch of the part of a slot's state block (head hh, rank rr) reads (one bulk prefetch per state row of
// the block, thread-strided); a hint only, it changes no value
#define PF_BYTES (COLS * (int)sizeof(ES::T))
template <typename TS>
__device__ __forceinline__ void prefetch_state(const TS* slot_base, int hh, int rr, int tid) {
#if GDN_VMAJOR
    // the block's COLS columns are COLS contiguous runs of D keys
    const char* b = reinterpret_cast<const char*>(slot_base + ((size_t)hh * D + rr * COLS) * D);
    for (int c = tid; c < COLS; c += NT) prefetch_l2(b + (size_t)c * D * sizeof(TS), D * sizeof(TS));
#else
    // D keys, each a run of COLS columns
    for (int i = tid; i < D; i += NT) prefetch_l2(slot_base + ((size_t)i * HV + hh) * D + rr * COLS, PF_BYTES);
#endif
}

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
#if GDN_VMAJOR
__device__ __forceinline__ int kidx(int i) { return ((i / VCH) % RG) * KPAD + (i / (VCH * RG)) * VCH + i % VCH; }
#else
__device__ __forceinline__ int kidx(int i) { return (i / RPT) * KPAD + (i % RPT); }
#endif

#if STAGE
// register rows r .. r + 7 of row group rg of column j from the staged state, widened
__device__ __forceinline__ void staged8(const unsigned char* sst, int rg, int j, int r, float f[8]) {
#if GDN_VMAJOR
    const uint4 w = *reinterpret_cast<const uint4*>(sst + j * SPITCH + KEY(rg, r) * 2);
    const unsigned u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        f[2 * c] = __uint_as_float(u[c] << 16);
        f[2 * c + 1] = __uint_as_float(u[c] & 0xffff0000u);
    }
#else
#pragma unroll
    for (int q = 0; q < 8; ++q)
        f[q] = ES::ld(*reinterpret_cast<const unsigned short*>(sst + KEY(rg, r + q) * SPITCH + j * 2));
#endif
}
#endif

extern "C" __global__ void __launch_bounds__(NT, GDN_MINB)
#if GDN_NCB > 1
__cluster_dims__(GDN_NCB, 1, 1)
#elif GDN_RCL > 1
__cluster_dims__(GDN_RCL, 1, 1)
#endif
gdn_step(ES::T* __restrict__ state, float* __restrict__ hist, const EQ::T* __restrict__ qkv,
         const EA::T* __restrict__ alpha, const EB::T* __restrict__ beta, const EZ::T* __restrict__ z,
         const float* __restrict__ conv_w, const float* __restrict__ dt, const float* __restrict__ ssm_a,
         const float* __restrict__ gamma, EO::T* __restrict__ out, const int* __restrict__ seq_slot,
         const int* __restrict__ seq_start, const int* __restrict__ seq_len, const int* __restrict__ seq_commit,
         int n_slots, int n_rows, long long plane, float eps, unsigned* __restrict__ fault
#if GDN_EXT
         , const GdnExt ext
#endif
#if GDN_SPEC
         , float* __restrict__ pend, const int* __restrict__ seq_acc
#if GDN_EXT
         , int* __restrict__ held_w, unsigned* __restrict__ seq_ctr
#endif
#endif
         ) {
#if GDN_EXT
    (void)hist;
#endif
#if GDN_COMMIT == 0
    (void)seq_commit;
#endif
#if GDN_PLANES == 0
    (void)plane;
#endif
    __shared__ float vs[COLS];
    __shared__ __align__(16) float qn[RG * KPAD];
    __shared__ __align__(16) float kn[RG * KPAD];
    __shared__ float gb[2];
    __shared__ float part_qk[2 * D / 16];
    __shared__ float part_o[2][NW];
#if GDN_NCB > 1
    __shared__ float blk_o[2];
#endif
#if GDN_PLANES
    __shared__ float ys[COLS];
#endif
#if GDN_SPEC
    // the accepted prefix of the held window, copied in at the start (cp.async, in flight during the prologue):
    // per token the gate, the key head's normalized keys (in kn's layout, kidx) and this block's deltas
    __shared__ __align__(16) float acc_k[MAXH * RG * KPAD];
    __shared__ __align__(16) float acc_d[MAXH * COLS];
    __shared__ float acc_g[MAXH];
    // the last (up to) three accepted raw rows of the block's conv channels, [3][NE] by list entry (each
    // thread copies and reads its own entries, so no barrier)
    __shared__ float acc_r[3 * NE];
    // per warp the pointer to the buffer a held window goes to, re-read at every store: kept in registers it
    // is rematerialised with 64-bit arithmetic at each of them (register pressure)
    __shared__ unsigned long long pnew_w[NW];
#endif
#if STAGE
    // row = key i (key-major) or value column j (value-major) of this head: D bf16 and a skew
    __shared__ __align__(16) unsigned char sst[D * SPITCH];
#endif

    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
#if GDN_RCL && !GDN_GROUPED
    // clusters of a key head's readers: member m of cluster g is value head g + m h_k (g = h % h_k)
    const int h = (blockIdx.x % GDN_RCL) * HK + blockIdx.x / GDN_RCL;
#else
    // (grouped heads: a key head's readers are consecutive value heads already)
    const int h = blockIdx.x / NCB;
#endif
    const int rank = blockIdx.x % NCB;
    const int sq_i = blockIdx.y;
#if GDN_GROUPED
    const int g = h / (HV / HK);
#else
    const int g = h % HK;
#endif
    const int rg = lane % RG;
    const int col = warp * CPW + lane / RG;
    const int j = rank * COLS + col;  // column of the head's state
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
#if GDN_SPEC
    // read by the gate's thread where it uses them (held in registers they spill under the speculative kernel's
    // pressure, and the spill store waits for the load at the very start)
#define DTH __ldg(dt + h)
#define AH __ldg(ssm_a + h)
#else
    const float dth = dt[h];
    const float ah = ssm_a[h];
#define DTH dth
#define AH ah
#endif

#if __CUDA_ARCH__ >= 900
#if GDN_PREWAIT
    {
        int s0;
        asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];" : "=r"(s0) : "l"(seq_slot + sq_i));
        if (s0 >= 0 && s0 < n_slots) prefetch_state(state + SLOT_OFF(s0), h, rank, tid);
    }
#endif
    // everything below may read what the previous kernel in the stream wrote; let the next one start
    // meanwhile
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;");
#endif

    // the sequence: all four loads in flight at once; the rows and the state both wait only for them
    const int slot = seq_slot[sq_i];
#if GDN_AHEAD
    // the block GDN_AHEAD places later in launch order (its slot loaded with ours; prefetched after our loads)
    const unsigned ahead_lin = blockIdx.y * gridDim.x + blockIdx.x + GDN_AHEAD;
    const unsigned ahead_y = ahead_lin / gridDim.x, ahead_x = ahead_lin % gridDim.x;
    const int ahead_slot = ahead_y < gridDim.y ? seq_slot[ahead_y] : -1;
#endif
#if GDN_EXT
    // seq_start null: the rows are packed in sequence order and this sequence starts after the lengths before
    // it, summed by the block (a negative or zero length among them makes the start invalid: skipped, reported)
    int start_v;
    if (seq_start) {
        start_v = seq_start[sq_i];
    } else {
        __shared__ long long pre_sum[NW];
        __shared__ int pre_bad[NW];
        long long acc = 0;
        int bad = 0;
        for (int i = tid; i < sq_i; i += NT) {
            const int l = seq_len[i];
            acc += l;
#if GDN_SPEC
            bad |= l < 0;  // a speculative sequence may have no window (it only accepts)
#else
            bad |= l < 1;
#endif
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
        bad = __any_sync(0xffffffffu, bad);
        if (lane == 0) {
            pre_sum[warp] = acc;
            pre_bad[warp] = bad;
        }
        __syncthreads();
        long long tot = 0;
        int any_bad = 0;
#pragma unroll
        for (int w = 0; w < NW; ++w) {
            tot += pre_sum[w];
            any_bad |= pre_bad[w];
        }
        start_v = any_bad || tot > 0x7fffffffLL ? -1 : (int)tot;
    }
    const int start = start_v;
    // start / len, or cu_seqlens (seq_len null: the length is the next offset minus this one)
    const int next = seq_len ? seq_len[sq_i] : seq_start[sq_i + 1];
    const long long len_ll = seq_len ? (long long)next : (long long)next - start;
#if GDN_SPEC
    // length 0 is a valid (accept-only) sequence here: a bad length must fail the row check instead
    const int len = len_ll < 0 || len_ll > n_rows ? -1 : (int)len_ll;
    const int acc_in = seq_acc[sq_i];
#else
    const int len = len_ll < 0 || len_ll > n_rows ? 0 : (int)len_ll;
#endif
#if GDN_COMMIT
    const int commit_raw = seq_commit ? seq_commit[sq_i] : 0;
#endif
#else
    const int start = seq_start[sq_i];
    const int len = seq_len[sq_i];
#if GDN_COMMIT
    const int commit_in = seq_commit[sq_i];
#endif
#if GDN_SPEC
    const int acc_raw = seq_acc[sq_i];
#endif
#endif
    // a negative slot skips its sequence; an entry out of range is skipped too (fail-closed: nothing outside
    // the pool, the rows or the window is touched) and reported in the pool's fault word, which the next host
    // call turns into an error (bits: 1 slot past the pool, 2 length not the compiled one, 4 rows outside the
    // step's, 8 commit point outside 0..=length)
    if (slot < 0) return;
    const bool report = tid == 0 && h == 0 && rank == 0;
    if (slot >= n_slots) {
        if (report) atomicOr(fault, 1u);
        return;
    }
#if GDN_SPEC && (GDN_EXT || (GDN_T > 0 && (GDN_STATE_DT == 1 || GDN_T >= 8)))
    // the state's loads follow the accepted prefix's copies (and on engine memory the held word's check, a round
    // trip after the slot's): its rows start towards L2 now (a hint; the slot is valid). On the pool it paid for a
    // bf16 state (W 4 and 8, 2-3%) and an f32 state at W 8 (2%), and cost an f32 state 4-6% at W 4 (H100)
    prefetch_state(state + SLOT_OFF(slot), h, rank, tid);
#endif
#if GDN_T > 0
    constexpr int T = GDN_T;
    // uniform over the cluster: its blocks share the sequence
    if (len != T) {
        if (report) atomicOr(fault, 2u);
        return;
    }
#else
    const int T = len;
#endif
#if GDN_SPEC
    // a speculative call may name a sequence with no window (length 0: it only accepts a held prefix)
    if (T < 0 || start < 0 || start > n_rows - T) {
#else
    if (T < 1 || start < 0 || start > n_rows - T) {
#endif
        if (report) atomicOr(fault, 4u);
        return;
    }
#if GDN_COMMIT
#if GDN_EXT
    const int commit_in = seq_commit ? commit_raw : T;
#endif
    const bool commit_ok = commit_in >= 0 && commit_in <= T;
    if (!commit_ok && report) atomicOr(fault, 8u);
    const int commit_at = commit_ok ? commit_in : 0;
#if GDN_EXT && GDN_SPEC
    if (!commit_ok) return;  // a bad commit point must not hold the window instead
#endif
#endif
#if GDN_ROUTE
    {
#if GDN_COMMIT
        const int eff = commit_at > 0 ? commit_at : T;
#else
        const int eff = T;
#endif
        if (T >= 2 && eff >= GDN_WMIN && eff <= GDN_WMAX) return;
    }
#endif
#if GDN_SPEC
#if GDN_EXT
    // the slot's held word (length | buffer << 8): the engine's count must lie within what the slot holds, a window
    // held now within MAXH; else the sequence is skipped (every block of it reads the same word: the last reader
    // rewrites it only after all of them have counted)
    const int hw = held_w[slot];
    const int hlen = hw & 0xff;
    if (acc_in < 0 || acc_in > hlen || hlen > MAXH || (hw >> 9) != 0) {
        if (report) atomicOr(fault, 16u);
        return;
    }
    if (commit_at == 0 && T > MAXH) {
        if (report) atomicOr(fault, 32u);
        return;
    }
    const int acc_raw = acc_in | (hw & 0x100);
#endif
    // the held window's buffer and accepted count (bit 16 of the fault word: a count above MAXH, none applied)
    const bool acc_ok = acc_raw >= 0 && (acc_raw & 0xff) <= MAXH && (acc_raw >> 9) == 0;
    if (!acc_ok && report) atomicOr(fault, 16u);
    const int acc = acc_ok ? acc_raw & 0xff : 0;
    const int rbuf = (acc_raw >> 8) & 1;
    const float* pold = pend + ((size_t)slot * 2 + rbuf) * PEND_PB;
    {
        const unsigned long long pn = (unsigned long long)(pend + ((size_t)slot * 2 + (rbuf ^ 1)) * PEND_PB);
        if (lane == 0)
            asm volatile("st.shared.u64 [%0], %1;" ::"r"((unsigned)__cvta_generic_to_shared(pnew_w + warp)), "l"(pn)
                         : "memory");
        __syncwarp();
    }
#define PNEW pend_new(pnew_w + warp)
    const bool held = commit_at == 0;
    // the first value head of a key head (its rank 0) keeps the key head's normalized keys and raw q / k rows
#if GDN_GROUPED
    const bool qkw = h % (HV / HK) == 0 && rank == 0;
#else
    const bool qkw = h < HK && rank == 0;
#endif
    const bool rows_in = T > 0;
    {
        // the accepted prefix into shared memory, 16 bytes a copy (gates 4): keys D / 4 and deltas COLS / 4
        // copies a token; the loads overlap the state's and the prologue, the apply reads shared memory
        const unsigned sk = (unsigned)__cvta_generic_to_shared(acc_k);
        const unsigned sd = (unsigned)__cvta_generic_to_shared(acc_d);
        const unsigned sg = (unsigned)__cvta_generic_to_shared(acc_g);
        const int nk = acc * (D / 4), nd = acc * (COLS / 4);
        for (int c = tid; c < nk + nd + acc; c += NT) {
            if (c < nk) {
                const int u = c / (D / 4), i = (c % (D / 4)) * 4;
                const float* src = pold + PK_OFF + ((size_t)g * MAXH + u) * D + i;
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(sk + 4u * (u * RG * KPAD + kidx(i))), "l"(src)
                             : "memory");
            } else if (c < nk + nd) {
                const int u = (c - nk) / (COLS / 4), jj = ((c - nk) % (COLS / 4)) * 4;
                const float* src = pold + PD_OFF + ((size_t)h * MAXH + u) * D + rank * COLS + jj;
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(sd + 4u * (u * COLS + jj)), "l"(src)
                             : "memory");
            } else {
                const int u = c - nk - nd;
                const float* src = pold + PG_OFF + h * MAXH + u;
                asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(sg + 4u * u), "l"(src) : "memory");
            }
        }
        // the raw rows of the history after the accepted prefix: rows acc - 3 .. acc - 1 (those that exist)
        const unsigned sr = (unsigned)__cvta_generic_to_shared(acc_r);
#pragma unroll
        for (int i = 0; i < 3; ++i) {
            const int u = acc - 3 + i;
#pragma unroll
            for (int m = 0; m < NCH; ++m) {
                if (u >= 0 && chan[m] >= 0) {
                    const float* src = pold + PR_OFF + (size_t)u * C_ALL + chan[m];
                    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(sr + 4u * (i * NE + tid + m * NT)), "l"(src)
                                 : "memory");
                }
            }
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
    }
#else
    constexpr bool rows_in = true;
#endif

#if STAGE
    {
        const char* gbase = reinterpret_cast<const char*>(state + SLOT_OFF(slot));
        const unsigned sbase = (unsigned)__cvta_generic_to_shared(sst);
        constexpr int PER_ROW = 2 * D / 16;
        // a pass of the block copies ROWS_STEP whole rows, so every copy is the first one plus a constant: the
        // addresses once, not a 64-bit computation a copy (ncu: those made 1.8 instructions a state element)
        constexpr int ROWS_STEP = NT / PER_ROW;
        static_assert(NT % PER_ROW == 0 && (D * PER_ROW) % NT == 0, "the staging copies whole rows a pass");
        const int row0 = tid / PER_ROW, part = tid % PER_ROW;
#if GDN_VMAJOR
        const char* src = gbase + (size_t)(h * D + row0) * D * 2 + part * 16;
        constexpr size_t GSTEP = (size_t)ROWS_STEP * D * 2;
#else
        const char* src = gbase + ((size_t)row0 * HV + h) * D * 2 + part * 16;
        constexpr size_t GSTEP = (size_t)ROWS_STEP * HV * D * 2;
#endif
        const unsigned dst = sbase + row0 * SPITCH + part * 16;
#pragma unroll
        for (int i = 0; i < D * PER_ROW / NT; ++i)
            asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;" ::"r"(dst + i * ROWS_STEP * SPITCH),
                         "l"(src + i * GSTEP)
                         : "memory");
        asm volatile("cp.async.commit_group;" ::: "memory");
    }
#endif

    // inputs of the first token
    const EQ::T* qkv_b = qkv + (size_t)start * QKV_RS;
    // inputs are kept as loaded and widened where they are used: a conversion right after a load would wait for
    // it before the next barrier (ptxas does not move instructions across one), where an f32 value's load
    // completes in the background (16-bit activations cost 18% at T 8 that way)
    EQ::T in[NCH];
#pragma unroll
    for (int m = 0; m < NCH; ++m) in[m] = chan[m] >= 0 && rows_in ? qkv_b[chan[m]] : (EQ::T)0;
    const size_t row0 = (size_t)start;
#if !PHASED
    EZ::T zz = rg == 0 && rows_in ? z[row0 * Z_RS + h * D + j] : (EZ::T)0;
#endif
    EA::T a_in = 0;
    EB::T b_in = 0;
    if (tid == NT - 1 && rows_in) a_in = alpha[row0 * A_RS + h];
    else if (tid == NT - 2 && rows_in) b_in = beta[row0 * B_RS + h];

#if GDN_EXT
    // column w - 3 of channel 0 of this slot; a channel's three columns are conv_ls apart
    EC::T* conv_b = reinterpret_cast<EC::T*>(ext.conv) + (size_t)slot * ext.conv_ss + ext.conv_off;
#else
    float* hist_head = hist + ((size_t)slot * HV + h) * (3 * D * 3);
#endif
    float hst[NCH][3];
#pragma unroll
    for (int m = 0; m < NCH; ++m) {
        if (chan[m] >= 0) {
#if GDN_EXT
            const EC::T* p = conv_b + (size_t)chan[m] * ext.conv_cs;
            hst[m][0] = EC::ld(p[0]);
            hst[m][1] = EC::ld(p[ext.conv_ls]);
            hst[m][2] = EC::ld(p[2 * ext.conv_ls]);
#else
            const int o = hist_off(tid + m * NT, rank);
            hst[m][0] = hist_head[o];
            hst[m][1] = hist_head[o + 1];
            hst[m][2] = hist_head[o + 2];
#endif
        } else {
            hst[m][0] = hst[m][1] = hst[m][2] = 0.0f;
        }
    }

    // the state: RPT rows of column j, read once
    // register row r sits at st_base + SOFF(r)
#if GDN_VMAJOR
    ES::T* st_base = state + SLOT_OFF(slot) + ((size_t)h * D + j) * D + KEY(rg, 0);
#define SOFF(r) ((size_t)(KEY(0, r)))
#else
    ES::T* st_base = state + SLOT_OFF(slot) + ((size_t)KEY(rg, 0) * HV + h) * D + j;
#define SOFF(r) ((size_t)(r) * HV * D)
#endif
#if !STAGE
    float st[RPT];
#if VEC_STATE && GDN_STATE_DT == 0
#pragma unroll
    for (int r = 0; r < RPT; r += 4) {
        const float4 w = *reinterpret_cast<const float4*>(st_base + SOFF(r));
        st[r] = w.x;
        st[r + 1] = w.y;
        st[r + 2] = w.z;
        st[r + 3] = w.w;
    }
#elif VEC_STATE
#pragma unroll
    for (int r = 0; r < RPT; r += 8) {
        const uint4 w = *reinterpret_cast<const uint4*>(st_base + SOFF(r));
        const unsigned u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            st[r + 2 * c] = __uint_as_float(u[c] << 16);
            st[r + 2 * c + 1] = __uint_as_float(u[c] & 0xffff0000u);
        }
    }
#else
#pragma unroll
    for (int r = 0; r < RPT; ++r) st[r] = ES::ld(st_base[SOFF(r)]);
#endif
#endif  // !STAGE
#if !STAGE
    // the register rows back to the slot, in the state's type (the commit, or a held window's accepted state)
    auto store_state = [&]() {
#if VEC_STATE && GDN_STATE_DT == 0
#pragma unroll
        for (int r = 0; r < RPT; r += 4)
            *reinterpret_cast<float4*>(st_base + SOFF(r)) = make_float4(st[r], st[r + 1], st[r + 2], st[r + 3]);
#elif VEC_STATE
#pragma unroll
        for (int r = 0; r < RPT; r += 8) {
            unsigned u[4];
#pragma unroll
            for (int c = 0; c < 4; ++c)
                u[c] = (unsigned)ES::st(st[r + 2 * c]) | ((unsigned)ES::st(st[r + 2 * c + 1]) << 16);
            *reinterpret_cast<uint4*>(st_base + SOFF(r)) = make_uint4(u[0], u[1], u[2], u[3]);
        }
#else
#pragma unroll
        for (int r = 0; r < RPT; ++r) st_base[SOFF(r)] = ES::st(st[r]);
#endif
    };
    // step 3's column sum S^T k (two partial sums, rows 4q.. and 4q+2.., halve the dependent chain; combined in a
    // fixed order, then over the column's RG lanes)
    auto kv_sum = [&](const float* kt) -> float {
        float kv0 = 0.0f, kv1 = 0.0f;
#pragma unroll
        for (int r = 0; r < RPT; r += 4) {
            const float4 k4 = *reinterpret_cast<const float4*>(kt + r);
            kv0 = fmaf(st[r + 0], k4.x, kv0);
            kv0 = fmaf(st[r + 1], k4.y, kv0);
            kv1 = fmaf(st[r + 2], k4.z, kv1);
            kv1 = fmaf(st[r + 3], k4.w, kv1);
        }
        return row_sum(kv0 + kv1);
    };
    // step 3's update st = g st + k delta of the register rows and the readout o = S^T q / sqrt(d) of the column
    auto update_readout = [&](const float* kt, const float* qt, float gt, float delta) -> float {
        float o0 = 0.0f, o1 = 0.0f;
#pragma unroll
        for (int r = 0; r < RPT; r += 4) {
            const float4 k4 = *reinterpret_cast<const float4*>(kt + r);
            const float4 q4 = *reinterpret_cast<const float4*>(qt + r);
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
        return row_sum(o0 + o1) * inv_sqrt_d;
    };
#endif
    // step 1 of conv channel m: the conv of its history and the input x, SiLU; the history shifted by x
    auto conv_silu = [&](int m, float x) -> float {
        const float4 w = __ldg(reinterpret_cast<const float4*>(conv_w) + chan[m]);
        float s = 0.0f;
        s = fmaf(hst[m][0], w.x, s);
        s = fmaf(hst[m][1], w.y, s);
        s = fmaf(hst[m][2], w.z, s);
        s = fmaf(x, w.w, s);
        hst[m][0] = hst[m][1];
        hst[m][1] = hst[m][2];
        hst[m][2] = x;
        return s / (1.0f + expf(-s));
    };
    // the sum of squares of the 16 q / k channels of list entries e & ~15 .. (the lanes of one half warp)
    auto sumsq16 = [&](float cv, int e) -> float {
        float sq = e < 2 * D ? cv * cv : 0.0f;
        sq += __shfl_xor_sync(0xffffffffu, sq, 8);
        sq += __shfl_xor_sync(0xffffffffu, sq, 4);
        sq += __shfl_xor_sync(0xffffffffu, sq, 2);
        sq += __shfl_xor_sync(0xffffffffu, sq, 1);
        return sq;
    };
#if GDN_AHEAD
    if (ahead_slot >= 0 && ahead_slot < n_slots)
        prefetch_state(state + SLOT_OFF(ahead_slot), (int)ahead_x / NCB, (int)ahead_x % NCB, tid);
#endif

#if GDN_SPEC
    if (acc > 0) {
        // the history after the accepted rows of the held window: the last three of (history, rows 0 .. acc - 1),
        // the rows from this thread's own copies (acc_r slot i holds row acc - 3 + i)
        asm volatile("cp.async.wait_all;" ::: "memory");
#pragma unroll
        for (int m = 0; m < NCH; ++m) {
            if (chan[m] >= 0) {
                const float h1 = hst[m][1], h2 = hst[m][2];
                const int e = tid + m * NT;
                hst[m][0] = acc >= 3 ? acc_r[e] : acc == 2 ? h2 : h1;
                hst[m][1] = acc >= 2 ? acc_r[NE + e] : h2;
                hst[m][2] = acc_r[2 * NE + e];
            }
        }
        if (held) {
            // the window runs held: the accepted history is the committed one now (a committing window writes
            // it at its commit instead)
#if GDN_EXT
            // v: the column's owner (its only reader) writes it now; q / k: kept in this thread's own acc_r
            // entries for the key head's last reader (write_acc_qk, once every reader has read the history)
#pragma unroll
            for (int m = 0; m < NCH; ++m) {
                const int e = tid + m * NT;
                if (chan[m] >= 0) {
                    if (e < 2 * D) {
                        acc_r[e] = hst[m][0];
                        acc_r[NE + e] = hst[m][1];
                        acc_r[2 * NE + e] = hst[m][2];
                    } else {
                        EC::T* p = conv_b + (size_t)chan[m] * ext.conv_cs;
                        p[0] = EC::st(hst[m][0]);
                        p[ext.conv_ls] = EC::st(hst[m][1]);
                        p[2 * ext.conv_ls] = EC::st(hst[m][2]);
                    }
                }
            }
#else
#if GDN_NCB > 1
            cluster_sync_all();  // every block of the cluster has read the q / k history it shares
#endif
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
#endif  // GDN_EXT
        }
    }
#endif

#if GDN_SPEC
    // applies the accepted prefix of the held window to the state: as it is first used (token 0, its loads had
    // the prologue to land), or after the loop for a sequence with no window
    auto apply_accepted = [&]() {
        if (acc == 0) return;

        // the accepted prefix of the held window applied to the state as it is first used (its loads had
        // the prologue to land), token by token with the update's own operations (step 3's
        // st = fmaf(gt, st, k4 * delta)) on the gate, key and delta bits the held window computed
        // (read from the shared copies: the caller waited for them and passed a barrier)
        for (int u = 0; u < acc; ++u) {
            const float gu = acc_g[u];
            const float du = acc_d[u * COLS + col];
            const float* ku = acc_k + u * RG * KPAD + rg * KPAD;
#pragma unroll
            for (int r = 0; r < RPT; r += 4) {
                // register rows r .. r + 3 (keys KEY(rg, r) ..), as kn holds them
                const float4 k4 = *reinterpret_cast<const float4*>(ku + r);
                st[r + 0] = fmaf(gu, st[r + 0], k4.x * du);
                st[r + 1] = fmaf(gu, st[r + 1], k4.y * du);
                st[r + 2] = fmaf(gu, st[r + 2], k4.z * du);
                st[r + 3] = fmaf(gu, st[r + 3], k4.w * du);
                if ((r & 7) == 4) __syncwarp();  // keeps ptxas from loading all of k ahead (registers)
            }
        }
#if GDN_STATE_DT == 1
        // the k-token commit stores the state rounded once, and the next window loads that. A window that runs held
        // stores those bits now (the accepted state is the committed one; a committing window writes it at its
        // commit instead): each value is rounded once, for both (rounding the rounded value again cost ~7 integer
        // instructions a state element)
        if (held) {
#if VEC_STATE
#pragma unroll
            for (int r = 0; r < RPT; r += 8) {
                unsigned short b[8];
#pragma unroll
                for (int q = 0; q < 8; ++q) b[q] = ES::st(st[r + q]);
                unsigned u[4];
#pragma unroll
                for (int c = 0; c < 4; ++c) u[c] = (unsigned)b[2 * c] | ((unsigned)b[2 * c + 1] << 16);
                *reinterpret_cast<uint4*>(st_base + SOFF(r)) = make_uint4(u[0], u[1], u[2], u[3]);
#pragma unroll
                for (int q = 0; q < 8; ++q) st[r + q] = ES::ld(b[q]);
            }
#else
#pragma unroll
            for (int r = 0; r < RPT; ++r) {
                const unsigned short b = ES::st(st[r]);
                st_base[SOFF(r)] = b;
                st[r] = ES::ld(b);
            }
#endif
        } else {
#pragma unroll
            for (int r = 0; r < RPT; ++r) st[r] = ES::ld(ES::st(st[r]));
        }
#else
        if (held) store_state();  // (as above)
#endif
    };
#endif

#if GDN_EXT && GDN_COMMIT && !GDN_RCL
    // the last-reader count of this sequence's q / k history (see EXTERNAL above): thread 0 counts the block
    // at token 0 once the conv has consumed every thread's history (after the token's first barrier) and
    // publishes the verdict before its output-norm barrier, so the atomic's round trip overlaps the sweeps
    __shared__ unsigned last_s;
    unsigned* const ctr = ext.ctr + (size_t)sq_i * HK + g;
    unsigned before = 0;
    // thread 0, once every thread has consumed its history (a barrier before): the block counts itself
    auto count_reader = [&]() {
        __threadfence();  // release: the block's history reads (ordered by the barrier) before the count
        before = atomicAdd(ctr, 1u);
    };
    // thread 0, later (the atomic's round trip overlaps the work between, a barrier after): whether the block is
    // the key head's last reader
    auto publish_last_reader = [&]() {
        const bool last = before == READERS - 1;
        if (last) {
            atomicExch(ctr, 0u);
            __threadfence();  // acquire: every reader counted, so every read is done, before the writes
        }
        last_s = last;
    };
#endif
#if GDN_EXT && GDN_SPEC
    // the held word after this step, written by the sequence's last block (see EXTERNAL SPECULATIVE)
    unsigned* const sctr = seq_ctr + sq_i;
    const int new_hw = held ? (T | ((rbuf ^ 1) << 8)) : (rbuf << 8);
    const bool qk = commit_at > 0 || acc > 0;  // the sequence writes a history
    unsigned sbefore = 0;
    // thread 0: counts the block in both counters (the q / k one where the sequence writes a history)
    auto count_block = [&]() {
        __threadfence();  // release: the block's reads (ordered by the barrier before) before the counts
        if (qk) before = atomicAdd(ctr, 1u);
        sbefore = atomicAdd(sctr, 1u);
    };
    // thread 0, later (the atomics' round trips overlap the work between): rewrites the held word if the block is
    // the sequence's last, and publishes whether it is the key head's last reader
    auto verdict = [&]() {
        if (sbefore == HV * NCB - 1) {
            atomicExch(sctr, 0u);
            __threadfence();  // acquire: every block has read the held word
            held_w[slot] = new_hw;
        }
        if (qk) {
            const bool last = before == READERS - 1;
            if (last) {
                atomicExch(ctr, 0u);
                __threadfence();  // acquire: every reader counted, so every read is done, before the writes
            }
            last_s = last;
        }
    };
    // the accepted q / k history of a window that runs held (or of no window), by the key head's last reader
    auto write_acc_qk = [&]() {
        if (!(held && acc > 0 && last_s)) return;
#pragma unroll
        for (int m = 0; m < NCH; ++m) {
            const int e = tid + m * NT;
            if (e < 2 * D) {
                EC::T* p = conv_b + (size_t)chan[m] * ext.conv_cs;
                p[0] = EC::st(acc_r[e]);
                p[ext.conv_ls] = EC::st(acc_r[NE + e]);
                p[2 * ext.conv_ls] = EC::st(acc_r[2 * NE + e]);
            }
        }
    };
#endif

#if GDN_COMMIT
    // the committed history (h0, h1, h2) of conv channel m (list entry tid + m NT), by the one block that writes it
    auto write_history = [&](int m, float h0, float h1, float h2) {
        const int e = tid + m * NT;
#if GDN_EXT
        // q / k: the last reader only (last_s was published before token 0's output-norm barrier, which every
        // commit follows), or the readers' cluster's member 0; v: the owner of the column
#if GDN_RCL
        const bool mine = e < 2 * D ? blockIdx.x % GDN_RCL == 0 : chan[m] >= 0;
#else
        const bool mine = e < 2 * D ? last_s != 0 : chan[m] >= 0;
#endif
        if (mine) {
            EC::T* p = conv_b + (size_t)chan[m] * ext.conv_cs;
            p[0] = EC::st(h0);
            p[ext.conv_ls] = EC::st(h1);
            p[2 * ext.conv_ls] = EC::st(h2);
        }
#else
        // q / k: the rank that owns them in the head's private copy; v: the owner of the column
        const bool mine = e < 2 * D ? (e / QK_PER_RANK) == rank : chan[m] >= 0;
        if (mine) {
            const int o = hist_off(e, rank);
            hist_head[o] = h0;
            hist_head[o + 1] = h1;
            hist_head[o + 2] = h2;
        }
#endif
    };
#endif
#if PHASED
    // (PHASED above) per token: q and k (the conv outputs, normalized in place), this block's v, gate and write
    // strength, the sums of squares of q and k per 16 channels, the output's per-warp sums of squares and readouts
    __shared__ __align__(16) float qn_w[T][RG * KPAD];
    __shared__ __align__(16) float kn_w[T][RG * KPAD];
    __shared__ float vs_w[T][COLS];
    __shared__ float gb_w[T][2];
    __shared__ float pqk_w[T][2 * D / 16];
    __shared__ float po_w[T][NW];
    __shared__ float o_w[T][COLS];
#if GDN_COMMIT
    __shared__ float hc_w[3][NE];  // the history after the commit token (each thread its own entries)
#endif
#if GDN_NCB > 1
    __shared__ float blk_ow[T];
#endif
#if GDN_PLANES
    __shared__ float ys_w[T][COLS];
#endif
    // A. every token's conv and gates (all rows' loads in flight before the first is used), then the L2 norms
    {
        EQ::T in_t[T][NCH];
        EA::T a_t[T];
        EB::T b_t[T];
#pragma unroll
        for (int t = 0; t < T; ++t) {
#pragma unroll
            for (int m = 0; m < NCH; ++m)
                in_t[t][m] = t == 0 ? in[m] : chan[m] >= 0 ? qkv_b[(size_t)t * QKV_RS + chan[m]] : (EQ::T)0;
            a_t[t] = t == 0 ? a_in : tid == NT - 1 ? alpha[(row0 + t) * A_RS + h] : (EA::T)0;
            b_t[t] = t == 0 ? b_in : tid == NT - 2 ? beta[(row0 + t) * B_RS + h] : (EB::T)0;
        }
#pragma unroll
        for (int t = 0; t < T; ++t) {
#pragma unroll
            for (int m = 0; m < NCH; ++m) {
                const int e = tid + m * NT;
                float cv = 0.0f;
                if (chan[m] >= 0) {
                    const float x = EQ::ld(in_t[t][m]);
#if GDN_SPEC
                    if (held && t < MAXH && (e >= 2 * D || qkw)) PNEW[PR_OFF + t * C_ALL + chan[m]] = x;
#endif
                    cv = conv_silu(m, x);
                    if (e < D) qn_w[t][kidx(e)] = cv;
                    else if (e < 2 * D) kn_w[t][kidx(e - D)] = cv;
                    else vs_w[t][e - 2 * D] = cv;
#if GDN_COMMIT
                    if (t + 1 == commit_at) {
                        hc_w[0][e] = hst[m][0];
                        hc_w[1][e] = hst[m][1];
                        hc_w[2][e] = hst[m][2];
                    }
#endif
                }
                const float sq = sumsq16(cv, e);
                if (e < 2 * D && (e & 15) == 0) pqk_w[t][e >> 4] = sq;
            }
            if (tid == NT - 1) {
                const float gt = softplus_decay(EA::ld(a_t[t]) + DTH, AH);
                gb_w[t][0] = gt;
#if GDN_SPEC
                if (held && t < MAXH && rank == 0) PNEW[PG_OFF + h * MAXH + t] = gt;
#endif
            } else if (tid == NT - 2) {
                gb_w[t][1] = sigmoid_f(EB::ld(b_t[t]));
            }
        }
    }
    __syncthreads();
#if GDN_EXT && GDN_SPEC
    if (tid == 0) count_block();
    const int tid_n = fresh_tid();  // (as in the token loop: fewer spills)
#elif GDN_EXT && GDN_COMMIT
    if (tid == 0 && commit_at > 0) count_reader();
    const int tid_n = tid;
#else
    const int tid_n = tid;
#endif
#pragma unroll
    for (int t = 0; t < T; ++t) {
#pragma unroll
        for (int m = 0; m < NCH; ++m) {
            const int e = tid_n + m * NT;
            if (e < 2 * D) {
                const int base = e < D ? 0 : D / 16;
                float tot = 0.0f;
#pragma unroll
                for (int c = 0; c < D / 16; ++c) tot += pqk_w[t][base + c];
                const float r = rsqrtf(tot / (float)D + eps / (float)D);
                float* p = e < D ? &qn_w[t][kidx(e)] : &kn_w[t][kidx(e - D)];
                const float x = (r * *p) * inv_sqrt_d;
                *p = x;
#if GDN_SPEC
                if (e >= D && held && t < MAXH && qkw) PNEW[PK_OFF + (g * MAXH + t) * D + (e - D)] = x;
#endif
            }
        }
    }
#if GDN_SPEC
    asm volatile("cp.async.wait_all;" ::: "memory");  // the accepted prefix (the barrier makes it visible)
#endif
    __syncthreads();
#if GDN_SPEC
    apply_accepted();
#endif

    // B. each column's recurrence over the window (the token loop's step 3; no barrier)
    for (int t = 0; t < T; ++t) {
        const float* kt = kn_w[t] + rg * KPAD;
        const float kv = kv_sum(kt);
        __syncwarp();  // (as in the token loop)
        const float gt = gb_w[t][0], bt = gb_w[t][1];
        const float delta = (vs_w[t][col] - gt * kv) * bt;
#if GDN_SPEC
        if (held && t < MAXH && rg == 0) PNEW[PD_OFF + (h * MAXH + t) * D + j] = delta;
#endif
        const float o = update_readout(kt, qn_w[t] + rg * KPAD, gt, delta);
#if GDN_COMMIT
        if (t + 1 == commit_at) store_state();
#endif
        float osq = rg == 0 ? o * o : 0.0f;
#pragma unroll
        for (int off = RG; off < 32; off <<= 1) osq += __shfl_xor_sync(0xffffffffu, osq, off);
        if (lane == 0) po_w[t][warp] = osq;
        if (rg == 0) o_w[t][col] = o;
    }

    // C. the output norm, gate, y and planes of every (token, column), over all threads
    constexpr int ITEMS = T * COLS;
    constexpr int PER_T = (ITEMS + NT - 1) / NT;
    EZ::T z_i[PER_T];
#pragma unroll
    for (int k = 0; k < PER_T; ++k) {
        const int i = tid + k * NT;
        z_i[k] = i < ITEMS ? z[(row0 + i / COLS) * Z_RS + h * D + rank * COLS + i % COLS] : (EZ::T)0;
    }
#if GDN_EXT && GDN_SPEC
    if (tid == 0) verdict();
#elif GDN_EXT && GDN_COMMIT
    if (tid == 0 && commit_at > 0) publish_last_reader();
#endif
    __syncthreads();
#if GDN_EXT && GDN_SPEC
    write_acc_qk();
#endif
#if GDN_NCB > 1
    if (tid < T) blk_ow[tid] = Tree<NW>::sum(po_w[tid]);
    cluster_sync_all();
#endif
#pragma unroll
    for (int k = 0; k < PER_T; ++k) {
        const int i = tid + k * NT;
        if (i < ITEMS) {
            const int t = i / COLS, c = i % COLS;
#if GDN_NCB > 1
            float rem[NCB];
#pragma unroll
            for (int cc = 0; cc < NCB; ++cc) rem[cc] = cc == rank ? blk_ow[t] : ld_cluster(&blk_ow[t], (unsigned)cc);
            const float tot = Tree<NCB>::sum(rem);
#else
            const float tot = Tree<NW>::sum(po_w[t]);
#endif
            const float rs = rsqrtf(tot / (float)D + eps);
            const float zt = EZ::ld(z_i[k]);
#if GDN_SILU
            const float act = zt * sigmoid_f(zt);
#else
            const float act = sigmoid_f(zt);
#endif
            const int jc = rank * COLS + c;
            const float yv = ((rs * o_w[t][c]) * gamma[jc]) * act;
            const size_t yi = (row0 + t) * O_RS + h * D + jc;
            store_y<EO, GDN_PLANES != 0>(out, plane, yi, jc, yv);
#if GDN_PLANES
            ys_w[t][c] = yv;
#endif
        }
    }
#if GDN_PLANES
    __syncthreads();
    for (int i = tid; i < T * (COLS / 16); i += NT) {
        const int t = i / (COLS / 16), q = i % (COLS / 16);
        float s_even = 0.0f, s_odd = 0.0f;
#pragma unroll
        for (int e = 0; e < 16; e += 2) {
            s_even += ys_w[t][16 * q + e];
            s_odd += ys_w[t][16 * q + e + 1];
        }
        out[4 * plane + (row0 + t) * (N_OUT / 16) + (h * D + rank * COLS) / 16 + q] = EO::st(s_even + s_odd);
    }
#endif
#if GDN_COMMIT
    // the history after the commit token, once every block of the cluster has read its own (before phase A)
    if (commit_at > 0) {
#pragma unroll
        for (int m = 0; m < NCH; ++m) {
            const int e = tid + m * NT;
            write_history(m, hc_w[0][e], hc_w[1][e], hc_w[2][e]);
        }
    }
#endif
#else  // PHASED
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
                const float x = EQ::ld(in[m]);
#if GDN_SPEC
                if (held && t < MAXH && (e >= 2 * D || qkw)) PNEW[PR_OFF + t * C_ALL + chan[m]] = x;
#endif
                cv = conv_silu(m, x);
                in[m] = more ? qkv_b[(size_t)(t + 1) * QKV_RS + chan[m]] : (EQ::T)0;
                if (e >= 2 * D) vs[e - 2 * D] = cv;
            }
            cvs[m] = cv;
            const float sq = sumsq16(cv, e);
            if (e < 2 * D && (e & 15) == 0) part_qk[e >> 4] = sq;
        }
        // gate and write strength, and the next token's alpha / beta
        if (tid == NT - 1) {
            gb[0] = softplus_decay(EA::ld(a_in) + DTH, AH);
#if GDN_SPEC
            if (held && t < MAXH && rank == 0) PNEW[PG_OFF + h * MAXH + t] = gb[0];
#endif
            a_in = more ? alpha[(row + 1) * A_RS + h] : (EA::T)0;
        } else if (tid == NT - 2) {
            gb[1] = sigmoid_f(EB::ld(b_in));
            b_in = more ? beta[(row + 1) * B_RS + h] : (EB::T)0;
        }
        __syncthreads();
#if GDN_EXT && GDN_SPEC
        if (t == 0 && tid == 0) count_block();
#elif GDN_EXT && GDN_COMMIT && GDN_RCL > 1
        if (t == 0 && commit_at > 0) cluster_arrive_release(tid);  // every thread has consumed its history
#elif GDN_EXT && GDN_COMMIT && !GDN_RCL
        if (t == 0 && tid == 0 && commit_at > 0) count_reader();
#endif

        // 2. L2 norms: each q / k channel's thread scales its value, in the spec's two roundings
#if GDN_EXT && GDN_SPEC
        const int tid_n = fresh_tid();  // (the engine-memory speculative kernel's registers: fewer spills)
#else
        const int tid_n = tid;
#endif
#pragma unroll
        for (int m = 0; m < NCH; ++m) {
            const int e = tid_n + m * NT;
            if (e < 2 * D) {
                const int base = e < D ? 0 : D / 16;
                float tot = 0.0f;
#pragma unroll
                for (int c = 0; c < D / 16; ++c) tot += part_qk[base + c];
                const float r = rsqrtf(tot / (float)D + eps / (float)D);
                const float x = (r * cvs[m]) * inv_sqrt_d;
                if (e < D) qn[kidx(e)] = x;
                else kn[kidx(e - D)] = x;
#if GDN_SPEC
                if (e >= D && held && t < MAXH && qkw) PNEW[PK_OFF + (g * MAXH + t) * D + (e - D)] = x;
#endif
            }
        }
#if STAGE
        asm volatile("cp.async.wait_all;" ::: "memory");  // this thread's copies; the barrier makes all visible
#endif
#if GDN_SPEC
        if (t == 0) asm volatile("cp.async.wait_all;" ::: "memory");  // the accepted prefix (as above)
#endif
        __syncthreads();

#if GDN_SPEC
        if (t == 0) apply_accepted();
#endif
        // 3. kv_j, the delta rule and the readout: column sums over the RG lanes of the column
#if STAGE
        float kv0 = 0.0f, kv1 = 0.0f;
#pragma unroll
        for (int r = 0; r < RPT; r += 8) {
            float f[8];
            staged8(sst, rg, j, r, f);
#pragma unroll
            for (int q = 0; q < 8; q += 4) {
                const float4 k4 = *reinterpret_cast<const float4*>(&kn[rg * KPAD + r + q]);
                kv0 = fmaf(f[q + 0], k4.x, kv0);
                kv0 = fmaf(f[q + 1], k4.y, kv0);
                kv1 = fmaf(f[q + 2], k4.z, kv1);
                kv1 = fmaf(f[q + 3], k4.w, kv1);
            }
        }
        const float kv = row_sum(kv0 + kv1);
#else
        const float kv = kv_sum(&kn[rg * KPAD]);
#endif
        // read k again below rather than keep RPT values of it live across the butterfly (registers)
        __syncwarp();
        const float gt = gb[0], bt = gb[1];
        const float delta = (vs[col] - gt * kv) * bt;
#if GDN_SPEC
        if (held && t < MAXH && rg == 0) PNEW[PD_OFF + (h * MAXH + t) * D + j] = delta;
#endif
#if STAGE
        float o0 = 0.0f, o1 = 0.0f;
        // the same operations in the same order as the register path below; the committed value is rounded
        // and stored right here (T 1: the commit, if any, is after this token)
#if GDN_COMMIT
        const bool commit_now = commit_at == 1;
#endif
#pragma unroll
        for (int r = 0; r < RPT; r += 8) {
            float f[8], n[8];
            staged8(sst, rg, j, r, f);
#pragma unroll
            for (int q = 0; q < 8; q += 4) {
                const float4 k4 = *reinterpret_cast<const float4*>(&kn[rg * KPAD + r + q]);
                const float4 q4 = *reinterpret_cast<const float4*>(&qn[rg * KPAD + r + q]);
                n[q + 0] = fmaf(gt, f[q + 0], k4.x * delta);
                o0 = fmaf(n[q + 0], q4.x, o0);
                n[q + 1] = fmaf(gt, f[q + 1], k4.y * delta);
                o0 = fmaf(n[q + 1], q4.y, o0);
                n[q + 2] = fmaf(gt, f[q + 2], k4.z * delta);
                o1 = fmaf(n[q + 2], q4.z, o1);
                n[q + 3] = fmaf(gt, f[q + 3], k4.w * delta);
                o1 = fmaf(n[q + 3], q4.w, o1);
            }
#if GDN_COMMIT
            if (commit_now) {
#if GDN_VMAJOR
                unsigned u[4];
#pragma unroll
                for (int c = 0; c < 4; ++c) u[c] = (unsigned)ES::st(n[2 * c]) | ((unsigned)ES::st(n[2 * c + 1]) << 16);
                *reinterpret_cast<uint4*>(st_base + SOFF(r)) = make_uint4(u[0], u[1], u[2], u[3]);
#else
#pragma unroll
                for (int q = 0; q < 8; ++q) st_base[SOFF(r + q)] = ES::st(n[q]);
#endif
            }
#endif
        }
        float o = o0 + o1;
        o = row_sum(o) * inv_sqrt_d;
#else
        const float o = update_readout(&kn[rg * KPAD], &qn[rg * KPAD], gt, delta);
#if GDN_COMMIT
        if (t + 1 == commit_at) {
            store_state();
        }
#endif
#endif  // STAGE
        // 4. the output norm: per-warp partial of sum_j o_j^2 (each column once: its rg 0 lane)
        float osq = rg == 0 ? o * o : 0.0f;
#pragma unroll
        for (int off = RG; off < 32; off <<= 1) osq += __shfl_xor_sync(0xffffffffu, osq, off);
        const float zt = EZ::ld(zz);
        if (rg == 0) zz = more ? z[(row + 1) * Z_RS + h * D + j] : (EZ::T)0;
        if (lane == 0) part_o[t & 1][warp] = osq;
#if GDN_EXT && GDN_SPEC
        if (t == 0 && tid == 0) verdict();
#elif GDN_EXT && GDN_COMMIT && !GDN_RCL
        if (t == 0 && tid == 0 && commit_at > 0) publish_last_reader();
#endif
        __syncthreads();
#if GDN_EXT && GDN_SPEC
        if (t == 0) write_acc_qk();
#endif
        // a pairwise tree over the head's warps (and then over the cluster's blocks): for a head dim whose warps
        // are a power of two it is the same tree whatever the cluster size, so the plan changes no bits
        float tot = Tree<NW>::sum(part_o[t & 1]);
#if GDN_NCB > 1
        if (tid == 0) blk_o[t & 1] = tot;
        cluster_sync_all();
        float rem[NCB];
#pragma unroll
        for (int c = 0; c < NCB; ++c) rem[c] = c == rank ? blk_o[t & 1] : ld_cluster(&blk_o[t & 1], (unsigned)c);
        tot = Tree<NCB>::sum(rem);
#endif

        // 5. gated RMS norm, y, planes (each computed in f32, rounded once to the output type)
        const float rs = rsqrtf(tot / (float)D + eps);
#if GDN_SILU
        const float act = zt * sigmoid_f(zt);
#else
        const float act = sigmoid_f(zt);
#endif
        const float yv = ((rs * o) * gam) * act;
        const size_t yi = row * O_RS + h * D + j;
        if (rg == 0) {
            store_y<EO, GDN_PLANES != 0>(out, plane, yi, j, yv);
#if GDN_PLANES
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
            out[4 * plane + row * (N_OUT / 16) + (h * D + rank * COLS) / 16 + tid] = EO::st(s_even + s_odd);
        }
#endif
#if GDN_COMMIT
        // the history after this token, once every block of the cluster has read its own (before the loop)
        if (t + 1 == commit_at) {
#if GDN_RCL > 1
            cluster_wait_acquire();  // every reader of the q / k history has arrived (token 0)
#endif
#pragma unroll
            for (int m = 0; m < NCH; ++m) write_history(m, hst[m][0], hst[m][1], hst[m][2]);
        }
#endif
    }
#endif  // PHASED
#if GDN_SPEC
    if (T == 0) {
        asm volatile("cp.async.wait_all;" ::: "memory");
        __syncthreads();  // uniform: T is the sequence's
        apply_accepted();
#if GDN_EXT
        // the counts token 0 would make, then the accepted q / k history by its last reader
        if (tid == 0) {
            count_block();
            verdict();
        }
        __syncthreads();
        write_acc_qk();
#endif
    }
#endif
#if GDN_NCB > 1
    // no block leaves while another may still read its shared memory
    cluster_sync_all();
#endif
}
