//! One layer's backward on the GPU, checked against the f64 references: the FFN block of a
//! SmolLM2-135M-sized layer (RMSNorm, SwiGLU, three frozen projections, the residual added) and
//! the LoRA backward of its query projection (r = 8). Prints each result's largest error.
//!
//! ```sh
//! scripts/with-gpu cargo run --release --example lora_backward [-- TOKENS]
//! ```

use std::process::ExitCode;

use hesper::exec::{Gpu, GpuBuffer};
use hesper::kernels::ffn::reference::{FfnWeights, ffn_backward, ffn_forward};
use hesper::kernels::ffn::{self, FfnLayer, FfnScratch, FfnStyle};
use hesper::kernels::lora::{self, LoraBackward};
use hesper::kernels::testing::{Rng, compare, f64s};

const D: usize = 576; // model width
const I: usize = 1536; // FFN width
const RANK: usize = 8;
const EPS: f64 = 1e-5;

fn main() -> ExitCode {
    let tokens = match std::env::args().nth(1).map(|a| a.parse::<usize>()) {
        None => 64,
        Some(Ok(t)) if t > 0 => t,
        Some(_) => {
            eprintln!("usage: lora_backward [TOKENS > 0]");
            return ExitCode::FAILURE;
        }
    };
    match run(tokens) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Largest `|got − want|` relative to the largest `|want|`: f32 sums of thousands of products
/// carry errors proportional to the result's scale, not to each element.
fn max_err(got: &[f32], want: &[f64]) -> f64 {
    compare(got, want, 0.0).scaled()
}

fn run(t: usize) -> Result<bool, Box<dyn std::error::Error>> {
    let gpu = Gpu::new()?;
    println!("device: {}", gpu.describe());
    println!("one layer, {t} tokens, D = {D}, I = {I}, LoRA r = {RANK} on the query projection");
    let mut rng = Rng::new(2026);
    let up = |v: &[f64]| gpu.upload(&v.iter().map(|x| *x as f32).collect::<Vec<_>>());
    let f32s = |v: Vec<f32>| f64s(&v);

    // ---- the FFN block: inputs, the forward's saved activations, and dx of the block output
    let x = f32s(rng.vec(t * D, 1.0));
    let gamma = f32s(rng.vec(D, 1.0));
    let (w_gate, w_up, w_down) = (
        f32s(rng.vec(I * D, 0.05)),
        f32s(rng.vec(I * D, 0.05)),
        f32s(rng.vec(D * I, 0.05)),
    );
    let dx_out = f32s(rng.vec(t * D, 1.0));
    let weights = FfnWeights {
        norm_gamma: &gamma,
        w_gate: &w_gate,
        w_up: &w_up,
        w_down: &w_down,
        sub_norm_gamma: None,
        eps: EPS,
    };
    let (_, saved) = ffn_forward(&x, &weights);
    let want_dx = ffn_backward(&x, &weights, &dx_out);

    let (xb, gb, wgb, wub, wdb) = (up(&x)?, up(&gamma)?, up(&w_gate)?, up(&w_up)?, up(&w_down)?);
    let (rstd, gate, upb) = (up(&saved.x_rstd)?, up(&saved.gate)?, up(&saved.up)?);
    let layer = FfnLayer {
        style: FfnStyle::SwiGlu,
        norm_gamma: &gb,
        w_gate: &wgb,
        w_up: &wub,
        w_down: &wdb,
        x: &xb,
        x_rstd: &rstd,
        gate: &gate,
        up: &upb,
    };
    let nan =
        |n: usize| -> Result<GpuBuffer<f32>, hesper::exec::ExecError> { gpu.filled(n, f32::NAN) };
    let (mut d_h, mut d_hn, mut d_g, mut d_u, mut d_n) =
        (nan(t * I)?, nan(1)?, nan(t * I)?, nan(t * I)?, nan(t * D)?);
    let mut dx = up(&dx_out)?;

    // ---- LoRA on the query projection (D → D): its input is the attention norm's output
    let (lx, a, b, dq) = (
        f32s(rng.vec(t * D, 1.0)),
        f32s(rng.vec(RANK * D, 0.1)),
        f32s(rng.vec(D * RANK, 0.1)),
        f32s(rng.vec(t * D, 1.0)),
    );
    let scale = 2.0; // α / r with α = 16
    let (want_da, want_db, want_dlx) =
        lora::reference::lora_backward(&lx, &a, &b, &dq, RANK, scale);
    let (want_h, _) = lora::reference::lora_forward(&lx, &a, &b, &vec![0.0; t * D], RANK, scale);
    let (lxb, ab, bb, dqb, hb) = (up(&lx)?, up(&a)?, up(&b)?, up(&dq)?, up(&want_h)?);
    let (mut dh, mut scratch) = (nan(t * RANK)?, nan(lora::lora_scratch_len(t, D + D, RANK))?);
    let (mut da, mut db, mut dlx) = (nan(RANK * D)?, nan(D * RANK)?, gpu.zeros::<f32>(t * D)?);

    // ---- one recorder, one submit
    let mut rec = gpu.recorder();
    let scratch_ffn = FfnScratch {
        d_h: &mut d_h,
        d_h_norm: &mut d_hn,
        d_gate: &mut d_g,
        d_up: &mut d_u,
        d_norm: &mut d_n,
    };
    ffn::execute_ffn_backward(&mut rec, &layer, scratch_ffn, &mut dx)?;
    let inputs = LoraBackward {
        x: &lxb,
        a: &ab,
        b: &bb,
        h: &hb,
        dy: &dqb,
    };
    lora::execute_lora_backward(
        &mut rec,
        &inputs,
        RANK,
        scale as f32,
        &mut dh,
        &mut scratch,
        &mut da,
        &mut db,
        &mut dlx,
    )?;
    let launches = rec.len();
    rec.submit()?;

    let results = [
        (
            "FFN block dx (residual added)",
            max_err(&dx.read(&gpu)?, &want_dx),
        ),
        ("LoRA dA", max_err(&da.read(&gpu)?, &want_da)),
        ("LoRA dB", max_err(&db.read(&gpu)?, &want_db)),
        ("LoRA dx", max_err(&dlx.read(&gpu)?, &want_dlx)),
    ];
    println!("{launches} launches in one submit");
    let mut ok = true;
    for (what, err) in results {
        let pass = err < 1e-5;
        ok &= pass;
        println!(
            "  {what:<30} max relative error {err:.2e}  {}",
            if pass { "PASS" } else { "FAIL" }
        );
    }
    Ok(ok)
}
