//! The device-resident state pool, the device-native step and the host-slice step on top of it.

use std::ffi::c_void;
use std::time::{Duration, Instant};

use cudarc::driver::{
    sys, CudaFunction, CudaSlice, CudaView, CudaViewMut, DevicePtr, DevicePtrMut,
};
use gdn::backend::{check_slot_io, head_history};
use gdn::{Commit, Error, Layer, LayerPool, OutputLayout, Result, StepArgs, StepTiming};

use crate::spec::{self, Plan, Spec};
use crate::{drv, Cuda};

/// Windows of inputs already on the device, SPEC.md's layouts with a leading batch dimension: `qkv`
/// [b][t][C], `alpha` and `beta` [b][t][h_v], `z` [b][t][n], and the pool slot of each sequence (negative:
/// skip it). The slots must be distinct; one out of the pool's range is skipped.
pub struct DeviceBatch<'a> {
    pub b: usize,
    pub t: usize,
    pub qkv: CudaView<'a, f32>,
    pub alpha: CudaView<'a, f32>,
    pub beta: CudaView<'a, f32>,
    pub z: CudaView<'a, f32>,
    pub slots: CudaView<'a, i32>,
}

/// Device buffers the host-slice step uploads into, grown on demand and reused.
struct Staging {
    qkv: CudaSlice<f32>,
    alpha: CudaSlice<f32>,
    beta: CudaSlice<f32>,
    z: CudaSlice<f32>,
    out: CudaSlice<f32>,
    slots: CudaSlice<i32>,
}

/// Raw device addresses of one step's operands.
#[derive(Clone, Copy)]
struct Operands {
    qkv: sys::CUdeviceptr,
    alpha: sys::CUdeviceptr,
    beta: sys::CUdeviceptr,
    z: sys::CUdeviceptr,
    out: sys::CUdeviceptr,
    slots: sys::CUdeviceptr,
}

/// One layer's parameters and state pool on a CUDA device. S is kept in SPEC.md's layout
/// [slot][d][h_v][d]; the conv history as [slot][h_v][3 (q, k, v)][d][3]: every value head has a private
/// copy of the q/k history it reads, so the kernel commits it in place with no cross-head dependency.
pub struct CudaPool {
    cuda: Cuda,
    layer: Layer,
    slots: usize,
    state: CudaSlice<f32>,
    hist: CudaSlice<f32>,
    conv_w: CudaSlice<f32>,
    dt: CudaSlice<f32>,
    a: CudaSlice<f32>,
    gamma: CudaSlice<f32>,
    staging: Option<Staging>,
}

fn ptr<T, S: DevicePtr<T>>(s: &S, cuda: &Cuda) -> sys::CUdeviceptr {
    // event tracking is off for this backend's context, so the guard records nothing
    let (p, _guard) = s.device_ptr(&cuda.stream);
    p
}

fn ptr_mut<T, S: DevicePtrMut<T>>(s: &mut S, cuda: &Cuda) -> sys::CUdeviceptr {
    let (p, _guard) = s.device_ptr_mut(&cuda.stream);
    p
}

impl CudaPool {
    pub(crate) fn new(cuda: Cuda, layer: &Layer, slots: usize) -> Result<CudaPool> {
        layer.validate()?;
        let sh = *layer.shape();
        // fail early on a shape the kernel cannot hold
        Plan::choose(sh.d, sh.h_v, 1, cuda.sms)?;
        let s = &cuda.stream;
        let p = &layer.params;
        let pool = CudaPool {
            state: s
                .alloc_zeros::<f32>((slots * sh.state_len()).max(1))
                .map_err(drv)?,
            hist: s
                .alloc_zeros::<f32>((slots * sh.h_v * 9 * sh.d).max(1))
                .map_err(drv)?,
            conv_w: s.clone_htod(&p.conv_w).map_err(drv)?,
            dt: s.clone_htod(&p.dt).map_err(drv)?,
            a: s.clone_htod(&p.a).map_err(drv)?,
            gamma: s.clone_htod(&p.gamma).map_err(drv)?,
            cuda,
            layer: layer.clone(),
            slots,
            staging: None,
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

    /// The launch plan for a batch of `b` sequences.
    pub fn plan(&self, b: usize) -> Result<Plan> {
        let sh = self.layer.shape();
        match self.cuda.plan_override {
            // a fixed plan where it fits this head dim, else the planner's
            Some(p) if p.valid_for(sh.d) => Ok(p),
            _ => Plan::choose(sh.d, sh.h_v, b, self.cuda.sms),
        }
    }

    /// The kernel specialisation a step of this kind runs.
    pub fn spec(&self, b: usize, t: usize, commit: Commit, planes: bool) -> Result<Spec> {
        Ok(Spec::new(
            self.cuda.arch,
            &self.layer.config,
            t,
            commit,
            planes,
            self.plan(b)?,
        )
        .with_kernel(self.cuda.kernel))
    }

    /// Compiles and loads the kernel a step of this kind needs, so that a later step (for instance one
    /// being captured into a graph) does no compilation.
    pub fn prepare(&self, b: usize, t: usize, commit: Commit, planes: bool) -> Result<()> {
        self.function(&self.spec(b, t, commit, planes)?).map(|_| ())
    }

    fn function(&self, spec: &Spec) -> Result<CudaFunction> {
        let lock = || {
            self.cuda
                .functions
                .lock()
                .map_err(|_| Error::Backend("function cache lock poisoned".into()))
        };
        if let Some(f) = lock()?.get(spec) {
            return Ok(f.clone());
        }
        let compiled = spec::compiled(spec)?;
        let module = self
            .cuda
            .ctx
            .load_module(cudarc::nvrtc::Ptx::from_binary(compiled.cubin.clone()))
            .map_err(drv)?;
        let f = module.load_function("gdn_step").map_err(drv)?;
        lock()?.insert(*spec, f.clone());
        Ok(f)
    }

    /// The device-native step: inputs, slot indices and output already on the device. It allocates nothing
    /// and does not wait for the device (after the first call of a specialisation, which compiles it: see
    /// [`CudaPool::prepare`]), so it can be captured into a CUDA graph. The output layout is
    /// [`gdn::OutputLayout`]'s; rows of skipped sequences are not written.
    pub fn step_device(
        &mut self,
        batch: &DeviceBatch<'_>,
        commit: Commit,
        plane_stride: Option<usize>,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        let sh = *self.layer.shape();
        let (b, t) = (batch.b, batch.t);
        if t == 0 {
            return Err(Error::EmptyWindow);
        }
        let commit_at = commit.commit_at(t)?;
        let bt = b * t;
        for (name, expected, got) in [
            ("qkv", bt * sh.channels(), batch.qkv.len()),
            ("alpha", bt * sh.h_v, batch.alpha.len()),
            ("beta", bt * sh.h_v, batch.beta.len()),
            ("z", bt * sh.n(), batch.z.len()),
            ("slots", b, batch.slots.len()),
        ] {
            if expected != got {
                return Err(Error::Length {
                    name,
                    expected,
                    got,
                });
            }
        }
        let layout = OutputLayout::new(&sh, b, t, plane_stride)?;
        if out.len() != layout.len() {
            return Err(Error::Length {
                name: "output",
                expected: layout.len(),
                got: out.len(),
            });
        }
        let ops = Operands {
            qkv: ptr(&batch.qkv, &self.cuda),
            alpha: ptr(&batch.alpha, &self.cuda),
            beta: ptr(&batch.beta, &self.cuda),
            z: ptr(&batch.z, &self.cuda),
            slots: ptr(&batch.slots, &self.cuda),
            out: ptr_mut(out, &self.cuda),
        };
        self.launch(b, t, commit, commit_at, plane_stride, ops)
    }

    fn launch(
        &mut self,
        b: usize,
        t: usize,
        commit: Commit,
        commit_at: usize,
        plane_stride: Option<usize>,
        ops: Operands,
    ) -> Result<()> {
        if b == 0 {
            return Ok(());
        }
        let sh = *self.layer.shape();
        let spec = self.spec(b, t, commit, plane_stride.is_some())?;
        let f = self.function(&spec)?;
        let int = |x: usize, what: &'static str| {
            i32::try_from(x).map_err(|_| Error::Param {
                name: what,
                why: format!("{x} does not fit the kernel's 32-bit argument"),
            })
        };
        let grid_y = u32::try_from(b)
            .ok()
            .filter(|&y| y <= 65535)
            .ok_or_else(|| Error::Param {
                name: "batch",
                why: format!("{b} sequences is above the 65535 a launch takes"),
            })?;
        let mut p_state = ptr_mut(&mut self.state, &self.cuda);
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
        let mut p_slots = ops.slots;
        let mut n_slots = int(self.slots, "slots")?;
        let mut t_rt = int(t, "t")?;
        let mut c_at = int(commit_at, "commit")?;
        let mut plane = i64::try_from(plane_stride.unwrap_or(0)).map_err(|_| Error::Param {
            name: "plane_stride",
            why: "too large".into(),
        })?;
        let mut eps = self.layer.config.eps;
        let mut params: [*mut c_void; 18] = [
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
            &mut p_slots as *mut _ as *mut c_void,
            &mut n_slots as *mut _ as *mut c_void,
            &mut t_rt as *mut _ as *mut c_void,
            &mut c_at as *mut _ as *mut c_void,
            &mut plane as *mut _ as *mut c_void,
            &mut eps as *mut _ as *mut c_void,
            std::ptr::null_mut(),
        ];
        let grid = ((sh.h_v * spec.plan.ncb) as u32, grid_y, 1);
        let block = (spec.threads() as u32, 1, 1);
        self.cuda.ctx.bind_to_thread().map_err(drv)?;
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
            blockDimX: block.0,
            blockDimY: block.1,
            blockDimZ: block.2,
            sharedMemBytes: 0,
            hStream: self.cuda.stream.cu_stream(),
            attrs: attrs.as_mut_ptr(),
            numAttrs: if self.cuda.pdl { 1 } else { 0 },
        };
        // SAFETY: the 17 parameters match the kernel's signature in order and type (six device pointers of
        // the pool, six of the batch, int n_slots, int t, int commit_at, long long plane, float eps); each
        // points to a local that lives across the call (the driver copies them at launch), as do `config` and
        // the attribute it points to. The buffers have the lengths the kernel indexes: the pool's by
        // construction, the batch's and the output's checked by the callers against the shape, b, t and the
        // output layout; the kernel skips slots out of range. Programmatic serialisation is sound because the
        // kernel executes griddepcontrol.wait before it touches anything an earlier kernel may write.
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

    fn staging(&mut self, qkv: usize, hv: usize, n: usize, out: usize, b: usize) -> Result<()> {
        let fits = self.staging.as_ref().is_some_and(|s| {
            s.qkv.len() >= qkv
                && s.alpha.len() >= hv
                && s.z.len() >= n
                && s.out.len() >= out
                && s.slots.len() >= b
        });
        if !fits {
            let s = &self.cuda.stream;
            let old = self.staging.take();
            let grow = |want: usize, have: usize| want.max(have).max(1);
            let have = |f: fn(&Staging) -> usize| old.as_ref().map_or(0, f);
            self.staging = Some(Staging {
                qkv: s
                    .alloc_zeros(grow(qkv, have(|x| x.qkv.len())))
                    .map_err(drv)?,
                alpha: s
                    .alloc_zeros(grow(hv, have(|x| x.alpha.len())))
                    .map_err(drv)?,
                beta: s
                    .alloc_zeros(grow(hv, have(|x| x.beta.len())))
                    .map_err(drv)?,
                z: s.alloc_zeros(grow(n, have(|x| x.z.len()))).map_err(drv)?,
                out: s
                    .alloc_zeros(grow(out, have(|x| x.out.len())))
                    .map_err(drv)?,
                slots: s
                    .alloc_zeros(grow(b, have(|x| x.slots.len())))
                    .map_err(drv)?,
            });
        }
        Ok(())
    }
}

impl LayerPool for CudaPool {
    fn layer(&self) -> &Layer {
        &self.layer
    }

    fn slots(&self) -> usize {
        self.slots
    }

    fn write_slot(&mut self, slot: usize, state: &[f32], hist: &[f32]) -> Result<()> {
        check_slot_io(&self.layer, self.slots, slot, state.len(), hist.len())?;
        let sl = state.len();
        let hl = head_history::len(&self.layer);
        let mut pooled = vec![0.0f32; hl];
        head_history::from_spec(&self.layer, hist, &mut pooled);
        let s = self.cuda.stream.clone();
        s.memcpy_htod(state, &mut self.state.slice_mut(slot * sl..(slot + 1) * sl))
            .map_err(drv)?;
        s.memcpy_htod(
            &pooled,
            &mut self.hist.slice_mut(slot * hl..(slot + 1) * hl),
        )
        .map_err(drv)?;
        s.synchronize().map_err(drv)
    }

    fn read_slot(&mut self, slot: usize, state: &mut [f32], hist: &mut [f32]) -> Result<()> {
        check_slot_io(&self.layer, self.slots, slot, state.len(), hist.len())?;
        let sl = state.len();
        let hl = head_history::len(&self.layer);
        let mut pooled = vec![0.0f32; hl];
        let s = self.cuda.stream.clone();
        s.memcpy_dtoh(&self.state.slice(slot * sl..(slot + 1) * sl), state)
            .map_err(drv)?;
        s.memcpy_dtoh(&self.hist.slice(slot * hl..(slot + 1) * hl), &mut pooled)
            .map_err(drv)?;
        s.synchronize().map_err(drv)?;
        head_history::to_spec(&self.layer, &pooled, hist);
        Ok(())
    }

    fn options(&self) -> gdn::PoolOptions {
        gdn::PoolOptions::default()
    }

    fn step_varlen(&mut self, step: &gdn::Step<'_>, out: gdn::TensorMut<'_>) -> Result<()> {
        step.validate(&self.layer, self.slots, out.len())?;
        Err(Error::Unsupported("varlen steps (being ported)".into()))
    }

    fn step(&mut self, args: &StepArgs<'_>, out: &mut [f32]) -> Result<()> {
        let (layout, commit_at) = args.validate(&self.layer, self.slots, out.len())?;
        let batch = &args.batch;
        let (b, t) = (batch.b, batch.t);
        if b == 0 {
            return Ok(());
        }
        self.staging(
            batch.qkv.len(),
            batch.alpha.len(),
            batch.z.len(),
            layout.len(),
            b,
        )?;
        let s = self.cuda.stream.clone();
        let st = self
            .staging
            .as_mut()
            .ok_or_else(|| Error::Backend("staging buffers missing".into()))?;
        s.memcpy_htod(batch.qkv, &mut st.qkv.slice_mut(0..batch.qkv.len()))
            .map_err(drv)?;
        s.memcpy_htod(batch.alpha, &mut st.alpha.slice_mut(0..batch.alpha.len()))
            .map_err(drv)?;
        s.memcpy_htod(batch.beta, &mut st.beta.slice_mut(0..batch.beta.len()))
            .map_err(drv)?;
        s.memcpy_htod(batch.z, &mut st.z.slice_mut(0..batch.z.len()))
            .map_err(drv)?;
        s.memcpy_htod(args.slots, &mut st.slots.slice_mut(0..b))
            .map_err(drv)?;
        // the caller's output goes up too: rows the step does not write must come back unchanged
        s.memcpy_htod(&*out, &mut st.out.slice_mut(0..out.len()))
            .map_err(drv)?;
        let ops = Operands {
            qkv: ptr(&st.qkv, &self.cuda),
            alpha: ptr(&st.alpha, &self.cuda),
            beta: ptr(&st.beta, &self.cuda),
            z: ptr(&st.z, &self.cuda),
            out: ptr_mut(&mut st.out, &self.cuda),
            slots: ptr(&st.slots, &self.cuda),
        };
        self.launch(b, t, args.commit, commit_at, args.plane_stride, ops)?;
        let st = self
            .staging
            .as_ref()
            .ok_or_else(|| Error::Backend("staging buffers missing".into()))?;
        s.memcpy_dtoh(&st.out.slice(0..out.len()), out)
            .map_err(drv)?;
        s.synchronize().map_err(drv)
    }

    fn time_step(&mut self, args: &StepArgs<'_>, iters: usize) -> Result<StepTiming> {
        let (layout, _) = args.validate(&self.layer, self.slots, layout_len(self, args)?)?;
        let batch = &args.batch;
        let s = self.cuda.stream.clone();
        let qkv = s.clone_htod(batch.qkv).map_err(drv)?;
        let alpha = s.clone_htod(batch.alpha).map_err(drv)?;
        let beta = s.clone_htod(batch.beta).map_err(drv)?;
        let z = s.clone_htod(batch.z).map_err(drv)?;
        let slots = s.clone_htod(args.slots).map_err(drv)?;
        let mut out = s.alloc_zeros::<f32>(layout.len().max(1)).map_err(drv)?;
        let db = DeviceBatch {
            b: batch.b,
            t: batch.t,
            qkv: qkv.as_view(),
            alpha: alpha.as_view(),
            beta: beta.as_view(),
            z: z.as_view(),
            slots: slots.as_view(),
        };
        let len = layout.len();
        let mut step = |pool: &mut CudaPool| {
            pool.step_device(
                &db,
                args.commit,
                args.plane_stride,
                &mut out.slice_mut(0..len),
            )
        };
        // warm-up (compiles and loads the kernel)
        for _ in 0..3 {
            step(self)?;
        }
        s.synchronize().map_err(drv)?;
        // host cost of one call: issue a run of calls without waiting
        let n_host = 50;
        let t0 = Instant::now();
        for _ in 0..n_host {
            step(self)?;
        }
        let host = t0.elapsed() / n_host;
        s.synchronize().map_err(drv)?;
        // a graph of `per_graph` steps, replayed
        let per_graph = iters.clamp(1, 100);
        s.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(drv)?;
        let mut captured = Ok(());
        for _ in 0..per_graph {
            captured = step(self);
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
}

fn layout_len(pool: &CudaPool, args: &StepArgs<'_>) -> Result<usize> {
    Ok(OutputLayout::new(
        pool.layer.shape(),
        args.batch.b,
        args.batch.t,
        args.plane_stride,
    )?
    .len())
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
