//! Prints the plan and ptxas's resource report of the main seed-shape specialisations (no GPU needed).
//! `ptxas ncb,rg,minb ..`: the report of those splits alone, at T 1, 4 and 8, plain and speculative, in each pool.
//! `ptxas spec [DIR]`: the speculative kernels `spec_bench` and `external_bench spec` run (B 64 / 256, W 4 / 8);
//! with DIR, their cubins written there (for nvdisasm).
use gdn::{Config, DType, PoolOptions, Shape, StateLayout};
use gdn_cuda::spec::{compiled, resource_line, Io, Plan, Spec, CLUSTER_SIZES};

fn main() {
    let cfg = Config::new(Shape::SEED);
    let t0 = std::time::Instant::now();
    let plans: Vec<Plan> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    if !plans.is_empty() {
        return splits(&cfg, &plans);
    }
    if std::env::args().nth(1).as_deref() == Some("spec") {
        return speculative(&cfg, std::env::args().nth(2));
    }
    // the decode kernels as the planner runs them: B 1 (own state prefetched before the wait) and B 256 (a bf16
    // state staged, value-major with the prefetch half a wave ahead)
    for state in [DType::F32, DType::Bf16] {
        for layout in [StateLayout::KeyMajor, StateLayout::ValueMajor] {
            for b in [1usize, 256] {
                let p = Plan::choose(128, 48, b, 132).expect("a split for d 128");
                let s = Spec::new((9, 0), &cfg, Some(1), true, false, p)
                    .with_pool(PoolOptions { state, layout })
                    .with_stage(b * 48 >= 264)
                    .with_tune(None, b * 48 * p.ncb, 132);
                match compiled(&s) {
                    Ok(c) => println!(
                        "decode B {b} state {} {} plan {}/{}/{} ahead {} prewait {}: {}",
                        state.name(),
                        layout.name(),
                        p.ncb,
                        p.rg,
                        s.minb(),
                        s.ahead,
                        s.prewait,
                        resource_line(&c.log)
                    ),
                    Err(e) => println!("{s:?}: {e}"),
                }
            }
        }
    }
    if std::env::args().any(|a| a == "decode") {
        return;
    }
    // the window kernel: every state and layout, verify and commit, T 4, 8 and the run-time length
    let p = Plan::choose(128, 48, 256, 132).expect("a split for d 128");
    for state in [DType::F32, DType::Bf16] {
        for layout in [StateLayout::KeyMajor, StateLayout::ValueMajor] {
            for (t, commit, planes) in [
                (Some(4), false, false),
                (Some(8), false, false),
                (Some(8), true, false),
                (None, true, false),
                (None, true, true),
            ] {
                let s = Spec::new((9, 0), &cfg, t, commit, planes, p)
                    .with_pool(PoolOptions { state, layout })
                    .with_window(1, 132, None);
                match compiled(&s) {
                    Ok(c) => println!(
                        "window state {} {} T {t:?} commit {commit} planes {planes}: {}",
                        state.name(),
                        layout.name(),
                        resource_line(&c.log)
                    ),
                    Err(e) => println!("{s:?}: {e}"),
                }
            }
        }
    }
    if std::env::args().any(|a| a == "window") {
        return;
    }
    let p = Plan::choose(128, 48, 256, 132).expect("a split for d 128");
    for state in [DType::F32, DType::Bf16] {
        for layout in [StateLayout::KeyMajor, StateLayout::ValueMajor] {
            for io in [DType::F32, DType::Bf16] {
                for (t, commit, planes) in [
                    (Some(1), true, false),
                    (Some(1), false, false),
                    (Some(8), true, false),
                    (None, true, false),
                    (None, true, true),
                ] {
                    let s = Spec::new((9, 0), &cfg, t, commit, planes, p)
                        .with_io(Io::all(io))
                        .with_pool(PoolOptions { state, layout });
                    match compiled(&s) {
                        Ok(c) => println!(
                            "state {} {} io {} T {t:?} commit {commit} planes {planes} minb {}: {}",
                            state.name(),
                            layout.name(),
                            io.name(),
                            s.minb(),
                            resource_line(&c.log)
                        ),
                        Err(e) => println!("{s:?}: {e}"),
                    }
                }
            }
        }
    }
    eprintln!("{:.1} s", t0.elapsed().as_secs_f64());
    // the speculative step beside the plain commit kernel of the same window
    for state in [DType::F32, DType::Bf16] {
        for layout in [StateLayout::KeyMajor, StateLayout::ValueMajor] {
            for t in [Some(4), Some(8), None] {
                let s = Spec::new((9, 0), &cfg, t, true, false, p)
                    .with_pool(PoolOptions { state, layout });
                for (what, s) in [("plain", s), ("speculative", s.with_speculative())] {
                    if let Ok(c) = compiled(&s) {
                        println!(
                            "{what} state {} {} T {t:?}: {}",
                            state.name(),
                            layout.name(),
                            resource_line(&c.log)
                        );
                    }
                }
            }
        }
    }
    for layout in [StateLayout::KeyMajor, StateLayout::ValueMajor] {
        for (rg, minb) in [(2, 1), (2, 2), (2, 3), (2, 4), (4, 2)] {
            for t in [Some(1), None] {
                let p = Plan { ncb: 1, rg, minb };
                let s = Spec::new((9, 0), &cfg, t, true, false, p).with_pool(PoolOptions {
                    state: DType::Bf16,
                    layout,
                });
                if let Ok(c) = compiled(&s) {
                    println!(
                        "bf16 {} plan 1/{rg}/{minb} T {t:?}: {}",
                        layout.name(),
                        resource_line(&c.log)
                    );
                }
            }
        }
    }
    for ncb in CLUSTER_SIZES {
        let Some(p) = Plan::for_ncb(128, ncb) else {
            continue;
        };
        for t in [Some(1), Some(8)] {
            let s = Spec::new((9, 0), &cfg, t, true, false, p);
            match compiled(&s) {
                Ok(c) => println!(
                    "plan {}/{}/{} ({} threads) T {t:?}: {}",
                    p.ncb,
                    p.rg,
                    p.minb,
                    s.threads(),
                    resource_line(&c.log)
                ),
                Err(e) => println!("plan {p:?} T {t:?}: {e}"),
            }
        }
    }
}

/// ptxas's report of the given splits in every pool kind, plain and speculative, at T 1, 4 and 8.
fn splits(cfg: &Config, plans: &[Plan]) {
    for p in plans {
        for (state, layout) in [
            (DType::F32, StateLayout::KeyMajor),
            (DType::Bf16, StateLayout::KeyMajor),
            (DType::Bf16, StateLayout::ValueMajor),
        ] {
            for t in [1, 4, 8] {
                let s = Spec::new((9, 0), cfg, Some(t), true, false, *p)
                    .with_pool(PoolOptions { state, layout });
                let kinds = if t == 1 {
                    vec![("plain", s)]
                } else {
                    vec![("plain", s), ("speculative", s.with_speculative())]
                };
                for (what, s) in kinds {
                    match compiled(&s) {
                        Ok(c) => println!(
                            "plan {}/{}/{} {what} state {} {} T {t}: {}",
                            p.ncb,
                            p.rg,
                            p.minb,
                            state.name(),
                            layout.name(),
                            resource_line(&c.log)
                        ),
                        Err(e) => println!("plan {p:?} {what} T {t}: {e}"),
                    }
                }
            }
        }
    }
}

/// ptxas's report of the speculative kernels the benches time: the pool's (key-major, f32 / bf16 state and io)
/// and engine memory's (f32 key-major with f32 io and conv; bf16 value-major with bf16 io and conv), hints planned
/// as at B 64 and 256.
fn speculative(cfg: &Config, dir: Option<String>) {
    let p = Plan::choose(128, 48, 256, 132).expect("a split for d 128");
    let f32km = PoolOptions::default();
    let bf16km = PoolOptions {
        state: DType::Bf16,
        layout: StateLayout::KeyMajor,
    };
    let bf16vm = PoolOptions {
        state: DType::Bf16,
        layout: StateLayout::ValueMajor,
    };
    for (what, pool, io, ext) in [
        ("pool f32", f32km, DType::F32, false),
        ("pool bf16", bf16km, DType::Bf16, false),
        ("engine f32", f32km, DType::F32, true),
        ("engine bf16", bf16vm, DType::Bf16, true),
    ] {
        for b in [64usize, 256] {
            for w in [4, 8] {
                // the one-pass kernel and the two-pass flow's verify (the k-token commit runs at a run-time length)
                for (flow, commits) in [("one-pass", true), ("verify", false)] {
                    let s = Spec::new((9, 0), cfg, Some(w), commits, false, p)
                        .with_io(Io::all(io))
                        .with_pool(pool);
                    let s = if ext { s.with_ext(io) } else { s };
                    let s = s.with_tune(None, b * 48 * p.ncb, 132);
                    let s = if commits { s.with_speculative() } else { s };
                    let name = format!("{what} {flow} B {b} W {w}");
                    match compiled(&s) {
                        Ok(c) => {
                            println!("{name}: {}", resource_line(&c.log));
                            if let Some(d) = &dir {
                                let f = format!("{d}/{}.cubin", name.replace(' ', "_"));
                                if let Err(e) = std::fs::write(&f, &c.cubin) {
                                    println!("{f}: {e}");
                                }
                            }
                        }
                        Err(e) => println!("{name}: {e}"),
                    }
                }
            }
        }
    }
}
