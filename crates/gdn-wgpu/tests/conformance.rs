//! The conformance suite on the wgpu backend, once per reduction path. Without an adapter (or, for the first
//! module, without subgroup operations) every test is skipped with a message on stderr.

mod subgroups {
    gdn_conformance::conformance_tests!(|| {
        let opts = gdn_wgpu::Options {
            subgroups: gdn_wgpu::Subgroups::Require,
            ..Default::default()
        };
        Ok(Box::new(gdn_wgpu::Wgpu::with_options(opts)?))
    });
}

mod workgroup_memory {
    gdn_conformance::conformance_tests!(|| Ok(Box::new(gdn_wgpu::Wgpu::without_subgroups()?)));
}
