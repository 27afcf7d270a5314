//! `gdn demo`: a random layer at the seed's shape and several sequences, as an engine's batch holds them:
//! prompts of different lengths in one varlen call, then speculative decoding where every sequence drafts its
//! own number of tokens and accepts its own prefix (one verify call and one commit call per round for the whole
//! batch), every output checked against the float64 oracle as it goes.

use std::time::{Duration, Instant};

use gdn::oracle::{self, SeqState};
use gdn::synth::Synth;
use gdn::{
    relative_error, Commit, Config, DType, Error, Gate, HeadMap, Result, RowsData, Seq, Shape,
    Step, TensorData,
};

use crate::backends;

#[derive(clap::Args)]
pub struct Args {
    /// The backend: cpu, cuda or wgpu (those this build has).
    #[arg(long, default_value = "cpu", value_parser = crate::backends::names())]
    backend: String,
    /// Sequences in the batch.
    #[arg(long, default_value_t = 3)]
    seqs: usize,
    /// Longest prompt (sequence s gets a prompt of about (s + 1) / seqs of it).
    #[arg(long, default_value_t = 64)]
    prompt: usize,
    /// Speculative rounds.
    #[arg(long, default_value_t = 24)]
    rounds: usize,
    /// Longest draft window (each sequence drafts 1 to this many tokens a round).
    #[arg(long, default_value_t = 4)]
    window: usize,
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Also show the layer's tail: a decode step with planes and the out_proj (6144 -> 5120) over quantized
    /// weights reading them, 2-bit (eight to a u16) or 8-bit (four to a u32 and two to a u16), checked and timed.
    #[arg(long, value_parser = ["2bit", "8bit"])]
    out_proj: Option<String>,
}

/// The backend as a quantized out_proj runs on it.
fn quant_backend(name: &str) -> Result<Box<dyn gdn::quant::QuantBackend>> {
    Ok(match name {
        "cpu" => Box::new(gdn::Cpu::new()),
        "cuda" => Box::new(crate::backends::cuda()?),
        "wgpu" => Box::new(gdn_wgpu::Wgpu::new()?),
        other => {
            return Err(Error::Unavailable(format!(
                "no quantized out_proj on '{other}'"
            )))
        }
    })
}

/// The tail: every sequence's next token through the step with planes (verify: the states stay as they are),
/// then the out_proj over quantized weights from the planes and group sums; checked against the dequantized
/// weights' product in float64 and against the shift path, and timed beside it.
fn show_tail(
    backend: &str,
    pool: &mut dyn gdn::LayerPool,
    rng: &mut Synth,
    bits: &str,
) -> Result<()> {
    use gdn::quant::{Packing, QuantWeights};
    let qb = quant_backend(backend)?;
    let layer = pool.layer().clone();
    let sh = *layer.shape();
    let (n, b, hidden) = (sh.n(), pool.slots(), 5120);
    let (rows, seqs) = windows(rng, &layer, &vec![1; b], &vec![Commit::Verify; b]);
    let stride = b * n;
    let layout = gdn::OutputLayout::for_rows(&sh, b, Some(stride))?;
    let step = Step {
        rows: rows.view(),
        seqs: &seqs,
        plane_stride: Some(stride),
    };
    let mut buf = TensorData::filled(layout.len(), 0.0, DType::F32);
    pool.step_varlen(&step, buf.view_mut())?;
    let out_buf = buf.to_f32();
    let y = &out_buf[..b * n];
    let w = rng.uniform(hidden * n, -0.02, 0.02);
    let packings: &[Packing] = if bits == "2bit" {
        &[Packing::Q2U16]
    } else {
        &[Packing::Q8U32, Packing::Q8U16]
    };
    let time = |f: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
        f()?;
        let t0 = Instant::now();
        let k = 10;
        for _ in 0..k {
            f()?;
        }
        Ok(t0.elapsed().as_secs_f64() / k as f64)
    };
    println!(
        "the tail: a decode step of {b} sequences with planes, then out_proj {n} -> {hidden} over quantized weights (affine groups of 16) reading the planes and group sums"
    );
    for &p in packings {
        let q = QuantWeights::quantize(&w, hidden, n, p)?;
        let dq = q.dequantized();
        let want: Vec<f64> = (0..b)
            .flat_map(|r| {
                let (y, dq) = (&y, &dq);
                (0..hidden).map(move |o| {
                    (0..n)
                        .map(|m| dq[o * n + m] * y[r * n + m] as f64)
                        .sum::<f64>()
                })
            })
            .collect();
        let mut prod = qb.load_out_proj(&q)?;
        let mut a = vec![0.0f32; b * hidden];
        let mut c = vec![0.0f32; b * hidden];
        prod.product_planes(&out_buf, &layout, &mut a)?;
        prod.product_shift(y, b, &mut c)?;
        let e_planes = relative_error(&a, &want);
        let e_shift = relative_error(&c, &want);
        if e_planes >= 1e-5 || e_shift >= 1e-5 {
            return Err(Error::Backend(format!(
                "out_proj ({}): relative error planes {e_planes:.2e}, shift {e_shift:.2e} against float64",
                p.name()
            )));
        }
        let wide: Vec<f64> = c.iter().map(|&v| v as f64).collect();
        let e_ps = relative_error(&a, &wide);
        let t_step = time(&mut || pool.step_varlen(&step, buf.view_mut()))?;
        let t_planes = time(&mut || prod.product_planes(&out_buf, &layout, &mut a))?;
        let t_shift = time(&mut || prod.product_shift(y, b, &mut c))?;
        println!(
            "  {}: {:.1} MB of weights; out against the dequantized weights' product in float64: planes {e_planes:.1e}, shift path {e_shift:.1e}, planes against shift {e_ps:.1e}; step {:.1} us + out_proj {:.1} us (planes) or {:.1} us (shifts + group-sum pass), host clock, host slices in and out",
            p.name(),
            q.bytes() as f64 / 1e6,
            t_step * 1e6,
            t_planes * 1e6,
            t_shift * 1e6
        );
    }
    Ok(())
}

/// Random packed rows for windows of these lengths, and their sequences (slot s, rows end to end).
fn windows(
    rng: &mut Synth,
    layer: &gdn::Layer,
    lens: &[usize],
    commits: &[Commit],
) -> (RowsData, Vec<Seq>) {
    let total: usize = lens.iter().sum();
    let w = rng.batch(layer, 1, total);
    let rows = RowsData::from_f32(&w.qkv, &w.alpha, &w.beta, &w.z, [DType::F32; 4]);
    let mut start = 0;
    let seqs = lens
        .iter()
        .zip(commits)
        .enumerate()
        .map(|(s, (&len, &commit))| {
            let q = Seq {
                slot: s as i32,
                start,
                len,
                commit,
            };
            start += len;
            q
        })
        .collect();
    (rows, seqs)
}

pub fn run(args: Args) -> Result<()> {
    let backend = backends::make(&args.backend)?;
    if args.seqs == 0 || args.prompt == 0 || args.window == 0 {
        return Err(Error::Param {
            name: "demo",
            why: "--seqs, --prompt and --window must be at least 1".into(),
        });
    }
    let shape = Shape::SEED;
    let config = Config {
        shape,
        head_map: HeadMap::Grouped,
        gate: Gate::Silu,
        eps: 1e-6,
    };
    let mut rng = Synth::new(args.seed);
    let layer = rng.layer(config)?;
    println!("gdn demo on {}", backend.name());
    println!(
        "layer: d {} h_k {} h_v {} (Qwen3.5-27B's GDN shape), grouped heads, silu gate; state {:.1} MiB per sequence; {} sequences",
        shape.d,
        shape.h_k,
        shape.h_v,
        (shape.state_len() * 4) as f64 / (1 << 20) as f64,
        args.seqs
    );
    let b = args.seqs;
    let mut pool = backend.create_pool(&layer, b)?;
    let mut reference = vec![SeqState::zeros(&layer); b];
    let n = shape.n();
    let mut worst: f64 = 0.0;
    let mut check = |what: &str, got: &TensorData, want: &[f64]| -> Result<f64> {
        let e = relative_error(&got.to_f32(), want);
        worst = worst.max(e);
        if e >= 1e-4 || e.is_nan() {
            return Err(Error::Backend(format!(
                "{what}: relative error {e:.2e} against the oracle"
            )));
        }
        Ok(e)
    };
    let call = |pool: &mut dyn gdn::LayerPool,
                reference: &mut [SeqState],
                rows: &RowsData,
                seqs: &[Seq]|
     -> Result<(TensorData, Vec<f64>, Duration)> {
        let total: usize = seqs.iter().map(|s| s.len).sum();
        let step = Step {
            rows: rows.view(),
            seqs,
            plane_stride: None,
        };
        let mut y = TensorData::filled(total * n, 0.0, DType::F32);
        let t0 = Instant::now();
        pool.step_varlen(&step, y.view_mut())?;
        let took = t0.elapsed();
        let want = oracle::step_varlen(&layer, reference, &step, DType::F32, DType::F32)?;
        Ok((y, want, took))
    };

    // the prompts, all in one varlen call, committed
    let lens: Vec<usize> = (0..b)
        .map(|s| (args.prompt * (s + 1)).div_ceil(b))
        .collect();
    let (rows, seqs) = windows(&mut rng, &layer, &lens, &vec![Commit::All; b]);
    let prompts = (rows.clone(), seqs.clone());
    let (y, want, took) = call(pool.as_mut(), &mut reference, &rows, &seqs)?;
    let e = check("prompts", &y, &want)?;
    let total: usize = lens.iter().sum();
    println!(
        "prompts of {lens:?} tokens in one call: {:.2} ms ({:.0} tokens/s), y relative error {e:.1e}",
        took.as_secs_f64() * 1e3,
        total as f64 / took.as_secs_f64()
    );

    // speculative decoding: every sequence drafts its own window; one call verifies them all, one commits each
    // sequence's accepted prefix
    let (mut verify_time, mut commit_time) = (Duration::ZERO, Duration::ZERO);
    let mut accepted_total = 0;
    // each round's windows, verify outputs and acceptances, for the one-pass run below
    let mut record: Vec<(RowsData, Vec<Seq>, TensorData, Vec<usize>)> = Vec::new();
    for round in 0..args.rounds {
        let drafts: Vec<usize> = (0..b).map(|_| rng.index(1, args.window)).collect();
        let (rows, mut seqs) = windows(&mut rng, &layer, &drafts, &vec![Commit::Verify; b]);
        let mut scratch = reference.clone();
        let (y, want, took) = call(pool.as_mut(), &mut scratch, &rows, &seqs)?;
        verify_time += took;
        let e_verify = check("verify", &y, &want)?;
        let accepted: Vec<usize> = drafts.iter().map(|&d| rng.index(1, d)).collect();
        record.push((rows.clone(), seqs.clone(), y.clone(), accepted.clone()));
        for (q, &k) in seqs.iter_mut().zip(&accepted) {
            q.commit = Commit::First(k);
        }
        let (y, want, took) = call(pool.as_mut(), &mut reference, &rows, &seqs)?;
        commit_time += took;
        let e_commit = check("commit", &y, &want)?;
        accepted_total += accepted.iter().sum::<usize>();
        if round < 4 || round + 1 == args.rounds {
            println!(
                "round {:>2}: verified drafts of {drafts:?} tokens in one call (error {e_verify:.1e}), accepted {accepted:?}, committed in one call (error {e_commit:.1e})",
                round + 1
            );
        } else if round == 4 {
            println!("...");
        }
    }
    let sh = layer.shape();
    let (mut e_s, mut e_h) = (0.0f64, 0.0f64);
    for (slot, want) in reference.iter().enumerate() {
        let mut s = vec![0.0; sh.state_len()];
        let mut h = vec![0.0; sh.hist_len()];
        pool.read_slot(slot, &mut s, &mut h)?;
        e_s = e_s.max(relative_error(&s, &want.s));
        e_h = e_h.max(relative_error(&h, &want.h));
    }
    worst = worst.max(e_s).max(e_h);
    let rounds = args.rounds as f64;
    println!(
        "{} rounds, {} tokens accepted over {b} sequences ({:.2} per sequence and round); verify {:.1} us, commit {:.1} us per round; {:.0} accepted tokens/s",
        args.rounds,
        accepted_total,
        accepted_total as f64 / rounds / b as f64,
        verify_time.as_secs_f64() * 1e6 / rounds,
        commit_time.as_secs_f64() * 1e6 / rounds,
        accepted_total as f64 / (verify_time + commit_time).as_secs_f64()
    );
    println!(
        "final states against the oracle: S {e_s:.1e}, history {e_h:.1e}; worst error seen {worst:.1e} (bound 1e-4): agreement OK"
    );

    // the same rounds again, timed alone (no oracle between the calls), two ways: the seed's two-pass flow
    // (verify, then commit the accepted prefix) and one state pass per round (`step_spec`: each call verifies the
    // new drafts, held, and first keeps the accepted prefix of the last round's; `commit_held` keeps the last)
    let mut run_flow = |one: &mut dyn gdn::LayerPool| -> Result<Duration> {
        let (rows, seqs) = &prompts;
        let mut y = TensorData::filled(rows.view().count(sh)? * n, 0.0, DType::F32);
        let step = Step {
            rows: rows.view(),
            seqs,
            plane_stride: None,
        };
        one.step_varlen(&step, y.view_mut())?;
        let mut took = Duration::ZERO;
        let mut prev: Vec<usize> = vec![0; b];
        for (rows, seqs, y_two, accepted) in &record {
            let mut y = TensorData::filled(y_two.len(), 0.0, DType::F32);
            let verify: Vec<Seq> = seqs
                .iter()
                .map(|q| Seq {
                    commit: Commit::Verify,
                    ..*q
                })
                .collect();
            let step = Step {
                rows: rows.view(),
                seqs: &verify,
                plane_stride: None,
            };
            let t0 = Instant::now();
            one.step_spec(&step, &prev, y.view_mut())?;
            took += t0.elapsed();
            let bits = |t: &TensorData| t.to_f32().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            if bits(&y) != bits(y_two) {
                return Err(Error::Backend(
                    "a speculative flow's outputs differ from the first run's".into(),
                ));
            }
            prev.clone_from(accepted);
        }
        for (slot, &k) in prev.iter().enumerate() {
            one.commit_held(slot, k)?;
        }
        for slot in 0..b {
            let (mut s1, mut h1) = (vec![0.0; sh.state_len()], vec![0.0; sh.hist_len()]);
            let (mut s2, mut h2) = (vec![0.0; sh.state_len()], vec![0.0; sh.hist_len()]);
            pool.read_slot(slot, &mut s1, &mut h1)?;
            one.read_slot(slot, &mut s2, &mut h2)?;
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            if bits(&s1) != bits(&s2) || bits(&h1) != bits(&h2) {
                return Err(Error::Backend(format!(
                    "slot {slot}: a speculative flow's state differs"
                )));
            }
        }
        Ok(took)
    };
    let mut two = gdn::spec::TwoPass::new(backend.create_pool(&layer, b)?);
    let two_time = run_flow(&mut two)?;
    let mut one = backend.create_pool(&layer, b)?;
    match run_flow(one.as_mut()) {
        Ok(one_time) => println!(
            "the rounds again, timed alone: verify + commit {:.1} us per round, one state pass per round (step_spec) {:.1} us ({:.2}x); outputs and final states bitwise equal",
            two_time.as_secs_f64() * 1e6 / rounds,
            one_time.as_secs_f64() * 1e6 / rounds,
            two_time.as_secs_f64() / one_time.as_secs_f64()
        ),
        Err(Error::Unsupported(why)) => println!(
            "the rounds again, timed alone: verify + commit {:.1} us per round; one state pass per round: not on this backend ({why})",
            two_time.as_secs_f64() * 1e6 / rounds
        ),
        Err(e) => return Err(e),
    }
    if let Some(bits) = &args.out_proj {
        show_tail(&args.backend, pool.as_mut(), &mut rng, bits)?;
    }
    Ok(())
}
