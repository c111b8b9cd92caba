//! # hesper-exec
//!
//! The runtime of hesper, and the only crate that touches wgpu: a [`Gpu`] (device, queue,
//! features, limits), typed buffers ([`GpuBuffer`]), a pipeline cache keyed by
//! `KernelKey` ([`Gpu::kernel`]), launches checked by binding name and recorded many to a
//! submit ([`Recorder`]), and GPU timing with timestamp queries (`profile`, native only).
//! With [`GpuOptions::interpreter`] (or `HESPER_INTERPRETER=1`) the same API runs with no GPU:
//! each launch on the DSL's interpreter, which reports what a GPU hides (out-of-bounds
//! accesses, races) as [`ExecError::Interpreter`].
//!
//! The same API runs in a web page (`wasm32-unknown-unknown`, WebGPU): there the device opens
//! and buffers read back asynchronously ([`Gpu::new_async`], [`GpuBuffer::read_async`], also
//! on native, so one code path serves both), while the blocking calls ([`Gpu::new`],
//! `GpuBuffer::read`, `Gpu::wait`), timing and the pipeline cache file are native only. A
//! wgpu error in the browser surfaces at the next call that checks the device (a browser
//! resolves error scopes asynchronously), at the latest the next `read_async`.

mod buffer;
mod cache;
mod error;
mod gpu;
#[cfg(not(target_arch = "wasm32"))]
mod interpreted;
mod launch;
mod pool;
#[cfg(not(target_arch = "wasm32"))]
pub mod profile;
mod tune;

/// `Instant` where `std`'s exists, `performance.now()` in the browser.
mod time {
    #[cfg(not(target_arch = "wasm32"))]
    pub use std::time::Instant;
    #[cfg(target_arch = "wasm32")]
    pub use web_time::Instant;
}

pub use buffer::{Element, GpuBuffer, HostElement, PendingRead};
pub use cache::{CacheStats, CompiledKernel, PipelineCache};
pub use error::ExecError;
pub use gpu::{DriverCacheStatus, Gpu, GpuOptions};
/// The `half` crate's `f16`, the host type of f16 buffers (`GpuBuffer<half::f16>`).
pub use half;
pub use launch::{Args, Grid, LaunchCache, LaunchTiming, MAX_TIMED_LAUNCHES, ParamValue, Recorder};
pub use pool::{PooledDevices, pooled_devices};
pub use tune::{TuneFileStatus, TuneReport};
/// The wgpu this crate is built on (its types appear in `GpuOptions` and `Gpu::device`).
pub use wgpu;
