//! The `gdn step` file format (SPEC.md, "The `gdn step` file format"): safetensors files, f32, row-major, an
//! optional leading batch dimension.

use std::collections::HashMap;
use std::path::Path;

use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

use crate::{
    Backend, BatchData, Commit, Config, Error, Gate, HeadMap, Layer, OutputLayout, Params, Result,
    Shape,
};

/// A window file as read: the layer, the windows, and each sequence's starting state.
#[derive(Clone, Debug)]
pub struct StepInput {
    pub layer: Layer,
    pub batch: BatchData,
    /// [b][d][h_v][d]; zeros when the file has none.
    pub state: Vec<f32>,
    /// [b][C][3]; zeros when the file has none.
    pub hist: Vec<f32>,
    /// Whether the file's tensors carry the batch dimension (the output then carries it too).
    pub batched: bool,
    /// The file's `__metadata__`.
    pub metadata: HashMap<String, String>,
}

/// Conventions given on the command line; each overrides the file's `__metadata__`, which overrides the
/// seed's defaults (tiled, sigmoid, 1e-6).
#[derive(Clone, Copy, Debug, Default)]
pub struct Overrides {
    pub head_map: Option<HeadMap>,
    pub gate: Option<Gate>,
    pub eps: Option<f32>,
}

fn bad(msg: impl Into<String>) -> Error {
    Error::File(msg.into())
}

struct Tensors<'a> {
    st: SafeTensors<'a>,
}

impl Tensors<'_> {
    fn get(&self, name: &str) -> Result<Option<(Vec<usize>, Vec<f32>)>> {
        let view = match self.st.tensor(name) {
            Ok(v) => v,
            Err(safetensors::SafeTensorError::TensorNotFound(_)) => return Ok(None),
            Err(e) => return Err(bad(format!("tensor '{name}': {e}"))),
        };
        if view.dtype() != Dtype::F32 {
            return Err(bad(format!(
                "tensor '{name}' is {:?}, expected F32",
                view.dtype()
            )));
        }
        let data = view
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        Ok(Some((view.shape().to_vec(), data)))
    }

    fn need(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>)> {
        self.get(name)?
            .ok_or_else(|| bad(format!("tensor '{name}' is missing")))
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

impl StepInput {
    /// Reads and checks a window file.
    pub fn read(path: &Path, overrides: Overrides) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|e| bad(format!("{}: {e}", path.display())))?;
        Self::parse(&bytes, overrides)
    }

    /// Parses and checks a window file's bytes.
    pub fn parse(bytes: &[u8], overrides: Overrides) -> Result<Self> {
        let (_, meta) = SafeTensors::read_metadata(bytes).map_err(|e| bad(e.to_string()))?;
        let metadata = meta.metadata().clone().unwrap_or_default();
        let st = SafeTensors::deserialize(bytes).map_err(|e| bad(e.to_string()))?;
        let ts = Tensors { st };

        let (gs, gamma) = ts.need("gamma")?;
        let (ds, dt) = ts.need("dt")?;
        let (cs, conv_w) = ts.need("conv_w")?;
        let (as_, a) = ts.need("a")?;
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
            [c, 4] => c,
            _ => {
                return Err(bad(format!(
                    "tensor 'conv_w' has shape {cs:?}, expected [C, 4]"
                )))
            }
        };
        expect_shape("a", &as_, &[h_v])?;
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

        let (qs, qkv) = ts.need("qkv")?;
        let (batched, b, t) = match qs[..] {
            [b, t, cc] if cc == c => (true, b, t),
            [t, cc] if cc == c => (false, 1, t),
            _ => {
                return Err(bad(format!(
                    "tensor 'qkv' has shape {qs:?}, expected [B, T, {c}] or [T, {c}]"
                )))
            }
        };
        if t == 0 {
            return Err(Error::EmptyWindow);
        }
        let dims = |w: &[usize]| -> Vec<usize> {
            let mut v = if batched { vec![b, t] } else { vec![t] };
            v.extend_from_slice(w);
            v
        };
        let seq = |w: &[usize]| -> Vec<usize> {
            let mut v = if batched { vec![b] } else { vec![] };
            v.extend_from_slice(w);
            v
        };
        let (al_s, alpha) = ts.need("alpha")?;
        expect_shape("alpha", &al_s, &dims(&[h_v]))?;
        let (be_s, beta) = ts.need("beta")?;
        expect_shape("beta", &be_s, &dims(&[h_v]))?;
        let (z_s, z) = ts.need("z")?;
        expect_shape("z", &z_s, &dims(&[shape.n()]))?;
        let state = match ts.get("state")? {
            Some((s, v)) => {
                expect_shape("state", &s, &seq(&[d, h_v, d]))?;
                v
            }
            None => vec![0.0; b * shape.state_len()],
        };
        let hist = match ts.get("hist")? {
            Some((s, v)) => {
                expect_shape("hist", &s, &seq(&[c, 3]))?;
                v
            }
            None => vec![0.0; b * shape.hist_len()],
        };
        Ok(StepInput {
            layer,
            batch: BatchData {
                b,
                t,
                qkv,
                alpha,
                beta,
                z,
            },
            state,
            hist,
            batched,
            metadata,
        })
    }

    /// Runs the file's windows on a backend: one pool slot per sequence, loaded with the file's states.
    pub fn run(&self, backend: &dyn Backend, commit: Commit, planes: bool) -> Result<StepOutput> {
        let sh = *self.layer.shape();
        let (b, t) = (self.batch.b, self.batch.t);
        commit.commit_at(t)?;
        let mut pool = backend.create_pool(&self.layer, b)?;
        for i in 0..b {
            pool.write_slot(
                i,
                &self.state[i * sh.state_len()..(i + 1) * sh.state_len()],
                &self.hist[i * sh.hist_len()..(i + 1) * sh.hist_len()],
            )?;
        }
        let layout = OutputLayout::new(&sh, b, t, planes.then_some(b * t * sh.n()))?;
        let mut out = vec![0.0; layout.len()];
        let slots: Vec<i32> = (0..b as i32).collect();
        pool.step(
            &crate::StepArgs {
                batch: self.batch.view(),
                slots: &slots,
                commit,
                plane_stride: layout.plane_stride,
            },
            &mut out,
        )?;
        let mut state = vec![0.0; b * sh.state_len()];
        let mut hist = vec![0.0; b * sh.hist_len()];
        for i in 0..b {
            pool.read_slot(
                i,
                &mut state[i * sh.state_len()..(i + 1) * sh.state_len()],
                &mut hist[i * sh.hist_len()..(i + 1) * sh.hist_len()],
            )?;
        }
        Ok(StepOutput {
            shape: sh,
            b,
            t,
            batched: self.batched,
            out,
            layout,
            state,
            hist,
        })
    }
}

/// A step's results, ready to be written as a file.
#[derive(Clone, Debug)]
pub struct StepOutput {
    pub shape: Shape,
    pub b: usize,
    pub t: usize,
    pub batched: bool,
    /// The backend's output buffer, in `layout`.
    pub out: Vec<f32>,
    pub layout: OutputLayout,
    pub state: Vec<f32>,
    pub hist: Vec<f32>,
}

fn le_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

impl StepOutput {
    pub fn y(&self) -> &[f32] {
        &self.out[..self.layout.rows * self.layout.n]
    }

    /// The tensors of the output file: `y`, `state`, `hist`, and with planes `planes` [B, 4, T, n] (plane 0 is y)
    /// and `group_sums` [B, T, n / 16].
    pub fn tensors(&self) -> Vec<(String, Vec<usize>, Vec<f32>)> {
        let (b, t, sh) = (self.b, self.t, self.shape);
        let n = sh.n();
        let lead = |w: &[usize]| -> Vec<usize> {
            let mut v = if self.batched { vec![b] } else { vec![] };
            v.extend_from_slice(w);
            v
        };
        let mut ts = vec![
            ("y".to_string(), lead(&[t, n]), self.y().to_vec()),
            (
                "state".to_string(),
                lead(&[sh.d, sh.h_v, sh.d]),
                self.state.clone(),
            ),
            (
                "hist".to_string(),
                lead(&[sh.channels(), 3]),
                self.hist.clone(),
            ),
        ];
        if let Some(ps) = self.layout.plane_stride {
            let mut planes = Vec::with_capacity(b * 4 * t * n);
            for s in 0..b {
                for p in 0..4 {
                    planes
                        .extend_from_slice(&self.out[p * ps + s * t * n..p * ps + (s + 1) * t * n]);
                }
            }
            ts.push(("planes".to_string(), lead(&[4, t, n]), planes));
            let sums = &self.out[4 * ps..4 * ps + b * t * n / 16];
            ts.push(("group_sums".to_string(), lead(&[t, n / 16]), sums.to_vec()));
        }
        ts
    }

    /// Writes the output file atomically: a temporary file beside it, renamed into place once complete.
    pub fn write(&self, path: &Path) -> Result<()> {
        let ts = self.tensors();
        let bytes: Vec<Vec<u8>> = ts.iter().map(|(_, _, v)| le_bytes(v)).collect();
        let mut views = Vec::with_capacity(ts.len());
        for ((name, shape, _), data) in ts.iter().zip(&bytes) {
            let view =
                TensorView::new(Dtype::F32, shape.clone(), data).map_err(|e| bad(e.to_string()))?;
            views.push((name.clone(), view));
        }
        let buf = safetensors::serialize(views, None).map_err(|e| bad(e.to_string()))?;
        let tmp = path.with_extension("partial");
        std::fs::write(&tmp, buf)?;
        std::fs::rename(&tmp, path).inspect_err(|_| {
            let _ = std::fs::remove_file(&tmp);
        })?;
        Ok(())
    }
}

/// Writes a window file (the input format), e.g. for tests and for dumping windows from an engine.
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
    let p = &layer.params;
    let mut ts: Vec<(&str, Vec<usize>, &[f32])> = vec![
        ("qkv", vec![b, t, sh.channels()], &batch.qkv),
        ("alpha", vec![b, t, sh.h_v], &batch.alpha),
        ("beta", vec![b, t, sh.h_v], &batch.beta),
        ("z", vec![b, t, sh.n()], &batch.z),
        ("conv_w", vec![sh.channels(), 4], &p.conv_w),
        ("dt", vec![sh.h_v], &p.dt),
        ("a", vec![sh.h_v], &p.a),
        ("gamma", vec![sh.d], &p.gamma),
    ];
    if let Some(s) = state {
        ts.push(("state", vec![b, sh.d, sh.h_v, sh.d], s));
    }
    if let Some(h) = hist {
        ts.push(("hist", vec![b, sh.channels(), 3], h));
    }
    let bytes: Vec<Vec<u8>> = ts.iter().map(|(_, _, v)| le_bytes(v)).collect();
    let mut views = Vec::new();
    for ((name, shape, _), data) in ts.iter().zip(&bytes) {
        views.push((
            name.to_string(),
            TensorView::new(Dtype::F32, shape.clone(), data).map_err(|e| bad(e.to_string()))?,
        ));
    }
    safetensors::serialize_to_file(views, metadata, path).map_err(|e| bad(e.to_string()))
}
