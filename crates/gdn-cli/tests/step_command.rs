//! `gdn step` end to end: a window file in, the outputs file out, checked against the oracle; bad input gives
//! one clear line on stderr, a non-zero exit, and no output file.

use std::path::Path;
use std::process::Command;

use gdn::oracle::{self, SeqState};
use gdn::synth::Synth;
use gdn::{Commit, Config, Gate, HeadMap, Shape};
use safetensors::SafeTensors;

fn gdn_cmd() -> Command {
    Command::new(env!("CARGO_BIN_EXE_gdn"))
}

fn tensor(bytes: &[u8], name: &str) -> (Vec<usize>, Vec<f32>) {
    let st = SafeTensors::deserialize(bytes).unwrap();
    let v = st
        .tensor(name)
        .unwrap_or_else(|_| panic!("output has no {name}"));
    let data = v
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    (v.shape().to_vec(), data)
}

fn write_case(
    dir: &Path,
    b: usize,
    t: usize,
) -> (
    gdn::Layer,
    gdn::BatchData,
    Vec<f32>,
    Vec<f32>,
    std::path::PathBuf,
) {
    let shape = Shape::new(32, 2, 4).unwrap();
    let mut rng = Synth::new(3);
    let mut config = Config::new(shape);
    config.head_map = HeadMap::Grouped;
    config.gate = Gate::Silu;
    let layer = rng.layer(config).unwrap();
    let batch = rng.batch(&layer, b, t);
    let (mut state, mut hist) = (Vec::new(), Vec::new());
    for _ in 0..b {
        let (s, h) = rng.seq_state(&layer);
        state.extend(s);
        hist.extend(h);
    }
    let path = dir.join("in.safetensors");
    let meta = [("head_map", "grouped"), ("gate", "silu")]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    gdn::stepfile::write_input(&path, &layer, &batch, Some(&state), Some(&hist), Some(meta))
        .unwrap();
    (layer, batch, state, hist, path)
}

#[test]
fn step_writes_outputs_that_match_the_oracle() {
    let dir = tempfile::tempdir().unwrap();
    let (b, t, k) = (2, 5, 3);
    let (layer, batch, state, hist, input) = write_case(dir.path(), b, t);
    let output = dir.path().join("out.safetensors");
    let st = gdn_cmd()
        .args(["step", "--input"])
        .arg(&input)
        .arg("--output")
        .arg(&output)
        .args(["--commit", &k.to_string(), "--planes"])
        .status()
        .unwrap();
    assert!(st.success());
    let bytes = std::fs::read(&output).unwrap();
    let sh = *layer.shape();
    let mut states: Vec<SeqState> = (0..b)
        .map(|i| {
            SeqState::from_f32(
                &state[i * sh.state_len()..(i + 1) * sh.state_len()],
                &hist[i * sh.hist_len()..(i + 1) * sh.hist_len()],
            )
        })
        .collect();
    let want = oracle::step(
        &layer,
        &mut states,
        &batch.view(),
        &[0, 1],
        Commit::First(k),
        None,
    )
    .unwrap();
    let (y_shape, y) = tensor(&bytes, "y");
    assert_eq!(y_shape, vec![b, t, sh.n()]);
    assert!(gdn::relative_error(&y, &want) < 1e-5);
    let (s_shape, s) = tensor(&bytes, "state");
    assert_eq!(s_shape, vec![b, sh.d, sh.h_v, sh.d]);
    let want_s: Vec<f64> = states.iter().flat_map(|x| x.s.clone()).collect();
    assert!(gdn::relative_error(&s, &want_s) < 1e-5);
    let (_, h) = tensor(&bytes, "hist");
    let want_h: Vec<f64> = states.iter().flat_map(|x| x.h.clone()).collect();
    assert!(gdn::relative_error(&h, &want_h) == 0.0);
    let (p_shape, planes) = tensor(&bytes, "planes");
    assert_eq!(p_shape, vec![b, 4, t, sh.n()]);
    let tn = t * sh.n();
    for s in 0..b {
        assert_eq!(
            &planes[s * 4 * tn..s * 4 * tn + tn],
            &y[s * tn..(s + 1) * tn],
            "plane 0 is y"
        );
        for m in 0..sh.n() {
            let p1 = planes[s * 4 * tn + tn + m];
            assert_eq!(p1, y[s * tn + m] * gdn::plane_scale(1, m));
        }
    }
    let (g_shape, _) = tensor(&bytes, "group_sums");
    assert_eq!(g_shape, vec![b, t, sh.n() / 16]);
}

#[test]
fn step_replays_an_hf_fixture() {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../gdn-conformance/fixtures/hf/win_r3_t7_tiled.safetensors");
    let dir = tempfile::tempdir().unwrap();
    let output = dir.path().join("out.safetensors");
    let st = gdn_cmd()
        .args(["step", "--input"])
        .arg(&fixture)
        .arg("--output")
        .arg(&output)
        .status()
        .unwrap();
    assert!(st.success());
    let out = std::fs::read(&output).unwrap();
    let fix = std::fs::read(&fixture).unwrap();
    let fst = SafeTensors::deserialize(&fix).unwrap();
    let want: Vec<f64> = fst
        .tensor("expect_y")
        .unwrap()
        .data()
        .chunks_exact(8)
        .map(|b| f64::from_le_bytes(b.try_into().unwrap()))
        .collect();
    let (_, y) = tensor(&out, "y");
    assert!(
        gdn::relative_error(&y, &want) < 1e-5,
        "the file's metadata (tiled, silu) was not honoured"
    );
}

fn expect_failure(args: &[&str], output: &Path, needle: &str) {
    let out = gdn_cmd().args(args).output().unwrap();
    assert!(!out.status.success(), "{args:?} should fail");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        err.trim().lines().count(),
        1,
        "one line on stderr, got: {err}"
    );
    assert!(
        err.contains(needle),
        "stderr '{err}' should mention '{needle}'"
    );
    assert!(!output.exists(), "nothing is written on error");
}

#[test]
fn bad_input_fails_with_one_line_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (_, _, _, _, input) = write_case(dir.path(), 1, 3);
    let output = dir.path().join("out.safetensors");
    let (i, o) = (input.to_str().unwrap(), output.to_str().unwrap());
    expect_failure(
        &["step", "--input", i, "--output", o, "--commit", "4"],
        &output,
        "commit first 4",
    );
    expect_failure(
        &["step", "--input", i, "--output", o, "--commit", "0"],
        &output,
        "commit first 0",
    );
    expect_failure(
        &["step", "--input", i, "--output", o, "--backend", "tpu"],
        &output,
        "[possible values: cpu, cuda, wgpu]",
    );
    expect_failure(
        &["step", "--input", i, "--output", o, "--eps=-1"],
        &output,
        "eps",
    );
    let missing = dir.path().join("missing.safetensors");
    expect_failure(
        &["step", "--input", missing.to_str().unwrap(), "--output", o],
        &output,
        "missing.safetensors",
    );
    let garbage = dir.path().join("garbage.safetensors");
    std::fs::write(&garbage, b"not a safetensors file at all").unwrap();
    expect_failure(
        &["step", "--input", garbage.to_str().unwrap(), "--output", o],
        &output,
        "malformed",
    );
    // a file whose z has the wrong width
    let shape = Shape::new(16, 1, 2).unwrap();
    let mut rng = Synth::new(1);
    let layer = rng.layer(Config::new(shape)).unwrap();
    let mut batch = rng.batch(&layer, 1, 2);
    batch.z.truncate(batch.z.len() - 16);
    let bad = dir.path().join("bad.safetensors");
    let r = gdn::stepfile::write_input(&bad, &layer, &batch, None, None, None);
    assert!(r.is_err(), "write_input refuses a z of the wrong size");
    let bad_meta = dir.path().join("bad_meta.safetensors");
    let batch = rng.batch(&layer, 1, 2);
    let meta = [("head_map".to_string(), "diagonal".to_string())]
        .into_iter()
        .collect();
    gdn::stepfile::write_input(&bad_meta, &layer, &batch, None, None, Some(meta)).unwrap();
    expect_failure(
        &["step", "--input", bad_meta.to_str().unwrap(), "--output", o],
        &output,
        "diagonal",
    );
}

/// A varlen file: packed bf16 rows, `cu_seqlens`, a per-sequence `commit` tensor, a bf16 state in the
/// value-major layout; the outputs come back in bf16 and the committed states as the oracle says.
#[test]
fn a_varlen_file_with_bf16_rows_and_state_matches_the_oracle() {
    use gdn::{DType, RowsData, Seq, StateLayout, Step};
    let dir = tempfile::tempdir().unwrap();
    let shape = Shape::new(32, 2, 4).unwrap();
    let mut rng = Synth::new(8);
    let mut config = Config::new(shape);
    config.head_map = HeadMap::Grouped;
    let layer = rng.layer(config).unwrap();
    let lens = [3usize, 1, 5];
    let cu = [0usize, 3, 4, 9];
    let commits = [Commit::First(2), Commit::Verify, Commit::All];
    let data = rng.batch(&layer, 1, 9);
    let rows = RowsData::from_f32(
        &data.qkv,
        &data.alpha,
        &data.beta,
        &data.z,
        [DType::Bf16; 4],
    );
    let (mut state_km, mut hist) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        let (s, h) = rng.seq_state(&layer);
        state_km.extend(s.iter().map(|&x| DType::Bf16.round(x)));
        hist.extend(h);
    }
    let sl = shape.state_len();
    let to_vm = |s: &[f32]| -> Vec<f32> {
        s.chunks(sl)
            .flat_map(|c| StateLayout::KeyMajor.convert(StateLayout::ValueMajor, &shape, c))
            .collect()
    };
    let input = dir.path().join("varlen.safetensors");
    let meta = [
        ("state_layout", "value-major"),
        ("head_map", "repeat_interleave"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    gdn::stepfile::write_varlen_input(
        &input,
        &layer,
        &rows,
        &cu,
        Some(&commits),
        Some((&to_vm(&state_km), DType::Bf16)),
        Some(&hist),
        Some(meta),
    )
    .unwrap();
    let output = dir.path().join("out.safetensors");
    let st = gdn_cmd()
        .args(["step", "--input"])
        .arg(&input)
        .arg("--output")
        .arg(&output)
        .status()
        .unwrap();
    assert!(st.success());
    let bytes = std::fs::read(&output).unwrap();
    let f = SafeTensors::deserialize(&bytes).unwrap();
    let y = f.tensor("y").unwrap();
    assert_eq!(y.dtype(), safetensors::Dtype::BF16);
    assert_eq!(y.shape(), &[9, shape.n()]);
    let widen = |d: &[u8]| -> Vec<f32> {
        d.chunks_exact(2)
            .map(|b| f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16))
            .collect()
    };
    let y = widen(y.data());
    let st = f.tensor("state").unwrap();
    assert_eq!(st.dtype(), safetensors::Dtype::BF16);
    let state_vm = widen(st.data());
    let seqs: Vec<Seq> = (0..3)
        .map(|i| Seq {
            slot: i as i32,
            start: cu[i],
            len: lens[i],
            commit: commits[i],
        })
        .collect();
    let mut states: Vec<SeqState> = (0..3)
        .map(|i| {
            SeqState::from_f32(
                &state_km[i * sl..(i + 1) * sl],
                &hist[i * shape.hist_len()..(i + 1) * shape.hist_len()],
            )
        })
        .collect();
    let step = Step {
        rows: rows.view(),
        seqs: &seqs,
        plane_stride: None,
    };
    let want = oracle::step_varlen(&layer, &mut states, &step, DType::Bf16, DType::Bf16).unwrap();
    assert!(gdn::relative_error(&y, &want) < 2e-3);
    let want_vm: Vec<f64> = to_vm(
        &states
            .iter()
            .flat_map(|s| s.s.iter().map(|&x| x as f32))
            .collect::<Vec<_>>(),
    )
    .iter()
    .map(|&x| x as f64)
    .collect();
    assert!(gdn::relative_error(&state_vm, &want_vm) < 2e-3);
    // the verify sequence's state is the file's, bitwise
    assert_eq!(&state_vm[sl..2 * sl], &to_vm(&state_km)[sl..2 * sl]);
}
