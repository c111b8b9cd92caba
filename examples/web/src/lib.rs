//! # hesper-web
//!
//! hesper in a web page. The executor builds for `wasm32-unknown-unknown` against the browser's
//! WebGPU, and this crate's tests (`tests/kernels.rs`) run the kernel library there, in headless
//! Chromium, against the same f64 references as the native tests:
//!
//! ```sh
//! scripts/web-test        # installs the wasm target, wasm-bindgen's runner, Chromium and its driver
//! ```
//!
//! In a page, open the device and read buffers back with the async calls, which also work on
//! native: `Gpu::new_async().await`, `buffer.read_async(&gpu).await`. Everything else —
//! building kernels, uploads, recorders, `execute_*` — is the same code as on native.
