//! `gdn bench`: the step at the seed's shape, timed the backend's own way, beside a memory-copy ceiling of the
//! same backend measured in the same run on a buffer the size of the case's state.

use std::time::Duration;

use gdn::synth::Synth;
use gdn::{
    Commit, Config, DType, Gate, HeadMap, LayerPool, PoolOptions, Result, RowsData, Seq, Shape,
    StateLayout, Step, StepArgs,
};
use indicatif::{ProgressBar, ProgressStyle};

use crate::backends;

#[derive(clap::Args)]
pub struct Args {
    /// The backend: cpu, cuda or wgpu (those this build has).
    #[arg(long, default_value = "cpu", value_parser = crate::backends::names())]
    backend: String,
    /// Batch sizes (default: 1,8 on the CPU; 1,8,32,128,256 on a GPU).
    #[arg(long, value_delimiter = ',')]
    batch: Option<Vec<usize>>,
    /// Window lengths (default: 1,4,8,64 on the CPU; 1,4,8 on a GPU).
    #[arg(long, value_delimiter = ',')]
    tokens: Option<Vec<usize>>,
    /// The output gate: sigmoid or silu (also swish).
    #[arg(long, default_value = "sigmoid")]
    gate: Gate,
    /// The head map: tiled (also repeat) or grouped (also repeat_interleave).
    #[arg(long, default_value = "tiled")]
    head_map: HeadMap,
    /// Wall time to aim for per timing round, in milliseconds.
    #[arg(long, default_value_t = 40)]
    round_ms: u64,
    /// Rotate among enough sets of B slots to span this many MiB of state, one set per call, so that a state
    /// comes from memory rather than from a cache that kept it since its last call, as in an engine that steps
    /// many layers in turn (0: one set, the default). The copy ceiling rotates the same way, and a timing round
    /// makes at least one call per set, so rounds can outlast --round-ms. On the CPU the table shows the rotated
    /// times; on CUDA both, in cache (one set, the small-B states stay in the GPU's L2 between calls) and
    /// rotated (graph replays over the sets), each beside its own ceiling (not implemented for wgpu).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=MAX_ROTATE_MIB))]
    rotate_mib: u32,
    /// The state's element type: f32 or bf16.
    #[arg(long, default_value = "f32")]
    state: DType,
    /// The state's layout: key-major or value-major.
    #[arg(long, default_value = "key-major")]
    layout: StateLayout,
    /// The activations' element type, inputs and outputs: f32, bf16 or f16.
    #[arg(long, default_value = "f32")]
    io: DType,
    /// A mixed batch `B:T` (B - 1 decode sequences and one window of T tokens in one call), timed beside the two
    /// calls it replaces; 0:0 for none (default: 256:64 on a GPU, 8:64 on the CPU).
    #[arg(long)]
    mixed: Option<Mixed>,
    /// Time a speculative loop instead, for each of these window lengths and each batch size: every call
    /// verifies a window of W drafted tokens per sequence and accepts a random prefix (0..=W, seeded) of the
    /// last one; the backend's one-pass `step_spec` beside the seed's two-pass flow (verify, then commit the
    /// prefix) on the same backend. With --rotate-mib the calls rotate among slot sets as above. Timed with the
    /// host clock around whole calls (on wgpu the host-slice uploads and downloads are in it); on CUDA device
    /// time instead: CUDA-graph replays of the one-pass kernel beside the two-pass flow's commit and verify
    /// kernels (`CudaPool::time_spec_rotating`, `time_varlen_rotating`).
    #[arg(long, value_delimiter = ',')]
    spec: Option<Vec<usize>>,
    /// Time the layer's out_proj over quantized weights (n -> this hidden size) and the layer's tail instead, at
    /// each batch size and window length (default B 1,64 and T 1,8): the product that reads the step's planes
    /// and group sums beside the same product from y with shifts and its own group-sum pass and beside a plain
    /// bf16 out_proj, alone and after the step, for every packing; bytes moved over the copy ceiling. CPU and
    /// CUDA; the products rotate over weight copies spanning --rotate-mib (default 256).
    #[arg(long)]
    out_proj: Option<usize>,
    /// Time one long window (prefill) instead, for each of these lengths: a sequence of T tokens committed in
    /// full, at the seed's shape, on the backend's own path (its crossover to chunks; the CPU runs every window
    /// token after token); each case timed in 3 rounds (best and spread shown).
    #[arg(long, value_delimiter = ',')]
    prefill: Option<Vec<usize>>,
}

/// `B:T` for `--mixed`.
#[derive(Clone, Copy, Debug)]
pub struct Mixed {
    b: usize,
    t: usize,
}

impl std::str::FromStr for Mixed {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let (b, t) = s.split_once(':').ok_or("expected B:T")?;
        let parse = |x: &str| x.trim().parse::<usize>().map_err(|e| e.to_string());
        let m = Mixed {
            b: parse(b)?,
            t: parse(t)?,
        };
        if (m.b == 0) != (m.t == 0) || m.b == 1 {
            return Err("B must be at least 2 and T at least 1 (or 0:0 for none)".into());
        }
        Ok(m)
    }
}

/// The most state `--rotate-mib` may ask for: 4 GiB (the pool and the ceiling's buffers are each that large).
const MAX_ROTATE_MIB: i64 = 4 << 10;

/// One measured case.
pub struct Row {
    pub b: usize,
    pub t: usize,
    /// CUDA with rotation: the rotated time and its ceiling (`per_call` is then the time in cache).
    pub rotated: Option<(Duration, f64)>,
    pub per_call: Duration,
    pub host_per_call: Option<Duration>,
    pub copy_bytes_per_s: f64,
    /// The backend's FMA ceiling in FLOP/s, measured in the same run, where it measures one.
    pub fma_flops_per_s: Option<f64>,
}

/// Element types of a run, for its byte counts.
#[derive(Clone, Copy, Debug)]
pub struct Dtypes {
    pub state: DType,
    pub io: DType,
}

/// Bytes a step must move at least: S and H read and written, inputs read, y written, parameters read.
pub fn bytes_moved(sh: &Shape, dt: Dtypes, b: usize, t: usize) -> f64 {
    let state = 2 * b * (sh.state_len() * dt.state.size() + sh.hist_len() * 4);
    let io = b * t * (sh.channels() + 2 * sh.h_v + 2 * sh.n()) * dt.io.size();
    let params = 4 * (sh.channels() * 4 + 2 * sh.h_v + sh.d);
    (state + io + params) as f64
}

/// Floating-point operations of a step: 7 d^2 per value head and token (kv, the update, the readout), the rest
/// is O(d).
pub fn flops(sh: &Shape, b: usize, t: usize) -> f64 {
    (b * t * sh.h_v * 7 * sh.d * sh.d) as f64
}

/// The footprint the copy ceiling is measured on: the state's own on the CPU (the L3 holds a few sequences'
/// states, so like is compared with like); on a GPU a large copy of at least 1 GiB (METHOD.md: a small one
/// measures launch latency, not bandwidth; B x 3 MiB states up to B ~ 16 still sit in a 60 MiB L2, so the
/// small-B rows can read above 100%).
fn ceiling_bytes(device: bool, state_bytes: usize) -> usize {
    if device {
        state_bytes.max(1 << 30)
    } else {
        state_bytes
    }
}

pub fn state_bytes_per_call(sh: &Shape, dt: Dtypes, b: usize) -> f64 {
    (2 * b * sh.state_len() * dt.state.size()) as f64
}

/// Packed rows of `r` random tokens in `dtype`.
fn random_rows(rng: &mut Synth, layer: &gdn::Layer, r: usize, dtype: DType) -> RowsData {
    let w = rng.batch(layer, 1, r);
    RowsData::from_f32(&w.qkv, &w.alpha, &w.beta, &w.z, [dtype; 4])
}

/// Sequences of `len` tokens laid end to end, one per slot, each committed in full.
fn seqs(slots: &[i32], len: usize) -> Vec<Seq> {
    slots
        .iter()
        .enumerate()
        .map(|(i, &slot)| Seq {
            slot,
            start: i * len,
            len,
            commit: Commit::All,
        })
        .collect()
}

pub fn run(args: Args) -> Result<()> {
    if let Some(lens) = &args.prefill {
        return run_prefill(&args, lens);
    }
    let backend = backends::make(&args.backend)?;
    let device = backends::is_device(&args.backend);
    let (args_batch_given, args_tokens_given) = (args.batch.is_some(), args.tokens.is_some());
    let (mut rng, layer, options) = seed_layer(&args)?;
    let (shape, config) = (*layer.shape(), layer.config);
    let batches = args.batch.unwrap_or_else(|| {
        if device {
            vec![1, 8, 32, 128, 256]
        } else {
            vec![1, 8]
        }
    });
    let tokens = args.tokens.unwrap_or_else(|| {
        if device {
            vec![1, 4, 8]
        } else {
            vec![1, 4, 8, 64]
        }
    });
    let dt = Dtypes {
        state: args.state,
        io: args.io,
    };
    let progress = ProgressBar::new((batches.len() * tokens.len()) as u64);
    progress.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let cuda_rotation = args.backend == "cuda" && args.rotate_mib > 0;
    if device && args.rotate_mib > 0 && !cuda_rotation && args.out_proj.is_none() {
        return Err(gdn::Error::Param {
            name: "rotate-mib",
            why: "rotation is implemented for the CPU and CUDA backends only".into(),
        });
    }
    if let Some(&b) = batches.iter().find(|&&b| b == 0) {
        return Err(gdn::Error::Param {
            name: "batch",
            why: format!("a batch size must be at least 1, got {b}"),
        });
    }
    if let Some(hidden) = args.out_proj {
        progress.finish_and_clear();
        // the cases unless asked otherwise: B 1 and 64, T 1 and 8
        let batches = if args_batch_given {
            batches
        } else {
            vec![1, 64]
        };
        let tokens = if args_tokens_given {
            tokens
        } else {
            vec![1, 8]
        };
        let rotate = if args.rotate_mib > 0 {
            args.rotate_mib as usize
        } else {
            256
        };
        return run_out_proj(
            &args.backend,
            backend.as_ref(),
            &layer,
            hidden,
            &batches,
            &tokens,
            args.round_ms,
            rotate,
        );
    }
    if let Some(windows) = &args.spec {
        progress.finish_and_clear();
        if windows.contains(&0) {
            return Err(gdn::Error::Param {
                name: "spec",
                why: "a window has at least one token".into(),
            });
        }
        if args.backend == "cuda" {
            return run_spec_cuda(
                &layer,
                options,
                args.io,
                &batches,
                windows,
                (args.rotate_mib as usize) << 20,
            );
        }
        return run_spec(
            backend.as_ref(),
            &layer,
            options,
            args.io,
            &batches,
            windows,
            (args.rotate_mib as usize) << 20,
            args.round_ms,
        );
    }
    progress.set_message("FMA ceiling");
    let fma = backend.fma_ceiling()?;
    let rotate_bytes = (args.rotate_mib as usize) << 20;
    let mut rows = Vec::new();
    let mut sets_of_batch = Vec::new();
    for &b in &batches {
        let state_bytes = b * shape.state_len() * args.state.size();
        let sets = rotate_bytes.div_ceil(state_bytes).max(1);
        sets_of_batch.push(format!("B {b}: {sets}"));
        progress.set_message(format!("copy ceiling, B {b}"));
        let ceiling = || {
            if sets > 1 {
                backend.copy_ceiling_rotating(state_bytes, sets)
            } else {
                backend.copy_ceiling(ceiling_bytes(device, state_bytes))
            }
        };
        // on a GPU one ceiling per batch size (a 1 GiB copy, stable); on the CPU, whose shared L3 and memory move
        // with the neighbours from one second to the next, a ceiling right before each case. CUDA with rotation:
        // the 1 GiB copy for the times in cache, the rotating one for the rotated times.
        let per_batch = if cuda_rotation {
            Some(backend.copy_ceiling(ceiling_bytes(device, state_bytes))?)
        } else if device {
            Some(ceiling()?)
        } else {
            None
        };
        let rot_ceiling = if cuda_rotation {
            Some(ceiling()?)
        } else {
            None
        };
        // CUDA times a rotation on the device (graph replays over the sets): its own pool type
        let mut pool = if cuda_rotation {
            CasePool::Cuda(Box::new(crate::backends::cuda()?.create_cuda_pool(
                &layer,
                b * sets,
                options,
            )?))
        } else {
            CasePool::Other(backend.create_pool_with(&layer, b * sets, options)?)
        };
        for s in 0..b {
            let (st, h) = rng.seq_state(&layer);
            for set in 0..sets {
                pool.get().write_slot(set * b + s, &st, &h)?;
            }
        }
        let slot_sets: Vec<Vec<i32>> = (0..sets)
            .map(|set| ((set * b) as i32..((set + 1) * b) as i32).collect())
            .collect();
        for &t in &tokens {
            progress.set_message(format!("B {b} T {t}"));
            let data = random_rows(&mut rng, &layer, b * t, args.io);
            let set_seqs: Vec<Vec<Seq>> = slot_sets.iter().map(|s| seqs(s, t)).collect();
            let steps: Vec<Step> = set_seqs
                .iter()
                .map(|q| Step {
                    rows: data.view(),
                    seqs: q,
                    plane_stride: None,
                })
                .collect();
            let copy = match per_batch {
                Some(c) => c,
                None => ceiling()?,
            };
            let (timing, rotated) = match (&mut pool, rot_ceiling) {
                (CasePool::Cuda(p), Some(rc)) => {
                    let cached = time_case(p, &steps[..1], args.io, args.round_ms)?;
                    let iters = ((args.round_ms as f64 / 1000.0)
                        / cached.per_call.as_secs_f64().max(1e-7))
                    .clamp(1.0, 20000.0) as usize;
                    let rot = p.time_varlen_rotating(&steps, args.io, iters)?;
                    (cached, Some((rot.per_call, rc)))
                }
                (p, _) => (time_case(p.get(), &steps, args.io, args.round_ms)?, None),
            };
            rows.push(Row {
                b,
                t,
                rotated,
                per_call: timing.per_call,
                host_per_call: timing.host_per_call,
                copy_bytes_per_s: copy,
                fma_flops_per_s: fma,
            });
            progress.inc(1);
        }
    }
    let mixed = args.mixed.unwrap_or(if device {
        Mixed { b: 256, t: 64 }
    } else {
        Mixed { b: 8, t: 64 }
    });
    let mixed_times = if mixed.b > 0 {
        progress.set_message(format!("mixed {}:{}", mixed.b, mixed.t));
        Some(time_mixed(
            backend.as_ref(),
            &layer,
            options,
            args.io,
            mixed,
            &mut rng,
            args.round_ms,
        )?)
    } else {
        None
    };
    progress.finish_and_clear();
    let method = timing_method(&mut *backend.create_pool(&layer, 1)?)?;
    print_table(&backend.name(), &config, dt, &rows, &method, device);
    if let Some([one, decode, window]) = mixed_times {
        println!(
            "mixed batch, {} x 1 token + 1 x {} tokens in one call: {:.2} us; the two calls it replaces: {} x 1 token {:.2} us + 1 x {} tokens {:.2} us = {:.2} us",
            mixed.b - 1,
            mixed.t,
            one * 1e6,
            mixed.b - 1,
            decode * 1e6,
            mixed.t,
            window * 1e6,
            (decode + window) * 1e6
        );
    }
    if args.rotate_mib > 0 {
        println!(
            "rotation: each call steps the next of several sets of B slots spanning at least {} MiB of state ({}), and the copy ceiling's pass takes the next of as many buffers",
            args.rotate_mib,
            sets_of_batch.join(", ")
        );
    }
    Ok(())
}

/// The pool of a case: CUDA's own type where a rotation is timed on the device, else the backend's.
enum CasePool {
    Cuda(Box<gdn_cuda::CudaPool>),
    Other(Box<dyn LayerPool>),
}

impl CasePool {
    fn get(&mut self) -> &mut dyn LayerPool {
        match self {
            CasePool::Cuda(p) => p.as_mut(),
            CasePool::Other(p) => p.as_mut(),
        }
    }
}

/// The mixed batch in one call, then its decode sequences alone and its long window alone (seconds per call).
fn time_mixed(
    backend: &dyn gdn::Backend,
    layer: &gdn::Layer,
    options: PoolOptions,
    io: DType,
    m: Mixed,
    rng: &mut Synth,
    round_ms: u64,
) -> Result<[f64; 3]> {
    let mut pool = backend.create_pool_with(layer, m.b, options)?;
    for s in 0..m.b {
        let (st, h) = rng.seq_state(layer);
        pool.write_slot(s, &st, &h)?;
    }
    let data = random_rows(rng, layer, m.b - 1 + m.t, io);
    let decode_slots: Vec<i32> = (0..(m.b - 1) as i32).collect();
    let mut all = seqs(&decode_slots, 1);
    all.push(Seq {
        slot: (m.b - 1) as i32,
        start: m.b - 1,
        len: m.t,
        commit: Commit::All,
    });
    let decode_rows = random_rows(rng, layer, m.b - 1, io);
    let window_rows = random_rows(rng, layer, m.t, io);
    let window = [Seq {
        start: 0,
        ..all[m.b - 1]
    }];
    let cases = [
        Step {
            rows: data.view(),
            seqs: &all,
            plane_stride: None,
        },
        Step {
            rows: decode_rows.view(),
            seqs: &all[..m.b - 1],
            plane_stride: None,
        },
        Step {
            rows: window_rows.view(),
            seqs: &window,
            plane_stride: None,
        },
    ];
    let mut out = [0.0; 3];
    for (o, step) in out.iter_mut().zip(&cases) {
        *o = time_case(pool.as_mut(), std::slice::from_ref(step), io, round_ms)?
            .per_call
            .as_secs_f64();
    }
    Ok(out)
}

/// Median of 5 rounds of about `round_ms` each (at least 3 calls a round), seconds per call of `f`, host clock.
fn host_time(round_ms: u64, f: &mut dyn FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    let mut rounds = Vec::new();
    for _ in 0..5 {
        let t0 = std::time::Instant::now();
        let mut k = 0;
        while k < 3 || t0.elapsed() < Duration::from_millis(round_ms) {
            f()?;
            k += 1;
        }
        rounds.push(t0.elapsed().as_secs_f64() / k as f64);
    }
    rounds.sort_by(f64::total_cmp);
    Ok(rounds[rounds.len() / 2])
}

/// The median of some values (None if there are none).
fn median(v: impl Iterator<Item = f64>) -> Option<f64> {
    let mut v: Vec<f64> = v.collect();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied()
}

/// Seconds per call of one tail case: each out_proj alone and each tail (step + out_proj).
struct Tail {
    planes: f64,
    shift: f64,
    bf16: f64,
    tail_planes: f64,
    tail_shift: f64,
    tail_bf16: f64,
    step: f64,
    step_planes: f64,
    /// Device only: an empty kernel in the same kind of graph, and the weight copies rotated over.
    empty: Option<f64>,
    copies: usize,
    planes_vs_shift: f64,
    /// CPU only: the planes product's time and the read ceiling, measured in turn (five pairs).
    turns: Vec<(f64, f64)>,
}

/// The tail on the CPU backend at `b` sequences of `t` tokens (host clock).
#[allow(clippy::too_many_arguments)]
fn cpu_tail(
    backend: &dyn gdn::Backend,
    layer: &gdn::Layer,
    q: &gdn::quant::QuantWeights,
    bf: &gdn::quant::Bf16Weights,
    b: usize,
    t: usize,
    rng: &mut Synth,
    round_ms: u64,
    rotate_bytes: usize,
) -> Result<Tail> {
    let sh = *layer.shape();
    let (n, rows, hidden) = (sh.n(), b * t, q.rows);
    // copies of the weights spanning `rotate_bytes`, one per call in turn: the weights come from memory, not
    // from the L3 that kept them since the last call (32 MiB here: the 2-bit weights would fit)
    let copies = rotate_bytes.div_ceil(q.bytes()).max(1);
    let bf_copies = rotate_bytes.div_ceil(bf.bytes()).max(1);
    let qs: Vec<gdn::quant::QuantWeights> = (0..copies).map(|_| q.clone()).collect();
    let bfs: Vec<gdn::quant::Bf16Weights> = (0..bf_copies).map(|_| bf.clone()).collect();
    let (mut qi, mut bi) = (0usize, 0usize);
    let mut pool = backend.create_pool(layer, b)?;
    for s in 0..b {
        let (st, h) = rng.seq_state(layer);
        pool.write_slot(s, &st, &h)?;
    }
    let data = random_rows(rng, layer, rows, DType::F32);
    let seq = seqs(&(0..b as i32).collect::<Vec<_>>(), t);
    let lay = gdn::OutputLayout::for_rows(&sh, rows, Some(rows * n))?;
    let mut with = vec![0.0f32; lay.len()];
    let mut plain = vec![0.0f32; rows * n];
    let mut out = vec![0.0f32; rows * hidden];
    let planes_step = Step {
        rows: data.view(),
        seqs: &seq,
        plane_stride: Some(rows * n),
    };
    let plain_step = Step {
        rows: data.view(),
        seqs: &seq,
        plane_stride: None,
    };
    // the same pool steps on and on: a state's values stay bounded (decays below 1), so every call does the
    // same work
    pool.step_varlen(&planes_step, gdn::TensorMut::F32(&mut with))?;
    let mut a = vec![0.0f32; rows * hidden];
    q.product_planes(&with, &lay, &mut a)?;
    q.product_shift(&with[..rows * n], rows, &mut out)?;
    let wide: Vec<f64> = out.iter().map(|&v| v as f64).collect();
    let planes_vs_shift = gdn::relative_error(&a, &wide);
    let p = pool.as_mut();
    let step_planes = host_time(round_ms, &mut || {
        p.step_varlen(&planes_step, gdn::TensorMut::F32(&mut with))
    })?;
    let step = host_time(round_ms, &mut || {
        p.step_varlen(&plain_step, gdn::TensorMut::F32(&mut plain))
    })?;
    let mut nq = || {
        qi += 1;
        &qs[qi % copies]
    };
    let planes = host_time(round_ms, &mut || nq().product_planes(&with, &lay, &mut out))?;
    // the planes product and a read pass over the rotation's footprint in turn: each pair's ratio holds on a
    // host whose speed moves from minute to minute (shared VMs), where the run's one read ceiling does not
    let mut turns = Vec::new();
    for _ in 0..5 {
        let Some(read) = backend.read_ceiling_rotating(rotate_bytes, 1)? else {
            break;
        };
        let t = host_time(round_ms, &mut || nq().product_planes(&with, &lay, &mut out))?;
        turns.push((t, read));
    }
    let shift = host_time(round_ms, &mut || nq().product_shift(&plain, rows, &mut out))?;
    let tail_planes = host_time(round_ms, &mut || {
        p.step_varlen(&planes_step, gdn::TensorMut::F32(&mut with))?;
        nq().product_planes(&with, &lay, &mut out)
    })?;
    let tail_shift = host_time(round_ms, &mut || {
        p.step_varlen(&plain_step, gdn::TensorMut::F32(&mut plain))?;
        nq().product_shift(&plain, rows, &mut out)
    })?;
    let mut nb = || {
        bi += 1;
        &bfs[bi % bf_copies]
    };
    let bf16 = host_time(round_ms, &mut || nb().product(&plain, rows, &mut out))?;
    let tail_bf16 = host_time(round_ms, &mut || {
        p.step_varlen(&plain_step, gdn::TensorMut::F32(&mut plain))?;
        nb().product(&plain, rows, &mut out)
    })?;
    Ok(Tail {
        planes,
        shift,
        bf16,
        tail_planes,
        tail_shift,
        tail_bf16,
        step,
        step_planes,
        empty: None,
        copies,
        planes_vs_shift,
        turns,
    })
}

/// `gdn bench --out-proj`: the quantized out_proj (every packing) and the layer's tail, step + out_proj, three
/// ways: the product that reads the step's planes and group sums, the same product from y with shifts and its
/// own group-sum pass, and a plain bf16 out_proj; at each batch size and window length; bytes moved and their
/// rate against the backend's copy ceiling. CPU and CUDA.
#[allow(clippy::too_many_arguments)]
fn run_out_proj(
    backend_name: &str,
    backend: &dyn gdn::Backend,
    layer: &gdn::Layer,
    hidden: usize,
    batches: &[usize],
    tokens: &[usize],
    round_ms: u64,
    rotate_mib: usize,
) -> Result<()> {
    use gdn::quant::{Bf16Weights, Packing, QuantWeights};
    let sh = *layer.shape();
    let n = sh.n();
    let device = backends::is_device(backend_name);
    let cuda = if backend_name == "cuda" {
        Some(crate::backends::cuda()?)
    } else if device {
        return Err(gdn::Error::Unsupported(format!(
            "--out-proj is benchmarked on the CPU and CUDA backends, not {backend_name}"
        )));
    } else {
        None
    };
    let mut rng = Synth::new(5);
    let w = rng.uniform(hidden * n, -0.02, 0.02);
    let bf = Bf16Weights::new(&w, hidden, n)?;
    let rotate = rotate_mib << 20;
    // one ceiling for the run: a GPU copy of 1 GiB; on the CPU a copy of the rotation's footprint (from memory,
    // as the rotated weights are)
    let ceiling = backend.copy_ceiling(if device { 1 << 30 } else { rotate })?;
    // and, where the backend measures one, a read-only pass over the same footprint: a product reads its weights
    // and writes next to nothing
    let read_ceiling = if device {
        None
    } else {
        backend.read_ceiling_rotating(rotate, 1)?
    };
    println!(
        "the layer's tail on {}: step (seed shape, f32, commit all) + out_proj {n} -> {hidden} (affine groups of 16); copy ceiling {:.0} GB/s{}{}",
        backend.name(),
        ceiling / 1e9,
        read_ceiling.map_or(String::new(), |r| format!(", read ceiling {:.0} GB/s", r / 1e9)),
        if device {
            format!("; each product rotates over copies of its weights spanning {rotate_mib} MiB (weights from memory, not L2); CUDA graphs of calls, events")
        } else {
            format!("; each product rotates over copies of its weights spanning {rotate_mib} MiB (from memory, not L3); host clock, median of 5 rounds")
        }
    );
    let mut products = Vec::new();
    let mut tails = Vec::new();
    for p in Packing::ALL {
        let q = QuantWeights::quantize(&w, hidden, n, p)?;
        for &b in batches {
            for &t in tokens {
                let r = match &cuda {
                    Some(c) => {
                        let x = gdn_cuda::quant::time_tail(c, layer, &q, &bf, b, t, rotate)?;
                        Tail {
                            planes: x.planes,
                            shift: x.shift,
                            bf16: x.bf16,
                            tail_planes: x.tail_planes,
                            tail_shift: x.tail_shift,
                            tail_bf16: x.tail_bf16,
                            step: x.step,
                            step_planes: x.step_planes,
                            empty: Some(x.empty),
                            copies: x.copies,
                            planes_vs_shift: x.planes_vs_shift,
                            turns: Vec::new(),
                        }
                    }
                    None => cpu_tail(backend, layer, &q, &bf, b, t, &mut rng, round_ms, rotate)?,
                };
                let rows = b * t;
                // bytes a product must move: weights, its activations (plane or y, group sums), its output
                let act = 4 * rows * (n + n / 16) + 4 * rows * hidden;
                let q_bytes = (q.bytes() + act) as f64;
                // the step's own bytes; with planes it writes 3 planes and the group sums beside y; the shift
                // path's group-sum pass reads y and writes the sums
                let dt = Dtypes {
                    state: DType::F32,
                    io: DType::F32,
                };
                let step_bytes = bytes_moved(&sh, dt, b, t);
                let planes_extra = (4 * rows * (3 * n + n / 16)) as f64;
                let gsum_pass = (4 * rows * (n + n / 16)) as f64;
                let bf_bytes = (bf.bytes() + 4 * rows * (n + hidden)) as f64;
                products.push((
                    p,
                    b,
                    t,
                    q.bytes(),
                    q.field_bytes(),
                    r.planes,
                    r.shift,
                    r.bf16,
                    r.empty,
                    r.copies,
                    r.planes_vs_shift,
                    median(r.turns.iter().map(|&(t, read)| t * read / q.bytes() as f64)),
                ));
                tails.push((
                    p,
                    b,
                    t,
                    r.step,
                    r.step_planes,
                    r.tail_planes,
                    r.tail_shift,
                    r.tail_bf16,
                    step_bytes + planes_extra + q_bytes,
                    step_bytes + gsum_pass + q_bytes,
                    step_bytes + bf_bytes,
                ));
            }
        }
    }
    println!();
    println!("out_proj alone, us per call (rows = B x T); floor = bytes to read / copy ceiling; read floor = bytes to read / read ceiling (\"-\" where the backend measures none); in turn = the median of five pairs of a planes product and a read ceiling measured one after the other");
    println!();
    println!("| packing | rows | weight MB (fields + scales) | planes us | shift + group sums us | planes / shift | bf16 us ({:.1} MB) | floor us | planes / floor | read floor us | planes / read floor | planes / read floor, in turn | bf16 / its read floor | fields-only floor us | empty kernel us | planes vs shift rel. diff |", bf.bytes() as f64 / 1e6);
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for &(p, b, t, bytes, fields, planes, shift, bf16, empty, _copies, diff, turn) in &products {
        let floor = bytes as f64 / ceiling;
        let read = |x: Option<f64>| x.map_or("-".into(), |v| format!("{v:.2}"));
        let read_floor = read_ceiling.map(|r| bytes as f64 / r);
        println!(
            "| {} | {} | {:.1} ({:.1} + {:.1}) | {:.1} | {:.1} | {:.2} | {:.1} | {:.1} | {:.2} | {} | {} | {} | {} | {:.1} | {} | {:.1e} |",
            p.name(),
            b * t,
            bytes as f64 / 1e6,
            fields as f64 / 1e6,
            (bytes - fields) as f64 / 1e6,
            planes * 1e6,
            shift * 1e6,
            planes / shift,
            bf16 * 1e6,
            floor * 1e6,
            planes / floor,
            read_floor.map_or("-".into(), |f| format!("{:.1}", f * 1e6)),
            read(read_floor.map(|f| planes / f)),
            read(turn),
            read(read_ceiling.map(|r| bf16 / (bf.bytes() as f64 / r))),
            fields as f64 / ceiling * 1e6,
            empty.map_or("-".into(), |e| format!("{:.2}", e * 1e6)),
            diff,
        );
    }
    println!();
    println!("the tail, step + out_proj, us per call; MB moved by the planes tail (step incl. its planes, weights, activations) and its rate over the copy ceiling");
    println!();
    println!("| packing | B | T | step us (with planes) | step + planes out_proj us | step + shift + group sums us | step + bf16 out_proj us | planes / shift | planes / bf16 | MB moved (planes, shift, bf16) | % copy (planes, shift, bf16) |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for &(p, b, t, step, step_planes, tp, ts, tb, bp, bs, bb) in &tails {
        println!(
            "| {} | {b} | {t} | {:.1} ({:.1}) | {:.1} | {:.1} | {:.1} | {:.2} | {:.2} | {:.1}, {:.1}, {:.1} | {:.0}%, {:.0}%, {:.0}% |",
            p.name(),
            step * 1e6,
            step_planes * 1e6,
            tp * 1e6,
            ts * 1e6,
            tb * 1e6,
            tp / ts,
            tp / tb,
            bp / 1e6,
            bs / 1e6,
            bb / 1e6,
            100.0 * bp / tp / ceiling,
            100.0 * bs / ts / ceiling,
            100.0 * bb / tb / ceiling,
        );
    }
    println!();
    println!("copy ceiling: {}; % copy = bytes moved / time / ceiling (bytes count each tensor read or written once)", if device { "a device copy of 1 GiB, read + write bytes" } else { "one in-place read-modify-write pass over the rotation's footprint, read + write bytes" });
    if let Some((.., copies, _)) = products.first() {
        println!("weights rotated over (first packing): {copies} copies");
    }
    Ok(())
}

/// `gdn bench --spec`: seconds per speculative step, the one-pass step (None where the backend has none) and the
/// two-pass flow, for each batch and window; printed as a table.
#[allow(clippy::too_many_arguments)]
fn run_spec(
    backend: &dyn gdn::Backend,
    layer: &gdn::Layer,
    options: PoolOptions,
    io: DType,
    batches: &[usize],
    windows: &[usize],
    rotate_bytes: usize,
    round_ms: u64,
) -> Result<()> {
    let sh = *layer.shape();
    let mut rng = Synth::new(77);
    println!("speculative loop on {} (state {}, io {}), seconds per speculative step (one call: verify W tokens per sequence, accept a random prefix of the last window)", backend.name(), options.state.name(), io.name());
    if !backend.name().starts_with("cpu") {
        println!("host clock around whole host-slice calls (uploads and downloads included)");
    }
    println!();
    println!("| B | W | slot sets | one-pass step_spec us | two-pass flow us | speed-up | state GB/s (one pass: 1 read + 1 write) |");
    println!("|---|---|---|---|---|---|---|");
    for &b in batches {
        let state_bytes = b * sh.state_len() * options.state.size();
        let sets = rotate_bytes.div_ceil(state_bytes).max(1);
        for &w in windows {
            let data = random_rows(&mut rng, layer, b * w, io);
            let set_seqs: Vec<Vec<Seq>> = (0..sets)
                .map(|set| {
                    (0..b)
                        .map(|i| Seq {
                            slot: (set * b + i) as i32,
                            start: i * w,
                            len: w,
                            commit: Commit::Verify,
                        })
                        .collect()
                })
                .collect();
            // acceptance patterns, the same for both flows
            let patterns: Vec<Vec<usize>> = (0..16)
                .map(|_| {
                    rng.uniform(b, 0.0, (w + 1) as f32)
                        .iter()
                        .map(|&x| (x as usize).min(w))
                        .collect()
                })
                .collect();
            let mut time_flow = |pool: &mut dyn LayerPool| -> Result<Option<f64>> {
                for s in 0..b * sets {
                    let (st, h) = rng.seq_state(layer);
                    pool.write_slot(s, &st, &h)?;
                }
                let mut out = vec![0.0f32; b * w * sh.n()];
                let mut call = 0usize;
                let mut one = |pool: &mut dyn LayerPool, call: usize| -> Result<()> {
                    let set = call % sets;
                    let seqs = &set_seqs[set];
                    let accept: Vec<usize> = seqs
                        .iter()
                        .zip(&patterns[(call / sets) % patterns.len()])
                        .map(|(q, &a)| a.min(pool.held(q.slot as usize)))
                        .collect();
                    let step = Step {
                        rows: data.view(),
                        seqs,
                        plane_stride: None,
                    };
                    pool.step_spec(&step, &accept, gdn::TensorMut::F32(&mut out))
                };
                match one(pool, call) {
                    Err(gdn::Error::Unsupported(_)) => return Ok(None),
                    r => r?,
                }
                call += 1;
                while call < 2 * sets {
                    one(pool, call)?;
                    call += 1;
                }
                let mut rounds = Vec::new();
                for _ in 0..5 {
                    let t0 = std::time::Instant::now();
                    let mut n = 0usize;
                    while n < sets || t0.elapsed() < Duration::from_millis(round_ms) {
                        one(pool, call)?;
                        call += 1;
                        n += 1;
                    }
                    rounds.push(t0.elapsed().as_secs_f64() / n as f64);
                }
                rounds.sort_by(f64::total_cmp);
                Ok(Some(rounds[rounds.len() / 2]))
            };
            let mut native = backend.create_pool_with(layer, b * sets, options)?;
            let one_pass = time_flow(native.as_mut())?;
            drop(native);
            let mut flow =
                gdn::spec::TwoPass::new(backend.create_pool_with(layer, b * sets, options)?);
            let two_pass = time_flow(&mut flow)?.unwrap_or(f64::NAN);
            let fmt = |x: Option<f64>| x.map_or("-".to_string(), |v| format!("{:.1}", v * 1e6));
            let gbs = one_pass.map_or("-".to_string(), |v| {
                format!("{:.1}", 2.0 * state_bytes as f64 / v / 1e9)
            });
            println!(
                "| {b} | {w} | {sets} | {} | {:.1} | {} | {gbs} |",
                fmt(one_pass),
                two_pass * 1e6,
                one_pass.map_or("-".to_string(), |v| format!("{:.2}x", two_pass / v)),
            );
        }
    }
    Ok(())
}

/// `gdn bench --backend cuda --spec`: device time per speculative step, the kernels alone as `time_varlen`
/// times a step (CUDA graphs of 20 calls replayed, events, median): the one-pass kernel (each slot holds a
/// window of W and accepts a random prefix of it, then holds the next) beside the two-pass flow's k-token commit
/// and verify kernels. With --rotate-mib the calls rotate among slot sets (states from memory).
fn run_spec_cuda(
    layer: &gdn::Layer,
    options: PoolOptions,
    io: DType,
    batches: &[usize],
    windows: &[usize],
    rotate_bytes: usize,
) -> Result<()> {
    let sh = *layer.shape();
    let cuda = gdn_cuda::Cuda::new()?;
    let mut rng = Synth::new(77);
    let ceiling = gdn::Backend::copy_ceiling(&cuda, 256 * sh.state_len() * options.state.size())?;
    println!(
        "speculative step on cuda (state {} {}, io {}): device us per speculative step, CUDA graphs of 20 calls replayed, events, median; copy ceiling {:.2} TB/s",
        options.state.name(),
        options.layout.name(),
        io.name(),
        ceiling / 1e12
    );
    println!();
    println!("| B | W | slot sets | mean accepted | one-pass us | verify us | commit k us | two-pass us | speed-up | one-pass state bytes / ceiling |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for &b in batches {
        let state_bytes = b * sh.state_len() * options.state.size();
        let sets = rotate_bytes.div_ceil(state_bytes).max(1);
        let mut one = cuda.create_cuda_pool(layer, b * sets, options)?;
        let mut two = cuda.create_cuda_pool(layer, b * sets, options)?;
        for s in 0..b * sets {
            let (st, h) = rng.seq_state(layer);
            one.write_slot(s, &st, &h)?;
            two.write_slot(s, &st, &h)?;
        }
        for &w in windows {
            let data = random_rows(&mut rng, layer, b * w, io);
            let seqs_of = |commit: &dyn Fn(usize) -> Option<Commit>| -> Vec<Vec<Seq>> {
                (0..sets)
                    .map(|set| {
                        (0..b)
                            .filter_map(|i| {
                                commit(i).map(|c| Seq {
                                    slot: (set * b + i) as i32,
                                    start: i * w,
                                    len: w,
                                    commit: c,
                                })
                            })
                            .collect()
                    })
                    .collect()
            };
            let verify = seqs_of(&|_| Some(Commit::Verify));
            let accept: Vec<usize> = rng
                .uniform(b, 0.0, (w + 1) as f32)
                .iter()
                .map(|&x| (x as usize).min(w))
                .collect();
            let commit = seqs_of(&|i| (accept[i] > 0).then_some(Commit::First(accept[i])));
            // every slot holds a window of W (whatever it held before dropped), then the timed calls accept
            for s in 0..b * sets {
                one.commit_held(s, 0)?;
            }
            let mut out = gdn::TensorData::filled(b * w * sh.n(), 0.0, io);
            for st in spec_steps(&data, &verify) {
                one.step_spec(&st, &vec![0; b], out.view_mut())?;
            }
            let t1 = one
                .time_spec_rotating(&spec_steps(&data, &verify), &accept, io, 20)?
                .per_call
                .as_secs_f64();
            let tc = if commit[0].is_empty() {
                0.0
            } else {
                two.time_varlen_rotating(&spec_steps(&data, &commit), io, 20)?
                    .per_call
                    .as_secs_f64()
            };
            let tv = two
                .time_varlen_rotating(&spec_steps(&data, &verify), io, 20)?
                .per_call
                .as_secs_f64();
            let mean = accept.iter().sum::<usize>() as f64 / b as f64;
            println!(
                "| {b} | {w} | {sets} | {mean:.2} | {:.1} | {:.1} | {:.1} | {:.1} | {:.2}x | {:.1}% |",
                t1 * 1e6,
                tv * 1e6,
                tc * 1e6,
                (tv + tc) * 1e6,
                (tv + tc) / t1,
                100.0 * 2.0 * state_bytes as f64 / t1 / ceiling
            );
        }
    }
    Ok(())
}

/// One step over `data` per entry of `seqs`.
fn spec_steps<'a>(data: &'a RowsData, seqs: &'a [Vec<Seq>]) -> Vec<Step<'a>> {
    seqs.iter()
        .map(|q| Step {
            rows: data.view(),
            seqs: q,
            plane_stride: None,
        })
        .collect()
}

fn timing_method(pool: &mut dyn LayerPool) -> Result<String> {
    let mut rng = Synth::new(1);
    let batch = rng.batch(pool.layer(), 1, 1);
    let t = pool.time_step(
        &StepArgs {
            batch: batch.view(),
            slots: &[0],
            commit: Commit::All,
            plane_stride: None,
        },
        1,
    )?;
    Ok(t.method)
}

/// Times a case with enough calls per round to last about `round_ms`: the backend's own way for one set of
/// slots, by the host clock over the sets in turn for several (CPU only).
fn time_case(
    pool: &mut dyn LayerPool,
    steps: &[Step<'_>],
    out: DType,
    round_ms: u64,
) -> Result<gdn::StepTiming> {
    let probe = pool.time_varlen(&steps[0], out, 1)?;
    let per = probe.per_call.as_secs_f64().max(1e-7);
    let iters = ((round_ms as f64 / 1000.0) / per).clamp(1.0, 20000.0) as usize;
    if steps.len() == 1 {
        return pool.time_varlen(&steps[0], out, iters);
    }
    gdn::backend::time_steps_host(pool, steps, out, iters)
}

pub fn print_table(
    backend: &str,
    config: &Config,
    dt: Dtypes,
    rows: &[Row],
    method: &str,
    device: bool,
) {
    let sh = config.shape;
    println!(
        "gdn bench: {backend}; d {} h_k {} h_v {}, {} map, {} gate, commit all; {} state, {} activations; timing: {method}",
        sh.d,
        sh.h_k,
        sh.h_v,
        config.head_map.name(),
        config.gate.name(),
        dt.state.name(),
        dt.io.name()
    );
    println!(
        "{:>4} {:>3} {:>11} {:>12} {:>11} {:>10} {:>7} {:>9} {:>8} {:>6} {:>10}",
        "B",
        "T",
        "us/call",
        "tokens/s",
        "state GB/s",
        "copy GB/s",
        "% copy",
        "MB moved",
        "GFLOP/s",
        "% FMA",
        "host us"
    );
    for r in rows {
        let secs = r.per_call.as_secs_f64();
        let state_bw = state_bytes_per_call(&sh, dt, r.b) / secs;
        let flop_rate = flops(&sh, r.b, r.t) / secs;
        println!(
            "{:>4} {:>3} {:>11.2} {:>12.0} {:>11.1} {:>10.1} {:>6.1}% {:>9.2} {:>8.1} {:>6} {:>10}",
            r.b,
            r.t,
            secs * 1e6,
            (r.b * r.t) as f64 / secs,
            state_bw / 1e9,
            r.copy_bytes_per_s / 1e9,
            100.0 * state_bw / r.copy_bytes_per_s,
            bytes_moved(&sh, dt, r.b, r.t) / 1e6,
            flop_rate / 1e9,
            r.fma_flops_per_s.map_or_else(
                || "-".to_string(),
                |c| format!("{:.1}%", 100.0 * flop_rate / c)
            ),
            r.host_per_call.map_or_else(
                || "-".to_string(),
                |h| format!("{:.2}", h.as_secs_f64() * 1e6)
            ),
        );
    }
    if rows.iter().any(|r| r.rotated.is_some()) {
        // the rotated time first after B and T: a parser of the rows above then reads it from these
        println!("rotated (every call's state from memory; graph replays over the slot sets):");
        println!(
            "{:>4} {:>3} {:>11} {:>11} {:>11} {:>10} {:>7} {:>11}",
            "B",
            "T",
            "rotated us",
            "in cache us",
            "state GB/s",
            "copy GB/s",
            "% copy",
            "rot / cache"
        );
        for r in rows {
            if let Some((rot, rc)) = r.rotated {
                let secs = rot.as_secs_f64();
                let state_bw = state_bytes_per_call(&sh, dt, r.b) / secs;
                println!(
                    "{:>4} {:>3} {:>11.2} {:>11.2} {:>11.1} {:>10.1} {:>6.1}% {:>11.2}",
                    r.b,
                    r.t,
                    secs * 1e6,
                    r.per_call.as_secs_f64() * 1e6,
                    state_bw / 1e9,
                    rc / 1e9,
                    100.0 * state_bw / rc,
                    secs / r.per_call.as_secs_f64()
                );
            }
        }
        println!("the rotated ceiling: one state-sized device copy per call, rotating over as many buffer pairs as slot sets, in a CUDA graph");
    }
    println!(
        "state GB/s counts one read and one write of S per call; % copy is that over a copy ceiling measured in this run: {}",
        if device {
            "a device copy of a 1 GiB footprint (or the state's, if larger; capped at the largest buffer the device allows)"
        } else {
            "one in-place read-modify-write pass over a buffer of the state's size, all threads, with the step's software prefetch, right before each case"
        }
    );
    if let Some(c) = rows.first().and_then(|r| r.fma_flops_per_s) {
        println!(
            "GFLOP/s counts 7 d^2 FLOP per value head and token (S^T k, the decay and rank-1 update, S^T q); % FMA is that over an FMA ceiling measured in this run: {:.1} GFLOP/s, all threads issuing independent FMAs and nothing else",
            c / 1e9
        );
    }
}

/// Best and worst of 3 rounds of one case, each of enough calls to last about `round_ms` (at least one).
fn prefill_rounds(
    pool: &mut dyn LayerPool,
    step: &Step<'_>,
    io: DType,
    round_ms: u64,
) -> Result<(f64, f64)> {
    let probe = pool
        .time_varlen(step, io, 1)?
        .per_call
        .as_secs_f64()
        .max(1e-7);
    let iters = ((round_ms as f64 / 1000.0) / probe).clamp(1.0, 1000.0) as usize;
    let mut times = Vec::new();
    for _ in 0..3 {
        times.push(pool.time_varlen(step, io, iters)?.per_call.as_secs_f64());
    }
    let best = times.iter().copied().fold(f64::INFINITY, f64::min);
    let worst = times.iter().copied().fold(0.0, f64::max);
    Ok((best, worst))
}

/// The layer every timing runs (the seed's shape with the arguments' head map and gate, seeded weights), the
/// generator that made it (for states and rows), and the arguments' pool options.
fn seed_layer(args: &Args) -> Result<(Synth, gdn::Layer, PoolOptions)> {
    let config = Config {
        shape: Shape::SEED,
        head_map: args.head_map,
        gate: args.gate,
        eps: 1e-6,
    };
    let mut rng = Synth::new(2026);
    let layer = rng.layer(config)?;
    let options = PoolOptions {
        state: args.state,
        layout: args.layout,
    };
    Ok((rng, layer, options))
}

/// `gdn bench --prefill`: one window of T tokens per call at the seed's shape, on the backend's own path (its
/// crossover to chunks where it has one; the CPU runs every window token after token), beside the FMA ceiling.
fn run_prefill(args: &Args, lens: &[usize]) -> Result<()> {
    if let Some(&t) = lens.iter().find(|&&t| t == 0) {
        return Err(gdn::Error::Param {
            name: "prefill",
            why: format!("a window has at least 1 token, got {t}"),
        });
    }
    let backend = backends::make(&args.backend)?;
    let (mut rng, layer, options) = seed_layer(args)?;
    let (shape, config) = (*layer.shape(), layer.config);
    let fma = backend.fma_ceiling()?;
    let (st, h) = rng.seq_state(&layer);
    let mut pool = backend.create_pool_with(&layer, 1, options)?;
    pool.write_slot(0, &st, &h)?;
    println!(
        "gdn bench --prefill: {}; d {} h_k {} h_v {}, {} map, {} gate, one window per call, commit all; {} state, {} activations",
        backend.name(),
        shape.d,
        shape.h_k,
        shape.h_v,
        config.head_map.name(),
        config.gate.name(),
        args.state.name(),
        args.io.name(),
    );
    println!(
        "{:>6} {:>11} {:>7} {:>11} {:>8} {:>6}",
        "T", "ms/call", "spread", "tokens/s", "GFLOP/s", "% FMA"
    );
    for &t in lens {
        let data = random_rows(&mut rng, &layer, t, args.io);
        let seqs = [Seq {
            slot: 0,
            start: 0,
            len: t,
            commit: Commit::All,
        }];
        let step = Step {
            rows: data.view(),
            seqs: &seqs,
            plane_stride: None,
        };
        let (best, worst) = prefill_rounds(pool.as_mut(), &step, args.io, args.round_ms)?;
        let rate = flops(&shape, 1, t) / best;
        println!(
            "{:>6} {:>11.3} {:>6.1}% {:>11.0} {:>8.1} {:>6}",
            t,
            best * 1e3,
            100.0 * (worst / best - 1.0),
            t as f64 / best,
            rate / 1e9,
            fma.map_or_else(|| "-".to_string(), |c| format!("{:.1}%", 100.0 * rate / c)),
        );
    }
    println!(
        "ms/call: the best of 3 rounds (median call of each round); spread: the worst round over the best. GFLOP/s counts 7 d^2 FLOP per value head and token as `gdn bench` does"
    );
    if let Some(c) = fma {
        println!(
            "% FMA is over an FMA ceiling measured in this run: {:.1} GFLOP/s, all threads issuing independent FMAs",
            c / 1e9
        );
    }
    Ok(())
}
