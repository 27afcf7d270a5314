//! Runs a fixed number of steps at the seed's shape, for counting cycles with `perf stat` on a busy machine:
//! `cargo run --release -p gdn --example fixed_steps -- B T STEPS THREADS [H_K H_V]`; THREADS `0` is rayon's
//! global pool, `N` a pool of N threads, `Nc` a pool of N threads with this thread one of them.

use gdn::synth::Synth;
use gdn::{Backend, Commit, Config, Cpu, Shape, StepArgs};

fn main() -> gdn::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let calling = args[3].ends_with('c');
    let a: Vec<usize> = args
        .iter()
        .map(|x| x.trim_end_matches('c').parse().expect("numbers"))
        .collect();
    let (b, t, steps, threads) = (a[0], a[1], a[2], a[3]);
    let backend = match (threads, calling) {
        (0, _) => Cpu::new(),
        (n, false) => Cpu::with_threads(n)?,
        (n, true) => Cpu::with_calling_thread(n)?,
    };
    let mut rng = Synth::new(1);
    // optional 5th and 6th arguments: h_k and h_v (default the seed's), e.g. a small state that stays in L2
    let shape = match (a.get(4), a.get(5)) {
        (Some(&h_k), Some(&h_v)) => Shape::new(Shape::SEED.d, h_k, h_v)?,
        _ => Shape::SEED,
    };
    let layer = rng.layer(Config::new(shape))?;
    let mut pool = backend.create_pool(&layer, b)?;
    for s in 0..b {
        let (st, h) = rng.seq_state(&layer);
        pool.write_slot(s, &st, &h)?;
    }
    let batch = rng.batch(&layer, b, t);
    let slots: Vec<i32> = (0..b as i32).collect();
    let mut out = vec![0.0; b * t * layer.shape().n()];
    let t0 = std::time::Instant::now();
    for _ in 0..steps {
        pool.step(
            &StepArgs {
                batch: batch.view(),
                slots: &slots,
                commit: Commit::All,
                plane_stride: None,
            },
            &mut out,
        )?;
    }
    eprintln!(
        "{:.1} us per step (wall)",
        t0.elapsed().as_secs_f64() * 1e6 / steps as f64
    );
    Ok(())
}
