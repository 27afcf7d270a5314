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

/// Output rows a warp owns in the `q_*` kernels (the kernel's ROWS).
pub const ROWS: usize = 4;
/// Tokens a block takes (the kernel's TT), one module each: 1 for calls of fewer than [`TILE_FROM`] rows (a
/// decode step: few registers), 8 from there (each decoded field used for 8 tokens). A one-token call runs the
/// TT 1 module's `q1_*` kernel (weights streamed, activations in shared memory). A row's sum has the same order
/// in every kernel (see `kernels/quant.cu`), so its bits do not depend on the rest of the call.
pub const TILES: [usize; 2] = [1, 8];
pub const TILE_FROM: usize = 4;
const WARPS: usize = 4;
/// Most warps a `q1_*` block (the kernel's MAXW1).
const MAXW1: usize = 16;

/// The one-token kernel's launch shape, compile-time and launch choices; none changes a bit of the result.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct QuantTune {
    /// Rows a warp sums at once, by packing (`Q2U16`, `Q8U32`, `Q8U16`).
    pub rows: [usize; 3],
    /// Chunks (32 groups of each of those rows) whose loads are in flight while one is summed, by packing.
    pub depth: [usize; 3],
    /// Blocks a multiprocessor (the grid is this times the multiprocessors, at most one a row set).
    pub blocks_per_sm: usize,
    /// Weights loaded past L1 with a 256-byte L2 prefetch hint (else plain read-only loads).
    pub stream_hint: bool,
    /// One-token calls on the `q1_*` kernel (else on the tiled kernel's TT 1 module, as calls of 2 or 3 rows).
    pub one_kernel: bool,
    /// Calls of this many rows or more on the tensor-core kernel `qm_*` (`usize::MAX`: never). Unlike the fields
    /// above this changes bits: `qm_*` sums a group's 16 products on tensor cores, in an order of its own.
    pub mma_from: usize,
    /// The tensor-core kernel's block: warps (16 rows each; 2, 4 or 8) and n-tiles (8 tokens each; 1 to 4). No
    /// bit depends on them.
    pub mma_warps: usize,
    pub mma_ntiles: usize,
    /// The tensor-core kernel's split of n over the blocks of a cluster (1 to 8); the bits depend on it.
    pub mma_split: usize,
    /// Calls of at most this many rows take the tensor-core kernel's block of 4 warps x 1 n-tile, calls of at least
    /// `mma_large_from` rows its block of 8 warps x 4 n-tiles, the others `mma_warps` x `mma_ntiles` (0 and
    /// `usize::MAX`: the tune's block for every row count). No bit depends on them.
    pub mma_small_to: usize,
    pub mma_large_from: usize,
}

impl QuantTune {
    /// The measured choice (H200, 2026-12-01, the crate's `quant_tune_sweep`; NOTES.md, "The quantized
    /// out_proj"): one-token calls on `q1_*`, 2 rows a warp, 4 chunks in flight, 2 blocks an SM (B 1: 2-bit 14.65
    /// against the tiled kernel's 14.92 us, 8-bit u32 18.40 against 23.05, u16 18.42 against 24.14; the same
    /// bits in every shape). Calls of 8 rows or more on tensor cores, 4 warps x 2 n-tiles, n split over clusters
    /// of 8 blocks (H200, 2026-12-06, `quant_mma_sweep`, us against the CUDA cores: 2-bit B 8 56.3 / 78.1, B 16
    /// 57.3 / 115.9, B 64 188.5 / 445.2, B 512 1414 / 3353; 8-bit u32 B 8 73.9 / 87.1, B 64 242.2 / 497.6; at
    /// B 4 the CUDA cores were level or ahead). Blocks by row count, the same split (same bits): 4 x 1 to 8 rows
    /// (2-bit B 8 48.1 against 56.3), 8 x 4 from 128 (B 256 669.3 against 711.6, B 512 1313.3 against 1414.0).
    pub const DEFAULT: QuantTune = QuantTune {
        rows: [2, 2, 2],
        depth: [4, 4, 4],
        blocks_per_sm: 2,
        stream_hint: true,
        one_kernel: true,
        mma_from: 8,
        mma_warps: 4,
        mma_ntiles: 2,
        mma_split: 8,
        mma_small_to: 8,
        mma_large_from: 128,
    };
}

impl Default for QuantTune {
    fn default() -> Self {
        QuantTune::DEFAULT
    }
}

/// Compiles the quant kernels for `arch` with `tt` tokens a block under the default launch shape (the step
/// kernel's NVRTC options and per-process cache, [`crate::spec::compiled_source`]); the cubin and ptxas's log.
pub fn compiled_quant(arch: (i32, i32), tt: usize) -> Result<Arc<Compiled>> {
    compiled_quant_with(arch, tt, &QuantTune::DEFAULT)
}

/// The same under `tune` (the TT 1 module's `q1_*` kernels read its one-token shape, the other module's `qm_*`
/// kernels its tensor-core block).
pub fn compiled_quant_with(arch: (i32, i32), tt: usize, tune: &QuantTune) -> Result<Arc<Compiled>> {
    let mut src = format!("#define ROWS {ROWS}\n#define TT {tt}\n");
    if tt != 1 {
        src += &format!(
            "#define QM_WARPS {}\n#define QM_NT {}\n#define QM_SPLIT {}\n",
            tune.mma_warps, tune.mma_ntiles, tune.mma_split
        );
    } else {
        for k in 0..3 {
            src += &format!(
                "#define R1_{k} {}\n#define D1_{k} {}\n",
                tune.rows[k], tune.depth[k]
            );
        }
        src += &format!("#define STREAM_HINT {}\n", u8::from(tune.stream_hint));
    }
    src += QUANT_SRC;
    crate::spec::compiled_source(&src, "quant.cu", arch)
}

/// The loaded kernels of one context.
#[derive(Clone)]
struct Kernels {
    _module: Arc<CudaModule>,
    planes: [CudaFunction; 3],
    shift: [CudaFunction; 3],
    /// The TT 1 module's one-token kernels (planes, shift).
    one: Option<([CudaFunction; 3], [CudaFunction; 3])>,
    /// The other module's tensor-core kernels (planes, shift) in the tune's block, 4 x 1 and 8 x 4 (`MMA_BLOCKS`).
    mma: Option<[([CudaFunction; 3], [CudaFunction; 3]); 3]>,
    group_sums: CudaFunction,
    bf16: CudaFunction,
    empty: CudaFunction,
}

fn kernels(cuda: &Cuda, tt: usize, tune: &QuantTune) -> Result<Kernels> {
    let c = compiled_quant_with(cuda.arch, tt, tune)?;
    let module = cuda
        .ctx
        .load_module(cudarc::nvrtc::Ptx::from_binary(c.cubin.clone()))
        .map_err(drv)?;
    let f = |name: &str| module.load_function(name).map_err(drv);
    Ok(Kernels {
        planes: [f("q_planes_0")?, f("q_planes_1")?, f("q_planes_2")?],
        shift: [f("q_shift_0")?, f("q_shift_1")?, f("q_shift_2")?],
        one: if tt == 1 {
            Some((
                [f("q1_planes_0")?, f("q1_planes_1")?, f("q1_planes_2")?],
                [f("q1_shift_0")?, f("q1_shift_1")?, f("q1_shift_2")?],
            ))
        } else {
            None
        },
        mma: if tt == 1 {
            None
        } else {
            let set = |p: &str| -> Result<([CudaFunction; 3], [CudaFunction; 3])> {
                let g = |kind: &str, i: usize| f(&format!("{p}_{kind}_{i}"));
                Ok((
                    [g("planes", 0)?, g("planes", 1)?, g("planes", 2)?],
                    [g("shift", 0)?, g("shift", 1)?, g("shift", 2)?],
                ))
            };
            Some([set("qm")?, set("qms")?, set("qml")?])
        },
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

/// The tensor-core kernel's fixed blocks (the kernel's `qms_*` and `qml_*`), warps x n-tiles.
const MMA_BLOCKS: [(usize, usize); 2] = [(4, 1), (8, 4)];

/// The tensor-core kernel's block for a call of `tokens` rows: an index into `Kernels::mma` and its warps and
/// n-tiles.
fn mma_block(tokens: usize, tune: &QuantTune) -> (usize, usize, usize) {
    if tokens <= tune.mma_small_to {
        (1, MMA_BLOCKS[0].0, MMA_BLOCKS[0].1)
    } else if tokens >= tune.mma_large_from {
        (2, MMA_BLOCKS[1].0, MMA_BLOCKS[1].1)
    } else {
        (0, tune.mma_warps, tune.mma_ntiles)
    }
}

/// The tensor-core kernel's grid over `tokens` rows and `hidden` outputs: blocks of `warps` warps, 16 outputs a
/// warp, 8 `ntiles` tokens a block, `mma_split` blocks along z.
fn mma_grid(
    hidden: usize,
    tokens: usize,
    (warps, ntiles): (usize, usize),
    tune: &QuantTune,
) -> Result<LaunchConfig> {
    let tok = 8 * ntiles;
    let y = tokens.div_ceil(tok);
    if y > 65535 {
        return Err(Error::Param {
            name: "rows",
            why: format!("{tokens} rows: at most {} a call", 65535 * tok),
        });
    }
    Ok(LaunchConfig {
        grid_dim: (
            int(hidden.div_ceil(16 * warps), "hidden")? as u32,
            y as u32,
            tune.mma_split as u32,
        ),
        block_dim: ((32 * warps) as u32, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// Shared bytes of the one-token kernel at n columns: the token's activations and group sums.
fn one_shared(n: usize) -> usize {
    (n / 16) * (64 + 4)
}

/// The one-token kernel's launch: about `blocks_per_sm` blocks a multiprocessor, each a contiguous range of row
/// sets, a warp a set at a time (at most [`MAXW1`] warps).
fn one_grid(
    p: Packing,
    hidden: usize,
    n: usize,
    sms: usize,
    tune: &QuantTune,
) -> Result<LaunchConfig> {
    let sets = hidden.div_ceil(tune.rows[pack_index(p)]);
    let blocks = (sms * tune.blocks_per_sm).clamp(1, sets.max(1));
    let warps = sets.div_ceil(blocks).clamp(1, MAXW1);
    Ok(LaunchConfig {
        grid_dim: (int(blocks, "hidden")? as u32, 1, 1),
        block_dim: ((32 * warps) as u32, 1, 1),
        shared_mem_bytes: one_shared(n) as u32,
    })
}

/// Quantized out_proj weights on the device, with the host path's staging buffers.
pub struct CudaOutProj {
    cuda: Cuda,
    k: [Kernels; 2],
    tune: QuantTune,
    shape: (Packing, usize, usize),
    /// Fields, scales and zero terms (as bits), each padded with 7 rows of zeros.
    words: CudaSlice<u32>,
    scale: CudaSlice<u32>,
    zs: CudaSlice<u32>,
    /// The shift path's group sums, `reserve`d rows x n / 16.
    gsum: CudaSlice<f32>,
    /// Host path: the activations (plane or y, then group sums) and the output.
    x: CudaSlice<f32>,
    out: CudaSlice<f32>,
}

/// The packed words as u32 (a 16-bit packing's rows hold n / 8 or n / 2 u16: n a multiple of 16 makes every
/// row whole u32s).
fn device_words(w: &QuantWeights) -> Vec<u32> {
    w.word_bytes_le()
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

impl Cuda {
    /// Uploads quantized out_proj weights (once; every product reads them there).
    pub fn load_out_proj(&self, w: &QuantWeights) -> Result<CudaOutProj> {
        self.load_out_proj_with(w, QuantTune::DEFAULT)
    }

    /// The same, the one-token kernel launched under `tune` (the same bits under any: for benchmarks, tests).
    pub fn load_out_proj_with(&self, w: &QuantWeights, tune: QuantTune) -> Result<CudaOutProj> {
        let bad = |v: &[usize; 3], hi: usize| v.iter().any(|&r| r == 0 || r > hi);
        if bad(&tune.rows, 8)
            || bad(&tune.depth, 12)
            || !(1..=8).contains(&tune.blocks_per_sm)
            || ![2, 4, 8].contains(&tune.mma_warps)
            || !(1..=4).contains(&tune.mma_ntiles)
            || !(1..=8).contains(&tune.mma_split)
        {
            return Err(Error::Param {
                name: "tune",
                why: format!(
                    "{tune:?}: rows 1 to 8, depth 1 to 12, blocks a multiprocessor 1 to 8, mma warps 2, 4 or 8, mma n-tiles 1 to 4, mma split 1 to 8"
                ),
            });
        }
        self.load_words(
            w.shape(),
            &device_words(w),
            w.scales(),
            w.zero_terms(),
            tune,
        )
    }

    fn load_words(
        &self,
        shape: (Packing, usize, usize),
        words: &[u32],
        scale: &[f32],
        zs: &[f32],
        tune: QuantTune,
    ) -> Result<CudaOutProj> {
        let s = &self.stream;
        // 7 rows of zeros past the last: the one-token kernel's last row set (at most 8 rows) reads them
        let padded = |v: &[u32]| {
            let mut p = v.to_vec();
            p.resize(v.len() + 7 * (v.len() / shape.1.max(1)), 0);
            s.clone_htod(&p).map_err(drv)
        };
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
        Ok(CudaOutProj {
            k: [
                kernels(self, TILES[0], &tune)?,
                kernels(self, TILES[1], &tune)?,
            ],
            tune,
            shape,
            words: padded(words)?,
            scale: padded(&bits(scale))?,
            zs: padded(&bits(zs))?,
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
        let tune = QuantTune::DEFAULT;
        Ok(CudaBf16OutProj {
            k: [
                kernels(self, TILES[0], &tune)?,
                kernels(self, TILES[1], &tune)?,
            ],
            hidden: w.rows,
            n: w.cols,
            w: self.stream.clone_htod(&bits).map_err(drv)?,
            cuda: self.clone(),
        })
    }
}

impl CudaOutProj {
    /// Bytes of the fields, scales and zero terms (without the padding rows).
    pub fn bytes(&self) -> usize {
        let hidden = self.shape.1;
        4 * (self.words.len() + self.scale.len() + self.zs.len()) / (hidden + 7) * hidden
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
        let s = &self.cuda.stream;
        let (w, sc, z) = (
            addr(&self.words, s),
            addr(&self.scale, s),
            addr(&self.zs, s),
        );
        let k = &self.k[tile(tokens)];
        // one token whose activations fit the shared memory and whose padded weights' u32 indices fit 32 bits:
        // the streaming kernel
        let indexable = (hidden + 7)
            .checked_mul(n / 16 * 4)
            .is_some_and(|w| w <= i32::MAX as usize);
        let one = match &k.one {
            Some(f)
                if tokens == 1
                    && self.tune.one_kernel
                    && indexable
                    && one_shared(n) <= 48 << 10 =>
            {
                Some(f)
            }
            _ => None,
        };
        let mma = match &self.k[1].mma {
            Some(sets) if tokens >= self.tune.mma_from && one.is_none() => {
                let (i, warps, ntiles) = mma_block(tokens, &self.tune);
                Some((&sets[i], (warps, ntiles)))
            }
            _ => None,
        };
        let ((planes, shift_k), cfg) = match (one, mma) {
            (_, Some(((pl, sh), block))) => {
                ((pl, sh), mma_grid(hidden, tokens, block, &self.tune)?)
            }
            (Some((pl, sh)), None) => (
                (pl, sh),
                one_grid(p, hidden, n, self.cuda.multiprocessors(), &self.tune)?,
            ),
            (None, None) => ((&k.planes, &k.shift), grid(hidden, tokens)?),
        };
        let f = &if shift { shift_k } else { planes }[pack_index(p)];
        let (hidden, n, tokens) = (int(hidden, "hidden")?, int(n, "n")?, int(tokens, "rows")?);
        let mut b = s.launch_builder(f);
        b.arg(&w)
            .arg(&sc)
            .arg(&z)
            .arg(&x)
            .arg(&gsum)
            .arg(&out)
            .arg(&hidden)
            .arg(&n);
        if one.is_none() {
            b.arg(&tokens);
        }
        // SAFETY: the arguments match the kernel's signature (the q1 kernels take no token count; their shared
        // memory is `one_shared`, their grid `one_grid`'s); the weights are this object's (hidden x n), and
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Widths the seed's shape does not reach: rows of 3 groups (one partial chunk), 130 (5 chunks, the last of 2
    /// groups), 600 (19 chunks) and 800 (activations past the shared memory: the tiled kernel at one token too),
    /// every packing, both paths, 1 and 9 rows, under the default, the default with tensor cores from 4 rows
    /// (4-row calls in the 4 x 1 block, 9-row calls in 4 x 2), another shape (other rows, depths that do and do
    /// not divide the chunks, 8 x 4 blocks from 9 rows) and CUDA cores only: within 1e-5 of the dequantized product in f64, planes == shift bitwise, rows 5..9 alone ==
    /// the same rows inside the 9-row call where both take one kernel, and every shape of a kernel the same bits.
    #[test]
    fn odd_widths_padding_and_looping_warps() {
        let cuda = match Cuda::new() {
            Ok(c) => c,
            Err(e) => {
                eprintln!("odd_widths_padding_and_looping_warps skipped: {e}");
                return;
            }
        };
        let other = QuantTune {
            rows: [3, 1, 5],
            depth: [5, 3, 1],
            blocks_per_sm: 2,
            stream_hint: false,
            one_kernel: true,
            mma_from: 4,
            mma_warps: 8,
            mma_ntiles: 1,
            mma_small_to: 0,
            mma_large_from: 9,
            ..QuantTune::DEFAULT
        };
        let mut rng = gdn::synth::Synth::new(17);
        for h_v in [3usize, 130, 600, 800] {
            let sh = gdn::Shape::new(16, 1, h_v).unwrap();
            let (n, hidden) = (sh.n(), 37);
            let w = rng.uniform(hidden * n, -0.05, 0.05);
            for rows in [1usize, 9] {
                let y = rng.uniform(rows * n, -2.0, 2.0);
                let lay = OutputLayout::for_rows(&sh, rows, Some(rows * n)).unwrap();
                let mut buf = vec![0.0f32; lay.len()];
                let p = rows * n;
                for (i, &v) in y.iter().enumerate() {
                    buf[i] = v;
                    for k in 1..4 {
                        buf[k * p + i] = v * gdn::plane_scale(k, i % n);
                    }
                }
                let gs = quant::group_sums(&y);
                buf[4 * p..4 * p + gs.len()].copy_from_slice(&gs);
                for pk in Packing::ALL {
                    let what = format!("{pk:?} n {n} rows {rows}");
                    let q = QuantWeights::quantize(&w, hidden, n, pk).unwrap();
                    let dq = q.dequantized();
                    let want: Vec<f64> = (0..rows)
                        .flat_map(|r| {
                            let (y, dq) = (&y, &dq);
                            (0..hidden).map(move |o| {
                                (0..n)
                                    .map(|m| dq[o * n + m] * y[r * n + m] as f64)
                                    .sum::<f64>()
                            })
                        })
                        .collect();
                    // the same bits under every launch shape of one kernel family: [CUDA cores, tensor cores]
                    let mut first: [Option<Vec<u32>>; 2] = [None, None];
                    let tensor = QuantTune {
                        mma_from: 4,
                        ..QuantTune::DEFAULT
                    };
                    let cores = QuantTune {
                        mma_from: usize::MAX,
                        ..QuantTune::DEFAULT
                    };
                    for tune in [QuantTune::DEFAULT, tensor, other, cores] {
                        let mut prod = cuda.load_out_proj_with(&q, tune).unwrap();
                        let mut a = vec![f32::NAN; rows * hidden];
                        let mut b = vec![f32::NAN; rows * hidden];
                        prod.product_planes(&buf, &lay, &mut a).unwrap();
                        prod.product_shift(&y, rows, &mut b).unwrap();
                        let e = gdn::relative_error(&a, &want);
                        assert!(e < 1e-5, "{what}: {e:.2e} from the f64 product");
                        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        assert_eq!(bits(&a), bits(&b), "{what}: planes against shift");
                        let family = &mut first[(rows >= tune.mma_from) as usize];
                        match family {
                            None => *family = Some(bits(&a)),
                            Some(f) => assert_eq!(*f, bits(&a), "{what}: launch shapes differ"),
                        }
                        if rows > 1 && (4 >= tune.mma_from) == (rows >= tune.mma_from) {
                            // rows 5..9 as a call of their own (on the kernel the 9 rows take)
                            let mut four = vec![f32::NAN; 4 * hidden];
                            prod.product_shift(&y[5 * n..9 * n], 4, &mut four).unwrap();
                            assert_eq!(
                                bits(&four),
                                bits(&b[5 * hidden..]),
                                "{what}: rows 5..9 alone"
                            );
                        }
                    }
                }
            }
        }
    }

    /// A planes product at the seed's out_proj, 2-bit and 8-bit in u32, one token (the one-token kernel), two (the
    /// tiled kernel) and 64 (the tensor-core kernel), for a profiler (`--ignored`; ncu flushes the caches between
    /// the calls it profiles).
    #[test]
    #[ignore]
    fn quant_profile_target() {
        let cuda = match Cuda::new() {
            Ok(c) => c,
            Err(e) => {
                eprintln!("quant_profile_target skipped: {e}");
                return;
            }
        };
        let (hidden, n) = (5120, 6144);
        let mut rng = gdn::synth::Synth::new(5);
        let w = rng.uniform(hidden * n, -0.02, 0.02);
        let s = cuda.stream.clone();
        for p in [Packing::Q2U16, Packing::Q8U32] {
            let q = QuantWeights::quantize(&w, hidden, n, p).unwrap();
            let one = QuantTune {
                one_kernel: true,
                ..QuantTune::DEFAULT
            };
            let prod = cuda.load_out_proj_with(&q, one).unwrap();
            for rows in [1usize, 2, 64] {
                let xd = s.clone_htod(&rng.uniform(rows * n, -1.0, 1.0)).unwrap();
                let gd = s
                    .clone_htod(&rng.uniform(rows * (n / 16), -1.0, 1.0))
                    .unwrap();
                let mut od = s.alloc_zeros::<f32>(rows * hidden).unwrap();
                let (x, g) = (addr(&xd, &s), addr(&gd, &s));
                let o = addr_mut(&mut od, &s);
                prod.launch(false, x, g, o, rows).unwrap();
                s.synchronize().unwrap();
            }
        }
    }

    /// The sweeps' device, seed out_proj shape (hidden 5120, n 6144) and f32 weights; None (with a message) without
    /// a device.
    fn sweep_setup(name: &str) -> Option<(Cuda, usize, usize, gdn::synth::Synth, Vec<f32>)> {
        let cuda = match Cuda::new() {
            Ok(c) => c,
            Err(e) => {
                eprintln!("{name} skipped: {e}");
                return None;
            }
        };
        let (hidden, n) = (5120, 6144);
        let mut rng = gdn::synth::Synth::new(5);
        let w = rng.uniform(hidden * n, -0.02, 0.02);
        Some((cuda, hidden, n, rng, w))
    }

    /// Enough copies of `q` on the device under `tune` to span 256 MiB (products rotating over them read their
    /// weights from memory).
    fn rotated(cuda: &Cuda, q: &QuantWeights, tune: QuantTune) -> Vec<CudaOutProj> {
        let copies = (256usize << 20).div_ceil(q.bytes()).max(1);
        let words = device_words(q);
        (0..copies)
            .map(|_| {
                cuda.load_words(q.shape(), &words, q.scales(), q.zero_terms(), tune)
                    .unwrap()
            })
            .collect()
    }

    /// The planes product at the seed's out_proj (n 6144 -> 5120) under several launch shapes, on the device
    /// (`--ignored --nocapture`): every shape's bits equal the default's, and its time per call (CUDA graphs,
    /// weights rotated over 256 MiB of copies) is printed as a table. For choosing [`QuantTune::DEFAULT`].
    #[test]
    #[ignore]
    fn quant_tune_sweep() {
        let Some((cuda, hidden, n, mut rng, w)) = sweep_setup("quant_tune_sweep") else {
            return;
        };
        let groups = n / 16;
        let d = QuantTune::DEFAULT;
        let tiled = QuantTune {
            one_kernel: false,
            ..d
        };
        // the one-token kernel's shapes around its first one (4 rows, depth 4,2,2, one block an SM), against the
        // tiled kernel
        let one = QuantTune {
            rows: [4, 4, 4],
            depth: [4, 2, 2],
            blocks_per_sm: 1,
            stream_hint: true,
            one_kernel: true,
            mma_from: 4,
            ..QuantTune::DEFAULT
        };
        let with = |f: &dyn Fn(&mut QuantTune)| {
            let mut t = one;
            f(&mut t);
            t
        };
        let tunes: Vec<(&str, QuantTune)> = vec![
            ("tiled kernel", tiled),
            ("default", d),
            ("q1 rows 4 depth 4,2,2", one),
            ("q1 2 blocks an SM", with(&|t| t.blocks_per_sm = 2)),
            ("q1 no stream hint", with(&|t| t.stream_hint = false)),
            ("q1 depth 6,3,3", with(&|t| t.depth = [6, 3, 3])),
            ("q1 depth 3,4,4", with(&|t| t.depth = [3, 4, 4])),
            (
                "q1 rows 2 depth 6,4,4",
                with(&|t| {
                    t.rows = [2, 2, 2];
                    t.depth = [6, 4, 4];
                }),
            ),
            (
                "q1 rows 2 depth 4, 2 blocks",
                with(&|t| {
                    t.rows = [2, 2, 2];
                    t.depth = [4, 4, 4];
                    t.blocks_per_sm = 2;
                }),
            ),
            (
                "q1 rows 8,2,2 depth 2,6,6",
                with(&|t| {
                    t.rows = [8, 2, 2];
                    t.depth = [2, 6, 6];
                }),
            ),
            (
                "q1 rows 1 depth 12,6,6",
                with(&|t| {
                    t.rows = [1, 1, 1];
                    t.depth = [12, 6, 6];
                }),
            ),
        ];
        let s = cuda.stream.clone();
        let mut table = Vec::new();
        for p in Packing::ALL {
            let q = QuantWeights::quantize(&w, hidden, n, p).unwrap();
            for rows in [1usize, 2, 3, 8, 64] {
                let xh = rng.uniform(rows * n, -1.0, 1.0);
                let gh = rng.uniform(rows * groups, -1.0, 1.0);
                let xd = s.clone_htod(&xh).unwrap();
                let gd = s.clone_htod(&gh).unwrap();
                let mut od = s.alloc_zeros::<f32>(rows * hidden).unwrap();
                let mut reference: Option<Vec<u32>> = None;
                for (name, tune) in &tunes {
                    // the launch shape is the one-token kernel's
                    if *tune != d && rows != 1 {
                        continue;
                    }
                    let qs = rotated(&cuda, &q, *tune);
                    let copies = qs.len();
                    let (x, g) = (addr(&xd, &s), addr(&gd, &s));
                    let o = addr_mut(&mut od, &s);
                    qs[0].launch(false, x, g, o, rows).unwrap();
                    let bits: Vec<u32> = s
                        .clone_dtoh(&od)
                        .unwrap()
                        .iter()
                        .map(|v| v.to_bits())
                        .collect();
                    match &reference {
                        None => reference = Some(bits),
                        Some(r) => assert!(
                            *r == bits,
                            "{p:?} rows {rows}: {name} changes bits against the default"
                        ),
                    }
                    let per = (2 * copies).clamp(8, 64);
                    let t = time_graph(&cuda, per, &mut |i| {
                        qs[i % copies].launch(false, x, g, o, rows)
                    })
                    .unwrap();
                    let floor = q.bytes() as f64 / 4.2e12;
                    let line = format!(
                        "| {} | {rows} | {name} | {:.2} | {:.2} |",
                        p.name(),
                        t * 1e6,
                        t / floor
                    );
                    eprintln!("{line}");
                    table.push(line);
                }
            }
        }
        println!("| packing | rows | shape | planes us | / floor (4.2 TB/s) |");
        println!("|---|---|---|---|---|");
        for l in table {
            println!("{l}");
        }
    }

    /// The tensor-core kernel against the CUDA-core kernels at the seed's out_proj (n 6144 -> 5120), on the device
    /// (`--ignored --nocapture`): for every packing and row count, the tensor-core kernel under several blocks
    /// (warps x n-tiles / split; the same bits under all of one split, asserted) against the CUDA-core kernels
    /// (relative L2 difference within 1e-5), times per call (CUDA graphs, weights rotated over 256 MiB of copies),
    /// as a table. For choosing [`QuantTune::DEFAULT`]'s `mma_from` and block.
    #[test]
    #[ignore]
    fn quant_mma_sweep() {
        let Some((cuda, hidden, n, mut rng, w)) = sweep_setup("quant_mma_sweep") else {
            return;
        };
        let groups = n / 16;
        let cores = QuantTune {
            mma_from: usize::MAX,
            ..QuantTune::DEFAULT
        };
        // (warps, n-tiles, split), one block for every row count; the bits depend on the split only. Last: the
        // default's blocks by row count (4 x 1 to 8 rows, 8 x 4 from 128, else 4 x 2; split 8)
        let shapes = [(4, 1, 8), (4, 2, 8), (8, 4, 8), (8, 2, 8), (8, 4, 4)];
        let mut tunes = vec![cores];
        for (mma_warps, mma_ntiles, mma_split) in shapes {
            tunes.push(QuantTune {
                mma_from: 1,
                one_kernel: false,
                mma_warps,
                mma_ntiles,
                mma_split,
                mma_small_to: 0,
                mma_large_from: usize::MAX,
                ..QuantTune::DEFAULT
            });
        }
        tunes.push(QuantTune {
            mma_from: 1,
            one_kernel: false,
            ..QuantTune::DEFAULT
        });
        let split = |k: usize| {
            shapes
                .get(k - 1)
                .map_or(QuantTune::DEFAULT.mma_split, |s| s.2)
        };
        let s = cuda.stream.clone();
        let mut table = Vec::new();
        for p in Packing::ALL {
            let q = QuantWeights::quantize(&w, hidden, n, p).unwrap();
            let sets: Vec<Vec<CudaOutProj>> =
                tunes.iter().map(|t| rotated(&cuda, &q, *t)).collect();
            let copies = sets[0].len();
            for rows in [1usize, 4, 8, 16, 64, 256, 512] {
                let xd = s.clone_htod(&rng.uniform(rows * n, -1.0, 1.0)).unwrap();
                let gd = s
                    .clone_htod(&rng.uniform(rows * groups, -1.0, 1.0))
                    .unwrap();
                let mut od = s.alloc_zeros::<f32>(rows * hidden).unwrap();
                let (x, g) = (addr(&xd, &s), addr(&gd, &s));
                let o = addr_mut(&mut od, &s);
                let mut outs = Vec::new();
                let mut times = Vec::new();
                for qs in &sets {
                    qs[0].launch(false, x, g, o, rows).unwrap();
                    outs.push(s.clone_dtoh(&od).unwrap());
                    let per = (2 * copies).clamp(8, 64);
                    let t = time_graph(&cuda, per, &mut |i| {
                        qs[i % copies].launch(false, x, g, o, rows)
                    })
                    .unwrap();
                    times.push(t * 1e6);
                }
                let wide: Vec<f64> = outs[0].iter().map(|&v| v as f64).collect();
                let diff = outs[1..]
                    .iter()
                    .map(|o| gdn::relative_error(o, &wide))
                    .fold(0.0, f64::max);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                for (k, o) in outs.iter().enumerate().skip(1) {
                    let first = 1 + shapes.iter().position(|s| s.2 == split(k)).unwrap();
                    assert!(
                        bits(o) == bits(&outs[first]),
                        "{p:?} rows {rows}: block {k} changes bits"
                    );
                }
                let best = times[1..].iter().copied().fold(f64::INFINITY, f64::min);
                let floor = q.bytes() as f64 / 4.2e12 * 1e6;
                let cols: Vec<String> = times.iter().map(|t| format!("{t:.2}")).collect();
                let line = format!(
                    "| {} | {rows} | {} | {:.2} | {:.2} | {diff:.1e} |",
                    p.name(),
                    cols.join(" | "),
                    times[0] / best,
                    best / floor
                );
                eprintln!("{line}");
                table.push(line);
                assert!(
                    diff < 1e-5,
                    "{p:?} rows {rows}: tensor against CUDA cores {diff:.2e}"
                );
            }
        }
        let mut heads: Vec<String> = shapes
            .iter()
            .map(|(w, t, z)| format!("tensor {w} warps x {t} n-tiles / {z} us"))
            .collect();
        heads.push("tensor, default (block by rows) us".into());
        println!(
            "| packing | rows | CUDA cores us | {} | speed-up (best) | best / floor (4.2 TB/s) | relative difference |",
            heads.join(" | ")
        );
        println!("|{}", "---|".repeat(6 + heads.len()));
        for l in table {
            println!("{l}");
        }
    }
}
