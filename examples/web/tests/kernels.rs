//! The kernel library in a web page: each family against its f64 reference at small shapes,
//! outputs poisoned with NaN, on the browser's WebGPU (headless Chromium: `scripts/web-test`).
//! The same checks as the native tests; only opening the device and reading back are awaited.

#![cfg(target_arch = "wasm32")]

use hesper_exec::{Gpu, GpuBuffer};
use hesper_kernels::testing::{Rng, assert_close, f64s};
use hesper_kernels::{ffn, linear, norm};
use wasm_bindgen_test::{wasm_bindgen_test, wasm_bindgen_test_configure};

wasm_bindgen_test_configure!(run_in_browser);

async fn read(gpu: &Gpu, b: &GpuBuffer<f32>) -> Vec<f32> {
    b.read_async(gpu).await.expect("readback")
}

#[wasm_bindgen_test]
async fn elementwise_swiglu_forward_matches_reference() {
    let g = Gpu::new_async().await.expect("a WebGPU adapter");
    let n = 1000;
    let mut rng = Rng::new(1);
    let (gate, up) = (rng.vec(n, 3.0), rng.vec(n, 1.0));
    let (gb, ub) = (g.upload(&gate).unwrap(), g.upload(&up).unwrap());
    let mut h = g.filled(n, f32::NAN).unwrap();
    let mut rec = g.recorder();
    ffn::execute_swiglu_forward(&mut rec, &gb, &ub, &mut h).unwrap();
    rec.submit().unwrap();
    let want = ffn::reference::swiglu_forward(&f64s(&gate), &f64s(&up));
    assert_close("swiglu h", &read(&g, &h).await, &want, 1e-5, 1e-6);
}

#[wasm_bindgen_test]
async fn rms_norm_forward_matches_reference() {
    let g = Gpu::new_async().await.expect("a WebGPU adapter");
    let (rows, cols, eps) = (5, 300, 1e-5f32);
    let mut rng = Rng::new(2);
    let (x, gamma) = (rng.vec(rows * cols, 2.0), rng.vec(cols, 1.5));
    let (xb, gb) = (g.upload(&x).unwrap(), g.upload(&gamma).unwrap());
    let mut y = g.filled(rows * cols, f32::NAN).unwrap();
    let mut rstd = g.filled(rows, f32::NAN).unwrap();
    let mut rec = g.recorder();
    norm::execute_rms_norm_forward(&mut rec, &xb, &gb, &mut y, &mut rstd, eps).unwrap();
    rec.submit().unwrap();
    let (want_y, want_r) =
        norm::reference::rms_norm_forward(&f64s(&x), &f64s(&gamma), eps as f64);
    assert_close("rms_norm y", &read(&g, &y).await, &want_y, 1e-5, 1e-6);
    assert_close("rms_norm rstd", &read(&g, &rstd).await, &want_r, 1e-5, 0.0);
}

#[wasm_bindgen_test]
async fn gemm_matches_reference() {
    let g = Gpu::new_async().await.expect("a WebGPU adapter");
    let (m, n, k) = (37, 29, 70);
    let mut rng = Rng::new(3);
    let (x, w) = (rng.vec(m * k, 1.0), rng.vec(n * k, 1.0));
    let (xb, wb) = (g.upload(&x).unwrap(), g.upload(&w).unwrap());
    let mut y = g.filled(m * n, f32::NAN).unwrap();
    let mut rec = g.recorder();
    linear::execute_matmul_nt(&mut rec, &xb, &wb, &mut y, m, n, k, false).unwrap();
    rec.submit().unwrap();
    let want = linear::reference::matmul_nt(&f64s(&x), &f64s(&w), m, n, k);
    assert_close("matmul_nt", &read(&g, &y).await, &want, 1e-5, 1e-5);
}
