//! Helpers shared by the integration tests: one GPU for the whole test binary, random data.
// Each test binary includes this module and uses a different part of it.
#![allow(dead_code, unused_imports)]

/// One device per test binary, and reproducible random data: the kernel library's helpers.
pub use hesper::kernels::testing::{Rng, gpu};

/// Largest |a - b| / (1 + |b|) over the slices, which must have equal lengths.
pub fn max_rel_err(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len(), "length");
    got.iter()
        .zip(want)
        .map(|(g, w)| {
            if g.is_nan() {
                f64::INFINITY
            } else {
                (*g as f64 - w).abs() / (1.0 + w.abs())
            }
        })
        .fold(0.0, f64::max)
}
