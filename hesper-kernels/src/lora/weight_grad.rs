//! The weight gradients `G(j, k) = s·Σ_t u[t, j]·v[t, k]`: `dB = s·dyᵀ·h` (`u = dy`, `v = h`,
//! `G` rank-minor `[out, r]`) and `dA = s·dhᵀ·x` (`u = x`, `v = dh`, `G` rank-major `[r, in]`),
//! summed over tokens in two passes with no float atomics: `lora_weight_grad_partials` sums
//! each block of tokens, `lora_weight_grad_sum` adds the blocks.

use hesper_dsl::prelude::*;
use hesper_dsl::{LocalArray, ReadBuffer, RwBuffer, WorkgroupArray};
use hesper_exec::{Args, ExecError, GpuBuffer, Grid, Recorder};

use super::{
    Layout, RankRows, adapter_key, adapter_shapes, bind_columns, bind_rank_rows, row_elements,
};
use crate::catalog::Failure;
use crate::linear::offset;
use crate::{Columns, bad_tile};

/// Blocks of tokens [`PartialsTile::for_tokens`] aims for at least.
const MIN_BLOCKS: u32 = 64;

/// The first pass's block sizes: a workgroup is `cols` invocations along the columns times
/// `lanes` along the tokens, each lane summing `lane_tokens` tokens of the block with `unroll`
/// rows in flight; the lanes' sums are added `round_sums` per invocation a round. Carried in the key;
/// [`PartialsTile::check`] says which rule a tile breaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct PartialsTile {
    cols: u32,
    lanes: u32,
    lane_tokens: u32,
    unroll: u32,
    round_sums: u32,
}

impl PartialsTile {
    pub(super) const DEFAULT: PartialsTile = PartialsTile {
        cols: 32,
        lanes: 4,
        lane_tokens: 64,
        unroll: 8,
        round_sums: 16,
    };

    /// The tile for a backward over `tokens`: [`PartialsTile::DEFAULT`] with fewer tokens a
    /// lane (a power of two, `unroll` at least) so that the blocks number [`MIN_BLOCKS`] or
    /// more where the tokens allow it. At
    /// 4096 tokens the default's 16 blocks gave the SmolLM2 step's projections 80 workgroups
    /// (17.7 µs a launch on the H200, where 4× the tokens took 22): too few to fill the GPU.
    pub(super) fn for_tokens(tokens: usize) -> PartialsTile {
        let d = PartialsTile::DEFAULT;
        // Rounded down: at least MIN_BLOCKS blocks.
        let per_lane = match tokens / (d.lanes * MIN_BLOCKS) as usize {
            0 => 1,
            p => 1 << p.ilog2(),
        };
        PartialsTile {
            lane_tokens: per_lane.clamp(d.unroll as usize, d.lane_tokens as usize) as u32,
            ..d
        }
    }

    fn invocations(&self) -> u32 {
        self.cols * self.lanes
    }
    /// Tokens per partial sum (one workgroup row of lanes).
    fn block_tokens(&self) -> u32 {
        self.lanes * self.lane_tokens
    }

    /// `Ok` when `lora_weight_grad_partials` can run this tile; else an error naming `kernel`
    /// and the rule.
    pub(super) fn check(&self, kernel: &str) -> Result<(), ExecError> {
        let sizes = [
            self.cols,
            self.lanes,
            self.lane_tokens,
            self.unroll,
            self.round_sums,
        ];
        if sizes.contains(&0) {
            return Err(bad_tile(
                kernel,
                self,
                "cols, lanes, lane_tokens, unroll and round_sums must be positive",
            ));
        }
        Ok(())
    }

    fn from_key(k: &mut KernelBuilder) -> PartialsTile {
        PartialsTile {
            cols: k.shape("cols"),
            lanes: k.shape("lanes"),
            lane_tokens: k.shape("lane_tokens"),
            unroll: k.shape("unroll"),
            round_sums: k.shape("round_sums"),
        }
    }
}

/// The second pass's block sizes: `invocations` per workgroup (the key's workgroup size), one
/// output each, and `loads` blocks read per step (independent sums, so that many loads are in
/// flight). Carried in the key; [`SumTile::check`] says which rule a tile breaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct SumTile {
    invocations: u32,
    loads: u32,
}

impl SumTile {
    /// Blocks are read 16 a step (a 4096-token backward has 64 blocks of 64: four steps).
    pub(super) const DEFAULT: SumTile = SumTile {
        invocations: 256,
        loads: 16,
    };

    /// `Ok` when `lora_weight_grad_sum` can run this tile; else an error naming `kernel` and
    /// the rule.
    pub(super) fn check(&self, kernel: &str) -> Result<(), ExecError> {
        if self.invocations == 0 || self.loads == 0 {
            return Err(bad_tile(
                kernel,
                self,
                "invocations and loads must be positive",
            ));
        }
        Ok(())
    }
}

/// Elements of the scratch buffer the weight gradients need: one partial sum per block of
/// tokens (256, or as few as 32 so that there are 64 blocks where the tokens allow: it is for
/// exactly `tokens`, and need not grow with them) per
/// weight element, `blocks·width·rank`, where `width` is `out` for
/// [`super::execute_grad_b`], `in` for [`super::execute_grad_a`] and `in + out` for
/// [`super::execute_lora_backward`] (which keeps both gradients' partials, to add them in one
/// launch).
pub fn lora_scratch_len(tokens: usize, width: usize, rank: usize) -> usize {
    let block = PartialsTile::for_tokens(tokens).block_tokens() as usize;
    tokens.div_ceil(block).max(1) * width * rank
}

/// `Ok` when the sum over the blocks of `tokens` fits the device's loop limit
/// ([`crate::expect_loops`]): an invocation of `lora_weight_grad_sum` steps through the blocks
/// `loads` at a time, for each of the two gradients it may add.
pub(super) fn expect_loops(
    gpu: &hesper_exec::Gpu,
    kernel: &str,
    tokens: usize,
) -> Result<(), ExecError> {
    let blocks = tokens.div_ceil(PartialsTile::for_tokens(tokens).block_tokens() as usize);
    let iterations = 2 * blocks.div_ceil(SumTile::DEFAULT.loads as usize) as u64;
    crate::expect_loops(gpu, kernel, || format!("{tokens} tokens"), iterations)
}

/// The first pass's key: one gradient `n` wide and, when `second` is not 0, a second one
/// `second` wide whose workgroups follow the first's (both of the fused backward: one launch).
fn partials_key(n: u32, second: u32, r: u32, tile: PartialsTile) -> KernelKey {
    KernelKey::new("lora_weight_grad_partials")
        .workgroup_size(tile.invocations())
        .shape("n", n)
        .shape("second", second)
        .shape("rank", r)
        .shape("cols", tile.cols)
        .shape("lanes", tile.lanes)
        .shape("lane_tokens", tile.lane_tokens)
        .shape("unroll", tile.unroll)
        .shape("round_sums", tile.round_sums)
        .assume_in_bounds()
}

/// One gradient of a first pass: its operands `u: [T, n]` (vec4s where `n` allows) and
/// `v: [T, r]`.
struct PartialsOf<U> {
    u: ReadBuffer<U>,
    v: RankRows,
    n: u32,
}

/// What both gradients of a first pass share: the tile, the rank, the partials, the tokens
/// and the workgroup memory where lanes add their sums.
struct PartialsPass {
    tile: PartialsTile,
    r: u32,
    partials: RwBuffer<f32>,
    tokens: Expr<u32>,
    sums: WorkgroupArray<f32>,
}

/// First pass: `partials[block, j, k] = Σ_{t in block} u[t, j]·v[t, k]`. Invocation
/// `(lane, c)` keeps its columns' `r` sums in registers over its `lane_tokens` tokens of the
/// block (`u` read wide, `unroll` rows in flight); the lanes' sums are added in workgroup
/// memory. With a second gradient, the workgroups past `first_workgroups` take it.
fn partials_body(k: &mut KernelBuilder) {
    let (n, second, r) = (
        k.shape::<u32>("n"),
        k.shape::<u32>("second"),
        k.shape("rank"),
    );
    let tile = PartialsTile::from_key(k);
    let first = Operands::declare(k, ("u", "v"), n, r);
    let second = (second > 0).then(|| Operands::declare(k, ("u2", "v2"), second, r));
    let pass = PartialsPass {
        tile,
        r,
        partials: k.storage_rw::<f32>("partials"),
        tokens: k.param::<u32>("tokens"),
        sums: k.workgroup_array::<f32>("sums", tile.lanes * tile.cols * tile.round_sums),
    };
    // Where each gradient's partials start in `partials` (the fused backward keeps two).
    let base = k.param::<u32>("base");
    let wg = k.let_("wg", k.workgroup_index());
    match second {
        None => first.partials(k, &pass, base, wg),
        Some(second) => {
            let base2 = k.param::<u32>("base2");
            let first_workgroups = k.param::<u32>("first_workgroups");
            let in_first = wg.lt(&first_workgroups);
            k.if_else(
                in_first,
                |k| first.partials(k, &pass, base, wg.clone()),
                |k| second.partials(k, &pass, base2, &wg - &first_workgroups),
            );
        }
    }
}

/// A gradient's operands, `u` read as vec4s or floats by its width.
enum Operands {
    Wide(PartialsOf<Vec4<f32>>),
    Narrow(PartialsOf<f32>),
}

impl Operands {
    fn declare(k: &mut KernelBuilder, (u, v): (&str, &str), n: u32, r: u32) -> Operands {
        match super::wide(n) {
            true => Operands::Wide(PartialsOf {
                u: k.storage(u),
                v: RankRows::declare(k, v, r),
                n,
            }),
            false => Operands::Narrow(PartialsOf {
                u: k.storage(u),
                v: RankRows::declare(k, v, r),
                n,
            }),
        }
    }

    /// This gradient's first pass ([`partials_with`]).
    fn partials(
        self,
        k: &mut KernelBuilder,
        pass: &PartialsPass,
        first_partial: Expr<u32>,
        wg: Expr<u32>,
    ) {
        match self {
            Operands::Wide(of) => partials_with(k, pass, of, (first_partial, wg)),
            Operands::Narrow(of) => partials_with(k, pass, of, (first_partial, wg)),
        }
    }
}

/// The first pass over one gradient's operands, its partials from `first_partial`, by
/// workgroup `wg` of its own.
fn partials_with<C: Columns>(
    k: &mut KernelBuilder,
    pass: &PartialsPass,
    of: PartialsOf<C>,
    (first_partial, wg): (Expr<u32>, Expr<u32>),
) {
    let PartialsPass {
        tile,
        r,
        partials,
        tokens,
        sums,
    } = pass;
    let (tile, r) = (*tile, *r);
    let PartialsOf { u, v, n } = of;
    let PartialsTile {
        cols,
        lanes,
        lane_tokens,
        unroll,
        round_sums,
    } = tile;
    let groups = n / C::N;
    let lid = k.let_("lid", k.local_index());
    let lane = k.let_("lane", &lid / cols);
    let c = k.let_("c", &lid % cols);
    let col_groups = groups.div_ceil(cols);
    let block = k.let_("block", &wg / col_groups);
    let g0 = k.let_("g0", (&wg % col_groups) * cols);
    // Columns past the last read the last (their sums are never stored).
    let g = k.let_("g", (&g0 + &c).min(groups - 1));
    // Indexed by Rust constants only: column `cc` of the invocation's, rank `kk` at `cc·r + kk`.
    let acc: LocalArray<f32> = k.var_array("acc", C::N * r);
    for o in 0..C::N * r {
        k.store(&acc, o, 0.0f32);
    }
    let first = k.let_("first", (&block * lanes + &lane) * lane_tokens);
    let end = k.let_("end", (&first + lane_tokens).min(tokens).max(&first));
    let full = k.let_("full", &first + (&end - &first) / unroll * unroll);
    let rows_at = |k: &mut KernelBuilder, t: &Expr<u32>, count: u32| {
        let us: Vec<Expr<C>> = (0..count)
            .map(|j| k.let_("u_t", u.at(offset(t, j) * groups + &g)))
            .collect();
        for (j, u_t) in us.iter().enumerate() {
            let vs = v.row(k, &offset(t, j as u32), r);
            for (cc, u_tj) in C::lanes(u_t).iter().enumerate() {
                for (kk, v_tk) in vs.iter().enumerate() {
                    // `acc(j, k) += u[t, j]·v[t, k]`
                    let o = cc as u32 * r + kk as u32;
                    k.store_op(&acc, o, BinaryOp::Add, u_tj * v_tk);
                }
            }
        }
    };
    k.for_step("t", &first, &full, unroll, |k, t| rows_at(k, &t, unroll));
    k.for_range("t", &full, &end, |k, t| rows_at(k, &t, 1));
    k.comment("Add the lanes' sums, `round_sums` per invocation a round.");
    let total_outputs = C::N * r;
    for pass in 0..total_outputs.div_ceil(round_sums) {
        let base = pass * round_sums;
        let len = round_sums.min(total_outputs - base);
        for o in 0..len {
            k.store(sums, (&lane * cols + &c) * round_sums + o, acc.at(base + o));
        }
        k.workgroup_barrier();
        let threads = tile.invocations();
        for part in 0..(cols * len).div_ceil(threads) {
            let e = k.let_("e", offset(&lid, part * threads));
            k.if_(e.lt(cols * len), |k| {
                let ec = k.let_("ec", &e / len);
                let eo = k.let_("eo", &e % len);
                let total = k.var("total", 0.0f32);
                for l in 0..lanes {
                    k.add_assign(&total, sums.at((l * cols + &ec) * round_sums + &eo));
                }
                let eg = k.let_("eg", &g0 + &ec);
                // A block past the tokens (a workgroup the 2-D grid rounds up to) stores nothing.
                let live = eg.lt(groups).and((&block * tile.block_tokens()).lt(tokens));
                k.if_(live, |k| {
                    // Output `base + eo` is column `cc` of the invocation's, rank `kk`.
                    let o = k.let_("o", &eo + base);
                    let col = k.let_("col", &eg * C::N + &o / r);
                    let at = &first_partial + (&block * n + &col) * r + &o % r;
                    k.store(partials, at, total.get());
                });
            });
        }
        k.workgroup_barrier();
    }
}

/// The second pass's key: one gradient `n` wide in `layout`, and, when `second` is not 0, a
/// second one `second` wide, rank-major (`dA` after `dB` in the fused backward: one launch).
fn sum_key(n: u32, r: u32, layout: Layout, second: u32, tile: SumTile) -> KernelKey {
    adapter_key("lora_weight_grad_sum", n, r, layout)
        .workgroup_size(tile.invocations)
        .shape("second", second)
        .shape("loads", tile.loads)
        .assume_in_bounds()
}

/// Second pass: `G(j, k) = scale·Σ_blocks partials[block, j, k]`, written in `G`'s layout —
/// for `grad`, and for `grad2` (whose partials follow `grad`'s) when the key has a second.
fn sum_body(k: &mut KernelBuilder) {
    let (n, r, layout) = adapter_shapes(k);
    let second = k.shape::<u32>("second");
    let partials = k.storage::<f32>("partials");
    let grad = k.storage_rw::<f32>("grad");
    let grad2 = (second > 0).then(|| k.storage_rw::<f32>("grad2"));
    let blocks = k.param::<u32>("blocks");
    let scale = k.param::<f32>("scale");
    let loads = k.shape::<u32>("loads");
    let i = k.global_index();
    // `loads` independent sums, so that many loads are in flight per step (a 4096-token
    // backward has 64 blocks: four steps); a block past the last reads the last one (in range)
    // and adds nothing.
    let add_blocks = |k: &mut KernelBuilder, (at, width, base): (Expr<u32>, u32, Expr<u32>)| {
        let accs: Vec<_> = (0..loads).map(|_| k.var("acc", 0.0f32)).collect();
        // With no blocks (no tokens) this wraps, unused: the loop below does not run.
        let last = k.let_("last", &blocks - 1u32);
        k.for_step("b", 0u32, &blocks, loads, |k, b| {
            for (q, acc) in accs.iter().enumerate() {
                let bq = k.let_("bq", offset(&b, q as u32).min(&last));
                let live = offset(&b, q as u32).lt(&blocks);
                let value = partials.at(&base + &bq * (width * r) + &at);
                k.add_assign(acc, select(live, value, 0.0f32));
            }
        });
        let total = accs
            .iter()
            .map(|acc| acc.get())
            .reduce(|a, b| a + b)
            .expect("loads > 0");
        // `G(j, k) = s·Σ_blocks partials[block, j, k]`
        &scale * total
    };
    k.if_(i.lt(n * r), |k| {
        let j = k.let_("j", &i / r);
        let kk = k.let_("k", &i % r);
        let total = add_blocks(k, (i.clone(), n, lit(0u32)));
        k.store(&grad, layout.at(&j, &kk, n, r), total);
    });
    if let Some(grad2) = &grad2 {
        k.if_(i.ge(n * r).and(i.lt((n + second) * r)), |k| {
            let at = k.let_("at", &i - n * r);
            let j = k.let_("j", &at / r);
            let kk = k.let_("k", &at % r);
            let base = k.let_("base", &blocks * (n * r));
            let total = add_blocks(k, (at.clone(), second, base));
            k.store(grad2, Layout::RankMajor.at(&j, &kk, second, r), total);
        });
    }
}

/// One weight gradient: `grad(j, k) = s·Σ_t u[t, j]·v[t, k]` for `u: [T, n]`, `v: [T, r]`.
pub(super) struct Gradient<'a> {
    pub(super) u: &'a GpuBuffer<f32>,
    pub(super) v: &'a GpuBuffer<f32>,
    pub(super) grad: &'a GpuBuffer<f32>,
    pub(super) n: u32,
}

/// Records both passes for `first` (laid out as `layout`) and, when given, a rank-major `second`
/// whose partials follow `first`'s in `scratch` and which the same second-pass launch adds up.
/// `scratch` holds [`lora_scratch_len`] for the gradients' widths (checked by the caller).
pub(super) fn launch(
    rec: &mut Recorder<'_>,
    (first, layout): (&Gradient<'_>, Layout),
    second: Option<&Gradient<'_>>,
    (tokens, r, scale): (u32, u32, f32),
    scratch: &GpuBuffer<f32>,
) -> Result<(), ExecError> {
    let tile = PartialsTile::for_tokens(tokens as usize);
    tile.check("lora_weight_grad_partials")?;
    let blocks = tokens.div_ceil(tile.block_tokens());
    launch_partials(rec, (first, second), (tokens, r, tile), scratch)?;
    let second_n = second.map_or(0, |s| s.n);
    let sum_tile = SumTile::DEFAULT;
    sum_tile.check("lora_weight_grad_sum")?;
    let key = sum_key(first.n, r, layout, second_n, sum_tile);
    let kernel = rec.gpu().kernel(&key, sum_body)?;
    let args = Args::new()
        .buffer("partials", scratch)
        .buffer("grad", first.grad);
    let args = match second {
        Some(second) => args.buffer("grad2", second.grad),
        None => args,
    };
    let args = args.param("blocks", blocks).param("scale", scale);
    let outputs = (first.n + second_n) as u64 * r as u64;
    rec.launch(&kernel, &args, Grid::Threads(outputs))
}

/// The first pass for `first` and, when given, `second` (its partials after `first`'s) in one
/// launch, into `scratch`.
fn launch_partials(
    rec: &mut Recorder<'_>,
    (first, second): (&Gradient<'_>, Option<&Gradient<'_>>),
    (tokens, r, tile): (u32, u32, PartialsTile),
    scratch: &GpuBuffer<f32>,
) -> Result<(), ExecError> {
    let blocks = tokens.div_ceil(tile.block_tokens());
    if blocks == 0 {
        return Ok(());
    }
    let workgroups = |n: u32| blocks as u64 * row_elements(n).div_ceil(tile.cols) as u64;
    let second_n = second.map_or(0, |s| s.n);
    let key = partials_key(first.n, second_n, r, tile);
    let kernel = rec.gpu().kernel(&key, partials_body)?;
    let args = bind_columns(Args::new(), "u", first.u, first.n);
    let mut args = bind_rank_rows(args, "v", first.v, r);
    if let Some(second) = second {
        args = bind_columns(args, "u2", second.u, second.n);
        args = bind_rank_rows(args, "v2", second.v, r);
    }
    let mut args = args
        .buffer("partials", scratch)
        .param("tokens", tokens)
        .param("base", 0u32);
    let mut total = workgroups(first.n);
    if second.is_some() {
        let first_workgroups = u32::try_from(total).map_err(|_| ExecError::Dispatch {
            kernel: "lora_weight_grad_partials".into(),
            what: format!("{total} workgroups for the first gradient"),
            why: "they are counted in u32".into(),
        })?;
        args = args
            .param("base2", blocks * first.n * r)
            .param("first_workgroups", first_workgroups);
        total += workgroups(second_n);
    }
    rec.launch(&kernel, &args, Grid::WorkgroupPerItem(total))
}

/// The kernels at a small shape, for snapshots and review.
pub(super) fn kernels() -> Result<Vec<Kernel>, hesper_dsl::DslError> {
    Ok(vec![
        Kernel::build(
            &partials_key(64, 48, 2, PartialsTile::DEFAULT),
            partials_body,
        )?,
        Kernel::build(&partials_key(6, 0, 2, PartialsTile::DEFAULT), partials_body)?,
        Kernel::build(
            &sum_key(64, 2, Layout::RankMinor, 48, SumTile::DEFAULT),
            sum_body,
        )?,
    ])
}

/// `lora_weight_grad_partials` at any shape and tile (`[cols, lanes, lane_tokens, unroll,
/// round_sums]`), within `limits`, for [`crate::catalog`]: the tile checked first.
pub(crate) fn partials_at(
    (n, second, r): (u32, u32, u32),
    [cols, lanes, lane_tokens, unroll, round_sums]: [u32; 5],
    limits: &Limits,
) -> Result<Kernel, Failure> {
    let tile = PartialsTile {
        cols,
        lanes,
        lane_tokens,
        unroll,
        round_sums,
    };
    super::check_width(n)?;
    if second > 0 {
        super::check_width(second)?;
    }
    tile.check("lora_weight_grad_partials")?;
    let key = partials_key(n, second, r, tile);
    Ok(Kernel::build_with_limits(&key, limits, partials_body)?)
}

/// `lora_weight_grad_sum` at any shape and tile (`[invocations, loads]`), within `limits`, for
/// [`crate::catalog`]: the tile checked first.
pub(crate) fn sum_at(
    (n, r, rank_minor, second): (u32, u32, bool, u32),
    [invocations, loads]: [u32; 2],
    limits: &Limits,
) -> Result<Kernel, Failure> {
    let tile = SumTile { invocations, loads };
    super::check_width(n)?;
    tile.check("lora_weight_grad_sum")?;
    let key = sum_key(n, r, Layout::from_shape(rank_minor), second, tile);
    Ok(Kernel::build_with_limits(&key, limits, sum_body)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_tile_passes_its_check_and_a_broken_one_says_why() {
        PartialsTile::DEFAULT
            .check("lora_weight_grad_partials")
            .unwrap();
        let err = PartialsTile {
            lanes: 0,
            ..PartialsTile::DEFAULT
        }
        .check("lora_weight_grad_partials")
        .unwrap_err()
        .to_string();
        assert!(err.contains("must be positive"), "{err}");
        SumTile::DEFAULT.check("lora_weight_grad_sum").unwrap();
        let err = SumTile {
            loads: 0,
            ..SumTile::DEFAULT
        }
        .check("lora_weight_grad_sum")
        .unwrap_err()
        .to_string();
        assert!(err.contains("must be positive"), "{err}");
    }
}
