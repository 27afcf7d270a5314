//! The quantized out_proj on wgpu (`quant.wgsl`; SPEC.md, "The quantized out_proj"): the weights uploaded once
//! ([`Wgpu::load_out_proj`]), products from host slices through [`gdn::quant::OutProj`] (the planes path reads
//! the packing's plane and the group sums of a step's output; the shift path runs its own group-sum pass first).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use gdn::quant::{self, OutProj, Packing, QuantBackend, QuantWeights};
use gdn::{Error, OutputLayout, Result};

use crate::{Gpu, Wgpu};

/// The kernels' source.
pub const QUANT_WGSL: &str = include_str!("quant.wgsl");

/// Output rows and tokens a workgroup takes (the kernel's ROWS and TT).
const ROWS: usize = 2;
const TT: usize = 4;

/// Pipelines by (packing code, shift path, group-sum pass).
pub(crate) type PipelineCache = Mutex<HashMap<(u32, bool, bool), Arc<wgpu::ComputePipeline>>>;

fn pack_code(p: Packing) -> u32 {
    match p {
        Packing::Q2U16 => 0,
        Packing::Q8U32 => 1,
        Packing::Q8U16 => 2,
    }
}

impl Gpu {
    fn quant_pipeline(
        &self,
        pack: u32,
        shift: bool,
        gsum: bool,
    ) -> Result<Arc<wgpu::ComputePipeline>> {
        let key = (pack, shift, gsum);
        let lock = || {
            self.quant
                .lock()
                .map_err(|_| Error::Backend("quant pipeline cache poisoned".into()))
        };
        if let Some(p) = lock()?.get(&key) {
            return Ok(p.clone());
        }
        let constants = [
            ("PACK", pack as f64),
            ("SHIFT", if shift { 1.0 } else { 0.0 }),
        ];
        let p = self.scoped("building the quant pipeline", || {
            let module = self
                .device
                .create_shader_module(wgpu::ShaderModuleDescriptor {
                    label: Some("quant.wgsl"),
                    source: wgpu::ShaderSource::Wgsl(QUANT_WGSL.into()),
                });
            self.device
                .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                    label: Some("gdn quant"),
                    layout: None,
                    module: &module,
                    entry_point: Some(if gsum { "group_sums" } else { "product" }),
                    compilation_options: wgpu::PipelineCompilationOptions {
                        constants: if gsum { &[] } else { &constants },
                        zero_initialize_workgroup_memory: false,
                    },
                    cache: None,
                })
        })?;
        let p = Arc::new(p);
        lock()?.insert(key, p.clone());
        Ok(p)
    }
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    hidden: u32,
    n: u32,
    tokens: u32,
    x_off: u32,
    g_off: u32,
    count: u32,
    _pad: [u32; 2],
}

fn u32_of(v: usize, what: &'static str) -> Result<u32> {
    u32::try_from(v).map_err(|_| Error::Param {
        name: what,
        why: format!("{v} does not fit the kernel's 32-bit index"),
    })
}

/// Quantized out_proj weights on a wgpu device.
pub struct WgpuOutProj {
    gpu: Arc<Gpu>,
    shape: (Packing, usize, usize),
    words: wgpu::Buffer,
    scale: wgpu::Buffer,
    zs: wgpu::Buffer,
}

impl Wgpu {
    /// Uploads quantized out_proj weights (once; every product reads them there).
    pub fn load_out_proj(&self, w: &QuantWeights) -> Result<WgpuOutProj> {
        let gpu = self.gpu.clone();
        let (_, hidden, n) = w.shape();
        let max = gpu.limits.max_storage_buffer_binding_size as usize;
        let words = w.word_bytes_le();
        if words.len() > max || 4 * w.scales().len() > max {
            return Err(Error::Unsupported(format!(
                "{hidden} x {n} weights exceed the adapter's largest binding ({max} bytes)"
            )));
        }
        let up = |label, bytes: &[u8]| {
            gpu.scoped("uploading the out_proj weights", || {
                let buf = gpu.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some(label),
                    size: (bytes.len() as u64).max(16).next_multiple_of(4),
                    usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
                    mapped_at_creation: false,
                });
                gpu.queue.write_buffer(&buf, 0, bytes);
                buf
            })
        };
        Ok(WgpuOutProj {
            shape: w.shape(),
            words: up("gdn quant words", &words)?,
            scale: up("gdn quant scales", bytemuck::cast_slice(w.scales()))?,
            zs: up("gdn quant zero terms", bytemuck::cast_slice(w.zero_terms()))?,
            gpu: self.gpu.clone(),
        })
    }
}

impl WgpuOutProj {
    fn storage(
        &self,
        label: &'static str,
        bytes: u64,
        extra: wgpu::BufferUsages,
    ) -> Result<wgpu::Buffer> {
        self.gpu.scoped("allocating a quant buffer", || {
            self.gpu.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size: bytes.max(16).next_multiple_of(4),
                usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST | extra,
                mapped_at_creation: false,
            })
        })
    }

    fn uniform(&self, p: &Params) -> Result<wgpu::Buffer> {
        let buf = self.gpu.scoped("allocating a quant uniform", || {
            self.gpu.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("gdn quant params"),
                size: std::mem::size_of::<Params>() as u64,
                usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            })
        })?;
        self.gpu.queue.write_buffer(&buf, 0, bytemuck::bytes_of(p));
        Ok(buf)
    }

    /// Runs (optionally the group-sum pass over y at the start of `act`, into a buffer of its own, then) the
    /// product of `x` at `x_off` in `act` with the group sums at `g_off`, and reads `out.len()` floats back.
    fn run(
        &self,
        shift: bool,
        act: &[f32],
        x_off: usize,
        g_off: usize,
        rows: usize,
        out: &mut [f32],
    ) -> Result<()> {
        let (p, hidden, n) = self.shape;
        if rows == 0 {
            return Ok(());
        }
        let gpu = &self.gpu;
        let groups_x = hidden.div_ceil(ROWS);
        let groups_y = rows.div_ceil(TT);
        let lim = gpu.limits.max_compute_workgroups_per_dimension as usize;
        if groups_x > lim || groups_y > lim {
            return Err(Error::Unsupported(format!(
                "{hidden} outputs x {rows} rows: more workgroups than the adapter dispatches"
            )));
        }
        let count = rows * (n / 16);
        let params = Params {
            hidden: u32_of(hidden, "hidden")?,
            n: u32_of(n, "n")?,
            tokens: u32_of(rows, "rows")?,
            x_off: u32_of(x_off, "x")?,
            g_off: u32_of(if shift { 0 } else { g_off }, "gsum")?,
            count: u32_of(count, "groups")?,
            _pad: [0; 2],
        };
        let act_buf = self.storage(
            "gdn quant activations",
            4 * act.len() as u64,
            wgpu::BufferUsages::empty(),
        )?;
        gpu.queue
            .write_buffer(&act_buf, 0, bytemuck::cast_slice(act));
        let out_bytes = 4 * out.len() as u64;
        let out_buf = self.storage("gdn quant output", out_bytes, wgpu::BufferUsages::COPY_SRC)?;
        let read = gpu.scoped("allocating the quant readback", || {
            gpu.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("gdn quant readback"),
                size: out_bytes.max(16).next_multiple_of(4),
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            })
        })?;
        let uni = self.uniform(&params)?;
        let gs_buf = if shift {
            Some(self.storage(
                "gdn quant group sums",
                4 * count as u64,
                wgpu::BufferUsages::empty(),
            )?)
        } else {
            None
        };
        let pipe = gpu.quant_pipeline(pack_code(p), shift, false)?;
        let bind = |pipe: &wgpu::ComputePipeline, entries: &[(u32, &wgpu::Buffer)]| {
            let entries: Vec<wgpu::BindGroupEntry> = entries
                .iter()
                .map(|&(binding, b)| wgpu::BindGroupEntry {
                    binding,
                    resource: b.as_entire_binding(),
                })
                .collect();
            gpu.scoped("binding the quant buffers", || {
                gpu.device.create_bind_group(&wgpu::BindGroupDescriptor {
                    label: Some("gdn quant"),
                    layout: &pipe.get_bind_group_layout(0),
                    entries: &entries,
                })
            })
        };
        let gsum_src = gs_buf.as_ref().unwrap_or(&act_buf);
        let bg = bind(
            &pipe,
            &[
                (0, &self.words),
                (1, &self.scale),
                (2, &self.zs),
                (3, &act_buf),
                (4, &out_buf),
                (5, &uni),
                (6, gsum_src),
            ],
        )?;
        let mut enc = gpu
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
        if let Some(gs) = &gs_buf {
            let gpipe = gpu.quant_pipeline(0, false, true)?;
            let gbg = bind(&gpipe, &[(3, &act_buf), (4, gs), (5, &uni)])?;
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("gdn quant group sums"),
                timestamp_writes: None,
            });
            pass.set_pipeline(&gpipe);
            pass.set_bind_group(0, Some(&gbg), &[]);
            let wg = count.div_ceil(64);
            if wg > lim {
                return Err(Error::Unsupported(format!(
                    "{count} groups: more workgroups than the adapter dispatches"
                )));
            }
            pass.dispatch_workgroups(wg as u32, 1, 1);
        }
        {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("gdn quant product"),
                timestamp_writes: None,
            });
            pass.set_pipeline(&pipe);
            pass.set_bind_group(0, Some(&bg), &[]);
            pass.dispatch_workgroups(groups_x as u32, groups_y as u32, 1);
        }
        enc.copy_buffer_to_buffer(&out_buf, 0, &read, 0, out_bytes);
        gpu.scoped("running the quant product", || {
            gpu.queue.submit([enc.finish()])
        })?;
        gpu.read_mapped_with(&read, out_bytes, |raw| {
            out.copy_from_slice(bytemuck::cast_slice(raw));
        })?;
        gpu.take_errors()
    }
}

impl OutProj for WgpuOutProj {
    fn shape(&self) -> (Packing, usize, usize) {
        self.shape
    }

    fn product_planes(
        &mut self,
        step_out: &[f32],
        layout: &OutputLayout,
        out: &mut [f32],
    ) -> Result<()> {
        let (at_plane, at_gsum) =
            quant::check_planes(self.shape, step_out.len(), layout, out.len())?;
        let (rows, n) = (layout.rows, self.shape.2);
        // only the plane this packing reads and the group sums travel
        let mut act = step_out[at_plane..at_plane + rows * n].to_vec();
        act.extend_from_slice(&step_out[at_gsum..at_gsum + rows * (n / 16)]);
        self.run(false, &act, 0, rows * n, rows, out)
    }

    fn product_shift(&mut self, y: &[f32], rows: usize, out: &mut [f32]) -> Result<()> {
        quant::check_shift(self.shape, y.len(), rows, out.len())?;
        self.run(true, y, 0, 0, rows, out)
    }
}

impl QuantBackend for Wgpu {
    fn load_out_proj(&self, weights: &QuantWeights) -> Result<Box<dyn OutProj>> {
        Ok(Box::new(Wgpu::load_out_proj(self, weights)?))
    }
}
