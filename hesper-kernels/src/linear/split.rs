//! Split-K on the tensor cores: a GEMM whose output has few tiles but whose depth is long leaves
//! most multiprocessors idle, each of its few workgroups stepping through the whole depth. The
//! lm-head's `dn = dz·E` over a chunk of 1024 tokens is one: a `[1024, 576]` output (24 tiles
//! of 128×192) summed over 49 152 vocabulary entries. [`execute_gemm_split`] cuts the depth into
//! parts ([`coop::splits_for`]): layer `z` of the grid sums part `z` into slice `z` of a scratch
//! buffer, and `gemm_split_sum` adds the slices into the output (or to it, accumulating). Where
//! a split does not pay (enough tiles, a short depth, no tensor cores, an f16 output) it is
//! [`execute_gemm`](super::execute_gemm). [`execute_gemm_split_fused`] takes a prologue (each
//! part stages its own columns of the depth through it): the step's lm-head backward reads the
//! logits so and computes the cross-entropy's gradient on the way in
//! ([`crate::loss::CrossEntropyGrad`]).
//!
//! ```
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use hesper_exec::Gpu;
//! use hesper_kernels::linear::split::{execute_gemm_split, gemm_split_scratch_len, split_plan};
//! use hesper_kernels::linear::{Gemm, Precision, Product, Weights};
//!
//! let gpu = Gpu::new()?;
//! // dx = dy·W over a long depth: dy [8, 4096], W [4096, 32].
//! let (m, n, k) = (8, 4096, 32);
//! let gemm = Gemm::new(Product::Nn, (m, n, k), false).with_precision(Precision::F16);
//! let dy = gpu.upload(&vec![0.5f32; m * n])?;
//! let w = gpu.upload(&vec![0.25f32; n * k])?;
//! let mut dx = gpu.zeros::<f32>(m * k)?;
//! // Zero where the device has no tensor cores or the GEMM is not split.
//! let mut scratch = gpu.zeros::<f32>(gemm_split_scratch_len(&gpu, &gemm).max(1))?;
//! // The tile and parts this device splits it into, for an f32 input.
//! if let Some(plan) = split_plan(&gpu, &gemm, false) {
//!     println!("{} parts of {:?}", plan.parts, plan.tile);
//! }
//! let mut rec = gpu.recorder();
//! execute_gemm_split(&mut rec, &gemm, &dy, Weights::Dense(&w), &mut dx, &mut scratch)?;
//! rec.submit()?;
//! assert!(dx.read(&gpu)?.iter().all(|&v| v == 512.0));
//! # Ok(())
//! # }
//! ```

use hesper_dsl::Limits;
use hesper_dsl::prelude::*;
use hesper_exec::{Args, ExecError, Gpu, GpuBuffer, Grid, Recorder};

use super::{
    Fusion, Gemm, Operand, OutputBuffer, Precision, Weights, check_gemm, coop, execute_gemm_fused,
};
use crate::{Len, expect_len, expect_u32};

/// How [`execute_gemm_split`] cuts a GEMM's depth on a device: the tensor-core tile and the
/// parts ([`split_plan`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SplitPlan {
    /// Each part's workgroup tile.
    pub tile: coop::CoopTile,
    /// Parts of the depth (at least 2), each summed into its own slice of the scratch.
    pub parts: u32,
}

/// The split [`execute_gemm_split`] runs for `gemm` on `gpu` with an f16 input (`input_half`)
/// or an f32 one (the tile depends on it: [`coop::CoopTile::WIDE_12`] shares the conversion of
/// an f32 input among twelve subgroups); `None` where it runs `execute_gemm`.
pub fn split_plan(gpu: &Gpu, gemm: &Gemm, input_half: bool) -> Option<SplitPlan> {
    plan(gpu, gemm, input_half).map(|(tile, _, parts)| SplitPlan { tile, parts })
}

/// [`split_plan`] with the subgroup size the tile is laid out for.
fn plan(gpu: &Gpu, gemm: &Gemm, input_half: bool) -> Option<(coop::CoopTile, u32, u32)> {
    let (cols, depth) = gemm.cols_depth();
    if gemm.precision != Precision::F16 || gemm.m == 0 || cols == 0 || depth == 0 {
        return None;
    }
    coop::split_path(gpu, gemm, input_half)
}

/// Floats of the scratch buffer [`execute_gemm_split`] needs for `gemm` on `gpu`: one
/// `[m, cols]` slice (rounded up to 4 floats) a part, for an input of either type; 0 where it
/// does not split.
pub fn gemm_split_scratch_len(gpu: &Gpu, gemm: &Gemm) -> usize {
    let (cols, _) = gemm.cols_depth();
    let parts = [false, true]
        .into_iter()
        .filter_map(|half| plan(gpu, gemm, half).map(|(_, _, parts)| parts))
        .max();
    parts.map_or(0, |parts| {
        parts as usize * (gemm.m * cols).next_multiple_of(4)
    })
}

/// [`execute_gemm`](super::execute_gemm), its depth split into parts where that pays (the
/// module doc): the parts' sums go to `scratch` (at least [`gemm_split_scratch_len`] floats;
/// untouched where the GEMM is not split), then into `output`, added to it with
/// `gemm.accumulate`. An f16 output or ternary weights are never split. Buffers are checked as
/// `execute_gemm` checks them, `scratch` too, before anything is recorded.
pub fn execute_gemm_split<'a>(
    rec: &mut Recorder<'_>,
    gemm: &Gemm,
    input: impl Into<Operand<'a>>,
    weights: Weights<'a>,
    output: impl Into<OutputBuffer<'a>>,
    scratch: &mut GpuBuffer<f32>,
) -> Result<(), ExecError> {
    let none = Fusion::NONE;
    execute_gemm_split_fused(rec, gemm, &none, input, weights, output, scratch)
}

/// [`execute_gemm_split`] with a prologue ([`super::fusion`]) on each element of the input as
/// it is staged (every part sees its elements' own columns of the depth): the lm-head's
/// backward computes the cross-entropy's gradient so ([`crate::loss::CrossEntropyGrad`]).
/// Epilogues are refused with an error: a part's sum is not the output they would see. Where
/// the GEMM is not split it is [`super::execute_gemm_fused`].
pub fn execute_gemm_split_fused<'a>(
    rec: &mut Recorder<'_>,
    gemm: &Gemm,
    fusion: &Fusion<'a>,
    input: impl Into<Operand<'a>>,
    weights: Weights<'a>,
    output: impl Into<OutputBuffer<'a>>,
    scratch: &mut GpuBuffer<f32>,
) -> Result<(), ExecError> {
    let (input, output) = (input.into(), output.into());
    if !fusion.epilogues.is_empty() {
        return Err(ExecError::Dispatch {
            kernel: coop::kernel_name(gemm.product).into(),
            what: format!("a split GEMM with {} epilogues", fusion.epilogues.len()),
            why: "a split GEMM takes a prologue only (each part sums a part of the depth, not \
                  the output an epilogue would see): run execute_gemm_fused"
                .into(),
        });
    }
    let dense = !matches!(weights, Weights::Ternary { .. });
    let input_half = matches!(input, Operand::F16(_));
    let plan = plan(rec.gpu(), gemm, input_half).filter(|_| dense);
    let (Some((tile, subgroup, parts)), OutputBuffer::F32(out)) = (plan, &output) else {
        return execute_gemm_fused(rec, gemm, fusion, input, weights, output);
    };
    let (scale, half) = check_gemm(rec.gpu(), gemm, fusion, (&input, &weights, &output))?;
    let name = coop::kernel_name(gemm.product);
    let (cols, depth) = gemm.cols_depth();
    let slice = (gemm.m * cols).next_multiple_of(4);
    let need = parts as usize * slice;
    expect_u32(name, "the split's scratch (parts · m · cols)", need)?;
    expect_len(
        name,
        "scratch",
        scratch,
        Len::AtLeast(need),
        "gemm_split_scratch_len",
    )?;
    let w = match weights {
        Weights::Dense(w) | Weights::ScaledDense { w, .. } => Operand::F32(w),
        Weights::Half { w, .. } => Operand::F16(w),
        Weights::Ternary { .. } => unreachable!("ternary weights are not split (above)"),
    };
    let launch = coop::Launch {
        product: gemm.product,
        shape: (cols as u32, depth as u32),
        m: gemm.m as u32,
        tile,
        subgroup,
        accumulate: false,
        scale,
        input_exponent: gemm.input_exponent,
        splits: parts,
        input_blocks: [0; coop::MAX_INPUT_BLOCKS],
        output_blocks: [0; coop::MAX_INPUT_BLOCKS],
    };
    debug_assert!(!half.output, "an f16 output is not split (above)");
    // Compiled before the GEMM is recorded: a failure leaves the recorder as it was.
    let sum = rec
        .gpu()
        .kernel(&sum_key(parts, gemm.accumulate), sum_body)?;
    coop::record(
        rec,
        &launch,
        input,
        w,
        OutputBuffer::F32(&mut *scratch),
        fusion,
    )?;
    let n4 = (slice / 4) as u32;
    let args = Args::new()
        .buffer_vec4("slices", &*scratch)
        .buffer_vec4("out", &**out)
        .param("n4", n4);
    rec.launch(&sum, &args, Grid::Threads(u64::from(n4)))
}

fn sum_key(parts: u32, accumulate: bool) -> KernelKey {
    KernelKey::new("gemm_split_sum")
        .workgroup_size(256)
        .shape("parts", parts)
        .shape("accumulate", accumulate)
}

/// `out[i] (+)= Σ_z slices[z·n4 + i]` over vec4s (a slice `n4` vec4s; the output's allocation
/// is padded to 16 bytes, so its last vec4 may run past its length).
fn sum_body(k: &mut KernelBuilder) {
    let parts: u32 = k.shape("parts");
    let accumulate: bool = k.shape("accumulate");
    let slices = k.storage::<Vec4<f32>>("slices");
    let out = k.storage_rw::<Vec4<f32>>("out");
    let n4 = k.param::<u32>("n4");
    let index = k.global_index();
    let i = k.let_("i", index);
    k.if_(i.lt(&n4), |k| {
        let mut sum = slices.at(&i);
        for z in 1..parts {
            sum = sum + slices.at(&i + &n4 * z);
        }
        if accumulate {
            sum = out.at(&i) + sum;
        }
        k.store(&out, &i, sum);
    });
}

/// The WGSL of this module's own kernel (the split GEMMs are [`coop`]'s), for snapshots.
pub fn kernels() -> Result<Vec<Kernel>, hesper_dsl::DslError> {
    Ok(vec![Kernel::build(&sum_key(4, true), sum_body)?])
}

/// The sum at any count of parts, within `limits`, for [`crate::catalog`].
pub(crate) mod build {
    use super::*;
    use crate::catalog::Failure;

    pub(crate) fn sum(parts: u32, accumulate: bool, limits: &Limits) -> Result<Kernel, Failure> {
        if !(1..=coop::MAX_SPLITS).contains(&parts) {
            return Err(Failure::rule(
                format!("parts = {parts}"),
                format!("a split GEMM has 1 to {} parts", coop::MAX_SPLITS),
            ));
        }
        Ok(Kernel::build_with_limits(
            &sum_key(parts, accumulate),
            limits,
            sum_body,
        )?)
    }
}
