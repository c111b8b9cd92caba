//! Files: GGUF models ([`gguf`]: the reader and its dequantizers; [`load_model`]: a model's
//! config and weights from one; [`tokenizer`]: the tokenizer its metadata describes; [`chat`]:
//! its chat template).

pub mod chat;
mod dequant;
pub mod gguf;
mod model;
pub mod tokenizer;
mod value;

pub use chat::{ChatMessage, ChatTemplate};
pub use dequant::SUPPORTED as DEQUANTIZED_TYPES;
pub use gguf::{GgmlType, GgufError, GgufFile, TensorInfo};
pub use model::{load_model, unpermute_rows};
pub use tokenizer::TokenizerError;
#[cfg(not(target_arch = "wasm32"))]
pub use tokenizer::{DecodeStream, PRE_TOKENIZERS, Tokenizer};
pub use value::{Value, ValueType};
