//! The CUDA path: `gdn_cuda::CudaLayer::step_raw` on the caller's device memory, on torch's current stream. No
//! copy, no allocation (but `out=None`'s), no host
//! synchronisation unless `validate=True`. One `CudaLayer` per (layer, device), made at the first step there;
//! one `gdn_cuda::Cuda` per device shared by every layer, so each kernel specialisation compiles once.

use std::sync::{Arc, Mutex};

use gdn::{DType, StateLayout};
use gdn_cuda::{Cuda, CudaLayer, RawConv, RawSpec, RawState, RawStep, RawTensor, SeqRows};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyDict;
use pyo3::{intern, Py};

use crate::tensor::{Elem, View};

/// One backend per device ordinal.
static DEVICES: Mutex<Vec<(usize, Cuda)>> = Mutex::new(Vec::new());

/// Per device, `arange(cap + 1)` as int32 on it: the row offsets of a decode step given without offsets.
static ARANGE: Mutex<Vec<(i64, Py<PyAny>, usize)>> = Mutex::new(Vec::new());

/// torch's accessor of the current raw stream (`torch._C._cuda_getCurrentRawStream`, about 0.1 us) or, where
/// this torch lacks it, None (then `torch.cuda.current_stream(d).cuda_stream`).
static RAW_STREAM: PyOnceLock<Option<Py<PyAny>>> = PyOnceLock::new();

/// The CUDA layers of one Python layer, by device; a layer outgrown by a call's sequence count is kept (a step
/// may still be queued on it) beside its larger successor.
#[derive(Default)]
pub struct Layers {
    by_device: Mutex<Vec<(i64, Arc<CudaLayer>)>>,
}

impl Drop for Layers {
    fn drop(&mut self) {
        // steps queued on torch's streams may still read the weights that dropping frees
        if let Ok(v) = self.by_device.get_mut() {
            for (_, l) in v.iter() {
                let _ = l.cuda().context().synchronize();
            }
        }
    }
}

fn backend_err(e: gdn::Error) -> PyErr {
    use gdn::Error as E;
    match e {
        E::Param { name, why } => {
            let arg = match name {
                "alpha" => "a",
                "beta" => "b",
                "slot" | "seqs" => "slots",
                "start" | "len" => "lengths",
                "commit_at" => "commit",
                n if n.starts_with("state") => "state",
                n if n.starts_with("conv") => "conv_state",
                n => n,
            };
            PyValueError::new_err(format!("{arg}: {why} ({name})"))
        }
        e => PyRuntimeError::new_err(format!("gdn CUDA: {e}")),
    }
}

/// The backends of every device gdn has run on, copied out, so that the device list's lock is not held while a
/// device is waited for.
fn backends() -> Vec<Cuda> {
    DEVICES
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .map(|(_, c)| c.clone())
        .collect()
}

/// Frees the chunked scratch of every device gdn has run on (each device's layers share one); returns the bytes
/// freed.
pub fn release_chunk_scratch() -> PyResult<usize> {
    let mut freed = 0;
    for c in backends().iter() {
        freed += c.chunk_scratch_bytes().map_err(backend_err)?;
        c.release_chunk_scratch().map_err(backend_err)?;
    }
    Ok(freed)
}

/// Bytes of chunked scratch held on every device gdn has run on.
pub fn chunk_scratch_bytes() -> PyResult<usize> {
    backends()
        .iter()
        .map(|c| c.chunk_scratch_bytes().map_err(backend_err))
        .sum()
}

fn device_backend(ordinal: usize) -> PyResult<Cuda> {
    let mut d = DEVICES.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, c)) = d.iter().find(|(o, _)| *o == ordinal) {
        return Ok(c.clone());
    }
    let c = Cuda::with_device(ordinal).map_err(backend_err)?;
    d.push((ordinal, c.clone()));
    Ok(c)
}

impl Layers {
    /// The layer's CUDA layer on `dev` for calls of `seqs` sequences.
    fn get(&self, layer: &gdn::Layer, dev: i64, seqs: usize) -> PyResult<Arc<CudaLayer>> {
        let mut v = self.by_device.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, l)) = v.iter().rev().find(|(d, _)| *d == dev) {
            if l.max_seqs() >= seqs {
                return Ok(Arc::clone(l));
            }
        }
        let cap = seqs
            .max(256)
            .next_power_of_two()
            .min(gdn_cuda::external::MAX_SEQS);
        if seqs > cap {
            return Err(PyValueError::new_err(format!(
                "slots: {seqs} sequences in one call, at most {} on CUDA",
                gdn_cuda::external::MAX_SEQS
            )));
        }
        let cuda = device_backend(dev as usize)?;
        let l = Arc::new(CudaLayer::new(&cuda, layer, cap).map_err(backend_err)?);
        v.push((dev, Arc::clone(&l)));
        Ok(l)
    }

    /// Syncs every device this layer ran on and reports sequences its kernels skipped (bad slot, rows or
    /// commit values that `validate=False` let through).
    pub fn take_faults(&self) -> PyResult<()> {
        let v = self.by_device.lock().unwrap_or_else(|p| p.into_inner());
        for (_, l) in v.iter() {
            l.take_fault()
                .map_err(|e| PyValueError::new_err(format!("slots, cu_seqlens or commit: {e}")))?;
        }
        Ok(())
    }
}

fn current_stream(py: Python<'_>, dev: i64) -> PyResult<usize> {
    let f = RAW_STREAM.get_or_try_init(py, || -> PyResult<Option<Py<PyAny>>> {
        let torch = py.import("torch")?;
        Ok(torch
            .getattr("_C")
            .and_then(|c| c.getattr("_cuda_getCurrentRawStream"))
            .ok()
            .map(|f| f.unbind()))
    })?;
    match f {
        Some(f) => f.bind(py).call1((dev,))?.extract(),
        None => py
            .import("torch")?
            .getattr("cuda")?
            .call_method1("current_stream", (dev,))?
            .getattr("cuda_stream")?
            .extract(),
    }
}

/// `arange(n + 1)` int32 on `dev`, cached (grown to powers of two).
fn arange(py: Python<'_>, dev: i64, n: usize) -> PyResult<u64> {
    let mut a = ARANGE.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, t, cap)) = a.iter().find(|(d, _, _)| *d == dev) {
        if *cap >= n {
            return t.bind(py).call_method0(intern!(py, "data_ptr"))?.extract();
        }
    }
    let cap = n.max(256).next_power_of_two();
    let torch = py.import(intern!(py, "torch"))?;
    let kw = PyDict::new(py);
    kw.set_item("dtype", torch.getattr("int32")?)?;
    kw.set_item("device", format!("cuda:{dev}"))?;
    let t = torch.call_method("arange", (cap + 1,), Some(&kw))?;
    let ptr = t.call_method0(intern!(py, "data_ptr"))?.extract()?;
    a.retain(|(d, _, _)| *d != dev);
    a.push((dev, t.unbind(), cap));
    Ok(ptr)
}

/// The checked views of one CUDA step.
pub struct Args<'a, 'py> {
    pub qkv: &'a View<'py>,
    pub a: &'a View<'py>,
    pub b: &'a View<'py>,
    pub z: &'a View<'py>,
    pub state: &'a View<'py>,
    pub conv: &'a View<'py>,
    pub out: &'a View<'py>,
    pub slots: &'a View<'py>,
    pub cu: Option<&'a View<'py>>,
    pub lengths: Option<&'a View<'py>>,
    pub commit: Option<&'a View<'py>>,
    pub layout: StateLayout,
    /// The speculative step's pending region, held words and accepted counts (None: a plain step).
    pub spec: Option<(&'a View<'py>, &'a View<'py>, &'a View<'py>)>,
    /// The caller's bound on every window's length (`max_seqlen`).
    pub max_len: Option<usize>,
}

fn dtype(v: &View<'_>) -> DType {
    v.elem.dtype().unwrap_or(DType::F32)
}

/// A row view's stride (a single row's is its width, whatever torch says).
fn rows_of(v: &View<'_>) -> RawTensor {
    let row_stride = if v.shape[0] <= 1 {
        v.shape[1]
    } else {
        v.strides[0] as usize
    };
    RawTensor {
        ptr: v.ptr as u64,
        dtype: dtype(v),
        row_stride,
    }
}

/// The thread's current CUDA context, put back when dropped: gdn-cuda binds its device's context to the thread,
/// and torch (the runtime API) takes the thread's current context for its current device.
struct KeepContext(cudarc::driver::sys::CUcontext);

impl KeepContext {
    fn new() -> Self {
        let mut c: cudarc::driver::sys::CUcontext = std::ptr::null_mut();
        // SAFETY: cuCtxGetCurrent only writes the thread's current context (or null) through its out-pointer, a
        // live local; the driver is loaded (torch runs on it: these are CUDA tensors)
        let _ = unsafe { cudarc::driver::sys::cuCtxGetCurrent(&mut c) };
        KeepContext(c)
    }
}

impl Drop for KeepContext {
    fn drop(&mut self) {
        if !self.0.is_null() {
            // SAFETY: the context was current on this thread before and is alive (torch holds it)
            let _ = unsafe { cudarc::driver::sys::cuCtxSetCurrent(self.0) };
        }
    }
}

/// Launches the step on torch's current stream of `dev`.
pub fn step(
    py: Python<'_>,
    layers: &Layers,
    layer: &gdn::Layer,
    dev: i64,
    x: &Args<'_, '_>,
) -> PyResult<()> {
    let _keep = KeepContext::new();
    let sh = *layer.shape();
    let seqs = x.slots.shape[0];
    let cl = layers.get(layer, dev, seqs.max(1))?;
    let stream = current_stream(py, dev)?;
    // with lengths, the kernel's blocks sum the lengths before their own sequence (rows packed in order)
    let (seq_rows, uniform_len) = match (x.cu, x.lengths) {
        (Some(cu), _) => (SeqRows::CuSeqlens(cu.ptr as u64), None),
        (None, Some(l)) => (SeqRows::Lengths(l.ptr as u64), None),
        (None, None) => (SeqRows::CuSeqlens(arange(py, dev, seqs)?), Some(1)),
    };
    let st = x.state;
    let sl = sh.state_len();
    let slot_stride = if st.shape[0] <= 1 {
        sl
    } else {
        st.strides[0] as usize
    };
    let cv = x.conv;
    let raw = RawStep {
        rows: x.qkv.shape[0],
        qkv: rows_of(x.qkv),
        alpha: rows_of(x.a),
        beta: rows_of(x.b),
        z: rows_of(x.z),
        out: rows_of(x.out),
        plane_stride: None,
        state: RawState {
            ptr: st.ptr as u64,
            dtype: dtype(st),
            layout: x.layout,
            slots: st.shape[0],
            slot_stride,
        },
        conv: RawConv {
            ptr: cv.ptr as u64,
            dtype: dtype(cv),
            width: cv.shape[2],
            slot_stride: cv.strides[0] as usize,
            chan_stride: cv.strides[1] as usize,
            col_stride: cv.strides[2] as usize,
        },
        seqs,
        slot: x.slots.ptr as u64,
        seq_rows,
        commit_at: x.commit.map(|c| c.ptr as u64),
        uniform_len,
        commits: true,
        max_len: x.max_len,
    };
    debug_assert!(x.slots.elem == Elem::I32);
    let spec = x.spec.map(|(p, h, a)| RawSpec {
        pending: p.ptr as u64,
        held: h.ptr as u64,
        accept: a.ptr as u64,
    });
    let r = py.detach(|| {
        // SAFETY: every pointer is a torch CUDA tensor's on device `dev` (checked: one device for every tensor),
        // in the device's primary context, which is the CudaLayer's (step_raw checks the stream's context); the
        // extents follow from the shapes and strides checked in `crate::step` (and again by step_raw); the
        // tensors the step writes are disjoint from the others (checked); torch keeps the memory alive for the
        // stream's work (its caching allocator reuses freed blocks only in stream order). Like any in-place torch
        // op, the caller must not have other streams write these tensors meanwhile.
        // With `spec`: the pending region, held words and accepted counts are torch CUDA tensors of the extents
        // step_spec_raw needs (checked), disjoint from the rest (checked), written only by these steps and the
        // engine's resets and forks (the documented contract of gdn.spec_step).
        match &spec {
            None => unsafe { cl.step_raw(&raw, stream as cudarc::driver::sys::CUstream) },
            Some(sp) => unsafe {
                cl.step_spec_raw(&raw, sp, stream as cudarc::driver::sys::CUstream)
            },
        }
    });
    r.map_err(backend_err)
}
