//! What the wgpu test programs share: the options the environment sets and the rule for a missing adapter.
//! `GDN_WGPU_ADAPTER` (a part of the adapter's name) picks the adapter, `GDN_WGPU_CHECKS=1` keeps wgpu's runtime
//! checks, and `GDN_WGPU_REQUIRE=1` (CI with lavapipe, the GPU machine) turns a missing adapter into a failure.
#![allow(dead_code)] // each test program uses a part

use gdn::Error;
use gdn_wgpu::{Options, Wgpu};

/// `Options::default()` with the environment's adapter and runtime checks.
pub fn env_options() -> Options {
    Options {
        adapter: std::env::var("GDN_WGPU_ADAPTER")
            .ok()
            .filter(|s| !s.is_empty()),
        runtime_checks: std::env::var("GDN_WGPU_CHECKS").is_ok_and(|v| v == "1"),
        ..Options::default()
    }
}

fn required() -> bool {
    std::env::var("GDN_WGPU_REQUIRE").is_ok_and(|v| v == "1")
}

/// The backend with `options`; where no adapter is there, an error if `GDN_WGPU_REQUIRE=1`, else the
/// `Unavailable` error as it came (the conformance suite skips on it).
pub fn make(options: Options) -> gdn::Result<Wgpu> {
    match Wgpu::with_options(options) {
        Err(Error::Unavailable(why)) if required() => {
            Err(Error::Backend(format!("GDN_WGPU_REQUIRE=1, but {why}")))
        }
        r => r,
    }
}

/// The backend with `options`, or `None` where no adapter is there: a line past the test harness's capture,
/// so that CI counts the test `what` as skipped (a failure with `GDN_WGPU_REQUIRE=1`).
pub fn backend_or_skip(options: Options, what: &str) -> Option<Wgpu> {
    match make(options) {
        Ok(b) => Some(b),
        Err(Error::Unavailable(why)) => {
            use std::io::Write;
            let _ = writeln!(std::io::stderr(), "SKIPPED a {what}: {why}");
            None
        }
        Err(e) => panic!("{e}"),
    }
}
