//! An interpreter of a [`Kernel`]'s IR on the CPU, with the checks a GPU cannot make.
//!
//! [`interpret`] runs a kernel over host buffers (their bytes, as the GPU holds them) and
//! runtime scalars for a grid of workgroups, with WGSL's semantics: f32 and f16 arithmetic,
//! wrapping integers, vectors, the builtins, workgroup memory and barriers (a workgroup's
//! invocations advance phase by phase, barrier to barrier), and subgroup operations at a chosen
//! subgroup size. It stops at the first of these, naming the kernel, the buffer or array, the
//! index, the invocation and the author's statement:
//! - a read or write out of bounds (a GPU clamps or drops it, silently);
//! - a race: two invocations touching one workgroup element between two barriers, one of them
//!   writing; or one storage element written by two invocations (or written by one and read
//!   by another) with no barrier of the workgroup between them, or from two workgroups;
//! - a read of workgroup memory never written;
//! - a barrier or subgroup operation reached by only part of the workgroup or subgroup.
//!
//! Cooperative matrices are held whole by every invocation of their subgroup: `coopLoad` reads
//! all `N × N` elements, `coopMultiplyAdd` sums f32 products in order along `k`, `coopStore`
//! writes once for the subgroup.

use std::collections::HashMap;
use std::fmt;

use half::f16;

use crate::error::Origin;
use crate::ir::{
    BinaryOp, Block, Builtin, ExprKind, Func, Literal, Node, Stmt, UnaryOp, VarId, VarKind,
};
use crate::kernel::{Kernel, ShapeValue};
use crate::ty::{Scalar, Ty};

/// A scalar value, as WGSL holds it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ScalarValue {
    F32(f32),
    F16(f16),
    I32(i32),
    U32(u32),
    Bool(bool),
}

impl ScalarValue {
    fn scalar(self) -> Scalar {
        match self {
            ScalarValue::F32(_) => Scalar::F32,
            ScalarValue::F16(_) => Scalar::F16,
            ScalarValue::I32(_) => Scalar::I32,
            ScalarValue::U32(_) => Scalar::U32,
            ScalarValue::Bool(_) => Scalar::Bool,
        }
    }

    fn as_f64(self) -> f64 {
        match self {
            ScalarValue::F32(v) => v as f64,
            ScalarValue::F16(v) => v.to_f64(),
            ScalarValue::I32(v) => v as f64,
            ScalarValue::U32(v) => v as f64,
            ScalarValue::Bool(v) => v as u8 as f64,
        }
    }

    /// WGSL's conversion `T(x)`: floats to integers saturate (NaN is 0), as Rust's `as`.
    fn convert(self, to: Scalar) -> ScalarValue {
        use ScalarValue::*;
        match (self, to) {
            (v, t) if v.scalar() == t => v,
            (Bool(b), Scalar::F32) => F32(b as u8 as f32),
            (Bool(b), Scalar::F16) => F16(f16::from_f32(b as u8 as f32)),
            (Bool(b), Scalar::I32) => I32(b as i32),
            (Bool(b), Scalar::U32) => U32(b as u32),
            (v, Scalar::Bool) => Bool(v.as_f64() != 0.0),
            (I32(v), Scalar::U32) => U32(v as u32),
            (U32(v), Scalar::I32) => I32(v as i32),
            (I32(v), Scalar::F32) => F32(v as f32),
            (U32(v), Scalar::F32) => F32(v as f32),
            (F16(v), Scalar::F32) => F32(v.to_f32()),
            (F32(v), Scalar::F16) => F16(f16::from_f32(v)),
            (I32(v), Scalar::F16) => F16(f16::from_f32(v as f32)),
            (U32(v), Scalar::F16) => F16(f16::from_f32(v as f32)),
            (F32(v), Scalar::I32) => I32(v as i32),
            (F32(v), Scalar::U32) => U32(v as u32),
            (F16(v), Scalar::I32) => I32(v.to_f32() as i32),
            (F16(v), Scalar::U32) => U32(v.to_f32() as u32),
            (v, _) => v,
        }
    }

    fn bits(self) -> u32 {
        match self {
            ScalarValue::F32(v) => v.to_bits(),
            ScalarValue::F16(v) => v.to_bits() as u32,
            ScalarValue::I32(v) => v as u32,
            ScalarValue::U32(v) => v,
            ScalarValue::Bool(v) => v as u32,
        }
    }

    fn from_bits(bits: u32, to: Scalar) -> ScalarValue {
        match to {
            Scalar::F32 => ScalarValue::F32(f32::from_bits(bits)),
            Scalar::F16 => ScalarValue::F16(f16::from_bits(bits as u16)),
            Scalar::I32 => ScalarValue::I32(bits as i32),
            Scalar::U32 => ScalarValue::U32(bits),
            Scalar::Bool => ScalarValue::Bool(bits != 0),
        }
    }
}

/// A value of the IR: a scalar, a vector, a fixed-size array, or a cooperative matrix (its
/// `size × size` elements row by row; every invocation of the subgroup holds the whole of it).
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    Scalar(ScalarValue),
    Vector(Vec<ScalarValue>),
    Array(Vec<Value>),
    Matrix { size: usize, data: Vec<ScalarValue> },
}

impl Value {
    fn scalar(&self) -> Result<ScalarValue, String> {
        match self {
            Value::Scalar(s) => Ok(*s),
            other => Err(format!("a scalar expected, {other:?} found (a hesper bug)")),
        }
    }
    fn u32(&self) -> Result<u32, String> {
        match self.scalar()? {
            ScalarValue::U32(v) => Ok(v),
            ScalarValue::I32(v) => Ok(v as u32),
            other => Err(format!(
                "an integer expected, {other:?} found (a hesper bug)"
            )),
        }
    }
    fn bool(&self) -> Result<bool, String> {
        match self.scalar()? {
            ScalarValue::Bool(v) => Ok(v),
            other => Err(format!("a bool expected, {other:?} found (a hesper bug)")),
        }
    }
    /// The components: a scalar is one.
    fn lanes(&self) -> Vec<ScalarValue> {
        match self {
            Value::Scalar(s) => vec![*s],
            Value::Vector(v) => v.clone(),
            Value::Array(_) => vec![],
            Value::Matrix { data, .. } => data.clone(),
        }
    }
    /// The zero of `ty` (WGSL zero-initializes `var`s and workgroup memory).
    fn zero(ty: &Ty) -> Value {
        match ty {
            Ty::Scalar(s) => Value::Scalar(ScalarValue::from_bits(0, *s)),
            Ty::Vector(n, s) => Value::Vector(vec![ScalarValue::from_bits(0, *s); *n as usize]),
            Ty::Array(t, n) => Value::Array(vec![Value::zero(t); *n as usize]),
            Ty::CoopMatrix { size, scalar, .. } => Value::Matrix {
                size: *size as usize,
                data: vec![ScalarValue::from_bits(0, *scalar); *size as usize * *size as usize],
            },
        }
    }
}

/// A kernel's run: the contents of each storage buffer by its binding's name (bytes, as the
/// GPU holds them: `bytemuck::cast_slice` of the host values; a binding of `vec4<f32>` reads
/// the same bytes as one of `f32`), the runtime scalars, the grid, and the subgroup size.
#[derive(Clone, Debug)]
pub struct Run {
    pub buffers: HashMap<String, Vec<u8>>,
    pub params: HashMap<String, ScalarValue>,
    pub workgroups: [u32; 3],
    /// Invocations a subgroup holds (1, 4, 8, 32, 64): where `subgroupAdd` and friends reduce.
    pub subgroup_size: u32,
    /// What the kernel's `k.debug` statements printed, in the order the invocations ran them
    /// (workgroup by workgroup; within a phase, invocation by invocation).
    pub printed: Vec<Printed>,
}

/// One value a `k.debug` statement printed.
#[derive(Clone, Debug, PartialEq)]
pub struct Printed {
    /// The invocation's `global_invocation_id`.
    pub invocation: [u32; 3],
    pub label: String,
    pub value: Value,
}

impl fmt::Display for Printed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let [x, y, z] = self.invocation;
        write!(f, "({x}, {y}, {z}) {} = ", self.label)?;
        match &self.value {
            Value::Scalar(s) => write!(f, "{}", scalar_text(s)),
            Value::Vector(l) => {
                let parts: Vec<String> = l.iter().map(scalar_text).collect();
                write!(f, "({})", parts.join(", "))
            }
            other => write!(f, "{other:?}"),
        }
    }
}

fn scalar_text(s: &ScalarValue) -> String {
    match s {
        ScalarValue::F32(v) => format!("{v}"),
        ScalarValue::F16(v) => format!("{v}"),
        ScalarValue::I32(v) => format!("{v}"),
        ScalarValue::U32(v) => format!("{v}"),
        ScalarValue::Bool(v) => format!("{v}"),
    }
}

impl Run {
    /// A run over `workgroups`, without buffers or parameters yet, at subgroups of 32.
    pub fn new(workgroups: [u32; 3]) -> Run {
        Run {
            buffers: HashMap::new(),
            params: HashMap::new(),
            workgroups,
            subgroup_size: 32,
            printed: vec![],
        }
    }

    /// Bind `values` to the buffer `name`.
    pub fn buffer<T: bytemuck::Pod>(mut self, name: &str, values: &[T]) -> Run {
        self.buffers
            .insert(name.to_string(), bytemuck::cast_slice(values).to_vec());
        self
    }

    /// Set the runtime scalar `name`.
    pub fn param(mut self, name: &str, value: ScalarValue) -> Run {
        self.params.insert(name.to_string(), value);
        self
    }

    /// The buffer `name`'s contents as `T`s.
    pub fn read<T: bytemuck::Pod>(&self, name: &str) -> Option<Vec<T>> {
        let bytes = self.buffers.get(name)?;
        let size = size_of::<T>();
        Some(
            bytes
                .chunks_exact(size)
                .map(bytemuck::pod_read_unaligned)
                .collect(),
        )
    }
}

/// What the interpreter found wrong, and where.
#[derive(Clone, Debug, PartialEq)]
pub struct InterpError {
    pub kernel: String,
    /// What happened: the check that failed, with the buffer or array and the index.
    pub what: String,
    /// The invocation's `global_invocation_id`, where one is at fault.
    pub invocation: Option<[u32; 3]>,
    /// The author's statement.
    pub at: Option<Origin>,
}

impl fmt::Display for InterpError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "kernel `{}`: {}", self.kernel, self.what)?;
        if let Some([x, y, z]) = self.invocation {
            write!(f, ", invocation ({x}, {y}, {z})")?;
        }
        if let Some(at) = self.at {
            write!(f, ", at {at}")?;
        }
        Ok(())
    }
}

impl std::error::Error for InterpError {}

/// One instruction of a flattened body: structured control flow becomes jumps, so that an
/// invocation can stop at a barrier and resume there.
#[derive(Debug)]
enum Op<'k> {
    Let(VarId, &'k Node),
    Var(VarId, Option<&'k Node>),
    Assign {
        target: &'k Node,
        op: Option<BinaryOp>,
        value: &'k Node,
    },
    /// Jump to the target unless the condition holds.
    JumpUnless(&'k Node, usize),
    Jump(usize),
    Return,
    /// A `for` loop's step: `counter = counter op step`.
    Step {
        counter: VarId,
        op: BinaryOp,
        step: &'k Node,
    },
    /// `workgroupBarrier` (true) or `storageBarrier`.
    Barrier(bool),
    /// `k.debug(label, value)`.
    Debug(&'k str, &'k Node),
    /// `coopStore(value, &place, stride)`, column by column where `column`.
    CoopStore {
        value: &'k Node,
        place: &'k Node,
        stride: &'k Node,
        column: bool,
    },
}

struct Compiled<'k> {
    ops: Vec<Op<'k>>,
    at: Vec<Origin>,
    /// The subgroup-wide call an instruction makes, if any (at most one a statement).
    subgroup: Vec<Option<&'k Node>>,
    /// Whether the instruction touches a cooperative matrix: the subgroup meets there before
    /// any of it goes on (a load, a multiply-add or a store is the whole subgroup's).
    meet: Vec<bool>,
}

/// Flattens blocks into [`Op`]s; `loops` holds each enclosing loop's (continue, break) fixups.
struct Flattener<'k> {
    out: Compiled<'k>,
    loops: Vec<(Vec<usize>, Vec<usize>)>,
}

impl<'k> Flattener<'k> {
    fn push(&mut self, op: Op<'k>, at: Origin, exprs: &[&'k Node]) -> Result<usize, String> {
        let mut calls = vec![];
        for e in exprs {
            subgroup_calls(e, &mut calls);
        }
        if calls.len() > 1 {
            return Err("two subgroup operations in one statement (not interpreted yet)".into());
        }
        let meet = matches!(op, Op::CoopStore { .. }) || exprs.iter().any(|e| touches_coop(e));
        self.out.ops.push(op);
        self.out.at.push(at);
        self.out.subgroup.push(calls.first().copied());
        self.out.meet.push(meet);
        Ok(self.out.ops.len() - 1)
    }

    fn block(&mut self, block: &'k Block) -> Result<(), (String, Origin)> {
        for placed in block {
            let at = placed.at;
            self.stmt(&placed.stmt, at).map_err(|e| (e, at))?;
        }
        Ok(())
    }

    fn patch(&mut self, at: usize, to: usize) {
        match &mut self.out.ops[at] {
            Op::JumpUnless(_, t) | Op::Jump(t) => *t = to,
            _ => unreachable!("only jumps are patched"),
        }
    }

    fn stmt(&mut self, stmt: &'k Stmt, at: Origin) -> Result<(), String> {
        match stmt {
            Stmt::Let { id, value } => {
                self.push(Op::Let(*id, value), at, &[value])?;
            }
            Stmt::Var { id, init } => {
                let exprs: Vec<&Node> = init.iter().collect();
                self.push(Op::Var(*id, init.as_ref()), at, &exprs)?;
            }
            Stmt::Assign { target, op, value } => {
                let op = Op::Assign {
                    target,
                    op: *op,
                    value,
                };
                self.push(op, at, &[target, value])?;
            }
            Stmt::If {
                cond,
                then,
                otherwise,
            } => {
                let branch = self.push(Op::JumpUnless(cond, 0), at, &[cond])?;
                self.block(then).map_err(|e| e.0)?;
                if otherwise.is_empty() {
                    let end = self.out.ops.len();
                    self.patch(branch, end);
                } else {
                    let skip = self.push(Op::Jump(0), at, &[])?;
                    let else_at = self.out.ops.len();
                    self.patch(branch, else_at);
                    self.block(otherwise).map_err(|e| e.0)?;
                    let end = self.out.ops.len();
                    self.patch(skip, end);
                }
            }
            Stmt::For {
                counter,
                init,
                cond,
                step_op,
                step,
                body,
            } => {
                self.push(Op::Var(*counter, Some(init)), at, &[init])?;
                let top = self.out.ops.len();
                let exit = self.push(Op::JumpUnless(cond, 0), at, &[cond])?;
                self.loops.push((vec![], vec![exit]));
                self.block(body).map_err(|e| e.0)?;
                let continue_at = self.out.ops.len();
                let op = Op::Step {
                    counter: *counter,
                    op: *step_op,
                    step,
                };
                self.push(op, at, &[step])?;
                self.push(Op::Jump(top), at, &[])?;
                self.close_loop(continue_at)?;
            }
            Stmt::While { cond, body } => {
                let top = self.out.ops.len();
                let exit = self.push(Op::JumpUnless(cond, 0), at, &[cond])?;
                self.loops.push((vec![], vec![exit]));
                self.block(body).map_err(|e| e.0)?;
                self.push(Op::Jump(top), at, &[])?;
                self.close_loop(top)?;
            }
            Stmt::Loop { body } => {
                let top = self.out.ops.len();
                self.loops.push((vec![], vec![]));
                self.block(body).map_err(|e| e.0)?;
                self.push(Op::Jump(top), at, &[])?;
                self.close_loop(top)?;
            }
            Stmt::Break => {
                let j = self.push(Op::Jump(0), at, &[])?;
                let lp = self.loops.last_mut().ok_or("`break` outside a loop")?;
                lp.1.push(j);
            }
            Stmt::Continue => {
                let j = self.push(Op::Jump(0), at, &[])?;
                let lp = self.loops.last_mut().ok_or("`continue` outside a loop")?;
                lp.0.push(j);
            }
            Stmt::Return => {
                self.push(Op::Return, at, &[])?;
            }
            Stmt::WorkgroupBarrier => {
                self.push(Op::Barrier(true), at, &[])?;
            }
            Stmt::UniformLoad { id, place } => {
                // WGSL's definition: a barrier, the read, a barrier.
                self.push(Op::Barrier(true), at, &[])?;
                self.push(Op::Let(*id, place), at, &[place])?;
                self.push(Op::Barrier(true), at, &[])?;
            }
            Stmt::StorageBarrier => {
                self.push(Op::Barrier(false), at, &[])?;
            }
            Stmt::CoopStore {
                value,
                place,
                stride,
                major,
            } => {
                let op = Op::CoopStore {
                    value,
                    place,
                    stride,
                    column: *major == crate::ir::Major::Column,
                };
                self.push(op, at, &[value, place, stride])?;
            }
            Stmt::Comment(_) => {}
            Stmt::Debug { label, value } => {
                self.push(Op::Debug(label, value), at, &[value])?;
            }
        }
        Ok(())
    }

    /// Patch the innermost loop's `continue`s to `continue_at` and its exits to here.
    fn close_loop(&mut self, continue_at: usize) -> Result<(), String> {
        let (continues, breaks) = self.loops.pop().ok_or("unbalanced loops (a hesper bug)")?;
        let end = self.out.ops.len();
        for c in continues {
            self.patch(c, continue_at);
        }
        for b in breaks {
            self.patch(b, end);
        }
        Ok(())
    }
}

/// Whether `node`'s tree holds a cooperative-matrix value.
fn touches_coop(node: &Node) -> bool {
    if matches!(node.ty, Ty::CoopMatrix { .. }) {
        return true;
    }
    match &node.kind {
        ExprKind::Unary(_, a) | ExprKind::Swizzle(a, _) | ExprKind::Bitcast(a) => touches_coop(a),
        ExprKind::Binary(_, a, b) | ExprKind::Index(a, b) => touches_coop(a) || touches_coop(b),
        ExprKind::Select(a, b, c) => [a, b, c].iter().any(|n| touches_coop(n)),
        ExprKind::Call(_, args) | ExprKind::Construct(args) | ExprKind::CallFunction(_, args) => {
            args.iter().any(touches_coop)
        }
        ExprKind::CoopLoad { .. } => true,
        _ => false,
    }
}

/// The subgroup-wide calls in `node`'s tree.
fn subgroup_calls<'k>(node: &'k Node, out: &mut Vec<&'k Node>) {
    match &node.kind {
        ExprKind::Call(f, args) => {
            if f.is_subgroup() {
                out.push(node);
            }
            for a in args {
                subgroup_calls(a, out);
            }
        }
        ExprKind::Unary(_, a) | ExprKind::Swizzle(a, _) | ExprKind::Bitcast(a) => {
            subgroup_calls(a, out)
        }
        ExprKind::Binary(_, a, b) | ExprKind::Index(a, b) => {
            subgroup_calls(a, out);
            subgroup_calls(b, out);
        }
        ExprKind::Select(a, b, c) => {
            for n in [a, b, c] {
                subgroup_calls(n, out);
            }
        }
        ExprKind::Construct(args) | ExprKind::CallFunction(_, args) => {
            for a in args {
                subgroup_calls(a, out);
            }
        }
        _ => {}
    }
}

fn flatten<'k>(kernel: &'k Kernel, block: &'k Block) -> Result<Compiled<'k>, InterpError> {
    let mut f = Flattener {
        out: Compiled {
            ops: vec![],
            at: vec![],
            subgroup: vec![],
            meet: vec![],
        },
        loops: vec![],
    };
    f.block(block).map_err(|(what, at)| InterpError {
        kernel: kernel.name().to_string(),
        what,
        invocation: None,
        at: Some(at),
    })?;
    Ok(f.out)
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum State {
    Running,
    AtBarrier(usize),
    AtSubgroup(usize),
    Done,
}

/// One invocation: where it is, its locals and its builtins.
struct Invocation {
    pc: usize,
    state: State,
    locals: Vec<Option<Value>>,
    global_id: [u32; 3],
    local_id: [u32; 3],
    local_index: u32,
    /// The value of the subgroup operation its current instruction makes, once the subgroup
    /// has arrived.
    subgroup_value: Option<Value>,
}

/// Who touched one element in the current phase.
#[derive(Clone, Debug, Default)]
struct Touch {
    writer: Option<u32>,
    readers: Vec<u32>,
}

/// Storage writes of a dispatch: by whom (workgroup, local index) and in which of its
/// workgroup's barrier phases; and reads of elements others wrote.
#[derive(Clone, Copy, Debug)]
struct StorageWrite {
    workgroup: u32,
    local: u32,
    phase: u32,
}

struct Machine<'k, 'r> {
    kernel: &'k Kernel,
    run: &'r mut Run,
    workgroup_size: [u32; 3],
    /// Workgroup arrays' contents (`None`: never written) by local index.
    shared: HashMap<u32, Vec<Option<Value>>>,
    /// Workgroup elements touched in the current phase.
    shared_touch: HashMap<(u32, usize), Touch>,
    storage_writes: HashMap<(String, usize), StorageWrite>,
    workgroup_linear: u32,
    phase: u32,
    /// The statement being executed, for faults found later.
    current_at: Option<Origin>,
    /// The first read of workgroup memory nobody had written (zero, as WGSL initializes it):
    /// a race if another invocation writes the element before the next barrier, else a read of
    /// memory never written, reported at that barrier.
    unwritten: Option<(String, [u32; 3], Option<Origin>)>,
}

type Fault = String;

/// Elements of an array by (index, lane): where a cooperative matrix's elements lie.
type Elements = Vec<(usize, usize)>;

/// Run `kernel` over `run`'s buffers and grid (see the module's documentation). The buffers
/// hold the results after; an error stops the run at the first fault found.
pub fn interpret(kernel: &Kernel, run: &mut Run) -> Result<(), InterpError> {
    let name = kernel.name().to_string();
    let fail = |what: String| InterpError {
        kernel: name.clone(),
        what,
        invocation: None,
        at: None,
    };
    for b in kernel.bindings() {
        if !run.buffers.contains_key(&b.name) {
            return Err(fail(format!("buffer `{}` is not bound", b.name)));
        }
    }
    for p in kernel.params() {
        match run.params.get(&p.name) {
            Some(v) if v.scalar() == p.ty => {}
            Some(v) => {
                return Err(fail(format!(
                    "parameter `{}` is {}, a {v:?} given",
                    p.name,
                    p.ty.wgsl()
                )));
            }
            None => return Err(fail(format!("parameter `{}` is not given", p.name))),
        }
    }
    if !run.subgroup_size.is_power_of_two() || run.subgroup_size > 128 {
        return Err(fail(format!(
            "a subgroup size of {} (a power of two up to 128)",
            run.subgroup_size
        )));
    }
    let code = flatten(kernel, &kernel.body)?;
    let size = kernel.key.wg_size();
    let mut m = Machine {
        kernel,
        run,
        workgroup_size: size,
        shared: HashMap::new(),
        shared_touch: HashMap::new(),
        storage_writes: HashMap::new(),
        workgroup_linear: 0,
        phase: 0,
        current_at: None,
        unwritten: None,
    };
    let [gx, gy, gz] = m.run.workgroups;
    for wz in 0..gz {
        for wy in 0..gy {
            for wx in 0..gx {
                m.workgroup([wx, wy, wz], &code)?;
            }
        }
    }
    Ok(())
}

/// Run `kernel` over copies of `run` at each subgroup size of `sizes`, and return the first
/// run's buffers; an error when any buffer differs between two sizes (a kernel right only where
/// its author assumed one size), or when a run faults.
pub fn subgroup_size_dependence(
    kernel: &Kernel,
    run: &Run,
    sizes: &[u32],
) -> Result<Run, InterpError> {
    let mut first: Option<(u32, Run)> = None;
    for &size in sizes {
        let mut this = run.clone();
        this.subgroup_size = size;
        interpret(kernel, &mut this)?;
        match &first {
            None => first = Some((size, this)),
            Some((at, reference)) => {
                let mut names: Vec<&String> = reference.buffers.keys().collect();
                names.sort();
                for name in names {
                    if reference.buffers[name] != this.buffers[name] {
                        return Err(InterpError {
                            kernel: kernel.name().to_string(),
                            what: format!(
                                "buffer `{name}` differs between subgroups of {at} and of {size}"
                            ),
                            invocation: None,
                            at: None,
                        });
                    }
                }
            }
        }
    }
    Ok(first.map_or_else(|| run.clone(), |(_, r)| r))
}

impl<'k> Machine<'k, '_> {
    fn error(&self, what: String, inv: Option<&Invocation>, at: Option<Origin>) -> InterpError {
        InterpError {
            kernel: self.kernel.name().to_string(),
            what,
            invocation: inv.map(|i| i.global_id),
            at,
        }
    }

    fn workgroup(&mut self, id: [u32; 3], code: &Compiled<'k>) -> Result<(), InterpError> {
        let [sx, sy, sz] = self.workgroup_size;
        let [gx, gy, _] = self.run.workgroups;
        self.workgroup_linear = id[0] + gx * (id[1] + gy * id[2]);
        self.phase = 0;
        self.shared.clear();
        self.shared_touch.clear();
        self.unwritten = None;
        let locals = self.kernel.locals.len();
        let mut invs: Vec<Invocation> = Vec::with_capacity((sx * sy * sz) as usize);
        for z in 0..sz {
            for y in 0..sy {
                for x in 0..sx {
                    invs.push(Invocation {
                        pc: 0,
                        state: State::Running,
                        locals: vec![None; locals],
                        global_id: [id[0] * sx + x, id[1] * sy + y, id[2] * sz + z],
                        local_id: [x, y, z],
                        local_index: x + sx * (y + sy * z),
                        subgroup_value: None,
                    });
                }
            }
        }
        loop {
            for inv in invs.iter_mut() {
                if inv.state == State::Running {
                    self.advance(inv, code)?;
                }
            }
            if invs.iter().all(|i| i.state == State::Done) {
                return self.no_unwritten_reads();
            }
            if invs.iter().any(|i| matches!(i.state, State::AtSubgroup(_))) {
                self.subgroups(&mut invs, code)?;
                continue;
            }
            // Every invocation is done or at a barrier: all must be at the same one.
            let waiting: Vec<&Invocation> =
                invs.iter().filter(|i| i.state != State::Done).collect();
            let State::AtBarrier(pc) = waiting[0].state else {
                unreachable!("invocations stop only at barriers and subgroup operations");
            };
            if let Some(other) = waiting.iter().find(|i| i.state != State::AtBarrier(pc)) {
                let at = match other.state {
                    State::AtBarrier(p) => Some(code.at[p]),
                    _ => None,
                };
                return Err(self.error(
                    format!(
                        "invocations wait at different barriers (another waits at {})",
                        code.at[pc]
                    ),
                    Some(other),
                    at,
                ));
            }
            if let Some(done) = invs.iter().find(|i| i.state == State::Done) {
                return Err(self.error(
                    "a barrier reached by only part of the workgroup (this invocation returned)"
                        .into(),
                    Some(done),
                    Some(code.at[pc]),
                ));
            }
            self.no_unwritten_reads()?;
            let workgroup = matches!(code.ops[pc], Op::Barrier(true));
            // A workgroup barrier orders workgroup memory; both order the workgroup's storage
            // accesses here (WGSL's workgroupBarrier orders only workgroup memory: a storage
            // race across it still shows as a race on some GPU, but not one this checks).
            if workgroup {
                self.shared_touch.clear();
            }
            self.phase += 1;
            for inv in &mut invs {
                inv.state = State::Running;
                inv.pc += 1;
            }
        }
    }

    /// `Ok` unless the phase just ended read workgroup memory that nobody wrote.
    fn no_unwritten_reads(&mut self) -> Result<(), InterpError> {
        match self.unwritten.take() {
            None => Ok(()),
            Some((element, invocation, at)) => Err(InterpError {
                kernel: self.kernel.name().to_string(),
                what: format!("read of workgroup array `{element}`, never written"),
                invocation: Some(invocation),
                at,
            }),
        }
    }

    /// Resolve the subgroup operations every member of a subgroup waits at.
    fn subgroups(
        &mut self,
        invs: &mut [Invocation],
        code: &Compiled<'k>,
    ) -> Result<(), InterpError> {
        let size = self.run.subgroup_size as usize;
        let mut progressed = false;
        for first in (0..invs.len()).step_by(size) {
            let members = first..(first + size).min(invs.len());
            let Some(pc) = invs[members.clone()].iter().find_map(|i| match i.state {
                State::AtSubgroup(pc) => Some(pc),
                _ => None,
            }) else {
                continue;
            };
            if let Some(other) = invs[members.clone()]
                .iter()
                .find(|i| i.state != State::AtSubgroup(pc))
            {
                if other.state == State::Running {
                    continue;
                }
                return Err(self.error(
                    "a subgroup operation reached by only part of the subgroup".into(),
                    Some(other),
                    Some(code.at[pc]),
                ));
            }
            let Some(call) = code.subgroup[pc] else {
                // A meeting at a cooperative-matrix instruction: the subgroup is all here.
                for i in members {
                    invs[i].subgroup_value = Some(Value::Array(vec![]));
                    invs[i].state = State::Running;
                }
                progressed = true;
                continue;
            };
            let ExprKind::Call(f, args) = &call.kind else {
                unreachable!("subgroup calls are calls");
            };
            let mut values = vec![];
            let mut extra = vec![];
            for i in members.clone() {
                let mut inv = std::mem::replace(&mut invs[i], placeholder());
                let v = self.eval(&mut inv, &args[0]);
                let e = args.get(1).map(|a| self.eval(&mut inv, a));
                invs[i] = inv;
                let at = Some(code.at[pc]);
                values.push(v.map_err(|w| self.error(w, Some(&invs[i]), at))?);
                extra.push(
                    e.transpose()
                        .map_err(|w| self.error(w, Some(&invs[i]), at))?,
                );
            }
            let results = subgroup_op(*f, &values, &extra)
                .map_err(|w| self.error(w, None, Some(code.at[pc])))?;
            for (i, r) in members.zip(results) {
                invs[i].subgroup_value = Some(r);
                invs[i].state = State::Running;
            }
            progressed = true;
        }
        if !progressed {
            let stuck = invs
                .iter()
                .find(|i| matches!(i.state, State::AtSubgroup(_)));
            let at = stuck.and_then(|i| match i.state {
                State::AtSubgroup(pc) => Some(code.at[pc]),
                _ => None,
            });
            return Err(self.error(
                "a subgroup operation that its subgroup never completes (some members wait at a barrier)"
                    .into(),
                stuck,
                at,
            ));
        }
        Ok(())
    }

    /// Run `inv` until it finishes or stops at a barrier or a subgroup operation.
    fn advance(&mut self, inv: &mut Invocation, code: &Compiled<'k>) -> Result<(), InterpError> {
        loop {
            let pc = inv.pc;
            let Some(op) = code.ops.get(pc) else {
                inv.state = State::Done;
                return Ok(());
            };
            let synced = code.subgroup[pc].is_some() || code.meet[pc];
            if synced && inv.subgroup_value.is_none() {
                inv.state = State::AtSubgroup(pc);
                return Ok(());
            }
            let at = Some(code.at[pc]);
            self.current_at = at;
            let step = self.execute(inv, op, code.subgroup[pc]);
            inv.subgroup_value = None;
            match step.map_err(|what| self.error(what, Some(inv), at))? {
                Flow::Next => inv.pc += 1,
                Flow::Jump(to) => inv.pc = to,
                Flow::Done => {
                    inv.state = State::Done;
                    return Ok(());
                }
                Flow::Barrier => {
                    inv.state = State::AtBarrier(pc);
                    return Ok(());
                }
            }
        }
    }

    fn execute(
        &mut self,
        inv: &mut Invocation,
        op: &Op<'k>,
        subgroup: Option<&'k Node>,
    ) -> Result<Flow, Fault> {
        // The subgroup's result stands in for its call while this instruction evaluates (and
        // is spent by it: `advance` clears it after).
        let sg = subgroup.zip(inv.subgroup_value.take());
        let eval = |m: &mut Self, inv: &mut Invocation, n: &Node| match &sg {
            Some((call, value)) => m.eval_with(inv, n, Some((call, value))),
            None => m.eval(inv, n),
        };
        match op {
            Op::Let(id, value) => {
                let v = eval(self, inv, value)?;
                inv.locals[id.index as usize] = Some(v);
            }
            Op::Var(id, init) => {
                let v = match init {
                    Some(n) => eval(self, inv, n)?,
                    None => Value::zero(&self.kernel.locals[id.index as usize].ty),
                };
                inv.locals[id.index as usize] = Some(v);
            }
            Op::Assign { target, op, value } => {
                let v = eval(self, inv, value)?;
                let v = match op {
                    Some(op) => {
                        let old = eval(self, inv, target)?;
                        binary(*op, &old, &v)?
                    }
                    None => v,
                };
                self.store(inv, target, v)?;
            }
            Op::JumpUnless(cond, to) => {
                if !eval(self, inv, cond)?.bool()? {
                    return Ok(Flow::Jump(*to));
                }
            }
            Op::Step { counter, op, step } => {
                let by = eval(self, inv, step)?;
                let slot = &mut inv.locals[counter.index as usize];
                let now = slot
                    .as_ref()
                    .ok_or("a loop counter before its loop (a hesper bug)")?;
                *slot = Some(binary(*op, now, &by)?);
            }
            Op::Jump(to) => return Ok(Flow::Jump(*to)),
            Op::Return => return Ok(Flow::Done),
            Op::Barrier(_) => return Ok(Flow::Barrier),
            Op::Debug(label, value) => {
                let value = eval(self, inv, value)?;
                self.run.printed.push(Printed {
                    invocation: inv.global_id,
                    label: label.to_string(),
                    value,
                });
            }
            Op::CoopStore {
                value,
                place,
                stride,
                column,
            } => {
                let value = eval(self, inv, value)?;
                let stride = eval(self, inv, stride)?.u32()? as usize;
                self.coop_store(inv, place, stride, *column, value)?;
            }
        }
        Ok(Flow::Next)
    }

    fn eval(&mut self, inv: &mut Invocation, n: &Node) -> Result<Value, Fault> {
        self.eval_with(inv, n, None)
    }

    fn eval_with(
        &mut self,
        inv: &mut Invocation,
        n: &Node,
        sg: Option<(&&Node, &Value)>,
    ) -> Result<Value, Fault> {
        if let Some((call, value)) = sg
            && std::ptr::eq(n.as_ref(), call.as_ref())
        {
            return Ok(value.clone());
        }
        let ev = |m: &mut Self, inv: &mut Invocation, n: &Node| m.eval_with(inv, n, sg);
        Ok(match &n.kind {
            ExprKind::Literal(l) => Value::Scalar(match *l {
                Literal::F32(v) => ScalarValue::F32(v),
                Literal::F16(v) => ScalarValue::F16(f16::from_f32(v)),
                Literal::I32(v) => ScalarValue::I32(v),
                Literal::U32(v) => ScalarValue::U32(v),
                Literal::Bool(v) => ScalarValue::Bool(v),
            }),
            ExprKind::Local(id) => self.read_local(inv, *id)?,
            ExprKind::Global(name) => {
                return Err(format!(
                    "the whole buffer `{name}` as a value (a hesper bug)"
                ));
            }
            ExprKind::Const(name) => match self.kernel.key.get(name) {
                Some(ShapeValue::U32(v)) => Value::Scalar(ScalarValue::U32(v)),
                Some(ShapeValue::I32(v)) => Value::Scalar(ScalarValue::I32(v)),
                Some(ShapeValue::F32Bits(b)) => Value::Scalar(ScalarValue::F32(f32::from_bits(b))),
                Some(ShapeValue::Bool(v)) => Value::Scalar(ScalarValue::Bool(v)),
                None => return Err(format!("shape constant `{name}` is not in the key")),
            },
            ExprKind::Builtin(b) => self.builtin(inv, *b),
            ExprKind::Param(name) => Value::Scalar(
                *self
                    .run
                    .params
                    .get(name)
                    .ok_or_else(|| format!("parameter `{name}` is not given"))?,
            ),
            ExprKind::Unary(op, a) => unary(*op, &ev(self, inv, a)?)?,
            ExprKind::Binary(op, a, b) => {
                let a = ev(self, inv, a)?;
                // `&&` and `||` short-circuit, as WGSL's do.
                match (op, &a) {
                    (BinaryOp::And, Value::Scalar(ScalarValue::Bool(false))) => a,
                    (BinaryOp::Or, Value::Scalar(ScalarValue::Bool(true))) => a,
                    _ => {
                        let b = ev(self, inv, b)?;
                        binary(*op, &a, &b)?
                    }
                }
            }
            ExprKind::Call(f, args) => {
                if f.is_subgroup() {
                    return Err("a subgroup operation outside its statement (a hesper bug)".into());
                }
                let mut values = Vec::with_capacity(args.len());
                for a in args {
                    values.push(ev(self, inv, a)?);
                }
                call(*f, &values, &n.ty)?
            }
            ExprKind::Index(base, index) => {
                let i = ev(self, inv, index)?;
                let i = i.u32()? as usize;
                self.load_indexed(inv, base, i, sg)?
            }
            ExprKind::Swizzle(a, lanes) => {
                let v = ev(self, inv, a)?.lanes();
                let picked: Result<Vec<ScalarValue>, Fault> = lanes
                    .chars()
                    .map(|c| {
                        let i = "xyzw".find(c).or_else(|| "rgba".find(c)).unwrap_or(4);
                        v.get(i)
                            .copied()
                            .ok_or_else(|| format!("swizzle `{lanes}` past the vector"))
                    })
                    .collect();
                let picked = picked?;
                if picked.len() == 1 {
                    Value::Scalar(picked[0])
                } else {
                    Value::Vector(picked)
                }
            }
            ExprKind::Construct(args) => {
                let mut lanes = vec![];
                for a in args {
                    lanes.extend(ev(self, inv, a)?.lanes());
                }
                construct(&n.ty, &lanes)?
            }
            ExprKind::Bitcast(a) => {
                let v = ev(self, inv, a)?;
                let to = match &n.ty {
                    Ty::Scalar(s) | Ty::Vector(_, s) => *s,
                    other => return Err(format!("bitcast to {other:?}")),
                };
                let lanes: Vec<ScalarValue> = v
                    .lanes()
                    .iter()
                    .map(|s| ScalarValue::from_bits(s.bits(), to))
                    .collect();
                shape_like(&n.ty, lanes)
            }
            ExprKind::Select(f, t, c) => {
                let (f, t, c) = (ev(self, inv, f)?, ev(self, inv, t)?, ev(self, inv, c)?);
                match c {
                    Value::Scalar(ScalarValue::Bool(c)) => {
                        if c {
                            t
                        } else {
                            f
                        }
                    }
                    Value::Vector(cs) => {
                        let (f, t) = (f.lanes(), t.lanes());
                        let lanes = cs
                            .iter()
                            .enumerate()
                            .map(|(i, c)| {
                                if *c == ScalarValue::Bool(true) {
                                    t[i]
                                } else {
                                    f[i]
                                }
                            })
                            .collect();
                        Value::Vector(lanes)
                    }
                    other => return Err(format!("select on {other:?}")),
                }
            }
            ExprKind::ArrayLength(name) => {
                Value::Scalar(ScalarValue::U32(self.buffer_len(name)? as u32))
            }
            ExprKind::CoopLoad {
                place,
                stride,
                major,
            } => {
                let stride = ev(self, inv, stride)?.u32()? as usize;
                let column = *major == crate::ir::Major::Column;
                self.coop_load(inv, place, stride, column, &n.ty)?
            }
            ExprKind::CallFunction(id, args) => {
                let mut values = Vec::with_capacity(args.len());
                for a in args {
                    values.push(ev(self, inv, a)?);
                }
                self.call_function(inv, *id, values)?
            }
            ExprKind::Error(e) => return Err(format!("an erroneous expression: {e}")),
        })
    }

    fn call_function(
        &mut self,
        inv: &mut Invocation,
        id: VarId,
        args: Vec<Value>,
    ) -> Result<Value, Fault> {
        let kernel = self.kernel;
        let f = kernel
            .functions
            .get(id.index as usize)
            .ok_or("a call of an unknown function (a hesper bug)")?;
        for (p, v) in f.params.iter().zip(args) {
            inv.locals[p.index as usize] = Some(v);
        }
        let code = flatten(kernel, &f.body).map_err(|e| e.what)?;
        let mut pc = 0;
        while let Some(op) = code.ops.get(pc) {
            if code.subgroup[pc].is_some() {
                return Err("subgroup operations in a function are not interpreted yet".into());
            }
            match self.execute(inv, op, None)? {
                Flow::Next => pc += 1,
                Flow::Jump(to) => pc = to,
                Flow::Done | Flow::Barrier => {
                    return Err("a barrier or return inside a function (not interpreted)".into());
                }
            }
        }
        self.eval(inv, &f.value)
    }

    fn builtin(&self, inv: &Invocation, b: Builtin) -> Value {
        let v3 = |v: [u32; 3]| Value::Vector(v.iter().map(|x| ScalarValue::U32(*x)).collect());
        let u = |v: u32| Value::Scalar(ScalarValue::U32(v));
        let size = self.run.subgroup_size;
        let invocations: u32 = self.workgroup_size.iter().product();
        match b {
            Builtin::GlobalInvocationId => v3(inv.global_id),
            Builtin::LocalInvocationId => v3(inv.local_id),
            Builtin::LocalInvocationIndex => u(inv.local_index),
            Builtin::WorkgroupId => {
                let s = self.workgroup_size;
                v3([
                    inv.global_id[0] / s[0],
                    inv.global_id[1] / s[1],
                    inv.global_id[2] / s[2],
                ])
            }
            Builtin::NumWorkgroups => v3(self.run.workgroups),
            Builtin::SubgroupSize => u(size),
            Builtin::SubgroupInvocationId => u(inv.local_index % size),
            Builtin::SubgroupId => u(inv.local_index / size),
            Builtin::NumSubgroups => u(invocations.div_ceil(size)),
        }
    }

    fn read_local(&mut self, inv: &Invocation, id: VarId) -> Result<Value, Fault> {
        let info = &self.kernel.locals[id.index as usize];
        if info.kind == VarKind::Workgroup {
            return Err(format!(
                "the whole workgroup array `{}` as a value",
                info.hint
            ));
        }
        inv.locals[id.index as usize]
            .clone()
            .ok_or_else(|| format!("`{}` read before it is set (a hesper bug)", info.hint))
    }

    fn buffer_len(&self, name: &str) -> Result<usize, Fault> {
        let b = self
            .kernel
            .binding(name)
            .ok_or_else(|| format!("no buffer `{name}`"))?;
        let bytes = self.run.buffers.get(name).map_or(0, Vec::len);
        Ok(bytes / b.elem.size() as usize)
    }

    fn load_indexed(
        &mut self,
        inv: &mut Invocation,
        base: &Node,
        i: usize,
        sg: Option<(&&Node, &Value)>,
    ) -> Result<Value, Fault> {
        match &base.kind {
            ExprKind::Global(_) => self.read_element(inv.local_index, base, i, inv.global_id),
            ExprKind::Local(id)
                if self.kernel.locals[id.index as usize].kind == VarKind::Workgroup =>
            {
                self.read_element(inv.local_index, base, i, inv.global_id)
            }
            _ => {
                let v = self.eval_with(inv, base, sg)?;
                match v {
                    Value::Array(items) => items.get(i).cloned().ok_or_else(|| {
                        format!("index {i} past an array of {} elements", items.len())
                    }),
                    Value::Vector(lanes) => lanes
                        .get(i)
                        .map(|s| Value::Scalar(*s))
                        .ok_or_else(|| format!("index {i} past a vector of {}", lanes.len())),
                    Value::Scalar(_) | Value::Matrix { .. } => {
                        Err("indexing a scalar or a cooperative matrix (a hesper bug)".into())
                    }
                }
            }
        }
    }

    /// Where element `(r, c)` of a cooperative matrix lies from `place` (an element of a
    /// storage buffer or workgroup array): the array, its element's index and lane (arrays of
    /// vectors are read as their scalars; `stride` counts the array's elements).
    fn coop_places(
        &mut self,
        inv: &mut Invocation,
        place: &Node,
        (size, stride, column): (usize, usize, bool),
    ) -> Result<(Node, usize, Elements), Fault> {
        let ExprKind::Index(base, index) = &place.kind else {
            return Err(
                "a cooperative load or store not at an array element (a hesper bug)".into(),
            );
        };
        let first = self.eval(inv, index)?.u32()? as usize;
        let elem = match &base.kind {
            ExprKind::Global(name) => self.kernel.binding(name).map(|b| b.elem.clone()),
            ExprKind::Local(id) => match &self.kernel.locals[id.index as usize].ty {
                Ty::Array(elem, _) => Some((**elem).clone()),
                _ => None,
            },
            _ => None,
        }
        .ok_or("a cooperative load or store of an unknown array (a hesper bug)")?;
        let lanes = match elem {
            Ty::Vector(n, _) => n as usize,
            _ => 1,
        };
        let places = (0..size * size)
            .map(|at| {
                let (r, c) = (at / size, at % size);
                let offset = first * lanes
                    + if column {
                        c * stride * lanes + r
                    } else {
                        r * stride * lanes + c
                    };
                (offset / lanes, offset % lanes)
            })
            .collect();
        Ok((base.clone(), lanes, places))
    }

    /// One element of a storage buffer or workgroup array, as `me` reads it (checked).
    fn read_element(
        &mut self,
        me: u32,
        base: &Node,
        i: usize,
        inv: [u32; 3],
    ) -> Result<Value, Fault> {
        match &base.kind {
            ExprKind::Global(name) => {
                let len = self.buffer_len(name)?;
                if i >= len {
                    return Err(format!("read of `{name}[{i}]`, past its {len} elements"));
                }
                self.touch_storage(me, name, i, false)?;
                let elem = self.kernel.binding(name).expect("checked").elem.clone();
                Ok(decode(&self.run.buffers[name], &elem, i))
            }
            ExprKind::Local(id) => {
                let info = &self.kernel.locals[id.index as usize];
                let (hint, ty) = (info.hint.clone(), info.ty.clone());
                let Ty::Array(elem, len) = &ty else {
                    return Err(format!("indexing `{hint}`, not an array"));
                };
                if i >= *len as usize {
                    return Err(format!(
                        "read of workgroup array `{hint}[{i}]`, past its {len} elements"
                    ));
                }
                self.touch_shared(me, id.index, i, false, &hint)?;
                match self.shared.get(&id.index).and_then(|a| a[i].clone()) {
                    Some(v) => Ok(v),
                    None => {
                        if self.unwritten.is_none() {
                            self.unwritten = Some((format!("{hint}[{i}]"), inv, self.current_at));
                        }
                        Ok(Value::zero(elem))
                    }
                }
            }
            _ => Err("an element of a value read as memory (a hesper bug)".into()),
        }
    }

    /// Write element `i` of a storage buffer or workgroup array as `me` (checked), or, with
    /// `lane`, one lane of it.
    fn write_element(
        &mut self,
        me: u32,
        base: &Node,
        (i, lane): (usize, Option<usize>),
        v: Value,
    ) -> Result<(), Fault> {
        match &base.kind {
            ExprKind::Global(name) => {
                let len = self.buffer_len(name)?;
                if i >= len {
                    return Err(format!("write of `{name}[{i}]`, past its {len} elements"));
                }
                self.touch_storage(me, name, i, true)?;
                let elem = self.kernel.binding(name).expect("checked").elem.clone();
                let bytes = self.run.buffers.get_mut(name).expect("bound");
                let v = match lane {
                    Some(l) => with_lane(decode(bytes, &elem, i), l, &v)?,
                    None => v,
                };
                encode(bytes, &elem, i, &v);
                Ok(())
            }
            ExprKind::Local(id) => {
                let info = &self.kernel.locals[id.index as usize];
                let (hint, ty) = (info.hint.clone(), info.ty.clone());
                let Ty::Array(elem, len) = &ty else {
                    return Err(format!("indexing `{hint}`, not an array"));
                };
                let len = *len as usize;
                if i >= len {
                    return Err(format!(
                        "write of workgroup array `{hint}[{i}]`, past its {len} elements"
                    ));
                }
                self.touch_shared(me, id.index, i, true, &hint)?;
                let slots = self
                    .shared
                    .entry(id.index)
                    .or_insert_with(|| vec![None; len]);
                slots[i] = Some(match lane {
                    Some(l) => {
                        with_lane(slots[i].clone().unwrap_or_else(|| Value::zero(elem)), l, &v)?
                    }
                    None => v,
                });
                Ok(())
            }
            _ => Err("an element of a value written as memory (a hesper bug)".into()),
        }
    }

    /// `coopLoad`: every invocation of the subgroup reads the whole matrix.
    fn coop_load(
        &mut self,
        inv: &mut Invocation,
        place: &Node,
        stride: usize,
        column: bool,
        ty: &Ty,
    ) -> Result<Value, Fault> {
        let Ty::CoopMatrix { size, scalar, .. } = ty else {
            return Err("a cooperative load of a value that is no matrix (a hesper bug)".into());
        };
        let size = *size as usize;
        let (base, _, places) = self.coop_places(inv, place, (size, stride, column))?;
        let mut data = Vec::with_capacity(places.len());
        // Read as the subgroup's first invocation: the subgroup's own store after it is no race.
        let leader = inv.local_index - inv.local_index % self.run.subgroup_size;
        for (i, lane) in places {
            let v = self.read_element(leader, &base, i, inv.global_id)?;
            data.push(v.lanes()[lane].convert(*scalar));
        }
        Ok(Value::Matrix { size, data })
    }

    /// `coopStore`: the subgroup writes the matrix once (every invocation stores the same
    /// values, as the subgroup's first invocation, so they do not race with each other).
    fn coop_store(
        &mut self,
        inv: &mut Invocation,
        place: &Node,
        stride: usize,
        column: bool,
        value: Value,
    ) -> Result<(), Fault> {
        let Value::Matrix { size, data } = value else {
            return Err("a cooperative store of a value that is no matrix (a hesper bug)".into());
        };
        let (base, _, places) = self.coop_places(inv, place, (size, stride, column))?;
        let leader = inv.local_index - inv.local_index % self.run.subgroup_size;
        for ((i, lane), v) in places.into_iter().zip(data) {
            self.write_element(leader, &base, (i, Some(lane)), Value::Scalar(v))?;
        }
        Ok(())
    }

    fn touch_shared(
        &mut self,
        me: u32,
        array: u32,
        i: usize,
        write: bool,
        name: &str,
    ) -> Result<(), Fault> {
        let t = self.shared_touch.entry((array, i)).or_default();
        if let Some(w) = t.writer
            && w != me
        {
            return Err(format!(
                "race on workgroup array `{name}[{i}]`: written by invocation {w} of the workgroup and {} by invocation {me} with no barrier between",
                if write { "written" } else { "read" }
            ));
        }
        if write {
            if let Some(r) = t.readers.iter().find(|r| **r != me) {
                return Err(format!(
                    "race on workgroup array `{name}[{i}]`: read by invocation {r} of the workgroup and written by invocation {me} with no barrier between"
                ));
            }
            t.writer = Some(me);
        } else if !t.readers.contains(&me) && t.readers.len() < 2 {
            t.readers.push(me);
        }
        Ok(())
    }

    fn touch_storage(
        &mut self,
        local: u32,
        name: &str,
        i: usize,
        write: bool,
    ) -> Result<(), Fault> {
        let key = (name.to_string(), i);
        let me = StorageWrite {
            workgroup: self.workgroup_linear,
            local,
            phase: self.phase,
        };
        if let Some(w) = self.storage_writes.get(&key) {
            let same = w.workgroup == me.workgroup && w.local == me.local;
            let ordered = w.workgroup == me.workgroup && w.phase != me.phase;
            if !same && !ordered {
                let whom = if w.workgroup == me.workgroup {
                    format!("invocation {} of the same workgroup", w.local)
                } else {
                    format!("workgroup {}", w.workgroup)
                };
                return Err(format!(
                    "race on `{name}[{i}]`: written by {whom} and {} here",
                    if write { "written" } else { "read" }
                ));
            }
        }
        if write {
            self.storage_writes.insert(key, me);
        }
        Ok(())
    }

    fn store(&mut self, inv: &mut Invocation, target: &Node, v: Value) -> Result<(), Fault> {
        match &target.kind {
            ExprKind::Local(id) => {
                inv.locals[id.index as usize] = Some(v);
                Ok(())
            }
            ExprKind::Swizzle(base, lanes) if lanes.len() == 1 => {
                let i = "xyzw".find(lanes.as_str()).ok_or("a swizzle store")?;
                let mut whole = self.eval(inv, base)?;
                if let Value::Vector(l) = &mut whole {
                    l[i] = v.scalar()?;
                }
                self.store(inv, base, whole)
            }
            ExprKind::Index(base, index) => {
                let i = self.eval(inv, index)?.u32()? as usize;
                match &base.kind {
                    ExprKind::Global(_) => self.write_element(inv.local_index, base, (i, None), v),
                    ExprKind::Local(id)
                        if self.kernel.locals[id.index as usize].kind == VarKind::Workgroup =>
                    {
                        self.write_element(inv.local_index, base, (i, None), v)
                    }
                    _ => {
                        let mut whole = self.eval(inv, base)?;
                        match &mut whole {
                            Value::Array(items) => {
                                let n = items.len();
                                *items.get_mut(i).ok_or_else(|| {
                                    format!("write at {i}, past an array of {n} elements")
                                })? = v;
                            }
                            Value::Vector(lanes) => {
                                let n = lanes.len();
                                *lanes.get_mut(i).ok_or_else(|| {
                                    format!("write at {i}, past a vector of {n}")
                                })? = v.scalar()?;
                            }
                            Value::Scalar(_) | Value::Matrix { .. } => {
                                return Err("indexing a scalar or a cooperative matrix".into());
                            }
                        }
                        self.store(inv, base, whole)
                    }
                }
            }
            other => Err(format!("a store to {other:?} (not interpreted)")),
        }
    }
}

enum Flow {
    Next,
    Jump(usize),
    Done,
    Barrier,
}

fn placeholder() -> Invocation {
    Invocation {
        pc: 0,
        state: State::Done,
        locals: vec![],
        global_id: [0; 3],
        local_id: [0; 3],
        local_index: 0,
        subgroup_value: None,
    }
}

/// Element `i` of a buffer of `elem`s.
fn decode(bytes: &[u8], elem: &Ty, i: usize) -> Value {
    let (n, s) = match elem {
        Ty::Scalar(s) => (1, *s),
        Ty::Vector(n, s) => (*n as usize, *s),
        _ => unreachable!("buffers hold scalars and vectors"),
    };
    let size = s.size() as usize;
    let lanes: Vec<ScalarValue> = (0..n)
        .map(|l| {
            let at = (i * n + l) * size;
            let bits = match size {
                2 => u16::from_le_bytes([bytes[at], bytes[at + 1]]) as u32,
                _ => u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes")),
            };
            ScalarValue::from_bits(bits, s)
        })
        .collect();
    shape_like(elem, lanes)
}

fn encode(bytes: &mut [u8], elem: &Ty, i: usize, v: &Value) {
    let (n, s) = match elem {
        Ty::Scalar(s) => (1, *s),
        Ty::Vector(n, s) => (*n as usize, *s),
        _ => unreachable!("buffers hold scalars and vectors"),
    };
    let size = s.size() as usize;
    for (l, lane) in v.lanes().iter().take(n).enumerate() {
        let at = (i * n + l) * size;
        let bits = lane.bits();
        match size {
            2 => bytes[at..at + 2].copy_from_slice(&(bits as u16).to_le_bytes()),
            _ => bytes[at..at + 4].copy_from_slice(&bits.to_le_bytes()),
        }
    }
}

fn shape_like(ty: &Ty, lanes: Vec<ScalarValue>) -> Value {
    match ty {
        Ty::Vector(..) => Value::Vector(lanes),
        _ => Value::Scalar(lanes[0]),
    }
}

/// `element` with lane `lane` replaced by `v` (converted to the element's scalar type).
fn with_lane(element: Value, lane: usize, v: &Value) -> Result<Value, Fault> {
    let mut lanes = element.lanes();
    let old = *lanes
        .get(lane)
        .ok_or("a lane past the element (a hesper bug)")?;
    lanes[lane] = v.scalar()?.convert(old.scalar());
    Ok(match element {
        Value::Vector(_) => Value::Vector(lanes),
        _ => Value::Scalar(lanes[0]),
    })
}

/// `T(args…)`: a splat, a vector from parts, or a conversion.
fn construct(ty: &Ty, lanes: &[ScalarValue]) -> Result<Value, Fault> {
    match ty {
        Ty::Scalar(s) => Ok(Value::Scalar(
            lanes.first().ok_or("an empty construction")?.convert(*s),
        )),
        Ty::Vector(n, s) => {
            let n = *n as usize;
            let lanes: Vec<ScalarValue> = match lanes.len() {
                1 => vec![lanes[0].convert(*s); n],
                m if m == n => lanes.iter().map(|l| l.convert(*s)).collect(),
                m => return Err(format!("{m} values for a vector of {n}")),
            };
            Ok(Value::Vector(lanes))
        }
        Ty::CoopMatrix { .. } if lanes.is_empty() => Ok(Value::zero(ty)),
        other => Err(format!("constructing {other:?} (not interpreted)")),
    }
}

fn unary(op: UnaryOp, a: &Value) -> Result<Value, Fault> {
    lanewise1(a, |s| {
        Ok(match (op, s) {
            (UnaryOp::Neg, ScalarValue::F32(v)) => ScalarValue::F32(-v),
            (UnaryOp::Neg, ScalarValue::F16(v)) => ScalarValue::F16(-v),
            (UnaryOp::Neg, ScalarValue::I32(v)) => ScalarValue::I32(v.wrapping_neg()),
            (UnaryOp::Not, ScalarValue::Bool(v)) => ScalarValue::Bool(!v),
            (UnaryOp::Complement, ScalarValue::I32(v)) => ScalarValue::I32(!v),
            (UnaryOp::Complement, ScalarValue::U32(v)) => ScalarValue::U32(!v),
            (op, s) => return Err(format!("{op:?} of {s:?}")),
        })
    })
}

fn lanewise1(
    a: &Value,
    f: impl Fn(ScalarValue) -> Result<ScalarValue, Fault>,
) -> Result<Value, Fault> {
    match a {
        Value::Scalar(s) => Ok(Value::Scalar(f(*s)?)),
        Value::Vector(l) => Ok(Value::Vector(
            l.iter().map(|s| f(*s)).collect::<Result<_, _>>()?,
        )),
        Value::Matrix { size, data } => Ok(Value::Matrix {
            size: *size,
            data: data.iter().map(|s| f(*s)).collect::<Result<_, _>>()?,
        }),
        Value::Array(_) => Err("an operator on an array".into()),
    }
}

/// Apply `f` lane by lane, a scalar operand standing for every lane.
fn lanewise2(
    a: &Value,
    b: &Value,
    f: impl Fn(ScalarValue, ScalarValue) -> Result<ScalarValue, Fault>,
) -> Result<Value, Fault> {
    match (a, b) {
        (Value::Scalar(x), Value::Scalar(y)) => Ok(Value::Scalar(f(*x, *y)?)),
        (Value::Vector(x), Value::Scalar(y)) => Ok(Value::Vector(
            x.iter().map(|x| f(*x, *y)).collect::<Result<_, _>>()?,
        )),
        (Value::Scalar(x), Value::Vector(y)) => Ok(Value::Vector(
            y.iter().map(|y| f(*x, *y)).collect::<Result<_, _>>()?,
        )),
        (Value::Vector(x), Value::Vector(y)) => Ok(Value::Vector(
            x.iter()
                .zip(y)
                .map(|(x, y)| f(*x, *y))
                .collect::<Result<_, _>>()?,
        )),
        // Cooperative matrices: element by element, a scalar scaling every element.
        (Value::Matrix { size, data: x }, Value::Matrix { data: y, .. }) => Ok(Value::Matrix {
            size: *size,
            data: x
                .iter()
                .zip(y)
                .map(|(x, y)| f(*x, *y))
                .collect::<Result<_, _>>()?,
        }),
        (Value::Matrix { size, data }, Value::Scalar(y)) => Ok(Value::Matrix {
            size: *size,
            data: data.iter().map(|x| f(*x, *y)).collect::<Result<_, _>>()?,
        }),
        (Value::Scalar(x), Value::Matrix { size, data }) => Ok(Value::Matrix {
            size: *size,
            data: data.iter().map(|y| f(*x, *y)).collect::<Result<_, _>>()?,
        }),
        _ => Err("an operator on an array".into()),
    }
}

fn binary(op: BinaryOp, a: &Value, b: &Value) -> Result<Value, Fault> {
    use BinaryOp::*;
    use ScalarValue as S;
    lanewise2(a, b, |x, y| {
        Ok(match (x, y) {
            (S::F32(x), S::F32(y)) => match op {
                Add => S::F32(x + y),
                Sub => S::F32(x - y),
                Mul => S::F32(x * y),
                Div => S::F32(x / y),
                Rem => S::F32(x % y),
                _ => compare(op, x.partial_cmp(&y), x == y)?,
            },
            (S::F16(x), S::F16(y)) => {
                let (a, b) = (x.to_f32(), y.to_f32());
                let h = |v: f32| S::F16(f16::from_f32(v));
                match op {
                    Add => h(a + b),
                    Sub => h(a - b),
                    Mul => h(a * b),
                    Div => h(a / b),
                    Rem => h(a % b),
                    _ => compare(op, a.partial_cmp(&b), a == b)?,
                }
            }
            (S::U32(x), S::U32(y)) => match op {
                Add => S::U32(x.wrapping_add(y)),
                Sub => S::U32(x.wrapping_sub(y)),
                Mul => S::U32(x.wrapping_mul(y)),
                // WGSL: `x / 0` is `x`, `x % 0` is 0.
                Div => S::U32(x.checked_div(y).unwrap_or(x)),
                Rem => S::U32(if y == 0 { 0 } else { x % y }),
                BitAnd => S::U32(x & y),
                BitOr => S::U32(x | y),
                BitXor => S::U32(x ^ y),
                Shl => S::U32(x.wrapping_shl(y)),
                Shr => S::U32(x.wrapping_shr(y)),
                _ => compare(op, Some(x.cmp(&y)), x == y)?,
            },
            (S::I32(x), S::I32(y)) => match op {
                Add => S::I32(x.wrapping_add(y)),
                Sub => S::I32(x.wrapping_sub(y)),
                Mul => S::I32(x.wrapping_mul(y)),
                Div => S::I32(if y == 0 { x } else { x.wrapping_div(y) }),
                Rem => S::I32(if y == 0 { 0 } else { x.wrapping_rem(y) }),
                BitAnd => S::I32(x & y),
                BitOr => S::I32(x | y),
                BitXor => S::I32(x ^ y),
                _ => compare(op, Some(x.cmp(&y)), x == y)?,
            },
            (S::I32(x), S::U32(y)) => match op {
                Shl => S::I32(x.wrapping_shl(y)),
                Shr => S::I32(x.wrapping_shr(y)),
                _ => return Err(format!("{op:?} of i32 and u32")),
            },
            (S::Bool(x), S::Bool(y)) => match op {
                And | BitAnd => S::Bool(x && y),
                Or | BitOr => S::Bool(x || y),
                Eq => S::Bool(x == y),
                Ne => S::Bool(x != y),
                _ => return Err(format!("{op:?} of bools")),
            },
            (x, y) => return Err(format!("{op:?} of {x:?} and {y:?}")),
        })
    })
}

fn compare(op: BinaryOp, ord: Option<std::cmp::Ordering>, eq: bool) -> Result<ScalarValue, Fault> {
    use std::cmp::Ordering::*;
    Ok(ScalarValue::Bool(match op {
        BinaryOp::Eq => eq,
        BinaryOp::Ne => !eq,
        BinaryOp::Lt => ord == Some(Less),
        BinaryOp::Le => matches!(ord, Some(Less | Equal)),
        BinaryOp::Gt => ord == Some(Greater),
        BinaryOp::Ge => matches!(ord, Some(Greater | Equal)),
        other => return Err(format!("{other:?} is no comparison")),
    }))
}

/// A float function lane by lane, in f32 (f16 lanes rounded back).
fn float1(a: &Value, f: impl Fn(f32) -> f32) -> Result<Value, Fault> {
    lanewise1(a, |s| match s {
        ScalarValue::F32(v) => Ok(ScalarValue::F32(f(v))),
        ScalarValue::F16(v) => Ok(ScalarValue::F16(f16::from_f32(f(v.to_f32())))),
        other => Err(format!("a float function of {other:?}")),
    })
}

fn float2(a: &Value, b: &Value, f: impl Fn(f32, f32) -> f32) -> Result<Value, Fault> {
    lanewise2(a, b, |x, y| match (x, y) {
        (ScalarValue::F32(x), ScalarValue::F32(y)) => Ok(ScalarValue::F32(f(x, y))),
        (ScalarValue::F16(x), ScalarValue::F16(y)) => {
            Ok(ScalarValue::F16(f16::from_f32(f(x.to_f32(), y.to_f32()))))
        }
        (x, y) => Err(format!("a float function of {x:?} and {y:?}")),
    })
}

fn call(f: Func, v: &[Value], ty: &Ty) -> Result<Value, Fault> {
    use ScalarValue as S;
    Ok(match f {
        Func::Abs => lanewise1(&v[0], |s| {
            Ok(match s {
                S::F32(x) => S::F32(x.abs()),
                S::F16(x) => S::F16(f16::from_f32(x.to_f32().abs())),
                S::I32(x) => S::I32(x.wrapping_abs()),
                S::U32(x) => S::U32(x),
                other => return Err(format!("abs of {other:?}")),
            })
        })?,
        Func::Min | Func::Max => {
            let max = f == Func::Max;
            lanewise2(&v[0], &v[1], |x, y| {
                Ok(match (x, y) {
                    (S::F32(x), S::F32(y)) => S::F32(if max { x.max(y) } else { x.min(y) }),
                    (S::F16(x), S::F16(y)) => S::F16(if max { x.max(y) } else { x.min(y) }),
                    (S::U32(x), S::U32(y)) => S::U32(if max { x.max(y) } else { x.min(y) }),
                    (S::I32(x), S::I32(y)) => S::I32(if max { x.max(y) } else { x.min(y) }),
                    (x, y) => return Err(format!("{f:?} of {x:?} and {y:?}")),
                })
            })?
        }
        Func::Clamp => call(
            Func::Min,
            &[call(Func::Max, &v[..2], ty)?, v[2].clone()],
            ty,
        )?,
        Func::Exp => float1(&v[0], f32::exp)?,
        Func::Exp2 => float1(&v[0], f32::exp2)?,
        Func::Log => float1(&v[0], f32::ln)?,
        Func::Log2 => float1(&v[0], f32::log2)?,
        Func::Sqrt => float1(&v[0], f32::sqrt)?,
        Func::InverseSqrt => float1(&v[0], |x| 1.0 / x.sqrt())?,
        Func::Tanh => float1(&v[0], f32::tanh)?,
        Func::Sin => float1(&v[0], f32::sin)?,
        Func::Cos => float1(&v[0], f32::cos)?,
        Func::Floor => float1(&v[0], f32::floor)?,
        Func::Ceil => float1(&v[0], f32::ceil)?,
        Func::Round => float1(&v[0], f32::round_ties_even)?,
        Func::Fract => float1(&v[0], |x| x - x.floor())?,
        Func::Sign => float1(&v[0], |x| {
            if x > 0.0 {
                1.0
            } else if x < 0.0 {
                -1.0
            } else {
                0.0
            }
        })?,
        Func::Pow => float2(&v[0], &v[1], f32::powf)?,
        // As lavapipe evaluates it: the product rounded, then the sum (WGSL allows either;
        // NVIDIA's GPUs fuse the two). Bit for bit with lavapipe's GEMMs.
        Func::Fma => {
            let (a, b, c) = (v[0].lanes(), v[1].lanes(), v[2].lanes());
            let n = a.len().max(b.len()).max(c.len());
            let pick = |l: &[ScalarValue], i: usize| l[if l.len() == 1 { 0 } else { i }];
            let lanes: Result<Vec<S>, Fault> = (0..n)
                .map(|i| match (pick(&a, i), pick(&b, i), pick(&c, i)) {
                    (S::F32(a), S::F32(b), S::F32(c)) => Ok(S::F32(a * b + c)),
                    (S::F16(a), S::F16(b), S::F16(c)) => {
                        let product = f16::from_f32(a.to_f32() * b.to_f32());
                        Ok(S::F16(f16::from_f32(product.to_f32() + c.to_f32())))
                    }
                    (a, b, c) => Err(format!("fma of {a:?}, {b:?}, {c:?}")),
                })
                .collect();
            shape_like(ty, lanes?)
        }
        Func::Mix => {
            let t = &v[2];
            let d = binary(BinaryOp::Sub, &v[1], &v[0])?;
            binary(BinaryOp::Add, &v[0], &binary(BinaryOp::Mul, &d, t)?)?
        }
        Func::Dot => {
            let p = binary(BinaryOp::Mul, &v[0], &v[1])?.lanes();
            let mut acc = Value::Scalar(p[0]);
            for l in &p[1..] {
                acc = binary(BinaryOp::Add, &acc, &Value::Scalar(*l))?;
            }
            acc
        }
        Func::Bf16Round => lanewise1(&v[0], |s| match s {
            S::F32(x) => Ok(S::U32(bf16_bits(x))),
            other => Err(format!("bf16_round of {other:?}")),
        })?,
        Func::Bf16Pack => {
            let (a, b) = (v[0].scalar()?, v[1].scalar()?);
            match (a, b) {
                (S::F32(a), S::F32(b)) => {
                    Value::Scalar(S::U32(bf16_bits(a) | (bf16_bits(b) << 16)))
                }
                (a, b) => return Err(format!("bf16_pack of {a:?}, {b:?}")),
            }
        }
        Func::Bf16Low => Value::Scalar(S::F32(f32::from_bits(v[0].u32()? << 16))),
        Func::Bf16High => Value::Scalar(S::F32(f32::from_bits(v[0].u32()? & 0xFFFF_0000))),
        Func::CoopMultiplyAdd => coop_multiply_add(&v[0], &v[1], &v[2])?,
        Func::SubgroupAdd
        | Func::SubgroupMax
        | Func::SubgroupMin
        | Func::SubgroupShuffleXor
        | Func::SubgroupBroadcast => {
            unreachable!("subgroup operations are resolved by the subgroup")
        }
    })
}

/// f32 → bf16 bits, rounded to nearest even, NaN kept a NaN.
fn bf16_bits(x: f32) -> u32 {
    let b = x.to_bits();
    if x.is_nan() {
        return (b >> 16) | 0x40;
    }
    let round = 0x7FFF + ((b >> 16) & 1);
    (b.wrapping_add(round)) >> 16
}

/// One subgroup operation over its members' `values` (and second operands).
fn subgroup_op(f: Func, values: &[Value], extra: &[Option<Value>]) -> Result<Vec<Value>, Fault> {
    let n = values.len();
    match f {
        Func::SubgroupAdd | Func::SubgroupMax | Func::SubgroupMin => {
            let op: fn(&Value, &Value) -> Result<Value, Fault> = match f {
                Func::SubgroupAdd => |a, b| binary(BinaryOp::Add, a, b),
                Func::SubgroupMax => |a, b| call(Func::Max, &[a.clone(), b.clone()], &Ty::F32),
                _ => |a, b| call(Func::Min, &[a.clone(), b.clone()], &Ty::F32),
            };
            let mut acc = values[0].clone();
            for v in &values[1..] {
                acc = op(&acc, v)?;
            }
            Ok(vec![acc; n])
        }
        Func::SubgroupShuffleXor | Func::SubgroupBroadcast => (0..n)
            .map(|i| {
                let arg = extra[i]
                    .as_ref()
                    .ok_or("a shuffle without its lane")?
                    .u32()? as usize;
                let from = if f == Func::SubgroupShuffleXor {
                    i ^ arg
                } else {
                    arg
                };
                values.get(from).cloned().ok_or_else(|| {
                    format!("a subgroup shuffle from lane {from} of a subgroup of {n}")
                })
            })
            .collect(),
        other => Err(format!("{other:?} is no subgroup operation")),
    }
}

/// `a·b + c` of cooperative matrices: each product of two elements in f32 (exact for f16),
/// summed in f32 along `k` in order, onto `c`'s element; the result in `c`'s type.
fn coop_multiply_add(a: &Value, b: &Value, c: &Value) -> Result<Value, Fault> {
    let (
        Value::Matrix { size: n, data: a },
        Value::Matrix { data: b, .. },
        Value::Matrix { data: c, .. },
    ) = (a, b, c)
    else {
        return Err("coopMultiplyAdd of values that are not cooperative matrices".into());
    };
    let n = *n;
    let f32s = |m: &[ScalarValue]| -> Vec<f32> { m.iter().map(|s| s.as_f64() as f32).collect() };
    let (a, b) = (f32s(a), f32s(b));
    let data = (0..n * n)
        .map(|at| {
            let (i, j) = (at / n, at % n);
            let start = c[at].as_f64() as f32;
            let sum = (0..n).fold(start, |acc, k| acc + a[i * n + k] * b[k * n + j]);
            ScalarValue::F32(sum).convert(c[at].scalar())
        })
        .collect();
    Ok(Value::Matrix { size: n, data })
}
