//! # hesper-exec
//!
//! The runtime of hesper, and the only crate that touches wgpu: a [`Gpu`] (device, queue,
//! features, limits), typed buffers ([`GpuBuffer`]), a pipeline cache keyed by
//! `KernelKey` ([`Gpu::kernel`]), launches checked by binding name and recorded many to a
//! submit ([`Recorder`]), and GPU timing with timestamp queries ([`profile`]).

mod buffer;
mod cache;
mod error;
mod gpu;
mod launch;
mod pool;
pub mod profile;

pub use buffer::{Element, GpuBuffer, HostElement};
pub use cache::{CacheStats, CompiledKernel, PipelineCache};
pub use error::ExecError;
pub use gpu::{DriverCacheStatus, Gpu, GpuOptions};
pub use launch::{Args, Grid, LaunchTiming, MAX_TIMED_LAUNCHES, ParamValue, Recorder};
pub use pool::{PooledDevices, pooled_devices};
/// The wgpu this crate is built on (its types appear in `GpuOptions` and `Gpu::device`).
pub use wgpu;
