//! # hesper-kernels
//!
//! The kernels of LoRA fine-tuning, written in hesper-dsl. Each kernel comes as
//! - a kernel definition (`#[kernel]` or a builder function) whose WGSL is snapshotted,
//! - an `execute_*` function that checks its buffers (an error names the kernel and the buffer)
//!   and records a launch into a [`Recorder`](hesper_exec::Recorder) — the caller submits,
//! - an f64 reference in the module's `reference` submodule, which the tests compare the GPU
//!   with on fresh random inputs, and which is itself checked against finite differences.
//!
//! [`catalog`] lists every kernel by name with its shape parameters, and builds any of them at
//! any shape.
//!
//! The math contract is `../shared/KERNELS.md`.

pub mod argmax;
pub mod attention;
pub mod catalog;
pub mod elementwise;
pub mod ffn;
pub mod linear;
pub mod lora;
pub mod loss;
pub mod norm;
pub mod optim;
pub mod rope;
pub mod testing;

use hesper_dsl::prelude::*;
use hesper_dsl::ty::{HostShareable, Numeric};
use hesper_exec::{Element, ExecError, GpuBuffer};

/// The columns an invocation of the streaming kernels owns: a `vec4` of four when the width is a
/// multiple of 4 (one wide load), else one.
pub(crate) trait Columns: Numeric<Elem = f32> + HostShareable + Sized {
    const N: u32;
    fn lanes(v: &Expr<Self>) -> Vec<Expr<f32>>;
    fn gather(lanes: Vec<Expr<f32>>) -> Expr<Self>;
    fn splat(x: Expr<f32>) -> Expr<Self>;
    /// Lane `i` (a runtime index below `N`).
    fn lane(v: &Expr<Self>, i: &Expr<u32>) -> Expr<f32>;
}

impl Columns for f32 {
    const N: u32 = 1;
    fn lanes(v: &Expr<f32>) -> Vec<Expr<f32>> {
        vec![v.clone()]
    }
    fn gather(lanes: Vec<Expr<f32>>) -> Expr<f32> {
        lanes[0].clone()
    }
    fn splat(x: Expr<f32>) -> Expr<f32> {
        x
    }
    fn lane(v: &Expr<f32>, _: &Expr<u32>) -> Expr<f32> {
        v.clone()
    }
}

impl Columns for Vec4<f32> {
    const N: u32 = 4;
    fn lanes(v: &Expr<Vec4<f32>>) -> Vec<Expr<f32>> {
        vec![v.x(), v.y(), v.z(), v.w()]
    }
    fn gather(l: Vec<Expr<f32>>) -> Expr<Vec4<f32>> {
        vec4(l[0].clone(), l[1].clone(), l[2].clone(), l[3].clone())
    }
    fn splat(x: Expr<f32>) -> Expr<Vec4<f32>> {
        Expr::<Vec4<f32>>::splat(x)
    }
    fn lane(v: &Expr<Vec4<f32>>, i: &Expr<u32>) -> Expr<f32> {
        v.component(i.clone())
    }
}

/// What a binding's length must be, as [`expect_len`] checks it.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Len {
    /// Exactly this many elements (a plain `usize` converts to this).
    Exactly(usize),
    /// At least this many: workspace, which may be larger.
    AtLeast(usize),
    /// A whole number of rows this wide, none when it is empty (a width of 0 fits nothing).
    Rows(usize),
    /// A non-empty multiple of this (a width of 0 fits nothing).
    Multiple(usize),
}

impl From<usize> for Len {
    fn from(len: usize) -> Len {
        Len::Exactly(len)
    }
}

impl Len {
    fn fits(self, given: usize) -> bool {
        match self {
            Len::Exactly(len) => given == len,
            Len::AtLeast(len) => given >= len,
            Len::Rows(width) => width > 0 && given.is_multiple_of(width),
            Len::Multiple(n) => n > 0 && given > 0 && given.is_multiple_of(n),
        }
    }

    fn expected(self, why: &str) -> String {
        match self {
            Len::Exactly(len) => format!("{len} elements ({why})"),
            Len::AtLeast(len) => format!("at least {len} elements ({why})"),
            Len::Rows(width) => format!("a whole number of rows of {width} ({why})"),
            Len::Multiple(n) => format!("a non-empty multiple of {n} elements ({why})"),
        }
    }
}

/// `Ok` when `buffer`'s length is what `len` says; else an error naming the kernel, the binding,
/// what was expected (`why` says where the number comes from) and what was given. Every length
/// check of the library's `execute_*` functions goes through here.
pub(crate) fn expect_len<T: Element>(
    kernel: &str,
    binding: &str,
    buffer: &GpuBuffer<T>,
    len: impl Into<Len>,
    why: &str,
) -> Result<(), ExecError> {
    let len = len.into();
    if len.fits(buffer.len()) {
        return Ok(());
    }
    Err(ExecError::Binding {
        kernel: kernel.into(),
        binding: binding.into(),
        expected: len.expected(why),
        given: format!("{} elements", buffer.len()),
    })
}

/// The rows of `buffer` when it is a whole number of rows `width` wide ([`Len::Rows`]).
pub(crate) fn expect_rows<T: Element>(
    kernel: &str,
    binding: &str,
    buffer: &GpuBuffer<T>,
    width: usize,
    why: &str,
) -> Result<usize, ExecError> {
    expect_len(kernel, binding, buffer, Len::Rows(width), why)?;
    Ok(buffer.len() / width)
}

/// The error of a tile's `check`: it names the kernel, the tile and the rule the tile breaks.
pub(crate) fn bad_tile(kernel: &str, tile: &impl std::fmt::Debug, why: &str) -> ExecError {
    ExecError::Dispatch {
        kernel: kernel.into(),
        what: format!("tile {tile:?}"),
        why: why.into(),
    }
}

/// `Ok` when a runtime count fits the `u32` kernels index with.
pub(crate) fn expect_u32(kernel: &str, what: &str, n: usize) -> Result<u32, ExecError> {
    u32::try_from(n).map_err(|_| ExecError::Dispatch {
        kernel: kernel.into(),
        what: format!("{what} = {n}"),
        why: "kernels index with u32".into(),
    })
}

/// Loop iterations an invocation may spend outside the strides a kernel counts: each workgroup
/// reduction loops over the workgroup's subgroups (lavapipe's are 8 invocations: 32 iterations
/// at 256 invocations, 128 at 1024) and a kernel holds up to four. Measured on lavapipe:
/// argmax (two reductions of 256) returned wrong indices from 65 470 iterations of its stride.
pub const LOOP_ALLOWANCE: u64 = 512;

/// `Ok` when one invocation's loop iterations (`iterations`, the kernel's own strides, plus
/// [`LOOP_ALLOWANCE`]), every loop counted together, fit `gpu`
/// ([`Gpu::max_loop_iterations`](hesper_exec::Gpu::max_loop_iterations)): lavapipe ends an
/// invocation's loops after 65 535 iterations and the kernel then returns wrong numbers, so a
/// size past that is refused. `what` names the size that sets the count.
pub(crate) fn expect_loops(
    gpu: &hesper_exec::Gpu,
    kernel: &str,
    what: impl FnOnce() -> String,
    iterations: u64,
) -> Result<(), ExecError> {
    let iterations = iterations.saturating_add(LOOP_ALLOWANCE);
    match gpu.max_loop_iterations() {
        Some(max) if iterations > max => Err(ExecError::Dispatch {
            kernel: kernel.into(),
            what: what(),
            why: format!(
                "an invocation would loop {iterations} times, and {} stops loops after {max} iterations",
                gpu.describe()
            ),
        }),
        _ => Ok(()),
    }
}
