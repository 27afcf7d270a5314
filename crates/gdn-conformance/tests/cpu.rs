//! The conformance suite on the CPU backend.
gdn_conformance::conformance_tests!(|| Ok(Box::new(gdn::Cpu::new())));

/// Head dims above 256 take the CPU conv's heap path for its per-group history (the suite's shapes stay small).
#[test]
fn cpu_matches_oracle_at_a_large_head_dim() {
    use gdn::{Commit, Shape};
    let backend = gdn::Cpu::new();
    for (t, commit) in [(1, Commit::All), (3, Commit::First(2))] {
        let mut spec = gdn_conformance::CaseSpec::new(Shape::new(320, 1, 2).unwrap(), 2, t, 7);
        spec.commit = commit;
        gdn_conformance::check_against_oracle(&backend, &spec.build());
    }
}

/// Three sequences at the seed's shape (9.4 MiB of state) take the CPU's software-prefetch path (8 MiB and up).
#[test]
fn cpu_matches_oracle_with_software_prefetch() {
    let backend = gdn::Cpu::new();
    let spec = gdn_conformance::CaseSpec::new(gdn::Shape::SEED, 3, 2, 9);
    gdn_conformance::check_against_oracle(&backend, &spec.build());
}
