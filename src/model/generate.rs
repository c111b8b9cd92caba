//! Text generation: the logits of the next token after a sequence ([`Generator`]), greedy or
//! temperature / top-p sampling ([`Sampling`]), and the loop that appends tokens until a stop
//! token or a length ([`Generator::generate`]).
//!
//! [`Generator::generate`] decodes over a [`KvCache`]: the prompt is run through once, then each
//! new token costs one token's forward. Its cache holds a length rounded up to a power of two
//! from 32 (at most the model's context), made the first time a generation needs that much and
//! kept for later ones.
//!
//! [`Generator::next_logits`] is the reference path: the whole forward over the sequence
//! ([`record_logits`], the training forward), at a length rounded up to a power of two from 32,
//! so a handful of shapes serve any prompt: the buffers and pipelines of a length are made once,
//! the first time a sequence reaches it. The tests check the cache's logits against it.

// In a web page the GPU is read asynchronously: `next_logits` and `generate`, which wait for
// it, are native only (a page records `KvCache::record_append` itself).
#![cfg_attr(target_arch = "wasm32", allow(dead_code, unused_imports))]

use hesper_exec::Gpu;

use super::activations::{LogitsBuffers, StepBuffers, StepShape};
use super::config::ModelError;
use super::decode::KvCache;
use super::gpu::{GpuAdapters, GpuModel};
use super::reference::{Batch, IGNORE_INDEX};
use super::step::record_logits;

/// How the next token is chosen from the logits.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Sampling {
    /// The most likely token (the lowest id among equals).
    Greedy,
    /// A token drawn from `softmax(logits / temperature)`, restricted to the smallest set of
    /// most likely tokens whose probabilities add up to `top_p` (nucleus sampling).
    Sample { temperature: f64, top_p: f64 },
}

impl Sampling {
    /// `Ok` for greedy, or a positive finite temperature and `top_p` in `(0, 1]`.
    pub fn check(&self) -> Result<(), ModelError> {
        if let Sampling::Sample { temperature, top_p } = *self {
            if !(temperature.is_finite() && temperature > 0.0) {
                let given = temperature.to_string();
                return Err(ModelError::invalid(
                    "Sampling",
                    "temperature",
                    "positive",
                    given,
                ));
            }
            if !(top_p > 0.0 && top_p <= 1.0) {
                let given = top_p.to_string();
                return Err(ModelError::invalid("Sampling", "top_p", "in (0, 1]", given));
            }
        }
        Ok(())
    }

    /// The token chosen from `logits` (one per vocabulary entry), drawing from `rng` when
    /// sampling.
    pub fn choose(&self, logits: &[f32], rng: &mut Rng) -> u32 {
        let argmax = || {
            let best = logits
                .iter()
                .enumerate()
                .fold(
                    (0, f32::NEG_INFINITY),
                    |b, (i, &z)| {
                        if z > b.1 { (i, z) } else { b }
                    },
                );
            best.0 as u32
        };
        let Sampling::Sample { temperature, top_p } = *self else {
            return argmax();
        };
        let max = logits.iter().fold(f32::NEG_INFINITY, |m, &z| m.max(z)) as f64;
        let mut probs: Vec<(usize, f64)> = logits
            .iter()
            .map(|&z| ((z as f64 - max) / temperature).exp())
            .enumerate()
            .collect();
        probs.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let total: f64 = probs.iter().map(|p| p.1).sum();
        if !(total.is_finite() && total > 0.0) {
            return argmax();
        }
        // The nucleus: the most likely tokens until their mass reaches top_p.
        let mut mass = 0.0;
        let mut keep = probs.len();
        for (i, p) in probs.iter().enumerate() {
            mass += p.1 / total;
            if mass >= top_p {
                keep = i + 1;
                break;
            }
        }
        let nucleus = &probs[..keep];
        let nucleus_mass: f64 = nucleus.iter().map(|p| p.1).sum();
        let mut u = rng.next_f64() * nucleus_mass;
        for &(id, p) in nucleus {
            if u < p {
                return id as u32;
            }
            u -= p;
        }
        nucleus[keep - 1].0 as u32
    }
}

/// A small, fast, seedable random number generator (SplitMix64) whose whole state is one
/// `u64`, so a checkpoint can save it and a resumed run draw the same numbers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rng {
    pub state: u64,
}

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng { state: seed }
    }

    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_f64() * n as f64) as usize % n.max(1)
    }
}

/// The forward of a growing sequence and the logits at its end.
pub struct Generator {
    /// [`Generator::next_logits`]' buffers of the current length (a power of two, at least 32).
    buffers: Option<StepBuffers>,
    logits: LogitsBuffers,
    /// [`Generator::generate`]'s cache (its capacity a power of two, at least 32, or the
    /// model's context).
    cache: Option<KvCache>,
}

/// The shortest length a [`Generator`] runs.
const MIN_LEN: usize = 32;

impl Generator {
    /// Buffers for `model`'s generation; the rest are made as they are needed.
    pub fn new(gpu: &Gpu, model: &GpuModel) -> Result<Generator, ModelError> {
        Ok(Generator {
            buffers: None,
            logits: LogitsBuffers::new(gpu, model.config(), 1)?,
            cache: None,
        })
    }

    /// `[V]`: the logits of the token after `tokens` (the model with `adapters`), from the full
    /// forward over all of them (no cache: the reference [`Generator::generate`]'s cached
    /// decoding is tested against). An error when `tokens` is empty or longer than the model's
    /// context.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn next_logits(
        &mut self,
        gpu: &Gpu,
        model: &GpuModel,
        adapters: &GpuAdapters,
        tokens: &[u32],
    ) -> Result<Vec<f32>, ModelError> {
        let c = model.config();
        let n = tokens.len();
        check_length(c.max_seq, n)?;
        let len = n.next_power_of_two().max(MIN_LEN).min(c.max_seq);
        let fits = |b: &StepBuffers| b.shape().seq_len == len && b.made_for().1 == adapters.lora();
        if !self.buffers.as_ref().is_some_and(fits) {
            // Gradient checkpointing's layout: one block's activations, whatever the depth.
            let shape = StepShape {
                recompute: true,
                ..StepShape::new(1, len)
            };
            self.buffers = None;
            self.buffers = Some(StepBuffers::new(gpu, model, adapters, shape)?);
        }
        let buffers = self.buffers.as_mut().expect("made above");
        let mut padded = tokens.to_vec();
        padded.resize(len, 0);
        let batch = Batch {
            batch: 1,
            seq_len: len,
            tokens: padded,
            targets: vec![IGNORE_INDEX; len],
            lens: vec![n],
        };
        buffers.load(gpu, c, std::slice::from_ref(&batch))?;
        let mut rec = gpu.recorder();
        record_logits(
            &mut rec,
            model,
            adapters,
            buffers,
            &[n - 1],
            &mut self.logits,
        )?;
        rec.submit()?;
        Ok(self.logits.logits().read(gpu)?)
    }

    /// Append up to `max_new` tokens to `prompt`, each chosen by `sampling` (drawing from
    /// `rng`), stopping after any token of `stop`; `on_token` sees each new token as it comes
    /// (to stream it). Returns the new tokens. Decodes over a [`KvCache`]: the prompt's forward
    /// once, then one token's per new token (no pipeline is compiled after the first); greedy
    /// choices are made on the GPU, one token ahead of the host ([`KvCache::generate_greedy`]).
    /// It stops early at the model's context; a prompt that fills it gives no token.
    #[cfg(not(target_arch = "wasm32"))]
    #[allow(clippy::too_many_arguments)]
    pub fn generate(
        &mut self,
        gpu: &Gpu,
        model: &GpuModel,
        adapters: &GpuAdapters,
        prompt: &[u32],
        max_new: usize,
        (sampling, rng): (Sampling, &mut Rng),
        stop: &[u32],
        mut on_token: impl FnMut(u32),
    ) -> Result<Vec<u32>, ModelError> {
        sampling.check()?;
        let max_seq = model.config().max_seq;
        if max_new == 0 || prompt.len() >= max_seq {
            return Ok(vec![]);
        }
        check_length(max_seq, prompt.len())?;
        // The last new token is never run through the model: the cache needs
        // `prompt + max_new − 1` positions.
        let needed = (prompt.len() + max_new - 1).min(max_seq);
        let capacity = needed.next_power_of_two().max(MIN_LEN).min(max_seq);
        let fits = |k: &KvCache| k.fits(model, adapters) && k.capacity() >= needed;
        if !self.cache.as_ref().is_some_and(fits) {
            self.cache = None;
            self.cache = Some(KvCache::new(gpu, model, adapters, capacity)?);
        }
        let cache = self.cache.as_mut().expect("made above");
        cache.clear();
        if sampling == Sampling::Greedy {
            return cache.generate_greedy(gpu, model, adapters, prompt, max_new, stop, on_token);
        }
        let mut logits = cache.append(gpu, model, adapters, prompt)?;
        let mut new = Vec::with_capacity(max_new);
        loop {
            let next = sampling.choose(&logits, rng);
            new.push(next);
            on_token(next);
            if stop.contains(&next) || new.len() == max_new || prompt.len() + new.len() >= max_seq {
                break;
            }
            logits = cache.append(gpu, model, adapters, &[next])?;
        }
        Ok(new)
    }
}

/// `Ok` for a sequence of 1 to `max_seq` tokens.
fn check_length(max_seq: usize, n: usize) -> Result<(), ModelError> {
    if n == 0 || n > max_seq {
        let expected = format!("1 to {max_seq} tokens (the model's context)");
        return Err(ModelError::invalid("generate", "sequence", expected, n));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_first_maximum() {
        let mut rng = Rng::new(1);
        assert_eq!(Sampling::Greedy.choose(&[0.0, 3.0, 3.0, -1.0], &mut rng), 1);
    }

    #[test]
    fn top_p_keeps_the_nucleus_and_samples_in_proportion() {
        // Probabilities 0.5, 0.3, 0.2 (logits are their logs): top_p = 0.8 keeps the first
        // two, so they come 5 : 3 and the third never.
        let logits = [0.5f32.ln(), 0.3f32.ln(), 0.2f32.ln()];
        let sampling = Sampling::Sample {
            temperature: 1.0,
            top_p: 0.8,
        };
        let mut rng = Rng::new(7);
        let mut counts = [0usize; 3];
        for _ in 0..40_000 {
            counts[sampling.choose(&logits, &mut rng) as usize] += 1;
        }
        assert_eq!(counts[2], 0, "{counts:?}");
        let share = counts[0] as f64 / 40_000.0;
        assert!((share - 0.625).abs() < 0.01, "{counts:?}");
    }

    #[test]
    fn a_low_temperature_is_nearly_greedy_and_a_bad_one_is_an_error() {
        let sampling = Sampling::Sample {
            temperature: 0.01,
            top_p: 1.0,
        };
        let mut rng = Rng::new(3);
        let logits = [1.0, 1.2, 0.9];
        assert!((0..100).all(|_| sampling.choose(&logits, &mut rng) == 1));
        let bad = Sampling::Sample {
            temperature: 0.0,
            top_p: 1.0,
        };
        assert!(bad.check().unwrap_err().to_string().contains("temperature"));
    }

    #[test]
    fn the_rng_is_reproducible_from_its_state() {
        let mut a = Rng::new(42);
        a.next_u64();
        let mut b = Rng { state: a.state };
        assert_eq!(a.next_u64(), b.next_u64());
        assert!((0..1000).all(|_| a.next_f64() < 1.0));
    }
}
