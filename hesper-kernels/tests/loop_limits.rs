//! Kernels whose per-invocation loops grow with a size refuse the sizes past the device's loop
//! limit (`Gpu::max_loop_iterations`: lavapipe ends an invocation's loops after 65 535
//! iterations, every loop counted together, and the kernel silently returns wrong numbers),
//! and compute the largest size within it right. Where the device has no known limit there is
//! nothing to refuse, and the test says so.

use hesper_exec::{ExecError, Gpu, Recorder};
use hesper_kernels::LOOP_ALLOWANCE;
use hesper_kernels::argmax::execute_argmax;
use hesper_kernels::linear::{Gemm, Product, Tile, Weights, execute_gemm};
use hesper_kernels::norm::{execute_rms_norm_forward, reference as norm_ref};
use hesper_kernels::testing::{compare, f64s, gpu};

fn record(
    g: &Gpu,
    call: impl FnOnce(&mut Recorder<'_>) -> Result<(), ExecError>,
) -> Result<(), ExecError> {
    let mut rec = g.recorder();
    call(&mut rec)?;
    rec.submit()
}

fn assert_refused(what: &str, result: Result<(), ExecError>, kernel: &str) {
    let e = result.expect_err(what).to_string();
    for word in [kernel, "65535", "loop"] {
        assert!(e.contains(word), "{what}: `{word}` is not in: {e}");
    }
}

/// A row of `n` values that is not all one value.
fn ramp(n: usize) -> Vec<f32> {
    (0..n).map(|i| ((i % 7) as f32 - 3.0) / 7.0).collect()
}

/// The iterations a kernel's own loops may take: the device's limit less the allowance for
/// reductions and loop exits.
fn limit(g: &Gpu) -> Option<u64> {
    let limit = g.max_loop_iterations().map(|max| max - LOOP_ALLOWANCE);
    if limit.is_none() {
        println!("{}: no loop limit known; nothing to refuse", g.describe());
    }
    limit
}

/// The tiled GEMM steps through the depth `bk` at a time: the most steps it takes are right
/// (before the check, 66 000 steps returned the sum of the first 65 535), one element more is
/// refused.
#[test]
fn the_gemm_refuses_a_depth_past_the_loop_limit() {
    let g = gpu();
    let Some(max) = limit(g) else { return };
    // The tile this device runs `Gemm::new`'s at (WebGPU's limits take one 8 deep).
    let bk = Tile::MEDIUM.within(&g.kernel_limits()).bk as usize;
    let (m, k) = (1, 4);
    for (depth, fits) in [(max as usize * bk, true), (max as usize * bk + 1, false)] {
        // `dx = dy·W`: `dy: [1, depth]`, `W: [depth, 4]`, a contraction over `depth`.
        let dy = ramp(m * depth);
        let w: Vec<f32> = (0..depth * k)
            .map(|i| ((i % 5) as f32 - 2.0) / 5.0)
            .collect();
        let (dy_b, w_b) = (g.upload(&dy).unwrap(), g.upload(&w).unwrap());
        let mut dx = g.filled(m * k, f32::NAN).unwrap();
        let gemm = Gemm::new(Product::Nn, (m, depth, k), false);
        let result = record(g, |rec| {
            execute_gemm(rec, &gemm, &dy_b, Weights::Dense(&w_b), &mut dx)
        });
        if !fits {
            assert_refused(&format!("depth {depth}"), result, "matmul_nn");
            continue;
        }
        result.unwrap();
        let want: Vec<f64> = (0..k)
            .map(|c| (0..depth).map(|d| dy[d] as f64 * w[d * k + c] as f64).sum())
            .collect();
        // Sums of a million products of size ~0.2: the error is f32's over that many terms.
        let c = compare(&dx.read(g).unwrap(), &want, 1.0);
        assert!(c.max_abs < 1e-2, "depth {depth}: {c}");
    }
}

/// RMSNorm's forward holds rows of up to 8 elements an invocation in registers; a wider one it
/// strides over twice: 2·⌈cols / 256⌉ iterations for a width that is not a multiple of 4 (at
/// 2 × 32 767, 10 short of the limit, its second stride stopped early before the check).
#[test]
fn rms_norm_refuses_a_row_past_the_loop_limit() {
    let g = gpu();
    let Some(max) = limit(g) else { return };
    // Odd widths go element by element (a multiple of 4 would go as vec4s, 4× further).
    let largest = (max as usize / 2) * 256 - 1;
    for (cols, fits) in [(largest, true), (largest + 2, false)] {
        let x = ramp(cols);
        let gamma: Vec<f32> = (0..cols).map(|i| 1.0 + (i % 3) as f32 / 4.0).collect();
        let (x_b, gamma_b) = (g.upload(&x).unwrap(), g.upload(&gamma).unwrap());
        let mut y = g.filled(cols, f32::NAN).unwrap();
        let mut rstd = g.filled(1, f32::NAN).unwrap();
        let result = record(g, |rec| {
            execute_rms_norm_forward(rec, &x_b, &gamma_b, &mut y, &mut rstd, 1e-5)
        });
        if !fits {
            assert_refused(&format!("cols {cols}"), result, "rms_norm_forward");
            continue;
        }
        result.unwrap();
        let (want_y, want_rstd) = norm_ref::rms_norm_forward(&f64s(&x), &f64s(&gamma), 1e-5);
        let c = compare(&y.read(g).unwrap(), &want_y, 1e-6);
        assert!(c.scaled() < 1e-4, "cols {cols}: y: {c}");
        let c = compare(&rstd.read(g).unwrap(), &want_rstd, 1e-6);
        assert!(c.scaled() < 1e-4, "cols {cols}: rstd: {c}");
    }
}

/// `argmax` strides over its row once: ⌈n / 256⌉ iterations (from 65 470, with its two
/// reductions' loops, it returned 0 before the check).
#[test]
fn argmax_refuses_a_row_past_the_loop_limit() {
    let g = gpu();
    let Some(max) = limit(g) else { return };
    let largest = max as usize * 256;
    for (n, fits) in [(largest, true), (largest + 1, false)] {
        let mut logits = vec![0.0f32; n];
        logits[n - 3] = 5.0;
        let logits = g.upload(&logits).unwrap();
        let mut out = g.filled(1, u32::MAX).unwrap();
        let result = record(g, |rec| execute_argmax(rec, &logits, n, &mut out, 0));
        if fits {
            result.unwrap();
            assert_eq!(out.read(g).unwrap(), [n as u32 - 3], "n = {n}");
        } else {
            assert_refused(&format!("n {n}"), result, "argmax");
        }
    }
}
