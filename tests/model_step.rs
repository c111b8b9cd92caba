//! The LoRA training step on the GPU (lavapipe here) against the f64 reference model: the
//! loss, every adapter gradient and the gradient at the embedding output, for every family;
//! gradient accumulation; one AdamW step against the f64 optimizer; a tiny model that learns
//! a text, twice with identical losses; and the inputs the step refuses.

use hesper::exec::{Gpu, GpuOptions};
use hesper::kernels::linear::Precision;
use hesper::kernels::optim::reference::{State, adamw_step, clip_coefficient, global_grad_norm};
use hesper::kernels::testing::gpu;
use hesper::model::config::{Family, LoraConfig, ModelConfig, Projection};
use hesper::model::reference::{
    Adapters, Batch, IGNORE_INDEX, Weights, logits as reference_logits, loss_and_grads,
};
use hesper::model::{
    Generator, GpuAdapters, GpuModel, KvCache, LogitsBuffers, Optimizer, Rng, Sampling,
    StepBuffers, StepShape, record_forward_backward, record_forward_loss, record_logits,
    record_optimizer_step,
};

fn lora(targets: &[Projection], rank: usize, alpha: f64, rslora: bool) -> LoraConfig {
    LoraConfig {
        targets: targets.to_vec(),
        rank,
        alpha,
        rslora,
    }
}

/// Panic unless `|got − want| ≤ tol·max|want|` at every element (the measure: relative
/// to the tensor's largest value), and `want` is not all zeros.
fn assert_matches(what: &str, got: &[f64], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let max = want.iter().fold(0f64, |m, v| m.max(v.abs()));
    assert!(
        max > 0.0,
        "{what}: the reference is all zeros, which tests nothing"
    );
    let (i, err) = got
        .iter()
        .zip(want)
        .map(|(g, w)| (g - w).abs())
        .enumerate()
        .fold((0, 0f64), |best, (i, e)| {
            if e.is_nan() || e > best.1 {
                (i, e)
            } else {
                best
            }
        });
    assert!(
        err <= tol * max,
        "{what}: element {i} is {} on the GPU, {} in f64 (error {err:e}, {:e} of the max {max:e})",
        got[i],
        want[i],
        err / max
    );
}

/// Every `lora_A` and `lora_B` gradient of `got` against `want` ([`assert_matches`] at 1e-4),
/// named by PEFT's key after `what`.
fn assert_grads_match(what: &str, got: &Adapters, want: &Adapters) {
    for (layer, p, want) in want.iter() {
        let name = Adapters::peft_key(layer, p);
        let got = got.get(layer, p).unwrap();
        assert_matches(&format!("{what} {name}.lora_A"), &got.a, &want.a, 1e-4);
        assert_matches(&format!("{what} {name}.lora_B"), &got.b, &want.b, 1e-4);
    }
}

/// The GPU's loss, adapter gradients and `∂loss/∂x0` for one batch.
#[derive(Debug, PartialEq)]
struct GpuResult {
    loss: f64,
    grads: Adapters,
    d_x0: Vec<f64>,
    /// What the step's buffers take.
    memory: u64,
}

fn run_step(
    config: &ModelConfig,
    lora: &LoraConfig,
    (weights, adapters): (&Weights, &Adapters),
    batches: &[Batch],
    (loss_chunk, recompute): (usize, bool),
) -> GpuResult {
    let g = gpu();
    let model = GpuModel::upload(g, config, weights).unwrap();
    let mut gpu_adapters = GpuAdapters::upload(g, config, lora, adapters).unwrap();
    let shape = StepShape {
        batch: batches[0].batch,
        seq_len: batches[0].seq_len,
        micro_batches: batches.len(),
        loss_chunk,
        recompute,
    };
    let mut buffers = StepBuffers::new(g, &model, &gpu_adapters, shape).unwrap();
    buffers.load(g, config, batches).unwrap();
    let mut rec = g.recorder();
    record_forward_backward(&mut rec, &model, &mut gpu_adapters, &mut buffers).unwrap();
    rec.submit().unwrap();
    GpuResult {
        loss: buffers.loss().read(g).unwrap()[0] as f64,
        grads: gpu_adapters.download_grads(g).unwrap(),
        d_x0: buffers
            .d_embeddings()
            .read(g)
            .unwrap()
            .iter()
            .map(|&v| v as f64)
            .collect(),
        memory: buffers.memory_bytes(),
    }
}

/// The GPU step of `config` against the f64 model on random weights, random (non-zero)
/// adapters and a batch of two sequences, one of them short, the loss in uneven chunks.
fn check_family(family: Family, lora: LoraConfig) {
    let config = ModelConfig::tiny(family);
    let weights = Weights::random(&config, 1);
    let adapters = Adapters::random(&config, &lora, 2);
    let batch = Batch::random(&config, 3, 8, &[8, 5]);
    let (loss, want) = loss_and_grads(&config, &lora, &weights, &adapters, &batch).unwrap();
    let got = run_step(
        &config,
        &lora,
        (&weights, &adapters),
        std::slice::from_ref(&batch),
        (3, false),
    );
    assert!(
        (got.loss - loss).abs() <= 1e-5 * loss,
        "{family:?}: loss {} on the GPU, {loss} in f64",
        got.loss
    );
    assert_grads_match(&format!("{family:?}"), &got.grads, &want.lora);
    assert_matches(&format!("{family:?} d_x0"), &got.d_x0, &want.d_x0, 1e-4);
}

/// Llama with LoRA on all seven projections (`s = 2`): every path of the block's backward
/// feeds some adapter's gradient, and `d_x0` checks the residual stream's.
#[test]
fn llama_step_matches_the_f64_model_on_all_seven_projections() {
    check_family(Family::Llama, lora(&Projection::ALL, 4, 8.0, false));
}

/// Sizes that are multiples of nothing: 3 sequences of 5 (T = 15, lengths 5, 2 and 0 — one
/// all padding), the loss in chunks of 4, rank 3, LoRA on o, up and down.
#[test]
fn odd_sizes_and_an_empty_sequence_match_the_f64_model() {
    let config = ModelConfig::tiny(Family::Llama);
    let lora = lora(
        &[Projection::O, Projection::Up, Projection::Down],
        3,
        5.0,
        false,
    );
    let weights = Weights::random(&config, 71);
    let adapters = Adapters::random(&config, &lora, 72);
    let batch = Batch::random(&config, 73, 5, &[5, 2, 0]);
    let (loss, want) = loss_and_grads(&config, &lora, &weights, &adapters, &batch).unwrap();
    let got = run_step(&config, &lora, (&weights, &adapters), &[batch], (4, false));
    assert!(
        (got.loss - loss).abs() <= 1e-5 * loss,
        "loss {} vs {loss}",
        got.loss
    );
    assert_grads_match("", &got.grads, &want.lora);
    assert_matches("d_x0", &got.d_x0, &want.d_x0, 1e-4);
}

/// Qwen2 (biases on Q, K, V; an untied head), LoRA on q, k, v with rank 2.
#[test]
fn qwen2_step_matches_the_f64_model() {
    let targets = [Projection::Q, Projection::K, Projection::V];
    check_family(Family::Qwen2, lora(&targets, 2, 3.0, false));
}

/// Qwen3 (per-head norms of Q and K before RoPE), rsLoRA on q, v, o and down.
#[test]
fn qwen3_step_matches_the_f64_model() {
    let targets = [
        Projection::Q,
        Projection::V,
        Projection::O,
        Projection::Down,
    ];
    check_family(Family::Qwen3, lora(&targets, 4, 6.0, true));
}

/// BitNet (sub-norms before W_o and W_down, ReLU²×Mul), LoRA on all seven.
#[test]
fn bitnet_step_matches_the_f64_model_on_all_seven_projections() {
    check_family(Family::BitNet, lora(&Projection::ALL, 2, 4.0, false));
}

/// Two micro-batches accumulate the gradient of the loss over all their targets: the f64
/// model's on the two batches as one batch of four sequences (N counted over both, not a mean
/// of two means: the micro-batches have different target counts).
/// The forward alone (an eval step: loss and per-position losses, the gradients untouched)
/// and the logits of chosen positions (what generation reads) against the f64 model, with
/// and without gradient checkpointing, for a family with every optional part (Qwen3's q/k
/// norms) and for Llama.
#[test]
fn forward_loss_and_logits_match_the_f64_model() {
    for (family, recompute) in [(Family::Qwen3, false), (Family::Llama, true)] {
        let config = ModelConfig::tiny(family);
        let lora = lora(
            &[Projection::Q, Projection::V, Projection::Down],
            4,
            8.0,
            false,
        );
        let weights = Weights::random(&config, 11);
        let adapters = Adapters::random(&config, &lora, 12);
        let batch = Batch::random(&config, 13, 8, &[8, 6]);
        let g = gpu();
        let model = GpuModel::upload(g, &config, &weights).unwrap();
        let mut gpu_adapters = GpuAdapters::upload(g, &config, &lora, &adapters).unwrap();
        let mut shape = StepShape::new(2, 8);
        shape.recompute = recompute;
        let mut buffers = StepBuffers::new(g, &model, &gpu_adapters, shape).unwrap();
        buffers
            .load(g, &config, std::slice::from_ref(&batch))
            .unwrap();
        // Gradients of a training step first: the eval step must leave them as they are.
        let mut rec = g.recorder();
        record_forward_backward(&mut rec, &model, &mut gpu_adapters, &mut buffers).unwrap();
        rec.submit().unwrap();
        let grads = gpu_adapters.download_grads(g).unwrap();
        buffers.token_losses().write(g, &[f32::NAN; 16]).unwrap();

        let mut rec = g.recorder();
        record_forward_loss(&mut rec, &model, &gpu_adapters, &mut buffers).unwrap();
        rec.submit().unwrap();
        let (want, _) = loss_and_grads(&config, &lora, &weights, &adapters, &batch).unwrap();
        let got = buffers.loss().read(g).unwrap()[0] as f64;
        assert!(
            (got - want).abs() <= 1e-5 * want,
            "{family:?}: eval loss {got} on the GPU, {want} in f64"
        );
        let want_logits = reference_logits(&config, &lora, &weights, &adapters, &batch).unwrap();
        let v = config.vocab;
        let want_token_losses: Vec<f64> = (batch.targets.iter().enumerate())
            .map(|(t, &y)| match usize::try_from(y) {
                Ok(y) => {
                    let z = &want_logits[t * v..][..v];
                    let max = z.iter().fold(f64::MIN, |m, &x| m.max(x));
                    max + z.iter().map(|x| (x - max).exp()).sum::<f64>().ln() - z[y]
                }
                Err(_) => 0.0,
            })
            .collect();
        let token_losses = buffers.token_losses().read(g).unwrap();
        let token_losses: Vec<f64> = token_losses.iter().map(|&l| l as f64).collect();
        assert_matches("token losses", &token_losses, &want_token_losses, 1e-5);
        assert_eq!(gpu_adapters.download_grads(g).unwrap(), grads, "{family:?}");

        let positions = [7, 8 + 5, 0];
        let mut out = LogitsBuffers::new(g, &config, positions.len()).unwrap();
        out.logits()
            .write(g, &vec![f32::NAN; positions.len() * v])
            .unwrap();
        let mut rec = g.recorder();
        record_logits(
            &mut rec,
            &model,
            &gpu_adapters,
            &mut buffers,
            &positions,
            &mut out,
        )
        .unwrap();
        rec.submit().unwrap();
        let got = out.logits().read(g).unwrap();
        for (row, &p) in positions.iter().enumerate() {
            let got: Vec<f64> = got[row * v..][..v].iter().map(|&x| x as f64).collect();
            let what = format!("{family:?} logits of position {p}");
            assert_matches(&what, &got, &want_logits[p * v..][..v], 1e-5);
        }
        let mut rec = g.recorder();
        let too_far = record_logits(
            &mut rec,
            &model,
            &gpu_adapters,
            &mut buffers,
            &[16, 0, 1],
            &mut out,
        );
        let message = too_far.unwrap_err().to_string();
        assert!(message.contains("positions below B·S = 16"), "{message}");
    }
}

/// Greedy generation on the GPU against the f64 model's argmax at every step, for 30 tokens
/// (past the first length of 32, so the generator's buffers grow once); where the f64 model's
/// two best tokens are closer than f32 can tell, either is accepted.
#[test]
fn greedy_generation_follows_the_f64_model() {
    let config = ModelConfig {
        max_seq: 64,
        ..ModelConfig::tiny(Family::Llama)
    };
    let lora = lora(&[Projection::Q, Projection::Up], 2, 4.0, true);
    let weights = Weights::random(&config, 21);
    let adapters = Adapters::random(&config, &lora, 22);
    let g = gpu();
    let model = GpuModel::upload(g, &config, &weights).unwrap();
    let gpu_adapters = GpuAdapters::upload(g, &config, &lora, &adapters).unwrap();
    let mut generator = Generator::new(g, &model).unwrap();
    let prompt = [3, 1, 4, 1, 5];
    let mut streamed = vec![];
    let mut rng = Rng::new(0);
    let greedy = (Sampling::Greedy, &mut rng);
    let new = generator
        .generate(g, &model, &gpu_adapters, &prompt, 30, greedy, &[], |t| {
            streamed.push(t)
        })
        .unwrap();
    assert_eq!(new.len(), 30);
    assert_eq!(new, streamed);
    let mut tokens = prompt.to_vec();
    for &next in &new {
        let s = tokens.len();
        let batch = Batch {
            batch: 1,
            seq_len: s,
            tokens: tokens.clone(),
            targets: vec![IGNORE_INDEX; s],
            lens: vec![s],
        };
        let logits = reference_logits(&config, &lora, &weights, &adapters, &batch).unwrap();
        let last = &logits[(s - 1) * config.vocab..];
        let mut order: Vec<usize> = (0..config.vocab).collect();
        order.sort_by(|&a, &b| last[b].total_cmp(&last[a]));
        let (best, second) = (order[0], order[1]);
        let close = last[best] - last[second] < 1e-4 * last[best].abs().max(1.0);
        assert!(
            next as usize == best || (close && next as usize == second),
            "after {s} tokens: the GPU chose {next}, the f64 model {best} (logit {} vs {})",
            last[next as usize],
            last[best]
        );
        tokens.push(next);
    }
    // A stop token ends it, and is the last token given.
    let stop = [new[2]];
    let mut rng = Rng::new(0);
    let until = generator
        .generate(
            g,
            &model,
            &gpu_adapters,
            &prompt,
            40,
            (Sampling::Greedy, &mut rng),
            &stop,
            |_| {},
        )
        .unwrap();
    assert_eq!(
        until,
        new[..=new.iter().position(|t| *t == new[2]).unwrap()]
    );
}

#[test]
fn micro_batches_accumulate_the_gradient_of_the_whole_batch() {
    let config = ModelConfig::tiny(Family::Llama);
    let lora = lora(
        &[Projection::Q, Projection::V, Projection::Down],
        4,
        8.0,
        false,
    );
    let weights = Weights::random(&config, 11);
    let adapters = Adapters::random(&config, &lora, 12);
    let first = Batch::random(&config, 13, 8, &[8, 3]);
    let second = Batch::random(&config, 14, 8, &[6, 8]);
    assert_ne!(first.target_count(), second.target_count());
    let whole = Batch {
        batch: 4,
        seq_len: 8,
        tokens: [first.tokens.clone(), second.tokens.clone()].concat(),
        targets: [first.targets.clone(), second.targets.clone()].concat(),
        lens: [first.lens.clone(), second.lens.clone()].concat(),
    };
    let (loss, want) = loss_and_grads(&config, &lora, &weights, &adapters, &whole).unwrap();
    let got = run_step(
        &config,
        &lora,
        (&weights, &adapters),
        &[first, second],
        (5, false),
    );
    assert!(
        (got.loss - loss).abs() <= 1e-5 * loss,
        "loss {} vs {loss}",
        got.loss
    );
    assert_grads_match("", &got.grads, &want.lora);
}

/// Gradient checkpointing recomputes each block's forward before its backward: the same
/// loss and gradients to the bit (BitNet with all seven adapters: every saved activation is
/// used), in less memory.
#[test]
fn gradient_checkpointing_gives_the_same_step_to_the_bit() {
    let config = ModelConfig::tiny(Family::BitNet);
    let lora = lora(&Projection::ALL, 2, 4.0, false);
    let weights = Weights::random(&config, 61);
    let adapters = Adapters::random(&config, &lora, 62);
    let batches = [
        Batch::random(&config, 63, 8, &[7, 8]),
        Batch::random(&config, 64, 8, &[8, 2]),
    ];
    let kept = run_step(&config, &lora, (&weights, &adapters), &batches, (16, false));
    let recomputed = run_step(&config, &lora, (&weights, &adapters), &batches, (16, true));
    assert!(
        recomputed.memory < kept.memory,
        "{} ≥ {}",
        recomputed.memory,
        kept.memory
    );
    assert_eq!(
        GpuResult {
            memory: 0,
            ..recomputed
        },
        GpuResult { memory: 0, ..kept }
    );
}

/// One optimizer step (clipping active, LoRA+ ratio 4) on the GPU against f64 AdamW applied to
/// the f64 model's clipped gradients.
#[test]
fn one_adamw_step_matches_the_f64_optimizer() {
    let lora = lora(&[Projection::Q, Projection::V], 4, 8.0, false);
    check_adamw_step(&ModelConfig::tiny(Family::Llama), &lora);
}

/// The same at sizes whose tensors leave zeros between them in the adapters' arenas (and
/// tails of vec4s: `A` of q is 3 × 45), which the norm and the update run over.
#[test]
fn one_adamw_step_matches_the_f64_optimizer_at_odd_sizes() {
    let config = ModelConfig {
        dim: 45,
        ffn_dim: 20,
        heads: 2,
        kv_heads: 1,
        head_dim: 12,
        ..ModelConfig::tiny(Family::Llama)
    };
    let lora = lora(
        &[Projection::Q, Projection::V, Projection::Down],
        3,
        5.0,
        false,
    );
    check_adamw_step(&config, &lora);
}

fn check_adamw_step(config: &ModelConfig, lora: &LoraConfig) {
    let (config, lora) = (config.clone(), lora.clone());
    let g = gpu();
    let weights = Weights::random(&config, 21);
    let adapters = Adapters::random(&config, &lora, 22);
    let batch = Batch::random(&config, 23, 8, &[8, 6]);
    let (_, grads) = loss_and_grads(&config, &lora, &weights, &adapters, &batch).unwrap();
    let all: Vec<&[f64]> = grads
        .lora
        .iter()
        .flat_map(|(_, _, a)| [&a.a[..], &a.b[..]])
        .collect();
    let norm = global_grad_norm(&all);
    // Clip to half the norm, so that the coefficient matters.
    let optimizer = Optimizer {
        max_grad_norm: Some(norm / 2.0),
        lora_plus_ratio: 4.0,
        ..Optimizer::default()
    };
    let coefficient = clip_coefficient(norm, norm / 2.0);
    let lr = 1e-3;

    let model = GpuModel::upload(g, &config, &weights).unwrap();
    let mut gpu_adapters = GpuAdapters::upload(g, &config, &lora, &adapters).unwrap();
    let mut buffers = StepBuffers::new(g, &model, &gpu_adapters, StepShape::new(2, 8)).unwrap();
    buffers
        .load(g, &config, std::slice::from_ref(&batch))
        .unwrap();
    let mut rec = g.recorder();
    record_forward_backward(&mut rec, &model, &mut gpu_adapters, &mut buffers).unwrap();
    record_optimizer_step(
        &mut rec,
        &optimizer,
        (lr, 1),
        &mut gpu_adapters,
        &mut buffers,
    )
    .unwrap();
    rec.submit().unwrap();
    let gpu_norm = buffers.grad_norm().read(g).unwrap()[0] as f64;
    assert!(
        (gpu_norm - norm).abs() <= 1e-4 * norm,
        "norm {gpu_norm} vs {norm}"
    );
    let got = gpu_adapters.download(g).unwrap();

    for (layer, p, start) in adapters.iter() {
        let grad = grads.lora.get(layer, p).unwrap();
        let name = Adapters::peft_key(layer, p);
        for (which, theta, grad, rate) in [
            ("lora_A", &start.a, &grad.a, lr),
            ("lora_B", &start.b, &grad.b, 4.0 * lr),
        ] {
            let clipped: Vec<f64> = grad.iter().map(|g| g * coefficient).collect();
            let mut state = State {
                theta: theta.clone(),
                m: vec![0.0; theta.len()],
                v: vec![0.0; theta.len()],
            };
            adamw_step(&optimizer.adamw, rate, 1, &clipped, &mut state);
            let got = if which == "lora_A" {
                &got.get(layer, p).unwrap().a
            } else {
                &got.get(layer, p).unwrap().b
            };
            // The update itself (θ − θ0) to 1e-3 of its largest element: at step 1 each
            // element moves by about lr·sign(g), so a wrong rate, sign or clip shows at once.
            let moved: Vec<f64> = got.iter().zip(theta).map(|(a, b)| a - b).collect();
            let want: Vec<f64> = state.theta.iter().zip(theta).map(|(a, b)| a - b).collect();
            assert_matches(&format!("{name}.{which} update"), &moved, &want, 1e-3);
        }
    }
}

/// A gradient that is not finite (an adapter holding NaN) is reported by the norm, and the
/// update is skipped: the other adapters keep their values.
#[test]
fn a_step_whose_gradient_is_not_finite_changes_nothing() {
    let g = gpu();
    let config = ModelConfig::tiny(Family::Llama);
    let lora = LoraConfig::default();
    let weights = Weights::random(&config, 31);
    let mut adapters = Adapters::random(&config, &lora, 32);
    adapters.get_mut(1, Projection::V).unwrap().b[0] = f64::NAN;
    let batch = Batch::random(&config, 33, 8, &[8, 8]);
    let model = GpuModel::upload(g, &config, &weights).unwrap();
    let mut gpu_adapters = GpuAdapters::upload(g, &config, &lora, &adapters).unwrap();
    let mut buffers = StepBuffers::new(g, &model, &gpu_adapters, StepShape::new(2, 8)).unwrap();
    buffers.load(g, &config, &[batch]).unwrap();
    let mut rec = g.recorder();
    record_forward_backward(&mut rec, &model, &mut gpu_adapters, &mut buffers).unwrap();
    record_optimizer_step(
        &mut rec,
        &Optimizer::default(),
        (1e-2, 1),
        &mut gpu_adapters,
        &mut buffers,
    )
    .unwrap();
    rec.submit().unwrap();
    assert!(!buffers.grad_norm().read(g).unwrap()[0].is_finite());
    let after = gpu_adapters.download(g).unwrap();
    let (layer, p) = (0, Projection::Q);
    assert_eq!(
        after.get(layer, p),
        adapters.get(layer, p),
        "{layer}.{p:?} was updated"
    );
}

/// The training test: a tiny random Llama with PEFT-initialised adapters on all seven
/// projections learns a fixed text: its loss falls below a tenth of where it starts in 30
/// steps (7.7 → 0.36 on lavapipe), and a second run from the same seeds gives bit-identical
/// losses.
#[test]
fn a_tiny_model_learns_a_text_and_trains_deterministically() {
    let losses = train_tiny(30);
    let (first, last) = (losses[0], losses[losses.len() - 1]);
    assert!(last < 0.1 * first, "loss {first} → {last}: {losses:?}");
    assert_eq!(losses, train_tiny(30), "a second run differs");
}

fn train_tiny(steps: u32) -> Vec<f32> {
    // Without the debug build's check of every pipeline-cache hit (a rebuild of each kernel at
    // each launch: 1 s of a step's 1.1 s on lavapipe); the other tests check the same kernels.
    static GPU: std::sync::OnceLock<Gpu> = std::sync::OnceLock::new();
    let g = GPU.get_or_init(|| {
        let options = GpuOptions {
            verify_cache_hits: false,
            ..GpuOptions::default()
        };
        Gpu::with_options(options).expect("the GPU tests need an adapter")
    });
    let config = ModelConfig {
        max_seq: 16,
        ..ModelConfig::tiny(Family::Llama)
    };
    let lora = lora(&Projection::ALL, 8, 16.0, false);
    let text = b"the quick brown fox jumps over the lazy dog; the dog sleeps.";
    // Printable ASCII as ids 0..95.
    let ids: Vec<u32> = text.iter().map(|&c| (c - b' ') as u32).collect();
    let (batch, seq_len) = (2, 16);
    let tokens: Vec<u32> = (0..batch * seq_len)
        .map(|t| ids[(t / seq_len) * 20 + t % seq_len])
        .collect();
    let targets = (0..tokens.len())
        .map(|t| {
            let (b, s) = (t / seq_len, t % seq_len);
            if s + 1 < seq_len {
                ids[b * 20 + s + 1] as i64
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
        lens: vec![seq_len; batch],
    };
    let weights = Weights::random(&config, 41);
    let adapters = Adapters::init_peft(&config, &lora, 42);
    let model = GpuModel::upload(g, &config, &weights).unwrap();
    let mut gpu_adapters = GpuAdapters::upload(g, &config, &lora, &adapters).unwrap();
    let mut buffers =
        StepBuffers::new(g, &model, &gpu_adapters, StepShape::new(batch, seq_len)).unwrap();
    buffers.load(g, &config, &[data]).unwrap();
    let optimizer = Optimizer::default();
    // Each step's loss is read while the next step runs: the read starts right after the
    // step's submit and is collected after the next step's.
    let mut losses = vec![];
    let mut pending = None;
    let mut compiled_by_step_1 = 0;
    for step in 1..=steps + 1 {
        if step <= steps {
            let mut rec = g.recorder();
            record_forward_backward(&mut rec, &model, &mut gpu_adapters, &mut buffers).unwrap();
            let at = (1e-2, step);
            record_optimizer_step(&mut rec, &optimizer, at, &mut gpu_adapters, &mut buffers)
                .unwrap();
            rec.submit().unwrap();
        }
        if step == 1 {
            compiled_by_step_1 = g.cache_stats().misses;
        }
        if let Some(previous) = pending.take() {
            let loss: Vec<f32> = hesper::exec::PendingRead::wait(previous, g).unwrap();
            losses.push(loss[0]);
        }
        if step <= steps {
            pending = Some(buffers.loss().read_start(g).unwrap());
        }
    }
    // The learning rate and the step number are runtime values: no step after the first
    // compiles a pipeline.
    assert_eq!(
        g.cache_stats().misses,
        compiled_by_step_1,
        "a later step compiled"
    );
    losses
}

/// The message of an error, which must name every one of `words`.
fn assert_names<T>(result: Result<T, hesper::model::config::ModelError>, words: &[&str]) {
    let Err(error) = result else {
        panic!("no error; expected one naming {words:?}");
    };
    let message = error.to_string();
    for word in words {
        assert!(message.contains(word), "{message:?} does not name {word:?}");
    }
}

#[test]
fn bad_inputs_are_errors_that_name_the_item() {
    let g = gpu();
    let config = ModelConfig::tiny(Family::Llama);
    let lora = LoraConfig::default();
    let weights = Weights::random(&config, 51);
    let adapters = Adapters::init_peft(&config, &lora, 52);

    let odd_head = ModelConfig {
        head_dim: 6,
        heads: 4,
        ..config.clone()
    };
    assert_names(
        GpuModel::upload(g, &odd_head, &Weights::random(&odd_head, 1)),
        &["head_dim", "multiple of 4", "6"],
    );
    let mut short = weights.clone();
    short.layers[1].q.pop();
    assert_names(
        GpuModel::upload(g, &config, &short),
        &["layers.1.self_attn.q_proj", "4096", "4095"],
    );
    let rank0 = LoraConfig {
        rank: 0,
        ..lora.clone()
    };
    assert_names(
        GpuAdapters::upload(g, &config, &rank0, &adapters),
        &["rank", "positive"],
    );

    let model = GpuModel::upload(g, &config, &weights).unwrap();
    let gpu_adapters = GpuAdapters::upload(g, &config, &lora, &adapters).unwrap();
    assert_names(
        StepBuffers::new(g, &model, &gpu_adapters, StepShape::new(2, 9)),
        &["seq_len", "max_seq = 8", "9"],
    );
    let mut buffers = StepBuffers::new(g, &model, &gpu_adapters, StepShape::new(2, 8)).unwrap();
    let mut batch = Batch::random(&config, 53, 8, &[8, 8]);
    batch.tokens[5] = 97;
    assert_names(
        buffers.load(g, &config, std::slice::from_ref(&batch)),
        &["tokens[5]", "vocab = 97", "97"],
    );
    let other = Batch::random(&config, 54, 4, &[4, 4]);
    assert_names(
        buffers.load(g, &config, &[other]),
        &["micro-batch 0", "2 sequences of 8", "2 sequences of 4"],
    );
    let mut adapters_on_gpu = GpuAdapters::upload(g, &config, &lora, &adapters).unwrap();
    let mut rec = g.recorder();
    for (optimizer, at, words) in [
        (
            Optimizer::default(),
            (1e-3, 0),
            &["Optimizer", "step", "from 1"][..],
        ),
        (Optimizer::default(), (f64::NAN, 1), &["lr", "NaN"]),
        (
            Optimizer {
                lora_plus_ratio: -2.0,
                ..Optimizer::default()
            },
            (1e-3, 1),
            &["lora_plus_ratio", "-2"],
        ),
        (
            Optimizer {
                max_grad_norm: Some(0.0),
                ..Optimizer::default()
            },
            (1e-3, 1),
            &["max_grad_norm"],
        ),
    ] {
        let result =
            record_optimizer_step(&mut rec, &optimizer, at, &mut adapters_on_gpu, &mut buffers);
        assert_names(result, words);
    }
    assert!(
        rec.is_empty(),
        "a refused optimizer step recorded {} launches",
        rec.len()
    );
    drop(rec);
    let narrow = ModelConfig {
        dim: 32,
        ..config.clone()
    };
    let narrow_adapters = Adapters::init_peft(&narrow, &lora, 1);
    let narrow_on_gpu = GpuAdapters::upload(g, &narrow, &lora, &narrow_adapters).unwrap();
    let shape = StepShape::new(2, 8);
    assert_names(
        StepBuffers::new(g, &model, &narrow_on_gpu, shape),
        &["GpuAdapters", "config", "dim: 32"],
    );
    let mut rec = g.recorder();
    let mut narrow_on_gpu = narrow_on_gpu;
    let result = record_forward_backward(&mut rec, &model, &mut narrow_on_gpu, &mut buffers);
    assert_names(
        result,
        &["StepBuffers", "another model, precision or LoRA config"],
    );
    assert!(
        rec.is_empty(),
        "mismatched adapters recorded {} launches",
        rec.len()
    );
    // Buffers of the f32 model under the same model in f16 (whose lm-head backward may be
    // split, with scratch the f32 buffers lack): refused, nothing recorded.
    if g.supports_f16() {
        let half = GpuModel::upload_with_precision(g, &config, &weights, Precision::F16).unwrap();
        let mut on_gpu = GpuAdapters::upload(g, &config, &lora, &adapters).unwrap();
        let result = record_forward_backward(&mut rec, &half, &mut on_gpu, &mut buffers);
        assert_names(result, &["StepBuffers", "F32"]);
        assert!(rec.is_empty());
    }
    drop(rec);
    let good = Batch::random(&config, 55, 8, &[8, 8]);
    assert_names(
        buffers.load(g, &config, &[good.clone(), good]),
        &["micro-batches", "1 micro-batches", "2"],
    );
}

/// A tiny model of `family` with a context of 64, random weights and random adapters on
/// several projections (different ones per family, so every adapted path is decoded somewhere).
fn decoding_model(family: Family, seed: u64) -> (ModelConfig, LoraConfig, Weights, Adapters) {
    let config = ModelConfig {
        max_seq: 64,
        ..ModelConfig::tiny(family)
    };
    let targets: &[Projection] = match family {
        Family::Llama | Family::BitNet => &Projection::ALL,
        Family::Qwen2 => &[
            Projection::Q,
            Projection::K,
            Projection::V,
            Projection::Down,
        ],
        Family::Qwen3 => &[Projection::Q, Projection::K, Projection::O, Projection::Up],
    };
    let lora = lora(targets, 4, 8.0, false);
    let weights = Weights::random(&config, seed);
    let adapters = Adapters::random(&config, &lora, seed + 1);
    (config, lora, weights, adapters)
}

const FAMILIES: [Family; 4] = [Family::Llama, Family::Qwen2, Family::Qwen3, Family::BitNet];

/// The KV cache's logits at every position of a 20-token sequence against the f64 model's and
/// the GPU's full forward (`Generator::next_logits`), for every family: the first 5 tokens
/// appended at once (the prompt), the rest one at a time; then the cache cleared and the same
/// sequence decoded again from position 0, to the bit. On a device of its own, so that its
/// pipeline count is its own: no token after the first compiles one.
#[test]
fn kv_cache_logits_match_the_full_forward_for_every_family() {
    let g = Gpu::new().expect("the GPU tests need an adapter");
    for (f, family) in FAMILIES.into_iter().enumerate() {
        let (config, lora, weights, adapters) = decoding_model(family, 60 + 2 * f as u64);
        let model = GpuModel::upload(&g, &config, &weights).unwrap();
        let gpu_adapters = GpuAdapters::upload(&g, &config, &lora, &adapters).unwrap();
        let n = 20;
        let batch = Batch::random(&config, 70 + f as u64, n, &[n]);
        let want = reference_logits(&config, &lora, &weights, &adapters, &batch).unwrap();
        let v = config.vocab;
        let mut cache = KvCache::new(&g, &model, &gpu_adapters, 24).unwrap();
        let mut generator = Generator::new(&g, &model).unwrap();
        let prompt = 5;
        let mut all = vec![];
        let mut compiled_after_first = None;
        let mut pos = 0;
        while pos < n {
            let take = if pos == 0 { prompt } else { 1 };
            let tokens = &batch.tokens[pos..pos + take];
            let got = cache.append(&g, &model, &gpu_adapters, tokens).unwrap();
            pos += take;
            assert_eq!(cache.len(), pos);
            let last = pos - 1;
            let what = format!("{family:?}: the cache's logits at position {last}");
            let got64: Vec<f64> = got.iter().map(|&z| z as f64).collect();
            assert_matches(&what, &got64, &want[last * v..][..v], 1e-5);
            let full = generator
                .next_logits(&g, &model, &gpu_adapters, &batch.tokens[..pos])
                .unwrap();
            let full: Vec<f64> = full.iter().map(|&z| z as f64).collect();
            let what = format!("{family:?}: the cache against the full forward at {last}");
            assert_matches(&what, &got64, &full, 1e-5);
            all.push(got);
            if pos == prompt + 1 {
                compiled_after_first = Some(g.cache_stats().misses);
            }
        }
        // One token's launches are the same at every position: the second decoded token on
        // compiles nothing (the full forward's buffers compiled theirs before it).
        assert_eq!(
            g.cache_stats().misses,
            compiled_after_first.unwrap(),
            "{family:?}: a later token compiled a pipeline"
        );
        cache.clear();
        assert!(cache.is_empty());
        for (i, t) in batch.tokens.iter().enumerate() {
            let got = cache.append(&g, &model, &gpu_adapters, &[*t]).unwrap();
            if i + 1 >= prompt {
                assert_eq!(got, all[i + 1 - prompt], "{family:?}: position {i} again");
            }
        }
        assert_eq!(cache.tokens(), &batch.tokens[..]);
    }
}

/// Greedy generation over the cache (`Generator::generate`) gives exactly the tokens of the
/// full forward's argmax at every step (`Generator::next_logits`), for 30 tokens, every family;
/// a second generation reuses the cache from position 0; and (Llama) the model's context ends
/// a longer one.
#[test]
fn greedy_generation_with_the_kv_cache_matches_the_full_forward() {
    let g = gpu();
    for (f, family) in FAMILIES.into_iter().enumerate() {
        let (config, lora, weights, adapters) = decoding_model(family, 80 + 2 * f as u64);
        let model = GpuModel::upload(g, &config, &weights).unwrap();
        let gpu_adapters = GpuAdapters::upload(g, &config, &lora, &adapters).unwrap();
        let mut generator = Generator::new(g, &model).unwrap();
        let prompt = [7, 3, 90, 12, 5, 41];
        let argmax = |z: &[f32]| Sampling::Greedy.choose(z, &mut Rng::new(0));
        let mut want = vec![];
        let mut tokens = prompt.to_vec();
        for _ in 0..30 {
            let z = generator
                .next_logits(g, &model, &gpu_adapters, &tokens)
                .unwrap();
            want.push(argmax(&z));
            tokens.push(argmax(&z));
        }
        for round in 0..2 {
            let mut rng = Rng::new(0);
            let greedy = (Sampling::Greedy, &mut rng);
            let got = generator
                .generate(g, &model, &gpu_adapters, &prompt, 30, greedy, &[], |_| {})
                .unwrap();
            assert_eq!(got, want, "{family:?}, generation {round}");
        }
        // The cache itself, pipelined on the GPU's choices: it holds the prompt and every new
        // token but the last, and goes on from there as the full forward does.
        let mut cache = KvCache::new(g, &model, &gpu_adapters, 64).unwrap();
        let got = cache
            .generate_greedy(g, &model, &gpu_adapters, &prompt, 30, &[], |_| {})
            .unwrap();
        assert_eq!(got, want, "{family:?}: generate_greedy");
        assert_eq!(cache.tokens(), [&prompt[..], &want[..29]].concat());
        let z = cache.append(g, &model, &gpu_adapters, &want[29..]).unwrap();
        let all = [&prompt[..], &want[..]].concat();
        let full = generator
            .next_logits(g, &model, &gpu_adapters, &all)
            .unwrap();
        let f64s = |v: &[f32]| v.iter().map(|&z| z as f64).collect::<Vec<_>>();
        assert_matches(
            &format!("{family:?}: after it"),
            &f64s(&z),
            &f64s(&full),
            1e-5,
        );
        // A stop token ends it with the token, the speculated position dropped.
        cache.clear();
        let first = want.iter().position(|&t| t == want[4]).unwrap();
        let got = cache
            .generate_greedy(g, &model, &gpu_adapters, &prompt, 30, &[want[4]], |_| {})
            .unwrap();
        assert_eq!(got, want[..=first], "{family:?}: stopped");
        assert_eq!(cache.tokens(), [&prompt[..], &want[..first]].concat());
        if family != Family::Llama {
            continue;
        }
        // The context ends it: 64 − 6 positions left.
        let mut rng = Rng::new(0);
        let greedy = (Sampling::Greedy, &mut rng);
        let long = generator
            .generate(g, &model, &gpu_adapters, &prompt, 100, greedy, &[], |_| {})
            .unwrap();
        assert_eq!(long.len(), 64 - prompt.len(), "{family:?}");
        assert_eq!(long[..30], want[..], "{family:?}");
    }
}

#[test]
fn kv_cache_refuses_what_it_cannot_hold() {
    let g = gpu();
    let (config, lora_config, weights, adapters) = decoding_model(Family::Llama, 90);
    let model = GpuModel::upload(g, &config, &weights).unwrap();
    let gpu_adapters = GpuAdapters::upload(g, &config, &lora_config, &adapters).unwrap();
    assert_names(
        KvCache::new(g, &model, &gpu_adapters, 65),
        &["capacity", "max_seq = 64", "65"],
    );
    let mut cache = KvCache::new(g, &model, &gpu_adapters, 4).unwrap();
    assert_names(
        cache.append(g, &model, &gpu_adapters, &[]),
        &["tokens", "1 to 4"],
    );
    assert_names(
        cache.append(g, &model, &gpu_adapters, &[1, 97]),
        &["tokens[1]", "97"],
    );
    cache.append(g, &model, &gpu_adapters, &[1, 2, 3]).unwrap();
    assert_names(
        cache.append(g, &model, &gpu_adapters, &[4, 5]),
        &["tokens", "1 to 1", "2"],
    );
    assert_eq!(cache.len(), 3, "a refused append caches nothing");
    let other_lora = lora(&[Projection::V], 2, 2.0, false);
    let other = Adapters::random(&config, &other_lora, 91);
    let other = GpuAdapters::upload(g, &config, &other_lora, &other).unwrap();
    assert_names(
        cache.append(g, &model, &other, &[4]),
        &["KvCache", "another model or LoRA config"],
    );
}
