//! FFN activations, forward and backward (KERNELS.md "Backward formulas"):
//! - ReLU²×Mul (BitNet, Hesper): `h = relu(g)²·u`; `du = dh·relu(g)²`, `dg = dh·u·2·relu(g)`.
//! - SwiGLU (Llama, entrenar): `h = silu(g)·u`, `σ = sigmoid(g)`; `du = dh·g·σ`,
//!   `dg = dh·u·σ·(1 + g·(1 − σ))`.
//!
//! Elementwise and bandwidth-bound: one `vec4<f32>` per invocation (the buffers' allocations are
//! padded to 16 bytes, so any length works).
//!
//! SwiGLU also reads its gate and up from one packed `[rows, 2·I]` array, each row a gate row
//! then an up row (`swiglu_packed_*`): what one GEMM over `[W_gate; W_up]` writes, so the step
//! computes both projections in one launch; its backward writes the gradients packed the same
//! way, for one GEMM back through `[W_gate; W_up]`. The `_f16` kernels read that array as f16
//! (what a mixed-precision step saves: half the bytes written, kept and read) and write its
//! gradient as f16, scaled by a power of two as the tensor-core GEMM would scale it before
//! rounding (`linear::Gemm::input_exponent`), so that GEMM reads it as it is.

use hesper_dsl::prelude::*;
use hesper_exec::half::f16;
use hesper_exec::{Args, Element, ExecError, GpuBuffer, Grid, Recorder};

use crate::{expect_len, expect_rows, expect_u32};

#[kernel(workgroup_size = 256)]
fn relu_sqr_mul_forward(
    gate: &[Vec4<f32>],
    up: &[Vec4<f32>],
    h: &mut [Vec4<f32>],
    #[runtime] n4: u32,
) {
    let i = global_index();
    if i < n4 {
        let r = gate[i].max(Expr::<Vec4<f32>>::splat(0.0));
        h[i] = r * r * up[i];
    }
}

#[kernel(workgroup_size = 256)]
fn relu_sqr_mul_backward(
    gate: &[Vec4<f32>],
    up: &[Vec4<f32>],
    d_h: &[Vec4<f32>],
    d_gate: &mut [Vec4<f32>],
    d_up: &mut [Vec4<f32>],
    #[runtime] n4: u32,
) {
    let i = global_index();
    if i < n4 {
        let r = gate[i].max(Expr::<Vec4<f32>>::splat(0.0));
        let dh = d_h[i];
        d_up[i] = dh * r * r;
        d_gate[i] = dh * up[i] * 2.0 * r;
    }
}

#[kernel(workgroup_size = 256)]
fn swiglu_forward(gate: &[Vec4<f32>], up: &[Vec4<f32>], h: &mut [Vec4<f32>], #[runtime] n4: u32) {
    let i = global_index();
    if i < n4 {
        let g = gate[i];
        h[i] = g / (1.0 + exp(-g)) * up[i];
    }
}

#[kernel(workgroup_size = 256)]
fn swiglu_backward(
    gate: &[Vec4<f32>],
    up: &[Vec4<f32>],
    d_h: &[Vec4<f32>],
    d_gate: &mut [Vec4<f32>],
    d_up: &mut [Vec4<f32>],
    #[runtime] n4: u32,
) {
    let i = global_index();
    if i < n4 {
        let g = gate[i];
        let dh = d_h[i];
        let sig = 1.0 / (1.0 + exp(-g));
        d_up[i] = dh * g * sig;
        d_gate[i] = dh * up[i] * sig * (1.0 + g * (1.0 - sig));
    }
}

/// `h = silu(g)·u` with row `r` of `gate_up` holding `g` then `u` (`i4` vec4s each).
#[kernel(workgroup_size = 256)]
fn swiglu_packed_forward(
    gate_up: &[Vec4<f32>],
    h: &mut [Vec4<f32>],
    #[runtime] i4: u32,
    #[runtime] n4: u32,
) {
    let i = global_index();
    if i < n4 {
        // `i = r·i4 + c`: the gate's vec4 is at `r·2·i4 + c = i + r·i4`, the up's `i4` past it.
        let at = i + i / i4 * i4;
        let g = gate_up[at];
        h[i] = g / (1.0 + exp(-g)) * gate_up[at + i4];
    }
}

/// `swiglu_backward` over the packed layout: `d_gate_up` packed as `gate_up` is.
#[kernel(workgroup_size = 256)]
fn swiglu_packed_backward(
    gate_up: &[Vec4<f32>],
    d_h: &[Vec4<f32>],
    d_gate_up: &mut [Vec4<f32>],
    #[runtime] i4: u32,
    #[runtime] n4: u32,
) {
    let i = global_index();
    if i < n4 {
        let at = i + i / i4 * i4;
        let g = gate_up[at];
        let dh = d_h[i];
        let sig = 1.0 / (1.0 + exp(-g));
        d_gate_up[at + i4] = dh * g * sig;
        d_gate_up[at] = dh * gate_up[at + i4] * sig * (1.0 + g * (1.0 - sig));
    }
}

/// [`swiglu_packed_forward`] with `gate_up` in f16, `h` in f32.
#[kernel(workgroup_size = 256)]
fn swiglu_packed_forward_f16(
    gate_up: &[Vec4<F16>],
    h: &mut [Vec4<f32>],
    #[runtime] i4: u32,
    #[runtime] n4: u32,
) {
    let i = global_index();
    if i < n4 {
        let at = i + i / i4 * i4;
        let g = gate_up[at].cast::<Vec4<f32>>();
        h[i] = g / (1.0 + exp(-g)) * gate_up[at + i4].cast::<Vec4<f32>>();
    }
}

/// [`swiglu_packed_forward`] with `gate_up` and `h` in f16 (`h` rounded as it is stored).
#[kernel(workgroup_size = 256)]
fn swiglu_packed_forward_half(
    gate_up: &[Vec4<F16>],
    h: &mut [Vec4<F16>],
    #[runtime] i4: u32,
    #[runtime] n4: u32,
) {
    let i = global_index();
    if i < n4 {
        let at = i + i / i4 * i4;
        let g = gate_up[at].cast::<Vec4<f32>>();
        let value = g / (1.0 + exp(-g)) * gate_up[at + i4].cast::<Vec4<f32>>();
        h[i] = value.cast::<Vec4<F16>>();
    }
}

/// [`swiglu_packed_backward`] with `gate_up` in f16, and `d_gate_up` in f16 multiplied by
/// `grad_scale` (a power of two) before it is rounded.
#[kernel(workgroup_size = 256)]
fn swiglu_packed_backward_f16(
    gate_up: &[Vec4<F16>],
    d_h: &[Vec4<f32>],
    d_gate_up: &mut [Vec4<F16>],
    #[runtime] grad_scale: f32,
    #[runtime] i4: u32,
    #[runtime] n4: u32,
) {
    let i = global_index();
    if i < n4 {
        let at = i + i / i4 * i4;
        let g = gate_up[at].cast::<Vec4<f32>>();
        let u = gate_up[at + i4].cast::<Vec4<f32>>();
        let dh = d_h[i] * grad_scale;
        let sig = 1.0 / (1.0 + exp(-g));
        d_gate_up[at + i4] = (dh * g * sig).cast::<Vec4<F16>>();
        d_gate_up[at] = (dh * u * sig * (1.0 + g * (1.0 - sig))).cast::<Vec4<F16>>();
    }
}

/// The WGSL of each kernel of this module at its default shapes (for snapshots and review).
pub fn kernels() -> Result<Vec<Kernel>, hesper_dsl::DslError> {
    Ok(vec![
        relu_sqr_mul_forward::build()?,
        relu_sqr_mul_backward::build()?,
        swiglu_forward::build()?,
        swiglu_backward::build()?,
        swiglu_packed_forward::build()?,
        swiglu_packed_backward::build()?,
        swiglu_packed_forward_f16::build()?,
        swiglu_packed_forward_half::build()?,
        swiglu_packed_backward_f16::build()?,
    ])
}

/// Each kernel of this module, within `limits`, for [`crate::catalog`] (none has a shape).
pub(crate) mod build {
    use super::*;
    use crate::catalog::Failure;

    /// `name(limits)`: the kernel `name` at its one key, within `limits`.
    macro_rules! builds {
        ($($name:ident),* $(,)?) => {$(
            pub(crate) fn $name(limits: &Limits) -> Result<Kernel, Failure> {
                let (key, body) = (super::$name::key(), super::$name::body);
                Ok(Kernel::build_with_limits(&key, limits, body)?)
            }
        )*};
    }

    builds!(
        relu_sqr_mul_forward,
        relu_sqr_mul_backward,
        swiglu_forward,
        swiglu_backward,
        swiglu_packed_forward,
        swiglu_packed_backward,
        swiglu_packed_forward_f16,
        swiglu_packed_forward_half,
        swiglu_packed_backward_f16,
    );
}

/// Elements as vec4s, checked against u32.
fn vec4s(kernel: &str, n: usize) -> Result<u32, ExecError> {
    expect_u32(kernel, "elements / 4", n.div_ceil(4))
}

/// `h = relu(gate)²·up` (all of one length).
pub fn execute_relu_sqr_mul_forward(
    rec: &mut Recorder<'_>,
    gate: &GpuBuffer<f32>,
    up: &GpuBuffer<f32>,
    h: &mut GpuBuffer<f32>,
) -> Result<(), ExecError> {
    let k = (
        relu_sqr_mul_forward::key(),
        relu_sqr_mul_forward::body as Body,
    );
    forward(rec, k, gate, up, h)
}

/// `h = silu(gate)·up` (all of one length).
pub fn execute_swiglu_forward(
    rec: &mut Recorder<'_>,
    gate: &GpuBuffer<f32>,
    up: &GpuBuffer<f32>,
    h: &mut GpuBuffer<f32>,
) -> Result<(), ExecError> {
    forward(
        rec,
        (swiglu_forward::key(), swiglu_forward::body),
        gate,
        up,
        h,
    )
}

/// A kernel's key and body, as `#[kernel]` generates them.
type Body = fn(&mut KernelBuilder);

fn forward(
    rec: &mut Recorder<'_>,
    (key, body): (KernelKey, Body),
    gate: &GpuBuffer<f32>,
    up: &GpuBuffer<f32>,
    h: &GpuBuffer<f32>,
) -> Result<(), ExecError> {
    let name = key.name();
    let n = gate.len();
    expect_len(name, "up", up, n, "as gate")?;
    expect_len(name, "h", h, n, "as gate")?;
    if n == 0 {
        return Ok(());
    }
    let n4 = vec4s(name, n)?;
    let kernel = rec.gpu().kernel(&key, body)?;
    let args = Args::new()
        .buffer_vec4("gate", gate)
        .buffer_vec4("up", up)
        .buffer_vec4("h", h)
        .param("n4", n4);
    rec.launch(&kernel, &args, Grid::Threads(n4 as u64))
}

/// `h = silu(gate)·up` `[rows, width]` with `gate_up` `[rows, 2·width]` packed: each row a
/// gate row then an up row. `width` must be a multiple of 4 (the rows go as vec4s).
pub fn execute_swiglu_packed_forward(
    rec: &mut Recorder<'_>,
    gate_up: &GpuBuffer<f32>,
    width: usize,
    h: &mut GpuBuffer<f32>,
) -> Result<(), ExecError> {
    let k = (
        swiglu_packed_forward::key(),
        swiglu_packed_forward::body as Body,
    );
    launch_packed(rec, k, gate_up, width, None, h, None)
}

/// `d_gate_up` (packed as `gate_up` is) of `h = silu(gate)·up` given `d_h` `[rows, width]`,
/// with `gate_up` as [`execute_swiglu_packed_forward`] reads it. Overwrites `d_gate_up`.
pub fn execute_swiglu_packed_backward(
    rec: &mut Recorder<'_>,
    gate_up: &GpuBuffer<f32>,
    width: usize,
    d_h: &GpuBuffer<f32>,
    d_gate_up: &mut GpuBuffer<f32>,
) -> Result<(), ExecError> {
    let k = (
        swiglu_packed_backward::key(),
        swiglu_packed_backward::body as Body,
    );
    launch_packed(rec, k, gate_up, width, Some(d_h), d_gate_up, None)
}

/// [`execute_swiglu_packed_forward`] with `gate_up` in f16 (as a mixed-precision step's GEMM
/// writes it), `h` in f32. Needs `SHADER_F16`.
pub fn execute_swiglu_packed_forward_f16(
    rec: &mut Recorder<'_>,
    gate_up: &GpuBuffer<f16>,
    width: usize,
    h: &mut GpuBuffer<f32>,
) -> Result<(), ExecError> {
    let k = (
        swiglu_packed_forward_f16::key(),
        swiglu_packed_forward_f16::body as Body,
    );
    launch_packed(rec, k, gate_up, width, None, h, None)
}

/// [`execute_swiglu_packed_forward`] with `gate_up` and `h` in f16: `h` rounded to nearest as
/// it is stored, for a tensor-core GEMM that would round it so as it read it (the FFN's down
/// projection). Needs `SHADER_F16`.
pub fn execute_swiglu_packed_forward_half(
    rec: &mut Recorder<'_>,
    gate_up: &GpuBuffer<f16>,
    width: usize,
    h: &mut GpuBuffer<f16>,
) -> Result<(), ExecError> {
    let k = (
        swiglu_packed_forward_half::key(),
        swiglu_packed_forward_half::body as Body,
    );
    launch_packed(rec, k, gate_up, width, None, h, None)
}

/// [`execute_swiglu_packed_backward`] with `gate_up` in f16, writing `d_gate_up` in f16 as
/// `2^grad_exponent·d_gate_up` rounded to nearest: the input a tensor-core GEMM with
/// `Gemm::input_exponent = grad_exponent` would have rounded (give that GEMM a weight scale of
/// `2^−grad_exponent` to undo it). WGSL leaves the rounding of a scaled gradient past 65504 to
/// the device (NVIDIA: ±∞), as in that GEMM. `|grad_exponent|` at most 64. Needs `SHADER_F16`.
pub fn execute_swiglu_packed_backward_f16(
    rec: &mut Recorder<'_>,
    gate_up: &GpuBuffer<f16>,
    width: usize,
    d_h: &GpuBuffer<f32>,
    grad_exponent: i32,
    d_gate_up: &mut GpuBuffer<f16>,
) -> Result<(), ExecError> {
    if grad_exponent.abs() > 64 {
        return Err(ExecError::Binding {
            kernel: "swiglu_packed_backward_f16".into(),
            binding: "grad_exponent".into(),
            expected: "at most 64 either way (2^e stays a normal f32)".into(),
            given: grad_exponent.to_string(),
        });
    }
    let k = (
        swiglu_packed_backward_f16::key(),
        swiglu_packed_backward_f16::body as Body,
    );
    let scale = Some(2f32.powi(grad_exponent));
    launch_packed(rec, k, gate_up, width, Some(d_h), d_gate_up, scale)
}

/// A packed SwiGLU's launch, its buffers checked: the forward's (`d_h` none, `out` is `h`
/// `[rows, width]`) or the backward's (`out` is `d_gate_up`, as long as `gate_up`), with
/// `grad_scale` where the kernel takes one.
fn launch_packed<G: Element, O: Element>(
    rec: &mut Recorder<'_>,
    (key, body): (KernelKey, Body),
    gate_up: &GpuBuffer<G>,
    width: usize,
    d_h: Option<&GpuBuffer<f32>>,
    out: &GpuBuffer<O>,
    grad_scale: Option<f32>,
) -> Result<(), ExecError> {
    let name = key.name();
    let (i4, n4) = match d_h {
        None => packed_shape(name, gate_up, width, out, "h")?,
        Some(d_h) => {
            let shape = packed_shape(name, gate_up, width, d_h, "d_h")?;
            expect_len(name, "d_gate_up", out, gate_up.len(), "as gate_up")?;
            shape
        }
    };
    if n4 == 0 {
        return Ok(());
    }
    let kernel = rec.gpu().kernel(&key, body)?;
    let args = Args::new().buffer_vec4("gate_up", gate_up);
    let args = match d_h {
        None => args.buffer_vec4("h", out),
        Some(d_h) => args.buffer_vec4("d_h", d_h).buffer_vec4("d_gate_up", out),
    };
    let args = match grad_scale {
        Some(scale) => args.param("grad_scale", scale),
        None => args,
    };
    let args = args.param("i4", i4).param("n4", n4);
    rec.launch(&kernel, &args, Grid::Threads(n4 as u64))
}

/// `(width / 4, rows·width / 4)` of a packed SwiGLU, checked: `width` a positive multiple of
/// 4, `gate_up` `[rows, 2·width]`, `out` (`binding`) `[rows, width]`.
fn packed_shape<G: Element, O: Element>(
    name: &str,
    gate_up: &GpuBuffer<G>,
    width: usize,
    out: &GpuBuffer<O>,
    binding: &str,
) -> Result<(u32, u32), ExecError> {
    if width == 0 || !width.is_multiple_of(4) {
        return Err(ExecError::Binding {
            kernel: name.into(),
            binding: "width".into(),
            expected: "a positive multiple of 4 (rows go as vec4s)".into(),
            given: width.to_string(),
        });
    }
    let rows = expect_rows(name, "gate_up", gate_up, 2 * width, "rows of gate then up")?;
    expect_len(name, binding, out, rows * width, "rows × width")?;
    Ok((
        expect_u32(name, "width / 4", width / 4)?,
        vec4s(name, rows * width)?,
    ))
}

/// `d_gate, d_up` of `h = relu(gate)²·up` given `d_h` (all of one length). Overwrites both.
pub fn execute_relu_sqr_mul_backward(
    rec: &mut Recorder<'_>,
    gate: &GpuBuffer<f32>,
    up: &GpuBuffer<f32>,
    d_h: &GpuBuffer<f32>,
    d_gate: &mut GpuBuffer<f32>,
    d_up: &mut GpuBuffer<f32>,
) -> Result<(), ExecError> {
    let k = (
        relu_sqr_mul_backward::key(),
        relu_sqr_mul_backward::body as Body,
    );
    backward(rec, k, [gate, up, d_h, d_gate, d_up])
}

/// `d_gate, d_up` of `h = silu(gate)·up` given `d_h` (all of one length). Overwrites both.
pub fn execute_swiglu_backward(
    rec: &mut Recorder<'_>,
    gate: &GpuBuffer<f32>,
    up: &GpuBuffer<f32>,
    d_h: &GpuBuffer<f32>,
    d_gate: &mut GpuBuffer<f32>,
    d_up: &mut GpuBuffer<f32>,
) -> Result<(), ExecError> {
    backward(
        rec,
        (swiglu_backward::key(), swiglu_backward::body),
        [gate, up, d_h, d_gate, d_up],
    )
}

fn backward(
    rec: &mut Recorder<'_>,
    (key, body): (KernelKey, Body),
    bufs: [&GpuBuffer<f32>; 5],
) -> Result<(), ExecError> {
    let name = key.name();
    let [gate, up, d_h, d_gate, d_up] = bufs;
    let n = gate.len();
    for (binding, b) in [("up", up), ("d_h", d_h), ("d_gate", d_gate), ("d_up", d_up)] {
        expect_len(name, binding, b, n, "as gate")?;
    }
    if n == 0 {
        return Ok(());
    }
    let n4 = vec4s(name, n)?;
    let kernel = rec.gpu().kernel(&key, body)?;
    let args = Args::new()
        .buffer_vec4("gate", gate)
        .buffer_vec4("up", up)
        .buffer_vec4("d_h", d_h)
        .buffer_vec4("d_gate", d_gate)
        .buffer_vec4("d_up", d_up)
        .param("n4", n4);
    rec.launch(&kernel, &args, Grid::Threads(n4 as u64))
}

/// f64 references.
pub mod reference {
    use crate::norm::reference as norm;

    /// `y = x·Wᵀ` for `x: [m, k]`, `w: [n, k]`.
    fn matmul_nt(x: &[f64], w: &[f64], k: usize) -> Vec<f64> {
        let n = w.len() / k;
        x.chunks(k)
            .flat_map(|row| (0..n).map(move |j| (0..k).map(|c| row[c] * w[j * k + c]).sum::<f64>()))
            .collect()
    }

    /// `dx = dy·W` for `dy: [m, n]`, `w: [n, k]`.
    fn matmul_nn(dy: &[f64], w: &[f64], k: usize) -> Vec<f64> {
        let n = w.len() / k;
        dy.chunks(n)
            .flat_map(|row| (0..k).map(move |c| (0..n).map(|j| row[j] * w[j * k + c]).sum::<f64>()))
            .collect()
    }

    /// An FFN layer's weights for the references: `γ [D]`, `W_gate`, `W_up` `[I, D]`,
    /// `W_down [D, I]`, and BitNet's sub-norm `γ_f [I]` (`None`: SwiGLU).
    pub struct FfnWeights<'a> {
        pub norm_gamma: &'a [f64],
        pub w_gate: &'a [f64],
        pub w_up: &'a [f64],
        pub w_down: &'a [f64],
        pub sub_norm_gamma: Option<&'a [f64]>,
        pub eps: f64,
    }

    /// What the forward saves for the backward.
    pub struct FfnSaved {
        pub x_rstd: Vec<f64>,
        pub gate: Vec<f64>,
        pub up: Vec<f64>,
        /// BitNet: `h` before the sub-norm, and the sub-norm's `rstd`.
        pub h: Vec<f64>,
        pub h_rstd: Vec<f64>,
    }

    /// `(x + FFN(x), saved)`.
    pub fn ffn_forward(x: &[f64], w: &FfnWeights<'_>) -> (Vec<f64>, FfnSaved) {
        let d = w.norm_gamma.len();
        let (n, x_rstd) = norm::rms_norm_forward(x, w.norm_gamma, w.eps);
        let (gate, up) = (matmul_nt(&n, w.w_gate, d), matmul_nt(&n, w.w_up, d));
        let (h, h_rstd, h_in) = match w.sub_norm_gamma {
            None => (swiglu_forward(&gate, &up), vec![], vec![]),
            Some(gf) => {
                let h = relu_sqr_mul_forward(&gate, &up);
                let (hn, r) = norm::rms_norm_forward(&h, gf, w.eps);
                (hn, r, h)
            }
        };
        let i = w.w_down.len() / d;
        let out = matmul_nt(&h, w.w_down, i);
        let y = x.iter().zip(&out).map(|(a, b)| a + b).collect();
        (
            y,
            FfnSaved {
                x_rstd,
                gate,
                up,
                h: h_in,
                h_rstd,
            },
        )
    }

    /// `dx_in = dx_out + RMSNorm_bwd(x, γ, dg·W_gate + du·W_up)` through the activation (and
    /// BitNet's sub-norm).
    pub fn ffn_backward(x: &[f64], w: &FfnWeights<'_>, dx_out: &[f64]) -> Vec<f64> {
        let d = w.norm_gamma.len();
        let i = w.w_down.len() / d;
        let (_, saved) = ffn_forward(x, w);
        let d_h_out = matmul_nn(dx_out, w.w_down, i);
        let (d_gate, d_up) = match w.sub_norm_gamma {
            None => swiglu_backward(&saved.gate, &saved.up, &d_h_out),
            Some(gf) => {
                let (d_h, _) = norm::rms_norm_backward(&saved.h, gf, &d_h_out, w.eps);
                relu_sqr_mul_backward(&saved.gate, &saved.up, &d_h)
            }
        };
        let d_norm: Vec<f64> = matmul_nn(&d_gate, w.w_gate, d)
            .iter()
            .zip(matmul_nn(&d_up, w.w_up, d))
            .map(|(a, b)| a + b)
            .collect();
        let (dx, _) = norm::rms_norm_backward(x, w.norm_gamma, &d_norm, w.eps);
        dx.iter().zip(dx_out).map(|(a, b)| a + b).collect()
    }

    fn relu(g: f64) -> f64 {
        g.max(0.0)
    }
    fn sigmoid(g: f64) -> f64 {
        1.0 / (1.0 + (-g).exp())
    }

    /// `h = relu(g)²·u`
    pub fn relu_sqr_mul_forward(gate: &[f64], up: &[f64]) -> Vec<f64> {
        gate.iter()
            .zip(up)
            .map(|(g, u)| relu(*g).powi(2) * u)
            .collect()
    }

    /// `(d_gate, d_up)` of ReLU²×Mul.
    pub fn relu_sqr_mul_backward(gate: &[f64], up: &[f64], d_h: &[f64]) -> (Vec<f64>, Vec<f64>) {
        let d_gate = (0..gate.len())
            .map(|i| d_h[i] * up[i] * 2.0 * relu(gate[i]))
            .collect();
        let d_up = (0..gate.len())
            .map(|i| d_h[i] * relu(gate[i]).powi(2))
            .collect();
        (d_gate, d_up)
    }

    /// `h = silu(g)·u`
    pub fn swiglu_forward(gate: &[f64], up: &[f64]) -> Vec<f64> {
        gate.iter()
            .zip(up)
            .map(|(g, u)| g * sigmoid(*g) * u)
            .collect()
    }

    /// `(d_gate, d_up)` of SwiGLU.
    pub fn swiglu_backward(gate: &[f64], up: &[f64], d_h: &[f64]) -> (Vec<f64>, Vec<f64>) {
        let mut d_gate = vec![0.0; gate.len()];
        let mut d_up = vec![0.0; gate.len()];
        for i in 0..gate.len() {
            let (g, s) = (gate[i], sigmoid(gate[i]));
            d_up[i] = d_h[i] * g * s;
            d_gate[i] = d_h[i] * up[i] * s * (1.0 + g * (1.0 - s));
        }
        (d_gate, d_up)
    }
}

/// The FFN's activation and whether a sub-norm follows it.
#[derive(Clone, Copy)]
pub enum FfnStyle<'a> {
    /// Llama / Qwen / SmolLM: `h = silu(g)·u`, then `W_down`.
    SwiGlu,
    /// BitNet b1.58: `h = relu(g)²·u`, then the sub-norm `h' = RMSNorm(h; γ_f)` before `W_down`.
    /// The weights are the dequantized dense matrices.
    BitNet {
        /// `γ_f`, `[I]`.
        sub_norm_gamma: &'a GpuBuffer<f32>,
        /// The forward's `h` (before the sub-norm), `[T, I]`, and its saved `rstd`, `[T]`.
        h: &'a GpuBuffer<f32>,
        h_rstd: &'a GpuBuffer<f32>,
    },
}

/// One block's FFN: `n = RMSNorm(x; γ)`, `g = n·W_gateᵀ`, `u = n·W_upᵀ`, `h = act(g, u)`,
/// `x_out = x + h·W_downᵀ` (BitNet: `h` through its sub-norm first). Weights are `[out, in]`.
pub struct FfnLayer<'a> {
    pub style: FfnStyle<'a>,
    /// `γ` of the pre-FFN RMSNorm, `[D]`.
    pub norm_gamma: &'a GpuBuffer<f32>,
    /// `W_gate`, `W_up`: `[I, D]`; `W_down`: `[D, I]`.
    pub w_gate: &'a GpuBuffer<f32>,
    pub w_up: &'a GpuBuffer<f32>,
    pub w_down: &'a GpuBuffer<f32>,
    /// What the forward saved: the block input `x` `[T, D]`, the norm's `rstd` `[T]`, and the
    /// pre-activations `g`, `u` `[T, I]`.
    pub x: &'a GpuBuffer<f32>,
    pub x_rstd: &'a GpuBuffer<f32>,
    pub gate: &'a GpuBuffer<f32>,
    pub up: &'a GpuBuffer<f32>,
}

/// Scratch of [`execute_ffn_backward`]: `d_h`, `d_gate`, `d_up` `[T, I]`, `d_norm` `[T, D]`, and
/// for BitNet `d_h_norm` `[T, I]` (any one-element buffer otherwise: it is not used).
pub struct FfnScratch<'a> {
    pub d_h: &'a mut GpuBuffer<f32>,
    pub d_h_norm: &'a mut GpuBuffer<f32>,
    pub d_gate: &'a mut GpuBuffer<f32>,
    pub d_up: &'a mut GpuBuffer<f32>,
    pub d_norm: &'a mut GpuBuffer<f32>,
}

/// The whole FFN backward of one layer for `T` tokens. `dx` holds the gradient of the block's
/// output on entry and the gradient of its input on return: the residual path is added
/// (`dx_in = dx_out + RMSNorm_bwd(…)`), never overwritten.
pub fn execute_ffn_backward(
    rec: &mut Recorder<'_>,
    layer: &FfnLayer<'_>,
    scratch: FfnScratch<'_>,
    dx: &mut GpuBuffer<f32>,
) -> Result<(), ExecError> {
    use crate::{linear, norm};
    let name = "ffn_backward";
    let d = layer.norm_gamma.len();
    let t = expect_rows(name, "x", layer.x, d, "D, norm_gamma's length")?;
    let i = layer.w_gate.len() / d;
    expect_len(name, "w_gate", layer.w_gate, i * d, "[I, D]")?;
    expect_len(name, "w_up", layer.w_up, i * d, "[I, D]")?;
    expect_len(name, "w_down", layer.w_down, d * i, "[D, I]")?;
    expect_len(name, "dx", dx, t * d, "[T, D]")?;
    // Check every buffer before recording anything: an error must not leave half a backward
    // in the caller's recorder.
    for (binding, buf, len, what) in [
        ("x_rstd", layer.x_rstd, t, "[T]"),
        ("gate", layer.gate, t * i, "[T, I]"),
        ("up", layer.up, t * i, "[T, I]"),
        ("d_h", &*scratch.d_h, t * i, "[T, I]"),
        ("d_gate", &*scratch.d_gate, t * i, "[T, I]"),
        ("d_up", &*scratch.d_up, t * i, "[T, I]"),
        ("d_norm", &*scratch.d_norm, t * d, "[T, D]"),
    ] {
        expect_len(name, binding, buf, len, what)?;
    }
    if let FfnStyle::BitNet {
        sub_norm_gamma,
        h,
        h_rstd,
    } = layer.style
    {
        for (binding, buf, len, what) in [
            ("sub_norm_gamma", sub_norm_gamma, i, "[I]"),
            ("h", h, t * i, "[T, I]"),
            ("h_rstd", h_rstd, t, "[T]"),
            ("d_h_norm", &*scratch.d_h_norm, t * i, "[T, I]"),
        ] {
            expect_len(name, binding, buf, len, what)?;
        }
    }
    // d(h·W_downᵀ) = dx·W_down: the gradient of the down projection's input.
    let FfnScratch {
        d_h,
        d_h_norm,
        d_gate,
        d_up,
        d_norm,
    } = scratch;
    match layer.style {
        FfnStyle::SwiGlu => {
            linear::execute_matmul_nn(rec, dx, layer.w_down, d_h, t, d, i, false)?;
            execute_swiglu_backward(rec, layer.gate, layer.up, d_h, d_gate, d_up)?;
        }
        FfnStyle::BitNet {
            sub_norm_gamma,
            h,
            h_rstd,
        } => {
            linear::execute_matmul_nn(rec, dx, layer.w_down, d_h_norm, t, d, i, false)?;
            norm::execute_rms_norm_backward(rec, h, sub_norm_gamma, h_rstd, d_h_norm, d_h, false)?;
            execute_relu_sqr_mul_backward(rec, layer.gate, layer.up, d_h, d_gate, d_up)?;
        }
    }
    // dn = dg·W_gate + du·W_up, then the norm's backward added to the residual gradient.
    linear::execute_matmul_nn(rec, d_gate, layer.w_gate, d_norm, t, i, d, false)?;
    linear::execute_matmul_nn(rec, d_up, layer.w_up, d_norm, t, i, d, true)?;
    norm::execute_rms_norm_backward(
        rec,
        layer.x,
        layer.norm_gamma,
        layer.x_rstd,
        d_norm,
        dx,
        true,
    )
}

/// Prologue of a GEMM whose input is `gate` ([`crate::linear::execute_gemm_fused`]): it
/// multiplies `silu(gate)·up` element by element, so `h = silu(gate)·up` feeds the down
/// projection without being written (the backward needs `gate` and `up`, not `h`).
pub struct SwigluInput<'a> {
    /// `[rows, depth]`, as the GEMM's input (`gate`).
    pub up: &'a GpuBuffer<f32>,
}

impl crate::linear::GemmFusion for SwigluInput<'_> {
    fn name(&self) -> &'static str {
        "swiglu"
    }
    fn build(&self, k: &mut KernelBuilder, width: u32) -> crate::linear::fusion::ElementFn {
        let up = k.storage::<f32>("up");
        // As `swiglu_forward` computes it.
        Box::new(move |_, row, col, g| g.clone() / ((-g).exp() + 1.0f32) * up.at(row * width + col))
    }
    fn check(&self, kernel: &str, rows: usize, width: usize) -> Result<(), ExecError> {
        expect_len(
            kernel,
            "up",
            self.up,
            rows * width,
            "as the GEMM's input (gate)",
        )
    }
    fn bind<'a>(&'a self, args: Args<'a>) -> Args<'a> {
        args.buffer("up", self.up)
    }
}
