//! The chunked path's bits over many geometries, written to a file, so that two builds of a change meant to keep
//! every sum (a reordered load, a padded array) can be compared with `cmp`: d 16, 48, 64 and 128, L 16 and 32, BV
//! 8, 16 and 32, f32 and bf16 states in both layouts, three windows of one call committing all, inside a chunk and
//! near the start; y with planes, then every slot's state and history (65 MB on lavapipe, about two minutes).
//!
//! `cargo run --release -p gdn-wgpu --example chunk_bits -- /tmp/before.bin` (then the change, `/tmp/after.bin`).
use gdn::step::{RowsData, Seq, Step, TensorData};
use gdn::synth::Synth;
use gdn::{Backend, Commit, Config, DType, OutputLayout, PoolOptions, Shape, StateLayout};
use gdn_wgpu::{Options, Wgpu};
use std::io::Write;

fn main() {
    let path = std::env::args().nth(1).expect("out file");
    let mut f = std::fs::File::create(path).unwrap();
    let mut n = 0;
    for (d, hk, hv) in [
        (16usize, 1usize, 2usize),
        (48, 1, 2),
        (128, 1, 1),
        (64, 2, 4),
    ] {
        for l in [16usize, 32] {
            for bv in [8usize, 16, 32] {
                let b = Wgpu::with_options(Options {
                    chunk_len: l,
                    chunk_columns: bv,
                    chunk_from: Some(1),
                    ..Options::default()
                })
                .unwrap();
                let shape = Shape::new(d, hk, hv).unwrap();
                let mut config = Config::new(shape);
                config.gate = gdn::Gate::Silu;
                let layer = Synth::new(d as u64 + l as u64).layer(config).unwrap();
                for (state, layout) in [
                    (DType::F32, StateLayout::KeyMajor),
                    (DType::Bf16, StateLayout::ValueMajor),
                    (DType::F32, StateLayout::ValueMajor),
                    (DType::Bf16, StateLayout::KeyMajor),
                ] {
                    let opts = PoolOptions { state, layout };
                    let mut p = b.create_pool_with(&layer, 3, opts).unwrap();
                    let mut rng = Synth::new(7 + d as u64);
                    for i in 0..3 {
                        let (s, h) = rng.seq_state(&layer);
                        p.write_slot(i, &s, &h).unwrap();
                    }
                    let rows = 150 + 77 + 40;
                    let bt = rng.batch(&layer, 1, rows);
                    let rd =
                        RowsData::from_f32(&bt.qkv, &bt.alpha, &bt.beta, &bt.z, [DType::F32; 4]);
                    let seqs = [
                        Seq {
                            slot: 0,
                            start: 0,
                            len: 150,
                            commit: Commit::All,
                        },
                        Seq {
                            slot: 1,
                            start: 150,
                            len: 77,
                            commit: Commit::First(45),
                        },
                        Seq {
                            slot: 2,
                            start: 227,
                            len: 40,
                            commit: Commit::First(17),
                        },
                    ];
                    let stride = Some(rows * shape.n() + 1);
                    let lay = OutputLayout::for_rows(&shape, rows, stride).unwrap();
                    let step = Step {
                        rows: rd.view(),
                        seqs: &seqs,
                        plane_stride: stride,
                    };
                    let mut out = TensorData::filled(lay.len(), 0.0, DType::F32);
                    p.step_varlen(&step, out.view_mut()).unwrap();
                    for v in out.to_f32() {
                        f.write_all(&v.to_bits().to_le_bytes()).unwrap();
                    }
                    for i in 0..3 {
                        let (mut s, mut h) =
                            (vec![0.0; shape.state_len()], vec![0.0; shape.hist_len()]);
                        p.read_slot(i, &mut s, &mut h).unwrap();
                        for v in s.iter().chain(h.iter()) {
                            f.write_all(&v.to_bits().to_le_bytes()).unwrap();
                        }
                    }
                    n += 1;
                }
            }
        }
    }
    eprintln!("{n} cases");
}
