//! The executor's error type: each message names the kernel and binding where there is one.

use hesper_dsl::DslError;
use hesper_dsl::interp::InterpError;

#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    /// `hint`: what to do about it, on native or in a browser.
    #[error("no GPU adapter found (backends: {backends}). {hint}")]
    NoAdapter {
        backends: String,
        hint: &'static str,
    },
    #[error("could not create the device on `{adapter}`: {message}")]
    RequestDevice { adapter: String, message: String },
    /// `why` says whether the adapter lacks the feature or this `Gpu` was opened without it.
    #[error("kernel `{kernel}` needs the device feature {feature}, which {why}")]
    MissingFeature {
        kernel: String,
        feature: &'static str,
        why: String,
    },
    #[error("kernel `{kernel}`, binding `{binding}`: expected {expected}, given {given}")]
    Binding {
        kernel: String,
        binding: String,
        expected: String,
        given: String,
    },
    #[error("kernel `{kernel}`, runtime scalar `{param}`: expected {expected}, given {given}")]
    Param {
        kernel: String,
        param: String,
        expected: String,
        given: String,
    },
    #[error("kernel `{kernel}`: cannot dispatch {what}: {why}")]
    Dispatch {
        kernel: String,
        what: String,
        why: String,
    },
    #[error("buffer `{buffer}`: {message}")]
    Buffer { buffer: String, message: String },
    #[error(
        "kernel `{kernel}` multiplies {kind} on cooperative matrices, which `{adapter}` does not \
         offer (it offers: {offered})"
    )]
    CoopUnsupported {
        kernel: String,
        kind: String,
        adapter: String,
        offered: String,
    },
    #[error("kernel `{kernel}`: wgpu rejected the pipeline: {message}")]
    Pipeline { kernel: String, message: String },
    #[error(
        "kernel `{kernel}`: the key `{key}` emitted different WGSL on a cache hit; the kernel's \
         builder reads a compile-time value that is not in its key"
    )]
    KeyMismatch { kernel: String, key: String },
    #[error("{path}: {message}")]
    Io { path: String, message: String },
    #[error("the device was lost or a wait failed: {0}")]
    Device(String),
    #[error("`{adapter}` was lost ({reason}): {what} cannot run; open a new `Gpu`")]
    DeviceLost {
        adapter: String,
        reason: String,
        what: String,
    },
    #[error(
        "{what}: not finished after {waited:?} (GpuOptions::wait_timeout); the GPU may be hung \
         or the work longer than the timeout allows"
    )]
    Timeout {
        what: String,
        waited: std::time::Duration,
    },
    #[error("{what}: wgpu reported {kind}: {message}")]
    Wgpu {
        what: String,
        kind: &'static str,
        message: String,
    },
    #[error("{what} belongs to Gpu #{owner}, and was used with Gpu #{used_with}")]
    WrongGpu {
        what: String,
        owner: u64,
        used_with: u64,
    },
    #[error(
        "buffer `{buffer}`: {operation} while a recorder that uses it is not submitted; it \
         would take effect before the recorded launches. Submit (or drop) the recorder first, \
         or record the operation into it (Recorder::fill, Recorder::copy)"
    )]
    InUse { buffer: String, operation: String },
    #[error("GpuOptions::{option}: expected {expected}, given {given}")]
    Options {
        option: &'static str,
        expected: String,
        given: String,
    },
    /// A fault the DSL's interpreter found in a launch ([`GpuOptions::interpreter`](crate::GpuOptions::interpreter)):
    /// the kernel, what went wrong (the buffer or array and the index), the invocation and
    /// the author's statement.
    #[error("on the interpreter: {0}")]
    Interpreter(Box<InterpError>),
    #[error(transparent)]
    Dsl(#[from] DslError),
}
