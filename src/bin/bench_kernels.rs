//! Kernel benchmarks at the shapes of shared/TARGETS.md: GPU time (timestamp queries, median
//! after a warm-up), GB/s or TFLOP/s, and the fraction of the roofline. Prints a markdown table
//! for BENCHMARKS.md.
//!
//! ```sh
//! scripts/with-gpu cargo run --release --bin bench_kernels                          # full sizes (H200)
//! HESPER_BENCH_QUICK=1 scripts/with-gpu cargo run --release --bin bench_kernels     # small, lavapipe
//! ```

use std::time::Duration;

use hesper::exec::profile::{BenchConfig, Measurement, bench};
use hesper::exec::{ExecError, Gpu, GpuBuffer, Recorder};
use hesper::kernels::{attention, ffn, lora, loss, norm, optim};

/// Device copy on the H200 (PyTorch; TARGETS.md): "of copy" is bytes over this.
const COPY_GBS: f64 = 4250.0;

struct Row {
    kernel: String,
    shape: String,
    m: Measurement,
    rate: String,
    fraction: String,
    target: &'static str,
}

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn filled(gpu: &Gpu, n: usize, seed: u32) -> Result<GpuBuffer<f32>, ExecError> {
    // Deterministic, non-trivial data (timing does not depend on values, but NaN/denormals could).
    let v: Vec<f32> = (0..n)
        .map(|i| {
            ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 8) as f32 / 16777216.0 - 0.5
        })
        .collect();
    gpu.upload(&v)
}

fn bandwidth(kernel: &str, shape: String, m: Measurement, bytes: f64, target: &'static str) -> Row {
    let gbs = m.gb_per_s(bytes);
    Row {
        kernel: kernel.into(),
        shape,
        rate: format!("{gbs:.0} GB/s"),
        fraction: format!("{:.2} of copy", gbs / COPY_GBS),
        m,
        target,
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let quick = std::env::var_os("HESPER_BENCH_QUICK").is_some();
    let gpu = Gpu::new()?;
    println!("device: {}", gpu.describe());
    let config = if quick {
        BenchConfig {
            warmup: Duration::from_millis(100),
            reps: 3,
        }
    } else {
        BenchConfig::default()
    };
    let t = if quick { 64 } else { 4096 };
    let mut rows: Vec<Row> = vec![];

    // --- elementwise FFN backward: 3 reads, 2 writes
    for (name, width, target) in [
        ("relu_sqr_mul_backward", 6912, "≥ 0.95"),
        ("swiglu_backward", 6912, "≥ 0.95"),
        ("relu_sqr_mul_backward", 1536, "≥ 0.85"),
        ("swiglu_backward", 1536, "≥ 0.85"),
    ] {
        let n = t * width;
        let (g, u, d) = (
            filled(&gpu, n, 1)?,
            filled(&gpu, n, 2)?,
            filled(&gpu, n, 3)?,
        );
        let (mut dg, mut du) = (gpu.zeros::<f32>(n)?, gpu.zeros::<f32>(n)?);
        let m = bench(&gpu, name, config, |rec: &mut Recorder<'_>| {
            if name == "swiglu_backward" {
                ffn::execute_swiglu_backward(rec, &g, &u, &d, &mut dg, &mut du)
            } else {
                ffn::execute_relu_sqr_mul_backward(rec, &g, &u, &d, &mut dg, &mut du)
            }
        })?;
        rows.push(bandwidth(
            name,
            format!("{t}×{width}"),
            m,
            5.0 * 4.0 * n as f64,
            target,
        ));
    }

    // --- RMSNorm backward (dx): reads x, dy, writes dx (γ and rstd are small)
    for (cols, target) in [(2560, "≥ 0.85"), (576, "≥ 0.70")] {
        let n = t * cols;
        let (x, gamma, dy) = (
            filled(&gpu, n, 4)?,
            filled(&gpu, cols, 5)?,
            filled(&gpu, n, 6)?,
        );
        let (mut y, mut rstd, mut dx) = (
            gpu.zeros::<f32>(n)?,
            gpu.zeros::<f32>(t)?,
            gpu.zeros::<f32>(n)?,
        );
        let mut rec = gpu.recorder();
        norm::execute_rms_norm_forward(&mut rec, &x, &gamma, &mut y, &mut rstd, 1e-5)?;
        rec.submit()?;
        let m = bench(&gpu, "rms_norm_backward", config, |rec| {
            norm::execute_rms_norm_backward(rec, &x, &gamma, &rstd, &dy, &mut dx, false)
        })?;
        rows.push(bandwidth(
            "rms_norm_backward (dx)",
            format!("{t}×{cols}"),
            m,
            3.0 * 4.0 * n as f64,
            target,
        ));
    }

    // --- softmax backward 8×20×512×512
    {
        let (rows_n, cols) = (if quick { 64 } else { 8 * 20 * 512 }, 512);
        let n = rows_n * cols;
        let (p, dp) = (filled(&gpu, n, 7)?, filled(&gpu, n, 8)?);
        let mut ds = gpu.zeros::<f32>(n)?;
        let m = bench(&gpu, "softmax_backward", config, |rec| {
            attention::execute_softmax_backward(rec, &p, &dp, cols, &mut ds)
        })?;
        rows.push(bandwidth(
            "softmax_backward",
            "8·20·512 rows × 512".into(),
            m,
            3.0 * 4.0 * n as f64,
            "≥ 0.85",
        ));
    }

    // --- LoRA backward, one projection, r = 16, 4096 × 2560 → 2560
    {
        let (d, r) = (2560usize, 16usize);
        let (x, a, b, dy) = (
            filled(&gpu, t * d, 9)?,
            filled(&gpu, r * d, 10)?,
            filled(&gpu, d * r, 11)?,
            filled(&gpu, t * d, 12)?,
        );
        let h = filled(&gpu, t * r, 13)?;
        let (mut dh, mut da, mut db, mut dx) = (
            gpu.zeros::<f32>(t * r)?,
            gpu.zeros::<f32>(r * d)?,
            gpu.zeros::<f32>(d * r)?,
            gpu.zeros::<f32>(t * d)?,
        );
        let mut scratch = gpu.zeros::<f32>(lora::lora_scratch_len(t, d, r))?;
        let inputs = lora::LoraBackward {
            x: &x,
            a: &a,
            b: &b,
            h: &h,
            dy: &dy,
        };
        let m = bench(&gpu, "lora_backward", config, |rec| {
            lora::execute_lora_backward(
                rec,
                &inputs,
                r,
                2.0,
                &mut dh,
                &mut scratch,
                &mut da,
                &mut db,
                &mut dx,
            )
        })?;
        // Least traffic: read x and dy once, read and write dx.
        rows.push(bandwidth(
            "lora_backward (dA, dB, dx)",
            format!("{t}×{d}, r={r}"),
            m,
            4.0 * 4.0 * (t * d) as f64,
            "≥ 0.5",
        ));
    }

    // --- cross-entropy forward+backward, SmolLM2's vocabulary
    {
        let (tokens, vocab) = (if quick { 16 } else { 4096 }, 49152usize);
        let z = filled(&gpu, tokens * vocab, 14)?;
        let labels = gpu.upload(
            &(0..tokens as i32)
                .map(|i| (i * 7919) % vocab as i32)
                .collect::<Vec<_>>(),
        )?;
        let mut dz = gpu.zeros::<f32>(tokens * vocab)?;
        let (mut tl, mut l, mut c) = (
            gpu.zeros::<f32>(tokens)?,
            gpu.zeros::<f32>(1)?,
            gpu.zeros::<u32>(1)?,
        );
        let m = bench(&gpu, "cross_entropy", config, |rec| {
            let out = loss::LossOutputs {
                token_loss: &mut tl,
                loss: &mut l,
                count: &mut c,
            };
            loss::execute_cross_entropy(rec, &z, &labels, vocab, &mut dz, out)
        })?;
        // Least traffic: read the logits once, write dz.
        rows.push(bandwidth(
            "cross_entropy (loss + dz)",
            format!("{tokens}×{vocab}"),
            m,
            2.0 * 4.0 * (tokens * vocab) as f64,
            "–",
        ));
    }

    // --- AdamW on 16M parameters: reads θ, g, m, v; writes θ, m, v
    {
        let n = if quick { 1 << 16 } else { 16 << 20 };
        let g = filled(&gpu, n, 15)?;
        let (mut theta, mut m_state, mut v_state) = (
            filled(&gpu, n, 16)?,
            gpu.zeros::<f32>(n)?,
            gpu.zeros::<f32>(n)?,
        );
        let opt = optim::AdamW::default();
        let step = optim::Step {
            lr: 1e-4,
            t: 10,
            clip: optim::Clip::None,
        };
        let m = bench(&gpu, "adamw", config, |rec| {
            optim::execute_adamw(rec, &opt, &step, &mut theta, &g, &mut m_state, &mut v_state)
        })?;
        rows.push(bandwidth(
            "adamw",
            format!("{}M params", n >> 20),
            m,
            7.0 * 4.0 * n as f64,
            "–",
        ));
    }

    println!();
    println!("per launch (median µs):");
    for r in rows.iter().filter(|r| r.m.launches > 1) {
        let parts: Vec<String> =
            r.m.per_launch
                .iter()
                .map(|(k, ns)| format!("{k} {:.1}", ns / 1e3))
                .collect();
        println!("  {}: {}", r.kernel, parts.join(", "));
    }
    println!();
    println!("| kernel | shape | median | min | rate | fraction | target |");
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    for r in rows {
        println!(
            "| {} | {} | {:.1} µs | {:.1} µs | {} | {} | {} |",
            r.kernel,
            r.shape,
            r.m.median_ns() / 1e3,
            r.m.min_ns() / 1e3,
            r.rate,
            r.fraction,
            r.target
        );
    }
    Ok(())
}
