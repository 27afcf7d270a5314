//! Target `step`: `Step::validate` and `LayerPool::step_varlen` on the CPU backend with generated arguments:
//! sequence lists (slots in and out of range and repeated, starts and lengths up to `usize::MAX`, every commit),
//! row counts that disagree across tensors, every dtype per tensor, plane strides and output lengths off by
//! one or huge, pools of every state dtype and layout. An input's bytes are the generator's choices, so the
//! byte mutator explores this space. Checked: no panic; `validate` and `step_varlen` agree; on an error the
//! pool's slots and the output buffer are bit for bit as before; on success the rows no running sequence
//! covers, the slots none names and the slots of verify sequences are as before. The slot operations
//! (`read_slot`, `write_slot`, `copy_slot`, `reset_slot`) get out-of-range slots and wrong lengths too.

use gdn::synth::Synth;
use gdn::{
    Backend, Commit, Config, DType, Gate, HeadMap, Layer, LayerPool, OutputLayout, PoolOptions,
    Rows, Seq, Shape, StateLayout, Step, Tensor, TensorMut,
};
use half::{bf16, f16};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::harness::{Outcome, Target};
use crate::mutate::Choices;

/// The largest output buffer made (a longer layout is given a shorter buffer, which must be an error).
const MAX_OUT: usize = 1 << 16;

pub struct StepTarget {
    cpu: gdn::Cpu,
    layers: Vec<Layer>,
}

impl StepTarget {
    pub fn new() -> gdn::Result<Self> {
        let mut rng = Synth::new(5);
        let layers = vec![
            rng.layer(Config::new(Shape::new(16, 1, 1)?))?,
            rng.layer(Config {
                head_map: HeadMap::Grouped,
                gate: Gate::Silu,
                eps: 1e-5,
                shape: Shape::new(16, 1, 2)?,
            })?,
            rng.layer(Config::new(Shape::new(32, 2, 4)?))?,
        ];
        Ok(StepTarget {
            cpu: gdn::Cpu::with_threads(2).unwrap_or_default(),
            layers,
        })
    }
}

enum Owned {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
    F16(Vec<f16>),
}

impl Owned {
    fn new(rng: &mut SmallRng, dtype: DType, len: usize, specials: bool) -> Self {
        let mut v: Vec<f32> = (0..len).map(|_| rng.random_range(-3.0..3.0)).collect();
        if specials && len > 0 {
            for _ in 0..3 {
                let i = rng.random_range(0..len);
                v[i] =
                    [f32::NAN, f32::INFINITY, -f32::INFINITY, 1e38, -0.0][rng.random_range(0..5)];
            }
        }
        match dtype {
            DType::F32 => Owned::F32(v),
            DType::Bf16 => Owned::Bf16(v.iter().map(|&x| bf16::from_f32(x)).collect()),
            DType::F16 => Owned::F16(v.iter().map(|&x| f16::from_f32(x)).collect()),
        }
    }
    fn view(&self) -> Tensor<'_> {
        match self {
            Owned::F32(x) => Tensor::F32(x),
            Owned::Bf16(x) => Tensor::Bf16(x),
            Owned::F16(x) => Tensor::F16(x),
        }
    }
    fn view_mut(&mut self) -> TensorMut<'_> {
        match self {
            Owned::F32(x) => TensorMut::F32(x),
            Owned::Bf16(x) => TensorMut::Bf16(x),
            Owned::F16(x) => TensorMut::F16(x),
        }
    }
    /// The bits of element `i`.
    fn bits(&self, i: usize) -> u32 {
        match self {
            Owned::F32(x) => x[i].to_bits(),
            Owned::Bf16(x) => x[i].to_bits() as u32,
            Owned::F16(x) => x[i].to_bits() as u32,
        }
    }
    fn all_bits(&self) -> Vec<u32> {
        let n = self.view().len();
        (0..n).map(|i| self.bits(i)).collect()
    }
}

const DTYPES: [DType; 3] = [DType::F32, DType::Bf16, DType::F16];

/// Every slot's state and history, as bits.
fn snapshot(pool: &mut dyn LayerPool, sh: &Shape) -> Result<Vec<Vec<u32>>, String> {
    (0..pool.slots())
        .map(|s| {
            let mut st = vec![0.0; sh.state_len()];
            let mut h = vec![0.0; sh.hist_len()];
            pool.read_slot(s, &mut st, &mut h)
                .map_err(|e| format!("read_slot({s}) of a good slot failed: {e}"))?;
            Ok(st.iter().chain(&h).map(|x| x.to_bits()).collect())
        })
        .collect()
}

/// A size near `hi` or at the edges of usize.
fn size(c: &mut Choices, hi: usize) -> usize {
    match c.below(10) {
        0 => usize::MAX,
        1 => usize::MAX - c.below(4),
        2 => 1 << 63,
        3 => c.u64() as usize,
        _ => c.below(hi + 3),
    }
}

impl Target for StepTarget {
    fn name(&self) -> &'static str {
        "step"
    }

    fn seeds(&self) -> Vec<Vec<u8>> {
        // zeros (the generator's first choices everywhere) and random choices
        let mut rng = SmallRng::seed_from_u64(9);
        let mut seeds = vec![vec![0u8; 96]];
        for _ in 0..15 {
            let mut v = vec![0u8; 96];
            rng.fill(&mut v[..]);
            seeds.push(v);
        }
        seeds
    }

    fn max_len(&self) -> usize {
        512
    }

    fn exec(&mut self, input: &[u8]) -> Outcome {
        let mut c = Choices::new(input);
        let layer = &self.layers[c.below(self.layers.len())];
        let sh = *layer.shape();
        let mut rng = SmallRng::seed_from_u64(c.u64());
        let options = PoolOptions {
            state: [DType::F32, DType::Bf16, DType::F32, DType::F16][c.below(4)],
            layout: [StateLayout::KeyMajor, StateLayout::ValueMajor][c.below(2)],
        };
        let slots = c.below(6);
        let mut pool = match self.cpu.create_pool_with(layer, slots, options) {
            Ok(p) => p,
            Err(e) => {
                if options.state != DType::F16 {
                    return Err(format!("a pool of {slots} slots, {options:?}: {e}"));
                }
                return Ok(format!("pool: {e}"));
            }
        };
        for s in 0..slots {
            let st: Vec<f32> = (0..sh.state_len())
                .map(|_| rng.random_range(-0.5..0.5))
                .collect();
            let h: Vec<f32> = (0..sh.hist_len())
                .map(|_| rng.random_range(-2.0..2.0))
                .collect();
            pool.write_slot(s, &st, &h)
                .map_err(|e| format!("write_slot({s}) of a good slot failed: {e}"))?;
        }

        // rows, each tensor its own dtype, and now and then one tensor a row short or long
        let rows = c.below(10);
        let specials = c.chance(10);
        let mut lens = [
            rows * sh.channels(),
            rows * sh.h_v,
            rows * sh.h_v,
            rows * sh.n(),
        ];
        if c.chance(8) {
            let i = c.below(4);
            lens[i] = [
                lens[i] + 1,
                lens[i].saturating_sub(1),
                0,
                lens[i] + sh.channels(),
            ][c.below(4)];
        }
        let tensors: Vec<Owned> = lens
            .iter()
            .map(|&n| Owned::new(&mut rng, c.pick(&DTYPES), n, specials))
            .collect();
        let rows_view = Rows {
            qkv: tensors[0].view(),
            alpha: tensors[1].view(),
            beta: tensors[2].view(),
            z: tensors[3].view(),
        };

        // sequences: laid end to end from a random row (valid more often than not), or anything
        let n_seqs = c.below(6);
        let mut seqs = Vec::with_capacity(n_seqs);
        let mut at = c.below(3);
        let wild = c.chance(30);
        for _ in 0..n_seqs {
            let (start, len) = if wild || c.chance(10) {
                (size(&mut c, rows), size(&mut c, rows))
            } else {
                let len = 1 + c.below(4);
                let s = (at, len);
                at += len + c.below(2);
                s
            };
            let slot = match c.below(8) {
                0 => -1,
                1 => [i32::MIN, i32::MAX, -7, slots as i32][c.below(4)],
                _ => c.below(slots + 1) as i32,
            };
            let commit = match c.below(6) {
                0 => Commit::Verify,
                1 | 2 => Commit::All,
                3 => Commit::First(c.below(len.min(8) + 2)),
                4 => Commit::First(len),
                _ => Commit::First([usize::MAX, 0, len.wrapping_add(1)][c.below(3)]),
            };
            seqs.push(Seq {
                slot,
                start,
                len,
                commit,
            });
        }
        let y_len = rows * sh.n();
        let plane_stride = match c.below(8) {
            0..=3 => None,
            4 => Some(y_len + c.below(40)),
            5 => Some(y_len.saturating_sub(1 + c.below(3))),
            6 => Some([usize::MAX, usize::MAX / 4, usize::MAX / 4 + 1, 1 << 62][c.below(4)]),
            _ => Some(c.below(MAX_OUT)),
        };
        let want = OutputLayout::for_rows(&sh, rows, plane_stride).map(|l| l.len());
        let out_len = match (c.below(10), &want) {
            (0, _) => 0,
            (1, Ok(n)) => n.saturating_sub(1),
            (2, Ok(n)) => n + 1,
            (3, _) => c.below(MAX_OUT),
            (_, Ok(n)) => *n,
            (_, Err(_)) => c.below(64),
        }
        .min(MAX_OUT);
        let mut out = Owned::new(&mut rng, c.pick(&DTYPES), out_len, false);
        let step = Step {
            rows: rows_view,
            seqs: &seqs,
            plane_stride,
        };

        // validate alone, against any pool size a caller might pass
        let other_slots = [
            slots,
            0,
            usize::MAX,
            1 << 40,
            i32::MAX as usize + 1,
            c.below(1 << 20),
        ][c.below(6)];
        let _ = step.validate(layer, other_slots, c.u64() as usize);
        let checked = step.validate(layer, slots, out_len);

        let before = snapshot(pool.as_mut(), &sh)?;
        let out_before = out.all_bits();
        let r = pool.step_varlen(&step, out.view_mut());
        let after = snapshot(pool.as_mut(), &sh)?;
        let outcome = match (&checked, &r) {
            (Err(_), Ok(())) => return Err("validate failed but step_varlen ran".into()),
            (Ok(_), Err(e)) => return Err(format!("validate passed but step_varlen failed: {e}")),
            (_, Err(e)) => {
                if before != after {
                    return Err(format!("step_varlen failed ({e}) and changed the pool"));
                }
                if out.all_bits() != out_before {
                    return Err(format!("step_varlen failed ({e}) and wrote the output"));
                }
                format!("error: {e}")
            }
            (Ok(ch), Ok(())) => {
                // rows no running sequence covers are not written, in y, the planes or the group sums
                let n = sh.n();
                let mut covered = vec![false; rows];
                for s in seqs.iter().filter(|s| s.slot >= 0) {
                    covered[s.start..s.start + s.len].fill(true);
                }
                let mut spans = vec![(0, n)];
                if let Some(p) = ch.layout.plane_stride {
                    spans.extend((1..4).map(|k| (k * p, n)));
                    spans.push((4 * p, n / 16));
                }
                for r in (0..rows).filter(|&r| !covered[r]) {
                    for &(base, w) in &spans {
                        if (base + r * w..base + (r + 1) * w).any(|i| out.bits(i) != out_before[i])
                        {
                            return Err(format!("row {r}, no running sequence's, was written"));
                        }
                    }
                }
                // slots no sequence names, and those of verify sequences, are as they were
                for s in 0..slots {
                    let named = seqs
                        .iter()
                        .zip(&ch.commit_at)
                        .find(|(q, _)| q.slot == s as i32);
                    if named.is_none_or(|(_, &k)| k == 0) && before[s] != after[s] {
                        return Err(format!("slot {s} changed, but no sequence commits to it"));
                    }
                }
                // the kind of a good step, for the corpus: each sequence's commit (skipped, verify, all,
                // first k), whether there are planes, the state's dtype
                let mut kind = String::from("ok ");
                for (q, &k) in seqs.iter().zip(&ch.commit_at) {
                    kind.push(match (q.slot < 0, k) {
                        (true, _) => 's',
                        (_, 0) => 'v',
                        (_, k) if k == q.len => 'a',
                        _ => 'f',
                    });
                }
                kind.push(if plane_stride.is_some() { 'P' } else { '-' });
                kind.push_str(options.state.name());
                kind
            }
        };

        // the slot operations with slots out of range and buffers of the wrong length
        let bad_slot = [slots, slots + 1, usize::MAX, 1 << 40][c.below(4)];
        let mut st = vec![0.0; sh.state_len() + c.below(2)];
        let mut h = vec![0.0; sh.hist_len().saturating_sub(c.below(2))];
        let snap = snapshot(pool.as_mut(), &sh)?;
        let good = c.below(slots.max(1));
        let results = [
            pool.read_slot(bad_slot, &mut st, &mut h).is_err(),
            pool.write_slot(bad_slot, &st, &h).is_err(),
            pool.copy_slot(bad_slot, good).is_err(),
            pool.copy_slot(good, bad_slot).is_err(),
            pool.reset_slot(bad_slot).is_err(),
        ];
        if results.iter().any(|&e| !e) {
            return Err(format!(
                "a slot operation on slot {bad_slot} of {slots} succeeded: {results:?}"
            ));
        }
        if slots > 0 && (st.len() != sh.state_len() || h.len() != sh.hist_len()) {
            let wrote = pool.write_slot(good, &st, &h).is_err();
            if !wrote {
                return Err("write_slot took buffers of the wrong length".into());
            }
        }
        if snapshot(pool.as_mut(), &sh)? != snap {
            return Err("a failed slot operation changed the pool".into());
        }
        Ok(outcome)
    }
}
