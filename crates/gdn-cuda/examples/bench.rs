//! The CUDA backend's benchmark at the seed shape (device runs): copy ceiling, the step at B x T for f32 and
//! bf16 states, both layouts, f32 and bf16 activations, a mixed batch, host cost, and the ptxas report of what
//! it ran. Usage: `bench [quick] [table] [sweep] [mixed]` (or `bench decode`, `bench windows` alone); writes a
//! markdown table to $OUT/bench-cuda.md when OUT is set. `GDN_CUDA_PLAN=ncb,rg,minb` forces a split, `GDN_CUDA_PDL=0` turns off programmatic dependent
//! launch (read here and passed in through the API; the library reads no environment).

use std::fmt::Write as _;

use gdn::synth::Synth;
use gdn::{
    Backend, Commit, Config, DType, Gate, LayerPool, PoolOptions, RowsData, Seq, Shape,
    StateLayout, Step,
};
use gdn_cuda::{spec, Cuda, Plan, Tune};

struct Row {
    what: String,
    b: usize,
    t: usize,
    state: DType,
    us: f64,
    host_us: f64,
    /// bytes of S read + written a call
    bytes: f64,
}

#[derive(Clone, Copy)]
struct Case {
    gate: Gate,
    state: DType,
    layout: StateLayout,
    io: DType,
}

fn time(cuda: &Cuda, c: Case, lens: &[usize], plan: Option<Plan>) -> gdn::Result<(f64, f64)> {
    time_rot(cuda, c, lens, plan, None, 1, Commit::All)
}

/// `time` with memory hints `tune` (None: the planner's) over `sets` sets of slots taken in turn (1: the same
/// slots every call, their states stay in L2 where they fit; more: each call's states come from memory), every
/// sequence committing as `commit` says.
fn time_rot(
    cuda: &Cuda,
    c: Case,
    lens: &[usize],
    plan: Option<Plan>,
    tune: Option<Tune>,
    sets: usize,
    commit: Commit,
) -> gdn::Result<(f64, f64)> {
    let mut cu = cuda.clone();
    if plan.is_some() {
        cu.set_plan_override(plan);
    }
    if tune.is_some() {
        cu.set_tune_override(tune);
    }
    let mut cfg = Config::new(Shape::SEED);
    cfg.gate = c.gate;
    let rows: usize = lens.iter().sum();
    let mut rng = Synth::new(7 + lens.len() as u64 * 31 + rows as u64);
    let layer = rng.layer(cfg)?;
    let opts = PoolOptions {
        state: c.state,
        layout: c.layout,
    };
    let mut pool = cu.create_cuda_pool(&layer, lens.len() * sets, opts)?;
    let batch = rng.batch(&layer, rows, 1);
    let data = RowsData::from_f32(&batch.qkv, &batch.alpha, &batch.beta, &batch.z, [c.io; 4]);
    let mut at = 0;
    let seqs: Vec<Seq> = lens
        .iter()
        .enumerate()
        .map(|(i, &len)| {
            let s = Seq {
                slot: i as i32,
                start: at,
                len,
                commit,
            };
            at += len;
            s
        })
        .collect();
    let set_seqs: Vec<Vec<Seq>> = (0..sets)
        .map(|k| {
            seqs.iter()
                .map(|q| Seq {
                    slot: q.slot + (k * lens.len()) as i32,
                    ..*q
                })
                .collect()
        })
        .collect();
    let steps: Vec<Step> = set_seqs
        .iter()
        .map(|q| Step {
            rows: data.view(),
            seqs: q,
            plane_stride: None,
        })
        .collect();
    let timing = if sets > 1 {
        pool.time_varlen_rotating(&steps, c.io, 20)?
    } else {
        pool.time_varlen(&steps[0], c.io, 20)?
    };
    Ok((
        timing.per_call.as_secs_f64() * 1e6,
        timing
            .host_per_call
            .map_or(f64::NAN, |d| d.as_secs_f64() * 1e6),
    ))
}

fn main() -> gdn::Result<()> {
    let arg = |a: &str| std::env::args().any(|x| x == a);
    let mut cuda = Cuda::new()?;
    if let Ok(v) = std::env::var("GDN_CUDA_PLAN") {
        cuda.set_plan_override(Some(v.parse()?));
    }
    if std::env::var("GDN_CUDA_PDL").is_ok_and(|v| v == "0") {
        cuda.set_pdl(false);
    }
    println!("backend: {}", cuda.name());
    let copy = cuda.copy_ceiling(1 << 30)?;
    println!(
        "copy ceiling: {:.3} TB/s (read + write, 1 GiB, events, median)",
        copy / 1e12
    );
    let sbytes = |b: usize, state: DType| 2.0 * (b * Shape::SEED.state_len() * state.size()) as f64;
    let base = Case {
        gate: Gate::Sigmoid,
        state: DType::F32,
        layout: StateLayout::KeyMajor,
        io: DType::F32,
    };
    let mut rows = Vec::new();
    let mut push = |what: String, c: Case, b: usize, t: usize, lens: &[usize], plan| match time(
        &cuda, c, lens, plan,
    ) {
        Ok((us, host_us)) => {
            let r = Row {
                what,
                b,
                t,
                state: c.state,
                us,
                host_us,
                bytes: sbytes(lens.len(), c.state),
            };
            println!(
                "{:<40} B {:>3} T {:>2} {:>9.2} us  {:>5.1}% of copy  host {:.2} us",
                r.what,
                b,
                t,
                r.us,
                100.0 * r.bytes / (r.us * 1e-6) / copy,
                r.host_us
            );
            rows.push(r);
        }
        Err(e) => println!("{what} B {b} T {t} failed: {e}"),
    };
    if arg("quick") || arg("table") {
        let bs: &[usize] = if arg("table") {
            &[1, 8, 32, 128, 256]
        } else {
            &[1, 256]
        };
        for state in [DType::F32, DType::Bf16] {
            for layout in [StateLayout::KeyMajor, StateLayout::ValueMajor] {
                for io in [DType::F32, DType::Bf16] {
                    for &b in bs {
                        for t in [1usize, 8] {
                            if io == DType::Bf16 && t == 8 && !arg("table") {
                                continue;
                            }
                            let c = Case {
                                state,
                                layout,
                                io,
                                ..base
                            };
                            let what = format!(
                                "state {} {} io {}",
                                state.name(),
                                layout.name(),
                                io.name()
                            );
                            push(what, c, b, t, &vec![t; b], None);
                        }
                    }
                }
            }
        }
    }
    if arg("sweep") {
        // splits and register budgets of the bf16 state (the packed registers at T 1 leave room for more blocks)
        for layout in [StateLayout::KeyMajor, StateLayout::ValueMajor] {
            // (a staged bf16 state at T 1 compiles for the plan's minb + 4 (key-major) or + 2 blocks an SM)
            for (ncb, rg, minb) in [(1, 2, 1), (1, 2, 2), (1, 2, 3), (1, 2, 4)] {
                let c = Case {
                    state: DType::Bf16,
                    layout,
                    ..base
                };
                let p = Plan { ncb, rg, minb };
                for (b, t) in [(256usize, 1usize), (1, 1)] {
                    push(
                        format!("bf16 {} plan {ncb}/{rg}/{minb}", layout.name()),
                        c,
                        b,
                        t,
                        &vec![t; b],
                        Some(p),
                    );
                }
            }
        }
    }
    if arg("mixed") {
        // 255 decode sequences and one 64-token window in one call, against the two calls it replaces
        for state in [DType::F32, DType::Bf16] {
            let c = Case { state, ..base };
            let mut lens = vec![1usize; 255];
            lens.push(64);
            push(
                format!("mixed 255x1 + 1x64 {}", state.name()),
                c,
                256,
                0,
                &lens,
                None,
            );
            push(
                format!("alone 255x1 {}", state.name()),
                c,
                255,
                1,
                &[1; 255],
                None,
            );
            push(
                format!("alone 1x64 {}", state.name()),
                c,
                1,
                64,
                &[64],
                None,
            );
        }
    }
    if arg("windows") {
        return window_forms(&cuda);
    }
    if arg("decode") {
        // the variant table alone (no ptxas report: its compiles take device time)
        return decode_variants(&cuda, copy, &mut rows);
    }
    println!("\n## ptxas report of the seed specialisations (commit, no planes)");
    let plan = Plan::choose(128, 48, 1, cuda.multiprocessors())?;
    for state in [DType::F32, DType::Bf16] {
        for layout in [StateLayout::KeyMajor, StateLayout::ValueMajor] {
            for t in [Some(1), Some(8), None] {
                let s =
                    spec::Spec::new(cuda.arch(), &Config::new(Shape::SEED), t, true, false, plan)
                        .with_pool(PoolOptions { state, layout });
                if let Ok(c) = spec::compiled(&s) {
                    println!(
                        "state {} {} T {t:?}: {}",
                        state.name(),
                        layout.name(),
                        spec::resource_line(&c.log)
                    );
                }
            }
        }
    }
    let mut md = String::new();
    let _ = writeln!(
        md,
        "copy ceiling {:.3} TB/s; % of copy = S bytes read + written (B x 48 x 128 x 128 x 2 x dtype size) / time / ceiling",
        copy / 1e12
    );
    let _ = writeln!(
        md,
        "\n| case | B | T | state | µs / call (graph) | % of copy | host µs / call |"
    );
    let _ = writeln!(md, "|---|---|---|---|---|---|---|");
    for r in &rows {
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {:.2} | {:.1} | {:.2} |",
            r.what,
            r.b,
            r.t,
            r.state.name(),
            r.us,
            100.0 * r.bytes / (r.us * 1e-6) / copy,
            r.host_us
        );
    }
    println!("\n{md}");
    if let Ok(out) = std::env::var("OUT") {
        let _ = std::fs::write(format!("{out}/bench-cuda.md"), &md);
    }
    Ok(())
}

/// Rotation footprint of `decode`: enough slot sets that every call's states come from memory (60 MiB L2).
const ROTATE_BYTES: usize = 1 << 30;

/// `bench decode`: the decode step (T 1, and T 8 as a check) at B 1, 32 and 256 for f32 and bf16 states under
/// variants of the plan and the memory hints, each in cache (the same slots every call) and rotated (slot sets
/// spanning ROTATE_BYTES), beside the copy ceiling rotated the same way and an empty kernel's graph replay.
/// `GDN_CUDA_VARIANTS=a,b,..` picks variants by name.
fn decode_variants(cuda: &Cuda, copy: f64, rows: &mut Vec<Row>) -> gdn::Result<()> {
    let sh = Shape::SEED;
    for (blocks, threads) in [(48u32, 256u32), (96, 128), (192, 64)] {
        let e = gdn_cuda::empty_kernel_time(cuda, blocks, threads)?;
        println!(
            "empty kernel {blocks} x {threads} threads: {:.2} us per launch (graph replay, PDL {})",
            e.as_secs_f64() * 1e6,
            if std::env::var("GDN_CUDA_PDL").is_ok_and(|v| v == "0") {
                "off"
            } else {
                "on"
            }
        );
    }
    let one = Plan::choose(128, 48, 256, cuda.multiprocessors())?;
    let tune = |ahead_half_waves, prewait| {
        Some(Tune {
            ahead_half_waves,
            prewait,
            phased: true,
        })
    };
    // (name, plan override, hints override: None the planner's)
    let variants: Vec<(&str, Option<Plan>, Option<Tune>)> = vec![
        ("old", Some(one), Some(Tune::NONE)),
        ("prewait", Some(one), tune(0, true)),
        ("ahead0.5", Some(one), tune(1, false)),
        ("ahead1", Some(one), tune(2, false)),
        ("default", None, None),
    ];
    let pick: Option<Vec<String>> = std::env::var("GDN_CUDA_VARIANTS")
        .ok()
        .map(|v| v.split(',').map(|x| x.trim().to_string()).collect());
    let base = Case {
        gate: Gate::Sigmoid,
        state: DType::F32,
        layout: StateLayout::KeyMajor,
        io: DType::F32,
    };
    let cases = [
        base,
        Case {
            state: DType::Bf16,
            ..base
        },
        Case {
            state: DType::Bf16,
            layout: StateLayout::ValueMajor,
            io: DType::Bf16,
            ..base
        },
    ];
    // compile every specialisation the table runs first, in parallel (NVRTC is single-threaded per program)
    let t0 = std::time::Instant::now();
    let mut specs = Vec::new();
    let layer = Synth::new(1).layer(Config::new(sh))?;
    for c in cases {
        for (b, t) in SIZES {
            for (name, plan, tune) in &variants {
                if skip(name, b, t) {
                    continue;
                }
                let mut cu = cuda.clone();
                cu.set_plan_override(*plan);
                cu.set_tune_override(*tune);
                let pool = cu.create_cuda_pool(
                    &layer,
                    1,
                    PoolOptions {
                        state: c.state,
                        layout: c.layout,
                    },
                )?;
                specs.push(pool.spec(&gdn_cuda::StepKind {
                    uniform_len: Some(t),
                    commits: true,
                    planes: false,
                    io: spec::Io::all(c.io),
                    seqs: b,
                })?);
            }
        }
    }
    let specs = std::sync::Mutex::new(specs);
    std::thread::scope(|s| {
        for _ in 0..16 {
            s.spawn(|| loop {
                let next = specs.lock().map(|mut v| v.pop()).ok().flatten();
                let Some(sp) = next else { break };
                let _ = spec::compiled(&sp);
            });
        }
    });
    println!(
        "compiled the table's kernels in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    println!(
        "\n| case | variant | B | T | in cache us | % copy | rotated us | % rotated copy | sets |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for c in cases {
        for (b, t) in SIZES {
            let state_bytes = b * sh.state_len() * c.state.size();
            let sets = ROTATE_BYTES.div_ceil(state_bytes).max(2);
            let rot_copy = cuda.copy_ceiling_rotating(state_bytes, sets)?;
            let what = format!(
                "state {} {} io {}",
                c.state.name(),
                c.layout.name(),
                c.io.name()
            );
            println!(
                "copy ceiling rotated ({what}, B {b}): {:.3} TB/s over {sets} parts of {:.1} MiB",
                rot_copy / 1e12,
                state_bytes as f64 / (1 << 20) as f64
            );
            for (name, plan, tune) in &variants {
                if pick.as_ref().is_some_and(|p| !p.iter().any(|x| x == name)) {
                    continue;
                }
                if skip(name, b, t) {
                    continue;
                }
                let lens = vec![t; b];
                let cached = time_rot(cuda, c, &lens, *plan, *tune, 1, Commit::All);
                let rotated = time_rot(cuda, c, &lens, *plan, *tune, sets, Commit::All);
                match (cached, rotated) {
                    (Ok((us, host_us)), Ok((rus, _))) => {
                        let bytes = 2.0 * state_bytes as f64;
                        println!(
                            "| {what} | {name} | {b} | {t} | {us:.2} | {:.1} | {rus:.2} | {:.1} | {sets} |",
                            100.0 * bytes / (us * 1e-6) / copy,
                            100.0 * bytes / (rus * 1e-6) / rot_copy,
                        );
                        rows.push(Row {
                            what: format!("{what} {name}"),
                            b,
                            t,
                            state: c.state,
                            us,
                            host_us,
                            bytes,
                        });
                    }
                    (a, r) => println!(
                        "{what} {name} B {b} T {t} failed: {:?} / {:?}",
                        a.err(),
                        r.err()
                    ),
                }
            }
        }
    }
    Ok(())
}

/// The (B, T) of `decode`'s table.
const SIZES: [(usize, usize); 4] = [(1, 1), (32, 1), (256, 1), (1, 8)];

/// Whether `decode` leaves variant `name` out at B `b`, T `t`: what prefetches before the wait only at B 1, what
/// works across waves only above it, at T 8 and B 32 only the old kernel and the default. (Other splits of a
/// head, timed here as variants in 2026-12-05's run, lost: NOTES.md; `GDN_CUDA_PLAN` still forces one.)
fn skip(name: &str, b: usize, t: usize) -> bool {
    (name == "prewait" && b > 1)
        || (name.starts_with("ahead") && b == 1)
        || (t > 1 && !matches!(name, "old" | "default"))
        || (b == 32 && !matches!(name, "old" | "default"))
}

/// `bench windows`: windows of 2, 4 and 8 tokens at B 1, 32 and 256, committing all or verifying, through the
/// token-serial kernel's token loop ("token": the planner's memory hints, three barriers a token), its three
/// phases ("phased": the planner's choice) and the window kernel ("window"), in cache; f32 key-major with f32 io
/// and bf16 value-major with bf16 io.
fn window_forms(cuda: &Cuda) -> gdn::Result<()> {
    let base = Case {
        gate: Gate::Sigmoid,
        state: DType::F32,
        layout: StateLayout::KeyMajor,
        io: DType::F32,
    };
    let bf = Case {
        state: DType::Bf16,
        layout: StateLayout::ValueMajor,
        io: DType::Bf16,
        ..base
    };
    println!("\n| state | commit | B | T | token us | phased us | window us | token / phased |");
    println!("|---|---|---|---|---|---|---|---|");
    for c in [base, bf] {
        for commit in [Commit::All, Commit::Verify] {
            for b in [1usize, 32, 256] {
                for t in [2usize, 4, 8] {
                    let lens = vec![t; b];
                    // the planner's hints for T >= 2: the own state prefetched before the wait in a call of one wave
                    let token = Tune {
                        ahead_half_waves: 0,
                        prewait: b * 48 <= 2 * cuda.multiprocessors(),
                        phased: false,
                    };
                    let us = |cu: &Cuda, tune| {
                        time_rot(cu, c, &lens, None, tune, 1, commit).map_or(f64::NAN, |r| r.0)
                    };
                    let tok = us(cuda, Some(token));
                    let ph = us(cuda, None);
                    let mut wcu = cuda.clone();
                    wcu.set_window_kernel(true);
                    let win = us(&wcu, None);
                    println!(
                        "| {} {} | {commit:?} | {b} | {t} | {tok:.2} | {ph:.2} | {win:.2} | {:.3} |",
                        c.state.name(),
                        c.layout.name(),
                        tok / ph
                    );
                }
            }
        }
    }
    Ok(())
}
