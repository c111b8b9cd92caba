//! `argmax`: greedy decoding's choice on the GPU — the index of the first maximum of each row
//! of logits, written where the next position's token id is read from, so that decoding can
//! record the next token's forward before the host knows the token.
//!
//! It is the host's `first i with z[i] > every z[j < i]` (a NaN or `−∞` never chosen, 0 when
//! no element is above `−∞`): each invocation keeps the first maximum of its stride, the
//! workgroup takes the largest value (`workgroup_reduce(max)`) and then the smallest index
//! holding it (`workgroup_reduce(min)`), so ties go to the first.

use hesper_dsl::prelude::*;
use hesper_exec::{Args, ExecError, GpuBuffer, Grid, Recorder};

use crate::{Len, expect_len, expect_u32};

const NAME: &str = "argmax";
/// Invocations per row (a 49152-word vocabulary: 192 elements each).
const WG: u32 = 256;
/// An invocation's index before it has seen an element above `−∞`.
const NONE: u32 = u32::MAX;

fn key(features: Features) -> KernelKey {
    KernelKey::new(NAME)
        .workgroup_size(WG)
        .features(features & Features::SUBGROUPS)
}

fn body(k: &mut KernelBuilder) {
    let logits = k.storage::<f32>("logits");
    let out = k.storage_rw::<u32>("out");
    let n = k.param::<u32>("n");
    let rows = k.param::<u32>("rows");
    let offset = k.param::<u32>("offset");
    let row = k.let_("row", k.workgroup_index());
    // The whole workgroup leaves together (one row): the reductions' barriers stay uniform.
    k.if_(row.ge(&rows), |k| k.return_());
    let base = k.let_("base", &row * &n);
    let best = k.var("best", lit(-f32::MAX));
    let at = k.var("at", lit(NONE));
    k.row_loop(n.clone(), |k, c| {
        let z = k.let_("z", logits.at(&base + &c));
        // `z ≥ −MAX` is false for NaN and −∞: neither is ever chosen, as on the host.
        let first = at.get().eq(NONE).and(z.ge(-f32::MAX));
        k.if_(first.or(z.gt(best.get())), |k| {
            k.assign(&best, z.clone());
            k.assign(&at, c.clone());
        });
    });
    let top = k.workgroup_reduce(best.get(), Reduce::Max);
    let mine = select(
        at.get().ne(NONE).and(best.get().eq(&top)),
        at.get(),
        lit(NONE),
    );
    let first = k.workgroup_reduce(mine, Reduce::Min);
    k.if_(k.local_index().eq(0u32), |k| {
        let chosen = select(first.eq(NONE), lit(0u32), first.clone());
        k.store(&out, &offset + &row, chosen);
    });
}

/// `out[offset + r] = argmax(logits[r, ..])` for each of the `rows = logits.len() / n` rows.
pub fn execute_argmax(
    rec: &mut Recorder<'_>,
    logits: &GpuBuffer<f32>,
    n: usize,
    out: &mut GpuBuffer<u32>,
    offset: usize,
) -> Result<(), ExecError> {
    let n32 = expect_u32(NAME, "n", n)?;
    if n == 0 {
        return Err(ExecError::Dispatch {
            kernel: NAME.into(),
            what: "rows of 0 logits".into(),
            why: "an empty row has no maximum".into(),
        });
    }
    expect_len(NAME, "logits", logits, Len::Multiple(n), "[rows, n]")?;
    let rows = logits.len() / n;
    expect_len(
        NAME,
        "out",
        out,
        Len::AtLeast(offset + rows),
        "offset + rows",
    )?;
    // The workgroup's invocations stride over the row.
    let iterations = n.div_ceil(WG as usize) as u64;
    crate::expect_loops(rec.gpu(), NAME, || format!("n = {n}"), iterations)?;
    let kernel = rec.gpu().kernel(&key(rec.gpu().kernel_features()), body)?;
    let args = Args::new()
        .buffer("logits", logits)
        .buffer("out", out)
        .param("n", n32)
        .param("rows", expect_u32(NAME, "rows", rows)?)
        .param("offset", expect_u32(NAME, "offset", offset)?);
    rec.launch(&kernel, &args, Grid::WorkgroupPerItem(rows as u64))
}

/// The WGSL of `argmax` (with subgroups, as the catalog's default), for snapshots and review.
pub fn kernels() -> Result<Vec<Kernel>, hesper_dsl::DslError> {
    Ok(vec![Kernel::build(&key(Features::SUBGROUPS), body)?])
}

/// `argmax` within `limits`, for [`crate::catalog`].
pub(crate) fn build(features: Features, limits: &Limits) -> Result<Kernel, hesper_dsl::DslError> {
    Kernel::build_with_limits(&key(features), limits, body)
}

/// The host's choice, for the tests: the first index whose value exceeds every one before it.
pub mod reference {
    pub fn argmax(row: &[f32]) -> u32 {
        let mut best = (0, f32::NEG_INFINITY);
        for (i, &z) in row.iter().enumerate() {
            if z > best.1 {
                best = (i, z);
            }
        }
        best.0 as u32
    }
}
