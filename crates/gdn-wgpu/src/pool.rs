//! A layer's state pool resident on the GPU, and the varlen step.
//!
//! Buffers: the state S of every slot in the pool's layout and dtype (what `write_slot`/`read_slot` take, so they
//! copy it as it is; bf16 is rounded and widened on the host); the conv history in this backend's own layout
//! [slot][h_v][3][d][3] (each value head keeps its own copy of the q and k history it reads, so a workgroup owns
//! all the history it touches and commits it in place); the layer's weights; and, per call, the inputs, the
//! output, the job list and a readback buffer, kept between calls only up to `Options::keep_bytes` each.

use std::sync::Arc;
use std::time::Duration;

use gdn::backend::{check_slot_io, head_history};
use gdn::step::Checked;
use gdn::{
    bf16, DType, Error, Gate, HeadMap, Layer, LayerPool, OutputLayout, PoolOptions, Result, Shape,
    StateLayout, Step, StepTiming, Tensor, TensorMut,
};

use crate::chunk::{self, CParams, Entry, Round};
use crate::kernel::{choose_row_blocks, pending_len, KernelKey, HOLD};
use crate::Gpu;

/// The uniform block of the kernel (`Params` in gdn_step.wgsl).
#[repr(C)]
#[derive(Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
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
}

/// What a pool takes from the backend's options.
pub(crate) struct Settings {
    pub row_blocks: usize,
    pub checked: bool,
    pub keep_bytes: u64,
    pub chunk_from: usize,
    pub chunk_columns: usize,
    pub chunk_len: usize,
    pub chunk_scratch_bytes: Option<u64>,
}

/// A buffer sized per call: reused while large enough, grown to the next power of two up to the keep cap (to
/// exactly what the call needs above it), and released after a call that needed more than the cap.
struct Scratch {
    buf: Option<wgpu::Buffer>,
    usage: wgpu::BufferUsages,
    label: &'static str,
}

impl Scratch {
    fn new(label: &'static str, usage: wgpu::BufferUsages) -> Self {
        Scratch {
            buf: None,
            usage,
            label,
        }
    }

    /// Makes room for `bytes`; true when the buffer was replaced.
    fn reserve(&mut self, gpu: &Gpu, bytes: u64, keep: u64) -> Result<bool> {
        let bytes = bytes
            .max(16)
            .checked_next_multiple_of(16)
            .ok_or_else(|| Error::Backend(format!("{}: {bytes} bytes overflow", self.label)))?;
        if self.buf.as_ref().is_some_and(|b| b.size() >= bytes) {
            return Ok(false);
        }
        let size = match bytes.checked_next_power_of_two() {
            Some(p) if p <= keep => p,
            _ => bytes,
        };
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

    /// Releases the buffer where it is above `keep` bytes; true when it did.
    fn trim(&mut self, keep: u64) -> bool {
        if self.bytes() > keep {
            self.buf = None;
            true
        } else {
            false
        }
    }

    fn bytes(&self) -> u64 {
        self.buf.as_ref().map_or(0, |b| b.size())
    }

    fn get(&self) -> Result<&wgpu::Buffer> {
        self.buf
            .as_ref()
            .ok_or_else(|| Error::Backend(format!("{} not allocated", self.label)))
    }
}

/// A bind group of the step's layout over `resources`, bound at 0, 1, 2, .. in order (`what`: the error's words).
fn bind_group<'a>(
    gpu: &Gpu,
    label: &'static str,
    what: &str,
    resources: impl IntoIterator<Item = wgpu::BindingResource<'a>>,
) -> Result<wgpu::BindGroup> {
    let entries: Vec<wgpu::BindGroupEntry> = resources
        .into_iter()
        .enumerate()
        .map(|(i, resource)| wgpu::BindGroupEntry {
            binding: i as u32,
            resource,
        })
        .collect();
    gpu.scoped(what, || {
        gpu.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some(label),
            layout: &gpu.bind_layout,
            entries: &entries,
        })
    })
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

/// `a * b`, an error naming `what` where it overflows.
fn mul(a: usize, b: usize, what: &str) -> Result<usize> {
    a.checked_mul(b)
        .ok_or_else(|| Error::Backend(format!("{what}: {a} x {b} overflows")))
}

/// `x` as a shader index: every index the kernel computes is below the size it is checked against here, so a
/// size above u32 is an error, never a wrapped offset.
fn index(x: usize, what: &str) -> Result<u32> {
    u32::try_from(x).map_err(|_| {
        Error::Backend(format!(
            "{what}: {x} elements is beyond the kernel's 32-bit indices"
        ))
    })
}

/// Element and byte counts of a pool's device buffers, every product checked and every element count a shader
/// index reaches within u32; sizes of one slot in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct PoolSizes {
    state_bytes: u64,
    hist_bytes: u64,
    slot_state_bytes: u64,
    slot_hist_bytes: u64,
}

impl PoolSizes {
    fn new(sh: &Shape, slots: usize, state: DType) -> Result<Self> {
        // computed here rather than with Shape's own (unchecked) products: on a 32-bit target they can wrap
        let what = "a slot's state";
        let state_len = mul(mul(sh.d, sh.d, what)?, sh.h_v, what)?;
        let hist_len = mul(
            mul(sh.h_v, 9, "a slot's history")?,
            sh.d,
            "a slot's history",
        )?;
        let state_elems = mul(slots, state_len, "the state pool")?;
        let hist_elems = mul(slots, hist_len, "the history pool")?;
        index(state_elems, "the state pool")?;
        index(hist_elems, "the history pool")?;
        // below u32::MAX elements of at most 4 bytes: no u64 product below can overflow
        let es = state.size() as u64;
        Ok(PoolSizes {
            state_bytes: state_elems as u64 * es,
            hist_bytes: hist_elems as u64 * 4,
            slot_state_bytes: state_len as u64 * es,
            slot_hist_bytes: hist_len as u64 * 4,
        })
    }
}

/// Word offsets of the four input tensors (each starts on a word) and the words of all four, for tensors of
/// `(elements, bytes per element)`; every element index and word offset the kernel computes within u32.
fn input_words(tensors: [(usize, usize); 4]) -> Result<([u32; 4], usize)> {
    let mut offs = [0u32; 4];
    let mut words = 0usize;
    for (i, &(len, es)) in tensors.iter().enumerate() {
        // the kernel indexes elements (not words) of 16-bit tensors: the element count must fit
        index(len, "an input tensor")?;
        offs[i] = index(words, "the step's inputs")?;
        words = words
            .checked_add(mul(len, es, "an input tensor")?.div_ceil(4))
            .ok_or_else(|| Error::Backend("the step's inputs overflow".into()))?;
    }
    index(words, "the step's inputs")?;
    Ok((offs, words))
}

/// The device's output layout for one call: y [R][n] at 0, planes at `plane`, 2 `plane`, 3 `plane` (the
/// caller's plane stride need not be even, the device's is), group sums [R][h_v][gw] at 4 `plane`.
#[derive(Clone, Copy, Debug)]
struct DevOut {
    /// Elements of y; also the device's plane stride where planes are on.
    y: usize,
    planes: bool,
    gw: usize,
    /// Elements of the whole buffer, and bytes of one.
    elems: usize,
    size: usize,
}

impl DevOut {
    fn new(key: &KernelKey, h_v: usize, layout: &OutputLayout) -> Result<Self> {
        let what = "the step's output";
        let y = mul(layout.rows, layout.n, what)?;
        let gw = key.group_width();
        let elems = if layout.plane_stride.is_some() {
            mul(y, 4, what)?
                .checked_add(mul(mul(layout.rows, h_v, what)?, gw, what)?)
                .ok_or_else(|| Error::Backend(format!("{what} overflows")))?
        } else {
            y
        };
        index(elems, what)?;
        Ok(DevOut {
            y,
            planes: layout.plane_stride.is_some(),
            gw,
            elems,
            size: key.out.size(),
        })
    }

    /// Below u32::MAX elements of at most 4 bytes: no overflow in u64, on any target.
    fn bytes(&self) -> u64 {
        self.elems as u64 * self.size as u64
    }
}

/// Bytes of a host tensor, as the kernel reads it (16-bit types two a word, little-endian).
fn tensor_bytes<'a>(t: &Tensor<'a>) -> &'a [u8] {
    match *t {
        Tensor::F32(x) => bytemuck::cast_slice(x),
        Tensor::Bf16(x) => bytemuck::cast_slice(x),
        Tensor::F16(x) => bytemuck::cast_slice(x),
    }
}

fn tensor_bytes_mut<'a>(t: &'a mut TensorMut<'_>) -> &'a mut [u8] {
    match t {
        TensorMut::F32(x) => bytemuck::cast_slice_mut(x),
        TensorMut::Bf16(x) => bytemuck::cast_slice_mut(x),
        TensorMut::F16(x) => bytemuck::cast_slice_mut(x),
    }
}

pub struct WgpuPool {
    gpu: Arc<Gpu>,
    layer: Layer,
    slots: usize,
    options: PoolOptions,
    /// The pool's specialisation with f32 activations; a step sets its own dtypes.
    key: KernelKey,
    keep: u64,
    sizes: PoolSizes,
    state: wgpu::Buffer,
    hist: wgpu::Buffer,
    weights: wgpu::Buffer,
    params: wgpu::Buffer,
    inputs: Scratch,
    out: Scratch,
    jobs: Scratch,
    readback: Scratch,
    bind_group: Option<wgpu::BindGroup>,
    /// Held windows (speculative steps): every slot's region, allocated by the first `step_spec`; until then a
    /// placeholder is bound. `held[slot]`: the length of the window the slot holds (0: none).
    pend: Option<wgpu::Buffer>,
    pend_none: wgpu::Buffer,
    held: Vec<usize>,
    /// The half of a slot's shared held records its held window is in (the next held window writes the other).
    half: Vec<u32>,
    /// Host scratch: the live sequences' jobs (slot, first row, length, commit point, then accepted tokens,
    /// held or not, the half the slot's held window is in, 0), history conversions.
    job_list: Vec<[u32; 8]>,
    scratch: Vec<f32>,
    /// The chunked path (`chunk.rs`): the crossover (windows of at least this many tokens to their commit
    /// point), the call's chunked windows and chunk entries, their device buffers and bind group.
    chunk_from: usize,
    /// Tokens a chunk and state columns a workgroup of the chunked recurrence carries.
    geom: chunk::Geom,
    /// The caller's cap on a round's scratch bytes.
    chunk_scratch: Option<u64>,
    chunked: Chunked,
    /// The call's plane stride and input offsets, for the chunked kernels' uniforms.
    chunked_base: (u32, [u32; 4]),
}

/// A call's chunked windows: the job list (two vectors a window, then one a chunk), the rounds, the scratch.
struct Chunked {
    windows: Vec<[u32; 8]>,
    lens: Vec<usize>,
    rounds: Vec<Round>,
    jobs: Scratch,
    cs: Scratch,
    params: wgpu::Buffer,
    bind_group: Option<wgpu::BindGroup>,
}

impl WgpuPool {
    pub(crate) fn new(
        gpu: Arc<Gpu>,
        layer: &Layer,
        slots: usize,
        options: PoolOptions,
        settings: Settings,
    ) -> Result<Self> {
        options.validate()?;
        layer.validate()?;
        let sh = *layer.shape();
        let row_blocks = choose_row_blocks(sh.d, &gpu.limits, settings.row_blocks);
        // the subgroup path wants full subgroups: a workgroup size that is a multiple of every subgroup size the
        // adapter may use (always so with four row blocks: 4 d is a multiple of 64); else workgroup memory
        let w = sh.d * row_blocks;
        let full = w.is_multiple_of(gpu.info.subgroup_max_size.max(1) as usize);
        let key = KernelKey {
            d: sh.d,
            subgroups: gpu.subgroups && full,
            row_blocks,
            checked: settings.checked,
            state: options.state,
            layout: options.layout,
            inputs: [DType::F32; 4],
            out: DType::F32,
        };
        if sh.h_v > gpu.limits.max_compute_workgroups_per_dimension as usize {
            return Err(Error::Backend(format!(
                "{} value heads: the adapter dispatches at most {} workgroups in x",
                sh.h_v, gpu.limits.max_compute_workgroups_per_dimension
            )));
        }
        let sizes = PoolSizes::new(&sh, slots, options.state)?;
        let (state_bytes, hist_bytes) = (sizes.state_bytes, sizes.hist_bytes);
        check_size(&gpu, "the state pool", state_bytes)?;
        check_size(&gpu, "the history pool", hist_bytes)?;
        // build the pipeline now (after the cheap checks), so that a shape the adapter cannot run fails here
        gpu.pipeline(key)?;
        let p = &layer.params;
        // lengths of the layer's own vectors (validated against the shape): in memory already, so no overflow
        let mut weights =
            Vec::with_capacity(p.conv_w.len() + p.dt.len() + p.a.len() + p.gamma.len());
        weights.extend_from_slice(&p.conv_w);
        weights.extend_from_slice(&p.dt);
        weights.extend_from_slice(&p.a);
        weights.extend_from_slice(&p.gamma);
        let weight_bytes = index(weights.len(), "the layer's weights")? as u64 * 4;
        check_size(&gpu, "the layer's weights", weight_bytes)?;
        let storage = wgpu::BufferUsages::STORAGE
            | wgpu::BufferUsages::COPY_DST
            | wgpu::BufferUsages::COPY_SRC;
        let (state, hist, weights_buf, params, pend_none) =
            gpu.scoped("allocating the pool", || {
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
                    mk("gdn weights", weight_bytes, storage),
                    mk(
                        "gdn params",
                        std::mem::size_of::<Params>() as u64,
                        wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
                    ),
                    mk("gdn no held windows", 16, wgpu::BufferUsages::STORAGE),
                )
            })?;
        gpu.queue
            .write_buffer(&weights_buf, 0, bytemuck::cast_slice(&weights));
        let rw = wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST;
        // the chunked kernels where the adapter runs them (else every window runs token by token)
        let geom = chunk::Geom::new(sh.d, settings.chunk_len, settings.chunk_columns);
        let chunk_from = if chunk::check_limits(sh.d, geom, &gpu.limits).is_ok() {
            settings.chunk_from
        } else {
            usize::MAX
        };
        let cparams = gpu.scoped("allocating the pool", || {
            gpu.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("gdn chunk params"),
                size: std::mem::size_of::<CParams>() as u64,
                usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            })
        })?;
        Ok(WgpuPool {
            layer: layer.clone(),
            slots,
            options,
            key,
            keep: settings.keep_bytes,
            sizes,
            state,
            hist,
            weights: weights_buf,
            params,
            inputs: Scratch::new("gdn inputs", rw),
            out: Scratch::new("gdn output", rw | wgpu::BufferUsages::COPY_SRC),
            jobs: Scratch::new("gdn jobs", rw),
            readback: Scratch::new(
                "gdn readback",
                wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            ),
            bind_group: None,
            pend: None,
            pend_none,
            held: vec![0; slots],
            half: vec![0; slots],
            job_list: Vec::new(),
            scratch: Vec::new(),
            chunk_from,
            geom,
            chunk_scratch: settings.chunk_scratch_bytes,
            chunked_base: (0, [0; 4]),
            chunked: Chunked {
                windows: Vec::new(),
                lens: Vec::new(),
                rounds: Vec::new(),
                jobs: Scratch::new("gdn chunk jobs", rw),
                cs: Scratch::new("gdn chunk scratch", wgpu::BufferUsages::STORAGE),
                params: cparams,
                bind_group: None,
            },
            gpu,
        })
    }

    /// Bytes of one slot's S (in the pool's dtype) and of its history.
    fn slot_bytes(&self) -> (u64, u64) {
        (self.sizes.slot_state_bytes, self.sizes.slot_hist_bytes)
    }

    /// Bytes of the per-call device buffers the pool holds now (inputs, output, jobs, readback).
    pub fn scratch_bytes(&self) -> u64 {
        [
            &self.inputs,
            &self.out,
            &self.jobs,
            &self.readback,
            &self.chunked.jobs,
            &self.chunked.cs,
        ]
        .iter()
        .map(|s| s.bytes())
        .sum()
    }

    /// The specialisation a step with these activation dtypes runs.
    pub fn kernel_key(&self, inputs: [DType; 4], out: DType) -> KernelKey {
        KernelKey {
            inputs,
            out,
            ..self.key
        }
    }

    /// Releases the per-call buffers a call needed above the keep cap, and large host scratch.
    fn trim(&mut self) {
        let keep = self.keep;
        let mut dropped = false;
        for s in [
            &mut self.inputs,
            &mut self.out,
            &mut self.jobs,
            &mut self.readback,
        ] {
            dropped |= s.trim(keep);
        }
        let mut cdropped = dropped;
        for s in [&mut self.chunked.jobs, &mut self.chunked.cs] {
            cdropped |= s.trim(keep);
        }
        if dropped {
            self.bind_group = None;
        }
        if cdropped {
            self.chunked.bind_group = None;
        }
        if self.job_list.capacity() as u64 * 32 > keep {
            self.job_list = Vec::new();
        }
    }

    /// The adapter's limits a call must fit, checked before anything is allocated or uploaded: the live
    /// sequences against the dispatch limit, every per-sequence value against the kernel's 32-bit indices, and
    /// the inputs', output's and job list's buffers against the binding size.
    fn check_limits(
        &self,
        step: &Step<'_>,
        checked: &Checked,
        out_dtype: DType,
        accept: Option<&[usize]>,
    ) -> Result<()> {
        let gpu = &self.gpu;
        // the chunked windows' rounds (a window whose scratch cannot be bound is refused here)
        let lens: Vec<usize> = (0..step.seqs.len())
            .filter(|&i| self.runs_chunked(step, checked, accept, i))
            .map(|i| step.seqs[i].len)
            .collect();
        self.plan_rounds(&lens)?;
        let mut live = 0usize;
        for (s, &commit_at) in step.seqs.iter().zip(&checked.commit_at) {
            if s.slot >= 0 {
                index(s.start, "a sequence's first row")?;
                index(s.len, "a sequence's length")?;
                index(commit_at, "a commit point")?;
                live += 1;
            }
        }
        let max = gpu.limits.max_compute_workgroups_per_dimension;
        if index(live, "the step's live sequences")? > max {
            return Err(Error::Backend(format!(
                "{live} sequences in one step; the adapter dispatches at most {max} workgroups in y"
            )));
        }
        let rows = step.rows;
        let tensors = [rows.qkv, rows.alpha, rows.beta, rows.z];
        let (_, words) = input_words(tensors.map(|t| (t.len(), t.dtype().size())))?;
        check_size(gpu, "the step's inputs", words as u64 * 4)?;
        let key = self.kernel_key(step.rows.dtypes(), out_dtype);
        let dev = DevOut::new(&key, self.layer.shape().h_v, &checked.layout)?;
        check_size(gpu, "the step's output", dev.bytes())?;
        check_size(gpu, "the step's job list", live as u64 * 32)
    }

    /// Whether sequence `i` of a step runs in the chunked form: its window counted to its commit point (all of it
    /// where it verifies) reaches the crossover. Its own length and commit only, never the rest of the batch, so
    /// `commit first k` runs on the path of the k-token window. A speculative step's held windows (at most
    /// `HOLD` tokens) and windows that first accept a held prefix run token by token.
    fn runs_chunked(
        &self,
        step: &Step<'_>,
        checked: &Checked,
        accept: Option<&[usize]>,
        i: usize,
    ) -> bool {
        let s = &step.seqs[i];
        let at = checked.commit_at[i];
        let eff = if at > 0 { at } else { s.len };
        let spec_ok = accept.is_none_or(|a| a[i] == 0 && at > 0);
        s.slot >= 0 && eff >= self.chunk_from && spec_ok
    }

    /// Groups chunked windows into rounds that fit the adapter's binding size and dispatch limit.
    fn plan_rounds(&self, lens: &[usize]) -> Result<Vec<Round>> {
        if lens.is_empty() {
            return Ok(Vec::new());
        }
        let l = &self.gpu.limits;
        let sh = self.layer.shape();
        let blocks = sh.h_v * (sh.d / self.geom.bv);
        if blocks > l.max_compute_workgroups_per_dimension as usize {
            return Err(Error::Backend(format!(
                "the chunked path needs {blocks} workgroups in x; the adapter dispatches at most {}",
                l.max_compute_workgroups_per_dimension
            )));
        }
        let max_floats = (l.max_buffer_size.min(l.max_storage_buffer_binding_size) / 4)
            .min(self.chunk_scratch.unwrap_or(u64::MAX) / 4)
            .min(u32::MAX as u64) as usize;
        chunk::plan(
            sh,
            self.geom,
            lens,
            max_floats,
            l.max_compute_workgroups_per_dimension as usize,
        )
    }

    /// Uploads a step's inputs and job list and records its arguments; returns the number of live sequences,
    /// the pipeline and the device's output layout.
    fn prepare(
        &mut self,
        step: &Step<'_>,
        checked: &Checked,
        out_dtype: DType,
        accept: Option<&[usize]>,
    ) -> Result<(u32, Arc<wgpu::ComputePipeline>, DevOut)> {
        let gpu = self.gpu.clone();
        let sh = *self.layer.shape();
        let key = self.kernel_key(step.rows.dtypes(), out_dtype);
        let pipeline = gpu.pipeline(key)?;
        self.job_list.clear();
        self.chunked.windows.clear();
        self.chunked.lens.clear();
        for (i, (s, &commit_at)) in step.seqs.iter().zip(&checked.commit_at).enumerate() {
            if self.runs_chunked(step, checked, accept, i) {
                // scratch tokens and chunks counted per round below
                self.chunked.windows.push([
                    s.slot as u32,
                    index(s.start, "a sequence's first row")?,
                    index(s.len, "a sequence's length")?,
                    index(commit_at, "a commit point")?,
                    0,
                    0,
                    0,
                    0,
                ]);
                self.chunked.lens.push(s.len);
                continue;
            }
            if s.slot >= 0 {
                // a speculative step: the accepted prefix of the slot's held window (checked against it, at most
                // HOLD), and whether this window is held (a verify)
                let (acc, hold) = match accept {
                    Some(a) => (a[i] as u32, (commit_at == 0) as u32),
                    None => (0, 0),
                };
                let half = self.half[s.slot as usize];
                // validate() put start + len within the rows, whose element count is checked below
                self.job_list.push([
                    s.slot as u32,
                    index(s.start, "a sequence's first row")?,
                    index(s.len, "a sequence's length")?,
                    index(commit_at, "a commit point")?,
                    acc,
                    hold,
                    half,
                    0,
                ]);
            }
        }
        self.chunked.rounds = self.plan_rounds(&self.chunked.lens)?;
        // each window's first scratch token and chunk, counted from its round's start; then the chunk entries
        let mut entries: Vec<[u32; 4]> = Vec::new();
        for r in &self.chunked.rounds {
            let (mut tok0, mut chunk0) = (0usize, 0usize);
            for w in r.windows.0..r.windows.1 {
                let len = self.chunked.lens[w];
                // within u32: the round's scratch (tokens times floats a token) fits u32 elements
                self.chunked.windows[w][4] = tok0 as u32;
                self.chunked.windows[w][5] = chunk0 as u32;
                for c in 0..len.div_ceil(self.geom.l) {
                    entries.push([w as u32, c as u32, 0, 0]);
                }
                tok0 += len;
                chunk0 += len.div_ceil(self.geom.l);
            }
        }
        // longest windows first: the GPU starts workgroups roughly in order, so a long window (a prefill chunk in
        // a decode batch) starts at once instead of after every short one; each job's bits do not depend on it
        self.job_list.sort_by_key(|j| std::cmp::Reverse(j[2]));
        // within the dispatch limit: check_limits ran first
        let live = index(self.job_list.len(), "the step's live sequences")?;
        let has_chunked = !self.chunked.windows.is_empty();
        let cgrown = if has_chunked {
            self.upload_chunked(&entries)?
        } else {
            false
        };
        let rows = step.rows;
        let tensors = [rows.qkv, rows.alpha, rows.beta, rows.z];
        let (offs, words) = input_words(tensors.map(|t| (t.len(), t.dtype().size())))?;
        let dev = DevOut::new(&key, sh.h_v, &checked.layout)?;
        let keep = self.keep;
        // below 2^32 words, and a job list below 2^32 entries (16 bytes each): no u64 product overflows
        let mut grown = self.inputs.reserve(&gpu, words as u64 * 4, keep)?;
        grown |= self.out.reserve(&gpu, dev.bytes(), keep)?;
        grown |= self
            .jobs
            .reserve(&gpu, self.job_list.len().max(1) as u64 * 32, keep)?;
        self.bind(grown)?;
        if has_chunked {
            self.bind_chunked(grown || cgrown)?;
        }
        let inputs = self.inputs.get()?;
        for (t, &off) in tensors.iter().zip(&offs) {
            // write_buffer takes whole words: a 16-bit tensor of odd length ends in a padded word
            let bytes = tensor_bytes(t);
            let whole = bytes.len() / 4 * 4;
            let at = off as u64 * 4;
            if whole > 0 {
                gpu.queue.write_buffer(inputs, at, &bytes[..whole]);
            }
            if whole < bytes.len() {
                let mut tail = [0u8; 4];
                tail[..bytes.len() - whole].copy_from_slice(&bytes[whole..]);
                gpu.queue.write_buffer(inputs, at + whole as u64, &tail);
            }
        }
        if live > 0 {
            gpu.queue
                .write_buffer(self.jobs.get()?, 0, bytemuck::cast_slice(&self.job_list));
        }
        let plane = if dev.planes {
            index(dev.y, "the plane stride")?
        } else {
            0
        };
        self.write_params(plane, offs)?;
        self.chunked_base = (plane, offs);
        Ok((live, pipeline, dev))
    }

    /// The chunked windows' job list (two vectors a window, then the chunk entries) uploaded, and the scratch
    /// sized for the largest round; true where a buffer was replaced.
    fn upload_chunked(&mut self, entries: &[[u32; 4]]) -> Result<bool> {
        let gpu = self.gpu.clone();
        let keep = self.keep;
        let sh = *self.layer.shape();
        let c = &mut self.chunked;
        let mut words: Vec<u32> = Vec::with_capacity(8 * c.windows.len() + 4 * entries.len());
        for w in &c.windows {
            words.extend_from_slice(w);
        }
        for e in entries {
            words.extend_from_slice(e);
        }
        // each round's scratch fits u32 floats and the binding (plan_rounds)
        let floats = c
            .rounds
            .iter()
            .filter_map(|r| chunk::regions(&sh, self.geom, r.tokens, r.chunks))
            .map(|r| r.iter().sum::<usize>())
            .max()
            .unwrap_or(0);
        let mut grown = c.jobs.reserve(&gpu, words.len() as u64 * 4, keep)?;
        // (reserve rounds to whole 16-byte vectors, which chunk_run's vec4 view of the scratch needs)
        grown |= c.cs.reserve(&gpu, floats as u64 * 4, keep)?;
        gpu.queue
            .write_buffer(c.jobs.get()?, 0, bytemuck::cast_slice(&words));
        Ok(grown)
    }

    /// (Re)builds the chunked kernels' bind group: the pool's and the call's buffers, the chunked job list, its
    /// uniforms and the scratch.
    fn bind_chunked(&mut self, grown: bool) -> Result<()> {
        if !grown && self.chunked.bind_group.is_some() {
            return Ok(());
        }
        let gpu = self.gpu.clone();
        let entries = [
            self.state.as_entire_binding(),
            self.hist.as_entire_binding(),
            self.inputs.get()?.as_entire_binding(),
            self.weights.as_entire_binding(),
            self.out.get()?.as_entire_binding(),
            self.chunked.jobs.get()?.as_entire_binding(),
            self.chunked.params.as_entire_binding(),
            self.chunked.cs.get()?.as_entire_binding(),
        ];
        let bg = bind_group(
            &gpu,
            "gdn chunked step",
            "binding the chunked step's buffers",
            entries,
        )?;
        self.chunked.bind_group = Some(bg);
        Ok(())
    }

    /// The uniforms of round `r` of the chunked windows.
    fn write_chunk_params(&self, r: usize) -> Result<()> {
        let sh = *self.layer.shape();
        let c = &self.chunked;
        let round = &c.rounds[r];
        let regions = chunk::regions(&sh, self.geom, round.tokens, round.chunks)
            .ok_or_else(|| Error::Backend("the chunked scratch overflows".into()))?;
        let mut offs = [0u32; 8];
        let mut at = 0usize;
        for (o, len) in offs.iter_mut().zip(regions) {
            *o = index(at, "the chunked scratch")?;
            at += len;
        }
        // the readouts over U (see `chunk::regions`)
        offs[4] = offs[2];
        // chunk_run reads the q, k, U (o) and W regions as vec4 rows: they start on multiples of d (of 16)
        debug_assert!(offs[..5].iter().all(|o| o % 4 == 0));
        let first_entry: usize = c.rounds[..r].iter().map(|x| x.chunks).sum();
        let (plane, io) = self.chunked_base;
        let p = CParams {
            plane,
            qkv_off: io[0],
            alpha_off: io[1],
            beta_off: io[2],
            z_off: io[3],
            h_k: index(sh.h_k, "the q/k heads")?,
            h_v: index(sh.h_v, "the value heads")?,
            c: index(sh.channels(), "the conv channels")?,
            n: index(sh.n(), "the output width")?,
            grouped: (self.layer.config.head_map == HeadMap::Grouped) as u32,
            silu: (self.layer.config.gate == Gate::Silu) as u32,
            eps: self.layer.config.eps,
            centry: index(2 * c.windows.len() + first_entry, "the chunk entries")?,
            offs,
            seq0: index(round.windows.0, "the chunked windows")?,
            pad: [0; 2],
        };
        self.gpu
            .queue
            .write_buffer(&c.params, 0, bytemuck::bytes_of(&p));
        Ok(())
    }

    /// The chunked kernels' pipelines for a call's dtypes, in dispatch order.
    fn chunk_pipelines(&self, key: KernelKey) -> Result<[Arc<wgpu::ComputePipeline>; 4]> {
        let g = &self.gpu;
        Ok([
            g.chunk_pipeline(key, self.geom, Entry::Pre)?,
            g.chunk_pipeline(key, self.geom, Entry::Wy)?,
            g.chunk_pipeline(key, self.geom, Entry::Run)?,
            g.chunk_pipeline(key, self.geom, Entry::Out)?,
        ])
    }

    /// Records round `r`'s chunked dispatches, the first `kernels` of the four (all of them but in
    /// `time_chunked_kernels`); its uniforms must be written before the submit.
    fn record_chunked(
        &self,
        pass: &mut wgpu::ComputePass<'_>,
        pipelines: &[Arc<wgpu::ComputePipeline>; 4],
        r: usize,
        kernels: usize,
    ) {
        let sh = self.layer.shape();
        let round = &self.chunked.rounds[r];
        // below the dispatch limit: plan_rounds
        let chunks = round.chunks as u32;
        let windows = (round.windows.1 - round.windows.0) as u32;
        let (h_k, h_v) = (sh.h_k as u32, sh.h_v as u32);
        let blocks = (sh.d / self.geom.bv) as u32;
        pass.set_bind_group(0, self.chunked.bind_group.as_ref(), &[]);
        let grid = [
            (h_k + h_v, chunks),
            (h_v, chunks),
            (h_v * blocks, windows),
            (h_v, chunks),
        ];
        for (p, (x, y)) in pipelines.iter().zip(grid).take(kernels) {
            pass.set_pipeline(p);
            pass.dispatch_workgroups(x, y, 1);
        }
    }

    /// The uniform block: the output's plane stride (device elements), the inputs' word offsets, the layer.
    fn write_params(&self, plane: u32, offs: [u32; 4]) -> Result<()> {
        let sh = *self.layer.shape();
        let params = Params {
            plane,
            qkv_off: offs[0],
            alpha_off: offs[1],
            beta_off: offs[2],
            z_off: offs[3],
            // h_v is below the dispatch limit and d at most 1024, so these fit; checked all the same
            h_k: index(sh.h_k, "the q/k heads")?,
            h_v: index(sh.h_v, "the value heads")?,
            c: index(sh.channels(), "the conv channels")?,
            n: index(sh.n(), "the output width")?,
            grouped: (self.layer.config.head_map == HeadMap::Grouped) as u32,
            silu: (self.layer.config.gate == Gate::Silu) as u32,
            eps: self.layer.config.eps,
        };
        self.gpu
            .queue
            .write_buffer(&self.params, 0, bytemuck::bytes_of(&params));
        Ok(())
    }

    /// (Re)builds the bind group where a buffer changed (`grown`) or none is bound yet.
    fn bind(&mut self, grown: bool) -> Result<()> {
        if !grown && self.bind_group.is_some() {
            return Ok(());
        }
        let gpu = self.gpu.clone();
        let pend = self.pend.as_ref().unwrap_or(&self.pend_none);
        let entries = [
            self.state.as_entire_binding(),
            self.hist.as_entire_binding(),
            self.inputs.get()?.as_entire_binding(),
            self.weights.as_entire_binding(),
            self.out.get()?.as_entire_binding(),
            self.jobs.get()?.as_entire_binding(),
            self.params.as_entire_binding(),
            pend.as_entire_binding(),
        ];
        let bg = bind_group(&gpu, "gdn step", "binding the step's buffers", entries)?;
        self.bind_group = Some(bg);
        Ok(())
    }

    /// Bytes of one slot's held-window region; its element count over the pool within the kernel's indices.
    fn slot_pend_bytes(&self) -> Result<u64> {
        let sh = *self.layer.shape();
        let what = "the held windows' region";
        let per = pending_len(sh.d, sh.h_k, sh.h_v)
            .ok_or_else(|| Error::Backend(format!("{what} overflows")))?;
        index(mul(per, self.slots, what)?, what)?;
        Ok(per as u64 * 4)
    }

    /// Allocates the held windows' region on the first speculative step.
    fn ensure_pend(&mut self) -> Result<()> {
        if self.pend.is_some() {
            return Ok(());
        }
        // below 2^32 floats (checked): no u64 overflow
        let bytes = self.slot_pend_bytes()? * self.slots as u64;
        check_size(&self.gpu, "the held windows' region", bytes)?;
        let gpu = self.gpu.clone();
        let buf = gpu.scoped("allocating the held windows' region", || {
            gpu.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("gdn held windows"),
                size: bytes.max(16),
                usage: wgpu::BufferUsages::STORAGE
                    | wgpu::BufferUsages::COPY_DST
                    | wgpu::BufferUsages::COPY_SRC,
                mapped_at_creation: false,
            })
        })?;
        self.pend = Some(buf);
        self.bind_group = None;
        Ok(())
    }

    /// A plain step (or timing) naming a slot that holds a window is an error.
    fn check_not_held(&self, step: &Step<'_>) -> Result<()> {
        for s in step.seqs.iter().filter(|s| s.slot >= 0) {
            let h = self.held[s.slot as usize];
            if h > 0 {
                return Err(gdn::spec::held_error(s.slot as usize, h));
            }
        }
        Ok(())
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

    /// A step, plain (`accept` None) or speculative (the accepted prefix of each sequence's held window).
    fn step_inner(
        &mut self,
        step: &Step<'_>,
        mut out: TensorMut<'_>,
        accept: Option<&[usize]>,
    ) -> Result<()> {
        let checked = step.validate(&self.layer, self.slots, out.len())?;
        match accept {
            None => self.check_not_held(step)?,
            Some(accept) => {
                let held = |s| self.held[s];
                gdn::spec::check_spec(
                    step,
                    &checked.commit_at,
                    accept,
                    held,
                    HOLD,
                    "the wgpu backend",
                )?;
            }
        }
        self.check_limits(step, &checked, out.dtype(), accept)?;
        if accept.is_some() && step.seqs.iter().any(|s| s.slot >= 0) {
            self.ensure_pend()?;
        }
        let (live, pipeline, dev) = self.prepare(step, &checked, out.dtype(), accept)?;
        let rounds = self.chunked.rounds.len();
        if live == 0 && rounds == 0 {
            return Ok(());
        }
        let gpu = self.gpu.clone();
        let bytes = dev.bytes();
        self.readback.reserve(&gpu, bytes, self.keep)?;
        let cpipes = if rounds > 0 {
            Some(self.chunk_pipelines(self.kernel_key(step.rows.dtypes(), out.dtype()))?)
        } else {
            None
        };
        let mut enc = gpu
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
        if live > 0 {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("gdn step"),
                timestamp_writes: None,
            });
            self.record_dispatch(&mut pass, &pipeline, live);
        }
        if let Some(cp) = &cpipes {
            // one submission a round: each round's uniforms are written before it
            for r in 0..rounds {
                self.write_chunk_params(r)?;
                {
                    let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                        label: Some("gdn chunked step"),
                        timestamp_writes: None,
                    });
                    self.record_chunked(&mut pass, cp, r, 4);
                }
                gpu.queue.submit([enc.finish()]);
                enc = gpu
                    .device
                    .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
            }
        }
        enc.copy_buffer_to_buffer(self.out.get()?, 0, self.readback.get()?, 0, bytes);
        gpu.queue.submit([enc.finish()]);
        // only the rows of live sequences (and no plane padding) reach `out`
        let sh = *self.layer.shape();
        let layout = checked.layout;
        let seqs = step.seqs;
        gpu.read_mapped_with(self.readback.get()?, bytes, |raw| {
            scatter_rows(
                raw,
                tensor_bytes_mut(&mut out),
                &dev,
                &layout,
                seqs.iter()
                    .filter(|s| s.slot >= 0)
                    .map(|s| (s.start, s.len)),
                sh.d,
                sh.h_v,
            );
        })?;
        gpu.take_errors()?;
        if accept.is_some() {
            // the accepted prefixes are committed now; a verify window is held in their place
            for (s, &at) in step.seqs.iter().zip(&checked.commit_at) {
                if s.slot >= 0 {
                    let slot = s.slot as usize;
                    self.held[slot] = if at == 0 { s.len } else { 0 };
                    if at == 0 {
                        self.half[slot] ^= 1;
                    }
                }
            }
        }
        Ok(())
    }

    /// Commits the first `accept` tokens of `slot`'s held window on the device (a job without a window: the
    /// kernel applies them to the state and history and stores both).
    fn commit_pending(&mut self, slot: usize, accept: usize) -> Result<()> {
        let gpu = self.gpu.clone();
        let pipeline = gpu.pipeline(self.key)?;
        let keep = self.keep;
        let mut grown = self.inputs.reserve(&gpu, 16, keep)?;
        grown |= self.out.reserve(&gpu, 16, keep)?;
        grown |= self.jobs.reserve(&gpu, 32, keep)?;
        self.bind(grown)?;
        // slot < slots and accept <= HOLD: both fit u32
        let job = [slot as u32, 0, 0, 0, accept as u32, 0, self.half[slot], 0];
        gpu.queue
            .write_buffer(self.jobs.get()?, 0, bytemuck::cast_slice(&job));
        self.write_params(0, [0; 4])?;
        let mut enc = gpu
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
        {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("gdn commit held"),
                timestamp_writes: None,
            });
            self.record_dispatch(&mut pass, &pipeline, 1);
        }
        gpu.queue.submit([enc.finish()]);
        gpu.take_errors()
    }
}

/// Copies the rows `start..start + len` of every live sequence from the device's output layout (`src`) into the
/// caller's (`dst`), in every plane; bytes, both in the output's dtype.
fn scatter_rows(
    src: &[u8],
    dst: &mut [u8],
    dev: &DevOut,
    layout: &OutputLayout,
    seqs: impl Iterator<Item = (usize, usize)>,
    d: usize,
    h_v: usize,
) {
    // no product here overflows: the caller's layout was checked by `OutputLayout::for_rows` and the output
    // slice holds it (`Step::validate`), the device's by `DevOut::new`; every index is below one of the two
    let es = dev.size;
    let n = layout.n;
    let g = d / 16;
    let mut copy = |from: usize, to: usize, len: usize| {
        dst[to * es..(to + len) * es].copy_from_slice(&src[from * es..(from + len) * es]);
    };
    for (start, len) in seqs {
        copy(start * n, start * n, len * n);
        if let Some(p) = layout.plane_stride {
            for k in 1..4 {
                copy(k * dev.y + start * n, k * p + start * n, len * n);
            }
            let (from, to) = (4 * dev.y, 4 * p);
            if dev.gw == g {
                copy(from + start * h_v * g, to + start * (n / 16), len * h_v * g);
            } else {
                for r in start..start + len {
                    for h in 0..h_v {
                        copy(from + (r * h_v + h) * dev.gw, to + r * (n / 16) + h * g, g);
                    }
                }
            }
        }
    }
}

impl LayerPool for WgpuPool {
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
        let hl = head_history::len(&self.layer);
        let mut own = std::mem::take(&mut self.scratch);
        own.clear();
        own.resize(hl, 0.0);
        head_history::from_spec(&self.layer, hist, &mut own);
        let gpu = &self.gpu;
        // slot < slots, and slots x a slot's bytes was checked at creation
        let (sb, hb) = self.slot_bytes();
        let at = slot as u64 * sb;
        match self.options.state {
            DType::Bf16 => {
                // rounded to nearest even here, once
                let s: Vec<bf16> = state.iter().map(|&x| bf16::from_f32(x)).collect();
                gpu.queue
                    .write_buffer(&self.state, at, bytemuck::cast_slice(&s));
            }
            _ => gpu
                .queue
                .write_buffer(&self.state, at, bytemuck::cast_slice(state)),
        }
        gpu.queue
            .write_buffer(&self.hist, slot as u64 * hb, bytemuck::cast_slice(&own));
        self.scratch = own;
        gpu.queue.submit([]);
        // a held window is dropped with the state it was verified from
        self.held[slot] = 0;
        gpu.take_errors()
    }

    fn read_slot(&mut self, slot: usize, state: &mut [f32], hist: &mut [f32]) -> Result<()> {
        check_slot_io(&self.layer, self.slots, slot, state.len(), hist.len())?;
        let hl = head_history::len(&self.layer);
        let gpu = self.gpu.clone();
        let sdt = self.options.state;
        let (sb, hb) = self.slot_bytes();
        self.readback.reserve(&gpu, sb + hb, self.keep)?;
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
        let split = usize::try_from(sb)
            .map_err(|_| Error::Backend(format!("a slot's {sb} bytes exceed the address space")))?;
        gpu.read_mapped_with(rb, sb + hb, |bytes| {
            let (s, h) = bytes.split_at(split);
            match sdt {
                DType::Bf16 => {
                    for (x, b) in state.iter_mut().zip(s.chunks_exact(2)) {
                        *x = bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
                    }
                }
                _ => bytemuck::cast_slice_mut::<f32, u8>(state).copy_from_slice(s),
            }
            bytemuck::cast_slice_mut::<f32, u8>(&mut own).copy_from_slice(h);
        })?;
        head_history::to_spec(&self.layer, &own, hist);
        self.scratch = own;
        self.trim();
        gpu.take_errors()
    }

    /// On the device: the slot's S and H cleared in place.
    fn reset_slot(&mut self, slot: usize) -> Result<()> {
        let sh = *self.layer.shape();
        check_slot_io(&self.layer, self.slots, slot, sh.state_len(), sh.hist_len())?;
        let (sb, hb) = self.slot_bytes();
        let gpu = &self.gpu;
        let mut enc = gpu
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
        enc.clear_buffer(&self.state, slot as u64 * sb, Some(sb));
        enc.clear_buffer(&self.hist, slot as u64 * hb, Some(hb));
        gpu.queue.submit([enc.finish()]);
        self.held[slot] = 0;
        gpu.take_errors()
    }

    /// On the device: slot `from`'s S and H copied onto slot `to` (bitwise, in the pool's dtype).
    fn copy_slot(&mut self, from: usize, to: usize) -> Result<()> {
        let sh = *self.layer.shape();
        for slot in [from, to] {
            check_slot_io(&self.layer, self.slots, slot, sh.state_len(), sh.hist_len())?;
        }
        if from == to {
            return Ok(());
        }
        let (sb, hb) = self.slot_bytes();
        // a held window travels with its slot (a fork): its region too (allocated, since a window is held)
        let held = self.held[from];
        let pending = match &self.pend {
            Some(p) if held > 0 => Some((p, self.slot_pend_bytes()?)),
            _ => None,
        };
        let pbytes = pending.map_or(0, |p| p.1);
        let gpu = &self.gpu;
        let mut enc = gpu
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
        // WebGPU forbids one buffer as source and destination of a copy: through a staging buffer of one slot
        let staging = gpu.scoped("staging a slot copy", || {
            gpu.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("gdn slot copy"),
                size: sb + hb + pbytes,
                usage: wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            })
        })?;
        enc.copy_buffer_to_buffer(&self.state, from as u64 * sb, &staging, 0, sb);
        enc.copy_buffer_to_buffer(&self.hist, from as u64 * hb, &staging, sb, hb);
        enc.copy_buffer_to_buffer(&staging, 0, &self.state, to as u64 * sb, sb);
        enc.copy_buffer_to_buffer(&staging, sb, &self.hist, to as u64 * hb, hb);
        if let Some((p, pb)) = pending {
            enc.copy_buffer_to_buffer(p, from as u64 * pb, &staging, sb + hb, pb);
            enc.copy_buffer_to_buffer(&staging, sb + hb, p, to as u64 * pb, pb);
        }
        gpu.queue.submit([enc.finish()]);
        self.held[to] = held;
        self.half[to] = self.half[from];
        gpu.take_errors()
    }

    fn step_varlen(&mut self, step: &Step<'_>, out: TensorMut<'_>) -> Result<()> {
        let r = self.step_inner(step, out, None);
        self.trim();
        r
    }

    /// One state pass: the kernel applies each sequence's accepted prefix as it first loads the state (the
    /// held tokens' keys, deltas and gates, kept on the device by the window that held them), then runs the
    /// new window, keeping what a verify window's commit would apply.
    fn step_spec(&mut self, step: &Step<'_>, accept: &[usize], out: TensorMut<'_>) -> Result<()> {
        let r = self.step_inner(step, out, Some(accept));
        self.trim();
        r
    }

    /// Every check `step_varlen` makes, nothing run or allocated. The output's dtype is not known here, so its
    /// buffer is checked as f32 (the largest): a call this accepts fits with any output dtype.
    fn check_step(&self, step: &Step<'_>, out_len: usize) -> Result<()> {
        let checked = step.validate(&self.layer, self.slots, out_len)?;
        self.check_not_held(step)?;
        self.check_limits(step, &checked, DType::F32, None)
    }

    fn held(&self, slot: usize) -> usize {
        self.held.get(slot).copied().unwrap_or(0)
    }

    fn commit_held(&mut self, slot: usize, accept: usize) -> Result<()> {
        gdn::spec::check_commit_held(slot, self.slots, accept, self.held(slot))?;
        if accept > 0 {
            let r = self.commit_pending(slot, accept);
            self.trim();
            r?;
        }
        self.held[slot] = 0;
        Ok(())
    }

    /// Inputs uploaded once; then rounds of back-to-back dispatches in one compute pass, timed with GPU
    /// timestamps where the adapter has them (else the host clock around submit and wait); the median round.
    fn time_varlen(
        &mut self,
        step: &Step<'_>,
        out_dtype: DType,
        iters: usize,
    ) -> Result<StepTiming> {
        self.time_kernels(step, out_dtype, iters, 4)
    }
}

impl WgpuPool {
    /// `time_varlen` of a pass that runs the token-serial kernel and the first `kernels` chunked kernels.
    fn time_kernels(
        &mut self,
        step: &Step<'_>,
        out_dtype: DType,
        iters: usize,
        kernels: usize,
    ) -> Result<StepTiming> {
        // the output buffer is ours here: validate against the length the layout asks for
        let sh = *self.layer.shape();
        let len = step.layout(&sh)?.len();
        let checked = step.validate(&self.layer, self.slots, len)?;
        self.check_not_held(step)?;
        self.check_limits(step, &checked, out_dtype, None)?;
        let (live, pipeline, _) = self.prepare(step, &checked, out_dtype, None)?;
        let gpu = self.gpu.clone();
        let iters = iters.max(1);
        let rounds = self.chunked.rounds.len();
        if rounds > 1 {
            return Err(Error::Unsupported(
                "timing a step whose chunked windows need several rounds of scratch".into(),
            ));
        }
        let cpipes = if rounds == 1 {
            self.write_chunk_params(0)?;
            Some(self.chunk_pipelines(self.kernel_key(step.rows.dtypes(), out_dtype))?)
        } else {
            None
        };
        let this = &*self;
        let timed = gpu.time_gpu(7, iters, true, |enc, ts| {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("gdn step timing"),
                timestamp_writes: ts,
            });
            for _ in 0..iters {
                if live > 0 {
                    pass.set_pipeline(&pipeline);
                    pass.set_bind_group(0, this.bind_group.as_ref(), &[]);
                    pass.dispatch_workgroups(sh.h_v as u32, live, 1);
                }
                if let Some(cp) = &cpipes {
                    this.record_chunked(&mut pass, cp, 0, kernels);
                }
            }
        });
        self.trim();
        let (secs, host, method) = timed?;
        Ok(StepTiming {
            per_call: Duration::from_secs_f64(secs),
            host_per_call: Some(Duration::from_secs_f64(host)),
            method: format!("{method}; {}", gpu.info.name),
        })
    }

    /// Where a chunked step's time goes: for each chunked kernel in dispatch order (`chunk_pre`, `chunk_wy`,
    /// `chunk_run`, `chunk_out`), the time of a pass running the kernels up to it less that of the pass up to the
    /// one before (each `time_varlen`'s way; the first pass holds the token-serial kernel alone, or nothing). A
    /// difference of two medians: noisy where a kernel is short, possibly below zero.
    pub fn time_chunked_kernels(
        &mut self,
        step: &Step<'_>,
        out_dtype: DType,
        iters: usize,
    ) -> Result<[f64; 4]> {
        let mut prefix = [0.0f64; 5];
        for (k, p) in prefix.iter_mut().enumerate() {
            *p = self
                .time_kernels(step, out_dtype, iters, k)?
                .per_call
                .as_secs_f64();
        }
        Ok(std::array::from_fn(|k| prefix[k + 1] - prefix[k]))
    }

    /// The crossover this pool uses: `usize::MAX` where the adapter cannot run the chunked kernels (or never
    /// chunking was asked for).
    pub fn chunk_from(&self) -> usize {
        self.chunk_from
    }

    /// Tokens of a chunk and state columns of a chunked workgroup this pool uses.
    pub fn chunk_geometry(&self) -> (usize, usize) {
        (self.geom.l, self.geom.bv)
    }

    /// The pool's state layout (what `read_slot` and `write_slot` take).
    pub fn state_layout(&self) -> StateLayout {
        self.options.layout
    }
}

/// Every size from a caller overflowing, on the host: no GPU needed (the pool and step run these same checks
/// before touching the device; `tests/varlen.rs` runs the pool's through a backend).
#[cfg(test)]
mod tests {
    use super::*;

    fn backend_err(r: Result<impl std::fmt::Debug>, want: &str) {
        match r {
            Err(Error::Backend(why)) => assert!(why.contains(want), "{why} (wanted '{want}')"),
            other => panic!("expected an error about '{want}', got {other:?}"),
        }
    }

    #[test]
    fn pool_sizes_overflow_is_an_error() {
        let sh = Shape::SEED;
        // d d h_v = 786 432 floats a slot: 5461 slots are the most below 2^32 elements
        let max = u32::MAX as usize / sh.state_len();
        for state in [DType::F32, DType::Bf16] {
            let ok = PoolSizes::new(&sh, max, state).unwrap();
            assert_eq!(ok.state_bytes, (max * sh.state_len() * state.size()) as u64);
            assert_eq!(ok.slot_hist_bytes, (sh.h_v * 9 * sh.d * 4) as u64);
            backend_err(PoolSizes::new(&sh, max + 1, state), "32-bit indices");
            backend_err(PoolSizes::new(&sh, usize::MAX / 2, state), "overflows");
            backend_err(PoolSizes::new(&sh, usize::MAX, state), "overflows");
        }
        // a shape whose one slot overflows (not a valid Shape: the products are checked all the same)
        let huge = Shape {
            d: 1024,
            h_k: 1,
            h_v: usize::MAX / 4,
        };
        backend_err(PoolSizes::new(&huge, 1, DType::F32), "overflows");
        assert!(PoolSizes::new(&sh, 0, DType::F32).is_ok());
    }

    #[test]
    fn input_words_beyond_32_bits_are_errors() {
        let big = u32::MAX as usize;
        // one f32 qkv of 2^32 - 1 elements fits alone
        let (offs, words) = input_words([(big, 4), (0, 4), (0, 4), (0, 4)]).unwrap();
        assert_eq!(
            (offs, words),
            ([0, big as u32, big as u32, big as u32], big)
        );
        // one element more: the element index wraps
        backend_err(
            input_words([(big + 1, 4), (1, 4), (1, 4), (1, 4)]),
            "an input tensor",
        );
        // 16-bit: 2^32 elements are 2^31 words, but the kernel indexes elements
        backend_err(
            input_words([(big + 1, 2), (1, 2), (1, 2), (1, 2)]),
            "an input tensor",
        );
        // each tensor fits, their sum does not: an offset or the total wraps
        backend_err(
            input_words([(1 << 31, 4), (1 << 31, 4), (1, 4), (1, 4)]),
            "the step's inputs",
        );
        backend_err(
            input_words([(usize::MAX, 4), (1, 4), (1, 4), (1, 4)]),
            "an input tensor",
        );
        // odd 16-bit tensors end in a padded word
        let (offs, words) = input_words([(3, 2), (1, 2), (2, 4), (5, 2)]).unwrap();
        assert_eq!((offs, words), ([0, 2, 3, 5], 8));
    }

    #[test]
    fn output_beyond_32_bits_is_an_error() {
        let sh = Shape::SEED;
        let n = sh.n();
        let layout = |rows: usize, plane_stride| OutputLayout {
            rows,
            n,
            plane_stride,
        };
        for out in [DType::F32, DType::Bf16, DType::F16] {
            let key = KernelKey {
                out,
                ..KernelKey::plain(sh.d)
            };
            // rows x n: the most rows below 2^32 elements, then one more, then past usize
            let rows = u32::MAX as usize / n;
            let dev = DevOut::new(&key, sh.h_v, &layout(rows, None)).unwrap();
            assert_eq!(dev.bytes(), (rows * n * out.size()) as u64);
            backend_err(
                DevOut::new(&key, sh.h_v, &layout(rows + 1, None)),
                "32-bit indices",
            );
            backend_err(
                DevOut::new(&key, sh.h_v, &layout(usize::MAX / 2, None)),
                "overflows",
            );
            // planes: y fits, four planes and the group sums do not
            let rows = u32::MAX as usize / (4 * n);
            backend_err(
                DevOut::new(&key, sh.h_v, &layout(rows, Some(rows * n))),
                "32-bit indices",
            );
            let per_row = 4 * n + sh.h_v * key.group_width();
            let rows = u32::MAX as usize / per_row;
            assert!(DevOut::new(&key, sh.h_v, &layout(rows, Some(rows * n))).is_ok());
            backend_err(
                DevOut::new(&key, sh.h_v, &layout(rows + 1, Some((rows + 1) * n))),
                "32-bit indices",
            );
            // a caller's plane stride past u32 is fine: the device uses its own (R n), the host copies
            let dev = DevOut::new(&key, sh.h_v, &layout(2, Some(1 << 33))).unwrap();
            assert_eq!(dev.y, 2 * n);
        }
    }

    #[test]
    fn index_and_mul_name_what_overflowed() {
        assert_eq!(index(u32::MAX as usize, "x").unwrap(), u32::MAX);
        backend_err(index(u32::MAX as usize + 1, "the thing"), "the thing");
        backend_err(mul(usize::MAX, 2, "the product"), "the product");
        assert_eq!(mul(3, 4, "x").unwrap(), 12);
    }
}
