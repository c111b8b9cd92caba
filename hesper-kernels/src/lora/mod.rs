//! LoRA on one projection `W` (KERNELS.md): `A` is `[r, in]`, `B` is `[out, r]`, scale `s`.
//!
//! Forward: `h = x·Aᵀ` (`[T, r]`, saved), `y += s·h·Bᵀ`.
//! Backward, contracting through `r` first (never forming `B·A`), in Hesper's names:
//! - `grad_dh`:    `dh = dy·B`                 `[T, r]`
//! - `grad_b`:     `dB = s·dyᵀ·h`              `[out, r]`
//! - `grad_a`:     `dA = s·dhᵀ·x`              `[r, in]`
//! - `input_grad`: `dx += s·dh·A`              `[T, in]` (added: `dx` also gets `dy·W`)
//!
//! Every product here is a stream over a `[T, width]` matrix with a small `r` beside it, so each
//! kernel keeps its `r`-sized state in registers and reads the big operand once, four columns
//! at a time when the width allows:
//! - `lora_down_subgroups` / `lora_down`: the products into `r` (`x·Aᵀ`, `dy·B`), a reduction
//!   along each row: with subgroups of one known size, a butterfly of shuffles over each
//!   subgroup's columns; else a slice of rows staged transposed in workgroup memory;
//! - `lora_up`: the products out of `r` (`s·h·Bᵀ`, `s·dh·A`), which read and write each output
//!   once;
//! - the weight gradients `G(j, k) = scale·Σ_t u[t, j]·v[t, k]` (`dB`, `dA`), summed over tokens
//!   in two passes: partials per block of 256 tokens, then a sum over blocks (no float atomics).
//!
//! Ranks past 32 (more sums than registers) go through the tiled GEMM ([`crate::linear`]).

use hesper_dsl::prelude::*;
use hesper_dsl::{LocalArray, ReadBuffer};
use hesper_exec::{Args, ExecError, GpuBuffer, Grid, Recorder};

use crate::linear::{self, Product, Tile, Weights, offset};
use crate::{Columns, expect_len, expect_u32};

/// Elementwise kernels' workgroup.
const WG: u32 = 256;

/// How a weight is laid out relative to the `r` axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Layout {
    /// `A: [r, n]` — element `(j, k)` at `k·n + j`.
    RankMajor,
    /// `B: [n, r]` — element `(j, k)` at `j·r + k`.
    RankMinor,
}

impl Layout {
    /// The layout as a kernel-key shape.
    fn is_rank_minor(self) -> bool {
        self == Layout::RankMinor
    }
    fn from_shape(rank_minor: bool) -> Self {
        if rank_minor {
            Layout::RankMinor
        } else {
            Layout::RankMajor
        }
    }
    /// Index of element `(j, k)` of an `n × r` weight.
    fn at(self, j: &Expr<u32>, k: impl IntoExpr<u32>, n: u32, r: u32) -> Expr<u32> {
        match self {
            Layout::RankMajor => k.into_expr() * n + j,
            Layout::RankMinor => j * r + k.into_expr(),
        }
    }
}

/// Whether rows of width `n` are read as vec4s.
fn wide(n: u32) -> bool {
    n.is_multiple_of(4)
}

/// The wide elements of a row of width `n`: vec4s, or single floats.
fn row_elements(n: u32) -> u32 {
    if wide(n) { n / 4 } else { n }
}

/// Rows of `r` values (`h`, `dh`: `[T, r]`), read as `r/4` vec4s when `r` allows.
enum RankRows {
    Vec4(ReadBuffer<Vec4<f32>>),
    Scalar(ReadBuffer<f32>),
}

impl RankRows {
    fn declare(k: &mut KernelBuilder, name: &str, r: u32) -> Self {
        if wide(r) {
            RankRows::Vec4(k.storage(name))
        } else {
            RankRows::Scalar(k.storage(name))
        }
    }
    /// The `r` values of row `t`, bound to names.
    fn row(&self, k: &mut KernelBuilder, t: &Expr<u32>, r: u32) -> Vec<Expr<f32>> {
        match self {
            RankRows::Vec4(v) => (0..r / 4)
                .flat_map(|q| {
                    let quad = k.let_("v", v.at(t * (r / 4) + q));
                    <Vec4<f32> as Columns>::lanes(&quad)
                })
                .collect(),
            RankRows::Scalar(v) => (0..r).map(|kk| k.let_("v", v.at(t * r + kk))).collect(),
        }
    }
}

fn bind_rank_rows<'a>(args: Args<'a>, name: &'a str, buf: &'a GpuBuffer<f32>, r: u32) -> Args<'a> {
    if wide(r) {
        args.buffer_vec4(name, buf)
    } else {
        args.buffer(name, buf)
    }
}

fn bind_columns<'a>(args: Args<'a>, name: &'a str, buf: &'a GpuBuffer<f32>, n: u32) -> Args<'a> {
    if wide(n) {
        args.buffer_vec4(name, buf)
    } else {
        args.buffer(name, buf)
    }
}

/// Ranks up to this go through `lora_down` and `lora_up` (their sums and weights live in
/// registers); larger ones through the tiled GEMM.
const DOWN_MAX_RANK: u32 = 32;
/// `lora_down`'s tile: `DOWN_TQ` invocations along the tokens (four tokens each) times
/// `DOWN_KS` along the columns (four columns each per step).
const DOWN_TQ: u32 = 4;
const DOWN_KS: u32 = 64;
const DOWN_TOKENS: u32 = 4 * DOWN_TQ;
const DOWN_STEP: u32 = 4 * DOWN_KS;
/// Floats per column of `lora_down`'s staged slice (see `down_with`).
const DOWN_PITCH: u32 = 18;
/// Partial sums per invocation per round of `lora_down`'s final reduction, and column slices
/// added by one invocation in its first level.
const DOWN_ROUND: u32 = 8;
const DOWN_SPAN: u32 = 8;

/// The key of kernel `name` over rows `n` wide, with a rank-`r` weight laid out as `layout`.
fn adapter_key(name: &str, n: u32, r: u32, layout: Layout) -> KernelKey {
    KernelKey::new(name)
        .workgroup_size(WG)
        .shape("n", n)
        .shape("rank", r)
        .shape("rank_minor", layout.is_rank_minor())
}

/// Builds `body` for the row width `n` of the key: four columns an invocation when it allows.
fn by_width(k: &mut KernelBuilder, body: fn(&mut KernelBuilder), narrow: fn(&mut KernelBuilder)) {
    if wide(k.shape::<u32>("n")) {
        body(k)
    } else {
        narrow(k)
    }
}

fn down_key(n: u32, r: u32, layout: Layout) -> KernelKey {
    // Workgroup and register indices are in range by construction, token and column indices
    // clamped or guarded: no runtime bounds checks (so in `lora_up`, `lora_weight_grad_sum`).
    adapter_key("lora_down", n, r, layout).assume_in_bounds()
}

/// `out[t, k] = Σ_i a[t, i]·W(i, k)` for `k < r` — a product whose output is only `r` wide
/// (`x·Aᵀ`, `dy·B`), too narrow for the GEMM's tiles. A workgroup owns `DOWN_TOKENS` tokens and
/// walks their rows `DOWN_STEP` columns a step: the step's slice of `a` is read with wide,
/// coalesced loads (the next step's while this one computes) and staged transposed in workgroup
/// memory; invocation `(ks, tq)` then multiplies four of its columns into its four tokens × `r`
/// sums, reading `W` rows that its neighbours share. The `DOWN_KS` partial sums of each output
/// are added in workgroup memory at the end.
fn down(k: &mut KernelBuilder) {
    by_width(k, down_with::<Vec4<f32>>, down_with::<f32>)
}

fn down_with<C: Columns>(k: &mut KernelBuilder) {
    let (n, r) = (k.shape::<u32>("n"), k.shape::<u32>("rank"));
    let layout = Layout::from_shape(k.shape::<bool>("rank_minor"));
    let groups = n / C::N;
    let a = k.storage::<C>("a");
    // `B`'s rows of `r` values are read as vec4s; `A`'s columns element by element.
    let w = if layout == Layout::RankMinor {
        RankRows::declare(k, "w", r)
    } else {
        RankRows::Scalar(k.storage("w"))
    };
    let out = k.storage_rw::<f32>("out");
    let tokens = k.param::<u32>("tokens");
    // Column-major slice, `DOWN_PITCH` floats per column: with `4·pitch ≡ 8 (mod 32)` the
    // reads of a subgroup (8 slices × 4 tokens) fall in at most two invocations a bank.
    let pitch = DOWN_PITCH;
    let slice = k.workgroup_array::<f32>("slice", DOWN_STEP * pitch);
    let partial = k.workgroup_array::<f32>("partial", WG * DOWN_ROUND);
    let group_sums =
        k.workgroup_array::<f32>("group_sums", DOWN_KS / DOWN_SPAN * DOWN_TQ * DOWN_ROUND);
    let lid = k.let_("lid", k.local_index());
    // Invocation `(ks, tq)` owns tokens `tq + DOWN_TQ·j` (j < 4) and columns `4·ks .. 4·ks + 4`
    // of a step.
    let ks = k.let_("ks", &lid / DOWN_TQ);
    let tq = k.let_("tq", &lid % DOWN_TQ);
    let t0 = k.let_("t0", k.workgroup_index() * DOWN_TOKENS);
    let last = k.let_("last", &tokens - 1u32);

    // The loads of a step: the slice's `DOWN_TOKENS × DOWN_STEP/N` wide elements, shared out
    // 32 at a time as 4 tokens × 8 consecutive elements (whole 128-byte rows of memory when
    // wide, and transposing stores in distinct banks). Rows past the last token read the last
    // one (their sums are never stored); columns past `n` read zero.
    let per_row = DOWN_STEP / C::N;
    let loads = DOWN_TOKENS * per_row / WG;
    let slots: Vec<(Expr<u32>, Expr<u32>, Expr<u32>)> = (0..loads)
        .map(|j| {
            let e = k.let_("e", &lid + j * WG);
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
            if n.is_multiple_of(DOWN_STEP) {
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
    // Indexed by Rust constants only, so the sums stay in registers: token `j`, rank `kk` at
    // `j·r + kk`.
    let acc: LocalArray<f32> = k.var_array("acc", 4 * r);
    for o in 0..4 * r {
        k.store(&acc, o, 0.0f32);
    }
    let steps = n.div_ceil(DOWN_STEP);
    fetch(k, &lit(0u32));
    stage(k);
    k.workgroup_barrier();
    k.for_range("step", 0u32, steps, |k, step| {
        let more = k.let_("more", (&step + 1u32).lt(steps));
        k.comment("Read the next step's slice into registers while this one computes.");
        k.if_(&more, |k| fetch(k, &(&step + 1u32)));
        for c in 0..4u32 {
            let col = k.let_("col", &ks * 4u32 + c);
            let i = k.let_("i", (&step * DOWN_STEP + &col).min(n - 1));
            let xs: Vec<Expr<f32>> = (0..4u32)
                .map(|j| k.let_("x", slice.at(&col * pitch + offset(&tq, DOWN_TQ * j))))
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
    k.comment("Add the column slices' partial sums, DOWN_ROUND per invocation a round.");
    // Two levels, so that every invocation helps: groups of DOWN_SPAN slices, then the groups.
    let slice_groups = DOWN_KS / DOWN_SPAN;
    for round in 0..(4 * r).div_ceil(DOWN_ROUND) {
        let outputs: Vec<u32> =
            (round * DOWN_ROUND..((round + 1) * DOWN_ROUND).min(4 * r)).collect();
        let len = outputs.len() as u32;
        let count = DOWN_TQ * len;
        for (c, o) in outputs.iter().enumerate() {
            k.store(
                &partial,
                (&ks * DOWN_TQ + &tq) * DOWN_ROUND + c as u32,
                acc.at(*o),
            );
        }
        k.workgroup_barrier();
        k.if_(lid.lt(slice_groups * count), |k| {
            let group = k.let_("group", &lid / count);
            let at = k.let_("at", &lid % count);
            let otq = k.let_("otq", &at / len);
            let c = k.let_("c", &at % len);
            let total = k.var("total", 0.0f32);
            for q in 0..DOWN_SPAN {
                let s = k.let_("s", &group * DOWN_SPAN + q);
                k.add_assign(&total, partial.at((&s * DOWN_TQ + &otq) * DOWN_ROUND + &c));
            }
            k.store(&group_sums, &group * count + &at, total.get());
        });
        k.workgroup_barrier();
        k.if_(lid.lt(count), |k| {
            let total = k.var("total", 0.0f32);
            for g in 0..slice_groups {
                k.add_assign(&total, group_sums.at(offset(&lid, g * count)));
            }
            // Output `o` of the round is token `o / r` of the invocation's four, rank `o % r`.
            let otq = k.let_("otq", &lid / len);
            let o = k.let_("o", &lid % len + round * DOWN_ROUND);
            let token = k.let_("token", &t0 + &otq + &o / r * DOWN_TQ);
            k.if_(token.lt(&tokens), |k| {
                k.store(&out, &token * r + &o % r, total.get())
            });
        });
        k.workgroup_barrier();
    }
}

/// `lora_down_subgroups`: tokens per workgroup, invocations per workgroup, and token rows read
/// before computing.
const SG_TOKENS: u32 = 16;
const SG_WG: u32 = WG;
const SG_UNROLL: u32 = 4;

fn down_subgroups_key(n: u32, r: u32, layout: Layout, subgroup_size: u32) -> KernelKey {
    // Bounds checks stay: its workgroup indices hold only if the device runs full subgroups of
    // exactly the size it reports (wgpu does not require full subgroups), and on the H200
    // dropping them gained nothing here.
    adapter_key("lora_down_subgroups", n, r, layout)
        .shape("lanes", subgroup_size)
        .features(Features::SUBGROUPS)
}

/// `lora_down` on a device with subgroups of one known size: invocation `lane` of subgroup `sg`
/// owns one wide element of each `SG_WG`-element chunk of the row, keeps its columns' `r`
/// weights in registers, and for each token multiplies them into `r` sums over its columns.
/// A butterfly of `subgroup_shuffle_xor`s adds those over the subgroup while halving them, so
/// that no sum crosses workgroup memory until the subgroup has one set; the subgroups' sets are
/// then added in workgroup memory, `SG_UNROLL` tokens at a time. (Keeping each invocation's
/// sums in registers over all the chunks instead, with no barrier, measured slower on the H200:
/// 47 against 43 µs at 4096 × 2560.)
fn down_subgroups(k: &mut KernelBuilder) {
    by_width(
        k,
        down_subgroups_with::<Vec4<f32>>,
        down_subgroups_with::<f32>,
    )
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

fn down_subgroups_with<C: Columns>(k: &mut KernelBuilder) {
    let (n, r) = (k.shape::<u32>("n"), k.shape::<u32>("rank"));
    let layout = Layout::from_shape(k.shape::<bool>("rank_minor"));
    let size = k.shape::<u32>("lanes");
    let groups = n / C::N;
    let subgroups = SG_WG / size;
    let padded = r.next_power_of_two();
    let a = k.storage::<C>("a");
    // `B` (`[n, r]`): a column's `r` weights are a row; `A` (`[r, n]`): one wide read per rank.
    let (b_rows, a_rows) = match layout {
        Layout::RankMinor => (Some(RankRows::declare(k, "w", r)), None),
        Layout::RankMajor => (None, Some(k.storage::<C>("w"))),
    };
    let out = k.storage_rw::<f32>("out");
    let tokens = k.param::<u32>("tokens");
    // Each subgroup's sums for SG_UNROLL tokens, and the workgroup's running totals.
    let batch = k.workgroup_array::<f32>("batch", subgroups * SG_UNROLL * padded);
    let totals = k.workgroup_array::<f32>("totals", SG_TOKENS * padded);
    let lid = k.let_("lid", k.local_index());
    let sg = k.let_("sg", k.subgroup_id());
    let lane = k.let_("lane", k.subgroup_invocation_id());
    let t0 = k.let_("t0", k.workgroup_index() * SG_TOKENS);
    let last = k.let_("last", &tokens - 1u32);
    // After the butterfly an invocation holds consecutive ranks from `first` on.
    let (first, copies) = butterfly_ranks(&lane, size, padded);
    let first = k.let_("first", first);
    // Token `j` of a batch, rank `kk`: total `j·padded + kk` of the batch, added up by
    // invocation `j·padded + kk` (the same one every chunk).
    let summers = SG_UNROLL * padded;
    for i in 0..(SG_TOKENS * padded).div_ceil(SG_WG) {
        let at = k.let_("at", offset(&lid, i * SG_WG));
        k.if_(at.lt(SG_TOKENS * padded), |k| k.store(&totals, &at, 0.0f32));
    }
    k.workgroup_barrier();
    k.for_range("chunk", 0u32, groups.div_ceil(SG_WG), |k, chunk| {
        let g = k.let_("g", &chunk * SG_WG + &sg * size + &lane);
        let live = k.let_("live", g.lt(groups));
        let gc = k.let_("gc", g.min(groups - 1));
        // ws[c][kk] = W(column c of the invocation's, kk), zero past the row's end (so that the
        // invocation adds nothing).
        let mut ws: Vec<Vec<Expr<f32>>> = vec![vec![]; C::N as usize];
        if let Some(rows) = &b_rows {
            for (c, wc) in ws.iter_mut().enumerate() {
                let col = k.let_("col", &gc * C::N + c as u32);
                *wc = rows.row(k, &col, r);
            }
        } else if let Some(cols) = &a_rows {
            for kk in 0..r {
                let wide_w = k.let_("w", cols.at(&gc + kk * groups));
                for (c, lane_w) in C::lanes(&wide_w).into_iter().enumerate() {
                    ws[c].push(lane_w);
                }
            }
        }
        let ws: Vec<Vec<Expr<f32>>> = ws
            .into_iter()
            .map(|wc| {
                wc.into_iter()
                    .map(|w| k.let_("w", select(live.clone(), w, 0.0f32)))
                    .collect()
            })
            .collect();
        k.for_range("b", 0u32, SG_TOKENS / SG_UNROLL, |k, b| {
            // Rows past the last token read the last one: their sums are never stored.
            let xs: Vec<Expr<C>> = (0..SG_UNROLL)
                .map(|j| {
                    let t = (&t0 + &b * SG_UNROLL + j).min(&last);
                    k.let_("x", a.at(t * groups + &gc))
                })
                .collect();
            for (j, x) in xs.iter().enumerate() {
                let x = C::lanes(x);
                let sums: Vec<Expr<f32>> = (0..padded)
                    .map(|kk| {
                        if kk < r {
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
                        let at = (&sg * SG_UNROLL + j as u32) * padded + offset(&first, q as u32);
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
        for b in 0..SG_TOKENS / SG_UNROLL {
            let token = k.let_("token", &t0 + b * SG_UNROLL + &lid / padded);
            k.if_(token.lt(&tokens).and(kk.lt(r)), |k| {
                k.store(&out, &token * r + &kk, totals.at(offset(&lid, b * summers)));
            });
        }
    });
}

/// `out = a·W(·, k)` for `a: [T, n]`: through `lora_down` for small ranks, else the GEMM.
fn project(
    rec: &mut Recorder<'_>,
    (a, w, out): (&GpuBuffer<f32>, &GpuBuffer<f32>, &mut GpuBuffer<f32>),
    (t, n, r): (u32, u32, u32),
    layout: Layout,
) -> Result<(), ExecError> {
    if r <= DOWN_MAX_RANK {
        // Subgroups of 8 to 256 invocations: with fewer, the subgroups' sums of a batch would
        // outgrow workgroup memory at the largest ranks.
        let subgroups = rec
            .gpu()
            .subgroup_size()
            .filter(|&size| (8..=SG_WG).contains(&size) && SG_WG.is_multiple_of(size));
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
                let key = down_subgroups_key(n, r, layout, size);
                (rec.gpu().kernel(&key, down_subgroups)?, SG_TOKENS)
            }
            None => (
                rec.gpu().kernel(&down_key(n, r, layout), down)?,
                DOWN_TOKENS,
            ),
        };
        let groups = t.div_ceil(tokens_per_group);
        return rec.launch(&kernel, &args, Grid::Threads(groups as u64 * WG as u64));
    }
    let (t, n, r) = (t as usize, n as usize, r as usize);
    match layout {
        Layout::RankMajor => linear::execute_matmul_nt(rec, a, w, out, t, r, n, false),
        Layout::RankMinor => linear::execute_matmul_nn(rec, a, w, out, t, n, r, false),
    }
}

/// Tokens per invocation of `lora_up`, and how many of them it reads before computing.
const UP_TOKENS: u32 = 16;
const UP_UNROLL: u32 = 4;

fn up_key(n: u32, r: u32, layout: Layout) -> KernelKey {
    adapter_key("lora_up", n, r, layout).assume_in_bounds()
}

/// `out[t, c] += scale·Σ_k v[t, k]·W(k, c)` — a product out of `r` (`s·h·Bᵀ`, `s·dh·A`) that
/// reads and writes each output once. An invocation keeps its columns' `r` weights (times
/// `scale`) in registers and walks `UP_TOKENS` tokens, `UP_UNROLL` output reads in flight.
fn up(k: &mut KernelBuilder) {
    by_width(k, up_with::<Vec4<f32>>, up_with::<f32>)
}

fn up_with<C: Columns>(k: &mut KernelBuilder) {
    let (n, r) = (k.shape::<u32>("n"), k.shape::<u32>("rank"));
    let layout = Layout::from_shape(k.shape::<bool>("rank_minor"));
    let groups = n / C::N;
    // `A`'s rows are read as the invocation's columns at once; `B`'s element by element.
    let w_rows = (layout == Layout::RankMajor).then(|| k.storage::<C>("w"));
    let w = (layout == Layout::RankMinor).then(|| k.storage::<f32>("w"));
    let v = RankRows::declare(k, "v", r);
    let out = k.storage_rw::<C>("out");
    let tokens = k.param::<u32>("tokens");
    let blocks = k.param::<u32>("blocks");
    let scale = k.param::<f32>("scale");
    let i = k.global_index();
    k.if_(i.lt(&blocks * groups), |k| {
        let g = k.let_("g", &i % groups);
        let block = k.let_("block", &i / groups);
        let weights: Vec<Expr<C>> = (0..r)
            .map(|kk| {
                let row = match &w_rows {
                    Some(rows) => rows.at(&g + kk * groups),
                    None => {
                        let w = w.as_ref().expect("B is bound when A is not");
                        C::gather(
                            (0..C::N)
                                .map(|c| w.at(layout.at(&(&g * C::N + c), kk, n, r)))
                                .collect(),
                        )
                    }
                };
                k.let_("w", row * C::splat(scale.clone()))
            })
            .collect();
        let first = k.let_("first", &block * UP_TOKENS);
        let end = k.let_("end", (&first + UP_TOKENS).min(&tokens));
        let full = k.let_("full", &first + (&end - &first) / UP_UNROLL * UP_UNROLL);
        let tokens_at = |k: &mut KernelBuilder, t: &Expr<u32>, count: u32| {
            let at: Vec<Expr<u32>> = (0..count)
                .map(|j| k.let_("at", offset(t, j) * groups + &g))
                .collect();
            let old: Vec<Expr<C>> = at.iter().map(|at| k.let_("old", out.at(at))).collect();
            for (j, (at, old)) in at.iter().zip(old).enumerate() {
                let hs = v.row(k, &offset(t, j as u32), r);
                let sum = weights
                    .iter()
                    .zip(hs)
                    .fold(old, |sum, (wk, h)| sum + wk * C::splat(h));
                k.store(&out, at, sum);
            }
        };
        k.for_step("t", &first, &full, UP_UNROLL, |k, t| {
            tokens_at(k, &t, UP_UNROLL)
        });
        k.for_range("t", &full, &end, |k, t| tokens_at(k, &t, 1));
    });
}

/// `out (+)= scale·v·W(k, ·)` for `v: [T, r]`: through `lora_up` for small ranks, else the GEMM.
fn project_up(
    rec: &mut Recorder<'_>,
    (v, w, out): (&GpuBuffer<f32>, &GpuBuffer<f32>, &mut GpuBuffer<f32>),
    (t, n, r): (u32, u32, u32),
    layout: Layout,
    scale: f32,
) -> Result<(), ExecError> {
    if r <= DOWN_MAX_RANK {
        let kernel = rec.gpu().kernel(&up_key(n, r, layout), up)?;
        let blocks = t.div_ceil(UP_TOKENS);
        let args = bind_rank_rows(Args::new(), "v", v, r);
        let args = match layout {
            Layout::RankMajor => bind_columns(args, "w", w, n),
            Layout::RankMinor => args.buffer("w", w),
        };
        let args = bind_columns(args, "out", out, n)
            .param("tokens", t)
            .param("blocks", blocks)
            .param("scale", scale);
        let threads = blocks as u64 * row_elements(n) as u64;
        return rec.launch(&kernel, &args, Grid::Threads(threads));
    }
    let (t, n, r) = (t as usize, n as usize, r as usize);
    let gemm = linear::Gemm {
        product: match layout {
            Layout::RankMinor => Product::Nt,
            Layout::RankMajor => Product::Nn,
        },
        m: t,
        n: match layout {
            Layout::RankMinor => n,
            Layout::RankMajor => r,
        },
        k: match layout {
            Layout::RankMinor => r,
            Layout::RankMajor => n,
        },
        accumulate: true,
        tile: Tile::for_shape(t, n),
    };
    linear::execute_gemm(rec, &gemm, v, Weights::ScaledDense { w, scale }, out)
}

/// The weight gradients' first pass: a workgroup is `GRAD_COLS` invocations along the columns
/// times `GRAD_LANES` along the tokens, each lane summing `GRAD_TOKENS` tokens.
const GRAD_COLS: u32 = 32;
const GRAD_LANES: u32 = 4;
const GRAD_TOKENS: u32 = 64;
/// Tokens per partial sum (one workgroup row of lanes).
const TOKENS_PER_BLOCK: u32 = GRAD_LANES * GRAD_TOKENS;
/// Token rows read before computing, and sums per invocation per round of the lanes' reduction.
const GRAD_UNROLL: u32 = 8;
const GRAD_ROUND: u32 = 16;
/// Blocks the second pass reads per step.
const SUM_LOADS: u32 = 16;

fn partials_key(n: u32, r: u32) -> KernelKey {
    KernelKey::new("lora_weight_grad_partials")
        .workgroup_size(GRAD_COLS * GRAD_LANES)
        .shape("n", n)
        .shape("rank", r)
        .assume_in_bounds()
}

/// First pass: `partials[block, j, k] = Σ_{t in block} u[t, j]·v[t, k]`. Invocation
/// `(lane, c)` keeps its columns' `r` sums in registers over its `GRAD_TOKENS` tokens of the
/// block (`u` read wide, `GRAD_UNROLL` rows in flight); the lanes' sums are added in workgroup
/// memory.
fn weight_grad_partials(k: &mut KernelBuilder) {
    by_width(
        k,
        weight_grad_partials_with::<Vec4<f32>>,
        weight_grad_partials_with::<f32>,
    )
}

fn weight_grad_partials_with<C: Columns>(k: &mut KernelBuilder) {
    let (n, r) = (k.shape::<u32>("n"), k.shape::<u32>("rank"));
    let groups = n / C::N;
    let u = k.storage::<C>("u");
    let v = RankRows::declare(k, "v", r);
    let partials = k.storage_rw::<f32>("partials");
    let tokens = k.param::<u32>("tokens");
    // Where this gradient's partials start in `partials` (the fused backward keeps two).
    let first_partial = k.param::<u32>("base");
    let sums = k.workgroup_array::<f32>("sums", GRAD_LANES * GRAD_COLS * GRAD_ROUND);
    let lid = k.let_("lid", k.local_index());
    let lane = k.let_("lane", &lid / GRAD_COLS);
    let c = k.let_("c", &lid % GRAD_COLS);
    let wg = k.let_("wg", k.workgroup_index());
    let col_groups = groups.div_ceil(GRAD_COLS);
    let block = k.let_("block", &wg / col_groups);
    let g0 = k.let_("g0", (&wg % col_groups) * GRAD_COLS);
    // Columns past the last read the last (their sums are never stored).
    let g = k.let_("g", (&g0 + &c).min(groups - 1));
    // Indexed by Rust constants only: column `cc` of the invocation's, rank `kk` at `cc·r + kk`.
    let acc: LocalArray<f32> = k.var_array("acc", C::N * r);
    for o in 0..C::N * r {
        k.store(&acc, o, 0.0f32);
    }
    let first = k.let_("first", (&block * GRAD_LANES + &lane) * GRAD_TOKENS);
    let end = k.let_("end", (&first + GRAD_TOKENS).min(&tokens).max(&first));
    let full = k.let_("full", &first + (&end - &first) / GRAD_UNROLL * GRAD_UNROLL);
    let rows_at = |k: &mut KernelBuilder, t: &Expr<u32>, count: u32| {
        let xs: Vec<Expr<C>> = (0..count)
            .map(|j| k.let_("x", u.at(offset(t, j) * groups + &g)))
            .collect();
        for (j, x) in xs.iter().enumerate() {
            let vs = v.row(k, &offset(t, j as u32), r);
            for (cc, xc) in C::lanes(x).iter().enumerate() {
                for (kk, vk) in vs.iter().enumerate() {
                    let o = cc as u32 * r + kk as u32;
                    k.store_op(&acc, o, BinaryOp::Add, xc * vk);
                }
            }
        }
    };
    k.for_step("t", &first, &full, GRAD_UNROLL, |k, t| {
        rows_at(k, &t, GRAD_UNROLL)
    });
    k.for_range("t", &full, &end, |k, t| rows_at(k, &t, 1));
    k.comment("Add the lanes' sums, GRAD_ROUND per invocation a round.");
    let total_outputs = C::N * r;
    for round in 0..total_outputs.div_ceil(GRAD_ROUND) {
        let base = round * GRAD_ROUND;
        let len = GRAD_ROUND.min(total_outputs - base);
        for o in 0..len {
            k.store(
                &sums,
                (&lane * GRAD_COLS + &c) * GRAD_ROUND + o,
                acc.at(base + o),
            );
        }
        k.workgroup_barrier();
        let threads = GRAD_COLS * GRAD_LANES;
        for part in 0..(GRAD_COLS * len).div_ceil(threads) {
            let e = k.let_("e", offset(&lid, part * threads));
            k.if_(e.lt(GRAD_COLS * len), |k| {
                let ec = k.let_("ec", &e / len);
                let eo = k.let_("eo", &e % len);
                let total = k.var("total", 0.0f32);
                for l in 0..GRAD_LANES {
                    k.add_assign(&total, sums.at((l * GRAD_COLS + &ec) * GRAD_ROUND + &eo));
                }
                let eg = k.let_("eg", &g0 + &ec);
                // A block past the tokens (a workgroup the 2-D grid rounds up to) stores nothing.
                let live = eg.lt(groups).and((&block * TOKENS_PER_BLOCK).lt(&tokens));
                k.if_(live, |k| {
                    // Output `base + eo` is column `cc` of the invocation's, rank `kk`.
                    let o = k.let_("o", &eo + base);
                    let col = k.let_("col", &eg * C::N + &o / r);
                    let at = &first_partial + (&block * n + &col) * r + &o % r;
                    k.store(&partials, at, total.get());
                });
            });
        }
        k.workgroup_barrier();
    }
}

/// The second pass's key: one gradient `n` wide in `layout`, and, when `second` is not 0, a
/// second one `second` wide, rank-major (`dA` after `dB` in the fused backward: one launch).
fn sum_key(n: u32, r: u32, layout: Layout, second: u32) -> KernelKey {
    adapter_key("lora_weight_grad_sum", n, r, layout)
        .shape("second", second)
        .assume_in_bounds()
}

/// Second pass: `G(j, k) = scale·Σ_blocks partials[block, j, k]`, written in `G`'s layout —
/// for `grad`, and for `grad2` (whose partials follow `grad`'s) when the key has a second.
fn weight_grad_sum(k: &mut KernelBuilder) {
    let (n, r) = (k.shape::<u32>("n"), k.shape::<u32>("rank"));
    let layout = Layout::from_shape(k.shape::<bool>("rank_minor"));
    let second = k.shape::<u32>("second");
    let partials = k.storage::<f32>("partials");
    let grad = k.storage_rw::<f32>("grad");
    let grad2 = (second > 0).then(|| k.storage_rw::<f32>("grad2"));
    let blocks = k.param::<u32>("blocks");
    let scale = k.param::<f32>("scale");
    let i = k.global_index();
    // SUM_LOADS independent sums, so that many loads are in flight per step (a 4096-token
    // backward has 16 blocks: one step); a block past the last reads the last one (in range)
    // and adds nothing.
    let add_blocks = |k: &mut KernelBuilder, (at, width, base): (Expr<u32>, u32, Expr<u32>)| {
        let accs: Vec<_> = (0..SUM_LOADS).map(|_| k.var("acc", 0.0f32)).collect();
        // With no blocks (no tokens) this wraps, unused: the loop below does not run.
        let last = k.let_("last", &blocks - 1u32);
        k.for_step("b", 0u32, &blocks, SUM_LOADS, |k, b| {
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
            .expect("SUM_LOADS > 0");
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

/// The WGSL of this module's kernels at representative shapes (for snapshots and review).
pub fn kernels() -> Result<Vec<Kernel>, hesper_dsl::DslError> {
    Ok(vec![
        Kernel::build(&down_key(2560, 16, Layout::RankMinor), down)?,
        Kernel::build(
            &down_subgroups_key(2560, 16, Layout::RankMinor, 32),
            down_subgroups,
        )?,
        Kernel::build(&up_key(2560, 16, Layout::RankMajor), up)?,
        Kernel::build(&partials_key(2560, 16), weight_grad_partials)?,
        Kernel::build(&sum_key(2560, 16, Layout::RankMinor, 2560), weight_grad_sum)?,
    ])
}

/// Rows of a `[rows, width]` buffer, checked.
fn rows(
    kernel: &str,
    binding: &str,
    buf: &GpuBuffer<f32>,
    width: usize,
    what: &str,
) -> Result<u32, ExecError> {
    if width == 0 || !buf.len().is_multiple_of(width) {
        return Err(ExecError::Binding {
            kernel: kernel.into(),
            binding: binding.into(),
            expected: format!("[rows, {what} = {width}] elements"),
            given: format!("{} elements", buf.len()),
        });
    }
    expect_u32(kernel, binding, buf.len() / width)
}

/// `r` and the width of an adapter matrix (`A: [r, in]` or `B: [out, r]`), checked.
fn adapter(
    kernel: &str,
    binding: &str,
    buf: &GpuBuffer<f32>,
    rank: usize,
) -> Result<(u32, u32), ExecError> {
    if rank == 0 || buf.is_empty() || !buf.len().is_multiple_of(rank) {
        return Err(ExecError::Binding {
            kernel: kernel.into(),
            binding: binding.into(),
            expected: format!("a non-empty multiple of the rank ({rank}) of elements"),
            given: format!("{} elements", buf.len()),
        });
    }
    Ok((
        expect_u32(kernel, "rank", rank)?,
        expect_u32(kernel, binding, buf.len() / rank)?,
    ))
}

/// The weight gradients' first pass for `u: [T, n]`, `v: [T, r]`, into `scratch` from `base`.
fn launch_partials(
    rec: &mut Recorder<'_>,
    (u, v, scratch): (&GpuBuffer<f32>, &GpuBuffer<f32>, &GpuBuffer<f32>),
    (tokens, n, r): (u32, u32, u32),
    base: u32,
) -> Result<(), ExecError> {
    let blocks = tokens.div_ceil(TOKENS_PER_BLOCK);
    if blocks == 0 {
        return Ok(());
    }
    let kernel = rec
        .gpu()
        .kernel(&partials_key(n, r), weight_grad_partials)?;
    let args = bind_columns(Args::new(), "u", u, n);
    let args = bind_rank_rows(args, "v", v, r)
        .buffer("partials", scratch)
        .param("tokens", tokens)
        .param("base", base);
    let workgroups = blocks as u64 * row_elements(n).div_ceil(GRAD_COLS) as u64;
    let threads = workgroups * (GRAD_COLS * GRAD_LANES) as u64;
    rec.launch(&kernel, &args, Grid::Threads(threads))
}

/// `grad(j, k) = scale·Σ_t u[t, j]·v[t, k]` for `u: [T, n]`, `v: [T, r]`, through `scratch`.
fn launch_weight_grad(
    rec: &mut Recorder<'_>,
    (u, v, scratch, grad): (
        &GpuBuffer<f32>,
        &GpuBuffer<f32>,
        &GpuBuffer<f32>,
        &GpuBuffer<f32>,
    ),
    (tokens, n, r): (u32, u32, u32),
    (layout, scale): (Layout, f32),
    name: &str,
) -> Result<(), ExecError> {
    let need = lora_scratch_len(tokens as usize, n as usize, r as usize);
    if scratch.len() < need {
        return Err(ExecError::Binding {
            kernel: name.into(),
            binding: "scratch".into(),
            expected: format!("at least {need} elements (lora_scratch_len)"),
            given: format!("{} elements", scratch.len()),
        });
    }
    launch_partials(rec, (u, v, scratch), (tokens, n, r), 0)?;
    let kernel = rec
        .gpu()
        .kernel(&sum_key(n, r, layout, 0), weight_grad_sum)?;
    let args = Args::new()
        .buffer("partials", scratch)
        .buffer("grad", grad)
        .param("blocks", tokens.div_ceil(TOKENS_PER_BLOCK))
        .param("scale", scale);
    rec.launch(&kernel, &args, Grid::Threads(n as u64 * r as u64))
}

/// Elements of the scratch buffer the weight gradients need: one partial sum per block of 256
/// tokens per weight element, `⌈tokens / 256⌉·width·rank`, where `width` is `out` for
/// [`execute_grad_b`], `in` for [`execute_grad_a`] and `in + out` for
/// [`execute_lora_backward`] (which keeps both gradients' partials, to add them in one launch).
pub fn lora_scratch_len(tokens: usize, width: usize, rank: usize) -> usize {
    tokens.div_ceil(TOKENS_PER_BLOCK as usize).max(1) * width * rank
}

/// LoRA forward of one projection: `h = x·Aᵀ` (`[T, r]`, saved for the backward) and
/// `y += s·h·Bᵀ` (added to the frozen projection's output already in `y`).
#[allow(clippy::too_many_arguments)]
pub fn execute_lora_forward(
    rec: &mut Recorder<'_>,
    x: &GpuBuffer<f32>,
    a: &GpuBuffer<f32>,
    b: &GpuBuffer<f32>,
    rank: usize,
    scale: f32,
    h: &mut GpuBuffer<f32>,
    y: &mut GpuBuffer<f32>,
) -> Result<(), ExecError> {
    let name = "lora_forward";
    let (r, input) = adapter(name, "a", a, rank)?;
    let (_, output) = adapter(name, "b", b, rank)?;
    let t = rows(name, "x", x, input as usize, "in")?;
    expect_len(name, "h", h, t as usize * r as usize, "[tokens, rank]")?;
    expect_len(name, "y", y, t as usize * output as usize, "[tokens, out]")?;
    if t == 0 {
        return Ok(());
    }
    project(rec, (x, a, h), (t, input, r), Layout::RankMajor)?;
    project_up(rec, (h, b, y), (t, output, r), Layout::RankMinor, scale)
}

/// `dh = dy·B` (`[T, r]`; Hesper's gradDh = Bᵀ·dy per token).
pub fn execute_grad_dh(
    rec: &mut Recorder<'_>,
    dy: &GpuBuffer<f32>,
    b: &GpuBuffer<f32>,
    rank: usize,
    dh: &mut GpuBuffer<f32>,
) -> Result<(), ExecError> {
    let name = "grad_dh";
    let (r, output) = adapter(name, "b", b, rank)?;
    let t = rows(name, "dy", dy, output as usize, "out")?;
    expect_len(name, "dh", dh, t as usize * r as usize, "[tokens, rank]")?;
    if t == 0 {
        return Ok(());
    }
    project(rec, (dy, b, dh), (t, output, r), Layout::RankMinor)
}

/// `dB = s·dyᵀ·h` (`[out, r]`, overwritten), summed over tokens through `scratch`
/// ([`lora_scratch_len`] for `out`).
pub fn execute_grad_b(
    rec: &mut Recorder<'_>,
    dy: &GpuBuffer<f32>,
    h: &GpuBuffer<f32>,
    rank: usize,
    scale: f32,
    scratch: &mut GpuBuffer<f32>,
    db: &mut GpuBuffer<f32>,
) -> Result<(), ExecError> {
    let name = "grad_b";
    let (r, output) = adapter(name, "db", db, rank)?;
    let t = rows(name, "dy", dy, output as usize, "out")?;
    expect_len(name, "h", h, t as usize * r as usize, "[tokens, rank]")?;
    launch_weight_grad(
        rec,
        (dy, h, scratch, db),
        (t, output, r),
        (Layout::RankMinor, scale),
        name,
    )
}

/// `dA = s·dhᵀ·x` (`[r, in]`, overwritten), summed over tokens through `scratch`
/// ([`lora_scratch_len`] for `in`).
pub fn execute_grad_a(
    rec: &mut Recorder<'_>,
    dh: &GpuBuffer<f32>,
    x: &GpuBuffer<f32>,
    rank: usize,
    scale: f32,
    scratch: &mut GpuBuffer<f32>,
    da: &mut GpuBuffer<f32>,
) -> Result<(), ExecError> {
    let name = "grad_a";
    let (r, input) = adapter(name, "da", da, rank)?;
    let t = rows(name, "x", x, input as usize, "in")?;
    expect_len(name, "dh", dh, t as usize * r as usize, "[tokens, rank]")?;
    launch_weight_grad(
        rec,
        (x, dh, scratch, da),
        (t, input, r),
        (Layout::RankMajor, scale),
        name,
    )
}

/// `dx += s·dh·A` (`[T, in]`; added, since `dx` also receives `dy·W` through the frozen weight).
pub fn execute_input_grad(
    rec: &mut Recorder<'_>,
    dh: &GpuBuffer<f32>,
    a: &GpuBuffer<f32>,
    rank: usize,
    scale: f32,
    dx: &mut GpuBuffer<f32>,
) -> Result<(), ExecError> {
    let name = "input_grad";
    let (r, input) = adapter(name, "a", a, rank)?;
    let t = rows(name, "dh", dh, r as usize, "rank")?;
    expect_len(name, "dx", dx, t as usize * input as usize, "[tokens, in]")?;
    if t == 0 {
        return Ok(());
    }
    project_up(rec, (dh, a, dx), (t, input, r), Layout::RankMajor, scale)
}

/// The buffers of one projection's LoRA backward.
pub struct LoraBackward<'a> {
    /// The projection's input, `[T, in]`.
    pub x: &'a GpuBuffer<f32>,
    /// `A: [r, in]`, `B: [out, r]`.
    pub a: &'a GpuBuffer<f32>,
    pub b: &'a GpuBuffer<f32>,
    /// The forward's saved `h = x·Aᵀ`, `[T, r]`.
    pub h: &'a GpuBuffer<f32>,
    /// The gradient of the projection's output, `[T, out]`.
    pub dy: &'a GpuBuffer<f32>,
}

/// The whole LoRA backward of one projection for `T` tokens, contracting through `r` first:
/// `dh = dy·B`, `dB = s·dyᵀ·h`, `dA = s·dhᵀ·x`, `dx += s·dh·A`. `dh` (`[T, r]`) and `scratch`
/// ([`lora_scratch_len`] for `max(in, out)`) are workspace; `da`, `db` are overwritten.
#[allow(clippy::too_many_arguments)]
pub fn execute_lora_backward(
    rec: &mut Recorder<'_>,
    inputs: &LoraBackward<'_>,
    rank: usize,
    scale: f32,
    dh: &mut GpuBuffer<f32>,
    scratch: &mut GpuBuffer<f32>,
    da: &mut GpuBuffer<f32>,
    db: &mut GpuBuffer<f32>,
    dx: &mut GpuBuffer<f32>,
) -> Result<(), ExecError> {
    // Check every buffer before recording anything: an error must not leave half a backward
    // in the caller's recorder.
    let name = "lora_backward";
    let (_, input) = adapter(name, "a", inputs.a, rank)?;
    let (_, output) = adapter(name, "b", inputs.b, rank)?;
    let t = rows(name, "x", inputs.x, input as usize, "in")? as usize;
    let (input, output) = (input as usize, output as usize);
    for (binding, buf, len, what) in [
        ("dy", inputs.dy, t * output, "[tokens, out]"),
        ("h", inputs.h, t * rank, "[tokens, rank]"),
        ("dh", &*dh, t * rank, "[tokens, rank]"),
        ("da", &*da, rank * input, "[rank, in]"),
        ("db", &*db, output * rank, "[out, rank]"),
        ("dx", &*dx, t * input, "[tokens, in]"),
    ] {
        expect_len(name, binding, buf, len, what)?;
    }
    let need = lora_scratch_len(t, input + output, rank);
    if scratch.len() < need {
        return Err(ExecError::Binding {
            kernel: name.into(),
            binding: "scratch".into(),
            expected: format!("at least {need} elements (lora_scratch_len)"),
            given: format!("{} elements", scratch.len()),
        });
    }
    execute_grad_dh(rec, inputs.dy, inputs.b, rank, dh)?;
    // Both weight gradients' partials, `dB`'s then `dA`'s, and one launch to add them up.
    let (t, input, output, r) = (t as u32, input as u32, output as u32, rank as u32);
    let db_len = t.div_ceil(TOKENS_PER_BLOCK) * output * r;
    launch_partials(rec, (inputs.dy, inputs.h, scratch), (t, output, r), 0)?;
    launch_partials(rec, (inputs.x, dh, scratch), (t, input, r), db_len)?;
    let key = sum_key(output, r, Layout::RankMinor, input);
    let kernel = rec.gpu().kernel(&key, weight_grad_sum)?;
    let args = Args::new()
        .buffer("partials", scratch)
        .buffer("grad", db)
        .buffer("grad2", da)
        .param("blocks", t.div_ceil(TOKENS_PER_BLOCK))
        .param("scale", scale);
    let outputs = (input + output) as u64 * r as u64;
    rec.launch(&kernel, &args, Grid::Threads(outputs))?;
    execute_input_grad(rec, dh, inputs.a, rank, scale, dx)
}

/// f64 references, written as the plain matrix products of KERNELS.md.
pub mod reference {
    /// `(h, y + s·h·Bᵀ)` for `x: [T, in]`, `a: [r, in]`, `b: [out, r]`, `y: [T, out]`.
    pub fn lora_forward(
        x: &[f64],
        a: &[f64],
        b: &[f64],
        y: &[f64],
        rank: usize,
        scale: f64,
    ) -> (Vec<f64>, Vec<f64>) {
        let (input, output) = (a.len() / rank, b.len() / rank);
        let tokens = x.len() / input;
        let mut h = vec![0.0; tokens * rank];
        let mut out = y.to_vec();
        for t in 0..tokens {
            for k in 0..rank {
                h[t * rank + k] = (0..input)
                    .map(|i| x[t * input + i] * a[k * input + i])
                    .sum();
            }
            for o in 0..output {
                out[t * output + o] += scale
                    * (0..rank)
                        .map(|k| h[t * rank + k] * b[o * rank + k])
                        .sum::<f64>();
            }
        }
        (h, out)
    }

    /// `(dA, dB, dx_lora)` given `dy`: the gradients of `Σ dy ⊙ (s·x·Aᵀ·Bᵀ)`.
    pub fn lora_backward(
        x: &[f64],
        a: &[f64],
        b: &[f64],
        dy: &[f64],
        rank: usize,
        scale: f64,
    ) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
        let (input, output) = (a.len() / rank, b.len() / rank);
        let tokens = x.len() / input;
        let (h, _) = lora_forward(x, a, b, &vec![0.0; tokens * output], rank, scale);
        let mut dh = vec![0.0; tokens * rank];
        for t in 0..tokens {
            for k in 0..rank {
                dh[t * rank + k] = (0..output)
                    .map(|o| dy[t * output + o] * b[o * rank + k])
                    .sum();
            }
        }
        let mut db = vec![0.0; output * rank];
        let mut da = vec![0.0; rank * input];
        let mut dx = vec![0.0; tokens * input];
        for t in 0..tokens {
            for o in 0..output {
                for k in 0..rank {
                    db[o * rank + k] += scale * dy[t * output + o] * h[t * rank + k];
                }
            }
            for k in 0..rank {
                for i in 0..input {
                    da[k * input + i] += scale * dh[t * rank + k] * x[t * input + i];
                    dx[t * input + i] += scale * dh[t * rank + k] * a[k * input + i];
                }
            }
        }
        (da, db, dx)
    }
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
                        let key = down_subgroups_key(n, r, layout, size);
                        if let Err(e) = Kernel::build(&key, down_subgroups) {
                            panic!("size {size}, rank {r}, width {n}, {layout:?}: {e}");
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
}
