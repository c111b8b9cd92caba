//! The training run of the page (`hesper_web::train::train_tiny`): the tiny model learns its
//! text, deterministically. Natively on lavapipe (`cargo test -p hesper-web`) and in headless
//! Chromium on SwiftShader (`scripts/web-test`).

use hesper_web::train::train_tiny;

#[cfg(not(target_arch = "wasm32"))]
mod native {
    use super::*;
    use hesper::exec::{Gpu, GpuOptions};

    /// 30 steps: the loss falls below a tenth of its first value, and a second run from the
    /// same seeds gives bit-identical losses (the root crate's `tests/model_step.rs` checks the
    /// same on its copy of the run).
    #[test]
    fn the_tiny_model_learns_its_text_deterministically() {
        // Debug builds check every pipeline-cache hit by rebuilding the kernel: most of a step.
        let options = GpuOptions {
            verify_cache_hits: false,
            ..GpuOptions::default()
        };
        let gpu = Gpu::with_options(options).expect("the GPU tests need an adapter");
        let mut seen = vec![];
        let losses =
            pollster::block_on(train_tiny(&gpu, 30, |step, loss| seen.push((step, loss)))).unwrap();
        assert_eq!(losses.len(), 30);
        assert_eq!(
            seen,
            (1..=30).zip(losses.iter().copied()).collect::<Vec<_>>()
        );
        let (first, last) = (losses[0], losses[29]);
        eprintln!("lavapipe: loss {first} → {last}");
        assert!(last < 0.1 * first, "loss {first} → {last}: {losses:?}");
        let again = pollster::block_on(train_tiny(&gpu, 30, |_, _| {})).unwrap();
        assert_eq!(losses, again, "a second run differs");
    }
}

#[cfg(target_arch = "wasm32")]
mod web {
    use super::*;
    use hesper::exec::{Gpu, GpuOptions};
    use wasm_bindgen_test::{console_log, wasm_bindgen_test, wasm_bindgen_test_configure};

    wasm_bindgen_test_configure!(run_in_browser);

    /// 30 steps on the browser's WebGPU: the loss falls below a tenth of its first value; a
    /// second run from the same seeds gives bit-identical losses over its 10 steps.
    ///
    /// The second run is shorter for time: in headless Chromium (SwiftShader, 2 cores) the first
    /// step takes ~75 s, SwiftShader compiling the step's 50 pipelines, and every step after it
    /// ~1.05 s (about 200 launches), so 30 steps take ~107 s and a second 30 would add ~33 s
    /// more; 10 steps (~10 s) run the same kernels and optimizer steps, bit for bit.
    #[wasm_bindgen_test]
    async fn the_tiny_model_learns_its_text_deterministically() {
        // The debug build's check of every pipeline-cache hit rebuilds the kernel each launch.
        let options = GpuOptions {
            verify_cache_hits: false,
            ..GpuOptions::default()
        };
        let gpu = Gpu::with_options_async(options)
            .await
            .expect("a WebGPU adapter");
        let start = js_sys::Date::now();
        let mut seen = vec![];
        let losses = train_tiny(&gpu, 30, |step, loss| seen.push((step, loss)))
            .await
            .unwrap();
        let trained = js_sys::Date::now();
        assert_eq!(losses.len(), 30);
        assert_eq!(
            seen,
            (1..=30).zip(losses.iter().copied()).collect::<Vec<_>>()
        );
        let (first, last) = (losses[0], losses[29]);
        assert!(last < 0.1 * first, "loss {first} → {last}: {losses:?}");
        let again = train_tiny(&gpu, 10, |_, _| {}).await.unwrap();
        assert_eq!(losses[..10], again, "a second run differs");
        // Shown with `scripts/web-test --test train -- --nocapture`.
        console_log!(
            "loss {first} → {last} in 30 steps ({:.1} s), 10 again ({:.1} s)",
            (trained - start) / 1e3,
            (js_sys::Date::now() - trained) / 1e3
        );
    }
}
