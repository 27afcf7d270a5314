//! gdn-cuda: the CUDA backend of gdn. The whole window step (SPEC.md) runs as one kernel launch, compiled by
//! NVRTC at first use for the device's own architecture and specialised on the shape, the window length, the
//! conventions, the planes, the commit kind and the launch split (see [`spec`]). The state pool lives on the
//! device; [`CudaPool::step_device`] takes inputs already there and can be captured into a CUDA graph.
//!
//! With no driver, no GPU or no libnvrtc, [`Cuda::new`] returns [`gdn::Error::Unavailable`].
//!
//! The device-native step, inputs already on the device (a decode step of 4 sequences at the seed shape):
//!
//! ```no_run
//! use gdn::{Commit, Config, OutputLayout, Shape};
//! use gdn_cuda::{Cuda, DeviceBatch};
//!
//! # fn main() -> gdn::Result<()> {
//! let cuda = Cuda::new()?;
//! let layer = gdn::synth::Synth::new(1).layer(Config::new(Shape::SEED))?;
//! let mut pool = cuda.create_cuda_pool(&layer, 16)?;
//! let (b, t) = (4, 1);
//! let sh = Shape::SEED;
//! let s = cuda.stream();
//! let drv = |e| gdn::Error::Backend(format!("{e:?}"));
//! let qkv = s.alloc_zeros::<f32>(b * t * sh.channels()).map_err(drv)?;
//! let alpha = s.alloc_zeros::<f32>(b * t * sh.h_v).map_err(drv)?;
//! let beta = s.alloc_zeros::<f32>(b * t * sh.h_v).map_err(drv)?;
//! let z = s.alloc_zeros::<f32>(b * t * sh.n()).map_err(drv)?;
//! let slots = s.clone_htod(&[3i32, 0, 7, -1]).map_err(drv)?; // the last sequence is skipped
//! let mut out = s.alloc_zeros::<f32>(OutputLayout::new(&sh, b, t, None)?.len()).map_err(drv)?;
//! pool.prepare(b, t, Commit::All, false)?; // compile before a graph capture
//! let batch = DeviceBatch {
//!     b,
//!     t,
//!     qkv: qkv.as_view(),
//!     alpha: alpha.as_view(),
//!     beta: beta.as_view(),
//!     z: z.as_view(),
//!     slots: slots.as_view(),
//! };
//! pool.step_device(&batch, Commit::All, None, &mut out.as_view_mut())?; // no allocation, no sync
//! # Ok(())
//! # }
//! ```

pub mod pool;
pub mod spec;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::{sys, CudaContext, CudaFunction, CudaStream, DriverError};
use gdn::{Backend, Error, Layer, LayerPool, Result};

pub use pool::{CudaPool, DeviceBatch};
pub use spec::{Kernel, Plan, Spec};

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
    /// A fixed plan instead of the planner's choice (benchmark sweeps): `GDN_CUDA_PLAN=ncb,rg,minb`.
    pub(crate) plan_override: Option<Plan>,
    /// Launch with programmatic dependent launch (the default; `GDN_CUDA_PDL=0` turns it off).
    pub(crate) pdl: bool,
    /// The token loop's variant (`GDN_CUDA_KERNEL=v3`; default v2b).
    pub(crate) kernel: Kernel,
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
        let plan_override = std::env::var("GDN_CUDA_PLAN").ok().and_then(|v| {
            let n: Vec<usize> = v.split(',').filter_map(|x| x.trim().parse().ok()).collect();
            (n.len() == 3).then(|| Plan {
                ncb: n[0],
                rg: n[1],
                minb: n[2],
            })
        });
        Ok(Cuda {
            ctx,
            stream,
            arch,
            sms,
            functions: Arc::new(Mutex::new(HashMap::new())),
            plan_override,
            pdl: std::env::var("GDN_CUDA_PDL").map_or(true, |v| v != "0"),
            kernel: Kernel::from_env(),
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
    pub fn create_cuda_pool(&self, layer: &Layer, slots: usize) -> Result<CudaPool> {
        CudaPool::new(self.clone(), layer, slots)
    }

    /// Turns programmatic dependent launch on or off for launches from now on.
    pub fn set_pdl(&mut self, on: bool) {
        self.pdl = on;
    }

    /// Selects the kernel variant for pools created afterwards (the default comes from `GDN_CUDA_KERNEL`).
    pub fn set_kernel(&mut self, kernel: Kernel) {
        self.kernel = kernel;
    }

    /// The kernel variant pools created from now on run.
    pub fn kernel(&self) -> Kernel {
        self.kernel
    }

    /// Sets (or with `None` clears) a fixed launch plan for pools created afterwards.
    pub fn set_plan_override(&mut self, plan: Option<Plan>) {
        self.plan_override = plan;
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
        if options != gdn::PoolOptions::default() {
            return Err(Error::Unsupported(format!(
                "{options:?} (f32 key-major states only, for now)"
            )));
        }
        self.create_pool(layer, slots)
    }

    fn create_pool(&self, layer: &Layer, slots: usize) -> Result<Box<dyn LayerPool>> {
        Ok(Box::new(self.create_cuda_pool(layer, slots)?))
    }

    fn copy_ceiling(&self, bytes: usize) -> Result<f64> {
        pool::copy_ceiling(self, bytes)
    }
}
