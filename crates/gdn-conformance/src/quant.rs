//! The quantized out_proj (SPEC.md, "The quantized out_proj"), the same checks on every backend: its product
//! over the backend's own step output (y, planes, group sums) against the dequantized weights' product in
//! float64, and against the same product from y without planes (the shift path with its own group sums).

use gdn::quant::{Packing, QuantBackend, QuantWeights};
use gdn::synth::Synth;
use gdn::{relative_error, Commit, Config, DType, OutputLayout, Seq, Shape, Step, TensorData};

/// `||out - ref|| / ||ref||` of a product against the dequantized weights' product in float64 (SPEC: 1e-5;
/// f32 sums of n terms, measured 1e-7 on the CPU at n 6144).
pub const QUANT_BOUND: f64 = 1e-5;

/// The planes path against the shift path (the same sums from the same fields; only the order of rounding
/// differs).
pub const PLANES_VS_SHIFT_BOUND: f64 = 1e-5;

/// Builds the quant backend or says on stderr why the test is skipped.
pub fn quant_or_skip(
    make: impl FnOnce() -> gdn::Result<Box<dyn QuantBackend>>,
    test: &str,
) -> Option<Box<dyn QuantBackend>> {
    match make() {
        Ok(b) => Some(b),
        Err(gdn::Error::Unavailable(why)) => {
            use std::io::Write;
            let _ = writeln!(
                std::io::stderr(),
                "SKIPPED {test}: backend unavailable: {why}"
            );
            None
        }
        Err(e) => panic!("{test}: backend failed to start: {e}"),
    }
}

/// One decode step of `rows` sequences on the backend, with planes (stride rows n + 16): its f32 output and
/// layout.
fn step_with_planes(
    backend: &dyn QuantBackend,
    layer: &gdn::Layer,
    rows: usize,
    rng: &mut Synth,
) -> (Vec<f32>, OutputLayout) {
    let sh = *layer.shape();
    let mut pool = backend.create_pool(layer, rows).expect("pool");
    for s in 0..rows {
        let (st, h) = rng.seq_state(layer);
        pool.write_slot(s, &st, &h).expect("write_slot");
    }
    let w = rng.batch(layer, 1, rows);
    let data = gdn::RowsData::from_f32(&w.qkv, &w.alpha, &w.beta, &w.z, [DType::F32; 4]);
    let seqs: Vec<Seq> = (0..rows)
        .map(|i| Seq {
            slot: i as i32,
            start: i,
            len: 1,
            commit: Commit::All,
        })
        .collect();
    let stride = rows * sh.n() + 16;
    let layout = OutputLayout::for_rows(&sh, rows, Some(stride)).expect("layout");
    let mut out = TensorData::filled(layout.len(), 0.0, DType::F32);
    pool.step_varlen(
        &Step {
            rows: data.view(),
            seqs: &seqs,
            plane_stride: Some(stride),
        },
        out.view_mut(),
    )
    .expect("step with planes");
    (out.to_f32(), layout)
}

/// Every packing, on the backend's own step output at a small shape (n 128) and the seed's (n 6144), one row
/// and a few (1, 3, 9: a token tile and its remainder): the planes product and the shift product each against
/// the dequantized weights' product in float64 (within [`QUANT_BOUND`]), and against each other (within
/// [`PLANES_VS_SHIFT_BOUND`]); the same call twice gives the same bits.
pub fn out_proj_matches_the_dequantized_product(backend: &dyn QuantBackend) {
    let cases = [
        (Shape::new(32, 2, 4).unwrap(), 96, [1usize, 3, 9]),
        (Shape::SEED, 160, [1, 3, 9]),
    ];
    let mut rng = Synth::new(1717);
    for (shape, hidden, row_counts) in cases {
        let layer = rng.layer(Config::new(shape)).expect("layer");
        let n = shape.n();
        let w = rng.uniform(hidden * n, -0.05, 0.05);
        for rows in row_counts {
            let (buf, layout) = step_with_planes(backend, &layer, rows, &mut rng);
            let y = &buf[..rows * n];
            for p in Packing::ALL {
                let what = format!("{} n {n} hidden {hidden} rows {rows}", p.name());
                let q = QuantWeights::quantize(&w, hidden, n, p).expect("quantize");
                let dq = q.dequantized();
                let want: Vec<f64> = (0..rows)
                    .flat_map(|r| {
                        let (y, dq) = (&y, &dq);
                        (0..hidden).map(move |o| {
                            (0..n)
                                .map(|m| dq[o * n + m] * y[r * n + m] as f64)
                                .sum::<f64>()
                        })
                    })
                    .collect();
                let mut prod = backend.load_out_proj(&q).expect("load_out_proj");
                assert_eq!(prod.shape(), (p, hidden, n), "{what}: shape");
                let mut a = vec![f32::NAN; rows * hidden];
                let mut b = vec![f32::NAN; rows * hidden];
                let mut again = vec![f32::NAN; rows * hidden];
                prod.product_planes(&buf, &layout, &mut a)
                    .expect("product_planes");
                prod.product_shift(y, rows, &mut b).expect("product_shift");
                prod.product_planes(&buf, &layout, &mut again)
                    .expect("product_planes again");
                let ea = relative_error(&a, &want);
                let eb = relative_error(&b, &want);
                assert!(
                    ea < QUANT_BOUND,
                    "{what}: planes path {ea:.2e} against the float64 product"
                );
                assert!(
                    eb < QUANT_BOUND,
                    "{what}: shift path {eb:.2e} against the float64 product"
                );
                let wide: Vec<f64> = b.iter().map(|&v| v as f64).collect();
                let eab = relative_error(&a, &wide);
                eprintln!("{what}: planes {ea:.1e}, shift {eb:.1e}, planes vs shift {eab:.1e}");
                assert!(
                    eab < PLANES_VS_SHIFT_BOUND,
                    "{what}: planes against shift {eab:.2e}"
                );
                let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&a), bits(&again), "{what}: a repeated call's bits");
            }
        }
    }
}

/// Arguments that do not fit are errors, not panics: no planes in the layout, another n, wrong lengths.
pub fn bad_out_proj_input_is_rejected(backend: &dyn QuantBackend) {
    let sh = Shape::new(16, 1, 2).unwrap(); // n 32
    let (n, hidden, rows) = (sh.n(), 8, 2);
    let w = Synth::new(3).uniform(hidden * n, -1.0, 1.0);
    for p in Packing::ALL {
        let q = QuantWeights::quantize(&w, hidden, n, p).unwrap();
        let mut prod = backend.load_out_proj(&q).expect("load_out_proj");
        let mut out = vec![0.0f32; rows * hidden];
        let plain = OutputLayout::for_rows(&sh, rows, None).unwrap();
        let buf = vec![0.0f32; plain.len()];
        assert!(
            prod.product_planes(&buf, &plain, &mut out).is_err(),
            "{p:?}: no planes"
        );
        let with = OutputLayout::for_rows(&sh, rows, Some(rows * n)).unwrap();
        let buf = vec![0.5f32; with.len()];
        assert!(
            prod.product_planes(&buf[1..], &with, &mut out).is_err(),
            "{p:?}: short step output"
        );
        assert!(
            prod.product_planes(&buf, &with, &mut out[1..]).is_err(),
            "{p:?}: short out"
        );
        let other = Shape::new(16, 1, 4).unwrap();
        let wide = OutputLayout::for_rows(&other, rows, Some(rows * other.n())).unwrap();
        let wbuf = vec![0.5f32; wide.len()];
        assert!(
            prod.product_planes(&wbuf, &wide, &mut out).is_err(),
            "{p:?}: another n"
        );
        assert!(
            prod.product_shift(&buf[..rows * n - 1], rows, &mut out)
                .is_err(),
            "{p:?}: short y"
        );
        assert!(
            prod.product_shift(&buf[..rows * n], rows, &mut out[..hidden])
                .is_err(),
            "{p:?}: short out (shift)"
        );
        // and a good call still works after the errors
        prod.product_planes(&buf, &with, &mut out).unwrap();
        assert!(out.iter().all(|v| v.is_finite()), "{p:?}");
    }
}
