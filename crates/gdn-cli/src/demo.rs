//! `gdn demo`: a random layer at the seed's shape, a prompt, then speculative decoding (verify a window of 4,
//! commit the accepted tokens), every output checked against the float64 oracle as it goes.

use std::time::{Duration, Instant};

use gdn::oracle::{self, SeqState};
use gdn::synth::Synth;
use gdn::{relative_error, Commit, Config, Error, Gate, HeadMap, Result, Shape, StepArgs};

use crate::backends;

#[derive(clap::Args)]
pub struct Args {
    #[arg(long, default_value = "cpu")]
    backend: String,
    /// Prompt length.
    #[arg(long, default_value_t = 64)]
    prompt: usize,
    /// Speculative rounds.
    #[arg(long, default_value_t = 24)]
    rounds: usize,
    /// Draft window length.
    #[arg(long, default_value_t = 4)]
    window: usize,
    #[arg(long, default_value_t = 7)]
    seed: u64,
}

pub fn run(args: Args) -> Result<()> {
    let backend = backends::make(&args.backend)?;
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
        "layer: d {} h_k {} h_v {} (Qwen3.5-27B's GDN shape), grouped heads, silu gate; state {:.1} MiB per sequence",
        shape.d,
        shape.h_k,
        shape.h_v,
        (shape.state_len() * 4) as f64 / (1 << 20) as f64
    );
    let mut pool = backend.create_pool(&layer, 1)?;
    let mut reference = vec![SeqState::zeros(&layer)];
    let n = shape.n();
    let mut worst: f64 = 0.0;
    let mut check = |what: &str, got: &[f32], want: &[f64]| -> Result<f64> {
        let e = relative_error(got, want);
        worst = worst.max(e);
        if e >= 1e-4 || e.is_nan() {
            return Err(Error::Backend(format!(
                "{what}: relative error {e:.2e} against the oracle"
            )));
        }
        Ok(e)
    };

    // the prompt, one window, committed
    let prompt = rng.batch(&layer, 1, args.prompt);
    let mut y = vec![0.0; args.prompt * n];
    let t0 = Instant::now();
    pool.step(
        &StepArgs {
            batch: prompt.view(),
            slots: &[0],
            commit: Commit::All,
            plane_stride: None,
        },
        &mut y,
    )?;
    let prompt_time = t0.elapsed();
    let want = oracle::step(
        &layer,
        &mut reference,
        &prompt.view(),
        &[0],
        Commit::All,
        None,
    )?;
    let e = check("prompt", &y, &want)?;
    println!(
        "prompt: {} tokens in one window: {:.2} ms ({:.0} tokens/s), y relative error {e:.1e}",
        args.prompt,
        prompt_time.as_secs_f64() * 1e3,
        args.prompt as f64 / prompt_time.as_secs_f64()
    );

    // speculative decoding: verify a draft window, accept a random prefix, commit it
    let w = args.window;
    let (mut verify_time, mut commit_time) = (Duration::ZERO, Duration::ZERO);
    let mut accepted_total = 0;
    let mut y = vec![0.0; w * n];
    for round in 0..args.rounds {
        let draft = rng.batch(&layer, 1, w);
        let t0 = Instant::now();
        pool.step(
            &StepArgs {
                batch: draft.view(),
                slots: &[0],
                commit: Commit::Verify,
                plane_stride: None,
            },
            &mut y,
        )?;
        verify_time += t0.elapsed();
        let mut scratch = reference.clone();
        let want = oracle::step(
            &layer,
            &mut scratch,
            &draft.view(),
            &[0],
            Commit::Verify,
            None,
        )?;
        let e_verify = check("verify", &y, &want)?;
        let accepted = rng.index(1, w);
        let t0 = Instant::now();
        pool.step(
            &StepArgs {
                batch: draft.view(),
                slots: &[0],
                commit: Commit::First(accepted),
                plane_stride: None,
            },
            &mut y,
        )?;
        commit_time += t0.elapsed();
        let want = oracle::step(
            &layer,
            &mut reference,
            &draft.view(),
            &[0],
            Commit::First(accepted),
            None,
        )?;
        let e_commit = check("commit", &y, &want)?;
        accepted_total += accepted;
        if round < 4 || round + 1 == args.rounds {
            println!(
                "round {:>2}: verified {w} drafted tokens (error {e_verify:.1e}), accepted {accepted}, committed (error {e_commit:.1e})",
                round + 1
            );
        } else if round == 4 {
            println!("...");
        }
    }
    let sh = layer.shape();
    let mut s = vec![0.0; sh.state_len()];
    let mut h = vec![0.0; sh.hist_len()];
    pool.read_slot(0, &mut s, &mut h)?;
    let e_s = relative_error(&s, &reference[0].s);
    let e_h = relative_error(&h, &reference[0].h);
    worst = worst.max(e_s).max(e_h);
    let rounds = args.rounds as f64;
    println!(
        "{} rounds, {} tokens accepted ({:.2} per round); verify {:.1} us, commit {:.1} us per round; {:.0} accepted tokens/s",
        args.rounds,
        accepted_total,
        accepted_total as f64 / rounds,
        verify_time.as_secs_f64() * 1e6 / rounds,
        commit_time.as_secs_f64() * 1e6 / rounds,
        accepted_total as f64 / (verify_time + commit_time).as_secs_f64()
    );
    println!(
        "final state against the oracle: S {e_s:.1e}, history {e_h:.1e}; worst error seen {worst:.1e} (bound 1e-4): agreement OK"
    );
    Ok(())
}
