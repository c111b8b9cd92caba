//! Causal attention over whole sequences, forward and backward, flash style (FlashAttention-2,
//! without float atomics): the `S×S` score matrix never exists in memory.
//!
//! `B` sequences of `S` positions (token `t = b·S + s`); `Q`, `O` are `[T, H·hd]`, `K`, `V`
//! `[T, KV·hd]`, query head `h` reads KV head `h / G`. Position `s` attends to the positions
//! `≤ s` of its own sequence, scaled by `τ` ([`SeqShape::scale`], `1/√hd` by default). With
//! [`ValidLengths`] (right padding) sequence `b` has `len_b ≤ S` real positions: keys at or past
//! `len_b` are excluded, and query rows past it produce zeros (never NaN) in every output.
//!
//! - forward ([`execute_attention_forward`]): `O = softmax(τ·Q·Kᵀ + causal)·V` by an online
//!   softmax over blocks of keys, and the rows' log-sum-exp `lse [T, H]` for the backward;
//! - backward ([`execute_attention_backward`]): a pre-pass writes `(lse, D = rowsum(dO ⊙ O))`
//!   per row into one packed `stats [T, H, 2]` buffer, then one kernel per KV block writes `dK`
//!   and `dV` (looping over the `G` query heads of its KV head and over the query blocks at or
//!   after it) and one kernel per query block writes `dQ`, both recomputing `P = exp(τ·S − lse)`
//!   (on the tensor cores, with a workspace for them, the second takes the first's `dS` instead:
//!   [`SeqGrads::scores`]).
//!   Packing `lse` and `D` keeps the dK/dV kernel at 8 storage buffers, what WebGPU guarantees.
//!
//! ## Tiling
//! A workgroup owns a block of `block` query rows (forward, dQ) or keys (dK/dV) of one head, with
//! `(block/4)²` invocations: invocation `(tx, ty)` holds the scores of rows `4·ty .. 4·ty+4` and
//! keys `4·tx .. 4·tx+4`, and of a `[block, hd]` accumulator the rows `4·ty ..` and the `vec4`
//! columns `tx, tx + block/4, …`. Products step through workgroup memory: the score tile
//! `S = Q·Kᵀ` stages `bk`-deep slices of both operands depth-major, the accumulator products
//! (`P·V`, `Pᵀ·dO`, `dSᵀ·Q`, `dS·K`) stage the probabilities (or `dS`) of the block and `vk`
//! rows of the other operand at a time. Reads past the sequence's end are clamped into it and
//! masked; rows past the end are never stored.
//!
//! ## Example
//! ```no_run
//! use hesper_exec::Gpu;
//! use hesper_kernels::attention::{self, SeqGrads, SeqInputs, SeqSaved, SeqShape, ValidLengths};
//!
//! let gpu = Gpu::new()?;
//! // Two sequences of 128 positions (the second padded after 100), 9 query heads reading 3
//! // key/value heads of 64: SmolLM2's attention.
//! let shape = SeqShape::new(2, 128, 9, 3, 64);
//! let lens = ValidLengths::upload(&gpu, &[128, 100], 128)?;
//! let (q, k, v) = (
//!     gpu.zeros::<f32>(shape.q_len())?,
//!     gpu.zeros::<f32>(shape.kv_len())?,
//!     gpu.zeros::<f32>(shape.kv_len())?,
//! );
//! let rows = shape.tokens() * shape.heads;
//! let (mut o, mut lse) = (gpu.zeros::<f32>(shape.q_len())?, gpu.zeros::<f32>(rows)?);
//! let inputs = SeqInputs { q: &q, k: &k, v: &v, lens: Some(&lens) };
//! let mut rec = gpu.recorder();
//! attention::execute_attention_forward(&mut rec, shape, inputs, &mut o, &mut lse)?;
//!
//! // The backward, given dO, in the same submission.
//! let d_out = gpu.zeros::<f32>(shape.q_len())?;
//! let mut stats = gpu.zeros::<f32>(2 * rows)?;
//! let (mut d_q, mut d_k, mut d_v) = (
//!     gpu.zeros::<f32>(shape.q_len())?,
//!     gpu.zeros::<f32>(shape.kv_len())?,
//!     gpu.zeros::<f32>(shape.kv_len())?,
//! );
//! let saved = SeqSaved { inputs, o: &o, lse: &lse };
//! // Where the tensor cores run the backward, a workspace keeps the scores' gradients for dQ.
//! let mut scores = attention::scores_workspace_len(&gpu, &shape)
//!     .map(|n| gpu.zeros(n))
//!     .transpose()?;
//! let grads = SeqGrads {
//!     stats: &mut stats,
//!     scores: scores.as_mut(),
//!     d_q: &mut d_q,
//!     d_k: &mut d_k,
//!     d_v: &mut d_v,
//! };
//! attention::execute_attention_backward(&mut rec, shape, saved, &d_out, grads)?;
//! rec.submit()?;
//! # Ok::<(), hesper_exec::ExecError>(())
//! ```

use hesper_dsl::prelude::*;
use hesper_dsl::{Limits, LocalArray, ReadBuffer, Var, WorkgroupArray};
use hesper_exec::half::f16;
use hesper_exec::{Args, ExecError, Gpu, GpuBuffer, Grid, Recorder};

use super::coop::{self, CoopSeqTile, Which};
use crate::linear::{Precision, lane, offset};
use crate::{expect_len, expect_u32};

/// Scores of excluded keys take part in no maximum: a finite stand-in for `−∞` (no `inf - inf`).
const NEG_BIG: f32 = -1.0e30;

/// The largest head dimension the kernels take (the accumulators are registers).
pub const MAX_HEAD_DIM: usize = 128;

/// The shape of one attention call: `batch` sequences of `seq_len` positions, `heads` query heads
/// reading `kv_heads` key/value heads of `head_dim`, scores scaled by `scale`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SeqShape {
    pub batch: usize,
    pub seq_len: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// `τ`: [`SeqShape::new`] sets `1/√head_dim`.
    pub scale: f32,
    /// `Precision::F16`: the products on the tensor cores ([`super::coop`]) where the device
    /// offers them and `head_dim` is a multiple of 16; else (and at `F32`, the default) in f32.
    pub precision: Precision,
    /// The backward on the tensor cores multiplies `dO` by `2^grad_exponent` before rounding it
    /// to f16 and its results by `2^−grad_exponent`: a mean loss's gradients (~1/N) keep their
    /// digits (as `Gemm::input_exponent`). At most 64 either way; 0 by default.
    pub grad_exponent: i32,
}

impl SeqShape {
    /// The shape with the usual scale `τ = 1/√head_dim`.
    pub fn new(
        batch: usize,
        seq_len: usize,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> Self {
        SeqShape {
            batch,
            seq_len,
            heads,
            kv_heads,
            head_dim,
            scale: (1.0 / (head_dim as f64).sqrt()) as f32,
            precision: Precision::F32,
            grad_exponent: 0,
        }
    }

    /// The same shape at another precision.
    pub fn with_precision(self, precision: Precision) -> Self {
        SeqShape { precision, ..self }
    }

    /// The same shape with the backward's gradient exponent ([`SeqShape::grad_exponent`]).
    pub fn with_grad_exponent(self, grad_exponent: i32) -> Self {
        SeqShape {
            grad_exponent,
            ..self
        }
    }

    /// Tokens `T = B·S`.
    pub fn tokens(&self) -> usize {
        self.batch * self.seq_len
    }

    /// `G = H / KV`.
    pub fn group(&self) -> usize {
        self.heads / self.kv_heads.max(1)
    }

    /// Elements of `Q` and `O` (`[T, H·hd]`).
    pub fn q_len(&self) -> usize {
        self.tokens() * self.heads * self.head_dim
    }

    /// Elements of `K` and `V` (`[T, KV·hd]`).
    pub fn kv_len(&self) -> usize {
        self.tokens() * self.kv_heads * self.head_dim
    }

    /// Elements of the tensor-core backward's workspace for the scores' gradients,
    /// `dSᵀ [B, H, S', S']` with `S'` the sequence rounded up to [`coop::SCORES_ALIGN`]
    /// ([`SeqGrads::scores`]); `None` where the count overflows.
    pub fn scores_len(&self) -> Option<usize> {
        let side = self
            .seq_len
            .checked_next_multiple_of(coop::SCORES_ALIGN as usize)?;
        (self.batch.checked_mul(self.heads)?)
            .checked_mul(side)?
            .checked_mul(side)
    }

    /// `Ok` when the kernels take this shape; else an error naming `kernel` and the rule.
    pub fn check(&self, kernel: &str) -> Result<(), ExecError> {
        let bad = |what: String, why: &str| {
            Err(ExecError::Dispatch {
                kernel: kernel.into(),
                what,
                why: why.into(),
            })
        };
        let SeqShape {
            heads,
            kv_heads,
            head_dim,
            ..
        } = *self;
        if kv_heads == 0 || heads == 0 || !heads.is_multiple_of(kv_heads) {
            return bad(
                format!("heads = {heads}, kv_heads = {kv_heads}"),
                "heads must be a positive multiple of kv_heads (GQA)",
            );
        }
        if head_dim == 0 || !head_dim.is_multiple_of(4) || head_dim > MAX_HEAD_DIM {
            return bad(
                format!("head_dim = {head_dim}"),
                "head_dim must be a positive multiple of 4, at most 128",
            );
        }
        if self.grad_exponent.abs() > crate::linear::MAX_INPUT_EXPONENT {
            return bad(
                format!("grad_exponent = {}", self.grad_exponent),
                "the gradient's scale is 2^e with |e| ≤ 64",
            );
        }
        if !self.scale.is_finite() {
            return bad(
                format!("scale = {}", self.scale),
                "the scale must be finite",
            );
        }
        // Checked before any length is formed: `q_len` and `kv_len` may not overflow after.
        let product = |dims: &[usize]| dims.iter().try_fold(1usize, |n, d| n.checked_mul(*d));
        let q = product(&[self.batch, self.seq_len, self.heads, self.head_dim]);
        if q.is_none_or(|n| n > u32::MAX as usize) {
            return bad(
                format!(
                    "batch·seq_len·heads·head_dim = {}·{}·{}·{}",
                    self.batch, self.seq_len, self.heads, self.head_dim
                ),
                "the element count must fit the kernels' u32 indices",
            );
        }
        if self.batch > 65535 || self.heads > 65535 {
            return bad(
                format!("batch = {}, heads = {}", self.batch, self.heads),
                "at most 65535 sequences and 65535 heads (one workgroup row each)",
            );
        }
        Ok(())
    }
}

/// The real lengths of a batch's sequences (right padding), on the GPU and on the host: checked
/// once against the sequence length when made, then bound by every kernel that takes them.
pub struct ValidLengths {
    lengths: Vec<usize>,
    seq_len: usize,
    buffer: GpuBuffer<u32>,
}

impl ValidLengths {
    /// `lengths[b]` real positions of sequence `b`, each at most `seq_len`.
    pub fn upload(gpu: &Gpu, lengths: &[usize], seq_len: usize) -> Result<Self, ExecError> {
        let words = ValidLengths::words(lengths, seq_len)?;
        Ok(ValidLengths {
            lengths: lengths.to_vec(),
            seq_len,
            buffer: gpu.upload(&words)?,
        })
    }

    /// Replace the lengths with those of another batch of the same shape (a training step
    /// reuses its buffers): checked as [`ValidLengths::upload`] checks them, nothing written on
    /// an error.
    pub fn write(&mut self, gpu: &Gpu, lengths: &[usize]) -> Result<(), ExecError> {
        if lengths.len() != self.lengths.len() {
            return Err(ExecError::Binding {
                kernel: "attention valid lengths".into(),
                binding: "lens".into(),
                expected: format!("{} lengths (the batch it was made for)", self.lengths.len()),
                given: format!("{} lengths", lengths.len()),
            });
        }
        let checked = ValidLengths::words(lengths, self.seq_len)?;
        self.buffer.write(gpu, &checked)?;
        self.lengths = lengths.to_vec();
        Ok(())
    }

    /// The lengths as the kernels read them, each checked to be at most `seq_len`.
    fn words(lengths: &[usize], seq_len: usize) -> Result<Vec<u32>, ExecError> {
        let name = "attention valid lengths";
        if let Some((b, &len)) = lengths.iter().enumerate().find(|(_, l)| **l > seq_len) {
            return Err(ExecError::Dispatch {
                kernel: name.into(),
                what: format!("lengths[{b}] = {len}"),
                why: format!("a valid length is at most the sequence length {seq_len}"),
            });
        }
        lengths
            .iter()
            .map(|&l| expect_u32(name, "length", l))
            .collect()
    }

    /// The lengths, one a sequence.
    pub fn lengths(&self) -> &[usize] {
        &self.lengths
    }

    fn check(&self, kernel: &str, shape: &SeqShape) -> Result<(), ExecError> {
        if self.lengths.len() == shape.batch && self.seq_len == shape.seq_len {
            return Ok(());
        }
        Err(ExecError::Binding {
            kernel: kernel.into(),
            binding: "lens".into(),
            expected: format!(
                "{} lengths of sequences of {} (the shape)",
                shape.batch, shape.seq_len
            ),
            given: format!(
                "{} lengths of sequences of {}",
                self.lengths.len(),
                self.seq_len
            ),
        })
    }
}

/// The blocking of the sequence kernels: `block` rows (and keys) per workgroup, `bk` of the
/// head dimension per step of the score tile, `vk` rows per step of the accumulator products.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SeqTile {
    pub block: u32,
    pub bk: u32,
    pub vk: u32,
}

impl SeqTile {
    /// 64 rows and keys, 256 invocations, products 32 rows a step: 48 KiB of workgroup memory
    /// at hd 128 (the H200's limit), 32 KiB at hd 64. The fastest of the blockings tried on
    /// the H200 (BENCHMARKS.md).
    pub const LARGE: SeqTile = SeqTile {
        block: 64,
        bk: 16,
        vk: 32,
    };
    /// As `LARGE`, products 16 rows a step: 32 KiB at hd 128 (lavapipe's limit).
    pub const MEDIUM: SeqTile = SeqTile {
        block: 64,
        bk: 16,
        vk: 16,
    };
    /// 32 rows and keys, 64 invocations, 12 KiB of workgroup memory at hd 128: within
    /// WebGPU's 16 KiB.
    pub const PORTABLE: SeqTile = SeqTile {
        block: 32,
        bk: 16,
        vk: 8,
    };

    /// The first of `LARGE`, `MEDIUM`, `PORTABLE` that a device with `limits` runs at this
    /// head dimension.
    pub fn for_device(limits: &Limits, head_dim: usize) -> SeqTile {
        let fits = |t: &SeqTile| {
            t.workgroup_bytes(head_dim as u32) <= limits.max_workgroup_storage_bytes
                && t.invocations() <= limits.max_invocations_per_workgroup
        };
        [SeqTile::LARGE, SeqTile::MEDIUM]
            .into_iter()
            .find(fits)
            .unwrap_or(SeqTile::PORTABLE)
    }

    pub fn invocations(&self) -> u32 {
        (self.block / 4) * (self.block / 4)
    }

    /// Depth of one score step: the largest of `bk`, 16, 8 and 4 (at most `bk`) dividing `hd`.
    fn depth_step(&self, head_dim: u32) -> u32 {
        [self.bk, 16, 8, 4]
            .into_iter()
            .find(|s| *s <= self.bk && head_dim.is_multiple_of(*s))
            .unwrap_or(4)
    }

    /// Workgroup memory: the staging area (two halves, each a score step's two slices or a
    /// product step's rows) and the block's probabilities (which the forward's row reductions
    /// share).
    pub fn workgroup_bytes(&self, head_dim: u32) -> u32 {
        let b = self.block;
        let half = (2 * self.depth_step(head_dim) * b).max(self.vk * head_dim);
        4 * (2 * half + b * b)
    }
}

/// What the three kernels' keys share.
fn seq_key(name: &str, shape: &SeqShape, tile: SeqTile, padded: bool) -> KernelKey {
    KernelKey::new(name)
        .workgroup_size(tile.invocations())
        .shape("head_dim", shape.head_dim as u32)
        .shape("heads", shape.heads as u32)
        .shape("kv_heads", shape.kv_heads as u32)
        .shape("block", tile.block)
        .shape("bk", tile.depth_step(shape.head_dim as u32))
        .shape("vk", tile.vk)
        .shape("padded", padded)
        // Every index is clamped into its sequence (reads) or guarded (stores) by construction.
        .assume_in_bounds()
}

/// The shapes every sequence kernel reads from its key.
struct Dims {
    hd: u32,
    heads: u32,
    kv_heads: u32,
    group: u32,
    block: u32,
    bk: u32,
    vk: u32,
    /// Invocations along a row group (`block / 4`), and `vec4`s of the head dimension each
    /// invocation holds of an accumulator row.
    tx_n: u32,
    cols: u32,
}

/// The launch-wide values and the invocation's place, bound once at the top of a kernel.
struct Place {
    dims: Dims,
    seq_len: Expr<u32>,
    /// `S` − 1: reads clamp to it.
    last: Expr<u32>,
    /// `len_b` (or `S` without valid lengths).
    len: Expr<u32>,
    /// The block's first row (query or key) inside the sequence, and the sequence's first token.
    origin: Expr<u32>,
    token0: Expr<u32>,
    /// The head (query head, or KV head for dK/dV) of the workgroup.
    head: Expr<u32>,
    tx: Expr<u32>,
    ty: Expr<u32>,
}

fn dims(k: &mut KernelBuilder) -> Dims {
    let hd: u32 = k.shape("head_dim");
    let heads: u32 = k.shape("heads");
    let kv_heads: u32 = k.shape("kv_heads");
    let block: u32 = k.shape("block");
    let tx_n = block / 4;
    Dims {
        hd,
        heads,
        kv_heads,
        group: heads / kv_heads,
        block,
        bk: k.shape("bk"),
        vk: k.shape("vk"),
        tx_n,
        cols: (hd / 4).div_ceil(tx_n),
    }
}

/// Where a sequence kernel's workgroup `(block, head, sequence)` is, with the runtime values
/// bound (`seq_len`, and `lens` when the key says `padded`): the sequence's length and first
/// token, the head, and the first of the block's `block` rows (query rows when `queries`, else
/// keys). Shared with the tensor-core kernels ([`super::coop`]).
pub(crate) struct SeqPlace {
    pub seq_len: Expr<u32>,
    /// `S` − 1: reads clamp to it.
    pub last: Expr<u32>,
    /// `len_b` (or `S` without valid lengths).
    pub len: Expr<u32>,
    pub origin: Expr<u32>,
    /// The sequence (`b`) and its first token (`b·S`).
    pub seq: Expr<u32>,
    pub token0: Expr<u32>,
    pub head: Expr<u32>,
}

pub(crate) fn seq_place(k: &mut KernelBuilder, queries: bool, block: u32) -> SeqPlace {
    let padded = k.shape::<bool>("padded");
    let seq_len = k.param::<u32>("seq_len");
    let wid = k.workgroup_id();
    let b = k.let_("b", wid.z());
    let len = if padded {
        let lens = k.storage::<u32>("lens");
        k.let_("len", lens.at(&b).min(&seq_len))
    } else {
        seq_len.clone()
    };
    let last = k.let_("last", &seq_len - 1u32);
    // Workgroups start roughly in the order of their ids: the blocks with the most work (the
    // last query blocks, which see the most keys; the first key blocks, which the most query
    // rows see) go first, so that the short ones fill the tail.
    let block_index = if queries {
        k.num_workgroups().x() - 1u32 - wid.x()
    } else {
        wid.x()
    };
    let origin = k.let_("origin", block_index * block);
    let token0 = k.let_("token0", &b * &seq_len);
    let head = k.let_("head", wid.y());
    SeqPlace {
        seq_len,
        last,
        len,
        origin,
        seq: b,
        token0,
        head,
    }
}

/// Binds the runtime values and the invocation's place: workgroup `(block, head, sequence)`,
/// the block one of query rows (`queries`) or of keys.
fn place(k: &mut KernelBuilder, queries: bool) -> Place {
    let dims = dims(k);
    let SeqPlace {
        seq_len,
        last,
        len,
        origin,
        token0,
        head,
        ..
    } = seq_place(k, queries, dims.block);
    let lid = k.let_("lid", k.local_index());
    let tx = k.let_("tx", &lid % dims.tx_n);
    let ty = k.let_("ty", &lid / dims.tx_n);
    Place {
        dims,
        seq_len,
        last,
        len,
        origin,
        token0,
        head,
        tx,
        ty,
    }
}

/// One operand of a product read from a `[T, heads·hd]` buffer: rows of a block of one head.
struct Rows<'a> {
    buf: &'a ReadBuffer<f32>,
    /// Elements per token (`heads·hd`) and the head's first column.
    stride: u32,
    head_col: Expr<u32>,
}

impl Rows<'_> {
    /// Flat index of `(row inside the sequence, clamped to S − 1; column 0 of the head)`.
    fn base(&self, k: &mut KernelBuilder, p: &Place, row: Expr<u32>) -> Expr<u32> {
        k.let_(
            "row_at",
            (&p.token0 + row.min(&p.last)) * self.stride + &self.head_col,
        )
    }
}

/// One `vec4` of a step's staged operands that this invocation carries: read from memory for a
/// step (`read`), held in `next` until the workgroup is done with the other half of the
/// staging area, then stored at `at` of it. `active` guards a slot past the operands' end.
struct Slot {
    at: Expr<u32>,
    active: Option<Expr<bool>>,
    read: StepRead,
    next: Var<Vec4<f32>>,
}

/// A slot's read for a step (the step's index).
type StepRead = Box<dyn Fn(&mut KernelBuilder, &Expr<u32>) -> Expr<Vec4<f32>>>;

/// The invocation's share of `slots` staging slots: `(slot index, guard)` pairs.
fn shares(k: &mut KernelBuilder, slots: u32) -> Vec<(Expr<u32>, Option<Expr<bool>>)> {
    let n = k.invocations();
    let lid = k.local_index();
    (0..slots.div_ceil(n))
        .map(|i| {
            let s = k.let_("s", offset(&lid, i * n));
            let guard = (!slots.is_multiple_of(n) && (i + 1) * n > slots).then(|| s.lt(slots));
            (s, guard)
        })
        .collect()
}

/// Slots staging, depth-major, `bk` columns (from `step·bk`) of `block` rows of `rows` from
/// `first`: `half[at + kk·block/4 + j] = (rows 4j .. 4j+4 at column step·bk + kk)`.
fn depth_major_slots(
    k: &mut KernelBuilder,
    p: &Place,
    at: u32,
    (rows, first): (&Rows<'_>, &Expr<u32>),
) -> Vec<Slot> {
    let Dims { block, bk, .. } = p.dims;
    shares(k, block / 4 * bk)
        .into_iter()
        .map(|(s, active)| {
            let kk = k.let_("kk", &s % bk);
            let j = k.let_("j", &s / bk);
            let bases: Vec<Expr<u32>> = (0..4u32)
                .map(|q| {
                    let base = rows.base(k, p, first + &j * 4u32 + q);
                    k.let_("col0", base + &kk)
                })
                .collect();
            let buf = rows.buf.clone();
            let read = Box::new(move |_: &mut KernelBuilder, step: &Expr<u32>| {
                let d0 = step * bk;
                let l: Vec<Expr<f32>> = bases.iter().map(|b| buf.at(b + &d0)).collect();
                vec4(l[0].clone(), l[1].clone(), l[2].clone(), l[3].clone())
            });
            Slot {
                at: &kk * (block / 4) + &j + at,
                active,
                read,
                next: k.var("next", Expr::<Vec4<f32>>::splat(0.0f32)),
            }
        })
        .collect()
}

/// Slots staging `vk` whole rows of `rows` (from `first + step·vk`) as `vec4`s along the head
/// dimension: `half[c·hd/4 + v] = row c's vec4 v`, zero for rows at or past `valid`.
fn row_slots(
    k: &mut KernelBuilder,
    p: &Place,
    (rows, first): (&Rows<'_>, &Expr<u32>),
    valid: &Expr<u32>,
) -> Vec<Slot> {
    let Dims { hd, vk, .. } = p.dims;
    let per_row = hd / 4;
    shares(k, vk * per_row)
        .into_iter()
        .map(|(s, active)| {
            let c = k.let_("c", &s / per_row);
            let v = k.let_("v", &s % per_row);
            let row0 = k.let_("row0", first + &c);
            let col = k.let_("col", &rows.head_col + &v * 4u32);
            let (buf, stride) = (rows.buf.clone(), rows.stride);
            let (token0, last, valid) = (p.token0.clone(), p.last.clone(), valid.clone());
            let read = Box::new(move |k: &mut KernelBuilder, step: &Expr<u32>| {
                let row = k.let_("row", &row0 + step * vk);
                let at = k.let_("at", (&token0 + row.min(&last)) * stride + &col);
                let l: Vec<Expr<f32>> = (0..4u32).map(|q| buf.at(offset(&at, q))).collect();
                let value = vec4(l[0].clone(), l[1].clone(), l[2].clone(), l[3].clone());
                select(row.lt(&valid), value, Expr::<Vec4<f32>>::splat(0.0f32))
            });
            Slot {
                at: s,
                active,
                read,
                next: k.var("next", Expr::<Vec4<f32>>::splat(0.0f32)),
            }
        })
        .collect()
}

/// `steps` steps over the two halves (`half` vec4s each) of `stage`: the operands of step
/// `i + 1` are read into registers before step `i` computes on its half, and stored into the
/// other half after, so a step costs one barrier and its memory latency hides behind the FMAs.
/// `compute(k, half's first index, step)`. Starts writing `stage` at once (every earlier reader
/// of it must be past a barrier: each `pipelined` ends with one, so `stage` is free after).
fn pipelined(
    k: &mut KernelBuilder,
    stage: &WorkgroupArray<Vec4<f32>>,
    (half, steps): (u32, u32),
    slots: &[Slot],
    mut compute: impl FnMut(&mut KernelBuilder, &Expr<u32>, &Expr<u32>),
) {
    let fetch = |k: &mut KernelBuilder, step: &Expr<u32>| {
        for slot in slots {
            let body = |k: &mut KernelBuilder| {
                let value = (slot.read)(k, step);
                k.assign(&slot.next, value);
            };
            match &slot.active {
                Some(active) => k.if_(active, body),
                None => body(k),
            }
        }
    };
    let store = |k: &mut KernelBuilder, base: &Expr<u32>| {
        for slot in slots {
            let body = |k: &mut KernelBuilder| k.store(stage, base + &slot.at, slot.next.get());
            match &slot.active {
                Some(active) => k.if_(active, body),
                None => body(k),
            }
        }
    };
    fetch(k, &lit(0u32));
    store(k, &lit(0u32));
    k.workgroup_barrier();
    k.for_range("step", 0u32, steps, |k, step| {
        let cur = k.let_("cur", (&step & 1u32) * half);
        let more = k.let_("more", (&step + 1u32).lt(steps));
        k.if_(&more, |k| fetch(k, &(&step + 1u32)));
        compute(k, &cur, &step);
        k.if_(&more, |k| store(k, &(lit(half) - &cur)));
        k.workgroup_barrier();
    });
}

/// Vec4s in each half of the staging area: a score step's two operand slices, or a product
/// step's rows.
fn stage_half(d: &Dims) -> u32 {
    (2 * d.bk * d.block / 4).max(d.vk * d.hd / 4)
}

/// The score tile `acc[i] (i = row 0..4) = vec4 over keys` of `A_rows·B_rowsᵀ` over the head
/// dimension: the invocation's rows `4·ty ..` of `a` (from `a_first`) against keys `4·tx ..` of
/// `b` (from `b_first`).
fn score_tile(
    k: &mut KernelBuilder,
    p: &Place,
    stage: &WorkgroupArray<Vec4<f32>>,
    a: (&Rows<'_>, &Expr<u32>),
    b: (&Rows<'_>, &Expr<u32>),
) -> LocalArray<Vec4<f32>> {
    let Dims { hd, bk, block, .. } = p.dims;
    let quarter = block / 4;
    let acc: LocalArray<Vec4<f32>> = k.var_array("score", 4);
    for i in 0..4u32 {
        k.store(&acc, i, Expr::<Vec4<f32>>::splat(0.0f32));
    }
    let mut slots = depth_major_slots(k, p, 0, a);
    slots.extend(depth_major_slots(k, p, bk * quarter, b));
    let half = stage_half(&p.dims);
    pipelined(k, stage, (half, hd / bk), &slots, |k, base, _| {
        let a_at = k.let_("a_at", base + &p.ty);
        let b_at = k.let_("b_at", base + &p.tx + bk * quarter);
        for kk in 0..bk {
            let av = k.let_("a", stage.at(offset(&a_at, kk * quarter)));
            let bv = k.let_("b", stage.at(offset(&b_at, kk * quarter)));
            for i in 0..4u32 {
                let ai = Expr::<Vec4<f32>>::splat(lane(&av, i));
                k.store(&acc, i, ai.fma(&bv, acc.at(i)));
            }
        }
    });
    acc
}

/// `acc[i·cols + j] += Σ_c lhs[c][rows 4·ty + i]·rows[c][vec4 tx + j·block/4]` over the
/// `block` rows of `lhs` (`[block][block/4]` vec4s, depth-major), staging `vk` rows of `rhs`
/// (from `first`, zero at or past `valid`) at a time.
fn accumulate_product(
    k: &mut KernelBuilder,
    p: &Place,
    (stage, lhs): (&WorkgroupArray<Vec4<f32>>, &WorkgroupArray<Vec4<f32>>),
    acc: &LocalArray<Vec4<f32>>,
    (rhs, first): (&Rows<'_>, &Expr<u32>),
    valid: &Expr<u32>,
) {
    let Dims {
        hd,
        vk,
        block,
        tx_n,
        cols,
        ..
    } = p.dims;
    let per_row = hd / 4;
    // Columns past the head dimension (when hd/4 is not a multiple of block/4) read the last
    // one; they are never stored.
    let col_at: Vec<Expr<u32>> = (0..cols)
        .map(|j| {
            let c = offset(&p.tx, j * tx_n);
            if per_row.is_multiple_of(tx_n) {
                c
            } else {
                k.let_("v_col", c.min(per_row - 1))
            }
        })
        .collect();
    let slots = row_slots(k, p, (rhs, first), valid);
    let half = stage_half(&p.dims);
    pipelined(k, stage, (half, block / vk), &slots, |k, base, step| {
        let l_at = k.let_("l_at", step * (vk * block / 4) + &p.ty);
        let r_at: Vec<Expr<u32>> = col_at.iter().map(|c| k.let_("r_at", base + c)).collect();
        for c in 0..vk {
            let lv = k.let_("l", lhs.at(offset(&l_at, c * block / 4)));
            let rv: Vec<Expr<Vec4<f32>>> = r_at
                .iter()
                .map(|at| k.let_("r", stage.at(offset(at, c * per_row))))
                .collect();
            for i in 0..4u32 {
                let li = Expr::<Vec4<f32>>::splat(lane(&lv, i));
                for (j, r) in rv.iter().enumerate() {
                    let at = i * cols + j as u32;
                    k.store(acc, at, li.fma(r, acc.at(at)));
                }
            }
        }
    });
}

/// A `[block, hd]` accumulator in registers, zeroed.
fn accumulator(k: &mut KernelBuilder, p: &Place, hint: &str) -> LocalArray<Vec4<f32>> {
    let acc: LocalArray<Vec4<f32>> = k.var_array(hint, 4 * p.dims.cols);
    for i in 0..4 * p.dims.cols {
        k.store(&acc, i, Expr::<Vec4<f32>>::splat(0.0f32));
    }
    acc
}

/// `out[token0 + origin + 4·ty + i, head's columns] = scales[i]·acc[i]` for rows inside the
/// sequence.
fn store_rows(
    k: &mut KernelBuilder,
    p: &Place,
    out: &hesper_dsl::RwBuffer<Vec4<f32>>,
    (stride4, head_col4): (u32, &Expr<u32>),
    acc: &LocalArray<Vec4<f32>>,
    scales: [Expr<f32>; 4],
) {
    let Dims { hd, tx_n, cols, .. } = p.dims;
    let per_row = hd / 4;
    for (i, scale) in (0..4u32).zip(scales) {
        let row = k.let_("row", &p.origin + &p.ty * 4u32 + i);
        k.if_(row.lt(&p.seq_len), |k| {
            let scale = k.let_("row_scale", scale);
            let base = k.let_("out_at", (&p.token0 + &row) * stride4 + head_col4);
            for j in 0..cols {
                let col = offset(&p.tx, j * tx_n);
                let value = acc.at(i * cols + j) * Expr::<Vec4<f32>>::splat(scale.clone());
                if per_row.is_multiple_of(tx_n) || (j + 1) * tx_n <= per_row {
                    k.store(out, &base + &col, value);
                } else {
                    k.if_(col.lt(per_row), |k| k.store(out, &base + &col, value));
                }
            }
        });
    }
}

/// The invocation's 4×4 of `P = exp(τ·S − m)` for query rows from `q0` and keys from `c0`,
/// zero where the key is excluded (after the row, at or past `len`) or the row is padded.
struct Masked {
    /// `valid[i][j]`
    valid: Vec<Vec<Expr<bool>>>,
}

fn mask(k: &mut KernelBuilder, p: &Place, q0: &Expr<u32>, c0: &Expr<u32>) -> Masked {
    let rows: Vec<Expr<u32>> = (0..4u32)
        .map(|i| k.let_("q_row", q0 + &p.ty * 4u32 + i))
        .collect();
    let keys: Vec<Expr<u32>> = (0..4u32)
        .map(|j| k.let_("key", c0 + &p.tx * 4u32 + j))
        .collect();
    let valid = rows
        .iter()
        .map(|r| {
            let row_ok = k.let_("row_ok", r.lt(&p.len));
            keys.iter()
                .map(|c| k.let_("valid", c.le(r).and(&row_ok)))
                .collect()
        })
        .collect();
    Masked { valid }
}

/// Binding names and their `Rows`.
fn rows_of<'a>(buf: &'a ReadBuffer<f32>, hd: u32, heads: u32, head: &Expr<u32>) -> Rows<'a> {
    Rows {
        buf,
        stride: heads * hd,
        head_col: head * hd,
    }
}

/// The invocation's four rows' `values` combined (`op`) across the `block/4` invocations that
/// share those rows, through the first `block²/16` vec4s of `scratch`: a `vec4` of the four
/// rows' results. The caller's earlier readers of `scratch` must be past a barrier; the caller
/// must pass another before writing it again.
fn row_reduce(
    k: &mut KernelBuilder,
    p: &Place,
    scratch: &WorkgroupArray<Vec4<f32>>,
    values: Vec<Expr<f32>>,
    op: Reduce,
) -> Expr<Vec4<f32>> {
    let tx_n = p.dims.tx_n;
    let mine = vec4(
        values[0].clone(),
        values[1].clone(),
        values[2].clone(),
        values[3].clone(),
    );
    k.store(scratch, &p.ty * tx_n + &p.tx, mine);
    k.workgroup_barrier();
    let base = k.let_("partials_at", &p.ty * tx_n);
    let mut acc = scratch.at(&base);
    for t in 1..tx_n {
        let next = scratch.at(offset(&base, t));
        acc = match op {
            Reduce::Max => acc.max(next),
            Reduce::Min => acc.min(next),
            Reduce::Sum => acc + next,
        };
    }
    k.let_("row_result", acc)
}

/// The forward: `O` and `lse` of one block of query rows of one head.
fn forward_body(k: &mut KernelBuilder) {
    let q = k.storage::<f32>("q");
    let kb = k.storage::<f32>("k");
    let v = k.storage::<f32>("v");
    let o = k.storage_rw::<Vec4<f32>>("o");
    let lse = k.storage_rw::<f32>("lse");
    let tau = k.param::<f32>("scale");
    let p = place(k, true);
    let Dims {
        hd,
        heads,
        kv_heads,
        group,
        block,
        ..
    } = p.dims;
    let stage = k.workgroup_array::<Vec4<f32>>("stage", 2 * stage_half(&p.dims));
    // The block's probabilities; before them, each invocation's row partials (a `vec4` of its
    // four rows at `ty·block/4 + tx`).
    let probs = k.workgroup_array::<Vec4<f32>>("probs", block * block / 4);

    let kv = k.let_("kv", &p.head / group);
    let q_rows = rows_of(&q, hd, heads, &p.head);
    let k_rows = rows_of(&kb, hd, kv_heads, &kv);
    let v_rows = rows_of(&v, hd, kv_heads, &kv);
    let m: Vec<Var<f32>> = (0..4).map(|_| k.var("m", lit(NEG_BIG))).collect();
    let l: Vec<Var<f32>> = (0..4).map(|_| k.var("l", lit(0.0f32))).collect();
    let acc = accumulator(k, &p, "o_acc");

    k.comment("Key blocks up to the block's last real row (none for a block of padding).");
    let end = k.let_("end", (&p.origin + block).min(&p.len));
    let blocks = k.let_(
        "blocks",
        select(p.origin.lt(&p.len), (&end + (block - 1)) / block, lit(0u32)),
    );
    k.for_range("key_block", 0u32, &blocks, |k, key_block| {
        let c0 = k.let_("c0", &key_block * block);
        let s = score_tile(k, &p, &stage, (&q_rows, &p.origin), (&k_rows, &c0));
        let masked = mask(k, &p, &p.origin, &c0);
        let scores: Vec<Vec<Expr<f32>>> = (0..4u32)
            .map(|i| {
                let row = k.let_("s_row", s.at(i) * Expr::<Vec4<f32>>::splat(tau.clone()));
                (0..4).map(|j| lane(&row, j)).collect()
            })
            .collect();
        k.comment("Row maxima over the block: each invocation's, then across the row's.");
        let partial: Vec<Expr<f32>> = scores
            .iter()
            .zip(&masked.valid)
            .map(|(row, valid)| {
                row.iter()
                    .zip(valid)
                    .fold(lit(NEG_BIG), |m: Expr<f32>, (s, ok)| {
                        m.max(select(ok.clone(), s.clone(), lit(NEG_BIG)))
                    })
            })
            .collect();
        let maxima = row_reduce(k, &p, &probs, partial, Reduce::Max);
        let mut alphas = Vec::new();
        let mut probs_of = Vec::new();
        for i in 0..4u32 {
            let m_new = k.let_("m_new", m[i as usize].get().max(lane(&maxima, i)));
            let alpha = k.let_("alpha", (m[i as usize].get() - &m_new).exp());
            let ps: Vec<Expr<f32>> = (0..4)
                .map(|j| {
                    let e = (scores[i as usize][j].clone() - &m_new).exp();
                    k.let_(
                        "p",
                        select(masked.valid[i as usize][j].clone(), e, lit(0.0f32)),
                    )
                })
                .collect();
            let sum = ps[0].clone() + ps[1].clone() + ps[2].clone() + ps[3].clone();
            k.assign(&l[i as usize], l[i as usize].get() * &alpha + sum);
            k.assign(&m[i as usize], m_new);
            alphas.push(alpha);
            probs_of.push(ps);
        }
        for i in 0..4u32 {
            for j in 0..p.dims.cols {
                let at = i * p.dims.cols + j;
                let a = Expr::<Vec4<f32>>::splat(alphas[i as usize].clone());
                k.store(&acc, at, acc.at(at) * a);
            }
        }
        k.comment(
            "The block's probabilities, depth (key) major, for P·V, once the partials are read.",
        );
        k.workgroup_barrier();
        for j in 0..4u32 {
            let col: Vec<Expr<f32>> = (0..4).map(|i| probs_of[i][j as usize].clone()).collect();
            let at = (&p.tx * 4u32 + j) * (block / 4) + &p.ty;
            k.store(
                &probs,
                at,
                vec4(
                    col[0].clone(),
                    col[1].clone(),
                    col[2].clone(),
                    col[3].clone(),
                ),
            );
        }
        accumulate_product(k, &p, (&stage, &probs), &acc, (&v_rows, &c0), &p.len);
    });

    k.comment("Row sums across the row's invocations.");
    let sums = row_reduce(
        k,
        &p,
        &probs,
        l.iter().map(|l| l.get()).collect(),
        Reduce::Sum,
    );
    let totals: Vec<Expr<f32>> = (0..4).map(|i| k.let_("row_sum", lane(&sums, i))).collect();
    // A padded row (or one with no key at all) has a sum of 0: it writes zeros.
    let real: Vec<Expr<bool>> = (0..4u32)
        .map(|i| {
            let row = &p.origin + &p.ty * 4u32 + i;
            k.let_("real", row.lt(&p.len).and(totals[i as usize].gt(0.0f32)))
        })
        .collect();
    let head_col4 = k.let_("head_col4", &p.head * (hd / 4));
    let scales =
        std::array::from_fn(|i| select(real[i].clone(), 1.0f32 / totals[i].clone(), lit(0.0f32)));
    store_rows(k, &p, &o, (heads * hd / 4, &head_col4), &acc, scales);
    for i in 0..4u32 {
        let row = k.let_("row", &p.origin + &p.ty * 4u32 + i);
        k.if_(row.lt(&p.seq_len).and(p.tx.eq(0u32)), |k| {
            let value = m[i as usize].get() + totals[i as usize].log();
            k.store(
                &lse,
                (&p.token0 + &row) * heads + &p.head,
                select(real[i as usize].clone(), value, lit(0.0f32)),
            );
        });
    }
}

/// Pairs of vec4s of `O` and `dO` the statistics kernel reads before it sums them.
const STATS_BATCH: u32 = 8;

/// Invocations that share a row of the statistics kernel where the device has subgroups of one
/// size, a power of two: the largest power of two that divides the row's vec4s, at most 16 and
/// at most the subgroup, so that a row's lanes lie in one subgroup (1 elsewhere: each
/// invocation walks its row alone). One invocation a row left a 4096-token batch of SmolLM2
/// with 36 864 invocations, each reading 256 scattered bytes of `O` and `dO`; with 16 a row, a
/// subgroup's reads are whole runs of rows.
fn stats_lanes(head_dim: u32, subgroup: Option<u32>) -> u32 {
    let vec4s = head_dim / 4;
    let pow2 = 1 << vec4s.trailing_zeros().min(4);
    match subgroup {
        Some(size) if size.is_power_of_two() => pow2.min(size),
        _ => 1,
    }
}

/// The backward's pre-pass: `stats[t, h] = (lse, D = Σ_d dO·O)`, zeros on padded rows. `lanes`
/// invocations per `(t, h)` ([`stats_lanes`]), each summing every `lanes`-th vec4 of the row
/// (so that neighbours read neighbouring vec4s), their sums added across the lanes by
/// subgroup shuffles.
fn stats_body(k: &mut KernelBuilder) {
    let hd: u32 = k.shape("head_dim");
    let heads: u32 = k.shape("heads");
    let padded = k.shape::<bool>("padded");
    let lanes: u32 = k.shape("lanes");
    let o = k.storage::<Vec4<f32>>("o");
    let d_out = k.storage::<Vec4<f32>>("d_out");
    let lse = k.storage::<f32>("lse");
    let stats = k.storage_rw::<f32>("stats");
    let seq_len = k.param::<u32>("seq_len");
    let rows = k.param::<u32>("rows");
    if !lanes.is_power_of_two() || !(hd / 4).is_multiple_of(lanes) {
        k.error(hesper_dsl::ErrorKind::TypeMismatch {
            item: "shape `lanes`".into(),
            expected: format!("a power of two dividing head_dim / 4 = {}", hd / 4),
            found: lanes.to_string(),
        });
        return;
    }
    // The row and lane: by the subgroup's own numbering where rows are shared, so that a
    // row's lanes are one subgroup's neighbours (`lanes` divides the subgroup).
    let (index, lane) = match lanes {
        1 => {
            let index = k.global_index();
            (k.let_("i", index), lit(0u32))
        }
        _ => {
            let slot = k.subgroup_id() * k.subgroup_size() + k.subgroup_invocation_id();
            // The workgroup's first invocation's global index.
            let first = k.global_index() - k.local_index();
            let slot = k.let_("slot", first + slot);
            (k.let_("i", &slot / lanes), k.let_("lane", &slot % lanes))
        }
    };
    // Past the last row the lanes read the last row and store nothing: the shuffles need the
    // whole subgroup.
    let inside = k.let_("inside", index.lt(&rows));
    let i = k.let_("row", index.min(rows.max(1u32) - 1u32));
    let t = k.let_("t", &i / heads);
    let real = if padded {
        let lens = k.storage::<u32>("lens");
        let b = k.let_("b", &t / &seq_len);
        k.let_("real", (&t % &seq_len).lt(lens.at(&b)))
    } else {
        lit(true)
    };
    let base = k.let_("base", &i * (hd / 4) + &lane);
    // A batch's vec4s are all read before any is summed, so that their reads are in flight
    // together (a loop of read-then-add kept one read in flight at a time).
    let mut dot: Option<Expr<Vec4<f32>>> = None;
    for batch in (0..hd / 4 / lanes)
        .collect::<Vec<u32>>()
        .chunks(STATS_BATCH as usize)
    {
        let reads: Vec<_> = batch
            .iter()
            .map(|&v| {
                let at = offset(&base, v * lanes);
                (k.let_("o", o.at(&at)), k.let_("d_o", d_out.at(&at)))
            })
            .collect();
        for (o4, d4) in reads {
            let sum = match dot.take() {
                Some(acc) => o4.fma(d4, acc),
                None => o4 * d4,
            };
            dot = Some(k.let_("dot", sum));
        }
    }
    let dot = dot.expect("head_dim is at least 4");
    let mut d = k.let_("d", dot.dot(Expr::<Vec4<f32>>::splat(1.0f32)));
    let mut mask = lanes / 2;
    while mask > 0 {
        let other = k.subgroup_shuffle_xor(d.clone(), mask);
        d = k.let_("d", d + other);
        mask /= 2;
    }
    let store = match lanes {
        1 => inside,
        _ => inside.and(lane.eq(0u32)),
    };
    k.if_(store, |k| {
        let real = k.let_("real", real);
        k.store(
            &stats,
            &i * 2u32,
            select(real.clone(), lse.at(&i), lit(0.0f32)),
        );
        k.store(&stats, &i * 2u32 + 1u32, select(real, d, lit(0.0f32)));
    });
}

/// `(lse, D)` of the invocation's four query rows from `q0` (rows clamped into the sequence).
fn row_stats(
    k: &mut KernelBuilder,
    p: &Place,
    stats: &ReadBuffer<f32>,
    q0: &Expr<u32>,
    head: &Expr<u32>,
) -> Vec<(Expr<f32>, Expr<f32>)> {
    let heads = p.dims.heads;
    (0..4u32)
        .map(|i| {
            let row = (q0 + &p.ty * 4u32 + i).min(&p.last);
            let at = k.let_("stat_at", ((&p.token0 + row) * heads + head) * 2u32);
            let lse = k.let_("lse", stats.at(&at));
            (lse, k.let_("delta", stats.at(&at + 1u32)))
        })
        .collect()
}

/// An invocation's 4×4 of a score-shaped tile: `[row i][key j]`.
type Quad = Vec<Vec<Expr<f32>>>;

/// The invocation's `P = exp(τ·S − lse)` and `dS = P ⊙ (dP − D)` for query rows from `q0` of
/// query head `head` and keys from `c0` of its KV head.
#[allow(clippy::too_many_arguments)]
fn probs_and_grads(
    k: &mut KernelBuilder,
    p: &Place,
    stage: &WorkgroupArray<Vec4<f32>>,
    (q_rows, k_rows, v_rows, do_rows): (&Rows<'_>, &Rows<'_>, &Rows<'_>, &Rows<'_>),
    stats: &ReadBuffer<f32>,
    (q0, c0, head): (&Expr<u32>, &Expr<u32>, &Expr<u32>),
    tau: &Expr<f32>,
) -> (Quad, Quad) {
    let s = score_tile(k, p, stage, (q_rows, q0), (k_rows, c0));
    let dp = score_tile(k, p, stage, (do_rows, q0), (v_rows, c0));
    let masked = mask(k, p, q0, c0);
    let st = row_stats(k, p, stats, q0, head);
    let mut probs = Vec::new();
    let mut grads = Vec::new();
    for i in 0..4u32 {
        let (lse, d) = &st[i as usize];
        let srow = k.let_("s_row", s.at(i));
        let dprow = k.let_("dp_row", dp.at(i));
        let mut pr = Vec::new();
        let mut gr = Vec::new();
        for j in 0..4 {
            let e = (lane(&srow, j) * tau - lse).exp();
            let pv = k.let_(
                "p",
                select(masked.valid[i as usize][j as usize].clone(), e, lit(0.0f32)),
            );
            gr.push(k.let_("ds", &pv * (lane(&dprow, j) - d)));
            pr.push(pv);
        }
        probs.push(pr);
        grads.push(gr);
    }
    (probs, grads)
}

/// `tile[r][keys 4·tx ..]` (row-major, `[block][block/4]` vec4s) from the invocation's 4×4 of
/// `values[i][j]` (rows `4·ty + i`, keys `4·tx + j`): the left operand of a product that
/// contracts over query rows.
fn store_by_rows(
    k: &mut KernelBuilder,
    p: &Place,
    tile: &WorkgroupArray<Vec4<f32>>,
    values: &Quad,
) {
    let quarter = p.dims.block / 4;
    for (i, row) in values.iter().enumerate() {
        let at = (&p.ty * 4u32 + i as u32) * quarter + &p.tx;
        k.store(
            tile,
            at,
            vec4(
                row[0].clone(),
                row[1].clone(),
                row[2].clone(),
                row[3].clone(),
            ),
        );
    }
}

/// `tile[c][rows 4·ty ..]` (key-major) from the invocation's 4×4: the left operand of a
/// product that contracts over keys.
fn store_by_keys(
    k: &mut KernelBuilder,
    p: &Place,
    tile: &WorkgroupArray<Vec4<f32>>,
    values: &Quad,
) {
    let quarter = p.dims.block / 4;
    for j in 0..4u32 {
        let at = (&p.tx * 4u32 + j) * quarter + &p.ty;
        let key: Vec<Expr<f32>> = values.iter().map(|row| row[j as usize].clone()).collect();
        k.store(
            tile,
            at,
            vec4(
                key[0].clone(),
                key[1].clone(),
                key[2].clone(),
                key[3].clone(),
            ),
        );
    }
}

/// What both backward kernels read, declared first (the binding order of both).
struct BackwardReads {
    q: ReadBuffer<f32>,
    k: ReadBuffer<f32>,
    v: ReadBuffer<f32>,
    d_out: ReadBuffer<f32>,
    stats: ReadBuffer<f32>,
}

fn backward_reads(k: &mut KernelBuilder) -> BackwardReads {
    BackwardReads {
        q: k.storage("q"),
        k: k.storage("k"),
        v: k.storage("v"),
        d_out: k.storage("d_out"),
        stats: k.storage("stats"),
    }
}

/// The backward kernels' workgroup memory: the staging area and the block's `P` or `dS` tile.
fn backward_memory(
    k: &mut KernelBuilder,
    dims: &Dims,
) -> (WorkgroupArray<Vec4<f32>>, WorkgroupArray<Vec4<f32>>) {
    let stage = k.workgroup_array::<Vec4<f32>>("stage", 2 * stage_half(dims));
    let tile = k.workgroup_array::<Vec4<f32>>("tile", dims.block * dims.block / 4);
    (stage, tile)
}

/// The backward to `K` and `V` of one block of keys of one KV head: over the `G` query heads
/// reading it and the query blocks at or after it, `dV += Pᵀ·dO`, `dK += τ·dSᵀ·Q`.
fn key_grads_body(k: &mut KernelBuilder) {
    let BackwardReads {
        q,
        k: kb,
        v,
        d_out,
        stats,
    } = backward_reads(k);
    let d_k = k.storage_rw::<Vec4<f32>>("d_k");
    let d_v = k.storage_rw::<Vec4<f32>>("d_v");
    let tau = k.param::<f32>("scale");
    let p = place(k, false);
    let Dims {
        hd,
        heads,
        kv_heads,
        group,
        block,
        ..
    } = p.dims;
    let (stage, tile) = backward_memory(k, &p.dims);
    let dk = accumulator(k, &p, "dk_acc");
    let dv = accumulator(k, &p, "dv_acc");
    // The workgroup's head is the KV head; its keys start at `origin`.
    let kv = &p.head;
    let k_rows = rows_of(&kb, hd, kv_heads, kv);
    let v_rows = rows_of(&v, hd, kv_heads, kv);

    k.comment("Query blocks from the one holding the block's first key to the last real row.");
    let first = k.let_("first", &p.origin / block);
    let blocks = k.let_("blocks", (&p.len + (block - 1)) / block);
    k.for_range("g", 0u32, group, |k, g| {
        let h = k.let_("h", kv * group + &g);
        let q_rows = rows_of(&q, hd, heads, &h);
        let do_rows = rows_of(&d_out, hd, heads, &h);
        k.for_range("query_block", &first, &blocks, |k, qb| {
            let q0 = k.let_("q0", &qb * block);
            // Rows are queries, columns keys (this workgroup's).
            let (probs, grads) = probs_and_grads(
                k,
                &p,
                &stage,
                (&q_rows, &k_rows, &v_rows, &do_rows),
                &stats,
                (&q0, &p.origin, &h),
                &tau,
            );
            // Stored query-row major, the tile's `vec4` `ty` of a row is the keys this
            // invocation accumulates: `dV[keys 4·ty ..] += Σ_r P[r, keys]·dO[r]`.
            // The tile's last readers (the previous product) are past its closing barrier.
            store_by_rows(k, &p, &tile, &probs);
            accumulate_product(k, &p, (&stage, &tile), &dv, (&do_rows, &q0), &p.len);
            store_by_rows(k, &p, &tile, &grads);
            accumulate_product(k, &p, (&stage, &tile), &dk, (&q_rows, &q0), &p.len);
        });
    });
    let head_col4 = k.let_("head_col4", kv * (hd / 4));
    let stride4 = kv_heads * hd / 4;
    store_rows(
        k,
        &p,
        &d_v,
        (stride4, &head_col4),
        &dv,
        [(); 4].map(|_| lit(1.0f32)),
    );
    store_rows(
        k,
        &p,
        &d_k,
        (stride4, &head_col4),
        &dk,
        [(); 4].map(|_| tau.clone()),
    );
}

/// The backward to `Q` of one block of query rows of one head: over the key blocks up to the
/// block's last real row, `dQ += τ·dS·K`.
fn query_grads_body(k: &mut KernelBuilder) {
    let BackwardReads {
        q,
        k: kb,
        v,
        d_out,
        stats,
    } = backward_reads(k);
    let d_q = k.storage_rw::<Vec4<f32>>("d_q");
    let tau = k.param::<f32>("scale");
    let p = place(k, true);
    let Dims {
        hd,
        heads,
        kv_heads,
        group,
        block,
        ..
    } = p.dims;
    let (stage, tile) = backward_memory(k, &p.dims);
    let dq = accumulator(k, &p, "dq_acc");
    let kv = k.let_("kv", &p.head / group);
    let q_rows = rows_of(&q, hd, heads, &p.head);
    let do_rows = rows_of(&d_out, hd, heads, &p.head);
    let k_rows = rows_of(&kb, hd, kv_heads, &kv);
    let v_rows = rows_of(&v, hd, kv_heads, &kv);

    let end = k.let_("end", (&p.origin + block).min(&p.len));
    let blocks = k.let_(
        "blocks",
        select(p.origin.lt(&p.len), (&end + (block - 1)) / block, lit(0u32)),
    );
    k.for_range("key_block", 0u32, &blocks, |k, key_block| {
        let c0 = k.let_("c0", &key_block * block);
        let (_, grads) = probs_and_grads(
            k,
            &p,
            &stage,
            (&q_rows, &k_rows, &v_rows, &do_rows),
            &stats,
            (&p.origin, &c0, &p.head),
            &tau,
        );
        store_by_keys(k, &p, &tile, &grads);
        accumulate_product(k, &p, (&stage, &tile), &dq, (&k_rows, &c0), &p.len);
    });
    let head_col4 = k.let_("head_col4", &p.head * (hd / 4));
    store_rows(
        k,
        &p,
        &d_q,
        (heads * hd / 4, &head_col4),
        &dq,
        [(); 4].map(|_| tau.clone()),
    );
}

const FORWARD: &str = "attention_forward";
const STATS: &str = "attention_backward_stats";
const KEY_GRADS: &str = "attention_backward_kv";
const QUERY_GRADS: &str = "attention_backward_q";

/// The WGSL of this module's kernels at a representative shape (SmolLM2's heads: 9 reading 3
/// of 64, padded batches, the large tile).
pub fn kernels() -> Result<Vec<Kernel>, hesper_dsl::DslError> {
    let shape = SeqShape::new(2, 128, 9, 3, 64);
    let tile = SeqTile::LARGE;
    Ok(vec![
        Kernel::build(&seq_key(FORWARD, &shape, tile, true), forward_body)?,
        Kernel::build(&stats_key(&shape, true, 1), stats_body)?,
        Kernel::build(&stats_key(&shape, true, 16), stats_body)?,
        Kernel::build(&seq_key(KEY_GRADS, &shape, tile, true), key_grads_body)?,
        Kernel::build(&seq_key(QUERY_GRADS, &shape, tile, true), query_grads_body)?,
    ])
}

/// The statistics kernel's key; `lanes` invocations a row ([`stats_lanes`]; subgroups where
/// more than 1).
fn stats_key(shape: &SeqShape, padded: bool, lanes: u32) -> KernelKey {
    let key = KernelKey::new(STATS)
        .workgroup_size(256)
        .shape("head_dim", shape.head_dim as u32)
        .shape("heads", shape.heads as u32)
        .shape("padded", padded)
        .shape("lanes", lanes)
        .assume_in_bounds();
    match lanes {
        1 => key,
        _ => key.features(Features::SUBGROUPS),
    }
}

/// Each kernel of this module at any shape and tile, within `limits`, for [`crate::catalog`].
pub(crate) mod build {
    use super::*;
    use crate::catalog::Failure;

    /// Which of the three blocked kernels.
    #[derive(Clone, Copy)]
    pub(crate) enum Blocked {
        Forward,
        KeyGrads,
        QueryGrads,
    }

    /// A shape of one sequence (the kernels' keys hold no batch or length), checked as the
    /// executor checks it.
    fn shape(
        name: &str,
        (head_dim, heads, kv_heads): (u32, u32, u32),
    ) -> Result<SeqShape, Failure> {
        let shape = SeqShape::new(1, 1, heads as usize, kv_heads as usize, head_dim as usize);
        shape.check(name)?;
        Ok(shape)
    }

    /// `Ok` for a tile the kernels' loops cover: `block` rows of `block / 4` invocations' four,
    /// `block / vk` product steps of `vk` rows. (The executor runs only `LARGE`, `MEDIUM` and
    /// `PORTABLE`, which the tests run on a GPU.)
    fn check_tile(tile: SeqTile) -> Result<(), Failure> {
        let SeqTile { block, bk, vk } = tile;
        if block == 0 || !block.is_multiple_of(4) || bk == 0 || vk == 0 || !block.is_multiple_of(vk)
        {
            return Err(Failure::rule(
                format!("tile {tile:?}"),
                "block must be a positive multiple of 4, bk positive, and vk positive and \
                 dividing block"
                    .into(),
            ));
        }
        Ok(())
    }

    /// `attention_forward`, `attention_backward_kv` or `attention_backward_q`.
    pub(crate) fn blocked(
        which: Blocked,
        dims: (u32, u32, u32),
        tile: SeqTile,
        padded: bool,
        limits: &Limits,
    ) -> Result<Kernel, Failure> {
        let (name, body): (_, fn(&mut KernelBuilder)) = match which {
            Blocked::Forward => (FORWARD, forward_body),
            Blocked::KeyGrads => (KEY_GRADS, key_grads_body),
            Blocked::QueryGrads => (QUERY_GRADS, query_grads_body),
        };
        let shape = shape(name, dims)?;
        check_tile(tile)?;
        let key = seq_key(name, &shape, tile, padded);
        Ok(Kernel::build_with_limits(&key, limits, body)?)
    }

    pub(crate) fn stats(
        (head_dim, heads): (u32, u32),
        padded: bool,
        lanes: u32,
        limits: &Limits,
    ) -> Result<Kernel, Failure> {
        let shape = shape(STATS, (head_dim, heads, 1))?;
        Ok(Kernel::build_with_limits(
            &stats_key(&shape, padded, lanes),
            limits,
            stats_body,
        )?)
    }
}

/// The inputs of the forward: `Q [T, H·hd]`, `K`, `V [T, KV·hd]` (rotated, as RoPE leaves
/// them), and the valid lengths when the batch is padded.
#[derive(Clone, Copy)]
pub struct SeqInputs<'a> {
    pub q: &'a GpuBuffer<f32>,
    pub k: &'a GpuBuffer<f32>,
    pub v: &'a GpuBuffer<f32>,
    pub lens: Option<&'a ValidLengths>,
}

impl SeqInputs<'_> {
    fn check(&self, kernel: &str, shape: &SeqShape) -> Result<(), ExecError> {
        shape.check(kernel)?;
        expect_len(
            kernel,
            "q",
            self.q,
            shape.q_len(),
            "[batch·seq_len, heads·head_dim]",
        )?;
        let kv = "[batch·seq_len, kv_heads·head_dim]";
        expect_len(kernel, "k", self.k, shape.kv_len(), kv)?;
        expect_len(kernel, "v", self.v, shape.kv_len(), kv)?;
        match self.lens {
            Some(lens) => lens.check(kernel, shape),
            None => Ok(()),
        }
    }

    /// `q`, `k`, `v` (as vec4s for the tensor-core kernels), the lengths and the runtime values.
    fn bind<'b>(
        &'b self,
        args: Args<'b>,
        shape: &SeqShape,
        vec4: bool,
    ) -> Result<Args<'b>, ExecError> {
        let args = [("q", self.q), ("k", self.k), ("v", self.v)]
            .into_iter()
            .fold(args, |args, (name, b)| match vec4 {
                true => args.buffer_vec4(name, b),
                false => args.buffer(name, b),
            })
            .param("seq_len", expect_u32(FORWARD, "seq_len", shape.seq_len)?)
            .param("scale", shape.scale);
        Ok(match self.lens {
            Some(lens) => args.buffer("lens", &lens.buffer),
            None => args,
        })
    }
}

/// `Ok` when one invocation's loop iterations, all loops counted together, fit the device
/// ([`Gpu::max_loop_iterations`]): lavapipe stops at 65 535, and the dK/dV kernel runs
/// `G · S/block · (1 + 2·hd/bk + 2·block/vk)` of them (S ≈ 20 000 at G = 8, hd 128 there).
fn check_loops(
    kernel: &str,
    shape: &SeqShape,
    tile: SeqTile,
    gpu: &Gpu,
    backward: bool,
) -> Result<(), ExecError> {
    let Some(max) = gpu.max_loop_iterations() else {
        return Ok(());
    };
    let blocks = shape.seq_len.div_ceil(tile.block as usize) as u64;
    let score = (shape.head_dim as u64).div_ceil(tile.depth_step(shape.head_dim as u32) as u64);
    let product = (tile.block / tile.vk) as u64;
    let iterations = if backward {
        (shape.group() as u64 * blocks * (1 + 2 * score + 2 * product))
            .max(blocks * (1 + 2 * score + product))
    } else {
        blocks * (1 + score + product)
    };
    if iterations <= max {
        return Ok(());
    }
    Err(ExecError::Dispatch {
        kernel: kernel.into(),
        what: format!(
            "seq_len = {}, {} query heads per KV head, head_dim = {}",
            shape.seq_len,
            shape.group(),
            shape.head_dim
        ),
        why: format!(
            "an invocation would loop {iterations} times, and {} stops loops after {max} iterations",
            gpu.describe()
        ),
    })
}

/// The tensor-core kernel `which` runs at `shape` on `gpu` with this tile and subgroup size:
/// at `Precision::F16`, on a device with 16×16 f16 cooperative matrices, `head_dim` a multiple
/// of 16, and a standard tile within the device's workgroup memory. `None`: the f32 kernels.
fn coop_tile(gpu: &Gpu, shape: &SeqShape, which: Which) -> Option<(CoopSeqTile, u32)> {
    if shape.precision != Precision::F16 || !shape.head_dim.is_multiple_of(16) {
        return None;
    }
    let subgroup = crate::linear::coop::subgroup_size(gpu)?;
    if !(16..=128).contains(&subgroup) || !subgroup.is_power_of_two() {
        return None;
    }
    let limits = gpu.kernel_limits();
    let tile = CoopSeqTile::for_device(&limits, which, shape.head_dim as u32, subgroup)?;
    Some((tile, subgroup))
}

fn coop_grid(shape: &SeqShape, tile: CoopSeqTile, heads: usize) -> Grid {
    let blocks = shape.seq_len.div_ceil(tile.block() as usize);
    Grid::Workgroups([blocks as u32, heads as u32, shape.batch as u32])
}

/// The workgroups of a sequence kernel: one per block of rows (or keys), head and sequence.
fn grid(shape: &SeqShape, tile: SeqTile, heads: usize) -> Grid {
    let blocks = shape.seq_len.div_ceil(tile.block as usize);
    Grid::Workgroups([blocks as u32, heads as u32, shape.batch as u32])
}

/// Causal attention within each sequence: `O [T, H·hd]` (overwritten, zeros on padded rows)
/// and the rows' log-sum-exp `lse [T, H]` (natural log of `Σ exp(τ·q·k)`, 0 on padded rows),
/// which [`execute_attention_backward`] takes.
pub fn execute_attention_forward(
    rec: &mut Recorder<'_>,
    shape: SeqShape,
    inputs: SeqInputs<'_>,
    o: &mut GpuBuffer<f32>,
    lse: &mut GpuBuffer<f32>,
) -> Result<(), ExecError> {
    shape.check(FORWARD)?;
    let tile = SeqTile::for_device(&rec.gpu().kernel_limits(), shape.head_dim);
    check_loops(FORWARD, &shape, tile, rec.gpu(), false)?;
    inputs.check(FORWARD, &shape)?;
    expect_len(
        FORWARD,
        "o",
        o,
        shape.q_len(),
        "[batch·seq_len, heads·head_dim]",
    )?;
    expect_len(
        FORWARD,
        "lse",
        lse,
        shape.tokens() * shape.heads,
        "[batch·seq_len, heads]",
    )?;
    if shape.tokens() == 0 {
        return Ok(());
    }
    if let Some((tile, subgroup)) = coop_tile(rec.gpu(), &shape, Which::Forward) {
        let padded = inputs.lens.is_some();
        let key = coop::key(Which::Forward, &shape, tile, subgroup, padded);
        let kernel = rec.gpu().kernel(&key, Which::Forward.body())?;
        let args = inputs
            .bind(Args::new(), &shape, true)?
            .buffer("o", o)
            .buffer("lse", lse);
        return rec.launch(&kernel, &args, coop_grid(&shape, tile, shape.heads));
    }
    let key = seq_key(FORWARD, &shape, tile, inputs.lens.is_some());
    let kernel = rec.gpu().kernel(&key, forward_body)?;
    let args = inputs
        .bind(Args::new(), &shape, false)?
        .buffer_vec4("o", o)
        .buffer("lse", lse);
    rec.launch(&kernel, &args, grid(&shape, tile, shape.heads))
}

/// What the backward reads: the forward's inputs, its output `O` and `lse`.
#[derive(Clone, Copy)]
pub struct SeqSaved<'a> {
    pub inputs: SeqInputs<'a>,
    pub o: &'a GpuBuffer<f32>,
    pub lse: &'a GpuBuffer<f32>,
}

/// Workspace and outputs of [`execute_attention_backward`].
pub struct SeqGrads<'a> {
    /// Workspace of `[T, H, 2]`: each row's `(lse, rowsum(dO ⊙ O))`.
    pub stats: &'a mut GpuBuffer<f32>,
    /// Workspace of [`SeqShape::scores_len`] f16 values for the scores' gradients, or `None`.
    /// Where the tensor-core kernels take it ([`scores_workspace_len`] says `Some`), the key
    /// gradients write `dS` there and `dQ` is one product over it, where it would otherwise
    /// recompute the scores and the softmax ([`super::coop`], "The scores' gradients kept");
    /// elsewhere it is left untouched.
    pub scores: Option<&'a mut GpuBuffer<f16>>,
    /// `dQ [T, H·hd]` and `dK`, `dV [T, KV·hd]`, overwritten (w.r.t. the rotated `Q`, `K`);
    /// zeros on padded rows.
    pub d_q: &'a mut GpuBuffer<f32>,
    pub d_k: &'a mut GpuBuffer<f32>,
    pub d_v: &'a mut GpuBuffer<f32>,
}

/// The largest head dimension at which the backward keeps the scores' gradients. On an H100
/// (BENCHMARKS.md, "The attention backward keeps its scores' gradients") keeping them took
/// SmolLM2's backward (hd 64) from 222 to 201 µs at B = 8 and from 636–642 to 552–555 µs at
/// B = 32; at hd 128 (B = 8, H = 20 and B = 2, S = 2048) it was 0.6–1.3% slower: the key
/// gradients' writes cost there what the query gradients save.
pub const SCORES_MAX_HEAD_DIM: usize = 64;

/// The length of the workspace [`SeqGrads::scores`] where [`execute_attention_backward`] takes
/// one at `shape` on `gpu`: the tensor-core kernels run there (`Precision::F16`, 16×16 f16
/// cooperative matrices, `head_dim` a multiple of 16, a tile within the workgroup memory), the
/// head dimension is at most [`SCORES_MAX_HEAD_DIM`], the workspace fits one storage binding,
/// and the key gradients' nine storage buffers fit the device. `None`: the backward recomputes
/// the scores for `dQ` (no workspace needed).
pub fn scores_workspace_len(gpu: &Gpu, shape: &SeqShape) -> Option<usize> {
    scores_plan(gpu, shape).map(|plan| plan.len)
}

/// Where the backward keeps the scores' gradients ([`scores_workspace_len`]'s rules): the
/// tensor-core tiles of the key gradients that write them and of the query gradients from them,
/// the subgroup size, and the workspace's length.
struct ScoresPlan {
    kv_tile: CoopSeqTile,
    q_tile: CoopSeqTile,
    subgroup: u32,
    len: usize,
}

fn scores_plan(gpu: &Gpu, shape: &SeqShape) -> Option<ScoresPlan> {
    if shape.head_dim > SCORES_MAX_HEAD_DIM {
        return None;
    }
    let kv = Which::KeyGrads { write_scores: true };
    let (kv_tile, subgroup) = coop_tile(gpu, shape, kv)?;
    let (q_tile, _) = coop_tile(gpu, shape, Which::QueryGradsFromScores)?;
    let len = shape.scores_len()?;
    let limits = gpu.wgpu_limits();
    let fits = (len as u64).checked_mul(2)? <= limits.max_storage_buffer_binding_size
        && limits.max_storage_buffers_per_shader_stage >= 9;
    fits.then_some(ScoresPlan {
        kv_tile,
        q_tile,
        subgroup,
        len,
    })
}

/// The backward of [`execute_attention_forward`] given `dO [T, H·hd]`: three launches (the row
/// statistics, `dK`/`dV` per KV block, `dQ` per query block), no float atomics.
pub fn execute_attention_backward(
    rec: &mut Recorder<'_>,
    shape: SeqShape,
    saved: SeqSaved<'_>,
    d_out: &GpuBuffer<f32>,
    grads: SeqGrads<'_>,
) -> Result<(), ExecError> {
    let name = "attention_backward";
    shape.check(name)?;
    let tile = SeqTile::for_device(&rec.gpu().kernel_limits(), shape.head_dim);
    check_loops(name, &shape, tile, rec.gpu(), true)?;
    saved.inputs.check(name, &shape)?;
    let rows = shape.tokens() * shape.heads;
    let q_shape = "[batch·seq_len, heads·head_dim]";
    let kv_shape = "[batch·seq_len, kv_heads·head_dim]";
    expect_len(name, "o", saved.o, shape.q_len(), q_shape)?;
    expect_len(name, "lse", saved.lse, rows, "[batch·seq_len, heads]")?;
    expect_len(name, "d_out", d_out, shape.q_len(), q_shape)?;
    expect_len(
        name,
        "stats",
        grads.stats,
        2 * rows,
        "[batch·seq_len, heads, 2]",
    )?;
    expect_len(name, "d_q", grads.d_q, shape.q_len(), q_shape)?;
    expect_len(name, "d_k", grads.d_k, shape.kv_len(), kv_shape)?;
    expect_len(name, "d_v", grads.d_v, shape.kv_len(), kv_shape)?;
    if let Some(scores) = &grads.scores {
        let len = shape.scores_len().ok_or_else(|| ExecError::Dispatch {
            kernel: name.into(),
            what: format!("{shape:?}"),
            why: "the scores' workspace's length overflows".into(),
        })?;
        expect_len(
            name,
            "scores",
            scores,
            len,
            "[batch, heads, S', S'] (scores_len)",
        )?;
    }
    if shape.tokens() == 0 {
        return Ok(());
    }
    let padded = saved.inputs.lens.is_some();
    let gpu = rec.gpu();
    let lanes = match gpu.kernel_features().contains(Features::SUBGROUPS) {
        true => stats_lanes(shape.head_dim as u32, gpu.subgroup_size()),
        false => 1,
    };
    let stats_kernel = gpu.kernel(&stats_key(&shape, padded, lanes), stats_body)?;
    // Every kernel is compiled before anything is recorded: an error leaves the recorder as it
    // was. The blocked kernels are the tensor-core ones where `coop_tile` says so, and those
    // that keep the scores' gradients where there is a workspace for them.
    let plan = grads.scores.as_ref().and_then(|_| scores_plan(gpu, &shape));
    let keep_scores = plan.is_some();
    let coop_tiles = match plan {
        Some(plan) => {
            let kv = (Which::KeyGrads { write_scores: true }, plan.kv_tile);
            Some((
                kv,
                (Which::QueryGradsFromScores, plan.q_tile),
                plan.subgroup,
            ))
        }
        None => {
            let kv_which = Which::KeyGrads {
                write_scores: false,
            };
            let kv = coop_tile(gpu, &shape, kv_which);
            let q = coop_tile(gpu, &shape, Which::QueryGrads);
            kv.zip(q)
                .map(|((kv, subgroup), (q, _))| ((kv_which, kv), (Which::QueryGrads, q), subgroup))
        }
    };
    let (kv_kernel, q_kernel, kv_grid, q_grid, coop) = match coop_tiles {
        Some(((kv_which, kv_tile), (q_which, q_tile), subgroup)) => {
            let kv_key = coop::key(kv_which, &shape, kv_tile, subgroup, padded);
            let q_key = coop::key(q_which, &shape, q_tile, subgroup, padded);
            (
                gpu.kernel(&kv_key, kv_which.body())?,
                gpu.kernel(&q_key, q_which.body())?,
                coop_grid(&shape, kv_tile, shape.kv_heads),
                coop_grid(&shape, q_tile, shape.heads),
                true,
            )
        }
        None => (
            gpu.kernel(&seq_key(KEY_GRADS, &shape, tile, padded), key_grads_body)?,
            gpu.kernel(
                &seq_key(QUERY_GRADS, &shape, tile, padded),
                query_grads_body,
            )?,
            grid(&shape, tile, shape.kv_heads),
            grid(&shape, tile, shape.heads),
            false,
        ),
    };

    let seq_len = expect_u32(name, "seq_len", shape.seq_len)?;
    let mut args = Args::new()
        .buffer_vec4("o", saved.o)
        .buffer_vec4("d_out", d_out)
        .buffer("lse", saved.lse)
        .buffer("stats", &*grads.stats)
        .param("seq_len", seq_len)
        .param("rows", expect_u32(name, "rows", rows)?);
    if let Some(lens) = saved.inputs.lens {
        args = args.buffer("lens", &lens.buffer);
    }
    let invocations = expect_u32(name, "rows × lanes", rows.saturating_mul(lanes as usize))?;
    rec.launch(&stats_kernel, &args, Grid::Threads(u64::from(invocations)))?;

    let stats: &GpuBuffer<f32> = grads.stats;
    // The f32 kernels read `dO` as scalars and write vec4s; the tensor-core ones the other way
    // round, and take the gradient's scale.
    let shared = || -> Result<Args<'_>, ExecError> {
        let args = saved.inputs.bind(Args::new(), &shape, coop)?;
        let args = args.buffer("stats", stats);
        Ok(match coop {
            true => args
                .buffer_vec4("d_out", d_out)
                .param("grad_scale", 2f32.powi(shape.grad_exponent))
                .param("grad_unscale", 2f32.powi(-shape.grad_exponent)),
            false => args.buffer("d_out", d_out),
        })
    };
    fn out<'a>(args: Args<'a>, name: &'a str, buf: &'a GpuBuffer<f32>, coop: bool) -> Args<'a> {
        match coop {
            true => args.buffer(name, buf),
            false => args.buffer_vec4(name, buf),
        }
    }
    let args = out(shared()?, "d_k", &*grads.d_k, coop);
    let args = out(args, "d_v", &*grads.d_v, coop);
    let Some(scores) = grads.scores.filter(|_| keep_scores) else {
        rec.launch(&kv_kernel, &args, kv_grid)?;
        let args = out(shared()?, "d_q", &*grads.d_q, coop);
        return rec.launch(&q_kernel, &args, q_grid);
    };
    rec.launch(&kv_kernel, &args.buffer_vec4("d_scores", &*scores), kv_grid)?;
    let args = Args::new()
        .buffer_vec4("k", saved.inputs.k)
        .buffer_vec4("d_scores", &*scores)
        .buffer("d_q", &*grads.d_q)
        .param("seq_len", seq_len)
        .param("grad_unscale", 2f32.powi(-shape.grad_exponent));
    let args = match saved.inputs.lens {
        Some(lens) => args.buffer("lens", &lens.buffer),
        None => args,
    };
    rec.launch(&q_kernel, &args, q_grid)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A row's lanes are a power of two that divides its vec4s and its subgroup: 1 without
    /// subgroups of one power-of-two size, at most 16.
    #[test]
    fn statistics_lanes_divide_the_row_and_the_subgroup() {
        assert_eq!(stats_lanes(64, Some(32)), 16);
        assert_eq!(stats_lanes(128, Some(32)), 16);
        assert_eq!(stats_lanes(64, Some(8)), 8);
        assert_eq!(stats_lanes(96, Some(32)), 8);
        assert_eq!(stats_lanes(12, Some(32)), 1);
        assert_eq!(stats_lanes(64, Some(24)), 1);
        assert_eq!(stats_lanes(64, None), 1);
        for hd in (4..=256).step_by(4) {
            for size in [4, 8, 16, 32, 64, 128] {
                let lanes = stats_lanes(hd, Some(size));
                assert!(
                    lanes.is_power_of_two() && lanes <= 16,
                    "{hd}, {size}: {lanes}"
                );
                assert!((hd / 4).is_multiple_of(lanes) && size.is_multiple_of(lanes));
            }
        }
    }
}
