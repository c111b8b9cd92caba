//! # hesper-web
//!
//! hesper in a web page. The executor builds for `wasm32-unknown-unknown` against the browser's
//! WebGPU, and this crate's tests (`tests/kernels.rs`) run the kernel library there, in headless
//! Chromium, against the same f64 references as the native tests:
//!
//! ```sh
//! scripts/web-test        # installs the wasm target, wasm-bindgen's runner, Chromium and its driver
//! scripts/web-demo        # builds the demo page and serves it on http://127.0.0.1:8000
//! ```
//!
//! In a page, open the device and read buffers back with the async calls, which also work on
//! native: `Gpu::new_async().await`, `buffer.read_async(&gpu).await`. Everything else —
//! building kernels, uploads, recorders, `execute_*` — is the same code as on native.
//!
//! The demo page ([`demo`], `index.html`): set a kernel's shape and see its WGSL, run it and one
//! projection's LoRA backward on the page's GPU, and see the error against the CPU reference.
//!
//! Training ([`train`]): [`train::train_tiny`] runs whole LoRA training steps of the root
//! crate's model ([`hesper::model`]: forward, backward and AdamW, one submission a step) on a
//! tiny random Llama until it has learned a line of text; the page plots each step's loss as it
//! arrives. `tests/train.rs` runs the same function natively (lavapipe) and in headless
//! Chromium, and checks that the loss falls below a tenth of its first value in 30 steps and
//! that a second run from the same seeds gives the same losses, bit for bit.

pub mod demo;
pub mod train;

/// What the page's JavaScript calls (`pkg/hesper_web.js`, made by `wasm-bindgen --target web`).
#[cfg(target_arch = "wasm32")]
mod page {
    use hesper::exec::{Gpu, GpuOptions};
    use std::cell::RefCell;
    use std::rc::Rc;
    use wasm_bindgen::prelude::*;

    /// The demo kernel's WGSL for `unroll` elements per invocation.
    #[wasm_bindgen]
    pub fn kernel_wgsl(unroll: u32) -> Result<String, JsError> {
        crate::demo::kernel_wgsl(unroll).map_err(|e| JsError::new(&e))
    }

    /// Run the demo on the page's GPU: the device, then one line per result against its
    /// reference, then `all within tolerance` or `NOT within tolerance`.
    #[wasm_bindgen]
    pub async fn run(n: u32, unroll: u32, tokens: u32, rank: u32) -> Result<String, JsError> {
        let report = crate::demo::run(n, unroll, tokens, rank)
            .await
            .map_err(|e| JsError::new(&e))?;
        let verdict = match report.ok {
            true => "all within tolerance",
            false => "NOT within tolerance",
        };
        Ok(format!(
            "{}\n{}\n{verdict}",
            report.device,
            report.lines.join("\n")
        ))
    }

    /// What [`train`] trains, in one line.
    #[wasm_bindgen]
    pub fn train_about() -> String {
        crate::train::describe()
    }

    thread_local! {
        /// The training's device, kept between runs: its compiled kernels are what a second
        /// run reuses (a software device compiles each pipeline in seconds).
        static TRAIN_GPU: RefCell<Option<Rc<Gpu>>> = const { RefCell::new(None) };
    }

    async fn train_gpu() -> Result<Rc<Gpu>, JsError> {
        if let Some(gpu) = TRAIN_GPU.with(|g| g.borrow().clone()) {
            return Ok(gpu);
        }
        // A debug build (scripts/web-demo --dev) would otherwise rebuild every kernel at
        // every launch to check its cache key.
        let options = GpuOptions {
            verify_cache_hits: false,
            ..GpuOptions::default()
        };
        let gpu = Gpu::with_options_async(options)
            .await
            .map_err(|e| JsError::new(&e.to_string()))?;
        let gpu = Rc::new(gpu);
        TRAIN_GPU.with(|g| *g.borrow_mut() = Some(gpu.clone()));
        Ok(gpu)
    }

    /// Train the tiny model for `steps` steps (1 to 1000) on the page's GPU, from the same
    /// seeds every time, calling `on_step(step, loss)` as each step's loss arrives; the
    /// losses, in order.
    #[wasm_bindgen]
    pub async fn train(steps: u32, on_step: js_sys::Function) -> Result<Vec<f32>, JsError> {
        if !(1..=1000).contains(&steps) {
            return Err(JsError::new(&format!(
                "steps: expected 1 to 1000, given {steps}"
            )));
        }
        let gpu = train_gpu().await?;
        let mut thrown = None;
        let losses = crate::train::train_tiny(&gpu, steps, |step, loss| {
            if thrown.is_none()
                && let Err(e) = on_step.call2(&JsValue::NULL, &step.into(), &loss.into())
            {
                thrown = Some(e);
            }
        })
        .await
        .map_err(|e| JsError::new(&e))?;
        match thrown {
            // The callback's own exception, as it threw it.
            Some(e) => Err(JsError::new(&format!("on_step threw: {e:?}"))),
            None => Ok(losses),
        }
    }
}
