//! gdn-wgpu: the GDN window step (docs/SPEC.md) on wgpu, for Vulkan, Metal and DX12 adapters (and WebGPU's
//! limits where a browser runs it).
//!
//! One WGSL kernel template (`gdn_step.wgsl`), specialised when its pipeline is built per head dim (the loops over
//! state rows written out, so the state stays in registers), per pool (f32 or bf16 state, key- or value-major
//! layout) and per step dtypes (qkv, alpha, beta, z and the output each f32, bf16 or f16). A varlen step is one
//! dispatch: one workgroup per (sequence, value head), each reading its sequence's slot, rows, length and commit
//! point from a job list, the head's state in registers for the whole window, the conv, norms, delta rule,
//! readout, gated RMS norm, planes and group sums fused. Two reduction paths: subgroup operations where the
//! adapter has them (any subgroup size), workgroup memory where it has none. Long windows (from
//! [`Options::chunk_from`] tokens to their commit point; 128 by default on a GPU, the crossover measured on an H100)
//! run in the chunked WY / UT form instead (`chunk.wgsl`:
//! four dispatches, the state in column blocks in workgroup memory; [`Wgpu::measure_crossover`] measures where it
//! pays). The library reads no environment variables: everything is in [`Options`].
//!
//! ```no_run
//! use gdn::Backend;
//! let backend = gdn_wgpu::Wgpu::new()?; // gdn::Error::Unavailable without an adapter
//! println!("{}", backend.name());
//! # Ok::<(), gdn::Error>(())
//! ```

mod chunk;
mod kernel;
mod pool;
pub mod quant;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use gdn::{Backend, Error, Layer, LayerPool, Result};

pub use chunk::{CHUNK_ENTRIES, DEFAULT_CHUNK_FROM};
pub use kernel::KernelKey;
pub use pool::WgpuPool;
pub use quant::WgpuOutProj;

/// Whether the kernel uses subgroup operations.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Subgroups {
    /// Where the adapter supports them.
    #[default]
    Auto,
    /// Never: the workgroup-memory path, as on a browser's WebGPU without the subgroups extension. The device
    /// is created without the feature.
    Off,
    /// Always: an adapter without them is `gdn::Error::Unavailable`.
    Require,
}

/// How to set the backend up. The library reads no environment variables: the command line, the tests and the
/// examples map theirs (`GDN_WGPU_ADAPTER`, `GDN_WGPU_ROW_BLOCKS`, `GDN_WGPU_CHECKS`) onto these fields.
#[derive(Clone, Debug)]
pub struct Options {
    pub subgroups: Subgroups,
    /// Part of the adapter's name to pick (case-insensitive, e.g. `nvidia` or `llvmpipe`); `None`: the
    /// high-performance adapter wgpu chooses.
    pub adapter: Option<String>,
    /// Row blocks per value head: the workgroup has `d * row_blocks` threads, each holding `d / row_blocks`
    /// state rows in registers (4 by default: 512 threads at d = 128). Lowered where the adapter's limits or the
    /// shape need it.
    pub row_blocks: usize,
    /// Keep wgpu's runtime checks in the kernel: bounds checks on every buffer index and loop bounding. Off by
    /// default: every index the kernel computes is derived from sizes the pool checked on the host (NOTES.md
    /// lists them), and the checks cost up to 7 % of the step on an H200.
    pub runtime_checks: bool,
    /// A pool keeps its per-call buffers (inputs, output, job list, readback) between calls up to this many
    /// bytes each; a call that needs a larger one gets it for that call only (released when it returns).
    pub keep_bytes: u64,
    /// Windows of at least this many tokens run in the chunked form (WY / UT, `chunk.wgsl`), shorter ones token
    /// by token. A window is counted to its commit point where it commits (all of it where it verifies), so a
    /// `commit first k` window runs on the path of the k-token window it must equal bitwise. `Some(usize::MAX)`:
    /// never chunked. `None` (the default): the crossover for the adapter's kind (NOTES.md): on a GPU
    /// [`DEFAULT_CHUNK_FROM`] (64 tokens, measured on an H100); on a CPU adapter
    /// (lavapipe) [`CPU_CHUNK_FROM`].
    pub chunk_from: Option<usize>,
    /// State columns one workgroup of the chunked recurrence carries (8, 16 or 32; lowered or raised to one that
    /// divides d): fewer columns, more workgroups in flight a window. [`DEFAULT_CHUNK_COLUMNS`] by default.
    pub chunk_columns: usize,
    /// Tokens of a chunk (16 or 32; another value means 32). [`DEFAULT_CHUNK_LEN`] by default.
    pub chunk_len: usize,
    /// The most bytes of scratch one round of chunked windows binds (`None`: the adapter's binding limit). A call's
    /// chunked windows are grouped into rounds under it; a window that alone needs more is refused.
    pub chunk_scratch_bytes: Option<u64>,
}

/// The crossover on a CPU adapter (lavapipe): the chunked form is slower there (0.8-0.9x), but lavapipe stops
/// every loop of an invocation after 65535 iterations in all, so the token kernel's loop over a window's tokens
/// cannot finish windows that long (its subgroup path stopped after 21845 tokens); the chunked kernels' loops
/// run at most a window's chunk count (or are unrolled).
pub const CPU_CHUNK_FROM: usize = 16384;

/// [`Options::chunk_len`] by default.
pub const DEFAULT_CHUNK_LEN: usize = chunk::DEFAULT_LEN;

/// [`Options::chunk_columns`] by default.
pub const DEFAULT_CHUNK_COLUMNS: usize = chunk::DEFAULT_COLUMNS;

/// [`Options::keep_bytes`] by default: a B 256 decode step at the seed shape (10 MiB of f32 inputs) stays
/// resident; prefill-sized calls allocate per call.
pub const DEFAULT_KEEP_BYTES: u64 = 32 << 20;

impl Default for Options {
    fn default() -> Self {
        Options {
            subgroups: Subgroups::Auto,
            adapter: None,
            row_blocks: 4,
            runtime_checks: false,
            keep_bytes: DEFAULT_KEEP_BYTES,
            chunk_from: None,
            chunk_columns: DEFAULT_CHUNK_COLUMNS,
            chunk_len: DEFAULT_CHUNK_LEN,
            chunk_scratch_bytes: None,
        }
    }
}

/// The wgpu backend: one adapter's device and queue, and the pipelines built so far.
///
/// Devices are opened once per process for each (adapter, subgroup mode) and shared by every `Wgpu` made with
/// those options, so pipelines are compiled once (Mesa's lavapipe compiles a pipeline in about half a second).
#[derive(Clone)]
pub struct Wgpu {
    gpu: Arc<Gpu>,
    row_blocks: usize,
    runtime_checks: bool,
    keep_bytes: u64,
    chunk_from: Option<usize>,
    chunk_columns: usize,
    chunk_len: usize,
    chunk_scratch_bytes: Option<u64>,
}

type DeviceKey = (Option<String>, Subgroups);

fn devices() -> &'static Mutex<HashMap<DeviceKey, Arc<Gpu>>> {
    static DEVICES: OnceLock<Mutex<HashMap<DeviceKey, Arc<Gpu>>>> = OnceLock::new();
    DEVICES.get_or_init(|| Mutex::new(HashMap::new()))
}

/// What every pool of a backend shares.
pub(crate) struct Gpu {
    pub device: wgpu::Device,
    pub queue: wgpu::Queue,
    pub info: wgpu::AdapterInfo,
    pub limits: wgpu::Limits,
    pub subgroups: bool,
    pub timestamps: bool,
    pub timestamps_in_encoders: bool,
    pub bind_layout: wgpu::BindGroupLayout,
    pub pipeline_layout: wgpu::PipelineLayout,
    pipelines: Mutex<HashMap<KernelKey, Arc<wgpu::ComputePipeline>>>,
    /// The chunked kernels' pipelines, per key (its d, state and dtypes) and entry point.
    #[allow(clippy::type_complexity)]
    chunk_pipelines:
        Mutex<HashMap<(KernelKey, chunk::Geom, chunk::Entry), Arc<wgpu::ComputePipeline>>>,
    copy: OnceLock<Arc<wgpu::ComputePipeline>>,
    /// The quantized out_proj's pipelines by (packing, shift path, group-sum pass), built on first use.
    pub(crate) quant: quant::PipelineCache,
    /// Errors wgpu reported outside an error scope (the device's uncaptured-error handler).
    uncaptured: Arc<Mutex<Vec<String>>>,
}

impl Wgpu {
    /// The default adapter, with subgroups where it has them.
    pub fn new() -> Result<Self> {
        Self::with_options(Options::default())
    }

    /// The default adapter, on the workgroup-memory path (no subgroup operations).
    pub fn without_subgroups() -> Result<Self> {
        Self::with_options(Options {
            subgroups: Subgroups::Off,
            ..Options::default()
        })
    }

    pub fn with_options(options: Options) -> Result<Self> {
        let key = (options.adapter.clone(), options.subgroups);
        let mut cache = devices()
            .lock()
            .map_err(|_| Error::Backend("device cache poisoned".into()))?;
        let gpu = match cache.get(&key) {
            Some(gpu) => gpu.clone(),
            None => {
                let gpu = Arc::new(pollster::block_on(Gpu::open(&options))?);
                cache.insert(key, gpu.clone());
                gpu
            }
        };
        Ok(Wgpu {
            gpu,
            row_blocks: options.row_blocks,
            runtime_checks: options.runtime_checks,
            keep_bytes: options.keep_bytes,
            chunk_from: options.chunk_from,
            chunk_columns: options.chunk_columns,
            chunk_len: options.chunk_len,
            chunk_scratch_bytes: options.chunk_scratch_bytes,
        })
    }

    /// The same backend with another crossover to the chunked form ([`Options::chunk_from`]): windows of at least
    /// `tokens` tokens (to their commit point) run chunked; `usize::MAX` never. Pools made afterwards use it.
    pub fn with_chunk_from(mut self, tokens: usize) -> Self {
        self.chunk_from = Some(tokens);
        self
    }

    /// The crossover to the chunked form this backend's pools use (the adapter's measured default unless set).
    pub fn chunk_from(&self) -> usize {
        self.chunk_from
            .unwrap_or(if self.gpu.info.device_type == wgpu::DeviceType::Cpu {
                CPU_CHUNK_FROM
            } else {
                DEFAULT_CHUNK_FROM
            })
    }

    /// The adapter's limits the backend runs under.
    pub fn limits(&self) -> &wgpu::Limits {
        &self.gpu.limits
    }

    /// A pool as its concrete type (what [`Backend::create_pool_with`] boxes).
    pub fn pool(&self, layer: &Layer, slots: usize, options: gdn::PoolOptions) -> Result<WgpuPool> {
        WgpuPool::new(
            self.gpu.clone(),
            layer,
            slots,
            options,
            pool::Settings {
                row_blocks: self.row_blocks,
                checked: self.runtime_checks,
                keep_bytes: self.keep_bytes,
                chunk_from: self.chunk_from(),
                chunk_columns: self.chunk_columns,
                chunk_len: self.chunk_len,
                chunk_scratch_bytes: self.chunk_scratch_bytes,
            },
        )
    }

    /// Whether the kernels of this backend use subgroup operations.
    pub fn uses_subgroups(&self) -> bool {
        self.gpu.subgroups
    }

    /// The adapter's description.
    pub fn adapter_info(&self) -> &wgpu::AdapterInfo {
        &self.gpu.info
    }
}

/// What [`Wgpu::measure_crossover`] measured.
#[derive(Clone, Debug)]
pub struct Crossover {
    /// (window length, token-serial seconds a call, chunked seconds a call) for each length tried.
    pub points: Vec<(usize, f64, f64)>,
    /// The shortest length tried from which the chunked form was faster at that and every longer length tried
    /// (`usize::MAX`: at none), and at least one more than the longest held window (`step_spec` runs held windows
    /// token by token, so a lower crossover would make its bits differ from the two-pass flow's).
    pub chunk_from: usize,
}

impl Wgpu {
    /// Measures the crossover to the chunked form on this adapter for `layer`'s shape: one window of each length
    /// in `lens`, commit all, f32, timed with `time_varlen` (`iters` calls a round) on both paths. Pass the
    /// result's `chunk_from` to [`Wgpu::with_chunk_from`]; the bits of a window depend on its path, so choose it
    /// once, not per call.
    pub fn measure_crossover(
        &self,
        layer: &Layer,
        lens: &[usize],
        iters: usize,
    ) -> Result<Crossover> {
        let sh = *layer.shape();
        let mut rng = gdn::synth::Synth::new(1);
        let (st, h) = rng.seq_state(layer);
        let tmax = lens.iter().copied().max().unwrap_or(0);
        let b = rng.batch(layer, 1, tmax);
        let mut points = Vec::new();
        for &t in lens.iter().filter(|&&t| t > 0) {
            let seqs = [gdn::Seq {
                slot: 0,
                start: 0,
                len: t,
                commit: gdn::Commit::All,
            }];
            let step = gdn::Step {
                rows: gdn::step::Rows {
                    qkv: gdn::Tensor::F32(&b.qkv[..t * sh.channels()]),
                    alpha: gdn::Tensor::F32(&b.alpha[..t * sh.h_v]),
                    beta: gdn::Tensor::F32(&b.beta[..t * sh.h_v]),
                    z: gdn::Tensor::F32(&b.z[..t * sh.n()]),
                },
                seqs: &seqs,
                plane_stride: None,
            };
            let mut secs = [0.0; 2];
            for (k, from) in [usize::MAX, 1].into_iter().enumerate() {
                let mut pool = self.clone().with_chunk_from(from).pool(
                    layer,
                    1,
                    gdn::PoolOptions::default(),
                )?;
                pool.write_slot(0, &st, &h)?;
                secs[k] = pool
                    .time_varlen(&step, gdn::DType::F32, iters)?
                    .per_call
                    .as_secs_f64();
            }
            points.push((t, secs[0], secs[1]));
        }
        points.sort_by_key(|p| p.0);
        // the shortest length from which chunked wins at every longer length tried
        let mut chunk_from = usize::MAX;
        for &(t, serial, chunked) in points.iter().rev() {
            if chunked < serial {
                chunk_from = t;
            } else {
                break;
            }
        }
        if chunk_from != usize::MAX {
            chunk_from = chunk_from.max(kernel::HOLD + 1);
        }
        Ok(Crossover { points, chunk_from })
    }
}

impl Gpu {
    async fn open(options: &Options) -> Result<Gpu> {
        let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
        // no `with_env()`: the library reads no environment variables (WGPU_BACKEND and friends included)
        desc.flags = wgpu::InstanceFlags::empty();
        desc.backends = wgpu::Backends::PRIMARY;
        let instance = wgpu::Instance::new(desc);
        let adapter = match &options.adapter {
            Some(name) => {
                let want = name.to_lowercase();
                let all = instance.enumerate_adapters(wgpu::Backends::all()).await;
                let names: Vec<String> = all.iter().map(|a| a.get_info().name).collect();
                all.into_iter()
                    .find(|a| a.get_info().name.to_lowercase().contains(&want))
                    .ok_or_else(|| {
                        Error::Unavailable(format!(
                            "no wgpu adapter named like '{name}'; found {names:?}"
                        ))
                    })?
            }
            None => instance
                .request_adapter(&wgpu::RequestAdapterOptions {
                    power_preference: wgpu::PowerPreference::HighPerformance,
                    ..Default::default()
                })
                .await
                .map_err(|e| {
                    Error::Unavailable(format!(
                        "no wgpu adapter (Vulkan, Metal or DX12): {e}; on Linux, Mesa's lavapipe \
                         (apt-get install mesa-vulkan-drivers libvulkan1) provides one on the CPU"
                    ))
                })?,
        };
        let info = adapter.get_info();
        let has_subgroups = adapter.features().contains(wgpu::Features::SUBGROUP);
        let subgroups = match options.subgroups {
            Subgroups::Off => false,
            Subgroups::Auto => has_subgroups,
            Subgroups::Require if has_subgroups => true,
            Subgroups::Require => {
                return Err(Error::Unavailable(format!(
                    "adapter '{}' ({:?}) has no subgroup operations",
                    info.name, info.backend
                )))
            }
        };
        let mut features = wgpu::Features::empty();
        if subgroups {
            features |= wgpu::Features::SUBGROUP;
        }
        let timestamps = adapter.features().contains(wgpu::Features::TIMESTAMP_QUERY);
        let timestamps_in_encoders = timestamps
            && adapter
                .features()
                .contains(wgpu::Features::TIMESTAMP_QUERY_INSIDE_ENCODERS);
        if timestamps {
            features |= wgpu::Features::TIMESTAMP_QUERY;
        }
        if timestamps_in_encoders {
            features |= wgpu::Features::TIMESTAMP_QUERY_INSIDE_ENCODERS;
        }
        let limits = adapter.limits();
        let (device, queue) = adapter
            .request_device(&wgpu::DeviceDescriptor {
                label: Some("gdn"),
                required_features: features,
                required_limits: limits.clone(),
                ..Default::default()
            })
            .await
            .map_err(|e| {
                Error::Unavailable(format!("adapter '{}' gave no device: {e}", info.name))
            })?;
        let uncaptured = Arc::new(Mutex::new(Vec::new()));
        let sink = uncaptured.clone();
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            if let Ok(mut v) = sink.lock() {
                v.push(e.to_string());
            }
        }));
        let storage = |binding: u32, read_only: bool| wgpu::BindGroupLayoutEntry {
            binding,
            visibility: wgpu::ShaderStages::COMPUTE,
            ty: wgpu::BindingType::Buffer {
                ty: wgpu::BufferBindingType::Storage { read_only },
                has_dynamic_offset: false,
                min_binding_size: None,
            },
            count: None,
        };
        let bind_layout = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
            label: Some("gdn step"),
            entries: &[
                storage(0, false),
                storage(1, false),
                storage(2, true),
                storage(3, true),
                storage(4, false),
                storage(5, true),
                wgpu::BindGroupLayoutEntry {
                    binding: 6,
                    visibility: wgpu::ShaderStages::COMPUTE,
                    ty: wgpu::BindingType::Buffer {
                        ty: wgpu::BufferBindingType::Uniform,
                        has_dynamic_offset: false,
                        min_binding_size: None,
                    },
                    count: None,
                },
                storage(7, false),
            ],
        });
        let pipeline_layout = device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
            label: Some("gdn step"),
            bind_group_layouts: &[Some(&bind_layout)],
            immediate_size: 0,
        });
        let gpu = Gpu {
            device,
            queue,
            info,
            limits,
            subgroups,
            timestamps,
            timestamps_in_encoders,
            bind_layout,
            pipeline_layout,
            pipelines: Mutex::new(HashMap::new()),
            chunk_pipelines: Mutex::new(HashMap::new()),
            copy: OnceLock::new(),
            quant: Default::default(),
            uncaptured,
        };
        gpu.take_errors()?;
        Ok(gpu)
    }

    /// Runs `f` inside error scopes: a validation, out-of-memory or internal error becomes `Err`.
    pub fn scoped<T>(&self, what: &str, f: impl FnOnce() -> T) -> Result<T> {
        let oom = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let internal = self.device.push_error_scope(wgpu::ErrorFilter::Internal);
        let validation = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let value = f();
        let mut errors = Vec::new();
        for scope in [validation, internal, oom] {
            if let Some(e) = pollster::block_on(scope.pop()) {
                errors.push(e.to_string());
            }
        }
        if errors.is_empty() {
            Ok(value)
        } else {
            Err(Error::Backend(format!("{what}: {}", errors.join("; "))))
        }
    }

    /// Errors the device reported outside any scope since the last call.
    pub fn take_errors(&self) -> Result<()> {
        let errors = match self.uncaptured.lock() {
            Ok(mut v) => std::mem::take(&mut *v),
            Err(_) => return Err(Error::Backend("wgpu error log poisoned".into())),
        };
        if errors.is_empty() {
            Ok(())
        } else {
            Err(Error::Backend(errors.join("; ")))
        }
    }

    /// Blocks until the queue's work is done.
    pub fn wait(&self) -> Result<()> {
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map(|_| ())
            .map_err(|e| Error::Backend(format!("waiting for the GPU: {e}")))
    }

    /// The pipeline for a specialisation, built (and checked against the limits) on first use.
    pub fn pipeline(&self, key: KernelKey) -> Result<Arc<wgpu::ComputePipeline>> {
        let mut cache = self
            .pipelines
            .lock()
            .map_err(|_| Error::Backend("pipeline cache poisoned".into()))?;
        if let Some(p) = cache.get(&key) {
            return Ok(p.clone());
        }
        key.check_limits(&self.limits)?;
        let pipeline = Arc::new(self.build(key.source(), "gdn_step", key.checked)?);
        cache.insert(key, pipeline.clone());
        Ok(pipeline)
    }

    /// A chunked kernel's pipeline (`chunk.wgsl`, entry `entry`) for a key's d, state and dtypes.
    pub(crate) fn chunk_pipeline(
        &self,
        key: KernelKey,
        geom: chunk::Geom,
        entry: chunk::Entry,
    ) -> Result<Arc<wgpu::ComputePipeline>> {
        // subgroups and row blocks do not apply to the chunked kernels: one pipeline whatever they are
        let key = KernelKey {
            subgroups: false,
            row_blocks: 1,
            ..key
        };
        let mut cache = self
            .chunk_pipelines
            .lock()
            .map_err(|_| Error::Backend("pipeline cache poisoned".into()))?;
        if let Some(p) = cache.get(&(key, geom, entry)) {
            return Ok(p.clone());
        }
        chunk::check_limits(key.d, geom, &self.limits)?;
        let source = chunk::source(&key, geom);
        let pipeline = Arc::new(self.build(source, entry.name(), key.checked)?);
        cache.insert((key, geom, entry), pipeline.clone());
        Ok(pipeline)
    }

    fn build(&self, source: String, entry: &str, checked: bool) -> Result<wgpu::ComputePipeline> {
        self.scoped("building the GDN pipeline", || {
            let desc = wgpu::ShaderModuleDescriptor {
                label: Some(entry),
                source: wgpu::ShaderSource::Wgsl(source.into()),
            };
            let module = if checked {
                self.device.create_shader_module(desc)
            } else {
                // SAFETY: the kernels' indices stay in bounds for every launch the pool makes: buffer sizes,
                // offsets, the job lists and the uniforms are all derived from arguments validated on the host
                // (Step::validate, the pool's checked sizes and 32-bit index checks, the chunked scratch's
                // regions sized for the round's windows), and their loops have uniform, finite bounds. The caller
                // asked for this through `Options::runtime_checks = false`.
                unsafe {
                    self.device
                        .create_shader_module_trusted(desc, wgpu::ShaderRuntimeChecks::unchecked())
                }
            };
            self.device
                .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                    label: Some(entry),
                    layout: Some(&self.pipeline_layout),
                    module: &module,
                    entry_point: Some(entry),
                    compilation_options: wgpu::PipelineCompilationOptions {
                        constants: &[],
                        // every workgroup variable is written before it is read
                        zero_initialize_workgroup_memory: false,
                    },
                    cache: None,
                })
        })
    }

    /// The copy kernel of the copy ceiling.
    pub fn copy_pipeline(&self) -> Result<Arc<wgpu::ComputePipeline>> {
        if let Some(p) = self.copy.get() {
            return Ok(p.clone());
        }
        let p = self.scoped("building the copy pipeline", || {
            let module = self
                .device
                .create_shader_module(wgpu::ShaderModuleDescriptor {
                    label: Some("copy.wgsl"),
                    source: wgpu::ShaderSource::Wgsl(include_str!("copy.wgsl").into()),
                });
            self.device
                .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                    label: Some("copy"),
                    layout: None,
                    module: &module,
                    entry_point: Some("copy"),
                    compilation_options: Default::default(),
                    cache: None,
                })
        })?;
        Ok(self.copy.get_or_init(|| Arc::new(p)).clone())
    }

    /// Seconds per call of `record` (which records `n` repetitions of the work), measured with GPU timestamps
    /// around the whole sequence where the adapter has them, else with the host clock around submit and wait:
    /// the median of `rounds` rounds after one warm-up round. Returns (seconds per call, host seconds per call
    /// spent recording and submitting, method).
    pub fn time_gpu(
        &self,
        rounds: usize,
        n: usize,
        in_pass: bool,
        mut record: impl FnMut(&mut wgpu::CommandEncoder, Option<wgpu::ComputePassTimestampWrites<'_>>),
    ) -> Result<(f64, f64, String)> {
        let n = n.max(1);
        let use_ts = if in_pass {
            self.timestamps
        } else {
            self.timestamps_in_encoders
        };
        let ts = if use_ts {
            Some(self.scoped("timestamp queries", || {
                let set = self.device.create_query_set(&wgpu::QuerySetDescriptor {
                    label: Some("gdn timing"),
                    ty: wgpu::QueryType::Timestamp,
                    count: 2,
                });
                let resolve = self.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("gdn timing resolve"),
                    size: 16,
                    usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
                    mapped_at_creation: false,
                });
                let read = self.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("gdn timing read"),
                    size: 16,
                    usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                    mapped_at_creation: false,
                });
                (set, resolve, read)
            })?)
        } else {
            None
        };
        let period = self.queue.get_timestamp_period() as f64 * 1e-9;
        let mut per_call = Vec::new();
        let mut host = Vec::new();
        for round in 0..=rounds.max(1) {
            let t0 = Instant::now();
            let mut enc = self
                .device
                .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
            match &ts {
                Some((set, resolve, read)) => {
                    if in_pass {
                        record(
                            &mut enc,
                            Some(wgpu::ComputePassTimestampWrites {
                                query_set: set,
                                beginning_of_pass_write_index: Some(0),
                                end_of_pass_write_index: Some(1),
                            }),
                        );
                    } else {
                        enc.write_timestamp(set, 0);
                        record(&mut enc, None);
                        enc.write_timestamp(set, 1);
                    }
                    enc.resolve_query_set(set, 0..2, resolve, 0);
                    enc.copy_buffer_to_buffer(resolve, 0, read, 0, 16);
                }
                None => record(&mut enc, None),
            }
            self.queue.submit([enc.finish()]);
            let t_host = t0.elapsed().as_secs_f64();
            self.wait()?;
            let t_wall = t0.elapsed().as_secs_f64();
            let secs = match &ts {
                Some((_, _, read)) => {
                    let bytes = self.read_mapped(read, 16)?;
                    let v: [u64; 2] = bytemuck::pod_read_unaligned(&bytes[..16]);
                    v[1].wrapping_sub(v[0]) as f64 * period
                }
                None => t_wall,
            };
            self.take_errors()?;
            if round > 0 {
                per_call.push(secs / n as f64);
                host.push(t_host / n as f64);
            }
        }
        per_call.sort_by(f64::total_cmp);
        host.sort_by(f64::total_cmp);
        let method = if ts.is_some() {
            format!(
                "GPU timestamps around back-to-back calls in one submission, median of {} rounds",
                per_call.len()
            )
        } else {
            format!(
                "host clock around back-to-back calls in one submission (submit and wait), median of {} rounds",
                per_call.len()
            )
        };
        Ok((per_call[per_call.len() / 2], host[host.len() / 2], method))
    }

    /// Maps `buf` (MAP_READ) after the queue is idle and copies its first `len` bytes out.
    pub fn read_mapped(&self, buf: &wgpu::Buffer, len: u64) -> Result<Vec<u8>> {
        let mut v = vec![0u8; len as usize];
        self.read_mapped_with(buf, len, |bytes| v.copy_from_slice(bytes))?;
        Ok(v)
    }

    /// Maps the first `len` bytes of `buf` and hands them to `f`.
    pub fn read_mapped_with(
        &self,
        buf: &wgpu::Buffer,
        len: u64,
        f: impl FnOnce(&[u8]),
    ) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let (tx, rx) = std::sync::mpsc::channel();
        buf.map_async(wgpu::MapMode::Read, 0..len, move |r| {
            let _ = tx.send(r);
        });
        self.wait()?;
        match rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(Error::Backend(format!("mapping a buffer: {e}"))),
            Err(_) => return Err(Error::Backend("mapping a buffer: no answer".into())),
        }
        {
            let view = buf
                .get_mapped_range(0..len)
                .map_err(|e| Error::Backend(format!("mapped range: {e}")))?;
            f(&view);
        }
        buf.unmap();
        Ok(())
    }
}

impl Backend for Wgpu {
    fn name(&self) -> String {
        let i = &self.gpu.info;
        format!(
            "wgpu ({}, {:?}, {})",
            i.name,
            i.backend,
            if self.gpu.subgroups {
                format!("subgroups {}..{}", i.subgroup_min_size, i.subgroup_max_size)
            } else {
                "workgroup-memory reductions".to_string()
            },
        )
    }

    fn create_pool_with(
        &self,
        layer: &Layer,
        slots: usize,
        options: gdn::PoolOptions,
    ) -> Result<Box<dyn LayerPool>> {
        Ok(Box::new(self.pool(layer, slots, options)?))
    }

    /// The footprint of a state of `bytes` bytes read and written: one buffer of `bytes / 2` copied onto
    /// another (wgpu copies between two buffers, not within one), in bytes read plus written per second, timed
    /// like the step (GPU timestamps where the adapter has them, else the host clock around submit and wait).
    /// The faster of a buffer-to-buffer copy and a compute-shader copy: NVIDIA's Vulkan driver runs large
    /// buffer-to-buffer copies at a fifth of what its shaders reach (NOTES.md).
    fn copy_ceiling(&self, bytes: usize) -> Result<f64> {
        let (buffer, shader) = self.copy_rates(bytes)?;
        Ok(buffer.max(shader))
    }
}

impl Wgpu {
    /// (buffer-to-buffer copy, compute-shader copy) rates for [`Backend::copy_ceiling`], bytes read plus
    /// written per second.
    pub fn copy_rates(&self, bytes: usize) -> Result<(f64, f64)> {
        let gpu = &self.gpu;
        // a footprint above the adapter's largest binding is measured at that binding's size (a copy that large
        // streams from memory all the same)
        let max = gpu
            .limits
            .max_buffer_size
            .min(gpu.limits.max_storage_buffer_binding_size)
            / 16
            * 16;
        let half = ((bytes as u64 / 32).max(1) * 16).min(max);
        let (src, dst) = gpu.scoped("copy ceiling buffers", || {
            let mk = |label| {
                gpu.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some(label),
                    size: half,
                    usage: wgpu::BufferUsages::COPY_SRC
                        | wgpu::BufferUsages::COPY_DST
                        | wgpu::BufferUsages::STORAGE,
                    mapped_at_creation: false,
                })
            };
            (mk("copy src"), mk("copy dst"))
        })?;
        let iters = 8;
        let (secs, _, _) = gpu.time_gpu(7, iters, false, |enc, _| {
            for _ in 0..iters {
                enc.copy_buffer_to_buffer(&src, 0, &dst, 0, half);
            }
        })?;
        let buffer = 2.0 * half as f64 / secs;
        let pipeline = gpu.copy_pipeline()?;
        let bind = gpu.scoped("copy ceiling binding", || {
            gpu.device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: Some("copy"),
                layout: &pipeline.get_bind_group_layout(0),
                entries: &[
                    wgpu::BindGroupEntry {
                        binding: 0,
                        resource: src.as_entire_binding(),
                    },
                    wgpu::BindGroupEntry {
                        binding: 1,
                        resource: dst.as_entire_binding(),
                    },
                ],
            })
        })?;
        let vec4s = half / 16;
        let groups = vec4s
            .div_ceil(256)
            .min(8192)
            .min(gpu.limits.max_compute_workgroups_per_dimension as u64)
            as u32;
        let (secs, _, _) = gpu.time_gpu(7, iters, true, |enc, ts| {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("copy"),
                timestamp_writes: ts,
            });
            pass.set_pipeline(&pipeline);
            pass.set_bind_group(0, &bind, &[]);
            for _ in 0..iters {
                pass.dispatch_workgroups(groups, 1, 1);
            }
        })?;
        Ok((buffer, 2.0 * half as f64 / secs))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernel's by-hand conversions (f16 and bf16 to nearest even, f16 widening) agree bit for bit with
    /// the host's `half` on ties, subnormals, overflow and random values; WGSL's own `pack2x16float` and
    /// `unpack2x16float` are run on the same values and their disagreements counted (WGSL lets it round either way and leaves values beyond
    /// f16's range indeterminate, so the kernel does not use it). Skipped without an adapter.
    #[test]
    fn kernel_rounding_is_to_nearest_even() {
        let Ok(backend) = Wgpu::with_options(Options::default()) else {
            // past the test harness's capture, so that CI counts the test as skipped
            use std::io::Write;
            let _ = writeln!(
                std::io::stderr(),
                "SKIPPED kernel_rounding_is_to_nearest_even: no adapter"
            );
            return;
        };
        let gpu = &backend.gpu;
        let t = kernel::TEMPLATE;
        let helpers = &t[t.find("fn bf16_lo").unwrap()..t.find("// where row block ib").unwrap()];
        let src = format!(
            "{helpers}
@group(0) @binding(0) var<storage, read> xin: array<f32>;
@group(0) @binding(1) var<storage, read_write> res: array<u32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) id: vec3<u32>) {{
    let i = id.x;
    if (i < arrayLength(&xin)) {{
        let x = xin[i];
        res[5u * i] = f16_bits(x);
        res[5u * i + 1u] = bf16_bits(x);
        res[5u * i + 2u] = bitcast<u32>(f16_f32(f16_bits(x)));
        res[5u * i + 3u] = pack2x16float(vec2<f32>(x, 0.0)) & 0xffffu;
        res[5u * i + 4u] = bitcast<u32>(unpack2x16float(f16_bits(x)).x);
    }}
}}"
        );
        // f16 ties and their neighbours over every binade (subnormals included), the overflow threshold,
        // bf16 ties, specials, and a spread of random values
        let mut xs: Vec<f32> = Vec::new();
        for h in (0u16..0x7c00).step_by(7) {
            let a = gdn::f16::from_bits(h).to_f32();
            let b = gdn::f16::from_bits(h + 1).to_f32();
            let mid = (a + b) / 2.0;
            xs.extend([
                mid,
                -mid,
                f32::from_bits(mid.to_bits() + 1),
                f32::from_bits(mid.to_bits() - 1),
                a,
            ]);
        }
        for u in (0u32..0xffff).step_by(13) {
            xs.push(f32::from_bits((u << 16) | 0x8000));
            xs.push(f32::from_bits((u << 16) | 0x8001));
        }
        xs.extend([
            65504.0,
            65519.0,
            65520.0,
            1e6,
            -1e9,
            f32::INFINITY,
            f32::NEG_INFINITY,
            0.0,
            -0.0,
        ]);
        xs.extend([
            2f32.powi(-25),
            2f32.powi(-24),
            1.5 * 2f32.powi(-25),
            3e-8,
            6e-5,
        ]);
        let mut rng = gdn::synth::Synth::new(3);
        xs.extend(rng.uniform(4096, -8.0, 8.0));
        let n = xs.len() as u64;
        let (inp, out, read) = gpu
            .scoped("rounding test buffers", || {
                let mk = |size, usage| {
                    gpu.device.create_buffer(&wgpu::BufferDescriptor {
                        label: None,
                        size,
                        usage,
                        mapped_at_creation: false,
                    })
                };
                let s = wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST;
                (
                    mk(4 * n, s),
                    mk(20 * n, s | wgpu::BufferUsages::COPY_SRC),
                    mk(
                        20 * n,
                        wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                    ),
                )
            })
            .unwrap();
        gpu.queue.write_buffer(&inp, 0, bytemuck::cast_slice(&xs));
        let pipeline = gpu
            .scoped("rounding test pipeline", || {
                let module = gpu
                    .device
                    .create_shader_module(wgpu::ShaderModuleDescriptor {
                        label: None,
                        source: wgpu::ShaderSource::Wgsl(src.into()),
                    });
                gpu.device
                    .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                        label: None,
                        layout: None,
                        module: &module,
                        entry_point: Some("main"),
                        compilation_options: Default::default(),
                        cache: None,
                    })
            })
            .unwrap();
        let bind = gpu.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: None,
            layout: &pipeline.get_bind_group_layout(0),
            entries: &[
                wgpu::BindGroupEntry {
                    binding: 0,
                    resource: inp.as_entire_binding(),
                },
                wgpu::BindGroupEntry {
                    binding: 1,
                    resource: out.as_entire_binding(),
                },
            ],
        });
        let mut enc = gpu
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
        {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: None,
                timestamp_writes: None,
            });
            pass.set_pipeline(&pipeline);
            pass.set_bind_group(0, &bind, &[]);
            pass.dispatch_workgroups(n.div_ceil(64) as u32, 1, 1);
        }
        enc.copy_buffer_to_buffer(&out, 0, &read, 0, 20 * n);
        gpu.queue.submit([enc.finish()]);
        let raw = gpu.read_mapped(&read, 20 * n).unwrap();
        let res: &[u32] = bytemuck::cast_slice(&raw);
        let mut pack_off = 0;
        let mut unpack_off = 0;
        let nan16 = |b: u32| b & 0x7fff > 0x7c00;
        for (i, &x) in xs.iter().enumerate() {
            let [f16b, bf16b, widened, packed, unpacked] = [0, 1, 2, 3, 4].map(|k| res[5 * i + k]);
            let want16 = gdn::f16::from_f32(x).to_bits() as u32;
            let wantb = gdn::bf16::from_f32(x).to_bits() as u32;
            if x.is_nan() {
                assert!(
                    nan16(f16b) && bf16b & 0x7fff > 0x7f80,
                    "NaN {:#x}",
                    x.to_bits()
                );
                continue;
            }
            assert_eq!(f16b, want16, "f16 of {x:e} ({:#x})", x.to_bits());
            assert_eq!(bf16b, wantb, "bf16 of {x:e} ({:#x})", x.to_bits());
            let back = gdn::f16::from_bits(want16 as u16).to_f32().to_bits();
            assert_eq!(widened, back, "f16 {want16:#x} widened");
            unpack_off += (unpacked != back) as usize;
            let same = packed == want16 || (x.is_nan() && nan16(packed));
            if !same {
                if pack_off < 12 {
                    eprintln!("  pack2x16float({x:e}) = {packed:#06x}, nearest even {want16:#06x}");
                }
                pack_off += 1;
            }
        }
        eprintln!(
            "pack2x16float on {}: {pack_off} of {n} values differ from round-to-nearest-even; \
             unpack2x16float: {unpack_off} widened inexactly",
            gpu.info.name
        );
    }
}
