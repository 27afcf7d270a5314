//! gdn: the fused Gated DeltaNet window step (SPEC.md), exact and fast.
//!
//! - [`config`]: shape, head map, gate, commit mode, layer parameters.
//! - [`step`]: the varlen step as engines call it: packed rows in f32/bf16/f16, one entry per sequence, pool options.
//! - [`batch`]: uniform windows of inputs, the output layout, the checks every backend runs first.
//! - [`backend`]: the [`Backend`] and [`LayerPool`] traits every backend implements.
//! - [`oracle`]: the float64 reference, SPEC.md as plain code.
//! - [`cpu`]: the fast f32 CPU backend.
//! - [`stepfile`]: the safetensors file format of `gdn step`.
//! - [`synth`]: random layers and windows for tests, demos and benchmarks.
//!
//! ```
//! use gdn::{synth::Synth, Backend, Commit, Config, Cpu, Gate, HeadMap, Shape, StepArgs};
//!
//! let mut config = Config::new(Shape::new(128, 16, 48)?); // d, h_k, h_v
//! config.head_map = HeadMap::Grouped; // HF / FLA / vLLM order
//! config.gate = Gate::Silu; // Qwen3.5's output gate
//! let layer = Synth::new(0).layer(config)?; // or gdn::Layer::new(config, params)
//!
//! let backend = Cpu::new();
//! let mut pool = backend.create_pool(&layer, 64)?; // 64 sequences' states
//! let batch = Synth::new(1).batch(&layer, 2, 4); // 2 sequences, 4 tokens each
//! let mut y = vec![0.0; 2 * 4 * layer.shape().n()];
//! let slots = [5, 9];
//! // verify: y for every token, the state untouched
//! pool.step(&StepArgs { batch: batch.view(), slots: &slots, commit: Commit::Verify, plane_stride: None }, &mut y)?;
//! // keep the state after the first 3 tokens
//! pool.step(&StepArgs { batch: batch.view(), slots: &slots, commit: Commit::First(3), plane_stride: None }, &mut y)?;
//! # Ok::<(), gdn::Error>(())
//! ```

pub mod backend;
pub mod batch;
pub mod config;
pub mod cpu;
pub mod error;
pub mod oracle;
pub mod step;
pub mod stepfile;
pub mod synth;

pub use backend::{Backend, LayerPool, StepTiming};
pub use batch::{plane_scale, Batch, BatchData, OutputLayout, StepArgs};
pub use config::{Commit, Config, Gate, HeadMap, Layer, Params, Shape};
pub use cpu::Cpu;
pub use error::{Error, Result};
pub use half::{bf16, f16};
pub use step::{
    seqs_from_cu_seqlens, Checked, DType, PoolOptions, Rows, RowsData, Seq, StateLayout, Step,
    Tensor, TensorData, TensorMut,
};

/// `||out - ref|| / ||ref||` over whole buffers: 0 when both are zero, infinite where one side has a NaN or an
/// infinity the other does not have at the same place (matching non-finite values are skipped).
pub fn relative_error(out: &[f32], reference: &[f64]) -> f64 {
    assert_eq!(out.len(), reference.len(), "relative_error: lengths differ");
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (&o, &r) in out.iter().zip(reference) {
        let o = o as f64;
        if !o.is_finite() || !r.is_finite() {
            let same = (o.is_nan() && r.is_nan()) || o == r;
            if !same {
                return f64::INFINITY;
            }
            continue;
        }
        num += (o - r) * (o - r);
        den += r * r;
    }
    if num == 0.0 {
        0.0
    } else {
        (num / den).sqrt()
    }
}
