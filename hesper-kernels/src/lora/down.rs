//! The products into `r` (`h = x·Aᵀ`, `dh = dy·B`): `out[t, k] = Σ_i a[t, i]·W(i, k)` for
//! `k < r`, a reduction along each row of `a` whose output is too narrow for the GEMM's tiles.
//! [`project`] picks `lora_down_subgroups` ([`super::subgroups`]) on a device with subgroups of
//! one known size, else `lora_down` (here), and the GEMM for ranks past [`MAX_RANK`].

use hesper_dsl::prelude::*;
use hesper_dsl::{LocalArray, RwBuffer, WorkgroupArray};
use hesper_exec::{Args, ExecError, GpuBuffer, Grid, Recorder};

use super::subgroups::{self, Operands, SubgroupTile};
use super::{
    Layout, MAX_RANK, RankRows, adapter_key, adapter_shapes, bind_columns, bind_rank_rows, by_width,
};
use crate::catalog::Failure;
use crate::linear::{self, offset};
use crate::{Columns, bad_tile};

/// `lora_down`'s block sizes. A workgroup owns `tokens()` tokens and walks their rows `step()`
/// columns at a time: invocation `(ks, tq)` (`ks < column_lanes`, `tq < token_lanes`) owns
/// tokens `tq + token_lanes·j` (`j < 4`) and columns `4·ks .. 4·ks + 4` of a step. Carried in
/// the key; [`DownTile::check`] says which rule a tile breaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct DownTile {
    /// Invocations along the tokens, four tokens each.
    token_lanes: u32,
    /// Invocations along the columns, four columns each per step.
    column_lanes: u32,
    /// Floats per column of the staged slice: the tile's tokens, plus padding against bank
    /// conflicts.
    pitch: u32,
    /// Partial sums per invocation per round of the final reduction.
    round_sums: u32,
    /// Column slices one invocation adds in the reduction's first level.
    span: u32,
}

impl DownTile {
    /// 4 × 64 invocations, 16 tokens × 256 columns a step, 27 KiB of workgroup memory. With
    /// `4·pitch ≡ 8 (mod 32)` the slice reads of a subgroup (8 slices × 4 tokens) fall in at most
    /// two invocations a bank.
    pub(super) const DEFAULT: DownTile = DownTile {
        token_lanes: 4,
        column_lanes: 64,
        pitch: 18,
        round_sums: 8,
        span: 8,
    };

    /// 4 × 32 invocations, 16 tokens × 128 columns a step, 13.5 KiB: within the 16 KiB of
    /// workgroup memory WebGPU guarantees, for devices that offer no more.
    pub(super) const PORTABLE: DownTile = DownTile {
        column_lanes: 32,
        ..DownTile::DEFAULT
    };

    /// `DEFAULT`, or `PORTABLE` on a device without the workgroup memory for it.
    pub(super) fn for_device(limits: &hesper_dsl::Limits) -> DownTile {
        if DownTile::DEFAULT.workgroup_bytes() <= limits.max_workgroup_storage_bytes {
            DownTile::DEFAULT
        } else {
            DownTile::PORTABLE
        }
    }

    /// Bytes of workgroup memory: the staged slice, the per-invocation partial sums and the
    /// first level's sums of the reduction.
    pub(super) fn workgroup_bytes(&self) -> u32 {
        let slice = self.step() * self.pitch;
        let partial = self.invocations() * self.round_sums;
        let group_sums = self.column_lanes / self.span * self.token_lanes * self.round_sums;
        4 * (slice + partial + group_sums)
    }

    pub(super) fn invocations(&self) -> u32 {
        self.token_lanes * self.column_lanes
    }
    /// Tokens per workgroup.
    pub(super) fn tokens(&self) -> u32 {
        4 * self.token_lanes
    }
    /// Columns per step.
    fn step(&self) -> u32 {
        4 * self.column_lanes
    }

    /// `Ok` when `lora_down` can run this tile; else an error naming `kernel` and the rule.
    pub(super) fn check(&self, kernel: &str) -> Result<(), ExecError> {
        let DownTile {
            token_lanes,
            column_lanes,
            pitch,
            round_sums,
            span,
        } = *self;
        let fail = |why: &str| Err(bad_tile(kernel, self, why));
        if token_lanes == 0 || round_sums == 0 || span == 0 {
            return fail("token_lanes, round_sums and span must be positive");
        }
        // A load is 4 tokens × 8 wide elements; the first level adds groups of `span` slices.
        if column_lanes == 0
            || !column_lanes.is_multiple_of(8)
            || !column_lanes.is_multiple_of(span)
        {
            return fail("column_lanes must be a positive multiple of 8 and of span");
        }
        // The first level's `column_lanes / span · token_lanes · round_sums` sums, one an invocation.
        if round_sums > span {
            return fail("round_sums must not exceed span");
        }
        if pitch < self.tokens() {
            return fail("pitch must hold the tile's 4·token_lanes tokens");
        }
        Ok(())
    }

    fn shapes(&self, key: KernelKey) -> KernelKey {
        key.workgroup_size(self.invocations())
            .shape("token_lanes", self.token_lanes)
            .shape("column_lanes", self.column_lanes)
            .shape("pitch", self.pitch)
            .shape("round_sums", self.round_sums)
            .shape("span", self.span)
    }

    fn from_key(k: &mut KernelBuilder) -> DownTile {
        DownTile {
            token_lanes: k.shape("token_lanes"),
            column_lanes: k.shape("column_lanes"),
            pitch: k.shape("pitch"),
            round_sums: k.shape("round_sums"),
            span: k.shape("span"),
        }
    }
}

pub(super) fn key(n: u32, r: u32, layout: Layout, tile: DownTile) -> KernelKey {
    // Workgroup and register indices are in range by construction, token and column indices
    // clamped or guarded: no runtime bounds checks (so in `lora_up`, `lora_weight_grad_sum`).
    tile.shapes(adapter_key("lora_down", n, r, layout))
        .assume_in_bounds()
}

/// `out[t, k] = Σ_i a[t, i]·W(i, k)` for `k < r`. The step's slice of `a` is read with wide,
/// coalesced loads (the next step's while this one computes) and staged transposed in workgroup
/// memory; invocation `(ks, tq)` then multiplies four of its columns into its four tokens × `r`
/// sums, reading `W` rows that its neighbours share. The `column_lanes` partial sums of each
/// output are added in workgroup memory at the end.
pub(super) fn body(k: &mut KernelBuilder) {
    by_width(k, body_with::<Vec4<f32>>, body_with::<f32>)
}

fn body_with<C: Columns>(k: &mut KernelBuilder) {
    let (n, r, layout) = adapter_shapes(k);
    let tile = DownTile::from_key(k);
    let (wg, step_cols) = (tile.invocations(), tile.step());
    let groups = n / C::N;
    let a = k.storage::<C>("a");
    // `B`'s rows of `r` values are read as vec4s; `A`'s columns element by element.
    let w = match layout {
        Layout::RankMinor => RankRows::declare(k, "w", r),
        Layout::RankMajor => RankRows::Scalar(k.storage("w")),
    };
    let out = k.storage_rw::<f32>("out");
    let tokens = k.param::<u32>("tokens");
    // The step's slice of `a`, column-major, `pitch` floats per column.
    let pitch = tile.pitch;
    let slice = k.workgroup_array::<f32>("slice", step_cols * pitch);
    let partial = k.workgroup_array::<f32>("partial", wg * tile.round_sums);
    let slice_sums = tile.column_lanes / tile.span * tile.token_lanes * tile.round_sums;
    let group_sums = k.workgroup_array::<f32>("group_sums", slice_sums);
    let lid = k.let_("lid", k.local_index());
    let ks = k.let_("ks", &lid / tile.token_lanes);
    let tq = k.let_("tq", &lid % tile.token_lanes);
    let t0 = k.let_("t0", k.workgroup_index() * tile.tokens());
    let last = k.let_("last", &tokens - 1u32);

    // The loads of a step: the slice's `tokens × step/N` wide elements, shared out 32 at a time
    // as 4 tokens × 8 consecutive elements (whole 128-byte rows of memory when wide, and
    // transposing stores in distinct banks). Rows past the last token read the last one (their
    // sums are never stored); columns past `n` read zero.
    let per_row = step_cols / C::N;
    let loads = tile.tokens() * per_row / wg;
    // Per load: the slice row (token) and wide column it fills, and where its token's row starts.
    let slots: Vec<(Expr<u32>, Expr<u32>, Expr<u32>)> = (0..loads)
        .map(|j| {
            let e = k.let_("e", &lid + j * wg);
            let (chunk, lane) = (k.let_("chunk", &e / 32u32), k.let_("lane", &e % 32u32));
            let across = per_row / 8;
            let tr = k.let_("tr", &lane / 8u32 + (&chunk / across) * 4u32);
            let cq = k.let_("cq", &lane % 8u32 + (&chunk % across) * 8u32);
            let row = k.let_("row", (&t0 + &tr).min(&last) * groups);
            (tr, cq, row)
        })
        .collect();
    let next: Vec<_> = (0..loads)
        .map(|_| k.var("next", C::splat(lit(0.0f32))))
        .collect();
    let fetch = |k: &mut KernelBuilder, step: &Expr<u32>| {
        for ((_, cq, row), next) in slots.iter().zip(&next) {
            let g = k.let_("g", step * per_row + cq);
            if n.is_multiple_of(step_cols) {
                k.assign(next, a.at(row + &g));
            } else {
                let value = a.at(row + g.min(groups - 1));
                k.assign(next, select(g.lt(groups), value, C::splat(lit(0.0f32))));
            }
        }
    };
    let stage = |k: &mut KernelBuilder| {
        for ((tr, cq, _), next) in slots.iter().zip(&next) {
            for (c, lane) in C::lanes(&next.get()).into_iter().enumerate() {
                k.store(&slice, (cq * C::N + c as u32) * pitch + tr, lane);
            }
        }
    };
    // `acc[j·r + kk] = Σ_i x[t_j, i]·W(i, kk)` over the invocation's columns, for its tokens
    // `t_j = t0 + tq + token_lanes·j`. Indexed by Rust constants only, so the sums stay in
    // registers.
    let acc: LocalArray<f32> = k.var_array("acc", 4 * r);
    for o in 0..4 * r {
        k.store(&acc, o, 0.0f32);
    }
    let steps = n.div_ceil(step_cols);
    fetch(k, &lit(0u32));
    stage(k);
    k.workgroup_barrier();
    k.for_range("step", 0u32, steps, |k, step| {
        let more = k.let_("more", (&step + 1u32).lt(steps));
        k.comment("Read the next step's slice into registers while this one computes.");
        k.if_(&more, |k| fetch(k, &(&step + 1u32)));
        for c in 0..4u32 {
            // Column `i` of the row: `x = a[t_j, i]` from the slice, `w = W(i, kk)` from memory.
            let col = k.let_("col", &ks * 4u32 + c);
            let i = k.let_("i", (&step * step_cols + &col).min(n - 1));
            let xs: Vec<Expr<f32>> = (0..4u32)
                .map(|j| {
                    let at = &col * pitch + offset(&tq, tile.token_lanes * j);
                    k.let_("x", slice.at(at))
                })
                .collect();
            let ws = match (&w, layout) {
                (w, Layout::RankMinor) => w.row(k, &i, r),
                (RankRows::Scalar(w), Layout::RankMajor) => (0..r)
                    .map(|kk| k.let_("w", w.at(layout.at(&i, kk, n, r))))
                    .collect(),
                (RankRows::Vec4(_), Layout::RankMajor) => unreachable!("A is read by element"),
            };
            for (kk, wk) in ws.iter().enumerate() {
                for (j, x) in xs.iter().enumerate() {
                    k.store_op(&acc, j as u32 * r + kk as u32, BinaryOp::Add, x * wk);
                }
            }
        }
        k.workgroup_barrier();
        k.if_(&more, stage);
        k.workgroup_barrier();
    });
    let sums = Sums {
        acc: &acc,
        partial: &partial,
        group_sums: &group_sums,
    };
    add_slices(k, &tile, &sums, (&lid, &ks, &tq, &t0), (&out, &tokens), r);
}

/// `lora_down`'s register sums and its workgroup arrays for adding them up.
struct Sums<'a> {
    acc: &'a LocalArray<f32>,
    partial: &'a WorkgroupArray<f32>,
    group_sums: &'a WorkgroupArray<f32>,
}

/// `out[t, kk] = Σ_ks acc_(ks, tq)[j·r + kk]`: the column slices' partial sums added, `round_sums`
/// outputs per invocation a round, in two levels so that every invocation helps: groups of
/// `span` slices, then the groups.
fn add_slices(
    k: &mut KernelBuilder,
    tile: &DownTile,
    sums: &Sums<'_>,
    (lid, ks, tq, t0): (&Expr<u32>, &Expr<u32>, &Expr<u32>, &Expr<u32>),
    (out, tokens): (&RwBuffer<f32>, &Expr<u32>),
    r: u32,
) {
    let Sums {
        acc,
        partial,
        group_sums,
    } = *sums;
    let (token_lanes, round_sums, span) = (tile.token_lanes, tile.round_sums, tile.span);
    k.comment("Add the column slices' partial sums, `round_sums` per invocation a round.");
    let slice_groups = tile.column_lanes / span;
    for pass in 0..(4 * r).div_ceil(round_sums) {
        let outputs: Vec<u32> = (pass * round_sums..((pass + 1) * round_sums).min(4 * r)).collect();
        let len = outputs.len() as u32;
        let count = token_lanes * len;
        for (c, o) in outputs.iter().enumerate() {
            let at = (ks * token_lanes + tq) * round_sums + c as u32;
            k.store(partial, at, acc.at(*o));
        }
        k.workgroup_barrier();
        k.if_(lid.lt(slice_groups * count), |k| {
            let group = k.let_("group", lid / count);
            let at = k.let_("at", lid % count);
            let otq = k.let_("otq", &at / len);
            let c = k.let_("c", &at % len);
            let total = k.var("total", 0.0f32);
            for q in 0..span {
                let s = k.let_("s", &group * span + q);
                k.add_assign(
                    &total,
                    partial.at((&s * token_lanes + &otq) * round_sums + &c),
                );
            }
            k.store(group_sums, &group * count + &at, total.get());
        });
        k.workgroup_barrier();
        k.if_(lid.lt(count), |k| {
            let total = k.var("total", 0.0f32);
            for g in 0..slice_groups {
                k.add_assign(&total, group_sums.at(offset(lid, g * count)));
            }
            // Output `o` of the round is token `o / r` of the invocation's four, rank `o % r`.
            let otq = k.let_("otq", lid / len);
            let o = k.let_("o", lid % len + pass * round_sums);
            let token = k.let_("token", t0 + &otq + &o / r * token_lanes);
            k.if_(token.lt(tokens), |k| {
                k.store(out, &token * r + &o % r, total.get())
            });
        });
        k.workgroup_barrier();
    }
}

/// `out = a·W(·, k)` for `a: [T, n]`: through `lora_down_subgroups` or `lora_down` for small
/// ranks, else the GEMM.
pub(super) fn project(
    rec: &mut Recorder<'_>,
    (a, w, out): (&GpuBuffer<f32>, &GpuBuffer<f32>, &mut GpuBuffer<f32>),
    (t, n, r): (u32, u32, u32),
    layout: Layout,
) -> Result<(), ExecError> {
    if r > MAX_RANK {
        let (t, n, r) = (t as usize, n as usize, r as usize);
        return match layout {
            Layout::RankMajor => linear::execute_matmul_nt(rec, a, w, out, t, r, n, false),
            Layout::RankMinor => linear::execute_matmul_nn(rec, a, w, out, t, n, r, false),
        };
    }
    let sg_tile = SubgroupTile::for_tokens(t);
    let subgroups = rec
        .gpu()
        .subgroup_size()
        .filter(|&size| sg_tile.runs_on(size));
    let args = bind_columns(Args::new(), "a", a, n)
        .buffer("out", out)
        .param("tokens", t);
    // `B`'s rows of `r`; `A` wide along its rows in the subgroup kernel, by element else.
    let args = match (layout, subgroups) {
        (Layout::RankMinor, _) => bind_rank_rows(args, "w", w, r),
        (Layout::RankMajor, Some(_)) => bind_columns(args, "w", w, n),
        (Layout::RankMajor, None) => args.buffer("w", w),
    };
    let (kernel, tokens_per_group) = match subgroups {
        Some(size) => {
            sg_tile.check("lora_down_subgroups")?;
            let key = subgroups::key((n, r, Operands::One), layout, size, sg_tile);
            let kernel = rec.gpu().kernel(&key, subgroups::body)?;
            (kernel, sg_tile.tokens())
        }
        None => {
            let tile = DownTile::for_device(&rec.gpu().kernel_limits());
            tile.check("lora_down")?;
            let kernel = rec.gpu().kernel(&key(n, r, layout, tile), body)?;
            (kernel, tile.tokens())
        }
    };
    let groups = t.div_ceil(tokens_per_group);
    rec.launch(&kernel, &args, Grid::WorkgroupPerItem(groups as u64))
}

/// `out1 = a·W1` and `out2 = a2·W2` (each `[t, r]`, the weights `A`s or `B`s of one layout;
/// `second` the second product's own input and its width, else `a` for both): one launch of
/// `lora_down_subgroups` where the device has subgroups it runs, both ranks fit its sums
/// (`2r ≤ MAX_RANK`) and both widths are multiples of 4 or neither, else one launch each.
pub(super) fn project_pair(
    rec: &mut Recorder<'_>,
    (a, (w1, w2), (out1, out2)): (&GpuBuffer<f32>, WeightPair<'_>, OutPair<'_>),
    second: Option<(&GpuBuffer<f32>, u32)>,
    (t, n, r): (u32, u32, u32),
    layout: Layout,
) -> Result<(), ExecError> {
    let sg_tile = SubgroupTile::for_tokens(t);
    let size = rec
        .gpu()
        .subgroup_size()
        .filter(|&size| sg_tile.runs_on(size) && 2 * r <= MAX_RANK);
    let (a2, n2) = second.unwrap_or((a, n));
    let size = size.filter(|_| super::wide(n) == super::wide(n2));
    let Some(size) = size else {
        project(rec, (a, w1, out1), (t, n, r), layout)?;
        return project(rec, (a2, w2, out2), (t, n2, r), layout);
    };
    sg_tile.check("lora_down_subgroups")?;
    let bind_weight = |args, name, w, n| match layout {
        Layout::RankMinor => bind_rank_rows(args, name, w, r),
        Layout::RankMajor => bind_columns(args, name, w, n),
    };
    let args = bind_columns(Args::new(), "a", a, n);
    let (args, operands) = match second {
        Some((a2, n2)) => (bind_columns(args, "a2", a2, n2), Operands::PairOver(n2)),
        None => (args, Operands::Pair),
    };
    let args = bind_weight(args, "w", w1, n);
    let args = bind_weight(args, "w2", w2, n2)
        .buffer("out", out1)
        .buffer("out2", out2)
        .param("tokens", t);
    let key = subgroups::key((n, r, operands), layout, size, sg_tile);
    let kernel = rec.gpu().kernel(&key, subgroups::body)?;
    let groups = t.div_ceil(sg_tile.tokens());
    rec.launch(&kernel, &args, Grid::WorkgroupPerItem(groups as u64))
}

/// Two weights of one layout.
pub(super) type WeightPair<'a> = (&'a GpuBuffer<f32>, &'a GpuBuffer<f32>);
/// Two outputs `[t, r]`.
pub(super) type OutPair<'a> = (&'a mut GpuBuffer<f32>, &'a mut GpuBuffer<f32>);

/// The kernel at a small shape, for snapshots and review.
pub(super) fn kernels() -> Result<Vec<Kernel>, hesper_dsl::DslError> {
    let key = key(64, 1, Layout::RankMinor, DownTile::DEFAULT);
    Ok(vec![Kernel::build(&key, body)?])
}

/// `lora_down` at any shape and tile (`[token_lanes, column_lanes, pitch, round_sums, span]`),
/// within `limits`, for [`crate::catalog`]: the rank and the tile checked first.
pub(crate) fn build_at(
    (n, r, rank_minor): (u32, u32, bool),
    [token_lanes, column_lanes, pitch, round_sums, span]: [u32; 5],
    limits: &Limits,
) -> Result<Kernel, Failure> {
    let tile = DownTile {
        token_lanes,
        column_lanes,
        pitch,
        round_sums,
        span,
    };
    super::check_width(n)?;
    super::check_rank(r)?;
    tile.check("lora_down")?;
    let key = key(n, r, Layout::from_shape(rank_minor), tile);
    Ok(Kernel::build_with_limits(&key, limits, body)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both tiles pass their checks and use the workgroup memory `workgroup_bytes` says (what
    /// `for_device` chooses by); `PORTABLE` fits WebGPU's 16 KiB.
    #[test]
    fn tiles_use_the_workgroup_memory_they_say() {
        assert!(DownTile::PORTABLE.workgroup_bytes() <= 16 * 1024);
        for tile in [DownTile::DEFAULT, DownTile::PORTABLE] {
            tile.check("lora_down").unwrap();
            let key = key(64, 4, Layout::RankMinor, tile);
            let kernel = Kernel::build(&key, body).unwrap();
            assert_eq!(
                kernel.workgroup_memory_bytes(),
                tile.workgroup_bytes(),
                "{key}"
            );
        }
    }

    #[test]
    fn default_tile_passes_its_check_and_a_broken_one_says_why() {
        DownTile::DEFAULT.check("lora_down").unwrap();
        let broken = DownTile {
            round_sums: 16,
            ..DownTile::DEFAULT
        };
        let err = broken.check("lora_down").unwrap_err().to_string();
        assert!(err.contains("round_sums must not exceed span"), "{err}");
        let ragged = DownTile {
            column_lanes: 60,
            ..DownTile::DEFAULT
        };
        let err = ragged.check("lora_down").unwrap_err().to_string();
        assert!(
            err.contains("column_lanes must be a positive multiple of 8"),
            "{err}"
        );
    }
}
