//! The readers of untrusted files never panic and never allocate what a header claims before
//! checking it against the file's size. proptest mutates valid files — GGUF: a tiny Llama built
//! here (tensors of F32, F16, BF16, Q8_0, Q4_0, Q4_1 and Q4_K, metadata of every value type, a
//! byte-level BPE tokenizer and a chat template) as v3 and as v2 with 64-byte alignment, that
//! tokenizer alone, and tests/data/dequant.gguf (every dequantized type); safetensors: PEFT
//! adapters from `encode_adapters` (F32) and tests/data/peft-tiny (F16, BF16); and
//! `adapter_config.json` — and runs every reader and accessor on each mutant (GGUF: parse, each
//! metadata value and lookup, each tensor's `tensor_bytes` and `tensor_f32`, `load_model`,
//! `Tokenizer::from_gguf`, then encoding, decoding and the chat template; safetensors:
//! `decode_adapters`; the config: `PeftConfig::parse`, `to_json` read back, `decode_adapters`
//! with it) inside `catch_unwind`, under a counting global allocator: a case fails on a panic,
//! or when one allocation exceeds [`bound`], 64 × the input's length + 1 MiB.
//!
//! The mutations, one to three a case: a bit flipped or a byte overwritten (three times in four
//! within the first 512 bytes, the header); an integer field of the file's structure (a count, a
//! length, a type id, a dim, an offset, a value; in safetensors the header's length or a number
//! of its JSON) or any 4 or 8 bytes set to an extreme value (0, 1, 2^31 − 1, u32::MAX, 2^32,
//! 2^40, 2^63 − 1, u64::MAX, the file's length ± 2, the bytes left after the field ± 2, the old
//! value ± 4, a random one); a string (with its GGUF length) or a JSON token (a string, a number,
//! an array) replaced by one the readers look for; the file cut short; bytes inserted; a range
//! duplicated elsewhere or removed. A safetensors header edited as text mostly keeps its length
//! prefix right, so that the JSON reaches the adapters' own checks.
//!
//! `HESPER_FUZZ_CASES=N` cases a reader (default [`DEFAULT_CASES`]: about 5 s for the GGUF
//! reader in a debug build), from `HESPER_FUZZ_SEED` (default fixed: CI runs the same cases).
//! Each test prints its count, how far the mutants got and how many distinct errors they met
//! (`--nocapture`; `HESPER_FUZZ_VERBOSE=1` lists the errors). A failure prints the case proptest
//! shrank it to, the panic or the allocation and the mutant's first bytes in hex, and saves the
//! mutant under `target/tmp/fuzz_readers/`; an allocation too large to be made aborts the
//! process, but the allocator saves the mutant and prints its first bytes first.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::{Cell, RefCell};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Mutex;
use std::time::Instant;

use hesper::io::{
    ChatMessage, GgufFile, PeftConfig, Tokenizer, Value, decode_adapters, encode_adapters,
    load_model,
};
use hesper::model::config::{Family, LoraConfig, ModelConfig, Projection};
use hesper::model::reference::Adapters;
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::{Config, RngSeed, TestCaseError, TestError, TestRunner};

// ---------------------------------------------------------------------------------------------
// The allocation bound: a global allocator that remembers, per thread and only while a case
// runs, the largest single request.

/// The largest single allocation a reader may make for an input of `len` bytes.
fn bound(len: usize) -> usize {
    64 * len + (1 << 20)
}

/// A request this large is reported at once (the mutant saved, its header printed), as the
/// system may refuse it, and then the process aborts before the case could report.
const REPORT_AT_ONCE: usize = 1 << 30;

struct Counting;

#[global_allocator]
static ALLOCATOR: Counting = Counting;

thread_local! {
    /// Whether this thread is running a case (its allocations are counted).
    static TRACKING: Cell<bool> = const { Cell::new(false) };
    /// The largest request since the case began.
    static LARGEST: Cell<usize> = const { Cell::new(0) };
    /// The case's input and reader, for the report of a request too large to survive.
    static CURRENT: Cell<(*const u8, usize, &'static str)> =
        const { Cell::new((std::ptr::null(), 0, "")) };
    /// The message and place of the last panic on this thread while a case ran.
    static PANIC: RefCell<Option<String>> = const { RefCell::new(None) };
}

fn note(size: usize) {
    let Ok(true) = TRACKING.try_with(Cell::get) else {
        return;
    };
    LARGEST.with(|l| l.set(l.get().max(size)));
    if size >= REPORT_AT_ONCE {
        // Allocating again from here goes to the system, uncounted.
        TRACKING.with(|t| t.set(false));
        let (ptr, len, reader) = CURRENT.with(Cell::get);
        if !ptr.is_null() {
            // SAFETY: the harness points CURRENT at the case's input for as long as TRACKING is
            // set, and the input outlives the case.
            let bytes = unsafe { std::slice::from_raw_parts(ptr, len) };
            let path = save(reader, "huge-allocation", bytes);
            eprintln!(
                "fuzz_readers: {reader}: a request of {size} bytes for an input of {len} \
                 (bound {}); the input is saved in {path}; its first bytes: {}",
                bound(len),
                hex(bytes, 512)
            );
        }
        TRACKING.with(|t| t.set(true));
    }
}

// SAFETY: every call is forwarded to the system allocator unchanged.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

/// A panic hook that, while a case runs, keeps the message and place instead of printing them
/// (the case reports them), and prints as usual otherwise.
fn install_panic_hook() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // proptest silences a case's panics with a hook of its own, installed at its first
        // case: let it install it first, and put this one above.
        let config = Config {
            failure_persistence: None,
            ..Config::with_cases(1)
        };
        TestRunner::new(config).run(&Just(()), |()| Ok(())).unwrap();
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if TRACKING.try_with(Cell::get).unwrap_or(false) {
                let message = info
                    .payload()
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| info.payload().downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "(a panic without a message)".into());
                let place = info
                    .location()
                    .map(|l| format!(" at {}:{}", l.file(), l.line()))
                    .unwrap_or_default();
                PANIC.with(|p| *p.borrow_mut() = Some(format!("{message}{place}")));
            } else {
                default(info);
            }
        }));
    });
}

/// What went wrong in a case.
#[derive(Debug)]
enum Failure {
    Panic(String),
    Allocation { largest: usize, bound: usize },
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Panic(message) => write!(f, "a panic: {message}"),
            Failure::Allocation { largest, bound } => {
                write!(
                    f,
                    "an allocation of {largest} bytes, over the bound {bound}"
                )
            }
        }
    }
}

/// `run` on `input` (named `reader` in reports) with its panics caught and its allocations
/// counted: its result, or the panic, or the largest allocation when it exceeds `bound(len)`
/// (also left in `LARGEST`).
fn tracked<T>(
    reader: &'static str,
    input: &[u8],
    len: usize,
    run: impl FnOnce() -> T,
) -> Result<T, Failure> {
    install_panic_hook();
    PANIC.with(|p| p.borrow_mut().take());
    CURRENT.with(|c| c.set((input.as_ptr(), input.len(), reader)));
    LARGEST.with(|l| l.set(0));
    TRACKING.with(|t| t.set(true));
    let result = catch_unwind(AssertUnwindSafe(run));
    TRACKING.with(|t| t.set(false));
    CURRENT.with(|c| c.set((std::ptr::null(), 0, "")));
    let largest = LARGEST.with(Cell::get);
    match result {
        Err(_) => {
            let message = PANIC.with(|p| p.borrow_mut().take());
            Err(Failure::Panic(message.unwrap_or_else(|| "a panic".into())))
        }
        Ok(_) if largest > bound(len) => Err(Failure::Allocation {
            largest,
            bound: bound(len),
        }),
        Ok(value) => Ok(value),
    }
}

/// `bytes` saved as `target/tmp/fuzz_readers/{reader}-{what}.bin`; the path.
fn save(reader: &str, what: &str, bytes: &[u8]) -> String {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("fuzz_readers");
    let path = dir.join(format!("{reader}-{what}.bin"));
    let _ = std::fs::create_dir_all(&dir);
    match std::fs::write(&path, bytes) {
        Ok(()) => path.display().to_string(),
        Err(e) => format!("(not saved: {e})"),
    }
}

/// The first `max` bytes of `bytes` in hex, and how many more there are.
fn hex(bytes: &[u8], max: usize) -> String {
    let mut out: String = bytes[..bytes.len().min(max)]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    if bytes.len() > max {
        out.push_str(&format!("… ({} bytes more)", bytes.len() - max));
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Seeds: valid files, with where their integer fields and strings lie.

/// An integer the mutations may overwrite with an extreme value.
#[derive(Clone, Copy, Debug)]
enum Field {
    /// `width` little-endian bytes at `at`.
    Binary { at: usize, width: usize },
    /// A JSON number, the text `at..end`.
    Decimal { at: usize, end: usize },
}

/// A string the mutations may replace.
#[derive(Clone, Copy, Debug)]
enum Span {
    /// A GGUF string: its u64 length at `len_at`, its bytes `len_at + 8..end`.
    Gguf { len_at: usize, end: usize },
    /// A JSON token (a string with its quotes, or a number), the text `at..end`.
    Json { at: usize, end: usize },
}

impl Span {
    fn start(self) -> usize {
        match self {
            Span::Gguf { len_at, .. } => len_at,
            Span::Json { at, .. } => at,
        }
    }
}

struct Seed {
    name: &'static str,
    bytes: Vec<u8>,
    fields: Vec<Field>,
    spans: Vec<Span>,
    /// A safetensors file: edits of its JSON header may fix its length prefix.
    header_prefix: bool,
    /// What the reader needs besides the bytes: the LoRA config of an adapter.
    lora: Option<LoraConfig>,
    /// What the reader needs besides the bytes: the adapter an adapter_config.json describes.
    weights: Vec<u8>,
}

impl Seed {
    fn new(name: &'static str, bytes: Vec<u8>) -> Seed {
        Seed {
            name,
            bytes,
            fields: Vec::new(),
            spans: Vec::new(),
            header_prefix: false,
            lora: None,
            weights: Vec::new(),
        }
    }

    fn gguf(name: &'static str, bytes: Vec<u8>) -> Seed {
        let mut seed = Seed::new(name, bytes);
        GgufWalk {
            bytes: &seed.bytes,
            pos: 0,
            fields: &mut seed.fields,
            spans: &mut seed.spans,
        }
        .file();
        seed
    }

    /// A safetensors file: its length prefix and the JSON header's numbers and strings.
    fn safetensors(name: &'static str, bytes: Vec<u8>, lora: LoraConfig) -> Seed {
        let mut seed = Seed::new(name, bytes);
        let n = u64::from_le_bytes(seed.bytes[..8].try_into().unwrap()) as usize;
        seed.fields.push(Field::Binary { at: 0, width: 8 });
        json_tokens(&seed.bytes[..8 + n], 8, &mut seed.fields, &mut seed.spans);
        seed.header_prefix = true;
        seed.lora = Some(lora);
        seed
    }

    /// An adapter_config.json, with the adapter it describes.
    fn config(name: &'static str, text: &str, weights: Vec<u8>) -> Seed {
        let mut seed = Seed::new(name, text.as_bytes().to_vec());
        json_tokens(&seed.bytes, 0, &mut seed.fields, &mut seed.spans);
        seed.weights = weights;
        seed
    }
}

/// Walks a valid GGUF file, noting its integer fields and strings.
struct GgufWalk<'a> {
    bytes: &'a [u8],
    pos: usize,
    fields: &'a mut Vec<Field>,
    spans: &'a mut Vec<Span>,
}

impl GgufWalk<'_> {
    fn field(&mut self, width: usize) -> u64 {
        let mut le = [0u8; 8];
        le[..width].copy_from_slice(&self.bytes[self.pos..self.pos + width]);
        self.fields.push(Field::Binary {
            at: self.pos,
            width,
        });
        self.pos += width;
        u64::from_le_bytes(le)
    }

    fn string(&mut self) {
        let len_at = self.pos;
        let len = self.field(8) as usize;
        self.pos += len;
        self.spans.push(Span::Gguf {
            len_at,
            end: self.pos,
        });
    }

    fn value(&mut self, ty: u64) {
        match ty {
            0 | 1 | 7 => self.pos += 1,
            2 | 3 => _ = self.field(2),
            4..=6 => _ = self.field(4),
            10..=12 => _ = self.field(8),
            8 => self.string(),
            9 => {
                let elem = self.field(4);
                for _ in 0..self.field(8) {
                    self.value(elem);
                }
            }
            _ => panic!("value type {ty} in a seed"),
        }
    }

    fn file(&mut self) {
        self.pos = 4;
        self.field(4);
        let tensors = self.field(8);
        let kvs = self.field(8);
        for _ in 0..kvs {
            self.string();
            let ty = self.field(4);
            self.value(ty);
        }
        for _ in 0..tensors {
            self.string();
            let dims = self.field(4);
            for _ in 0..dims {
                self.field(8);
            }
            self.field(4);
            self.field(8);
        }
    }
}

/// The numbers, strings and arrays of the JSON text `text[from..]`, as fields and spans.
fn json_tokens(text: &[u8], from: usize, fields: &mut Vec<Field>, spans: &mut Vec<Span>) {
    let mut i = from;
    let mut arrays = Vec::new();
    while i < text.len() {
        match text[i] {
            b'[' => {
                arrays.push(i);
                i += 1;
            }
            b']' => {
                let at = arrays.pop().expect("a valid seed");
                i += 1;
                spans.push(Span::Json { at, end: i });
            }
            b'"' => {
                let at = i;
                i += 1;
                while text[i] != b'"' {
                    i += if text[i] == b'\\' { 2 } else { 1 };
                }
                i += 1;
                spans.push(Span::Json { at, end: i });
            }
            b'-' | b'0'..=b'9' => {
                let at = i;
                while i < text.len()
                    && matches!(text[i], b'-' | b'+' | b'.' | b'e' | b'E' | b'0'..=b'9')
                {
                    i += 1;
                }
                fields.push(Field::Decimal { at, end: i });
                spans.push(Span::Json { at, end: i });
            }
            _ => i += 1,
        }
    }
}

/// Reproducible random numbers for the seeds (splitmix64).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A finite IEEE half below 1 in magnitude.
    fn f16(&mut self) -> [u8; 2] {
        let r = self.next() as u16;
        ((r & 0x8000) | ((5 + r % 9) << 10) | (r & 0x3ff)).to_le_bytes()
    }
}

fn str_bytes(s: &str) -> Vec<u8> {
    let mut out = (s.len() as u64).to_le_bytes().to_vec();
    out.extend(s.as_bytes());
    out
}

/// A GGUF writer: raw key/values, tensors with raw data at aligned offsets.
struct Writer {
    version: u32,
    alignment: usize,
    kvs: Vec<u8>,
    kv_count: u64,
    tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)>,
}

impl Writer {
    fn kv(&mut self, key: &str, type_id: u32, value: &[u8]) -> &mut Writer {
        self.kvs.extend(str_bytes(key));
        self.kvs.extend(type_id.to_le_bytes());
        self.kvs.extend(value);
        self.kv_count += 1;
        self
    }

    fn u32(&mut self, key: &str, v: u32) -> &mut Writer {
        self.kv(key, 4, &v.to_le_bytes())
    }

    fn u64(&mut self, key: &str, v: u64) -> &mut Writer {
        self.kv(key, 10, &v.to_le_bytes())
    }

    fn f32(&mut self, key: &str, v: f32) -> &mut Writer {
        self.kv(key, 6, &v.to_le_bytes())
    }

    fn string(&mut self, key: &str, v: &str) -> &mut Writer {
        self.kv(key, 8, &str_bytes(v))
    }

    fn array(&mut self, key: &str, elem: u32, items: &[Vec<u8>]) -> &mut Writer {
        let mut v = elem.to_le_bytes().to_vec();
        v.extend((items.len() as u64).to_le_bytes());
        items.iter().for_each(|item| v.extend(item));
        self.kv(key, 9, &v)
    }

    /// A tensor of PyTorch shape `[rows, cols]` (`[cols]` when `rows` is 0) of ggml type
    /// `ty`, random finite values.
    fn tensor(&mut self, rng: &mut Rng, name: &str, rows: usize, cols: usize, ty: &str) {
        let (id, block_elems, block_bytes) = match ty {
            "F32" => (0, 1, 4),
            "F16" => (1, 1, 2),
            "BF16" => (30, 1, 2),
            "Q4_0" => (2, 32, 18),
            "Q4_1" => (3, 32, 20),
            "Q8_0" => (8, 32, 34),
            "Q4_K" => (12, 256, 144),
            _ => unreachable!("{ty}"),
        };
        assert_eq!(cols % block_elems, 0, "{name}");
        let mut data = Vec::new();
        for _ in 0..rows.max(1) * cols / block_elems {
            let mut block: Vec<u8> = (0..block_bytes).map(|_| rng.next() as u8).collect();
            match ty {
                "F32" => {
                    let v = (rng.next() % 2001) as f32 / 1000.0 - 1.0;
                    block.copy_from_slice(&v.to_le_bytes());
                }
                "F16" => block.copy_from_slice(&rng.f16()),
                // The upper half of a small f32.
                "BF16" => block.copy_from_slice(&[rng.next() as u8, 0x3e + (rng.next() & 1) as u8]),
                // Each block starts with its scale (and its min).
                _ => {
                    block[..2].copy_from_slice(&rng.f16());
                    block[2..4].copy_from_slice(&rng.f16());
                }
            }
            data.extend(block);
        }
        let dims = if rows == 0 {
            vec![cols as u64]
        } else {
            vec![cols as u64, rows as u64]
        };
        self.tensors.push((name.into(), dims, id, data));
    }

    fn build(&self) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend(self.version.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend(self.kv_count.to_le_bytes());
        out.extend(&self.kvs);
        let mut offset = 0;
        for (name, dims, ty, data) in &self.tensors {
            out.extend(str_bytes(name));
            out.extend((dims.len() as u32).to_le_bytes());
            dims.iter().for_each(|d| out.extend(d.to_le_bytes()));
            out.extend(ty.to_le_bytes());
            out.extend((offset as u64).to_le_bytes());
            offset = (offset + data.len()).next_multiple_of(self.alignment);
        }
        for (_, _, _, data) in &self.tensors {
            out.resize(out.len().next_multiple_of(self.alignment), 0);
            out.extend(data);
        }
        out
    }
}

/// The model seed's tokens, their types (3 control, 4 user-defined, 1 normal) and merges.
const TOKENS: [(&str, i32); 14] = [
    ("<|endoftext|>", 3),
    ("<|im_start|>", 3),
    ("<|im_end|>", 3),
    ("a", 1),
    ("b", 1),
    ("c", 1),
    ("Ġ", 1),
    ("Ċ", 1),
    ("1", 1),
    ("2", 1),
    ("ab", 1),
    ("abc", 1),
    ("Ġa", 1),
    ("<think>", 4),
];
const MERGES: [&str; 3] = ["a b", "ab c", "Ġ a"];
const CHAT_TEMPLATE: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}\
<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

impl Writer {
    fn new(version: u32, alignment: u32) -> Writer {
        Writer {
            version,
            alignment: alignment as usize,
            kvs: Vec::new(),
            kv_count: 0,
            tensors: Vec::new(),
        }
    }

    /// A byte-level BPE tokenizer of [`TOKENS`] and [`MERGES`], its special tokens and chat
    /// template.
    fn tokenizer(&mut self) -> &mut Writer {
        self.string("tokenizer.ggml.model", "gpt2")
            .string("tokenizer.ggml.pre", "smollm");
        let tokens: Vec<Vec<u8>> = TOKENS.iter().map(|(t, _)| str_bytes(t)).collect();
        self.array("tokenizer.ggml.tokens", 8, &tokens);
        let types: Vec<Vec<u8>> = TOKENS
            .iter()
            .map(|(_, t)| t.to_le_bytes().to_vec())
            .collect();
        self.array("tokenizer.ggml.token_type", 5, &types);
        let merges: Vec<Vec<u8>> = MERGES.iter().map(|m| str_bytes(m)).collect();
        self.array("tokenizer.ggml.merges", 8, &merges);
        self.u32("tokenizer.ggml.bos_token_id", 1)
            .u32("tokenizer.ggml.eos_token_id", 2);
        self.u32("tokenizer.ggml.padding_token_id", 0)
            .kv("tokenizer.ggml.add_bos_token", 7, &[1]);
        self.string("tokenizer.chat_template", CHAT_TEMPLATE)
    }
}

/// A tiny Llama (1 layer, D = 32, FFN 256, 2 query heads and 1 KV head of 16, untied head)
/// whose tensors are of seven types, with a tokenizer and a chat template, and metadata of every
/// value type: load_model and Tokenizer::from_gguf accept it.
fn model_gguf(version: u32, alignment: u32) -> Vec<u8> {
    let mut w = Writer::new(version, alignment);
    let (vocab, d, i, q, kv) = (TOKENS.len(), 32, 256, 32, 16);
    w.string("general.architecture", "llama")
        .u32("general.alignment", alignment);
    w.u32("llama.embedding_length", d as u32)
        .u64("llama.feed_forward_length", i as u64)
        .u32("llama.block_count", 1);
    w.u64("llama.attention.head_count", 2)
        .u32("llama.attention.head_count_kv", 1);
    w.u64("llama.attention.key_length", 16)
        .u32("llama.rope.dimension_count", 16);
    w.f32("llama.rope.freq_base", 10000.0)
        .f32("llama.attention.layer_norm_rms_epsilon", 1e-5);
    w.u32("llama.context_length", 16).tokenizer();
    // The other value types, and arrays of arrays.
    w.kv("test.u8", 0, &[7])
        .kv("test.i8", 1, &[0xf0])
        .kv("test.u16", 2, &[1, 2]);
    w.kv("test.i16", 3, &[0xff, 0xff])
        .kv("test.i64", 11, &(-3i64).to_le_bytes());
    w.kv("test.f64", 12, &0.25f64.to_le_bytes());
    let inner = |v: &[u16]| {
        let mut out = 2u32.to_le_bytes().to_vec();
        out.extend((v.len() as u64).to_le_bytes());
        v.iter().for_each(|x| out.extend(x.to_le_bytes()));
        out
    };
    w.array("test.nested", 9, &[inner(&[1, 2]), inner(&[3])]);

    let mut rng = Rng(7);
    w.tensor(&mut rng, "token_embd.weight", vocab, d, "F16");
    w.tensor(&mut rng, "blk.0.attn_norm.weight", 0, d, "F32");
    w.tensor(&mut rng, "blk.0.attn_q.weight", q, d, "Q8_0");
    w.tensor(&mut rng, "blk.0.attn_k.weight", kv, d, "Q8_0");
    w.tensor(&mut rng, "blk.0.attn_v.weight", kv, d, "Q4_0");
    w.tensor(&mut rng, "blk.0.attn_output.weight", d, q, "BF16");
    w.tensor(&mut rng, "blk.0.ffn_norm.weight", 0, d, "F32");
    w.tensor(&mut rng, "blk.0.ffn_gate.weight", i, d, "Q4_1");
    w.tensor(&mut rng, "blk.0.ffn_up.weight", i, d, "Q8_0");
    w.tensor(&mut rng, "blk.0.ffn_down.weight", d, i, "Q4_K");
    w.tensor(&mut rng, "output_norm.weight", 0, d, "F32");
    w.tensor(&mut rng, "output.weight", vocab, d, "F16");
    w.build()
}

/// A tokenizer alone (metadata, no tensors: 1.2 KB), so that mutations land in it more often.
fn tokenizer_gguf() -> Vec<u8> {
    Writer::new(3, 32).tokenizer().build()
}

fn data_file(path: &str) -> Vec<u8> {
    let path = format!("{}/tests/data/{path}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn gguf_seeds() -> Vec<Seed> {
    vec![
        Seed::gguf("model.gguf", model_gguf(3, 32)),
        Seed::gguf("model-v2-align64.gguf", model_gguf(2, 64)),
        Seed::gguf("tokenizer.gguf", tokenizer_gguf()),
        Seed::gguf("dequant.gguf", data_file("dequant.gguf")),
    ]
}

/// The adapters of tests/data/peft-tiny: r = 3, α = 6, rsLoRA, all seven projections.
fn fixture_lora() -> LoraConfig {
    LoraConfig {
        targets: Projection::ALL.to_vec(),
        rank: 3,
        alpha: 6.0,
        rslora: true,
    }
}

fn own_lora() -> LoraConfig {
    LoraConfig {
        targets: vec![Projection::Q, Projection::V, Projection::Down],
        rank: 2,
        alpha: 4.0,
        rslora: false,
    }
}

fn own_adapter() -> Vec<u8> {
    let config = ModelConfig::tiny(Family::Llama);
    let lora = own_lora();
    encode_adapters(&config, &lora, &Adapters::random(&config, &lora, 11)).unwrap()
}

fn safetensors_seeds() -> Vec<Seed> {
    let fixture = |dtype: &str| data_file(&format!("peft-tiny/{dtype}/adapter_model.safetensors"));
    vec![
        Seed::safetensors("own-f32.safetensors", own_adapter(), own_lora()),
        Seed::safetensors("fixture-f16.safetensors", fixture("f16"), fixture_lora()),
        Seed::safetensors("fixture-bf16.safetensors", fixture("bf16"), fixture_lora()),
    ]
}

fn config_seeds() -> Vec<Seed> {
    let own = PeftConfig::new(own_lora(), Some("hesper/tiny-llama")).to_json();
    let fixture = String::from_utf8(data_file("peft-tiny/bf16/adapter_config.json")).unwrap();
    vec![
        Seed::config("own-adapter_config.json", &own, own_adapter()),
        Seed::config(
            "fixture-adapter_config.json",
            &fixture,
            data_file("peft-tiny/bf16/adapter_model.safetensors"),
        ),
    ]
}

// ---------------------------------------------------------------------------------------------
// Mutations.

/// A position: in the first 512 bytes (the header), or anywhere.
#[derive(Clone, Copy, Debug)]
enum Pos {
    Head(usize),
    Any(Index),
}

impl Pos {
    /// The position in a file of `len` bytes (`len` > 0), below `len`.
    fn at(self, len: usize) -> usize {
        match self {
            Pos::Head(h) => h % len,
            Pos::Any(i) => i.index(len),
        }
    }
}

/// A value for an integer field.
#[derive(Clone, Copy, Debug)]
enum Extreme {
    Zero,
    One,
    I32Max,
    U32Max,
    Pow32,
    Pow40,
    I64Max,
    U64Max,
    /// The file's length plus this.
    FileLen(i8),
    /// The bytes after the field plus this.
    Rest(i8),
    /// The field's value plus this.
    Current(i8),
    Any(u64),
}

impl Extreme {
    fn value(self, current: u64, len: usize, end: usize) -> u64 {
        match self {
            Extreme::Zero => 0,
            Extreme::One => 1,
            Extreme::I32Max => i32::MAX as u64,
            Extreme::U32Max => u32::MAX.into(),
            Extreme::Pow32 => 1 << 32,
            Extreme::Pow40 => 1 << 40,
            Extreme::I64Max => i64::MAX as u64,
            Extreme::U64Max => u64::MAX,
            Extreme::FileLen(d) => (len as u64).wrapping_add_signed(d.into()),
            Extreme::Rest(d) => (len.saturating_sub(end) as u64).wrapping_add_signed(d.into()),
            Extreme::Current(d) => current.wrapping_add_signed(d.into()),
            Extreme::Any(v) => v,
        }
    }
}

#[derive(Clone, Debug)]
enum Mutation {
    Flip {
        at: Pos,
        bit: u8,
    },
    Byte {
        at: Pos,
        value: u8,
    },
    /// One of the seed's integer fields set to an extreme value.
    Field {
        field: Index,
        value: Extreme,
    },
    /// Any 4 or 8 bytes set to an extreme value.
    Word {
        at: Pos,
        width: usize,
        value: Extreme,
    },
    /// One of the seed's strings replaced by one of the reader's interesting strings.
    Text {
        span: Index,
        text: Index,
    },
    Truncate {
        at: Pos,
    },
    Insert {
        at: Pos,
        bytes: Vec<u8>,
    },
    Duplicate {
        from: Pos,
        len: usize,
        to: Pos,
    },
    Remove {
        at: Pos,
        len: usize,
    },
}

impl Mutation {
    /// Whether it edits the seed's structure (applied first, at the seed's offsets).
    fn structured(&self) -> bool {
        matches!(self, Mutation::Field { .. } | Mutation::Text { .. })
    }
}

#[derive(Clone, Debug)]
struct Case {
    seed: Index,
    mutations: Vec<Mutation>,
    /// A safetensors header edited as text keeps its length prefix right.
    fix_prefix: bool,
}

fn pos() -> impl Strategy<Value = Pos> {
    prop_oneof![
        3 => (0usize..512).prop_map(Pos::Head),
        1 => any::<Index>().prop_map(Pos::Any),
    ]
}

fn extreme() -> impl Strategy<Value = Extreme> {
    prop_oneof![
        Just(Extreme::Zero),
        Just(Extreme::One),
        Just(Extreme::I32Max),
        Just(Extreme::U32Max),
        Just(Extreme::Pow32),
        Just(Extreme::Pow40),
        Just(Extreme::I64Max),
        Just(Extreme::U64Max),
        (-2i8..=2).prop_map(Extreme::FileLen),
        (-2i8..=2).prop_map(Extreme::Rest),
        (-4i8..=4).prop_map(Extreme::Current),
        any::<u64>().prop_map(Extreme::Any),
    ]
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        2 => (pos(), 0u8..8).prop_map(|(at, bit)| Mutation::Flip { at, bit }),
        2 => (pos(), any::<u8>()).prop_map(|(at, value)| Mutation::Byte { at, value }),
        5 => (any::<Index>(), extreme()).prop_map(|(field, value)| Mutation::Field { field, value }),
        2 => (pos(), prop_oneof![Just(4usize), Just(8)], extreme())
            .prop_map(|(at, width, value)| Mutation::Word { at, width, value }),
        3 => (any::<Index>(), any::<Index>()).prop_map(|(span, text)| Mutation::Text { span, text }),
        1 => pos().prop_map(|at| Mutation::Truncate { at }),
        1 => (pos(), vec(any::<u8>(), 1..16)).prop_map(|(at, bytes)| Mutation::Insert { at, bytes }),
        1 => (pos(), 1usize..64, pos())
            .prop_map(|(from, len, to)| Mutation::Duplicate { from, len, to }),
        1 => (pos(), 1usize..64).prop_map(|(at, len)| Mutation::Remove { at, len }),
    ]
}

fn case() -> impl Strategy<Value = Case> {
    (
        any::<Index>(),
        vec(mutation(), 1..=3),
        prop::bool::weighted(0.85),
    )
        .prop_map(|(seed, mutations, fix_prefix)| Case {
            seed,
            mutations,
            fix_prefix,
        })
}

/// Strings a GGUF reader looks for: architectures, tokenizer names, tensor and key names.
const GGUF_TEXTS: &[&str] = &[
    "",
    "a",
    "llama",
    "qwen2",
    "qwen3",
    "gpt2",
    "smollm",
    "starcoder",
    "general.alignment",
    "general.architecture",
    "llama.block_count",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.merges",
    "token_embd.weight",
    "output.weight",
    "blk.0.attn_q.weight",
    "blk.1.attn_q.weight",
    "blk.0.attn_q.bias",
    "rope_freqs.weight",
    "a b",
    "a  b",
    "ab c d",
    "<|im_start|>",
    "<|endoftext|>",
    "Ġ",
    "{{ messages }}",
    "{% for m in messages %}{% for n in messages %}{{ m }}{% endfor %}{% endfor %}",
    "{{ raise_exception('no') }}",
    "{%",
    "é",
    "\u{0}",
    "\u{10ffff}",
    "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx",
];

/// JSON tokens the PEFT readers look for: dtypes (some of the seeds' sizes), keys, config
/// values, shapes of the seeds' element counts, odd numbers.
const JSON_TEXTS: &[&str] = &[
    "\"\"",
    "\"F32\"",
    "\"F16\"",
    "\"BF16\"",
    "\"F64\"",
    "\"I8\"",
    "\"I16\"",
    "\"U16\"",
    "\"I32\"",
    "\"U32\"",
    "\"U64\"",
    "\"BOOL\"",
    "\"F8_E4M3\"",
    "\"F4\"",
    "\"__metadata__\"",
    "\"base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight\"",
    "\"base_model.model.model.layers.0.mlp.down_proj.lora_B.weight\"",
    "\"base_model.model.model.layers.99.self_attn.v_proj.lora_A.weight\"",
    "\"base_model.model.model.layers.01.self_attn.v_proj.lora_A.weight\"",
    "\"base_model.model.model.layers.18446744073709551616.self_attn.v_proj.lora_A.weight\"",
    "\"data_offsets\"",
    "\"shape\"",
    "\"dtype\"",
    "\"q_proj\"",
    "\"k_proj\"",
    "\"o_proj\"",
    "\"gate_proj\"",
    "\"mlp.up_proj\"",
    "\"all-linear\"",
    "\".*\"",
    "\"LORA\"",
    "\"LOHA\"",
    "\"CAUSAL_LM\"",
    "\"pissa\"",
    "\"\\ud800\"",
    "\"\\u0000\"",
    "\"é\"",
    "-1",
    "0",
    "1.5",
    "1e400",
    "-0.0",
    "18446744073709551616",
    "99999999999999999999999999",
    "null",
    "true",
    "false",
    "[]",
    "{}",
    "[0,0]",
    "[0]",
    "[64,2]",
    "[1,128]",
    "[128,2]",
    "[2,64,1]",
    "[128,3]",
    "[64,3]",
    "[3,32]",
    "[384]",
    "[1099511627776,1099511627776]",
    "[\"q_proj\",\"q_proj\"]",
    "{\"a\":1}",
];

/// The mutant of `seed` that `case` describes.
fn mutate(seed: &Seed, case: &Case, texts: &[&str]) -> Vec<u8> {
    let mut b = seed.bytes.clone();
    // The edits of the seed's structure, from the last: each leaves the offsets before it.
    let mut structured: Vec<(usize, &Mutation)> = case
        .mutations
        .iter()
        .filter(|m| m.structured())
        .filter_map(|m| {
            let at = match *m {
                Mutation::Field { field, .. } if !seed.fields.is_empty() => {
                    match *field.get(&seed.fields) {
                        Field::Binary { at, .. } | Field::Decimal { at, .. } => at,
                    }
                }
                Mutation::Text { span, .. } if !seed.spans.is_empty() => {
                    span.get(&seed.spans).start()
                }
                _ => return None,
            };
            Some((at, m))
        })
        .collect();
    structured.sort_by_key(|&(at, _)| std::cmp::Reverse(at));
    let header_len = if seed.header_prefix {
        u64::from_le_bytes(b[..8].try_into().unwrap())
    } else {
        0
    };
    let mut prefix_fixed = false;
    for (at, m) in structured {
        if seed.header_prefix && at < 8 && !prefix_fixed {
            fix_prefix(&mut b, seed, header_len, case.fix_prefix);
            prefix_fixed = true;
        }
        match *m {
            Mutation::Field { field, value } => match *field.get(&seed.fields) {
                Field::Binary { at, width } if at + width <= b.len() => {
                    let mut le = [0u8; 8];
                    le[..width].copy_from_slice(&b[at..at + width]);
                    let v = value.value(u64::from_le_bytes(le), b.len(), at + width);
                    b[at..at + width].copy_from_slice(&v.to_le_bytes()[..width]);
                }
                Field::Decimal { at, end } if end <= b.len() => {
                    let current = std::str::from_utf8(&b[at..end])
                        .ok()
                        .and_then(|s| s.parse().ok())
                        .unwrap_or(0);
                    let v = value.value(current, b.len(), end);
                    b.splice(at..end, v.to_string().into_bytes());
                }
                // An earlier edit at the same place made it shorter.
                _ => {}
            },
            Mutation::Text { span, text } => {
                let text = text.get(texts).as_bytes();
                match *span.get(&seed.spans) {
                    Span::Gguf { len_at, end } if end <= b.len() => {
                        b.splice(len_at..end, str_bytes_raw(text));
                    }
                    Span::Json { at, end } if end <= b.len() => {
                        b.splice(at..end, text.iter().copied());
                    }
                    _ => {}
                }
            }
            _ => unreachable!(),
        }
    }
    if seed.header_prefix && !prefix_fixed {
        fix_prefix(&mut b, seed, header_len, case.fix_prefix);
    }
    for m in case.mutations.iter().filter(|m| !m.structured()) {
        if b.is_empty() {
            break;
        }
        let len = b.len();
        match *m {
            Mutation::Flip { at, bit } => b[at.at(len)] ^= 1 << bit,
            Mutation::Byte { at, value } => b[at.at(len)] = value,
            Mutation::Word { at, width, value } => {
                let at = at.at(len).min(len.saturating_sub(width));
                let width = width.min(len - at);
                let mut le = [0u8; 8];
                le[..width].copy_from_slice(&b[at..at + width]);
                let v = value.value(u64::from_le_bytes(le), len, at + width);
                b[at..at + width].copy_from_slice(&v.to_le_bytes()[..width]);
            }
            Mutation::Truncate { at } => b.truncate(at.at(len)),
            Mutation::Insert { at, ref bytes } => {
                let at = at.at(len + 1);
                b.splice(at..at, bytes.iter().copied());
            }
            Mutation::Duplicate { from, len: n, to } => {
                let from = from.at(len);
                let piece = b[from..(from + n).min(len)].to_vec();
                let to = to.at(len + 1);
                b.splice(to..to, piece);
            }
            Mutation::Remove { at, len: n } => {
                let at = at.at(len);
                b.drain(at..(at + n).min(len));
            }
            Mutation::Field { .. } | Mutation::Text { .. } => unreachable!(),
        }
    }
    b
}

fn str_bytes_raw(s: &[u8]) -> Vec<u8> {
    let mut out = (s.len() as u64).to_le_bytes().to_vec();
    out.extend(s);
    out
}

/// The safetensors length prefix set to the header's new length (the file's length less the
/// seed's data), when `fix` is set.
fn fix_prefix(b: &mut [u8], seed: &Seed, header_len: u64, fix: bool) {
    if fix {
        let data = seed.bytes.len() as u64 - 8 - header_len;
        let n = b.len() as u64 - 8 - data;
        b[..8].copy_from_slice(&n.to_le_bytes());
    }
}

// ---------------------------------------------------------------------------------------------
// The readers, every accessor on each mutant.

/// The readers' errors on a mutant, for counting the distinct ones.
type Errors = Vec<String>;

/// `result`'s value, its error's message pushed on `errors`.
fn ok<T, E: std::fmt::Display>(result: Result<T, E>, errors: &mut Errors) -> Option<T> {
    result.map_err(|e| errors.push(e.to_string())).ok()
}

/// How far a GGUF mutant got: 0 not parsed, 1 parsed, 2 a model or a tokenizer loaded, 3
/// both.
fn exercise_gguf(bytes: &[u8], errors: &mut Errors) -> usize {
    let Some(file) = ok(GgufFile::parse(bytes.to_vec(), "fuzz.gguf"), errors) else {
        return 0;
    };
    let _ = (file.name(), file.version(), file.alignment());
    for (key, value) in file.metadata_entries() {
        touch(value);
        // The first value of `key` is this one: keys are unique (compared as places, as a
        // value may be a NaN).
        assert!(file.metadata(key).is_some_and(|v| std::ptr::eq(v, value)));
        let _ = file.metadata_u64(key);
        let _ = file.metadata_f64(key);
        let _ = file.metadata_str(key);
        let _ = file.metadata_array(key);
    }
    for key in ["general.architecture", "llama.block_count", "absent"] {
        let _ = file.metadata_u64(key);
        let _ = file.metadata_str(key);
    }
    for info in file.tensors() {
        let shape = info.shape();
        let elements = info.elements();
        assert_eq!(file.tensor(&info.name), Some(info));
        let data = file.tensor_bytes(&info.name).expect("a listed tensor");
        assert_eq!(data.len() as u64, info.size);
        if let Some(values) = ok(file.tensor_f32(&info.name), errors) {
            assert_eq!(values.len() as u64, elements, "{:?}", info.name);
            assert_eq!(shape.iter().product::<usize>(), values.len());
        }
    }
    let _ = file.tensor_f32("absent");
    let mut reached = 1;
    if let Some((config, weights)) = ok(load_model(&file), errors) {
        weights.check(&config).expect("load_model checked it");
        reached += 1;
    }
    if let Some(tokenizer) = ok(Tokenizer::from_gguf(&file), errors) {
        if let Some(ids) = ok(tokenizer.encode("abc 12 <|im_start|>a\nb<think>"), errors) {
            ok(tokenizer.decode(&ids), errors);
            let mut stream = tokenizer.decode_stream();
            for &id in &ids {
                ok(stream.step(id), errors);
            }
        }
        ok(tokenizer.encode_with_offsets("ab c"), errors);
        ok(tokenizer.decode(&[0, 1, u32::MAX]), errors);
        let _ = tokenizer.token_id("Ġa");
        if let Some(template) = tokenizer.chat_template() {
            ok(
                template.render(&[ChatMessage::new("user", "hi")], true),
                errors,
            );
        }
        reached += 1;
    }
    reached
}

/// Every accessor of a metadata value, its elements' too.
fn touch(value: &Value) {
    let _ = (value.value_type(), value.as_u64(), value.as_f64());
    let _ = (value.as_str(), value.as_array());
    if let Some(items) = value.as_array() {
        items.iter().for_each(touch);
    }
}

/// Whether a safetensors mutant decoded to adapters.
fn exercise_safetensors(bytes: &[u8], lora: &LoraConfig, errors: &mut Errors) -> usize {
    let config = ModelConfig::tiny(Family::Llama);
    match ok(
        decode_adapters(bytes, "fuzz.safetensors", &config, lora),
        errors,
    ) {
        Some(adapters) => {
            adapters
                .check(&config, lora)
                .expect("decode_adapters checked it");
            1
        }
        None => 0,
    }
}

/// How far an adapter_config.json mutant got: 0 refused, 1 parsed (and its JSON parses back
/// to the same config), 2 its adapter decoded with it.
fn exercise_config(text: &[u8], weights: &[u8], errors: &mut Errors) -> usize {
    let Some(text) = ok(std::str::from_utf8(text), errors) else {
        return 0;
    };
    let Some(peft) = ok(PeftConfig::parse(text, "adapter_config.json"), errors) else {
        return 0;
    };
    // What to_json writes parses back to the same config, but that serde_json (without its
    // `float_roundtrip` feature) may parse a float of 17 digits 1 ulp off.
    let mut again = PeftConfig::parse(&peft.to_json(), "again.json").expect("to_json parses");
    for (a, b) in [
        (&mut again.lora.alpha, peft.lora.alpha),
        (&mut again.lora_dropout, peft.lora_dropout),
    ] {
        assert!((*a - b).abs() <= 2.0 * f64::EPSILON * b.abs(), "{a} vs {b}");
        *a = b;
    }
    assert_eq!(again, peft);
    let config = ModelConfig::tiny(Family::Llama);
    let adapters = decode_adapters(weights, "adapter_model.safetensors", &config, &peft.lora);
    match ok(adapters, errors) {
        Some(_) => 2,
        None => 1,
    }
}

// ---------------------------------------------------------------------------------------------
// The harness.

/// The cases a reader when `HESPER_FUZZ_CASES` is unset: a few seconds each in a debug build.
const DEFAULT_CASES: u32 = 5000;

fn env_u64(name: &str) -> Option<u64> {
    let value = std::env::var(name).ok()?;
    Some(
        value
            .parse()
            .unwrap_or_else(|_| panic!("{name}={value:?} is not a number")),
    )
}

/// An error message with its numbers as `#` and cut at 240 characters: its kind.
fn kind(message: &str) -> String {
    let mut out = String::new();
    for c in message.chars().take(240) {
        if !c.is_ascii_digit() {
            out.push(c);
        } else if !out.ends_with('#') {
            out.push('#');
        }
    }
    out
}

/// What the cases of one reader came to.
#[derive(Default)]
struct Stats {
    cases: u64,
    reached: [u64; 4],
    kinds: std::collections::HashSet<String>,
    /// The largest allocation, its share of the bound, and the input that made it.
    largest: usize,
    share: f64,
    largest_input: Vec<u8>,
}

/// One case: the mutant `case` describes, `exercise`d within the bound, counted in `stats`.
fn run_case(
    reader: &'static str,
    seeds: &[Seed],
    texts: &[&str],
    exercise: &(impl Fn(&Seed, &[u8], &mut Errors) -> usize + Sync),
    stats: &Mutex<Stats>,
    case: Case,
) -> Result<(), TestCaseError> {
    let seed = case.seed.get(seeds);
    let bytes = mutate(seed, &case, texts);
    let len = bytes.len() + seed.weights.len();
    let mut errors = Errors::new();
    match tracked(reader, &bytes, len, || exercise(seed, &bytes, &mut errors)) {
        Ok(reached) => {
            let mut s = stats.lock().unwrap();
            s.cases += 1;
            s.reached[reached.min(3)] += 1;
            let largest = LARGEST.with(Cell::get);
            let share = largest as f64 / bound(len) as f64;
            if share > s.share {
                (s.largest, s.share, s.largest_input) = (largest, share, bytes.clone());
            }
            for e in &errors {
                s.kinds.insert(kind(e));
            }
            Ok(())
        }
        Err(failure) => {
            let path = save(reader, "failure", &bytes);
            Err(TestCaseError::fail(format!(
                "{failure} on a mutant of {} ({} bytes, saved in {path}), first bytes: {}",
                seed.name,
                bytes.len(),
                hex(&bytes, 512)
            )))
        }
    }
}

/// The cases a thread runs (see [`fuzz`]).
const CHUNK: u32 = 1000;

/// Run `exercise` on `cases` mutants of `seeds` (`HESPER_FUZZ_CASES`, else `default_cases`);
/// eprintln the count, how many got how far, and how many distinct errors they met.
fn fuzz(
    reader: &'static str,
    seeds: &[Seed],
    texts: &'static [&'static str],
    default_cases: u32,
    exercise: impl Fn(&Seed, &[u8], &mut Errors) -> usize + Sync,
) {
    // Each seed is valid, and reaches the deepest level.
    let deepest: Vec<usize> = seeds
        .iter()
        .map(|seed| {
            let len = seed.bytes.len() + seed.weights.len();
            let mut errors = Errors::new();
            tracked(reader, &seed.bytes, len, || {
                exercise(seed, &seed.bytes, &mut errors)
            })
            .unwrap_or_else(|f| panic!("{reader}: seed {}: {f}", seed.name))
        })
        .collect();
    let cases = env_u64("HESPER_FUZZ_CASES").map_or(default_cases, |n| n as u32);
    let rng_seed = env_u64("HESPER_FUZZ_SEED").unwrap_or(0x4845_5350_4552);
    let stats = Mutex::new(Stats::default());
    let start = Instant::now();
    // The cases in chunks, each on a thread of its own, so that no thread-local state of a
    // library grows over all of them: tokenizers 0.23 keeps its BPE caches in a thread-local map
    // keyed by each BPE's id and never removes one, so that map grows with every tokenizer built
    // and used on the thread (a leak, which in a long run ends in an allocation larger than a
    // small file's bound).
    let mut chunk = 0;
    while u64::from(chunk) * u64::from(CHUNK) < u64::from(cases) {
        let n = CHUNK.min(cases - chunk * CHUNK);
        let result = std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    let mut runner = TestRunner::new(Config {
                        cases: n,
                        failure_persistence: None,
                        rng_seed: RngSeed::Fixed(rng_seed.wrapping_add(chunk.into())),
                        max_shrink_time: 60_000,
                        ..Config::default()
                    });
                    runner.run(&case(), |case| {
                        run_case(reader, seeds, texts, &exercise, &stats, case)
                    })
                })
                .join()
                .expect("the runner catches the cases' panics")
        });
        match result {
            Ok(()) => {}
            Err(TestError::Fail(reason, case)) => {
                panic!("{reader}: {reason}\nthe case (chunk {chunk}), shrunk: {case:?}")
            }
            Err(e) => panic!("{reader}: {e}"),
        }
        chunk += 1;
    }
    let s = stats.lock().unwrap();
    if std::env::var_os("HESPER_FUZZ_VERBOSE").is_some() {
        let mut kinds: Vec<_> = s.kinds.iter().collect();
        kinds.sort();
        kinds
            .iter()
            .for_each(|k| eprintln!("fuzz_readers: {reader}: error: {k}"));
        let path = save(reader, "largest", &s.largest_input);
        eprintln!("fuzz_readers: {reader}: the input of the largest allocation: {path}");
    }
    eprintln!(
        "fuzz_readers: {reader}: {} cases in {:.1} s (seed {rng_seed}), none panicked or \
         over-allocated; how far they got (0 refused, 1 to 3 further; the seeds {deepest:?}): \
         {:?}; {} distinct errors; the largest allocation against the bound: {} bytes of an input of {}, \
         {:.1}% of the bound",
        s.cases,
        start.elapsed().as_secs_f64(),
        s.reached,
        s.kinds.len(),
        s.largest,
        s.largest_input.len(),
        100.0 * s.share,
    );
}

#[test]
fn gguf_reader_survives_mutated_files() {
    fuzz(
        "gguf",
        &gguf_seeds(),
        GGUF_TEXTS,
        DEFAULT_CASES,
        |_, bytes, errors| exercise_gguf(bytes, errors),
    );
}

#[test]
fn safetensors_reader_survives_mutated_files() {
    fuzz(
        "safetensors",
        &safetensors_seeds(),
        JSON_TEXTS,
        DEFAULT_CASES,
        |seed, bytes, errors| exercise_safetensors(bytes, seed.lora.as_ref().unwrap(), errors),
    );
}

#[test]
fn adapter_config_parser_survives_mutated_json() {
    fuzz(
        "adapter_config",
        &config_seeds(),
        JSON_TEXTS,
        DEFAULT_CASES,
        |seed, bytes, errors| exercise_config(bytes, &seed.weights, errors),
    );
}

/// The harness itself: a panic and an allocation over the bound are failures.
#[test]
fn the_harness_catches_panics_and_large_allocations() {
    let input = [0u8; 16];
    let failure = tracked("self-test", &input, 16, || panic!("boom")).unwrap_err();
    assert!(
        matches!(&failure, Failure::Panic(m) if m.contains("boom")),
        "{failure:?}"
    );
    let failure = tracked("self-test", &input, 16, || {
        std::hint::black_box(Vec::<u8>::with_capacity(bound(16) + 1));
    })
    .unwrap_err();
    assert!(matches!(failure, Failure::Allocation { .. }), "{failure:?}");
    tracked("self-test", &input, 16, || {
        std::hint::black_box(Vec::<u8>::with_capacity(bound(16)));
    })
    .unwrap();
}

/// `bytes` (a GGUF file) with the value of metadata key `key` overwritten by `le`.
fn set_value(bytes: &mut [u8], key: &str, le: &[u8]) {
    let needle = str_bytes(key);
    let at = bytes
        .windows(needle.len())
        .position(|w| w == needle)
        .unwrap_or_else(|| panic!("{key} in the seed"))
        + needle.len()
        + 4;
    bytes[at..at + le.len()].copy_from_slice(le);
}

/// The mutant `bytes` read by every GGUF accessor within the bound; the error load_model gives.
fn model_error(bytes: &[u8]) -> String {
    let mut errors = Errors::new();
    tracked("regression", bytes, bytes.len(), || {
        exercise_gguf(bytes, &mut errors)
    })
    .unwrap_or_else(|f| panic!("{f}"));
    let file = GgufFile::parse(bytes.to_vec(), "fuzz.gguf").unwrap();
    load_model(&file).unwrap_err().to_string()
}

/// What the fuzzing found, and what it could not reach with small seeds.
#[test]
fn regressions() {
    // `llama.block_count` = 2^31 + 1 (the top bit set): load_model reserved room for that many
    // layers (824 GB) before looking for their tensors, and the process aborted.
    let mut b = model_gguf(3, 32);
    set_value(&mut b, "llama.block_count", &0x8000_0001u32.to_le_bytes());
    let e = model_error(&b);
    assert!(
        e.contains("\"blk.1.attn_norm.weight\"") && e.contains("absent"),
        "{e}"
    );

    // `head_count` = 2^60 + 2 (a bit flipped): heads · head_dim overflowed (a panic in a debug
    // build, a wrapped size in a release one).
    let mut b = model_gguf(3, 32);
    set_value(
        &mut b,
        "llama.attention.head_count",
        &((1u64 << 60) + 2).to_le_bytes(),
    );
    let e = model_error(&b);
    assert!(
        e.contains("\"llama.attention.head_count\"") && e.contains("fits"),
        "{e}"
    );

    // A tensor of no bytes whose other dims' product overflows: [0, 2^40, 2^40] (ggml's order)
    // was accepted, and its shape's product overflowed in any order but ggml's (and for a block
    // type, elements() could too: Q1_0's [2^63, 2, 0]).
    let mut w = Writer::new(3, 32);
    w.tensors
        .push(("t".into(), vec![0, 1 << 40, 1 << 40], 0, Vec::new()));
    let b = w.build();
    let mut errors = Errors::new();
    tracked("regression", &b, b.len(), || exercise_gguf(&b, &mut errors)).unwrap();
    let e = GgufFile::parse(b, "t.gguf").unwrap_err().to_string();
    assert!(
        e.contains("tensor \"t\"") && e.contains("fits in memory"),
        "{e}"
    );
    w.tensors[0] = ("t".into(), vec![1 << 63, 2, 0], 41, Vec::new());
    let e = GgufFile::parse(w.build(), "t.gguf")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("tensor \"t\"") && e.contains("fits in memory"),
        "{e}"
    );

    // A vocabulary of 917 505 u8s (one byte each, not strings): the tokenizer reserved its
    // table for that many tokens (2^21 entries of 33 bytes, 75 × the file) before finding the
    // first is not a string.
    let n = (7 << 17) + 1;
    let mut w = Writer::new(3, 32);
    w.string("tokenizer.ggml.model", "gpt2")
        .string("tokenizer.ggml.pre", "gpt2");
    let mut tokens = 0u32.to_le_bytes().to_vec();
    tokens.extend((n as u64).to_le_bytes());
    tokens.resize(tokens.len() + n, b'a');
    w.kv("tokenizer.ggml.tokens", 9, &tokens);
    let b = w.build();
    let file = GgufFile::parse(b.clone(), "vocab.gguf").unwrap();
    let e = tracked("regression", &b, b.len(), || {
        Tokenizer::from_gguf(&file).unwrap_err().to_string()
    })
    .unwrap_or_else(|f| panic!("{f}"));
    assert!(
        e.contains("tokenizer.ggml.tokens") && e.contains("a string"),
        "{e}"
    );
}
