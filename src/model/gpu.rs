//! The model on the GPU: the frozen weights in f32, or their projections in f16 for the
//! mixed-precision step ([`GpuModel`]), and the LoRA adapters with their gradients and AdamW
//! state ([`GpuAdapters`]), uploaded from and read back to the host arrays of
//! [`reference`](super::reference).

use hesper_exec::half::f16;
use hesper_exec::{Gpu, GpuBuffer, PendingRead};
use hesper_kernels::linear::{Gemm, Precision, Product, Weights as GemmWeights};
use hesper_kernels::rope::RopeTable;

use super::config::{Family, LoraConfig, ModelConfig, ModelError, Projection};
use super::reference::{Adapter, Adapters, LayerWeights, Weights};

/// An adapter's `A` and `B` on their way to the host.
type Reads = (PendingRead<f32>, PendingRead<f32>);

/// f64 host values as the f32 the GPU computes with.
fn f32s(values: &[f64]) -> Vec<f32> {
    values.iter().map(|&v| v as f32).collect()
}

fn upload(gpu: &Gpu, values: &[f64]) -> Result<GpuBuffer<f32>, ModelError> {
    Ok(gpu.upload(&f32s(values))?)
}

fn upload_option(
    gpu: &Gpu,
    values: &Option<Vec<f64>>,
) -> Result<Option<GpuBuffer<f32>>, ModelError> {
    values.as_deref().map(|v| upload(gpu, v)).transpose()
}

/// An error unless `values` (`what` in it) fit `precision`: f16's range is ±65 504.
fn check_range(what: &str, values: &[f64], precision: Precision) -> Result<(), ModelError> {
    let max = f64::from(f16::MAX);
    match values.iter().find(|v| v.is_nan() || v.abs() > max) {
        Some(v) if precision == Precision::F16 => Err(ModelError::invalid(
            "GpuModel",
            what,
            "values within f16's range (±65504) for Precision::F16",
            v,
        )),
        _ => Ok(()),
    }
}

/// A frozen matrix a GEMM reads: f32, or f16 (half the memory) in a mixed-precision model.
pub(crate) enum Frozen {
    F32(GpuBuffer<f32>),
    F16(GpuBuffer<f16>),
}

impl Frozen {
    /// `values` (`what` in errors) as `precision` holds them: f16 is rounded to nearest, and a
    /// value beyond its range (±65 504) is an error rather than an infinity in every product.
    fn upload(
        gpu: &Gpu,
        what: &str,
        values: &[f64],
        precision: Precision,
    ) -> Result<Frozen, ModelError> {
        check_range(what, values, precision)?;
        match precision {
            Precision::F32 => Ok(Frozen::F32(upload(gpu, values)?)),
            Precision::F16 => {
                let halves: Vec<f16> = values.iter().map(|&v| f16::from_f64(v)).collect();
                Ok(Frozen::F16(gpu.upload(&halves)?))
            }
        }
    }

    /// Elements `range` of the matrix, in its allocation ([`GpuBuffer::view`]).
    fn view(&self, gpu: &Gpu, range: std::ops::Range<usize>) -> Result<Frozen, ModelError> {
        Ok(match self {
            Frozen::F32(w) => Frozen::F32(w.view(gpu, range)?),
            Frozen::F16(w) => Frozen::F16(w.view(gpu, range)?),
        })
    }

    /// The matrix as a GEMM's weights.
    pub(crate) fn weights(&self) -> GemmWeights<'_> {
        match self {
            Frozen::F32(w) => GemmWeights::Dense(w),
            Frozen::F16(w) => GemmWeights::Half { w, scale: 1.0 },
        }
    }

    /// `scale` times the matrix, as a GEMM's weights.
    pub(crate) fn scaled_weights(&self, scale: f32) -> GemmWeights<'_> {
        match self {
            Frozen::F32(w) => GemmWeights::ScaledDense { w, scale },
            Frozen::F16(w) => GemmWeights::Half { w, scale },
        }
    }

    fn bytes(&self) -> u64 {
        match self {
            Frozen::F32(w) => w.bytes(),
            Frozen::F16(w) => w.bytes(),
        }
    }
}

/// One block's frozen weights on the GPU (the fields of [`LayerWeights`]).
pub(crate) struct GpuLayer {
    pub(crate) attn_norm: GpuBuffer<f32>,
    /// `W_q, W_k, W_v, W_o, W_gate, W_up, W_down`, in [`Projection::ALL`]'s order.
    projections: [Frozen; 7],
    /// `[W_gate; W_up]` `[2I, D]`: one allocation of which `W_gate` and `W_up` above are views,
    /// so that the step computes both projections in one GEMM. `None` where the device cannot
    /// bind `W_up` where it starts (`I·D` elements not a multiple of its storage-binding
    /// alignment): then they are two allocations.
    gate_up: Option<Frozen>,
    /// `[W_q; W_k; W_v]` `[Hq + 2·Hkv, D]` the same way: one allocation of which the three are
    /// views, so that the step's input gradient through them is one GEMM
    /// (`linear::execute_gemm_blocks`). `None` where `W_k` or `W_v` could not start a view.
    qkv: Option<Frozen>,
    pub(crate) ffn_norm: GpuBuffer<f32>,
    pub(crate) q_bias: Option<GpuBuffer<f32>>,
    pub(crate) k_bias: Option<GpuBuffer<f32>>,
    pub(crate) v_bias: Option<GpuBuffer<f32>>,
    pub(crate) q_norm: Option<GpuBuffer<f32>>,
    pub(crate) k_norm: Option<GpuBuffer<f32>>,
    pub(crate) attn_sub_norm: Option<GpuBuffer<f32>>,
    pub(crate) ffn_sub_norm: Option<GpuBuffer<f32>>,
}

impl GpuLayer {
    fn upload(
        gpu: &Gpu,
        (layer, w): (usize, &LayerWeights),
        precision: Precision,
    ) -> Result<GpuLayer, ModelError> {
        let what = |p: Projection| format!("layers[{layer}].{p:?}");
        let (gate, up) = (w.projection(Projection::Gate), w.projection(Projection::Up));
        let elem = match precision {
            Precision::F32 => 4,
            Precision::F16 => 2,
        };
        // `W_up`'s start must be one a view can start at, and `W_gate`'s end one it can end at.
        let align = (gpu.wgpu_limits().min_storage_buffer_offset_alignment as usize).max(16);
        let gate_up = if (gate.len() * elem).is_multiple_of(align) && gate.len() == up.len() {
            check_range(&what(Projection::Gate), gate, precision)?;
            check_range(&what(Projection::Up), up, precision)?;
            let what = format!("layers[{layer}].[Gate; Up]");
            Some(Frozen::upload(gpu, &what, &[gate, up].concat(), precision)?)
        } else {
            None
        };
        let (q, k, v) = (
            w.projection(Projection::Q),
            w.projection(Projection::K),
            w.projection(Projection::V),
        );
        let starts_view = |elements: usize| (elements * elem).is_multiple_of(align);
        let qkv = if starts_view(q.len()) && starts_view(q.len() + k.len()) {
            for (p, values) in [(Projection::Q, q), (Projection::K, k), (Projection::V, v)] {
                check_range(&what(p), values, precision)?;
            }
            let what = format!("layers[{layer}].[Q; K; V]");
            Some(Frozen::upload(gpu, &what, &[q, k, v].concat(), precision)?)
        } else {
            None
        };
        let mut projections = Vec::with_capacity(7);
        for p in Projection::ALL {
            let n = gate.len();
            let (qk, qkv_len) = (q.len() + k.len(), q.len() + k.len() + v.len());
            let frozen = match (p, &gate_up, &qkv) {
                (Projection::Gate, Some(merged), _) => merged.view(gpu, 0..n)?,
                (Projection::Up, Some(merged), _) => merged.view(gpu, n..2 * n)?,
                (Projection::Q, _, Some(merged)) => merged.view(gpu, 0..q.len())?,
                (Projection::K, _, Some(merged)) => merged.view(gpu, q.len()..qk)?,
                (Projection::V, _, Some(merged)) => merged.view(gpu, qk..qkv_len)?,
                _ => Frozen::upload(gpu, &what(p), w.projection(p), precision)?,
            };
            projections.push(frozen);
        }
        Ok(GpuLayer {
            attn_norm: upload(gpu, &w.attn_norm)?,
            projections: projections.try_into().ok().expect("seven projections"),
            gate_up,
            qkv,
            ffn_norm: upload(gpu, &w.ffn_norm)?,
            q_bias: upload_option(gpu, &w.q_bias)?,
            k_bias: upload_option(gpu, &w.k_bias)?,
            v_bias: upload_option(gpu, &w.v_bias)?,
            q_norm: upload_option(gpu, &w.q_norm)?,
            k_norm: upload_option(gpu, &w.k_norm)?,
            attn_sub_norm: upload_option(gpu, &w.attn_sub_norm)?,
            ffn_sub_norm: upload_option(gpu, &w.ffn_sub_norm)?,
        })
    }

    /// The frozen weight of `projection`, `[out, in]`.
    pub(crate) fn projection(&self, projection: Projection) -> &Frozen {
        let at = Projection::ALL
            .iter()
            .position(|&p| p == projection)
            .expect("ALL holds every projection");
        &self.projections[at]
    }

    /// `[W_gate; W_up]` `[2I, D]`, where the layer holds them in one allocation.
    pub(crate) fn gate_up(&self) -> Option<&Frozen> {
        self.gate_up.as_ref()
    }

    /// `[W_q; W_k; W_v]` `[Hq + 2·Hkv, D]`, where the layer holds them in one allocation.
    pub(crate) fn qkv(&self) -> Option<&Frozen> {
        self.qkv.as_ref()
    }

    /// The bias of `projection`, where the family has one (Qwen2's Q, K, V).
    pub(crate) fn bias(&self, projection: Projection) -> Option<&GpuBuffer<f32>> {
        match projection {
            Projection::Q => self.q_bias.as_ref(),
            Projection::K => self.k_bias.as_ref(),
            Projection::V => self.v_bias.as_ref(),
            _ => None,
        }
    }
}

/// A model's frozen weights on the GPU, with its config and RoPE table: what every step reads
/// and none writes.
pub struct GpuModel {
    config: ModelConfig,
    precision: Precision,
    pub(crate) embed: GpuBuffer<f32>,
    pub(crate) layers: Vec<GpuLayer>,
    pub(crate) final_norm: GpuBuffer<f32>,
    lm_head: Option<Frozen>,
    pub(crate) rope: RopeTable,
}

impl GpuModel {
    /// Upload `weights` in f32 (checked against `config` first; the GPU computes with their
    /// f32 roundings): the reference precision. The GPU step also needs `head_dim` to be a
    /// multiple of 4 and at most 128 (its attention kernels' rule), checked here.
    pub fn upload(
        gpu: &Gpu,
        config: &ModelConfig,
        weights: &Weights,
    ) -> Result<GpuModel, ModelError> {
        GpuModel::upload_with_precision(gpu, config, weights, Precision::F32)
    }

    /// [`GpuModel::upload`] at a precision. [`Precision::F16`] is mixed precision, as bf16
    /// training is in PyTorch: the projections and an untied lm-head held in f16 (rounded to
    /// nearest: half the memory; a weight beyond f16's ±65 504 is an error), and every GEMM of
    /// the step at [`Precision::F16`] (its f32 inputs rounded to f16 on the tensor cores, where
    /// the device has them, products summed in f32). The embedding (which the lookup reads, and
    /// the tied lm-head), norms, attention, softmax, loss, LoRA and the optimizer stay f32. It
    /// needs `SHADER_F16` (`GpuOptions::shader_f16`).
    ///
    /// Activations stay f32 between kernels; only a GEMM's copy of its input is f16. An
    /// activation beyond ±65 504 becomes an infinity there, the loss or a gradient is then not
    /// finite, and the optimizer step skips the update ([`record_optimizer_step`]; the trainer
    /// reports it as a skipped step).
    ///
    /// [`record_optimizer_step`]: super::record_optimizer_step
    pub fn upload_with_precision(
        gpu: &Gpu,
        config: &ModelConfig,
        weights: &Weights,
        precision: Precision,
    ) -> Result<GpuModel, ModelError> {
        config.check()?;
        if precision == Precision::F16 && !gpu.supports_f16() {
            return Err(ModelError::invalid(
                "GpuModel",
                "precision",
                "Precision::F32 on a Gpu without SHADER_F16 (which WebGPU limits leave out)",
                format!("{precision:?} on `{}`", gpu.adapter_info().name),
            ));
        }
        let hd = config.head_dim;
        if !hd.is_multiple_of(4) || hd > hesper_kernels::attention::sequence::MAX_HEAD_DIM {
            return Err(ModelError::invalid(
                "ModelConfig",
                "head_dim",
                "a multiple of 4, at most 128 (the GPU attention kernels)",
                hd,
            ));
        }
        weights.check(config)?;
        let layers = weights
            .layers
            .iter()
            .enumerate()
            .map(|w| GpuLayer::upload(gpu, w, precision))
            .collect::<Result<_, _>>()?;
        Ok(GpuModel {
            config: config.clone(),
            precision,
            embed: upload(gpu, &weights.embed)?,
            layers,
            final_norm: upload(gpu, &weights.final_norm)?,
            lm_head: weights
                .lm_head
                .as_deref()
                .map(|h| Frozen::upload(gpu, "lm_head", h, precision))
                .transpose()?,
            rope: RopeTable::new(gpu, hd, config.rope_base, config.max_seq)?,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The precision the model was uploaded at, which its GEMMs run at.
    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// The matrix the logits are `n·Wᵀ` of (`[V, D]`): the head, or the tied embedding.
    pub(crate) fn head(&self) -> GemmWeights<'_> {
        match &self.lm_head {
            Some(head) => head.weights(),
            None => GemmWeights::Dense(&self.embed),
        }
    }

    /// A GEMM through one of the model's frozen matrices (`W: [n, k]`, `m` rows) at the
    /// model's precision.
    pub(crate) fn gemm(
        &self,
        product: Product,
        dims: (usize, usize, usize),
        accumulate: bool,
    ) -> Gemm {
        Gemm::new(product, dims, accumulate).with_precision(self.precision)
    }

    /// Whether the step computes the FFN's gate and up projections in one GEMM over
    /// `[W_gate; W_up]`, into rows of gate then up (`ffn::execute_swiglu_packed_*`): where every
    /// layer holds them in one allocation, the FFN is SwiGLU (BitNet's ReLU² has no packed
    /// kernel), `I` is a multiple of 4 (the packed kernels' vec4s), and `lora` adapts neither
    /// (its up-projection would add to half of each row).
    pub(crate) fn packs_gate_up(&self, lora: &LoraConfig) -> bool {
        let c = &self.config;
        self.layers.iter().all(|l| l.gate_up.is_some())
            && c.family != Family::BitNet
            && c.ffn_dim.is_multiple_of(4)
            && !lora
                .targets
                .iter()
                .any(|p| matches!(p, Projection::Gate | Projection::Up))
    }

    /// Bytes of GPU memory the frozen weights take (`[W_gate; W_up]` and `[W_q; W_k; W_v]`
    /// once: their projections are views of them).
    pub fn memory_bytes(&self) -> u64 {
        let layer = |l: &GpuLayer| {
            let extras = [
                &l.q_bias,
                &l.k_bias,
                &l.v_bias,
                &l.q_norm,
                &l.k_norm,
                &l.attn_sub_norm,
                &l.ffn_sub_norm,
            ];
            l.projections.iter().map(Frozen::bytes).sum::<u64>()
                + l.attn_norm.bytes()
                + l.ffn_norm.bytes()
                + extras
                    .iter()
                    .flat_map(|e| e.as_ref())
                    .map(GpuBuffer::bytes)
                    .sum::<u64>()
        };
        self.embed.bytes()
            + self.layers.iter().map(layer).sum::<u64>()
            + self.final_norm.bytes()
            + self.lm_head.as_ref().map_or(0, Frozen::bytes)
    }
}

/// One projection's adapter on the GPU: the trained `A [r, in]` and `B [out, r]`, their
/// gradients, and AdamW's moments.
pub(crate) struct GpuAdapter {
    pub(crate) a: GpuBuffer<f32>,
    pub(crate) b: GpuBuffer<f32>,
    /// `∂loss/∂A`, `∂loss/∂B` of the last step (summed over its micro-batches).
    pub(crate) da: GpuBuffer<f32>,
    pub(crate) db: GpuBuffer<f32>,
    /// One micro-batch's gradients, added into `da`, `db` after the first micro-batch.
    pub(crate) micro_da: GpuBuffer<f32>,
    pub(crate) micro_db: GpuBuffer<f32>,
    /// AdamW's `m` and `v` of `A` and of `B`.
    pub(crate) moments: [GpuBuffer<f32>; 4],
}

/// Every adapter's tensors of one role (values, gradients, one micro-batch's gradients, `m`,
/// `v`) in one allocation ([`Gpu::zeros_parts`]), every `A` then every `B`, each adapter's
/// tensors views of it: the optimizer updates every `A` in one launch and every `B` in another,
/// and the gradient norm reads all in one, where a buffer a tensor took a launch each (241 a
/// step for SmolLM2 with LoRA on q and v). The zeros between tensors stay zero: the gradient
/// kernels write only their elements, or sums of zeros into the tail of a vec4.
pub(crate) struct Arena {
    /// Every `A`, then every `B`, with the zeros between them.
    pub(crate) whole: GpuBuffer<f32>,
    /// The views of every `A` and of every `B` (the zeros after each included).
    pub(crate) a: GpuBuffer<f32>,
    pub(crate) b: GpuBuffer<f32>,
}

impl Arena {
    /// The arena of `lens` (every `A`'s, then every `B`'s: `adapters` of each), zeroed, and each
    /// tensor's view.
    fn new(
        gpu: &Gpu,
        lens: &[usize],
        adapters: usize,
    ) -> Result<(Arena, Vec<GpuBuffer<f32>>), ModelError> {
        let (whole, parts) = gpu.zeros_parts::<f32>(lens)?;
        let a_end = match parts.get(adapters) {
            Some(first_b) => (first_b.offset() - whole.offset()) as usize / 4,
            None => whole.len(),
        };
        let arena = Arena {
            a: whole.view(gpu, 0..a_end)?,
            b: whole.view(gpu, a_end..whole.len())?,
            whole,
        };
        Ok((arena, parts))
    }
}

/// The adapters' arenas, one a role.
pub(crate) struct Arenas {
    pub(crate) values: Arena,
    pub(crate) grads: Arena,
    pub(crate) micro_grads: Arena,
    pub(crate) m: Arena,
    pub(crate) v: Arena,
}

/// The LoRA adapters of every targeted projection of every layer on the GPU, with their
/// gradients and optimizer state (what a step writes).
pub struct GpuAdapters {
    config: ModelConfig,
    lora: LoraConfig,
    /// `[layer][target]`, flattened, as [`Adapters`] holds them: views of `arenas`.
    pub(crate) adapters: Vec<GpuAdapter>,
    pub(crate) arenas: Arenas,
}

impl GpuAdapters {
    /// Upload `adapters` (checked against `config` and `lora`), with zero gradients and
    /// optimizer state.
    pub fn upload(
        gpu: &Gpu,
        config: &ModelConfig,
        lora: &LoraConfig,
        adapters: &Adapters,
    ) -> Result<GpuAdapters, ModelError> {
        config.check()?;
        lora.check()?;
        adapters.check(config, lora)?;
        let host: Vec<&Adapter> = adapters.iter().map(|(_, _, adapter)| adapter).collect();
        let n = host.len();
        let lens: Vec<usize> = host
            .iter()
            .map(|h| h.a.len())
            .chain(host.iter().map(|h| h.b.len()))
            .collect();
        let arena = || Arena::new(gpu, &lens, n);
        let (values, value_views) = arena()?;
        let (grads, grad_views) = arena()?;
        let (micro_grads, micro_views) = arena()?;
        let (m, m_views) = arena()?;
        let (v, v_views) = arena()?;
        for (view, h) in value_views
            .iter()
            .zip(host.iter().map(|h| &h.a).chain(host.iter().map(|h| &h.b)))
        {
            view.write(gpu, &f32s(h))?;
        }
        // Each list is every `A`'s view, then every `B`'s: split into pairs by adapter.
        let pairs = |mut views: Vec<GpuBuffer<f32>>| {
            let bs = views.split_off(n);
            views.into_iter().zip(bs).collect::<Vec<_>>()
        };
        let (value_pairs, grad_pairs, micro_pairs, m_pairs, v_pairs) = (
            pairs(value_views),
            pairs(grad_views),
            pairs(micro_views),
            pairs(m_views),
            pairs(v_views),
        );
        let adapters = value_pairs
            .into_iter()
            .zip(grad_pairs)
            .zip(micro_pairs)
            .zip(m_pairs.into_iter().zip(v_pairs))
            .map(
                |((((a, b), (da, db)), (micro_da, micro_db)), ((m_a, m_b), (v_a, v_b)))| {
                    GpuAdapter {
                        a,
                        b,
                        da,
                        db,
                        micro_da,
                        micro_db,
                        moments: [m_a, v_a, m_b, v_b],
                    }
                },
            )
            .collect();
        Ok(GpuAdapters {
            config: config.clone(),
            lora: lora.clone(),
            adapters,
            arenas: Arenas {
                values,
                grads,
                micro_grads,
                m,
                v,
            },
        })
    }

    pub fn lora(&self) -> &LoraConfig {
        &self.lora
    }

    /// `Ok` when the adapters were made for `model`'s config (what every buffer set of a model
    /// and its adapters checks first).
    pub(crate) fn check_model(&self, model: &GpuModel) -> Result<(), ModelError> {
        let c = model.config();
        if &self.config != c {
            return Err(ModelError::invalid(
                "GpuAdapters",
                "config",
                format!("the model's ({c:?})"),
                format!("{:?}", self.config),
            ));
        }
        Ok(())
    }

    /// The model config the adapters were made for.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The position of `(layer, projection)`'s adapter, `None` when LoRA does not target it.
    pub(crate) fn index(&self, layer: usize, projection: Projection) -> Option<usize> {
        let targets = &self.lora.targets;
        let target = targets.iter().position(|&p| p == projection)?;
        Some(layer * targets.len() + target)
    }

    /// The adapters as host arrays (waits for the GPU; [`GpuAdapters::download_async`] in a
    /// web page).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn download(&self, gpu: &Gpu) -> Result<Adapters, ModelError> {
        let reads = self.start_reads(gpu, |a| (&a.a, &a.b))?;
        self.gather(
            reads
                .into_iter()
                .map(|(a, b)| Ok((a.wait(gpu)?, b.wait(gpu)?))),
        )
    }

    /// The last step's gradients, in the adapters' layout (waits for the GPU;
    /// [`GpuAdapters::download_grads_async`] in a web page).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn download_grads(&self, gpu: &Gpu) -> Result<Adapters, ModelError> {
        let reads = self.start_reads(gpu, |a| (&a.da, &a.db))?;
        self.gather(
            reads
                .into_iter()
                .map(|(a, b)| Ok((a.wait(gpu)?, b.wait(gpu)?))),
        )
    }

    /// [`GpuAdapters::download`], awaited (in a web page; on native it waits).
    pub async fn download_async(&self, gpu: &Gpu) -> Result<Adapters, ModelError> {
        let reads = self.start_reads(gpu, |a| (&a.a, &a.b))?;
        self.gather_async(gpu, reads).await
    }

    /// [`GpuAdapters::download_grads`], awaited (in a web page; on native it waits).
    pub async fn download_grads_async(&self, gpu: &Gpu) -> Result<Adapters, ModelError> {
        let reads = self.start_reads(gpu, |a| (&a.da, &a.db))?;
        self.gather_async(gpu, reads).await
    }

    /// Replace the adapters' values (checked like [`GpuAdapters::upload`]); the optimizer
    /// state is kept.
    pub fn write(&self, gpu: &Gpu, adapters: &Adapters) -> Result<(), ModelError> {
        adapters.check(&self.config, &self.lora)?;
        for (gpu_adapter, (_, _, host)) in self.adapters.iter().zip(adapters.iter()) {
            gpu_adapter.a.write(gpu, &f32s(&host.a))?;
            gpu_adapter.b.write(gpu, &f32s(&host.b))?;
        }
        Ok(())
    }

    /// AdamW's first and second moments `(m, v)`, each in the adapters' layout (`m` of `A` in
    /// `a`, of `B` in `b`): what a checkpoint saves so a resumed run continues the same curve.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn download_moments(&self, gpu: &Gpu) -> Result<(Adapters, Adapters), ModelError> {
        let m = self.start_reads(gpu, |a| (&a.moments[0], &a.moments[2]))?;
        let v = self.start_reads(gpu, |a| (&a.moments[1], &a.moments[3]))?;
        let wait = |reads: Vec<Reads>| {
            self.gather(
                reads
                    .into_iter()
                    .map(|(a, b)| Ok((a.wait(gpu)?, b.wait(gpu)?))),
            )
        };
        Ok((wait(m)?, wait(v)?))
    }

    /// Replace AdamW's moments (as [`GpuAdapters::download_moments`] gives them, checked
    /// like the adapters).
    pub fn write_moments(&self, gpu: &Gpu, m: &Adapters, v: &Adapters) -> Result<(), ModelError> {
        m.check(&self.config, &self.lora)?;
        v.check(&self.config, &self.lora)?;
        let pairs = self.adapters.iter().zip(m.iter().zip(v.iter()));
        for (gpu_adapter, ((_, _, m), (_, _, v))) in pairs {
            let [m_a, v_a, m_b, v_b] = &gpu_adapter.moments;
            m_a.write(gpu, &f32s(&m.a))?;
            v_a.write(gpu, &f32s(&v.a))?;
            m_b.write(gpu, &f32s(&m.b))?;
            v_b.write(gpu, &f32s(&v.b))?;
        }
        Ok(())
    }

    /// Start every adapter's two readbacks at once (each then waits only for its own copy).
    fn start_reads(
        &self,
        gpu: &Gpu,
        pick: impl Fn(&GpuAdapter) -> (&GpuBuffer<f32>, &GpuBuffer<f32>),
    ) -> Result<Vec<Reads>, ModelError> {
        let start = |a: &GpuAdapter| {
            let (a, b) = pick(a);
            Ok((a.read_start(gpu)?, b.read_start(gpu)?))
        };
        self.adapters.iter().map(start).collect()
    }

    async fn gather_async(&self, gpu: &Gpu, reads: Vec<Reads>) -> Result<Adapters, ModelError> {
        let mut values = Vec::with_capacity(reads.len());
        for (a, b) in reads {
            values.push(Ok((a.wait_async(gpu).await?, b.wait_async(gpu).await?)));
        }
        self.gather(values)
    }

    /// Host adapters of every adapter's `(A, B)` values, in the adapters' order.
    fn gather(
        &self,
        values: impl IntoIterator<Item = Result<(Vec<f32>, Vec<f32>), ModelError>>,
    ) -> Result<Adapters, ModelError> {
        let mut out = Adapters::zeros(&self.config, &self.lora);
        let targets = self.lora.targets.len();
        for (i, ab) in values.into_iter().enumerate() {
            let (a, b) = ab?;
            let host = out
                .get_mut(i / targets, self.lora.targets[i % targets])
                .expect("the same layout");
            host.a = a.iter().map(|&v| v as f64).collect();
            host.b = b.iter().map(|&v| v as f64).collect();
        }
        Ok(out)
    }

    /// Bytes of GPU memory the adapters, their gradients and their optimizer state take (their
    /// arenas, the zeros between tensors included).
    pub fn memory_bytes(&self) -> u64 {
        let a = &self.arenas;
        [&a.values, &a.grads, &a.micro_grads, &a.m, &a.v]
            .iter()
            .map(|arena| arena.whole.bytes())
            .sum()
    }
}
