//! FFN activations on the GPU against the f64 reference, and the reference against finite
//! differences.

use hesper_exec::{ExecError, GpuBuffer};
use hesper_kernels::ffn::{self, reference};
use hesper_kernels::testing::{Rng, assert_close, check_gradient, f64s, gpu};

/// Lengths that are and are not multiples of 4 and of the workgroup (1024 elements).
const LENGTHS: [usize; 5] = [1, 3, 1000, 4099, 70_001];

type Backward = fn(
    &mut hesper_exec::Recorder<'_>,
    &GpuBuffer<f32>,
    &GpuBuffer<f32>,
    &GpuBuffer<f32>,
    &mut GpuBuffer<f32>,
    &mut GpuBuffer<f32>,
) -> Result<(), ExecError>;
type BackwardRef = fn(&[f64], &[f64], &[f64]) -> (Vec<f64>, Vec<f64>);
type Forward = fn(
    &mut hesper_exec::Recorder<'_>,
    &GpuBuffer<f32>,
    &GpuBuffer<f32>,
    &mut GpuBuffer<f32>,
) -> Result<(), ExecError>;

/// `rtol`: a few f32 ulps for plain arithmetic, more where `exp` (a few ulps itself) feeds
/// products; `atol` 1e-6 for outputs that cancel to near zero (inputs are O(1)).
fn check_forward(
    name: &str,
    execute: Forward,
    reference: fn(&[f64], &[f64]) -> Vec<f64>,
    rtol: f64,
) {
    let g = gpu();
    for (seed, n) in LENGTHS.into_iter().enumerate() {
        let mut rng = Rng::new(seed as u64 + 100);
        let (gate, up) = (rng.vec(n, 4.0), rng.vec(n, 2.0));
        let (gb, ub) = (g.upload(&gate).unwrap(), g.upload(&up).unwrap());
        let mut h = g.filled(n, f32::NAN).unwrap();
        let mut rec = g.recorder();
        execute(&mut rec, &gb, &ub, &mut h).unwrap();
        rec.submit().unwrap();
        let want = reference(&f64s(&gate), &f64s(&up));
        assert_close(
            &format!("{name} n={n}"),
            &h.read(g).unwrap(),
            &want,
            rtol,
            1e-6,
        );
    }
}

fn check_backward(name: &str, execute: Backward, reference: BackwardRef, rtol: f64) {
    let g = gpu();
    for (seed, n) in LENGTHS.into_iter().enumerate() {
        let mut rng = Rng::new(seed as u64);
        let (gate, up, dh) = (rng.vec(n, 4.0), rng.vec(n, 2.0), rng.vec(n, 1.0));
        let (gb, ub, db) = (
            g.upload(&gate).unwrap(),
            g.upload(&up).unwrap(),
            g.upload(&dh).unwrap(),
        );
        let mut d_gate = g.filled(n, f32::NAN).unwrap();
        let mut d_up = g.filled(n, f32::NAN).unwrap();
        let mut rec = g.recorder();
        execute(&mut rec, &gb, &ub, &db, &mut d_gate, &mut d_up).unwrap();
        rec.submit().unwrap();
        let (want_gate, want_up) = reference(&f64s(&gate), &f64s(&up), &f64s(&dh));
        assert_close(
            &format!("{name} d_gate n={n}"),
            &d_gate.read(g).unwrap(),
            &want_gate,
            rtol,
            1e-6,
        );
        assert_close(
            &format!("{name} d_up n={n}"),
            &d_up.read(g).unwrap(),
            &want_up,
            rtol,
            1e-6,
        );
    }
}

#[test]
fn relu_sqr_mul_matches_reference() {
    check_forward(
        "relu_sqr_mul_forward",
        ffn::execute_relu_sqr_mul_forward,
        reference::relu_sqr_mul_forward,
        1e-6,
    );
    check_backward(
        "relu_sqr_mul_backward",
        ffn::execute_relu_sqr_mul_backward,
        reference::relu_sqr_mul_backward,
        1e-6,
    );
}

#[test]
fn swiglu_matches_reference() {
    check_forward(
        "swiglu_forward",
        ffn::execute_swiglu_forward,
        reference::swiglu_forward,
        1e-5,
    );
    check_backward(
        "swiglu_backward",
        ffn::execute_swiglu_backward,
        reference::swiglu_backward,
        1e-5,
    );
}

/// The backward references are the gradients of `L = Σ d_h·h` of their forward references.
#[test]
fn backward_references_match_finite_differences() {
    let mut rng = Rng::new(7);
    let n = 64;
    // Keep gates away from relu's kink at 0, where the derivative is undefined.
    let gate: Vec<f64> = rng
        .vec(n, 3.0)
        .iter()
        .map(|g| *g as f64 + if *g >= 0.0 { 0.05 } else { -0.05 })
        .collect();
    let (up, dh) = (f64s(&rng.vec(n, 2.0)), f64s(&rng.vec(n, 1.0)));
    type Pair = (
        fn(&[f64], &[f64]) -> Vec<f64>,
        fn(&[f64], &[f64], &[f64]) -> (Vec<f64>, Vec<f64>),
    );
    let pairs: [(&str, Pair); 2] = [
        (
            "relu_sqr_mul",
            (
                reference::relu_sqr_mul_forward,
                reference::relu_sqr_mul_backward,
            ),
        ),
        (
            "swiglu",
            (reference::swiglu_forward, reference::swiglu_backward),
        ),
    ];
    for (name, (forward, backward)) in pairs {
        let loss = |g: &[f64], u: &[f64]| {
            forward(g, u)
                .iter()
                .zip(&dh)
                .map(|(h, d)| h * d)
                .sum::<f64>()
        };
        let (d_gate, d_up) = backward(&gate, &up, &dh);
        check_gradient(&format!("{name} d_gate"), &gate, &d_gate, n, |g| {
            loss(g, &up)
        });
        check_gradient(&format!("{name} d_up"), &up, &d_up, n, |u| loss(&gate, u));
    }
}

/// Rows of `width` gate values then `width` up values, from the two `[rows, width]` arrays.
fn pack<T: Copy>(gate: &[T], up: &[T], width: usize) -> Vec<T> {
    gate.chunks(width)
        .zip(up.chunks(width))
        .flat_map(|(g, u)| g.iter().chain(u).copied())
        .collect()
}

/// The packed SwiGLU (rows of gate then up, as one GEMM over `[W_gate; W_up]` writes them)
/// against the f64 reference of the two arrays apart; outputs poisoned, widths of one vec4 to
/// more than a workgroup's, rows from one to many.
#[test]
fn swiglu_packed_matches_reference() {
    let g = gpu();
    for (seed, (rows, width)) in [(1, 4), (3, 12), (37, 256), (5, 1028), (700, 8)]
        .into_iter()
        .enumerate()
    {
        let mut rng = Rng::new(seed as u64 + 300);
        let n = rows * width;
        let (gate, up, dh) = (rng.vec(n, 4.0), rng.vec(n, 2.0), rng.vec(n, 1.0));
        let gate_up = g.upload(&pack(&gate, &up, width)).unwrap();
        let d_h = g.upload(&dh).unwrap();
        let mut h = g.filled(n, f32::NAN).unwrap();
        let mut d_gate_up = g.filled(2 * n, f32::NAN).unwrap();
        let mut rec = g.recorder();
        ffn::execute_swiglu_packed_forward(&mut rec, &gate_up, width, &mut h).unwrap();
        ffn::execute_swiglu_packed_backward(&mut rec, &gate_up, width, &d_h, &mut d_gate_up)
            .unwrap();
        rec.submit().unwrap();
        let (gate, up, dh) = (f64s(&gate), f64s(&up), f64s(&dh));
        let what = format!("swiglu_packed {rows}×{width}");
        let want = reference::swiglu_forward(&gate, &up);
        assert_close(&what, &h.read(g).unwrap(), &want, 1e-5, 1e-6);
        let (want_gate, want_up) = reference::swiglu_backward(&gate, &up, &dh);
        let want = pack(&want_gate, &want_up, width);
        let what = format!("swiglu_packed_backward {rows}×{width} d_gate_up");
        assert_close(&what, &d_gate_up.read(g).unwrap(), &want, 1e-5, 1e-6);
    }
}

/// The f16 packed SwiGLU against the f64 reference on the f16-rounded `gate_up`: `h` within
/// f32's rounding (its inputs are exact), or f16's where it is stored in f16, `d_gate_up` read back as `2^−e` times the f16 values
/// the kernel wrote, within f16's rounding of `2^e·d_gate_up` (half an ulp: 2^−11 relative).
/// On a device without `SHADER_F16`: the error that says so.
#[test]
fn swiglu_packed_f16_matches_reference() {
    use hesper_exec::half::f16;
    let g = gpu();
    let round = |v: &[f32]| -> Vec<f16> { v.iter().map(|x| f16::from_f32(*x)).collect() };
    let widen = |v: &[f16]| -> Vec<f64> { v.iter().map(|x| x.to_f64()).collect() };
    for (seed, (rows, width, exponent)) in [(1, 4, 0), (3, 12, 5), (37, 256, 12), (700, 8, -3)]
        .into_iter()
        .enumerate()
    {
        let mut rng = Rng::new(seed as u64 + 900);
        let n = rows * width;
        let (gate, up, dh) = (rng.vec(n, 4.0), rng.vec(n, 2.0), rng.vec(n, 1.0));
        let packed = round(&pack(&gate, &up, width));
        let gate_up = g.upload(&packed).unwrap();
        let d_h = g.upload(&dh).unwrap();
        let mut h = g.filled(n, f32::NAN).unwrap();
        let mut h_half = g.filled(n, f16::NAN).unwrap();
        let mut d_gate_up = g.filled(2 * n, f16::NAN).unwrap();
        let mut rec = g.recorder();
        let forward = ffn::execute_swiglu_packed_forward_f16(&mut rec, &gate_up, width, &mut h);
        if !g.supports_f16() {
            let e = forward.unwrap_err();
            assert!(matches!(e, ExecError::MissingFeature { .. }), "{e}");
            eprintln!("no SHADER_F16 here: the f16 SwiGLU is refused, as it should be");
            return;
        }
        forward.unwrap();
        ffn::execute_swiglu_packed_forward_half(&mut rec, &gate_up, width, &mut h_half).unwrap();
        ffn::execute_swiglu_packed_backward_f16(
            &mut rec,
            &gate_up,
            width,
            &d_h,
            exponent,
            &mut d_gate_up,
        )
        .unwrap();
        rec.submit().unwrap();
        let rounded = widen(&packed);
        let (gate, up): (Vec<f64>, Vec<f64>) = rounded
            .chunks(2 * width)
            .flat_map(|row| row[..width].iter().zip(&row[width..]))
            .map(|(g, u)| (*g, *u))
            .unzip();
        let dh = f64s(&dh);
        let what = format!("swiglu_packed_forward_f16 {rows}×{width}");
        let want = reference::swiglu_forward(&gate, &up);
        assert_close(&what, &h.read(g).unwrap(), &want, 1e-5, 1e-6);
        // Rounded to nearest: within half an ulp (2^−11 relative; f16's subnormals 2^−25 apart).
        let what = format!("swiglu_packed_forward_half {rows}×{width}");
        let got: Vec<f32> = h_half.read(g).unwrap().iter().map(|v| v.to_f32()).collect();
        assert_close(&what, &got, &want, 4.9e-4, 3e-8);
        let (want_gate, want_up) = reference::swiglu_backward(&gate, &up, &dh);
        let want = pack(&want_gate, &want_up, width);
        let unscale = 2f64.powi(-exponent);
        let got: Vec<f32> = widen(&d_gate_up.read(g).unwrap())
            .iter()
            .map(|v| (v * unscale) as f32)
            .collect();
        let what = format!("swiglu_packed_backward_f16 {rows}×{width} e = {exponent}");
        assert_close(&what, &got, &want, 5e-4, 1e-6);
    }
}

#[test]
fn packed_shapes_are_checked() {
    let g = gpu();
    let (gate_up, h) = (g.zeros::<f32>(48).unwrap(), g.zeros::<f32>(24).unwrap());
    let mut h_short = g.zeros::<f32>(20).unwrap();
    let mut d_gate_up = g.zeros::<f32>(40).unwrap();
    let mut rec = g.recorder();
    let err = |e: ExecError| e.to_string();
    assert_eq!(
        err(ffn::execute_swiglu_packed_forward(&mut rec, &gate_up, 6, &mut h_short).unwrap_err()),
        "kernel `swiglu_packed_forward`, binding `width`: expected a positive multiple of 4 \
         (rows go as vec4s), given 6"
    );
    assert_eq!(
        err(ffn::execute_swiglu_packed_forward(&mut rec, &gate_up, 8, &mut h_short).unwrap_err()),
        "kernel `swiglu_packed_forward`, binding `h`: expected 24 elements (rows × width), given \
         20 elements"
    );
    let err =
        ffn::execute_swiglu_packed_backward(&mut rec, &gate_up, 8, &h, &mut d_gate_up).unwrap_err();
    assert_eq!(
        err.to_string(),
        "kernel `swiglu_packed_backward`, binding `d_gate_up`: expected 48 elements (as \
         gate_up), given 40 elements"
    );
    let odd = g.zeros::<f32>(50).unwrap();
    let err =
        ffn::execute_swiglu_packed_backward(&mut rec, &odd, 8, &h, &mut d_gate_up).unwrap_err();
    assert!(
        err.to_string()
            .starts_with("kernel `swiglu_packed_backward`, binding `gate_up`: expected"),
        "{err}"
    );
    // The f16 kernels check the same, and the exponent (checked before the device's f16).
    use hesper_exec::half::f16;
    let gate_up16 = g.zeros::<f16>(48).unwrap();
    let mut d_gate_up16 = g.zeros::<f16>(40).unwrap();
    let err =
        ffn::execute_swiglu_packed_backward_f16(&mut rec, &gate_up16, 8, &h, 0, &mut d_gate_up16)
            .unwrap_err();
    assert_eq!(
        err.to_string(),
        "kernel `swiglu_packed_backward_f16`, binding `d_gate_up`: expected 48 elements (as \
         gate_up), given 40 elements"
    );
    let mut d_gate_up16 = g.zeros::<f16>(48).unwrap();
    let err =
        ffn::execute_swiglu_packed_backward_f16(&mut rec, &gate_up16, 8, &h, 65, &mut d_gate_up16)
            .unwrap_err();
    assert_eq!(
        err.to_string(),
        "kernel `swiglu_packed_backward_f16`, binding `grad_exponent`: expected at most 64 either \
         way (2^e stays a normal f32), given 65"
    );
    let err =
        ffn::execute_swiglu_packed_forward_f16(&mut rec, &gate_up16, 8, &mut h_short).unwrap_err();
    assert!(
        err.to_string()
            .starts_with("kernel `swiglu_packed_forward_f16`, binding `h`: expected 24"),
        "{err}"
    );
    let mut h_short16 = g.zeros::<f16>(20).unwrap();
    let err = ffn::execute_swiglu_packed_forward_half(&mut rec, &gate_up16, 8, &mut h_short16)
        .unwrap_err();
    assert!(
        err.to_string()
            .starts_with("kernel `swiglu_packed_forward_half`, binding `h`: expected 24"),
        "{err}"
    );
    assert!(rec.is_empty());
}

#[test]
fn mismatched_lengths_name_kernel_and_buffer() {
    let g = gpu();
    let a = g.zeros::<f32>(10).unwrap();
    let b = g.zeros::<f32>(9).unwrap();
    let (mut c, mut d) = (g.zeros::<f32>(10).unwrap(), g.zeros::<f32>(10).unwrap());
    let mut rec = g.recorder();
    let err = ffn::execute_swiglu_backward(&mut rec, &a, &b, &a, &mut c, &mut d).unwrap_err();
    assert_eq!(
        err.to_string(),
        "kernel `swiglu_backward`, binding `up`: expected 10 elements (as gate), given 9 elements"
    );
    assert!(rec.is_empty());
}

/// Each kernel's WGSL at a small key (its first line), the snapshot named by the key.
#[test]
fn wgsl_snapshots() {
    let names = [
        "relu_sqr_mul_forward",
        "relu_sqr_mul_backward",
        "swiglu_forward",
        "swiglu_backward",
        "swiglu_packed_forward",
        "swiglu_packed_backward",
        "swiglu_packed_forward_f16",
        "swiglu_packed_forward_half",
        "swiglu_packed_backward_f16",
    ];
    let kernels = ffn::kernels().unwrap();
    for (name, k) in hesper_kernels::testing::named_by_key(&kernels, &names) {
        insta::assert_snapshot!(name, k.wgsl());
    }
}

mod layer {
    use hesper_kernels::ffn::reference::{self, FfnWeights};
    use hesper_kernels::ffn::{self, FfnLayer, FfnScratch, FfnStyle};
    use hesper_kernels::testing::{Rng, assert_close, check_gradient, f64s, gpu};

    const EPS: f64 = 1e-5;

    fn to_f32(v: &[f64]) -> Vec<f32> {
        v.iter().map(|x| *x as f32).collect()
    }

    /// One layer's FFN backward (both styles) on the GPU against the composed f64 reference; the
    /// residual gradient `dx_out` must come back added.
    #[test]
    fn ffn_backward_matches_reference() {
        let g = gpu();
        for bitnet in [false, true] {
            for (seed, (t, d, i)) in [(3usize, 8usize, 12usize), (7, 24, 40), (4, 7, 9)]
                .into_iter()
                .enumerate()
            {
                let mut rng = Rng::new(seed as u64 + if bitnet { 100 } else { 0 });
                let x = f64s(&rng.vec(t * d, 1.0));
                let gamma = f64s(&rng.vec(d, 1.0));
                let (wg, wu, wd) = (
                    f64s(&rng.vec(i * d, 0.3)),
                    f64s(&rng.vec(i * d, 0.3)),
                    f64s(&rng.vec(d * i, 0.3)),
                );
                let gf = f64s(&rng.vec(i, 1.0));
                let dx_out = f64s(&rng.vec(t * d, 1.0));
                let w = FfnWeights {
                    norm_gamma: &gamma,
                    w_gate: &wg,
                    w_up: &wu,
                    w_down: &wd,
                    sub_norm_gamma: bitnet.then_some(&gf[..]),
                    eps: EPS,
                };
                let (_, saved) = reference::ffn_forward(&x, &w);
                let want = reference::ffn_backward(&x, &w, &dx_out);

                let up = |v: &[f64]| g.upload(&to_f32(v)).unwrap();
                let (xb, gb, wgb, wub, wdb, gfb) =
                    (up(&x), up(&gamma), up(&wg), up(&wu), up(&wd), up(&gf));
                let (rb, gateb, upb, hb, hrb) = (
                    up(&saved.x_rstd),
                    up(&saved.gate),
                    up(&saved.up),
                    up(&saved.h),
                    up(&saved.h_rstd),
                );
                let h_rstd_dummy = g.zeros::<f32>(1).unwrap();
                let style = if bitnet {
                    FfnStyle::BitNet {
                        sub_norm_gamma: &gfb,
                        h: &hb,
                        h_rstd: &hrb,
                    }
                } else {
                    FfnStyle::SwiGlu
                };
                let layer = FfnLayer {
                    style,
                    norm_gamma: &gb,
                    w_gate: &wgb,
                    w_up: &wub,
                    w_down: &wdb,
                    x: &xb,
                    x_rstd: &rb,
                    gate: &gateb,
                    up: &upb,
                };
                let nan = |n: usize| g.filled(n, f32::NAN).unwrap();
                let (mut d_h, mut d_h_norm, mut d_gate, mut d_up, mut d_norm) =
                    (nan(t * i), nan(t * i), nan(t * i), nan(t * i), nan(t * d));
                let mut dx = up(&dx_out);
                let mut rec = g.recorder();
                let scratch = FfnScratch {
                    d_h: &mut d_h,
                    d_h_norm: &mut d_h_norm,
                    d_gate: &mut d_gate,
                    d_up: &mut d_up,
                    d_norm: &mut d_norm,
                };
                ffn::execute_ffn_backward(&mut rec, &layer, scratch, &mut dx).unwrap();
                rec.submit().unwrap();
                let _ = h_rstd_dummy;
                assert_close(
                    &format!("ffn dx (bitnet={bitnet}, T={t} D={d} I={i})"),
                    &dx.read(g).unwrap(),
                    &want,
                    1e-4,
                    1e-5,
                );
            }
        }
    }

    /// The composed reference is the gradient of `Σ dx_out ⊙ (x + FFN(x))` in x.
    #[test]
    fn ffn_backward_reference_matches_finite_differences() {
        let mut rng = Rng::new(12);
        let (t, d, i) = (2, 5, 6);
        let (x, gamma) = (f64s(&rng.vec(t * d, 1.0)), f64s(&rng.vec(d, 1.0)));
        let (wg, wu, wd, gf) = (
            f64s(&rng.vec(i * d, 0.5)),
            f64s(&rng.vec(i * d, 0.5)),
            f64s(&rng.vec(d * i, 0.5)),
            f64s(&rng.vec(i, 1.0)),
        );
        let dx_out = f64s(&rng.vec(t * d, 1.0));
        for bitnet in [false, true] {
            let w = FfnWeights {
                norm_gamma: &gamma,
                w_gate: &wg,
                w_up: &wu,
                w_down: &wd,
                sub_norm_gamma: bitnet.then_some(&gf[..]),
                eps: EPS,
            };
            let dx = reference::ffn_backward(&x, &w, &dx_out);
            check_gradient(
                &format!("ffn dx (bitnet={bitnet})"),
                &x,
                &dx,
                x.len(),
                |x| {
                    let (y, _) = reference::ffn_forward(x, &w);
                    y.iter().zip(&dx_out).map(|(a, b)| a * b).sum()
                },
            );
        }
    }
}
