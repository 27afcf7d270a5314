//! A batch of windows, the output layout, and the checks every backend runs before it touches state.

use crate::config::check_len;
use crate::{Commit, Error, Layer, Result, Shape};

/// Windows of `t` tokens for `b` sequences, host slices in the layout of SPEC.md with a leading batch
/// dimension: `qkv` [b][t][C], `alpha` and `beta` [b][t][h_v], `z` [b][t][n].
#[derive(Clone, Copy, Debug)]
pub struct Batch<'a> {
    pub b: usize,
    pub t: usize,
    pub qkv: &'a [f32],
    pub alpha: &'a [f32],
    pub beta: &'a [f32],
    pub z: &'a [f32],
}

impl Batch<'_> {
    pub fn validate(&self, shape: &Shape) -> Result<()> {
        if self.t == 0 {
            return Err(Error::EmptyWindow);
        }
        let bt = self.b * self.t;
        check_len("qkv", self.qkv, bt * shape.channels())?;
        check_len("alpha", self.alpha, bt * shape.h_v)?;
        check_len("beta", self.beta, bt * shape.h_v)?;
        check_len("z", self.z, bt * shape.n())?;
        Ok(())
    }
}

/// Owned batch storage, for files, tests and tools.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BatchData {
    pub b: usize,
    pub t: usize,
    pub qkv: Vec<f32>,
    pub alpha: Vec<f32>,
    pub beta: Vec<f32>,
    pub z: Vec<f32>,
}

impl BatchData {
    pub fn view(&self) -> Batch<'_> {
        Batch {
            b: self.b,
            t: self.t,
            qkv: &self.qkv,
            alpha: &self.alpha,
            beta: &self.beta,
            z: &self.z,
        }
    }
}

/// Where a step writes. Rows are the flattened (sequence, token) pairs `r = b * t + token`.
///
/// Without planes the buffer is `y` [rows][n]. With a plane stride `P >= rows * n` it holds `y` at 0, the
/// three prepared-activation planes at P, 2P and 3P (each [rows][n]) and the group sums [rows][n / 16] at 4P:
/// each plane is one matrix a batched out_proj can consume as it is (SPEC.md, "planes").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OutputLayout {
    pub rows: usize,
    pub n: usize,
    pub plane_stride: Option<usize>,
}

impl OutputLayout {
    pub fn new(shape: &Shape, b: usize, t: usize, plane_stride: Option<usize>) -> Result<Self> {
        let rows = b * t;
        let n = shape.n();
        if let Some(p) = plane_stride {
            if p < rows * n {
                return Err(Error::PlaneStride {
                    stride: p,
                    min: rows * n,
                });
            }
        }
        Ok(OutputLayout {
            rows,
            n,
            plane_stride,
        })
    }

    /// Floats the output buffer must hold.
    pub fn len(&self) -> usize {
        match self.plane_stride {
            None => self.rows * self.n,
            Some(p) => 4 * p + self.rows * self.n / 16,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The whole argument list of a step, checked before anything is touched.
#[derive(Clone, Copy, Debug)]
pub struct StepArgs<'a> {
    pub batch: Batch<'a>,
    /// Pool slot of each sequence; a negative index skips that sequence (its output rows are not written).
    pub slots: &'a [i32],
    pub commit: Commit,
    /// `Some(P)` turns the planes on with plane stride P (floats).
    pub plane_stride: Option<usize>,
}

impl StepArgs<'_> {
    /// Checks shapes, the commit mode, the plane stride, the slot indices (range, no slot twice) and the output
    /// length; returns the output layout and the commit point.
    pub fn validate(
        &self,
        layer: &Layer,
        pool_slots: usize,
        out_len: usize,
    ) -> Result<(OutputLayout, usize)> {
        let shape = layer.shape();
        self.batch.validate(shape)?;
        let commit_at = self.commit.commit_at(self.batch.t)?;
        if self.slots.len() != self.batch.b {
            return Err(Error::SlotCount {
                got: self.slots.len(),
                batch: self.batch.b,
            });
        }
        let mut seen = vec![false; pool_slots];
        for &s in self.slots {
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
            if std::mem::replace(&mut seen[i], true) {
                return Err(Error::SlotTwice(i));
            }
        }
        let layout = OutputLayout::new(shape, self.batch.b, self.batch.t, self.plane_stride)?;
        if out_len != layout.len() {
            return Err(Error::Length {
                name: "output",
                expected: layout.len(),
                got: out_len,
            });
        }
        Ok((layout, commit_at))
    }
}

/// The prepared-activation scale of plane `p` (1..=3) for flattened column `m` (SPEC.md's table).
pub fn plane_scale(p: usize, m: usize) -> f32 {
    match p {
        1 => 0.25f32.powi((m % 8) as i32),
        2 => (1.0 / 256.0f32).powi((m % 4) as i32),
        3 => {
            if m.is_multiple_of(2) {
                1.0
            } else {
                1.0 / 256.0
            }
        }
        _ => 1.0,
    }
}
