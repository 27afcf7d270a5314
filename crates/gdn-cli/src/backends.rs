//! The backends this binary was built with, by name.

use gdn::{Backend, Error, Result};

/// Names accepted by `--backend`.
pub const NAMES: &[&str] = &["cpu", "cuda", "wgpu"];

/// `--backend`'s parser: one of [`NAMES`], listed in `--help` and in the error for any other value.
pub fn names() -> clap::builder::PossibleValuesParser {
    clap::builder::PossibleValuesParser::new(NAMES)
}

pub fn make(name: &str) -> Result<Box<dyn Backend>> {
    match name {
        "cpu" => Ok(Box::new(cpu())),
        "cuda" => Ok(Box::new(cuda()?)),
        "wgpu" => Ok(Box::new(gdn_wgpu::Wgpu::with_options(wgpu_options())?)),
        other => Err(Error::Unavailable(format!(
            "no backend '{other}' in this build (known: {})",
            NAMES.join(", ")
        ))),
    }
}

/// The CPU backend as this binary drives it, from its main thread: a pool of RAYON_NUM_THREADS or one thread per
/// core with the main thread one of them (no hand-off per call), or rayon's global pool where that cannot be built
/// (one thread).
fn cpu() -> gdn::Cpu {
    // rayon's own default: RAYON_NUM_THREADS if set, else one thread per core
    let threads = std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|n| n.parse().ok())
        .filter(|&n: &usize| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    gdn::Cpu::with_calling_thread(threads).unwrap_or_default()
}

/// The CUDA backend with its options from the environment (the library itself reads none): `GDN_CUDA_WINDOW=1`
/// runs the windows of `gdn_cuda::spec::window_range` in the window kernel (eight tokens at a time in the chunked
/// form); `GDN_CUDA_CHUNK_PRODUCTS=tf32` gives long windows' chunks one TF32 product a step instead of 3xTF32
/// (`tf32x3`, the default; another value is an error).
pub fn cuda() -> Result<gdn_cuda::Cuda> {
    let mut c = gdn_cuda::Cuda::new()?;
    c.set_window_kernel(std::env::var("GDN_CUDA_WINDOW").is_ok_and(|v| v == "1"));
    match std::env::var("GDN_CUDA_CHUNK_PRODUCTS").as_deref() {
        Ok("tf32") => c.set_chunk_products(gdn_cuda::chunk::ChunkProducts::Tf32),
        Ok("tf32x3") | Err(_) => {}
        Ok(other) => {
            return Err(Error::Param {
                name: "GDN_CUDA_CHUNK_PRODUCTS",
                why: format!("tf32 or tf32x3, got {other:?}"),
            })
        }
    }
    Ok(c)
}

/// The wgpu backend's options from the environment (the library itself reads none): `GDN_WGPU_ADAPTER` (a part
/// of the adapter's name, e.g. `nvidia` or `llvmpipe`), `GDN_WGPU_ROW_BLOCKS` (1, 2, 4 or 8) and
/// `GDN_WGPU_CHECKS=1` (keep wgpu's runtime checks in the kernel).
fn wgpu_options() -> gdn_wgpu::Options {
    let var = |name| std::env::var(name).ok().filter(|s: &String| !s.is_empty());
    let default = gdn_wgpu::Options::default();
    gdn_wgpu::Options {
        adapter: var("GDN_WGPU_ADAPTER"),
        row_blocks: var("GDN_WGPU_ROW_BLOCKS")
            .and_then(|s| s.parse().ok())
            .filter(|n| [1, 2, 4, 8].contains(n))
            .unwrap_or(default.row_blocks),
        runtime_checks: var("GDN_WGPU_CHECKS").is_some_and(|v| v == "1"),
        ..default
    }
}

/// Whether a backend computes on a device with its own memory (the benchmark then uses the GPU grid).
pub fn is_device(name: &str) -> bool {
    name != "cpu"
}
