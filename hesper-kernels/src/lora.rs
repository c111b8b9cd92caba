//! LoRA on one projection `W` (KERNELS.md): `A` is `[r, in]`, `B` is `[out, r]`, scale `s`.
//!
//! Forward: `h = x·Aᵀ` (`[T, r]`, saved), `y += s·h·Bᵀ`.
//! Backward, contracting through `r` first (never forming `B·A`), in Hesper's names:
//! - `grad_dh`:    `dh = dy·B`                 `[T, r]`
//! - `grad_b`:     `dB = s·dyᵀ·h`              `[out, r]`
//! - `grad_a`:     `dA = s·dhᵀ·x`              `[r, in]`
//! - `input_grad`: `dx += s·dh·A`              `[T, in]` (added: `dx` also gets `dy·W`)
//!
//! The products into `r` (`x·Aᵀ`, `dy·B`, only `r` wide) go through `lora_down`, which shares each
//! weight read among several tokens; those out of `r` (`s·h·Bᵀ`, `s·dh·A`) are tiled GEMMs
//! ([`crate::linear`]). The weight gradients `G(j, k) = scale·Σ_t u[t, j]·v[t, k]` (`dB`, `dA`) sum over
//! tokens in two passes: partials per block of tokens (each invocation keeps `r` sums in
//! registers and reads `u` once), then a sum over blocks — no float atomics.

use hesper_dsl::LocalArray;
use hesper_dsl::prelude::*;
use hesper_exec::{Args, ExecError, GpuBuffer, Grid, Recorder};

use crate::linear::{self, Product, Tile, Weights};
use crate::{expect_len, expect_u32};

/// Tokens per partial sum in the first pass of the weight gradients.
const TOKENS_PER_BLOCK: u32 = 64;
/// Elementwise kernels' workgroup.
const WG: u32 = 256;

/// How a weight is laid out relative to the `r` axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Layout {
    /// `A: [r, n]` — element `(j, k)` at `k·n + j`.
    RankMajor,
    /// `B: [n, r]` — element `(j, k)` at `j·r + k`.
    RankMinor,
}

impl Layout {
    fn shape(self) -> bool {
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

/// `lora_down`'s layout: `SLICES` invocations share each token's row of `n` inputs, and each
/// invocation keeps `TOKENS` tokens × `r` sums, so one read of a weight serves `TOKENS` tokens.
const SLICES: u32 = 64;
const TOKENS: u32 = 4;
/// Tokens per `lora_down` workgroup.
const DOWN_TOKENS: u32 = (WG / SLICES) * TOKENS;
/// Ranks up to this go through `lora_down` (its `TOKENS·r` sums live in registers); larger ones
/// through the tiled GEMM.
const DOWN_MAX_RANK: u32 = 32;
/// Sums reduced per round in `lora_down`'s workgroup memory.
const DOWN_CHUNK: u32 = 8;

fn down_key(n: u32, r: u32, layout: Layout) -> KernelKey {
    KernelKey::new("lora_down")
        .workgroup_size(WG)
        .shape("n", n)
        .shape("rank", r)
        .shape("rank_minor", layout.shape())
}

/// `out[t, k] = Σ_i a[t, i]·W(i, k)` for `k < r` — a product whose output is only `r` wide
/// (`x·Aᵀ`, `dy·B`), too narrow for the GEMM's tiles. Invocation `(group, slice)` walks
/// `i = slice, slice + SLICES, …` for the group's `TOKENS` tokens; the `SLICES` partial sums of
/// each output are then added in workgroup memory, `DOWN_CHUNK` outputs per round.
fn down(k: &mut KernelBuilder) {
    let (n, r) = (k.shape::<u32>("n"), k.shape::<u32>("rank"));
    let layout = Layout::from_shape(k.shape::<bool>("rank_minor"));
    let a = k.storage::<f32>("a");
    // `B`'s rows of `r` values are read as `r/4` vec4s (four sums per load).
    let vec4_rows = layout == Layout::RankMinor && r.is_multiple_of(4);
    let w4 = vec4_rows.then(|| k.storage::<Vec4<f32>>("w"));
    let w1 = (!vec4_rows).then(|| k.storage::<f32>("w"));
    let out = k.storage_rw::<f32>("out");
    let tokens = k.param::<u32>("tokens");
    let scratch = k.workgroup_array::<f32>("partial", WG * DOWN_CHUNK);
    let lid = k.let_("lid", k.local_index());
    let group = k.let_("group", &lid / SLICES);
    let slice = k.let_("slice", &lid % SLICES);
    let block = k.let_("block", k.workgroup_index());
    let first = k.let_("first", &block * DOWN_TOKENS + &group * TOKENS);
    // Rows past the last token read row 0 (in range) and are never stored.
    let rows: Vec<Expr<u32>> = (0..TOKENS)
        .map(|q| {
            k.let_(
                "row",
                select((&first + q).lt(&tokens), (&first + q) * n, 0u32),
            )
        })
        .collect();
    // Indexed by Rust constants only, so the sums stay in registers.
    let acc = k.var_array::<f32>("acc", TOKENS * r);
    k.for_step("i", &slice, n, SLICES, |k, i| {
        let xs: Vec<Expr<f32>> = rows.iter().map(|row| k.let_("x", a.at(row + &i))).collect();
        let add = |k: &mut KernelBuilder, kk: u32, wk: &Expr<f32>| {
            for (q, x) in xs.iter().enumerate() {
                k.store_op(&acc, q as u32 * r + kk, BinaryOp::Add, x * wk);
            }
        };
        if let Some(w) = &w4 {
            for quad in 0..r / 4 {
                let wq = k.let_("w", w.at(&i * (r / 4) + quad));
                for (c, lane) in [wq.x(), wq.y(), wq.z(), wq.w()].iter().enumerate() {
                    add(k, 4 * quad + c as u32, lane);
                }
            }
        } else if let Some(w) = &w1 {
            for kk in 0..r {
                let wk = k.let_("w", w.at(layout.at(&i, kk, n, r)));
                add(k, kk, &wk);
            }
        }
    });
    for chunk in 0..(TOKENS * r).div_ceil(DOWN_CHUNK) {
        let outputs =
            (chunk * DOWN_CHUNK..((chunk + 1) * DOWN_CHUNK).min(TOKENS * r)).collect::<Vec<_>>();
        for (c, o) in outputs.iter().enumerate() {
            k.store(&scratch, &lid * DOWN_CHUNK + c as u32, acc.at(*o));
        }
        k.workgroup_barrier();
        // One invocation per (group, output of the chunk) adds the group's SLICES partials.
        let per_round = (WG / SLICES) * outputs.len() as u32;
        k.if_(lid.lt(per_round), |k| {
            let g = k.let_("g", &lid / outputs.len() as u32);
            let c = k.let_("c", &lid % outputs.len() as u32);
            let total = k.var("total", 0.0f32);
            k.for_range("s", 0u32, SLICES, |k, s| {
                k.add_assign(&total, scratch.at((&g * SLICES + s) * DOWN_CHUNK + &c));
            });
            // Output `o = chunk·DOWN_CHUNK + c` is token `o / r` of the group, rank `o % r`.
            let o = k.let_("o", &c + chunk * DOWN_CHUNK);
            let token = k.let_("token", &block * DOWN_TOKENS + &g * TOKENS + &o / r);
            k.if_(token.lt(&tokens), |k| {
                k.store(&out, &token * r + &o % r, total.get())
            });
        });
        k.workgroup_barrier();
    }
}

/// `out = a·W(·, k)` for `a: [T, n]`: through `lora_down` for small ranks, else the GEMM.
fn project(
    rec: &mut Recorder<'_>,
    (a, w, out): (&GpuBuffer<f32>, &GpuBuffer<f32>, &mut GpuBuffer<f32>),
    (t, n, r): (u32, u32, u32),
    layout: Layout,
) -> Result<(), ExecError> {
    if r <= DOWN_MAX_RANK {
        let kernel = rec.gpu().kernel(&down_key(n, r, layout), down)?;
        let args = Args::new()
            .buffer("a", a)
            .buffer("out", out)
            .param("tokens", t);
        let args = if layout == Layout::RankMinor && r.is_multiple_of(4) {
            args.buffer_vec4("w", w)
        } else {
            args.buffer("w", w)
        };
        let groups = t.div_ceil(DOWN_TOKENS);
        return rec.launch(&kernel, &args, Grid::Threads(groups as u64 * WG as u64));
    }
    let (t, n, r) = (t as usize, n as usize, r as usize);
    match layout {
        Layout::RankMajor => linear::execute_matmul_nt(rec, a, w, out, t, r, n, false),
        Layout::RankMinor => linear::execute_matmul_nn(rec, a, w, out, t, n, r, false),
    }
}

fn partials_key(n: u32, r: u32) -> KernelKey {
    KernelKey::new("lora_weight_grad_partials")
        .workgroup_size(WG)
        .shape("n", n)
        .shape("rank", r)
        .shape("tokens_per_block", TOKENS_PER_BLOCK)
}

/// First pass: `partials[block, j, k] = Σ_{t in block} u[t, j]·v[t, k]`, one invocation per
/// (block, j) keeping `r` sums (`u` is read once).
fn weight_grad_partials(k: &mut KernelBuilder) {
    let (n, r) = (k.shape::<u32>("n"), k.shape::<u32>("rank"));
    let per_block = k.shape::<u32>("tokens_per_block");
    let u = k.storage::<f32>("u");
    // `v`'s rows of `r` values are read as `r/4` vec4s when `r` allows (one load for four sums).
    let lanes = if r.is_multiple_of(4) { 4 } else { 1 };
    let v4 = (lanes == 4).then(|| k.storage::<Vec4<f32>>("v"));
    let v1 = (lanes == 1).then(|| k.storage::<f32>("v"));
    let partials = k.storage_rw::<f32>("partials");
    let tokens = k.param::<u32>("tokens");
    let blocks = k.param::<u32>("blocks");
    let i = k.global_index();
    k.if_(i.lt(&blocks * n), |k| {
        let block = k.let_("block", &i / n);
        let j = k.let_("j", &i % n);
        // Indexed by Rust constants only (unrolled over `r`), so `acc` stays in registers.
        let acc: LocalArray<f32> = k.var_array("acc", r);
        let first = k.let_("first", &block * per_block);
        let end = k.let_("end", (&first + per_block).min(&tokens));
        k.for_range("t", &first, &end, |k, t| {
            let x = k.let_("x", u.at(&t * n + &j));
            if let Some(v) = &v4 {
                for q in 0..r / 4 {
                    let vq = k.let_("vq", v.at(&t * (r / 4) + q));
                    for (c, lane) in [vq.x(), vq.y(), vq.z(), vq.w()].into_iter().enumerate() {
                        k.store_op(&acc, 4 * q + c as u32, BinaryOp::Add, &x * lane);
                    }
                }
            } else if let Some(v) = &v1 {
                for kk in 0..r {
                    k.store_op(&acc, kk, BinaryOp::Add, &x * v.at(&t * r + kk));
                }
            }
        });
        for kk in 0..r {
            k.store(&partials, &i * r + kk, acc.at(kk));
        }
    });
}

fn sum_key(n: u32, r: u32, layout: Layout) -> KernelKey {
    KernelKey::new("lora_weight_grad_sum")
        .workgroup_size(WG)
        .shape("n", n)
        .shape("rank", r)
        .shape("rank_minor", layout.shape())
}

/// Second pass: `G(j, k) = scale·Σ_blocks partials[block, j, k]`, written in `G`'s layout.
fn weight_grad_sum(k: &mut KernelBuilder) {
    let (n, r) = (k.shape::<u32>("n"), k.shape::<u32>("rank"));
    let layout = Layout::from_shape(k.shape::<bool>("rank_minor"));
    let partials = k.storage::<f32>("partials");
    let grad = k.storage_rw::<f32>("grad");
    let blocks = k.param::<u32>("blocks");
    let scale = k.param::<f32>("scale");
    let i = k.global_index();
    k.if_(i.lt(n * r), |k| {
        let j = k.let_("j", &i / r);
        let kk = k.let_("k", &i % r);
        // Four independent sums, so four loads are in flight per step; a block past the last
        // reads the last one (in range) and adds nothing.
        let accs: Vec<_> = (0..4).map(|_| k.var("acc", 0.0f32)).collect();
        let last = k.let_("last", &blocks - 1u32);
        k.for_step("b", 0u32, &blocks, 4u32, |k, b| {
            for (q, acc) in accs.iter().enumerate() {
                let bq = k.let_("bq", (&b + q as u32).min(&last));
                let live = (&b + q as u32).lt(&blocks);
                k.add_assign(acc, select(live, partials.at(&bq * (n * r) + &i), 0.0f32));
            }
        });
        let total = accs[0].get() + accs[1].get() + accs[2].get() + accs[3].get();
        k.store(&grad, layout.at(&j, &kk, n, r), &scale * total);
    });
}

/// The WGSL of this module's kernels at representative shapes (for snapshots and review).
pub fn kernels() -> Result<Vec<Kernel>, hesper_dsl::DslError> {
    Ok(vec![
        Kernel::build(&down_key(2560, 16, Layout::RankMinor), down)?,
        Kernel::build(&partials_key(2560, 16), weight_grad_partials)?,
        Kernel::build(&sum_key(2560, 16, Layout::RankMajor), weight_grad_sum)?,
    ])
}

/// Rows of a `[rows, width]` buffer, checked.
fn rows(
    kernel: &str,
    binding: &str,
    buf: &GpuBuffer<f32>,
    width: usize,
    what: &str,
) -> Result<u32, ExecError> {
    if width == 0 || !buf.len().is_multiple_of(width) {
        return Err(ExecError::Binding {
            kernel: kernel.into(),
            binding: binding.into(),
            expected: format!("[rows, {what} = {width}] elements"),
            given: format!("{} elements", buf.len()),
        });
    }
    expect_u32(kernel, binding, buf.len() / width)
}

/// `r` and the width of an adapter matrix (`A: [r, in]` or `B: [out, r]`), checked.
fn adapter(
    kernel: &str,
    binding: &str,
    buf: &GpuBuffer<f32>,
    rank: usize,
) -> Result<(u32, u32), ExecError> {
    if rank == 0 || buf.is_empty() || !buf.len().is_multiple_of(rank) {
        return Err(ExecError::Binding {
            kernel: kernel.into(),
            binding: binding.into(),
            expected: format!("a non-empty multiple of the rank ({rank}) of elements"),
            given: format!("{} elements", buf.len()),
        });
    }
    Ok((
        expect_u32(kernel, "rank", rank)?,
        expect_u32(kernel, binding, buf.len() / rank)?,
    ))
}

/// `grad(j, k) = scale·Σ_t u[t, j]·v[t, k]` for `u: [T, n]`, `v: [T, r]`, through `scratch`.
fn launch_weight_grad(
    rec: &mut Recorder<'_>,
    (u, v, scratch, grad): (
        &GpuBuffer<f32>,
        &GpuBuffer<f32>,
        &GpuBuffer<f32>,
        &GpuBuffer<f32>,
    ),
    (tokens, n, r): (u32, u32, u32),
    layout: Layout,
    scale: f32,
) -> Result<(), ExecError> {
    let blocks = tokens.div_ceil(TOKENS_PER_BLOCK);
    let need = lora_scratch_len(tokens as usize, n.max(1) as usize, r as usize);
    if scratch.len() < need {
        return Err(ExecError::Binding {
            kernel: "lora_weight_grad_partials".into(),
            binding: "partials".into(),
            expected: format!("at least {need} elements (lora_scratch_len)"),
            given: format!("{} elements", scratch.len()),
        });
    }
    if blocks > 0 {
        let kernel = rec
            .gpu()
            .kernel(&partials_key(n, r), weight_grad_partials)?;
        let args = Args::new().buffer("u", u);
        let args = if r.is_multiple_of(4) {
            args.buffer_vec4("v", v)
        } else {
            args.buffer("v", v)
        };
        let args = args
            .buffer("partials", scratch)
            .param("tokens", tokens)
            .param("blocks", blocks);
        rec.launch(&kernel, &args, Grid::Threads(blocks as u64 * n as u64))?;
    }
    let kernel = rec.gpu().kernel(&sum_key(n, r, layout), weight_grad_sum)?;
    let args = Args::new()
        .buffer("partials", scratch)
        .buffer("grad", grad)
        .param("blocks", blocks)
        .param("scale", scale);
    rec.launch(&kernel, &args, Grid::Threads(n as u64 * r as u64))
}

/// Elements of the scratch buffer the weight gradients need for `tokens` × `max(in, out)` × `r`.
pub fn lora_scratch_len(tokens: usize, width: usize, rank: usize) -> usize {
    tokens.div_ceil(TOKENS_PER_BLOCK as usize).max(1) * width * rank
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
    let (t, input, output, r) = (t as usize, input as usize, output as usize, r as usize);
    project(
        rec,
        (x, a, h),
        (t as u32, input as u32, r as u32),
        Layout::RankMajor,
    )?;
    let gemm = linear::Gemm {
        product: Product::Nt,
        m: t,
        n: output,
        k: r,
        accumulate: true,
        tile: Tile::for_shape(t, output),
    };
    linear::execute_gemm(rec, &gemm, h, Weights::ScaledDense { w: b, scale }, y)
}

/// `dh = dy·B` (`[T, r]`; Hesper's gradDh = Bᵀ·dy per token).
pub fn execute_grad_dh(
    rec: &mut Recorder<'_>,
    dy: &GpuBuffer<f32>,
    b: &GpuBuffer<f32>,
    rank: usize,
    dh: &mut GpuBuffer<f32>,
) -> Result<(), ExecError> {
    let name = "grad_dh";
    let (r, output) = adapter(name, "b", b, rank)?;
    let t = rows(name, "dy", dy, output as usize, "out")?;
    expect_len(name, "dh", dh, t as usize * r as usize, "[tokens, rank]")?;
    if t == 0 {
        return Ok(());
    }
    project(rec, (dy, b, dh), (t, output, r), Layout::RankMinor)
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
    let name = "grad_b";
    let (r, output) = adapter(name, "db", db, rank)?;
    let t = rows(name, "dy", dy, output as usize, "out")?;
    expect_len(name, "h", h, t as usize * r as usize, "[tokens, rank]")?;
    launch_weight_grad(
        rec,
        (dy, h, scratch, db),
        (t, output, r),
        Layout::RankMinor,
        scale,
    )
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
    let name = "grad_a";
    let (r, input) = adapter(name, "da", da, rank)?;
    let t = rows(name, "x", x, input as usize, "in")?;
    expect_len(name, "dh", dh, t as usize * r as usize, "[tokens, rank]")?;
    launch_weight_grad(
        rec,
        (x, dh, scratch, da),
        (t, input, r),
        Layout::RankMajor,
        scale,
    )
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
    let (t, input, r) = (t as usize, input as usize, r as usize);
    let gemm = linear::Gemm {
        product: Product::Nn,
        m: t,
        n: r,
        k: input,
        accumulate: true,
        tile: Tile::for_shape(t, input),
    };
    linear::execute_gemm(rec, &gemm, dh, Weights::ScaledDense { w: a, scale }, dx)
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
/// ([`lora_scratch_len`] for `max(in, out)`) are workspace; `da`, `db` are overwritten.
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
    // Check every buffer before recording anything: an error must not leave half a backward
    // in the caller's recorder.
    let name = "lora_backward";
    let (_, input) = adapter(name, "a", inputs.a, rank)?;
    let (_, output) = adapter(name, "b", inputs.b, rank)?;
    let t = rows(name, "x", inputs.x, input as usize, "in")? as usize;
    let (input, output) = (input as usize, output as usize);
    for (binding, buf, len, what) in [
        ("dy", inputs.dy, t * output, "[tokens, out]"),
        ("h", inputs.h, t * rank, "[tokens, rank]"),
        ("dh", &*dh, t * rank, "[tokens, rank]"),
        ("da", &*da, rank * input, "[rank, in]"),
        ("db", &*db, output * rank, "[out, rank]"),
        ("dx", &*dx, t * input, "[tokens, in]"),
    ] {
        expect_len(name, binding, buf, len, what)?;
    }
    let need = lora_scratch_len(t, input.max(output), rank);
    if scratch.len() < need {
        return Err(ExecError::Binding {
            kernel: name.into(),
            binding: "scratch".into(),
            expected: format!("at least {need} elements (lora_scratch_len)"),
            given: format!("{} elements", scratch.len()),
        });
    }
    execute_grad_dh(rec, inputs.dy, inputs.b, rank, dh)?;
    execute_grad_b(rec, inputs.dy, inputs.h, rank, scale, scratch, db)?;
    execute_grad_a(rec, dh, inputs.x, rank, scale, scratch, da)?;
    execute_input_grad(rec, dh, inputs.a, rank, scale, dx)
}

/// f64 references, written as the plain matrix products of KERNELS.md.
pub mod reference {
    /// `(h, y + s·h·Bᵀ)` for `x: [T, in]`, `a: [r, in]`, `b: [out, r]`, `y: [T, out]`.
    pub fn lora_forward(
        x: &[f64],
        a: &[f64],
        b: &[f64],
        y: &[f64],
        rank: usize,
        scale: f64,
    ) -> (Vec<f64>, Vec<f64>) {
        let (input, output) = (a.len() / rank, b.len() / rank);
        let tokens = x.len() / input;
        let mut h = vec![0.0; tokens * rank];
        let mut out = y.to_vec();
        for t in 0..tokens {
            for k in 0..rank {
                h[t * rank + k] = (0..input)
                    .map(|i| x[t * input + i] * a[k * input + i])
                    .sum();
            }
            for o in 0..output {
                out[t * output + o] += scale
                    * (0..rank)
                        .map(|k| h[t * rank + k] * b[o * rank + k])
                        .sum::<f64>();
            }
        }
        (h, out)
    }

    /// `(dA, dB, dx_lora)` given `dy`: the gradients of `Σ dy ⊙ (s·x·Aᵀ·Bᵀ)`.
    pub fn lora_backward(
        x: &[f64],
        a: &[f64],
        b: &[f64],
        dy: &[f64],
        rank: usize,
        scale: f64,
    ) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
        let (input, output) = (a.len() / rank, b.len() / rank);
        let tokens = x.len() / input;
        let (h, _) = lora_forward(x, a, b, &vec![0.0; tokens * output], rank, scale);
        let mut dh = vec![0.0; tokens * rank];
        for t in 0..tokens {
            for k in 0..rank {
                dh[t * rank + k] = (0..output)
                    .map(|o| dy[t * output + o] * b[o * rank + k])
                    .sum();
            }
        }
        let mut db = vec![0.0; output * rank];
        let mut da = vec![0.0; rank * input];
        let mut dx = vec![0.0; tokens * input];
        for t in 0..tokens {
            for o in 0..output {
                for k in 0..rank {
                    db[o * rank + k] += scale * dy[t * output + o] * h[t * rank + k];
                }
            }
            for k in 0..rank {
                for i in 0..input {
                    da[k * input + i] += scale * dh[t * rank + k] * x[t * input + i];
                    dx[t * input + i] += scale * dh[t * rank + k] * a[k * input + i];
                }
            }
        }
        (da, db, dx)
    }
}
