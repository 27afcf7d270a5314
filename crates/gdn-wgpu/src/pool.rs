//! A layer's state pool resident on the GPU, and the step.
//!
//! Buffers: the state S of every slot in SPEC.md's layout; the conv history in this backend's own layout
//! [slot][h_v][3][d][3] (each value head keeps its own copy of the q and k history it reads, so a workgroup owns
//! all the history it touches and commits it in place); the layer's weights; and, grown on demand and reused,
//! the window's inputs, the output, the job list and a readback buffer.

use std::sync::Arc;
use std::time::Duration;

use gdn::backend::{check_slot_io, head_history};
use gdn::{Error, Gate, HeadMap, Layer, LayerPool, OutputLayout, Result, StepArgs, StepTiming};

use crate::kernel::{choose_row_blocks, KernelKey};
use crate::Gpu;

/// The uniform block of the kernel (`Params` in gdn_step.wgsl).
#[repr(C)]
#[derive(Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    t: u32,
    commit_at: u32,
    plane: u32,
    qkv_off: u32,
    alpha_off: u32,
    beta_off: u32,
    z_off: u32,
    h_k: u32,
    h_v: u32,
    c: u32,
    n: u32,
    grouped: u32,
    silu: u32,
    eps: f32,
    pad: u32,
}

/// A buffer that grows on demand (to the next power of two, at least 256 bytes) and is otherwise reused.
struct Growable {
    buf: Option<wgpu::Buffer>,
    usage: wgpu::BufferUsages,
    label: &'static str,
}

impl Growable {
    fn new(label: &'static str, usage: wgpu::BufferUsages) -> Self {
        Growable {
            buf: None,
            usage,
            label,
        }
    }

    /// Makes room for `bytes`; true when the buffer was replaced.
    fn reserve(&mut self, gpu: &Gpu, bytes: u64) -> Result<bool> {
        if self.buf.as_ref().is_some_and(|b| b.size() >= bytes) {
            return Ok(false);
        }
        let size = bytes
            .max(256)
            .checked_next_power_of_two()
            .unwrap_or(bytes)
            .min(
                gpu.limits
                    .max_buffer_size
                    .min(gpu.limits.max_storage_buffer_binding_size),
            );
        let size = size.max(bytes.max(256).div_ceil(4) * 4);
        check_size(gpu, self.label, size)?;
        self.buf = None;
        let buf = gpu.scoped(self.label, || {
            gpu.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(self.label),
                size,
                usage: self.usage,
                mapped_at_creation: false,
            })
        })?;
        self.buf = Some(buf);
        Ok(true)
    }

    fn get(&self) -> Result<&wgpu::Buffer> {
        self.buf
            .as_ref()
            .ok_or_else(|| Error::Backend(format!("{} not allocated", self.label)))
    }
}

fn check_size(gpu: &Gpu, what: &str, bytes: u64) -> Result<()> {
    let l = &gpu.limits;
    let max = l.max_buffer_size.min(l.max_storage_buffer_binding_size);
    if bytes > max {
        return Err(Error::Backend(format!(
            "{what} needs a buffer of {bytes} bytes; the adapter binds at most {max}"
        )));
    }
    Ok(())
}

pub struct WgpuPool {
    gpu: Arc<Gpu>,
    layer: Layer,
    slots: usize,
    key: KernelKey,
    state: wgpu::Buffer,
    hist: wgpu::Buffer,
    weights: wgpu::Buffer,
    params: wgpu::Buffer,
    inputs: Growable,
    out: Growable,
    jobs: Growable,
    readback: Growable,
    bind_group: Option<wgpu::BindGroup>,
    /// Host scratch: live (sequence, slot) pairs, history conversions.
    job_list: Vec<[u32; 2]>,
    scratch: Vec<f32>,
}

impl WgpuPool {
    pub(crate) fn new(
        gpu: Arc<Gpu>,
        layer: &Layer,
        slots: usize,
        row_blocks: usize,
        checked: bool,
        onepass: bool,
    ) -> Result<Self> {
        layer.validate()?;
        let sh = *layer.shape();
        let row_blocks = choose_row_blocks(sh.d, &gpu.limits, row_blocks);
        // the subgroup path wants full subgroups: a workgroup size that is a multiple of every subgroup size the
        // adapter may use (always so with four row blocks: 4 d is a multiple of 64); else workgroup memory
        let w = sh.d * row_blocks;
        let full = w.is_multiple_of(gpu.info.subgroup_max_size.max(1) as usize);
        let key = KernelKey {
            d: sh.d,
            subgroups: gpu.subgroups && full,
            row_blocks,
            checked,
            onepass,
        };
        // build the pipeline now, so that a shape the adapter cannot run fails here
        gpu.pipeline(key)?;
        if sh.h_v > gpu.limits.max_compute_workgroups_per_dimension as usize {
            return Err(Error::Backend(format!(
                "{} value heads: the adapter dispatches at most {} workgroups in x",
                sh.h_v, gpu.limits.max_compute_workgroups_per_dimension
            )));
        }
        let state_bytes = (slots * sh.state_len() * 4) as u64;
        let hist_bytes = (slots * sh.h_v * 9 * sh.d * 4) as u64;
        check_size(&gpu, "the state pool", state_bytes)?;
        check_size(&gpu, "the history pool", hist_bytes)?;
        let p = &layer.params;
        let mut weights = Vec::with_capacity(p.conv_w.len() + 2 * sh.h_v + sh.d);
        weights.extend_from_slice(&p.conv_w);
        weights.extend_from_slice(&p.dt);
        weights.extend_from_slice(&p.a);
        weights.extend_from_slice(&p.gamma);
        let storage = wgpu::BufferUsages::STORAGE
            | wgpu::BufferUsages::COPY_DST
            | wgpu::BufferUsages::COPY_SRC;
        let (state, hist, weights_buf, params) = gpu.scoped("allocating the pool", || {
            let mk = |label, size: u64, usage| {
                gpu.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some(label),
                    size: size.max(16),
                    usage,
                    mapped_at_creation: false,
                })
            };
            (
                mk("gdn state", state_bytes, storage),
                mk("gdn hist", hist_bytes, storage),
                mk("gdn weights", (weights.len() * 4) as u64, storage),
                mk(
                    "gdn params",
                    std::mem::size_of::<Params>() as u64,
                    wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
                ),
            )
        })?;
        gpu.queue
            .write_buffer(&weights_buf, 0, bytemuck::cast_slice(&weights));
        let rw = wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST;
        Ok(WgpuPool {
            layer: layer.clone(),
            slots,
            key,
            state,
            hist,
            weights: weights_buf,
            params,
            inputs: Growable::new("gdn inputs", rw),
            out: Growable::new("gdn output", rw | wgpu::BufferUsages::COPY_SRC),
            jobs: Growable::new("gdn jobs", rw),
            readback: Growable::new(
                "gdn readback",
                wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            ),
            bind_group: None,
            job_list: Vec::new(),
            scratch: Vec::new(),
            gpu,
        })
    }

    /// Uploads a step's inputs and job list and records its arguments; returns the number of live sequences
    /// and the pipeline.
    fn prepare(
        &mut self,
        args: &StepArgs<'_>,
        layout: &OutputLayout,
        commit_at: usize,
    ) -> Result<(u32, Arc<wgpu::ComputePipeline>)> {
        let gpu = self.gpu.clone();
        let sh = *self.layer.shape();
        self.job_list.clear();
        for (b, &s) in args.slots.iter().enumerate() {
            if s >= 0 {
                self.job_list.push([b as u32, s as u32]);
            }
        }
        let live = self.job_list.len() as u32;
        if live > gpu.limits.max_compute_workgroups_per_dimension {
            return Err(Error::Backend(format!(
                "{live} sequences in one step; the adapter dispatches at most {} workgroups in y",
                gpu.limits.max_compute_workgroups_per_dimension
            )));
        }
        let batch = &args.batch;
        let floats = [batch.qkv, batch.alpha, batch.beta, batch.z];
        let total: usize = floats.iter().map(|v| v.len()).sum();
        let to_u32 = |x: usize| {
            u32::try_from(x)
                .map_err(|_| Error::Backend(format!("a window of {x} floats is too large")))
        };
        let out_floats = layout.len();
        to_u32(total)?;
        to_u32(out_floats)?;
        let mut grown = self.inputs.reserve(&gpu, (total * 4) as u64)?;
        grown |= self.out.reserve(&gpu, (out_floats * 4) as u64)?;
        grown |= self
            .jobs
            .reserve(&gpu, (self.job_list.len().max(1) * 8) as u64)?;
        if grown || self.bind_group.is_none() {
            let entries = [
                self.state.as_entire_binding(),
                self.hist.as_entire_binding(),
                self.inputs.get()?.as_entire_binding(),
                self.weights.as_entire_binding(),
                self.out.get()?.as_entire_binding(),
                self.jobs.get()?.as_entire_binding(),
                self.params.as_entire_binding(),
            ];
            let entries: Vec<wgpu::BindGroupEntry> = entries
                .into_iter()
                .enumerate()
                .map(|(i, resource)| wgpu::BindGroupEntry {
                    binding: i as u32,
                    resource,
                })
                .collect();
            let bg = gpu.scoped("binding the step's buffers", || {
                gpu.device.create_bind_group(&wgpu::BindGroupDescriptor {
                    label: Some("gdn step"),
                    layout: &gpu.bind_layout,
                    entries: &entries,
                })
            })?;
            self.bind_group = Some(bg);
        }
        let inputs = self.inputs.get()?;
        let mut off = 0usize;
        let mut offs = [0u32; 4];
        for (i, v) in floats.iter().enumerate() {
            offs[i] = off as u32;
            if !v.is_empty() {
                gpu.queue
                    .write_buffer(inputs, (off * 4) as u64, bytemuck::cast_slice(v));
            }
            off += v.len();
        }
        if live > 0 {
            gpu.queue
                .write_buffer(self.jobs.get()?, 0, bytemuck::cast_slice(&self.job_list));
        }
        let params = Params {
            t: batch.t as u32,
            commit_at: commit_at as u32,
            plane: layout.plane_stride.map_or(Ok(0), to_u32)?,
            qkv_off: offs[0],
            alpha_off: offs[1],
            beta_off: offs[2],
            z_off: offs[3],
            h_k: sh.h_k as u32,
            h_v: sh.h_v as u32,
            c: sh.channels() as u32,
            n: sh.n() as u32,
            grouped: (self.layer.config.head_map == HeadMap::Grouped) as u32,
            silu: (self.layer.config.gate == Gate::Silu) as u32,
            eps: self.layer.config.eps,
            pad: 0,
        };
        gpu.queue
            .write_buffer(&self.params, 0, bytemuck::bytes_of(&params));
        let pipeline = gpu.pipeline(self.key)?;
        Ok((live, pipeline))
    }

    fn record_dispatch(
        &self,
        pass: &mut wgpu::ComputePass<'_>,
        pipeline: &wgpu::ComputePipeline,
        live: u32,
    ) {
        pass.set_pipeline(pipeline);
        pass.set_bind_group(0, self.bind_group.as_ref(), &[]);
        pass.dispatch_workgroups(self.layer.shape().h_v as u32, live, 1);
    }
}

impl LayerPool for WgpuPool {
    fn layer(&self) -> &Layer {
        &self.layer
    }

    fn slots(&self) -> usize {
        self.slots
    }

    fn write_slot(&mut self, slot: usize, state: &[f32], hist: &[f32]) -> Result<()> {
        check_slot_io(&self.layer, self.slots, slot, state.len(), hist.len())?;
        let sh = *self.layer.shape();
        let hl = head_history::len(&self.layer);
        let mut own = std::mem::take(&mut self.scratch);
        own.clear();
        own.resize(hl, 0.0);
        head_history::from_spec(&self.layer, hist, &mut own);
        let gpu = &self.gpu;
        gpu.queue.write_buffer(
            &self.state,
            (slot * sh.state_len() * 4) as u64,
            bytemuck::cast_slice(state),
        );
        gpu.queue.write_buffer(
            &self.hist,
            (slot * hl * 4) as u64,
            bytemuck::cast_slice(&own),
        );
        self.scratch = own;
        gpu.queue.submit([]);
        gpu.take_errors()
    }

    fn read_slot(&mut self, slot: usize, state: &mut [f32], hist: &mut [f32]) -> Result<()> {
        check_slot_io(&self.layer, self.slots, slot, state.len(), hist.len())?;
        let sh = *self.layer.shape();
        let hl = head_history::len(&self.layer);
        let gpu = self.gpu.clone();
        let sb = (sh.state_len() * 4) as u64;
        let hb = (hl * 4) as u64;
        self.readback.reserve(&gpu, sb + hb)?;
        let rb = self.readback.get()?;
        let mut enc = gpu
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
        enc.copy_buffer_to_buffer(&self.state, slot as u64 * sb, rb, 0, sb);
        enc.copy_buffer_to_buffer(&self.hist, slot as u64 * hb, rb, sb, hb);
        gpu.queue.submit([enc.finish()]);
        let mut own = std::mem::take(&mut self.scratch);
        own.clear();
        own.resize(hl, 0.0);
        gpu.read_mapped_with(rb, sb + hb, |bytes| {
            let (s, h) = bytes.split_at(sb as usize);
            bytemuck::cast_slice_mut::<f32, u8>(state).copy_from_slice(s);
            bytemuck::cast_slice_mut::<f32, u8>(&mut own).copy_from_slice(h);
        })?;
        head_history::to_spec(&self.layer, &own, hist);
        self.scratch = own;
        gpu.take_errors()
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
        let (live, pipeline) = self.prepare(args, &layout, commit_at)?;
        if live == 0 {
            return Ok(());
        }
        let gpu = self.gpu.clone();
        let bytes = (layout.len() * 4) as u64;
        self.readback.reserve(&gpu, bytes)?;
        let mut enc = gpu
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
        {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("gdn step"),
                timestamp_writes: None,
            });
            self.record_dispatch(&mut pass, &pipeline, live);
        }
        enc.copy_buffer_to_buffer(self.out.get()?, 0, self.readback.get()?, 0, bytes);
        gpu.queue.submit([enc.finish()]);
        // only the rows of live sequences (and no plane padding) reach `out`
        let (t, n) = (args.batch.t, layout.n);
        let job_list = &self.job_list;
        gpu.read_mapped_with(self.readback.get()?, bytes, |raw| {
            let src: &[f32] = bytemuck::cast_slice(raw);
            let mut copy =
                |lo: usize, len: usize| out[lo..lo + len].copy_from_slice(&src[lo..lo + len]);
            for &[b, _] in job_list {
                let b = b as usize;
                match layout.plane_stride {
                    None => copy(b * t * n, t * n),
                    Some(p) => {
                        for k in 0..4 {
                            copy(k * p + b * t * n, t * n);
                        }
                        copy(4 * p + b * t * (n / 16), t * (n / 16));
                    }
                }
            }
        })?;
        gpu.take_errors()
    }

    /// Inputs uploaded once; then rounds of back-to-back dispatches in one compute pass, timed with GPU
    /// timestamps where the adapter has them (else the host clock around submit and wait); the median round.
    fn time_step(&mut self, args: &StepArgs<'_>, iters: usize) -> Result<StepTiming> {
        // the output buffer is ours here: validate against the length the layout asks for
        let len = OutputLayout::new(
            self.layer.shape(),
            args.batch.b,
            args.batch.t,
            args.plane_stride,
        )
        .map_or(0, |l| l.len());
        let (layout, commit_at) = args.validate(&self.layer, self.slots, len)?;
        let (live, pipeline) = self.prepare(args, &layout, commit_at)?;
        let gpu = self.gpu.clone();
        let iters = iters.max(1);
        let this = &*self;
        let (secs, host, method) = gpu.time_gpu(7, iters, true, |enc, ts| {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("gdn step timing"),
                timestamp_writes: ts,
            });
            if live > 0 {
                pass.set_pipeline(&pipeline);
                pass.set_bind_group(0, this.bind_group.as_ref(), &[]);
                for _ in 0..iters {
                    pass.dispatch_workgroups(this.layer.shape().h_v as u32, live, 1);
                }
            }
        })?;
        Ok(StepTiming {
            per_call: Duration::from_secs_f64(secs),
            host_per_call: Some(Duration::from_secs_f64(host)),
            method: format!("{method}; {}", gpu.info.name),
        })
    }
}
