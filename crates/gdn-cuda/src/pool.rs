//! The device-resident state pool, the device-native varlen step and the host-slice step on top of it.

use std::ffi::c_void;
use std::time::{Duration, Instant};

use cudarc::driver::{
    sys, CudaFunction, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut,
};
use gdn::backend::{check_slot_io, head_history};
use gdn::{
    bf16, f16, DType, Error, Layer, LayerPool, OutputLayout, PoolOptions, Result, Step, StepTiming,
    Tensor, TensorMut,
};

use crate::spec::{window_range, Io, Plan, Spec, MAX_CONST_T};
use crate::{drv, Cuda};

/// A device tensor of activations in one of the [`DType`]s (flat, row-major).
#[derive(Clone, Copy)]
pub enum DeviceTensor<'a> {
    F32(&'a CudaView<'a, f32>),
    Bf16(&'a CudaView<'a, bf16>),
    F16(&'a CudaView<'a, f16>),
}

impl DeviceTensor<'_> {
    pub fn len(&self) -> usize {
        match self {
            DeviceTensor::F32(x) => x.len(),
            DeviceTensor::Bf16(x) => x.len(),
            DeviceTensor::F16(x) => x.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn dtype(&self) -> DType {
        match self {
            DeviceTensor::F32(_) => DType::F32,
            DeviceTensor::Bf16(_) => DType::Bf16,
            DeviceTensor::F16(_) => DType::F16,
        }
    }
    fn ptr(&self, cuda: &Cuda) -> sys::CUdeviceptr {
        match self {
            DeviceTensor::F32(x) => ptr(*x, cuda),
            DeviceTensor::Bf16(x) => ptr(*x, cuda),
            DeviceTensor::F16(x) => ptr(*x, cuda),
        }
    }
}

/// A device output buffer in one of the [`DType`]s.
pub enum DeviceTensorMut<'a, 'b> {
    F32(&'b mut CudaViewMut<'a, f32>),
    Bf16(&'b mut CudaViewMut<'a, bf16>),
    F16(&'b mut CudaViewMut<'a, f16>),
}

impl DeviceTensorMut<'_, '_> {
    pub fn len(&self) -> usize {
        match self {
            DeviceTensorMut::F32(x) => x.len(),
            DeviceTensorMut::Bf16(x) => x.len(),
            DeviceTensorMut::F16(x) => x.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn dtype(&self) -> DType {
        match self {
            DeviceTensorMut::F32(_) => DType::F32,
            DeviceTensorMut::Bf16(_) => DType::Bf16,
            DeviceTensorMut::F16(_) => DType::F16,
        }
    }
    fn ptr(&mut self, cuda: &Cuda) -> sys::CUdeviceptr {
        match self {
            DeviceTensorMut::F32(x) => ptr_mut(*x, cuda),
            DeviceTensorMut::Bf16(x) => ptr_mut(*x, cuda),
            DeviceTensorMut::F16(x) => ptr_mut(*x, cuda),
        }
    }
}

/// A varlen step with everything already on the device: packed rows (`qkv` [R][C], `alpha` and `beta`
/// [R][h_v], `z` [R][n], each in its own dtype) and, per sequence s, its pool slot `slot[s]` (outside the pool:
/// skipped), its first row `start[s]`, its length `len[s]` (>= 1) and its commit point `commit_at[s]` (0:
/// verify, k: the state after its first k tokens; 1..=len). The slots of one call must be distinct (the
/// device cannot check that). Two hints pick the kernel, as the host knows them: `uniform_len` (every sequence
/// has this length, <= 8: the compile-time-length kernel; the bits are the same either way) and `commits`
/// (false: no sequence commits, the verify-only kernel; `commit_at` is then not read). Blocks start in sequence
/// order: put long windows first, so that they do not trail the call.
pub struct DeviceStep<'a> {
    pub rows: usize,
    pub qkv: DeviceTensor<'a>,
    pub alpha: DeviceTensor<'a>,
    pub beta: DeviceTensor<'a>,
    pub z: DeviceTensor<'a>,
    pub slot: &'a CudaView<'a, i32>,
    pub start: &'a CudaView<'a, i32>,
    pub len: &'a CudaView<'a, i32>,
    pub commit_at: &'a CudaView<'a, i32>,
    pub uniform_len: Option<usize>,
    pub commits: bool,
    pub plane_stride: Option<usize>,
}

/// The kind of kernel a step needs (what [`CudaPool::prepare`] compiles ahead).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepKind {
    /// Every sequence's length when they all have the same one (`None`: lengths vary).
    pub uniform_len: Option<usize>,
    /// Some sequence commits.
    pub commits: bool,
    pub planes: bool,
    pub io: Io,
    /// Sequences in the call: from [`STAGE_MIN_BLOCKS`] blocks on, a bf16 state at T 1 is staged through shared
    /// memory (more blocks a multiprocessor; slower for a call that does not fill the device). No bits change.
    pub seqs: usize,
}

/// Blocks a call needs (sequences x value heads) per multiprocessor before staging pays (H200: B 1 T 1 4.4 µs
/// in registers against 5.1 staged, B 256 T 1 351 against 276).
pub const STAGE_MIN_BLOCKS: usize = 2;

/// Raw device addresses of one step's operands.
#[derive(Clone, Copy)]
pub(crate) struct Operands {
    pub(crate) qkv: sys::CUdeviceptr,
    pub(crate) alpha: sys::CUdeviceptr,
    pub(crate) beta: sys::CUdeviceptr,
    pub(crate) z: sys::CUdeviceptr,
    pub(crate) out: sys::CUdeviceptr,
    pub(crate) slot: sys::CUdeviceptr,
    pub(crate) start: sys::CUdeviceptr,
    pub(crate) len: sys::CUdeviceptr,
    pub(crate) commit_at: sys::CUdeviceptr,
    /// The speculative step's per-sequence `accepted | buffer << 8` (None: a plain step).
    pub(crate) accept: Option<sys::CUdeviceptr>,
    /// What the host knows of the call's windows (picks the chunked path and the kernels).
    pub(crate) known: Option<Known>,
}

/// What the host knows of a call's windows: the shortest and the longest, and, for the window kernel's range of
/// effective lengths (`spec::window_range`: commit point, or length without one), whether some sequence is its
/// (`window`) and whether some is the token-serial kernel's (`serial`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Known {
    pub(crate) lo: usize,
    pub(crate) hi: usize,
    pub(crate) window: bool,
    pub(crate) serial: bool,
}

impl Known {
    /// From the live sequences' lengths and commit points (0: none), for the window kernel's range `wr`.
    pub(crate) fn of(
        lens_commits: impl Iterator<Item = (usize, usize)>,
        wr: (usize, usize),
    ) -> Option<Known> {
        lens_commits.fold(None, |k: Option<Known>, (len, c)| {
            let eff = if c > 0 { c } else { len };
            let window = len >= 2 && (wr.0..=wr.1).contains(&eff);
            Some(match k {
                None => Known {
                    lo: len,
                    hi: len,
                    window,
                    serial: !window,
                },
                Some(k) => Known {
                    lo: k.lo.min(len),
                    hi: k.hi.max(len),
                    window: k.window || window,
                    serial: k.serial || !window,
                },
            })
        })
    }

    /// All windows of length `t`, commit points unknown when `commits`.
    pub(crate) fn uniform(t: usize, commits: bool, wr: (usize, usize)) -> Known {
        let verify_in = t >= 2 && (wr.0..=wr.1).contains(&t);
        Known {
            lo: t,
            hi: t,
            window: if commits {
                t >= 2 && t >= wr.0
            } else {
                verify_in
            },
            serial: commits || !verify_in,
        }
    }
}

/// Longest window a slot holds for a speculative step (the kernel's `MAXH`).
pub const MAX_HELD: usize = 16;

/// Floats of one (slot, buffer) of the pending region (the kernel's `PEND_PB`): per token of a held window the
/// gate of each value head, the normalized key of each key head, the delta vector of each value head and the raw
/// qkv row.
pub(crate) fn pending_len(sh: &gdn::Shape) -> Option<usize> {
    let per_token = sh
        .h_v
        .checked_add(sh.h_k.checked_mul(sh.d)?)?
        .checked_add(sh.h_v.checked_mul(sh.d)?)?
        .checked_add(sh.channels())?;
    per_token.checked_mul(MAX_HELD)
}

/// The pool's S, in its element type.
pub(crate) enum StateBuf {
    F32(CudaSlice<f32>),
    Bf16(CudaSlice<bf16>),
}

impl StateBuf {
    /// The pool's state address, for a kernel that writes it.
    pub(crate) fn ptr_mut(&mut self, cuda: &Cuda) -> sys::CUdeviceptr {
        match self {
            StateBuf::F32(s) => ptr_mut(s, cuda),
            StateBuf::Bf16(s) => ptr_mut(s, cuda),
        }
    }
}

/// Element types whose values are plain bytes (no padding, every bit pattern valid), so a slice of them can be
/// moved to and from a byte buffer on the device.
trait Plain: Copy {}
impl Plain for f32 {}
impl Plain for bf16 {}
impl Plain for f16 {}
impl Plain for i32 {}

fn bytes_of<T: Plain>(x: &[T]) -> &[u8] {
    // SAFETY: `T` is one of the plain types above (no padding), so its `size_of_val(x)` bytes are initialised;
    // u8 has alignment 1, and the returned slice borrows `x`.
    unsafe { std::slice::from_raw_parts(x.as_ptr() as *const u8, std::mem::size_of_val(x)) }
}

fn bytes_of_mut<T: Plain>(x: &mut [T]) -> &mut [u8] {
    // SAFETY: as `bytes_of`; in addition every byte pattern is a valid `T` (f32, bf16, f16, i32), so writes
    // through the byte view leave valid values; the returned slice borrows `x` mutably.
    unsafe { std::slice::from_raw_parts_mut(x.as_mut_ptr() as *mut u8, std::mem::size_of_val(x)) }
}

fn tensor_bytes<'a>(t: &Tensor<'a>) -> &'a [u8] {
    match *t {
        Tensor::F32(x) => bytes_of(x),
        Tensor::Bf16(x) => bytes_of(x),
        Tensor::F16(x) => bytes_of(x),
    }
}

/// Staging (the host-slice step's device copy of one call's tensors) is one byte buffer, each tensor at a
/// 256-byte-aligned offset. It is sized to the call (rounded up to 64 KiB, so similar calls reuse it) and kept
/// while it is at most [`STAGING_KEEP`] bytes; a call that needed more frees it when it returns, so a pool
/// never holds more than that between calls however large a window it once saw.
pub const STAGING_KEEP: usize = 64 << 20;
const STAGING_ALIGN: usize = 256;
const STAGING_GRAIN: usize = 64 << 10;

/// The offsets of parts of `sizes` bytes in one staging buffer and the bytes it needs (checked arithmetic).
pub fn staging_layout(sizes: &[usize]) -> Option<(Vec<usize>, usize)> {
    let mut offs = Vec::with_capacity(sizes.len());
    let mut end = 0usize;
    for &s in sizes {
        let at = end.checked_next_multiple_of(STAGING_ALIGN)?;
        offs.push(at);
        end = at.checked_add(s)?;
    }
    Some((offs, end))
}

/// What a call that needs `need` bytes does with a staging buffer of `have` bytes (0: none): `Some(n)`
/// allocates a new one of `n` bytes first, `None` uses the one there.
pub fn staging_alloc(have: usize, need: usize) -> Option<usize> {
    if need <= have && have > 0 {
        None
    } else {
        Some(
            need.max(1)
                .checked_next_multiple_of(STAGING_GRAIN)
                .unwrap_or(need),
        )
    }
}

/// Whether a staging buffer of `have` bytes is kept after a call.
pub fn staging_keep(have: usize) -> bool {
    have <= STAGING_KEEP
}

/// One layer's parameters and state pool on a CUDA device. `step_spec` runs natively (one state read and one
/// write per speculative step; the kernel's `GDN_SPEC`): a held window's per-token gates, keys, deltas and raw
/// rows are kept on the device per slot (two buffers, see `pend`), windows of at most [`MAX_HELD`] tokens. S
/// is kept in the pool's layout (key-major [slot][d][h_v][d] or value-major [slot][h_v][d][d]) and element
/// type; the conv history (f32) as [slot][h_v][3 (q, k, v)][d][3]: every value head has a private copy of the
/// q/k history it reads, so the kernel commits it in place with no cross-head dependency.
pub struct CudaPool {
    pub(crate) cuda: Cuda,
    pub(crate) layer: Layer,
    pub(crate) slots: usize,
    pub(crate) options: PoolOptions,
    pub(crate) state: StateBuf,
    pub(crate) hist: CudaSlice<f32>,
    pub(crate) conv_w: CudaSlice<f32>,
    pub(crate) dt: CudaSlice<f32>,
    pub(crate) a: CudaSlice<f32>,
    pub(crate) gamma: CudaSlice<f32>,
    staging: Option<CudaSlice<u8>>,
    /// Bits the kernel sets where a device-native step named a sequence out of range (see `take_fault`).
    pub(crate) fault: CudaSlice<u32>,
    /// The speculative step's pending region, [slot][2 buffers][`pending_len`] (allocated by the first
    /// `step_spec`): what each held window's tokens would commit. Two buffers a slot, so a step writes the
    /// window it holds into the one its kernel does not read.
    pend: Option<CudaSlice<f32>>,
    /// Per slot, the length of the window it holds (0: none) and the buffer holding it.
    held: Vec<usize>,
    held_buf: Vec<u8>,
}

pub(crate) fn ptr<T, S: DevicePtr<T>>(s: &S, cuda: &Cuda) -> sys::CUdeviceptr {
    // event tracking is off for this backend's context, so the guard records nothing
    let (p, _guard) = s.device_ptr(&cuda.stream);
    p
}

pub(crate) fn ptr_mut<T, S: DevicePtrMut<T>>(s: &mut S, cuda: &Cuda) -> sys::CUdeviceptr {
    let (p, _guard) = s.device_ptr_mut(&cuda.stream);
    p
}

pub(crate) fn too_large(name: &'static str) -> Error {
    Error::Param {
        name,
        why: "the size overflows the address space".into(),
    }
}

pub(crate) fn int(x: usize, what: &'static str) -> Result<i32> {
    i32::try_from(x).map_err(|_| Error::Param {
        name: what,
        why: format!("{x} does not fit the kernel's 32-bit argument"),
    })
}

impl CudaPool {
    pub(crate) fn new(
        cuda: Cuda,
        layer: &Layer,
        slots: usize,
        options: PoolOptions,
    ) -> Result<CudaPool> {
        layer.validate()?;
        options.validate()?;
        let sh = *layer.shape();
        // fail early on a shape the kernel cannot hold
        Plan::choose(sh.d, sh.h_v, 1, cuda.sms)?;
        int(slots, "slots")?;
        let state_len = slots
            .checked_mul(sh.state_len())
            .ok_or_else(|| too_large("slots"))?;
        let hist_len = slots
            .checked_mul(head_history::len(layer))
            .ok_or_else(|| too_large("slots"))?;
        let s = &cuda.stream;
        let p = &layer.params;
        let state = match options.state {
            DType::Bf16 => StateBuf::Bf16(s.alloc_zeros::<bf16>(state_len.max(1)).map_err(drv)?),
            _ => StateBuf::F32(s.alloc_zeros::<f32>(state_len.max(1)).map_err(drv)?),
        };
        let fault = s.alloc_zeros::<u32>(1).map_err(drv)?;
        let pool = CudaPool {
            state,
            hist: s.alloc_zeros::<f32>(hist_len.max(1)).map_err(drv)?,
            conv_w: s.clone_htod(&p.conv_w).map_err(drv)?,
            dt: s.clone_htod(&p.dt).map_err(drv)?,
            a: s.clone_htod(&p.a).map_err(drv)?,
            gamma: s.clone_htod(&p.gamma).map_err(drv)?,
            cuda,
            layer: layer.clone(),
            slots,
            options,
            staging: None,
            fault,
            pend: None,
            held: vec![0; slots],
            held_buf: vec![0; slots],
        };
        pool.cuda.stream.synchronize().map_err(drv)?;
        Ok(pool)
    }

    /// Turns programmatic dependent launch on or off for this pool's launches.
    pub fn set_pdl(&mut self, on: bool) {
        self.cuda.pdl = on;
    }

    /// The backend this pool lives on.
    pub fn cuda(&self) -> &Cuda {
        &self.cuda
    }

    /// The launch plan (the same for every call: a sequence's bits do not depend on the batch).
    pub fn plan(&self) -> Result<Plan> {
        let sh = self.layer.shape();
        self.cuda.plan_for(sh.d, sh.h_v)
    }

    /// Whether this pool runs windows in the window kernel ([`Cuda::set_window_kernel`]
    /// and a shape it takes).
    pub fn window_runs(&self) -> bool {
        self.cuda.window
            && self
                .spec(&StepKind {
                    uniform_len: None,
                    commits: true,
                    planes: false,
                    io: Io::all(DType::F32),
                    seqs: 1,
                })
                .is_ok_and(|s| s.window_fits())
    }

    /// The kernel specialisation a step of this kind runs.
    pub fn spec(&self, kind: &StepKind) -> Result<Spec> {
        let heads = kind.seqs.saturating_mul(self.layer.shape().h_v);
        let plan = self.plan()?;
        Ok(Spec::new(
            self.cuda.arch,
            &self.layer.config,
            kind.uniform_len,
            kind.commits,
            kind.planes,
            plan,
        )
        .with_io(kind.io)
        .with_pool(self.options)
        .with_stage(heads >= STAGE_MIN_BLOCKS * self.cuda.sms)
        .with_tune(
            self.cuda.tune(),
            heads.saturating_mul(plan.ncb),
            self.cuda.sms,
        ))
    }

    /// Compiles and loads the kernel a step of this kind needs, so that a later step (for instance one
    /// being captured into a graph) does no compilation.
    pub fn prepare(&self, kind: &StepKind) -> Result<()> {
        let spec = self.spec(kind)?;
        self.function(&spec)?;
        if self.cuda.window
            && spec.window_fits()
            && kind
                .uniform_len
                .is_none_or(|t| t >= window_range(self.options.state).0)
        {
            self.function(&self.window_spec(&spec, kind.seqs))?;
            self.function(&spec.with_route())?;
        }
        Ok(())
    }

    /// Bytes of staging held now (0: none).
    pub fn staging_bytes(&self) -> usize {
        self.staging.as_ref().map_or(0, |s| s.len())
    }

    /// The window kernel's specialisation of a call of `seqs` sequences.
    fn window_spec(&self, spec: &Spec, seqs: usize) -> Spec {
        let blocks = seqs.saturating_mul(self.layer.shape().h_v);
        spec.with_window(blocks, self.cuda.sms, self.cuda.tune())
    }

    /// A speculative step's generic checks and its acceptances against what the slots hold.
    fn check_spec_step(
        &self,
        step: &Step<'_>,
        out_len: usize,
        accept: &[usize],
    ) -> Result<gdn::Checked> {
        let checked = step.validate(&self.layer, self.slots, out_len)?;
        let held = |slot| self.held[slot];
        gdn::spec::check_spec(
            step,
            &checked.commit_at,
            accept,
            held,
            MAX_HELD,
            "the CUDA pool",
        )?;
        Ok(checked)
    }

    fn function(&self, spec: &Spec) -> Result<CudaFunction> {
        self.cuda.function(spec)
    }

    /// Reports, and clears, what the device found wrong in device-native steps since the last report: a sequence
    /// whose slot is past the pool, whose length is not the one its specialisation was compiled for, whose rows
    /// leave the step's, or whose commit point is outside 0..=its length. Such a sequence was skipped (its
    /// commit, for a bad commit point), nothing outside the pool, the rows or the output touched. The host
    /// calls of this pool (`step_varlen`, `read_slot`, `write_slot`) call it first, so the next one after a
    /// faulty device step returns this error and does nothing else; an engine that only captures device steps
    /// calls it where it may wait for the stream.
    pub fn take_fault(&mut self) -> Result<()> {
        let s = self.cuda.stream.clone();
        let mut word = [0u32];
        s.memcpy_dtoh(&self.fault, &mut word).map_err(drv)?;
        s.synchronize().map_err(drv)?;
        if word[0] == 0 {
            return Ok(());
        }
        s.memset_zeros(&mut self.fault).map_err(drv)?;
        Err(fault_error(word[0]))
    }

    /// The device-native step: inputs, per-sequence arrays and output already on the device. It allocates
    /// nothing and does not wait for the device (after the first call of a specialisation, which compiles it:
    /// see [`CudaPool::prepare`]), so it can be captured into a CUDA graph. The output is
    /// [`gdn::OutputLayout`] over `step.rows`; rows of skipped sequences and rows no sequence covers are not
    /// written. Sequences the device finds out of range (slot outside the pool, length not positive or not
    /// `uniform_len`, rows outside `rows`) are skipped; a commit point outside 0..=len commits nothing; both are
    /// reported by [`CudaPool::take_fault`], which the pool's next host call runs first. The slots live on the
    /// device, so a slot holding a speculative window is not checked here (as `step_varlen` does): accept or
    /// drop the window first (`commit_held`), or the next `step_spec` applies it to a state it no longer
    /// belongs to. Windows of at least [`CudaPool::chunk_min_len`] tokens take the chunked path, whose scratch
    /// is allocated by the first call that needs it: before a graph capture, [`CudaPool::reserve_chunk`] with
    /// the largest call's rows and sequences.
    pub fn step_device(
        &mut self,
        step: &DeviceStep<'_>,
        out: &mut DeviceTensorMut<'_, '_>,
    ) -> Result<()> {
        self.step_device_with(step, out, None, None)
    }

    /// `step_device`, or with `accept` (a device array of `accepted | buffer << 8` per sequence, see the
    /// kernel's SPECULATIVE) the speculative kernel.
    /// `known`: what the caller knows of the call's windows (else `uniform_len`'s).
    fn step_device_with(
        &mut self,
        step: &DeviceStep<'_>,
        out: &mut DeviceTensorMut<'_, '_>,
        accept: Option<sys::CUdeviceptr>,
        known: Option<Known>,
    ) -> Result<()> {
        let sh = *self.layer.shape();
        let rows = step.rows;
        for (name, width, got) in [
            ("qkv", sh.channels(), step.qkv.len()),
            ("alpha", sh.h_v, step.alpha.len()),
            ("beta", sh.h_v, step.beta.len()),
            ("z", sh.n(), step.z.len()),
        ] {
            let expected = rows.checked_mul(width).ok_or_else(|| too_large(name))?;
            if expected != got {
                return Err(Error::Length {
                    name,
                    expected,
                    got,
                });
            }
        }
        let n = step.slot.len();
        for (name, got) in [
            ("start", step.start.len()),
            ("len", step.len.len()),
            ("commit_at", step.commit_at.len()),
        ] {
            if got != n {
                return Err(Error::Length {
                    name,
                    expected: n,
                    got,
                });
            }
        }
        if step.uniform_len == Some(0) {
            return Err(Error::EmptyWindow);
        }
        let layout = OutputLayout::for_rows(&sh, rows, step.plane_stride)?;
        if out.len() != layout.len() {
            return Err(Error::Length {
                name: "output",
                expected: layout.len(),
                got: out.len(),
            });
        }
        let kind = StepKind {
            uniform_len: step.uniform_len,
            commits: step.commits,
            planes: step.plane_stride.is_some(),
            io: Io::new(
                [
                    step.qkv.dtype(),
                    step.alpha.dtype(),
                    step.beta.dtype(),
                    step.z.dtype(),
                ],
                out.dtype(),
            ),
            seqs: n,
        };
        let ops = Operands {
            qkv: step.qkv.ptr(&self.cuda),
            alpha: step.alpha.ptr(&self.cuda),
            beta: step.beta.ptr(&self.cuda),
            z: step.z.ptr(&self.cuda),
            out: out.ptr(&self.cuda),
            slot: ptr(step.slot, &self.cuda),
            start: ptr(step.start, &self.cuda),
            len: ptr(step.len, &self.cuda),
            commit_at: ptr(step.commit_at, &self.cuda),
            accept,
            known: known.or(step
                .uniform_len
                .map(|t| Known::uniform(t, step.commits, window_range(self.options.state)))),
        };
        self.launch(&kind, n, rows, step.plane_stride, ops)
    }

    fn launch(
        &mut self,
        kind: &StepKind,
        n_seqs: usize,
        rows: usize,
        plane_stride: Option<usize>,
        ops: Operands,
    ) -> Result<()> {
        if n_seqs == 0 {
            return Ok(());
        }
        // long windows take the chunked path; the token-serial kernel runs the rest (or nothing). The chunked
        // path's scratch is shared by the backend's pools, and it holds the slot array the token-serial kernel
        // reads: its lock is held until that kernel is enqueued (on the one stream), so no other pool's chunked
        // step comes between.
        let shared = self.cuda.pool_chunk.clone();
        let mut held = None;
        let ops = if ops.accept.is_none() {
            match self.chunk_dispatch(kind, n_seqs, rows, plane_stride, ops, &shared, &mut held)? {
                Some(o) => o,
                None => return Ok(()),
            }
        } else {
            ops
        };
        let mut spec = self.spec(kind)?;
        if ops.accept.is_some() {
            spec = spec.with_speculative();
        } else if self.cuda.window && spec.window_fits() {
            // sequences whose effective length is in the window kernel's range go to it, the rest of the call to
            // the token-serial one; unknown lengths: both, each taking its own sequences
            let (window, serial) = ops.known.map_or((true, true), |k| (k.window, k.serial));
            if window {
                self.launch_spec(
                    &self.window_spec(&spec, n_seqs),
                    n_seqs,
                    rows,
                    plane_stride,
                    ops,
                )?;
                if !serial {
                    return Ok(());
                }
                spec = spec.with_route();
            }
        }
        self.launch_spec(&spec, n_seqs, rows, plane_stride, ops)
    }

    /// One launch of one specialisation over the call's sequences.
    fn launch_spec(
        &mut self,
        spec: &Spec,
        n_seqs: usize,
        rows: usize,
        plane_stride: Option<usize>,
        ops: Operands,
    ) -> Result<()> {
        let sh = *self.layer.shape();
        let spec = *spec;
        let f = self.function(&spec)?;
        let mut p_pend = match (&mut self.pend, ops.accept) {
            (Some(p), Some(_)) => ptr_mut(p, &self.cuda),
            (None, Some(_)) => return Err(Error::Backend("pending region missing".into())),
            _ => 0,
        };
        let mut p_acc = ops.accept.unwrap_or(0);
        let grid_y = u32::try_from(n_seqs)
            .ok()
            .filter(|&y| y <= 65535)
            .ok_or_else(|| Error::Param {
                name: "seqs",
                why: format!("{n_seqs} sequences is above the 65535 a launch takes"),
            })?;
        let mut p_state = self.state.ptr_mut(&self.cuda);
        let mut p_hist = ptr_mut(&mut self.hist, &self.cuda);
        let mut p_qkv = ops.qkv;
        let mut p_alpha = ops.alpha;
        let mut p_beta = ops.beta;
        let mut p_z = ops.z;
        let mut p_conv = ptr(&self.conv_w, &self.cuda);
        let mut p_dt = ptr(&self.dt, &self.cuda);
        let mut p_a = ptr(&self.a, &self.cuda);
        let mut p_gamma = ptr(&self.gamma, &self.cuda);
        let mut p_out = ops.out;
        let mut p_slot = ops.slot;
        let mut p_start = ops.start;
        let mut p_len = ops.len;
        let mut p_commit = ops.commit_at;
        let mut n_slots = int(self.slots, "slots")?;
        let mut n_rows = int(rows, "rows")?;
        let mut plane = i64::try_from(plane_stride.unwrap_or(0)).map_err(|_| Error::Param {
            name: "plane_stride",
            why: "too large".into(),
        })?;
        let mut eps = self.layer.config.eps;
        let mut p_fault = ptr_mut(&mut self.fault, &self.cuda);
        let mut params: Vec<*mut c_void> = vec![
            &mut p_state as *mut _ as *mut c_void,
            &mut p_hist as *mut _ as *mut c_void,
            &mut p_qkv as *mut _ as *mut c_void,
            &mut p_alpha as *mut _ as *mut c_void,
            &mut p_beta as *mut _ as *mut c_void,
            &mut p_z as *mut _ as *mut c_void,
            &mut p_conv as *mut _ as *mut c_void,
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
        ];
        if ops.accept.is_some() {
            params.push(&mut p_pend as *mut _ as *mut c_void);
            params.push(&mut p_acc as *mut _ as *mut c_void);
        }
        let grid = ((sh.h_v * spec.plan.ncb) as u32, grid_y, 1);
        // SAFETY: the 20 parameters match the kernel's signature in order and type (six device pointers of
        // the pool and the layer, four of the rows, the output, four per-sequence int arrays, int n_slots, int
        // n_rows, long long plane, float eps, the pool's one-word fault buffer; a speculative step, compiled
        // with GDN_SPEC, two more: the pending region of `slots` x 2 x `pending_len` floats and a fifth
        // per-sequence int array of `n_seqs` entries, whose accepted counts the kernel bounds by MAX_HELD and
        // whose buffer it takes as one bit); each points to a local that
        // lives across the call (the driver copies them at launch). The element types the kernel was compiled
        // for are those of the buffers (the spec is built from the same dtypes). The buffers have the lengths
        // the kernel indexes: the pool's by construction, the rows' and the output's checked by the callers
        // against the shape, `rows` and the output layout, the per-sequence arrays hold `n_seqs` entries (one
        // block row each); the kernel skips a sequence whose slot or rows are out of range. The stream is the
        // pool's own.
        unsafe {
            launch_kernel(
                &self.cuda,
                &f,
                grid,
                spec.threads() as u32,
                &mut params,
                self.cuda.stream.cu_stream(),
            )
        }
    }

    /// The host-slice step on the device: stages the rows, the per-sequence arrays (with `accept`, the speculative
    /// step's fifth: accepted count and buffer) and the output, launches once, brings the output back.
    fn run_host(
        &mut self,
        step: &Step<'_>,
        checked: &gdn::Checked,
        mut out: TensorMut<'_>,
        accept: Option<&[usize]>,
    ) -> Result<()> {
        let rows = checked.rows;
        int(rows, "rows")?;
        // only the sequences that run go to the device, as four int arrays (five for a speculative step)
        let live = live_longest_first(step.seqs);
        if live.is_empty() {
            return Ok(());
        }
        let n = live.len();
        let cols = if accept.is_some() { 5 } else { 4 };
        let mut ints = vec![0i32; cols * n];
        for (k, &i) in live.iter().enumerate() {
            let s = &step.seqs[i];
            ints[k] = s.slot;
            ints[n + k] = int(s.start, "start")?;
            ints[2 * n + k] = int(s.len, "len")?;
            ints[3 * n + k] = int(checked.commit_at[i], "commit")?;
            if let Some(a) = accept {
                let slot = s.slot as usize;
                ints[4 * n + k] = int(a[i] | (self.held_buf[slot] as usize) << 8, "accept")?;
            }
        }
        let first = step.seqs[live[0]].len;
        let uniform = live.iter().all(|&i| step.seqs[i].len == first);
        let kind = StepKind {
            uniform_len: (uniform && first <= MAX_CONST_T).then_some(first),
            commits: live.iter().any(|&i| checked.commit_at[i] > 0),
            planes: step.plane_stride.is_some(),
            io: Io::new(step.rows.dtypes(), out.dtype()),
            seqs: n,
        };
        let r = &step.rows;
        let parts = [
            tensor_bytes(&r.qkv),
            tensor_bytes(&r.alpha),
            tensor_bytes(&r.beta),
            tensor_bytes(&r.z),
            bytes_of(&ints),
        ];
        let out_bytes = bytes_of_mut_tensor(&mut out);
        let mut sizes: Vec<usize> = parts.iter().map(|p| p.len()).collect();
        sizes.push(out_bytes.len());
        let (offs, need) = staging_layout(&sizes).ok_or_else(|| too_large("step"))?;
        self.staging(need)?;
        let s = self.cuda.stream.clone();
        let result = (|| {
            let st = self
                .staging
                .as_mut()
                .ok_or_else(|| Error::Backend("staging buffer missing".into()))?;
            for (p, &at) in parts.iter().zip(&offs) {
                put(&s, st, at, p)?;
            }
            // the caller's output goes up too: rows the step does not write must come back unchanged
            put(&s, st, offs[5], out_bytes)?;
            let base = ptr(st, &self.cuda);
            let at = |k: usize| base + offs[k] as u64;
            let ints_at = |k: usize| at(4) + (4 * k * n) as u64;
            let ops = Operands {
                qkv: at(0),
                alpha: at(1),
                beta: at(2),
                z: at(3),
                slot: ints_at(0),
                start: ints_at(1),
                len: ints_at(2),
                commit_at: ints_at(3),
                accept: accept.map(|_| ints_at(4)),
                out: at(5),
                known: Known::of(
                    live.iter()
                        .map(|&i| (step.seqs[i].len, checked.commit_at[i])),
                    window_range(self.options.state),
                ),
            };
            self.launch(&kind, n, rows, step.plane_stride, ops)?;
            let st = self
                .staging
                .as_ref()
                .ok_or_else(|| Error::Backend("staging buffer missing".into()))?;
            if !out_bytes.is_empty() {
                s.memcpy_dtoh(&st.slice(offs[5]..offs[5] + out_bytes.len()), out_bytes)
                    .map_err(drv)?;
            }
            s.synchronize().map_err(drv)
        })();
        if !staging_keep(self.staging_bytes()) {
            self.staging = None;
        }
        result
    }

    /// The pending region, allocated on first use (zeros: no slot holds a window yet).
    fn pending(&mut self) -> Result<()> {
        if self.pend.is_none() {
            let pl = pending_len(self.layer.shape()).ok_or_else(|| too_large("slots"))?;
            let len = self
                .slots
                .checked_mul(2)
                .and_then(|x| x.checked_mul(pl))
                .ok_or_else(|| too_large("slots"))?;
            self.pend = Some(
                self.cuda
                    .stream
                    .alloc_zeros::<f32>(len.max(1))
                    .map_err(drv)?,
            );
        }
        Ok(())
    }

    /// The staging buffer, at least `need` bytes (see [`staging_alloc`]).
    fn staging(&mut self, need: usize) -> Result<()> {
        if let Some(n) = staging_alloc(self.staging_bytes(), need) {
            self.staging = None;
            self.staging = Some(self.cuda.stream.alloc_zeros::<u8>(n).map_err(drv)?);
        }
        Ok(())
    }

    fn state_len(&self) -> usize {
        self.layer.shape().state_len()
    }
}

/// The error for a nonzero fault word of a device-native step (the kernel's bits: 1 slot past the pool, 2
/// length other than the compiled one, 4 rows outside the step's, 8 commit point outside 0..=length).
pub(crate) fn fault_error(word: u32) -> Error {
    let what: Vec<&str> = [
        (1, "a slot past the pool"),
        (2, "a length other than the compiled window length"),
        (4, "rows outside the step's"),
        (8, "a commit point outside 0..=length"),
        (16, "an accepted count above what a slot holds"),
        (32, "a held window longer than 16 tokens"),
    ]
    .into_iter()
    .filter(|(bit, _)| word & bit != 0)
    .map(|(_, w)| w)
    .collect();
    Error::Param {
        name: "device step",
        why: format!(
            "a device-native step named sequences with {} (they were skipped)",
            what.join(", ")
        ),
    }
}

/// Launches `f` over `grid` with `threads` threads a block on `stream`, with programmatic dependent launch
/// where `cuda` has it on.
///
/// # Safety
/// `params` are the kernel's parameters in order and type, each pointing to a value that lives across the
/// call, every device pointer among them valid for what the kernel indexes; `stream` is a live stream of
/// `cuda`'s context. Programmatic serialisation is sound because the kernel executes griddepcontrol.wait
/// before it touches anything an earlier kernel may write.
pub(crate) unsafe fn launch_kernel(
    cuda: &Cuda,
    f: &CudaFunction,
    grid: (u32, u32, u32),
    threads: u32,
    params: &mut [*mut c_void],
    stream: sys::CUstream,
) -> Result<()> {
    cuda.ctx.bind_to_thread().map_err(drv)?;
    // SAFETY: all-zero bytes are a valid value of this plain C union of integers and small structs.
    let mut value: sys::CUlaunchAttributeValue = unsafe { std::mem::zeroed() };
    value.programmaticStreamSerializationAllowed = 1;
    let mut attrs = [sys::CUlaunchAttribute {
        id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
        pad: [0; 4],
        value,
    }];
    let config = sys::CUlaunchConfig {
        gridDimX: grid.0,
        gridDimY: grid.1,
        gridDimZ: grid.2,
        blockDimX: threads,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: 0,
        hStream: stream,
        attrs: attrs.as_mut_ptr(),
        numAttrs: if cuda.pdl { 1 } else { 0 },
    };
    // SAFETY: the caller's contract covers the parameters and the stream; `config` and the attribute it
    // points to live across the call.
    let r = unsafe {
        sys::cuLaunchKernelEx(
            &config,
            f.cu_function(),
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    };
    r.result().map_err(drv)
}

/// Uploads `src` into `dst` at byte offset `at`.
fn put(
    s: &std::sync::Arc<CudaStream>,
    dst: &mut CudaSlice<u8>,
    at: usize,
    src: &[u8],
) -> Result<()> {
    if src.is_empty() {
        return Ok(());
    }
    s.memcpy_htod(src, &mut dst.slice_mut(at..at + src.len()))
        .map_err(drv)
}

impl LayerPool for CudaPool {
    fn layer(&self) -> &Layer {
        &self.layer
    }

    fn slots(&self) -> usize {
        self.slots
    }

    fn options(&self) -> PoolOptions {
        self.options
    }

    fn write_slot(&mut self, slot: usize, state: &[f32], hist: &[f32]) -> Result<()> {
        check_slot_io(&self.layer, self.slots, slot, state.len(), hist.len())?;
        self.take_fault()?;
        let sl = self.state_len();
        let hl = head_history::len(&self.layer);
        let mut pooled = vec![0.0f32; hl];
        head_history::from_spec(&self.layer, hist, &mut pooled);
        let s = self.cuda.stream.clone();
        let r = slot * sl..(slot + 1) * sl;
        match &mut self.state {
            StateBuf::F32(d) => s.memcpy_htod(state, &mut d.slice_mut(r)).map_err(drv)?,
            StateBuf::Bf16(d) => {
                let rounded: Vec<bf16> = state.iter().map(|&x| bf16::from_f32(x)).collect();
                s.memcpy_htod(&rounded, &mut d.slice_mut(r)).map_err(drv)?
            }
        }
        s.memcpy_htod(
            &pooled,
            &mut self.hist.slice_mut(slot * hl..(slot + 1) * hl),
        )
        .map_err(drv)?;
        s.synchronize().map_err(drv)?;
        // a write replaces what the slot held
        self.held[slot] = 0;
        Ok(())
    }

    fn read_slot(&mut self, slot: usize, state: &mut [f32], hist: &mut [f32]) -> Result<()> {
        check_slot_io(&self.layer, self.slots, slot, state.len(), hist.len())?;
        self.take_fault()?;
        let sl = self.state_len();
        let hl = head_history::len(&self.layer);
        let mut pooled = vec![0.0f32; hl];
        let s = self.cuda.stream.clone();
        let r = slot * sl..(slot + 1) * sl;
        match &self.state {
            StateBuf::F32(d) => s.memcpy_dtoh(&d.slice(r), state).map_err(drv)?,
            StateBuf::Bf16(d) => {
                let mut raw = vec![bf16::ZERO; sl];
                s.memcpy_dtoh(&d.slice(r), &mut raw).map_err(drv)?;
                s.synchronize().map_err(drv)?;
                for (o, x) in state.iter_mut().zip(&raw) {
                    *o = x.to_f32();
                }
            }
        }
        s.memcpy_dtoh(&self.hist.slice(slot * hl..(slot + 1) * hl), &mut pooled)
            .map_err(drv)?;
        s.synchronize().map_err(drv)?;
        head_history::to_spec(&self.layer, &pooled, hist);
        Ok(())
    }

    fn step_varlen(&mut self, step: &Step<'_>, out: TensorMut<'_>) -> Result<()> {
        let checked = step.validate(&self.layer, self.slots, out.len())?;
        for s in step.seqs.iter().filter(|s| s.slot >= 0) {
            let h = self.held[s.slot as usize];
            if h > 0 {
                return Err(gdn::spec::held_error(s.slot as usize, h));
            }
        }
        self.take_fault()?;
        self.run_host(step, &checked, out, None)
    }

    fn step_spec(&mut self, step: &Step<'_>, accept: &[usize], out: TensorMut<'_>) -> Result<()> {
        if self.window_runs() {
            // the one-pass kernel replays token-serial windows; this pool's plain steps are not token-serial
            return Err(Error::Unsupported(
                "the CUDA speculative step needs a pool of the token-serial kernels (Cuda::set_window_kernel(false)); \
                 with the window kernel, run the two-pass flow (gdn::spec::TwoPass)"
                    .into(),
            ));
        }
        let checked = self.check_spec_step(step, out.len(), accept)?;
        self.take_fault()?;
        self.pending()?;
        self.run_host(step, &checked, out, Some(accept))?;
        // a held window went to the buffer the kernel did not read
        for (s, &at) in step.seqs.iter().zip(&checked.commit_at) {
            if s.slot >= 0 {
                let slot = s.slot as usize;
                self.held[slot] = if at == 0 { s.len } else { 0 };
                if at == 0 {
                    self.held_buf[slot] ^= 1;
                }
            }
        }
        Ok(())
    }

    fn held(&self, slot: usize) -> usize {
        self.held.get(slot).copied().unwrap_or(0)
    }

    fn commit_held(&mut self, slot: usize, accept: usize) -> Result<()> {
        gdn::spec::check_commit_held(slot, self.slots, accept, self.held(slot))?;
        if accept > 0 {
            self.take_fault()?;
            // one sequence of no rows: the kernel applies the accepted prefix and writes state and history
            let ints = [
                int(slot, "slot")?,
                0,
                0,
                0,
                int(accept | (self.held_buf[slot] as usize) << 8, "accept")?,
            ];
            self.staging(std::mem::size_of_val(&ints))?;
            let s = self.cuda.stream.clone();
            let st = self
                .staging
                .as_mut()
                .ok_or_else(|| Error::Backend("staging buffer missing".into()))?;
            put(&s, st, 0, bytes_of(&ints))?;
            let base = ptr(st, &self.cuda);
            let ops = Operands {
                qkv: base,
                alpha: base,
                beta: base,
                z: base,
                out: base,
                slot: base,
                start: base + 4,
                len: base + 8,
                commit_at: base + 12,
                accept: Some(base + 16),
                known: None,
            };
            let kind = StepKind {
                uniform_len: None,
                commits: true,
                planes: false,
                io: Io::all(DType::F32),
                seqs: 1,
            };
            self.launch(&kind, 1, 0, None, ops)?;
            s.synchronize().map_err(drv)?;
        }
        self.held[slot] = 0;
        Ok(())
    }

    fn copy_slot(&mut self, from: usize, to: usize) -> Result<()> {
        let sh = *self.layer.shape();
        let (mut st, mut hi) = (vec![0.0; sh.state_len()], vec![0.0; sh.hist_len()]);
        check_slot_io(&self.layer, self.slots, to, st.len(), hi.len())?;
        check_slot_io(&self.layer, self.slots, from, st.len(), hi.len())?;
        if from == to {
            return Ok(());
        }
        self.read_slot(from, &mut st, &mut hi)?;
        self.write_slot(to, &st, &hi)?;
        // a fork keeps the held window: its buffer goes along, to the same buffer of the other slot
        if self.held[from] > 0 {
            let pl = pending_len(&sh).ok_or_else(|| too_large("slots"))?;
            let b = self.held_buf[from] as usize;
            let s = self.cuda.stream.clone();
            let pend = self
                .pend
                .as_mut()
                .ok_or_else(|| Error::Backend("pending region missing".into()))?;
            let mut tmp = vec![0.0f32; pl];
            let at = |slot: usize| (slot * 2 + b) * pl;
            s.memcpy_dtoh(&pend.slice(at(from)..at(from) + pl), &mut tmp)
                .map_err(drv)?;
            s.memcpy_htod(&tmp, &mut pend.slice_mut(at(to)..at(to) + pl))
                .map_err(drv)?;
            s.synchronize().map_err(drv)?;
            self.held[to] = self.held[from];
            self.held_buf[to] = self.held_buf[from];
        }
        Ok(())
    }

    fn time_varlen(
        &mut self,
        step: &Step<'_>,
        out_dtype: DType,
        iters: usize,
    ) -> Result<StepTiming> {
        self.time_inner(std::slice::from_ref(step), out_dtype, iters, None)
    }
}

impl CudaPool {
    /// `time_varlen` over several steps taken in turn, one per call, as an engine that steps many layers meets
    /// its states: every entry names its own slots (a set of slots per entry, enough sets that together they do
    /// not fit the L2), so that each call reads its state from memory. The entries share the first one's rows
    /// and planes. The graph holds a whole number of passes over the entries (at least `iters` calls).
    pub fn time_varlen_rotating(
        &mut self,
        steps: &[Step<'_>],
        out_dtype: DType,
        iters: usize,
    ) -> Result<StepTiming> {
        self.time_inner(steps, out_dtype, iters, None)
    }

    /// `time_varlen`'s graph replays over `steps` in turn, of the speculative kernel where `accept` is given (see
    /// `time_spec`; one step then).
    fn time_inner(
        &mut self,
        steps: &[Step<'_>],
        out_dtype: DType,
        iters: usize,
        accept: Option<&[usize]>,
    ) -> Result<StepTiming> {
        let step = steps.first().ok_or_else(|| Error::Param {
            name: "steps",
            why: "nothing to time".into(),
        })?;
        let sh = *self.layer.shape();
        let layout = step.layout(&sh)?;
        let rows = layout.rows;
        let s = self.cuda.stream.clone();
        let up = |t: &Tensor<'_>| -> Result<Owned> {
            Ok(match *t {
                Tensor::F32(x) => Owned::F32(s.clone_htod(x).map_err(drv)?),
                Tensor::Bf16(x) => Owned::Bf16(s.clone_htod(x).map_err(drv)?),
                Tensor::F16(x) => Owned::F16(s.clone_htod(x).map_err(drv)?),
            })
        };
        let (qkv, alpha, beta, z) = (
            up(&step.rows.qkv)?,
            up(&step.rows.alpha)?,
            up(&step.rows.beta)?,
            up(&step.rows.z)?,
        );
        // per entry: its four (five) per-sequence arrays and the kernel hints
        struct Arrays {
            cols: Vec<CudaSlice<i32>>,
            n: usize,
            uniform_len: Option<usize>,
            commits: bool,
            /// what the host knows of the windows (the chunked path's and the kernels' choice)
            known: Option<Known>,
        }
        let mut sets = Vec::with_capacity(steps.len());
        for st in steps {
            if st.layout(&sh)?.len() != layout.len() {
                return Err(Error::Param {
                    name: "steps",
                    why: "the entries of a rotation must have the same rows and output".into(),
                });
            }
            let checked = st.validate(&self.layer, self.slots, layout.len())?;
            let live = live_longest_first(st.seqs);
            let col = |f: &dyn Fn(usize) -> Result<i32>| -> Result<CudaSlice<i32>> {
                let v = live.iter().map(|&i| f(i)).collect::<Result<Vec<i32>>>()?;
                // an empty call still needs a buffer to point at
                s.clone_htod(if v.is_empty() { &[0][..] } else { &v })
                    .map_err(drv)
            };
            let mut cols = vec![
                col(&|i| Ok(st.seqs[i].slot))?,
                col(&|i| int(st.seqs[i].start, "start"))?,
                col(&|i| int(st.seqs[i].len, "len"))?,
                col(&|i| int(checked.commit_at[i], "commit"))?,
            ];
            if let Some(a) = accept {
                cols.push(col(&|i| {
                    let buf = self.held_buf[st.seqs[i].slot as usize] as usize;
                    int(a[i] | buf << 8, "accept")
                })?);
            }
            let first = live.first().map_or(1, |&i| st.seqs[i].len);
            let uniform = live.iter().all(|&i| st.seqs[i].len == first);
            sets.push(Arrays {
                cols,
                n: live.len(),
                uniform_len: (uniform && first <= MAX_CONST_T).then_some(first),
                commits: live.iter().any(|&i| checked.commit_at[i] > 0),
                known: Known::of(
                    live.iter().map(|&i| (st.seqs[i].len, checked.commit_at[i])),
                    window_range(self.options.state),
                ),
            });
        }
        let mut out = Owned::zeros(&s, out_dtype, layout.len().max(1))?;
        let (qv, av, bv, zv) = (qkv.view(), alpha.view(), beta.view(), z.view());
        let views: Vec<Vec<CudaView<'_, i32>>> = sets
            .iter()
            .map(|a| a.cols.iter().map(|c| c.slice(0..a.n)).collect())
            .collect();
        let dss: Vec<DeviceStep<'_>> = sets
            .iter()
            .zip(&views)
            .map(|(a, v)| DeviceStep {
                rows,
                qkv: qv.tensor(),
                alpha: av.tensor(),
                beta: bv.tensor(),
                z: zv.tensor(),
                slot: &v[0],
                start: &v[1],
                len: &v[2],
                commit_at: &v[3],
                uniform_len: a.uniform_len,
                commits: a.commits,
                plane_stride: step.plane_stride,
            })
            .collect();
        let acc_ptrs: Vec<Option<sys::CUdeviceptr>> = views
            .iter()
            .map(|v| v.get(4).map(|a| ptr(a, &self.cuda)))
            .collect();
        let out_len = layout.len();
        let next = std::cell::Cell::new(0usize);
        let one = |pool: &mut CudaPool, out: &mut Owned| -> Result<()> {
            let k = next.get();
            next.set((k + 1) % dss.len());
            out.step_with(pool, &dss[k], out_len, acc_ptrs[k], sets[k].known)
        };
        // warm-up (compiles and loads the kernel)
        for _ in 0..3.max(dss.len()) {
            one(self, &mut out)?;
        }
        s.synchronize().map_err(drv)?;
        // host cost of one call: issue a run of calls without waiting
        let n_host = 50;
        let t0 = Instant::now();
        for _ in 0..n_host {
            one(self, &mut out)?;
        }
        let host = t0.elapsed() / n_host;
        s.synchronize().map_err(drv)?;
        // a graph of `per_graph` steps, replayed
        // whole passes over the entries (each graph replay starts at the first)
        let per_graph = iters.clamp(1, 100).next_multiple_of(steps.len());
        next.set(0);
        s.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(drv)?;
        let mut captured = Ok(());
        for _ in 0..per_graph {
            captured = one(self, &mut out);
            if captured.is_err() {
                break;
            }
        }
        let graph = s.end_capture(sys::CUgraphInstantiate_flags(0));
        captured?;
        let graph = graph
            .map_err(drv)?
            .ok_or_else(|| Error::Backend("graph capture produced no graph".into()))?;
        graph.launch().map_err(drv)?;
        s.synchronize().map_err(drv)?;
        let ev = |ctx: &std::sync::Arc<cudarc::driver::CudaContext>| {
            ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(drv)
        };
        let (e0, e1) = (ev(&self.cuda.ctx)?, ev(&self.cuda.ctx)?);
        let replays = 10;
        let mut times = Vec::new();
        for _ in 0..7 {
            e0.record(&s).map_err(drv)?;
            for _ in 0..replays {
                graph.launch().map_err(drv)?;
            }
            e1.record(&s).map_err(drv)?;
            e1.synchronize().map_err(drv)?;
            let ms = e0.elapsed_ms(&e1).map_err(drv)? as f64;
            times.push(ms * 1e-3 / (replays * per_graph) as f64);
        }
        times.sort_by(|a, b| a.total_cmp(b));
        Ok(StepTiming {
            per_call: Duration::from_secs_f64(times[times.len() / 2]),
            host_per_call: Some(host),
            method: format!(
                "CUDA graph of {per_graph} steps replayed {replays}x, events, median of 7"
            ),
        })
    }

    /// Device time of one speculative step (`step_spec`'s kernel: each sequence first applies `accept[i]` tokens
    /// of its slot's held window), as `time_varlen` times a plain step: a CUDA graph of steps replayed, events,
    /// median. A benchmark: the replays apply the same accepted prefix again and again, so the named slots'
    /// states, histories and held windows are unspecified afterwards (their held windows are dropped).
    pub fn time_spec(
        &mut self,
        step: &Step<'_>,
        accept: &[usize],
        out_dtype: DType,
        iters: usize,
    ) -> Result<StepTiming> {
        self.time_spec_rotating(std::slice::from_ref(step), accept, out_dtype, iters)
    }

    /// `time_spec` over several steps taken in turn, one per call (as `time_varlen_rotating`: each entry names
    /// its own slots, so each call's state comes from memory); every entry's sequence `i` accepts `accept[i]`.
    /// The same caveat: the named slots' states, histories and held windows are unspecified afterwards.
    pub fn time_spec_rotating(
        &mut self,
        steps: &[Step<'_>],
        accept: &[usize],
        out_dtype: DType,
        iters: usize,
    ) -> Result<StepTiming> {
        for step in steps {
            let layout = step.layout(self.layer.shape())?;
            self.check_spec_step(step, layout.len(), accept)?;
        }
        self.take_fault()?;
        self.pending()?;
        let t = self.time_inner(steps, out_dtype, iters, Some(accept));
        for s in steps.iter().flat_map(|st| st.seqs).filter(|s| s.slot >= 0) {
            self.held[s.slot as usize] = 0;
        }
        t
    }
}

/// The sequences that run, longest first: the blocks of a long window start in the first wave instead of
/// trailing the call (the order changes no bits: each block reads only its own sequence).
fn live_longest_first(seqs: &[gdn::Seq]) -> Vec<usize> {
    let mut live: Vec<usize> = (0..seqs.len()).filter(|&i| seqs[i].slot >= 0).collect();
    live.sort_by_key(|&i| std::cmp::Reverse(seqs[i].len));
    live
}

fn bytes_of_mut_tensor<'a>(t: &'a mut TensorMut<'_>) -> &'a mut [u8] {
    match t {
        TensorMut::F32(x) => bytes_of_mut(x),
        TensorMut::Bf16(x) => bytes_of_mut(x),
        TensorMut::F16(x) => bytes_of_mut(x),
    }
}

/// A device buffer of one of the dtypes (for timing and tests).
pub enum Owned {
    F32(CudaSlice<f32>),
    Bf16(CudaSlice<bf16>),
    F16(CudaSlice<f16>),
}

/// A view of an [`Owned`] buffer.
pub enum OwnedView<'a> {
    F32(CudaView<'a, f32>),
    Bf16(CudaView<'a, bf16>),
    F16(CudaView<'a, f16>),
}

impl OwnedView<'_> {
    /// The view as a step input.
    pub fn tensor(&self) -> DeviceTensor<'_> {
        match self {
            OwnedView::F32(x) => DeviceTensor::F32(x),
            OwnedView::Bf16(x) => DeviceTensor::Bf16(x),
            OwnedView::F16(x) => DeviceTensor::F16(x),
        }
    }
}

impl Owned {
    /// `len` zeros of `dtype` on the device.
    pub fn zeros(s: &std::sync::Arc<CudaStream>, dtype: DType, len: usize) -> Result<Owned> {
        Ok(match dtype {
            DType::F32 => Owned::F32(s.alloc_zeros(len).map_err(drv)?),
            DType::Bf16 => Owned::Bf16(s.alloc_zeros(len).map_err(drv)?),
            DType::F16 => Owned::F16(s.alloc_zeros(len).map_err(drv)?),
        })
    }
    pub fn view(&self) -> OwnedView<'_> {
        match self {
            Owned::F32(x) => OwnedView::F32(x.as_view()),
            Owned::Bf16(x) => OwnedView::Bf16(x.as_view()),
            Owned::F16(x) => OwnedView::F16(x.as_view()),
        }
    }
    /// Runs `step` with the first `len` elements of this buffer as its output.
    pub fn step(&mut self, pool: &mut CudaPool, step: &DeviceStep<'_>, len: usize) -> Result<()> {
        self.step_with(pool, step, len, None, None)
    }

    fn step_with(
        &mut self,
        pool: &mut CudaPool,
        step: &DeviceStep<'_>,
        len: usize,
        accept: Option<sys::CUdeviceptr>,
        known: Option<Known>,
    ) -> Result<()> {
        match self {
            Owned::F32(x) => pool.step_device_with(
                step,
                &mut DeviceTensorMut::F32(&mut x.slice_mut(0..len)),
                accept,
                known,
            ),
            Owned::Bf16(x) => pool.step_device_with(
                step,
                &mut DeviceTensorMut::Bf16(&mut x.slice_mut(0..len)),
                accept,
                known,
            ),
            Owned::F16(x) => pool.step_device_with(
                step,
                &mut DeviceTensorMut::F16(&mut x.slice_mut(0..len)),
                accept,
                known,
            ),
        }
    }
}

/// Device-to-device copy bandwidth, bytes read plus written per second, median of events-timed rounds, with the
/// footprint of a state of `bytes` bytes read and written (as `gdn::Backend::copy_ceiling` asks): one half of
/// that footprint copied onto the other.
pub(crate) fn copy_ceiling(cuda: &Cuda, bytes: usize) -> Result<f64> {
    let n = (bytes / 8).max(256);
    let s = &cuda.stream;
    let src = s.alloc_zeros::<f32>(n).map_err(drv)?;
    let mut dst = s.alloc_zeros::<f32>(n).map_err(drv)?;
    for _ in 0..3 {
        s.memcpy_dtod(&src, &mut dst).map_err(drv)?;
    }
    let e0 = cuda
        .ctx
        .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
        .map_err(drv)?;
    let e1 = cuda
        .ctx
        .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
        .map_err(drv)?;
    let reps = 20;
    let mut rates = Vec::new();
    for _ in 0..7 {
        e0.record(s).map_err(drv)?;
        for _ in 0..reps {
            s.memcpy_dtod(&src, &mut dst).map_err(drv)?;
        }
        e1.record(s).map_err(drv)?;
        e1.synchronize().map_err(drv)?;
        let secs = e0.elapsed_ms(&e1).map_err(drv)? as f64 * 1e-3;
        rates.push(2.0 * (n * 4) as f64 * reps as f64 / secs);
    }
    rates.sort_by(|a, b| a.total_cmp(b));
    Ok(rates[rates.len() / 2])
}

/// The copy ceiling as a rotating benchmark meets it: `parts` pairs of buffers of `bytes` bytes each (a state
/// read and written per call), one pair copied per call, the pairs in turn, the copies captured in a CUDA graph
/// of whole passes and replayed as `time_varlen` replays steps; bytes read plus written per second, median.
/// With enough parts that they do not fit the L2, every copy reads from memory, and small copies pay what a
/// small step pays for its launch.
pub(crate) fn copy_ceiling_rotating(cuda: &Cuda, bytes: usize, parts: usize) -> Result<f64> {
    let n = (bytes / 4).max(64);
    let parts = parts.max(1);
    let s = &cuda.stream;
    let mut bufs = Vec::with_capacity(parts);
    for _ in 0..parts {
        bufs.push((
            s.alloc_zeros::<f32>(n).map_err(drv)?,
            s.alloc_zeros::<f32>(n).map_err(drv)?,
        ));
    }
    let per_graph = 20usize.next_multiple_of(parts);
    let pass = |bufs: &mut Vec<(CudaSlice<f32>, CudaSlice<f32>)>| -> Result<()> {
        for k in 0..per_graph {
            let (src, dst) = &mut bufs[k % parts];
            s.memcpy_dtod(&*src, dst).map_err(drv)?;
        }
        Ok(())
    };
    pass(&mut bufs)?;
    s.synchronize().map_err(drv)?;
    s.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(drv)?;
    let captured = pass(&mut bufs);
    let graph = s.end_capture(sys::CUgraphInstantiate_flags(0));
    captured?;
    let graph = graph
        .map_err(drv)?
        .ok_or_else(|| Error::Backend("graph capture produced no graph".into()))?;
    let secs = time_graph(cuda, &graph, per_graph)?;
    Ok(2.0 * (n * 4) as f64 / secs)
}

/// Seconds per captured node of `graph` (`per_graph` nodes): replayed 10 times a round after a warm-up,
/// events, median of 7 rounds.
fn time_graph(cuda: &Cuda, graph: &cudarc::driver::CudaGraph, per_graph: usize) -> Result<f64> {
    let s = &cuda.stream;
    graph.launch().map_err(drv)?;
    s.synchronize().map_err(drv)?;
    let ev = || {
        cuda.ctx
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(drv)
    };
    let (e0, e1) = (ev()?, ev()?);
    let replays = 10;
    let mut times = Vec::new();
    for _ in 0..7 {
        e0.record(s).map_err(drv)?;
        for _ in 0..replays {
            graph.launch().map_err(drv)?;
        }
        e1.record(s).map_err(drv)?;
        e1.synchronize().map_err(drv)?;
        let ms = e0.elapsed_ms(&e1).map_err(drv)? as f64;
        times.push(ms * 1e-3 / (replays * per_graph) as f64);
    }
    times.sort_by(|a, b| a.total_cmp(b));
    Ok(times[times.len() / 2])
}

/// The source of the empty kernel [`empty_kernel_time`] launches: it waits for the previous kernel (as the
/// step does, with programmatic dependent launch) and lets the next one start, nothing else.
const EMPTY_SRC: &str = "extern \"C\" __global__ void gdn_empty() {\n\
#if __CUDA_ARCH__ >= 900\n\
    asm volatile(\"griddepcontrol.wait;\" ::: \"memory\");\n\
    asm volatile(\"griddepcontrol.launch_dependents;\");\n\
#endif\n\
}\n";

/// Device time of one launch of an empty kernel of `blocks` blocks of `threads` threads, launched as the step is
/// (programmatic dependent launch where `cuda` has it on) and timed as `time_varlen` times a step (a CUDA graph
/// of 20 launches replayed, events, median): the floor under a step's graph-replay time on this machine.
pub fn empty_kernel_time(cuda: &Cuda, blocks: u32, threads: u32) -> Result<Duration> {
    let compiled = crate::spec::compiled_source(EMPTY_SRC, "gdn_empty.cu", cuda.arch)?;
    let module = cuda
        .ctx
        .load_module(cudarc::nvrtc::Ptx::from_binary(compiled.cubin.clone()))
        .map_err(drv)?;
    let f = module.load_function("gdn_empty").map_err(drv)?;
    let s = cuda.stream.clone();
    let per_graph = 20;
    let pass = || -> Result<()> {
        for _ in 0..per_graph {
            // SAFETY: the kernel takes no parameters and touches no memory; the stream is the backend's own.
            unsafe { launch_kernel(cuda, &f, (blocks, 1, 1), threads, &mut [], s.cu_stream())? };
        }
        Ok(())
    };
    pass()?;
    s.synchronize().map_err(drv)?;
    s.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(drv)?;
    let captured = pass();
    let graph = s.end_capture(sys::CUgraphInstantiate_flags(0));
    captured?;
    let graph = graph
        .map_err(drv)?
        .ok_or_else(|| Error::Backend("graph capture produced no graph".into()))?;
    Ok(Duration::from_secs_f64(time_graph(
        cuda, &graph, per_graph,
    )?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn staging_is_sized_per_call_and_released_above_the_cap() {
        // a first call allocates, rounded up to the grain
        let mut have = 0;
        let n = staging_alloc(have, 1000).unwrap();
        assert!(n >= 1000 && n.is_multiple_of(STAGING_GRAIN));
        have = n;
        // smaller and equal calls reuse it
        assert_eq!(staging_alloc(have, 10), None);
        assert_eq!(staging_alloc(have, have), None);
        // a larger call allocates anew, to its own size (not a growth factor of the old one)
        let big = staging_alloc(have, 3 * STAGING_KEEP).unwrap();
        assert!((3 * STAGING_KEEP..3 * STAGING_KEEP + STAGING_GRAIN).contains(&big));
        // ... which is released after that call, while a buffer up to the cap is kept
        assert!(!staging_keep(big));
        assert!(staging_keep(STAGING_KEEP));
        // so the next small call allocates a small one again
        let after = if staging_keep(big) { big } else { 0 };
        assert!(staging_alloc(after, 1000).unwrap() <= STAGING_GRAIN);
        // sizes near the top of the address space do not wrap
        assert!(staging_alloc(0, usize::MAX).is_some());
    }

    #[test]
    fn staging_layout_aligns_and_checks_overflow() {
        let (offs, end) = staging_layout(&[3, 0, 300, 4]).unwrap();
        assert_eq!(offs, vec![0, 256, 256, 768]);
        assert_eq!(end, 772);
        assert!(offs.iter().all(|o| o % STAGING_ALIGN == 0));
        assert!(staging_layout(&[usize::MAX - 10, 20]).is_none());
        assert!(staging_layout(&[1, usize::MAX]).is_none());
    }
}
