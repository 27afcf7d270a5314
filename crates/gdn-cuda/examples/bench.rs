//! The CUDA backend's benchmark at the seed shape (device runs): copy ceiling, the step at B x T, host cost,
//! and the ptxas report of the specialisations it ran. Usage: `bench [sweep] [table]`; writes a markdown table to
//! $OUT/bench-cuda.md when OUT is set.

use std::fmt::Write as _;

use gdn::synth::Synth;
use gdn::{Backend, Commit, Config, Gate, Shape, StepArgs};
use gdn_cuda::{spec, Cuda, Plan};

struct Row {
    b: usize,
    t: usize,
    gate: Gate,
    plan: Plan,
    us: f64,
    host_us: f64,
}

fn run(
    cuda: &Cuda,
    gate: Gate,
    b: usize,
    t: usize,
    plan: Option<Plan>,
    pdl: bool,
) -> gdn::Result<Row> {
    let mut c = cuda.clone();
    c.set_plan_override(plan);
    c.set_pdl(pdl);
    let mut cfg = Config::new(Shape::SEED);
    cfg.gate = gate;
    let mut rng = Synth::new(7 + b as u64 * 31 + t as u64);
    let layer = rng.layer(cfg)?;
    let mut pool = c.create_cuda_pool(&layer, b)?;
    let batch = rng.batch(&layer, b, t);
    let slots: Vec<i32> = (0..b as i32).collect();
    let args = StepArgs {
        batch: batch.view(),
        slots: &slots,
        commit: Commit::All,
        plane_stride: None,
    };
    let used = pool.plan(b)?;
    let timing = gdn::LayerPool::time_step(&mut pool, &args, 20)?;
    Ok(Row {
        b,
        t,
        gate,
        plan: used,
        us: timing.per_call.as_secs_f64() * 1e6,
        host_us: timing
            .host_per_call
            .map_or(f64::NAN, |d| d.as_secs_f64() * 1e6),
    })
}

fn main() -> gdn::Result<()> {
    let sweep = std::env::args().any(|a| a == "sweep");
    let table = std::env::args().any(|a| a == "table");
    let cuda = Cuda::new()?;
    println!("backend: {}", cuda.name());
    println!(
        "kernel: {:?} (GDN_CUDA_KERNEL=v3 selects v3)",
        spec::Kernel::from_env()
    );
    let copy = cuda.copy_ceiling(1 << 30)?;
    println!(
        "copy ceiling: {:.3} TB/s (read + write, 1 GiB, events, median)",
        copy / 1e12
    );
    let state_bytes = |b: usize| 2.0 * (b * Shape::SEED.state_len() * 4) as f64;

    if sweep {
        println!("\n## plan sweep (sigmoid, commit all)");
        println!(
            "{:>4} {:>2} {:>14} {:>9} {:>7}",
            "B", "T", "plan ncb/rg/mb", "us", "%copy"
        );
        for (b, t) in [(1, 1), (1, 8), (256, 1), (256, 8)] {
            let plans: Vec<Plan> = [
                (1, 4, 1),
                (1, 4, 2),
                (1, 2, 2),
                (1, 2, 1),
                (2, 4, 2),
                (2, 4, 1),
                (2, 8, 2),
                (4, 8, 3),
                (8, 8, 5),
            ]
            .into_iter()
            .map(|(ncb, rg, minb)| Plan { ncb, rg, minb })
            .collect();
            for p in plans {
                for pdl in [true, false] {
                    if !pdl && b > 1 {
                        continue;
                    }
                    match run(&cuda, Gate::Sigmoid, b, t, Some(p), pdl) {
                        Ok(r) => println!(
                            "{:>4} {:>2} {:>14} {:>5} {:>9.2} {:>7.1} {:>6.2}",
                            b,
                            t,
                            format!("{}/{}/{}", p.ncb, p.rg, p.minb),
                            pdl,
                            r.us,
                            100.0 * state_bytes(b) / (r.us * 1e-6) / copy,
                            r.host_us
                        ),
                        Err(e) => println!("{b:>4} {t:>2} {:?} failed: {e}", p),
                    }
                }
            }
        }
    }

    // FLA, same machine 2026-11-29 (anchors/README.md): whole step and recurrence alone, graph replay, f32.
    let fla = |b: usize, t: usize| -> (Option<f64>, Option<f64>) {
        let full = [
            (1, 1, 7.03, 3.55),
            (1, 8, 19.70, 8.02),
            (8, 1, 34.61, 20.06),
            (8, 8, 67.38, 40.94),
            (32, 1, 101.2, 71.45),
            (32, 8, 211.6, 135.0),
            (128, 1, 371.5, 280.7),
            (128, 8, 797.5, 507.5),
            (256, 1, 729.8, 554.3),
            (256, 8, 1566.2, 1002.3),
        ];
        full.iter()
            .find(|r| r.0 == b && r.1 == t)
            .map_or((None, None), |r| (Some(r.2), Some(r.3)))
    };
    let mut rows = Vec::new();
    for gate in [Gate::Sigmoid, Gate::Silu].into_iter().filter(|_| table) {
        for b in [1usize, 8, 32, 128, 256] {
            for t in [1usize, 4, 8] {
                if gate == Gate::Silu && t == 4 {
                    continue;
                }
                match run(&cuda, gate, b, t, None, true) {
                    Ok(r) => rows.push(r),
                    Err(e) => println!("B {b} T {t} {gate:?} failed: {e}"),
                }
            }
        }
    }
    println!("\n## ptxas report of the specialisations timed (commit all, no planes)");
    let mut seen = std::collections::HashSet::new();
    for r in &rows {
        let mut cfg = Config::new(Shape::SEED);
        cfg.gate = r.gate;
        let s = spec::Spec::new(cuda.arch(), &cfg, r.t, Commit::All, false, r.plan);
        if seen.insert(s) {
            if let Ok(c) = spec::compiled(&s) {
                println!(
                    "{:?} T {} {:?} plan {}/{}/{}: {}",
                    s.kernel,
                    r.t,
                    r.gate,
                    r.plan.ncb,
                    r.plan.rg,
                    r.plan.minb,
                    spec::resource_line(&c.log)
                );
            }
        }
    }
    let mut md = String::new();
    let _ = writeln!(
        md,
        "copy ceiling {:.3} TB/s; floor = state bytes (B x 48 x 64 KiB x 2) / copy ceiling",
        copy / 1e12
    );
    let _ = writeln!(md, "\n| gate | B | T | plan ncb/rg/minb | µs / call (graph) | state GB/s | % of copy | x floor | FLA whole step µs | FLA recurrence µs | FLA whole / ours | host µs / call |");
    let _ = writeln!(md, "|---|---|---|---|---|---|---|---|---|---|---|---|");
    for r in &rows {
        let bytes = state_bytes(r.b);
        let gbs = bytes / (r.us * 1e-6) / 1e9;
        let floor_us = bytes / copy * 1e6;
        let (ff, fr) = if r.gate == Gate::Silu {
            fla(r.b, r.t)
        } else {
            (None, None)
        };
        let f = |x: Option<f64>| x.map_or("".to_string(), |v| format!("{v:.2}"));
        let ratio = ff.map_or("".to_string(), |v| format!("{:.2}", v / r.us));
        let _ =
            writeln!(
            md,
            "| {} | {} | {} | {}/{}/{} | {:.2} | {:.0} | {:.1} | {:.2} | {} | {} | {} | {:.2} |",
            r.gate.name(), r.b, r.t, r.plan.ncb, r.plan.rg, r.plan.minb, r.us, gbs,
            100.0 * gbs * 1e9 / copy, r.us / floor_us, f(ff), f(fr), ratio, r.host_us
        );
    }
    println!("\n{md}");
    if let Ok(out) = std::env::var("OUT") {
        let _ = std::fs::write(format!("{out}/bench-cuda.md"), &md);
    }
    Ok(())
}
