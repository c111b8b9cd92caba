//! RMSNorm forward and backward (KERNELS.md): `y = x·r·γ` with `r = (mean_j x_j² + ε)^-½` per
//! row, saved by the forward; with `m = dy ⊙ γ`,
//! `dx = r·m − (r³/n)·(Σ_j m_j x_j)·x` and `dγ = Σ_rows dy ⊙ x·r`.
//!
//! One workgroup per row, each invocation holding up to three of its elements (`vec4`s where
//! the width allows) in registers, so a row is read once and written once; row sums go
//! through `workgroup_reduce`. The backward reads the forward's saved `r` (so it uses the forward's ε by
//! construction — Hesper recomputed it with another ε). `dx` can be added to what the buffer
//! holds (the residual path is a sum, never an overwrite). `dγ` is a two-pass column reduction
//! (partial sums per block of rows, then a sum over blocks): no float atomics.

use hesper_dsl::prelude::*;
use hesper_dsl::{LocalArray, WgslType};
use hesper_exec::{Args, ExecError, GpuBuffer, Grid, Recorder};

use crate::{expect_len, expect_rows, expect_u32};

/// Rows per partial sum in the first pass of `dγ`.
const ROWS_PER_BLOCK: u32 = 32;

/// Lanes per element (4 where the row is a whole number of `vec4`s) and invocations per row:
/// three elements each where 256 invocations allow (more up to [`MAX_HELD`], then a loop),
/// kept in registers, in a multiple of 16 invocations (at 576
/// columns: 48 × 3 vec4s, no ragged step; 0.69 of copy on the H200 against 0.67 with 64 ×
/// 2.25) and at least one NVIDIA warp.
fn row_layout(cols: u32) -> (u32, u32) {
    let lanes = if cols.is_multiple_of(4) { 4 } else { 1 };
    let wg = (cols / lanes)
        .div_ceil(3)
        .next_multiple_of(16)
        .clamp(32, 256);
    (lanes, wg)
}

/// Iterations of the runtime loops an invocation makes over a row of `cols` in two passes
/// (0 where the row is held in registers).
fn row_loop_iterations(cols: u32) -> u64 {
    let (lanes, wg) = row_layout(cols);
    let per_invocation = (cols / lanes).div_ceil(wg);
    if per_invocation <= MAX_HELD {
        0
    } else {
        2 * u64::from(per_invocation)
    }
}

/// Key of the forward: the width and ε shape the text; the layout is [`row_layout`]'s and
/// subgroups speed the row reduction up where the device has them.
/// The key both kernels start from: a workgroup a row of `cols` ([`row_layout`]), subgroups
/// where the device has them.
fn row_key(name: &str, cols: u32, features: Features) -> KernelKey {
    KernelKey::new(name)
        .workgroup_size(row_layout(cols).1)
        .shape("cols", cols)
        .features(features & Features::SUBGROUPS)
        // Register arrays are indexed by constants and columns guarded: no runtime bounds checks.
        .assume_in_bounds()
}

/// A body over lanes of `E`: the builder, the lanes an element, and the sum of an element's
/// lanes.
type Lanes<E> = fn(&mut KernelBuilder, u32, fn(Expr<E>) -> Expr<f32>);

/// Runs `vec4` where the row's width (`cols`) is a multiple of 4, else `scalar`.
fn by_width(k: &mut KernelBuilder, vec4: Lanes<Vec4<f32>>, scalar: Lanes<f32>) {
    if k.shape::<u32>("cols").is_multiple_of(4) {
        vec4(k, 4, |v| v.x() + v.y() + v.z() + v.w());
    } else {
        scalar(k, 1, |v| v);
    }
}

fn forward_key(cols: u32, eps: f32, features: Features) -> KernelKey {
    row_key("rms_norm_forward", cols, features).shape("eps", eps)
}

/// `y = x·r·γ`, `r = (Σ x²/n + ε)^-½`: each invocation loads its share of the row once into
/// registers, so the row is read once and written once (twice read past [`MAX_HELD`]).
fn forward_body(k: &mut KernelBuilder) {
    by_width(k, forward_lanes::<Vec4<f32>>, forward_lanes::<f32>);
}

fn forward_lanes<E>(k: &mut KernelBuilder, lanes: u32, lane_sum: fn(Expr<E>) -> Expr<f32>)
where
    E: hesper_dsl::Reducible,
    Expr<E>: std::ops::Mul<Expr<E>, Output = Expr<E>> + std::ops::Mul<Expr<f32>, Output = Expr<E>>,
{
    let cols = k.shape::<u32>("cols");
    let eps = k.shape_const::<f32>("eps");
    let x = k.storage::<E>("x");
    let gamma = k.storage::<E>("gamma");
    let y = k.storage_rw::<E>("y");
    let rstd = k.storage_rw::<f32>("rstd");
    let rows = k.param::<u32>("rows");
    let row = k.let_("row", k.workgroup_index());
    // The whole workgroup leaves together (same row): the barriers below stay uniform.
    k.if_(row.ge(&rows), |k| k.return_());
    let row_pass = RowPass::new(k, cols / lanes, &row);
    let xs = row_pass.registers::<E>(k, "xs");
    let squares = k.var("squares", E::zero());
    row_pass.each(k, &|k, at, _, j| {
        let v = row_pass.keep(k, &xs, j, x.at(at));
        k.add_assign(&squares, &v * &v);
    });
    let total = k.workgroup_reduce(lane_sum(squares.get()), Reduce::Sum);
    let r = k.let_("r", (total / cols as f32 + eps).inverse_sqrt());
    k.if_(row_pass.lid.eq(0u32), |k| k.store(&rstd, &row, r.clone()));
    row_pass.each(k, &|k, at, c, j| {
        let v = RowPass::kept(&xs, j).unwrap_or_else(|| x.at(at));
        k.store(&y, at, v * r.clone() * gamma.at(c));
    });
}

/// Most elements of a row an invocation holds in registers; a wider row is read twice, a
/// stride of the workgroup at a time (and counts against the device's loop limit).
const MAX_HELD: u32 = 8;

/// What a pass does at one column: `(k, index in the buffer, column, which held one)`.
type ColumnBody<'a> = dyn Fn(&mut KernelBuilder, &Expr<u32>, &Expr<u32>, Option<u32>) + 'a;

/// One row's columns shared out over a workgroup: invocation `lid` takes columns `lid + j·wg`.
/// Up to [`MAX_HELD`] a row, `j` runs over constants (the last step guarded where it runs past
/// the row) and what the first pass reads can be kept in registers for the second; past it,
/// a runtime loop.
struct RowPass {
    lid: Expr<u32>,
    base: Expr<u32>,
    width: u32,
    wg: u32,
    /// Elements per invocation, where they are held.
    held: Option<u32>,
}

impl RowPass {
    fn new(k: &mut KernelBuilder, width: u32, row: &Expr<u32>) -> RowPass {
        let wg = k.invocations();
        let lid = k.let_("lid", k.local_index());
        let base = k.let_("base", row * width);
        let per_invocation = width.div_ceil(wg);
        RowPass {
            lid,
            base,
            width,
            wg,
            held: (per_invocation <= MAX_HELD).then_some(per_invocation),
        }
    }

    /// A register array for one element per held column (none where the row is looped).
    fn registers<E: WgslType>(&self, k: &mut KernelBuilder, hint: &str) -> Option<LocalArray<E>> {
        self.held.map(|n| k.var_array::<E>(hint, n))
    }

    /// `value`, stored in `registers[j]` where the row is held; the value to use after.
    fn keep<E: WgslType>(
        &self,
        k: &mut KernelBuilder,
        registers: &Option<LocalArray<E>>,
        j: Option<u32>,
        value: Expr<E>,
    ) -> Expr<E> {
        match (registers, j) {
            (Some(registers), Some(j)) => {
                k.store(registers, j, value);
                registers.at(j)
            }
            _ => k.let_("v", value),
        }
    }

    /// What [`RowPass::keep`] stored for column `j`, where the row is held.
    fn kept<E: WgslType>(registers: &Option<LocalArray<E>>, j: Option<u32>) -> Option<Expr<E>> {
        Some(registers.as_ref()?.at(j?))
    }

    /// `f(k, index in the buffer, column, j)` for each of this invocation's columns (`j`:
    /// which held one, `None` in the runtime loop).
    fn each(&self, k: &mut KernelBuilder, f: &ColumnBody) {
        let Some(held) = self.held else {
            k.for_step("c", self.lid.clone(), self.width, self.wg, |k, c| {
                let at = k.let_("at", &self.base + &c);
                f(k, &at, &c, None);
            });
            return;
        };
        for j in 0..held {
            let body = |k: &mut KernelBuilder| {
                let c = k.let_("c", &self.lid + j * self.wg);
                let at = k.let_("at", &self.base + &c);
                f(k, &at, &c, Some(j));
            };
            if (j + 1) * self.wg <= self.width {
                body(k)
            } else {
                k.if_((&self.lid + j * self.wg).lt(self.width), body)
            }
        }
    }
}

/// Key of the backward: the width and `accumulate` shape the text; the layout is
/// [`row_layout`]'s and subgroups speed the row reduction up where the device has them.
fn backward_key(cols: u32, accumulate: bool, features: Features) -> KernelKey {
    row_key("rms_norm_backward", cols, features).shape("accumulate", accumulate)
}

/// `dx = r·m − (r³/n)·(Σ m·x)·x` with `m = dy·γ`. Each invocation loads its share of the row
/// once into registers (`x` and `m`), so the row is read once and written once.
fn backward_body(k: &mut KernelBuilder) {
    by_width(k, backward_lanes::<Vec4<f32>>, backward_lanes::<f32>);
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
    let x = k.storage::<E>("x");
    let gamma = k.storage::<E>("gamma");
    let rstd = k.storage::<f32>("rstd");
    let dy = k.storage::<E>("dy");
    let dx = k.storage_rw::<E>("dx");
    let rows = k.param::<u32>("rows");
    let row = k.let_("row", k.workgroup_index());
    // The whole workgroup leaves together (same row): the barriers below stay uniform.
    k.if_(row.ge(&rows), |k| k.return_());
    let row_pass = RowPass::new(k, cols / lanes, &row);
    // Read before the reduction: after its barriers the load would add a memory latency to
    // every row's critical path.
    let r = k.let_("r", rstd.at(&row));
    let xs = row_pass.registers::<E>(k, "xs");
    let ms = row_pass.registers::<E>(k, "ms");
    let dot = k.var("dot", E::zero());
    row_pass.each(k, &|k, at, c, j| {
        let xv = row_pass.keep(k, &xs, j, x.at(at));
        let m = row_pass.keep(k, &ms, j, dy.at(at) * gamma.at(c));
        k.add_assign(&dot, m * xv);
    });
    let m_dot_x = k.workgroup_reduce(lane_sum(dot.get()), Reduce::Sum);
    let coef = k.let_("coef", &r * &r * &r * m_dot_x / cols as f32);
    row_pass.each(k, &|k, at, c, j| {
        let xv = RowPass::kept(&xs, j).unwrap_or_else(|| x.at(at));
        let m = RowPass::kept(&ms, j).unwrap_or_else(|| dy.at(at) * gamma.at(c));
        let g = m * r.clone() - xv * coef.clone();
        if accumulate {
            k.store(&dx, at, dx.at(at) + g);
        } else {
            k.store(&dx, at, g);
        }
    });
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
        Kernel::build(&forward_key(2560, 1e-6, Features::SUBGROUPS), forward_body)?,
        Kernel::build(&forward_key(66, 1e-5, Features::NONE), forward_body)?,
        Kernel::build(&forward_key(8196, 1e-6, Features::NONE), forward_body)?,
        Kernel::build(
            &backward_key(2560, true, Features::SUBGROUPS),
            backward_body,
        )?,
        Kernel::build(&backward_key(576, false, Features::NONE), backward_body)?,
        Kernel::build(&backward_key(2051, false, Features::NONE), backward_body)?,
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
        features: Features,
        limits: &Limits,
    ) -> Result<Kernel, Failure> {
        let key = forward_key(cols, eps, features);
        Ok(Kernel::build_with_limits(&key, limits, forward_body)?)
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
    let name = "rms_norm_forward";
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
    crate::expect_loops(
        rec.gpu(),
        name,
        || format!("cols = {cols}"),
        row_loop_iterations(cols),
    )?;
    if rows == 0 {
        return Ok(());
    }
    let key = forward_key(cols, eps, rec.gpu().kernel_features());
    let kernel = rec.gpu().kernel(&key, forward_body)?;
    let args = if cols.is_multiple_of(4) {
        Args::new()
            .buffer_vec4("x", x)
            .buffer_vec4("gamma", gamma)
            .buffer_vec4("y", y)
    } else {
        Args::new()
            .buffer("x", x)
            .buffer("gamma", gamma)
            .buffer("y", y)
    };
    let args = args.buffer("rstd", rstd).param("rows", rows);
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
    crate::expect_loops(
        rec.gpu(),
        name,
        || format!("cols = {cols}"),
        row_loop_iterations(cols),
    )?;
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
    rec.launch(&kernel, &args, row_grid(rows))
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
