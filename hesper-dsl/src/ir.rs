//! The IR every pass reads: expression trees ([`ExprNode`], shared through `Node`), the
//! statements that hold them ([`Stmt`] in blocks of [`Placed`] statements), the kernel's locals
//! and functions. The builder makes it, `check` and `uniform` check it, `consteval` folds it
//! and `wgsl` emits it.

use std::sync::Arc;

use crate::error::Origin;
use crate::ty::{Scalar, Ty};

pub(crate) type Node = Arc<ExprNode>;

/// One node of an expression tree, with its type.
#[derive(Debug, PartialEq)]
pub struct ExprNode {
    pub kind: ExprKind,
    pub ty: Ty,
    /// Nodes on the longest path down from here (a leaf is 1). The builder refuses statements
    /// whose expressions are deeper than [`MAX_EXPRESSION_DEPTH`]: the passes over a tree
    /// recurse.
    pub(crate) depth: u32,
}

/// The deepest expression tree a statement may hold; bind parts with `let_` to go further.
/// Every pass over the IR (checks, constant evaluation, emission) recurses down a tree, and in
/// a debug build a level costs kilobytes of stack: 128 levels stay far inside the 2 MiB of a
/// test thread.
pub const MAX_EXPRESSION_DEPTH: u32 = 128;

impl ExprKind {
    /// The depth of the deepest operand (0 for a leaf), without allocating: every node made
    /// asks.
    fn operand_depth(&self) -> u32 {
        let deepest = |nodes: &[Node]| nodes.iter().map(|n| n.depth).max().unwrap_or(0);
        match self {
            ExprKind::Literal(_)
            | ExprKind::Local(_)
            | ExprKind::Global(_)
            | ExprKind::Const(_)
            | ExprKind::Builtin(_)
            | ExprKind::Param(_)
            | ExprKind::ArrayLength(_)
            | ExprKind::Error(_) => 0,
            ExprKind::Unary(_, a) | ExprKind::Swizzle(a, _) | ExprKind::Bitcast(a) => a.depth,
            ExprKind::Binary(_, a, b)
            | ExprKind::Index(a, b)
            | ExprKind::CoopLoad {
                place: a,
                stride: b,
                ..
            } => a.depth.max(b.depth),
            ExprKind::Select(a, b, c) => a.depth.max(b.depth).max(c.depth),
            ExprKind::Call(_, args)
            | ExprKind::Construct(args)
            | ExprKind::CallFunction(_, args) => deepest(args),
        }
    }

    /// Moves the node's operands out (leaving it a leaf), for [`ExprNode`]'s drop.
    fn take_children(&mut self, into: &mut Vec<Node>) {
        match std::mem::replace(self, ExprKind::Error(String::new())) {
            ExprKind::Unary(_, a) | ExprKind::Swizzle(a, _) | ExprKind::Bitcast(a) => into.push(a),
            ExprKind::Binary(_, a, b)
            | ExprKind::Index(a, b)
            | ExprKind::CoopLoad {
                place: a,
                stride: b,
                ..
            } => into.extend([a, b]),
            ExprKind::Select(a, b, c) => into.extend([a, b, c]),
            ExprKind::Call(_, args)
            | ExprKind::Construct(args)
            | ExprKind::CallFunction(_, args) => into.extend(args),
            _ => {}
        }
    }
}

/// Dropped by a loop, not by recursion: a tree of a hundred thousand nested sums (which the
/// builder refuses, but which the author's code may still build and drop) must not overflow
/// the stack.
impl Drop for ExprNode {
    fn drop(&mut self) {
        let mut pending = Vec::new();
        self.kind.take_children(&mut pending);
        while let Some(child) = pending.pop() {
            // Only the last holder of a node takes its operands; shared ones just lose a count.
            if let Ok(mut node) = Arc::try_unwrap(child) {
                node.kind.take_children(&mut pending);
            }
        }
    }
}

/// A local value (`let`, `var`, loop counter) or workgroup array of one kernel, named when the
/// kernel is emitted so that names never collide. `kernel` tells builders apart, so that a
/// handle from another kernel is caught.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct VarId {
    pub(crate) kernel: u32,
    pub(crate) index: u32,
}

/// A literal value.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Literal {
    F32(f32),
    /// An f16 value, held as the f32 it equals exactly.
    F16(f32),
    I32(i32),
    U32(u32),
    Bool(bool),
}

impl Literal {
    pub fn ty(&self) -> Ty {
        Ty::Scalar(match self {
            Literal::F32(_) => Scalar::F32,
            Literal::F16(_) => Scalar::F16,
            Literal::I32(_) => Scalar::I32,
            Literal::U32(_) => Scalar::U32,
            Literal::Bool(_) => Scalar::Bool,
        })
    }
}

/// The entry point's builtin inputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Builtin {
    GlobalInvocationId,
    LocalInvocationId,
    LocalInvocationIndex,
    WorkgroupId,
    NumWorkgroups,
    SubgroupSize,
    SubgroupInvocationId,
    SubgroupId,
    NumSubgroups,
}

impl Builtin {
    /// (WGSL builtin name, parameter name in the emitted entry point, type)
    pub fn info(self) -> (&'static str, &'static str, Ty) {
        let v3 = Ty::Vector(3, Scalar::U32);
        match self {
            Builtin::GlobalInvocationId => ("global_invocation_id", "global_id", v3),
            Builtin::LocalInvocationId => ("local_invocation_id", "local_id", v3),
            Builtin::LocalInvocationIndex => ("local_invocation_index", "local_index", Ty::U32),
            Builtin::WorkgroupId => ("workgroup_id", "workgroup_id", v3),
            Builtin::NumWorkgroups => ("num_workgroups", "num_workgroups", v3),
            Builtin::SubgroupSize => ("subgroup_size", "subgroup_size", Ty::U32),
            Builtin::SubgroupInvocationId => {
                ("subgroup_invocation_id", "subgroup_invocation_id", Ty::U32)
            }
            Builtin::SubgroupId => ("subgroup_id", "subgroup_id", Ty::U32),
            Builtin::NumSubgroups => ("num_subgroups", "num_subgroups", Ty::U32),
        }
    }

    pub fn needs_subgroups(self) -> bool {
        matches!(
            self,
            Builtin::SubgroupSize
                | Builtin::SubgroupInvocationId
                | Builtin::SubgroupId
                | Builtin::NumSubgroups
        )
    }

    pub const ALL: [Builtin; 9] = [
        Builtin::GlobalInvocationId,
        Builtin::LocalInvocationId,
        Builtin::LocalInvocationIndex,
        Builtin::WorkgroupId,
        Builtin::NumWorkgroups,
        Builtin::SubgroupSize,
        Builtin::SubgroupInvocationId,
        Builtin::SubgroupId,
        Builtin::NumSubgroups,
    ];
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnaryOp {
    Neg,
    /// `!` on bool
    Not,
    /// `~` on integers
    Complement,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BinaryOp {
    Add,
    Sub,
    Mul,
    Div,
    Rem,
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
    BitAnd,
    BitOr,
    BitXor,
    Shl,
    Shr,
    /// `&&`
    And,
    /// `||`
    Or,
}

impl BinaryOp {
    pub fn wgsl(self) -> &'static str {
        use BinaryOp::*;
        match self {
            Add => "+",
            Sub => "-",
            Mul => "*",
            Div => "/",
            Rem => "%",
            Eq => "==",
            Ne => "!=",
            Lt => "<",
            Le => "<=",
            Gt => ">",
            Ge => ">=",
            BitAnd => "&",
            BitOr => "|",
            BitXor => "^",
            Shl => "<<",
            Shr => ">>",
            And => "&&",
            Or => "||",
        }
    }
    /// Whether `op=` exists in WGSL (arithmetic, bit and shift operators).
    pub fn is_compound(self) -> bool {
        !self.is_comparison() && !matches!(self, BinaryOp::And | BinaryOp::Or)
    }
    pub(crate) fn is_arithmetic(self) -> bool {
        matches!(
            self,
            BinaryOp::Add | BinaryOp::Sub | BinaryOp::Mul | BinaryOp::Div | BinaryOp::Rem
        )
    }
    pub(crate) fn is_comparison(self) -> bool {
        matches!(
            self,
            BinaryOp::Eq | BinaryOp::Ne | BinaryOp::Lt | BinaryOp::Le | BinaryOp::Gt | BinaryOp::Ge
        )
    }
}

/// Functions an expression can call: WGSL builtins, subgroup operations and hesper's helpers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Func {
    Abs,
    Min,
    Max,
    Clamp,
    Exp,
    Exp2,
    Log,
    Log2,
    Sqrt,
    InverseSqrt,
    Tanh,
    Sin,
    Cos,
    Pow,
    Fma,
    Floor,
    Ceil,
    Round,
    Fract,
    Sign,
    Mix,
    Dot,
    SubgroupAdd,
    SubgroupMax,
    SubgroupMin,
    SubgroupShuffleXor,
    SubgroupBroadcast,
    /// hesper helper: f32 → bf16 bits (round to nearest even, NaN kept), in the low 16 bits.
    Bf16Round,
    /// hesper helper: two f32 → one u32 holding two bf16 (first in the low half).
    Bf16Pack,
    /// hesper helper: the low bf16 of a u32 → f32.
    Bf16Low,
    /// hesper helper: the high bf16 of a u32 → f32.
    Bf16High,
    /// `coopMultiplyAdd(a, b, c)`: `a·b + c` on cooperative matrices.
    CoopMultiplyAdd,
}

impl Func {
    pub fn wgsl(self) -> &'static str {
        use Func::*;
        match self {
            Abs => "abs",
            Min => "min",
            Max => "max",
            Clamp => "clamp",
            Exp => "exp",
            Exp2 => "exp2",
            Log => "log",
            Log2 => "log2",
            Sqrt => "sqrt",
            InverseSqrt => "inverseSqrt",
            Tanh => "tanh",
            Sin => "sin",
            Cos => "cos",
            Pow => "pow",
            Fma => "fma",
            Floor => "floor",
            Ceil => "ceil",
            Round => "round",
            Fract => "fract",
            Sign => "sign",
            Mix => "mix",
            Dot => "dot",
            SubgroupAdd => "subgroupAdd",
            SubgroupMax => "subgroupMax",
            SubgroupMin => "subgroupMin",
            SubgroupShuffleXor => "subgroupShuffleXor",
            SubgroupBroadcast => "subgroupBroadcast",
            Bf16Round => "bf16_round",
            Bf16Pack => "bf16_pack",
            Bf16Low => "bf16_low",
            Bf16High => "bf16_high",
            CoopMultiplyAdd => "coopMultiplyAdd",
        }
    }
    pub fn is_subgroup(self) -> bool {
        matches!(
            self,
            Func::SubgroupAdd
                | Func::SubgroupMax
                | Func::SubgroupMin
                | Func::SubgroupShuffleXor
                | Func::SubgroupBroadcast
        )
    }
    /// Whether every invocation of the subgroup must reach it together: the subgroup
    /// operations and `coopMultiplyAdd`.
    pub fn is_subgroup_wide(self) -> bool {
        self.is_subgroup() || self == Func::CoopMultiplyAdd
    }
    pub fn is_helper(self) -> bool {
        matches!(
            self,
            Func::Bf16Round | Func::Bf16Pack | Func::Bf16Low | Func::Bf16High
        )
    }
}

#[derive(Debug, PartialEq)]
pub enum ExprKind {
    Literal(Literal),
    Local(VarId),
    /// A module-scope variable: storage buffer or workgroup array.
    Global(String),
    /// A shape constant (`const` at module scope).
    Const(String),
    Builtin(Builtin),
    /// A runtime scalar: `params.<name>`.
    Param(String),
    Unary(UnaryOp, Node),
    Binary(BinaryOp, Node, Node),
    Call(Func, Vec<Node>),
    Index(Node, Node),
    Swizzle(Node, String),
    /// `T(args)`: vector construction, splat, or scalar conversion.
    Construct(Vec<Node>),
    Bitcast(Node),
    /// `select(if_false, if_true, cond)`
    Select(Node, Node, Node),
    /// `arrayLength(&name)`
    ArrayLength(String),
    /// `coopLoadT<T>(&place, stride)` (row-major) or `coopLoad<T>(&place, stride)`
    /// (column-major): a cooperative matrix (the node's type) read from memory starting at
    /// `place`, an element of a storage buffer or workgroup array; `stride` elements of that
    /// array between rows (columns).
    CoopLoad {
        place: Node,
        stride: Node,
        major: Major,
    },
    /// A call of a WGSL function the kernel declared ([`crate::KernelBuilder::function`]),
    /// by its index in the kernel.
    CallFunction(VarId, Vec<Node>),
    /// Misuse found while building the expression; reported by the builder.
    Error(String),
}

/// How a cooperative matrix lies in memory: row by row (WGSL's `coopLoadT` / `coopStoreT`) or
/// column by column (`coopLoad` / `coopStore`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Major {
    Row,
    Column,
}

impl Major {
    /// The WGSL load and store functions of this layout.
    pub fn wgsl(self) -> (&'static str, &'static str) {
        match self {
            Major::Row => ("coopLoadT", "coopStoreT"),
            Major::Column => ("coopLoad", "coopStore"),
        }
    }
}

pub(crate) fn node(kind: ExprKind, ty: Ty) -> Node {
    let depth = 1 + kind.operand_depth();
    Arc::new(ExprNode { kind, ty, depth })
}

/// A statement block.
pub(crate) type Block = Vec<Placed>;

/// A statement and where its author recorded it.
#[derive(Clone, Debug)]
pub(crate) struct Placed {
    pub stmt: Stmt,
    pub at: Origin,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum VarKind {
    Let,
    Var,
    /// A `for` loop's counter: a `var` the body may read but not assign.
    LoopCounter,
    Workgroup,
    /// A parameter of a WGSL function.
    Param,
}

/// A WGSL function the kernel declared: its parameters (locals of kind `Param`), body and
/// returned value.
#[derive(Clone, Debug)]
pub(crate) struct FunctionDef {
    pub hint: String,
    pub params: Vec<VarId>,
    pub ret: Ty,
    pub body: Block,
    pub value: Node,
    /// Where the author declared it.
    pub at: Origin,
}

#[derive(Clone, Debug)]
pub(crate) struct LocalInfo {
    pub hint: String,
    pub ty: Ty,
    pub kind: VarKind,
    /// The hint came from the library (`global_index`'s `index`), not the kernel's author: a
    /// `let_` of this value renames it instead of binding it again.
    pub library_named: bool,
}

#[derive(Clone, Debug)]
pub(crate) enum Stmt {
    Let {
        id: VarId,
        value: Node,
    },
    Var {
        id: VarId,
        init: Option<Node>,
    },
    Assign {
        target: Node,
        op: Option<BinaryOp>,
        value: Node,
    },
    If {
        cond: Node,
        then: Block,
        otherwise: Block,
    },
    For {
        counter: VarId,
        init: Node,
        cond: Node,
        step_op: BinaryOp,
        step: Node,
        body: Block,
    },
    While {
        cond: Node,
        body: Block,
    },
    Loop {
        body: Block,
    },
    Break,
    Continue,
    Return,
    WorkgroupBarrier,
    StorageBarrier,
    /// `let id = workgroupUniformLoad(&place);`: a workgroup barrier, the read of `place` (an
    /// element of a workgroup array), another barrier; the value is uniform.
    UniformLoad {
        id: VarId,
        place: Node,
    },
    /// `coopStoreT(value, &place, stride);` (row-major) or `coopStore(…)` (column-major).
    CoopStore {
        value: Node,
        place: Node,
        stride: Node,
        major: Major,
    },
    Comment(String),
    /// `k.debug(label, value)`: printed by the interpreter with the invocation's id; nothing in
    /// the WGSL.
    Debug {
        label: String,
        value: Node,
    },
}

impl Stmt {
    /// The statement's own expressions (not those of the blocks it holds).
    pub(crate) fn expressions(&self) -> Vec<&Node> {
        match self {
            Stmt::Let { value, .. } | Stmt::Debug { value, .. } => vec![value],
            Stmt::UniformLoad { place, .. } => vec![place],
            Stmt::Var { init, .. } => init.iter().collect(),
            Stmt::Assign { target, value, .. } => vec![target, value],
            Stmt::If { cond, .. } | Stmt::While { cond, .. } => vec![cond],
            Stmt::For {
                init, cond, step, ..
            } => vec![init, cond, step],
            Stmt::CoopStore {
                value,
                place,
                stride,
                ..
            } => vec![value, place, stride],
            Stmt::Loop { .. }
            | Stmt::Break
            | Stmt::Continue
            | Stmt::Return
            | Stmt::WorkgroupBarrier
            | Stmt::StorageBarrier
            | Stmt::Comment(_) => vec![],
        }
    }
}
