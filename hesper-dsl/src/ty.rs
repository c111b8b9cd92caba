//! WGSL types: scalars, vectors, fixed-size arrays, and the Rust marker types that name them.
//!
//! The builder is typed on the Rust side (`Expr<f32>`, `Expr<Vec4<f32>>`), and every expression
//! node also carries its runtime [`Ty`], which the untyped paths check and the emitter prints.

use std::fmt;
use std::marker::PhantomData;

/// A WGSL scalar type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Scalar {
    F32,
    F16,
    I32,
    U32,
    Bool,
}

impl Scalar {
    pub fn is_float(self) -> bool {
        matches!(self, Scalar::F32 | Scalar::F16)
    }
    pub fn is_integer(self) -> bool {
        matches!(self, Scalar::I32 | Scalar::U32)
    }
    pub fn is_numeric(self) -> bool {
        self != Scalar::Bool
    }
    /// Size in bytes in host-shareable memory (`bool` has none: it may not live in buffers).
    pub fn size(self) -> u32 {
        match self {
            Scalar::F16 => 2,
            _ => 4,
        }
    }
    pub fn wgsl(self) -> &'static str {
        match self {
            Scalar::F32 => "f32",
            Scalar::F16 => "f16",
            Scalar::I32 => "i32",
            Scalar::U32 => "u32",
            Scalar::Bool => "bool",
        }
    }
}

/// A WGSL type as the IR sees it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Ty {
    Scalar(Scalar),
    /// `vecN<S>`, N in 2..=4.
    Vector(u8, Scalar),
    /// `array<T, N>` with a fixed length (workgroup arrays, private arrays).
    Array(Box<Ty>, u32),
    /// `coop_matNxN<S, R>`: an `N × N` tile held by a whole subgroup (tensor cores), in one of
    /// the three roles of `C + A·B`. Not host-shareable: it moves to and from memory only through
    /// `coopLoad` and `coopStore` ([`crate::KernelBuilder::coop_load`]).
    CoopMatrix {
        size: u8,
        scalar: Scalar,
        role: CoopRole,
    },
}

/// The role of a cooperative matrix in `C + A·B`: WGSL's `A`, `B` and `C`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum CoopRole {
    /// The left operand, `M × K`.
    A,
    /// The right operand, `K × N`.
    B,
    /// The accumulator and result, `M × N`.
    C,
}

impl CoopRole {
    pub fn wgsl(self) -> &'static str {
        match self {
            CoopRole::A => "A",
            CoopRole::B => "B",
            CoopRole::C => "C",
        }
    }
}

impl Ty {
    pub const F32: Ty = Ty::Scalar(Scalar::F32);
    pub const F16: Ty = Ty::Scalar(Scalar::F16);
    pub const I32: Ty = Ty::Scalar(Scalar::I32);
    pub const U32: Ty = Ty::Scalar(Scalar::U32);
    pub const BOOL: Ty = Ty::Scalar(Scalar::Bool);

    /// The scalar at the bottom of this type (`f32` for `vec4<f32>` or `array<vec4<f32>, 8>`).
    pub fn scalar(&self) -> Scalar {
        match self {
            Ty::Scalar(s) | Ty::Vector(_, s) | Ty::CoopMatrix { scalar: s, .. } => *s,
            Ty::Array(e, _) => e.scalar(),
        }
    }

    /// The number of components of a scalar (1) or vector; `None` for arrays.
    pub fn width(&self) -> Option<u8> {
        match self {
            Ty::Scalar(_) => Some(1),
            Ty::Vector(n, _) => Some(*n),
            Ty::Array(..) | Ty::CoopMatrix { .. } => None,
        }
    }

    /// The same shape (scalar or vector width) with another scalar.
    pub fn with_scalar(&self, s: Scalar) -> Ty {
        match self {
            Ty::Scalar(_) => Ty::Scalar(s),
            Ty::Vector(n, _) => Ty::Vector(*n, s),
            Ty::Array(e, n) => Ty::Array(Box::new(e.with_scalar(s)), *n),
            Ty::CoopMatrix { size, role, .. } => Ty::CoopMatrix {
                size: *size,
                scalar: s,
                role: *role,
            },
        }
    }

    pub fn is_scalar_or_vector(&self) -> bool {
        matches!(self, Ty::Scalar(_) | Ty::Vector(..))
    }

    /// Whether this is a cooperative matrix, or an array of them.
    pub fn contains_coop_matrix(&self) -> bool {
        match self {
            Ty::CoopMatrix { .. } => true,
            Ty::Array(e, _) => e.contains_coop_matrix(),
            _ => false,
        }
    }

    pub fn contains_f16(&self) -> bool {
        self.scalar() == Scalar::F16
    }

    /// WGSL alignment in storage / workgroup memory.
    pub fn align(&self) -> u32 {
        match self {
            Ty::Scalar(s) => s.size(),
            Ty::Vector(n, s) => {
                let n = if *n == 3 { 4 } else { *n as u32 };
                n * s.size()
            }
            Ty::Array(e, _) => e.align(),
            // Opaque: never in host-shareable or workgroup memory.
            Ty::CoopMatrix { .. } => 0,
        }
    }

    /// WGSL size in storage / workgroup memory (`bool` counts 4 bytes in workgroup memory).
    pub fn size(&self) -> u32 {
        match self {
            Ty::Scalar(s) => s.size(),
            Ty::Vector(n, s) => *n as u32 * s.size(),
            // Saturating: an array past 4 GiB is refused by the memory limits, not a panic.
            Ty::Array(e, n) => e.stride().saturating_mul(*n),
            Ty::CoopMatrix { .. } => 0,
        }
    }

    /// Distance between consecutive elements of an array of this type.
    pub fn stride(&self) -> u32 {
        let (size, align) = (self.size(), self.align());
        size.div_ceil(align.max(1)) * align
    }
}

impl fmt::Display for Ty {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Ty::Scalar(s) => f.write_str(s.wgsl()),
            Ty::Vector(n, s) => write!(f, "vec{n}<{}>", s.wgsl()),
            Ty::Array(e, n) => write!(f, "array<{e}, {n}>"),
            Ty::CoopMatrix { size, scalar, role } => write!(
                f,
                "coop_mat{size}x{size}<{}, {}>",
                scalar.wgsl(),
                role.wgsl()
            ),
        }
    }
}

/// A Rust type that stands for a WGSL type.
pub trait WgslType: 'static {
    fn ty() -> Ty;
}

/// The marker for WGSL's `f16` (Rust's own `f16` is not stable). Literals are given as `f32`
/// and must be exactly representable in f16.
#[derive(Clone, Copy, Debug)]
pub struct F16;

/// Marker for `vec2<S>`.
#[derive(Clone, Copy, Debug)]
pub struct Vec2<S>(PhantomData<S>);
/// Marker for `vec3<S>`.
#[derive(Clone, Copy, Debug)]
pub struct Vec3<S>(PhantomData<S>);
/// Marker for `vec4<S>`.
#[derive(Clone, Copy, Debug)]
pub struct Vec4<S>(PhantomData<S>);
/// Marker for a fixed-size `array<T, N>`.
#[derive(Clone, Copy, Debug)]
pub struct Array<T, const N: u32>(PhantomData<T>);

/// A scalar marker type.
pub trait ScalarType: WgslType {
    const SCALAR: Scalar;
}
/// A numeric scalar or vector (arithmetic is defined on it).
pub trait Numeric: WgslType {
    type Elem: ScalarType;
}
/// A floating-point scalar or vector (the float builtins are defined on it).
pub trait FloatType: Numeric {}
/// An integer scalar or vector (bit operators are defined on it).
pub trait IntegerType: Numeric {}
/// A type whose values can be stored in storage or workgroup memory.
pub trait HostShareable: WgslType {}

macro_rules! scalar_marker {
    ($t:ty, $s:ident) => {
        impl WgslType for $t {
            fn ty() -> Ty {
                Ty::Scalar(Scalar::$s)
            }
        }
        impl ScalarType for $t {
            const SCALAR: Scalar = Scalar::$s;
        }
    };
}
scalar_marker!(f32, F32);
scalar_marker!(F16, F16);
scalar_marker!(i32, I32);
scalar_marker!(u32, U32);
scalar_marker!(bool, Bool);

macro_rules! vector_marker {
    ($v:ident, $n:literal) => {
        impl<S: ScalarType> WgslType for $v<S> {
            fn ty() -> Ty {
                Ty::Vector($n, S::SCALAR)
            }
        }
    };
}
vector_marker!(Vec2, 2);
vector_marker!(Vec3, 3);
vector_marker!(Vec4, 4);

impl<T: WgslType, const N: u32> WgslType for Array<T, N> {
    fn ty() -> Ty {
        Ty::Array(Box::new(T::ty()), N)
    }
}

/// Marker for a cooperative matrix `coop_matNxN<S, R>`: `N × N` elements of `S` (`F16` or
/// `f32`) held by a whole subgroup, in role `R` ([`CoopA`], [`CoopB`] or [`CoopC`]). WGSL spells
/// `N` = 8 and 16; which sizes and element types a device multiplies on its tensor cores, it
/// reports (hesper-exec's `Gpu::cooperative_matrix_configs`).
#[derive(Clone, Copy, Debug)]
pub struct CoopMat<S, R, const N: u32 = 16>(PhantomData<(S, R)>);

/// Role marker: the left operand `A` of `C + A·B`.
#[derive(Clone, Copy, Debug)]
pub struct CoopA;
/// Role marker: the right operand `B` of `C + A·B`.
#[derive(Clone, Copy, Debug)]
pub struct CoopB;
/// Role marker: the accumulator `C` of `C + A·B`.
#[derive(Clone, Copy, Debug)]
pub struct CoopC;

/// A cooperative-matrix role marker.
pub trait CoopRoleType: 'static {
    const ROLE: CoopRole;
}
impl CoopRoleType for CoopA {
    const ROLE: CoopRole = CoopRole::A;
}
impl CoopRoleType for CoopB {
    const ROLE: CoopRole = CoopRole::B;
}
impl CoopRoleType for CoopC {
    const ROLE: CoopRole = CoopRole::C;
}

/// The element types a cooperative matrix may hold: `F16` and `f32`.
pub trait CoopScalar: ScalarType {}
impl CoopScalar for F16 {}
impl CoopScalar for f32 {}

impl<S: CoopScalar, R: CoopRoleType, const N: u32> WgslType for CoopMat<S, R, N> {
    fn ty() -> Ty {
        Ty::CoopMatrix {
            // Only 8 and 16 are spellable; another `N` makes a type the builder reports.
            size: N.min(255) as u8,
            scalar: S::SCALAR,
            role: R::ROLE,
        }
    }
}

/// A cooperative-matrix marker type (for the builder's loads and stores).
pub trait CoopMatrixType: WgslType {
    type Scalar: CoopScalar;
    const SIZE: u32;
}
impl<S: CoopScalar, R: CoopRoleType, const N: u32> CoopMatrixType for CoopMat<S, R, N> {
    type Scalar = S;
    const SIZE: u32 = N;
}

macro_rules! numeric {
    ($($t:ty => $e:ty),*) => {$(
        impl Numeric for $t { type Elem = $e; }
        impl HostShareable for $t {}
    )*};
}
numeric!(f32 => f32, F16 => F16, i32 => i32, u32 => u32,
    Vec2<f32> => f32, Vec3<f32> => f32, Vec4<f32> => f32,
    Vec2<F16> => F16, Vec3<F16> => F16, Vec4<F16> => F16,
    Vec2<i32> => i32, Vec3<i32> => i32, Vec4<i32> => i32,
    Vec2<u32> => u32, Vec3<u32> => u32, Vec4<u32> => u32);
impl<T: HostShareable, const N: u32> HostShareable for Array<T, N> {}

macro_rules! marker_impls {
    ($tr:ident: $($t:ty),*) => {$( impl $tr for $t {} )*};
}
marker_impls!(FloatType: f32, F16, Vec2<f32>, Vec3<f32>, Vec4<f32>, Vec2<F16>, Vec3<F16>, Vec4<F16>);
marker_impls!(IntegerType: i32, u32, Vec2<i32>, Vec3<i32>, Vec4<i32>, Vec2<u32>, Vec3<u32>, Vec4<u32>);

/// How a kernel may use a storage buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Access {
    Read,
    ReadWrite,
}

impl Access {
    pub fn wgsl(self) -> &'static str {
        match self {
            Access::Read => "read",
            Access::ReadWrite => "read_write",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_follows_wgsl() {
        assert_eq!(<Vec3<f32>>::ty().align(), 16);
        assert_eq!(<Vec3<f32>>::ty().size(), 12);
        assert_eq!(<Vec3<f32>>::ty().stride(), 16);
        assert_eq!(<Array<Vec3<f32>, 4>>::ty().size(), 64);
        assert_eq!(<Array<F16, 3>>::ty().size(), 6);
        assert_eq!(<Vec2<F16>>::ty().to_string(), "vec2<f16>");
        assert_eq!(
            <Array<Vec4<u32>, 8>>::ty().to_string(),
            "array<vec4<u32>, 8>"
        );
        assert_eq!(
            <CoopMat<F16, CoopA>>::ty().to_string(),
            "coop_mat16x16<f16, A>"
        );
        assert_eq!(
            <CoopMat<f32, CoopC, 8>>::ty().to_string(),
            "coop_mat8x8<f32, C>"
        );
        assert!(!<CoopMat<F16, CoopB>>::ty().is_scalar_or_vector());
    }
}
