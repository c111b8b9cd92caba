//! LoRA adapters as Hugging Face PEFT saves them: a directory holding `adapter_model.safetensors`
//! (every adapter's `A` and `B`) and `adapter_config.json` (`r`, `lora_alpha`, the target
//! modules), so that an adapter trained here loads in PEFT (`PeftModel.from_pretrained(model,
//! dir)`, see `scripts/peft-check.py`) and one trained with PEFT loads here.
//!
//! **The tensors.** `base_model.model.model.layers.{i}.{module}.lora_A.weight` is `A [r, in]` and
//! `….lora_B.weight` is `B [out, r]`, row-major, where `{module}` is the projection's path inside
//! the layer ([`Projection::peft_name`]: `self_attn.q_proj`, `mlp.down_proj`): the names of a
//! `LlamaForCausalLM` (Qwen2's and Qwen3's alike) inside PEFT's `PeftModelForCausalLM`, without
//! the adapter name (`.default`) that PEFT strips when saving. They are saved as F32 with the
//! metadata `{"format": "pt"}` that PEFT passes to `safetensors.torch.save_file`, through
//! Hugging Face's own `safetensors` crate (the code under Python's `safetensors`, which orders
//! the tensors by name), so the file is byte for byte what PEFT writes for the same f32 values.
//! They are loaded from F32, F16, BF16 (what PEFT users often save) or F64.
//!
//! **The rows of Q and K** are Hugging Face's. llama.cpp's converter permutes the rows of a
//! Llama's `W_q` and `W_k`; [`load_model`](super::load_model) undoes it, so our weights — and
//! with them the `B` of `q_proj` and `k_proj`, whose rows are the projection's output rows — are
//! in transformers' order and are saved and loaded unchanged (tests/peft.rs shows the rows go
//! to the file as they are; tests/gguf.rs checks the loader's order against transformers').
//!
//! **The config.** [`PeftConfig::to_json`] writes the 23 fields of PEFT 0.9's `LoraConfig`
//! (the first version with `use_dora`), as PEFT writes them (keys sorted, two-space indent):
//! every PEFT from 0.9 on knows each of them, so none warns of "unexpected keyword arguments",
//! and the fields later versions added take their defaults, which are plain LoRA. Reading
//! ([`PeftConfig::parse`]) takes what any PEFT writes and refuses, naming the field, what
//! would make the adapter mean anything but `y = x·Wᵀ + s·(x·Aᵀ)·Bᵀ` on every layer, `s = α/r`
//! or `α/√r` (`use_rslora`): another `peft_type`, DoRA, per-module ranks or alphas, a subset of the
//! layers, trained biases or whole modules, an init that changes the base weights (PiSSA,
//! LoftQ…), a `target_modules` regex. Fields it does not know (a later PEFT's) are ignored, as
//! PEFT itself ignores them.
//!
//! Checked with PEFT 0.21.0 (torch 2.11, transformers 5.17, 2026-12-01): on a tiny
//! `LlamaForCausalLM`, `PeftModel.from_pretrained` loaded an adapter saved here without a
//! warning, with exactly the file's keys and values and the rsLoRA scale, and its
//! `save_pretrained` wrote the same `adapter_model.safetensors` byte for byte.
//!
//! **Untrusted files.** Loading never panics and allocates nothing a file's header claims
//! beyond the file: each file is read whole (an adapter is small: SmolLM2-135M's of rank 8 on
//! all seven projections is 9.3 MiB in f32), the safetensors header's offsets are checked against
//! the file's length, and a tensor is converted only once its shape is the one `config` and `r`
//! give. Every error names the file and the key or field.
//!
//! **Saving** writes both files atomically ([`write_atomic_all`](super::write_atomic_all)): a
//! save that fails leaves the previous adapter in place, never half a file.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Display;
use std::path::Path;

use safetensors::{Dtype, SafeTensors, tensor::TensorView};
use serde_json::{Value, json};

use crate::model::config::{LoraConfig, ModelConfig, ModelError, Projection};
use crate::model::reference::Adapters;

/// The config's file name in an adapter directory (PEFT's `CONFIG_NAME`).
pub const CONFIG_FILE: &str = "adapter_config.json";
/// The tensors' file name in an adapter directory (PEFT's `SAFETENSORS_WEIGHTS_NAME`).
pub const WEIGHTS_FILE: &str = "adapter_model.safetensors";

/// What every LoRA key starts with: `PeftModel.base_model` (the `LoraModel`), its `model` (the
/// `LlamaForCausalLM`), and that one's `model` (the `LlamaModel`).
const KEY_PREFIX: &str = "base_model.model.model.layers.";

/// An adapter directory that could not be read or written, or that holds an adapter hesper
/// does not load. Each names the file (`<dir>/adapter_model.safetensors`) and what in it.
#[derive(Debug, thiserror::Error)]
pub enum PeftError {
    /// The file could not be read or written.
    #[error("{file}: {source}")]
    Io {
        /// The file (or, creating it, the directory).
        file: String,
        /// What the system said.
        source: std::io::Error,
    },
    /// `item` in `file` is not what an adapter of this model has there.
    #[error("{file}: {item}: expected {expected}, given {given}")]
    Invalid {
        /// The file.
        file: String,
        /// The config field (`r`, `target_modules[2]`), the tensor's key, or `header`.
        item: String,
        /// What an adapter of this model has there.
        expected: String,
        /// What the file has.
        given: String,
    },
    /// `item` in `file` is valid PEFT, but a kind of adapter hesper does not compute.
    #[error("{file}: {item} = {given} is unsupported: {why}")]
    Unsupported {
        /// The file.
        file: String,
        /// The config field, or `<key>: dtype`.
        item: String,
        /// Its value.
        given: String,
        /// What it means, and what hesper takes instead.
        why: String,
    },
    /// The tensor `item` is not in `file`: every layer has an `A` and a `B` for every target.
    #[error("{file}: {item}: missing (the config's target_modules adapt it in every layer)")]
    Missing {
        /// The file.
        file: String,
        /// The key that is absent.
        item: String,
    },
    /// The config or the adapters are not valid for the model (`LoraConfig::check`,
    /// `Adapters::check`).
    #[error("{file}: {source}")]
    Model {
        /// The file read or to be written.
        file: String,
        /// What the check said.
        source: Box<ModelError>,
    },
}

impl PeftError {
    /// The file the error is about.
    pub fn file(&self) -> &str {
        match self {
            PeftError::Io { file, .. }
            | PeftError::Invalid { file, .. }
            | PeftError::Unsupported { file, .. }
            | PeftError::Missing { file, .. }
            | PeftError::Model { file, .. } => file,
        }
    }

    fn invalid(
        file: &str,
        item: impl Into<String>,
        expected: impl Into<String>,
        given: impl Display,
    ) -> PeftError {
        PeftError::Invalid {
            file: file.into(),
            item: item.into(),
            expected: expected.into(),
            given: given.to_string(),
        }
    }

    fn unsupported(
        file: &str,
        item: impl Into<String>,
        given: impl Display,
        why: impl Into<String>,
    ) -> PeftError {
        PeftError::Unsupported {
            file: file.into(),
            item: item.into(),
            given: given.to_string(),
            why: why.into(),
        }
    }

    fn model(file: &str, source: ModelError) -> PeftError {
        PeftError::Model {
            file: file.into(),
            source: Box::new(source),
        }
    }
}

/// What `adapter_config.json` says that hesper uses or keeps: PEFT's `LoraConfig` as far as a
/// plain LoRA of every layer goes (the module doc says which other fields are refused).
#[derive(Clone, Debug, PartialEq)]
pub struct PeftConfig {
    /// `target_modules`, `r`, `lora_alpha`, `use_rslora`.
    pub lora: LoraConfig,
    /// The base model, a Hub id or a path (PEFT loads it with `AutoPeftModel…`); `None` writes
    /// `null`.
    pub base_model_name_or_path: Option<String>,
    /// The base model's Hub revision; `None` writes `null`.
    pub revision: Option<String>,
    /// `"CAUSAL_LM"` (what hesper trains; PEFT then wraps the model in
    /// `PeftModelForCausalLM`), or `None` (a plain `PeftModel`, the same keys).
    pub task_type: Option<String>,
    /// The dropout on the adapters' input in training; kept for the record (a loaded adapter
    /// is used in inference, where PEFT applies no dropout).
    pub lora_dropout: f64,
}

/// The fields a plain LoRA leaves off (`null`, `false`, `{}`, `[]` or absent), each with why
/// hesper refuses it on.
const OFF_FIELDS: [(&str, &str); 20] = [
    (
        "use_dora",
        "DoRA adds a magnitude vector per module; hesper computes plain LoRA",
    ),
    (
        "fan_in_fan_out",
        "that is Conv1D's [in, out] layout; hesper's weights are nn.Linear's [out, in]",
    ),
    (
        "lora_bias",
        "a bias on lora_B is not plain LoRA; hesper's adapters have none",
    ),
    (
        "use_qalora",
        "QA-LoRA pools the adapter's input; hesper computes plain LoRA",
    ),
    (
        "rank_pattern",
        "a rank per module; hesper uses the one r of every adapter",
    ),
    (
        "alpha_pattern",
        "an alpha per module; hesper uses the one lora_alpha of every adapter",
    ),
    (
        "modules_to_save",
        "fully trained modules are not LoRA adapters",
    ),
    (
        "layers_to_transform",
        "hesper adapts the target modules of every layer",
    ),
    (
        "layers_pattern",
        "hesper adapts the target modules of every layer",
    ),
    (
        "exclude_modules",
        "hesper adapts the target modules of every layer",
    ),
    (
        "layer_replication",
        "replicated layers change the base model",
    ),
    ("megatron_config", "Megatron's parallel layers"),
    (
        "trainable_token_indices",
        "trained embedding rows are not LoRA adapters",
    ),
    (
        "target_parameters",
        "LoRA on parameters (MoE experts) rather than on modules",
    ),
    (
        "alora_invocation_tokens",
        "aLoRA adapts only the tokens after its invocation sequence",
    ),
    ("use_bdlora", "block-diagonal LoRA is not plain LoRA"),
    ("arrow_config", "Arrow routes between several adapters"),
    ("velora_config", "VeLoRA is not plain LoRA"),
    ("monteclora_config", "MonteCLoRA is not plain LoRA"),
    ("kasa_config", "KaSA is not plain LoRA"),
];

/// The values of `init_lora_weights` that only choose the starting `A` and `B` (which the saved
/// ones replace); the others (`pissa…`, `olora`, `corda`, `loftq`, `lora_ga`) change the base
/// model's weights, or (`mica`) the layer.
const PLAIN_INITS: [&str; 3] = ["gaussian", "eva", "orthogonal"];

impl PeftConfig {
    /// The config of an adapter of `lora` hesper trained: a causal LM's, dropout 0, no revision.
    pub fn new(lora: LoraConfig, base_model: Option<&str>) -> PeftConfig {
        PeftConfig {
            lora,
            base_model_name_or_path: base_model.map(str::to_owned),
            revision: None,
            task_type: Some("CAUSAL_LM".into()),
            lora_dropout: 0.0,
        }
    }

    /// `adapter_config.json`'s text, as PEFT's `LoraConfig.save_pretrained` writes it
    /// (`json.dumps(…, indent=2, sort_keys=True)`): the fields of PEFT 0.9's `LoraConfig` (module
    /// doc), `inference_mode: true` as PEFT saves it, `lora_alpha` an integer when it is one,
    /// `target_modules` the short names (`q_proj`) in `lora.targets`' order.
    pub fn to_json(&self) -> String {
        let lora = &self.lora;
        // PEFT types lora_alpha as int; write 16, not 16.0, when it is one.
        let alpha = if lora.alpha.fract() == 0.0 && lora.alpha.abs() < 2f64.powi(53) {
            json!(lora.alpha as i64)
        } else {
            json!(lora.alpha)
        };
        let targets: Vec<&str> = lora.targets.iter().map(|p| short_name(*p)).collect();
        let fields: BTreeMap<&str, Value> = [
            ("alpha_pattern", json!({})),
            ("auto_mapping", Value::Null),
            (
                "base_model_name_or_path",
                json!(self.base_model_name_or_path),
            ),
            ("bias", json!("none")),
            ("fan_in_fan_out", json!(false)),
            ("inference_mode", json!(true)),
            ("init_lora_weights", json!(true)),
            ("layers_pattern", Value::Null),
            ("layers_to_transform", Value::Null),
            ("loftq_config", json!({})),
            ("lora_alpha", alpha),
            ("lora_dropout", json!(self.lora_dropout)),
            ("megatron_config", Value::Null),
            ("megatron_core", json!("megatron.core")),
            ("modules_to_save", Value::Null),
            ("peft_type", json!("LORA")),
            ("r", json!(lora.rank)),
            ("rank_pattern", json!({})),
            ("revision", json!(self.revision)),
            ("target_modules", json!(targets)),
            ("task_type", json!(self.task_type)),
            ("use_dora", json!(false)),
            ("use_rslora", json!(lora.rslora)),
        ]
        .into_iter()
        .collect();
        // A BTreeMap of JSON values always serializes.
        serde_json::to_string_pretty(&fields).unwrap_or_default()
    }

    /// The config in `text`, the contents of `file` (named in the errors): `peft_type` must be
    /// `"LORA"`; `r`, `lora_alpha` and `target_modules` (a list of module names, or
    /// `"all-linear"`) must be present; `use_rslora`, `lora_dropout`, `task_type`,
    /// `base_model_name_or_path` and `revision` may be absent; the fields of other kinds of
    /// adapter must be off (module doc); the rest is ignored. The LoRA config must pass
    /// [`LoraConfig::check`].
    pub fn parse(text: &str, file: &str) -> Result<PeftConfig, PeftError> {
        let value: Value = serde_json::from_str(text)
            .map_err(|e| PeftError::invalid(file, "JSON", "a PEFT adapter config", e))?;
        let Value::Object(map) = value else {
            return Err(PeftError::invalid(file, "JSON", "an object", shown(&value)));
        };
        // A field's value, `None` when absent or null.
        let get = |key: &str| map.get(key).filter(|v| !v.is_null());

        match get("peft_type") {
            Some(Value::String(s)) if s == "LORA" => {}
            Some(Value::String(s)) => {
                return Err(PeftError::unsupported(
                    file,
                    "peft_type",
                    shown(&json!(s)),
                    "hesper reads LoRA adapters (\"LORA\")",
                ));
            }
            other => {
                return Err(PeftError::invalid(
                    file,
                    "peft_type",
                    "\"LORA\"",
                    given(other),
                ));
            }
        }
        let task_type = match get("task_type") {
            None => None,
            Some(Value::String(s)) if s == "CAUSAL_LM" => Some(s.clone()),
            Some(Value::String(s)) => {
                return Err(PeftError::unsupported(
                    file,
                    "task_type",
                    shown(&json!(s)),
                    "hesper's model is a causal LM (\"CAUSAL_LM\")",
                ));
            }
            other => {
                return Err(PeftError::invalid(
                    file,
                    "task_type",
                    "a string",
                    given(other),
                ));
            }
        };
        let rank = get("r")
            .and_then(Value::as_u64)
            .and_then(|r| usize::try_from(r).ok())
            .filter(|&r| r > 0)
            .ok_or_else(|| PeftError::invalid(file, "r", "a positive integer", given(get("r"))))?;
        let alpha = get("lora_alpha")
            .and_then(Value::as_f64)
            .filter(|a| a.is_finite())
            .ok_or_else(|| {
                PeftError::invalid(file, "lora_alpha", "a number", given(get("lora_alpha")))
            })?;
        let rslora = match get("use_rslora") {
            None => false,
            Some(Value::Bool(b)) => *b,
            other => {
                return Err(PeftError::invalid(
                    file,
                    "use_rslora",
                    "a bool",
                    given(other),
                ));
            }
        };
        let lora_dropout = match get("lora_dropout") {
            None => 0.0,
            Some(v) => v
                .as_f64()
                .filter(|p| (0.0..=1.0).contains(p))
                .ok_or_else(|| {
                    PeftError::invalid(file, "lora_dropout", "a number in [0, 1]", shown(v))
                })?,
        };
        let string = |key: &str| match get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            other => Err(PeftError::invalid(
                file,
                key,
                "a string or null",
                given(other),
            )),
        };
        let base_model_name_or_path = string("base_model_name_or_path")?;
        let revision = string("revision")?;
        let targets = parse_targets(file, get("target_modules"))?;

        for (key, why) in OFF_FIELDS {
            if let Some(v) = get(key).filter(|v| !is_off(v)) {
                return Err(PeftError::unsupported(file, key, shown(v), why));
            }
        }
        match get("bias") {
            None => {}
            Some(Value::String(s)) if s == "none" => {}
            Some(v) => {
                return Err(PeftError::unsupported(
                    file,
                    "bias",
                    shown(v),
                    "trained biases of the base model are not LoRA adapters (\"none\")",
                ));
            }
        }
        match get("init_lora_weights") {
            None | Some(Value::Bool(_)) => {}
            Some(Value::String(s)) if PLAIN_INITS.contains(&s.as_str()) => {}
            Some(v @ Value::String(_)) => {
                return Err(PeftError::unsupported(
                    file,
                    "init_lora_weights",
                    shown(v),
                    "PiSSA, OLoRA, CorDA, LoftQ and LoRA-GA change the base model's weights \
                     and MiCA the layer; hesper's adapters are on the unchanged base model",
                ));
            }
            Some(v) => {
                return Err(PeftError::invalid(
                    file,
                    "init_lora_weights",
                    "a bool or a string",
                    shown(v),
                ));
            }
        }

        let lora = LoraConfig {
            targets,
            rank,
            alpha,
            rslora,
        };
        lora.check().map_err(|e| PeftError::model(file, e))?;
        Ok(PeftConfig {
            lora,
            base_model_name_or_path,
            revision,
            task_type,
            lora_dropout,
        })
    }
}

/// `q_proj`: the module's last name, as `target_modules` lists it.
fn short_name(p: Projection) -> &'static str {
    let path = p.peft_name();
    path.rsplit('.').next().unwrap_or(path)
}

/// The projections `target_modules` names: a list of names (PEFT matches each against the end
/// of a module's path, so `q_proj` and `self_attn.q_proj` both name Q; repeats are one, as in
/// PEFT's set), or `"all-linear"` (every linear layer of a block; the head is never adapted).
fn parse_targets(file: &str, value: Option<&Value>) -> Result<Vec<Projection>, PeftError> {
    let names: Vec<&str> = Projection::ALL.iter().map(|&p| short_name(p)).collect();
    match value {
        Some(Value::Array(items)) => {
            let mut targets = Vec::new();
            for (i, item) in items.iter().enumerate() {
                let field = format!("target_modules[{i}]");
                let Value::String(name) = item else {
                    return Err(PeftError::invalid(
                        file,
                        field,
                        "a module name",
                        shown(item),
                    ));
                };
                let p = Projection::from_peft_name(name).map_err(|_| {
                    let why = format!("hesper adapts {}", names.join(", "));
                    PeftError::unsupported(file, field, shown(item), why)
                })?;
                if !targets.contains(&p) {
                    targets.push(p);
                }
            }
            Ok(targets)
        }
        Some(Value::String(s)) if s == "all-linear" => Ok(Projection::ALL.to_vec()),
        Some(v @ Value::String(_)) => Err(PeftError::unsupported(
            file,
            "target_modules",
            shown(v),
            format!(
                "a regex; hesper reads a list of module names ({})",
                names.join(", ")
            ),
        )),
        other => Err(PeftError::invalid(
            file,
            "target_modules",
            "a list of module names",
            given(other),
        )),
    }
}

/// Whether a field is off: `null`, `false`, `{}`, `[]` or `""`.
fn is_off(v: &Value) -> bool {
    match v {
        Value::Null | Value::Bool(false) => true,
        Value::Object(m) => m.is_empty(),
        Value::Array(a) => a.is_empty(),
        Value::String(s) => s.is_empty(),
        _ => false,
    }
}

/// A value for a message: its JSON, cut at 80 characters.
fn shown(v: &Value) -> String {
    let text = v.to_string();
    match text.char_indices().nth(80) {
        Some((at, _)) => format!("{}…", &text[..at]),
        None => text,
    }
}

/// A field's value for a message, `absent` when it is absent or null.
fn given(v: Option<&Value>) -> String {
    v.map_or_else(|| "absent".into(), shown)
}

/// The tensors' key: `base_model.model.model.layers.{layer}.{module}.lora_{A|B}.weight`.
fn tensor_key(layer: usize, p: Projection, b: bool) -> String {
    let which = if b { "lora_B" } else { "lora_A" };
    format!("{}.{which}.weight", Adapters::peft_key(layer, p))
}

/// `(layer, projection, is B)` of a LoRA key, `None` when `key` is not one of our model's.
fn parse_key(key: &str) -> Option<(usize, Projection, bool)> {
    let (layer, rest) = key.strip_prefix(KEY_PREFIX)?.split_once('.')?;
    // Only the index as PyTorch writes it (no sign, no leading zero).
    if layer.is_empty()
        || !layer.bytes().all(|c| c.is_ascii_digit())
        || (layer.len() > 1 && layer.starts_with('0'))
    {
        return None;
    }
    let (module, b) = if let Some(m) = rest.strip_suffix(".lora_A.weight") {
        (m, false)
    } else {
        (rest.strip_suffix(".lora_B.weight")?, true)
    };
    let p = Projection::ALL
        .into_iter()
        .find(|p| p.peft_name() == module)?;
    Some((layer.parse().ok()?, p, b))
}

/// `adapters` (of `lora`'s targets and rank, for `config`) as `adapter_model.safetensors`'s
/// bytes: F32 tensors under PEFT's keys (module doc), metadata `{"format": "pt"}`. Errors:
/// adapters not of `lora` and `config`, or a value that is not finite in f32. For a caller that
/// stores the bytes elsewhere (a browser's download); [`save_peft_adapter`] writes them.
pub fn encode_adapters(
    config: &ModelConfig,
    lora: &LoraConfig,
    adapters: &Adapters,
) -> Result<Vec<u8>, PeftError> {
    encode(WEIGHTS_FILE, config, lora, adapters)
}

fn encode(
    file: &str,
    config: &ModelConfig,
    lora: &LoraConfig,
    adapters: &Adapters,
) -> Result<Vec<u8>, PeftError> {
    lora.check()
        .and_then(|()| adapters.check(config, lora))
        .map_err(|e| PeftError::model(file, e))?;
    let r = lora.rank;
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (layer, p, adapter) in adapters.iter() {
        let (out, input) = p.shape(config);
        for (b, values, shape) in [
            (false, &adapter.a, [r, input]),
            (true, &adapter.b, [out, r]),
        ] {
            let key = tensor_key(layer, p, b);
            let mut bytes = Vec::with_capacity(values.len() * 4);
            for (i, &v) in values.iter().enumerate() {
                let x = v as f32;
                if !x.is_finite() {
                    let given = format!("{v:?} at element {i}");
                    return Err(PeftError::invalid(file, key, "finite f32 values", given));
                }
                bytes.extend_from_slice(&x.to_le_bytes());
            }
            tensors.push((key, shape.to_vec(), bytes));
        }
    }
    let safetensors_error = |e: safetensors::SafeTensorError| {
        PeftError::invalid(file, "tensors", "a safetensors file", e)
    };
    let views = tensors
        .iter()
        .map(|(key, shape, bytes)| {
            TensorView::new(Dtype::F32, shape.clone(), bytes).map(|v| (key.as_str(), v))
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(safetensors_error)?;
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize(views, Some(metadata)).map_err(safetensors_error)
}

/// The adapters in `bytes`, the contents of the safetensors file `file` (named in the errors),
/// for `config` and `lora` (from `adapter_config.json`): exactly one `A [r, in]` and one
/// `B [out, r]` per layer and target, F32, F16, BF16 or F64, finite; no other tensor. The
/// byte-level half of [`load_peft_adapter`].
pub fn decode_adapters(
    bytes: &[u8],
    file: &str,
    config: &ModelConfig,
    lora: &LoraConfig,
) -> Result<Adapters, PeftError> {
    lora.check().map_err(|e| PeftError::model(file, e))?;
    check_offsets(bytes, file)?;
    let st = SafeTensors::deserialize(bytes)
        .map_err(|e| PeftError::invalid(file, "header", "a safetensors file", e))?;
    let (r, targets) = (lora.rank, &lora.targets);
    let layers = config.layers;
    // Sorted, so that the first error is the same on every run.
    let mut names = st.names();
    names.sort_unstable();
    // `[layer][target][A, B]`, flattened.
    let mut found: Vec<Option<Vec<f64>>> = vec![None; layers * targets.len() * 2];
    for name in names {
        let unexpected = || {
            PeftError::invalid(
                file,
                name,
                format!("only LoRA weights ({KEY_PREFIX}{{i}}.{{module}}.lora_{{A,B}}.weight)"),
                "an unexpected tensor",
            )
        };
        let (layer, p, b) = parse_key(name).ok_or_else(unexpected)?;
        if layer >= layers {
            let expected = format!("a layer index below {layers} (the model's layers)");
            return Err(PeftError::invalid(file, name, expected, layer));
        }
        let Some(target) = targets.iter().position(|&t| t == p) else {
            let listed: Vec<&str> = targets.iter().map(|&t| short_name(t)).collect();
            let expected = format!("a module of target_modules [{}]", listed.join(", "));
            return Err(PeftError::invalid(file, name, expected, short_name(p)));
        };
        let view = st
            .tensor(name)
            .map_err(|e| PeftError::invalid(file, name, "a tensor", e))?;
        let (out, input) = p.shape(config);
        let shape = if b { [out, r] } else { [r, input] };
        if view.shape() != shape {
            // A rank that disagrees with the config is the likely cause when the other side fits.
            let other = if b { 0 } else { 1 };
            let hint = match view.shape() {
                [_, _] if view.shape()[other] == shape[other] => {
                    format!(" (r = {r} in {CONFIG_FILE})")
                }
                _ => String::new(),
            };
            let expected = format!("shape {shape:?}{hint}");
            return Err(PeftError::invalid(
                file,
                name,
                expected,
                format!("{:?}", view.shape()),
            ));
        }
        let values = to_f64(&view, file, name)?;
        if let Some(i) = values.iter().position(|v| !v.is_finite()) {
            let given = format!("{:?} at element {i}", values[i]);
            return Err(PeftError::invalid(file, name, "finite values", given));
        }
        found[(layer * targets.len() + target) * 2 + b as usize] = Some(values);
    }
    // Every tensor is present with its shape now, so `r` is backed by the file's bytes.
    let mut adapters = Adapters::zeros(config, lora);
    for layer in 0..layers {
        for (target, &p) in targets.iter().enumerate() {
            let at = (layer * targets.len() + target) * 2;
            let missing = |b| PeftError::Missing {
                file: file.into(),
                item: tensor_key(layer, p, b),
            };
            let a = found[at].take().ok_or_else(|| missing(false))?;
            let b = found[at + 1].take().ok_or_else(|| missing(true))?;
            let adapter = adapters
                .get_mut(layer, p)
                .expect("Adapters::zeros has every layer and target");
            adapter.a = a;
            adapter.b = b;
        }
    }
    Ok(adapters)
}

/// The tensor's elements, widened to f64 (exactly: every F32, F16 and BF16 value is an f64).
fn to_f64(view: &TensorView<'_>, file: &str, name: &str) -> Result<Vec<f64>, PeftError> {
    fn words<const N: usize>(data: &[u8]) -> impl Iterator<Item = [u8; N]> + '_ {
        data.chunks_exact(N).map(|c| {
            let mut w = [0; N];
            w.copy_from_slice(c);
            w
        })
    }
    let data = view.data();
    Ok(match view.dtype() {
        Dtype::F32 => words(data).map(|w| f32::from_le_bytes(w) as f64).collect(),
        Dtype::F64 => words(data).map(f64::from_le_bytes).collect(),
        Dtype::F16 => words(data)
            .map(|w| half::f16::from_bits(u16::from_le_bytes(w)).to_f64())
            .collect(),
        Dtype::BF16 => words(data)
            .map(|w| half::bf16::from_bits(u16::from_le_bytes(w)).to_f64())
            .collect(),
        other => {
            return Err(PeftError::unsupported(
                file,
                format!("{name}: dtype"),
                other,
                "hesper reads F32, F16, BF16 and F64",
            ));
        }
    })
}

/// Every tensor's end offset within the data that follows the header. The safetensors crate
/// (0.8.0) checks the offsets against each other and the sum against the file, but computes that
/// sum unchecked: a header claiming tensors of ~2⁶⁴ bytes overflows it (a panic in a debug
/// build). Anything else wrong with the header is left to the crate to report.
fn check_offsets(bytes: &[u8], file: &str) -> Result<(), PeftError> {
    let Some(len) = bytes.first_chunk::<8>() else {
        return Ok(());
    };
    let n = u64::from_le_bytes(*len);
    let Some(data_len) = (bytes.len() as u64 - 8).checked_sub(n) else {
        return Ok(());
    };
    let Ok(Value::Object(header)) = serde_json::from_slice::<Value>(&bytes[8..8 + n as usize])
    else {
        return Ok(());
    };
    for (name, info) in &header {
        let end = info
            .get("data_offsets")
            .and_then(|o| o.get(1))
            .and_then(Value::as_u64);
        if let Some(end) = end.filter(|&end| end > data_len) {
            let expected = format!("tensors within the file's {data_len} bytes of data");
            let given = format!("{name:?} ending at byte {end}");
            return Err(PeftError::invalid(file, "header", expected, given));
        }
    }
    Ok(())
}

/// Save `adapters` (of `lora`, for `config`) into the directory `dir` (created if absent) as
/// PEFT does: `adapter_model.safetensors` and `adapter_config.json` with `base_model` as
/// `base_model_name_or_path` (module doc). Both files are replaced atomically, and only once
/// both are written, so a failed save leaves the previous adapter whole. Errors: `lora` or
/// `adapters` invalid for `config`, a value not finite in f32, or the system's (named by file).
///
/// ```
/// use hesper::io::{load_peft_adapter, save_peft_adapter};
/// use hesper::model::config::{Family, LoraConfig, ModelConfig};
/// use hesper::model::reference::Adapters;
///
/// let config = ModelConfig::tiny(Family::Llama);
/// let lora = LoraConfig::default(); // q_proj and v_proj, r = 8, α = 16
/// let adapters = Adapters::random(&config, &lora, 7);
/// let dir = std::env::temp_dir().join(format!("hesper-doc-peft-{}", std::process::id()));
/// save_peft_adapter(&dir, &config, &lora, &adapters, Some("HuggingFaceTB/SmolLM2-135M"))?;
///
/// // PeftModel.from_pretrained(model, dir) loads it; so does hesper:
/// assert_eq!(load_peft_adapter(&dir, &config)?, (lora, adapters));
/// # std::fs::remove_dir_all(&dir).unwrap();
/// # Ok::<(), hesper::io::PeftError>(())
/// ```
pub fn save_peft_adapter(
    dir: &Path,
    config: &ModelConfig,
    lora: &LoraConfig,
    adapters: &Adapters,
    base_model: Option<&str>,
) -> Result<(), PeftError> {
    save_peft(
        dir,
        config,
        &PeftConfig::new(lora.clone(), base_model),
        adapters,
    )
}

/// [`save_peft_adapter`] with the whole config (a revision, a dropout, another task type).
pub fn save_peft(
    dir: &Path,
    config: &ModelConfig,
    peft: &PeftConfig,
    adapters: &Adapters,
) -> Result<(), PeftError> {
    let config_path = dir.join(CONFIG_FILE);
    let weights_path = dir.join(WEIGHTS_FILE);
    let (config_file, weights_file) = (
        config_path.display().to_string(),
        weights_path.display().to_string(),
    );
    peft.lora
        .check()
        .map_err(|e| PeftError::model(&config_file, e))?;
    let p = peft.lora_dropout;
    if !(0.0..=1.0).contains(&p) {
        return Err(PeftError::invalid(
            &config_file,
            "lora_dropout",
            "a number in [0, 1]",
            p,
        ));
    }
    let weights = encode(&weights_file, config, &peft.lora, adapters)?;
    let json = peft.to_json();
    std::fs::create_dir_all(dir).map_err(|source| PeftError::Io {
        file: dir.display().to_string(),
        source,
    })?;
    super::write_atomic_all(&[(&weights_path, &weights), (&config_path, json.as_bytes())]).map_err(
        |(path, source)| PeftError::Io {
            file: path.display().to_string(),
            source,
        },
    )
}

/// The adapter PEFT saved in the directory `dir`, for `config`: its LoRA config (targets in
/// `target_modules`' order) and adapters. Errors name the file and the field or key: a missing
/// or unreadable file, a config hesper does not load ([`PeftConfig::parse`]), tensors that are
/// not exactly the adapters of that config and `config` ([`decode_adapters`]).
pub fn load_peft_adapter(
    dir: &Path,
    config: &ModelConfig,
) -> Result<(LoraConfig, Adapters), PeftError> {
    load_peft(dir, config).map(|(peft, adapters)| (peft.lora, adapters))
}

/// [`load_peft_adapter`] with the whole config (the base model's name, the dropout).
pub fn load_peft(dir: &Path, config: &ModelConfig) -> Result<(PeftConfig, Adapters), PeftError> {
    let read = |name: &str| {
        let path = dir.join(name);
        let file = path.display().to_string();
        std::fs::read(&path)
            .map(|bytes| (file.clone(), bytes))
            .map_err(|source| PeftError::Io { file, source })
    };
    let (config_file, text) = read(CONFIG_FILE)?;
    let text = String::from_utf8(text)
        .map_err(|e| PeftError::invalid(&config_file, "JSON", "UTF-8 text", e))?;
    let peft = PeftConfig::parse(&text, &config_file)?;
    let (weights_file, bytes) = read(WEIGHTS_FILE)?;
    let adapters = decode_adapters(&bytes, &weights_file, config, &peft.lora)?;
    Ok((peft, adapters))
}
