//! The conformance suite on the CPU backend.
gdn_conformance::conformance_tests!(|| Ok(Box::new(gdn::Cpu::new())));
