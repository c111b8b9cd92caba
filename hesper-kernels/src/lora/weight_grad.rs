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

/// The key shapes of the gradients' widths in both passes' keys (the first is `n`; 0: none).
const WIDTHS: [&str; MAX_PARTS] = ["n", "second", "third", "fourth"];

/// The most gradients one second pass takes: two adapters' `dB` and `dA`.
pub(super) const MAX_PARTS: usize = 4;

/// The most gradients one first pass takes: one adapter's `dB` and `dA`. Each binds its `u`
/// and `v`: with the partials, 5 storage buffers, within WebGPU's 8 a shader (four would
/// need 9).
const MAX_PARTIALS: usize = 2;

/// The first pass's parts: the operands' bindings, the parameters where their partials start
/// and where their workgroups end.
const PARTIALS: [((&str, &str), &str, &str); MAX_PARTIALS] = [
    (("u", "v"), "base", "end1"),
    (("u2", "v2"), "base2", "end2"),
];

/// The first pass's key: the widths of up to [`MAX_PARTIALS`] gradients (0: none), the
/// second's workgroups after the first's (an adapter's `dB` and `dA`: one launch).
fn partials_key(widths: [u32; MAX_PARTIALS], r: u32, tile: PartialsTile) -> KernelKey {
    let mut key = KernelKey::new("lora_weight_grad_partials").workgroup_size(tile.invocations());
    for (name, width) in WIDTHS.iter().zip(widths) {
        key = key.shape(*name, width);
    }
    key.shape("rank", r)
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

/// What the gradients of a first pass share: the tile, the rank, the partials, the tokens
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
/// memory. With more than one gradient, each takes the workgroups up to its `end` (after the
/// one before's), and its partials start at its `base`.
fn partials_body(k: &mut KernelBuilder) {
    let r = k.shape::<u32>("rank");
    let widths: Vec<u32> = (WIDTHS.iter().take(MAX_PARTIALS))
        .map(|name| k.shape::<u32>(name))
        .take_while(|&n| n > 0)
        .collect();
    let tile = PartialsTile::from_key(k);
    let parts: Vec<Operands> = (PARTIALS.iter().zip(&widths))
        .map(|((names, ..), &n)| Operands::declare(k, *names, n, r))
        .collect();
    let pass = PartialsPass {
        tile,
        r,
        partials: k.storage_rw::<f32>("partials"),
        tokens: k.param::<u32>("tokens"),
        sums: k.workgroup_array::<f32>("sums", tile.lanes * tile.cols * tile.round_sums),
    };
    let bases: Vec<Expr<u32>> = (PARTIALS.iter().take(parts.len()))
        .map(|(_, base, _)| k.param::<u32>(base))
        .collect();
    // The last part's end is the grid's.
    let ends: Vec<Expr<u32>> = (PARTIALS.iter().take(parts.len().saturating_sub(1)))
        .map(|(.., end)| k.param::<u32>(end))
        .collect();
    let wg = k.let_("wg", k.workgroup_index());
    run_parts(k, &pass, parts, (&bases, &ends), (wg, lit(0u32)));
}

/// Part 0 of `parts` where `wg` is below its end (counted from `start`), else the rest.
fn run_parts(
    k: &mut KernelBuilder,
    pass: &PartialsPass,
    mut parts: Vec<Operands>,
    (bases, ends): (&[Expr<u32>], &[Expr<u32>]),
    (wg, start): (Expr<u32>, Expr<u32>),
) {
    let part = parts.remove(0);
    let own = k.let_("part_wg", &wg - &start);
    match ends.first() {
        None => part.partials(k, pass, bases[0].clone(), own),
        Some(end) => k.if_else(
            wg.lt(end),
            |k| part.partials(k, pass, bases[0].clone(), own.clone()),
            |k| run_parts(k, pass, parts, (&bases[1..], &ends[1..]), (wg, end.clone())),
        ),
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

/// The second pass's key: up to [`MAX_PARTS`] gradients, each its width and layout (`dB`
/// rank-minor, `dA` rank-major), their partials one after another as the first pass wrote
/// them; the first's as an [`adapter_key`], the others' as `second`, `third`, `fourth` (0:
/// none) and `second_rank_minor`, ….
fn sum_key(parts: &[(u32, Layout)], r: u32, tile: SumTile) -> KernelKey {
    let (n, layout) = parts[0];
    let mut key =
        adapter_key("lora_weight_grad_sum", n, r, layout).workgroup_size(tile.invocations);
    for (i, name) in WIDTHS.iter().enumerate().skip(1) {
        let (width, layout) = parts.get(i).copied().unwrap_or((0, Layout::RankMajor));
        key = key
            .shape(*name, width)
            .shape(format!("{name}_rank_minor"), layout.is_rank_minor());
    }
    key.shape("loads", tile.loads).assume_in_bounds()
}

/// Bindings of the second pass's gradients.
const SUM_GRADS: [&str; MAX_PARTS] = ["grad", "grad2", "grad3", "grad4"];

/// Second pass: `G(j, k) = scale·Σ_blocks partials[block, j, k]`, written in `G`'s layout —
/// for each gradient of the key, invocation `i` adding element `i` of them all in turn.
fn sum_body(k: &mut KernelBuilder) {
    let (n, r, layout) = adapter_shapes(k);
    let mut parts = vec![(n, layout)];
    for name in &WIDTHS[1..] {
        let width = k.shape::<u32>(name);
        if width == 0 {
            break;
        }
        let minor = k.shape::<bool>(&format!("{name}_rank_minor"));
        parts.push((width, Layout::from_shape(minor)));
    }
    let partials = k.storage::<f32>("partials");
    let grads: Vec<_> = (SUM_GRADS.iter().take(parts.len()))
        .map(|name| k.storage_rw::<f32>(name))
        .collect();
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
    // Gradient `p`'s elements follow those of the ones before it, in `i` and in each block.
    let mut before = 0;
    for ((width, layout), grad) in parts.into_iter().zip(&grads) {
        let inside = match before {
            0 => i.lt(width * r),
            _ => i.ge(before).and(i.lt(before + width * r)),
        };
        k.if_(inside, |k| {
            let at = match before {
                0 => i.clone(),
                _ => k.let_("at", &i - before),
            };
            let j = k.let_("j", &at / r);
            let kk = k.let_("k", &at % r);
            let base = match before {
                0 => lit(0u32),
                _ => k.let_("base", &blocks * before),
            };
            let total = add_blocks(k, (at.clone(), width, base));
            k.store(grad, layout.at(&j, &kk, width, r), total);
        });
        before += width * r;
    }
}

/// One weight gradient: `grad(j, k) = s·Σ_t u[t, j]·v[t, k]` for `u: [T, n]`, `v: [T, r]`.
pub(super) struct Gradient<'a> {
    pub(super) u: &'a GpuBuffer<f32>,
    pub(super) v: &'a GpuBuffer<f32>,
    pub(super) grad: &'a GpuBuffer<f32>,
    pub(super) n: u32,
}

/// Records both passes for each gradient of `gradients` (at most [`MAX_PARTS`], each with its
/// layout), every gradient's partials after the one before's in `scratch`, one launch each
/// pass. `scratch` holds [`lora_scratch_len`] for the gradients' widths (checked by the caller).
pub(super) fn launch(
    rec: &mut Recorder<'_>,
    gradients: &[(&Gradient<'_>, Layout)],
    (tokens, r, scale): (u32, u32, f32),
    scratch: &GpuBuffer<f32>,
) -> Result<(), ExecError> {
    let tile = PartialsTile::for_tokens(tokens as usize);
    tile.check("lora_weight_grad_partials")?;
    let blocks = tokens.div_ceil(tile.block_tokens());
    // The first pass an adapter (two gradients) a launch, each's partials after the last's.
    let mut base = 0u64;
    for part in gradients.chunks(MAX_PARTIALS) {
        let part: Vec<&Gradient<'_>> = part.iter().map(|(g, _)| *g).collect();
        base = launch_partials(rec, &part, (tokens, r, tile), (scratch, base))?;
    }
    let sum_tile = SumTile::DEFAULT;
    sum_tile.check("lora_weight_grad_sum")?;
    let parts: Vec<(u32, Layout)> = gradients.iter().map(|(g, l)| (g.n, *l)).collect();
    let kernel = rec.gpu().kernel(&sum_key(&parts, r, sum_tile), sum_body)?;
    let mut args = Args::new().buffer("partials", scratch);
    for (name, (g, _)) in SUM_GRADS.iter().zip(gradients) {
        args = args.buffer(name, g.grad);
    }
    let args = args.param("blocks", blocks).param("scale", scale);
    let outputs: u64 = gradients.iter().map(|(g, _)| g.n as u64 * r as u64).sum();
    rec.launch(&kernel, &args, Grid::Threads(outputs))
}

/// The first pass for every gradient of `gradients` (at most [`MAX_PARTIALS`]) in one
/// launch, into `scratch` from element `base`: each gradient's partials after the one before's.
/// Returns where the next gradient's partials would start.
fn launch_partials(
    rec: &mut Recorder<'_>,
    gradients: &[&Gradient<'_>],
    (tokens, r, tile): (u32, u32, PartialsTile),
    (scratch, mut base): (&GpuBuffer<f32>, u64),
) -> Result<u64, ExecError> {
    let name = "lora_weight_grad_partials";
    let blocks = tokens.div_ceil(tile.block_tokens());
    if blocks == 0 {
        return Ok(base);
    }
    assert!(
        (1..=MAX_PARTIALS).contains(&gradients.len()),
        "callers pass 1 to {MAX_PARTIALS} gradients"
    );
    let mut widths = [0; MAX_PARTIALS];
    for (w, g) in widths.iter_mut().zip(gradients) {
        *w = g.n;
    }
    let kernel = rec
        .gpu()
        .kernel(&partials_key(widths, r, tile), partials_body)?;
    let u32_of = |what: String, v: u64| {
        u32::try_from(v).map_err(|_| ExecError::Dispatch {
            kernel: name.into(),
            what,
            why: "it is counted in u32".into(),
        })
    };
    let mut args = Args::new();
    let mut end = 0u64;
    for (i, (((u, v), base_name, end_name), g)) in PARTIALS.iter().zip(gradients).enumerate() {
        args = bind_columns(args, u, g.u, g.n);
        args = bind_rank_rows(args, v, g.v, r);
        args = args.param(
            base_name,
            u32_of(format!("the partials of gradient {i}"), base)?,
        );
        base += blocks as u64 * g.n as u64 * r as u64;
        end += blocks as u64 * row_elements(g.n).div_ceil(tile.cols) as u64;
        if i + 1 < gradients.len() {
            args = args.param(end_name, u32_of(format!("{end} workgroups"), end)?);
        }
    }
    let args = args.buffer("partials", scratch).param("tokens", tokens);
    rec.launch(&kernel, &args, Grid::WorkgroupPerItem(end))?;
    Ok(base)
}

/// The kernels at a small shape, for snapshots and review.
pub(super) fn kernels() -> Result<Vec<Kernel>, hesper_dsl::DslError> {
    let (minor, major) = (Layout::RankMinor, Layout::RankMajor);
    let tile = PartialsTile::DEFAULT;
    let four = [(64, minor), (48, major), (20, minor), (64, major)];
    Ok(vec![
        Kernel::build(&partials_key([64, 48], 2, tile), partials_body)?,
        Kernel::build(&partials_key([6, 0], 2, tile), partials_body)?,
        Kernel::build(&sum_key(&four, 2, SumTile::DEFAULT), sum_body)?,
        Kernel::build(&sum_key(&[(6, major)], 2, SumTile::DEFAULT), sum_body)?,
    ])
}

/// `lora_weight_grad_partials` at any shape and tile (`[cols, lanes, lane_tokens, unroll,
/// round_sums]`), within `limits`, for [`crate::catalog`]: the tile checked first.
pub(crate) fn partials_at(
    (widths, r): ([u32; MAX_PARTIALS], u32),
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
    check_parts(&widths)?;
    tile.check("lora_weight_grad_partials")?;
    let key = partials_key(widths, r, tile);
    Ok(Kernel::build_with_limits(&key, limits, partials_body)?)
}

/// `Ok` for parts' widths a kernel takes: the first positive, none after a 0.
fn check_parts(widths: &[u32]) -> Result<(), Failure> {
    super::check_width(widths[0])?;
    match widths.windows(2).any(|w| w[0] == 0 && w[1] > 0) {
        true => Err(Failure::rule(
            format!("widths {widths:?}"),
            "the gradients' widths one after another: none after a 0".into(),
        )),
        false => Ok(()),
    }
}

/// `lora_weight_grad_sum` at any shape and tile (`[invocations, loads]`), within `limits`, for
/// [`crate::catalog`]: the tile checked first.
pub(crate) fn sum_at(
    (parts, r): ([(u32, bool); MAX_PARTS], u32),
    [invocations, loads]: [u32; 2],
    limits: &Limits,
) -> Result<Kernel, Failure> {
    let tile = SumTile { invocations, loads };
    check_parts(&parts.map(|(width, _)| width))?;
    tile.check("lora_weight_grad_sum")?;
    let parts: Vec<(u32, Layout)> = parts
        .into_iter()
        .take_while(|&(width, _)| width > 0)
        .map(|(width, minor)| (width, Layout::from_shape(minor)))
        .collect();
    let key = sum_key(&parts, r, tile);
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
