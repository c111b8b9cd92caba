//! Helpers shared by the integration tests: one GPU for the whole test binary, random data.
// Each test binary includes this module and uses a different part of it.
#![allow(dead_code)]

use std::sync::OnceLock;

use hesper::exec::Gpu;

/// The test binary's one device (lavapipe here and in CI). Device creation costs ~0.3 s on
/// lavapipe, so tests share it.
pub fn gpu() -> &'static Gpu {
    static GPU: OnceLock<Gpu> = OnceLock::new();
    GPU.get_or_init(|| match Gpu::new() {
        Ok(g) => g,
        Err(e) => panic!("the GPU tests need an adapter: {e}"),
    })
}

/// xorshift64*: fresh, reproducible inputs per seed.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next_u32(&mut self) -> u32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 32) as u32
    }
    /// Uniform in [-1, 1).
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u32() >> 8) as f32 / (1u32 << 23) as f32 - 1.0
    }
    pub fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.next_f32()).collect()
    }
}

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
