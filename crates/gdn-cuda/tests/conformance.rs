//! The whole conformance suite on the CUDA backend; without a GPU, driver or libnvrtc every test is skipped
//! with a message on stderr.
gdn_conformance::conformance_tests!(
    || gdn_cuda::Cuda::new().map(|c| Box::new(c) as Box<dyn gdn::Backend>)
);
