//! FFN activations, forward and backward (KERNELS.md "Backward formulas"):
//! - ReLU²×Mul (BitNet, Hesper): `h = relu(g)²·u`; `du = dh·relu(g)²`, `dg = dh·u·2·relu(g)`.
//! - SwiGLU (Llama, entrenar): `h = silu(g)·u`, `σ = sigmoid(g)`; `du = dh·g·σ`,
//!   `dg = dh·u·σ·(1 + g·(1 − σ))`.
//!
//! Elementwise and bandwidth-bound: one `vec4<f32>` per invocation (the buffers' allocations are
//! padded to 16 bytes, so any length works).

use hesper_dsl::prelude::*;
use hesper_exec::{Args, ExecError, GpuBuffer, Grid, Recorder};

use crate::{expect_len, expect_u32};

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

/// The WGSL of each kernel of this module at its default shapes (for snapshots and review).
pub fn kernels() -> Result<Vec<Kernel>, hesper_dsl::DslError> {
    Ok(vec![
        relu_sqr_mul_forward::build()?,
        relu_sqr_mul_backward::build()?,
        swiglu_forward::build()?,
        swiglu_backward::build()?,
    ])
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
