//! Compiles every kernel specialisation the planner can produce through NVRTC, with no GPU needed. Skips with
//! a message only when libnvrtc cannot be loaded and `GDN_REQUIRE_NVRTC` is unset (CI sets it).

use gdn::{Config, DType, Gate, HeadMap, PoolOptions, Shape, StateLayout};
use gdn_cuda::spec::{self, all_specs, compiled, Io, Plan, Spec, CLUSTER_SIZES, MAX_CONST_T};

fn nvrtc_or_skip(test: &str) -> bool {
    if spec::nvrtc_present() {
        return true;
    }
    // CI installs libnvrtc so that a kernel that does not compile fails it: there, a missing library is a failure
    assert!(
        std::env::var_os("GDN_REQUIRE_NVRTC").is_none(),
        "{test}: GDN_REQUIRE_NVRTC is set but libnvrtc cannot be loaded"
    );
    use std::io::Write;
    let _ = writeln!(
        std::io::stderr(),
        "SKIPPED {test}: libnvrtc not found (run crates/gdn-cuda/ci-nvrtc.sh or put nvidia-cuda-nvrtc's lib on LD_LIBRARY_PATH)"
    );
    false
}

/// Compiles `specs` on a few threads and fails with every failure listed.
fn assert_all_compile(specs: Vec<spec::Spec>) -> usize {
    let n = specs.len();
    let threads = std::thread::available_parallelism()
        .map_or(2, |n| n.get())
        .min(8);
    let specs = std::sync::Mutex::new(specs);
    let failures = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let next = specs.lock().unwrap().pop();
                let Some(sp) = next else { break };
                if let Err(e) = compiled(&sp) {
                    failures.lock().unwrap().push(format!("{sp:?}: {e}"));
                }
            });
        }
    });
    let failures = failures.into_inner().unwrap();
    assert!(
        failures.is_empty(),
        "{} of {n} failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
    n
}

/// Every f32 specialisation for the seed shape the planner can produce (windows 1..=8 and the run-time length,
/// planes on/off, verify/commit) under every plan it picks for batches 1..=256 on an H200 (132 SMs), for sm_90,
/// with both gates and both head maps at T 1 and the run-time length.
#[test]
fn every_seed_specialisation_compiles() {
    if !nvrtc_or_skip("every_seed_specialisation_compiles") {
        return;
    }
    let batches = [1, 2, 4, 8, 16, 256];
    let mut specs = all_specs((9, 0), &Config::new(Shape::SEED), 132, &batches);
    for gate in [Gate::Sigmoid, Gate::Silu] {
        for head_map in [HeadMap::Tiled, HeadMap::Grouped] {
            let mut cfg = Config::new(Shape::SEED);
            cfg.gate = gate;
            cfg.head_map = head_map;
            specs.extend(
                all_specs((9, 0), &cfg, 132, &batches)
                    .into_iter()
                    .filter(|s| s.t <= 1 && s.commit),
            );
        }
    }
    specs.sort_by_key(|s| format!("{s:?}"));
    specs.dedup();
    let n = assert_all_compile(specs);
    eprintln!("compiled {n} seed specialisations");
}

/// The dtypes, the bf16 state and both layouts at the seed shape: every state/layout pair at every window
/// (1..=8, run-time) for commit, and for verify at T 1 and run-time, planes on; every dtype in every tensor
/// position (the others f32) under each state/layout pair at T 1 and the run-time length; all-bf16 and
/// all-f16 calls.
#[test]
fn every_dtype_state_and_layout_compiles() {
    if !nvrtc_or_skip("every_dtype_state_and_layout_compiles") {
        return;
    }
    let cfg = Config::new(Shape::SEED);
    let plan = Plan::choose(128, 48, 1, 132).unwrap();
    let mut specs = Vec::new();
    let dts = [DType::F32, DType::Bf16, DType::F16];
    for state in [DType::F32, DType::Bf16] {
        for layout in [StateLayout::KeyMajor, StateLayout::ValueMajor] {
            let pool = PoolOptions { state, layout };
            let base = |t: Option<usize>, commit: bool, planes: bool| {
                Spec::new((9, 0), &cfg, t, commit, planes, plan).with_pool(pool)
            };
            for t in (1..=MAX_CONST_T).map(Some).chain([None]) {
                specs.push(base(t, true, true));
                specs.push(base(t, true, false));
            }
            // the register path of a bf16 state at T 1 (calls too small to fill the device)
            specs.push(base(Some(1), true, true).with_stage(false));
            specs.push(base(Some(1), false, false).with_stage(false));
            for t in [Some(1), None] {
                specs.push(base(t, false, true));
                specs.push(base(t, false, false));
                for d in [DType::Bf16, DType::F16] {
                    for pos in 0..5 {
                        let mut io = [DType::F32; 5];
                        io[pos] = d;
                        let io = Io::new([io[0], io[1], io[2], io[3]], io[4]);
                        specs.push(base(t, true, true).with_io(io));
                    }
                }
                for d in dts {
                    specs.push(base(t, true, false).with_io(Io::all(d)));
                }
            }
        }
    }
    specs.sort_by_key(|s| format!("{s:?}"));
    specs.dedup();
    let n = assert_all_compile(specs);
    eprintln!("compiled {n} dtype / state / layout specialisations");
}

/// Every cluster size's split (the planner's and the plan overrides' kind) for the small shapes the
/// conformance suite uses, the seed shape and larger heads, T 1 and run-time, commit and verify, with f32 and a
/// bf16 value-major state.
#[test]
fn every_split_compiles_for_other_shapes() {
    if !nvrtc_or_skip("every_split_compiles_for_other_shapes") {
        return;
    }
    let mut specs = Vec::new();
    for (d, h_k, h_v) in [
        (16, 1, 2),
        (32, 2, 4),
        (48, 2, 6),
        (64, 3, 12),
        (256, 4, 8),
        (512, 2, 4),
    ] {
        let cfg = Config::new(Shape::new(d, h_k, h_v).unwrap());
        for ncb in CLUSTER_SIZES {
            if let Some(plan) = Plan::for_ncb(d, ncb) {
                for t in [Some(1), None] {
                    for commit in [true, false] {
                        let s = Spec::new((9, 0), &cfg, t, commit, true, plan);
                        specs.push(s);
                        specs.push(s.with_pool(PoolOptions {
                            state: DType::Bf16,
                            layout: StateLayout::ValueMajor,
                        }));
                    }
                }
            }
        }
    }
    assert_all_compile(specs);
}

/// The planner finds a valid split for the usual head dims, and for any other d either a valid split or a clean
/// `Unavailable` (the state must fit in registers).
#[test]
fn planner_covers_shapes() {
    for d in (16..=1024).step_by(16) {
        for b in [1, 7, 300] {
            match Plan::choose(d, 4, b, 132) {
                Ok(p) => assert!(p.valid_for(d), "{p:?} for d {d}"),
                Err(gdn::Error::Unavailable(_)) => {
                    assert!(
                        ![16, 32, 48, 64, 96, 128, 192, 256].contains(&d),
                        "d {d} has no split"
                    )
                }
                Err(e) => panic!("d {d}: {e}"),
            }
        }
    }
    assert!(matches!(
        Plan::choose(1024, 4, 1, 132),
        Err(gdn::Error::Unavailable(_))
    ));
}

/// The step on memory the caller owns (`GDN_EXT`): every conv-state dtype under every state dtype and layout,
/// at T 1 (staged and not), T 2 and the run-time length, commit and verify, planes on and off; 16-bit
/// activations; both gates and head maps; and the cluster splits of a small and a large head.
#[test]
fn every_external_specialisation_compiles() {
    if !nvrtc_or_skip("every_external_specialisation_compiles") {
        return;
    }
    let cfg = Config::new(Shape::SEED);
    let plan = Plan::choose(128, 48, 1, 132).unwrap();
    let mut specs = Vec::new();
    for conv in [DType::F32, DType::Bf16, DType::F16] {
        for state in [DType::F32, DType::Bf16] {
            for layout in [StateLayout::KeyMajor, StateLayout::ValueMajor] {
                let pool = PoolOptions { state, layout };
                for t in [Some(1), Some(2), None] {
                    for commit in [true, false] {
                        let s = Spec::new((9, 0), &cfg, t, commit, false, plan)
                            .with_pool(pool)
                            .with_ext(conv);
                        specs.push(s);
                        specs.push(s.with_stage(false));
                        if t == Some(1) && commit {
                            // one wave (B 1): the readers' cluster instead of the counters
                            let one = s.with_stage(false).with_tune(None, 48, 132);
                            assert_eq!(one.readers_cluster(), Some(3));
                            specs.push(one);
                        }
                    }
                }
                specs.push(
                    Spec::new((9, 0), &cfg, None, true, true, plan)
                        .with_pool(pool)
                        .with_ext(conv),
                );
            }
        }
        for d in [DType::Bf16, DType::F16] {
            specs.push(
                Spec::new((9, 0), &cfg, Some(1), true, false, plan)
                    .with_io(Io::all(d))
                    .with_ext(conv),
            );
        }
    }
    for gate in [Gate::Sigmoid, Gate::Silu] {
        for head_map in [HeadMap::Tiled, HeadMap::Grouped] {
            let mut c = Config::new(Shape::SEED);
            c.gate = gate;
            c.head_map = head_map;
            specs.push(Spec::new((9, 0), &c, None, true, false, plan).with_ext(DType::Bf16));
            specs.push(
                Spec::new((9, 0), &c, Some(1), true, false, plan)
                    .with_ext(DType::Bf16)
                    .with_tune(None, 48, 132),
            );
        }
    }
    for (d, h_k, h_v) in [(32, 2, 4), (256, 4, 8)] {
        let cfg = Config::new(Shape::new(d, h_k, h_v).unwrap());
        for ncb in CLUSTER_SIZES {
            if let Some(plan) = Plan::for_ncb(d, ncb) {
                for commit in [true, false] {
                    specs.push(
                        Spec::new((9, 0), &cfg, None, commit, true, plan).with_ext(DType::F32),
                    );
                }
            }
        }
    }
    // the pool's header is unchanged by the external step's macros
    let pool_spec = Spec::new((9, 0), &cfg, Some(1), true, false, plan);
    assert!(!pool_spec.header().contains("GDN_EXT"));
    assert!(pool_spec
        .with_ext(DType::F32)
        .header()
        .contains("#define GDN_EXT 1"));
    specs.sort_by_key(|s| format!("{s:?}"));
    specs.dedup();
    let n = assert_all_compile(specs);
    eprintln!("compiled {n} external-memory specialisations");
}

/// The speculative step (`GDN_SPEC`): every state dtype x layout at every window (1..=8, run-time), planes on
/// and off, 16-bit activations, both gates and head maps, and every cluster split of a small and a large head
/// (the cross-block history barrier of the accepted prefix). Its ptxas report (registers, spills) is printed.
#[test]
fn every_speculative_specialisation_compiles() {
    if !nvrtc_or_skip("every_speculative_specialisation_compiles") {
        return;
    }
    let cfg = Config::new(Shape::SEED);
    let plan = Plan::choose(128, 48, 1, 132).unwrap();
    let mut specs = Vec::new();
    for state in [DType::F32, DType::Bf16] {
        for layout in [StateLayout::KeyMajor, StateLayout::ValueMajor] {
            let pool = PoolOptions { state, layout };
            for t in (1..=MAX_CONST_T).map(Some).chain([None]) {
                let s = Spec::new((9, 0), &cfg, t, true, false, plan)
                    .with_pool(pool)
                    .with_speculative();
                specs.push(s);
                if t.is_none() || t == Some(1) || t == Some(4) {
                    specs.push(Spec { planes: true, ..s });
                    specs.push(s.with_io(Io::all(DType::Bf16)));
                    specs.push(s.with_io(Io::all(DType::F16)));
                }
            }
        }
    }
    for gate in [Gate::Sigmoid, Gate::Silu] {
        for head_map in [HeadMap::Tiled, HeadMap::Grouped] {
            let mut c = Config::new(Shape::SEED);
            c.gate = gate;
            c.head_map = head_map;
            specs.push(Spec::new((9, 0), &c, None, true, false, plan).with_speculative());
        }
    }
    // the shapes of the GPU tests (d 64 with a tiled map and the sigmoid gate among them)
    for (d, h_k, h_v) in [(32, 2, 4), (64, 3, 12), (256, 4, 8)] {
        let mut c = Config::new(Shape::new(d, h_k, h_v).unwrap());
        if d == 64 {
            c.gate = Gate::Sigmoid;
            c.head_map = HeadMap::Tiled;
        }
        for ncb in CLUSTER_SIZES {
            if let Some(p) = Plan::for_ncb(d, ncb) {
                for t in [Some(4), None] {
                    let s = Spec::new((9, 0), &c, t, true, true, p).with_speculative();
                    specs.push(s);
                    specs.push(s.with_pool(PoolOptions {
                        state: DType::Bf16,
                        layout: StateLayout::ValueMajor,
                    }));
                }
            }
        }
    }
    for s in [
        Spec::new((9, 0), &cfg, Some(4), true, false, plan).with_speculative(),
        Spec::new((9, 0), &cfg, None, true, false, plan).with_speculative(),
        Spec::new((9, 0), &cfg, Some(4), true, false, plan)
            .with_pool(PoolOptions {
                state: DType::Bf16,
                layout: StateLayout::ValueMajor,
            })
            .with_speculative(),
    ] {
        if let Ok(c) = compiled(&s) {
            eprintln!(
                "speculative t {} state {:?} {:?}: {}",
                s.t,
                s.pool.state,
                s.pool.layout,
                spec::resource_line(&c.log)
            );
        }
    }
    let n = assert_all_compile(specs);
    eprintln!("compiled {n} speculative specialisations");
}

/// The speculative step on memory the caller owns (`GDN_SPEC` with `GDN_EXT`, `CudaLayer::step_spec_raw`): every
/// conv-state dtype under every state dtype and layout, at T 1, 4 and the run-time length (planes with it), 16-bit
/// activations, both gates and head maps, and a head of d 256 over a cluster of two blocks.
#[test]
fn every_external_speculative_specialisation_compiles() {
    if !nvrtc_or_skip("every_external_speculative_specialisation_compiles") {
        return;
    }
    let cfg = Config::new(Shape::SEED);
    let plan = Plan::choose(128, 48, 1, 132).unwrap();
    let mut specs = Vec::new();
    for conv in [DType::F32, DType::Bf16, DType::F16] {
        for state in [DType::F32, DType::Bf16] {
            for layout in [StateLayout::KeyMajor, StateLayout::ValueMajor] {
                let pool = PoolOptions { state, layout };
                for t in [Some(1), Some(4), None] {
                    specs.push(
                        Spec::new((9, 0), &cfg, t, true, t.is_none(), plan)
                            .with_pool(pool)
                            .with_ext(conv)
                            .with_speculative(),
                    );
                }
            }
        }
    }
    specs.push(
        Spec::new((9, 0), &cfg, None, true, false, plan)
            .with_io(Io::all(DType::Bf16))
            .with_ext(DType::Bf16)
            .with_speculative(),
    );
    for gate in [Gate::Sigmoid, Gate::Silu] {
        for head_map in [HeadMap::Tiled, HeadMap::Grouped] {
            let mut c = Config::new(Shape::SEED);
            c.gate = gate;
            c.head_map = head_map;
            specs.push(
                Spec::new((9, 0), &c, None, true, false, plan)
                    .with_ext(DType::F32)
                    .with_speculative(),
            );
        }
    }
    let big = Config::new(Shape::new(256, 4, 8).unwrap());
    let p2 = Plan::for_ncb(256, 2).unwrap();
    specs.push(
        Spec::new((9, 0), &big, None, true, false, p2)
            .with_ext(DType::F32)
            .with_speculative(),
    );
    specs.sort_by_key(|s| format!("{s:?}"));
    specs.dedup();
    let n = assert_all_compile(specs);
    eprintln!("compiled {n} external speculative specialisations");
}

/// The speculative macro is added only to its own specialisations: a plain one's source has no `GDN_SPEC` line,
/// so its machine code is what it was before the speculative step existed (checked byte for byte against the
/// previous kernel source at `202a20b` when it was added: 40 pool and 40 external specialisations, see NOTES.md).
#[test]
fn plain_specialisations_have_no_speculative_macro() {
    let cfg = Config::new(Shape::SEED);
    let plan = Plan::choose(128, 48, 1, 132).unwrap();
    let s = Spec::new((9, 0), &cfg, Some(4), true, false, plan);
    assert!(!s.header().contains("GDN_SPEC"));
    assert!(s.with_speculative().header().contains("#define GDN_SPEC 1"));
    assert!(!s
        .with_pool(PoolOptions {
            state: DType::Bf16,
            layout: StateLayout::KeyMajor
        })
        .with_speculative()
        .staged());
}

/// The quantized out_proj's kernels compile for sm_90 without spilling (ptxas's report printed).
#[test]
fn quant_kernels_compile() {
    if !nvrtc_or_skip("quant_kernels_compile") {
        return;
    }
    use gdn_cuda::quant::{QuantTune, TILES};
    // the default module pair, then the tensor-core kernel's other blocks and splits in the TT 8 module
    let mut cases: Vec<(usize, QuantTune)> =
        TILES.iter().map(|&tt| (tt, QuantTune::DEFAULT)).collect();
    // (warps, n-tiles, split over a cluster); every module also holds the fixed 4 x 1 and 8 x 4 blocks
    for (mma_warps, mma_ntiles, mma_split) in [(8, 1, 8), (8, 2, 4), (2, 1, 2)] {
        let t = QuantTune {
            mma_warps,
            mma_ntiles,
            mma_split,
            ..QuantTune::DEFAULT
        };
        cases.push((TILES[1], t));
    }
    for (tt, tune) in cases {
        let c = gdn_cuda::quant::compiled_quant_with((9, 0), tt, &tune).unwrap();
        eprintln!(
            "TT {tt}, tensor-core block {} x {} / {}:",
            tune.mma_warps, tune.mma_ntiles, tune.mma_split
        );
        let report: Vec<&str> = c
            .log
            .lines()
            .filter(|l| {
                l.contains("Compiling entry") || l.contains("registers") || l.contains("spill")
            })
            .collect();
        eprintln!("{}", report.join("\n"));
        // ptxas may park a word or two on the stack; more would mean the tiles are too large for the registers
        for l in c.log.lines().filter(|l| l.contains("spill stores")) {
            let bytes: usize = l
                .split("bytes spill stores")
                .next()
                .and_then(|h| h.rsplit(',').next())
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(usize::MAX);
            assert!(bytes <= 16, "quant kernels spill: {l}");
        }
    }
}

/// The memory hints (L2 prefetch ahead, own-state prefetch before the wait) on every state dtype and layout, the
/// staged and the register path, the external and the speculative kernels, and a cluster split.
#[test]
fn every_memory_hint_compiles() {
    if !nvrtc_or_skip("every_memory_hint_compiles") {
        return;
    }
    let cfg = Config::new(Shape::SEED);
    let big = Plan::choose(128, 48, 256, 132).unwrap();
    let small = Plan::with_rg(128, 2, big.rg);
    // the planner's, both hints
    let hints = [
        None,
        Some(spec::Tune {
            ahead_half_waves: 1,
            prewait: true,
            phased: false,
        }),
    ];
    let mut specs = Vec::new();
    for state in [DType::F32, DType::Bf16] {
        for layout in [StateLayout::KeyMajor, StateLayout::ValueMajor] {
            let pool = PoolOptions { state, layout };
            for t in [Some(1), Some(8), None] {
                for commit in [false, true] {
                    for (plan, blocks) in [(big, 256 * 48), (small, 96)] {
                        // the verify kernels and the cluster split under the default hints only
                        let n = if commit && plan == big {
                            hints.len()
                        } else {
                            1
                        };
                        for &tune in &hints[..n] {
                            let s = Spec::new((9, 0), &cfg, t, commit, false, plan)
                                .with_pool(pool)
                                .with_stage(blocks > 1000)
                                .with_tune(tune, blocks, 132);
                            if tune.is_some() {
                                assert_eq!(s.ahead > 0, blocks > 1000, "{s:?}");
                            }
                            specs.push(s);
                            specs.push(s.with_ext(DType::Bf16));
                            specs.push(s.with_speculative());
                        }
                    }
                }
            }
        }
    }
    specs.sort_by_key(|s| format!("{s:?}"));
    specs.dedup();
    assert_all_compile(specs);
}

/// The window kernel and the routed token-serial kernel beside it, for the head dims the window kernel takes (64
/// and 128), every state dtype and layout, 16-bit tensors, planes, verify and commit,
/// T 2..=8 and the run-time length, both gates and head maps.
#[test]
fn every_window_specialisation_compiles() {
    if !nvrtc_or_skip("every_window_specialisation_compiles") {
        return;
    }
    let mut specs = Vec::new();
    for d in (16..=256).step_by(16) {
        let shape = Shape::new(d, 2, 4).unwrap();
        let cfg = Config::new(shape);
        let plan = Plan::choose(d, 4, 1, 132).unwrap();
        let base = Spec::new((9, 0), &cfg, None, true, false, plan);
        assert_eq!(base.window_fits(), d == 64 || d == 128, "d {d}");
        if !base.window_fits() {
            continue;
        }
        specs.push(base.with_window(1, 132, None));
        specs.push(base.with_route());
    }
    let plan = Plan::choose(128, 48, 256, 132).unwrap();
    for (gate, map) in [
        (Gate::Sigmoid, HeadMap::Tiled),
        (Gate::Silu, HeadMap::Grouped),
    ] {
        let mut cfg = Config::new(Shape::SEED);
        cfg.gate = gate;
        cfg.head_map = map;
        for state in [DType::F32, DType::Bf16] {
            for layout in [StateLayout::KeyMajor, StateLayout::ValueMajor] {
                for t in (2..=MAX_CONST_T).map(Some).chain([None]) {
                    for (commit, planes, io) in [
                        (false, false, DType::F32),
                        (true, true, DType::Bf16),
                        (true, false, DType::F16),
                    ] {
                        let s = Spec::new((9, 0), &cfg, t, commit, planes, plan)
                            .with_io(Io::all(io))
                            .with_pool(PoolOptions { state, layout });
                        // a call of many waves: with the L2 prefetch ahead
                        specs.push(s.with_window(256 * 48, 132, None));
                        if t.is_none() {
                            specs.push(s.with_route());
                        }
                    }
                }
            }
        }
    }
    let n = assert_all_compile(specs);
    assert!(n > 200, "{n}");
}
