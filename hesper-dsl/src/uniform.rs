//! Barriers and subgroup operations must be reached by every invocation of the workgroup (of the
//! subgroup) together: in *uniform control flow*. naga does not check this (browsers' Tint
//! does); a barrier that only some invocations reach hangs or corrupts a GPU. This walk rejects a
//! barrier or subgroup operation under a condition, loop or early exit that may differ between
//! invocations.
//!
//! It is conservative, after WGSL's own analysis: uniform values are literals, shape constants,
//! runtime scalars, `workgroup_id`, `num_workgroups`, `num_subgroups`, `subgroup_size`,
//! `arrayLength`, reads of read-only buffers at uniform indices, and `let`s, loop counters and
//! calls of memory-free functions built only from those. `var`s, workgroup memory, read-write
//! buffers and per-invocation builtins are not.

use std::collections::HashMap;

use crate::builder::{Block, KernelBuilder, Stmt, VarKind};
use crate::error::ErrorKind;
use crate::expr::{Builtin, ExprKind, Node, VarId};
use crate::ty::Access;

pub(crate) fn check(k: &KernelBuilder, body: &Block) -> Result<(), ErrorKind> {
    let pure = k
        .functions
        .iter()
        .map(|f| !f.body.iter().any(stmt_touches_memory) && !touches_memory(&f.value))
        .collect();
    let mut u = Uniformity {
        k,
        uniform: HashMap::new(),
        pure,
    };
    for f in &k.functions {
        // A function's barriers are judged as if it were called in uniform control flow with
        // uniform arguments; the call site is judged where it stands.
        for p in &f.params {
            u.uniform.insert(*p, true);
        }
        u.block(&f.body, true)?;
    }
    u.block(body, true).map(|_| ())
}

struct Uniformity<'a> {
    k: &'a KernelBuilder,
    /// Whether each `let`, loop counter and parameter seen so far holds a uniform value.
    uniform: HashMap<VarId, bool>,
    /// Whether each function reads no memory (so its result is uniform for uniform arguments).
    pure: Vec<bool>,
}

impl Uniformity<'_> {
    /// Walk `b` with control flow uniform or not (`ctx`); returns whether it is still uniform
    /// after `b` (an early exit taken by only some invocations leaves the rest non-uniform).
    fn block(&mut self, b: &Block, mut ctx: bool) -> Result<bool, ErrorKind> {
        for s in b {
            ctx = self.stmt(s, ctx)?;
        }
        Ok(ctx)
    }

    fn stmt(&mut self, s: &Stmt, ctx: bool) -> Result<bool, ErrorKind> {
        match s {
            Stmt::Let { id, value } => {
                self.subgroup_ops(value, ctx)?;
                let u = self.expr(value);
                self.uniform.insert(*id, u);
            }
            Stmt::Var { init, .. } => {
                if let Some(init) = init {
                    self.subgroup_ops(init, ctx)?;
                }
            }
            Stmt::Assign { value, .. } => self.subgroup_ops(value, ctx)?,
            Stmt::If {
                cond,
                then,
                otherwise,
            } => {
                self.subgroup_ops(cond, ctx)?;
                let inner = ctx && self.expr(cond);
                let after_then = self.block(then, inner)?;
                let after_else = self.block(otherwise, inner)?;
                return Ok(if inner {
                    // Uniform branches: only a non-uniform exit nested inside breaks uniformity.
                    after_then && after_else
                } else {
                    // Some invocations may take an exit the others do not.
                    ctx && !(escapes(then) || escapes(otherwise))
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
                let counter_uniform = self.expr(init) && self.expr(step);
                self.uniform.insert(*counter, counter_uniform);
                let inner = ctx && counter_uniform && self.expr(cond);
                return self.loop_body(body, ctx, inner);
            }
            Stmt::While { cond, body } => {
                let inner = ctx && self.expr(cond);
                return self.loop_body(body, ctx, inner);
            }
            Stmt::Loop { body } => return self.loop_body(body, ctx, ctx),
            Stmt::WorkgroupBarrier | Stmt::StorageBarrier if !ctx => {
                let op = if matches!(s, Stmt::WorkgroupBarrier) {
                    "workgroupBarrier"
                } else {
                    "storageBarrier"
                };
                return Err(ErrorKind::NonUniformBarrier { op: op.into() });
            }
            Stmt::WorkgroupBarrier
            | Stmt::StorageBarrier
            | Stmt::Break
            | Stmt::Continue
            | Stmt::Return
            | Stmt::Comment(_) => {}
        }
        Ok(ctx)
    }

    /// A loop body: if some invocations leave an iteration early, the later iterations are not
    /// uniform, so the body is walked again as non-uniform. After the loop, control is uniform
    /// again unless a `return` may have been taken by only some invocations.
    fn loop_body(&mut self, body: &Block, ctx: bool, inner: bool) -> Result<bool, ErrorKind> {
        let after = self.block(body, inner)?;
        if inner && !after {
            self.block(body, false)?;
        }
        Ok(ctx && !((!inner || !after) && contains_return(body)))
    }

    /// Subgroup operations need the subgroup's invocations together.
    fn subgroup_ops(&self, n: &Node, ctx: bool) -> Result<(), ErrorKind> {
        if !ctx && let Some(f) = find_subgroup_op(n) {
            return Err(ErrorKind::NonUniformBarrier { op: f.into() });
        }
        Ok(())
    }

    /// Whether `n` has the same value in every invocation of the workgroup.
    fn expr(&self, n: &Node) -> bool {
        match &n.kind {
            ExprKind::Literal(_)
            | ExprKind::Const(_)
            | ExprKind::Param(_)
            | ExprKind::ArrayLength(_) => true,
            ExprKind::Builtin(b) => matches!(
                b,
                Builtin::WorkgroupId
                    | Builtin::NumWorkgroups
                    | Builtin::NumSubgroups
                    | Builtin::SubgroupSize
            ),
            ExprKind::Local(id) => self.uniform.get(id).copied().unwrap_or(false),
            // A buffer or array by itself: only ever the base of an index, judged there.
            ExprKind::Global(_) => true,
            ExprKind::Index(base, index) => {
                let readable = match &base.kind {
                    ExprKind::Global(name) => self
                        .k
                        .bindings
                        .iter()
                        .any(|b| &b.name == name && b.access == Access::Read),
                    ExprKind::Local(id) => {
                        self.k.locals[id.index as usize].kind != VarKind::Workgroup
                            && self.expr(base)
                    }
                    _ => self.expr(base),
                };
                readable && self.expr(index)
            }
            ExprKind::Call(f, args) => !f.is_subgroup() && args.iter().all(|a| self.expr(a)),
            ExprKind::CallFunction(id, args) => {
                self.pure.get(id.index as usize).copied().unwrap_or(false)
                    && args.iter().all(|a| self.expr(a))
            }
            ExprKind::Unary(_, a) | ExprKind::Swizzle(a, _) | ExprKind::Bitcast(a) => self.expr(a),
            ExprKind::Binary(_, a, b) => self.expr(a) && self.expr(b),
            ExprKind::Select(a, b, c) => self.expr(a) && self.expr(b) && self.expr(c),
            ExprKind::Construct(args) => args.iter().all(|a| self.expr(a)),
            ExprKind::Error(_) => false,
        }
    }
}

/// Whether `b` may leave early (`break`, `continue`, `return`), anywhere inside.
fn escapes(b: &Block) -> bool {
    b.iter().any(|s| match s {
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
    b.iter().any(|s| match s {
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

fn find_subgroup_op(n: &Node) -> Option<&'static str> {
    let children: Vec<&Node> = match &n.kind {
        ExprKind::Call(f, _) if f.is_subgroup() => return Some(f.wgsl()),
        ExprKind::Call(_, args) | ExprKind::CallFunction(_, args) | ExprKind::Construct(args) => {
            args.iter().collect()
        }
        ExprKind::Unary(_, a) | ExprKind::Swizzle(a, _) | ExprKind::Bitcast(a) => vec![a],
        ExprKind::Binary(_, a, b) | ExprKind::Index(a, b) => vec![a, b],
        ExprKind::Select(a, b, c) => vec![a, b, c],
        _ => vec![],
    };
    children.into_iter().find_map(find_subgroup_op)
}

/// Whether an expression reads a buffer or workgroup memory.
fn touches_memory(n: &Node) -> bool {
    match &n.kind {
        ExprKind::Global(_) | ExprKind::ArrayLength(_) => true,
        ExprKind::Call(_, args) | ExprKind::CallFunction(_, args) | ExprKind::Construct(args) => {
            args.iter().any(touches_memory)
        }
        ExprKind::Unary(_, a) | ExprKind::Swizzle(a, _) | ExprKind::Bitcast(a) => touches_memory(a),
        ExprKind::Binary(_, a, b) | ExprKind::Index(a, b) => touches_memory(a) || touches_memory(b),
        ExprKind::Select(a, b, c) => touches_memory(a) || touches_memory(b) || touches_memory(c),
        _ => false,
    }
}

fn stmt_touches_memory(s: &Stmt) -> bool {
    match s {
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
        _ => false,
    }
}
