//! The GEMM on tensor cores (`Precision::F16`: f16 inputs, f32 accumulation) against the f32
//! GEMM: TFLOP/s (GPU time from timestamp queries, medians) at 8192³ and at the SmolLM2-135M
//! step's shapes (T = 4096 tokens), `·Wᵀ` (NT) and `·W` (NN), at the tile autotuning chooses
//! and at each standard and extra tile. f16 input and weight buffers, f32 output; one row also with
//! the f32 input rounded as it is loaded. Where a product splits its depth (the lm-head chunk's
//! `·W`), the split with an f16 input, an f32 one, and f32 logits read through the
//! cross-entropy's gradient as a prologue (`loss::CrossEntropyGrad`, as the step does). Prints markdown for BENCHMARKS.md; PyTorch's figures
//! for the same products come from `scripts/bench-matmul-torch.py` in the same device run.
//!
//! ```sh
//! scripts/with-gpu cargo run --release --bin bench_matmul              # every shape and tile
//! HESPER_BENCH_QUICK=1 scripts/with-gpu cargo run --release --bin bench_matmul   # small shapes
//! HESPER_BENCH_TUNED=1 scripts/with-gpu cargo run --release --bin bench_matmul   # tuned tiles only
//! HESPER_BENCH_SHAPES='lm-head|down' scripts/with-gpu cargo run --release --bin bench_matmul  # shapes whose label has one
//! HESPER_BENCH_TILES='128x64x32/64x64,256x64x32/64x64' …   # these tiles instead of the extra ones
//!                                                       # (with HESPER_BENCH_TUNED=1: tuned and these)
//! HESPER_BENCH_INPUT=f32 …   # the input as f32, rounded as it is staged (the step's forward)
//! ```

use std::time::Duration;

use hesper::exec::half::f16;
use hesper::exec::profile::{BenchConfig, bench};
use hesper::exec::{Gpu, GpuBuffer, GpuOptions};
use hesper::kernels::linear::coop::{self, CoopTile};
use hesper::kernels::linear::fusion::{Fusion, GemmFusion};
use hesper::kernels::linear::split::{
    execute_gemm_split_fused, gemm_split_scratch_len, split_plan,
};
use hesper::kernels::linear::{
    Gemm, GemmPath, HalfBuffers, Operand, OutputBuffer, Precision, Product, Weights, execute_gemm,
    gemm_path,
};
use hesper::kernels::loss::{self, CrossEntropyGrad};
use hesper::kernels::testing::Rng;

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

/// The tiles measured beside the standard ones.
const EXTRA_TILES: [CoopTile; 2] = [
    CoopTile {
        bm: 256,
        bn: 128,
        bk: 32,
        wm: 64,
        wn: 64,
    },
    CoopTile {
        bm: 128,
        bn: 128,
        bk: 64,
        wm: 64,
        wn: 32,
    },
];

/// The `(lse, 1/N)` rows and labels of `logits` `[rows, vocab]` (random labels, one in eight
/// masked), for the cross-entropy's gradient as a prologue.
fn cross_entropy_stats(
    gpu: &Gpu,
    logits: &GpuBuffer<f32>,
    (rows, vocab): (usize, usize),
    rng: &mut Rng,
) -> Result<(GpuBuffer<f32>, GpuBuffer<i32>), Box<dyn std::error::Error>> {
    let labels: Vec<i32> = (0..rows)
        .map(|_| match rng.next_u32() % 8 {
            0 => loss::IGNORE_INDEX,
            _ => (rng.next_u32() as usize % vocab) as i32,
        })
        .collect();
    let labels = gpu.upload(&labels)?;
    let mut count = gpu.zeros::<u32>(1)?;
    let mut stats = gpu.zeros::<f32>(rows * loss::STATS_PER_TOKEN)?;
    let mut token_loss = gpu.zeros::<f32>(rows)?;
    let mut rec = gpu.recorder();
    loss::execute_cross_entropy_count(&mut rec, &labels, vocab, &mut count)?;
    loss::execute_cross_entropy_stats(
        &mut rec,
        logits,
        &labels,
        vocab,
        &count,
        &mut stats,
        &mut token_loss,
    )?;
    rec.submit()?;
    Ok((stats, labels))
}

/// A tile written `bm×bn×bk/wm×wn` (`HESPER_BENCH_TILES`).
fn parse_tile(text: &str) -> Result<CoopTile, String> {
    let numbers: Vec<u32> = text
        .split(['x', '/'])
        .map(|n| n.trim().parse::<u32>())
        .collect::<Result<_, _>>()
        .map_err(|e| format!("HESPER_BENCH_TILES: {text:?}: {e}"))?;
    match numbers[..] {
        [bm, bn, bk, wm, wn] => Ok(CoopTile { bm, bn, bk, wm, wn }),
        _ => Err(format!(
            "HESPER_BENCH_TILES: {text:?}: expected bm×bn×bk/wm×wn, e.g. 128x64x32/64x64"
        )),
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let quick = std::env::var("HESPER_BENCH_QUICK").is_ok_and(|v| v == "1");
    let gpu = Gpu::with_options(GpuOptions {
        cooperative_matrix: true,
        autotune: true,
        ..Default::default()
    })?;
    println!("device: {}", gpu.describe());
    println!(
        "cooperative matrices: {:?}",
        gpu.cooperative_matrix_properties()
    );
    let kinds: Vec<String> = gpu
        .coop_multiplies()
        .iter()
        .map(|k| k.to_string())
        .collect();
    println!("kinds a kernel can use: {}", kinds.join(", "));
    let Some(subgroup) = coop::subgroup_size(&gpu) else {
        println!("no tensor cores reachable: nothing to measure");
        return Ok(());
    };
    let t = if quick { 512 } else { 4096 };
    let shapes: Vec<(&str, (usize, usize, usize))> = if quick {
        vec![("square", (512, 512, 512)), ("q, o", (t, 576, 576))]
    } else {
        vec![
            ("square 8192³", (8192, 8192, 8192)),
            ("q, o", (t, 576, 576)),
            ("k, v", (t, 192, 576)),
            ("q, k, v as one", (t, 960, 576)),
            ("gate, up", (t, 1536, 576)),
            ("gate and up as one", (t, 3072, 576)),
            ("down", (t, 576, 1536)),
            ("lm-head", (t, 49_152, 576)),
            ("lm-head chunk", (1024, 49_152, 576)),
        ]
    };
    let only = std::env::var("HESPER_BENCH_SHAPES").unwrap_or_default();
    let shapes: Vec<_> = shapes
        .into_iter()
        .filter(|(label, _)| only.split('|').any(|part| label.contains(part)))
        .collect();
    let tuned_only = std::env::var("HESPER_BENCH_TUNED").is_ok_and(|v| v == "1");
    let named = match std::env::var("HESPER_BENCH_TILES") {
        Ok(list) => Some(
            list.split(',')
                .map(parse_tile)
                .collect::<Result<Vec<_>, _>>()?,
        ),
        Err(_) => None,
    };
    let f32_input = match std::env::var("HESPER_BENCH_INPUT").as_deref() {
        Ok("f32") => true,
        Ok("f16") | Err(_) => false,
        Ok(other) => return Err(format!("HESPER_BENCH_INPUT: f16 or f32, not {other}").into()),
    };
    let mut tiles: Vec<Option<CoopTile>> = vec![None];
    match (tuned_only, named) {
        (true, None) => {}
        (true, Some(named)) => tiles.extend(named.into_iter().map(Some)),
        (false, named) => {
            let extra = named.unwrap_or(EXTRA_TILES.to_vec());
            tiles.extend(coop::TILES.iter().chain(&extra).map(|t| Some(*t)));
        }
    }
    let mut first = true;
    println!();
    println!("| product | M×N×K | tile (bm×bn×bk, wm×wn) | µs (median) | TFLOP/s |");
    println!("| --- | --- | --- | --- | --- |");
    for (label, (m, n, k)) in shapes {
        let mut rng = Rng::new(1);
        let half = |len: usize, rng: &mut Rng| -> Vec<f16> {
            rng.vec(len, 1.0).into_iter().map(f16::from_f32).collect()
        };
        let w: GpuBuffer<f16> = gpu.upload(&half(n * k, &mut rng))?;
        let mut out = gpu.zeros::<f32>(m * n)?;
        let flops = 2.0 * m as f64 * n as f64 * k as f64;
        for product in [Product::Nt, Product::Nn] {
            let (in_len, out_len) = match product {
                Product::Nt => (m * k, m * n),
                Product::Nn => (m * n, m * k),
            };
            let x = gpu.upload(&half(in_len, &mut rng))?;
            let x32 = gpu.upload(&rng.vec(in_len, 1.0))?;
            let input = || match f32_input {
                true => Operand::F32(&x32),
                false => Operand::F16(&x),
            };
            let mut y = gpu.zeros::<f32>(out_len)?;
            for tile in &tiles {
                let gemm = Gemm {
                    coop_tile: *tile,
                    ..Gemm::new(product, (m, n, k), false).with_precision(Precision::F16)
                };
                let weights = Weights::Half { w: &w, scale: 1.0 };
                let half = HalfBuffers {
                    input: !f32_input,
                    weight: true,
                    output: false,
                };
                let used = match gemm_path(&gpu, &gemm, &weights, half) {
                    GemmPath::TensorCores { tile, .. } => tile,
                    other => return Err(format!("not on the tensor cores: {other:?}").into()),
                };
                if used.workgroup_bytes() > gpu.kernel_limits().max_workgroup_storage_bytes
                    || used.check("", subgroup).is_err()
                {
                    continue;
                }
                let config = BenchConfig {
                    warmup: Duration::from_millis(if first { 2000 } else { 800 }),
                    reps: 20,
                };
                first = false;
                let r = bench(&gpu, "matmul", config, |rec| {
                    execute_gemm(rec, &gemm, input(), weights, OutputBuffer::F32(&mut y))
                });
                let name = format!(
                    "{}{}×{}×{}, {}×{}",
                    if tile.is_none() { "tuned: " } else { "" },
                    used.bm,
                    used.bn,
                    used.bk,
                    used.wm,
                    used.wn
                );
                match r {
                    Ok(r) => println!(
                        "| {label} {product:?} | {m}×{n}×{k} | {name} | {:.1} | {:.1} |",
                        r.median_ns() / 1e3,
                        r.tflop_per_s(flops)
                    ),
                    Err(e) => {
                        println!("| {label} {product:?} | {m}×{n}×{k} | {name} | error: {e} | |")
                    }
                }
            }
            // Split-K where `execute_gemm_split` splits this GEMM (a long depth, few tiles), at
            // the tile it takes (`None`) and at others.
            let split_tiles = [None, Some(CoopTile::WIDE_12), Some(CoopTile::WIDE)];
            for split_tile in split_tiles {
                let gemm = Gemm {
                    coop_tile: split_tile,
                    ..Gemm::new(product, (m, n, k), false).with_precision(Precision::F16)
                };
                let scratch_len = gemm_split_scratch_len(&gpu, &gemm);
                if scratch_len > 0 {
                    let mut scratch = gpu.zeros::<f32>(scratch_len)?;
                    let weights = Weights::Half { w: &w, scale: 1.0 };
                    let config = BenchConfig {
                        warmup: Duration::from_millis(800),
                        reps: 20,
                    };
                    // f16 input; f32 input (the step's `dz` before 2026-12-07); the logits with the
                    // cross-entropy's gradient as the prologue (the step's lm-head backward since).
                    let (inputs, stats) = match product {
                        Product::Nt => (vec![("f16 input", Operand::F16(&x))], None),
                        Product::Nn => (
                            vec![
                                ("f16 input", Operand::F16(&x)),
                                ("f32 input", Operand::F32(&x32)),
                                (
                                    "f32 logits, the cross-entropy's gradient as prologue",
                                    Operand::F32(&x32),
                                ),
                            ],
                            Some(cross_entropy_stats(&gpu, &x32, (m, n), &mut rng)?),
                        ),
                    };
                    let grad = stats
                        .as_ref()
                        .map(|(stats, labels)| CrossEntropyGrad { stats, labels });
                    for (how, input) in inputs {
                        let half = matches!(input, Operand::F16(_));
                        let Some(plan) = split_plan(&gpu, &gemm, half) else {
                            continue;
                        };
                        let (t, parts) = (plan.tile, plan.parts);
                        let tile_name = format!(
                            "{}×{}×{}, {}×{}{}",
                            t.bm,
                            t.bn,
                            t.bk,
                            t.wm,
                            t.wn,
                            if split_tile.is_none() {
                                " (as the step)"
                            } else {
                                ""
                            }
                        );
                        let prologue = grad.as_ref().filter(|_| how.contains("prologue"));
                        let fusion = Fusion {
                            prologue: prologue.map(|g| g as &dyn GemmFusion),
                            epilogues: &[],
                        };
                        let r = bench(&gpu, "matmul", config, |rec| {
                            let out = OutputBuffer::F32(&mut y);
                            execute_gemm_split_fused(
                                rec,
                                &gemm,
                                &fusion,
                                input,
                                weights,
                                out,
                                &mut scratch,
                            )
                        })?;
                        println!(
                            "| {label} {product:?} | {m}×{n}×{k} | split-K: {parts} parts of {tile_name} (and their sum), {how} | {:.1} | {:.1} |",
                            r.median_ns() / 1e3,
                            r.tflop_per_s(flops)
                        );
                    }
                }
            }
        }
        // The f32 input rounded to f16 as it is loaded, and the f32 GEMM, at the chosen tiles.
        let x32 = gpu.upload(&rng.vec(m * k, 1.0))?;
        let w32 = gpu.upload(&rng.vec(n * k, 1.0))?;
        for precision in [Precision::F16, Precision::F32] {
            let gemm = Gemm::new(Product::Nt, (m, n, k), false).with_precision(precision);
            let config = BenchConfig {
                warmup: Duration::from_millis(800),
                reps: 10,
            };
            let r = bench(&gpu, "matmul", config, |rec| {
                execute_gemm(rec, &gemm, &x32, Weights::Dense(&w32), &mut out)
            })?;
            println!(
                "| {label} Nt, f32 buffers | {m}×{n}×{k} | {:?} | {:.1} | {:.1} |",
                gemm_path(&gpu, &gemm, &Weights::Dense(&w32), HalfBuffers::NONE),
                r.median_ns() / 1e3,
                r.tflop_per_s(flops)
            );
        }
    }
    println!("\nautotune runs: {}", gpu.autotune_runs());
    for report in gpu.autotune_reports() {
        let measured: Vec<String> = report
            .measured
            .iter()
            .map(|(name, r)| match r {
                Ok(ns) => format!("{name} {:.1} µs", ns / 1e3),
                Err(e) => format!("{name} failed: {e}"),
            })
            .collect();
        println!(
            "- {}: {} → {:?}",
            report.key,
            measured.join(", "),
            report.chosen
        );
    }
    Ok(())
}
