//! A batch of windows, the output layout, and the checks every backend runs before it touches state.

use crate::config::check_len;
use crate::step::{Rows, Seq, Step, Tensor};
use crate::{Commit, Error, Result, Shape};

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

impl<'a> Batch<'a> {
    /// The batch as packed f32 rows (sequence b's token at row `b * t + token`).
    pub fn rows(&self) -> Rows<'a> {
        Rows {
            qkv: Tensor::F32(self.qkv),
            alpha: Tensor::F32(self.alpha),
            beta: Tensor::F32(self.beta),
            z: Tensor::F32(self.z),
        }
    }

    pub fn validate(&self, shape: &Shape) -> Result<()> {
        if self.t == 0 {
            return Err(Error::EmptyWindow);
        }
        // products checked: a huge b or t must be an error, not a wrapped length that happens to match
        let bt = self.b.checked_mul(self.t);
        for (name, v, width) in [
            ("qkv", self.qkv, shape.channels()),
            ("alpha", self.alpha, shape.h_v),
            ("beta", self.beta, shape.h_v),
            ("z", self.z, shape.n()),
        ] {
            match bt.and_then(|bt| bt.checked_mul(width)) {
                Some(expected) => check_len(name, v, expected)?,
                None => {
                    return Err(Error::Length {
                        name,
                        expected: usize::MAX,
                        got: v.len(),
                    })
                }
            }
        }
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
    /// A checked layout for `b` sequences of `t` tokens (see [`OutputLayout::for_rows`]).
    pub fn new(shape: &Shape, b: usize, t: usize, plane_stride: Option<usize>) -> Result<Self> {
        let rows = b.checked_mul(t).ok_or_else(|| Error::Param {
            name: "output",
            why: format!("{b} sequences of {t} tokens overflow the address space"),
        })?;
        Self::for_rows(shape, rows, plane_stride)
    }

    /// A checked layout over `rows` rows: the plane stride holds y, and every length fits in `usize` (so `len`
    /// cannot wrap).
    pub fn for_rows(shape: &Shape, rows: usize, plane_stride: Option<usize>) -> Result<Self> {
        let n = shape.n();
        let too_large = || Error::Param {
            name: "output",
            why: format!("{rows} rows (plane stride {plane_stride:?}) overflow the address space"),
        };
        let y_len = rows.checked_mul(n).ok_or_else(too_large)?;
        if let Some(p) = plane_stride {
            if p < y_len {
                return Err(Error::PlaneStride {
                    stride: p,
                    min: y_len,
                });
            }
            p.checked_mul(4)
                .and_then(|x| x.checked_add(y_len / 16))
                .ok_or_else(too_large)?;
        }
        Ok(OutputLayout {
            rows,
            n,
            plane_stride,
        })
    }

    /// Floats the output buffer must hold (saturating for a layout not made by `new`).
    pub fn len(&self) -> usize {
        let y_len = self.rows.saturating_mul(self.n);
        match self.plane_stride {
            None => y_len,
            Some(p) => p.saturating_mul(4).saturating_add(y_len / 16),
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
    /// Checks what is particular to a uniform batch (the window length, the tensors' lengths for b x t rows,
    /// the one commit mode, one slot per sequence) and returns the batch as varlen sequences; the rest is
    /// [`Step::validate`]'s, which every backend's `step_varlen` runs.
    pub fn seqs(&self, shape: &Shape) -> Result<Vec<Seq>> {
        self.batch.validate(shape)?;
        self.commit.commit_at(self.batch.t)?;
        if self.slots.len() != self.batch.b {
            return Err(Error::SlotCount {
                got: self.slots.len(),
                batch: self.batch.b,
            });
        }
        let t = self.batch.t;
        Ok(self
            .slots
            .iter()
            .enumerate()
            .map(|(b, &slot)| Seq {
                slot,
                start: b * t,
                len: t,
                commit: self.commit,
            })
            .collect())
    }

    /// The varlen step over `seqs` (from [`StepArgs::seqs`]).
    pub fn varlen<'a>(&'a self, seqs: &'a [Seq]) -> Step<'a> {
        Step {
            rows: self.batch.rows(),
            seqs,
            plane_stride: self.plane_stride,
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plane_scales_are_specs_table() {
        // SPEC.md: 4^-(m mod 8), 256^-(m mod 4), and 1 or 1/256 by parity
        assert_eq!(plane_scale(1, 0), 1.0);
        assert_eq!(plane_scale(1, 7), 2.0f32.powi(-14));
        assert_eq!(plane_scale(1, 9), 0.25);
        assert_eq!(plane_scale(2, 3), 2.0f32.powi(-24));
        assert_eq!(plane_scale(2, 6), 2.0f32.powi(-16));
        assert_eq!(plane_scale(3, 1), 1.0 / 256.0);
        assert_eq!(plane_scale(3, 10), 1.0);
    }

    #[test]
    fn layouts_that_overflow_are_errors() {
        let sh = Shape::SEED;
        assert!(OutputLayout::new(&sh, 2, 3, Some(usize::MAX / 2)).is_err());
        assert!(OutputLayout::new(&sh, usize::MAX / 2, 3, None).is_err());
        let ok = OutputLayout::new(&sh, 2, 3, Some(6 * sh.n())).unwrap();
        assert_eq!(ok.len(), 4 * 6 * sh.n() + 6 * sh.n() / 16);
    }
}
