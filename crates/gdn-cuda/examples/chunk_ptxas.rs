//! ptxas's report of the chunked kernels at the seed shape (no GPU; needs libnvrtc).
use gdn::{Config, DType, PoolOptions, Shape};
use gdn_cuda::chunk::ChunkSpec;
use gdn_cuda::spec::Io;

fn main() -> gdn::Result<()> {
    for (io, pool) in [
        (Io::all(DType::F32), PoolOptions::default()),
        (
            Io::all(DType::Bf16),
            PoolOptions {
                state: DType::Bf16,
                layout: gdn::StateLayout::ValueMajor,
            },
        ),
    ] {
        let spec = ChunkSpec::new((9, 0), &Config::new(Shape::SEED), false, io, pool);
        let c = spec.compiled()?;
        println!("{io:?} {pool:?}");
        for l in c
            .log
            .lines()
            .filter(|l| l.contains("Compiling") || l.contains("registers") || l.contains("spill"))
        {
            println!("  {}", l.trim());
        }
    }
    Ok(())
}
