//! Decoding with a KV cache ([`KvCache`]): each new token runs one token's forward (GEMMs of
//! one row, its attention over the cached keys and values of the positions before it) instead
//! of the whole sequence's.
//!
//! Every block of one token is the training forward's ([`record_logits`](super::record_logits),
//! KERNELS.md "Forward of one block") with `T = 1`, by the same kernels: RMSNorm, the q/k/v
//! projections with their biases and LoRA, Qwen3's q/k norms, RoPE at the token's position,
//! then the token's rotated keys and values appended to the layer's cache
//! ([`execute_kv_cache_append`]) and its attention over positions `0 ..= pos`
//! ([`execute_decode_attention`]), BitNet's sub-norm, the o-projection and residual, the FFN
//! and its residual; after the last block the final norm and the lm-head. The token's position
//! is a runtime value of every launch that depends on it (RoPE's offset, the append's row, the
//! attention's length), so after the first token no token compiles a pipeline, and nothing is
//! allocated per token.
//!
//! The prompt is filled token by token through the same path: the caches then hold exactly
//! what the decoding of each position would have written. [`KvCache::append`] records each
//! token in a recorder of its own that reuses the cache's bind groups ([`LaunchCache`]: every
//! token binds the same buffers), submitted without waiting; the residual stream is added to
//! in place. [`KvCache::generate_greedy`] makes the greedy choice on the GPU and records the
//! next token's forward before the host has read the token, so the host's recording of one
//! token overlaps the GPU's run of the one before.

use hesper_exec::{Gpu, GpuBuffer, LaunchCache, Recorder};
use hesper_kernels::argmax::execute_argmax;
use hesper_kernels::attention::{DecodeShape, execute_decode_attention, execute_kv_cache_append};
use hesper_kernels::elementwise::{execute_add_bias, execute_embedding};
use hesper_kernels::ffn::{
    execute_relu_sqr_mul_forward, execute_swiglu_forward, execute_swiglu_packed_forward,
};
use hesper_kernels::linear::gemv::{self, Adapter, execute_gemv_lora};
use hesper_kernels::linear::{Gemm, Product, execute_gemm};
use hesper_kernels::lora::execute_lora_forward;
use hesper_kernels::norm::execute_rms_norm_forward;
use hesper_kernels::rope::{Positions, execute_rope_qk};

use super::activations::{GateUp, LogitsBuffers};
use super::config::{Family, LoraConfig, ModelConfig, ModelError, Projection};
use super::gpu::{Frozen, GpuAdapter, GpuAdapters, GpuModel};

/// One token's activations, reused by every block and every token.
struct TokenBuffers {
    /// The token id `[1]`: copied from [`KvCache`]'s ids, or left by `argmax` (greedy decoding).
    token: GpuBuffer<u32>,
    /// The residual stream `[D]`: a block's input, the attention's and then the FFN's outputs
    /// added into it in place (nothing reads a block's input after its residual).
    x: GpuBuffer<f32>,
    /// A norm's output `[D]` and the `rstd` of a norm of one row.
    n: GpuBuffer<f32>,
    rstd: GpuBuffer<f32>,
    /// Qwen3: `Q` and `K` before their per-head norms, and those norms' `rstd`s.
    q_pre: Option<GpuBuffer<f32>>,
    k_pre: Option<GpuBuffer<f32>>,
    rstd_q: Option<GpuBuffer<f32>>,
    rstd_k: Option<GpuBuffer<f32>>,
    /// `Q [H·hd]`, `K`, `V [KV·hd]` (rotated where RoPE applies), the attention's output.
    q: GpuBuffer<f32>,
    k: GpuBuffer<f32>,
    v: GpuBuffer<f32>,
    o: GpuBuffer<f32>,
    /// The attention's probabilities, `[H, capacity]` (the first `H·(pos + 1)` used).
    attn: GpuBuffer<f32>,
    /// BitNet: the attention output's sub-norm.
    o_sub: Option<GpuBuffer<f32>>,
    /// The FFN's `gate`, `up` (one GEMM's `[2I]` where the model packs them), `h [I]`;
    /// BitNet's sub-norm of `h`.
    gate_up: GateUp,
    h: GpuBuffer<f32>,
    h_sub: Option<GpuBuffer<f32>>,
    /// `x·Aᵀ` `[r]` of the projection being adapted (scratch: nothing reads it later).
    lora_h: GpuBuffer<f32>,
}

/// The keys and values of every layer for the positions decoded so far, one token's buffers,
/// and the logits after the last token: generation at one token's cost per step.
///
/// Made for one model and one LoRA config ([`KvCache::new`]) with room for `capacity`
/// positions. [`KvCache::append`] runs tokens through the model one position after another,
/// writing their keys and values into the caches, and returns the logits of the token after
/// the last; [`KvCache::clear`] starts a new sequence in the same buffers.
pub struct KvCache {
    config: ModelConfig,
    lora: LoraConfig,
    capacity: usize,
    /// The tokens whose keys and values are cached, and the same ids on the GPU (`[capacity]`,
    /// zero past them).
    ids: Vec<u32>,
    ids_gpu: GpuBuffer<u32>,
    /// Per layer, `[KV, capacity, hd]`, keys rotated.
    k_cache: Vec<GpuBuffer<f32>>,
    v_cache: Vec<GpuBuffer<f32>>,
    work: TokenBuffers,
    logits: LogitsBuffers,
    /// The bind groups of one token's launches, the same for every token (used by the
    /// native-only loops that wait for the GPU: `append`, `generate_greedy`).
    #[cfg_attr(target_arch = "wasm32", allow(dead_code))]
    launches: LaunchCache,
}

impl KvCache {
    /// The caches and buffers of sequences of up to `capacity` positions (at most the model's
    /// `max_seq`) for `model` with `adapters`' LoRA config: `2·L·KV·capacity·hd` floats of
    /// cache, one token's activations and one row of logits.
    pub fn new(
        gpu: &Gpu,
        model: &GpuModel,
        adapters: &GpuAdapters,
        capacity: usize,
    ) -> Result<KvCache, ModelError> {
        let c = model.config();
        adapters.check_model(model)?;
        if capacity == 0 || capacity > c.max_seq {
            let expected = format!("1 to max_seq = {}", c.max_seq);
            return Err(ModelError::invalid(
                "KvCache", "capacity", expected, capacity,
            ));
        }
        let (d, i, hd) = (c.dim, c.ffn_dim, c.head_dim);
        let (hq, hkv) = (c.heads * hd, c.kv_heads * hd);
        let (qwen3, bitnet) = (c.family == Family::Qwen3, c.family == Family::BitNet);
        let buf = |n: usize| gpu.zeros::<f32>(n);
        let opt = |on: bool, n: usize| on.then(|| buf(n)).transpose();
        let cache = |_| buf(c.kv_heads * capacity * hd);
        let work = TokenBuffers {
            token: gpu.zeros(1)?,
            x: buf(d)?,
            n: buf(d)?,
            rstd: buf(1)?,
            q_pre: opt(qwen3, hq)?,
            k_pre: opt(qwen3, hkv)?,
            rstd_q: opt(qwen3, c.heads)?,
            rstd_k: opt(qwen3, c.kv_heads)?,
            q: buf(hq)?,
            k: buf(hkv)?,
            v: buf(hkv)?,
            o: buf(hq)?,
            attn: buf(c.heads * capacity)?,
            o_sub: opt(bitnet, hq)?,
            gate_up: GateUp::new(gpu, (1, i), GateUp::layout(model, adapters.lora()))?,
            h: buf(i)?,
            h_sub: opt(bitnet, i)?,
            lora_h: buf(adapters.lora().rank.max(1))?,
        };
        Ok(KvCache {
            config: c.clone(),
            lora: adapters.lora().clone(),
            capacity,
            ids: Vec::with_capacity(capacity),
            ids_gpu: gpu.zeros(capacity)?,
            k_cache: (0..c.layers).map(cache).collect::<Result<_, _>>()?,
            v_cache: (0..c.layers).map(cache).collect::<Result<_, _>>()?,
            work,
            logits: LogitsBuffers::new(gpu, c, 1)?,
            launches: LaunchCache::new(),
        })
    }

    /// The most positions it holds.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The positions cached so far: the next token is at this position.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// `true` before the first token.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// The tokens cached so far.
    pub fn tokens(&self) -> &[u32] {
        &self.ids
    }

    /// Forget every position (a new sequence starts at position 0; the buffers are kept).
    pub fn clear(&mut self) {
        self.ids.clear();
    }

    /// `true` when it was made for `model`'s config and `adapters`' LoRA config.
    pub fn fits(&self, model: &GpuModel, adapters: &GpuAdapters) -> bool {
        &self.config == model.config()
            && adapters.config() == model.config()
            && &self.lora == adapters.lora()
    }

    /// `[V]`: the logits the last [`KvCache::record_append`] wrote (of the token after the
    /// cached ones).
    pub fn logits(&self) -> &GpuBuffer<f32> {
        self.logits.logits()
    }

    /// Record the forward of `tokens` at the positions after the cached ones (their keys and
    /// values into the caches, one position after another) and the logits after the last of
    /// them into [`KvCache::logits`]. Everything is checked first (the model and adapters
    /// those the cache was made for, at least one token, each in the vocabulary, room for
    /// them); then the cached ids are written to the GPU, so record at most one append per
    /// recorder, and submit it before the next. The tokens count as cached once recorded.
    pub fn record_append(
        &mut self,
        rec: &mut Recorder<'_>,
        model: &GpuModel,
        adapters: &GpuAdapters,
        tokens: &[u32],
    ) -> Result<(), ModelError> {
        self.record_positions(rec, model, adapters, tokens)?;
        self.record_logits(rec, model)
    }

    /// The model and adapters those the cache was made for, at least one token, each in the
    /// vocabulary, room for them.
    fn check(
        &self,
        model: &GpuModel,
        adapters: &GpuAdapters,
        tokens: &[u32],
    ) -> Result<(), ModelError> {
        if !self.fits(model, adapters) {
            return Err(ModelError::invalid(
                "KvCache",
                "model",
                "a cache made by KvCache::new for this model and these adapters",
                format!(
                    "a cache of another model or LoRA config ({:?}, {:?})",
                    self.config, self.lora
                ),
            ));
        }
        let c = model.config();
        let start = self.ids.len();
        if tokens.is_empty() || start + tokens.len() > self.capacity {
            let room = self.capacity - start;
            let expected = format!(
                "1 to {room} tokens (room left of a capacity of {})",
                self.capacity
            );
            return Err(ModelError::invalid(
                "KvCache",
                "tokens",
                expected,
                tokens.len(),
            ));
        }
        if let Some((i, &t)) = tokens
            .iter()
            .enumerate()
            .find(|(_, t)| **t as usize >= c.vocab)
        {
            let expected = format!("below the vocabulary's {}", c.vocab);
            return Err(ModelError::invalid(
                "KvCache",
                format!("tokens[{i}]"),
                expected,
                t,
            ));
        }
        Ok(())
    }

    /// [`KvCache::record_append`] without the logits.
    fn record_positions(
        &mut self,
        rec: &mut Recorder<'_>,
        model: &GpuModel,
        adapters: &GpuAdapters,
        tokens: &[u32],
    ) -> Result<(), ModelError> {
        self.check(model, adapters, tokens)?;
        let start = self.ids.len();
        let mut ids = self.ids.clone();
        ids.extend_from_slice(tokens);
        let mut padded = ids.clone();
        padded.resize(self.capacity, 0);
        self.ids_gpu.write(rec.gpu(), &padded)?;
        self.ids = ids;
        for pos in start..self.ids.len() {
            self.record_position(rec, model, adapters, pos, Source::Ids)?;
        }
        Ok(())
    }

    /// The logits of the last recorded position and their argmax into `work.token`.
    #[cfg_attr(target_arch = "wasm32", allow(dead_code))]
    fn record_choice(
        &mut self,
        rec: &mut Recorder<'_>,
        model: &GpuModel,
    ) -> Result<(), ModelError> {
        self.record_logits(rec, model)?;
        let vocab = model.config().vocab;
        execute_argmax(rec, &self.logits.logits, vocab, &mut self.work.token, 0)?;
        Ok(())
    }

    /// Greedy decoding of up to `max_new` tokens after `prompt` (appended to the cached
    /// positions first), with each choice made on the GPU (`argmax`, the first maximum, as
    /// [`Sampling::Greedy`](super::Sampling) on the host): the forward of a token is recorded
    /// and submitted before the host has read it back, so the host's recording of one token
    /// overlaps the GPU's run of the one before. Stops after a token of `stop`, at the model's
    /// context, or when the cache is full; `on_token` sees each new token as it comes. The
    /// last new token is not cached (as after [`Generator::generate`](super::Generator)).
    #[cfg(not(target_arch = "wasm32"))]
    #[allow(clippy::too_many_arguments)]
    pub fn generate_greedy(
        &mut self,
        gpu: &Gpu,
        model: &GpuModel,
        adapters: &GpuAdapters,
        prompt: &[u32],
        max_new: usize,
        stop: &[u32],
        mut on_token: impl FnMut(u32),
    ) -> Result<Vec<u32>, ModelError> {
        self.check(model, adapters, prompt)?;
        if max_new == 0 || self.len() + prompt.len() >= self.config.max_seq {
            return Ok(vec![]);
        }
        self.submit_tokens(gpu, (model, adapters), prompt, KvCache::record_choice)?;
        let mut pending = self.work.token.read_start(gpu)?;
        let mut new = Vec::with_capacity(max_new);
        loop {
            // The forward of the token not yet read (at position `len`) goes in first, unless
            // no token after it could be wanted.
            let len = self.ids.len();
            let more =
                new.len() + 1 < max_new && len + 1 < self.config.max_seq && len < self.capacity;
            let next = if more {
                let mut rec = gpu.recorder_reusing(&self.launches);
                self.record_position(&mut rec, model, adapters, len, Source::Chosen)?;
                self.record_choice(&mut rec, model)?;
                rec.submit()?;
                Some(self.work.token.read_start(gpu)?)
            } else {
                None
            };
            let token = pending.wait(gpu)?[0];
            new.push(token);
            on_token(token);
            match next {
                Some(next) if !stop.contains(&token) => {
                    // Position `len` now holds this token's keys and values.
                    self.ids.push(token);
                    pending = next;
                }
                _ => return Ok(new),
            }
        }
    }

    /// The final norm and the lm-head of the last recorded position's output.
    fn record_logits(
        &mut self,
        rec: &mut Recorder<'_>,
        model: &GpuModel,
    ) -> Result<(), ModelError> {
        let c = model.config();
        let (d, eps) = (c.dim, c.norm_eps as f32);
        let TokenBuffers { x, rstd, .. } = &mut self.work;
        let out = &mut self.logits;
        execute_rms_norm_forward(rec, x, &model.final_norm, &mut out.n, rstd, eps)?;
        // f32 products: one row is `gemv`'s (f32 weights) or the tiled GEMM's, never a tensor
        // core's tile.
        let gemm = Gemm::new(Product::Nt, (1, c.vocab, d), false);
        execute_gemm(rec, &gemm, &out.n, model.head(), &mut out.logits)?;
        Ok(())
    }

    /// Run `tokens` through the model as [`KvCache::record_append`] does and read the logits
    /// after them back (`[V]`; waits for the GPU). Each token goes in a recorder of its own
    /// that reuses the cache's bind groups (the same launches every token), submitted without
    /// waiting; only the last records the logits.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn append(
        &mut self,
        gpu: &Gpu,
        model: &GpuModel,
        adapters: &GpuAdapters,
        tokens: &[u32],
    ) -> Result<Vec<f32>, ModelError> {
        self.submit_tokens(gpu, (model, adapters), tokens, KvCache::record_logits)?;
        Ok(self.logits().read(gpu)?)
    }

    /// Check `tokens`, then run them through the model a recorder each (reusing the cache's
    /// bind groups, submitted without waiting), `then` recording after the last one's forward
    /// what the caller wants of it.
    #[cfg(not(target_arch = "wasm32"))]
    fn submit_tokens(
        &mut self,
        gpu: &Gpu,
        (model, adapters): (&GpuModel, &GpuAdapters),
        tokens: &[u32],
        then: fn(&mut KvCache, &mut Recorder<'_>, &GpuModel) -> Result<(), ModelError>,
    ) -> Result<(), ModelError> {
        self.check(model, adapters, tokens)?;
        let count = tokens.len();
        for (i, t) in tokens.iter().enumerate() {
            let mut rec = gpu.recorder_reusing(&self.launches);
            self.record_positions(&mut rec, model, adapters, std::slice::from_ref(t))?;
            if i + 1 == count {
                then(self, &mut rec, model)?;
            }
            rec.submit()?;
        }
        Ok(())
    }

    /// Every block's forward of the token at `pos` (its id in `ids_gpu`, or already in
    /// `work.token`), the last block's output left in `work.x`.
    fn record_position(
        &mut self,
        rec: &mut Recorder<'_>,
        model: &GpuModel,
        adapters: &GpuAdapters,
        pos: usize,
        source: Source,
    ) -> Result<(), ModelError> {
        let c = model.config();
        let eps = c.norm_eps as f32;
        let a = &mut self.work;
        if source == Source::Ids {
            rec.copy_range(&self.ids_gpu, pos, &a.token, 0, 1)?;
        }
        execute_embedding(rec, &model.embed, &a.token, c.dim, &mut a.x)?;
        let positions = Positions {
            seq_len: 1,
            offset: u32::try_from(pos).expect("pos < capacity ≤ max_seq fits u32"),
        };
        let shape = DecodeShape {
            heads: c.heads,
            kv_heads: c.kv_heads,
            head_dim: c.head_dim,
            max_seq: self.capacity,
            pos,
        };
        for layer in 0..c.layers {
            let w = &model.layers[layer];
            let project = |rec: &mut Recorder<'_>,
                           p: Projection,
                           x: &GpuBuffer<f32>,
                           y: &mut GpuBuffer<f32>,
                           h: &mut GpuBuffer<f32>,
                           acc: bool| {
                project(rec, (model, adapters), (layer, p), x, y, h, acc)
            };
            execute_rms_norm_forward(rec, &a.x, &w.attn_norm, &mut a.n, &mut a.rstd, eps)?;
            let q_out = a.q_pre.as_mut().unwrap_or(&mut a.q);
            project(rec, Projection::Q, &a.n, q_out, &mut a.lora_h, false)?;
            let k_out = a.k_pre.as_mut().unwrap_or(&mut a.k);
            project(rec, Projection::K, &a.n, k_out, &mut a.lora_h, false)?;
            project(rec, Projection::V, &a.n, &mut a.v, &mut a.lora_h, false)?;
            if let (
                Some(q_pre),
                Some(k_pre),
                Some(rstd_q),
                Some(rstd_k),
                Some(q_norm),
                Some(k_norm),
            ) = (
                &a.q_pre,
                &a.k_pre,
                &mut a.rstd_q,
                &mut a.rstd_k,
                &w.q_norm,
                &w.k_norm,
            ) {
                execute_rms_norm_forward(rec, q_pre, q_norm, &mut a.q, rstd_q, eps)?;
                execute_rms_norm_forward(rec, k_pre, k_norm, &mut a.k, rstd_k, eps)?;
            }
            let (qk, heads) = ((&mut a.q, &mut a.k), (c.heads, c.kv_heads));
            execute_rope_qk(rec, qk, &model.rope, heads, positions, false)?;
            let (k_cache, v_cache) = (&mut self.k_cache[layer], &mut self.v_cache[layer]);
            execute_kv_cache_append(rec, shape, (&a.k, &a.v), k_cache, v_cache)?;
            execute_decode_attention(rec, shape, &a.q, (k_cache, v_cache), &mut a.attn, &mut a.o)?;
            if let (Some(o_sub), Some(gamma)) = (&mut a.o_sub, &w.attn_sub_norm) {
                execute_rms_norm_forward(rec, &a.o, gamma, o_sub, &mut a.rstd, eps)?;
            }
            let o_in = a.o_sub.as_ref().unwrap_or(&a.o);
            project(rec, Projection::O, o_in, &mut a.x, &mut a.lora_h, true)?;

            execute_rms_norm_forward(rec, &a.x, &w.ffn_norm, &mut a.n, &mut a.rstd, eps)?;
            match &mut a.gate_up {
                GateUp::Packed(gate_up) => {
                    let merged = w
                        .gate_up()
                        .expect("packed only where the model merges them");
                    let gemm = Gemm::new(Product::Nt, (1, 2 * c.ffn_dim, c.dim), false);
                    execute_gemm(rec, &gemm, &a.n, merged.weights(), &mut *gate_up)?;
                    execute_swiglu_packed_forward(rec, gate_up, c.ffn_dim, &mut a.h)?;
                }
                GateUp::PackedHalf(_) => {
                    unreachable!("decoding lays its gate and up out in f32 (GateUp::layout)")
                }
                GateUp::Apart { gate, up } => {
                    project(rec, Projection::Gate, &a.n, gate, &mut a.lora_h, false)?;
                    project(rec, Projection::Up, &a.n, up, &mut a.lora_h, false)?;
                    match (&mut a.h_sub, &w.ffn_sub_norm) {
                        (Some(h_sub), Some(gamma)) => {
                            execute_relu_sqr_mul_forward(rec, gate, up, &mut a.h)?;
                            execute_rms_norm_forward(rec, &a.h, gamma, h_sub, &mut a.rstd, eps)?;
                        }
                        _ => execute_swiglu_forward(rec, gate, up, &mut a.h)?,
                    }
                }
            }
            let h_in = a.h_sub.as_ref().unwrap_or(&a.h);
            project(rec, Projection::Down, h_in, &mut a.x, &mut a.lora_h, true)?;
        }
        Ok(())
    }

    /// Bytes of GPU memory the caches and buffers take.
    pub fn memory_bytes(&self) -> u64 {
        let w = &self.work;
        let fixed = [
            &w.x, &w.n, &w.rstd, &w.q, &w.k, &w.v, &w.o, &w.attn, &w.h, &w.lora_h,
        ];
        let extra = [&w.q_pre, &w.k_pre, &w.rstd_q, &w.rstd_k, &w.o_sub, &w.h_sub];
        let caches = self.k_cache.iter().chain(&self.v_cache);
        fixed.into_iter().map(GpuBuffer::bytes).sum::<u64>()
            + extra
                .into_iter()
                .flatten()
                .map(GpuBuffer::bytes)
                .sum::<u64>()
            + caches.map(GpuBuffer::bytes).sum::<u64>()
            + w.gate_up.bytes()
            + self.ids_gpu.bytes()
            + w.token.bytes()
            + self.logits.n.bytes()
            + self.logits.logits.bytes()
    }
}

/// Where a position's token id comes from.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Source {
    /// [`KvCache`]'s ids, written from the host.
    Ids,
    /// `work.token`, where the last `argmax` left it (`generate_greedy`, native only).
    #[cfg_attr(target_arch = "wasm32", allow(dead_code))]
    Chosen,
}

/// `y (+)= x·Wᵀ (+ bias) + s·(x·Aᵀ)·Bᵀ` for one token's row: the training forward's
/// projection at `T = 1`, with the adapter in the same launch (`gemv_lora`) up to its largest
/// rank.
#[allow(clippy::too_many_arguments)]
fn project(
    rec: &mut Recorder<'_>,
    (model, adapters): (&GpuModel, &GpuAdapters),
    (layer, projection): (usize, Projection),
    x: &GpuBuffer<f32>,
    y: &mut GpuBuffer<f32>,
    lora_h: &mut GpuBuffer<f32>,
    accumulate: bool,
) -> Result<(), ModelError> {
    let weights = &model.layers[layer];
    let (out, input) = projection.shape(model.config());
    let w = weights.projection(projection);
    let lora = adapters.lora();
    let (rank, scale) = (lora.rank, lora.scale() as f32);
    match (adapters.index(layer, projection), w) {
        (Some(i), Frozen::F32(w)) if rank <= gemv::MAX_RANK => {
            let GpuAdapter { a, b, .. } = &adapters.adapters[i];
            let adapter = Adapter { a, b, rank, scale };
            execute_gemv_lora(rec, (x, w), adapter, y, (1, out, input), accumulate)?;
        }
        (index, w) => {
            let gemm = Gemm::new(Product::Nt, (1, out, input), accumulate);
            execute_gemm(rec, &gemm, x, w.weights(), &mut *y)?;
            if let Some(i) = index {
                let GpuAdapter { a, b, .. } = &adapters.adapters[i];
                execute_lora_forward(rec, x, a, b, rank, scale, lora_h, y)?;
            }
        }
    }
    if let Some(bias) = weights.bias(projection) {
        execute_add_bias(rec, y, bias)?;
    }
    Ok(())
}
