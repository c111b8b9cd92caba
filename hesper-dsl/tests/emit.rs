//! The emitter: deterministic text, parentheses exactly where WGSL's grammar needs them,
//! declarations from nested scopes kept, fresh names that never collide.

use hesper_dsl::prelude::*;

fn body(wgsl: &str) -> Vec<&str> {
    let start = wgsl.find(") {\n").expect("entry point") + 4;
    wgsl[start..]
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && *l != "}")
        .collect()
}

#[test]
fn same_key_gives_byte_identical_text() {
    let build = |cols: u32| {
        let key = KernelKey::new("det")
            .workgroup_size(128)
            .shape("cols", cols)
            .features(Features::SUBGROUPS);
        Kernel::build(&key, |k| {
            let x = k.storage::<f32>("x");
            let y = k.storage_rw::<f32>("y");
            let cols = k.shape_const::<u32>("cols");
            let acc = k.var("acc", 0.0f32);
            k.row_loop(&cols, |k, c| k.add_assign(&acc, x.at(c)));
            let s = k.workgroup_reduce(acc.get(), Reduce::Sum);
            let m = k.workgroup_reduce(acc.get(), Reduce::Max);
            k.store(&y, k.workgroup_id().x(), s + m);
        })
        .unwrap()
    };
    let (a, b) = (build(300), build(300));
    assert_eq!(a.wgsl(), b.wgsl());
    assert_eq!(a.key(), b.key());
    let c = build(301);
    assert_ne!(a.wgsl(), c.wgsl());
    assert_ne!(a.key(), c.key());
}

#[test]
fn parentheses_only_where_the_grammar_needs_them() {
    let key = KernelKey::new("prec");
    let k = Kernel::build(&key, |k| {
        let out = k.storage_rw::<f32>("out");
        let bits = k.storage_rw::<u32>("bits");
        let flags = k.storage_rw::<u32>("flags");
        let a = k.let_("a", out.at(0u32));
        let b = k.let_("b", out.at(1u32));
        let c = k.let_("c", out.at(2u32));
        let u = k.let_("u", bits.at(0u32));
        let v = k.let_("v", bits.at(1u32));
        k.store(&out, 0u32, (&a + &b) * &c); // needs ( )
        k.store(&out, 1u32, &a + &b * &c); // none
        k.store(&out, 2u32, &a - (&b - &c)); // needs ( )
        k.store(&out, 3u32, &a - &b - &c); // none
        k.store(&out, 4u32, &a / (&b * &c)); // needs ( )
        k.store(&out, 5u32, -(-&a)); // no `--`
        k.store(&out, 6u32, &a * -1.5f32);
        k.store(&out, 7u32, -(&a + &b));
        k.store(&bits, 2u32, (&u & &v) | 1u32); // bit ops never mix without ( )
        k.store(&bits, 3u32, (&u << 2u32) + &v); // shift operands are unary
        k.store(&bits, 4u32, &u << (&v + 1u32));
        k.store(&bits, 5u32, &u & &v & 7u32); // same bit op chains
        let lt = a.lt(&b);
        let gt = c.gt(1e-7f32);
        k.store(&flags, 0u32, select(lt.and(&gt).or(u.eq(&v)), 1u32, 0u32));
        k.store(&flags, 1u32, select(!(lt.and(&gt)), 1u32, 0u32));
        k.store(&flags, 2u32, select(lt.eq(gt.clone()), 1u32, 0u32));
    })
    .unwrap();
    let lines = body(k.wgsl());
    let expected = [
        "out[0u] = (a + b) * c;",
        "out[1u] = a + b * c;",
        "out[2u] = a - (b - c);",
        "out[3u] = a - b - c;",
        "out[4u] = a / (b * c);",
        "out[5u] = -(-a);",
        "out[6u] = a * -1.5f;",
        "out[7u] = -(a + b);",
        "bits[2u] = (u & v) | 1u;",
        "bits[3u] = (u << 2u) + v;",
        "bits[4u] = u << (v + 1u);",
        "bits[5u] = u & v & 7u;",
        "flags[0u] = select(0u, 1u, (a < b && c > 1e-7f) || u == v);",
        "flags[1u] = select(0u, 1u, !(a < b && c > 1e-7f));",
        "flags[2u] = select(0u, 1u, (a < b) == (c > 1e-7f));",
    ];
    assert_eq!(&lines[5..], &expected, "\n{}", k.wgsl());
}

#[test]
fn declarations_in_nested_scopes_are_kept() {
    let key = KernelKey::new("nested").workgroup_size(64);
    let k = Kernel::build(&key, |k| {
        let out = k.storage_rw::<f32>("out");
        let lid = k.local_index();
        k.if_(lid.lt(32u32), |k| {
            k.for_range("j", 0u32, 4u32, |k, j| {
                // a workgroup array declared three scopes deep still lands at module scope
                let tile = k.workgroup_array::<f32>("tile", 64);
                let t = k.let_("t", j.cast::<f32>() * 0.5f32);
                k.store(&tile, &lid, &t);
                k.store(&out, &lid, tile.at(&lid) + &t);
            });
        });
    })
    .unwrap();
    let w = k.wgsl();
    assert!(
        w.contains("\nvar<workgroup> tile: array<f32, 64>;\n"),
        "{w}"
    );
    assert!(w.contains("            let t = f32(j) * 0.5f;\n"), "{w}");
    assert_eq!(k.workgroup_memory_bytes(), 256);
}

#[test]
fn fresh_names_never_collide() {
    let key = KernelKey::new("names")
        .workgroup_size(64)
        .shape("acc", 3u32);
    let k = Kernel::build(&key, |k| {
        // a binding called `index` and a shape called `acc`: locals must step around both
        let index = k.storage_rw::<f32>("index");
        let i = k.global_index();
        let a = k.var("acc", 1.0f32);
        let b = k.var("acc", 2.0f32);
        let l = k.let_("loop", 3.0f32); // a WGSL keyword as a hint
        let m = k.let_("max", 4.0f32); // a builtin function's name
        let s1 = k.workgroup_reduce(a.get(), Reduce::Sum);
        let s2 = k.workgroup_reduce(b.get(), Reduce::Sum);
        k.for_range("i", 0u32, 2u32, |k, j| {
            k.for_range("i", 0u32, 2u32, |k, j2| {
                k.store(&index, &j + &j2, &s1 + &s2 + &l + &m);
            });
        });
        k.store(&index, &i, 0.0f32);
    })
    .unwrap();
    let w = k.wgsl();
    for decl in [
        "let index_1 = ",
        "var acc_1: f32 = 1.0f;",
        "var acc_2: f32 = 2.0f;",
        "let loop_1 = 3.0f;",
        "let max_1 = 4.0f;",
        "var<workgroup> scratch: array<f32, 64>;",
        "var<workgroup> scratch_1: array<f32, 64>;",
        "for (var i: u32 = 0u; i < 2u; i += 1u) {",
        "for (var i_1: u32 = 0u; i_1 < 2u; i_1 += 1u) {",
        "index[i + i_1] = sum + sum_1 + loop_1 + max_1;",
    ] {
        assert!(w.contains(decl), "missing `{decl}` in\n{w}");
    }
}

#[test]
fn f16_is_enabled_only_when_used() {
    let plain = Kernel::build(&KernelKey::new("plain"), |k| {
        let out = k.storage_rw::<f32>("out");
        k.store(&out, 0u32, 1.0f32);
    })
    .unwrap();
    assert!(!plain.wgsl().contains("enable f16") && !plain.uses_f16());
    let half = Kernel::build(&KernelKey::new("half"), |k| {
        let out = k.storage_rw::<F16>("out");
        k.store(&out, 0u32, Expr::<F16>::lit(1.5));
    })
    .unwrap();
    assert!(half.wgsl().contains("\nenable f16;\n") && half.uses_f16());
    assert!(half.wgsl().contains("out[0u] = 1.5h;"));
}

#[test]
fn loops_and_control_flow() {
    let k = Kernel::build(&KernelKey::new("flow"), |k| {
        let out = k.storage_rw::<i32>("out");
        let n = k.param::<i32>("n");
        let v = k.var("v", 0i32);
        k.while_(v.get().lt(&n), |k| {
            k.add_assign(&v, 3i32);
            k.if_else(
                v.get().eq(9i32),
                |k| k.continue_(),
                |k| {
                    k.if_else(
                        v.get().gt(20i32),
                        |k| k.break_(),
                        |k| k.store(&out, 1u32, v.get()),
                    )
                },
            );
        });
        k.loop_(|k| {
            k.update(&v, BinaryOp::Sub, 1i32);
            k.break_if(v.get().le(i32::MIN + 5));
        });
        k.unroll(0..2, |k, j| k.store(&out, j + 2, -v.get()));
        k.return_();
    })
    .unwrap();
    let w = k.wgsl();
    for text in [
        "while v < params.n {",
        "} else if v > 20i {",
        "v -= 1i;",
        "if v <= -2147483643i {",
        "out[2u] = -v;",
        "out[3u] = -v;",
        "return;",
    ] {
        assert!(w.contains(text), "missing `{text}` in\n{w}");
    }
}

#[test]
fn wgsl_functions_are_declared_once_and_called() {
    let key = KernelKey::new("fns").workgroup_size(64);
    let k = Kernel::build(&key, |k| {
        let x = k.storage::<f32>("x");
        let out = k.storage_rw::<f32>("out");
        let i = k.global_index();
        let silu = |k: &mut KernelBuilder, v: Expr<f32>| {
            let f = k.function::<(f32,), f32>("silu", &["x"], |k, (x,)| {
                let s = k.let_("s", 1.0f32 / (1.0f32 + (-&x).exp()));
                x * s
            });
            f.call((v,))
        };
        let a = silu(k, x.at(&i));
        let b = silu(k, x.at(&i) * 2.0f32);
        k.store(&out, &i, a + b);
    })
    .unwrap();
    let w = k.wgsl();
    assert_eq!(w.matches("fn silu(").count(), 1, "{w}");
    assert!(w.contains("fn silu(x_1: f32) -> f32 {\n    let s = 1.0f / (1.0f + exp(-x_1));\n    return x_1 * s;\n}"), "{w}");
    assert!(
        w.contains("out[index] = silu(x[index]) + silu(x[index] * 2.0f);"),
        "{w}"
    );
}

#[test]
fn functions_cannot_see_the_entry_points_locals_or_builtins() {
    let key = KernelKey::new("fn_scope").workgroup_size(64);
    let err = Kernel::build(&key, |k| {
        let out = k.storage_rw::<u32>("out");
        let f = k.function::<(u32,), u32>("plus_lane", &["v"], |k, (v,)| v + k.local_index());
        k.store(&out, 0u32, f.call((lit(1u32),)));
    })
    .unwrap_err();
    assert!(
        err.to_string()
            .contains("`local_invocation_index` is used inside a WGSL function"),
        "{err}"
    );
    let err = Kernel::build(&key, |k| {
        let out = k.storage_rw::<u32>("out");
        let outer = k.let_("outer", 3u32);
        let f = k.function::<(u32,), u32>("plus_outer", &["v"], |_, (v,)| v + &outer);
        k.store(&out, 0u32, f.call((lit(1u32),)));
    })
    .unwrap_err();
    assert!(
        matches!(err.kind, hesper_dsl::ErrorKind::OutOfScope { .. }),
        "{err}"
    );
}

/// `a < (b + c) >> 1` must not read as a template `a<…>`: the right side is parenthesised.
#[test]
fn less_than_a_shift_is_not_a_template() {
    let k = Kernel::build(&KernelKey::new("tmpl"), |k| {
        let out = k.storage_rw::<u32>("out");
        let n = k.param::<u32>("n");
        let i = k.local_index();
        k.if_(i.lt((&n + 1u32) >> 1u32), |k| k.store(&out, 0u32, 1u32));
        k.if_(i.le(vec2(1u32, 2u32).x() >> 1u32), |k| {
            k.store(&out, 1u32, 1u32)
        });
    })
    .unwrap();
    assert!(
        k.wgsl()
            .contains("if local_index < ((params.n + 1u) >> 1u) {"),
        "{}",
        k.wgsl()
    );
}

/// A reduction's scratch is read after its last barrier: in a loop, a closing barrier keeps the
/// next iteration's reduction from overwriting it early; elsewhere that barrier would only make
/// finished invocations wait.
#[test]
fn workgroup_reduce_closes_with_a_barrier_only_where_it_may_run_again() {
    for features in [Features::NONE, Features::SUBGROUPS] {
        let barriers = |in_loop: bool| {
            let key = KernelKey::new("reduce")
                .workgroup_size(64)
                .features(features);
            let k = Kernel::build(&key, |k| {
                let out = k.storage_rw::<f32>("out");
                let v = k.local_index().cast::<f32>();
                if in_loop {
                    k.for_range("i", 0u32, 3u32, |k, i| {
                        let s = k.workgroup_reduce(v.clone(), Reduce::Sum);
                        k.store(&out, i, s);
                    });
                } else {
                    let s = k.workgroup_reduce(v, Reduce::Sum);
                    k.store(&out, 0u32, s);
                }
            })
            .unwrap();
            k.wgsl().matches("workgroupBarrier()").count()
        };
        assert_eq!(barriers(true), barriers(false) + 1, "{features:?}");
    }
}

/// The author's names survive: a `let_` of a value the library bound under its own name
/// (`index`, `sum`, `maximum`) renames it rather than adding `let i = index;`; an alias of the
/// author's own `let` stays an alias; `+ 0u` and `* 1u` disappear from integer arithmetic.
#[test]
fn authors_names_survive_and_integer_identities_fold() {
    let key = KernelKey::new("names").workgroup_size(64);
    let k = Kernel::build(&key, |k| {
        let x = k.storage::<f32>("x");
        let y = k.storage_rw::<f32>("y");
        let i = k.global_index();
        let i = k.let_("i", i);
        let row_max = k.workgroup_reduce(x.at(&i), Reduce::Max);
        let row_max = k.let_("row_max", row_max);
        let total = k.workgroup_reduce(x.at(&i), Reduce::Sum);
        let total = k.let_("total", total);
        let again = k.let_("again", &total);
        let base = k.let_("base", &i * 1u32);
        k.store(&y, &base + 0u32, &row_max + &again);
        k.store(&y, 0u32 + &i * 2u32, lit(0.0f32) + &total);
    })
    .unwrap();
    let lines = body(k.wgsl());
    let w = k.wgsl();
    assert!(lines[0].starts_with("let i = (workgroup_id.y"), "{w}");
    assert!(lines.contains(&"let row_max = scratch[0u];"), "{w}");
    assert!(lines.contains(&"let total = scratch_1[0u];"), "{w}");
    assert!(lines.contains(&"let again = total;"), "{w}");
    assert!(lines.contains(&"let base = i;"), "{w}");
    assert!(lines.contains(&"y[base] = row_max + again;"), "{w}");
    // Floats keep their `0.0 +`: it is not the identity for -0.0.
    assert!(lines.contains(&"y[i * 2u] = 0.0f + total;"), "{w}");
    for library_name in ["index", "maximum", "sum"] {
        assert!(!w.contains(&format!("let {library_name} ")), "{w}");
    }
}
