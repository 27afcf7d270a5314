//! gdn-cuda: the CUDA backend of gdn. A varlen step (SPEC.md: packed rows, one entry per sequence with its own
//! length and commit, activations and outputs in f32/bf16/f16, an f32 or bf16 state in key-major or value-major
//! layout) runs as one kernel launch, compiled by NVRTC at first use for the device's own architecture and
//! specialised on the shape, the window length, the conventions, the planes, the commit kind, the dtypes, the
//! pool's state and the launch split (see [`spec`]). The state pool lives on the device;
//! [`CudaPool::step_device`] takes inputs already there and can be captured into a CUDA graph.
//!
//! [`CudaLayer::step_raw`] runs the same step on memory an engine owns (its state pool, its `[slot][C][w]` conv
//! state, strided rows, cu_seqlens) on the engine's stream; see [`external`] for the design and how the
//! shared q/k history stays race-free.
//!
//! The pool runs the speculative step natively ([`gdn::LayerPool::step_spec`], `held`, `commit_held`: a held
//! window's per-token updates kept on the device, the accepted prefix applied as the next window first reads
//! the state; one state read and one write per step, bitwise the two-pass flow); [`CudaPool::time_spec`] times
//! its kernel. Held windows of at most [`pool::MAX_HELD`] tokens.
//!
//! With no driver, no GPU or no libnvrtc, [`Cuda::new`] returns [`gdn::Error::Unavailable`]. The library
//! reads no environment variables.
//!
//! The device-native step, inputs already on the device (a decode step of 4 sequences at the seed shape, bf16
//! activations, an f32 output):
//!
//! ```no_run
//! use gdn::{bf16, Config, OutputLayout, Shape};
//! use gdn_cuda::{Cuda, DeviceStep, DeviceTensor, DeviceTensorMut, StepKind, spec::Io};
//!
//! # fn main() -> gdn::Result<()> {
//! let cuda = Cuda::new()?;
//! let layer = gdn::synth::Synth::new(1).layer(Config::new(Shape::SEED))?;
//! let mut pool = cuda.create_cuda_pool(&layer, 16, gdn::PoolOptions::default())?;
//! let rows = 4; // one token each
//! let sh = Shape::SEED;
//! let s = cuda.stream();
//! let drv = |e| gdn::Error::Backend(format!("{e:?}"));
//! let qkv = s.alloc_zeros::<bf16>(rows * sh.channels()).map_err(drv)?;
//! let alpha = s.alloc_zeros::<bf16>(rows * sh.h_v).map_err(drv)?;
//! let beta = s.alloc_zeros::<bf16>(rows * sh.h_v).map_err(drv)?;
//! let z = s.alloc_zeros::<bf16>(rows * sh.n()).map_err(drv)?;
//! let slot = s.clone_htod(&[3i32, 0, 7, -1]).map_err(drv)?; // the last sequence is skipped
//! let start = s.clone_htod(&[0i32, 1, 2, 3]).map_err(drv)?;
//! let len = s.clone_htod(&[1i32; 4]).map_err(drv)?;
//! let commit_at = s.clone_htod(&[1i32, 1, 0, 0]).map_err(drv)?; // the third only verifies
//! let mut out = s.alloc_zeros::<f32>(OutputLayout::for_rows(&sh, rows, None)?.len()).map_err(drv)?;
//! let (qkv, alpha, beta, z) = (qkv.as_view(), alpha.as_view(), beta.as_view(), z.as_view());
//! let (slot, start, len, commit_at) = (slot.as_view(), start.as_view(), len.as_view(), commit_at.as_view());
//! let step = DeviceStep {
//!     rows,
//!     qkv: DeviceTensor::Bf16(&qkv),
//!     alpha: DeviceTensor::Bf16(&alpha),
//!     beta: DeviceTensor::Bf16(&beta),
//!     z: DeviceTensor::Bf16(&z),
//!     slot: &slot,
//!     start: &start,
//!     len: &len,
//!     commit_at: &commit_at,
//!     uniform_len: Some(1),
//!     commits: true,
//!     plane_stride: None,
//! };
//! // compile before a graph capture
//! pool.prepare(&StepKind { uniform_len: Some(1), commits: true, planes: false,
//!     io: Io::new([gdn::DType::Bf16; 4], gdn::DType::F32), seqs: 4 })?;
//! pool.step_device(&step, &mut DeviceTensorMut::F32(&mut out.as_view_mut()))?; // no allocation, no sync
//! # Ok(())
//! # }
//! ```

pub mod chunk;
pub mod external;
pub mod pool;
pub mod quant;

/// The cudarc this crate is built on (an engine on cudarc passes its streams and device addresses).
pub use cudarc;
pub mod spec;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::{sys, CudaContext, CudaFunction, CudaStream, DriverError};
use gdn::{Backend, Error, Layer, LayerPool, Result};

pub use external::{
    pending_bytes, pending_row_bytes, CudaLayer, ExternalKind, RawConv, RawSpec, RawState, RawStep,
    RawTensor, SeqRows,
};
pub use pool::{empty_kernel_time, CudaPool, DeviceStep, DeviceTensor, DeviceTensorMut, StepKind};
pub use quant::{CudaBf16OutProj, CudaOutProj};
pub use spec::{Io, Plan, Spec, Tune};

pub(crate) fn drv(e: DriverError) -> Error {
    Error::Backend(format!("CUDA driver: {e:?}"))
}

/// Whether the CUDA driver library can be loaded on this machine.
pub fn driver_present() -> bool {
    // SAFETY: only tries to open the library by its candidate names; no symbol is called.
    unsafe { sys::is_culib_present() }
}

/// Loaded kernels of one context, by specialisation.
pub(crate) type FunctionCache = Arc<Mutex<HashMap<Spec, CudaFunction>>>;

/// The CUDA backend on one device.
#[derive(Clone)]
pub struct Cuda {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    pub(crate) arch: (i32, i32),
    pub(crate) sms: usize,
    pub(crate) functions: FunctionCache,
    /// A fixed plan instead of the planner's choice (benchmark sweeps, [`Cuda::set_plan_override`]).
    pub(crate) plan_override: Option<Plan>,
    /// Launch with programmatic dependent launch (the default; [`Cuda::set_pdl`]).
    pub(crate) pdl: bool,
    /// Fixed memory hints instead of the planner's (benchmark sweeps, [`Cuda::set_tune_override`]).
    pub(crate) tune_override: Option<spec::Tune>,
    /// Windows of at least this many tokens take the chunked path (`None`: [`chunk::DEFAULT_CHUNK_MIN_LEN`];
    /// [`Cuda::set_chunk_min_len`]).
    pub(crate) chunk_min_len: Option<usize>,
    /// The chunked path's products ([`Cuda::set_chunk_products`]; 3xTF32 by default).
    pub(crate) chunk_products: chunk::ChunkProducts,
    /// The chunked path's scratch and kernels for every [`CudaLayer`] of this backend (their long-window steps
    /// are ordered, so they share it; see [`CudaLayer::reserve_chunk`]).
    pub(crate) ext_chunk: Arc<std::sync::Mutex<chunk::ChunkScratch>>,
    /// The same for every [`CudaPool`] of this backend (all on its one stream, so their steps are ordered; see
    /// [`CudaPool::reserve_chunk`]). Apart from the layers', whose steps run on engines' streams.
    pub(crate) pool_chunk: Arc<std::sync::Mutex<chunk::ChunkScratch>>,
    /// Windows in [`spec::window_range`] run in the window kernel ([`Cuda::set_window_kernel`]; off by default).
    pub(crate) window: bool,
}

impl Cuda {
    /// The backend on device 0.
    pub fn new() -> Result<Cuda> {
        Cuda::with_device(0)
    }

    /// The backend on device `ordinal`.
    pub fn with_device(ordinal: usize) -> Result<Cuda> {
        if !driver_present() {
            return Err(Error::Unavailable(
                "the CUDA driver library (libcuda) is not installed".into(),
            ));
        }
        let mut version: std::ffi::c_int = 0;
        // SAFETY: libcuda is loadable (checked above); cuDriverGetVersion needs no cuInit and only writes through
        // its out-pointer, a live local.
        let r = unsafe { sys::cuDriverGetVersion(&mut version) };
        if r != sys::cudaError_enum::CUDA_SUCCESS || version < 13000 {
            // cudarc's bindings are CUDA 13.0's: an older driver may lack symbols it loads (a panic), so stop here
            return Err(Error::Unavailable(format!(
                "the CUDA driver supports CUDA {}.{}, this backend needs 13.0 or newer ({r:?})",
                version / 1000,
                version % 1000 / 10
            )));
        }
        if !spec::nvrtc_present() {
            return Err(Error::Unavailable(
                "libnvrtc (CUDA 13) not found: install nvidia-cuda-nvrtc and put its lib folder on LD_LIBRARY_PATH"
                    .into(),
            ));
        }
        let count = CudaContext::device_count()
            .map_err(|e| Error::Unavailable(format!("no CUDA device: {e:?}")))?;
        if ordinal >= count.max(0) as usize {
            return Err(Error::Unavailable(format!(
                "CUDA device {ordinal} asked for, {count} present"
            )));
        }
        let ctx = CudaContext::new(ordinal)
            .map_err(|e| Error::Unavailable(format!("CUDA device {ordinal}: {e:?}")))?;
        // SAFETY: this backend orders all its work on one stream of its own, so cudarc's cross-stream event
        // tracking is not needed; turning it off keeps launches free of event records and graph-capturable.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(drv)?;
        let arch = ctx.compute_capability().map_err(drv)?;
        let sms = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(drv)? as usize;
        if arch.0 < 9 {
            return Err(Error::Unavailable(format!(
                "the CUDA backend needs thread-block clusters (sm_90 or newer); device {ordinal} is sm_{}{}",
                arch.0, arch.1
            )));
        }
        Ok(Cuda {
            ctx,
            stream,
            arch,
            sms,
            functions: Arc::new(Mutex::new(HashMap::new())),
            plan_override: None,
            pdl: true,
            tune_override: None,
            chunk_min_len: None,
            chunk_products: chunk::ChunkProducts::default(),
            ext_chunk: Default::default(),
            pool_chunk: Default::default(),
            window: false,
        })
    }

    /// The device's compute capability.
    pub fn arch(&self) -> (i32, i32) {
        self.arch
    }

    /// The device's multiprocessor count.
    pub fn multiprocessors(&self) -> usize {
        self.sms
    }

    /// The stream all of this backend's work runs on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// A pool with the concrete type, for the device-native API.
    pub fn create_cuda_pool(
        &self,
        layer: &Layer,
        slots: usize,
        options: gdn::PoolOptions,
    ) -> Result<CudaPool> {
        CudaPool::new(self.clone(), layer, slots, options)
    }

    /// Turns programmatic dependent launch on or off for launches from now on.
    pub fn set_pdl(&mut self, on: bool) {
        self.pdl = on;
    }

    /// Sets (or with `None` clears) a fixed launch plan for pools created afterwards.
    pub fn set_plan_override(&mut self, plan: Option<Plan>) {
        self.plan_override = plan;
    }

    /// Sets (or with `None` restores the measured default, [`chunk::DEFAULT_CHUNK_MIN_LEN`]) the window length
    /// from which a sequence takes the chunked path, for pools and `CudaLayer`s created afterwards (`usize::MAX`:
    /// never). The
    /// choice is per sequence, from its own length only, so a sequence's bits do not depend on its batch.
    pub fn set_chunk_min_len(&mut self, min_len: Option<usize>) {
        self.chunk_min_len = min_len;
    }

    /// Frees the chunked-path scratch that this backend's [`CudaLayer`]s share (and the older buffers kept for
    /// captured graphs), after waiting for the context; the next long window allocates it again. No graph that
    /// captured a chunked step of these layers may be replayed after this.
    pub fn release_chunk_scratch(&self) -> Result<()> {
        // locked first, so that no step enqueues on the buffers between the wait and the free
        let mut scratch = self
            .ext_chunk
            .lock()
            .map_err(|_| Error::Backend("chunk scratch lock poisoned".into()))?;
        self.ctx.synchronize().map_err(drv)?;
        scratch.release();
        Ok(())
    }

    /// Bytes of chunked-path scratch this backend's [`CudaLayer`]s hold now.
    pub fn chunk_scratch_bytes(&self) -> Result<usize> {
        Ok(self
            .ext_chunk
            .lock()
            .map_err(|_| Error::Backend("chunk scratch lock poisoned".into()))?
            .bytes())
    }

    /// The window length from which a sequence takes the chunked path ([`Cuda::set_chunk_min_len`], or
    /// [`chunk::DEFAULT_CHUNK_MIN_LEN`]).
    pub fn chunk_min_len(&self) -> usize {
        self.chunk_min_len
            .unwrap_or(chunk::DEFAULT_CHUNK_MIN_LEN)
            .max(1)
    }

    /// Sets how the chunked path's tensor-core products round, for pools created afterwards:
    /// [`chunk::ChunkProducts::Tf32x3`] (the default, about f32's accuracy) or the faster, opt-in
    /// [`chunk::ChunkProducts::Tf32`] (3-5e-4 relative measured, bound 5e-3). Every invariant of the chunked path holds within
    /// either; their bits differ.
    pub fn set_chunk_products(&mut self, products: chunk::ChunkProducts) {
        self.chunk_products = products;
    }

    /// Runs the windows whose effective length (commit point, or length without one) is in
    /// [`spec::window_range`] in the window kernel, eight tokens at a time in the chunked form, or every window
    /// token after token like one-token steps (`false`, the default), in pools created afterwards. Bits differ between the two; within either, a sequence's bits depend only on its
    /// own inputs. The speculative step (`step_spec`) runs on the token-serial kernels only: a pool of the
    /// window kernel answers it with `Error::Unsupported`.
    pub fn set_window_kernel(&mut self, on: bool) {
        self.window = on;
    }

    /// The CUDA context this backend runs in (the device's primary context, the one torch and most engines
    /// use): an engine's memory and streams for [`CudaLayer::step_raw`] belong to it.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Sets (or with `None` clears) fixed memory hints (L2 prefetch distance, prefetch before the wait) for
    /// launches from now on, instead of the planner's ([`Spec::planned_tune`]). No bits depend on them.
    pub fn set_tune_override(&mut self, tune: Option<spec::Tune>) {
        self.tune_override = tune;
    }

    /// The fixed memory hints, if any (None: the planner's).
    pub(crate) fn tune(&self) -> Option<spec::Tune> {
        self.tune_override
    }

    /// The launch plan for head dim `d` and `h_v` heads: the override where it fits `d`, else the planner's.
    pub(crate) fn plan_for(&self, d: usize, h_v: usize) -> Result<Plan> {
        match self.plan_override {
            Some(p) if p.valid_for(d) => Ok(p),
            _ => Plan::choose(d, h_v, 1, self.sms),
        }
    }

    /// The loaded kernel of one specialisation (compiled on first use, see [`spec::compiled`]).
    pub(crate) fn function(&self, spec: &Spec) -> Result<CudaFunction> {
        let lock = || {
            self.functions
                .lock()
                .map_err(|_| Error::Backend("function cache lock poisoned".into()))
        };
        if let Some(f) = lock()?.get(spec) {
            return Ok(f.clone());
        }
        let compiled = spec::compiled(spec)?;
        let module = self
            .ctx
            .load_module(cudarc::nvrtc::Ptx::from_binary(compiled.cubin.clone()))
            .map_err(drv)?;
        let f = module.load_function("gdn_step").map_err(drv)?;
        lock()?.insert(*spec, f.clone());
        Ok(f)
    }
}

impl Backend for Cuda {
    fn name(&self) -> String {
        let name = self.ctx.name().unwrap_or_else(|_| "?".into());
        format!(
            "cuda ({name}, sm_{}{}, {} SMs)",
            self.arch.0, self.arch.1, self.sms
        )
    }

    fn create_pool_with(
        &self,
        layer: &Layer,
        slots: usize,
        options: gdn::PoolOptions,
    ) -> Result<Box<dyn LayerPool>> {
        Ok(Box::new(self.create_cuda_pool(layer, slots, options)?))
    }

    fn copy_ceiling(&self, bytes: usize) -> Result<f64> {
        pool::copy_ceiling(self, bytes)
    }

    fn copy_ceiling_rotating(&self, bytes: usize, parts: usize) -> Result<f64> {
        pool::copy_ceiling_rotating(self, bytes, parts)
    }
}
