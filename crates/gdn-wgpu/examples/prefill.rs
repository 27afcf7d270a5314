//! Long windows (prefill) at the seed's shape, B windows of T tokens (`--seqs B`, 1 by default), commit all: the
//! token-serial kernel beside the chunked form (per column block), per window length, through
//! `LayerPool::time_varlen`; the chunked output checked against the token-serial one and (at `--oracle-t`) against
//! the float64 oracle.
//!
//! `cargo run --release -p gdn-wgpu --example prefill [-- --t 16,32,64,128,256,512,4096] [--columns 8,16,32]
//! [--len 16,32] [--crossover 16,24,32,48,64,96,128]
//! [--io f32|bf16] [--state f32|bf16] [--oracle-t 512] [--budget 20000] [--kernels 1] [--seqs 1]` (tokens a timed round:
//! iterations are budget / T, 1 to 50; `--kernels 1` adds each chunked kernel's share of every variant's time,
//! `WgpuPool::time_chunked_kernels`; `--seqs B` takes one B, and a timed round then holds B x budget tokens).
//! `GDN_WGPU_ADAPTER=nvidia` picks an adapter by name (read
//! here and passed in: the library reads no environment).

use gdn::oracle::{self, SeqState};
use gdn::step::{RowsData, Seq, Step, TensorData};
use gdn::synth::Synth;
use gdn::{Backend, Commit, Config, DType, LayerPool, OutputLayout, PoolOptions, Shape};
use gdn_wgpu::{Options, Wgpu};

fn main() {
    if let Err(e) = run() {
        eprintln!("prefill: {e}");
        std::process::exit(1);
    }
}

fn list(s: Option<&String>) -> Vec<usize> {
    s.map(|s| s.split(',').filter_map(|x| x.parse().ok()).collect())
        .unwrap_or_default()
}

fn run() -> gdn::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let mut ts = vec![16usize, 32, 64, 128, 256, 512, 4096];
    let mut columns = vec![8usize, 16, 32];
    let mut lens = vec![32usize];
    let mut io = DType::F32;
    let mut options = PoolOptions::default();
    let mut oracle_t = 512usize;
    let mut budget = 20000usize;
    let mut crossover: Vec<usize> = Vec::new();
    let mut kernels = false;
    let mut nseq = 1usize;
    let mut i = 1;
    while i < args.len() {
        let v = args.get(i + 1);
        match args[i].as_str() {
            "--t" => ts = list(v),
            "--columns" => columns = list(v),
            "--len" => lens = list(v),
            // lengths at which Wgpu::measure_crossover times both paths (with the default chunk geometry)
            "--crossover" => crossover = list(v),
            "--io" => io = v.map_or("", |s| s.as_str()).parse()?,
            "--state" => options.state = v.map_or("", |s| s.as_str()).parse()?,
            "--oracle-t" => oracle_t = list(v).first().copied().unwrap_or(0),
            // tokens per timed round (iterations = budget / T, 2 to 50)
            "--budget" => budget = list(v).first().copied().unwrap_or(budget),
            "--kernels" => kernels = list(v).first().is_some_and(|&k| k != 0),
            // windows of T tokens in one call (the same rows each, a slot each)
            "--seqs" => nseq = list(v).first().copied().unwrap_or(1).max(1),
            other => {
                return Err(gdn::Error::Param {
                    name: "argument",
                    why: other.into(),
                })
            }
        }
        i += 2;
    }
    let adapter = std::env::var("GDN_WGPU_ADAPTER")
        .ok()
        .filter(|s| !s.is_empty());
    let make = |chunk_from, chunk_len, chunk_columns| {
        Wgpu::with_options(Options {
            adapter: adapter.clone(),
            chunk_from: Some(chunk_from),
            chunk_len,
            chunk_columns,
            ..Options::default()
        })
    };
    let serial = make(usize::MAX, 32, 16)?;
    let variants: Vec<(usize, usize)> = lens
        .iter()
        .flat_map(|&l| columns.iter().map(move |&c| (l, c)))
        .collect();
    println!(
        "{}; seed shape, B {nseq}, commit all, {} state, {} activations and output",
        serial.name(),
        options.state.name(),
        io.name()
    );
    let shape = Shape::SEED;
    let mut rng = Synth::new(1);
    let layer = rng.layer(Config::new(shape))?;
    let (st, h) = rng.seq_state(&layer);
    let tmax = ts.iter().copied().max().unwrap_or(1);
    let b = rng.batch(&layer, 1, tmax);
    let mut header = format!("{:>6} {:>12}", "T", "serial us");
    for (l, c) in &variants {
        header.push_str(&format!(" {:>13} {:>7}", format!("L{l}/{c} us"), "x"));
    }
    header.push_str("  chunked vs serial y, vs oracle y / S");
    let mut table = vec![header];
    let mut split = vec![format!(
        "{:>6} {:>9} {:>10} {:>10} {:>10} {:>10}",
        "T", "L/BV", "pre us", "wy us", "run us", "out us"
    )];
    for &t in &ts {
        // the first t rows, once a window
        let cut = |x: &[f32], w: usize| x[..t * w].repeat(nseq);
        let n = shape.n();
        let rows = RowsData::from_f32(
            &cut(&b.qkv, shape.channels()),
            &cut(&b.alpha, shape.h_v),
            &cut(&b.beta, shape.h_v),
            &cut(&b.z, n),
            [io; 4],
        );
        let seqs: Vec<Seq> = (0..nseq)
            .map(|k| Seq {
                slot: k as i32,
                start: k * t,
                len: t,
                commit: Commit::All,
            })
            .collect();
        let step = Step {
            rows: rows.view(),
            seqs: &seqs,
            plane_stride: None,
        };
        let fill = |pool: &mut dyn LayerPool| -> gdn::Result<()> {
            (0..nseq).try_for_each(|k| pool.write_slot(k, &st, &h))
        };
        let iters = (budget / t).clamp(1, 50);
        let layout = OutputLayout::for_rows(&shape, nseq * t, None)?;
        let once = |backend: &Wgpu| -> gdn::Result<(Vec<f32>, Vec<f32>, f64)> {
            let mut pool = backend.create_pool_with(&layer, nseq, options)?;
            fill(pool.as_mut())?;
            let mut out = TensorData::filled(layout.len(), 0.0, io);
            pool.step_varlen(&step, out.view_mut())?;
            let (mut s1, mut h1) = (vec![0.0; shape.state_len()], vec![0.0; shape.hist_len()]);
            pool.read_slot(0, &mut s1, &mut h1)?;
            fill(pool.as_mut())?;
            let us = pool.time_varlen(&step, io, iters)?.per_call.as_secs_f64() * 1e6;
            Ok((out.to_f32(), s1, us))
        };
        let (ys, ss, us_s) = once(&serial)?;
        let mut line = format!("{t:>6} {us_s:>12.1}");
        let mut errs = String::new();
        for (k, &(l, c)) in variants.iter().enumerate() {
            let (yc, sc, us_c) = once(&make(1, l, c)?)?;
            line.push_str(&format!(" {us_c:>13.1} {:>6.2}x", us_s / us_c));
            if k == 0 {
                let e = gdn::relative_error(&yc, &ys.iter().map(|&x| x as f64).collect::<Vec<_>>());
                errs = format!("  {e:.2e}");
                if t == oracle_t {
                    let mut states = vec![SeqState::from_f32(&st, &h); nseq];
                    let want = oracle::step_varlen(&layer, &mut states, &step, options.state, io)?;
                    let ey = gdn::relative_error(&yc, &want);
                    let es = gdn::relative_error(&sc, &states[0].s);
                    let ey_s = gdn::relative_error(&ys, &want);
                    let es_s = gdn::relative_error(&ss, &states[0].s);
                    errs.push_str(&format!(
                        ", {ey:.2e} / {es:.2e} (token-serial {ey_s:.2e} / {es_s:.2e})"
                    ));
                }
            }
        }
        if kernels {
            for &(l, c) in &variants {
                let mut pool = make(1, l, c)?.pool(&layer, nseq, options)?;
                fill(&mut pool)?;
                let k = pool.time_chunked_kernels(&step, io, iters)?;
                let mut row = format!("{t:>6} {:>9}", format!("{l}/{c}"));
                for x in k {
                    row.push_str(&format!(" {:>10.1}", x * 1e6));
                }
                split.push(row);
            }
        }
        line.push_str(&errs);
        println!("{line}");
        table.push(line);
    }
    println!("\n{}", table.join("\n"));
    if kernels {
        println!(
            "\neach chunked kernel's time (a pass up to it less the pass up to the one before)"
        );
        println!("{}", split.join("\n"));
    }
    if !crossover.is_empty() {
        let c = serial.measure_crossover(&layer, &crossover, 10)?;
        for (t, a, b) in &c.points {
            println!(
                "crossover T {t}: serial {:.1} us, chunked {:.1} us",
                a * 1e6,
                b * 1e6
            );
        }
        println!("measured crossover: chunk_from = {}", c.chunk_from);
    }
    Ok(())
}
