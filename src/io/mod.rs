//! Files: GGUF models ([`gguf`]: the reader and its dequantizers; [`load_model`]: a model's
//! config and weights from one; [`tokenizer`]: the tokenizer its metadata describes; [`chat`]:
//! its chat template), LoRA adapters as Hugging Face PEFT saves them ([`peft`]:
//! [`save_peft_adapter`], [`load_peft_adapter`]), and files replaced atomically
//! ([`write_atomic`]).

mod atomic;
pub mod chat;
mod dequant;
pub mod gguf;
mod model;
pub mod peft;
pub mod tokenizer;
mod value;

pub use atomic::{write_atomic, write_atomic_all};
pub use chat::{ChatMessage, ChatTemplate};
pub use dequant::SUPPORTED as DEQUANTIZED_TYPES;
pub use gguf::{GgmlType, GgufError, GgufFile, TensorInfo};
pub use model::{load_model, unpermute_rows};
pub use peft::{
    PeftConfig, PeftError, decode_adapters, encode_adapters, load_peft, load_peft_adapter,
    save_peft, save_peft_adapter,
};
pub use tokenizer::TokenizerError;
#[cfg(not(target_arch = "wasm32"))]
pub use tokenizer::{DecodeStream, PRE_TOKENIZERS, Tokenizer};
pub use value::{Value, ValueType};
