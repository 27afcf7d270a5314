//! Tensor-parallel shards of a layer (SPEC.md, "Tensor-parallel shards").
//!
//! Rank r of `world` holds h_k / world q/k heads and the value heads that read them, so a shard's step needs
//! nothing from another rank: each value head's recurrence, readout and output norm involve only its own
//! q/k head. The shard is an ordinary [`Layer`]; its [`ShardMap`] names the global heads, conv channels and
//! output columns it holds, in the shard's own order, so that an engine (or a test) can slice its inputs and
//! place its outputs.

use crate::config::{HeadMap, Layer, Params, Shape};
use crate::{Error, Result};

/// Which global heads, in the shard's order, a shard holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardMap {
    /// The unsharded layer's shape.
    pub full: Shape,
    /// Global q/k head of each of the shard's q/k heads.
    pub key_heads: Vec<usize>,
    /// Global value head of each of the shard's value heads.
    pub value_heads: Vec<usize>,
}

impl ShardMap {
    /// Global conv channel of each of the shard's channels (q of its key heads, k of its key heads, v of its
    /// value heads: the shard's own [q | k | v] order). The shard's qkv rows are the full rows gathered at these.
    pub fn channels(&self) -> Vec<usize> {
        let (d, h_k) = (self.full.d, self.full.h_k);
        let heads = |base: usize, hs: &[usize]| -> Vec<usize> {
            hs.iter()
                .flat_map(|&g| (0..d).map(move |e| base + g * d + e))
                .collect()
        };
        let mut c = heads(0, &self.key_heads);
        c.extend(heads(h_k * d, &self.key_heads));
        c.extend(heads(2 * h_k * d, &self.value_heads));
        c
    }

    /// Global output column (of y [R][h_v d], and of z) of each of the shard's output columns.
    pub fn columns(&self) -> Vec<usize> {
        let d = self.full.d;
        self.value_heads
            .iter()
            .flat_map(|&h| (0..d).map(move |j| h * d + j))
            .collect()
    }
}

impl Layer {
    /// Rank `rank`'s shard of `world` (tensor parallelism over heads): `world` must divide h_k. Grouped map:
    /// q/k heads `rank * h_k/world ..` and the value heads `rank * h_v/world ..`, both contiguous (how engines
    /// split the projections). Tiled map (g = h % h_k): q/k heads `g0 .. g0 + h_k/world` and the value heads
    /// `g + h_k m` that read them, ordered so that the shard's tiled map holds again.
    pub fn shard(&self, rank: usize, world: usize) -> Result<(Layer, ShardMap)> {
        self.validate()?;
        let full = *self.shape();
        if world == 0 || !full.h_k.is_multiple_of(world) {
            return Err(Error::Param {
                name: "world",
                why: format!("{world} must be positive and divide h_k = {}", full.h_k),
            });
        }
        if rank >= world {
            return Err(Error::Param {
                name: "rank",
                why: format!("{rank} is not below world = {world}"),
            });
        }
        let hk = full.h_k / world;
        let ratio = full.group();
        let g0 = rank * hk;
        let key_heads: Vec<usize> = (g0..g0 + hk).collect();
        let value_heads: Vec<usize> = match self.config.head_map {
            HeadMap::Grouped => (g0 * ratio..(g0 + hk) * ratio).collect(),
            // shard head h' = (g - g0) + hk m reads q/k head h' % hk = g - g0, as global h = g + h_k m reads g
            HeadMap::Tiled => (0..ratio)
                .flat_map(|m| key_heads.iter().map(move |&g| g + full.h_k * m))
                .collect(),
        };
        let map = ShardMap {
            full,
            key_heads,
            value_heads,
        };
        let p = &self.params;
        let conv_w = map
            .channels()
            .iter()
            .flat_map(|&c| p.conv_w[c * 4..c * 4 + 4].iter().copied())
            .collect();
        let pick = |v: &[f32]| map.value_heads.iter().map(|&h| v[h]).collect();
        let mut config = self.config;
        config.shape = Shape::new(full.d, hk, hk * ratio)?;
        let layer = Layer::new(
            config,
            Params {
                conv_w,
                dt: pick(&p.dt),
                a: pick(&p.a),
                gamma: p.gamma.clone(),
            },
        )?;
        Ok((layer, map))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::synth::Synth;

    #[test]
    fn shards_cover_every_head_once_and_keep_the_head_map() {
        for map in [HeadMap::Tiled, HeadMap::Grouped] {
            let mut config = Config::new(Shape::new(16, 4, 12).unwrap());
            config.head_map = map;
            let layer = Synth::new(3).layer(config).unwrap();
            let mut seen_v = [0; 12];
            let mut seen_c = vec![0; layer.shape().channels()];
            for rank in 0..2 {
                let (shard, m) = layer.shard(rank, 2).unwrap();
                let s = shard.shape();
                assert_eq!((s.h_k, s.h_v), (2, 6));
                for (hs, &h) in m.value_heads.iter().enumerate() {
                    seen_v[h] += 1;
                    // the shard's head reads the shard's q/k head that is the global head's q/k head
                    let g_shard = map.qk_head(s, hs);
                    assert_eq!(m.key_heads[g_shard], map.qk_head(layer.shape(), h));
                    assert_eq!(shard.params.dt[hs], layer.params.dt[h]);
                }
                for (cs, &c) in m.channels().iter().enumerate() {
                    seen_c[c] += 1;
                    assert_eq!(
                        shard.params.conv_w[cs * 4..cs * 4 + 4],
                        layer.params.conv_w[c * 4..c * 4 + 4]
                    );
                }
            }
            assert!(seen_v.iter().all(|&n| n == 1));
            assert!(seen_c.iter().all(|&n| n == 1));
        }
    }

    #[test]
    fn bad_rank_or_world_is_an_error() {
        let layer = Synth::new(3)
            .layer(Config::new(Shape::new(16, 4, 8).unwrap()))
            .unwrap();
        assert!(layer.shard(0, 3).is_err());
        assert!(layer.shard(0, 0).is_err());
        assert!(layer.shard(2, 2).is_err());
        assert!(layer.shard(3, 4).is_ok());
    }
}
