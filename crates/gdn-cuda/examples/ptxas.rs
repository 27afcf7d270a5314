//! Prints the plan and ptxas's resource report of the main seed-shape specialisations (no GPU needed).
//! `ptxas ncb,rg,minb ..`: the report of those splits alone, at T 1, 4 and 8, plain and speculative, in each pool.
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
