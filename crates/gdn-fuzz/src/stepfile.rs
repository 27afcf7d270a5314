//! Target `stepfile`: `StepInput::parse` on mutated window files, then `StepInput::run` on the CPU backend for
//! the ones that parse and are small. Mutations are of three kinds: structural (a file decomposed into tensors
//! and metadata, one of them changed, reassembled: shapes, dtypes, row counts, `cu_seqlens` and `commit`
//! values, special floats, metadata values, names), byte-level inside the JSON header with its length prefix
//! kept right, and byte-level over the whole file (lengths, truncation, splices).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use gdn::stepfile::{write_input, write_varlen_input, Form, Overrides, StepInput};
use gdn::synth::Synth;
use gdn::{Commit, Config, DType, Gate, HeadMap, RowsData, Shape};
use rand::rngs::SmallRng;
use rand::Rng;
use safetensors::SafeTensors;

use crate::harness::{Outcome, Target};

/// Inputs larger than this are cut (the seeds are 2 to 26 KB).
const MAX_LEN: usize = 1 << 17;

/// The largest file `run` is tried on, in floats of state across its sequences, rows, and state updates
/// (rows x state): beyond these the run is skipped as too slow for a fuzzer, not as wrong.
const RUN_STATE_FLOATS: usize = 1 << 20;
const RUN_ROWS: usize = 512;
const RUN_WORK: usize = 1 << 24;

pub struct StepFile {
    cpu: gdn::Cpu,
    corpus_dir: PathBuf,
}

impl StepFile {
    pub fn new(corpus_dir: PathBuf) -> Self {
        StepFile {
            cpu: gdn::Cpu::with_threads(2).unwrap_or_default(),
            corpus_dir,
        }
    }
}

/// The HF fixtures used as seeds beside the generated files, read in place (not copied).
const HF_SEEDS: &[&str] = &[
    "win_r1_t1.safetensors",
    "win_r2_t5_verify.safetensors",
    "fwd_decode_t1.safetensors",
];

fn hf_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../gdn-conformance/fixtures/hf")
}

/// Writes the generated seeds: small uniform and varlen files at d 16 (f32 and bf16 rows, states present and
/// absent, commits, metadata), a few KB each.
pub fn write_corpus(dir: &Path) -> gdn::Result<()> {
    std::fs::create_dir_all(dir)?;
    let mut rng = Synth::new(16);
    let meta = |kv: &[(&str, &str)]| {
        Some(
            kv.iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        )
    };
    // uniform, B 2 T 2, d 16, one q/k head and one value head, with state and history
    let layer = rng.layer(Config::new(Shape::new(16, 1, 1)?))?;
    let batch = rng.batch(&layer, 2, 2);
    let (s0, h0) = rng.seq_state(&layer);
    let (s1, h1) = rng.seq_state(&layer);
    write_input(
        &dir.join("uniform_b2_t2.safetensors"),
        &layer,
        &batch,
        Some(&[s0, s1].concat()),
        Some(&[h0, h1].concat()),
        meta(&[("gate", "silu"), ("eps", "1e-5")]),
    )?;
    // uniform decode, no state or history (zeros)
    let batch = rng.batch(&layer, 1, 1);
    write_input(
        &dir.join("uniform_b1_t1_nostate.safetensors"),
        &layer,
        &batch,
        None,
        None,
        None,
    )?;
    // varlen, h_v 2 grouped, rows 1 + 3, bf16 rows, commits verify and 2, bf16 value-major state
    let layer = rng.layer(Config {
        head_map: HeadMap::Grouped,
        gate: Gate::Sigmoid,
        ..Config::new(Shape::new(16, 1, 2)?)
    })?;
    let b = rng.batch(&layer, 1, 4);
    let rows = RowsData::from_f32(
        &b.qkv,
        &b.alpha,
        &b.beta,
        &b.z,
        [DType::Bf16, DType::F32, DType::F16, DType::Bf16],
    );
    let (s0, h0) = rng.seq_state(&layer);
    let (s1, h1) = rng.seq_state(&layer);
    let state: Vec<f32> = [s0, s1]
        .concat()
        .into_iter()
        .map(|x| DType::Bf16.round(x))
        .collect();
    write_varlen_input(
        &dir.join("varlen_r4_s2.safetensors"),
        &layer,
        &rows,
        &[0, 1, 4],
        Some(&[Commit::Verify, Commit::First(2)]),
        Some((&state, DType::Bf16)),
        Some(&[h0, h1].concat()),
        meta(&[("head_map", "grouped"), ("state_layout", "value-major")]),
    )?;
    // varlen with rows no sequence covers and no state
    let rows = RowsData::from_f32(&b.qkv, &b.alpha, &b.beta, &b.z, [DType::F32; 4]);
    write_varlen_input(
        &dir.join("varlen_r4_s1_gap.safetensors"),
        &layer,
        &rows,
        &[0, 3],
        None,
        None,
        None,
        None,
    )?;
    Ok(())
}

/// A file taken apart: tensors (name, dtype as the header spells it, shape, bytes) and metadata.
struct Parts {
    tensors: Vec<(String, String, Vec<usize>, Vec<u8>)>,
    meta: BTreeMap<String, String>,
}

fn decompose(bytes: &[u8]) -> Option<Parts> {
    let (_, m) = SafeTensors::read_metadata(bytes).ok()?;
    let st = SafeTensors::deserialize(bytes).ok()?;
    let mut tensors: Vec<_> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| {
            (
                n,
                format!("{:?}", v.dtype()),
                v.shape().to_vec(),
                v.data().to_vec(),
            )
        })
        .collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    Some(Parts {
        tensors,
        meta: m
            .metadata()
            .clone()
            .unwrap_or_default()
            .into_iter()
            .collect(),
    })
}

fn json_str(s: &str) -> String {
    let mut o = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            c if (c as u32) < 0x20 => o.push_str(&format!("\\u{:04x}", c as u32)),
            c => o.push(c),
        }
    }
    o.push('"');
    o
}

/// The file format written by hand, so that what safetensors' own writer refuses (a shape that does not match
/// the data, any dtype name) can be written too.
fn compose(p: &Parts) -> Vec<u8> {
    let mut fields = Vec::new();
    if !p.meta.is_empty() {
        let kv: Vec<String> = p
            .meta
            .iter()
            .map(|(k, v)| format!("{}:{}", json_str(k), json_str(v)))
            .collect();
        fields.push(format!("\"__metadata__\":{{{}}}", kv.join(",")));
    }
    let mut off = 0usize;
    for (name, dtype, shape, data) in &p.tensors {
        let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
        fields.push(format!(
            "{}:{{\"dtype\":\"{dtype}\",\"shape\":[{}],\"data_offsets\":[{off},{}]}}",
            json_str(name),
            dims.join(","),
            off + data.len()
        ));
        off += data.len();
    }
    let mut header = format!("{{{}}}", fields.join(","));
    while header.len() % 8 != 0 {
        header.push(' ');
    }
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    for (_, _, _, data) in &p.tensors {
        out.extend_from_slice(data);
    }
    out
}

const NAMES: &[&str] = &[
    "qkv",
    "alpha",
    "beta",
    "z",
    "state",
    "hist",
    "cu_seqlens",
    "commit",
    "gamma",
    "dt",
    "conv_w",
    "a",
    "A_log",
];
const DTYPES: &[&str] = &[
    "F32", "BF16", "F16", "I32", "I64", "U8", "F64", "BOOL", "I8",
];
const META_KEYS: &[&str] = &["head_map", "gate", "eps", "state_layout", "commit", "junk"];
const META_VALUES: &[&str] = &[
    "tiled",
    "grouped",
    "repeat_interleave",
    "sigmoid",
    "silu",
    "swish",
    "key-major",
    "value-major",
    "v",
    "1e-5",
    "0",
    "-1",
    "nan",
    "inf",
    "1e38",
    " 1e-6 ",
    "",
    "\u{0}",
    "all",
    "verify",
    "3",
];

fn dtype_size(d: &str) -> usize {
    match d {
        "F64" | "I64" => 8,
        "F32" | "I32" => 4,
        "BF16" | "F16" => 2,
        _ => 1,
    }
}

fn elems(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d))
}

/// Resizes a tensor's bytes to its shape where that is small, filling with random bytes.
fn fit(rng: &mut SmallRng, t: &mut (String, String, Vec<usize>, Vec<u8>)) {
    if let Some(n) = elems(&t.2).and_then(|n| n.checked_mul(dtype_size(&t.1))) {
        if n <= MAX_LEN {
            let old = t.3.len();
            t.3.resize(n, 0);
            if n > old {
                rng.fill(&mut t.3[old..]);
            }
        }
    }
}

fn ints(rng: &mut SmallRng, n: usize, i64s: bool, rows: usize) -> (String, Vec<u8>) {
    let pool: [i64; 12] = [
        0,
        1,
        2,
        3,
        rows as i64,
        rows as i64 + 1,
        rows as i64 - 1,
        -1,
        i32::MAX as i64,
        i32::MIN as i64,
        i64::MAX,
        1 << 40,
    ];
    // rising offsets most of the time, any values otherwise
    let mut v: Vec<i64> = Vec::with_capacity(n);
    let mut at = 0i64;
    for i in 0..n {
        if rng.random_bool(0.7) {
            if i > 0 {
                at += rng.random_range(0..3);
            }
            v.push(at);
        } else {
            v.push(pool[rng.random_range(0..pool.len())]);
        }
    }
    if i64s {
        (
            "I64".into(),
            v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        )
    } else {
        (
            "I32".into(),
            v.iter().flat_map(|&x| (x as i32).to_le_bytes()).collect(),
        )
    }
}

fn structural(rng: &mut SmallRng, p: &mut Parts, other: Option<&Parts>) {
    let nt = p.tensors.len();
    let pick = |rng: &mut SmallRng| rng.random_range(0..nt.max(1));
    let rows = p
        .tensors
        .iter()
        .find(|t| t.0 == "qkv")
        .and_then(|t| t.2.first().copied())
        .unwrap_or(1);
    match rng.random_range(0..10) {
        0 if nt > 0 => {
            let t = &mut p.tensors[pick(rng)];
            let s = &mut t.2;
            match rng.random_range(0..4) {
                0 if !s.is_empty() => {
                    let i = rng.random_range(0..s.len());
                    s.remove(i);
                }
                1 => {
                    let i = rng.random_range(0..=s.len());
                    s.insert(i, 1);
                }
                _ if !s.is_empty() => {
                    let i = rng.random_range(0..s.len());
                    let pool = crate::mutate::INTERESTING;
                    s[i] = if rng.random_bool(0.5) {
                        rng.random_range(0..8)
                    } else {
                        pool[rng.random_range(0..pool.len())] as usize
                    };
                }
                _ => {}
            }
            if rng.random_bool(0.8) {
                fit(rng, t);
            }
        }
        1 if nt > 0 => {
            let t = &mut p.tensors[pick(rng)];
            t.1 = DTYPES[rng.random_range(0..DTYPES.len())].into();
            if rng.random_bool(0.8) {
                fit(rng, t);
            }
        }
        2 if nt > 0 => {
            p.tensors.remove(pick(rng));
        }
        3 => {
            // cu_seqlens or commit, I32 or I64, of a length near the sequences'
            let name = if rng.random_bool(0.5) {
                "cu_seqlens"
            } else {
                "commit"
            };
            let n = rng.random_range(0..6);
            let wide = rng.random_bool(0.3);
            let (dt, data) = ints(rng, n, wide, rows);
            p.tensors.retain(|t| t.0 != name);
            p.tensors.push((name.into(), dt, vec![n], data));
        }
        4 if nt > 0 => {
            // special values in a float tensor
            let t = &mut p.tensors[pick(rng)];
            let w = dtype_size(&t.1);
            if t.3.len() >= w {
                for _ in 0..rng.random_range(1..4) {
                    let i = rng.random_range(0..t.3.len() / w) * w;
                    let specials: [f32; 7] = [
                        f32::NAN,
                        f32::INFINITY,
                        -f32::INFINITY,
                        0.0,
                        -0.0,
                        1e38,
                        1e-45,
                    ];
                    let x = specials[rng.random_range(0..specials.len())];
                    let bytes: Vec<u8> = match w {
                        4 => x.to_le_bytes().to_vec(),
                        2 => half::bf16::from_f32(x).to_bits().to_le_bytes().to_vec(),
                        8 => (x as f64).to_le_bytes().to_vec(),
                        _ => vec![0xff],
                    };
                    t.3[i..i + w].copy_from_slice(&bytes[..w]);
                }
            }
        }
        5 => {
            let k = META_KEYS[rng.random_range(0..META_KEYS.len())];
            if rng.random_bool(0.2) {
                p.meta.remove(k);
            } else {
                let v = META_VALUES[rng.random_range(0..META_VALUES.len())];
                p.meta.insert(k.into(), v.into());
            }
        }
        6 if nt > 0 => {
            let i = pick(rng);
            let name = NAMES[rng.random_range(0..NAMES.len())];
            p.tensors.retain(|t| t.0 != name);
            let i = i.min(p.tensors.len().saturating_sub(1));
            if let Some(t) = p.tensors.get_mut(i) {
                t.0 = name.into();
            }
        }
        7 => {
            if let Some(o) = other {
                if !o.tensors.is_empty() {
                    let t = o.tensors[rng.random_range(0..o.tensors.len())].clone();
                    p.tensors.retain(|x| x.0 != t.0);
                    p.tensors.push(t);
                }
            }
        }
        _ => {
            // a new row (or batch) count for every activation, and the per-sequence tensors' first dimension
            let k = [0usize, 1, 2, 3, 5, 8, 33][rng.random_range(0..7)];
            let lead_too = rng.random_bool(0.5);
            for t in &mut p.tensors {
                let act = matches!(t.0.as_str(), "qkv" | "alpha" | "beta" | "z");
                let per_seq = matches!(t.0.as_str(), "state" | "hist");
                if (act || (per_seq && lead_too)) && !t.2.is_empty() {
                    t.2[0] = k;
                    fit(rng, t);
                }
            }
        }
    }
}

impl Target for StepFile {
    fn name(&self) -> &'static str {
        "stepfile"
    }

    fn seeds(&self) -> Vec<Vec<u8>> {
        let mut files: Vec<PathBuf> = std::fs::read_dir(&self.corpus_dir)
            .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect())
            .unwrap_or_default();
        files.sort();
        files.extend(HF_SEEDS.iter().map(|f| hf_dir().join(f)));
        files.iter().filter_map(|f| std::fs::read(f).ok()).collect()
    }

    fn dict(&self) -> Vec<Vec<u8>> {
        NAMES
            .iter()
            .chain(DTYPES)
            .chain(META_KEYS)
            .chain(META_VALUES)
            .map(|s| format!("\"{s}\"").into_bytes())
            .chain(
                [
                    "__metadata__",
                    "data_offsets",
                    "shape",
                    "dtype",
                    "[]",
                    "[0,0]",
                    ":",
                    ",",
                ]
                .iter()
                .map(|s| s.as_bytes().to_vec()),
            )
            .collect()
    }

    fn max_len(&self) -> usize {
        MAX_LEN
    }

    fn mutate(&self, rng: &mut SmallRng, buf: &mut Vec<u8>, other: &[u8], dict: &[&[u8]]) {
        let r = rng.random_range(0..10);
        if r < 5 {
            if let Some(mut p) = decompose(buf) {
                let o = decompose(other);
                for _ in 0..rng.random_range(1..=3) {
                    structural(rng, &mut p, o.as_ref());
                }
                *buf = compose(&p);
                buf.truncate(MAX_LEN);
                return;
            }
        }
        let n = buf
            .get(..8)
            .map(|b| u64::from_le_bytes(b.try_into().unwrap_or_default()) as usize);
        match n {
            Some(n) if r < 8 && n <= buf.len() - 8 => {
                // inside the header, its length prefix kept right (most of the time)
                let mut header = buf[8..8 + n].to_vec();
                let data = buf[8 + n..].to_vec();
                crate::mutate::mutate(rng, &mut header, &[], dict, MAX_LEN);
                let len = if rng.random_bool(0.9) {
                    header.len() as u64
                } else {
                    rng.random()
                };
                buf.clear();
                buf.extend_from_slice(&len.to_le_bytes());
                buf.extend_from_slice(&header);
                buf.extend_from_slice(&data);
                buf.truncate(MAX_LEN);
            }
            _ => crate::mutate::mutate(rng, buf, other, dict, MAX_LEN),
        }
    }

    fn exec(&mut self, input: &[u8]) -> Outcome {
        let inp = match StepInput::parse(input, Overrides::default()) {
            Ok(inp) => inp,
            Err(e) => return Ok(format!("parse: {e}")),
        };
        // what a parsed file promises, which `run` relies on
        let sh = *inp.layer.shape();
        let s_n = inp.spans.len();
        let rows = inp
            .rows
            .view()
            .count(&sh)
            .map_err(|e| format!("parsed, but its rows disagree: {e}"))?;
        if inp.state.len() != s_n * sh.state_len() || inp.hist.len() != s_n * sh.hist_len() {
            return Err(format!(
                "parsed with {s_n} sequences but {} state and {} history floats",
                inp.state.len(),
                inp.hist.len()
            ));
        }
        if inp
            .spans
            .iter()
            .any(|&(s, l)| s.checked_add(l).is_none_or(|e| e > rows))
        {
            return Err(format!("parsed with a span outside its {rows} rows"));
        }
        if inp.commits.as_ref().is_some_and(|c| c.len() != s_n) {
            return Err("parsed with a commit count unlike its sequence count".into());
        }
        if let Form::Varlen { cu_seqlens } = &inp.form {
            if cu_seqlens.len() != s_n + 1 {
                return Err("parsed with cu_seqlens unlike its spans".into());
            }
        }
        if inp.state.len() > RUN_STATE_FLOATS
            || rows > RUN_ROWS
            || rows.saturating_mul(sh.state_len()) > RUN_WORK
        {
            return Ok("parsed; too large to run here".into());
        }
        // the run's options from the input's last bytes, so that mutants try them all
        let tail = input.last().copied().unwrap_or(0);
        let commit = [
            Commit::All,
            Commit::Verify,
            Commit::First(1),
            Commit::First(2),
        ][(tail & 3) as usize];
        let planes = tail & 4 != 0;
        let out_dtype = [None, Some(DType::F32), Some(DType::Bf16), Some(DType::F16)]
            [((tail >> 3) & 3) as usize];
        match inp.run(&self.cpu, commit, planes, out_dtype) {
            Ok(out) => {
                if out.state.len() != inp.state.len() {
                    return Err("run returned a state of another length".into());
                }
                // the output file's tensors, as `gdn step` would write them
                let _ = out.tensors();
                // the kind of a good file, for the corpus: its form, dtypes, state, commits and options
                let form = match inp.form {
                    Form::Uniform { batched, .. } => {
                        ["uniform", "uniform batched"][batched as usize]
                    }
                    Form::Varlen { .. } => "varlen",
                };
                let dt: Vec<&str> = inp.rows.view().dtypes().iter().map(|d| d.name()).collect();
                Ok(format!(
                    "ok {form} {} {:?} {} {} {} {planes} {out_dtype:?} {}",
                    dt.join(","),
                    inp.options,
                    inp.commits.is_some(),
                    commit,
                    inp.layer.config.gate.name(),
                    ["one", "some", "many"][s_n.min(2)]
                ))
            }
            Err(e) => Ok(format!("run: {e}")),
        }
    }
}
