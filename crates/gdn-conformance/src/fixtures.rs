//! Replays the committed reference cases through a backend: windows and whole-layer forwards computed with HF
//! transformers' Qwen3.5 GatedDeltaNet code in float64 (`tools/conformance/make_fixtures.py`), stored in the
//! `gdn step` input format plus `expect_y`, `expect_state` and `expect_hist` (F64) and a `commit` entry in the
//! metadata.

use std::path::{Path, PathBuf};

use gdn::stepfile::{Overrides, StepInput};
use gdn::{Backend, Commit, DType, TensorData};
use safetensors::{Dtype, SafeTensors};

use crate::F32_BOUND;

/// The folder of the HF fixtures.
pub fn hf_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/hf")
}

/// Every fixture file, sorted by name.
pub fn hf_files() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(hf_dir())
        .expect("fixtures/hf exists")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    files
}

fn f64_tensor(st: &SafeTensors<'_>, name: &str) -> Vec<f64> {
    let v = st
        .tensor(name)
        .unwrap_or_else(|e| panic!("fixture tensor {name}: {e}"));
    match v.dtype() {
        Dtype::F64 => v
            .data()
            .chunks_exact(8)
            .map(|b| f64::from_le_bytes(b.try_into().expect("8 bytes")))
            .collect(),
        Dtype::F32 => v
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")) as f64)
            .collect(),
        other => panic!("fixture tensor {name} has dtype {other:?}"),
    }
}

/// Relative errors of one fixture on a backend: (y, state, hist).
pub fn replay(backend: &dyn Backend, path: &Path) -> (f64, f64, f64) {
    replay_as(backend, path, DType::F32)
}

/// The bound on a fixture replayed with bf16 activations (inputs rounded to bf16, y written in bf16) against HF's
/// float64 result from the unrounded inputs: the inputs' rounding (2^-9 relative) carried through the step
/// (measured: y 5.8e-3, state 3.1e-3 at worst over the fixtures).
pub const BF16_IO_BOUND: f64 = 1e-2;

/// [`replay`] with every activation rounded to `io` and y written in `io`.
pub fn replay_as(backend: &dyn Backend, path: &Path, io: DType) -> (f64, f64, f64) {
    let bytes = std::fs::read(path).expect("read fixture");
    let mut input = StepInput::parse(&bytes, Overrides::default()).expect("fixture parses");
    for t in [
        &mut input.rows.qkv,
        &mut input.rows.alpha,
        &mut input.rows.beta,
        &mut input.rows.z,
    ] {
        *t = TensorData::from_f32(&t.to_f32(), io);
    }
    let commit: Commit = input
        .metadata
        .get("commit")
        .map_or(Ok(Commit::All), |s| s.parse())
        .expect("commit metadata");
    let out = input
        .run(backend, commit, false, None)
        .expect("fixture runs");
    let st = SafeTensors::deserialize(&bytes).expect("fixture deserializes");
    (
        gdn::relative_error(&out.y(), &f64_tensor(&st, "expect_y")),
        gdn::relative_error(&out.state, &f64_tensor(&st, "expect_state")),
        gdn::relative_error(&out.hist, &f64_tensor(&st, "expect_hist")),
    )
}

/// Replays every HF fixture and checks each tensor within F32_BOUND; prints the errors per case.
pub fn replay_all(backend: &dyn Backend) {
    let files = hf_files();
    assert!(
        files.len() >= 10,
        "expected the HF fixtures in {}",
        hf_dir().display()
    );
    // f32 activations, then bf16 activations in and out
    for (io, bound) in [(DType::F32, F32_BOUND), (DType::Bf16, BF16_IO_BOUND)] {
        let mut worst = (0.0f64, 0.0f64, 0.0f64);
        for f in &files {
            let (y, s, h) = replay_as(backend, f, io);
            let name = f.file_stem().unwrap_or_default().to_string_lossy();
            eprintln!(
                "{}: {name:<24} {} activations: y {y:.2e}  state {s:.2e}  hist {h:.2e}",
                backend.name(),
                io.name()
            );
            assert!(
                y < bound && s < bound && h < bound,
                "{name}, {} activations: relative error against HF over {bound:e}: y {y:.2e} state {s:.2e} hist {h:.2e}",
                io.name()
            );
            worst = (worst.0.max(y), worst.1.max(s), worst.2.max(h));
        }
        eprintln!(
            "{}: worst over {} HF fixtures, {} activations: y {:.2e}, state {:.2e}, hist {:.2e}",
            backend.name(),
            files.len(),
            io.name(),
            worst.0,
            worst.1,
            worst.2
        );
    }
}
