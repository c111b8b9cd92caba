//! What `#[kernel]` expands to, beyond the builder itself: free functions for the WGSL builtins,
//! and traits that let one expansion mean compile-time Rust or a runtime DSL statement
//! depending on the types involved — `if n > 4` on a shape value runs when the kernel is built,
//! `if i < n` on an `Expr` records a WGSL `if` (comptime is plain Rust).
//!
//! The free functions are also handy in hand-written kernels: `max(gate.at(&i), 0.0)`.

use crate::builder::{KernelBuilder, LoopCounter};
use crate::expr::{Expr, IntoExpr};
use crate::ty::{FloatType, Numeric, ScalarType, WgslType};

// ---------------------------------------------------------------- builtin functions

/// `max(a, b)`
pub fn max<T: Numeric>(a: impl IntoExpr<T>, b: impl IntoExpr<T>) -> Expr<T> {
    a.into_expr().max(b)
}
/// `min(a, b)`
pub fn min<T: Numeric>(a: impl IntoExpr<T>, b: impl IntoExpr<T>) -> Expr<T> {
    a.into_expr().min(b)
}
/// `clamp(x, lo, hi)`
pub fn clamp<T: Numeric>(
    x: impl IntoExpr<T>,
    lo: impl IntoExpr<T>,
    hi: impl IntoExpr<T>,
) -> Expr<T> {
    x.into_expr().clamp(lo, hi)
}
/// `abs(x)`
pub fn abs<T: Numeric>(x: impl IntoExpr<T>) -> Expr<T> {
    x.into_expr().abs()
}
/// `pow(x, y)`
pub fn pow<T: FloatType>(x: impl IntoExpr<T>, y: impl IntoExpr<T>) -> Expr<T> {
    x.into_expr().pow(y)
}
/// `fma(a, b, c)` = a·b + c
pub fn fma<T: FloatType>(a: impl IntoExpr<T>, b: impl IntoExpr<T>, c: impl IntoExpr<T>) -> Expr<T> {
    a.into_expr().fma(b, c)
}
/// `select(if_false, if_true, cond)` written as `select(cond, if_true, if_false)`.
pub use crate::expr::select;

macro_rules! float_fns {
    ($($name:ident => $doc:literal),*) => {$(
        #[doc = $doc]
        pub fn $name<T: FloatType>(x: impl IntoExpr<T>) -> Expr<T> {
            x.into_expr().$name()
        }
    )*};
}
float_fns!(exp => "`exp(x)`", exp2 => "`exp2(x)`", log => "`log(x)`", log2 => "`log2(x)`",
    sqrt => "`sqrt(x)`", inverse_sqrt => "`inverseSqrt(x)`", tanh => "`tanh(x)`",
    sin => "`sin(x)`", cos => "`cos(x)`", floor => "`floor(x)`", ceil => "`ceil(x)`");

// ---------------------------------------------------------------- comptime or runtime

/// `a < b` and friends: a Rust `bool` for two Rust values, an `Expr<bool>` when either side is
/// an expression.
pub trait Compare<R> {
    type Output;
    fn lt(self, r: R) -> Self::Output;
    fn le(self, r: R) -> Self::Output;
    fn gt(self, r: R) -> Self::Output;
    fn ge(self, r: R) -> Self::Output;
    fn eq(self, r: R) -> Self::Output;
    fn ne(self, r: R) -> Self::Output;
}

impl<T: ScalarType + Numeric, R: IntoExpr<T>> Compare<R> for Expr<T> {
    type Output = Expr<bool>;
    fn lt(self, r: R) -> Expr<bool> {
        Expr::lt(&self, r)
    }
    fn le(self, r: R) -> Expr<bool> {
        Expr::le(&self, r)
    }
    fn gt(self, r: R) -> Expr<bool> {
        Expr::gt(&self, r)
    }
    fn ge(self, r: R) -> Expr<bool> {
        Expr::ge(&self, r)
    }
    fn eq(self, r: R) -> Expr<bool> {
        Expr::eq(&self, r)
    }
    fn ne(self, r: R) -> Expr<bool> {
        Expr::ne(&self, r)
    }
}

macro_rules! compare_rust {
    ($($t:ty),*) => {$(
        impl Compare<$t> for $t {
            type Output = bool;
            fn lt(self, r: $t) -> bool { self < r }
            fn le(self, r: $t) -> bool { self <= r }
            fn gt(self, r: $t) -> bool { self > r }
            fn ge(self, r: $t) -> bool { self >= r }
            fn eq(self, r: $t) -> bool { self == r }
            fn ne(self, r: $t) -> bool { self != r }
        }
        impl Compare<Expr<$t>> for $t {
            type Output = Expr<bool>;
            fn lt(self, r: Expr<$t>) -> Expr<bool> { r.gt(self) }
            fn le(self, r: Expr<$t>) -> Expr<bool> { r.ge(self) }
            fn gt(self, r: Expr<$t>) -> Expr<bool> { r.lt(self) }
            fn ge(self, r: Expr<$t>) -> Expr<bool> { r.le(self) }
            fn eq(self, r: Expr<$t>) -> Expr<bool> { r.eq(self) }
            fn ne(self, r: Expr<$t>) -> Expr<bool> { r.ne(self) }
        }
    )*};
}
compare_rust!(f32, u32, i32);

/// `&&` and `||`: Rust's for two `bool`s, WGSL's when either side is an expression.
pub trait Logic<R> {
    type Output;
    fn and(self, r: R) -> Self::Output;
    fn or(self, r: R) -> Self::Output;
}
impl Logic<bool> for bool {
    type Output = bool;
    fn and(self, r: bool) -> bool {
        self && r
    }
    fn or(self, r: bool) -> bool {
        self || r
    }
}
impl<R: IntoExpr<bool>> Logic<R> for Expr<bool> {
    type Output = Expr<bool>;
    fn and(self, r: R) -> Expr<bool> {
        Expr::and(&self, r)
    }
    fn or(self, r: R) -> Expr<bool> {
        Expr::or(&self, r)
    }
}
impl Logic<Expr<bool>> for bool {
    type Output = Expr<bool>;
    fn and(self, r: Expr<bool>) -> Expr<bool> {
        crate::lit(self).and(r)
    }
    fn or(self, r: Expr<bool>) -> Expr<bool> {
        crate::lit(self).or(r)
    }
}

/// An `if` condition: a Rust `bool` picks a branch now; an `Expr<bool>` records a WGSL `if`.
pub trait Condition {
    #[track_caller]
    fn branch(
        self,
        k: &mut KernelBuilder,
        then: impl FnOnce(&mut KernelBuilder),
        otherwise: impl FnOnce(&mut KernelBuilder),
    );
}
impl Condition for bool {
    #[track_caller]
    fn branch(
        self,
        k: &mut KernelBuilder,
        then: impl FnOnce(&mut KernelBuilder),
        otherwise: impl FnOnce(&mut KernelBuilder),
    ) {
        if self { then(k) } else { otherwise(k) }
    }
}
impl Condition for Expr<bool> {
    #[track_caller]
    fn branch(
        self,
        k: &mut KernelBuilder,
        then: impl FnOnce(&mut KernelBuilder),
        otherwise: impl FnOnce(&mut KernelBuilder),
    ) {
        k.if_else(self, then, otherwise)
    }
}

/// `if cond { then } else { otherwise }`, comptime or runtime by the condition's type.
#[track_caller]
pub fn if_else(
    k: &mut KernelBuilder,
    cond: impl Condition,
    then: impl FnOnce(&mut KernelBuilder),
    otherwise: impl FnOnce(&mut KernelBuilder),
) {
    cond.branch(k, then, otherwise)
}

/// The bounds of a `for` range: two Rust integers unroll at build time; any expression makes a
/// runtime WGSL loop.
pub trait LoopBounds {
    type Index;
    #[track_caller]
    fn run(
        self,
        k: &mut KernelBuilder,
        hint: &str,
        step: Option<Self::Index>,
        body: impl FnMut(&mut KernelBuilder, Self::Index),
    );
}

/// A `step_by` amount for a range whose index is `I`.
pub trait StepFor<I> {
    fn step(self) -> I;
}

macro_rules! loop_bounds {
    ($($t:ty),*) => {$(
        impl LoopBounds for ($t, $t) {
            type Index = $t;
            #[track_caller]
            fn run(self, k: &mut KernelBuilder, _hint: &str, step: Option<$t>, mut body: impl FnMut(&mut KernelBuilder, $t)) {
                let step = step.unwrap_or(1).max(1) as usize;
                for i in (self.0..self.1).step_by(step) {
                    body(k, i);
                }
            }
        }
        impl LoopBounds for (Expr<$t>, Expr<$t>) {
            type Index = Expr<$t>;
            #[track_caller]
            fn run(self, k: &mut KernelBuilder, hint: &str, step: Option<Expr<$t>>, mut body: impl FnMut(&mut KernelBuilder, Expr<$t>)) {
                let step = step.unwrap_or_else(<$t as LoopCounter>::one);
                k.for_step(hint, self.0, self.1, step, |k, i| body(k, i));
            }
        }
        impl LoopBounds for ($t, Expr<$t>) {
            type Index = Expr<$t>;
            #[track_caller]
            fn run(self, k: &mut KernelBuilder, hint: &str, step: Option<Expr<$t>>, body: impl FnMut(&mut KernelBuilder, Expr<$t>)) {
                (crate::lit(self.0), self.1).run(k, hint, step, body)
            }
        }
        impl LoopBounds for (Expr<$t>, $t) {
            type Index = Expr<$t>;
            #[track_caller]
            fn run(self, k: &mut KernelBuilder, hint: &str, step: Option<Expr<$t>>, body: impl FnMut(&mut KernelBuilder, Expr<$t>)) {
                (self.0, crate::lit(self.1)).run(k, hint, step, body)
            }
        }
        impl StepFor<$t> for $t {
            fn step(self) -> $t {
                self
            }
        }
        impl StepFor<Expr<$t>> for $t {
            fn step(self) -> Expr<$t> {
                crate::lit(self)
            }
        }
        impl StepFor<Expr<$t>> for Expr<$t> {
            fn step(self) -> Expr<$t> {
                self
            }
        }
    )*};
}
loop_bounds!(u32, i32);

/// `for i in start..end`, comptime or runtime by the bounds' types.
#[track_caller]
pub fn for_range<B: LoopBounds>(
    k: &mut KernelBuilder,
    hint: &str,
    bounds: B,
    body: impl FnMut(&mut KernelBuilder, B::Index),
) {
    bounds.run(k, hint, None, body)
}

/// `for i in (start..end).step_by(step)`, comptime or runtime by the bounds' types.
#[track_caller]
pub fn for_range_step<B: LoopBounds, S: StepFor<B::Index>>(
    k: &mut KernelBuilder,
    hint: &str,
    bounds: B,
    step: S,
    body: impl FnMut(&mut KernelBuilder, B::Index),
) {
    bounds.run(k, hint, Some(step.step()), body)
}

/// `x as T`: a Rust cast for a Rust number, a WGSL conversion for an expression.
pub trait CastTo<T> {
    type Output;
    fn cast_to(self) -> Self::Output;
}
impl<T: Numeric, U: Numeric> CastTo<U> for Expr<T> {
    type Output = Expr<U>;
    fn cast_to(self) -> Expr<U> {
        self.cast::<U>()
    }
}
macro_rules! cast_rust {
    ($($from:ty => $($to:ty),*;)*) => {$($(
        impl CastTo<$to> for $from {
            type Output = $to;
            fn cast_to(self) -> $to {
                self as $to
            }
        }
    )*)*};
}
cast_rust!(u32 => f32, i32, u32; i32 => f32, u32, i32; f32 => u32, i32, f32;);

/// `x as T`.
pub fn cast<T, X: CastTo<T>>(x: X) -> X::Output {
    x.cast_to()
}

/// A value the macro binds with `let`: expressions get a WGSL `let`, Rust values stay Rust.
pub trait Bind {
    #[track_caller]
    fn bind(self, k: &mut KernelBuilder, hint: &str) -> Self;
}
impl<T: WgslType> Bind for Expr<T> {
    #[track_caller]
    fn bind(self, k: &mut KernelBuilder, hint: &str) -> Self {
        k.let_(hint, self)
    }
}
macro_rules! bind_rust {
    ($($t:ty),*) => {$(
        impl Bind for $t {
            #[track_caller]
            fn bind(self, _: &mut KernelBuilder, _: &str) -> Self {
                self
            }
        }
    )*};
}
bind_rust!(f32, u32, i32, bool);

/// A call of a `#[kernel_fn]` helper from a `#[kernel]` body: the helper takes the builder
/// first. A plain Rust function called by a plain name lands here, and is told so.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a `#[kernel_fn]` helper: a `#[kernel]` body calls only those by a plain name",
    label = "not a `#[kernel_fn]`",
    note = "mark the function `#[kernel_fn]` (it becomes a WGSL function), use a builtin (`max`, `exp`, `select`, …: see `hesper_dsl::kernel`), or call ordinary Rust on Rust values by a path (`self::square(…)`)"
)]
pub trait KernelFnCall<Args> {
    type Output;
    fn call_helper(self, k: &mut KernelBuilder, args: Args) -> Self::Output;
}

macro_rules! kernel_fn_call {
    ($($a:ident $i:tt),*) => {
        impl<F, R, $($a),*> KernelFnCall<($($a,)*)> for F
        where
            F: FnOnce(&mut KernelBuilder, $($a),*) -> Expr<R>,
        {
            type Output = Expr<R>;
            #[track_caller]
            fn call_helper(self, k: &mut KernelBuilder, _args: ($($a,)*)) -> Expr<R> {
                self(k, $(_args.$i),*)
            }
        }
    };
}
kernel_fn_call!();
kernel_fn_call!(A 0);
kernel_fn_call!(A 0, B 1);
kernel_fn_call!(A 0, B 1, C 2);
kernel_fn_call!(A 0, B 1, C 2, D 3);

/// `helper(args…)` in a `#[kernel]` body.
#[track_caller]
pub fn call_kernel_fn<F: KernelFnCall<A>, A>(
    helper: F,
    k: &mut KernelBuilder,
    args: A,
) -> F::Output {
    helper.call_helper(k, args)
}
