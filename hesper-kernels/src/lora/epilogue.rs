//! LoRA's up-projection as the epilogue of a frozen projection's GEMM ([`LoraUp`]), one or
//! several in one GEMM ([`LoraUps`]).

use std::ops::Range;

use hesper_dsl::prelude::*;
use hesper_exec::{Args, ExecError, GpuBuffer};

use super::Layout;
use crate::expect_len;
use crate::linear::fusion::{ElementFn, GemmFusion, LowRank};

/// The adapter matrix a [`LoraUp`] epilogue multiplies by.
#[derive(Clone, Copy)]
pub enum UpWeight<'a> {
    /// `B: [out, r]`: the forward's `s·h·Bᵀ` (`h = x·Aᵀ`).
    B(&'a GpuBuffer<f32>),
    /// `A: [r, in]`: the backward's `s·dh·A` (`dh = dy·B`).
    A(&'a GpuBuffer<f32>),
}

/// The largest rank a [`LoraUp`] epilogue takes (its sum is unrolled).
pub const MAX_FUSED_RANK: usize = 64;

/// Epilogue of a frozen projection's GEMM ([`crate::linear::execute_gemm_fused`]): adds the
/// LoRA up-projection `s·Σ_j h[row, j]·W(col, j)`, with `W` = `B` (`y = x·Wᵀ + s·h·Bᵀ`, the
/// forward) or `Aᵀ` (`dx = dy·W + s·dh·A`, the backward), so that the adapter's product out of
/// `r` needs no launch or pass over `[T, width]` of its own. `h` (`[T, r]`) comes first, from
/// the products into `r` ([`super::execute_grad_dh`], or the forward's `x·Aᵀ`).
///
/// With `columns`, it adds to those columns of the output only, `W` having as many: an adapter
/// of one projection in a GEMM of several side by side (`[q | k | v]`, where LoRA adapts the
/// query and the value: a [`LoraUps`] of two).
pub struct LoraUp<'a> {
    /// `[rows, r]`.
    pub h: &'a GpuBuffer<f32>,
    pub weight: UpWeight<'a>,
    pub rank: usize,
    pub scale: f32,
    /// `Some(start..end)`: the columns it adds to; `None`: all of them.
    pub columns: Option<Range<usize>>,
}

/// One up-projection's term of the element function: `(builder, row, col) → value`.
type Term = Box<dyn Fn(&mut KernelBuilder, &Expr<u32>, &Expr<u32>) -> Expr<f32>>;

/// Where one up-projection's buffers, parameter and key entries go in a GEMM.
struct Names {
    h: &'static str,
    w: &'static str,
    scale: &'static str,
    rank: &'static str,
    rank_minor: &'static str,
    start: &'static str,
    end: &'static str,
}

/// A lone [`LoraUp`]'s names.
const ONE: Names = Names {
    h: "lora_h",
    w: "lora_w",
    scale: "lora_scale",
    rank: "lora_rank",
    rank_minor: "lora_rank_minor",
    start: "lora_start",
    end: "lora_end",
};

/// The most up-projections a [`LoraUps`] adds.
pub const MAX_UPS: usize = 4;

/// The names of a [`LoraUps`]' up-projections, in order.
const MANY: [Names; MAX_UPS] = {
    macro_rules! names {
        ($i:literal) => {
            Names {
                h: concat!("lora", $i, "_h"),
                w: concat!("lora", $i, "_w"),
                scale: concat!("lora", $i, "_scale"),
                rank: concat!("lora", $i, "_rank"),
                rank_minor: concat!("lora", $i, "_rank_minor"),
                start: concat!("lora", $i, "_start"),
                end: concat!("lora", $i, "_end"),
            }
        };
    }
    [names!(0), names!(1), names!(2), names!(3)]
};

impl LoraUp<'_> {
    fn w(&self) -> &GpuBuffer<f32> {
        match self.weight {
            UpWeight::B(w) | UpWeight::A(w) => w,
        }
    }

    fn rank_u32(&self) -> u32 {
        u32::try_from(self.rank).unwrap_or(u32::MAX)
    }

    fn shape_as(&self, names: &Names) -> Vec<(String, hesper_dsl::ShapeValue)> {
        let rank_minor = matches!(self.weight, UpWeight::B(_));
        let mut shape = vec![
            (names.rank.into(), self.rank_u32().into()),
            (names.rank_minor.into(), rank_minor.into()),
        ];
        if let Some(columns) = &self.columns {
            let at = |c: usize| u32::try_from(c).unwrap_or(u32::MAX).into();
            shape.push((names.start.into(), at(columns.start)));
            shape.push((names.end.into(), at(columns.end)));
        }
        shape
    }

    /// The element function's term: `s·Σ_j h[row, j]·W(col, j)`, 0 outside `columns`.
    fn build_as(&self, k: &mut KernelBuilder, width: u32, names: &Names) -> Term {
        let rank = k.shape::<u32>(names.rank);
        let layout = Layout::from_shape(k.shape(names.rank_minor));
        let columns = self
            .columns
            .is_some()
            .then(|| (k.shape::<u32>(names.start), k.shape::<u32>(names.end)));
        let h = k.storage::<f32>(names.h);
        let w = k.storage::<f32>(names.w);
        let scale = k.param::<f32>(names.scale);
        Box::new(move |k, row, col| {
            let h_row = k.let_("lora_h_row", row * rank);
            // `W`'s column: past `start` (clamped into `W` outside the range, where the term
            // is 0).
            let (col, w_width, inside) = match columns {
                Some((start, end)) => {
                    let c = k.let_("lora_col", (col.max(start) - start).min(end - start - 1));
                    (c, end - start, Some(col.ge(start).and(col.lt(end))))
                }
                None => (col.clone(), width, None),
            };
            let w_at = |j: u32| match layout {
                Layout::RankMinor => &col * rank + j,
                Layout::RankMajor => &col + j * w_width,
            };
            let mut sum = h.at(&h_row) * w.at(w_at(0));
            for j in 1..rank {
                sum = h.at(&h_row + j).fma(w.at(w_at(j)), sum);
            }
            let term = &scale * sum;
            match inside {
                Some(inside) => select(inside, term, lit(0.0f32)),
                None => term,
            }
        })
    }

    fn check_as(&self, kernel: &str, rows: usize, width: usize) -> Result<(), ExecError> {
        if self.rank == 0 || self.rank > MAX_FUSED_RANK {
            return Err(ExecError::Dispatch {
                kernel: kernel.into(),
                what: format!("lora_up epilogue of rank {}", self.rank),
                why: format!("its rank is 1 to {MAX_FUSED_RANK}"),
            });
        }
        let w_width = match &self.columns {
            Some(c) if c.start >= c.end || c.end > width => {
                return Err(ExecError::Dispatch {
                    kernel: kernel.into(),
                    what: format!("lora_up epilogue's columns {c:?}"),
                    why: format!("a range of at least one column within the output's {width}"),
                });
            }
            Some(c) => c.len(),
            None => width,
        };
        let what = match self.weight {
            UpWeight::B(_) => "B: [out, rank] (out: its columns)",
            UpWeight::A(_) => "A: [rank, in] (in: its columns)",
        };
        expect_len(kernel, "lora_h", self.h, rows * self.rank, "[rows, rank]")?;
        expect_len(kernel, "lora_w", self.w(), w_width * self.rank, what)
    }

    fn low_rank_as(&self, names: &Names) -> LowRank {
        let at = |c: usize| u32::try_from(c).unwrap_or(u32::MAX);
        LowRank {
            h: names.h,
            w: names.w,
            rank: self.rank_u32(),
            rank_minor: matches!(self.weight, UpWeight::B(_)),
            scale: names.scale,
            columns: self.columns.as_ref().map(|c| (at(c.start), at(c.end))),
        }
    }

    fn bind_as<'a>(&'a self, args: Args<'a>, names: &Names) -> Args<'a> {
        args.buffer(names.h, self.h)
            .buffer(names.w, self.w())
            .param(names.scale, self.scale)
    }
}

impl GemmFusion for LoraUp<'_> {
    fn name(&self) -> &'static str {
        "lora_up"
    }
    fn shape(&self) -> Vec<(String, hesper_dsl::ShapeValue)> {
        self.shape_as(&ONE)
    }
    fn build(&self, k: &mut KernelBuilder, width: u32) -> ElementFn {
        let term = self.build_as(k, width, &ONE);
        Box::new(move |k, row, col, value| value + term(k, row, col))
    }
    fn check(&self, kernel: &str, rows: usize, width: usize) -> Result<(), ExecError> {
        self.check_as(kernel, rows, width)
    }
    fn low_rank(&self) -> Vec<LowRank> {
        vec![self.low_rank_as(&ONE)]
    }
    fn bind<'a>(&'a self, args: Args<'a>) -> Args<'a> {
        self.bind_as(args, &ONE)
    }
}

/// Several [`LoraUp`] epilogues in one GEMM (up to [`MAX_UPS`]): adds each's up-projection.
/// On the tensor cores, ups over columns that do not overlap take one fold's depth between
/// them (each workgroup's tile lies in one of them), and ups that need more depth than a step
/// holds are folded a step after another. Each up binds two storage buffers (`h`, `W`) beside
/// the GEMM's three: past two ups, a device held to WebGPU's default of eight a shader stage
/// refuses the pipeline (an error naming the kernel and the limit).
///
/// ```no_run
/// # use hesper_exec::{Gpu, GpuBuffer, GpuOptions};
/// # use hesper_kernels::lora::{LoraUp, LoraUps, UpWeight};
/// # use hesper_kernels::linear::{Fusion, GemmFusion};
/// # fn demo(gpu: &Gpu, h_q: &GpuBuffer<f32>, b_q: &GpuBuffer<f32>, h_v: &GpuBuffer<f32>,
/// #         b_v: &GpuBuffer<f32>) {
/// // `[q | k | v]` (576 | 192 | 192 columns) with LoRA on the query and the value.
/// let ups = [
///     LoraUp { h: h_q, weight: UpWeight::B(b_q), rank: 8, scale: 2.0, columns: Some(0..576) },
///     LoraUp { h: h_v, weight: UpWeight::B(b_v), rank: 8, scale: 2.0, columns: Some(768..960) },
/// ];
/// let ups = LoraUps { ups: &ups };
/// let epilogues: [&dyn GemmFusion; 1] = [&ups];
/// let fusion = Fusion { prologue: None, epilogues: &epilogues };
/// # }
/// ```
pub struct LoraUps<'a> {
    pub ups: &'a [LoraUp<'a>],
}

impl GemmFusion for LoraUps<'_> {
    fn name(&self) -> &'static str {
        "lora_ups"
    }
    fn shape(&self) -> Vec<(String, hesper_dsl::ShapeValue)> {
        let names = MANY.iter();
        let mut shape: Vec<_> = vec![("lora_ups".into(), (self.ups.len() as u32).into())];
        shape.extend((self.ups.iter().zip(names)).flat_map(|(u, n)| u.shape_as(n)));
        shape
    }
    fn build(&self, k: &mut KernelBuilder, width: u32) -> ElementFn {
        let terms: Vec<_> = (self.ups.iter().zip(&MANY))
            .map(|(u, n)| u.build_as(k, width, n))
            .collect();
        Box::new(move |k, row, col, value| terms.iter().fold(value, |v, t| v + t(k, row, col)))
    }
    fn check(&self, kernel: &str, rows: usize, width: usize) -> Result<(), ExecError> {
        if self.ups.is_empty() || self.ups.len() > MAX_UPS {
            return Err(ExecError::Dispatch {
                kernel: kernel.into(),
                what: format!("lora_ups epilogue of {} up-projections", self.ups.len()),
                why: format!("it takes 1 to {MAX_UPS}"),
            });
        }
        self.ups
            .iter()
            .try_for_each(|u| u.check_as(kernel, rows, width))
    }
    fn low_rank(&self) -> Vec<LowRank> {
        (self.ups.iter().zip(&MANY))
            .map(|(u, n)| u.low_rank_as(n))
            .collect()
    }
    fn bind<'a>(&'a self, args: Args<'a>) -> Args<'a> {
        (self.ups.iter().zip(&MANY)).fold(args, |args, (u, n)| u.bind_as(args, n))
    }
}
