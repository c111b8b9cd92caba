//! The mixed-precision step (`GpuModel::upload_with_precision(.., Precision::F16)`): frozen
//! projections held in f16, GEMMs at `Precision::F16`, everything else f32. Against the f64
//! model of the same weights rounded to f16: to the f32 step's tolerance where the GEMMs run in
//! f32 (lavapipe: only the weights are rounded), and to f16's where they run on tensor cores
//! (the GEMMs' inputs are rounded too). Also its memory, its decoding, and the weights it
//! refuses.

use hesper::exec::Gpu;
use hesper::exec::half::f16;
use hesper::kernels::linear::{
    Gemm, GemmPath, HalfBuffers, Precision, Product, gemm_blocks_fit, gemm_output_blocks_path,
    gemm_path,
};
use hesper::kernels::testing::gpu;
use hesper::model::config::{Family, LoraConfig, ModelConfig, Projection};
use hesper::model::reference::{Adapters, Batch, Weights, logits, loss_and_grads};
use hesper::model::{
    GpuAdapters, GpuModel, KvCache, StepBuffers, StepShape, record_forward_backward,
};

/// `weights` with every matrix the mixed-precision model holds in f16 (the projections, an
/// untied lm-head) rounded to it, as the GPU holds them.
fn rounded(weights: &Weights) -> Weights {
    let round = |v: &mut Vec<f64>| {
        for x in v.iter_mut() {
            *x = f16::from_f64(*x).to_f64();
        }
    };
    let mut w = weights.clone();
    for layer in &mut w.layers {
        for m in [
            &mut layer.q,
            &mut layer.k,
            &mut layer.v,
            &mut layer.o,
            &mut layer.gate,
            &mut layer.up,
            &mut layer.down,
        ] {
            round(m);
        }
    }
    if let Some(head) = &mut w.lm_head {
        round(head);
    }
    w
}

/// Whether `g` runs a GEMM of the step of `config` at `Precision::F16` on tensor cores (which
/// round its f32 inputs to f16), rather than in f32.
fn on_tensor_cores(g: &Gpu, config: &ModelConfig, tokens: usize) -> bool {
    let (n, k) = (config.ffn_dim, config.dim);
    let w = g.zeros::<f16>(n * k).unwrap();
    let gemm = Gemm::new(Product::Nt, (tokens, n, k), false).with_precision(Precision::F16);
    let weights = hesper::kernels::linear::Weights::Half { w: &w, scale: 1.0 };
    matches!(
        gemm_path(g, &gemm, &weights, HalfBuffers::NONE),
        GemmPath::TensorCores { .. }
    )
}

/// The largest `|got − want|` over the largest `|want|` (the f32 step's tests' measure).
fn relative_error(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let max = want.iter().fold(0f64, |m, v| m.max(v.abs()));
    assert!(max > 0.0, "a reference of zeros tests nothing");
    let err = got
        .iter()
        .zip(want)
        .map(|(g, w)| (g - w).abs())
        .fold(0f64, |m, e| if e.is_nan() { f64::NAN } else { m.max(e) });
    err / max
}

fn lora(targets: &[Projection]) -> LoraConfig {
    LoraConfig {
        targets: targets.to_vec(),
        rank: 4,
        alpha: 8.0,
        rslora: false,
    }
}

/// The mixed-precision step of a tiny `family` model (random weights and non-zero adapters, two
/// sequences, one short, the loss in uneven chunks) against the f64 model of its f16 weights:
/// the loss, every adapter gradient and the gradient at the embedding output.
fn check_family(family: Family, lora: LoraConfig) {
    check_step(
        gpu(),
        ModelConfig::tiny(family),
        lora,
        (8, &[8, 5]),
        3,
        2e-2,
    );
}

/// [`check_family`] over sequences of `seq_len` with `lens` real positions each, the loss in
/// chunks of `loss_chunk` rows, the gradients within `tensor_core_tol` on tensor cores.
fn check_step(
    g: &Gpu,
    config: ModelConfig,
    lora: LoraConfig,
    (seq_len, lens): (usize, &[usize]),
    loss_chunk: usize,
    tensor_core_tol: f64,
) {
    let family = config.family;
    let config = ModelConfig {
        max_seq: seq_len,
        ..config
    };
    let weights = Weights::random(&config, 11);
    let adapters = Adapters::random(&config, &lora, 12);
    let batch = Batch::random(&config, 13, seq_len, lens);
    let model = GpuModel::upload_with_precision(g, &config, &weights, Precision::F16).unwrap();
    assert_eq!(model.precision(), Precision::F16);
    let mut gpu_adapters = GpuAdapters::upload(g, &config, &lora, &adapters).unwrap();
    let shape = StepShape {
        batch: lens.len(),
        seq_len,
        micro_batches: 1,
        loss_chunk,
        recompute: false,
    };
    let mut buffers = StepBuffers::new(g, &model, &gpu_adapters, shape).unwrap();
    buffers
        .load(g, &config, std::slice::from_ref(&batch))
        .unwrap();
    let mut rec = g.recorder();
    record_forward_backward(&mut rec, &model, &mut gpu_adapters, &mut buffers).unwrap();
    rec.submit().unwrap();
    let loss = buffers.loss().read(g).unwrap()[0] as f64;
    let grads = gpu_adapters.download_grads(g).unwrap();
    let d_x0: Vec<f64> = (buffers.d_embeddings().read(g).unwrap().iter())
        .map(|&v| v as f64)
        .collect();

    let half = rounded(&weights);
    let (want_loss, want) = loss_and_grads(&config, &lora, &half, &adapters, &batch).unwrap();
    // f32 GEMMs: the f32 step's tolerances. Tensor cores round each GEMM's f32 input to f16
    // (2⁻¹¹ relative) and its error is carried through both blocks and back.
    let tensor_cores = on_tensor_cores(g, &config, shape.batch * shape.seq_len);
    let (loss_tol, tol) = if tensor_cores {
        (2e-3, tensor_core_tol)
    } else {
        (1e-5, 1e-4)
    };
    let what = format!("{family:?} (tensor cores: {tensor_cores})");
    let loss_err = (loss - want_loss).abs() / want_loss;
    println!("{what}: loss {loss} against {want_loss} ({loss_err:e})");
    assert!(loss_err <= loss_tol, "{what}: loss {loss}, f64 {want_loss}");
    let mut worst = 0f64;
    for (layer, p, want) in want.lora.iter() {
        let got = grads.get(layer, p).unwrap();
        let name = Adapters::peft_key(layer, p);
        for (m, got, want) in [("A", &got.a, &want.a), ("B", &got.b, &want.b)] {
            let err = relative_error(got, want);
            assert!(err <= tol, "{what}: {name}.lora_{m}: error {err:e}");
            worst = worst.max(err);
        }
    }
    let err = relative_error(&d_x0, &want.d_x0);
    assert!(err <= tol, "{what}: d_x0: error {err:e}");
    println!("{what}: LoRA gradients within {worst:e}, d_x0 within {err:e} of f64");
}

#[test]
fn mixed_llama_step_matches_the_f64_model_of_its_f16_weights() {
    check_family(Family::Llama, lora(&Projection::ALL));
}

#[test]
fn mixed_qwen_and_bitnet_steps_match_the_f64_model_of_their_f16_weights() {
    check_family(Family::Qwen2, lora(&[Projection::Q, Projection::V]));
    check_family(
        Family::Qwen3,
        lora(&[Projection::K, Projection::O, Projection::Up]),
    );
    check_family(Family::BitNet, lora(&Projection::ALL));
}

/// A model of 8192 classes whose logits are near uniform, over 1022 targets: the mean loss's
/// gradient at the logits is ~1/(8192·1022) ≈ 1.2e-7, among f16's subnormals (the smallest
/// normal is 6.1e-5). The step scales its backward GEMMs' inputs by `2^⌊log2 N⌋` before the
/// tensor cores round them (`Gemm::input_exponent`): on the H200 the LoRA gradients are then
/// within 6.3e-4 of the f64 model, without it 5.9e-3 (at 16 384 classes 9.6e-3; on SmolLM2,
/// 49 152 classes over 4088 targets, 58% at the median). Without tensor cores the GEMMs
/// multiply in f32 and this is the f32 tolerance. On tensor cores the lm-head's backward
/// (`[300, 32]` over a depth of 8192) is split in 8 parts (`linear::split`).
#[test]
fn a_mixed_step_over_many_targets_keeps_its_gradients_digits() {
    let config = ModelConfig {
        vocab: 8192,
        dim: 32,
        ffn_dim: 64,
        layers: 1,
        heads: 2,
        kv_heads: 1,
        ..ModelConfig::tiny(Family::Llama)
    };
    // With the down projection adapted `h` stays f32; with PEFT's default (q, v) the step
    // keeps it in f16 on tensor cores (`Hidden::F16`), as it does gate and up.
    for targets in [
        &[Projection::Q, Projection::V, Projection::Down][..],
        &[Projection::Q, Projection::V],
    ] {
        let config = config.clone();
        check_step(
            gpu(),
            config,
            lora(targets),
            (256, &[256, 256, 256, 254]),
            300,
            2e-3,
        );
    }
}

/// The query, key and value projections as one GEMM each way, which run only on tensor cores
/// (lavapipe has none): forward, `[q | k | v]` block-major out of one GEMM over `[W_q; W_k;
/// W_v]` (`execute_gemm_output_blocks`), each adapted projection's up-projection folded over
/// its own columns (`LoraUps`), biases a launch each after it; backward, the input gradient
/// over the block-major `[dq | dk | dv]` (`execute_gemm_blocks`: with q and v adapted, both
/// up-projections folded in, a step's depth each). The steps of a tiny Qwen2 with LoRA on q
/// and v (both GEMMs merged, with their folds), on q, k and v (the forward merged, the three
/// up-projections sharing its fold's depth; the backward three GEMMs), on o (both merged, with
/// biases), and a tiny Llama with LoRA on o and down (both merged) on the DSL's
/// interpreter's tensor cores, against the f64 model.
#[test]
fn the_merged_qkv_gemms_match_the_f64_model_on_the_interpreters_tensor_cores() {
    let g = hesper::kernels::testing::interpreter_with_tensor_cores();
    let cases = [
        (Family::Qwen2, lora(&[Projection::Q, Projection::V])),
        (
            Family::Qwen2,
            lora(&[Projection::Q, Projection::K, Projection::V]),
        ),
        (Family::Qwen2, lora(&[Projection::O])),
        (Family::Llama, lora(&[Projection::O, Projection::Down])),
    ];
    for (family, lora) in cases {
        let config = ModelConfig::tiny(family);
        // The step takes the one GEMM where it fits: the tiny models' blocks (64 | 32 | 32)
        // do, in a standard tile's 32-deep step and its 32 columns.
        let (hq, hkv) = (
            config.heads * config.head_dim,
            config.kv_heads * config.head_dim,
        );
        let w = g.zeros::<f16>((hq + 2 * hkv) * config.dim).unwrap();
        let weights = hesper::kernels::linear::Weights::Half { w: &w, scale: 1.0 };
        let widths = [hq, hkv, hkv];
        let backward = (16, hq + 2 * hkv, config.dim);
        let backward = Gemm::new(Product::Nn, backward, false).with_precision(Precision::F16);
        let half = HalfBuffers::NONE;
        assert!(gemm_blocks_fit(g, &backward, &widths, &weights, half));
        let forward = (16, hq + 2 * hkv, config.dim);
        let forward = Gemm::new(Product::Nt, forward, false).with_precision(Precision::F16);
        let path = gemm_output_blocks_path(g, &forward, &widths, &weights, half);
        assert!(
            matches!(path, Some(GemmPath::TensorCores { .. })),
            "{path:?}"
        );
        check_step(g, config, lora, (8, &[8, 5]), 3, 2e-2);
    }
}

/// The f16 model takes 2 bytes a projection weight (and untied head weight) where the f32 one
/// takes 4; everything else the same.
#[test]
fn the_mixed_model_holds_its_projections_in_half_the_memory() {
    let g = gpu();
    // Llama's tiny model ties its embedding, Qwen2's has a head of its own.
    for (family, untied) in [(Family::Llama, false), (Family::Qwen2, true)] {
        let config = ModelConfig::tiny(family);
        let weights = Weights::random(&config, 5);
        let f32_model = GpuModel::upload(g, &config, &weights).unwrap();
        let f16_model = GpuModel::upload_with_precision(g, &config, &weights, Precision::F16);
        let f16_model = f16_model.unwrap();
        let halved: usize = (weights.layers.iter())
            .flat_map(|l| Projection::ALL.map(|p| l.projection(p).len()))
            .sum::<usize>()
            + weights.lm_head.as_ref().map_or(0, Vec::len);
        assert!(untied == weights.lm_head.is_some(), "{family:?}: the head");
        assert_eq!(
            f32_model.memory_bytes() - f16_model.memory_bytes(),
            2 * halved as u64,
            "{family:?}"
        );
    }
}

/// Decoding a mixed-precision model (f16 weights, f32 products: one row is never a tensor
/// core's tile) gives the f64 logits of its f16 weights at every position.
#[test]
fn decoding_a_mixed_model_matches_the_f64_model_of_its_f16_weights() {
    let g = gpu();
    for family in [Family::Llama, Family::Qwen2] {
        let config = ModelConfig {
            max_seq: 32,
            ..ModelConfig::tiny(family)
        };
        let lora = lora(&[Projection::Q, Projection::V, Projection::Down]);
        let weights = Weights::random(&config, 21);
        let adapters = Adapters::random(&config, &lora, 22);
        let model = GpuModel::upload_with_precision(g, &config, &weights, Precision::F16).unwrap();
        let gpu_adapters = GpuAdapters::upload(g, &config, &lora, &adapters).unwrap();
        let n = 6;
        let batch = Batch::random(&config, 23, n, &[n]);
        let want = logits(&config, &lora, &rounded(&weights), &adapters, &batch).unwrap();
        let v = config.vocab;
        let mut cache = KvCache::new(g, &model, &gpu_adapters, 8).unwrap();
        for pos in 0..n {
            let got = cache
                .append(g, &model, &gpu_adapters, &batch.tokens[pos..=pos])
                .unwrap();
            let got: Vec<f64> = got.iter().map(|&z| z as f64).collect();
            let err = relative_error(&got, &want[pos * v..][..v]);
            assert!(err <= 1e-5, "{family:?}: logits at {pos}: error {err:e}");
        }
    }
}

/// A weight beyond f16's range is an error naming the matrix (the f32 model takes it).
#[test]
fn a_weight_beyond_f16_is_an_error_naming_the_matrix() {
    let g = gpu();
    let config = ModelConfig::tiny(Family::Llama);
    let mut weights = Weights::random(&config, 31);
    weights.layers[1].up[3] = -1e5;
    let err = GpuModel::upload_with_precision(g, &config, &weights, Precision::F16)
        .err()
        .expect("-1e5 is beyond f16")
        .to_string();
    for word in ["GpuModel", "layers[1].Up", "65504", "-100000"] {
        assert!(err.contains(word), "`{word}` is not in: {err}");
    }
    GpuModel::upload(g, &config, &weights).unwrap();
}
