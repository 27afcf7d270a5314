//! `gdn._native`: the Python binding of gdn (PyO3, abi3). The package `gdn` (python/gdn/) re-exports it.
//!
//! Every argument of a step is checked here, in Rust, before anything is read or written: its type, element type,
//! device, shape, strides (a tensor gdn would have to copy is an error: no silent copies), alignment, and that the
//! tensors the step writes share no memory with any other argument. A failed check raises a `TypeError` (a wrong
//! type or dtype) or `ValueError` (anything else) whose message starts with the argument's name.

use std::sync::Mutex;

use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

mod cpu;
#[cfg(feature = "cuda")]
mod cuda;
mod tensor;

use gdn::{Commit, Config, Gate, HeadMap, Params, Seq, Shape, StateLayout};
use tensor::{expect_disjoint, Device, Elem, View};

const FLOATS: [Elem; 3] = [Elem::F32, Elem::Bf16, Elem::F16];
const FLOATS_DOC: &str = "float32, bfloat16 or float16";

fn value_err(e: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(e.to_string())
}

/// One Gated DeltaNet layer's weights and conventions (copied once, to f32), for `gdn.step`.
///
/// Args:
///     conv_weight: the short conv's weight, ``[C, 1, 4]`` (HF's ``conv1d.weight``) or ``[C, 4]``, with
///         ``C = (2 * num_k_heads + num_v_heads) * head_dim`` (q | k | v channels); tap 0 on the oldest input.
///     dt_bias: ``[num_v_heads]``.
///     A_log: ``[num_v_heads]``; the decay rate is ``-exp(A_log)`` in f32, as HF computes it.
///     norm_weight: ``[head_dim]``, the gated RMS norm's weight shared by the heads.
///     num_k_heads, num_v_heads, head_dim: the layer's shape (head_dim a multiple of 16, at most 1024;
///         num_v_heads a multiple of num_k_heads).
///     head_map: which q/k head a value head reads: ``"grouped"`` (HF's ``repeat_interleave``, FLA, vLLM,
///         SGLang: ``h // (h_v // h_k)``) or ``"tiled"`` (``h % h_k``).
///     gate: the output gate, ``"silu"`` (Qwen3.5, Qwen3-Next) or ``"sigmoid"``.
///     eps: the RMS norm's epsilon.
///
/// Each tensor may be a torch tensor (any dtype, any device) or a numpy array (or anything numpy turns into one).
#[pyclass(module = "gdn", name = "Layer", frozen)]
pub struct Layer {
    inner: gdn::Layer,
    /// The CPU path's scratch pool (see `cpu`), kept between steps.
    cpu: Mutex<Option<gdn::cpu::CpuPool>>,
    /// Where this layer's heads sit in the layer it is a shard of (None: not a shard).
    shard: Option<gdn::ShardMap>,
    /// The CUDA path's layers, one per device.
    #[cfg(feature = "cuda")]
    cuda: cuda::Layers,
}

impl Layer {
    fn wrap(inner: gdn::Layer) -> Self {
        Layer {
            inner,
            cpu: Mutex::new(None),
            shard: None,
            #[cfg(feature = "cuda")]
            cuda: cuda::Layers::default(),
        }
    }
}

/// `x` as a packed f32 numpy array (torch tensors are moved to the host and widened first): the one copy a layer's
/// weights take.
fn f32_array<'py>(
    py: Python<'py>,
    name: &'static str,
    x: &Bound<'py, PyAny>,
) -> PyResult<(Vec<usize>, Vec<f32>)> {
    let arr = py
        .import("gdn._convert")?
        .call_method1("f32_array", (x, name))?;
    let v = View::of(name, &arr)?;
    let len = v.shape().iter().product::<usize>();
    // SAFETY: `f32_array` returns a C-contiguous f32 numpy array of `len` elements, alive while `arr` is
    let data = if len == 0 {
        Vec::new()
    } else {
        unsafe { std::slice::from_raw_parts(v.ptr as *const f32, len) }.to_vec()
    };
    Ok((v.shape().to_vec(), data))
}

#[pymethods]
impl Layer {
    #[new]
    #[pyo3(signature = (conv_weight, dt_bias, A_log, norm_weight, *, num_k_heads, num_v_heads, head_dim,
                        head_map = "grouped", gate = "silu", eps = 1e-6))]
    #[allow(non_snake_case, clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        conv_weight: &Bound<'_, PyAny>,
        dt_bias: &Bound<'_, PyAny>,
        A_log: &Bound<'_, PyAny>,
        norm_weight: &Bound<'_, PyAny>,
        num_k_heads: usize,
        num_v_heads: usize,
        head_dim: usize,
        head_map: &str,
        gate: &str,
        eps: f64,
    ) -> PyResult<Self> {
        let shape = Shape::new(head_dim, num_k_heads, num_v_heads).map_err(value_err)?;
        let mut config = Config::new(shape);
        config.head_map = head_map.parse::<HeadMap>().map_err(value_err)?;
        config.gate = gate.parse::<Gate>().map_err(value_err)?;
        config.eps = eps as f32;
        let c = shape.channels();
        let (ws, w) = f32_array(py, "conv_weight", conv_weight)?;
        if !(ws == [c, 1, 4] || ws == [c, 4]) {
            return Err(PyValueError::new_err(format!(
                "conv_weight must have shape [C, 1, 4] or [C, 4] with C = (2 * {num_k_heads} + {num_v_heads}) * \
                 {head_dim} = {c}, got {ws:?}"
            )));
        }
        let mut vecs = Vec::new();
        for (name, x, len, doc) in [
            ("dt_bias", dt_bias, num_v_heads, "num_v_heads"),
            ("A_log", A_log, num_v_heads, "num_v_heads"),
            ("norm_weight", norm_weight, head_dim, "head_dim"),
        ] {
            let (s, v) = f32_array(py, name, x)?;
            if s != [len] {
                return Err(PyValueError::new_err(format!(
                    "{name} must have shape [{doc}] = [{len}], got {s:?}"
                )));
            }
            vecs.push(v);
        }
        let params = Params::from_checkpoint(&w, &vecs[0], &vecs[1], &vecs[2]);
        let layer = gdn::Layer::new(config, params).map_err(value_err)?;
        Ok(Layer::wrap(layer))
    }

    /// The layer of a Hugging Face ``Qwen3_5GatedDeltaNet`` or ``Qwen3NextGatedDeltaNet`` module (its
    /// ``conv1d.weight``, ``dt_bias``, ``A_log``, ``norm.weight``, head counts, head dim and the norm's epsilon;
    /// HF's head map is ``"grouped"`` and its gate ``"silu"``).
    #[classmethod]
    fn from_hf<'py>(
        cls: &Bound<'py, pyo3::types::PyType>,
        module: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = cls.py();
        let (args, kwargs): (Bound<'py, PyTuple>, Bound<'py, PyDict>) = py
            .import("gdn._convert")?
            .call_method1("hf_layer_args", (module,))?
            .extract()?;
        cls.call(args, Some(&kwargs))
    }

    /// The tensor-parallel shard ``rank`` of ``world``: the layer restricted to its heads (see the core's
    /// ``Layer::shard``).
    ///
    /// ``world`` must divide ``num_k_heads``. Grouped map: key heads ``rank * h_k/world ..`` and value heads
    /// ``rank * h_v/world ..`` (contiguous, as engines split the projections); tiled map: the value heads
    /// ``g + h_k * m`` that read the shard's key heads ``g``. ``shard_map`` on the result says which global
    /// heads, qkv channels and output columns the shard's are: feed the shard ``qkv[:, m["channels"]]``,
    /// ``a[:, m["value_heads"]]``, ``b[:, m["value_heads"]]``, ``z[:, m["columns"]]``, a state pool of its value
    /// heads and a conv state of its channels; its output is ``out[:, m["columns"]]``.
    fn shard(&self, rank: usize, world: usize) -> PyResult<Layer> {
        let (inner, map) = self.inner.shard(rank, world).map_err(value_err)?;
        let mut l = Layer::wrap(inner);
        l.shard = Some(map);
        Ok(l)
    }

    /// For a shard (``Layer.shard``): a dict of lists, ``key_heads`` and ``value_heads`` (the global head of
    /// each of the shard's), ``channels`` (the global qkv / conv channel of each of the shard's, in its
    /// q | k | v order) and ``columns`` (the global column of z and of the output of each of the shard's);
    /// None for a layer that is no shard.
    #[getter]
    fn shard_map<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(m) = &self.shard else {
            return Ok(None);
        };
        let d = PyDict::new(py);
        d.set_item("key_heads", m.key_heads.clone())?;
        d.set_item("value_heads", m.value_heads.clone())?;
        d.set_item("channels", m.channels())?;
        d.set_item("columns", m.columns())?;
        Ok(Some(d))
    }

    /// Waits for every device this layer ran on and raises a ValueError if a CUDA step skipped sequences for
    /// bad index values (a slot past the pool, rows outside the step's, a commit past a length) that
    /// ``validate=False`` let through; clears the report. A no-op for the CPU (its checks always run).
    fn check_faults(&self, py: Python<'_>) -> PyResult<()> {
        let _ = py;
        #[cfg(feature = "cuda")]
        self.cuda.take_faults()?;
        Ok(())
    }

    #[getter]
    fn num_k_heads(&self) -> usize {
        self.inner.shape().h_k
    }
    #[getter]
    fn num_v_heads(&self) -> usize {
        self.inner.shape().h_v
    }
    #[getter]
    fn head_dim(&self) -> usize {
        self.inner.shape().d
    }
    /// Conv channels ``C = (2 * num_k_heads + num_v_heads) * head_dim``, the width of ``qkv``.
    #[getter]
    fn channels(&self) -> usize {
        self.inner.shape().channels()
    }
    #[getter]
    fn head_map(&self) -> &'static str {
        self.inner.config.head_map.name()
    }
    #[getter]
    fn gate(&self) -> &'static str {
        self.inner.config.gate.name()
    }
    #[getter]
    fn eps(&self) -> f32 {
        self.inner.config.eps
    }

    fn __repr__(&self) -> String {
        let s = self.inner.shape();
        format!(
            "gdn.Layer(num_k_heads={}, num_v_heads={}, head_dim={}, head_map='{}', gate='{}', eps={:e})",
            s.h_k,
            s.h_v,
            s.d,
            self.head_map(),
            self.gate(),
            self.inner.config.eps
        )
    }
}

/// An int32 index tensor's values, read on the host (CPU tensors only).
fn host_ints(v: &View<'_>) -> Vec<i32> {
    let len = v.shape[0];
    if len == 0 {
        return Vec::new();
    }
    // SAFETY: a checked 1-D contiguous aligned int32 host tensor of `len` elements, alive for the call
    unsafe { std::slice::from_raw_parts(v.ptr as *const i32, len) }.to_vec()
}

/// The sequences of a step from the index values, each bad value a ValueError naming its argument.
fn host_seqs(
    slots: &[i32],
    cu: Option<&[i32]>,
    lengths: Option<&[i32]>,
    commit: Option<&[i32]>,
    allow_empty: bool,
) -> PyResult<Vec<Seq>> {
    let min = if allow_empty { 0 } else { 1 };
    let n = slots.len();
    let mut seqs = Vec::with_capacity(n);
    let mut start = 0usize;
    for s in 0..n {
        let (st, len) = match (cu, lengths) {
            (Some(cu), _) => {
                let (a, b) = (cu[s], cu[s + 1]);
                if a < 0 || i64::from(b) - i64::from(a) < i64::from(min) {
                    return Err(PyValueError::new_err(format!(
                        "cu_seqlens must increase {}from a value >= 0: cu_seqlens[{s}] = {a}, cu_seqlens[{}] = {b}",
                        if allow_empty { "" } else { "strictly " },
                        s + 1
                    )));
                }
                (a as usize, (b - a) as usize)
            }
            (None, Some(l)) => {
                if l[s] < min {
                    return Err(PyValueError::new_err(format!(
                        "lengths[{s}] = {} must be at least {min}",
                        l[s]
                    )));
                }
                (start, l[s] as usize)
            }
            (None, None) => (s, 1),
        };
        start = st + len;
        let c = match commit {
            None => Commit::All,
            Some(k) => match k[s] {
                0 => Commit::Verify,
                k if k >= 1 && k as usize <= len => Commit::First(k as usize),
                k => {
                    return Err(PyValueError::new_err(format!(
                        "commit[{s}] = {k} is outside 0..={len} (0 verifies; k commits after k of its {len} tokens)"
                    )))
                }
            },
        };
        seqs.push(Seq {
            slot: slots[s],
            start: st,
            len,
            commit: c,
        });
    }
    Ok(seqs)
}

/// A core check's error as the Python exception naming the argument it is about.
fn step_err(e: gdn::Error, rows_arg: &str) -> PyErr {
    use gdn::Error as E;
    match &e {
        E::SlotRange { .. } | E::SlotTwice(_) => PyValueError::new_err(format!("slots: {e}")),
        E::SeqRows { .. } | E::SeqOverlap { .. } | E::EmptySeq { .. } => {
            PyValueError::new_err(format!("{rows_arg}: {e}"))
        }
        E::SeqCommit { .. } => PyValueError::new_err(format!("commit: {e}")),
        E::Length { .. } | E::Param { .. } | E::Shape(_) => value_err(e),
        _ => PyRuntimeError::new_err(e.to_string()),
    }
}

#[allow(clippy::too_many_arguments)]
fn step_impl<'py>(
    py: Python<'py>,
    layer: &Bound<'py, Layer>,
    qkv: &Bound<'py, PyAny>,
    a: &Bound<'py, PyAny>,
    b: &Bound<'py, PyAny>,
    z: &Bound<'py, PyAny>,
    state: &Bound<'py, PyAny>,
    conv_state: &Bound<'py, PyAny>,
    slots: &Bound<'py, PyAny>,
    cu_seqlens: Option<&Bound<'py, PyAny>>,
    lengths: Option<&Bound<'py, PyAny>>,
    commit: Option<&Bound<'py, PyAny>>,
    out: Option<&Bound<'py, PyAny>>,
    state_layout: &str,
    validate: bool,
    dry: bool,
    spec: Option<SpecObjs<'_, 'py>>,
    max_seqlen: Option<usize>,
) -> PyResult<Bound<'py, PyAny>> {
    let lay = layer.get();
    let sh = *lay.inner.shape();
    let (c, hv, d, n) = (sh.channels(), sh.h_v, sh.d, sh.n());
    let layout = match state_layout {
        "value_major" | "value-major" => StateLayout::ValueMajor,
        "key_major" | "key-major" => StateLayout::KeyMajor,
        _ => {
            return Err(PyValueError::new_err(format!(
                "state_layout must be 'value_major' or 'key_major', got '{state_layout}'"
            )))
        }
    };
    if cu_seqlens.is_some() && lengths.is_some() {
        return Err(PyTypeError::new_err(
            "cu_seqlens and lengths: give one of them, not both",
        ));
    }

    let qkv = View::of("qkv", qkv)?;
    let a = View::of("a", a)?;
    let b = View::of("b", b)?;
    let z = View::of("z", z)?;
    let state = View::of("state", state)?;
    let conv = View::of("conv_state", conv_state)?;
    let slots = View::of("slots", slots)?;
    let cu = cu_seqlens.map(|x| View::of("cu_seqlens", x)).transpose()?;
    let lens = lengths.map(|x| View::of("lengths", x)).transpose()?;
    let com = commit.map(|x| View::of("commit", x)).transpose()?;
    let out_given = out.map(|x| View::of("out", x)).transpose()?;
    let spec_v = spec
        .map(|o| -> PyResult<SpecViews<'py>> {
            Ok(SpecViews {
                pending: View::of("pending", o.pending)?,
                held: View::of("held", o.held)?,
                accept: View::of("accept", o.accept)?,
            })
        })
        .transpose()?;

    // devices: one for every tensor
    let device = qkv.device;
    if device == Device::Other {
        return Err(PyValueError::new_err(format!(
            "qkv is on {}, gdn runs on the CPU and on CUDA devices",
            qkv.obj.getattr("device")?.str()?
        )));
    }
    {
        let mut all: Vec<&View<'_>> = vec![&a, &b, &z, &state, &conv, &slots];
        all.extend(cu.iter().chain(&lens).chain(&com).chain(&out_given));
        if let Some(sv) = &spec_v {
            all.extend([&sv.pending, &sv.held, &sv.accept]);
        }
        for v in all {
            if v.device != device {
                return Err(PyValueError::new_err(format!(
                    "{} is on {}, qkv on {device}: every tensor of a step is on one device",
                    v.name, v.device
                )));
            }
        }
    }

    // element types
    for v in [&qkv, &a, &b, &z, &conv] {
        v.expect_elem(&FLOATS, FLOATS_DOC)?;
    }
    state.expect_elem(&[Elem::F32, Elem::Bf16], "float32 or bfloat16")?;
    for v in std::iter::once(&slots).chain(&cu).chain(&lens).chain(&com) {
        v.expect_elem(&[Elem::I32], "int32")?;
    }
    if let Some(o) = &out_given {
        o.expect_elem(&FLOATS, FLOATS_DOC)?;
    }

    // shapes
    if qkv.ndim != 2 {
        qkv.expect_shape(&[None, Some(c)], || format!("[R, C = {c}]"))?;
    }
    let rows = qkv.shape[0];
    qkv.expect_shape(&[Some(rows), Some(c)], || format!("[R, C = {c}]"))?;
    a.expect_shape(&[Some(rows), Some(hv)], || {
        format!("[R = {rows}, num_v_heads = {hv}]")
    })?;
    b.expect_shape(&[Some(rows), Some(hv)], || {
        format!("[R = {rows}, num_v_heads = {hv}]")
    })?;
    z.expect_shape(&[Some(rows), Some(n)], || {
        format!("[R = {rows}, num_v_heads * head_dim = {n}]")
    })?;
    match layout {
        StateLayout::ValueMajor => state
            .expect_shape(&[None, Some(hv), Some(d), Some(d)], || {
                format!("[slots, num_v_heads = {hv}, head_dim = {d}, head_dim = {d}] (value_major)")
            })?,
        StateLayout::KeyMajor => state.expect_shape(&[None, Some(d), Some(hv), Some(d)], || {
            format!("[slots, head_dim = {d}, num_v_heads = {hv}, head_dim = {d}] (key_major)")
        })?,
    }
    let pool_slots = state.shape[0];
    conv.expect_shape(&[Some(pool_slots), Some(c), None], || {
        format!("[slots = {pool_slots}, C = {c}, w]")
    })?;
    if conv.shape[2] < 3 {
        return Err(PyValueError::new_err(format!(
            "conv_state's last dimension w = {} must be at least 3 (the history is its last three columns)",
            conv.shape[2]
        )));
    }
    if slots.ndim != 1 {
        slots.expect_shape(&[None], || "[N]".into())?;
    }
    let nseq = slots.shape[0];
    if let Some(v) = &cu {
        v.expect_shape(&[Some(nseq + 1)], || {
            format!("[N + 1] = [{}] (N from slots)", nseq + 1)
        })?;
    }
    if let Some(v) = &lens {
        v.expect_shape(&[Some(nseq)], || format!("[N] = [{nseq}] (N from slots)"))?;
    }
    if let Some(v) = &com {
        v.expect_shape(&[Some(nseq)], || format!("[N] = [{nseq}] (N from slots)"))?;
    }
    if let Some(o) = &out_given {
        o.expect_shape(&[Some(rows), Some(n)], || {
            format!("[R = {rows}, num_v_heads * head_dim = {n}]")
        })?;
    }
    if let Some(sv) = &spec_v {
        check_spec_views(sv, &sh, pool_slots, nseq)?;
        let reads: Vec<&View<'_>> = [&qkv, &a, &b, &z, &slots]
            .into_iter()
            .chain(&cu)
            .chain(&lens)
            .chain(&com)
            .chain(&out_given)
            .chain([&state, &conv, &sv.accept])
            .collect();
        for w in [&sv.pending, &sv.held] {
            for r in &reads {
                expect_disjoint(w, r)?;
            }
        }
        expect_disjoint(&sv.pending, &sv.held)?;
        for w in [&state, &conv] {
            expect_disjoint(w, &sv.accept)?;
        }
        if let Some(o) = &out_given {
            expect_disjoint(o, &sv.accept)?;
        }
    }

    // strides, alignment, memory the step writes
    {
        let mut all: Vec<&View<'_>> = vec![&qkv, &a, &b, &z, &state, &conv, &slots];
        all.extend(cu.iter().chain(&lens).chain(&com).chain(&out_given));
        for v in &all {
            v.expect_forward()?;
            v.expect_aligned()?;
        }
    }
    for v in [&qkv, &a, &b, &z] {
        v.expect_contiguous_from(1, "in its last dimension")?;
    }
    state.expect_contiguous_from(1, "within a slot")?;
    for v in std::iter::once(&slots).chain(&cu).chain(&lens).chain(&com) {
        v.expect_contiguous_from(0, "")?;
    }
    state.expect_writable()?;
    conv.expect_writable()?;
    {
        let reads: Vec<&View<'_>> = [&qkv, &a, &b, &z, &slots]
            .into_iter()
            .chain(&cu)
            .chain(&lens)
            .chain(&com)
            .collect();
        for r in &reads {
            expect_disjoint(&state, r)?;
            expect_disjoint(&conv, r)?;
        }
        expect_disjoint(&state, &conv)?;
        if let Some(o) = &out_given {
            o.expect_contiguous_from(1, "in its last dimension")?;
            o.expect_writable()?;
            for r in reads.iter().copied().chain([&state, &conv]) {
                expect_disjoint(o, r)?;
            }
        }
    }

    let rows_arg = if cu.is_some() {
        "cu_seqlens"
    } else if lens.is_some() {
        "lengths"
    } else {
        "qkv (one row per sequence without cu_seqlens or lengths)"
    };
    // the index values on the host: read in place on the CPU; copied (a sync) on CUDA with validate=True
    let host = |v: &View<'py>| -> PyResult<Vec<i32>> {
        if device == Device::Cpu {
            Ok(host_ints(v))
        } else {
            let h = v.obj.call_method0("cpu")?;
            let hv = View::of(v.name, &h)?;
            Ok(host_ints(&hv))
        }
    };
    let seqs = if device == Device::Cpu || validate {
        let slot_v = host(&slots)?;
        let cu_v = cu.as_ref().map(host).transpose()?;
        let len_v = lens.as_ref().map(host).transpose()?;
        let com_v = com.as_ref().map(host).transpose()?;
        let seqs = host_seqs(
            &slot_v,
            cu_v.as_deref(),
            len_v.as_deref(),
            com_v.as_deref(),
            spec.is_some(),
        )?;
        check_seqs(&seqs, rows, pool_slots).map_err(|e| step_err(e, rows_arg))?;
        if let Some(sv) = &spec_v {
            check_spec_values(&seqs, &host(&sv.held)?, &host(&sv.accept)?)?;
        }
        seqs
    } else {
        Vec::new()
    };

    if dry {
        return Ok(py.None().into_bound(py));
    }
    // the output, allocated only now that every other argument has passed
    let out_obj = match out {
        Some(o) => o.clone(),
        None => alloc_out(py, &qkv, rows, n)?,
    };
    let out_v = match out_given {
        Some(v) => v,
        None => View::of("out", &out_obj)?,
    };

    if let Device::Cuda(dev) = device {
        #[cfg(feature = "cuda")]
        {
            let args = cuda::Args {
                qkv: &qkv,
                a: &a,
                b: &b,
                z: &z,
                state: &state,
                conv: &conv,
                out: &out_v,
                slots: &slots,
                cu: cu.as_ref(),
                lengths: lens.as_ref(),
                commit: com.as_ref(),
                layout,
                spec: spec_v.as_ref().map(|v| (&v.pending, &v.held, &v.accept)),
                max_len: max_seqlen,
            };
            cuda::step(py, &lay.cuda, &lay.inner, dev, &args)?;
            return Ok(out_obj);
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = dev;
            return Err(pyo3::exceptions::PyNotImplementedError::new_err(
                "qkv: CUDA tensors need gdn built with its `cuda` feature",
            ));
        }
    }
    let step = cpu::CpuStep {
        qkv: qkv.raw(),
        a: a.raw(),
        b: b.raw(),
        z: z.raw(),
        state: state.raw(),
        conv: conv.raw(),
        out: out_v.raw(),
        layout,
        seqs: &seqs,
        spec: spec_v.as_ref().map(|v| cpu::CpuSpec {
            pending: v.pending.raw(),
            held: v.held.raw(),
            accept: host_ints(&v.accept),
        }),
    };
    let inner = &lay.inner;
    let cache = &lay.cpu;
    let result = py.detach(|| {
        let mut cached = cache.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: every view was checked above (type, dtype, shape, strides, alignment, device: host memory,
        // disjointness of what the step writes, slots in range); the tensors are kept alive by the caller's
        // references for the call. Like any in-place torch op, the call needs no other thread writing them.
        unsafe { cpu::run(inner, &mut cached, &step) }
    });
    result.map_err(|e| step_err(e, rows_arg))?;
    Ok(out_obj)
}

/// One window step of a layer on the caller's tensors, in place: every sequence advances by its rows, its
/// output rows are written into ``out``, and its state and conv-state slot are updated where it commits.
///
/// Args:
///     layer (gdn.Layer): the layer.
///     qkv: ``[R, C]``, the mixed q | k | v projections BEFORE the conv (HF's ``in_proj_qkv`` output), ``C =
///         (2 * num_k_heads + num_v_heads) * head_dim``; float32, bfloat16 or float16; the row stride is free, the
///         last dimension contiguous. R rows in all, sequences packed.
///     a: ``[R, num_v_heads]``, the decay logits (HF's ``in_proj_a`` output); float dtype as qkv (each input may
///         have its own); last dimension contiguous.
///     b: ``[R, num_v_heads]``, the beta logits (HF's ``in_proj_b`` output); as ``a``.
///     z: ``[R, num_v_heads * head_dim]``, the output gate (HF's ``in_proj_z`` output); as ``a``.
///     state: the recurrent state pool, updated in place: ``[slots, num_v_heads, head_dim, head_dim]`` with
///         ``state_layout="value_major"`` (``[slot][head][v][k]``, vLLM's, SGLang's and FlashInfer's), or
///         ``[slots, head_dim, num_v_heads, head_dim]`` with ``"key_major"`` (``[slot][k][head][v]``, gdn's SPEC);
///         float32 or bfloat16 (a bf16 state is widened, updated in f32 over the window, rounded once where it
///         commits); the slot stride is free, each slot contiguous.
///     conv_state: ``[slots, C, w]``, ``w >= 3``, the conv history (HF's and vLLM's layout; the last three columns
///         hold the last three inputs, oldest first; other columns are neither read nor written), updated in
///         place; float32, bfloat16 or float16; any (non-negative, non-overlapping) strides, so vLLM's transposed
///         view works.
///     slots: ``[N]`` int32, each sequence's slot in ``state`` and ``conv_state``; -1 skips the sequence (its
///         rows of ``out`` are not written, no slot is touched). A slot may be named once.
///     cu_seqlens: ``[N + 1]`` int32 row offsets (FLA's and vLLM's ``query_start_loc``): sequence s has rows
///         ``cu_seqlens[s]:cu_seqlens[s + 1]``; or
///     lengths: ``[N]`` int32 tokens per sequence, rows packed in order from row 0. With neither, every sequence
///         has one row (decode: R == N).
///     commit: None (every sequence commits its whole window) or ``[N]`` int32: 0 verifies (writes no slot), k
///         commits the state after k of its tokens (``1 <= k <= len``); every token's output is written either
///         way (speculative decoding: verify a draft, then commit the accepted tokens).
///     out: ``[R, num_v_heads * head_dim]``, float32, bfloat16 or float16, last dimension contiguous; None
///         allocates it (zeros, qkv's dtype and device). Rows no running sequence covers are left as they were.
///     state_layout: ``"value_major"`` or ``"key_major"``, see ``state``.
///     validate: on CUDA, copy the index tensors to the host and check them first (syncs the stream). On the
///         CPU they are always checked.
///     max_seqlen: None or an upper bound on every sequence's length (FLA's and flash-attn's ``max_seqlen``), a
///         hint for CUDA: below 64 (the chunked path's threshold) a call with ``cu_seqlens`` or ``lengths`` skips
///         the chunked path's launches (decode and short verify windows in large batches); a longer window is
///         then not refused but runs token after token. 1 runs the decode kernel, as a call without offsets does
///         (a sequence of another length is then skipped and reported by ``layer.check_faults()``): measured on
///         the H200 at B 256 with a bf16 state, 288 us a call against 363 without the hint.
///
/// Returns:
///     ``out``.
///
/// Every tensor is on one device: the CPU (torch CPU tensors or numpy arrays) or one CUDA device (torch
/// tensors; the step runs on torch's current stream there). Nothing is copied: a tensor the step cannot use as
/// it is (wrong dtype, shape, strides, device, not contiguous where that is needed, overlapping another) raises a
/// TypeError or ValueError naming it, before anything is touched. The CPU path stages the named slots: each
/// running sequence's state and conv history are copied into a scratch pool of the layer, stepped there, and
/// copied back for the sequences that commit.
///
/// On CUDA: one kernel launch, no host synchronisation (unless ``validate``), nothing allocated but ``out=None``'s
/// output (``lengths`` are summed on the device by the kernel itself). Windows of 64 tokens or more (prefill)
/// take the chunked path (tensor-core chunks of 64 tokens: four more launches, within 2e-6 of the float64
/// reference like the token-serial kernel, its bits its own); its scratch, about 132 KiB a row at Qwen3.5's
/// shape (``rows x num_v_heads x (5 head_dim + 65)`` floats), is allocated outside torch's allocator, after a
/// device synchronize, by the first call that may hold a long window (``cu_seqlens`` or ``lengths`` with 64 rows
/// or more and no ``max_seqlen`` below 64), grown the same way by a larger one, kept (``gdn.release_chunk_scratch()``
/// frees it), and shared by every layer on the device (their steps are ordered anyway). Bad index
/// values that ``validate=False`` lets through skip their sequence on the device and are reported by
/// ``layer.check_faults()``. The steps of every layer on one device must be ordered (one stream, or streams
/// ordered by events): they share the layer's q/k-history counters and the chunked scratch. CUDA graphs: run one
/// step of each kind (dtypes, layout, commit given or not, decode without offsets or not) outside the capture
/// first; it compiles the kernel and makes the layer's device copy, which a capture cannot. A captured step
/// chunks only if an eager call of the same kind with at least its rows and sequences ran before (the scratch
/// and the chunked kernels were there); else every window of the graph runs token after token.
#[pyfunction]
#[pyo3(signature = (layer, qkv, a, b, z, state, conv_state, slots, *, cu_seqlens = None, lengths = None,
                    commit = None, out = None, state_layout = "value_major", validate = false, max_seqlen = None))]
#[allow(clippy::too_many_arguments)]
fn step<'py>(
    py: Python<'py>,
    layer: &Bound<'py, Layer>,
    qkv: &Bound<'py, PyAny>,
    a: &Bound<'py, PyAny>,
    b: &Bound<'py, PyAny>,
    z: &Bound<'py, PyAny>,
    state: &Bound<'py, PyAny>,
    conv_state: &Bound<'py, PyAny>,
    slots: &Bound<'py, PyAny>,
    cu_seqlens: Option<&Bound<'py, PyAny>>,
    lengths: Option<&Bound<'py, PyAny>>,
    commit: Option<&Bound<'py, PyAny>>,
    out: Option<&Bound<'py, PyAny>>,
    state_layout: &str,
    validate: bool,
    max_seqlen: Option<usize>,
) -> PyResult<Bound<'py, PyAny>> {
    step_impl(
        py,
        layer,
        qkv,
        a,
        b,
        z,
        state,
        conv_state,
        slots,
        cu_seqlens,
        lengths,
        commit,
        out,
        state_layout,
        validate,
        false,
        None,
        max_seqlen,
    )
}

/// `gdn.step`'s argument extraction and checks alone, without the step (nothing is read or written): the host
/// cost of a call, for `bench_host.py`.
#[pyfunction(name = "_check_only")]
#[pyo3(signature = (layer, qkv, a, b, z, state, conv_state, slots, *, cu_seqlens = None, lengths = None,
                    commit = None, out = None, state_layout = "value_major", validate = false, max_seqlen = None))]
#[allow(clippy::too_many_arguments)]
fn check_only<'py>(
    py: Python<'py>,
    layer: &Bound<'py, Layer>,
    qkv: &Bound<'py, PyAny>,
    a: &Bound<'py, PyAny>,
    b: &Bound<'py, PyAny>,
    z: &Bound<'py, PyAny>,
    state: &Bound<'py, PyAny>,
    conv_state: &Bound<'py, PyAny>,
    slots: &Bound<'py, PyAny>,
    cu_seqlens: Option<&Bound<'py, PyAny>>,
    lengths: Option<&Bound<'py, PyAny>>,
    commit: Option<&Bound<'py, PyAny>>,
    out: Option<&Bound<'py, PyAny>>,
    state_layout: &str,
    validate: bool,
    max_seqlen: Option<usize>,
) -> PyResult<Bound<'py, PyAny>> {
    step_impl(
        py,
        layer,
        qkv,
        a,
        b,
        z,
        state,
        conv_state,
        slots,
        cu_seqlens,
        lengths,
        commit,
        out,
        state_layout,
        validate,
        true,
        None,
        max_seqlen,
    )
}

/// The core's sequence checks on index values read on the host: rows inside the step's and not shared, slots
/// in range and named once (commits were checked against lengths by `host_seqs`).
fn check_seqs(seqs: &[Seq], rows: usize, pool_slots: usize) -> gdn::Result<()> {
    let mut order: Vec<usize> = (0..seqs.len()).collect();
    for (i, s) in seqs.iter().enumerate() {
        if s.start.checked_add(s.len).is_none_or(|e| e > rows) {
            return Err(gdn::Error::SeqRows {
                seq: i,
                start: s.start,
                len: s.len,
                rows,
            });
        }
    }
    order.sort_by_key(|&i| seqs[i].start);
    for w in order.windows(2) {
        let (x, y) = (&seqs[w[0]], &seqs[w[1]]);
        if x.start + x.len > y.start {
            return Err(gdn::Error::SeqOverlap {
                a: w[0].min(w[1]),
                b: w[0].max(w[1]),
            });
        }
    }
    let mut seen = std::collections::HashSet::new();
    for s in seqs {
        if s.slot < 0 {
            continue;
        }
        if s.slot as usize >= pool_slots {
            return Err(gdn::Error::SlotRange {
                index: s.slot as i64,
                slots: pool_slots,
            });
        }
        if !seen.insert(s.slot) {
            return Err(gdn::Error::SlotTwice(s.slot as usize));
        }
    }
    Ok(())
}

/// A zeroed `[rows, n]` output in qkv's dtype and device.
fn alloc_out<'py>(
    py: Python<'py>,
    qkv: &View<'py>,
    rows: usize,
    n: usize,
) -> PyResult<Bound<'py, PyAny>> {
    if let Some(t) = tensor::torch(py)? {
        if t.is_tensor(&qkv.obj)? {
            return qkv.obj.call_method1("new_zeros", ((rows, n),));
        }
    }
    let np = py.import("numpy")?;
    np.call_method1("zeros", ((rows, n), qkv.obj.getattr("dtype")?))
}

/// The speculative step's extra arguments, as given.
#[derive(Clone, Copy)]
struct SpecObjs<'a, 'py> {
    pending: &'a Bound<'py, PyAny>,
    held: &'a Bound<'py, PyAny>,
    accept: &'a Bound<'py, PyAny>,
}

/// The speculative step's extra arguments, viewed.
struct SpecViews<'py> {
    pending: View<'py>,
    held: View<'py>,
    accept: View<'py>,
}

/// Floats of one slot's row of the speculative step's pending region: what the CUDA kernel keeps there, or the
/// CPU path's held window (`CpuPool::held_floats`), whichever is more, so one row serves both devices.
fn pending_row_floats(sh: &Shape) -> PyResult<usize> {
    let cpu = gdn::cpu::CpuPool::held_floats(sh);
    #[cfg(feature = "cuda")]
    {
        gdn_cuda::pending_row_bytes(sh)
            .map(|b| (b / 4).max(cpu))
            .map_err(value_err)
    }
    #[cfg(not(feature = "cuda"))]
    Ok(cpu)
}

fn check_spec_views(
    sv: &SpecViews<'_>,
    sh: &Shape,
    pool_slots: usize,
    nseq: usize,
) -> PyResult<()> {
    let row = pending_row_floats(sh)?;
    sv.pending.expect_elem(&[Elem::F32], "float32")?;
    sv.pending
        .expect_shape(&[Some(pool_slots), Some(row)], || {
            format!("[slots = {pool_slots}, gdn.pending_row(layer) = {row}]")
        })?;
    sv.held.expect_elem(&[Elem::I32], "int32")?;
    sv.held
        .expect_shape(&[Some(pool_slots)], || format!("[slots] = [{pool_slots}]"))?;
    sv.accept.expect_elem(&[Elem::I32], "int32")?;
    sv.accept
        .expect_shape(&[Some(nseq)], || format!("[N] = [{nseq}] (N from slots)"))?;
    for v in [&sv.pending, &sv.held, &sv.accept] {
        v.expect_forward()?;
        v.expect_aligned()?;
        v.expect_contiguous_from(0, "")?;
    }
    if !sv.pending.ptr.is_multiple_of(16) {
        return Err(PyValueError::new_err(format!(
            "pending's data at {:#x} is not aligned to 16 bytes",
            sv.pending.ptr
        )));
    }
    sv.pending.expect_writable()?;
    sv.held.expect_writable()
}

/// `validate=True`'s checks of the speculative values: each accepted count within what its slot holds, a window
/// that will be held (commit 0) at most 16 tokens.
fn check_spec_values(seqs: &[Seq], held: &[i32], accept: &[i32]) -> PyResult<()> {
    for (i, s) in seqs.iter().enumerate() {
        if s.slot < 0 {
            continue;
        }
        let w = held[s.slot as usize];
        let len = w & 0xff;
        if w < 0 || w >> 9 != 0 || len > 16 {
            return Err(PyValueError::new_err(format!(
                "held[{}] = {w} is not a held word (length | buffer << 8) the step wrote",
                s.slot
            )));
        }
        if accept[i] < 0 || accept[i] > len {
            return Err(PyValueError::new_err(format!(
                "accept[{i}] = {} is outside 0..={len} (slot {} holds a window of {len})",
                accept[i], s.slot
            )));
        }
        if s.commit == Commit::Verify && s.len > 16 {
            return Err(PyValueError::new_err(format!(
                "commit[{i}] = 0 would hold a window of {} tokens; at most 16 are held",
                s.len
            )));
        }
    }
    Ok(())
}

/// Floats of one slot's row of the speculative step's pending region: ``pending`` is ``[slots,
/// gdn.pending_row(layer)]`` float32 (see ``gdn.spec_step``).
#[pyfunction]
fn pending_row(layer: &Bound<'_, Layer>) -> PyResult<usize> {
    pending_row_floats(layer.get().inner.shape())
}

/// One speculative step (one state pass: SPEC.md "Speculative steps") of a layer on the caller's CUDA tensors,
/// in place. Per sequence s, first the first ``accept[s]`` tokens of the window its slot holds are kept (exactly
/// their commit: state and conv history) and the rest dropped; then its window runs: with ``commit[s] == 0`` it
/// is *held* on the slot (its outputs are a verify's, nothing is committed, ``held[slot]`` becomes its length),
/// with ``k > 0`` it commits after k tokens as ``gdn.step`` does (nothing held after). Outputs, states and conv
/// states are bitwise those of the two-pass flow through ``gdn.step`` (verify the window; next step commit its
/// first k tokens, then verify the next window).
///
/// Args (as ``gdn.step`` unless said):
///     layer, qkv, a, b, z, state, conv_state, slots, cu_seqlens, lengths, out, state_layout: see ``gdn.step``.
///         A sequence may have no rows here (a length of 0, or equal cu_seqlens): it only accepts (the end of a
///         request; ``gdn.commit_held``).
///     pending: ``[slots, gdn.pending_row(layer)]`` float32, contiguous, 16-byte aligned, updated in place: what
///         each slot's held window would commit (opaque; zeros hold nothing). One ``pending`` and one ``held`` per
///         layer, like its ``state`` (each layer's step rewrites its own). Fork slot a into b (with what it
///         holds): copy ``state``, ``conv_state``, ``held`` and ``pending`` rows a to b.
///     held: ``[slots]`` int32, contiguous, updated in place on the device: per slot ``length | buffer << 8`` of
///         the window it holds (``held & 0xff`` is the length; 0 holds nothing). Start from zeros; reset a slot
///         (drop its window) by zeroing its entry. A plain ``gdn.step`` neither reads nor clears it: accept or drop
///         a slot's window before a plain step on it.
///     accept: ``[N]`` int32, contiguous: per sequence, how many tokens of its slot's held window it accepts,
///         ``0 ..= held[slot] & 0xff`` (computed on the GPU by the engine: nothing is read on the host).
///     commit: None (every window commits whole, nothing is held) or ``[N]`` int32: 0 holds the window (at most
///         16 tokens), k commits after k tokens.
///     validate: also copy ``held`` and ``accept`` to the host and check them (syncs the stream).
///
/// Returns:
///     ``out``.
///
/// One kernel launch on torch's current stream, no host synchronisation (unless ``validate``), nothing allocated
/// but ``out=None``'s, so it can be captured into a CUDA graph (run one step of each kind before the capture).
/// Bad values ``validate=False`` lets through (an accepted count above what the slot holds, a held window above
/// 16 tokens, a commit point past the window, slots or rows out of range) skip their sequence whole on the
/// device (nothing of it written) and are reported by ``layer.check_faults()``. On the CPU (torch CPU tensors or
/// numpy arrays) the same call runs gdn's CPU pool's one-pass step on each named slot, staged as ``gdn.step``
/// stages it (its held window kept in the slot's ``pending`` row); there every value is checked on the host
/// first (as ``validate``), and the outputs, states and held windows are bitwise the CPU's two-pass flow. The
/// ``pending`` rows are the device's own: a window held on one device cannot go on on another (an error).
#[pyfunction]
#[pyo3(signature = (layer, qkv, a, b, z, state, conv_state, slots, pending, held, accept, *, cu_seqlens = None,
                    lengths = None, commit = None, out = None, state_layout = "value_major", validate = false))]
#[allow(clippy::too_many_arguments)]
fn spec_step<'py>(
    py: Python<'py>,
    layer: &Bound<'py, Layer>,
    qkv: &Bound<'py, PyAny>,
    a: &Bound<'py, PyAny>,
    b: &Bound<'py, PyAny>,
    z: &Bound<'py, PyAny>,
    state: &Bound<'py, PyAny>,
    conv_state: &Bound<'py, PyAny>,
    slots: &Bound<'py, PyAny>,
    pending: &Bound<'py, PyAny>,
    held: &Bound<'py, PyAny>,
    accept: &Bound<'py, PyAny>,
    cu_seqlens: Option<&Bound<'py, PyAny>>,
    lengths: Option<&Bound<'py, PyAny>>,
    commit: Option<&Bound<'py, PyAny>>,
    out: Option<&Bound<'py, PyAny>>,
    state_layout: &str,
    validate: bool,
) -> PyResult<Bound<'py, PyAny>> {
    step_impl(
        py,
        layer,
        qkv,
        a,
        b,
        z,
        state,
        conv_state,
        slots,
        cu_seqlens,
        lengths,
        commit,
        out,
        state_layout,
        validate,
        false,
        Some(SpecObjs {
            pending,
            held,
            accept,
        }),
        None,
    )
}

/// Frees the CUDA chunked path's scratch (the long windows' workspace, about 132 KiB a row at Qwen3.5's shape,
/// kept after a prefill and shared by every layer on a device) on every device gdn has run on, after waiting for
/// each device; the next long window allocates it again. Returns the bytes freed (0 without CUDA). A CUDA graph
/// that captured a long-window step must not be replayed after this.
#[pyfunction]
fn release_chunk_scratch(py: Python<'_>) -> PyResult<usize> {
    #[cfg(feature = "cuda")]
    return py.detach(cuda::release_chunk_scratch);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = py;
        Ok(0)
    }
}

/// Bytes the CUDA chunked path's scratch holds now, over every device (0 without CUDA or before a long window).
#[pyfunction]
fn chunk_scratch_bytes(py: Python<'_>) -> PyResult<usize> {
    // without the GIL: a step on another thread may hold the scratch's lock while it waits for its device
    #[cfg(feature = "cuda")]
    return py.detach(cuda::chunk_scratch_bytes);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = py;
        Ok(0)
    }
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Layer>()?;
    m.add_function(wrap_pyfunction!(step, m)?)?;
    m.add_function(wrap_pyfunction!(check_only, m)?)?;
    m.add_function(wrap_pyfunction!(spec_step, m)?)?;
    m.add_function(wrap_pyfunction!(pending_row, m)?)?;
    m.add_function(wrap_pyfunction!(release_chunk_scratch, m)?)?;
    m.add_function(wrap_pyfunction!(chunk_scratch_bytes, m)?)?;
    Ok(())
}
