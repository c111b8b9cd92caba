//! Files: GGUF models ([`gguf`]: the reader and its dequantizers; [`load_model`]: a model's
//! config and weights from one).

mod dequant;
pub mod gguf;
mod model;
mod value;

pub use dequant::SUPPORTED as DEQUANTIZED_TYPES;
pub use gguf::{GgmlType, GgufError, GgufFile, TensorInfo};
pub use model::{load_model, unpermute_rows};
pub use value::{Value, ValueType};
