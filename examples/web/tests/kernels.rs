//! The kernel library in a web page: each family against its f64 reference at small shapes,
//! outputs poisoned with NaN, on the browser's WebGPU (headless Chromium: `scripts/web-test`).
//! The same checks and tolerances as the native tests (`hesper-kernels/tests/`); only opening
//! the device and reading back are awaited. The browser's device has no subgroups, no f16 and
//! at most 256 invocations a workgroup, so every kernel runs its portable path.

#![cfg(target_arch = "wasm32")]

use hesper_exec::{Element, Gpu, GpuBuffer};
use hesper_kernels::attention::{self, DecodeGrads, DecodeInputs, DecodeShape};
use hesper_kernels::linear;
use hesper_kernels::lora::{self, LoraBackward};
use hesper_kernels::loss::{self, IGNORE_INDEX, LossOutputs};
use hesper_kernels::optim::{self, AdamW, Clip, Step};
use hesper_kernels::rope::{self, Positions, RopeTable};
use hesper_kernels::testing::{Rng, assert_close, f64s, f64s_nan_as_zero};
use hesper_kernels::{ffn, norm};
use wasm_bindgen_test::{wasm_bindgen_test, wasm_bindgen_test_configure};

wasm_bindgen_test_configure!(run_in_browser);

async fn gpu() -> Gpu {
    Gpu::new_async().await.expect("a WebGPU adapter")
}

async fn read<T: Element>(gpu: &Gpu, b: &GpuBuffer<T>) -> Vec<T> {
    b.read_async(gpu).await.expect("readback")
}

/// `base + add`, elementwise: the reference of an output the kernel adds to.
fn plus(base: &[f32], add: &[f64]) -> Vec<f64> {
    base.iter().zip(add).map(|(b, a)| *b as f64 + a).collect()
}

/// relu²·mul and SwiGLU, forward and backward (`tests/ffn.rs`): lengths below, at and past
/// one workgroup's 1024 elements, and not multiples of 4.
#[wasm_bindgen_test]
async fn elementwise_matches_reference() {
    let g = gpu().await;
    for (seed, n) in [3usize, 1000, 4099].into_iter().enumerate() {
        let mut rng = Rng::new(seed as u64 + 100);
        let (gate, up, dh) = (rng.vec(n, 4.0), rng.vec(n, 2.0), rng.vec(n, 1.0));
        let (gb, ub, db) = (
            g.upload(&gate).unwrap(),
            g.upload(&up).unwrap(),
            g.upload(&dh).unwrap(),
        );
        let nan = |n: usize| g.filled(n, f32::NAN).unwrap();
        let (mut h_relu, mut h_swiglu) = (nan(n), nan(n));
        let (mut dg_relu, mut du_relu, mut dg_swiglu, mut du_swiglu) =
            (nan(n), nan(n), nan(n), nan(n));
        let mut rec = g.recorder();
        ffn::execute_relu_sqr_mul_forward(&mut rec, &gb, &ub, &mut h_relu).unwrap();
        ffn::execute_swiglu_forward(&mut rec, &gb, &ub, &mut h_swiglu).unwrap();
        ffn::execute_relu_sqr_mul_backward(&mut rec, &gb, &ub, &db, &mut dg_relu, &mut du_relu)
            .unwrap();
        ffn::execute_swiglu_backward(&mut rec, &gb, &ub, &db, &mut dg_swiglu, &mut du_swiglu)
            .unwrap();
        rec.submit().unwrap();

        let (gate, up, dh) = (f64s(&gate), f64s(&up), f64s(&dh));
        let want = ffn::reference::relu_sqr_mul_forward(&gate, &up);
        let what = format!("relu_sqr_mul n={n}");
        assert_close(&what, &read(&g, &h_relu).await, &want, 1e-6, 1e-6);
        let (want_g, want_u) = ffn::reference::relu_sqr_mul_backward(&gate, &up, &dh);
        let what = format!("relu_sqr_mul_backward n={n}");
        assert_close(
            &format!("{what} d_gate"),
            &read(&g, &dg_relu).await,
            &want_g,
            1e-6,
            1e-6,
        );
        assert_close(
            &format!("{what} d_up"),
            &read(&g, &du_relu).await,
            &want_u,
            1e-6,
            1e-6,
        );

        let want = ffn::reference::swiglu_forward(&gate, &up);
        let what = format!("swiglu n={n}");
        assert_close(&what, &read(&g, &h_swiglu).await, &want, 1e-5, 1e-6);
        let (want_g, want_u) = ffn::reference::swiglu_backward(&gate, &up, &dh);
        let what = format!("swiglu_backward n={n}");
        assert_close(
            &format!("{what} d_gate"),
            &read(&g, &dg_swiglu).await,
            &want_g,
            1e-5,
            1e-6,
        );
        assert_close(
            &format!("{what} d_up"),
            &read(&g, &du_swiglu).await,
            &want_u,
            1e-5,
            1e-6,
        );
    }
}

/// SwiGLU over rows of gate then up (`tests/ffn.rs`'s packed test): one vec4 a row, and rows
/// wider than a workgroup.
#[wasm_bindgen_test]
async fn swiglu_packed_matches_reference() {
    let g = gpu().await;
    for (seed, (rows, width)) in [(3usize, 4usize), (5, 1028)].into_iter().enumerate() {
        let mut rng = Rng::new(seed as u64 + 300);
        let n = rows * width;
        let (gate, up, dh) = (rng.vec(n, 4.0), rng.vec(n, 2.0), rng.vec(n, 1.0));
        let packed: Vec<f32> = gate
            .chunks(width)
            .zip(up.chunks(width))
            .flat_map(|(g, u)| g.iter().chain(u).copied())
            .collect();
        let gate_up = g.upload(&packed).unwrap();
        let d_h = g.upload(&dh).unwrap();
        let mut h = g.filled(n, f32::NAN).unwrap();
        let mut d_gate_up = g.filled(2 * n, f32::NAN).unwrap();
        let mut rec = g.recorder();
        ffn::execute_swiglu_packed_forward(&mut rec, &gate_up, width, &mut h).unwrap();
        ffn::execute_swiglu_packed_backward(&mut rec, &gate_up, width, &d_h, &mut d_gate_up)
            .unwrap();
        rec.submit().unwrap();
        let (gate, up, dh) = (f64s(&gate), f64s(&up), f64s(&dh));
        let want = ffn::reference::swiglu_forward(&gate, &up);
        let what = format!("swiglu_packed {rows}×{width}");
        assert_close(&what, &read(&g, &h).await, &want, 1e-5, 1e-6);
        let (want_g, want_u) = ffn::reference::swiglu_backward(&gate, &up, &dh);
        let want: Vec<f64> = want_g
            .chunks(width)
            .zip(want_u.chunks(width))
            .flat_map(|(g, u)| g.iter().chain(u).copied())
            .collect();
        let what = format!("swiglu_packed_backward {rows}×{width}");
        assert_close(&what, &read(&g, &d_gate_up).await, &want, 1e-5, 1e-6);
    }
}

/// RMSNorm forward, backward (overwriting and added to a residual) and dγ (`tests/norm.rs`):
/// a scalar row, a vec4 row past the 256-invocation workgroup, and one of three vec4s an
/// invocation.
#[wasm_bindgen_test]
async fn rms_norm_matches_reference() {
    let g = gpu().await;
    let eps = 1e-5f32;
    for (seed, (rows, cols)) in [(1, 7), (5, 300), (4, 576)].into_iter().enumerate() {
        let mut rng = Rng::new(seed as u64 + 1);
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
        let mut y = g.filled(rows * cols, f32::NAN).unwrap();
        let mut rstd = g.filled(rows, f32::NAN).unwrap();
        let mut dx = g.filled(rows * cols, f32::NAN).unwrap();
        let mut dx_acc = g.upload(&residual).unwrap();
        let mut scratch = g
            .filled(norm::dgamma_scratch_len(rows, cols), f32::NAN)
            .unwrap();
        let mut dgamma = g.filled(cols, f32::NAN).unwrap();
        let mut rec = g.recorder();
        norm::execute_rms_norm_forward(&mut rec, &xb, &gb, &mut y, &mut rstd, eps).unwrap();
        norm::execute_rms_norm_backward(&mut rec, &xb, &gb, &rstd, &dyb, &mut dx, false).unwrap();
        norm::execute_rms_norm_backward(&mut rec, &xb, &gb, &rstd, &dyb, &mut dx_acc, true)
            .unwrap();
        norm::execute_rms_norm_dgamma(&mut rec, &xb, &rstd, &dyb, &mut scratch, &mut dgamma)
            .unwrap();
        rec.submit().unwrap();

        let (x, gamma, dy) = (f64s(&x), f64s(&gamma), f64s(&dy));
        let (want_y, want_r) = norm::reference::rms_norm_forward(&x, &gamma, eps as f64);
        let (want_dx, want_dgamma) =
            norm::reference::rms_norm_backward(&x, &gamma, &dy, eps as f64);
        let what = format!("rms_norm {rows}x{cols}");
        assert_close(
            &format!("{what} y"),
            &read(&g, &y).await,
            &want_y,
            1e-5,
            1e-6,
        );
        assert_close(
            &format!("{what} rstd"),
            &read(&g, &rstd).await,
            &want_r,
            1e-5,
            0.0,
        );
        assert_close(
            &format!("{what} dx"),
            &read(&g, &dx).await,
            &want_dx,
            1e-4,
            1e-5,
        );
        let want_acc = plus(&residual, &want_dx);
        assert_close(
            &format!("{what} dx +="),
            &read(&g, &dx_acc).await,
            &want_acc,
            1e-4,
            1e-5,
        );
        assert_close(
            &format!("{what} dgamma"),
            &read(&g, &dgamma).await,
            &want_dgamma,
            1e-4,
            1e-5,
        );
    }
}

/// The softmax backward (`tests/attention.rs`): rows shorter and longer than a workgroup.
#[wasm_bindgen_test]
async fn softmax_backward_matches_reference() {
    let g = gpu().await;
    for (seed, (rows, cols)) in [(1, 1), (3, 7), (5, 1000)].into_iter().enumerate() {
        let mut rng = Rng::new(seed as u64 + 40);
        // Rows of real probabilities.
        let mut p = rng.vec(rows * cols, 3.0);
        for row in p.chunks_mut(cols) {
            let m = row.iter().cloned().fold(f32::MIN, f32::max);
            let z: f32 = row.iter().map(|v| (v - m).exp()).sum();
            row.iter_mut().for_each(|v| *v = (*v - m).exp() / z);
        }
        let dp = rng.vec(rows * cols, 1.0);
        let (pb, dpb) = (g.upload(&p).unwrap(), g.upload(&dp).unwrap());
        let mut ds = g.filled(rows * cols, f32::NAN).unwrap();
        let mut rec = g.recorder();
        attention::execute_softmax_backward(&mut rec, &pb, &dpb, cols, &mut ds).unwrap();
        rec.submit().unwrap();
        let want = attention::reference::softmax_backward(&f64s(&p), &f64s(&dp), cols);
        let what = format!("softmax_backward {rows}x{cols}");
        assert_close(&what, &read(&g, &ds).await, &want, 1e-5, 1e-7);
    }
}

/// f32 dot products of length `depth` (`tests/linear.rs`).
fn gemm_tolerance(depth: usize) -> (f64, f64) {
    (1e-5, 1e-5 * (depth.max(1) as f64).sqrt())
}

fn random_ternary(rng: &mut Rng, len: usize) -> Vec<i8> {
    (0..len).map(|_| (rng.next_u32() % 3) as i8 - 1).collect()
}

/// The GEMM entry points `·Wᵀ`, `·W` and the ternary `·Wᵀ`, at the tile they pick
/// (`tests/linear.rs`). Three pipelines only: SwiftShader takes ~1.7 s to compile each GEMM.
#[wasm_bindgen_test]
async fn gemm_matches_reference() {
    let g = gpu().await;
    let scale = 0.37f32;
    let (m, n, k) = (70, 36, 52);
    let mut rng = Rng::new(99);
    let (x, dy, w) = (
        rng.vec(m * k, 1.0),
        rng.vec(m * n, 1.0),
        rng.vec(n * k, 1.0),
    );
    let t = random_ternary(&mut rng, n * k);
    let (xb, dyb, wb) = (
        g.upload(&x).unwrap(),
        g.upload(&dy).unwrap(),
        g.upload(&w).unwrap(),
    );
    let packed = g.upload(&linear::pack_ternary(&t).unwrap()).unwrap();
    let mut y = g.filled(m * n, f32::NAN).unwrap();
    let mut dx = g.filled(m * k, f32::NAN).unwrap();
    let mut y_bit = g.filled(m * n, f32::NAN).unwrap();
    let mut rec = g.recorder();
    linear::execute_matmul_nt(&mut rec, &xb, &wb, &mut y, m, n, k, false).unwrap();
    linear::execute_matmul_nn(&mut rec, &dyb, &wb, &mut dx, m, n, k, false).unwrap();
    linear::execute_bitlinear_forward(&mut rec, &xb, &packed, scale, &mut y_bit, m, n, k, false)
        .unwrap();
    rec.submit().unwrap();

    let (x64, dy64, w64) = (f64s(&x), f64s(&dy), f64s(&w));
    let (rtol, atol_k) = gemm_tolerance(k);
    let (_, atol_n) = gemm_tolerance(n);
    let want_y = linear::reference::matmul_nt(&x64, &w64, m, n, k);
    assert_close("matmul_nt", &read(&g, &y).await, &want_y, rtol, atol_k);
    let want_dx = linear::reference::matmul_nn(&dy64, &w64, m, n, k);
    assert_close("matmul_nn", &read(&g, &dx).await, &want_dx, rtol, atol_n);
    let dequantized = linear::reference::dequantize(&t, scale as f64);
    let want = linear::reference::matmul_nt(&x64, &dequantized, m, n, k);
    assert_close(
        "bitlinear_forward",
        &read(&g, &y_bit).await,
        &want,
        rtol,
        atol_k,
    );
}

/// LoRA forward (added to `y`) and the fused backward (dA, dB, and dx added to)
/// (`tests/lora.rs`) at one shape: an input width that is a multiple of 4 (vec4 loads) and an
/// output width that is not (scalar loads), a rank that is not a multiple of 4, tokens past one
/// `lora_down` tile (16). One shape only: SwiftShader takes seconds to compile each of LoRA's
/// pipelines, whose keys hold the widths and the rank.
#[wasm_bindgen_test]
async fn lora_matches_reference() {
    let g = gpu().await;
    let scale = 2.0f32;
    // (tokens, in, out, rank)
    let shapes = [(37, 100, 130, 5)];
    for (seed, (t, input, output, r)) in shapes.into_iter().enumerate() {
        let mut rng = Rng::new(seed as u64 + 11);
        let x = rng.vec(t * input, 1.0);
        let (a, b) = (rng.vec(r * input, 0.5), rng.vec(output * r, 0.5));
        let (y0, dy, dx0) = (
            rng.vec(t * output, 1.0),
            rng.vec(t * output, 1.0),
            rng.vec(t * input, 1.0),
        );
        let (xb, ab, bb, dyb) = (
            g.upload(&x).unwrap(),
            g.upload(&a).unwrap(),
            g.upload(&b).unwrap(),
            g.upload(&dy).unwrap(),
        );
        let mut y = g.upload(&y0).unwrap();
        let mut h = g.filled(t * r, f32::NAN).unwrap();
        let mut dh = g.filled(t * r, f32::NAN).unwrap();
        let mut scratch = g
            .filled(lora::lora_scratch_len(t, input + output, r), f32::NAN)
            .unwrap();
        let (mut da, mut db) = (
            g.filled(r * input, f32::NAN).unwrap(),
            g.filled(output * r, f32::NAN).unwrap(),
        );
        let mut dx = g.upload(&dx0).unwrap();
        let mut rec = g.recorder();
        lora::execute_lora_forward(&mut rec, &xb, &ab, &bb, r, scale, &mut h, &mut y).unwrap();
        let inputs = LoraBackward {
            x: &xb,
            a: &ab,
            b: &bb,
            h: &h,
            dy: &dyb,
        };
        lora::execute_lora_backward(
            &mut rec,
            &inputs,
            r,
            scale,
            &mut dh,
            &mut scratch,
            &mut da,
            &mut db,
            &mut dx,
        )
        .unwrap();
        rec.submit().unwrap();

        let (x64, a64, b64) = (f64s(&x), f64s(&a), f64s(&b));
        let (want_h, want_y) =
            lora::reference::lora_forward(&x64, &a64, &b64, &f64s(&y0), r, scale as f64);
        let (want_da, want_db, want_dx) =
            lora::reference::lora_backward(&x64, &a64, &b64, &f64s(&dy), r, scale as f64);
        let what = format!("lora T={t} in={input} out={output} r={r}");
        assert_close(
            &format!("{what} h"),
            &read(&g, &h).await,
            &want_h,
            1e-5,
            1e-5,
        );
        assert_close(
            &format!("{what} y"),
            &read(&g, &y).await,
            &want_y,
            1e-5,
            1e-5,
        );
        assert_close(
            &format!("{what} dA"),
            &read(&g, &da).await,
            &want_da,
            1e-5,
            1e-4,
        );
        assert_close(
            &format!("{what} dB"),
            &read(&g, &db).await,
            &want_db,
            1e-5,
            1e-4,
        );
        let want_dx = plus(&dx0, &want_dx);
        assert_close(
            &format!("{what} dx"),
            &read(&g, &dx).await,
            &want_dx,
            1e-5,
            1e-4,
        );
    }
}

const OPT: AdamW = AdamW {
    beta1: 0.9,
    beta2: 0.999,
    eps: 1e-8,
    weight_decay: 0.1,
};

/// One trained tensor on the GPU and its f64 twin: random θ, and m, v as after some training
/// (`tests/optim.rs`).
struct Tensor {
    theta: GpuBuffer<f32>,
    m: GpuBuffer<f32>,
    v: GpuBuffer<f32>,
    want: optim::reference::State,
}

impl Tensor {
    fn random(g: &Gpu, rng: &mut Rng, n: usize) -> Tensor {
        let theta = rng.vec(n, 1.0);
        let m = rng.vec(n, 0.1);
        let v: Vec<f32> = rng.vec(n, 0.1).iter().map(|x| x * x).collect();
        Tensor {
            theta: g.upload(&theta).unwrap(),
            m: g.upload(&m).unwrap(),
            v: g.upload(&v).unwrap(),
            want: optim::reference::State {
                theta: f64s(&theta),
                m: f64s(&m),
                v: f64s(&v),
            },
        }
    }

    async fn check(&self, g: &Gpu, what: &str) {
        let s = &self.want;
        assert_close(
            &format!("{what} theta"),
            &read(g, &self.theta).await,
            &s.theta,
            1e-6,
            1e-6,
        );
        assert_close(
            &format!("{what} m"),
            &read(g, &self.m).await,
            &s.m,
            1e-6,
            1e-7,
        );
        assert_close(
            &format!("{what} v"),
            &read(g, &self.v).await,
            &s.v,
            1e-6,
            0.0,
        );
    }
}

/// Gradient buffers of these lengths with their f64 copies; padding past the last element is
/// NaN, as a vec4 kernel may leave it.
fn random_grads(g: &Gpu, rng: &mut Rng, lens: &[usize]) -> (Vec<GpuBuffer<f32>>, Vec<Vec<f64>>) {
    lens.iter()
        .map(|&n| {
            let x = rng.vec(n, 1.0);
            let buf = g.filled(n, f32::NAN).unwrap();
            buf.write(g, &x).unwrap();
            (buf, f64s(&x))
        })
        .unzip()
}

/// AdamW steps without clipping, the global gradient norm (into NaN-poisoned scratch), and a
/// step clipped by that norm in the same recorder (`tests/optim.rs`).
#[wasm_bindgen_test]
async fn adamw_and_grad_norm_match_reference() {
    let g = gpu().await;
    let lr = |t: u32| 1e-2 / t as f32;
    for (seed, n) in [1usize, 3, 1000, 4099].into_iter().enumerate() {
        let mut rng = Rng::new(seed as u64 + 200);
        let mut tensor = Tensor::random(&g, &mut rng, n);
        for t in 1..=2 {
            let grad = rng.vec(n, 1.0);
            let grad_buf = g.upload(&grad).unwrap();
            let step = Step {
                lr: lr(t),
                t,
                clip: Clip::None,
            };
            let mut rec = g.recorder();
            let Tensor { theta, m, v, want } = &mut tensor;
            optim::execute_adamw(&mut rec, &OPT, &step, theta, &grad_buf, m, v).unwrap();
            rec.submit().unwrap();
            optim::reference::adamw_step(&OPT, lr(t) as f64, t, &f64s(&grad), want);
            tensor.check(&g, &format!("adamw n={n} t={t}")).await;
        }
    }

    // The norm's two passes; the relative error of a sum of squares is under 1e-6.
    let cases: [&[usize]; 4] = [&[1], &[0, 17], &[5000, 1000, 3], &[]];
    for (seed, lens) in cases.into_iter().enumerate() {
        let mut rng = Rng::new(seed as u64 + 300);
        let (bufs, host) = random_grads(&g, &mut rng, lens);
        let host_refs: Vec<&[f64]> = host.iter().map(|h| h.as_slice()).collect();
        let want = optim::reference::global_grad_norm(&host_refs);
        let refs: Vec<&GpuBuffer<f32>> = bufs.iter().collect();
        let len = optim::grad_norm_partials_len(lens.iter().copied());
        let mut partials = g.filled(len, f32::NAN).unwrap();
        let mut norm = g.filled(1, f32::NAN).unwrap();
        let mut rec = g.recorder();
        optim::execute_global_grad_norm(&mut rec, &refs, &mut partials, &mut norm).unwrap();
        rec.submit().unwrap();
        let what = format!("grad norm of {lens:?}");
        assert_close(&what, &read(&g, &norm).await, &[want], 1e-6, 0.0);
    }

    // Norm and a clipped AdamW step of two tensors in one recorder, max_norm a quarter of the
    // norm (clipping engaged).
    let lens = [1000, 3];
    let mut rng = Rng::new(400);
    let mut tensors: Vec<Tensor> = lens
        .iter()
        .map(|&n| Tensor::random(&g, &mut rng, n))
        .collect();
    let (grads, host) = random_grads(&g, &mut rng, &lens);
    let host_refs: Vec<&[f64]> = host.iter().map(|h| h.as_slice()).collect();
    let want_norm = optim::reference::global_grad_norm(&host_refs);
    let max_norm = (0.25 * want_norm) as f32;
    let coef = optim::reference::clip_coefficient(want_norm, max_norm as f64);
    assert!(coef < 1.0, "coefficient {coef}");
    let mut partials = g
        .filled(optim::grad_norm_partials_len(lens), f32::NAN)
        .unwrap();
    let mut norm = g.filled(1, f32::NAN).unwrap();
    let mut rec = g.recorder();
    let refs: Vec<&GpuBuffer<f32>> = grads.iter().collect();
    optim::execute_global_grad_norm(&mut rec, &refs, &mut partials, &mut norm).unwrap();
    let step = Step {
        lr: lr(1),
        t: 1,
        clip: Clip::GlobalNorm {
            norm: &norm,
            max_norm,
        },
    };
    for (tensor, grad) in tensors.iter_mut().zip(&grads) {
        let Tensor { theta, m, v, .. } = tensor;
        optim::execute_adamw(&mut rec, &OPT, &step, theta, grad, m, v).unwrap();
    }
    rec.submit().unwrap();
    assert_close(
        "clipped norm",
        &read(&g, &norm).await,
        &[want_norm],
        1e-6,
        0.0,
    );
    for ((tensor, grad), n) in tensors.iter_mut().zip(&host).zip(lens) {
        let clipped: Vec<f64> = grad.iter().map(|x| x * coef).collect();
        optim::reference::adamw_step(&OPT, lr(1) as f64, 1, &clipped, &mut tensor.want);
        tensor.check(&g, &format!("clipped adamw n={n}")).await;
    }
}

/// A cache with rows past `L` set to NaN: a kernel that reads past the cached positions, or
/// strides by `L` for `max_seq`, shows up (`tests/attention.rs`).
fn cache(rng: &mut Rng, shape: &DecodeShape) -> Vec<f32> {
    let mut c = rng.vec(shape.kv_heads * shape.max_seq * shape.head_dim, 1.0);
    for kv in 0..shape.kv_heads {
        for s in shape.pos + 1..shape.max_seq {
            let at = (kv * shape.max_seq + s) * shape.head_dim;
            c[at..at + shape.head_dim].fill(f32::NAN);
        }
    }
    c
}

/// One decoded token's attention backward: dQ (through RoPE's backward), dK and dV added to
/// the caches' gradients (`tests/attention.rs`).
#[wasm_bindgen_test]
async fn decode_attention_backward_matches_reference() {
    let g = gpu().await;
    let shape = |heads, kv_heads, head_dim, max_seq, pos| DecodeShape {
        heads,
        kv_heads,
        head_dim,
        max_seq,
        pos,
    };
    let shapes = [
        shape(4, 2, 8, 16, 0),
        shape(4, 2, 8, 16, 9),
        shape(3, 1, 64, 40, 33),
        shape(2, 2, 128, 300, 299),
    ];
    for (seed, shape) in shapes.into_iter().enumerate() {
        let mut rng = Rng::new(seed as u64 + 60);
        let (h, hd, len) = (shape.heads, shape.head_dim, shape.pos + 1);
        let q = rng.vec(h * hd, 1.0);
        let (k_cache, v_cache) = (cache(&mut rng, &shape), cache(&mut rng, &shape));
        let d_out = rng.vec(h * hd, 1.0);
        let a: Vec<f32> = attention::reference::decode_probs(&shape, &f64s(&q), &f64s(&k_cache))
            .iter()
            .map(|v| *v as f32)
            .collect();
        let table = RopeTable::new(&g, hd, 10_000.0, shape.max_seq).unwrap();
        let cache_len = k_cache.len();
        let (dk0, dv0) = (rng.vec(cache_len, 1.0), rng.vec(cache_len, 1.0));

        let up = |v: &[f32]| g.upload(v).unwrap();
        let (qb, ab, dob, kb, vb) = (up(&q), up(&a), up(&d_out), up(&k_cache), up(&v_cache));
        let mut d_attn = g.filled(h * len, f32::NAN).unwrap();
        let mut d_scores = g.filled(h * len, f32::NAN).unwrap();
        let mut d_q = g.filled(h * hd, f32::NAN).unwrap();
        let (mut dk, mut dv) = (up(&dk0), up(&dv0));
        let mut rec = g.recorder();
        let inputs = DecodeInputs {
            q: &qb,
            attn: &ab,
            d_out: &dob,
            k_cache: &kb,
            v_cache: &vb,
            rope: &table,
        };
        let grads = DecodeGrads {
            d_attn: &mut d_attn,
            d_scores: &mut d_scores,
            d_q: &mut d_q,
            d_k_cache: &mut dk,
            d_v_cache: &mut dv,
        };
        attention::execute_decode_attention_backward(&mut rec, shape, &inputs, grads).unwrap();
        rec.submit().unwrap();
        let (want_dq, want_dk, want_dv) = attention::reference::decode_backward(
            &shape,
            &f64s(&q),
            &f64s_nan_as_zero(&k_cache),
            &f64s_nan_as_zero(&v_cache),
            &f64s(&d_out),
        );
        let want_dq = rope::reference::rope(&want_dq, (hd, 10_000.0), h, 1, shape.pos, true);
        let what = format!("{shape:?}");
        assert_close(
            &format!("dQ {what}"),
            &read(&g, &d_q).await,
            &want_dq,
            1e-4,
            1e-5,
        );
        let want_dk = plus(&dk0, &want_dk);
        assert_close(
            &format!("dK {what}"),
            &read(&g, &dk).await,
            &want_dk,
            1e-4,
            1e-5,
        );
        let want_dv = plus(&dv0, &want_dv);
        assert_close(
            &format!("dV {what}"),
            &read(&g, &dv).await,
            &want_dv,
            1e-4,
            1e-5,
        );
    }
}
/// Labels uniform over the vocabulary, one in four masked: by [`IGNORE_INDEX`] or by a label
/// just outside `0..V` (`tests/loss.rs`).
fn labels(rng: &mut Rng, t: usize, v: usize) -> Vec<i32> {
    (0..t)
        .map(|_| match rng.next_u32() % 12 {
            0 | 1 => IGNORE_INDEX,
            2 => [-1, v as i32][rng.next_u32() as usize % 2],
            _ => (rng.next_u32() as usize % v) as i32,
        })
        .collect()
}

/// Cross-entropy, fused with its gradient and forward only (`tests/loss.rs`): the token losses,
/// the mean, the target count `N` and `dz` against the reference, masked rows exactly 0;
/// vocabularies below and past the 256-invocation row, floats and vec4s, and one past whole
/// unrolled strides ending in a ragged one.
#[wasm_bindgen_test]
async fn cross_entropy_matches_reference() {
    let g = gpu().await;
    let (rtol, loss_atol) = (1e-5, 1e-6);
    for (seed, (t, v)) in [(5, 7), (33, 7), (5, 1000), (2, 20_001)]
        .into_iter()
        .enumerate()
    {
        let mut rng = Rng::new(seed as u64);
        let (logits, labels) = (rng.vec(t * v, 4.0), labels(&mut rng, t, v));
        let z = f64s(&logits);
        let (want_token, want_loss, n) = loss::reference::cross_entropy_forward(&z, &labels, v);
        let masked: Vec<usize> = (0..t)
            .filter(|&i| !loss::reference::is_target(labels[i], v))
            .collect();
        let (zb, yb) = (g.upload(&logits).unwrap(), g.upload(&labels).unwrap());
        for with_grad in [true, false] {
            let mut d_logits = g.filled(t * v, f32::NAN).unwrap();
            let mut token_loss = g.filled(t, f32::NAN).unwrap();
            let mut mean = g.filled(1, f32::NAN).unwrap();
            let mut count = g.filled(1, u32::MAX).unwrap();
            let losses = LossOutputs {
                token_loss: &mut token_loss,
                loss: &mut mean,
                count: &mut count,
            };
            let mut rec = g.recorder();
            if with_grad {
                loss::execute_cross_entropy(&mut rec, &zb, &yb, v, &mut d_logits, losses).unwrap();
            } else {
                loss::execute_cross_entropy_forward(&mut rec, &zb, &yb, v, losses).unwrap();
            }
            rec.submit().unwrap();

            let what = format!("cross_entropy T={t} V={v} gradient {with_grad}");
            assert_eq!(read(&g, &count).await, [n as u32], "{what}: N");
            let got_token = read(&g, &token_loss).await;
            let token_what = format!("{what} token_loss");
            assert_close(&token_what, &got_token, &want_token, rtol, loss_atol);
            let got_mean = read(&g, &mean).await;
            assert_close(
                &format!("{what} loss"),
                &got_mean,
                &[want_loss],
                rtol,
                loss_atol,
            );
            for &i in &masked {
                assert_eq!(got_token[i], 0.0, "{what}: masked token {i}'s loss");
            }
            if !with_grad {
                continue;
            }
            let got_d = read(&g, &d_logits).await;
            let want_d = loss::reference::cross_entropy_backward(&z, &labels, v);
            let dz_atol = 1e-6 / n.max(1) as f64;
            assert_close(&format!("{what} d_logits"), &got_d, &want_d, rtol, dz_atol);
            for &i in &masked {
                assert!(
                    got_d[i * v..(i + 1) * v].iter().all(|d| *d == 0.0),
                    "{what}: masked row {i} of d_logits is not 0"
                );
            }
        }
    }
}

/// The lm-head's backward as the step runs it (`tests/loss.rs`): `cross_entropy_stats` (each
/// row's `(lse, 1/N)`, masked rows exactly `(0, 0)`, and the token losses) and `dn = dz·E` by
/// the f32 GEMM with `dz` computed from the logits as it reads them (`loss::CrossEntropyGrad`),
/// against the f64 product of the reference's `dz`.
#[wasm_bindgen_test]
async fn cross_entropy_gradient_prologue_matches_reference() {
    use linear::fusion::Fusion;
    use linear::{Gemm, Product, Weights};
    let g = gpu().await;
    for (seed, (t, v, d)) in [(7, 1001, 24), (5, 4096, 16)].into_iter().enumerate() {
        let mut rng = Rng::new(seed as u64 + 50);
        let (logits, labels) = (rng.vec(t * v, 4.0), labels(&mut rng, t, v));
        let e = rng.vec(v * d, 1.0);
        let (zb, yb, eb) = (
            g.upload(&logits).unwrap(),
            g.upload(&labels).unwrap(),
            g.upload(&e).unwrap(),
        );
        let mut count = g.filled(1, u32::MAX).unwrap();
        let mut stats = g.filled(t * loss::STATS_PER_TOKEN, f32::NAN).unwrap();
        let mut token_loss = g.filled(t, f32::NAN).unwrap();
        let mut dn = g.filled(t * d, f32::NAN).unwrap();
        let mut rec = g.recorder();
        loss::execute_cross_entropy_count(&mut rec, &yb, v, &mut count).unwrap();
        loss::execute_cross_entropy_stats(
            &mut rec,
            &zb,
            &yb,
            v,
            &count,
            &mut stats,
            &mut token_loss,
        )
        .unwrap();
        let grad = loss::CrossEntropyGrad {
            stats: &stats,
            labels: &yb,
        };
        let fusion = Fusion {
            prologue: Some(&grad),
            epilogues: &[],
        };
        let gemm = Gemm::new(Product::Nn, (t, v, d), false);
        linear::execute_gemm_fused(&mut rec, &gemm, &fusion, &zb, Weights::Dense(&eb), &mut dn)
            .unwrap();
        rec.submit().unwrap();

        let what = format!("the lm-head's backward T={t} V={v} D={d}");
        let z = f64s(&logits);
        let (want_token, _, n) = loss::reference::cross_entropy_forward(&z, &labels, v);
        let want_stats: Vec<f64> = (0..t)
            .flat_map(|r| match loss::reference::is_target(labels[r], v) {
                true => [
                    want_token[r] + z[r * v + labels[r] as usize],
                    1.0 / n as f64,
                ],
                false => [0.0, 0.0],
            })
            .collect();
        let got_stats = read(&g, &stats).await;
        assert_close(
            &format!("{what} stats"),
            &got_stats,
            &want_stats,
            1e-5,
            1e-6,
        );
        let got_token = read(&g, &token_loss).await;
        assert_close(
            &format!("{what} token_loss"),
            &got_token,
            &want_token,
            1e-5,
            1e-6,
        );
        let dz = loss::reference::cross_entropy_backward(&z, &labels, v);
        let got = read(&g, &dn).await;
        for r in 0..t {
            for c in 0..d {
                let terms = (0..v).map(|k| dz[r * v + k] * e[k * d + c] as f64);
                let (want, bound) = terms.fold((0.0, 0.0), |(s, b), x| (s + x, b + x.abs()));
                let got = got[r * d + c] as f64;
                assert!(
                    (got - want).abs() <= 1e-5 * bound + 1e-9,
                    "{what}: dn[{r}, {c}] is {got} where {want} is expected"
                );
            }
        }
    }
}

/// RoPE forward and backward in place (`tests/rope.rs`): batches of sequences, one decoded
/// token far into its sequence, a head_dim whose half is not a power of two.
#[wasm_bindgen_test]
async fn rope_matches_reference() {
    let g = gpu().await;
    // (tokens, heads, head_dim, seq_len, offset)
    let cases = [
        (8, 2, 8, 4, 0),
        (6, 3, 64, 3, 5),
        (1, 4, 128, 1, 300),
        (10, 1, 6, 10, 0),
        (3, 2, 64, 1, 8000),
        (4, 1, 16, 2, 1500),
    ];
    for (seed, (t, heads, hd, seq_len, offset)) in cases.into_iter().enumerate() {
        let mut rng = Rng::new(seed as u64 + 3);
        let x = rng.vec(t * heads * hd, 1.0);
        let table = RopeTable::new(&g, hd, 10_000.0, offset + seq_len).unwrap();
        let pos = Positions {
            seq_len: seq_len as u32,
            offset: offset as u32,
        };
        for backward in [false, true] {
            let mut xb = g.upload(&x).unwrap();
            let mut rec = g.recorder();
            rope::execute_rope(&mut rec, &mut xb, &table, heads, pos, backward).unwrap();
            rec.submit().unwrap();
            let rope_of = (hd, 10_000.0);
            let want = rope::reference::rope(&f64s(&x), rope_of, heads, seq_len, offset, backward);
            let what =
                format!("rope T={t} heads={heads} hd={hd} offset={offset} backward={backward}");
            assert_close(&what, &read(&g, &xb).await, &want, 1e-6, 1e-6);
        }
    }
}

/// The decode forward after appending the token to the caches (`tests/attention.rs`).
#[wasm_bindgen_test]
async fn decode_attention_forward_matches_reference() {
    let g = gpu().await;
    for (seed, (heads, kv_heads, head_dim, max_seq, pos)) in [(4, 2, 8, 16, 9), (9, 3, 64, 40, 33)]
        .into_iter()
        .enumerate()
    {
        let shape = DecodeShape {
            heads,
            kv_heads,
            head_dim,
            max_seq,
            pos,
        };
        let mut rng = Rng::new(seed as u64 + 80);
        let q = rng.vec(heads * head_dim, 1.5);
        let mut k_cache = cache(&mut rng, &shape);
        let mut v_cache = cache(&mut rng, &shape);
        // The token's row arrives by the append kernel: NaN there until it runs.
        let (k_new, v_new) = (
            rng.vec(kv_heads * head_dim, 1.5),
            rng.vec(kv_heads * head_dim, 1.0),
        );
        let (mut kb, mut vb) = (g.upload(&k_cache).unwrap(), g.upload(&v_cache).unwrap());
        for kv in 0..kv_heads {
            let at = (kv * max_seq + pos) * head_dim;
            k_cache[at..at + head_dim].copy_from_slice(&k_new[kv * head_dim..][..head_dim]);
            v_cache[at..at + head_dim].copy_from_slice(&v_new[kv * head_dim..][..head_dim]);
        }
        let (qb, knb, vnb) = (
            g.upload(&q).unwrap(),
            g.upload(&k_new).unwrap(),
            g.upload(&v_new).unwrap(),
        );
        let mut attn = g.filled(heads * (pos + 1), f32::NAN).unwrap();
        let mut o = g.filled(heads * head_dim, f32::NAN).unwrap();
        let mut rec = g.recorder();
        attention::execute_kv_cache_append(&mut rec, shape, (&knb, &vnb), &mut kb, &mut vb)
            .unwrap();
        attention::execute_decode_attention(&mut rec, shape, &qb, (&kb, &vb), &mut attn, &mut o)
            .unwrap();
        rec.submit().unwrap();
        let want_a =
            attention::reference::decode_probs(&shape, &f64s(&q), &f64s_nan_as_zero(&k_cache));
        let want_o = attention::reference::decode_out(&shape, &want_a, &f64s_nan_as_zero(&v_cache));
        let what = format!("{shape:?}");
        assert_close(
            &format!("A {what}"),
            &read(&g, &attn).await,
            &want_a,
            1e-4,
            1e-6,
        );
        assert_close(
            &format!("O {what}"),
            &read(&g, &o).await,
            &want_o,
            1e-4,
            1e-5,
        );
    }
}

/// Causal attention over whole sequences, forward and backward, GQA and a padded batch
/// (`tests/attention_sequence.rs`).
#[wasm_bindgen_test]
async fn sequence_attention_matches_reference() {
    use attention::{SeqGrads, SeqInputs, SeqSaved, SeqShape, ValidLengths};
    let g = gpu().await;
    let cases: [(SeqShape, Option<&[usize]>); 2] = [
        (SeqShape::new(2, 37, 3, 1, 12), None),
        (SeqShape::new(3, 40, 4, 2, 64), Some(&[40, 1, 29])),
    ];
    for (seed, (shape, lens)) in cases.into_iter().enumerate() {
        let mut rng = Rng::new(seed as u64 + 700);
        let (q, k, v, d_out) = (
            rng.vec(shape.q_len(), 1.5),
            rng.vec(shape.kv_len(), 1.5),
            rng.vec(shape.kv_len(), 1.0),
            rng.vec(shape.q_len(), 1.0),
        );
        let valid = lens.map(|l| ValidLengths::upload(&g, l, shape.seq_len).unwrap());
        let up = |v: &[f32]| g.upload(v).unwrap();
        let (qb, kb, vb, dob) = (up(&q), up(&k), up(&v), up(&d_out));
        let nan = |n: usize| g.filled(n, f32::NAN).unwrap();
        let rows = shape.tokens() * shape.heads;
        let (mut o, mut lse, mut stats) = (nan(shape.q_len()), nan(rows), nan(2 * rows));
        let (mut dq, mut dk, mut dv) =
            (nan(shape.q_len()), nan(shape.kv_len()), nan(shape.kv_len()));
        let inputs = SeqInputs {
            q: &qb,
            k: &kb,
            v: &vb,
            lens: valid.as_ref(),
        };
        let mut rec = g.recorder();
        attention::execute_attention_forward(&mut rec, shape, inputs, &mut o, &mut lse).unwrap();
        rec.submit().unwrap();
        let mut rec = g.recorder();
        let saved = SeqSaved {
            inputs,
            o: &o,
            lse: &lse,
        };
        let grads = SeqGrads {
            stats: &mut stats,
            scores: None,
            d_q: &mut dq,
            d_k: &mut dk,
            d_v: &mut dv,
        };
        attention::execute_attention_backward(&mut rec, shape, saved, &dob, grads).unwrap();
        rec.submit().unwrap();

        let r =
            attention::reference::attention_forward(&shape, lens, &f64s(&q), &f64s(&k), &f64s(&v));
        let (want_dq, want_dk, want_dv) = attention::reference::attention_backward(
            &shape,
            lens,
            (&f64s(&q), &f64s(&k), &f64s(&v)),
            &f64s(&d_out),
        );
        let what = format!("{shape:?} lens {lens:?}");
        assert_close(&format!("O {what}"), &read(&g, &o).await, &r.0, 1e-4, 1e-5);
        assert_close(
            &format!("lse {what}"),
            &read(&g, &lse).await,
            &r.1,
            1e-5,
            1e-5,
        );
        assert_close(
            &format!("dQ {what}"),
            &read(&g, &dq).await,
            &want_dq,
            2e-4,
            1e-4,
        );
        assert_close(
            &format!("dK {what}"),
            &read(&g, &dk).await,
            &want_dk,
            2e-4,
            1e-4,
        );
        assert_close(
            &format!("dV {what}"),
            &read(&g, &dv).await,
            &want_dv,
            2e-4,
            1e-4,
        );
    }
}

/// The DSL's `workgroup_uniform_load` where the browser's own compiler (Tint) checks
/// uniformity: invocation 0 decides for its workgroup whether any value passes the limit, every
/// invocation reads the decision back uniform, and a branch on it holds a barrier (each output
/// its neighbour's value halved, through workgroup memory). Exact against Rust.
#[wasm_bindgen_test]
async fn a_workgroup_uniform_decision_guards_a_barrier() {
    use hesper_dsl::prelude::*;
    let key = KernelKey::new("halve_swapped_if_over").workgroup_size(64);
    let kernel = Kernel::build(&key, |k| {
        let x = k.storage::<f32>("x");
        let y = k.storage_rw::<f32>("y");
        let limit = k.param::<f32>("limit");
        let values = k.workgroup_array::<f32>("values", 64);
        let decision = k.workgroup_array::<u32>("decision", 1);
        let lid = k.let_("lid", k.local_index());
        let global = k.global_index();
        let i = k.let_("i", global);
        let v = k.let_("v", x.at(&i));
        k.store(&values, &lid, &v);
        k.workgroup_barrier();
        k.if_(lid.eq(0u32), |k| {
            let top = k.var("top", f32::MIN);
            k.for_range("j", 0u32, 64u32, |k, j| {
                k.assign(&top, top.get().max(values.at(&j)));
            });
            let over = select(top.get().gt(&limit), lit(1u32), lit(0u32));
            k.store(&decision, 0u32, over);
        });
        let over = k.workgroup_uniform_load("over", &decision, 0u32);
        let out = k.var("out", v.clone());
        k.if_(over.eq(1u32), |k| {
            k.store(&values, &lid, &v * 0.5f32);
            k.workgroup_barrier();
            k.assign(&out, values.at(&lid ^ 1u32));
        });
        k.store(&y, &i, out.get());
    })
    .expect("the kernel builds");
    let g = gpu().await;
    let mut x = Rng::new(21).vec(64 * 5, 1.0);
    x[64 + 9] = 3.0;
    x[3 * 64 + 40] = 2.5;
    let limit = 2.0f32;
    let xb = g.upload(&x).unwrap();
    let y = g.filled(x.len(), f32::NAN).unwrap();
    let args = hesper_exec::Args::new()
        .buffer("x", &xb)
        .buffer("y", &y)
        .param("limit", limit);
    g.run(&kernel, &args, hesper_exec::Grid::Workgroups([5, 1, 1]))
        .unwrap();
    let got = read(&g, &y).await;
    for (i, got) in got.iter().enumerate() {
        let over = x[i / 64 * 64..][..64].iter().any(|v| *v > limit);
        let want = if over { x[i ^ 1] * 0.5 } else { x[i] };
        assert_eq!(*got, want, "element {i}");
    }
}
