//! `lora_up`: the products out of `r` (`y += s·h·Bᵀ`, `dx += s·dh·A`),
//! `out[t, c] += s·Σ_k v[t, k]·W(k, c)`, which read and write each output once.

use hesper_dsl::prelude::*;
use hesper_exec::{Args, ExecError, GpuBuffer, Grid, Recorder};

use super::{
    Layout, MAX_RANK, RankRows, adapter_key, adapter_shapes, bind_columns, bind_rank_rows,
    by_width, row_elements,
};
use crate::catalog::Failure;
use crate::linear::{self, Gemm, Product, Weights, offset};
use crate::{Columns, bad_tile};

/// `lora_up`'s block sizes: `invocations` per workgroup (the key's workgroup size), and per
/// invocation `block_tokens` tokens walked, `unroll` output reads in flight. Carried in the key;
/// [`UpTile::check`] says which rule a tile breaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct UpTile {
    invocations: u32,
    block_tokens: u32,
    unroll: u32,
}

impl UpTile {
    /// At every token count: blocks of 4 tokens at 4096 (4× the workgroups, for the SmolLM2
    /// step's narrow v projection) measured slower on the H200 (BENCHMARKS.md, "Split-K for
    /// the lm-head's backward").
    pub(super) const DEFAULT: UpTile = UpTile {
        invocations: 256,
        block_tokens: 16,
        unroll: 4,
    };

    /// `Ok` when `lora_up` can run this tile; else an error naming `kernel` and the rule.
    pub(super) fn check(&self, kernel: &str) -> Result<(), ExecError> {
        if self.invocations == 0 || self.block_tokens == 0 || self.unroll == 0 {
            return Err(bad_tile(
                kernel,
                self,
                "invocations, block_tokens and unroll must be positive",
            ));
        }
        Ok(())
    }

    fn from_key(k: &mut KernelBuilder) -> UpTile {
        UpTile {
            invocations: k.invocations(),
            block_tokens: k.shape("block_tokens"),
            unroll: k.shape("unroll"),
        }
    }
}

pub(super) fn key(n: u32, r: u32, layout: Layout, tile: UpTile) -> KernelKey {
    adapter_key("lora_up", n, r, layout)
        .workgroup_size(tile.invocations)
        .shape("block_tokens", tile.block_tokens)
        .shape("unroll", tile.unroll)
        .assume_in_bounds()
}

/// An invocation keeps its columns' `r` weights (times `s`) in registers and walks
/// `block_tokens` tokens, `unroll` output reads in flight.
pub(super) fn body(k: &mut KernelBuilder) {
    by_width(k, body_with::<Vec4<f32>>, body_with::<f32>)
}

fn body_with<C: Columns>(k: &mut KernelBuilder) {
    let (n, r, layout) = adapter_shapes(k);
    let tile = UpTile::from_key(k);
    let (block_tokens, unroll) = (tile.block_tokens, tile.unroll);
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
                // `s·W(kk, c)`: the scale folded into the weights once.
                k.let_("s_w", row * C::splat(scale.clone()))
            })
            .collect();
        let first = k.let_("first", &block * block_tokens);
        let end = k.let_("end", (&first + block_tokens).min(&tokens));
        let full = k.let_("full", &first + (&end - &first) / unroll * unroll);
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
        k.for_step("t", &first, &full, unroll, |k, t| tokens_at(k, &t, unroll));
        k.for_range("t", &full, &end, |k, t| tokens_at(k, &t, 1));
    });
}

/// `out (+)= scale·v·W(k, ·)` for `v: [T, r]`: through `lora_up` for small ranks, else the GEMM.
pub(super) fn project_up(
    rec: &mut Recorder<'_>,
    (v, w, out): (&GpuBuffer<f32>, &GpuBuffer<f32>, &mut GpuBuffer<f32>),
    (t, n, r): (u32, u32, u32),
    layout: Layout,
    scale: f32,
) -> Result<(), ExecError> {
    if r <= MAX_RANK {
        let tile = UpTile::DEFAULT;
        tile.check("lora_up")?;
        let kernel = rec.gpu().kernel(&key(n, r, layout, tile), body)?;
        let blocks = t.div_ceil(tile.block_tokens);
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
    // `W` is `B: [n, r]` read through `·Bᵀ`, or `A: [r, n]` read through `·A`.
    let (product, dims) = match layout {
        Layout::RankMinor => (Product::Nt, (t, n, r)),
        Layout::RankMajor => (Product::Nn, (t, r, n)),
    };
    let gemm = Gemm::new(product, dims, true);
    linear::execute_gemm(rec, &gemm, v, Weights::ScaledDense { w, scale }, out)
}

/// The kernel at a small shape, for snapshots and review.
pub(super) fn kernels() -> Result<Vec<Kernel>, hesper_dsl::DslError> {
    let key = key(64, 4, Layout::RankMajor, UpTile::DEFAULT);
    Ok(vec![Kernel::build(&key, body)?])
}

/// `lora_up` at any shape and tile (`[invocations, block_tokens, unroll]`), within `limits`,
/// for [`crate::catalog`]: the rank and the tile checked first.
pub(crate) fn build_at(
    (n, r, rank_minor): (u32, u32, bool),
    [invocations, block_tokens, unroll]: [u32; 3],
    limits: &Limits,
) -> Result<Kernel, Failure> {
    let tile = UpTile {
        invocations,
        block_tokens,
        unroll,
    };
    super::check_width(n)?;
    super::check_rank(r)?;
    tile.check("lora_up")?;
    let key = key(n, r, Layout::from_shape(rank_minor), tile);
    Ok(Kernel::build_with_limits(&key, limits, body)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_tile_passes_its_check_and_a_broken_one_says_why() {
        UpTile::DEFAULT.check("lora_up").unwrap();
        let err = UpTile {
            unroll: 0,
            ..UpTile::DEFAULT
        }
        .check("lora_up")
        .unwrap_err()
        .to_string();
        assert!(err.contains("must be positive"), "{err}");
    }
}
