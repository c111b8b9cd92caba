//! The one error type of the DSL: every message names the kernel and the item at fault.

use std::fmt;
use std::panic::Location;

/// A kernel that could not be built, and why.
#[derive(Clone, Debug, PartialEq)]
pub struct DslError {
    /// The kernel's name (from its [`KernelKey`](crate::KernelKey)).
    pub kernel: String,
    pub kind: ErrorKind,
    /// Where in the author's code: the builder call (or `#[kernel]` line) that recorded the
    /// statement at fault. `None` for what belongs to the kernel as a whole (device limits,
    /// naga).
    pub at: Option<Origin>,
}

/// A place in the kernel author's code: the caller of a builder method (every recording
/// method is `#[track_caller]`, and `#[kernel]` gives its calls the body's spans), and the DSL
/// operation it came through when that is a combinator (`workgroup_reduce`, `grid_stride`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Origin {
    pub location: &'static Location<'static>,
    /// The combinator whose call this is, if any.
    pub op: Option<&'static str>,
}

impl Origin {
    pub(crate) fn from_location(location: &'static Location<'static>) -> Self {
        Origin { location, op: None }
    }
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.location)?;
        if let Some(op) = self.op {
            write!(f, " (in `{op}`)")?;
        }
        Ok(())
    }
}

/// An error found walking a kernel's statements, and the statement's place once known.
#[derive(Debug)]
pub(crate) struct PlacedError {
    pub kind: ErrorKind,
    pub at: Option<Origin>,
}

impl PlacedError {
    /// Place an error not placed yet (by a nested statement) at `at`.
    pub fn or_at(self, at: Origin) -> Self {
        PlacedError {
            at: self.at.or(Some(at)),
            ..self
        }
    }

    pub fn into_error(self, kernel: &str) -> DslError {
        DslError::new(kernel, self.kind).at(self.at)
    }
}

impl From<ErrorKind> for PlacedError {
    fn from(kind: ErrorKind) -> Self {
        PlacedError { kind, at: None }
    }
}

/// What went wrong.
#[derive(Clone, Debug, PartialEq)]
pub enum ErrorKind {
    /// A store through the untyped path into a buffer declared read-only.
    StoreToReadOnly { binding: String },
    /// A name used twice for bindings, runtime scalars or workgroup arrays.
    DuplicateName { name: String },
    /// A name that is not a WGSL identifier, or one WGSL reserves.
    InvalidName { name: String, why: String },
    /// A value of the wrong type for `item`.
    TypeMismatch {
        item: String,
        expected: String,
        found: String,
    },
    /// An expression that could not be typed (bad swizzle, bad bitcast, untyped misuse).
    InvalidExpression { message: String },
    /// A subgroup operation in a kernel whose key did not ask for `Features::SUBGROUPS`.
    SubgroupsNotRequested { op: String },
    /// A cooperative-matrix type or operation in a kernel whose key did not ask for
    /// `Features::COOPERATIVE_MATRIX`.
    CoopNotRequested { op: String },
    /// A shape parameter the kernel reads but its key does not hold (or holds with another type).
    MissingShape { name: String, expected: String },
    /// A local used outside the scope that declared it, or a name from another kernel.
    OutOfScope { name: String },
    /// A barrier or subgroup operation where the workgroup's invocations may not all arrive
    /// together (under a condition, loop or early exit that can differ between invocations).
    NonUniformBarrier {
        op: String,
        /// `workgroup` for barriers, `subgroup` for subgroup operations.
        scope: &'static str,
        /// The condition, loop or early exit that makes it so.
        because: String,
    },
    /// `workgroupUniformLoad` at an index that may differ between invocations: its value would
    /// not be one for the whole workgroup.
    NonUniformIndex {
        op: String,
        /// What the index depends on.
        because: String,
    },
    /// `break` or `continue` outside a loop.
    NotInLoop { statement: String },
    /// An assignment to something that cannot be assigned (a `let`, a read-only buffer).
    NotAssignable { target: String },
    /// Workgroup memory over the device limit (naga does not check this).
    WorkgroupMemory { used: u32, limit: u32 },
    /// Workgroup size over a device limit.
    WorkgroupSize { size: [u32; 3], limit: String },
    /// Runtime scalars passed as immediates over the device's immediate size.
    ImmediateSize { used: u32, limit: u32 },
    /// An expression tree deeper than [`crate::MAX_EXPRESSION_DEPTH`] in one statement.
    ExpressionTooDeep { depth: u32, limit: u32 },
    /// Blocks (`if`, loops) nested deeper than [`crate::MAX_NESTING`].
    NestingTooDeep { limit: u32 },
    /// More statements than [`crate::MAX_STATEMENTS`].
    TooManyStatements { limit: u32 },
    /// A loop whose literal step leaves its counter unchanged (`+= 0`, `*= 1`, a shift by 0).
    EndlessLoop { counter: String, step: String },
    /// naga rejected the emitted WGSL. This is a hesper bug: the builder should have caught the
    /// misuse first. The WGSL is kept for the report.
    Naga { message: String, wgsl: String },
}

impl DslError {
    pub(crate) fn new(kernel: &str, kind: ErrorKind) -> Self {
        DslError {
            kernel: kernel.to_string(),
            kind,
            at: None,
        }
    }

    pub(crate) fn at(self, at: Option<Origin>) -> Self {
        DslError { at, ..self }
    }
}

impl fmt::Display for DslError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "kernel `{}`", self.kernel)?;
        if let Some(at) = &self.at {
            write!(f, " at {at}")?;
        }
        write!(f, ": ")?;
        match &self.kind {
            ErrorKind::StoreToReadOnly { binding } => {
                write!(f, "store into `{binding}`, which is declared read-only")
            }
            ErrorKind::DuplicateName { name } => write!(f, "the name `{name}` is declared twice"),
            ErrorKind::InvalidName { name, why } => write!(f, "invalid name `{name}`: {why}"),
            ErrorKind::TypeMismatch {
                item,
                expected,
                found,
            } => write!(f, "{item}: expected {expected}, found {found}"),
            ErrorKind::InvalidExpression { message } => write!(f, "invalid expression: {message}"),
            ErrorKind::SubgroupsNotRequested { op } => write!(
                f,
                "`{op}` needs subgroups, but the kernel key does not ask for Features::SUBGROUPS"
            ),
            ErrorKind::CoopNotRequested { op } => write!(
                f,
                "`{op}` needs cooperative matrices, but the kernel key does not ask for \
                 Features::COOPERATIVE_MATRIX"
            ),
            ErrorKind::MissingShape { name, expected } => write!(
                f,
                "shape parameter `{name}` ({expected}) is not in the kernel key"
            ),
            ErrorKind::OutOfScope { name } => write!(
                f,
                "`{name}` is used outside the scope that declares it (or comes from another kernel)"
            ),
            ErrorKind::NotInLoop { statement } => write!(f, "`{statement}` outside a loop"),
            ErrorKind::ExpressionTooDeep { depth, limit } => write!(
                f,
                "an expression {depth} operations deep, more than the {limit} a statement may hold: \
                 bind parts of it with `let_` (a sum of many terms: accumulate into a `var`)"
            ),
            ErrorKind::TooManyStatements { limit } => write!(
                f,
                "more than {limit} statements (naga's validation time grows with their square): \
                 write long unrolled code as a loop"
            ),
            ErrorKind::NestingTooDeep { limit } => {
                write!(f, "blocks (`if`, loops) nested more than {limit} deep")
            }
            ErrorKind::EndlessLoop { counter, step } => write!(
                f,
                "the loop over `{counter}` never ends: its step `{counter} {step}` leaves the counter unchanged"
            ),
            ErrorKind::NonUniformBarrier { op, scope, because } => write!(
                f,
                "`{op}` may be reached by only some invocations of the {scope}: {because}. \
                 Every invocation must reach it together. Compute the condition from values all \
                 invocations share (shapes, runtime scalars, `workgroup_id`, read-only buffers at \
                 such indices), or move the barrier or reduction out of the branch and guard only \
                 the loads and stores around it (invocations past the end contribute the \
                 reduction's identity: 0 to a sum)"
            ),
            ErrorKind::NonUniformIndex { op, because } => write!(
                f,
                "`{op}` reads an element whose index depends on {because}: every invocation must \
                 read the same element for the value to be uniform. Index it with values all \
                 invocations share (shapes, runtime scalars, `workgroup_id`, literals)"
            ),
            ErrorKind::NotAssignable { target } => write!(f, "`{target}` cannot be assigned"),
            ErrorKind::WorkgroupMemory { used, limit } => write!(
                f,
                "workgroup memory of {used} bytes is over the limit of {limit} bytes"
            ),
            ErrorKind::WorkgroupSize { size, limit } => write!(
                f,
                "workgroup size {}x{}x{} is over the limit: {limit}",
                size[0], size[1], size[2]
            ),
            ErrorKind::ImmediateSize { used, limit } => write!(
                f,
                "runtime scalars take {used} bytes of immediates, over the limit of {limit} bytes"
            ),
            ErrorKind::Naga { message, wgsl } => {
                write!(
                    f,
                    "naga rejected the emitted WGSL (a hesper bug):\n{message}\n--- WGSL ---\n{wgsl}"
                )
            }
        }
    }
}

impl std::error::Error for DslError {}
