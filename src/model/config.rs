//! The model's and the adapters' configuration: plain host-side values, checked before use.

/// A value of a config, the weights, the adapters or a batch that the model does not take, or
/// an error of the GPU running it.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// `item.field` is not what it must be.
    #[error("{item}: {field} must be {expected}, but is {given}")]
    Invalid {
        /// What holds the value: `ModelConfig`, `LoraConfig`, `Weights`, `Adapters`, `Batch`.
        item: &'static str,
        /// The field, or the tensor or element (`layers.1.q`, `tokens[5]`).
        field: String,
        /// What the model takes there.
        expected: String,
        /// What it was given.
        given: String,
    },
    /// The executor refused or failed a launch, an upload or a readback (its message names
    /// the kernel and the binding).
    #[error(transparent)]
    Gpu(#[from] hesper_exec::ExecError),
}

impl ModelError {
    /// `item.field` must be `expected` but is `given`.
    pub(crate) fn invalid(
        item: &'static str,
        field: impl Into<String>,
        expected: impl Into<String>,
        given: impl std::fmt::Display,
    ) -> ModelError {
        ModelError::Invalid {
            item,
            field: field.into(),
            expected: expected.into(),
            given: given.to_string(),
        }
    }
}

/// The model families the reference computes (KERNELS.md "Forward of one block").
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Family {
    /// Llama and SmolLM2: SwiGLU, no biases.
    Llama,
    /// Qwen2: Llama with biases on the Q, K and V projections.
    Qwen2,
    /// Qwen3: Llama with an RMSNorm of each head of Q and of K before RoPE.
    Qwen3,
    /// BitNet b1.58: ReLU²×Mul with a sub-norm before `W_down`, a sub-norm of the attention
    /// output before `W_o`; the linear layers as their dequantized dense matrices.
    BitNet,
}

/// A model's shape, with Hugging Face's meanings (`hidden_size` is `dim`, `intermediate_size`
/// is `ffn_dim`, `num_key_value_heads` is `kv_heads`, `rope_theta` is `rope_base`,
/// `rms_norm_eps` is `norm_eps`).
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// Which block the layers are.
    pub family: Family,
    /// `V`: the vocabulary.
    pub vocab: usize,
    /// `D`: the residual stream's width.
    pub dim: usize,
    /// `I`: the FFN's width.
    pub ffn_dim: usize,
    /// `L`: the blocks.
    pub layers: usize,
    /// `H`: query heads.
    pub heads: usize,
    /// `KV`: key/value heads (`H / KV` query heads read each).
    pub kv_heads: usize,
    /// `hd`: the width of a head.
    pub head_dim: usize,
    /// RoPE's `base` in `θ_i = pos·base^(−2i/hd)`.
    pub rope_base: f64,
    /// The `ε` of every RMSNorm.
    pub norm_eps: f64,
    /// Whether the logits use the embedding (`logits = n·Eᵀ`) rather than a separate head.
    pub tied_embeddings: bool,
    /// The longest sequence a batch may hold.
    pub max_seq: usize,
}

impl ModelConfig {
    /// The tests' model of `family`: 2 layers, `D = 64`, FFN 128, 4 query and 2 KV heads of 16,
    /// a vocabulary of 97, RoPE base 10 000, `ε = 1e-5`, at most 8 positions; the embedding
    /// tied for Llama and Qwen3 (Qwen2 and BitNet have a head of their own).
    pub fn tiny(family: Family) -> ModelConfig {
        ModelConfig {
            family,
            vocab: 97,
            dim: 64,
            ffn_dim: 128,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
            rope_base: 10_000.0,
            norm_eps: 1e-5,
            tied_embeddings: matches!(family, Family::Llama | Family::Qwen3),
            max_seq: 8,
        }
    }

    /// `Ok` when every size is positive, `heads` is a multiple of `kv_heads`, `head_dim` is
    /// even (RoPE rotates pairs), and `rope_base` and `norm_eps` are positive and finite.
    pub fn check(&self) -> Result<(), ModelError> {
        let bad = |field: &str, expected: &str, given: &dyn std::fmt::Display| {
            Err(ModelError::invalid("ModelConfig", field, expected, given))
        };
        let sizes = [
            ("vocab", self.vocab),
            ("dim", self.dim),
            ("ffn_dim", self.ffn_dim),
            ("layers", self.layers),
            ("heads", self.heads),
            ("kv_heads", self.kv_heads),
            ("head_dim", self.head_dim),
            ("max_seq", self.max_seq),
        ];
        for (field, size) in sizes {
            if size == 0 {
                return bad(field, "positive", &size);
            }
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            let expected = format!("a multiple of kv_heads = {}", self.kv_heads);
            return bad("heads", &expected, &self.heads);
        }
        if !self.head_dim.is_multiple_of(2) {
            return bad("head_dim", "even (RoPE rotates pairs)", &self.head_dim);
        }
        for (field, value) in [("rope_base", self.rope_base), ("norm_eps", self.norm_eps)] {
            if !(value.is_finite() && value > 0.0) {
                return bad(field, "positive and finite", &value);
            }
        }
        Ok(())
    }

    /// `G = H / KV`: the query heads that read one KV head.
    pub fn group(&self) -> usize {
        self.heads / self.kv_heads
    }
}

/// A linear layer of a block that LoRA can adapt.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Projection {
    /// `W_q [H·hd, D]`.
    Q,
    /// `W_k [KV·hd, D]`.
    K,
    /// `W_v [KV·hd, D]`.
    V,
    /// `W_o [D, H·hd]`.
    O,
    /// `W_gate [I, D]`.
    Gate,
    /// `W_up [I, D]`.
    Up,
    /// `W_down [D, I]`.
    Down,
}

impl Projection {
    /// All seven, in the order of a block's forward.
    pub const ALL: [Projection; 7] = [
        Projection::Q,
        Projection::K,
        Projection::V,
        Projection::O,
        Projection::Gate,
        Projection::Up,
        Projection::Down,
    ];

    /// The module's path inside a layer, as Hugging Face and PEFT name it.
    pub fn peft_name(self) -> &'static str {
        match self {
            Projection::Q => "self_attn.q_proj",
            Projection::K => "self_attn.k_proj",
            Projection::V => "self_attn.v_proj",
            Projection::O => "self_attn.o_proj",
            Projection::Gate => "mlp.gate_proj",
            Projection::Up => "mlp.up_proj",
            Projection::Down => "mlp.down_proj",
        }
    }

    /// The projection PEFT names `name`: a module path (`self_attn.q_proj`) or its last part
    /// (`q_proj`, as `target_modules` lists it); else an error listing the names there are.
    pub fn from_peft_name(name: &str) -> Result<Projection, ModelError> {
        Projection::ALL
            .into_iter()
            .find(|p| {
                let path = p.peft_name();
                path == name || path.rsplit('.').next() == Some(name)
            })
            .ok_or_else(|| {
                let names: Vec<&str> = Projection::ALL.iter().map(|p| p.peft_name()).collect();
                let expected = format!("one of {}", names.join(", "));
                ModelError::invalid("LoraConfig", "target", expected, format!("{name:?}"))
            })
    }

    /// `(out, in)`: the weight is `[out, in]`, `y = x·Wᵀ`.
    pub fn shape(self, config: &ModelConfig) -> (usize, usize) {
        let (d, i) = (config.dim, config.ffn_dim);
        let q = config.heads * config.head_dim;
        let kv = config.kv_heads * config.head_dim;
        match self {
            Projection::Q => (q, d),
            Projection::K | Projection::V => (kv, d),
            Projection::O => (d, q),
            Projection::Gate | Projection::Up => (i, d),
            Projection::Down => (d, i),
        }
    }
}

/// Which projections LoRA adapts and how (PEFT's `target_modules`, `r`, `lora_alpha`,
/// `use_rslora`).
#[derive(Clone, Debug, PartialEq)]
pub struct LoraConfig {
    /// The adapted projections of every layer.
    pub targets: Vec<Projection>,
    /// `r`: `A` is `[r, in]`, `B` is `[out, r]`.
    pub rank: usize,
    /// `α`.
    pub alpha: f64,
    /// rsLoRA: the scale is `α/√r` rather than `α/r`.
    pub rslora: bool,
}

impl LoraConfig {
    /// `s` in `y = x·Wᵀ + s·(x·Aᵀ)·Bᵀ`: `α/r`, or `α/√r` with rsLoRA.
    pub fn scale(&self) -> f64 {
        let r = self.rank as f64;
        if self.rslora {
            self.alpha / r.sqrt()
        } else {
            self.alpha / r
        }
    }

    /// `Ok` when the rank is positive, `alpha` finite, and the targets non-empty and unique.
    pub fn check(&self) -> Result<(), ModelError> {
        let bad = |field: &str, expected: &str, given: String| {
            Err(ModelError::invalid("LoraConfig", field, expected, given))
        };
        if self.rank == 0 {
            return bad("rank", "positive", "0".into());
        }
        if !self.alpha.is_finite() {
            return bad("alpha", "finite", self.alpha.to_string());
        }
        if self.targets.is_empty() {
            return bad("targets", "at least one projection", "empty".into());
        }
        for (i, p) in self.targets.iter().enumerate() {
            if self.targets[..i].contains(p) {
                return bad("targets", "unique", format!("{p:?} twice"));
            }
        }
        Ok(())
    }
}

impl Default for LoraConfig {
    /// PEFT's defaults: `q_proj` and `v_proj`, rank 8, `α = 16`, no rsLoRA.
    fn default() -> Self {
        LoraConfig {
            targets: vec![Projection::Q, Projection::V],
            rank: 8,
            alpha: 16.0,
            rslora: false,
        }
    }
}
