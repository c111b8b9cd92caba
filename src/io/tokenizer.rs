//! The tokenizer a GGUF file describes in its `tokenizer.*` metadata, built with Hugging Face's
//! `tokenizers` (the implementation behind transformers' fast tokenizers), and its chat template.
//!
//! A GGUF stores no `tokenizer.json`: it gives llama.cpp's keys — the vocabulary
//! (`tokenizer.ggml.tokens`), each token's type (`token_type`: control tokens like
//! `<|im_start|>` are special), the BPE merges in rank order (`merges`), and the name of the
//! pre-tokenizer (`pre`), which stands for the split the vocabulary was trained with. We build
//! the byte-level BPE tokenizer those describe ([`PRE_TOKENIZERS`] lists the `pre` values we map,
//! and to what) and refuse everything else by name: a tokenizer that silently splits text
//! differently from the one the model was trained with would corrupt every training example.
//!
//! Native targets only: `tokenizers` does not build for `wasm32-unknown-unknown` (its random
//! number dependency needs a browser backend chosen by a compiler flag). [`TokenizerError`] and
//! the chat template ([`super::chat`]) build everywhere.

use super::gguf::GgufError;

/// A tokenizer or chat template we cannot build from a file, or a call it cannot answer.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A metadata value the reader itself refused (absent, or of the wrong type).
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// `item` in `file` is not what the tokenizer needs.
    #[error("{file}: {item}: expected {expected}, but is {given}")]
    Invalid {
        /// The file the tokenizer was read from.
        file: String,
        /// What holds the value: `metadata key "tokenizer.ggml.merges" item 7`, `decode token 3`.
        item: String,
        /// What we need there.
        expected: String,
        /// What there is.
        given: String,
    },
    /// A chat template that does not compile, or failed to render.
    #[error("{template}: {message}")]
    Template {
        /// The template's name: the file and metadata key it came from, or "chat template".
        template: String,
        /// What minijinja said (with the line), and what caused it.
        message: String,
    },
    /// The `tokenizers` library failed on a call: not expected of a tokenizer built here (its
    /// inputs are checked first), but reported rather than unwrapped.
    #[error("{file}: {operation}: {message}")]
    Library {
        /// The file the tokenizer was read from.
        file: String,
        /// What was asked: `encode`, `decode`, `build`.
        operation: &'static str,
        /// What the library said.
        message: String,
    },
}

#[cfg(not(target_arch = "wasm32"))]
pub use native::{DecodeStream, PRE_TOKENIZERS, Tokenizer};

#[cfg(not(target_arch = "wasm32"))]
mod native {
    use std::ops::Range;

    use tokenizers::AddedToken;
    use tokenizers::decoders::DecoderWrapper;
    use tokenizers::models::ModelWrapper;
    use tokenizers::models::bpe::{BPE, Vocab};
    use tokenizers::normalizers::NormalizerWrapper;
    use tokenizers::pre_tokenizers::PreTokenizerWrapper;
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::pre_tokenizers::digits::Digits;
    use tokenizers::pre_tokenizers::sequence::Sequence;
    use tokenizers::processors::PostProcessorWrapper;

    use super::TokenizerError;
    use crate::io::chat::ChatTemplate;
    use crate::io::gguf::GgufFile;
    use crate::io::value::Value;

    /// The `tokenizer.ggml.pre` values we build, and the Hugging Face pre-tokenizer each one
    /// names: llama.cpp writes the value when it converts a model, picking it by the token ids
    /// the model's own tokenizer gives a test text, so each stands for one `tokenizer.json`
    /// pre-tokenizer, which we rebuild.
    ///
    /// - `smollm` (SmolLM, SmolLM2) and `starcoder` (StarCoder, whose tokenizer SmolLM's follows):
    ///   every digit split off alone, then GPT-2's byte-level split —
    ///   `Sequence[Digits(individual_digits=true), ByteLevel(add_prefix_space=false,
    ///   use_regex=true)]`, llama.cpp's regexes `\p{N}` then
    ///   `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)`. (transformers
    ///   5.24 gives `smollm` only the byte-level split; the two differ where whitespace precedes a
    ///   digit: `"  12"` is `[ĠĠ, 1, 2]` here and in SmolLM2's own tokenizer, `[Ġ, Ġ, 1, 2]` there.)
    ///   Checked on SmolLM2-135M-Instruct against Hugging Face (tests/tokenizer.rs).
    /// - `gpt2`: GPT-2's byte-level split alone, `ByteLevel(add_prefix_space=false,
    ///   use_regex=true)`.
    pub const PRE_TOKENIZERS: [&str; 3] = ["smollm", "starcoder", "gpt2"];

    fn pre_tokenizer(pre: &str) -> Option<PreTokenizerWrapper> {
        // add_prefix_space, trim_offsets (unused: offsets are trimmed by a post-processor, and we
        // set none), use_regex.
        let byte_level = ByteLevel::new(false, true, true);
        match pre {
            "smollm" | "starcoder" => {
                Some(Sequence::new(vec![Digits::new(true).into(), byte_level.into()]).into())
            }
            "gpt2" => Some(byte_level.into()),
            _ => None,
        }
    }

    /// llama.cpp's `llama_token_type`: a control token (`<|endoftext|>`) is special, a
    /// user-defined one (`<think>`) is matched whole in text but is not special.
    const TOKEN_CONTROL: u64 = 3;
    const TOKEN_USER_DEFINED: u64 = 4;

    type Inner = tokenizers::TokenizerImpl<
        ModelWrapper,
        NormalizerWrapper,
        PreTokenizerWrapper,
        PostProcessorWrapper,
        DecoderWrapper,
    >;

    /// A GGUF file's byte-level BPE tokenizer, its special tokens and its chat template.
    ///
    /// Text round-trips: `decode(encode(s)) == s`, except for bytes the vocabulary has no token
    /// for (SmolLM2 lacks 21 of the 256, e.g. `0x04` and `0xF1`, which leads the UTF-8 of
    /// U+40000–U+7FFFF), which are dropped — as the model's Hugging Face tokenizer and llama.cpp
    /// drop them.
    pub struct Tokenizer {
        inner: Inner,
        file: String,
        vocab_size: usize,
        bos: Option<u32>,
        eos: Option<u32>,
        pad: Option<u32>,
        add_bos: bool,
        chat_template: Option<ChatTemplate>,
    }

    impl std::fmt::Debug for Tokenizer {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("Tokenizer")
                .field("file", &self.file)
                .field("vocab_size", &self.vocab_size)
                .field("bos", &self.bos)
                .field("eos", &self.eos)
                .field("pad", &self.pad)
                .field("add_bos", &self.add_bos)
                .field("chat_template", &self.chat_template)
                .finish_non_exhaustive()
        }
    }

    impl Tokenizer {
        /// The tokenizer `file`'s metadata describes: `tokenizer.ggml.model` must be `gpt2`
        /// (byte-level BPE; `llama`, SentencePiece, and the rest are refused by name),
        /// `tokenizer.ggml.pre` one of [`PRE_TOKENIZERS`]; `tokens` and `merges` must be present
        /// and consistent; `token_type`, the `*_token_id`s, `add_bos_token` and
        /// `tokenizer.chat_template` may be absent. Every error names the file and the key.
        pub fn from_gguf(file: &GgufFile) -> Result<Tokenizer, TokenizerError> {
            let name = file.name();
            let invalid = |item: String, expected: &str, given: String| TokenizerError::Invalid {
                file: name.to_string(),
                item,
                expected: expected.to_string(),
                given,
            };
            let key = |k: &str| format!("metadata key {k:?}");

            let model = file.metadata_str("tokenizer.ggml.model")?;
            if model != "gpt2" {
                return Err(invalid(
                    key("tokenizer.ggml.model"),
                    "\"gpt2\" (byte-level BPE, the one tokenizer model we build)",
                    format!("{model:?}"),
                ));
            }
            let pre = file.metadata_str("tokenizer.ggml.pre")?;
            let Some(pre_tokenizer) = pre_tokenizer(pre) else {
                let known = PRE_TOKENIZERS.map(|p| format!("{p:?}")).join(", ");
                return Err(invalid(
                    key("tokenizer.ggml.pre"),
                    &format!("a pre-tokenizer we build ({known})"),
                    format!("{pre:?}"),
                ));
            };

            let tokens = file.metadata_array("tokenizer.ggml.tokens")?;
            if tokens.is_empty() || u32::try_from(tokens.len()).is_err() {
                let expected = "1 to 2^32 - 1 tokens";
                return Err(invalid(
                    key("tokenizer.ggml.tokens"),
                    expected,
                    tokens.len().to_string(),
                ));
            }
            let vocab_size = tokens.len();
            let types = match file.metadata("tokenizer.ggml.token_type") {
                None => vec![1; vocab_size],
                Some(_) => {
                    let types = file.metadata_array("tokenizer.ggml.token_type")?;
                    if types.len() != vocab_size {
                        let expected = format!("one type per token ({vocab_size})");
                        let given = format!("{} types", types.len());
                        return Err(invalid(key("tokenizer.ggml.token_type"), &expected, given));
                    }
                    types
                        .iter()
                        .enumerate()
                        .map(|(i, v)| {
                            v.as_u64().ok_or_else(|| {
                                let item = format!("{} item {i}", key("tokenizer.ggml.token_type"));
                                invalid(item, "a non-negative integer", type_name(v))
                            })
                        })
                        .collect::<Result<Vec<u64>, _>>()?
                }
            };

            // The vocabulary: each token as the BPE model spells it (in the byte alphabet), and
            // the control and user-defined ones to match whole in text.
            let alphabet = ByteLevel::alphabet();
            // Room for every token only once each is a string (8 bytes of the file at least):
            // for an array of as many u8s (a byte each), the table would take 75 times the
            // file before the first token is found not to be a string.
            let strings = tokens.iter().all(|v| v.as_str().is_some());
            let mut vocab = Vocab::with_capacity(if strings { vocab_size } else { 0 });
            let mut added = Vec::new();
            for (id, (value, &ty)) in tokens.iter().zip(&types).enumerate() {
                let item = || format!("{} item {id}", key("tokenizer.ggml.tokens"));
                let Some(text) = value.as_str() else {
                    return Err(invalid(item(), "a string", type_name(value)));
                };
                if text.is_empty() {
                    return Err(invalid(item(), "a non-empty token", "\"\"".into()));
                }
                let spelled = if ty == TOKEN_CONTROL || ty == TOKEN_USER_DEFINED {
                    added.push(AddedToken::from(text, ty == TOKEN_CONTROL).normalized(false));
                    text.to_string()
                } else if text.chars().all(|c| alphabet.contains(&c)) {
                    text.to_string()
                } else {
                    // A token not written in the byte alphabet (a raw space, say): spelled as
                    // its bytes, as transformers does, so that merges can reach it.
                    byte_level_spelling(text)
                };
                let id = id as u32; // < vocab_size, which fits a u32
                if let Some(first) = vocab.insert(spelled.clone(), id) {
                    let expected = format!("distinct tokens ({spelled:?} is token {first})");
                    return Err(invalid(item(), &expected, "a second one".into()));
                }
            }

            let merges_value = file.metadata_array("tokenizer.ggml.merges")?;
            let mut merges = Vec::with_capacity(merges_value.len());
            for (i, value) in merges_value.iter().enumerate() {
                let item = || format!("{} item {i}", key("tokenizer.ggml.merges"));
                let Some(text) = value.as_str() else {
                    return Err(invalid(item(), "a string", type_name(value)));
                };
                let pair = text
                    .split_once(' ')
                    .filter(|(a, b)| !a.is_empty() && !b.is_empty() && !b.contains(' '));
                let Some((a, b)) = pair else {
                    let expected = "two tokens separated by one space";
                    return Err(invalid(item(), expected, format!("{text:?}")));
                };
                for part in [a.to_string(), b.to_string(), format!("{a}{b}")] {
                    if !vocab.contains_key(&part) {
                        let expected = format!("a merge of tokens into a token ({part:?} is none)");
                        return Err(invalid(item(), &expected, format!("{text:?}")));
                    }
                }
                merges.push((a.to_string(), b.to_string()));
            }

            let token_id = |k: &str| -> Result<Option<u32>, TokenizerError> {
                let Some(value) = file.metadata(k) else {
                    return Ok(None);
                };
                match value.as_u64() {
                    Some(id) if id < vocab_size as u64 => Ok(Some(id as u32)),
                    Some(id) => {
                        let expected = format!("a token id below the vocabulary's {vocab_size}");
                        Err(invalid(key(k), &expected, id.to_string()))
                    }
                    None => Err(invalid(key(k), "a token id", type_name(value))),
                }
            };
            let bos = token_id("tokenizer.ggml.bos_token_id")?;
            let eos = token_id("tokenizer.ggml.eos_token_id")?;
            let pad = token_id("tokenizer.ggml.padding_token_id")?;
            let unk = token_id("tokenizer.ggml.unknown_token_id")?;
            let add_bos = match file.metadata("tokenizer.ggml.add_bos_token") {
                None => false,
                Some(Value::Bool(b)) => *b,
                Some(v) => {
                    return Err(invalid(
                        key("tokenizer.ggml.add_bos_token"),
                        "a bool",
                        type_name(v),
                    ));
                }
            };

            let library = |operation, e: tokenizers::Error| TokenizerError::Library {
                file: name.to_string(),
                operation,
                message: e.to_string(),
            };
            // No unknown token: a byte with no token is dropped, as in the model's tokenizer.json
            // and llama.cpp (SmolLM2 names `<|endoftext|>` its unknown token, but never emits it).
            let bpe = BPE::builder()
                .vocab_and_merges(vocab, merges)
                .build()
                .map_err(|e| library("build", e))?;
            let mut inner = Inner::new(bpe.into());
            inner.with_pre_tokenizer(Some(pre_tokenizer));
            inner.with_decoder(Some(ByteLevel::default()));
            inner
                .add_special_tokens(added.iter().filter(|t| t.special).cloned())
                .map_err(|e| library("build", e))?;
            inner
                .add_tokens(added.iter().filter(|t| !t.special).cloned())
                .map_err(|e| library("build", e))?;

            let text_of = |id: Option<u32>| id.and_then(|id| tokens[id as usize].as_str());
            let chat_template = match file.metadata("tokenizer.chat_template") {
                None => None,
                Some(_) => {
                    let source = file.metadata_str("tokenizer.chat_template")?;
                    let template_name = format!("{name}: {}", key("tokenizer.chat_template"));
                    let mut template = ChatTemplate::named(template_name, source)?;
                    for (var, id) in [
                        ("bos_token", bos),
                        ("eos_token", eos),
                        ("pad_token", pad),
                        ("unk_token", unk),
                    ] {
                        if let Some(text) = text_of(id) {
                            template = template.with_variable(var, text);
                        }
                    }
                    Some(template)
                }
            };

            Ok(Tokenizer {
                inner,
                file: name.to_string(),
                vocab_size,
                bos,
                eos,
                pad,
                add_bos,
                chat_template,
            })
        }

        /// Tokens of `text`, special tokens written in the text parsed as such; no BOS/EOS added.
        pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
            let encoding = self
                .inner
                .encode_fast(text, false)
                .map_err(|e| self.library("encode", e))?;
            Ok(encoding.get_ids().to_vec())
        }

        /// Tokens with each one's byte range in `text` (for masking the loss by character
        /// spans). The ranges follow one another and cover the text, a token's leading space
        /// included (` world` is `5..11` in `Hello world`), save that the tokens a character's
        /// bytes are split between (an emoji, often) each get the whole character's range, and
        /// a dropped byte (see [`Tokenizer`]) belongs to no token.
        pub fn encode_with_offsets(
            &self,
            text: &str,
        ) -> Result<Vec<(u32, Range<usize>)>, TokenizerError> {
            let encoding = self
                .inner
                .encode(text, false)
                .map_err(|e| self.library("encode", e))?;
            let ids = encoding.get_ids().iter();
            let offsets = encoding.get_offsets().iter();
            Ok(ids.zip(offsets).map(|(&id, &(a, b))| (id, a..b)).collect())
        }

        /// Text of `ids`, special tokens included; an id outside the vocabulary is an error.
        /// Bytes that are not UTF-8 (a token sequence cut inside a character) become U+FFFD:
        /// to print tokens as they come, use [`Tokenizer::decode_stream`].
        pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
            self.check_ids(ids)?;
            self.inner
                .decode(ids, false)
                .map_err(|e| self.library("decode", e))
        }

        /// A decoder for tokens that arrive one at a time (generation): feed each to
        /// [`DecodeStream::step`] and print what it returns. It holds back the bytes of a
        /// character until its last byte has come, so the pieces concatenate to
        /// `decode(all ids)` and none ends inside a character. (Equivalently, decode the whole
        /// prefix each time and print the new suffix once it does not end in U+FFFD; the
        /// stream does that over a short window instead of the whole text.)
        pub fn decode_stream(&self) -> DecodeStream<'_> {
            DecodeStream {
                tokenizer: self,
                inner: self.inner.decode_stream(false),
            }
        }

        /// The number of tokens (ids are `0..vocab_size()`).
        pub fn vocab_size(&self) -> usize {
            self.vocab_size
        }

        /// `tokenizer.ggml.bos_token_id`: the token a sequence starts with, when the file has one.
        pub fn bos(&self) -> Option<u32> {
            self.bos
        }

        /// `tokenizer.ggml.eos_token_id`: the token that ends a sequence (or a turn).
        pub fn eos(&self) -> Option<u32> {
            self.eos
        }

        /// `tokenizer.ggml.padding_token_id`: the token that fills a batch's short rows.
        pub fn pad(&self) -> Option<u32> {
            self.pad
        }

        /// `tokenizer.ggml.add_bos_token`: whether the model expects [`Tokenizer::bos`] before
        /// each sequence (the caller adds it: [`Tokenizer::encode`] never does); false when absent.
        pub fn add_bos(&self) -> bool {
            self.add_bos
        }

        /// The id of `token` as the vocabulary spells it (`<|im_start|>`, `Ġthe` for " the").
        pub fn token_id(&self, token: &str) -> Option<u32> {
            self.inner.token_to_id(token)
        }

        /// `tokenizer.chat_template`, compiled, with `bos_token`, `eos_token`, `pad_token` and
        /// `unk_token` set to those tokens' text.
        pub fn chat_template(&self) -> Option<&ChatTemplate> {
            self.chat_template.as_ref()
        }

        /// The name errors give the file.
        pub fn file(&self) -> &str {
            &self.file
        }

        fn check_ids(&self, ids: &[u32]) -> Result<(), TokenizerError> {
            match ids.iter().position(|&id| id as usize >= self.vocab_size) {
                None => Ok(()),
                Some(i) => Err(self.out_of_range(i, ids[i])),
            }
        }

        fn out_of_range(&self, position: usize, id: u32) -> TokenizerError {
            TokenizerError::Invalid {
                file: self.file.clone(),
                item: format!("decode token {position}"),
                expected: format!("an id below the vocabulary's {}", self.vocab_size),
                given: id.to_string(),
            }
        }

        fn library(&self, operation: &'static str, e: tokenizers::Error) -> TokenizerError {
            TokenizerError::Library {
                file: self.file.clone(),
                operation,
                message: e.to_string(),
            }
        }
    }

    /// Decodes tokens one at a time into text pieces that never end inside a character
    /// ([`Tokenizer::decode_stream`]).
    pub struct DecodeStream<'a> {
        tokenizer: &'a Tokenizer,
        inner: tokenizers::DecodeStream<
            'a,
            ModelWrapper,
            NormalizerWrapper,
            PreTokenizerWrapper,
            PostProcessorWrapper,
            DecoderWrapper,
        >,
    }

    impl DecodeStream<'_> {
        /// Add `id`; the text it completes, or `None` while it ends inside a character.
        pub fn step(&mut self, id: u32) -> Result<Option<String>, TokenizerError> {
            if id as usize >= self.tokenizer.vocab_size {
                return Err(TokenizerError::Invalid {
                    file: self.tokenizer.file.clone(),
                    item: "decode_stream step".into(),
                    expected: format!("an id below the vocabulary's {}", self.tokenizer.vocab_size),
                    given: id.to_string(),
                });
            }
            self.inner
                .step(id)
                .map_err(|e| self.tokenizer.library("decode", e))
        }
    }

    /// GPT-2's spelling of `text`'s bytes in its byte alphabet (a space is `Ġ`).
    fn byte_level_spelling(text: &str) -> String {
        use std::sync::OnceLock;
        static CHARS: OnceLock<[char; 256]> = OnceLock::new();
        let chars = CHARS.get_or_init(|| {
            // GPT-2's bytes_to_unicode: printable bytes stand for themselves, the others for
            // U+0100 onwards, in order.
            let mut out = ['\0'; 256];
            let mut next = 256u32;
            for b in 0..=255u8 {
                let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
                out[b as usize] = if printable {
                    char::from(b)
                } else {
                    next += 1;
                    char::from_u32(next - 1).unwrap_or('\u{FFFD}')
                };
            }
            out
        });
        text.bytes().map(|b| chars[b as usize]).collect()
    }

    fn type_name(value: &Value) -> String {
        format!("a {:?}", value.value_type())
    }
}
