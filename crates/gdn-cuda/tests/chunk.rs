//! The chunked path of long windows (src/chunk.rs, kernels/gdn_chunk.cu): against the float64 oracle on long
//! windows, every commit kind, both state dtypes and layouts, and its bitwise invariants. GPU tests skip with a
//! message without a GPU, driver or libnvrtc; the compile test needs only libnvrtc.

use gdn::{Commit, DType, Gate, HeadMap, PoolOptions, RowsData, Shape, StateLayout, TensorData};
use gdn_conformance::varlen::{
    check_var, check_var_within, oracle_var, run_var, run_var_on, VarCase, VarSpec,
};
use gdn_cuda::chunk::{ChunkProducts, ChunkSpec};
use gdn_cuda::spec::Io;
use gdn_cuda::{Cuda, CudaPool};

mod common;

/// The backend with the chunked path from `min_len` tokens on (`None`: the default crossover).
fn cuda_or_skip(test: &str, min_len: Option<usize>) -> Option<Cuda> {
    common::cuda_or_skip(test).map(|mut c| {
        c.set_chunk_min_len(min_len);
        c
    })
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

fn pools() -> [PoolOptions; 4] {
    let o = |state, layout| PoolOptions { state, layout };
    [
        o(DType::F32, StateLayout::KeyMajor),
        o(DType::F32, StateLayout::ValueMajor),
        o(DType::Bf16, StateLayout::KeyMajor),
        o(DType::Bf16, StateLayout::ValueMajor),
    ]
}

/// The chunked kernels compile for every pool kind, 16-bit tensors and planes, engine memory with each conv
/// dtype, at the seed shape and three
/// others (d 16, d 48 with column blocks of 16, d 256 with chunks of 32); no GPU needed.
#[test]
fn chunked_kernels_compile() {
    if !gdn_cuda::spec::nvrtc_present() {
        eprintln!("SKIPPED chunked_kernels_compile: libnvrtc not found");
        return;
    }
    let mut n = 0;
    for (shape, grouped, silu) in [
        (Shape::SEED, false, false),
        (Shape::new(16, 1, 2).unwrap(), true, true),
        (Shape::new(48, 2, 4).unwrap(), false, true),
        (Shape::new(256, 1, 2).unwrap(), true, false),
    ] {
        let mut config = gdn::Config::new(shape);
        config.head_map = if grouped {
            HeadMap::Grouped
        } else {
            HeadMap::Tiled
        };
        config.gate = if silu { Gate::Silu } else { Gate::Sigmoid };
        // every pool kind with f32 tensors; 16-bit tensors and planes with one pool kind each (the dtypes and
        // the pool touch different lines of the source)
        let mixed = Io::new(
            [DType::F16, DType::Bf16, DType::F32, DType::F16],
            DType::F16,
        );
        let variants = pools()
            .into_iter()
            .map(|p| (p, Io::all(DType::F32), false))
            .chain([
                (pools()[3], Io::all(DType::Bf16), true),
                (pools()[0], mixed, false),
            ]);
        // the fast mode's products once a shape, with the last pool kind (a bf16 state)
        let fast = (pools()[3], Io::all(DType::F32), false, ChunkProducts::Tf32);
        let variants = variants
            .map(|(p, io, planes)| (p, io, planes, ChunkProducts::Tf32x3, None))
            .chain([(fast.0, fast.1, fast.2, fast.3, None)])
            // engine memory (CudaLayer): its conv state in each dtype, once a shape each
            .chain([
                (
                    pools()[0],
                    Io::all(DType::F32),
                    false,
                    ChunkProducts::Tf32x3,
                    Some(DType::F32),
                ),
                (
                    pools()[3],
                    Io::all(DType::Bf16),
                    true,
                    ChunkProducts::Tf32x3,
                    Some(DType::Bf16),
                ),
                (
                    pools()[1],
                    mixed,
                    false,
                    ChunkProducts::Tf32,
                    Some(DType::F16),
                ),
            ]);
        for (pool, io, planes, products, ext) in variants {
            {
                let mut spec = ChunkSpec::new((9, 0), &config, planes, io, pool, products);
                if let Some(conv) = ext {
                    spec = spec.with_ext(conv);
                }
                assert!(spec.supported(), "{spec:?}");
                let c = spec.compiled().unwrap_or_else(|e| panic!("{e}"));
                // the host loads the narrow state kernel exactly where the module has it (its name in the cubin's
                // symbols: NVRTC's log, ptxas' report, lacked it on the H100 while other tests compiled in the process)
                let narrow = b"gdn_chunk_state_narrow";
                assert_eq!(
                    c.cubin.windows(narrow.len()).any(|w| w == narrow),
                    spec.has_narrow(),
                    "{spec:?}"
                );
                if n == 0 {
                    eprintln!("seed shape: {}", gdn_cuda::spec::resource_line(&c.log));
                }
                n += 1;
            }
        }
    }
    eprintln!("{n} chunked specialisations compile");
}

fn spec(shape: Shape, seqs: &[(usize, Commit)], seed: u64) -> VarSpec {
    let mut s = VarSpec::new(shape, &[], seed);
    s.seqs = seqs.iter().map(|&(l, c)| (l, c, false, 0)).collect();
    s
}

/// Long windows against the float64 oracle: small d up to 65536 tokens, the seed's shape for two thousand, d
/// 256 (chunks of 32) and d 48 (column blocks of 16); f32 and 16-bit activations, both state dtypes and
/// layouts, planes. f32 outputs and states within 2e-6 relative.
#[test]
fn long_windows_match_the_oracle() {
    let Some(cuda) = cuda_or_skip("long_windows_match_the_oracle", None) else {
        return;
    };
    let small = Shape::new(16, 1, 2).unwrap();
    let mut cases = vec![
        ("d16 T65536", spec(small, &[(65536, Commit::All)], 1)),
        (
            "d16 mixed",
            spec(
                small,
                &[
                    (4096, Commit::First(1000)),
                    (3, Commit::All),
                    (100, Commit::Verify),
                    (1, Commit::All),
                    (777, Commit::First(777)),
                ],
                2,
            ),
        ),
        ("seed T2048", spec(Shape::SEED, &[(2048, Commit::All)], 3)),
        (
            "d256 T300",
            spec(
                Shape::new(256, 1, 2).unwrap(),
                &[(300, Commit::First(250))],
                4,
            ),
        ),
        (
            "d48 T200 tiled planes",
            spec(
                Shape::new(48, 2, 4).unwrap(),
                &[(200, Commit::First(65)), (70, Commit::All)],
                5,
            ),
        ),
    ];
    cases[4].1.head_map = HeadMap::Tiled;
    cases[4].1.gate = Gate::Sigmoid;
    cases[4].1.planes = true;
    // 16-bit activations and outputs, every pool kind
    for (i, pool) in pools().into_iter().enumerate() {
        let mut s = spec(
            Shape::new(32, 2, 4).unwrap(),
            &[(1500, Commit::First(700 + i)), (90, Commit::All)],
            10 + i as u64,
        );
        s.options = pool;
        if i % 2 == 1 {
            s.inputs = [DType::Bf16; 4];
            s.out_dtype = DType::Bf16;
        }
        cases.push(("d32 pool kinds", s));
    }
    let mut s = spec(Shape::SEED, &[(1000, Commit::First(999))], 20);
    s.options = PoolOptions {
        state: DType::Bf16,
        layout: StateLayout::ValueMajor,
    };
    s.inputs = [DType::Bf16; 4];
    s.out_dtype = DType::Bf16;
    cases.push(("seed T1000 bf16", s));
    for (name, s) in &cases {
        let case = s.build();
        let (ey, es, eh) = check_var(&cuda, &case);
        eprintln!(
            "{name}: {:?} {:?} io {:?}/{:?}: y {ey:.2e} S {es:.2e} H {eh:.2e}",
            case.layer.shape(),
            case.options,
            s.inputs[0],
            s.out_dtype,
        );
        if s.out_dtype == DType::F32 {
            assert!(ey < 2e-6, "{name}: y error {ey:.2e}");
        }
        if s.options.state == DType::F32 {
            assert!(es < 2e-6, "{name}: state error {es:.2e}");
        }
    }
}

/// The first `k` rows of a one-sequence case, committed in full.
fn truncate(case: &VarCase, k: usize) -> VarCase {
    let sh = *case.layer.shape();
    let cut = |t: &TensorData, w: usize| {
        let dtype = match t {
            TensorData::F32(_) => DType::F32,
            TensorData::Bf16(_) => DType::Bf16,
            TensorData::F16(_) => DType::F16,
        };
        TensorData::from_f32(&t.to_f32()[..k * w], dtype)
    };
    let r = &case.rows;
    let mut short = case.clone();
    short.rows = RowsData {
        qkv: cut(&r.qkv, sh.channels()),
        alpha: cut(&r.alpha, sh.h_v),
        beta: cut(&r.beta, sh.h_v),
        z: cut(&r.z, sh.n()),
    };
    short.seqs[0].len = k;
    short.seqs[0].commit = Commit::All;
    short.plane_stride = None;
    short
}

/// Through the chunked path (every window chunked here), commit first k equals a k-token window bitwise (S, H
/// and y of the first k tokens) for k inside a chunk, at a chunk's end and past it; verify writes nothing and
/// gives the same y as a commit; the same inputs give the same bits. Both state dtypes and layouts.
#[test]
fn chunked_commit_first_k_is_a_k_token_window() {
    let Some(cuda) = cuda_or_skip("chunked_commit_first_k_is_a_k_token_window", Some(1)) else {
        return;
    };
    commit_first_k_bitwise(&cuda, None);
}

/// The body of `chunked_commit_first_k_is_a_k_token_window`, for a backend that chunks every window; `bound`:
/// the oracle bound on y and S of a mode with its own (None: the dtypes' bounds).
fn commit_first_k_bitwise(cuda: &Cuda, bound: Option<f64>) {
    let t = 150;
    for (pi, pool) in pools().into_iter().enumerate() {
        let mut s = spec(
            Shape::new(32, 2, 4).unwrap(),
            &[(t, Commit::All)],
            30 + pi as u64,
        );
        s.options = pool;
        s.spare_slots = 0;
        let all = s.build();
        let got_all = run_var(cuda, &all);
        let again = run_var(cuda, &all);
        assert!(
            got_all == again,
            "{pool:?}: identical inputs gave different bits"
        );
        let mut verify = all.clone();
        verify.seqs[0].commit = Commit::Verify;
        let got_v = run_var(cuda, &verify);
        assert!(
            bits(&got_v.out.to_f32()) == bits(&got_all.out.to_f32()),
            "{pool:?}: verify y differs from commit-all y"
        );
        for (slot, (st, h)) in got_v.slots.iter().enumerate() {
            assert!(
                bits(st) == bits(&verify.init[slot].0) && bits(h) == bits(&verify.init[slot].1),
                "{pool:?}: verify changed slot {slot}"
            );
        }
        let n = all.layer.shape().n();
        for k in [1, 2, 5, 63, 64, 65, 100, 128, 129, 149, 150] {
            let mut first = all.clone();
            first.seqs[0].commit = Commit::First(k);
            let got = run_var(cuda, &first);
            let short = truncate(&all, k);
            let want = run_var(cuda, &short);
            for (slot, (g, w)) in got.slots.iter().zip(&want.slots).enumerate() {
                assert!(
                    bits(&g.0) == bits(&w.0),
                    "{pool:?} k {k}: slot {slot}'s state differs from a {k}-token window"
                );
                assert!(
                    bits(&g.1) == bits(&w.1),
                    "{pool:?} k {k}: slot {slot}'s history differs from a {k}-token window"
                );
            }
            let (gy, wy) = (got.out.to_f32(), want.out.to_f32());
            assert!(
                bits(&gy[..k * n]) == bits(&wy[..k * n]),
                "{pool:?} k {k}: y of the first {k} tokens differs"
            );
            assert!(
                bits(&gy) == bits(&got_all.out.to_f32()),
                "{pool:?} k {k}: y depends on the commit point"
            );
        }
        // and against the oracle
        let mut first = all.clone();
        first.seqs[0].commit = Commit::First(77);
        let (ey, es, _) = match bound {
            Some(b) => check_var_within(cuda, &first, b, b),
            None => check_var(cuda, &first),
        };
        eprintln!("{pool:?} T {t} First(77): y {ey:.2e} S {es:.2e}");
    }
}

/// The opt-in fast products (one TF32 product, `ChunkProducts::Tf32`): long windows within their stated bound
/// of the float64 oracle (5e-3 relative on y and the committed f32 state), and the chunked path's bitwise
/// invariants (commit first k, verify, determinism) within the mode.
#[test]
fn fast_products_keep_their_bound_and_the_invariants() {
    let Some(mut cuda) = cuda_or_skip("fast_products_keep_their_bound_and_the_invariants", None)
    else {
        return;
    };
    cuda.set_chunk_products(ChunkProducts::Tf32);
    let cases = [
        (
            "d16 T65536",
            spec(Shape::new(16, 1, 2).unwrap(), &[(65536, Commit::All)], 1),
        ),
        ("seed T2048", spec(Shape::SEED, &[(2048, Commit::All)], 3)),
        (
            "d32 T1500 First(700)",
            spec(
                Shape::new(32, 2, 4).unwrap(),
                &[(1500, Commit::First(700)), (90, Commit::All)],
                10,
            ),
        ),
    ];
    let mut worst = 0.0f64;
    for (name, s) in &cases {
        let (ey, es, eh) = check_var_within(&cuda, &s.build(), 5e-3, 5e-3);
        eprintln!("fast {name}: y {ey:.2e} S {es:.2e} H {eh:.2e}");
        worst = worst.max(ey).max(es);
    }
    // one TF32 product a step is ~1e-4 off: errors within the f32 bound would mean the mode did not apply
    assert!(
        worst > gdn_conformance::F32_BOUND,
        "the fast products did not take effect (worst error {worst:.2e})"
    );
    // one bound, the mode's, for every pool kind (a bf16 state's committed S measured 1.1e-3 in this mode)
    cuda.set_chunk_min_len(Some(1));
    commit_first_k_bitwise(&cuda, Some(5e-3));
}

/// A varlen mix of long and short sequences (both paths in one call, every commit kind): each sequence's bits
/// are those of the sequence alone in a call, and the whole call matches the oracle.
#[test]
fn a_sequence_bits_do_not_depend_on_the_batch() {
    let Some(cuda) = cuda_or_skip("a_sequence_bits_do_not_depend_on_the_batch", None) else {
        return;
    };
    for pool in pools() {
        let mut s = spec(
            Shape::new(32, 2, 4).unwrap(),
            &[
                (300, Commit::First(130)),
                (5, Commit::All),
                (64, Commit::Verify),
                (1, Commit::All),
                (63, Commit::First(10)),
                (1000, Commit::All),
                (8, Commit::First(3)),
                (129, Commit::All),
            ],
            40,
        );
        s.options = pool;
        s.inputs = [DType::Bf16, DType::F32, DType::F16, DType::Bf16];
        s.seqs[3].2 = true; // skipped
        s.seqs[1].3 = 3; // rows of no sequence
        let mixed = s.build();
        let (ey, es, _) = check_var(&cuda, &mixed);
        eprintln!("mixed {pool:?}: y {ey:.2e} S {es:.2e}");
        let got = run_var(&cuda, &mixed);
        let n = mixed.layer.shape().n();
        let gy = got.out.to_f32();
        for i in 0..mixed.seqs.len() {
            let mut alone = mixed.clone();
            for (q, seq) in alone.seqs.iter_mut().enumerate() {
                if q != i {
                    seq.slot = -1;
                }
            }
            let q = &mixed.seqs[i];
            if q.slot < 0 {
                continue;
            }
            let one = run_var(&cuda, &alone);
            let rows = q.start * n..(q.start + q.len) * n;
            assert!(
                bits(&one.out.to_f32()[rows.clone()]) == bits(&gy[rows]),
                "{pool:?}: sequence {i} ({} tokens): y differs inside the mix",
                q.len
            );
            let slot = q.slot as usize;
            assert!(
                bits(&one.slots[slot].0) == bits(&got.slots[slot].0)
                    && bits(&one.slots[slot].1) == bits(&got.slots[slot].1),
                "{pool:?}: sequence {i} ({} tokens): committed slot differs inside the mix",
                q.len
            );
        }
    }
    // the oracle on the same mix through the token-serial kernel alone, for comparison
    let Some(serial) = cuda_or_skip("serial", Some(usize::MAX)) else {
        return;
    };
    let mixed = spec(Shape::new(32, 2, 4).unwrap(), &[(1000, Commit::All)], 41).build();
    let (ey, es, _) = check_var(&serial, &mixed);
    let (ey2, es2, _) = check_var(&cuda, &mixed);
    let _ = oracle_var;
    eprintln!("T 1000 d 32: token-serial y {ey:.2e} S {es:.2e}; chunked y {ey2:.2e} S {es2:.2e}");
}

/// The narrow state kernel (one long window at the seed's shape, 16 columns a block) and the wide one (several
/// long windows, 32 columns a block) give a window the same bits: the window alone against it beside two others.
#[test]
fn narrow_and_wide_state_kernels_give_the_same_bits() {
    let Some(cuda) = cuda_or_skip("narrow_and_wide_state_kernels_give_the_same_bits", None) else {
        return;
    };
    let sms = cuda.multiprocessors();
    let probe = ChunkSpec::new(
        cuda.arch(),
        &gdn::Config::new(Shape::SEED),
        false,
        Io::all(DType::F32),
        PoolOptions::default(),
        ChunkProducts::default(),
    );
    // the host's choice for the calls below: the pool sends only the live sequences (1 alone, 3 mixed) of the
    // call's 405 rows
    let min_len = cuda.chunk_min_len();
    let (alone_narrow, mix_narrow) = (
        probe.narrow_for_call(405, 1, min_len, sms),
        probe.narrow_for_call(405, 3, min_len, sms),
    );
    eprintln!("{sms} SMs: alone narrow {alone_narrow}, mixed narrow {mix_narrow}");
    for pool in pools() {
        let mut s = spec(
            Shape::SEED,
            &[
                (200, Commit::First(130)),
                (7, Commit::All),
                (198, Commit::All),
            ],
            50,
        );
        s.options = pool;
        let mixed = s.build();
        let last = mixed.seqs.last().expect("three sequences");
        assert_eq!(
            last.start + last.len,
            405,
            "the rows the choice above assumes"
        );
        let got = run_var(&cuda, &mixed);
        let mut alone = mixed.clone();
        for seq in alone.seqs.iter_mut().skip(1) {
            seq.slot = -1;
        }
        let one = run_var(&cuda, &alone);
        let q = &mixed.seqs[0];
        let n = mixed.layer.shape().n();
        let rows = q.start * n..(q.start + q.len) * n;
        assert!(
            bits(&one.out.to_f32()[rows.clone()]) == bits(&got.out.to_f32()[rows]),
            "{pool:?}: y differs between the state kernels"
        );
        let slot = q.slot as usize;
        assert!(
            bits(&one.slots[slot].0) == bits(&got.slots[slot].0)
                && bits(&one.slots[slot].1) == bits(&got.slots[slot].1),
            "{pool:?}: the committed slot differs between the state kernels"
        );
    }
    if alone_narrow == mix_narrow {
        eprintln!("note: on {sms} SMs both calls took the same state kernel");
    }
}

/// A small mixed call through both paths (for compute-sanitizer: memcheck, racecheck, initcheck).
#[test]
fn small_mixed_call_for_the_sanitizer() {
    let Some(cuda) = cuda_or_skip("small_mixed_call_for_the_sanitizer", Some(40)) else {
        return;
    };
    let mut s = spec(
        Shape::new(16, 1, 2).unwrap(),
        &[
            (130, Commit::First(70)),
            (5, Commit::All),
            (40, Commit::Verify),
        ],
        50,
    );
    s.planes = true;
    s.options.state = DType::Bf16;
    let (ey, es, _) = check_var(&cuda, &s.build());
    eprintln!("small mixed: y {ey:.2e} S {es:.2e}");
}

/// The pools of one backend share one chunked-path scratch: two pools of different shapes, stepping long windows
/// in turn (the second's calls larger, so the scratch grows between the first's calls), give every step the bits
/// each pool gives on a backend of its own; the bytes held are the same through either pool, and a release by
/// one frees them for both.
#[test]
fn pools_of_one_backend_share_the_chunk_scratch() {
    let Some(cuda) = cuda_or_skip("pools_of_one_backend_share_the_chunk_scratch", None) else {
        return;
    };
    let cases = |round: usize| {
        let a = spec(
            Shape::new(32, 2, 4).unwrap(),
            &[(200 + 50 * round, Commit::All), (3, Commit::All)],
            60 + round as u64,
        )
        .build();
        let mut b = spec(
            Shape::new(64, 1, 2).unwrap(),
            &[(700 + 400 * round, Commit::First(650)), (90, Commit::All)],
            70 + round as u64,
        );
        b.options = pools()[3];
        (a, b.build())
    };
    // a CudaPool holding the case's slots, as VarCase::pool makes them
    let pool_of = |cuda: &Cuda, case: &VarCase| -> CudaPool {
        let mut pool = cuda
            .create_cuda_pool(&case.layer, case.init.len(), case.options)
            .expect("create_cuda_pool");
        case.load_slots(&mut pool);
        pool
    };
    let (a0, b0) = cases(0);
    let (mut pa, mut pb) = (pool_of(&cuda, &a0), pool_of(&cuda, &b0));
    let own_a = cuda_or_skip("own backend a", None).unwrap();
    let own_b = cuda_or_skip("own backend b", None).unwrap();
    let (mut qa, mut qb) = (pool_of(&own_a, &a0), pool_of(&own_b, &b0));
    let mut grew = false;
    for round in 0..3 {
        let (a, b) = cases(round);
        let before = pa.chunk_bytes();
        let (sa, sb) = (run_var_on(&mut pa, &a), run_var_on(&mut pb, &b));
        grew |= pa.chunk_bytes() > before;
        let (ra, rb) = (run_var_on(&mut qa, &a), run_var_on(&mut qb, &b));
        for (shared, own, what) in [(&sa, &ra, "a"), (&sb, &rb, "b")] {
            assert!(
                bits(&shared.out.to_f32()) == bits(&own.out.to_f32()),
                "round {round}: pool {what}'s y differs with the shared scratch"
            );
            for (s, o) in shared.slots.iter().zip(&own.slots) {
                assert!(
                    bits(&s.0) == bits(&o.0) && bits(&s.1) == bits(&o.1),
                    "round {round}: pool {what}'s committed slots differ with the shared scratch"
                );
            }
        }
    }
    assert!(
        grew,
        "the scratch never grew between the first pool's calls"
    );
    let held = pa.chunk_bytes();
    assert!(
        held > 0 && pb.chunk_bytes() == held,
        "one scratch, seen from both pools"
    );
    pb.release_chunk();
    assert_eq!(pa.chunk_bytes(), 0, "released for both");
    // and allocated again by the next long window (both pools of `a` have stepped the same calls)
    let (a, _) = cases(0);
    let again = run_var_on(&mut pa, &a);
    let own = run_var_on(&mut qa, &a);
    assert!(pa.chunk_bytes() > 0, "allocated again");
    assert!(
        bits(&again.out.to_f32()) == bits(&own.out.to_f32()),
        "y differs after the release"
    );
    eprintln!("shared scratch: {held} bytes after three rounds");
}
