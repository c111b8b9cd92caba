//! `gemv`: `y[t, j] (+)= Σ_c x[t, c]·W[j, c]` for a few rows `t` — decoding's one token, where
//! the tiled GEMM's `bm`-row tiles would compute 63 rows of nothing and run one workgroup per
//! 64 outputs (on the H200: 52 µs for a 576 × 576 weight, 25 GB/s).
//!
//! One workgroup per output `(t, j)`: its invocations stride over the depth (as `vec4`s when it
//! is a multiple of 4), so that neighbours read neighbouring elements of the weight's row, and
//! `workgroup_reduce` adds their sums. The depth is in the key; `n` and the row count are
//! runtime values, so the projections of one width share one kernel.
//!
//! `gemv_lora` adds a LoRA adapter in the same launch, `y (+)= x·Wᵀ + s·(x·Aᵀ)·Bᵀ`: each
//! workgroup also takes the `r` dot products `h = x·Aᵀ` of its row in the same stride (the
//! adapter's `A`, `r·k` words, comes out of L2 for every output) and adds `s·B[j, ..]·h`. That is
//! one launch a projection rather than three (decoding is launch-bound), and `h` is not kept.

use hesper_dsl::prelude::*;
use hesper_exec::{Args, ExecError, GpuBuffer, Grid, Recorder};

use super::offset;
use crate::{expect_len, expect_loops, expect_u32};

/// `Ok` when the workgroup of `key` strides over a row of `depth` (`vec4`s where it allows)
/// within the device's loop limit.
fn expect_row_loop(rec: &Recorder<'_>, key: &KernelKey, depth: u32) -> Result<(), ExecError> {
    let width = if depth.is_multiple_of(4) {
        depth / 4
    } else {
        depth
    };
    let iterations = u64::from(width.div_ceil(key.invocations().max(1)));
    let kernel = key.name();
    expect_loops(
        rec.gpu(),
        kernel,
        || format!("depth k = {depth}"),
        iterations,
    )
}

/// The most rows [`super::execute_gemm`] gives to `gemv` rather than the tiled GEMM, and
/// [`execute_gemv_lora`] takes.
pub const MAX_ROWS: usize = 4;
/// The largest rank [`execute_gemv_lora`] takes (an invocation holds `r` sums).
pub const MAX_RANK: usize = 32;

const NAME: &str = "gemv";
const NAME_LORA: &str = "gemv_lora";

pub(super) fn key(depth: u32, accumulate: bool, features: Features) -> KernelKey {
    KernelKey::new(NAME)
        .workgroup_size(invocations(depth))
        .shape("depth", depth)
        .shape("accumulate", accumulate)
        .features(features & Features::SUBGROUPS)
}

/// `gemv_lora`'s key: `gemv`'s and the rank, at most 128 invocations and few enough that its
/// `r + 1` reductions (a float of workgroup memory per invocation each) fit WebGPU's 16 KiB.
fn lora_key(depth: u32, rank: u32, accumulate: bool, features: Features) -> KernelKey {
    let fits = (4096 / (rank + 1) / 32 * 32).max(32);
    KernelKey::new(NAME_LORA)
        .workgroup_size(invocations(depth).min(128).min(fits))
        .shape("depth", depth)
        .shape("rank", rank)
        .shape("accumulate", accumulate)
        .features(features & Features::SUBGROUPS)
}

/// Three elements (`vec4`s where the depth allows) per invocation at the widths of small models
/// (576: 48 invocations of 3 vec4s), at least one NVIDIA warp and at most 256.
fn invocations(depth: u32) -> u32 {
    let lanes = if depth.is_multiple_of(4) { 4 } else { 1 };
    (depth / lanes)
        .div_ceil(3)
        .next_multiple_of(32)
        .clamp(32, 256)
}

pub(super) fn body(k: &mut KernelBuilder) {
    by_width(k, 0);
}

fn lora_body(k: &mut KernelBuilder) {
    let rank = k.shape::<u32>("rank");
    by_width(k, rank);
}

fn by_width(k: &mut KernelBuilder, rank: u32) {
    if k.shape::<u32>("depth").is_multiple_of(4) {
        body_with::<Vec4<f32>>(k, 4, |v| v.x() + v.y() + v.z() + v.w(), rank);
    } else {
        body_with::<f32>(k, 1, |v| v, rank);
    }
}

/// `rank` 0: `gemv`; else `gemv_lora` with an adapter of that rank.
fn body_with<E>(k: &mut KernelBuilder, lanes: u32, lane_sum: fn(Expr<E>) -> Expr<f32>, rank: u32)
where
    E: hesper_dsl::Reducible,
    Expr<E>: std::ops::Mul<Expr<E>, Output = Expr<E>>,
{
    let depth = k.shape::<u32>("depth");
    let accumulate = k.shape::<bool>("accumulate");
    let width = depth / lanes;
    let x = k.storage::<E>("x");
    let w = k.storage::<E>("w");
    let lora = (rank > 0).then(|| (k.storage::<E>("a"), k.storage::<f32>("b")));
    let y = k.storage_rw::<f32>("y");
    let n = k.param::<u32>("n");
    let rows = k.param::<u32>("rows");
    let scale = (rank > 0).then(|| k.param::<f32>("scale"));
    let item = k.let_("item", k.workgroup_index());
    // The whole workgroup leaves together (one output): the reductions' barriers stay uniform.
    k.if_(item.ge(&rows * &n), |k| k.return_());
    let x_row = k.let_("x_row", &item / &n * width);
    let j = k.let_("j", &item % &n);
    let w_row = k.let_("w_row", &j * width);
    let acc = k.var("acc", E::zero());
    let h_acc: Vec<_> = (0..rank).map(|_| k.var("h_acc", E::zero())).collect();
    k.row_loop(width, |k, c| {
        let xc = k.let_("xc", x.at(&x_row + &c));
        k.add_assign(&acc, xc.clone() * w.at(&w_row + &c));
        if let Some((a, _)) = &lora {
            for (r, h) in h_acc.iter().enumerate() {
                k.add_assign(h, xc.clone() * a.at(offset(&c, r as u32 * width)));
            }
        }
    });
    let mut total = k.workgroup_reduce(lane_sum(acc.get()), Reduce::Sum);
    if let (Some((_, b)), Some(scale)) = (&lora, scale) {
        let hs: Vec<Expr<f32>> = h_acc
            .iter()
            .map(|h| k.workgroup_reduce(lane_sum(h.get()), Reduce::Sum))
            .collect();
        let b_row = k.let_("b_row", &j * rank);
        let up = hs
            .into_iter()
            .enumerate()
            .map(|(r, h)| h * b.at(offset(&b_row, r as u32)))
            .reduce(|s, t| s + t)
            .expect("rank > 0");
        total = k.let_("total", total + scale * up);
    }
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
    expect_row_loop(rec, &key, k)?;
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

/// A LoRA adapter of a projection: `A: [r, k]`, `B: [n, r]`, its rank `r` and scale `s`.
pub struct Adapter<'a> {
    pub a: &'a GpuBuffer<f32>,
    pub b: &'a GpuBuffer<f32>,
    pub rank: usize,
    pub scale: f32,
}

/// `y (+)= x·Wᵀ + s·(x·Aᵀ)·Bᵀ` over `m ≤ MAX_ROWS` rows in one launch (`x: [m, k]`,
/// `w: [n, k]`, `y: [m, n]`, a rank of 1 to [`MAX_RANK`]): a LoRA projection of decoding's one
/// token, without the `x·Aᵀ` the backward would need.
pub fn execute_gemv_lora(
    rec: &mut Recorder<'_>,
    (x, w): (&GpuBuffer<f32>, &GpuBuffer<f32>),
    adapter: Adapter<'_>,
    y: &mut GpuBuffer<f32>,
    (m, n, k): (usize, usize, usize),
    accumulate: bool,
) -> Result<(), ExecError> {
    let name = NAME_LORA;
    let Adapter { a, b, rank, scale } = adapter;
    if !(1..=MAX_ROWS).contains(&m) || !(1..=MAX_RANK).contains(&rank) || n == 0 || k == 0 {
        return Err(ExecError::Dispatch {
            kernel: name.into(),
            what: format!("m = {m} rows, n = {n}, k = {k}, rank {rank}"),
            why: format!(
                "it takes 1 to {MAX_ROWS} rows, a rank of 1 to {MAX_RANK} and n, k above 0"
            ),
        });
    }
    expect_u32(name, "n·k", n * k)?;
    expect_u32(name, "m·n", m * n)?;
    expect_len(name, "x", x, m * k, "[m, k]")?;
    expect_len(name, "w", w, n * k, "[n, k]")?;
    expect_len(name, "a", a, rank * k, "[rank, k]")?;
    expect_len(name, "b", b, n * rank, "[n, rank]")?;
    expect_len(name, "y", y, m * n, "[m, n]")?;
    let (m, n, k, rank) = (m as u32, n as u32, k as u32, rank as u32);
    let key = lora_key(k, rank, accumulate, rec.gpu().kernel_features());
    expect_row_loop(rec, &key, k)?;
    let kernel = rec.gpu().kernel(&key, lora_body)?;
    let args = if k.is_multiple_of(4) {
        Args::new()
            .buffer_vec4("x", x)
            .buffer_vec4("w", w)
            .buffer_vec4("a", a)
    } else {
        Args::new().buffer("x", x).buffer("w", w).buffer("a", a)
    };
    let args = args
        .buffer("b", b)
        .buffer("y", y)
        .param("n", n)
        .param("rows", m)
        .param("scale", scale);
    rec.launch(
        &kernel,
        &args,
        Grid::WorkgroupPerItem(u64::from(m) * u64::from(n)),
    )
}

/// The WGSL of `gemv` and `gemv_lora` at small shapes (with subgroups first, as the catalog's
/// defaults), for snapshots and review.
pub(super) fn kernels() -> Result<Vec<Kernel>, hesper_dsl::DslError> {
    Ok(vec![
        Kernel::build(&key(36, false, Features::SUBGROUPS), body)?,
        Kernel::build(&key(29, true, Features::NONE), body)?,
        Kernel::build(&lora_key(36, 2, false, Features::SUBGROUPS), lora_body)?,
        Kernel::build(&lora_key(29, 3, true, Features::NONE), lora_body)?,
    ])
}

/// `gemv` (`rank` 0) or `gemv_lora` at any depth and rank, within `limits`, for
/// [`crate::catalog`].
pub(crate) fn build(
    (depth, rank): (u32, u32),
    accumulate: bool,
    features: Features,
    limits: &Limits,
) -> Result<Kernel, hesper_dsl::DslError> {
    match rank {
        0 => Kernel::build_with_limits(&key(depth, accumulate, features), limits, body),
        r => {
            let key = lora_key(depth, r, accumulate, features);
            Kernel::build_with_limits(&key, limits, lora_body)
        }
    }
}
