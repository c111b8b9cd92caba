//! The exact elementwise pieces of a transformer step around the GEMMs: the token embedding
//! lookup (`out[t, :] = table[tokens[t], :]`), a bias broadcast over rows (`y[r, :] += bias`) and
//! the residual add (`y += x`).
//!
//! Bandwidth-bound, one invocation per output element, or per `vec4` of them where the row width
//! is a multiple of 4 (one wide load). Row widths are shapes (fixed per model; they key the
//! pipeline); the vocabulary, the token count and the row count are runtime values.

use hesper_dsl::prelude::*;
use hesper_exec::{Args, ExecError, GpuBuffer, Grid, Recorder};

use crate::{Columns, Len, expect_len, expect_u32};

/// Invocations of every workgroup here (WebGPU promises 256).
const WG: u32 = 256;

const EMBEDDING: &str = "embedding";
const ADD_BIAS: &str = "add_bias";

/// The embedding kernel's key: the row width `dim` (a multiple of 4 goes as `vec4`s).
fn embedding_key(dim: u32) -> KernelKey {
    KernelKey::new(EMBEDDING)
        .workgroup_size(WG)
        .shape("dim", dim)
}

/// The bias kernel's key: the row width `cols` (a multiple of 4 goes as `vec4`s).
fn add_bias_key(cols: u32) -> KernelKey {
    KernelKey::new(ADD_BIAS)
        .workgroup_size(WG)
        .shape("cols", cols)
}

/// `out[t, :] = table[tokens[t], :]`, zeros where `tokens[t] ≥ vocab`.
fn embedding(k: &mut KernelBuilder) {
    if k.shape::<u32>("dim").is_multiple_of(4) {
        embedding_lanes::<Vec4<f32>>(k)
    } else {
        embedding_lanes::<f32>(k)
    }
}

fn embedding_lanes<E: Columns>(k: &mut KernelBuilder) {
    let width = k.shape::<u32>("dim") / E::N;
    let table = k.storage::<E>("table");
    let tokens = k.storage::<u32>("tokens");
    let out = k.storage_rw::<E>("out");
    // `tokens × width` and the table's rows.
    let n = k.param::<u32>("n");
    let vocab = k.param::<u32>("vocab");
    let i = k.global_index();
    k.if_(i.lt(&n), |k| {
        let t = k.let_("t", &i / width);
        let token = k.let_("token", tokens.at(&t));
        k.if_else(
            token.lt(&vocab),
            |k| {
                let c = k.let_("c", &i - &t * width);
                k.store(&out, &i, table.at(&token * width + &c))
            },
            // A GPU cannot raise an error: an id past the table gives a row of zeros.
            |k| k.store(&out, &i, E::splat(lit(0.0f32))),
        );
    });
}

/// `y[r, c] += bias[c]` over rows of `cols`.
fn add_bias(k: &mut KernelBuilder) {
    if k.shape::<u32>("cols").is_multiple_of(4) {
        add_bias_lanes::<Vec4<f32>>(k)
    } else {
        add_bias_lanes::<f32>(k)
    }
}

fn add_bias_lanes<E: Columns>(k: &mut KernelBuilder) {
    let width = k.shape::<u32>("cols") / E::N;
    let y = k.storage_rw::<E>("y");
    let bias = k.storage::<E>("bias");
    // `rows × width`.
    let n = k.param::<u32>("n");
    let i = k.global_index();
    k.if_(i.lt(&n), |k| {
        let c = k.let_("c", &i % width);
        k.store(&y, &i, y.at(&i) + bias.at(&c));
    });
}

/// `y += x` over `vec4`s (the allocations are padded to 16 bytes, so any length works).
#[kernel(workgroup_size = 256)]
fn add(x: &[Vec4<f32>], y: &mut [Vec4<f32>], #[runtime] n4: u32) {
    let i = global_index();
    if i < n4 {
        y[i] = y[i] + x[i];
    }
}

/// The WGSL of each kernel of this module at small widths, `vec4` and scalar (for snapshots and
/// review).
pub fn kernels() -> Result<Vec<Kernel>, hesper_dsl::DslError> {
    Ok(vec![
        Kernel::build(&embedding_key(64), embedding)?,
        Kernel::build(&embedding_key(5), embedding)?,
        Kernel::build(&add_bias_key(64), add_bias)?,
        Kernel::build(&add_bias_key(5), add_bias)?,
        add::build()?,
    ])
}

/// Each kernel of this module at any shape, within `limits`, for [`crate::catalog`].
pub(crate) mod build {
    use super::*;
    use crate::catalog::Failure;

    pub(crate) fn embedding(dim: u32, limits: &Limits) -> Result<Kernel, Failure> {
        Ok(Kernel::build_with_limits(
            &embedding_key(dim),
            limits,
            super::embedding,
        )?)
    }

    pub(crate) fn add_bias(cols: u32, limits: &Limits) -> Result<Kernel, Failure> {
        Ok(Kernel::build_with_limits(
            &add_bias_key(cols),
            limits,
            super::add_bias,
        )?)
    }

    pub(crate) fn add(limits: &Limits) -> Result<Kernel, Failure> {
        Ok(Kernel::build_with_limits(
            &super::add::key(),
            limits,
            super::add::body,
        )?)
    }
}

/// Bind an f32 buffer as a kernel of width `width` reads it: `vec4`s when it is a multiple of 4.
fn bind<'a>(args: Args<'a>, name: &'a str, buffer: &'a GpuBuffer<f32>, width: u32) -> Args<'a> {
    if width.is_multiple_of(4) {
        args.buffer_vec4(name, buffer)
    } else {
        args.buffer(name, buffer)
    }
}

/// Invocations of a launch over `elements` f32s in rows of `width`: one per `vec4` where the
/// width is a multiple of 4, else one per element; checked against u32.
fn invocations(kernel: &str, elements: usize, width: u32) -> Result<u32, ExecError> {
    let lanes = if width.is_multiple_of(4) { 4 } else { 1 };
    expect_u32(kernel, "elements / lanes", elements / lanes)
}

/// `out[t, :] = table[tokens[t], :]`: the token embedding lookup. `table` is `[V, dim]`, `tokens`
/// `[T]`, `out` `[T, dim]` (overwritten). A token id ≥ V writes a row of zeros (a GPU cannot
/// raise an error; callers check ids on the host first).
pub fn execute_embedding(
    rec: &mut Recorder<'_>,
    table: &GpuBuffer<f32>,
    tokens: &GpuBuffer<u32>,
    dim: usize,
    out: &mut GpuBuffer<f32>,
) -> Result<(), ExecError> {
    expect_len(EMBEDDING, "table", table, Len::Multiple(dim), "[V, dim]")?;
    let elements = tokens.len().saturating_mul(dim);
    expect_len(EMBEDDING, "out", out, elements, "tokens × dim")?;
    let width = expect_u32(EMBEDDING, "dim", dim)?;
    let vocab = expect_u32(EMBEDDING, "V", table.len() / dim)?;
    // The table's element indices are u32 as well.
    invocations(EMBEDDING, table.len(), width)?;
    let n = invocations(EMBEDDING, elements, width)?;
    if n == 0 {
        return Ok(());
    }
    let kernel = rec.gpu().kernel(&embedding_key(width), embedding)?;
    let args = bind(Args::new(), "table", table, width).buffer("tokens", tokens);
    let args = bind(args, "out", out, width)
        .param("n", n)
        .param("vocab", vocab);
    rec.launch(&kernel, &args, Grid::Threads(u64::from(n)))
}

/// `y[r, :] += bias` for every row `r`: the bias of a linear layer, added after its GEMM. `y` is
/// `[rows, n]` and `bias` `[n]` (`n = bias.len()`).
pub fn execute_add_bias(
    rec: &mut Recorder<'_>,
    y: &mut GpuBuffer<f32>,
    bias: &GpuBuffer<f32>,
) -> Result<(), ExecError> {
    let cols = bias.len();
    expect_len(ADD_BIAS, "y", y, Len::Rows(cols), "bias's length")?;
    let width = expect_u32(ADD_BIAS, "cols", cols)?;
    let n = invocations(ADD_BIAS, y.len(), width)?;
    if n == 0 {
        return Ok(());
    }
    let kernel = rec.gpu().kernel(&add_bias_key(width), add_bias)?;
    let args = bind(Args::new(), "y", y, width);
    let args = bind(args, "bias", bias, width).param("n", n);
    rec.launch(&kernel, &args, Grid::Threads(u64::from(n)))
}

/// `y += x` (same length): the residual add.
pub fn execute_add(
    rec: &mut Recorder<'_>,
    x: &GpuBuffer<f32>,
    y: &mut GpuBuffer<f32>,
) -> Result<(), ExecError> {
    expect_len(add::NAME, "y", y, x.len(), "as x")?;
    if x.is_empty() {
        return Ok(());
    }
    let n4 = expect_u32(add::NAME, "elements / 4", x.len().div_ceil(4))?;
    let kernel = rec.gpu().kernel(&add::key(), add::body)?;
    let args = Args::new()
        .buffer_vec4("x", x)
        .buffer_vec4("y", y)
        .param("n4", n4);
    rec.launch(&kernel, &args, Grid::Threads(u64::from(n4)))
}

/// f64 references.
pub mod reference {
    /// `out[t, :] = table[tokens[t], :]`, zeros for an id past the table's `V` rows.
    pub fn embedding(table: &[f64], tokens: &[u32], dim: usize) -> Vec<f64> {
        let rows = table.len() / dim;
        tokens
            .iter()
            .flat_map(|&t| match usize::try_from(t) {
                Ok(t) if t < rows => table[t * dim..(t + 1) * dim].to_vec(),
                _ => vec![0.0; dim],
            })
            .collect()
    }

    /// `y[r, :] + bias` for every row of `y` (`[rows, bias.len()]`).
    pub fn add_bias(y: &[f64], bias: &[f64]) -> Vec<f64> {
        y.chunks(bias.len())
            .flat_map(|row| row.iter().zip(bias).map(|(y, b)| y + b))
            .collect()
    }

    /// `y + x`.
    pub fn add(x: &[f64], y: &[f64]) -> Vec<f64> {
        x.iter().zip(y).map(|(x, y)| x + y).collect()
    }
}
