//! `#[kernel]` is thin sugar: each kernel here is written twice, with the macro and with the
//! builder, and both must emit byte-identical WGSL (the macro's is also snapshotted). One runs
//! on the GPU through its generated typed launcher.

mod common;

use common::{Rng, gpu, max_rel_err};
use hesper::dsl::macro_support::max;
use hesper::dsl::prelude::*;
use hesper::exec::Grid;

#[kernel(workgroup_size = 256)]
fn relu_sqr_mul_backward(
    gate: &[f32],
    up: &[f32],
    d_hidden: &[f32],
    d_gate: &mut [f32],
    d_up: &mut [f32],
    #[shape] n: u32,
) {
    let i = global_index();
    if i < n {
        let g = max(gate[i], 0.0);
        d_gate[i] = d_hidden[i] * up[i] * 2.0 * g;
        d_up[i] = d_hidden[i] * g * g;
    }
}

fn relu_sqr_mul_backward_by_hand(n: u32) -> Kernel {
    let key = KernelKey::new("relu_sqr_mul_backward")
        .workgroup_size(256)
        .shape("n", n)
        .features(Features::NONE);
    Kernel::build(&key, |k| {
        let n = k.shape::<u32>("n");
        let gate = k.storage::<f32>("gate");
        let up = k.storage::<f32>("up");
        let d_hidden = k.storage::<f32>("d_hidden");
        let d_gate = k.storage_rw::<f32>("d_gate");
        let d_up = k.storage_rw::<f32>("d_up");
        let i = k.global_index();
        let i = k.let_("i", i);
        k.if_(i.lt(n), |k| {
            let g = k.let_("g", max(gate.at(&i), 0.0));
            k.store(&d_gate, &i, d_hidden.at(&i) * up.at(&i) * 2.0 * &g);
            k.store(&d_up, &i, d_hidden.at(&i) * &g * &g);
        });
    })
    .unwrap()
}

#[kernel(workgroup_size = 128)]
fn row_sum(x: &[f32], sums: &mut [f32], #[shape] cols: u32) {
    let row = workgroup_id().x;
    let mut acc = 0.0;
    for c in (local_index()..cols).step_by(128) {
        acc += x[row * cols + c];
    }
    let total = workgroup_reduce(acc, Reduce::Sum);
    if local_index() == 0 {
        sums[row] = total;
    }
}

fn row_sum_by_hand(cols: u32) -> Kernel {
    let key = KernelKey::new("row_sum")
        .workgroup_size(128)
        .shape("cols", cols);
    Kernel::build(&key, |k| {
        let cols = k.shape::<u32>("cols");
        let x = k.storage::<f32>("x");
        let sums = k.storage_rw::<f32>("sums");
        let row = k.let_("row", k.workgroup_id().x());
        let acc = k.var("acc", 0.0f32);
        k.for_step("c", k.local_index(), cols, 128u32, |k, c| {
            k.add_assign(&acc, x.at(&row * cols + c));
        });
        let total = k.workgroup_reduce(acc.get(), Reduce::Sum);
        let total = k.let_("total", total);
        k.if_(k.local_index().eq(0u32), |k| k.store(&sums, &row, &total));
    })
    .unwrap()
}

/// A helper that becomes a WGSL function.
#[kernel_fn]
fn silu(x: f32) -> f32 {
    x / (1.0 + exp(-x))
}

/// Comptime Rust on shapes: an unrolled loop and an `if` that decides the text.
#[kernel(workgroup_size = 64)]
fn swiglu_forward(gate: &[f32], up: &[f32], h: &mut [f32], #[shape] n: u32, #[shape] unroll: u32) {
    let base = global_index() * unroll;
    for j in 0..unroll {
        let i = base + j;
        if i < n {
            if unroll > 1 {
                h[i] = silu(gate[i]) * up[i];
            } else {
                h[i] = gate[i] * up[i];
            }
        }
    }
}

fn swiglu_forward_by_hand(n: u32, unroll: u32) -> Kernel {
    let key = KernelKey::new("swiglu_forward")
        .workgroup_size(64)
        .shape("n", n)
        .shape("unroll", unroll);
    Kernel::build(&key, |k| {
        let n = k.shape::<u32>("n");
        let unroll = k.shape::<u32>("unroll");
        let gate = k.storage::<f32>("gate");
        let up = k.storage::<f32>("up");
        let h = k.storage_rw::<f32>("h");
        let silu = |k: &mut KernelBuilder, v: Expr<f32>| {
            let f =
                k.function::<(f32,), f32>("silu", &["x"], |_, (x,)| &x / (1.0f32 + (-&x).exp()));
            f.call((v,))
        };
        let index = k.global_index();
        let base = k.let_("base", index * unroll);
        for j in 0..unroll {
            let i = k.let_("i", &base + j);
            k.if_(i.lt(n), |k| {
                if unroll > 1 {
                    let s = silu(k, gate.at(&i));
                    k.store(&h, &i, s * up.at(&i));
                } else {
                    k.store(&h, &i, gate.at(&i) * up.at(&i));
                }
            });
        }
    })
    .unwrap()
}

/// Runtime scalars as immediates, a `var` updated in a `while`, a workgroup array.
#[kernel(workgroup_size = 64, immediates)]
fn scale_rows(
    x: &mut [f32],
    #[workgroup] tile: &mut [f32; 64],
    #[runtime] alpha: f32,
    #[runtime] n: u32,
) {
    let i = global_index();
    let lid = local_index();
    tile[lid] = 0.0;
    if i < n {
        tile[lid] = x[i] * alpha;
    }
    workgroup_barrier();
    let mut k = 0u32;
    while k < 2u32 {
        k += 1u32;
    }
    if i < n {
        x[i] = tile[lid] + k as f32;
    }
}

fn scale_rows_by_hand() -> Kernel {
    let key = KernelKey::new("scale_rows")
        .workgroup_size(64)
        .features(Features::IMMEDIATES);
    Kernel::build(&key, |k| {
        let x = k.storage_rw::<f32>("x");
        let tile = k.workgroup_array::<f32>("tile", 64);
        let alpha = k.param::<f32>("alpha");
        let n = k.param::<u32>("n");
        let i = k.global_index();
        let i = k.let_("i", i);
        let lid = k.let_("lid", k.local_index());
        k.store(&tile, &lid, 0.0f32);
        k.if_(i.lt(&n), |k| k.store(&tile, &lid, x.at(&i) * &alpha));
        k.workgroup_barrier();
        let kv = k.var("k", 0u32);
        k.while_(kv.get().lt(2u32), |k| k.update(&kv, BinaryOp::Add, 1u32));
        k.if_(i.lt(&n), |k| {
            k.store(&x, &i, tile.at(&lid) + kv.get().cast::<f32>())
        });
    })
    .unwrap()
}

#[test]
fn macro_and_builder_emit_identical_wgsl() {
    let pairs = [
        (
            relu_sqr_mul_backward::build(1000).unwrap(),
            relu_sqr_mul_backward_by_hand(1000),
        ),
        (row_sum::build(300).unwrap(), row_sum_by_hand(300)),
        (
            swiglu_forward::build(500, 4).unwrap(),
            swiglu_forward_by_hand(500, 4),
        ),
        (
            swiglu_forward::build(500, 1).unwrap(),
            swiglu_forward_by_hand(500, 1),
        ),
        (scale_rows::build().unwrap(), scale_rows_by_hand()),
    ];
    for (from_macro, by_hand) in &pairs {
        assert_eq!(from_macro.key(), by_hand.key());
        assert_eq!(from_macro.wgsl(), by_hand.wgsl(), "{}", from_macro.name());
    }
    insta::assert_snapshot!("macro_relu_sqr_mul_backward", pairs[0].0.wgsl());
    insta::assert_snapshot!("macro_row_sum", pairs[1].0.wgsl());
    insta::assert_snapshot!("macro_swiglu_forward_unrolled", pairs[2].0.wgsl());
    insta::assert_snapshot!("macro_scale_rows", pairs[4].0.wgsl());
}

/// The typed launcher, positional and by name (`<Name>Launch`: two inputs of one type cannot
/// trade places, `gate` and `up` here); outputs poisoned before each.
#[test]
fn typed_launcher_runs_the_macro_kernel() {
    let g = gpu();
    let n = 777usize;
    let mut rng = Rng::new(77);
    let (gate, up, dh) = (rng.vec(n, 1.0), rng.vec(n, 1.0), rng.vec(n, 1.0));
    let (gb, ub, db) = (
        g.upload(&gate).unwrap(),
        g.upload(&up).unwrap(),
        g.upload(&dh).unwrap(),
    );
    let r = |i: usize| (gate[i] as f64).max(0.0);
    let want_gate: Vec<f64> = (0..n)
        .map(|i| dh[i] as f64 * up[i] as f64 * 2.0 * r(i))
        .collect();
    let want_up: Vec<f64> = (0..n).map(|i| dh[i] as f64 * r(i) * r(i)).collect();
    for by_name in [false, true] {
        let (mut d_gate, mut d_up) = (
            g.filled(n, f32::NAN).unwrap(),
            g.filled(n, f32::NAN).unwrap(),
        );
        let mut rec = g.recorder();
        let grid = Grid::Threads(n as u64);
        if by_name {
            // Fields in any order: each binds by its name.
            ReluSqrMulBackwardLaunch {
                up: &ub,
                gate: &gb,
                d_up: &mut d_up,
                d_hidden: &db,
                d_gate: &mut d_gate,
                n: n as u32,
            }
            .record(&mut rec, grid)
        } else {
            relu_sqr_mul_backward::launch(
                &mut rec,
                &gb,
                &ub,
                &db,
                &mut d_gate,
                &mut d_up,
                n as u32,
                grid,
            )
        }
        .unwrap();
        rec.submit().unwrap();
        assert!(max_rel_err(&d_gate.read(g).unwrap(), &want_gate, 1.0) < 1e-6);
        assert!(max_rel_err(&d_up.read(g).unwrap(), &want_up, 1.0) < 1e-6);
    }
}

#[test]
fn compile_errors_point_at_the_users_code() {
    trybuild::TestCases::new().compile_fail("tests/ui/*.rs");
}

#[kernel(workgroup_size = 64, subgroups, immediates, name = "row_max_sg")]
fn row_max(x: &[f32], out: &mut [f32], #[runtime] cols: u32) {
    let row = workgroup_id().x;
    let mut best = f32::MIN;
    for c in (local_index()..cols).step_by(64) {
        best = max(best, x[row * cols + c]);
    }
    let m = workgroup_reduce(best, Reduce::Max);
    if subgroup_invocation_id() == 0 && local_index() == 0 {
        out[row] = m;
    }
}

#[test]
fn kernel_options_reach_the_key() {
    let k = row_max::build().unwrap();
    assert_eq!(row_max::NAME, "row_max_sg");
    assert_eq!(
        k.key(),
        &KernelKey::new("row_max_sg")
            .workgroup_size(64)
            .features(Features::SUBGROUPS | Features::IMMEDIATES)
    );
    assert!(
        k.wgsl().contains("subgroupMax(best)")
            && k.wgsl().contains("var<immediate> params: Params;")
    );
    assert!(
        k.wgsl().contains("var best: f32 = -3.40282346e38f;"),
        "{}",
        k.wgsl()
    );
}

/// Reverses each block of 64 through workgroup memory; its indices are in range by
/// construction, so it is compiled without bounds checks.
#[kernel(workgroup_size = 64, assume_in_bounds)]
fn reverse_blocks(x: &[f32], y: &mut [f32], #[workgroup] tile: &mut [f32; 64], #[runtime] n: u32) {
    let i = global_index();
    let lid = local_index();
    tile[lid] = 0.0;
    if i < n {
        tile[lid] = x[i];
    }
    workgroup_barrier();
    let from = workgroup_id().x * 64u32 + 63u32 - lid;
    if i < n && from < n {
        y[i] = tile[63u32 - lid];
    }
}

#[test]
fn kernels_assuming_in_bounds_run_with_and_without_bounds_checks() {
    let k = reverse_blocks::build().unwrap();
    assert!(k.key().assumes_in_bounds());
    assert!(
        k.wgsl()
            .lines()
            .next()
            .unwrap()
            .ends_with(" assume_in_bounds")
    );
    let forced = hesper::exec::Gpu::with_options(hesper::exec::GpuOptions {
        force_bounds_checks: true,
        ..Default::default()
    })
    .unwrap();
    let n = 1000usize;
    let x = Rng::new(5).vec(n, 1.0);
    // Elements whose mirror lies past `n` (the last, partial block) stay NaN.
    let want: Vec<f64> = (0..n)
        .map(|i| {
            let from = i / 64 * 64 + 63 - i % 64;
            if from < n { x[from] as f64 } else { f64::NAN }
        })
        .collect();
    for g in [gpu(), &forced] {
        let (xb, mut yb) = (g.upload(&x).unwrap(), g.filled(n, f32::NAN).unwrap());
        let mut rec = g.recorder();
        reverse_blocks::launch(&mut rec, &xb, &mut yb, n as u32, Grid::Threads(n as u64)).unwrap();
        rec.submit().unwrap();
        let got = yb.read(g).unwrap();
        for (i, (got, want)) in got.iter().zip(&want).enumerate() {
            assert!(
                (want.is_nan() && got.is_nan()) || *got as f64 == *want,
                "element {i}: {got} against {want}"
            );
        }
    }
}

/// `y[r, c] = x[r, c] + bias[c]`, each buffer's length stated in terms of a shape and a runtime
/// scalar.
#[kernel(workgroup_size = 64)]
fn add_bias(
    #[len(rows * cols)] x: &[f32],
    #[len(cols)] bias: &[f32],
    #[len(rows * cols)] y: &mut [f32],
    #[shape] cols: u32,
    #[runtime] rows: u32,
) {
    let i = global_index();
    if i < rows * cols {
        y[i] = x[i] + bias[i % cols];
    }
}

/// The typed launcher checks each `#[len(…)]` before recording: a short buffer is an error
/// naming the kernel and binding, and nothing runs; lengths are computed in u64 (rows·cols past
/// 2^32 does not wrap into a small number).
#[test]
fn typed_launcher_checks_stated_lengths() {
    let g = gpu();
    let (rows, cols) = (5usize, 7usize);
    let mut rng = Rng::new(9);
    let (x, bias) = (rng.vec(rows * cols, 1.0), rng.vec(cols, 1.0));
    let (xb, bb) = (g.upload(&x).unwrap(), g.upload(&bias).unwrap());
    let mut y = g.filled(rows * cols, f32::NAN).unwrap();
    let short = g.upload(&x[..rows * cols - 1]).unwrap();
    let mut rec = g.recorder();
    let grid = Grid::Threads((rows * cols) as u64);
    let err = add_bias::launch(
        &mut rec,
        &short,
        &bb,
        &mut y,
        cols as u32,
        rows as u32,
        grid,
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "kernel `add_bias`, binding `x`: expected at least 35 elements (#[len(rows * cols)]), given 34 elements"
    );
    let err = add_bias::launch(&mut rec, &xb, &bb, &mut y, cols as u32, 1 << 30, grid).unwrap_err();
    assert!(
        err.to_string().contains("at least 7516192768 elements"),
        "{err}"
    );
    assert!(rec.is_empty(), "nothing recorded");
    add_bias::launch(&mut rec, &xb, &bb, &mut y, cols as u32, rows as u32, grid).unwrap();
    rec.submit().unwrap();
    let got = y.read(g).unwrap();
    for (i, got) in got.iter().enumerate() {
        assert_eq!(*got, x[i] + bias[i % cols], "element {i}");
    }
}

/// Three reductions, one under a per-invocation `if`: the error names the line of that one.
#[kernel(workgroup_size = 64)]
fn three_reductions(x: &[f32], out: &mut [f32], #[runtime] n: u32) {
    let i = global_index();
    let sum = workgroup_reduce(x[0], Reduce::Sum);
    let biggest = workgroup_reduce(x[1], Reduce::Max);
    if i < n {
        let smallest = workgroup_reduce(x[i], Reduce::Min);
        out[i] = sum + biggest + smallest;
    }
}

#[test]
fn dsl_errors_point_at_the_kernel_body() {
    let err = three_reductions::build().unwrap_err();
    let at = err.at.expect("a place");
    let source = include_str!("macro_kernels.rs");
    let line = source
        .lines()
        .position(|l| l.contains("let smallest = workgroup_reduce("))
        .unwrap() as u32
        + 1;
    let if_line = line - 1;
    assert_eq!(
        (at.location.file(), at.location.line(), at.op),
        (file!(), line, Some("workgroup_reduce"))
    );
    let message = err.to_string();
    assert!(
        message.contains(&format!("the `if` at {}:{if_line}:", file!()))
            && message.contains("depends on `i` (which depends on `local_index`)"),
        "{message}"
    );
}

/// A 2-D workgroup: a 16×16 tiled transpose through workgroup memory (the tile padded to 17
/// columns), with a barrier every invocation reaches.
#[kernel(workgroup_size = (16, 16))]
fn transpose_tiled(
    #[len(rows * cols)] x: &[f32],
    #[len(rows * cols)] y: &mut [f32],
    #[workgroup] tile: &mut [f32; 16 * 17],
    #[runtime] rows: u32,
    #[runtime] cols: u32,
) {
    let tx = local_id().x;
    let ty = local_id().y;
    let r = workgroup_id().y * 16u32 + ty;
    let c = workgroup_id().x * 16u32 + tx;
    if r < rows && c < cols {
        tile[ty * 17u32 + tx] = x[r * cols + c];
    }
    workgroup_barrier();
    // Output row = input column: the workgroup's tile, read across.
    let out_r = workgroup_id().x * 16u32 + ty;
    let out_c = workgroup_id().y * 16u32 + tx;
    if out_r < cols && out_c < rows {
        y[out_r * rows + out_c] = tile[tx * 17u32 + ty];
    }
}

/// `row_loop`, `Reduce::Min`/`Max`, and one kernel for both subgroup variants.
#[kernel(workgroup_size = 64, subgroups = use_subgroups)]
fn row_min_max(
    #[len(rows * cols)] x: &[f32],
    #[len(rows)] lo: &mut [f32],
    #[len(rows)] hi: &mut [f32],
    #[runtime] rows: u32,
    #[shape] cols: u32,
    #[shape] use_subgroups: bool,
) {
    let row = workgroup_index();
    if row < rows {
        let mut least = f32::MAX;
        let mut most = f32::MIN;
        for c in row_loop(cols) {
            let v = x[row * cols + c];
            least = min(least, v);
            most = max(most, v);
        }
        let smallest = workgroup_reduce(least, Reduce::Min);
        let largest = workgroup_reduce(most, Reduce::Max);
        if local_index() == 0 {
            lo[row] = smallest;
            hi[row] = largest;
        }
    }
}

/// `grid_stride`: three workgroups cover any `n`.
#[kernel(workgroup_size = 128)]
fn scale_all(#[len(n)] x: &mut [f32], #[runtime] a: f32, #[runtime] n: u32) {
    for i in grid_stride(n) {
        x[i] = x[i] * a;
    }
}

#[test]
fn macro_workgroup_shapes_loops_and_subgroup_variants_run() {
    let g = gpu();
    let mut rng = Rng::new(2026);

    let (rows, cols) = (37usize, 53usize);
    let x = rng.vec(rows * cols, 1.0);
    let xb = g.upload(&x).unwrap();
    let mut y = g.filled(rows * cols, f32::NAN).unwrap();
    let k = transpose_tiled::build().unwrap();
    assert_eq!(k.key().wg_size(), [16, 16, 1]);
    let mut rec = g.recorder();
    let groups = [cols.div_ceil(16) as u32, rows.div_ceil(16) as u32, 1];
    transpose_tiled::launch(
        &mut rec,
        &xb,
        &mut y,
        rows as u32,
        cols as u32,
        Grid::Workgroups(groups),
    )
    .unwrap();
    rec.submit().unwrap();
    let want: Vec<f32> = (0..cols * rows)
        .map(|i| x[(i % rows) * cols + i / rows])
        .collect();
    assert_eq!(y.read(g).unwrap(), want);

    let (rows, cols) = (70usize, 300usize);
    let x = rng.vec(rows * cols, 1.0);
    let xb = g.upload(&x).unwrap();
    let mut variants = vec![false];
    if g.kernel_features().contains(Features::SUBGROUPS) {
        variants.push(true);
    }
    let with_sg = row_min_max::build(cols as u32, true).unwrap();
    let without = row_min_max::build(cols as u32, false).unwrap();
    assert!(with_sg.wgsl().contains("subgroupMin(") && !without.wgsl().contains("subgroupM"));
    for use_subgroups in variants {
        let (mut lo, mut hi) = (
            g.filled(rows, f32::NAN).unwrap(),
            g.filled(rows, f32::NAN).unwrap(),
        );
        let mut rec = g.recorder();
        row_min_max::launch(
            &mut rec,
            &xb,
            &mut lo,
            &mut hi,
            rows as u32,
            cols as u32,
            use_subgroups,
            Grid::WorkgroupPerItem(rows as u64),
        )
        .unwrap();
        rec.submit().unwrap();
        let row = |r: usize| &x[r * cols..(r + 1) * cols];
        let want_lo: Vec<f32> = (0..rows)
            .map(|r| row(r).iter().copied().fold(f32::MAX, f32::min))
            .collect();
        let want_hi: Vec<f32> = (0..rows)
            .map(|r| row(r).iter().copied().fold(f32::MIN, f32::max))
            .collect();
        assert_eq!(lo.read(g).unwrap(), want_lo, "subgroups: {use_subgroups}");
        assert_eq!(hi.read(g).unwrap(), want_hi, "subgroups: {use_subgroups}");
    }

    let n = 10_000usize;
    let x = rng.vec(n, 1.0);
    let mut xb = g.upload(&x).unwrap();
    let mut rec = g.recorder();
    scale_all::launch(
        &mut rec,
        &mut xb,
        -3.0,
        n as u32,
        Grid::Workgroups([3, 1, 1]),
    )
    .unwrap();
    rec.submit().unwrap();
    let want: Vec<f32> = x.iter().map(|v| v * -3.0).collect();
    assert_eq!(xb.read(g).unwrap(), want);
}

/// Invocation 0 decides for its workgroup whether any value passes `limit`;
/// `workgroup_uniform_load` hands every invocation that decision as a uniform value, and a
/// branch on it holds a barrier: each output is then its neighbour's value halved, through
/// the tile.
#[kernel(workgroup_size = 64)]
fn halve_swapped_if_over(
    x: &[f32],
    y: &mut [f32],
    #[workgroup] values: &mut [f32; 64],
    #[workgroup] decision: &mut [u32; 1],
    #[runtime] limit: f32,
) {
    let lid = local_index();
    let i = global_index();
    let v = x[i];
    values[lid] = v;
    workgroup_barrier();
    if lid == 0u32 {
        let mut top = f32::MIN;
        let mut j = 0u32;
        while j < 64u32 {
            top = max(top, values[j]);
            j += 1u32;
        }
        decision[0u32] = select(top > limit, 1u32, 0u32);
    }
    let over = workgroup_uniform_load(&decision[0u32]);
    let mut out = v;
    if over == 1u32 {
        values[lid] = v * 0.5;
        workgroup_barrier();
        out = values[lid ^ 1u32];
    }
    y[i] = out;
}

#[test]
fn a_uniform_load_in_a_macro_kernel_guards_a_barrier() {
    let kernel = halve_swapped_if_over::build().unwrap();
    assert!(
        kernel
            .wgsl()
            .contains("let over = workgroupUniformLoad(&decision[0u]);"),
        "{}",
        kernel.wgsl()
    );
    let g = gpu();
    let mut x = Rng::new(31).vec(64 * 4, 1.0);
    x[2 * 64 + 5] = 4.0; // workgroup 2 passes the limit
    let limit = 2.0f32;
    let xb = g.upload(&x).unwrap();
    let mut y = g.filled(x.len(), f32::NAN).unwrap();
    let mut rec = g.recorder();
    let grid = Grid::Threads(x.len() as u64);
    halve_swapped_if_over::launch(&mut rec, &xb, &mut y, limit, grid).unwrap();
    rec.submit().unwrap();
    let got = y.read(g).unwrap();
    for (i, got) in got.iter().enumerate() {
        let over = x[i / 64 * 64..][..64].iter().any(|v| *v > limit);
        let want = if over { x[i ^ 1] * 0.5 } else { x[i] };
        assert_eq!(*got, want, "element {i}");
    }
}
