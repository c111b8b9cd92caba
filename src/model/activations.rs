//! Every buffer a training step uses, allocated once per step shape ([`StepBuffers::new`]) and
//! reused by every step of that shape: nothing allocates while a step is recorded.
//!
//! Sizes, with `T = B·S` tokens of one micro-batch, `M` micro-batches, `Hq = H·hd`,
//! `Hkv = KV·hd`, `C` the loss chunk's tokens (per layer, saved for the backward, in `f32`s):
//! `x, n1, x1, n2: [T, D]`, `q, o: [T, Hq]`, `k, v: [T, Hkv]` (`q`, `k`, `v` views of one
//! block-major `[q | k | v]` where they can start views), `gate, up, h: [T, I]` (`h` in f16 where
//! [`Hidden::step_in_half`]), `lse: [T, H]`,
//! two `rstd: [T]`, one `h_lora: [T, r]` per adapted projection (gate and up as one `[T, 2I]`
//! of rows of gate then up where the model packs them); Qwen3 adds the un-normed
//! `q, k` and their `rstd`s, BitNet the sub-norms' outputs `[T, Hq]`, `[T, I]` and `rstd`s. The
//! workspace (one for all layers) holds the gradients of one layer's activations, the loss's
//! chunk `[C, V]` logits and their gradient, and the batch's inputs.

use hesper_exec::half::f16;
use hesper_exec::{Gpu, GpuBuffer};
use hesper_kernels::attention::{SeqShape, ValidLengths, scores_workspace_len};
use hesper_kernels::linear::split::gemm_split_scratch_len;
use hesper_kernels::linear::{GemmPath, HalfBuffers, Precision, Product, gemm_path};
use hesper_kernels::lora::lora_scratch_len;
use hesper_kernels::loss::STATS_PER_TOKEN;
use hesper_kernels::optim::grad_norm_partials_len;

use super::config::{Family, LoraConfig, ModelConfig, ModelError, Projection};
use super::gpu::{Frozen, GpuAdapters, GpuModel};
use super::reference::{Batch, IGNORE_INDEX};

/// The shape a step's buffers are made for: `micro_batches` micro-batches of `batch`
/// sequences of `seq_len` positions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepShape {
    pub batch: usize,
    pub seq_len: usize,
    /// Gradient accumulation: the step's gradient is that of the mean loss over the targets of
    /// all its micro-batches.
    pub micro_batches: usize,
    /// The lm-head and cross-entropy run over chunks of this many tokens, so that only a
    /// `[chunk, V]` block of logits exists at once (1024 at V = 49 152 is 201 MB).
    pub loss_chunk: usize,
    /// Gradient checkpointing (Hugging Face's `gradient_checkpointing`): keep only each
    /// block's input and recompute the block's forward just before its backward, trading one
    /// more forward for one block's activations in place of `L` blocks'.
    pub recompute: bool,
}

impl StepShape {
    /// One micro-batch, the loss in chunks of 1024 tokens.
    pub fn new(batch: usize, seq_len: usize) -> StepShape {
        StepShape {
            batch,
            seq_len,
            micro_batches: 1,
            loss_chunk: 1024,
            recompute: false,
        }
    }

    /// `T = B·S`: the tokens of one micro-batch.
    pub fn tokens(&self) -> usize {
        self.batch * self.seq_len
    }

    /// The attention's shape in a step of this shape for a model of `config` at `precision`.
    pub(crate) fn attention(&self, config: &ModelConfig, precision: Precision) -> SeqShape {
        let c = config;
        SeqShape::new(self.batch, self.seq_len, c.heads, c.kv_heads, c.head_dim)
            .with_precision(precision)
    }

    fn check(&self, config: &ModelConfig) -> Result<(), ModelError> {
        let bad = |field: &str, expected: String, given: usize| {
            Err(ModelError::invalid("StepShape", field, expected, given))
        };
        for (field, size) in [
            ("batch", self.batch),
            ("seq_len", self.seq_len),
            ("micro_batches", self.micro_batches),
            ("loss_chunk", self.loss_chunk),
        ] {
            if size == 0 {
                return bad(field, "positive".into(), size);
            }
        }
        if self.seq_len > config.max_seq {
            return bad(
                "seq_len",
                format!("at most max_seq = {}", config.max_seq),
                self.seq_len,
            );
        }
        // The widest activation row, and the loss chunk's logits.
        let widest = config
            .ffn_dim
            .max(config.dim)
            .max(config.heads * config.head_dim);
        let fits = |n: Option<usize>| n.is_some_and(|n| n <= u32::MAX as usize);
        let activations = self
            .tokens()
            .checked_mul(self.micro_batches)
            .and_then(|t| t.checked_mul(widest));
        let logits = self.loss_chunk.min(self.tokens()).checked_mul(config.vocab);
        if !fits(logits) {
            return bad(
                "loss_chunk",
                format!(
                    "a chunk whose [chunk, V = {}] logits fit u32 indices",
                    config.vocab
                ),
                self.loss_chunk,
            );
        }
        if !fits(activations) {
            return bad(
                "batch",
                "a size whose activations fit u32 indices".into(),
                self.batch,
            );
        }
        Ok(())
    }
}

/// One block's activations saved by the forward for the backward.
pub(crate) struct LayerActivations {
    /// The block's input `[T, D]`.
    pub(crate) x: GpuBuffer<f32>,
    pub(crate) rstd1: GpuBuffer<f32>,
    pub(crate) n1: GpuBuffer<f32>,
    /// Qwen3: `Q` and `K` before their per-head norms, and the norms' `rstd` (`[T·H]`, `[T·KV]`).
    pub(crate) q_pre: Option<GpuBuffer<f32>>,
    pub(crate) k_pre: Option<GpuBuffer<f32>>,
    pub(crate) rstd_q: Option<GpuBuffer<f32>>,
    pub(crate) rstd_k: Option<GpuBuffer<f32>>,
    /// `Q`, `K` rotated, `V`.
    pub(crate) q: GpuBuffer<f32>,
    pub(crate) k: GpuBuffer<f32>,
    pub(crate) v: GpuBuffer<f32>,
    /// `[q | k | v]` block-major: the allocation `q`, `k` and `v` are views of, for the forward's
    /// one GEMM over `[W_q; W_k; W_v]`; `None` with a q/k norm (Qwen3: the GEMM's outputs are
    /// then `q_pre` and `k_pre`) or where `k` or `v` could not start a view (three allocations).
    pub(crate) qkv: Option<GpuBuffer<f32>>,
    pub(crate) o: GpuBuffer<f32>,
    pub(crate) lse: GpuBuffer<f32>,
    /// BitNet: the attention output's sub-norm and its `rstd`.
    pub(crate) o_sub: Option<GpuBuffer<f32>>,
    pub(crate) rstd_o: Option<GpuBuffer<f32>>,
    pub(crate) x1: GpuBuffer<f32>,
    pub(crate) rstd2: GpuBuffer<f32>,
    pub(crate) n2: GpuBuffer<f32>,
    pub(crate) gate_up: GateUp,
    /// The FFN's `h = act(gate)·up`; BitNet's sub-norm of it and its `rstd`.
    pub(crate) h: Hidden,
    pub(crate) h_sub: Option<GpuBuffer<f32>>,
    pub(crate) rstd_h: Option<GpuBuffer<f32>>,
    /// `x·Aᵀ` `[T, r]` of each adapted projection, in the LoRA config's order.
    pub(crate) lora_h: Vec<GpuBuffer<f32>>,
}

/// The FFN's gate and up projections' outputs (or their gradients): two `[T, I]` arrays, or one
/// `[T, 2I]` of rows of gate then up where the step (and decoding) computes both in one GEMM
/// ([`GpuModel::packs_gate_up`](super::GpuModel::packs_gate_up)), in f16 where a
/// mixed-precision step keeps them so ([`GateUp::step_layout`]).
pub(crate) enum GateUp {
    Apart {
        gate: GpuBuffer<f32>,
        up: GpuBuffer<f32>,
    },
    Packed(GpuBuffer<f32>),
    /// `[T, 2I]` in f16: the GEMM's output rounded as PyTorch's autocast rounds it (to bf16
    /// there), half the bytes written, saved and read; the gradient scaled by
    /// `2^grad_exponent` (`ffn::execute_swiglu_packed_backward_f16`), as the tensor-core GEMM
    /// that reads it would have scaled it.
    PackedHalf(GpuBuffer<f16>),
}

/// The FFN's `h` `[T, I]`, the down projection's input.
pub(crate) enum Hidden {
    F32(GpuBuffer<f32>),
    /// Rounded to f16 as SwiGLU stores it (`ffn::execute_swiglu_packed_forward_half`): the
    /// value the down projection's tensor-core GEMM rounded it to as it read it, at half the
    /// bytes written and read. Where [`Hidden::step_in_half`].
    F16(GpuBuffer<f16>),
}

impl Hidden {
    /// Whether a step keeps `h` in f16: where gate and up are [`GateUpLayout::PackedHalf`]
    /// (the SwiGLU that writes `h` reads f16), LoRA does not adapt the down projection (its
    /// adapter reads `h` in f32, and so does its weight gradient), and the down projection's
    /// GEMM with an f16 input runs on the tensor cores (which rounded an f32 `h` the same way).
    pub(crate) fn step_in_half(
        gpu: &Gpu,
        model: &GpuModel,
        lora: &LoraConfig,
        (tokens, gate_up): (usize, GateUpLayout),
    ) -> bool {
        if gate_up != GateUpLayout::PackedHalf || lora.targets.contains(&Projection::Down) {
            return false;
        }
        let c = model.config();
        let down = match model.layers.first() {
            Some(layer) => layer.projection(Projection::Down),
            None => return false,
        };
        // Asked only now: with autotuning on, the path may measure tiles for this GEMM.
        let gemm = model.gemm(Product::Nt, (tokens, c.dim, c.ffn_dim), true);
        let half = HalfBuffers {
            input: true,
            ..HalfBuffers::NONE
        };
        let path = gemm_path(gpu, &gemm, &down.weights(), half);
        matches!(path, GemmPath::TensorCores { .. })
    }

    /// `h` in f32: every path but the f16 one ([`Hidden::step_in_half`]) keeps it so.
    pub(crate) fn f32(&self) -> &GpuBuffer<f32> {
        match self {
            Hidden::F32(h) => h,
            Hidden::F16(_) => unreachable!("h is in f16 only where nothing reads it in f32"),
        }
    }

    /// [`Hidden::f32`], to write.
    pub(crate) fn f32_mut(&mut self) -> &mut GpuBuffer<f32> {
        match self {
            Hidden::F32(h) => h,
            Hidden::F16(_) => unreachable!("h is in f16 only where nothing writes it in f32"),
        }
    }

    fn bytes(&self) -> u64 {
        match self {
            Hidden::F32(h) => h.bytes(),
            Hidden::F16(h) => h.bytes(),
        }
    }
}

/// How [`GateUp`] holds the gate and up.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum GateUpLayout {
    Apart,
    Packed,
    PackedHalf,
}

impl GateUp {
    /// The layout decoding gives `model`'s gate and up: packed where
    /// [`GpuModel::packs_gate_up`](super::GpuModel::packs_gate_up), in f32.
    pub(crate) fn layout(model: &GpuModel, lora: &LoraConfig) -> GateUpLayout {
        match model.packs_gate_up(lora) {
            true => GateUpLayout::Packed,
            false => GateUpLayout::Apart,
        }
    }

    /// The layout a step over `tokens` gives them: [`GateUp::layout`]'s, in f16 where the
    /// packed GEMM runs on the tensor cores (which round its output's readers' inputs to f16
    /// anyway); elsewhere `Precision::F16` keeps the f32 GEMM's exactness, and f32 buffers.
    pub(crate) fn step_layout(
        gpu: &Gpu,
        model: &GpuModel,
        lora: &LoraConfig,
        tokens: usize,
    ) -> GateUpLayout {
        let c = model.config();
        let merged = model.layers.first().and_then(|l| l.gate_up());
        let on_tensor_cores = |merged: &Frozen| {
            let gemm = model.gemm(Product::Nt, (tokens, 2 * c.ffn_dim, c.dim), false);
            let half = HalfBuffers {
                output: true,
                ..HalfBuffers::NONE
            };
            let path = gemm_path(gpu, &gemm, &merged.weights(), half);
            gpu.supports_f16() && matches!(path, GemmPath::TensorCores { .. })
        };
        match (GateUp::layout(model, lora), merged) {
            (GateUpLayout::Packed, Some(merged)) if on_tensor_cores(merged) => {
                GateUpLayout::PackedHalf
            }
            (layout, _) => layout,
        }
    }

    /// `[T, I]` twice, or packed as one `[T, 2I]`, zeroed.
    pub(crate) fn new(
        gpu: &Gpu,
        (tokens, ffn_dim): (usize, usize),
        layout: GateUpLayout,
    ) -> Result<GateUp, ModelError> {
        let n = tokens * ffn_dim;
        Ok(match layout {
            GateUpLayout::Packed => GateUp::Packed(gpu.zeros(2 * n)?),
            GateUpLayout::PackedHalf => GateUp::PackedHalf(gpu.zeros(2 * n)?),
            GateUpLayout::Apart => GateUp::Apart {
                gate: gpu.zeros(n)?,
                up: gpu.zeros(n)?,
            },
        })
    }

    pub(crate) fn bytes(&self) -> u64 {
        match self {
            GateUp::Apart { gate, up } => gate.bytes() + up.bytes(),
            GateUp::Packed(gate_up) => gate_up.bytes(),
            GateUp::PackedHalf(gate_up) => gate_up.bytes(),
        }
    }
}

/// The gradients of one block's activations (reused by every block) and the LoRA backward's
/// workspace.
pub(crate) struct Workspace {
    /// The residual stream's gradient, `[T, D]`: `∂loss/∂x_l` once block `l` is done.
    pub(crate) dx: GpuBuffer<f32>,
    /// The gradient of a norm's output `[T, D]` (`n1`, `n2`, the final norm).
    pub(crate) dn: GpuBuffer<f32>,
    pub(crate) d_h: GpuBuffer<f32>,
    pub(crate) d_h_sub: Option<GpuBuffer<f32>>,
    /// The gradients of the FFN's gate and up, laid out as the saved ones are.
    pub(crate) d_gate_up: GateUp,
    /// The gradient of `W_o`'s input `[T, Hq]`; BitNet's of the attention output before it.
    pub(crate) d_o: GpuBuffer<f32>,
    pub(crate) d_o_attn: Option<GpuBuffer<f32>>,
    pub(crate) stats: GpuBuffer<f32>,
    /// The tensor-core attention backward's scores' gradients (`SeqGrads::scores`), where it
    /// takes them.
    pub(crate) scores: Option<GpuBuffer<f16>>,
    pub(crate) d_q: GpuBuffer<f32>,
    pub(crate) d_k: GpuBuffer<f32>,
    pub(crate) d_v: GpuBuffer<f32>,
    /// `[d_q | d_k | d_v]` block-major: the allocation `d_q`, `d_k` and `d_v` are views of, for
    /// their input gradient in one GEMM (`linear::execute_gemm_blocks`); `None` where `d_k` or
    /// `d_v` could not start a view (then they are three allocations).
    pub(crate) d_qkv: Option<GpuBuffer<f32>>,
    pub(crate) d_q_pre: Option<GpuBuffer<f32>>,
    pub(crate) d_k_pre: Option<GpuBuffer<f32>>,
    pub(crate) lora: LoraWork,
}

/// The LoRA backward's workspace: `dh [T, r]`, a second for the query and value adapters'
/// pair where LoRA adapts both (`Ctx::lora_weight_backward_pair`), and the weight gradients'
/// partial sums (a pair's both).
pub(crate) struct LoraWork {
    pub(crate) dh: GpuBuffer<f32>,
    pub(crate) dh_pair: Option<GpuBuffer<f32>>,
    pub(crate) scratch: GpuBuffer<f32>,
}

/// The final norm, the chunked lm-head and cross-entropy, and the loss.
pub(crate) struct LossBuffers {
    /// `RMSNorm(x_L)` `[T, D]` and its `rstd`.
    pub(crate) n: GpuBuffer<f32>,
    pub(crate) rstd: GpuBuffer<f32>,
    /// One chunk: its rows of `n` `[C, D]`, logits `[C, V]` and their rows' `(lse, 1/N)` `[C, 2]`
    /// (the lm-head's backward computes their gradient as it reads them:
    /// `loss::CrossEntropyGrad`), the gradient of its rows of `n`, its labels (`−100` past the
    /// batch's end) and per-token losses.
    pub(crate) n_chunk: GpuBuffer<f32>,
    pub(crate) logits: GpuBuffer<f32>,
    pub(crate) logit_stats: GpuBuffer<f32>,
    pub(crate) d_n_chunk: GpuBuffer<f32>,
    /// The lm-head backward's split-K parts (`linear::split`; one float where it is not split).
    pub(crate) d_n_split: GpuBuffer<f32>,
    pub(crate) labels_chunk: GpuBuffer<i32>,
    pub(crate) token_loss_chunk: GpuBuffer<f32>,
    /// Every micro-batch's per-token losses `[M·T]`, `N` over all of them, and the mean.
    pub(crate) token_loss: GpuBuffer<f32>,
    pub(crate) count: GpuBuffer<u32>,
    pub(crate) loss: GpuBuffer<f32>,
}

/// The step's inputs: every micro-batch's tokens and targets `[M·T]`, and lengths.
pub(crate) struct Inputs {
    pub(crate) tokens: GpuBuffer<u32>,
    pub(crate) labels: GpuBuffer<i32>,
    /// The current micro-batch's tokens `[T]`, copied out of `tokens`.
    pub(crate) tokens_micro: GpuBuffer<u32>,
    pub(crate) lens: Vec<ValidLengths>,
}

/// Every buffer of a step of one [`StepShape`], for one model and set of adapters.
pub struct StepBuffers {
    config: ModelConfig,
    lora: LoraConfig,
    /// The model's precision: the lm-head backward's split-K scratch is sized for it.
    precision: Precision,
    pub(crate) shape: StepShape,
    /// The loss chunk's rows: `loss_chunk`, or `T` when that is fewer.
    pub(crate) chunk: usize,
    /// Every block's activations; with [`StepShape::recompute`], one block's, which every
    /// block's forward and recomputed forward fill in turn.
    pub(crate) layers: Vec<LayerActivations>,
    /// With [`StepShape::recompute`], each block's input `[T, D]` (else empty: the inputs are
    /// in `layers`).
    pub(crate) layer_inputs: Vec<GpuBuffer<f32>>,
    /// The last block's output `x_L` `[T, D]`.
    pub(crate) x_out: GpuBuffer<f32>,
    pub(crate) work: Workspace,
    pub(crate) loss: LossBuffers,
    pub(crate) inputs: Inputs,
    /// The global gradient norm's partial sums and the norm.
    pub(crate) norm_partials: GpuBuffer<f32>,
    pub(crate) grad_norm: GpuBuffer<f32>,
    /// The targets (labels other than −100) of the batches [`StepBuffers::load`] wrote last,
    /// over all micro-batches; before any, every position.
    pub(crate) targets: usize,
}

impl StepBuffers {
    /// Allocate every buffer of a step of `shape` for `model` and `adapters`.
    pub fn new(
        gpu: &Gpu,
        model: &GpuModel,
        adapters: &GpuAdapters,
        shape: StepShape,
    ) -> Result<StepBuffers, ModelError> {
        let c = model.config();
        adapters.check_model(model)?;
        shape.check(c)?;
        let t = shape.tokens();
        let (d, i, r) = (c.dim, c.ffn_dim, adapters.lora().rank);
        let (hq, hkv) = (c.heads * c.head_dim, c.kv_heads * c.head_dim);
        let (qwen3, bitnet) = (c.family == Family::Qwen3, c.family == Family::BitNet);
        let buf = |n: usize| gpu.zeros::<f32>(n);
        let opt = |on: bool, n: usize| on.then(|| buf(n)).transpose();
        let kept = if shape.recompute { 1 } else { c.layers };
        let align = gpu.wgpu_limits().min_storage_buffer_offset_alignment as usize;
        let starts_view = |floats: usize| (floats * 4).is_multiple_of(align.max(4));
        // `[q | k | v]` (or their gradients) as views of one allocation, where they can start
        // views: `(q, k, v, the allocation)`.
        let qkv_views = || -> Result<_, ModelError> {
            Ok(match starts_view(t * hq) && starts_view(t * (hq + hkv)) {
                true => {
                    let whole = buf(t * (hq + 2 * hkv))?;
                    let (q_end, k_end) = (t * hq, t * (hq + hkv));
                    let q = whole.view(gpu, 0..q_end)?;
                    let k = whole.view(gpu, q_end..k_end)?;
                    let v = whole.view(gpu, k_end..whole.len())?;
                    (q, k, v, Some(whole))
                }
                false => (buf(t * hq)?, buf(t * hkv)?, buf(t * hkv)?, None),
            })
        };
        let gate_up = GateUp::step_layout(gpu, model, adapters.lora(), t);
        let h_in_half = Hidden::step_in_half(gpu, model, adapters.lora(), (t, gate_up));
        let layers = (0..kept)
            .map(|_| {
                let (q, k, v, qkv) = match qwen3 {
                    true => (buf(t * hq)?, buf(t * hkv)?, buf(t * hkv)?, None),
                    false => qkv_views()?,
                };
                Ok(LayerActivations {
                    x: buf(t * d)?,
                    rstd1: buf(t)?,
                    n1: buf(t * d)?,
                    q_pre: opt(qwen3, t * hq)?,
                    k_pre: opt(qwen3, t * hkv)?,
                    rstd_q: opt(qwen3, t * c.heads)?,
                    rstd_k: opt(qwen3, t * c.kv_heads)?,
                    q,
                    k,
                    v,
                    qkv,
                    o: buf(t * hq)?,
                    lse: buf(t * c.heads)?,
                    o_sub: opt(bitnet, t * hq)?,
                    rstd_o: opt(bitnet, t)?,
                    x1: buf(t * d)?,
                    rstd2: buf(t)?,
                    n2: buf(t * d)?,
                    gate_up: GateUp::new(gpu, (t, i), gate_up)?,
                    h: match h_in_half {
                        true => Hidden::F16(gpu.zeros(t * i)?),
                        false => Hidden::F32(buf(t * i)?),
                    },
                    h_sub: opt(bitnet, t * i)?,
                    rstd_h: opt(bitnet, t)?,
                    lora_h: adapters
                        .lora()
                        .targets
                        .iter()
                        .map(|_| buf(t * r))
                        .collect::<Result<_, _>>()?,
                })
            })
            .collect::<Result<_, ModelError>>()?;
        let targets = &adapters.lora().targets;
        let width = |p: &Projection| {
            let (out, input) = p.shape(c);
            out + input
        };
        let paired = targets.contains(&Projection::Q) && targets.contains(&Projection::V);
        let widest = targets.iter().map(width).max().unwrap_or(0);
        let widest = match paired {
            true => widest.max(width(&Projection::Q) + width(&Projection::V)),
            false => widest,
        };
        let (d_q, d_k, d_v, d_qkv) = qkv_views()?;
        let work = Workspace {
            dx: buf(t * d)?,
            dn: buf(t * d)?,
            d_h: buf(t * i)?,
            d_h_sub: opt(bitnet, t * i)?,
            d_gate_up: GateUp::new(gpu, (t, i), gate_up)?,
            d_o: buf(t * hq)?,
            d_o_attn: opt(bitnet, t * hq)?,
            stats: buf(2 * t * c.heads)?,
            scores: scores_workspace_len(gpu, &shape.attention(c, model.precision()))
                .map(|n| gpu.zeros::<f16>(n))
                .transpose()?,
            d_q,
            d_k,
            d_v,
            d_qkv,
            d_q_pre: opt(qwen3, t * hq)?,
            d_k_pre: opt(qwen3, t * hkv)?,
            lora: LoraWork {
                dh: buf(t * r)?,
                dh_pair: paired.then(|| buf(t * r)).transpose()?,
                scratch: buf(lora_scratch_len(t, widest, r))?,
            },
        };
        let chunk = shape.loss_chunk.min(t);
        let all = t * shape.micro_batches;
        let lm_head_backward = model.gemm(Product::Nn, (chunk, c.vocab, d), false);
        let loss = LossBuffers {
            n: buf(t * d)?,
            rstd: buf(t)?,
            n_chunk: buf(chunk * d)?,
            logits: buf(chunk * c.vocab)?,
            logit_stats: buf(chunk * STATS_PER_TOKEN)?,
            d_n_chunk: buf(chunk * d)?,
            d_n_split: buf(gemm_split_scratch_len(gpu, &lm_head_backward).max(1))?,
            labels_chunk: gpu.filled(chunk, IGNORE_INDEX as i32)?,
            token_loss_chunk: buf(chunk)?,
            token_loss: buf(all)?,
            count: gpu.zeros(1)?,
            loss: buf(1)?,
        };
        let lens = (0..shape.micro_batches)
            .map(|_| ValidLengths::upload(gpu, &vec![shape.seq_len; shape.batch], shape.seq_len))
            .collect::<Result<_, _>>()?;
        let inputs = Inputs {
            tokens: gpu.zeros(all)?,
            labels: gpu.filled(all, IGNORE_INDEX as i32)?,
            tokens_micro: gpu.zeros(t)?,
            lens,
        };
        // The norm reads every gradient in one arena.
        let grads = [adapters.arenas.grads.whole.len()];
        let inputs_kept = if shape.recompute { c.layers } else { 0 };
        let layer_inputs = (0..inputs_kept)
            .map(|_| buf(t * d))
            .collect::<Result<_, _>>()?;
        Ok(StepBuffers {
            config: c.clone(),
            lora: adapters.lora().clone(),
            precision: model.precision(),
            shape,
            chunk,
            layers,
            layer_inputs,
            x_out: buf(t * d)?,
            work,
            loss,
            inputs,
            norm_partials: buf(grad_norm_partials_len(grads))?,
            grad_norm: buf(1)?,
            targets: t * shape.micro_batches,
        })
    }

    pub fn shape(&self) -> StepShape {
        self.shape
    }

    /// The model config, LoRA config and model precision these buffers were made for.
    pub(crate) fn made_for(&self) -> (&ModelConfig, &LoraConfig, Precision) {
        (&self.config, &self.lora, self.precision)
    }

    /// Write the step's micro-batches (one per [`StepShape::micro_batches`], each of the
    /// shape's `batch` and `seq_len`, checked against the model first; nothing is written
    /// on an error).
    pub fn load(
        &mut self,
        gpu: &Gpu,
        config: &ModelConfig,
        batches: &[Batch],
    ) -> Result<(), ModelError> {
        let shape = self.shape;
        if batches.len() != shape.micro_batches {
            let expected = format!("{} micro-batches (the step's shape)", shape.micro_batches);
            return Err(ModelError::invalid(
                "Batch",
                "micro-batches",
                expected,
                batches.len(),
            ));
        }
        for (m, batch) in batches.iter().enumerate() {
            batch.check(config)?;
            if (batch.batch, batch.seq_len) != (shape.batch, shape.seq_len) {
                let expected = format!(
                    "{} sequences of {} (the step's shape)",
                    shape.batch, shape.seq_len
                );
                let given = format!("{} sequences of {}", batch.batch, batch.seq_len);
                return Err(ModelError::invalid(
                    "Batch",
                    format!("micro-batch {m}"),
                    expected,
                    given,
                ));
            }
        }
        let tokens: Vec<u32> = batches
            .iter()
            .flat_map(|b| b.tokens.iter().copied())
            .collect();
        // `Batch::check` has made every target a class or −100.
        let labels: Vec<i32> = batches
            .iter()
            .flat_map(|b| b.targets.iter().map(|&y| y as i32))
            .collect();
        self.inputs.tokens.write(gpu, &tokens)?;
        self.inputs.labels.write(gpu, &labels)?;
        for (lens, batch) in self.inputs.lens.iter_mut().zip(batches) {
            lens.write(gpu, &batch.lens)?;
        }
        self.targets = labels.iter().filter(|&&y| y as i64 != IGNORE_INDEX).count();
        Ok(())
    }

    /// `[1]`: the mean cross-entropy of the last recorded step, over the targets of all its
    /// micro-batches.
    pub fn loss(&self) -> &GpuBuffer<f32> {
        &self.loss.loss
    }

    /// `[M·T]`: each position's cross-entropy (0 where the target is −100).
    pub fn token_losses(&self) -> &GpuBuffer<f32> {
        &self.loss.token_loss
    }

    /// `[1]`: the global norm of the last step's LoRA gradients, before clipping (written by
    /// the optimizer step).
    pub fn grad_norm(&self) -> &GpuBuffer<f32> {
        &self.grad_norm
    }

    /// `[T, D]`: `∂loss/∂x0` of the last micro-batch, the gradient at the embedding output.
    pub fn d_embeddings(&self) -> &GpuBuffer<f32> {
        &self.work.dx
    }

    /// Bytes of GPU memory these buffers take: the saved activations, the workspace, the
    /// loss's chunk and the inputs.
    pub fn memory_bytes(&self) -> u64 {
        let sum = |bufs: &mut dyn Iterator<Item = Option<&GpuBuffer<f32>>>| {
            bufs.flatten().map(GpuBuffer::bytes).sum::<u64>()
        };
        let layer = |l: &LayerActivations| {
            let fixed = [
                &l.x, &l.rstd1, &l.n1, &l.q, &l.k, &l.v, &l.o, &l.lse, &l.x1, &l.rstd2, &l.n2,
            ];
            let extra = [
                &l.q_pre, &l.k_pre, &l.rstd_q, &l.rstd_k, &l.o_sub, &l.rstd_o, &l.h_sub, &l.rstd_h,
            ];
            sum(&mut fixed.into_iter().map(Some))
                + sum(&mut extra.into_iter().map(Option::as_ref))
                + sum(&mut l.lora_h.iter().map(Some))
                + l.gate_up.bytes()
                + l.h.bytes()
        };
        let w = &self.work;
        let work = [
            &w.dx,
            &w.dn,
            &w.d_h,
            &w.d_o,
            &w.stats,
            &w.d_q,
            &w.d_k,
            &w.d_v,
            &w.lora.dh,
            &w.lora.scratch,
        ];
        let work_extra = [
            &w.d_h_sub,
            &w.d_o_attn,
            &w.d_q_pre,
            &w.d_k_pre,
            &w.lora.dh_pair,
        ];
        let l = &self.loss;
        let loss = [
            &l.n,
            &l.rstd,
            &l.n_chunk,
            &l.logits,
            &l.logit_stats,
            &l.d_n_chunk,
            &l.d_n_split,
            &l.token_loss_chunk,
            &l.token_loss,
            &l.loss,
        ];
        self.layers.iter().map(layer).sum::<u64>()
            + self.layer_inputs.iter().map(GpuBuffer::bytes).sum::<u64>()
            + self.x_out.bytes()
            + sum(&mut work.into_iter().map(Some))
            + w.d_gate_up.bytes()
            + w.scores.as_ref().map_or(0, GpuBuffer::bytes)
            + sum(&mut work_extra.into_iter().map(Option::as_ref))
            + sum(&mut loss.into_iter().map(Some))
            + l.labels_chunk.bytes()
            + self.inputs.tokens.bytes() * 2
            + self.inputs.labels.bytes()
    }
}

/// Where a projection of a block reads its input from.
pub(crate) fn projection_input(layer: &LayerActivations, p: Projection) -> &GpuBuffer<f32> {
    match p {
        Projection::Q | Projection::K | Projection::V => &layer.n1,
        Projection::O => layer.o_sub.as_ref().unwrap_or(&layer.o),
        Projection::Gate | Projection::Up => &layer.n2,
        Projection::Down => layer.h_sub.as_ref().unwrap_or_else(|| layer.h.f32()),
    }
}

/// Where [`record_logits`](super::record_logits) puts the logits of `rows` positions: their
/// rows of the final norm's output `[rows, D]` and the logits `[rows, V]`.
pub struct LogitsBuffers {
    pub(crate) rows: usize,
    pub(crate) vocab: usize,
    pub(crate) n: GpuBuffer<f32>,
    pub(crate) logits: GpuBuffer<f32>,
}

impl LogitsBuffers {
    /// Buffers for the logits of `rows` positions of `config`'s vocabulary.
    pub fn new(gpu: &Gpu, config: &ModelConfig, rows: usize) -> Result<LogitsBuffers, ModelError> {
        if rows == 0 {
            return Err(ModelError::invalid("LogitsBuffers", "rows", "positive", 0));
        }
        Ok(LogitsBuffers {
            rows,
            vocab: config.vocab,
            n: gpu.zeros(rows * config.dim)?,
            logits: gpu.zeros(rows * config.vocab)?,
        })
    }

    /// `[rows, V]`: the logits the last [`record_logits`](super::record_logits) wrote.
    pub fn logits(&self) -> &GpuBuffer<f32> {
        &self.logits
    }
}
