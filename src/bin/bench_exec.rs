//! Executor benchmarks: device copy and fill bandwidth, the CPU cost of recording a launch,
//! compile time, pipeline-cache hit time, and compile time with a warm driver cache. Prints a
//! markdown table for BENCHMARKS.md.
//!
//! ```sh
//! scripts/with-gpu cargo run --release --bin bench_exec            # full sizes (for the H200)
//! HESPER_BENCH_QUICK=1 scripts/with-gpu cargo run --release --bin bench_exec   # small, for lavapipe
//! ```

use std::time::{Duration, Instant};

use hesper::dsl::prelude::*;
use hesper::exec::profile::{BenchConfig, bench};
use hesper::exec::{Args, Gpu, GpuOptions, Grid};

/// The probe's WGSL vec4 copy on the H200 (shared/GPU.md) and PyTorch's device copy (TARGETS.md).
const PROBE_COPY_GBS: f64 = 4120.0;
const TORCH_COPY_GBS: f64 = 4250.0;

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

struct Row(String, String, String, String);

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let quick = std::env::var_os("HESPER_BENCH_QUICK").is_some();
    let gpu = Gpu::new()?;
    println!("device: {}", gpu.describe());
    println!("features: {:?}", gpu.wgpu_features());
    let config = if quick {
        BenchConfig {
            warmup: Duration::from_millis(200),
            reps: 5,
        }
    } else {
        BenchConfig::default()
    };
    let mut rows = vec![];

    // --- bandwidth: compute copy and fill through the executor's own kernels
    let sizes: &[usize] = if quick {
        &[1 << 20]
    } else {
        &[16 << 20, 64 << 20, 256 << 20]
    };
    for &n in sizes {
        let src = gpu.filled(n, 1.0f32)?;
        let dst = gpu.zeros::<f32>(n)?;
        let m = bench(&gpu, "copy", config, |rec| rec.copy(&src, &dst))?;
        let gbs = m.gb_per_s(2.0 * 4.0 * n as f64);
        rows.push(Row(
            format!("compute copy, {} MiB f32", (n * 4) >> 20),
            format!("{:.1} µs", m.median_ns() / 1e3),
            format!("{gbs:.0} GB/s"),
            format!(
                "{:.3} of the probe's 4.12 TB/s, {:.3} of PyTorch's 4.25",
                gbs / PROBE_COPY_GBS,
                gbs / TORCH_COPY_GBS
            ),
        ));
        let m = bench(&gpu, "fill", config, |rec| rec.fill(&dst, 2.0f32))?;
        let gbs = m.gb_per_s(4.0 * n as f64);
        rows.push(Row(
            format!("fill, {} MiB f32", (n * 4) >> 20),
            format!("{:.1} µs", m.median_ns() / 1e3),
            format!("{gbs:.0} GB/s"),
            format!("{:.3} of the probe's copy", gbs / PROBE_COPY_GBS),
        ));
        if gpu.copy(&src, &dst).is_ok() && dst.read(&gpu)?.iter().any(|v| *v != 1.0) {
            return Err("copy produced wrong data".into());
        }
    }

    // --- recording: CPU cost of one launch, through a uniform and through immediates
    let launches = if quick { 2_000 } else { 20_000 };
    let mut modes = vec![("uniform", Features::NONE)];
    if gpu.kernel_features().contains(Features::IMMEDIATES) {
        modes.push(("immediates", Features::IMMEDIATES));
    }
    for (mode, features) in modes {
        let key = KernelKey::new("bench_axpy")
            .workgroup_size(256)
            .features(features);
        let kernel = gpu.kernel(&key, axpy)?;
        let (x, y) = (gpu.filled(1024, 1.0f32)?, gpu.filled(1024, 0.0f32)?);
        let mut best = f64::INFINITY;
        let mut gpu_per_launch = 0.0;
        for _ in 0..3 {
            let t0 = Instant::now();
            let mut rec = gpu.recorder();
            for i in 0..launches {
                let args = Args::new()
                    .buffer("x", &x)
                    .buffer("y", &y)
                    .param("a", i as f32)
                    .param("n", 1024u32);
                rec.launch(&kernel, &args, Grid::Threads(1024))?;
            }
            let recorded = t0.elapsed();
            rec.submit()?;
            gpu.wait()?;
            let all = t0.elapsed();
            let per = recorded.as_secs_f64() * 1e6 / launches as f64;
            if per < best {
                best = per;
                gpu_per_launch = (all - recorded).as_secs_f64() * 1e6 / launches as f64;
            }
        }
        rows.push(Row(
            format!("record one launch ({mode}), {launches} per submit"),
            format!("{best:.2} µs CPU"),
            format!("{gpu_per_launch:.2} µs/launch to drain"),
            "target ≤ 5 µs".into(),
        ));
    }

    // --- compile: first build + compile of new keys, then cache hits
    let mut first = vec![];
    for cols in 0..10u32 {
        let key = KernelKey::new("bench_row_sum")
            .workgroup_size(256)
            .shape("cols", 1000 + cols);
        let t0 = Instant::now();
        gpu.kernel(&key, row_sum)?;
        first.push(t0.elapsed().as_secs_f64() * 1e3);
    }
    first.sort_by(f64::total_cmp);
    rows.push(Row(
        "first compile (build, WGSL, naga, pipeline), row reduction".into(),
        format!("{:.2} ms median of 10", first[5]),
        String::new(),
        String::new(),
    ));
    let key = KernelKey::new("bench_row_sum")
        .workgroup_size(256)
        .shape("cols", 1000u32);
    let hits = if quick { 100_000 } else { 1_000_000 };
    let t0 = Instant::now();
    for _ in 0..hits {
        std::hint::black_box(gpu.kernel(std::hint::black_box(&key), row_sum)?);
    }
    let hit_ns = t0.elapsed().as_secs_f64() * 1e9 / hits as f64;
    rows.push(Row(
        "pipeline-cache hit (`Gpu::kernel`)".into(),
        format!("{hit_ns:.0} ns"),
        String::new(),
        "target ≤ 2 µs".into(),
    ));

    // --- driver cache: the same kernels compiled by a fresh device with a warm cache file
    let path = std::env::temp_dir().join(format!("hesper-bench-cache-{}.bin", std::process::id()));
    let open = || {
        Gpu::with_options(GpuOptions {
            pipeline_cache_file: Some(path.clone()),
            ..GpuOptions::default()
        })
    };
    let compile_all = |g: &Gpu| -> Result<f64, Box<dyn std::error::Error>> {
        let t0 = Instant::now();
        for cols in 0..10u32 {
            let key = KernelKey::new("bench_row_sum")
                .workgroup_size(256)
                .shape("cols", 2000 + cols);
            g.kernel(&key, row_sum)?;
        }
        Ok(t0.elapsed().as_secs_f64() * 1e3 / 10.0)
    };
    let cold = open()?;
    let status = format!("{:?}", cold.driver_cache_status());
    let cold_ms = compile_all(&cold)?;
    cold.save_pipeline_cache()?;
    drop(cold);
    let warm = open()?;
    let warm_ms = compile_all(&warm)?;
    rows.push(Row(
        "compile with the driver cache file: cold → warm".into(),
        format!("{cold_ms:.2} → {warm_ms:.2} ms per kernel"),
        format!("{:?}", warm.driver_cache_status()),
        format!("cold status {status}"),
    ));
    let _ = std::fs::remove_file(&path);

    println!();
    println!("| what | time | rate | against |");
    println!("| --- | --- | --- | --- |");
    for Row(a, b, c, d) in rows {
        println!("| {a} | {b} | {c} | {d} |");
    }
    Ok(())
}

/// `y = a·x + y`
fn axpy(k: &mut KernelBuilder) {
    let x = k.storage::<f32>("x");
    let y = k.storage_rw::<f32>("y");
    let a = k.param::<f32>("a");
    let n = k.param::<u32>("n");
    let i = k.global_index();
    k.if_(i.lt(&n), |k| k.store(&y, &i, a * x.at(&i) + y.at(&i)));
}

/// One workgroup sums one row of `cols` (a shape parameter).
fn row_sum(k: &mut KernelBuilder) {
    let x = k.storage::<f32>("x");
    let out = k.storage_rw::<f32>("out");
    let cols = k.shape_const::<u32>("cols");
    let row = k.let_("row", k.workgroup_id().x());
    let acc = k.var("acc", 0.0f32);
    k.row_loop(&cols, |k, c| k.add_assign(&acc, x.at(&row * &cols + c)));
    let s = k.workgroup_reduce(acc.get(), Reduce::Sum);
    k.if_(k.local_index().eq(0u32), |k| k.store(&out, &row, s));
}
