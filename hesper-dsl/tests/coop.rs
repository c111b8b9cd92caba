//! Cooperative matrices (tensor cores) in the DSL: what the emitter writes, what naga makes of
//! it (SPIR-V capabilities included: a missing one passes naga and fails in the driver), and the
//! misuse the builder refuses. No GPU is needed; the H200 runs them in hesper-kernels' tests.

use hesper_dsl::prelude::*;
use hesper_dsl::{CoopMultiply, ErrorKind, WorkgroupArray};

mod spirv;
use spirv::has_coop_capabilities;

type A16 = CoopMat<F16, CoopA>;
type B16 = CoopMat<F16, CoopB>;
type C32 = CoopMat<f32, CoopC>;

fn coop_key(name: &str) -> KernelKey {
    KernelKey::new(name)
        .workgroup_size(32)
        .features(Features::COOPERATIVE_MATRIX)
}

/// One subgroup computes a 16×16 tile `c = a·b` over `depth`: `a` row-major `[16, depth]` from
/// a storage buffer of vec4<f16>, `b` staged through workgroup memory column by column (it is
/// `[16, depth]` too: `c = a·bᵀ`), the accumulator in a `var`.
fn tile_kernel(depth: u32) -> Result<Kernel, hesper_dsl::DslError> {
    let key = coop_key("coop_tile").shape("depth", depth);
    Kernel::build(&key, |k| {
        let depth = k.shape::<u32>("depth");
        let a = k.storage::<Vec4<F16>>("a");
        let b = k.storage::<F16>("b");
        let c = k.storage_rw::<f32>("c");
        let staged: WorkgroupArray<F16> = k.workgroup_array("b_tile", 16 * 16);
        let acc = k.var("acc", Expr::<C32>::zero());
        k.for_step("d", 0u32, depth, 16u32, |k, d| {
            let lid = k.local_index();
            k.for_step("e", lid, 256u32, 32u32, |k, e| {
                // b_tile[col * 16 + kk] = b[col * depth + d + kk]
                let (col, kk) = (&e / 16u32, &e % 16u32);
                k.store(&staged, &e, b.at(&col * depth + &d + &kk));
            });
            k.workgroup_barrier();
            let left = k.coop_load::<A16, _>(&a, &d / 4u32, depth / 4, Major::Row);
            let right = k.coop_load::<B16, _>(&staged, 0u32, 16u32, Major::Column);
            k.assign(&acc, coop_multiply_add(left, right, acc.get()));
            k.workgroup_barrier();
        });
        k.coop_store(&c, 0u32, 16u32, Major::Row, acc.get() * 0.5f32);
    })
}

#[test]
fn tile_kernel_emits_and_validates() {
    let kernel = tile_kernel(64).unwrap();
    insta::assert_snapshot!("coop_tile", kernel.wgsl());
    assert!(kernel.uses_cooperative_matrix() && kernel.uses_f16());
    assert_eq!(
        kernel.coop_multiplies(),
        [CoopMultiply {
            size: 16,
            ab: Scalar::F16,
            c: Scalar::F32
        }]
    );
    assert!(has_coop_capabilities(&kernel));
}

/// A kernel whose matrices all live in `let`s: naga alone would leave out `VulkanMemoryModel`
/// (the driver then fails the pipeline); the builder declares one `var` so it does not.
#[test]
fn matrices_only_in_lets_still_get_every_capability() {
    let kernel = Kernel::build(&coop_key("lets_only"), |k| {
        let x = k.storage::<F16>("x");
        let y = k.storage_rw::<f32>("y");
        let a = k.coop_load::<A16, _>(&x, 0u32, 16u32, Major::Row);
        let b = k.coop_load::<B16, _>(&x, 256u32, 16u32, Major::Column);
        let c = k.coop_load::<C32, _>(&y, 0u32, 16u32, Major::Row);
        let d = k.let_("d", coop_multiply_add(a, b, c.clone()) + c);
        k.coop_store(&y, 0u32, 16u32, Major::Row, d);
    })
    .unwrap();
    assert!(
        kernel
            .wgsl()
            .contains("var coop_capability: coop_mat16x16<f16, A> = coop_mat16x16<f16, A>();"),
        "{}",
        kernel.wgsl()
    );
    assert!(has_coop_capabilities(&kernel));
    // With a `var` of its own the kernel gets no extra one.
    assert!(!tile_kernel(16).unwrap().wgsl().contains("coop_capability"));
}

/// Names a module-scope item could take that would hide WGSL's roles `A`, `B` and `C`: the
/// emitter renames the binding or shape constant in the WGSL (the executor still binds it by
/// its own name) and never gives a local one of them.
#[test]
fn role_names_are_never_hidden() {
    let key = coop_key("roles").shape("C", 16u32);
    let kernel = Kernel::build(&key, |k| {
        let a = k.storage::<F16>("A");
        let out = k.storage_rw::<f32>("B");
        let n = k.shape_const::<u32>("C");
        let left = k.coop_load::<A16, _>(&a, 0u32, &n, Major::Row);
        let right = k.coop_load::<B16, _>(&a, 0u32, &n, Major::Row);
        let m = k.let_("A", coop_multiply_add(left, right, Expr::<C32>::zero()));
        k.coop_store(&out, 0u32, n, Major::Row, m);
    })
    .unwrap();
    let wgsl = kernel.wgsl();
    assert!(wgsl.contains("const C_1: u32 = 16u;"), "{wgsl}");
    assert!(
        wgsl.contains("var<storage, read> A_1: array<f16>;"),
        "{wgsl}"
    );
    assert!(
        wgsl.contains("var<storage, read_write> B_1: array<f32>;"),
        "{wgsl}"
    );
    assert!(wgsl.contains("let A_2 = coopMultiplyAdd("), "{wgsl}");
    assert_eq!(kernel.binding("A").unwrap().binding, 0);
    // A kernel without cooperative matrices keeps its names.
    let plain = Kernel::build(&KernelKey::new("plain"), |k| {
        let a = k.storage_rw::<f32>("A");
        k.store(&a, 0u32, 1.0f32);
    })
    .unwrap();
    assert!(
        plain
            .wgsl()
            .contains("var<storage, read_write> A: array<f32>;")
    );
}

#[test]
fn the_extension_is_enabled_only_when_used() {
    // The key asks for the feature; the body uses none: no `enable`.
    let kernel = Kernel::build(&coop_key("unused"), |k| {
        let y = k.storage_rw::<f32>("y");
        k.store(&y, 0u32, 1.0f32);
    })
    .unwrap();
    assert!(!kernel.wgsl().contains("enable"), "{}", kernel.wgsl());
    assert!(!kernel.uses_cooperative_matrix());
    // f32 matrices alone need no `enable f16;`.
    let kernel = Kernel::build(&coop_key("f32_only"), |k| {
        let y = k.storage_rw::<f32>("y");
        k.coop_store(&y, 0u32, 16u32, Major::Column, Expr::<C32>::zero());
    })
    .unwrap();
    assert!(kernel.wgsl().contains("enable wgpu_cooperative_matrix;"));
    assert!(!kernel.wgsl().contains("enable f16;"));
}

fn build_err(key: &KernelKey, f: impl FnOnce(&mut KernelBuilder)) -> hesper_dsl::DslError {
    let err = Kernel::build(key, f).expect_err("the kernel must not build");
    assert!(
        !matches!(err.kind, ErrorKind::Naga { .. }),
        "reached naga: {err}"
    );
    err
}

#[test]
fn a_kernel_must_ask_for_the_feature() {
    let key = KernelKey::new("no_feature").workgroup_size(32);
    let err = build_err(&key, |k| {
        let x = k.storage::<F16>("x");
        k.coop_load::<A16, _>(&x, 0u32, 16u32, Major::Row);
    });
    assert!(
        matches!(&err.kind, ErrorKind::CoopNotRequested { op } if op == "coopLoadT"),
        "{err}"
    );
    assert!(
        err.to_string().contains("Features::COOPERATIVE_MATRIX"),
        "{err}"
    );
    // A zero matrix alone needs it too.
    let err = build_err(&key, |k| {
        let y = k.storage_rw::<f32>("y");
        k.coop_store(&y, 0u32, 16u32, Major::Row, Expr::<C32>::zero());
    });
    assert!(
        matches!(err.kind, ErrorKind::CoopNotRequested { .. }),
        "{err}"
    );
}

#[test]
fn cooperative_operations_need_uniform_control_flow() {
    let err = build_err(&coop_key("divergent"), |k| {
        let x = k.storage::<F16>("x");
        let y = k.storage_rw::<f32>("y");
        k.if_(k.local_index().lt(16u32), |k| {
            let a = k.coop_load::<A16, _>(&x, 0u32, 16u32, Major::Row);
            let b = k.coop_load::<B16, _>(&x, 0u32, 16u32, Major::Row);
            k.coop_store(
                &y,
                0u32,
                16u32,
                Major::Row,
                coop_multiply_add(a, b, Expr::<C32>::zero()),
            );
        });
    });
    assert!(
        matches!(&err.kind, ErrorKind::NonUniformBarrier { op, scope: "subgroup", .. } if op == "coopLoadT"),
        "{err}"
    );
    // A store alone, under a condition that differs between invocations.
    let err = build_err(&coop_key("divergent_store"), |k| {
        let y = k.storage_rw::<f32>("y");
        let m = k.let_("m", Expr::<C32>::zero());
        k.if_(k.local_index().eq(0u32), |k| {
            k.coop_store(&y, 0u32, 16u32, Major::Row, m);
        });
    });
    assert!(
        matches!(&err.kind, ErrorKind::NonUniformBarrier { op, .. } if op == "coopStoreT"),
        "{err}"
    );
}

#[test]
fn misuse_is_refused() {
    // A size WGSL cannot spell.
    let err = build_err(&coop_key("size"), |k| {
        let y = k.storage_rw::<f32>("y");
        k.coop_store(
            &y,
            0u32,
            12u32,
            Major::Row,
            Expr::<CoopMat<f32, CoopC, 12>>::zero(),
        );
    });
    assert!(err.to_string().contains("8×8 or 16×16"), "{err}");
    // `select` between matrices.
    let err = build_err(&coop_key("select"), |k| {
        let y = k.storage_rw::<f32>("y");
        let m = select(
            k.local_index().eq(0u32),
            Expr::<C32>::zero(),
            Expr::<C32>::zero(),
        );
        k.coop_store(&y, 0u32, 16u32, Major::Row, m);
    });
    assert!(err.to_string().contains("select"), "{err}");
    // An array of matrices in function memory.
    let err = build_err(&coop_key("array"), |k| {
        k.var_array::<C32>("tiles", 4);
    });
    assert!(
        err.to_string().contains("cooperative matrices in `var`s"),
        "{err}"
    );
}

/// 8×8 tiles (what Apple GPUs offer) are spelled too.
#[test]
fn eight_by_eight() {
    let kernel = Kernel::build(&coop_key("small"), |k| {
        let x = k.storage::<f32>("x");
        let y = k.storage_rw::<f32>("y");
        let a = k.coop_load::<CoopMat<f32, CoopA, 8>, _>(&x, 0u32, 8u32, Major::Row);
        let b = k.coop_load::<CoopMat<f32, CoopB, 8>, _>(&x, 64u32, 8u32, Major::Row);
        let c = coop_multiply_add(a, b, Expr::<CoopMat<f32, CoopC, 8>>::zero());
        k.coop_store(&y, 0u32, 8u32, Major::Column, c);
    })
    .unwrap();
    assert!(
        kernel
            .wgsl()
            .contains("coopLoadT<coop_mat8x8<f32, A>>(&x[0u], 8u)")
    );
    assert_eq!(
        kernel.coop_multiplies(),
        [CoopMultiply {
            size: 8,
            ab: Scalar::F32,
            c: Scalar::F32
        }]
    );
}

/// naga checks cooperative loads and multiply-adds against its own uniformity analysis, which
/// counts a short-circuit `&&`, loop counters and per-invocation builtins as varying: the
/// builder refuses what naga would (never "naga rejected"), and `&` on booleans passes.
#[test]
fn conditions_naga_counts_as_varying_are_refused() {
    let build = |short_circuit: bool| {
        Kernel::build(&coop_key("inside"), |k| {
            let y = k.storage_rw::<f32>("y");
            let n = k.param::<u32>("n");
            let wid = k.workgroup_id();
            let inside = match short_circuit {
                true => wid.x().lt(&n).and(wid.y().lt(&n)),
                false => wid.x().lt(&n) & wid.y().lt(&n),
            };
            k.if_(inside, |k| {
                let c = k.coop_load::<C32, _>(&y, 0u32, 16u32, Major::Row);
                k.coop_store(&y, 256u32, 16u32, Major::Row, c);
            });
        })
    };
    let err = build(true).unwrap_err();
    assert!(
        matches!(&err.kind, ErrorKind::NonUniformBarrier { op, .. } if op == "coopLoadT"),
        "{err}"
    );
    assert!(err.to_string().contains("short-circuit"), "{err}");
    let kernel = build(false).unwrap();
    assert!(
        kernel
            .wgsl()
            .contains("if (workgroup_id.x < params.n) & (workgroup_id.y < params.n) {"),
        "{}",
        kernel.wgsl()
    );
    // A loop counter is a variable to naga.
    let err = build_err(&coop_key("counter"), |k| {
        let y = k.storage_rw::<f32>("y");
        let acc = k.var("acc", Expr::<C32>::zero());
        k.for_range("i", 0u32, 4u32, |k, i| {
            k.if_(i.lt(2u32), |k| {
                let c = k.coop_load::<C32, _>(&y, 0u32, 16u32, Major::Row);
                k.assign(&acc, acc.get() + c);
            });
        });
        k.coop_store(&y, 0u32, 16u32, Major::Row, acc.get());
    });
    assert!(err.to_string().contains("loop counter `i`"), "{err}");
}
