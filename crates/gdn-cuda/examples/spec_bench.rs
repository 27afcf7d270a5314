//! The speculative step's device time at the seed shape: the one-pass kernel (`CudaPool::time_spec`: accept a
//! random prefix of each slot's held window of W tokens, verify the next W) beside the two-pass flow's two
//! kernels (a k-token commit of the held rows, then the verify), each timed as `time_varlen` times a step (a
//! CUDA graph of 20 steps replayed 10 times, events, median of 7). Same-run ratios; device runs only.
//! `spec_bench [B,B,..] [W,W,..]` (default 1,64,256 and 4,8). `spec_bench B W profile [bf16]`: no timing, for a
//! profiler: f32 state and io (bf16: a bf16 value-major state and bf16 io), the four kernels once each in this
//! order: the one-pass kernel holding a first window (nothing accepted), the one-pass kernel accepting a random
//! prefix of it, the two-pass flow's k-token commit, its verify. With W 1 the commit is a decode step (T 1, every
//! sequence committing its token), the kernel a pool's decode call runs. `GDN_CUDA_PLAN=ncb,rg,minb` forces a split.

use gdn::synth::Synth;
use gdn::{
    Backend, Commit, Config, DType, LayerPool, PoolOptions, RowsData, Seq, Shape, StateLayout, Step,
};
use gdn_cuda::Cuda;

fn list(arg: Option<String>, default: &[usize]) -> Vec<usize> {
    arg.map(|a| a.split(',').filter_map(|x| x.parse().ok()).collect())
        .unwrap_or_else(|| default.to_vec())
}

fn main() -> gdn::Result<()> {
    let mut args = std::env::args().skip(1);
    let batches = list(args.next(), &[1, 64, 256]);
    let windows = list(args.next(), &[4, 8]);
    if args.next().as_deref() == Some("profile") {
        return profile(
            batches[0],
            windows[0],
            args.next().as_deref() == Some("bf16"),
        );
    }
    let cuda = backend()?;
    let mut rng = Synth::new(15);
    let layer = rng.layer(Config::new(Shape::SEED))?;
    let sh = *layer.shape();
    let ceiling = cuda.copy_ceiling(256 * sh.state_len() * 4)?;
    println!(
        "seed shape, key-major state; device us per speculative step; copy ceiling {:.3} TB/s",
        ceiling / 1e12
    );
    println!();
    println!("| state / io | B | W | one-pass | verify | commit k | two-pass | speed-up | one-pass state bytes / ceiling |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for (state, io) in [(DType::F32, DType::F32), (DType::Bf16, DType::Bf16)] {
        let opts = PoolOptions {
            state,
            layout: StateLayout::KeyMajor,
        };
        for &b in &batches {
            let mut one = cuda.create_cuda_pool(&layer, b, opts)?;
            let mut two = cuda.create_cuda_pool(&layer, b, opts)?;
            for slot in 0..b {
                let (s, h) = rng.seq_state(&layer);
                one.write_slot(slot, &s, &h)?;
                two.write_slot(slot, &s, &h)?;
            }
            for &w in &windows {
                let data = rng.batch(&layer, b * w, 1);
                let rows = RowsData::from_f32(&data.qkv, &data.alpha, &data.beta, &data.z, [io; 4]);
                let verify = held_windows(b, w);
                let step = Step {
                    rows: rows.view(),
                    seqs: &verify,
                    plane_stride: None,
                };
                // hold a window on every slot, then time the steps that accept a random prefix of it
                for s in 0..b {
                    let k = one.held(s);
                    one.commit_held(s, k)?;
                }
                let mut out = gdn::TensorData::filled(b * w * sh.n(), 0.0, io);
                one.step_spec(&step, &vec![0; b], out.view_mut())?;
                let accept: Vec<usize> = rng
                    .uniform(b, 0.0, (w + 1) as f32)
                    .iter()
                    .map(|&x| (x as usize).min(w))
                    .collect();
                let t1 = one
                    .time_spec(&step, &accept, io, 20)?
                    .per_call
                    .as_secs_f64();
                let commit: Vec<Seq> = (0..b)
                    .filter(|&i| accept[i] > 0)
                    .map(|i| Seq {
                        slot: i as i32,
                        start: i * w,
                        len: w,
                        commit: Commit::First(accept[i]),
                    })
                    .collect();
                let tc = if commit.is_empty() {
                    0.0
                } else {
                    let cstep = Step {
                        rows: rows.view(),
                        seqs: &commit,
                        plane_stride: None,
                    };
                    two.time_varlen(&cstep, io, 20)?.per_call.as_secs_f64()
                };
                let tv = two.time_varlen(&step, io, 20)?.per_call.as_secs_f64();
                let bytes = 2.0 * (b * sh.state_len() * state.size()) as f64;
                println!(
                    "| {} / {} | {b} | {w} | {:.1} | {:.1} | {:.1} | {:.1} | {:.2}x | {:.1}% |",
                    state.name(),
                    io.name(),
                    t1 * 1e6,
                    tv * 1e6,
                    tc * 1e6,
                    (tv + tc) * 1e6,
                    (tv + tc) / t1,
                    100.0 * bytes / t1 / ceiling
                );
            }
        }
    }
    Ok(())
}

/// The launches `spec_bench B W profile` makes (see the module's comment), one of each kernel, outside graphs.
fn profile(b: usize, w: usize, bf16: bool) -> gdn::Result<()> {
    let cuda = backend()?;
    let mut rng = Synth::new(15);
    let layer = rng.layer(Config::new(Shape::SEED))?;
    let sh = *layer.shape();
    let (opts, io) = if bf16 {
        let st = PoolOptions {
            state: DType::Bf16,
            layout: StateLayout::ValueMajor,
        };
        (st, DType::Bf16)
    } else {
        (PoolOptions::default(), DType::F32)
    };
    let mut one = cuda.create_cuda_pool(&layer, b, opts)?;
    let mut two = cuda.create_cuda_pool(&layer, b, opts)?;
    for slot in 0..b {
        let (s, h) = rng.seq_state(&layer);
        one.write_slot(slot, &s, &h)?;
        two.write_slot(slot, &s, &h)?;
    }
    let data = rng.batch(&layer, b * w, 1);
    let rows = RowsData::from_f32(&data.qkv, &data.alpha, &data.beta, &data.z, [io; 4]);
    let verify = held_windows(b, w);
    let step = Step {
        rows: rows.view(),
        seqs: &verify,
        plane_stride: None,
    };
    let accept: Vec<usize> = rng
        .uniform(b, 0.0, (w + 1) as f32)
        .iter()
        .map(|&x| (x as usize).min(w))
        .collect();
    let commit: Vec<Seq> = (0..b)
        .map(|i| Seq {
            slot: i as i32,
            start: i * w,
            len: w,
            commit: Commit::First(accept[i].max(1)),
        })
        .collect();
    let cstep = Step {
        rows: rows.view(),
        seqs: &commit,
        plane_stride: None,
    };
    let mut out = gdn::TensorData::filled(b * w * sh.n(), 0.0, DType::F32);
    one.step_spec(&step, &vec![0; b], out.view_mut())?;
    one.step_spec(&step, &accept, out.view_mut())?;
    two.step_varlen(&cstep, out.view_mut())?;
    two.step_varlen(&step, out.view_mut())?;
    let mean = accept.iter().sum::<usize>() as f64 / b as f64;
    println!("profile: B {b} W {w}, mean accepted {mean:.2}; launches: hold, accept + hold, commit k, verify");
    Ok(())
}

/// Sequence i of b on slot i, rows i w .. + w, held (verify) windows of w tokens.
fn held_windows(b: usize, w: usize) -> Vec<Seq> {
    (0..b)
        .map(|i| Seq {
            slot: i as i32,
            start: i * w,
            len: w,
            commit: Commit::Verify,
        })
        .collect()
}

/// The CUDA backend, with the split `GDN_CUDA_PLAN=ncb,rg,minb` forces (as `bench` takes it).
fn backend() -> gdn::Result<Cuda> {
    let mut cuda = Cuda::new()?;
    if let Ok(v) = std::env::var("GDN_CUDA_PLAN") {
        cuda.set_plan_override(Some(v.parse()?));
    }
    Ok(cuda)
}
