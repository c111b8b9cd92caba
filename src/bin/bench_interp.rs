//! The DSL's interpreter (`hesper::dsl::interp`) on the CPU: invocations per second (one
//! thread) for an elementwise kernel, a workgroup reduction (barriers, workgroup memory) and the
//! tiled GEMM, with every check on. Prints markdown for BENCHMARKS.md.
//!
//! ```sh
//! cargo run --release --bin bench_interp
//! ```

use std::time::Instant;

use hesper::dsl::interp::{Run, ScalarValue, interpret};
use hesper::dsl::prelude::*;
use hesper::kernels::catalog;

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn values(n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
        .collect()
}

/// Seconds for one interpretation of `kernel` over `run` (the best of three).
fn time(kernel: &Kernel, run: &Run) -> Result<f64, Box<dyn std::error::Error>> {
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let mut this = run.clone();
        let started = Instant::now();
        interpret(kernel, &mut this)?;
        best = best.min(started.elapsed().as_secs_f64());
    }
    Ok(best)
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    println!("| kernel | invocations | seconds | invocations/s |");
    println!("|---|---|---|---|");
    let report = |name: &str, invocations: u64, seconds: f64| {
        println!(
            "| {name} | {invocations} | {seconds:.3} | {:.0} |",
            invocations as f64 / seconds
        );
    };

    let n = 1 << 18;
    let key = KernelKey::new("axpb").workgroup_size(256);
    let axpb = Kernel::build(&key, |k| {
        let x = k.storage::<f32>("x");
        let y = k.storage_rw::<f32>("y");
        let len = k.param::<u32>("n");
        let i = k.global_index();
        k.if_(i.lt(&len), |k| k.store(&y, &i, x.at(&i) * 2.0f32 + 1.0f32));
    })?;
    let run = Run::new([(n / 256) as u32, 1, 1])
        .buffer("x", &values(n))
        .buffer("y", &vec![0f32; n])
        .param("n", ScalarValue::U32(n as u32));
    report("y = 2x + 1", n as u64, time(&axpb, &run)?);

    let key = KernelKey::new("block_sum").workgroup_size(256);
    let sum = Kernel::build(&key, |k| {
        let x = k.storage::<f32>("x");
        let out = k.storage_rw::<f32>("out");
        let i = k.global_index();
        let s = k.workgroup_reduce(x.at(&i), Reduce::Sum);
        k.if_(k.local_index().eq(0u32), |k| {
            k.store(&out, k.workgroup_id().x(), s)
        });
    })?;
    let run = Run::new([(n / 256) as u32, 1, 1])
        .buffer("x", &values(n))
        .buffer("out", &vec![0f32; n / 256]);
    report(
        "workgroup sum (a shared-memory tree, 9 barriers)",
        n as u64,
        time(&sum, &run)?,
    );

    // The tiled GEMM, 128 × 128 × 128: 16×16 outputs a workgroup of 16 invocations.
    let shape: Vec<(String, String)> = [("cols", "128"), ("depth", "128"), ("accumulate", "false")]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let gemm = catalog::find("matmul_nt")?.build(&shape)?;
    let m = 128;
    let run = Run::new([128 / 16, (m / 16) as u32, 1])
        .buffer("x", &values(m * 128))
        .buffer("w", &values(128 * 128))
        .buffer("y", &vec![0f32; m * 128])
        .param("rows", ScalarValue::U32(m as u32))
        .param("scale", ScalarValue::F32(1.0));
    let invocations = 64 * 16;
    report(
        "matmul_nt 128×128×128 (tile 16×16, 4×4 an invocation)",
        invocations,
        time(&gemm, &run)?,
    );
    Ok(())
}
