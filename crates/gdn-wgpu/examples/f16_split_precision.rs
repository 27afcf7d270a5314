//! The precision a split-f16 product would reach on cooperative matrices (f16 inputs, f32 accumulators: what NVIDIA's
//! Vulkan driver offers through wgpu, NOTES.md "Tensor cores are reachable"), emulated on the CPU against float64:
//! each f32 operand as hi = f16(x) and lo = f16(x - hi), three products hi*hi + hi*lo + lo*hi summed in f32, with
//! and without a power-of-two scale per row of A and per column of B bringing its largest magnitude near 2^14 (so
//! that the lo parts stay in f16's normal range). A 64 x 128 by 128 x 16 product (a chunk's W S at d 128, BV 16),
//! entries of three dynamic ranges; plain f32 FMAs beside it. `cargo run --release -p gdn-wgpu --example
//! f16_split_precision`. No GPU: the tensor cores' own accumulation order and rounding are not modelled.
use half::f16;

fn rng(seed: &mut u64) -> f64 {
    *seed = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    ((*seed >> 11) as f64) / ((1u64 << 53) as f64)
}

fn split(x: f32) -> (f32, f32) {
    let hi = f16::from_f32(x).to_f32();
    let lo = f16::from_f32(x - hi).to_f32();
    (hi, lo)
}

fn pow2_scale(maxabs: f64) -> f64 {
    if maxabs == 0.0 {
        return 1.0;
    }
    let e = maxabs.log2().floor();
    2f64.powf(14.0 - e)
}

fn main() {
    let (m, k, n) = (64usize, 128usize, 16usize);
    for (name, spread) in [
        ("unit normal-ish", 0.0f64),
        ("magnitudes over 2^-8..1", 8.0),
        ("over 2^-16..1", 16.0),
    ] {
        let mut seed = 7u64;
        let gen = |s: &mut u64| {
            let u = rng(s) * 2.0 - 1.0;
            let mag = 2f64.powf(-spread * rng(s));
            (u * mag * 0.1) as f32
        };
        let a: Vec<f32> = (0..m * k).map(|_| gen(&mut seed)).collect();
        let b: Vec<f32> = (0..k * n).map(|_| gen(&mut seed) * 30.0).collect();
        for scaled in [false, true] {
            // a scale per row of a and per column of b (1 unscaled)
            let scales = |outer: usize, at: &dyn Fn(usize, usize) -> f32| -> Vec<f64> {
                (0..outer)
                    .map(|o| {
                        let max = (0..k).map(|j| at(o, j).abs() as f64).fold(0.0, f64::max);
                        if scaled {
                            pow2_scale(max)
                        } else {
                            1.0
                        }
                    })
                    .collect()
            };
            let ra = scales(m, &|i, j| a[i * k + j]);
            let cb = scales(n, &|c, j| b[j * n + c]);
            let (mut num, mut den, mut worst) = (0.0f64, 0.0f64, 0.0f64);
            // the same product in plain f32 FMAs for reference
            let mut n32 = 0.0f64;
            for i in 0..m {
                for c in 0..n {
                    let (mut acc, mut acc32) = (0.0f32, 0.0f32);
                    let mut exact = 0.0f64;
                    let mut absum = 0.0f64;
                    for j in 0..k {
                        let (av, bv) = (a[i * k + j], b[j * n + c]);
                        let (xh, xl) = split((av as f64 * ra[i]) as f32);
                        let (yh, yl) = split((bv as f64 * cb[c]) as f32);
                        acc += xh * yh;
                        acc += xh * yl;
                        acc += xl * yh;
                        acc32 = av.mul_add(bv, acc32);
                        exact += av as f64 * bv as f64;
                        absum += (av as f64 * bv as f64).abs();
                    }
                    let got = acc as f64 / (ra[i] * cb[c]);
                    num += (got - exact).powi(2);
                    den += exact.powi(2);
                    worst = worst.max((got - exact).abs() / absum);
                    n32 += (acc32 as f64 - exact).powi(2);
                }
            }
            println!(
                "{name:>24} scaled {scaled:5}: split-f16 rel L2 {:.2e} (worst |err| / sum|ab| {:.2e}); f32 FMAs {:.2e}",
                (num / den).sqrt(),
                worst,
                (n32 / den).sqrt()
            );
        }
    }
}
