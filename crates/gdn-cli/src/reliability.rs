//! `gdn drift` and `gdn soak`: long runs against the float64 oracle carried alongside. Drift: many decode steps,
//! the error printed at checkpoints. Soak: random steps (lengths, commits, slots, forks, resets, dtypes) with the
//! output checked every step, the states at checkpoints, and the process's memory, which must stay flat.

use gdn::oracle::{self, SeqState};
use gdn::synth::Synth;
use gdn::{
    relative_error, Commit, Config, DType, Error, Gate, HeadMap, LayerPool, PoolOptions, Result,
    RowsData, Seq, Shape, StateLayout, Step, TensorData,
};

use crate::backends;

#[derive(clap::Args)]
pub struct DriftArgs {
    /// The backend: cpu, cuda or wgpu (those this build has).
    #[arg(long, default_value = "cpu", value_parser = crate::backends::names())]
    backend: String,
    /// Decode steps.
    #[arg(long, default_value_t = 100_000)]
    steps: usize,
    /// The state's element type: f32 or bf16.
    #[arg(long, default_value = "f32")]
    state: DType,
    /// Head dim, q/k heads, value heads.
    #[arg(long, value_delimiter = ',', default_value = "128,1,2")]
    shape: Vec<usize>,
}

#[derive(clap::Args)]
pub struct SoakArgs {
    /// The backend: cpu, cuda or wgpu (those this build has).
    #[arg(long, default_value = "cpu", value_parser = crate::backends::names())]
    backend: String,
    /// Random steps.
    #[arg(long, default_value_t = 1_000_000)]
    steps: usize,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Steps between checkpoints (states read back against the oracle, memory sampled).
    #[arg(long, default_value_t = 10_000)]
    every: usize,
}

fn shape_of(v: &[usize]) -> Result<Shape> {
    match v {
        [d, h_k, h_v] => Shape::new(*d, *h_k, *h_v),
        _ => Err(Error::Param {
            name: "shape",
            why: format!("expected d,h_k,h_v, got {v:?}"),
        }),
    }
}

/// The oracle's states as key-major f32 slices beside the pool's, worst relative error of S and of H.
fn state_errors(pool: &mut dyn LayerPool, want: &[SeqState]) -> Result<(f64, f64)> {
    let sh = *pool.layer().shape();
    let layout = pool.options().layout;
    let (mut e_s, mut e_h) = (0.0f64, 0.0f64);
    for (slot, w) in want.iter().enumerate() {
        let (mut s, mut h) = (vec![0.0; sh.state_len()], vec![0.0; sh.hist_len()]);
        pool.read_slot(slot, &mut s, &mut h)?;
        let s = layout.convert(StateLayout::KeyMajor, &sh, &s);
        e_s = e_s.max(relative_error(&s, &w.s));
        e_h = e_h.max(relative_error(&h, &w.h));
    }
    Ok((e_s, e_h))
}

pub fn drift(args: DriftArgs) -> Result<()> {
    let backend = backends::make(&args.backend)?;
    let shape = shape_of(&args.shape)?;
    let mut config = Config::new(shape);
    config.head_map = HeadMap::Grouped;
    config.gate = Gate::Silu;
    let mut rng = Synth::new(5);
    let layer = rng.layer(config)?;
    let options = PoolOptions {
        state: args.state,
        layout: StateLayout::KeyMajor,
    };
    let b = 2;
    let mut pool = backend.create_pool_with(&layer, b, options)?;
    let mut exact = vec![SeqState::zeros(&layer); b];
    let seqs: Vec<Seq> = (0..b)
        .map(|s| Seq {
            slot: s as i32,
            start: s,
            len: 1,
            commit: Commit::All,
        })
        .collect();
    println!(
        "gdn drift on {}: {} decode steps of {b} sequences, d {} h_k {} h_v {}, {} state, against the exact float64 state",
        backend.name(),
        args.steps,
        shape.d,
        shape.h_k,
        shape.h_v,
        args.state.name()
    );
    let (mut worst_y, mut worst_s) = (0.0f64, 0.0f64);
    let mut ys = Vec::with_capacity(args.steps);
    let mut next = 1;
    for step in 1..=args.steps {
        let w = rng.batch(&layer, 1, b);
        let rows = RowsData::from_f32(&w.qkv, &w.alpha, &w.beta, &w.z, [DType::F32; 4]);
        let st = Step {
            rows: rows.view(),
            seqs: &seqs,
            plane_stride: None,
        };
        let mut out = TensorData::filled(b * shape.n(), 0.0, DType::F32);
        pool.step_varlen(&st, out.view_mut())?;
        let want = oracle::step_varlen(&layer, &mut exact, &st, DType::F32, DType::F32)?;
        let e_y = relative_error(&out.to_f32(), &want);
        worst_y = worst_y.max(e_y);
        ys.push(e_y);
        if step == next || step == args.steps {
            let (e_s, e_h) = state_errors(pool.as_mut(), &exact)?;
            worst_s = worst_s.max(e_s);
            println!("step {step:>7}: y {e_y:.2e}  S {e_s:.2e}  H {e_h:.2e}");
            next *= 10;
        }
    }
    ys.sort_by(f64::total_cmp);
    let median = ys.get(ys.len() / 2).copied().unwrap_or(0.0);
    let p99 = ys.get(ys.len() * 99 / 100).copied().unwrap_or(0.0);
    println!(
        "y per step: median {median:.2e}, 99th percentile {p99:.2e}, worst {worst_y:.2e}; S worst at the checkpoints {worst_s:.2e}"
    );
    // an f32 state must stay at f32 rounding; a bf16 state at bf16 rounding, not growing with the steps
    let bound = if args.state == DType::F32 { 1e-4 } else { 1e-2 };
    if worst_s.is_nan() || worst_s > bound || median.is_nan() || median > bound {
        return Err(Error::Backend(format!(
            "drift over {bound:e}: S {worst_s:.2e}, median y {median:.2e}"
        )));
    }
    Ok(())
}

/// Resident memory of this process in bytes (Linux), or 0 where it cannot be read.
fn resident_bytes() -> usize {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<usize>().ok())
        .map_or(0, |pages| pages * 4096)
}

pub fn soak(args: SoakArgs) -> Result<()> {
    let backend = backends::make(&args.backend)?;
    let shape = Shape::new(16, 1, 2)?;
    let mut config = Config::new(shape);
    config.head_map = HeadMap::Grouped;
    let mut rng = Synth::new(args.seed);
    let layer = rng.layer(config)?;
    let n_slots = 6;
    // two pools: an f32 key-major one and a bf16 value-major one, stepped alike
    let options = [
        PoolOptions::default(),
        PoolOptions {
            state: DType::Bf16,
            layout: StateLayout::ValueMajor,
        },
    ];
    let mut pools = Vec::new();
    for o in options {
        pools.push(backend.create_pool_with(&layer, n_slots, o)?);
    }
    let mut refs = vec![vec![SeqState::zeros(&layer); n_slots]; 2];
    println!(
        "gdn soak on {}: {} random steps over {n_slots} slots (d 16, h_k 1, h_v 2), f32 and bf16 pools, y checked every step, states every {}",
        backend.name(),
        args.steps,
        args.every
    );
    let (mut worst, mut tokens) = ([0.0f64; 2], 0usize);
    let mut rss_first = 0;
    let mut rss_max = 0;
    let every = args.every.max(1);
    for step in 1..=args.steps {
        match rng.index(0, 49) {
            // a fork or a fresh sequence now and then
            0 => {
                let (from, to) = (rng.index(0, n_slots - 1), rng.index(0, n_slots - 1));
                for (pool, r) in pools.iter_mut().zip(refs.iter_mut()) {
                    pool.copy_slot(from, to)?;
                    r[to] = r[from].clone();
                }
                continue;
            }
            1 => {
                let slot = rng.index(0, n_slots - 1);
                for (pool, r) in pools.iter_mut().zip(refs.iter_mut()) {
                    pool.reset_slot(slot)?;
                    r[slot] = SeqState::zeros(&layer);
                }
                continue;
            }
            _ => {}
        }
        // 1 to 4 sequences on distinct slots (one skipped now and then), lengths mostly short, every commit kind
        let count = rng.index(1, 4);
        let mut free: Vec<i32> = (0..n_slots as i32).collect();
        let mut seqs = Vec::with_capacity(count);
        let mut row = 0;
        for _ in 0..count {
            let slot = free.swap_remove(rng.index(0, free.len() - 1));
            let len = if rng.index(0, 99) == 0 {
                rng.index(9, 40)
            } else {
                rng.index(1, 8)
            };
            let commit = match rng.index(0, 5) {
                0 | 1 => Commit::Verify,
                2 => Commit::First(rng.index(1, len)),
                _ => Commit::All,
            };
            let slot = if rng.index(0, 19) == 0 { -1 } else { slot };
            row += rng.index(0, 1);
            seqs.push(Seq {
                slot,
                start: row,
                len,
                commit,
            });
            row += len;
        }
        tokens += row;
        let io = [DType::F32, DType::Bf16, DType::F16][rng.index(0, 2)];
        let w = rng.batch(&layer, 1, row);
        let rows = RowsData::from_f32(&w.qkv, &w.alpha, &w.beta, &w.z, [io; 4]);
        let st = Step {
            rows: rows.view(),
            seqs: &seqs,
            plane_stride: None,
        };
        for (k, (pool, r)) in pools.iter_mut().zip(refs.iter_mut()).enumerate() {
            let mut out = TensorData::filled(row * shape.n(), 0.0, io);
            pool.step_varlen(&st, out.view_mut())?;
            let want = oracle::step_varlen(&layer, r, &st, options[k].state, io)?;
            let e = relative_error(&out.to_f32(), &want);
            worst[k] = worst[k].max(e);
            // f32 outputs of the f32 pool within f32 rounding; 16-bit outputs, and the bf16 pool (whose state and
            // the oracle's may round to neighbouring values and carry that for a while), within 2e-2
            let bound = if io == DType::F32 && k == 0 {
                1e-4
            } else {
                2e-2
            };
            if e.is_nan() || e >= bound {
                return Err(Error::Backend(format!(
                    "step {step}, pool {k}: y error {e:.2e} over {bound:e} ({seqs:?}, {io:?})"
                )));
            }
        }
        if step % every == 0 || step == args.steps {
            let mut line = format!("step {step:>8}:");
            for (k, (pool, r)) in pools.iter_mut().zip(refs.iter()).enumerate() {
                let (e_s, e_h) = state_errors(pool.as_mut(), r)?;
                let bound = if k == 0 { 1e-4 } else { 1e-2 };
                if e_s.is_nan() || e_s >= bound || e_h.is_nan() || e_h >= 1e-6 {
                    return Err(Error::Backend(format!(
                        "step {step}, pool {k}: state error {e_s:.2e}, history {e_h:.2e}"
                    )));
                }
                line += &format!(" {} S {e_s:.1e}", options[k].state.name());
            }
            let rss = resident_bytes();
            if step / every == 2 {
                rss_first = rss;
            }
            rss_max = rss_max.max(rss);
            println!("{line}; resident {:.1} MiB", rss as f64 / (1 << 20) as f64);
        }
    }
    println!(
        "{tokens} tokens; worst y: f32 pool {:.2e}, bf16 pool {:.2e}; resident memory after warm-up {:.1} MiB, at most {:.1} MiB",
        worst[0],
        worst[1],
        rss_first as f64 / (1 << 20) as f64,
        rss_max as f64 / (1 << 20) as f64
    );
    // flat: no more than 16 MiB above the level after the first checkpoints
    if rss_first > 0 && rss_max > rss_first + (16 << 20) {
        return Err(Error::Backend(format!(
            "memory grew from {rss_first} to {rss_max} bytes"
        )));
    }
    Ok(())
}
