//! Barriers and subgroup operations must be reached by every invocation of the workgroup (of the
//! subgroup) together: in *uniform control flow*. naga does not check this (browsers' Tint
//! does); a barrier that only some invocations reach hangs or corrupts a GPU. This walk rejects a
//! barrier or subgroup operation under a condition, loop or early exit that may differ between
//! invocations. Cooperative-matrix operations are subgroup-wide too, and judged the same way.
//!
//! It is conservative, after WGSL's own analysis: uniform values are literals, shape constants,
//! runtime scalars, `workgroup_id`, `num_workgroups`, `num_subgroups`, `subgroup_size`,
//! `arrayLength`, reads of read-only buffers at uniform indices, and `let`s, loop counters and
//! calls of memory-free functions built only from those. `var`s, workgroup memory, read-write
//! buffers and per-invocation builtins are not.

use std::collections::{HashMap, HashSet};

use crate::builder::KernelBuilder;
use crate::error::{ErrorKind, Origin, PlacedError};
use crate::ir::{BinaryOp, Builtin, ExprKind, Func, Node, VarId};
use crate::ir::{Block, Placed, Stmt, VarKind};
use crate::ty::Access;

/// Why control flow may differ between invocations at a point, in words for the error
/// (`the \`if\` at src/k.rs:10:5 tests a value that depends on \`local_index\``); `None` while
/// it is uniform.
type Divergence = Option<String>;

/// What makes a value differ between invocations; `None` for a uniform value.
type Cause = Option<Culprit>;

#[derive(Clone)]
struct Culprit {
    /// The per-invocation value at the root (`\`local_index\``, `the \`var\` \`acc\``).
    root: String,
    /// The author's `let` it reaches the expression through, if any.
    via: Option<String>,
}

impl std::fmt::Display for Culprit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.via {
            Some(name) => write!(f, "`{name}` (which depends on {})", self.root),
            None => write!(f, "{}", self.root),
        }
    }
}

fn culprit(root: String) -> Cause {
    Some(Culprit { root, via: None })
}

pub(crate) fn check(k: &KernelBuilder, body: &Block) -> Result<(), PlacedError> {
    let pure = k
        .functions
        .iter()
        .map(|f| !f.body.iter().any(stmt_touches_memory) && !touches_memory(&f.value))
        .collect();
    let mut u = Uniformity {
        k,
        cause: HashMap::new(),
        pure,
        lets: HashMap::new(),
        conditions: vec![],
        uniform_loads: HashSet::new(),
    };
    for f in &k.functions {
        // A function's barriers are judged as if it were called in uniform control flow with
        // uniform arguments; the call site is judged where it stands.
        for p in &f.params {
            u.cause.insert(*p, None);
        }
        u.block(&f.body, None)?;
    }
    u.block(body, None).map(|_| ())
}

struct Uniformity<'a> {
    k: &'a KernelBuilder,
    /// What makes each `let`, loop counter and parameter seen so far differ between
    /// invocations (`None`: uniform).
    cause: HashMap<VarId, Cause>,
    /// Whether each function reads no memory (so its result is uniform for uniform arguments).
    pure: Vec<bool>,
    /// Every `let` seen so far and its value, and the `if` conditions around the statement
    /// being walked: what naga's own, stricter, analysis of cooperative operations reads.
    lets: HashMap<VarId, Node>,
    conditions: Vec<(Node, Origin)>,
    /// The `let`s bound by `workgroupUniformLoad`.
    uniform_loads: HashSet<VarId>,
}

impl Uniformity<'_> {
    /// Walk `b` with control flow uniform or not (`ctx`); returns whether it is still uniform
    /// after `b` (an early exit taken by only some invocations leaves the rest non-uniform).
    fn block(&mut self, b: &Block, mut ctx: Divergence) -> Result<Divergence, PlacedError> {
        for s in b {
            ctx = self.stmt(s, ctx).map_err(|e| e.or_at(s.at))?;
        }
        Ok(ctx)
    }

    fn stmt(&mut self, placed: &Placed, ctx: Divergence) -> Result<Divergence, PlacedError> {
        let at = placed.at;
        match &placed.stmt {
            Stmt::Let { id, value } => {
                self.subgroup_ops(value, &ctx)?;
                let cause = self.expr(value);
                self.cause.insert(*id, cause);
                self.lets.insert(*id, value.clone());
            }
            Stmt::Var { init, .. } => {
                if let Some(init) = init {
                    self.subgroup_ops(init, &ctx)?;
                }
            }
            Stmt::Assign { value, .. } => self.subgroup_ops(value, &ctx)?,
            Stmt::If {
                cond,
                then,
                otherwise,
            } => {
                self.subgroup_ops(cond, &ctx)?;
                let test = self.expr(cond).map(|c| {
                    format!(
                        "the `if` at {} tests a value that depends on {c}",
                        place(at)
                    )
                });
                let inner = ctx.clone().or(test.clone());
                self.conditions.push((cond.clone(), at));
                let after_then = self.block(then, inner.clone());
                let after_else = self.block(otherwise, inner.clone());
                self.conditions.pop();
                let (after_then, after_else) = (after_then?, after_else?);
                return Ok(match (ctx, test) {
                    // Uniform branches: only a non-uniform exit nested inside breaks uniformity.
                    (None, None) => after_then.or(after_else),
                    (Some(ctx), _) => Some(ctx),
                    // Some invocations may take an exit the others do not.
                    (None, Some(test)) => (escapes(then) || escapes(otherwise))
                        .then(|| format!("some invocations may leave early under {test}")),
                });
            }
            Stmt::For {
                counter,
                init,
                cond,
                step,
                body,
                ..
            } => {
                let counter_cause = self.expr(init).or_else(|| self.expr(step));
                self.cause.insert(*counter, counter_cause.clone());
                let why = counter_cause.or_else(|| self.expr(cond)).map(|c| {
                    format!(
                        "the loop at {} runs a number of times that depends on {c}",
                        place(at)
                    )
                });
                let inner = ctx.clone().or(why);
                return self.loop_body(body, ctx, inner, at);
            }
            Stmt::While { cond, body } => {
                let why = self.expr(cond).map(|c| {
                    format!(
                        "the loop at {} runs a number of times that depends on {c}",
                        place(at)
                    )
                });
                let inner = ctx.clone().or(why);
                return self.loop_body(body, ctx, inner, at);
            }
            Stmt::Loop { body } => return self.loop_body(body, ctx.clone(), ctx, at),
            Stmt::WorkgroupBarrier | Stmt::StorageBarrier if ctx.is_some() => {
                let op = if matches!(placed.stmt, Stmt::WorkgroupBarrier) {
                    "workgroupBarrier"
                } else {
                    "storageBarrier"
                };
                return Err(non_uniform(op, "workgroup", ctx));
            }
            Stmt::UniformLoad { id, place } => {
                self.subgroup_ops(place, &ctx)?;
                if ctx.is_some() {
                    return Err(non_uniform("workgroupUniformLoad", "workgroup", ctx));
                }
                if let Some(c) = self.expr_index(place) {
                    return Err(ErrorKind::NonUniformIndex {
                        op: "workgroupUniformLoad".into(),
                        because: c.to_string(),
                    }
                    .into());
                }
                // Uniform by definition, to this walk and to naga's.
                self.cause.insert(*id, None);
                self.uniform_loads.insert(*id);
            }
            Stmt::CoopStore {
                value,
                place,
                stride,
                major,
            } => {
                for e in [value, place, stride] {
                    self.subgroup_ops(e, &ctx)?;
                }
                if ctx.is_some() {
                    return Err(non_uniform(major.wgsl().1, "subgroup", ctx));
                }
            }
            Stmt::WorkgroupBarrier
            | Stmt::StorageBarrier
            | Stmt::Break
            | Stmt::Continue
            | Stmt::Return
            | Stmt::Comment(_)
            | Stmt::Debug { .. } => {}
        }
        Ok(ctx)
    }

    /// A loop body: if some invocations leave an iteration early, the later iterations are not
    /// uniform, so the body is walked again as non-uniform. After the loop, control is uniform
    /// again unless a `return` may have been taken by only some invocations.
    fn loop_body(
        &mut self,
        body: &Block,
        ctx: Divergence,
        inner: Divergence,
        at: Origin,
    ) -> Result<Divergence, PlacedError> {
        let after = self.block(body, inner.clone())?;
        if inner.is_none()
            && let Some(early) = &after
        {
            let later = format!(
                "{early}, and the loop at {} goes on without them",
                place(at)
            );
            self.block(body, Some(later))?;
        }
        if ctx.is_some() {
            return Ok(ctx);
        }
        let diverged = inner.or(after);
        Ok(match diverged {
            Some(why) if contains_return(body) => Some(format!(
                "some invocations may `return` inside the loop at {} ({why})",
                place(at)
            )),
            _ => None,
        })
    }

    /// Subgroup operations need the subgroup's invocations together. naga checks that of
    /// cooperative loads and multiply-adds itself, with a stricter analysis: every `if` around
    /// one must test a value naga proves uniform.
    fn subgroup_ops(&self, n: &Node, ctx: &Divergence) -> Result<(), PlacedError> {
        if ctx.is_some()
            && let Some(f) = find_subgroup_op(n)
        {
            return Err(non_uniform(f, "subgroup", ctx.clone()));
        }
        if let Some(op) = find_coop_op(n) {
            for (cond, at) in &self.conditions {
                if let Some(why) = self.varying_to_naga(cond) {
                    let because = format!(
                        "the `if` at {} tests a value that depends on {why}, which naga's \
                         analysis of cooperative operations counts as varying",
                        place(*at)
                    );
                    return Err(non_uniform(op, "subgroup", Some(because)));
                }
            }
        }
        Ok(())
    }

    /// Why naga's uniformity analysis counts `n` as varying between invocations, if it does:
    /// besides what [`Uniformity::expr`] finds, loop counters and function parameters (they are
    /// variables to naga), builtins other than `workgroup_id` and `num_workgroups`, and
    /// short-circuit `&&` / `||` (naga lowers them to a variable).
    fn varying_to_naga(&self, n: &Node) -> Option<String> {
        let any = |nodes: &[&Node]| nodes.iter().find_map(|a| self.varying_to_naga(a));
        match &n.kind {
            ExprKind::Literal(_)
            | ExprKind::Const(_)
            | ExprKind::Param(_)
            | ExprKind::ArrayLength(_)
            | ExprKind::Global(_) => None,
            ExprKind::Builtin(Builtin::WorkgroupId | Builtin::NumWorkgroups) => None,
            ExprKind::Builtin(b) => Some(format!("`{}`", b.info().1)),
            ExprKind::Local(id) if self.uniform_loads.contains(id) => None,
            ExprKind::Local(id) => match self.k.locals[id.index as usize].kind {
                VarKind::Let => match self.lets.get(id) {
                    Some(value) => self.varying_to_naga(value),
                    None => Some(format!("`{}`", self.hint(*id))),
                },
                VarKind::LoopCounter => Some(format!("the loop counter `{}`", self.hint(*id))),
                VarKind::Param => Some(format!("the parameter `{}`", self.hint(*id))),
                VarKind::Var => Some(format!("the `var` `{}`", self.hint(*id))),
                VarKind::Workgroup => Some(format!("workgroup memory `{}`", self.hint(*id))),
            },
            ExprKind::Binary(BinaryOp::And | BinaryOp::Or, ..) => Some(
                "a short-circuit `&&` or `||` (combine booleans with `&` or `|` instead)".into(),
            ),
            ExprKind::Index(base, index) => match &base.kind {
                ExprKind::Global(name)
                    if self
                        .k
                        .bindings
                        .iter()
                        .any(|b| &b.name == name && b.access != Access::Read) =>
                {
                    Some(format!("a read of the read-write buffer `{name}`"))
                }
                _ => any(&[base, index]),
            },
            ExprKind::Call(f, _) if f.is_subgroup_wide() => Some(format!("`{}(…)`", f.wgsl())),
            ExprKind::CoopLoad { .. } => Some("a cooperative load".into()),
            ExprKind::CallFunction(..) => Some("a function's result".into()),
            ExprKind::Call(_, args) | ExprKind::Construct(args) => {
                args.iter().find_map(|a| self.varying_to_naga(a))
            }
            ExprKind::Unary(_, a) | ExprKind::Swizzle(a, _) | ExprKind::Bitcast(a) => {
                self.varying_to_naga(a)
            }
            ExprKind::Binary(_, a, b) => any(&[a, b]),
            ExprKind::Select(a, b, c) => any(&[a, b, c]),
            ExprKind::Error(_) => Some("an invalid expression".into()),
        }
    }

    /// What makes `n` differ between the invocations of the workgroup; `None` when it cannot.
    fn expr(&self, n: &Node) -> Cause {
        let all = |nodes: &[&Node]| nodes.iter().find_map(|a| self.expr(a));
        match &n.kind {
            ExprKind::Literal(_)
            | ExprKind::Const(_)
            | ExprKind::Param(_)
            | ExprKind::ArrayLength(_) => None,
            ExprKind::Builtin(b) => match b {
                Builtin::WorkgroupId
                | Builtin::NumWorkgroups
                | Builtin::NumSubgroups
                | Builtin::SubgroupSize => None,
                other => culprit(format!("`{}`", other.info().1)),
            },
            ExprKind::Local(id) => match self.k.locals[id.index as usize].kind {
                VarKind::Var => culprit(format!("the `var` `{}`", self.hint(*id))),
                VarKind::Workgroup => culprit(format!("workgroup memory `{}`", self.hint(*id))),
                kind => {
                    let cause = self.cause.get(id).cloned();
                    let cause = cause.unwrap_or_else(|| culprit(format!("`{}`", self.hint(*id))));
                    cause.map(|c| Culprit {
                        via: (kind == VarKind::Let).then(|| self.hint(*id).to_string()),
                        ..c
                    })
                }
            },
            // A buffer or array by itself: only ever the base of an index, judged there.
            ExprKind::Global(_) => None,
            ExprKind::Index(base, index) => {
                let base_cause = match &base.kind {
                    ExprKind::Global(name) => self
                        .k
                        .bindings
                        .iter()
                        .any(|b| &b.name == name && b.access != Access::Read)
                        .then(|| Culprit {
                            root: format!("a read of the read-write buffer `{name}`"),
                            via: None,
                        }),
                    _ => self.expr(base),
                };
                base_cause.or_else(|| self.expr(index))
            }
            ExprKind::Call(f, _) if f.is_subgroup_wide() => culprit(format!("`{}(…)`", f.wgsl())),
            ExprKind::CoopLoad { major, .. } => culprit(format!("`{}(…)`", major.wgsl().0)),
            ExprKind::Call(_, args) | ExprKind::Construct(args) => {
                args.iter().find_map(|a| self.expr(a))
            }
            ExprKind::CallFunction(id, args) => {
                if self.pure.get(id.index as usize).copied().unwrap_or(false) {
                    args.iter().find_map(|a| self.expr(a))
                } else {
                    let name = &self.k.functions[id.index as usize].hint;
                    culprit(format!("a call of `{name}`, which reads memory"))
                }
            }
            ExprKind::Unary(_, a) | ExprKind::Swizzle(a, _) | ExprKind::Bitcast(a) => self.expr(a),
            ExprKind::Binary(_, a, b) => all(&[a, b]),
            ExprKind::Select(a, b, c) => all(&[a, b, c]),
            ExprKind::Error(_) => culprit("an invalid expression".into()),
        }
    }

    /// What makes the index of `place` (an element of a workgroup array) differ between
    /// invocations.
    fn expr_index(&self, place: &Node) -> Cause {
        match &place.kind {
            ExprKind::Index(_, index) => self.expr(index),
            _ => None,
        }
    }

    fn hint(&self, id: VarId) -> &str {
        &self.k.locals[id.index as usize].hint
    }
}

/// A place, without the combinator's name (the error names that once, first).
fn place(at: Origin) -> String {
    Origin { op: None, ..at }.to_string()
}

fn non_uniform(op: &str, scope: &'static str, because: Divergence) -> PlacedError {
    ErrorKind::NonUniformBarrier {
        op: op.into(),
        scope,
        because: because.unwrap_or_default(),
    }
    .into()
}

/// Whether `b` may leave early (`break`, `continue`, `return`), anywhere inside.
fn escapes(b: &Block) -> bool {
    b.iter().any(|s| match &s.stmt {
        Stmt::Break | Stmt::Continue | Stmt::Return => true,
        Stmt::If {
            then, otherwise, ..
        } => escapes(then) || escapes(otherwise),
        Stmt::For { body, .. } | Stmt::While { body, .. } | Stmt::Loop { body } => {
            contains_return(body)
        }
        _ => false,
    })
}

fn contains_return(b: &Block) -> bool {
    b.iter().any(|s| match &s.stmt {
        Stmt::Return => true,
        Stmt::If {
            then, otherwise, ..
        } => contains_return(then) || contains_return(otherwise),
        Stmt::For { body, .. } | Stmt::While { body, .. } | Stmt::Loop { body } => {
            contains_return(body)
        }
        _ => false,
    })
}

/// The first subgroup-wide operation in `n`: a subgroup builtin or cooperative-matrix operation.
fn find_subgroup_op(n: &Node) -> Option<&'static str> {
    find_op(n, &|kind| match kind {
        ExprKind::Call(f, _) if f.is_subgroup_wide() => Some(f.wgsl()),
        ExprKind::CoopLoad { major, .. } => Some(major.wgsl().0),
        _ => None,
    })
}

/// The first cooperative load or multiply-add in `n` (what naga's analysis checks).
fn find_coop_op(n: &Node) -> Option<&'static str> {
    find_op(n, &|kind| match kind {
        ExprKind::Call(Func::CoopMultiplyAdd, _) => Some(Func::CoopMultiplyAdd.wgsl()),
        ExprKind::CoopLoad { major, .. } => Some(major.wgsl().0),
        _ => None,
    })
}

/// The first node of `n`'s tree, outermost first, that `op` names.
fn find_op(n: &Node, op: &dyn Fn(&ExprKind) -> Option<&'static str>) -> Option<&'static str> {
    if let Some(name) = op(&n.kind) {
        return Some(name);
    }
    let children: Vec<&Node> = match &n.kind {
        ExprKind::Call(_, args) | ExprKind::CallFunction(_, args) | ExprKind::Construct(args) => {
            args.iter().collect()
        }
        ExprKind::Unary(_, a) | ExprKind::Swizzle(a, _) | ExprKind::Bitcast(a) => vec![a],
        ExprKind::Binary(_, a, b) | ExprKind::Index(a, b) => vec![a, b],
        ExprKind::Select(a, b, c) => vec![a, b, c],
        _ => vec![],
    };
    children.into_iter().find_map(|c| find_op(c, op))
}

/// Whether an expression reads a buffer or workgroup memory.
fn touches_memory(n: &Node) -> bool {
    match &n.kind {
        ExprKind::Global(_) | ExprKind::ArrayLength(_) | ExprKind::CoopLoad { .. } => true,
        ExprKind::Call(_, args) | ExprKind::CallFunction(_, args) | ExprKind::Construct(args) => {
            args.iter().any(touches_memory)
        }
        ExprKind::Unary(_, a) | ExprKind::Swizzle(a, _) | ExprKind::Bitcast(a) => touches_memory(a),
        ExprKind::Binary(_, a, b) | ExprKind::Index(a, b) => touches_memory(a) || touches_memory(b),
        ExprKind::Select(a, b, c) => touches_memory(a) || touches_memory(b) || touches_memory(c),
        _ => false,
    }
}

fn stmt_touches_memory(s: &Placed) -> bool {
    match &s.stmt {
        Stmt::Let { value, .. } => touches_memory(value),
        Stmt::Var { init, .. } => init.as_ref().is_some_and(touches_memory),
        Stmt::Assign { target, value, .. } => touches_memory(target) || touches_memory(value),
        Stmt::If {
            cond,
            then,
            otherwise,
        } => {
            touches_memory(cond)
                || then.iter().any(stmt_touches_memory)
                || otherwise.iter().any(stmt_touches_memory)
        }
        Stmt::For {
            init,
            cond,
            step,
            body,
            ..
        } => {
            touches_memory(init)
                || touches_memory(cond)
                || touches_memory(step)
                || body.iter().any(stmt_touches_memory)
        }
        Stmt::While { cond, body } => touches_memory(cond) || body.iter().any(stmt_touches_memory),
        Stmt::Loop { body } => body.iter().any(stmt_touches_memory),
        Stmt::CoopStore { .. } | Stmt::UniformLoad { .. } => true,
        _ => false,
    }
}
