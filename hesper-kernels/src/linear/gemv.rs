//! `gemv`: `y[t, j] (+)= Σ_c x[t, c]·W[j, c]` for a few rows `t` — decoding's one token, where
//! the tiled GEMM's `bm`-row tiles would compute 63 rows of nothing and run one workgroup per
//! 64 outputs (on the H200: 52 µs for a 576 × 576 weight, 25 GB/s).
//!
//! One workgroup per output `(t, j)`: its invocations stride over the depth (as `vec4`s when it
//! is a multiple of 4), so that neighbours read neighbouring elements of the weight's row, and
//! `workgroup_reduce` adds their sums. The depth is in the key; `n` and the row count are
//! runtime values, so the projections of one width share one kernel.

use hesper_dsl::prelude::*;
use hesper_exec::{Args, ExecError, GpuBuffer, Grid, Recorder};

/// The most rows [`super::execute_gemm`] gives to `gemv` rather than the tiled GEMM.
pub const MAX_ROWS: usize = 4;

pub(super) const NAME: &str = "gemv";

/// Four elements per invocation and step at the widths of small models (576: 48 invocations of
/// 3 vec4s), at least one NVIDIA warp and at most 256.
pub(super) fn key(depth: u32, accumulate: bool, features: Features) -> KernelKey {
    let lanes = if depth.is_multiple_of(4) { 4 } else { 1 };
    let wg = (depth / lanes)
        .div_ceil(3)
        .next_multiple_of(32)
        .clamp(32, 256);
    KernelKey::new(NAME)
        .workgroup_size(wg)
        .shape("depth", depth)
        .shape("accumulate", accumulate)
        .features(features & Features::SUBGROUPS)
}

pub(super) fn body(k: &mut KernelBuilder) {
    if k.shape::<u32>("depth").is_multiple_of(4) {
        body_with::<Vec4<f32>>(k, 4, |v| v.x() + v.y() + v.z() + v.w());
    } else {
        body_with::<f32>(k, 1, |v| v);
    }
}

fn body_with<E>(k: &mut KernelBuilder, lanes: u32, lane_sum: fn(Expr<E>) -> Expr<f32>)
where
    E: hesper_dsl::Reducible,
    Expr<E>: std::ops::Mul<Expr<E>, Output = Expr<E>>,
{
    let depth = k.shape::<u32>("depth");
    let accumulate = k.shape::<bool>("accumulate");
    let width = depth / lanes;
    let x = k.storage::<E>("x");
    let w = k.storage::<E>("w");
    let y = k.storage_rw::<f32>("y");
    let n = k.param::<u32>("n");
    let rows = k.param::<u32>("rows");
    let item = k.let_("item", k.workgroup_index());
    // The whole workgroup leaves together (one output): the reduction's barriers stay uniform.
    k.if_(item.ge(&rows * &n), |k| k.return_());
    let x_row = k.let_("x_row", &item / &n * width);
    let w_row = k.let_("w_row", &item % &n * width);
    let acc = k.var("acc", E::zero());
    k.row_loop(width, |k, c| {
        k.add_assign(&acc, x.at(&x_row + &c) * w.at(&w_row + &c));
    });
    let total = k.workgroup_reduce(lane_sum(acc.get()), Reduce::Sum);
    k.if_(k.local_index().eq(0u32), |k| {
        if accumulate {
            k.store_op(&y, &item, BinaryOp::Add, total);
        } else {
            k.store(&y, &item, total);
        }
    });
}

/// Record `y (+)= x·Wᵀ` over `m` rows (`x: [m, k]`, `w: [n, k]`, `y: [m, n]`, lengths checked
/// by the caller; `m`, `n` and `k` non-zero and within `u32`).
pub(super) fn record(
    rec: &mut Recorder<'_>,
    (m, n, k): (u32, u32, u32),
    (x, w, y): (&GpuBuffer<f32>, &GpuBuffer<f32>, &mut GpuBuffer<f32>),
    accumulate: bool,
) -> Result<(), ExecError> {
    let key = key(k, accumulate, rec.gpu().kernel_features());
    let kernel = rec.gpu().kernel(&key, body)?;
    let args = if k.is_multiple_of(4) {
        Args::new().buffer_vec4("x", x).buffer_vec4("w", w)
    } else {
        Args::new().buffer("x", x).buffer("w", w)
    };
    let args = args.buffer("y", y).param("n", n).param("rows", m);
    rec.launch(
        &kernel,
        &args,
        Grid::WorkgroupPerItem(u64::from(m) * u64::from(n)),
    )
}

/// `gemv` at any depth, within `limits`, for [`crate::catalog`].
pub(crate) fn build(
    depth: u32,
    accumulate: bool,
    features: Features,
    limits: &Limits,
) -> Result<Kernel, hesper_dsl::DslError> {
    Kernel::build_with_limits(&key(depth, accumulate, features), limits, body)
}
