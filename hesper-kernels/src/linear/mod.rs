//! Linear layers (KERNELS.md): the weight `W` is `[out, in]` = `[n, k]`, row-major.
//!
//! - `matmul_nt`: `y (+)= x·Wᵀ`, `x: [m, k]` → `y: [m, n]` — the forward through a frozen weight;
//! - `matmul_nn`: `dx (+)= dy·W`, `dy: [m, n]` → `dx: [m, k]` — the backward through it;
//! - `bitlinear_forward`, `bitlinear_transpose`: the same two products with BitNet's ternary
//!   weight `s·T` (`T` in {−1, 0, +1} packed 16 per `u32` by [`pack_ternary`], `s` a per-tensor
//!   scale): `y (+)= s·x·Tᵀ` and `dx (+)= s·dy·T` — the backward treats `s·T` as the dense matrix.
//!
//! All four are one tiled GEMM `out[m, cols] (+)= s·A[m, depth]·B[depth, cols]` that differs only
//! in how it reads `B` out of `W`: through `·Wᵀ`, `B(d, c) = W[c, d]` (`cols = n`, `depth = k`);
//! through `·W`, `B(d, c) = W[d, c]` (`cols = k`, `depth = n`).
//!
//! ## Tiling
//! A workgroup computes a `bm × bn` tile of `out`, stepping through the depth `bk` at a time. Each
//! step stages the `bm × bk` slice of `A` and the `bk × bn` slice of `B` in workgroup memory, both
//! depth-major as `vec4`s along the tile's rows or columns, so that the inner loop reads whole
//! `vec4`s: an invocation keeps a `tm × tn` register tile (in 4×4 blocks spread `4·bm/tm` rows and
//! `4·bn/tn` columns apart, so that an invocation group reads consecutive `vec4`s) and does
//! `tm·tn` FMAs per `(tm + tn) / 4` workgroup loads. The staging is double-buffered: the next
//! step's slices are read from memory into registers before the current step's FMAs and stored
//! after them, so one barrier per step suffices.
//!
//! Compile-time (the kernel key): the layer's `cols` and `depth` (a model's widths), the tile and
//! `accumulate`. Runtime: `m`, the token count. Knowing `cols` and `depth` when the kernel is
//! built removes every bounds check a shape does not need (a depth that is a multiple of `bk`
//! needs no zeroing of the last step; `cols` a multiple of `bn` no column guards) and lets rows be
//! read and written as `vec4`s when `cols` is a multiple of 4. Reads past the last row or column
//! are clamped into the buffer rather than zeroed: they only feed outputs that are never stored.
//! Reads past the depth are zeroed, since they would feed every output.
//!
//! ## Few rows
//! `·Wᵀ` through a dense weight over at most [`gemv::MAX_ROWS`] rows (decoding's one token) runs
//! [`gemv`] instead: a workgroup per output, its invocations along the depth.
//!
//! ## Long depths
//! A product with few output tiles over a long depth (the lm-head's backward) leaves most of the
//! GPU idle: [`split::execute_gemm_split`] cuts the depth into parts on the tensor cores, each
//! summed into a scratch slice, and adds the slices ([`split::execute_gemm_split_fused`] with a
//! prologue).

use hesper_dsl::prelude::*;
use hesper_dsl::{LocalArray, ReadBuffer, RwBuffer, Var, WorkgroupArray};
use hesper_exec::half::f16;
use hesper_exec::{Args, ExecError, Gpu, GpuBuffer, Grid, Recorder};

use crate::{bad_tile, expect_len, expect_u32};

pub mod coop;
pub mod fusion;
pub mod gemv;
pub mod split;

pub use fusion::{Fusion, GemmFusion};
use std::rc::Rc;

/// Ternary weights per packed `u32` (2 bits each).
pub const TERNARY_PER_WORD: usize = 16;

/// Which product of a linear layer with its weight `W: [n, k]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Product {
    /// `y = x·Wᵀ`: `x: [m, k]` → `y: [m, n]` (the forward).
    Nt,
    /// `dx = dy·W`: `dy: [m, n]` → `dx: [m, k]` (the backward to the input).
    Nn,
}

impl Product {
    /// The names of the input and output buffers, as kernels bind them and errors name them.
    fn names(self) -> (&'static str, &'static str) {
        match self {
            Product::Nt => ("x", "y"),
            Product::Nn => ("dy", "dx"),
        }
    }
}

/// A linear layer's weight `W: [n, k]`.
#[derive(Clone, Copy)]
pub enum Weights<'a> {
    /// Dense f32, `n·k` elements.
    Dense(&'a GpuBuffer<f32>),
    /// `scale·W`, dense (LoRA's `s·h·Bᵀ` and `s·dh·A`).
    ScaledDense { w: &'a GpuBuffer<f32>, scale: f32 },
    /// `scale·W`, dense f16 (a frozen weight kept at half the memory).
    Half { w: &'a GpuBuffer<f16>, scale: f32 },
    /// BitNet's `scale·T`, `T` packed by [`pack_ternary`] (`⌈n·k / 16⌉` words).
    Ternary {
        packed: &'a GpuBuffer<u32>,
        scale: f32,
    },
}

/// A GEMM's workgroup tile: `bm × bn` outputs per workgroup, `bk` of the depth per step, and
/// `tm × tn` outputs per invocation. `tm` and `tn` are multiples of 4 dividing `bm` and `bn`, and
/// the `(bm/tm)·(bn/tn)` invocations share out the `bk·bm/4` and `bk·bn/4` vec4s of a step's
/// slices evenly ([`Tile::check`] says which rule a tile breaks).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Tile {
    pub bm: u32,
    pub bn: u32,
    pub bk: u32,
    pub tm: u32,
    pub tn: u32,
}

impl Tile {
    /// 128×128 outputs, 8 deep, 8×8 per invocation, 256 invocations, 16.5 KiB of workgroup
    /// memory: the shape of the reference probe that reached 37 TFLOP/s on the H200 (here 32
    /// TFLOP/s at 4096 × 6912 × 2560, where `MEDIUM` reaches 34–38).
    pub const LARGE: Tile = Tile {
        bm: 128,
        bn: 128,
        bk: 8,
        tm: 8,
        tn: 8,
    };
    /// 64×64 outputs, 16 deep, 8×8 per invocation, 64 invocations, 17 KiB: four times the
    /// workgroups of `LARGE` with its work per invocation. [`Gemm::new`]'s tile: on the H200 it
    /// was the fastest of eight tiles, or within 10% of it, at every GEMM of a SmolLM2 LoRA step
    /// at 4096 and 16 384 tokens, and at 4096 × 6912 × 2560 (BENCHMARKS.md "The whole step").
    pub const MEDIUM: Tile = Tile {
        bm: 64,
        bn: 64,
        bk: 16,
        tm: 8,
        tn: 8,
    };
    /// 64×64 outputs, 16 deep, 4×4 per invocation, 256 invocations, 17 KiB.
    pub const SMALL: Tile = Tile {
        bm: 64,
        bn: 64,
        bk: 16,
        tm: 4,
        tn: 4,
    };

    /// 64×64 outputs, 8 deep, 4×8 per invocation, 128 invocations, 8.5 KiB: within what
    /// WebGPU guarantees every device (16 KiB of workgroup memory), for devices that offer no
    /// more.
    pub const PORTABLE: Tile = Tile {
        bm: 64,
        bn: 64,
        bk: 8,
        tm: 4,
        tn: 8,
    };

    /// Invocations per workgroup.
    pub fn invocations(&self) -> u32 {
        (self.bm / self.tm.max(1)) * (self.bn / self.tn.max(1))
    }

    /// Bytes of workgroup memory the GEMM kernels use at most: two `bk`-deep slices
    /// (double-buffered) of each operand's tile, rows padded by up to 4 floats (against bank
    /// conflicts).
    pub fn workgroup_bytes(&self) -> u32 {
        2 * 4 * self.bk * (self.bm + self.bn + 8)
    }

    /// This tile if a device with `limits` runs it, else the first standard tile that fits
    /// (`MEDIUM`, `SMALL`, then `PORTABLE`): a choice made for the shape, kept within the
    /// device.
    pub fn within(self, limits: &Limits) -> Tile {
        let fits = |t: &Tile| {
            t.workgroup_bytes() <= limits.max_workgroup_storage_bytes
                && t.invocations() <= limits.max_invocations_per_workgroup
        };
        [self, Tile::MEDIUM, Tile::SMALL, Tile::PORTABLE]
            .into_iter()
            .find(fits)
            .unwrap_or(self)
    }

    /// `Ok` when the kernels can run this tile; else an error naming `kernel` and the rule.
    pub fn check(&self, kernel: &str) -> Result<(), ExecError> {
        let Tile { bm, bn, bk, tm, tn } = *self;
        let fail = |why: &str| Err(bad_tile(kernel, self, why));
        let block = |t: u32, b: u32| t > 0 && t.is_multiple_of(4) && b > 0 && b.is_multiple_of(t);
        if !block(tm, bm) || !block(tn, bn) {
            return fail("tm and tn must be multiples of 4 that divide bm and bn");
        }
        let threads = self.invocations() as u64;
        let shared = |b: u32| {
            let vec4s = bk as u64 * b as u64 / 4;
            vec4s > 0 && vec4s.is_multiple_of(threads)
        };
        if !shared(bm) || !shared(bn) {
            return fail(
                "the invocations must share out the bk·bm/4 and bk·bn/4 vec4s of a step evenly",
            );
        }
        Ok(())
    }
}

/// A GEMM's input (`x` or `dy`): f32, or f16 (`half::f16` on the host).
#[derive(Clone, Copy)]
pub enum Operand<'a> {
    F32(&'a GpuBuffer<f32>),
    F16(&'a GpuBuffer<f16>),
}

impl<'a> From<&'a GpuBuffer<f32>> for Operand<'a> {
    fn from(b: &'a GpuBuffer<f32>) -> Self {
        Operand::F32(b)
    }
}
impl<'a> From<&'a GpuBuffer<f16>> for Operand<'a> {
    fn from(b: &'a GpuBuffer<f16>) -> Self {
        Operand::F16(b)
    }
}
impl<'a> From<&'a mut GpuBuffer<f32>> for Operand<'a> {
    fn from(b: &'a mut GpuBuffer<f32>) -> Self {
        Operand::F32(b)
    }
}

/// A GEMM's output (`y` or `dx`): f32, or f16 (rounded to nearest when stored).
pub enum OutputBuffer<'a> {
    F32(&'a mut GpuBuffer<f32>),
    F16(&'a mut GpuBuffer<f16>),
}

impl<'a> From<&'a mut GpuBuffer<f32>> for OutputBuffer<'a> {
    fn from(b: &'a mut GpuBuffer<f32>) -> Self {
        OutputBuffer::F32(b)
    }
}
impl<'a> From<&'a mut GpuBuffer<f16>> for OutputBuffer<'a> {
    fn from(b: &'a mut GpuBuffer<f16>) -> Self {
        OutputBuffer::F16(b)
    }
}

/// How a GEMM multiplies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Precision {
    /// f32 products and sums (f16 buffers are read as f32): the reference.
    F32,
    /// f16 inputs (f32 buffers rounded to f16 as they are read) multiplied on the tensor cores
    /// and summed in f32, where the device offers them (cooperative matrices, opened with
    /// `GpuOptions::cooperative_matrix`); elsewhere the f32 GEMM, which is at least as exact.
    /// f16 holds ±65504 at most: WGSL leaves the rounding of a larger f32 to the device (NVIDIA
    /// gives ±∞), so the products it feeds are not finite, which the result shows.
    F16,
}

/// One launch of the linear GEMM: the product, its dimensions (`W` is `[n, k]`, `m` rows),
/// whether it adds into the output, the precision, and the tiles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Gemm {
    pub product: Product,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub accumulate: bool,
    /// The f32 GEMM's tile.
    pub tile: Tile,
    pub precision: Precision,
    /// The tensor-core GEMM's tile; `None`: the device's tuned choice for the shape
    /// ([`coop::choose_tile`]).
    pub coop_tile: Option<coop::CoopTile>,
    /// Where the GEMM rounds an f32 input to f16 (the tensor cores), it multiplies the input by
    /// `2^input_exponent` first and the result by `2^−input_exponent`: exact in f32, it lifts
    /// small inputs (a backward's gradients, of the order of 1/targets) out of f16's
    /// subnormals, where they would lose their digits or vanish. Elsewhere (f32 products, f16
    /// inputs) it changes nothing. At most 64 either way; [`Gemm::with_input_exponent`].
    pub input_exponent: i32,
}

/// The largest `|Gemm::input_exponent|`: the scale and its inverse stay normal f32 numbers.
pub const MAX_INPUT_EXPONENT: i32 = 64;

/// Which kernel a GEMM runs on a device ([`gemm_path`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmPath {
    /// Nothing to compute (no rows or columns), or a fill of zeros (no depth).
    Empty,
    /// [`gemv`]: a workgroup per output (few rows).
    Gemv,
    /// The f32 tiled GEMM at this tile.
    Tiled(Tile),
    /// The tensor-core GEMM at this tile, laid out for subgroups of `subgroup` invocations.
    TensorCores { tile: coop::CoopTile, subgroup: u32 },
}

impl Gemm {
    /// The GEMM of `product` with `W: [n, k]` over `m` rows, in f32 at [`Tile::MEDIUM`].
    pub fn new(product: Product, (m, n, k): (usize, usize, usize), accumulate: bool) -> Gemm {
        Gemm {
            product,
            m,
            n,
            k,
            accumulate,
            tile: Tile::MEDIUM,
            precision: Precision::F32,
            coop_tile: None,
            input_exponent: 0,
        }
    }

    /// The same GEMM at another precision.
    pub fn with_precision(self, precision: Precision) -> Gemm {
        Gemm { precision, ..self }
    }

    /// The same GEMM with its f32 input scaled by `2^exponent` where it is rounded to f16
    /// ([`Gemm::input_exponent`]).
    pub fn with_input_exponent(self, exponent: i32) -> Gemm {
        Gemm {
            input_exponent: exponent,
            ..self
        }
    }

    /// `(cols, depth)` of the output and the contraction.
    fn cols_depth(&self) -> (usize, usize) {
        match self.product {
            Product::Nt => (self.n, self.k),
            Product::Nn => (self.k, self.n),
        }
    }
}

fn kernel_name(product: Product, ternary: bool) -> &'static str {
    match (product, ternary) {
        (Product::Nt, false) => "matmul_nt",
        (Product::Nn, false) => "matmul_nn",
        (Product::Nt, true) => "bitlinear_forward",
        (Product::Nn, true) => "bitlinear_transpose",
    }
}

/// Rows of `out` (and dense `W` read through `·W`) are accessed as `vec4`s when `cols` allows.
fn vec4_columns(cols: u32) -> bool {
    cols.is_multiple_of(4)
}

/// Which of a GEMM's buffers hold f16 (read as f32; the output rounded to f16 when stored).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct HalfBuffers {
    pub input: bool,
    pub weight: bool,
    pub output: bool,
}

impl HalfBuffers {
    pub const NONE: HalfBuffers = HalfBuffers {
        input: false,
        weight: false,
        output: false,
    };
    pub fn any(&self) -> bool {
        self.input || self.weight || self.output
    }
}

/// The f16 buffers of a key: shape flags present only when set, so that an all-f32 GEMM keeps
/// its key (and WGSL).
fn half_buffers_of(k: &KernelBuilder) -> HalfBuffers {
    let flag = |name: &str| k.key().get(name) == Some(hesper_dsl::ShapeValue::Bool(true));
    HalfBuffers {
        input: flag("input_f16"),
        weight: flag("weight_f16"),
        output: flag("output_f16"),
    }
}

fn gemm_key(
    product: Product,
    ternary: bool,
    (cols, depth): (u32, u32),
    tile: Tile,
    accumulate: bool,
) -> KernelKey {
    gemm_key_with(
        product,
        ternary,
        (cols, depth),
        tile,
        accumulate,
        HalfBuffers::NONE,
    )
}

fn gemm_key_with(
    product: Product,
    ternary: bool,
    (cols, depth): (u32, u32),
    tile: Tile,
    accumulate: bool,
    half: HalfBuffers,
) -> KernelKey {
    let mut key = KernelKey::new(kernel_name(product, ternary));
    for (name, set) in [
        ("input_f16", half.input),
        ("weight_f16", half.weight),
        ("output_f16", half.output),
    ] {
        if set {
            key = key.shape(name, true);
        }
    }
    key.workgroup_size(tile.invocations())
        .shape("cols", cols)
        .shape("depth", depth)
        .shape("bm", tile.bm)
        .shape("bn", tile.bn)
        .shape("bk", tile.bk)
        .shape("tm", tile.tm)
        .shape("tn", tile.tn)
        .shape("accumulate", accumulate)
        // Tile indices are in range by construction (`gemm_kernel`), and rows and columns past
        // the edges are clamped or guarded: no runtime bounds checks (+4% on the H200).
        .assume_in_bounds()
}

/// A scalar source of `A` or `W` elements by flat index.
#[derive(Clone)]
enum Elements {
    F32(ReadBuffer<f32>),
    F16(ReadBuffer<F16>),
    /// 2-bit codes, 16 per word, element `i` at bits `2·(i % 16)` of word `i / 16`.
    Ternary(ReadBuffer<u32>),
}

impl Elements {
    fn at(&self, k: &mut KernelBuilder, index: Expr<u32>) -> Expr<f32> {
        match self {
            Elements::F32(buf) => buf.at(index),
            Elements::F16(buf) => buf.at(index).cast::<f32>(),
            Elements::Ternary(words) => {
                let at = k.let_("at", index);
                let code = k.let_(
                    "code",
                    (words.at(&at >> 4u32) >> ((&at & 15u32) * 2u32)) & 3u32,
                );
                // 0b01 → +1, 0b10 → −1, 0b00 → 0 (see `pack_ternary`).
                k.let_(
                    "weight",
                    (&code & 1u32).cast::<f32>() - (&code >> 1u32).cast::<f32>(),
                )
            }
        }
    }
}

/// Reads one staged vec4 at a depth already clamped into range.
type Reader = Box<dyn Fn(&mut KernelBuilder, Expr<u32>) -> Expr<Vec4<f32>>>;

/// One vec4 of a step's slice that this invocation loads: at depth row `kk` of the slice, vec4
/// `at` along it, read by `read`, held in `next` between the read and the store.
struct Slot {
    kk: Expr<u32>,
    at: Expr<u32>,
    read: Reader,
    next: Var<Vec4<f32>>,
}

/// `e + c`, without a `+ 0u`.
pub(crate) fn offset(e: &Expr<u32>, c: u32) -> Expr<u32> {
    if c == 0 { e.clone() } else { e + c }
}

/// `let hint = e + c;`, or `e` itself when `c` is 0.
fn let_offset(k: &mut KernelBuilder, hint: &str, e: &Expr<u32>, c: u32) -> Expr<u32> {
    if c == 0 {
        e.clone()
    } else {
        k.let_(hint, e + c)
    }
}

/// `vec4(l0, l1, l2, l3)` from four lanes.
pub(crate) fn vec4_of<S: hesper_dsl::ty::ScalarType>(lanes: Vec<Expr<S>>) -> Expr<Vec4<S>> {
    let [a, b, c, d]: [Expr<S>; 4] = match lanes.try_into() {
        Ok(lanes) => lanes,
        Err(lanes) => unreachable!("a vec4 of {} lanes", lanes.len()),
    };
    vec4(a, b, c, d)
}

/// Component `q` of `v`.
pub(crate) fn lane<S: hesper_dsl::ty::ScalarType>(v: &Expr<Vec4<S>>, q: u32) -> Expr<S>
where
    Vec4<S>: hesper_dsl::expr::VectorType<Elem = S>,
{
    match q {
        0 => v.x(),
        1 => v.y(),
        2 => v.z(),
        _ => v.w(),
    }
}

/// Slots of a slice whose rows run along the depth (`A`, and `W` read through `·Wᵀ`): slot `s`
/// holds rows `4j .. 4j+4` at depth `s % bk` (consecutive invocations read consecutive depths of
/// a row). Rows past `last` read row `last` (`None` when the slice never passes the end).
fn row_slots(
    k: &mut KernelBuilder,
    operand: &str,
    (rows, origin, last): (u32, &Expr<u32>, Option<Expr<u32>>),
    (elements, prologue): (&Elements, Option<&Rc<fusion::ElementFn>>),
    (bk, depth): (u32, u32),
) -> Vec<Slot> {
    let threads = k.invocations();
    let lid = k.local_index();
    (0..bk * rows / 4 / threads)
        .map(|i| {
            let s = offset(&lid, i * threads);
            let kk = k.let_(&format!("{operand}_kk"), &s % bk);
            let j = k.let_(&format!("{operand}_j"), &s / bk);
            let (bases, rows): (Vec<Expr<u32>>, Vec<Expr<u32>>) = (0..4)
                .map(|q| {
                    let row = offset(&(origin + &j * 4u32), q);
                    let mut row = match &last {
                        Some(last) => row.min(last),
                        None => row,
                    };
                    if prologue.is_some() {
                        // The prologue sees the row.
                        row = k.let_(&format!("{operand}_row"), row);
                    }
                    (k.let_(&format!("{operand}_base"), &row * depth), row)
                })
                .unzip();
            let elements = elements.clone();
            let prologue = prologue.cloned();
            let read: Reader = Box::new(move |k, d| {
                let v: Vec<Expr<f32>> = (0..4)
                    .map(|q| {
                        let v = elements.at(k, &bases[q] + &d);
                        match &prologue {
                            Some(f) => {
                                let fused = f(k, &rows[q], &d, v);
                                k.let_("fused", fused)
                            }
                            None => v,
                        }
                    })
                    .collect();
                vec4_of(v)
            });
            let next = k.var(&format!("{operand}_next"), Expr::<Vec4<f32>>::splat(0.0f32));
            Slot {
                kk,
                at: j,
                read,
                next,
            }
        })
        .collect()
}

/// How the kernel reads `W`: by rows along the depth (through `·Wᵀ`) or along the output's
/// columns (through `·W`).
enum WeightReads {
    Rows(Elements),
    Columns(ColumnSource),
}

/// Where `W` read through `·W` comes from.
enum ColumnSource {
    /// Dense with `cols` a multiple of 4: one vec4 per read.
    Vec4(ReadBuffer<Vec4<f32>>),
    Vec4F16(ReadBuffer<Vec4<F16>>),
    Scalar(Elements),
}

/// Slots of the `B` slice when `W` is read through `·W`: slot `s` holds columns `4j .. 4j+4` at
/// depth `s / (bn/4)` (consecutive invocations read consecutive columns).
fn column_slots(
    k: &mut KernelBuilder,
    n0: &Expr<u32>,
    source: &ColumnSource,
    (bn, bk): (u32, u32),
    cols: u32,
) -> Vec<Slot> {
    let threads = k.invocations();
    let lid = k.local_index();
    let per_row = bn / 4;
    let guard = !cols.is_multiple_of(bn);
    (0..bk * per_row / threads)
        .map(|i| {
            let s = offset(&lid, i * threads);
            let j = k.let_("b_j", &s % per_row);
            let kk = k.let_("b_kk", &s / per_row);
            let col = n0 + &j * 4u32;
            let read: Reader = match source {
                ColumnSource::Vec4(w) => {
                    let col = if guard { col.min(cols - 4) } else { col };
                    let col4 = k.let_("b_col4", col / 4u32);
                    let w = w.clone();
                    Box::new(move |_, d| w.at(d * (cols / 4) + &col4))
                }
                ColumnSource::Vec4F16(w) => {
                    let col = if guard { col.min(cols - 4) } else { col };
                    let col4 = k.let_("b_col4", col / 4u32);
                    let w = w.clone();
                    Box::new(move |_, d| w.at(d * (cols / 4) + &col4).cast::<Vec4<f32>>())
                }
                ColumnSource::Scalar(elements) => {
                    let at: Vec<Expr<u32>> = (0..4)
                        .map(|q| {
                            let c = offset(&col, q);
                            k.let_("b_col", if guard { c.min(cols - 1) } else { c })
                        })
                        .collect();
                    let elements = elements.clone();
                    Box::new(move |k, d| {
                        let row = k.let_("w_row", d * cols);
                        let v: Vec<Expr<f32>> =
                            at.iter().map(|c| elements.at(k, &row + c)).collect();
                        vec4_of(v)
                    })
                }
            };
            let next = k.var("b_next", Expr::<Vec4<f32>>::splat(0.0f32));
            Slot {
                kk,
                at: j,
                read,
                next,
            }
        })
        .collect()
}

/// Read each slot's vec4 for the step starting at depth `first` (zero past the depth).
fn fetch(
    k: &mut KernelBuilder,
    operand: &str,
    slots: &[Slot],
    first: Option<&Expr<u32>>,
    (bk, depth): (u32, u32),
) {
    let partial = !depth.is_multiple_of(bk);
    for slot in slots {
        let d = match first {
            Some(first) => k.let_(&format!("{operand}_d"), first + &slot.kk),
            None => slot.kk.clone(),
        };
        if partial {
            let clamped = k.let_(&format!("{operand}_d_clamped"), d.min(depth - 1));
            let value = (slot.read)(k, clamped);
            let zero = Expr::<Vec4<f32>>::splat(0.0f32);
            k.assign(&slot.next, select(d.lt(depth), value, zero));
        } else {
            let value = (slot.read)(k, d);
            k.assign(&slot.next, value);
        }
    }
}

/// Store each slot's vec4 into the staging buffer starting at `buffer` (`None`: the first),
/// `stride` vec4s a depth row.
fn stage(
    k: &mut KernelBuilder,
    slots: &[Slot],
    tile: &WorkgroupArray<Vec4<f32>>,
    buffer: Option<&Expr<u32>>,
    stride: u32,
) {
    for slot in slots {
        let at = &slot.kk * stride + &slot.at;
        let at = match buffer {
            Some(buffer) => buffer + at,
            None => at,
        };
        k.store(tile, at, slot.next.get());
    }
}

/// The output: rows as vec4s when `cols` allows; f32 or f16.
enum Output {
    Vec4(RwBuffer<Vec4<f32>>),
    Scalar(RwBuffer<f32>),
    Vec4F16(RwBuffer<Vec4<F16>>),
    ScalarF16(RwBuffer<F16>),
}

/// `out[rows, cols] (+)= s·A[rows, depth]·B[depth, cols]`, `B` read out of `W` as `product` says,
/// with `fusion`'s code on `A`'s elements and the output's.
fn gemm_kernel(k: &mut KernelBuilder, product: Product, ternary: bool, fusion: &Fusion<'_>) {
    let cols = k.shape::<u32>("cols");
    let depth = k.shape::<u32>("depth");
    let tile = Tile {
        bm: k.shape("bm"),
        bn: k.shape("bn"),
        bk: k.shape("bk"),
        tm: k.shape("tm"),
        tn: k.shape("tn"),
    };
    let accumulate = k.shape::<bool>("accumulate");
    let half = half_buffers_of(k);
    let (input_name, output_name) = product.names();

    let dense = |k: &mut KernelBuilder, name: &str, f16: bool| match f16 {
        true => Elements::F16(k.storage(name)),
        false => Elements::F32(k.storage(name)),
    };
    let a = dense(k, input_name, half.input);
    let w = match (product, ternary) {
        (Product::Nt, false) => WeightReads::Rows(dense(k, "w", half.weight)),
        (Product::Nt, true) => WeightReads::Rows(Elements::Ternary(k.storage("w"))),
        (Product::Nn, false) if vec4_columns(cols) && half.weight => {
            WeightReads::Columns(ColumnSource::Vec4F16(k.storage("w")))
        }
        (Product::Nn, false) if vec4_columns(cols) => {
            WeightReads::Columns(ColumnSource::Vec4(k.storage("w")))
        }
        (Product::Nn, false) => {
            WeightReads::Columns(ColumnSource::Scalar(dense(k, "w", half.weight)))
        }
        (Product::Nn, true) => {
            WeightReads::Columns(ColumnSource::Scalar(Elements::Ternary(k.storage("w"))))
        }
    };
    let out = match (vec4_columns(cols), half.output) {
        (true, false) => Output::Vec4(k.storage_rw(output_name)),
        (false, false) => Output::Scalar(k.storage_rw(output_name)),
        (true, true) => Output::Vec4F16(k.storage_rw(output_name)),
        (false, true) => Output::ScalarF16(k.storage_rw(output_name)),
    };
    let rows = k.param::<u32>("rows");
    // Every product takes a scale (1 for plain dense weights): one multiply in the epilogue.
    let scale = k.param::<f32>("scale");
    let fused = fusion.build(k, (cols, depth), None);
    let prologue = fused.prologue.map(Rc::new);

    // Invocation (tx, ty) owns rows `ty·4 + g·4·down + (0..4)` and columns
    // `tx·4 + h·4·across + (0..4)` of the tile.
    let (across, down) = (tile.bn / tile.tn, tile.bm / tile.tm);
    let (row_blocks, col_blocks) = (tile.tm / 4, tile.tn / 4);
    let lid = k.let_("lid", k.local_index());
    let tx = k.let_("tx", &lid % across);
    let ty = k.let_("ty", &lid / across);
    let m0 = k.let_("m0", k.workgroup_id().y() * tile.bm);
    let n0 = k.let_("n0", k.workgroup_id().x() * tile.bn);

    // Two buffers per operand, depth-major. Slices staged by rows get one vec4 of padding per
    // depth row: their stores (consecutive invocations at consecutive depths) then fall in
    // distinct banks.
    let a_stride = tile.bm / 4 + 1;
    let b_stride = tile.bn / 4 + u32::from(matches!(w, WeightReads::Rows(_)));
    let (a_size, b_size) = (tile.bk * a_stride, tile.bk * b_stride);
    let a_tile = k.workgroup_array::<Vec4<f32>>("a_tile", 2 * a_size);
    let b_tile = k.workgroup_array::<Vec4<f32>>("b_tile", 2 * b_size);

    let steps = (tile.bk, depth);
    let last_row = k.let_("last_row", &rows - 1u32);
    let a_slots = row_slots(
        k,
        "a",
        (tile.bm, &m0, Some(last_row)),
        (&a, prologue.as_ref()),
        steps,
    );
    let b_slots = match &w {
        WeightReads::Rows(w) => {
            let last = (!cols.is_multiple_of(tile.bn)).then(|| lit(cols - 1));
            row_slots(k, "b", (tile.bn, &n0, last), (w, None), steps)
        }
        WeightReads::Columns(source) => column_slots(k, &n0, source, (tile.bn, tile.bk), cols),
    };

    let acc: LocalArray<Vec4<f32>> = k.var_array("acc", row_blocks * col_blocks * 4);
    k.comment("Stage the first step.");
    fetch(k, "a", &a_slots, None, steps);
    fetch(k, "b", &b_slots, None, steps);
    stage(k, &a_slots, &a_tile, None, a_stride);
    stage(k, &b_slots, &b_tile, None, b_stride);
    k.workgroup_barrier();
    k.for_range("step", 0u32, depth.div_ceil(tile.bk), |k, step| {
        let cur = k.let_("cur", &step & 1u32);
        let more = k.let_("more", (&step + 1u32).lt(depth.div_ceil(tile.bk)));
        k.comment("Read the next step's slices into registers while this one computes.");
        k.if_(&more, |k| {
            let first = k.let_("first", (&step + 1u32) * tile.bk);
            fetch(k, "a", &a_slots, Some(&first), steps);
            fetch(k, "b", &b_slots, Some(&first), steps);
        });
        // Unrolled here, not a WGSL loop: naga's loop bounding (a counter it adds to every
        // loop) kept the driver from unrolling it, which cost the 64×64×16 tile a quarter of
        // its speed on the H200 (BENCHMARKS.md, third session).
        for kk in 0..tile.bk {
            let a_at = k.let_("a_at", &cur * a_size + kk * a_stride + &ty);
            let b_at = k.let_("b_at", &cur * b_size + kk * b_stride + &tx);
            let av: Vec<Expr<Vec4<f32>>> = (0..row_blocks)
                .map(|g| k.let_("a", a_tile.at(offset(&a_at, g * down))))
                .collect();
            let bv: Vec<Expr<Vec4<f32>>> = (0..col_blocks)
                .map(|h| k.let_("b", b_tile.at(offset(&b_at, h * across))))
                .collect();
            for g in 0..row_blocks {
                for q in 0..4 {
                    let a = Expr::<Vec4<f32>>::splat(lane(&av[g as usize], q));
                    for (h, b) in bv.iter().enumerate() {
                        let i = (g * 4 + q) * col_blocks + h as u32;
                        k.store(&acc, i, a.fma(b, acc.at(i)));
                    }
                }
            }
        }
        k.if_(&more, |k| {
            let next = 1u32 - &cur;
            stage(k, &a_slots, &a_tile, Some(&(&next * a_size)), a_stride);
            stage(k, &b_slots, &b_tile, Some(&(next * b_size)), b_stride);
        });
        k.workgroup_barrier();
    });

    k.comment("Write the register tile.");
    let row0 = k.let_("row0", &m0 + &ty * 4u32);
    let col0 = k.let_("col0", &n0 + &tx * 4u32);
    let col_at: Vec<Expr<u32>> = (0..col_blocks)
        .map(|h| let_offset(k, "col", &col0, h * 4 * across))
        .collect();
    let guard_cols = !cols.is_multiple_of(tile.bn);
    for g in 0..row_blocks {
        for q in 0..4 {
            let row = let_offset(k, "row", &row0, g * 4 * down + q);
            k.if_(row.lt(&rows), |k| {
                for (h, col) in col_at.iter().enumerate() {
                    let i = (g * 4 + q) * col_blocks + h as u32;
                    let mut value = acc.at(i) * &scale;
                    if let Some(f) = &fused.epilogue {
                        // Columns past the edge (never stored) are clamped into it.
                        let at = |_: &mut KernelBuilder, q: u32| match guard_cols {
                            true => offset(col, q).min(cols - 1),
                            false => offset(col, q),
                        };
                        value = fusion::per_lane(k, f, &row, &at, value);
                    }
                    write_out(k, &out, (&row, col), value, (cols, guard_cols), accumulate);
                }
            });
        }
    }
}

/// `out[row, col .. col+4] (+)= value`, skipping columns past `cols`.
fn write_out(
    k: &mut KernelBuilder,
    out: &Output,
    (row, col): (&Expr<u32>, &Expr<u32>),
    value: Expr<Vec4<f32>>,
    (cols, guard): (u32, bool),
    accumulate: bool,
) {
    match out {
        Output::Vec4(out) => {
            let put = |k: &mut KernelBuilder| {
                let at = row * (cols / 4) + col / 4u32;
                if accumulate {
                    k.store_op(out, at, BinaryOp::Add, value.clone());
                } else {
                    k.store(out, at, value.clone());
                }
            };
            if guard {
                k.if_(col.lt(cols), put);
            } else {
                put(k);
            }
        }
        Output::Vec4F16(out) => {
            let put = |k: &mut KernelBuilder| {
                let at = k.let_("at", row * (cols / 4) + col / 4u32);
                let sum = match accumulate {
                    true => out.at(&at).cast::<Vec4<f32>>() + value.clone(),
                    false => value.clone(),
                };
                k.store(out, &at, sum.cast::<Vec4<F16>>());
            };
            if guard {
                k.if_(col.lt(cols), put);
            } else {
                put(k);
            }
        }
        Output::Scalar(out) => {
            let value = k.let_("value", value);
            let at = k.let_("at", row * cols + col);
            k.for_range("c", 0u32, 4u32, |k, c| {
                k.if_((col + &c).lt(cols), |k| {
                    if accumulate {
                        k.store_op(out, &at + &c, BinaryOp::Add, value.component(&c));
                    } else {
                        k.store(out, &at + &c, value.component(&c));
                    }
                });
            });
        }
        Output::ScalarF16(out) => {
            let value = k.let_("value", value);
            let at = k.let_("at", row * cols + col);
            k.for_range("c", 0u32, 4u32, |k, c| {
                k.if_((col + &c).lt(cols), |k| {
                    let sum = match accumulate {
                        true => out.at(&at + &c).cast::<f32>() + value.component(&c),
                        false => value.component(&c),
                    };
                    k.store(out, &at + &c, sum.cast::<F16>());
                });
            });
        }
    }
}

/// The WGSL of this module's kernels at small shapes and a small tile (16×16 outputs, 4 deep,
/// 4×4 per invocation: the structure of [`Tile::SMALL`] in fewer lines), for snapshots and
/// review. The first product has a ragged last column tile and depth step.
pub fn kernels() -> Result<Vec<Kernel>, hesper_dsl::DslError> {
    let tile = Tile {
        bm: 16,
        bn: 16,
        bk: 4,
        tm: 4,
        tn: 4,
    };
    let build = |product, ternary, shape, accumulate| {
        Kernel::build(&gemm_key(product, ternary, shape, tile, accumulate), |k| {
            gemm_kernel(k, product, ternary, &Fusion::NONE)
        })
    };
    // f16 weight and output, read and written as f32 (the fallback of `Precision::F16`).
    let half = HalfBuffers {
        input: false,
        weight: true,
        output: true,
    };
    let half_key = gemm_key_with(Product::Nn, false, (32, 64), tile, false, half);
    Ok(vec![
        build(Product::Nt, false, (60, 36), false)?,
        build(Product::Nn, false, (32, 64), true)?,
        build(Product::Nt, true, (64, 32), false)?,
        build(Product::Nn, true, (32, 64), true)?,
        Kernel::build(&half_key, |k| {
            gemm_kernel(k, Product::Nn, false, &Fusion::NONE)
        })?,
    ]
    .into_iter()
    .chain(coop::kernels()?)
    .chain(gemv::kernels()?)
    .chain(split::kernels()?)
    .collect())
}

/// The GEMM kernels at any shape and tile, within `limits`, for [`crate::catalog`].
pub(crate) mod build {
    use super::*;
    use crate::catalog::Failure;

    /// `matmul_nt`, `matmul_nn`, `bitlinear_forward` or `bitlinear_transpose` (`ternary`), the
    /// tile checked first.
    pub(crate) fn gemm(
        (product, ternary): (Product, bool),
        (cols, depth): (u32, u32),
        tile: Tile,
        (accumulate, half): (bool, HalfBuffers),
        limits: &Limits,
    ) -> Result<Kernel, Failure> {
        tile.check(kernel_name(product, ternary))?;
        let key = gemm_key_with(product, ternary, (cols, depth), tile, accumulate, half);
        Ok(Kernel::build_with_limits(&key, limits, |k| {
            gemm_kernel(k, product, ternary, &Fusion::NONE)
        })?)
    }
}

/// The kernel [`execute_gemm`] runs for `gemm` with these weights and f16 buffers (`half`: the
/// input's and output's, and the weight's, which `Weights::Half` is) on `gpu`: the tensor cores
/// for [`Precision::F16`] where the device offers them and the weights are dense, at the tile
/// asked for or chosen ([`coop::choose_tile`]); [`gemv`] for an all-f32 `·Wᵀ` over few rows;
/// else the f32 tiled GEMM.
pub fn gemm_path(gpu: &Gpu, gemm: &Gemm, weights: &Weights<'_>, half: HalfBuffers) -> GemmPath {
    let half = HalfBuffers {
        weight: matches!(weights, Weights::Half { .. }),
        ..half
    };
    let (cols, depth) = gemm.cols_depth();
    if gemm.m == 0 || cols == 0 || depth == 0 {
        return GemmPath::Empty;
    }
    let dense = !matches!(weights, Weights::Ternary { .. });
    if gemm.precision == Precision::F16
        && dense
        && let Some(path) = coop::path(gpu, gemm, half)
    {
        return path;
    }
    if let (Product::Nt, Weights::Dense(_)) = (gemm.product, weights)
        && gemm.m <= gemv::MAX_ROWS
        && !half.any()
    {
        return GemmPath::Gemv;
    }
    GemmPath::Tiled(gemm.tile.within(&gpu.kernel_limits()))
}

/// Record one GEMM: `output (+)= input·Wᵀ` or `input·W` (times the weights' scale, if any),
/// with the buffers' lengths and the tile checked first (an error names the kernel and buffer).
/// f32 or f16 input, weights and output ([`Operand`], [`Weights::Half`], [`OutputBuffer`]); at
/// [`Precision::F16`] on the tensor cores where [`gemm_path`] says so.
pub fn execute_gemm<'a>(
    rec: &mut Recorder<'_>,
    gemm: &Gemm,
    input: impl Into<Operand<'a>>,
    weights: Weights<'a>,
    output: impl Into<OutputBuffer<'a>>,
) -> Result<(), ExecError> {
    execute_gemm_fused(rec, gemm, &Fusion::NONE, input, weights, output)
}

/// [`execute_gemm`] with `fusion`'s code ([`fusion`]): its prologue on each element of the
/// input before the product, its epilogues on each element of `scale·input·B(W)` before it is
/// stored (or added, with `gemm.accumulate`), in one launch. Its buffers are checked with the
/// GEMM's; a fused GEMM needs a depth of at least 1 (an empty sum would skip the epilogues).
/// On the f32 tiled GEMM and the tensor cores alike (never [`gemv`]).
pub fn execute_gemm_fused<'a>(
    rec: &mut Recorder<'_>,
    gemm: &Gemm,
    fusion: &Fusion<'a>,
    input: impl Into<Operand<'a>>,
    weights: Weights<'a>,
    output: impl Into<OutputBuffer<'a>>,
) -> Result<(), ExecError> {
    let (input, output) = (input.into(), output.into());
    record_gemm(rec, gemm, fusion, (input, weights, output), None)
}

/// [`execute_gemm_fused`] with its input block-major along the depth: `[x_0 | x_1 | …]` held
/// as the row-major `[m, widths[b]]` matrices one after another (views of one allocation, say),
/// `Σ widths` the depth. `dn = [dq | dk | dv]·[W_q; W_k; W_v]` is then one GEMM over a depth of
/// `q + k + v` where three GEMMs would each stage a narrower one.
///
/// On the tensor cores only, at a tile whose step divides every width
/// ([`gemm_blocks_fit`] says beforehand); elsewhere an error that says so, and one GEMM per
/// block (accumulating) is the portable way. At most [`coop::MAX_INPUT_BLOCKS`] blocks, and no
/// prologue (epilogues as [`execute_gemm_fused`] takes them).
pub fn execute_gemm_blocks<'a>(
    rec: &mut Recorder<'_>,
    gemm: &Gemm,
    widths: &[usize],
    fusion: &Fusion<'a>,
    input: impl Into<Operand<'a>>,
    weights: Weights<'a>,
    output: impl Into<OutputBuffer<'a>>,
) -> Result<(), ExecError> {
    let operands = (input.into(), weights, output.into());
    record_blocked(rec, gemm, (Blocked::Input, widths), fusion, operands)
}

/// [`execute_gemm_fused`] with its output block-major along the columns: `[y_0 | y_1 | …]`
/// held as the row-major `[m, widths[b]]` matrices one after another (views of one allocation,
/// say), `Σ widths` the output's columns. `[q | k | v] = x·[W_q; W_k; W_v]ᵀ` is then one GEMM
/// over `q + k + v` columns where three GEMMs would each have fewer workgroups and the same
/// input to stage.
///
/// On the tensor cores only, at a tile whose columns divide every width
/// ([`gemm_output_blocks_path`] says beforehand); elsewhere an error that says so, and one GEMM
/// per block is the portable way. At most [`coop::MAX_INPUT_BLOCKS`] blocks. Epilogues see
/// element `(row, col)` of the `[m, Σ widths]` product (its block and place in it follow from
/// `col`); none may add a matrix ([`GemmFusion::added_matrix`], laid out row-major).
///
/// ```no_run
/// # use hesper_kernels::linear::{execute_gemm_output_blocks, Fusion, Gemm, Precision, Product, Weights};
/// # fn demo(gpu: &hesper_exec::Gpu) -> Result<(), Box<dyn std::error::Error>> {
/// let (m, q, kv, d) = (4096, 576, 192, 576);
/// let x = gpu.zeros::<f32>(m * d)?;
/// // [W_q; W_k; W_v], `[q + 2·kv, d]`, and the three outputs as views of one allocation.
/// let w = gpu.zeros::<f32>((q + 2 * kv) * d)?;
/// let mut qkv = gpu.zeros::<f32>(m * (q + 2 * kv))?;
/// let gemm = Gemm::new(Product::Nt, (m, q + 2 * kv, d), false).with_precision(Precision::F16);
/// let mut rec = gpu.recorder();
/// let widths = [q, kv, kv];
/// execute_gemm_output_blocks(&mut rec, &gemm, &widths, &Fusion::NONE, &x, Weights::Dense(&w), &mut qkv)?;
/// rec.submit()?;
/// let k = qkv.view(gpu, m * q..m * (q + kv))?; // `[m, kv]`, row-major
/// # let _ = k; Ok(()) }
/// ```
pub fn execute_gemm_output_blocks<'a>(
    rec: &mut Recorder<'_>,
    gemm: &Gemm,
    widths: &[usize],
    fusion: &Fusion<'a>,
    input: impl Into<Operand<'a>>,
    weights: Weights<'a>,
    output: impl Into<OutputBuffer<'a>>,
) -> Result<(), ExecError> {
    let operands = (input.into(), weights, output.into());
    record_blocked(rec, gemm, (Blocked::Output, widths), fusion, operands)
}

/// Which operand [`record_blocked`] takes block-major.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Blocked {
    Input,
    Output,
}

/// [`execute_gemm_blocks`] or [`execute_gemm_output_blocks`]: the blocks and the fusion checked,
/// then the tensor cores' launch.
fn record_blocked<'a>(
    rec: &mut Recorder<'_>,
    gemm: &Gemm,
    (operand, widths): (Blocked, &[usize]),
    fusion: &Fusion<'a>,
    (input, weights, output): (Operand<'a>, Weights<'a>, OutputBuffer<'a>),
) -> Result<(), ExecError> {
    let name = kernel_name(gemm.product, false);
    let (cols, depth) = gemm.cols_depth();
    let (what, along, total) = match operand {
        Blocked::Input => ("input", "depth", depth),
        Blocked::Output => ("output", "columns", cols),
    };
    let blocks = block_widths(widths, total).map_err(|why| ExecError::Dispatch {
        kernel: name.into(),
        what: format!("{what} blocks {widths:?} over {along} {total}"),
        why,
    })?;
    let refused = match operand {
        Blocked::Input => fusion
            .prologue
            .map(|_| "a block-major input takes no prologue"),
        Blocked::Output => fusion.adds_matrices().then_some(
            "a block-major output takes no epilogue that adds a matrix (it is laid out row-major)",
        ),
    };
    if let Some(why) = refused {
        return Err(ExecError::Dispatch {
            kernel: name.into(),
            what: format!("the fusion of a GEMM with {what} blocks {widths:?}"),
            why: why.into(),
        });
    }
    if gemm.m == 0 || cols == 0 {
        // No output: the buffers are checked, nothing is launched, on any device.
        return record_gemm(rec, gemm, fusion, (input, weights, output), None);
    }
    let half = HalfBuffers {
        input: matches!(input, Operand::F16(_)),
        output: matches!(output, OutputBuffer::F16(_)),
        ..HalfBuffers::NONE
    };
    let (path, divides) = match operand {
        Blocked::Input => (
            gemm_blocks_path(rec.gpu(), gemm, widths, &weights, half),
            "step divides",
        ),
        Blocked::Output => (
            gemm_output_blocks_path(rec.gpu(), gemm, widths, &weights, half),
            "columns divide",
        ),
    };
    if path.is_none() {
        return Err(ExecError::Dispatch {
            kernel: name.into(),
            what: format!("{what} blocks {widths:?}"),
            why: format!(
                "a block-major {what} runs on the tensor cores only (Precision::F16, dense \
                 weights, a device with them, a tile whose {divides} every width): run \
                 one GEMM per block here"
            ),
        });
    }
    let blocks = BlockLaunch {
        operand,
        widths: blocks,
    };
    record_gemm(rec, gemm, fusion, (input, weights, output), Some(blocks))
}

/// Whether [`execute_gemm_blocks`] runs `gemm` with its input in blocks of `widths` on `gpu`
/// (with no prologue: it takes none).
pub fn gemm_blocks_fit(
    gpu: &Gpu,
    gemm: &Gemm,
    widths: &[usize],
    weights: &Weights<'_>,
    half: HalfBuffers,
) -> bool {
    gemm_blocks_path(gpu, gemm, widths, weights, half).is_some()
}

/// The path [`execute_gemm_blocks`] takes for `gemm` with its input in blocks of `widths` on
/// `gpu`: the tensor cores at a tile whose step divides every width, or `None` where it
/// cannot run (then it returns an error).
pub fn gemm_blocks_path(
    gpu: &Gpu,
    gemm: &Gemm,
    widths: &[usize],
    weights: &Weights<'_>,
    half: HalfBuffers,
) -> Option<GemmPath> {
    let blocks = block_widths(widths, gemm.cols_depth().1).ok()?;
    let used = coop::BlockMajor::Input(coop::used_blocks(&blocks));
    blocked_path(gpu, gemm, used, weights, half)
}

/// The path [`execute_gemm_output_blocks`] takes for `gemm` with its output in blocks of
/// `widths` on `gpu`: the tensor cores at a tile whose columns divide every width, or `None`
/// where it cannot run (then it returns an error).
pub fn gemm_output_blocks_path(
    gpu: &Gpu,
    gemm: &Gemm,
    widths: &[usize],
    weights: &Weights<'_>,
    half: HalfBuffers,
) -> Option<GemmPath> {
    let blocks = block_widths(widths, gemm.cols_depth().0).ok()?;
    let used = coop::BlockMajor::Output(coop::used_blocks(&blocks));
    blocked_path(gpu, gemm, used, weights, half)
}

/// The tensor-core path for a GEMM with an operand block-major, where there is one.
fn blocked_path(
    gpu: &Gpu,
    gemm: &Gemm,
    blocks: coop::BlockMajor<'_>,
    weights: &Weights<'_>,
    half: HalfBuffers,
) -> Option<GemmPath> {
    let half = HalfBuffers {
        weight: matches!(weights, Weights::Half { .. }),
        ..half
    };
    let dense = !matches!(weights, Weights::Ternary { .. });
    if gemm.precision != Precision::F16 || !dense || gemm.m == 0 {
        return None;
    }
    let (tile, subgroup) = coop::blocks_path(gpu, gemm, half, blocks)?;
    Some(GemmPath::TensorCores { tile, subgroup })
}

/// `widths` as [`coop::Launch::input_blocks`] or [`coop::Launch::output_blocks`]: 1 to
/// [`coop::MAX_INPUT_BLOCKS`] of them, none zero, adding up to `total`.
fn block_widths(widths: &[usize], total: usize) -> Result<[u32; coop::MAX_INPUT_BLOCKS], String> {
    let mut blocks = [0; coop::MAX_INPUT_BLOCKS];
    if widths.is_empty() || widths.len() > blocks.len() {
        return Err(format!("1 to {} blocks", blocks.len()));
    }
    if widths.contains(&0) || widths.iter().sum::<usize>() != total {
        return Err(format!("widths of at least 1 that add up to {total}"));
    }
    for (b, &w) in blocks.iter_mut().zip(widths) {
        *b = u32::try_from(w).map_err(|_| format!("widths within u32, not {w}"))?;
    }
    Ok(blocks)
}

/// A block-major operand of a launch, as [`record_gemm`] takes it: which, and its widths
/// (zeros after the last).
#[derive(Clone, Copy)]
struct BlockLaunch {
    operand: Blocked,
    widths: [u32; coop::MAX_INPUT_BLOCKS],
}

impl BlockLaunch {
    fn major(&self) -> coop::BlockMajor<'_> {
        let used = coop::used_blocks(&self.widths);
        match self.operand {
            Blocked::Input => coop::BlockMajor::Input(used),
            Blocked::Output => coop::BlockMajor::Output(used),
        }
    }

    /// The widths if the operand is `operand`; else none (zeros).
    fn of(blocks: Option<BlockLaunch>, operand: Blocked) -> [u32; coop::MAX_INPUT_BLOCKS] {
        match blocks {
            Some(b) if b.operand == operand => b.widths,
            _ => [0; coop::MAX_INPUT_BLOCKS],
        }
    }
}

/// One GEMM as [`execute_gemm_fused`] records it; with `blocks`, an operand block-major
/// ([`record_blocked`], which has checked that the tensor cores take it).
fn record_gemm<'a>(
    rec: &mut Recorder<'_>,
    gemm: &Gemm,
    fusion: &Fusion<'a>,
    (input, weights, output): (Operand<'a>, Weights<'a>, OutputBuffer<'a>),
    blocks: Option<BlockLaunch>,
) -> Result<(), ExecError> {
    let ternary = matches!(weights, Weights::Ternary { .. });
    let product = gemm.product;
    let name = kernel_name(product, ternary);
    let (input_name, output_name) = gemm.product.names();
    let (cols, depth) = gemm.cols_depth();
    let m = expect_u32(name, "m", gemm.m)?;
    let tile = gemm.tile.within(&rec.gpu().kernel_limits());
    let (scale, half) = check_gemm(rec.gpu(), gemm, fusion, (&input, &weights, &output))?;
    // A fused GEMM that adds matrices reads its output's tiles as an accumulating one does:
    // its tile is chosen as for one.
    let chooses_as = Gemm {
        accumulate: gemm.accumulate || fusion.adds_matrices(),
        ..*gemm
    };
    let path = match (gemm_path(rec.gpu(), &chooses_as, &weights, half), blocks) {
        (_, Some(blocks)) => {
            let (tile, subgroup) = coop::blocks_path(rec.gpu(), &chooses_as, half, blocks.major())
                .expect("record_blocked checked that the tensor cores take it");
            GemmPath::TensorCores { tile, subgroup }
        }
        // gemv has no fusion.
        (GemmPath::Gemv, None) if !fusion.is_empty() => GemmPath::Tiled(tile),
        (path, None) => path,
    };
    match path {
        GemmPath::Empty if depth == 0 && gemm.m > 0 && cols > 0 && !gemm.accumulate => {
            // An empty sum: zero.
            match output {
                OutputBuffer::F32(out) => rec.fill(out, 0.0),
                OutputBuffer::F16(out) => rec.fill(out, f16::ZERO),
            }
        }
        GemmPath::Empty => Ok(()),
        GemmPath::Gemv => {
            let (Operand::F32(x), Weights::Dense(w), OutputBuffer::F32(y)) =
                (input, weights, output)
            else {
                unreachable!("gemm_path chooses gemv for f32 dense buffers only");
            };
            // n·k and m·n are checked above to fit u32; m·k is the length of `x`.
            let dims = (m, gemm.n as u32, gemm.k as u32);
            gemv::record(rec, dims, (x, w, y), gemm.accumulate)
        }
        GemmPath::TensorCores { tile, subgroup } => {
            let w = match weights {
                Weights::Dense(w) | Weights::ScaledDense { w, .. } => Operand::F32(w),
                Weights::Half { w, .. } => Operand::F16(w),
                Weights::Ternary { .. } => unreachable!("gemm_path keeps ternary weights tiled"),
            };
            let launch = coop::Launch {
                product,
                shape: (cols as u32, depth as u32),
                m,
                tile,
                subgroup,
                accumulate: gemm.accumulate,
                scale,
                input_exponent: gemm.input_exponent,
                splits: 1,
                input_blocks: BlockLaunch::of(blocks, Blocked::Input),
                output_blocks: BlockLaunch::of(blocks, Blocked::Output),
            };
            coop::record(rec, &launch, input, w, output, fusion)
        }
        GemmPath::Tiled(tile) => {
            // One step of `bk` of the depth an iteration.
            let iterations = depth.div_ceil(tile.bk as usize) as u64;
            crate::expect_loops(rec.gpu(), name, || format!("depth {depth}"), iterations)?;
            let shape = (cols as u32, depth as u32);
            let key = gemm_key_with(product, ternary, shape, tile, gemm.accumulate, half);
            let key = fusion.key(name, key)?;
            let kernel = rec
                .gpu()
                .kernel(&key, |k| gemm_kernel(k, product, ternary, fusion))?;
            let vec4_cols = vec4_columns(shape.0);
            let args = match input {
                Operand::F32(b) => Args::new().buffer(input_name, b),
                Operand::F16(b) => Args::new().buffer(input_name, b),
            };
            let args = match weights {
                Weights::Dense(w) | Weights::ScaledDense { w, .. }
                    if product == Product::Nn && vec4_cols =>
                {
                    args.buffer_vec4("w", w)
                }
                Weights::Half { w, .. } if product == Product::Nn && vec4_cols => {
                    args.buffer_vec4("w", w)
                }
                Weights::Dense(w) | Weights::ScaledDense { w, .. } => args.buffer("w", w),
                Weights::Half { w, .. } => args.buffer("w", w),
                Weights::Ternary { packed, .. } => args.buffer("w", packed),
            };
            let args = match (&output, vec4_cols) {
                (OutputBuffer::F32(out), true) => args.buffer_vec4(output_name, &**out),
                (OutputBuffer::F32(out), false) => args.buffer(output_name, &**out),
                (OutputBuffer::F16(out), true) => args.buffer_vec4(output_name, &**out),
                (OutputBuffer::F16(out), false) => args.buffer(output_name, &**out),
            };
            let args = fusion.bind(args.param("rows", m).param("scale", scale));
            let Tile { bm, bn, .. } = tile;
            let groups = [shape.0.div_ceil(bn), m.div_ceil(bm), 1];
            rec.launch(&kernel, &args, Grid::Workgroups(groups))
        }
    }
}

/// What [`execute_gemm_fused`] checks before it records anything (an error names the kernel
/// and buffer): the shape within u32 indices, the tile, the input's exponent, each buffer's
/// length, the fusion's buffers, f16 on the device where a buffer holds it. The weights' scale
/// and which buffers hold f16.
fn check_gemm(
    gpu: &Gpu,
    gemm: &Gemm,
    fusion: &Fusion<'_>,
    (input, weights, output): (&Operand<'_>, &Weights<'_>, &OutputBuffer<'_>),
) -> Result<(f32, HalfBuffers), ExecError> {
    let ternary = matches!(weights, Weights::Ternary { .. });
    let product = gemm.product;
    let name = kernel_name(product, ternary);
    let (input_name, output_name) = gemm.product.names();
    let (in_dims, out_dims) = match gemm.product {
        Product::Nt => ("[m, k]", "[m, n]"),
        Product::Nn => ("[m, n]", "[m, k]"),
    };
    let (cols, depth) = gemm.cols_depth();
    expect_u32(name, "m", gemm.m)?;
    expect_u32(name, "n", gemm.n)?;
    expect_u32(name, "k", gemm.k)?;
    // Ternary weights, and dense ones in `gemv`, are indexed by their flat position.
    expect_u32(name, "n·k", gemm.n.saturating_mul(gemm.k))?;
    expect_u32(name, "m·n", gemm.m.saturating_mul(gemm.n))?;
    expect_u32(name, "m·k", gemm.m.saturating_mul(gemm.k))?;
    let tile = gemm.tile.within(&gpu.kernel_limits());
    tile.check(name)?;
    if gemm.input_exponent.abs() > MAX_INPUT_EXPONENT {
        return Err(ExecError::Dispatch {
            kernel: name.into(),
            what: format!("input_exponent = {}", gemm.input_exponent),
            why: format!("the input's scale is 2^e with |e| ≤ {MAX_INPUT_EXPONENT}"),
        });
    }
    if !fusion.is_empty() && depth == 0 {
        return Err(ExecError::Dispatch {
            kernel: name.into(),
            what: "a fused GEMM over a depth of 0".into(),
            why: "a fused GEMM needs a depth of at least 1 (an empty sum would skip its code)"
                .into(),
        });
    }
    match input {
        Operand::F32(b) => expect_len(name, input_name, b, gemm.m * depth, in_dims)?,
        Operand::F16(b) => expect_len(name, input_name, b, gemm.m * depth, in_dims)?,
    }
    match weights {
        Weights::Dense(w) | Weights::ScaledDense { w, .. } => {
            expect_len(name, "w", w, gemm.n * gemm.k, "[n, k]")?
        }
        Weights::Half { w, .. } => expect_len(name, "w", w, gemm.n * gemm.k, "[n, k]")?,
        Weights::Ternary { packed, .. } => expect_len(
            name,
            "w",
            packed,
            (gemm.n * gemm.k).div_ceil(TERNARY_PER_WORD),
            "[n, k] ternary, 16 per u32",
        )?,
    }
    match output {
        OutputBuffer::F32(b) => expect_len(name, output_name, *b, gemm.m * cols, out_dims)?,
        OutputBuffer::F16(b) => expect_len(name, output_name, *b, gemm.m * cols, out_dims)?,
    }
    fusion.check(name, (gemm.m, cols, depth))?;
    let scale = match weights {
        Weights::Dense(_) => 1.0,
        Weights::ScaledDense { scale, .. }
        | Weights::Half { scale, .. }
        | Weights::Ternary { scale, .. } => *scale,
    };
    let half = HalfBuffers {
        input: matches!(input, Operand::F16(_)),
        weight: matches!(weights, Weights::Half { .. }),
        output: matches!(output, OutputBuffer::F16(_)),
    };
    if half.any() && !gpu.supports_f16() {
        // f16 buffers are read and written as f16.
        return Err(ExecError::MissingFeature {
            kernel: name.into(),
            feature: "SHADER_F16",
            why: match gpu
                .adapter_features()
                .contains(hesper_exec::wgpu::Features::SHADER_F16)
            {
                true => "this Gpu was opened without (GpuOptions)".into(),
                false => format!("`{}` does not have", gpu.adapter_info().name),
            },
        });
    }
    Ok((scale, half))
}

/// The kernel a fused dense GEMM runs on `path` (the f32 tiled GEMM or the tensor cores), as
/// [`execute_gemm_fused`] builds it for a device with `limits` (`Gpu::kernel_limits`): for
/// snapshots, review and the DSL's interpreter. `half` says which buffers hold f16 (the
/// tensor cores' key always names all three).
pub fn fused_kernel(
    gemm: &Gemm,
    path: GemmPath,
    half: HalfBuffers,
    fusion: &Fusion<'_>,
    limits: &hesper_dsl::Limits,
) -> Result<Kernel, ExecError> {
    let product = gemm.product;
    let (cols, depth) = gemm.cols_depth();
    let shape = (
        expect_u32(kernel_name(product, false), "cols", cols)?,
        expect_u32(kernel_name(product, false), "depth", depth)?,
    );
    let (name, key) = match path {
        GemmPath::Tiled(tile) => {
            let key = gemm_key_with(product, false, shape, tile, gemm.accumulate, half);
            (kernel_name(product, false), key)
        }
        GemmPath::TensorCores { tile, subgroup } => {
            let key = coop::key(product, shape, tile, subgroup, half, (gemm.accumulate, 1));
            (coop::kernel_name(product), key)
        }
        GemmPath::Empty | GemmPath::Gemv => {
            return Err(ExecError::Dispatch {
                kernel: kernel_name(product, false).into(),
                what: format!("{path:?}"),
                why: "a fused GEMM runs tiled or on the tensor cores".into(),
            });
        }
    };
    let key = fusion.key(name, key)?;
    let kernel = Kernel::build_with_limits(&key, limits, |k| match path {
        GemmPath::TensorCores { .. } => coop::kernel(k, product, fusion),
        _ => gemm_kernel(k, product, false, fusion),
    })?;
    Ok(kernel)
}

/// `y (+)= x·Wᵀ`: `x: [m, k]`, `w: [n, k]`, `y: [m, n]` (the forward through a frozen weight).
#[allow(clippy::too_many_arguments)]
pub fn execute_matmul_nt(
    rec: &mut Recorder<'_>,
    x: &GpuBuffer<f32>,
    w: &GpuBuffer<f32>,
    y: &mut GpuBuffer<f32>,
    m: usize,
    n: usize,
    k: usize,
    accumulate: bool,
) -> Result<(), ExecError> {
    let gemm = Gemm::new(Product::Nt, (m, n, k), accumulate);
    execute_gemm(rec, &gemm, x, Weights::Dense(w), y)
}

/// `dx (+)= dy·W`: `dy: [m, n]`, `w: [n, k]`, `dx: [m, k]` (the backward through a frozen weight;
/// accumulate when `dx` also receives other paths' gradients).
#[allow(clippy::too_many_arguments)]
pub fn execute_matmul_nn(
    rec: &mut Recorder<'_>,
    dy: &GpuBuffer<f32>,
    w: &GpuBuffer<f32>,
    dx: &mut GpuBuffer<f32>,
    m: usize,
    n: usize,
    k: usize,
    accumulate: bool,
) -> Result<(), ExecError> {
    let gemm = Gemm::new(Product::Nn, (m, n, k), accumulate);
    execute_gemm(rec, &gemm, dy, Weights::Dense(w), dx)
}

/// `y (+)= scale·x·Tᵀ`: `x: [m, k]`, `T: [n, k]` ternary packed by [`pack_ternary`], `y: [m, n]`.
#[allow(clippy::too_many_arguments)]
pub fn execute_bitlinear_forward(
    rec: &mut Recorder<'_>,
    x: &GpuBuffer<f32>,
    packed: &GpuBuffer<u32>,
    scale: f32,
    y: &mut GpuBuffer<f32>,
    m: usize,
    n: usize,
    k: usize,
    accumulate: bool,
) -> Result<(), ExecError> {
    let gemm = Gemm::new(Product::Nt, (m, n, k), accumulate);
    execute_gemm(rec, &gemm, x, Weights::Ternary { packed, scale }, y)
}

/// `dx (+)= scale·dy·T`: `dy: [m, n]`, `T: [n, k]` ternary packed by [`pack_ternary`],
/// `dx: [m, k]` (the backward of [`execute_bitlinear_forward`] to its input).
#[allow(clippy::too_many_arguments)]
pub fn execute_bitlinear_transpose(
    rec: &mut Recorder<'_>,
    dy: &GpuBuffer<f32>,
    packed: &GpuBuffer<u32>,
    scale: f32,
    dx: &mut GpuBuffer<f32>,
    m: usize,
    n: usize,
    k: usize,
    accumulate: bool,
) -> Result<(), ExecError> {
    let gemm = Gemm::new(Product::Nn, (m, n, k), accumulate);
    execute_gemm(rec, &gemm, dy, Weights::Ternary { packed, scale }, dx)
}

/// Pack ternary weights 16 per `u32`, element `i` in bits `2·(i % 16)` of word `i / 16`:
/// `0b00` = 0, `0b01` = +1, `0b10` = −1 (`0b11` is never written; the kernels read it as 0).
/// The last word's unused bits are 0. A value outside −1..=1 is an error naming its index.
pub fn pack_ternary(values: &[i8]) -> Result<Vec<u32>, ExecError> {
    let mut words = vec![0u32; values.len().div_ceil(TERNARY_PER_WORD)];
    for (i, &v) in values.iter().enumerate() {
        let code = match v {
            0 => 0b00,
            1 => 0b01,
            -1 => 0b10,
            _ => {
                return Err(ExecError::Buffer {
                    buffer: "ternary weights".into(),
                    message: format!("element {i} is {v}, not -1, 0 or +1"),
                });
            }
        };
        words[i / TERNARY_PER_WORD] |= code << (2 * (i % TERNARY_PER_WORD));
    }
    Ok(words)
}

/// The first `len` ternary weights of `packed` (the inverse of [`pack_ternary`]); an error when
/// `packed` holds fewer than `len`.
pub fn unpack_ternary(packed: &[u32], len: usize) -> Result<Vec<i8>, ExecError> {
    if len.div_ceil(TERNARY_PER_WORD) > packed.len() {
        return Err(ExecError::Buffer {
            buffer: "ternary weights".into(),
            message: format!(
                "{len} weights asked for, {} words hold at most {}",
                packed.len(),
                packed.len() * TERNARY_PER_WORD
            ),
        });
    }
    Ok((0..len)
        .map(|i| {
            let code = (packed[i / TERNARY_PER_WORD] >> (2 * (i % TERNARY_PER_WORD))) & 0b11;
            (code & 1) as i8 - (code >> 1) as i8
        })
        .collect())
}

/// f64 references: the plain sums of KERNELS.md's products.
pub mod reference {
    /// `x·Wᵀ` for `x: [m, k]`, `w: [n, k]`: `[m, n]`.
    pub fn matmul_nt(x: &[f64], w: &[f64], m: usize, n: usize, k: usize) -> Vec<f64> {
        product(x, (m, k, n), |i, o| w[o * k + i])
    }

    /// `dy·W` for `dy: [m, n]`, `w: [n, k]`: `[m, k]`.
    pub fn matmul_nn(dy: &[f64], w: &[f64], m: usize, n: usize, k: usize) -> Vec<f64> {
        product(dy, (m, n, k), |o, i| w[o * k + i])
    }

    /// `out[r, c] = Σ_d a[r, d]·B(d, c)` for `a: [rows, depth]`: the one GEMM, `B` read out of
    /// `W` as the product says (the module's doc).
    fn product(
        a: &[f64],
        (rows, depth, cols): (usize, usize, usize),
        b: impl Fn(usize, usize) -> f64,
    ) -> Vec<f64> {
        let mut out = vec![0.0; rows * cols];
        for r in 0..rows {
            for c in 0..cols {
                out[r * cols + c] = (0..depth).map(|d| a[r * depth + d] * b(d, c)).sum();
            }
        }
        out
    }

    /// The dense matrix `scale·T` of ternary weights.
    pub fn dequantize(ternary: &[i8], scale: f64) -> Vec<f64> {
        ternary.iter().map(|&t| scale * t as f64).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The standard tiles, for every product, use at most the workgroup memory
    /// `workgroup_bytes` says (what `within` chooses by), and pass their checks: `LARGE`, `MEDIUM` and `SMALL` fit 32 KiB, `PORTABLE` WebGPU's 16 KiB
    /// (the snapshots are taken at a smaller tile).
    #[test]
    fn standard_tiles_use_the_workgroup_memory_they_say() {
        assert!(Tile::LARGE.workgroup_bytes() <= 32 * 1024);
        assert!(Tile::MEDIUM.workgroup_bytes() <= 32 * 1024);
        assert!(Tile::SMALL.workgroup_bytes() <= 32 * 1024);
        assert!(Tile::PORTABLE.workgroup_bytes() <= 16 * 1024);
        for tile in [Tile::LARGE, Tile::MEDIUM, Tile::SMALL, Tile::PORTABLE] {
            for (product, ternary) in [
                (Product::Nt, false),
                (Product::Nn, false),
                (Product::Nt, true),
                (Product::Nn, true),
            ] {
                let key = gemm_key(product, ternary, (1536, 576), tile, false);
                let kernel =
                    Kernel::build(&key, |k| gemm_kernel(k, product, ternary, &Fusion::NONE))
                        .unwrap();
                let used = kernel.workgroup_memory_bytes();
                assert!(used <= tile.workgroup_bytes(), "{key}");
                assert!(tile.check(kernel.name()).is_ok(), "{key}");
            }
        }
    }
}
