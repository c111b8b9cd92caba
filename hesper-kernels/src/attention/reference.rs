//! f64 references of the attention kernels: the decoded token's (over a `[KV, max_seq, hd]`
//! cache) and whole sequences' (causal, GQA, right padding).

use super::{DecodeShape, SeqShape};

/// `ds = p ⊙ (dp − rowsum(p ⊙ dp))`.
pub fn softmax_backward(p: &[f64], dp: &[f64], cols: usize) -> Vec<f64> {
    let mut ds = vec![0.0; p.len()];
    for r in 0..p.len() / cols {
        let row = r * cols..(r + 1) * cols;
        let dot: f64 = p[row.clone()]
            .iter()
            .zip(&dp[row.clone()])
            .map(|(a, b)| a * b)
            .sum();
        for i in row {
            ds[i] = p[i] * (dp[i] - dot);
        }
    }
    ds
}

/// `A = softmax(τ·q·Kᵀ)` over the `L` cached positions, `[H, L]`.
pub fn decode_probs(shape: &DecodeShape, q: &[f64], k_cache: &[f64]) -> Vec<f64> {
    let (h_n, hd, len) = (shape.heads, shape.head_dim, shape.pos + 1);
    let g = h_n / shape.kv_heads;
    let tau = 1.0 / (hd as f64).sqrt();
    let mut a = vec![0.0; h_n * len];
    for h in 0..h_n {
        let row: Vec<f64> = (0..len)
            .map(|s| {
                let k = &k_cache[((h / g) * shape.max_seq + s) * hd..][..hd];
                tau * (0..hd).map(|d| q[h * hd + d] * k[d]).sum::<f64>()
            })
            .collect();
        let m = row.iter().cloned().fold(f64::MIN, f64::max);
        let z: f64 = row.iter().map(|v| (v - m).exp()).sum();
        for s in 0..len {
            a[h * len + s] = (row[s] - m).exp() / z;
        }
    }
    a
}

/// `O = A·V`, `[H, hd]`.
pub fn decode_out(shape: &DecodeShape, a: &[f64], v_cache: &[f64]) -> Vec<f64> {
    let (h_n, hd, len) = (shape.heads, shape.head_dim, shape.pos + 1);
    let g = h_n / shape.kv_heads;
    let mut o = vec![0.0; h_n * hd];
    for h in 0..h_n {
        for s in 0..len {
            for d in 0..hd {
                o[h * hd + d] += a[h * len + s] * v_cache[((h / g) * shape.max_seq + s) * hd + d];
            }
        }
    }
    o
}

/// `(dQ, dK_cache, dV_cache)` (all w.r.t. the rotated values) of `Σ dO ⊙ O`.
pub fn decode_backward(
    shape: &DecodeShape,
    q: &[f64],
    k_cache: &[f64],
    v_cache: &[f64],
    d_out: &[f64],
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (h_n, hd, len) = (shape.heads, shape.head_dim, shape.pos + 1);
    let g = h_n / shape.kv_heads;
    let tau = 1.0 / (hd as f64).sqrt();
    let a = decode_probs(shape, q, k_cache);
    let at = |kv: usize, s: usize, d: usize| (kv * shape.max_seq + s) * hd + d;
    let mut da = vec![0.0; h_n * len];
    for h in 0..h_n {
        for s in 0..len {
            da[h * len + s] = (0..hd)
                .map(|d| d_out[h * hd + d] * v_cache[at(h / g, s, d)])
                .sum();
        }
    }
    let ds = softmax_backward(&a, &da, len);
    let mut dq = vec![0.0; h_n * hd];
    let mut dk = vec![0.0; k_cache.len()];
    let mut dv = vec![0.0; v_cache.len()];
    for h in 0..h_n {
        for s in 0..len {
            for d in 0..hd {
                dq[h * hd + d] += tau * ds[h * len + s] * k_cache[at(h / g, s, d)];
                dk[at(h / g, s, d)] += tau * ds[h * len + s] * q[h * hd + d];
                dv[at(h / g, s, d)] += a[h * len + s] * d_out[h * hd + d];
            }
        }
    }
    (dq, dk, dv)
}

/// The positions of sequence `b` that are real: `lens[b]`, or all `S`.
fn real_len(shape: &SeqShape, lens: Option<&[usize]>, b: usize) -> usize {
    lens.map_or(shape.seq_len, |l| l[b].min(shape.seq_len))
}

/// Row `s` of sequence `b`, head `h` of a `[T, heads·hd]` tensor.
fn head_row(
    shape: &SeqShape,
    heads: usize,
    (b, s, h): (usize, usize, usize),
) -> std::ops::Range<usize> {
    let at = ((b * shape.seq_len + s) * heads + h) * shape.head_dim;
    at..at + shape.head_dim
}

/// `P[s, c] = softmax_c(τ·q_s·k_c)` over the keys `c ≤ s` of query row `s` (`s < len`) of head
/// `h` in sequence `b`.
fn probs_row(
    shape: &SeqShape,
    (q, k): (&[f64], &[f64]),
    (b, s, h): (usize, usize, usize),
) -> (Vec<f64>, f64) {
    let kv = h / shape.group();
    let qr = &q[head_row(shape, shape.heads, (b, s, h))];
    let scores: Vec<f64> = (0..=s)
        .map(|c| {
            let kr = &k[head_row(shape, shape.kv_heads, (b, c, kv))];
            shape.scale as f64 * qr.iter().zip(kr).map(|(a, b)| a * b).sum::<f64>()
        })
        .collect();
    let m = scores.iter().cloned().fold(f64::MIN, f64::max);
    let z: f64 = scores.iter().map(|v| (v - m).exp()).sum();
    (
        scores.iter().map(|v| (v - m).exp() / z).collect(),
        m + z.ln(),
    )
}

/// `(O [T, H·hd], lse [T, H])` of causal attention within each sequence; rows at or past a
/// sequence's valid length are zeros in both.
pub fn attention_forward(
    shape: &SeqShape,
    lens: Option<&[usize]>,
    q: &[f64],
    k: &[f64],
    v: &[f64],
) -> (Vec<f64>, Vec<f64>) {
    let (hn, hd) = (shape.heads, shape.head_dim);
    let mut o = vec![0.0; shape.q_len()];
    let mut lse = vec![0.0; shape.tokens() * hn];
    for b in 0..shape.batch {
        for s in 0..real_len(shape, lens, b) {
            for h in 0..hn {
                let (p, l) = probs_row(shape, (q, k), (b, s, h));
                lse[(b * shape.seq_len + s) * hn + h] = l;
                let out = head_row(shape, hn, (b, s, h));
                for (c, pc) in p.iter().enumerate() {
                    let vr = &v[head_row(shape, shape.kv_heads, (b, c, h / shape.group()))];
                    for d in 0..hd {
                        o[out.start + d] += pc * vr[d];
                    }
                }
            }
        }
    }
    (o, lse)
}

/// `(dQ, dK, dV)` of `Σ dO ⊙ O` (w.r.t. the rotated `Q`, `K`): `dK` and `dV` of a KV head sum
/// over its `G` query heads and over every later query row.
pub fn attention_backward(
    shape: &SeqShape,
    lens: Option<&[usize]>,
    (q, k, v): (&[f64], &[f64], &[f64]),
    d_out: &[f64],
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (hn, kvn, hd) = (shape.heads, shape.kv_heads, shape.head_dim);
    let tau = shape.scale as f64;
    let mut dq = vec![0.0; shape.q_len()];
    let mut dk = vec![0.0; shape.kv_len()];
    let mut dv = vec![0.0; shape.kv_len()];
    for b in 0..shape.batch {
        for s in 0..real_len(shape, lens, b) {
            for h in 0..hn {
                let kv = h / shape.group();
                let (p, _) = probs_row(shape, (q, k), (b, s, h));
                let qr = head_row(shape, hn, (b, s, h));
                let dor = &d_out[qr.clone()];
                let dp: Vec<f64> = (0..=s)
                    .map(|c| {
                        let vr = &v[head_row(shape, kvn, (b, c, kv))];
                        dor.iter().zip(vr).map(|(a, b)| a * b).sum()
                    })
                    .collect();
                let dot: f64 = p.iter().zip(&dp).map(|(a, b)| a * b).sum();
                for c in 0..=s {
                    let ds = p[c] * (dp[c] - dot);
                    let kr = head_row(shape, kvn, (b, c, kv));
                    for d in 0..hd {
                        dq[qr.start + d] += tau * ds * k[kr.start + d];
                        dk[kr.start + d] += tau * ds * q[qr.start + d];
                        dv[kr.start + d] += p[c] * dor[d];
                    }
                }
            }
        }
    }
    (dq, dk, dv)
}
