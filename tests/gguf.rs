//! The GGUF reader on small files a minimal writer below makes (valid and corrupted), its
//! dequantizers against gguf-py's (tests/data/dequant.gguf, from scripts/gguf-fixture.py), the
//! model mapping on tiny synthetic models, and the real SmolLM2 file when present
//! (scripts/fetch-model, or `HESPER_SMOLLM2=path`).

mod common;

use hesper::io::{GgufError, GgufFile, Value, ValueType, load_model};
use hesper::model::config::{Family, ModelConfig};

/// A metadata value as the writer lays it out: type id and bytes.
fn kv_bytes(key: &str, type_id: u32, value: &[u8]) -> Vec<u8> {
    let mut out = str_bytes(key);
    out.extend(type_id.to_le_bytes());
    out.extend(value);
    out
}

fn str_bytes(s: &str) -> Vec<u8> {
    let mut out = (s.len() as u64).to_le_bytes().to_vec();
    out.extend(s.as_bytes());
    out
}

/// A minimal GGUF writer: raw key/values, tensors with raw data, offsets aligned.
struct Writer {
    version: u32,
    alignment: u64,
    kvs: Vec<Vec<u8>>,
    tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)>,
}

impl Writer {
    fn new() -> Writer {
        Writer {
            version: 3,
            alignment: 32,
            kvs: Vec::new(),
            tensors: Vec::new(),
        }
    }

    fn kv(&mut self, key: &str, type_id: u32, value: &[u8]) -> &mut Writer {
        self.kvs.push(kv_bytes(key, type_id, value));
        self
    }

    fn u32(&mut self, key: &str, v: u32) -> &mut Writer {
        self.kv(key, 4, &v.to_le_bytes())
    }

    fn f32(&mut self, key: &str, v: f32) -> &mut Writer {
        self.kv(key, 6, &v.to_le_bytes())
    }

    fn string(&mut self, key: &str, v: &str) -> &mut Writer {
        self.kv(key, 8, &str_bytes(v))
    }

    fn strings(&mut self, key: &str, items: &[&str]) -> &mut Writer {
        let mut v = 8u32.to_le_bytes().to_vec();
        v.extend((items.len() as u64).to_le_bytes());
        items.iter().for_each(|s| v.extend(str_bytes(s)));
        self.kv(key, 9, &v)
    }

    fn alignment(&mut self, a: u32) -> &mut Writer {
        self.alignment = a.into();
        self.u32("general.alignment", a)
    }

    /// An F32 tensor of PyTorch shape `shape` (written as GGUF dims, reversed).
    fn tensor_f32(&mut self, name: &str, shape: &[usize], values: &[f32]) -> &mut Writer {
        assert_eq!(shape.iter().product::<usize>(), values.len());
        let dims = shape.iter().rev().map(|&d| d as u64).collect();
        let data = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.tensors.push((name.into(), dims, 0, data));
        self
    }

    fn build(&self) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend(self.version.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend((self.kvs.len() as u64).to_le_bytes());
        self.kvs.iter().for_each(|kv| out.extend(kv));
        let mut offset = 0u64;
        for (name, dims, ty, data) in &self.tensors {
            out.extend(str_bytes(name));
            out.extend((dims.len() as u32).to_le_bytes());
            dims.iter().for_each(|d| out.extend(d.to_le_bytes()));
            out.extend(ty.to_le_bytes());
            out.extend(offset.to_le_bytes());
            offset = (offset + data.len() as u64).div_ceil(self.alignment) * self.alignment;
        }
        for (_, _, _, data) in &self.tensors {
            out.resize(
                (out.len() as u64).div_ceil(self.alignment) as usize * self.alignment as usize,
                0,
            );
            out.extend(data);
        }
        out
    }
}

fn parse(bytes: Vec<u8>) -> Result<GgufFile, GgufError> {
    GgufFile::parse(bytes, "test.gguf")
}

/// The error's message, which must name `test.gguf` and contain each of `parts`.
#[track_caller]
fn expect_err(result: Result<GgufFile, GgufError>, parts: &[&str]) {
    let message = result.expect_err("an error").to_string();
    assert!(message.starts_with("test.gguf: "), "{message}");
    for part in parts {
        assert!(message.contains(part), "{message:?} lacks {part:?}");
    }
}

fn small_file() -> Writer {
    let mut w = Writer::new();
    w.string("general.architecture", "llama")
        .u32("n", 7)
        .strings("list", &["a", "bc"]);
    w.tensor_f32("a", &[2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    w.tensor_f32("b", &[1], &[-1.5]);
    w
}

#[test]
fn metadata_of_every_type_round_trips_in_v2_and_v3() {
    for version in [2, 3] {
        let mut w = Writer::new();
        w.version = version;
        w.kv("u8", 0, &[200])
            .kv("i8", 1, &[0xff])
            .kv("u16", 2, &500u16.to_le_bytes());
        w.kv("i16", 3, &(-500i16).to_le_bytes()).u32("u32", 70_000);
        w.kv("i32", 5, &(-7i32).to_le_bytes())
            .f32("f32", 1.5)
            .kv("bool", 7, &[1]);
        w.string("str", "héllo").strings("strs", &["x", "", "yz"]);
        w.kv("u64", 10, &u64::MAX.to_le_bytes())
            .kv("i64", 11, &i64::MIN.to_le_bytes());
        w.kv("f64", 12, &0.1f64.to_le_bytes());
        // An array of two arrays of u16.
        let mut nested = 9u32.to_le_bytes().to_vec();
        nested.extend(2u64.to_le_bytes());
        for pair in [[1u16, 2], [3, 4]] {
            nested.extend(2u32.to_le_bytes());
            nested.extend(2u64.to_le_bytes());
            pair.iter().for_each(|v| nested.extend(v.to_le_bytes()));
        }
        w.kv("nested", 9, &nested);
        let f = parse(w.build()).unwrap();
        assert_eq!(f.version(), version);
        assert_eq!(f.metadata("u8"), Some(&Value::U8(200)));
        assert_eq!(f.metadata("i8"), Some(&Value::I8(-1)));
        assert_eq!(f.metadata("u16"), Some(&Value::U16(500)));
        assert_eq!(f.metadata("i16"), Some(&Value::I16(-500)));
        assert_eq!(f.metadata_u64("u32").unwrap(), 70_000);
        assert_eq!(f.metadata("i32"), Some(&Value::I32(-7)));
        assert_eq!(f.metadata_f64("f32").unwrap(), 1.5);
        assert_eq!(f.metadata("bool"), Some(&Value::Bool(true)));
        assert_eq!(f.metadata_str("str").unwrap(), "héllo");
        let strs: Vec<_> = f
            .metadata_array("strs")
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect();
        assert_eq!(strs, ["x", "", "yz"]);
        assert_eq!(f.metadata_u64("u64").unwrap(), u64::MAX);
        assert_eq!(f.metadata("i64"), Some(&Value::I64(i64::MIN)));
        assert_eq!(f.metadata_f64("f64").unwrap(), 0.1);
        let inner =
            |v: &[u16]| Value::Array(ValueType::U16, v.iter().map(|&x| Value::U16(x)).collect());
        assert_eq!(
            f.metadata("nested"),
            Some(&Value::Array(
                ValueType::Array,
                vec![inner(&[1, 2]), inner(&[3, 4])]
            ))
        );
        assert_eq!(f.metadata_entries().len(), 14);
        assert_eq!(f.metadata("absent"), None);
        let e = f.metadata_u64("str").unwrap_err().to_string();
        assert!(
            e.contains("\"str\"") && e.contains("non-negative integer") && e.contains("String"),
            "{e}"
        );
        let e = f.metadata_u64("i64").unwrap_err().to_string();
        assert!(e.contains("\"i64\""), "{e}");
        let e = f.metadata_str("nope").unwrap_err().to_string();
        assert!(e.contains("\"nope\"") && e.contains("absent"), "{e}");
    }
}

#[test]
fn tensor_data_lies_at_aligned_offsets() {
    for alignment in [None, Some(64), Some(1)] {
        let mut w = small_file();
        if let Some(a) = alignment {
            w.alignment(a);
        }
        let bytes = w.build();
        let f = parse(bytes.clone()).unwrap();
        let a = alignment.map_or(32, u64::from);
        assert_eq!(f.alignment(), a);
        let t = f.tensors();
        assert_eq!(t.len(), 2);
        assert_eq!(
            (t[0].name.as_str(), t[0].dims.as_slice(), t[0].shape()),
            ("a", &[3u64, 2][..], vec![2, 3])
        );
        assert_eq!(
            (t[0].ty.name, t[0].offset, t[0].size, t[0].elements()),
            ("F32", 0, 24, 6)
        );
        assert_eq!(t[1].offset, 24u64.div_ceil(a) * a);
        assert_eq!(f.tensor_f32("a").unwrap(), [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        assert_eq!(f.tensor_f32("b").unwrap(), [-1.5]);
        // The data section starts at the first multiple of the alignment after the infos.
        let start = bytes.len() - 4 - t[1].offset as usize;
        assert_eq!(start as u64 % a, 0);
        assert_eq!(f.tensor_bytes("a").unwrap(), &bytes[start..start + 24]);
        let e = f.tensor_f32("c").unwrap_err().to_string();
        assert!(e.contains("tensor \"c\"") && e.contains("absent"), "{e}");
    }
}

#[test]
fn a_file_cut_short_at_any_byte_is_an_error() {
    let bytes = small_file().build();
    parse(bytes.clone()).unwrap();
    for n in 0..bytes.len() {
        assert!(
            parse(bytes[..n].to_vec()).is_err(),
            "cut at {n} of {}",
            bytes.len()
        );
    }
}

/// The header of a file with `kvs` key/values and `tensors` tensors, the rest to follow.
fn header(kvs: u64, tensors: u64) -> Vec<u8> {
    let mut out = b"GGUF".to_vec();
    out.extend(3u32.to_le_bytes());
    out.extend(tensors.to_le_bytes());
    out.extend(kvs.to_le_bytes());
    out
}

#[test]
fn huge_counts_and_lengths_are_errors_before_any_allocation() {
    expect_err(
        parse(header(u64::MAX, 0)),
        &["metadata_kv_count", &u64::MAX.to_string()],
    );
    expect_err(parse(header(0, u64::MAX)), &["tensor_count"]);
    // A key of u64::MAX bytes.
    let mut b = header(1, 0);
    b.extend(u64::MAX.to_le_bytes());
    b.extend([0; 16]);
    expect_err(parse(b), &["metadata key 0", "more bytes", "16 left"]);
    // A string value of 2^60 bytes, an array of 2^62 u32s, an array of 2^61 strings.
    let mut b = header(1, 0);
    b.extend(kv_bytes("s", 8, &(1u64 << 60).to_le_bytes()));
    expect_err(parse(b), &["\"s\"", "more bytes"]);
    for (elem, count) in [(4u32, 1u64 << 62), (8, 1 << 61), (9, u64::MAX)] {
        let mut v = elem.to_le_bytes().to_vec();
        v.extend(count.to_le_bytes());
        v.extend([0; 64]);
        let mut b = header(1, 0);
        b.extend(kv_bytes("arr", 9, &v));
        expect_err(parse(b), &["\"arr\"", "a count whose", &count.to_string()]);
    }
    // Dims whose product overflows, and a tensor past the end of the file.
    let mut w = Writer::new();
    w.tensor_f32("t", &[1], &[0.0]);
    w.tensors[0].1 = vec![1 << 40, 1 << 40];
    expect_err(parse(w.build()), &["tensor \"t\"", "fits in memory"]);
    w.tensors[0].1 = vec![1 << 20];
    expect_err(parse(w.build()), &["tensor \"t\"", "past the end"]);
}

#[test]
fn wrong_magic_version_and_types_are_errors() {
    let good = small_file().build();
    let mut b = good.clone();
    b[0] = b'g';
    expect_err(parse(b), &["header", "magic"]);
    for version in [0u32, 1, 4, 3 << 24] {
        let mut b = good.clone();
        b[4..8].copy_from_slice(&version.to_le_bytes());
        expect_err(parse(b), &["version 2 or 3", &format!("version {version}")]);
    }
    let mut b = header(1, 0);
    b.extend(kv_bytes("k", 13, &[0; 8]));
    expect_err(parse(b), &["\"k\"", "value type", "type 13"]);
    let mut b = header(1, 0);
    b.extend(kv_bytes("flag", 7, &[2]));
    expect_err(parse(b), &["\"flag\"", "0 or 1"]);
    let mut b = header(1, 0);
    b.extend(kv_bytes("s", 8, &[2, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xfe]));
    expect_err(parse(b), &["\"s\"", "UTF-8"]);
    let mut w = Writer::new();
    w.u32("k", 1).u32("k", 2);
    expect_err(parse(w.build()), &["\"k\"", "unique"]);
    // Arrays nested nine deep.
    let mut v = Vec::new();
    for _ in 0..9 {
        v.extend(9u32.to_le_bytes());
        v.extend(1u64.to_le_bytes());
    }
    v.extend(0u32.to_le_bytes());
    v.extend(0u64.to_le_bytes());
    let mut b = header(1, 0);
    b.extend(kv_bytes("deep", 9, &v));
    expect_err(parse(b), &["\"deep\"", "nested at most 8"]);
    let mut w = small_file();
    w.alignment(48);
    expect_err(parse(w.build()), &["general.alignment", "power of two"]);
    // Tensor types: unknown to ggml, not a whole block, misaligned, unsupported.
    let mut w = small_file();
    w.tensors[1].2 = 99;
    expect_err(
        parse(w.build()),
        &["tensor \"b\"", "ggml type id", "type 99"],
    );
    w.tensors[1].2 = 8;
    expect_err(parse(w.build()), &["tensor \"b\"", "Q8_0's block"]);
    let mut w = small_file();
    w.tensors.truncate(1);
    w.tensors[0].0 = "a".into();
    w.tensors.push(("b".into(), vec![256], 10, vec![0; 84]));
    let f = parse(w.build()).unwrap();
    let e = f.tensor_f32("b").unwrap_err().to_string();
    assert!(
        e.contains("tensor \"b\"") && e.contains("Q2_K") && e.contains("Q6_K"),
        "{e}"
    );
    let mut b = small_file().build();
    // Tensor "b"'s info: its name, one dim, the dim, the type, then the offset.
    let info = [1, 0, 0, 0, 0, 0, 0, 0, b'b', 1, 0, 0, 0];
    let at = b.windows(info.len()).position(|w| w == info).unwrap() + info.len() + 8 + 4;
    b[at..at + 8].copy_from_slice(&4u64.to_le_bytes());
    expect_err(parse(b), &["tensor \"b\"", "multiple of 32", "4"]);
}

fn fixture() -> GgufFile {
    GgufFile::open(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/dequant.gguf"
    ))
    .unwrap()
}

#[test]
fn dequantizers_match_gguf_py_bit_for_bit() {
    let f = fixture();
    for ty in hesper::io::DEQUANTIZED_TYPES {
        let info = f.tensor(ty).unwrap();
        assert_eq!(info.ty.name, ty);
        let expected = f.tensor_f32(&format!("{ty}.expected")).unwrap();
        let got = f.tensor_f32(ty).unwrap();
        assert_eq!(got.len(), info.elements() as usize);
        assert_eq!(
            info.shape(),
            f.tensor(&format!("{ty}.expected")).unwrap().shape()
        );
        for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
            assert_eq!(g.to_bits(), e.to_bits(), "{ty}[{i}]: {g} vs gguf-py's {e}");
        }
    }
}

/// Tiny models of each family, their tensors in F32; Llama's Q and K written permuted.
struct Tiny {
    config: ModelConfig,
    writer: Writer,
    /// `blk.0.attn_q.weight` as Hugging Face has it.
    q_hf: Vec<f32>,
}

fn tiny(family: Family, arch: &str) -> Tiny {
    let (vocab, d, i, heads, kv, hd) = (5, 8, 12, 2, 1, 4);
    let config = ModelConfig {
        family,
        vocab,
        dim: d,
        ffn_dim: i,
        layers: 2,
        heads,
        kv_heads: kv,
        head_dim: hd,
        rope_base: 10000.0,
        norm_eps: f64::from(1e-6f32),
        tied_embeddings: true,
        max_seq: 64,
    };
    let mut w = Writer::new();
    w.string("general.architecture", arch)
        .u32(&format!("{arch}.embedding_length"), d as u32);
    w.u32(&format!("{arch}.feed_forward_length"), i as u32)
        .u32(&format!("{arch}.block_count"), 2);
    w.u32(&format!("{arch}.attention.head_count"), heads as u32);
    w.u32(&format!("{arch}.attention.head_count_kv"), kv as u32);
    w.f32(&format!("{arch}.rope.freq_base"), 10000.0);
    w.f32(&format!("{arch}.attention.layer_norm_rms_epsilon"), 1e-6);
    w.u32(&format!("{arch}.context_length"), 64);
    w.strings("tokenizer.ggml.tokens", &["a", "b", "c", "d", "e"]);
    let mut seed = 0.0f32;
    let mut values = |n: usize| -> Vec<f32> {
        (0..n)
            .map(|_| {
                seed += 1.0;
                (seed * 0.37).sin()
            })
            .collect()
    };
    // convert_hf_to_gguf.py's LlamaModel.permute: reshape(n, 2, hd/2, in).swapaxes(1, 2).
    let permute = |m: &[f32], n: usize| -> Vec<f32> {
        let mut out = Vec::new();
        for h in 0..n {
            for j in 0..hd / 2 {
                for c in 0..2 {
                    let row = h * hd + c * hd / 2 + j;
                    out.extend_from_slice(&m[row * d..(row + 1) * d]);
                }
            }
        }
        out
    };
    w.tensor_f32("token_embd.weight", &[vocab, d], &values(vocab * d));
    let mut q_hf = Vec::new();
    for l in 0..2 {
        let name = |n: &str| format!("blk.{l}.{n}");
        let (q, k) = (values(heads * hd * d), values(kv * hd * d));
        let llama = family == Family::Llama;
        w.tensor_f32(&name("attn_norm.weight"), &[d], &values(d));
        w.tensor_f32(
            &name("attn_q.weight"),
            &[heads * hd, d],
            &if llama { permute(&q, heads) } else { q.clone() },
        );
        w.tensor_f32(
            &name("attn_k.weight"),
            &[kv * hd, d],
            &if llama { permute(&k, kv) } else { k },
        );
        w.tensor_f32(&name("attn_v.weight"), &[kv * hd, d], &values(kv * hd * d));
        w.tensor_f32(
            &name("attn_output.weight"),
            &[d, heads * hd],
            &values(d * heads * hd),
        );
        w.tensor_f32(&name("ffn_norm.weight"), &[d], &values(d));
        w.tensor_f32(&name("ffn_gate.weight"), &[i, d], &values(i * d));
        w.tensor_f32(&name("ffn_up.weight"), &[i, d], &values(i * d));
        w.tensor_f32(&name("ffn_down.weight"), &[d, i], &values(d * i));
        if family == Family::Qwen2 {
            w.tensor_f32(&name("attn_q.bias"), &[heads * hd], &values(heads * hd));
            w.tensor_f32(&name("attn_k.bias"), &[kv * hd], &values(kv * hd));
            w.tensor_f32(&name("attn_v.bias"), &[kv * hd], &values(kv * hd));
        }
        if family == Family::Qwen3 {
            w.tensor_f32(&name("attn_q_norm.weight"), &[hd], &values(hd));
            w.tensor_f32(&name("attn_k_norm.weight"), &[hd], &values(hd));
        }
        if l == 0 {
            q_hf = q;
        }
    }
    w.tensor_f32("output_norm.weight", &[d], &values(d));
    Tiny {
        config,
        writer: w,
        q_hf,
    }
}

#[test]
fn tiny_models_load_with_llama_q_k_unpermuted() {
    for (family, arch) in [
        (Family::Llama, "llama"),
        (Family::Qwen2, "qwen2"),
        (Family::Qwen3, "qwen3"),
    ] {
        let mut t = tiny(family, arch);
        let (config, weights) = load_model(&parse(t.writer.build()).unwrap()).unwrap();
        assert_eq!(config, t.config, "{arch}");
        let q_hf: Vec<f64> = t.q_hf.iter().map(|&v| v.into()).collect();
        assert_eq!(
            weights.layers[0].q, q_hf,
            "{arch}: W_q as Hugging Face has it"
        );
        assert_eq!(weights.layers[1].q_bias.is_some(), family == Family::Qwen2);
        assert_eq!(weights.layers[1].k_norm.is_some(), family == Family::Qwen3);
        assert!(weights.lm_head.is_none());
        // An untied head.
        t.writer.tensor_f32("output.weight", &[5, 8], &[0.5; 40]);
        let (config, weights) = load_model(&parse(t.writer.build()).unwrap()).unwrap();
        assert!(!config.tied_embeddings);
        assert_eq!(weights.lm_head, Some(vec![0.5; 40]));
    }
}

#[test]
fn models_we_do_not_load_are_errors_naming_what() {
    let load = |w: &Writer| {
        load_model(&parse(w.build()).unwrap())
            .unwrap_err()
            .to_string()
    };
    let mut t = tiny(Family::Llama, "llama");
    t.writer.kvs[0] = kv_bytes("general.architecture", 8, &str_bytes("gpt2"));
    let e = load(&t.writer);
    assert!(
        e.contains("general.architecture") && e.contains("\"gpt2\"") && e.contains("qwen3"),
        "{e}"
    );
    let mut t = tiny(Family::Llama, "llama");
    t.writer.tensor_f32("rope_freqs.weight", &[2], &[1.0, 1.0]);
    let e = load(&t.writer);
    assert!(
        e.contains("\"rope_freqs.weight\"") && e.contains("extra tensor"),
        "{e}"
    );
    let mut t = tiny(Family::Qwen2, "qwen2");
    t.writer.tensors.retain(|x| x.0 != "blk.1.attn_v.bias");
    let e = load(&t.writer);
    assert!(
        e.contains("\"blk.1.attn_v.bias\"") && e.contains("absent"),
        "{e}"
    );
    let mut t = tiny(Family::Qwen3, "qwen3");
    t.writer.tensors[1].1 = vec![4, 8];
    let e = load(&t.writer);
    assert!(
        e.contains("\"blk.0.attn_norm.weight\"") && e.contains("shape [8]") && e.contains("[8, 4]"),
        "{e}"
    );
    let mut t = tiny(Family::Llama, "llama");
    t.writer.kvs.remove(3);
    let e = load(&t.writer);
    assert!(
        e.contains("\"llama.block_count\"") && e.contains("absent"),
        "{e}"
    );
}

#[test]
fn smollm2_loads_with_gguf_py_values() {
    let Some(path) = common::smollm2_path() else {
        return;
    };
    let file = GgufFile::open(&path).unwrap();
    let (config, weights) = load_model(&file).unwrap();
    let smollm2 = ModelConfig {
        family: Family::Llama,
        vocab: 49152,
        dim: 576,
        ffn_dim: 1536,
        layers: 30,
        heads: 9,
        kv_heads: 3,
        head_dim: 64,
        rope_base: 100000.0,
        norm_eps: f64::from(1e-5f32),
        tied_embeddings: true,
        max_seq: 8192,
    };
    assert_eq!(config, smollm2);
    let reference = fixture();
    let rows = |name: &str| -> Vec<usize> {
        let key = format!("smollm2/{name}.rows");
        reference
            .metadata_array(&key)
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as usize)
            .collect()
    };
    let check = |what: &str, ours: &[f64], cols: usize, name: &str, recorded: &str| {
        let expected = reference.tensor_f32(recorded).unwrap();
        for (k, row) in rows(name).into_iter().enumerate() {
            let got = &ours[row * cols..(row + 1) * cols];
            for (c, (g, e)) in got
                .iter()
                .zip(&expected[k * cols..(k + 1) * cols])
                .enumerate()
            {
                assert_eq!(
                    (*g as f32).to_bits(),
                    e.to_bits(),
                    "{what}[{row}, {c}]: {g} vs gguf-py's {e}"
                );
            }
        }
    };
    let raw = |name: &str| -> Vec<f64> {
        file.tensor_f32(name)
            .unwrap()
            .into_iter()
            .map(f64::from)
            .collect()
    };
    for name in [
        "token_embd.weight",
        "blk.0.attn_q.weight",
        "blk.0.attn_k.weight",
        "blk.0.ffn_down.weight",
    ] {
        let cols = *file.tensor(name).unwrap().shape().last().unwrap();
        check(name, &raw(name), cols, name, &format!("smollm2/{name}"));
    }
    check(
        "embed",
        &weights.embed,
        576,
        "token_embd.weight",
        "smollm2/token_embd.weight",
    );
    check(
        "layers.0.q",
        &weights.layers[0].q,
        576,
        "blk.0.attn_q.weight",
        "smollm2/hf/blk.0.attn_q.weight",
    );
    check(
        "layers.0.k",
        &weights.layers[0].k,
        576,
        "blk.0.attn_k.weight",
        "smollm2/hf/blk.0.attn_k.weight",
    );
    check(
        "layers.0.down",
        &weights.layers[0].down,
        1536,
        "blk.0.ffn_down.weight",
        "smollm2/blk.0.ffn_down.weight",
    );
    check(
        "layers.29.attn_norm",
        &weights.layers[29].attn_norm,
        576,
        "blk.29.attn_norm.weight",
        "smollm2/blk.29.attn_norm.weight",
    );
    check(
        "final_norm",
        &weights.final_norm,
        576,
        "output_norm.weight",
        "smollm2/output_norm.weight",
    );
}
