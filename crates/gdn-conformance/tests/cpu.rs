//! The conformance suite on the CPU backend.
gdn_conformance::conformance_tests!(|| Ok(Box::new(gdn::Cpu::new())), quant: || Ok(Box::new(gdn::Cpu::new())));

/// The whole suite again with the calling thread in the backend's pool (each test runs on its own thread).
mod calling_thread {
    gdn_conformance::conformance_tests!(|| Ok(Box::new(gdn::Cpu::with_calling_thread(2)?)));
}

/// The CPU conv takes a token's taps from the history while they reach back before the window (its first three
/// tokens) and from the input rows after that, and writes the history from both: windows shorter and longer than
/// the history, committed inside it, at its edge and past it, and a head dim above the suite's (d 320).
#[test]
fn cpu_matches_oracle_at_a_large_head_dim() {
    use gdn::{Commit, Shape};
    let backend = gdn::Cpu::new();
    let cases = [
        (1, Commit::All),
        (2, Commit::First(1)),
        (3, Commit::First(2)),
        (4, Commit::First(3)),
        (5, Commit::First(4)),
        (6, Commit::All),
        (5, Commit::Verify),
    ];
    for (t, commit) in cases {
        let mut spec = gdn_conformance::CaseSpec::new(Shape::new(320, 1, 2).unwrap(), 2, t, 7);
        spec.commit = commit;
        gdn_conformance::check_against_oracle(&backend, &spec.build());
    }
}

/// Three sequences at the seed's shape (9 MiB of state): the software prefetch of the next column block runs
/// past each head's last block into the next head's, and past the last slot's end.
#[test]
fn cpu_matches_oracle_at_the_seed_shape_over_three_slots() {
    let backend = gdn::Cpu::new();
    let spec = gdn_conformance::CaseSpec::new(gdn::Shape::SEED, 3, 2, 9);
    gdn_conformance::check_against_oracle(&backend, &spec.build());
}

/// A pool with the calling thread in it: at least two threads and one per thread (both clear errors, not panics
/// or hangs), and a step called from another thread is still right (the pool's other threads compute it).
/// A pool larger than any allocation can be (2^42 slots at the seed's shape: 2^63.6 bytes, past `isize::MAX`),
/// or whose size overflows, is an error, not an abort. (A size merely larger than this machine's memory would
/// depend on the kernel's overcommit policy.)
#[test]
fn cpu_pool_too_large_for_memory_is_an_error() {
    use gdn::Backend;
    let layer = gdn::synth::Synth::new(5)
        .layer(gdn::Config::new(gdn::Shape::SEED))
        .unwrap();
    for slots in [1 << 42, usize::MAX / 2] {
        match gdn::Cpu::new().create_pool(&layer, slots) {
            Err(gdn::Error::Param { name: "slots", .. }) => {}
            Err(e) => panic!("{slots} slots: the wrong error: {e}"),
            Ok(_) => panic!("{slots} slots: a pool was made"),
        }
    }
}

#[test]
fn calling_thread_pool_is_one_per_thread_and_serves_other_threads() {
    assert!(matches!(
        gdn::Cpu::with_calling_thread(1),
        Err(gdn::Error::Backend(_))
    ));
    let backend = gdn::Cpu::with_calling_thread(2).unwrap();
    assert!(matches!(
        gdn::Cpu::with_calling_thread(2),
        Err(gdn::Error::Backend(_))
    ));
    let spec = gdn_conformance::CaseSpec::new(gdn::Shape::new(32, 2, 4).unwrap(), 2, 3, 11);
    let case = spec.build();
    gdn_conformance::check_against_oracle(&backend, &case);
    std::thread::scope(|s| {
        s.spawn(|| gdn_conformance::check_against_oracle(&backend, &case))
            .join()
            .expect("step from another thread");
    });
}

/// A long prefill window's work buffers are not kept for the decode steps after it: the first shorter step
/// releases a buffer holding more than `CpuPool::WORK_KEEP` floats and twice its need, so a pool's memory
/// beyond its states stays bounded by what its recent steps need.
#[test]
fn cpu_work_buffers_stay_bounded_after_a_long_window() {
    use gdn::{DType, LayerPool, PoolOptions, RowsData, Seq, Step, TensorData};
    let shape = gdn::Shape::new(128, 1, 2).unwrap();
    let mut rng = gdn::synth::Synth::new(12);
    let layer = rng.layer(gdn::Config::new(shape)).unwrap();
    let mut pool = gdn::Cpu::new()
        .create_cpu_pool(&layer, 1, PoolOptions::default())
        .unwrap();
    let mut run = |len: usize| {
        let w = rng.batch(&layer, 1, len);
        let rows = RowsData::from_f32(&w.qkv, &w.alpha, &w.beta, &w.z, [DType::Bf16; 4]);
        let seqs = [Seq {
            slot: 0,
            start: 0,
            len,
            commit: gdn::Commit::All,
        }];
        let mut out = TensorData::filled(len * shape.n(), 0.0, DType::Bf16);
        let step = Step {
            rows: rows.view(),
            seqs: &seqs,
            plane_stride: None,
        };
        pool.step_varlen(&step, out.view_mut()).unwrap();
        pool.work_floats()
    };
    // 9000 tokens: conv outputs and widened qkv of 4.6 M floats each, over the limit
    let need = 2 * 9000 * shape.channels() + 9000 * shape.n();
    let after_long = run(9000);
    assert!(
        after_long >= need,
        "{after_long} floats held after a step that needed {need}"
    );
    let keep = gdn::cpu::CpuPool::WORK_KEEP;
    let after_decode = run(1);
    // six work buffers and two threads' scratch, each at most `keep`
    assert!(
        after_decode <= 8 * keep,
        "{after_decode} floats kept after a decode step"
    );
    // the two buffers over the limit (conv outputs, widened qkv: 9.2 M floats) are gone
    assert!(
        after_decode + 9_000_000 < after_long,
        "{after_decode} floats kept of the {after_long} after the long window"
    );
}

/// A held window kept outside the pool (`save_held` / `load_held`), as the Python package's CPU path keeps the
/// caller's states: every step stages each slot's state, history and held window into a fresh pool, runs the
/// speculative step there and takes them back out. Outputs, states and histories are bitwise those of one pool
/// that keeps everything, over random windows, holds and acceptances, f32 and bf16 states.
#[test]
fn held_windows_saved_and_loaded_outside_the_pool_keep_their_bits() {
    use gdn::cpu::CpuPool;
    use gdn::{Commit, DType, LayerPool, PoolOptions, RowsData, Seq, Step, TensorData};
    let shape = gdn::Shape::new(32, 2, 4).unwrap();
    for state in [DType::F32, DType::Bf16] {
        let mut rng = gdn::synth::Synth::new(31);
        let layer = rng.layer(gdn::Config::new(shape)).unwrap();
        let options = PoolOptions {
            state,
            ..PoolOptions::default()
        };
        let backend = gdn::Cpu::new();
        let slots = 3;
        let mut kept = backend.create_cpu_pool(&layer, slots, options).unwrap();
        // the caller's copies: per slot S, H and the held window
        let mut s_out: Vec<Vec<f32>> = Vec::new();
        let mut h_out: Vec<Vec<f32>> = Vec::new();
        let mut held_out = vec![vec![0.0f32; CpuPool::held_floats(&shape)]; slots];
        for slot in 0..slots {
            let (s, h) = rng.seq_state(&layer);
            kept.write_slot(slot, &s, &h).unwrap();
            let (mut s2, mut h2) = (vec![0.0; s.len()], vec![0.0; h.len()]);
            kept.read_slot(slot, &mut s2, &mut h2).unwrap();
            s_out.push(s2);
            h_out.push(h2);
        }
        let mut held_len = vec![0usize; slots];
        let (mut holds, mut accepted) = (0, 0);
        for round in 0..40 {
            // every slot once a round, in a rotating order; windows 1..=6, held (Verify) or committed
            let mut seqs = Vec::new();
            let mut accept = Vec::new();
            let mut start = 0;
            for i in 0..slots {
                let slot = (i + round) % slots;
                let len = 1 + rng.index(0, 5);
                let commit = match rng.index(0, 3) {
                    0 => Commit::All,
                    1 if len > 1 => Commit::First(rng.index(1, len - 1)),
                    _ => Commit::Verify,
                };
                accept.push(rng.index(0, held_len[slot]));
                accepted += accept[i];
                holds += usize::from(commit == Commit::Verify);
                seqs.push(Seq {
                    slot: slot as i32,
                    start,
                    len,
                    commit,
                });
                start += len;
            }
            let w = rng.batch(&layer, 1, start);
            let rows = RowsData::from_f32(&w.qkv, &w.alpha, &w.beta, &w.z, [DType::F32; 4]);
            let step = Step {
                rows: rows.view(),
                seqs: &seqs,
                plane_stride: None,
            };
            let mut y_kept = TensorData::filled(start * shape.n(), 0.0, DType::F32);
            kept.step_spec(&step, &accept, y_kept.view_mut()).unwrap();

            // the staged flow: a fresh pool, slot i of the step in its slot i
            let mut staged = backend.create_cpu_pool(&layer, slots, options).unwrap();
            let mut sseqs = seqs.clone();
            for (k, s) in sseqs.iter_mut().enumerate() {
                let slot = s.slot as usize;
                staged.write_slot(k, &s_out[slot], &h_out[slot]).unwrap();
                staged.load_held(k, &held_out[slot]).unwrap();
                s.slot = k as i32;
            }
            let sstep = Step {
                seqs: &sseqs,
                ..step
            };
            let mut y_staged = TensorData::filled(start * shape.n(), 0.0, DType::F32);
            staged
                .step_spec(&sstep, &accept, y_staged.view_mut())
                .unwrap();
            let bits = |t: &TensorData| t.to_f32().iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&y_kept),
                bits(&y_staged),
                "{state:?} round {round}: outputs"
            );
            for (k, s) in seqs.iter().enumerate() {
                let slot = s.slot as usize;
                staged
                    .read_slot(k, &mut s_out[slot], &mut h_out[slot])
                    .unwrap();
                held_len[slot] = staged.save_held(k, &mut held_out[slot]).unwrap();
                assert_eq!(
                    held_len[slot],
                    kept.held(slot),
                    "{state:?} round {round}: held"
                );
            }
            for slot in 0..slots {
                let (mut s, mut h) = (vec![0.0; s_out[slot].len()], vec![0.0; h_out[slot].len()]);
                kept.read_slot(slot, &mut s, &mut h).unwrap();
                let b = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    b(&s),
                    b(&s_out[slot]),
                    "{state:?} round {round}: slot {slot}'s state"
                );
                assert_eq!(
                    b(&h),
                    b(&h_out[slot]),
                    "{state:?} round {round}: slot {slot}'s history"
                );
            }
        }
        assert!(
            holds > 20 && accepted > 20,
            "{holds} windows held, {accepted} tokens accepted"
        );
    }
}
