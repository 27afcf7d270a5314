//! The step on device memory the caller owns: an engine's state pool, its conv state, its packed inputs and its
//! output, on its own stream.
//!
//! [`CudaLayer`] holds only one layer's weights and a small scratch (a fault word and the q/k history counters
//! below) on the device; [`CudaLayer::step_raw`] launches the same kernel as [`crate::CudaPool`] (specialised
//! with `GDN_EXT`) on raw device addresses and strides. It allocates nothing and does not wait for the device
//! (after the first call of a specialisation, which compiles it: [`CudaLayer::prepare`]), reads the slot
//! indices, the sequences' rows and commit points on the device, and can be captured into a CUDA graph.
//!
//! - State pool: f32 or bf16, key-major `[slot][d][h_v][d]` or value-major `[slot][h_v][d][d]` (vLLM,
//!   FlashInfer), slots `slot_stride` elements apart, one slot's `d * h_v * d` elements contiguous.
//! - Conv state: the engine's `[slot][C][w]` (w >= 3) with free strides, f32, bf16 or f16: HF's `[slot][C][K]`
//!   and vLLM's transposed `[slot][K-1][C]` view alike. The q/k/v history is its last three columns, oldest
//!   first, stored rounded to its dtype (nearest even); columns before `w - 3` are neither read nor written.
//! - Inputs and y: rows `row_stride` elements apart (the row's own elements contiguous); with planes, y must
//!   be packed (`row_stride` n) and the planes sit at `plane_stride` as in [`gdn::OutputLayout`].
//! - Sequences: `cu_seqlens` (`i32 [n + 1]`), start and length arrays (`i32 [n]` each) or lengths alone (rows
//!   packed in sequence order from row 0; each block sums the lengths before it), a slot each (`i32`,
//!   negative skips), and optionally a commit point each (`i32`: 0 verify, k commit after k tokens; `None`:
//!   every sequence commits its whole window). Bits are those of [`crate::CudaPool`] on the same values (with its
//!   window kernel off: the step on engine memory runs every window token after token).
//!
//! **The shared q/k history.** The pool keeps a private copy of the q/k history for every value head, so a
//! block can commit it in place. An engine's conv state has one copy, read by all `h_v / h_k` value heads of a
//! key head (and by all blocks of a head's cluster), so a block must not overwrite it before every other
//! reader of that sequence has read it. Per (sequence of the call, key head) the layer's scratch holds a u32
//! counter, zero between calls. Each committing block reads its history, meets a block barrier, and its thread
//! 0 issues a fence and an atomic increment: the one block that sees `readers - 1` before it is the last
//! reader; it resets the counter to 0 (so graph replays and the next call need no reset) and alone writes the
//! new q/k history at its commit token. Value channels belong to one block, which writes them. Verify
//! sequences neither count nor write. So the steps of one `CudaLayer` must be ordered (one stream, or streams
//! ordered by events): two steps of the same layer running at once would share counters.
//!
//! **Speculative steps.** [`CudaLayer::step_spec_raw`] runs the pool's one-pass speculative kernel on the same
//! memory plus the engine's pending region ([`pending_bytes`], zeros: nothing held), its held words (`i32` per
//! slot) and each sequence's accepted count (`i32` on the device); [`CudaLayer::commit_held_raw`] commits what
//! slots hold. The kernel rewrites the held words itself (the last block of each sequence to read one), so
//! nothing is read on the host; resets and forks are the engine's (see `step_spec_raw`).
//!
//! A decode step of 2 sequences at the seed shape on an engine's bf16 buffers (allocated here with cudarc; an
//! engine passes its own addresses, torch's `data_ptr()` for instance) and on its stream:
//!
//! ```no_run
//! use gdn::{Config, DType, Shape, StateLayout};
//! use gdn_cuda::cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
//! use std::sync::Arc;
//! use gdn_cuda::{Cuda, CudaLayer, RawConv, RawState, RawStep, RawTensor, SeqRows};
//!
//! # fn main() -> gdn::Result<()> {
//! let cuda = Cuda::new()?;
//! let layer = gdn::synth::Synth::new(1).layer(Config::new(Shape::SEED))?;
//! let ext = CudaLayer::new(&cuda, &layer, 256)?;
//! let sh = Shape::SEED;
//! let (rows, slots, c) = (2, 8, sh.channels());
//! let stream = cuda.context().new_stream().map_err(|e| gdn::Error::Backend(format!("{e:?}")))?;
//! let drv = |e| gdn::Error::Backend(format!("{e:?}"));
//! let bf = |n: usize| stream.alloc_zeros::<gdn::bf16>(n).map_err(drv);
//! let (qkv, ab, z, out) = (bf(rows * c)?, bf(2 * rows * sh.h_v)?, bf(rows * sh.n())?, bf(rows * sh.n())?);
//! let state = bf(slots * sh.state_len())?; // [slot][h_v][d][d], value-major
//! let conv = bf(slots * 3 * c)?; // vLLM's [slot][3][C], seen as [slot][C][3] through its strides
//! let slot = stream.clone_htod(&[5i32, 2]).map_err(drv)?;
//! let cu = stream.clone_htod(&[0i32, 1, 2]).map_err(drv)?;
//! fn addr<T>(b: &CudaSlice<T>, s: &Arc<CudaStream>) -> u64 {
//!     b.device_ptr(s).0
//! }
//! let p = |b: &CudaSlice<gdn::bf16>| addr(b, &stream);
//! let t = |ptr: u64, row_stride: usize| RawTensor { ptr, dtype: DType::Bf16, row_stride };
//! let step = RawStep {
//!     rows,
//!     qkv: t(p(&qkv), c),
//!     alpha: t(p(&ab), sh.h_v),
//!     beta: t(p(&ab) + 2 * (rows * sh.h_v) as u64, sh.h_v),
//!     z: t(p(&z), sh.n()),
//!     out: t(p(&out), sh.n()),
//!     plane_stride: None,
//!     state: RawState { ptr: p(&state), dtype: DType::Bf16, layout: StateLayout::ValueMajor, slots,
//!                       slot_stride: sh.state_len() },
//!     conv: RawConv { ptr: p(&conv), dtype: DType::Bf16, width: 3, slot_stride: 3 * c, chan_stride: 1,
//!                     col_stride: c },
//!     seqs: 2,
//!     slot: addr(&slot, &stream),
//!     seq_rows: SeqRows::CuSeqlens(addr(&cu, &stream)),
//!     commit_at: None, // both commit their whole window
//!     uniform_len: Some(1),
//!     commits: true,
//!     max_len: None,
//! };
//! ext.prepare(&step.kind())?; // compile before a graph capture
//! // SAFETY: the buffers above are of this context and of the extents the step names; `stream` is live.
//! unsafe { ext.step_raw(&step, stream.cu_stream())? };
//! ext.take_fault()?; // waits for the context; reports device-side skips
//! # Ok(())
//! # }
//! ```

use std::ffi::c_void;
use std::sync::Mutex;

use cudarc::driver::{sys, CudaSlice, DevicePtr};
use gdn::{DType, Error, Layer, OutputLayout, PoolOptions, Result, StateLayout};

use crate::chunk::{ChunkCall, ChunkScratch, ChunkSpec};
use crate::pool::{fault_error, launch_kernel, STAGE_MIN_BLOCKS};
use crate::spec::{Io, Spec};
use crate::{drv, Cuda};

/// A device tensor of rows the caller owns: row r at `ptr + r * row_stride` elements, its elements contiguous.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawTensor {
    /// Device address (in this layer's context).
    pub ptr: u64,
    pub dtype: DType,
    /// Elements between rows (at least the row's width).
    pub row_stride: usize,
}

/// An engine's state pool: slot s at `ptr + s * slot_stride` elements, holding `d * h_v * d` elements
/// contiguous in `layout`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawState {
    pub ptr: u64,
    /// F32 or Bf16.
    pub dtype: DType,
    pub layout: StateLayout,
    /// Slots in the pool (also the conv state's); a slot index at or past this is skipped and reported.
    pub slots: usize,
    /// Elements between slots (at least `d * h_v * d`; `ptr` and `slot_stride` bytes multiples of 16).
    pub slot_stride: usize,
}

/// An engine's conv state: element (slot, c, col) at `ptr + slot * slot_stride + c * chan_stride + col *
/// col_stride` elements; the history is columns `width - 3 .. width` (oldest first). HF's `[slot][C][K]`:
/// (K C, K, 1); vLLM's transposed view of `[slot][K-1][C]`: ((K-1) C, 1, C).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawConv {
    pub ptr: u64,
    /// F32, Bf16 or F16.
    pub dtype: DType,
    /// Columns, at least 3.
    pub width: usize,
    pub slot_stride: usize,
    pub chan_stride: usize,
    pub col_stride: usize,
}

/// Where each sequence's rows are (device `i32` arrays).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SeqRows {
    /// `[seqs + 1]` offsets: sequence s has rows `cu[s] .. cu[s + 1]`.
    CuSeqlens(u64),
    /// `[seqs]` first rows and `[seqs]` lengths.
    StartLen { start: u64, len: u64 },
    /// `[seqs]` lengths, the rows packed in sequence order: sequence s starts after the lengths before it
    /// (each block sums them on the device, so the caller needs no offsets).
    Lengths(u64),
}

/// One varlen step on memory the caller owns. `rows` rows of `qkv` `[R][C]`, `alpha` and `beta` `[R][h_v]`, `z`
/// `[R][n]`, y in `out` `[R][n]` (rows of skipped sequences and rows no sequence covers are not written; with
/// `plane_stride` the planes and group sums follow as in [`gdn::OutputLayout`], y packed). Per sequence s < `seqs`
/// (device `i32` arrays): `slot[s]` (negative: skipped), its rows (`seq_rows`), and `commit_at[s]` (0: verify, k:
/// commit the state and history after its first k tokens; `None`: every sequence commits its whole window). The
/// slots of one call must be distinct. Two hints pick the kernel and do not change bits: `uniform_len` (every
/// live sequence has this length; a sequence of another length is skipped and reported where a kernel is
/// specialised on the length: up to 8 tokens, and from the chunked path's threshold on; between them the
/// run-time-length kernel runs it) and `commits` (false:
/// the verify-only kernel, nothing is written back and `commit_at` is not read; it must be true with `commit_at`
/// `None`). A third, `max_len` (no live window is longer), lets a call whose windows are all shorter than the
/// chunked path's threshold ([`Cuda::chunk_min_len`]) skip the chunked path's four launches: with `max_len`
/// below it every window of the call runs token after token, a longer one too (its bits are then the
/// token-serial kernel's; nothing is skipped). `max_len` 1 is `uniform_len` 1 (the decode kernel; a window of
/// another length is skipped and reported). Without either, a call of at least the threshold's rows launches the
/// chunked path, which finds its long windows on the device (measured on the H200, bf16 value-major state, B 64
/// decode given by cu_seqlens: 81.4 µs with the decode kernel, 93.0 with the run-time-length kernel, 101.4 with
/// the chunked path's launches as well).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawStep {
    pub rows: usize,
    pub qkv: RawTensor,
    pub alpha: RawTensor,
    pub beta: RawTensor,
    pub z: RawTensor,
    pub out: RawTensor,
    pub plane_stride: Option<usize>,
    pub state: RawState,
    pub conv: RawConv,
    pub seqs: usize,
    pub slot: u64,
    pub seq_rows: SeqRows,
    pub commit_at: Option<u64>,
    pub uniform_len: Option<usize>,
    pub commits: bool,
    pub max_len: Option<usize>,
}

/// What picks the kernel of a [`RawStep`] (what [`CudaLayer::prepare`] compiles ahead of a graph capture).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExternalKind {
    pub uniform_len: Option<usize>,
    pub commits: bool,
    pub planes: bool,
    /// Element types of qkv, alpha, beta, z and the output.
    pub io: Io,
    /// The state's element type and layout.
    pub state: PoolOptions,
    /// The conv state's element type.
    pub conv: DType,
    /// Sequences in the call (a bf16 state at T 1 is staged through shared memory from a size on; no bits
    /// change).
    pub seqs: usize,
    /// The speculative kernel ([`CudaLayer::step_spec_raw`]; [`RawStep::spec_kind`]).
    pub speculative: bool,
}

impl RawStep {
    /// The kind of kernel this step runs.
    pub fn kind(&self) -> ExternalKind {
        ExternalKind {
            uniform_len: self.uniform(),
            commits: self.commits,
            planes: self.plane_stride.is_some(),
            io: Io::new(
                [
                    self.qkv.dtype,
                    self.alpha.dtype,
                    self.beta.dtype,
                    self.z.dtype,
                ],
                self.out.dtype,
            ),
            state: PoolOptions {
                state: self.state.dtype,
                layout: self.state.layout,
            },
            conv: self.conv.dtype,
            seqs: self.seqs,
            speculative: false,
        }
    }

    /// `uniform_len`, or 1 where `max_len` is 1 (every live window then has one token).
    pub fn uniform(&self) -> Option<usize> {
        self.uniform_len.or(self.max_len.filter(|&m| m == 1))
    }

    /// The kind of kernel [`CudaLayer::step_spec_raw`] runs for this step.
    pub fn spec_kind(&self) -> ExternalKind {
        ExternalKind {
            speculative: true,
            commits: true,
            // a speculative call may hold sequences of no rows (they only accept): max_len 1 is no length
            uniform_len: self.uniform_len,
            ..self.kind()
        }
    }
}

/// The engine-owned memory of a speculative step ([`CudaLayer::step_spec_raw`]), beside the state pool and conv
/// state of its [`RawStep`]: device addresses in the layer's context. One pending region and one held array per
/// layer, like its state pool: each layer's step rewrites its own held words, so arrays shared by layers would
/// apply one layer's buffers to another.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawSpec {
    /// The pending region: [`pending_bytes`]`(shape, state.slots)` bytes, 16-byte aligned, one row of
    /// [`pending_row_bytes`] per slot (slot s at `s * pending_row_bytes`). Its contents are opaque (what each held
    /// window's tokens would commit); allocated zeroed, it holds nothing.
    pub pending: u64,
    /// `i32 [state.slots]`, the held word of each slot: `len | buffer << 8`, `len` (`word & 0xff`) the length of
    /// the window the slot holds (0: none). Zeros: nothing held. The step rewrites it on the device.
    pub held: u64,
    /// `i32 [seqs]`: per sequence, how many tokens of its slot's held window it accepts (`0 ..= len`).
    pub accept: u64,
}

/// Bytes of one slot's row of a speculative step's pending region (two buffers of [`MAX_HELD`](crate::pool::MAX_HELD) tokens: per token
/// the gates, normalized keys, deltas and raw qkv row, f32): what an engine copies with a slot to fork it.
pub fn pending_row_bytes(shape: &gdn::Shape) -> Result<usize> {
    crate::pool::pending_len(shape)
        .and_then(|pl| pl.checked_mul(2 * 4))
        .ok_or_else(|| overflow("pending"))
}

/// Bytes of the pending region of a pool of `slots` slots ([`RawSpec::pending`]).
pub fn pending_bytes(shape: &gdn::Shape, slots: usize) -> Result<usize> {
    pending_row_bytes(shape)?
        .checked_mul(slots)
        .ok_or_else(|| overflow("pending"))
}

/// The kernel's `GdnExt` argument (gdn_step.cu), field for field; every field 8 bytes, so no padding.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct ExtArgs {
    conv: u64,
    ctr: u64,
    state_ss: u64,
    conv_ss: u64,
    conv_cs: u64,
    conv_ls: u64,
    conv_off: u64,
    qkv_rs: u64,
    a_rs: u64,
    b_rs: u64,
    z_rs: u64,
    o_rs: u64,
}

/// The most sequences one call may have (the launch grid's y limit).
pub const MAX_SEQS: usize = 65535;

/// One layer's weights and a small scratch on a device, for steps on memory the caller owns (see the module
/// documentation).
pub struct CudaLayer {
    cuda: Cuda,
    layer: Layer,
    max_seqs: usize,
    // the weights, kept alive for the raw addresses below
    _weights: [CudaSlice<f32>; 4],
    w_ptr: [u64; 4],
    /// `[0]`: the fault word; `[1..]`: `max_seqs x h_k` last-reader counters, then `max_seqs` per-sequence
    /// counters of the speculative step (all zero between calls), then `max_seqs + 1` zeros (the row offsets of
    /// [`CudaLayer::commit_held_raw`]'s sequences, which have no rows).
    scratch: Mutex<CudaSlice<u32>>,
    scratch_ptr: u64,
}

fn param(name: &'static str, why: impl Into<String>) -> Error {
    Error::Param {
        name,
        why: why.into(),
    }
}

fn overflow(name: &'static str) -> Error {
    param(name, "its extent overflows the address space")
}

/// Checks a device address: nonzero and aligned to `align` bytes; with the byte extent `bytes`, that the end
/// fits the address space.
fn check_ptr(name: &'static str, ptr: u64, align: u64, bytes: usize) -> Result<()> {
    if ptr == 0 {
        return Err(param(name, "null device pointer"));
    }
    if !ptr.is_multiple_of(align) {
        return Err(param(
            name,
            format!("address {ptr:#x} is not aligned to {align} bytes"),
        ));
    }
    u64::try_from(bytes)
        .ok()
        .and_then(|b| ptr.checked_add(b))
        .filter(|&end| end <= i64::MAX as u64)
        .map(|_| ())
        .ok_or_else(|| overflow(name))
}

/// Checks rows `0..rows` of `width` elements `t.row_stride` apart (no-op for no rows).
fn check_rows(name: &'static str, t: &RawTensor, rows: usize, width: usize) -> Result<()> {
    if rows == 0 {
        return Ok(());
    }
    if t.row_stride < width {
        return Err(param(
            name,
            format!(
                "row stride {} is below the row's {width} elements",
                t.row_stride
            ),
        ));
    }
    let bytes = (rows - 1)
        .checked_mul(t.row_stride)
        .and_then(|x| x.checked_add(width))
        .and_then(|x| x.checked_mul(t.dtype.size()))
        .ok_or_else(|| overflow(name))?;
    check_ptr(name, t.ptr, t.dtype.size() as u64, bytes)
}

/// `n` device i32 values at `ptr`.
fn check_ints(name: &'static str, ptr: u64, n: usize) -> Result<()> {
    let bytes = n.checked_mul(4).ok_or_else(|| overflow(name))?;
    check_ptr(name, ptr, 4, bytes)
}

/// Everything the launch needs once a step has passed the checks.
struct Checked {
    spec: Spec,
    ext: ExtArgs,
    n_rows: i32,
    n_slots: i32,
    plane: i64,
}

impl CudaLayer {
    /// The layer's weights on `cuda`'s device, for calls of at most `max_seqs` sequences (1..=65535; the
    /// scratch is `4 * (2 + max_seqs * (h_k + 2))` bytes). Waits for the copies.
    pub fn new(cuda: &Cuda, layer: &Layer, max_seqs: usize) -> Result<CudaLayer> {
        layer.validate()?;
        let sh = *layer.shape();
        cuda.plan_for(sh.d, sh.h_v)?;
        if !(1..=MAX_SEQS).contains(&max_seqs) {
            return Err(param(
                "max_seqs",
                format!("{max_seqs} is outside 1..={MAX_SEQS}"),
            ));
        }
        let scratch_len = sh
            .h_k
            .checked_add(2)
            .and_then(|x| x.checked_mul(max_seqs))
            .and_then(|x| x.checked_add(2))
            .ok_or_else(|| overflow("max_seqs"))?;
        let s = &cuda.stream;
        let p = &layer.params;
        let up = |x: &[f32]| s.clone_htod(x).map_err(drv);
        let weights = [up(&p.conv_w)?, up(&p.dt)?, up(&p.a)?, up(&p.gamma)?];
        let scratch = s.alloc_zeros::<u32>(scratch_len).map_err(drv)?;
        // the allocations live as long as the layer, so their addresses do too (event tracking is off for
        // this backend's context: the guards record nothing)
        let w_ptr = [0, 1, 2, 3].map(|i| weights[i].device_ptr(s).0);
        let scratch_ptr = scratch.device_ptr(s).0;
        s.synchronize().map_err(drv)?;
        Ok(CudaLayer {
            cuda: cuda.clone(),
            layer: layer.clone(),
            max_seqs,
            _weights: weights,
            w_ptr,
            scratch: Mutex::new(scratch),
            scratch_ptr,
        })
    }

    pub fn layer(&self) -> &Layer {
        &self.layer
    }

    /// The most sequences a call may have.
    pub fn max_seqs(&self) -> usize {
        self.max_seqs
    }

    /// The backend (context, device) this layer lives on.
    pub fn cuda(&self) -> &Cuda {
        &self.cuda
    }

    /// The kernel specialisation a step of this kind runs.
    pub fn spec(&self, kind: &ExternalKind) -> Result<Spec> {
        kind.state.validate()?;
        let sh = self.layer.shape();
        let heads = kind.seqs.saturating_mul(sh.h_v);
        let plan = self.cuda.plan_for(sh.d, sh.h_v)?;
        let spec = Spec::new(
            self.cuda.arch,
            &self.layer.config,
            kind.uniform_len,
            kind.commits,
            kind.planes,
            plan,
        )
        .with_io(kind.io)
        .with_pool(kind.state)
        .with_stage(heads >= STAGE_MIN_BLOCKS * self.cuda.sms)
        .with_ext(kind.conv)
        .with_tune(
            self.cuda.tune(),
            heads.saturating_mul(plan.ncb),
            self.cuda.sms,
        );
        // the pool's speculative kernel is specialised the same way (hints first, then speculative)
        Ok(if kind.speculative {
            spec.with_speculative()
        } else {
            spec
        })
    }

    /// Compiles and loads the kernel a step of this kind needs, so that a later step (one being captured into
    /// a graph, say) does no compilation.
    pub fn prepare(&self, kind: &ExternalKind) -> Result<()> {
        self.cuda.function(&self.spec(kind)?).map(|_| ())
    }

    /// Checks every host-visible argument of `step` (shapes, strides within extents in checked arithmetic,
    /// dtypes, the sequence count, alignment) without touching the device. [`CudaLayer::step_raw`] runs it
    /// first.
    pub fn check(&self, step: &RawStep) -> Result<()> {
        self.checked(step, false).map(|_| ())
    }

    /// [`CudaLayer::check`] for a speculative step: also the pending region, the held words and the accepted
    /// counts (extents, alignment), and `step.commits` (the speculative kernel reads every commit point).
    /// [`CudaLayer::step_spec_raw`] runs it first.
    pub fn check_spec(&self, step: &RawStep, spec: &RawSpec) -> Result<()> {
        self.checked_spec(step, spec).map(|_| ())
    }

    fn checked_spec(&self, step: &RawStep, spec: &RawSpec) -> Result<Checked> {
        if !step.commits {
            return Err(param(
                "commits",
                "false: a speculative step reads every commit point (commit_at 0 holds a window, None commits all)",
            ));
        }
        let ck = self.checked(step, true)?;
        let sh = self.layer.shape();
        check_ptr(
            "pending",
            spec.pending,
            16,
            pending_bytes(sh, step.state.slots)?,
        )?;
        check_ints("held", spec.held, step.state.slots)?;
        if step.seqs > 0 {
            check_ints("accept", spec.accept, step.seqs)?;
        }
        Ok(ck)
    }

    fn checked(&self, step: &RawStep, speculative: bool) -> Result<Checked> {
        let sh = *self.layer.shape();
        let (c, hv, n) = (sh.channels(), sh.h_v, sh.n());
        let rows = step.rows;
        let n_rows = i32::try_from(rows)
            .map_err(|_| param("rows", format!("{rows} does not fit the kernel's i32")))?;
        if step.seqs > self.max_seqs {
            return Err(param(
                "seqs",
                format!(
                    "{} sequences, this layer was made for at most {}",
                    step.seqs, self.max_seqs
                ),
            ));
        }
        // max_len 0 is a true bound only where no sequence has rows (an accept-only speculative call)
        if step.uniform_len == Some(0) || (step.max_len == Some(0) && step.seqs > 0 && !speculative)
        {
            return Err(Error::EmptyWindow);
        }
        if step.commit_at.is_none() && !step.commits {
            return Err(param(
                "commits",
                "false (verify only) with commit_at None (every sequence commits its whole window)",
            ));
        }
        check_rows("qkv", &step.qkv, rows, c)?;
        check_rows("alpha", &step.alpha, rows, hv)?;
        check_rows("beta", &step.beta, rows, hv)?;
        check_rows("z", &step.z, rows, n)?;
        let layout = OutputLayout::for_rows(&sh, rows, step.plane_stride)?;
        if rows > 0 {
            if step.plane_stride.is_some() && step.out.row_stride != n {
                return Err(param(
                    "out",
                    format!(
                        "row stride {}: with planes y is packed ({n} elements a row)",
                        step.out.row_stride
                    ),
                ));
            }
            check_rows("out", &step.out, rows, n)?;
            let bytes = layout
                .len()
                .checked_mul(step.out.dtype.size())
                .ok_or_else(|| overflow("out"))?;
            check_ptr("out", step.out.ptr, step.out.dtype.size() as u64, bytes)?;
        }
        let plane = i64::try_from(step.plane_stride.unwrap_or(0))
            .map_err(|_| param("plane_stride", "too large"))?;

        // the state pool
        let st = &step.state;
        PoolOptions {
            state: st.dtype,
            layout: st.layout,
        }
        .validate()?;
        if st.slots == 0 {
            return Err(param("state.slots", "a pool needs at least one slot"));
        }
        let n_slots = i32::try_from(st.slots).map_err(|_| {
            param(
                "state.slots",
                format!("{} does not fit the kernel's i32", st.slots),
            )
        })?;
        let sl = sh.state_len();
        if st.slot_stride < sl {
            return Err(param(
                "state.slot_stride",
                format!(
                    "{} is below a slot's {sl} elements (d x h_v x d)",
                    st.slot_stride
                ),
            ));
        }
        let es = st.dtype.size();
        if !(st.slot_stride * es).is_multiple_of(16) {
            return Err(param(
                "state.slot_stride",
                format!(
                    "{} elements is not a multiple of 16 bytes (the kernel's vector loads)",
                    st.slot_stride
                ),
            ));
        }
        let bytes = (st.slots - 1)
            .checked_mul(st.slot_stride)
            .and_then(|x| x.checked_add(sl))
            .and_then(|x| x.checked_mul(es))
            .ok_or_else(|| overflow("state"))?;
        check_ptr("state", st.ptr, 16, bytes)?;

        // the conv state: (c, col) must name distinct elements of a slot, the slots must not overlap
        let cv = &step.conv;
        if cv.width < 3 {
            return Err(param(
                "conv.width",
                format!("{} columns: the history needs 3", cv.width),
            ));
        }
        let mut dims = [(cv.chan_stride, c), (cv.col_stride, cv.width)];
        dims.sort();
        let disjoint = dims[0].0 >= 1
            && dims[0]
                .0
                .checked_mul(dims[0].1)
                .is_some_and(|inner| inner <= dims[1].0);
        if !disjoint {
            return Err(param(
                "conv",
                format!(
                    "channel stride {} and column stride {} make channels or columns overlap",
                    cv.chan_stride, cv.col_stride
                ),
            ));
        }
        let span = (c - 1)
            .checked_mul(cv.chan_stride)
            .and_then(|x| x.checked_add((cv.width - 1).checked_mul(cv.col_stride)?))
            .and_then(|x| x.checked_add(1))
            .ok_or_else(|| overflow("conv"))?;
        if st.slots > 1 && cv.slot_stride < span {
            return Err(param(
                "conv.slot_stride",
                format!(
                    "{} is below one slot's span of {span} elements",
                    cv.slot_stride
                ),
            ));
        }
        let bytes = (st.slots - 1)
            .checked_mul(cv.slot_stride)
            .and_then(|x| x.checked_add(span))
            .and_then(|x| x.checked_mul(cv.dtype.size()))
            .ok_or_else(|| overflow("conv"))?;
        check_ptr("conv", cv.ptr, cv.dtype.size() as u64, bytes)?;

        // the per-sequence arrays
        if step.seqs > 0 {
            check_ints("slot", step.slot, step.seqs)?;
            match step.seq_rows {
                SeqRows::CuSeqlens(p) => check_ints("cu_seqlens", p, step.seqs + 1)?,
                SeqRows::StartLen { start, len } => {
                    check_ints("start", start, step.seqs)?;
                    check_ints("len", len, step.seqs)?;
                }
                SeqRows::Lengths(p) => check_ints("len", p, step.seqs)?,
            }
            if let Some(p) = step.commit_at {
                check_ints("commit_at", p, step.seqs)?;
            }
        }
        let u = |x: usize| x as u64;
        Ok(Checked {
            spec: self.spec(&if speculative {
                step.spec_kind()
            } else {
                step.kind()
            })?,
            ext: ExtArgs {
                conv: cv.ptr,
                ctr: self.scratch_ptr + 4,
                state_ss: u(st.slot_stride),
                conv_ss: u(cv.slot_stride),
                conv_cs: u(cv.chan_stride),
                conv_ls: u(cv.col_stride),
                conv_off: u((cv.width - 3) * cv.col_stride),
                qkv_rs: u(step.qkv.row_stride),
                a_rs: u(step.alpha.row_stride),
                b_rs: u(step.beta.row_stride),
                z_rs: u(step.z.row_stride),
                o_rs: u(step.out.row_stride),
            },
            n_rows,
            n_slots,
            plane,
        })
    }

    /// The step on memory the caller owns, launched on `stream`: no allocation, no host synchronisation
    /// (compile first with [`CudaLayer::prepare`] before a graph capture), except where the call may hold a
    /// window of [`Cuda::chunk_min_len`] tokens or more (no `max_len` / `uniform_len` below it) and the backend's
    /// chunked scratch does not hold it yet: then the first such call compiles the chunked kernels, and it and any
    /// larger one wait for the whole context and allocate ([`CudaLayer::reserve_chunk`] does it ahead; not while
    /// another stream of this thread is being captured). Every host-visible argument is checked first
    /// ([`CudaLayer::check`]) and `stream` must belong to this layer's context; an error found there leaves
    /// everything untouched (a driver error at a later launch may leave the long windows, launched first,
    /// committed). Sequences the device finds out of range (a slot at or past `state.slots`, a length not
    /// positive or not `uniform_len`, rows outside `rows`, a commit point outside 0..=length) are skipped (a bad
    /// commit point commits nothing) and reported by [`CudaLayer::take_fault`].
    ///
    /// # Safety
    /// Every address in `step` is device memory of this layer's context (or reachable from it), valid for
    /// the extents that the shapes, strides and counts in `step` give, with the dtypes `step` names; the
    /// per-sequence arrays hold `seqs` entries (`seqs + 1` for `cu_seqlens`) and name distinct slots; nothing
    /// written by the step (the output, the state pool, the conv state) overlaps anything else the step reads
    /// or writes, and nothing else writes any of it while `stream` runs the step. `stream` is a live stream
    /// (or null, the legacy default stream of this context). Steps of one `CudaLayer` run one at a time (one
    /// stream, or ordered by events): they share the q/k history counters; and steps of all the `CudaLayer`s of
    /// one [`Cuda`] (and its clones) that may chunk are ordered the same way: they share the chunked scratch. A
    /// graph that captured a chunked step is not replayed after [`CudaLayer::release_chunk`] or once every clone
    /// of that `Cuda` is dropped.
    pub unsafe fn step_raw(&self, step: &RawStep, stream: sys::CUstream) -> Result<()> {
        let ck = self.checked(step, false)?;
        // SAFETY: the caller's contract for `step_raw` is `launch`'s.
        unsafe { self.launch(step, &ck, None, stream) }
    }

    /// The speculative step (SPEC "Speculative steps") on memory the caller owns, launched on `stream`: the
    /// pool's one-pass kernel (`GDN_SPEC`, the same code as [`crate::CudaPool`]'s `step_spec`) on the engine's
    /// state pool and conv state (`step`, as for [`CudaLayer::step_raw`]) and its pending region and held words
    /// (`spec`). Per sequence s, first the first `accept[s]` tokens of its slot's held window are kept (exactly
    /// their commit: state and conv history) and the rest dropped, then its window runs: with commit point 0 it
    /// is held (its outputs are a verify's; the slot's held word becomes its length), with k > 0 it commits
    /// after k tokens as `step_raw` does (nothing held after). A sequence of length 0 (no rows) only accepts:
    /// [`CudaLayer::commit_held_raw`]. Outputs, committed states and histories are bitwise those of the seed's
    /// flow on `step_raw` (verify, commit the first k, then the next window) and of `CudaPool::step_spec`.
    ///
    /// `step.commits` must be true; held windows are at most [`MAX_HELD`](crate::pool::MAX_HELD) tokens. No allocation, no host
    /// synchronisation: the held words live on the device and the kernel rewrites them (each sequence's last
    /// block, once every block has read it), so a step can be captured into a CUDA graph
    /// ([`CudaLayer::prepare`] with [`RawStep::spec_kind`] first). Host-visible arguments are checked first
    /// ([`CudaLayer::check_spec`]); an error leaves everything untouched. On the device, a sequence whose slot,
    /// rows or length are out of range (as `step_raw`), whose commit point is outside 0..=length, whose accepted
    /// count is outside 0..=its slot's held length, or whose window would be held and is longer than
    /// [`MAX_HELD`](crate::pool::MAX_HELD) is skipped whole (nothing of it written, its held word kept) and reported by
    /// [`CudaLayer::take_fault`].
    ///
    /// The engine's part: the pending region and the held words start zeroed (nothing held). Resetting a slot
    /// drops its held window: zero its held word. Forking slot a into b (with a held window): copy a's state,
    /// conv rows, held word and pending row ([`pending_row_bytes`], at `a * pending_row_bytes`) to b's. A plain
    /// `step_raw` neither reads nor clears held words: on a slot that holds a window, accept or drop it first
    /// (a later speculative step would apply the old window to the new state).
    ///
    /// # Safety
    /// [`CudaLayer::step_raw`]'s contract, and: `spec.pending` is [`pending_bytes`] bytes and `spec.held`
    /// `state.slots` i32 of device memory of this context, `spec.accept` `seqs` i32, none of them overlapping
    /// anything else the step reads or writes; the pending region and held words are only ever written by these
    /// steps, [`CudaLayer::commit_held_raw`] and the resets and forks above (a held word not made by them is
    /// skipped only where it fails the checks above; another pending row than the one that held the window
    /// gives unspecified values, no memory outside the region is touched).
    pub unsafe fn step_spec_raw(
        &self,
        step: &RawStep,
        spec: &RawSpec,
        stream: sys::CUstream,
    ) -> Result<()> {
        let ck = self.checked_spec(step, spec)?;
        // SAFETY: the caller's contract covers `launch`'s and the speculative buffers (checked above).
        unsafe { self.launch(step, &ck, Some(spec), stream) }
    }

    /// "Commit what is pending" on memory the caller owns: for each of `seqs` sequences (`slot`: device `i32
    /// [seqs]`, negative skips), the first `spec.accept[s]` tokens of its slot's held window are committed
    /// (state and conv history), the rest dropped, and the slot holds nothing after (a request's end, or before
    /// the engine reads or forks a slot). One launch of [`CudaLayer::step_spec_raw`] with sequences of no rows;
    /// same checks and faults. An accepted count of 0 only drops the window.
    ///
    /// # Safety
    /// As [`CudaLayer::step_spec_raw`] for these buffers.
    pub unsafe fn commit_held_raw(
        &self,
        state: &RawState,
        conv: &RawConv,
        spec: &RawSpec,
        seqs: usize,
        slot: u64,
        stream: sys::CUstream,
    ) -> Result<()> {
        if seqs > self.max_seqs {
            return Err(param(
                "seqs",
                format!(
                    "{seqs} sequences, this layer was made for at most {}",
                    self.max_seqs
                ),
            ));
        }
        let sh = self.layer.shape();
        // every sequence has rows 0..0: the layer's zeros as cu_seqlens
        let zeros = self.scratch_ptr + 4 * (1 + self.max_seqs * (sh.h_k + 1)) as u64;
        let none = |width: usize| RawTensor {
            ptr: 0,
            dtype: DType::F32,
            row_stride: width,
        };
        let step = RawStep {
            rows: 0,
            qkv: none(sh.channels()),
            alpha: none(sh.h_v),
            beta: none(sh.h_v),
            z: none(sh.n()),
            out: none(sh.n()),
            plane_stride: None,
            state: *state,
            conv: *conv,
            seqs,
            slot,
            seq_rows: SeqRows::CuSeqlens(zeros),
            commit_at: None,
            uniform_len: None,
            commits: true,
            max_len: None,
        };
        // SAFETY: the caller's contract; the rows are empty (nothing read there, no output written).
        unsafe { self.step_spec_raw(&step, spec, stream) }
    }

    /// The launch of a checked step (plain, or with `spec` the speculative kernel).
    ///
    /// # Safety
    /// `step_raw`'s contract (and `step_spec_raw`'s with `spec`).
    unsafe fn launch(
        &self,
        step: &RawStep,
        ck: &Checked,
        spec: Option<&RawSpec>,
        stream: sys::CUstream,
    ) -> Result<()> {
        self.cuda.ctx.bind_to_thread().map_err(drv)?;
        let mut owner: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: `stream` is live by the caller's contract; the out-pointer is a live local. With this
        // context bound, the null stream resolves to it.
        unsafe { sys::cuStreamGetCtx(stream, &mut owner) }
            .result()
            .map_err(|e| param("stream", format!("not a usable stream: {e:?}")))?;
        if owner != self.cuda.ctx.cu_ctx() {
            return Err(param(
                "stream",
                "belongs to another CUDA context than this layer's (another device?)",
            ));
        }
        if step.seqs == 0 {
            return Ok(());
        }
        let f = self.cuda.function(&ck.spec)?;
        let sh = *self.layer.shape();
        let (p_start, p_len) = match step.seq_rows {
            SeqRows::CuSeqlens(p) => (p, 0u64),
            SeqRows::StartLen { start, len } => (start, len),
            SeqRows::Lengths(len) => (0u64, len),
        };
        // long windows take the chunked path first; the token-serial kernel runs the rest (or nothing), with the
        // scratch's lock held until it is enqueued (its slot array lives in the scratch's plan)
        let mut held = None;
        let slot = match spec {
            Some(_) => step.slot,
            // SAFETY: the caller's contract covers the chunked kernels' reads and writes (the same memory).
            None => {
                match unsafe { self.chunk_first(step, ck, (p_start, p_len), stream, &mut held)? } {
                    Some(slot) => slot,
                    None => return Ok(()),
                }
            }
        };
        let mut p_state = step.state.ptr;
        let mut p_hist = 0u64;
        let mut p_qkv = step.qkv.ptr;
        let mut p_alpha = step.alpha.ptr;
        let mut p_beta = step.beta.ptr;
        let mut p_z = step.z.ptr;
        let [mut p_conv_w, mut p_dt, mut p_a, mut p_gamma] = self.w_ptr;
        let mut p_out = step.out.ptr;
        let mut p_slot = slot;
        let mut p_start = p_start;
        let mut p_len = p_len;
        let mut p_commit = step.commit_at.unwrap_or(0);
        let mut n_slots = ck.n_slots;
        let mut n_rows = ck.n_rows;
        let mut plane = ck.plane;
        let mut eps = self.layer.config.eps;
        let mut p_fault = self.scratch_ptr;
        let mut ext = ck.ext;
        let mut p_pend = spec.map_or(0, |x| x.pending);
        let mut p_acc = spec.map_or(0, |x| x.accept);
        let mut p_held = spec.map_or(0, |x| x.held);
        let mut p_sctr = self.scratch_ptr + 4 * (1 + self.max_seqs * sh.h_k) as u64;
        let mut params: Vec<*mut c_void> = vec![
            &mut p_state as *mut _ as *mut c_void,
            &mut p_hist as *mut _ as *mut c_void,
            &mut p_qkv as *mut _ as *mut c_void,
            &mut p_alpha as *mut _ as *mut c_void,
            &mut p_beta as *mut _ as *mut c_void,
            &mut p_z as *mut _ as *mut c_void,
            &mut p_conv_w as *mut _ as *mut c_void,
            &mut p_dt as *mut _ as *mut c_void,
            &mut p_a as *mut _ as *mut c_void,
            &mut p_gamma as *mut _ as *mut c_void,
            &mut p_out as *mut _ as *mut c_void,
            &mut p_slot as *mut _ as *mut c_void,
            &mut p_start as *mut _ as *mut c_void,
            &mut p_len as *mut _ as *mut c_void,
            &mut p_commit as *mut _ as *mut c_void,
            &mut n_slots as *mut _ as *mut c_void,
            &mut n_rows as *mut _ as *mut c_void,
            &mut plane as *mut _ as *mut c_void,
            &mut eps as *mut _ as *mut c_void,
            &mut p_fault as *mut _ as *mut c_void,
            &mut ext as *mut _ as *mut c_void,
        ];
        if spec.is_some() {
            params.extend([
                &mut p_pend as *mut _ as *mut c_void,
                &mut p_acc as *mut _ as *mut c_void,
                &mut p_held as *mut _ as *mut c_void,
                &mut p_sctr as *mut _ as *mut c_void,
            ]);
        }
        let grid = (
            (sh.h_v * ck.spec.plan.ncb) as u32,
            step.seqs as u32, // <= max_seqs <= 65535, checked
            1,
        );
        // SAFETY: the 21 parameters (25 with `spec`) match the GDN_EXT kernel's signature in order and type (the state, a null
        // pool history, the four inputs, the layer's four weights, the output, slot / start-or-cu_seqlens /
        // len-or-null / commit-or-null, int n_slots, int n_rows, long long plane, float eps, the fault word,
        // the GdnExt struct by value; a speculative step, compiled with GDN_SPEC, four more: the pending region,
        // the accepted counts, the held words and the layer's per-sequence counters), each pointing to a local
        // that lives across the call. The kernel was
        // compiled for the dtypes `step` names. The caller guarantees the memory behind the addresses for
        // the extents checked above; the weights and scratch are this layer's; the kernel skips sequences
        // whose slot, rows or length are out of range. The stream belongs to this context (checked).
        unsafe {
            launch_kernel(
                &self.cuda,
                &f,
                grid,
                ck.spec.threads() as u32,
                &mut params,
                stream,
            )
        }
    }

    /// The chunked kernels' specialisation for a step of this kind.
    pub fn chunk_spec(&self, kind: &ExternalKind) -> ChunkSpec {
        ChunkSpec::new(
            self.cuda.arch,
            &self.layer.config,
            kind.planes,
            kind.io,
            kind.state,
            self.cuda.chunk_products,
        )
        .with_ext(kind.conv)
    }

    /// Compiles the chunked kernels of `kind` and grows the chunked path's scratch to hold calls of up to
    /// `rows` rows and `seqs` sequences (`rows x h_v x (5 d + 65)` floats at d 128, 132 KiB a row at the seed's
    /// shape, and a small plan). The scratch is one per backend ([`Cuda`]), shared by all its layers, whose
    /// long-window steps must therefore be ordered (one stream, or events), as one layer's steps must be. A step
    /// captured into a CUDA graph takes the chunked path only if the scratch held its rows and sequences before
    /// the capture (else every window of it runs token after token, whatever its length), and the graph then
    /// holds the scratch's address: a later, larger call allocates a new scratch and keeps the old one for the
    /// graph until [`CudaLayer::release_chunk`]. Waits for the context when it allocates.
    pub fn reserve_chunk(&self, kind: &ExternalKind, rows: usize, seqs: usize) -> Result<()> {
        let spec = self.chunk_spec(kind);
        if !spec.supported() || kind.speculative {
            return Ok(());
        }
        let mut scratch = self.ext_chunk()?;
        self.grow(&mut scratch, &spec, rows, seqs)
    }

    /// Frees the shared chunked-path scratch of this layer's backend, old ones kept for captured graphs too (no
    /// graph that used them may be replayed after this); the next long window allocates it again.
    pub fn release_chunk(&self) -> Result<()> {
        self.cuda.release_chunk_scratch()
    }

    /// Bytes the shared chunked-path scratch holds now.
    pub fn chunk_bytes(&self) -> Result<usize> {
        self.cuda.chunk_scratch_bytes()
    }

    fn ext_chunk(&self) -> Result<std::sync::MutexGuard<'_, ChunkScratch>> {
        self.cuda
            .ext_chunk
            .lock()
            .map_err(|_| Error::Backend("chunk scratch lock poisoned".into()))
    }

    fn grow(
        &self,
        scratch: &mut ChunkScratch,
        spec: &ChunkSpec,
        rows: usize,
        seqs: usize,
    ) -> Result<()> {
        let min_len = self.cuda.chunk_min_len();
        scratch.fns(&self.cuda, spec)?;
        if scratch.holds(spec, rows, seqs, min_len) {
            return Ok(());
        }
        // a step on another stream may still use the old scratch; the new one is ready before any step uses it
        self.cuda.ctx.synchronize().map_err(drv)?;
        scratch.reserve(&self.cuda, spec, rows, seqs, min_len)?;
        self.cuda.stream.synchronize().map_err(drv)
    }

    /// Runs the step's long windows in chunks on `stream` and returns the slot array the token-serial kernel
    /// runs with, or `None` when nothing is left for it; when it used the scratch, its lock goes to `held`.
    ///
    /// # Safety
    /// `step_raw`'s contract; `rows` is the step's (start or cu_seqlens, len) pair of device arrays.
    unsafe fn chunk_first<'a>(
        &'a self,
        step: &RawStep,
        ck: &Checked,
        rows: (u64, u64),
        stream: sys::CUstream,
        held: &mut Option<std::sync::MutexGuard<'a, ChunkScratch>>,
    ) -> Result<Option<u64>> {
        let min_len = self.cuda.chunk_min_len();
        let hi = step.max_len.or(step.uniform()).unwrap_or(step.rows);
        if hi < min_len || step.rows < min_len {
            return Ok(Some(step.slot));
        }
        let spec = self.chunk_spec(&step.kind());
        if !spec.supported() {
            return Ok(Some(step.slot));
        }
        let mut scratch = self.ext_chunk()?;
        // SAFETY: `stream` is live (the caller's contract).
        if unsafe { crate::chunk::capturing(stream) }? {
            // neither compile nor allocate in a capture: only what was reserved chunks
            if !scratch.holds(&spec, step.rows, step.seqs, min_len) {
                return Ok(Some(step.slot));
            }
            scratch.pinned = true;
        } else {
            self.grow(&mut scratch, &spec, step.rows, step.seqs)?;
        }
        let call = ChunkCall {
            n_seqs: step.seqs,
            rows: step.rows,
            n_slots: ck.n_slots,
            commits: step.commits,
            lo: step.uniform().unwrap_or(1),
            uniform: i32::try_from(step.uniform().unwrap_or(0))
                .map_err(|_| param("uniform_len", "does not fit the kernel's i32"))?,
            plane: ck.plane,
            eps: self.layer.config.eps,
            qkv: step.qkv.ptr,
            alpha: step.alpha.ptr,
            beta: step.beta.ptr,
            z: step.z.ptr,
            out: step.out.ptr,
            slot: step.slot,
            start: rows.0,
            len: rows.1,
            commit: step.commit_at.unwrap_or(0),
            state: step.state.ptr,
            hist: 0,
            weights: self.w_ptr,
            fault: self.scratch_ptr,
            ext: Some(ck.ext),
            stream,
        };
        // SAFETY: the caller's contract for the step's memory (checked extents, dtypes and strides in `ck`); the
        // weights and fault word are this layer's; the scratch holds the call (grown or checked above).
        let slot = unsafe { scratch.run(&self.cuda, &spec, min_len, &call) }?;
        *held = Some(scratch);
        Ok(slot)
    }

    /// Waits for the whole context (every stream of it, the caller's too), then reports and clears what the
    /// device found wrong in this layer's steps since the last call (see [`CudaLayer::step_raw`]).
    pub fn take_fault(&self) -> Result<()> {
        self.cuda.ctx.synchronize().map_err(drv)?;
        let mut scratch = self
            .scratch
            .lock()
            .map_err(|_| Error::Backend("scratch lock poisoned".into()))?;
        let s = &self.cuda.stream;
        let mut word = [0u32];
        s.memcpy_dtoh(&scratch.slice(0..1), &mut word)
            .map_err(drv)?;
        s.synchronize().map_err(drv)?;
        if word[0] == 0 {
            return Ok(());
        }
        s.memset_zeros(&mut scratch.slice_mut(0..1)).map_err(drv)?;
        s.synchronize().map_err(drv)?;
        Err(fault_error(word[0]))
    }
}
