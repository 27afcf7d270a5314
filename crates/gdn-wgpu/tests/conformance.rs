//! The conformance suite on the wgpu backend, once per reduction path and once with long windows chunked. Without
//! an adapter (or, for the first module, without subgroup operations) every test is skipped with a message on
//! stderr, unless `GDN_WGPU_REQUIRE=1` (CI with lavapipe installed), which turns a missing adapter into a failure.
//! `GDN_WGPU_ADAPTER` (a part of the adapter's name) and `GDN_WGPU_CHECKS=1` (wgpu's runtime checks kept in the
//! kernel) are read here and passed in as options: the library reads no environment.

mod common;

fn make(
    subgroups: gdn_wgpu::Subgroups,
    chunk_from: Option<usize>,
) -> gdn::Result<Box<dyn gdn::Backend>> {
    make_wgpu(subgroups, chunk_from).map(|b| Box::new(b) as Box<dyn gdn::Backend>)
}

fn make_quant(subgroups: gdn_wgpu::Subgroups) -> gdn::Result<Box<dyn gdn::quant::QuantBackend>> {
    make_wgpu(subgroups, None).map(|b| Box::new(b) as Box<dyn gdn::quant::QuantBackend>)
}

fn make_wgpu(
    subgroups: gdn_wgpu::Subgroups,
    chunk_from: Option<usize>,
) -> gdn::Result<gdn_wgpu::Wgpu> {
    common::make(gdn_wgpu::Options {
        subgroups,
        chunk_from,
        ..common::env_options()
    })
}

mod subgroups {
    gdn_conformance::conformance_tests!(|| super::make(gdn_wgpu::Subgroups::Require, None));
}

mod workgroup_memory {
    gdn_conformance::conformance_tests!(
        || super::make(gdn_wgpu::Subgroups::Off, None),
        quant: || super::make_quant(gdn_wgpu::Subgroups::Off)
    );
}

/// Every window of 17 tokens or more (to its commit point) in the chunked form, whatever the adapter's default: the
/// suite's long windows, and its mixed batches across both paths (17: above the longest held window, so that the
/// speculative flows compare one path with itself). Where the adapter binds less than 256 MiB (lavapipe: 128 MiB),
/// from 4097 tokens: the suite's 2048 tokens at the seed's shape need 149 MB of chunked scratch, which such an
/// adapter refuses (by design: never truncated).
fn make_chunked() -> gdn::Result<Box<dyn gdn::Backend>> {
    let probe = make_wgpu(gdn_wgpu::Subgroups::Auto, None)?;
    let l = probe.limits();
    let from = if l.max_storage_buffer_binding_size.min(l.max_buffer_size) >= 256 << 20 {
        17
    } else {
        4097
    };
    make(gdn_wgpu::Subgroups::Auto, Some(from))
}

mod chunked {
    gdn_conformance::conformance_tests!(super::make_chunked);
}
