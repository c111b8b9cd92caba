//! # hesper-dsl-macros
//!
//! `#[kernel]`: a Rust function turned into hesper-dsl builder calls. The macro is being built
//! (its own issue); until then kernels are written with `hesper_dsl::KernelBuilder` directly.
