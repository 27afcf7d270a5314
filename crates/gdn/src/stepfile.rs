//! The `gdn step` file format (SPEC.md, "The `gdn step` file format"): safetensors files, row-major, uniform
//! (`[B, T, ...]`, the batch dimension optional) or varlen (`[R, ...]` rows plus `cu_seqlens`); activations and
//! the state in f32, bf16 or f16.

use std::collections::HashMap;
use std::path::Path;

use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

use crate::{
    Backend, BatchData, Commit, Config, DType, Error, Gate, HeadMap, Layer, OutputLayout, Params,
    PoolOptions, Result, RowsData, Seq, Shape, StateLayout, Step, TensorData,
};

/// How a file lays out its sequences.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Form {
    /// B windows of T tokens; `batched` whether the tensors carry the batch dimension.
    Uniform { b: usize, t: usize, batched: bool },
    /// Packed rows with `cu_seqlens` [S+1].
    Varlen { cu_seqlens: Vec<usize> },
}

/// A window file as read: the layer, the packed rows, the sequences, and each sequence's starting state.
#[derive(Clone, Debug)]
pub struct StepInput {
    pub layer: Layer,
    pub form: Form,
    /// The rows of every sequence, packed (for a uniform file, sequence b's token at row `b * t + token`).
    pub rows: RowsData,
    /// Per sequence: its first row and length.
    pub spans: Vec<(usize, usize)>,
    /// Per sequence commits from the file's `commit` tensor, if it has one.
    pub commits: Option<Vec<Commit>>,
    /// [S][d][h_v][d] in `options.layout`, values representable in `options.state`; zeros when absent.
    pub state: Vec<f32>,
    /// [S][C][3]; zeros when the file has none.
    pub hist: Vec<f32>,
    /// The state's dtype (from the `state` tensor's) and layout (from the metadata or the command line).
    pub options: PoolOptions,
    /// The file's `__metadata__`.
    pub metadata: HashMap<String, String>,
}

/// Options given on the command line; each overrides the file's `__metadata__`, which overrides the seed's
/// defaults (tiled, sigmoid, 1e-6, key-major).
#[derive(Clone, Copy, Debug, Default)]
pub struct Overrides {
    pub head_map: Option<HeadMap>,
    pub gate: Option<Gate>,
    pub eps: Option<f32>,
    pub state_layout: Option<StateLayout>,
}

fn bad(msg: impl Into<String>) -> Error {
    Error::File(msg.into())
}

fn file_dtype(dt: DType) -> Dtype {
    match dt {
        DType::F32 => Dtype::F32,
        DType::Bf16 => Dtype::BF16,
        DType::F16 => Dtype::F16,
    }
}

struct Tensors<'a> {
    st: SafeTensors<'a>,
}

impl Tensors<'_> {
    fn view(&self, name: &str) -> Result<Option<TensorView<'_>>> {
        match self.st.tensor(name) {
            Ok(v) => Ok(Some(v)),
            Err(safetensors::SafeTensorError::TensorNotFound(_)) => Ok(None),
            Err(e) => Err(bad(format!("tensor '{name}': {e}"))),
        }
    }

    /// A tensor of activations (or a state) with its own dtype: F32, BF16 or F16.
    fn get_data(&self, name: &str) -> Result<Option<(Vec<usize>, TensorData)>> {
        let Some(view) = self.view(name)? else {
            return Ok(None);
        };
        let raw = view.data();
        let data = match view.dtype() {
            Dtype::F32 => TensorData::F32(
                raw.chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect(),
            ),
            Dtype::BF16 => TensorData::Bf16(
                raw.chunks_exact(2)
                    .map(|b| half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]])))
                    .collect(),
            ),
            Dtype::F16 => TensorData::F16(
                raw.chunks_exact(2)
                    .map(|b| half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])))
                    .collect(),
            ),
            other => {
                return Err(bad(format!(
                    "tensor '{name}' is {other:?}, expected F32, BF16 or F16"
                )))
            }
        };
        Ok(Some((view.shape().to_vec(), data)))
    }

    /// A tensor widened to f32 (parameters, the history).
    fn get(&self, name: &str) -> Result<Option<(Vec<usize>, Vec<f32>)>> {
        Ok(self.get_data(name)?.map(|(s, d)| (s, d.to_f32())))
    }

    fn need(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>)> {
        self.get(name)?
            .ok_or_else(|| bad(format!("tensor '{name}' is missing")))
    }

    fn need_data(&self, name: &str) -> Result<(Vec<usize>, TensorData)> {
        self.get_data(name)?
            .ok_or_else(|| bad(format!("tensor '{name}' is missing")))
    }

    /// An integer tensor (I32 or I64) as i64 values.
    fn get_ints(&self, name: &str) -> Result<Option<(Vec<usize>, Vec<i64>)>> {
        let Some(view) = self.view(name)? else {
            return Ok(None);
        };
        let raw = view.data();
        let v = match view.dtype() {
            Dtype::I32 => raw
                .chunks_exact(4)
                .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as i64)
                .collect(),
            Dtype::I64 => raw
                .chunks_exact(8)
                .map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes")))
                .collect(),
            other => {
                return Err(bad(format!(
                    "tensor '{name}' is {other:?}, expected I32 or I64"
                )))
            }
        };
        Ok(Some((view.shape().to_vec(), v)))
    }
}

fn expect_shape(name: &str, got: &[usize], want: &[usize]) -> Result<()> {
    if got != want {
        return Err(bad(format!(
            "tensor '{name}' has shape {got:?}, expected {want:?}"
        )));
    }
    Ok(())
}

/// `n * per` floats of zeros, an error where the count overflows or the memory cannot be had.
fn zeros(name: &str, n: usize, per: usize) -> Result<Vec<f32>> {
    let too_large = || bad(format!("{n} sequences' {name} overflow the address space"));
    let len = n.checked_mul(per).ok_or_else(too_large)?;
    let mut v = Vec::new();
    v.try_reserve_exact(len).map_err(|_| too_large())?;
    v.resize(len, 0.0);
    Ok(v)
}

impl StepInput {
    /// Reads and checks a window file.
    pub fn read(path: &Path, overrides: Overrides) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|source| Error::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::parse(&bytes, overrides)
    }

    /// Parses and checks a window file's bytes. Every size is checked arithmetic on the file's shapes, whose data
    /// the file holds; the one allocation the data does not bound is the zero state of a file without `state`
    /// (S sequences of d * h_v * d floats, S at most the rows: at most 2 d bytes per byte of bf16 `qkv`), which
    /// is an error rather than an abort where the memory cannot be reserved.
    pub fn parse(bytes: &[u8], overrides: Overrides) -> Result<Self> {
        let (_, meta) = SafeTensors::read_metadata(bytes).map_err(|e| bad(e.to_string()))?;
        let metadata = meta.metadata().clone().unwrap_or_default();
        let st = SafeTensors::deserialize(bytes).map_err(|e| bad(e.to_string()))?;
        let ts = Tensors { st };

        let (gs, gamma) = ts.need("gamma")?;
        let (ds, dt) = ts.need("dt")?;
        let (cs, conv_w) = ts.need("conv_w")?;
        let d = match gs[..] {
            [d] => d,
            _ => {
                return Err(bad(format!(
                    "tensor 'gamma' has shape {gs:?}, expected [d]"
                )))
            }
        };
        let h_v = match ds[..] {
            [h] => h,
            _ => return Err(bad(format!("tensor 'dt' has shape {ds:?}, expected [h_v]"))),
        };
        let c = match cs[..] {
            [c, 4] | [c, 1, 4] => c,
            _ => {
                return Err(bad(format!(
                    "tensor 'conv_w' has shape {cs:?}, expected [C, 4] or [C, 1, 4]"
                )))
            }
        };
        // the decay rate as `a`, or the checkpoint's A_log (a = -exp(A_log))
        let a = match (ts.get("a")?, ts.get("A_log")?) {
            (Some((s, a)), None) => {
                expect_shape("a", &s, &[h_v])?;
                a
            }
            (None, Some((s, a_log))) => {
                expect_shape("A_log", &s, &[h_v])?;
                a_log.iter().map(|&x| -x.exp()).collect()
            }
            (Some(_), Some(_)) => return Err(bad("the file has both 'a' and 'A_log'; give one")),
            (None, None) => return Err(bad("tensor 'a' (or 'A_log') is missing")),
        };
        if d == 0 || c % d != 0 || c / d <= h_v || (c / d - h_v) % 2 != 0 {
            return Err(bad(format!(
                "conv_w has {c} channels, which is not (2 h_k + h_v) d for d {d}, h_v {h_v}"
            )));
        }
        let shape = Shape::new(d, (c / d - h_v) / 2, h_v)?;

        let meta_parse = |key: &str| metadata.get(key).map(|s| s.as_str());
        let head_map = match (overrides.head_map, meta_parse("head_map")) {
            (Some(m), _) => m,
            (None, Some(s)) => s.parse()?,
            (None, None) => HeadMap::Tiled,
        };
        let gate = match (overrides.gate, meta_parse("gate")) {
            (Some(g), _) => g,
            (None, Some(s)) => s.parse()?,
            (None, None) => Gate::Sigmoid,
        };
        let eps = match (overrides.eps, meta_parse("eps")) {
            (Some(e), _) => e,
            (None, Some(s)) => s
                .trim()
                .parse::<f32>()
                .map_err(|_| bad(format!("metadata eps '{s}' is not a number")))?,
            (None, None) => 1e-6,
        };
        let layout = match (overrides.state_layout, meta_parse("state_layout")) {
            (Some(l), _) => l,
            (None, Some(s)) => s.parse()?,
            (None, None) => StateLayout::KeyMajor,
        };
        let config = Config {
            shape,
            head_map,
            gate,
            eps,
        };
        let layer = Layer::new(
            config,
            Params {
                conv_w,
                dt,
                a,
                gamma,
            },
        )?;

        let (qs, qkv) = ts.need_data("qkv")?;
        let cu = ts.get_ints("cu_seqlens")?;
        // the leading dimensions every activation carries, and the per-sequence ones of state and hist
        let (form, lead, per_seq) = match (&qs[..], cu) {
            ([r, cc], Some((cus, cu))) if *cc == c => {
                if cus.len() != 1 || cu.is_empty() {
                    return Err(bad(format!(
                        "tensor 'cu_seqlens' has shape {cus:?}, expected [S+1]"
                    )));
                }
                let cu: Vec<usize> = cu
                    .iter()
                    .map(|&x| usize::try_from(x))
                    .collect::<std::result::Result<_, _>>()
                    .map_err(|_| bad("cu_seqlens has a negative offset"))?;
                if cu[0] != 0 || cu.windows(2).any(|w| w[1] < w[0]) || cu[cu.len() - 1] > *r {
                    return Err(bad(format!(
                        "cu_seqlens must rise from 0 to at most the {r} rows of qkv"
                    )));
                }
                // an empty sequence could never run, and each would cost a zero state below for 4 bytes
                // of file: with none, the sequences are at most the rows
                if let Some(seq) = cu.windows(2).position(|w| w[1] == w[0]) {
                    return Err(Error::EmptySeq { seq });
                }
                let s = cu.len() - 1;
                (Form::Varlen { cu_seqlens: cu }, vec![*r], vec![s])
            }
            ([b, t, cc], None) if *cc == c => (
                Form::Uniform {
                    b: *b,
                    t: *t,
                    batched: true,
                },
                vec![*b, *t],
                vec![*b],
            ),
            ([t, cc], None) if *cc == c => (
                Form::Uniform {
                    b: 1,
                    t: *t,
                    batched: false,
                },
                vec![*t],
                vec![],
            ),
            (_, cu) => {
                let want = if cu.is_some() {
                    format!("[R, {c}] with cu_seqlens")
                } else {
                    format!("[B, T, {c}] or [T, {c}]")
                };
                return Err(bad(format!(
                    "tensor 'qkv' has shape {qs:?}, expected {want}"
                )));
            }
        };
        let spans: Vec<(usize, usize)> = match &form {
            Form::Uniform { b, t, .. } => {
                if *t == 0 {
                    return Err(Error::EmptyWindow);
                }
                (0..*b).map(|i| (i * t, *t)).collect()
            }
            Form::Varlen { cu_seqlens } => {
                cu_seqlens.windows(2).map(|w| (w[0], w[1] - w[0])).collect()
            }
        };
        let n_seqs = spans.len();
        let dims = |w: &[usize]| -> Vec<usize> { lead.iter().chain(w).copied().collect() };
        let seq = |w: &[usize]| -> Vec<usize> { per_seq.iter().chain(w).copied().collect() };
        let (al_s, alpha) = ts.need_data("alpha")?;
        expect_shape("alpha", &al_s, &dims(&[h_v]))?;
        let (be_s, beta) = ts.need_data("beta")?;
        expect_shape("beta", &be_s, &dims(&[h_v]))?;
        let (z_s, z) = ts.need_data("z")?;
        expect_shape("z", &z_s, &dims(&[shape.n()]))?;
        let commits = match ts.get_ints("commit")? {
            None => None,
            Some((s, v)) => {
                expect_shape("commit", &s, &[n_seqs])?;
                Some(
                    v.iter()
                        .zip(&spans)
                        .enumerate()
                        .map(|(i, (&k, &(_, len)))| match k {
                            0 => Ok(Commit::Verify),
                            k if k > 0 && k as u64 == len as u64 => Ok(Commit::All),
                            k if k > 0 => {
                                Ok(Commit::First(usize::try_from(k).unwrap_or(usize::MAX)))
                            }
                            _ => Err(bad(format!("commit[{i}] = {k} is negative"))),
                        })
                        .collect::<Result<Vec<_>>>()?,
                )
            }
        };
        let (state, state_dtype) = match ts.get_data("state")? {
            Some((s, v)) => {
                expect_shape("state", &s, &seq(&[d, h_v, d]))?;
                let dt = v.dtype();
                if dt == DType::F16 {
                    return Err(Error::Unsupported(
                        "an F16 'state' (a state is F32 or BF16)".into(),
                    ));
                }
                (v.to_f32(), dt)
            }
            None => (zeros("state", n_seqs, shape.state_len())?, DType::F32),
        };
        let hist = match ts.get("hist")? {
            Some((s, v)) => {
                expect_shape("hist", &s, &seq(&[c, 3]))?;
                v
            }
            None => zeros("hist", n_seqs, shape.hist_len())?,
        };
        Ok(StepInput {
            layer,
            form,
            rows: RowsData {
                qkv,
                alpha,
                beta,
                z,
            },
            spans,
            commits,
            state,
            hist,
            options: PoolOptions {
                state: state_dtype,
                layout,
            },
            metadata,
        })
    }

    /// The file's windows as a uniform f32 batch, where the file is uniform.
    pub fn batch(&self) -> Option<BatchData> {
        match self.form {
            Form::Uniform { b, t, .. } => Some(BatchData {
                b,
                t,
                qkv: self.rows.qkv.to_f32(),
                alpha: self.rows.alpha.to_f32(),
                beta: self.rows.beta.to_f32(),
                z: self.rows.z.to_f32(),
            }),
            Form::Varlen { .. } => None,
        }
    }

    /// Runs the file's windows on a backend: one pool slot per sequence (with the file's state dtype and layout),
    /// loaded with the file's states; each sequence commits as the file's `commit` tensor says, else `commit`.
    /// The output is in `out_dtype`, or the dtype of the file's `z` when `None`.
    pub fn run(
        &self,
        backend: &dyn Backend,
        commit: Commit,
        planes: bool,
        out_dtype: Option<DType>,
    ) -> Result<StepOutput> {
        let sh = *self.layer.shape();
        let s_n = self.spans.len();
        // the fields are public: what `parse` guarantees is checked again rather than trusted by the slicing
        // below
        let floats = |per: usize| s_n.saturating_mul(per);
        for (name, got, expected) in [
            ("state", self.state.len(), floats(sh.state_len())),
            ("hist", self.hist.len(), floats(sh.hist_len())),
            (
                "commit",
                self.commits.as_ref().map_or(s_n, |c| c.len()),
                s_n,
            ),
        ] {
            if got != expected {
                return Err(Error::Length {
                    name,
                    expected,
                    got,
                });
            }
        }
        if i32::try_from(s_n).is_err() {
            return Err(bad(format!(
                "{s_n} sequences are more than a pool's i32 slots"
            )));
        }
        let seqs: Vec<Seq> = self
            .spans
            .iter()
            .enumerate()
            .map(|(i, &(start, len))| Seq {
                slot: i as i32,
                start,
                len,
                commit: self.commits.as_ref().map_or(commit, |c| c[i]),
            })
            .collect();
        let rows = self.rows.view().count(&sh)?;
        let layout = OutputLayout::for_rows(&sh, rows, planes.then(|| rows * sh.n()))?;
        let step = Step {
            rows: self.rows.view(),
            seqs: &seqs,
            plane_stride: layout.plane_stride,
        };
        // bad sequences are reported before a pool is made
        step.validate(&self.layer, s_n, layout.len())?;
        let mut pool = backend.create_pool_with(&self.layer, s_n, self.options)?;
        for i in 0..s_n {
            pool.write_slot(
                i,
                &self.state[i * sh.state_len()..(i + 1) * sh.state_len()],
                &self.hist[i * sh.hist_len()..(i + 1) * sh.hist_len()],
            )?;
        }
        let out_dtype = out_dtype.unwrap_or(self.rows.z.dtype());
        let mut out = TensorData::filled(layout.len(), 0.0, out_dtype);
        pool.step_varlen(&step, out.view_mut())?;
        let mut state = vec![0.0; self.state.len()];
        let mut hist = vec![0.0; self.hist.len()];
        for i in 0..s_n {
            pool.read_slot(
                i,
                &mut state[i * sh.state_len()..(i + 1) * sh.state_len()],
                &mut hist[i * sh.hist_len()..(i + 1) * sh.hist_len()],
            )?;
        }
        Ok(StepOutput {
            shape: sh,
            config: self.layer.config,
            commits: seqs.iter().map(|s| s.commit).collect(),
            form: self.form.clone(),
            out,
            layout,
            state,
            hist,
            options: self.options,
        })
    }
}

/// A step's results, ready to be written as a file.
#[derive(Clone, Debug)]
pub struct StepOutput {
    pub shape: Shape,
    /// The conventions the step ran with, and each sequence's commit: written to the file's metadata.
    pub config: Config,
    pub commits: Vec<Commit>,
    pub form: Form,
    /// The backend's output buffer, in `layout`.
    pub out: TensorData,
    pub layout: OutputLayout,
    /// [S][d][h_v][d] in `options.layout`.
    pub state: Vec<f32>,
    pub hist: Vec<f32>,
    pub options: PoolOptions,
}

/// One tensor of an output file.
pub struct FileTensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub data: TensorData,
}

impl StepOutput {
    /// y, widened to f32.
    pub fn y(&self) -> Vec<f32> {
        let len = self
            .layout
            .rows
            .saturating_mul(self.layout.n)
            .min(self.out.len());
        let mut y = vec![0.0; len];
        self.out.view().widen_into(0, &mut y);
        y
    }

    /// Whether the public fields agree with each other (as `StepInput::run` makes them), so that the file's
    /// tensors can be cut from them.
    fn check(&self) -> Result<()> {
        let sh = self.shape;
        let seqs = match &self.form {
            Form::Uniform { b, t, .. } => b
                .checked_mul(*t)
                .filter(|&r| r == self.layout.rows)
                .map(|_| *b),
            Form::Varlen { cu_seqlens } => cu_seqlens
                .last()
                .filter(|&&end| end <= self.layout.rows)
                .map(|_| cu_seqlens.len() - 1),
        };
        let seqs = seqs.ok_or_else(|| bad("the output's form disagrees with its rows"))?;
        let agree = self.layout.n == sh.n()
            && self.out.len() == self.layout.len()
            && Some(self.state.len()) == seqs.checked_mul(sh.state_len())
            && Some(self.hist.len()) == seqs.checked_mul(sh.hist_len());
        if !agree {
            return Err(bad(
                "the output's buffers disagree with its shape and sequences",
            ));
        }
        Ok(())
    }

    /// The tensors of the output file: `y`, `state`, `hist`, and with planes `planes` ([B, 4, T, n] or
    /// [4, R, n]; plane 0 is y) and `group_sums` ([B, T, n / 16] or [R, n / 16]). An error where the public fields
    /// disagree (never for the output of `StepInput::run`).
    pub fn tensors(&self) -> Result<Vec<FileTensor>> {
        self.check()?;
        let sh = self.shape;
        let n = sh.n();
        let rows = self.layout.rows;
        let (lead, per_seq, uniform): (Vec<usize>, Vec<usize>, Option<(usize, usize)>) =
            match self.form {
                Form::Uniform { b, t, batched } => (
                    if batched { vec![b, t] } else { vec![t] },
                    if batched { vec![b] } else { vec![] },
                    Some((b, t)),
                ),
                Form::Varlen { ref cu_seqlens } => (vec![rows], vec![cu_seqlens.len() - 1], None),
            };
        let dims = |w: &[usize]| -> Vec<usize> { lead.iter().chain(w).copied().collect() };
        let seq = |w: &[usize]| -> Vec<usize> { per_seq.iter().chain(w).copied().collect() };
        let dt = self.out.dtype();
        let part = |at: usize, len: usize| {
            let mut v = vec![0.0; len];
            self.out.view().widen_into(at, &mut v);
            v
        };
        // the values are already rounded to `dt`: narrowing them again is exact
        let out_tensor = |name: &str, shape: Vec<usize>, v: &[f32]| FileTensor {
            name: name.into(),
            shape,
            data: TensorData::from_f32(v, dt),
        };
        let mut ts = vec![
            out_tensor("y", dims(&[n]), &self.y()),
            FileTensor {
                name: "state".into(),
                shape: seq(&[sh.d, sh.h_v, sh.d]),
                data: TensorData::from_f32(&self.state, self.options.state),
            },
            FileTensor {
                name: "hist".into(),
                shape: seq(&[sh.channels(), 3]),
                data: TensorData::F32(self.hist.clone()),
            },
        ];
        if let Some(ps) = self.layout.plane_stride {
            let mut planes = Vec::with_capacity(4 * rows * n);
            let shape = match uniform {
                Some((b, t)) => {
                    for s in 0..b {
                        for p in 0..4 {
                            planes.extend(part(p * ps + s * t * n, t * n));
                        }
                    }
                    seq(&[4, t, n])
                }
                None => {
                    for p in 0..4 {
                        planes.extend(part(p * ps, rows * n));
                    }
                    vec![4, rows, n]
                }
            };
            ts.push(out_tensor("planes", shape, &planes));
            ts.push(out_tensor(
                "group_sums",
                dims(&[n / 16]),
                &part(4 * ps, rows * n / 16),
            ));
        }
        Ok(ts)
    }

    /// Writes the output file atomically: a temporary file in the same folder, synced, then renamed into place;
    /// on any error nothing is left behind. The metadata records the conventions, the state layout and the
    /// commits used (one for all where they agree, else a comma-separated list).
    pub fn write(&self, path: &Path) -> Result<()> {
        let ts = self.tensors()?;
        let c = &self.config;
        let name = |k: &Commit| match k {
            Commit::Verify => "verify".to_string(),
            Commit::All => "all".to_string(),
            Commit::First(k) => k.to_string(),
        };
        let commit = if self.commits.windows(2).all(|w| w[0] == w[1]) {
            self.commits.first().map_or_else(|| "all".into(), name)
        } else {
            self.commits.iter().map(name).collect::<Vec<_>>().join(",")
        };
        let meta = [
            ("head_map", c.head_map.name().to_string()),
            ("gate", c.gate.name().to_string()),
            ("eps", format!("{:e}", c.eps)),
            ("state_layout", self.options.layout.name().to_string()),
            ("commit", commit),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        let buf = serialize(&ts, &[], Some(meta))?;
        let dir = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        let mut tmp = tempfile::NamedTempFile::new_in(dir)?;
        std::io::Write::write_all(&mut tmp, &buf)?;
        tmp.as_file().sync_all()?;
        tmp.persist(path).map_err(|e| Error::Io(e.error))?;
        Ok(())
    }
}

fn le_bytes(d: &TensorData) -> Vec<u8> {
    match d {
        TensorData::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        TensorData::Bf16(v) => v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect(),
        TensorData::F16(v) => v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect(),
    }
}

/// Serializes tensors, and integer tensors (written as I32: `cu_seqlens`, `commit`), with optional metadata.
fn serialize(
    tensors: &[FileTensor],
    ints: &[(&str, Vec<i64>)],
    metadata: Option<HashMap<String, String>>,
) -> Result<Vec<u8>> {
    let mut owned: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|t| {
            (
                t.name.clone(),
                file_dtype(t.data.dtype()),
                t.shape.clone(),
                le_bytes(&t.data),
            )
        })
        .collect();
    for (name, v) in ints {
        let bytes = v
            .iter()
            .map(|&x| i32::try_from(x).map(|x| x.to_le_bytes()))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|_| bad(format!("{name} does not fit I32")))?
            .concat();
        owned.push((name.to_string(), Dtype::I32, vec![v.len()], bytes));
    }
    let mut views = Vec::with_capacity(owned.len());
    for (name, dtype, shape, data) in &owned {
        let view = TensorView::new(*dtype, shape.clone(), data)
            .map_err(|e| bad(format!("tensor '{name}': {e}")))?;
        views.push((name.clone(), view));
    }
    safetensors::serialize(views, metadata).map_err(|e| bad(e.to_string()))
}

/// Writes an input file: the tensors given, the layer's parameters, and the integer tensors.
fn write_file(
    path: &Path,
    mut ts: Vec<FileTensor>,
    layer: &Layer,
    ints: &[(&str, Vec<i64>)],
    metadata: Option<HashMap<String, String>>,
) -> Result<()> {
    let sh = layer.shape();
    let p = &layer.params;
    for (name, shape, v) in [
        ("conv_w", vec![sh.channels(), 4], &p.conv_w),
        ("dt", vec![sh.h_v], &p.dt),
        ("a", vec![sh.h_v], &p.a),
        ("gamma", vec![sh.d], &p.gamma),
    ] {
        ts.push(FileTensor {
            name: name.into(),
            shape,
            data: TensorData::F32(v.clone()),
        });
    }
    std::fs::write(path, serialize(&ts, ints, metadata)?)?;
    Ok(())
}

/// Writes a uniform f32 window file (the input format), e.g. for tests and for dumping windows from an engine.
pub fn write_input(
    path: &Path,
    layer: &Layer,
    batch: &BatchData,
    state: Option<&[f32]>,
    hist: Option<&[f32]>,
    metadata: Option<HashMap<String, String>>,
) -> Result<()> {
    let sh = layer.shape();
    let (b, t) = (batch.b, batch.t);
    let f = |name: &str, shape: Vec<usize>, v: &[f32]| FileTensor {
        name: name.into(),
        shape,
        data: TensorData::F32(v.to_vec()),
    };
    let mut ts = vec![
        f("qkv", vec![b, t, sh.channels()], &batch.qkv),
        f("alpha", vec![b, t, sh.h_v], &batch.alpha),
        f("beta", vec![b, t, sh.h_v], &batch.beta),
        f("z", vec![b, t, sh.n()], &batch.z),
    ];
    if let Some(s) = state {
        ts.push(f("state", vec![b, sh.d, sh.h_v, sh.d], s));
    }
    if let Some(h) = hist {
        ts.push(f("hist", vec![b, sh.channels(), 3], h));
    }
    write_file(path, ts, layer, &[], metadata)
}

/// Writes a varlen window file: packed rows in their dtypes, `cu_seqlens` (I32), optionally per-sequence commits
/// (I32: 0 verify, k commit the first k), states (written in `state_dtype`, in the layout the metadata names) and
/// histories.
#[allow(clippy::too_many_arguments)]
pub fn write_varlen_input(
    path: &Path,
    layer: &Layer,
    rows: &RowsData,
    cu_seqlens: &[usize],
    commits: Option<&[Commit]>,
    state: Option<(&[f32], DType)>,
    hist: Option<&[f32]>,
    metadata: Option<HashMap<String, String>>,
) -> Result<()> {
    let sh = layer.shape();
    let r = rows.view().count(sh)?;
    let s_n = cu_seqlens.len().saturating_sub(1);
    let t = |name: &str, shape: Vec<usize>, data: &TensorData| FileTensor {
        name: name.into(),
        shape,
        data: data.clone(),
    };
    let mut ts = vec![
        t("qkv", vec![r, sh.channels()], &rows.qkv),
        t("alpha", vec![r, sh.h_v], &rows.alpha),
        t("beta", vec![r, sh.h_v], &rows.beta),
        t("z", vec![r, sh.n()], &rows.z),
    ];
    if let Some((s, dt)) = state {
        ts.push(FileTensor {
            name: "state".into(),
            shape: vec![s_n, sh.d, sh.h_v, sh.d],
            data: TensorData::from_f32(s, dt),
        });
    }
    if let Some(h) = hist {
        ts.push(FileTensor {
            name: "hist".into(),
            shape: vec![s_n, sh.channels(), 3],
            data: TensorData::F32(h.to_vec()),
        });
    }
    let mut ints = vec![(
        "cu_seqlens",
        cu_seqlens.iter().map(|&x| x as i64).collect::<Vec<_>>(),
    )];
    if let Some(c) = commits {
        let lens: Vec<usize> = cu_seqlens.windows(2).map(|w| w[1] - w[0]).collect();
        ints.push((
            "commit",
            c.iter()
                .zip(&lens)
                .map(|(k, &len)| match k {
                    Commit::Verify => 0,
                    Commit::All => len as i64,
                    Commit::First(k) => *k as i64,
                })
                .collect(),
        ));
    }
    write_file(path, ts, layer, &ints, metadata)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth::Synth;

    fn ser(ts: &[(&str, Vec<usize>, Vec<f32>)], meta: Option<HashMap<String, String>>) -> Vec<u8> {
        let ft: Vec<FileTensor> = ts
            .iter()
            .map(|(n, s, v)| FileTensor {
                name: n.to_string(),
                shape: s.clone(),
                data: TensorData::F32(v.clone()),
            })
            .collect();
        serialize(&ft, &[], meta).unwrap()
    }

    fn layer() -> Layer {
        Synth::new(3)
            .layer(Config::new(Shape::new(16, 1, 2).unwrap()))
            .unwrap()
    }

    /// A window file's bytes with the given tensors replacing or dropping the defaults.
    fn file(
        layer: &Layer,
        b: Option<usize>,
        t: usize,
        edit: impl FnOnce(&mut Vec<(&str, Vec<usize>, Vec<f32>)>),
    ) -> Vec<u8> {
        let sh = layer.shape();
        let batch = Synth::new(4).batch(layer, b.unwrap_or(1), t);
        let lead = |w: &[usize]| -> Vec<usize> {
            b.map_or(vec![t], |b| vec![b, t])
                .into_iter()
                .chain(w.iter().copied())
                .collect()
        };
        let p = &layer.params;
        let mut ts = vec![
            ("qkv", lead(&[sh.channels()]), batch.qkv.clone()),
            ("alpha", lead(&[sh.h_v]), batch.alpha.clone()),
            ("beta", lead(&[sh.h_v]), batch.beta.clone()),
            ("z", lead(&[sh.n()]), batch.z.clone()),
            ("conv_w", vec![sh.channels(), 4], p.conv_w.clone()),
            ("dt", vec![sh.h_v], p.dt.clone()),
            ("a", vec![sh.h_v], p.a.clone()),
            ("gamma", vec![sh.d], p.gamma.clone()),
        ];
        edit(&mut ts);
        ser(&ts, None)
    }

    #[test]
    fn an_unbatched_file_without_state_reads_as_one_sequence_from_zeros() {
        let l = layer();
        let inp = StepInput::parse(&file(&l, None, 3, |_| {}), Overrides::default()).unwrap();
        assert_eq!(
            inp.form,
            Form::Uniform {
                b: 1,
                t: 3,
                batched: false
            }
        );
        assert!(inp.state.iter().all(|&x| x == 0.0) && inp.state.len() == l.shape().state_len());
        assert!(inp.hist.iter().all(|&x| x == 0.0) && inp.hist.len() == l.shape().hist_len());
        assert_eq!(
            inp.layer.config,
            Config::new(*l.shape()),
            "seed defaults: tiled, sigmoid, 1e-6"
        );
    }

    #[test]
    fn wrong_shapes_and_dtypes_are_named() {
        let l = layer();
        type Edit = Box<dyn Fn(&mut Vec<(&str, Vec<usize>, Vec<f32>)>)>;
        let cases: Vec<(&str, Edit)> = vec![
            (
                "'z'",
                Box::new(|ts| ts[3] = ("z", vec![2, 3, 31], vec![0.0; 2 * 3 * 31])),
            ),
            (
                "'alpha'",
                Box::new(|ts| ts[1] = ("alpha", vec![2, 3, 3], vec![0.0; 18])),
            ),
            (
                "'state'",
                Box::new(|ts| ts.push(("state", vec![2, 16, 2, 15], vec![0.0; 2 * 16 * 2 * 15]))),
            ),
            (
                "'hist'",
                Box::new(|ts| ts.push(("hist", vec![1, 64, 3], vec![0.0; 192]))),
            ),
            (
                "'gamma' is missing",
                Box::new(|ts| ts.retain(|t| t.0 != "gamma")),
            ),
            (
                "channels",
                Box::new(|ts| ts[4] = ("conv_w", vec![65, 4], vec![0.0; 260])),
            ),
        ];
        for (needle, edit) in cases {
            let err =
                StepInput::parse(&file(&l, Some(2), 3, edit), Overrides::default()).unwrap_err();
            assert!(err.to_string().contains(needle), "{needle}: {err}");
        }
        let err = StepInput::parse(b"\x08\x00\x00\x00\x00\x00\x00\x00{}", Overrides::default());
        assert!(err.is_err());
    }

    #[test]
    fn metadata_sets_conventions_and_flags_override_it() {
        let l = layer();
        let mut bytes = file(&l, Some(1), 2, |_| {});
        // rewrite with metadata
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let names: Vec<String> = st.names().into_iter().map(|s| s.to_string()).collect();
        let data: Vec<(String, Vec<usize>, Vec<f32>)> = names
            .iter()
            .map(|n| {
                let v = st.tensor(n).unwrap();
                let f = v
                    .data()
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                    .collect();
                (n.clone(), v.shape().to_vec(), f)
            })
            .collect();
        let meta = [("head_map", "grouped"), ("gate", "silu"), ("eps", "1e-5")]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let data: Vec<(&str, Vec<usize>, Vec<f32>)> = data
            .iter()
            .map(|(n, s, v)| (n.as_str(), s.clone(), v.clone()))
            .collect();
        bytes = ser(&data, Some(meta));
        let c = StepInput::parse(&bytes, Overrides::default())
            .unwrap()
            .layer
            .config;
        assert_eq!(
            (c.head_map, c.gate, c.eps),
            (HeadMap::Grouped, Gate::Silu, 1e-5)
        );
        let o = Overrides {
            head_map: Some(HeadMap::Tiled),
            gate: Some(Gate::Sigmoid),
            eps: Some(2e-6),
            state_layout: None,
        };
        let c = StepInput::parse(&bytes, o).unwrap().layer.config;
        assert_eq!(
            (c.head_map, c.gate, c.eps),
            (HeadMap::Tiled, Gate::Sigmoid, 2e-6)
        );
    }

    /// A varlen file of empty sequences is an error at parse, before any zero state is made for them (seen while
    /// fuzzing: parse took them, only the run refused them; 10^5 of them at d 1024, a 450 KB file, would ask for
    /// 400 GB of zero state).
    #[test]
    fn empty_sequences_are_refused_before_their_states_are_made() {
        let l = Synth::new(3)
            .layer(Config::new(Shape::new(1024, 1, 1).unwrap()))
            .unwrap();
        let rows = RowsData::from_f32(&[], &[], &[], &[], [DType::F32; 4]);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("empty.safetensors");
        write_varlen_input(&path, &l, &rows, &vec![0; 100_001], None, None, None, None).unwrap();
        let err = StepInput::read(&path, Overrides::default()).unwrap_err();
        assert!(matches!(err, Error::EmptySeq { seq: 0 }), "{err}");
    }

    /// `tensors` (and so `write`) refuses an output whose public fields disagree instead of cutting by them.
    #[test]
    fn tensors_refuse_fields_that_disagree() {
        let l = layer();
        let inp = StepInput::parse(&file(&l, Some(2), 3, |_| {}), Overrides::default()).unwrap();
        let out = inp
            .run(&crate::Cpu::new(), Commit::All, true, None)
            .unwrap();
        assert!(out.tensors().is_ok());
        let mut empty = out.clone();
        empty.form = Form::Varlen { cu_seqlens: vec![] };
        let mut short = out.clone();
        short.state.pop();
        let mut rows = out.clone();
        rows.layout.rows += 1;
        for bad in [empty, short, rows] {
            assert!(bad.tensors().is_err());
            let _ = bad.y();
        }
    }

    /// `run` checks the public fields `parse` fills rather than slicing by them.
    #[test]
    fn run_refuses_fields_that_disagree() {
        let l = layer();
        let inp = StepInput::parse(&file(&l, Some(2), 3, |_| {}), Overrides::default()).unwrap();
        let cpu = crate::Cpu::new();
        assert!(inp.run(&cpu, Commit::All, false, None).is_ok());
        let mut short = inp.clone();
        short.state.pop();
        let mut commits = inp.clone();
        commits.commits = Some(vec![Commit::All]);
        for bad in [short, commits] {
            let err = bad.run(&cpu, Commit::All, false, None).unwrap_err();
            assert!(matches!(err, Error::Length { .. }), "{err}");
        }
    }
}
