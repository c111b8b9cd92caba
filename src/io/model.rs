//! A model's [`ModelConfig`] and [`Weights`] from a GGUF file of llama.cpp's conventions
//! (`convert_hf_to_gguf.py`'s metadata keys and tensor names).
//!
//! **The Q/K permutation.** For `llama` the converter permutes the rows of `W_q` and `W_k` (and
//! their biases) head by head, `W_gguf = W_hf.reshape(n, 2, hd/2, in).swapaxes(1, 2)` with `n =
//! H` for Q and `KV` for K (`LlamaModel.permute`), because llama.cpp rotates adjacent pairs
//! (`LLAMA_ROPE_TYPE_NORM`). Our RoPE is Hugging Face's split-half one, so the loader undoes it:
//! row `h·hd + c·hd/2 + j` of the result is row `h·hd + 2j + c` of the file. `qwen2` and
//! `qwen3` are converted without permutation (their classes map names only, and llama.cpp runs
//! them with `LLAMA_ROPE_TYPE_NEOX`, the split-half rotation), so their rows are taken as stored.

use crate::model::config::{Family, ModelConfig};
use crate::model::reference::{LayerWeights, Weights};

use super::gguf::{GgufError, GgufFile};

/// The config and f64 weights of the `llama` (SmolLM2), `qwen2` or `qwen3` model in `file`:
/// hyperparameters from `{arch}.*` metadata (`head_dim` from `{arch}.attention.key_length`
/// when present, else `dim / heads`; `kv_heads` defaults to `heads`), the vocabulary from
/// `tokenizer.ggml.tokens`, the embedding tied when `output.weight` is absent, Llama's Q/K rows
/// un-permuted (module doc). Errors name the key or tensor: an unsupported architecture, a
/// missing key or tensor, a tensor of the wrong shape or an unsupported type, a tensor the
/// model does not use (`rope_freqs.weight`: RoPE scaling, which the model does not compute).
pub fn load_model(file: &GgufFile) -> Result<(ModelConfig, Weights), GgufError> {
    let arch = file.metadata_str("general.architecture")?;
    let family = match arch {
        "llama" => Family::Llama,
        "qwen2" => Family::Qwen2,
        "qwen3" => Family::Qwen3,
        _ => {
            let item = "metadata key \"general.architecture\"";
            return Err(file.invalid(item, "llama, qwen2 or qwen3", format!("{arch:?}")));
        }
    };
    let config = read_config(file, arch, family)?;
    config.check().map_err(|source| GgufError::Model {
        file: file.name().to_string(),
        source: Box::new(source),
    })?;
    let weights = read_weights(file, &config)?;
    weights.check(&config).map_err(|source| GgufError::Model {
        file: file.name().to_string(),
        source: Box::new(source),
    })?;
    Ok((config, weights))
}

fn size(file: &GgufFile, key: &str) -> Result<usize, GgufError> {
    let value = file.metadata_u64(key)?;
    usize::try_from(value)
        .map_err(|_| file.invalid(format!("metadata key {key:?}"), "a size", value))
}

fn read_config(file: &GgufFile, arch: &str, family: Family) -> Result<ModelConfig, GgufError> {
    let key = |name: &str| format!("{arch}.{name}");
    let dim = size(file, &key("embedding_length"))?;
    let heads = size(file, &key("attention.head_count"))?;
    let kv_heads = match file.metadata(&key("attention.head_count_kv")) {
        Some(_) => size(file, &key("attention.head_count_kv"))?,
        None => heads,
    };
    let head_dim = match file.metadata(&key("attention.key_length")) {
        Some(_) => size(file, &key("attention.key_length"))?,
        None if heads > 0 && dim.is_multiple_of(heads) => dim / heads,
        None => {
            let item = format!("metadata key {:?}", key("embedding_length"));
            let expected = format!("a multiple of head_count = {heads}");
            return Err(file.invalid(item, expected, dim));
        }
    };
    // The projections are `heads · head_dim` rows: a product that overflows is no model.
    if heads.checked_mul(head_dim).is_none() {
        let item = format!("metadata key {:?}", key("attention.head_count"));
        let expected = format!("a count of heads of {head_dim} that fits in memory");
        return Err(file.invalid(item, expected, heads));
    }
    let rope_key = key("rope.dimension_count");
    if file.metadata(&rope_key).is_some() && size(file, &rope_key)? != head_dim {
        let expected = format!("the head dim {head_dim} (partial RoPE is not supported)");
        let given = size(file, &rope_key)?;
        return Err(file.invalid(format!("metadata key {rope_key:?}"), expected, given));
    }
    Ok(ModelConfig {
        family,
        vocab: file.metadata_array("tokenizer.ggml.tokens")?.len(),
        dim,
        ffn_dim: size(file, &key("feed_forward_length"))?,
        layers: size(file, &key("block_count"))?,
        heads,
        kv_heads,
        head_dim,
        rope_base: file.metadata_f64(&key("rope.freq_base"))?,
        norm_eps: file.metadata_f64(&key("attention.layer_norm_rms_epsilon"))?,
        tied_embeddings: file.tensor("output.weight").is_none(),
        max_seq: size(file, &key("context_length"))?,
    })
}

/// Reads tensors by name, checking each one's shape, and remembers which it read.
struct Tensors<'a> {
    file: &'a GgufFile,
    used: Vec<&'a str>,
}

impl<'a> Tensors<'a> {
    /// Tensor `name` of PyTorch shape `shape`, widened to f64.
    fn get(&mut self, name: &str, shape: &[usize]) -> Result<Vec<f64>, GgufError> {
        let item = format!("tensor {name:?}");
        let Some(info) = self.file.tensor(name) else {
            return Err(self
                .file
                .invalid(item, format!("present, of shape {shape:?}"), "absent"));
        };
        if info.shape() != shape {
            let given = format!("shape {:?}", info.shape());
            return Err(self.file.invalid(item, format!("shape {shape:?}"), given));
        }
        self.used.push(&info.name);
        let values = self.file.tensor_f32(name)?;
        Ok(values.into_iter().map(f64::from).collect())
    }

    /// `get`, or `None` when `wanted` is false.
    fn maybe(
        &mut self,
        wanted: bool,
        name: &str,
        shape: &[usize],
    ) -> Result<Option<Vec<f64>>, GgufError> {
        wanted.then(|| self.get(name, shape)).transpose()
    }
}

fn read_weights(file: &GgufFile, config: &ModelConfig) -> Result<Weights, GgufError> {
    let mut t = Tensors {
        file,
        used: Vec::new(),
    };
    let (d, i, hd) = (config.dim, config.ffn_dim, config.head_dim);
    let (q, kv) = (config.heads * hd, config.kv_heads * hd);
    let (qwen2, qwen3) = (
        config.family == Family::Qwen2,
        config.family == Family::Qwen3,
    );
    // Llama's Q and K rows (and a bias's entries) as the converter permuted them.
    let permuted = config.family == Family::Llama;
    let unpermute = |w: Vec<f64>, heads: usize| {
        if permuted {
            unpermute_rows(&w, heads, hd)
        } else {
            w
        }
    };
    let embed = t.get("token_embd.weight", &[config.vocab, d])?;
    // Not `with_capacity(config.layers)`: the count is the file's claim (`block_count`), backed
    // by the file only as each layer's tensors are found.
    let mut layers = Vec::new();
    for l in 0..config.layers {
        let name = |n: &str| format!("blk.{l}.{n}");
        layers.push(LayerWeights {
            attn_norm: t.get(&name("attn_norm.weight"), &[d])?,
            q: unpermute(t.get(&name("attn_q.weight"), &[q, d])?, config.heads),
            k: unpermute(t.get(&name("attn_k.weight"), &[kv, d])?, config.kv_heads),
            v: t.get(&name("attn_v.weight"), &[kv, d])?,
            o: t.get(&name("attn_output.weight"), &[d, q])?,
            ffn_norm: t.get(&name("ffn_norm.weight"), &[d])?,
            gate: t.get(&name("ffn_gate.weight"), &[i, d])?,
            up: t.get(&name("ffn_up.weight"), &[i, d])?,
            down: t.get(&name("ffn_down.weight"), &[d, i])?,
            q_bias: t.maybe(qwen2, &name("attn_q.bias"), &[q])?,
            k_bias: t.maybe(qwen2, &name("attn_k.bias"), &[kv])?,
            v_bias: t.maybe(qwen2, &name("attn_v.bias"), &[kv])?,
            q_norm: t.maybe(qwen3, &name("attn_q_norm.weight"), &[hd])?,
            k_norm: t.maybe(qwen3, &name("attn_k_norm.weight"), &[hd])?,
            attn_sub_norm: None,
            ffn_sub_norm: None,
        });
    }
    let final_norm = t.get("output_norm.weight", &[d])?;
    let lm_head = t.maybe(!config.tied_embeddings, "output.weight", &[config.vocab, d])?;
    if let Some(extra) = file
        .tensors()
        .iter()
        .find(|info| !t.used.contains(&info.name.as_str()))
    {
        let expected = format!("only tensors a {:?} model uses", config.family);
        return Err(file.invalid(
            format!("tensor {:?}", extra.name),
            expected,
            "an extra tensor",
        ));
    }
    Ok(Weights {
        embed,
        layers,
        final_norm,
        lm_head,
    })
}

/// Undo `convert_hf_to_gguf.py`'s `LlamaModel.permute` on a `[heads·hd, cols]` matrix (`cols`
/// from its length): row `h·hd + c·hd/2 + j` of the result is row `h·hd + 2j + c` of `w`.
pub fn unpermute_rows(w: &[f64], heads: usize, hd: usize) -> Vec<f64> {
    let cols = w.len() / (heads * hd);
    let half = hd / 2;
    let mut out = Vec::with_capacity(w.len());
    for h in 0..heads {
        for c in 0..2 {
            for j in 0..half {
                let src = (h * hd + 2 * j + c) * cols;
                out.extend_from_slice(&w[src..src + cols]);
            }
        }
    }
    out
}
