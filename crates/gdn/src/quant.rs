//! The planes' consumer: the layer's out_proj (n -> hidden) over quantized weights, reading the step's prepared
//! planes and group sums (SPEC.md, "Prepared activations" and "The quantized out_proj").
//!
//! Weights are affine per group of 16 input columns: `w = scale (q - zero)`. A packed word holds several fields;
//! the product masks a field in place (no shift) and multiplies it by the plane whose scale undoes the field's bit
//! position, so `float(word & mask_e) * plane[m] = q_m y_m` exactly; the zero point's share is `scale * zero`
//! times the group's sum of y, read from the step's group sums. [`QuantWeights::product_planes`] is that path;
//! [`QuantWeights::product_shift`] computes the same product from y alone (a shift per field and its own pass
//! for the group sums), for comparison.
//!
//! Every backend runs the product behind one trait, [`QuantBackend::load_out_proj`] -> [`OutProj`] (weights
//! uploaded once; the CPU's is [`QuantWeights`] itself, gdn-cuda's and gdn-wgpu's upload them), so the
//! conformance suite checks them all with the same cases; [`check_planes`] and [`check_shift`] are the argument
//! checks they share. [`Bf16Weights`] is the plain bf16 out_proj the tail benchmark compares against.

use multiversion::multiversion;
use rayon::prelude::*;

use crate::batch::OutputLayout;
use crate::{Error, Result};

/// `out [r_n][hidden]` from the kernels' `tmp [hidden][r_n]`.
fn rows_to_out(tmp: &[f32], out: &mut [f32], r_n: usize) {
    let hidden = tmp.len() / r_n;
    for (o, row) in tmp.chunks_exact(r_n).enumerate() {
        for (r, &v) in row.iter().enumerate() {
            out[r * hidden + o] = v;
        }
    }
}

/// How weights are packed: field width, fields per word, and which plane serves them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Packing {
    /// 2-bit fields, eight to a 16-bit word (plane 1: `y 4^-(m mod 8)`).
    Q2U16,
    /// 8-bit fields, four to a 32-bit word (plane 2: `y 256^-(m mod 4)`).
    Q8U32,
    /// 8-bit fields, two to a 16-bit word (plane 3: `y`, or `y / 256` for odd m).
    Q8U16,
}

impl Packing {
    pub const ALL: [Packing; 3] = [Packing::Q2U16, Packing::Q8U32, Packing::Q8U16];
    pub fn bits(self) -> u32 {
        match self {
            Packing::Q2U16 => 2,
            _ => 8,
        }
    }
    /// Fields per word.
    pub fn fields(self) -> usize {
        match self {
            Packing::Q2U16 => 8,
            Packing::Q8U32 => 4,
            Packing::Q8U16 => 2,
        }
    }
    /// Bytes per word.
    pub fn word_bytes(self) -> usize {
        match self {
            Packing::Q8U32 => 4,
            _ => 2,
        }
    }
    /// The plane (1, 2 or 3) of the step's output that serves this packing.
    pub fn plane(self) -> usize {
        match self {
            Packing::Q2U16 => 1,
            Packing::Q8U32 => 2,
            Packing::Q8U16 => 3,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Packing::Q2U16 => "2-bit, 8 per u16",
            Packing::Q8U32 => "8-bit, 4 per u32",
            Packing::Q8U16 => "8-bit, 2 per u16",
        }
    }
}

/// Packed words as the packing stores them.
#[derive(Clone, Debug)]
enum Words {
    U16(Vec<u16>),
    U32(Vec<u32>),
}

impl Words {
    fn get(&self, i: usize) -> u32 {
        match self {
            Words::U16(w) => w[i] as u32,
            Words::U32(w) => w[i],
        }
    }
}

/// out_proj weights `[rows][cols]` (rows = hidden, cols = n), quantized per group of 16 columns.
#[derive(Clone, Debug)]
pub struct QuantWeights {
    pub packing: Packing,
    pub rows: usize,
    pub cols: usize,
    /// Packed fields, row-major, in the packing's word type.
    words: Words,
    /// `[rows][cols / 16]` scale, and scale times zero point.
    scale: Vec<f32>,
    zs: Vec<f32>,
}

impl QuantWeights {
    /// Quantizes `w` (`[rows][cols]`, cols a multiple of 16): per group, the range `[min, max]` onto the field's
    /// `0 ..= 2^bits - 1`, nearest.
    pub fn quantize(w: &[f32], rows: usize, cols: usize, packing: Packing) -> Result<QuantWeights> {
        if cols == 0 || !cols.is_multiple_of(16) {
            return Err(Error::Param {
                name: "cols",
                why: format!("{cols} must be a positive multiple of 16"),
            });
        }
        check_weights(w, rows, cols)?;
        if let Some(i) = w.iter().position(|x| !x.is_finite()) {
            return Err(Error::Param {
                name: "weights",
                why: format!("element {i} is {}", w[i]),
            });
        }
        let (b, f) = (packing.bits(), packing.fields());
        let top = ((1u32 << b) - 1) as f32;
        let groups = cols / 16;
        let mut words = vec![0u32; rows * cols / f];
        let (mut scale, mut zs) = (vec![0.0f32; rows * groups], vec![0.0f32; rows * groups]);
        for r in 0..rows {
            for g in 0..groups {
                let x = &w[r * cols + 16 * g..r * cols + 16 * g + 16];
                let lo = x.iter().copied().fold(f32::INFINITY, f32::min);
                let hi = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let s = if hi > lo { (hi - lo) / top } else { 1.0 };
                let zero = -lo / s;
                scale[r * groups + g] = s;
                zs[r * groups + g] = s * zero;
                for (e, &v) in x.iter().enumerate() {
                    let q = ((v - lo) / s).round().clamp(0.0, top) as u32;
                    let m = 16 * g + e;
                    words[(r * cols + m) / f] |= q << (b * (m % f) as u32);
                }
            }
        }
        let words = if packing.word_bytes() == 2 {
            Words::U16(words.iter().map(|&w| w as u16).collect())
        } else {
            Words::U32(words)
        };
        Ok(QuantWeights {
            packing,
            rows,
            cols,
            words,
            scale,
            zs,
        })
    }

    /// The weights these fields stand for, `scale q - scale zero` per element (for references).
    pub fn dequantized(&self) -> Vec<f64> {
        let (b, f) = (self.packing.bits(), self.packing.fields());
        let groups = self.cols / 16;
        let mut out = vec![0.0f64; self.rows * self.cols];
        for r in 0..self.rows {
            for m in 0..self.cols {
                let q = (self.words.get((r * self.cols + m) / f) >> (b * (m % f) as u32))
                    & ((1 << b) - 1);
                let gi = r * groups + m / 16;
                out[r * self.cols + m] = self.scale[gi] as f64 * q as f64 - self.zs[gi] as f64;
            }
        }
        out
    }

    /// Bytes of the packed fields plus the per-group scale and zero terms: what a product must read.
    pub fn bytes(&self) -> usize {
        self.rows * self.cols / self.packing.fields() * self.packing.word_bytes()
            + 8 * self.scale.len()
    }

    /// Where a planes product reads in the step's output buffer of `step_len` elements laid out as `layout`
    /// (which must have planes and the weights' n): the offsets of the packing's plane and of the group sums,
    /// after checking `out_len` (= rows x hidden). Every backend's product checks its arguments with this.
    pub fn check_planes(
        &self,
        step_len: usize,
        layout: &OutputLayout,
        out_len: usize,
    ) -> Result<(usize, usize)> {
        check_planes(self.shape(), step_len, layout, out_len)
    }

    /// Checks a shift-path call: y `[rows][cols]` of `y_len` elements, `out_len` = rows x hidden.
    pub fn check_shift(&self, y_len: usize, rows: usize, out_len: usize) -> Result<()> {
        check_shift(self.shape(), y_len, rows, out_len)
    }

    /// The packing, hidden size (rows) and n (columns).
    pub fn shape(&self) -> (Packing, usize, usize) {
        (self.packing, self.rows, self.cols)
    }

    /// The packed fields as little-endian bytes, row-major (`rows x cols / fields` words of `word_bytes`): what
    /// a device backend uploads.
    pub fn word_bytes_le(&self) -> Vec<u8> {
        match &self.words {
            Words::U16(w) => w.iter().flat_map(|v| v.to_le_bytes()).collect(),
            Words::U32(w) => w.iter().flat_map(|v| v.to_le_bytes()).collect(),
        }
    }

    /// The per-group scales `[rows][cols / 16]`.
    pub fn scales(&self) -> &[f32] {
        &self.scale
    }

    /// The per-group zero terms (scale times zero point) `[rows][cols / 16]`.
    pub fn zero_terms(&self) -> &[f32] {
        &self.zs
    }

    /// Bytes of the packed fields alone (without scales and zero terms).
    pub fn field_bytes(&self) -> usize {
        self.rows * self.cols / self.packing.fields() * self.packing.word_bytes()
    }

    /// `out [R][rows] = y W^T` from the step's output buffer `step_out` (f32, laid out as `layout`, which must
    /// have planes): the packing's plane, masked fields, and the group sums for the zero points.
    pub fn product_planes(
        &self,
        step_out: &[f32],
        layout: &OutputLayout,
        out: &mut [f32],
    ) -> Result<()> {
        let (at_plane, at_gsum) = self.check_planes(step_out.len(), layout, out.len())?;
        let (r_n, n) = (layout.rows, self.cols);
        let plane = &step_out[at_plane..at_plane + r_n * n];
        let gsum = &step_out[at_gsum..at_gsum + r_n * (n / 16)];
        self.product(plane, gsum, r_n, out, false);
        Ok(())
    }

    /// The same product from y `[R][cols]` alone: each field shifted down before it is used, and the group sums
    /// computed in a pass of their own (what a consumer without the planes does).
    pub fn product_shift(&self, y: &[f32], rows: usize, out: &mut [f32]) -> Result<()> {
        self.check_shift(y.len(), rows, out.len())?;
        let gsum = group_sums(y);
        self.product(y, &gsum, rows, out, true);
        Ok(())
    }

    fn product(&self, x: &[f32], gsum: &[f32], r_n: usize, out: &mut [f32], shift: bool) {
        let (n, hidden) = (self.cols, self.rows);
        let groups = n / 16;
        let wpr = n / self.packing.fields();
        // output rows in chunks over the threads; every token of the batch per weight row, so each word is read
        // once per call
        const CHUNK: usize = 64;
        let mut tmp = vec![0.0f32; hidden * r_n];
        #[cfg(target_arch = "x86_64")]
        let bytes_of = |o: usize| self.row_bytes(o..o + 1);
        // row q's words, scales and zero terms into L1
        #[cfg(target_arch = "x86_64")]
        let prefetch_row = |q: usize| {
            prefetch(bytes_of(q));
            prefetch(bytemuck::cast_slice(
                &self.scale[q * groups..(q + 1) * groups],
            ));
            prefetch(bytemuck::cast_slice(&self.zs[q * groups..(q + 1) * groups]));
        };
        // one or two tokens on integer dot products where the CPU has them and every activation is finite
        #[cfg(target_arch = "x86_64")]
        if !shift
            && r_n <= 2
            && std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512vnni")
            && std::arch::is_x86_feature_detected!("avx512vbmi")
        {
            if let Some((digits, factor)) = vnni::layout(self.packing, x, n, r_n) {
                tmp.par_chunks_mut(CHUNK * r_n)
                    .enumerate()
                    .for_each(|(c, chunk)| {
                        // rows in blocks (four for one token, two for two: twelve accumulators), so that each
                        // vector of the token's digits is loaded once for the block; the chunk's last rows in a
                        // block of two where they are two, else one at a time
                        let rb = if r_n == 1 { 4 } else { 2 };
                        let mut i = 0;
                        for block in chunk.chunks_mut(rb * r_n) {
                            let o = c * CHUNK + i;
                            // SAFETY: the CPU has AVX-512F, VNNI and VBMI (checked above); `digits` and
                            // `factor` are the layout of the call's r_n tokens
                            unsafe {
                                match block.len() / r_n {
                                    4 => self.vnni_rows::<4>(o, &digits, &factor, gsum, block),
                                    2 => self.vnni_rows::<2>(o, &digits, &factor, gsum, block),
                                    _ => {
                                        for (q, acc) in block.chunks_exact_mut(r_n).enumerate() {
                                            self.vnni_rows::<1>(o + q, &digits, &factor, gsum, acc)
                                        }
                                    }
                                }
                            }
                            i += block.len() / r_n;
                        }
                    });
                rows_to_out(&tmp, out, r_n);
                return;
            }
        }
        #[cfg(target_arch = "x86_64")]
        if !shift && std::arch::is_x86_feature_detected!("avx512f") {
            // one or two tokens: each weight row streams in one piece; more: words in blocks of 64 groups, so
            // that a block of every token's activations (8 tokens x 1024 values: 32 KiB) stays in L1 while a
            // chunk of weight rows streams past it
            let all = avx512::words(self.packing, n);
            let width = if r_n <= 2 {
                all.div_ceil(64) * 64
            } else {
                64 * 16 * self.packing.bits() as usize / 32
            };
            let xt = avx512::layout(self.packing, x, n, width);
            tmp.par_chunks_mut(CHUNK * r_n)
                .enumerate()
                .for_each(|(c, chunk)| {
                    let o0 = c * CHUNK;
                    // a block of 8 tokens' activations stays in L1 while the chunk's rows stream past it
                    for (jb, t0) in (0..all.div_ceil(width))
                        .flat_map(|jb| (0..r_n).step_by(8).map(move |t0| (jb, t0)))
                    {
                        for (i, acc_row) in chunk.chunks_exact_mut(r_n).enumerate() {
                            let o = o0 + i;
                            // one or two tokens: the next weight row's words, scales and zero terms fetched into
                            // L1 while this one is summed
                            if r_n <= 2 && o + 1 < hidden {
                                prefetch_row(o + 1);
                            }
                            let scale = &self.scale[o * groups..(o + 1) * groups];
                            // SAFETY: the CPU has AVX-512F (checked above); `bytes_of(o)` is the row's packed
                            // bytes, `scale` its groups' scales and `xt` the layout of every token's activations
                            // for this packing, n and width, as `row_part` asks.
                            unsafe {
                                avx512::row_part(
                                    self.packing,
                                    bytes_of(o),
                                    scale,
                                    &xt,
                                    acc_row,
                                    width,
                                    jb,
                                    t0..(t0 + 8).min(r_n),
                                )
                            };
                            // the zero points' share once a row, while its zero terms are in cache
                            if jb == 0 && t0 == 0 {
                                let zs = &self.zs[o * groups..(o + 1) * groups];
                                for (r, a) in acc_row.iter_mut().enumerate() {
                                    // SAFETY: as above; both slices have `groups` values
                                    *a -= unsafe {
                                        avx512::dot(zs, &gsum[r * groups..(r + 1) * groups])
                                    };
                                }
                            }
                        }
                    }
                });
            rows_to_out(&tmp, out, r_n);
            return;
        }
        tmp.par_chunks_mut(CHUNK * r_n)
            .enumerate()
            .for_each(|(c, block)| {
                let o0 = c * CHUNK;
                for (i, acc_row) in block.chunks_exact_mut(r_n).enumerate() {
                    let o = o0 + i;
                    let scale = &self.scale[o * groups..(o + 1) * groups];
                    let zs = &self.zs[o * groups..(o + 1) * groups];
                    let w = match &self.words {
                        Words::U16(w) => Row::U16(&w[o * wpr..(o + 1) * wpr]),
                        Words::U32(w) => Row::U32(&w[o * wpr..(o + 1) * wpr]),
                    };
                    row_dots(self.packing, shift, w, scale, zs, x, gsum, acc_row);
                }
            });
        rows_to_out(&tmp, out, r_n);
    }
    /// The packed bytes of weight rows `rows` (contiguous, 4 a word in either word size).
    #[cfg(target_arch = "x86_64")]
    fn row_bytes(&self, rows: std::ops::Range<usize>) -> &[u8] {
        let wpr = self.cols / self.packing.fields();
        match &self.words {
            Words::U16(w) => bytemuck::cast_slice(&w[rows.start * wpr..rows.end * wpr]),
            Words::U32(w) => bytemuck::cast_slice(&w[rows.start * wpr..rows.end * wpr]),
        }
    }

    /// Rows o .. o + R of the integer kernel (`vnni::rows`) into `acc` (`[row][token]`), the zero points' share
    /// subtracted, the next R rows' words, scales and zero terms prefetched a slice a step.
    ///
    /// # Safety
    /// The CPU has AVX-512F, VNNI and VBMI; `digits` and `factor` are `vnni::layout`'s for `acc.len() / R` tokens.
    #[cfg(target_arch = "x86_64")]
    unsafe fn vnni_rows<const R: usize>(
        &self,
        o: usize,
        digits: &[i32],
        factor: &[f32],
        gsum: &[f32],
        acc: &mut [f32],
    ) {
        let groups = self.cols / 16;
        let r_n = acc.len() / R;
        // the next block's rows are contiguous in each of the three arrays
        let (q0, q1) = ((o + R).min(self.rows), (o + 2 * R).min(self.rows));
        let next: [&[u8]; 3] = [
            self.row_bytes(q0..q1),
            bytemuck::cast_slice(&self.scale[q0 * groups..q1 * groups]),
            bytemuck::cast_slice(&self.zs[q0 * groups..q1 * groups]),
        ];
        let w = std::array::from_fn(|k| self.row_bytes(o + k..o + k + 1));
        let scale = std::array::from_fn(|k| &self.scale[(o + k) * groups..(o + k + 1) * groups]);
        // SAFETY: the CPU has AVX-512F, VNNI and VBMI (this function's contract); `w[k]` is row o + k's packed bytes,
        // `scale[k]` its groups' scales, `digits` and `factor` the layout of the call's r_n tokens for this packing
        // and n, as `rows` asks; `dot` needs AVX-512F and two slices of `groups` values.
        unsafe {
            vnni::rows::<R>(self.packing, w, scale, digits, factor, next, acc);
            for (k, acc_row) in acc.chunks_exact_mut(r_n).enumerate() {
                let zs = &self.zs[(o + k) * groups..(o + k + 1) * groups];
                for (r, a) in acc_row.iter_mut().enumerate() {
                    *a -= avx512::dot(zs, &gsum[r * groups..(r + 1) * groups]);
                }
            }
        }
    }
}

fn check_out(hidden: usize, rows: usize, out_len: usize) -> Result<()> {
    let want = rows.checked_mul(hidden).ok_or_else(|| Error::Param {
        name: "out",
        why: "rows x hidden overflows".into(),
    })?;
    if out_len != want {
        return Err(Error::Length {
            name: "out",
            expected: want,
            got: out_len,
        });
    }
    Ok(())
}

/// [`QuantWeights::check_planes`] for weights of this `(packing, hidden, n)` (a device backend keeps no host
/// copy of the weights): the offsets of the packing's plane and of the group sums in the step's output.
pub fn check_planes(
    (packing, hidden, n): (Packing, usize, usize),
    step_len: usize,
    layout: &OutputLayout,
    out_len: usize,
) -> Result<(usize, usize)> {
    let p = layout.plane_stride.ok_or_else(|| Error::Param {
        name: "layout",
        why: "the step's output has no planes (plane_stride None)".into(),
    })?;
    if layout.n != n {
        return Err(Error::Param {
            name: "layout",
            why: format!(
                "the step's n = {} is not the weights' {n} columns",
                layout.n
            ),
        });
    }
    if step_len != layout.len() {
        return Err(Error::Length {
            name: "step_out",
            expected: layout.len(),
            got: step_len,
        });
    }
    check_out(hidden, layout.rows, out_len)?;
    // OutputLayout::for_rows checked that 4P + rows n / 16 fits
    Ok((packing.plane() * p, 4 * p))
}

/// [`QuantWeights::check_shift`] for weights of this `(packing, hidden, n)`.
pub fn check_shift(
    (_, hidden, n): (Packing, usize, usize),
    y_len: usize,
    rows: usize,
    out_len: usize,
) -> Result<()> {
    let want = rows.checked_mul(n).ok_or_else(|| Error::Param {
        name: "y",
        why: "rows x cols overflows".into(),
    })?;
    if y_len != want {
        return Err(Error::Length {
            name: "y",
            expected: want,
            got: y_len,
        });
    }
    check_out(hidden, rows, out_len)
}

/// The group sums of y `[R][n]` as the step writes them (per 16 columns: the even columns' sum plus the odd
/// columns', each in increasing column order): the shift path's own pass.
pub fn group_sums(y: &[f32]) -> Vec<f32> {
    y.chunks_exact(16)
        .map(|g| {
            let (mut even, mut odd) = (0.0f32, 0.0f32);
            for e in (0..16).step_by(2) {
                even += g[e];
                odd += g[e + 1];
            }
            even + odd
        })
        .collect()
}

/// The quantized out_proj on one backend, its weights already where the backend computes (uploaded once by
/// [`QuantBackend::load_out_proj`]). Host slices in and out; device backends also have entries on their own
/// buffers.
pub trait OutProj {
    /// The weights' packing, hidden size (output rows) and n (input columns).
    fn shape(&self) -> (Packing, usize, usize);
    /// As [`QuantWeights::product_planes`]: `out [R][hidden]` from the step's output (y, planes, group sums).
    fn product_planes(
        &mut self,
        step_out: &[f32],
        layout: &OutputLayout,
        out: &mut [f32],
    ) -> Result<()>;
    /// As [`QuantWeights::product_shift`]: the same product from y `[rows][n]` alone.
    fn product_shift(&mut self, y: &[f32], rows: usize, out: &mut [f32]) -> Result<()>;
}

/// A backend that runs the quantized out_proj (every backend of the workspace: the conformance suite checks
/// them all the same way).
pub trait QuantBackend: crate::Backend {
    fn load_out_proj(&self, weights: &QuantWeights) -> Result<Box<dyn OutProj>>;
}

impl OutProj for QuantWeights {
    fn shape(&self) -> (Packing, usize, usize) {
        QuantWeights::shape(self)
    }
    fn product_planes(
        &mut self,
        step_out: &[f32],
        layout: &OutputLayout,
        out: &mut [f32],
    ) -> Result<()> {
        QuantWeights::product_planes(self, step_out, layout, out)
    }
    fn product_shift(&mut self, y: &[f32], rows: usize, out: &mut [f32]) -> Result<()> {
        QuantWeights::product_shift(self, y, rows, out)
    }
}

/// The CPU runs the product on rayon's global pool.
impl QuantBackend for crate::Cpu {
    fn load_out_proj(&self, weights: &QuantWeights) -> Result<Box<dyn OutProj>> {
        Ok(Box::new(weights.clone()))
    }
}

/// Plain bf16 out_proj weights `[rows][cols]`, the unquantized tail the benchmark compares against.
#[derive(Clone, Debug)]
pub struct Bf16Weights {
    pub rows: usize,
    pub cols: usize,
    pub w: Vec<half::bf16>,
}

/// `w` holds `rows x cols` values (checked arithmetic).
fn check_weights(w: &[f32], rows: usize, cols: usize) -> Result<()> {
    let len = rows.checked_mul(cols).ok_or_else(|| Error::Param {
        name: "rows",
        why: "rows x cols overflows".into(),
    })?;
    if w.len() != len {
        return Err(Error::Length {
            name: "weights",
            expected: len,
            got: w.len(),
        });
    }
    Ok(())
}

impl Bf16Weights {
    /// `w` rounded to bf16 (nearest even).
    pub fn new(w: &[f32], rows: usize, cols: usize) -> Result<Bf16Weights> {
        check_weights(w, rows, cols)?;
        Ok(Bf16Weights {
            rows,
            cols,
            w: w.iter().map(|&v| half::bf16::from_f32(v)).collect(),
        })
    }

    pub fn bytes(&self) -> usize {
        2 * self.w.len()
    }

    /// `out [R][rows] = y W^T`, y `[R][cols]`, in f32.
    pub fn product(&self, y: &[f32], r_n: usize, out: &mut [f32]) -> Result<()> {
        let (n, hidden) = (self.cols, self.rows);
        let want_y = r_n.checked_mul(n).ok_or_else(|| Error::Param {
            name: "y",
            why: "rows x cols overflows".into(),
        })?;
        let want_out = r_n.checked_mul(hidden).ok_or_else(|| Error::Param {
            name: "out",
            why: "rows x hidden overflows".into(),
        })?;
        if y.len() != want_y || out.len() != want_out {
            return Err(Error::Length {
                name: if y.len() != want_y { "y" } else { "out" },
                expected: if y.len() != want_y { want_y } else { want_out },
                got: if y.len() != want_y {
                    y.len()
                } else {
                    out.len()
                },
            });
        }
        const CHUNK: usize = 64;
        let mut tmp = vec![0.0f32; hidden * r_n];
        let bits: &[u16] = bytemuck::cast_slice(&self.w);
        tmp.par_chunks_mut(CHUNK * r_n)
            .enumerate()
            .for_each(|(c, block)| {
                for (i, acc) in block.chunks_exact_mut(r_n).enumerate() {
                    let o = c * CHUNK + i;
                    bf16_row(&bits[o * n..(o + 1) * n], y, acc);
                }
            });
        for o in 0..hidden {
            for r in 0..r_n {
                out[r * hidden + o] = tmp[o * r_n + r];
            }
        }
        Ok(())
    }
}

/// Asks for every cache line of `v` (a hint: no effect on results).
#[cfg(target_arch = "x86_64")]
fn prefetch(v: &[u8]) {
    for c in v.chunks(64) {
        // SAFETY: a prefetch of an address inside a live slice; it reads nothing and cannot fault
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(c.as_ptr().cast())
        };
    }
}

/// One bf16 weight row against every token (the bf16 bits widened by a shift, 16 lanes of partial sums).
#[multiversion(targets("x86_64+avx512f+avx512vl+fma", "x86_64+avx2+fma", "aarch64+neon"))]
fn bf16_row(w: &[u16], x: &[f32], acc: &mut [f32]) {
    let n = w.len();
    for (r, a) in acc.iter_mut().enumerate() {
        let xr = &x[r * n..(r + 1) * n];
        let mut total = [0.0f32; 16];
        for (wc, xc) in w.chunks_exact(16).zip(xr.chunks_exact(16)) {
            for e in 0..16 {
                total[e] = f32::from_bits((wc[e] as u32) << 16).mul_add(xc[e], total[e]);
            }
        }
        let mut t: f32 = total.iter().sum();
        let full = n / 16 * 16;
        for m in full..n {
            t = f32::from_bits((w[m] as u32) << 16).mul_add(xr[m], t);
        }
        *a = t;
    }
}

/// One weight row's packed words.
#[derive(Clone, Copy)]
enum Row<'a> {
    U16(&'a [u16]),
    U32(&'a [u32]),
}

/// One weight row against every token: `acc[r]` = the sum over groups of `scale (sum_e field_e x_e) - scale
/// zero gsum`. Specialised per packing and path (the fields per word a constant, so a group's 16 lanes are
/// built with shuffles), compiled per instruction set.
#[multiversion(targets("x86_64+avx512f+avx512vl+fma", "x86_64+avx2+fma", "aarch64+neon"))]
#[allow(clippy::too_many_arguments)]
fn row_dots<'a>(
    packing: Packing,
    shift: bool,
    w: Row<'a>,
    scale: &[f32],
    zs: &[f32],
    x: &[f32],
    gsum: &[f32],
    acc: &mut [f32],
) {
    match (packing, shift, w) {
        (Packing::Q2U16, false, Row::U16(w)) => {
            dots::<u16, 8, 2, false>(w, scale, zs, x, gsum, acc)
        }
        (Packing::Q2U16, true, Row::U16(w)) => dots::<u16, 8, 2, true>(w, scale, zs, x, gsum, acc),
        (Packing::Q8U16, false, Row::U16(w)) => {
            dots::<u16, 2, 8, false>(w, scale, zs, x, gsum, acc)
        }
        (Packing::Q8U16, true, Row::U16(w)) => dots::<u16, 2, 8, true>(w, scale, zs, x, gsum, acc),
        (Packing::Q8U32, false, Row::U32(w)) => {
            dots::<u32, 4, 8, false>(w, scale, zs, x, gsum, acc)
        }
        (Packing::Q8U32, true, Row::U32(w)) => dots::<u32, 4, 8, true>(w, scale, zs, x, gsum, acc),
        _ => unreachable!("the word type follows the packing"),
    }
}

#[inline(always)]
fn dots<W: Copy + Into<u32>, const F: usize, const B: u32, const SHIFT: bool>(
    w: &[W],
    scale: &[f32],
    zs: &[f32],
    x: &[f32],
    gsum: &[f32],
    acc: &mut [f32],
) {
    let n = scale.len() * 16;
    let groups = scale.len();
    let field = (1u32 << B) - 1;
    let mask: [u32; 16] = std::array::from_fn(|e| field << (B * (e % F) as u32));
    let sh: [u32; 16] = std::array::from_fn(|e| B * (e % F) as u32);
    for (r, a) in acc.iter_mut().enumerate() {
        let xr = &x[r * n..(r + 1) * n];
        let gr = &gsum[r * groups..(r + 1) * groups];
        let mut total = [0.0f32; 16];
        let mut zero_part = 0.0f32;
        for (g, (xg, wg)) in xr.chunks_exact(16).zip(w.chunks_exact(16 / F)).enumerate() {
            let s = scale[g];
            let v: [f32; 16] = if SHIFT {
                std::array::from_fn(|e| ((wg[e / F].into() >> sh[e]) & field) as f32)
            } else {
                std::array::from_fn(|e| (wg[e / F].into() & mask[e]) as f32)
            };
            for e in 0..16 {
                total[e] = (s * v[e]).mul_add(xg[e], total[e]);
            }
            zero_part = zs[g].mul_add(gr[g], zero_part);
        }
        *a = total.iter().sum::<f32>() - zero_part;
    }
}

/// The planes path in AVX-512, lanes over words: a vector holds 16 consecutive u32 words of a weight row, and
/// field position p of every word is one mask, one conversion and one FMA per token against the activations of
/// those 16 columns, which the call lays out once as `[block][token][p][word]` (transposed and folded by `layout`). A
/// vector's sums take their groups' scales once (16 groups a vector for 2-bit fields, 4 for 8-bit), so a 16-field
/// piece costs 3 vector operations where a group at a time cost 5 plus its scalar bookkeeping.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::Packing;
    use std::arch::x86_64::*;

    /// Fields per u32 word: 2-bit fields 16 to a word (a group a word: two u16 side by side), 8-bit fields 4 to
    /// a word (a group in 4 words). Word j's field p is column `P j + p` in both.
    fn per_word(p: Packing) -> usize {
        match p {
            Packing::Q2U16 => 16,
            Packing::Q8U32 | Packing::Q8U16 => 4,
        }
    }

    /// Words a row: 16 columns a word for 2-bit fields, 4 for 8-bit.
    pub fn words(p: Packing, n: usize) -> usize {
        n / per_word(p)
    }

    /// The activations `x` (`[tokens][n]`, the packing's plane) as the kernel reads them: in blocks of `width`
    /// words (a multiple of 64; zeros past the row), `[block][token][p][word]`, so that one block of every token's
    /// activations is one contiguous piece (rows of a power-of-two stride would share L1 sets); times 2^-16 where
    /// a field sits in the upper half of a u32 that holds two u16 words (the plane's scale covers its place within
    /// the u16; the power of two is exact).
    pub fn layout(p: Packing, x: &[f32], n: usize, width: usize) -> Vec<f32> {
        let pw = per_word(p);
        let j_n = words(p, n);
        let upper = |e: usize| match p {
            Packing::Q2U16 => e >= 8,
            Packing::Q8U16 => e >= 2,
            Packing::Q8U32 => false,
        };
        let tokens = x.len() / n;
        let mut out = vec![0.0f32; j_n.div_ceil(width) * tokens * pw * width];
        for j in 0..j_n {
            let (jb, jw) = (j / width, j % width);
            for t in 0..tokens {
                for e in 0..pw {
                    let f = if upper(e) { 1.0 / 65536.0 } else { 1.0 };
                    out[((jb * tokens + t) * pw + e) * width + jw] = x[t * n + pw * j + e] * f;
                }
            }
        }
        out
    }

    /// `sum a[i] b[i]` in 16 lanes (then the lanes, then the tail).
    ///
    /// # Safety
    /// The CPU has AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let full = n / 16 * 16;
        // SAFETY: the loads read a[i..i + 16] and b[i..i + 16] with i + 16 <= full <= both lengths
        let mut v = _mm512_setzero_ps();
        let mut i = 0;
        while i < full {
            unsafe {
                v = _mm512_fmadd_ps(
                    _mm512_loadu_ps(a.as_ptr().add(i)),
                    _mm512_loadu_ps(b.as_ptr().add(i)),
                    v,
                );
            }
            i += 16;
        }
        let mut t = _mm512_reduce_add_ps(v);
        for k in full..n {
            t = a[k].mul_add(b[k], t);
        }
        t
    }

    /// `U` vectors of 16 words of a row from word `j0` (zeros past the row's `w.len() / 4` words) and their
    /// lanes' group scales (a group a word where `word_groups`, else four words a group).
    ///
    /// # Safety
    /// The CPU has AVX-512F; `scale` holds the row's groups (16 columns each), `w` its packed bytes.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub unsafe fn words_and_scales<const U: usize>(
        w: &[u8],
        scale: &[f32],
        j0: usize,
        word_groups: bool,
    ) -> ([__m512i; U], [__m512; U]) {
        let (j_n, groups) = (w.len() / 4, scale.len());
        let quarter = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
        let mut wv = [_mm512_setzero_si512(); U];
        let mut sc = [_mm512_setzero_ps(); U];
        if j0 + 16 * U <= j_n {
            // every word of the step is in the row: plain loads, no masks to compute
            for u in 0..U {
                let j = j0 + 16 * u;
                // SAFETY: j + 16 <= j_n words (within `w`); a group a word: j + 16 <= groups = j_n; four words a
                // group: j / 4 + 4 <= j_n / 4 = groups
                unsafe {
                    wv[u] = _mm512_loadu_si512(w.as_ptr().add(4 * j).cast());
                    sc[u] = if word_groups {
                        _mm512_loadu_ps(scale.as_ptr().add(j))
                    } else {
                        _mm512_permutexvar_ps(
                            quarter,
                            _mm512_castps128_ps512(_mm_loadu_ps(scale.as_ptr().add(j / 4))),
                        )
                    };
                }
            }
            return (wv, sc);
        }
        for u in 0..U {
            let j = j0 + 16 * u;
            let k: __mmask16 = if j >= j_n {
                0
            } else {
                (((1u32 << (j_n - j).min(16)) - 1) & 0xFFFF) as __mmask16
            };
            // SAFETY: words are read under a lane mask that keeps j < j_n (within `w`), scales under one that
            // keeps groups < `groups`
            unsafe {
                wv[u] = _mm512_maskz_loadu_epi32(k, w.as_ptr().add(4 * j.min(j_n)).cast());
                sc[u] = if word_groups {
                    _mm512_maskz_loadu_ps(k, scale.as_ptr().add(j.min(groups)))
                } else {
                    let g = (j / 4).min(groups);
                    let kg = ((1u32 << (groups - g).min(4)) - 1) as __mmask16;
                    _mm512_permutexvar_ps(quarter, _mm512_maskz_loadu_ps(kg, scale.as_ptr().add(g)))
                };
            }
        }
        (wv, sc)
    }

    /// Adds to `acc[t]`, for every token t of `tokens`, the row's sum over block `jb` of [`layout`]'s blocks of
    /// `width` words (clipped to the row) of `scale (field x)`, without the zero-point term.
    ///
    /// # Safety
    /// The CPU has AVX-512F; `w` is the row's packed bytes (4 a word), `scale` its groups' scales, `xt`
    /// [`layout`]'s activations for `acc.len()` tokens, this packing, the row's n and `width`.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn row_part(
        p: Packing,
        w: &[u8],
        scale: &[f32],
        xt: &[f32],
        acc: &mut [f32],
        width: usize,
        jb: usize,
        tokens: std::ops::Range<usize>,
    ) {
        let (mut t, end) = (tokens.start, tokens.end.min(acc.len()));
        while t < end {
            // SAFETY: forwarded; each block's tokens are within `acc` and `xt`
            t += unsafe {
                match (per_word(p), end - t) {
                    (16, 8..) => block::<16, 2, 8, 1>(w, scale, xt, acc, t, width, jb),
                    (16, 4..=7) => block::<16, 2, 4, 1>(w, scale, xt, acc, t, width, jb),
                    (16, 2 | 3) => block::<16, 2, 2, 2>(w, scale, xt, acc, t, width, jb),
                    (16, _) => block::<16, 2, 1, 4>(w, scale, xt, acc, t, width, jb),
                    (_, 8..) => block::<4, 8, 8, 1>(w, scale, xt, acc, t, width, jb),
                    (_, 4..=7) => block::<4, 8, 4, 1>(w, scale, xt, acc, t, width, jb),
                    (_, 2 | 3) => block::<4, 8, 2, 2>(w, scale, xt, acc, t, width, jb),
                    _ => block::<4, 8, 1, 4>(w, scale, xt, acc, t, width, jb),
                }
            };
        }
    }

    /// `NB` tokens from `t0`, `U` vectors of 16 words at a time (independent FMA chains where tokens are few);
    /// `P` fields of `B` bits a word. Returns `NB`.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn block<const P: usize, const B: u32, const NB: usize, const U: usize>(
        w: &[u8],
        scale: &[f32],
        xt: &[f32],
        acc: &mut [f32],
        t0: usize,
        width: usize,
        jb: usize,
    ) -> usize {
        let j_n = w.len() / 4;
        let groups = scale.len();
        let tokens = acc.len();
        let start = jb * width;
        let end = (start + width).min(j_n);
        assert!(
            j_n * P == 16 * groups
                && width.is_multiple_of(64)
                && xt.len() >= (jb + 1) * tokens * P * width
                && t0 + NB <= tokens
        );
        // this block's activations, [token][p][width]
        let xb = xt[jb * tokens * P * width..].as_ptr();
        // SAFETY: words are read under a lane mask that keeps j < j_n (within `w`), scales under one that keeps
        // groups < `groups`; activations at [t][p][j - start .. + 16 U] of the block, j - start + 16 U <= width
        // (U divides 4 and width is a multiple of 64), within `xt` (checked above); every intrinsic needs
        // AVX-512F only, which the caller guarantees.
        unsafe {
            let mut total = [_mm512_setzero_ps(); NB];
            let mut j0 = start;
            while j0 < end {
                let mut a = [[_mm512_setzero_ps(); U]; NB];
                let (wv, sc) = words_and_scales::<U>(w, scale, j0, P == 16);
                for e in 0..P {
                    for u in 0..U {
                        let m = _mm512_set1_epi32((((1u32 << B) - 1) << (B as usize * e)) as i32);
                        let f = _mm512_cvtepu32_ps(_mm512_and_si512(wv[u], m));
                        for (t, at) in a.iter_mut().enumerate() {
                            let xv = _mm512_loadu_ps(
                                xb.add(((t0 + t) * P + e) * width + j0 - start + 16 * u),
                            );
                            at[u] = _mm512_fmadd_ps(f, xv, at[u]);
                        }
                    }
                }
                for (tt, at) in total.iter_mut().zip(&a) {
                    for u in 0..U {
                        *tt = _mm512_fmadd_ps(at[u], sc[u], *tt);
                    }
                }
                j0 += 16 * U;
            }
            for (t, tt) in total.iter().enumerate() {
                acc[t0 + t] += _mm512_reduce_add_ps(*tt);
            }
        }
        NB
    }
}

/// One- and two-token products on integer dot products (AVX-512 VNNI, with VBMI's multishift): the fields as unsigned bytes, the
/// activations as signed 8-bit digits. Per token and group of 16 columns, y (the plane times the inverse of its
/// power of two) is scaled by 2^(21 - E), E the exponent of the group's largest |y|, and rounded to an integer Y
/// (|Y| < 2^22: within 2^-22 of the group's largest value), written as three balanced base-256 digits; `vpdpbusd`
/// sums field x digit products exactly in i32, and a lane's sum sum_d 256^d S_d, times 2^(E - 21) and the group's
/// scale, is added in f32. The float kernel's three operations a 16-field piece (mask, conversion, FMA) become
/// three dot products a 64-field piece and, for 2-bit fields, a multishift and a mask per field of a byte.
#[cfg(target_arch = "x86_64")]
mod vnni {
    use super::Packing;
    use std::arch::x86_64::*;

    /// Fields per byte: 2-bit fields four to a byte (word j's byte b holds columns 16 j + 4 b + e, e = 0..3),
    /// 8-bit fields one (word j's byte b is column 4 j + b).
    fn per_byte(p: Packing) -> usize {
        match p {
            Packing::Q2U16 => 4,
            Packing::Q8U32 | Packing::Q8U16 => 1,
        }
    }

    /// Words a row (four bytes each) and the padded width the kernel walks (a multiple of 64).
    pub fn width(p: Packing, n: usize) -> usize {
        (n / (4 * per_byte(p))).div_ceil(64) * 64
    }

    /// The digits and group factors of `tokens` rows of the packing's plane `x` (`[tokens][n]`): digits
    /// `[t][e][d][word]` as i32 (byte b: digit d of the column word j's byte b holds at field e), factors
    /// `[t][word]` (2^(E - 21) of the word's group). None where a value is not finite (the float kernel keeps it).
    pub fn layout(p: Packing, x: &[f32], n: usize, tokens: usize) -> Option<(Vec<i32>, Vec<f32>)> {
        let (pb, wd) = (per_byte(p), width(p, n));
        let words = n / (4 * pb);
        let mut digits = vec![0i32; tokens * pb * 3 * wd];
        let mut factor = vec![0.0f32; tokens * wd];
        let mut y = [0.0f64; 16];
        for t in 0..tokens {
            for g in 0..n / 16 {
                let mut big = 0.0f64;
                for (e, v) in y.iter_mut().enumerate() {
                    let m = 16 * g + e;
                    let xv = x[t * n + m];
                    if !xv.is_finite() {
                        return None;
                    }
                    // the plane's power of two undone (exact)
                    *v = xv as f64 / crate::plane_scale(p.plane(), m) as f64;
                    big = big.max(v.abs());
                }
                if big == 0.0 {
                    continue;
                }
                let e_big = big.log2().floor() as i32;
                // guard log2's rounding: 2^e_big <= big < 2^(e_big + 1)
                let e_big = if 2f64.powi(e_big) > big {
                    e_big - 1
                } else if 2f64.powi(e_big + 1) <= big {
                    e_big + 1
                } else {
                    e_big
                };
                let up = 2f64.powi(21 - e_big);
                let f = 2f64.powi(e_big - 21) as f32;
                for (e, &v) in y.iter().enumerate() {
                    let m = 16 * g + e;
                    // word and byte of column m, field e within the byte
                    let (j, b, fe) = match pb {
                        4 => (m / 16, (m % 16) / 4, m % 4),
                        _ => (m / 4, m % 4, 0),
                    };
                    let mut big_y = (v * up).round() as i32;
                    for d in 0..3 {
                        let digit = ((big_y + 128) & 255) - 128;
                        big_y = (big_y - digit) >> 8;
                        let at = ((t * pb + fe) * 3 + d) * wd + j;
                        digits[at] |= ((digit as u8) as i32) << (8 * b);
                    }
                    factor[t * wd + j] = f;
                }
            }
        }
        debug_assert!(words <= wd);
        Some((digits, factor))
    }

    /// Adds to `acc[r * nb + t]` row r's `sum scale (field y)` over all its words, without the zero-point term, for
    /// `nb = acc.len() / R` (1 or 2) tokens and the `R` rows of `w` (each digit vector loaded once for all of them;
    /// each row's sums in the order of a row alone, so `R` changes no bit).
    ///
    /// # Safety
    /// The CPU has AVX-512F, VNNI and VBMI; `w[r]` is row r's packed bytes (4 a word, the same count every row),
    /// `scale[r]` its groups' scales, `digits` and `factor` [`layout`]'s for `nb` tokens, this packing and the
    /// rows' n; `next` slices to prefetch (the next rows'), a share a step.
    #[target_feature(enable = "avx512f,avx512vnni,avx512vbmi")]
    pub unsafe fn rows<const R: usize>(
        p: Packing,
        w: [&[u8]; R],
        scale: [&[f32]; R],
        digits: &[i32],
        factor: &[f32],
        next: [&[u8]; 3],
        acc: &mut [f32],
    ) {
        // SAFETY: forwarded; one row alone takes 4 (one token) or 2 vectors a step, a block of rows one
        unsafe {
            match (per_byte(p), acc.len() / R, R) {
                (4, 1, 1) => rows_n::<4, 1, 4, R>(w, scale, digits, factor, next, acc),
                (4, 1, _) => rows_n::<4, 1, 1, R>(w, scale, digits, factor, next, acc),
                (4, _, 1) => rows_n::<4, 2, 2, R>(w, scale, digits, factor, next, acc),
                (4, _, _) => rows_n::<4, 2, 1, R>(w, scale, digits, factor, next, acc),
                (_, 1, 1) => rows_n::<1, 1, 4, R>(w, scale, digits, factor, next, acc),
                (_, 1, _) => rows_n::<1, 1, 1, R>(w, scale, digits, factor, next, acc),
                (_, _, 1) => rows_n::<1, 2, 2, R>(w, scale, digits, factor, next, acc),
                _ => rows_n::<1, 2, 1, R>(w, scale, digits, factor, next, acc),
            }
        }
    }

    /// `NB` tokens, `U` vectors of 16 words at a time, `E` fields a byte, `R` rows.
    #[target_feature(enable = "avx512f,avx512vnni,avx512vbmi")]
    unsafe fn rows_n<const E: usize, const NB: usize, const U: usize, const R: usize>(
        w: [&[u8]; R],
        scale: [&[f32]; R],
        digits: &[i32],
        factor: &[f32],
        next: [&[u8]; 3],
        acc: &mut [f32],
    ) {
        let j_n = w[0].len() / 4;
        let steps = j_n.div_ceil(16 * U).max(1);
        let groups = scale[0].len();
        let wd = factor.len() / NB;
        assert!(
            acc.len() == NB * R
                && wd.is_multiple_of(64)
                && wd >= j_n
                && digits.len() >= NB * E * 3 * wd
                && j_n * 4 * E == 16 * groups
                && w.iter().all(|x| x.len() / 4 == j_n)
                && scale.iter().all(|x| x.len() == groups)
        );
        // SAFETY: words are read under a lane mask that keeps j < j_n (within each row's `w`), scales under one
        // that keeps groups < `groups`; digits and factors at [..][j0 + 16 u .. + 16] with j0 + 16 U <= wd (U
        // divides 4, wd a multiple of 64), within the slices (checked above); prefetches at 64 l < a.len(), inside
        // `next`'s slices; the intrinsics need AVX-512F, VNNI and VBMI, which the caller guarantees.
        unsafe {
            let two_bits = _mm512_set1_epi32(0x0303_0303);
            // multishift controls: output byte i of a qword takes its bits 8 i + 2 e ..
            let fields: [__m512i; 4] = std::array::from_fn(|e| {
                _mm512_set1_epi64(i64::from_le_bytes(std::array::from_fn(|i| {
                    (8 * i + 2 * e) as u8
                })))
            });
            let mut total = [[_mm512_setzero_ps(); NB]; R];
            // the next rows' lines, a share of each slice a step (no division in the loop)
            let shares = next.map(|a| {
                let lines = a.len().div_ceil(64);
                (a.as_ptr(), lines, lines.div_ceil(steps))
            });
            let mut j0 = 0;
            while j0 < j_n {
                // this step's share of the next rows' lines into L2, not L1 (a sliding prefetch, as the read
                // ceiling's): from memory, 1.14-1.46x the read floor against 1.33-1.69x into L1 (Zen 4, CPU-NOTES)
                let step = j0 / (16 * U);
                for &(a, lines, per) in &shares {
                    for l in (step * per).min(lines)..((step + 1) * per).min(lines) {
                        _mm_prefetch::<_MM_HINT_T1>(a.add(64 * l).cast());
                    }
                }
                let mut wv = [[_mm512_setzero_si512(); U]; R];
                let mut sc = [[_mm512_setzero_ps(); U]; R];
                for r in 0..R {
                    (wv[r], sc[r]) =
                        super::avx512::words_and_scales::<U>(w[r], scale[r], j0, E == 4);
                }
                let mut a = [[[[_mm512_setzero_si512(); 3]; U]; NB]; R];
                for (e, ctrl) in fields.iter().enumerate().take(E) {
                    for u in 0..U {
                        // field e of every byte: the byte's bits 2e.. moved down by a multishift (the shuffle
                        // port; a vector shift would take the port the dot products need), then masked
                        let mut f = [_mm512_setzero_si512(); R];
                        for (fr, wr) in f.iter_mut().zip(&wv) {
                            *fr = match (E, e) {
                                (1, _) => wr[u],
                                (_, 0) => _mm512_and_si512(wr[u], two_bits),
                                _ => _mm512_and_si512(
                                    _mm512_multishift_epi64_epi8(*ctrl, wr[u]),
                                    two_bits,
                                ),
                            };
                        }
                        for t in 0..NB {
                            for d in 0..3 {
                                let dv = _mm512_loadu_si512(
                                    digits
                                        .as_ptr()
                                        .add(((t * E + e) * 3 + d) * wd + j0 + 16 * u)
                                        .cast(),
                                );
                                for (ar, fr) in a.iter_mut().zip(&f) {
                                    ar[t][u][d] = _mm512_dpbusd_epi32(ar[t][u][d], *fr, dv);
                                }
                            }
                        }
                    }
                }
                for r in 0..R {
                    for t in 0..NB {
                        for u in 0..U {
                            let at = &a[r][t][u];
                            // (S_2 256 + S_1) 256 + S_0
                            let s = _mm512_fmadd_ps(
                                _mm512_cvtepi32_ps(at[2]),
                                _mm512_set1_ps(256.0),
                                _mm512_cvtepi32_ps(at[1]),
                            );
                            let s = _mm512_fmadd_ps(
                                s,
                                _mm512_set1_ps(256.0),
                                _mm512_cvtepi32_ps(at[0]),
                            );
                            let fv = _mm512_loadu_ps(factor.as_ptr().add(t * wd + j0 + 16 * u));
                            total[r][t] =
                                _mm512_fmadd_ps(s, _mm512_mul_ps(fv, sc[r][u]), total[r][t]);
                        }
                    }
                }
                j0 += 16 * U;
            }
            for (r, tr) in total.iter().enumerate() {
                for (t, tt) in tr.iter().enumerate() {
                    acc[r * NB + t] += _mm512_reduce_add_ps(*tt);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth::Synth;
    use crate::{plane_scale, Shape};

    fn planes_of(y: &[f32], rows: usize, n: usize) -> (Vec<f32>, OutputLayout) {
        let sh = Shape::new(16, 1, n / 16).unwrap();
        let lay = OutputLayout::for_rows(&sh, rows, Some(rows * n)).unwrap();
        let p = rows * n;
        let mut out = vec![0.0f32; lay.len()];
        for r in 0..rows {
            for m in 0..n {
                let v = y[r * n + m];
                out[r * n + m] = v;
                for k in 1..4 {
                    out[k * p + r * n + m] = v * plane_scale(k, m);
                }
            }
            for g in 0..n / 16 {
                let s = &y[r * n + 16 * g..r * n + 16 * g + 16];
                let even: f32 = (0..16).step_by(2).map(|e| s[e]).sum();
                let odd: f32 = (1..16).step_by(2).map(|e| s[e]).sum();
                out[4 * p + r * (n / 16) + g] = even + odd;
            }
        }
        (out, lay)
    }

    #[test]
    fn planes_product_matches_the_dequantized_product_and_the_shift_path() {
        // 15 tokens: blocks of 8, 4, 2 and 1; 1 and 2 tokens: the integer kernel where the CPU has VNNI; n 80 and
        // 1040: a part of a vector of words, and of a column block
        for n in [256, 80, 1040] {
            for rows in [15, 1, 2] {
                planes_product_case(n, rows, false);
            }
        }
        // activations over a wide range: each group of 16 scaled by its own power of two (2^-60 .. 2^60), some
        // groups and single values zero
        for rows in [1, 2, 15] {
            planes_product_case(1040, rows, true);
        }
    }

    /// A NaN or an infinity among one token's activations reaches that token's outputs (the integer kernel
    /// leaves such calls to the float one).
    #[test]
    fn non_finite_activations_stay_non_finite() {
        let (hidden, n) = (8, 256);
        let mut rng = Synth::new(9);
        let w = rng.uniform(hidden * n, -0.05, 0.05);
        for bad in [f32::NAN, f32::INFINITY] {
            let mut y = rng.uniform(2 * n, -1.0, 1.0);
            y[n + 37] = bad;
            let (buf, lay) = planes_of(&y, 2, n);
            for p in Packing::ALL {
                let q = QuantWeights::quantize(&w, hidden, n, p).unwrap();
                let mut a = vec![0.0f32; 2 * hidden];
                q.product_planes(&buf, &lay, &mut a).unwrap();
                assert!(a[..hidden].iter().all(|v| v.is_finite()), "{p:?}: token 0");
                assert!(
                    a[hidden..].iter().all(|v| !v.is_finite()),
                    "{p:?}: token 1 {bad}"
                );
            }
        }
    }

    fn planes_product_case(n: usize, rows: usize, wide: bool) {
        let hidden = 96;
        let mut rng = Synth::new(4);
        let w = rng.uniform(hidden * n, -0.05, 0.05);
        let mut y = rng.uniform(rows * n, -2.0, 2.0);
        if wide {
            for (g, piece) in y.chunks_mut(16).enumerate() {
                let k = (g * 37 % 121) as i32 - 60;
                for (i, v) in piece.iter_mut().enumerate() {
                    *v = if g % 11 == 3 || (g + i) % 13 == 0 {
                        0.0
                    } else {
                        *v * 2f32.powi(k)
                    };
                }
            }
        }
        let (buf, lay) = planes_of(&y, rows, n);
        for p in Packing::ALL {
            let q = QuantWeights::quantize(&w, hidden, n, p).unwrap();
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
            let mut a = vec![0.0f32; rows * hidden];
            let mut b = vec![0.0f32; rows * hidden];
            q.product_planes(&buf, &lay, &mut a).unwrap();
            q.product_shift(&y, rows, &mut b).unwrap();
            let ea = crate::relative_error(&a, &want);
            let eb = crate::relative_error(&b, &want);
            assert!(
                ea < 1e-5 && eb < 1e-5,
                "{p:?}: planes {ea:.2e}, shift {eb:.2e}"
            );
            // the masked field times its plane is the field times y exactly: the two paths agree to rounding
            let ab: Vec<f64> = b.iter().map(|&v| v as f64).collect();
            assert!(crate::relative_error(&a, &ab) < 1e-6, "{p:?}");
            // and the quantization itself is close to the weights
            let e_w = crate::relative_error(
                &dq.iter().map(|&v| v as f32).collect::<Vec<_>>(),
                &w.iter().map(|&v| v as f64).collect::<Vec<_>>(),
            );
            assert!(e_w < if p.bits() == 2 { 0.3 } else { 0.01 }, "{p:?}: {e_w}");
        }
    }

    /// The integer kernel sums blocks of rows with one load of each digit vector; every row's bits must be those
    /// of the row alone (the product's tail rows, past the blocks, run alone).
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn integer_row_blocks_change_no_bit() {
        use std::arch::is_x86_feature_detected as has;
        if !(has!("avx512f") && has!("avx512vnni") && has!("avx512vbmi")) {
            eprintln!("skipped: this CPU has no AVX-512 VNNI and VBMI (the integer kernel's)");
            return;
        }
        // 71 rows: blocks of four, then three rows alone; 70: a last block of two. n 80: a row's words end inside
        // a vector (masked loads)
        let mut rng = Synth::new(6);
        for (n, hidden, rows) in [(512, 71, 1), (512, 71, 2), (80, 70, 1), (80, 70, 2)] {
            let w = rng.uniform(hidden * n, -0.05, 0.05);
            let y = rng.uniform(rows * n, -2.0, 2.0);
            let (buf, lay) = planes_of(&y, rows, n);
            for p in Packing::ALL {
                let q = QuantWeights::quantize(&w, hidden, n, p).unwrap();
                let mut got = vec![0.0f32; rows * hidden];
                q.product_planes(&buf, &lay, &mut got).unwrap();
                let (at_plane, at_gsum) = q.check_planes(buf.len(), &lay, got.len()).unwrap();
                let plane = &buf[at_plane..at_plane + rows * n];
                let gsum = &buf[at_gsum..at_gsum + rows * (n / 16)];
                let (digits, factor) = vnni::layout(p, plane, n, rows).unwrap();
                for o in 0..hidden {
                    let mut acc = vec![0.0f32; rows];
                    // SAFETY: the features were checked above; digits and factor are the layout of `rows` tokens
                    unsafe { q.vnni_rows::<1>(o, &digits, &factor, gsum, &mut acc) };
                    for (r, a) in acc.iter().enumerate() {
                        assert_eq!(
                            a.to_bits(),
                            got[r * hidden + o].to_bits(),
                            "{p:?} rows {rows} row {o}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn bad_input_is_an_error() {
        assert!(QuantWeights::quantize(&[0.0; 15], 1, 15, Packing::Q8U32).is_err());
        assert!(QuantWeights::quantize(&[0.0; 16], 2, 16, Packing::Q8U32).is_err());
        assert!(QuantWeights::quantize(&[f32::NAN; 16], 1, 16, Packing::Q8U32).is_err());
        let q = QuantWeights::quantize(&[0.5; 32], 2, 16, Packing::Q2U16).unwrap();
        let mut out = vec![0.0; 2];
        assert!(q.product_shift(&[1.0; 15], 1, &mut out).is_err());
        let sh = Shape::new(16, 1, 1).unwrap();
        let lay = OutputLayout::for_rows(&sh, 1, None).unwrap();
        assert!(q.product_planes(&[0.0; 16], &lay, &mut out).is_err());
    }
}

/// `cargo test --release -p gdn --lib quant::timing -- --ignored --nocapture`: the planes product at B 1 and 2,
/// n 6144 -> 5120, one and two threads, the fastest of 40 calls (a minimum is what survives neighbours on a shared
/// machine).
#[cfg(test)]
mod timing {
    use super::*;
    use crate::synth::Synth;

    #[test]
    #[ignore]
    fn planes_product_at_b1_one_thread() {
        let (n, hidden) = (6144, 5120);
        let mut rng = Synth::new(5);
        let w = rng.uniform(hidden * n, -0.02, 0.02);
        for (threads, rows) in [(1, 1usize), (1, 2), (2, 1), (2, 2)] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            let sh = crate::Shape::new(128, 16, 48).unwrap();
            let lay = OutputLayout::for_rows(&sh, rows, Some(rows * n)).unwrap();
            let buf = rng.uniform(lay.len(), -1.0, 1.0);
            for p in Packing::ALL {
                let q = QuantWeights::quantize(&w, hidden, n, p).unwrap();
                let mut out = vec![0.0f32; rows * hidden];
                let best = pool.install(|| {
                    (0..40)
                        .map(|_| {
                            let t0 = std::time::Instant::now();
                            q.product_planes(&buf, &lay, &mut out).unwrap();
                            t0.elapsed().as_secs_f64()
                        })
                        .fold(f64::INFINITY, f64::min)
                });
                eprintln!(
                    "threads {threads} rows {rows} {}: {:.0} us",
                    p.name(),
                    best * 1e6
                );
            }
        }
    }
}
