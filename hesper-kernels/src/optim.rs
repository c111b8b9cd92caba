//! The optimizer (KERNELS.md "AdamW"): AdamW with bias correction and decoupled weight decay,
//! global-norm gradient clipping, and LoRA+ learning rates.
//!
//! Per step, for every trained tensor θ with gradient g and state m, v (updated in place):
//! ```text
//! g ← c·g                      c = min(1, max_norm / (‖all gradients‖ + 1e-6))   (PyTorch's)
//! m ← β1·m + (1 − β1)·g
//! v ← β2·v + (1 − β2)·g²
//! θ ← θ − lr·(m̂ / (√v̂ + ε) + λ·θ)     m̂ = m / (1 − β1^t),  v̂ = v / (1 − β2^t)
//! ```
//!
//! What is compile-time and what is not: the workgroup size and whether clipping is on are the
//! pipeline's shape; `lr`, β1, β2, ε, λ, `max_norm`, the bias corrections and the element count
//! are runtime scalars, so a new step (or a new schedule, or new hyperparameters) reuses the
//! pipelines. The bias corrections `1 − β^t` are computed on the host in f64 (formed in f32 on
//! the GPU they lose ~1e-5).
//!
//! Clipping needs no CPU round trip: [`execute_global_grad_norm`] leaves ‖g‖ in a one-element
//! buffer, and [`execute_adamw`] with [`Clip::GlobalNorm`] reads it and scales the gradient by
//! the coefficient inside the update, so the gradients themselves are never rewritten. The
//! norm is a two-pass reduction without float atomics: pass 1 (`grad_norm_partials`, one launch
//! per gradient buffer) writes one sum of squares per workgroup into that buffer's own slice of
//! a shared partials buffer; pass 2 (`grad_norm_finish`, one workgroup) adds the partials up and
//! takes the square root.

use hesper_dsl::prelude::*;
use hesper_exec::{Args, ExecError, GpuBuffer, Grid, Recorder};

use crate::{expect_len, expect_u32};

/// Invocations per workgroup of every kernel here.
const WG: u32 = 256;

/// At most this many workgroups (so partials) per gradient buffer in pass 1; larger buffers are
/// walked grid-stride. It bounds pass 2's work to one partial per invocation per buffer.
const MAX_PARTIALS_PER_BUFFER: u32 = WG;

/// AdamW's hyperparameters. The default is PyTorch's `torch.optim.AdamW`. Held in f64: the
/// host forms `1 − β` and the bias corrections `1 − β^t` in f64 and passes them as runtime
/// values (formed on the GPU from `f32(0.999)`, `1 − β2` is 1.3e-5 off, and so is every second
/// moment).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamW {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    /// λ, decoupled: it shrinks θ directly and never enters m or v.
    pub weight_decay: f64,
}

impl Default for AdamW {
    fn default() -> Self {
        AdamW {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }
}

/// Whether and how a step clips the gradient.
#[derive(Clone, Copy)]
pub enum Clip<'a> {
    None,
    /// Scale the gradient by `min(1, max_norm / (norm + 1e-6))`, where `norm` is the one-element
    /// buffer [`execute_global_grad_norm`] wrote (over all the gradients clipped together).
    GlobalNorm {
        norm: &'a GpuBuffer<f32>,
        max_norm: f32,
    },
}

/// The values of one optimizer step.
#[derive(Clone, Copy)]
pub struct Step<'a> {
    pub lr: f32,
    /// The step number, from 1 (Adam's bias corrections `1 − β^t` are 0 at t = 0).
    pub t: u32,
    pub clip: Clip<'a>,
}

/// LoRA+ (Hayou et al., 2024): the B factor trains with `ratio` times A's learning rate (one
/// rate for both learns features inefficiently at large width; entrenar used 16). Give each
/// tensor its rate in its [`Step`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LoraPlus {
    pub ratio: f32,
}

impl LoraPlus {
    /// The learning rates `(lr_A, lr_B)` for A's learning rate `lr_a`.
    pub fn learning_rates(&self, lr_a: f32) -> (f32, f32) {
        (lr_a, self.ratio * lr_a)
    }
}

/// The pipeline key of AdamW: `clip` adds the norm binding and `max_norm`.
fn adamw_key(clip: bool) -> KernelKey {
    KernelKey::new("adamw")
        .workgroup_size(WG)
        .shape("clip", clip)
}

/// AdamW over one tensor, one `vec4<f32>` per invocation. Written with the builder because the
/// clipping variant declares a binding the plain one does not have.
fn adamw_body(k: &mut KernelBuilder) {
    let clip = k.shape::<bool>("clip");
    let theta = k.storage_rw::<Vec4<f32>>("theta");
    let grad = k.storage::<Vec4<f32>>("grad");
    let m = k.storage_rw::<Vec4<f32>>("m");
    let v = k.storage_rw::<Vec4<f32>>("v");
    let n4 = k.param::<u32>("n4");
    let lr = k.param::<f32>("lr");
    let beta1 = k.param::<f32>("beta1");
    let beta2 = k.param::<f32>("beta2");
    let one_minus_beta1 = k.param::<f32>("one_minus_beta1");
    let one_minus_beta2 = k.param::<f32>("one_minus_beta2");
    let eps = k.param::<f32>("eps");
    let weight_decay = k.param::<f32>("weight_decay");
    let bias_correction1 = k.param::<f32>("bias_correction1");
    let bias_correction2 = k.param::<f32>("bias_correction2");
    let mut live = k.global_index().lt(&n4);
    let clip_coef = clip.then(|| {
        let grad_norm = k.storage::<f32>("grad_norm");
        let max_norm = k.param::<f32>("max_norm");
        let norm = k.let_("norm", grad_norm.at(0u32));
        // A NaN or infinite norm (a gradient that is not finite) skips the step: θ, m and v keep
        // their values. Tested on the bits: drivers may fold `x != x` away.
        let finite = (norm.bitcast::<u32>() & 0x7f80_0000u32).ne(0x7f80_0000u32);
        live = live.clone().and(finite);
        k.let_("clip_coef", (max_norm / (norm + 1e-6f32)).min(1.0f32))
    });
    let i = k.global_index();
    k.if_(live, |k| {
        let g = match clip_coef {
            Some(c) => grad.at(&i) * c,
            None => grad.at(&i),
        };
        let g = k.let_("g", g);
        let m_new = k.let_("m_new", m.at(&i) * beta1 + g.clone() * one_minus_beta1);
        let v_new = k.let_("v_new", v.at(&i) * beta2 + g.clone() * g * one_minus_beta2);
        let m_hat = m_new.clone() / bias_correction1;
        let v_hat = v_new.clone() / bias_correction2;
        let th = k.let_("th", theta.at(&i));
        let update = m_hat / (v_hat.sqrt() + eps) + th.clone() * weight_decay;
        k.store(&theta, &i, th - update * lr);
        k.store(&m, &i, m_new);
        k.store(&v, &i, v_new);
    });
}

/// The sum of squares of the lanes of `g` that hold elements (`base + lane < n`): a buffer's
/// padding past its last element, which vec4 kernels may have written, must not count.
#[kernel_fn]
fn sum_sq_live(g: Vec4<f32>, base: u32, n: u32) -> f32 {
    select(base < n, g.x * g.x, 0.0)
        + select(base + 1 < n, g.y * g.y, 0.0)
        + select(base + 2 < n, g.z * g.z, 0.0)
        + select(base + 3 < n, g.w * g.w, 0.0)
}

/// Pass 1 of the global gradient norm over one buffer of `n` elements: workgroup `w` writes
/// the sum of squares of its grid-stride share of `grad` to `partials[first + w]`.
#[kernel(workgroup_size = WG)]
fn grad_norm_partials(
    grad: &[Vec4<f32>],
    partials: &mut [f32],
    #[runtime] n: u32,
    #[runtime] first: u32,
) {
    let mut sum = 0.0;
    for i in (global_index()..(n + 3) / 4).step_by(total_invocations()) {
        sum += sum_sq_live(grad[i], 4 * i, n);
    }
    let total = workgroup_reduce(sum, Reduce::Sum);
    if local_index() == 0 {
        partials[first + workgroup_id().x] = total;
    }
}

/// Pass 2 of the global gradient norm (one workgroup): `norm[0] = √(Σ partials)`.
#[kernel(workgroup_size = WG)]
fn grad_norm_finish(partials: &[f32], norm: &mut [f32], #[runtime] count: u32) {
    let mut sum = 0.0;
    for i in (local_index()..count).step_by(WG) {
        sum += partials[i];
    }
    let total = workgroup_reduce(sum, Reduce::Sum);
    if local_index() == 0 {
        norm[0] = sqrt(total);
    }
}

/// The WGSL of each kernel of this module (AdamW without and with clipping, then the norm's
/// two passes), for snapshots and review.
pub fn kernels() -> Result<Vec<Kernel>, hesper_dsl::DslError> {
    Ok(vec![
        Kernel::build(&adamw_key(false), adamw_body)?,
        Kernel::build(&adamw_key(true), adamw_body)?,
        grad_norm_partials::build()?,
        grad_norm_finish::build()?,
    ])
}

/// Each kernel of this module at any shape, within `limits`, for [`crate::catalog`].
pub(crate) mod build {
    use super::*;
    use crate::catalog::Failure;

    pub(crate) fn adamw(clip: bool, limits: &Limits) -> Result<Kernel, Failure> {
        Ok(Kernel::build_with_limits(
            &adamw_key(clip),
            limits,
            adamw_body,
        )?)
    }

    pub(crate) fn grad_norm_partials(limits: &Limits) -> Result<Kernel, Failure> {
        let key = super::grad_norm_partials::key();
        Ok(Kernel::build_with_limits(
            &key,
            limits,
            super::grad_norm_partials::body,
        )?)
    }

    pub(crate) fn grad_norm_finish(limits: &Limits) -> Result<Kernel, Failure> {
        let key = super::grad_norm_finish::key();
        Ok(Kernel::build_with_limits(
            &key,
            limits,
            super::grad_norm_finish::body,
        )?)
    }
}

/// `(1 − β1^t, 1 − β2^t)`, formed in f64, once the step's values are checked: an error for
/// t = 0 or a β outside [0, 1) (a correction 0 or negative), and for an ε, decay, learning
/// rate or `max_norm` that is not finite or out of range.
fn checked_bias_corrections(
    opt: &AdamW,
    (t, lr): (u32, f32),
    max_norm: Option<f32>,
) -> Result<(f32, f32), ExecError> {
    let err = |param: &str, expected: &str, given: String| ExecError::Param {
        kernel: "adamw".into(),
        param: param.into(),
        expected: expected.into(),
        given,
    };
    if t == 0 {
        return Err(err("t", "a step number ≥ 1", "0".into()));
    }
    for (param, beta) in [("beta1", opt.beta1), ("beta2", opt.beta2)] {
        if !(0.0..1.0).contains(&beta) {
            return Err(err(param, "a value in [0, 1)", beta.to_string()));
        }
    }
    let finite_at_least = |param: &str, value: f64, low: f64, strict: bool| {
        let ok = value.is_finite() && if strict { value > low } else { value >= low };
        if ok {
            Ok(())
        } else {
            let bound = if strict { "above" } else { "at least" };
            Err(err(
                param,
                &format!("a finite number {bound} {low}"),
                value.to_string(),
            ))
        }
    };
    // ε = 0 divides 0 by 0 where a gradient and its moments are 0; a negative decay grows θ.
    finite_at_least("eps", opt.eps, 0.0, true)?;
    finite_at_least("weight_decay", opt.weight_decay, 0.0, false)?;
    finite_at_least("lr", lr as f64, 0.0, false)?;
    if let Some(max_norm) = max_norm {
        // A negative max_norm would reverse the update (gradient ascent).
        finite_at_least("max_norm", max_norm as f64, 0.0, true)?;
    }
    let correction = |beta: f64| (1.0 - beta.powf(t as f64)) as f32;
    Ok((correction(opt.beta1), correction(opt.beta2)))
}

/// One AdamW step on one tensor: updates `theta`, `m` and `v` in place from `grad` (all of one
/// length; `m` and `v` start at zero).
///
/// A gradient that is not finite: with [`Clip::GlobalNorm`], its norm is not finite either and
/// the step leaves `theta`, `m` and `v` as they were (the step is skipped; read the norm to know
/// it was). Without clipping, NaN or ∞ reaches `m`, `v` and `theta` — check the gradients first.
pub fn execute_adamw(
    rec: &mut Recorder<'_>,
    opt: &AdamW,
    step: &Step<'_>,
    theta: &mut GpuBuffer<f32>,
    grad: &GpuBuffer<f32>,
    m: &mut GpuBuffer<f32>,
    v: &mut GpuBuffer<f32>,
) -> Result<(), ExecError> {
    let name = "adamw";
    let n = theta.len();
    expect_len(name, "grad", grad, n, "as theta")?;
    expect_len(name, "m", m, n, "as theta")?;
    expect_len(name, "v", v, n, "as theta")?;
    if let Clip::GlobalNorm { norm, .. } = step.clip {
        expect_len(name, "grad_norm", norm, 1, "the global gradient norm")?;
    }
    let max_norm = match step.clip {
        Clip::GlobalNorm { max_norm, .. } => Some(max_norm),
        Clip::None => None,
    };
    let (bias_correction1, bias_correction2) =
        checked_bias_corrections(opt, (step.t, step.lr), max_norm)?;
    if n == 0 {
        return Ok(());
    }
    let n4 = expect_u32(name, "elements / 4", n.div_ceil(4))?;
    let clip = matches!(step.clip, Clip::GlobalNorm { .. });
    let kernel = rec.gpu().kernel(&adamw_key(clip), adamw_body)?;
    let mut args = Args::new()
        .buffer_vec4("theta", theta)
        .buffer_vec4("grad", grad)
        .buffer_vec4("m", m)
        .buffer_vec4("v", v)
        .param("n4", n4)
        .param("lr", step.lr)
        .param("beta1", opt.beta1 as f32)
        .param("beta2", opt.beta2 as f32)
        .param("one_minus_beta1", (1.0 - opt.beta1) as f32)
        .param("one_minus_beta2", (1.0 - opt.beta2) as f32)
        .param("eps", opt.eps as f32)
        .param("weight_decay", opt.weight_decay as f32)
        .param("bias_correction1", bias_correction1)
        .param("bias_correction2", bias_correction2);
    if let Clip::GlobalNorm { norm, max_norm } = step.clip {
        args = args.buffer("grad_norm", norm).param("max_norm", max_norm);
    }
    rec.launch(&kernel, &args, Grid::Threads(n4 as u64))
}

/// Pass-1 workgroups (so partials) for a gradient buffer of `len` elements.
fn partial_groups(len: usize) -> usize {
    len.div_ceil(4)
        .div_ceil(WG as usize)
        .min(MAX_PARTIALS_PER_BUFFER as usize)
}

/// The length of the partials buffer [`execute_global_grad_norm`] needs for gradient buffers of
/// these lengths (at least 1, since a binding cannot be empty).
pub fn grad_norm_partials_len(lens: impl IntoIterator<Item = usize>) -> usize {
    lens.into_iter().map(partial_groups).sum::<usize>().max(1)
}

/// `norm[0] = √(Σ over all `grads` of g²)`: the global gradient norm that clipping uses.
/// `partials` is scratch of [`grad_norm_partials_len`] elements; `norm` has one element.
pub fn execute_global_grad_norm(
    rec: &mut Recorder<'_>,
    grads: &[&GpuBuffer<f32>],
    partials: &mut GpuBuffer<f32>,
    norm: &mut GpuBuffer<f32>,
) -> Result<(), ExecError> {
    let why = format!(
        "grad_norm_partials_len of the {} gradient buffers",
        grads.len()
    );
    let len = grad_norm_partials_len(grads.iter().map(|g| g.len()));
    expect_len(grad_norm_partials::NAME, "partials", partials, len, &why)?;
    expect_len(grad_norm_finish::NAME, "norm", norm, 1, "the norm")?;
    expect_u32(grad_norm_finish::NAME, "partials", len)?;
    let pass1 = rec
        .gpu()
        .kernel(&grad_norm_partials::key(), grad_norm_partials::body)?;
    // Each buffer's partials start where the previous buffer's end.
    let mut first = 0u32;
    for grad in grads {
        let groups = partial_groups(grad.len()) as u32;
        if groups == 0 {
            continue;
        }
        let n = expect_u32(grad_norm_partials::NAME, "elements", grad.len())?;
        let args = Args::new()
            .buffer_vec4("grad", grad)
            .buffer("partials", partials)
            .param("n", n)
            .param("first", first);
        rec.launch(&pass1, &args, Grid::Workgroups([groups, 1, 1]))?;
        first += groups;
    }
    let pass2 = rec
        .gpu()
        .kernel(&grad_norm_finish::key(), grad_norm_finish::body)?;
    let args = Args::new()
        .buffer("partials", partials)
        .buffer("norm", norm)
        .param("count", first);
    rec.launch(&pass2, &args, Grid::Workgroups([1, 1, 1]))
}

/// f64 references.
pub mod reference {
    /// One tensor's trained values and AdamW state.
    #[derive(Clone, Debug)]
    pub struct State {
        pub theta: Vec<f64>,
        pub m: Vec<f64>,
        pub v: Vec<f64>,
    }

    /// One AdamW step, literally as KERNELS.md writes it (`grad` already clipped).
    pub fn adamw_step(opt: &super::AdamW, lr: f64, t: u32, grad: &[f64], s: &mut State) {
        let (b1, b2) = (opt.beta1, opt.beta2);
        let (eps, wd) = (opt.eps, opt.weight_decay);
        let (bc1, bc2) = (1.0 - b1.powf(t as f64), 1.0 - b2.powf(t as f64));
        for (i, g) in grad.iter().enumerate() {
            s.m[i] = b1 * s.m[i] + (1.0 - b1) * g;
            s.v[i] = b2 * s.v[i] + (1.0 - b2) * g * g;
            let (m_hat, v_hat) = (s.m[i] / bc1, s.v[i] / bc2);
            s.theta[i] -= lr * (m_hat / (v_hat.sqrt() + eps) + wd * s.theta[i]);
        }
    }

    /// `√(Σ g²)` over all buffers.
    pub fn global_grad_norm(grads: &[&[f64]]) -> f64 {
        grads
            .iter()
            .flat_map(|g| g.iter())
            .map(|g| g * g)
            .sum::<f64>()
            .sqrt()
    }

    /// PyTorch's `clip_grad_norm_` coefficient.
    pub fn clip_coefficient(norm: f64, max_norm: f64) -> f64 {
        (max_norm / (norm + 1e-6)).min(1.0)
    }
}
