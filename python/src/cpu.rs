//! The CPU path: the step on the caller's host memory through gdn's CPU backend. The backend keeps its states in
//! its own pool, so this path stages: each named slot's S and conv history are copied into a scratch pool of the
//! layer (`write_slot`), the step runs there, and the slots of committing sequences are copied back (`read_slot`).
//! Verify and skipped sequences' slots are only read. The output is written in place where its rows are packed.
//! A speculative step (`gdn.spec_step`) stages each named slot's held window too (`CpuPool::load_held` from the
//! slot's row of `pending`), runs the pool's one-pass step, and writes every named slot back with the window it
//! now holds (`save_held`; `held[slot]` its length).

use gdn::{
    Commit, DType, LayerPool, PoolOptions, Seq, StateLayout, Step, Tensor, TensorData, TensorMut,
};
use half::{bf16, f16};

use crate::tensor::{Elem, Raw};

/// The tensors and index values of one CPU step, checked (shapes, strides, dtypes, disjoint memory, seqs).
pub struct CpuStep<'a> {
    pub qkv: Raw,
    pub a: Raw,
    pub b: Raw,
    pub z: Raw,
    pub state: Raw,
    pub conv: Raw,
    pub out: Raw,
    pub layout: StateLayout,
    /// Sequences with the caller's slots.
    pub seqs: &'a [Seq],
    /// A speculative step's pending rows, held words and accepted counts (checked against the held words).
    pub spec: Option<CpuSpec>,
}

/// A speculative step's extra arguments on the host.
pub struct CpuSpec {
    /// `[slots, row]` f32, contiguous, row at least `CpuPool::held_floats`.
    pub pending: Raw,
    /// `[slots]` i32, contiguous: the held length of each slot (`& 0xff`).
    pub held: Raw,
    /// Per sequence, the tokens of its slot's held window it keeps.
    pub accept: Vec<i32>,
}

/// A slice over `len` elements of `T` at `ptr` (no slice at all for `len` 0, whose pointer may be null).
///
/// # Safety
/// `ptr` is aligned for `T` and valid for reads of `len` elements for `'a`, not written meanwhile.
unsafe fn slice<'a, T>(ptr: usize, len: usize) -> &'a [T] {
    if len == 0 {
        return &[];
    }
    // SAFETY: the caller's contract
    unsafe { std::slice::from_raw_parts(ptr as *const T, len) }
}

/// Rows of one input: the caller's memory where packed, else gathered into a packed copy.
enum RowsIn<'a> {
    Borrowed(Tensor<'a>),
    Owned(TensorData),
}

impl RowsIn<'_> {
    fn view(&self) -> Tensor<'_> {
        match self {
            RowsIn::Borrowed(t) => *t,
            RowsIn::Owned(t) => t.view(),
        }
    }
}

/// # Safety
/// `r` is a checked 2-D view of host memory (rows of `width` contiguous elements, aligned, forward strides) that
/// stays alive and unwritten for `'a`.
unsafe fn rows_in<'a>(r: &Raw) -> RowsIn<'a> {
    let (rows, width) = (r.shape[0], r.shape[1]);
    let rs = r.strides[0] as usize;
    let packed = rows <= 1 || rs == width;
    macro_rules! typed {
        ($t:ty, $variant:ident) => {{
            if packed {
                // SAFETY: rows * width elements from ptr, the view's extent when packed
                RowsIn::Borrowed(Tensor::$variant(unsafe { slice::<$t>(r.ptr, rows * width) }))
            } else {
                let mut v: Vec<$t> = Vec::with_capacity(rows * width);
                for i in 0..rows {
                    // SAFETY: row i lies at i * rs elements, width elements long, inside the view's extent
                    v.extend_from_slice(unsafe { slice::<$t>(r.ptr + i * rs * r.elem.size(), width) });
                }
                RowsIn::Owned(TensorData::$variant(v))
            }
        }};
    }
    match r.elem {
        Elem::F32 => typed!(f32, F32),
        Elem::Bf16 => typed!(bf16, Bf16),
        _ => typed!(f16, F16),
    }
}

/// Element `i` of a float view widened to f32.
///
/// # Safety
/// `ptr + i` elements is inside a live host tensor of element type `elem`, aligned.
unsafe fn load(ptr: usize, elem: Elem, i: usize) -> f32 {
    // SAFETY: the caller's contract
    unsafe {
        match elem {
            Elem::F32 => *(ptr as *const f32).add(i),
            Elem::Bf16 => (*(ptr as *const bf16).add(i)).to_f32(),
            _ => (*(ptr as *const f16).add(i)).to_f32(),
        }
    }
}

/// Writes `x` rounded (nearest, ties to even) to the element type.
///
/// # Safety
/// `ptr + i` elements is inside a live host tensor of element type `elem`, aligned, that nothing else reads or
/// writes meanwhile.
unsafe fn store(ptr: usize, elem: Elem, i: usize, x: f32) {
    // SAFETY: the caller's contract
    unsafe {
        match elem {
            Elem::F32 => *(ptr as *mut f32).add(i) = x,
            Elem::Bf16 => *(ptr as *mut bf16).add(i) = bf16::from_f32(x),
            _ => *(ptr as *mut f16).add(i) = f16::from_f32(x),
        }
    }
}

/// A scratch pool of at least `slots` slots with `options`, the layer's own from the last step where it fits.
pub fn fit_pool<'p>(
    cached: &'p mut Option<gdn::cpu::CpuPool>,
    layer: &gdn::Layer,
    slots: usize,
    options: PoolOptions,
) -> gdn::Result<&'p mut gdn::cpu::CpuPool> {
    let fits = cached
        .as_ref()
        .is_some_and(|p| p.slots() >= slots && p.options() == options);
    if !fits {
        *cached = None; // its memory is released before the new pool's is taken
        *cached = Some(gdn::Cpu::new().create_cpu_pool(layer, slots.max(1), options)?);
    }
    Ok(cached.as_mut().expect("set above"))
}

/// Runs a checked step.
///
/// # Safety
/// Every view of `step` is a checked view of host memory alive for the call (shapes, strides, element types,
/// alignment as `crate::step` checks them; `out`, `state` and `conv` disjoint from each other and from every
/// input; every slot index in range), not touched by anything else during the call.
pub unsafe fn run(
    layer: &gdn::Layer,
    cached: &mut Option<gdn::cpu::CpuPool>,
    step: &CpuStep<'_>,
) -> gdn::Result<()> {
    let sh = *layer.shape();
    let (c, n, sl) = (sh.channels(), sh.n(), sh.state_len());
    // SAFETY (each rows_in): the inputs are checked 2-D row views (the function's contract)
    let (qkv, a, b, z) = unsafe {
        (
            rows_in(&step.qkv),
            rows_in(&step.a),
            rows_in(&step.b),
            rows_in(&step.z),
        )
    };
    let rows = step.qkv.shape[0];
    let rows_view = gdn::Rows {
        qkv: qkv.view(),
        alpha: a.view(),
        beta: b.view(),
        z: z.view(),
    };
    // a speculative step's sequences without rows only accept (`gdn.commit_held`); the others step
    let stepped: Vec<Seq> = step.seqs.iter().filter(|s| s.len > 0).copied().collect();
    // the core's checks with the caller's slots, before any slot is read: rows in range and not shared, commits
    // in range, slots in range and named once
    Step {
        rows: rows_view,
        seqs: &stepped,
        plane_stride: None,
    }
    .validate(layer, step.state.shape[0], rows * n)?;

    let live: Vec<usize> = (0..step.seqs.len())
        .filter(|&i| step.seqs[i].slot >= 0)
        .collect();
    let state_dtype = if step.state.elem == Elem::Bf16 {
        DType::Bf16
    } else {
        DType::F32
    };
    let pool = fit_pool(
        cached,
        layer,
        live.len(),
        PoolOptions {
            state: state_dtype,
            layout: step.layout,
        },
    )?;

    // stage the named slots in (S in the pool's layout and dtype, H as SPEC's [C][3] f32)
    let (sbase, ss) = (
        step.state.ptr,
        step.state.strides[0] as usize * step.state.elem.size(),
    );
    let conv = &step.conv;
    let w = conv.shape[2];
    let (cs0, cs1, cs2) = (
        conv.strides[0] as usize,
        conv.strides[1] as usize,
        conv.strides[2] as usize,
    );
    let mut s_f32 = vec![0f32; sl];
    let mut hist = vec![0f32; c * 3];
    let mut scratch_seqs: Vec<Seq> = step.seqs.to_vec();
    for (k, &i) in live.iter().enumerate() {
        let slot = step.seqs[i].slot as usize;
        let at = sbase + slot * ss;
        match step.state.elem {
            // SAFETY: a slot's sl elements are contiguous at slot * stride (checked), the slot in range
            Elem::F32 => s_f32.copy_from_slice(unsafe { slice::<f32>(at, sl) }),
            _ => {
                use half::slice::HalfFloatSliceExt;
                // SAFETY: as above, in bf16
                unsafe { slice::<bf16>(at, sl) }.convert_to_f32_slice(&mut s_f32);
            }
        }
        for ch in 0..c {
            for j in 0..3 {
                // SAFETY: (slot, ch, w-3+j) is inside the conv state's checked shape
                hist[ch * 3 + j] = unsafe {
                    load(
                        conv.ptr,
                        conv.elem,
                        slot * cs0 + ch * cs1 + (w - 3 + j) * cs2,
                    )
                };
            }
        }
        pool.write_slot(k, &s_f32, &hist)?;
        if let Some(sp) = &step.spec {
            let row = sp.pending.shape[1];
            // SAFETY: the slot's row of the checked [slots, row] contiguous f32 pending tensor and its held word
            let (data, word) = unsafe {
                (
                    slice::<f32>(sp.pending.ptr + slot * row * 4, row),
                    *(sp.held.ptr as *const i32).add(slot),
                )
            };
            if word & 0xff > 0 {
                if data[0] != (word & 0xff) as f32 {
                    return Err(gdn::Error::Param {
                        name: "pending",
                        why: format!(
                            "slot {slot}'s row does not hold the window held[{slot}] = {word} names (rows written by \
                             gdn.spec_step on the CPU, or zeros)"
                        ),
                    });
                }
                pool.load_held(k, data)?;
            }
            if step.seqs[i].len == 0 {
                pool.commit_held(k, usize::try_from(sp.accept[i]).unwrap_or(usize::MAX))?;
            }
        }
        scratch_seqs[i].slot = k as i32;
    }
    // the sequences with rows, in the scratch pool's slots, and (a speculative step) their accepted counts,
    // skipped sequences' included
    let accept_all: Vec<usize> = match &step.spec {
        Some(sp) => (0..step.seqs.len())
            .filter(|&i| step.seqs[i].len > 0)
            .map(|i| usize::try_from(sp.accept[i]).unwrap_or(usize::MAX))
            .collect(),
        None => Vec::new(),
    };
    let scratch_seqs: Vec<Seq> = scratch_seqs.into_iter().filter(|s| s.len > 0).collect();
    let run_step = |pool: &mut gdn::cpu::CpuPool, st: &Step<'_>, t: TensorMut<'_>| match &step.spec
    {
        Some(_) => pool.step_spec(st, &accept_all, t),
        None => pool.step_varlen(st, t),
    };

    let gstep = Step {
        rows: rows_view,
        seqs: &scratch_seqs,
        plane_stride: None,
    };
    let out = &step.out;
    let out_rs = out.strides[0] as usize;
    let packed_out = rows <= 1 || out_rs == n;
    if packed_out {
        let len = rows * n;
        macro_rules! out_mut {
            ($t:ty, $variant:ident) => {
                // SAFETY: the packed output's rows * n elements, disjoint from every other view, written by
                // nothing else during the call
                TensorMut::$variant(if len == 0 {
                    &mut []
                } else {
                    unsafe { std::slice::from_raw_parts_mut(out.ptr as *mut $t, len) }
                })
            };
        }
        let t = match out.elem {
            Elem::F32 => out_mut!(f32, F32),
            Elem::Bf16 => out_mut!(bf16, Bf16),
            _ => out_mut!(f16, F16),
        };
        run_step(pool, &gstep, t)?;
    } else {
        // strided output rows: computed packed, then each live sequence's rows copied out (other rows untouched)
        let dtype = out.elem.dtype().unwrap_or(DType::F32);
        let mut y = TensorData::filled(rows * n, 0.0, dtype);
        run_step(pool, &gstep, y.view_mut())?;
        let y = y.to_f32();
        for &i in &live {
            let s = &step.seqs[i];
            for r in s.start..s.start + s.len {
                for col in 0..n {
                    // SAFETY: (r, col) inside the output's checked shape; the value came from the output dtype
                    unsafe { store(out.ptr, out.elem, r * out_rs + col, y[r * n + col]) };
                }
            }
        }
    }

    // commit: the slots of committing sequences back to the caller's tensors (in a speculative step every named
    // slot: an accepted prefix commits, and the window held changes)
    for (k, &i) in live.iter().enumerate() {
        if step.seqs[i].commit == Commit::Verify && step.spec.is_none() {
            continue;
        }
        let slot = step.seqs[i].slot as usize;
        if let Some(sp) = &step.spec {
            let row = sp.pending.shape[1];
            // SAFETY: the slot's row of the checked, writable pending tensor and its held word, disjoint from every
            // other view; nothing else touches them during the call
            let (data, word) = unsafe {
                (
                    std::slice::from_raw_parts_mut(
                        (sp.pending.ptr + slot * row * 4) as *mut f32,
                        row,
                    ),
                    &mut *(sp.held.ptr as *mut i32).add(slot),
                )
            };
            let len = pool.save_held(k, data)?;
            *word = len as i32;
        }
        pool.read_slot(k, &mut s_f32, &mut hist)?;
        let at = sbase + slot * ss;
        match step.state.elem {
            Elem::F32 => {
                // SAFETY: the slot's sl contiguous elements, in range, disjoint from every other view
                unsafe { std::ptr::copy_nonoverlapping(s_f32.as_ptr(), at as *mut f32, sl) }
            }
            _ => {
                use half::slice::HalfFloatSliceExt;
                // SAFETY: as above, in bf16; the pool holds bf16 values, so the rounding is exact
                let dst = unsafe { std::slice::from_raw_parts_mut(at as *mut bf16, sl) };
                dst.convert_from_f32_slice(&s_f32);
            }
        }
        for ch in 0..c {
            for j in 0..3 {
                // SAFETY: (slot, ch, w-3+j) inside the conv state's checked shape, disjoint from every other view
                unsafe {
                    store(
                        conv.ptr,
                        conv.elem,
                        slot * cs0 + ch * cs1 + (w - 3 + j) * cs2,
                        hist[ch * 3 + j],
                    )
                };
            }
        }
    }
    Ok(())
}
