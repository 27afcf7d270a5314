//! Speculative steps (SPEC.md, "Speculative steps"): a verify window *held* on its slot, of which a later step
//! keeps the first k tokens before it runs its own window.
//!
//! The seed's flow pays three passes over the state per speculative step: verify the drafted window (a read),
//! then commit its accepted prefix (a read and a write). A held window keeps what its commit would apply (per
//! token the gate, the normalized key and the delta vector, and the raw inputs the conv history needs), so the
//! next step applies the accepted prefix while it first reads the state, writes the committed state once and runs
//! its window from it: one read and one write per step. Its outputs, committed state and history are bitwise
//! those of the seed's flow on the same backend.
//!
//! [`LayerPool::step_spec`](crate::LayerPool::step_spec) is that step; backends that do not run it natively are
//! wrapped in [`TwoPass`], which runs the seed's flow on the pool's own steps (the reference the native paths
//! are tested against, bitwise).

use crate::step::{Seq, Step};
use crate::{Commit, DType, Error, Layer, LayerPool, PoolOptions, Result, RowsData, TensorMut};

/// Checks one speculative step's acceptances against what the slots hold (`held(slot)`: the held window's
/// length, 0 for none): one entry per sequence, at most the held length of its slot (0 where nothing is held;
/// ignored for skipped sequences). Runs after [`Step::validate`], before anything is touched.
pub fn check_accept(
    step: &Step<'_>,
    accept: &[usize],
    held: impl Fn(usize) -> usize,
) -> Result<()> {
    if accept.len() != step.seqs.len() {
        return Err(Error::Length {
            name: "accept",
            expected: step.seqs.len(),
            got: accept.len(),
        });
    }
    for (i, (s, &a)) in step.seqs.iter().zip(accept).enumerate() {
        if s.slot < 0 {
            continue;
        }
        let h = held(s.slot as usize);
        if a > h {
            return Err(Error::Param {
                name: "accept",
                why: format!(
                    "sequence {i} accepts {a} tokens of slot {}'s held window of {h}",
                    s.slot
                ),
            });
        }
    }
    Ok(())
}

/// [`check_accept`], then that every window the step would hold (commit point 0, from [`Step::validate`]'s
/// `commit_at`) fits the `max_held` tokens the backend (`who`) keeps.
pub fn check_spec(
    step: &Step<'_>,
    commit_at: &[usize],
    accept: &[usize],
    held: impl Fn(usize) -> usize,
    max_held: usize,
    who: &str,
) -> Result<()> {
    check_accept(step, accept, held)?;
    for (s, &at) in step.seqs.iter().zip(commit_at) {
        if s.slot >= 0 && at == 0 && s.len > max_held {
            return Err(Error::Unsupported(format!(
                "a held window of {} tokens ({who} holds at most {max_held})",
                s.len
            )));
        }
    }
    Ok(())
}

/// The checks of `commit_held(slot, accept)` on a pool of `slots` whose `slot` holds `held` tokens.
pub fn check_commit_held(slot: usize, slots: usize, accept: usize, held: usize) -> Result<()> {
    slot_in_range(slot, slots)?;
    if accept > held {
        return Err(Error::Param {
            name: "accept",
            why: format!("{accept} tokens of slot {slot}'s held window of {held}"),
        });
    }
    Ok(())
}

/// The error of a plain step (or slot write) that names a slot holding a window.
pub fn held_error(slot: usize, held: usize) -> Error {
    Error::Param {
        name: "seqs",
        why: format!(
            "slot {slot} holds a window of {held} tokens: accept a prefix of it with step_spec or commit_held first"
        ),
    }
}

/// `slot` named in a pool of `slots`.
pub fn slot_in_range(slot: usize, slots: usize) -> Result<()> {
    if slot >= slots {
        return Err(Error::Param {
            name: "slot",
            why: format!("{slot} is not below the pool's {slots} slots"),
        });
    }
    Ok(())
}

/// A window held on a slot: its rows widened to f32 (exact) and its length.
#[derive(Clone, Debug)]
struct Held {
    qkv: Vec<f32>,
    alpha: Vec<f32>,
    beta: Vec<f32>,
    z: Vec<f32>,
    len: usize,
}

/// Any pool with the speculative step run as the seed's flow: a held window is kept as rows, and a step that
/// accepts k of its tokens first runs a k-token commit of them on the pool, then the new window. Three passes
/// over the state per speculative step; the reference for the native one-pass paths.
pub struct TwoPass<P> {
    pub pool: P,
    held: Vec<Option<Held>>,
}

impl<P: LayerPool> TwoPass<P> {
    pub fn new(pool: P) -> Self {
        let n = pool.slots();
        TwoPass {
            pool,
            held: vec![None; n],
        }
    }

    fn held_len(&self, slot: usize) -> usize {
        self.held
            .get(slot)
            .and_then(|h| h.as_ref())
            .map_or(0, |h| h.len)
    }

    fn no_held(&self, slots: impl Iterator<Item = usize>) -> Result<()> {
        for s in slots {
            let h = self.held_len(s);
            if h > 0 {
                return Err(held_error(s, h));
            }
        }
        Ok(())
    }

    /// Commits the first `accept` tokens of each named slot's held window (a k-token commit of its rows on the
    /// pool) and drops the windows.
    fn commit_prefixes(&mut self, items: &[(usize, usize)]) -> Result<()> {
        let sh = *self.pool.layer().shape();
        let (mut qkv, mut alpha, mut beta, mut z, mut seqs) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for &(slot, a) in items {
            let Some(h) = self.held[slot].as_ref() else {
                continue;
            };
            if a > 0 {
                seqs.push(Seq {
                    slot: slot as i32,
                    start: seqs.iter().map(|s: &Seq| s.len).sum(),
                    len: h.len,
                    commit: Commit::First(a),
                });
                qkv.extend_from_slice(&h.qkv);
                alpha.extend_from_slice(&h.alpha);
                beta.extend_from_slice(&h.beta);
                z.extend_from_slice(&h.z);
            }
        }
        if !seqs.is_empty() {
            let rows = RowsData::from_f32(&qkv, &alpha, &beta, &z, [DType::F32; 4]);
            let r: usize = seqs.iter().map(|s| s.len).sum();
            let mut out = vec![0.0f32; r * sh.n()];
            self.pool.step_varlen(
                &Step {
                    rows: rows.view(),
                    seqs: &seqs,
                    plane_stride: None,
                },
                TensorMut::F32(&mut out),
            )?;
        }
        for &(slot, _) in items {
            self.held[slot] = None;
        }
        Ok(())
    }
}

impl<P: LayerPool> LayerPool for TwoPass<P> {
    fn layer(&self) -> &Layer {
        self.pool.layer()
    }
    fn slots(&self) -> usize {
        self.pool.slots()
    }
    fn options(&self) -> PoolOptions {
        self.pool.options()
    }
    fn write_slot(&mut self, slot: usize, state: &[f32], hist: &[f32]) -> Result<()> {
        self.pool.write_slot(slot, state, hist)?;
        self.held[slot] = None;
        Ok(())
    }
    fn read_slot(&mut self, slot: usize, state: &mut [f32], hist: &mut [f32]) -> Result<()> {
        self.pool.read_slot(slot, state, hist)
    }
    fn reset_slot(&mut self, slot: usize) -> Result<()> {
        self.pool.reset_slot(slot)?;
        self.held[slot] = None;
        Ok(())
    }
    fn copy_slot(&mut self, from: usize, to: usize) -> Result<()> {
        self.pool.copy_slot(from, to)?;
        self.held[to] = self.held[from].clone();
        Ok(())
    }
    fn step_varlen(&mut self, step: &Step<'_>, out: TensorMut<'_>) -> Result<()> {
        step.validate(self.pool.layer(), self.pool.slots(), out.len())?;
        self.no_held(
            step.seqs
                .iter()
                .filter(|s| s.slot >= 0)
                .map(|s| s.slot as usize),
        )?;
        self.pool.step_varlen(step, out)
    }
    fn check_step(&self, step: &Step<'_>, out_len: usize) -> Result<()> {
        self.pool.check_step(step, out_len)?;
        self.no_held(
            step.seqs
                .iter()
                .filter(|s| s.slot >= 0)
                .map(|s| s.slot as usize),
        )
    }
    fn held(&self, slot: usize) -> usize {
        self.held_len(slot)
    }
    fn commit_held(&mut self, slot: usize, accept: usize) -> Result<()> {
        check_commit_held(slot, self.pool.slots(), accept, self.held_len(slot))?;
        self.commit_prefixes(&[(slot, accept)])
    }
    fn step_spec(&mut self, step: &Step<'_>, accept: &[usize], out: TensorMut<'_>) -> Result<()> {
        let sh = *self.pool.layer().shape();
        let checked = step.validate(self.pool.layer(), self.pool.slots(), out.len())?;
        check_accept(step, accept, |s| self.held_len(s))?;
        let live: Vec<(usize, usize)> = step
            .seqs
            .iter()
            .zip(accept)
            .filter(|(s, _)| s.slot >= 0)
            .map(|(s, &a)| (s.slot as usize, a))
            .collect();
        // every check of the new window before the prefixes are committed, so a rejected call changes nothing
        self.pool.check_step(step, out.len())?;
        self.commit_prefixes(&live)?;
        self.pool.step_varlen(step, out)?;
        for (s, &at) in step.seqs.iter().zip(&checked.commit_at) {
            if s.slot < 0 || at > 0 {
                continue;
            }
            let rows = |t: &crate::Tensor<'_>, w: usize| {
                let mut v = vec![0.0f32; s.len * w];
                t.widen_into(s.start * w, &mut v);
                v
            };
            let r = &step.rows;
            self.held[s.slot as usize] = Some(Held {
                qkv: rows(&r.qkv, sh.channels()),
                alpha: rows(&r.alpha, sh.h_v),
                beta: rows(&r.beta, sh.h_v),
                z: rows(&r.z, sh.n()),
                len: s.len,
            });
        }
        Ok(())
    }
}
