//! The step on memory the caller owns (`CudaLayer::step_raw`) against the pool's own step (`CudaPool`), bitwise:
//! y and the committed state and history, across state dtypes and layouts, strided state pools, the engines'
//! conv-state layouts and dtypes, strided rows, cu_seqlens, mixed commits, skipped slots, clusters; verify and
//! skipped sequences write nothing, padding and untouched slots stay as they were; graph replays; bad
//! arguments. Without a GPU, driver or libnvrtc every test is skipped with a message on stderr.

use gdn::synth::Synth;
use gdn::{
    Commit, Config, DType, HeadMap, Layer, LayerPool, OutputLayout, PoolOptions, RowsData, Seq,
    Shape, StateLayout, Step, TensorData,
};
use gdn_cuda::cudarc::driver::{sys, CudaSlice, CudaStream, DevicePtr};
use gdn_cuda::{Cuda, CudaLayer, RawConv, RawState, RawStep, RawTensor, SeqRows};
use std::sync::Arc;

mod common;

/// The backend with the window kernel off: the external step runs the token-serial kernels, and its pool
/// counterpart must too for the bits to be comparable.
fn cuda_or_skip(test: &str) -> Option<Cuda> {
    common::cuda_or_skip(test).map(|mut c| {
        c.set_window_kernel(false);
        c
    })
}

/// Bytes of one element of `dt` holding `x` rounded (nearest even).
fn elt(dt: DType, x: f32) -> Vec<u8> {
    match dt {
        DType::F32 => x.to_le_bytes().to_vec(),
        DType::Bf16 => gdn::bf16::from_f32(x).to_bits().to_le_bytes().to_vec(),
        DType::F16 => gdn::f16::from_f32(x).to_bits().to_le_bytes().to_vec(),
    }
}

/// The f32 value of element `i` of a byte buffer of `dt` (exact widening).
fn widen(dt: DType, b: &[u8], i: usize) -> f32 {
    match dt {
        DType::F32 => f32::from_le_bytes(b[4 * i..4 * i + 4].try_into().unwrap()),
        DType::Bf16 => {
            gdn::bf16::from_bits(u16::from_le_bytes(b[2 * i..2 * i + 2].try_into().unwrap()))
                .to_f32()
        }
        DType::F16 => {
            gdn::f16::from_bits(u16::from_le_bytes(b[2 * i..2 * i + 2].try_into().unwrap()))
                .to_f32()
        }
    }
}

fn data_bytes(t: &TensorData) -> Vec<u8> {
    match t {
        TensorData::F32(x) => x.iter().flat_map(|v| v.to_le_bytes()).collect(),
        TensorData::Bf16(x) => x.iter().flat_map(|v| v.to_bits().to_le_bytes()).collect(),
        TensorData::F16(x) => x.iter().flat_map(|v| v.to_bits().to_le_bytes()).collect(),
    }
}

const PAD: u8 = 0xA5;

/// `rows` packed rows of `width` elements of `es` bytes, spread `stride` elements apart, padding PAD.
fn strided(packed: &[u8], es: usize, rows: usize, width: usize, stride: usize) -> Vec<u8> {
    let mut out = vec![PAD; (rows.max(1) - 1) * stride * es + width * es];
    for r in 0..rows {
        out[r * stride * es..(r * stride + width) * es]
            .copy_from_slice(&packed[r * width * es..(r + 1) * width * es]);
    }
    out
}

#[derive(Clone, Copy, Debug)]
enum ConvKind {
    /// [slot][C][3]
    Packed3,
    /// HF: [slot][C][4], the history in columns 1..4
    Hf4,
    /// vLLM: the transposed view of [slot][3][C] (channel stride 1, column stride C), slots padded
    VllmT,
}

#[derive(Clone, Debug)]
struct Case {
    name: &'static str,
    shape: Shape,
    head_map: HeadMap,
    state: PoolOptions,
    io: DType,
    out: DType,
    conv: DType,
    conv_kind: ConvKind,
    /// extra elements per state slot
    state_pad: usize,
    /// extra elements per input / output row
    row_pad: usize,
    cu_seqlens: bool,
    /// with `cu_seqlens`: the lengths alone (`SeqRows::Lengths`, rows packed from row 0)
    lengths_only: bool,
    /// commit_at None (every sequence commits its whole window; the seqs' commits must be All)
    commit_none: bool,
    planes: bool,
    slots: usize,
    seqs: Vec<Seq>,
    rows: usize,
    uniform: bool,
    /// history (and so inputs) rounded to bf16 first
    bf16_hist: bool,
    /// the `max_len` hint
    max_len: Option<usize>,
}

/// What one path produced: output bytes, every slot's state (f32 bits in the pool's layout) and SPEC history.
#[derive(PartialEq, Debug)]
struct Result3 {
    y: Vec<u32>,
    state: Vec<Vec<u32>>,
    hist: Vec<Vec<u32>>,
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

struct Inputs {
    layer: Layer,
    init: Vec<(Vec<f32>, Vec<f32>)>,
    rows: RowsData,
}

fn inputs(c: &Case, seed: u64) -> Inputs {
    let mut rng = Synth::new(seed);
    let mut cfg = Config::new(c.shape);
    cfg.head_map = c.head_map;
    let layer = rng.layer(cfg).unwrap();
    let init = (0..c.slots)
        .map(|_| {
            let (s, mut h) = rng.seq_state(&layer);
            if c.bf16_hist {
                h.iter_mut().for_each(|x| *x = DType::Bf16.round(*x));
            }
            (s, h)
        })
        .collect();
    let b = rng.batch(&layer, c.rows, 1);
    let rows = RowsData::from_f32(&b.qkv, &b.alpha, &b.beta, &b.z, [c.io; 4]);
    Inputs { layer, init, rows }
}

fn plane_stride(c: &Case) -> Option<usize> {
    c.planes.then_some(c.rows * c.shape.n() + 32)
}

/// The pool's own step on the host slices.
fn pool_run(cuda: &Cuda, c: &Case, inp: &Inputs) -> Result3 {
    let sh = c.shape;
    let mut p = cuda.create_cuda_pool(&inp.layer, c.slots, c.state).unwrap();
    for (i, (s, h)) in inp.init.iter().enumerate() {
        p.write_slot(i, s, h).unwrap();
    }
    let len = OutputLayout::for_rows(&sh, c.rows, plane_stride(c))
        .unwrap()
        .len();
    let mut out = TensorData::filled(len, 0.0, c.out);
    let step = Step {
        rows: inp.rows.view(),
        seqs: &c.seqs,
        plane_stride: plane_stride(c),
    };
    p.step_varlen(&step, out.view_mut()).unwrap();
    let (mut state, mut hist) = (Vec::new(), Vec::new());
    for i in 0..c.slots {
        let (mut s, mut h) = (vec![0.0; sh.state_len()], vec![0.0; sh.hist_len()]);
        p.read_slot(i, &mut s, &mut h).unwrap();
        state.push(bits(&s));
        hist.push(bits(&h));
    }
    Result3 {
        y: bits(&out.to_f32()),
        state,
        hist,
    }
}

fn up(s: &Arc<CudaStream>, b: &[u8]) -> CudaSlice<u8> {
    s.clone_htod(b).unwrap()
}

fn addr(s: &Arc<CudaStream>, b: &CudaSlice<u8>) -> u64 {
    b.device_ptr(s).0
}

fn down(s: &Arc<CudaStream>, b: &CudaSlice<u8>) -> Vec<u8> {
    let mut v = vec![0u8; b.len()];
    s.memcpy_dtoh(b, &mut v).unwrap();
    s.synchronize().unwrap();
    v
}

fn ints(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// The engine's buffers of one case on the device, and the step over them.
struct Engine {
    state: CudaSlice<u8>,
    conv: CudaSlice<u8>,
    out: CudaSlice<u8>,
    init_state: Vec<u8>,
    init_conv: Vec<u8>,
    init_out: Vec<u8>,
    _keep: Vec<CudaSlice<u8>>,
    step: RawStep,
    state_ss: usize,
    conv_geom: (usize, usize, usize, usize), // width, slot, chan, col strides
    out_len: usize,
}

fn engine(s: &Arc<CudaStream>, c: &Case, inp: &Inputs) -> Engine {
    let sh = c.shape;
    let (ch, hv, n) = (sh.channels(), sh.h_v, sh.n());
    // the state pool, slots padded
    let es = c.state.state.size();
    let ss = sh.state_len() + c.state_pad;
    let mut state_b = vec![PAD; c.slots * ss * es];
    for (i, (st, _)) in inp.init.iter().enumerate() {
        for (k, &x) in st.iter().enumerate() {
            let at = (i * ss + k) * es;
            state_b[at..at + es].copy_from_slice(&elt(c.state.state, x));
        }
    }
    // the conv state
    let (w, css, ccs, cls) = match c.conv_kind {
        ConvKind::Packed3 => (3, ch * 3, 3, 1),
        ConvKind::Hf4 => (4, ch * 4, 4, 1),
        ConvKind::VllmT => (3, 3 * ch + 40, 1, ch),
    };
    let ce = c.conv.size();
    let mut conv_b = vec![PAD; ((c.slots - 1) * css + (ch - 1) * ccs + (w - 1) * cls + 1) * ce];
    for (i, (_, h)) in inp.init.iter().enumerate() {
        for cc in 0..ch {
            for k in 0..3 {
                let at = (i * css + cc * ccs + (w - 3 + k) * cls) * ce;
                conv_b[at..at + ce].copy_from_slice(&elt(c.conv, h[cc * 3 + k]));
            }
        }
    }
    let rs = |width: usize| width + c.row_pad;
    let tensor = |t: &TensorData, width: usize| {
        strided(&data_bytes(t), t.dtype().size(), c.rows, width, rs(width))
    };
    let (qkv_b, a_b, b_b, z_b) = (
        tensor(&inp.rows.qkv, ch),
        tensor(&inp.rows.alpha, hv),
        tensor(&inp.rows.beta, hv),
        tensor(&inp.rows.z, n),
    );
    let out_stride = if c.planes { n } else { rs(n) };
    let layout = OutputLayout::for_rows(&sh, c.rows, plane_stride(c)).unwrap();
    let zeros = vec![0u8; layout.len() * c.out.size()];
    let out_b = if c.planes {
        zeros
    } else {
        strided(&zeros, c.out.size(), c.rows, n, out_stride)
    };
    // per-sequence arrays
    let slot: Vec<i32> = c.seqs.iter().map(|q| q.slot).collect();
    let start: Vec<i32> = c.seqs.iter().map(|q| q.start as i32).collect();
    let len: Vec<i32> = c.seqs.iter().map(|q| q.len as i32).collect();
    let mut cu = vec![c.seqs[0].start as i32];
    for q in &c.seqs {
        assert!(!c.cu_seqlens || q.start as i32 == *cu.last().unwrap());
        cu.push((q.start + q.len) as i32);
    }
    let commit: Vec<i32> = c
        .seqs
        .iter()
        .map(|q| match q.commit {
            Commit::Verify => 0,
            Commit::All => q.len as i32,
            Commit::First(k) => k as i32,
        })
        .collect();
    let bufs: Vec<CudaSlice<u8>> = [
        &qkv_b,
        &a_b,
        &b_b,
        &z_b,
        &ints(&slot),
        &ints(&start),
        &ints(&len),
        &ints(&cu),
        &ints(&commit),
    ]
    .iter()
    .map(|b| up(s, b))
    .collect();
    let a = |i: usize| addr(s, &bufs[i]);
    let state = up(s, &state_b);
    let conv = up(s, &conv_b);
    let out = up(s, &out_b);
    let first = c.seqs[0].len;
    let step = RawStep {
        rows: c.rows,
        qkv: RawTensor {
            ptr: a(0),
            dtype: c.io,
            row_stride: rs(ch),
        },
        alpha: RawTensor {
            ptr: a(1),
            dtype: c.io,
            row_stride: rs(hv),
        },
        beta: RawTensor {
            ptr: a(2),
            dtype: c.io,
            row_stride: rs(hv),
        },
        z: RawTensor {
            ptr: a(3),
            dtype: c.io,
            row_stride: rs(n),
        },
        out: RawTensor {
            ptr: addr(s, &out),
            dtype: c.out,
            row_stride: out_stride,
        },
        plane_stride: plane_stride(c),
        state: RawState {
            ptr: addr(s, &state),
            dtype: c.state.state,
            layout: c.state.layout,
            slots: c.slots,
            slot_stride: ss,
        },
        conv: RawConv {
            ptr: addr(s, &conv),
            dtype: c.conv,
            width: w,
            slot_stride: css,
            chan_stride: ccs,
            col_stride: cls,
        },
        seqs: c.seqs.len(),
        slot: a(4),
        seq_rows: if c.cu_seqlens && c.lengths_only {
            SeqRows::Lengths(a(6))
        } else if c.cu_seqlens {
            SeqRows::CuSeqlens(a(7))
        } else {
            SeqRows::StartLen {
                start: a(5),
                len: a(6),
            }
        },
        commit_at: (!c.commit_none).then(|| a(8)),
        uniform_len: (c.uniform && c.seqs.iter().all(|q| q.len == first)).then_some(first),
        commits: commit.iter().any(|&k| k > 0),
        max_len: c.max_len,
    };
    Engine {
        state,
        conv,
        out,
        init_state: state_b,
        init_conv: conv_b,
        init_out: out_b,
        _keep: bufs,
        step,
        state_ss: ss,
        conv_geom: (w, css, ccs, cls),
        out_len: layout.len(),
    }
}

/// Reads an engine's buffers back as the pool's results, and checks that nothing but y rows of live
/// sequences, the committed slots' states and the history columns changed.
fn read_engine(s: &Arc<CudaStream>, c: &Case, e: &Engine) -> Result3 {
    let sh = c.shape;
    let (ch, n) = (sh.channels(), sh.n());
    let st = down(s, &e.state);
    let cv = down(s, &e.conv);
    let out = down(s, &e.out);
    let committed: Vec<usize> = c
        .seqs
        .iter()
        .filter(|q| q.slot >= 0 && q.commit != Commit::Verify)
        .map(|q| q.slot as usize)
        .collect();
    let es = c.state.state.size();
    let (w, css, ccs, cls) = e.conv_geom;
    let ce = c.conv.size();
    let mut state = Vec::new();
    let mut hist = Vec::new();
    for i in 0..c.slots {
        let slot_bytes = i * e.state_ss * es..(i * e.state_ss + sh.state_len()) * es;
        if !committed.contains(&i) {
            assert!(
                st[slot_bytes.clone()] == e.init_state[slot_bytes.clone()],
                "{}: slot {i} (not committed) changed",
                c.name
            );
        }
        let v: Vec<f32> = (0..sh.state_len())
            .map(|k| widen(c.state.state, &st, i * e.state_ss + k))
            .collect();
        state.push(bits(&v));
        let mut h = vec![0.0f32; sh.hist_len()];
        for cc in 0..ch {
            for k in 0..3 {
                h[cc * 3 + k] = widen(c.conv, &cv, i * css + cc * ccs + (w - 3 + k) * cls);
            }
        }
        hist.push(bits(&h));
    }
    // padding between state slots
    for i in 0..c.slots {
        let pad = (i * e.state_ss + sh.state_len()) * es..(i + 1) * e.state_ss * es;
        assert!(
            st[pad.clone()] == e.init_state[pad],
            "{}: state padding of slot {i} changed",
            c.name
        );
    }
    // the conv state outside committed slots' history columns
    let mut hist_elems = vec![false; cv.len() / ce];
    for &i in &committed {
        for cc in 0..ch {
            for k in 0..3 {
                hist_elems[i * css + cc * ccs + (w - 3 + k) * cls] = true;
            }
        }
    }
    for (k, &is_hist) in hist_elems.iter().enumerate() {
        if !is_hist {
            assert!(
                cv[k * ce..(k + 1) * ce] == e.init_conv[k * ce..(k + 1) * ce],
                "{}: conv element {k} (no committed history) changed",
                c.name
            );
        }
    }
    // y: the packed output the pool produces, from the strided rows; row padding untouched
    let oe = c.out.size();
    let y: Vec<f32> = if c.planes {
        (0..e.out_len).map(|k| widen(c.out, &out, k)).collect()
    } else {
        let rs = e.step.out.row_stride;
        for r in 0..c.rows.saturating_sub(1) {
            let pad = (r * rs + n) * oe..(r + 1) * rs * oe;
            assert!(
                out[pad.clone()] == e.init_out[pad],
                "{}: output row padding changed",
                c.name
            );
        }
        (0..c.rows * n)
            .map(|k| widen(c.out, &out, (k / n) * rs + k % n))
            .collect()
    };
    Result3 {
        y: bits(&y),
        state,
        hist,
    }
}

fn seq(slot: i32, start: usize, len: usize, commit: Commit) -> Seq {
    Seq {
        slot,
        start,
        len,
        commit,
    }
}

fn base(name: &'static str) -> Case {
    Case {
        name,
        shape: Shape::SEED,
        head_map: HeadMap::Tiled,
        state: PoolOptions::default(),
        io: DType::F32,
        out: DType::F32,
        conv: DType::F32,
        conv_kind: ConvKind::Packed3,
        state_pad: 0,
        row_pad: 0,
        cu_seqlens: false,
        lengths_only: false,
        commit_none: false,
        planes: false,
        slots: 8,
        // row 0 and rows 11.. belong to no sequence; slot 5 is skipped; slots 1, 6, 7 untouched
        seqs: vec![
            seq(4, 1, 3, Commit::All),
            seq(0, 4, 1, Commit::All),
            seq(2, 5, 4, Commit::First(2)),
            seq(-1, 9, 1, Commit::All),
            seq(3, 10, 2, Commit::Verify),
        ],
        rows: 13,
        uniform: false,
        bf16_hist: false,
        max_len: None,
    }
}

/// Windows long enough for the chunked path (the default threshold, 64) beside short ones, with the base case's
/// mix of commits: a commit point inside a chunk, one below the threshold (that window stays token-serial), a
/// verify, a skipped slot; one row between sequences (cu_seqlens and lengths alone make them adjacent).
fn long(mut c: Case) -> Case {
    let spec = [
        (4, 150, Commit::All),
        (0, 1, Commit::All),
        (2, 130, Commit::First(100)),
        (3, 70, Commit::Verify),
        (-1, 80, Commit::All),
        (5, 65, Commit::First(10)),
        (6, 64, Commit::First(64)),
    ];
    let mut at = 1;
    c.seqs = spec
        .iter()
        .map(|&(slot, len, commit)| {
            let q = seq(slot, at, len, commit);
            at += len + 1;
            q
        })
        .collect();
    c.rows = at + 2;
    c
}

/// Every sequence commits its whole window
fn all_commit(mut c: Case) -> Case {
    for q in &mut c.seqs {
        q.commit = Commit::All;
    }
    c
}

/// Lengths alone: adjacent sequences from row 0
fn packed(c: Case) -> Case {
    let mut c = adjacent(c);
    for q in &mut c.seqs {
        q.start -= 2;
    }
    c.rows -= 2;
    c.lengths_only = true;
    c
}

/// cu_seqlens needs adjacent sequences
fn adjacent(mut c: Case) -> Case {
    let mut at = 2;
    for q in &mut c.seqs {
        q.start = at;
        at += q.len;
    }
    c.rows = at + 1;
    c.cu_seqlens = true;
    c
}

fn decode(mut c: Case, b: usize) -> Case {
    c.seqs = (0..b)
        .map(|i| {
            let commit = if i % 5 == 3 {
                Commit::Verify
            } else {
                Commit::All
            };
            seq(if i % 7 == 6 { -1 } else { i as i32 }, i, 1, commit)
        })
        .collect();
    c.rows = b;
    c.slots = b + 2;
    c.uniform = true;
    c
}

fn cases() -> Vec<Case> {
    let bf16_vm = PoolOptions {
        state: DType::Bf16,
        layout: StateLayout::ValueMajor,
    };
    let mut v = vec![
        base("f32 state, key-major, packed f32 conv, start/len, mixed commits"),
        Case {
            state: PoolOptions {
                state: DType::Bf16,
                layout: StateLayout::KeyMajor,
            },
            io: DType::Bf16,
            conv_kind: ConvKind::Hf4,
            row_pad: 8,
            ..adjacent(base(
                "bf16 state, bf16 io, HF [C][4] conv, strided rows, cu_seqlens",
            ))
        },
        Case {
            state: PoolOptions {
                state: DType::F32,
                layout: StateLayout::ValueMajor,
            },
            io: DType::F16,
            out: DType::Bf16,
            conv_kind: ConvKind::VllmT,
            state_pad: 64,
            row_pad: 3,
            head_map: HeadMap::Grouped,
            ..base("value-major strided pool, vLLM transposed conv, f16 io, grouped heads")
        },
        Case {
            state: bf16_vm,
            planes: true,
            state_pad: 8,
            ..base("bf16 value-major, planes")
        },
        Case {
            commit_none: true,
            conv_kind: ConvKind::VllmT,
            ..adjacent(all_commit(base("commit_at None, cu_seqlens, vLLM conv")))
        },
        Case {
            conv_kind: ConvKind::VllmT,
            io: DType::Bf16,
            ..packed(base(
                "lengths alone (rows packed from 0), mixed commits, vLLM conv",
            ))
        },
        Case {
            seqs: base("")
                .seqs
                .into_iter()
                .map(|q| Seq {
                    commit: Commit::Verify,
                    ..q
                })
                .collect(),
            ..base("verify only (the verify kernel): nothing written")
        },
        // decode: the const-length kernel; a bf16 state at 8 x 48 blocks is staged
        Case {
            state: bf16_vm,
            io: DType::Bf16,
            conv_kind: ConvKind::Hf4,
            row_pad: 16,
            ..decode(base("decode B 8, bf16 value-major (staged), HF conv"), 8)
        },
        Case {
            conv_kind: ConvKind::VllmT,
            ..decode(base("decode B 3, f32 key-major, vLLM conv"), 3)
        },
        // one wave of T 1 blocks: a key head's readers form a cluster (tiled above, grouped here)
        Case {
            head_map: HeadMap::Grouped,
            io: DType::Bf16,
            ..decode(base("decode B 4, f32 key-major, grouped heads, bf16 io"), 4)
        },
        // d 256: two blocks a head (a cluster), so 2 x h_v / h_k readers of a key head's history
        Case {
            shape: Shape::new(256, 2, 4).unwrap(),
            conv_kind: ConvKind::Hf4,
            row_pad: 4,
            state_pad: 16,
            ..base("d 256 (clusters of 2), HF conv, strided")
        },
        Case {
            shape: Shape::new(32, 2, 4).unwrap(),
            head_map: HeadMap::Grouped,
            state: bf16_vm,
            ..adjacent(base("d 32, bf16 value-major, cu_seqlens"))
        },
        // long windows: the chunked kernels on engine memory
        long(base(
            "long windows, f32 key-major, packed conv, start/len, mixed commits",
        )),
        Case {
            state: PoolOptions {
                state: DType::Bf16,
                layout: StateLayout::KeyMajor,
            },
            io: DType::Bf16,
            conv_kind: ConvKind::Hf4,
            row_pad: 8,
            state_pad: 8,
            ..adjacent(long(base(
                "long windows, bf16 state, bf16 io, HF conv, strided rows, cu_seqlens",
            )))
        },
        Case {
            state: PoolOptions {
                state: DType::F32,
                layout: StateLayout::ValueMajor,
            },
            io: DType::F16,
            out: DType::Bf16,
            conv_kind: ConvKind::VllmT,
            head_map: HeadMap::Grouped,
            ..packed(long(base(
                "long windows, lengths alone, value-major, vLLM conv, f16 io, grouped heads",
            )))
        },
        Case {
            state: bf16_vm,
            planes: true,
            ..long(base("long windows, bf16 value-major, planes"))
        },
        Case {
            commit_none: true,
            conv_kind: ConvKind::VllmT,
            ..adjacent(all_commit(long(base(
                "long windows, commit_at None, cu_seqlens, vLLM conv",
            ))))
        },
        Case {
            seqs: long(base(""))
                .seqs
                .into_iter()
                .map(|q| Seq {
                    commit: Commit::Verify,
                    ..q
                })
                .collect(),
            ..long(base("long windows, verify only: nothing written"))
        },
        Case {
            shape: Shape::new(256, 2, 4).unwrap(),
            conv_kind: ConvKind::Hf4,
            row_pad: 4,
            ..long(base("long windows, d 256 (chunks of 32)"))
        },
        Case {
            shape: Shape::new(32, 2, 4).unwrap(),
            head_map: HeadMap::Grouped,
            state: bf16_vm,
            ..packed(long(base("long windows, d 32, lengths alone")))
        },
        // rows past the threshold, every window short: the chunked path finds nothing (or, with the hint, is
        // not launched)
        Case {
            uniform: false,
            conv_kind: ConvKind::VllmT,
            ..adjacent(decode(base("decode B 70 with cu_seqlens, no hint"), 70))
        },
        Case {
            uniform: false,
            max_len: Some(1),
            conv_kind: ConvKind::VllmT,
            ..adjacent(decode(base("decode B 70 with cu_seqlens, max_len 1"), 70))
        },
    ];
    for c in &mut v {
        if c.name.is_empty() {
            c.name = "?";
        }
    }
    v
}

fn run_case(cuda: &Cuda, s: &Arc<CudaStream>, c: &Case, seed: u64) -> (Result3, Result3) {
    let inp = inputs(c, seed);
    let reference = pool_run(cuda, c, &inp);
    let layer = CudaLayer::new(cuda, &inp.layer, c.seqs.len().max(1)).unwrap();
    let e = engine(s, c, &inp);
    layer.prepare(&e.step.kind()).unwrap();
    // SAFETY: every address in the step is a live allocation of this context on `s`, sized by `engine` for
    // the extents the step names; `s` is a stream of this context.
    unsafe { layer.step_raw(&e.step, s.cu_stream()) }
        .unwrap_or_else(|err| panic!("{}: {err}", c.name));
    s.synchronize().unwrap();
    layer.take_fault().unwrap();
    (reference, read_engine(s, c, &e))
}

fn assert_same(c: &Case, a: &Result3, b: &Result3) {
    assert!(a.y == b.y, "{}: y differs", c.name);
    for i in 0..a.state.len() {
        assert!(
            a.state[i] == b.state[i],
            "{}: state of slot {i} differs",
            c.name
        );
        assert!(
            a.hist[i] == b.hist[i],
            "{}: history of slot {i} differs",
            c.name
        );
    }
}

/// Every case on a stream of the caller's (not the backend's own): the same bits as the pool's step.
#[test]
fn external_step_matches_the_pool_bitwise() {
    let Some(cuda) = cuda_or_skip("external_step_matches_the_pool_bitwise") else {
        return;
    };
    let s = cuda.context().new_stream().unwrap();
    for (k, c) in cases().iter().enumerate() {
        let (reference, ext) = run_case(&cuda, &s, c, 100 + k as u64);
        assert_same(c, &reference, &ext);
        eprintln!("ok: {}", c.name);
    }
}

/// A bf16 conv state with bf16 inputs (every history value is then a bf16 value) gives the bits of the f32
/// conv state: y, the state, and the history widened.
#[test]
fn bf16_conv_state_with_bf16_inputs_equals_the_f32_conv_state() {
    let Some(cuda) = cuda_or_skip("bf16_conv_state_with_bf16_inputs_equals_the_f32_conv_state")
    else {
        return;
    };
    let s = cuda.context().new_stream().unwrap();
    for kind in [ConvKind::Packed3, ConvKind::Hf4, ConvKind::VllmT] {
        let f32c = Case {
            io: DType::Bf16,
            conv_kind: kind,
            bf16_hist: true,
            ..base("bf16 inputs, f32 conv")
        };
        let bf16c = Case {
            conv: DType::Bf16,
            name: "bf16 inputs, bf16 conv",
            ..f32c.clone()
        };
        let (reference, a) = run_case(&cuda, &s, &f32c, 7);
        let (_, b) = run_case(&cuda, &s, &bf16c, 7);
        assert_same(&f32c, &reference, &a);
        assert_same(&bf16c, &a, &b);
        // an f16 conv state holds bf16 values of this range exactly too? Not in general: not asserted
    }
}

/// One decode step captured into a CUDA graph on the caller's stream and replayed equals as many pool steps:
/// the last-reader counters come back to zero after every replay (6 sequences, 3 replays, a bf16 value-major
/// state; and 64 sequences, 10 replays, where many blocks of one key head run at once), and a call of one wave
/// (2 sequences) orders its history through the readers' cluster.
#[test]
fn graph_replays_of_the_external_step_equal_repeated_steps() {
    let Some(cuda) = cuda_or_skip("graph_replays_of_the_external_step_equal_repeated_steps") else {
        return;
    };
    let s = cuda.context().new_stream().unwrap();
    let c = Case {
        conv_kind: ConvKind::VllmT,
        state: PoolOptions {
            state: DType::Bf16,
            layout: StateLayout::ValueMajor,
        },
        ..decode(base("graph, B 6"), 6)
    };
    graph_case(&cuda, &s, &c, 3, true);
    // one wave: the readers' cluster instead of the counters
    graph_case(&cuda, &s, &decode(base("graph, B 2"), 2), 3, true);
    let c = Case {
        conv_kind: ConvKind::Hf4,
        ..decode(base("graph, B 64"), 64)
    };
    graph_case(&cuda, &s, &c, 10, true);
    // long windows: chunked in the graph when the scratch was reserved before the capture, token after token
    // when it was not
    let c = Case {
        conv_kind: ConvKind::VllmT,
        ..adjacent(all_commit(long(base("graph, long windows, reserved"))))
    };
    graph_case(&cuda, &s, &c, 3, true);
    let c = Case {
        name: "graph, long windows, not reserved: token-serial",
        ..c
    };
    graph_case(&cuda, &s, &c, 2, false);
}

/// `replays` steps of the pool against as many replays of one captured external step; `reserve`: the chunked
/// path's scratch reserved before the capture (else the pool runs every window token after token too).
fn graph_case(cuda: &Cuda, s: &Arc<CudaStream>, c: &Case, replays: usize, reserve: bool) {
    let inp = inputs(c, 3);
    // the pool, three steps on the same rows
    let sh = c.shape;
    let mut p = cuda.create_cuda_pool(&inp.layer, c.slots, c.state).unwrap();
    if !reserve {
        p.set_chunk_min_len(Some(usize::MAX));
    }
    for (i, (st, h)) in inp.init.iter().enumerate() {
        p.write_slot(i, st, h).unwrap();
    }
    let mut out = TensorData::filled(c.rows * sh.n(), 0.0, c.out);
    for _ in 0..replays {
        let step = Step {
            rows: inp.rows.view(),
            seqs: &c.seqs,
            plane_stride: None,
        };
        p.step_varlen(&step, out.view_mut()).unwrap();
    }
    let (mut state, mut hist) = (Vec::new(), Vec::new());
    for i in 0..c.slots {
        let (mut st, mut h) = (vec![0.0; sh.state_len()], vec![0.0; sh.hist_len()]);
        p.read_slot(i, &mut st, &mut h).unwrap();
        state.push(bits(&st));
        hist.push(bits(&h));
    }
    let reference = Result3 {
        y: bits(&out.to_f32()),
        state,
        hist,
    };
    let mut own = cuda.clone();
    if !reserve {
        // a backend of its own: its scratch never allocated
        own = Cuda::new().unwrap();
        own.set_window_kernel(false);
    }
    let layer = CudaLayer::new(&own, &inp.layer, 64).unwrap();
    let e = engine(s, c, &inp);
    layer.prepare(&e.step.kind()).unwrap();
    if reserve {
        layer
            .reserve_chunk(&e.step.kind(), c.rows, c.seqs.len())
            .unwrap();
    }
    s.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .unwrap();
    // SAFETY: as in `run_case`
    let r = unsafe { layer.step_raw(&e.step, s.cu_stream()) };
    let graph = s.end_capture(sys::CUgraphInstantiate_flags(0)).unwrap();
    r.unwrap();
    let graph = graph.expect("a graph");
    for _ in 0..replays {
        graph.launch().unwrap();
    }
    s.synchronize().unwrap();
    layer.take_fault().unwrap();
    let ext = read_engine(s, c, &e);
    assert_same(c, &reference, &ext);
    eprintln!("ok: {}", c.name);
}

/// Bad host-visible arguments are named errors and touch nothing; bad per-sequence entries are skipped on the
/// device and reported by take_fault; a stream is checked.
#[test]
fn bad_external_arguments_are_named_errors() {
    let Some(cuda) = cuda_or_skip("bad_external_arguments_are_named_errors") else {
        return;
    };
    let s = cuda.context().new_stream().unwrap();
    let c = base("bad");
    let inp = inputs(&c, 5);
    let layer = CudaLayer::new(&cuda, &inp.layer, 8).unwrap();
    assert!(matches!(
        CudaLayer::new(&cuda, &inp.layer, 0),
        Err(gdn::Error::Param {
            name: "max_seqs",
            ..
        })
    ));
    let e = engine(&s, &c, &inp);
    let good = e.step;
    let sh = c.shape;
    type Edit<'a> = Box<dyn Fn(&mut RawStep) + 'a>;
    let cases: Vec<(&str, Edit<'_>)> = vec![
        ("qkv", Box::new(|t| t.qkv.row_stride = sh.channels() - 1)),
        ("qkv", Box::new(|t| t.qkv.ptr = 0)),
        ("alpha", Box::new(|t| t.alpha.ptr += 1)),
        ("z", Box::new(|t| t.z.row_stride = 1)),
        ("out", Box::new(|t| t.out.row_stride = 3)),
        (
            "out",
            Box::new(|t| {
                t.plane_stride = Some(t.rows * sh.n() + 32);
                t.out.row_stride = sh.n() + 1;
            }),
        ),
        ("state.slot_stride", Box::new(|t| t.state.slot_stride -= 4)),
        ("state.slot_stride", Box::new(|t| t.state.slot_stride += 1)),
        ("state.slots", Box::new(|t| t.state.slots = 0)),
        ("state", Box::new(|t| t.state.ptr += 4)),
        ("conv.width", Box::new(|t| t.conv.width = 2)),
        ("conv", Box::new(|t| t.conv.chan_stride = 2)),
        ("conv", Box::new(|t| t.conv.col_stride = 0)),
        ("conv.slot_stride", Box::new(|t| t.conv.slot_stride = 5)),
        ("seqs", Box::new(|t| t.seqs = 9)),
        ("slot", Box::new(|t| t.slot = 0)),
        ("commit_at", Box::new(|t| t.commit_at = Some(2))),
        (
            "commits",
            Box::new(|t| {
                t.commit_at = None;
                t.commits = false;
            }),
        ),
        ("rows", Box::new(|t| t.rows = usize::MAX)),
        ("qkv", Box::new(|t| t.qkv.row_stride = usize::MAX / 2)),
    ];
    for (name, edit) in &cases {
        let mut bad = good;
        edit(&mut bad);
        // SAFETY: the step is rejected before anything is launched (asserted); the good parts are as in
        // `run_case`
        match unsafe { layer.step_raw(&bad, s.cu_stream()) } {
            Err(gdn::Error::Param { name: got, why }) => {
                assert_eq!(got, *name, "{bad:?}: {why}")
            }
            other => panic!("{name}: expected a named error, got {other:?}"),
        }
    }
    let mut bad = good;
    bad.state.dtype = DType::F16;
    // SAFETY: rejected before launch
    assert!(matches!(
        unsafe { layer.step_raw(&bad, s.cu_stream()) },
        Err(gdn::Error::Unsupported(_))
    ));
    let mut bad = good;
    bad.uniform_len = Some(0);
    // SAFETY: rejected before launch
    assert!(matches!(
        unsafe { layer.step_raw(&bad, s.cu_stream()) },
        Err(gdn::Error::EmptyWindow)
    ));
    s.synchronize().unwrap();
    assert!(
        down(&s, &e.state) == e.init_state,
        "a rejected step wrote the state"
    );
    assert!(
        down(&s, &e.conv) == e.init_conv,
        "a rejected step wrote the conv state"
    );
    assert!(
        down(&s, &e.out) == e.init_out,
        "a rejected step wrote the output"
    );
    // the null stream resolves to this context (bound by the call): accepted; a wrong uniform length is
    // skipped on the device and reported
    let mut skip = good;
    skip.uniform_len = Some(2);
    // SAFETY: as in `run_case`; the null stream is this context's legacy default stream
    unsafe { layer.step_raw(&skip, std::ptr::null_mut()) }.unwrap();
    let err = layer.take_fault().unwrap_err();
    assert!(err.to_string().contains("length"), "{err}");
    layer.take_fault().unwrap();
    assert!(
        down(&s, &e.state) == e.init_state,
        "skipped sequences wrote the state"
    );
    assert!(
        down(&s, &e.conv) == e.init_conv,
        "skipped sequences wrote the conv state"
    );
    // a slot past the pool: skipped, reported
    let slots_small = RawStep {
        state: RawState {
            slots: 3,
            ..good.state
        },
        ..good
    };
    // SAFETY: as in `run_case` (a smaller pool than allocated)
    unsafe { layer.step_raw(&slots_small, s.cu_stream()) }.unwrap();
    let err = layer.take_fault().unwrap_err();
    assert!(err.to_string().contains("slot past the pool"), "{err}");
}
