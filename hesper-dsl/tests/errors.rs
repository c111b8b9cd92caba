//! Builder misuse is an error that names the kernel and the item, caught before naga sees any
//! WGSL (a naga rejection would be `ErrorKind::Naga`, which none of these may be).

use hesper_dsl::prelude::*;
use hesper_dsl::{
    AnyExpr, ErrorKind, Literal, LocalArray, MAX_EXPRESSION_DEPTH, MAX_NESTING, RwBuffer, Scalar,
};

fn build_err(key: &KernelKey, f: impl FnOnce(&mut KernelBuilder)) -> hesper_dsl::DslError {
    let err = Kernel::build(key, f).expect_err("the kernel must not build");
    assert!(
        !matches!(err.kind, ErrorKind::Naga { .. }),
        "reached naga: {err}"
    );
    assert_eq!(err.kernel, key.name());
    err
}

/// The message without its place (`at tests/errors.rs:12:5`), which must be in this file:
/// the statement at fault, or the builder call that recorded the misuse.
fn without_place(err: &hesper_dsl::DslError) -> String {
    let at = err.at.expect("a misuse in the body has a place");
    assert_eq!(at.location.file(), file!(), "{err}");
    err.to_string().replacen(&format!(" at {at}"), "", 1)
}

fn key() -> KernelKey {
    KernelKey::new("misuse").workgroup_size(64)
}

#[test]
fn store_into_read_only_buffer_through_untyped_path() {
    let err = build_err(&key(), |k| {
        k.storage::<f32>("x");
        let i = AnyExpr::literal(Literal::U32(0));
        let v = AnyExpr::literal(Literal::F32(1.0));
        k.store_any("x", &i, &v);
    });
    assert_eq!(
        without_place(&err),
        "kernel `misuse`: store into `x`, which is declared read-only"
    );
}

#[test]
fn type_mismatch_through_untyped_path() {
    let err = build_err(&key(), |k| {
        k.storage_rw::<f32>("y");
        let i = AnyExpr::literal(Literal::U32(0));
        let v = AnyExpr::literal(Literal::U32(1));
        k.store_any("y", &i, &v);
    });
    assert_eq!(
        without_place(&err),
        "kernel `misuse`: assignment: expected f32, found u32"
    );
    let err = build_err(&key(), |k| {
        let c = k.param_any("n", Scalar::U32);
        k.if_any(&c, |_| {}, |_| {});
    });
    assert_eq!(
        without_place(&err),
        "kernel `misuse`: if condition: expected bool, found u32"
    );
}

#[test]
fn typed_misuse_inside_expressions_is_reported() {
    let err = build_err(&key(), |k| {
        let out = k.storage_rw::<f32>("out");
        let v = vec2(1.0f32, 2.0f32);
        k.store(&out, 0u32, v.z());
    });
    assert!(
        err.to_string()
            .contains("swizzle `.z` does not fit vec2<f32>"),
        "{err}"
    );
    let err = build_err(&key(), |k| {
        let out = k.storage_rw::<f32>("out");
        k.store(&out, 0u32, lit(f32::INFINITY));
    });
    assert!(err.to_string().contains("no literal for inf"), "{err}");
    let err = build_err(&key(), |k| {
        let out = k.storage_rw::<f32>("out");
        k.store(&out, 0u32, Expr::<F16>::lit(0.1).cast::<f32>());
    });
    assert!(
        err.to_string()
            .contains("0.1 is not exactly representable as f16"),
        "{err}"
    );
}

#[test]
fn workgroup_memory_over_the_limit() {
    let err = build_err(&key(), |k| {
        let big = k.workgroup_array::<f32>("big", 9000);
        let out = k.storage_rw::<f32>("out");
        k.store(&big, 0u32, 1.0f32);
        k.store(&out, 0u32, big.at(0u32));
    });
    assert_eq!(
        err.kind,
        ErrorKind::WorkgroupMemory {
            used: 36000,
            limit: 32768
        }
    );
    // The same kernel fits a device with 48 KiB (the H200).
    let limits = Limits {
        max_workgroup_storage_bytes: 48 * 1024,
        ..Limits::default()
    };
    Kernel::build_with_limits(&key(), &limits, |k| {
        let big = k.workgroup_array::<f32>("big", 9000);
        k.store(&big, 0u32, 1.0f32);
    })
    .unwrap();
}

#[test]
fn workgroup_size_and_immediates_over_limits() {
    let err = build_err(&KernelKey::new("wide").workgroup_size(2048), |_| {});
    assert!(
        err.to_string()
            .contains("workgroup size 2048x1x1 is over the limit: 1024 invocations"),
        "{err}"
    );
    let err = build_err(&KernelKey::new("many").workgroup_size(0), |_| {});
    assert!(matches!(err.kind, ErrorKind::WorkgroupSize { .. }), "{err}");
    let err = build_err(&KernelKey::new("imm").features(Features::IMMEDIATES), |k| {
        let out = k.storage_rw::<f32>("out");
        for i in 0..40 {
            let p = k.param::<f32>(&format!("p{i}"));
            k.store(&out, i as u32, p);
        }
    });
    assert_eq!(
        err.kind,
        ErrorKind::ImmediateSize {
            used: 160,
            limit: 128
        }
    );
}

#[test]
fn two_bindings_with_one_name() {
    let err = build_err(&key(), |k| {
        k.storage::<f32>("x");
        k.storage_rw::<u32>("x");
    });
    assert_eq!(
        without_place(&err),
        "kernel `misuse`: the name `x` is declared twice"
    );
    let err = build_err(&KernelKey::new("clash").shape("n", 4u32), |k| {
        k.param::<u32>("n");
    });
    assert_eq!(err.kind, ErrorKind::DuplicateName { name: "n".into() });
}

#[test]
fn invalid_names() {
    for bad in ["loop", "max", "a b", "__x", "params", "local_index"] {
        let err = build_err(&key(), |k| {
            k.storage::<f32>(bad);
        });
        assert!(
            matches!(&err.kind, ErrorKind::InvalidName { name, .. } if name == bad),
            "{bad}: {err}"
        );
    }
    let err = build_err(&KernelKey::new("shape_name").shape("var", 1u32), |_| {});
    assert!(matches!(err.kind, ErrorKind::InvalidName { .. }), "{err}");
}

#[test]
fn subgroup_ops_need_the_feature() {
    let err = build_err(&key(), |k| {
        let out = k.storage_rw::<f32>("out");
        let s = k.subgroup_add(1.0f32);
        k.store(&out, 0u32, s);
    });
    assert_eq!(
        without_place(&err),
        "kernel `misuse`: `subgroupAdd` needs subgroups, but the kernel key does not ask for Features::SUBGROUPS"
    );
    let err = build_err(&key(), |k| {
        let out = k.storage_rw::<u32>("out");
        k.store(&out, 0u32, k.subgroup_size());
    });
    assert!(
        matches!(err.kind, ErrorKind::SubgroupsNotRequested { ref op } if op == "subgroup_size"),
        "{err}"
    );
    // The subgroup path of a reduction is only taken with the feature, so this builds.
    Kernel::build(&key(), |k| {
        let out = k.storage_rw::<f32>("out");
        let s = k.workgroup_reduce(1.0f32, Reduce::Sum);
        k.store(&out, 0u32, s);
    })
    .unwrap();
}

#[test]
fn locals_out_of_scope_and_from_other_kernels() {
    let err = build_err(&key(), |k| {
        let out = k.storage_rw::<f32>("out");
        let mut inner = None;
        k.if_(lit(true), |k| inner = Some(k.let_("t", 2.0f32)));
        k.store(&out, 0u32, inner.unwrap());
    });
    assert_eq!(
        without_place(&err),
        "kernel `misuse`: `t` is used outside the scope that declares it (or comes from another kernel)"
    );
    let mut stolen = None;
    Kernel::build(&KernelKey::new("donor"), |k| {
        stolen = Some(k.let_("x", 1.0f32))
    })
    .unwrap();
    let err = build_err(&key(), |k| {
        let out = k.storage_rw::<f32>("out");
        k.store(&out, 0u32, stolen.clone().unwrap());
    });
    assert!(matches!(err.kind, ErrorKind::OutOfScope { .. }), "{err}");
    let mut other_buffer = None;
    Kernel::build(&KernelKey::new("donor2"), |k| {
        other_buffer = Some(k.storage::<f32>("w"))
    })
    .unwrap();
    let err = build_err(&key(), |k| {
        let out = k.storage_rw::<f32>("out");
        k.store(&out, 0u32, other_buffer.as_ref().unwrap().at(0u32));
    });
    assert_eq!(err.kind, ErrorKind::OutOfScope { name: "w".into() });
}

#[test]
fn control_flow_misuse() {
    let err = build_err(&key(), |k| k.break_());
    assert_eq!(
        without_place(&err),
        "kernel `misuse`: `break` outside a loop"
    );
    let err = build_err(&key(), |k| {
        let t = k.let_("t", 1u32);
        k.assign_op_any(&t.erase(), None, &AnyExpr::literal(Literal::U32(2)));
    });
    assert!(matches!(err.kind, ErrorKind::NotAssignable { .. }), "{err}");
    let err = build_err(&key(), |k| {
        k.for_range("i", 0u32, 4u32, |k, i| {
            k.assign_op_any(&i.erase(), None, &AnyExpr::literal(Literal::U32(2)));
        });
    });
    assert!(err.to_string().contains("loop counter i"), "{err}");
    let err = build_err(&key(), |k| {
        let flag = k.var("flag", true);
        k.update(&flag, BinaryOp::And, false);
    });
    assert!(
        err.to_string()
            .contains("`&&=` is not a WGSL compound assignment"),
        "{err}"
    );
}

#[test]
fn missing_shape_parameter() {
    let err = build_err(&KernelKey::new("shapes").shape("rows", 3u32), |k| {
        let _ = k.shape::<u32>("cols");
    });
    assert_eq!(
        without_place(&err),
        "kernel `shapes`: shape parameter `cols` (u32) is not in the kernel key"
    );
    let err = build_err(&KernelKey::new("shapes").shape("eps", 1e-6f32), |k| {
        let _ = k.shape::<u32>("eps");
    });
    assert!(matches!(err.kind, ErrorKind::MissingShape { .. }), "{err}");
}

/// Barriers and subgroup operations must be reached by every invocation together.
#[test]
fn barriers_in_non_uniform_control_flow() {
    let non_uniform = |f: &dyn Fn(&mut KernelBuilder)| {
        let key = KernelKey::new("sync")
            .workgroup_size(64)
            .features(Features::SUBGROUPS);
        let err = build_err(&key, f);
        assert!(
            matches!(err.kind, ErrorKind::NonUniformBarrier { .. }),
            "{err}"
        );
    };
    // Under a per-invocation condition.
    non_uniform(&|k| k.if_(k.local_index().lt(32u32), |k| k.workgroup_barrier()));
    // A reduction under a condition on data read from a read-write buffer.
    non_uniform(&|k| {
        let x = k.storage_rw::<f32>("x");
        k.if_(x.at(0u32).gt(0.0f32), |k| {
            let s = k.workgroup_reduce(1.0f32, Reduce::Sum);
            k.store(&x, 0u32, s);
        });
    });
    // After an early return that only some invocations take.
    non_uniform(&|k| {
        k.if_(k.local_index().eq(3u32), |k| k.return_());
        k.workgroup_barrier();
    });
    // In a loop some invocations leave early (even before the break, on later iterations).
    non_uniform(&|k| {
        k.for_range("i", 0u32, 4u32, |k, i| {
            k.workgroup_barrier();
            k.break_if(i.eq(k.local_index()));
        });
    });
    // A subgroup operation under a per-invocation condition.
    non_uniform(&|k| {
        let x = k.storage_rw::<f32>("x");
        k.if_(k.subgroup_invocation_id().eq(0u32), |k| {
            let s = k.subgroup_add(1.0f32);
            k.store(&x, 0u32, s);
        });
    });

    // `workgroupUniformLoad` is a barrier itself, and its index must be uniform.
    non_uniform(&|k| {
        let flags = k.workgroup_array::<u32>("flags", 64);
        k.if_(k.local_index().lt(32u32), |k| {
            let _ = k.workgroup_uniform_load("f", &flags, 0u32);
        });
    });
    let key = KernelKey::new("sync").workgroup_size(64);
    let err = build_err(&key, |k| {
        let flags = k.workgroup_array::<u32>("flags", 64);
        let lane = k.let_("lane", k.local_index());
        let f = k.workgroup_uniform_load("f", &flags, &lane);
        k.if_(f.eq(1u32), |k| k.workgroup_barrier());
    });
    assert!(
        without_place(&err).starts_with(
            "kernel `sync`: `workgroupUniformLoad` reads an element whose index depends on `lane` (which \
             depends on `local_index`): every invocation must read the same element"
        ),
        "{err}"
    );
    // A branch on workgroup memory read as such is not uniform; read by
    // `workgroupUniformLoad` it is (below).
    non_uniform(&|k| {
        let flags = k.workgroup_array::<u32>("flags", 1);
        k.if_(flags.at(0u32).eq(1u32), |k| k.workgroup_barrier());
    });

    // Uniform: conditions on workgroup ids, runtime scalars and read-only data at uniform
    // indices; loops with uniform bounds; exits every invocation takes together.
    let key = KernelKey::new("sync_ok").workgroup_size(64);
    Kernel::build(&key, |k| {
        let labels = k.storage::<u32>("labels");
        let out = k.storage_rw::<f32>("out");
        let rows = k.param::<u32>("rows");
        let row = k.let_("row", k.workgroup_id().x());
        k.if_(row.ge(&rows), |k| k.return_());
        k.if_(labels.at(&row).lt(10u32), |k| {
            k.for_range("i", 0u32, &rows, |k, _| k.workgroup_barrier());
            let s = k.workgroup_reduce(1.0f32, Reduce::Sum);
            k.store(&out, &row, s);
        });
        let flags = k.workgroup_array::<u32>("flags", 4);
        k.if_(k.local_index().eq(0u32), |k| k.store(&flags, 1u32, 1u32));
        let f = k.workgroup_uniform_load("f", &flags, row.min(3u32));
        k.if_(f.eq(1u32), |k| k.workgroup_barrier());
    })
    .unwrap();
}

/// A barrier some invocations may skip is reported at the author's call (the `workgroup_reduce`,
/// not the `workgroupBarrier` inside it), with the condition that makes it so and a way out.
#[test]
fn a_non_uniform_barrier_says_where_which_operation_and_why() {
    let key = KernelKey::new("rows").workgroup_size(64);
    let (mut if_line, mut reduce_line) = (0, 0);
    let err = build_err(&key, |k| {
        let x = k.storage::<f32>("x");
        let y = k.storage_rw::<f32>("y");
        let n = k.param::<u32>("n");
        let i = k.global_index();
        let i = k.let_("i", i);
        let first = k.workgroup_reduce(x.at(0u32), Reduce::Max); // uniform: fine
        k.store(&y, 0u32, first);
        if_line = line!() + 1;
        k.if_(i.lt(&n), |k| {
            reduce_line = line!() + 1;
            let total = k.workgroup_reduce(x.at(&i), Reduce::Sum);
            k.store(&y, &i, total);
        });
    });
    let file = file!();
    assert_eq!(
        err.to_string(),
        format!(
            "kernel `rows` at {file}:{reduce_line}:27 (in `workgroup_reduce`): `workgroupBarrier` \
             may be reached by only some invocations of the workgroup: the `if` at \
             {file}:{if_line}:11 tests a value that depends on `i` (which depends on \
             `local_index`). Every invocation must reach it together. Compute the condition \
             from values all invocations share (shapes, runtime scalars, `workgroup_id`, \
             read-only buffers at such indices), or move the barrier or reduction out of the \
             branch and guard only the loads and stores around it (invocations past the end \
             contribute the reduction's identity: 0 to a sum)"
        )
    );

    // The cause is named for loops, vars and early exits too.
    let because = |f: &dyn Fn(&mut KernelBuilder)| match build_err(&key, f).kind {
        ErrorKind::NonUniformBarrier { because, .. } => because,
        other => panic!("{other:?}"),
    };
    let why = because(&|k| {
        let steps = k.var("steps", 0u32);
        k.while_(steps.get().lt(4u32), |k| {
            k.workgroup_barrier();
            k.add_assign(&steps, 1u32);
        });
    });
    assert!(why.starts_with("the loop at "), "{why}");
    assert!(why.ends_with("depends on the `var` `steps`"), "{why}");
    let why = because(&|k| {
        k.if_(k.local_index().eq(3u32), |k| k.return_());
        k.workgroup_barrier();
    });
    assert!(
        why.starts_with("some invocations may leave early under the `if` at "),
        "{why}"
    );
    let why = because(&|k| {
        let flags = k.storage_rw::<u32>("flags");
        k.if_(flags.at(k.workgroup_id().x()).eq(1u32), |k| {
            k.workgroup_barrier()
        });
    });
    assert!(
        why.ends_with("a read of the read-write buffer `flags`"),
        "{why}"
    );
}

/// A loop whose literal step leaves its counter unchanged never ends (a hang on the GPU, with
/// the device lost after the driver's timeout): refused where it is written.
#[test]
fn loops_that_never_end_are_refused() {
    let err = build_err(&key(), |k| {
        let y = k.storage_rw::<f32>("y");
        k.for_step("i", 0u32, 8u32, 0u32, |k, i| k.store(&y, i, 1.0f32));
    });
    assert_eq!(
        without_place(&err),
        "kernel `misuse`: the loop over `i` never ends: its step `i += 0` leaves the counter unchanged"
    );
    let err = build_err(&key(), |k| {
        let y = k.storage_rw::<f32>("y");
        k.for_loop(
            "s",
            64u32,
            |s| s.gt(0u32),
            BinaryOp::Shr,
            0u32,
            |k, s| k.store(&y, s, 1.0f32),
        );
    });
    assert!(without_place(&err).contains("its step `s >>= 0`"), "{err}");
    // A step that moves the counter builds.
    Kernel::build(&key(), |k| {
        let y = k.storage_rw::<f32>("y");
        k.for_loop(
            "s",
            64u32,
            |s| s.gt(0u32),
            BinaryOp::Shr,
            1u32,
            |k, s| k.store(&y, s, 1.0f32),
        );
    })
    .unwrap();
}

/// Text reaches WGSL only inside comments: every WGSL line break in a comment or a kernel name
/// (LF, CR, VT, FF, NEL, U+2028, U+2029) starts a new comment line, never code.
#[test]
fn comments_and_names_cannot_become_code() {
    for brk in [
        '\n', '\r', '\u{0B}', '\u{0C}', '\u{85}', '\u{2028}', '\u{2029}',
    ] {
        let name = format!("evil{brk}y[0] = 42.0f;");
        let key = KernelKey::new(name).workgroup_size(64);
        let kernel = Kernel::build(&key, |k| {
            let y = k.storage_rw::<f32>("y");
            k.comment(&format!("note{brk}y[0] = 42.0f;"));
            k.store(&y, 0u32, 1.0f32);
        })
        .unwrap_or_else(|e| panic!("break {brk:?}: {e}"));
        for line in kernel.wgsl().split(|c: char| {
            matches!(
                c,
                '\n' | '\r' | '\u{0B}' | '\u{0C}' | '\u{85}' | '\u{2028}' | '\u{2029}'
            )
        }) {
            assert!(
                !line.contains("42.0f") || line.trim_start().starts_with("//"),
                "break {brk:?} put code in the WGSL: {line:?}"
            );
        }
    }
}

/// A sum of ten thousand terms (an unrolled loop written as one expression) is an error naming
/// its depth — not a stack overflow that aborts the process — on a thread with the 2 MiB stack
/// of a test; and a tree of a hundred thousand is dropped without one.
#[test]
fn deep_expressions_are_errors_not_stack_overflows() {
    let run = || {
        let err = build_err(&key(), |k| {
            let x = k.storage::<f32>("x");
            let y = k.storage_rw::<f32>("y");
            let mut sum = x.at(0u32);
            for i in 1..10_000u32 {
                sum = sum + x.at(i);
            }
            k.store(&y, 0u32, sum);
        });
        assert!(
            without_place(&err).contains("an expression 10001 operations deep, more than the 128"),
            "{err}"
        );
        let mut deep: Expr<f32> = lit(1.0f32);
        for _ in 0..100_000 {
            deep = deep * 1.5f32;
        }
        drop(deep);
        // At the limit it builds.
        Kernel::build(&key(), |k| {
            let x = k.storage::<f32>("x");
            let y = k.storage_rw::<f32>("y");
            let mut sum = x.at(0u32);
            for i in 1..(MAX_EXPRESSION_DEPTH - 1) / 2 {
                sum = sum + x.at(i);
            }
            k.store(&y, 0u32, sum);
        })
        .unwrap();
    };
    std::thread::Builder::new()
        .stack_size(2 << 20)
        .spawn(run)
        .unwrap()
        .join()
        .unwrap();
}

/// `if`s nested past the limit are an error naming it, not "naga rejected … (a hesper bug)".
#[test]
fn nesting_too_deep_is_an_error() {
    fn nest(k: &mut KernelBuilder, y: &RwBuffer<f32>, depth: u32) {
        if depth == 0 {
            k.store(y, 0u32, 1.0f32);
        } else {
            let i = k.local_index();
            k.if_(i.lt(depth), |k| nest(k, y, depth - 1));
        }
    }
    let err = build_err(&key(), |k| {
        let y = k.storage_rw::<f32>("y");
        nest(k, &y, 200);
    });
    assert!(
        without_place(&err).contains("nested more than 48 deep"),
        "{err}"
    );
    Kernel::build(&key(), |k| {
        let y = k.storage_rw::<f32>("y");
        nest(k, &y, MAX_NESTING);
    })
    .unwrap();
}

/// Sizes past u32 and shape values WGSL cannot spell are errors, not panics or "naga rejected".
#[test]
fn sizes_past_u32_and_non_finite_shapes_are_errors() {
    let err = Kernel::build(
        &KernelKey::new("huge").workgroup_size_3d([65536, 65536, 1]),
        |k| {
            let y = k.storage_rw::<f32>("y");
            k.store(&y, 0u32, 1.0f32);
        },
    )
    .unwrap_err();
    assert!(matches!(err.kind, ErrorKind::WorkgroupSize { .. }), "{err}");
    let err = Kernel::build(&key(), |k| {
        let y = k.storage_rw::<f32>("y");
        let tile = k.workgroup_array::<Vec4<f32>>("tile", 1 << 30);
        k.store(&tile, 0u32, Expr::<Vec4<f32>>::splat(1.0f32));
        k.store(&y, 0u32, tile.at(0u32).x());
    })
    .unwrap_err();
    assert!(
        matches!(err.kind, ErrorKind::WorkgroupMemory { .. }),
        "{err}"
    );
    let err = Kernel::build(&KernelKey::new("reduce").workgroup_size(u32::MAX), |k| {
        let y = k.storage_rw::<f32>("y");
        let total = k.workgroup_reduce(1.0f32, Reduce::Sum);
        k.store(&y, 0u32, total);
    })
    .unwrap_err();
    assert!(!matches!(err.kind, ErrorKind::Naga { .. }), "{err}");
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let key = KernelKey::new("scaled")
            .workgroup_size(64)
            .shape("tau", bad);
        let err = Kernel::build(&key, |k| {
            let tau = k.shape_const::<f32>("tau");
            let y = k.storage_rw::<f32>("y");
            k.store(&y, 0u32, tau);
        })
        .unwrap_err();
        assert!(
            err.to_string()
                .contains("shape value `tau`: expected a finite f32"),
            "{err}"
        );
    }
}

/// Builds that would take minutes or exhaust memory are refused at once: a private array of
/// 64 Ki f32, 100 000 unrolled statements.
#[test]
fn unbounded_builds_are_refused() {
    let started = std::time::Instant::now();
    let err = build_err(&key(), |k| {
        let y = k.storage_rw::<f32>("y");
        let big: LocalArray<f32> = k.var_array("big", 65536);
        k.store(&big, 0u32, 1.0f32);
        k.store(&y, 0u32, big.at(0u32));
    });
    assert!(
        without_place(&err).contains("local array `big`: expected at most 16384 bytes"),
        "{err}"
    );
    let err = build_err(&key(), |k| {
        let y = k.storage_rw::<f32>("y");
        k.unroll(0..100_000, |k, i| k.store(&y, i, 1.0f32));
    });
    assert!(
        without_place(&err).contains("more than 20000 statements"),
        "{err}"
    );
    assert!(started.elapsed().as_secs() < 20, "refused quickly");
}
