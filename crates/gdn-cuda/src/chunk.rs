//! The chunked (WY / UT) form of long windows (`kernels/gdn_chunk.cu`, NOTES.md "Chunked windows").
//!
//! A sequence whose window has at least [`CudaPool::chunk_min_len`] tokens runs in chunks of L tokens (unless it
//! commits after fewer than that many: then the whole window stays token-serial, so its committed state is
//! bitwise a k-token window's, which is token-serial too): the rank-1 updates of a chunk become small matrix
//! products, and only the chunk boundaries are sequential. The choice is per sequence, from its own length and
//! commit point only. The pool's launch hands the call to four kernels (plan,
//! prep, state, out) and the token-serial kernel gets the short sequences (the long ones' slots set to -1 in a
//! copy of the slot array), so one call may mix both paths.
//!
//! Scratch: the pool owns it, sized for the call's rows (floats: `rows x h_v x (5 d + L + 1)`; ints: the plan).
//! The first call with more rows than reserved allocates it, so a step captured into a graph needs
//! [`CudaPool::reserve_chunk`] first (with the rows and sequences of the largest call), as it needs
//! [`CudaPool::prepare`] for its kernels.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{sys, CudaFunction, CudaSlice};
use gdn::{DType, Error, Gate, HeadMap, PoolOptions, Result, Shape, StateLayout};

use crate::pool::{int, ptr, ptr_mut, too_large, CudaPool, Operands, StateBuf, StepKind};
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

    /// Dynamic shared memory of the prep kernel, bytes (the kernel's PREP_SMEM).
    pub fn prep_smem(&self) -> usize {
        let (d, l) = (self.shape.d, self.l());
        4 * (2 * l * (d + 4) + 2 * l * (l + 4) + 3 * l)
    }

    /// Dynamic shared memory of the state kernel, bytes (the kernel's STATE_SMEM).
    pub fn state_smem(&self) -> usize {
        let (d, l, cb) = (self.shape.d, self.l(), self.cb());
        4 * (2 * d * (cb + 2) + l * (cb + 2) + 3 * l)
    }

    /// Whether the chunked path holds this shape (its tiles fit shared memory); else every window stays
    /// token-serial.
    pub fn supported(&self) -> bool {
        self.prep_smem() <= MAX_SMEM && self.state_smem() <= MAX_SMEM
    }

    /// Scratch floats per row of a call.
    pub fn floats_per_row(&self) -> usize {
        let s = &self.shape;
        s.h_v * (5 * s.d + self.l() + 1)
    }

    pub fn header(&self) -> String {
        let s = &self.shape;
        format!(
            "#define GDN_D {}\n#define GDN_HK {}\n#define GDN_HV {}\n#define GDN_SILU {}\n#define GDN_GROUPED {}\n\
             #define GDN_PLANES {}\n#define GDN_QKV_DT {}\n#define GDN_ALPHA_DT {}\n#define GDN_BETA_DT {}\n\
             #define GDN_Z_DT {}\n#define GDN_OUT_DT {}\n#define GDN_STATE_DT {}\n#define GDN_VMAJOR {}\n\
             #define GDN_L {}\n#define GDN_CB {}\n#define GDN_TF32X1 {}\n",
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
    out: CudaFunction,
}

/// The pool's chunked-path scratch and loaded kernels.
#[derive(Default)]
pub(crate) struct ChunkScratch {
    buf: Option<CudaSlice<f32>>,
    /// Rows the float scratch holds, at its specialisation's floats per row.
    rows: usize,
    plan: Option<CudaSlice<i32>>,
    fns: HashMap<ChunkSpec, Arc<ChunkFns>>,
}

/// How many long sequences and chunks a call of `rows` rows and `seqs` sequences can hold (rows do not overlap).
fn caps(rows: usize, seqs: usize, min_len: usize, l: usize) -> (usize, usize) {
    let cap_long = seqs.min(rows / min_len.max(1)).max(1);
    (cap_long, rows / l + cap_long + 1)
}

/// Launches a kernel without programmatic dependent launch (every chunked kernel reads what the one before
/// it wrote, so each waits for the previous one to finish).
///
/// # Safety
/// As [`crate::pool::launch_kernel`]: the parameters match the kernel's in order and type, each pointing to a
/// value that lives across the call, every device pointer valid for what the kernel indexes.
unsafe fn launch(
    cuda: &Cuda,
    f: &CudaFunction,
    grid: (u32, u32),
    threads: u32,
    smem: usize,
    params: &mut [*mut c_void],
) -> Result<()> {
    cuda.ctx.bind_to_thread().map_err(drv)?;
    // SAFETY: the caller's contract; the stream is the backend's own.
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
            cuda.stream.cu_stream(),
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    };
    r.result().map_err(drv)
}

impl CudaPool {
    /// The window length from which a sequence takes the chunked path (the backend's setting when the pool
    /// was created, [`Cuda::set_chunk_min_len`], or [`DEFAULT_CHUNK_MIN_LEN`]).
    pub fn chunk_min_len(&self) -> usize {
        self.cuda
            .chunk_min_len
            .unwrap_or(DEFAULT_CHUNK_MIN_LEN)
            .max(1)
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

    /// Allocates the chunked path's scratch for calls of up to `rows` rows and `seqs` sequences and compiles
    /// its kernels for `kind`, so that a later `step_device` (a graph capture) neither allocates nor compiles.
    pub fn reserve_chunk(&mut self, kind: &StepKind, rows: usize, seqs: usize) -> Result<()> {
        let spec = self.chunk_spec(kind);
        if !spec.supported() {
            return Ok(());
        }
        self.chunk_fns(&spec)?;
        self.chunk_scratch(&spec, rows, seqs)
    }

    /// Frees the chunked path's scratch (the next long window allocates it again).
    pub fn release_chunk(&mut self) {
        self.chunk.buf = None;
        self.chunk.rows = 0;
        self.chunk.plan = None;
    }

    /// Bytes of chunked-path scratch held now.
    pub fn chunk_bytes(&self) -> usize {
        self.chunk.buf.as_ref().map_or(0, |b| b.len() * 4)
            + self.chunk.plan.as_ref().map_or(0, |b| b.len() * 4)
    }

    fn chunk_fns(&mut self, spec: &ChunkSpec) -> Result<Arc<ChunkFns>> {
        if let Some(f) = self.chunk.fns.get(spec) {
            return Ok(f.clone());
        }
        let compiled = spec.compiled()?;
        let module = self
            .cuda
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
            out: load("gdn_chunk_out", 0)?,
        });
        self.chunk.fns.insert(*spec, fns.clone());
        Ok(fns)
    }

    fn chunk_scratch(&mut self, spec: &ChunkSpec, rows: usize, seqs: usize) -> Result<()> {
        let per_row = spec.floats_per_row();
        let floats = rows
            .max(1)
            .checked_mul(per_row)
            .ok_or_else(|| too_large("rows"))?;
        let have = self.chunk.buf.as_ref().map_or(0, |b| b.len());
        if have < floats || self.chunk.rows < rows {
            self.chunk.buf = None;
            self.chunk.buf = Some(self.cuda.stream.alloc_zeros::<f32>(floats).map_err(drv)?);
        }
        self.chunk.rows = self.chunk.buf.as_ref().map_or(0, |b| b.len()) / per_row.max(1);
        let (cap_long, cap_ent) = caps(rows, seqs, self.chunk_min_len(), spec.l());
        let ints = cap_long
            .checked_mul(4)
            .and_then(|x| x.checked_add(cap_ent.checked_mul(2)?))
            .and_then(|x| x.checked_add(seqs.checked_add(2)?))
            .ok_or_else(|| too_large("seqs"))?;
        if self.chunk.plan.as_ref().map_or(0, |b| b.len()) < ints {
            self.chunk.plan = None;
            self.chunk.plan = Some(self.cuda.stream.alloc_zeros::<i32>(ints).map_err(drv)?);
        }
        Ok(())
    }

    /// The launch hook: runs the call's long windows in chunks and returns the operands the token-serial kernel
    /// runs with (the long windows' slots skipped), or `None` when no sequence is left for it.
    pub(crate) fn chunk_dispatch(
        &mut self,
        kind: &StepKind,
        n_seqs: usize,
        rows: usize,
        plane_stride: Option<usize>,
        ops: Operands,
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
        let fns = self.chunk_fns(&spec)?;
        self.chunk_scratch(&spec, rows, n_seqs)?;
        let sh = *self.layer.shape();
        let (cap_long, cap_ent) = caps(rows, n_seqs, min_len, spec.l());
        let grid_long = u32::try_from(cap_long)
            .ok()
            .filter(|&y| y <= 65535)
            .ok_or_else(|| too_large("seqs"))?;
        let grid_ent = u32::try_from(cap_ent)
            .ok()
            .filter(|&x| x < i32::MAX as u32)
            .ok_or_else(|| too_large("rows"))?;
        let mut n_seqs_i = int(n_seqs, "seqs")?;
        let mut n_slots = int(self.slots, "slots")?;
        let mut n_rows = int(rows, "rows")?;
        let mut min_len_i = int(min_len, "chunk_min_len")?;
        let mut cap_long_i = int(cap_long, "seqs")?;
        let mut cap_ent_i = int(cap_ent, "rows")?;
        let mut commits = kind.commits as i32;
        let mut rc = i64::try_from(self.chunk.rows).map_err(|_| too_large("rows"))?;
        let mut eps = self.layer.config.eps;
        let mut plane = i64::try_from(plane_stride.unwrap_or(0)).map_err(|_| too_large("plane"))?;
        let cuda = self.cuda.clone();
        let (mut p_slot, mut p_start, mut p_len, mut p_commit) =
            (ops.slot, ops.start, ops.len, ops.commit_at);
        let (mut p_qkv, mut p_alpha, mut p_beta, mut p_z, mut p_out) =
            (ops.qkv, ops.alpha, ops.beta, ops.z, ops.out);
        let mut p_fault = ptr_mut(&mut self.fault, &cuda);
        let mut p_hist = ptr_mut(&mut self.hist, &cuda);
        let mut p_conv = ptr(&self.conv_w, &cuda);
        let mut p_dt = ptr(&self.dt, &cuda);
        let mut p_a = ptr(&self.a, &cuda);
        let mut p_gamma = ptr(&self.gamma, &cuda);
        let mut p_state = match &mut self.state {
            StateBuf::F32(s) => ptr_mut(s, &cuda),
            StateBuf::Bf16(s) => ptr_mut(s, &cuda),
        };
        let mut p_plan = ptr_mut(
            self.chunk
                .plan
                .as_mut()
                .ok_or_else(|| Error::Backend("chunk plan missing".into()))?,
            &cuda,
        );
        let mut p_scr = ptr_mut(
            self.chunk
                .buf
                .as_mut()
                .ok_or_else(|| Error::Backend("chunk scratch missing".into()))?,
            &cuda,
        );
        macro_rules! params {
            ($($x:ident),*) => { vec![$(&mut $x as *mut _ as *mut c_void),*] };
        }
        let mut p = params!(
            p_slot, p_start, p_len, p_commit, commits, n_seqs_i, n_slots, n_rows, min_len_i,
            cap_long_i, cap_ent_i, p_plan, p_fault
        );
        // SAFETY: gdn_chunk_plan(const int* x4, int commits, int n_seqs, int n_slots, int n_rows, int min_len,
        // int cap_long, int cap_ent, int* plan, unsigned* fault): the four per-sequence arrays hold n_seqs
        // entries (checked by the callers; commit_at is read only when commits is set), the plan holds
        // 2 + n_seqs + 4 cap_long + 2 cap_ent ints (chunk_scratch), the fault word is the pool's.
        unsafe { launch(&cuda, &fns.plan, (1, 1), 1024, 0, &mut p)? };
        let mut p = params!(
            p_qkv, p_alpha, p_beta, p_hist, p_conv, p_dt, p_a, p_plan, n_seqs_i, cap_long_i, eps,
            p_scr, rc
        );
        // SAFETY: gdn_chunk_prep(qkv, alpha, beta, hist, conv_w, dt, a, plan, int n_seqs, int cap_long, float
        // eps, float* scr, long long rc): the rows hold `rows` rows in the spec's dtypes (checked by the
        // callers), the plan lists only sequences whose slot is in the pool and whose rows are in 0..rows, the
        // scratch holds rc >= rows rows (chunk_scratch); dynamic shared memory as the kernel's PREP_SMEM.
        unsafe {
            launch(
                &cuda,
                &fns.prep,
                (grid_ent, sh.h_v as u32),
                256,
                spec.prep_smem(),
                &mut p,
            )?
        };
        let mut p = params!(p_state, p_hist, p_qkv, p_plan, n_seqs_i, cap_long_i, p_scr, rc);
        // SAFETY: gdn_chunk_state(state, hist, qkv, plan, int n_seqs, int cap_long, float* scr, long long
        // rc): the pool's state and history, the rows and scratch as above; STATE_SMEM bytes of shared memory.
        unsafe {
            launch(
                &cuda,
                &fns.state,
                ((sh.h_v * (sh.d / spec.cb())) as u32, grid_long),
                256,
                spec.state_smem(),
                &mut p,
            )?
        };
        let mut p =
            params!(p_z, p_gamma, p_out, plane, p_plan, n_seqs_i, cap_long_i, eps, p_scr, rc);
        // SAFETY: gdn_chunk_out(z, gamma, out, long long plane, plan, int n_seqs, int cap_long, float eps, const
        // float* scr, long long rc): z and the output hold `rows` rows in the spec's dtypes and the output
        // layout of plane_stride (checked by the callers); the scratch as above.
        unsafe { launch(&cuda, &fns.out, (grid_ent, sh.h_v as u32), 128, 0, &mut p)? };
        // every window chunked: nothing is left for the token-serial kernel, unless a commit point below
        // min_len keeps its window there (the plan kernel decides on the device)
        if lo >= min_len && !kind.commits {
            return Ok(None);
        }
        Ok(Some(Operands {
            slot: p_plan + 8,
            ..ops
        }))
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
    }
}
