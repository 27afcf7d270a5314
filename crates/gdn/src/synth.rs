//! Random layers, states and windows in realistic ranges, seeded: for tests, the demo and benchmarks.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::{BatchData, Config, Layer, Params, Result};

/// A seeded generator of layers and windows.
pub struct Synth {
    rng: SmallRng,
}

impl Synth {
    pub fn new(seed: u64) -> Self {
        Synth {
            rng: SmallRng::seed_from_u64(seed),
        }
    }

    pub fn uniform(&mut self, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..n).map(|_| self.rng.random_range(lo..hi)).collect()
    }

    pub fn index(&mut self, lo: usize, hi_inclusive: usize) -> usize {
        self.rng.random_range(lo..=hi_inclusive)
    }

    /// Parameters in the ranges of a trained layer: conv taps around +-0.5, dt_bias around 0, A in (-8, -0.1).
    pub fn layer(&mut self, config: Config) -> Result<Layer> {
        let s = config.shape;
        let params = Params {
            conv_w: self.uniform(s.channels() * 4, -0.6, 0.6),
            dt: self.uniform(s.h_v, -1.0, 1.0),
            a: self
                .uniform(s.h_v, -2.0, 2.0)
                .into_iter()
                .map(|x| -x.exp())
                .collect(),
            gamma: self.uniform(s.d, 0.5, 1.5),
        };
        Layer::new(config, params)
    }

    /// A window batch of `b` sequences of `t` tokens.
    pub fn batch(&mut self, layer: &Layer, b: usize, t: usize) -> BatchData {
        let s = layer.shape();
        let bt = b * t;
        BatchData {
            b,
            t,
            qkv: self.uniform(bt * s.channels(), -2.0, 2.0),
            alpha: self.uniform(bt * s.h_v, -4.0, 2.0),
            beta: self.uniform(bt * s.h_v, -3.0, 3.0),
            z: self.uniform(bt * s.n(), -3.0, 3.0),
        }
    }

    /// A non-zero state and history for one sequence, as a layer might hold after a prompt.
    pub fn seq_state(&mut self, layer: &Layer) -> (Vec<f32>, Vec<f32>) {
        let s = layer.shape();
        (
            self.uniform(s.state_len(), -0.5, 0.5),
            self.uniform(s.hist_len(), -2.0, 2.0),
        )
    }
}
