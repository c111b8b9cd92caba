//! The built-in default job: write a kernel, print its WGSL, run it on the GPU (or lavapipe)
//! and check every element against an f64 reference.
//!
//! ```sh
//! scripts/with-gpu cargo run --release --example hello_kernel [-- N]
//! ```

use std::process::ExitCode;

use hesper::dsl::prelude::*;
use hesper::exec::{Gpu, Grid};

/// ReLU²×Mul backward (BitNet's FFN activation): with `h = relu(g)²·u`,
/// `d_up = dh·relu(g)²` and `d_gate = dh·u·2·relu(g)`.
#[kernel(workgroup_size = 256)]
fn relu_sqr_mul_backward(
    gate: &[f32],
    up: &[f32],
    d_h: &[f32],
    d_gate: &mut [f32],
    d_up: &mut [f32],
    #[runtime] n: u32,
) {
    let i = global_index();
    if i < n {
        let r = max(gate[i], 0.0);
        let dh = d_h[i];
        d_gate[i] = dh * up[i] * 2.0 * r;
        d_up[i] = dh * r * r;
    }
}

fn main() -> ExitCode {
    let n: usize = match std::env::args().nth(1).map(|a| a.parse()) {
        None => 1 << 20,
        Some(Ok(n)) if n > 0 => n,
        Some(_) => {
            eprintln!("usage: hello_kernel [N > 0]");
            return ExitCode::FAILURE;
        }
    };
    match run(n) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(n: usize) -> Result<bool, Box<dyn std::error::Error>> {
    println!("{}", relu_sqr_mul_backward::build()?.wgsl());

    let gpu = Gpu::new()?;
    println!("device: {}", gpu.describe());
    // Fresh pseudo-random inputs in [-1, 1).
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    };
    let gate: Vec<f32> = (0..n).map(|_| next()).collect();
    let up: Vec<f32> = (0..n).map(|_| next()).collect();
    let dh: Vec<f32> = (0..n).map(|_| next()).collect();

    let (g, u, d) = (gpu.upload(&gate)?, gpu.upload(&up)?, gpu.upload(&dh)?);
    // Outputs start as NaN, so an element the kernel does not write fails the check.
    let (mut d_gate, mut d_up) = (gpu.filled(n, f32::NAN)?, gpu.filled(n, f32::NAN)?);
    let mut rec = gpu.recorder();
    relu_sqr_mul_backward::launch(
        &mut rec,
        &g,
        &u,
        &d,
        &mut d_gate,
        &mut d_up,
        n as u32,
        Grid::Threads(n as u64),
    )?;
    rec.submit()?;
    let (got_gate, got_up) = (d_gate.read(&gpu)?, d_up.read(&gpu)?);

    let mut max_err = 0f64;
    for i in 0..n {
        let r = (gate[i] as f64).max(0.0);
        let want_gate = dh[i] as f64 * up[i] as f64 * 2.0 * r;
        let want_up = dh[i] as f64 * r * r;
        for (got, want) in [(got_gate[i], want_gate), (got_up[i], want_up)] {
            let err = if got.is_finite() {
                (got as f64 - want).abs() / (1.0 + want.abs())
            } else {
                f64::INFINITY
            };
            max_err = max_err.max(err);
        }
    }
    let ok = max_err < 1e-6;
    println!(
        "{n} elements: max relative error {max_err:.3e} against the f64 reference: {}",
        if ok { "PASS" } else { "FAIL" }
    );
    Ok(ok)
}
