//! f64 references, written as the plain matrix products of KERNELS.md.

/// `(h, y + s·h·Bᵀ)` for `x: [T, in]`, `a: [r, in]`, `b: [out, r]`, `y: [T, out]`.
pub fn lora_forward(
    x: &[f64],
    a: &[f64],
    b: &[f64],
    y: &[f64],
    rank: usize,
    scale: f64,
) -> (Vec<f64>, Vec<f64>) {
    let (input, output) = (a.len() / rank, b.len() / rank);
    let tokens = x.len() / input;
    let mut h = vec![0.0; tokens * rank];
    let mut out = y.to_vec();
    for t in 0..tokens {
        for k in 0..rank {
            h[t * rank + k] = (0..input)
                .map(|i| x[t * input + i] * a[k * input + i])
                .sum();
        }
        for o in 0..output {
            out[t * output + o] += scale
                * (0..rank)
                    .map(|k| h[t * rank + k] * b[o * rank + k])
                    .sum::<f64>();
        }
    }
    (h, out)
}

/// `(dA, dB, dx_lora)` given `dy`: the gradients of `Σ dy ⊙ (s·x·Aᵀ·Bᵀ)`.
pub fn lora_backward(
    x: &[f64],
    a: &[f64],
    b: &[f64],
    dy: &[f64],
    rank: usize,
    scale: f64,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (input, output) = (a.len() / rank, b.len() / rank);
    let tokens = x.len() / input;
    let (h, _) = lora_forward(x, a, b, &vec![0.0; tokens * output], rank, scale);
    let mut dh = vec![0.0; tokens * rank];
    for t in 0..tokens {
        for k in 0..rank {
            dh[t * rank + k] = (0..output)
                .map(|o| dy[t * output + o] * b[o * rank + k])
                .sum();
        }
    }
    let mut db = vec![0.0; output * rank];
    let mut da = vec![0.0; rank * input];
    let mut dx = vec![0.0; tokens * input];
    for t in 0..tokens {
        for o in 0..output {
            for k in 0..rank {
                db[o * rank + k] += scale * dy[t * output + o] * h[t * rank + k];
            }
        }
        for k in 0..rank {
            for i in 0..input {
                da[k * input + i] += scale * dh[t * rank + k] * x[t * input + i];
                dx[t * input + i] += scale * dh[t * rank + k] * a[k * input + i];
            }
        }
    }
    (da, db, dx)
}
