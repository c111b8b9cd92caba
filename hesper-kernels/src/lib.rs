//! # hesper-kernels
//!
//! The kernels of LoRA fine-tuning, written in hesper-dsl. Each kernel comes as
//! - a kernel definition (`#[kernel]` or a builder function) whose WGSL is snapshotted,
//! - an `execute_*` function that checks its buffers (an error names the kernel and the buffer)
//!   and records a launch into a [`Recorder`](hesper_exec::Recorder) — the caller submits,
//! - an f64 reference in the module's `reference` submodule, which the tests compare the GPU
//!   with on fresh random inputs, and which is itself checked against finite differences.
//!
//! The math contract is `../shared/KERNELS.md`.

pub mod attention;
pub mod ffn;
pub mod linear;
pub mod lora;
pub mod loss;
pub mod norm;
pub mod optim;
pub mod rope;
pub mod testing;

use hesper_exec::{Element, ExecError, GpuBuffer};

/// `Ok` when `buffer` has exactly `len` elements; else an error naming kernel and binding.
pub(crate) fn expect_len<T: Element>(
    kernel: &str,
    binding: &str,
    buffer: &GpuBuffer<T>,
    len: usize,
    why: &str,
) -> Result<(), ExecError> {
    if buffer.len() == len {
        return Ok(());
    }
    Err(ExecError::Binding {
        kernel: kernel.into(),
        binding: binding.into(),
        expected: format!("{len} elements ({why})"),
        given: format!("{} elements", buffer.len()),
    })
}

/// `Ok` when a runtime count fits the `u32` kernels index with.
pub(crate) fn expect_u32(kernel: &str, what: &str, n: usize) -> Result<u32, ExecError> {
    u32::try_from(n).map_err(|_| ExecError::Dispatch {
        kernel: kernel.into(),
        what: format!("{what} = {n}"),
        why: "kernels index with u32".into(),
    })
}
