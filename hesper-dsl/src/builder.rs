//! `KernelBuilder`: Hesper's `ShaderM` in Rust. Declarations, statements and scopes are effects
//! recorded into the builder; expressions are values (see [`crate::expr`]).
//!
//! Builder misuse never panics and never reaches naga: it is recorded, and [`KernelBuilder::finish`]
//! returns the first error, naming the kernel and the item.

use std::cell::Cell;
use std::marker::PhantomData;
use std::panic::Location;
use std::sync::atomic::{AtomicU32, Ordering};

use crate::error::{DslError, ErrorKind, Origin};
use crate::expr::{AnyExpr, Expr, IntoExpr};
use crate::ir::{
    BinaryOp, Block, Builtin, ExprKind, Func, FunctionDef, LocalInfo, Major, Node, Placed, Stmt,
    VarId, VarKind, node,
};
use crate::kernel::{
    Binding, Features, Kernel, KernelKey, Limits, Param, ShapeValue, WorkgroupVar,
};
use crate::ty::{Access, CoopMatrixType, HostShareable, Numeric, Scalar, ScalarType, Ty, WgslType};
use crate::{check, names, wgsl};

/// The deepest nesting of blocks (`if`, loops) a kernel may have.
pub const MAX_NESTING: u32 = 48;

/// The largest private (`var`) array an invocation may hold.
pub const MAX_LOCAL_ARRAY_BYTES: u32 = 16 * 1024;

/// The most statements a kernel may have: naga's validation grows quadratically with them
/// (10 000 took 2.8 s, 100 000 took 164 s); unrolled code past this wants a loop.
pub const MAX_STATEMENTS: u32 = 20_000;

static NEXT_KERNEL: AtomicU32 = AtomicU32::new(1);

/// Builds one kernel. Get one from [`Kernel::build`] (or [`KernelBuilder::new`] and
/// [`KernelBuilder::finish`]).
pub struct KernelBuilder {
    key: KernelKey,
    tag: u32,
    pub(crate) bindings: Vec<Binding>,
    pub(crate) params: Vec<Param>,
    pub(crate) locals: Vec<LocalInfo>,
    scopes: Vec<Block>,
    /// Statements recorded so far (against [`MAX_STATEMENTS`]).
    statements: u32,
    loop_depth: u32,
    /// Inside a function body being built (where builtins and bare `return` are not allowed).
    in_function: bool,
    pub(crate) functions: Vec<FunctionDef>,
    errors: Vec<(ErrorKind, Origin)>,
    /// Inside a combinator: its statements are the author's call of it, not the combinator's
    /// own lines (see [`KernelBuilder::within`]).
    pinned: Option<Origin>,
    /// Where the author first asked for `workgroup_index()` (one workgroup per item), and
    /// whether the kernel indexes by invocation (`global_index`, `global_id`): see
    /// [`Kernel::indexes_by_workgroup`].
    pub(crate) workgroup_indexed: Cell<Option<Origin>>,
    pub(crate) invocation_indexed: Cell<bool>,
}

// ---------------------------------------------------------------- handles

/// A read-only storage buffer `array<T>`. It has no store: writing to it does not compile.
#[derive(Clone, Debug)]
pub struct ReadBuffer<T> {
    name: String,
    _t: PhantomData<fn() -> T>,
}

/// A read-write storage buffer `array<T>`.
#[derive(Clone, Debug)]
pub struct RwBuffer<T> {
    name: String,
    _t: PhantomData<fn() -> T>,
}

/// A `var<workgroup>` array of `len` elements.
#[derive(Clone, Debug)]
pub struct WorkgroupArray<T> {
    id: VarId,
    len: u32,
    _t: PhantomData<fn() -> T>,
}

/// A function-local `var` array of `len` elements (registers, when the compiler can).
#[derive(Clone, Debug)]
pub struct LocalArray<T> {
    id: VarId,
    len: u32,
    _t: PhantomData<fn() -> T>,
}

/// A function-local `var`.
#[derive(Clone, Debug)]
pub struct Var<T> {
    id: VarId,
    _t: PhantomData<fn() -> T>,
}

fn array_node(kind: ExprKind, elem: &Ty, len: u32) -> Node {
    node(kind, Ty::Array(Box::new(elem.clone()), len))
}

fn index_node(base: Node, index: Node) -> Node {
    let elem = match &base.ty {
        Ty::Array(e, _) => (**e).clone(),
        other => other.clone(),
    };
    node(ExprKind::Index(base, index), elem)
}

/// Something elements can be read from by index.
pub trait Indexable<T: WgslType> {
    #[doc(hidden)]
    fn base(&self) -> Node;
    /// `self[i]`
    fn at(&self, i: impl IntoExpr<u32>) -> Expr<T> {
        Expr::wrap(index_node(self.base(), i.into_expr().node))
    }
}

/// Something elements can be stored into by index ([`KernelBuilder::store`]).
pub trait Writable<T: WgslType>: Indexable<T> {}

impl<T: WgslType> Indexable<T> for ReadBuffer<T> {
    fn base(&self) -> Node {
        array_node(ExprKind::Global(self.name.clone()), &T::ty(), 0)
    }
}
impl<T: WgslType> Indexable<T> for RwBuffer<T> {
    fn base(&self) -> Node {
        array_node(ExprKind::Global(self.name.clone()), &T::ty(), 0)
    }
}
impl<T: WgslType> Indexable<T> for WorkgroupArray<T> {
    fn base(&self) -> Node {
        array_node(ExprKind::Local(self.id), &T::ty(), self.len)
    }
}
impl<T: WgslType> Indexable<T> for LocalArray<T> {
    fn base(&self) -> Node {
        array_node(ExprKind::Local(self.id), &T::ty(), self.len)
    }
}
impl<T: WgslType> Writable<T> for RwBuffer<T> {}
impl<T: WgslType> Writable<T> for WorkgroupArray<T> {}
impl<T: WgslType> Writable<T> for LocalArray<T> {}

/// Memory cooperative matrices load from and store to: storage buffers and workgroup arrays
/// (Vulkan allows no other; a function's `var` array is not one).
pub trait CoopMemory<T: WgslType>: Indexable<T> {}
impl<T: WgslType> CoopMemory<T> for ReadBuffer<T> {}
impl<T: WgslType> CoopMemory<T> for RwBuffer<T> {}
impl<T: WgslType> CoopMemory<T> for WorkgroupArray<T> {}

macro_rules! buffer_common {
    ($t:ident) => {
        impl<T: WgslType> $t<T> {
            /// The binding's name, as the executor binds it.
            pub fn name(&self) -> &str {
                &self.name
            }
            /// `arrayLength(&self)`: elements in the bound buffer.
            pub fn len(&self) -> Expr<u32> {
                Expr::wrap(node(ExprKind::ArrayLength(self.name.clone()), Ty::U32))
            }
        }
    };
}
buffer_common!(ReadBuffer);
buffer_common!(RwBuffer);

impl<T> WorkgroupArray<T> {
    pub fn len(&self) -> u32 {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}
impl<T> LocalArray<T> {
    pub fn len(&self) -> u32 {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl<T: WgslType> Var<T> {
    /// The variable's current value.
    pub fn get(&self) -> Expr<T> {
        Expr::wrap(node(ExprKind::Local(self.id), T::ty()))
    }
}
impl<T: WgslType> IntoExpr<T> for &Var<T> {
    fn into_expr(self) -> Expr<T> {
        self.get()
    }
}

/// A storage buffer declared through the untyped path.
#[derive(Clone, Debug)]
pub struct AnyBuffer {
    name: String,
    elem: Ty,
}

impl AnyBuffer {
    pub fn name(&self) -> &str {
        &self.name
    }
    pub fn elem(&self) -> &Ty {
        &self.elem
    }
    /// `self[i]`; `i` must be `u32` or `i32`.
    pub fn at(&self, i: &AnyExpr) -> Result<AnyExpr, String> {
        let base = AnyExpr {
            node: array_node(ExprKind::Global(self.name.clone()), &self.elem, 0),
        };
        if !matches!(i.ty(), Ty::Scalar(Scalar::U32 | Scalar::I32)) {
            return Err(format!(
                "index into `{}` must be u32 or i32, found {}",
                self.name,
                i.ty()
            ));
        }
        Ok(AnyExpr {
            node: index_node(base.node, i.node.clone()),
        })
    }
}

/// Types a shape parameter can have.
pub trait ShapeType: ScalarType + Copy {
    fn from_value(v: ShapeValue) -> Option<Self>;
    fn fallback() -> Self;
}
macro_rules! shape_type {
    ($t:ty, $v:ident, $fb:expr) => {
        impl ShapeType for $t {
            fn from_value(v: ShapeValue) -> Option<Self> {
                match v {
                    ShapeValue::$v(x) => Some(x),
                    _ => None,
                }
            }
            fn fallback() -> Self {
                $fb
            }
        }
    };
}
shape_type!(u32, U32, 1);
shape_type!(i32, I32, 1);
shape_type!(bool, Bool, false);
impl ShapeType for f32 {
    fn from_value(v: ShapeValue) -> Option<Self> {
        match v {
            ShapeValue::F32Bits(b) => Some(f32::from_bits(b)),
            _ => None,
        }
    }
    fn fallback() -> Self {
        1.0
    }
}

/// Types a runtime scalar can have (4-byte scalars: what uniforms and immediates hold portably).
pub trait ParamType: ScalarType {}
impl ParamType for f32 {}
impl ParamType for u32 {}
impl ParamType for i32 {}

/// Integer types a `for` loop can count with.
pub trait LoopCounter: ScalarType + Numeric + Sized {
    fn one() -> Expr<Self>;
}
impl LoopCounter for u32 {
    fn one() -> Expr<u32> {
        crate::lit(1u32)
    }
}
impl LoopCounter for i32 {
    fn one() -> Expr<i32> {
        crate::lit(1i32)
    }
}

// ---------------------------------------------------------------- the builder

impl Kernel {
    /// Build a kernel for `key`: `f` declares and records its body. Checked against the default
    /// [`Limits`]; see [`Kernel::build_with_limits`].
    #[track_caller]
    pub fn build(key: &KernelKey, f: impl FnOnce(&mut KernelBuilder)) -> Result<Kernel, DslError> {
        Kernel::build_with_limits(key, &Limits::default(), f)
    }

    #[track_caller]
    pub fn build_with_limits(
        key: &KernelKey,
        limits: &Limits,
        f: impl FnOnce(&mut KernelBuilder),
    ) -> Result<Kernel, DslError> {
        let mut k = KernelBuilder::new(key);
        f(&mut k);
        k.finish_with_limits(limits)
    }
}

impl KernelBuilder {
    #[track_caller]
    pub fn new(key: &KernelKey) -> Self {
        let mut b = KernelBuilder {
            key: key.clone(),
            tag: NEXT_KERNEL.fetch_add(1, Ordering::Relaxed),
            bindings: vec![],
            params: vec![],
            locals: vec![],
            scopes: vec![vec![]],
            statements: 0,
            loop_depth: 0,
            in_function: false,
            functions: vec![],
            errors: vec![],
            pinned: None,
            workgroup_indexed: Cell::new(None),
            invocation_indexed: Cell::new(false),
        };
        for (name, _) in key.shape_params() {
            if let Err(why) = names::check_user_name(name) {
                b.error(ErrorKind::InvalidName {
                    name: name.clone(),
                    why,
                });
            }
        }
        b
    }

    pub fn key(&self) -> &KernelKey {
        &self.key
    }

    /// Whether statements go inside a WGSL loop, or a function (which a loop may call).
    pub(crate) fn may_repeat(&self) -> bool {
        self.loop_depth > 0 || self.in_function
    }

    /// Invocations per workgroup (the product of the key's workgroup size).
    pub fn invocations(&self) -> u32 {
        self.key.invocations()
    }

    pub fn has_feature(&self, f: Features) -> bool {
        self.key.feature_set().contains(f)
    }

    /// Record a misuse; the first one is what `finish` reports.
    #[track_caller]
    pub fn error(&mut self, kind: ErrorKind) {
        let at = self.origin();
        self.errors.push((kind, at));
    }

    /// Where the statement being recorded comes from: the author's call (through
    /// `#[track_caller]` on every recording method), or the combinator call it is inside.
    #[track_caller]
    pub(crate) fn origin(&self) -> Origin {
        // Not in a closure: `Location::caller` sees through `#[track_caller]` functions only.
        let here = Origin::from_location(Location::caller());
        self.pinned.unwrap_or(here)
    }

    /// Record `f` as the DSL operation `op` called here: its statements and errors are placed
    /// at the author's call of `op` and name it (a barrier inside `workgroup_reduce` is reported
    /// as the author's `workgroup_reduce`). An author's closure the combinator runs is placed
    /// on its own lines again: run it through [`KernelBuilder::unpinned`].
    #[track_caller]
    pub(crate) fn within<R>(&mut self, op: &'static str, f: impl FnOnce(&mut Self) -> R) -> R {
        let here = Origin {
            op: Some(op),
            ..Origin::from_location(Location::caller())
        };
        let at = self.pinned.unwrap_or(here);
        let outer = self.pinned.replace(at);
        let r = f(self);
        self.pinned = outer;
        r
    }

    /// Run the author's code `f` from inside a combinator, placed on its own lines.
    pub(crate) fn unpinned<R>(&mut self, f: impl FnOnce(&mut Self) -> R) -> R {
        let outer = self.pinned.take();
        let r = f(self);
        self.pinned = outer;
        r
    }

    /// Finish with the default [`Limits`].
    pub fn finish(self) -> Result<Kernel, DslError> {
        self.finish_with_limits(&Limits::default())
    }

    /// Check everything, emit WGSL, validate it with naga, and check `limits`.
    pub fn finish_with_limits(mut self, limits: &Limits) -> Result<Kernel, DslError> {
        let name = self.key.name().to_string();
        if let Some((kind, at)) = self.errors.first() {
            return Err(DslError::new(&name, kind.clone()).at(Some(*at)));
        }
        // A shape value becomes a WGSL constant: NaN and ±∞ have no literal.
        for (shape, value) in self.key.shape_params() {
            if let crate::ShapeValue::F32Bits(bits) = value {
                let v = f32::from_bits(*bits);
                if !v.is_finite() {
                    return Err(DslError::new(
                        &name,
                        ErrorKind::TypeMismatch {
                            item: format!("shape value `{shape}`"),
                            expected: "a finite f32 (it becomes a WGSL constant)".into(),
                            found: v.to_string(),
                        },
                    ));
                }
            }
        }
        debug_assert_eq!(self.scopes.len(), 1, "scopes are balanced by construction");
        let mut body = self.scopes.pop().unwrap_or_default();
        let found = check::check(&self, &body).map_err(|e| e.into_error(&name))?;
        crate::uniform::check(&self, &body).map_err(|e| e.into_error(&name))?;
        if let Some(ty) = &found.coop_type {
            self.declare_coop_capability(&mut body, ty);
        }
        let mut kernel = Kernel {
            key: self.key,
            bindings: self.bindings,
            params: self.params,
            workgroup_vars: vec![],
            locals: self.locals,
            var_names: vec![],
            functions: self.functions,
            fn_names: vec![],
            global_names: vec![],
            builtins: found.builtins,
            helpers: found.helpers,
            body,
            uses_f16: found.uses_f16,
            uses_coop: found.coop_type.is_some(),
            coop_multiplies: found.coop_multiplies,
            indexes_by_workgroup: self
                .workgroup_indexed
                .get()
                .filter(|_| !self.invocation_indexed.get()),
            wgsl: String::new(),
        };
        let names = names::assign(&kernel);
        (kernel.var_names, kernel.fn_names, kernel.global_names) =
            (names.vars, names.fns, names.globals);
        kernel.workgroup_vars = kernel
            .locals
            .iter()
            .zip(&kernel.var_names)
            .filter(|(l, _)| l.kind == VarKind::Workgroup)
            .map(|(l, name)| WorkgroupVar {
                name: name.clone(),
                ty: l.ty.clone(),
            })
            .collect();
        // Limits first: naga rejects some (a zero workgroup size) with a less helpful message.
        kernel.check_limits(limits)?;
        kernel.wgsl = wgsl::emit(&kernel);
        crate::validate::validate(&kernel).map_err(|message| {
            DslError::new(
                &name,
                ErrorKind::Naga {
                    message,
                    wgsl: kernel.wgsl.clone(),
                },
            )
        })?;
        Ok(kernel)
    }

    /// naga declares SPIR-V's `VulkanMemoryModel` capability, which cooperative matrices need,
    /// only for a cooperative-matrix type a variable declares: a kernel whose matrices all live
    /// in `let`s fails in the driver. Such a kernel gets one `var` of the first type it uses.
    fn declare_coop_capability(&mut self, body: &mut Block, ty: &Ty) {
        let declared = self
            .locals
            .iter()
            .any(|l| l.kind == VarKind::Var && matches!(l.ty, Ty::CoopMatrix { .. }));
        if declared {
            return;
        }
        let id = self.new_local("coop_capability", ty.clone(), VarKind::Var);
        let zero = node(ExprKind::Construct(vec![]), ty.clone());
        let at = body.first().map(|s| s.at).unwrap_or_else(|| self.origin());
        body.insert(
            0,
            Placed {
                stmt: Stmt::Var {
                    id,
                    init: Some(zero),
                },
                at,
            },
        );
    }

    // ------------------------------------------------------------ shape parameters

    /// A compile-time shape parameter from the key, as a Rust value (comptime is plain Rust).
    /// Missing or of another type: an error at `finish`, and a fallback value meanwhile.
    #[track_caller]
    pub fn shape<T: ShapeType>(&mut self, name: &str) -> T {
        match self.key.get(name).and_then(T::from_value) {
            Some(v) => v,
            None => {
                self.error(ErrorKind::MissingShape {
                    name: name.into(),
                    expected: T::ty().to_string(),
                });
                T::fallback()
            }
        }
    }

    /// A shape parameter as a WGSL expression: a reference to its module-scope `const`.
    #[track_caller]
    pub fn shape_const<T: ShapeType>(&mut self, name: &str) -> Expr<T> {
        self.shape::<T>(name);
        Expr::wrap(node(ExprKind::Const(name.into()), T::ty()))
    }

    // ------------------------------------------------------------ declarations

    #[track_caller]
    fn declare_name(&mut self, name: &str) -> bool {
        if let Err(why) = names::check_user_name(name) {
            self.error(ErrorKind::InvalidName {
                name: name.into(),
                why,
            });
            return false;
        }
        let taken = self.bindings.iter().any(|b| b.name == name)
            || self.params.iter().any(|p| p.name == name)
            || self.key.get(name).is_some();
        if taken {
            self.error(ErrorKind::DuplicateName { name: name.into() });
        }
        !taken
    }

    #[track_caller]
    fn declare_binding(&mut self, name: &str, elem: Ty, access: Access) {
        if !elem.is_scalar_or_vector() && !matches!(elem, Ty::Array(_, n) if n > 0) {
            self.error(ErrorKind::TypeMismatch {
                item: format!("element type of binding `{name}`"),
                expected: "a scalar, vector or fixed-size array".into(),
                found: elem.to_string(),
            });
        }
        if elem.scalar() == Scalar::Bool {
            self.error(ErrorKind::TypeMismatch {
                item: format!("element type of binding `{name}`"),
                expected: "a host-shareable type (bool is not)".into(),
                found: elem.to_string(),
            });
        }
        if self.declare_name(name) {
            let binding = self.bindings.len() as u32;
            self.bindings.push(Binding {
                name: name.into(),
                binding,
                elem,
                access,
            });
        }
    }

    /// Declare a read-only storage buffer `array<T>` bound by `name` (binding order = declaration order).
    #[track_caller]
    pub fn storage<T: HostShareable>(&mut self, name: &str) -> ReadBuffer<T> {
        self.declare_binding(name, T::ty(), Access::Read);
        ReadBuffer {
            name: name.into(),
            _t: PhantomData,
        }
    }

    /// Declare a read-write storage buffer `array<T>` bound by `name`.
    #[track_caller]
    pub fn storage_rw<T: HostShareable>(&mut self, name: &str) -> RwBuffer<T> {
        self.declare_binding(name, T::ty(), Access::ReadWrite);
        RwBuffer {
            name: name.into(),
            _t: PhantomData,
        }
    }

    /// Declare a storage buffer through the untyped path.
    #[track_caller]
    pub fn storage_any(&mut self, name: &str, elem: Ty, access: Access) -> AnyBuffer {
        self.declare_binding(name, elem.clone(), access);
        AnyBuffer {
            name: name.into(),
            elem,
        }
    }

    /// Declare a runtime scalar (a per-step value: learning rate, step, token count). It travels in
    /// a uniform buffer, or as immediates when the key asks for `Features::IMMEDIATES`, and never
    /// changes the WGSL text.
    #[track_caller]
    pub fn param<T: ParamType>(&mut self, name: &str) -> Expr<T> {
        Expr::wrap(self.param_any(name, T::SCALAR).node)
    }

    /// Declare a runtime scalar through the untyped path (`f32`, `u32` or `i32`).
    #[track_caller]
    pub fn param_any(&mut self, name: &str, ty: Scalar) -> AnyExpr {
        if !matches!(ty, Scalar::F32 | Scalar::U32 | Scalar::I32) {
            self.error(ErrorKind::TypeMismatch {
                item: format!("runtime scalar `{name}`"),
                expected: "f32, u32 or i32".into(),
                found: ty.wgsl().into(),
            });
        } else if self.declare_name(name) {
            let offset = self.params.len() as u32 * 4;
            self.params.push(Param {
                name: name.into(),
                ty,
                offset,
            });
        }
        AnyExpr {
            node: node(ExprKind::Param(name.into()), Ty::Scalar(ty)),
        }
    }

    pub(crate) fn new_local(&mut self, hint: &str, ty: Ty, kind: VarKind) -> VarId {
        let id = VarId {
            kernel: self.tag,
            index: self.locals.len() as u32,
        };
        self.locals.push(LocalInfo {
            hint: hint.into(),
            ty,
            kind,
            library_named: false,
        });
        id
    }

    /// Declare a `var<workgroup>` array. Where in the body this is called does not matter: it
    /// is always emitted at module scope. Its name is made fresh from `hint`.
    #[track_caller]
    pub fn workgroup_array<T: HostShareable>(&mut self, hint: &str, len: u32) -> WorkgroupArray<T> {
        if len == 0 {
            self.error(ErrorKind::TypeMismatch {
                item: format!("workgroup array `{hint}`"),
                expected: "at least one element".into(),
                found: "0".into(),
            });
        }
        let id = self.new_local(
            hint,
            Ty::Array(Box::new(T::ty()), len.max(1)),
            VarKind::Workgroup,
        );
        WorkgroupArray {
            id,
            len,
            _t: PhantomData,
        }
    }

    // ------------------------------------------------------------ builtins

    /// Builtins need no builder borrow; a subgroup builtin in a kernel whose key lacks
    /// `Features::SUBGROUPS` is reported by `finish`.
    fn builtin<T: WgslType>(&self, b: Builtin) -> Expr<T> {
        Expr::wrap(node(ExprKind::Builtin(b), b.info().2))
    }
    /// `@builtin(global_invocation_id)`
    pub fn global_id(&self) -> Expr<crate::Vec3<u32>> {
        self.invocation_indexed.set(true);
        self.builtin(Builtin::GlobalInvocationId)
    }
    /// `@builtin(local_invocation_id)`
    pub fn local_id(&self) -> Expr<crate::Vec3<u32>> {
        self.builtin(Builtin::LocalInvocationId)
    }
    /// `@builtin(local_invocation_index)`
    pub fn local_index(&self) -> Expr<u32> {
        self.builtin(Builtin::LocalInvocationIndex)
    }
    /// `@builtin(workgroup_id)`
    pub fn workgroup_id(&self) -> Expr<crate::Vec3<u32>> {
        self.builtin(Builtin::WorkgroupId)
    }
    /// `@builtin(num_workgroups)`
    pub fn num_workgroups(&self) -> Expr<crate::Vec3<u32>> {
        self.builtin(Builtin::NumWorkgroups)
    }
    /// `@builtin(subgroup_size)` (needs `Features::SUBGROUPS`)
    pub fn subgroup_size(&self) -> Expr<u32> {
        self.builtin(Builtin::SubgroupSize)
    }
    /// `@builtin(subgroup_invocation_id)` (needs `Features::SUBGROUPS`)
    pub fn subgroup_invocation_id(&self) -> Expr<u32> {
        self.builtin(Builtin::SubgroupInvocationId)
    }
    /// `@builtin(subgroup_id)` (needs `Features::SUBGROUPS`)
    pub fn subgroup_id(&self) -> Expr<u32> {
        self.builtin(Builtin::SubgroupId)
    }
    /// `@builtin(num_subgroups)` (needs `Features::SUBGROUPS`)
    pub fn num_subgroups(&self) -> Expr<u32> {
        self.builtin(Builtin::NumSubgroups)
    }

    // ------------------------------------------------------------ subgroup operations

    #[track_caller]
    fn require_subgroups(&mut self, op: &str) {
        if !self.has_feature(Features::SUBGROUPS) {
            self.error(ErrorKind::SubgroupsNotRequested { op: op.into() });
        }
    }

    /// A subgroup operation, bound with `let` right where it is called (where the subgroup's
    /// invocations are converged), never moved into a later branch.
    #[track_caller]
    fn subgroup_op<T: Numeric>(&mut self, f: Func, args: Vec<Node>) -> Expr<T> {
        self.require_subgroups(f.wgsl());
        let tys: Vec<&Ty> = args.iter().map(|a| &a.ty).collect();
        let e = match crate::expr::call_type(f, &tys) {
            Ok(t) => node(ExprKind::Call(f, args), t),
            Err(m) => node(ExprKind::Error(m), T::ty()),
        };
        self.let_library_named("sg", Expr::wrap(e))
    }
    /// `subgroupAdd(e)`: the sum over the subgroup's active invocations.
    #[track_caller]
    pub fn subgroup_add<T: Numeric>(&mut self, e: impl IntoExpr<T>) -> Expr<T> {
        self.subgroup_op(Func::SubgroupAdd, vec![e.into_expr().node])
    }
    /// `subgroupMax(e)`
    #[track_caller]
    pub fn subgroup_max<T: Numeric>(&mut self, e: impl IntoExpr<T>) -> Expr<T> {
        self.subgroup_op(Func::SubgroupMax, vec![e.into_expr().node])
    }
    /// `subgroupMin(e)`
    #[track_caller]
    pub fn subgroup_min<T: Numeric>(&mut self, e: impl IntoExpr<T>) -> Expr<T> {
        self.subgroup_op(Func::SubgroupMin, vec![e.into_expr().node])
    }
    /// `subgroupShuffleXor(e, mask)`: the value of the invocation whose id is `own id ^ mask`.
    #[track_caller]
    pub fn subgroup_shuffle_xor<T: Numeric>(
        &mut self,
        e: impl IntoExpr<T>,
        mask: impl IntoExpr<u32>,
    ) -> Expr<T> {
        let args = vec![e.into_expr().node, mask.into_expr().node];
        self.subgroup_op(Func::SubgroupShuffleXor, args)
    }
    /// `subgroupBroadcast(e, lane)`: invocation `lane`'s value (`lane` is a constant).
    #[track_caller]
    pub fn subgroup_broadcast<T: Numeric>(&mut self, e: impl IntoExpr<T>, lane: u32) -> Expr<T> {
        let args = vec![e.into_expr().node, crate::lit(lane).node];
        self.subgroup_op(Func::SubgroupBroadcast, args)
    }

    // ------------------------------------------------------------ cooperative matrices

    #[track_caller]
    fn require_coop(&mut self, op: &str) {
        if !self.has_feature(Features::COOPERATIVE_MATRIX) {
            self.error(ErrorKind::CoopNotRequested { op: op.into() });
        }
    }

    /// `coopLoadT<M>(&array[index], stride)` (`Major::Row`) or `coopLoad<M>(…)`
    /// (`Major::Column`): the `N × N` matrix whose first element is `array[index]`, with `stride`
    /// elements of `array` between consecutive rows (columns). `array` holds the matrix's
    /// element type, alone or in vectors: through an `array<vec4<f16>>` the index and the stride
    /// count vec4s. Subgroup-wide, like every cooperative operation: every invocation of the
    /// subgroup must reach it together, with the same index and stride. Bound with `let` where
    /// it is called.
    ///
    /// f16 tiles through a `vec4<u32>` view (which naga passes and the driver fails silently)
    /// do not compile:
    ///
    /// ```compile_fail
    /// use hesper_dsl::prelude::*;
    /// Kernel::build(&KernelKey::new("view").features(Features::COOPERATIVE_MATRIX), |k| {
    ///     let packed = k.storage::<Vec4<u32>>("packed");
    ///     k.coop_load::<CoopMat<F16, CoopA>, _>(&packed, 0u32, 2u32, Major::Row);
    /// });
    /// ```
    #[track_caller]
    pub fn coop_load<M: CoopMatrixType, T: Numeric<Elem = M::Scalar>>(
        &mut self,
        array: &impl CoopMemory<T>,
        index: impl IntoExpr<u32>,
        stride: impl IntoExpr<u32>,
        major: Major,
    ) -> Expr<M> {
        self.require_coop(major.wgsl().0);
        let load = node(
            ExprKind::CoopLoad {
                place: array.at(index).node,
                stride: stride.into_expr().node,
                major,
            },
            M::ty(),
        );
        self.let_library_named("tile", Expr::<M>::wrap(load))
    }

    /// `coopStoreT(value, &array[index], stride);` (`Major::Row`) or `coopStore(…)`
    /// (`Major::Column`): the inverse of [`KernelBuilder::coop_load`], into a read-write storage
    /// buffer or a workgroup array of the matrix's element type.
    #[track_caller]
    pub fn coop_store<M: CoopMatrixType, T: Numeric<Elem = M::Scalar>, A>(
        &mut self,
        array: &A,
        index: impl IntoExpr<u32>,
        stride: impl IntoExpr<u32>,
        major: Major,
        value: impl IntoExpr<M>,
    ) where
        A: CoopMemory<T> + Writable<T>,
    {
        self.require_coop(major.wgsl().1);
        // naga's SPIR-V writer does not emit expressions computed inside a cooperative store's
        // arguments (it panics: "Expression [n] is not cached"): name them first.
        let value = self.named("tile", value.into_expr());
        let index = self.named("at", index.into_expr());
        let stride = self.named("stride", stride.into_expr());
        self.push(Stmt::CoopStore {
            value: value.node,
            place: array.at(index).node,
            stride: stride.node,
            major,
        });
    }

    /// `e` itself when it is a name or a literal, else bound to a fresh `let`.
    #[track_caller]
    fn named<T: WgslType>(&mut self, hint: &str, e: Expr<T>) -> Expr<T> {
        match e.node.kind {
            ExprKind::Local(_)
            | ExprKind::Literal(_)
            | ExprKind::Const(_)
            | ExprKind::Builtin(_) => e,
            _ => self.let_library_named(hint, e),
        }
    }

    // ------------------------------------------------------------ statements

    #[track_caller]
    fn push(&mut self, stmt: Stmt) {
        self.statements += 1;
        if self.statements == MAX_STATEMENTS + 1 {
            self.error(ErrorKind::TooManyStatements {
                limit: MAX_STATEMENTS,
            });
        }
        let depth = stmt
            .expressions()
            .iter()
            .map(|n| n.depth)
            .max()
            .unwrap_or(0);
        if depth > crate::ir::MAX_EXPRESSION_DEPTH {
            self.error(ErrorKind::ExpressionTooDeep {
                depth,
                limit: crate::ir::MAX_EXPRESSION_DEPTH,
            });
        }
        let at = self.origin();
        self.scopes
            .last_mut()
            .expect("the root scope is never popped before finish")
            .push(Placed { stmt, at });
    }

    /// Record a function body in a scope of its own, outside any loop.
    pub(crate) fn function_body(&mut self, f: impl FnOnce(&mut Self) -> Node) -> (Block, Node) {
        let depth = std::mem::replace(&mut self.loop_depth, 0);
        let inside = std::mem::replace(&mut self.in_function, true);
        self.scopes.push(vec![]);
        let value = f(self);
        let body = self.scopes.pop().expect("pushed just above");
        self.loop_depth = depth;
        self.in_function = inside;
        (body, value)
    }

    #[track_caller]
    fn scoped(&mut self, f: impl FnOnce(&mut Self)) -> Block {
        // The root scope and each function body's count too: blocks nested past the limit
        // would recurse that deep in every pass (and naga has its own, lower, limits).
        if self.scopes.len() as u32 == MAX_NESTING + 1 {
            self.error(ErrorKind::NestingTooDeep { limit: MAX_NESTING });
        }
        self.scopes.push(vec![]);
        f(self);
        self.scopes.pop().expect("pushed just above")
    }

    /// `let <fresh name from hint> = value;` — bind a value once, use it many times.
    ///
    /// A value the library has bound already under a name of its own (`global_index()`'s
    /// `index`, `workgroup_reduce`'s `sum`) is renamed instead, so `let_("i", k.global_index())`
    /// emits `let i = …`, not `let i = index;`.
    #[track_caller]
    pub fn let_<T: WgslType>(&mut self, hint: &str, value: impl IntoExpr<T>) -> Expr<T> {
        Expr::wrap(self.let_any(hint, &value.into_expr().erase()).node)
    }

    /// A `let` whose name the library chose: the author's `let_` of it renames it.
    #[track_caller]
    pub(crate) fn let_library_named<T: WgslType>(
        &mut self,
        hint: &str,
        value: impl IntoExpr<T>,
    ) -> Expr<T> {
        let bound = self.let_(hint, value);
        if let ExprKind::Local(id) = bound.node.kind
            && let Some(local) = self.locals.get_mut(id.index as usize)
        {
            local.library_named = true;
        }
        bound
    }

    /// `let` through the untyped path.
    #[track_caller]
    pub fn let_any(&mut self, hint: &str, value: &AnyExpr) -> AnyExpr {
        if let ExprKind::Local(id) = value.node.kind
            && id.kernel == self.tag
            && let Some(local) = self.locals.get_mut(id.index as usize)
            && local.kind == VarKind::Let
            && local.library_named
        {
            local.hint = hint.into();
            local.library_named = false;
            return value.clone();
        }
        let ty = value.ty().clone();
        let id = self.new_local(hint, ty.clone(), VarKind::Let);
        self.push(Stmt::Let {
            id,
            value: value.node.clone(),
        });
        AnyExpr {
            node: node(ExprKind::Local(id), ty),
        }
    }

    /// `var <fresh name>: T = init;`
    #[track_caller]
    pub fn var<T: WgslType>(&mut self, hint: &str, init: impl IntoExpr<T>) -> Var<T> {
        let id = self.new_local(hint, T::ty(), VarKind::Var);
        self.push(Stmt::Var {
            id,
            init: Some(init.into_expr().node),
        });
        Var {
            id,
            _t: PhantomData,
        }
    }

    /// `var <fresh name>: array<T, len>;` (zero-initialised, as WGSL does).
    #[track_caller]
    pub fn var_array<T: WgslType>(&mut self, hint: &str, len: u32) -> LocalArray<T> {
        let id = self.new_local(hint, Ty::Array(Box::new(T::ty()), len.max(1)), VarKind::Var);
        if len == 0 {
            self.error(ErrorKind::TypeMismatch {
                item: format!("local array `{hint}`"),
                expected: "at least one element".into(),
                found: "0".into(),
            });
        }
        if T::ty().contains_coop_matrix() {
            self.error(ErrorKind::TypeMismatch {
                item: format!("local array `{hint}`"),
                expected: "an element type held in memory (hold cooperative matrices in `var`s)"
                    .into(),
                found: T::ty().to_string(),
            });
        }
        let bytes = T::ty().stride().saturating_mul(len);
        if bytes > MAX_LOCAL_ARRAY_BYTES {
            // Every invocation holds its own copy: 64 Ki f32 took the driver minutes to compile,
            // 64 Mi exhausted the host's memory.
            self.error(ErrorKind::TypeMismatch {
                item: format!("local array `{hint}`"),
                expected: format!(
                    "at most {MAX_LOCAL_ARRAY_BYTES} bytes per invocation (use workgroup or storage memory)"
                ),
                found: format!("{len} elements, {bytes} bytes"),
            });
        }
        self.push(Stmt::Var { id, init: None });
        LocalArray {
            id,
            len,
            _t: PhantomData,
        }
    }

    /// `var = value;`
    #[track_caller]
    pub fn assign<T: WgslType>(&mut self, var: &Var<T>, value: impl IntoExpr<T>) {
        self.push(Stmt::Assign {
            target: var.get().node,
            op: None,
            value: value.into_expr().node,
        });
    }

    /// `var op= value;` for an arithmetic or bit operator.
    #[track_caller]
    pub fn update<T: WgslType>(&mut self, var: &Var<T>, op: BinaryOp, value: impl IntoExpr<T>) {
        self.assign_op_any(&var.get().erase(), Some(op), &value.into_expr().erase());
    }

    /// `var += value;`
    #[track_caller]
    pub fn add_assign<T: Numeric>(&mut self, var: &Var<T>, value: impl IntoExpr<T>) {
        self.update(var, BinaryOp::Add, value);
    }

    /// `target[index] = value;`
    #[track_caller]
    pub fn store<T: WgslType>(
        &mut self,
        target: &impl Writable<T>,
        index: impl IntoExpr<u32>,
        value: impl IntoExpr<T>,
    ) {
        self.push(Stmt::Assign {
            target: target.at(index).node,
            op: None,
            value: value.into_expr().node,
        });
    }

    /// `target[index] op= value;`
    #[track_caller]
    pub fn store_op<T: WgslType>(
        &mut self,
        target: &impl Writable<T>,
        index: impl IntoExpr<u32>,
        op: BinaryOp,
        value: impl IntoExpr<T>,
    ) {
        self.assign_op_any(
            &target.at(index).erase(),
            Some(op),
            &value.into_expr().erase(),
        );
    }

    /// `name[index] = value;` through the untyped path: unknown names, read-only buffers and type
    /// mismatches are errors.
    #[track_caller]
    pub fn store_any(&mut self, name: &str, index: &AnyExpr, value: &AnyExpr) {
        let Some(b) = self.bindings.iter().find(|b| b.name == name).cloned() else {
            self.error(ErrorKind::OutOfScope { name: name.into() });
            return;
        };
        if b.access == Access::Read {
            self.error(ErrorKind::StoreToReadOnly {
                binding: name.into(),
            });
            return;
        }
        let buf = AnyBuffer {
            name: b.name,
            elem: b.elem,
        };
        match buf.at(index) {
            Ok(place) => self.assign_op_any(&place, None, value),
            Err(message) => self.error(ErrorKind::InvalidExpression { message }),
        }
    }

    /// `target op= value;` through the untyped path; `target` must be a `var`, a writable buffer
    /// or array element, or one component of a `var` vector (checked at `finish`).
    #[track_caller]
    pub fn assign_op_any(&mut self, target: &AnyExpr, op: Option<BinaryOp>, value: &AnyExpr) {
        if let Some(op) = op
            && !op.is_compound()
        {
            self.error(ErrorKind::InvalidExpression {
                message: format!("`{}=` is not a WGSL compound assignment", op.wgsl()),
            });
            return;
        }
        let result = match op {
            Some(op) => crate::expr::binary_type(op, target.ty(), value.ty()),
            None => Ok(value.ty().clone()),
        };
        match result {
            Ok(t) if t == *target.ty() => self.push(Stmt::Assign {
                target: target.node.clone(),
                op,
                value: value.node.clone(),
            }),
            Ok(t) => self.error(ErrorKind::TypeMismatch {
                item: "assignment".into(),
                expected: target.ty().to_string(),
                found: t.to_string(),
            }),
            Err(message) => self.error(ErrorKind::InvalidExpression { message }),
        }
    }

    /// `if cond { then }`
    #[track_caller]
    pub fn if_(&mut self, cond: impl IntoExpr<bool>, then: impl FnOnce(&mut Self)) {
        let then = self.scoped(then);
        self.push(Stmt::If {
            cond: cond.into_expr().node,
            then,
            otherwise: vec![],
        });
    }

    /// `if cond { then } else { otherwise }`
    #[track_caller]
    pub fn if_else(
        &mut self,
        cond: impl IntoExpr<bool>,
        then: impl FnOnce(&mut Self),
        otherwise: impl FnOnce(&mut Self),
    ) {
        let then = self.scoped(then);
        let otherwise = self.scoped(otherwise);
        self.push(Stmt::If {
            cond: cond.into_expr().node,
            then,
            otherwise,
        });
    }

    /// `if` through the untyped path (`cond` must be `bool`).
    #[track_caller]
    pub fn if_any(
        &mut self,
        cond: &AnyExpr,
        then: impl FnOnce(&mut Self),
        otherwise: impl FnOnce(&mut Self),
    ) {
        if *cond.ty() != Ty::BOOL {
            self.error(ErrorKind::TypeMismatch {
                item: "if condition".into(),
                expected: "bool".into(),
                found: cond.ty().to_string(),
            });
        }
        let then = self.scoped(then);
        let otherwise = self.scoped(otherwise);
        self.push(Stmt::If {
            cond: cond.node.clone(),
            then,
            otherwise,
        });
    }

    /// A general runtime loop: `for (var c = init; cond(c); c op= step) { body(c) }`.
    #[track_caller]
    pub fn for_loop<T: LoopCounter>(
        &mut self,
        hint: &str,
        init: impl IntoExpr<T>,
        cond: impl FnOnce(&Expr<T>) -> Expr<bool>,
        step_op: BinaryOp,
        step: impl IntoExpr<T>,
        body: impl FnOnce(&mut Self, Expr<T>),
    ) {
        let counter = self.new_local(hint, T::ty(), VarKind::LoopCounter);
        let c = Expr::<T>::wrap(node(ExprKind::Local(counter), T::ty()));
        let init = init.into_expr().node;
        let cond = cond(&c).node;
        let step = step.into_expr().node;
        if leaves_unchanged(step_op, &step) {
            self.error(ErrorKind::EndlessLoop {
                counter: hint.to_string(),
                step: format!("{}= {}", step_op.wgsl(), literal_text(&step)),
            });
        }
        self.loop_depth += 1;
        let body = self.scoped(|k| body(k, c));
        self.loop_depth -= 1;
        self.push(Stmt::For {
            counter,
            init,
            cond,
            step_op,
            step,
            body,
        });
    }

    /// `for (var i = start; i < end; i += step) { body(i) }`
    #[track_caller]
    pub fn for_step<T: LoopCounter>(
        &mut self,
        hint: &str,
        start: impl IntoExpr<T>,
        end: impl IntoExpr<T>,
        step: impl IntoExpr<T>,
        body: impl FnOnce(&mut Self, Expr<T>),
    ) {
        let end = end.into_expr();
        self.for_loop(hint, start, |i| i.lt(end), BinaryOp::Add, step, body);
    }

    /// `for (var i = start; i < end; i += 1) { body(i) }`
    #[track_caller]
    pub fn for_range<T: LoopCounter>(
        &mut self,
        hint: &str,
        start: impl IntoExpr<T>,
        end: impl IntoExpr<T>,
        body: impl FnOnce(&mut Self, Expr<T>),
    ) {
        self.for_step(hint, start, end, T::one(), body);
    }

    /// A compile-time unrolled loop: `body` runs once per value, in Rust, and each run records
    /// its own statements (comptime is plain Rust; this only reads better).
    #[track_caller]
    pub fn unroll(
        &mut self,
        range: impl IntoIterator<Item = u32>,
        mut body: impl FnMut(&mut Self, u32),
    ) {
        for i in range {
            body(self, i);
        }
    }

    /// `while cond { body }`
    #[track_caller]
    pub fn while_(&mut self, cond: impl IntoExpr<bool>, body: impl FnOnce(&mut Self)) {
        let cond = cond.into_expr().node;
        self.loop_depth += 1;
        let body = self.scoped(body);
        self.loop_depth -= 1;
        self.push(Stmt::While { cond, body });
    }

    /// `loop { body }` — leave it with [`KernelBuilder::break_`] or [`KernelBuilder::break_if`].
    #[track_caller]
    pub fn loop_(&mut self, body: impl FnOnce(&mut Self)) {
        self.loop_depth += 1;
        let body = self.scoped(body);
        self.loop_depth -= 1;
        self.push(Stmt::Loop { body });
    }

    #[track_caller]
    fn in_loop(&mut self, statement: &str) -> bool {
        if self.loop_depth == 0 {
            self.error(ErrorKind::NotInLoop {
                statement: statement.into(),
            });
        }
        self.loop_depth > 0
    }

    /// `break;`
    #[track_caller]
    pub fn break_(&mut self) {
        if self.in_loop("break") {
            self.push(Stmt::Break);
        }
    }

    /// `if cond { break; }`
    #[track_caller]
    pub fn break_if(&mut self, cond: impl IntoExpr<bool>) {
        if self.in_loop("break") {
            let then = vec![Placed {
                stmt: Stmt::Break,
                at: self.origin(),
            }];
            self.push(Stmt::If {
                cond: cond.into_expr().node,
                then,
                otherwise: vec![],
            });
        }
    }

    /// `continue;`
    #[track_caller]
    pub fn continue_(&mut self) {
        if self.in_loop("continue") {
            self.push(Stmt::Continue);
        }
    }

    /// `return;` — leave the kernel for this invocation. Every later barrier must still be
    /// reached by all invocations of the workgroup, so return only where no barrier follows.
    #[track_caller]
    pub fn return_(&mut self) {
        if self.in_function {
            self.error(ErrorKind::InvalidExpression {
                message: "`return;` inside a WGSL function: a function returns its body's value"
                    .into(),
            });
            return;
        }
        self.push(Stmt::Return);
    }

    /// `workgroupBarrier();` — call it where every invocation of the workgroup arrives.
    #[track_caller]
    pub fn workgroup_barrier(&mut self) {
        self.push(Stmt::WorkgroupBarrier);
    }

    /// `let <hint> = workgroupUniformLoad(&array[index]);`: a workgroup barrier, the element
    /// read, another barrier. Every invocation gets the same value, and it counts as uniform: a
    /// branch on it may hold barriers, subgroup and cooperative-matrix operations (a decision
    /// one invocation wrote for the whole workgroup). Like a barrier it must be reached by the
    /// whole workgroup, and `index` must be uniform; `finish` reports either as a `DslError`.
    ///
    /// ```
    /// use hesper_dsl::prelude::*;
    ///
    /// let key = KernelKey::new("halve_if_any_over").workgroup_size(64);
    /// let kernel = Kernel::build(&key, |k| {
    ///     let x = k.storage_rw::<f32>("x");
    ///     let over = k.workgroup_array::<u32>("over", 1);
    ///     let i = k.global_index();
    ///     let i = k.let_("i", i);
    ///     k.if_(k.local_index().eq(0u32), |k| k.store(&over, 0u32, 0u32));
    ///     k.workgroup_barrier();
    ///     // Invocation 0 decides for the workgroup (every invocation writing would race).
    ///     k.if_(k.local_index().eq(0u32), |k| {
    ///         let any = select(x.at(&i).gt(1.0f32), lit(1u32), lit(0u32));
    ///         k.store(&over, 0u32, any);
    ///     });
    ///     let decided = k.workgroup_uniform_load("decided", &over, 0u32);
    ///     k.if_(decided.eq(1u32), |k| {
    ///         k.workgroup_barrier(); // allowed: every invocation takes this branch or none
    ///         k.store(&x, &i, x.at(&i) * 0.5f32);
    ///     });
    /// })
    /// .unwrap();
    /// assert!(kernel.wgsl().contains("let decided = workgroupUniformLoad(&over[0u]);"));
    /// ```
    #[track_caller]
    pub fn workgroup_uniform_load<T: WgslType>(
        &mut self,
        hint: &str,
        array: &WorkgroupArray<T>,
        index: impl IntoExpr<u32>,
    ) -> Expr<T> {
        let place = array.at(index).node;
        let id = self.new_local(hint, T::ty(), VarKind::Let);
        // An author's `let` of it takes the author's name rather than copying it.
        if let Some(local) = self.locals.get_mut(id.index as usize) {
            local.library_named = true;
        }
        self.push(Stmt::UniformLoad { id, place });
        Expr::wrap(node(ExprKind::Local(id), T::ty()))
    }

    /// `storageBarrier();`
    #[track_caller]
    pub fn storage_barrier(&mut self) {
        self.push(Stmt::StorageBarrier);
    }

    /// A `// comment` line in the emitted WGSL.
    #[track_caller]
    pub fn comment(&mut self, text: &str) {
        // Every WGSL line break, not only Rust's `lines()`: text after a U+2028 would be code.
        let text = text.strip_suffix('\n').unwrap_or(text);
        for line in text.split(crate::wgsl::is_line_break) {
            self.push(Stmt::Comment(line.to_string()));
        }
    }

    /// Print `value` with `label` and the invocation's id when the kernel runs on the
    /// interpreter ([`crate::interp`]); on a GPU nothing: the WGSL (and the key) are the kernel's
    /// without it.
    #[track_caller]
    pub fn debug<T: WgslType>(&mut self, label: &str, value: impl IntoExpr<T>) {
        self.push(Stmt::Debug {
            label: label.to_string(),
            value: value.into_expr().node,
        });
    }

    pub(crate) fn tag(&self) -> u32 {
        self.tag
    }
}

/// What the final walk over the body found.
pub(crate) struct Found {
    pub builtins: Vec<Builtin>,
    pub helpers: Vec<Func>,
    pub uses_f16: bool,
    /// The first cooperative-matrix type in the body, if any.
    pub coop_type: Option<Ty>,
    pub coop_multiplies: Vec<crate::kernel::CoopMultiply>,
}

/// Whether `c op= step` leaves a loop counter as it was, for a literal `step` (`+= 0`, `-= 0`,
/// `*= 1`, `/= 1`, a shift by 0): such a loop never ends.
fn leaves_unchanged(op: BinaryOp, step: &Node) -> bool {
    let value = match step.kind {
        ExprKind::Literal(crate::Literal::U32(v)) => v as i64,
        ExprKind::Literal(crate::Literal::I32(v)) => v as i64,
        _ => return false,
    };
    match op {
        BinaryOp::Add | BinaryOp::Sub | BinaryOp::Shl | BinaryOp::Shr => value == 0,
        BinaryOp::Mul | BinaryOp::Div => value == 1,
        _ => false,
    }
}

/// A literal step as the author wrote it, for the error.
fn literal_text(step: &Node) -> String {
    match step.kind {
        ExprKind::Literal(crate::Literal::U32(v)) => v.to_string(),
        ExprKind::Literal(crate::Literal::I32(v)) => v.to_string(),
        _ => "?".into(),
    }
}
