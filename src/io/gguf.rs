//! The GGUF reader: header, metadata, tensor infos and tensor data of a version 2 or 3 file
//! (little-endian), as llama.cpp's `gguf.cpp` and gguf-py's `GGUFReader` read them.
//!
//! Our own, not a crate's: the format is small (a few hundred lines here), and owning the parser
//! lets us promise what a loader of downloaded files must: no panic on any input, and no
//! allocation for a count the file could not back. Every count or length a header gives is
//! checked against the bytes left before anything is allocated for it (a string longer than the
//! rest of the file, or an array of more elements than the rest could hold, is an error), so the
//! parsed metadata takes at most a small multiple of the file's size; arrays nest at most
//! [`MAX_ARRAY_DEPTH`] deep, and every tensor's bytes must lie inside the file. A crate
//! would add a dependency whose behaviour on hostile input we would have to audit anyway.

use std::path::Path;

use super::dequant;
use super::value::{Value, ValueType};

/// `GGUF`: the first four bytes of every file.
pub const MAGIC: [u8; 4] = *b"GGUF";
/// The alignment of the tensor data when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// The deepest nesting of arrays of arrays accepted (deeper is an error, not a deep recursion).
pub const MAX_ARRAY_DEPTH: usize = 8;
/// ggml's `GGML_MAX_DIMS`: the most dimensions a tensor has.
pub const MAX_DIMS: usize = 4;

/// A file that is not a GGUF file we read, or a model we do not load.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    /// The file could not be read.
    #[error("{file}: {source}")]
    Io {
        /// The file.
        file: String,
        /// What the system said.
        source: std::io::Error,
    },
    /// `item` in `file` is not what it must be.
    #[error("{file}: {item}: expected {expected}, but is {given}")]
    Invalid {
        /// The file (the name given to [`GgufFile::parse`]).
        file: String,
        /// What holds the value: `header`, `metadata key "…"`, `tensor "…"`, with the byte offset
        /// where the reader stood when it matters.
        item: String,
        /// What a file we read has there.
        expected: String,
        /// What this file has.
        given: String,
    },
    /// The weights read from `file` are not a model of the config read from it.
    #[error("{file}: {source}")]
    Model {
        /// The file.
        file: String,
        /// What `Weights::check` or `ModelConfig::check` said.
        source: Box<crate::model::config::ModelError>,
    },
}

/// A tensor's element type (ggml's `ggml_type`) as far as the reader needs it: its name, id
/// and block layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GgmlType {
    /// ggml's id (`GGML_TYPE_Q4_K` is 12).
    pub id: u32,
    /// ggml's name (`Q4_K`).
    pub name: &'static str,
    /// Elements per block (1 for the plain types).
    pub block_elems: u64,
    /// Bytes per block.
    pub block_bytes: u64,
}

/// `(id, name, elements per block, bytes per block)` of every ggml type a file may hold
/// (ggml-common.h's block structs; the gaps are ids ggml removed).
const GGML_TYPES: [(u32, &str, u64, u64); 34] = [
    (0, "F32", 1, 4),
    (1, "F16", 1, 2),
    (2, "Q4_0", 32, 18),
    (3, "Q4_1", 32, 20),
    (6, "Q5_0", 32, 22),
    (7, "Q5_1", 32, 24),
    (8, "Q8_0", 32, 34),
    (9, "Q8_1", 32, 36),
    (10, "Q2_K", 256, 84),
    (11, "Q3_K", 256, 110),
    (12, "Q4_K", 256, 144),
    (13, "Q5_K", 256, 176),
    (14, "Q6_K", 256, 210),
    (15, "Q8_K", 256, 292),
    (16, "IQ2_XXS", 256, 66),
    (17, "IQ2_XS", 256, 74),
    (18, "IQ3_XXS", 256, 98),
    (19, "IQ1_S", 256, 50),
    (20, "IQ4_NL", 32, 18),
    (21, "IQ3_S", 256, 110),
    (22, "IQ2_S", 256, 82),
    (23, "IQ4_XS", 256, 136),
    (24, "I8", 1, 1),
    (25, "I16", 1, 2),
    (26, "I32", 1, 4),
    (27, "I64", 1, 8),
    (28, "F64", 1, 8),
    (29, "IQ1_M", 256, 56),
    (30, "BF16", 1, 2),
    (34, "TQ1_0", 256, 54),
    (35, "TQ2_0", 256, 66),
    (39, "MXFP4", 32, 17),
    (40, "NVFP4", 64, 36),
    (41, "Q1_0", 128, 18),
];

impl GgmlType {
    /// The type of id `id`, if ggml has one.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        GGML_TYPES
            .iter()
            .find(|t| t.0 == id)
            .map(|&(id, name, block_elems, block_bytes)| GgmlType {
                id,
                name,
                block_elems,
                block_bytes,
            })
    }
}

/// One tensor's entry in the file's table.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    /// Its name (`blk.0.attn_q.weight`).
    pub name: String,
    /// ggml's `ne`: the fastest-varying dimension first (PyTorch's shape reversed).
    pub dims: Vec<u64>,
    /// Its element type.
    pub ty: GgmlType,
    /// Where its bytes start, relative to the data section (a multiple of the alignment).
    pub offset: u64,
    /// How many bytes it takes.
    pub size: u64,
}

impl TensorInfo {
    /// The shape as PyTorch sees it, `dims` reversed: a matrix is `[rows, cols]`.
    pub fn shape(&self) -> Vec<usize> {
        // Every dim fits a usize: their product was checked against the file's size.
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }

    /// The number of elements.
    pub fn elements(&self) -> u64 {
        self.dims.iter().product()
    }
}

/// A parsed GGUF file: its metadata, its tensor table, and its bytes.
#[derive(Debug)]
pub struct GgufFile {
    name: String,
    version: u32,
    metadata: Vec<(String, Value)>,
    tensors: Vec<TensorInfo>,
    alignment: u64,
    data_start: usize,
    bytes: Vec<u8>,
}

impl GgufFile {
    /// Read and parse the file at `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile, GgufError> {
        let path = path.as_ref();
        let file = path.display().to_string();
        let bytes = std::fs::read(path).map_err(|source| GgufError::Io {
            file: file.clone(),
            source,
        })?;
        GgufFile::parse(bytes, file)
    }

    /// Parse a whole file's `bytes`; `name` names the file in errors.
    pub fn parse(bytes: Vec<u8>, name: impl Into<String>) -> Result<GgufFile, GgufError> {
        let name = name.into();
        let mut r = Reader {
            bytes: &bytes,
            pos: 0,
            file: &name,
        };
        let magic = r.take(4, "header magic")?;
        if magic != MAGIC {
            return Err(r.invalid("header", "the magic \"GGUF\"", format!("{magic:02x?}")));
        }
        let version = r.u32("header version")?;
        if !(2..=3).contains(&version) {
            let expected = "version 2 or 3 (little-endian)";
            return Err(r.invalid("header", expected, format!("version {version}")));
        }
        let tensor_count = r.u64("header tensor_count")?;
        let kv_count = r.u64("header metadata_kv_count")?;
        // A key/value takes at least 13 bytes (key length, type, a one-byte value), a tensor
        // info at least 24 (name length, n_dims, type, offset).
        r.check_count(kv_count, 13, "header metadata_kv_count")?;
        r.check_count(tensor_count, 24, "header tensor_count")?;

        let mut metadata: Vec<(String, Value)> = Vec::with_capacity(kv_count as usize);
        for i in 0..kv_count {
            let key = r.string(&format!("metadata key {i}"))?;
            let item = format!("metadata key {key:?}");
            if metadata.iter().any(|(k, _)| *k == key) {
                return Err(r.invalid(&item, "unique keys", "a second value"));
            }
            let ty = r.value_type(&item)?;
            let value = r.value(ty, &item, 0)?;
            metadata.push((key, value));
        }
        let alignment = match metadata.iter().find(|(k, _)| k == "general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some((_, Value::U32(a))) if a.is_power_of_two() => u64::from(*a),
            Some((_, v)) => {
                let expected = "a u32 power of two";
                let given = format!("{v:?}");
                return Err(r.invalid("metadata key \"general.alignment\"", expected, given));
            }
        };

        let mut infos = Vec::with_capacity(tensor_count as usize);
        for i in 0..tensor_count {
            let name = r.string(&format!("tensor {i} name"))?;
            let item = format!("tensor {name:?}");
            if infos
                .iter()
                .any(|t: &(String, Vec<u64>, GgmlType, u64)| t.0 == name)
            {
                return Err(r.invalid(&item, "unique tensor names", "a second tensor"));
            }
            let n_dims = r.u32(&item)?;
            if !(1..=MAX_DIMS as u32).contains(&n_dims) {
                let expected = format!("1 to {MAX_DIMS} dimensions");
                return Err(r.invalid(&item, &expected, n_dims));
            }
            let dims = (0..n_dims)
                .map(|_| r.u64(&item))
                .collect::<Result<Vec<_>, _>>()?;
            let type_id = r.u32(&item)?;
            let Some(ty) = GgmlType::from_id(type_id) else {
                return Err(r.invalid(&item, "a ggml type id", format!("type {type_id}")));
            };
            let offset = r.u64(&item)?;
            infos.push((name, dims, ty, offset));
        }
        let data_start = align_up(r.pos as u64, alignment);
        let data_len = (bytes.len() as u64).saturating_sub(data_start);
        let tensors = infos
            .into_iter()
            .map(|(name, dims, ty, offset)| {
                let item = format!("tensor {name:?}");
                let size = tensor_size(&dims, ty).map_err(|e| r.invalid(&item, &e.0, e.1))?;
                if !offset.is_multiple_of(alignment) {
                    let expected = format!("an offset that is a multiple of {alignment}");
                    return Err(r.invalid(&item, &expected, offset));
                }
                if offset.checked_add(size).is_none_or(|end| end > data_len) {
                    let expected = format!(
                        "{size} bytes at offset {offset} inside the data section's {data_len}"
                    );
                    return Err(r.invalid(&item, &expected, "a tensor past the end of the file"));
                }
                Ok(TensorInfo {
                    name,
                    dims,
                    ty,
                    offset,
                    size,
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(GgufFile {
            data_start: data_start as usize,
            name,
            version,
            metadata,
            tensors,
            alignment,
            bytes,
        })
    }

    /// The name errors give the file (its path, when opened).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The format's version: 2 or 3.
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The tensor data's alignment (`general.alignment`, else 32).
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Every metadata key and value, in the file's order.
    pub fn metadata_entries(&self) -> &[(String, Value)] {
        &self.metadata
    }

    /// The value of `key`, if present.
    pub fn metadata(&self, key: &str) -> Option<&Value> {
        self.metadata.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// The value of `key`, or an error naming the key.
    fn required(&self, key: &str) -> Result<&Value, GgufError> {
        self.metadata(key)
            .ok_or_else(|| self.invalid(format!("metadata key {key:?}"), "present", "absent"))
    }

    /// `key` as an unsigned integer (of any integer type), or an error naming it.
    pub fn metadata_u64(&self, key: &str) -> Result<u64, GgufError> {
        let value = self.required(key)?;
        value
            .as_u64()
            .ok_or_else(|| self.wrong_type(key, "a non-negative integer", value))
    }

    /// `key` as an `f64` (a float or an integer), or an error naming it.
    pub fn metadata_f64(&self, key: &str) -> Result<f64, GgufError> {
        let value = self.required(key)?;
        value
            .as_f64()
            .ok_or_else(|| self.wrong_type(key, "a number", value))
    }

    /// `key` as a string, or an error naming it.
    pub fn metadata_str(&self, key: &str) -> Result<&str, GgufError> {
        let value = self.required(key)?;
        value
            .as_str()
            .ok_or_else(|| self.wrong_type(key, "a string", value))
    }

    /// `key` as an array, or an error naming it.
    pub fn metadata_array(&self, key: &str) -> Result<&[Value], GgufError> {
        let value = self.required(key)?;
        value
            .as_array()
            .ok_or_else(|| self.wrong_type(key, "an array", value))
    }

    fn wrong_type(&self, key: &str, expected: &str, value: &Value) -> GgufError {
        let given = format!("a {:?}", value.value_type());
        self.invalid(format!("metadata key {key:?}"), expected, given)
    }

    /// The tensor table, in the file's order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The entry of tensor `name`, if present.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The raw bytes of tensor `name` (its blocks, as stored), or an error if absent.
    pub fn tensor_bytes(&self, name: &str) -> Result<&[u8], GgufError> {
        let info = self.require_tensor(name)?;
        Ok(self.bytes_of(info))
    }

    /// Tensor `name` dequantized to f32, row-major in [`TensorInfo::shape`]; an error if it is
    /// absent or its type is one we do not dequantize.
    pub fn tensor_f32(&self, name: &str) -> Result<Vec<f32>, GgufError> {
        let info = self.require_tensor(name)?;
        dequant::dequantize(info.ty, self.bytes_of(info)).ok_or_else(|| {
            let expected = format!("a type of {}", dequant::SUPPORTED.join(", "));
            self.invalid(format!("tensor {name:?}"), expected, info.ty.name)
        })
    }

    fn require_tensor(&self, name: &str) -> Result<&TensorInfo, GgufError> {
        self.tensor(name)
            .ok_or_else(|| self.invalid(format!("tensor {name:?}"), "present", "absent"))
    }

    fn bytes_of(&self, info: &TensorInfo) -> &[u8] {
        // In range: parse checked offset + size against the data section.
        let start = self.data_start + info.offset as usize;
        &self.bytes[start..start + info.size as usize]
    }

    /// An [`GgufError::Invalid`] naming this file.
    pub(crate) fn invalid(
        &self,
        item: impl Into<String>,
        expected: impl Into<String>,
        given: impl std::fmt::Display,
    ) -> GgufError {
        GgufError::Invalid {
            file: self.name.clone(),
            item: item.into(),
            expected: expected.into(),
            given: given.to_string(),
        }
    }
}

fn align_up(pos: u64, alignment: u64) -> u64 {
    pos.div_ceil(alignment) * alignment
}

/// The bytes a tensor of `dims` and `ty` takes, or `(expected, given)` when its first dim is not
/// a whole number of blocks or its size overflows.
fn tensor_size(dims: &[u64], ty: GgmlType) -> Result<u64, (String, String)> {
    let first = dims[0];
    if !first.is_multiple_of(ty.block_elems) {
        let expected = format!("a first dim that is a multiple of {}'s block", ty.name);
        return Err((expected, format!("dims {dims:?}")));
    }
    // The element count too, without its zero dims: with a dim of 0 the size is 0 whatever the
    // others are, and the product of the others (or of any of them, in any order) must not
    // overflow either.
    let mut nonzero = dims.iter().filter(|&&d| d != 0);
    let elements = nonzero.try_fold(1u64, |acc, &d| acc.checked_mul(d));
    if elements.is_none_or(|n| usize::try_from(n).is_err()) {
        return Err((
            "a size that fits in memory".into(),
            format!("dims {dims:?}"),
        ));
    }
    dims[1..]
        .iter()
        .try_fold(
            (first / ty.block_elems).checked_mul(ty.block_bytes),
            |acc, &d| acc.map(|a| a.checked_mul(d)),
        )
        .flatten()
        .filter(|&size| usize::try_from(size).is_ok())
        .ok_or_else(|| {
            (
                "a size that fits in memory".into(),
                format!("dims {dims:?}"),
            )
        })
}

/// A cursor over the file's bytes whose every read is checked.
struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
    file: &'a str,
}

impl<'a> Reader<'a> {
    fn invalid(&self, item: &str, expected: &str, given: impl std::fmt::Display) -> GgufError {
        GgufError::Invalid {
            file: self.file.to_string(),
            item: format!("{item} (at byte {})", self.pos),
            expected: expected.to_string(),
            given: given.to_string(),
        }
    }

    fn remaining(&self) -> u64 {
        (self.bytes.len() - self.pos) as u64
    }

    fn take(&mut self, n: u64, item: &str) -> Result<&'a [u8], GgufError> {
        if n > self.remaining() {
            let left = self.remaining();
            return Err(self.invalid(item, &format!("{n} more bytes"), format!("{left} left")));
        }
        let out = &self.bytes[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(out)
    }

    fn array<const N: usize>(&mut self, item: &str) -> Result<[u8; N], GgufError> {
        let bytes = self.take(N as u64, item)?;
        let mut out = [0; N];
        out.copy_from_slice(bytes);
        Ok(out)
    }

    fn u32(&mut self, item: &str) -> Result<u32, GgufError> {
        self.array(item).map(u32::from_le_bytes)
    }

    fn u64(&mut self, item: &str) -> Result<u64, GgufError> {
        self.array(item).map(u64::from_le_bytes)
    }

    /// An error unless `count` things of at least `min_size` bytes each fit in what is left.
    fn check_count(&self, count: u64, min_size: u64, item: &str) -> Result<(), GgufError> {
        let left = self.remaining();
        if count > left / min_size {
            let expected =
                format!("a count whose {min_size}-byte minimum fits the {left} bytes left");
            return Err(self.invalid(item, &expected, count));
        }
        Ok(())
    }

    fn string(&mut self, item: &str) -> Result<String, GgufError> {
        let len = self.u64(item)?;
        let bytes = self.take(len, item)?;
        String::from_utf8(bytes.to_vec()).map_err(|e| {
            let given = format!("invalid UTF-8 after {} bytes", e.utf8_error().valid_up_to());
            self.invalid(item, "a UTF-8 string", given)
        })
    }

    fn value_type(&mut self, item: &str) -> Result<ValueType, GgufError> {
        let id = self.u32(item)?;
        ValueType::from_id(id)
            .ok_or_else(|| self.invalid(item, "a value type 0 to 12", format!("type {id}")))
    }

    fn value(&mut self, ty: ValueType, item: &str, depth: usize) -> Result<Value, GgufError> {
        Ok(match ty {
            ValueType::U8 => Value::U8(u8::from_le_bytes(self.array(item)?)),
            ValueType::I8 => Value::I8(i8::from_le_bytes(self.array(item)?)),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.array(item)?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.array(item)?)),
            ValueType::U32 => Value::U32(self.u32(item)?),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.array(item)?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.array(item)?)),
            ValueType::U64 => Value::U64(self.u64(item)?),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.array(item)?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.array(item)?)),
            ValueType::Bool => match self.array::<1>(item)?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(self.invalid(item, "a bool 0 or 1", b)),
            },
            ValueType::String => Value::String(self.string(item)?),
            ValueType::Array => {
                if depth >= MAX_ARRAY_DEPTH {
                    let expected = format!("arrays nested at most {MAX_ARRAY_DEPTH} deep");
                    return Err(self.invalid(item, &expected, "deeper"));
                }
                let elem = self.value_type(item)?;
                let count = self.u64(item)?;
                self.check_count(count, elem.min_size(), item)?;
                let mut items = Vec::with_capacity(count as usize);
                for _ in 0..count {
                    items.push(self.value(elem, item, depth + 1)?);
                }
                Value::Array(elem, items)
            }
        })
    }
}
