//! The step on memory the caller owns (`CudaLayer::step_raw`) against the pool's step at the seed shape: device
//! time per call (a CUDA graph of 20 steps replayed 10 times, events, median of 7, as the pool's
//! `time_varlen`) and the host cost of one `step_raw` call (50 calls issued without waiting), decode, verify and
//! prefill lengths (the chunked path from 64 tokens), then decode batches given by cu_seqlens with each length hint
//! (`external_bench hints`: those alone; `external_bench decode`: the decode and verify lengths alone). Device
//! runs only.
//!
//! `external_bench spec [B,B,..] [W,W,..]` (default 64,256 and 4,8): the speculative step on engine memory, as
//! `spec_bench` times it on a pool. The one-pass step (`CudaLayer::step_spec_raw`: accept a random prefix of each
//! slot's held window of W tokens, hold the next W) beside the two-pass flow on the same kind of engine buffers
//! (`step_raw`: a k-token commit of the accepted prefix of the previous window's rows, sequences accepting
//! nothing left out, then the verify of the new window, commit point 0 with the verify-only kernel, as
//! `gdn::spec::TwoPass` does on a pool). Each flow is a CUDA graph of 20 consecutive speculative steps, each with
//! its own accepted counts (uniform in 0..=W per sequence, seeded; every slot holds W tokens before each step, so
//! any count is valid and the replays are steady state), replayed as above; `verify` and `commit k` are those
//! calls alone in graphs of 20 (`spec_bench`'s columns), `two-pass` the graph of both in turn, `speed-up`
//! two-pass over one-pass. States f32 key-major (f32 io, f32 `[C][3]` conv) and bf16 value-major (bf16 io,
//! bf16 vLLM-view conv), the engine cases above. Before timing, the 20 steps run once uncaptured on both flows
//! (after a first held window) and the states, histories and last outputs are compared bitwise.

use std::sync::Arc;
use std::time::Instant;

use gdn::synth::Synth;
use gdn::{Commit, Config, DType, LayerPool, PoolOptions, RowsData, Seq, Shape, StateLayout, Step};
use gdn_cuda::cudarc::driver::{sys, CudaSlice, CudaStream, DevicePtr};
use gdn_cuda::pool::MAX_HELD;
use gdn_cuda::{
    pending_bytes, Cuda, CudaLayer, RawConv, RawSpec, RawState, RawStep, RawTensor, SeqRows,
};

fn bytes(t: &gdn::TensorData) -> Vec<u8> {
    match t {
        gdn::TensorData::F32(x) => x.iter().flat_map(|v| v.to_le_bytes()).collect(),
        gdn::TensorData::Bf16(x) => x.iter().flat_map(|v| v.to_bits().to_le_bytes()).collect(),
        gdn::TensorData::F16(x) => x.iter().flat_map(|v| v.to_bits().to_le_bytes()).collect(),
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// The engine's conv state of `c` channels and 3 columns a slot: `[slot][C][3]`, or vLLM's `[slot][3][C]` seen
/// through its strides.
fn conv_view(ptr: u64, dtype: DType, c: usize, vllm: bool) -> RawConv {
    RawConv {
        ptr,
        dtype,
        width: 3,
        slot_stride: 3 * c,
        chan_stride: if vllm { 1 } else { 3 },
        col_stride: if vllm { c } else { 1 },
    }
}

/// Device µs per step: `per_graph` steps (`one(i)` issues step i on `s`) captured into a CUDA graph, replayed once,
/// then 10 times between two events, median of 7 rounds (as the pool's `time_varlen`).
fn time_graph(
    cuda: &Cuda,
    s: &Arc<CudaStream>,
    per_graph: usize,
    one: &mut dyn FnMut(usize) -> gdn::Result<()>,
) -> gdn::Result<f64> {
    let drv = |e| gdn::Error::Backend(format!("{e:?}"));
    s.synchronize().map_err(drv)?;
    s.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(drv)?;
    let mut captured = Ok(());
    for i in 0..per_graph {
        captured = one(i);
        if captured.is_err() {
            break;
        }
    }
    let graph = s.end_capture(sys::CUgraphInstantiate_flags(0));
    captured?;
    let graph = graph
        .map_err(drv)?
        .ok_or_else(|| gdn::Error::Backend("no graph".into()))?;
    graph.launch().map_err(drv)?;
    s.synchronize().map_err(drv)?;
    let ctx = cuda.context();
    // timing events (cudarc's default flags disable timing)
    let ev = || {
        ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(drv)
    };
    let (e0, e1) = (ev()?, ev()?);
    let replays = 10;
    let mut times = Vec::new();
    for _ in 0..7 {
        e0.record(s).map_err(drv)?;
        for _ in 0..replays {
            graph.launch().map_err(drv)?;
        }
        e1.record(s).map_err(drv)?;
        e1.synchronize().map_err(drv)?;
        times.push(e0.elapsed_ms(&e1).map_err(drv)? as f64 * 1e3 / (replays * per_graph) as f64);
    }
    Ok(median(times))
}

struct Row {
    pool_us: f64,
    ext_us: f64,
    host_us: f64,
}

/// What the call tells the kernels of its lengths.
#[derive(Clone, Copy, PartialEq)]
enum Hint {
    /// `uniform_len` T (the tables above)
    Uniform,
    /// nothing: a call of at least 64 rows launches the chunked path, which finds no long window
    Nothing,
    /// `max_len` T
    MaxLen,
}

#[allow(clippy::too_many_arguments)]
fn case(
    cuda: &Cuda,
    s: &Arc<CudaStream>,
    state: PoolOptions,
    io: DType,
    conv_dt: DType,
    vllm_conv: bool,
    (b, t): (usize, usize),
    hint: Hint,
) -> gdn::Result<Row> {
    let drv = |e| gdn::Error::Backend(format!("{e:?}"));
    let sh = Shape::SEED;
    let mut rng = Synth::new(9);
    let layer = rng.layer(Config::new(sh))?;
    let rows = b * t;
    let batch = rng.batch(&layer, rows, 1);
    let data = RowsData::from_f32(&batch.qkv, &batch.alpha, &batch.beta, &batch.z, [io; 4]);
    let seqs: Vec<Seq> = (0..b)
        .map(|i| Seq {
            slot: i as i32,
            start: i * t,
            len: t,
            commit: Commit::All,
        })
        .collect();
    let mut pool = cuda.create_cuda_pool(&layer, b, state)?;
    let step = Step {
        rows: data.view(),
        seqs: &seqs,
        plane_stride: None,
    };
    let pool_us = pool.time_varlen(&step, io, 20)?.per_call.as_secs_f64() * 1e6;

    let up = |v: &[u8]| s.clone_htod(v).map_err(drv);
    let addr = |x: &CudaSlice<u8>| x.device_ptr(s).0;
    let c = sh.channels();
    let keep = [
        up(&bytes(&data.qkv))?,
        up(&bytes(&data.alpha))?,
        up(&bytes(&data.beta))?,
        up(&bytes(&data.z))?,
        s.alloc_zeros::<u8>(rows * sh.n() * io.size())
            .map_err(drv)?,
        s.alloc_zeros::<u8>(b * sh.state_len() * state.state.size())
            .map_err(drv)?,
        s.alloc_zeros::<u8>(b * c * 3 * conv_dt.size())
            .map_err(drv)?,
        up(&(0..b as i32)
            .flat_map(|i| i.to_le_bytes())
            .collect::<Vec<u8>>())?,
        up(&(0..=b as i32)
            .flat_map(|i| (i * t as i32).to_le_bytes())
            .collect::<Vec<u8>>())?,
    ];
    let tensor = |i: usize, w: usize| RawTensor {
        ptr: addr(&keep[i]),
        dtype: io,
        row_stride: w,
    };
    let raw = RawStep {
        rows,
        qkv: tensor(0, c),
        alpha: tensor(1, sh.h_v),
        beta: tensor(2, sh.h_v),
        z: tensor(3, sh.n()),
        out: tensor(4, sh.n()),
        plane_stride: None,
        state: RawState {
            ptr: addr(&keep[5]),
            dtype: state.state,
            layout: state.layout,
            slots: b,
            slot_stride: sh.state_len(),
        },
        conv: conv_view(addr(&keep[6]), conv_dt, c, vllm_conv),
        seqs: b,
        slot: addr(&keep[7]),
        seq_rows: SeqRows::CuSeqlens(addr(&keep[8])),
        commit_at: None,
        uniform_len: (hint == Hint::Uniform).then_some(t),
        commits: true,
        max_len: (hint == Hint::MaxLen).then_some(t),
    };
    let ext = CudaLayer::new(cuda, &layer, b)?;
    ext.prepare(&raw.kind())?;
    let cs = s.cu_stream();
    // SAFETY: every address is a live allocation above of the extents the step names, on `s` of this context
    let one = || unsafe { ext.step_raw(&raw, cs) };
    for _ in 0..3 {
        one()?;
    }
    s.synchronize().map_err(drv)?;
    let n_host = 50;
    let t0 = Instant::now();
    for _ in 0..n_host {
        one()?;
    }
    let host_us = t0.elapsed().as_secs_f64() * 1e6 / n_host as f64;
    s.synchronize().map_err(drv)?;
    let ext_us = time_graph(cuda, s, 20, &mut |_| one())?;
    ext.take_fault()?;
    Ok(Row {
        pool_us,
        ext_us,
        host_us,
    })
}

/// The engine cases: state, io, conv dtype, vLLM's conv view, and their name in the tables.
fn engine_cases() -> [(PoolOptions, DType, DType, bool, &'static str); 2] {
    let f32km = PoolOptions::default();
    let bf16vm = PoolOptions {
        state: DType::Bf16,
        layout: StateLayout::ValueMajor,
    };
    [
        (
            f32km,
            DType::F32,
            DType::F32,
            false,
            "f32 key-major | f32, f32 [C][3]",
        ),
        (
            bf16vm,
            DType::Bf16,
            DType::Bf16,
            true,
            "bf16 value-major | bf16, bf16 vLLM view",
        ),
    ]
}

/// Device µs per speculative step of each flow of `external_bench spec` (see the module's comment).
struct SpecRow {
    one_pass: f64,
    verify: f64,
    commit: f64,
    two_pass: f64,
    /// the uncaptured run's states, histories and last outputs are the same bits in both flows
    bitwise: bool,
}

/// One case of `external_bench spec`: B sequences on slots 0..B, windows of W tokens.
#[allow(clippy::too_many_arguments)]
fn spec_case(
    cuda: &Cuda,
    s: &Arc<CudaStream>,
    state: PoolOptions,
    io: DType,
    conv_dt: DType,
    vllm_conv: bool,
    (b, w): (usize, usize),
) -> gdn::Result<SpecRow> {
    let drv = |e| gdn::Error::Backend(format!("{e:?}"));
    if !(1..=MAX_HELD).contains(&w) || b == 0 {
        return Err(gdn::Error::Param {
            name: "B, W",
            why: format!("B {b}, W {w}: B at least 1, held windows of 1..={MAX_HELD} tokens"),
        });
    }
    let sh = Shape::SEED;
    let (c, n) = (sh.channels(), sh.n());
    let mut rng = Synth::new(15);
    let layer = rng.layer(Config::new(sh))?;
    let rows = b * w;
    // one set of rows for every window (as spec_bench's pool steps): sequence i has rows i W .. + W
    let batch = rng.batch(&layer, rows, 1);
    let data = RowsData::from_f32(&batch.qkv, &batch.alpha, &batch.beta, &batch.z, [io; 4]);
    // random states and histories (independent values, so their layout does not matter), a few distinct ones
    // repeated over the slots; both flows start from the same bytes
    let (mut states, mut hists) = (Vec::new(), Vec::new());
    for _ in 0..b.min(8) {
        let (st, h) = rng.seq_state(&layer);
        states.push(bytes(&gdn::TensorData::from_f32(&st, state.state)));
        hists.push(bytes(&gdn::TensorData::from_f32(&h, conv_dt)));
    }
    let tile = |parts: &[Vec<u8>]| -> Vec<u8> {
        (0..b)
            .flat_map(|i| parts[i % parts.len()].iter().copied())
            .collect()
    };
    let (init_state, init_conv) = (tile(&states), tile(&hists));
    // the graphs' steps, each with its own accepted counts (spec_bench's draw: uniform in 0..=W)
    let per_graph = 20;
    let draws: Vec<Vec<i32>> = (0..per_graph)
        .map(|_| {
            rng.uniform(b, 0.0, (w + 1) as f32)
                .iter()
                .map(|&x| (x as usize).min(w) as i32)
                .collect()
        })
        .collect();

    let up = |v: &[u8]| s.clone_htod(v).map_err(drv);
    // i32 arrays (an empty one still gets a buffer to point at)
    let ints = |v: &[i32]| {
        let mut x: Vec<u8> = v.iter().flat_map(|i| i.to_le_bytes()).collect();
        if x.is_empty() {
            x = vec![0; 4];
        }
        up(&x)
    };
    let addr = |x: &CudaSlice<u8>| x.device_ptr(s).0;
    let (qkv, alpha, beta, z) = (
        up(&bytes(&data.qkv))?,
        up(&bytes(&data.alpha))?,
        up(&bytes(&data.beta))?,
        up(&bytes(&data.z))?,
    );
    // [0]: the one-pass flow's engine buffers, [1]: the two-pass flow's
    let out = [
        s.alloc_zeros::<u8>(rows * n * io.size()).map_err(drv)?,
        s.alloc_zeros::<u8>(rows * n * io.size()).map_err(drv)?,
    ];
    let st = [up(&init_state)?, up(&init_state)?];
    let cv = [up(&init_conv)?, up(&init_conv)?];
    // the one-pass flow's pending region and held words: zeros, nothing held
    let pending = s.alloc_zeros::<u8>(pending_bytes(&sh, b)?).map_err(drv)?;
    let held = s.alloc_zeros::<u8>(4 * b).map_err(drv)?;
    let slot = ints(&(0..b as i32).collect::<Vec<_>>())?;
    let cu = ints(&(0..=b as i32).map(|i| i * w as i32).collect::<Vec<_>>())?;
    let hold_at = ints(&vec![0; b])?;
    let no_accept = ints(&vec![0; b])?;
    let lens = ints(&vec![w as i32; b])?;
    let accept = draws
        .iter()
        .map(|a| ints(a))
        .collect::<gdn::Result<Vec<_>>>()?;
    // the two-pass flow's k-token commits: per step the sequences that accept something (slot, first row,
    // accepted count), each on the rows of its previous window
    let live: Vec<Vec<usize>> = draws
        .iter()
        .map(|a| (0..b).filter(|&i| a[i] > 0).collect())
        .collect();
    let mut prefix = Vec::with_capacity(per_graph);
    for (a, l) in draws.iter().zip(&live) {
        prefix.push([
            ints(&l.iter().map(|&i| i as i32).collect::<Vec<_>>())?,
            ints(&l.iter().map(|&i| (i * w) as i32).collect::<Vec<_>>())?,
            ints(&l.iter().map(|&i| a[i]).collect::<Vec<_>>())?,
        ]);
    }

    let tensor = |x: &CudaSlice<u8>, width: usize| RawTensor {
        ptr: addr(x),
        dtype: io,
        row_stride: width,
    };
    // every sequence's window on flow e's buffers, held (commit point 0)
    let window = |e: usize| RawStep {
        rows,
        qkv: tensor(&qkv, c),
        alpha: tensor(&alpha, sh.h_v),
        beta: tensor(&beta, sh.h_v),
        z: tensor(&z, n),
        out: tensor(&out[e], n),
        plane_stride: None,
        state: RawState {
            ptr: addr(&st[e]),
            dtype: state.state,
            layout: state.layout,
            slots: b,
            slot_stride: sh.state_len(),
        },
        conv: conv_view(addr(&cv[e]), conv_dt, c, vllm_conv),
        seqs: b,
        slot: addr(&slot),
        seq_rows: SeqRows::CuSeqlens(addr(&cu)),
        commit_at: Some(addr(&hold_at)),
        uniform_len: Some(w),
        commits: true,
        max_len: None,
    };
    let spec_step = window(0);
    let spec = |acc: &CudaSlice<u8>| RawSpec {
        pending: addr(&pending),
        held: addr(&held),
        accept: addr(acc),
    };
    // the verify-only kernel, as the pool's step of verify windows (and TwoPass's) runs
    let verify = RawStep {
        commits: false,
        ..window(1)
    };
    let commits: Vec<Option<RawStep>> = prefix
        .iter()
        .zip(&live)
        .map(|(p, l)| {
            (!l.is_empty()).then(|| RawStep {
                seqs: l.len(),
                slot: addr(&p[0]),
                seq_rows: SeqRows::StartLen {
                    start: addr(&p[1]),
                    len: addr(&lens),
                },
                commit_at: Some(addr(&p[2])),
                ..window(1)
            })
        })
        .collect();
    let ext = CudaLayer::new(cuda, &layer, b)?;
    ext.check_spec(&spec_step, &spec(&no_accept))?;
    ext.prepare(&spec_step.spec_kind())?;
    ext.prepare(&verify.kind())?;
    for step in commits.iter().flatten() {
        ext.prepare(&step.kind())?;
    }
    let cs = s.cu_stream();
    // SAFETY (the three closures): every address is a live allocation above, on `s` of this context, of the
    // extents the steps name (B W rows of the io dtype, B slots of state and of 3 C conv elements, pending_bytes(B)
    // and B held words, B-entry i32 arrays, B + 1 for cu_seqlens); each call names distinct slots (0..B or a subset);
    // what a step writes (its flow's output, state, conv state, pending region and held words) is its own
    // allocation, which nothing else writes meanwhile; every call goes to `s` in order, so this layer's steps
    // run one at a time; the pending region and held words are written only by the speculative steps.
    let one_pass = |acc: &CudaSlice<u8>| unsafe { ext.step_spec_raw(&spec_step, &spec(acc), cs) };
    // SAFETY: as above.
    let two_verify = || unsafe { ext.step_raw(&verify, cs) };
    let two_commit = |i: usize| match &commits[i] {
        // SAFETY: as above.
        Some(step) => unsafe { ext.step_raw(step, cs) },
        None => Ok(()),
    };
    // uncaptured first (every kernel compiled and loaded) and compared: the one-pass flow holds a first window,
    // then takes the 20 draws, accepting each from the window held before it; the two-pass flow verifies the
    // first window, then per draw commits the accepted prefixes and verifies the next window
    one_pass(&no_accept)?;
    two_verify()?;
    for (i, acc) in accept.iter().enumerate() {
        one_pass(acc)?;
        two_commit(i)?;
        two_verify()?;
    }
    ext.take_fault()?;
    let down = |x: &CudaSlice<u8>| -> gdn::Result<Vec<u8>> {
        let mut v = vec![0u8; x.len()];
        s.memcpy_dtoh(x, &mut v).map_err(drv)?;
        s.synchronize().map_err(drv)?;
        Ok(v)
    };
    let bitwise = down(&st[0])? == down(&st[1])?
        && down(&cv[0])? == down(&cv[1])?
        && down(&out[0])? == down(&out[1])?;
    // every slot now holds a window of W tokens, before each step of the one-pass graph too: its replays accept
    // the draws from windows of W
    let one = time_graph(cuda, s, per_graph, &mut |i| one_pass(&accept[i]))?;
    let verify_us = time_graph(cuda, s, per_graph, &mut |_| two_verify())?;
    let commit = if commits.iter().all(Option::is_none) {
        0.0
    } else {
        time_graph(cuda, s, per_graph, &mut |i| two_commit(i))?
    };
    let two = time_graph(cuda, s, per_graph, &mut |i| {
        two_commit(i)?;
        two_verify()
    })?;
    ext.take_fault()?;
    Ok(SpecRow {
        one_pass: one,
        verify: verify_us,
        commit,
        two_pass: two,
        bitwise,
    })
}

fn list(arg: Option<&String>, default: &[usize]) -> Vec<usize> {
    arg.map(|a| a.split(',').filter_map(|x| x.parse().ok()).collect())
        .unwrap_or_else(|| default.to_vec())
}

/// `external_bench spec [B,..] [W,..]`.
fn spec_main(cuda: &Cuda, s: &Arc<CudaStream>, args: &[String]) -> gdn::Result<()> {
    let batches = list(args.get(1), &[64, 256]);
    let windows = list(args.get(2), &[4, 8]);
    println!(
        "seed shape, engine memory; device µs per speculative step (CUDA graphs of 20 steps replayed 10 times, \
         events, median of 7); accepted counts uniform in 0..=W, seeded; f32: key-major state, f32 [C][3] conv; \
         bf16: value-major state, bf16 vLLM-view conv"
    );
    println!();
    println!("| state / io | B | W | one-pass | verify | commit k | two-pass | speed-up |");
    println!("|---|---|---|---|---|---|---|---|");
    for (st, io, conv, vllm, _) in engine_cases() {
        for &b in &batches {
            for &w in &windows {
                let r = spec_case(cuda, s, st, io, conv, vllm, (b, w))?;
                if !r.bitwise {
                    eprintln!(
                        "warning: {} / {} B {b} W {w}: the one-pass and two-pass flows' states, histories or \
                         outputs differ after the uncaptured steps",
                        st.state.name(),
                        io.name()
                    );
                }
                println!(
                    "| {} / {} | {b} | {w} | {:.1} | {:.1} | {:.1} | {:.1} | {:.2}x{} |",
                    st.state.name(),
                    io.name(),
                    r.one_pass,
                    r.verify,
                    r.commit,
                    r.two_pass,
                    r.two_pass / r.one_pass,
                    if r.bitwise { "" } else { " (bits differ)" }
                );
            }
        }
    }
    Ok(())
}

fn main() -> gdn::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let cuda = Cuda::new()?;
    let s = cuda
        .context()
        .new_stream()
        .map_err(|e| gdn::Error::Backend(format!("{e:?}")))?;
    if args.first().map(String::as_str) == Some("spec") {
        return spec_main(&cuda, &s, &args);
    }
    // `external_bench hints`: only the decode batches given by cu_seqlens, with each hint
    let hints_only = args.iter().any(|a| a == "hints");
    // `external_bench decode`: only the decode and verify-length cases (no prefill lengths, no hint table)
    let decode_only = args.iter().any(|a| a == "decode");
    println!("| state | io, conv | B | T | pool µs | external µs | external host µs a call |");
    println!("|---|---|---|---|---|---|---|");
    for (st, io, conv, vllm, what) in engine_cases() {
        // prefill lengths too: windows of 64 tokens or more take the chunked path on both
        for (b, t) in [
            (1, 1),
            (256, 1),
            (1, 8),
            (256, 8),
            (1, 512),
            (1, 8192),
            (4, 8192),
            (1, 32768),
        ] {
            if hints_only {
                break;
            }
            if decode_only && t > 8 {
                continue;
            }
            let r = case(&cuda, &s, st, io, conv, vllm, (b, t), Hint::Uniform)?;
            println!(
                "| {what} | {b} | {t} | {:.2} | {:.2} | {:.2} |",
                r.pool_us, r.ext_us, r.host_us
            );
        }
    }
    if decode_only {
        return Ok(());
    }
    // decode batches as vLLM passes them (cu_seqlens): the chunked path's fixed cost when nothing tells the
    // call that no window is long
    println!();
    println!("| state | io, conv | B | T | hint | external µs | external host µs a call |");
    println!("|---|---|---|---|---|---|---|");
    for (b, t) in [(64, 1), (256, 1), (64, 4)] {
        for (hint, name) in [
            (Hint::Uniform, "uniform_len"),
            (Hint::MaxLen, "max_len"),
            (Hint::Nothing, "none"),
        ] {
            let (st, io, conv, vllm, _) = engine_cases()[1];
            let r = case(&cuda, &s, st, io, conv, vllm, (b, t), hint)?;
            println!(
                "| bf16 value-major | bf16, bf16 vLLM view | {b} | {t} | {name} | {:.2} | {:.2} |",
                r.ext_us, r.host_us
            );
        }
    }
    Ok(())
}
