//! One decoded token's attention over the KV cache: appending its keys and values
//! ([`execute_kv_cache_append`]), the forward for generation ([`execute_decode_attention`]) and
//! the backward (Hesper's single-token path, without its bugs), and the row softmax backward
//! (KERNELS.md).
//!
//! The token's query is at position `pos` and attends over `L = pos + 1` cached positions. The
//! KV cache is `[KV, max_seq, hd]` — its stride is `max_seq`, not `L` (Hesper used `L`). Query
//! head `h` reads KV head `h / G`, `G = H / KV`. With `A = softmax(τ·q·Kᵀ)` (`[H, L]`, saved
//! by the forward) and `τ = 1/√hd`:
//! - forward:          `O[h, d] = Σ_s A[h, s]·V[h/G, s, d]`
//! - apply backward:   `dA[h, s] = Σ_d dO[h, d]·V[h/G, s, d]`
//! - softmax backward: `dS = A ⊙ (dA − Σ_s A·dA)` (one reduction per row)
//! - score backward:   `dQ[h, d] = τ·Σ_s dS[h, s]·K[h/G, s, d]`
//! - the cached keys and values, which the seeds drop:
//!   `dK[kv, s, d] += τ·Σ_{h of kv} dS[h, s]·q[h, d]`, `dV[kv, s, d] += Σ_{h of kv} A[h, s]·dO[h, d]`
//!   (summed over the `G` query heads of each KV head; added, since the cache gradients collect
//!   every later token's contribution).
//!
//! `q` and `K` are the rotated (post-RoPE) values: rotate the query and the new key at `pos`
//! (`rope::execute_rope`) before the append and the forward. The backward's `dQ` comes out
//! rotated too — [`execute_decode_attention_backward`] applies `rope::execute_rope_backward` at
//! `pos`; apply it to the cache gradient once all tokens have added to it.

use hesper_dsl::prelude::*;
use hesper_exec::{Args, ExecError, GpuBuffer, Grid, Recorder};

use crate::rope::{self, Positions, RopeTable};
use crate::{Len, expect_len, expect_rows, expect_u32};

const WG: u32 = 256;

/// Key of the softmax backward: rows whose length is a multiple of 4 go as `vec4`s; subgroups
/// speed the row reduction up where the device has them. The row length is a runtime value
/// (the cache length changes with every decoded token).
fn softmax_key(vec4: bool, features: Features) -> KernelKey {
    KernelKey::new("softmax_backward")
        .workgroup_size(128)
        .shape("lanes4", vec4)
        .features(features & Features::SUBGROUPS)
        // Every column index is below the row length it loops to: no runtime bounds checks.
        .assume_in_bounds()
}

/// `ds = p ⊙ (dp − Σ_j p_j·dp_j)` per row, one workgroup per row.
fn softmax_body(k: &mut KernelBuilder) {
    if k.shape::<bool>("lanes4") {
        softmax_lanes::<Vec4<f32>>(k, |v| v.x() + v.y() + v.z() + v.w());
    } else {
        softmax_lanes::<f32>(k, |v| v);
    }
}

fn softmax_lanes<E>(k: &mut KernelBuilder, lane_sum: fn(Expr<E>) -> Expr<f32>)
where
    E: hesper_dsl::Reducible,
    Expr<E>: std::ops::Mul<Expr<E>, Output = Expr<E>> + std::ops::Sub<Expr<f32>, Output = Expr<E>>,
{
    let wg = k.invocations();
    let p = k.storage::<E>("p");
    let dp = k.storage::<E>("dp");
    let ds = k.storage_rw::<E>("ds");
    let rows = k.param::<u32>("rows");
    let width = k.param::<u32>("width");
    let row = k.let_("row", k.workgroup_index());
    // The whole workgroup leaves together (same row): the barrier in the reduction stays uniform.
    k.if_(row.ge(&rows), |k| k.return_());
    let base = k.let_("base", &row * &width);
    let dot = k.var("dot", E::zero());
    k.for_step("c", k.local_index(), &width, wg, |k, c| {
        k.add_assign(&dot, p.at(&base + &c) * dp.at(&base + &c));
    });
    let total = k.workgroup_reduce(lane_sum(dot.get()), Reduce::Sum);
    k.for_step("c", k.local_index(), &width, wg, |k, c| {
        let at = k.let_("at", &base + &c);
        k.store(&ds, &at, p.at(&at) * (dp.at(&at) - total.clone()));
    });
}

/// `dA[h, s] = Σ_d dO[h, d]·V[h/G, s, d]`, one invocation per `(h, s)`.
#[kernel(workgroup_size = WG)]
fn apply_backward(
    d_out: &[f32],
    v_cache: &[f32],
    d_attn: &mut [f32],
    #[shape] head_dim: u32,
    #[shape] group: u32,
    #[runtime] heads: u32,
    #[runtime] len: u32,
    #[runtime] max_seq: u32,
) {
    let i = global_index();
    if i < heads * len {
        let h = i / len;
        let s = i % len;
        let v_row = ((h / group) * max_seq + s) * head_dim;
        let mut acc = 0.0;
        for d in 0u32..head_dim {
            acc += d_out[h * head_dim + d] * v_cache[v_row + d];
        }
        d_attn[i] = acc;
    }
}

/// `dQ[h, d] = τ·Σ_s dS[h, s]·K[h/G, s, d]`, one invocation per `(h, d)`.
#[kernel(workgroup_size = WG)]
fn score_backward_q(
    d_scores: &[f32],
    k_cache: &[f32],
    d_q: &mut [f32],
    #[shape] head_dim: u32,
    #[shape] group: u32,
    #[shape] tau: f32,
    #[runtime] heads: u32,
    #[runtime] len: u32,
    #[runtime] max_seq: u32,
) {
    let i = global_index();
    if i < heads * head_dim {
        let h = i / head_dim;
        let d = i % head_dim;
        let k_base = (h / group) * max_seq * head_dim + d;
        let mut acc = 0.0;
        for s in 0u32..len {
            acc += d_scores[h * len + s] * k_cache[k_base + s * head_dim];
        }
        d_q[i] = tau * acc;
    }
}

/// `dK[kv, s, d] += τ·Σ_g dS[kv·G + g, s]·q[kv·G + g, d]` and
/// `dV[kv, s, d] += Σ_g A[kv·G + g, s]·dO[kv·G + g, d]`, one invocation per `(kv, s, d)` for
/// `s < L`; rows past `L` are not touched.
#[kernel(workgroup_size = WG)]
fn cache_backward(
    d_scores: &[f32],
    attn: &[f32],
    q: &[f32],
    d_out: &[f32],
    d_k_cache: &mut [f32],
    d_v_cache: &mut [f32],
    #[shape] head_dim: u32,
    #[shape] group: u32,
    #[shape] tau: f32,
    #[runtime] kv_heads: u32,
    #[runtime] len: u32,
    #[runtime] max_seq: u32,
) {
    let i = global_index();
    if i < kv_heads * len * head_dim {
        let d = i % head_dim;
        let s = (i / head_dim) % len;
        let kv = i / (head_dim * len);
        let mut dk = 0.0;
        let mut dv = 0.0;
        for g in 0u32..group {
            let h = kv * group + g;
            dk += d_scores[h * len + s] * q[h * head_dim + d];
            dv += attn[h * len + s] * d_out[h * head_dim + d];
        }
        let at = (kv * max_seq + s) * head_dim + d;
        d_k_cache[at] += tau * dk;
        d_v_cache[at] += dv;
    }
}

/// Writes one token's keys and values (`[KV, hd]`) into row `pos` of each KV head's cache.
#[kernel(workgroup_size = WG)]
fn kv_cache_append(
    k_new: &[f32],
    v_new: &[f32],
    k_cache: &mut [f32],
    v_cache: &mut [f32],
    #[shape] head_dim: u32,
    #[runtime] kv_heads: u32,
    #[runtime] pos: u32,
    #[runtime] max_seq: u32,
) {
    let i = global_index();
    if i < kv_heads * head_dim {
        let at = ((i / head_dim) * max_seq + pos) * head_dim + i % head_dim;
        k_cache[at] = k_new[i];
        v_cache[at] = v_new[i];
    }
}

/// Invocations of the decode forward: one workgroup per query head, each invocation a strided
/// share of its cached positions for the scores, and for `A·V` one column of the output in one
/// of `DECODE_WG / hd` groups of positions (2 at hd = 128, 4 at 64: a group alone walking every
/// position was 104 µs of a SmolLM2 token's 3.1 ms of attention on the H200).
const DECODE_WG: u32 = 256;
/// The largest head dimension the decode forward takes (at least two groups of positions).
const DECODE_MAX_HD: u32 = 128;

fn decode_key(head_dim: u32, group: u32, tau: f32, features: Features) -> KernelKey {
    KernelKey::new("decode_attention")
        .workgroup_size(DECODE_WG)
        .shape("head_dim", head_dim)
        .shape("group", group)
        .shape("tau", tau)
        .features(features & Features::SUBGROUPS)
        .assume_in_bounds()
}

/// `A[h] = softmax(τ·q_h·Kᵀ)` over the `L` cached positions (written into `attn`, the backward's
/// input), then `O[h] = A[h]·V`.
fn decode_body(k: &mut KernelBuilder) {
    let hd: u32 = k.shape("head_dim");
    let group: u32 = k.shape("group");
    let tau = k.shape_const::<f32>("tau");
    let q = k.storage::<f32>("q");
    let k_cache = k.storage::<f32>("k_cache");
    let v_cache = k.storage::<f32>("v_cache");
    let attn = k.storage_rw::<f32>("attn");
    let out = k.storage_rw::<f32>("o");
    let heads = k.param::<u32>("heads");
    let len = k.param::<u32>("len");
    let max_seq = k.param::<u32>("max_seq");
    let h = k.let_("h", k.workgroup_index());
    // Whole workgroups leave together: the reductions' barriers stay uniform.
    k.if_(h.ge(&heads), |k| k.return_());
    let cache0 = k.let_("cache0", (&h / group) * &max_seq * hd);
    let row0 = k.let_("row0", &h * &len);
    let lid = k.local_index();
    let local_max = k.var("local_max", lit(-3.0e38f32));
    k.comment("Scores; each invocation keeps the positions it wrote, so no barrier is needed.");
    k.for_step("s", lid.clone(), &len, DECODE_WG, |k, s| {
        let key = k.let_("key", &cache0 + &s * hd);
        let dot = k.var("dot", lit(0.0f32));
        k.for_range("d", 0u32, hd, |k, d| {
            k.assign(
                &dot,
                q.at(&h * hd + &d).fma(k_cache.at(&key + &d), dot.get()),
            );
        });
        let score = k.let_("score", dot.get() * &tau);
        k.store(&attn, &row0 + &s, &score);
        k.assign(&local_max, local_max.get().max(&score));
    });
    let m = k.workgroup_reduce(local_max.get(), Reduce::Max);
    let local_sum = k.var("local_sum", lit(0.0f32));
    k.for_step("s", lid.clone(), &len, DECODE_WG, |k, s| {
        let e = k.let_("e", (attn.at(&row0 + &s) - &m).exp());
        k.store(&attn, &row0 + &s, &e);
        k.add_assign(&local_sum, e);
    });
    let z = k.workgroup_reduce(local_sum.get(), Reduce::Sum);
    let inv = k.let_("inv", 1.0f32 / z);
    k.for_step("s", lid.clone(), &len, DECODE_WG, |k, s| {
        let at = k.let_("at", &row0 + &s);
        k.store(&attn, &at, attn.at(&at) * &inv);
    });
    k.comment("Every invocation reads every position's probability.");
    k.storage_barrier();
    // Invocation `g·hd + d` adds column `d` over positions `g, g + groups, …`; the first `hd`
    // then add the groups' partial sums.
    let groups = DECODE_WG / hd;
    let partial = k.workgroup_array::<f32>("partial", DECODE_WG);
    k.if_(lid.lt(groups * hd), |k| {
        let column = k.let_("column", &lid % hd);
        let acc = k.var("acc", lit(0.0f32));
        k.for_step("s", &lid / hd, &len, groups, |k, s| {
            let value = v_cache.at(&cache0 + &s * hd + &column);
            k.assign(&acc, attn.at(&row0 + &s).fma(value, acc.get()));
        });
        k.store(&partial, &lid, acc.get());
    });
    k.workgroup_barrier();
    // A loop, not one expression: at hd = 1 there are 256 groups to add.
    k.if_(lid.lt(hd), |k| {
        let sum = k.var("sum", partial.at(&lid));
        k.for_range("g", 1u32, groups, |k, g| {
            k.add_assign(&sum, partial.at(&lid + &g * hd));
        });
        k.store(&out, &h * hd + &lid, sum.get());
    });
}

/// The WGSL of this module's kernels at a representative shape (hd 128, GQA group 4).
pub fn kernels() -> Result<Vec<Kernel>, hesper_dsl::DslError> {
    let tau = 1.0 / (128f32).sqrt();
    Ok(vec![
        kv_cache_append::build(128)?,
        Kernel::build(&decode_key(128, 4, tau, Features::SUBGROUPS), decode_body)?,
        Kernel::build(&softmax_key(true, Features::SUBGROUPS), softmax_body)?,
        apply_backward::build(128, 4)?,
        score_backward_q::build(128, 4, tau)?,
        cache_backward::build(128, 4, tau)?,
    ])
}

/// Each kernel of this module at any shape, within `limits`, for [`crate::catalog`].
pub(crate) mod build {
    use super::*;
    use crate::catalog::Failure;

    /// `1/√hd`, as the executor forms `τ` ([`DecodeShape`]).
    pub(crate) fn tau(head_dim: u32) -> f32 {
        (1.0 / (head_dim as f64).sqrt()) as f32
    }

    pub(crate) fn kv_cache_append(head_dim: u32, limits: &Limits) -> Result<Kernel, Failure> {
        let key = super::kv_cache_append::key(head_dim);
        Ok(Kernel::build_with_limits(
            &key,
            limits,
            super::kv_cache_append::body,
        )?)
    }

    /// The forward, for a head dimension the executor takes (`1 ..= 128`).
    pub(crate) fn decode_attention(
        (head_dim, group, tau): (u32, u32, f32),
        features: Features,
        limits: &Limits,
    ) -> Result<Kernel, Failure> {
        if head_dim == 0 || head_dim > DECODE_MAX_HD {
            return Err(Failure::rule(
                format!("head_dim = {head_dim}"),
                format!("head_dim must be 1 to {DECODE_MAX_HD} (one invocation per output column)"),
            ));
        }
        let key = decode_key(head_dim, group, tau, features);
        Ok(Kernel::build_with_limits(&key, limits, decode_body)?)
    }

    pub(crate) fn softmax_backward(
        lanes4: bool,
        features: Features,
        limits: &Limits,
    ) -> Result<Kernel, Failure> {
        let key = softmax_key(lanes4, features);
        Ok(Kernel::build_with_limits(&key, limits, softmax_body)?)
    }

    pub(crate) fn apply_backward(
        head_dim: u32,
        group: u32,
        limits: &Limits,
    ) -> Result<Kernel, Failure> {
        let key = super::apply_backward::key(head_dim, group);
        Ok(Kernel::build_with_limits(
            &key,
            limits,
            super::apply_backward::body,
        )?)
    }

    pub(crate) fn score_backward_q(
        (head_dim, group, tau): (u32, u32, f32),
        limits: &Limits,
    ) -> Result<Kernel, Failure> {
        let key = super::score_backward_q::key(head_dim, group, tau);
        Ok(Kernel::build_with_limits(
            &key,
            limits,
            super::score_backward_q::body,
        )?)
    }

    pub(crate) fn cache_backward(
        (head_dim, group, tau): (u32, u32, f32),
        limits: &Limits,
    ) -> Result<Kernel, Failure> {
        let key = super::cache_backward::key(head_dim, group, tau);
        Ok(Kernel::build_with_limits(
            &key,
            limits,
            super::cache_backward::body,
        )?)
    }
}

/// `ds = p ⊙ (dp − rowsum(p ⊙ dp))` over rows of `cols`.
pub fn execute_softmax_backward(
    rec: &mut Recorder<'_>,
    p: &GpuBuffer<f32>,
    dp: &GpuBuffer<f32>,
    cols: usize,
    ds: &mut GpuBuffer<f32>,
) -> Result<(), ExecError> {
    let name = "softmax_backward";
    let rows = expect_rows(name, "p", p, cols, "cols")?;
    expect_len(name, "dp", dp, p.len(), "as p")?;
    expect_len(name, "ds", ds, p.len(), "as p")?;
    let rows = expect_u32(name, "rows", rows)?;
    let vec4 = cols.is_multiple_of(4);
    let key = softmax_key(vec4, rec.gpu().kernel_features());
    // Two strides over the row (`vec4`s where it allows).
    let width = if vec4 { cols / 4 } else { cols };
    let iterations = 2 * width.div_ceil(key.invocations() as usize) as u64;
    crate::expect_loops(rec.gpu(), name, || format!("cols = {cols}"), iterations)?;
    if rows == 0 {
        return Ok(());
    }
    let kernel = rec.gpu().kernel(&key, softmax_body)?;
    let (args, width) = if vec4 {
        let args = Args::new()
            .buffer_vec4("p", p)
            .buffer_vec4("dp", dp)
            .buffer_vec4("ds", ds);
        (args, cols / 4)
    } else {
        (
            Args::new().buffer("p", p).buffer("dp", dp).buffer("ds", ds),
            cols,
        )
    };
    let args = args
        .param("rows", rows)
        .param("width", expect_u32(name, "cols", width)?);
    rec.launch(&kernel, &args, Grid::WorkgroupPerItem(rows as u64))
}

/// The shape of one decoded token's attention.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeShape {
    /// Query heads `H` and key/value heads `KV` (`H` a multiple of `KV`).
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Rows reserved per KV head in the cache (its stride).
    pub max_seq: usize,
    /// The query's position; it attends over `pos + 1` cached positions.
    pub pos: usize,
}

impl DecodeShape {
    fn len(&self) -> usize {
        self.pos + 1
    }
    fn group(&self) -> usize {
        self.heads / self.kv_heads.max(1)
    }
    fn tau(&self) -> f32 {
        (1.0 / (self.head_dim as f64).sqrt()) as f32
    }
    fn check(&self, kernel: &str) -> Result<(), ExecError> {
        let bad = |why: String| ExecError::Dispatch {
            kernel: kernel.into(),
            what: format!("{self:?}"),
            why,
        };
        if self.kv_heads == 0 || self.heads == 0 || !self.heads.is_multiple_of(self.kv_heads) {
            return Err(bad("heads must be a positive multiple of kv_heads".into()));
        }
        if self.head_dim == 0 || self.pos >= self.max_seq {
            return Err(bad("head_dim must be positive and pos < max_seq".into()));
        }
        // Every element count the kernels index (`[H, hd]`, `[KV, max_seq, hd]`, `[H, L]`).
        let product = |dims: &[usize]| dims.iter().try_fold(1usize, |n, d| n.checked_mul(*d));
        let counts = [
            product(&[self.heads, self.head_dim]),
            product(&[self.kv_heads, self.max_seq, self.head_dim]),
            product(&[self.heads, self.len()]),
        ];
        if counts
            .iter()
            .any(|n| n.is_none_or(|n| n > u32::MAX as usize))
        {
            return Err(bad(
                "the buffers' element counts must fit the kernels' u32 indices".into(),
            ));
        }
        Ok(())
    }

    /// `Ok` when an invocation's loops over the `pos + 1` cached positions fit the device
    /// ([`crate::expect_loops`]): once over them for the backward's `dQ`; for the forward
    /// ([`DecodeShape::forward_iterations`]) three strides with a head's dot product in each
    /// step, then `A·V` in groups.
    fn check_loop(
        &self,
        kernel: &str,
        gpu: &hesper_exec::Gpu,
        forward: bool,
    ) -> Result<(), ExecError> {
        let iterations = if forward {
            self.forward_iterations()
        } else {
            self.len() as u64
        };
        let what = || format!("pos = {} ({} cached positions)", self.pos, self.len());
        crate::expect_loops(gpu, kernel, what, iterations)
    }

    /// `decode_attention`'s iterations an invocation: `⌈L/256⌉·(hd + 3)` for the scores (a loop
    /// of `hd` a position), the exponentials and the normalization, `⌈L/groups⌉` for `A·V` and
    /// `groups` to add the groups (`groups = 256 / hd`). On lavapipe at hd = 128 and L = 65 535
    /// its `O` was 16% off before this was counted.
    fn forward_iterations(&self) -> u64 {
        let (len, hd) = (self.len() as u64, self.head_dim as u64);
        let groups = (u64::from(DECODE_WG) / hd.max(1)).max(1);
        len.div_ceil(u64::from(DECODE_WG)) * (hd + 3) + len.div_ceil(groups) + groups
    }

    /// The shape checked and as the kernels take it (`u32`s).
    fn dims(&self, kernel: &str) -> Result<DecodeDims, ExecError> {
        self.check(kernel)?;
        let u = |what: &str, v: usize| expect_u32(kernel, what, v);
        Ok(DecodeDims {
            head_dim: u("head_dim", self.head_dim)?,
            group: u("group", self.group())?,
            heads: u("heads", self.heads)?,
            kv_heads: u("kv_heads", self.kv_heads)?,
            len: u("len", self.len())?,
            max_seq: u("max_seq", self.max_seq)?,
        })
    }
}

/// The buffers of one decoded token's attention backward.
pub struct DecodeInputs<'a> {
    /// The rotated query `[H, hd]`, the saved probabilities `A` `[H, L]`, the output gradient
    /// `dO` `[H, hd]`, and the caches `[KV, max_seq, hd]` (keys rotated).
    pub q: &'a GpuBuffer<f32>,
    pub attn: &'a GpuBuffer<f32>,
    pub d_out: &'a GpuBuffer<f32>,
    pub k_cache: &'a GpuBuffer<f32>,
    pub v_cache: &'a GpuBuffer<f32>,
    /// The model's RoPE rotations (its head dimension, positions up to `pos` at least).
    pub rope: &'a RopeTable,
}

/// [`DecodeShape`] in the kernels' `u32`s.
struct DecodeDims {
    head_dim: u32,
    group: u32,
    heads: u32,
    kv_heads: u32,
    len: u32,
    max_seq: u32,
}

/// Workspace and outputs of [`execute_decode_attention_backward`].
pub struct DecodeGrads<'a> {
    /// Workspace of exactly `[H, L]` (`L = pos + 1`): `dA`, then `dS`.
    pub d_attn: &'a mut GpuBuffer<f32>,
    pub d_scores: &'a mut GpuBuffer<f32>,
    /// `dQ` `[H, hd]`, overwritten, un-rotated (the gradient of the pre-RoPE query).
    pub d_q: &'a mut GpuBuffer<f32>,
    /// Cache gradients `[KV, max_seq, hd]`, added to for positions `< L`, w.r.t. the rotated keys.
    pub d_k_cache: &'a mut GpuBuffer<f32>,
    pub d_v_cache: &'a mut GpuBuffer<f32>,
}

/// `dA[h, s] = Σ_d dO[h, d]·V[h/G, s, d]` for `s < L`.
pub fn execute_apply_backward(
    rec: &mut Recorder<'_>,
    shape: DecodeShape,
    d_out: &GpuBuffer<f32>,
    v_cache: &GpuBuffer<f32>,
    d_attn: &mut GpuBuffer<f32>,
) -> Result<(), ExecError> {
    let name = apply_backward::NAME;
    shape.check(name)?;
    expect_len(
        name,
        "d_out",
        d_out,
        shape.heads * shape.head_dim,
        "[heads, head_dim]",
    )?;
    let cache = shape.kv_heads * shape.max_seq * shape.head_dim;
    expect_len(
        name,
        "v_cache",
        v_cache,
        cache,
        "[kv_heads, max_seq, head_dim]",
    )?;
    expect_len(
        name,
        "d_attn",
        d_attn,
        shape.heads * shape.len(),
        "[heads, pos + 1]",
    )?;
    let DecodeDims {
        head_dim: hd,
        group,
        heads,
        len,
        max_seq,
        ..
    } = shape.dims(name)?;
    let kernel = rec
        .gpu()
        .kernel(&apply_backward::key(hd, group), apply_backward::body)?;
    let args = Args::new()
        .buffer("d_out", d_out)
        .buffer("v_cache", v_cache)
        .buffer("d_attn", d_attn)
        .param("heads", heads)
        .param("len", len)
        .param("max_seq", max_seq);
    rec.launch(
        &kernel,
        &args,
        Grid::Threads((shape.heads * shape.len()) as u64),
    )
}

/// `dQ[h, d] = τ·Σ_s dS[h, s]·K[h/G, s, d]` (rotated; RoPE backward is the caller's).
pub fn execute_score_backward_q(
    rec: &mut Recorder<'_>,
    shape: DecodeShape,
    d_scores: &GpuBuffer<f32>,
    k_cache: &GpuBuffer<f32>,
    d_q: &mut GpuBuffer<f32>,
) -> Result<(), ExecError> {
    let name = score_backward_q::NAME;
    shape.check(name)?;
    shape.check_loop(name, rec.gpu(), false)?;
    expect_len(
        name,
        "d_scores",
        d_scores,
        shape.heads * shape.len(),
        "[heads, pos + 1]",
    )?;
    let cache = shape.kv_heads * shape.max_seq * shape.head_dim;
    expect_len(
        name,
        "k_cache",
        k_cache,
        cache,
        "[kv_heads, max_seq, head_dim]",
    )?;
    expect_len(
        name,
        "d_q",
        d_q,
        shape.heads * shape.head_dim,
        "[heads, head_dim]",
    )?;
    let DecodeDims {
        head_dim: hd,
        group,
        heads,
        len,
        max_seq,
        ..
    } = shape.dims(name)?;
    let kernel = rec.gpu().kernel(
        &score_backward_q::key(hd, group, shape.tau()),
        score_backward_q::body,
    )?;
    let args = Args::new()
        .buffer("d_scores", d_scores)
        .buffer("k_cache", k_cache)
        .buffer("d_q", d_q)
        .param("heads", heads)
        .param("len", len)
        .param("max_seq", max_seq);
    rec.launch(
        &kernel,
        &args,
        Grid::Threads((shape.heads * shape.head_dim) as u64),
    )
}

/// `dK += τ·dSᵀ·q` and `dV += Aᵀ·dO` for the cached positions `< L`, summed over each KV
/// head's query heads.
#[allow(clippy::too_many_arguments)]
pub fn execute_cache_backward(
    rec: &mut Recorder<'_>,
    shape: DecodeShape,
    d_scores: &GpuBuffer<f32>,
    attn: &GpuBuffer<f32>,
    q: &GpuBuffer<f32>,
    d_out: &GpuBuffer<f32>,
    d_k_cache: &mut GpuBuffer<f32>,
    d_v_cache: &mut GpuBuffer<f32>,
) -> Result<(), ExecError> {
    let name = cache_backward::NAME;
    shape.check(name)?;
    let scores = shape.heads * shape.len();
    expect_len(name, "d_scores", d_scores, scores, "[heads, pos + 1]")?;
    expect_len(name, "attn", attn, scores, "[heads, pos + 1]")?;
    expect_len(
        name,
        "q",
        q,
        shape.heads * shape.head_dim,
        "[heads, head_dim]",
    )?;
    expect_len(
        name,
        "d_out",
        d_out,
        shape.heads * shape.head_dim,
        "[heads, head_dim]",
    )?;
    let cache = shape.kv_heads * shape.max_seq * shape.head_dim;
    expect_len(
        name,
        "d_k_cache",
        d_k_cache,
        cache,
        "[kv_heads, max_seq, head_dim]",
    )?;
    expect_len(
        name,
        "d_v_cache",
        d_v_cache,
        cache,
        "[kv_heads, max_seq, head_dim]",
    )?;
    let DecodeDims {
        head_dim: hd,
        group,
        kv_heads,
        len,
        max_seq,
        ..
    } = shape.dims(name)?;
    let kernel = rec.gpu().kernel(
        &cache_backward::key(hd, group, shape.tau()),
        cache_backward::body,
    )?;
    let args = Args::new()
        .buffer("d_scores", d_scores)
        .buffer("attn", attn)
        .buffer("q", q)
        .buffer("d_out", d_out)
        .buffer("d_k_cache", d_k_cache)
        .buffer("d_v_cache", d_v_cache)
        .param("kv_heads", kv_heads)
        .param("len", len)
        .param("max_seq", max_seq);
    rec.launch(
        &kernel,
        &args,
        Grid::Threads((shape.kv_heads * shape.len() * shape.head_dim) as u64),
    )
}

/// Writes one token's rotated keys and values `[KV, hd]` into row `pos` of the caches
/// `[KV, max_seq, hd]`; the other rows are untouched.
pub fn execute_kv_cache_append(
    rec: &mut Recorder<'_>,
    shape: DecodeShape,
    (k_new, v_new): (&GpuBuffer<f32>, &GpuBuffer<f32>),
    k_cache: &mut GpuBuffer<f32>,
    v_cache: &mut GpuBuffer<f32>,
) -> Result<(), ExecError> {
    let name = kv_cache_append::NAME;
    shape.check(name)?;
    let row = shape.kv_heads * shape.head_dim;
    expect_len(name, "k_new", k_new, row, "[kv_heads, head_dim]")?;
    expect_len(name, "v_new", v_new, row, "[kv_heads, head_dim]")?;
    let cache = shape.kv_heads * shape.max_seq * shape.head_dim;
    let what = "[kv_heads, max_seq, head_dim]";
    expect_len(name, "k_cache", k_cache, cache, what)?;
    expect_len(name, "v_cache", v_cache, cache, what)?;
    let dims = shape.dims(name)?;
    let kernel = rec
        .gpu()
        .kernel(&kv_cache_append::key(dims.head_dim), kv_cache_append::body)?;
    let args = Args::new()
        .buffer("k_new", k_new)
        .buffer("v_new", v_new)
        .buffer("k_cache", k_cache)
        .buffer("v_cache", v_cache)
        .param("kv_heads", dims.kv_heads)
        .param("pos", expect_u32(name, "pos", shape.pos)?)
        .param("max_seq", dims.max_seq);
    rec.launch(&kernel, &args, Grid::Threads(row as u64))
}

/// One decoded token's attention over the `pos + 1` cached positions: the probabilities
/// `attn [H, pos + 1]` (kept for [`execute_decode_attention_backward`]) and `O [H, hd]`, from
/// the rotated query `q [H, hd]` and the caches `[KV, max_seq, hd]` (append the token's keys
/// and values first). `attn` may be longer than `H·(pos + 1)` (sized for the longest sequence,
/// say): its first `H·(pos + 1)` elements are written, row `h` at `h·(pos + 1)`.
pub fn execute_decode_attention(
    rec: &mut Recorder<'_>,
    shape: DecodeShape,
    q: &GpuBuffer<f32>,
    (k_cache, v_cache): (&GpuBuffer<f32>, &GpuBuffer<f32>),
    attn: &mut GpuBuffer<f32>,
    o: &mut GpuBuffer<f32>,
) -> Result<(), ExecError> {
    let name = "decode_attention";
    shape.check(name)?;
    shape.check_loop(name, rec.gpu(), true)?;
    if shape.head_dim > DECODE_MAX_HD as usize {
        return Err(ExecError::Dispatch {
            kernel: name.into(),
            what: format!("head_dim = {}", shape.head_dim),
            why: format!("at most {DECODE_MAX_HD} (one invocation per output column)"),
        });
    }
    let per_head = shape.heads * shape.head_dim;
    expect_len(name, "q", q, per_head, "[heads, head_dim]")?;
    let cache = shape.kv_heads * shape.max_seq * shape.head_dim;
    let what = "[kv_heads, max_seq, head_dim]";
    expect_len(name, "k_cache", k_cache, cache, what)?;
    expect_len(name, "v_cache", v_cache, cache, what)?;
    // At least `[H, L]`: a buffer sized for the longest `L` serves every token (the kernel's
    // rows are `L` apart, so only the first `H·L` elements are written).
    expect_len(
        name,
        "attn",
        attn,
        Len::AtLeast(shape.heads * shape.len()),
        "[heads, pos + 1]",
    )?;
    expect_len(name, "o", o, per_head, "[heads, head_dim]")?;
    let dims = shape.dims(name)?;
    let key = decode_key(
        dims.head_dim,
        dims.group,
        shape.tau(),
        rec.gpu().kernel_features(),
    );
    let kernel = rec.gpu().kernel(&key, decode_body)?;
    let args = Args::new()
        .buffer("q", q)
        .buffer("k_cache", k_cache)
        .buffer("v_cache", v_cache)
        .buffer("attn", attn)
        .buffer("o", o)
        .param("heads", dims.heads)
        .param("len", dims.len)
        .param("max_seq", dims.max_seq);
    rec.launch(&kernel, &args, Grid::WorkgroupPerItem(shape.heads as u64))
}

/// One decoded token's attention backward: `dA`, `dS`, `dQ` (un-rotated at `pos`), and the
/// cache gradients added for every cached position.
pub fn execute_decode_attention_backward(
    rec: &mut Recorder<'_>,
    shape: DecodeShape,
    inputs: &DecodeInputs<'_>,
    grads: DecodeGrads<'_>,
) -> Result<(), ExecError> {
    // Check every buffer before recording anything: an error must not leave half a backward
    // in the caller's recorder.
    let name = "decode_attention_backward";
    shape.check(name)?;
    shape.check_loop(name, rec.gpu(), false)?;
    let (scores, per_head) = (shape.heads * shape.len(), shape.heads * shape.head_dim);
    let cache = shape.kv_heads * shape.max_seq * shape.head_dim;
    for (binding, buf, len, what) in [
        ("q", inputs.q, per_head, "[heads, head_dim]"),
        ("attn", inputs.attn, scores, "[heads, pos + 1]"),
        ("d_out", inputs.d_out, per_head, "[heads, head_dim]"),
        (
            "k_cache",
            inputs.k_cache,
            cache,
            "[kv_heads, max_seq, head_dim]",
        ),
        (
            "v_cache",
            inputs.v_cache,
            cache,
            "[kv_heads, max_seq, head_dim]",
        ),
        ("d_attn", &*grads.d_attn, scores, "[heads, pos + 1]"),
        ("d_scores", &*grads.d_scores, scores, "[heads, pos + 1]"),
        ("d_q", &*grads.d_q, per_head, "[heads, head_dim]"),
        (
            "d_k_cache",
            &*grads.d_k_cache,
            cache,
            "[kv_heads, max_seq, head_dim]",
        ),
        (
            "d_v_cache",
            &*grads.d_v_cache,
            cache,
            "[kv_heads, max_seq, head_dim]",
        ),
    ] {
        expect_len(name, binding, buf, len, what)?;
    }
    if inputs.rope.head_dim() != shape.head_dim {
        return Err(ExecError::Binding {
            kernel: name.into(),
            binding: "rope".into(),
            expected: format!("a RoPE table of head_dim {}", shape.head_dim),
            given: format!("one of head_dim {}", inputs.rope.head_dim()),
        });
    }
    let at = Positions {
        seq_len: 1,
        offset: expect_u32(name, "pos", shape.pos)?,
    };
    inputs.rope.check(name, 1, at)?;
    execute_apply_backward(rec, shape, inputs.d_out, inputs.v_cache, grads.d_attn)?;
    execute_softmax_backward(rec, inputs.attn, grads.d_attn, shape.len(), grads.d_scores)?;
    execute_score_backward_q(rec, shape, grads.d_scores, inputs.k_cache, grads.d_q)?;
    rope::execute_rope_backward(rec, grads.d_q, inputs.rope, shape.heads, at)?;
    execute_cache_backward(
        rec,
        shape,
        grads.d_scores,
        inputs.attn,
        inputs.q,
        inputs.d_out,
        grads.d_k_cache,
        grads.d_v_cache,
    )
}
