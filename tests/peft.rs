//! PEFT adapters (`hesper::io::peft`): what `save_peft_adapter` writes is what PEFT writes (the
//! JSON's fields and the safetensors header, both read here independently of the crate), what
//! Python's `safetensors` wrote (tests/data/peft-tiny, by its generate.py) loads to the known
//! values, every malformed or unsupported input is an error naming its file, and a failed save
//! leaves the previous adapter whole.

use std::fs;
use std::path::{Path, PathBuf};

use hesper::io::peft::{CONFIG_FILE, WEIGHTS_FILE};
use hesper::io::{
    PeftConfig, PeftError, encode_adapters, load_peft, load_peft_adapter, save_peft,
    save_peft_adapter, write_atomic,
};
use hesper::model::config::{Family, LoraConfig, ModelConfig, Projection};
use hesper::model::reference::Adapters;
use serde_json::{Map, Value, json};

/// A new empty directory for one test (case).
fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("hesper-peft-{}-{name}", std::process::id()));
    if dir.exists() {
        make_writable(&dir);
        fs::remove_dir_all(&dir).unwrap();
    }
    fs::create_dir_all(&dir).unwrap();
    dir
}

#[cfg(unix)]
fn make_writable(dir: &Path) {
    use std::os::unix::fs::PermissionsExt;
    let _ = fs::set_permissions(dir, fs::Permissions::from_mode(0o755));
}

#[cfg(not(unix))]
fn make_writable(_: &Path) {}

/// Every projection, rank 4, rsLoRA: the tests' usual LoRA.
fn lora_all() -> LoraConfig {
    LoraConfig {
        targets: Projection::ALL.to_vec(),
        rank: 4,
        alpha: 8.0,
        rslora: true,
    }
}

/// Each element's bits, so that "equal" means bit for bit (`-0.0 != 0.0`).
fn bits(adapters: &Adapters) -> Vec<u64> {
    adapters
        .iter()
        .flat_map(|(_, _, a)| a.a.iter().chain(&a.b).map(|v| v.to_bits()))
        .collect()
}

/// One tensor of a safetensors file, read or to be written by this test's own code.
#[derive(Clone, Debug)]
struct Entry {
    name: String,
    dtype: String,
    shape: Vec<usize>,
    data: Vec<u8>,
}

/// A safetensors file, parsed here: the 8-byte little-endian header length, the JSON header,
/// the data. Returns the header length, the metadata, and the tensors in the header's key order.
fn parse_safetensors(bytes: &[u8]) -> (usize, Value, Vec<Entry>) {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Map<String, Value> = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let data = &bytes[8 + n..];
    let mut metadata = Value::Null;
    let mut entries = Vec::new();
    for (name, info) in header {
        if name == "__metadata__" {
            metadata = info;
            continue;
        }
        let offsets: Vec<usize> = serde_json::from_value(info["data_offsets"].clone()).unwrap();
        entries.push(Entry {
            name,
            dtype: info["dtype"].as_str().unwrap().into(),
            shape: serde_json::from_value(info["shape"].clone()).unwrap(),
            data: data[offsets[0]..offsets[1]].to_vec(),
        });
    }
    (n, metadata, entries)
}

/// A safetensors file of `entries` in their order, written here (not by the crate), so that
/// the tests can also write what no writer would.
fn write_safetensors(entries: &[Entry]) -> Vec<u8> {
    let mut header = Map::new();
    header.insert("__metadata__".into(), json!({"format": "pt"}));
    let mut offset = 0;
    for e in entries {
        let end = offset + e.data.len();
        let info = json!({"dtype": e.dtype, "shape": e.shape, "data_offsets": [offset, end]});
        header.insert(e.name.clone(), info);
        offset = end;
    }
    let mut text = serde_json::to_vec(&header).unwrap();
    text.resize(text.len().next_multiple_of(8), b' ');
    let mut bytes = (text.len() as u64).to_le_bytes().to_vec();
    bytes.extend(text);
    for e in entries {
        bytes.extend(&e.data);
    }
    bytes
}

fn f32_values(data: &[u8]) -> Vec<f64> {
    data.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
        .collect()
}

#[test]
fn round_trip_is_bit_exact() {
    let cases = [
        (Family::Llama, LoraConfig::default()),
        (Family::Qwen2, lora_all()),
        (
            Family::Qwen3,
            LoraConfig {
                targets: vec![Projection::Down, Projection::Q],
                rank: 1,
                alpha: 0.5,
                rslora: false,
            },
        ),
    ];
    for (i, (family, lora)) in cases.into_iter().enumerate() {
        let config = ModelConfig::tiny(family);
        let mut adapters = Adapters::random(&config, &lora, 40 + i as u64);
        // A negative zero, which only a bit-for-bit comparison tells from 0.
        adapters.get_mut(1, lora.targets[0]).unwrap().b[3] = -0.0;
        let dir = temp_dir(&format!("round-trip-{i}"));
        save_peft_adapter(&dir, &config, &lora, &adapters, Some("base/model")).unwrap();
        let (lora2, adapters2) = load_peft_adapter(&dir, &config).unwrap();
        assert_eq!(lora2, lora, "{family:?}");
        assert_eq!(bits(&adapters2), bits(&adapters), "{family:?}");
        assert_eq!(adapters2, adapters);
        let (peft, _) = load_peft(&dir, &config).unwrap();
        assert_eq!(peft, PeftConfig::new(lora, Some("base/model")));
        fs::remove_dir_all(&dir).unwrap();
    }
    // The whole PeftConfig round-trips too.
    let config = ModelConfig::tiny(Family::Llama);
    let peft = PeftConfig {
        lora: lora_all(),
        base_model_name_or_path: None,
        revision: Some("main".into()),
        task_type: None,
        lora_dropout: 0.1,
    };
    let adapters = Adapters::random(&config, &peft.lora, 3);
    let dir = temp_dir("round-trip-peft");
    save_peft(&dir, &config, &peft, &adapters).unwrap();
    assert_eq!(load_peft(&dir, &config).unwrap(), (peft, adapters));
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn config_json_is_what_peft_writes() {
    let config = ModelConfig::tiny(Family::Llama);
    let lora = LoraConfig {
        targets: vec![Projection::Q, Projection::V, Projection::Down],
        rank: 8,
        alpha: 16.0,
        rslora: false,
    };
    let adapters = Adapters::random(&config, &lora, 1);
    let dir = temp_dir("config-json");
    let base = "HuggingFaceTB/SmolLM2-135M-Instruct";
    save_peft_adapter(&dir, &config, &lora, &adapters, Some(base)).unwrap();
    let text = fs::read_to_string(dir.join(CONFIG_FILE)).unwrap();
    // PEFT 0.9's LoraConfig fields, at PEFT's defaults but for the adapter's own.
    let expected = json!({
        "alpha_pattern": {},
        "auto_mapping": null,
        "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "bias": "none",
        "fan_in_fan_out": false,
        "inference_mode": true,
        "init_lora_weights": true,
        "layers_pattern": null,
        "layers_to_transform": null,
        "loftq_config": {},
        "lora_alpha": 16,
        "lora_dropout": 0.0,
        "megatron_config": null,
        "megatron_core": "megatron.core",
        "modules_to_save": null,
        "peft_type": "LORA",
        "r": 8,
        "rank_pattern": {},
        "revision": null,
        "target_modules": ["q_proj", "v_proj", "down_proj"],
        "task_type": "CAUSAL_LM",
        "use_dora": false,
        "use_rslora": false
    });
    let parsed: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(parsed, expected);
    // The integer stays an integer (PEFT types lora_alpha as int).
    assert!(parsed["lora_alpha"].is_u64());
    // And the text is Python's json.dumps(…, indent=2, sort_keys=True).
    let python = r#"{
  "alpha_pattern": {},
  "auto_mapping": null,
  "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct",
  "bias": "none",
  "fan_in_fan_out": false,
  "inference_mode": true,
  "init_lora_weights": true,
  "layers_pattern": null,
  "layers_to_transform": null,
  "loftq_config": {},
  "lora_alpha": 16,
  "lora_dropout": 0.0,
  "megatron_config": null,
  "megatron_core": "megatron.core",
  "modules_to_save": null,
  "peft_type": "LORA",
  "r": 8,
  "rank_pattern": {},
  "revision": null,
  "target_modules": [
    "q_proj",
    "v_proj",
    "down_proj"
  ],
  "task_type": "CAUSAL_LM",
  "use_dora": false,
  "use_rslora": false
}"#;
    assert_eq!(text, python);

    // A fractional alpha, rsLoRA, no base model.
    let lora = LoraConfig {
        alpha: 2.5,
        rslora: true,
        ..lora
    };
    let text = PeftConfig::new(lora, None).to_json();
    let parsed: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(parsed["lora_alpha"], json!(2.5));
    assert_eq!(parsed["use_rslora"], json!(true));
    assert_eq!(parsed["base_model_name_or_path"], Value::Null);
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn safetensors_header_is_what_peft_writes() {
    let config = ModelConfig::tiny(Family::Llama);
    let lora = lora_all();
    let adapters = Adapters::random(&config, &lora, 2);
    let dir = temp_dir("header");
    save_peft_adapter(&dir, &config, &lora, &adapters, None).unwrap();
    let bytes = fs::read(dir.join(WEIGHTS_FILE)).unwrap();
    let (n, metadata, entries) = parse_safetensors(&bytes);
    assert_eq!(metadata, json!({"format": "pt"}));
    // The header is padded to 8 bytes, as the safetensors writer pads it.
    assert_eq!(n % 8, 0);

    let (d, i, q, kv, r) = (64, 128, 64, 32, 4);
    let shapes = [
        ("self_attn.q_proj", q, d),
        ("self_attn.k_proj", kv, d),
        ("self_attn.v_proj", kv, d),
        ("self_attn.o_proj", d, q),
        ("mlp.gate_proj", i, d),
        ("mlp.up_proj", i, d),
        ("mlp.down_proj", d, i),
    ];
    let mut expected: Vec<(String, Vec<usize>)> = Vec::new();
    for layer in 0..2 {
        for (module, out, input) in shapes {
            let key = format!("base_model.model.model.layers.{layer}.{module}");
            expected.push((format!("{key}.lora_A.weight"), vec![r, input]));
            expected.push((format!("{key}.lora_B.weight"), vec![out, r]));
        }
    }
    expected.sort();
    // parse_safetensors keeps the header's keys sorted (serde_json's map); the data is laid out
    // in the same order (the writer sorts by dtype, then name), contiguous up to the file's end.
    let mut found: Vec<(String, Vec<usize>)> = entries
        .iter()
        .map(|e| (e.name.clone(), e.shape.clone()))
        .collect();
    found.sort();
    assert_eq!(found, expected);
    let header: Map<String, Value> = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let mut at = 0;
    for (key, _) in &expected {
        let offsets = &header[key]["data_offsets"];
        assert_eq!(offsets[0], json!(at), "{key}");
        at = offsets[1].as_u64().unwrap() as usize;
    }
    assert_eq!(8 + n + at, bytes.len());
    for e in &entries {
        assert_eq!(e.dtype, "F32", "{}", e.name);
        let adapter = adapters.get_by_name(e.name.rsplitn(3, '.').nth(2).unwrap());
        let adapter = adapter.unwrap();
        let want = if e.name.ends_with("lora_A.weight") {
            &adapter.a
        } else {
            &adapter.b
        };
        assert_eq!(&f32_values(&e.data), want, "{}", e.name);
    }
    fs::remove_dir_all(&dir).unwrap();
}

/// Our `W_q` and `W_k` rows are Hugging Face's (the GGUF loader un-permutes llama.cpp's order;
/// tests/gguf.rs checks it against transformers'), so B's rows — the projection's output rows
/// — go to the file as they are: row `j` of the file's `q_proj.lora_B` is our row `j`.
#[test]
fn q_and_k_rows_go_to_the_file_unpermuted() {
    let config = ModelConfig::tiny(Family::Llama);
    let lora = LoraConfig {
        targets: vec![Projection::Q, Projection::K],
        rank: 2,
        alpha: 4.0,
        rslora: false,
    };
    let mut adapters = Adapters::zeros(&config, &lora);
    for p in [Projection::Q, Projection::K] {
        let b = &mut adapters.get_mut(0, p).unwrap().b;
        for (at, v) in b.iter_mut().enumerate() {
            // Row j, column c holds 100·j + c.
            *v = (100 * (at / 2) + at % 2) as f64;
        }
    }
    let dir = temp_dir("rows");
    save_peft_adapter(&dir, &config, &lora, &adapters, None).unwrap();
    let (_, _, entries) = parse_safetensors(&fs::read(dir.join(WEIGHTS_FILE)).unwrap());
    for (module, rows) in [("q_proj", 64), ("k_proj", 32)] {
        let key = format!("base_model.model.model.layers.0.self_attn.{module}.lora_B.weight");
        let e = entries.iter().find(|e| e.name == key).unwrap();
        assert_eq!(e.shape, [rows, 2]);
        let values = f32_values(&e.data);
        for j in 0..rows {
            assert_eq!(values[2 * j], (100 * j) as f64, "{module} row {j}");
            assert_eq!(values[2 * j + 1], (100 * j + 1) as f64, "{module} row {j}");
        }
    }
    fs::remove_dir_all(&dir).unwrap();
}

fn fixture(variant: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/peft-tiny")
        .join(variant)
}

/// Element `i` of fixture tensor `t` (tests/data/peft-tiny/generate.py's formulas).
fn fixture_value(variant: &str, t: usize, i: usize) -> f64 {
    let wide = (10000 * t + i) as f64 * 1e-4;
    match variant {
        "f64" => wide,
        "f32" => wide as f32 as f64,
        _ => (((37 * t + i) % 255) as f64 - 127.0) / 64.0,
    }
}

#[test]
fn python_fixture_loads_to_its_values() {
    let config = ModelConfig::tiny(Family::Llama);
    use Projection::*;
    let lora = LoraConfig {
        targets: vec![V, Down, Q, Up, O, K, Gate],
        rank: 3,
        alpha: 6.0,
        rslora: true,
    };
    for variant in ["f32", "f64", "f16", "bf16"] {
        let (peft, adapters) = load_peft(&fixture(variant), &config).unwrap();
        let expected = PeftConfig {
            lora: lora.clone(),
            base_model_name_or_path: Some("hesper/tiny-llama".into()),
            revision: None,
            task_type: Some("CAUSAL_LM".into()),
            lora_dropout: 0.05,
        };
        assert_eq!(peft, expected, "{variant}");
        let mut checked = 0;
        for layer in 0..2 {
            for (k, p) in Projection::ALL.into_iter().enumerate() {
                let adapter = adapters.get(layer, p).unwrap();
                for (which, values) in [(0, &adapter.a), (1, &adapter.b)] {
                    let t = 2 * (7 * layer + k) + which;
                    for (i, &v) in values.iter().enumerate() {
                        let want = fixture_value(variant, t, i);
                        assert_eq!(v.to_bits(), want.to_bits(), "{variant} {layer} {p:?} {i}");
                        checked += 1;
                    }
                }
            }
        }
        assert_eq!(
            checked,
            2 * 3 * (6 * 64 + 128 + 64 + 2 * 32 + 64 + 2 * 128 + 64)
        );
    }
    // f64 values no f32 holds came through as f64.
    let (_, a) = load_peft_adapter(&fixture("f64"), &config).unwrap();
    let v = a.get(0, Q).unwrap().a[1];
    assert_eq!(v, 1e-4);
    assert_ne!(v as f32 as f64, v);
}

/// The encoder writes byte for byte what Python's safetensors wrote for the same f32 tensors.
#[test]
fn encoder_writes_what_python_writes() {
    let config = ModelConfig::tiny(Family::Llama);
    let dir = fixture("f32");
    let (lora, adapters) = load_peft_adapter(&dir, &config).unwrap();
    let python = fs::read(dir.join(WEIGHTS_FILE)).unwrap();
    assert!(encode_adapters(&config, &lora, &adapters).unwrap() == python);
}

/// A good adapter (q_proj and v_proj, r = 4) saved in a new directory `name`.
fn good_adapter(name: &str) -> (PathBuf, ModelConfig) {
    let config = ModelConfig::tiny(Family::Llama);
    let lora = LoraConfig {
        rank: 4,
        ..LoraConfig::default()
    };
    let adapters = Adapters::random(&config, &lora, 9);
    let dir = temp_dir(name);
    save_peft_adapter(&dir, &config, &lora, &adapters, None).unwrap();
    (dir, config)
}

/// The error of loading `dir`, which must name `file` (in `dir`) and say `says`.
fn assert_refused(dir: &Path, config: &ModelConfig, file: &str, says: &str, case: &str) {
    let err: PeftError = match load_peft_adapter(dir, config) {
        Ok(_) => panic!("{case}: loaded"),
        Err(e) => e,
    };
    let message = err.to_string();
    let path = dir.join(file).display().to_string();
    assert!(
        message.starts_with(&format!("{path}: ")),
        "{case}: {message}"
    );
    assert_eq!(err.file(), path, "{case}");
    assert!(message.contains(says), "{case}: {message:?} lacks {says:?}");
}

#[test]
fn bad_configs_are_refused() {
    let (good, config) = good_adapter("config-good");
    let good_json: Value =
        serde_json::from_str(&fs::read_to_string(good.join(CONFIG_FILE)).unwrap()).unwrap();
    type Edit = fn(&mut Map<String, Value>);
    let cases: [(&str, Edit, &str); 26] = [
        (
            "peft_type",
            |m| {
                m.insert("peft_type".into(), json!("ADALORA"));
            },
            "peft_type = \"ADALORA\" is unsupported",
        ),
        (
            "no peft_type",
            |m| {
                m.remove("peft_type");
            },
            "peft_type: expected \"LORA\", given absent",
        ),
        (
            "dora",
            |m| {
                m.insert("use_dora".into(), json!(true));
            },
            "use_dora = true is unsupported: DoRA",
        ),
        (
            "rank_pattern",
            |m| {
                m.insert("rank_pattern".into(), json!({"q_proj": 2}));
            },
            "rank_pattern = {\"q_proj\":2} is unsupported",
        ),
        (
            "alpha_pattern",
            |m| {
                m.insert("alpha_pattern".into(), json!({"v_proj": 2}));
            },
            "alpha_pattern = {\"v_proj\":2} is unsupported",
        ),
        (
            "unknown target",
            |m| {
                m.insert("target_modules".into(), json!(["q_proj", "lm_head"]));
            },
            "target_modules[1] = \"lm_head\" is unsupported: hesper adapts q_proj, k_proj",
        ),
        (
            "regex",
            |m| {
                m.insert("target_modules".into(), json!(".*(q|v)_proj"));
            },
            "target_modules = \".*(q|v)_proj\" is unsupported: a regex",
        ),
        (
            "no targets",
            |m| {
                m.remove("target_modules");
            },
            "target_modules: expected a list of module names, given absent",
        ),
        (
            "target not a string",
            |m| {
                m.insert("target_modules".into(), json!([1]));
            },
            "target_modules[0]: expected a module name, given 1",
        ),
        (
            "empty targets",
            |m| {
                m.insert("target_modules".into(), json!([]));
            },
            "LoraConfig: targets must be at least one projection",
        ),
        (
            "task",
            |m| {
                m.insert("task_type".into(), json!("SEQ_CLS"));
            },
            "task_type = \"SEQ_CLS\" is unsupported",
        ),
        (
            "modules_to_save",
            |m| {
                m.insert("modules_to_save".into(), json!(["lm_head"]));
            },
            "modules_to_save = [\"lm_head\"] is unsupported",
        ),
        (
            "layers_to_transform",
            |m| {
                m.insert("layers_to_transform".into(), json!([0]));
            },
            "layers_to_transform = [0] is unsupported",
        ),
        (
            "bias",
            |m| {
                m.insert("bias".into(), json!("all"));
            },
            "bias = \"all\" is unsupported",
        ),
        (
            "fan_in_fan_out",
            |m| {
                m.insert("fan_in_fan_out".into(), json!(true));
            },
            "fan_in_fan_out = true is unsupported",
        ),
        (
            "lora_bias",
            |m| {
                m.insert("lora_bias".into(), json!(true));
            },
            "lora_bias = true is unsupported",
        ),
        (
            "pissa",
            |m| {
                m.insert("init_lora_weights".into(), json!("pissa"));
            },
            "init_lora_weights = \"pissa\" is unsupported",
        ),
        (
            "alora",
            |m| {
                m.insert("alora_invocation_tokens".into(), json!([1, 2]));
            },
            "alora_invocation_tokens = [1,2] is unsupported",
        ),
        (
            "r zero",
            |m| {
                m.insert("r".into(), json!(0));
            },
            "r: expected a positive integer, given 0",
        ),
        (
            "r string",
            |m| {
                m.insert("r".into(), json!("8"));
            },
            "r: expected a positive integer, given \"8\"",
        ),
        (
            "r fraction",
            |m| {
                m.insert("r".into(), json!(4.5));
            },
            "r: expected a positive integer, given 4.5",
        ),
        (
            "no alpha",
            |m| {
                m.remove("lora_alpha");
            },
            "lora_alpha: expected a number, given absent",
        ),
        (
            "rslora type",
            |m| {
                m.insert("use_rslora".into(), json!("yes"));
            },
            "use_rslora: expected a bool, given \"yes\"",
        ),
        (
            "dropout",
            |m| {
                m.insert("lora_dropout".into(), json!(2));
            },
            "lora_dropout: expected a number in [0, 1], given 2",
        ),
        (
            "base model",
            |m| {
                m.insert("base_model_name_or_path".into(), json!(3));
            },
            "base_model_name_or_path: expected a string or null, given 3",
        ),
        // The rank disagrees with the tensors: the first tensor says so.
        (
            "r disagrees",
            |m| {
                m.insert("r".into(), json!(8));
            },
            "adapter_model.safetensors: base_model.model.model.layers.0.self_attn.q_proj.lora_A.\
             weight: expected shape [8, 64] (r = 8 in adapter_config.json), given [4, 64]",
        ),
    ];
    for (i, (case, edit, says)) in cases.into_iter().enumerate() {
        let dir = temp_dir(&format!("config-{i}"));
        fs::copy(good.join(WEIGHTS_FILE), dir.join(WEIGHTS_FILE)).unwrap();
        let mut json = good_json.as_object().unwrap().clone();
        edit(&mut json);
        fs::write(dir.join(CONFIG_FILE), serde_json::to_string(&json).unwrap()).unwrap();
        let file = if case == "r disagrees" {
            WEIGHTS_FILE
        } else {
            CONFIG_FILE
        };
        assert_refused(&dir, &config, file, says, case);
        fs::remove_dir_all(&dir).unwrap();
    }

    // Not JSON, not an object, not UTF-8.
    let texts: [(&[u8], &str); 4] = [
        (
            b"{\"peft_type\": \"LORA\", ",
            "JSON: expected a PEFT adapter config, given EOF",
        ),
        (b"", "JSON: expected a PEFT adapter config, given EOF"),
        (b"[1, 2]", "JSON: expected an object, given [1,2]"),
        (b"\xff\xfe{}", "JSON: expected UTF-8 text"),
    ];
    for (i, (text, says)) in texts.into_iter().enumerate() {
        let dir = temp_dir(&format!("config-text-{i}"));
        fs::copy(good.join(WEIGHTS_FILE), dir.join(WEIGHTS_FILE)).unwrap();
        fs::write(dir.join(CONFIG_FILE), text).unwrap();
        assert_refused(&dir, &config, CONFIG_FILE, says, says);
        fs::remove_dir_all(&dir).unwrap();
    }

    // What a PEFT writes and hesper takes: "all-linear", module paths, repeats, the other
    // harmless inits, a later PEFT's unknown fields.
    let accepted: [(Edit, &[Projection]); 4] = [
        (
            |m| {
                m.insert(
                    "target_modules".into(),
                    json!(["self_attn.v_proj", "q_proj", "v_proj"]),
                );
            },
            &[Projection::V, Projection::Q],
        ),
        (
            |m| {
                m.insert("init_lora_weights".into(), json!("gaussian"));
            },
            &[Projection::Q, Projection::V],
        ),
        (
            |m| {
                m.insert("some_future_field".into(), json!({"x": 1}));
            },
            &[Projection::Q, Projection::V],
        ),
        (
            |m| {
                m.insert("use_dora".into(), Value::Null);
                m.remove("bias");
            },
            &[Projection::Q, Projection::V],
        ),
    ];
    for (i, (edit, targets)) in accepted.into_iter().enumerate() {
        let mut json = good_json.as_object().unwrap().clone();
        edit(&mut json);
        let peft = PeftConfig::parse(&serde_json::to_string(&json).unwrap(), "x").unwrap();
        assert_eq!(peft.lora.targets, targets, "accepted case {i}");
    }
    let mut json = good_json.as_object().unwrap().clone();
    json.insert("target_modules".into(), json!("all-linear"));
    let peft = PeftConfig::parse(&serde_json::to_string(&json).unwrap(), "x").unwrap();
    assert_eq!(peft.lora.targets, Projection::ALL);
    fs::remove_dir_all(&good).unwrap();
}

#[test]
fn bad_tensors_are_refused() {
    let (good, config) = good_adapter("tensors-good");
    let (_, _, entries) = parse_safetensors(&fs::read(good.join(WEIGHTS_FILE)).unwrap());
    let q_a = "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight";
    let v_b = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight";
    let entry = |name: &str, dtype: &str, shape: &[usize], n: usize| Entry {
        name: name.into(),
        dtype: dtype.into(),
        shape: shape.to_vec(),
        data: vec![0; n],
    };
    let key = |rest: &str| format!("base_model.model.model.layers.{rest}");
    // An A of q_proj's or v_proj's shape, under another key.
    let a_of = |name: &str| entry(name, "F32", &[4, 64], 4 * 64 * 4);
    let replaced = |name: &str, with: Entry| -> Vec<Entry> {
        entries
            .iter()
            .map(|e| {
                if e.name == name {
                    with.clone()
                } else {
                    e.clone()
                }
            })
            .collect()
    };
    let with = |extra: Entry| -> Vec<Entry> {
        let mut all = entries.clone();
        all.push(extra);
        all
    };
    let mut nan = entries.clone();
    let at = nan.iter().position(|e| e.name == q_a).unwrap();
    nan[at].data[20..24].copy_from_slice(&f32::NAN.to_le_bytes());
    let cases: Vec<(&str, Vec<Entry>, String)> =
        vec![
        (
            "shape",
            replaced(q_a, entry(q_a, "F32", &[4, 63], 4 * 63 * 4)),
            format!("{q_a}: expected shape [4, 64], given [4, 63]"),
        ),
        (
            "transposed",
            replaced(q_a, entry(q_a, "F32", &[64, 4], 64 * 4 * 4)),
            format!("{q_a}: expected shape [4, 64], given [64, 4]"),
        ),
        (
            "one dimension",
            replaced(q_a, entry(q_a, "F32", &[256], 256 * 4)),
            format!("{q_a}: expected shape [4, 64], given [256]"),
        ),
        (
            "rank",
            replaced(q_a, entry(q_a, "F32", &[2, 64], 2 * 64 * 4)),
            format!("{q_a}: expected shape [4, 64] (r = 4 in adapter_config.json), given [2, 64]"),
        ),
        (
            "dtype",
            replaced(q_a, entry(q_a, "I32", &[4, 64], 4 * 64 * 4)),
            format!("{q_a}: dtype = I32 is unsupported: hesper reads F32, F16, BF16 and F64"),
        ),
        (
            "f8",
            replaced(q_a, entry(q_a, "F8_E4M3", &[4, 64], 4 * 64)),
            format!("{q_a}: dtype = F8_E4M3 is unsupported"),
        ),
        (
            "missing B",
            entries.iter().filter(|e| e.name != v_b).cloned().collect(),
            format!("{v_b}: missing"),
        ),
        ("no tensors", vec![], "layers.0.self_attn.q_proj.lora_A.weight: missing".into()),
        (
            "layer beyond",
            with(a_of(&key("2.self_attn.q_proj.lora_A.weight"))),
            "layers.2.self_attn.q_proj.lora_A.weight: expected a layer index below 2 (the model's \
             layers), given 2"
                .into(),
        ),
        (
            "not a target",
            with(a_of(&key("0.mlp.up_proj.lora_A.weight"))),
            "layers.0.mlp.up_proj.lora_A.weight: expected a module of target_modules [q_proj, \
             v_proj], given up_proj"
                .into(),
        ),
        (
            "extra tensor",
            with(entry("lm_head.weight", "F32", &[97, 64], 97 * 64 * 4)),
            "lm_head.weight: expected only LoRA weights".into(),
        ),
        (
            "adapter name infix",
            with(a_of(&key("0.self_attn.q_proj.lora_A.default.weight"))),
            "q_proj.lora_A.default.weight: expected only LoRA weights".into(),
        ),
        (
            "lora bias",
            with(entry(&key("0.self_attn.q_proj.lora_B.bias"), "F32", &[64], 64 * 4)),
            "q_proj.lora_B.bias: expected only LoRA weights".into(),
        ),
        (
            "leading zero",
            with(a_of(&key("01.self_attn.q_proj.lora_A.weight"))),
            "layers.01.self_attn.q_proj.lora_A.weight: expected only LoRA weights".into(),
        ),
        ("nan", nan, format!("{q_a}: expected finite values, given NaN at element 5")),
    ];
    let good_bytes = fs::read(good.join(WEIGHTS_FILE)).unwrap();
    let mut files: Vec<(&str, Vec<u8>, String)> = cases
        .into_iter()
        .map(|(case, entries, says)| (case, write_safetensors(&entries), says))
        .collect();
    let header_len = |n: u64, rest: &[u8]| [&n.to_le_bytes()[..], rest].concat();
    // Corrupt files: every one the crate's error, or the offset check's, never a panic.
    files.extend([
        (
            "empty",
            vec![],
            "header: expected a safetensors file, given header too small".into(),
        ),
        (
            "5 bytes",
            good_bytes[..5].to_vec(),
            "header too small".into(),
        ),
        (
            "cut header",
            good_bytes[..100].to_vec(),
            "invalid header length".into(),
        ),
        (
            "cut data",
            good_bytes[..good_bytes.len() - 1].to_vec(),
            "header: expected tensors within the file's".into(),
        ),
        (
            "longer",
            [&good_bytes[..], b"x"].concat(),
            "incomplete metadata".into(),
        ),
        (
            "huge length",
            header_len(u64::MAX, b"{}"),
            "header: expected a safetensors file".into(),
        ),
        (
            "not json",
            header_len(8, b"not json"),
            "invalid JSON in header".into(),
        ),
        (
            "not utf-8",
            header_len(2, b"\xff\xfe"),
            "invalid UTF-8 in header".into(),
        ),
    ]);
    let gap = br#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#;
    files.push((
        "offsets gap",
        [&header_len(gap.len() as u64, gap)[..], &[0; 8]].concat(),
        "invalid offset for tensor `a`".into(),
    ));
    // A header claiming eight tensors of 2⁶¹ bytes each, whose sum overflows.
    let mut header = Map::new();
    let elems: u64 = (1 << 58) - 1;
    for t in 0..8u64 {
        let (s, e) = (t * elems * 8, (t + 1) * elems * 8);
        header.insert(
            format!("t{t}"),
            json!({"dtype": "F64", "shape": [elems], "data_offsets": [s, e]}),
        );
    }
    let text = serde_json::to_vec(&header).unwrap();
    files.push((
        "offsets overflow",
        header_len(text.len() as u64, &text),
        "header: expected tensors within the file's 0 bytes of data, given \"t0\" ending at byte"
            .into(),
    ));
    for (i, (case, bytes, says)) in files.into_iter().enumerate() {
        let dir = temp_dir(&format!("tensors-{i}"));
        fs::copy(good.join(CONFIG_FILE), dir.join(CONFIG_FILE)).unwrap();
        fs::write(dir.join(WEIGHTS_FILE), bytes).unwrap();
        assert_refused(&dir, &config, WEIGHTS_FILE, &says, case);
        fs::remove_dir_all(&dir).unwrap();
    }
    // The test's own writer, given the good tensors, writes a file that loads: the cases above
    // fail for what they change, not for how they were written.
    let dir = temp_dir("tensors-rewritten");
    fs::copy(good.join(CONFIG_FILE), dir.join(CONFIG_FILE)).unwrap();
    fs::write(dir.join(WEIGHTS_FILE), write_safetensors(&entries)).unwrap();
    assert_eq!(
        load_peft_adapter(&dir, &config).unwrap(),
        load_peft_adapter(&good, &config).unwrap()
    );
    fs::remove_dir_all(&dir).unwrap();
    fs::remove_dir_all(&good).unwrap();
}

#[test]
fn missing_files_are_refused() {
    let (good, config) = good_adapter("missing-good");
    let dir = temp_dir("missing");
    assert_refused(&dir, &config, CONFIG_FILE, "No such file", "no config");
    fs::copy(good.join(CONFIG_FILE), dir.join(CONFIG_FILE)).unwrap();
    assert_refused(&dir, &config, WEIGHTS_FILE, "No such file", "no weights");
    fs::remove_dir_all(&dir).unwrap();
    let absent = dir.join("absent");
    assert_refused(
        &absent,
        &config,
        CONFIG_FILE,
        "No such file",
        "no directory",
    );
    fs::remove_dir_all(&good).unwrap();
}

/// The files of an adapter directory, with their bytes, sorted by name.
fn contents(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<(String, Vec<u8>)> = fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            let name = e.file_name().into_string().unwrap();
            let bytes = if e.path().is_dir() {
                b"<dir>".to_vec()
            } else {
                fs::read(e.path()).unwrap()
            };
            (name, bytes)
        })
        .collect();
    files.sort();
    files
}

#[test]
fn failed_saves_leave_the_old_adapter() {
    let config = ModelConfig::tiny(Family::Llama);
    let lora = LoraConfig::default();
    let old = Adapters::random(&config, &lora, 1);
    let new = Adapters::random(&config, &lora, 2);
    let new_lora = LoraConfig {
        alpha: 32.0,
        ..lora.clone()
    };

    // The config's temporary cannot be written (a directory has its name): the weights'
    // temporary was written, but neither file is replaced and no temporary is left.
    let dir = temp_dir("fail-tmp");
    save_peft_adapter(&dir, &config, &lora, &old, None).unwrap();
    fs::create_dir(dir.join("adapter_config.json.tmp")).unwrap();
    let before = contents(&dir);
    let err = save_peft_adapter(&dir, &config, &new_lora, &new, None).unwrap_err();
    assert_eq!(
        err.file(),
        dir.join(CONFIG_FILE).display().to_string(),
        "{err}"
    );
    assert_eq!(contents(&dir), before);
    assert_eq!(
        load_peft_adapter(&dir, &config).unwrap(),
        (lora.clone(), old.clone())
    );
    fs::remove_dir_all(&dir).unwrap();

    // The weights' name is a directory: the rename fails, the old config stays, and no
    // temporary is left.
    let dir = temp_dir("fail-target");
    save_peft_adapter(&dir, &config, &lora, &old, None).unwrap();
    fs::remove_file(dir.join(WEIGHTS_FILE)).unwrap();
    fs::create_dir(dir.join(WEIGHTS_FILE)).unwrap();
    let before = contents(&dir);
    let err = save_peft_adapter(&dir, &config, &new_lora, &new, None).unwrap_err();
    assert_eq!(
        err.file(),
        dir.join(WEIGHTS_FILE).display().to_string(),
        "{err}"
    );
    assert_eq!(contents(&dir), before);
    fs::remove_dir_all(&dir).unwrap();

    // A read-only directory (unless the tests run with the privilege to write there anyway).
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let dir = temp_dir("fail-read-only");
        save_peft_adapter(&dir, &config, &lora, &old, None).unwrap();
        let before = contents(&dir);
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o555)).unwrap();
        if fs::write(dir.join("probe"), b"").is_ok() {
            eprintln!("read-only case skipped: this user writes into read-only directories");
            fs::remove_file(dir.join("probe")).unwrap();
        } else {
            let err = save_peft_adapter(&dir, &config, &new_lora, &new, None).unwrap_err();
            assert!(err.to_string().contains("ermission denied"), "{err}");
            assert_eq!(contents(&dir), before);
        }
        make_writable(&dir);
        fs::remove_dir_all(&dir).unwrap();
    }

    // What the save refuses (adapters of another LoRA, a value f32 cannot hold) touches no
    // file.
    let dir = temp_dir("fail-refused");
    save_peft_adapter(&dir, &config, &lora, &old, None).unwrap();
    let before = contents(&dir);
    let other = Adapters::random(&config, &lora_all(), 3);
    let err = save_peft_adapter(&dir, &config, &lora, &other, None).unwrap_err();
    assert!(
        err.to_string().contains("Adapters: targets must be"),
        "{err}"
    );
    let mut huge = new.clone();
    huge.get_mut(1, Projection::V).unwrap().a[7] = 1e300;
    let err = save_peft_adapter(&dir, &config, &lora, &huge, None).unwrap_err();
    let weights = dir.join(WEIGHTS_FILE).display().to_string();
    assert_eq!(
        err.to_string(),
        format!(
            "{weights}: base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight: expected \
             finite f32 values, given 1e300 at element 7"
        )
    );
    let bad_lora = LoraConfig {
        rank: 0,
        ..lora.clone()
    };
    let err = save_peft_adapter(&dir, &config, &bad_lora, &old, None).unwrap_err();
    assert!(err.to_string().contains("rank must be positive"), "{err}");
    assert_eq!(contents(&dir), before);
    fs::remove_dir_all(&dir).unwrap();

    // A save into a directory that does not exist yet creates it.
    let top = temp_dir("fail-none");
    let dir = top.join("a/b");
    save_peft_adapter(&dir, &config, &lora, &new, None).unwrap();
    assert_eq!(load_peft_adapter(&dir, &config).unwrap(), (lora, new));
    fs::remove_dir_all(&top).unwrap();
}

#[test]
fn write_atomic_replaces_whole_files() {
    let dir = temp_dir("atomic");
    let path = dir.join("checkpoint.bin");
    write_atomic(&path, b"first").unwrap();
    write_atomic(&path, b"second, longer").unwrap();
    assert_eq!(fs::read(&path).unwrap(), b"second, longer");
    assert_eq!(contents(&dir).len(), 1, "no temporary left");
    // Into a directory that does not exist: an error, and nothing is created.
    let err = write_atomic(&dir.join("absent/x"), b"x").unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::NotFound);
    assert_eq!(contents(&dir).len(), 1);
    fs::remove_dir_all(&dir).unwrap();
}
