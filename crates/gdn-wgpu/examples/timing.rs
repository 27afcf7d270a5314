//! Times the wgpu step at the seed's shape (d 128, h_k 16, h_v 48) for B in {1, 256} x T in {1, 8}, commit
//! all, through `LayerPool::time_varlen` (what `gdn bench --backend wgpu` uses), and the copy ceiling.
//!
//! `cargo run --release -p gdn-wgpu --example timing [-- --row-blocks 4,8] [--checks on,off]
//! [--no-subgroups | --both] [--batches 1,256] [--state f32|bf16] [--layout key-major|value-major]
//! [--io f32|bf16|f16]` (`--io`: every activation and the output in that dtype; the byte counts follow the state's
//! dtype).
//! `GDN_WGPU_ADAPTER=nvidia` picks an adapter by name (read here and passed in: the library reads no environment).

use gdn::step::{RowsData, Step};
use gdn::synth::Synth;
use gdn::{Backend, Commit, Config, DType, PoolOptions, Shape, StateLayout, StepArgs};
use gdn_wgpu::{Options, Subgroups, Wgpu};

fn main() {
    if let Err(e) = run() {
        eprintln!("timing: {e}");
        std::process::exit(1);
    }
}

fn run() -> gdn::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let mut row_blocks = vec![Options::default().row_blocks];
    let mut subgroups = Subgroups::Auto;
    let mut batches = vec![1usize, 256];
    let mut checks = vec![Options::default().runtime_checks];
    let mut pool_options = PoolOptions::default();
    let mut io = DType::F32;
    let mut i = 1;
    while i < args.len() {
        match args[i].as_str() {
            "--row-blocks" => {
                i += 1;
                row_blocks = args
                    .get(i)
                    .map(|s| s.split(',').filter_map(|x| x.parse().ok()).collect())
                    .unwrap_or_default();
            }
            "--no-subgroups" => subgroups = Subgroups::Off,
            "--batches" => {
                i += 1;
                batches = args
                    .get(i)
                    .map(|s| s.split(',').filter_map(|x| x.parse().ok()).collect())
                    .unwrap_or_default();
            }
            "--checks" => {
                i += 1;
                checks = args
                    .get(i)
                    .map(|s| s.split(',').map(|x| x != "off").collect())
                    .unwrap_or_default();
            }
            "--both" => subgroups = Subgroups::Require,
            "--state" | "--layout" | "--io" => {
                let flag = args[i].clone();
                i += 1;
                let v = args.get(i).map_or("", |s| s.as_str());
                match flag.as_str() {
                    "--state" => pool_options.state = v.parse()?,
                    "--layout" => pool_options.layout = v.parse::<StateLayout>()?,
                    _ => io = v.parse()?,
                }
            }
            other => {
                return Err(gdn::Error::Param {
                    name: "argument",
                    why: other.into(),
                })
            }
        }
        i += 1;
    }
    let paths: Vec<Subgroups> = if subgroups == Subgroups::Require {
        vec![Subgroups::Auto, Subgroups::Off]
    } else {
        vec![subgroups]
    };
    let shape = Shape::SEED;
    let mut rng = Synth::new(1);
    let layer = rng.layer(Config::new(shape))?;
    // one random state written to every slot: the timing does not depend on the values
    let (st, h) = rng.seq_state(&layer);
    for &sg in &paths {
        for (&ib, &checked) in row_blocks
            .iter()
            .flat_map(|ib| checks.iter().map(move |c| (ib, c)))
        {
            let backend = Wgpu::with_options(Options {
                subgroups: sg,
                row_blocks: ib,
                runtime_checks: checked,
                adapter: std::env::var("GDN_WGPU_ADAPTER")
                    .ok()
                    .filter(|s| !s.is_empty()),
                ..Options::default()
            })?;
            println!(
                "{} (row blocks {ib}, runtime checks {}; {} {} state, {} activations)",
                backend.name(),
                if checked { "on" } else { "off" },
                pool_options.state.name(),
                pool_options.layout.name(),
                io.name()
            );
            // the cost of one tiny dispatch (a 32-byte shader copy) back to back: the floor under B 1
            let (_, tiny) = backend.copy_rates(64)?;
            println!(
                "  floor: {:.1} us per back-to-back dispatch of a 32-byte copy kernel",
                64.0 / tiny * 1e6
            );
            for &b in &batches {
                let state_bytes = b * shape.state_len() * pool_options.state.size();
                let bytes = 2.0 * state_bytes as f64;
                let (by_buffer, by_shader) = backend.copy_rates(state_bytes)?;
                let ceiling = by_buffer.max(by_shader);
                println!(
                    "  B {b:3}: copy with the state's footprint: buffer-to-buffer {:.0} GB/s, shader {:.0} GB/s (read + write)",
                    by_buffer / 1e9,
                    by_shader / 1e9
                );
                let mut pool = backend.create_pool_with(&layer, b, pool_options)?;
                for s in 0..b {
                    pool.write_slot(s, &st, &h)?;
                }
                for t in [1usize, 8] {
                    let batch = rng.batch(&layer, b, t);
                    let slots: Vec<i32> = (0..b as i32).collect();
                    let args = StepArgs {
                        batch: batch.view(),
                        slots: &slots,
                        commit: Commit::All,
                        plane_stride: None,
                    };
                    let iters = if b == 1 { 200 } else { 20 };
                    let seqs = args.seqs(layer.shape())?;
                    let rows = RowsData::from_f32(
                        &batch.qkv,
                        &batch.alpha,
                        &batch.beta,
                        &batch.z,
                        [io; 4],
                    );
                    let step = Step {
                        rows: rows.view(),
                        ..args.varlen(&seqs)
                    };
                    let timing = pool.time_varlen(&step, io, iters)?;
                    let us = timing.per_call.as_secs_f64() * 1e6;
                    println!(
                        "  B {b:3} T {t}: {us:9.1} us per call ({:.0} GB/s of state read + written, {:.0}% of the ceiling; host {:.1} us per call) [{}]",
                        bytes / (us * 1e-6) / 1e9,
                        100.0 * bytes / (us * 1e-6) / ceiling,
                        timing.host_per_call.map_or(0.0, |h| h.as_secs_f64() * 1e6),
                        timing.method
                    );
                }
            }
        }
    }
    Ok(())
}
