//! The interpreter (`hesper_dsl::interp`) on small kernels against plain Rust, and the bugs it
//! is for, each seeded once: an index one past the end, an unguarded write beyond the length,
//! a missing barrier between a reduction's writes and reads, two invocations writing one output,
//! and a result that depends on the subgroup size.

use hesper_dsl::interp::{InterpError, Run, ScalarValue, interpret};
use hesper_dsl::prelude::*;

fn xs(n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
        .collect()
}

fn expect_fault<T: std::fmt::Debug>(result: Result<T, InterpError>, words: &[&str]) -> InterpError {
    let e = result.expect_err("a fault");
    let text = e.to_string();
    for w in words {
        assert!(text.contains(w), "`{w}` is not in: {text}");
    }
    e
}

/// `y[i] = x[i + shift] * 2 + 1` for `i < n`, guarded or not.
fn axpb(shift: u32, guarded: bool) -> Kernel {
    let key = KernelKey::new("axpb").workgroup_size(64);
    Kernel::build(&key, |k| {
        let x = k.storage::<f32>("x");
        let y = k.storage_rw::<f32>("y");
        let n = k.param::<u32>("n");
        let i = k.global_index();
        let value = x.at(&i + shift) * 2.0f32 + 1.0f32;
        if guarded {
            k.if_(i.lt(&n), |k| k.store(&y, &i, value));
        } else {
            k.store(&y, &i, value);
        }
    })
    .unwrap()
}

#[test]
fn an_elementwise_kernel_matches_rust_and_every_element_is_written() {
    let x = xs(100);
    let mut run = Run::new([2, 1, 1])
        .buffer("x", &x)
        .buffer("y", &vec![f32::NAN; 100])
        .param("n", ScalarValue::U32(100));
    interpret(&axpb(0, true), &mut run).unwrap();
    let y: Vec<f32> = run.read("y").unwrap();
    let want: Vec<f32> = x.iter().map(|v| v * 2.0 + 1.0).collect();
    assert_eq!(y, want);
}

#[test]
fn an_index_one_past_the_end_is_caught() {
    let mut run = Run::new([2, 1, 1])
        .buffer("x", &xs(100))
        .buffer("y", &[0f32; 100])
        .param("n", ScalarValue::U32(100));
    let e = expect_fault(
        interpret(&axpb(1, true), &mut run),
        &[
            "axpb",
            "read of `x[100]`",
            "past its 100 elements",
            "(99, 0, 0)",
        ],
    );
    assert!(e.at.is_some(), "the statement is named: {e}");
}

#[test]
fn an_unguarded_write_beyond_the_length_is_caught() {
    // Two workgroups of 64 over 100 elements: invocations 100..128 write past the end.
    let mut run = Run::new([2, 1, 1])
        .buffer("x", &xs(128))
        .buffer("y", &[0f32; 100])
        .param("n", ScalarValue::U32(100));
    expect_fault(
        interpret(&axpb(0, false), &mut run),
        &["write of `y[100]`", "past its 100 elements", "(100, 0, 0)"],
    );
}

/// Each workgroup's sum of its 64 values, through workgroup memory: every invocation writes
/// its value, then invocation 0 adds them; `barrier` between the two or not.
fn block_sum(barrier: bool) -> Kernel {
    let key = KernelKey::new("block_sum").workgroup_size(64);
    Kernel::build(&key, |k| {
        let x = k.storage::<f32>("x");
        let out = k.storage_rw::<f32>("out");
        let scratch = k.workgroup_array::<f32>("scratch", 64);
        let lid = k.local_index();
        let g = k.global_index();
        k.store(&scratch, &lid, x.at(&g));
        if barrier {
            k.workgroup_barrier();
        }
        k.if_(lid.eq(0u32), |k| {
            let acc = k.var("acc", 0.0f32);
            k.for_range("j", 0u32, 64u32, |k, j| {
                k.add_assign(&acc, scratch.at(&j));
            });
            k.store(&out, k.workgroup_id().x(), acc.get());
        });
    })
    .unwrap()
}

#[test]
fn a_reduction_with_its_barrier_matches_rust() {
    let x = xs(192);
    let mut run = Run::new([3, 1, 1])
        .buffer("x", &x)
        .buffer("out", &[f32::NAN; 3]);
    interpret(&block_sum(true), &mut run).unwrap();
    let got: Vec<f32> = run.read("out").unwrap();
    for (b, got) in got.iter().enumerate() {
        // The same order as the kernel's loop: bit for bit.
        let want = x[b * 64..][..64].iter().fold(0f32, |a, v| a + v);
        assert_eq!(*got, want, "block {b}");
    }
}

#[test]
fn a_missing_barrier_between_a_reductions_writes_and_reads_is_a_race() {
    let mut run = Run::new([1, 1, 1])
        .buffer("x", &xs(64))
        .buffer("out", &[0f32; 1]);
    expect_fault(
        interpret(&block_sum(false), &mut run),
        &["race on workgroup array `scratch[", "no barrier between"],
    );
}

#[test]
fn two_invocations_writing_one_output_is_a_race() {
    let key = KernelKey::new("last_wins").workgroup_size(64);
    let kernel = Kernel::build(&key, |k| {
        let x = k.storage::<f32>("x");
        let out = k.storage_rw::<f32>("out");
        let i = k.global_index();
        k.store(&out, 0u32, x.at(&i));
    })
    .unwrap();
    let mut run = Run::new([1, 1, 1])
        .buffer("x", &xs(64))
        .buffer("out", &[0f32; 1]);
    expect_fault(
        interpret(&kernel, &mut run),
        &["last_wins", "race on `out[0]`", "written by invocation 0"],
    );
}

#[test]
fn a_read_of_workgroup_memory_never_written_is_caught() {
    let key = KernelKey::new("unwritten").workgroup_size(64);
    let kernel = Kernel::build(&key, |k| {
        let out = k.storage_rw::<f32>("out");
        let scratch = k.workgroup_array::<f32>("scratch", 128);
        let lid = k.local_index();
        k.store(&scratch, &lid, 1.0f32);
        k.workgroup_barrier();
        // Reads 64..128, which nobody wrote.
        k.store(&out, &lid, scratch.at(&lid + 64u32));
    })
    .unwrap();
    let mut run = Run::new([1, 1, 1]).buffer("out", &[0f32; 64]);
    expect_fault(
        interpret(&kernel, &mut run),
        &["workgroup array `scratch[64]`", "never written"],
    );
}

/// `out[i] = subgroupAdd(1)`: the subgroup's size, right only where the author assumed it.
#[test]
fn a_result_that_depends_on_the_subgroup_size_shows_when_run_at_two() {
    let key = KernelKey::new("sg_count")
        .workgroup_size(64)
        .features(Features::SUBGROUPS);
    let kernel = Kernel::build(&key, |k| {
        let out = k.storage_rw::<u32>("out");
        let i = k.global_index();
        let count = k.subgroup_add(1u32);
        k.store(&out, &i, count);
    })
    .unwrap();
    let at = |size: u32| {
        let mut run = Run::new([1, 1, 1]).buffer("out", &[0u32; 64]);
        run.subgroup_size = size;
        interpret(&kernel, &mut run).unwrap();
        run.read::<u32>("out").unwrap()
    };
    assert_eq!(at(32), vec![32; 64]);
    assert_eq!(at(8), vec![8; 64]);
    let sizes = hesper_dsl::interp::subgroup_size_dependence(
        &kernel,
        &Run::new([1, 1, 1]).buffer("out", &[0u32; 64]),
        &[8, 32],
    );
    expect_fault(sizes, &["sg_count", "`out`", "subgroups of 8", "of 32"]);
}

/// A subgroup reduction then a workgroup one (the library's `workgroup_reduce` with subgroups)
/// gives the same sum at every subgroup size.
#[test]
fn workgroup_reduce_is_right_at_every_subgroup_size() {
    let key = KernelKey::new("reduce")
        .workgroup_size(128)
        .features(Features::SUBGROUPS);
    let kernel = Kernel::build(&key, |k| {
        let x = k.storage::<f32>("x");
        let out = k.storage_rw::<f32>("out");
        let i = k.global_index();
        let s = k.workgroup_reduce(x.at(&i), Reduce::Max);
        k.if_(k.local_index().eq(0u32), |k| {
            k.store(&out, k.workgroup_id().x(), s)
        });
    })
    .unwrap();
    let x = xs(256);
    for size in [1, 4, 8, 32, 64] {
        let mut run = Run::new([2, 1, 1])
            .buffer("x", &x)
            .buffer("out", &[f32::NAN; 2]);
        run.subgroup_size = size;
        interpret(&kernel, &mut run).unwrap();
        let got: Vec<f32> = run.read("out").unwrap();
        for (b, got) in got.iter().enumerate() {
            let want = x[b * 128..][..128].iter().copied().fold(f32::MIN, f32::max);
            assert_eq!(*got, want, "subgroups of {size}, block {b}");
        }
    }
}

/// `k.debug` prints on the interpreter, with each invocation's id, and leaves the WGSL (and the
/// key) exactly the kernel's without it.
#[test]
fn debug_prints_on_the_interpreter_and_emits_nothing() {
    let build = |debug: bool| {
        let key = KernelKey::new("printing").workgroup_size(4);
        Kernel::build(&key, |k| {
            let x = k.storage::<f32>("x");
            let y = k.storage_rw::<f32>("y");
            let i = k.global_index();
            let doubled = k.let_("doubled", x.at(&i) * 2.0f32);
            if debug {
                k.debug("doubled", &doubled);
                k.debug(
                    "index and value",
                    vec2(i.clone().cast::<f32>(), doubled.clone()),
                );
            }
            k.store(&y, &i, doubled);
        })
        .unwrap()
    };
    let (with, without) = (build(true), build(false));
    assert_eq!(with.wgsl(), without.wgsl());
    assert_eq!(with.key(), without.key());
    let mut run = Run::new([2, 1, 1])
        .buffer("x", &[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])
        .buffer("y", &[0f32; 8]);
    interpret(&with, &mut run).unwrap();
    let lines: Vec<String> = run.printed.iter().map(ToString::to_string).collect();
    assert_eq!(lines.len(), 16);
    assert_eq!(lines[0], "(0, 0, 0) doubled = 2");
    assert_eq!(lines[1], "(0, 0, 0) index and value = (0, 2)");
    assert_eq!(lines[15], "(7, 0, 0) index and value = (7, 16)");
    assert_eq!(run.read::<f32>("y").unwrap()[7], 16.0);
}

/// Half the workgroup returning before a barrier the other half waits at never reaches the
/// interpreter: the builder's uniformity analysis refuses the kernel first (the interpreter's
/// own check of partial barriers is for IR that escapes it).
#[test]
fn a_barrier_after_a_non_uniform_return_is_refused_before_it_runs() {
    let key = KernelKey::new("half_barrier").workgroup_size(64);
    let built = Kernel::build(&key, |k| {
        let out = k.storage_rw::<f32>("out");
        let scratch = k.workgroup_array::<f32>("scratch", 64);
        let lid = k.local_index();
        let live = k.param::<u32>("live");
        k.if_(lid.ge(&live), |k| k.return_());
        k.store(&scratch, &lid, 1.0f32);
        k.workgroup_barrier();
        k.store(&out, &lid, scratch.at(&lid));
    });
    let e = built
        .expect_err("a barrier after a non-uniform return")
        .to_string();
    assert!(
        e.contains("half_barrier") && e.contains("workgroupBarrier"),
        "{e}"
    );
}
