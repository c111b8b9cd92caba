//! RoPE, split-half ("NeoX", HF `rotate_half`) layout (KERNELS.md): in each head of `hd`
//! values, pair `i < hd/2` is `(x_i, x_{i+hd/2})`, rotated by `θ_i = pos·base^(−2i/hd)`.
//! The backward is the same rotation with `sin → −sin`.
//!
//! In place, one invocation per pair. Positions are runtime values, never baked into the WGSL:
//! token `t` (a row of `heads·hd` values) is at `pos = offset + t mod seq_len` — `seq_len = S`
//! for a `[B·S, …]` batch, `seq_len = 1, offset = pos` for one decoded token, and
//! `seq_len = max_seq` for a `[KV, max_seq, hd]` cache.
//!
//! The rotations come from a [`RopeTable`]: `cos θ` and `sin θ` of every angle, computed on the
//! host in f64 and rounded once. Formed on the GPU, an f32 angle is already `|θ|·6e-8` off
//! (1.2e-4 rad at position 2048, far past an f32 tolerance of the rotated values), and WGSL
//! promises `sin` and `cos` only to 2⁻¹¹ (browsers' software devices are that far off).

use hesper_dsl::prelude::*;
use hesper_exec::{Args, ExecError, Gpu, GpuBuffer, Grid, Recorder};

use crate::{expect_rows, expect_u32};

#[kernel(workgroup_size = 256)]
fn rope(
    x: &mut [f32],
    cos_sin: &[f32],
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
        let at = (pos * half + i) * 2;
        let c = cos_sin[at];
        let mut s = cos_sin[at + 1];
        if backward {
            s = -s;
        }
        let a = x[first];
        let b = x[first + half];
        x[first] = a * c - b * s;
        x[first + half] = a * s + b * c;
    }
}

/// [`rope`] four pairs an invocation (`half` a multiple of 4): one vec4 of each half of the
/// head, and the four angles' `cos`, `sin` as two vec4s. A quarter of the invocations and of
/// their runtime divisions (which, not the bytes, held the scalar kernel back on the H200:
/// BENCHMARKS.md, "RoPE four pairs an invocation").
#[kernel(workgroup_size = 256)]
fn rope_vec4(
    x: &mut [Vec4<f32>],
    cos_sin: &[Vec4<f32>],
    #[shape] half: u32,
    #[shape] backward: bool,
    #[runtime] quads: u32,
    #[runtime] quads_per_token: u32,
    #[runtime] seq_len: u32,
    #[runtime] offset: u32,
) {
    let p = global_index();
    if p < quads {
        let token = p / quads_per_token;
        let in_token = p % quads_per_token;
        let i = in_token % (half / 4);
        // In vec4s: the head's first half starts at `(in_token - i)·2`, its second `half / 4`
        // later.
        let first = token * quads_per_token * 2 + (in_token - i) * 2 + i;
        let pos = offset + token % seq_len;
        // `cos θ_j, sin θ_j` interleaved: pairs 4i … 4i+3 of position `pos` are two vec4s.
        let at = (pos * (half / 4) + i) * 2;
        let cs01 = cos_sin[at];
        let cs23 = cos_sin[at + 1];
        let c = vec4(cs01.x, cs01.z, cs23.x, cs23.z);
        let mut s = vec4(cs01.y, cs01.w, cs23.y, cs23.w);
        if backward {
            s = -s;
        }
        let a = x[first];
        let b = x[first + half / 4];
        x[first] = a * c - b * s;
        x[first + half / 4] = a * s + b * c;
    }
}

/// [`rope_vec4`] over a layer's queries and keys in one launch (the step's forward and
/// backward rotate both; two launches of a few µs each cost the step 30 of them a pass):
/// invocations below `q_quads` take `q`'s quads, the rest `k`'s.
#[kernel(workgroup_size = 256)]
fn rope_qk_vec4(
    q: &mut [Vec4<f32>],
    k: &mut [Vec4<f32>],
    cos_sin: &[Vec4<f32>],
    #[shape] half: u32,
    #[shape] backward: bool,
    #[runtime] q_quads: u32,
    #[runtime] q_quads_per_token: u32,
    #[runtime] k_quads: u32,
    #[runtime] k_quads_per_token: u32,
    #[runtime] seq_len: u32,
    #[runtime] offset: u32,
) {
    let p = global_index();
    if p < q_quads + k_quads {
        let in_k = p >= q_quads;
        let quad = select(in_k, p - q_quads, p);
        let quads_per_token = select(in_k, k_quads_per_token, q_quads_per_token);
        let token = quad / quads_per_token;
        let in_token = quad % quads_per_token;
        let i = in_token % (half / 4);
        let first = token * quads_per_token * 2 + (in_token - i) * 2 + i;
        let pos = offset + token % seq_len;
        let at = (pos * (half / 4) + i) * 2;
        let cs01 = cos_sin[at];
        let cs23 = cos_sin[at + 1];
        let c = vec4(cs01.x, cs01.z, cs23.x, cs23.z);
        let mut s = vec4(cs01.y, cs01.w, cs23.y, cs23.w);
        if backward {
            s = -s;
        }
        if in_k {
            let a = k[first];
            let b = k[first + half / 4];
            k[first] = a * c - b * s;
            k[first + half / 4] = a * s + b * c;
        } else {
            let a = q[first];
            let b = q[first + half / 4];
            q[first] = a * c - b * s;
            q[first + half / 4] = a * s + b * c;
        }
    }
}

/// `base^(−2i/hd)` for `i < hd/2`, in f64.
pub fn inverse_frequencies(head_dim: usize, base: f64) -> Vec<f64> {
    (0..head_dim / 2)
        .map(|i| base.powf(-2.0 * i as f64 / head_dim as f64))
        .collect()
}

/// `cos θ` and `sin θ` of every RoPE angle `θ_i = pos·base^(−2i/hd)` for `pos < positions` and
/// `i < hd/2`, formed in f64 and rounded once: `[positions, hd/2, 2]` on the GPU. Make one per
/// model (positions up to its longest sequence) and pass it to every RoPE launch.
pub struct RopeTable {
    buffer: GpuBuffer<f32>,
    head_dim: usize,
    positions: usize,
}

impl RopeTable {
    /// The table of a model's heads of `head_dim` (even) with RoPE base `base`, for positions
    /// `0 .. positions`.
    pub fn new(gpu: &Gpu, head_dim: usize, base: f64, positions: usize) -> Result<Self, ExecError> {
        let bad = |what: String, why: &str| ExecError::Dispatch {
            kernel: rope::NAME.into(),
            what,
            why: why.into(),
        };
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(bad(
                format!("head_dim = {head_dim}"),
                "RoPE pairs a head's halves: head_dim must be even and positive",
            ));
        }
        if !(base.is_finite() && base > 0.0) {
            return Err(bad(
                format!("base = {base}"),
                "the base must be a positive number",
            ));
        }
        if positions == 0 {
            return Err(bad("positions = 0".into(), "the table needs a position"));
        }
        expect_u32(rope::NAME, "positions × head_dim", positions * head_dim)?;
        let values = Self::values(head_dim, base, positions);
        Ok(RopeTable {
            buffer: gpu.upload(&values)?,
            head_dim,
            positions,
        })
    }

    /// The table's values on the host, as [`RopeTable::new`] uploads them.
    pub fn values(head_dim: usize, base: f64, positions: usize) -> Vec<f32> {
        let inv = inverse_frequencies(head_dim, base);
        let mut out = Vec::with_capacity(positions * head_dim);
        for pos in 0..positions {
            for f in &inv {
                let (s, c) = (pos as f64 * f).sin_cos();
                out.extend([c as f32, s as f32]);
            }
        }
        out
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Positions `0 .. positions()` are in the table.
    pub fn positions(&self) -> usize {
        self.positions
    }

    /// `Ok` when rows `0 .. rows` at `at` stay inside the table; else an error naming `kernel`.
    pub(crate) fn check(&self, kernel: &str, rows: usize, at: Positions) -> Result<(), ExecError> {
        if at.seq_len == 0 {
            return Err(ExecError::Dispatch {
                kernel: kernel.into(),
                what: "positions with seq_len 0".into(),
                why: "every row is at offset + row mod seq_len".into(),
            });
        }
        let last = at.offset as usize + rows.min(at.seq_len as usize);
        if rows > 0 && last > self.positions {
            return Err(ExecError::Dispatch {
                kernel: kernel.into(),
                what: format!(
                    "positions up to {} (offset {}, {} rows)",
                    last - 1,
                    at.offset,
                    rows
                ),
                why: format!("the RoPE table holds positions below {}", self.positions),
            });
        }
        Ok(())
    }
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
    Ok(vec![
        rope::build(64, false)?,
        rope::build(64, true)?,
        rope_vec4::build(32, false)?,
        rope_vec4::build(32, true)?,
        rope_qk_vec4::build(32, false)?,
        rope_qk_vec4::build(32, true)?,
    ])
}

/// The kernel of this module at any shape, within `limits`, for [`crate::catalog`].
pub(crate) mod build {
    use super::*;
    use crate::catalog::Failure;

    pub(crate) fn rope(half: u32, backward: bool, limits: &Limits) -> Result<Kernel, Failure> {
        let key = super::rope::key(half, backward);
        Ok(Kernel::build_with_limits(&key, limits, super::rope::body)?)
    }

    pub(crate) fn rope_vec4(half: u32, backward: bool, limits: &Limits) -> Result<Kernel, Failure> {
        if half == 0 || !half.is_multiple_of(4) {
            return Err(Failure::rule(
                format!("half = {half}"),
                "a positive multiple of 4 (four pairs an invocation)".into(),
            ));
        }
        let key = super::rope_vec4::key(half, backward);
        Ok(Kernel::build_with_limits(
            &key,
            limits,
            super::rope_vec4::body,
        )?)
    }

    pub(crate) fn rope_qk_vec4(
        half: u32,
        backward: bool,
        limits: &Limits,
    ) -> Result<Kernel, Failure> {
        if half == 0 || !half.is_multiple_of(4) {
            return Err(Failure::rule(
                format!("half = {half}"),
                "a positive multiple of 4 (four pairs an invocation)".into(),
            ));
        }
        let key = super::rope_qk_vec4::key(half, backward);
        Ok(Kernel::build_with_limits(
            &key,
            limits,
            super::rope_qk_vec4::body,
        )?)
    }
}

/// Rotate `x` (rows of `heads × head_dim`, `head_dim` the table's) in place: the forward, or
/// with `backward` the gradient's transpose rotation.
pub fn execute_rope(
    rec: &mut Recorder<'_>,
    x: &mut GpuBuffer<f32>,
    table: &RopeTable,
    heads: usize,
    positions: Positions,
    backward: bool,
) -> Result<(), ExecError> {
    let name = rope::NAME;
    let half = table.head_dim / 2;
    let width = check_rows(name, ("x", x), table, heads, positions)?;
    let pairs = expect_u32(name, "pairs", x.len() / 2)?;
    if pairs == 0 {
        return Ok(());
    }
    let (half, pairs_per_token) = (half as u32, (width / 2) as u32);
    let (kernel, args, invocations) = if half.is_multiple_of(4) {
        // Four pairs an invocation: every head's halves are whole vec4s.
        let kernel = rec
            .gpu()
            .kernel(&rope_vec4::key(half, backward), rope_vec4::body)?;
        let args = Args::new()
            .buffer_vec4("x", x)
            .buffer_vec4("cos_sin", &table.buffer)
            .param("quads", pairs / 4)
            .param("quads_per_token", pairs_per_token / 4);
        (kernel, args, pairs / 4)
    } else {
        let kernel = rec.gpu().kernel(&rope::key(half, backward), rope::body)?;
        let args = Args::new()
            .buffer("x", x)
            .buffer("cos_sin", &table.buffer)
            .param("pairs", pairs)
            .param("pairs_per_token", pairs_per_token);
        (kernel, args, pairs)
    };
    let args = args
        .param("seq_len", positions.seq_len)
        .param("offset", positions.offset);
    rec.launch(&kernel, &args, Grid::Threads(u64::from(invocations)))
}

/// The row width (`heads × head_dim`) of `x` (`binding` of `kernel`), once it is checked to
/// hold whole rows whose positions the table has.
fn check_rows(
    kernel: &str,
    (binding, x): (&str, &GpuBuffer<f32>),
    table: &RopeTable,
    heads: usize,
    positions: Positions,
) -> Result<usize, ExecError> {
    let width = heads
        .checked_mul(table.head_dim)
        .filter(|w| *w > 0)
        .ok_or_else(|| ExecError::Dispatch {
            kernel: kernel.into(),
            what: format!("{binding}: heads = {heads}"),
            why: format!(
                "heads × head_dim ({}) must be positive and fit",
                table.head_dim
            ),
        })?;
    let row = format!("heads × head_dim = {heads} × {}", table.head_dim);
    let rows = expect_rows(kernel, binding, x, width, &row)?;
    table.check(kernel, rows, positions)?;
    Ok(width)
}

/// Rotate a layer's queries `q` (rows of `heads × head_dim`) and keys `k` (rows of
/// `kv_heads × head_dim`, the same tokens) in place, as [`execute_rope`] does each: one launch
/// where half the head dimension is a multiple of 4, else one each.
pub fn execute_rope_qk(
    rec: &mut Recorder<'_>,
    (q, k): (&mut GpuBuffer<f32>, &mut GpuBuffer<f32>),
    table: &RopeTable,
    (heads, kv_heads): (usize, usize),
    positions: Positions,
    backward: bool,
) -> Result<(), ExecError> {
    let name = rope_qk_vec4::NAME;
    let q_width = check_rows(name, ("q", q), table, heads, positions)?;
    let k_width = check_rows(name, ("k", k), table, kv_heads, positions)?;
    if q.len() / q_width != k.len() / k_width {
        return Err(ExecError::Dispatch {
            kernel: name.into(),
            what: format!(
                "q of {} rows and k of {} rows",
                q.len() / q_width,
                k.len() / k_width
            ),
            why: "the queries and keys of the same tokens: as many rows each".into(),
        });
    }
    let half = table.head_dim / 2;
    if !half.is_multiple_of(4) {
        execute_rope(rec, q, table, heads, positions, backward)?;
        return execute_rope(rec, k, table, kv_heads, positions, backward);
    }
    let q_quads = expect_u32(name, "q_quads", q.len() / 8)?;
    let k_quads = expect_u32(name, "k_quads", k.len() / 8)?;
    let total = expect_u32(name, "q_quads + k_quads", q.len() / 8 + k.len() / 8)?;
    if total == 0 {
        return Ok(());
    }
    let kernel = rec.gpu().kernel(
        &rope_qk_vec4::key(half as u32, backward),
        rope_qk_vec4::body,
    )?;
    let args = Args::new()
        .buffer_vec4("q", q)
        .buffer_vec4("k", k)
        .buffer_vec4("cos_sin", &table.buffer)
        .param("q_quads", q_quads)
        .param("q_quads_per_token", (q_width / 8) as u32)
        .param("k_quads", k_quads)
        .param("k_quads_per_token", (k_width / 8) as u32)
        .param("seq_len", positions.seq_len)
        .param("offset", positions.offset);
    rec.launch(&kernel, &args, Grid::Threads(u64::from(total)))
}

/// RoPE forward, in place.
pub fn execute_rope_forward(
    rec: &mut Recorder<'_>,
    x: &mut GpuBuffer<f32>,
    table: &RopeTable,
    heads: usize,
    positions: Positions,
) -> Result<(), ExecError> {
    execute_rope(rec, x, table, heads, positions, false)
}

/// RoPE backward on a gradient, in place (apply to dQ and dK).
pub fn execute_rope_backward(
    rec: &mut Recorder<'_>,
    dx: &mut GpuBuffer<f32>,
    table: &RopeTable,
    heads: usize,
    positions: Positions,
) -> Result<(), ExecError> {
    execute_rope(rec, dx, table, heads, positions, true)
}

/// f64 references.
pub mod reference {
    /// RoPE of rows of `heads × head_dim` with base `base`, the angles in f64, forward or
    /// backward.
    pub fn rope(
        x: &[f64],
        (head_dim, base): (usize, f64),
        heads: usize,
        seq_len: usize,
        offset: usize,
        backward: bool,
    ) -> Vec<f64> {
        let inv = super::inverse_frequencies(head_dim, base);
        let half = head_dim / 2;
        let mut out = x.to_vec();
        for (t, row) in out.chunks_mut(heads * head_dim).enumerate() {
            let pos = (offset + t % seq_len) as f64;
            for head in row.chunks_mut(head_dim) {
                for (i, f) in inv.iter().enumerate() {
                    let (s, c) = (pos * f).sin_cos();
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
