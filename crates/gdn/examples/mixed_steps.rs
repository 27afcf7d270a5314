//! Times a mixed batch (B - 1 decode sequences + one T-token window) against its two halves, by CPU time and
//! wall time, for `perf stat`: `cargo run --release -p gdn --example mixed_steps -- B T STEPS WHICH` with WHICH
//! `mixed`, `decode` or `window`.

use gdn::synth::Synth;
use gdn::{
    Backend, Commit, Config, Cpu, DType, PoolOptions, RowsData, Seq, Shape, Step, TensorData,
};

fn main() -> gdn::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (b, t, steps): (usize, usize, usize) = (
        args[0].parse().expect("B"),
        args[1].parse().expect("T"),
        args[2].parse().expect("STEPS"),
    );
    let which = args[3].as_str();
    let backend = Cpu::with_calling_thread(2)?;
    let mut rng = Synth::new(1);
    let layer = rng.layer(Config::new(Shape::SEED))?;
    let mut pool = backend.create_pool_with(&layer, b, PoolOptions::default())?;
    for s in 0..b {
        let (st, h) = rng.seq_state(&layer);
        pool.write_slot(s, &st, &h)?;
    }
    let mut seqs: Vec<Seq> = (0..b - 1)
        .map(|s| Seq {
            slot: s as i32,
            start: s,
            len: 1,
            commit: Commit::All,
        })
        .collect();
    seqs.push(Seq {
        slot: (b - 1) as i32,
        start: b - 1,
        len: t,
        commit: Commit::All,
    });
    let seqs = match which {
        "mixed" => seqs,
        "decode" => seqs[..b - 1].to_vec(),
        _ => vec![seqs[b - 1]],
    };
    let rows_n = b - 1 + t;
    let w = rng.batch(&layer, 1, rows_n);
    let rows = RowsData::from_f32(&w.qkv, &w.alpha, &w.beta, &w.z, [DType::F32; 4]);
    let mut out = TensorData::filled(rows_n * layer.shape().n(), 0.0, DType::F32);
    let step = Step {
        rows: rows.view(),
        seqs: &seqs,
        plane_stride: None,
    };
    let t0 = std::time::Instant::now();
    for _ in 0..steps {
        pool.step_varlen(&step, out.view_mut())?;
    }
    eprintln!(
        "{which}: {:.1} us per step (wall)",
        t0.elapsed().as_secs_f64() * 1e6 / steps as f64
    );
    Ok(())
}
