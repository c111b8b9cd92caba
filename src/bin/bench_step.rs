//! The LoRA training step at the SmolLM2-135M shape (30 layers, D = 576, I = 1536, 9/3 heads of
//! 64, vocab 49 152, tied), LoRA q, v at r = 8, S = 512, f32 or (`HESPER_BENCH_PRECISION=f16`)
//! mixed precision on tensor cores with tuned tiles. It prints markdown for BENCHMARKS.md:
//! - ms per step: the wall clock between two steps' losses arriving, each step's loss read
//!   while the next is recorded and runs (the median of 10 intervals and their range);
//!   tokens/s; one step alone (submitted to an idle GPU, until done); the CPU's time to record
//!   a step; launches and submissions per step; GPU memory; with and without gradient
//!   checkpointing;
//! - the GPU time per kernel family (timestamp queries, one step), and with
//!   `HESPER_BENCH_KERNELS=1` per kernel (by name, every launch of it in the step), with `=2`
//!   also per launch kind (the kernel's whole key and the workgroups: which GEMM, which tile);
//! - with `HESPER_BENCH_GEMMS=1` the step's GEMM shapes one by one at several tiles, and with
//!   `HESPER_BENCH_FUSION=1` the step's fused GEMMs against their plain ones at the step's
//!   precision.
//!
//! ```sh
//! scripts/with-gpu cargo run --release --bin bench_step                        # B = 8 and 32 (H200)
//! HESPER_BENCH_QUICK=1 scripts/with-gpu cargo run --release --bin bench_step   # 2 layers, B = 1, S = 64
//! HESPER_BENCH_PRECISION=f16 scripts/with-gpu cargo run --release --bin bench_step
//! HESPER_BENCH_BATCHES=8,64 HESPER_BENCH_LOSS_CHUNK=4096 …   # other batches, lm-head chunk
//! HESPER_BENCH_CACHE_DIR=/tmp/tiles …   # keep the tuned tiles and pipelines for the next run
//! ```

use std::collections::BTreeMap;
use std::time::Instant;

use hesper::exec::profile::{BenchConfig, bench};
use hesper::exec::{Gpu, GpuBuffer, GpuOptions, PendingRead, Recorder};
use hesper::kernels::ffn::SwigluInput;
use hesper::kernels::linear::fusion::Residual;
use hesper::kernels::linear::{
    Fusion, Gemm, GemmFusion, Precision, Product, Tile, Weights as GemmWeights, execute_gemm,
    execute_gemm_fused,
};
use hesper::kernels::lora::{LoraUp, UpWeight};
use hesper::kernels::testing::Rng;
use hesper::model::config::{Family, LoraConfig, ModelConfig};
use hesper::model::reference::{Adapters, Batch, Weights};
use hesper::model::{
    GpuAdapters, GpuModel, Optimizer, StepBuffers, StepShape, record_forward_backward,
    record_optimizer_step,
};

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

/// SmolLM2-135M's shape (Hugging Face's config of `HuggingFaceTB/SmolLM2-135M-Instruct`).
fn smollm2(layers: usize, max_seq: usize) -> ModelConfig {
    ModelConfig {
        family: Family::Llama,
        vocab: 49_152,
        dim: 576,
        ffn_dim: 1536,
        layers,
        heads: 9,
        kv_heads: 3,
        head_dim: 64,
        rope_base: 100_000.0,
        norm_eps: 1e-5,
        tied_embeddings: true,
        max_seq,
    }
}

/// Every position of `batch` full sequences predicts a random next token.
fn random_batch(config: &ModelConfig, batch: usize, seq_len: usize, seed: u64) -> Batch {
    let mut rng = Rng::new(seed);
    let tokens: Vec<u32> = (0..batch * seq_len)
        .map(|_| rng.next_u32() % config.vocab as u32)
        .collect();
    let targets = tokens.iter().map(|&t| t as i64).collect();
    Batch {
        batch,
        seq_len,
        tokens,
        targets,
        lens: vec![seq_len; batch],
    }
}

/// The family a kernel's name belongs to, for the breakdown.
fn family(kernel: &str) -> &'static str {
    let families = [
        ("matmul", "GEMM (frozen weights, lm-head)"),
        (
            "coop_matmul",
            "GEMM on tensor cores (frozen weights, lm-head)",
        ),
        ("lora", "LoRA"),
        ("attention", "attention"),
        ("coop_attention", "attention on tensor cores"),
        ("cross_entropy", "cross-entropy"),
        ("rms_norm", "RMSNorm"),
        ("rope", "RoPE"),
        ("swiglu", "SwiGLU"),
        ("adamw", "optimizer"),
        ("grad_norm", "optimizer"),
        ("hesper_copy", "copies"),
        ("hesper_fill", "copies"),
        ("embedding", "embedding"),
    ];
    families
        .iter()
        .find(|(prefix, _)| kernel.starts_with(prefix))
        .map_or("other", |(_, f)| f)
}

/// One training step (forward, backward, AdamW at learning rate 1e-4 as step `step`) into `rec`.
fn record_step(
    rec: &mut Recorder<'_>,
    (model, optimizer, adapters, buffers): (
        &GpuModel,
        &Optimizer,
        &mut GpuAdapters,
        &mut StepBuffers,
    ),
    step: u32,
) -> Result<(), Box<dyn std::error::Error>> {
    record_forward_backward(rec, model, adapters, buffers)?;
    record_optimizer_step(rec, optimizer, (1e-4, step), adapters, buffers)?;
    Ok(())
}

/// A table of `times` (name → ms, launches), the largest first.
fn print_breakdown(title: &str, what: &str, times: BTreeMap<String, (f64, usize)>) {
    let total: f64 = times.values().map(|(ms, _)| ms).sum();
    println!();
    println!("GPU time per {title} (one step, {total:.1} ms in all):");
    println!();
    println!("| {what} | launches | ms | share |");
    println!("|---|---|---|---|");
    let mut rows: Vec<_> = times.into_iter().collect();
    rows.sort_by(|a, b| b.1.0.total_cmp(&a.1.0));
    for (name, (ms, n)) in rows {
        println!("| {name} | {n} | {ms:.2} | {:.0}% |", 100.0 * ms / total);
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let quick = std::env::var_os("HESPER_BENCH_QUICK").is_some();
    let per_kernel = std::env::var_os("HESPER_BENCH_KERNELS").is_some();
    let per_launch = std::env::var("HESPER_BENCH_KERNELS").is_ok_and(|v| v == "2");
    let precision = match std::env::var("HESPER_BENCH_PRECISION").as_deref() {
        Ok("f16") => Precision::F16,
        Ok("f32") | Err(_) => Precision::F32,
        Ok(other) => return Err(format!("HESPER_BENCH_PRECISION: f16 or f32, not {other}").into()),
    };
    // Tiles measured and pipelines compiled by an earlier run, where it kept them.
    let cache = std::env::var_os("HESPER_BENCH_CACHE_DIR").map(std::path::PathBuf::from);
    let gpu = Gpu::with_options(GpuOptions {
        cooperative_matrix: true,
        autotune: true,
        tune_cache_file: cache.as_ref().map(|d| d.join("tune.txt")),
        pipeline_cache_file: cache.as_ref().map(|d| d.join("pipelines.bin")),
        ..GpuOptions::default()
    })?;
    println!("device: {}", gpu.describe());
    println!("precision: {precision:?}");
    let (layers, seq_len, batches, steps) = if quick {
        (2, 64, vec![(1, false), (1, true)], 3)
    } else {
        let batches = match std::env::var("HESPER_BENCH_BATCHES") {
            // `8,64`: those batch sizes, without recomputing.
            Ok(list) => list
                .split(',')
                .map(|b| b.trim().parse().map(|b| (b, false)))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| format!("HESPER_BENCH_BATCHES: {list:?}: {e}"))?,
            Err(_) => vec![(8, false), (32, false), (8, true), (32, true)],
        };
        (30, 512, batches, 10)
    };
    let loss_chunk = match std::env::var("HESPER_BENCH_LOSS_CHUNK") {
        Ok(v) => v
            .parse()
            .map_err(|e| format!("HESPER_BENCH_LOSS_CHUNK: {v:?}: {e}"))?,
        Err(_) => StepShape::new(1, 1).loss_chunk,
    };
    println!("loss chunk: {loss_chunk} tokens");
    let config = smollm2(layers, seq_len);
    let lora = LoraConfig::default();
    let started = Instant::now();
    let weights = Weights::random(&config, 1);
    let model = GpuModel::upload_with_precision(&gpu, &config, &weights, precision)?;
    drop(weights);
    let adapters = Adapters::init_peft(&config, &lora, 2);
    let optimizer = Optimizer::default();
    println!("model uploaded in {:.1} s", started.elapsed().as_secs_f64());
    println!();
    println!(
        "| B × S | recompute | ms/step (min–max) | tokens/s | one step alone, ms | recording, CPU ms | launches | submits | GPU memory (weights + adapters + step) | step's per token |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let mut breakdowns = vec![];
    for (batch, recompute) in batches {
        let mut gpu_adapters = GpuAdapters::upload(&gpu, &config, &lora, &adapters)?;
        let shape = StepShape {
            recompute,
            loss_chunk,
            ..StepShape::new(batch, seq_len)
        };
        let mut buffers = StepBuffers::new(&gpu, &model, &gpu_adapters, shape)?;
        buffers.load(&gpu, &config, &[random_batch(&config, batch, seq_len, 3)])?;
        // As a trainer runs: each step's loss is read while the next step is recorded and
        // runs. The first two steps compile the pipelines and warm the caches. A step's time is
        // the interval between two steps' losses arriving (steady state: the next step is
        // already queued), the median of `steps` intervals (steps 2 to 2 + `steps`). Until
        // 2026-12-04 the clock started while step 2 ran and stopped after step 12, 11 steps
        // divided by 10: every ms/step in BENCHMARKS.md before that date is ~10% too high.
        let mut launches = 0;
        let mut pending = None;
        let mut arrivals = vec![];
        let mut recording = vec![];
        for step in 1..=steps + 2 {
            let started = Instant::now();
            let mut rec = gpu.recorder();
            let on = (&model, &optimizer, &mut gpu_adapters, &mut buffers);
            record_step(&mut rec, on, step)?;
            launches = rec.len();
            if step > 2 {
                recording.push(started.elapsed().as_secs_f64() * 1e3);
            }
            rec.submit()?;
            if let Some(previous) = pending.take() {
                let loss: Vec<f32> = PendingRead::wait(previous, &gpu)?;
                if step > 2 {
                    arrivals.push(Instant::now());
                }
                if !loss[0].is_finite() {
                    return Err(format!("step {}: loss {}", step - 1, loss[0]).into());
                }
            }
            pending = Some(buffers.loss().read_start(&gpu)?);
        }
        if let Some(last) = pending {
            let loss: Vec<f32> = PendingRead::wait(last, &gpu)?;
            arrivals.push(Instant::now());
            if !loss[0].is_finite() {
                return Err(format!("step {}: loss {}", steps + 2, loss[0]).into());
            }
        }
        let mut intervals: Vec<f64> = arrivals
            .windows(2)
            .map(|w| (w[1] - w[0]).as_secs_f64() * 1e3)
            .collect();
        intervals.sort_by(f64::total_cmp);
        // The upper median of an even count.
        let ms = intervals[intervals.len() / 2];
        let record_ms = recording.iter().sum::<f64>() / recording.len() as f64;
        // The latency of one step: recorded, then submitted to an idle GPU and waited for.
        let mut rec = gpu.recorder();
        let on = (&model, &optimizer, &mut gpu_adapters, &mut buffers);
        record_step(&mut rec, on, steps + 3)?;
        let started = Instant::now();
        rec.submit()?;
        gpu.wait()?;
        let alone_ms = started.elapsed().as_secs_f64() * 1e3;
        let tokens = (batch * seq_len) as f64;
        let memory = model.memory_bytes() + gpu_adapters.memory_bytes() + buffers.memory_bytes();
        println!(
            "| {batch} × {seq_len} | {recompute} | {ms:.1} ({:.1}–{:.1}) | {:.0} | {alone_ms:.1} | {record_ms:.1} | {launches} | 1 | {:.2} GB ({:.2} + {:.3} + {:.2}) | {:.0} KB |",
            intervals[0],
            intervals[intervals.len() - 1],
            tokens / ms * 1e3,
            memory as f64 / 1e9,
            model.memory_bytes() as f64 / 1e9,
            gpu_adapters.memory_bytes() as f64 / 1e9,
            buffers.memory_bytes() as f64 / 1e9,
            buffers.memory_bytes() as f64 / tokens / 1e3,
        );

        // One step with a timestamp per launch (each launch in its own pass; a recomputing
        // step has more launches than a timed recorder holds).
        if recompute {
            continue;
        }
        let mut rec = gpu.timed_recorder(launches as u32)?;
        let on = (&model, &optimizer, &mut gpu_adapters, &mut buffers);
        record_step(&mut rec, on, steps + 4)?;
        let timings = rec.submit_timed()?;
        let mut by_family: BTreeMap<String, (f64, usize)> = BTreeMap::new();
        let mut by_kernel: BTreeMap<String, (f64, usize)> = BTreeMap::new();
        let mut by_launch: BTreeMap<String, (f64, usize)> = BTreeMap::new();
        for t in &timings {
            for (map, name) in [
                (&mut by_family, family(&t.kernel).to_string()),
                (&mut by_kernel, t.kernel.clone()),
                (&mut by_launch, t.launch.clone()),
            ] {
                let entry = map.entry(name).or_default();
                entry.0 += t.gpu_ns / 1e6;
                entry.1 += 1;
            }
        }
        breakdowns.push((batch, "kernel family", by_family));
        if per_kernel {
            breakdowns.push((batch, "kernel", by_kernel));
        }
        if per_launch {
            breakdowns.push((batch, "kernel and shape, workgroups", by_launch));
        }
    }
    for (batch, what, times) in breakdowns {
        print_breakdown(&format!("{what}, B = {batch}, S = {seq_len}"), what, times);
    }
    if let Some(dir) = &cache {
        std::fs::create_dir_all(dir)?;
        gpu.save_tune_cache()?;
        gpu.save_pipeline_cache()?;
    }
    if std::env::var_os("HESPER_BENCH_GEMMS").is_some() {
        for batch in [8, 32] {
            gemm_sweep(&gpu, &config, batch * seq_len, quick)?;
        }
    }
    if std::env::var_os("HESPER_BENCH_FUSION").is_some() {
        fusion_sweep(&gpu, &config, 8 * seq_len, precision, quick)?;
    }
    Ok(())
}

/// The step's GEMMs over `t` tokens with the fusions the step gives them, against the same
/// GEMMs plain (f16 weights at `Precision::F16`, as the step holds them): µs, medians.
fn fusion_sweep(
    gpu: &Gpu,
    c: &ModelConfig,
    t: usize,
    precision: Precision,
    quick: bool,
) -> Result<(), Box<dyn std::error::Error>> {
    use hesper::exec::half::f16;
    let (d, i, kv, r) = (c.dim, c.ffn_dim, c.kv_heads * c.head_dim, 8);
    let config = match quick {
        true => BenchConfig {
            warmup: std::time::Duration::from_millis(50),
            reps: 3,
        },
        false => BenchConfig::default(),
    };
    let widest = i.max(d);
    let mut rng = Rng::new(7);
    let input = gpu.upload(&rng.vec(t * widest, 1.0))?;
    let other = gpu.upload(&rng.vec(t * widest, 1.0))?;
    let out = gpu.zeros::<f32>(t * widest)?;
    let lora_h = gpu.upload(&rng.vec(t * r, 1.0))?;
    let lora_w = gpu.upload(&rng.vec(widest * r, 0.1))?;
    let w32 = rng.vec(widest * widest, 0.05);
    let w16: Vec<f16> = w32.iter().map(|v| f16::from_f32(*v)).collect();
    let (w32, w16) = (gpu.upload(&w32)?, gpu.upload(&w16)?);
    let slice =
        |b: &GpuBuffer<f32>, len: usize| -> Result<GpuBuffer<f32>, hesper::exec::ExecError> {
            let s = gpu.zeros::<f32>(len)?;
            let mut rec = gpu.recorder();
            rec.copy_range(b, 0, &s, 0, len)?;
            rec.submit()?;
            Ok(s)
        };
    println!();
    println!("The step's fused GEMMs ({t} tokens, {precision:?}), µs, medians, against plain:");
    println!();
    println!("| GEMM | m×n×k | plain | plain, accumulating | fused | fusion |");
    println!("|---|---|---|---|---|---|");
    // (what, product, n, k, fusion): `lora` 'B' forward, 'A' backward; `residual`; `swiglu`.
    let cases = [
        ("q forward", Product::Nt, d, d, "lora_b"),
        ("v forward", Product::Nt, kv, d, "lora_b"),
        ("o forward", Product::Nt, d, d, "residual"),
        ("down forward", Product::Nt, d, i, "residual"),
        ("down forward", Product::Nt, d, i, "swiglu+residual"),
        ("q backward", Product::Nn, d, d, "lora_a"),
        ("v backward", Product::Nn, kv, d, "lora_a"),
    ];
    for (what, product, n, k, fusion_name) in cases {
        let (cols, depth) = match product {
            Product::Nt => (n, k),
            Product::Nn => (k, n),
        };
        let x = slice(&input, t * depth)?;
        let up = slice(&other, t * depth)?;
        let residual = slice(&other, t * cols)?;
        let mut y = slice(&out, t * cols)?;
        let h = slice(&lora_h, t * r)?;
        let lw = slice(&lora_w, cols * r)?;
        let w16n = gpu.zeros::<f16>(n * k)?;
        let w32n = slice(&w32, n * k)?;
        {
            let mut rec = gpu.recorder();
            rec.copy_range(&w16, 0, &w16n, 0, n * k)?;
            rec.submit()?;
        }
        let weights = || match precision {
            Precision::F16 => GemmWeights::Half {
                w: &w16n,
                scale: 1.0,
            },
            Precision::F32 => GemmWeights::Dense(&w32n),
        };
        let gemm = Gemm::new(product, (t, n, k), false).with_precision(precision);
        let plain = bench(gpu, what, config, |rec| {
            execute_gemm(rec, &gemm, &x, weights(), &mut y)
        })?;
        // What a residual replaces: the GEMM adding into a copy of it.
        let adding = Gemm {
            accumulate: true,
            ..gemm
        };
        let accumulating = bench(gpu, what, config, |rec| {
            execute_gemm(rec, &adding, &x, weights(), &mut y)
        })?;
        let lora = LoraUp {
            h: &h,
            weight: match fusion_name {
                "lora_a" => UpWeight::A(&lw),
                _ => UpWeight::B(&lw),
            },
            rank: r,
            scale: 2.0,
            columns: None,
        };
        let residual = Residual {
            residual: &residual,
        };
        let swiglu = SwigluInput { up: &up };
        let (prologue, epilogues): (Option<&dyn GemmFusion>, Vec<&dyn GemmFusion>) =
            match fusion_name {
                "residual" => (None, vec![&residual]),
                "swiglu+residual" => (Some(&swiglu), vec![&residual]),
                _ => (None, vec![&lora]),
            };
        let fusion = Fusion {
            prologue,
            epilogues: &epilogues,
        };
        let fused = bench(gpu, what, config, |rec| {
            execute_gemm_fused(rec, &gemm, &fusion, &x, weights(), &mut y)
        })?;
        println!(
            "| {what} | {t}×{n}×{k} | {:.1} | {:.1} | {:.1} | {fusion_name} |",
            plain.median_ns() / 1e3,
            accumulating.median_ns() / 1e3,
            fused.median_ns() / 1e3
        );
    }
    Ok(())
}

/// Every GEMM shape of the step over `t` tokens (`(product, m, n, k)`, `W: [n, k]`; the count a step
/// runs) at `Gemm::new`'s tile and at others: µs (median) and TFLOP/s.
fn gemm_sweep(
    gpu: &Gpu,
    c: &ModelConfig,
    t: usize,
    quick: bool,
) -> Result<(), Box<dyn std::error::Error>> {
    let (d, i, kv) = (c.dim, c.ffn_dim, c.kv_heads * c.head_dim);
    let l = c.layers;
    let chunk = 1024.min(t);
    let shapes = [
        (Product::Nt, t, d, d, 2 * l),
        (Product::Nt, t, kv, d, 2 * l),
        (Product::Nt, t, i, d, 2 * l),
        (Product::Nt, t, d, i, l),
        (Product::Nt, chunk, c.vocab, d, t / chunk),
        (Product::Nn, t, d, d, 2 * l),
        (Product::Nn, t, kv, d, 2 * l),
        (Product::Nn, t, i, d, 2 * l),
        (Product::Nn, t, d, i, l),
        (Product::Nn, chunk, c.vocab, d, t / chunk),
    ];
    let tiles = [
        Tile::LARGE,
        Tile::SMALL,
        Tile {
            bm: 128,
            bn: 128,
            bk: 16,
            tm: 8,
            tn: 8,
        },
        Tile {
            bm: 128,
            bn: 64,
            bk: 16,
            tm: 8,
            tn: 4,
        },
        Tile {
            bm: 64,
            bn: 128,
            bk: 16,
            tm: 4,
            tn: 8,
        },
        Tile {
            bm: 64,
            bn: 64,
            bk: 16,
            tm: 4,
            tn: 8,
        },
        Tile::MEDIUM,
        Tile {
            bm: 32,
            bn: 64,
            bk: 16,
            tm: 4,
            tn: 4,
        },
    ];
    let config = if quick {
        BenchConfig {
            warmup: std::time::Duration::from_millis(50),
            reps: 3,
        }
    } else {
        BenchConfig::default()
    };
    println!();
    println!(
        "The step's GEMMs ({t} tokens), µs (TFLOP/s) at each tile (bm×bn×bk tm×tn); * = Gemm::new's:"
    );
    println!();
    let names: Vec<String> = tiles
        .iter()
        .map(|t| format!("{}×{}×{} {}×{}", t.bm, t.bn, t.bk, t.tm, t.tn))
        .collect();
    println!("| product m×n×k | per step | {} |", names.join(" | "));
    println!("|---|---|{}", "---|".repeat(tiles.len()));
    let mut chosen_total = 0.0;
    let mut best_total = 0.0;
    for (product, m, n, k, count) in shapes {
        let filled = |len: usize| -> Result<GpuBuffer<f32>, hesper::exec::ExecError> {
            gpu.upload(
                &(0..len)
                    .map(|x| ((x % 97) as f32 - 48.0) / 97.0)
                    .collect::<Vec<_>>(),
            )
        };
        let (rows_in, rows_out) = match product {
            Product::Nt => (k, n),
            Product::Nn => (n, k),
        };
        let input = filled(m * rows_in)?;
        let w = filled(n * k)?;
        let mut out = gpu.zeros::<f32>(m * rows_out)?;
        let flops = 2.0 * (m * n * k) as f64;
        let default = Gemm::new(product, (m, n, k), false).tile;
        let mut cells = vec![];
        let mut best = f64::INFINITY;
        for tile in tiles {
            let gemm = Gemm {
                tile,
                ..Gemm::new(product, (m, n, k), false)
            };
            if tile.check("gemm").is_err() {
                cells.push("–".to_string());
                continue;
            }
            let us = bench(gpu, "gemm", config, |rec| {
                execute_gemm(rec, &gemm, &input, GemmWeights::Dense(&w), &mut out)
            })?
            .median_ns()
                / 1e3;
            best = best.min(us);
            if tile == default {
                chosen_total += us * count as f64;
            }
            let mark = if tile == default { "*" } else { "" };
            cells.push(format!("{us:.0}{mark} ({:.1})", flops / us / 1e6));
        }
        best_total += best * count as f64;
        println!(
            "| {product:?} {m}×{n}×{k} | {count} | {} |",
            cells.join(" | ")
        );
    }
    println!();
    println!(
        "GEMM time a step at the chosen tiles {:.1} ms; at the best tile of each shape {:.1} ms",
        chosen_total / 1e3,
        best_total / 1e3
    );
    Ok(())
}
