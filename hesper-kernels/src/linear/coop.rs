//! The linear GEMM on tensor cores: `out[m, cols] (+)= s·A[m, depth]·B(depth, cols)` with f16
//! inputs (f16 buffers, or f32 rounded to f16 as they are staged) multiplied by cooperative
//! matrices and accumulated in f32, out in f32 or f16. `B` is read out of `W` as the module's
//! products say (`·Wᵀ`: `W: [cols, depth]`; `·W`: `W: [depth, cols]`).
//!
//! ## Tiling
//! A workgroup computes a `bm × bn` tile of `out`; each of its subgroups a `wm × wn` part of it,
//! as `(wm/16)·(wn/16)` accumulators of 16×16. A step stages `bk` of the depth: `A`'s `bm × bk`
//! slice row by row, `B`'s as `W` holds it (rows of `W` along the depth for `·Wᵀ`, so `B` is
//! loaded column-major; rows along the columns for `·W`, row-major), in workgroup memory as
//! `vec4<f16>` with 8 halves of padding a row (against bank conflicts). Each invocation reads
//! the next step's vec4s into registers while the tensor cores work on this one, and computes
//! nothing from them (rounding, prologue) until it stages them. The H200's compiler is
//! sensitive to how this loop is written (BENCHMARKS.md "Tensor cores, second pass"): the
//! choices below that look arbitrary were measured.
//!
//! ## Edges
//! Rows past `m`, columns past `cols` and depth past `depth` are loaded as zeros (from a
//! clamped index: no read leaves its buffer), so the products there are zero and never stored.
//! A workgroup whose tile lies inside `out` stores its accumulators straight into it (f32 out,
//! `cols` a multiple of 4); the others, and every f16 output, go through workgroup memory a
//! 16×16 tile at a time and store element by element under a bounds check.

use hesper_dsl::prelude::*;
use hesper_dsl::{ReadBuffer, RwBuffer, Var, WorkgroupArray};
use hesper_exec::{ExecError, Gpu};

use super::fusion::{ElementFn, Fusion, LowRankBuilt};
use super::{HalfBuffers, Product};
use crate::bad_tile;

type TileA = CoopMat<F16, CoopA>;
type TileB = CoopMat<F16, CoopB>;
type Acc = CoopMat<f32, CoopC>;

/// Halves of padding after each staged row.
const PAD: u32 = 8;

/// A tensor-core GEMM's tile: `bm × bn` outputs per workgroup, `bk` of the depth per step,
/// `wm × wn` per subgroup (multiples of 16). [`CoopTile::check`] says which rule a tile breaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CoopTile {
    pub bm: u32,
    pub bn: u32,
    pub bk: u32,
    pub wm: u32,
    pub wn: u32,
}

impl CoopTile {
    /// 128×256 outputs, 32 deep, 64×64 a subgroup: 8 subgroups (the reference probe's fastest
    /// tile, 270 TFLOP/s at 8192³ on the H200).
    pub const LARGE: CoopTile = CoopTile {
        bm: 128,
        bn: 256,
        bk: 32,
        wm: 64,
        wn: 64,
    };
    /// 128×192, 48 deep, 64×64 a subgroup: 6 subgroups. For outputs 576 (3·192) or 1536
    /// (8·192) wide, SmolLM2's, where `LARGE`'s last column of tiles is a quarter full (and
    /// stored through workgroup memory): on the H100 the q and o projections' `·Wᵀ` took 29.1
    /// µs with it against 33.2 with the tile chosen before (BENCHMARKS.md, "The FFN's `h` in
    /// f16"). 48 deep so that six subgroups share a step's vec4s evenly.
    pub const WIDE: CoopTile = CoopTile {
        bm: 128,
        bn: 192,
        bk: 48,
        wm: 64,
        wn: 64,
    };
    /// `WIDE`'s 128×192×48 in twelve subgroups of 32×64 (384 invocations): half the
    /// accumulators an invocation, twice the subgroups to hide the reads behind. On the H100
    /// the q and o projections' `·Wᵀ` took 25.2 µs with it against `WIDE`'s 28.6, their `·W`
    /// 24.0 against 28.1, and the input gradient through q, k and v (`·W` over a depth of
    /// 960) 33.3 against 39.5 (BENCHMARKS.md, "Twelve subgroups").
    pub const WIDE_12: CoopTile = CoopTile {
        bm: 128,
        bn: 192,
        bk: 48,
        wm: 32,
        wn: 64,
    };
    /// 128×128, 32 deep, 64×32 a subgroup: 8 subgroups.
    pub const MEDIUM: CoopTile = CoopTile {
        bm: 128,
        bn: 128,
        bk: 32,
        wm: 64,
        wn: 32,
    };
    /// 128×64, 32 deep, 64×32 a subgroup: 4 subgroups.
    pub const TALL: CoopTile = CoopTile {
        bm: 128,
        bn: 64,
        bk: 32,
        wm: 64,
        wn: 32,
    };
    /// 64×64, 32 deep, 32×32 a subgroup: 4 subgroups (narrow layers: more workgroups).
    pub const SMALL: CoopTile = CoopTile {
        bm: 64,
        bn: 64,
        bk: 32,
        wm: 32,
        wn: 32,
    };
    /// 64×32, 32 deep, 32×16 a subgroup: 4 subgroups (the narrowest layers).
    pub const NARROW: CoopTile = CoopTile {
        bm: 64,
        bn: 32,
        bk: 32,
        wm: 32,
        wn: 16,
    };

    /// Subgroups per workgroup.
    pub fn subgroups(&self) -> u32 {
        (self.bm / self.wm.max(1)) * (self.bn / self.wn.max(1))
    }

    /// Bytes of workgroup memory: the staged slices and a 16×16 f32 tile per subgroup.
    pub fn workgroup_bytes(&self) -> u32 {
        let a = self.bm * (self.bk + PAD);
        let b = (self.bn * (self.bk + PAD)).max(self.bk * (self.bn + PAD));
        2 * (a + b) + 4 * 256 * self.subgroups()
    }

    /// `Ok` when the kernels can run this tile with `subgroup_size` invocations a subgroup;
    /// else an error naming `kernel` and the rule.
    pub fn check(&self, kernel: &str, subgroup_size: u32) -> Result<(), ExecError> {
        let CoopTile { bm, bn, bk, wm, wn } = *self;
        let fail = |why: &str| Err(bad_tile(kernel, self, why));
        let divides = |w: u32, b: u32| w > 0 && w.is_multiple_of(16) && b.is_multiple_of(w);
        if !divides(wm, bm) || !divides(wn, bn) || bk == 0 || !bk.is_multiple_of(16) {
            return fail(
                "wm and wn must be multiples of 16 dividing bm and bn; bk a multiple of 16",
            );
        }
        let threads = self.subgroups() as u64 * subgroup_size as u64;
        let shared = |vec4s: u64| vec4s > 0 && vec4s.is_multiple_of(threads);
        if !shared(bm as u64 * bk as u64 / 4) || !shared(bn as u64 * bk as u64 / 4) {
            return fail(
                "the invocations must share out the bm·bk/4 and bn·bk/4 vec4s of a step evenly",
            );
        }
        if !threads.is_multiple_of(bk as u64 / 4) || !threads.is_multiple_of(bn as u64 / 4) {
            return fail("the invocations must cover whole staged rows: bk/4 and bn/4 divide them");
        }
        Ok(())
    }
}

/// The most parts a split GEMM cuts its depth into.
pub const MAX_SPLITS: u32 = 16;
/// Workgroups a split GEMM aims for at most: four for each of the H200's 132 multiprocessors.
const SPLIT_WORKGROUPS: usize = 4 * 132;
/// The fewest steps of the depth a part keeps (its first step's staging and its store of a
/// whole output slice are paid once a part).
const SPLIT_MIN_STEPS: u32 = 32;

/// `Ok` when a GEMM can cut its depth into `splits` parts (1: not split); else the rule.
pub(crate) fn check_splits(
    splits: u32,
    depth: u32,
    bk: u32,
    (accumulate, f16_out): (bool, bool),
) -> Result<(), &'static str> {
    match splits {
        0 => Err("at least 1"),
        1 => Ok(()),
        s if s > MAX_SPLITS => Err("at most 16"),
        _ if accumulate || f16_out => Err(
            "1 for an accumulating GEMM or an f16 output (the parts are f32 slices, added \
             by `gemm_split_sum`)",
        ),
        s if s
            .checked_mul(bk)
            .is_none_or(|step| !depth.is_multiple_of(step)) =>
        {
            Err("a count that cuts the depth into whole steps (depth a multiple of splits·bk)")
        }
        _ => Ok(()),
    }
}

/// Parts to cut a GEMM's depth into (split-K), for an output of `tiles` workgroups' tiles: 1
/// when the tiles already give each of ~132 multiprocessors (the H200's) a workgroup; else
/// the most (a power of two up to [`MAX_SPLITS`]) that keeps the grid within four workgroups
/// a multiprocessor and each part at least 32 whole steps. The lm-head's `·W` over a chunk of
/// 1024 tokens (24 tiles of 128×192 or of 128×256, 49 152 deep) takes 16.
pub fn splits_for(tiles: usize, depth: u32, bk: u32) -> u32 {
    if tiles >= 132 || bk == 0 {
        return 1;
    }
    [16u32, 8, 4, 2]
        .into_iter()
        .find(|&s| {
            let part = s.saturating_mul(bk);
            depth.is_multiple_of(part)
                && depth / part >= SPLIT_MIN_STEPS
                && tiles * s as usize <= SPLIT_WORKGROUPS
        })
        .unwrap_or(1)
}

pub(crate) fn kernel_name(product: Product) -> &'static str {
    match product {
        Product::Nt => "coop_matmul_nt",
        Product::Nn => "coop_matmul_nn",
    }
}

/// The kernel key: the product's widths, the tile, the subgroup size the workgroup is laid out
/// for, the element types, `accumulate` and the depth's `splits` (1: none; [`splits_for`]); `m`
/// and the scale are runtime.
pub(crate) fn key(
    product: Product,
    (cols, depth): (u32, u32),
    tile: CoopTile,
    subgroup_size: u32,
    types: HalfBuffers,
    (accumulate, splits): (bool, u32),
) -> KernelKey {
    KernelKey::new(kernel_name(product))
        .workgroup_size(tile.subgroups() * subgroup_size)
        .features(Features::COOPERATIVE_MATRIX | Features::SUBGROUPS)
        .shape("cols", cols)
        .shape("depth", depth)
        .shape("bm", tile.bm)
        .shape("bn", tile.bn)
        .shape("bk", tile.bk)
        .shape("wm", tile.wm)
        .shape("wn", tile.wn)
        .shape("subgroup", subgroup_size)
        .shape("input_f16", types.input)
        .shape("weight_f16", types.weight)
        .shape("output_f16", types.output)
        .shape("accumulate", accumulate)
        .shape("splits", splits)
        // Every index is clamped into its buffer or guarded, and tile indices are in range by
        // construction: no runtime bounds checks (+59% on the probe's tile).
        .assume_in_bounds()
}

/// The most blocks a block-major input ([`super::execute_gemm_blocks`]) or output
/// ([`super::execute_gemm_output_blocks`]) is cut into.
pub const MAX_INPUT_BLOCKS: usize = 4;

/// The widths of `blocks` up to its first zero ([`Launch::input_blocks`],
/// [`Launch::output_blocks`]).
pub(crate) fn used_blocks(blocks: &[u32; MAX_INPUT_BLOCKS]) -> &[u32] {
    let n = blocks.iter().take_while(|&&w| w > 0).count();
    &blocks[..n]
}

/// `key` with an operand's blocks (`operand`: "input" along the depth, "output" along the
/// columns) where it has more than one (a row-major operand keeps its key and WGSL).
fn with_blocks(key: KernelKey, operand: &str, blocks: &[u32]) -> KernelKey {
    match blocks.len() {
        0 | 1 => key,
        n => blocks.iter().enumerate().fold(
            key.shape(format!("{operand}_blocks"), n as u32),
            |key, (i, &width)| key.shape(format!("{operand}_block{i}"), width),
        ),
    }
}

/// An operand's blocks as the key holds them ([`with_blocks`]): each one's first column and
/// width (none: row-major).
fn blocks_of(k: &KernelBuilder, operand: &str) -> Vec<(u32, u32)> {
    let get = |name: &str| match k.key().get(name) {
        Some(hesper_dsl::ShapeValue::U32(v)) => Some(v),
        _ => None,
    };
    let count = get(&format!("{operand}_blocks")).unwrap_or(0);
    let mut start = 0;
    (0..count)
        .map_while(|i| {
            let width = get(&format!("{operand}_block{i}"))?;
            let block = (start, width);
            start += width;
            Some(block)
        })
        .collect()
}

/// A block-major input as its reads address it: each block's first column and width along the
/// depth, and `rows − 1` (block `b` starts at element `rows·start_b` of the buffer).
struct Blocks {
    spans: Vec<(u32, u32)>,
    rows_less_one: Expr<u32>,
}

/// Where a staged operand comes from: f16 or f32 (rounded to f16 when it is staged, after a
/// multiply by the scale where there is one), four elements at once when its rows are a
/// multiple of 4 long, else one by one.
enum Source {
    Vec4F16(ReadBuffer<Vec4<F16>>),
    Vec4F32(ReadBuffer<Vec4<f32>>, Option<Expr<f32>>),
    F16(ReadBuffer<F16>),
    F32(ReadBuffer<f32>, Option<Expr<f32>>),
}

/// Four elements of a slot between their read and their staging, as the source holds them.
/// Nothing is computed from a read until it is staged: the tensor cores' work on the current
/// step hides the read's latency only if no instruction waits for it before (an f32 input
/// rounded as it was read made the gate projection's GEMM 16% slower on the H200).
enum Raw {
    F16(Var<Vec4<F16>>),
    F32(Var<Vec4<f32>>),
}

impl Source {
    /// `scale`: f32 elements are multiplied by it before they are rounded.
    fn declare(
        k: &mut KernelBuilder,
        name: &str,
        (f16, vec4): (bool, bool),
        scale: Option<Expr<f32>>,
    ) -> Source {
        match (f16, vec4) {
            (true, true) => Source::Vec4F16(k.storage(name)),
            (false, true) => Source::Vec4F32(k.storage(name), scale),
            (true, false) => Source::F16(k.storage(name)),
            (false, false) => Source::F32(k.storage(name), scale),
        }
    }

    fn is_vec4(&self) -> bool {
        matches!(self, Source::Vec4F16(_) | Source::Vec4F32(..))
    }

    /// A register for one slot's four elements.
    fn raw(&self, k: &mut KernelBuilder, name: &str) -> Raw {
        match self {
            Source::Vec4F16(_) | Source::F16(_) => {
                Raw::F16(k.var(name, Expr::<Vec4<F16>>::splat(Expr::<F16>::lit(0.0))))
            }
            Source::Vec4F32(..) | Source::F32(..) => {
                Raw::F32(k.var(name, Expr::<Vec4<f32>>::splat(lit(0.0f32))))
            }
        }
    }

    /// Reads four elements into `raw`: on the vec4 paths the vec4 at index `at[0]` (counted
    /// in vec4s), else the elements at the four indices `at`.
    fn load(&self, k: &mut KernelBuilder, at: &[Expr<u32>], raw: &Raw) {
        let scalar = |q: usize| at[q].clone();
        match (self, raw) {
            (Source::Vec4F16(buf), Raw::F16(v)) => k.assign(v, buf.at(&at[0])),
            (Source::Vec4F32(buf, _), Raw::F32(v)) => k.assign(v, buf.at(&at[0])),
            (Source::F16(buf), Raw::F16(v)) => k.assign(
                v,
                super::vec4_of((0..4).map(|q| buf.at(scalar(q))).collect()),
            ),
            (Source::F32(buf, _), Raw::F32(v)) => k.assign(
                v,
                super::vec4_of((0..4).map(|q| buf.at(scalar(q))).collect()),
            ),
            _ => unreachable!("a slot's register has its source's element type"),
        }
    }

    /// The four elements of `raw` as staged: each through `prologue` (lane, value) in f32
    /// first, multiplied by the scale (f32 sources), rounded to f16, zero where `valid(q)`
    /// fails (on the vec4 paths `valid(0)` speaks for all four).
    fn finish(
        &self,
        k: &mut KernelBuilder,
        raw: &Raw,
        valid: &Validity,
        prologue: Option<&LaneFn>,
    ) -> Expr<Vec4<F16>> {
        let zero = Expr::<F16>::lit(0.0);
        let scale = match self {
            Source::Vec4F32(_, s) | Source::F32(_, s) => s.clone(),
            Source::Vec4F16(_) | Source::F16(_) => None,
        };
        let scaled = |v: Expr<f32>| match &scale {
            Some(s) => v * s,
            None => v,
        };
        let Some(prologue) = prologue else {
            let v = match raw {
                Raw::F16(v) => v.get(),
                Raw::F32(v) => {
                    let v = match &scale {
                        Some(s) => v.get() * Expr::<Vec4<f32>>::splat(s.clone()),
                        None => v.get(),
                    };
                    v.cast::<Vec4<F16>>()
                }
            };
            if self.is_vec4() {
                return match valid(0) {
                    Some(ok) => select(ok, v, Expr::<Vec4<F16>>::splat(zero)),
                    None => v,
                };
            }
            let lanes = (0..4).map(|q| match valid(q) {
                Some(ok) => select(ok, super::lane(&v, q), zero.clone()),
                None => super::lane(&v, q),
            });
            return super::vec4_of(lanes.collect());
        };
        let raw = match raw {
            Raw::F16(v) => v.get().cast::<Vec4<f32>>(),
            Raw::F32(v) => v.get(),
        };
        let raw = k.let_("fused_in", raw);
        let lanes: Vec<Expr<F16>> = (0..4)
            .map(|q| {
                let v = prologue(k, q, super::lane(&raw, q));
                let v = k.let_("fused", scaled(v).cast::<F16>());
                // The vec4 paths' `valid(0)` speaks for all four lanes.
                let ok = if self.is_vec4() { valid(0) } else { valid(q) };
                match ok {
                    Some(ok) => select(ok, v, zero.clone()),
                    None => v,
                }
            })
            .collect();
        super::vec4_of(lanes)
    }
}

/// Whether lane `q` of a read is within the depth (`None`: always).
type Validity<'a> = dyn Fn(u32) -> Option<Expr<bool>> + 'a;

/// A prologue at one slot: `(lane, value) → value`, the slot's row and depth bound.
type LaneFn<'a> = dyn Fn(&mut KernelBuilder, u32, Expr<f32>) -> Expr<f32> + 'a;

/// One vec4 of a step's slice that this invocation stages: row `row` of the staged slice, vec4
/// `c4` along it, read from index `at` at depth 0 (+ the step's offset), held in `next`
/// between the read and the staging.
struct Slot {
    row: Expr<u32>,
    c4: Expr<u32>,
    /// With [`Addressing::Vec4s`], one index counted in vec4s; else the element index (one on
    /// the vec4 paths, four otherwise), clamped where it may pass the operand.
    at: Vec<Expr<u32>>,
    next: Raw,
    /// The operand's row in memory, where a prologue needs it.
    source_row: Option<Expr<u32>>,
}

/// Which way an operand's rows run in memory.
#[derive(Clone, Copy, PartialEq)]
enum Along {
    /// `[rows, depth]`: `A`, and `W` read through `·Wᵀ`. A slice is `rows × bk`.
    Depth,
    /// `[depth, cols]`: `W` read through `·W`. A slice is `bk × cols`.
    Columns,
}

/// How a slot's reads are indexed.
#[derive(Clone, Copy, PartialEq)]
enum Addressing {
    /// Element indices, each slot's row clamped into the operand, every read clamped to the
    /// buffer where the depth is ragged: any operand, any shape.
    Clamped,
    /// One index a invocation counted in vec4s, each slot a constant past it: `W` through
    /// `·W` (its column, clamped once, is every slot's) from vec4s, the depth a whole number
    /// of steps. On the H200 (BENCHMARKS.md "Tensor cores, second pass") the lm-head's `·W`
    /// GEMM took 1478 µs against 2220 with clamped indices, the gate projection's 58.3 against
    /// 67.6. The same addressing for the operands along the depth, in the tiles inside the
    /// output, was slower there (the 8192³ `·W` GEMM 228 against 274 TFLOP/s): not used.
    Vec4s,
}

/// How one operand's slices are read. The dimension that is not the depth (`A`'s rows, the
/// output's columns) starts at `origin` and is clamped to `fixed_last`: what lies past it only
/// feeds outputs that are never stored. The depth past `depth` is zero (it feeds every output).
struct Staged<'a> {
    source: &'a Source,
    along: Along,
    origin: &'a Expr<u32>,
    fixed_last: Expr<u32>,
    /// Elements a row of the operand in memory.
    width: u32,
    /// Runs on each element read (`A` only: rows along the depth).
    prologue: Option<&'a ElementFn>,
    depth: u32,
    /// The depth is not a multiple of the step: the last step passes it.
    partial: bool,
    /// The buffer's last element (reads are clamped to it where they may pass it).
    last: Expr<u32>,
    /// `A` held block-major along the depth (every block a whole number of steps).
    blocks: Option<&'a Blocks>,
}

impl Staged<'_> {
    /// How this operand's reads are indexed.
    fn addressing(&self) -> Addressing {
        match self.along == Along::Columns && self.source.is_vec4() && !self.partial {
            true => Addressing::Vec4s,
            false => Addressing::Clamped,
        }
    }

    /// The slots of this operand's slice (`rows × width` halves staged, shared by `threads`
    /// invocations), their loop-invariant read positions computed once.
    fn slots(
        &self,
        k: &mut KernelBuilder,
        operand: &str,
        (rows, width): (u32, u32),
        threads: u32,
    ) -> Vec<Slot> {
        let addressing = self.addressing();
        let lid = k.local_index();
        let per_row = width / 4;
        // Invocations cover whole rows of the slice per round (CoopTile::check): every slot's
        // position is the first's plus constants.
        let rows_per_round = threads / per_row;
        let row0 = k.let_(&format!("{operand}_row"), &lid / per_row);
        let c4 = k.let_(&format!("{operand}_c4"), &lid % per_row);
        let col0 = k.let_(&format!("{operand}_col"), &c4 * 4u32);
        let vec4_base = (addressing == Addressing::Vec4s).then(|| {
            let column = (self.origin + &col0).min(&self.fixed_last) / 4u32;
            k.let_(&format!("{operand}_at"), &row0 * (self.width / 4) + column)
        });
        (0..rows * per_row / threads)
            .map(|i| {
                let row = super::offset(&row0, i * rows_per_round);
                let mut source_row = None;
                let at = match (&vec4_base, self.along) {
                    (Some(base), _) => {
                        vec![super::offset(base, i * rows_per_round * (self.width / 4))]
                    }
                    (None, Along::Depth) if self.blocks.is_some() => {
                        // The row's start depends on the step's block: computed as it is read.
                        let r = (self.origin + &row).min(&self.fixed_last);
                        source_row = Some(k.let_(&format!("{operand}_source_row"), r));
                        vec![col0.clone()]
                    }
                    (None, Along::Depth) => {
                        let mut r = (self.origin + &row).min(&self.fixed_last);
                        if self.prologue.is_some() {
                            r = k.let_(&format!("{operand}_source_row"), r);
                            source_row = Some(r.clone());
                        }
                        vec![k.let_(&format!("{operand}_base"), r * self.width + &col0)]
                    }
                    (None, Along::Columns) => {
                        let lanes = if self.source.is_vec4() { 1 } else { 4 };
                        (0..lanes)
                            .map(|q| {
                                let c = super::offset(&(self.origin + &col0), q);
                                let c = c.min(&self.fixed_last);
                                k.let_(&format!("{operand}_base"), &row * self.width + c)
                            })
                            .collect()
                    }
                };
                Slot {
                    row,
                    c4: c4.clone(),
                    at,
                    next: self.source.raw(k, &format!("{operand}_next")),
                    source_row,
                }
            })
            .collect()
    }

    /// Read each slot's four elements for the step starting at depth `d0` into its register.
    fn fetch(&self, k: &mut KernelBuilder, slots: &[Slot], d0: &Expr<u32>) {
        let addressing = self.addressing();
        // Block-major: the step lies in one block (`start`, `width`); element `(r, d)` of it is
        // at `rows·start + r·width + (d − start)` = `r·width + d + start·(rows − 1)`.
        let block_width = self.blocks.map(|b| {
            let (mut width, mut start) = (lit(b.spans[0].1), lit(0u32));
            for &(s, w) in &b.spans[1..] {
                let inside = d0.ge(s);
                width = select(inside.clone(), w, width);
                start = select(inside, s, start);
            }
            let width = k.let_("block_width", width);
            let d0 = k.let_("block_d0", d0 + start * &b.rows_less_one);
            (width, d0)
        });
        let step = match (self.along, addressing, &block_width) {
            (Along::Depth, _, Some((_, d0))) => d0.clone(),
            (Along::Depth, _, None) => d0.clone(),
            (Along::Columns, Addressing::Vec4s, _) => k.let_("d0_offset", d0 * (self.width / 4)),
            (Along::Columns, Addressing::Clamped, _) => k.let_("d0_offset", d0 * self.width),
        };
        let clamp = |i: Expr<u32>| match self.partial {
            true => i.min(&self.last),
            false => i,
        };
        for slot in slots {
            let step = match (&block_width, &slot.source_row) {
                (Some((width, _)), Some(row)) => row * width + &step,
                _ => step.clone(),
            };
            let at: Vec<Expr<u32>> = match (&slot.at[..], addressing, self.source.is_vec4()) {
                ([at], Addressing::Vec4s, _) => vec![at + &step],
                ([base], Addressing::Clamped, true) => vec![clamp(base + &step) / 4u32],
                ([base], Addressing::Clamped, false) => (0..4)
                    .map(|q| clamp(super::offset(&(base + &step), q)))
                    .collect(),
                (bases, _, _) => bases.iter().map(|b| clamp(b + &step)).collect(),
            };
            let at: Vec<Expr<u32>> = at
                .into_iter()
                .map(|i| match self.source.is_vec4() {
                    true => i,
                    false => k.let_("at", i),
                })
                .collect();
            self.source.load(k, &at, &slot.next);
        }
    }

    /// Store each slot's four elements, for the step starting at depth `d0`, into `tile` as
    /// f16 (rows `stride` halves apart), each through the prologue, scaled and rounded.
    fn stage(
        &self,
        k: &mut KernelBuilder,
        slots: &[Slot],
        d0: &Expr<u32>,
        (tile, stride): (&WorkgroupArray<Vec4<F16>>, u32),
    ) {
        for slot in slots {
            let (depth, partial) = (self.depth, self.partial);
            let valid = |q: u32| {
                partial.then(|| match self.along {
                    Along::Depth => super::offset(&(d0 + &slot.c4 * 4u32), q).lt(depth),
                    Along::Columns => (d0 + &slot.row).lt(depth),
                })
            };
            // The prologue sees the element's row and depth (clamped: a lane past the depth
            // is zeroed after it).
            let prologue = match (self.prologue, &slot.source_row) {
                (Some(f), Some(row)) => {
                    let d = k.let_("fused_d", d0 + &slot.c4 * 4u32);
                    Some(
                        Box::new(move |k: &mut KernelBuilder, q: u32, v: Expr<f32>| {
                            let col = super::offset(&d, q);
                            let col = if partial { col.min(depth - 1) } else { col };
                            f(k, row, &col, v)
                        }) as Box<LaneFn>,
                    )
                }
                _ => None,
            };
            let value = self
                .source
                .finish(k, &slot.next, &valid, prologue.as_deref());
            k.store(tile, &slot.row * (stride / 4) + &slot.c4, value);
        }
    }
}

/// The output buffer: f32 or f16 elements.
enum Output {
    F32(RwBuffer<f32>),
    F16(RwBuffer<F16>),
}

/// `out[m, cols] (+)= s·A[m, depth]·B(depth, cols)` on cooperative matrices (the module doc),
/// with `fusion`'s code on `A`'s elements and the output's.
pub(crate) fn kernel(k: &mut KernelBuilder, product: Product, fusion: &Fusion<'_>) {
    let cols = k.shape::<u32>("cols");
    let depth = k.shape::<u32>("depth");
    let tile = CoopTile {
        bm: k.shape("bm"),
        bn: k.shape("bn"),
        bk: k.shape("bk"),
        wm: k.shape("wm"),
        wn: k.shape("wn"),
    };
    let subgroup = k.shape::<u32>("subgroup");
    let types = HalfBuffers {
        input: k.shape("input_f16"),
        weight: k.shape("weight_f16"),
        output: k.shape("output_f16"),
    };
    let accumulate = k.shape::<bool>("accumulate");
    let splits = k.shape::<u32>("splits");
    let (input_name, output_name) = product.names();
    if cols == 0 || depth == 0 || cols.checked_mul(depth).is_none() {
        k.error(hesper_dsl::ErrorKind::TypeMismatch {
            item: "shape `cols` × `depth`".into(),
            expected: "at least 1 each, the weight's elements within u32".into(),
            found: format!("{cols} × {depth}"),
        });
        return;
    }
    if let Err(why) = check_splits(splits, depth, tile.bk, (accumulate, types.output)) {
        k.error(hesper_dsl::ErrorKind::TypeMismatch {
            item: "shape `splits`".into(),
            expected: why.into(),
            found: format!("{splits} (depth {depth}, bk {})", tile.bk),
        });
        return;
    }
    if splits > 1 && !fusion.epilogues.is_empty() {
        k.error(hesper_dsl::ErrorKind::TypeMismatch {
            item: "shape `splits`".into(),
            expected: "1 for a GEMM with epilogues (a part of the depth has no whole output)"
                .into(),
            found: splits.to_string(),
        });
        return;
    }

    let input_blocks = blocks_of(k, "input");
    if !input_blocks.is_empty() {
        let widths: Vec<u32> = input_blocks.iter().map(|&(_, w)| w).collect();
        let whole = input_blocks
            .iter()
            .all(|&(_, w)| w > 0 && w.is_multiple_of(tile.bk));
        if !whole || widths.iter().sum::<u32>() != depth || fusion.prologue.is_some() {
            k.error(hesper_dsl::ErrorKind::TypeMismatch {
                item: "shape `input_blocks`".into(),
                expected: format!(
                    "widths, each a multiple of bk = {}, that add up to the depth {depth}, and no prologue",
                    tile.bk
                ),
                found: format!("{widths:?}"),
            });
            return;
        }
    }
    let output_blocks = blocks_of(k, "output");
    if !output_blocks.is_empty() {
        let widths: Vec<u32> = output_blocks.iter().map(|&(_, w)| w).collect();
        let whole = output_blocks
            .iter()
            .all(|&(_, w)| w > 0 && w.is_multiple_of(tile.bn));
        let adds = fusion.adds_matrices();
        if !whole || widths.iter().sum::<u32>() != cols || splits > 1 || adds {
            k.error(hesper_dsl::ErrorKind::TypeMismatch {
                item: "shape `output_blocks`".into(),
                expected: format!(
                    "widths, each a multiple of bn = {}, that add up to the columns {cols}, \
                     no split and no added matrix",
                    tile.bn
                ),
                found: format!("{widths:?}"),
            });
            return;
        }
    }

    // Rows of `A` (and of `W` through `·Wᵀ`) run along the depth; of `W` through `·W`, along
    // the columns.
    let w_width = match product {
        Product::Nt => depth,
        Product::Nn => cols,
    };
    let a_vec4 = depth.is_multiple_of(4);
    // An f32 input is scaled (by a power of two, `Gemm::input_exponent`) before it is rounded.
    let input_scale = (!types.input).then(|| k.param::<f32>("input_scale"));
    let a = Source::declare(k, input_name, (types.input, a_vec4), input_scale.clone());
    let w_vec4 = w_width.is_multiple_of(4);
    let w = Source::declare(k, "w", (types.weight, w_vec4), None);
    let out = match types.output {
        true => Output::F16(k.storage_rw(output_name)),
        false => Output::F32(k.storage_rw(output_name)),
    };
    let rows = k.param::<u32>("rows");
    let scale = k.param::<f32>("scale");
    let fused = fusion.build(k, (cols, depth), Some((tile.bk, tile.bn)));

    let threads = tile.subgroups() * subgroup;
    let sg = k.let_("sg", k.subgroup_id());
    let (m0, n0) = tile_origin(k, &rows, cols, &tile);
    // Split: the grid's layer `z` sums part `z` of the depth into slice `z` of `out`.
    let split = (splits > 1).then(|| {
        let z = k.let_("split", k.workgroup_id().z());
        let d0 = k.let_("split_d0", &z * (depth / splits));
        let slice = (&rows * cols + 3u32) / 4u32 * 4u32;
        (d0, k.let_("split_at", z * slice))
    });
    let across = tile.bn / tile.wn;
    let wm0 = k.let_("wm0", (&sg / across) * tile.wm);
    let wn0 = k.let_("wn0", (&sg % across) * tile.wn);

    // Staged slices, `stride` halves a row: A `bm × bk`; B `bn × bk` (·Wᵀ) or `bk × bn` (·W).
    let a_stride = tile.bk + PAD;
    let a_tile = k.workgroup_array::<Vec4<F16>>("a_tile", tile.bm * a_stride / 4);
    let (b_rows, b_width) = match product {
        Product::Nt => (tile.bn, tile.bk),
        Product::Nn => (tile.bk, tile.bn),
    };
    let b_stride = b_width + PAD;
    let b_tile = k.workgroup_array::<Vec4<F16>>("b_tile", b_rows * b_stride / 4);

    let partial = !depth.is_multiple_of(tile.bk);
    let blocks = (!input_blocks.is_empty()).then(|| Blocks {
        spans: input_blocks,
        rows_less_one: k.let_("rows_less_one", &rows - 1u32),
    });
    let staged_a = Staged {
        source: &a,
        along: Along::Depth,
        origin: &m0,
        fixed_last: k.let_("last_row", &rows - 1u32),
        width: depth,
        prologue: fused.prologue.as_ref(),
        depth,
        partial,
        last: k.let_("a_last", &rows * depth - 1u32),
        blocks: blocks.as_ref(),
    };
    let staged_w = Staged {
        source: &w,
        along: match product {
            Product::Nt => Along::Depth,
            Product::Nn => Along::Columns,
        },
        origin: &n0,
        fixed_last: lit(cols - 1),
        width: w_width,
        prologue: None,
        depth,
        partial,
        last: lit(cols * depth - 1),
        blocks: None,
    };
    let (frag_rows, frag_cols) = (tile.wm / 16, tile.wn / 16);
    let acc: Vec<Var<Acc>> = (0..frag_rows * frag_cols)
        .map(|_| k.var("acc", Expr::<Acc>::zero()))
        .collect();
    let a_base = k.let_("a_base", &wm0 * (a_stride / 4));
    let b_base = match product {
        Product::Nt => k.let_("b_base", &wn0 * (b_stride / 4)),
        Product::Nn => k.let_("b_base", &wn0 / 4u32),
    };
    // An epilogue works element by element, through workgroup memory; one that adds
    // matrices, tile by tile.
    let direct_matrices = match (&fused.epilogue, &fused.added_matrices) {
        (None, _) => Some(&[][..]),
        (Some(_), Some(matrices)) => Some(&matrices[..]),
        (Some(_), None) => None,
    };
    let direct =
        matches!(out, Output::F32(_)) && cols.is_multiple_of(4) && direct_matrices.is_some();
    // Whether the tile's rows and columns lie inside `out`, for a direct store: computed
    // before the main loop, since computed after it (the same expressions) the H200's compiler
    // made the lm-head's `·W` GEMM 1.5× slower (2209 against 1478 µs; BENCHMARKS.md "Tensor
    // cores, second pass").
    let fits = direct.then(|| {
        let rows_fit = k.let_("rows_fit", (&m0 + tile.bm).le(&rows));
        let cols_fit =
            (!cols.is_multiple_of(tile.bn)).then(|| k.let_("cols_fit", (&n0 + tile.bn).le(cols)));
        (rows_fit, cols_fit)
    });

    // A block-major output: the tile's columns lie in one block (`start`, `width`); element
    // `(r, c)` of it is at `rows·start + r·width + (c − start)` = `r·width + c + start·(rows − 1)`.
    // Computed before the main loop, as `fits` is.
    let out_block = (!output_blocks.is_empty()).then(|| {
        let (mut width, mut start) = (lit(output_blocks[0].1), lit(0u32));
        for &(s, w) in &output_blocks[1..] {
            let inside = n0.ge(s);
            width = select(inside.clone(), w, width);
            start = select(inside, s, start);
        }
        let width = k.let_("out_block_width", width);
        let shift = k.let_("out_block_shift", start * (&rows - 1u32));
        OutputBlock { width, shift }
    });

    let a_slots = staged_a.slots(k, "a", (tile.bm, tile.bk), threads);
    let b_slots = staged_w.slots(k, "b", (b_rows, b_width), threads);
    let fetch = |k: &mut KernelBuilder, d0: &Expr<u32>| {
        staged_a.fetch(k, &a_slots, d0);
        staged_w.fetch(k, &b_slots, d0);
    };
    let stage = |k: &mut KernelBuilder, d0: &Expr<u32>| {
        staged_a.stage(k, &a_slots, d0, (&a_tile, a_stride));
        staged_w.stage(k, &b_slots, d0, (&b_tile, b_stride));
    };
    k.comment("Stage the first step.");
    let first = split.as_ref().map_or(lit(0u32), |(d0, _)| d0.clone());
    fetch(k, &first);
    stage(k, &first);
    k.workgroup_barrier();
    let steps = match &split {
        Some(_) => depth / splits / tile.bk,
        None => depth.div_ceil(tile.bk),
    };
    k.for_range("step", 0u32, steps, |k, step| {
        let more = k.let_("more", (&step + 1u32).lt(steps));
        let next = (&step + 1u32) * tile.bk;
        let d0 = match &split {
            Some((split_d0, _)) => k.let_("d0", next + split_d0),
            None => k.let_("d0", next),
        };
        k.comment("Read the next step's slices into registers while this one multiplies.");
        k.if_(&more, |k| fetch(k, &d0));
        for kf in 0..tile.bk / 16 {
            let a_frags: Vec<Expr<TileA>> = (0..frag_rows)
                .map(|i| {
                    let at = super::offset(&a_base, i * 16 * a_stride / 4 + kf * 4);
                    k.coop_load::<TileA, _>(&a_tile, at, a_stride / 4, Major::Row)
                })
                .collect();
            let b_frags: Vec<Expr<TileB>> = (0..frag_cols)
                .map(|j| match product {
                    // B(k, n) = W[n, k]: column n of B is row n of the staged slice.
                    Product::Nt => {
                        let at = super::offset(&b_base, j * 16 * b_stride / 4 + kf * 4);
                        k.coop_load::<TileB, _>(&b_tile, at, b_stride / 4, Major::Column)
                    }
                    Product::Nn => {
                        let at = super::offset(&b_base, kf * 16 * b_stride / 4 + j * 4);
                        k.coop_load::<TileB, _>(&b_tile, at, b_stride / 4, Major::Row)
                    }
                })
                .collect();
            for i in 0..frag_rows {
                for j in 0..frag_cols {
                    let c = &acc[(i * frag_cols + j) as usize];
                    let product = coop_multiply_add(
                        a_frags[i as usize].clone(),
                        b_frags[j as usize].clone(),
                        c.get(),
                    );
                    k.assign(c, product);
                }
            }
        }
        k.workgroup_barrier();
        k.if_(&more, |k| stage(k, &d0));
        k.workgroup_barrier();
    });

    // With low-rank products, the accumulators are scaled (and the products added) here.
    let scaled = !fused.low_rank.is_empty();
    if scaled {
        let staged = LowRankStage::new(k, &fused.low_rank, (input_scale.as_ref(), &n0), tile.bk);
        let slices = Slices {
            product,
            tile: &tile,
            threads,
            origin: (&m0, &n0),
            rows: &rows,
            cols,
            a: (&a_tile, a_stride),
            b: (&b_tile, b_stride),
        };
        let frags = LowRankFrags {
            product,
            a: (&a_tile, a_stride, &a_base),
            b: (&b_tile, b_stride, &b_base),
        };
        for (i, round) in staged.rounds.iter().enumerate() {
            if i > 0 {
                // The previous round's fragments are read before this round stages over them.
                k.workgroup_barrier();
            }
            k.comment("Stage the low-rank epilogues' operands as more depth.");
            staged.stage(k, round, &slices, input_scale.as_ref());
            k.workgroup_barrier();
            k.comment("The accumulators scaled, the low-rank products added.");
            let first = (i == 0).then_some(&scale);
            frags.fold(k, round, (&acc, frag_cols), first);
        }
    }

    k.comment("Write the accumulators.");
    let row0 = k.let_("row0", &m0 + &wm0);
    let col0 = k.let_("col0", &n0 + &wn0);
    let c_tile = k.workgroup_array::<f32>("c_tile", tile.subgroups() * 256);
    let epilogue = Epilogue {
        out: &out,
        acc: &acc,
        frag_cols,
        origin: (&row0, &col0),
        rows: &rows,
        cols,
        scale: &scale,
        accumulate,
        fused: fused.epilogue.as_ref(),
        scaled,
        slice: split.as_ref().map(|(_, at)| at),
        block: out_block.as_ref(),
    };
    if let (Output::F32(y), Some(matrices), Some((rows_fit, cols_fit))) =
        (&out, direct_matrices, fits)
    {
        let inside = match cols_fit {
            // `&`, not `&&`: naga counts a short-circuit's result as varying.
            Some(cols_fit) => rows_fit & cols_fit,
            None => rows_fit,
        };
        k.if_else(
            inside,
            |k| epilogue.direct(k, y, matrices),
            |k| epilogue.staged(k, &c_tile, &sg, subgroup),
        );
    } else {
        epilogue.staged(k, &c_tile, &sg, subgroup);
    }
}

/// Rows of tiles taken together, for reuse of the weight's slices in the L2 cache.
const GROUP_ROWS: u32 = 8;

/// The first output row and column of this workgroup's tile. Workgroups run column by column
/// within groups of `GROUP_ROWS` rows of tiles, so the ones in flight together share the
/// weight's slices (and `A`'s) in the L2 cache: `workgroup_id` counts tiles row-major.
fn tile_origin(
    k: &mut KernelBuilder,
    rows: &Expr<u32>,
    cols: u32,
    tile: &CoopTile,
) -> (Expr<u32>, Expr<u32>) {
    let across = cols.div_ceil(tile.bn);
    let tile_rows = k.let_("tile_rows", (rows + (tile.bm - 1)) / tile.bm);
    let wid = k.workgroup_id();
    let id = k.let_("tile_id", wid.y() * across + wid.x());
    let per_group = GROUP_ROWS * across;
    let first = k.let_("first_row", &id / per_group * GROUP_ROWS);
    let height = k.let_("group_rows", (&tile_rows - &first).min(GROUP_ROWS));
    let within = k.let_("within", &id % per_group);
    let m0 = k.let_("m0", (&first + &within % &height) * tile.bm);
    let n0 = k.let_("n0", &within / &height * tile.bn);
    (m0, n0)
}

/// How the accumulators reach `out`.
struct Epilogue<'a> {
    out: &'a Output,
    acc: &'a [Var<Acc>],
    frag_cols: u32,
    /// The subgroup's first output row and column.
    origin: (&'a Expr<u32>, &'a Expr<u32>),
    rows: &'a Expr<u32>,
    cols: u32,
    scale: &'a Expr<f32>,
    accumulate: bool,
    /// The fusion's epilogues, on each element before it is stored.
    fused: Option<&'a ElementFn>,
    /// The accumulators hold `s·Σ` already (and the low-rank products).
    scaled: bool,
    /// A split GEMM's slice of `out` (its first element): it neither accumulates nor has epilogues.
    slice: Option<&'a Expr<u32>>,
    /// A block-major `out`: the block holding the workgroup's columns.
    block: Option<&'a OutputBlock>,
}

/// The block of a block-major output ([`Launch::output_blocks`]) that holds a workgroup's
/// columns: its width (the stride of its rows), and `start·(rows − 1)` for its first column
/// `start` (so that element `(r, c)` is at `r·width + c + shift`).
struct OutputBlock {
    width: Expr<u32>,
    shift: Expr<u32>,
}

impl Epilogue<'_> {
    /// `s·acc` of a fragment.
    fn scaled(&self, acc: &Var<Acc>) -> Expr<Acc> {
        match self.scaled {
            true => acc.get(),
            false => acc.get() * self.scale,
        }
    }

    /// Fragment `f`'s first row and column.
    fn corner(&self, f: u32) -> (Expr<u32>, Expr<u32>) {
        let (i, j) = (f / self.frag_cols, f % self.frag_cols);
        (
            super::offset(self.origin.0, i * 16),
            super::offset(self.origin.1, j * 16),
        )
    }

    /// The index in `out` of element (`row`, `col`).
    fn index(&self, row: Expr<u32>, col: Expr<u32>) -> Expr<u32> {
        match (self.slice, self.block) {
            (_, Some(b)) => row * &b.width + col + &b.shift,
            (Some(slice), None) => row * self.cols + col + slice,
            (None, None) => row * self.cols + col,
        }
    }

    /// The distance between rows of `out` where the workgroup's tile lies.
    fn stride(&self) -> Expr<u32> {
        match self.block {
            Some(b) => b.width.clone(),
            None => lit(self.cols),
        }
    }

    /// Every fragment straight into `y` (a tile inside `out`, f32, rows 16-byte aligned),
    /// `matrices` (`[rows, cols]`) added to it.
    /// Where tiles are read (added matrices, `accumulate`), every fragment's reads come before
    /// the first store: a store into `y` may alias any later read, so the driver would keep
    /// each read waiting on the store before it — a whole wave's latency a fragment (the down
    /// projection's GEMM took 56% longer accumulating, BENCHMARKS.md "Fusion").
    fn direct(&self, k: &mut KernelBuilder, y: &RwBuffer<f32>, matrices: &[ReadBuffer<f32>]) {
        let reads = self.accumulate || !matrices.is_empty();
        let mut pending = vec![];
        for (f, acc) in self.acc.iter().enumerate() {
            let (row, col) = self.corner(f as u32);
            let at = k.let_("at", self.index(row, col));
            let mut value = self.scaled(acc);
            for m in matrices {
                value = value + k.coop_load::<Acc, _>(m, &at, self.cols, Major::Row);
            }
            if self.accumulate {
                value = value + k.coop_load::<Acc, _>(y, &at, self.stride(), Major::Row);
            }
            if reads {
                pending.push((at, k.let_("value", value)));
            } else {
                k.coop_store(y, &at, self.stride(), Major::Row, value);
            }
        }
        for (at, value) in pending {
            k.coop_store(y, &at, self.stride(), Major::Row, value);
        }
    }

    /// Every fragment through the subgroup's 16×16 of `c_tile`, then element by element under
    /// a bounds check (converted to f16 for an f16 `out`).
    fn staged(
        &self,
        k: &mut KernelBuilder,
        c_tile: &WorkgroupArray<f32>,
        sg: &Expr<u32>,
        subgroup: u32,
    ) {
        let mine = k.let_("mine", sg * 256u32);
        let lane = k.let_("lane", k.subgroup_invocation_id());
        for (f, acc) in self.acc.iter().enumerate() {
            let (row, col) = self.corner(f as u32);
            k.coop_store(c_tile, &mine, 16u32, Major::Row, acc.get());
            k.workgroup_barrier();
            for e in 0..256 / subgroup {
                let idx = k.let_("idx", super::offset(&lane, e * subgroup));
                let r = k.let_("r", &row + &idx / 16u32);
                let c = k.let_("c", &col + &idx % 16u32);
                k.if_(r.lt(self.rows).and(c.lt(self.cols)), |k| {
                    let at = k.let_("at", self.index(r.clone(), c.clone()));
                    let element = c_tile.at(&mine + &idx);
                    let element = match self.scaled {
                        true => element,
                        false => element * self.scale,
                    };
                    let mut value = k.let_("value", element);
                    if let Some(f) = self.fused {
                        let fused = f(k, &r, &c, value);
                        value = k.let_("fused", fused);
                    }
                    match self.out {
                        Output::F32(y) if self.accumulate => {
                            k.store_op(y, &at, BinaryOp::Add, value)
                        }
                        Output::F32(y) => k.store(y, &at, value),
                        Output::F16(y) if self.accumulate => {
                            k.store(y, &at, (y.at(&at).cast::<f32>() + value).cast::<F16>())
                        }
                        Output::F16(y) => k.store(y, &at, value.cast::<F16>()),
                    }
                });
            }
            k.workgroup_barrier();
        }
    }
}

/// Where a tensor-core GEMM stages its slices, for the low-rank epilogues' operands.
struct Slices<'a> {
    product: Product,
    tile: &'a CoopTile,
    threads: u32,
    /// The workgroup's first output row and column.
    origin: (&'a Expr<u32>, &'a Expr<u32>),
    rows: &'a Expr<u32>,
    cols: u32,
    /// `A`'s and `B`'s staged slices and their strides in halves.
    a: (&'a WorkgroupArray<Vec4<F16>>, u32),
    b: (&'a WorkgroupArray<Vec4<F16>>, u32),
}

/// The low-rank epilogues ([`GemmFusion::low_rank`](super::GemmFusion::low_rank)) as more
/// depth of the product: after the main loop, each term's `h` is staged into `A`'s slice and
/// its `w` into `B`'s, side by side along the depth, so that every fragment adds `s·h·w` from
/// one or two more products on the tensor cores, a tile at a time, where the element-by-element
/// epilogue would read `rank` values of each from memory for every element. Each is staged in
/// parts, `[h₁ | h₂ | h₁]` against `[w₁; w₁; w₂]` (a value cut to f16's digits and what was
/// cut: [`low_rank_depth`](super::fusion::low_rank_depth)). Terms over ranges of the columns
/// that do not overlap share a slot (a workgroup stages the one its tile lies in, or zeros);
/// slots go side by side into rounds of one step's depth, more rounds where one is not
/// enough.
struct LowRankStage<'a> {
    terms: &'a [LowRankBuilt],
    /// Rounds of slots, each round's slots within one step's depth.
    rounds: Vec<Vec<LowRankSlot>>,
}

/// Terms that share depth of a staged step ([`LowRankStage`]).
struct LowRankSlot {
    /// The slot's first staged column along the depth and its depth (multiples of 16).
    at: u32,
    depth: u32,
    /// The terms (indices), more than one only where each has its own range of the columns
    /// and the ranges do not overlap.
    terms: Vec<usize>,
    /// What the slot's product is multiplied by in this workgroup: its term's `s` over the
    /// input's scale (`h` is staged scaled as the input is, out of f16's subnormals, as a
    /// backward's `dy·B` is), 0 where the workgroup's tile lies in none of its terms' ranges.
    multiplier: Expr<f32>,
}

impl<'a> LowRankStage<'a> {
    /// The terms' slots and rounds (`n0`: the workgroup's first output column; `bk`: a step's
    /// depth, which each term's depth fits).
    fn new(
        k: &mut KernelBuilder,
        terms: &'a [LowRankBuilt],
        (input_scale, n0): (Option<&Expr<f32>>, &Expr<u32>),
        bk: u32,
    ) -> Self {
        let apart = |a: &LowRankBuilt, b: &LowRankBuilt| match (a.columns, b.columns) {
            (Some((s0, e0)), Some((s1, e1))) => e0 <= s1 || e1 <= s0,
            _ => false,
        };
        let mut shared: Vec<Vec<usize>> = vec![];
        for (t, term) in terms.iter().enumerate() {
            match (shared.iter_mut()).find(|slot| slot.iter().all(|&u| apart(&terms[u], term))) {
                Some(slot) => slot.push(t),
                None => shared.push(vec![t]),
            }
        }
        let mut rounds: Vec<Vec<LowRankSlot>> = vec![];
        let mut used = bk;
        for slot in shared {
            let depth = (slot.iter())
                .map(|&t| super::fusion::low_rank_depth(terms[t].rank))
                .max()
                .expect("a slot holds a term");
            assert!(
                depth <= bk,
                "Fusion::low_rank_taken takes terms that fit a step"
            );
            if used + depth > bk {
                rounds.push(vec![]);
                used = 0;
            }
            let of = |t: usize| match input_scale {
                Some(s) => &terms[t].scale / s,
                None => terms[t].scale.clone(),
            };
            let multiplier = match terms[slot[0]].columns {
                None => of(slot[0]),
                Some(_) => (slot.iter()).fold(lit(0.0f32), |m, &t| {
                    select(in_columns(&terms[t], n0), of(t), m)
                }),
            };
            let multiplier = k.let_("low_rank_multiplier", multiplier);
            let at = used;
            used += depth;
            let round = rounds.last_mut().expect("a round was opened");
            round.push(LowRankSlot {
                at,
                depth,
                terms: slot,
                multiplier,
            });
        }
        LowRankStage { terms, rounds }
    }

    /// Stages the `h` (times `input_scale`) and `w` of every slot of `round` as f16: of a
    /// shared slot, the term whose range holds the workgroup's tile, else zeros.
    fn stage(
        &self,
        k: &mut KernelBuilder,
        round: &[LowRankSlot],
        slices: &Slices<'_>,
        input_scale: Option<&Expr<f32>>,
    ) {
        for slot in round {
            match self.terms[slot.terms[0]].columns {
                None => {
                    let term = Some(&self.terms[slot.terms[0]]);
                    self.stage_term(k, (slot, term), slices, input_scale);
                }
                // Each range is whole tiles (`low_rank_tiled`): a uniform choice.
                Some(_) => self.stage_shared(k, (slot, &slot.terms), slices, input_scale),
            }
        }
    }

    /// Stages into `slot` the first of `terms` whose range holds the workgroup's tile, else
    /// zeros.
    fn stage_shared(
        &self,
        k: &mut KernelBuilder,
        (slot, terms): (&LowRankSlot, &[usize]),
        slices: &Slices<'_>,
        input_scale: Option<&Expr<f32>>,
    ) {
        match terms.split_first() {
            Some((&t, rest)) => {
                let term = &self.terms[t];
                k.if_else(
                    in_columns(term, slices.origin.1),
                    |k| self.stage_term(k, (slot, Some(term)), slices, input_scale),
                    |k| self.stage_shared(k, (slot, rest), slices, input_scale),
                );
            }
            None => self.stage_term(k, (slot, None), slices, input_scale),
        }
    }

    /// Stages `term`'s `h` and `w` into `slot` (zeros where `None`).
    fn stage_term(
        &self,
        k: &mut KernelBuilder,
        (slot, term): (&LowRankSlot, Option<&LowRankBuilt>),
        slices: &Slices<'_>,
        input_scale: Option<&Expr<f32>>,
    ) {
        let (m0, n0) = slices.origin;
        let (bm, bn) = (slices.tile.bm, slices.tile.bn);
        let (at, span) = (slot.at, slot.depth);
        let lid = k.local_index();
        let zero = Expr::<F16>::lit(0.0);
        // Every vec4 of a `height × width`-half slice (width a multiple of 4), its position
        // given to `each` as (row, vec4 along it).
        let over = |k: &mut KernelBuilder, (height, width): (u32, u32), each: &VecSlot| {
            let total = height * width / 4;
            for s in 0..total.div_ceil(slices.threads) {
                let idx = k.let_("low_rank_idx", super::offset(&lid, s * slices.threads));
                let body = |k: &mut KernelBuilder| {
                    let row = k.let_("low_rank_row", &idx / (width / 4));
                    let c4 = k.let_("low_rank_c4", &idx % (width / 4));
                    each(k, &row, &c4);
                };
                match (s + 1) * slices.threads <= total {
                    true => body(k),
                    false => k.if_(idx.lt(total), body),
                }
            }
        };
        let (a_tile, a_stride) = slices.a;
        let (b_tile, b_stride) = slices.b;
        let Some(term) = term else {
            let zeros = || super::vec4_of(vec![zero.clone(); 4]);
            over(k, (bm, span), &|k, row, c4| {
                k.store(a_tile, row * (a_stride / 4) + at / 4 + c4, zeros());
            });
            match slices.product {
                Product::Nt => over(k, (bn, span), &|k, row, c4| {
                    k.store(b_tile, row * (b_stride / 4) + at / 4 + c4, zeros());
                }),
                Product::Nn => over(k, (span, bn), &|k, row, c4| {
                    k.store(b_tile, (row + at) * (b_stride / 4) + c4, zeros());
                }),
            }
            return;
        };
        let rank = term.rank;
        // The term's columns: `w`'s column `col − start` of `width`.
        let (start, end) = term.columns.unwrap_or((0, slices.cols));
        let width = end - start;
        // `(j, col)` of `w` (`j < rank`), the column clamped into it (the lane is zeroed
        // outside).
        let w_at = |j: &Expr<u32>, col: &Expr<u32>| {
            let col = (col - start).min(width - 1);
            match term.rank_minor {
                true => col * rank + j,
                false => j * width + col,
            }
        };
        // `h`: `bm` rows of `span`, into A's slice at column `at`.
        over(k, (bm, span), &|k, row, c4| {
            let r = k.let_("low_rank_r", m0 + row);
            let inside = r.lt(slices.rows);
            let r = r.min(&(slices.rows - 1u32));
            let lanes = (0..4)
                .map(|q| {
                    // Staged column `c` holds part `c / rank` of `h[r, c mod rank]`.
                    let c = super::offset(&(c4 * 4u32), q);
                    let v = term.h.at(&r * rank + &c % rank);
                    let v = match input_scale {
                        Some(s) => v * s,
                        None => v,
                    };
                    let v = split_part(k, "low_rank_h", v, (&c / rank).eq(1u32));
                    select(inside.clone().and(c.lt(3 * rank)), v, zero.clone())
                })
                .collect();
            let to = row * (a_stride / 4) + at / 4 + c4;
            k.store(a_tile, to, super::vec4_of(lanes));
        });
        // `w`: through `·Wᵀ` `bn` rows of `span` (B's columns), through `·W` `span` rows of
        // `bn`, into B's slice at depth `at`. Staged depth `c` holds part `c / rank` of
        // `w(col, c mod rank)`.
        let w_lane = |k: &mut KernelBuilder, c: Expr<u32>, col: Expr<u32>| {
            let inside = col.lt(end).and(c.lt(3 * rank));
            let v = term.w.at(w_at(&(&c % rank), &col));
            let v = split_part(k, "low_rank_w", v, (&c / rank).eq(2u32));
            select(inside, v, zero.clone())
        };
        match slices.product {
            Product::Nt => over(k, (bn, span), &|k, row, c4| {
                let col = k.let_("low_rank_col", n0 + row);
                let lanes = (0..4)
                    .map(|q| w_lane(k, super::offset(&(c4 * 4u32), q), col.clone()))
                    .collect();
                let to = row * (b_stride / 4) + at / 4 + c4;
                k.store(b_tile, to, super::vec4_of(lanes));
            }),
            Product::Nn => over(k, (span, bn), &|k, row, c4| {
                let col = k.let_("low_rank_col", n0 + c4 * 4u32);
                let lanes = (0..4)
                    .map(|q| w_lane(k, row.clone(), super::offset(&col, q)))
                    .collect();
                let to = (row + at) * (b_stride / 4) + c4;
                k.store(b_tile, to, super::vec4_of(lanes));
            }),
        }
    }
}

/// Whether the tile whose first column is `n0` lies in `term`'s range of columns (every tile
/// lies wholly in it or outside it: `low_rank_tiled`).
fn in_columns(term: &LowRankBuilt, n0: &Expr<u32>) -> Expr<bool> {
    let (start, end) = term.columns.expect("a term with a range");
    n0.ge(start).and(n0.lt(end))
}

/// Code for one vec4 of a staged slice, given its row and its vec4 along the row.
type VecSlot<'a> = dyn Fn(&mut KernelBuilder, &Expr<u32>, &Expr<u32>) + 'a;

/// A value's two f16 parts ([`low_rank_depth`](super::fusion::low_rank_depth)): `v` with its
/// mantissa cut to f16's 10 bits (exact in f16 in its normal range), or where `error` what
/// was cut (exact in f32), rounded to f16. Cut on the bits, not rounded by a conversion and
/// back: the H200's compiler folds `f32(f16(v))` into `v`, which left the error part zero.
fn split_part(k: &mut KernelBuilder, hint: &str, v: Expr<f32>, error: Expr<bool>) -> Expr<F16> {
    let v = k.let_(hint, v);
    let cut = (v.bitcast::<u32>() & 0xFFFF_E000u32).bitcast::<f32>();
    let high = k.let_(&format!("{hint}_high"), cut);
    select(error, (v - &high).cast::<F16>(), high.cast::<F16>())
}

/// A subgroup's view of the staged low-rank operands.
struct LowRankFrags<'a> {
    product: Product,
    /// `A`'s and `B`'s staged slices, their strides in halves and the subgroup's first vec4.
    a: (&'a WorkgroupArray<Vec4<F16>>, u32, &'a Expr<u32>),
    b: (&'a WorkgroupArray<Vec4<F16>>, u32, &'a Expr<u32>),
}

impl LowRankFrags<'_> {
    /// `acc = s·acc + Σ m·h·w` over the slots of `round` for every fragment of the subgroup's
    /// `frag_cols`-wide grid (`scale`: `s`, the first round's; later rounds add): `w`'s
    /// fragments read once, `h`'s once a row of fragments.
    fn fold(
        &self,
        k: &mut KernelBuilder,
        round: &[LowRankSlot],
        (acc, frag_cols): (&[Var<Acc>], u32),
        scale: Option<&Expr<f32>>,
    ) {
        let ((a_tile, a_stride, a_base), (b_tile, b_stride, b_base)) = (self.a, self.b);
        // Every 16 of the staged depth, with the slot it belongs to.
        let depths: Vec<(usize, u32)> = (round.iter().enumerate())
            .flat_map(|(n, slot)| {
                (slot.at..slot.at + slot.depth)
                    .step_by(16)
                    .map(move |d| (n, d))
            })
            .collect();
        let b: Vec<Vec<Expr<TileB>>> = (depths.iter())
            .map(|(_, d)| {
                (0..frag_cols)
                    .map(|j| {
                        let (at, major) = match self.product {
                            Product::Nt => (j * 16 * b_stride / 4 + d / 4, Major::Column),
                            Product::Nn => (d * b_stride / 4 + j * 4, Major::Row),
                        };
                        let at = super::offset(b_base, at);
                        let frag = k.coop_load::<TileB, _>(b_tile, at, b_stride / 4, major);
                        k.let_("low_rank_b", frag)
                    })
                    .collect()
            })
            .collect();
        for i in 0..acc.len() as u32 / frag_cols {
            let a: Vec<Expr<TileA>> = (depths.iter())
                .map(|(_, d)| {
                    let at = super::offset(a_base, i * 16 * a_stride / 4 + d / 4);
                    let frag = k.coop_load::<TileA, _>(a_tile, at, a_stride / 4, Major::Row);
                    k.let_("low_rank_a", frag)
                })
                .collect();
            for j in 0..frag_cols {
                let c = &acc[(i * frag_cols + j) as usize];
                let mut value = match scale {
                    Some(scale) => c.get() * scale,
                    None => c.get(),
                };
                for (n, slot) in round.iter().enumerate() {
                    let mut product = Expr::<Acc>::zero();
                    for (at, _) in depths.iter().enumerate().filter(|(_, (s, _))| *s == n) {
                        let b = b[at][j as usize].clone();
                        product = coop_multiply_add(a[at].clone(), b, product);
                    }
                    value = value + product * &slot.multiplier;
                }
                k.assign(c, value);
            }
        }
    }
}

/// The tensor-core kernels at small shapes and a small tile (32×32 outputs, 16 deep, 16×16 a
/// subgroup: the structure of [`CoopTile::LARGE`] in fewer lines), for snapshots and review.
/// The first has a ragged last column tile and depth step, f32 inputs (rounded in the load) and
/// an f16 output; the second f16 inputs, accumulating into f32; the third the same, its depth
/// split in two (each half into its own slice of the output).
pub fn kernels() -> Result<Vec<Kernel>, hesper_dsl::DslError> {
    let tile = CoopTile {
        bm: 32,
        bn: 32,
        bk: 16,
        wm: 16,
        wn: 16,
    };
    let build = |product, shape, types, accumulate_splits| {
        Kernel::build(
            &key(product, shape, tile, 32, types, accumulate_splits),
            |k| kernel(k, product, &Fusion::NONE),
        )
    };
    let f32_in = HalfBuffers {
        input: false,
        weight: false,
        output: true,
    };
    let f16_in = HalfBuffers {
        input: true,
        weight: true,
        output: false,
    };
    Ok(vec![
        build(Product::Nt, (60, 36), f32_in, (false, 1))?,
        build(Product::Nn, (64, 32), f16_in, (true, 1))?,
        build(Product::Nn, (64, 64), f16_in, (false, 2))?,
    ])
}

/// The tensor-core GEMMs at any shape and tile, within `limits`, for [`crate::catalog`].
pub(crate) mod build {
    use super::*;
    use crate::catalog::Failure;

    /// `coop_matmul_nt` or `coop_matmul_nn`, the tile checked first.
    pub(crate) fn gemm(
        product: Product,
        (cols, depth): (u32, u32),
        (tile, subgroup): (CoopTile, u32),
        types: HalfBuffers,
        accumulate_splits: (bool, u32),
        limits: &Limits,
    ) -> Result<Kernel, Failure> {
        tile.check(kernel_name(product), subgroup)?;
        let key = key(
            product,
            (cols, depth),
            tile,
            subgroup,
            types,
            accumulate_splits,
        );
        Ok(Kernel::build_with_limits(&key, limits, |k| {
            kernel(k, product, &Fusion::NONE)
        })?)
    }
}

/// The subgroup size a device lays its tensor-core GEMMs out for, when it can run them: it
/// offers 16×16 f16·f16 + f32 cooperative matrices and has subgroups of one fixed size.
pub fn subgroup_size(gpu: &Gpu) -> Option<u32> {
    let kind = hesper_dsl::CoopMultiply {
        size: 16,
        ab: Scalar::F16,
        c: Scalar::F32,
    };
    gpu.coop_multiplies()
        .contains(&kind)
        .then(|| gpu.subgroup_size())
        .flatten()
}

/// One launch of the tensor-core GEMM, its buffers checked by the caller.
pub(crate) struct Launch {
    pub product: Product,
    /// `(cols, depth)` of the output and the contraction.
    pub shape: (u32, u32),
    pub m: u32,
    pub tile: CoopTile,
    pub subgroup: u32,
    pub accumulate: bool,
    pub scale: f32,
    /// The f32 input is multiplied by `2^input_exponent` before rounding, the result by its
    /// inverse (`Gemm::input_exponent`).
    pub input_exponent: i32,
    /// Parts of the depth, each summed into its own `[m, cols]` slice of the output (rows
    /// rounded up to 4 floats; 1: not split, the output itself).
    pub splits: u32,
    /// The input's widths along the depth where it is block-major: `[x_0 | x_1 | …]` held as
    /// the row-major `[m, width_b]` matrices one after another (each a whole number of the
    /// tile's steps), zeros after the last; all zeros (or one block): row-major `[m, depth]`.
    pub input_blocks: [u32; MAX_INPUT_BLOCKS],
    /// The output's widths along the columns where it is block-major: `[y_0 | y_1 | …]` held
    /// as the row-major `[m, width_b]` matrices one after another (each a whole number of the
    /// tile's columns), zeros after the last; all zeros (or one block): row-major `[m, cols]`.
    pub output_blocks: [u32; MAX_INPUT_BLOCKS],
}

impl Launch {
    /// The input's blocks along the depth ([`Launch::input_blocks`] up to its first zero).
    fn blocks(&self) -> &[u32] {
        used_blocks(&self.input_blocks)
    }
}

/// The tensor-core path for `gemm` on `gpu`, when the device offers it: the tile asked for, or
/// the one [`choose_tile`] picks.
pub(crate) fn path(gpu: &Gpu, gemm: &super::Gemm, half: HalfBuffers) -> Option<super::GemmPath> {
    let subgroup = subgroup_size(gpu)?;
    let tile = gemm
        .coop_tile
        .unwrap_or_else(|| choose_tile(gpu, gemm, subgroup, half));
    Some(super::GemmPath::TensorCores { tile, subgroup })
}

/// Which operand of a tensor-core GEMM is block-major, with its blocks' widths.
#[derive(Clone, Copy, Debug)]
pub(crate) enum BlockMajor<'w> {
    /// The input along the depth ([`Launch::input_blocks`]): a tile serves whose step divides
    /// every width.
    Input(&'w [u32]),
    /// The output along the columns ([`Launch::output_blocks`]): a tile serves whose columns
    /// divide every width.
    Output(&'w [u32]),
}

impl BlockMajor<'_> {
    fn serves(&self, t: &CoopTile) -> bool {
        match self {
            BlockMajor::Input(widths) => widths.iter().all(|w| w.is_multiple_of(t.bk)),
            BlockMajor::Output(widths) => widths.iter().all(|w| w.is_multiple_of(t.bn)),
        }
    }
}

/// The tensor-core path for `gemm` with an operand block-major (`blocks`): the tile asked for
/// or chosen where it serves the blocks ([`BlockMajor`]); else, where none was asked for, the
/// standard tile that [`choose_tile`]'s default rule picks among those that serve. `None`
/// where the device has no tensor cores, the tile asked for does not serve, or no standard
/// tile does.
pub(crate) fn blocks_path(
    gpu: &Gpu,
    gemm: &super::Gemm,
    half: HalfBuffers,
    blocks: BlockMajor<'_>,
) -> Option<(CoopTile, u32)> {
    let Some(super::GemmPath::TensorCores { tile, subgroup }) = path(gpu, gemm, half) else {
        return None;
    };
    let serves = |t: &CoopTile| blocks.serves(t);
    if serves(&tile) {
        return Some((tile, subgroup));
    }
    if gemm.coop_tile.is_some() {
        return None;
    }
    let (cols, _) = gemm.cols_depth();
    let groups = |t: &CoopTile| gemm.m.div_ceil(t.bm as usize) * cols.div_ceil(t.bn as usize);
    let usable: Vec<CoopTile> = TILES
        .into_iter()
        .filter(|t| serves(t) && fits_device(gpu, t, subgroup))
        .collect();
    let tile = usable.iter().find(|t| groups(t) >= 132).or(usable.last())?;
    Some((*tile, subgroup))
}

/// Whether `gpu` runs `tile` with subgroups of `subgroup` invocations.
fn fits_device(gpu: &Gpu, tile: &CoopTile, subgroup: u32) -> bool {
    let limits = gpu.kernel_limits();
    tile.workgroup_bytes() <= limits.max_workgroup_storage_bytes
        && tile.subgroups() * subgroup <= limits.max_invocations_per_workgroup
        && tile.check("", subgroup).is_ok()
}

/// The tile, subgroup size and parts of `gemm`'s split on the tensor cores ([`splits_for`]),
/// where `gpu` has them and the GEMM gains from a split: the tile asked for, else the first of
/// the split's standard tiles that fits the device and splits the depth. An f16 input takes
/// [`CoopTile::LARGE`] (the fastest per product on the H200; a split supplies the workgroups
/// that a smaller tile would); an f32 input, converted to f16 as it is staged, takes
/// [`CoopTile::WIDE_12`] first, its twelve subgroups sharing the conversion: the step's
/// lm-head backward (f32 logits through the cross-entropy's gradient) took 399.6 µs a chunk
/// on the H100 with it against 493.9 with `LARGE`, where an f16 input took 359.3 against 313.8
/// (BENCHMARKS.md, "Splitting the attention's steps among subgroups"). `WIDE_12`'s 48-deep
/// step cuts fewer depths into whole parts (none a power of two): `LARGE` is then next.
pub(crate) fn split_path(
    gpu: &Gpu,
    gemm: &super::Gemm,
    input_half: bool,
) -> Option<(CoopTile, u32, u32)> {
    let subgroup = subgroup_size(gpu)?;
    let candidates: &[CoopTile] = match (&gemm.coop_tile, input_half) {
        (Some(tile), _) => std::slice::from_ref(tile),
        (None, true) => &[CoopTile::LARGE],
        (None, false) => &[CoopTile::WIDE_12, CoopTile::LARGE],
    };
    let (cols, depth) = gemm.cols_depth();
    let depth = u32::try_from(depth).ok()?;
    candidates.iter().find_map(|tile| {
        if !fits_device(gpu, tile, subgroup) {
            return None;
        }
        let tiles = gemm.m.div_ceil(tile.bm as usize) * cols.div_ceil(tile.bn as usize);
        let parts = splits_for(tiles, depth, tile.bk);
        (parts > 1).then_some((*tile, subgroup, parts))
    })
}

/// The standard tiles, largest first.
pub const TILES: [CoopTile; 7] = [
    CoopTile::LARGE,
    CoopTile::WIDE_12,
    CoopTile::WIDE,
    CoopTile::MEDIUM,
    CoopTile::TALL,
    CoopTile::SMALL,
    CoopTile::NARROW,
];

/// The tile for `gemm` when none is asked for. With autotuning on (`GpuOptions::autotune`),
/// the fastest standard tile that fits the device, measured once per product and widths and
/// power-of-two class of `m` (and remembered in the tune cache file). Otherwise, and where
/// measuring fails, the largest standard tile that still gives every one of ~132
/// multiprocessors (the H200's) a workgroup, else the one with the most workgroups.
pub fn choose_tile(gpu: &Gpu, gemm: &super::Gemm, subgroup: u32, half: HalfBuffers) -> CoopTile {
    let (cols, _) = gemm.cols_depth();
    let fits = |t: &CoopTile| fits_device(gpu, t, subgroup);
    let groups = |t: &CoopTile| gemm.m.div_ceil(t.bm as usize) * cols.div_ceil(t.bn as usize);
    let usable: Vec<CoopTile> = TILES.into_iter().filter(fits).collect();
    let default = usable
        .iter()
        .copied()
        .find(|t| groups(t) >= 132)
        .or_else(|| usable.last().copied())
        .unwrap_or(CoopTile::SMALL);
    if !gpu.autotunes() || usable.len() < 2 {
        return default;
    }
    tuned_tile(gpu, gemm, &usable, subgroup, half).unwrap_or(default)
}

/// The fastest of `usable` for `gemm`'s product, widths and class of `m`, measured once on this
/// device (`Gpu::tuned`); `None` when measuring fails.
#[cfg(not(target_arch = "wasm32"))]
fn tuned_tile(
    gpu: &Gpu,
    gemm: &super::Gemm,
    usable: &[CoopTile],
    subgroup: u32,
    half: HalfBuffers,
) -> Option<CoopTile> {
    let (cols, depth) = gemm.cols_depth();
    let class = gemm.m.next_power_of_two();
    let ty = |f16: bool| if f16 { "f16" } else { "f32" };
    // Reading the output's tiles in the epilogue (accumulating, a residual) changes which tile
    // is fastest: on the H200 the down projection's 128×256 took 1.6× its plain time.
    let reads = if gemm.accumulate { " accumulate" } else { "" };
    let key = format!(
        "{} v3 cols={cols} depth={depth} m~{class} subgroup={subgroup} in={} w={} out={}{reads}",
        kernel_name(gemm.product),
        ty(half.input),
        ty(half.weight),
        ty(half.output)
    );
    let name = |t: &CoopTile| format!("{}x{}x{}_{}x{}", t.bm, t.bn, t.bk, t.wm, t.wn);
    // Every tile is measured at the first call (none when the key is remembered).
    let times: std::cell::RefCell<Option<Vec<Result<f64, String>>>> = Default::default();
    let measure = |t: &CoopTile| {
        let mut times = times.borrow_mut();
        let times = times.get_or_insert_with(|| {
            let shape = (cols, depth, class);
            let kind = (gemm.product, gemm.accumulate);
            measure_tiles(gpu, kind, shape, usable, (subgroup, half))
        });
        let i = usable.iter().position(|u| u == t).expect("a candidate");
        times[i].clone().map_err(ExecError::Device)
    };
    gpu.tuned(&key, usable, name, measure).ok()
}

/// In a web page nothing is measured (it would block the page).
#[cfg(target_arch = "wasm32")]
fn tuned_tile(
    _: &Gpu,
    _: &super::Gemm,
    _: &[CoopTile],
    _: u32,
    _: HalfBuffers,
) -> Option<CoopTile> {
    None
}

/// GPU nanoseconds of one launch at each of `tiles` over `m` rows (fewer where the output
/// would pass the device's largest binding), with buffers of the GEMM's types. Every tile's pipeline is
/// compiled and run once first, then the GPU is kept busy for a second (its clock falls within
/// a second of idling and takes as long to climb back), then each tile is timed (medians of 10)
/// in two rounds, of which the faster counts: measurements taken back to back, so that none
/// pays for a compile or a slow clock.
#[cfg(not(target_arch = "wasm32"))]
fn measure_tiles(
    gpu: &Gpu,
    (product, accumulate): (Product, bool),
    (cols, depth, m): (usize, usize, usize),
    tiles: &[CoopTile],
    (subgroup, half): (u32, HalfBuffers),
) -> Vec<Result<f64, String>> {
    use hesper_exec::half::f16;
    use hesper_exec::profile::{BenchConfig, bench};
    use std::time::Duration;
    let widest = cols.max(depth).max(1);
    let binding = gpu.wgpu_limits().max_storage_buffer_binding_size as usize;
    let tallest = tiles.iter().map(|t| t.bm as usize).max().unwrap_or(1);
    let m = m.min(binding / 4 / widest).max(tallest);
    /// A scratch buffer of either element type.
    enum Scratch {
        F16(hesper_exec::GpuBuffer<f16>),
        F32(hesper_exec::GpuBuffer<f32>),
    }
    let scratch = |len: usize, f16: bool| -> Result<Scratch, ExecError> {
        Ok(match f16 {
            true => Scratch::F16(gpu.zeros(len)?),
            false => Scratch::F32(gpu.zeros(len)?),
        })
    };
    let buffers = (|| {
        Ok::<_, ExecError>((
            scratch(m * depth, half.input)?,
            scratch(cols * depth, half.weight)?,
            scratch(m * cols, half.output)?,
        ))
    })();
    let (input, w, mut out) = match buffers {
        Ok(buffers) => buffers,
        Err(e) => return tiles.iter().map(|_| Err(e.to_string())).collect(),
    };
    fn operand(b: &Scratch) -> super::Operand<'_> {
        match b {
            Scratch::F16(b) => super::Operand::F16(b),
            Scratch::F32(b) => super::Operand::F32(b),
        }
    }
    let mut run = |tile: CoopTile, warmup_ms: u64| -> Result<f64, String> {
        let launch = Launch {
            product,
            shape: (cols as u32, depth as u32),
            m: m as u32,
            tile,
            subgroup,
            accumulate,
            scale: 1.0,
            input_exponent: 0,
            splits: 1,
            input_blocks: [0; MAX_INPUT_BLOCKS],
            output_blocks: [0; MAX_INPUT_BLOCKS],
        };
        let config = BenchConfig {
            warmup: Duration::from_millis(warmup_ms),
            reps: 10,
        };
        let measured = bench(gpu, "autotune", config, |rec| {
            let out = match &mut out {
                Scratch::F16(b) => super::OutputBuffer::F16(b),
                Scratch::F32(b) => super::OutputBuffer::F32(b),
            };
            record(
                rec,
                &launch,
                operand(&input),
                operand(&w),
                out,
                &Fusion::NONE,
            )
        });
        measured.map(|m| m.median_ns()).map_err(|e| e.to_string())
    };
    // Compile and run each once; then warm the GPU up on the first that runs.
    let ran: Vec<bool> = tiles.iter().map(|t| run(*t, 0).is_ok()).collect();
    if let Some(first) = tiles.iter().zip(&ran).find(|(_, ok)| **ok) {
        let _ = run(*first.0, 1000);
    }
    let mut best: Vec<Result<f64, String>> = vec![Err("not measured".into()); tiles.len()];
    for _round in 0..2 {
        for (i, tile) in tiles.iter().enumerate() {
            match (run(*tile, 100), &best[i]) {
                (Ok(t), Ok(b)) if t >= *b => {}
                (Ok(t), _) => best[i] = Ok(t),
                (Err(e), Err(_)) => best[i] = Err(e),
                (Err(_), Ok(_)) => {}
            }
        }
    }
    best
}

/// Record the launch: `output (+)= scale·input·B(W)`, with `fusion`'s code (its buffers
/// checked by the caller).
pub(crate) fn record<'a>(
    rec: &mut hesper_exec::Recorder<'_>,
    launch: &Launch,
    input: super::Operand<'a>,
    w: super::Operand<'a>,
    output: super::OutputBuffer<'a>,
    fusion: &Fusion<'a>,
) -> Result<(), ExecError> {
    use super::{Operand, OutputBuffer};
    use hesper_exec::{Args, Grid};
    let Launch {
        product,
        shape: (cols, depth),
        m,
        tile,
        subgroup,
        accumulate,
        scale,
        input_exponent,
        splits,
        input_blocks: _,
        output_blocks: _,
    } = *launch;
    let name = kernel_name(product);
    tile.check(name, subgroup)?;
    let types = HalfBuffers {
        input: matches!(input, Operand::F16(_)),
        weight: matches!(w, Operand::F16(_)),
        output: matches!(output, OutputBuffer::F16(_)),
    };
    let key = fusion.key(
        name,
        key(
            product,
            (cols, depth),
            tile,
            subgroup,
            types,
            (accumulate, splits),
        ),
    )?;
    let key = with_blocks(key, "input", launch.blocks());
    let key = with_blocks(key, "output", used_blocks(&launch.output_blocks));
    let kernel = rec.gpu().kernel(&key, |k| kernel(k, product, fusion))?;
    let (input_name, output_name) = product.names();
    let w_width = match product {
        Product::Nt => depth,
        Product::Nn => cols,
    };
    fn bind<'a>(args: Args<'a>, name: &'a str, operand: Operand<'a>, vec4: bool) -> Args<'a> {
        match (operand, vec4) {
            (Operand::F32(b), true) => args.buffer_vec4(name, b),
            (Operand::F32(b), false) => args.buffer(name, b),
            (Operand::F16(b), true) => args.buffer_vec4(name, b),
            (Operand::F16(b), false) => args.buffer(name, b),
        }
    }
    let args = bind(Args::new(), input_name, input, depth.is_multiple_of(4));
    let args = bind(args, "w", w, w_width.is_multiple_of(4));
    let args = match &output {
        OutputBuffer::F32(b) => args.buffer(output_name, &**b),
        OutputBuffer::F16(b) => args.buffer(output_name, &**b),
    };
    // Powers of two: both multiplies are exact. An f16 input is read as it is.
    let input_scale = match types.input {
        true => 1.0,
        false => 2f32.powi(input_exponent),
    };
    let args = args.param("rows", m).param("scale", scale / input_scale);
    let args = match types.input {
        true => args,
        false => args.param("input_scale", input_scale),
    };
    let args = fusion.bind(args);
    let groups = [cols.div_ceil(tile.bn), m.div_ceil(tile.bm), splits];
    rec.launch(&kernel, &args, Grid::Workgroups(groups))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every standard tile passes its checks with subgroups of 32 and builds, for both
    /// products, within the workgroup memory `workgroup_bytes` says (what `fits_device`
    /// chooses by), on the H200's 48 KiB.
    #[test]
    fn standard_tiles_use_the_workgroup_memory_they_say() {
        let limits = Limits {
            max_workgroup_storage_bytes: 48 * 1024,
            ..Limits::default()
        };
        let f16_in = HalfBuffers {
            input: true,
            weight: true,
            output: false,
        };
        for tile in TILES {
            assert!(tile.check("test", 32).is_ok(), "{tile:?}");
            assert!(tile.workgroup_bytes() <= limits.max_workgroup_storage_bytes);
            for product in [Product::Nt, Product::Nn] {
                let key = key(product, (576, 1536), tile, 32, f16_in, (false, 1));
                let kernel =
                    Kernel::build_with_limits(&key, &limits, |k| kernel(k, product, &Fusion::NONE))
                        .unwrap();
                let used = kernel.workgroup_memory_bytes();
                assert!(used <= tile.workgroup_bytes(), "{key}: {used} bytes");
            }
        }
    }
}
