//! The demo page's Rust side: a kernel whose shape the page sets, its WGSL, and a run of it and
//! of one projection's LoRA backward on the page's GPU, each against its f64 reference.

use hesper_dsl::prelude::*;
use hesper_exec::{ExecError, Gpu, GpuBuffer, Grid};
use hesper_kernels::lora::{self, LoraBackward};
use hesper_kernels::testing::{Rng, compare, f64s};

/// ReLU²×Mul backward, `unroll` elements per invocation (a shape: it changes the WGSL).
#[kernel(workgroup_size = 64)]
fn relu_sqr_mul_backward(
    #[len(n)] gate: &[f32],
    #[len(n)] up: &[f32],
    #[len(n)] d_h: &[f32],
    #[len(n)] d_gate: &mut [f32],
    #[len(n)] d_up: &mut [f32],
    #[runtime] n: u32,
    #[shape] unroll: u32,
) {
    let first = global_index() * unroll;
    for j in 0..unroll {
        let i = first + j;
        if i < n {
            let r = max(gate[i], 0.0);
            let dh = d_h[i];
            d_gate[i] = dh * up[i] * 2.0 * r;
            d_up[i] = dh * r * r;
        }
    }
}

/// The kernel's WGSL for `unroll` (1 to 16).
pub fn kernel_wgsl(unroll: u32) -> Result<String, String> {
    let unroll = check("unroll", unroll, 1..=16)?;
    relu_sqr_mul_backward::build(unroll)
        .map(|k| k.wgsl().to_string())
        .map_err(|e| e.to_string())
}

/// What one run found, for the page.
pub struct Report {
    pub device: String,
    pub lines: Vec<String>,
    /// Whether every result is within its tolerance of the reference.
    pub ok: bool,
}

/// Run the kernel over `n` elements and one LoRA backward (`tokens`, `rank`, 96 → 80) on the
/// page's GPU, each against its f64 reference.
pub async fn run(n: u32, unroll: u32, tokens: u32, rank: u32) -> Result<Report, String> {
    let n = check("n", n, 1..=1 << 22)? as usize;
    let unroll = check("unroll", unroll, 1..=16)?;
    let tokens = check("tokens", tokens, 1..=4096)? as usize;
    let rank = check("rank", rank, 1..=64)? as usize;
    let gpu = Gpu::new_async().await.map_err(|e| e.to_string())?;
    let mut report = Report {
        device: gpu.describe(),
        lines: vec![],
        ok: true,
    };
    // Elementwise results are held to each element; sums over tokens to the result's size
    // (their f32 error grows with the sum, not with each term).
    let mut note = |what: &str, got: &[f32], want: &[f64], sum: bool| {
        let c = compare(got, want, 1e-6);
        let (error, tol) = match sum {
            false => (c.max_rel, 1e-5),
            true => (c.scaled(), 1e-5),
        };
        report.ok &= error <= tol;
        let measure = if sum {
            "scaled error"
        } else {
            "relative error"
        };
        report.lines.push(format!(
            "{what}: {measure} {error:.2e} (tolerance {tol:.0e}); {c}"
        ));
    };
    let (d_gate, d_up, want_gate, want_up) = activation(&gpu, n, unroll)
        .await
        .map_err(|e| e.to_string())?;
    note("relu_sqr_mul_backward d_gate", &d_gate, &want_gate, false);
    note("relu_sqr_mul_backward d_up", &d_up, &want_up, false);
    let grads = lora_backward(&gpu, tokens, rank)
        .await
        .map_err(|e| e.to_string())?;
    for (name, got, want) in grads {
        note(name, &got, &want, true);
    }
    Ok(report)
}

fn check(what: &str, v: u32, range: std::ops::RangeInclusive<u32>) -> Result<u32, String> {
    match range.contains(&v) {
        true => Ok(v),
        false => Err(format!(
            "{what}: expected {} to {}, given {v}",
            range.start(),
            range.end()
        )),
    }
}

type Pair = (Vec<f32>, Vec<f32>, Vec<f64>, Vec<f64>);

async fn activation(gpu: &Gpu, n: usize, unroll: u32) -> Result<Pair, ExecError> {
    let mut rng = Rng::new(u64::from(unroll) + n as u64);
    let (gate, up, dh) = (rng.vec(n, 1.0), rng.vec(n, 1.0), rng.vec(n, 1.0));
    let (gb, ub, db) = (gpu.upload(&gate)?, gpu.upload(&up)?, gpu.upload(&dh)?);
    let (mut d_gate, mut d_up) = (gpu.filled(n, f32::NAN)?, gpu.filled(n, f32::NAN)?);
    let mut rec = gpu.recorder();
    let threads = (n as u64).div_ceil(u64::from(unroll));
    relu_sqr_mul_backward::launch(
        &mut rec,
        &gb,
        &ub,
        &db,
        &mut d_gate,
        &mut d_up,
        n as u32,
        unroll,
        Grid::Threads(threads),
    )?;
    rec.submit()?;
    let r = |i: usize| f64::from(gate[i]).max(0.0);
    let want_gate = (0..n)
        .map(|i| f64::from(dh[i]) * f64::from(up[i]) * 2.0 * r(i))
        .collect();
    let want_up = (0..n).map(|i| f64::from(dh[i]) * r(i) * r(i)).collect();
    Ok((
        d_gate.read_async(gpu).await?,
        d_up.read_async(gpu).await?,
        want_gate,
        want_up,
    ))
}

type Grads = Vec<(&'static str, Vec<f32>, Vec<f64>)>;

async fn lora_backward(gpu: &Gpu, tokens: usize, rank: usize) -> Result<Grads, ExecError> {
    let (input, output, scale) = (96, 80, 2.0f32);
    let mut rng = Rng::new((tokens * 64 + rank) as u64);
    let x = rng.vec(tokens * input, 1.0);
    let a = rng.vec(rank * input, 0.5);
    let b = rng.vec(output * rank, 0.5);
    let dy = rng.vec(tokens * output, 1.0);
    let upload = |v: &[f32]| gpu.upload(v);
    let (xb, ab, bb, dyb) = (upload(&x)?, upload(&a)?, upload(&b)?, upload(&dy)?);
    let mut h = gpu.filled(tokens * rank, f32::NAN)?;
    let mut y = gpu.filled(tokens * output, f32::NAN)?;
    let mut dh = gpu.filled(tokens * rank, f32::NAN)?;
    let scratch_len = lora::lora_scratch_len(tokens, input + output, rank);
    let mut scratch = gpu.filled(scratch_len, f32::NAN)?;
    let (mut da, mut db) = (
        gpu.filled(rank * input, f32::NAN)?,
        gpu.filled(output * rank, f32::NAN)?,
    );
    let mut dx = gpu.filled(tokens * input, 0.0)?;
    let mut rec = gpu.recorder();
    lora::execute_lora_forward(&mut rec, &xb, &ab, &bb, rank, scale, &mut h, &mut y)?;
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
        rank,
        scale,
        &mut dh,
        &mut scratch,
        &mut da,
        &mut db,
        &mut dx,
    )?;
    rec.submit()?;
    let (want_da, want_db, want_dx) = lora::reference::lora_backward(
        &f64s(&x),
        &f64s(&a),
        &f64s(&b),
        &f64s(&dy),
        rank,
        f64::from(scale),
    );
    Ok(vec![
        ("lora dA", read(gpu, &da).await?, want_da),
        ("lora dB", read(gpu, &db).await?, want_db),
        ("lora dx", read(gpu, &dx).await?, want_dx),
    ])
}

async fn read(gpu: &Gpu, b: &GpuBuffer<f32>) -> Result<Vec<f32>, ExecError> {
    b.read_async(gpu).await
}
