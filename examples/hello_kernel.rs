//! The built-in default job: write a kernel in the DSL, print its WGSL, run it on the GPU (or
//! lavapipe) and check every element against an f64 reference.
//!
//! ```sh
//! scripts/with-gpu cargo run --release --example hello_kernel [-- N]
//! ```

use std::process::ExitCode;

use hesper::dsl::prelude::*;
use hesper::exec::{Args, Gpu, Grid};

/// ReLU²×Mul backward (BitNet's FFN activation): with `h = relu(g)²·u`,
/// `d_up = dh·relu(g)²` and `d_gate = dh·u·2·relu(g)`.
fn relu_sqr_mul_backward() -> Result<Kernel, hesper::dsl::DslError> {
    let key = KernelKey::new("relu_sqr_mul_backward").workgroup_size(256);
    Kernel::build(&key, |k| {
        let gate = k.storage::<f32>("gate");
        let up = k.storage::<f32>("up");
        let d_h = k.storage::<f32>("d_h");
        let d_gate = k.storage_rw::<f32>("d_gate");
        let d_up = k.storage_rw::<f32>("d_up");
        let n = k.param::<u32>("n");
        let i = k.global_index();
        k.if_(i.lt(&n), |k| {
            let r = k.let_("r", gate.at(&i).max(0.0));
            let dh = k.let_("dh", d_h.at(&i));
            k.store(&d_gate, &i, &dh * up.at(&i) * 2.0 * &r);
            k.store(&d_up, &i, &dh * &r * &r);
        });
    })
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
    let kernel = relu_sqr_mul_backward()?;
    println!("{}", kernel.wgsl());

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
    let (d_gate, d_up) = (gpu.filled(n, f32::NAN)?, gpu.filled(n, f32::NAN)?);
    let args = Args::new()
        .buffer("gate", &g)
        .buffer("up", &u)
        .buffer("d_h", &d)
        .buffer("d_gate", &d_gate)
        .buffer("d_up", &d_up)
        .param("n", n as u32);
    gpu.run(&kernel, &args, Grid::Threads(n as u64))?;
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
