//! Helpers shared by the integration tests: one GPU for the whole test binary, random data.
// Each test binary includes this module and uses a different part of it.
#![allow(dead_code, unused_imports)]

/// One device per test binary, and reproducible random data: the kernel library's helpers.
pub use hesper::kernels::testing::{Rng, gpu, max_rel_err};

/// A new `Gpu` that keeps its driver pipeline cache in `path`.
pub fn gpu_with_cache_file(path: &std::path::Path) -> hesper::exec::Gpu {
    hesper::exec::Gpu::with_options(hesper::exec::GpuOptions {
        pipeline_cache_file: Some(path.to_path_buf()),
        ..Default::default()
    })
    .unwrap()
}

/// The real SmolLM2-135M-Instruct GGUF: `HESPER_SMOLLM2`, else `models/` (where
/// `scripts/fetch-model` puts it); `None`, with the skip reason printed, when it is absent.
pub fn smollm2_path() -> Option<String> {
    let path = std::env::var("HESPER_SMOLLM2").unwrap_or_else(|_| {
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/models/SmolLM2-135M-Instruct.Q4_1.gguf"
        )
        .into()
    });
    if std::path::Path::new(&path).exists() {
        Some(path)
    } else {
        eprintln!("skipped: {path} is absent (scripts/fetch-model fetches it)");
        None
    }
}
