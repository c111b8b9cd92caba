//! The executor on lavapipe: the pipeline cache, many launches to one submit, fill, copy (whole
//! and of a range) and readback of every element, timing, and the driver-cache file.

mod common;

use std::sync::Arc;

use common::{Rng, gpu, gpu_with_cache_file};
use hesper::dsl::prelude::*;
use hesper::exec::{Args, DriverCacheStatus, ExecError, Gpu, GpuOptions, Grid, LaunchCache};

/// `x[i] = x[i] * 3 + step` over u32 (exact, so 1000 chained launches can be checked exactly).
fn mul_add_key(features: Features, wg: u32) -> KernelKey {
    KernelKey::new("mul_add_step")
        .workgroup_size(wg)
        .features(features)
}

fn mul_add(k: &mut KernelBuilder) {
    let x = k.storage_rw::<u32>("x");
    let step = k.param::<u32>("step");
    let n = k.param::<u32>("n");
    let i = k.global_index();
    k.if_(i.lt(&n), |k| k.store(&x, &i, x.at(&i) * 3u32 + &step));
}

#[test]
fn one_compile_per_key_and_a_new_one_per_shape() {
    let g = Gpu::new().unwrap();
    let before = g.cache_stats();
    let a = g.kernel(&mul_add_key(Features::NONE, 64), mul_add).unwrap();
    let b = g.kernel(&mul_add_key(Features::NONE, 64), mul_add).unwrap();
    assert!(Arc::ptr_eq(&a, &b), "a hit returns the compiled kernel");
    let s = g.cache_stats();
    assert_eq!((s.misses - before.misses, s.hits - before.hits), (1, 1));
    assert!(s.compile_time > std::time::Duration::ZERO);
    // Another shape (workgroup size) is another pipeline.
    let c = g
        .kernel(&mul_add_key(Features::NONE, 128), mul_add)
        .unwrap();
    assert!(!Arc::ptr_eq(&a, &c));
    assert_eq!(g.cache_stats().misses - before.misses, 2);
    // Compiling a built kernel goes through the same cache.
    let built = Kernel::build(&mul_add_key(Features::NONE, 64), mul_add).unwrap();
    assert!(Arc::ptr_eq(&a, &g.compile(&built).unwrap()));
    assert_eq!(g.cache_stats().misses - before.misses, 2);
}

#[test]
fn runtime_scalars_do_not_make_pipelines_and_1000_launches_are_right() {
    // Its own device: other tests compiling on the shared one would move the miss counter.
    let g = &Gpu::new().unwrap();
    let mut modes = vec![Features::NONE];
    if g.kernel_features().contains(Features::IMMEDIATES) {
        modes.push(Features::IMMEDIATES);
    }
    for mode in modes {
        let n = 1000usize;
        let mut rng = Rng::new(3);
        let start: Vec<u32> = (0..n).map(|_| rng.next_u32()).collect();
        let x = g.upload(&start).unwrap();
        let kernel = g.kernel(&mul_add_key(mode, 64), mul_add).unwrap();
        let misses = g.cache_stats().misses;
        let mut rec = g.recorder();
        for step in 0..1000u32 {
            let args = Args::new()
                .buffer("x", &x)
                .param("step", step)
                .param("n", n as u32);
            rec.launch(&kernel, &args, Grid::Threads(n as u64)).unwrap();
        }
        assert_eq!(rec.len(), 1000);
        rec.submit().unwrap();
        assert_eq!(
            g.cache_stats().misses,
            misses,
            "a runtime scalar made a pipeline"
        );
        let want: Vec<u32> = start
            .iter()
            .map(|&v| (0..1000u32).fold(v, |acc, s| acc.wrapping_mul(3).wrapping_add(s)))
            .collect();
        let got = x.read(g).unwrap();
        let wrong = got.iter().zip(&want).filter(|(a, b)| a != b).count();
        assert_eq!(
            wrong, 0,
            "{mode:?}: {wrong} of {n} elements differ after 1000 launches"
        );
    }
}

/// Recorders reusing one `LaunchCache` run each launch with its own params (the params chunk is
/// shared, its bytes written at each submit), while the bind groups are made once: for
/// launches of the same kernel on the same buffers at the same params offsets. Another buffer
/// is another bind group; two recorders alive at once, submitted in the other order, each
/// get their own params; past `MAX_BIND_GROUPS` it starts again.
#[test]
fn a_launch_cache_makes_bind_groups_once_and_keeps_every_launch_its_params() {
    let g = &Gpu::new().unwrap();
    let kernel = g.kernel(&mul_add_key(Features::NONE, 64), mul_add).unwrap();
    let n = 300usize;
    let mut rng = Rng::new(9);
    let start: Vec<u32> = (0..n).map(|_| rng.next_u32()).collect();
    let (x, y) = (g.upload(&start).unwrap(), g.upload(&start).unwrap());
    let cache = LaunchCache::new();
    let launch = |rec: &mut hesper::exec::Recorder<'_>, buf, step: u32| {
        let args = Args::new()
            .buffer("x", buf)
            .param("step", step)
            .param("n", n as u32);
        rec.launch(&kernel, &args, Grid::Threads(n as u64)).unwrap();
    };
    let apply = |v: &mut Vec<u32>, steps: &[u32]| {
        for e in v.iter_mut() {
            *e = steps
                .iter()
                .fold(*e, |a, s| a.wrapping_mul(3).wrapping_add(*s));
        }
    };
    let (mut want_x, mut want_y) = (start.clone(), start.clone());
    for round in 0..4u32 {
        let steps: Vec<u32> = (0..5).map(|i| 1000 * round + 7 * i + 1).collect();
        let mut rec = g.recorder_reusing(&cache);
        for &s in &steps {
            launch(&mut rec, &x, s);
        }
        rec.submit().unwrap();
        apply(&mut want_x, &steps);
        assert_eq!(cache.len(), 5, "round {round}: five launches, five offsets");
    }
    assert_eq!(x.read(g).unwrap(), want_x);
    // Another buffer at the same offsets: new bind groups beside the old.
    let mut rec = g.recorder_reusing(&cache);
    launch(&mut rec, &y, 5);
    rec.submit().unwrap();
    apply(&mut want_y, &[5]);
    assert_eq!(cache.len(), 6);
    // Two alive at once, the later submitted first: each launch still sees its own step.
    let mut first = g.recorder_reusing(&cache);
    let mut second = g.recorder_reusing(&cache);
    launch(&mut first, &x, 11);
    launch(&mut second, &y, 22);
    second.submit().unwrap();
    first.submit().unwrap();
    apply(&mut want_x, &[11]);
    apply(&mut want_y, &[22]);
    assert_eq!(x.read(g).unwrap(), want_x);
    assert_eq!(y.read(g).unwrap(), want_y);
    // Many launches in one recorder: each at its own offset, until the cache starts again.
    let mut rec = g.recorder_reusing(&cache);
    let steps: Vec<u32> = (0..LaunchCache::MAX_BIND_GROUPS as u32 + 10).collect();
    for &s in &steps {
        launch(&mut rec, &y, s);
    }
    rec.submit().unwrap();
    apply(&mut want_y, &steps);
    assert_eq!(y.read(g).unwrap(), want_y);
    assert!(cache.len() <= LaunchCache::MAX_BIND_GROUPS);
    cache.clear();
    assert!(cache.is_empty());
}

#[test]
fn a_key_that_emits_two_texts_is_caught() {
    let g = Gpu::with_options(GpuOptions {
        verify_cache_hits: true,
        ..GpuOptions::default()
    })
    .unwrap();
    let key = KernelKey::new("leaky").workgroup_size(64);
    let build = |scale: f32| {
        move |k: &mut KernelBuilder| {
            let x = k.storage_rw::<f32>("x");
            // `scale` changes the text but is not in the key: the bug this check exists for.
            k.store(&x, 0u32, x.at(0u32) * scale);
        }
    };
    // One call site (as in an `execute_*` function), called with a captured value that changes.
    let results: Vec<_> = [2.0, 2.0, 3.0]
        .into_iter()
        .map(|scale| g.kernel(&key, build(scale)).map(|_| ()))
        .collect();
    assert!(results[0].is_ok() && results[1].is_ok(), "{results:?}");
    let err = results[2].as_ref().expect_err("a key mismatch");
    assert!(matches!(err, ExecError::KeyMismatch { .. }), "{err}");
    assert!(err.to_string().contains("kernel `leaky`"), "{err}");
}

#[test]
fn fill_copy_and_readback_of_every_element() {
    let g = gpu();
    for len in [1usize, 3, 5, 1000, 65_537] {
        let a = g.filled(len, -1.5f32).unwrap();
        assert!(
            a.read(g).unwrap().iter().all(|v| *v == -1.5),
            "fill f32 len {len}"
        );
        let v4 = g.filled(len, [1.0f32, 2.0, 3.0, 4.0]).unwrap();
        assert!(
            v4.read(g)
                .unwrap()
                .iter()
                .all(|v| *v == [1.0, 2.0, 3.0, 4.0]),
            "fill vec4 len {len}"
        );
        let v2 = g.filled(len, [7u32, 9]).unwrap();
        assert!(
            v2.read(g).unwrap().iter().all(|v| *v == [7, 9]),
            "fill vec2 len {len}"
        );

        let mut rng = Rng::new(len as u64);
        let data: Vec<u32> = (0..len).map(|_| rng.next_u32()).collect();
        let src = g.upload(&data).unwrap();
        let dst = g.filled(len, 0xFFFF_FFFFu32).unwrap();
        g.copy(&src, &dst).unwrap();
        assert_eq!(dst.read(g).unwrap(), data, "copy len {len}");
    }
    let (a, b) = (g.zeros::<f32>(3).unwrap(), g.zeros::<f32>(4).unwrap());
    let err = g.copy(&a, &b).unwrap_err().to_string();
    assert_eq!(
        err,
        "kernel `hesper_copy`, binding `dst`: expected 3 elements, as src has, given 4 elements"
    );
}

/// `copy_range` of `len` elements from `src_start` to `dst_start`, checked against the same
/// copy on the host: the range holds `src`'s data, the rest of `dst` keeps its poison.
fn check_copy_range<T: hesper::exec::Element + PartialEq + std::fmt::Debug>(
    src: &[T],
    dst_len: usize,
    poison: T,
    (src_start, dst_start, len): (usize, usize, usize),
) {
    let g = gpu();
    let s = g.upload(src).unwrap();
    let d = g.filled(dst_len, poison).unwrap();
    let mut rec = g.recorder();
    rec.copy_range(&s, src_start, &d, dst_start, len).unwrap();
    assert_eq!(rec.len(), usize::from(len > 0), "launches for len {len}");
    rec.submit().unwrap();
    let mut want = vec![poison; dst_len];
    want[dst_start..dst_start + len].copy_from_slice(&src[src_start..src_start + len]);
    assert_eq!(
        d.read(g).unwrap(),
        want,
        "{} src {} → dst {dst_len}: {src_start}, {dst_start}, {len}",
        std::any::type_name::<T>(),
        src.len()
    );
}

#[test]
fn copy_range_moves_only_its_range() {
    let mut rng = Rng::new(21);
    let words: Vec<u32> = (0..1001).map(|_| rng.next_u32()).collect();
    // (src_start, dst_start, len): aligned and not, to either end, whole, empty.
    for range in [
        (0, 0, 1001),
        (0, 0, 1),
        (1, 3, 7),
        (5, 0, 996),
        (0, 1000, 1),
        (333, 17, 555),
        (1001, 0, 0),
        (2, 2, 0),
    ] {
        check_copy_range(&words, 1001, 0xDEAD_BEEFu32, range);
    }
    check_copy_range(&words, 2000, 0xDEAD_BEEFu32, (0, 999, 1001));
    let floats = rng.vec(70_001, 1.0);
    // Past one workgroup's reach many times, at unaligned offsets.
    check_copy_range(&floats, 70_003, f32::MAX, (3, 1, 69_997));
    let pairs: Vec<[u32; 2]> = (0..37).map(|_| [rng.next_u32(), rng.next_u32()]).collect();
    check_copy_range(&pairs, 40, [u32::MAX; 2], (3, 1, 33));
    let vec4s: Vec<[f32; 4]> = (0..123)
        .map(|_| {
            [
                rng.next_f32(),
                rng.next_f32(),
                rng.next_f32(),
                rng.next_f32(),
            ]
        })
        .collect();
    for range in [(0, 0, 123), (1, 2, 5), (7, 0, 116), (122, 9, 1)] {
        check_copy_range(&vec4s, 130, [-7.0f32; 4], range);
    }
}

#[test]
fn copy_range_refuses_ranges_past_the_end_and_one_buffer_for_both() {
    let g = gpu();
    let (a, b) = (g.zeros::<f32>(10).unwrap(), g.zeros::<f32>(6).unwrap());
    let err = |src: &hesper::exec::GpuBuffer<f32>, s, dst, d, len| {
        let mut rec = g.recorder();
        let e = rec.copy_range(src, s, dst, d, len).unwrap_err().to_string();
        assert!(rec.is_empty(), "{e}");
        e
    };
    assert_eq!(
        err(&a, 8, &b, 0, 3),
        "kernel `hesper_copy_range`, binding `src`: expected room for 3 elements from element 8, \
         given 10 elements"
    );
    assert_eq!(
        err(&a, 0, &b, 4, 3),
        "kernel `hesper_copy_range`, binding `dst`: expected room for 3 elements from element 4, \
         given 6 elements"
    );
    assert_eq!(
        err(&a, 11, &b, 0, 0),
        "kernel `hesper_copy_range`, binding `src`: expected room for 0 elements from element 11, \
         given 10 elements"
    );
    // An end past usize::MAX is an error, not a wrap.
    assert_eq!(
        err(&a, 1, &b, 0, usize::MAX),
        format!(
            "kernel `hesper_copy_range`, binding `src`: expected room for {} elements from \
             element 1, given 10 elements",
            usize::MAX
        )
    );
    assert_eq!(
        err(&a, 0, &a, 5, 5),
        "kernel `hesper_copy_range`, binding `dst`: expected a buffer other than src (a storage \
         buffer cannot be bound both read and read_write in one dispatch, views of it included; \
         copy through a second buffer), given src's buffer"
    );
}

/// A started readback holds the values of its start: work submitted after it (here a fill of
/// the same buffer) is not in it, and the buffer is free for that work at once.
#[test]
fn a_started_readback_reads_the_buffer_as_it_was_then() {
    let g = gpu();
    let data: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5 - 7.0).collect();
    let buf = g.upload(&data).unwrap();
    let pending = buf.read_start(g).unwrap();
    let mut rec = g.recorder();
    rec.fill(&buf, f32::NAN).unwrap();
    rec.submit().unwrap();
    let later = buf.read_start(g).unwrap();
    assert_eq!(pending.wait(g).unwrap(), data);
    assert!(later.wait(g).unwrap().iter().all(|v| v.is_nan()));
    let empty = g.zeros::<u32>(0).unwrap();
    assert!(empty.read_start(g).unwrap().wait(g).unwrap().is_empty());
}

#[test]
fn readbacks_reuse_staging_buffers() {
    let g = Gpu::new().unwrap();
    let buf = g.filled(10_000, 1u32).unwrap();
    for _ in 0..10 {
        assert_eq!(buf.read(&g).unwrap().len(), 10_000);
    }
    assert_eq!(g.staging_buffers(), 1);
    let small = g.filled(10, 2u32).unwrap();
    assert_eq!(small.read(&g).unwrap(), vec![2; 10]);
    assert_eq!(
        g.staging_buffers(),
        1,
        "a smaller read reuses the larger staging buffer"
    );
}

#[test]
fn too_short_buffers_are_refused_before_dispatch() {
    let g = gpu();
    let kernel = g.kernel(&mul_add_key(Features::NONE, 64), mul_add).unwrap();
    let x = g.filled(10, 5u32).unwrap();
    let mut rec = g.recorder();
    let args = Args::new()
        .buffer_at_least("x", &x, 11)
        .param("step", 1u32)
        .param("n", 11u32);
    let err = rec.launch(&kernel, &args, Grid::Threads(11)).unwrap_err();
    assert_eq!(
        err.to_string(),
        "kernel `mul_add_step`, binding `x`: expected at least 11 elements, given 10 elements"
    );
    assert!(rec.is_empty(), "nothing was recorded");
    rec.submit().unwrap();
    assert_eq!(x.read(g).unwrap(), vec![5; 10]);
}

#[test]
fn timed_launches_report_each_kernel() {
    let g = gpu();
    if !g.supports_timestamps() {
        eprintln!("skipped: {} has no TIMESTAMP_QUERY", g.describe());
        return;
    }
    let kernel = g.kernel(&mul_add_key(Features::NONE, 64), mul_add).unwrap();
    let x = g.filled(4096, 1u32).unwrap();
    let mut rec = g.timed_recorder(3).unwrap();
    for step in 0..3u32 {
        let args = Args::new()
            .buffer("x", &x)
            .param("step", step)
            .param("n", 4096u32);
        rec.launch(&kernel, &args, Grid::Threads(4096)).unwrap();
    }
    let args = Args::new()
        .buffer("x", &x)
        .param("step", 9u32)
        .param("n", 4096u32);
    assert!(
        rec.launch(&kernel, &args, Grid::Threads(4096)).is_err(),
        "over capacity"
    );
    // wgpu's query sets hold 4096 queries: more launches than that is an error, not a panic.
    assert!(
        g.timed_recorder(hesper::exec::MAX_TIMED_LAUNCHES + 1)
            .is_err()
    );
    let times = rec.submit_timed().unwrap();
    assert_eq!(times.len(), 3);
    for t in &times {
        assert_eq!(t.kernel, "mul_add_step");
        // The whole key (its workgroup of 64) and the launch's 4096 / 64 workgroups.
        assert_eq!(t.launch, format!("{} [64, 1, 1]", kernel.kernel().key()));
        assert!(t.gpu_ns.is_finite() && t.gpu_ns > 0.0, "{t:?}");
    }
    // The three launches really ran: 1 → 3·1+0 → 3·3+1 → 3·10+2.
    assert!(x.read(g).unwrap().iter().all(|v| *v == 32));
}

#[test]
fn driver_pipeline_cache_file_is_checked_before_it_is_trusted() {
    let dir = std::env::temp_dir().join(format!("hesper-cache-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("pipelines.bin");
    let open = || gpu_with_cache_file(&path);
    let g = open();
    if *g.driver_cache_status() == DriverCacheStatus::Off {
        eprintln!("skipped: {} has no PIPELINE_CACHE", g.describe());
        return;
    }
    assert_eq!(*g.driver_cache_status(), DriverCacheStatus::Empty);
    g.kernel(&mul_add_key(Features::NONE, 64), mul_add).unwrap();
    g.save_pipeline_cache().unwrap();
    drop(g);
    assert!(matches!(
        open().driver_cache_status(),
        DriverCacheStatus::Loaded { .. }
    ));

    // A flipped byte: ignored, with the reason.
    let mut bytes = std::fs::read(&path).unwrap();
    *bytes.last_mut().unwrap() ^= 0x55;
    std::fs::write(&path, &bytes).unwrap();
    let g = open();
    assert!(
        matches!(g.driver_cache_status(), DriverCacheStatus::Ignored(why) if why.contains("checksum")),
        "{:?}",
        g.driver_cache_status()
    );
    // Still works, and saving replaces the bad file.
    g.kernel(&mul_add_key(Features::NONE, 64), mul_add).unwrap();
    g.save_pipeline_cache().unwrap();
    drop(g);
    assert!(matches!(
        open().driver_cache_status(),
        DriverCacheStatus::Loaded { .. }
    ));

    // Written for another driver: ignored.
    let text = String::from_utf8_lossy(&std::fs::read(&path).unwrap()).replacen(
        "hesper pipeline cache v1\n",
        "hesper pipeline cache v1\nother",
        1,
    );
    std::fs::write(&path, text.as_bytes()).unwrap();
    assert!(
        matches!(open().driver_cache_status(), DriverCacheStatus::Ignored(why) if why.contains("another adapter"))
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `GpuOptions::max_invocations_per_workgroup` makes a device like one that allows no more:
/// the limits say so, and a wider kernel is refused with the DSL's limit error.
#[test]
fn a_device_can_be_asked_for_smaller_workgroups() {
    let small = Gpu::with_options(GpuOptions {
        max_invocations_per_workgroup: Some(256),
        ..Default::default()
    })
    .unwrap();
    let limits = small.kernel_limits();
    assert!(limits.max_invocations_per_workgroup <= 256);
    assert!(limits.max_workgroup_size[0] <= 256);
    let Err(err) = small.kernel(&mul_add_key(Features::NONE, 512), mul_add) else {
        panic!("a 512-wide kernel on a device asked for 256");
    };
    assert!(matches!(err, ExecError::Dsl(_)), "{err}");
    assert!(err.to_string().contains("512"), "{err}");
    small
        .kernel(&mul_add_key(Features::NONE, 256), mul_add)
        .unwrap();
}

/// One workgroup per row, past 65535 rows: `Grid::WorkgroupPerItem` lays them out in 2-D and
/// `workgroup_index` flattens them back; every row is written (outputs poisoned first).
#[test]
fn one_workgroup_per_item_reaches_every_row() {
    let g = gpu();
    let key = KernelKey::new("row_first_plus_last").workgroup_size(32);
    let kernel = g
        .kernel(&key, |k| {
            let x = k.storage::<u32>("x");
            let y = k.storage_rw::<u32>("y");
            let rows = k.param::<u32>("rows");
            let row = k.let_("row", k.workgroup_index());
            let lane = k.local_index();
            k.if_(row.lt(&rows).and(lane.eq(0u32)), |k| {
                k.store(&y, &row, x.at(&row * 4u32) + x.at(&row * 4u32 + 3u32));
            });
        })
        .unwrap();
    let rows = 70_000usize;
    let mut rng = Rng::new(11);
    let x: Vec<u32> = (0..rows * 4).map(|_| rng.next_u32() >> 2).collect();
    let (xb, yb) = (g.upload(&x).unwrap(), g.filled(rows, u32::MAX).unwrap());
    let mut rec = g.recorder();
    let args = Args::new()
        .buffer_at_least("x", &xb, rows * 4)
        .buffer_at_least("y", &yb, rows)
        .param("rows", rows as u32);
    rec.launch(&kernel, &args, Grid::WorkgroupPerItem(rows as u64))
        .unwrap();
    rec.submit().unwrap();
    let got = yb.read(g).unwrap();
    let wrong = (0..rows)
        .filter(|&r| got[r] != x[4 * r] + x[4 * r + 3])
        .count();
    assert_eq!(wrong, 0, "{wrong} of {rows} rows wrong or unwritten");
}

/// The async calls a web page must use also run on native, so one code path serves both:
/// `Gpu::new_async`, and `read_async` after a launch reads what a blocking `read` does.
#[test]
fn async_open_and_readback_run_on_native_too() {
    pollster::block_on(async {
        let g = Gpu::new_async().await.unwrap();
        let x: Vec<u32> = (0..1000).collect();
        let mut b = g.upload(&x).unwrap();
        let kernel = g.kernel(&mul_add_key(Features::NONE, 64), mul_add).unwrap();
        let mut rec = g.recorder();
        let args = Args::new()
            .buffer("x", &b)
            .param("step", 5u32)
            .param("n", 1000u32);
        rec.launch(&kernel, &args, Grid::Threads(1000)).unwrap();
        rec.submit().unwrap();
        let want: Vec<u32> = x.iter().map(|v| v * 3 + 5).collect();
        assert_eq!(b.read_async(&g).await.unwrap(), want);
        assert_eq!(b.read(&g).unwrap(), want);
        b = g.upload(&[]).unwrap();
        assert!(b.read_async(&g).await.unwrap().is_empty());
    });
}

/// Autotuning: measured once per key, the fastest kept, remembered in memory and in the tune
/// cache file; a damaged line is measured again, a file of another device ignored whole.
#[test]
fn autotune_measures_once_and_remembers_in_its_file() {
    use hesper::exec::TuneFileStatus;
    let dir = std::env::temp_dir().join(format!("hesper-tune-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("tune.txt");
    let open = || {
        Gpu::with_options(GpuOptions {
            autotune: true,
            tune_cache_file: Some(path.clone()),
            ..Default::default()
        })
        .unwrap()
    };
    let tiles = [16u32, 32, 64];
    let name = |t: &u32| format!("tile{t}");
    // 32 is fastest; 64 fails to measure and is skipped.
    let timing = |t: &u32| match t {
        16 => Ok(3.0),
        32 => Ok(1.0),
        _ => Err(ExecError::Device("too big".into())),
    };
    let never = |_: &u32| -> Result<f64, ExecError> { panic!("measured again") };

    let g = open();
    assert_eq!(*g.tune_file_status(), TuneFileStatus::Empty);
    assert_eq!(g.tuned("gemm v1 a", &tiles, name, timing).unwrap(), 32);
    assert_eq!(g.tuned("gemm v1 a", &tiles, name, never).unwrap(), 32);
    assert_eq!(
        g.tuned("gemm v1 b", &tiles, name, |t| Ok(*t as f64))
            .unwrap(),
        16
    );
    assert_eq!(g.autotune_runs(), 2);
    let first = &g.autotune_reports()[0];
    assert_eq!(first.key, "gemm v1 a");
    assert_eq!(first.chosen.as_deref(), Some("tile32"));
    assert_eq!(first.measured[0], ("tile16".to_string(), Ok(3.0)));
    assert!(matches!(&first.measured[2].1, Err(e) if e.contains("too big")));
    // Every candidate failing is an error, remembered nowhere.
    let fail = |_: &u32| -> Result<f64, ExecError> { Err(ExecError::Device("no".into())) };
    assert!(g.tuned("gemm v1 c", &tiles, name, fail).is_err());
    g.save_tune_cache().unwrap();
    drop(g);

    let g = open();
    assert_eq!(
        *g.tune_file_status(),
        TuneFileStatus::Loaded {
            choices: 2,
            ignored: 0
        }
    );
    assert_eq!(g.tuned("gemm v1 a", &tiles, name, never).unwrap(), 32);
    assert_eq!(g.autotune_runs(), 0);
    // A kernel that no longer has the remembered variant measures again.
    assert_eq!(
        g.tuned(
            "gemm v1 b",
            &[8, 128],
            |t| format!("tile{t}"),
            |t| Ok(*t as f64)
        )
        .unwrap(),
        8
    );
    assert_eq!(g.autotune_runs(), 1);
    drop(g);

    // A damaged line (one value changed): that key alone is measured again.
    let text = std::fs::read_to_string(&path)
        .unwrap()
        .replacen("tile32", "tile64", 1);
    std::fs::write(&path, text).unwrap();
    let g = open();
    assert!(matches!(
        g.tune_file_status(),
        TuneFileStatus::Loaded { ignored: 1, .. }
    ));
    assert_eq!(g.tuned("gemm v1 a", &tiles, name, timing).unwrap(), 32);
    assert_eq!(g.autotune_runs(), 1);
    drop(g);

    // Written for another device: ignored whole.
    let text = std::fs::read_to_string(&path).unwrap();
    let mut lines: Vec<&str> = text.lines().collect();
    lines[1] = "another adapter | driver";
    std::fs::write(&path, lines.join("\n")).unwrap();
    let g = open();
    assert!(
        matches!(g.tune_file_status(), TuneFileStatus::Ignored(why) if why.contains("another adapter")),
        "{:?}",
        g.tune_file_status()
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
