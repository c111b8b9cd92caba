//! Cross-entropy over the vocabulary, forward and backward (KERNELS.md "Backward formulas"):
//! for each token `t` whose label is a class, `loss_t = logsumexp(z_t) − z_t[y_t]`; the loss is
//! the mean over those `N` tokens, and `dz = (softmax(z) − onehot(y)) / N`, 0 on masked rows.
//!
//! Labels are `i32`. A token is masked when its label is not a class (`label < 0` or
//! `label ≥ vocab`); [`IGNORE_INDEX`] (−100, PyTorch's and Hugging Face's value) is the one to
//! write. Masking every out-of-range label keeps each workgroup inside its own row: a GPU cannot
//! raise an error, and the count `N` the kernels write lets a caller check for unexpected masks.
//! With every token masked (`N = 0`) the loss is 0 and `dz` is 0.
//!
//! Three launches, all in the recorder's one pass:
//! 1. `cross_entropy_count` (one workgroup): `N` from the labels buffer. Counting on the GPU
//!    keeps one source of truth — the labels the row kernel reads, with the same predicate — and
//!    needs no host copy of the labels; it reads `T` integers, nothing next to the `T·V` logits.
//! 2. `cross_entropy` (or `cross_entropy_forward`): one workgroup per token (1024 invocations,
//!    or the device's most).
//!    They stride over the row (as `vec4`s when `V` is a multiple of 4), each reading
//!    `ROW_UNROLL` elements before using them, with an online log-sum-exp (running max and
//!    rescaled sum, one `exp` per logit); two workgroup reductions combine them, and — with the
//!    gradient — a second stride writes `dz`. The row is read twice and written once, and
//!    nothing larger than a stride is held; with few, large workgroups the rows in flight are
//!    few enough that much of the second read comes out of L2. Masked rows skip the reductions
//!    (the branch is uniform: the label is read from a read-only buffer at the workgroup's row).
//! 3. `cross_entropy_mean` (one workgroup): `Σ_t loss_t / max(N, 1)`.
//!
//! [`execute_cross_entropy`] records the three. For an lm-head run over the batch in chunks of
//! tokens (so that only one chunk's `[C, V]` logits exist at a time), each is public on its own:
//! [`execute_cross_entropy_count`] once over the whole batch's labels, then
//! [`execute_cross_entropy_rows`] for each chunk, every one dividing by that one global `N`, and
//! [`execute_cross_entropy_mean`] over the `[T]` token losses of all chunks.
//!
//! ## The gradient where the lm-head's backward reads it
//! The only reader of `dz` in a training step is the GEMM `dn = dz·E` through the lm-head. Written
//! out it costs a `[C, V]` buffer, its write and the GEMM's reads of it. Instead,
//! [`execute_cross_entropy_stats`] reads each row once and writes, besides the loss, the two
//! numbers of the row that `dz` is made from: `(lse, c)`, the log-sum-exp and `1/N` (`(0, 0)` on a
//! masked row). [`CrossEntropyGrad`] is the prologue ([`crate::linear::fusion`]) with which that
//! GEMM reads the logits themselves and multiplies `dz = exp(min(z − lse, 0))·c − [col = y]·c`,
//! computed as it stages each element (`z ≤ lse` on a class row, so the `min` only keeps a masked
//! row's `exp` finite, where `c = 0`).
//!
//! The vocabulary is a shape (fixed per model; it keys the pipeline); the token count is a
//! runtime value (the last batch may be shorter).

use hesper_dsl::Var;
use hesper_dsl::prelude::*;
use hesper_exec::{Args, ExecError, Gpu, GpuBuffer, Grid, Recorder};

use crate::linear::fusion::{ElementFn, GemmFusion};
use crate::{Columns, expect_len, expect_u32};

/// The label of a masked token (any label outside `0..vocab` is masked as well).
pub const IGNORE_INDEX: i32 = -100;

/// Invocations of every workgroup here: 1024, or the device's most if it allows fewer (WebGPU
/// promises 256). The one-workgroup kernels then stride over the tokens in few dependent steps,
/// and with few, large row workgroups the rows in flight are few enough that much of a row's
/// second read comes out of L2.
fn invocations(limits: &Limits) -> u32 {
    1024u32
        .min(limits.max_invocations_per_workgroup)
        .min(limits.max_workgroup_size[0])
}

/// The invocations the snapshots are taken at (WebGPU's promised most).
const SNAPSHOT_WG: u32 = 256;

/// Whether `label` is a class of the vocabulary (else the token is masked).
#[kernel_fn]
fn is_target(label: i32, vocab: u32) -> bool {
    label >= 0 && (label as u32) < vocab
}

/// `count[0] = N`: one workgroup strides over the labels.
#[kernel(workgroup_size = wg)]
fn cross_entropy_count(
    labels: &[i32],
    count: &mut [u32],
    #[runtime] tokens: u32,
    #[shape] vocab: u32,
    #[shape] wg: u32,
) {
    let mut n = 0u32;
    for t in (local_index()..tokens).step_by(invocations()) {
        if is_target(labels[t], vocab) {
            n += 1u32;
        }
    }
    let total = workgroup_reduce(n, Reduce::Sum);
    if local_index() == 0u32 {
        count[0u32] = total;
    }
}

/// The row kernels' names: with the gradient, the loss alone, and the loss with the row's
/// statistics.
const ROW: &str = "cross_entropy";
const ROW_FORWARD: &str = "cross_entropy_forward";
const ROW_STATS: &str = "cross_entropy_stats";

/// What a row kernel writes besides each token's loss.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum RowOutput {
    /// Nothing more.
    Loss,
    /// The row of `dz`.
    Grad,
    /// The row's `(lse, 1/N)`, `(0, 0)` when masked ([`CrossEntropyGrad`]).
    Stats,
}

impl RowOutput {
    /// The kernel's name and body.
    fn kernel(self) -> (&'static str, fn(&mut KernelBuilder)) {
        match self {
            RowOutput::Loss => (ROW_FORWARD, row_loss_only),
            RowOutput::Grad => (ROW, row_with_grad),
            RowOutput::Stats => (ROW_STATS, row_with_stats),
        }
    }
}

/// Floats of the statistics [`execute_cross_entropy_stats`] writes for each token.
pub const STATS_PER_TOKEN: usize = 2;
/// Wide elements each invocation reads before using them, in each pass over the row (on the
/// H200 at 4096 × 49152 with 1024 invocations: 583, 575 and 547 µs for 2, 4 and 8; 256 and 512
/// invocations were slower than 1024 at each).
const ROW_UNROLL: u32 = 8;

/// A row kernel's key: `wg` invocations, the vocabulary (its body reads the rows of one of a
/// multiple of 4 as `vec4`s), subgroups where the device has them.
fn row_key(name: &str, vocab: u32, wg: u32, features: Features) -> KernelKey {
    KernelKey::new(name)
        .workgroup_size(wg)
        .shape("vocab", vocab)
        .features(features & Features::SUBGROUPS)
        // Only storage indices, each below the row's end or clamped: no runtime bounds checks.
        .assume_in_bounds()
}

/// One workgroup per token: its loss, and with the gradient its row of `dz` (reading `N` from
/// `count`).
fn row_with_grad(k: &mut KernelBuilder) {
    row_body(k, RowOutput::Grad)
}

/// One workgroup per token: its loss only.
fn row_loss_only(k: &mut KernelBuilder) {
    row_body(k, RowOutput::Loss)
}

/// One workgroup per token: its loss and its row's `(lse, 1/N)` (reading `N` from `count`).
fn row_with_stats(k: &mut KernelBuilder) {
    row_body(k, RowOutput::Stats)
}

fn row_body(k: &mut KernelBuilder, output: RowOutput) {
    if k.shape::<u32>("vocab").is_multiple_of(4) {
        row_lanes::<Vec4<f32>>(k, output)
    } else {
        row_lanes::<f32>(k, output)
    }
}

fn row_lanes<E: Columns>(k: &mut KernelBuilder, output: RowOutput) {
    let vocab = k.shape::<u32>("vocab");
    let width = vocab / E::N;
    let logits = k.storage::<E>("logits");
    let labels = k.storage::<i32>("labels");
    let count = (output != RowOutput::Loss).then(|| k.storage::<u32>("count"));
    let d_logits = (output == RowOutput::Grad).then(|| k.storage_rw::<E>("d_logits"));
    let stats = (output == RowOutput::Stats).then(|| k.storage_rw::<f32>("stats"));
    let token_loss = k.storage_rw::<f32>("token_loss");
    let tokens = k.param::<u32>("tokens");
    // Past 65535 tokens the workgroups are laid out 2-D.
    let row = k.let_("row", k.workgroup_index());
    k.if_(row.ge(&tokens), |k| k.return_());
    let lid = k.let_("lid", k.local_index());
    let base = k.let_("base", &row * width);
    // Read from a read-only buffer at the workgroup's row: the branch below is uniform.
    let label = k.let_("label", labels.at(&row));
    let is_class = label.ge(0i32).and(label.cast::<u32>().lt(vocab));
    k.if_else(
        is_class,
        |k| {
            let (m, s) = (k.var("m", f32::MIN), k.var("s", 0.0f32));
            stride_row(
                k,
                (width, &lid),
                |k, c| k.let_("x", logits.at(&base + c)),
                |k, _, x| {
                    for x in E::lanes(&x) {
                        logsumexp_step(k, (&m, &s), x);
                    }
                },
            );
            let row_max = k.workgroup_reduce(m.get(), Reduce::Max);
            let sum = k.workgroup_reduce(s.get() * (m.get() - &row_max).exp(), Reduce::Sum);
            let target = k.let_("target", label.cast::<u32>());
            k.if_(lid.eq(0u32), |k| {
                let z = E::lane(&logits.at(&base + &target / E::N), &(&target % E::N));
                // `row_max − z_y` first: exact for nearby values, where `logsumexp − z_y` would
                // cancel.
                let log_sum = match stats {
                    Some(_) => k.let_("log_sum", sum.log()),
                    None => sum.log(),
                };
                k.store(&token_loss, &row, &row_max - z + &log_sum);
                if let (Some(count), Some(stats)) = (&count, &stats) {
                    let inv_n = 1.0f32 / count.at(0u32).cast::<f32>();
                    k.store(stats, &row * 2u32, &row_max + &log_sum);
                    k.store(stats, &row * 2u32 + 1u32, inv_n);
                }
            });
            if let (Some(count), Some(d_logits)) = (&count, &d_logits) {
                let inv_n = k.let_("inv_n", 1.0f32 / count.at(0u32).cast::<f32>());
                let p_scale = k.let_("p_scale", &inv_n / &sum);
                stride_row(
                    k,
                    (width, &lid),
                    |k, c| k.let_("x", logits.at(&base + c)),
                    |k, c, x| {
                        let dz = E::lanes(&x)
                            .into_iter()
                            .enumerate()
                            .map(|(q, x)| {
                                let at = c * E::N + q as u32;
                                let onehot = select(at.eq(&target), inv_n.clone(), 0.0f32);
                                (x - &row_max).exp() * &p_scale - onehot
                            })
                            .collect();
                        k.store(d_logits, &base + c, E::gather(dz));
                    },
                );
            }
        },
        |k| {
            k.if_(lid.eq(0u32), |k| {
                k.store(&token_loss, &row, 0.0f32);
                if let Some(stats) = &stats {
                    k.store(stats, &row * 2u32, 0.0f32);
                    k.store(stats, &row * 2u32 + 1u32, 0.0f32);
                }
            });
            if let Some(d_logits) = &d_logits {
                stride_row(
                    k,
                    (width, &lid),
                    |_, _| (),
                    |k, c, ()| k.store(d_logits, &base + c, E::splat(lit(0.0f32))),
                );
            }
        },
    );
}

/// The workgroup's invocations stride over `0..width`, `ROW_UNROLL` elements an invocation at a
/// time: `read` each of them first (their loads in flight together), then `apply` each to what
/// was read. Only the last batch can run past the row; there `read` gets the last element and
/// `apply` is skipped.
fn stride_row<D>(
    k: &mut KernelBuilder,
    (width, lid): (u32, &Expr<u32>),
    mut read: impl FnMut(&mut KernelBuilder, &Expr<u32>) -> D,
    mut apply: impl FnMut(&mut KernelBuilder, &Expr<u32>, D),
) {
    let wg = k.invocations();
    let chunk = wg * ROW_UNROLL;
    let (full, rest) = (width / chunk, width % chunk);
    let mut batch = |k: &mut KernelBuilder, first: &Expr<u32>, steps: u32, ragged: bool| {
        let mut read_ = vec![];
        for j in 0..steps {
            let c = k.let_("c", first + j * wg);
            if ragged && (j + 1) * wg > rest {
                let live = k.let_("live", c.lt(width));
                let data = read(k, &c.min(width - 1));
                read_.push((c, Some(live), data));
            } else {
                let data = read(k, &c);
                read_.push((c, None, data));
            }
        }
        for (c, live, data) in read_ {
            match live {
                Some(live) => k.if_(live, |k| apply(k, &c, data)),
                None => apply(k, &c, data),
            }
        }
    };
    if full > 0 {
        k.for_range("i", 0u32, full, |k, i| {
            let first = k.let_("first", lid + &i * chunk);
            batch(k, &first, ROW_UNROLL, false);
        });
    }
    if rest > 0 {
        let first = k.let_("first", lid + full * chunk);
        batch(k, &first, rest.div_ceil(wg), true);
    }
}

/// One more logit `x` into the online log-sum-exp `(m, s)`, `s = Σ exp(x − m)`, with one `exp`:
/// a new maximum rescales the sum by `exp(m − x)`, any other `x` adds `exp(x − m)`.
fn logsumexp_step(k: &mut KernelBuilder, (m, s): (&Var<f32>, &Var<f32>), x: Expr<f32>) {
    let x = k.let_("x", x);
    let e = k.let_("e", (-(&x - m.get()).abs()).exp());
    k.assign(
        s,
        select(x.gt(m.get()), s.get() * &e + 1.0f32, s.get() + &e),
    );
    k.assign(m, m.get().max(&x));
}

/// `loss[0] = Σ_t token_loss[t] / max(N, 1)` (masked tokens' losses are 0): one workgroup.
#[kernel(workgroup_size = wg)]
fn cross_entropy_mean(
    token_loss: &[f32],
    count: &[u32],
    loss: &mut [f32],
    #[runtime] tokens: u32,
    #[shape] wg: u32,
) {
    let mut sum = 0.0;
    for t in (local_index()..tokens).step_by(invocations()) {
        sum += token_loss[t];
    }
    let total = workgroup_reduce(sum, Reduce::Sum);
    if local_index() == 0u32 {
        loss[0u32] = total / (max(count[0u32], 1u32) as f32);
    }
}

/// The vocabulary the snapshots are taken at (a small one: two strides of `vec4`s, the second
/// ragged), on a device with subgroups.
const SNAPSHOT_VOCAB: u32 = 2_000;
const SNAPSHOT_FEATURES: Features = Features::SUBGROUPS;

/// The WGSL of each kernel of this module at a small vocabulary (for snapshots and review).
pub fn kernels() -> Result<Vec<Kernel>, hesper_dsl::DslError> {
    Ok(vec![
        cross_entropy_count::build(SNAPSHOT_VOCAB, SNAPSHOT_WG)?,
        Kernel::build(
            &row_key(ROW, SNAPSHOT_VOCAB, SNAPSHOT_WG, SNAPSHOT_FEATURES),
            row_with_grad,
        )?,
        Kernel::build(
            &row_key(ROW_FORWARD, SNAPSHOT_VOCAB, SNAPSHOT_WG, SNAPSHOT_FEATURES),
            row_loss_only,
        )?,
        Kernel::build(
            &row_key(ROW_STATS, SNAPSHOT_VOCAB, SNAPSHOT_WG, SNAPSHOT_FEATURES),
            row_with_stats,
        )?,
        // A vocabulary that is not a multiple of 4 (as GPT-2's 50257 is not): scalar rows.
        Kernel::build(
            &row_key(ROW, 1_001, SNAPSHOT_WG, SNAPSHOT_FEATURES),
            row_with_grad,
        )?,
        cross_entropy_mean::build(SNAPSHOT_WG)?,
    ])
}

/// Each kernel of this module at any shape, within `limits`, for [`crate::catalog`].
pub(crate) mod build {
    use super::*;
    use crate::catalog::Failure;

    /// `Ok` for a workgroup of invocations.
    fn check_wg(wg: u32) -> Result<(), Failure> {
        match wg {
            0 => Err(Failure::rule(
                "wg = 0".into(),
                "a workgroup needs an invocation".into(),
            )),
            _ => Ok(()),
        }
    }

    pub(crate) fn cross_entropy_count(
        vocab: u32,
        wg: u32,
        limits: &Limits,
    ) -> Result<Kernel, Failure> {
        check_wg(wg)?;
        let key = super::cross_entropy_count::key(vocab, wg);
        Ok(Kernel::build_with_limits(
            &key,
            limits,
            super::cross_entropy_count::body,
        )?)
    }

    /// The row kernel that writes `output`: `cross_entropy`, `cross_entropy_forward` or
    /// `cross_entropy_stats`.
    pub(crate) fn cross_entropy_rows(
        output: RowOutput,
        vocab: u32,
        wg: u32,
        features: Features,
        limits: &Limits,
    ) -> Result<Kernel, Failure> {
        check_wg(wg)?;
        let (name, body) = output.kernel();
        Ok(Kernel::build_with_limits(
            &row_key(name, vocab, wg, features),
            limits,
            body,
        )?)
    }

    pub(crate) fn cross_entropy_mean(wg: u32, limits: &Limits) -> Result<Kernel, Failure> {
        check_wg(wg)?;
        let key = super::cross_entropy_mean::key(wg);
        Ok(Kernel::build_with_limits(
            &key,
            limits,
            super::cross_entropy_mean::body,
        )?)
    }
}

/// What the cross-entropy kernels write besides the gradient.
pub struct LossOutputs<'a> {
    /// `[T]`: each token's loss, 0 where masked.
    pub token_loss: &'a mut GpuBuffer<f32>,
    /// `[1]`: the mean of the token losses over the non-masked tokens; 0 when all are masked.
    pub loss: &'a mut GpuBuffer<f32>,
    /// `[1]`: `N`, the number of non-masked tokens.
    pub count: &'a mut GpuBuffer<u32>,
}

/// The checked sizes of one row launch: `T` (or a chunk's `C`), and `V` as the kernels take them.
struct Sizes {
    tokens: u32,
    vocab: u32,
    /// Invocations of every workgroup ([`invocations`]).
    wg: u32,
}

/// `vocab` as the kernels take it: at least one class, below 2³².
fn expect_vocab(kernel: &str, vocab: usize) -> Result<u32, ExecError> {
    if vocab == 0 {
        return Err(ExecError::Dispatch {
            kernel: kernel.into(),
            what: "vocab = 0".into(),
            why: "a softmax needs at least one class".into(),
        });
    }
    expect_u32(kernel, "vocab", vocab)
}

/// Check a row kernel's `logits` and `token_loss` against `T = labels.len()` and `vocab`.
/// `Ok` when an invocation's loops fit `gpu` ([`crate::expect_loops`]): a row kernel strides
/// over the `vocab` twice (the log-sum-exp, then the gradient), `ROW_UNROLL` elements an
/// invocation at a time; the count and the mean stride once over the `tokens`.
fn expect_loss_loops(
    gpu: &Gpu,
    kernel: &str,
    (tokens, vocab): (usize, usize),
) -> Result<(), ExecError> {
    let wg = invocations(&gpu.kernel_limits()) as usize;
    let rows = 2 * vocab.div_ceil(wg * ROW_UNROLL as usize);
    let iterations = rows.max(tokens.div_ceil(wg)) as u64;
    let what = || format!("{tokens} tokens of a vocabulary of {vocab}");
    crate::expect_loops(gpu, kernel, what, iterations)
}

fn row_sizes(
    gpu: &Gpu,
    row_kernel: &str,
    logits: &GpuBuffer<f32>,
    labels: &GpuBuffer<i32>,
    vocab: usize,
    token_loss: &GpuBuffer<f32>,
) -> Result<Sizes, ExecError> {
    let vocab_u32 = expect_vocab(row_kernel, vocab)?;
    let t = labels.len();
    let elements = t.saturating_mul(vocab);
    expect_len(row_kernel, "logits", logits, elements, "labels × vocab")?;
    expect_len(row_kernel, "token_loss", token_loss, t, "one per label")?;
    expect_u32(row_kernel, "logits elements", elements)?;
    expect_loss_loops(gpu, row_kernel, (t, vocab))?;
    Ok(Sizes {
        tokens: expect_u32(row_kernel, "tokens", t)?,
        vocab: vocab_u32,
        wg: invocations(&gpu.kernel_limits()),
    })
}

/// Check every buffer of a whole-batch launch before anything is recorded.
fn check(
    gpu: &Gpu,
    row_kernel: &str,
    logits: &GpuBuffer<f32>,
    labels: &GpuBuffer<i32>,
    vocab: usize,
    out: &LossOutputs<'_>,
) -> Result<Sizes, ExecError> {
    let sizes = row_sizes(gpu, row_kernel, logits, labels, vocab, out.token_loss)?;
    expect_len(cross_entropy_mean::NAME, "loss", out.loss, 1, "the mean")?;
    expect_len(cross_entropy_count::NAME, "count", out.count, 1, "N")?;
    Ok(sizes)
}

/// Cross-entropy forward and backward, fused: `d_logits` (`[T, V]`, overwritten, 0 on masked
/// rows), the per-token losses, their mean and `N` (see [`LossOutputs`]). `logits` are `[T, V]`
/// row-major and `labels` `[T]`, with `T = labels.len()` and `V = vocab`. The three launches of
/// [`execute_cross_entropy_count`], [`execute_cross_entropy_rows`] and
/// [`execute_cross_entropy_mean`], every buffer checked before any is recorded.
pub fn execute_cross_entropy(
    rec: &mut Recorder<'_>,
    logits: &GpuBuffer<f32>,
    labels: &GpuBuffer<i32>,
    vocab: usize,
    d_logits: &mut GpuBuffer<f32>,
    out: LossOutputs<'_>,
) -> Result<(), ExecError> {
    check(rec.gpu(), ROW, logits, labels, vocab, &out)?;
    expect_len(ROW, "d_logits", d_logits, logits.len(), "as logits")?;
    execute_cross_entropy_count(rec, labels, vocab, out.count)?;
    execute_cross_entropy_rows(
        rec,
        logits,
        labels,
        vocab,
        out.count,
        d_logits,
        out.token_loss,
    )?;
    execute_cross_entropy_mean(rec, out.token_loss, out.count, out.loss)
}

/// Cross-entropy forward only (for evaluation: no `[T, V]` gradient is written or needed): the
/// per-token losses, their mean and `N`, as [`execute_cross_entropy`] writes them.
pub fn execute_cross_entropy_forward(
    rec: &mut Recorder<'_>,
    logits: &GpuBuffer<f32>,
    labels: &GpuBuffer<i32>,
    vocab: usize,
    out: LossOutputs<'_>,
) -> Result<(), ExecError> {
    let sizes = check(rec.gpu(), ROW_FORWARD, logits, labels, vocab, &out)?;
    execute_cross_entropy_count(rec, labels, vocab, out.count)?;
    if sizes.tokens > 0 {
        let key = row_key(
            ROW_FORWARD,
            sizes.vocab,
            sizes.wg,
            rec.gpu().kernel_features(),
        );
        let kernel = rec.gpu().kernel(&key, row_loss_only)?;
        let args = bind_rows(Args::new(), "logits", logits, &sizes)
            .buffer("labels", labels)
            .buffer("token_loss", out.token_loss)
            .param("tokens", sizes.tokens);
        rec.launch(&kernel, &args, one_workgroup_per_token(&sizes))?;
    }
    execute_cross_entropy_mean(rec, out.token_loss, out.count, out.loss)
}

/// `count[0] = N`, the non-masked tokens of `labels` (label in `0..vocab`). The first step of a
/// chunked loss: count over the whole batch once, then every chunk's
/// [`execute_cross_entropy_rows`] divides by the same `N`. No labels write `N = 0`.
pub fn execute_cross_entropy_count(
    rec: &mut Recorder<'_>,
    labels: &GpuBuffer<i32>,
    vocab: usize,
    count: &mut GpuBuffer<u32>,
) -> Result<(), ExecError> {
    let name = cross_entropy_count::NAME;
    let vocab = expect_vocab(name, vocab)?;
    expect_len(name, "count", count, 1, "N")?;
    let tokens = expect_u32(name, "tokens", labels.len())?;
    if tokens == 0 {
        return rec.fill(count, 0);
    }
    expect_loss_loops(rec.gpu(), name, (labels.len(), 0))?;
    let wg = invocations(&rec.gpu().kernel_limits());
    let kernel = rec.gpu().kernel(
        &cross_entropy_count::key(vocab, wg),
        cross_entropy_count::body,
    )?;
    let args = Args::new()
        .buffer("labels", labels)
        .buffer("count", count)
        .param("tokens", tokens);
    rec.launch(&kernel, &args, Grid::Workgroups([1, 1, 1]))
}

/// The rows of one chunk of tokens, so that the lm-head can run over a batch chunk by chunk:
/// `d_logits` (`[C, V]`, overwritten, `(softmax − onehot) / N` with `N` read from `count`, 0 on
/// masked rows) and `token_loss` `[C]` (0 where masked), for the `C = labels.len()` rows of
/// `logits` `[C, V]`. `count` holds the `N` of the whole batch, from
/// [`execute_cross_entropy_count`].
pub fn execute_cross_entropy_rows(
    rec: &mut Recorder<'_>,
    logits: &GpuBuffer<f32>,
    labels: &GpuBuffer<i32>,
    vocab: usize,
    count: &GpuBuffer<u32>,
    d_logits: &mut GpuBuffer<f32>,
    token_loss: &mut GpuBuffer<f32>,
) -> Result<(), ExecError> {
    let sizes = row_sizes(rec.gpu(), ROW, logits, labels, vocab, token_loss)?;
    expect_len(ROW, "d_logits", d_logits, logits.len(), "as logits")?;
    expect_len(ROW, "count", count, 1, "N")?;
    if sizes.tokens == 0 {
        return Ok(());
    }
    let key = row_key(ROW, sizes.vocab, sizes.wg, rec.gpu().kernel_features());
    let kernel = rec.gpu().kernel(&key, row_with_grad)?;
    let args = bind_rows(Args::new(), "logits", logits, &sizes)
        .buffer("labels", labels)
        .buffer("count", count);
    let args = bind_rows(args, "d_logits", d_logits, &sizes)
        .buffer("token_loss", token_loss)
        .param("tokens", sizes.tokens);
    rec.launch(&kernel, &args, one_workgroup_per_token(&sizes))
}

/// The rows of one chunk as [`execute_cross_entropy_rows`] does them, without writing their
/// gradient: `token_loss` `[C]` and `stats` `[C, 2]`, each row's `(lse, 1/N)` (`(0, 0)` where
/// masked), with `N` read from `count`. Each row is read once (twice with the gradient). The
/// gradient is then computed where it is multiplied: [`CrossEntropyGrad`] (the module doc).
pub fn execute_cross_entropy_stats(
    rec: &mut Recorder<'_>,
    logits: &GpuBuffer<f32>,
    labels: &GpuBuffer<i32>,
    vocab: usize,
    count: &GpuBuffer<u32>,
    stats: &mut GpuBuffer<f32>,
    token_loss: &mut GpuBuffer<f32>,
) -> Result<(), ExecError> {
    let sizes = row_sizes(rec.gpu(), ROW_STATS, logits, labels, vocab, token_loss)?;
    let want = labels.len().saturating_mul(STATS_PER_TOKEN);
    expect_len(ROW_STATS, "stats", stats, want, "(lse, 1/N) per label")?;
    expect_len(ROW_STATS, "count", count, 1, "N")?;
    if sizes.tokens == 0 {
        return Ok(());
    }
    let key = row_key(
        ROW_STATS,
        sizes.vocab,
        sizes.wg,
        rec.gpu().kernel_features(),
    );
    let kernel = rec.gpu().kernel(&key, row_with_stats)?;
    let args = bind_rows(Args::new(), "logits", logits, &sizes)
        .buffer("labels", labels)
        .buffer("count", count)
        .buffer("stats", stats)
        .buffer("token_loss", token_loss)
        .param("tokens", sizes.tokens);
    rec.launch(&kernel, &args, one_workgroup_per_token(&sizes))
}

/// The cross-entropy's gradient as a GEMM prologue ([`crate::linear::fusion`]): the GEMM
/// `dn = dz·E` through the lm-head takes the logits `[C, V]` as its input, and each element
/// `z` (row `t`, column `v`) becomes `dz = exp(min(z − lse, 0))·c − [v = y_t]·c` as it is
/// staged, with `(lse, c)` row `t` of [`execute_cross_entropy_stats`]'s `stats` and `y_t` its
/// label: `(softmax(z) − onehot(y)) / N` on a class row, 0 on a masked one (`c = 0`). No `[C, V]`
/// gradient is written or read.
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use hesper_exec::Gpu;
/// use hesper_kernels::linear::fusion::Fusion;
/// use hesper_kernels::linear::{Gemm, Product, Weights, execute_gemm_fused};
/// use hesper_kernels::loss::{self, CrossEntropyGrad, STATS_PER_TOKEN};
///
/// let gpu = Gpu::new()?;
/// // Two tokens over a vocabulary of 4, an lm-head E [4, 2]: dn = dz·E.
/// let (tokens, vocab, dim) = (2, 4, 2);
/// let logits = gpu.upload(&[0.5f32, 1.0, -1.0, 2.0, 0.0, 0.0, 0.0, 0.0])?;
/// let labels = gpu.upload(&[3i32, loss::IGNORE_INDEX])?;
/// let e = gpu.upload(&[1.0f32, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0])?;
/// let mut count = gpu.zeros::<u32>(1)?;
/// let mut stats = gpu.zeros::<f32>(tokens * STATS_PER_TOKEN)?;
/// let mut token_loss = gpu.zeros::<f32>(tokens)?;
/// let mut dn = gpu.zeros::<f32>(tokens * dim)?;
/// let mut rec = gpu.recorder();
/// loss::execute_cross_entropy_count(&mut rec, &labels, vocab, &mut count)?;
/// loss::execute_cross_entropy_stats(
///     &mut rec, &logits, &labels, vocab, &count, &mut stats, &mut token_loss,
/// )?;
/// let grad = CrossEntropyGrad { stats: &stats, labels: &labels };
/// let fusion = Fusion { prologue: Some(&grad), epilogues: &[] };
/// let gemm = Gemm::new(Product::Nn, (tokens, vocab, dim), false);
/// execute_gemm_fused(&mut rec, &gemm, &fusion, &logits, Weights::Dense(&e), &mut dn)?;
/// rec.submit()?;
/// // The masked token's row of dn is 0; the other's is softmax(z)·E − E[3] (N = 1).
/// let dn = dn.read(&gpu)?;
/// let z = [0.5f64, 1.0, -1.0, 2.0];
/// let sum: f64 = z.iter().map(|v| v.exp()).sum();
/// let p: Vec<f64> = z.iter().map(|v| v.exp() / sum).collect();
/// assert!((dn[0] as f64 - (p[0] + p[2])).abs() < 1e-6);
/// assert!((dn[1] as f64 - (p[1] + p[2])).abs() < 1e-6);
/// assert_eq!(&dn[2..], [0.0, 0.0]);
/// # Ok(())
/// # }
/// ```
pub struct CrossEntropyGrad<'a> {
    /// `[C, 2]`: each row's `(lse, 1/N)` ([`execute_cross_entropy_stats`]).
    pub stats: &'a GpuBuffer<f32>,
    /// `[C]`: the rows' labels, as [`execute_cross_entropy_stats`] read them.
    pub labels: &'a GpuBuffer<i32>,
}

impl GemmFusion for CrossEntropyGrad<'_> {
    fn name(&self) -> &'static str {
        "cross_entropy_grad"
    }
    fn build(&self, k: &mut KernelBuilder, _width: u32) -> ElementFn {
        let stats = k.storage::<f32>("ce_stats");
        let labels = k.storage::<i32>("ce_labels");
        Box::new(move |_, row, col, z| {
            let (lse, c) = (stats.at(row * 2u32), stats.at(row * 2u32 + 1u32));
            // A masked label is no column (and its row's `c` is 0).
            let onehot = select(labels.at(row).cast::<u32>().eq(col), c.clone(), 0.0f32);
            (z - lse).min(0.0f32).exp() * c - onehot
        })
    }
    fn check(&self, kernel: &str, rows: usize, _width: usize) -> Result<(), ExecError> {
        let want = rows.saturating_mul(STATS_PER_TOKEN);
        expect_len(
            kernel,
            "ce_stats",
            self.stats,
            want,
            "(lse, 1/N) per row, from execute_cross_entropy_stats",
        )?;
        expect_len(kernel, "ce_labels", self.labels, rows, "one label per row")
    }
    fn bind<'a>(&'a self, args: Args<'a>) -> Args<'a> {
        args.buffer("ce_stats", self.stats)
            .buffer("ce_labels", self.labels)
    }
}

/// `loss[0] = Σ token_loss / max(N, 1)` with `N` read from `count`: the mean over the
/// non-masked tokens (0 when all are masked, or there are none). The last step of a chunked
/// loss, over the `[T]` token losses of every chunk.
pub fn execute_cross_entropy_mean(
    rec: &mut Recorder<'_>,
    token_loss: &GpuBuffer<f32>,
    count: &GpuBuffer<u32>,
    loss: &mut GpuBuffer<f32>,
) -> Result<(), ExecError> {
    let name = cross_entropy_mean::NAME;
    expect_len(name, "count", count, 1, "N")?;
    expect_len(name, "loss", loss, 1, "the mean")?;
    let tokens = expect_u32(name, "tokens", token_loss.len())?;
    if tokens == 0 {
        return rec.fill(loss, 0.0);
    }
    expect_loss_loops(rec.gpu(), name, (token_loss.len(), 0))?;
    let wg = invocations(&rec.gpu().kernel_limits());
    let kernel = rec
        .gpu()
        .kernel(&cross_entropy_mean::key(wg), cross_entropy_mean::body)?;
    let args = Args::new()
        .buffer("token_loss", token_loss)
        .buffer("count", count)
        .buffer("loss", loss)
        .param("tokens", tokens);
    rec.launch(&kernel, &args, Grid::Workgroups([1, 1, 1]))
}

fn one_workgroup_per_token(sizes: &Sizes) -> Grid {
    Grid::WorkgroupPerItem(u64::from(sizes.tokens))
}

/// Bind a `[T, V]` buffer as the row kernels read it: `vec4`s when `V` is a multiple of 4.
fn bind_rows<'a>(
    args: Args<'a>,
    name: &'a str,
    buffer: &'a GpuBuffer<f32>,
    sizes: &Sizes,
) -> Args<'a> {
    if sizes.vocab.is_multiple_of(4) {
        args.buffer_vec4(name, buffer)
    } else {
        args.buffer(name, buffer)
    }
}

/// f64 references.
pub mod reference {
    /// Whether `label` is a class of a `vocab`-sized vocabulary (else the token is masked).
    pub fn is_target(label: i32, vocab: usize) -> bool {
        usize::try_from(label).is_ok_and(|y| y < vocab)
    }

    /// `logsumexp` of one row, with the maximum subtracted.
    fn logsumexp(row: &[f64]) -> f64 {
        let m = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        m + row.iter().map(|z| (z - m).exp()).sum::<f64>().ln()
    }

    /// `(token_loss, loss, N)`: each token's `logsumexp(z_t) − z_t[y_t]` (0 where masked), their
    /// mean over the `N` non-masked tokens (0 when `N = 0`), and `N`.
    pub fn cross_entropy_forward(
        logits: &[f64],
        labels: &[i32],
        vocab: usize,
    ) -> (Vec<f64>, f64, usize) {
        let token_loss: Vec<f64> = labels
            .iter()
            .zip(logits.chunks(vocab))
            .map(|(&y, row)| {
                if is_target(y, vocab) {
                    logsumexp(row) - row[y as usize]
                } else {
                    0.0
                }
            })
            .collect();
        let n = labels.iter().filter(|&&y| is_target(y, vocab)).count();
        let loss = token_loss.iter().sum::<f64>() / n.max(1) as f64;
        (token_loss, loss, n)
    }

    /// `d loss / d logits = (softmax(z_t) − onehot(y_t)) / N` per non-masked row, 0 elsewhere.
    pub fn cross_entropy_backward(logits: &[f64], labels: &[i32], vocab: usize) -> Vec<f64> {
        let n = labels.iter().filter(|&&y| is_target(y, vocab)).count();
        let mut d = vec![0.0; logits.len()];
        for ((&y, row), d_row) in labels
            .iter()
            .zip(logits.chunks(vocab))
            .zip(d.chunks_mut(vocab))
        {
            if !is_target(y, vocab) {
                continue;
            }
            let lse = logsumexp(row);
            for (c, (z, dz)) in row.iter().zip(d_row.iter_mut()).enumerate() {
                let onehot = if c == y as usize { 1.0 } else { 0.0 };
                *dz = ((z - lse).exp() - onehot) / n as f64;
            }
        }
        d
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a device that allows fewer than 1024 invocations every kernel here takes what it allows,
    /// and builds (naga validates it) at that size.
    #[test]
    fn kernels_fit_devices_with_smaller_workgroups() {
        let small = Limits {
            max_invocations_per_workgroup: 256,
            max_workgroup_size: [256, 256, 64],
            ..Limits::default()
        };
        assert_eq!(invocations(&Limits::default()), 1024);
        assert_eq!(invocations(&small), 256);
        for wg in [256, 64] {
            for vocab in [32_000, 50_257] {
                let row = row_key(ROW, vocab, wg, Features::SUBGROUPS);
                let forward = row_key(ROW_FORWARD, vocab, wg, Features::NONE);
                Kernel::build(&row, row_with_grad).unwrap();
                Kernel::build(&forward, row_loss_only).unwrap();
                cross_entropy_count::build(vocab, wg).unwrap();
            }
            cross_entropy_mean::build(wg).unwrap();
        }
    }
}
