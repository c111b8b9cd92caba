//! The model: its configuration ([`config`]), its f64 reference on the CPU
//! ([`reference`](mod@reference)), and the LoRA training step on the GPU: the weights and
//! adapters there ([`GpuModel`], [`GpuAdapters`]), the step's buffers ([`StepBuffers`], made
//! once per [`StepShape`]), and the step recorded into one recorder
//! ([`record_forward_backward`], then [`record_optimizer_step`]); and generation
//! ([`Generator`]), decoding one token at a time over a [`KvCache`].
//!
//! The reference is the proof of the GPU training step: the step's loss, its LoRA gradients
//! and its gradient at the embedding output are compared with [`reference::loss_and_grads`] on
//! the same weights, adapters and batch, and the reference's own gradients are checked against
//! finite differences of [`reference::loss`]. Its semantics, exactly (KERNELS.md "Forward of one
//! block"; Llama, Qwen2, Qwen3 and BitNet differ where [`config::Family`] says):
//! - **Layout.** `B` sequences of `S` positions, flattened: token `t = b·S + s`; activations
//!   `[T, width]`, row-major; a weight is `[out, in]` and `y = x·Wᵀ`; query head `h` occupies
//!   columns `h·hd .. (h+1)·hd` and reads KV head `h / (H/KV)`.
//! - **LoRA.** A targeted projection is `y = x·Wᵀ (+ bias) + s·(x·Aᵀ)·Bᵀ`, `A [r, in]`,
//!   `B [out, r]`, `s = α/r` (`α/√r` with rsLoRA).
//! - **RMSNorm.** `y = x·(mean x² + ε)^−½·γ`, one `ε` for every norm (Qwen3's per-head norms of
//!   Q and K included).
//! - **RoPE.** Split-half ("NeoX", `rotate_half`): pair `i < hd/2` of a head rotates
//!   `(x_i, x_{i+hd/2})` by `θ_i = pos·base^(−2i/hd)`, `pos = s`, the position inside its
//!   sequence; applied to Q and K after Qwen3's norms.
//! - **Attention.** Causal within each sequence, `τ = 1/√hd`. Sequence `b` is right-padded:
//!   positions `≥ lens[b]` are padding; their keys are never read and their attention output
//!   is 0 (the rest of the block still runs on them).
//! - **Loss.** `logits = RMSNorm(x_L; γ)·Eᵀ` (tied) or `·headᵀ`; the mean cross-entropy over
//!   the positions whose target is not `−100` (a batch without one has loss 0). A padded
//!   position's target must be `−100`, so padding never changes the loss.

mod activations;
pub mod config;
mod decode;
mod generate;
mod gpu;
pub mod reference;
mod step;
mod tape;

pub use activations::{LogitsBuffers, StepBuffers, StepShape};
pub use decode::KvCache;
pub use generate::{Generator, Rng, Sampling};
pub use gpu::{GpuAdapters, GpuModel};
pub use step::{
    Optimizer, record_forward_backward, record_forward_loss, record_logits, record_optimizer_step,
};
