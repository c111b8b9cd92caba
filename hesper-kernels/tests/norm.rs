//! RMSNorm on the GPU against the f64 reference, and the reference against finite differences.

use hesper_exec::Gpu;
use hesper_kernels::norm::{self, reference};
use hesper_kernels::testing::{
    Rng, assert_close, check_gradient, f64s, gpu, gpu_without_subgroups,
};

/// (rows, cols): scalar and vec4 rows, one to three elements per invocation, with and without
/// a ragged last step (576: 48 invocations × 3 vec4s exactly); 2047 columns hold 8 an
/// invocation (the most in registers), 2051 and 8196 (2049 vec4s) go through the runtime loop.
const SHAPES: [(usize, usize); 9] = [
    (1, 7),
    (3, 256),
    (5, 1000),
    (33, 2560),
    (70, 96),
    (4, 576),
    (3, 2047),
    (3, 2051),
    (2, 8196),
];
const EPS: f32 = 1e-5;

#[test]
fn forward_matches_reference() {
    let g = gpu();
    for (seed, (rows, cols)) in SHAPES.into_iter().enumerate() {
        let mut rng = Rng::new(seed as u64 + 1);
        let (x, gamma) = (rng.vec(rows * cols, 2.0), rng.vec(cols, 1.5));
        let (xb, gb) = (g.upload(&x).unwrap(), g.upload(&gamma).unwrap());
        let mut y = g.filled(rows * cols, f32::NAN).unwrap();
        let mut rstd = g.filled(rows, f32::NAN).unwrap();
        let mut rec = g.recorder();
        norm::execute_rms_norm_forward(&mut rec, &xb, &gb, &mut y, &mut rstd, EPS).unwrap();
        rec.submit().unwrap();
        let (want_y, want_r) = reference::rms_norm_forward(&f64s(&x), &f64s(&gamma), EPS as f64);
        let what = format!("{rows}x{cols}");
        assert_close(
            &format!("y {what}"),
            &y.read(g).unwrap(),
            &want_y,
            1e-5,
            1e-6,
        );
        assert_close(
            &format!("rstd {what}"),
            &rstd.read(g).unwrap(),
            &want_r,
            1e-5,
            0.0,
        );
    }
}

#[test]
fn backward_matches_reference_and_adds_to_the_residual() {
    backward_matches_reference_and_adds_to_the_residual_on(gpu());
}

/// The paths for devices without subgroups, on this one.
#[test]
fn backward_matches_reference_and_adds_to_the_residual_without_subgroups() {
    backward_matches_reference_and_adds_to_the_residual_on(gpu_without_subgroups());
}

fn backward_matches_reference_and_adds_to_the_residual_on(g: &Gpu) {
    for (seed, (rows, cols)) in SHAPES.into_iter().enumerate() {
        let mut rng = Rng::new(seed as u64 + 50);
        let (x, gamma, dy) = (
            rng.vec(rows * cols, 2.0),
            rng.vec(cols, 1.5),
            rng.vec(rows * cols, 1.0),
        );
        let residual = rng.vec(rows * cols, 1.0);
        let (xb, gb, dyb) = (
            g.upload(&x).unwrap(),
            g.upload(&gamma).unwrap(),
            g.upload(&dy).unwrap(),
        );
        let (mut y, mut rstd) = (
            g.zeros::<f32>(rows * cols).unwrap(),
            g.zeros::<f32>(rows).unwrap(),
        );
        let mut dx = g.filled(rows * cols, f32::NAN).unwrap();
        let mut dx_acc = g.upload(&residual).unwrap();
        let mut scratch = g
            .filled(norm::dgamma_scratch_len(rows, cols), f32::NAN)
            .unwrap();
        let mut dgamma = g.filled(cols, f32::NAN).unwrap();
        let mut rec = g.recorder();
        norm::execute_rms_norm_forward(&mut rec, &xb, &gb, &mut y, &mut rstd, EPS).unwrap();
        norm::execute_rms_norm_backward(&mut rec, &xb, &gb, &rstd, &dyb, &mut dx, false).unwrap();
        norm::execute_rms_norm_backward(&mut rec, &xb, &gb, &rstd, &dyb, &mut dx_acc, true)
            .unwrap();
        norm::execute_rms_norm_dgamma(&mut rec, &xb, &rstd, &dyb, &mut scratch, &mut dgamma)
            .unwrap();
        rec.submit().unwrap();
        let (want_dx, want_dgamma) =
            reference::rms_norm_backward(&f64s(&x), &f64s(&gamma), &f64s(&dy), EPS as f64);
        let what = format!("{rows}x{cols}");
        assert_close(
            &format!("dx {what}"),
            &dx.read(g).unwrap(),
            &want_dx,
            1e-4,
            1e-5,
        );
        let want_acc: Vec<f64> = want_dx
            .iter()
            .zip(&residual)
            .map(|(d, r)| d + *r as f64)
            .collect();
        assert_close(
            &format!("dx += {what}"),
            &dx_acc.read(g).unwrap(),
            &want_acc,
            1e-4,
            1e-5,
        );
        assert_close(
            &format!("dgamma {what}"),
            &dgamma.read(g).unwrap(),
            &want_dgamma,
            1e-4,
            1e-5,
        );
    }
}

/// `dx` and `dγ` are the gradients of `L = Σ dy·y`.
#[test]
fn backward_reference_matches_finite_differences() {
    let mut rng = Rng::new(9);
    let (rows, cols) = (3, 17);
    let (x, gamma, dy) = (
        f64s(&rng.vec(rows * cols, 2.0)),
        f64s(&rng.vec(cols, 1.5)),
        f64s(&rng.vec(rows * cols, 1.0)),
    );
    let eps = 1e-5;
    let loss = |x: &[f64], gamma: &[f64]| {
        let (y, _) = reference::rms_norm_forward(x, gamma, eps);
        y.iter().zip(&dy).map(|(a, b)| a * b).sum::<f64>()
    };
    let (dx, dgamma) = reference::rms_norm_backward(&x, &gamma, &dy, eps);
    check_gradient("dx", &x, &dx, x.len(), |x| loss(x, &gamma));
    check_gradient("dgamma", &gamma, &dgamma, cols, |gm| loss(&x, gm));
}

#[test]
fn bad_shapes_name_kernel_and_buffer() {
    let g = gpu();
    let x = g.zeros::<f32>(10).unwrap();
    let gamma = g.zeros::<f32>(3).unwrap();
    let (mut y, mut rstd) = (g.zeros::<f32>(10).unwrap(), g.zeros::<f32>(3).unwrap());
    let mut rec = g.recorder();
    let err =
        norm::execute_rms_norm_forward(&mut rec, &x, &gamma, &mut y, &mut rstd, EPS).unwrap_err();
    assert_eq!(
        err.to_string(),
        "kernel `rms_norm_forward`, binding `x`: expected a whole number of rows of 3 (gamma's length), given 10 elements"
    );
    let x = g.zeros::<f32>(9).unwrap();
    let err =
        norm::execute_rms_norm_forward(&mut rec, &x, &gamma, &mut y, &mut rstd, EPS).unwrap_err();
    assert_eq!(
        err.to_string(),
        "kernel `rms_norm_forward`, binding `y`: expected 9 elements (as x), given 10 elements"
    );
}

/// Each kernel's WGSL at a small key (its first line), the snapshot named by the key.
#[test]
fn wgsl_snapshots() {
    let names = [
        "rms_norm_forward_cols2560_subgroups",
        "rms_norm_forward_cols66_eps1e-5",
        "rms_norm_forward_cols8196_looped",
        "rms_norm_backward_cols2560_accumulate_subgroups",
        "rms_norm_backward_cols576",
        "rms_norm_backward_cols2051_looped",
        "rms_norm_dgamma_partials_cols2560_rows32",
        "rms_norm_dgamma_sum_cols2560",
    ];
    let kernels = norm::kernels().unwrap();
    for (name, k) in hesper_kernels::testing::named_by_key(&kernels, &names) {
        insta::assert_snapshot!(name, k.wgsl());
    }
}
