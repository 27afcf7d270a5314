//! The layer's fixed description: shape, conventions and parameters (SPEC.md, "Shapes" and "Layer parameters").

use crate::{Error, Result};

/// Head dim `d` and head counts of one GDN layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Shape {
    pub d: usize,
    pub h_k: usize,
    pub h_v: usize,
}

impl Shape {
    /// The seed's shape (Qwen3.5-27B): d 128, 16 q/k heads, 48 value heads.
    pub const SEED: Shape = Shape {
        d: 128,
        h_k: 16,
        h_v: 48,
    };

    /// A validated shape: d a positive multiple of 16 up to 1024, h_v a positive multiple of h_k, every size of
    /// the layer within the address space.
    pub fn new(d: usize, h_k: usize, h_v: usize) -> Result<Self> {
        let s = Shape { d, h_k, h_v };
        s.validate()?;
        Ok(s)
    }

    pub fn validate(&self) -> Result<()> {
        if self.d == 0 || !self.d.is_multiple_of(16) {
            return Err(Error::Shape(format!(
                "d = {} must be a positive multiple of 16",
                self.d
            )));
        }
        if self.d > 1024 {
            return Err(Error::Shape(format!("d = {} is above 1024", self.d)));
        }
        if self.h_k == 0 || self.h_v == 0 || !self.h_v.is_multiple_of(self.h_k) {
            return Err(Error::Shape(format!(
                "h_v = {} must be a positive multiple of h_k = {}",
                self.h_v, self.h_k
            )));
        }
        // every size the helpers below compute (the conv weights' C x 4 the largest per channel, the state's
        // d x h_v x d) must fit, so that they cannot wrap, on 32-bit targets too
        let conv_w = (2 * self.h_k as u128 + self.h_v as u128) * self.d as u128 * 4;
        let state = self.d as u128 * self.d as u128 * self.h_v as u128;
        if conv_w.max(state) > isize::MAX as u128 {
            return Err(Error::Shape(format!(
                "h_k = {}, h_v = {} at d = {}: the layer's sizes overflow the address space",
                self.h_k, self.h_v, self.d
            )));
        }
        Ok(())
    }

    /// Conv channels C = (2 h_k + h_v) d.
    pub fn channels(&self) -> usize {
        (2 * self.h_k + self.h_v) * self.d
    }
    /// Output width n = h_v d.
    pub fn n(&self) -> usize {
        self.h_v * self.d
    }
    /// Floats of one sequence's state S.
    pub fn state_len(&self) -> usize {
        self.d * self.h_v * self.d
    }
    /// Floats of one sequence's conv history H.
    pub fn hist_len(&self) -> usize {
        self.channels() * 3
    }
    /// Value heads per q/k head.
    pub fn group(&self) -> usize {
        self.h_v / self.h_k
    }
}

/// Which q/k head a value head reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum HeadMap {
    /// `g(h) = h % h_k` (the seed; llama.cpp after its weight conversion).
    #[default]
    Tiled,
    /// `g(h) = h / (h_v / h_k)` (HF transformers, FLA, vLLM, SGLang).
    Grouped,
}

impl HeadMap {
    pub fn qk_head(self, shape: &Shape, h: usize) -> usize {
        match self {
            HeadMap::Tiled => h % shape.h_k,
            HeadMap::Grouped => h / shape.group(),
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            HeadMap::Tiled => "tiled",
            HeadMap::Grouped => "grouped",
        }
    }
}

impl std::str::FromStr for HeadMap {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "tiled" | "tile" | "repeat" => Ok(HeadMap::Tiled),
            // HF transformers expands q/k with `repeat_interleave`
            "grouped" | "repeat_interleave" => Ok(HeadMap::Grouped),
            _ => Err(Error::Param {
                name: "head_map",
                why: format!(
                    "'{s}' is none of 'tiled' ('repeat'), 'grouped' ('repeat_interleave')"
                ),
            }),
        }
    }
}

/// The output gate's activation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Gate {
    /// `1 / (1 + exp(-z))` (the seed).
    #[default]
    Sigmoid,
    /// `z / (1 + exp(-z))` (HF Qwen3-Next / Qwen3.5).
    Silu,
}

impl Gate {
    pub fn name(self) -> &'static str {
        match self {
            Gate::Sigmoid => "sigmoid",
            Gate::Silu => "silu",
        }
    }
}

impl std::str::FromStr for Gate {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "sigmoid" => Ok(Gate::Sigmoid),
            // HF's config says `hidden_act: silu`; torch calls it swish too
            "silu" | "swish" => Ok(Gate::Silu),
            _ => Err(Error::Param {
                name: "gate",
                why: format!("'{s}' is none of 'sigmoid', 'silu' ('swish')"),
            }),
        }
    }
}

/// What a step writes back to the pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Commit {
    /// Nothing: every token's y from the evolving state, S and H untouched.
    Verify,
    /// S and H after the last token.
    #[default]
    All,
    /// S and H after token k-1 (1 <= k <= T); y for every token.
    First(usize),
}

impl Commit {
    /// The number of tokens whose effect is committed, checked against the window length.
    pub fn commit_at(self, t: usize) -> Result<usize> {
        match self {
            Commit::Verify => Ok(0),
            Commit::All => Ok(t),
            Commit::First(k) if (1..=t).contains(&k) => Ok(k),
            Commit::First(k) => Err(Error::CommitRange { k, t }),
        }
    }
}

impl std::fmt::Display for Commit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Commit::Verify => write!(f, "verify"),
            Commit::All => write!(f, "all"),
            Commit::First(k) => write!(f, "first {k}"),
        }
    }
}

impl std::str::FromStr for Commit {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "verify" => Ok(Commit::Verify),
            "all" => Ok(Commit::All),
            k => k
                .parse::<usize>()
                .map(Commit::First)
                .map_err(|_| Error::Param {
                    name: "commit",
                    why: format!("'{s}' is not 'verify', 'all' or a token count"),
                }),
        }
    }
}

/// Shape and conventions of a layer: what a kernel is specialised on.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Config {
    pub shape: Shape,
    pub head_map: HeadMap,
    pub gate: Gate,
    pub eps: f32,
}

impl Config {
    /// Seed defaults for the conventions: tiled, sigmoid, eps 1e-6.
    pub fn new(shape: Shape) -> Self {
        Config {
            shape,
            head_map: HeadMap::Tiled,
            gate: Gate::Sigmoid,
            eps: 1e-6,
        }
    }

    pub fn validate(&self) -> Result<()> {
        self.shape.validate()?;
        if !(self.eps.is_finite() && self.eps > 0.0) {
            return Err(Error::Param {
                name: "eps",
                why: format!("{} must be finite and positive", self.eps),
            });
        }
        Ok(())
    }
}

/// The layer's weights used by the step.
#[derive(Clone, Debug, PartialEq)]
pub struct Params {
    /// [C][4], tap 0 on the oldest input.
    pub conv_w: Vec<f32>,
    /// [h_v] dt_bias.
    pub dt: Vec<f32>,
    /// [h_v] decay rate, negative (`-exp(A_log)`).
    pub a: Vec<f32>,
    /// [d] output-norm weight shared by all heads.
    pub gamma: Vec<f32>,
}

impl Params {
    /// The checkpoint's tensors as HF transformers and vLLM name them: `conv1d.weight` ([C][1][4] or [C][4]),
    /// `dt_bias` [h_v], `A_log` [h_v] and `norm.weight` [d]. The decay rate is `a = -exp(A_log)` in f32, as
    /// HF computes it (`-self.A_log.float().exp()`).
    pub fn from_checkpoint(
        conv_weight: &[f32],
        dt_bias: &[f32],
        a_log: &[f32],
        norm_weight: &[f32],
    ) -> Params {
        Params {
            conv_w: conv_weight.to_vec(),
            dt: dt_bias.to_vec(),
            a: a_log.iter().map(|&x| -x.exp()).collect(),
            gamma: norm_weight.to_vec(),
        }
    }
}

/// A layer: configuration and parameters, validated together.
#[derive(Clone, Debug, PartialEq)]
pub struct Layer {
    pub config: Config,
    pub params: Params,
}

impl Layer {
    pub fn new(config: Config, params: Params) -> Result<Self> {
        let layer = Layer { config, params };
        layer.validate()?;
        Ok(layer)
    }

    pub fn validate(&self) -> Result<()> {
        self.config.validate()?;
        let s = &self.config.shape;
        let p = &self.params;
        check_len("conv_w", &p.conv_w, s.channels() * 4)?;
        check_len("dt", &p.dt, s.h_v)?;
        check_len("a", &p.a, s.h_v)?;
        check_len("gamma", &p.gamma, s.d)?;
        for (name, v) in [
            ("conv_w", &p.conv_w),
            ("dt", &p.dt),
            ("a", &p.a),
            ("gamma", &p.gamma),
        ] {
            if let Some(i) = v.iter().position(|x| !x.is_finite()) {
                return Err(Error::Param {
                    name,
                    why: format!("element {i} is {}", v[i]),
                });
            }
        }
        // the decay rate is -exp(A_log): passing A_log itself (usually positive) would make the gate exceed 1
        if let Some(i) = p.a.iter().position(|&x| x >= 0.0) {
            return Err(Error::Param {
                name: "a",
                why: format!("a[{i}] = {} must be negative (a = -exp(A_log))", p.a[i]),
            });
        }
        Ok(())
    }

    pub fn shape(&self) -> &Shape {
        &self.config.shape
    }
}

pub(crate) fn check_len(name: &'static str, v: &[f32], expected: usize) -> Result<()> {
    if v.len() != expected {
        return Err(Error::Length {
            name,
            expected,
            got: v.len(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg(target_pointer_width = "64")]
    fn shapes_whose_sizes_overflow_are_errors() {
        assert!(Shape::new(1024, 1, usize::MAX).is_err());
        assert!(Shape::new(16, usize::MAX / 2, usize::MAX / 2).is_err());
        assert!(Shape::new(128, 1 << 50, 1 << 50).is_err());
        assert!(
            Shape::new(128, 1 << 40, 1 << 40).is_ok(),
            "large, but every size fits"
        );
        assert!(Shape::new(128, 16, 48).is_ok());
    }
}
