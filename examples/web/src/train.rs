//! A whole LoRA training run on one GPU, in a page or on native: the tiny model of the root
//! crate's training test (`tests/model_step.rs`, `train_tiny`) — the same model, text, seeds
//! and hyperparameters — learning a line of text. Nothing here blocks: the device is awaited,
//! and each step's loss is read while the next step runs.

use hesper::exec::{Gpu, PendingRead};
use hesper::model::config::{Family, LoraConfig, ModelConfig, ModelError, Projection};
use hesper::model::reference::{Adapters, Batch, IGNORE_INDEX, Weights};
use hesper::model::{
    GpuAdapters, GpuModel, Optimizer, StepBuffers, StepShape, record_forward_backward,
    record_optimizer_step,
};

/// The text the model learns, as printable ASCII: character `c` is token `c − ' '`.
pub const TEXT: &str = "the quick brown fox jumps over the lazy dog; the dog sleeps.";

/// Sequences a step trains on, and positions in each: sequence `b` is the 16 characters from
/// `20·b` of [`TEXT`], each predicting the next (the last predicts nothing).
pub const BATCH: usize = 2;
pub const SEQ_LEN: usize = 16;

/// The learning rate, constant (AdamW as PyTorch's, clipping the global norm at 1).
pub const LEARNING_RATE: f64 = 1e-2;

/// A random Llama of 2 layers, `D = 64`, FFN 128, 4 query and 2 KV heads of 16, a vocabulary
/// of 97 (printable ASCII and two more), tied embeddings, at most 16 positions.
pub fn model_config() -> ModelConfig {
    ModelConfig {
        max_seq: SEQ_LEN,
        ..ModelConfig::tiny(Family::Llama)
    }
}

/// LoRA of rank 8, `α = 16`, on all seven projections of every layer.
pub fn lora_config() -> LoraConfig {
    LoraConfig {
        targets: Projection::ALL.to_vec(),
        rank: 8,
        alpha: 16.0,
        rslora: false,
    }
}

/// The one batch every step trains on (see [`BATCH`]).
pub fn batch() -> Batch {
    let ids: Vec<u32> = TEXT.bytes().map(|c| u32::from(c - b' ')).collect();
    let tokens: Vec<u32> = (0..BATCH * SEQ_LEN)
        .map(|t| ids[(t / SEQ_LEN) * 20 + t % SEQ_LEN])
        .collect();
    let targets = (0..tokens.len())
        .map(|t| {
            let (b, s) = (t / SEQ_LEN, t % SEQ_LEN);
            match s + 1 < SEQ_LEN {
                true => i64::from(ids[b * 20 + s + 1]),
                false => IGNORE_INDEX,
            }
        })
        .collect();
    Batch {
        batch: BATCH,
        seq_len: SEQ_LEN,
        tokens,
        targets,
        lens: vec![SEQ_LEN; BATCH],
    }
}

/// One line about the run, for the page.
pub fn describe() -> String {
    let (c, l) = (model_config(), lora_config());
    format!(
        "a random {:?} of {} layers (D = {}, FFN {}, {} query / {} KV heads of {}, vocabulary {}), \
         LoRA rank {} (α = {}) on all {} projections, AdamW at {LEARNING_RATE}; \
         {BATCH} sequences of {SEQ_LEN} characters from {TEXT:?}",
        c.family,
        c.layers,
        c.dim,
        c.ffn_dim,
        c.heads,
        c.kv_heads,
        c.head_dim,
        c.vocab,
        l.rank,
        l.alpha,
        l.targets.len()
    )
}

/// Train the tiny model for `steps` steps on `gpu` from its fixed seeds (weights 41, adapters
/// PEFT-initialised from 42) and return each step's loss. `on_step(step, loss)` is called as
/// each loss arrives (step from 1), one step behind the GPU: step `n`'s loss is read while
/// step `n + 1` runs.
///
/// On a debug build, open `gpu` with `verify_cache_hits: false`: that check rebuilds every
/// kernel at every launch, most of a step's time on a CPU device.
pub async fn train_tiny(
    gpu: &Gpu,
    steps: u32,
    on_step: impl FnMut(u32, f32),
) -> Result<Vec<f32>, String> {
    run(gpu, steps, on_step).await.map_err(|e| e.to_string())
}

async fn run(
    gpu: &Gpu,
    steps: u32,
    mut on_step: impl FnMut(u32, f32),
) -> Result<Vec<f32>, ModelError> {
    let (config, lora) = (model_config(), lora_config());
    let model = GpuModel::upload(gpu, &config, &Weights::random(&config, 41))?;
    let init = Adapters::init_peft(&config, &lora, 42);
    let mut adapters = GpuAdapters::upload(gpu, &config, &lora, &init)?;
    let shape = StepShape::new(BATCH, SEQ_LEN);
    let mut buffers = StepBuffers::new(gpu, &model, &adapters, shape)?;
    buffers.load(gpu, &config, &[batch()])?;
    let optimizer = Optimizer::default();
    let mut losses = Vec::with_capacity(steps as usize);
    let mut pending: Option<PendingRead<f32>> = None;
    for step in 1..=steps + 1 {
        if step <= steps {
            let mut rec = gpu.recorder();
            record_forward_backward(&mut rec, &model, &mut adapters, &mut buffers)?;
            let at = (LEARNING_RATE, step);
            record_optimizer_step(&mut rec, &optimizer, at, &mut adapters, &mut buffers)?;
            rec.submit()?;
        }
        if let Some(previous) = pending.take() {
            let loss = previous.wait_async(gpu).await?[0];
            losses.push(loss);
            on_step(step - 1, loss);
        }
        if step <= steps {
            pending = Some(buffers.loss().read_start(gpu)?);
        }
    }
    Ok(losses)
}
