//! The quantized out_proj on CUDA (`kernels/quant.cu`; SPEC.md, "The quantized out_proj"): the weights uploaded
//! once ([`Cuda::load_out_proj`]), then products on device buffers ([`CudaOutProj::product_planes_device`] reads
//! a step's output with planes as [`crate::CudaPool::step_device`] writes it; [`CudaOutProj::product_shift_device`]
//! runs the group-sum pass and the shift path from y) or on host slices ([`gdn::quant::OutProj`]). No call
//! allocates or waits once the scratch for its row count exists ([`CudaOutProj::reserve`]), so a step and its
//! out_proj can be captured into one CUDA graph. [`time_tail`] times the layer's tail that way for `gdn bench`.

use std::sync::Arc;

use cudarc::driver::{
    sys, CudaFunction, CudaModule, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr,
    DevicePtrMut, LaunchConfig, PushKernelArg,
};
use gdn::quant::{self, Bf16Weights, OutProj, Packing, QuantBackend, QuantWeights};
use gdn::{Error, OutputLayout, Result};

use crate::spec::Compiled;
use crate::{drv, Cuda};

/// The kernels' source.
pub const QUANT_SRC: &str = include_str!("../kernels/quant.cu");

/// Output rows a warp owns (the kernel's ROWS).
pub const ROWS: usize = 4;
/// Tokens a block takes (the kernel's TT), one module each: 1 for calls of fewer than [`TILE_FROM`] rows (a
/// decode step: few registers, full occupancy), 8 from there (each decoded field used for 8 tokens). A token's
/// arithmetic is the same in both, so its bits do not depend on the rest of the call.
pub const TILES: [usize; 2] = [1, 8];
pub const TILE_FROM: usize = 4;
const WARPS: usize = 4;

/// Compiles the quant kernels for `arch` with `tt` tokens a block (the step kernel's NVRTC options and
/// per-process cache, [`crate::spec::compiled_source`]); the cubin and ptxas's log.
pub fn compiled_quant(arch: (i32, i32), tt: usize) -> Result<Arc<Compiled>> {
    let src = format!("#define ROWS {ROWS}\n#define TT {tt}\n{QUANT_SRC}");
    crate::spec::compiled_source(&src, "quant.cu", arch)
}

/// The loaded kernels of one context.
#[derive(Clone)]
struct Kernels {
    _module: Arc<CudaModule>,
    planes: [CudaFunction; 3],
    shift: [CudaFunction; 3],
    group_sums: CudaFunction,
    bf16: CudaFunction,
    empty: CudaFunction,
}

fn kernels(cuda: &Cuda, tt: usize) -> Result<Kernels> {
    let c = compiled_quant(cuda.arch, tt)?;
    let module = cuda
        .ctx
        .load_module(cudarc::nvrtc::Ptx::from_binary(c.cubin.clone()))
        .map_err(drv)?;
    let f = |name: &str| module.load_function(name).map_err(drv);
    Ok(Kernels {
        planes: [f("q_planes_0")?, f("q_planes_1")?, f("q_planes_2")?],
        shift: [f("q_shift_0")?, f("q_shift_1")?, f("q_shift_2")?],
        group_sums: f("group_sums")?,
        bf16: f("bf16_product")?,
        empty: f("empty_kernel")?,
        _module: module,
    })
}

fn pack_index(p: Packing) -> usize {
    match p {
        Packing::Q2U16 => 0,
        Packing::Q8U32 => 1,
        Packing::Q8U16 => 2,
    }
}

fn addr<T, S: DevicePtr<T>>(s: &S, stream: &Arc<CudaStream>) -> u64 {
    // event tracking is off for this backend's context, so the guard records nothing
    let (p, _guard) = s.device_ptr(stream);
    p
}

fn addr_mut<T, S: DevicePtrMut<T>>(s: &mut S, stream: &Arc<CudaStream>) -> u64 {
    let (p, _guard) = s.device_ptr_mut(stream);
    p
}

fn int(v: usize, what: &'static str) -> Result<i32> {
    i32::try_from(v).map_err(|_| Error::Param {
        name: what,
        why: format!("{v} does not fit the kernel's 32-bit index"),
    })
}

/// The token tile (an index into [`TILES`]) for a call of `tokens` rows.
fn tile(tokens: usize) -> usize {
    usize::from(tokens >= TILE_FROM)
}

/// The launch grid of a product over `tokens` rows and `hidden` outputs.
fn grid(hidden: usize, tokens: usize) -> Result<LaunchConfig> {
    let x = hidden.div_ceil(ROWS * WARPS);
    let tt = TILES[tile(tokens)];
    let y = tokens.div_ceil(tt);
    if y > 65535 {
        return Err(Error::Param {
            name: "rows",
            why: format!("{tokens} rows: at most {} a call", 65535 * tt),
        });
    }
    Ok(LaunchConfig {
        grid_dim: (int(x, "hidden")? as u32, y as u32, 1),
        block_dim: ((32 * WARPS) as u32, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// Quantized out_proj weights on the device, with the host path's staging buffers.
pub struct CudaOutProj {
    cuda: Cuda,
    k: [Kernels; 2],
    shape: (Packing, usize, usize),
    words: CudaSlice<u32>,
    scale: CudaSlice<f32>,
    zs: CudaSlice<f32>,
    /// The shift path's group sums, `reserve`d rows x n / 16.
    gsum: CudaSlice<f32>,
    /// Host path: the activations (plane or y, then group sums) and the output.
    x: CudaSlice<f32>,
    out: CudaSlice<f32>,
}

impl Cuda {
    /// Uploads quantized out_proj weights (once; every product reads them there).
    pub fn load_out_proj(&self, w: &QuantWeights) -> Result<CudaOutProj> {
        let s = &self.stream;
        let bytes = w.word_bytes_le();
        // a 16-bit packing's rows hold n / 8 or n / 2 u16: n a multiple of 16 makes every row whole u32s
        let words: Vec<u32> = bytes
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        Ok(CudaOutProj {
            k: [kernels(self, TILES[0])?, kernels(self, TILES[1])?],
            shape: w.shape(),
            words: s.clone_htod(&words).map_err(drv)?,
            scale: s.clone_htod(w.scales()).map_err(drv)?,
            zs: s.clone_htod(w.zero_terms()).map_err(drv)?,
            gsum: s.alloc_zeros::<f32>(16).map_err(drv)?,
            x: s.alloc_zeros::<f32>(16).map_err(drv)?,
            out: s.alloc_zeros::<f32>(16).map_err(drv)?,
            cuda: self.clone(),
        })
    }

    /// Uploads plain bf16 out_proj weights (the benchmark's unquantized tail).
    pub fn load_bf16_out_proj(&self, w: &Bf16Weights) -> Result<CudaBf16OutProj> {
        if !w.cols.is_multiple_of(8) {
            return Err(Error::Param {
                name: "cols",
                why: format!("{} must be a multiple of 8", w.cols),
            });
        }
        let bits: Vec<u16> = w.w.iter().map(|v| v.to_bits()).collect();
        Ok(CudaBf16OutProj {
            k: [kernels(self, TILES[0])?, kernels(self, TILES[1])?],
            hidden: w.rows,
            n: w.cols,
            w: self.stream.clone_htod(&bits).map_err(drv)?,
            cuda: self.clone(),
        })
    }
}

impl CudaOutProj {
    /// Bytes of the fields, scales and zero terms on the device.
    pub fn bytes(&self) -> usize {
        4 * (self.words.len() + self.scale.len() + self.zs.len())
    }

    /// Makes the shift path's group-sum scratch hold `rows` rows (the device entries allocate nothing).
    pub fn reserve(&mut self, rows: usize) -> Result<()> {
        let need = rows
            .checked_mul(self.shape.2 / 16)
            .ok_or_else(|| Error::Param {
                name: "rows",
                why: "rows x groups overflows".into(),
            })?;
        if self.gsum.len() < need {
            self.gsum = self.cuda.stream.alloc_zeros::<f32>(need).map_err(drv)?;
        }
        Ok(())
    }

    /// Launches the product of `x` (plane or y) and `gsum` at these device addresses into `out`.
    fn launch(&self, shift: bool, x: u64, gsum: u64, out: u64, tokens: usize) -> Result<()> {
        let (p, hidden, n) = self.shape;
        if tokens == 0 {
            return Ok(());
        }
        let cfg = grid(hidden, tokens)?;
        let (hidden, n, tokens) = (int(hidden, "hidden")?, int(n, "n")?, int(tokens, "rows")?);
        let s = &self.cuda.stream;
        let (w, sc, z) = (
            addr(&self.words, s),
            addr(&self.scale, s),
            addr(&self.zs, s),
        );
        let k = &self.k[tile(tokens as usize)];
        let f = if shift {
            &k.shift[pack_index(p)]
        } else {
            &k.planes[pack_index(p)]
        };
        let mut b = s.launch_builder(f);
        b.arg(&w)
            .arg(&sc)
            .arg(&z)
            .arg(&x)
            .arg(&gsum)
            .arg(&out)
            .arg(&hidden)
            .arg(&n)
            .arg(&tokens);
        // SAFETY: the arguments match the kernel's signature; the weights are this object's (hidden x n), and
        // the callers checked that x holds `tokens` rows of n, gsum `tokens` rows of n / 16 and out `tokens`
        // rows of hidden floats, x 16-byte aligned.
        unsafe { b.launch(cfg) }.map_err(drv)?;
        Ok(())
    }

    /// `out [R][hidden]` from a step's output on the device (f32, laid out as `layout`, with planes), as
    /// [`gdn::quant::QuantWeights::product_planes`]; on this backend's stream, no allocation, no wait. The plane
    /// stride must be a multiple of 4 (16-byte loads).
    pub fn product_planes_device(
        &self,
        step_out: &CudaView<'_, f32>,
        layout: &OutputLayout,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        let (at_plane, at_gsum) =
            quant::check_planes(self.shape, step_out.len(), layout, out.len())?;
        if !at_plane.is_multiple_of(4) {
            return Err(Error::Param {
                name: "plane_stride",
                why: "the CUDA product needs a plane stride that is a multiple of 4".into(),
            });
        }
        let s = self.cuda.stream.clone();
        let base = addr(step_out, &s);
        let o = addr_mut(out, &s);
        self.launch(
            false,
            base + 4 * at_plane as u64,
            base + 4 * at_gsum as u64,
            o,
            layout.rows,
        )
    }

    /// The same product from y `[rows][n]` on the device: the group-sum pass into the scratch ([`reserve`]d
    /// for `rows`, else an error), then the shift path.
    ///
    /// [`reserve`]: CudaOutProj::reserve
    pub fn product_shift_device(
        &mut self,
        y: &CudaView<'_, f32>,
        rows: usize,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        quant::check_shift(self.shape, y.len(), rows, out.len())?;
        let groups = rows * (self.shape.2 / 16);
        if self.gsum.len() < groups {
            return Err(Error::Param {
                name: "rows",
                why: format!("{rows} rows: reserve them first (CudaOutProj::reserve)"),
            });
        }
        let s = self.cuda.stream.clone();
        let (yp, o) = (addr(y, &s), addr_mut(out, &s));
        let g = addr_mut(&mut self.gsum, &s);
        self.group_sums(yp, g, groups)?;
        self.launch(true, yp, g, o, rows)
    }

    fn group_sums(&self, y: u64, gsum: u64, groups: usize) -> Result<()> {
        if groups == 0 {
            return Ok(());
        }
        let count = int(groups, "groups")?;
        let cfg = LaunchConfig {
            grid_dim: (groups.div_ceil(256) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let s = &self.cuda.stream;
        let mut b = s.launch_builder(&self.k[0].group_sums);
        b.arg(&y).arg(&gsum).arg(&count);
        // SAFETY: y holds `groups` x 16 floats and gsum `groups` (checked by the caller).
        unsafe { b.launch(cfg) }.map_err(drv)?;
        Ok(())
    }

    /// Makes the host path's staging buffers hold `x` floats in and `out` floats out.
    fn stage(&mut self, x: usize, out: usize) -> Result<()> {
        let s = &self.cuda.stream;
        if self.x.len() < x.max(1) {
            self.x = s.alloc_zeros::<f32>(x.max(1)).map_err(drv)?;
        }
        if self.out.len() < out.max(1) {
            self.out = s.alloc_zeros::<f32>(out.max(1)).map_err(drv)?;
        }
        Ok(())
    }

    /// An empty kernel's launch, for latency references.
    pub fn launch_empty(&self) -> Result<()> {
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (32, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.cuda.stream.launch_builder(&self.k[0].empty);
        // SAFETY: the kernel takes no arguments and touches nothing.
        unsafe { b.launch(cfg) }.map_err(drv)?;
        Ok(())
    }
}

impl OutProj for CudaOutProj {
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
        // only the plane this packing reads and the group sums travel: [plane][gsum], both 16-byte aligned
        let plane_len = rows * n;
        let gsum_len = rows * (n / 16);
        let at_g = plane_len.next_multiple_of(4);
        self.stage(at_g + gsum_len, out.len())?;
        let s = self.cuda.stream.clone();
        if plane_len > 0 {
            s.memcpy_htod(
                &step_out[at_plane..at_plane + plane_len],
                &mut self.x.slice_mut(0..plane_len),
            )
            .map_err(drv)?;
            s.memcpy_htod(
                &step_out[at_gsum..at_gsum + gsum_len],
                &mut self.x.slice_mut(at_g..at_g + gsum_len),
            )
            .map_err(drv)?;
        }
        let x = addr(&self.x, &s);
        let o = addr_mut(&mut self.out, &s);
        self.launch(false, x, x + 4 * at_g as u64, o, rows)?;
        s.memcpy_dtoh(&self.out.slice(0..out.len()), out)
            .map_err(drv)?;
        s.synchronize().map_err(drv)
    }

    fn product_shift(&mut self, y: &[f32], rows: usize, out: &mut [f32]) -> Result<()> {
        quant::check_shift(self.shape, y.len(), rows, out.len())?;
        self.reserve(rows)?;
        self.stage(y.len(), out.len())?;
        let s = self.cuda.stream.clone();
        if !y.is_empty() {
            s.memcpy_htod(y, &mut self.x.slice_mut(0..y.len()))
                .map_err(drv)?;
        }
        let x = addr(&self.x, &s);
        let o = addr_mut(&mut self.out, &s);
        let g = addr_mut(&mut self.gsum, &s);
        self.group_sums(x, g, rows * (self.shape.2 / 16))?;
        self.launch(true, x, g, o, rows)?;
        s.memcpy_dtoh(&self.out.slice(0..out.len()), out)
            .map_err(drv)?;
        s.synchronize().map_err(drv)
    }
}

impl QuantBackend for Cuda {
    fn load_out_proj(&self, weights: &QuantWeights) -> Result<Box<dyn OutProj>> {
        Ok(Box::new(Cuda::load_out_proj(self, weights)?))
    }
}

/// Plain bf16 out_proj weights on the device.
pub struct CudaBf16OutProj {
    cuda: Cuda,
    k: [Kernels; 2],
    hidden: usize,
    n: usize,
    w: CudaSlice<u16>,
}

impl CudaBf16OutProj {
    pub fn bytes(&self) -> usize {
        2 * self.w.len()
    }

    /// `out [rows][hidden] = y W^T`, y `[rows][n]` f32 on the device (16-byte aligned).
    pub fn product_device(
        &self,
        y: &CudaView<'_, f32>,
        rows: usize,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        quant::check_shift(
            (Packing::Q8U16, self.hidden, self.n),
            y.len(),
            rows,
            out.len(),
        )?;
        if rows == 0 {
            return Ok(());
        }
        let cfg = grid(self.hidden, rows)?;
        let s = &self.cuda.stream;
        let (w, x, o) = (addr(&self.w, s), addr(y, s), addr_mut(out, s));
        let (hidden, n, tokens) = (
            int(self.hidden, "hidden")?,
            int(self.n, "n")?,
            int(rows, "rows")?,
        );
        let mut b = s.launch_builder(&self.k[tile(rows)].bf16);
        b.arg(&w).arg(&x).arg(&o).arg(&hidden).arg(&n).arg(&tokens);
        // SAFETY: the arguments match the kernel; y and out hold rows x n and rows x hidden floats (checked).
        unsafe { b.launch(cfg) }.map_err(drv)?;
        Ok(())
    }
}

/// Device seconds of the layer's tail, one call each (see [`time_tail`]).
#[derive(Clone, Copy, Debug)]
pub struct TailTimes {
    /// The step alone, with planes and without.
    pub step_planes: f64,
    pub step: f64,
    /// The out_proj alone: planes path, shift path with its group-sum pass, bf16 weights.
    pub planes: f64,
    pub shift: f64,
    pub bf16: f64,
    /// Step + out_proj in one graph.
    pub tail_planes: f64,
    pub tail_shift: f64,
    pub tail_bf16: f64,
    /// An empty kernel launched in the same kind of graph.
    pub empty: f64,
    /// Largest relative L2 difference of the planes path's output from the shift path's (same run).
    pub planes_vs_shift: f64,
    /// Weight copies the products rotate over.
    pub copies: usize,
}

/// Times `what` (a closure that enqueues one call on the stream) as a CUDA graph of `per_graph` calls replayed,
/// events; median seconds per call of 5 rounds of 3 replays.
fn time_graph(
    cuda: &Cuda,
    per_graph: usize,
    what: &mut dyn FnMut(usize) -> Result<()>,
) -> Result<f64> {
    let s = cuda.stream.clone();
    for i in 0..per_graph.min(4) {
        what(i)?;
    }
    s.synchronize().map_err(drv)?;
    s.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(drv)?;
    let mut captured = Ok(());
    for i in 0..per_graph {
        captured = what(i);
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
    let ev = || {
        cuda.ctx
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(drv)
    };
    let (e0, e1) = (ev()?, ev()?);
    let replays = 3;
    let mut times = Vec::new();
    for _ in 0..5 {
        e0.record(&s).map_err(drv)?;
        for _ in 0..replays {
            graph.launch().map_err(drv)?;
        }
        e1.record(&s).map_err(drv)?;
        e1.synchronize().map_err(drv)?;
        let ms = e0.elapsed_ms(&e1).map_err(drv)? as f64;
        times.push(ms * 1e-3 / (replays * per_graph) as f64);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// The layer's tail on the device at `b` sequences of `t` tokens: the step (device-native, f32 activations and
/// state, commit all) with planes + the planes product, the step without planes + the group-sum pass + the
/// shift path, the step + the bf16 product; each part alone too, and an empty kernel. The products rotate over
/// enough copies of their weights to span `rotate_bytes`, so that the weights come from memory, not from the
/// L2 that kept them since the last call (as in a model, where 63 other layers run in between).
pub fn time_tail(
    cuda: &Cuda,
    layer: &gdn::Layer,
    q: &QuantWeights,
    bf: &Bf16Weights,
    b: usize,
    t: usize,
    rotate_bytes: usize,
) -> Result<TailTimes> {
    use crate::{DeviceStep, DeviceTensor, DeviceTensorMut, StepKind};
    let sh = *layer.shape();
    let (n, rows) = (sh.n(), b * t);
    let (_, hidden, _) = q.shape();
    let s = cuda.stream.clone();
    let mut pool = cuda.create_cuda_pool(layer, b, gdn::PoolOptions::default())?;
    let mut rng = gdn::synth::Synth::new(99);
    for slot in 0..b {
        let (st, h) = rng.seq_state(layer);
        gdn::LayerPool::write_slot(&mut pool, slot, &st, &h)?;
    }
    let batch = rng.batch(layer, 1, rows);
    let up = |v: &[f32]| s.clone_htod(v).map_err(drv);
    let (qkv, alpha, beta, z) = (
        up(&batch.qkv)?,
        up(&batch.alpha)?,
        up(&batch.beta)?,
        up(&batch.z)?,
    );
    let ints = |v: Vec<i32>| s.clone_htod(&v).map_err(drv);
    let slot = ints((0..b as i32).collect())?;
    let start = ints((0..b).map(|i| (i * t) as i32).collect())?;
    let len = ints(vec![t as i32; b])?;
    let commit = ints(vec![t as i32; b])?;
    let p = rows * n;
    let lay_planes = OutputLayout::for_rows(&sh, rows, Some(p))?;
    let lay_plain = OutputLayout::for_rows(&sh, rows, None)?;
    let mut out_planes = s.alloc_zeros::<f32>(lay_planes.len()).map_err(drv)?;
    let mut out_plain = s.alloc_zeros::<f32>(lay_plain.len()).map_err(drv)?;
    let mut res = s.alloc_zeros::<f32>(rows * hidden).map_err(drv)?;
    let mut res2 = s.alloc_zeros::<f32>(rows * hidden).map_err(drv)?;
    let io = crate::Io::all(gdn::DType::F32);
    for planes in [false, true] {
        pool.prepare(&StepKind {
            uniform_len: (t <= crate::spec::MAX_CONST_T).then_some(t),
            commits: true,
            planes,
            io,
            seqs: b,
        })?;
    }
    let copies = rotate_bytes.div_ceil(q.bytes()).max(1);
    let bf_copies = rotate_bytes.div_ceil(bf.bytes()).max(1);
    let mut qs = Vec::new();
    for _ in 0..copies {
        let mut c = cuda.load_out_proj(q)?;
        c.reserve(rows)?;
        qs.push(c);
    }
    let bfs = (0..bf_copies)
        .map(|_| cuda.load_bf16_out_proj(bf))
        .collect::<Result<Vec<_>>>()?;
    let (qv, av, bv, zv) = (qkv.as_view(), alpha.as_view(), beta.as_view(), z.as_view());
    let (slv, stv, lev, cov) = (
        slot.as_view(),
        start.as_view(),
        len.as_view(),
        commit.as_view(),
    );
    let step = |pool: &mut crate::CudaPool, out: &mut CudaSlice<f32>, planes: bool| {
        let ds = DeviceStep {
            rows,
            qkv: DeviceTensor::F32(&qv),
            alpha: DeviceTensor::F32(&av),
            beta: DeviceTensor::F32(&bv),
            z: DeviceTensor::F32(&zv),
            slot: &slv,
            start: &stv,
            len: &lev,
            commit_at: &cov,
            uniform_len: (t <= crate::spec::MAX_CONST_T).then_some(t),
            commits: true,
            plane_stride: planes.then_some(p),
        };
        pool.step_device(&ds, &mut DeviceTensorMut::F32(&mut out.as_view_mut()))
    };
    // correctness in this run: the planes path against the shift path on the same step's y
    step(&mut pool, &mut out_planes, true)?;
    qs[0].product_planes_device(&out_planes.as_view(), &lay_planes, &mut res.as_view_mut())?;
    let yv = out_planes.slice(0..rows * n);
    qs[0].product_shift_device(&yv, rows, &mut res2.as_view_mut())?;
    let a = s.clone_dtoh(&res).map_err(drv)?;
    let c = s.clone_dtoh(&res2).map_err(drv)?;
    let wide: Vec<f64> = c.iter().map(|&v| v as f64).collect();
    let planes_vs_shift = gdn::relative_error(&a, &wide);
    let per = (2 * copies.max(bf_copies)).clamp(8, 64);
    let step_planes = time_graph(cuda, per, &mut |_| step(&mut pool, &mut out_planes, true))?;
    let step_plain = time_graph(cuda, per, &mut |_| step(&mut pool, &mut out_plain, false))?;
    let planes = time_graph(cuda, per, &mut |i| {
        qs[i % copies].product_planes_device(
            &out_planes.as_view(),
            &lay_planes,
            &mut res.as_view_mut(),
        )
    })?;
    let shift = time_graph(cuda, per, &mut |i| {
        let y = out_plain.slice(0..rows * n);
        qs[i % copies].product_shift_device(&y, rows, &mut res.as_view_mut())
    })?;
    let bf16 = time_graph(cuda, per, &mut |i| {
        let y = out_plain.slice(0..rows * n);
        bfs[i % bf_copies].product_device(&y, rows, &mut res.as_view_mut())
    })?;
    let tail_planes = time_graph(cuda, per, &mut |i| {
        step(&mut pool, &mut out_planes, true)?;
        qs[i % copies].product_planes_device(
            &out_planes.as_view(),
            &lay_planes,
            &mut res.as_view_mut(),
        )
    })?;
    let tail_shift = time_graph(cuda, per, &mut |i| {
        step(&mut pool, &mut out_plain, false)?;
        let y = out_plain.slice(0..rows * n);
        qs[i % copies].product_shift_device(&y, rows, &mut res.as_view_mut())
    })?;
    let tail_bf16 = time_graph(cuda, per, &mut |i| {
        step(&mut pool, &mut out_plain, false)?;
        let y = out_plain.slice(0..rows * n);
        bfs[i % bf_copies].product_device(&y, rows, &mut res.as_view_mut())
    })?;
    let empty = time_graph(cuda, per, &mut |_| qs[0].launch_empty())?;
    pool.take_fault()?;
    Ok(TailTimes {
        step_planes,
        step: step_plain,
        planes,
        shift,
        bf16,
        tail_planes,
        tail_shift,
        tail_bf16,
        empty,
        planes_vs_shift,
        copies,
    })
}
