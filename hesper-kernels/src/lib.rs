//! # hesper-kernels
//!
//! The kernels of LoRA fine-tuning, written in hesper-dsl: for each, a builder function, an
//! `execute_*` function, an f64 reference and tests (see `../shared/KERNELS.md` for the math).
//! The library is being built; its first kernels land with the "every seed kernel" issue.
