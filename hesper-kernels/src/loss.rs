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
//! 2. `cross_entropy` (or `cross_entropy_forward`): one workgroup per token. Its invocations
//!    stride over the row in chunks of the workgroup size with an online log-sum-exp (running
//!    max and rescaled sum, one `exp` per logit), combine with two workgroup reductions, and —
//!    with the gradient — stride again to write `dz`: the row is read twice and written once, and
//!    nothing larger than a chunk is ever held. Masked rows skip the reductions (the branch is
//!    uniform: the label is read from a read-only buffer at the workgroup's row).
//! 3. `cross_entropy_mean` (one workgroup): `Σ_t loss_t / max(N, 1)`.
//!
//! The vocabulary is a shape (fixed per model; it keys the pipeline); the token count is a
//! runtime value (the last batch may be shorter).

use hesper_dsl::prelude::*;
use hesper_exec::{Args, ExecError, GpuBuffer, Grid, Recorder};

use crate::{expect_len, expect_u32};

/// The label of a masked token (any label outside `0..vocab` is masked as well).
pub const IGNORE_INDEX: i32 = -100;

/// Invocations per workgroup of every kernel here.
const WORKGROUP: u32 = 256;

/// Whether `label` is a class of the vocabulary (else the token is masked).
#[kernel_fn]
fn is_target(label: i32, vocab: u32) -> bool {
    label >= 0 && (label as u32) < vocab
}

/// The online log-sum-exp `(m, s)` with `s = Σ exp(x − m)`, after one more logit `x`. One `exp`:
/// a new maximum rescales the sum by `exp(m − x)`, any other `x` adds `exp(x − m)`.
#[kernel_fn]
fn logsumexp_step(acc: Vec2<f32>, x: f32) -> Vec2<f32> {
    let e = exp(-abs(x - acc.x));
    vec2(max(acc.x, x), select(x > acc.x, acc.y * e + 1.0, acc.y + e))
}

/// `count[0] = N`: one workgroup strides over the labels.
#[kernel(workgroup_size = WORKGROUP)]
fn cross_entropy_count(
    labels: &[i32],
    count: &mut [u32],
    #[runtime] tokens: u32,
    #[shape] vocab: u32,
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

/// One workgroup per token: its loss, and its row of `dz` (reads `N` from `count`).
#[kernel(workgroup_size = WORKGROUP)]
fn cross_entropy(
    logits: &[f32],
    labels: &[i32],
    count: &[u32],
    d_logits: &mut [f32],
    token_loss: &mut [f32],
    #[runtime] tokens: u32,
    #[shape] vocab: u32,
) {
    // Past 65535 tokens the workgroups are laid out 2-D.
    let row = workgroup_index();
    if row >= tokens {
        return;
    }
    let base = row * vocab;
    let label = labels[row];
    if is_target(label, vocab) {
        let mut acc = vec2(f32::MIN, 0.0);
        for c in (local_index()..vocab).step_by(invocations()) {
            acc = logsumexp_step(acc, logits[base + c]);
        }
        let row_max = workgroup_reduce(acc.x, Reduce::Max);
        let sum = workgroup_reduce(acc.y * exp(acc.x - row_max), Reduce::Sum);
        let target = label as u32;
        if local_index() == 0u32 {
            // `row_max − z_y` first: exact for nearby values, where `logsumexp − z_y` would cancel.
            token_loss[row] = row_max - logits[base + target] + log(sum);
        }
        let inv_n = 1.0 / (count[0u32] as f32);
        let p_scale = inv_n / sum;
        for c in (local_index()..vocab).step_by(invocations()) {
            let onehot = select(c == target, inv_n, 0.0);
            d_logits[base + c] = exp(logits[base + c] - row_max) * p_scale - onehot;
        }
    } else {
        if local_index() == 0u32 {
            token_loss[row] = 0.0;
        }
        for c in (local_index()..vocab).step_by(invocations()) {
            d_logits[base + c] = 0.0;
        }
    }
}

/// One workgroup per token: its loss only.
#[kernel(workgroup_size = WORKGROUP)]
fn cross_entropy_forward(
    logits: &[f32],
    labels: &[i32],
    token_loss: &mut [f32],
    #[runtime] tokens: u32,
    #[shape] vocab: u32,
) {
    let row = workgroup_index();
    if row >= tokens {
        return;
    }
    let label = labels[row];
    if is_target(label, vocab) {
        let base = row * vocab;
        let mut acc = vec2(f32::MIN, 0.0);
        for c in (local_index()..vocab).step_by(invocations()) {
            acc = logsumexp_step(acc, logits[base + c]);
        }
        let row_max = workgroup_reduce(acc.x, Reduce::Max);
        let sum = workgroup_reduce(acc.y * exp(acc.x - row_max), Reduce::Sum);
        if local_index() == 0u32 {
            token_loss[row] = row_max - logits[base + (label as u32)] + log(sum);
        }
    } else if local_index() == 0u32 {
        token_loss[row] = 0.0;
    }
}

/// `loss[0] = Σ_t token_loss[t] / max(N, 1)` (masked tokens' losses are 0): one workgroup.
#[kernel(workgroup_size = WORKGROUP)]
fn cross_entropy_mean(token_loss: &[f32], count: &[u32], loss: &mut [f32], #[runtime] tokens: u32) {
    let mut sum = 0.0;
    for t in (local_index()..tokens).step_by(invocations()) {
        sum += token_loss[t];
    }
    let total = workgroup_reduce(sum, Reduce::Sum);
    if local_index() == 0u32 {
        loss[0u32] = total / (max(count[0u32], 1u32) as f32);
    }
}

/// The vocabulary the snapshots are taken at (Llama 2's).
const SNAPSHOT_VOCAB: u32 = 32_000;

/// The WGSL of each kernel of this module at a Llama-sized vocabulary (for snapshots and review).
pub fn kernels() -> Result<Vec<Kernel>, hesper_dsl::DslError> {
    Ok(vec![
        cross_entropy_count::build(SNAPSHOT_VOCAB)?,
        cross_entropy::build(SNAPSHOT_VOCAB)?,
        cross_entropy_forward::build(SNAPSHOT_VOCAB)?,
        cross_entropy_mean::build()?,
    ])
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

/// The checked sizes of one launch: `T`, and `V` as the kernels take them.
struct Sizes {
    tokens: u32,
    vocab: u32,
}

/// Check every buffer against `T = labels.len()` and `vocab` before anything is recorded.
fn check(
    row_kernel: &str,
    logits: &GpuBuffer<f32>,
    labels: &GpuBuffer<i32>,
    vocab: usize,
    out: &LossOutputs<'_>,
) -> Result<Sizes, ExecError> {
    if vocab == 0 {
        return Err(ExecError::Dispatch {
            kernel: row_kernel.into(),
            what: "vocab = 0".into(),
            why: "a softmax needs at least one class".into(),
        });
    }
    let t = labels.len();
    let elements = t.saturating_mul(vocab);
    expect_len(row_kernel, "logits", logits, elements, "labels × vocab")?;
    expect_len(row_kernel, "token_loss", out.token_loss, t, "one per label")?;
    expect_len(cross_entropy_mean::NAME, "loss", out.loss, 1, "the mean")?;
    expect_len(cross_entropy_count::NAME, "count", out.count, 1, "N")?;
    expect_u32(row_kernel, "logits elements", elements)?;
    Ok(Sizes {
        tokens: expect_u32(row_kernel, "tokens", t)?,
        vocab: expect_u32(row_kernel, "vocab", vocab)?,
    })
}

/// Cross-entropy forward and backward, fused: `d_logits` (`[T, V]`, overwritten, 0 on masked
/// rows), the per-token losses, their mean and `N` (see [`LossOutputs`]). `logits` are `[T, V]`
/// row-major and `labels` `[T]`, with `T = labels.len()` and `V = vocab`.
pub fn execute_cross_entropy(
    rec: &mut Recorder<'_>,
    logits: &GpuBuffer<f32>,
    labels: &GpuBuffer<i32>,
    vocab: usize,
    d_logits: &mut GpuBuffer<f32>,
    out: LossOutputs<'_>,
) -> Result<(), ExecError> {
    let name = cross_entropy::NAME;
    let sizes = check(name, logits, labels, vocab, &out)?;
    expect_len(name, "d_logits", d_logits, logits.len(), "as logits")?;
    if sizes.tokens == 0 {
        return no_tokens(rec, &out);
    }
    count(rec, labels, &sizes, out.count)?;
    let kernel = rec
        .gpu()
        .kernel(&cross_entropy::key(sizes.vocab), cross_entropy::body)?;
    let args = Args::new()
        .buffer("logits", logits)
        .buffer("labels", labels)
        .buffer("count", out.count)
        .buffer("d_logits", d_logits)
        .buffer("token_loss", out.token_loss)
        .param("tokens", sizes.tokens);
    rec.launch(&kernel, &args, one_workgroup_per_token(&sizes))?;
    mean(rec, &sizes, &out)
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
    let sizes = check(cross_entropy_forward::NAME, logits, labels, vocab, &out)?;
    if sizes.tokens == 0 {
        return no_tokens(rec, &out);
    }
    count(rec, labels, &sizes, out.count)?;
    let kernel = rec.gpu().kernel(
        &cross_entropy_forward::key(sizes.vocab),
        cross_entropy_forward::body,
    )?;
    let args = Args::new()
        .buffer("logits", logits)
        .buffer("labels", labels)
        .buffer("token_loss", out.token_loss)
        .param("tokens", sizes.tokens);
    rec.launch(&kernel, &args, one_workgroup_per_token(&sizes))?;
    mean(rec, &sizes, &out)
}

fn one_workgroup_per_token(sizes: &Sizes) -> Grid {
    Grid::Threads(u64::from(sizes.tokens) * u64::from(WORKGROUP))
}

/// No tokens: `N` and the loss are 0, and the empty per-token buffers need no launch.
fn no_tokens(rec: &mut Recorder<'_>, out: &LossOutputs<'_>) -> Result<(), ExecError> {
    rec.fill(out.loss, 0.0)?;
    rec.fill(out.count, 0)
}

fn count(
    rec: &mut Recorder<'_>,
    labels: &GpuBuffer<i32>,
    sizes: &Sizes,
    count: &GpuBuffer<u32>,
) -> Result<(), ExecError> {
    let kernel = rec.gpu().kernel(
        &cross_entropy_count::key(sizes.vocab),
        cross_entropy_count::body,
    )?;
    let args = Args::new()
        .buffer("labels", labels)
        .buffer("count", count)
        .param("tokens", sizes.tokens);
    rec.launch(&kernel, &args, Grid::Workgroups([1, 1, 1]))
}

fn mean(rec: &mut Recorder<'_>, sizes: &Sizes, out: &LossOutputs<'_>) -> Result<(), ExecError> {
    let kernel = rec
        .gpu()
        .kernel(&cross_entropy_mean::key(), cross_entropy_mean::body)?;
    let args = Args::new()
        .buffer("token_loss", out.token_loss)
        .buffer("count", out.count)
        .buffer("loss", out.loss)
        .param("tokens", sizes.tokens);
    rec.launch(&kernel, &args, Grid::Workgroups([1, 1, 1]))
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
