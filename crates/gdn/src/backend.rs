//! The one interface every backend implements, the way the conformance suite and the command line see it.

use crate::{Layer, Result, StepArgs};

/// A place the step can run: the CPU, a CUDA device, a wgpu adapter.
pub trait Backend {
    /// A short name with the device, e.g. `cpu (avx2+fma, 2 threads)`.
    fn name(&self) -> String;
    /// Loads a layer's parameters and makes a state pool of `slots` zeroed slots for it.
    fn create_pool(&self, layer: &Layer, slots: usize) -> Result<Box<dyn LayerPool>>;
}

/// One layer on one backend: its parameters and its pool of per-sequence states (S and the conv history),
/// resident where the backend computes. The history's double buffering, where a backend needs one, is inside.
pub trait LayerPool {
    fn layer(&self) -> &Layer;
    fn slots(&self) -> usize;
    /// Sets one slot's S (`d * h_v * d`) and H (`C * 3`) in SPEC.md's layouts.
    fn write_slot(&mut self, slot: usize, state: &[f32], hist: &[f32]) -> Result<()>;
    /// Reads one slot's S and H in SPEC.md's layouts.
    fn read_slot(&mut self, slot: usize, state: &mut [f32], hist: &mut [f32]) -> Result<()>;
    /// Advances the named slots by their windows and writes `out` (see [`crate::OutputLayout`]). Every check
    /// runs before any state is touched: on error, the pool and `out` are as they were.
    fn step(&mut self, args: &StepArgs<'_>, out: &mut [f32]) -> Result<()>;
}

/// Checks a slot index and the lengths of a slot's S and H, for `write_slot` and `read_slot`.
pub fn check_slot_io(
    layer: &Layer,
    slots: usize,
    slot: usize,
    state: usize,
    hist: usize,
) -> Result<()> {
    let s = layer.shape();
    if slot >= slots {
        return Err(crate::Error::SlotRange {
            index: slot as i64,
            slots,
        });
    }
    for (name, expected, got) in [
        ("state", s.state_len(), state),
        ("hist", s.hist_len(), hist),
    ] {
        if got != expected {
            return Err(crate::Error::Length {
                name,
                expected,
                got,
            });
        }
    }
    Ok(())
}
