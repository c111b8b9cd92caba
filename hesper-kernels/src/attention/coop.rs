//! Sequence attention on the tensor cores: the forward and backward of [`super::sequence`] with
//! the products on cooperative matrices (f16 `Q`, `K`, `V`, `dO`, `P`, `dS` as they are staged,
//! f32 accumulators), the softmax and its statistics in f32. [`super::sequence`]'s entry points
//! take these kernels at `Precision::F16` where the device offers 16×16 f16·f16 + f32
//! cooperative matrices and `head_dim` is a multiple of 16.
//!
//! ## Layout
//! A workgroup of `subgroups` subgroups owns `16·subgroups` rows (query rows for the forward and
//! dQ, keys for dK/dV) of one head; each subgroup owns 16 of them and keeps their operand tiles
//! (`Q`; `K` and `V`; `Q` and `dO`) in registers as `head_dim/16` f16 fragments. A loop steps
//! through the other side `step` rows at a time, staged in workgroup memory as f16: the score
//! tiles (`Q·Kᵀ`, `dO·Vᵀ`, or their transposes) go through the subgroup's f32 scratch, where
//! its invocations (`subgroup/16` a row, each a run of whole vec4s of it, every read before
//! anything is computed or stored) apply the mask and the softmax and write `P` or `dS`
//! as f16 for the accumulating products (`P·V`, `Pᵀ·dO`, `dSᵀ·Q`, `dS·K`).
//!
//! ## Reading ahead
//! Where the registers allow it (`AHEAD_VEC4S`), the forward and the query gradients read the
//! next step's keys and values into registers (f32, as the buffers hold them) before the
//! current step's products and round and stage them only after, as the tensor-core GEMM does
//! (`linear::coop`): the reads' latency hides behind the tensor cores' work. The query
//! gradients then keep the keys in two staged buffers used in turn, so that a step takes two
//! barriers instead of four. Elsewhere, and in the key gradients always, each step's rows are
//! staged as they are read (four barriers a step): reading ahead measured slower there on the
//! H200 (BENCHMARKS.md, "Attention on the tensor cores, reading ahead").
//!
//! - Forward: two passes over the keys. The first finds each row's maximum `m` (per
//!   invocation, then across the row's invocations: no `exp`); the second multiplies
//!   `P = exp(τ·S − m)` by `V` into accumulators that never need rescaling (cooperative
//!   matrices offer no element-wise scaling), summing `l = Σ P` on the way, and stores each
//!   row times `1/l`. `Q·Kᵀ` is computed twice: 1.5× the forward's products, in exchange for
//!   no round trip of the output through memory per key block.
//! - Backward: `lse` is known, so `P` needs no rescaling either. The gradients of a mean loss
//!   are small (~1/N): `dO` is multiplied by `2^grad_exponent` before it is rounded to f16
//!   (`D` with it), and the results by `2^−grad_exponent` ([`SeqShape::grad_exponent`]).
//!
//! ## Splitting the steps
//! The key gradients' grid is small (a workgroup per 32 keys, KV head and sequence: 384 at
//! SmolLM2's B = 8), and each workgroup steps through all the queries after its keys for every
//! query head of its group. With `split > 1` ([`CoopSeqTile::split`]) each row tile has
//! `split` subgroups, each taking `step/split` of a step's staged rows (queries): its own
//! scores, softmax and products into its own partial `dK`, `dV`, added when they are stored.
//! More subgroups share the work of a step without more workgroups or more staging. The
//! forward splits its key steps so too: each subgroup's row maxima, then its sums `l`, are
//! combined across the row tile's subgroups through workgroup memory (the maximum before the
//! second pass, so every part's `P` has the same reference and their `P·V` add up). The query
//! gradients from the scores' gradients (below) split their key steps as the key gradients
//! split their query steps: each subgroup multiplies its part of a step's keys into its own
//! partial `dQ`.
//!
//! ## The scores' gradients kept
//! The query gradients need the same `P` and `dS` as the key gradients: computed again, that
//! is two more products and the softmax a second time. Given a workspace for them
//! ([`SCORES_ALIGN`]), the key gradients' kernel also writes its `dS` (f16, scaled as above) as
//! `dSᵀ [batch, heads, S', S']` (`S'` = `S` rounded up to [`SCORES_ALIGN`]: every block's
//! writes land inside without guards), and `dQ = dS·K` is one product over it
//! (`coop_attention_backward_q_from_scores`). That kernel stages each step's `dSᵀ` with the
//! causal mask applied, so what the key gradients never wrote (above the diagonal) is never
//! read as a value into a row that is stored.
//! [`super::sequence::execute_attention_backward`] takes this path up to a head dimension of
//! [`super::sequence::SCORES_MAX_HEAD_DIM`] (where it measured faster).

use hesper_dsl::prelude::*;
use hesper_dsl::{Kernel, Limits, ReadBuffer, RwBuffer, Var, WorkgroupArray};

use super::sequence::{SeqPlace, SeqShape, seq_place};
use crate::linear::{lane, offset, vec4_of};

type TileA = CoopMat<F16, CoopA>;
type TileB = CoopMat<F16, CoopB>;
type Acc = CoopMat<f32, CoopC>;

/// Scores of excluded keys take part in no maximum: a finite stand-in for `−∞`.
const NEG_BIG: f32 = -1.0e30;
/// Halves of padding after each staged f16 row (against bank conflicts; rows stay 16-byte
/// aligned, as cooperative loads want).
const PAD: u32 = 8;
/// Floats of padding after each scratch row.
const SCRATCH_PAD: u32 = 4;
/// The most vec4s an invocation holds in registers between their read and their staging.
/// Reading a step ahead pays while the registers fit beside the fragments and accumulators:
/// on the H200 (BENCHMARKS.md, "Attention on the tensor cores, reading ahead") 8 and 16 gained
/// 1–12% (hd 64 and 128 over 128 invocations), 32 (hd 128 over 64 invocations) lost 9–92%.
const AHEAD_VEC4S: u32 = 16;

/// Whether `operands` operands of `step` rows of `head_dim` are read a step ahead by
/// `invocations` invocations (at most [`AHEAD_VEC4S`] vec4s each).
fn ahead_fits(head_dim: u32, step: u32, invocations: u32, operands: u32) -> bool {
    operands * (step * head_dim / 4).div_ceil(invocations) <= AHEAD_VEC4S
}

/// Rows of the query gradients' staged f16: the block's `Q` and `dO` (`rows` each), then a
/// step's keys and values; reading ahead, keys in two buffers (rows 0 and `2·step`).
fn query_grads_staged(rows: u32, step: u32, ahead: bool) -> u32 {
    match ahead {
        true => (2 * rows).max(3 * step),
        false => 2 * rows,
    }
}

/// Whether `which` writes or reads the scores' gradients.
fn writes_or_reads_scores(which: Which) -> bool {
    matches!(
        which,
        Which::KeyGrads { write_scores: true } | Which::QueryGradsFromScores
    )
}

/// A tensor-core attention kernel's blocking: `subgroups` tiles of 16 rows each, the other
/// side stepped `step` rows at a time, each step's rows shared out among `split` subgroups a
/// row tile (the workgroup has `subgroups·split` subgroups). The query gradients that recompute
/// the scores do not split (the module doc, "Splitting the steps"): `split` is 1 there.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CoopSeqTile {
    pub subgroups: u32,
    pub step: u32,
    pub split: u32,
}

/// The scores' gradients' workspace rows and columns are the sequence rounded up to this
/// ([`SeqShape::scores_len`]); it is a multiple of every block and step the kernels that
/// write and read it take (their tiles are chosen so).
pub const SCORES_ALIGN: u32 = 64;

/// The kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Which {
    Forward,
    /// `dK`, `dV`; with `write_scores`, the scores' gradients too (the module doc).
    KeyGrads {
        write_scores: bool,
    },
    QueryGrads,
    /// `dQ` from the scores' gradients the key gradients wrote.
    QueryGradsFromScores,
}

impl Which {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Which::Forward => "coop_attention_forward",
            Which::KeyGrads { .. } => "coop_attention_backward_kv",
            Which::QueryGrads => "coop_attention_backward_q",
            Which::QueryGradsFromScores => "coop_attention_backward_q_from_scores",
        }
    }

    /// The kernel's body.
    pub(crate) fn body(self) -> fn(&mut KernelBuilder) {
        match self {
            Which::Forward => forward_body,
            Which::KeyGrads { .. } => key_grads_body,
            Which::QueryGrads => query_grads_body,
            Which::QueryGradsFromScores => query_grads_from_scores_body,
        }
    }
}

impl CoopSeqTile {
    /// Rows a workgroup owns.
    pub fn block(&self) -> u32 {
        16 * self.subgroups
    }

    /// Subgroups a workgroup has.
    pub fn workgroup_subgroups(&self) -> u32 {
        self.subgroups * self.split
    }

    /// Columns of a step each subgroup's scores take.
    fn cols(&self) -> u32 {
        self.step / self.split
    }

    /// Bytes of workgroup memory `which` takes at `head_dim`, with subgroups of `subgroup`.
    pub(crate) fn workgroup_bytes(&self, which: Which, head_dim: u32, subgroup: u32) -> u32 {
        let row = 2 * (head_dim + PAD);
        let (block, step) = (self.block(), self.step);
        let scratch = 4 * 16 * (self.cols() + SCRATCH_PAD) * self.workgroup_subgroups();
        let probs = 2 * 16 * (self.cols() + PAD) * self.workgroup_subgroups();
        match which {
            Which::Forward => {
                let part_stats = match self.split {
                    1 => 0,
                    _ => 2 * 4 * 16 * self.workgroup_subgroups(),
                };
                block.max(2 * step) * row + scratch + probs + 4 * block + part_stats
            }
            Which::KeyGrads { .. } => {
                2 * block.max(step) * row + 2 * scratch + 2 * probs + 8 * step
            }
            Which::QueryGrads => {
                let ahead = ahead_fits(head_dim, step, self.workgroup_subgroups() * subgroup, 2);
                query_grads_staged(block.max(step), step, ahead) * row + 2 * scratch + probs
            }
            Which::QueryGradsFromScores => step * (row + 2 * (block + PAD)) + scratch,
        }
    }

    /// Whether the tile's blocks and steps divide [`SCORES_ALIGN`], as the kernels that write
    /// and read the scores' gradients need.
    pub(crate) fn scores_fit(&self) -> bool {
        SCORES_ALIGN.is_multiple_of(self.block()) && SCORES_ALIGN.is_multiple_of(self.step)
    }

    /// The first of `which`'s standard tiles ([`CoopSeqTile::standard`]) that a device with
    /// `limits` runs with subgroups of `subgroup`.
    pub(crate) fn for_device(
        limits: &Limits,
        which: Which,
        head_dim: u32,
        subgroup: u32,
    ) -> Option<CoopSeqTile> {
        let measured = match which {
            Which::KeyGrads { .. } => tiles_to_measure("HESPER_ATTENTION_KV_TILES"),
            Which::Forward => tiles_to_measure("HESPER_ATTENTION_FORWARD_TILES"),
            Which::QueryGradsFromScores => tiles_to_measure("HESPER_ATTENTION_Q_TILES"),
            Which::QueryGrads => Vec::new(),
        };
        (measured
            .into_iter()
            .chain(CoopSeqTile::standard(which).iter().copied()))
        .map(|(subgroups, step, split)| CoopSeqTile {
            subgroups,
            step,
            split,
        })
        .find(|t| {
            t.workgroup_bytes(which, head_dim, subgroup) <= limits.max_workgroup_storage_bytes
                && t.workgroup_subgroups() * subgroup <= limits.max_invocations_per_workgroup
                && t.rule(which, subgroup).is_none()
        })
    }

    /// Why `which` cannot take this tile with subgroups of `subgroup`, or `None`.
    pub(crate) fn rule(&self, which: Which, subgroup: u32) -> Option<String> {
        let step_ok = self.step > 0 && self.step.is_multiple_of(16 * self.split);
        if self.subgroups == 0 || self.split == 0 || !step_ok {
            return Some(
                "at least one subgroup, and a step that is a positive multiple of 16·split".into(),
            );
        }
        if self.split > 1 && which == Which::QueryGrads {
            return Some(
                "the query gradients that recompute the scores do not split their steps \
                 (split = 1)"
                    .into(),
            );
        }
        // Each invocation of a scratch row handles whole vec4s of it.
        if !self.cols().is_multiple_of(4 * (subgroup / 16)) {
            return Some(
                "a subgroup's part of the step (step/split) must share out in whole vec4s \
                 among a row's subgroup/16 invocations"
                    .into(),
            );
        }
        if writes_or_reads_scores(which) && !self.scores_fit() {
            return Some(format!(
                "the scores' gradients take blocks (16·row_tiles) and steps that divide \
                 {SCORES_ALIGN}"
            ));
        }
        None
    }

    /// `which`'s tiles as `(subgroups, step, split)`, fastest first where the workgroup memory allows,
    /// as measured on the H200 at SmolLM2's heads (hd 64) and at hd 128 (BENCHMARKS.md,
    /// "Attention tiles"): short steps keep the workgroup memory small, so more workgroups
    /// share a multiprocessor, and the scalar softmax of a step is short.
    /// - forward: 4 subgroups stepping 16 keys (hd 64: 84 µs against 126 stepping 64);
    /// - key gradients: 2 row tiles stepping 64 queries, each step split between 2 subgroups a
    ///   row tile (on an H100 at hd 64, B = 8, writing the scores' gradients: 116.0 µs against
    ///   138.3 for 2 × 32 unsplit; 2 × 32 split 2 ways 132.1, 1 × 64 split 4 ways 143.0;
    ///   BENCHMARKS.md, "Splitting the attention's steps"), else 2 stepping 32 (hd 64 on the
    ///   H200: 171 µs against 188 with 4; 2 stepping 16 measured 2.7–5× slower);
    /// - query gradients: 4 subgroups stepping 32 keys, else 16 (hd 128: 278 µs against 611
    ///   with 2 subgroups stepping 32);
    /// - query gradients from the scores' gradients: 4 row tiles stepping 32 keys, each step
    ///   split between 2 subgroups a row tile (on an H100 at hd 64, B = 8: 43.3 µs against
    ///   45.4 unsplit; 2 × 64 split 4 ways 44.6, 2 × 64 split 2 ways 46.2, 4 × 64 split 2 ways
    ///   47.6, 4 × 64 unsplit 51.5, 1 × 64 split 4 ways 62.3; BENCHMARKS.md, "The query
    ///   gradients' steps split"), else the query gradients' tiles.
    fn standard(which: Which) -> &'static [(u32, u32, u32)] {
        match which {
            Which::Forward => &[(4, 16, 1), (2, 16, 1), (1, 16, 1)],
            Which::KeyGrads { .. } => &[(2, 64, 2), (2, 32, 1), (1, 16, 1)],
            Which::QueryGrads => &[(4, 32, 1), (4, 16, 1), (2, 16, 1), (1, 16, 1)],
            Which::QueryGradsFromScores => {
                &[(4, 32, 2), (4, 32, 1), (4, 16, 1), (2, 16, 1), (1, 16, 1)]
            }
        }
    }
}

/// The tiles named in the environment variable `var` (`SUBGROUPSxSTEPxSPLIT`, comma-separated:
/// `2x32x2,1x64x4`), tried before the standard ones: `HESPER_ATTENTION_KV_TILES` for the key
/// gradients, `HESPER_ATTENTION_FORWARD_TILES` for the forward, `HESPER_ATTENTION_Q_TILES` for
/// the query gradients from the scores' gradients; for measuring tiles on a device
/// (BENCHMARKS.md). What does not parse, fit the device or follow [`CoopSeqTile::rule`] is
/// passed over.
fn tiles_to_measure(var: &str) -> Vec<(u32, u32, u32)> {
    let Ok(text) = std::env::var(var) else {
        return Vec::new();
    };
    (text.split(','))
        .filter_map(|tile| {
            let n: Vec<u32> = tile
                .trim()
                .split('x')
                .map(|n| n.parse().ok())
                .collect::<Option<_>>()?;
            match n[..] {
                [subgroups, step, split] => Some((subgroups, step, split)),
                _ => None,
            }
        })
        .collect()
}

/// The kernel key of `which` at `shape`, `tile`, subgroups of `subgroup`, with or without
/// valid lengths.
pub(crate) fn key(
    which: Which,
    shape: &SeqShape,
    tile: CoopSeqTile,
    subgroup: u32,
    padded: bool,
) -> KernelKey {
    let key = KernelKey::new(which.name());
    let key = match which {
        Which::KeyGrads { write_scores } => key
            .shape("write_scores", write_scores)
            .shape("split", tile.split),
        Which::Forward | Which::QueryGradsFromScores => key.shape("split", tile.split),
        Which::QueryGrads => key,
    };
    key.workgroup_size(tile.workgroup_subgroups() * subgroup)
        .features(Features::COOPERATIVE_MATRIX | Features::SUBGROUPS)
        .shape("head_dim", shape.head_dim as u32)
        .shape("heads", shape.heads as u32)
        .shape("kv_heads", shape.kv_heads as u32)
        .shape("row_tiles", tile.subgroups)
        .shape("step", tile.step)
        .shape("subgroup", subgroup)
        .shape("padded", padded)
        // Reads are clamped into their sequence and stores guarded, by construction.
        .assume_in_bounds()
}

/// What every kernel reads from its key and binds first.
struct Place {
    hd: u32,
    heads: u32,
    kv_heads: u32,
    group: u32,
    /// Row tiles (16 rows each), rows of the other side a step, and subgroups a row tile.
    subgroups: u32,
    step: u32,
    split: u32,
    /// Columns of a step the subgroup's scores take (`step / split`), and where it has a part
    /// of the step (`split > 1`) its first column and that column's first vec4 in the staged
    /// rows (the shift of [`scores_into`] and [`accumulate`]).
    cols: u32,
    part_col0: Option<Expr<u32>>,
    part_shift: Option<Expr<u32>>,
    /// Invocations a scratch row (`subgroup / 16`), and the row and part of this invocation.
    per_row: u32,
    row: Expr<u32>,
    part: Expr<u32>,
    /// The subgroup's index (its scratch's), its row tile's, and its first owned row (inside
    /// the sequence).
    sg: Expr<u32>,
    row_tile: Expr<u32>,
    own0: Expr<u32>,
    seq_len: Expr<u32>,
    last: Expr<u32>,
    len: Expr<u32>,
    origin: Expr<u32>,
    seq: Expr<u32>,
    token0: Expr<u32>,
    head: Expr<u32>,
    lid: Expr<u32>,
    invocations: u32,
}

impl Place {
    /// Halves (and vec4s) a staged row takes.
    fn row_halves(&self) -> u32 {
        self.hd + PAD
    }
    fn row_vec4s(&self) -> u32 {
        self.row_halves() / 4
    }
    /// Floats a scratch row takes, and one subgroup's scratch.
    fn scratch_row(&self) -> u32 {
        self.cols + SCRATCH_PAD
    }
    fn scratch_len(&self) -> u32 {
        16 * self.scratch_row()
    }
    /// Halves a `P` / `dS` row takes, and one subgroup's tile.
    fn probs_row(&self) -> u32 {
        self.cols + PAD
    }
    fn probs_len(&self) -> u32 {
        16 * self.probs_row()
    }
}

/// Whether `operands` operands of a step are read a step ahead ([`ahead_fits`]).
fn reads_ahead(p: &Place, operands: u32) -> bool {
    ahead_fits(p.hd, p.step, p.invocations, operands)
}

/// Binds the runtime values and the invocation's place; `queries`: the owned rows are query
/// rows (the blocks with the most keys first), else keys; `split`: subgroups a row tile.
fn place(k: &mut KernelBuilder, queries: bool, split: u32) -> Place {
    let hd: u32 = k.shape("head_dim");
    let heads: u32 = k.shape("heads");
    let kv_heads: u32 = k.shape("kv_heads");
    let subgroups: u32 = k.shape("row_tiles");
    let step: u32 = k.shape("step");
    let subgroup: u32 = k.shape("subgroup");
    let cols = step / split;
    let SeqPlace {
        seq_len,
        last,
        len,
        origin,
        seq,
        token0,
        head,
    } = seq_place(k, queries, 16 * subgroups);
    let sg = k.let_("sg", k.subgroup_id());
    let lane = k.let_("lane", k.subgroup_invocation_id());
    let per_row = subgroup / 16;
    let row = k.let_("row", &lane / per_row);
    let part = k.let_("part", &lane % per_row);
    // A row tile's subgroups are `row_tile`, `row_tile + subgroups`, …: the parts of its steps.
    let (row_tile, part_col0, part_shift) = match split {
        1 => (sg.clone(), None, None),
        _ => {
            let row_tile = k.let_("row_tile", &sg % subgroups);
            let col0 = k.let_("part_col0", &sg / subgroups * cols);
            let shift = k.let_("part_rows", &col0 * ((hd + PAD) / 4));
            (row_tile, Some(col0), Some(shift))
        }
    };
    let own0 = k.let_("own0", &origin + &row_tile * 16u32);
    let lid = k.let_("lid", k.local_index());
    Place {
        hd,
        heads,
        kv_heads,
        group: heads / kv_heads,
        subgroups,
        step,
        split,
        cols,
        part_col0,
        part_shift,
        per_row,
        row,
        part,
        sg,
        row_tile,
        own0,
        seq_len,
        last,
        len,
        origin,
        seq,
        token0,
        head,
        lid,
        invocations: subgroups * split * subgroup,
    }
}

/// Rows of one head in a `[T, heads·hd]` buffer read as vec4s.
struct Rows<'a> {
    buf: &'a ReadBuffer<Vec4<f32>>,
    /// vec4s a token (`heads·hd/4`) and the head's first vec4.
    stride4: u32,
    head4: Expr<u32>,
}

fn rows_of<'a>(
    k: &mut KernelBuilder,
    buf: &'a ReadBuffer<Vec4<f32>>,
    p: &Place,
    heads: u32,
    head: &Expr<u32>,
) -> Rows<'a> {
    Rows {
        buf,
        stride4: heads * p.hd / 4,
        head4: k.let_("head4", head * (p.hd / 4)),
    }
}

/// `body(slot)` for each of `slots` slots, shared out over the workgroup's invocations a round
/// at a time (the last round guarded where it passes the slots).
fn for_each_slot(
    k: &mut KernelBuilder,
    p: &Place,
    slots: u32,
    body: impl Fn(&mut KernelBuilder, &Expr<u32>),
) {
    for i in 0..slots.div_ceil(p.invocations) {
        let s = k.let_("slot", offset(&p.lid, i * p.invocations));
        if (i + 1) * p.invocations > slots {
            k.if_(s.lt(slots), |k| body(k, &s));
        } else {
            body(k, &s);
        }
    }
}

/// Stage `rows` rows of `src` from sequence row `first` (clamped into the sequence) as f16 into
/// `stage` from its row `at`, each multiplied by `scale` first where there is one.
fn stage_rows(
    k: &mut KernelBuilder,
    p: &Place,
    stage: &WorkgroupArray<Vec4<F16>>,
    (src, first, rows): (&Rows<'_>, &Expr<u32>, u32),
    at: u32,
    scale: Option<&Expr<f32>>,
) {
    let per_row = p.hd / 4;
    for_each_slot(k, p, rows * per_row, |k, s| {
        let r = k.let_("r", s / per_row);
        let c4 = k.let_("c4", s % per_row);
        let token = &p.token0 + (first + &r).min(&p.last);
        let v = src.buf.at(token * src.stride4 + &src.head4 + &c4);
        let v = match scale {
            Some(f) => v * Expr::<Vec4<f32>>::splat(f.clone()),
            None => v,
        };
        let dst = (&r + at) * p.row_vec4s() + &c4;
        k.store(stage, dst, v.cast::<Vec4<F16>>());
    });
}

/// One operand's `rows` rows of a step as this invocation stages them: each slot's row and vec4
/// (computed once, outside the loop) and a register that holds the slot's vec4 raw, as the
/// buffer holds it, from its read to its staging. The loops read the next step's rows into
/// these registers before the current step's products and stage them after (as the
/// tensor-core GEMM does, `linear::coop`): nothing waits for a read until it is staged.
struct Ahead {
    slots: Vec<AheadSlot>,
}

/// One vec4 of [`Ahead`]: row `r` of the step, vec4 `c4` along it.
struct AheadSlot {
    r: Expr<u32>,
    c4: Expr<u32>,
    /// Where the last round of slots passes the rows: whether this slot is one of them.
    inside: Option<Expr<bool>>,
    next: Var<Vec4<f32>>,
}

/// The slots of `rows` rows (their registers named after `name`).
fn ahead(k: &mut KernelBuilder, p: &Place, rows: u32, name: &str) -> Ahead {
    let per_row = p.hd / 4;
    let slots = rows * per_row;
    // Invocations covering whole rows per round: every slot is the first's rows later.
    let first = p.invocations.is_multiple_of(per_row).then(|| {
        (
            k.let_(&format!("{name}_r"), &p.lid / per_row),
            k.let_(&format!("{name}_c4"), &p.lid % per_row),
        )
    });
    let slots = (0..slots.div_ceil(p.invocations))
        .map(|i| {
            let partial = (i + 1) * p.invocations > slots;
            let (r, c4, inside) = match (&first, partial) {
                (Some((r0, c4)), false) => {
                    (offset(r0, i * p.invocations / per_row), c4.clone(), None)
                }
                _ => {
                    let s = k.let_("slot", offset(&p.lid, i * p.invocations));
                    let inside = partial.then(|| k.let_("inside", s.lt(slots)));
                    // A slot past the rows reads the last one (and stages nothing).
                    let s = if partial { s.min(slots - 1) } else { s };
                    let r = k.let_(&format!("{name}_r"), &s / per_row);
                    let c4 = k.let_(&format!("{name}_c4"), &s % per_row);
                    (r, c4, inside)
                }
            };
            let next = k.var(name, Expr::<Vec4<f32>>::splat(lit(0.0f32)));
            AheadSlot {
                r,
                c4,
                inside,
                next,
            }
        })
        .collect();
    Ahead { slots }
}

impl Ahead {
    /// Read the rows from sequence row `first` (clamped into the sequence) of `src`.
    fn fetch(&self, k: &mut KernelBuilder, p: &Place, src: &Rows<'_>, first: &Expr<u32>) {
        for slot in &self.slots {
            let token = &p.token0 + (first + &slot.r).min(&p.last);
            k.assign(
                &slot.next,
                src.buf.at(token * src.stride4 + &src.head4 + &slot.c4),
            );
        }
    }

    /// Stage what was read as f16 into `stage` from its row `at` (plus `shift` vec4s where
    /// there is one), each multiplied by `scale` first where there is one.
    fn stage(
        &self,
        k: &mut KernelBuilder,
        p: &Place,
        (stage, at, shift): (&WorkgroupArray<Vec4<F16>>, u32, Option<&Expr<u32>>),
        scale: Option<&Expr<f32>>,
    ) {
        for slot in &self.slots {
            let v = match scale {
                Some(f) => slot.next.get() * Expr::<Vec4<f32>>::splat(f.clone()),
                None => slot.next.get(),
            };
            let dst = (&slot.r + at) * p.row_vec4s() + &slot.c4;
            let dst = match shift {
                Some(s) => dst + s,
                None => dst,
            };
            match &slot.inside {
                Some(inside) => k.if_(inside, |k| k.store(stage, dst, v.cast::<Vec4<F16>>())),
                None => k.store(stage, dst, v.cast::<Vec4<F16>>()),
            }
        }
    }
}

/// The subgroup's own 16 rows of a staged operand (from stage row `at + 16·sg`) as the left
/// operand: `hd/16` fragments along the head dimension.
fn own_fragments(
    k: &mut KernelBuilder,
    p: &Place,
    stage: &WorkgroupArray<Vec4<F16>>,
    at: u32,
) -> Vec<Expr<TileA>> {
    let base = k.let_("own_at", (&p.row_tile * 16u32 + at) * p.row_vec4s());
    (0..p.hd / 16)
        .map(|d| k.coop_load::<TileA, _>(stage, offset(&base, d * 4), p.row_vec4s(), Major::Row))
        .collect()
}

/// A constant index into the staged rows, plus `shift` where there is one.
fn shifted(index: u32, shift: Option<&Expr<u32>>) -> Expr<u32> {
    match shift {
        Some(s) => offset(s, index),
        None => lit(index),
    }
}

/// `own · staged[at .. at + cols]ᵀ` (the staged rows (from row `at`, plus `shift` vec4s where
/// there is one) as the product's columns) into the subgroup's scratch, 16 columns a fragment.
fn scores_into(
    k: &mut KernelBuilder,
    p: &Place,
    own: &[Expr<TileA>],
    stage: &WorkgroupArray<Vec4<F16>>,
    (at, shift): (u32, Option<&Expr<u32>>),
    scratch: &WorkgroupArray<Vec4<f32>>,
) {
    let base = k.let_("scratch_at", &p.sg * (p.scratch_len() / 4));
    for j in 0..p.cols / 16 {
        let mut acc = Expr::<Acc>::zero();
        for (d, a) in own.iter().enumerate() {
            let idx = shifted((at + j * 16) * p.row_vec4s() + d as u32 * 4, shift);
            let b = k.coop_load::<TileB, _>(stage, idx, p.row_vec4s(), Major::Column);
            acc = coop_multiply_add(a.clone(), b, acc);
        }
        k.coop_store(
            scratch,
            offset(&base, j * 4),
            p.scratch_row() / 4,
            Major::Row,
            acc,
        );
    }
}

/// `acc[j] += tile · staged[at .. at + cols]` (the staged rows as the product's depth; `shift`
/// as for [`scores_into`]): the subgroup's `16 × cols` f16 `tile` times `cols` staged rows,
/// `hd/16` accumulators.
fn accumulate(
    k: &mut KernelBuilder,
    p: &Place,
    tile: &WorkgroupArray<Vec4<F16>>,
    stage: &WorkgroupArray<Vec4<F16>>,
    at: (u32, Option<&Expr<u32>>),
    acc: &[Var<Acc>],
) {
    let base = k.let_("tile_at", &p.sg * (p.probs_len() / 4));
    let row4 = p.probs_row() / 4;
    let left = |k: &mut KernelBuilder, kk: u32| {
        k.coop_load::<TileA, _>(tile, offset(&base, kk * 4), row4, Major::Row)
    };
    accumulate_from(k, p, &left, stage, at, acc);
}

/// `acc[j] += left · staged[at .. at + cols]`, `left(kk)` the left operand's `kk`-th 16
/// columns (of `cols`).
fn accumulate_from(
    k: &mut KernelBuilder,
    p: &Place,
    left: &dyn Fn(&mut KernelBuilder, u32) -> Expr<TileA>,
    stage: &WorkgroupArray<Vec4<F16>>,
    (at, shift): (u32, Option<&Expr<u32>>),
    acc: &[Var<Acc>],
) {
    for kk in 0..p.cols / 16 {
        let a = left(k, kk);
        for (j, c) in acc.iter().enumerate() {
            let idx = shifted((at + kk * 16) * p.row_vec4s() + j as u32 * 4, shift);
            let b = k.coop_load::<TileB, _>(stage, idx, p.row_vec4s(), Major::Row);
            k.assign(c, coop_multiply_add(a.clone(), b, c.get()));
        }
    }
}

/// The scratch columns this invocation handles, in order: `cols/per_row` of them from
/// `part·cols/per_row`, whole vec4s of its row (their first column, and the `cols/4` vec4s a
/// row, are multiples of 4: [`CoopSeqTile::rule`]).
fn my_columns(p: &Place) -> Vec<Expr<u32>> {
    let run = p.cols / p.per_row;
    (0..run).map(|c| &p.part * run + c).collect()
}

/// [`my_columns`] as columns of the whole step: where a row tile's subgroups split it, from
/// this subgroup's part's first column.
fn step_columns(p: &Place) -> Vec<Expr<u32>> {
    (my_columns(p).into_iter())
        .map(|c| match &p.part_col0 {
            Some(c0) => c0 + c,
            None => c,
        })
        .collect()
}

/// Where a row tile's subgroups split the steps: `value` (one a row, the same in each of the
/// row's invocations) combined over the row tile's subgroups through `parts` (16 floats a
/// subgroup), a barrier between the writes and the reads; as it is otherwise.
fn across_parts(
    k: &mut KernelBuilder,
    p: &Place,
    parts: Option<&WorkgroupArray<f32>>,
    value: Expr<f32>,
    combine: fn(Expr<f32>, Expr<f32>) -> Expr<f32>,
) -> Expr<f32> {
    let Some(parts) = parts else {
        return value;
    };
    k.if_(p.part.eq(0u32), |k| {
        k.store(parts, &p.sg * 16u32 + &p.row, value)
    });
    k.workgroup_barrier();
    let all = (0..p.split)
        .map(|t| parts.at((&p.row_tile + t * p.subgroups) * 16u32 + &p.row))
        .reduce(combine)
        .expect("a row tile has a subgroup");
    k.let_("across_parts", all)
}

/// The first vec4 of this invocation's run of columns in its subgroup's `16 × row4`-vec4
/// tile of `len4` vec4s.
fn my_vec4(p: &Place, (len4, row4): (u32, u32)) -> Expr<u32> {
    &p.sg * len4 + &p.row * row4 + &p.part * (p.cols / p.per_row / 4)
}

/// Every value of `scratch` this invocation handles ([`my_columns`]), in their order, read
/// as vec4s into `let`s before anything is computed from them or stored. Read, computed and
/// stored column by column, the H200's compiler kept each column's read waiting on the
/// stores before it: the key gradients took 171 µs at SmolLM2's shape where reads first
/// take 112 (BENCHMARKS.md, "Attention's softmax: reads first").
fn scratch_reads(
    k: &mut KernelBuilder,
    p: &Place,
    scratch: &WorkgroupArray<Vec4<f32>>,
) -> Vec<Expr<f32>> {
    let first = k.let_(
        "scratch_at",
        my_vec4(p, (p.scratch_len() / 4, p.scratch_row() / 4)),
    );
    let quads: Vec<Expr<Vec4<f32>>> = (0..p.cols / p.per_row / 4)
        .map(|i| k.let_("s", scratch.at(offset(&first, i))))
        .collect();
    quads
        .iter()
        .flat_map(|v| (0..4).map(move |q| lane(v, q)))
        .collect()
}

/// `tile[row][col] = values[i]` (f16) for this invocation's columns ([`my_columns`]), four a
/// store.
fn tile_stores(
    k: &mut KernelBuilder,
    p: &Place,
    tile: &WorkgroupArray<Vec4<F16>>,
    values: Vec<Expr<f32>>,
) {
    let first = k.let_(
        "tile_at",
        my_vec4(p, (p.probs_len() / 4, p.probs_row() / 4)),
    );
    for (i, quad) in values.chunks(4).enumerate() {
        let v = vec4_of(quad.iter().map(|v| v.clone().cast::<F16>()).collect());
        k.store(tile, offset(&first, i as u32), v);
    }
}

/// Store the accumulators (`16 × hd`, the subgroup's own rows) into `out` `[T, heads·hd]` at
/// `head`, row `r` (of 16) times `mult(r)`, through the scratch a fragment at a time: rows past
/// the sequence are not stored, rows past its valid length get zeros. Where a row tile has
/// several subgroups (`split`), each holds a part of the sums: its subgroups store their
/// fragments side by side, and each stores a share of the elements, the parts added.
#[allow(clippy::too_many_arguments)]
fn store_own(
    k: &mut KernelBuilder,
    p: &Place,
    acc: &[Var<Acc>],
    scratch: &WorkgroupArray<Vec4<f32>>,
    out: &RwBuffer<f32>,
    (heads, head): (u32, &Expr<u32>),
    mult: &dyn Fn(&Expr<u32>) -> Expr<f32>,
    subgroup: u32,
) {
    let len4 = p.scratch_len() / 4;
    let base = k.let_("scratch_at", &p.sg * len4);
    // The row tile's subgroups' fragments, and this invocation's first element of a fragment.
    let (parts, first) = match &p.part_col0 {
        None => (vec![base.clone()], k.subgroup_invocation_id()),
        Some(_) => {
            let parts = (0..p.split)
                .map(|t| k.let_("part_at", (&p.row_tile + t * p.subgroups) * len4))
                .collect();
            let share = k.let_("share", &p.sg / p.subgroups * subgroup);
            (parts, k.let_("first", share + k.subgroup_invocation_id()))
        }
    };
    let sharers = p.split * subgroup;
    let head_col = k.let_("head_col", head * p.hd);
    for (j, c) in acc.iter().enumerate() {
        k.workgroup_barrier();
        k.coop_store(scratch, &base, p.scratch_row() / 4, Major::Row, c.get());
        k.workgroup_barrier();
        // The fragment's 64 vec4s (16 rows of 4), `split·subgroup` at a time.
        for i in 0..64u32.div_ceil(sharers) {
            let e = k.let_("e", offset(&first, i * sharers));
            let r = k.let_("r", &e / 4u32);
            let c4 = k.let_("c4", &e % 4u32);
            let row = k.let_("at_row", &p.own0 + &r);
            let inside = row.lt(&p.seq_len);
            let inside = match (i + 1) * sharers > 64 {
                true => inside.and(e.lt(64u32)),
                false => inside,
            };
            k.if_(inside, |k| {
                let row4 = p.scratch_row() / 4;
                let sum = (parts.iter().map(|part| scratch.at(part + &r * row4 + &c4)))
                    .reduce(|a, b| a + b)
                    .expect("a row tile has a subgroup");
                let v = k.let_("v", sum);
                let (valid, m) = (k.let_("valid", row.lt(&p.len)), k.let_("m", mult(&r)));
                let at = k.let_(
                    "at",
                    (&p.token0 + &row) * (heads * p.hd) + &head_col + &c4 * 4u32 + j as u32 * 16,
                );
                for q in 0..4 {
                    let value = select(valid.clone(), lane(&v, q) * &m, lit(0.0f32));
                    k.store(out, offset(&at, q), value);
                }
            });
        }
    }
}

fn accumulators(k: &mut KernelBuilder, p: &Place, hint: &str) -> Vec<Var<Acc>> {
    (0..p.hd / 16)
        .map(|_| k.var(hint, Expr::<Acc>::zero()))
        .collect()
}

/// Head `head`'s square of the scores' gradients `dSᵀ [batch, heads, S', S']` (f16 read as
/// vec4s; the module doc): its first vec4, and `S'/4`, the vec4s a row.
fn scores_square(k: &mut KernelBuilder, p: &Place, head: &Expr<u32>) -> (Expr<u32>, Expr<u32>) {
    let side = (&p.seq_len + (SCORES_ALIGN - 1)) / SCORES_ALIGN * SCORES_ALIGN;
    let side4 = k.let_("scores_row4", side / 4u32);
    let square = k.let_(
        "scores_at",
        (&p.seq * p.heads + head) * &side4 * 4u32 * &side4,
    );
    (square, side4)
}

/// Key blocks of `step` up to the owned block's last real row (none for a block of padding).
fn key_steps(k: &mut KernelBuilder, p: &Place) -> Expr<u32> {
    let end = k.let_("end", (&p.origin + 16 * p.subgroups).min(&p.len));
    k.let_(
        "key_steps",
        select(
            p.origin.lt(&p.len),
            (&end + (p.step - 1)) / p.step,
            lit(0u32),
        ),
    )
}

/// `O = softmax(τ·Q·Kᵀ + causal)·V` and `lse` (the module doc).
fn forward_body(k: &mut KernelBuilder) {
    let q = k.storage::<Vec4<f32>>("q");
    let kb = k.storage::<Vec4<f32>>("k");
    let v = k.storage::<Vec4<f32>>("v");
    let o = k.storage_rw::<f32>("o");
    let lse = k.storage_rw::<f32>("lse");
    let tau = k.param::<f32>("scale");
    let subgroup: u32 = k.shape("subgroup");
    let split: u32 = k.shape("split");
    let p = place(k, true, split);
    let block = 16 * p.subgroups;
    let all = p.subgroups * p.split;
    let stage = k.workgroup_array::<Vec4<F16>>("stage", block.max(2 * p.step) * p.row_vec4s());
    let scratch = k.workgroup_array::<Vec4<f32>>("scratch", all * p.scratch_len() / 4);
    let probs = k.workgroup_array::<Vec4<F16>>("probs", all * p.probs_len() / 4);
    // Each owned row's 1/l.
    let row_scale = k.workgroup_array::<f32>("row_scale", block);
    // Where the steps are split: each subgroup's rows' maxima, then sums.
    let part_stats = (split > 1).then(|| {
        (
            k.workgroup_array::<f32>("part_max", 16 * all),
            k.workgroup_array::<f32>("part_sum", 16 * all),
        )
    });
    let shift = p.part_shift.as_ref();
    let kv = k.let_("kv", &p.head / p.group);
    let q_rows = rows_of(k, &q, &p, p.heads, &p.head);
    let k_rows = rows_of(k, &kb, &p, p.kv_heads, &kv);
    let v_rows = rows_of(k, &v, &p, p.kv_heads, &kv);

    k.comment("The block's query rows, each subgroup's 16 kept as fragments.");
    stage_rows(k, &p, &stage, (&q_rows, &p.origin, block), 0, None);
    k.workgroup_barrier();
    let own = own_fragments(k, &p, &stage, 0);
    let steps = key_steps(k, &p);
    let my_row = k.let_("my_row", &p.own0 + &p.row);
    let valid = |k: &mut KernelBuilder, key: &Expr<u32>| {
        k.let_("valid", key.le(&my_row).and(key.lt(&p.len)))
    };

    k.comment("First pass: the row's maximum, per invocation.");
    let m = k.var("m", lit(NEG_BIG));
    // Keys and values read a step ahead, where the registers allow it.
    let k_next = reads_ahead(&p, 2).then(|| ahead(k, &p, p.step, "k_next"));
    if let Some(k_next) = &k_next {
        k_next.fetch(k, &p, &k_rows, &lit(0u32));
        k.workgroup_barrier();
        k_next.stage(k, &p, (&stage, 0, None), None);
        k.workgroup_barrier();
    }
    k.for_range("key_step", 0u32, &steps, |k, ks| {
        let c0 = k.let_("c0", &ks * p.step);
        let more = match &k_next {
            Some(k_next) => {
                let more = k.let_("more", (&ks + 1u32).lt(&steps));
                let c1 = k.let_("c1", &c0 + p.step);
                k.comment("Read the next step's keys into registers while this one multiplies.");
                k.if_(&more, |k| k_next.fetch(k, &p, &k_rows, &c1));
                Some(more)
            }
            None => {
                k.workgroup_barrier();
                stage_rows(k, &p, &stage, (&k_rows, &c0, p.step), 0, None);
                k.workgroup_barrier();
                None
            }
        };
        scores_into(k, &p, &own, &stage, (0, shift), &scratch);
        k.workgroup_barrier();
        let read = scratch_reads(k, &p, &scratch);
        let scores: Vec<Expr<f32>> = (step_columns(&p).iter().zip(read))
            .map(|(col, s)| {
                let ok = valid(k, &(&c0 + col));
                k.let_("ts", select(ok, s * &tau, lit(NEG_BIG)))
            })
            .collect();
        let top = scores.iter().fold(m.get(), |a, s| a.max(s.clone()));
        k.assign(&m, top);
        if let (Some(k_next), Some(more)) = (&k_next, &more) {
            k.workgroup_barrier();
            k.if_(more, |k| k_next.stage(k, &p, (&stage, 0, None), None));
            k.workgroup_barrier();
        }
    });
    k.comment("Across the row's invocations.");
    let mut mask = 1;
    while mask < p.per_row {
        let m_other = k.subgroup_shuffle_xor(m.get(), mask);
        k.assign(&m, m.get().max(m_other));
        mask *= 2;
    }
    if let Some((part_max, _)) = &part_stats {
        k.comment("Across the row tile's subgroups.");
        let top = across_parts(k, &p, Some(part_max), m.get(), |a, b| a.max(b));
        k.assign(&m, top);
    }

    k.comment("Second pass: O = Σ P·V with P = exp(τ·S − m), at most 1 (f16 keeps its digits);");
    k.comment("no rescaling; the sum l = Σ P on the way, each row times 1/l when stored.");
    let l = k.var("l", lit(0.0f32));
    let acc = accumulators(k, &p, "o_acc");
    let kv_next = k_next.map(|k_next| (k_next, ahead(k, &p, p.step, "v_next")));
    let stage_next = |k: &mut KernelBuilder, (k_next, v_next): &(Ahead, Ahead)| {
        k_next.stage(k, &p, (&stage, 0, None), None);
        v_next.stage(k, &p, (&stage, p.step, None), None);
    };
    if let Some(next) = &kv_next {
        next.0.fetch(k, &p, &k_rows, &lit(0u32));
        next.1.fetch(k, &p, &v_rows, &lit(0u32));
        k.workgroup_barrier();
        stage_next(k, next);
        k.workgroup_barrier();
    }
    k.for_range("key_step", 0u32, &steps, |k, ks| {
        let c0 = k.let_("c0", &ks * p.step);
        let more = match &kv_next {
            Some((k_next, v_next)) => {
                let c1 = k.let_("c1", &c0 + p.step);
                let more = k.let_("more", (&ks + 1u32).lt(&steps));
                k.comment("Read the next step's keys and values while this one multiplies.");
                k.if_(&more, |k| {
                    k_next.fetch(k, &p, &k_rows, &c1);
                    v_next.fetch(k, &p, &v_rows, &c1);
                });
                Some(more)
            }
            None => {
                k.workgroup_barrier();
                stage_rows(k, &p, &stage, (&k_rows, &c0, p.step), 0, None);
                stage_rows(k, &p, &stage, (&v_rows, &c0, p.step), p.step, None);
                k.workgroup_barrier();
                None
            }
        };
        scores_into(k, &p, &own, &stage, (0, shift), &scratch);
        k.workgroup_barrier();
        let scores = scratch_reads(k, &p, &scratch);
        let probs_of: Vec<Expr<f32>> = (step_columns(&p).iter().zip(scores))
            .map(|(col, s)| {
                let ok = valid(k, &(&c0 + col));
                k.let_("p", select(ok, (s * &tau - m.get()).exp(), lit(0.0f32)))
            })
            .collect();
        let sum = probs_of.iter().cloned().reduce(|a, b| a + b);
        k.assign(&l, l.get() + sum.unwrap_or(lit(0.0f32)));
        tile_stores(k, &p, &probs, probs_of);
        k.workgroup_barrier();
        accumulate(k, &p, &probs, &stage, (p.step, shift), &acc);
        if let (Some(next), Some(more)) = (&kv_next, &more) {
            k.workgroup_barrier();
            k.if_(more, |k| stage_next(k, next));
            k.workgroup_barrier();
        }
    });
    let mut mask = 1;
    while mask < p.per_row {
        let l_other = k.subgroup_shuffle_xor(l.get(), mask);
        k.assign(&l, l.get() + l_other);
        mask *= 2;
    }
    if let Some((_, part_sum)) = &part_stats {
        let sum = across_parts(k, &p, Some(part_sum), l.get(), |a, b| a + b);
        k.assign(&l, sum);
    }
    let real = k.let_("real", l.get().gt(0.0f32).and(my_row.lt(&p.len)));
    // One invocation a row (of the row tile's first subgroup) writes its statistics.
    let writes = match split {
        1 => p.part.eq(0u32),
        _ => p.part.eq(0u32).and(p.sg.lt(p.subgroups)),
    };
    k.if_(writes, |k| {
        let inv_l = select(real.clone(), 1.0f32 / l.get(), lit(0.0f32));
        k.store(&row_scale, &p.row_tile * 16u32 + &p.row, inv_l);
        k.if_(my_row.lt(&p.seq_len), |k| {
            let value = select(real.clone(), m.get() + l.get().log(), lit(0.0f32));
            k.store(&lse, (&p.token0 + &my_row) * p.heads + &p.head, value);
        });
    });
    let inv_l = |r: &Expr<u32>| row_scale.at(&p.row_tile * 16u32 + r);
    store_own(
        k,
        &p,
        &acc,
        &scratch,
        &o,
        (p.heads, &p.head),
        &inv_l,
        subgroup,
    );
}

/// The backward's reads, declared first in both kernels.
struct Reads {
    q: ReadBuffer<Vec4<f32>>,
    k: ReadBuffer<Vec4<f32>>,
    v: ReadBuffer<Vec4<f32>>,
    d_out: ReadBuffer<Vec4<f32>>,
    stats: ReadBuffer<f32>,
}

fn reads(k: &mut KernelBuilder) -> Reads {
    Reads {
        q: k.storage("q"),
        k: k.storage("k"),
        v: k.storage("v"),
        d_out: k.storage("d_out"),
        stats: k.storage("stats"),
    }
}

/// `2^grad_exponent` and its inverse (the runtime parameters `grad_scale`, `grad_unscale`:
/// exact, where a division in the shader need not be).
fn grad_scales(k: &mut KernelBuilder) -> (Expr<f32>, Expr<f32>) {
    (k.param::<f32>("grad_scale"), k.param::<f32>("grad_unscale"))
}

/// `dK = τ·Σ dSᵀ·Q`, `dV = Σ Pᵀ·dO` for a block of keys of one KV head, over its `G` query heads
/// and the query steps at or after the block.
fn key_grads_body(k: &mut KernelBuilder) {
    let r = reads(k);
    let d_k = k.storage_rw::<f32>("d_k");
    let d_v = k.storage_rw::<f32>("d_v");
    let d_scores = match k.shape::<bool>("write_scores") {
        true => Some(k.storage_rw::<Vec4<F16>>("d_scores")),
        false => None,
    };
    let tau = k.param::<f32>("scale");
    let (up, down) = grad_scales(k);
    let subgroup: u32 = k.shape("subgroup");
    let split: u32 = k.shape("split");
    let p = place(k, false, split);
    let block = 16 * p.subgroups;
    let rows = block.max(p.step);
    let stage = k.workgroup_array::<Vec4<F16>>("stage", 2 * rows * p.row_vec4s());
    let all = p.subgroups * p.split;
    let scratch_vec4s = all * p.scratch_len() / 4;
    let s_scratch = k.workgroup_array::<Vec4<f32>>("s_scratch", scratch_vec4s);
    let dp_scratch = k.workgroup_array::<Vec4<f32>>("dp_scratch", scratch_vec4s);
    let probs = k.workgroup_array::<Vec4<F16>>("probs", all * p.probs_len() / 4);
    let grads = k.workgroup_array::<Vec4<F16>>("grads", all * p.probs_len() / 4);
    let q_stats = k.workgroup_array::<f32>("q_stats", 2 * p.step);
    let kv = p.head.clone();
    let k_rows = rows_of(k, &r.k, &p, p.kv_heads, &kv);
    let v_rows = rows_of(k, &r.v, &p, p.kv_heads, &kv);

    k.comment("The block's keys and values, each subgroup's 16 kept as fragments.");
    stage_rows(k, &p, &stage, (&k_rows, &p.origin, block), 0, None);
    stage_rows(k, &p, &stage, (&v_rows, &p.origin, block), rows, None);
    k.workgroup_barrier();
    let own_k = own_fragments(k, &p, &stage, 0);
    let own_v = own_fragments(k, &p, &stage, rows);
    let dk = accumulators(k, &p, "dk_acc");
    let dv = accumulators(k, &p, "dv_acc");
    let my_key = k.let_("my_key", &p.own0 + &p.row);
    let shift = p.part_shift.as_ref();

    k.comment("Query steps from the one holding the block's first key to the last real row.");
    let first = k.let_("first", &p.origin / p.step);
    let steps = k.let_("q_steps", (&p.len + (p.step - 1)) / p.step);
    k.for_range("g", 0u32, p.group, |k, g| {
        let h = k.let_("h", &kv * p.group + &g);
        let q_rows = rows_of(k, &r.q, &p, p.heads, &h);
        let do_rows = rows_of(k, &r.d_out, &p, p.heads, &h);
        // This invocation's row of `dSᵀ` (its key's), where the scores' gradients are written.
        let scores_row = d_scores.as_ref().map(|_| {
            let (square, row4) = scores_square(k, &p, &h);
            k.let_("scores_row", square + &my_key * row4)
        });
        k.for_range("q_step", &first, &steps, |k, qs| {
            let q0 = k.let_("q0", &qs * p.step);
            k.workgroup_barrier();
            stage_rows(k, &p, &stage, (&q_rows, &q0, p.step), 0, None);
            stage_rows(k, &p, &stage, (&do_rows, &q0, p.step), p.step, Some(&up));
            for i in 0..p.step.div_ceil(p.invocations) {
                let c = k.let_("stat_row", offset(&p.lid, i * p.invocations));
                k.if_(c.lt(p.step), |k| {
                    let q = (&q0 + &c).min(&p.last);
                    let at = k.let_("stat_at", ((&p.token0 + q) * p.heads + &h) * 2u32);
                    k.store(&q_stats, &c * 2u32, r.stats.at(&at));
                    k.store(&q_stats, &c * 2u32 + 1u32, r.stats.at(&at + 1u32));
                });
            }
            k.workgroup_barrier();
            scores_into(k, &p, &own_k, &stage, (0, shift), &s_scratch);
            scores_into(k, &p, &own_v, &stage, (p.step, shift), &dp_scratch);
            k.workgroup_barrier();
            // The step's columns (queries from `q0`) this invocation handles.
            let cols = step_columns(&p);
            let scores = scratch_reads(k, &p, &s_scratch);
            let dps = scratch_reads(k, &p, &dp_scratch);
            let stats: Vec<(Expr<f32>, Expr<f32>)> = (cols.iter())
                .map(|col| {
                    let lse = k.let_("lse", q_stats.at(col * 2u32));
                    (lse, k.let_("d", q_stats.at(col * 2u32 + 1u32) * &up))
                })
                .collect();
            let values: Vec<(Expr<f32>, Expr<f32>)> = (cols.iter().zip(scores))
                .zip(dps.into_iter().zip(stats))
                .map(|((col, s), (dp, (lse, d)))| {
                    let query = &q0 + col;
                    let ok = my_key
                        .le(&query)
                        .and(query.lt(&p.len))
                        .and(my_key.lt(&p.len));
                    let ok = k.let_("ok", ok);
                    let prob = select(ok.clone(), (s * &tau - lse).exp(), lit(0.0f32));
                    let prob = k.let_("p", prob);
                    // Masked entries are 0 even where `dP` is not finite (0·∞ would be NaN).
                    let ds = select(ok, prob.clone() * (dp - d) * &tau, lit(0.0f32));
                    (prob, k.let_("ds", ds))
                })
                .collect();
            let (prob, ds): (Vec<_>, Vec<_>) = values.into_iter().unzip();
            if let (Some(out), Some(row)) = (&d_scores, &scores_row) {
                // The run of queries `cols` holds, four a store (whole vec4s of the row).
                let run4 = p.cols / p.per_row / 4;
                let first = match &p.part_col0 {
                    Some(c0) => (&q0 + c0) / 4u32,
                    None => &q0 / 4u32,
                };
                let at = k.let_("scores_at", row + first + &p.part * run4);
                for (i, quad) in ds.chunks(4).enumerate() {
                    let v = vec4_of(quad.iter().map(|v| v.clone().cast::<F16>()).collect());
                    k.store(out, offset(&at, i as u32), v);
                }
            }
            tile_stores(k, &p, &probs, prob);
            tile_stores(k, &p, &grads, ds);
            k.workgroup_barrier();
            accumulate(k, &p, &probs, &stage, (p.step, shift), &dv);
            accumulate(k, &p, &grads, &stage, (0, shift), &dk);
        });
    });
    let unscale = |_: &Expr<u32>| down.clone();
    store_own(
        k,
        &p,
        &dv,
        &s_scratch,
        &d_v,
        (p.kv_heads, &kv),
        &unscale,
        subgroup,
    );
    store_own(
        k,
        &p,
        &dk,
        &s_scratch,
        &d_k,
        (p.kv_heads, &kv),
        &unscale,
        subgroup,
    );
}

/// `dQ = τ·Σ dS·K` for a block of query rows of one head, over the keys up to its last row.
fn query_grads_body(k: &mut KernelBuilder) {
    let r = reads(k);
    let d_q = k.storage_rw::<f32>("d_q");
    let tau = k.param::<f32>("scale");
    let (up, down) = grad_scales(k);
    let subgroup: u32 = k.shape("subgroup");
    let p = place(k, true, 1);
    let block = 16 * p.subgroups;
    let rows = block.max(p.step);
    let staged = query_grads_staged(rows, p.step, reads_ahead(&p, 2));
    let stage = k.workgroup_array::<Vec4<F16>>("stage", staged * p.row_vec4s());
    let scratch_vec4s = p.subgroups * p.scratch_len() / 4;
    let s_scratch = k.workgroup_array::<Vec4<f32>>("s_scratch", scratch_vec4s);
    let dp_scratch = k.workgroup_array::<Vec4<f32>>("dp_scratch", scratch_vec4s);
    let grads = k.workgroup_array::<Vec4<F16>>("grads", p.subgroups * p.probs_len() / 4);
    let kv = k.let_("kv", &p.head / p.group);
    let q_rows = rows_of(k, &r.q, &p, p.heads, &p.head);
    let do_rows = rows_of(k, &r.d_out, &p, p.heads, &p.head);
    let k_rows = rows_of(k, &r.k, &p, p.kv_heads, &kv);
    let v_rows = rows_of(k, &r.v, &p, p.kv_heads, &kv);

    k.comment("The block's query rows and their dO, each subgroup's 16 kept as fragments.");
    stage_rows(k, &p, &stage, (&q_rows, &p.origin, block), 0, None);
    stage_rows(k, &p, &stage, (&do_rows, &p.origin, block), rows, Some(&up));
    k.workgroup_barrier();
    let own_q = own_fragments(k, &p, &stage, 0);
    let own_do = own_fragments(k, &p, &stage, rows);
    let my_row = k.let_("my_row", &p.own0 + &p.row);
    let stat_at = k.let_(
        "stat_at",
        ((&p.token0 + my_row.min(&p.last)) * p.heads + &p.head) * 2u32,
    );
    let lse = k.let_("lse", r.stats.at(&stat_at));
    let d = k.let_("delta", r.stats.at(&stat_at + 1u32) * &up);
    let dq = accumulators(k, &p, "dq_acc");
    let steps = key_steps(k, &p);
    let grads_of = |k: &mut KernelBuilder, c0: &Expr<u32>| {
        let cols = my_columns(&p);
        let scores = scratch_reads(k, &p, &s_scratch);
        let dps = scratch_reads(k, &p, &dp_scratch);
        let values: Vec<Expr<f32>> = (cols.iter().zip(scores).zip(dps))
            .map(|((col, s), dp)| {
                let key = c0 + col;
                let ok = key.le(&my_row).and(key.lt(&p.len)).and(my_row.lt(&p.len));
                let ok = k.let_("ok", ok);
                let ds = (s * &tau - &lse).exp() * (dp - &d) * &tau;
                k.let_("ds", select(ok, ds, lit(0.0f32)))
            })
            .collect();
        tile_stores(k, &p, &grads, values);
    };
    if reads_ahead(&p, 2) {
        k.comment("Keys and values read a step ahead; keys staged in two buffers (rows 0 and");
        k.comment("2·step) in turn: a step's products, then its dS and the next step's staging,");
        k.comment("then its dS·K and the next step's products. Two barriers a step.");
        let k_next = ahead(k, &p, p.step, "k_next");
        let v_next = ahead(k, &p, p.step, "v_next");
        let fetch = |k: &mut KernelBuilder, c: &Expr<u32>| {
            k_next.fetch(k, &p, &k_rows, c);
            v_next.fetch(k, &p, &v_rows, c);
        };
        fetch(k, &lit(0u32));
        k.workgroup_barrier();
        k_next.stage(k, &p, (&stage, 0, None), None);
        v_next.stage(k, &p, (&stage, p.step, None), None);
        let other = 2 * p.step * p.row_vec4s();
        k.if_(lit(1u32).lt(&steps), |k| fetch(k, &lit(p.step)));
        k.workgroup_barrier();
        k.for_range("key_step", 0u32, &steps, |k, ks| {
            let c0 = k.let_("c0", &ks * p.step);
            let c2 = k.let_("c2", &c0 + 2 * p.step);
            let shift = k.let_("k_shift", (&ks % 2u32) * other);
            let next_shift = k.let_("next_shift", lit(other) - &shift);
            scores_into(k, &p, &own_q, &stage, (0, Some(&shift)), &s_scratch);
            scores_into(k, &p, &own_do, &stage, (p.step, None), &dp_scratch);
            k.workgroup_barrier();
            grads_of(k, &c0);
            k.if_((&ks + 1u32).lt(&steps), |k| {
                k_next.stage(k, &p, (&stage, 0, Some(&next_shift)), None);
                v_next.stage(k, &p, (&stage, p.step, None), None);
            });
            k.workgroup_barrier();
            k.if_((&ks + 2u32).lt(&steps), |k| fetch(k, &c2));
            accumulate(k, &p, &grads, &stage, (0, Some(&shift)), &dq);
        });
    } else {
        k.for_range("key_step", 0u32, &steps, |k, ks| {
            let c0 = k.let_("c0", &ks * p.step);
            k.workgroup_barrier();
            stage_rows(k, &p, &stage, (&k_rows, &c0, p.step), 0, None);
            stage_rows(k, &p, &stage, (&v_rows, &c0, p.step), p.step, None);
            k.workgroup_barrier();
            scores_into(k, &p, &own_q, &stage, (0, None), &s_scratch);
            scores_into(k, &p, &own_do, &stage, (p.step, None), &dp_scratch);
            k.workgroup_barrier();
            grads_of(k, &c0);
            k.workgroup_barrier();
            accumulate(k, &p, &grads, &stage, (0, None), &dq);
        });
    }
    let unscale = |_: &Expr<u32>| down.clone();
    store_own(
        k,
        &p,
        &dq,
        &s_scratch,
        &d_q,
        (p.heads, &p.head),
        &unscale,
        subgroup,
    );
}

/// `dQ = Σ dS·K` for a block of query rows of one head, over the keys up to its last row, from
/// the scores' gradients the key gradients wrote (`d_scores`: `dSᵀ` in f16, `τ` and
/// `2^grad_exponent` in it; the module doc). Each step stages its keys (f16) and the block's
/// columns of its `dSᵀ` rows, masked: a key past the query contributes 0, whatever the
/// workspace holds there. (For a query row inside the sequence's length that is every key the
/// key gradients did not write; rows past it are stored as zeros whatever they sum.) Where the
/// steps are split, each of a row tile's subgroups takes `step/split` of the staged keys into
/// its own partial `dQ`, added when stored.
fn query_grads_from_scores_body(k: &mut KernelBuilder) {
    let keys = k.storage::<Vec4<f32>>("k");
    let d_scores = k.storage::<Vec4<F16>>("d_scores");
    let d_q = k.storage_rw::<f32>("d_q");
    let down = k.param::<f32>("grad_unscale");
    let subgroup: u32 = k.shape("subgroup");
    let split: u32 = k.shape("split");
    let p = place(k, true, split);
    let block = 16 * p.subgroups;
    let stage = k.workgroup_array::<Vec4<F16>>("stage", p.step * p.row_vec4s());
    // A staged `dSᵀ` row: the block's queries, padded as the staged keys are.
    let ds_row4 = (block + PAD) / 4;
    let ds_stage = k.workgroup_array::<Vec4<F16>>("ds_stage", p.step * ds_row4);
    let all = p.subgroups * p.split;
    let scratch = k.workgroup_array::<Vec4<f32>>("scratch", all * p.scratch_len() / 4);
    let kv = k.let_("kv", &p.head / p.group);
    let k_rows = rows_of(k, &keys, &p, p.kv_heads, &kv);
    let (square, row4) = scores_square(k, &p, &p.head);
    let block_at = k.let_("block_at", &square + &p.origin / 4u32);
    let dq = accumulators(k, &p, "dq_acc");
    let steps = key_steps(k, &p);
    // `dS` is the left operand: the subgroup's 16 queries are 16 columns of the staged `dSᵀ`,
    // its part's keys (where the steps are split) its rows.
    let own_at = match &p.part_col0 {
        Some(c0) => k.let_("own_at", &p.row_tile * 4u32 + c0 * ds_row4),
        None => k.let_("own_at", &p.row_tile * 4u32),
    };
    let left = |k: &mut KernelBuilder, kk: u32| {
        let at = offset(&own_at, kk * 16 * ds_row4);
        k.coop_load::<TileA, _>(&ds_stage, at, ds_row4, Major::Column)
    };
    let quads = block / 4;
    let zero = Expr::<F16>::lit(0.0);
    k.for_range("key_step", 0u32, &steps, |k, ks| {
        let c0 = k.let_("c0", &ks * p.step);
        k.workgroup_barrier();
        stage_rows(k, &p, &stage, (&k_rows, &c0, p.step), 0, None);
        for_each_slot(k, &p, p.step * quads, |k, s| {
            let r = k.let_("r", s / quads);
            let c4 = k.let_("c4", s % quads);
            let key = k.let_("key", &c0 + &r);
            let v = k.let_("ds", d_scores.at(&block_at + &key * &row4 + &c4));
            let query = k.let_("query", &p.origin + &c4 * 4u32);
            let lanes = (0..4)
                .map(|q| select(key.le(offset(&query, q)), lane(&v, q), zero.clone()))
                .collect();
            k.store(&ds_stage, &r * ds_row4 + &c4, vec4_of(lanes));
        });
        k.workgroup_barrier();
        accumulate_from(k, &p, &left, &stage, (0, p.part_shift.as_ref()), &dq);
    });
    let unscale = |_: &Expr<u32>| down.clone();
    store_own(
        k,
        &p,
        &dq,
        &scratch,
        &d_q,
        (p.heads, &p.head),
        &unscale,
        subgroup,
    );
}

/// The WGSL of this module's kernels at a representative shape (SmolLM2's heads, padded
/// batches, 2 subgroups of 32 stepping 32 rows: within the default limits' workgroup memory):
/// the forward, the key gradients, the query gradients, then the key gradients that write the
/// scores' gradients and the query gradients from them, and last the key gradients writing the
/// scores' gradients and the forward with each step split between two subgroups a row tile.
pub fn kernels() -> Result<Vec<Kernel>, hesper_dsl::DslError> {
    let shape = SeqShape::new(2, 128, 9, 3, 64);
    let tile = CoopSeqTile {
        subgroups: 2,
        step: 32,
        split: 1,
    };
    let split = CoopSeqTile { split: 2, ..tile };
    [
        (Which::Forward, tile),
        (
            Which::KeyGrads {
                write_scores: false,
            },
            tile,
        ),
        (Which::QueryGrads, tile),
        (Which::KeyGrads { write_scores: true }, tile),
        (Which::QueryGradsFromScores, tile),
        (Which::KeyGrads { write_scores: true }, split),
        (Which::Forward, split),
    ]
    .into_iter()
    .map(|(which, tile)| Kernel::build(&key(which, &shape, tile, 32, true), which.body()))
    .collect()
}

/// Each kernel of this module at any shape and tile, within `limits`, for [`crate::catalog`].
pub(crate) mod build {
    use super::*;
    use crate::catalog::Failure;

    /// `coop_attention_forward`, `coop_attention_backward_kv`, `coop_attention_backward_q` or
    /// `coop_attention_backward_q_from_scores`, the shape and tile checked first.
    pub(crate) fn kernel(
        which: Which,
        (head_dim, heads, kv_heads): (u32, u32, u32),
        (tile, subgroup): (CoopSeqTile, u32),
        padded: bool,
        limits: &Limits,
    ) -> Result<Kernel, Failure> {
        let name = which.name();
        let shape = SeqShape::new(1, 1, heads as usize, kv_heads as usize, head_dim as usize);
        shape.check(name)?;
        let rule = |why: &str| {
            Err(Failure::rule(
                format!("{tile:?}, subgroup {subgroup}"),
                why.into(),
            ))
        };
        if !head_dim.is_multiple_of(16) {
            return Err(Failure::rule(
                format!("head_dim = {head_dim}"),
                "the tensor-core kernels take head dimensions that are multiples of 16".into(),
            ));
        }
        if !(16..=128).contains(&subgroup) || !subgroup.is_power_of_two() {
            return rule("the subgroup must be 16, 32, 64 or 128 invocations");
        }
        if let Some(why) = tile.rule(which, subgroup) {
            return rule(&why);
        }
        let key = key(which, &shape, tile, subgroup, padded);
        Ok(Kernel::build_with_limits(&key, limits, which.body())?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every standard tile of every kernel builds, at hd 64 and 128 with subgroups of 32,
    /// within the workgroup memory `workgroup_bytes` says (what `for_device` chooses by).
    #[test]
    fn standard_tiles_use_the_workgroup_memory_they_say() {
        let limits = Limits {
            max_workgroup_storage_bytes: 64 * 1024,
            ..Limits::default()
        };
        let kinds = [
            Which::Forward,
            Which::KeyGrads {
                write_scores: false,
            },
            Which::KeyGrads { write_scores: true },
            Which::QueryGrads,
            Which::QueryGradsFromScores,
        ];
        for which in kinds {
            for hd in [64, 128] {
                let shape = SeqShape::new(1, 128, 4, 2, hd as usize);
                for &(subgroups, step, split) in CoopSeqTile::standard(which) {
                    let tile = CoopSeqTile {
                        subgroups,
                        step,
                        split,
                    };
                    let key = key(which, &shape, tile, 32, true);
                    let kernel = Kernel::build_with_limits(&key, &limits, which.body()).unwrap();
                    let used = kernel.workgroup_memory_bytes();
                    let said = tile.workgroup_bytes(which, hd, 32);
                    assert!(used <= said, "{key}: {used} bytes, {said} said");
                }
            }
        }
    }
}
