//! The whole conformance suite on the CUDA backend; without a GPU, driver or libnvrtc every test is skipped
//! with a message on stderr.
gdn_conformance::conformance_tests!(
    || gdn_cuda::Cuda::new().map(|c| Box::new(c) as Box<dyn gdn::Backend>)
);

/// The same suite on kernel v3 (NOTES.md), whatever `GDN_CUDA_KERNEL` says.
mod v3 {
    gdn_conformance::conformance_tests!(|| gdn_cuda::Cuda::new().map(|mut c| {
        c.set_kernel(gdn_cuda::Kernel::V3);
        Box::new(c) as Box<dyn gdn::Backend>
    }));
}
