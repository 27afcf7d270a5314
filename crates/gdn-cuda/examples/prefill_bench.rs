//! Long windows (prefill) and verify windows at the seed shape: the chunked path (src/chunk.rs) beside the
//! token-serial kernel, each timed by `time_varlen` (a CUDA graph of steps replayed, events, median of 7), f32
//! state, commit all. Device runs only. `prefill_bench [quick]` (quick: no threshold sweep, fewer bf16 cases);
//! `prefill_bench case B T [fast]`: that one case, chunked, f32 io (for a profiler; `fast`: one-TF32 products);
//! `prefill_bench dump FILE B T`: one chunked step of that case, its y, committed states and histories written to
//! FILE as little-endian f32 (two builds' files compared with `cmp` tell whether a kernel change kept the bits).
//! The table's prefill cases also time the opt-in one-TF32 products (`ChunkProducts::Tf32`).

use gdn::synth::Synth;
use gdn::{Commit, Config, DType, LayerPool, PoolOptions, RowsData, Seq, Shape, Step};
use gdn_cuda::chunk::ChunkProducts;
use gdn_cuda::{Cuda, CudaPool};

fn time(pool: &mut CudaPool, rows: &RowsData, seqs: &[Seq], iters: usize) -> gdn::Result<f64> {
    let step = Step {
        rows: rows.view(),
        seqs,
        plane_stride: None,
    };
    Ok(pool
        .time_varlen(&step, DType::F32, iters)?
        .per_call
        .as_secs_f64()
        * 1e6)
}

/// `B T` after argument `i` (B x T in 1..=32768).
fn only_after(args: &[String], i: usize) -> Option<(usize, usize)> {
    let num = |k: usize| args.get(i + k).and_then(|a| a.parse::<usize>().ok());
    match (num(1), num(2)) {
        (Some(b), Some(t)) if b.checked_mul(t).is_some_and(|r| (1..=32768).contains(&r)) => {
            Some((b, t))
        }
        _ => None,
    }
}

fn uniform(b: usize, t: usize) -> Vec<Seq> {
    (0..b)
        .map(|i| Seq {
            slot: i as i32,
            start: i * t,
            len: t,
            commit: Commit::All,
        })
        .collect()
}

fn main() -> gdn::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "quick");
    let only: Option<(usize, usize)> = match args.iter().position(|a| a == "case") {
        Some(i) => match only_after(&args, i) {
            Some(bt) => Some(bt),
            None => {
                eprintln!("usage: prefill_bench case B T (B x T at most 32768)");
                std::process::exit(2);
            }
        },
        None => None,
    };
    let mut chunked = Cuda::new()?;
    chunked.set_chunk_min_len(Some(1));
    let mut serial = chunked.clone();
    serial.set_chunk_min_len(Some(usize::MAX));
    let mut fast = chunked.clone();
    fast.set_chunk_products(ChunkProducts::Tf32);
    let mut rng = Synth::new(14);
    let layer = rng.layer(Config::new(Shape::SEED))?;
    let max_rows = 32768;
    let data = rng.batch(&layer, 1, max_rows);
    let sh = *layer.shape();
    let rows_of = |n: usize, io: DType| {
        RowsData::from_f32(
            &data.qkv[..n * sh.channels()],
            &data.alpha[..n * sh.h_v],
            &data.beta[..n * sh.h_v],
            &data.z[..n * sh.n()],
            [io; 4],
        )
    };
    let pool = |cuda: &Cuda, slots: usize, rng: &mut Synth| -> gdn::Result<CudaPool> {
        let mut p = cuda.create_cuda_pool(&layer, slots, PoolOptions::default())?;
        for s in 0..slots {
            let (st, h) = rng.seq_state(&layer);
            p.write_slot(s, &st, &h)?;
        }
        Ok(p)
    };
    println!("seed shape, f32 state key-major, commit all; device us per call (graph replays)");
    println!();
    println!(
        "| case | io | chunked | token-serial | serial / chunked | chunked, one-TF32 products |"
    );
    println!("|---|---|---|---|---|---|");
    if let Some(i) = args.iter().position(|a| a == "dump") {
        let (Some(file), Some((b, t))) = (args.get(i + 1), only_after(&args, i + 1)) else {
            eprintln!("usage: prefill_bench dump FILE B T");
            std::process::exit(2);
        };
        let mut p = pool(&chunked, b, &mut rng)?;
        let rows = rows_of(b * t, DType::F32);
        let seqs = uniform(b, t);
        let mut out = gdn::TensorData::filled(b * t * sh.n(), 0.0, DType::F32);
        p.step_varlen(
            &Step {
                rows: rows.view(),
                seqs: &seqs,
                plane_stride: None,
            },
            out.view_mut(),
        )?;
        let mut bytes: Vec<u8> = out.to_f32().iter().flat_map(|v| v.to_le_bytes()).collect();
        for slot in 0..b {
            let (mut st, mut h) = (vec![0.0; sh.state_len()], vec![0.0; sh.hist_len()]);
            p.read_slot(slot, &mut st, &mut h)?;
            bytes.extend(st.iter().chain(&h).flat_map(|v| v.to_le_bytes()));
        }
        std::fs::write(file, &bytes).map_err(|e| gdn::Error::Backend(format!("{file}: {e}")))?;
        println!("{file}: {} bytes", bytes.len());
        return Ok(());
    }
    if let Some((b, t)) = only {
        let is_fast = args.iter().any(|a| a == "fast");
        let mut p = pool(if is_fast { &fast } else { &chunked }, b, &mut rng)?;
        let tc = time(&mut p, &rows_of(b * t, DType::F32), &uniform(b, t), 3)?;
        let (three, one) = if is_fast {
            ("-".to_string(), format!("{tc:.1}"))
        } else {
            (format!("{tc:.1}"), "-".to_string())
        };
        println!("| B {b} T {t} | F32 | {three} | - | - | {one} |");
        return Ok(());
    }
    let mut cases: Vec<(&str, usize, usize, bool, usize)> = vec![
        ("B 1 T 512", 1, 512, true, 20),
        ("B 1 T 8192", 1, 8192, true, 2),
        ("B 1 T 32768", 1, 32768, false, 1),
        ("4 x 8192 varlen", 4, 8192, true, 1),
        ("2 x 8192 varlen", 2, 8192, true, 1),
        ("B 64 T 4", 64, 4, true, 20),
        ("B 64 T 8", 64, 8, true, 20),
        ("B 256 T 4", 256, 4, true, 20),
        ("B 256 T 8", 256, 8, true, 20),
    ];
    if !quick {
        for &(name, b, t) in &[
            ("B 1 T 16", 1usize, 16usize),
            ("B 1 T 32", 1, 32),
            ("B 1 T 64", 1, 64),
            ("B 1 T 128", 1, 128),
            ("B 1 T 256", 1, 256),
            ("B 64 T 16", 64, 16),
            ("B 64 T 64", 64, 64),
            ("B 8 T 256", 8, 256),
        ] {
            cases.push((name, b, t, true, 10));
        }
    }
    let mut pools: Vec<(usize, CudaPool, CudaPool, CudaPool)> = Vec::new();
    for io in [DType::F32, DType::Bf16] {
        for (ci, &(name, b, t, with_serial, iters)) in cases.iter().enumerate() {
            // bf16 activations: the four prefill cases only
            if io == DType::Bf16 && (ci >= 4 || (quick && ci == 3)) {
                continue;
            }
            let rows = rows_of(b * t, io);
            let seqs = uniform(b, t);
            if !pools.iter().any(|p| p.0 == b) {
                let c = pool(&chunked, b, &mut rng)?;
                let s = pool(&serial, b, &mut rng)?;
                let f = pool(&fast, b, &mut rng)?;
                pools.push((b, c, s, f));
            }
            let entry = pools.iter_mut().find(|p| p.0 == b).expect("pool");
            let tc = time(&mut entry.1, &rows, &seqs, iters)?;
            let ts = if with_serial {
                Some(time(&mut entry.2, &rows, &seqs, iters)?)
            } else {
                None
            };
            // the fast products on the prefill cases
            let tf = if ci < 5 {
                let t = time(&mut entry.3, &rows, &seqs, iters)?;
                entry.3.release_chunk();
                Some(t)
            } else {
                None
            };
            println!(
                "| {name} | {io:?} | {tc:.1} | {} | {} | {} |",
                ts.map_or("-".into(), |x| format!("{x:.1}")),
                ts.map_or("-".into(), |x| format!("{:.2}x", x / tc)),
                tf.map_or("-".into(), |x| format!("{x:.1}"))
            );
        }
        // free the big pools' chunk scratch between dtypes
        for p in pools.iter_mut() {
            p.1.release_chunk();
        }
    }
    Ok(())
}
