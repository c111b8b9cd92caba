//! The whole model in f64 on the CPU, its loss and the loss's gradients with respect to every
//! LoRA adapter and to the embedding output (the semantics are the module doc's,
//! [`crate::model`]).

use hesper_kernels::testing::Rng;

use super::config::{Family, LoraConfig, ModelConfig, ModelError, Projection};
use super::tape::{AttentionShape, Tape, Var};

/// The target of a position that predicts nothing (PyTorch's `ignore_index`).
pub const IGNORE_INDEX: i64 = -100;

/// One block's frozen weights, row-major; a matrix is `[out, in]` like `nn.Linear`'s.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerWeights {
    /// `γ1 [D]`: the RMSNorm before attention.
    pub attn_norm: Vec<f64>,
    /// `W_q [H·hd, D]`.
    pub q: Vec<f64>,
    /// `W_k [KV·hd, D]`.
    pub k: Vec<f64>,
    /// `W_v [KV·hd, D]`.
    pub v: Vec<f64>,
    /// `W_o [D, H·hd]`.
    pub o: Vec<f64>,
    /// `γ2 [D]`: the RMSNorm before the FFN.
    pub ffn_norm: Vec<f64>,
    /// `W_gate [I, D]`.
    pub gate: Vec<f64>,
    /// `W_up [I, D]`.
    pub up: Vec<f64>,
    /// `W_down [D, I]`.
    pub down: Vec<f64>,
    /// Qwen2: the Q projection's bias `[H·hd]`.
    pub q_bias: Option<Vec<f64>>,
    /// Qwen2: the K projection's bias `[KV·hd]`.
    pub k_bias: Option<Vec<f64>>,
    /// Qwen2: the V projection's bias `[KV·hd]`.
    pub v_bias: Option<Vec<f64>>,
    /// Qwen3: the gain `[hd]` of the RMSNorm of each head of Q (before RoPE).
    pub q_norm: Option<Vec<f64>>,
    /// Qwen3: the gain `[hd]` of the RMSNorm of each head of K (before RoPE).
    pub k_norm: Option<Vec<f64>>,
    /// BitNet: `γa [H·hd]` (`= D` in BitNet's configs), the sub-norm of the attention output.
    pub attn_sub_norm: Option<Vec<f64>>,
    /// BitNet: `γf [I]`, the sub-norm of the FFN's `h`.
    pub ffn_sub_norm: Option<Vec<f64>>,
}

impl LayerWeights {
    /// The frozen weight of `projection`.
    pub fn projection(&self, projection: Projection) -> &[f64] {
        match projection {
            Projection::Q => &self.q,
            Projection::K => &self.k,
            Projection::V => &self.v,
            Projection::O => &self.o,
            Projection::Gate => &self.gate,
            Projection::Up => &self.up,
            Projection::Down => &self.down,
        }
    }

    /// The family's extras, each with the shape it must have, and whether the family has it.
    fn extras(&self, config: &ModelConfig) -> [(&'static str, &Option<Vec<f64>>, usize, bool); 7] {
        let (q, kv) = (
            config.heads * config.head_dim,
            config.kv_heads * config.head_dim,
        );
        let f = config.family;
        let (qwen2, qwen3, bitnet) = (f == Family::Qwen2, f == Family::Qwen3, f == Family::BitNet);
        [
            ("q_bias", &self.q_bias, q, qwen2),
            ("k_bias", &self.k_bias, kv, qwen2),
            ("v_bias", &self.v_bias, kv, qwen2),
            ("q_norm", &self.q_norm, config.head_dim, qwen3),
            ("k_norm", &self.k_norm, config.head_dim, qwen3),
            ("attn_sub_norm", &self.attn_sub_norm, q, bitnet),
            ("ffn_sub_norm", &self.ffn_sub_norm, config.ffn_dim, bitnet),
        ]
    }
}

/// The frozen model.
#[derive(Clone, Debug, PartialEq)]
pub struct Weights {
    /// `E [V, D]`: row `token` is the token's embedding.
    pub embed: Vec<f64>,
    /// The blocks, first to last.
    pub layers: Vec<LayerWeights>,
    /// `γ [D]`: the RMSNorm before the logits.
    pub final_norm: Vec<f64>,
    /// The output head `[V, D]`; `None` when the embedding is tied (the logits use `embed`).
    pub lm_head: Option<Vec<f64>>,
}

/// `n` values uniform in `±bound`, each an f32 widened (so a GPU given the f32s computes with
/// exactly the reference's numbers).
fn uniform(rng: &mut Rng, n: usize, bound: f64) -> Vec<f64> {
    rng.vec(n, bound as f32).iter().map(|&v| v as f64).collect()
}

/// `n` norm gains in `1 ± 0.1`, f32-representable.
fn gains(rng: &mut Rng, n: usize) -> Vec<f64> {
    rng.vec(n, 0.1).iter().map(|&v| (1.0 + v) as f64).collect()
}

/// `[out, in]` uniform in `±0.5/√in`.
fn matrix(rng: &mut Rng, (out, input): (usize, usize)) -> Vec<f64> {
    uniform(rng, out * input, 0.5 / (input as f64).sqrt())
}

impl Weights {
    /// Small random weights of `config`'s shape and family (matrices uniform in `±0.5/√in`,
    /// the embedding in `±√(3/D)` so tied logits have unit variance, biases in `±0.1`, norm
    /// gains in `1 ± 0.1`), reproducible per seed: non-trivial inputs for tests.
    pub fn random(config: &ModelConfig, seed: u64) -> Weights {
        let mut rng = Rng::new(seed);
        let (d, f) = (config.dim, config.family);
        let (q, kv) = (
            config.heads * config.head_dim,
            config.kv_heads * config.head_dim,
        );
        let embed = uniform(&mut rng, config.vocab * d, (3.0 / d as f64).sqrt());
        let (qwen2, qwen3, bitnet) = (f == Family::Qwen2, f == Family::Qwen3, f == Family::BitNet);
        let layers = (0..config.layers)
            .map(|_| LayerWeights {
                attn_norm: gains(&mut rng, d),
                q: matrix(&mut rng, Projection::Q.shape(config)),
                k: matrix(&mut rng, Projection::K.shape(config)),
                v: matrix(&mut rng, Projection::V.shape(config)),
                o: matrix(&mut rng, Projection::O.shape(config)),
                ffn_norm: gains(&mut rng, d),
                gate: matrix(&mut rng, Projection::Gate.shape(config)),
                up: matrix(&mut rng, Projection::Up.shape(config)),
                down: matrix(&mut rng, Projection::Down.shape(config)),
                q_bias: qwen2.then(|| uniform(&mut rng, q, 0.1)),
                k_bias: qwen2.then(|| uniform(&mut rng, kv, 0.1)),
                v_bias: qwen2.then(|| uniform(&mut rng, kv, 0.1)),
                q_norm: qwen3.then(|| gains(&mut rng, config.head_dim)),
                k_norm: qwen3.then(|| gains(&mut rng, config.head_dim)),
                attn_sub_norm: bitnet.then(|| gains(&mut rng, q)),
                ffn_sub_norm: bitnet.then(|| gains(&mut rng, config.ffn_dim)),
            })
            .collect();
        let final_norm = gains(&mut rng, d);
        let lm_head = (!config.tied_embeddings).then(|| matrix(&mut rng, (config.vocab, d)));
        Weights {
            embed,
            layers,
            final_norm,
            lm_head,
        }
    }

    /// `Ok` when every tensor has `config`'s shape, the family's extras are present and no
    /// other, and `lm_head` is present exactly when the embedding is not tied.
    pub fn check(&self, config: &ModelConfig) -> Result<(), ModelError> {
        let d = config.dim;
        check_len("embed", &self.embed, config.vocab * d)?;
        if self.layers.len() != config.layers {
            let expected = format!("{} layers", config.layers);
            return Err(ModelError::invalid(
                "Weights",
                "layers",
                expected,
                self.layers.len(),
            ));
        }
        for (i, layer) in self.layers.iter().enumerate() {
            check_len(&format!("layers.{i}.attn_norm"), &layer.attn_norm, d)?;
            check_len(&format!("layers.{i}.ffn_norm"), &layer.ffn_norm, d)?;
            for p in Projection::ALL {
                let (out, input) = p.shape(config);
                let name = format!("layers.{i}.{}", p.peft_name());
                check_len(&name, layer.projection(p), out * input)?;
            }
            for (name, tensor, len, wanted) in layer.extras(config) {
                let field = format!("layers.{i}.{name}");
                match (tensor, wanted) {
                    (Some(t), true) => check_len(&field, t, len)?,
                    (None, false) => {}
                    (None, true) => {
                        let expected = format!("present ({:?} has it)", config.family);
                        return Err(ModelError::invalid("Weights", field, expected, "None"));
                    }
                    (Some(_), false) => {
                        let expected = format!("None ({:?} has no {name})", config.family);
                        return Err(ModelError::invalid("Weights", field, expected, "present"));
                    }
                }
            }
        }
        check_len("final_norm", &self.final_norm, d)?;
        match (&self.lm_head, config.tied_embeddings) {
            (Some(head), false) => check_len("lm_head", head, config.vocab * d),
            (None, true) => Ok(()),
            (Some(_), true) => Err(ModelError::invalid(
                "Weights",
                "lm_head",
                "None (the embedding is tied)",
                "present",
            )),
            (None, false) => Err(ModelError::invalid(
                "Weights",
                "lm_head",
                "present (the embedding is not tied)",
                "None",
            )),
        }
    }

    /// The matrix the logits are `n·Wᵀ` of: the head, or the tied embedding.
    fn head(&self) -> &[f64] {
        self.lm_head.as_deref().unwrap_or(&self.embed)
    }
}

fn check_len(field: &str, tensor: &[f64], len: usize) -> Result<(), ModelError> {
    if tensor.len() == len {
        return Ok(());
    }
    let (expected, given) = (
        format!("{len} elements"),
        format!("{} elements", tensor.len()),
    );
    Err(ModelError::invalid("Weights", field, expected, given))
}

/// One projection's LoRA adapter.
#[derive(Clone, Debug, PartialEq)]
pub struct Adapter {
    /// `A [r, in]`.
    pub a: Vec<f64>,
    /// `B [out, r]`.
    pub b: Vec<f64>,
}

/// The LoRA adapters of every targeted projection of every layer (or, in [`Grads`], their
/// gradients in the same layout).
#[derive(Clone, Debug, PartialEq)]
pub struct Adapters {
    /// The adapted projections, in the LoRA config's order.
    targets: Vec<Projection>,
    /// `[layer][target]`, flattened.
    adapters: Vec<Adapter>,
}

impl Adapters {
    /// One adapter per layer and target, each made by `make(rng, (out, in))`.
    fn build(
        config: &ModelConfig,
        lora: &LoraConfig,
        seed: u64,
        make: impl Fn(&mut Rng, (usize, usize)) -> Adapter,
    ) -> Adapters {
        let mut rng = Rng::new(seed);
        let adapters = (0..config.layers)
            .flat_map(|_| &lora.targets)
            .map(|p| make(&mut rng, p.shape(config)))
            .collect();
        Adapters {
            targets: lora.targets.clone(),
            adapters,
        }
    }

    /// All zeros: the model without adapters.
    pub fn zeros(config: &ModelConfig, lora: &LoraConfig) -> Adapters {
        let r = lora.rank;
        Adapters::build(config, lora, 0, |_, (out, input)| Adapter {
            a: vec![0.0; r * input],
            b: vec![0.0; out * r],
        })
    }

    /// `A` uniform in `±1/√in` and `B` in `±1/√r`, f32-representable: adapters whose every
    /// gradient is non-zero, for tests.
    pub fn random(config: &ModelConfig, lora: &LoraConfig, seed: u64) -> Adapters {
        let r = lora.rank;
        Adapters::build(config, lora, seed, |rng, (out, input)| Adapter {
            a: uniform(rng, r * input, 1.0 / (input as f64).sqrt()),
            b: uniform(rng, out * r, 1.0 / (r as f64).sqrt()),
        })
    }

    /// PEFT's init: `A` kaiming-uniform with `a = √5` (uniform in `±1/√in`), `B` zeros, so the
    /// adapted model starts as the frozen one.
    pub fn init_peft(config: &ModelConfig, lora: &LoraConfig, seed: u64) -> Adapters {
        let r = lora.rank;
        Adapters::build(config, lora, seed, |rng, (out, input)| Adapter {
            a: uniform(rng, r * input, 1.0 / (input as f64).sqrt()),
            b: vec![0.0; out * r],
        })
    }

    /// The prefix of a PEFT key: `base_model.model.model.layers.{layer}.{peft_name}`, to which
    /// `.lora_A.weight` and `.lora_B.weight` are appended.
    pub fn peft_key(layer: usize, projection: Projection) -> String {
        format!(
            "base_model.model.model.layers.{layer}.{}",
            projection.peft_name()
        )
    }

    /// The adapter PEFT names `name`: `layers.{i}.{module}` (`layers.3.self_attn.q_proj`),
    /// with or without the `base_model.model.model.` of its keys ([`Adapters::peft_key`]);
    /// `None` when there is no such layer or LoRA does not target the module.
    pub fn get_by_name(&self, name: &str) -> Option<&Adapter> {
        let (layer, projection) = Adapters::parse_name(name)?;
        self.get(layer, projection)
    }

    /// The adapter PEFT names `name` ([`Adapters::get_by_name`]), to change.
    pub fn get_by_name_mut(&mut self, name: &str) -> Option<&mut Adapter> {
        let (layer, projection) = Adapters::parse_name(name)?;
        self.get_mut(layer, projection)
    }

    fn parse_name(name: &str) -> Option<(usize, Projection)> {
        let name = name.strip_prefix("base_model.model.model.").unwrap_or(name);
        let (layer, module) = name.strip_prefix("layers.")?.split_once('.')?;
        let projection = Projection::ALL
            .into_iter()
            .find(|p| p.peft_name() == module)?;
        Some((layer.parse().ok()?, projection))
    }

    /// The adapted projections, in the LoRA config's order.
    pub fn targets(&self) -> &[Projection] {
        &self.targets
    }

    fn index(&self, layer: usize, projection: Projection) -> Option<usize> {
        let target = self.targets.iter().position(|&p| p == projection)?;
        let at = layer * self.targets.len() + target;
        (at < self.adapters.len()).then_some(at)
    }

    /// The adapter of `projection` in `layer` (`None` when LoRA does not target it).
    pub fn get(&self, layer: usize, projection: Projection) -> Option<&Adapter> {
        self.index(layer, projection).map(|i| &self.adapters[i])
    }

    /// The adapter of `projection` in `layer`, to change.
    pub fn get_mut(&mut self, layer: usize, projection: Projection) -> Option<&mut Adapter> {
        self.index(layer, projection).map(|i| &mut self.adapters[i])
    }

    /// `(layer, projection, adapter)` for every adapter, layer by layer.
    pub fn iter(&self) -> impl Iterator<Item = (usize, Projection, &Adapter)> {
        let targets = self.targets.len();
        self.adapters
            .iter()
            .enumerate()
            .map(move |(i, a)| (i / targets, self.targets[i % targets], a))
    }

    /// `Ok` when these are adapters of `lora`'s targets and rank for every layer of `config`.
    pub fn check(&self, config: &ModelConfig, lora: &LoraConfig) -> Result<(), ModelError> {
        let bad = |field: String, expected: String, given: String| {
            Err(ModelError::invalid("Adapters", field, expected, given))
        };
        if self.targets != lora.targets {
            let (expected, given) = (format!("{:?}", lora.targets), format!("{:?}", self.targets));
            return bad("targets".into(), expected, given);
        }
        let want = config.layers * self.targets.len();
        if self.adapters.len() != want {
            let expected = format!("{want} adapters ({} layers)", config.layers);
            return bad("adapters".into(), expected, self.adapters.len().to_string());
        }
        let r = lora.rank;
        for (layer, p, adapter) in self.iter() {
            let (out, input) = p.shape(config);
            let name = format!("layers.{layer}.{}", p.peft_name());
            for (which, tensor, len) in [
                ("lora_A", &adapter.a, r * input),
                ("lora_B", &adapter.b, out * r),
            ] {
                if tensor.len() != len {
                    let expected = format!("{len} elements");
                    return bad(
                        format!("{name}.{which}"),
                        expected,
                        format!("{} elements", tensor.len()),
                    );
                }
            }
        }
        Ok(())
    }
}

/// A batch of `B` right-padded sequences of `S` positions, flattened: token `t = b·S + s`.
#[derive(Clone, Debug, PartialEq)]
pub struct Batch {
    /// `B`.
    pub batch: usize,
    /// `S`.
    pub seq_len: usize,
    /// `[B·S]` token ids (at padded positions: any id of the vocabulary).
    pub tokens: Vec<u32>,
    /// `[B·S]` the token each position predicts, or [`IGNORE_INDEX`].
    pub targets: Vec<i64>,
    /// `[B]` each sequence's valid length; positions `≥ lens[b]` are padding.
    pub lens: Vec<usize>,
}

impl Batch {
    /// Random tokens of `config`'s vocabulary in sequences of `lens`, right-padded to
    /// `seq_len`, reproducible per seed, for tests: each position predicts the next token; the
    /// last of each sequence, the padding, and position 1 of the first sequence (a masked
    /// target inside a sequence) predict nothing.
    pub fn random(config: &ModelConfig, seed: u64, seq_len: usize, lens: &[usize]) -> Batch {
        let mut rng = Rng::new(seed);
        let tokens: Vec<u32> = (0..lens.len() * seq_len)
            .map(|_| rng.next_u32() % config.vocab as u32)
            .collect();
        let targets = (0..tokens.len())
            .map(|t| {
                let (b, s) = (t / seq_len, t % seq_len);
                if s + 1 < lens[b] && !(b == 0 && s == 1) {
                    tokens[t + 1] as i64
                } else {
                    IGNORE_INDEX
                }
            })
            .collect();
        Batch {
            batch: lens.len(),
            seq_len,
            tokens,
            targets,
            lens: lens.to_vec(),
        }
    }

    /// `T = B·S`.
    pub fn positions(&self) -> usize {
        self.batch * self.seq_len
    }

    /// `N`: the positions whose target is not [`IGNORE_INDEX`], the loss's denominator.
    pub fn target_count(&self) -> usize {
        self.targets.iter().filter(|&&t| t != IGNORE_INDEX).count()
    }

    /// `Ok` when `B` and `S` are positive, `S ≤ max_seq`, the vectors have their lengths, every
    /// token id is `< vocab`, every length `≤ S`, and every target is `< vocab` or
    /// [`IGNORE_INDEX`] — the latter at every padded position.
    pub fn check(&self, config: &ModelConfig) -> Result<(), ModelError> {
        let bad = |field: String, expected: String, given: String| {
            Err(ModelError::invalid("Batch", field, expected, given))
        };
        for (field, size) in [("batch", self.batch), ("seq_len", self.seq_len)] {
            if size == 0 {
                return bad(field.into(), "positive".into(), "0".into());
            }
        }
        if self.seq_len > config.max_seq {
            let expected = format!("at most max_seq = {}", config.max_seq);
            return bad("seq_len".into(), expected, self.seq_len.to_string());
        }
        let t = self.positions();
        let lengths = [
            ("tokens", self.tokens.len(), t),
            ("targets", self.targets.len(), t),
            ("lens", self.lens.len(), self.batch),
        ];
        for (field, len, want) in lengths {
            if len != want {
                return bad(format!("{field}.len()"), want.to_string(), len.to_string());
            }
        }
        if let Some((i, len)) = self
            .lens
            .iter()
            .enumerate()
            .find(|(_, l)| **l > self.seq_len)
        {
            let expected = format!("at most seq_len = {}", self.seq_len);
            return bad(format!("lens[{i}]"), expected, len.to_string());
        }
        if let Some((i, id)) = self
            .tokens
            .iter()
            .enumerate()
            .find(|(_, id)| **id as usize >= config.vocab)
        {
            let expected = format!("a token id below vocab = {}", config.vocab);
            return bad(format!("tokens[{i}]"), expected, id.to_string());
        }
        for (i, &target) in self.targets.iter().enumerate() {
            let padded = i % self.seq_len >= self.lens[i / self.seq_len];
            let class = usize::try_from(target).is_ok_and(|y| y < config.vocab);
            if padded && target != IGNORE_INDEX {
                let expected = format!("{IGNORE_INDEX} (position {} is padding)", i % self.seq_len);
                return bad(format!("targets[{i}]"), expected, target.to_string());
            }
            if !padded && !class && target != IGNORE_INDEX {
                let expected = format!(
                    "a token id below vocab = {} or {IGNORE_INDEX}",
                    config.vocab
                );
                return bad(format!("targets[{i}]"), expected, target.to_string());
            }
        }
        Ok(())
    }
}

/// The loss's gradients.
#[derive(Clone, Debug, PartialEq)]
pub struct Grads {
    /// `∂loss/∂A` and `∂loss/∂B` of every adapter, in the adapters' layout.
    pub lora: Adapters,
    /// `[T, D]`: `∂loss/∂x0`, the gradient with respect to the embedding output.
    pub d_x0: Vec<f64>,
}

/// `x0 [T, D]`: the embedding of every token of the batch.
pub fn embed(
    config: &ModelConfig,
    weights: &Weights,
    batch: &Batch,
) -> Result<Vec<f64>, ModelError> {
    config.check()?;
    weights.check(config)?;
    batch.check(config)?;
    let d = config.dim;
    Ok(batch
        .tokens
        .iter()
        .flat_map(|&id| &weights.embed[id as usize * d..][..d])
        .copied()
        .collect())
}

/// The mean cross-entropy of the batch.
pub fn loss(
    config: &ModelConfig,
    lora: &LoraConfig,
    weights: &Weights,
    adapters: &Adapters,
    batch: &Batch,
) -> Result<f64, ModelError> {
    let x0 = embed(config, weights, batch)?;
    loss_from_embeddings(config, lora, weights, adapters, batch, &x0)
}

/// The mean cross-entropy of the batch with `x0 [T, D]` in place of its embedding: the loss as
/// a function of the embedding output, whose gradient is [`Grads::d_x0`].
pub fn loss_from_embeddings(
    config: &ModelConfig,
    lora: &LoraConfig,
    weights: &Weights,
    adapters: &Adapters,
    batch: &Batch,
    x0: &[f64],
) -> Result<f64, ModelError> {
    let mut tape = Tape::new();
    let graph = record(&mut tape, (config, lora, weights, adapters, batch), x0)?;
    Ok(tape.value(graph.loss)[0])
}

/// `[T, V]`: the logits of every position of the batch (its targets unused).
pub fn logits(
    config: &ModelConfig,
    lora: &LoraConfig,
    weights: &Weights,
    adapters: &Adapters,
    batch: &Batch,
) -> Result<Vec<f64>, ModelError> {
    let x0 = embed(config, weights, batch)?;
    let mut tape = Tape::new();
    let graph = record(&mut tape, (config, lora, weights, adapters, batch), &x0)?;
    Ok(tape.value(graph.logits).to_vec())
}

/// The mean cross-entropy of the batch and its gradients.
pub fn loss_and_grads(
    config: &ModelConfig,
    lora: &LoraConfig,
    weights: &Weights,
    adapters: &Adapters,
    batch: &Batch,
) -> Result<(f64, Grads), ModelError> {
    let x0 = embed(config, weights, batch)?;
    let mut tape = Tape::new();
    let graph = record(&mut tape, (config, lora, weights, adapters, batch), &x0)?;
    let mut grads = tape.backward(graph.loss);
    let mut lora_grads = adapters.clone();
    for (adapter, (a, b)) in lora_grads.adapters.iter_mut().zip(graph.adapters) {
        adapter.a = grads.take(a);
        adapter.b = grads.take(b);
    }
    let grads = Grads {
        lora: lora_grads,
        d_x0: grads.take(graph.x0),
    };
    Ok((tape.value(graph.loss)[0], grads))
}

/// What a recorded forward's leaves and root are.
struct Graph {
    x0: Var,
    /// `(A, B)` of each adapter, in the adapters' order.
    adapters: Vec<(Var, Var)>,
    logits: Var,
    loss: Var,
}

type Model<'a> = (
    &'a ModelConfig,
    &'a LoraConfig,
    &'a Weights,
    &'a Adapters,
    &'a Batch,
);

/// Check everything, then record the forward of KERNELS.md on `tape`.
fn record<'a>(tape: &mut Tape<'a>, model: Model<'a>, x0: &[f64]) -> Result<Graph, ModelError> {
    let (config, lora, weights, adapters, batch) = model;
    config.check()?;
    lora.check()?;
    weights.check(config)?;
    adapters.check(config, lora)?;
    batch.check(config)?;
    if x0.len() != batch.positions() * config.dim {
        let expected = format!("[T, D] = {} elements", batch.positions() * config.dim);
        return Err(ModelError::invalid("Batch", "x0", expected, x0.len()));
    }
    let r = lora.rank;
    let x0 = tape.leaf(x0.to_vec(), config.dim);
    let leaves: Vec<(Var, Var)> = adapters
        .adapters
        .iter()
        .map(|a| {
            (
                tape.leaf(a.a.clone(), a.a.len() / r),
                tape.leaf(a.b.clone(), r),
            )
        })
        .collect();
    let mut x = x0;
    for (i, layer) in weights.layers.iter().enumerate() {
        let lora_leaves = adapters.iter().zip(&leaves);
        let block = Block {
            config,
            layer,
            scale: lora.scale(),
            lora: lora_leaves
                .filter(|((l, ..), _)| *l == i)
                .map(|((_, p, _), &(a, b))| (p, a, b))
                .collect(),
        };
        x = block.record(tape, x, batch);
    }
    let n = tape.rms_norm(x, &weights.final_norm, config.norm_eps);
    let logits = tape.frozen(n, weights.head());
    let loss = tape.cross_entropy(logits, &batch.targets);
    Ok(Graph {
        x0,
        adapters: leaves,
        logits,
        loss,
    })
}

/// One block's forward.
struct Block<'a> {
    config: &'a ModelConfig,
    layer: &'a LayerWeights,
    scale: f64,
    /// The `A` and `B` leaves of each targeted projection.
    lora: Vec<(Projection, Var, Var)>,
}

impl<'a> Block<'a> {
    /// `x·Wᵀ (+ bias) + s·(x·Aᵀ)·Bᵀ`, the LoRA term where LoRA targets the projection.
    fn project(&self, tape: &mut Tape<'a>, x: Var, p: Projection, bias: Option<&'a [f64]>) -> Var {
        let mut y = tape.frozen(x, self.layer.projection(p));
        if let Some(bias) = bias {
            y = tape.bias(y, bias);
        }
        if let Some(&(_, a, b)) = self.lora.iter().find(|(target, ..)| *target == p) {
            let h = tape.matmul_nt(x, a);
            let delta = tape.matmul_nt(h, b);
            let delta = tape.scale(delta, self.scale);
            y = tape.add(y, delta);
        }
        y
    }

    /// `x2` of `x0` (KERNELS.md "Forward of one block").
    fn record(&self, tape: &mut Tape<'a>, x0: Var, batch: &'a Batch) -> Var {
        let (c, w) = (self.config, self.layer);
        let eps = c.norm_eps;
        // Present exactly for the family that uses it (`Weights::check`).
        let extra = |v: &'a Option<Vec<f64>>| v.as_deref();
        let n1 = tape.rms_norm(x0, &w.attn_norm, eps);
        let mut q = self.project(tape, n1, Projection::Q, extra(&w.q_bias));
        let mut k = self.project(tape, n1, Projection::K, extra(&w.k_bias));
        let v = self.project(tape, n1, Projection::V, extra(&w.v_bias));
        if let (Some(q_norm), Some(k_norm)) = (extra(&w.q_norm), extra(&w.k_norm)) {
            q = tape.rms_norm(q, q_norm, eps);
            k = tape.rms_norm(k, k_norm, eps);
        }
        let q = tape.rope(q, c.head_dim, batch.seq_len, c.rope_base);
        let k = tape.rope(k, c.head_dim, batch.seq_len, c.rope_base);
        let shape = AttentionShape {
            batch: batch.batch,
            seq_len: batch.seq_len,
            heads: c.heads,
            kv_heads: c.kv_heads,
            head_dim: c.head_dim,
        };
        let mut o = tape.attention((q, k, v), shape, &batch.lens);
        if let Some(gamma) = extra(&w.attn_sub_norm) {
            o = tape.rms_norm(o, gamma, eps);
        }
        let attn = self.project(tape, o, Projection::O, None);
        let x1 = tape.add(x0, attn);
        let n2 = tape.rms_norm(x1, &w.ffn_norm, eps);
        let g = self.project(tape, n2, Projection::Gate, None);
        let u = self.project(tape, n2, Projection::Up, None);
        let h = match extra(&w.ffn_sub_norm) {
            Some(gamma) => {
                let h = tape.relu_sqr_mul(g, u);
                tape.rms_norm(h, gamma, eps)
            }
            None => tape.swiglu(g, u),
        };
        let ffn = self.project(tape, h, Projection::Down, None);
        tape.add(x1, ffn)
    }
}
