//! The step as engines call it (SPEC.md, "Varlen steps"): packed rows of activations in f32, bf16 or f16, one
//! entry per sequence (its slot, its rows, its own commit), and the pool's options (state dtype and layout).

use half::{bf16, f16};

use crate::batch::OutputLayout;
use crate::{Commit, Error, Layer, Result, Shape};

/// An element type of activations (and, for the state, of a pool).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum DType {
    #[default]
    F32,
    Bf16,
    F16,
}

impl DType {
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::Bf16 => "bf16",
            DType::F16 => "f16",
        }
    }
    /// Bytes of one element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::Bf16 | DType::F16 => 2,
        }
    }
    /// `x` rounded to this type (to nearest, ties to even; NaN stays NaN), as f32.
    pub fn round(self, x: f32) -> f32 {
        match self {
            DType::F32 => x,
            DType::Bf16 => bf16::from_f32(x).to_f32(),
            DType::F16 => f16::from_f32(x).to_f32(),
        }
    }
    /// `x` rounded once to this type from float64 (the oracle's rounding), as f64. F32 is left unrounded: the
    /// oracle's f32 outputs are the exact values an f32 backend approximates.
    pub fn round_f64(self, x: f64) -> f64 {
        match self {
            DType::F32 => x,
            DType::Bf16 => bf16::from_f64(x).to_f64(),
            DType::F16 => f16::from_f64(x).to_f64(),
        }
    }
}

impl std::str::FromStr for DType {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "f32" | "float32" => Ok(DType::F32),
            "bf16" | "bfloat16" => Ok(DType::Bf16),
            "f16" | "float16" => Ok(DType::F16),
            _ => Err(Error::Param {
                name: "dtype",
                why: format!("'{s}' is not f32, bf16 or f16"),
            }),
        }
    }
}

/// A host tensor of activations in one of the [`DType`]s, flat and row-major.
#[derive(Clone, Copy, Debug)]
pub enum Tensor<'a> {
    F32(&'a [f32]),
    Bf16(&'a [bf16]),
    F16(&'a [f16]),
}

impl<'a> Tensor<'a> {
    pub fn len(&self) -> usize {
        match self {
            Tensor::F32(x) => x.len(),
            Tensor::Bf16(x) => x.len(),
            Tensor::F16(x) => x.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn dtype(&self) -> DType {
        match self {
            Tensor::F32(_) => DType::F32,
            Tensor::Bf16(_) => DType::Bf16,
            Tensor::F16(_) => DType::F16,
        }
    }
    /// Element `i`, widened to f32 (exact).
    #[inline]
    pub fn get(&self, i: usize) -> f32 {
        match self {
            Tensor::F32(x) => x[i],
            Tensor::Bf16(x) => x[i].to_f32(),
            Tensor::F16(x) => x[i].to_f32(),
        }
    }
    /// Elements `start..start + out.len()`, widened to f32 (exact) into `out`.
    pub fn widen_into(&self, start: usize, out: &mut [f32]) {
        use half::slice::HalfFloatSliceExt;
        let r = start..start + out.len();
        match self {
            Tensor::F32(x) => out.copy_from_slice(&x[r]),
            Tensor::Bf16(x) => x[r].convert_to_f32_slice(out),
            Tensor::F16(x) => x[r].convert_to_f32_slice(out),
        }
    }
    /// The f32 slice itself, where the tensor is f32.
    pub fn as_f32(&self) -> Option<&'a [f32]> {
        match self {
            Tensor::F32(x) => Some(x),
            _ => None,
        }
    }
}

impl<'a> From<&'a [f32]> for Tensor<'a> {
    fn from(x: &'a [f32]) -> Self {
        Tensor::F32(x)
    }
}
impl<'a> From<&'a [bf16]> for Tensor<'a> {
    fn from(x: &'a [bf16]) -> Self {
        Tensor::Bf16(x)
    }
}
impl<'a> From<&'a [f16]> for Tensor<'a> {
    fn from(x: &'a [f16]) -> Self {
        Tensor::F16(x)
    }
}

/// A host output buffer in one of the [`DType`]s.
#[derive(Debug)]
pub enum TensorMut<'a> {
    F32(&'a mut [f32]),
    Bf16(&'a mut [bf16]),
    F16(&'a mut [f16]),
}

impl TensorMut<'_> {
    pub fn len(&self) -> usize {
        match self {
            TensorMut::F32(x) => x.len(),
            TensorMut::Bf16(x) => x.len(),
            TensorMut::F16(x) => x.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn dtype(&self) -> DType {
        match self {
            TensorMut::F32(_) => DType::F32,
            TensorMut::Bf16(_) => DType::Bf16,
            TensorMut::F16(_) => DType::F16,
        }
    }
    /// The same buffer, borrowed again.
    pub fn reborrow(&mut self) -> TensorMut<'_> {
        match self {
            TensorMut::F32(x) => TensorMut::F32(x),
            TensorMut::Bf16(x) => TensorMut::Bf16(x),
            TensorMut::F16(x) => TensorMut::F16(x),
        }
    }
    /// A read-only view of the buffer.
    pub fn as_tensor(&self) -> Tensor<'_> {
        match self {
            TensorMut::F32(x) => Tensor::F32(x),
            TensorMut::Bf16(x) => Tensor::Bf16(x),
            TensorMut::F16(x) => Tensor::F16(x),
        }
    }
    /// Writes `src` at `start..`, each value rounded once to the buffer's type (nearest, ties to even).
    pub fn write(&mut self, start: usize, src: &[f32]) {
        use half::slice::HalfFloatSliceExt;
        let r = start..start + src.len();
        match self {
            TensorMut::F32(x) => x[r].copy_from_slice(src),
            TensorMut::Bf16(x) => x[r].convert_from_f32_slice(src),
            TensorMut::F16(x) => x[r].convert_from_f32_slice(src),
        }
    }
}

impl<'a> From<&'a mut [f32]> for TensorMut<'a> {
    fn from(x: &'a mut [f32]) -> Self {
        TensorMut::F32(x)
    }
}
impl<'a> From<&'a mut [bf16]> for TensorMut<'a> {
    fn from(x: &'a mut [bf16]) -> Self {
        TensorMut::Bf16(x)
    }
}
impl<'a> From<&'a mut [f16]> for TensorMut<'a> {
    fn from(x: &'a mut [f16]) -> Self {
        TensorMut::F16(x)
    }
}

/// Owned activations in one dtype, for files, tests and tools.
#[derive(Clone, Debug, PartialEq)]
pub enum TensorData {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
    F16(Vec<f16>),
}

impl TensorData {
    /// `x` rounded to `dtype` (nearest, ties to even).
    pub fn from_f32(x: &[f32], dtype: DType) -> Self {
        match dtype {
            DType::F32 => TensorData::F32(x.to_vec()),
            DType::Bf16 => TensorData::Bf16(x.iter().map(|&v| bf16::from_f32(v)).collect()),
            DType::F16 => TensorData::F16(x.iter().map(|&v| f16::from_f32(v)).collect()),
        }
    }
    /// Zeros (or any fill value, rounded) of `dtype`.
    pub fn filled(len: usize, value: f32, dtype: DType) -> Self {
        TensorData::from_f32(&vec![value; len], dtype)
    }
    pub fn view(&self) -> Tensor<'_> {
        match self {
            TensorData::F32(x) => Tensor::F32(x),
            TensorData::Bf16(x) => Tensor::Bf16(x),
            TensorData::F16(x) => Tensor::F16(x),
        }
    }
    pub fn view_mut(&mut self) -> TensorMut<'_> {
        match self {
            TensorData::F32(x) => TensorMut::F32(x),
            TensorData::Bf16(x) => TensorMut::Bf16(x),
            TensorData::F16(x) => TensorMut::F16(x),
        }
    }
    /// Every element widened to f32.
    pub fn to_f32(&self) -> Vec<f32> {
        let v = self.view();
        let mut out = vec![0.0; v.len()];
        v.widen_into(0, &mut out);
        out
    }
    pub fn len(&self) -> usize {
        self.view().len()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn dtype(&self) -> DType {
        self.view().dtype()
    }
}

/// One sequence of a varlen step: its pool slot (negative: skip it, its rows are not written), its rows
/// `start..start + len` of the packed inputs and outputs, and its own commit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Seq {
    pub slot: i32,
    pub start: usize,
    pub len: usize,
    pub commit: Commit,
}

impl Seq {
    /// Tokens whose effect is committed (0 for verify), checked against the length.
    pub fn commit_at(&self) -> Result<usize> {
        self.commit.commit_at(self.len)
    }
}

/// Sequences laid end to end from `cu_seqlens` (`S + 1` row offsets, FLA's and vLLM's convention), one slot and
/// one commit each.
pub fn seqs_from_cu_seqlens(cu: &[usize], slots: &[i32], commits: &[Commit]) -> Result<Vec<Seq>> {
    let n = cu.len().checked_sub(1).ok_or_else(|| Error::Param {
        name: "cu_seqlens",
        why: "needs at least one offset".into(),
    })?;
    if slots.len() != n || commits.len() != n {
        return Err(Error::SlotCount {
            got: slots.len().min(commits.len()),
            batch: n,
        });
    }
    (0..n)
        .map(|s| {
            let len = cu[s + 1].checked_sub(cu[s]).ok_or_else(|| Error::Param {
                name: "cu_seqlens",
                why: format!(
                    "offsets decrease at sequence {s}: {} then {}",
                    cu[s],
                    cu[s + 1]
                ),
            })?;
            Ok(Seq {
                slot: slots[s],
                start: cu[s],
                len,
                commit: commits[s],
            })
        })
        .collect()
}

/// Packed rows of window inputs, R rows each: `qkv` [R][C], `alpha` and `beta` [R][h_v], `z` [R][n].
#[derive(Clone, Copy, Debug)]
pub struct Rows<'a> {
    pub qkv: Tensor<'a>,
    pub alpha: Tensor<'a>,
    pub beta: Tensor<'a>,
    pub z: Tensor<'a>,
}

impl Rows<'_> {
    /// The row count R, checked to agree across the four tensors.
    pub fn count(&self, shape: &Shape) -> Result<usize> {
        let c = shape.channels();
        if !self.qkv.len().is_multiple_of(c) {
            return Err(Error::Param {
                name: "qkv",
                why: format!(
                    "{} values is not a whole number of rows of C = {c}",
                    self.qkv.len()
                ),
            });
        }
        let rows = self.qkv.len() / c;
        for (name, v, width) in [
            ("alpha", self.alpha, shape.h_v),
            ("beta", self.beta, shape.h_v),
            ("z", self.z, shape.n()),
        ] {
            // rows * width cannot overflow: rows * C fits and C >= width
            if v.len() != rows * width {
                return Err(Error::Length {
                    name,
                    expected: rows * width,
                    got: v.len(),
                });
            }
        }
        Ok(rows)
    }

    /// The dtype of every input, (qkv, alpha, beta, z).
    pub fn dtypes(&self) -> [DType; 4] {
        [
            self.qkv.dtype(),
            self.alpha.dtype(),
            self.beta.dtype(),
            self.z.dtype(),
        ]
    }
}

/// Owned packed rows, for files, tests and tools.
#[derive(Clone, Debug, PartialEq)]
pub struct RowsData {
    pub qkv: TensorData,
    pub alpha: TensorData,
    pub beta: TensorData,
    pub z: TensorData,
}

impl RowsData {
    pub fn view(&self) -> Rows<'_> {
        Rows {
            qkv: self.qkv.view(),
            alpha: self.alpha.view(),
            beta: self.beta.view(),
            z: self.z.view(),
        }
    }
    /// f32 rows rounded to the given dtypes (qkv, alpha, beta, z).
    pub fn from_f32(
        qkv: &[f32],
        alpha: &[f32],
        beta: &[f32],
        z: &[f32],
        dtypes: [DType; 4],
    ) -> Self {
        RowsData {
            qkv: TensorData::from_f32(qkv, dtypes[0]),
            alpha: TensorData::from_f32(alpha, dtypes[1]),
            beta: TensorData::from_f32(beta, dtypes[2]),
            z: TensorData::from_f32(z, dtypes[3]),
        }
    }
}

/// A varlen step: packed rows, one entry per sequence, and optionally the planes with stride P (elements).
/// The output buffer is [`OutputLayout`] over the R rows: a sequence's y rows are its input rows.
#[derive(Clone, Copy, Debug)]
pub struct Step<'a> {
    pub rows: Rows<'a>,
    pub seqs: &'a [Seq],
    pub plane_stride: Option<usize>,
}

/// What the checks of a step found: the output layout and each sequence's commit point.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Checked {
    pub layout: OutputLayout,
    pub rows: usize,
    /// Tokens committed per sequence (0: verify).
    pub commit_at: Vec<usize>,
    /// The longest sequence.
    pub max_len: usize,
}

impl Step<'_> {
    /// The output layout over the step's rows (the rows checked to agree across the four tensors).
    pub fn layout(&self, shape: &Shape) -> Result<OutputLayout> {
        OutputLayout::for_rows(shape, self.rows.count(shape)?, self.plane_stride)
    }

    /// Every check a backend runs before touching state: rows agree across tensors; every sequence has at
    /// least one token, lies inside the rows and shares none with another (skipped ones included); its
    /// commit is within its length; slots are in range and named once; the output has the layout's length.
    pub fn validate(&self, layer: &Layer, pool_slots: usize, out_len: usize) -> Result<Checked> {
        let shape = layer.shape();
        let rows = self.rows.count(shape)?;
        let mut commit_at = Vec::with_capacity(self.seqs.len());
        let mut max_len = 0;
        for (i, s) in self.seqs.iter().enumerate() {
            if s.len == 0 {
                return Err(Error::EmptySeq { seq: i });
            }
            match s.start.checked_add(s.len) {
                Some(end) if end <= rows => {}
                _ => {
                    return Err(Error::SeqRows {
                        seq: i,
                        start: s.start,
                        len: s.len,
                        rows,
                    })
                }
            }
            commit_at.push(s.commit_at().map_err(|_| Error::SeqCommit {
                seq: i,
                commit: s.commit,
                len: s.len,
            })?);
            max_len = max_len.max(s.len);
        }
        let mut order: Vec<usize> = (0..self.seqs.len()).collect();
        order.sort_by_key(|&i| self.seqs[i].start);
        for w in order.windows(2) {
            let (a, b) = (&self.seqs[w[0]], &self.seqs[w[1]]);
            if a.start + a.len > b.start {
                return Err(Error::SeqOverlap {
                    a: w[0].min(w[1]),
                    b: w[0].max(w[1]),
                });
            }
        }
        check_slots(self.seqs.iter().map(|s| s.slot), pool_slots)?;
        let layout = OutputLayout::for_rows(shape, rows, self.plane_stride)?;
        if out_len != layout.len() {
            return Err(Error::Length {
                name: "output",
                expected: layout.len(),
                got: out_len,
            });
        }
        Ok(Checked {
            layout,
            rows,
            commit_at,
            max_len,
        })
    }
}

/// Slot indices: in range, none twice (negative ones skip their sequence).
pub(crate) fn check_slots(slots: impl Iterator<Item = i32>, pool_slots: usize) -> Result<()> {
    // which slots were named: a bitmap over a small pool, else a set of the names, so that the pool size a
    // caller passes never sizes an allocation by itself (`validate` is public)
    const BITMAP_MAX: usize = 1 << 16;
    let small = pool_slots <= BITMAP_MAX;
    let mut seen = vec![false; if small { pool_slots } else { 0 }];
    let mut named = std::collections::HashSet::new();
    for s in slots {
        if s < 0 {
            continue;
        }
        let i = s as usize;
        if i >= pool_slots {
            return Err(Error::SlotRange {
                index: s as i64,
                slots: pool_slots,
            });
        }
        let twice = if small {
            std::mem::replace(&mut seen[i], true)
        } else {
            !named.insert(i)
        };
        if twice {
            return Err(Error::SlotTwice(i));
        }
    }
    Ok(())
}

/// Where element `S[i][h][j]` of a state sits (i the key index, j the value index).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum StateLayout {
    /// `[i][h][j]` at `(i * h_v + h) * d + j` (the seed's, SPEC.md).
    #[default]
    KeyMajor,
    /// `[h][j][i]` at `(h * d + j) * d + i`, keys contiguous: vLLM's, SGLang's and FlashInfer's state pools.
    ValueMajor,
}

impl StateLayout {
    /// The offset of `S[i][h][j]`.
    #[inline]
    pub fn index(self, shape: &Shape, i: usize, h: usize, j: usize) -> usize {
        let d = shape.d;
        match self {
            StateLayout::KeyMajor => (i * shape.h_v + h) * d + j,
            StateLayout::ValueMajor => (h * d + j) * d + i,
        }
    }
    /// A state in layout `self` rewritten in layout `to`.
    pub fn convert<T: Copy + Default>(self, to: StateLayout, shape: &Shape, s: &[T]) -> Vec<T> {
        if self == to {
            return s.to_vec();
        }
        let mut out = vec![T::default(); s.len()];
        let d = shape.d;
        for i in 0..d {
            for h in 0..shape.h_v {
                for j in 0..d {
                    out[to.index(shape, i, h, j)] = s[self.index(shape, i, h, j)];
                }
            }
        }
        out
    }
    pub fn name(self) -> &'static str {
        match self {
            StateLayout::KeyMajor => "key-major",
            StateLayout::ValueMajor => "value-major",
        }
    }
}

impl std::str::FromStr for StateLayout {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "key-major" | "kmajor" | "k" => Ok(StateLayout::KeyMajor),
            "value-major" | "vmajor" | "v" => Ok(StateLayout::ValueMajor),
            _ => Err(Error::Param {
                name: "state_layout",
                why: format!("'{s}' is neither 'key-major' nor 'value-major'"),
            }),
        }
    }
}

/// How a pool keeps its states: the element type of S (f32, or bf16 to halve its traffic; the history stays
/// f32) and the layout `read_slot`/`write_slot` (and an engine's own pool) use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct PoolOptions {
    pub state: DType,
    pub layout: StateLayout,
}

impl PoolOptions {
    /// f16 states are not part of the contract.
    pub fn validate(&self) -> Result<()> {
        if self.state == DType::F16 {
            return Err(Error::Unsupported(
                "an f16 state (a pool's state is f32 or bf16)".into(),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth::Synth;
    use crate::Config;

    #[test]
    fn cu_seqlens_give_sequences_end_to_end() {
        let c = [Commit::All, Commit::Verify, Commit::First(1)];
        let seqs = seqs_from_cu_seqlens(&[0, 3, 4, 9], &[2, -1, 0], &c).unwrap();
        assert_eq!(
            seqs.iter()
                .map(|s| (s.slot, s.start, s.len))
                .collect::<Vec<_>>(),
            [(2, 0, 3), (-1, 3, 1), (0, 4, 5)]
        );
        assert!(seqs_from_cu_seqlens(&[0, 3, 2], &[0, 1], &c[..2]).is_err());
        assert!(seqs_from_cu_seqlens(&[0, 3], &[0, 1], &c[..2]).is_err());
        assert!(seqs_from_cu_seqlens(&[], &[], &[]).is_err());
    }

    /// A pool size near usize::MAX is checked like any other, without an allocation of its size (found by
    /// `gdn-fuzz step`: `vec![false; pool_slots]` asked for 2 GiB, or aborted on usize::MAX).
    #[test]
    fn a_huge_pool_size_is_checked_without_allocating_it() {
        let layer = Synth::new(1)
            .layer(Config::new(Shape::new(16, 1, 1).unwrap()))
            .unwrap();
        let sh = *layer.shape();
        let (qkv, ab, z) = (
            vec![0.0; 2 * sh.channels()],
            vec![0.0; 2 * sh.h_v],
            vec![0.0; 2 * sh.n()],
        );
        let seq = |slot, start| Seq {
            slot,
            start,
            len: 1,
            commit: Commit::All,
        };
        for (slots, pool, ok) in [
            ([i32::MAX, 0], usize::MAX, true),
            ([7, 7], usize::MAX, false),
            ([7, 7], 8, false),
            ([7, -1], 7, false),
        ] {
            let seqs = [seq(slots[0], 0), seq(slots[1], 1)];
            let step = Step {
                rows: Rows {
                    qkv: Tensor::F32(&qkv),
                    alpha: Tensor::F32(&ab),
                    beta: Tensor::F32(&ab),
                    z: Tensor::F32(&z),
                },
                seqs: &seqs,
                plane_stride: None,
            };
            let r = step.validate(&layer, pool, 2 * sh.n());
            assert_eq!(r.is_ok(), ok, "{slots:?} in {pool}: {r:?}");
        }
    }
}
