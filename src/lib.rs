//! # hesper
//!
//! Write, test and run the backward-pass GPU kernels of LoRA fine-tuning from Rust. Kernels are
//! written in a typed DSL ([`dsl`]) that emits validated, deterministic WGSL; the executor
//! ([`exec`]) runs them through wgpu on Vulkan, Metal, DX12 or Mesa's lavapipe; [`kernels`] is
//! the kernel library.
//!
//! The README follows, and its example runs as a doc test.
#![doc = ""]
#![doc = include_str!("../README.md")]

pub use hesper_dsl as dsl;
pub use hesper_exec as exec;
pub use hesper_kernels as kernels;

pub mod io;
pub mod model;
pub mod train;
