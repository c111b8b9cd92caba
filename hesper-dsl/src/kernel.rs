//! `KernelKey` (what specialises a kernel's text) and `Kernel` (the finished, validated IR and
//! its WGSL).

use std::fmt;

use crate::ir::{Block, FunctionDef, LocalInfo};
use crate::ir::{Builtin, Func};
use crate::ty::{Access, Scalar, Ty};

/// Device features a kernel may use. They change the emitted text, so they are part of the key.
#[derive(Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Features(u8);

impl Features {
    pub const NONE: Features = Features(0);
    /// Subgroup builtins and operations (wgpu `Features::SUBGROUP`).
    pub const SUBGROUPS: Features = Features(1);
    /// Runtime scalars as immediates (`var<immediate>`, wgpu `Features::IMMEDIATES`) rather than a
    /// uniform buffer.
    pub const IMMEDIATES: Features = Features(2);
    /// Cooperative matrices: tiles held by a whole subgroup and multiplied on the tensor cores
    /// (wgpu `Features::EXPERIMENTAL_COOPERATIVE_MATRIX`, WGSL `enable wgpu_cooperative_matrix;`).
    pub const COOPERATIVE_MATRIX: Features = Features(4);

    pub fn contains(self, other: Features) -> bool {
        self.0 & other.0 == other.0
    }
}

impl std::ops::BitOr for Features {
    type Output = Features;
    fn bitor(self, rhs: Features) -> Features {
        Features(self.0 | rhs.0)
    }
}

impl std::ops::BitAnd for Features {
    type Output = Features;
    fn bitand(self, rhs: Features) -> Features {
        Features(self.0 & rhs.0)
    }
}

/// `Features(subgroups+immediates)`, `Features(none)`: names, not bits.
impl fmt::Debug for Features {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self == Features::NONE {
            true => f.write_str("Features(none)"),
            false => write!(f, "Features({self})"),
        }
    }
}

impl fmt::Display for Features {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut names = vec![];
        if self.contains(Features::SUBGROUPS) {
            names.push("subgroups");
        }
        if self.contains(Features::IMMEDIATES) {
            names.push("immediates");
        }
        if self.contains(Features::COOPERATIVE_MATRIX) {
            names.push("cooperative_matrix");
        }
        f.write_str(&names.join("+"))
    }
}

/// A compile-time shape parameter's value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ShapeValue {
    U32(u32),
    I32(i32),
    /// Held as bits so that keys can be hashed and compared exactly.
    F32Bits(u32),
    Bool(bool),
}

impl ShapeValue {
    pub fn ty(&self) -> Ty {
        Ty::Scalar(match self {
            ShapeValue::U32(_) => Scalar::U32,
            ShapeValue::I32(_) => Scalar::I32,
            ShapeValue::F32Bits(_) => Scalar::F32,
            ShapeValue::Bool(_) => Scalar::Bool,
        })
    }
}

impl fmt::Display for ShapeValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ShapeValue::U32(v) => write!(f, "{v}"),
            ShapeValue::I32(v) => write!(f, "{v}"),
            ShapeValue::F32Bits(b) => write!(f, "{:?}", f32::from_bits(*b)),
            ShapeValue::Bool(v) => write!(f, "{v}"),
        }
    }
}

impl From<u32> for ShapeValue {
    fn from(v: u32) -> Self {
        ShapeValue::U32(v)
    }
}
impl From<i32> for ShapeValue {
    fn from(v: i32) -> Self {
        ShapeValue::I32(v)
    }
}
impl From<f32> for ShapeValue {
    fn from(v: f32) -> Self {
        ShapeValue::F32Bits(v.to_bits())
    }
}
impl From<bool> for ShapeValue {
    fn from(v: bool) -> Self {
        ShapeValue::Bool(v)
    }
}

/// Everything that changes a kernel's WGSL text: its name, shape parameters, the features it
/// uses, its workgroup size, and whether it is compiled without bounds checks. The same key
/// always emits byte-identical WGSL, so a pipeline cache keyed by it is sound — provided the
/// kernel's builder function reads its compile-time values from the key (through
/// [`KernelBuilder::shape`](crate::KernelBuilder::shape) and friends) and nowhere else.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct KernelKey {
    name: String,
    shape: Vec<(String, ShapeValue)>,
    features: Features,
    workgroup_size: [u32; 3],
    assume_in_bounds: bool,
}

impl KernelKey {
    /// A key with no shape parameters, no features and a 64×1×1 workgroup.
    pub fn new(name: impl Into<String>) -> Self {
        KernelKey {
            name: name.into(),
            shape: vec![],
            features: Features::NONE,
            workgroup_size: [64, 1, 1],
            assume_in_bounds: false,
        }
    }
    /// The kernel's author vouches that every index it computes is in range: into its
    /// workgroup and local arrays for every launch, and into its storage buffers for every
    /// launch whose buffers its `execute_*` function has checked. The executor then compiles it
    /// without wgpu's runtime bounds checks (a clamp of every dynamic index), which made the
    /// GEMM, softmax and LoRA kernels 3–15% faster on the H200 (BENCHMARKS.md). Where the
    /// driver bounds buffer accesses itself (Vulkan's robust buffer access, which wgpu turns
    /// on) a wrong buffer index still reads zero or writes nothing; a wrong workgroup or local
    /// index is undefined behaviour. Loops stay bounded. `GpuOptions::force_bounds_checks` in
    /// hesper-exec compiles such kernels with the checks anyway, to debug one.
    pub fn assume_in_bounds(mut self) -> Self {
        self.assume_in_bounds = true;
        self
    }
    /// Set (or replace) a shape parameter. Parameters keep the order they were first set in.
    pub fn shape(mut self, name: impl Into<String>, value: impl Into<ShapeValue>) -> Self {
        let (name, value) = (name.into(), value.into());
        match self.shape.iter_mut().find(|(n, _)| *n == name) {
            Some(slot) => slot.1 = value,
            None => self.shape.push((name, value)),
        }
        self
    }
    pub fn features(mut self, features: Features) -> Self {
        self.features = features;
        self
    }
    /// A 1-D workgroup of `x` invocations.
    pub fn workgroup_size(self, x: u32) -> Self {
        self.workgroup_size_3d([x, 1, 1])
    }
    pub fn workgroup_size_3d(mut self, size: [u32; 3]) -> Self {
        self.workgroup_size = size;
        self
    }

    pub fn name(&self) -> &str {
        &self.name
    }
    pub fn shape_params(&self) -> &[(String, ShapeValue)] {
        &self.shape
    }
    pub fn get(&self, name: &str) -> Option<ShapeValue> {
        self.shape.iter().find(|(n, _)| n == name).map(|(_, v)| *v)
    }
    pub fn feature_set(&self) -> Features {
        self.features
    }
    pub fn wg_size(&self) -> [u32; 3] {
        self.workgroup_size
    }
    /// Invocations per workgroup.
    pub fn invocations(&self) -> u32 {
        // Saturating: a size past u32 is refused by the limits, not a panic.
        self.workgroup_size
            .iter()
            .fold(1u32, |n, d| n.saturating_mul(*d))
    }
    /// Whether the kernel may be compiled without bounds checks ([`KernelKey::assume_in_bounds`]).
    pub fn assumes_in_bounds(&self) -> bool {
        self.assume_in_bounds
    }
}

impl fmt::Display for KernelKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.name)?;
        for (n, v) in &self.shape {
            write!(f, " {n}={v}")?;
        }
        let [x, y, z] = self.workgroup_size;
        write!(f, " wg={x}x{y}x{z}")?;
        if self.features != Features::NONE {
            write!(f, " features={}", self.features)?;
        }
        if self.assume_in_bounds {
            write!(f, " assume_in_bounds")?;
        }
        Ok(())
    }
}

/// A storage buffer the kernel binds, in `@group(0)`.
#[derive(Clone, Debug, PartialEq)]
pub struct Binding {
    pub name: String,
    pub binding: u32,
    /// The element type of the buffer's runtime-sized array.
    pub elem: Ty,
    pub access: Access,
}

/// A runtime scalar, a field of the kernel's `Params` struct.
#[derive(Clone, Debug, PartialEq)]
pub struct Param {
    pub name: String,
    pub ty: Scalar,
    /// Byte offset in the params block.
    pub offset: u32,
}

/// One kind of `coopMultiplyAdd` a kernel makes: `size × size` tiles, `A` and `B` of `ab`,
/// accumulated in `c`. A device multiplies only the kinds it reports (hesper-exec checks the
/// kernel's against them before it compiles).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CoopMultiply {
    pub size: u32,
    pub ab: Scalar,
    pub c: Scalar,
}

impl fmt::Display for CoopMultiply {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = self.size;
        write!(
            f,
            "{s}x{s}x{s} {}·{} + {}",
            self.ab.wgsl(),
            self.ab.wgsl(),
            self.c.wgsl()
        )
    }
}

/// A `var<workgroup>` array.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkgroupVar {
    pub name: String,
    pub ty: Ty,
}

/// Device limits a kernel is checked against (naga checks none of these).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    pub max_workgroup_storage_bytes: u32,
    pub max_invocations_per_workgroup: u32,
    pub max_workgroup_size: [u32; 3],
    pub max_immediate_bytes: u32,
}

impl Default for Limits {
    /// The limits of the smallest device hesper targets: Mesa's lavapipe (32 KiB workgroup
    /// memory, 1024 invocations, 128 bytes of immediates), which Apple GPUs also meet.
    fn default() -> Self {
        Limits {
            max_workgroup_storage_bytes: 32 * 1024,
            max_invocations_per_workgroup: 1024,
            max_workgroup_size: [1024, 1024, 64],
            max_immediate_bytes: 128,
        }
    }
}

/// A finished kernel: validated IR and its WGSL (entry point `main`).
#[derive(Clone, Debug)]
pub struct Kernel {
    pub(crate) key: KernelKey,
    pub(crate) bindings: Vec<Binding>,
    pub(crate) params: Vec<Param>,
    pub(crate) workgroup_vars: Vec<WorkgroupVar>,
    pub(crate) locals: Vec<LocalInfo>,
    /// The emitted name of each local and workgroup array, by index.
    pub(crate) var_names: Vec<String>,
    pub(crate) functions: Vec<FunctionDef>,
    /// The emitted name of each function, by index.
    pub(crate) fn_names: Vec<String>,
    /// Bindings and shape constants emitted under another name (see `names::Names::globals`).
    pub(crate) global_names: Vec<(String, String)>,
    pub(crate) builtins: Vec<Builtin>,
    pub(crate) helpers: Vec<Func>,
    pub(crate) body: Block,
    pub(crate) uses_f16: bool,
    /// Whether the body holds a cooperative matrix (`enable wgpu_cooperative_matrix;`).
    pub(crate) uses_coop: bool,
    /// Every kind of cooperative multiply-add the kernel makes (sorted, without repeats).
    pub(crate) coop_multiplies: Vec<CoopMultiply>,
    pub(crate) indexes_by_workgroup: Option<crate::Origin>,
    pub(crate) wgsl: String,
}

impl Kernel {
    pub fn key(&self) -> &KernelKey {
        &self.key
    }
    pub fn name(&self) -> &str {
        self.key.name()
    }
    /// Where the kernel asks for `workgroup_index()` when it never indexes by invocation
    /// (`global_index`, `global_id`): one workgroup per item, so a thread grid
    /// (`Grid::Threads(items)`) would launch too few workgroups. The executor refuses that.
    pub fn indexes_by_workgroup(&self) -> Option<crate::Origin> {
        self.indexes_by_workgroup
    }
    /// The emitted WGSL (deterministic for a given key).
    pub fn wgsl(&self) -> &str {
        &self.wgsl
    }
    /// Storage buffers in binding order.
    pub fn bindings(&self) -> &[Binding] {
        &self.bindings
    }
    pub fn binding(&self, name: &str) -> Option<&Binding> {
        self.bindings.iter().find(|b| b.name == name)
    }
    /// Runtime scalars in block order.
    pub fn params(&self) -> &[Param] {
        &self.params
    }
    /// Size of the runtime-scalar block, padded to 16 bytes; 0 when there is none.
    pub fn params_size(&self) -> u32 {
        (self.params.len() as u32 * 4).div_ceil(16) * 16
    }
    /// Whether runtime scalars travel as immediates (else in a uniform buffer).
    pub fn params_as_immediates(&self) -> bool {
        self.key.features.contains(Features::IMMEDIATES)
    }
    /// The binding index of the uniform params buffer, when there is one.
    pub fn params_binding(&self) -> Option<u32> {
        (!self.params.is_empty() && !self.params_as_immediates())
            .then_some(self.bindings.len() as u32)
    }
    pub fn workgroup_vars(&self) -> &[WorkgroupVar] {
        &self.workgroup_vars
    }
    /// Bytes of workgroup memory the kernel declares.
    pub fn workgroup_memory_bytes(&self) -> u32 {
        workgroup_bytes(&self.workgroup_vars)
    }
    pub fn uses_f16(&self) -> bool {
        self.uses_f16
    }
    /// Whether the kernel's body holds a cooperative matrix (which its key must allow with
    /// [`Features::COOPERATIVE_MATRIX`]): the device then needs the feature.
    pub fn uses_cooperative_matrix(&self) -> bool {
        self.uses_coop
    }
    /// The kinds of cooperative multiply-add the kernel makes, which the device must offer.
    pub fn coop_multiplies(&self) -> &[CoopMultiply] {
        &self.coop_multiplies
    }
    pub fn uses_subgroups(&self) -> bool {
        self.key.features.contains(Features::SUBGROUPS)
    }
    /// Whether the kernel may be compiled without bounds checks ([`KernelKey::assume_in_bounds`]).
    pub fn assumes_in_bounds(&self) -> bool {
        self.key.assume_in_bounds
    }

    /// Check the limits naga does not check: workgroup memory, invocations, immediates.
    pub fn check_limits(&self, limits: &Limits) -> Result<(), crate::DslError> {
        check_limits(self, limits)
    }
}

pub(crate) fn workgroup_bytes(vars: &[WorkgroupVar]) -> u32 {
    // Each variable starts at its own alignment; 16 covers every type we emit.
    vars.iter().fold(0u32, |total, v| {
        total.saturating_add(v.ty.size().div_ceil(16).saturating_mul(16))
    })
}

fn check_limits(k: &Kernel, limits: &Limits) -> Result<(), crate::DslError> {
    use crate::error::{DslError, ErrorKind};
    let err = |kind| Err(DslError::new(k.name(), kind));
    let used = k.workgroup_memory_bytes();
    if used > limits.max_workgroup_storage_bytes {
        return err(ErrorKind::WorkgroupMemory {
            used,
            limit: limits.max_workgroup_storage_bytes,
        });
    }
    let size = k.key.workgroup_size;
    if size.contains(&0) {
        return err(ErrorKind::WorkgroupSize {
            size,
            limit: "every dimension must be at least 1".into(),
        });
    }
    if k.key.invocations() > limits.max_invocations_per_workgroup {
        return err(ErrorKind::WorkgroupSize {
            size,
            limit: format!(
                "{} invocations per workgroup",
                limits.max_invocations_per_workgroup
            ),
        });
    }
    if size
        .iter()
        .zip(limits.max_workgroup_size)
        .any(|(s, m)| *s > m)
    {
        let [x, y, z] = limits.max_workgroup_size;
        return err(ErrorKind::WorkgroupSize {
            size,
            limit: format!("{x}x{y}x{z} per dimension"),
        });
    }
    if k.params_as_immediates() && k.params_size() > limits.max_immediate_bytes {
        return err(ErrorKind::ImmediateSize {
            used: k.params_size(),
            limit: limits.max_immediate_bytes,
        });
    }
    Ok(())
}
