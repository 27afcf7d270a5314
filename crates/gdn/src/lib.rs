//! gdn: the fused Gated DeltaNet window step (docs/SPEC.md), exact and fast.
//!
//! - [`config`]: shape, head map, gate, commit mode, layer parameters.
//! - [`step`]: the varlen step as engines call it: packed rows in f32/bf16/f16, one entry per sequence, pool options.
//! - [`batch`]: uniform windows of inputs, the output layout, the checks every backend runs first.
//! - [`backend`]: the [`Backend`] and [`LayerPool`] traits every backend implements.
//! - [`oracle`]: the float64 reference, SPEC.md as plain code.
//! - [`quant`]: the planes' consumer, out_proj over quantized weights.
//! - [`shard`]: tensor-parallel shards of a layer over its heads.
//! - [`spec`]: speculative steps (a held verify window, a prefix of it kept by the next step).
//! - [`cpu`]: the fast f32 CPU backend.
//! - [`stepfile`]: the safetensors file format of `gdn step`.
//! - [`synth`]: random layers and windows for tests, demos and benchmarks.
//!
//! ```
//! use gdn::{synth::Synth, Backend, Commit, Config, Cpu, DType, Gate, HeadMap, PoolOptions, RowsData, Seq};
//! use gdn::{Shape, StateLayout, Step, TensorData};
//!
//! let mut config = Config::new(Shape::new(128, 16, 48)?); // d, h_k, h_v
//! config.head_map = "repeat_interleave".parse::<HeadMap>()?; // HF's name for the grouped map
//! config.gate = Gate::Silu; // Qwen3.5's output gate
//! let layer = Synth::new(0).layer(config)?; // or Layer::new(config, Params::from_checkpoint(..))
//!
//! let backend = Cpu::new();
//! let options = PoolOptions { state: DType::Bf16, layout: StateLayout::ValueMajor };
//! let mut pool = backend.create_pool_with(&layer, 64, options)?;
//! // a decode token, a 4-token verify window, a 3-token window keeping 2 tokens: one call
//! let seqs = [
//!     Seq { slot: 5, start: 0, len: 1, commit: Commit::All },
//!     Seq { slot: 9, start: 1, len: 4, commit: Commit::Verify },
//!     Seq { slot: 2, start: 5, len: 3, commit: Commit::First(2) },
//! ];
//! let w = Synth::new(1).batch(&layer, 1, 8); // 8 rows of inputs
//! let rows = RowsData::from_f32(&w.qkv, &w.alpha, &w.beta, &w.z, [DType::Bf16; 4]);
//! let mut y = TensorData::filled(8 * layer.shape().n(), 0.0, DType::Bf16);
//! pool.step_varlen(&Step { rows: rows.view(), seqs: &seqs, plane_stride: None }, y.view_mut())?;
//! # Ok::<(), gdn::Error>(())
//! ```

pub mod backend;
pub mod batch;
pub mod config;
pub mod cpu;
pub mod error;
pub mod oracle;
pub mod quant;
pub mod shard;
pub mod spec;
pub mod step;
pub mod stepfile;
pub mod synth;

pub use backend::{Backend, LayerPool, StepTiming};
pub use batch::{plane_scale, Batch, BatchData, OutputLayout, StepArgs};
pub use config::{Commit, Config, Gate, HeadMap, Layer, Params, Shape};
pub use cpu::Cpu;
pub use error::{Error, Result};
pub use half::{bf16, f16};
pub use shard::ShardMap;
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
