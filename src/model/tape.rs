//! A reverse-mode tape over row-major f64 tensors: the reference's gradients, op by op. Each op
//! keeps what its local backward needs; the backward walks the tape once in reverse and sums
//! every use of a value into its gradient (so a residual's two paths add, never overwrite).
//! Frozen weights are borrowed, not recorded: they get no gradient.

use hesper_kernels::ffn::reference as ffn;
use hesper_kernels::linear::reference as linear;
use hesper_kernels::norm::reference as norm;

/// A value on the tape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Var(usize);

/// The layout attention reads: `B` sequences of `S` positions, and its heads.
#[derive(Clone, Copy, Debug)]
pub(crate) struct AttentionShape {
    pub batch: usize,
    pub seq_len: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl AttentionShape {
    /// Row `s` of sequence `b`, head `h` of a `[T, heads·hd]` tensor.
    fn head(&self, heads: usize, b: usize, s: usize, h: usize) -> std::ops::Range<usize> {
        let at = ((b * self.seq_len + s) * heads + h) * self.head_dim;
        at..at + self.head_dim
    }

    /// Where `P[b, s, h, c]` sits in the saved probabilities, `[T, H, S]`.
    fn prob(&self, b: usize, s: usize, h: usize) -> usize {
        ((b * self.seq_len + s) * self.heads + h) * self.seq_len
    }
}

enum Op<'a> {
    /// A value given to the tape (an input or a trained parameter): its gradient is kept.
    Leaf,
    /// `x·Wᵀ` through a frozen `W [out, in]`.
    Frozen {
        x: Var,
        w: &'a [f64],
    },
    /// `x·Wᵀ` of two tracked values (LoRA's products with `A` and `B`).
    MatMulNt {
        x: Var,
        w: Var,
    },
    /// `x` plus a frozen bias on every row.
    Bias {
        x: Var,
    },
    Add(Var, Var),
    Scale(Var, f64),
    /// RMSNorm of every `gamma.len()` consecutive values.
    RmsNorm {
        x: Var,
        gamma: &'a [f64],
        eps: f64,
    },
    /// Split-half RoPE of every head of every row; row `t` is at position `t mod seq_len`.
    Rope {
        x: Var,
        head_dim: usize,
        seq_len: usize,
        base: f64,
    },
    /// Causal GQA attention within each sequence; `probs [T, H, S]` saved.
    Attention {
        q: Var,
        k: Var,
        v: Var,
        shape: AttentionShape,
        lens: &'a [usize],
        probs: Vec<f64>,
    },
    SwiGlu {
        gate: Var,
        up: Var,
    },
    ReluSqrMul {
        gate: Var,
        up: Var,
    },
    /// Mean cross-entropy over the rows whose target is not negative.
    CrossEntropy {
        logits: Var,
        targets: &'a [i64],
    },
}

struct Node<'a> {
    value: Vec<f64>,
    /// Row width: the value is `[value.len() / width, width]`.
    width: usize,
    op: Op<'a>,
}

/// The recorded forward.
pub(crate) struct Tape<'a> {
    nodes: Vec<Node<'a>>,
}

/// The gradient of the backward's root with respect to each leaf.
pub(crate) struct Gradients(Vec<Vec<f64>>);

impl Gradients {
    /// The gradient of leaf `v` (zeros where the root does not depend on it).
    pub fn take(&mut self, v: Var) -> Vec<f64> {
        std::mem::take(&mut self.0[v.0])
    }
}

impl<'a> Tape<'a> {
    pub fn new() -> Self {
        Tape { nodes: vec![] }
    }

    fn push(&mut self, value: Vec<f64>, width: usize, op: Op<'a>) -> Var {
        self.nodes.push(Node { value, width, op });
        Var(self.nodes.len() - 1)
    }

    pub fn value(&self, v: Var) -> &[f64] {
        &self.nodes[v.0].value
    }

    fn width(&self, v: Var) -> usize {
        self.nodes[v.0].width
    }

    fn rows(&self, v: Var) -> usize {
        self.value(v).len() / self.width(v)
    }

    /// A leaf `[value.len() / width, width]`.
    pub fn leaf(&mut self, value: Vec<f64>, width: usize) -> Var {
        self.push(value, width, Op::Leaf)
    }

    /// `x·Wᵀ`, `w: [out, in]` frozen.
    pub fn frozen(&mut self, x: Var, w: &'a [f64]) -> Var {
        let (rows, input) = (self.rows(x), self.width(x));
        let out = w.len() / input;
        let y = linear::matmul_nt(self.value(x), w, rows, out, input);
        self.push(y, out, Op::Frozen { x, w })
    }

    /// `x·Wᵀ` with both tracked.
    pub fn matmul_nt(&mut self, x: Var, w: Var) -> Var {
        let (rows, input, out) = (self.rows(x), self.width(x), self.rows(w));
        let y = linear::matmul_nt(self.value(x), self.value(w), rows, out, input);
        self.push(y, out, Op::MatMulNt { x, w })
    }

    /// `x + bias` on every row.
    pub fn bias(&mut self, x: Var, bias: &[f64]) -> Var {
        let width = self.width(x);
        let y = self
            .value(x)
            .chunks(width)
            .flat_map(|row| row.iter().zip(bias).map(|(a, b)| a + b));
        let y = y.collect();
        self.push(y, width, Op::Bias { x })
    }

    pub fn add(&mut self, a: Var, b: Var) -> Var {
        let y = self
            .value(a)
            .iter()
            .zip(self.value(b))
            .map(|(x, y)| x + y)
            .collect();
        self.push(y, self.width(a), Op::Add(a, b))
    }

    pub fn scale(&mut self, x: Var, s: f64) -> Var {
        let y = self.value(x).iter().map(|v| s * v).collect();
        self.push(y, self.width(x), Op::Scale(x, s))
    }

    /// RMSNorm of every `gamma.len()` consecutive values (a row, or one head of a row).
    pub fn rms_norm(&mut self, x: Var, gamma: &'a [f64], eps: f64) -> Var {
        let (y, _) = norm::rms_norm_forward(self.value(x), gamma, eps);
        self.push(y, self.width(x), Op::RmsNorm { x, gamma, eps })
    }

    /// Split-half RoPE (KERNELS.md "Conventions") of every head; row `t` is at position
    /// `t mod seq_len`.
    pub fn rope(&mut self, x: Var, head_dim: usize, seq_len: usize, base: f64) -> Var {
        let y = rotate(self.value(x), self.width(x), (head_dim, seq_len, base), 1.0);
        let op = Op::Rope {
            x,
            head_dim,
            seq_len,
            base,
        };
        self.push(y, self.width(x), op)
    }

    /// `O [T, H·hd]` of causal attention within each sequence, `τ = 1/√hd`: query head `h`
    /// reads KV head `h / G`; query rows at or past their sequence's length are 0 (and the keys
    /// there are never read: a valid query reads only earlier positions).
    pub fn attention(
        &mut self,
        (q, k, v): (Var, Var, Var),
        shape: AttentionShape,
        lens: &'a [usize],
    ) -> Var {
        let AttentionShape {
            heads, kv_heads, ..
        } = shape;
        let (qs, ks, vs) = (self.value(q), self.value(k), self.value(v));
        let tau = 1.0 / (shape.head_dim as f64).sqrt();
        let group = heads / kv_heads;
        let mut out = vec![0.0; qs.len()];
        let mut probs = vec![0.0; shape.batch * shape.seq_len * heads * shape.seq_len];
        for (b, &len) in lens.iter().enumerate() {
            for s in 0..len {
                for h in 0..heads {
                    let qr = &qs[shape.head(heads, b, s, h)];
                    let scores: Vec<f64> = (0..=s)
                        .map(|c| tau * dot(qr, &ks[shape.head(kv_heads, b, c, h / group)]))
                        .collect();
                    let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let z: f64 = scores.iter().map(|x| (x - max).exp()).sum();
                    let p = &mut probs[shape.prob(b, s, h)..][..=s];
                    let o = shape.head(heads, b, s, h);
                    for (c, (pc, score)) in p.iter_mut().zip(&scores).enumerate() {
                        *pc = (score - max).exp() / z;
                        let vr = &vs[shape.head(kv_heads, b, c, h / group)];
                        for (od, vd) in out[o.clone()].iter_mut().zip(vr) {
                            *od += *pc * vd;
                        }
                    }
                }
            }
        }
        let width = heads * shape.head_dim;
        let op = Op::Attention {
            q,
            k,
            v,
            shape,
            lens,
            probs,
        };
        self.push(out, width, op)
    }

    /// `silu(gate) ⊙ up`.
    pub fn swiglu(&mut self, gate: Var, up: Var) -> Var {
        let y = ffn::swiglu_forward(self.value(gate), self.value(up));
        self.push(y, self.width(gate), Op::SwiGlu { gate, up })
    }

    /// `relu(gate)² ⊙ up`.
    pub fn relu_sqr_mul(&mut self, gate: Var, up: Var) -> Var {
        let y = ffn::relu_sqr_mul_forward(self.value(gate), self.value(up));
        self.push(y, self.width(gate), Op::ReluSqrMul { gate, up })
    }

    /// The mean over the rows whose target is a class (not negative) of
    /// `logsumexp(z) − z[target]`; 0 when there is none.
    pub fn cross_entropy(&mut self, logits: Var, targets: &'a [i64]) -> Var {
        let vocab = self.width(logits);
        let rows = self.value(logits).chunks(vocab).zip(targets);
        let losses: Vec<f64> = rows
            .filter_map(|(z, &y)| Some(logsumexp(z) - z[usize::try_from(y).ok()?]))
            .collect();
        let loss = losses.iter().sum::<f64>() / losses.len().max(1) as f64;
        self.push(vec![loss], 1, Op::CrossEntropy { logits, targets })
    }

    /// The gradients of the scalar `root` with respect to every leaf before it.
    pub fn backward(&self, root: Var) -> Gradients {
        let mut grads: Vec<Vec<f64>> = vec![vec![]; self.nodes.len()];
        grads[root.0] = vec![1.0];
        for (i, node) in self.nodes[..=root.0].iter().enumerate().rev() {
            let dy = std::mem::take(&mut grads[i]);
            if matches!(node.op, Op::Leaf) {
                grads[i] = if dy.is_empty() {
                    vec![0.0; node.value.len()]
                } else {
                    dy
                };
            } else if !dy.is_empty() {
                for (input, dx) in self.local_backward(&node.op, &dy) {
                    accumulate(&mut grads[input.0], dx);
                }
            }
        }
        Gradients(grads)
    }

    /// Each input's share of the gradient, given `dy`, the gradient of the op's output.
    fn local_backward(&self, op: &Op<'a>, dy: &[f64]) -> Vec<(Var, Vec<f64>)> {
        match *op {
            Op::Leaf => vec![],
            Op::Frozen { x, w } => {
                let (rows, input) = (self.rows(x), self.width(x));
                let dx = linear::matmul_nn(dy, w, rows, w.len() / input, input);
                vec![(x, dx)]
            }
            Op::MatMulNt { x, w } => {
                let (rows, input, out) = (self.rows(x), self.width(x), self.rows(w));
                let dx = linear::matmul_nn(dy, self.value(w), rows, out, input);
                // dW[o, i] = Σ_t dy[t, o]·x[t, i].
                let mut dw = vec![0.0; out * input];
                for (dy_row, x_row) in dy.chunks(out).zip(self.value(x).chunks(input)) {
                    for (dw_row, g) in dw.chunks_mut(input).zip(dy_row) {
                        for (d, xi) in dw_row.iter_mut().zip(x_row) {
                            *d += g * xi;
                        }
                    }
                }
                vec![(x, dx), (w, dw)]
            }
            Op::Bias { x } => vec![(x, dy.to_vec())],
            Op::Add(a, b) => vec![(a, dy.to_vec()), (b, dy.to_vec())],
            Op::Scale(x, s) => vec![(x, dy.iter().map(|d| s * d).collect())],
            Op::RmsNorm { x, gamma, eps } => {
                let (dx, _) = norm::rms_norm_backward(self.value(x), gamma, dy, eps);
                vec![(x, dx)]
            }
            Op::Rope {
                x,
                head_dim,
                seq_len,
                base,
            } => {
                // The transposed rotation: the forward's with sin → −sin.
                let dx = rotate(dy, self.width(x), (head_dim, seq_len, base), -1.0);
                vec![(x, dx)]
            }
            Op::Attention {
                q,
                k,
                v,
                shape,
                lens,
                ref probs,
            } => {
                let (dq, dk, dv) = self.attention_backward((q, k, v), shape, lens, probs, dy);
                vec![(q, dq), (k, dk), (v, dv)]
            }
            Op::SwiGlu { gate, up } => {
                let (dg, du) = ffn::swiglu_backward(self.value(gate), self.value(up), dy);
                vec![(gate, dg), (up, du)]
            }
            Op::ReluSqrMul { gate, up } => {
                let (dg, du) = ffn::relu_sqr_mul_backward(self.value(gate), self.value(up), dy);
                vec![(gate, dg), (up, du)]
            }
            Op::CrossEntropy { logits, targets } => {
                // dz = dy·(softmax(z) − onehot(y)) / N on the rows with a target.
                let vocab = self.width(logits);
                let count = targets.iter().filter(|&&t| t >= 0).count().max(1);
                let g = dy[0] / count as f64;
                let mut dz = vec![0.0; self.value(logits).len()];
                let rows = self.value(logits).chunks(vocab).zip(dz.chunks_mut(vocab));
                for ((z, dz), &target) in rows.zip(targets) {
                    let Ok(target) = usize::try_from(target) else {
                        continue;
                    };
                    let lse = logsumexp(z);
                    for (d, zc) in dz.iter_mut().zip(z) {
                        *d = g * (zc - lse).exp();
                    }
                    dz[target] -= g;
                }
                vec![(logits, dz)]
            }
        }
    }

    /// `(dQ, dK, dV)` of attention (KERNELS.md "Attention"): `dS = P ⊙ (dP − Σ_c P_c dP_c)`;
    /// `dK`, `dV` of a KV head sum over its `G` query heads and over every later query row.
    fn attention_backward(
        &self,
        (q, k, v): (Var, Var, Var),
        shape: AttentionShape,
        lens: &[usize],
        probs: &[f64],
        d_out: &[f64],
    ) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
        let AttentionShape {
            heads, kv_heads, ..
        } = shape;
        let (qs, ks, vs) = (self.value(q), self.value(k), self.value(v));
        let tau = 1.0 / (shape.head_dim as f64).sqrt();
        let group = heads / kv_heads;
        let (mut dq, mut dk, mut dv) = (
            vec![0.0; qs.len()],
            vec![0.0; ks.len()],
            vec![0.0; vs.len()],
        );
        for (b, &len) in lens.iter().enumerate() {
            for s in 0..len {
                for h in 0..heads {
                    let p = &probs[shape.prob(b, s, h)..][..=s];
                    let qr = shape.head(heads, b, s, h);
                    let d_or = &d_out[qr.clone()];
                    let dp: Vec<f64> = (0..=s)
                        .map(|c| dot(d_or, &vs[shape.head(kv_heads, b, c, h / group)]))
                        .collect();
                    let p_dot_dp = dot(p, &dp);
                    for c in 0..=s {
                        let ds = p[c] * (dp[c] - p_dot_dp);
                        let kr = shape.head(kv_heads, b, c, h / group);
                        for (i, j) in qr.clone().zip(kr) {
                            dq[i] += tau * ds * ks[j];
                            dk[j] += tau * ds * qs[i];
                            dv[j] += p[c] * d_out[i];
                        }
                    }
                }
            }
        }
        (dq, dk, dv)
    }
}

/// `grad += dx`; a first contribution is taken as it is.
fn accumulate(grad: &mut Vec<f64>, dx: Vec<f64>) {
    if grad.is_empty() {
        *grad = dx;
    } else {
        for (g, d) in grad.iter_mut().zip(dx) {
            *g += d;
        }
    }
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

fn logsumexp(z: &[f64]) -> f64 {
    let max = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    max + z.iter().map(|v| (v - max).exp()).sum::<f64>().ln()
}

/// Rotate `(x_i, x_{i+hd/2})` of every head by `sign·θ_i`, `θ_i = pos·base^(−2i/hd)`, in rows
/// of `width`; row `t` is at position `t mod seq_len`.
fn rotate(
    x: &[f64],
    width: usize,
    (head_dim, seq_len, base): (usize, usize, f64),
    sign: f64,
) -> Vec<f64> {
    let half = head_dim / 2;
    let inv_freq: Vec<f64> = (0..half)
        .map(|i| base.powf(-2.0 * i as f64 / head_dim as f64))
        .collect();
    let mut out = x.to_vec();
    for (t, row) in out.chunks_mut(width).enumerate() {
        let pos = (t % seq_len) as f64;
        for head in row.chunks_mut(head_dim) {
            for (i, f) in inv_freq.iter().enumerate() {
                let (sin, cos) = (pos * f).sin_cos();
                let sin = sign * sin;
                let (a, b) = (head[i], head[i + half]);
                head[i] = a * cos - b * sin;
                head[i + half] = a * sin + b * cos;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use hesper_kernels::attention::{SeqShape, reference as attention};
    use hesper_kernels::rope::reference as rope;
    use hesper_kernels::testing::{Rng, f64s};

    fn max_diff(a: &[f64], b: &[f64]) -> f64 {
        assert_eq!(a.len(), b.len());
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f64::max)
    }

    /// The tape's attention, forward and backward, is the kernel library's reference, written
    /// apart: the same GQA head mapping, causal mask and padding (`hd = 4`, so the kernels'
    /// f32 `τ = 0.5` is exact). Finite differences cannot see a wrong layout; this can.
    #[test]
    fn attention_is_the_kernel_reference() {
        let shape = AttentionShape {
            batch: 2,
            seq_len: 5,
            heads: 4,
            kv_heads: 2,
            head_dim: 4,
        };
        let lens = [5, 3];
        let mut rng = Rng::new(1);
        let (q, k, v) = (rng.vec(160, 1.0), rng.vec(80, 1.0), rng.vec(80, 1.0));
        let (q, k, v, d_out) = (f64s(&q), f64s(&k), f64s(&v), f64s(&rng.vec(160, 1.0)));
        let mut tape = Tape::new();
        let leaves = (
            tape.leaf(q.clone(), 16),
            tape.leaf(k.clone(), 8),
            tape.leaf(v.clone(), 8),
        );
        let o = tape.attention(leaves, shape, &lens);
        let seq = SeqShape::new(2, 5, 4, 2, 4);
        let (want, _) = attention::attention_forward(&seq, Some(&lens), &q, &k, &v);
        assert!(max_diff(tape.value(o), &want) < 1e-12);

        let got = tape.local_backward(&tape.nodes[o.0].op, &d_out);
        let (dq, dk, dv) = attention::attention_backward(&seq, Some(&lens), (&q, &k, &v), &d_out);
        for ((_, got), want) in got.iter().zip([dq, dk, dv]) {
            assert!(max_diff(got, &want) < 1e-12);
        }
    }

    /// The tape's RoPE is the kernel library's split-half reference, and its backward undoes it.
    #[test]
    fn rope_is_the_kernel_reference_and_its_backward_the_inverse() {
        let (heads, head_dim, seq_len, base) = (3, 8, 6, 10_000.0);
        let x = f64s(&Rng::new(2).vec(2 * seq_len * heads * head_dim, 1.0));
        let width = heads * head_dim;
        let y = rotate(&x, width, (head_dim, seq_len, base), 1.0);
        let want = rope::rope(&x, (head_dim, base), heads, seq_len, 0, false);
        assert!(max_diff(&y, &want) < 1e-12);
        let back = rotate(&y, width, (head_dim, seq_len, base), -1.0);
        assert!(max_diff(&back, &x) < 1e-14);
    }
}
