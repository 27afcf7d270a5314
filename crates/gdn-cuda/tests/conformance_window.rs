//! The whole conformance suite on the CUDA backend with the window kernel on (windows of two tokens or more in
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
