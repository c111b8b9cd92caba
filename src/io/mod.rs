//! Files: GGUF models ([`gguf`]: the reader and its dequantizers; [`load_model`]: a model's
//! config and weights from one), LoRA adapters as Hugging Face PEFT saves them ([`peft`]:
//! [`save_peft_adapter`], [`load_peft_adapter`]), and files replaced atomically
//! ([`write_atomic`]).

mod atomic;
mod dequant;
pub mod gguf;
mod model;
pub mod peft;
mod value;

pub use atomic::{write_atomic, write_atomic_all};
pub use dequant::SUPPORTED as DEQUANTIZED_TYPES;
pub use gguf::{GgmlType, GgufError, GgufFile, TensorInfo};
pub use model::{load_model, unpermute_rows};
pub use peft::{
    PeftConfig, PeftError, decode_adapters, encode_adapters, load_peft, load_peft_adapter,
    save_peft, save_peft_adapter,
};
pub use value::{Value, ValueType};
