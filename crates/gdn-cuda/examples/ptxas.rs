//! Prints the plan and ptxas's resource report of the main seed-shape specialisations (no GPU needed).
use gdn::{Commit, Config, Shape};
use gdn_cuda::spec::{compiled, resource_line, Kernel, Plan, Spec, CLUSTER_SIZES};

fn main() {
    let cfg = Config::new(Shape::SEED);
    for ncb in CLUSTER_SIZES {
        let Some(p) = Plan::for_ncb(128, ncb) else {
            continue;
        };
        for (t, kernel) in [1, 8]
            .into_iter()
            .flat_map(|t| [(t, Kernel::V2b), (t, Kernel::V3)])
        {
            let s = Spec::new((9, 0), &cfg, t, Commit::All, false, p).with_kernel(kernel);
            match compiled(&s) {
                Ok(c) => println!(
                    "{kernel:?} plan {}/{}/{} ({} threads) T {t}: {}",
                    p.ncb,
                    p.rg,
                    p.minb,
                    s.threads(),
                    resource_line(&c.log)
                ),
                Err(e) => println!("plan {p:?} T {t}: {e}"),
            }
        }
    }
    for p in [
        Plan {
            ncb: 1,
            rg: 4,
            minb: 1,
        },
        Plan {
            ncb: 1,
            rg: 4,
            minb: 2,
        },
        Plan {
            ncb: 1,
            rg: 2,
            minb: 1,
        },
    ] {
        for (t, kernel) in [1, 8]
            .into_iter()
            .flat_map(|t| [(t, Kernel::V2b), (t, Kernel::V3)])
        {
            let s = Spec::new((9, 0), &cfg, t, Commit::All, false, p).with_kernel(kernel);
            if let Ok(c) = compiled(&s) {
                println!(
                    "{kernel:?} plan {}/{}/{} T {t}: {}",
                    p.ncb,
                    p.rg,
                    p.minb,
                    resource_line(&c.log)
                );
            }
        }
    }
    // kernel v3 at the planner's split: commit-all and verify without planes, commit-all with planes
    let p = Plan::choose(128, 48, 256, 132).expect("a split for d 128");
    for (commit, planes) in [
        (Commit::All, false),
        (Commit::Verify, false),
        (Commit::All, true),
        (Commit::Verify, true),
    ] {
        for t in [1, 2, 4, 8, 9] {
            let s = Spec::new((9, 0), &cfg, t, commit, planes, p).with_kernel(Kernel::V3);
            match compiled(&s) {
                Ok(c) => println!(
                    "v3 plan {}/{}/{} {commit:?} planes {planes} T {}: {}",
                    p.ncb,
                    p.rg,
                    p.minb,
                    if t > 8 {
                        "run-time".to_string()
                    } else {
                        t.to_string()
                    },
                    resource_line(&c.log)
                ),
                Err(e) => println!("v3 plan {p:?} T {t}: {e}"),
            }
        }
    }
    for b in [1usize, 2, 4, 8, 256] {
        println!("B {b}: {:?}", Plan::choose(128, 48, b, 132));
    }
}
