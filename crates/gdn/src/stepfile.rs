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
        let bytes = std::fs::read(path).map_err(|source| Error::Read {
            path: path.display().to_string(),
            source,
        })?;
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
            config: self.layer.config,
            commit,
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
    /// The conventions the step ran with, and its commit mode: written to the file's metadata.
    pub config: Config,
    pub commit: Commit,
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

    /// Writes the output file atomically: a temporary file in the same folder, synced, then renamed into place;
    /// on any error nothing is left behind. The metadata records the conventions and the commit mode used.
    pub fn write(&self, path: &Path) -> Result<()> {
        let ts = self.tensors();
        let c = &self.config;
        let commit = match self.commit {
            Commit::Verify => "verify".to_string(),
            Commit::All => "all".to_string(),
            Commit::First(k) => k.to_string(),
        };
        let meta = [
            ("head_map", c.head_map.name().to_string()),
            ("gate", c.gate.name().to_string()),
            ("eps", format!("{:e}", c.eps)),
            ("commit", commit),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        let buf = serialize(
            ts.iter()
                .map(|(n, s, v)| (n.as_str(), s.clone(), v.as_slice())),
            Some(meta),
        )?;
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

/// Serializes f32 tensors (name, shape, data) with optional metadata.
fn serialize<'a>(
    tensors: impl Iterator<Item = (&'a str, Vec<usize>, &'a [f32])>,
    metadata: Option<HashMap<String, String>>,
) -> Result<Vec<u8>> {
    let owned: Vec<(&str, Vec<usize>, Vec<u8>)> =
        tensors.map(|(n, s, v)| (n, s, le_bytes(v))).collect();
    let mut views = Vec::with_capacity(owned.len());
    for (name, shape, data) in &owned {
        let view =
            TensorView::new(Dtype::F32, shape.clone(), data).map_err(|e| bad(e.to_string()))?;
        views.push((name.to_string(), view));
    }
    safetensors::serialize(views, metadata).map_err(|e| bad(e.to_string()))
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
    let buf = serialize(ts.into_iter(), metadata)?;
    std::fs::write(path, buf)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth::Synth;

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
        serialize(
            ts.iter().map(|(n, s, v)| (*n, s.clone(), v.as_slice())),
            None,
        )
        .unwrap()
    }

    #[test]
    fn an_unbatched_file_without_state_reads_as_one_sequence_from_zeros() {
        let l = layer();
        let inp = StepInput::parse(&file(&l, None, 3, |_| {}), Overrides::default()).unwrap();
        assert!(!inp.batched);
        assert_eq!((inp.batch.b, inp.batch.t), (1, 3));
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
        bytes = serialize(
            data.iter()
                .map(|(n, s, v)| (n.as_str(), s.clone(), v.as_slice())),
            Some(meta),
        )
        .unwrap();
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
        };
        let c = StepInput::parse(&bytes, o).unwrap().layer.config;
        assert_eq!(
            (c.head_map, c.gate, c.eps),
            (HeadMap::Tiled, Gate::Sigmoid, 2e-6)
        );
    }
}
