//! Kernel benchmarks at the shapes of shared/TARGETS.md: GPU time (timestamp queries, median
//! after a warm-up), GB/s or TFLOP/s, and the fraction of the roofline. Prints a markdown table
//! for BENCHMARKS.md.
//!
//! ```sh
//! scripts/with-gpu cargo run --release --bin bench_kernels                          # full sizes (H200)
//! HESPER_BENCH_QUICK=1 scripts/with-gpu cargo run --release --bin bench_kernels     # small, lavapipe
//! HESPER_BENCH_ONLY=lora,norm scripts/with-gpu cargo run --release --bin bench_kernels  # some groups
//! HESPER_BENCH_ONLY=attention HESPER_BENCH_ATTENTION='8,512,9,3,64;24,512,9,3,64' \
//!     scripts/with-gpu cargo run --release --bin bench_kernels   # attention at other shapes
//! ```
//!
//! Groups (for `HESPER_BENCH_ONLY`, comma-separated): elementwise, norm, softmax, lora,
//! cross_entropy, adamw, gemm, attention, ffn. `HESPER_BENCH_ATTENTION` replaces the
//! attention's shapes by its own, `batch,seq_len,heads,kv_heads,head_dim` each, `;` between.

use std::time::Duration;

use hesper::exec::half::f16;
use hesper::exec::profile::{BenchConfig, Measurement, bench};
use hesper::exec::{ExecError, Gpu, GpuBuffer, Recorder};
use hesper::kernels::linear::{Gemm, Product, Tile, Weights};
use hesper::kernels::{attention, ffn, linear, lora, loss, norm, optim};

/// Device copy on the H200 (PyTorch; TARGETS.md): "of copy" is bytes over this.
const COPY_GBS: f64 = 4250.0;

struct Row {
    /// Least bytes moved, for the same-size copy column (0 for compute-bound rows).
    bytes: f64,
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
        bytes,
        kernel: kernel.into(),
        shape,
        rate: format!("{gbs:.0} GB/s"),
        fraction: format!("{:.2} of copy", gbs / COPY_GBS),
        m,
        target,
    }
}

/// The shapes of `HESPER_BENCH_ATTENTION` (`batch,seq_len,heads,kv_heads,head_dim;…`).
fn attention_shapes(list: &str) -> Result<Vec<[usize; 5]>, String> {
    list.split(';')
        .map(|shape| {
            let dims: Result<Vec<usize>, _> = shape.split(',').map(|d| d.trim().parse()).collect();
            dims.ok()
                .and_then(|dims| dims.try_into().ok())
                .ok_or_else(|| {
                    format!(
                        "HESPER_BENCH_ATTENTION: expected batch,seq_len,heads,kv_heads,head_dim \
                         (five whole numbers), found `{shape}`"
                    )
                })
        })
        .collect()
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let quick = std::env::var_os("HESPER_BENCH_QUICK").is_some();
    // Cooperative matrices where the device has them: the attention group's f16 rows.
    let gpu = Gpu::with_options(hesper::exec::GpuOptions {
        cooperative_matrix: true,
        ..Default::default()
    })?;
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
    let only = std::env::var("HESPER_BENCH_ONLY").ok();
    let wanted = |group: &str| {
        only.as_deref()
            .is_none_or(|only| only.split(',').any(|g| g.trim() == group))
    };

    // --- elementwise FFN backward: 3 reads, 2 writes
    if wanted("elementwise") {
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
    }
    // --- RMSNorm forward (reads x, writes y) and backward (dx: reads x, dy, writes dx); γ and
    // rstd are small
    if wanted("norm") {
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
            let m = bench(&gpu, "rms_norm_forward", config, |rec| {
                norm::execute_rms_norm_forward(rec, &x, &gamma, &mut y, &mut rstd, 1e-5)
            })?;
            rows.push(bandwidth(
                "rms_norm_forward (y)",
                format!("{t}×{cols}"),
                m,
                2.0 * 4.0 * n as f64,
                target,
            ));
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
    }
    // --- softmax backward 8×20×512×512
    if wanted("softmax") {
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
    if wanted("lora") {
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
        let mut scratch = gpu.zeros::<f32>(lora::lora_scratch_len(t, d + d, r))?;
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
    if wanted("cross_entropy") {
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
    if wanted("adamw") {
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

    // --- f32 GEMM at 4096×2560×6912 (BitNet 2B's FFN): forward NT and backward NN, by tile
    if wanted("gemm") {
        let (m, n, k) = if quick {
            (64, 256, 128)
        } else {
            (4096, 6912, 2560)
        };
        let (x, w, dy) = (
            filled(&gpu, m * k, 17)?,
            filled(&gpu, n * k, 18)?,
            filled(&gpu, m * n, 19)?,
        );
        let (mut y, mut dx) = (gpu.zeros::<f32>(m * n)?, gpu.zeros::<f32>(m * k)?);
        let flops = 2.0 * (m * n * k) as f64;
        let tiles = [
            ("128×128×8", Tile::LARGE),
            ("64×64×16", Tile::SMALL),
            ("64×64×16 8×8", Tile::MEDIUM),
            (
                "128×128×16",
                Tile {
                    bm: 128,
                    bn: 128,
                    bk: 16,
                    tm: 8,
                    tn: 8,
                },
            ),
        ];
        for (label, tile) in tiles {
            for product in [Product::Nt, Product::Nn] {
                let gemm = Gemm {
                    tile,
                    ..Gemm::new(product, (m, n, k), false)
                };
                let (input, out, name) = match product {
                    Product::Nt => (&x, &mut y, "matmul_nt"),
                    Product::Nn => (&dy, &mut dx, "matmul_nn"),
                };
                let r = bench(&gpu, name, config, |rec| {
                    linear::execute_gemm(rec, &gemm, input, Weights::Dense(&w), &mut *out)
                });
                let m_ = match r {
                    Ok(m_) => m_,
                    Err(e) => {
                        println!("{name} tile {label}: {e}");
                        continue;
                    }
                };
                let tf = m_.tflop_per_s(flops);
                rows.push(Row {
                    bytes: 0.0,
                    kernel: format!("{name} (tile {label})"),
                    shape: format!("{m}×{n}×{k}"),
                    rate: format!("{tf:.1} TFLOP/s"),
                    fraction: format!("{:.2} of cuBLAS f32 (51)", tf / 51.0),
                    m: m_,
                    target: "≥ 20",
                });
            }
        }
    }

    // --- causal attention over sequences, forward and backward (TARGETS.md, SDPA f32 anchors)
    if wanted("attention") {
        use attention::{SeqGrads, SeqInputs, SeqSaved, SeqShape};
        use hesper::kernels::linear::Precision;
        // Each shape with SDPA's TFLOP/s and our targets, forward and backward: f32, and f16
        // (against SDPA bf16) where the device has tensor cores.
        type Figures = ([f64; 2], [&'static str; 2]);
        let none = ([0.0; 2], ["–"; 2]);
        let chosen = std::env::var("HESPER_BENCH_ATTENTION").ok();
        let shapes: Vec<(SeqShape, Figures, Figures)> = if let Some(list) = chosen {
            let shapes = attention_shapes(&list)?.into_iter();
            shapes
                .map(|[b, s, h, kv, hd]| (SeqShape::new(b, s, h, kv, hd), none, none))
                .collect()
        } else if quick {
            vec![(SeqShape::new(1, 64, 4, 2, 64), none, none)]
        } else {
            vec![
                (
                    SeqShape::new(8, 512, 9, 3, 64),
                    ([5.7, 8.2], ["≥ 15", "≥ 16"]),
                    ([127.0, 32.0], ["–", "≥ 64"]),
                ),
                (
                    SeqShape::new(8, 512, 20, 5, 128),
                    ([9.9, 19.7], ["≥ 25", "≥ 25"]),
                    ([268.0, 141.0], ["–", "≥ 150"]),
                ),
                (
                    SeqShape::new(2, 2048, 32, 8, 128),
                    ([11.7, 23.6], ["≥ 30", "≥ 30"]),
                    ([476.0, 361.0], ["–", "≥ 250"]),
                ),
            ]
        };
        let tensor_cores = linear::coop::subgroup_size(&gpu).is_some();
        for (shape, f32_figures, f16_figures) in shapes {
            let mut runs = vec![(Precision::F32, f32_figures, "f32", "SDPA f32")];
            if tensor_cores {
                runs.push((Precision::F16, f16_figures, "f16 tensor cores", "SDPA bf16"));
            }
            for (precision, (sdpa, targets), label, against) in runs {
                let shape = shape.with_precision(precision);
                let (b, s, h, kv, hd) = (
                    shape.batch,
                    shape.seq_len,
                    shape.heads,
                    shape.kv_heads,
                    shape.head_dim,
                );
                let (q, k, v) = (
                    filled(&gpu, shape.q_len(), 30)?,
                    filled(&gpu, shape.kv_len(), 31)?,
                    filled(&gpu, shape.kv_len(), 32)?,
                );
                let d_out = filled(&gpu, shape.q_len(), 33)?;
                let rows_h = shape.tokens() * h;
                let z = |n: usize| gpu.zeros::<f32>(n);
                let (mut o, mut lse, mut stats) = (z(shape.q_len())?, z(rows_h)?, z(2 * rows_h)?);
                let (mut dq, mut dk, mut dv) =
                    (z(shape.q_len())?, z(shape.kv_len())?, z(shape.kv_len())?);
                let inputs = SeqInputs {
                    q: &q,
                    k: &k,
                    v: &v,
                    lens: None,
                };
                let forward = bench(&gpu, "attention_forward", config, |rec| {
                    attention::execute_attention_forward(rec, shape, inputs, &mut o, &mut lse)
                })?;
                let saved = SeqSaved {
                    inputs,
                    o: &o,
                    lse: &lse,
                };
                // The backward as it recomputes the scores for dQ, and (where the tensor cores
                // take one) with the workspace that keeps the scores' gradients instead.
                let mut scores = match attention::scores_workspace_len(&gpu, &shape) {
                    Some(n) => vec![None, Some(gpu.zeros::<f16>(n)?)],
                    None => vec![None],
                };
                let mut backward = Vec::new();
                for scores in scores.iter_mut() {
                    let name = match scores {
                        Some(_) => "attention_backward, scores' gradients kept",
                        None => "attention_backward",
                    };
                    let m = bench(&gpu, name, config, |rec| {
                        let grads = SeqGrads {
                            stats: &mut stats,
                            scores: scores.as_mut(),
                            d_q: &mut dq,
                            d_k: &mut dk,
                            d_v: &mut dv,
                        };
                        attention::execute_attention_backward(rec, shape, saved, &d_out, grads)
                    })?;
                    backward.push((name, m));
                }
                // PyTorch's count for causal attention: half the square.
                let flops = 4.0 * (b * h * s * s * hd) as f64 / 2.0;
                let forward = [(0, "attention_forward", forward, flops)];
                let backward = backward.into_iter().map(|(n, m)| (1, n, m, 2.5 * flops));
                for (i, name, m, flops) in forward.into_iter().chain(backward) {
                    let tf = m.tflop_per_s(flops);
                    rows.push(Row {
                        bytes: 0.0,
                        kernel: format!("{name} (causal, {label})"),
                        shape: format!("B={b} S={s} H={h} KV={kv} hd={hd}"),
                        rate: format!("{tf:.1} TFLOP/s"),
                        fraction: if sdpa[i] > 0.0 {
                            format!("{:.2}× {against} ({})", tf / sdpa[i], sdpa[i])
                        } else {
                            "–".into()
                        },
                        m,
                        target: targets[i],
                    });
                }
            }
        }
    }

    // --- one layer's whole FFN backward (SwiGLU), T × 2560 → 6912
    if wanted("ffn") {
        let (d, i) = if quick { (64, 96) } else { (2560, 6912) };
        let (x, gamma, rstd) = (
            filled(&gpu, t * d, 20)?,
            filled(&gpu, d, 21)?,
            filled(&gpu, t, 22)?,
        );
        let (wg, wu, wd) = (
            filled(&gpu, i * d, 23)?,
            filled(&gpu, i * d, 24)?,
            filled(&gpu, d * i, 25)?,
        );
        let (gate, up) = (filled(&gpu, t * i, 26)?, filled(&gpu, t * i, 27)?);
        let layer = ffn::FfnLayer {
            style: ffn::FfnStyle::SwiGlu,
            norm_gamma: &gamma,
            w_gate: &wg,
            w_up: &wu,
            w_down: &wd,
            x: &x,
            x_rstd: &rstd,
            gate: &gate,
            up: &up,
        };
        let z = |n: usize| gpu.zeros::<f32>(n);
        let (mut d_h, mut d_hn, mut d_g, mut d_u, mut d_n, mut dx) =
            (z(t * i)?, z(1)?, z(t * i)?, z(t * i)?, z(t * d)?, z(t * d)?);
        let m = bench(&gpu, "ffn_backward", config, |rec| {
            let scratch = ffn::FfnScratch {
                d_h: &mut d_h,
                d_h_norm: &mut d_hn,
                d_gate: &mut d_g,
                d_up: &mut d_u,
                d_norm: &mut d_n,
            };
            ffn::execute_ffn_backward(rec, &layer, scratch, &mut dx)
        })?;
        let flops = 3.0 * 2.0 * (t * d * i) as f64;
        let tf = m.tflop_per_s(flops);
        rows.push(Row {
            bytes: 0.0,
            kernel: "ffn_backward (SwiGLU, whole layer)".into(),
            shape: format!("T={t} D={d} I={i}"),
            rate: format!("{tf:.1} TFLOP/s"),
            fraction: "3 GEMMs + elementwise + norm".into(),
            m,
            target: "–",
        });
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
    // A compute copy moving the same bytes: small kernels pay a fixed launch and tail cost that
    // a copy of their size pays too.
    let mut same_size = vec![];
    for r in &rows {
        if r.bytes == 0.0 {
            same_size.push(String::new());
            continue;
        }
        let n = (r.bytes / 8.0) as usize;
        let (src, dst) = (filled(&gpu, n, 99)?, gpu.zeros::<f32>(n)?);
        let m = bench(&gpu, "copy", config, |rec| rec.copy(&src, &dst))?;
        same_size.push(format!(
            "{:.2}",
            r.m.gb_per_s(r.bytes) / m.gb_per_s(r.bytes)
        ));
    }
    println!("| kernel | shape | median | min | rate | fraction | of a same-size copy | target |");
    println!("| --- | --- | --- | --- | --- | --- | --- | --- |");
    for (r, same) in rows.iter().zip(same_size) {
        println!(
            "| {} | {} | {:.1} µs | {:.1} µs | {} | {} | {} | {} |",
            r.kernel,
            r.shape,
            r.m.median_ns() / 1e3,
            r.m.min_ns() / 1e3,
            r.rate,
            r.fraction,
            same,
            r.target
        );
    }
    Ok(())
}
