//! The whole conformance suite on the CUDA backend with the window kernel on (windows of 4 to 8 tokens in
//! chunks of eight); without a GPU, driver or libnvrtc every test is skipped with a message on stderr.
fn window() -> gdn::Result<gdn_cuda::Cuda> {
    let mut c = gdn_cuda::Cuda::new()?;
    c.set_window_kernel(true);
    Ok(c)
}

gdn_conformance::conformance_tests!(
    || window().map(|c| Box::new(c) as Box<dyn gdn::Backend>),
    quant: || window().map(|c| Box::new(c) as Box<dyn gdn::quant::QuantBackend>)
);

use gdn::{Commit, Shape};
use gdn_conformance::{check_against_oracle, checks::truncate, run_backend, CaseSpec};

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// The window kernel's invariants at the head dims it takes (the suite's invariant checks run at d 16 to 48, where
/// the token-serial kernel runs everything): for windows across the window range's edges and of more than one
/// chunk, a commit after every k equals a k-token window bitwise (y of the first k tokens, S and H), a verify
/// changes no slot, and every case is within the oracle's bounds.
#[test]
fn window_kernel_invariants_at_d_64_and_128() {
    let backend = match window() {
        Ok(b) => b,
        Err(gdn::Error::Unavailable(why)) => {
            use std::io::Write;
            let _ = writeln!(
                std::io::stderr(),
                "SKIPPED window_kernel_invariants_at_d_64_and_128: backend unavailable: {why}"
            );
            return;
        }
        Err(e) => panic!("{e}"),
    };
    for (shape, t, seed) in [
        (Shape::new(64, 2, 4).unwrap(), 12, 3u64),
        (Shape::new(128, 2, 4).unwrap(), 9, 4),
        (Shape::new(128, 1, 2).unwrap(), 5, 5),
    ] {
        let mut spec = CaseSpec::new(shape, 2, t, seed);
        spec.commit = Commit::Verify;
        let case = spec.build();
        check_against_oracle(&backend, &case);
        let got = run_backend(&backend, &case);
        for (g, w) in got.slots.iter().zip(&case.init) {
            assert!(
                bits(&g.0) == bits(&w.0) && bits(&g.1) == bits(&w.1),
                "d {} t {t}: verify changed a slot",
                shape.d
            );
        }
        for k in 1..=t {
            spec.commit = Commit::First(k);
            let full = spec.build();
            check_against_oracle(&backend, &full);
            let got = run_backend(&backend, &full);
            let mut short = full.clone();
            short.commit = Commit::All;
            short.batch = truncate(&full.batch, k, full.layer.shape());
            let want = run_backend(&backend, &short);
            for (g, w) in got.slots.iter().zip(&want.slots) {
                assert!(
                    bits(&g.0) == bits(&w.0) && bits(&g.1) == bits(&w.1),
                    "d {} t {t} k {k}: committed slots differ from a {k}-token window",
                    shape.d
                );
            }
            let n = shape.n();
            for b in 0..2 {
                assert!(
                    bits(&got.out[b * t * n..(b * t + k) * n])
                        == bits(&want.out[b * k * n..(b * k + k) * n]),
                    "d {} t {t} k {k}: y of the first {k} tokens differs",
                    shape.d
                );
            }
        }
    }
}
