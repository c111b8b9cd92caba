//! The f64 reference model: its gradients against finite differences of its loss, for every
//! family, and the properties the seeds' known mistakes (KERNELS.md) break — each test says
//! which mistake it catches.

use hesper::kernels::testing::{Rng, finite_difference};
use hesper::model::config::{Family, LoraConfig, ModelConfig, ModelError, Projection};
use hesper::model::reference::{
    Adapters, Batch, Grads, IGNORE_INDEX, Weights, embed, loss, loss_and_grads,
    loss_from_embeddings,
};

/// Small enough for finite differences of every adapter element: D = 8, vocab 17,
/// 4 query / 2 KV heads of 4 (so `H·hd = 16 ≠ D`).
/// `norm_eps` is large enough that an RMSNorm backward with another ε than the forward's fails
/// the finite-difference checks (a seed's mistake); Llama and Qwen3 tie the embedding.
fn tiny(family: Family) -> ModelConfig {
    ModelConfig {
        family,
        vocab: 17,
        dim: 8,
        ffn_dim: 12,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        head_dim: 4,
        rope_base: 10_000.0,
        norm_eps: 0.02,
        tied_embeddings: matches!(family, Family::Llama | Family::Qwen3),
        max_seq: 8,
    }
}

const FAMILIES: [Family; 4] = [Family::Llama, Family::Qwen2, Family::Qwen3, Family::BitNet];

/// LoRA on all seven projections with a scale that is not 1 (so a forgotten scale shows).
fn all_seven(rank: usize, alpha: f64, rslora: bool) -> LoraConfig {
    LoraConfig {
        targets: Projection::ALL.to_vec(),
        rank,
        alpha,
        rslora,
    }
}

/// Estimates of `∂f/∂x[i]`, tried in turn: central differences at a step of 3e-5; then at
/// steps of 5e-4 and 2.5e-4, extrapolated (Richardson: `(4·D(h/2) − D(h))/3`, exact to
/// `O(h⁴)`); then at 3e-6. Not `check_gradient`'s single step of 1e-6: the loss (≈ 3) is
/// computed to about an ulp (4e-16), which at 1e-6 is 2e-10 of the derivative, more than 1e-5
/// of many single adapter elements' gradients (1e-5 and less); the larger, extrapolated steps
/// serve the smallest gradients. The smallest step is for a stencil that straddles the kink of
/// BitNet's `relu(g)²` (a gate within a step of 0), whose error is `O(h)`. A wrong gradient
/// fails at every step.
fn derivatives<'f>(
    x: &'f [f64],
    i: usize,
    f: &'f dyn Fn(&[f64]) -> f64,
) -> impl Iterator<Item = f64> + 'f {
    let central = move |h: f64| finite_difference(x, i, h, f);
    let richardson = move || (4.0 * central(2.5e-4) - central(5e-4)) / 3.0;
    std::iter::once_with(move || central(3e-5))
        .chain(std::iter::once_with(richardson))
        .chain(std::iter::once_with(move || central(3e-6)))
}

/// Panic unless, at every element of `x`, `grad` agrees with an estimate of the derivative of
/// `f` ([`derivatives`]) to `|fd − grad| ≤ 1e-5·(1e-6 + max(|fd|, |grad|))`, `check_gradient`'s
/// test.
fn check_gradient(what: &str, x: &[f64], grad: &[f64], f: impl Fn(&[f64]) -> f64) {
    assert_eq!(x.len(), grad.len(), "{what}: gradient length");
    let err = |fd: f64, g: f64| (fd - g).abs() / (1e-6 + fd.abs().max(g.abs()));
    for (i, &g) in grad.iter().enumerate() {
        if !derivatives(x, i, &f).any(|fd| err(fd, g) < 1e-5) {
            let estimates: Vec<f64> = derivatives(x, i, &f).collect();
            panic!("{what}: d/dx[{i}] is {g} analytically but {estimates:?} by finite differences");
        }
    }
}

struct Case {
    config: ModelConfig,
    lora: LoraConfig,
    weights: Weights,
    adapters: Adapters,
    batch: Batch,
}

impl Case {
    fn new(config: ModelConfig, lora: LoraConfig, batch: Batch) -> Case {
        Case {
            weights: Weights::random(&config, 1),
            adapters: Adapters::random(&config, &lora, 2),
            config,
            lora,
            batch,
        }
    }

    fn loss_with(&self, adapters: &Adapters) -> f64 {
        loss(
            &self.config,
            &self.lora,
            &self.weights,
            adapters,
            &self.batch,
        )
        .unwrap()
    }

    fn grads(&self) -> (f64, Grads) {
        loss_and_grads(
            &self.config,
            &self.lora,
            &self.weights,
            &self.adapters,
            &self.batch,
        )
        .unwrap()
    }

    fn loss_at_embeddings(&self, x0: &[f64]) -> f64 {
        let c = self;
        loss_from_embeddings(&c.config, &c.lora, &c.weights, &c.adapters, &c.batch, x0).unwrap()
    }

    /// Every element of every `A` and `B` gradient and of `d_x0` against central differences
    /// of the loss.
    fn check_gradients(&self, grads: &Grads) {
        for (layer, p, adapter) in self.adapters.iter() {
            let grad = grads.lora.get(layer, p).unwrap();
            let name = Adapters::peft_key(layer, p);
            let perturbed = |set: &dyn Fn(&mut Adapters, &[f64]), x: &[f64]| {
                let mut adapters = self.adapters.clone();
                set(&mut adapters, x);
                self.loss_with(&adapters)
            };
            let set_a = |ad: &mut Adapters, x: &[f64]| ad.get_mut(layer, p).unwrap().a = x.to_vec();
            let set_b = |ad: &mut Adapters, x: &[f64]| ad.get_mut(layer, p).unwrap().b = x.to_vec();
            check_gradient(&format!("{name}.lora_A"), &adapter.a, &grad.a, |x| {
                perturbed(&set_a, x)
            });
            check_gradient(&format!("{name}.lora_B"), &adapter.b, &grad.b, |x| {
                perturbed(&set_b, x)
            });
        }
        let x0 = embed(&self.config, &self.weights, &self.batch).unwrap();
        check_gradient("d_x0", &x0, &grads.d_x0, |x| self.loss_at_embeddings(x));
    }
}

/// The tiny model of each family, LoRA on all seven projections with a scale ≠ 1 (rank 1 for
/// Qwen2, rsLoRA for Qwen3), random non-zero adapters, two sequences (one short) with masked
/// targets: every element of every `A`, `B` and of `d_x0` against finite differences. Catches,
/// among others, an overwritten residual gradient (d_x0), dK/dV missing for earlier positions
/// or the LoRA-V gradient fed the attention output's gradient cut to the KV width (A_v, B_v,
/// A_k with GQA), dQ used after RoPE and Qwen3's QK-norm without inverting them (A_q, B_q, A_k
/// at positions > 0), a forgotten LoRA scale, and an RMSNorm backward with another ε.
fn gradients_match_finite_differences(family: Family, lora: LoraConfig) {
    let config = tiny(family);
    let batch = Batch::random(&config, 3, 6, &[6, 4]);
    let case = Case::new(config, lora, batch);
    let (value, grads) = case.grads();
    assert_eq!(value, case.loss_with(&case.adapters));
    case.check_gradients(&grads);
}

#[test]
fn llama_gradients_match_finite_differences() {
    gradients_match_finite_differences(Family::Llama, all_seven(2, 3.0, false));
}

#[test]
fn qwen2_gradients_match_finite_differences() {
    gradients_match_finite_differences(Family::Qwen2, all_seven(1, 2.0, false));
}

#[test]
fn qwen3_gradients_match_finite_differences() {
    gradients_match_finite_differences(Family::Qwen3, all_seven(2, 3.0, true));
}

#[test]
fn bitnet_gradients_match_finite_differences() {
    gradients_match_finite_differences(Family::BitNet, all_seven(2, 5.0, false));
}

/// The GPU step's test model (B = 2, S = 8, one short sequence) for every family: the loss is
/// near `ln V` for small random weights, and the gradients agree with a finite difference
/// along a random direction of all the adapters at once, and of the embedding output.
#[test]
fn the_gpu_test_model_runs_for_every_family() {
    for family in FAMILIES {
        let config = ModelConfig::tiny(family);
        let batch = Batch::random(&config, 4, 8, &[8, 5]);
        let case = Case::new(config, all_seven(4, 8.0, false), batch);
        let (value, grads) = case.grads();
        assert!((value - 97f64.ln()).abs() < 1.0, "{family:?}: loss {value}");

        let mut rng = Rng::new(5);
        let mut direction = case.adapters.clone();
        let mut along = 0.0;
        for (layer, p, grad) in grads.lora.iter() {
            let d = direction.get_mut(layer, p).unwrap();
            for (x, g) in
                d.a.iter_mut()
                    .chain(d.b.iter_mut())
                    .zip(grad.a.iter().chain(&grad.b))
            {
                *x = rng.next_f32() as f64;
                along += *x * g;
            }
        }
        let h = 1e-6;
        let shifted = |sign: f64| {
            let mut adapters = case.adapters.clone();
            for (layer, p, d) in direction.iter() {
                let a = adapters.get_mut(layer, p).unwrap();
                for (x, u) in
                    a.a.iter_mut()
                        .chain(a.b.iter_mut())
                        .zip(d.a.iter().chain(&d.b))
                {
                    *x += sign * h * u;
                }
            }
            case.loss_with(&adapters)
        };
        let fd = (shifted(1.0) - shifted(-1.0)) / (2.0 * h);
        assert!(
            (fd - along).abs() <= 1e-5 * fd.abs(),
            "{family:?}: adapters {along} vs {fd}"
        );

        let x0 = embed(&case.config, &case.weights, &case.batch).unwrap();
        let u: Vec<f64> = (0..x0.len()).map(|_| rng.next_f32() as f64).collect();
        let along: f64 = u.iter().zip(&grads.d_x0).map(|(u, g)| u * g).sum();
        let at = |sign: f64| {
            let x: Vec<f64> = x0.iter().zip(&u).map(|(x, u)| x + sign * h * u).collect();
            case.loss_at_embeddings(&x)
        };
        let fd = (at(1.0) - at(-1.0)) / (2.0 * h);
        assert!(
            (fd - along).abs() <= 1e-5 * fd.abs(),
            "{family:?}: x0 {along} vs {fd}"
        );
    }
}

/// Catches a LoRA scale left at 0 or ignored (a seed's mistake): the loss depends on `s·B`
/// only, so doubling `α` and halving `B` keeps the loss and `dA` and doubles `dB`; and the
/// adapters do change the loss.
#[test]
fn the_lora_scale_enters_the_forward_and_both_gradients() {
    let config = tiny(Family::Llama);
    let batch = Batch::random(&config, 6, 6, &[6, 3]);
    let case = Case::new(config, all_seven(2, 3.0, false), batch);
    let (value, grads) = case.grads();
    let frozen = case.loss_with(&Adapters::zeros(&case.config, &case.lora));
    assert!((value - frozen).abs() > 1e-3, "adapters change nothing");

    let mut doubled = Case::new(
        case.config.clone(),
        all_seven(2, 6.0, false),
        case.batch.clone(),
    );
    doubled.adapters = case.adapters.clone();
    for (layer, p, _) in case.adapters.iter() {
        let b = &mut doubled.adapters.get_mut(layer, p).unwrap().b;
        b.iter_mut().for_each(|x| *x /= 2.0);
    }
    let (value2, grads2) = doubled.grads();
    assert!((value - value2).abs() < 1e-12, "{value} vs {value2}");
    for (layer, p, g) in grads.lora.iter() {
        let g2 = grads2.lora.get(layer, p).unwrap();
        let close = |x: f64, y: f64| (x - y).abs() <= 1e-9 * (1e-6 + x.abs());
        assert!(
            g.a.iter().zip(&g2.a).all(|(x, y)| close(*x, *y)),
            "{p:?} dA"
        );
        assert!(
            g.b.iter().zip(&g2.b).all(|(x, y)| close(2.0 * x, *y)),
            "{p:?} dB"
        );
        assert!(g.b.iter().any(|x| x.abs() > 1e-6), "{p:?}: dB is 0");
    }
}

/// PEFT's init: `B = 0`, so the adapted model is the frozen one and `dA = 0`, but `dB` is not
/// (a scale left at 0 makes it 0: a seed's mistake) and matches finite differences.
#[test]
fn peft_init_starts_at_the_frozen_model_with_non_zero_b_gradients() {
    let config = tiny(Family::Qwen2);
    // PEFT's default targets and α at a rank the finite differences can afford.
    let lora = LoraConfig {
        rank: 2,
        ..LoraConfig::default()
    };
    let batch = Batch::random(&config, 7, 6, &[5, 6]);
    let mut case = Case::new(config, lora, batch);
    case.adapters = Adapters::init_peft(&case.config, &case.lora, 8);
    for (_, p, adapter) in case.adapters.iter() {
        let bound = 1.0 / (p.shape(&case.config).1 as f64).sqrt();
        assert!(adapter.a.iter().all(|x| x.abs() <= bound) && adapter.a.iter().any(|&x| x != 0.0));
        assert!(adapter.b.iter().all(|&x| x == 0.0));
    }
    let (value, grads) = case.grads();
    assert_eq!(
        value,
        case.loss_with(&Adapters::zeros(&case.config, &case.lora))
    );
    for (_, p, g) in grads.lora.iter() {
        assert!(g.a.iter().all(|&x| x == 0.0), "{p:?}: dA ≠ 0 with B = 0");
        assert!(g.b.iter().any(|x| x.abs() > 1e-6), "{p:?}: dB is 0");
    }
    case.check_gradients(&grads);
}

/// Catches dK and dV computed only for the query's own position (a seed's mistake): only the
/// last position has a target, so position 0 reaches the loss through its keys and values
/// alone. With LoRA on K and V, its `d_x0` row and the K, V adapters' gradients must be non-zero
/// and match finite differences.
#[test]
fn keys_and_values_of_earlier_positions_get_gradients() {
    let config = tiny(Family::Llama);
    let lora = LoraConfig {
        targets: vec![Projection::K, Projection::V],
        rank: 2,
        alpha: 3.0,
        rslora: false,
    };
    let mut batch = Batch::random(&config, 9, 5, &[5]);
    batch.targets = vec![IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX, 7];
    let case = Case::new(config, lora, batch);
    let (_, grads) = case.grads();
    let row0 = &grads.d_x0[..case.config.dim];
    assert!(
        row0.iter().any(|x| x.abs() > 1e-4),
        "position 0 gets no gradient: {row0:?}"
    );
    case.check_gradients(&grads);
}

/// Catches the residual gradient overwritten instead of added (both seeds' mistake): with
/// `W_o = W_down = 0` (and LoRA only on Q and V) every block adds 0, so `d_x0` is the gradient
/// through the final norm and head alone, which only the residual path carries; the block's own
/// norm paths give 0 here, so an overwrite gives `d_x0 = 0`.
#[test]
fn the_residual_gradient_is_a_sum() {
    let config = tiny(Family::Qwen3);
    let batch = Batch::random(&config, 10, 6, &[6, 2]);
    let lora = LoraConfig {
        rank: 2,
        ..LoraConfig::default()
    };
    let mut case = Case::new(config, lora, batch);
    for layer in &mut case.weights.layers {
        layer.o.fill(0.0);
        layer.down.fill(0.0);
    }
    let (_, grads) = case.grads();
    assert!(grads.d_x0.iter().any(|x| x.abs() > 1e-3), "d_x0 is 0");
    case.check_gradients(&grads);
}

/// Padding: tokens at padded positions change neither the loss nor a gradient, and `d_x0` is 0
/// there.
#[test]
fn padded_tokens_change_nothing() {
    let config = tiny(Family::BitNet);
    let batch = Batch::random(&config, 11, 6, &[6, 3]);
    let case = Case::new(config, all_seven(2, 3.0, false), batch);
    let (value, grads) = case.grads();
    let mut repadded = Case::new(case.config.clone(), case.lora.clone(), case.batch.clone());
    for s in 3..6 {
        repadded.batch.tokens[6 + s] = (repadded.batch.tokens[6 + s] + 5) % 17;
    }
    let (value2, grads2) = repadded.grads();
    assert_eq!(value, value2);
    assert_eq!(grads.lora, grads2.lora);
    let d = case.config.dim;
    assert!(grads.d_x0[(6 + 3) * d..].iter().all(|&x| x == 0.0));
}

/// A batch's loss is the mean over all its targets: `N·loss` is the sum of each sequence's
/// `N_b·loss_b` (the short one alone without padding), and so are the gradients.
#[test]
fn a_batch_is_the_target_weighted_mean_of_its_sequences() {
    let config = tiny(Family::Qwen2);
    let batch = Batch::random(&config, 12, 6, &[6, 4]);
    let case = Case::new(config, all_seven(2, 3.0, false), batch);
    let (value, grads) = case.grads();
    let part = |b: usize, seq_len: usize| {
        let rows = b * 6..b * 6 + seq_len;
        let batch = Batch {
            batch: 1,
            seq_len,
            tokens: case.batch.tokens[rows.clone()].to_vec(),
            targets: case.batch.targets[rows].to_vec(),
            lens: vec![case.batch.lens[b]],
        };
        let n = batch.target_count() as f64;
        let part = Case::new(case.config.clone(), case.lora.clone(), batch);
        let (value, grads) = part.grads();
        (n, value, grads)
    };
    let (n0, v0, g0) = part(0, 6);
    let (n1, v1, g1) = part(1, 4);
    let n = case.batch.target_count() as f64;
    assert_eq!(n, n0 + n1);
    assert!(
        (n * value - (n0 * v0 + n1 * v1)).abs() < 1e-12,
        "{value} vs {v0}, {v1}"
    );
    for (layer, p, g) in grads.lora.iter() {
        let (a0, a1) = (
            g0.lora.get(layer, p).unwrap(),
            g1.lora.get(layer, p).unwrap(),
        );
        let whole = g.a.iter().chain(&g.b);
        let parts = a0.a.iter().chain(&a0.b).zip(a1.a.iter().chain(&a1.b));
        for (x, (y0, y1)) in whole.zip(parts) {
            assert!((n * x - (n0 * y0 + n1 * y1)).abs() < 1e-12, "{p:?}");
        }
    }
}

/// A batch without a target has loss 0 and no gradient.
#[test]
fn a_batch_without_targets_has_loss_zero() {
    let config = tiny(Family::Llama);
    let mut batch = Batch::random(&config, 13, 4, &[4, 2]);
    batch.targets.fill(IGNORE_INDEX);
    let case = Case::new(config, LoraConfig::default(), batch);
    let (value, grads) = case.grads();
    assert_eq!(value, 0.0);
    assert!(grads.d_x0.iter().all(|&x| x == 0.0));
    assert!(
        grads
            .lora
            .iter()
            .all(|(_, _, g)| g.a.iter().chain(&g.b).all(|&x| x == 0.0))
    );
}

#[test]
fn peft_names_keys_shapes_and_scales() {
    let config = ModelConfig::tiny(Family::Llama);
    assert_eq!(Projection::K.peft_name(), "self_attn.k_proj");
    assert_eq!(Projection::Gate.peft_name(), "mlp.gate_proj");
    assert_eq!(
        Adapters::peft_key(3, Projection::Down),
        "base_model.model.model.layers.3.mlp.down_proj"
    );
    let shapes: Vec<_> = Projection::ALL.iter().map(|p| p.shape(&config)).collect();
    let want = [
        (64, 64),
        (32, 64),
        (32, 64),
        (64, 64),
        (128, 64),
        (128, 64),
        (64, 128),
    ];
    assert_eq!(shapes, want);
    let lora = LoraConfig::default();
    assert_eq!(lora.targets, [Projection::Q, Projection::V]);
    assert_eq!((lora.rank, lora.alpha, lora.rslora), (8, 16.0, false));
    assert_eq!(lora.scale(), 2.0);
    let rslora = LoraConfig {
        rslora: true,
        ..lora
    };
    assert_eq!(rslora.scale(), 16.0 / 8f64.sqrt());
}

/// Adapters by PEFT's names, with and without the key's prefix; names of modules LoRA does not
/// target, of layers past the model, and of no module are `None`; `target_modules`' names.
#[test]
fn adapters_by_peft_names() {
    let config = tiny(Family::Llama);
    let lora = LoraConfig::default();
    let mut adapters = Adapters::random(&config, &lora, 3);
    let v1 = adapters.get(1, Projection::V).unwrap().clone();
    assert_eq!(adapters.get_by_name("layers.1.self_attn.v_proj"), Some(&v1));
    let key = Adapters::peft_key(1, Projection::V);
    assert_eq!(adapters.get_by_name(&key), Some(&v1));
    adapters
        .get_by_name_mut("layers.0.self_attn.q_proj")
        .unwrap()
        .b[2] = 7.0;
    assert_eq!(adapters.get(0, Projection::Q).unwrap().b[2], 7.0);
    for missing in [
        "layers.0.self_attn.k_proj",
        "layers.2.self_attn.q_proj",
        "layers.0.self_attn.x_proj",
        "self_attn.q_proj",
        "layers.one.self_attn.q_proj",
    ] {
        assert_eq!(adapters.get_by_name(missing), None, "{missing}");
    }
    assert_eq!(
        Projection::from_peft_name("gate_proj").unwrap(),
        Projection::Gate
    );
    assert_eq!(
        Projection::from_peft_name("mlp.down_proj").unwrap(),
        Projection::Down
    );
    assert_names(
        Projection::from_peft_name("qkv_proj"),
        &["target", "\"qkv_proj\"", "self_attn.q_proj"],
    );
}

/// The message of an error, which must name every one of `words`.
fn assert_names(error: Result<impl std::fmt::Debug, ModelError>, words: &[&str]) {
    let message = error.unwrap_err().to_string();
    for word in words {
        assert!(message.contains(word), "{message:?} does not name {word:?}");
    }
}

#[test]
fn config_errors_name_the_field() {
    let good = tiny(Family::Llama);
    let with = |f: &dyn Fn(&mut ModelConfig)| {
        let mut c = good.clone();
        f(&mut c);
        c.check()
    };
    assert!(good.check().is_ok());
    assert_names(with(&|c| c.heads = 3), &["heads", "kv_heads = 2", "3"]);
    assert_names(with(&|c| c.head_dim = 5), &["head_dim", "even", "5"]);
    assert_names(with(&|c| c.dim = 0), &["dim", "positive", "0"]);
    assert_names(with(&|c| c.kv_heads = 0), &["kv_heads", "positive"]);
    assert_names(with(&|c| c.norm_eps = 0.0), &["norm_eps", "positive"]);
    assert_names(with(&|c| c.rope_base = f64::NAN), &["rope_base", "NaN"]);

    let lora = |f: &dyn Fn(&mut LoraConfig)| {
        let mut l = LoraConfig::default();
        f(&mut l);
        l.check()
    };
    assert!(lora(&|_| {}).is_ok());
    assert_names(lora(&|l| l.rank = 0), &["LoraConfig", "rank", "positive"]);
    assert_names(lora(&|l| l.targets.clear()), &["targets", "empty"]);
    assert_names(
        lora(&|l| l.targets.push(Projection::Q)),
        &["targets", "unique", "Q twice"],
    );
}

/// What the model is given is checked, and an error names what is wrong: `loss` returns it.
#[test]
fn inputs_errors_name_the_tensor_or_element() {
    let config = tiny(Family::Llama);
    let good = Case::new(
        config.clone(),
        LoraConfig::default(),
        Batch::random(&config, 14, 6, &[6, 3]),
    );
    let loss_of = |f: &dyn Fn(&mut Case)| {
        let mut c = Case::new(good.config.clone(), good.lora.clone(), good.batch.clone());
        f(&mut c);
        loss(&c.config, &c.lora, &c.weights, &c.adapters, &c.batch)
    };
    assert!(loss_of(&|_| {}).is_ok());
    assert_names(
        loss_of(&|c| c.config.heads = 3),
        &["ModelConfig", "heads", "kv_heads"],
    );
    assert_names(
        loss_of(&|c| c.batch.tokens[4] = 17),
        &["Batch", "tokens[4]", "vocab = 17"],
    );
    assert_names(
        loss_of(&|c| c.batch.lens[1] = 7),
        &["lens[1]", "seq_len = 6", "7"],
    );
    assert_names(
        loss_of(&|c| c.batch.targets[0] = 17),
        &["targets[0]", "-100", "17"],
    );
    assert_names(
        loss_of(&|c| c.batch.targets[10] = 1),
        &["targets[10]", "padding"],
    );
    assert_names(
        loss_of(&|c| {
            c.batch.tokens.pop();
        }),
        &["tokens.len()", "12", "11"],
    );
    assert_names(
        loss_of(&|c| c.config.max_seq = 5),
        &["seq_len", "max_seq = 5"],
    );
    assert_names(
        loss_of(&|c| c.weights.layers[1].q.truncate(10)),
        &[
            "Weights",
            "layers.1.self_attn.q_proj",
            "128 elements",
            "10 elements",
        ],
    );
    assert_names(
        loss_of(&|c| c.weights.layers[0].q_bias = Some(vec![0.0; 16])),
        &["layers.0.q_bias", "Llama"],
    );
    assert_names(
        loss_of(&|c| c.config.family = Family::Qwen3),
        &["layers.0.q_norm", "Qwen3", "None"],
    );
    assert_names(
        loss_of(&|c| c.weights.lm_head = Some(vec![0.0; 17 * 8])),
        &["lm_head", "tied"],
    );
    assert_names(
        loss_of(&|c| c.lora.targets = vec![Projection::Q]),
        &["Adapters", "targets", "[Q]", "[Q, V]"],
    );
    assert_names(
        loss_of(&|c| c.adapters.get_mut(1, Projection::V).unwrap().b.push(0.0)),
        &["layers.1.self_attn.v_proj.lora_B"],
    );
    let x0 = vec![0.0; 5];
    let c = &good;
    assert_names(
        loss_from_embeddings(&c.config, &c.lora, &c.weights, &c.adapters, &c.batch, &x0),
        &["x0", "96 elements", "5"],
    );
}
