//! RoPE, split-half ("NeoX", HF `rotate_half`) layout (KERNELS.md): in each head of `hd`
//! values, pair `i < hd/2` is `(x_i, x_{i+hd/2})`, rotated by `θ_i = pos·base^(−2i/hd)`.
//! The backward is the same rotation with `sin → −sin`.
//!
//! In place, one invocation per pair. Positions are runtime values, never baked into the WGSL:
//! token `t` (a row of `heads·hd` values) is at `pos = offset + t mod seq_len` — `seq_len = S`
//! for a `[B·S, …]` batch, `seq_len = 1, offset = pos` for one decoded token, and
//! `seq_len = max_seq` for a `[KV, max_seq, hd]` cache. `base^(−2i/hd)` comes from the host,
//! computed in f64 ([`inverse_frequencies`]); the angle is formed in f32, so its absolute error
//! grows like `|θ|·6e-8`.

use hesper_dsl::prelude::*;
use hesper_exec::{Args, ExecError, GpuBuffer, Grid, Recorder};

use crate::{expect_len, expect_rows, expect_u32};

// WGSL promises sin and cos only to 2⁻¹¹ absolute, and only on [−π, π]; browsers' software
// devices (SwiftShader) are that far off (1.9e-4), and angles here reach the last position.
// So both are computed here, as Cephes' sinf/cosf do: θ reduced by the nearest multiple of
// π/2 in three parts (each product exact for |θ| < 2¹⁶), then a polynomial on [−π/4, π/4]
// (≤ 1 ulp there) picked and signed by the quadrant.

/// `θ − q·π/2` for the nearest integer `q` (as a float), `θ ≥ 0`.
#[kernel_fn]
fn reduced(theta: f32, q: f32) -> f32 {
    theta - q * 1.5703125 - q * 4.837_513e-4 - q * 7.549_79e-8
}

/// `sin(r)` for `|r| ≤ π/4`.
#[kernel_fn]
fn sin_poly(r: f32) -> f32 {
    r + r * r * r * (-0.166_666_55 + r * r * (8.332_161e-3 + r * r * -1.951_529_6e-4))
}

/// `cos(r)` for `|r| ≤ π/4`.
#[kernel_fn]
fn cos_poly(r: f32) -> f32 {
    1.0 - 0.5 * r * r
        + r * r * r * r * (4.166_664_6e-2 + r * r * (-1.388_731_6e-3 + r * r * 2.443_315_7e-5))
}

/// `sin(θ)` for `θ ≥ 0`, to about an ulp of the reduced angle.
#[kernel_fn]
fn sin_accurate(theta: f32) -> f32 {
    let q = (theta * 0.63661975).round();
    let r = reduced(theta, q);
    let quadrant = (q as u32) % 4u32;
    let v = select(quadrant % 2u32 == 0u32, sin_poly(r), cos_poly(r));
    select(quadrant >= 2u32, -v, v)
}

/// `cos(θ)` for `θ ≥ 0`: `sin(θ + π/2)`, by quadrant.
#[kernel_fn]
fn cos_accurate(theta: f32) -> f32 {
    let q = (theta * 0.63661975).round();
    let r = reduced(theta, q);
    let quadrant = (q as u32) % 4u32;
    let v = select(quadrant % 2u32 == 0u32, cos_poly(r), sin_poly(r));
    select(quadrant == 1u32 || quadrant == 2u32, -v, v)
}

#[kernel(workgroup_size = 256)]
fn rope(
    x: &mut [f32],
    inv_freq: &[f32],
    #[shape] half: u32,
    #[shape] backward: bool,
    #[runtime] pairs: u32,
    #[runtime] pairs_per_token: u32,
    #[runtime] seq_len: u32,
    #[runtime] offset: u32,
) {
    let p = global_index();
    if p < pairs {
        let token = p / pairs_per_token;
        let in_token = p % pairs_per_token;
        let i = in_token % half;
        // Start of this pair's head: the head's first `half` values pair with its last `half`.
        let first = token * pairs_per_token * 2 + (in_token - i) * 2 + i;
        let pos = offset + token % seq_len;
        let theta = pos as f32 * inv_freq[i];
        let c = cos_accurate(theta);
        let mut s = sin_accurate(theta);
        if backward {
            s = -s;
        }
        let a = x[first];
        let b = x[first + half];
        x[first] = a * c - b * s;
        x[first + half] = a * s + b * c;
    }
}

/// `base^(−2i/hd)` for `i < hd/2`, computed in f64 and rounded once.
pub fn inverse_frequencies(head_dim: usize, base: f64) -> Vec<f32> {
    (0..head_dim / 2)
        .map(|i| base.powf(-2.0 * i as f64 / head_dim as f64) as f32)
        .collect()
}

/// Where the rows of a RoPE'd buffer sit in their sequences.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Positions {
    /// Row `t` is at `offset + t mod seq_len`.
    pub seq_len: u32,
    pub offset: u32,
}

/// The WGSL of this module's kernels (for snapshots and review).
pub fn kernels() -> Result<Vec<Kernel>, hesper_dsl::DslError> {
    Ok(vec![rope::build(64, false)?, rope::build(64, true)?])
}

/// Rotate `x` (rows of `heads × head_dim`) in place: the forward, or with `backward` the
/// gradient's transpose rotation.
pub fn execute_rope(
    rec: &mut Recorder<'_>,
    x: &mut GpuBuffer<f32>,
    inv_freq: &GpuBuffer<f32>,
    heads: usize,
    positions: Positions,
    backward: bool,
) -> Result<(), ExecError> {
    let name = rope::NAME;
    let half = inv_freq.len();
    let width = heads * 2 * half;
    let row = format!("heads × head_dim = {heads} × {}", 2 * half);
    expect_rows(name, "x", x, width, &row)?;
    if positions.seq_len == 0 {
        return Err(ExecError::Dispatch {
            kernel: name.into(),
            what: "positions with seq_len 0".into(),
            why: "every row is at offset + row mod seq_len".into(),
        });
    }
    expect_len(name, "inv_freq", inv_freq, half, "head_dim / 2")?;
    let pairs = expect_u32(name, "pairs", x.len() / 2)?;
    if pairs == 0 {
        return Ok(());
    }
    let kernel = rec
        .gpu()
        .kernel(&rope::key(half as u32, backward), rope::body)?;
    let args = Args::new()
        .buffer("x", x)
        .buffer("inv_freq", inv_freq)
        .param("pairs", pairs)
        .param("pairs_per_token", (width / 2) as u32)
        .param("seq_len", positions.seq_len)
        .param("offset", positions.offset);
    rec.launch(&kernel, &args, Grid::Threads(pairs as u64))
}

/// RoPE forward, in place.
pub fn execute_rope_forward(
    rec: &mut Recorder<'_>,
    x: &mut GpuBuffer<f32>,
    inv_freq: &GpuBuffer<f32>,
    heads: usize,
    positions: Positions,
) -> Result<(), ExecError> {
    execute_rope(rec, x, inv_freq, heads, positions, false)
}

/// RoPE backward on a gradient, in place (apply to dQ and dK).
pub fn execute_rope_backward(
    rec: &mut Recorder<'_>,
    dx: &mut GpuBuffer<f32>,
    inv_freq: &GpuBuffer<f32>,
    heads: usize,
    positions: Positions,
) -> Result<(), ExecError> {
    execute_rope(rec, dx, inv_freq, heads, positions, true)
}

/// f64 references.
pub mod reference {
    /// RoPE of rows of `heads × head_dim` (`inv_freq` as the kernel gets it), forward or backward.
    pub fn rope(
        x: &[f64],
        inv_freq: &[f32],
        heads: usize,
        seq_len: usize,
        offset: usize,
        backward: bool,
    ) -> Vec<f64> {
        let half = inv_freq.len();
        let width = heads * 2 * half;
        let mut out = x.to_vec();
        for (t, row) in out.chunks_mut(width).enumerate() {
            let pos = (offset + t % seq_len) as f64;
            for head in row.chunks_mut(2 * half) {
                for i in 0..half {
                    let theta = pos * inv_freq[i] as f64;
                    let (s, c) = theta.sin_cos();
                    let s = if backward { -s } else { s };
                    let (a, b) = (head[i], head[i + half]);
                    head[i] = a * c - b * s;
                    head[i + half] = a * s + b * c;
                }
            }
        }
        out
    }
}
