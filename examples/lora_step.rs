//! A LoRA training step on the GPU, end to end: a small random Llama-family model, PEFT's
//! adapter initialisation on q and v, a batch of two sequences (one of them padded), and
//! twenty steps of forward, backward and AdamW, each recorded into one recorder and submitted
//! once. Each step's loss is read while the next step runs. Then the step's gradients are
//! compared with the f64 reference model's on the same weights, adapters and batch.
//!
//! ```sh
//! scripts/with-gpu cargo run --release --example lora_step
//! ```

use hesper::exec::Gpu;
use hesper::model::config::{Family, LoraConfig, ModelConfig};
use hesper::model::reference::{Adapters, Batch, IGNORE_INDEX, Weights, loss_and_grads};
use hesper::model::{
    GpuAdapters, GpuModel, Optimizer, StepBuffers, StepShape, record_forward_backward,
    record_optimizer_step,
};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let gpu = Gpu::new()?;
    println!("device: {}", gpu.describe());
    let config = ModelConfig {
        family: Family::Llama,
        vocab: 256,
        dim: 128,
        ffn_dim: 384,
        layers: 4,
        heads: 8,
        kv_heads: 2,
        head_dim: 16,
        rope_base: 10_000.0,
        norm_eps: 1e-5,
        tied_embeddings: true,
        max_seq: 32,
    };
    let lora = LoraConfig::default(); // q_proj and v_proj, r = 8, α = 16
    let weights = Weights::random(&config, 1);
    let adapters = Adapters::init_peft(&config, &lora, 2);

    // Two sequences of the bytes of a text, the second one shorter (right-padded).
    let text = b"A LoRA step: forward, loss, backward through every block, AdamW.";
    let (batch, seq_len, lens) = (2, 32, [32, 20]);
    let tokens: Vec<u32> = (0..batch * seq_len)
        .map(|t| text[t % text.len()] as u32)
        .collect();
    let targets = (0..tokens.len())
        .map(|t| {
            let s = t % seq_len;
            if s + 1 < lens[t / seq_len] {
                tokens[t + 1] as i64
            } else {
                IGNORE_INDEX
            }
        })
        .collect();
    let data = Batch {
        batch,
        seq_len,
        tokens,
        targets,
        lens: lens.to_vec(),
    };

    let model = GpuModel::upload(&gpu, &config, &weights)?;
    let mut gpu_adapters = GpuAdapters::upload(&gpu, &config, &lora, &adapters)?;
    let mut buffers =
        StepBuffers::new(&gpu, &model, &gpu_adapters, StepShape::new(batch, seq_len))?;
    println!(
        "GPU memory: weights {} KB, adapters with their state {} KB, the step's buffers {} KB",
        model.memory_bytes() / 1000,
        gpu_adapters.memory_bytes() / 1000,
        buffers.memory_bytes() / 1000
    );
    buffers.load(&gpu, &config, std::slice::from_ref(&data))?;

    // The first step's gradients against the f64 model.
    let mut rec = gpu.recorder();
    record_forward_backward(&mut rec, &model, &mut gpu_adapters, &mut buffers)?;
    rec.submit()?;
    let (loss, want) = loss_and_grads(&config, &lora, &weights, &adapters, &data)?;
    let got = gpu_adapters.download_grads(&gpu)?;
    let mut worst: f64 = 0.0;
    for (layer, p, want) in want.lora.iter() {
        let got = got.get(layer, p).expect("same targets");
        let max = want.b.iter().fold(1e-30f64, |m, v| m.max(v.abs()));
        for (g, w) in got.b.iter().zip(&want.b) {
            worst = worst.max((g - w).abs() / max);
        }
    }
    println!(
        "loss {:.6} on the GPU, {loss:.6} in f64; lora_B gradients within {worst:.1e} of each tensor's largest",
        buffers.loss().read(&gpu)?[0]
    );

    let optimizer = Optimizer::default();
    let mut pending = None;
    for step in 1..=20u32 {
        let mut rec = gpu.recorder();
        record_forward_backward(&mut rec, &model, &mut gpu_adapters, &mut buffers)?;
        record_optimizer_step(
            &mut rec,
            &optimizer,
            (1e-2, step),
            &mut gpu_adapters,
            &mut buffers,
        )?;
        rec.submit()?;
        // Step n − 1's loss arrives while step n runs.
        if let Some(previous) = pending.replace(buffers.loss().read_start(&gpu)?) {
            let loss: Vec<f32> = hesper::exec::PendingRead::wait(previous, &gpu)?;
            println!("step {:2}: loss {:.4}", step - 1, loss[0]);
        }
    }
    if let Some(last) = pending {
        println!("step 20: loss {:.4}", last.wait(&gpu)?[0]);
    }
    let trained = gpu_adapters.download(&gpu)?;
    let (layer, p, adapter) = trained.iter().next().expect("an adapter");
    println!(
        "{}.lora_B[0..4] = {:?}",
        Adapters::peft_key(layer, p),
        &adapter.b[..4]
    );
    Ok(())
}
