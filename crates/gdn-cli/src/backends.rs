//! The backends this binary was built with, by name.

use gdn::{Backend, Error, Result};

/// Names accepted by `--backend`.
pub const NAMES: &[&str] = &["cpu", "cuda", "wgpu"];

pub fn make(name: &str) -> Result<Box<dyn Backend>> {
    match name {
        "cpu" => Ok(Box::new(gdn::Cpu::new())),
        "cuda" => Ok(Box::new(gdn_cuda::Cuda::new()?)),
        "wgpu" => Ok(Box::new(gdn_wgpu::Wgpu::new()?)),
        other => Err(Error::Unavailable(format!(
            "no backend '{other}' in this build (known: {})",
            NAMES.join(", ")
        ))),
    }
}

/// Whether a backend computes on a device with its own memory (the benchmark then uses the GPU grid).
pub fn is_device(name: &str) -> bool {
    name != "cpu"
}
