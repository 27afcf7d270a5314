//! The conformance suite on the wgpu backend, once per reduction path and token loop (two-pass, one-pass). Without an adapter (or, for the first
//! module, without subgroup operations) every test is skipped with a message on stderr, unless
//! `GDN_WGPU_REQUIRE=1` (CI with lavapipe installed), which turns a missing adapter into a failure.

fn make(
    subgroups: gdn_wgpu::Subgroups,
    kernel: gdn_wgpu::Kernel,
) -> gdn::Result<Box<dyn gdn::Backend>> {
    let options = gdn_wgpu::Options {
        subgroups,
        kernel,
        ..Default::default()
    };
    match gdn_wgpu::Wgpu::with_options(options) {
        Ok(b) => Ok(Box::new(b)),
        Err(gdn::Error::Unavailable(why))
            if std::env::var("GDN_WGPU_REQUIRE").is_ok_and(|v| v == "1") =>
        {
            Err(gdn::Error::Backend(format!(
                "GDN_WGPU_REQUIRE=1, but {why}"
            )))
        }
        Err(e) => Err(e),
    }
}

mod subgroups {
    gdn_conformance::conformance_tests!(|| super::make(
        gdn_wgpu::Subgroups::Require,
        gdn_wgpu::Kernel::TwoPass
    ));
}

mod workgroup_memory {
    gdn_conformance::conformance_tests!(|| super::make(
        gdn_wgpu::Subgroups::Off,
        gdn_wgpu::Kernel::TwoPass
    ));
}

mod onepass_subgroups {
    gdn_conformance::conformance_tests!(|| super::make(
        gdn_wgpu::Subgroups::Require,
        gdn_wgpu::Kernel::OnePass
    ));
}

mod onepass_workgroup_memory {
    gdn_conformance::conformance_tests!(|| super::make(
        gdn_wgpu::Subgroups::Off,
        gdn_wgpu::Kernel::OnePass
    ));
}
