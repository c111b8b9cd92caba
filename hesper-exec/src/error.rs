//! The executor's error type: each message names the kernel and binding where there is one.

use hesper_dsl::DslError;

#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    #[error(
        "no GPU adapter found (backends: {backends}). On headless Linux install Mesa's lavapipe \
         (`apt-get install mesa-vulkan-drivers libvulkan1`, or run through scripts/with-gpu) and \
         set WGPU_BACKEND=vulkan. With an NVIDIA driver, the Vulkan loader also needs the glvnd \
         libraries (libglvnd0, libglx0, libegl1); VK_LOADER_DEBUG=error shows why a driver was \
         not loaded"
    )]
    NoAdapter { backends: String },
    #[error("could not create the device on `{adapter}`: {message}")]
    RequestDevice { adapter: String, message: String },
    #[error(
        "kernel `{kernel}` needs the device feature {feature}, which `{adapter}` does not have"
    )]
    MissingFeature {
        kernel: String,
        feature: &'static str,
        adapter: String,
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
    #[error(transparent)]
    Dsl(#[from] DslError),
}
