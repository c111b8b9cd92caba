//! Helpers shared by the integration tests: one GPU for the whole test binary, random data.
// Each test binary includes this module and uses a different part of it.
#![allow(dead_code, unused_imports)]

/// One device per test binary, and reproducible random data: the kernel library's helpers.
pub use hesper::kernels::testing::{Rng, gpu, max_rel_err};

/// A new `Gpu` that keeps its driver pipeline cache in `path`.
pub fn gpu_with_cache_file(path: &std::path::Path) -> hesper::exec::Gpu {
    hesper::exec::Gpu::with_options(hesper::exec::GpuOptions {
        pipeline_cache_file: Some(path.to_path_buf()),
        ..Default::default()
    })
    .unwrap()
}

/// The real SmolLM2-135M-Instruct GGUF: `HESPER_SMOLLM2`, else `models/` (where
/// `scripts/fetch-model` puts it); `None`, with the skip reason printed, when it is absent.
pub fn smollm2_path() -> Option<String> {
    let path = std::env::var("HESPER_SMOLLM2").unwrap_or_else(|_| {
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/models/SmolLM2-135M-Instruct.Q4_1.gguf"
        )
        .into()
    });
    if std::path::Path::new(&path).exists() {
        Some(path)
    } else {
        eprintln!("skipped: {path} is absent (scripts/fetch-model fetches it)");
        None
    }
}

/// A GGUF string: its length (u64), then its bytes. (With [`Meta`], a minimal GGUF writer,
/// metadata only: small tokenizers for tests.)
pub fn str_bytes(s: &str) -> Vec<u8> {
    let mut out = (s.len() as u64).to_le_bytes().to_vec();
    out.extend(s.as_bytes());
    out
}

/// Metadata key/values as GGUF lays them out (type id, then the value).
#[derive(Clone, Default)]
pub struct Meta(pub Vec<(String, u32, Vec<u8>)>);

impl Meta {
    pub fn set(&mut self, key: &str, type_id: u32, value: Vec<u8>) -> &mut Meta {
        self.remove(key);
        self.0.push((key.into(), type_id, value));
        self
    }
    pub fn remove(&mut self, key: &str) -> &mut Meta {
        self.0.retain(|(k, _, _)| k != key);
        self
    }
    pub fn string(&mut self, key: &str, v: &str) -> &mut Meta {
        self.set(key, 8, str_bytes(v))
    }
    pub fn u32(&mut self, key: &str, v: u32) -> &mut Meta {
        self.set(key, 4, v.to_le_bytes().to_vec())
    }
    pub fn bool(&mut self, key: &str, v: bool) -> &mut Meta {
        self.set(key, 7, vec![v as u8])
    }
    pub fn strings(&mut self, key: &str, items: &[&str]) -> &mut Meta {
        let mut v = 8u32.to_le_bytes().to_vec();
        v.extend((items.len() as u64).to_le_bytes());
        items.iter().for_each(|s| v.extend(str_bytes(s)));
        self.set(key, 9, v)
    }
    pub fn i32s(&mut self, key: &str, items: &[i32]) -> &mut Meta {
        let mut v = 5u32.to_le_bytes().to_vec();
        v.extend((items.len() as u64).to_le_bytes());
        items.iter().for_each(|x| v.extend(x.to_le_bytes()));
        self.set(key, 9, v)
    }
    pub fn u32s(&mut self, key: &str, items: &[u32]) -> &mut Meta {
        let mut v = 4u32.to_le_bytes().to_vec();
        v.extend((items.len() as u64).to_le_bytes());
        items.iter().for_each(|x| v.extend(x.to_le_bytes()));
        self.set(key, 9, v)
    }
    pub fn f32(&mut self, key: &str, v: f32) -> &mut Meta {
        self.set(key, 6, v.to_le_bytes().to_vec())
    }
    /// A GGUF v3 file of this metadata and no tensors.
    pub fn file(&self) -> hesper::io::GgufFile {
        hesper::io::GgufFile::parse(self.bytes(&[]), "test.gguf").unwrap()
    }
    /// The bytes of a GGUF v3 file of this metadata and F32 `tensors` (name, PyTorch shape,
    /// values), their data at 32-byte aligned offsets.
    pub fn bytes(&self, tensors: &[(String, Vec<usize>, Vec<f32>)]) -> Vec<u8> {
        const ALIGN: usize = 32;
        let mut out = b"GGUF".to_vec();
        out.extend(3u32.to_le_bytes());
        out.extend((tensors.len() as u64).to_le_bytes());
        out.extend((self.0.len() as u64).to_le_bytes());
        for (key, ty, value) in &self.0 {
            out.extend(str_bytes(key));
            out.extend(ty.to_le_bytes());
            out.extend(value);
        }
        let mut offset = 0;
        for (name, shape, values) in tensors {
            assert_eq!(shape.iter().product::<usize>(), values.len(), "{name}");
            out.extend(str_bytes(name));
            out.extend((shape.len() as u32).to_le_bytes());
            shape
                .iter()
                .rev()
                .for_each(|&d| out.extend((d as u64).to_le_bytes()));
            out.extend(0u32.to_le_bytes());
            out.extend((offset as u64).to_le_bytes());
            offset = (offset + 4 * values.len()).next_multiple_of(ALIGN);
        }
        for (_, _, values) in tensors {
            out.resize(out.len().next_multiple_of(ALIGN), 0);
            values.iter().for_each(|v| out.extend(v.to_le_bytes()));
        }
        out
    }
    pub fn tokenizer(&self) -> Result<hesper::io::Tokenizer, hesper::io::TokenizerError> {
        hesper::io::Tokenizer::from_gguf(&self.file())
    }
}

/// A tokenizer of one token per character in GGUF metadata (architecture `llama`):
/// `<|endoftext|>` (0, end of sequence), `<|im_start|>` (1, the beginning), `<|im_end|>` (2),
/// then `a`–`z` (3–28), a space (29), a newline (30), and one merge ("ĊĊ", 31); a ChatML
/// template.
pub fn char_tokenizer_meta() -> Meta {
    let mut tokens = vec!["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
    let letters: Vec<String> = ('a'..='z').map(String::from).collect();
    tokens.extend(letters.iter().map(String::as_str));
    tokens.extend(["Ġ", "Ċ", "ĊĊ"]);
    let mut types = vec![3; 3];
    types.resize(tokens.len(), 1);
    let mut meta = Meta::default();
    meta.string("general.architecture", "llama")
        .string("tokenizer.ggml.model", "gpt2")
        .string("tokenizer.ggml.pre", "smollm")
        .strings("tokenizer.ggml.tokens", &tokens)
        .i32s("tokenizer.ggml.token_type", &types)
        .strings("tokenizer.ggml.merges", &["Ċ Ċ"])
        .u32("tokenizer.ggml.bos_token_id", 1)
        .u32("tokenizer.ggml.eos_token_id", 0)
        .bool("tokenizer.ggml.add_bos_token", false)
        .string(
            "tokenizer.chat_template",
            "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n\
             {% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
        );
    meta
}
