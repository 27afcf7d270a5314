//! The step on memory the caller owns (`CudaLayer::step_raw`) against the pool's step at the seed shape: device
//! time per call (a CUDA graph of 20 steps replayed 10 times, events, median of 7, as the pool's
//! `time_varlen`) and the host cost of one `step_raw` call (50 calls issued without waiting), decode, verify and
//! prefill lengths (the chunked path from 64 tokens), then decode batches given by cu_seqlens with each length hint
//! (`external_bench hints`: those alone). Device runs only.

use std::sync::Arc;
use std::time::Instant;

use gdn::synth::Synth;
use gdn::{Commit, Config, DType, LayerPool, PoolOptions, RowsData, Seq, Shape, StateLayout, Step};
use gdn_cuda::cudarc::driver::{sys, CudaSlice, CudaStream, DevicePtr};
use gdn_cuda::{Cuda, CudaLayer, RawConv, RawState, RawStep, RawTensor, SeqRows};

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
        conv: if vllm_conv {
            RawConv {
                ptr: addr(&keep[6]),
                dtype: conv_dt,
                width: 3,
                slot_stride: 3 * c,
                chan_stride: 1,
                col_stride: c,
            }
        } else {
            RawConv {
                ptr: addr(&keep[6]),
                dtype: conv_dt,
                width: 3,
                slot_stride: 3 * c,
                chan_stride: 3,
                col_stride: 1,
            }
        },
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
    let per_graph = 20;
    s.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(drv)?;
    let mut captured = Ok(());
    for _ in 0..per_graph {
        captured = one();
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
    ext.take_fault()?;
    Ok(Row {
        pool_us,
        ext_us: median(times),
        host_us,
    })
}

fn main() -> gdn::Result<()> {
    // `external_bench hints`: only the decode batches given by cu_seqlens, with each hint
    let hints_only = std::env::args().any(|a| a == "hints");
    let cuda = Cuda::new()?;
    let s = cuda
        .context()
        .new_stream()
        .map_err(|e| gdn::Error::Backend(format!("{e:?}")))?;
    println!("| state | io, conv | B | T | pool µs | external µs | external host µs a call |");
    println!("|---|---|---|---|---|---|---|");
    let f32km = PoolOptions::default();
    let bf16vm = PoolOptions {
        state: DType::Bf16,
        layout: StateLayout::ValueMajor,
    };
    for (st, io, conv, vllm, what) in [
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
    ] {
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
            let r = case(&cuda, &s, st, io, conv, vllm, (b, t), Hint::Uniform)?;
            println!(
                "| {what} | {b} | {t} | {:.2} | {:.2} | {:.2} |",
                r.pool_us, r.ext_us, r.host_us
            );
        }
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
            let r = case(
                &cuda,
                &s,
                bf16vm,
                DType::Bf16,
                DType::Bf16,
                true,
                (b, t),
                hint,
            )?;
            println!(
                "| bf16 value-major | bf16, bf16 vLLM view | {b} | {t} | {name} | {:.2} | {:.2} |",
                r.ext_us, r.host_us
            );
        }
    }
    Ok(())
}
