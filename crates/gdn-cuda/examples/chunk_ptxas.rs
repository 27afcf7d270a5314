//! ptxas's report of the chunked kernels at the seed shape, the pool's and engine memory's (no GPU; needs
//! libnvrtc).
use gdn::{Config, DType, PoolOptions, Shape};
use gdn_cuda::chunk::{ChunkProducts, ChunkSpec};
use gdn_cuda::spec::Io;

fn main() -> gdn::Result<()> {
    for (io, pool, products) in [
        (
            Io::all(DType::F32),
            PoolOptions::default(),
            ChunkProducts::Tf32x3,
        ),
        (
            Io::all(DType::Bf16),
            PoolOptions {
                state: DType::Bf16,
                layout: gdn::StateLayout::ValueMajor,
            },
            ChunkProducts::Tf32x3,
        ),
        (
            Io::all(DType::F32),
            PoolOptions::default(),
            ChunkProducts::Tf32,
        ),
    ] {
        let pooled = ChunkSpec::new((9, 0), &Config::new(Shape::SEED), false, io, pool, products);
        // the same on engine memory (CudaLayer), its conv state in the rows' dtype
        for spec in [pooled, pooled.with_ext(io.qkv)] {
            let c = spec.compiled()?;
            println!("{io:?} {pool:?} {products:?} ext {:?}", spec.ext);
            for l in c.log.lines().filter(|l| {
                l.contains("Compiling") || l.contains("registers") || l.contains("spill")
            }) {
                println!("  {}", l.trim());
            }
        }
    }
    Ok(())
}
