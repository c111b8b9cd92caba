//! The executor refuses what would silently give a wrong result: buffers and kernels of another
//! `Gpu`, host writes and reads overtaking an unsubmitted recorder, grids past u32 indices,
//! aliased writable bindings, kernels keyed like another's, a cache file save that would touch
//! a stranger's file, and options no device can honour.

mod common;

use common::{Rng, gpu, gpu_with_cache_file};
use hesper::dsl::prelude::*;
use hesper::exec::{Args, DriverCacheStatus, ExecError, Gpu, GpuOptions, Grid};

/// `y[i] = x[i] * 2 + 1` over u32 (exact).
fn double_plus_one(k: &mut KernelBuilder) {
    let x = k.storage::<u32>("x");
    let y = k.storage_rw::<u32>("y");
    let n = k.param::<u32>("n");
    let i = k.global_index();
    k.if_(i.lt(&n), |k| k.store(&y, &i, x.at(&i) * 2u32 + 1u32));
}

fn key() -> KernelKey {
    KernelKey::new("double_plus_one").workgroup_size(64)
}

/// Two `Gpu`s open at once: each has its own device, and nothing of one is used by the other.
#[test]
fn buffers_and_kernels_of_another_gpu_are_refused() {
    let (g1, g2) = (Gpu::new().unwrap(), Gpu::new().unwrap());
    assert_ne!(g1.id(), g2.id());
    let mine = g2.upload(&[7u32, 8]).unwrap();
    let theirs = g1.upload(&[1u32, 2]).unwrap();

    let err = theirs.read(&g2).unwrap_err();
    assert!(matches!(err, ExecError::WrongGpu { .. }), "{err}");
    assert!(
        err.to_string().contains(&format!(
            "belongs to Gpu #{}, and was used with Gpu #{}",
            g1.id(),
            g2.id()
        )),
        "{err}"
    );
    assert!(theirs.write(&g2, &[5, 6]).is_err());
    assert!(g2.fill(&theirs, 0).is_err());
    assert!(g2.copy(&mine, &theirs).is_err());

    // A launch on g2 with g1's buffer, and g1's compiled kernel on g2's recorder.
    let out = g2.filled(2, 0xDEAD_BEEFu32).unwrap();
    let k2 = g2.kernel(&key(), double_plus_one).unwrap();
    let mut rec = g2.recorder();
    let args = Args::new()
        .buffer("x", &theirs)
        .buffer("y", &out)
        .param("n", 2u32);
    let err = rec.launch(&k2, &args, Grid::Threads(2)).unwrap_err();
    assert!(err.to_string().contains("binding `x`"), "{err}");
    let k1 = g1.kernel(&key(), double_plus_one).unwrap();
    let args = Args::new()
        .buffer("x", &mine)
        .buffer("y", &out)
        .param("n", 2u32);
    let err = rec.launch(&k1, &args, Grid::Threads(2)).unwrap_err();
    assert!(matches!(err, ExecError::WrongGpu { .. }), "{err}");
    assert!(rec.is_empty());
    rec.submit().unwrap();
    // Nothing wrote anywhere: each device's buffers hold what they were given.
    assert_eq!(out.read(&g2).unwrap(), [0xDEAD_BEEF; 2]);
    assert_eq!(mine.read(&g2).unwrap(), [7, 8]);
    assert_eq!(theirs.read(&g1).unwrap(), [1, 2]);
}

/// A host write or read issued while a recorder that uses the buffer is not submitted would
/// take effect before the recorded launches (queue writes precede the next submit): refused.
#[test]
fn host_writes_and_reads_do_not_overtake_an_unsubmitted_recorder() {
    let g = gpu();
    let n = 100usize;
    let mut rng = Rng::new(5);
    let grad: Vec<u32> = (0..n).map(|_| rng.next_u32() >> 2).collect();
    let x = g.upload(&grad).unwrap();
    let y = g.filled(n, 0u32).unwrap();
    let kernel = g.kernel(&key(), double_plus_one).unwrap();
    let mut rec = g.recorder();
    let args = Args::new()
        .buffer("x", &x)
        .buffer("y", &y)
        .param("n", n as u32);
    rec.launch(&kernel, &args, Grid::Threads(n as u64)).unwrap();

    // "Zero the gradient after the step": refused while the step is only recorded.
    for err in [
        g.fill(&x, 0).unwrap_err(),
        x.write(g, &vec![0; n]).unwrap_err(),
        x.read(g).map(|_| ()).unwrap_err(),
        y.read(g).map(|_| ()).unwrap_err(),
        g.copy(&y, &x).unwrap_err(),
    ] {
        assert!(matches!(err, ExecError::InUse { .. }), "{err}");
        assert!(
            err.to_string().contains("Submit (or drop) the recorder"),
            "{err}"
        );
    }
    // Recording the fill into the same recorder orders it after the launch.
    rec.fill(&x, 0).unwrap();
    rec.submit().unwrap();
    let want: Vec<u32> = grad.iter().map(|v| v * 2 + 1).collect();
    assert_eq!(
        y.read(g).unwrap(),
        want,
        "the launch read the gradient before the fill"
    );
    assert_eq!(x.read(g).unwrap(), vec![0; n]);

    // A recorder dropped without submitting frees its buffers too.
    let mut rec = g.recorder();
    rec.launch(&kernel, &args, Grid::Threads(n as u64)).unwrap();
    assert!(x.write(g, &grad).is_err());
    drop(rec);
    x.write(g, &grad).unwrap();
    assert_eq!(x.read(g).unwrap(), grad);
}

/// Flat indices are u32: a grid of more than 2^32 invocations would wrap them and process
/// elements twice, so it is refused, with what to do instead.
#[test]
fn a_grid_beyond_u32_indices_is_refused() {
    let g = gpu();
    let kernel = g.kernel(&key(), double_plus_one).unwrap();
    let k = kernel.kernel();
    for grid in [
        Grid::Threads((1u64 << 32) + 64),
        Grid::Threads(u64::MAX),
        Grid::Workgroups([65535, 65535, 2]),
    ] {
        let err = g.workgroups(k, grid).unwrap_err();
        assert!(err.to_string().contains("2^32"), "{grid:?}: {err}");
    }
    // Large grids that fit are laid out 2-D, every invocation's index in range.
    for n in [1u64 << 31, 3_000_000_000, 65535 * 64 + 1] {
        let [x, y, z] = g.workgroups(k, Grid::Threads(n)).unwrap();
        let total = x as u64 * y as u64 * z as u64 * 64;
        assert!(total >= n && total <= 1 << 32, "{n}: {x}×{y}×{z}");
    }
    let err = g
        .workgroups(k, Grid::Workgroups([70_000, 1, 1]))
        .unwrap_err();
    assert!(err.to_string().contains("Grid::WorkgroupPerItem"), "{err}");
}

/// One buffer bound to two bindings that write it is a race inside the dispatch: refused, like
/// one bound read-only beside read-write.
#[test]
fn one_buffer_bound_to_two_writable_bindings_is_refused() {
    let g = gpu();
    let key = KernelKey::new("two_outputs").workgroup_size(64);
    let kernel = g
        .kernel(&key, |k| {
            let a = k.storage_rw::<f32>("a");
            let b = k.storage_rw::<f32>("b");
            let i = k.global_index();
            k.if_(i.lt(4u32), |k| {
                k.store(&a, &i, 1.0f32);
                k.store(&b, &i, 2.0f32);
            });
        })
        .unwrap();
    let buf = g.filled(4, 0.0f32).unwrap();
    let mut rec = g.recorder();
    let err = rec
        .launch(
            &kernel,
            &Args::new().buffer("a", &buf).buffer("b", &buf),
            Grid::Threads(4),
        )
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "kernel `two_outputs`, binding `a`: expected a buffer of its own (it is written, and `b` \
         is written), given the buffer also bound to `b`"
    );
    assert!(rec.is_empty());
}

/// A user kernel under the very key of the executor's copy, and two bodies under one key: each
/// runs its own code, with cache-hit verification off (the release default).
#[test]
fn kernels_keyed_alike_do_not_share_a_pipeline() {
    let g = Gpu::with_options(GpuOptions {
        verify_cache_hits: false,
        ..GpuOptions::default()
    })
    .unwrap();
    // The executor's copy key on this device (a 256-wide `hesper_copy` over vec4<u32> words).
    let copy_key = KernelKey::new("hesper_copy")
        .workgroup_size(256)
        .features(g.kernel_features() & Features::IMMEDIATES);
    let user_copy = g
        .kernel(&copy_key, |k| {
            let src = k.storage::<Vec4<u32>>("src");
            let dst = k.storage_rw::<Vec4<u32>>("dst");
            let n = k.param::<u32>("n");
            let i = k.global_index();
            let one = vec4(lit(1u32), lit(1u32), lit(1u32), lit(1u32));
            k.if_(i.lt(&n), |k| k.store(&dst, &i, src.at(&i) + one));
        })
        .unwrap();
    let src = g.upload(&[10u32, 20, 30, 40]).unwrap();
    let dst = g.filled(4, 0u32).unwrap();
    g.copy(&src, &dst).unwrap();
    assert_eq!(
        dst.read(&g).unwrap(),
        [10, 20, 30, 40],
        "Gpu::copy ran the user's kernel"
    );
    let mut rec = g.recorder();
    let words = g.upload(&[[1u32, 2, 3, 4]]).unwrap();
    let out = g.filled(1, [0u32; 4]).unwrap();
    let args = Args::new()
        .buffer("src", &words)
        .buffer("dst", &out)
        .param("n", 1u32);
    rec.launch(&user_copy, &args, Grid::Threads(1)).unwrap();
    rec.submit().unwrap();
    assert_eq!(out.read(&g).unwrap(), [[2, 3, 4, 5]]);

    // Two bodies, one key, two call sites.
    let key = KernelKey::new("scaled").workgroup_size(64);
    let times = |factor: u32| {
        move |k: &mut KernelBuilder| {
            let x = k.storage_rw::<u32>("x");
            let i = k.global_index();
            k.if_(i.lt(1u32), |k| k.store(&x, &i, x.at(&i) * factor));
        }
    };
    let double = g.kernel(&key, times(2)).unwrap();
    let triple = g
        .kernel(&key, |k: &mut KernelBuilder| {
            let x = k.storage_rw::<u32>("x");
            let i = k.global_index();
            k.if_(i.lt(1u32), |k| k.store(&x, &i, x.at(&i) * 3u32));
        })
        .unwrap();
    let x = g.upload(&[5u32]).unwrap();
    let mut rec = g.recorder();
    rec.launch(&double, &Args::new().buffer("x", &x), Grid::Threads(1))
        .unwrap();
    rec.launch(&triple, &Args::new().buffer("x", &x), Grid::Threads(1))
        .unwrap();
    rec.submit().unwrap();
    assert_eq!(x.read(&g).unwrap(), [30]);
}

/// Saving the driver cache writes through a temporary file of its own: a user's file that
/// happens to be named like the old temporary (`weights.tmp` beside `weights.cache`) survives,
/// and unreadable files say what is wrong with them.
#[test]
fn the_pipeline_cache_file_is_saved_without_touching_other_files() {
    let dir = std::env::temp_dir().join(format!("hesper-cache-misuse-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("weights.cache");
    let theirs = dir.join("weights.tmp");
    std::fs::write(&theirs, b"someone else's bytes").unwrap();
    let open = || gpu_with_cache_file(&path);
    let g = open();
    if *g.driver_cache_status() == DriverCacheStatus::Off {
        eprintln!("skipped: {} has no PIPELINE_CACHE", g.describe());
        return;
    }
    g.kernel(&key(), double_plus_one).unwrap();
    g.save_pipeline_cache().unwrap();
    drop(g);
    assert_eq!(std::fs::read(&theirs).unwrap(), b"someone else's bytes");
    let mut left: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    assert_eq!(
        left,
        ["weights.cache", "weights.tmp"],
        "no temporary left behind"
    );

    let full = std::fs::read(&path).unwrap();
    let header_len = full.windows(5).position(|w| w == b"wgpu ").unwrap();
    for (bytes, why) in [
        (&full[..0], "empty"),
        (&full[..10], "truncated"),
        (&full[..header_len], "truncated"),
        (
            &b"PK\x03\x04 a zip file"[..],
            "not a hesper pipeline cache file",
        ),
    ] {
        std::fs::write(&path, bytes).unwrap();
        let g = open();
        match g.driver_cache_status() {
            DriverCacheStatus::Ignored(message) => assert!(message.contains(why), "{message}"),
            other => panic!("{} bytes: {other:?}", bytes.len()),
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// More runtime scalars than one uniform binding holds is an error at compile, not a panic
/// at the first launch.
#[test]
fn a_kernel_with_too_many_runtime_scalars_is_an_error() {
    let g = gpu();
    let most = 64 * 1024 / 4;
    let key = KernelKey::new("many_scalars").workgroup_size(64);
    let err = g
        .kernel(&key, |k| {
            let out = k.storage_rw::<u32>("out");
            let sum = k.var("sum", 0u32);
            for p in 0..=most {
                let p = k.param::<u32>(&format!("p{p}"));
                k.assign(&sum, sum.get() + p);
            }
            k.store(&out, 0u32, sum.get());
        })
        .unwrap_err();
    assert!(matches!(err, ExecError::Pipeline { .. }), "{err}");
    assert!(err.to_string().contains("16385 runtime scalars"), "{err}");
}

/// Options no device can honour are refused when the `Gpu` opens; a device asked for small
/// workgroups still fills and copies (the executor's kernels size themselves to it).
#[test]
fn options_are_checked_and_small_devices_still_work() {
    let err = Gpu::with_options(GpuOptions {
        max_invocations_per_workgroup: Some(0),
        ..GpuOptions::default()
    })
    .err()
    .expect("0 invocations refused");
    assert_eq!(
        err.to_string(),
        "GpuOptions::max_invocations_per_workgroup: expected None or at least 1 invocation, \
         given Some(0)"
    );
    assert!(
        Gpu::with_options(GpuOptions {
            wait_timeout: std::time::Duration::ZERO,
            ..GpuOptions::default()
        })
        .is_err()
    );
    let small = Gpu::with_options(GpuOptions {
        max_invocations_per_workgroup: Some(32),
        ..GpuOptions::default()
    })
    .unwrap();
    let a = small.filled(1000, 3.5f32).unwrap();
    let b = small.filled(1000, 0.0f32).unwrap();
    small.copy(&a, &b).unwrap();
    assert_eq!(b.read(&small).unwrap(), vec![3.5; 1000]);
}

/// Messages speak the user's terms: a runtime scalar of the wrong type shows its value and type,
/// a device opened without subgroups says so rather than blaming the adapter.
#[test]
fn messages_name_values_and_why_a_feature_is_missing() {
    let g = gpu();
    let kernel = g.kernel(&key(), double_plus_one).unwrap();
    let (x, y) = (g.filled(4, 1u32).unwrap(), g.filled(4, 0u32).unwrap());
    let args = Args::new()
        .buffer("x", &x)
        .buffer("y", &y)
        .param("n", 1000i32);
    let err = g
        .recorder()
        .launch(&kernel, &args, Grid::Threads(4))
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "kernel `double_plus_one`, runtime scalar `n`: expected u32, given 1000 (i32)"
    );
    assert_eq!(
        format!("{:?}", Features::SUBGROUPS | Features::IMMEDIATES),
        "Features(subgroups+immediates)"
    );

    let plain = hesper::kernels::testing::gpu_without_subgroups();
    if !plain
        .adapter_features()
        .contains(hesper::exec::wgpu::Features::SUBGROUP)
    {
        eprintln!("skipped: {} has no subgroups", plain.describe());
        return;
    }
    let key = KernelKey::new("sum_lanes")
        .workgroup_size(64)
        .features(Features::SUBGROUPS);
    let err = plain
        .kernel(&key, |k| {
            let out = k.storage_rw::<f32>("out");
            let s = k.subgroup_add(1.0f32);
            k.store(&out, 0u32, s);
        })
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "kernel `sum_lanes` needs the device feature SUBGROUP, which this Gpu was opened without \
         (GpuOptions)"
    );
}

/// A kernel that indexes by workgroup (`workgroup_index()`, never `global_index`) launched with
/// a thread grid would run `items / invocations` workgroups: refused, naming the grid to use
/// and the line that asked for the workgroup index. With `WorkgroupPerItem` every row is done.
#[test]
fn a_per_workgroup_kernel_is_refused_a_thread_grid() {
    let g = gpu();
    let rows = 300usize;
    let key = KernelKey::new("row_first").workgroup_size(64);
    let row_line = line!() + 4;
    let kernel = Kernel::build(&key, |k| {
        let x = k.storage::<u32>("x");
        let y = k.storage_rw::<u32>("y");
        let row = k.workgroup_index();
        let row = k.let_("row", row);
        k.if_(k.local_index().eq(0u32), |k| {
            k.store(&y, &row, x.at(&row * 64u32) + 1u32)
        });
    })
    .unwrap();
    assert_eq!(
        kernel.indexes_by_workgroup().map(|at| at.location.line()),
        Some(row_line)
    );
    let x: Vec<u32> = (0..rows as u32 * 64).collect();
    let xb = g.upload(&x).unwrap();
    let y = g.filled(rows, u32::MAX).unwrap();
    let args = Args::new().buffer("x", &xb).buffer("y", &y);
    let err = g
        .run(&kernel, &args, Grid::Threads(rows as u64))
        .unwrap_err();
    let message = err.to_string();
    assert!(
        matches!(err, ExecError::Dispatch { .. })
            && message.contains("Grid::WorkgroupPerItem(items)")
            && message.contains(&format!("{}:{row_line}:", file!())),
        "{message}"
    );
    g.run(&kernel, &args, Grid::WorkgroupPerItem(rows as u64))
        .unwrap();
    let want: Vec<u32> = (0..rows as u32).map(|r| r * 64 + 1).collect();
    assert_eq!(y.read(g).unwrap(), want);

    // Indexing by invocation too (`global_index`): a thread grid may be meant; not refused.
    let mixed = Kernel::build(&KernelKey::new("mixed").workgroup_size(64), |k| {
        let y = k.storage_rw::<u32>("y");
        let i = k.global_index();
        let w = k.workgroup_index();
        k.if_(i.lt(rows as u32), |k| k.store(&y, &i, w));
    })
    .unwrap();
    assert_eq!(mixed.indexes_by_workgroup(), None);

    // A 2-D workgroup with a 1-D thread grid: refused, naming the 2-D grid to use.
    let tiled = Kernel::build(&KernelKey::new("tiled").workgroup_size_3d([8, 8, 1]), |k| {
        let y = k.storage_rw::<u32>("y");
        let id = k.global_id();
        k.if_(id.x().lt(rows as u32), |k| k.store(&y, id.x(), id.y()));
    })
    .unwrap();
    let args = Args::new().buffer("y", &y);
    let err = g
        .run(&tiled, &args, Grid::Threads(rows as u64))
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("workgroup is 8×8×1: launch a 2-D (3-D) kernel with Grid::Workgroups(["),
        "{err}"
    );
    let args = Args::new().buffer("y", &y);
    g.run(&mixed, &args, Grid::Threads(rows as u64)).unwrap();
    let want: Vec<u32> = (0..rows as u32).map(|i| i / 64).collect();
    assert_eq!(y.read(g).unwrap(), want);
}
