//! RMSNorm forward and backward (KERNELS.md): `y = x·r·γ` with `r = (mean_j x_j² + ε)^-½` per
//! row, saved by the forward; with `m = dy ⊙ γ`,
//! `dx = r·m − (r³/n)·(Σ_j m_j x_j)·x` and `dγ = Σ_rows dy ⊙ x·r`.
//!
//! One workgroup per row, its invocations striding over the columns; row sums go through
//! `workgroup_reduce`. The backward reads the forward's saved `r` (so it uses the forward's ε by
//! construction — Hesper recomputed it with another ε). `dx` can be added to what the buffer
//! holds (the residual path is a sum, never an overwrite). `dγ` is a two-pass column reduction
//! (partial sums per block of rows, then a sum over blocks): no float atomics.

use hesper_dsl::prelude::*;
use hesper_exec::{Args, ExecError, GpuBuffer, Grid, Recorder};

use crate::{expect_len, expect_rows, expect_u32};

/// Invocations per row.
const WG: u32 = 256;
/// Rows per partial sum in the first pass of `dγ`.
const ROWS_PER_BLOCK: u32 = 32;

#[kernel(workgroup_size = WG)]
fn rms_norm_forward(
    x: &[f32],
    gamma: &[f32],
    y: &mut [f32],
    rstd: &mut [f32],
    #[shape] cols: u32,
    #[shape] eps: f32,
    #[runtime] rows: u32,
) {
    // Rows past 65535 arrive as a 2-D grid of workgroups.
    let row = workgroup_index();
    if row < rows {
        let base = row * cols;
        let mut sum_sq = 0.0;
        for c in (local_index()..cols).step_by(WG) {
            let v = x[base + c];
            sum_sq += v * v;
        }
        let total = workgroup_reduce(sum_sq, Reduce::Sum);
        let r = inverse_sqrt(total / cols as f32 + eps);
        for c in (local_index()..cols).step_by(WG) {
            y[base + c] = x[base + c] * r * gamma[c];
        }
        if local_index() == 0 {
            rstd[row] = r;
        }
    }
}

/// Key of the backward: the width and `accumulate` shape the text; rows of a multiple of 4
/// columns go as `vec4`s; subgroups speed the row reduction up where the device has them.
fn backward_key(cols: u32, accumulate: bool, features: Features) -> KernelKey {
    let lanes = if cols.is_multiple_of(4) { 4 } else { 1 };
    // At most three elements per invocation, kept in registers, in a multiple of 16
    // invocations (at 576 columns: 48 × 3 vec4s, no ragged step; 0.69 of copy on the H200
    // against 0.67 with 64 × 2.25) and at least one NVIDIA warp.
    let wg = (cols / lanes)
        .div_ceil(3)
        .next_multiple_of(16)
        .clamp(32, 256);
    KernelKey::new("rms_norm_backward")
        .workgroup_size(wg)
        .shape("cols", cols)
        .shape("accumulate", accumulate)
        .features(features & Features::SUBGROUPS)
        // Register arrays are indexed by constants and columns guarded: no runtime bounds checks.
        .assume_in_bounds()
}

/// `dx = r·m − (r³/n)·(Σ m·x)·x` with `m = dy·γ`. Each invocation loads its share of the row
/// once into registers (`x` and `m`), so the row is read once and written once.
fn backward_body(k: &mut KernelBuilder) {
    if k.shape::<u32>("cols").is_multiple_of(4) {
        backward_lanes::<Vec4<f32>>(k, 4, |v| v.x() + v.y() + v.z() + v.w());
    } else {
        backward_lanes::<f32>(k, 1, |v| v);
    }
}

fn backward_lanes<E>(k: &mut KernelBuilder, lanes: u32, lane_sum: fn(Expr<E>) -> Expr<f32>)
where
    E: hesper_dsl::Reducible,
    Expr<E>: std::ops::Mul<Expr<E>, Output = Expr<E>>
        + std::ops::Mul<Expr<f32>, Output = Expr<E>>
        + std::ops::Sub<Expr<E>, Output = Expr<E>>,
{
    let cols = k.shape::<u32>("cols");
    let accumulate = k.shape::<bool>("accumulate");
    let wg = k.invocations();
    let (width, per_invocation) = (cols / lanes, (cols / lanes).div_ceil(wg));
    let x = k.storage::<E>("x");
    let gamma = k.storage::<E>("gamma");
    let rstd = k.storage::<f32>("rstd");
    let dy = k.storage::<E>("dy");
    let dx = k.storage_rw::<E>("dx");
    let rows = k.param::<u32>("rows");
    let row = k.let_("row", k.workgroup_index());
    // The whole workgroup leaves together (same row): the barriers below stay uniform.
    k.if_(row.ge(&rows), |k| k.return_());
    let lid = k.let_("lid", k.local_index());
    let base = k.let_("base", &row * width);
    // Read before the reduction: after its barriers the load would add a memory latency to
    // every row's critical path.
    let r = k.let_("r", rstd.at(&row));
    let xs = k.var_array::<E>("xs", per_invocation);
    let ms = k.var_array::<E>("ms", per_invocation);
    let dot = k.var("dot", E::zero());
    // Columns `lid + j·wg`; only the last step can run past the row.
    let column = |j: u32| &lid + j * wg;
    let guarded = |k: &mut KernelBuilder, j: u32, f: &dyn Fn(&mut KernelBuilder)| {
        if (j + 1) * wg <= width {
            f(k)
        } else {
            k.if_(column(j).lt(width), |k| f(k))
        }
    };
    for j in 0..per_invocation {
        guarded(k, j, &|k| {
            let c = k.let_("c", column(j));
            k.store(&xs, j, x.at(&base + &c));
            k.store(&ms, j, dy.at(&base + &c) * gamma.at(&c));
            k.add_assign(&dot, ms.at(j) * xs.at(j));
        });
    }
    let m_dot_x = k.workgroup_reduce(lane_sum(dot.get()), Reduce::Sum);
    let coef = k.let_("coef", &r * &r * &r * m_dot_x / cols as f32);
    for j in 0..per_invocation {
        guarded(k, j, &|k| {
            let at = k.let_("at", &base + column(j));
            let g = ms.at(j) * r.clone() - xs.at(j) * coef.clone();
            if accumulate {
                k.store(&dx, &at, dx.at(&at) + g);
            } else {
                k.store(&dx, &at, g);
            }
        });
    }
}

/// First pass of `dγ`: `partials[block, c] = Σ_{rows r of the block} dy[r, c]·x[r, c]·rstd[r]`.
#[kernel(workgroup_size = 256)]
fn rms_norm_dgamma_partials(
    x: &[f32],
    rstd: &[f32],
    dy: &[f32],
    partials: &mut [f32],
    #[shape] cols: u32,
    #[shape] rows_per_block: u32,
    #[runtime] rows: u32,
    #[runtime] blocks: u32,
) {
    // One invocation per (block, column); neighbouring invocations read neighbouring columns.
    let i = global_index();
    if i < blocks * cols {
        let block = i / cols;
        let c = i % cols;
        let first = block * rows_per_block;
        let end = min(first + rows_per_block, rows);
        let mut acc = 0.0;
        for r in first..end {
            let at = r * cols + c;
            acc += dy[at] * x[at] * rstd[r];
        }
        partials[i] = acc;
    }
}

/// Second pass of `dγ`: `dgamma[c] = Σ_blocks partials[block, c]`.
#[kernel(workgroup_size = 256)]
fn rms_norm_dgamma_sum(
    partials: &[f32],
    dgamma: &mut [f32],
    #[shape] cols: u32,
    #[runtime] blocks: u32,
) {
    let c = global_index();
    if c < cols {
        let mut acc = 0.0;
        for b in 0u32..blocks {
            acc += partials[b * cols + c];
        }
        dgamma[c] = acc;
    }
}

/// The WGSL of this module's kernels at representative shapes (for snapshots and review).
pub fn kernels() -> Result<Vec<Kernel>, hesper_dsl::DslError> {
    Ok(vec![
        rms_norm_forward::build(2560, 1e-6)?,
        Kernel::build(
            &backward_key(2560, true, Features::SUBGROUPS),
            backward_body,
        )?,
        Kernel::build(&backward_key(576, false, Features::NONE), backward_body)?,
        rms_norm_dgamma_partials::build(2560, ROWS_PER_BLOCK)?,
        rms_norm_dgamma_sum::build(2560)?,
    ])
}

/// Each kernel of this module at any shape, within `limits`, for [`crate::catalog`].
pub(crate) mod build {
    use super::*;
    use crate::catalog::Failure;

    pub(crate) fn rms_norm_forward(
        cols: u32,
        eps: f32,
        limits: &Limits,
    ) -> Result<Kernel, Failure> {
        let key = super::rms_norm_forward::key(cols, eps);
        Ok(Kernel::build_with_limits(
            &key,
            limits,
            super::rms_norm_forward::body,
        )?)
    }

    pub(crate) fn rms_norm_backward(
        cols: u32,
        accumulate: bool,
        features: Features,
        limits: &Limits,
    ) -> Result<Kernel, Failure> {
        let key = backward_key(cols, accumulate, features);
        Ok(Kernel::build_with_limits(&key, limits, backward_body)?)
    }

    pub(crate) fn rms_norm_dgamma_partials(
        cols: u32,
        rows_per_block: u32,
        limits: &Limits,
    ) -> Result<Kernel, Failure> {
        let key = super::rms_norm_dgamma_partials::key(cols, rows_per_block);
        Ok(Kernel::build_with_limits(
            &key,
            limits,
            super::rms_norm_dgamma_partials::body,
        )?)
    }

    pub(crate) fn rms_norm_dgamma_sum(cols: u32, limits: &Limits) -> Result<Kernel, Failure> {
        let key = super::rms_norm_dgamma_sum::key(cols);
        Ok(Kernel::build_with_limits(
            &key,
            limits,
            super::rms_norm_dgamma_sum::body,
        )?)
    }
}

/// Rows and columns of `x` given `gamma`'s length, checked.
fn rows_of(
    kernel: &str,
    x: &GpuBuffer<f32>,
    gamma: &GpuBuffer<f32>,
) -> Result<(u32, u32), ExecError> {
    let cols = gamma.len();
    let rows = expect_rows(kernel, "x", x, cols, "gamma's length")?;
    Ok((
        expect_u32(kernel, "rows", rows)?,
        expect_u32(kernel, "columns", cols)?,
    ))
}

/// One workgroup per row, 2-D past 65535 rows.
fn row_grid(rows: u32) -> Grid {
    Grid::WorkgroupPerItem(rows as u64)
}

/// `y = x·r·γ` per row, saving `r` in `rstd` (one per row). `x` and `y` are `[rows, cols]`,
/// `gamma` is `[cols]`; `eps` is the model's (a compile-time value, finite and at least 0).
pub fn execute_rms_norm_forward(
    rec: &mut Recorder<'_>,
    x: &GpuBuffer<f32>,
    gamma: &GpuBuffer<f32>,
    y: &mut GpuBuffer<f32>,
    rstd: &mut GpuBuffer<f32>,
    eps: f32,
) -> Result<(), ExecError> {
    let name = rms_norm_forward::NAME;
    let (rows, cols) = rows_of(name, x, gamma)?;
    expect_len(name, "y", y, x.len(), "as x")?;
    expect_len(name, "rstd", rstd, rows as usize, "one per row of x")?;
    if !(eps.is_finite() && eps >= 0.0) {
        // A negative ε takes the root of a negative mean square (NaN) on small rows.
        return Err(ExecError::Param {
            kernel: name.into(),
            param: "eps".into(),
            expected: "a finite number at least 0".into(),
            given: eps.to_string(),
        });
    }
    // Two strides over the row: the sum of squares, then the scaling.
    let iterations = 2 * u64::from(cols.div_ceil(WG));
    crate::expect_loops(rec.gpu(), name, || format!("cols = {cols}"), iterations)?;
    if rows == 0 {
        return Ok(());
    }
    let kernel = rec
        .gpu()
        .kernel(&rms_norm_forward::key(cols, eps), rms_norm_forward::body)?;
    let args = Args::new()
        .buffer("x", x)
        .buffer("gamma", gamma)
        .buffer("y", y)
        .buffer("rstd", rstd)
        .param("rows", rows);
    rec.launch(&kernel, &args, row_grid(rows))
}

/// `dx` of RMSNorm given `dy`, with the forward's saved `rstd`. With `accumulate`, adds to
/// `dx` (the residual stream's gradient); else overwrites it.
pub fn execute_rms_norm_backward(
    rec: &mut Recorder<'_>,
    x: &GpuBuffer<f32>,
    gamma: &GpuBuffer<f32>,
    rstd: &GpuBuffer<f32>,
    dy: &GpuBuffer<f32>,
    dx: &mut GpuBuffer<f32>,
    accumulate: bool,
) -> Result<(), ExecError> {
    let name = "rms_norm_backward";
    let (rows, cols) = rows_of(name, x, gamma)?;
    expect_len(name, "rstd", rstd, rows as usize, "one per row of x")?;
    expect_len(name, "dy", dy, x.len(), "as x")?;
    expect_len(name, "dx", dx, x.len(), "as x")?;
    if rows == 0 {
        return Ok(());
    }
    let key = backward_key(cols, accumulate, rec.gpu().kernel_features());
    let kernel = rec.gpu().kernel(&key, backward_body)?;
    let args = if cols.is_multiple_of(4) {
        Args::new()
            .buffer_vec4("x", x)
            .buffer_vec4("gamma", gamma)
            .buffer_vec4("dy", dy)
            .buffer_vec4("dx", dx)
    } else {
        Args::new()
            .buffer("x", x)
            .buffer("gamma", gamma)
            .buffer("dy", dy)
            .buffer("dx", dx)
    };
    let args = args.buffer("rstd", rstd).param("rows", rows);
    rec.launch(&kernel, &args, Grid::WorkgroupPerItem(rows as u64))
}

/// Elements of the scratch buffer [`execute_rms_norm_dgamma`] needs for `rows` × `cols`.
pub fn dgamma_scratch_len(rows: usize, cols: usize) -> usize {
    rows.div_ceil(ROWS_PER_BLOCK as usize).max(1) * cols
}

/// `dγ = Σ_rows dy ⊙ x·r` (overwrites `dgamma`), in two passes through `scratch`
/// ([`dgamma_scratch_len`] elements).
pub fn execute_rms_norm_dgamma(
    rec: &mut Recorder<'_>,
    x: &GpuBuffer<f32>,
    rstd: &GpuBuffer<f32>,
    dy: &GpuBuffer<f32>,
    scratch: &mut GpuBuffer<f32>,
    dgamma: &mut GpuBuffer<f32>,
) -> Result<(), ExecError> {
    let name = rms_norm_dgamma_partials::NAME;
    let cols = dgamma.len();
    let rows = expect_rows(name, "x", x, cols, "dgamma's length")?;
    expect_len(name, "rstd", rstd, rows, "one per row of x")?;
    expect_len(name, "dy", dy, x.len(), "as x")?;
    expect_len(
        name,
        "partials",
        scratch,
        dgamma_scratch_len(rows, cols),
        "dgamma_scratch_len",
    )?;
    let blocks = rows.div_ceil(ROWS_PER_BLOCK as usize);
    // The sum walks every block in one invocation.
    crate::expect_loops(rec.gpu(), name, || format!("{rows} rows"), blocks as u64)?;
    let (rows, cols32, blocks) = (
        expect_u32(name, "rows", rows)?,
        expect_u32(name, "columns", cols)?,
        expect_u32(name, "blocks", blocks)?,
    );
    let partials_kernel = rec.gpu().kernel(
        &rms_norm_dgamma_partials::key(cols32, ROWS_PER_BLOCK),
        rms_norm_dgamma_partials::body,
    )?;
    let sum_kernel = rec
        .gpu()
        .kernel(&rms_norm_dgamma_sum::key(cols32), rms_norm_dgamma_sum::body)?;
    if blocks > 0 {
        let args = Args::new()
            .buffer("x", x)
            .buffer("rstd", rstd)
            .buffer("dy", dy)
            .buffer("partials", scratch)
            .param("rows", rows)
            .param("blocks", blocks);
        rec.launch(
            &partials_kernel,
            &args,
            Grid::Threads(blocks as u64 * cols as u64),
        )?;
    }
    let args = Args::new()
        .buffer("partials", scratch)
        .buffer("dgamma", dgamma)
        .param("blocks", blocks);
    rec.launch(&sum_kernel, &args, Grid::Threads(cols as u64))
}

/// f64 references.
pub mod reference {
    /// `(y, rstd)` of RMSNorm over rows of `gamma.len()` columns.
    pub fn rms_norm_forward(x: &[f64], gamma: &[f64], eps: f64) -> (Vec<f64>, Vec<f64>) {
        let cols = gamma.len();
        let mut y = vec![0.0; x.len()];
        let mut rstd = vec![];
        for (row, out) in x.chunks(cols).zip(y.chunks_mut(cols)) {
            let r = 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / cols as f64 + eps).sqrt();
            for c in 0..cols {
                out[c] = row[c] * r * gamma[c];
            }
            rstd.push(r);
        }
        (y, rstd)
    }

    /// `(dx, dgamma)` of RMSNorm given `dy`.
    pub fn rms_norm_backward(
        x: &[f64],
        gamma: &[f64],
        dy: &[f64],
        eps: f64,
    ) -> (Vec<f64>, Vec<f64>) {
        let cols = gamma.len();
        let (_, rstd) = rms_norm_forward(x, gamma, eps);
        let mut dx = vec![0.0; x.len()];
        let mut dgamma = vec![0.0; cols];
        for (row, r) in rstd.iter().enumerate() {
            let at = row * cols;
            let m_dot_x: f64 = (0..cols).map(|c| dy[at + c] * gamma[c] * x[at + c]).sum();
            for c in 0..cols {
                let m = dy[at + c] * gamma[c];
                dx[at + c] = r * m - r.powi(3) / cols as f64 * m_dot_x * x[at + c];
                dgamma[c] += dy[at + c] * x[at + c] * r;
            }
        }
        (dx, dgamma)
    }
}
