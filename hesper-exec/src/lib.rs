//! # hesper-exec
//!
//! The runtime of hesper, and the only crate that touches wgpu: a [`Gpu`] (device and queue),
//! typed buffers ([`GpuBuffer`]), and launching DSL kernels with buffers bound by name
//! ([`Gpu::run`]).

mod buffer;
mod error;
mod gpu;
mod launch;

pub use buffer::{Element, GpuBuffer};
pub use error::ExecError;
pub use gpu::Gpu;
pub use launch::{Args, Grid, ParamValue, Pipeline};
