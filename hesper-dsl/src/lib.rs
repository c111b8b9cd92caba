//! # hesper-dsl
//!
//! A typed builder for WGSL compute kernels, in the spirit of Hesper's `ShaderM`: expressions are
//! values ([`Expr<T>`]), statements and declarations are effects recorded by a
//! [`KernelBuilder`], and [`Kernel::build`] turns a [`KernelKey`] and a body into validated,
//! deterministic WGSL.
//!
//! ```
//! use hesper_dsl::prelude::*;
//!
//! // d_up = dh · relu(g)²  and  d_gate = dh · u · 2·relu(g)   (ReLU²×Mul backward)
//! let key = KernelKey::new("relu_sqr_mul_backward").workgroup_size(256);
//! let kernel = Kernel::build(&key, |k| {
//!     let gate = k.storage::<f32>("gate");
//!     let up = k.storage::<f32>("up");
//!     let d_h = k.storage::<f32>("d_h");
//!     let d_gate = k.storage_rw::<f32>("d_gate");
//!     let d_up = k.storage_rw::<f32>("d_up");
//!     let n = k.param::<u32>("n");
//!     let i = k.global_index();
//!     k.if_(i.lt(&n), |k| {
//!         let r = k.let_("r", gate.at(&i).max(0.0));
//!         let dh = k.let_("dh", d_h.at(&i));
//!         k.store(&d_gate, &i, &dh * up.at(&i) * 2.0 * &r);
//!         k.store(&d_up, &i, &dh * &r * &r);
//!     });
//! })
//! .unwrap();
//! assert!(kernel.wgsl().contains("d_up[index] = dh * r * r;")); // `global_index()` names it `index`
//! ```
//!
//! Misuse is an error naming the kernel, the item and the line of the builder call (or of the
//! `#[kernel]` body) at fault, never WGSL that naga rejects:
//!
//! ```
//! use hesper_dsl::prelude::*;
//! let err = Kernel::build(&KernelKey::new("twice"), |k| {
//!     k.storage::<f32>("x");
//!     k.storage_rw::<f32>("x"); // this line
//! })
//! .unwrap_err();
//! let at = err.at.unwrap();
//! assert_eq!(at.location.line(), line!() - 4);
//! assert_eq!(
//!     err.to_string(),
//!     format!("kernel `twice` at {at}: the name `x` is declared twice")
//! );
//! ```
//!
//! ## `#[kernel]`: a kernel as a Rust function
//!
//! The same kernel, written as Rust. The macro expands to the builder calls above (the WGSL is
//! byte-identical); shapes are plain Rust values in the body, so an `if` or `for` over them runs
//! when the kernel is built, while one over expressions becomes WGSL.
//!
//! ```
//! use hesper_dsl::prelude::*;
//!
//! #[kernel_fn]
//! fn relu(x: f32) -> f32 {
//!     max(x, 0.0)
//! }
//!
//! #[kernel(workgroup_size = 256)]
//! fn relu_sqr_mul_backward(
//!     gate: &[f32],
//!     up: &[f32],
//!     d_h: &[f32],
//!     d_gate: &mut [f32],
//!     d_up: &mut [f32],
//!     #[runtime] n: u32,
//!     #[shape] unroll: u32,
//! ) {
//!     let first = global_index() * unroll;
//!     for j in 0..unroll {
//!         // unrolled at build time: `unroll` is a shape
//!         let i = first + j;
//!         if i < n {
//!             // a WGSL `if`: `i` is an expression
//!             let r = relu(gate[i]);
//!             d_gate[i] = d_h[i] * up[i] * 2.0 * r;
//!             d_up[i] = d_h[i] * r * r;
//!         }
//!     }
//! }
//!
//! let kernel = relu_sqr_mul_backward::build(2).unwrap();
//! assert!(kernel.wgsl().contains("fn relu(x: f32) -> f32"));
//! assert_eq!(kernel.wgsl().matches("if i").count(), 2); // two unrolled iterations
//! ```
//!
//! One workgroup per row, with reductions: a numerically safe softmax. `workgroup_index()` is
//! the same for every invocation of a workgroup, so the `if row < rows` around the
//! reductions is uniform (the spare workgroups of a 2-D layout skip it together); launch it with
//! `Grid::WorkgroupPerItem(rows)`.
//!
//! ```
//! use hesper_dsl::prelude::*;
//!
//! #[kernel(workgroup_size = 128)]
//! fn softmax_rows(x: &[f32], y: &mut [f32], #[runtime] rows: u32, #[shape] cols: u32) {
//!     let row = workgroup_index();
//!     if row < rows {
//!         let base = row * cols;
//!         let mut biggest = f32::MIN; // the identity of max (WGSL has no -inf literal)
//!         for c in row_loop(cols) {
//!             biggest = max(biggest, x[base + c]);
//!         }
//!         let row_max = workgroup_reduce(biggest, Reduce::Max);
//!         let mut sum = 0.0;
//!         for c in row_loop(cols) {
//!             sum += exp(x[base + c] - row_max);
//!         }
//!         let total = workgroup_reduce(sum, Reduce::Sum);
//!         for c in row_loop(cols) {
//!             y[base + c] = exp(x[base + c] - row_max) / total;
//!         }
//!     }
//! }
//!
//! let wgsl = softmax_rows::build(300).unwrap().wgsl().to_string();
//! assert!(wgsl.contains("let row_max = ") && wgsl.contains("for (var c: u32 = local_index;"));
//! ```
//!
//! ## Tensor cores: cooperative matrices
//!
//! A kernel whose key asks for [`Features::COOPERATIVE_MATRIX`] can hold `16 × 16` (or `8 × 8`)
//! tiles that a whole subgroup shares ([`CoopMat`], in role [`CoopA`], [`CoopB`] or
//! [`CoopC`]), load and store them in either major from storage buffers or workgroup arrays,
//! and multiply them on the tensor cores with [`coop_multiply_add`]. The emitter enables the
//! WGSL extensions, keeps the role names `A`, `B`, `C` free and declares what naga's SPIR-V
//! needs; hesper-exec runs such a kernel only on a device that offers its tile kinds.
//!
//! ```
//! use hesper_dsl::prelude::*;
//!
//! // c[16, 16] = a[16, 16] · b[16, 16], f16 inputs accumulated in f32, by one subgroup.
//! let key = KernelKey::new("tile_product")
//!     .workgroup_size(32)
//!     .features(Features::COOPERATIVE_MATRIX);
//! let kernel = Kernel::build(&key, |k| {
//!     let a = k.storage::<F16>("a");
//!     let b = k.storage::<F16>("b");
//!     let c = k.storage_rw::<f32>("c");
//!     let left = k.coop_load::<CoopMat<F16, CoopA>, _>(&a, 0u32, 16u32, Major::Row);
//!     let right = k.coop_load::<CoopMat<F16, CoopB>, _>(&b, 0u32, 16u32, Major::Row);
//!     let product = coop_multiply_add(left, right, Expr::<CoopMat<f32, CoopC>>::zero());
//!     k.coop_store(&c, 0u32, 16u32, Major::Row, product);
//! })
//! .unwrap();
//! assert!(kernel.wgsl().contains("enable wgpu_cooperative_matrix;"));
//! ```
//!
//! Storing into a read-only buffer does not compile:
//!
//! ```compile_fail
//! use hesper_dsl::prelude::*;
//! Kernel::build(&KernelKey::new("ro"), |k| {
//!     let x = k.storage::<f32>("x");
//!     k.store(&x, 0u32, 1.0f32);
//! });
//! ```

mod builder;
mod check;
mod combinators;
mod consteval;
mod error;
pub mod expr;
mod function;
pub mod interp;
pub(crate) mod ir;
mod kernel;
#[doc(hidden)]
pub mod macro_support;
mod names;
pub mod ty;
mod uniform;
pub mod validate;
mod wgsl;

pub use builder::{
    AnyBuffer, CoopMemory, Indexable, KernelBuilder, LocalArray, LoopCounter,
    MAX_LOCAL_ARRAY_BYTES, MAX_NESTING, MAX_STATEMENTS, ParamType, ReadBuffer, RwBuffer, ShapeType,
    Var, WorkgroupArray, Writable,
};
pub use combinators::{Reduce, Reducible};
pub use error::{DslError, ErrorKind, Origin};
pub use expr::{AnyExpr, Expr, IntoExpr, bf16, coop_multiply_add, lit, select, vec2, vec3, vec4};
pub use function::{FnArgs, Function};
pub use hesper_dsl_macros::{kernel, kernel_fn};
pub use ir::{BinaryOp, Literal, MAX_EXPRESSION_DEPTH, Major, UnaryOp, VarId};
pub use kernel::{
    Binding, CoopMultiply, Features, Kernel, KernelKey, Limits, Param, ShapeValue, WorkgroupVar,
};
pub use ty::{
    Access, Array, CoopA, CoopB, CoopC, CoopMat, CoopRole, F16, Scalar, Ty, Vec2, Vec3, Vec4,
    WgslType,
};

/// Everything a kernel author needs, in one `use`.
pub mod prelude {
    pub use crate::{
        Access, Array, BinaryOp, CoopA, CoopB, CoopC, CoopMat, Expr, F16, Features, Indexable,
        IntoExpr, Kernel, KernelBuilder, KernelKey, Limits, Major, Reduce, Scalar, Ty, Vec2, Vec3,
        Vec4, Writable, bf16, coop_multiply_add, kernel, kernel_fn, lit, select, vec2, vec3, vec4,
    };
}
