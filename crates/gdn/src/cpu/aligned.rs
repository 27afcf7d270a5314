//! f32 buffers that start on a 64-byte cache line. The CPU kernels read and write rows of 16 lanes (64 bytes);
//! in a `Vec<f32>` from the system allocator a large buffer starts 16 bytes past a page, so every such row
//! straddled two cache lines: a split access for every AVX-512 row and every second AVX2 half-row.

use std::collections::TryReserveError;
use std::ops::{Deref, DerefMut};

/// One cache line of 16 lanes; only ever seen through [`LineVec`]'s float view.
#[derive(Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C, align(64))]
struct Line([f32; 16]);

/// A growable buffer of f32 whose first float sits at the start of a 64-byte line (the lines after it follow
/// contiguously, so a row of 16 lanes at a multiple of 16 floats is one line).
#[derive(Clone, Default)]
pub struct LineVec {
    lines: Vec<Line>,
    len: usize,
}

impl LineVec {
    /// `len` zeros; an error rather than an abort where the memory cannot be had.
    pub fn zeroed(len: usize) -> Result<Self, TryReserveError> {
        let mut lines = Vec::new();
        lines.try_reserve_exact(len.div_ceil(16))?;
        lines.resize(len.div_ceil(16), Line::default());
        Ok(LineVec { lines, len })
    }

    /// A copy of `x`.
    pub fn from_slice(x: &[f32]) -> Self {
        let mut v = LineVec::default();
        v.resize(x.len());
        v.copy_from_slice(x);
        v
    }

    /// Floats the buffer holds room for.
    pub fn capacity(&self) -> usize {
        self.lines.capacity() * 16
    }

    /// Grows or shrinks to `len` floats; floats past the old length are zero.
    pub fn resize(&mut self, len: usize) {
        let old = self.len;
        self.lines.resize(len.div_ceil(16), Line::default());
        self.len = len;
        if len > old {
            self[old..].fill(0.0);
        }
    }
}

impl Deref for LineVec {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        &bytemuck::cast_slice(&self.lines)[..self.len]
    }
}

impl DerefMut for LineVec {
    fn deref_mut(&mut self) -> &mut [f32] {
        &mut bytemuck::cast_slice_mut(&mut self.lines)[..self.len]
    }
}

#[cfg(test)]
mod tests {
    use super::LineVec;

    #[test]
    fn starts_on_a_line_and_zeroes_what_it_grows() {
        for len in [0, 1, 15, 16, 17, 1000, 786_432] {
            let mut v = LineVec::zeroed(len).unwrap();
            assert_eq!(v.len(), len);
            assert!(v.iter().all(|&x| x == 0.0));
            assert_eq!(v.as_ptr() as usize % 64, 0, "len {len}");
            v.fill(1.0);
            v.resize(len / 2);
            v.resize(len + 20);
            assert!(v[..len / 2].iter().all(|&x| x == 1.0));
            assert!(v[len / 2..].iter().all(|&x| x == 0.0), "len {len}");
            assert_eq!(v.as_ptr() as usize % 64, 0);
        }
        let w = LineVec::from_slice(&[1.0, 2.0, 3.0]);
        assert_eq!(&w[..], &[1.0, 2.0, 3.0]);
    }
}
