//! Helpers shared by the integration tests: one GPU for the whole test binary, random data.
// Each test binary includes this module and uses a different part of it.
#![allow(dead_code, unused_imports)]

/// One device per test binary, and reproducible random data: the kernel library's helpers.
pub use hesper::kernels::testing::{Rng, gpu, max_rel_err};
