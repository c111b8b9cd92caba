//! Fusion: DSL code that a GEMM runs on each element of its input as it reads it (a prologue)
//! and on each element of its output before it stores it (epilogues), so that an activation, a
//! norm's scaling, a bias, a residual or a LoRA up-projection rides along with the GEMM instead
//! of taking a launch and a pass over the activations of its own — without copying the GEMM.
//!
//! A fusion is elementwise code over a `[rows, width]` matrix: `(row, col, value) → value`.
//! As a prologue it sees the input `A[rows, depth]` (`width` = the depth) and gives the element
//! the GEMM multiplies; as an epilogue it sees `s·Σ` of the output `[rows, cols]` (`width` =
//! `cols`) and gives what is stored (or, with `accumulate`, added to what is there). Epilogues
//! run in the order given. Its author implements [`GemmFusion`]: the kernel-key entries that
//! name the code, the code itself (which may declare buffers and runtime parameters of its
//! own), the checks of its buffers, and their binding. [`super::execute_gemm_fused`] runs a
//! GEMM with them, on the f32 tiled GEMM and on the tensor cores alike.
//!
//! Kernels of other modules provide their own: [`crate::lora::LoraUp`] (the LoRA
//! up-projection as an epilogue), [`crate::ffn::SwigluInput`] (SwiGLU as a prologue); this
//! module [`Residual`] and [`Bias`].
//!
//! Two kinds of epilogue the tensor cores take a tile at a time rather than element by
//! element (which goes through workgroup memory): a matrix added ([`GemmFusion::added_matrix`],
//! a residual) and a product of low rank added ([`GemmFusion::low_rank`], LoRA's
//! up-projection), which they multiply as more depth of their own product.

use hesper_dsl::ShapeValue;
use hesper_dsl::prelude::*;
use hesper_exec::{Args, ExecError, GpuBuffer};

use crate::expect_len;

/// A fusion's element function: `(builder, row, col, value) → value`.
pub type ElementFn =
    Box<dyn Fn(&mut KernelBuilder, &Expr<u32>, &Expr<u32>, Expr<f32>) -> Expr<f32>>;

/// Elementwise code a GEMM runs on its input or output (the module's doc).
pub trait GemmFusion {
    /// A name for the code, unique among fusions (it goes into the kernel key and errors).
    fn name(&self) -> &'static str;

    /// Compile-time values the code depends on, as kernel-key shape entries (their names unique
    /// to this fusion, e.g. prefixed by its name). [`GemmFusion::build`] must read what it
    /// depends on from these (through `KernelBuilder::shape`) and nothing else: a GEMM's
    /// pipeline is built once per key.
    fn shape(&self) -> Vec<(String, ShapeValue)> {
        vec![]
    }

    /// Declares the buffers and runtime parameters the code reads (named apart from the GEMM's
    /// own: `x`, `w`, `y`, `dy`, `dx`, `rows`, `scale`, `input_scale`) and returns the element
    /// function over a `[rows, width]` matrix. Indices it is given are in range: a row below
    /// the GEMM's `rows`, a column below `width`.
    fn build(&self, k: &mut KernelBuilder, width: u32) -> ElementFn;

    /// `Ok` when the fusion's buffers fit a `[rows, width]` matrix; else an error naming
    /// `kernel` and the buffer.
    fn check(&self, kernel: &str, rows: usize, width: usize) -> Result<(), ExecError>;

    /// Binds what [`GemmFusion::build`] declared.
    fn bind<'a>(&'a self, args: Args<'a>) -> Args<'a>;

    /// `Some(binding)` where the code is exactly `value + m[row·width + col]` for an f32
    /// buffer `m` that [`GemmFusion::build`] declares as `binding` (a residual): the tensor
    /// cores then add it a 16×16 tile at a time and store their tiles directly, where other
    /// epilogues go through workgroup memory element by element.
    fn added_matrix(&self) -> Option<&'static str> {
        None
    }

    /// The terms where the code is exactly `value + Σ_t s_t·Σ_j h_t[row, j]·w_t(col, j)`, a
    /// sum of products of low rank added ([`LowRank`], each over all columns or a range of
    /// them); empty otherwise. The tensor cores then multiply them as more depth of their own
    /// product (`[A | h]·[B; w]`, each value of `h` and `w` in two f16 parts, its 10 leading
    /// mantissa bits and the rest, which keep about 22 bits) where the tile's depth has room
    /// for each ([`low_rank_fits`]) and each range is whole tiles, and the epilogue stays a
    /// tile at a time where the others allow it.
    fn low_rank(&self) -> Vec<LowRank> {
        vec![]
    }
}

/// A low-rank product an epilogue adds ([`GemmFusion::low_rank`]): the bindings and runtime
/// parameter that [`GemmFusion::bind`] binds, and the shape of `w`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LowRank {
    /// `h: [rows, rank]`, f32.
    pub h: &'static str,
    /// `w`, f32: `[width, rank]` where `rank_minor` (element `(col, j)` at `col·rank + j`),
    /// else `[rank, width]` (at `j·width + col`).
    pub w: &'static str,
    pub rank: u32,
    pub rank_minor: bool,
    /// The runtime f32 parameter `s`.
    pub scale: &'static str,
    /// `Some((start, end))`: the term adds to columns `start..end` only, and `w` has
    /// `end − start` columns (its column `col − start`); `None`: to every column.
    pub columns: Option<(u32, u32)>,
}

/// The depth a low-rank product of `rank` takes on the tensor cores, rounded up to 16: with
/// `h = h₁ + h₂` and `w = w₁ + w₂` (each value cut to f16's 10 mantissa bits, and what was cut
/// rounded to f16), three products `h₁·w₁ + h₂·w₁ + h₁·w₂`, which keep f32's digits but the
/// last few (an adapter's values are f32 parameters, not the frozen f16 weights).
pub(crate) fn low_rank_depth(rank: u32) -> u32 {
    (3 * rank).div_ceil(16) * 16
}

/// Whether a tensor-core GEMM stepping `bk` of its depth at a time multiplies a low-rank
/// epilogue of `rank` ([`GemmFusion::low_rank`]) as more depth of its product; else the
/// epilogue goes element by element through workgroup memory, which costs more than a launch
/// of its own (BENCHMARKS.md, "Fusion").
pub fn low_rank_fits(rank: usize, bk: u32) -> bool {
    u32::try_from(rank).is_ok_and(|r| r > 0 && low_rank_depth(r) <= bk)
}

/// Whether a tensor-core GEMM whose tiles are `bn` columns wide, `cols` in all, multiplies
/// `term` as more depth: its rank fits the step ([`low_rank_fits`]) and its columns, where it
/// has a range, are whole tiles (each tile adds it or not).
fn low_rank_tiled(term: &LowRank, (bk, bn): (u32, u32), cols: u32) -> bool {
    let whole = |c: u32| c.is_multiple_of(bn) || c == cols;
    low_rank_fits(term.rank as usize, bk)
        && term
            .columns
            .is_none_or(|(s, e)| s < e && e <= cols && s.is_multiple_of(bn) && whole(e))
}

/// An epilogue's low-rank product as a tensor-core GEMM declared it.
pub(crate) struct LowRankBuilt {
    pub h: hesper_dsl::ReadBuffer<f32>,
    pub w: hesper_dsl::ReadBuffer<f32>,
    pub rank: u32,
    pub rank_minor: bool,
    pub scale: Expr<f32>,
    pub columns: Option<(u32, u32)>,
}

/// The fusions of one GEMM: at most one prologue, any number of epilogues.
#[derive(Clone, Copy, Default)]
pub struct Fusion<'a> {
    pub prologue: Option<&'a dyn GemmFusion>,
    pub epilogues: &'a [&'a dyn GemmFusion],
}

impl<'a> Fusion<'a> {
    /// No fusion: the plain GEMM.
    pub const NONE: Fusion<'static> = Fusion {
        prologue: None,
        epilogues: &[],
    };

    /// Whether some epilogue adds a matrix ([`GemmFusion::added_matrix`]).
    pub(crate) fn adds_matrices(&self) -> bool {
        self.epilogues.iter().any(|e| e.added_matrix().is_some())
    }

    /// Which epilogues the tensor cores multiply as more depth ([`GemmFusion::low_rank`]):
    /// low-rank ones with only additions before them (an addition moved ahead of them changes
    /// nothing) whose every term the tile takes (`tile`: its step and columns, `None` off the
    /// tensor cores; `cols` the output's); the others go element by element.
    pub(crate) fn low_rank_taken(&self, tile: Option<(u32, u32)>, cols: u32) -> Vec<bool> {
        let mut additive = true;
        self.epilogues
            .iter()
            .map(|e| {
                let terms = e.low_rank();
                let taken = additive
                    && !terms.is_empty()
                    && tile.is_some_and(|t| terms.iter().all(|term| low_rank_tiled(term, t, cols)));
                additive &= e.added_matrix().is_some() || !terms.is_empty();
                taken
            })
            .collect()
    }

    /// Whether there is no code to fuse.
    pub fn is_empty(&self) -> bool {
        self.prologue.is_none() && self.epilogues.is_empty()
    }

    /// The key with this fusion's entries added: `prologue_<name>` and `epilogue<i>_<name>`
    /// (the order matters), then each fusion's own shape entries. An error when two fusions
    /// share a name or a shape entry, or an entry would replace one of the GEMM's.
    pub(crate) fn key(&self, kernel: &str, mut key: KernelKey) -> Result<KernelKey, ExecError> {
        let taken: Vec<String> = key.shape_params().iter().map(|(n, _)| n.clone()).collect();
        let mut added: Vec<String> = vec![];
        let mut add = |key: KernelKey, name: String, value: ShapeValue| {
            if taken.contains(&name) || added.contains(&name) {
                return Err(ExecError::Dispatch {
                    kernel: kernel.into(),
                    what: format!("fusion key entry `{name}`"),
                    why: "two fusions of one GEMM, or a fusion and the GEMM, use it".into(),
                });
            }
            added.push(name.clone());
            Ok(key.shape(name, value))
        };
        let mut names = vec![];
        if let Some(p) = self.prologue {
            key = add(key, format!("prologue_{}", p.name()), true.into())?;
            names.push(p.name());
        }
        for (i, e) in self.epilogues.iter().enumerate() {
            key = add(key, format!("epilogue{i}_{}", e.name()), true.into())?;
            if names.contains(&e.name()) {
                return Err(ExecError::Dispatch {
                    kernel: kernel.into(),
                    what: format!("fusion `{}`", e.name()),
                    why: "a fusion runs at most once in a GEMM".into(),
                });
            }
            names.push(e.name());
        }
        for f in self.prologue.iter().chain(self.epilogues) {
            for (name, value) in f.shape() {
                key = add(key, name, value)?;
            }
        }
        Ok(key)
    }

    /// Checks every fusion's buffers: the prologue's against `[rows, depth]`, the epilogues'
    /// against `[rows, cols]`.
    pub(crate) fn check(
        &self,
        kernel: &str,
        (rows, cols, depth): (usize, usize, usize),
    ) -> Result<(), ExecError> {
        if let Some(p) = self.prologue {
            p.check(kernel, rows, depth)?;
        }
        self.epilogues
            .iter()
            .try_for_each(|e| e.check(kernel, rows, cols))
    }

    /// Binds every fusion's buffers and parameters.
    pub(crate) fn bind<'b>(&self, mut args: Args<'b>) -> Args<'b>
    where
        'a: 'b,
    {
        for f in self.prologue.iter().chain(self.epilogues) {
            args = f.bind(args);
        }
        args
    }

    /// Builds the code inside a GEMM's kernel: the prologue's element function (over
    /// `[rows, depth]`) and the epilogues' (over `[rows, cols]`) chained into one; the
    /// low-rank epilogues a tensor-core GEMM multiplies (`tile`: its step and columns,
    /// [`Fusion::low_rank_taken`]; `None` elsewhere) declared instead of chained; and where
    /// every other epilogue adds a matrix ([`GemmFusion::added_matrix`]), those matrices.
    pub(crate) fn build(
        &self,
        k: &mut KernelBuilder,
        (cols, depth): (u32, u32),
        tile: Option<(u32, u32)>,
    ) -> Built {
        let prologue = self.prologue.map(|p| p.build(k, depth));
        let taken = self.low_rank_taken(tile, cols);
        let mut low_rank = vec![];
        let all_matrices = self
            .epilogues
            .iter()
            .zip(&taken)
            .all(|(e, taken)| *taken || e.added_matrix().is_some());
        let mut added_matrices = vec![];
        let mut chained = vec![];
        for (e, taken) in self.epilogues.iter().zip(taken) {
            match taken {
                true => low_rank.extend(e.low_rank().into_iter().map(|term| LowRankBuilt {
                    h: k.storage::<f32>(term.h),
                    w: k.storage::<f32>(term.w),
                    rank: term.rank,
                    rank_minor: term.rank_minor,
                    scale: k.param::<f32>(term.scale),
                    columns: term.columns,
                })),
                false => chained.push(e),
            }
        }
        let epilogues: Vec<ElementFn> = chained
            .into_iter()
            .map(|e| match (all_matrices, e.added_matrix()) {
                (true, Some(binding)) => {
                    // The GEMM declares it, to add it by tiles as well.
                    let m = k.storage::<f32>(binding);
                    added_matrices.push(m.clone());
                    Box::new(
                        move |_: &mut KernelBuilder, row: &Expr<u32>, col: &Expr<u32>, v| {
                            v + m.at(row * cols + col)
                        },
                    ) as ElementFn
                }
                _ => e.build(k, cols),
            })
            .collect();
        let epilogue: Option<ElementFn> = (!epilogues.is_empty()).then(|| {
            Box::new(
                move |k: &mut KernelBuilder, row: &Expr<u32>, col: &Expr<u32>, v| {
                    epilogues.iter().fold(v, |v, e| e(k, row, col, v))
                },
            ) as ElementFn
        });
        Built {
            prologue,
            epilogue,
            added_matrices: (!self.epilogues.is_empty() && all_matrices).then_some(added_matrices),
            low_rank,
        }
    }
}

/// A fusion's code inside a GEMM kernel.
pub(crate) struct Built {
    pub prologue: Option<ElementFn>,
    /// The epilogues but the low-rank products the tensor cores multiply.
    pub epilogue: Option<ElementFn>,
    /// Where every epilogue adds a matrix or is such a low-rank product: the matrices
    /// (`[rows, cols]`, f32), in order.
    pub added_matrices: Option<Vec<hesper_dsl::ReadBuffer<f32>>>,
    /// The low-rank products the tensor cores multiply.
    pub low_rank: Vec<LowRankBuilt>,
}

/// The element function applied to each lane of `v` at columns `col + q` (`col(q)` gives
/// them), as one vec4.
pub(crate) fn per_lane(
    k: &mut KernelBuilder,
    f: &ElementFn,
    row: &Expr<u32>,
    col: &dyn Fn(&mut KernelBuilder, u32) -> Expr<u32>,
    v: Expr<Vec4<f32>>,
) -> Expr<Vec4<f32>> {
    let v = k.let_("fused_in", v);
    let lanes: Vec<Expr<f32>> = (0..4)
        .map(|q| {
            let c = col(k, q);
            let value = f(k, row, &c, super::lane(&v, q));
            k.let_("fused", value)
        })
        .collect();
    super::vec4_of(lanes)
}

/// Epilogue: `value + r[row, col]` — a residual connection (`x + o·Wᵀ`) without a copy of `x`
/// into the output first.
pub struct Residual<'a> {
    /// `[rows, cols]`, f32.
    pub residual: &'a GpuBuffer<f32>,
}

impl GemmFusion for Residual<'_> {
    fn name(&self) -> &'static str {
        "residual"
    }
    fn build(&self, k: &mut KernelBuilder, width: u32) -> ElementFn {
        let r = k.storage::<f32>("residual");
        Box::new(move |_, row, col, v| v + r.at(row * width + col))
    }
    fn check(&self, kernel: &str, rows: usize, width: usize) -> Result<(), ExecError> {
        expect_len(
            kernel,
            "residual",
            self.residual,
            rows * width,
            "[rows, cols]",
        )
    }
    fn bind<'a>(&'a self, args: Args<'a>) -> Args<'a> {
        args.buffer("residual", self.residual)
    }
    fn added_matrix(&self) -> Option<&'static str> {
        Some("residual")
    }
}

/// Epilogue: `value + bias[col]`.
pub struct Bias<'a> {
    /// `[cols]`, f32.
    pub bias: &'a GpuBuffer<f32>,
}

impl GemmFusion for Bias<'_> {
    fn name(&self) -> &'static str {
        "bias"
    }
    fn build(&self, k: &mut KernelBuilder, _: u32) -> ElementFn {
        let b = k.storage::<f32>("bias");
        Box::new(move |_, _, col, v| v + b.at(col))
    }
    fn check(&self, kernel: &str, _: usize, width: usize) -> Result<(), ExecError> {
        expect_len(kernel, "bias", self.bias, width, "[cols]")
    }
    fn bind<'a>(&'a self, args: Args<'a>) -> Args<'a> {
        args.buffer("bias", self.bias)
    }
}
