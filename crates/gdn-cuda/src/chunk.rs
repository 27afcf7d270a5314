//! The chunked (WY / UT) form of long windows (`kernels/gdn_chunk.cu`, NOTES.md "Chunked windows").
//!
//! A sequence whose window has at least [`CudaPool::chunk_min_len`] tokens runs in chunks of L tokens (unless it
//! commits after fewer than that many: then the whole window stays token-serial, so its committed state is
//! bitwise a k-token window's, which is token-serial too): the rank-1 updates of a chunk become small matrix
//! products, and only the chunk boundaries are sequential. The choice is per sequence, from its own length and
//! commit point only. The pool's launch (and [`crate::CudaLayer`]'s on engine memory, `GDN_EXT`) hands the call to
//! four kernels (plan, prep, state, out) and the token-serial kernel gets the short sequences (the long ones'
//! slots set to -1 in a copy of the slot array), so one call may mix both paths.
//!
//! Scratch ([`ChunkScratch`]): the pools of a backend share one (their steps run in order on its stream), its
//! `CudaLayer`s another (their steps run on engines' streams, in order by their contract). Sized for the call's
//! rows (floats: `rows x h_v x (5 d + L + 1)`; ints: the plan). The first call with more rows than reserved
//! allocates it, so a step captured into a graph needs [`CudaPool::reserve_chunk`] (or
//! [`crate::CudaLayer::reserve_chunk`]) first (with the rows and sequences of the largest call), as it needs
//! [`CudaPool::prepare`] for its kernels.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::{sys, CudaFunction, CudaSlice};
use gdn::{DType, Error, Gate, HeadMap, PoolOptions, Result, Shape, StateLayout};

use crate::external::ExtArgs;
use crate::pool::{int, ptr, ptr_mut, too_large, CudaPool, Operands, StepKind};
use crate::spec::{compiled_source, Compiled, Io};
use crate::{drv, Cuda};

/// The chunked kernels' source: macros select the specialisation (see the comment at its top).
pub const CHUNK_SRC: &str = include_str!("../kernels/gdn_chunk.cu");

/// Windows of at least this many tokens take the chunked path unless [`Cuda::set_chunk_min_len`] says
/// otherwise (NOTES.md: where the chunked path overtook the token-serial kernel on the H200).
pub const DEFAULT_CHUNK_MIN_LEN: usize = 64;

/// Largest dynamic shared memory a block may take on sm_90 (227 KiB).
const MAX_SMEM: usize = 227 * 1024;

fn dt_code(d: DType) -> u8 {
    match d {
        DType::F32 => 0,
        DType::Bf16 => 1,
        DType::F16 => 2,
    }
}

/// How the chunked path's tensor-core products round ([`Cuda::set_chunk_products`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ChunkProducts {
    /// 3xTF32 (each operand split into a TF32 high part and its remainder, three products): about f32's
    /// accuracy, within the conformance suite's 2e-6 of the float64 oracle. The default.
    #[default]
    Tf32x3,
    /// One TF32 product of the operands rounded to TF32 (10-bit mantissas): a third of the tensor-core work and
    /// none of the remainders' splits: y and the committed f32 state measured 3-5e-4 relative to the float64
    /// oracle, bound 5e-3 (FLA's and FlashInfer's bf16 products are ~1e-3 to 5e-3). Opt-in.
    Tf32,
}

/// Value columns a block of the narrow state kernel owns, and its blocks an SM (the kernel's launch bounds).
const NARROW_CB: usize = 16;
const NARROW_MINB: usize = 3;
/// Shared memory of one sm_90 multiprocessor (each block reserves 1 KiB of it).
const SM_SMEM: usize = 228 * 1024;

/// Everything the chunked kernels are specialised on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ChunkSpec {
    pub arch: (i32, i32),
    pub shape: Shape,
    pub silu: bool,
    pub grouped: bool,
    pub planes: bool,
    pub io: Io,
    pub pool: PoolOptions,
    pub products: ChunkProducts,
    /// Memory an engine owns (`GDN_EXT`, [`crate::CudaLayer`]): its conv state's element type; `None`: the pool's.
    pub ext: Option<DType>,
}

impl ChunkSpec {
    pub fn new(
        arch: (i32, i32),
        config: &gdn::Config,
        planes: bool,
        io: Io,
        pool: PoolOptions,
        products: ChunkProducts,
    ) -> ChunkSpec {
        ChunkSpec {
            arch,
            shape: config.shape,
            silu: config.gate == Gate::Silu,
            grouped: config.head_map == HeadMap::Grouped,
            planes,
            io,
            pool,
            products,
            ext: None,
        }
    }

    /// The specialisation for memory an engine owns, its conv state in `conv`.
    pub fn with_ext(self, conv: DType) -> ChunkSpec {
        ChunkSpec {
            ext: Some(conv),
            ..self
        }
    }

    /// Tokens a chunk (64; 32 above d 128, so the tiles fit shared memory).
    pub fn l(&self) -> usize {
        if self.shape.d <= 128 {
            64
        } else {
            32
        }
    }

    /// Value columns one state block owns.
    pub fn cb(&self) -> usize {
        if self.shape.d.is_multiple_of(32) {
            32
        } else {
            16
        }
    }

    /// Whether the module also holds `gdn_chunk_state_narrow` (16 columns a block, three blocks an SM): the
    /// 3xTF32 products only, wide blocks above 16 columns, three narrow blocks' shared memory within an SM's.
    pub fn has_narrow(&self) -> bool {
        self.products == ChunkProducts::Tf32x3
            && self.cb() > NARROW_CB
            && NARROW_MINB * (self.state_smem_for(NARROW_CB) + 1024) <= SM_SMEM
    }

    /// The state kernel for a call of at most `long` long windows on `sms` multiprocessors: the narrow one where
    /// its blocks are all resident at once (three an SM) and the busiest multiprocessor then owns fewer value
    /// columns than with the wide blocks (spread evenly). Measured at the seed's shape (H200, 2026-12-02): one
    /// window 3 x 16 columns against 2 x 32, 6% faster at 8192 and 32768 tokens; two windows (not one wave) 2.5%
    /// slower, four 9% slower (the narrow blocks read every operand tile twice as often). With the one-TF32 products
    /// the state kernel's tensor work is a third and the balance no longer pays (T 8192 even, T 32768 2% slower),
    /// so those calls keep the wide kernel (`has_narrow`). Both give the same bits.
    pub fn narrow_state(&self, long: usize, sms: usize) -> bool {
        let sms = sms.max(1);
        let blocks = |cb: usize| {
            long.saturating_mul(self.shape.h_v)
                .saturating_mul(self.shape.d / cb)
        };
        let busiest = |cb: usize| blocks(cb).div_ceil(sms).saturating_mul(cb);
        self.has_narrow()
            && blocks(NARROW_CB) <= NARROW_MINB.saturating_mul(sms)
            && busiest(NARROW_CB) < busiest(self.cb())
    }

    /// The state kernel a call of `rows` rows and `seqs` sequences takes (true: the narrow one): `narrow_state` of
    /// the host's bound on its long windows, `min(seqs, rows / min_len)`, every sequence counted (also those the
    /// device skips), so a prefill batched with many decodes keeps the wide kernel.
    pub fn narrow_for_call(&self, rows: usize, seqs: usize, min_len: usize, sms: usize) -> bool {
        self.narrow_state(caps(rows, seqs, min_len, self.l()).0, sms)
    }

    /// Dynamic shared memory of the prep kernel, bytes (the kernel's PREP_SMEM).
    pub fn prep_smem(&self) -> usize {
        let (d, l) = (self.shape.d, self.l());
        4 * (2 * l * (d + 4) + 2 * l * (l + 4) + 3 * l)
    }

    /// Dynamic shared memory of the state kernel, bytes (the kernel's STATE_SMEM).
    pub fn state_smem(&self) -> usize {
        self.state_smem_for(self.cb())
    }

    /// The same for `cb` columns a block (the narrow kernel's: `NARROW_CB`).
    pub fn state_smem_for(&self, cb: usize) -> usize {
        let (d, l) = (self.shape.d, self.l());
        4 * (2 * d * (cb + 2) + l * (cb + 2) + 3 * l)
    }

    /// Whether the chunked path holds this shape (its tiles fit shared memory); else every window stays
    /// token-serial.
    pub fn supported(&self) -> bool {
        self.prep_smem() <= MAX_SMEM && self.state_smem() <= MAX_SMEM
    }

    /// Threads of a `gdn_chunk_out` block (`GDN_NT_OUT`): 16 warps, a token each in turn (with 4, one chunk's
    /// block took ~40 us at L 64); 4 where 16 warps' rows of y (16 d floats) would pass 48 KB of static shared memory.
    pub fn out_threads(&self) -> u32 {
        if self.shape.d <= 256 {
            512
        } else {
            128
        }
    }

    /// Scratch floats per row of a call.
    pub fn floats_per_row(&self) -> usize {
        let s = &self.shape;
        s.h_v * (5 * s.d + self.l() + 1)
    }

    pub fn header(&self) -> String {
        let s = &self.shape;
        let ext = self.ext.map_or(String::new(), |c| {
            format!("#define GDN_EXT 1\n#define GDN_CONV_DT {}\n", dt_code(c))
        });
        ext + &format!(
            "#define GDN_D {}\n#define GDN_HK {}\n#define GDN_HV {}\n#define GDN_SILU {}\n#define GDN_GROUPED {}\n\
             #define GDN_PLANES {}\n#define GDN_QKV_DT {}\n#define GDN_ALPHA_DT {}\n#define GDN_BETA_DT {}\n\
             #define GDN_Z_DT {}\n#define GDN_OUT_DT {}\n#define GDN_STATE_DT {}\n#define GDN_VMAJOR {}\n\
             #define GDN_L {}\n#define GDN_CB {}\n#define GDN_TF32X1 {}\n#define GDN_NARROW {}\n#define GDN_NT_OUT {}\n",
            s.d,
            s.h_k,
            s.h_v,
            self.silu as u8,
            self.grouped as u8,
            self.planes as u8,
            dt_code(self.io.qkv),
            dt_code(self.io.alpha),
            dt_code(self.io.beta),
            dt_code(self.io.z),
            dt_code(self.io.out),
            dt_code(self.pool.state),
            (self.pool.layout == StateLayout::ValueMajor) as u8,
            self.l(),
            self.cb(),
            (self.products == ChunkProducts::Tf32) as u8,
            self.has_narrow() as u8,
            self.out_threads(),
        )
    }

    pub fn source(&self) -> String {
        format!("{}{}{}", self.header(), crate::spec::ELT_SRC, CHUNK_SRC)
    }

    /// The machine code (NVRTC, cached for the process); needs no GPU.
    pub fn compiled(&self) -> Result<Arc<Compiled>> {
        compiled_source(&self.source(), "gdn_chunk.cu", self.arch)
    }
}

/// The four loaded kernels of one specialisation.
pub(crate) struct ChunkFns {
    plan: CudaFunction,
    prep: CudaFunction,
    state: CudaFunction,
    /// `gdn_chunk_state_narrow` (see [`ChunkSpec::narrow_state`]), where the spec has it.
    narrow: Option<CudaFunction>,
    out: CudaFunction,
}

/// A scratch buffer and plan a captured graph may still use.
type Retired = (Option<CudaSlice<f32>>, Option<CudaSlice<i32>>);

/// The chunked path's scratch and loaded kernels: the one all [`CudaPool`]s of a backend share, or the one all
/// its [`crate::CudaLayer`]s share.
#[derive(Default)]
pub(crate) struct ChunkScratch {
    buf: Option<CudaSlice<f32>>,
    plan: Option<CudaSlice<i32>>,
    fns: HashMap<ChunkSpec, Arc<ChunkFns>>,
    /// A captured graph may hold the scratch's addresses (set by a capture that used it, until `release`): a
    /// buffer replaced by growth then stays alive in `retired`, so the graph's replays still find it.
    pub(crate) pinned: bool,
    retired: Vec<Retired>,
}

/// How many long sequences and chunks a call of `rows` rows and `seqs` sequences can hold (rows do not overlap).
fn caps(rows: usize, seqs: usize, min_len: usize, l: usize) -> (usize, usize) {
    let cap_long = seqs.min(rows / min_len.max(1)).max(1);
    (cap_long, rows / l + cap_long + 1)
}

/// Ints of the plan for a call of `seqs` sequences with these caps.
fn plan_ints(seqs: usize, cap_long: usize, cap_ent: usize) -> Result<usize> {
    cap_long
        .checked_mul(4)
        .and_then(|x| x.checked_add(cap_ent.checked_mul(2)?))
        .and_then(|x| x.checked_add(seqs.checked_add(2)?))
        .ok_or_else(|| too_large("seqs"))
}

/// Launches a kernel on `stream` without programmatic dependent launch (every chunked kernel reads what the one
/// before it wrote, so each waits for the previous one to finish).
///
/// # Safety
/// As [`crate::pool::launch_kernel`]: the parameters match the kernel's in order and type, each pointing to a
/// value that lives across the call, every device pointer valid for what the kernel indexes; `stream` is live
/// and of the backend's context.
unsafe fn launch(
    cuda: &Cuda,
    f: &CudaFunction,
    grid: (u32, u32),
    threads: u32,
    smem: usize,
    params: &mut [*mut c_void],
    stream: sys::CUstream,
) -> Result<()> {
    cuda.ctx.bind_to_thread().map_err(drv)?;
    // SAFETY: the caller's contract.
    let r = unsafe {
        sys::cuLaunchKernel(
            f.cu_function(),
            grid.0,
            grid.1,
            1,
            threads,
            1,
            1,
            smem as u32,
            stream,
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    };
    r.result().map_err(drv)
}

/// Whether `stream` is capturing a graph.
///
/// # Safety
/// `stream` is a live stream (or the null stream) of the current context.
pub(crate) unsafe fn capturing(stream: sys::CUstream) -> Result<bool> {
    let mut capture = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: the caller's contract for `stream`; the out-pointer is a live local.
    unsafe { sys::cuStreamIsCapturing(stream, &mut capture) }
        .result()
        .map_err(drv)?;
    Ok(capture != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

/// One call's memory as the chunked kernels take it: the pool's (`ext` None: packed rows, the private history at
/// `hist`) or an engine's (`ext`: strides and its conv state).
pub(crate) struct ChunkCall {
    pub n_seqs: usize,
    pub rows: usize,
    pub n_slots: i32,
    pub commits: bool,
    /// The shortest live window the caller knows of (else 1).
    pub lo: usize,
    /// The call's uniform-length hint (0: none): a live window of another length is skipped and reported.
    pub uniform: i32,
    pub plane: i64,
    pub eps: f32,
    pub qkv: u64,
    pub alpha: u64,
    pub beta: u64,
    pub z: u64,
    pub out: u64,
    /// Per-sequence device arrays (`start` may be cu_seqlens with `len` 0, or 0 with lengths alone: engine memory
    /// only; `commit` 0 with `commits`: every sequence commits its whole window).
    pub slot: u64,
    pub start: u64,
    pub len: u64,
    pub commit: u64,
    pub state: u64,
    pub hist: u64,
    /// conv_w, dt, a, gamma.
    pub weights: [u64; 4],
    pub fault: u64,
    pub ext: Option<ExtArgs>,
    pub stream: sys::CUstream,
}

impl ChunkScratch {
    /// Compiles (once a process) and loads (once) the kernels of `spec`.
    pub(crate) fn fns(&mut self, cuda: &Cuda, spec: &ChunkSpec) -> Result<Arc<ChunkFns>> {
        if let Some(f) = self.fns.get(spec) {
            return Ok(f.clone());
        }
        let compiled = spec.compiled()?;
        let module = cuda
            .ctx
            .load_module(cudarc::nvrtc::Ptx::from_binary(compiled.cubin.clone()))
            .map_err(drv)?;
        let load = |name: &str, smem: usize| -> Result<CudaFunction> {
            let f = module.load_function(name).map_err(drv)?;
            if smem > 48 * 1024 {
                f.set_attribute(
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    smem as i32,
                )
                .map_err(drv)?;
            }
            Ok(f)
        };
        let fns = Arc::new(ChunkFns {
            plan: load("gdn_chunk_plan", 0)?,
            prep: load("gdn_chunk_prep", spec.prep_smem())?,
            state: load("gdn_chunk_state", spec.state_smem())?,
            narrow: if spec.has_narrow() {
                Some(load(
                    "gdn_chunk_state_narrow",
                    spec.state_smem_for(NARROW_CB),
                )?)
            } else {
                None
            },
            out: load("gdn_chunk_out", 0)?,
        });
        self.fns.insert(*spec, fns.clone());
        Ok(fns)
    }

    /// Whether the scratch already holds a call of `rows` rows and `seqs` sequences of `spec`, its kernels loaded.
    pub(crate) fn holds(&self, spec: &ChunkSpec, rows: usize, seqs: usize, min_len: usize) -> bool {
        let (cap_long, cap_ent) = caps(rows, seqs, min_len, spec.l());
        let floats = rows.max(1).saturating_mul(spec.floats_per_row());
        self.fns.contains_key(spec)
            && self.buf.as_ref().is_some_and(|b| b.len() >= floats)
            && plan_ints(seqs, cap_long, cap_ent)
                .is_ok_and(|n| self.plan.as_ref().is_some_and(|p| p.len() >= n))
    }

    /// Grows the scratch (on the backend's stream) to hold a call of `rows` rows and `seqs` sequences.
    pub(crate) fn reserve(
        &mut self,
        cuda: &Cuda,
        spec: &ChunkSpec,
        rows: usize,
        seqs: usize,
        min_len: usize,
    ) -> Result<()> {
        let per_row = spec.floats_per_row();
        let floats = rows
            .max(1)
            .checked_mul(per_row)
            .ok_or_else(|| too_large("rows"))?;
        let (cap_long, cap_ent) = caps(rows, seqs, min_len, spec.l());
        let ints = plan_ints(seqs, cap_long, cap_ent)?;
        let grow_buf = self.buf.as_ref().map_or(0, |b| b.len()) < floats;
        let grow_plan = self.plan.as_ref().map_or(0, |b| b.len()) < ints;
        // a buffer a captured graph may use is kept alive (retired) when it is replaced, never freed
        if self.pinned && (grow_buf || grow_plan) {
            let buf = if grow_buf { self.buf.take() } else { None };
            let plan = if grow_plan { self.plan.take() } else { None };
            self.retired.push((buf, plan));
        }
        if grow_buf {
            self.buf = None;
            self.buf = Some(cuda.stream.alloc_zeros::<f32>(floats).map_err(drv)?);
        }
        if grow_plan {
            self.plan = None;
            self.plan = Some(cuda.stream.alloc_zeros::<i32>(ints).map_err(drv)?);
        }
        Ok(())
    }

    /// Frees the scratch (the next long window allocates it again).
    pub(crate) fn release(&mut self) {
        self.buf = None;
        self.plan = None;
        self.retired.clear();
        self.pinned = false;
    }

    /// Bytes held now.
    pub(crate) fn bytes(&self) -> usize {
        let held = |b: &Option<CudaSlice<f32>>, p: &Option<CudaSlice<i32>>| {
            b.as_ref().map_or(0, |b| b.len() * 4) + p.as_ref().map_or(0, |p| p.len() * 4)
        };
        held(&self.buf, &self.plan) + self.retired.iter().map(|(b, p)| held(b, p)).sum::<usize>()
    }

    /// Runs the call's long windows in chunks (the scratch must hold the call: [`ChunkScratch::reserve`]) and
    /// returns the slot array the token-serial kernel runs with (the long windows' slots skipped), or `None`
    /// when no sequence is left for it.
    ///
    /// # Safety
    /// Every address in `call` is device memory of the backend's context valid for what the kernels index: the
    /// rows for `call.rows` rows of the spec's dtypes and strides, the per-sequence arrays for `call.n_seqs`
    /// entries as `call` describes them, the state and history (or conv state) for `call.n_slots` slots, the
    /// weights the layer's, the output for its layout; `call.stream` is live and of that context.
    pub(crate) unsafe fn run(
        &mut self,
        cuda: &Cuda,
        spec: &ChunkSpec,
        min_len: usize,
        call: &ChunkCall,
    ) -> Result<Option<u64>> {
        let fns = self.fns(cuda, spec)?;
        if !self.holds(spec, call.rows, call.n_seqs, min_len) {
            return Err(Error::Backend("chunk scratch not reserved".into()));
        }
        let sh = spec.shape;
        let (cap_long, cap_ent) = caps(call.rows, call.n_seqs, min_len, spec.l());
        let grid_long = u32::try_from(cap_long)
            .ok()
            .filter(|&y| y <= 65535)
            .ok_or_else(|| too_large("seqs"))?;
        let grid_ent = u32::try_from(cap_ent)
            .ok()
            .filter(|&x| x < i32::MAX as u32)
            .ok_or_else(|| too_large("rows"))?;
        let mut n_seqs_i = int(call.n_seqs, "seqs")?;
        let mut n_slots = call.n_slots;
        let mut n_rows = int(call.rows, "rows")?;
        let mut min_len_i = int(min_len, "chunk_min_len")?;
        let mut uniform = call.uniform;
        let mut cap_long_i = int(cap_long, "seqs")?;
        let mut cap_ent_i = int(cap_ent, "rows")?;
        let mut commits = call.commits as i32;
        // rows the float scratch holds at this specialisation's floats per row
        let held = self.buf.as_ref().map_or(0, |b| b.len()) / spec.floats_per_row().max(1);
        let mut rc = i64::try_from(held).map_err(|_| too_large("rows"))?;
        let mut eps = call.eps;
        let mut plane = call.plane;
        let (mut p_slot, mut p_start, mut p_len, mut p_commit) =
            (call.slot, call.start, call.len, call.commit);
        let (mut p_qkv, mut p_alpha, mut p_beta, mut p_z, mut p_out) =
            (call.qkv, call.alpha, call.beta, call.z, call.out);
        let (mut p_fault, mut p_hist, mut p_state) = (call.fault, call.hist, call.state);
        let [mut p_conv, mut p_dt, mut p_a, mut p_gamma] = call.weights;
        let stream = call.stream;
        let mut p_plan = ptr_mut(
            self.plan
                .as_mut()
                .ok_or_else(|| Error::Backend("chunk plan missing".into()))?,
            cuda,
        );
        let mut p_scr = ptr_mut(
            self.buf
                .as_mut()
                .ok_or_else(|| Error::Backend("chunk scratch missing".into()))?,
            cuda,
        );
        let mut ext = call.ext;
        macro_rules! params {
            ($($x:ident),*) => {{
                let mut v: Vec<*mut c_void> = vec![$(&mut $x as *mut _ as *mut c_void),*];
                if let Some(e) = ext.as_mut() {
                    v.push(e as *mut ExtArgs as *mut c_void);
                }
                v
            }};
        }
        let mut p = vec![
            &mut p_slot as *mut _ as *mut c_void,
            &mut p_start as *mut _ as *mut c_void,
            &mut p_len as *mut _ as *mut c_void,
            &mut p_commit as *mut _ as *mut c_void,
            &mut commits as *mut _ as *mut c_void,
            &mut n_seqs_i as *mut _ as *mut c_void,
            &mut n_slots as *mut _ as *mut c_void,
            &mut n_rows as *mut _ as *mut c_void,
            &mut min_len_i as *mut _ as *mut c_void,
            &mut uniform as *mut _ as *mut c_void,
            &mut cap_long_i as *mut _ as *mut c_void,
            &mut cap_ent_i as *mut _ as *mut c_void,
            &mut p_plan as *mut _ as *mut c_void,
            &mut p_fault as *mut _ as *mut c_void,
        ];
        // SAFETY: gdn_chunk_plan(const int* x4, int commits, int n_seqs, int n_slots, int n_rows, int min_len,
        // int uniform, int cap_long, int cap_ent, int* plan, unsigned* fault): the per-sequence arrays as the caller states
        // (start may be cu_seqlens with len null, or null with lengths; commit_at is read only when commits is
        // set and is not null), the plan holds 2 + n_seqs + 4 cap_long + 2 cap_ent ints (`holds`), the fault
        // word is the caller's.
        unsafe { launch(cuda, &fns.plan, (1, 1), 1024, 0, &mut p, stream)? };
        let mut p = params!(
            p_qkv, p_alpha, p_beta, p_hist, p_conv, p_dt, p_a, p_plan, n_seqs_i, cap_long_i, eps,
            p_scr, rc
        );
        // SAFETY: gdn_chunk_prep(qkv, alpha, beta, hist, conv_w, dt, a, plan, int n_seqs, int cap_long, float
        // eps, float* scr, long long rc[, GdnExt ext]): the rows hold `rows` rows in the spec's dtypes and
        // strides (the caller's contract), the plan lists only sequences whose slot is in the pool and whose
        // rows are in 0..rows, the scratch holds rc >= rows rows (`holds`); the ExtArgs struct (with `ext`) is
        // the kernel's GdnExt field for field; dynamic shared memory as the kernel's PREP_SMEM.
        unsafe {
            launch(
                cuda,
                &fns.prep,
                (grid_ent, sh.h_v as u32),
                256,
                spec.prep_smem(),
                &mut p,
                stream,
            )?
        };
        let mut p = params!(p_state, p_hist, p_qkv, p_plan, n_seqs_i, cap_long_i, p_scr, rc);
        let (state_fn, cb) = match &fns.narrow {
            Some(f)
                if spec.narrow_for_call(
                    call.rows,
                    call.n_seqs,
                    min_len,
                    cuda.multiprocessors(),
                ) =>
            {
                (f, NARROW_CB)
            }
            _ => (&fns.state, spec.cb()),
        };
        // SAFETY: gdn_chunk_state / gdn_chunk_state_narrow(state, hist, qkv, plan, int n_seqs, int cap_long, float*
        // scr, long long rc[, GdnExt ext]): the state and history (or conv state), the rows and scratch as above;
        // STATE_SMEM bytes of shared memory for its column count, a block per (head, column block, long window).
        unsafe {
            launch(
                cuda,
                state_fn,
                ((sh.h_v * (sh.d / cb)) as u32, grid_long),
                256,
                spec.state_smem_for(cb),
                &mut p,
                stream,
            )?
        };
        let mut p =
            params!(p_z, p_gamma, p_out, plane, p_plan, n_seqs_i, cap_long_i, eps, p_scr, rc);
        // SAFETY: gdn_chunk_out(z, gamma, out, long long plane, plan, int n_seqs, int cap_long, float eps, const
        // float* scr, long long rc[, GdnExt ext]): z and the output hold `rows` rows in the spec's dtypes and
        // strides, the output layout of `plane` (the caller's contract); the scratch as above.
        unsafe {
            launch(
                cuda,
                &fns.out,
                (grid_ent, sh.h_v as u32),
                spec.out_threads(),
                0,
                &mut p,
                stream,
            )?
        };
        // every window chunked: nothing is left for the token-serial kernel, unless a commit point below
        // min_len keeps its window there (the plan kernel decides on the device)
        if call.lo >= min_len && !call.commits {
            return Ok(None);
        }
        Ok(Some(p_plan + 8))
    }
}

impl CudaPool {
    /// The window length from which a sequence takes the chunked path (the backend's setting when the pool
    /// was created, [`Cuda::set_chunk_min_len`], or [`DEFAULT_CHUNK_MIN_LEN`]).
    pub fn chunk_min_len(&self) -> usize {
        self.cuda.chunk_min_len()
    }

    /// Sets this pool's threshold (see [`Cuda::set_chunk_min_len`]; `None`: the default).
    pub fn set_chunk_min_len(&mut self, min_len: Option<usize>) {
        self.cuda.chunk_min_len = min_len;
    }

    /// The chunked kernels' specialisation for a step of this kind.
    pub fn chunk_spec(&self, kind: &StepKind) -> ChunkSpec {
        ChunkSpec::new(
            self.cuda.arch,
            &self.layer.config,
            kind.planes,
            kind.io,
            self.options,
            self.cuda.chunk_products,
        )
    }

    /// The chunked-path scratch this backend's pools share (a lock another thread's panic poisoned is taken
    /// over: every step leaves the scratch consistent before anything can panic).
    fn shared_chunk(shared: &Mutex<ChunkScratch>) -> MutexGuard<'_, ChunkScratch> {
        shared.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Allocates the chunked path's scratch for calls of up to `rows` rows and `seqs` sequences and compiles
    /// its kernels for `kind`, so that a later `step_device` (a graph capture) neither allocates nor compiles.
    /// The scratch is one for all pools of the backend (their steps run in order on its stream): it holds the
    /// largest call any of them reserved or ran.
    pub fn reserve_chunk(&mut self, kind: &StepKind, rows: usize, seqs: usize) -> Result<()> {
        let spec = self.chunk_spec(kind);
        if !spec.supported() {
            return Ok(());
        }
        let min_len = self.chunk_min_len();
        let mut scratch = Self::shared_chunk(&self.cuda.pool_chunk);
        scratch.fns(&self.cuda, &spec)?;
        scratch.reserve(&self.cuda, &spec, rows, seqs, min_len)
    }

    /// Frees the chunked-path scratch of this backend's pools (the next long window allocates it again). No
    /// graph that captured a chunked step of any of them may be replayed after this.
    pub fn release_chunk(&mut self) {
        Self::shared_chunk(&self.cuda.pool_chunk).release();
    }

    /// Bytes of chunked-path scratch this backend's pools hold now (shared by all of them).
    pub fn chunk_bytes(&self) -> usize {
        Self::shared_chunk(&self.cuda.pool_chunk).bytes()
    }

    /// The launch hook: runs the call's long windows in chunks and returns the operands the token-serial kernel
    /// runs with (the long windows' slots skipped), or `None` when no sequence is left for it.
    /// The shared scratch's lock goes to `held` when the call runs chunked: the slot array it returns lives in
    /// the scratch, so the lock must be held until the token-serial kernel that reads it is enqueued.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn chunk_dispatch<'a>(
        &mut self,
        kind: &StepKind,
        n_seqs: usize,
        rows: usize,
        plane_stride: Option<usize>,
        ops: Operands,
        shared: &'a Mutex<ChunkScratch>,
        held: &mut Option<MutexGuard<'a, ChunkScratch>>,
    ) -> Result<Option<Operands>> {
        let min_len = self.chunk_min_len();
        let (lo, hi) = ops.known.map_or((1, rows), |k| (k.lo, k.hi));
        if hi < min_len || rows < min_len {
            return Ok(Some(ops));
        }
        let spec = self.chunk_spec(kind);
        if !spec.supported() {
            return Ok(Some(ops));
        }
        let mut scratch = Self::shared_chunk(shared);
        scratch.fns(&self.cuda, &spec)?;
        // a graph captured now keeps the scratch's addresses: a later growth (by any pool) retires them instead
        // of freeing them
        // SAFETY: the backend's stream is live.
        if unsafe { capturing(self.cuda.stream.cu_stream()) }? {
            scratch.pinned = true;
        }
        scratch.reserve(&self.cuda, &spec, rows, n_seqs, min_len)?;
        let cuda = self.cuda.clone();
        let call = ChunkCall {
            n_seqs,
            rows,
            n_slots: int(self.slots, "slots")?,
            commits: kind.commits,
            lo,
            uniform: int(kind.uniform_len.unwrap_or(0), "uniform_len")?,
            plane: i64::try_from(plane_stride.unwrap_or(0)).map_err(|_| too_large("plane"))?,
            eps: self.layer.config.eps,
            qkv: ops.qkv,
            alpha: ops.alpha,
            beta: ops.beta,
            z: ops.z,
            out: ops.out,
            slot: ops.slot,
            start: ops.start,
            len: ops.len,
            commit: ops.commit_at,
            state: self.state.ptr_mut(&cuda),
            hist: ptr_mut(&mut self.hist, &cuda),
            weights: [
                ptr(&self.conv_w, &cuda),
                ptr(&self.dt, &cuda),
                ptr(&self.a, &cuda),
                ptr(&self.gamma, &cuda),
            ],
            fault: ptr_mut(&mut self.fault, &cuda),
            ext: None,
            stream: cuda.stream.cu_stream(),
        };
        // SAFETY: the pool's own state, history, weights and fault word, on its own stream; the rows, the
        // per-sequence arrays (start / len / commit_at, n_seqs each) and the output checked by the callers.
        let slot = unsafe { scratch.run(&cuda, &spec, min_len, &call)? };
        *held = Some(scratch);
        Ok(slot.map(|slot| Operands { slot, ..ops }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The caps hold every call whose rows do not overlap: at most rows / min_len long windows, and their
    /// chunks at most rows / L plus one a window.
    #[test]
    fn caps_hold_every_valid_call() {
        for (rows, seqs, min_len, l) in [
            (1, 1, 1, 64),
            (64, 1, 64, 64),
            (1000, 7, 64, 64),
            (32768, 4, 64, 64),
        ] {
            let (cap_long, cap_ent) = caps(rows, seqs, min_len, l);
            // the worst case: as many long windows as fit, each one token past a chunk boundary
            let n_long = seqs.min(rows / min_len).max(1);
            assert!(cap_long >= n_long);
            let per = rows / n_long;
            let chunks = n_long * per.div_ceil(l);
            assert!(cap_ent >= chunks, "{rows} {seqs}: {cap_ent} < {chunks}");
        }
    }

    /// Shared memory fits an SM for every head dim the token-serial kernel takes up to 256, and the kernels' sizes
    /// follow the source's formulas.
    #[test]
    fn tiles_fit_shared_memory() {
        for d in (16..=256).step_by(16) {
            let spec = ChunkSpec::new(
                (9, 0),
                &gdn::Config::new(Shape::new(d, 1, 2).unwrap()),
                false,
                Io::all(DType::F32),
                PoolOptions::default(),
                ChunkProducts::default(),
            );
            assert!(
                spec.supported(),
                "d {d}: {} / {}",
                spec.prep_smem(),
                spec.state_smem()
            );
            assert!(d.is_multiple_of(spec.cb()) && spec.l().is_multiple_of(16));
        }
        let seed = ChunkSpec::new(
            (9, 0),
            &gdn::Config::new(Shape::SEED),
            false,
            Io::all(DType::F32),
            PoolOptions::default(),
            ChunkProducts::default(),
        );
        assert_eq!((seed.l(), seed.cb()), (64, 32));
        // the formulas above are the kernel source's
        for def in ["DP4 (D + 4)", "LP4 (L + 4)", "CBP (CB + 2)"] {
            assert!(CHUNK_SRC.contains(&format!("#define {def}")), "{def}");
        }
        assert!(CHUNK_SRC.contains("#define PREP_SMEM (2 * L * DP4 + 2 * L * LP4 + 3 * L)"));
        assert!(CHUNK_SRC.contains("#define STATE_SMEM (2 * D * CBP + L * CBP + 3 * L)"));
        assert_eq!(seed.floats_per_row(), 48 * (5 * 128 + 64 + 1));
        // the narrow state kernel's launch bounds and columns are the constants the host plans with
        assert!(CHUNK_SRC.contains(&format!(
            "__launch_bounds__(NT_STATE, {NARROW_MINB}) gdn_chunk_state_narrow"
        )));
        assert!(CHUNK_SRC.contains(&format!("state_body<{NARROW_CB}>(STATE_ARGS)")));
    }

    /// The narrow state kernel takes the calls where it measured faster at the seed's shape on 132 SMs (one long
    /// window), the wide one from two windows; shapes whose wide blocks are already 16 columns have no narrow one.
    #[test]
    fn narrow_state_kernel_takes_the_calls_that_cannot_fill_the_device() {
        let spec = |shape| {
            ChunkSpec::new(
                (9, 0),
                &gdn::Config::new(shape),
                false,
                Io::all(DType::F32),
                PoolOptions::default(),
                ChunkProducts::default(),
            )
        };
        let seed = spec(Shape::SEED);
        assert!(seed.narrow_state(1, 132));
        for long in [2, 3, 4, 64] {
            assert!(!seed.narrow_state(long, 132), "{long}");
        }
        // d 48: 16-column blocks already
        assert!(!spec(Shape::new(48, 2, 4).unwrap()).has_narrow());
        // a device with twice the multiprocessors fits the wide blocks of one window in equal shares
        assert!(!seed.narrow_state(1, 264));
        // the one-TF32 products keep the wide kernel
        let fast = ChunkSpec {
            products: ChunkProducts::Tf32,
            ..seed
        };
        assert!(!fast.narrow_state(1, 132));
    }
}
