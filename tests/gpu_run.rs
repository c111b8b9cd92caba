//! Emitted kernels run through wgpu (lavapipe in CI) and compared with CPU computations.

mod common;

use common::{Rng, gpu, max_rel_err};
use hesper::dsl::prelude::*;
use hesper::exec::{Args, ExecError, Grid};

fn relu_sqr_mul_backward(features: Features) -> Kernel {
    let key = KernelKey::new("relu_sqr_mul_backward")
        .workgroup_size(256)
        .features(features);
    Kernel::build(&key, |k| {
        let gate = k.storage::<f32>("gate");
        let up = k.storage::<f32>("up");
        let d_h = k.storage::<f32>("d_h");
        let d_gate = k.storage_rw::<f32>("d_gate");
        let d_up = k.storage_rw::<f32>("d_up");
        let n = k.param::<u32>("n");
        let i = k.global_index();
        k.if_(i.lt(&n), |k| {
            let r = k.let_("r", gate.at(&i).max(0.0));
            let dh = k.let_("dh", d_h.at(&i));
            k.store(&d_gate, &i, &dh * up.at(&i) * 2.0 * &r);
            k.store(&d_up, &i, &dh * &r * &r);
        });
    })
    .expect("relu_sqr_mul_backward builds")
}

/// Elementwise kernel, through a uniform and through immediates, at sizes that are not
/// multiples of the workgroup; outputs poisoned with NaN so unwritten elements show.
#[test]
fn elementwise_backward_matches_reference() {
    let g = gpu();
    let mut modes = vec![Features::NONE];
    if g.kernel_features().contains(Features::IMMEDIATES) {
        modes.push(Features::IMMEDIATES);
    }
    for (seed, n) in [(1u64, 1usize), (2, 255), (3, 1000), (4, 4099)] {
        let mut rng = Rng::new(seed);
        let (gate, up, dh) = (rng.vec(n, 1.0), rng.vec(n, 1.0), rng.vec(n, 1.0));
        let r = |i: usize| (gate[i] as f64).max(0.0);
        let want_gate: Vec<f64> = (0..n)
            .map(|i| dh[i] as f64 * up[i] as f64 * 2.0 * r(i))
            .collect();
        let want_up: Vec<f64> = (0..n).map(|i| dh[i] as f64 * r(i) * r(i)).collect();
        for &mode in &modes {
            let kernel = relu_sqr_mul_backward(mode);
            let bufs = [
                g.upload(&gate).unwrap(),
                g.upload(&up).unwrap(),
                g.upload(&dh).unwrap(),
            ];
            let d_gate = g.filled(n, f32::NAN).unwrap();
            let d_up = g.filled(n, f32::NAN).unwrap();
            let args = Args::new()
                .buffer("gate", &bufs[0])
                .buffer("up", &bufs[1])
                .buffer("d_h", &bufs[2])
                .buffer("d_gate", &d_gate)
                .buffer("d_up", &d_up)
                .param("n", n as u32);
            g.run(&kernel, &args, Grid::Threads(n as u64)).unwrap();
            let e1 = max_rel_err(&d_gate.read(g).unwrap(), &want_gate, 1.0);
            let e2 = max_rel_err(&d_up.read(g).unwrap(), &want_up, 1.0);
            assert!(
                e1 < 1e-6 && e2 < 1e-6,
                "n={n} {mode:?}: errors {e1:e} {e2:e}"
            );
        }
    }
}

/// A row reduction (sum and max of each row) through the shared-memory tree and, where the
/// device has them, subgroups; workgroup sizes that are and are not powers of two.
#[test]
fn workgroup_reduce_matches_reference() {
    // Sum, max and min over rows, at power-of-two and other workgroup sizes.
    let g = gpu();
    let mut feature_sets = vec![Features::NONE];
    if g.kernel_features().contains(Features::SUBGROUPS) {
        feature_sets.push(Features::SUBGROUPS);
    }
    let (rows, cols) = (7usize, 1000usize);
    let mut rng = Rng::new(11);
    let x = rng.vec(rows * cols, 1.0);
    let want_sum: Vec<f64> = x
        .chunks(cols)
        .map(|r| r.iter().map(|v| *v as f64).sum())
        .collect();
    let want_max: Vec<f64> = x
        .chunks(cols)
        .map(|r| r.iter().fold(f64::MIN, |m, v| m.max(*v as f64)))
        .collect();
    let want_min: Vec<f64> = x
        .chunks(cols)
        .map(|r| r.iter().fold(f64::MAX, |m, v| m.min(*v as f64)))
        .collect();
    for features in feature_sets {
        for wg in [64u32, 96, 256] {
            let key = KernelKey::new("row_sum_max")
                .workgroup_size(wg)
                .shape("cols", cols as u32)
                .features(features);
            let kernel = Kernel::build(&key, |k| {
                let x = k.storage::<f32>("x");
                let sums = k.storage_rw::<f32>("sums");
                let maxes = k.storage_rw::<f32>("maxes");
                let mins = k.storage_rw::<f32>("mins");
                let cols = k.shape_const::<u32>("cols");
                let row = k.let_("row", k.workgroup_id().x());
                let base = k.let_("base", &row * &cols);
                let acc = k.var("acc", 0.0f32);
                let best = k.var("best", f32::MIN);
                let least = k.var("least", f32::MAX);
                k.row_loop(&cols, |k, c| {
                    let v = k.let_("v", x.at(&base + c));
                    k.add_assign(&acc, &v);
                    k.assign(&best, best.get().max(&v));
                    k.assign(&least, least.get().min(&v));
                });
                let s = k.workgroup_reduce(acc.get(), Reduce::Sum);
                let m = k.workgroup_reduce(best.get(), Reduce::Max);
                let lo = k.workgroup_reduce(least.get(), Reduce::Min);
                k.if_(k.local_index().eq(0u32), |k| {
                    k.store(&sums, &row, s);
                    k.store(&maxes, &row, m);
                    k.store(&mins, &row, lo);
                });
            })
            .unwrap();
            let xb = g.upload(&x).unwrap();
            let sums = g.filled(rows, f32::NAN).unwrap();
            let maxes = g.filled(rows, f32::NAN).unwrap();
            let mins = g.filled(rows, f32::NAN).unwrap();
            let args = Args::new()
                .buffer("x", &xb)
                .buffer("sums", &sums)
                .buffer("maxes", &maxes)
                .buffer("mins", &mins);
            g.run(&kernel, &args, Grid::Workgroups([rows as u32, 1, 1]))
                .unwrap();
            let es = max_rel_err(&sums.read(g).unwrap(), &want_sum, 1.0);
            let em = max_rel_err(&maxes.read(g).unwrap(), &want_max, 1.0);
            let en = max_rel_err(&mins.read(g).unwrap(), &want_min, 1.0);
            assert!(
                es < 1e-5 && em == 0.0 && en == 0.0,
                "wg={wg} {features:?}: sum err {es:e}, max err {em:e}, min err {en:e}"
            );
        }
    }
}

/// More than 65535 workgroups: the launch goes 2-D and `global_index` flattens it back; every
/// element is written exactly with its own index.
#[test]
fn global_index_is_right_past_65535_workgroups() {
    let g = gpu();
    let wg = 64u32;
    let n = 65_536 * wg as usize + 37; // 65538 workgroups
    let key = KernelKey::new("write_index").workgroup_size(wg);
    let kernel = Kernel::build(&key, |k| {
        let out = k.storage_rw::<u32>("out");
        let i = k.global_index();
        k.if_(i.lt(out.len()), |k| k.store(&out, &i, &i ^ 0x5A5A_5A5Au32));
    })
    .unwrap();
    assert_eq!(
        g.workgroups(&kernel, Grid::Threads(n as u64)).unwrap(),
        [32769, 2, 1]
    );
    let out = g.filled(n, u32::MAX).unwrap();
    g.run(
        &kernel,
        &Args::new().buffer("out", &out),
        Grid::Threads(n as u64),
    )
    .unwrap();
    let got = out.read(g).unwrap();
    let wrong = got
        .iter()
        .enumerate()
        .filter(|(i, v)| **v != *i as u32 ^ 0x5A5A_5A5A)
        .count();
    assert_eq!(wrong, 0, "{wrong} of {n} elements wrong");
}

/// bf16 packing on the GPU rounds exactly like the host reference (ties to even, NaN kept).
#[test]
fn bf16_pack_matches_host_rounding() {
    let g = gpu();
    let mut rng = Rng::new(5);
    let mut x: Vec<f32> = (0..4096).map(|_| rng.next_f32() * 1e3).collect();
    // exact ties, both parities, and specials
    x.extend([
        1.0 + 2f32.powi(-8),
        1.0 + 3.0 * 2f32.powi(-8),
        -2.5,
        0.0,
        -0.0,
        f32::NAN,
        f32::INFINITY,
        3.4e38,
    ]);
    if x.len() % 2 == 1 {
        x.push(1.0);
    }
    let key = KernelKey::new("bf16_roundtrip").workgroup_size(64);
    let kernel = Kernel::build(&key, |k| {
        let x = k.storage::<f32>("x");
        let packed = k.storage_rw::<u32>("packed");
        let back = k.storage_rw::<f32>("back");
        let i = k.global_index();
        k.if_(i.lt(packed.len()), |k| {
            let p = k.let_("p", bf16::pack(x.at(&i * 2u32), x.at(&i * 2u32 + 1u32)));
            k.store(&packed, &i, &p);
            k.store(&back, &i * 2u32, bf16::low(&p));
            k.store(&back, &i * 2u32 + 1u32, bf16::high(&p));
        });
    })
    .unwrap();
    let xb = g.upload(&x).unwrap();
    let packed = g.filled(x.len() / 2, 0xDEAD_BEEFu32).unwrap();
    let back = g.filled(x.len(), f32::NAN).unwrap();
    let args = Args::new()
        .buffer("x", &xb)
        .buffer("packed", &packed)
        .buffer("back", &back);
    g.run(&kernel, &args, Grid::Threads((x.len() / 2) as u64))
        .unwrap();
    let (packed, back) = (packed.read(g).unwrap(), back.read(g).unwrap());
    for (i, v) in x.iter().enumerate() {
        let want = bf16::round_host(*v);
        let got = (packed[i / 2] >> (16 * (i % 2))) as u16;
        if v.is_nan() {
            assert!(
                bf16::to_f32_host(got).is_nan() && back[i].is_nan(),
                "NaN at {i}"
            );
        } else {
            assert_eq!(got, want, "x[{i}] = {v:e}");
            assert_eq!(
                back[i].to_bits(),
                bf16::to_f32_host(want).to_bits(),
                "back[{i}]"
            );
        }
    }
}

/// An f16 kernel (where the device has SHADER_F16): computes in f16, compared with the host
/// within f16's precision.
#[test]
fn f16_kernel_runs() {
    let g = gpu();
    if !g.supports_f16() {
        eprintln!("skipped: {} has no SHADER_F16", g.describe());
        return;
    }
    let n = 777usize;
    let mut rng = Rng::new(9);
    let x = rng.vec(n, 1.0);
    let key = KernelKey::new("f16_square").workgroup_size(64);
    let kernel = Kernel::build(&key, |k| {
        let x = k.storage::<f32>("x");
        let out = k.storage_rw::<f32>("out");
        let i = k.global_index();
        k.if_(i.lt(out.len()), |k| {
            let h = k.let_("h", x.at(&i).cast::<F16>());
            k.store(&out, &i, (&h * &h + Expr::<F16>::lit(0.5)).cast::<f32>());
        });
    })
    .unwrap();
    assert!(
        kernel.uses_f16()
            && kernel
                .wgsl()
                .starts_with("// f16_square wg=64x1x1\nenable f16;")
    );
    let xb = g.upload(&x).unwrap();
    let out = g.filled(n, f32::NAN).unwrap();
    g.run(
        &kernel,
        &Args::new().buffer("x", &xb).buffer("out", &out),
        Grid::Threads(n as u64),
    )
    .unwrap();
    let want: Vec<f64> = x.iter().map(|v| (*v as f64).powi(2) + 0.5).collect();
    let e = max_rel_err(&out.read(g).unwrap(), &want, 1.0);
    assert!(e < 3e-3, "f16 error {e:e}");
}

/// Launch arguments are checked by name and type before anything is dispatched.
#[test]
fn binding_errors_name_kernel_and_binding() {
    let g = gpu();
    let kernel = relu_sqr_mul_backward(Features::NONE);
    let input = g.upload(&[1.0f32; 8]).unwrap();
    let (out1, out2) = (g.zeros::<f32>(8).unwrap(), g.zeros::<f32>(8).unwrap());
    let ints = g.upload(&[1u32; 8]).unwrap();
    let inputs = || {
        Args::new()
            .buffer("gate", &input)
            .buffer("up", &input)
            .buffer("d_h", &input)
    };
    let full = || inputs().buffer("d_gate", &out1);
    let run = |args: Args| {
        g.run(&kernel, &args, Grid::Threads(8))
            .unwrap_err()
            .to_string()
    };
    assert_eq!(
        run(full().param("n", 8u32)),
        "kernel `relu_sqr_mul_backward`, binding `d_up`: expected a buffer of f32, given none"
    );
    assert_eq!(
        run(full().buffer("d_up", &ints).param("n", 8u32)),
        "kernel `relu_sqr_mul_backward`, binding `d_up`: expected elements of f32, given elements of u32"
    );
    assert!(
        run(full()
            .buffer("d_up", &out2)
            .buffer("extra", &out2)
            .param("n", 8u32))
        .contains("binding `extra`")
    );
    assert_eq!(
        run(full().buffer("d_up", &out2)),
        "kernel `relu_sqr_mul_backward`, runtime scalar `n`: expected u32, given no value"
    );
    assert!(
        run(full().buffer("d_up", &out2).param("n", 8.0f32))
            .contains("runtime scalar `n`: expected u32")
    );
    assert_eq!(
        run(full().buffer("d_up", &input).param("n", 8u32)),
        "kernel `relu_sqr_mul_backward`, binding `d_up`: expected a buffer of its own (it is written, \
         and `gate` is read), given the buffer also bound to `gate`"
    );
    let err = g
        .run(
            &kernel,
            &full().buffer("d_up", &out2).param("n", 8u32),
            Grid::Workgroups([70_000, 1, 1]),
        )
        .unwrap_err();
    assert!(matches!(err, ExecError::Dispatch { .. }), "{err}");
}

/// Subgroup shuffle-xor, broadcast, add and max against what each lane must see (where the
/// device has subgroups; lavapipe's are 8 wide, the H200's 32).
#[test]
fn subgroup_operations() {
    let g = gpu();
    if !g.kernel_features().contains(Features::SUBGROUPS) {
        eprintln!("skipped: {} has no SUBGROUP", g.describe());
        return;
    }
    let wg = 128u32;
    let groups = 3u32;
    let key = KernelKey::new("subgroup_ops")
        .workgroup_size(wg)
        .features(Features::SUBGROUPS);
    let kernel = Kernel::build(&key, |k| {
        let x = k.storage::<f32>("x");
        let out = k.storage_rw::<Vec4<f32>>("out");
        let ids = k.storage_rw::<Vec2<u32>>("ids");
        let i = k.global_index();
        let v = k.let_("v", x.at(&i));
        let flipped = k.subgroup_shuffle_xor(&v, 1u32);
        let first = k.subgroup_broadcast(&v, 0);
        let sum = k.subgroup_add(&v);
        let best = k.subgroup_max(&v);
        k.store(&out, &i, vec4(flipped, first, sum, best));
        k.store(
            &ids,
            &i,
            vec2(
                k.subgroup_id() + k.workgroup_id().x() * 1000u32,
                k.subgroup_invocation_id(),
            ),
        );
    })
    .unwrap();
    let n = (wg * groups) as usize;
    let mut rng = Rng::new(21);
    let x = rng.vec(n, 1.0);
    let xb = g.upload(&x).unwrap();
    let out = g.filled(n, [f32::NAN; 4]).unwrap();
    let ids = g.filled(n, [u32::MAX; 2]).unwrap();
    let args = Args::new()
        .buffer("x", &xb)
        .buffer("out", &out)
        .buffer("ids", &ids);
    g.run(&kernel, &args, Grid::Threads(n as u64)).unwrap();
    let (out, ids) = (out.read(g).unwrap(), ids.read(g).unwrap());
    // Group invocations by subgroup, then check each lane against its subgroup's values.
    let mut subgroups: std::collections::BTreeMap<u32, Vec<(u32, usize)>> = Default::default();
    for (i, [sg, lane]) in ids.iter().enumerate() {
        subgroups.entry(*sg).or_default().push((*lane, i));
    }
    for (sg, lanes) in &subgroups {
        let value_of = |lane: u32| lanes.iter().find(|(l, _)| *l == lane).map(|(_, i)| x[*i]);
        let sum: f64 = lanes.iter().map(|(_, i)| x[*i] as f64).sum();
        let max = lanes.iter().map(|(_, i)| x[*i]).fold(f32::MIN, f32::max);
        for (lane, i) in lanes {
            let [flipped, first, s, m] = out[*i];
            assert_eq!(
                Some(flipped),
                value_of(lane ^ 1),
                "subgroup {sg} lane {lane}: shuffle_xor"
            );
            assert_eq!(
                Some(first),
                value_of(0),
                "subgroup {sg} lane {lane}: broadcast"
            );
            assert!(
                ((s as f64) - sum).abs() < 1e-5,
                "subgroup {sg} lane {lane}: add {s} vs {sum}"
            );
            assert_eq!(m, max, "subgroup {sg} lane {lane}: max");
        }
    }
    assert!(
        subgroups.len() >= groups as usize,
        "{} subgroups",
        subgroups.len()
    );
}

/// Each workgroup of 64 decides once whether its largest value passes `limit` (invocation 0
/// reads them all and writes the decision); with `workgroupUniformLoad` every invocation gets
/// that decision and branches on it around a barrier: if it passes, each output is its
/// neighbour's value (`lid ^ 1`) halved, through workgroup memory; else the value itself.
fn halve_swapped_if_over() -> Kernel {
    let key = KernelKey::new("halve_swapped_if_over").workgroup_size(64);
    Kernel::build(&key, |k| {
        let x = k.storage::<f32>("x");
        let y = k.storage_rw::<f32>("y");
        let limit = k.param::<f32>("limit");
        let values = k.workgroup_array::<f32>("values", 64);
        let decision = k.workgroup_array::<u32>("decision", 1);
        let lid = k.let_("lid", k.local_index());
        let global = k.global_index();
        let i = k.let_("i", global);
        let v = k.let_("v", x.at(&i));
        k.store(&values, &lid, &v);
        k.workgroup_barrier();
        k.if_(lid.eq(0u32), |k| {
            let top = k.var("top", f32::MIN);
            k.for_range("j", 0u32, 64u32, |k, j| {
                k.assign(&top, top.get().max(values.at(&j)));
            });
            k.store(
                &decision,
                0u32,
                select(top.get().gt(&limit), lit(1u32), lit(0u32)),
            );
        });
        let over = k.workgroup_uniform_load("over", &decision, 0u32);
        let out = k.var("out", v.clone());
        k.if_(over.eq(1u32), |k| {
            k.store(&values, &lid, &v * 0.5f32);
            k.workgroup_barrier();
            k.assign(&out, values.at(&lid ^ 1u32));
        });
        k.store(&y, &i, out.get());
    })
    .expect("halve_swapped_if_over builds")
}

/// `workgroupUniformLoad` on the GPU and on the DSL's interpreter: workgroups on both sides
/// of the limit, against the same computation in Rust.
#[test]
fn a_workgroup_uniform_decision_guards_a_barrier() {
    let g = gpu();
    let kernel = halve_swapped_if_over();
    assert!(
        kernel
            .wgsl()
            .contains("workgroupUniformLoad(&decision[0u])")
    );
    let groups = 6;
    let mut rng = Rng::new(21);
    let mut x = rng.vec(64 * groups, 1.0);
    // Workgroups 1 and 4 pass the limit through one element each.
    x[64 + 17] = 3.0;
    x[4 * 64 + 63] = 2.5;
    let limit = 2.0f32;
    let want: Vec<f64> = (0..x.len())
        .map(|i| {
            let block = &x[i / 64 * 64..][..64];
            match block.iter().any(|v| *v > limit) {
                true => x[i ^ 1] as f64 * 0.5,
                false => x[i] as f64,
            }
        })
        .collect();
    let xb = g.upload(&x).unwrap();
    let y = g.filled(x.len(), f32::NAN).unwrap();
    let args = Args::new()
        .buffer("x", &xb)
        .buffer("y", &y)
        .param("limit", limit);
    g.run(&kernel, &args, Grid::Workgroups([groups as u32, 1, 1]))
        .unwrap();
    assert_eq!(max_rel_err(&y.read(g).unwrap(), &want, 1.0), 0.0, "GPU");

    let mut run = hesper::dsl::interp::Run::new([groups as u32, 1, 1])
        .buffer("x", &x)
        .buffer("y", &vec![f32::NAN; x.len()])
        .param("limit", hesper::dsl::interp::ScalarValue::F32(limit));
    hesper::dsl::interp::interpret(&kernel, &mut run).unwrap();
    let got: Vec<f32> = run.read("y").unwrap();
    assert_eq!(max_rel_err(&got, &want, 1.0), 0.0, "interpreter");
}
