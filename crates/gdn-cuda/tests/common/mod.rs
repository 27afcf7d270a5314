//! What the CUDA test programs share.
use gdn_cuda::Cuda;

/// The CUDA backend, or `None` with a `SKIPPED` line where there is no device (any other error fails the test).
pub fn cuda_or_skip(test: &str) -> Option<Cuda> {
    match Cuda::new() {
        Ok(c) => Some(c),
        Err(gdn::Error::Unavailable(why)) => {
            // past the test harness's capture, so that CI counts the test as skipped
            use std::io::Write;
            let _ = writeln!(
                std::io::stderr(),
                "SKIPPED {test}: backend unavailable: {why}"
            );
            None
        }
        Err(e) => panic!("{test}: {e}"),
    }
}
