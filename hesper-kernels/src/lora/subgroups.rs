//! `lora_down_subgroups`: the products into `r` of [`super::down`] (`out[t, k] =
//! Σ_i a[t, i]·W(i, k)` for `k < r`) on a device with subgroups of one known size, the
//! reduction along each row done by a butterfly of subgroup shuffles.

use hesper_dsl::ReadBuffer;
use hesper_dsl::prelude::*;
use hesper_exec::ExecError;

use super::{Layout, MAX_RANK, RankRows, adapter_key, adapter_shapes, by_width};
use crate::catalog::Failure;
use crate::linear::offset;
use crate::{Columns, bad_tile};

/// `lora_down_subgroups`' block sizes: `invocations` per workgroup (the key's workgroup size),
/// `group_tokens` tokens per workgroup, `unroll` token rows read before computing. Carried in
/// the key; [`SubgroupTile::check`] says which rule a tile breaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct SubgroupTile {
    invocations: u32,
    group_tokens: u32,
    unroll: u32,
}

impl SubgroupTile {
    pub(super) const DEFAULT: SubgroupTile = SubgroupTile {
        invocations: 256,
        group_tokens: 16,
        unroll: 4,
    };

    /// The tile for `tokens` rows: [`SubgroupTile::DEFAULT`] with 8 tokens a workgroup where
    /// 16 would give fewer than 512 workgroups (the SmolLM2 step's 4096 tokens: 256).
    pub(super) fn for_tokens(tokens: u32) -> SubgroupTile {
        let d = SubgroupTile::DEFAULT;
        match tokens.div_ceil(d.group_tokens) >= 512 {
            true => d,
            false => SubgroupTile {
                group_tokens: 8,
                ..d
            },
        }
    }

    /// Tokens per workgroup.
    pub(super) fn tokens(&self) -> u32 {
        self.group_tokens
    }
    /// Whether the kernel runs on subgroups of `size`: 8 to `invocations` of them, dividing it
    /// (with fewer, the subgroups' sums of a batch would outgrow workgroup memory at the
    /// largest ranks).
    pub(super) fn runs_on(&self, size: u32) -> bool {
        (8..=self.invocations).contains(&size) && self.invocations.is_multiple_of(size)
    }

    /// `Ok` when `lora_down_subgroups` can run this tile; else an error naming `kernel` and the
    /// rule.
    pub(super) fn check(&self, kernel: &str) -> Result<(), ExecError> {
        let fail = |why: &str| Err(bad_tile(kernel, self, why));
        if self.unroll == 0 || !self.group_tokens.is_multiple_of(self.unroll) {
            return fail("group_tokens must be a multiple of a positive unroll");
        }
        // One invocation adds up each of a batch's `unroll × padded rank` totals.
        if self.unroll * MAX_RANK.next_power_of_two() > self.invocations {
            return fail("unroll × the largest (padded) rank must not exceed the invocations");
        }
        Ok(())
    }

    fn from_key(k: &mut KernelBuilder) -> SubgroupTile {
        SubgroupTile {
            invocations: k.invocations(),
            group_tokens: k.shape("group_tokens"),
            unroll: k.shape("unroll"),
        }
    }
}

/// What a `lora_down_subgroups` launch multiplies: one weight, or a pair of weights over the
/// same input or over two inputs of their own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Operands {
    One,
    /// Two weights of `n` over `a`: `out = a·W`, `out2 = a·W2`.
    Pair,
    /// The second weight over its own input `a2` of this width: `out2 = a2·W2` (the weight
    /// gradients' `dy·B` of a layer's query and value adapters, 576 and 192 wide in SmolLM2).
    PairOver(u32),
}

impl Operands {
    fn is_pair(self) -> bool {
        self != Operands::One
    }
    /// The width of the second input (0: none of its own).
    fn second_n(self) -> u32 {
        match self {
            Operands::PairOver(n2) => n2,
            Operands::One | Operands::Pair => 0,
        }
    }
}

/// The key for subgroups of `subgroup_size` invocations.
pub(super) fn key(
    (n, r, operands): (u32, u32, Operands),
    layout: Layout,
    subgroup_size: u32,
    tile: SubgroupTile,
) -> KernelKey {
    // Bounds checks stay: its workgroup indices hold only if the device runs full subgroups of
    // exactly the size it reports (wgpu does not require full subgroups), and on the H200
    // dropping them gained nothing here.
    adapter_key("lora_down_subgroups", n, r, layout)
        .shape("pair", operands.is_pair())
        .shape("second_n", operands.second_n())
        .workgroup_size(tile.invocations)
        .shape("lanes", subgroup_size)
        .shape("group_tokens", tile.group_tokens)
        .shape("unroll", tile.unroll)
        .features(Features::SUBGROUPS)
}

/// Invocation `lane` of subgroup `sg` owns one wide element of each `invocations`-element chunk
/// of the row, keeps its columns' `r` weights in registers, and for each token multiplies them
/// into `r` sums over its columns. A butterfly of `subgroup_shuffle_xor`s adds those over the
/// subgroup while halving them, so that no sum crosses workgroup memory until the subgroup has
/// one set; the subgroups' sets are then added in workgroup memory, `unroll` tokens at a time.
/// (Keeping each invocation's sums in registers over all the chunks instead, with no barrier,
/// measured slower on the H200: 47 against 43 µs at 4096 × 2560.)
pub(super) fn body(k: &mut KernelBuilder) {
    by_width(k, body_with::<Vec4<f32>>, body_with::<f32>)
}

/// The steps of a butterfly over `size` invocations holding `count` (a power of two) values
/// each: the lane mask of each exchange, and the values kept (half of them) while more than one
/// is left.
fn butterfly_steps(size: u32, mut count: u32) -> Vec<(u32, Option<u32>)> {
    let mut steps = vec![];
    let mut mask = size / 2;
    while mask >= 1 {
        let half = (count > 1).then_some(count / 2);
        count = half.unwrap_or(1);
        steps.push((mask, half));
        mask /= 2;
    }
    steps
}

/// Adds `values` (a power of two of them) over the subgroup's `size` invocations, halving them
/// at each step while more than one is left (see [`butterfly_ranks`] for which are kept).
fn subgroup_butterfly(
    k: &mut KernelBuilder,
    mut values: Vec<Expr<f32>>,
    lane: &Expr<u32>,
    size: u32,
) -> Vec<Expr<f32>> {
    for (mask, half) in butterfly_steps(size, values.len() as u32) {
        values = match half {
            Some(half) => {
                // The invocation with this lane bit set keeps the upper half of the values and
                // sends the lower half; its partner the reverse.
                let upper = k.let_("upper", (lane & mask).ne(0u32));
                let (low, high) = values.split_at(half as usize);
                low.iter()
                    .zip(high)
                    .map(|(lo, hi)| {
                        let send = select(upper.clone(), lo.clone(), hi.clone());
                        let keep = select(upper.clone(), hi.clone(), lo.clone());
                        let got = k.subgroup_shuffle_xor(send, mask);
                        k.let_("sum", keep + got)
                    })
                    .collect()
            }
            None => {
                let got = k.subgroup_shuffle_xor(values[0].clone(), mask);
                vec![k.let_("sum", &values[0] + got)]
            }
        };
    }
    values
}

/// After [`subgroup_butterfly`] of `count` values: the index of the first value an invocation
/// keeps (the others follow it), and the lane bits whose invocations keep copies of the same.
fn butterfly_ranks(lane: &Expr<u32>, size: u32, count: u32) -> (Expr<u32>, u32) {
    let mut first = lit(0u32);
    let mut copies = 0;
    for (mask, half) in butterfly_steps(size, count) {
        match half {
            Some(half) => first = first + select((lane & mask).ne(0u32), half, 0u32),
            None => copies |= mask,
        }
    }
    (first, copies)
}

/// A weight of `lora_down_subgroups`: `B` (`[n, r]`), a column's `r` weights a row; or `A`
/// (`[r, n]`), one wide read per rank.
enum DownWeight<C: Columns> {
    Rows(RankRows),
    Columns(ReadBuffer<C>),
}

impl<C: Columns> DownWeight<C> {
    fn declare(k: &mut KernelBuilder, name: &str, layout: Layout, r: u32) -> Self {
        match layout {
            Layout::RankMinor => DownWeight::Rows(RankRows::declare(k, name, r)),
            Layout::RankMajor => DownWeight::Columns(k.storage::<C>(name)),
        }
    }

    /// `W(column c of wide element gc, kk)` for each of its `C::N` columns `c` and `kk < r`.
    fn at(
        &self,
        k: &mut KernelBuilder,
        gc: &Expr<u32>,
        (r, groups): (u32, u32),
    ) -> Vec<Vec<Expr<f32>>> {
        let mut ws: Vec<Vec<Expr<f32>>> = vec![vec![]; C::N as usize];
        match self {
            DownWeight::Rows(rows) => {
                for (c, wc) in ws.iter_mut().enumerate() {
                    let col = k.let_("col", gc * C::N + c as u32);
                    *wc = rows.row(k, &col, r);
                }
            }
            DownWeight::Columns(cols) => {
                for kk in 0..r {
                    let wide_w = k.let_("w", cols.at(gc + kk * groups));
                    for (c, lane_w) in C::lanes(&wide_w).into_iter().enumerate() {
                        ws[c].push(lane_w);
                    }
                }
            }
        }
        ws
    }
}

fn body_with<C: Columns>(k: &mut KernelBuilder) {
    let (n, r, layout) = adapter_shapes(k);
    let pair = k.shape::<bool>("pair");
    let second_n = k.shape::<u32>("second_n");
    let size = k.shape::<u32>("lanes");
    let tile = SubgroupTile::from_key(k);
    let (wg, group_tokens, unroll) = (tile.invocations, tile.group_tokens, tile.unroll);
    let groups = n / C::N;
    // With a second input, its wide elements follow the first's along the chunks.
    let groups2 = second_n / C::N;
    let all_groups = groups + groups2;
    let subgroups = wg / size;
    // A pair's sums are the first weight's `r` then the second's.
    let sums_r = if pair { 2 * r } else { r };
    let padded = sums_r.next_power_of_two();
    let a = k.storage::<C>("a");
    let a2 = (groups2 > 0).then(|| k.storage::<C>("a2"));
    let w = DownWeight::<C>::declare(k, "w", layout, r);
    let w2 = pair.then(|| DownWeight::<C>::declare(k, "w2", layout, r));
    let out = k.storage_rw::<f32>("out");
    let out2 = pair.then(|| k.storage_rw::<f32>("out2"));
    let tokens = k.param::<u32>("tokens");
    // Each subgroup's sums for `unroll` tokens, and the workgroup's running totals.
    let batch = k.workgroup_array::<f32>("batch", subgroups * unroll * padded);
    let totals = k.workgroup_array::<f32>("totals", group_tokens * padded);
    let lid = k.let_("lid", k.local_index());
    let sg = k.let_("sg", k.subgroup_id());
    let lane = k.let_("lane", k.subgroup_invocation_id());
    let t0 = k.let_("t0", k.workgroup_index() * group_tokens);
    let last = k.let_("last", &tokens - 1u32);
    // After the butterfly an invocation holds consecutive ranks from `first` on.
    let (first, copies) = butterfly_ranks(&lane, size, padded);
    let first = k.let_("first", first);
    // Token `j` of a batch, rank `kk`: total `j·padded + kk` of the batch, added up by
    // invocation `j·padded + kk` (the same one every chunk).
    let summers = unroll * padded;
    for i in 0..(group_tokens * padded).div_ceil(wg) {
        let at = k.let_("at", offset(&lid, i * wg));
        k.if_(at.lt(group_tokens * padded), |k| {
            k.store(&totals, &at, 0.0f32)
        });
    }
    k.workgroup_barrier();
    k.for_range("chunk", 0u32, all_groups.div_ceil(wg), |k, chunk| {
        let g = k.let_("g", &chunk * wg + &sg * size + &lane);
        let live = k.let_("live", g.lt(groups));
        let gc = k.let_("gc", g.min(groups - 1));
        // With a second input: the invocation's wide element of it, where `g` is past the
        // first's (else its first, read and multiplied by zeros).
        let second = (groups2 > 0).then(|| {
            let live2 = k.let_("live2", g.ge(groups).and(g.lt(all_groups)));
            let gc2 = k.let_("gc2", select(live2.clone(), &g - groups, lit(0u32)));
            (live2, gc2)
        });
        // ws[c][kk] = W(column c of the invocation's, kk) (a pair's second weight from
        // kk = r on), zero past the row's end (so that the invocation adds nothing) and, with
        // a second input, zero where the invocation's element is of the other input.
        let mut ws = w.at(k, &gc, (r, groups));
        if let Some(w2) = &w2 {
            let (gc2, groups_of_w2) = match &second {
                Some((_, gc2)) => (gc2, groups2),
                None => (&gc, groups),
            };
            for (wc, w2c) in ws.iter_mut().zip(w2.at(k, gc2, (r, groups_of_w2))) {
                wc.extend(w2c);
            }
        }
        let ws: Vec<Vec<Expr<f32>>> = ws
            .into_iter()
            .map(|wc| {
                (wc.into_iter().enumerate())
                    .map(|(kk, w)| {
                        let ok = match &second {
                            Some((live2, _)) if kk >= r as usize => live2.clone(),
                            _ => live.clone(),
                        };
                        k.let_("w", select(ok, w, 0.0f32))
                    })
                    .collect()
            })
            .collect();
        k.for_range("b", 0u32, group_tokens / unroll, |k, b| {
            // Rows past the last token read the last one: their sums are never stored.
            let xs: Vec<Expr<C>> = (0..unroll)
                .map(|j| {
                    let t = k.let_("t", (&t0 + &b * unroll + j).min(&last));
                    let x = a.at(&t * groups + &gc);
                    // Both reads, one of them wasted: the element of the input an invocation
                    // does not take is one its subgroup shares (the first input's last, the
                    // second's first), a single read.
                    let x = match (&a2, &second) {
                        (Some(a2), Some((live2, gc2))) => {
                            select(live2.clone(), a2.at(&t * groups2 + gc2), x)
                        }
                        _ => x,
                    };
                    k.let_("x", x)
                })
                .collect();
            for (j, x) in xs.iter().enumerate() {
                let x = C::lanes(x);
                let sums: Vec<Expr<f32>> = (0..padded)
                    .map(|kk| {
                        if kk < sums_r {
                            let dot = (0..C::N as usize)
                                .map(|c| &x[c] * &ws[c][kk as usize])
                                .reduce(|p, q| p + q)
                                .expect("at least one column");
                            k.let_("p", dot)
                        } else {
                            lit(0.0f32)
                        }
                    })
                    .collect();
                let sums = subgroup_butterfly(k, sums, &lane, size);
                k.if_((&lane & copies).eq(0u32), |k| {
                    for (q, sum) in sums.iter().enumerate() {
                        let at = (&sg * unroll + j as u32) * padded + offset(&first, q as u32);
                        k.store(&batch, at, sum.clone());
                    }
                });
            }
            k.workgroup_barrier();
            k.if_(lid.lt(summers), |k| {
                let total = (0..subgroups)
                    .map(|s| batch.at(offset(&lid, s * summers)))
                    .reduce(|p, q| p + q)
                    .expect("at least one subgroup");
                k.store_op(&totals, &b * summers + &lid, BinaryOp::Add, total);
            });
            k.workgroup_barrier();
        });
    });
    k.if_(lid.lt(summers), |k| {
        let kk = k.let_("kk", &lid % padded);
        for b in 0..group_tokens / unroll {
            let token = k.let_("token", &t0 + b * unroll + &lid / padded);
            let total = totals.at(offset(&lid, b * summers));
            k.if_(token.lt(&tokens).and(kk.lt(r)), |k| {
                k.store(&out, &token * r + &kk, total.clone());
            });
            if let Some(out2) = &out2 {
                let second = kk.ge(r).and(kk.lt(2 * r));
                k.if_(token.lt(&tokens).and(second), |k| {
                    k.store(out2, &token * r + &kk - r, total);
                });
            }
        }
    });
}

/// The kernel at a small shape, for snapshots and review.
pub(super) fn kernels() -> Result<Vec<Kernel>, hesper_dsl::DslError> {
    let key_of = |operands, layout| key((64, 2, operands), layout, 32, SubgroupTile::DEFAULT);
    Ok(vec![
        Kernel::build(&key_of(Operands::One, Layout::RankMinor), body)?,
        Kernel::build(&key_of(Operands::Pair, Layout::RankMajor), body)?,
        Kernel::build(&key_of(Operands::PairOver(48), Layout::RankMinor), body)?,
    ])
}

/// `lora_down_subgroups` for subgroups of `lanes` at any shape and tile (`[invocations,
/// group_tokens, unroll]`), within `limits`, for [`crate::catalog`]: the rank, the tile and the
/// subgroup size checked first.
pub(crate) fn build_at(
    (n, r, rank_minor): (u32, u32, bool),
    (pair, second_n, lanes): (bool, u32, u32),
    [invocations, group_tokens, unroll]: [u32; 3],
    limits: &Limits,
) -> Result<Kernel, Failure> {
    let name = "lora_down_subgroups";
    let tile = SubgroupTile {
        invocations,
        group_tokens,
        unroll,
    };
    super::check_width(n)?;
    super::check_rank(r)?;
    if pair && 2 * r > MAX_RANK {
        return Err(Failure::rule(
            format!("rank = {r} with pair"),
            format!("a pair sums both weights' ranks: 2·rank at most {MAX_RANK}"),
        ));
    }
    let operands = match (pair, second_n) {
        (false, 0) => Operands::One,
        (true, 0) => Operands::Pair,
        (true, n2) if super::wide(n2) == super::wide(n) => Operands::PairOver(n2),
        (true, n2) => {
            return Err(Failure::rule(
                format!("n = {n}, second_n = {n2}"),
                "both inputs' widths multiples of 4, or neither".into(),
            ));
        }
        (false, n2) => {
            return Err(Failure::rule(
                format!("second_n = {n2} without pair"),
                "a second input takes a second weight: pair".into(),
            ));
        }
    };
    tile.check(name)?;
    if !tile.runs_on(lanes) {
        return Err(Failure::rule(
            format!("lanes = {lanes}"),
            format!("the subgroup size must be 8 to {invocations} and divide it"),
        ));
    }
    let key = key(
        (n, r, operands),
        Layout::from_shape(rank_minor),
        lanes,
        tile,
    );
    Ok(Kernel::build_with_limits(&key, limits, body)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Subgroup sizes, ranks and widths no test device runs: every `lora_down_subgroups` the
    /// executor may pick must build (naga validates it, workgroup memory within 32 KiB).
    #[test]
    fn subgroup_down_builds_for_every_size_it_is_chosen_for() {
        for size in [8, 16, 32, 64, 128, 256] {
            for r in [1, 3, 4, 6, 12, 16, 17, 32] {
                for n in [7, 64, 2560] {
                    for layout in [Layout::RankMajor, Layout::RankMinor] {
                        // A pair sums both weights' ranks: up to MAX_RANK in all. A second
                        // input as wide as the first or by a whole vec4 less (`PairOver`
                        // needs both widths wide or neither).
                        let pairs = [Operands::Pair, Operands::PairOver(n.max(5) - 4)];
                        let pairs = pairs.into_iter().filter(|_| 2 * r <= MAX_RANK);
                        for operands in std::iter::once(Operands::One).chain(pairs) {
                            let key = key((n, r, operands), layout, size, SubgroupTile::DEFAULT);
                            if let Err(e) = Kernel::build(&key, body) {
                                panic!(
                                    "size {size}, rank {r}, width {n}, {layout:?}, \
                                     {operands:?}: {e}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// The butterfly's bookkeeping against its data movement, on the host: after the
    /// exchanges `subgroup_butterfly` makes, the invocation whose lane bits are clear in
    /// `copies` holds, from `first` on, the subgroup's sums of those values.
    #[test]
    fn butterfly_ranks_name_the_sums_each_invocation_holds() {
        for size in [1u32, 2, 4, 8, 16, 32, 64, 128] {
            for count in [1u32, 2, 4, 8, 16, 32] {
                let mut vals: Vec<Vec<f64>> = (0..size)
                    .map(|lane| {
                        (0..count)
                            .map(|i| (lane * 1000 + i * 7 + 1) as f64)
                            .collect()
                    })
                    .collect();
                let steps = butterfly_steps(size, count);
                for &(mask, half) in &steps {
                    vals = (0..size as usize)
                        .map(|lane| {
                            let partner = lane ^ mask as usize;
                            match half {
                                Some(h) => {
                                    let (h, upper) = (h as usize, lane & mask as usize != 0);
                                    (0..h)
                                        .map(|j| {
                                            // Keep one half, receive the partner's other half.
                                            let (keep, got) = if upper {
                                                (vals[lane][j + h], vals[partner][j + h])
                                            } else {
                                                (vals[lane][j], vals[partner][j])
                                            };
                                            keep + got
                                        })
                                        .collect()
                                }
                                None => vec![vals[lane][0] + vals[partner][0]],
                            }
                        })
                        .collect();
                }
                let copies: u32 = steps
                    .iter()
                    .filter(|(_, half)| half.is_none())
                    .map(|(mask, _)| mask)
                    .sum();
                for lane in 0..size {
                    let first: u32 = steps
                        .iter()
                        .filter_map(|&(mask, half)| half.filter(|_| lane & mask != 0))
                        .sum();
                    for (q, got) in vals[lane as usize].iter().enumerate() {
                        let i = first + q as u32;
                        let want: f64 = (0..size).map(|l| (l * 1000 + i * 7 + 1) as f64).sum();
                        assert_eq!(
                            *got, want,
                            "size {size}, count {count}, lane {lane}, rank {i}"
                        );
                    }
                    // Invocations that differ only in `copies` bits hold the same sums.
                    let twin = (lane & !copies) as usize;
                    assert_eq!(
                        vals[lane as usize], vals[twin],
                        "size {size}, count {count}"
                    );
                }
                assert_eq!(vals[0].len() as u32, (count / size).max(1));
            }
        }
    }

    #[test]
    fn default_tile_passes_its_check_and_a_broken_one_says_why() {
        SubgroupTile::DEFAULT.check("lora_down_subgroups").unwrap();
        let ragged = SubgroupTile {
            unroll: 3,
            ..SubgroupTile::DEFAULT
        };
        let err = ragged.check("lora_down_subgroups").unwrap_err().to_string();
        assert!(err.contains("group_tokens must be a multiple"), "{err}");
        let narrow = SubgroupTile {
            invocations: 64,
            ..SubgroupTile::DEFAULT
        };
        let err = narrow.check("lora_down_subgroups").unwrap_err().to_string();
        assert!(err.contains("must not exceed the invocations"), "{err}");
    }
}
