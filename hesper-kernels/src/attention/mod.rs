//! Attention (KERNELS.md "Attention"): over whole sequences for training ([`sequence`]: the
//! flash-style causal forward and backward, GQA, padded batches) and for one decoded token
//! ([`decode`]: the KV cache, its forward for generation and its backward), with their f64
//! [references](mod@reference).

pub mod coop;
pub mod decode;
pub mod reference;
pub mod sequence;

pub use decode::{
    DecodeGrads, DecodeInputs, DecodeShape, execute_apply_backward, execute_cache_backward,
    execute_decode_attention, execute_decode_attention_backward, execute_kv_cache_append,
    execute_score_backward_q, execute_softmax_backward,
};
pub use sequence::{
    SeqGrads, SeqInputs, SeqSaved, SeqShape, SeqTile, ValidLengths, execute_attention_backward,
    execute_attention_forward, scores_workspace_len,
};

/// The WGSL of this module's kernels at representative shapes.
pub fn kernels() -> Result<Vec<hesper_dsl::Kernel>, hesper_dsl::DslError> {
    let mut all = decode::kernels()?;
    all.extend(sequence::kernels()?);
    all.extend(coop::kernels()?);
    Ok(all)
}
