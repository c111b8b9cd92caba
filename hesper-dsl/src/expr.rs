//! Expressions: typed handles (`Expr<T>`) over shared, immutable expression trees.
//!
//! Building an expression touches no builder: `a * b + 1.0` only makes a tree. Statements
//! (`let_`, `store`, `if_`) record trees into the builder's current scope. Every node knows its
//! WGSL type, so the untyped path ([`AnyExpr`]) can check types and report mismatches.
//!
//! Misuse that can only be seen while an expression is made (a bad swizzle, a bitcast between
//! types of different sizes) becomes an error node; the builder reports it, naming the kernel,
//! when a statement uses it.

use std::marker::PhantomData;
use std::ops;

use crate::ir::{BinaryOp, ExprKind, Func, Literal, Node, UnaryOp, node};
use crate::ty::{
    CoopA, CoopB, CoopC, CoopMat, CoopRole, CoopScalar, F16, FloatType, Numeric, Scalar,
    ScalarType, Ty, Vec2, Vec3, Vec4, WgslType,
};

fn error_node(msg: String, ty: Ty) -> Node {
    node(ExprKind::Error(msg), ty)
}

/// The type of `a op b`, or why there is none.
/// `i + 0`, `0 + i`, `i - 0`, `i * 1`, `1 * i` on integers are `i` (unrolled loops and offsets
/// write them often; the WGSL reads better without). Floats are left alone: `x + 0.0` is not `x`
/// for `x = -0.0`. Only where the kept operand already has the result's type.
fn fold_integer_identity(op: BinaryOp, a: &Node, b: &Node, result: &Ty) -> Option<Node> {
    let is = |n: &Node, v: u32| match n.kind {
        ExprKind::Literal(Literal::U32(x)) => x == v,
        ExprKind::Literal(Literal::I32(x)) => x == v as i32,
        _ => false,
    };
    let kept = match op {
        BinaryOp::Add if is(b, 0) => a,
        BinaryOp::Add if is(a, 0) => b,
        BinaryOp::Sub if is(b, 0) => a,
        BinaryOp::Mul if is(b, 1) => a,
        BinaryOp::Mul if is(a, 1) => b,
        _ => return None,
    };
    (&kept.ty == result).then(|| kept.clone())
}

pub(crate) fn binary_type(op: BinaryOp, a: &Ty, b: &Ty) -> Result<Ty, String> {
    let bad = || format!("`{}` is not defined for {a} and {b}", op.wgsl());
    // Cooperative matrices add and subtract their own type and scale by their element type
    // (what SPIR-V's cooperative-matrix extension defines); nothing else.
    match (op, a, b) {
        (BinaryOp::Add | BinaryOp::Sub, Ty::CoopMatrix { .. }, _) if a == b => {
            return Ok(a.clone());
        }
        (BinaryOp::Mul, Ty::CoopMatrix { scalar, .. }, Ty::Scalar(s))
        | (BinaryOp::Mul, Ty::Scalar(s), Ty::CoopMatrix { scalar, .. })
            if scalar == s =>
        {
            return Ok(if matches!(a, Ty::CoopMatrix { .. }) {
                a.clone()
            } else {
                b.clone()
            });
        }
        _ => {}
    }
    if !a.is_scalar_or_vector() || !b.is_scalar_or_vector() {
        return Err(bad());
    }
    let (sa, sb) = (a.scalar(), b.scalar());
    match op {
        BinaryOp::Shl | BinaryOp::Shr => {
            if sa.is_integer() && sb == Scalar::U32 && a.width() == b.width() {
                Ok(a.clone())
            } else {
                Err(format!(
                    "`{}` needs an integer on the left and u32 of the same width on the right, got {a} and {b}",
                    op.wgsl()
                ))
            }
        }
        _ if sa != sb => Err(bad()),
        BinaryOp::And | BinaryOp::Or => {
            if *a == Ty::BOOL && *b == Ty::BOOL {
                Ok(Ty::BOOL)
            } else {
                Err(bad())
            }
        }
        BinaryOp::BitAnd | BinaryOp::BitOr | BinaryOp::BitXor => {
            if a == b && (sa.is_integer() || sa == Scalar::Bool) {
                Ok(a.clone())
            } else {
                Err(bad())
            }
        }
        _ if op.is_comparison() => {
            let ordered = !matches!(op, BinaryOp::Eq | BinaryOp::Ne);
            if a != b || (ordered && sa == Scalar::Bool) {
                Err(bad())
            } else {
                Ok(a.with_scalar(Scalar::Bool))
            }
        }
        _ => {
            debug_assert!(op.is_arithmetic());
            if !sa.is_numeric() {
                return Err(bad());
            }
            match (a, b) {
                _ if a == b => Ok(a.clone()),
                (Ty::Vector(..), Ty::Scalar(_)) => Ok(a.clone()),
                (Ty::Scalar(_), Ty::Vector(..)) => Ok(b.clone()),
                _ => Err(bad()),
            }
        }
    }
}

/// The type a builtin call returns, or why the arguments do not fit.
pub(crate) fn call_type(f: Func, args: &[&Ty]) -> Result<Ty, String> {
    use Func::*;
    let arity = match f {
        Min | Max | Pow | Dot | SubgroupShuffleXor | SubgroupBroadcast | Bf16Pack => 2,
        Clamp | Fma | Mix | CoopMultiplyAdd => 3,
        _ => 1,
    };
    if args.len() != arity {
        return Err(format!(
            "`{}` takes {arity} argument(s), got {}",
            f.wgsl(),
            args.len()
        ));
    }
    let a = args[0];
    let same = |n: usize| args[..n].iter().all(|t| *t == a);
    let float = a.is_scalar_or_vector() && a.scalar().is_float();
    let numeric = a.is_scalar_or_vector() && a.scalar().is_numeric();
    let shown = args
        .iter()
        .map(|t| t.to_string())
        .collect::<Vec<_>>()
        .join(", ");
    let bad = || format!("`{}` is not defined for ({shown})", f.wgsl());
    match f {
        Abs | Sign if numeric => Ok(a.clone()),
        Min | Max | Clamp if numeric && same(arity) => Ok(a.clone()),
        Exp | Exp2 | Log | Log2 | Sqrt | InverseSqrt | Tanh | Sin | Cos | Floor | Ceil | Round
        | Fract
            if float =>
        {
            Ok(a.clone())
        }
        Pow | Fma | Mix if float && same(arity) => Ok(a.clone()),
        Dot if numeric && same(2) && matches!(a, Ty::Vector(..)) => Ok(Ty::Scalar(a.scalar())),
        SubgroupAdd | SubgroupMax | SubgroupMin if numeric => Ok(a.clone()),
        SubgroupShuffleXor | SubgroupBroadcast if numeric && *args[1] == Ty::U32 => Ok(a.clone()),
        Bf16Round | Bf16Pack if same(arity) && *a == Ty::F32 => Ok(Ty::U32),
        Bf16Low | Bf16High if *a == Ty::U32 => Ok(Ty::F32),
        CoopMultiplyAdd => match (args[0], args[1], args[2]) {
            (
                Ty::CoopMatrix {
                    size: n,
                    scalar: ab,
                    role: CoopRole::A,
                },
                Ty::CoopMatrix {
                    size: n2,
                    scalar: ab2,
                    role: CoopRole::B,
                },
                c @ Ty::CoopMatrix {
                    size: n3,
                    role: CoopRole::C,
                    ..
                },
            ) if n == n2 && n == n3 && ab == ab2 => Ok(c.clone()),
            _ => Err(format!(
                "`coopMultiplyAdd` takes matrices A, B (one element type) and C of one size, got ({shown})"
            )),
        },
        _ => Err(bad()),
    }
}

/// An expression of a statically known WGSL type `T`.
pub struct Expr<T> {
    pub(crate) node: Node,
    _t: PhantomData<fn() -> T>,
}

impl<T> Clone for Expr<T> {
    fn clone(&self) -> Self {
        Expr::wrap(self.node.clone())
    }
}

impl<T> std::fmt::Debug for Expr<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Expr<{}>({:?})", self.node.ty, self.node.kind)
    }
}

/// An expression whose type is known only at run time: the untyped path, for code generators
/// (such as `#[kernel]`) that cannot name types. Mismatches are `Err`s, never panics.
#[derive(Clone, Debug)]
pub struct AnyExpr {
    pub(crate) node: Node,
}

impl<T> Expr<T> {
    pub(crate) fn wrap(node: Node) -> Self {
        Expr {
            node,
            _t: PhantomData,
        }
    }
    /// Forget the static type.
    pub fn erase(&self) -> AnyExpr {
        AnyExpr {
            node: self.node.clone(),
        }
    }
    pub fn ty(&self) -> &Ty {
        &self.node.ty
    }
}

impl<T: WgslType> Expr<T> {
    /// Build a typed node; the caller guarantees the type rules hold, so a failure is a hesper bug
    /// turned into an error node rather than a panic.
    fn typed(kind: ExprKind) -> Self {
        Expr::wrap(node(kind, T::ty()))
    }

    fn binary<U: WgslType>(op: BinaryOp, a: Node, b: Node) -> Expr<U> {
        debug_assert_eq!(binary_type(op, &a.ty, &b.ty).as_ref(), Ok(&U::ty()));
        match fold_integer_identity(op, &a, &b, &U::ty()) {
            Some(kept) => Expr::wrap(kept),
            None => Expr::<U>::typed(ExprKind::Binary(op, a, b)),
        }
    }

    fn call(f: Func, args: Vec<Node>) -> Self {
        let tys: Vec<&Ty> = args.iter().map(|a| &a.ty).collect();
        match call_type(f, &tys) {
            Ok(t) if t == T::ty() => Expr::typed(ExprKind::Call(f, args)),
            Ok(t) => Expr::wrap(error_node(
                format!("`{}` returns {t}, not {}", f.wgsl(), T::ty()),
                T::ty(),
            )),
            Err(e) => Expr::wrap(error_node(e, T::ty())),
        }
    }
}

impl AnyExpr {
    pub fn ty(&self) -> &Ty {
        &self.node.ty
    }

    /// Take the static type back; `Err` names both types when they differ.
    pub fn typed<T: WgslType>(&self) -> Result<Expr<T>, String> {
        if self.node.ty == T::ty() {
            Ok(Expr::wrap(self.node.clone()))
        } else {
            Err(format!("expected {}, found {}", T::ty(), self.node.ty))
        }
    }

    pub fn literal(l: Literal) -> AnyExpr {
        AnyExpr {
            node: node(ExprKind::Literal(l), l.ty()),
        }
    }

    /// `a op b`, type-checked.
    pub fn binary(op: BinaryOp, a: &AnyExpr, b: &AnyExpr) -> Result<AnyExpr, String> {
        let ty = binary_type(op, a.ty(), b.ty())?;
        let node = fold_integer_identity(op, &a.node, &b.node, &ty)
            .unwrap_or_else(|| node(ExprKind::Binary(op, a.node.clone(), b.node.clone()), ty));
        Ok(AnyExpr { node })
    }

    /// `-a`, `!a` or `~a`, type-checked.
    pub fn unary(op: UnaryOp, a: &AnyExpr) -> Result<AnyExpr, String> {
        let ok = a.ty().is_scalar_or_vector()
            && match op {
                UnaryOp::Neg => a.ty().scalar().is_float() || a.ty().scalar() == Scalar::I32,
                UnaryOp::Not => a.ty().scalar() == Scalar::Bool,
                UnaryOp::Complement => a.ty().scalar().is_integer(),
            };
        if !ok {
            return Err(format!("unary {op:?} is not defined for {}", a.ty()));
        }
        Ok(AnyExpr {
            node: node(ExprKind::Unary(op, a.node.clone()), a.ty().clone()),
        })
    }

    /// A builtin call, type-checked. Subgroup functions go through the builder instead.
    pub fn call(f: Func, args: &[AnyExpr]) -> Result<AnyExpr, String> {
        if f.is_subgroup() {
            return Err(format!(
                "`{}` must be made through the builder (it checks the kernel asked for subgroups)",
                f.wgsl()
            ));
        }
        let tys: Vec<&Ty> = args.iter().map(|a| a.ty()).collect();
        let ty = call_type(f, &tys)?;
        Ok(AnyExpr {
            node: node(
                ExprKind::Call(f, args.iter().map(|a| a.node.clone()).collect()),
                ty,
            ),
        })
    }

    /// `base[index]` on an array or vector value, type-checked.
    pub fn index(base: &AnyExpr, index: &AnyExpr) -> Result<AnyExpr, String> {
        let elem = match base.ty() {
            Ty::Array(e, _) => (**e).clone(),
            Ty::Vector(_, s) => Ty::Scalar(*s),
            t => return Err(format!("{t} cannot be indexed")),
        };
        if !matches!(index.ty(), Ty::Scalar(Scalar::U32 | Scalar::I32)) {
            return Err(format!("an index must be u32 or i32, found {}", index.ty()));
        }
        Ok(AnyExpr {
            node: node(ExprKind::Index(base.node.clone(), index.node.clone()), elem),
        })
    }

    /// `T(value)`: a conversion between scalar (or same-width vector) types.
    pub fn convert(value: &AnyExpr, to: &Ty) -> Result<AnyExpr, String> {
        if !to.is_scalar_or_vector() || value.ty().width() != to.width() {
            return Err(format!("cannot convert {} to {to}", value.ty()));
        }
        Ok(AnyExpr {
            node: node(ExprKind::Construct(vec![value.node.clone()]), to.clone()),
        })
    }
}

/// Anything that can stand where an `Expr<T>` is wanted: the expression itself, a reference to
/// it, or a Rust literal of the matching type.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot stand where a `{T}` expression is wanted",
    label = "expected an `Expr<{T}>` or a `{T}` value here",
    note = "a literal must have the expression's type: `2.0` for f32, `2u32` for u32 (a bare `2` is an integer, never a float); convert an expression with `as`: `i as f32`"
)]
pub trait IntoExpr<T> {
    fn into_expr(self) -> Expr<T>;
}

impl<T> IntoExpr<T> for Expr<T> {
    fn into_expr(self) -> Expr<T> {
        self
    }
}
impl<T> IntoExpr<T> for &Expr<T> {
    fn into_expr(self) -> Expr<T> {
        self.clone()
    }
}

/// Make a literal expression.
pub fn lit<T: LiteralType>(v: T) -> Expr<T::Marker> {
    v.literal()
}

/// Rust values that are WGSL literals.
pub trait LiteralType: Copy {
    type Marker: ScalarType;
    fn literal(self) -> Expr<Self::Marker>;
}

macro_rules! literal {
    ($t:ty, $v:ident) => {
        impl LiteralType for $t {
            type Marker = $t;
            fn literal(self) -> Expr<$t> {
                Expr::wrap(node(ExprKind::Literal(Literal::$v(self)), <$t>::ty()))
            }
        }
        impl IntoExpr<$t> for $t {
            fn into_expr(self) -> Expr<$t> {
                self.literal()
            }
        }
    };
}
literal!(f32, F32);
literal!(i32, I32);
literal!(u32, U32);
literal!(bool, Bool);

impl Expr<F16> {
    /// An f16 literal. The value must be exactly representable in f16; otherwise the kernel
    /// fails to build with an error naming the value.
    pub fn lit(v: f32) -> Expr<F16> {
        if f16_exact(v) {
            Expr::wrap(node(ExprKind::Literal(Literal::F16(v)), Ty::F16))
        } else {
            Expr::wrap(error_node(
                format!("{v:?} is not exactly representable as f16"),
                Ty::F16,
            ))
        }
    }
}

/// Whether an f32 equals an f16 value exactly (normal, subnormal or zero; no inf/NaN).
fn f16_exact(v: f32) -> bool {
    if !v.is_finite() || v.abs() > 65504.0 {
        return false;
    }
    if v == 0.0 {
        return true;
    }
    // f16 has 11 significant bits; subnormals are multiples of 2^-24.
    let scaled = v * (1u32 << 24) as f32;
    if v.abs() < 6.103_515_6e-5 {
        return scaled.fract() == 0.0;
    }
    let bits = v.to_bits() & 0x7f_ffff;
    bits & 0x1fff == 0
}

// ---------------------------------------------------------------- operators

macro_rules! arith_op {
    ($tr:ident, $m:ident, $op:ident) => {
        impl<T: Numeric, R: IntoExpr<T>> ops::$tr<R> for Expr<T> {
            type Output = Expr<T>;
            fn $m(self, rhs: R) -> Expr<T> {
                Expr::<T>::binary(BinaryOp::$op, self.node, rhs.into_expr().node)
            }
        }
        impl<T: Numeric, R: IntoExpr<T>> ops::$tr<R> for &Expr<T> {
            type Output = Expr<T>;
            fn $m(self, rhs: R) -> Expr<T> {
                Expr::<T>::binary(BinaryOp::$op, self.node.clone(), rhs.into_expr().node)
            }
        }
    };
}
arith_op!(Add, add, Add);
arith_op!(Sub, sub, Sub);
arith_op!(Mul, mul, Mul);
arith_op!(Div, div, Div);
arith_op!(Rem, rem, Rem);

/// `literal op expr` and `vector op scalar` for the concrete types (Rust's orphan rules need them
/// spelled out).
macro_rules! scalar_lhs_ops {
    ($s:ty; $($v:ty),*) => {
        scalar_lhs_ops!(@lit $s, $s);
        $(
            scalar_lhs_ops!(@lit $s, $v);
            scalar_lhs_ops!(@vs $s, $v, Add, add);
            scalar_lhs_ops!(@vs $s, $v, Sub, sub);
            scalar_lhs_ops!(@vs $s, $v, Mul, mul);
            scalar_lhs_ops!(@vs $s, $v, Div, div);
        )*
    };
    (@lit $s:ty, $t:ty) => {
        scalar_lhs_ops!(@one $s, $t, Add, add);
        scalar_lhs_ops!(@one $s, $t, Sub, sub);
        scalar_lhs_ops!(@one $s, $t, Mul, mul);
        scalar_lhs_ops!(@one $s, $t, Div, div);
    };
    (@one $s:ty, $t:ty, $tr:ident, $m:ident) => {
        impl ops::$tr<Expr<$t>> for $s {
            type Output = Expr<$t>;
            fn $m(self, rhs: Expr<$t>) -> Expr<$t> {
                Expr::<$t>::binary(BinaryOp::$tr, lit(self).node, rhs.node)
            }
        }
        impl ops::$tr<&Expr<$t>> for $s {
            type Output = Expr<$t>;
            fn $m(self, rhs: &Expr<$t>) -> Expr<$t> {
                Expr::<$t>::binary(BinaryOp::$tr, lit(self).node, rhs.node.clone())
            }
        }
    };
    (@vs $s:ty, $v:ty, $tr:ident, $m:ident) => {
        impl ops::$tr<$s> for Expr<$v> {
            type Output = Expr<$v>;
            fn $m(self, rhs: $s) -> Expr<$v> {
                Expr::<$v>::binary(BinaryOp::$tr, self.node, lit(rhs).node)
            }
        }
        impl ops::$tr<Expr<$s>> for Expr<$v> {
            type Output = Expr<$v>;
            fn $m(self, rhs: Expr<$s>) -> Expr<$v> {
                Expr::<$v>::binary(BinaryOp::$tr, self.node, rhs.node)
            }
        }
        impl ops::$tr<&Expr<$s>> for Expr<$v> {
            type Output = Expr<$v>;
            fn $m(self, rhs: &Expr<$s>) -> Expr<$v> {
                Expr::<$v>::binary(BinaryOp::$tr, self.node, rhs.node.clone())
            }
        }
        impl ops::$tr<Expr<$s>> for &Expr<$v> {
            type Output = Expr<$v>;
            fn $m(self, rhs: Expr<$s>) -> Expr<$v> {
                Expr::<$v>::binary(BinaryOp::$tr, self.node.clone(), rhs.node)
            }
        }
    };
}
scalar_lhs_ops!(f32; Vec2<f32>, Vec3<f32>, Vec4<f32>);
scalar_lhs_ops!(u32; Vec2<u32>, Vec3<u32>, Vec4<u32>);
scalar_lhs_ops!(i32; Vec2<i32>, Vec3<i32>, Vec4<i32>);

macro_rules! neg_op {
    ($($t:ty),*) => {$(
        impl ops::Neg for Expr<$t> {
            type Output = Expr<$t>;
            fn neg(self) -> Expr<$t> {
                Expr::typed(ExprKind::Unary(UnaryOp::Neg, self.node))
            }
        }
        impl ops::Neg for &Expr<$t> {
            type Output = Expr<$t>;
            fn neg(self) -> Expr<$t> {
                -self.clone()
            }
        }
    )*};
}
neg_op!(
    f32,
    F16,
    i32,
    Vec2<f32>,
    Vec3<f32>,
    Vec4<f32>,
    Vec2<F16>,
    Vec3<F16>,
    Vec4<F16>,
    Vec2<i32>,
    Vec3<i32>,
    Vec4<i32>
);

impl ops::Not for Expr<bool> {
    type Output = Expr<bool>;
    fn not(self) -> Expr<bool> {
        Expr::typed(ExprKind::Unary(UnaryOp::Not, self.node))
    }
}
impl ops::Not for &Expr<bool> {
    type Output = Expr<bool>;
    fn not(self) -> Expr<bool> {
        !self.clone()
    }
}

macro_rules! bit_ops {
    ($($t:ty),*) => {$(
        impl ops::Not for Expr<$t> {
            type Output = Expr<$t>;
            fn not(self) -> Expr<$t> {
                Expr::typed(ExprKind::Unary(UnaryOp::Complement, self.node))
            }
        }
        bit_ops!(@op $t, BitAnd, bitand);
        bit_ops!(@op $t, BitOr, bitor);
        bit_ops!(@op $t, BitXor, bitxor);
    )*};
    (@op $t:ty, $tr:ident, $m:ident) => {
        impl<R: IntoExpr<$t>> ops::$tr<R> for Expr<$t> {
            type Output = Expr<$t>;
            fn $m(self, rhs: R) -> Expr<$t> {
                Expr::<$t>::binary(BinaryOp::$tr, self.node, rhs.into_expr().node)
            }
        }
        impl<R: IntoExpr<$t>> ops::$tr<R> for &Expr<$t> {
            type Output = Expr<$t>;
            fn $m(self, rhs: R) -> Expr<$t> {
                Expr::<$t>::binary(BinaryOp::$tr, self.node.clone(), rhs.into_expr().node)
            }
        }
    };
}
bit_ops!(u32, i32, Vec2<u32>, Vec4<u32>);

/// Shifts take a `u32` amount (WGSL's rule) for `u32` and `i32` values.
macro_rules! shift_ops {
    ($($t:ty),*) => {$(
        impl<R: IntoExpr<u32>> ops::Shl<R> for Expr<$t> {
            type Output = Expr<$t>;
            fn shl(self, rhs: R) -> Expr<$t> {
                Expr::<$t>::binary(BinaryOp::Shl, self.node, rhs.into_expr().node)
            }
        }
        impl<R: IntoExpr<u32>> ops::Shr<R> for Expr<$t> {
            type Output = Expr<$t>;
            fn shr(self, rhs: R) -> Expr<$t> {
                Expr::<$t>::binary(BinaryOp::Shr, self.node, rhs.into_expr().node)
            }
        }
        impl<R: IntoExpr<u32>> ops::Shl<R> for &Expr<$t> {
            type Output = Expr<$t>;
            fn shl(self, rhs: R) -> Expr<$t> {
                self.clone() << rhs
            }
        }
        impl<R: IntoExpr<u32>> ops::Shr<R> for &Expr<$t> {
            type Output = Expr<$t>;
            fn shr(self, rhs: R) -> Expr<$t> {
                self.clone() >> rhs
            }
        }
    )*};
}
shift_ops!(u32, i32);

// ---------------------------------------------------------------- methods

impl<T: ScalarType> Expr<T> {
    fn compare(&self, op: BinaryOp, rhs: Expr<T>) -> Expr<bool> {
        Expr::<T>::binary(op, self.node.clone(), rhs.node)
    }
    /// `self == rhs`
    pub fn eq(&self, rhs: impl IntoExpr<T>) -> Expr<bool> {
        self.compare(BinaryOp::Eq, rhs.into_expr())
    }
    /// `self != rhs`
    pub fn ne(&self, rhs: impl IntoExpr<T>) -> Expr<bool> {
        self.compare(BinaryOp::Ne, rhs.into_expr())
    }
}

impl<T: ScalarType + Numeric> Expr<T> {
    /// `self < rhs`
    pub fn lt(&self, rhs: impl IntoExpr<T>) -> Expr<bool> {
        self.compare(BinaryOp::Lt, rhs.into_expr())
    }
    /// `self <= rhs`
    pub fn le(&self, rhs: impl IntoExpr<T>) -> Expr<bool> {
        self.compare(BinaryOp::Le, rhs.into_expr())
    }
    /// `self > rhs`
    pub fn gt(&self, rhs: impl IntoExpr<T>) -> Expr<bool> {
        self.compare(BinaryOp::Gt, rhs.into_expr())
    }
    /// `self >= rhs`
    pub fn ge(&self, rhs: impl IntoExpr<T>) -> Expr<bool> {
        self.compare(BinaryOp::Ge, rhs.into_expr())
    }
}

/// `self & rhs` on booleans: both sides evaluated, no short-circuit (naga counts the result of
/// `&&` as varying between invocations, so a cooperative operation under it fails to validate).
impl<R: IntoExpr<bool>> ops::BitAnd<R> for Expr<bool> {
    type Output = Expr<bool>;
    fn bitand(self, rhs: R) -> Expr<bool> {
        Expr::<bool>::binary(BinaryOp::BitAnd, self.node, rhs.into_expr().node)
    }
}
/// `self | rhs` on booleans: both sides evaluated.
impl<R: IntoExpr<bool>> ops::BitOr<R> for Expr<bool> {
    type Output = Expr<bool>;
    fn bitor(self, rhs: R) -> Expr<bool> {
        Expr::<bool>::binary(BinaryOp::BitOr, self.node, rhs.into_expr().node)
    }
}

impl Expr<bool> {
    /// Short-circuit `self && rhs`.
    pub fn and(&self, rhs: impl IntoExpr<bool>) -> Expr<bool> {
        Expr::<bool>::binary(BinaryOp::And, self.node.clone(), rhs.into_expr().node)
    }
    /// Short-circuit `self || rhs`.
    pub fn or(&self, rhs: impl IntoExpr<bool>) -> Expr<bool> {
        Expr::<bool>::binary(BinaryOp::Or, self.node.clone(), rhs.into_expr().node)
    }
    /// `select(if_false, if_true, self)`: both sides are evaluated.
    pub fn select<T: WgslType>(
        &self,
        if_true: impl IntoExpr<T>,
        if_false: impl IntoExpr<T>,
    ) -> Expr<T> {
        Expr::typed(ExprKind::Select(
            if_false.into_expr().node,
            if_true.into_expr().node,
            self.node.clone(),
        ))
    }
}

macro_rules! unary_methods {
    ($bound:ident: $($name:ident => $f:ident, $doc:literal;)*) => {
        impl<T: $bound> Expr<T> {$(
            #[doc = $doc]
            pub fn $name(&self) -> Expr<T> {
                Expr::call(Func::$f, vec![self.node.clone()])
            }
        )*}
    };
}
unary_methods!(Numeric:
    abs => Abs, "`abs(self)`";
    sign => Sign, "`sign(self)`";
);
unary_methods!(FloatType:
    exp => Exp, "`exp(self)`";
    exp2 => Exp2, "`exp2(self)`";
    log => Log, "`log(self)` (natural)";
    log2 => Log2, "`log2(self)`";
    sqrt => Sqrt, "`sqrt(self)`";
    inverse_sqrt => InverseSqrt, "`inverseSqrt(self)`";
    tanh => Tanh, "`tanh(self)`";
    sin => Sin, "`sin(self)`";
    cos => Cos, "`cos(self)`";
    floor => Floor, "`floor(self)`";
    ceil => Ceil, "`ceil(self)`";
    round => Round, "`round(self)` (ties to even)";
    fract => Fract, "`fract(self)`";
);

impl<T: Numeric> Expr<T> {
    /// `min(self, rhs)`
    pub fn min(&self, rhs: impl IntoExpr<T>) -> Expr<T> {
        Expr::call(Func::Min, vec![self.node.clone(), rhs.into_expr().node])
    }
    /// `max(self, rhs)`
    pub fn max(&self, rhs: impl IntoExpr<T>) -> Expr<T> {
        Expr::call(Func::Max, vec![self.node.clone(), rhs.into_expr().node])
    }
    /// `clamp(self, lo, hi)`
    pub fn clamp(&self, lo: impl IntoExpr<T>, hi: impl IntoExpr<T>) -> Expr<T> {
        let args = vec![self.node.clone(), lo.into_expr().node, hi.into_expr().node];
        Expr::call(Func::Clamp, args)
    }
    /// Convert to another numeric type of the same width: `f32(self)`, `vec4<f32>(self)`.
    pub fn cast<U: Numeric>(&self) -> Expr<U> {
        match AnyExpr::convert(&self.erase(), &U::ty()) {
            Ok(e) => Expr::wrap(e.node),
            Err(m) => Expr::wrap(error_node(m, U::ty())),
        }
    }
    /// Reinterpret the bits as another type of the same size: `bitcast<U>(self)`.
    pub fn bitcast<U: Numeric>(&self) -> Expr<U> {
        let (from, to) = (T::ty(), U::ty());
        if from.size() == to.size() && from.is_scalar_or_vector() {
            Expr::wrap(node(ExprKind::Bitcast(self.node.clone()), to))
        } else {
            Expr::wrap(error_node(
                format!("bitcast from {from} to {to} changes the size"),
                to,
            ))
        }
    }
}

impl<T: FloatType> Expr<T> {
    /// `pow(self, e)`
    pub fn pow(&self, e: impl IntoExpr<T>) -> Expr<T> {
        Expr::call(Func::Pow, vec![self.node.clone(), e.into_expr().node])
    }
    /// `fma(self, b, c)` = self·b + c with one rounding.
    pub fn fma(&self, b: impl IntoExpr<T>, c: impl IntoExpr<T>) -> Expr<T> {
        let args = vec![self.node.clone(), b.into_expr().node, c.into_expr().node];
        Expr::call(Func::Fma, args)
    }
    /// `mix(self, b, t)` = self·(1−t) + b·t.
    pub fn mix(&self, b: impl IntoExpr<T>, t: impl IntoExpr<T>) -> Expr<T> {
        let args = vec![self.node.clone(), b.into_expr().node, t.into_expr().node];
        Expr::call(Func::Mix, args)
    }
}

/// Vector-only methods: components, swizzles, dot.
pub trait VectorType: Numeric {
    const WIDTH: u8;
}
impl<S: ScalarType> VectorType for Vec2<S>
where
    Vec2<S>: Numeric,
{
    const WIDTH: u8 = 2;
}
impl<S: ScalarType> VectorType for Vec3<S>
where
    Vec3<S>: Numeric,
{
    const WIDTH: u8 = 3;
}
impl<S: ScalarType> VectorType for Vec4<S>
where
    Vec4<S>: Numeric,
{
    const WIDTH: u8 = 4;
}

impl<V: VectorType> Expr<V> {
    fn swizzle_to<U: WgslType>(&self, pattern: &str) -> Expr<U> {
        let valid = !pattern.is_empty()
            && pattern.len() <= 4
            && (pattern
                .chars()
                .all(|c| "xyzw"[..V::WIDTH as usize].contains(c))
                || pattern
                    .chars()
                    .all(|c| "rgba"[..V::WIDTH as usize].contains(c)));
        let want = if pattern.len() == 1 {
            Ty::Scalar(V::ty().scalar())
        } else {
            Ty::Vector(pattern.len() as u8, V::ty().scalar())
        };
        if !valid || want != U::ty() {
            let msg = format!(
                "swizzle `.{pattern}` does not fit {} → {}",
                V::ty(),
                U::ty()
            );
            return Expr::wrap(error_node(msg, U::ty()));
        }
        Expr::wrap(node(
            ExprKind::Swizzle(self.node.clone(), pattern.to_string()),
            U::ty(),
        ))
    }
    /// `self.x`
    pub fn x(&self) -> Expr<V::Elem> {
        self.swizzle_to("x")
    }
    /// `self.y`
    pub fn y(&self) -> Expr<V::Elem> {
        self.swizzle_to("y")
    }
    /// `self.z` (an error node on a vec2)
    pub fn z(&self) -> Expr<V::Elem> {
        self.swizzle_to("z")
    }
    /// `self.w` (an error node on a vec2 or vec3)
    pub fn w(&self) -> Expr<V::Elem> {
        self.swizzle_to("w")
    }
    /// A swizzle whose result type is named: `v.swizzle::<Vec2<f32>>("zx")`.
    pub fn swizzle<U: WgslType>(&self, pattern: &str) -> Expr<U> {
        self.swizzle_to(pattern)
    }
    /// `self[i]` with a runtime component index.
    pub fn component(&self, i: impl IntoExpr<u32>) -> Expr<V::Elem> {
        Expr::wrap(node(
            ExprKind::Index(self.node.clone(), i.into_expr().node),
            Ty::Scalar(V::ty().scalar()),
        ))
    }
    /// `dot(self, rhs)`
    pub fn dot(&self, rhs: impl IntoExpr<V>) -> Expr<V::Elem> {
        Expr::call(Func::Dot, vec![self.node.clone(), rhs.into_expr().node])
    }
    /// `V(s)`: every component set to `s`.
    pub fn splat(s: impl IntoExpr<V::Elem>) -> Expr<V> {
        Expr::typed(ExprKind::Construct(vec![s.into_expr().node]))
    }
}

/// `vec2<S>(a, b)`
pub fn vec2<S: ScalarType>(a: impl IntoExpr<S>, b: impl IntoExpr<S>) -> Expr<Vec2<S>> {
    Expr::typed(ExprKind::Construct(vec![
        a.into_expr().node,
        b.into_expr().node,
    ]))
}
/// `vec3<S>(a, b, c)`
pub fn vec3<S: ScalarType>(
    a: impl IntoExpr<S>,
    b: impl IntoExpr<S>,
    c: impl IntoExpr<S>,
) -> Expr<Vec3<S>> {
    let args = vec![a.into_expr().node, b.into_expr().node, c.into_expr().node];
    Expr::typed(ExprKind::Construct(args))
}
/// `vec4<S>(a, b, c, d)`
pub fn vec4<S: ScalarType>(
    a: impl IntoExpr<S>,
    b: impl IntoExpr<S>,
    c: impl IntoExpr<S>,
    d: impl IntoExpr<S>,
) -> Expr<Vec4<S>> {
    let args = vec![
        a.into_expr().node,
        b.into_expr().node,
        c.into_expr().node,
        d.into_expr().node,
    ];
    Expr::typed(ExprKind::Construct(args))
}

/// `select(if_false, if_true, cond)`
pub fn select<T: WgslType>(
    cond: impl IntoExpr<bool>,
    if_true: impl IntoExpr<T>,
    if_false: impl IntoExpr<T>,
) -> Expr<T> {
    cond.into_expr().select(if_true, if_false)
}

// ---------------------------------------------------------------- cooperative matrices

impl<S: CoopScalar, R: crate::ty::CoopRoleType, const N: u32> Expr<CoopMat<S, R, N>> {
    /// `coop_matNxN<S, R>()`: the matrix of zeros (WGSL has no other constructor).
    pub fn zero() -> Self {
        Expr::typed(ExprKind::Construct(vec![]))
    }
}

/// `coopMultiplyAdd(a, b, c)` = `a·b + c` on the tensor cores: `a` is `N × N` in role A, `b`
/// in role B (of the same element type), `c` the accumulator. Subgroup-wide: every
/// invocation of the subgroup must reach it together.
pub fn coop_multiply_add<S: CoopScalar, T: CoopScalar, const N: u32>(
    a: impl IntoExpr<CoopMat<S, CoopA, N>>,
    b: impl IntoExpr<CoopMat<S, CoopB, N>>,
    c: impl IntoExpr<CoopMat<T, CoopC, N>>,
) -> Expr<CoopMat<T, CoopC, N>> {
    let args = vec![a.into_expr().node, b.into_expr().node, c.into_expr().node];
    Expr::call(Func::CoopMultiplyAdd, args)
}

impl<S: CoopScalar, R: crate::ty::CoopRoleType, const N: u32> ops::Add for Expr<CoopMat<S, R, N>> {
    type Output = Self;
    fn add(self, rhs: Self) -> Self {
        Expr::<CoopMat<S, R, N>>::binary(BinaryOp::Add, self.node, rhs.node)
    }
}
impl<S: CoopScalar, R: crate::ty::CoopRoleType, const N: u32> ops::Sub for Expr<CoopMat<S, R, N>> {
    type Output = Self;
    fn sub(self, rhs: Self) -> Self {
        Expr::<CoopMat<S, R, N>>::binary(BinaryOp::Sub, self.node, rhs.node)
    }
}
/// Every element times a scalar of the matrix's element type.
impl<S: CoopScalar, R: crate::ty::CoopRoleType, const N: u32, E: IntoExpr<S>> ops::Mul<E>
    for Expr<CoopMat<S, R, N>>
{
    type Output = Self;
    fn mul(self, rhs: E) -> Self {
        Expr::<CoopMat<S, R, N>>::binary(BinaryOp::Mul, self.node, rhs.into_expr().node)
    }
}

/// Packed bf16 (two per `u32`): WGSL has no bf16 type, so bf16 data lives in `u32` buffers.
pub mod bf16 {
    use super::*;

    /// The f32 in the low half of `packed`.
    pub fn low(packed: impl IntoExpr<u32>) -> Expr<f32> {
        Expr::call(Func::Bf16Low, vec![packed.into_expr().node])
    }
    /// The f32 in the high half of `packed`.
    pub fn high(packed: impl IntoExpr<u32>) -> Expr<f32> {
        Expr::call(Func::Bf16High, vec![packed.into_expr().node])
    }
    /// `lo` and `hi` rounded to bf16 (nearest, ties to even; NaN stays NaN) in one `u32`, `lo` in
    /// the low half.
    pub fn pack(lo: impl IntoExpr<f32>, hi: impl IntoExpr<f32>) -> Expr<u32> {
        Expr::call(
            Func::Bf16Pack,
            vec![lo.into_expr().node, hi.into_expr().node],
        )
    }
    /// `x` rounded to bf16 (nearest, ties to even), as bits in the low 16 bits of a `u32`.
    pub fn round(x: impl IntoExpr<f32>) -> Expr<u32> {
        Expr::call(Func::Bf16Round, vec![x.into_expr().node])
    }

    /// The host-side twin of [`round`], for references and tests.
    pub fn round_host(x: f32) -> u16 {
        if x.is_nan() {
            return 0x7fc0;
        }
        let b = x.to_bits();
        ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
    }
    /// bf16 bits → f32, on the host.
    pub fn to_f32_host(h: u16) -> f32 {
        f32::from_bits((h as u32) << 16)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_exactness() {
        assert!(f16_exact(1.0));
        assert!(f16_exact(0.5));
        assert!(f16_exact(65504.0));
        assert!(!f16_exact(65505.0));
        assert!(!f16_exact(0.1));
        assert!(f16_exact(2f32.powi(-24)));
        assert!(!f16_exact(2f32.powi(-25)));
        assert!(f16_exact(1.0 + 2f32.powi(-10)));
        assert!(!f16_exact(1.0 + 2f32.powi(-11)));
    }

    #[test]
    fn binary_types_follow_wgsl() {
        let v4 = Ty::Vector(4, Scalar::F32);
        assert_eq!(binary_type(BinaryOp::Mul, &v4, &Ty::F32), Ok(v4.clone()));
        assert_eq!(
            binary_type(BinaryOp::Lt, &v4, &v4),
            Ok(Ty::Vector(4, Scalar::Bool))
        );
        assert!(binary_type(BinaryOp::Add, &Ty::F32, &Ty::U32).is_err());
        assert!(binary_type(BinaryOp::BitAnd, &Ty::F32, &Ty::F32).is_err());
        assert!(binary_type(BinaryOp::Shl, &Ty::I32, &Ty::I32).is_err());
        assert_eq!(binary_type(BinaryOp::Shl, &Ty::I32, &Ty::U32), Ok(Ty::I32));
        assert!(binary_type(BinaryOp::Lt, &Ty::BOOL, &Ty::BOOL).is_err());
        assert!(binary_type(BinaryOp::And, &Ty::U32, &Ty::U32).is_err());
    }

    #[test]
    fn untyped_path_reports_mismatches() {
        let a = AnyExpr::literal(Literal::F32(1.0));
        let b = AnyExpr::literal(Literal::U32(1));
        let e = AnyExpr::binary(BinaryOp::Add, &a, &b).unwrap_err();
        assert!(e.contains("f32") && e.contains("u32"), "{e}");
        assert!(a.typed::<u32>().is_err());
        assert!(a.typed::<f32>().is_ok());
        assert!(AnyExpr::call(Func::Sqrt, std::slice::from_ref(&b)).is_err());
        assert!(AnyExpr::index(&a, &b).is_err());
    }

    #[test]
    fn bf16_host_rounding_is_nearest_even() {
        // 1 + 2^-8 lies halfway between two bf16 values; ties go to the even one (1.0).
        assert_eq!(bf16::round_host(1.0 + 2f32.powi(-8)), 0x3f80);
        // 1 + 3·2^-8 ties up to the even 1 + 2^-6.
        assert_eq!(bf16::round_host(1.0 + 3.0 * 2f32.powi(-8)), 0x3f82);
        assert_eq!(bf16::to_f32_host(bf16::round_host(-2.5)), -2.5);
        assert!(bf16::to_f32_host(bf16::round_host(f32::NAN)).is_nan());
    }
}
