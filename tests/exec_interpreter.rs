//! The executor on the DSL's interpreter (`GpuOptions::interpreter`): the same API as on a GPU,
//! with no GPU or Vulkan driver, and the faults a GPU hides reported as errors at submit.

use hesper::dsl::prelude::*;
use hesper::exec::half::f16;
use hesper::exec::{Args, ExecError, Gpu, GpuOptions, Grid};
use hesper::kernels::testing::Rng;

fn interpreter() -> Gpu {
    Gpu::with_options(GpuOptions {
        interpreter: true,
        ..GpuOptions::default()
    })
    .unwrap()
}

/// `y[i] = a·x[i] + b` for `i < n`, the guard left out when `guarded` is false.
fn axpb(guarded: bool) -> impl FnOnce(&mut KernelBuilder) {
    move |k| {
        let (x, y) = (k.storage::<f32>("x"), k.storage_rw::<f32>("y"));
        let (a, b, n) = (
            k.param::<f32>("a"),
            k.param::<f32>("b"),
            k.param::<u32>("n"),
        );
        let i = k.global_index();
        let write = |k: &mut KernelBuilder| k.store(&y, &i, x.at(&i) * a + b);
        match guarded {
            true => k.if_(i.lt(&n), write),
            false => write(k),
        }
    }
}

/// Launches, fills and copies recorded in one recorder run in their order (each launch sees
/// the one before), and the buffers hold exactly what the kernels compute: f32 arithmetic is
/// the host's, an odd-length f16 buffer is written back whole.
#[test]
fn a_recorder_runs_its_launches_in_order_on_the_interpreter() {
    let g = interpreter();
    assert!(g.interprets(), "{}", g.describe());
    assert!(g.describe().contains("interpreter"), "{}", g.describe());
    let n = 100;
    let x = Rng::new(7).vec(n, 1.0);
    let axpb = g
        .kernel(&KernelKey::new("axpb").workgroup_size(64), axpb(true))
        .unwrap();
    let square = g
        .kernel(&KernelKey::new("square").workgroup_size(32), |k| {
            let (y, z) = (k.storage::<f32>("y"), k.storage_rw::<f32>("z"));
            let n = k.param::<u32>("n");
            let i = k.global_index();
            k.if_(i.lt(&n), |k| k.store(&z, &i, y.at(&i) * y.at(&i)));
        })
        .unwrap();
    let xb = g.upload(&x).unwrap();
    let (y, z, w) = (
        g.filled(n, f32::NAN).unwrap(),
        g.filled(n, f32::NAN).unwrap(),
        g.filled(n, -1.0f32).unwrap(),
    );
    let mut rec = g.recorder();
    let (a, b) = (1.5f32, -0.25f32);
    let args = Args::new()
        .buffer("x", &xb)
        .buffer("y", &y)
        .param("a", a)
        .param("b", b)
        .param("n", n as u32);
    rec.launch(&axpb, &args, Grid::Threads(n as u64)).unwrap();
    let args = Args::new()
        .buffer("y", &y)
        .buffer("z", &z)
        .param("n", n as u32);
    rec.launch(&square, &args, Grid::Threads(n as u64)).unwrap();
    rec.copy_range(&z, 10, &w, 20, 30).unwrap();
    rec.fill(&y, 3.0).unwrap();
    rec.submit().unwrap();

    let want_z: Vec<f32> = x.iter().map(|v| (v * a + b) * (v * a + b)).collect();
    assert_eq!(z.read(&g).unwrap(), want_z);
    assert_eq!(y.read(&g).unwrap(), vec![3.0; n]);
    let w = w.read(&g).unwrap();
    assert_eq!(&w[20..50], &want_z[10..40]);
    assert!(w[..20].iter().chain(&w[50..]).all(|v| *v == -1.0));

    // Five f16: ten bytes, read and written back as whole words.
    let halve = g
        .kernel(&KernelKey::new("halve").workgroup_size(8), |k| {
            let h = k.storage_rw::<F16>("h");
            let n = k.param::<u32>("n");
            let i = k.global_index();
            k.if_(i.lt(&n), |k| {
                k.store(&h, &i, h.at(&i) * Expr::<F16>::lit(0.5))
            });
        })
        .unwrap();
    let values: Vec<f16> = [1.0f32, -3.0, 0.125, 7.5, 1000.0]
        .iter()
        .map(|v| f16::from_f32(*v))
        .collect();
    let h = g.upload(&values).unwrap();
    let args = Args::new().buffer("h", &h).param("n", 5u32);
    g.run(halve.kernel(), &args, Grid::Threads(5)).unwrap();
    let want: Vec<f16> = values.iter().map(|v| *v * f16::from_f32(0.5)).collect();
    assert_eq!(h.read(&g).unwrap(), want);
}

/// What a GPU drops or clamps silently is an error naming the kernel, the buffer, the index
/// and the invocation: an unguarded write past a buffer's length (Hesper's bug), and two
/// invocations writing one element.
#[test]
fn faults_a_gpu_hides_are_errors_at_submit() {
    let g = interpreter();
    let n = 50;
    let x = g.upload(&Rng::new(3).vec(64, 1.0)).unwrap();
    let y = g.filled(n, 0.0f32).unwrap();
    let unguarded = g
        .kernel(
            &KernelKey::new("axpb_unguarded").workgroup_size(64),
            axpb(false),
        )
        .unwrap();
    let args = Args::new()
        .buffer("x", &x)
        .buffer("y", &y)
        .param("a", 2.0f32)
        .param("b", 1.0f32)
        .param("n", n as u32);
    let err = g
        .run(unguarded.kernel(), &args, Grid::Threads(64))
        .unwrap_err();
    let ExecError::Interpreter(e) = &err else {
        panic!("expected an interpreter fault, got {err}");
    };
    assert_eq!(e.kernel, "axpb_unguarded");
    assert!(e.what.contains("`y[50]`, past its 50 elements"), "{err}");
    assert_eq!(e.invocation, Some([50, 0, 0]), "{err}");
    assert!(err.to_string().contains("on the interpreter"), "{err}");

    let race = g
        .kernel(
            &KernelKey::new("everyone_writes_one").workgroup_size(32),
            |k| {
                let out = k.storage_rw::<u32>("out");
                let i = k.global_index();
                k.store(&out, 0u32, i.clone());
            },
        )
        .unwrap();
    let out = g.filled(4, 0u32).unwrap();
    let err = g
        .run(
            race.kernel(),
            &Args::new().buffer("out", &out),
            Grid::Threads(32),
        )
        .unwrap_err();
    assert!(
        err.to_string().contains("race on `out[0]`"),
        "expected a race on out[0], got {err}"
    );
}

/// A fault stops the whole submit: the launches before it, which ran, leave their buffers as
/// they were too (nothing is submitted, as on a GPU).
#[test]
fn a_fault_leaves_every_buffer_as_it_was() {
    let g = interpreter();
    let x = g.upload(&Rng::new(5).vec(64, 1.0)).unwrap();
    let (y, z) = (g.filled(64, 7.0f32).unwrap(), g.filled(50, 7.0f32).unwrap());
    let guarded = g
        .kernel(&KernelKey::new("axpb").workgroup_size(64), axpb(true))
        .unwrap();
    let unguarded = g
        .kernel(
            &KernelKey::new("axpb_unguarded").workgroup_size(64),
            axpb(false),
        )
        .unwrap();
    let args = |out| {
        Args::new()
            .buffer("x", &x)
            .buffer("y", out)
            .param("a", 2.0f32)
            .param("b", 1.0f32)
            .param("n", 50u32)
    };
    let mut rec = g.recorder();
    rec.launch(&guarded, &args(&y), Grid::Threads(64)).unwrap();
    rec.fill(&z, 1.0).unwrap();
    rec.launch(&unguarded, &args(&z), Grid::Threads(64))
        .unwrap();
    let err = rec.submit().unwrap_err();
    assert!(err.to_string().contains("`y[50]`"), "{err}");
    assert_eq!(y.read(&g).unwrap(), vec![7.0; 64]);
    assert_eq!(z.read(&g).unwrap(), vec![7.0; 50]);
}

/// The launch checks are the executor's, as on a GPU (before anything runs), and what the
/// interpreter cannot do is refused by name: timing.
#[test]
fn the_executors_checks_stay_and_timing_is_refused() {
    let g = interpreter();
    let kernel = g
        .kernel(&KernelKey::new("axpb").workgroup_size(64), axpb(true))
        .unwrap();
    let (x, y) = (g.filled(10, 1.0f32).unwrap(), g.filled(9, 0.0f32).unwrap());
    let args = Args::new()
        .buffer("x", &x)
        .buffer_at_least("y", &y, 10)
        .param("a", 2.0f32)
        .param("b", 1.0f32)
        .param("n", 10u32);
    let err = g
        .run(kernel.kernel(), &args, Grid::Threads(10))
        .unwrap_err();
    assert!(
        matches!(&err, ExecError::Binding { binding, .. } if binding == "y"),
        "{err}"
    );
    assert_eq!(y.read(&g).unwrap(), vec![0.0; 9], "nothing ran");
    let err = g.timed_recorder(4).err().expect("no timestamps here");
    assert!(err.to_string().contains("TIMESTAMP_QUERY"), "{err}");
}
