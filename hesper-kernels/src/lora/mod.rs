//! LoRA on one projection `W` (KERNELS.md): `A` is `[r, in]`, `B` is `[out, r]`, scale `s`.
//!
//! Forward: `h = x·Aᵀ` (`[T, r]`, saved), `y += s·h·Bᵀ`.
//! Backward, contracting through `r` first (never forming `B·A`), in Hesper's names:
//! - `grad_dh`:    `dh = dy·B`                 `[T, r]`
//! - `grad_b`:     `dB = s·dyᵀ·h`              `[out, r]`
//! - `grad_a`:     `dA = s·dhᵀ·x`              `[r, in]`
//! - `input_grad`: `dx += s·dh·A`              `[T, in]` (added: `dx` also gets `dy·W`)
//!
//! Every product here is a stream over a `[T, width]` matrix with a small `r` beside it, so each
//! kernel keeps its `r`-sized state in registers and reads the big operand once, four columns
//! at a time when the width allows:
//! - `lora_down_subgroups` / `lora_down`: the products into `r` (`x·Aᵀ`, `dy·B`), a reduction
//!   along each row: with subgroups of one known size, a butterfly of shuffles over each
//!   subgroup's columns; else a slice of rows staged transposed in workgroup memory;
//! - `lora_up`: the products out of `r` (`s·h·Bᵀ`, `s·dh·A`), which read and write each output
//!   once;
//! - the weight gradients `G(j, k) = scale·Σ_t u[t, j]·v[t, k]` (`dB`, `dA`), summed over tokens
//!   in two passes: partials per block of tokens (256, fewer where that leaves under 64
//!   blocks), then a sum over blocks (no float atomics).
//!
//! Ranks past 32 (more sums than registers) go through the tiled GEMM ([`crate::linear`]).
//!
//! One file per kernel family, each kernel's block sizes a tile value in its key: `down.rs`
//! (`lora_down`, and the routing of the products into `r`), `subgroups.rs`
//! (`lora_down_subgroups`), `up.rs` (`lora_up`), `weight_grad.rs` (the two passes); this file
//! holds the `execute_*` functions, which check every buffer and route each product, and the
//! helpers the kernels share; `reference.rs` the f64 references.

use hesper_dsl::ReadBuffer;
use hesper_dsl::prelude::*;
use hesper_exec::{Args, ExecError, GpuBuffer, Recorder};

use crate::{Columns, Len, expect_len, expect_rows, expect_u32};

mod down;
mod epilogue;
pub mod reference;
mod subgroups;
mod up;
mod weight_grad;

pub use epilogue::{LoraUp, LoraUps, MAX_FUSED_RANK, MAX_UPS, UpWeight};
use weight_grad::Gradient;
pub use weight_grad::lora_scratch_len;

/// How a weight is laid out relative to the `r` axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Layout {
    /// `A: [r, n]` — element `(j, k)` at `k·n + j`.
    RankMajor,
    /// `B: [n, r]` — element `(j, k)` at `j·r + k`.
    RankMinor,
}

impl Layout {
    /// The layout as a kernel-key shape.
    fn is_rank_minor(self) -> bool {
        self == Layout::RankMinor
    }
    fn from_shape(rank_minor: bool) -> Self {
        if rank_minor {
            Layout::RankMinor
        } else {
            Layout::RankMajor
        }
    }
    /// Index of element `(j, k)` of an `n × r` weight.
    fn at(self, j: &Expr<u32>, k: impl IntoExpr<u32>, n: u32, r: u32) -> Expr<u32> {
        match self {
            Layout::RankMajor => k.into_expr() * n + j,
            Layout::RankMinor => j * r + k.into_expr(),
        }
    }
}

/// Whether rows of width `n` are read as vec4s.
fn wide(n: u32) -> bool {
    n.is_multiple_of(4)
}

/// The wide elements of a row of width `n`: vec4s, or single floats.
fn row_elements(n: u32) -> u32 {
    if wide(n) { n / 4 } else { n }
}

/// Rows of `r` values (`h`, `dh`: `[T, r]`), read as `r/4` vec4s when `r` allows.
enum RankRows {
    Vec4(ReadBuffer<Vec4<f32>>),
    Scalar(ReadBuffer<f32>),
}

impl RankRows {
    fn declare(k: &mut KernelBuilder, name: &str, r: u32) -> Self {
        if wide(r) {
            RankRows::Vec4(k.storage(name))
        } else {
            RankRows::Scalar(k.storage(name))
        }
    }
    /// The `r` values of row `t`, bound to names.
    fn row(&self, k: &mut KernelBuilder, t: &Expr<u32>, r: u32) -> Vec<Expr<f32>> {
        match self {
            RankRows::Vec4(v) => (0..r / 4)
                .flat_map(|q| {
                    let quad = k.let_("v", v.at(t * (r / 4) + q));
                    <Vec4<f32> as Columns>::lanes(&quad)
                })
                .collect(),
            RankRows::Scalar(v) => (0..r).map(|kk| k.let_("v", v.at(t * r + kk))).collect(),
        }
    }
}

fn bind_rank_rows<'a>(args: Args<'a>, name: &'a str, buf: &'a GpuBuffer<f32>, r: u32) -> Args<'a> {
    if wide(r) {
        args.buffer_vec4(name, buf)
    } else {
        args.buffer(name, buf)
    }
}

fn bind_columns<'a>(args: Args<'a>, name: &'a str, buf: &'a GpuBuffer<f32>, n: u32) -> Args<'a> {
    if wide(n) {
        args.buffer_vec4(name, buf)
    } else {
        args.buffer(name, buf)
    }
}

/// Ranks up to this go through `lora_down` and `lora_up` (their sums and weights live in
/// registers); larger ones through the tiled GEMM.
const MAX_RANK: u32 = 32;

/// The key of kernel `name` over rows `n` wide, with a rank-`r` weight laid out as `layout` (the
/// kernel's tile adds its workgroup size and block sizes).
fn adapter_key(name: &str, n: u32, r: u32, layout: Layout) -> KernelKey {
    KernelKey::new(name)
        .shape("n", n)
        .shape("rank", r)
        .shape("rank_minor", layout.is_rank_minor())
}

/// The row width `n`, rank `r` and weight layout of an [`adapter_key`], in a kernel's body.
fn adapter_shapes(k: &mut KernelBuilder) -> (u32, u32, Layout) {
    let (n, r) = (k.shape::<u32>("n"), k.shape::<u32>("rank"));
    (n, r, Layout::from_shape(k.shape::<bool>("rank_minor")))
}

/// Builds `body` for the row width `n` of the key: four columns an invocation when it allows.
fn by_width(k: &mut KernelBuilder, body: fn(&mut KernelBuilder), narrow: fn(&mut KernelBuilder)) {
    if wide(k.shape::<u32>("n")) {
        body(k)
    } else {
        narrow(k)
    }
}

/// The WGSL of this module's kernels at small shapes, for snapshots and review (the key of
/// each is the first line of its text).
pub fn kernels() -> Result<Vec<Kernel>, hesper_dsl::DslError> {
    let mut kernels = down::kernels()?;
    kernels.extend(subgroups::kernels()?);
    kernels.extend(up::kernels()?);
    kernels.extend(weight_grad::kernels()?);
    Ok(kernels)
}

/// Each kernel of this module at any shape and tile, for [`crate::catalog`].
pub(crate) mod build {
    pub(crate) use super::down::build_at as lora_down;
    pub(crate) use super::subgroups::build_at as lora_down_subgroups;
    pub(crate) use super::up::build_at as lora_up;
    pub(crate) use super::weight_grad::{
        partials_at as lora_weight_grad_partials, sum_at as lora_weight_grad_sum,
    };
}

/// `Ok` for a row width the kernels take (a positive one).
fn check_width(n: u32) -> Result<(), crate::catalog::Failure> {
    if n > 0 {
        return Ok(());
    }
    Err(crate::catalog::Failure::rule(
        "n = 0".into(),
        "the row width must be positive".into(),
    ))
}

/// `Ok` for a rank `lora_down`, `lora_down_subgroups` and `lora_up` take (`1 ..= MAX_RANK`:
/// larger ones go through the GEMM).
fn check_rank(r: u32) -> Result<(), crate::catalog::Failure> {
    if (1..=MAX_RANK).contains(&r) {
        return Ok(());
    }
    Err(crate::catalog::Failure::rule(
        format!("rank = {r}"),
        format!("the rank must be 1 to {MAX_RANK} (larger ranks go through the GEMM)"),
    ))
}

/// Rows of a `[rows, width]` buffer, checked (`what` names the width).
fn rows(
    kernel: &str,
    binding: &str,
    buf: &GpuBuffer<f32>,
    width: usize,
    what: &str,
) -> Result<u32, ExecError> {
    let rows = expect_rows(kernel, binding, buf, width, what)?;
    expect_u32(kernel, binding, rows)
}

/// `r` and the width of an adapter matrix (`A: [r, in]` or `B: [out, r]`), checked.
fn adapter(
    kernel: &str,
    binding: &str,
    buf: &GpuBuffer<f32>,
    rank: usize,
) -> Result<(u32, u32), ExecError> {
    expect_len(kernel, binding, buf, Len::Multiple(rank), "the rank")?;
    Ok((
        expect_u32(kernel, "rank", rank)?,
        expect_u32(kernel, binding, buf.len() / rank)?,
    ))
}

/// LoRA forward of one projection: `h = x·Aᵀ` (`[T, r]`, saved for the backward) and
/// `y += s·h·Bᵀ` (added to the frozen projection's output already in `y`).
#[allow(clippy::too_many_arguments)]
pub fn execute_lora_forward(
    rec: &mut Recorder<'_>,
    x: &GpuBuffer<f32>,
    a: &GpuBuffer<f32>,
    b: &GpuBuffer<f32>,
    rank: usize,
    scale: f32,
    h: &mut GpuBuffer<f32>,
    y: &mut GpuBuffer<f32>,
) -> Result<(), ExecError> {
    let name = "lora_forward";
    let (r, input) = adapter(name, "a", a, rank)?;
    let (_, output) = adapter(name, "b", b, rank)?;
    let t = rows(name, "x", x, input as usize, "in")?;
    expect_len(name, "h", h, t as usize * r as usize, "[tokens, rank]")?;
    expect_len(name, "y", y, t as usize * output as usize, "[tokens, out]")?;
    if t == 0 {
        return Ok(());
    }
    execute_lora_down(rec, x, a, rank, h)?;
    up::project_up(rec, (h, b, y), (t, output, r), Layout::RankMinor, scale)
}

/// `y += s·h·Bᵀ` alone (`h: [T, r]`, `B: [out, r]`, `y: [T, out]`): the LoRA forward's product
/// out of `r`, for an `h` computed before ([`execute_lora_down_pair`]).
pub fn execute_lora_up(
    rec: &mut Recorder<'_>,
    h: &GpuBuffer<f32>,
    b: &GpuBuffer<f32>,
    rank: usize,
    scale: f32,
    y: &mut GpuBuffer<f32>,
) -> Result<(), ExecError> {
    let name = "lora_up";
    let (r, output) = adapter(name, "b", b, rank)?;
    let t = rows(name, "h", h, r as usize, "rank")?;
    expect_len(name, "y", y, t as usize * output as usize, "[tokens, out]")?;
    if t == 0 {
        return Ok(());
    }
    up::project_up(rec, (h, b, y), (t, output, r), Layout::RankMinor, scale)
}

/// `h = x·Aᵀ` (`[T, r]`) alone: the LoRA forward's product into `r`, for a frozen projection
/// whose GEMM adds `s·h·Bᵀ` itself ([`LoraUp`]).
pub fn execute_lora_down(
    rec: &mut Recorder<'_>,
    x: &GpuBuffer<f32>,
    a: &GpuBuffer<f32>,
    rank: usize,
    h: &mut GpuBuffer<f32>,
) -> Result<(), ExecError> {
    into_rank(rec, &LORA_DOWN, (x, a, h), rank)
}

/// `h1 = x·A1ᵀ` and `h2 = x·A2ᵀ` (each `[T, r]`): the products into `r` of two adapters on
/// the same input (a layer's query and value projections), read in one pass over `x` and one
/// launch where the device's subgroups allow (`lora_down_subgroups` with `pair`, `2r ≤ 32`),
/// else [`execute_lora_down`] for each.
pub fn execute_lora_down_pair(
    rec: &mut Recorder<'_>,
    x: &GpuBuffer<f32>,
    (a1, a2): (&GpuBuffer<f32>, &GpuBuffer<f32>),
    rank: usize,
    (h1, h2): (&mut GpuBuffer<f32>, &mut GpuBuffer<f32>),
) -> Result<(), ExecError> {
    let name = "lora_down_pair";
    let (r, n) = adapter(name, "a1", a1, rank)?;
    let (_, n2) = adapter(name, "a2", a2, rank)?;
    if n2 != n {
        return Err(ExecError::Dispatch {
            kernel: name.into(),
            what: format!("a1 of {n} inputs and a2 of {n2}"),
            why: "both adapters read the same x: `[rank, in]` each, the same `in`".into(),
        });
    }
    let t = rows(name, "x", x, n as usize, "in")?;
    for (binding, h) in [("h1", &*h1), ("h2", &*h2)] {
        expect_len(name, binding, h, t as usize * r as usize, "[tokens, rank]")?;
    }
    if t == 0 {
        return Ok(());
    }
    down::project_pair(
        rec,
        (x, (a1, a2), (h1, h2)),
        None,
        (t, n, r),
        Layout::RankMajor,
    )
}

/// `dh = dy·B` (`[T, r]`; Hesper's gradDh = Bᵀ·dy per token).
pub fn execute_grad_dh(
    rec: &mut Recorder<'_>,
    dy: &GpuBuffer<f32>,
    b: &GpuBuffer<f32>,
    rank: usize,
    dh: &mut GpuBuffer<f32>,
) -> Result<(), ExecError> {
    into_rank(rec, &GRAD_DH, (dy, b, dh), rank)
}

/// `dh1 = dy1·B1` and `dh2 = dy2·B2` (each `[T, r]`; `B1: [out1, r]`, `B2: [out2, r]`, the
/// same `T` and `r`, the widths free): the products into `r` of two adapters' weight
/// backward (a layer's query and value projections) in one launch where the device's
/// subgroups allow (`lora_down_subgroups` with a second input, `2r ≤ 32`, both widths
/// multiples of 4 or neither), else [`execute_grad_dh`] for each.
pub fn execute_grad_dh_pair(
    rec: &mut Recorder<'_>,
    (dy1, dy2): (&GpuBuffer<f32>, &GpuBuffer<f32>),
    (b1, b2): (&GpuBuffer<f32>, &GpuBuffer<f32>),
    rank: usize,
    (dh1, dh2): (&mut GpuBuffer<f32>, &mut GpuBuffer<f32>),
) -> Result<(), ExecError> {
    let name = "grad_dh_pair";
    let (r, n1) = adapter(name, "b1", b1, rank)?;
    let (_, n2) = adapter(name, "b2", b2, rank)?;
    let t = rows(name, "dy1", dy1, n1 as usize, "out1")?;
    let t2 = rows(name, "dy2", dy2, n2 as usize, "out2")?;
    if t2 != t {
        return Err(ExecError::Dispatch {
            kernel: name.into(),
            what: format!("dy1 of {t} tokens and dy2 of {t2}"),
            why: "both adapters' gradients are of the same tokens".into(),
        });
    }
    for (binding, dh) in [("dh1", &*dh1), ("dh2", &*dh2)] {
        expect_len(name, binding, dh, t as usize * r as usize, "[tokens, rank]")?;
    }
    if t == 0 {
        return Ok(());
    }
    down::project_pair(
        rec,
        (dy1, (b1, b2), (dh1, dh2)),
        Some((dy2, n2)),
        (t, n1, r),
        GRAD_DH.layout,
    )
}

/// A product into `r`, `out[T, r] = u[T, n]·W(n, r)`, as an `execute_*` function names it.
struct IntoRank {
    kernel: &'static str,
    /// The bindings `u`, `W` and `out`, and what `n` is.
    u: &'static str,
    w: &'static str,
    out: &'static str,
    width: &'static str,
    layout: Layout,
}

/// `h = x·Aᵀ`: `A: [r, in]`.
const LORA_DOWN: IntoRank = IntoRank {
    kernel: "lora_down",
    u: "x",
    w: "a",
    out: "h",
    width: "in",
    layout: Layout::RankMajor,
};

/// `dh = dy·B`: `B: [out, r]`.
const GRAD_DH: IntoRank = IntoRank {
    kernel: "grad_dh",
    u: "dy",
    w: "b",
    out: "dh",
    width: "out",
    layout: Layout::RankMinor,
};

fn into_rank(
    rec: &mut Recorder<'_>,
    names: &IntoRank,
    (u, w, out): (&GpuBuffer<f32>, &GpuBuffer<f32>, &mut GpuBuffer<f32>),
    rank: usize,
) -> Result<(), ExecError> {
    let name = names.kernel;
    let (r, n) = adapter(name, names.w, w, rank)?;
    let t = rows(name, names.u, u, n as usize, names.width)?;
    expect_len(
        name,
        names.out,
        out,
        t as usize * r as usize,
        "[tokens, rank]",
    )?;
    if t == 0 {
        return Ok(());
    }
    down::project(rec, (u, w, out), (t, n, r), names.layout)
}

/// `dB = s·dyᵀ·h` (`[out, r]`, overwritten), summed over tokens through `scratch`
/// ([`lora_scratch_len`] for `out`).
pub fn execute_grad_b(
    rec: &mut Recorder<'_>,
    dy: &GpuBuffer<f32>,
    h: &GpuBuffer<f32>,
    rank: usize,
    scale: f32,
    scratch: &mut GpuBuffer<f32>,
    db: &mut GpuBuffer<f32>,
) -> Result<(), ExecError> {
    execute_weight_grad(rec, &GRAD_B, (dy, h), (rank, scale), scratch, db)
}

/// `dA = s·dhᵀ·x` (`[r, in]`, overwritten), summed over tokens through `scratch`
/// ([`lora_scratch_len`] for `in`).
pub fn execute_grad_a(
    rec: &mut Recorder<'_>,
    dh: &GpuBuffer<f32>,
    x: &GpuBuffer<f32>,
    rank: usize,
    scale: f32,
    scratch: &mut GpuBuffer<f32>,
    da: &mut GpuBuffer<f32>,
) -> Result<(), ExecError> {
    execute_weight_grad(rec, &GRAD_A, (x, dh), (rank, scale), scratch, da)
}

/// A weight gradient `G(j, k) = s·Σ_t u[t, j]·v[t, k]` as an `execute_*` function names it.
struct WeightGrad {
    kernel: &'static str,
    /// The bindings `u: [T, n]`, `v: [T, r]` and `G`, and what `n` is.
    u: &'static str,
    v: &'static str,
    grad: &'static str,
    width: &'static str,
    layout: Layout,
}

/// `dB = s·dyᵀ·h`: `u = dy`, `v = h`, `dB: [out, r]`.
const GRAD_B: WeightGrad = WeightGrad {
    kernel: "grad_b",
    u: "dy",
    v: "h",
    grad: "db",
    width: "out",
    layout: Layout::RankMinor,
};

/// `dA = s·dhᵀ·x`: `u = x`, `v = dh`, `dA: [r, in]`.
const GRAD_A: WeightGrad = WeightGrad {
    kernel: "grad_a",
    u: "x",
    v: "dh",
    grad: "da",
    width: "in",
    layout: Layout::RankMajor,
};

fn execute_weight_grad(
    rec: &mut Recorder<'_>,
    names: &WeightGrad,
    (u, v): (&GpuBuffer<f32>, &GpuBuffer<f32>),
    (rank, scale): (usize, f32),
    scratch: &GpuBuffer<f32>,
    grad: &GpuBuffer<f32>,
) -> Result<(), ExecError> {
    let name = names.kernel;
    let (r, n) = adapter(name, names.grad, grad, rank)?;
    let t = rows(name, names.u, u, n as usize, names.width)?;
    expect_len(name, names.v, v, t as usize * rank, "[tokens, rank]")?;
    weight_grad::expect_loops(rec.gpu(), name, t as usize)?;
    let need = lora_scratch_len(t as usize, n as usize, rank);
    expect_len(
        name,
        "scratch",
        scratch,
        Len::AtLeast(need),
        "lora_scratch_len",
    )?;
    let gradient = Gradient { u, v, grad, n };
    weight_grad::launch(rec, &[(&gradient, names.layout)], (t, r, scale), scratch)
}

/// `dx += s·dh·A` (`[T, in]`; added, since `dx` also receives `dy·W` through the frozen weight).
pub fn execute_input_grad(
    rec: &mut Recorder<'_>,
    dh: &GpuBuffer<f32>,
    a: &GpuBuffer<f32>,
    rank: usize,
    scale: f32,
    dx: &mut GpuBuffer<f32>,
) -> Result<(), ExecError> {
    let name = "input_grad";
    let (r, input) = adapter(name, "a", a, rank)?;
    let t = rows(name, "dh", dh, r as usize, "rank")?;
    expect_len(name, "dx", dx, t as usize * input as usize, "[tokens, in]")?;
    if t == 0 {
        return Ok(());
    }
    up::project_up(rec, (dh, a, dx), (t, input, r), Layout::RankMajor, scale)
}

/// The buffers of one projection's LoRA backward.
pub struct LoraBackward<'a> {
    /// The projection's input, `[T, in]`.
    pub x: &'a GpuBuffer<f32>,
    /// `A: [r, in]`, `B: [out, r]`.
    pub a: &'a GpuBuffer<f32>,
    pub b: &'a GpuBuffer<f32>,
    /// The forward's saved `h = x·Aᵀ`, `[T, r]`.
    pub h: &'a GpuBuffer<f32>,
    /// The gradient of the projection's output, `[T, out]`.
    pub dy: &'a GpuBuffer<f32>,
}

/// The whole LoRA backward of one projection for `T` tokens, contracting through `r` first:
/// `dh = dy·B`, `dB = s·dyᵀ·h`, `dA = s·dhᵀ·x`, `dx += s·dh·A`. `dh` (`[T, r]`) and `scratch`
/// ([`lora_scratch_len`] for `in + out`) are workspace; `da`, `db` are overwritten.
#[allow(clippy::too_many_arguments)]
pub fn execute_lora_backward(
    rec: &mut Recorder<'_>,
    inputs: &LoraBackward<'_>,
    rank: usize,
    scale: f32,
    dh: &mut GpuBuffer<f32>,
    scratch: &mut GpuBuffer<f32>,
    da: &mut GpuBuffer<f32>,
    db: &mut GpuBuffer<f32>,
    dx: &mut GpuBuffer<f32>,
) -> Result<(), ExecError> {
    let (_, input) = adapter("lora_backward", "a", inputs.a, rank)?;
    let t = rows("lora_backward", "x", inputs.x, input as usize, "in")? as usize;
    expect_len(
        "lora_backward",
        "dx",
        dx,
        t * input as usize,
        "[tokens, in]",
    )?;
    execute_lora_weight_backward(rec, inputs, rank, scale, dh, scratch, da, db)?;
    execute_input_grad(rec, dh, inputs.a, rank, scale, dx)
}

/// The LoRA backward of one projection but its input gradient: `dh = dy·B`, `dB = s·dyᵀ·h`,
/// `dA = s·dhᵀ·x` — for a frozen projection whose GEMM adds `s·dh·A` to `dx` itself
/// ([`LoraUp`] with [`UpWeight::A`] over `dh`). Buffers as [`execute_lora_backward`]'s.
#[allow(clippy::too_many_arguments)]
pub fn execute_lora_weight_backward(
    rec: &mut Recorder<'_>,
    inputs: &LoraBackward<'_>,
    rank: usize,
    scale: f32,
    dh: &mut GpuBuffer<f32>,
    scratch: &mut GpuBuffer<f32>,
    da: &mut GpuBuffer<f32>,
    db: &mut GpuBuffer<f32>,
) -> Result<(), ExecError> {
    let mut adapters = [WeightBackward { inputs, dh, da, db }];
    weight_backward("lora_backward", rec, &mut adapters, (rank, scale), scratch)
}

/// One adapter's part of [`execute_lora_weight_backward_pair`]: its inputs, `dh` (`[T, r]`,
/// workspace) and the gradients `da`, `db` (overwritten).
pub struct WeightBackward<'a, 'b> {
    pub inputs: &'a LoraBackward<'b>,
    pub dh: &'a mut GpuBuffer<f32>,
    pub da: &'a mut GpuBuffer<f32>,
    pub db: &'a mut GpuBuffer<f32>,
}

/// [`execute_lora_weight_backward`] for two adapters of the same tokens (a layer's query and
/// value projections) in four launches instead of six: both `dh = dy·B`
/// ([`execute_grad_dh_pair`]; two launches where it cannot pair them), each adapter's two
/// weight gradients' partial sums, and all four gradients' sums in one launch. `scratch` holds
/// [`lora_scratch_len`] for the sum of both adapters' `in + out`.
pub fn execute_lora_weight_backward_pair(
    rec: &mut Recorder<'_>,
    adapters: [WeightBackward<'_, '_>; 2],
    rank: usize,
    scale: f32,
    scratch: &mut GpuBuffer<f32>,
) -> Result<(), ExecError> {
    let mut adapters = adapters;
    weight_backward(
        "lora_backward_pair",
        rec,
        &mut adapters,
        (rank, scale),
        scratch,
    )
}

/// The weight backward of `adapters` (one or two, of the same tokens), every buffer checked
/// before anything is recorded (an error must not leave half a backward in the recorder).
fn weight_backward(
    name: &str,
    rec: &mut Recorder<'_>,
    adapters: &mut [WeightBackward<'_, '_>],
    (rank, scale): (usize, f32),
    scratch: &mut GpuBuffer<f32>,
) -> Result<(), ExecError> {
    let mut tokens = None;
    let mut widths = 0;
    let pair = adapters.len() > 1;
    for (i, WeightBackward { inputs, dh, da, db }) in adapters.iter().enumerate() {
        // A pair's bindings are named by their adapter: `adapters[1].dy`.
        let named = |binding: &str| match pair {
            true => format!("adapters[{i}].{binding}"),
            false => binding.to_string(),
        };
        let (_, input) = adapter(name, &named("a"), inputs.a, rank)?;
        let (_, output) = adapter(name, &named("b"), inputs.b, rank)?;
        let t = rows(name, &named("x"), inputs.x, input as usize, "in")? as usize;
        if tokens.is_some_and(|first| first != t) {
            return Err(ExecError::Dispatch {
                kernel: name.into(),
                what: format!("adapters over {} and {t} tokens", tokens.unwrap_or(0)),
                why: "the adapters of one backward take the same tokens".into(),
            });
        }
        tokens = Some(t);
        let (input, output) = (input as usize, output as usize);
        widths += input + output;
        for (binding, buf, len, what) in [
            ("dy", inputs.dy, t * output, "[tokens, out]"),
            ("h", inputs.h, t * rank, "[tokens, rank]"),
            ("dh", &**dh, t * rank, "[tokens, rank]"),
            ("da", &**da, rank * input, "[rank, in]"),
            ("db", &**db, output * rank, "[out, rank]"),
        ] {
            expect_len(name, &named(binding), buf, len, what)?;
        }
    }
    let t = tokens.unwrap_or(0);
    weight_grad::expect_loops(rec.gpu(), name, t)?;
    let need = lora_scratch_len(t, widths, rank);
    expect_len(
        name,
        "scratch",
        scratch,
        Len::AtLeast(need),
        "lora_scratch_len",
    )?;
    match adapters {
        [first, second] => execute_grad_dh_pair(
            rec,
            (first.inputs.dy, second.inputs.dy),
            (first.inputs.b, second.inputs.b),
            rank,
            (&mut *first.dh, &mut *second.dh),
        )?,
        _ => {
            for WeightBackward { inputs, dh, .. } in adapters.iter_mut() {
                execute_grad_dh(rec, inputs.dy, inputs.b, rank, dh)?;
            }
        }
    }
    // Every weight gradient, each adapter's `dB` then its `dA`: the partials an adapter a
    // launch, all their sums in one.
    let (t, r) = (t as u32, rank as u32);
    let gradients: Vec<(Gradient<'_>, Layout)> = adapters
        .iter()
        .flat_map(|WeightBackward { inputs, dh, da, db }| {
            let (n_in, n_out) = (inputs.a.len() / rank, inputs.b.len() / rank);
            let db = Gradient {
                u: inputs.dy,
                v: inputs.h,
                grad: db,
                n: n_out as u32,
            };
            let da = Gradient {
                u: inputs.x,
                v: dh,
                grad: da,
                n: n_in as u32,
            };
            [(db, GRAD_B.layout), (da, GRAD_A.layout)]
        })
        .collect();
    let gradients: Vec<(&Gradient<'_>, Layout)> = gradients.iter().map(|(g, l)| (g, *l)).collect();
    weight_grad::launch(rec, &gradients, (t, r, scale), scratch)
}
