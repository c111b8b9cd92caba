//! What is safe across threads, under load: one `Gpu` shared by many threads (recorders built
//! and submitted concurrently, readbacks, compiles), several `Gpu`s at once, and `Gpu`s opened
//! and dropped while others work (what hung the H200's driver). Every result is checked exactly.
//!
//! `HESPER_STRESS=heavy` runs the heavier setting the H200 runs many times.

mod common;

use std::sync::Arc;
use std::thread;

use common::Rng;
use hesper::dsl::prelude::*;
use hesper::exec::{Args, CompiledKernel, Gpu, GpuBuffer, Grid, Recorder};

fn _shared_between_threads()
where
    Gpu: Send + Sync,
    GpuBuffer<f32>: Send + Sync,
    CompiledKernel: Send + Sync,
    Recorder<'static>: Send,
{
}

/// `x[i] = x[i] * 3 + step` over u32, at a workgroup size from the key (so threads compile
/// kernels of their own concurrently).
fn mul_add(gpu: &Gpu, wg: u32) -> Arc<CompiledKernel> {
    let key = KernelKey::new("stress_mul_add").workgroup_size(wg);
    gpu.kernel(&key, |k| {
        let x = k.storage_rw::<u32>("x");
        let step = k.param::<u32>("step");
        let n = k.param::<u32>("n");
        let i = k.global_index();
        k.if_(i.lt(&n), |k| k.store(&x, &i, x.at(&i) * 3u32 + &step));
    })
    .unwrap()
}

struct Load {
    threads: usize,
    rounds: usize,
    launches: u32,
    len: usize,
    churn: usize,
}

fn load() -> Load {
    match std::env::var("HESPER_STRESS").as_deref() {
        Ok("heavy") => Load {
            threads: 16,
            rounds: 200,
            launches: 50,
            len: 100_000,
            churn: 100,
        },
        _ => Load {
            threads: 6,
            rounds: 12,
            launches: 8,
            len: 3000,
            churn: 6,
        },
    }
}

/// One thread's work: rounds of upload, `launches` recorded launches (and a fill and copy in
/// the same recorder), one submit, readback, exact check.
fn work(gpu: &Gpu, thread: usize, load: &Load) {
    let mut rng = Rng::new(thread as u64 + 1);
    let wgs = [32, 64, 128, 256];
    for round in 0..load.rounds {
        let n = load.len - (rng.next_u32() as usize % 100);
        let start: Vec<u32> = (0..n).map(|_| rng.next_u32()).collect();
        let x = gpu.upload(&start).unwrap();
        let copy = gpu.filled(n, 0u32).unwrap();
        let kernel = mul_add(gpu, wgs[(thread + round) % wgs.len()]);
        let mut rec = gpu.recorder();
        let first = (thread * 1000 + round) as u32;
        for step in first..first + load.launches {
            let args = Args::new()
                .buffer("x", &x)
                .param("step", step)
                .param("n", n as u32);
            rec.launch(&kernel, &args, Grid::Threads(n as u64)).unwrap();
        }
        rec.copy(&x, &copy).unwrap();
        rec.fill(&x, 7).unwrap();
        rec.submit().unwrap();
        let want: Vec<u32> = start
            .iter()
            .map(|&v| {
                (first..first + load.launches).fold(v, |acc, s| acc.wrapping_mul(3).wrapping_add(s))
            })
            .collect();
        let got = copy.read(gpu).unwrap();
        let wrong = got.iter().zip(&want).filter(|(a, b)| a != b).count();
        assert_eq!(
            wrong, 0,
            "thread {thread}, round {round}: {wrong} of {n} wrong"
        );
        assert!(x.read(gpu).unwrap().iter().all(|v| *v == 7));
    }
}

#[test]
fn threads_share_gpus_while_others_open_and_drop_theirs() {
    let load = load();
    let gpus = [Gpu::new().unwrap(), Gpu::new().unwrap()];
    thread::scope(|s| {
        for t in 0..load.threads {
            let (gpu, load) = (&gpus[t % gpus.len()], &load);
            s.spawn(move || work(gpu, t, load));
        }
        // Meanwhile `Gpu`s come and go, each used briefly (a device destroyed here would hang
        // NVIDIA's driver).
        for c in 0..2 {
            let load = &load;
            s.spawn(move || {
                for i in 0..load.churn {
                    let g = Gpu::new().unwrap();
                    let v = (c * 1000 + i) as u32;
                    assert_eq!(g.upload(&[v]).unwrap().read(&g).unwrap(), [v]);
                }
            });
        }
    });
}
