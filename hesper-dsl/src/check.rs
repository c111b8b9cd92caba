//! The walk `finish` makes over a kernel body before emitting it: scopes, names from other
//! kernels, assignability, error nodes, features, and what the module needs (builtins, helpers,
//! `enable f16`).

use std::cell::RefCell;
use std::collections::{BTreeSet, HashMap};

use crate::builder::{Found, KernelBuilder};
use crate::consteval;
use crate::error::{ErrorKind, PlacedError};
use crate::ir::{Block, Placed, Stmt, VarKind};
use crate::ir::{Builtin, ExprKind, Func, Literal, Node, VarId};
use crate::kernel::{CoopMultiply, Features};
use crate::ty::{Access, Scalar, Ty};

struct Checker<'a> {
    k: &'a KernelBuilder,
    visible: Vec<Vec<VarId>>,
    /// Walking a function body: builtins are not available there.
    in_function: bool,
    builtins: BTreeSet<Builtin>,
    helpers: BTreeSet<Func>,
    uses_f16: bool,
    /// The first cooperative-matrix type seen, and every kind of multiply-add.
    coop_type: Option<Ty>,
    coop_multiplies: BTreeSet<CoopMultiply>,
    /// Every `let` seen so far and its value, for constant evaluation.
    lets: HashMap<VarId, Node>,
    memo: RefCell<HashMap<VarId, Option<consteval::Eval>>>,
}

pub(crate) fn check(k: &KernelBuilder, body: &Block) -> Result<Found, PlacedError> {
    let mut c = Checker {
        k,
        visible: vec![vec![]],
        in_function: false,
        builtins: BTreeSet::new(),
        helpers: BTreeSet::new(),
        uses_f16: false,
        coop_type: None,
        coop_multiplies: BTreeSet::new(),
        lets: HashMap::new(),
        memo: RefCell::new(HashMap::new()),
    };
    c.uses_f16 = k.bindings.iter().any(|b| b.elem.contains_f16())
        || k.locals.iter().any(|l| l.ty.contains_f16());
    for f in &k.functions {
        c.visible = vec![f.params.clone()];
        c.in_function = true;
        // The returned value sees the body's locals: check it inside the body's scope.
        for st in &f.body {
            c.placed(st)?;
        }
        let value = c.expr(&f.value).and_then(|()| {
            c.same_type(
                &format!("value of function `{}`", f.hint),
                &f.ret,
                &f.value.ty,
            )
        });
        value.map_err(|kind| PlacedError::from(kind).or_at(f.at))?;
    }
    c.visible = vec![vec![]];
    c.in_function = false;
    c.block(body)?;
    if c.helpers.contains(&Func::Bf16Pack) {
        c.helpers.insert(Func::Bf16Round);
    }
    Ok(Found {
        builtins: c.builtins.into_iter().collect(),
        helpers: c.helpers.into_iter().collect(),
        uses_f16: c.uses_f16,
        coop_type: c.coop_type,
        coop_multiplies: c.coop_multiplies.into_iter().collect(),
    })
}

impl Checker<'_> {
    fn block(&mut self, b: &Block) -> Result<(), PlacedError> {
        self.visible.push(vec![]);
        for s in b {
            self.placed(s)?;
        }
        self.visible.pop();
        Ok(())
    }

    /// A statement; its errors are placed where it was recorded (unless a nested one's were).
    fn placed(&mut self, s: &Placed) -> Result<(), PlacedError> {
        self.stmt(&s.stmt).map_err(|e| e.or_at(s.at))
    }

    fn declare(&mut self, id: VarId) {
        self.visible
            .last_mut()
            .expect("a block is always open while walking")
            .push(id);
    }

    fn stmt(&mut self, s: &Stmt) -> Result<(), PlacedError> {
        match s {
            Stmt::Debug { value, .. } => self.expr(value)?,
            Stmt::Let { id, value } => {
                self.expr(value)?;
                if matches!(value.ty, Ty::Array(_, 0)) {
                    return Err(ErrorKind::TypeMismatch {
                        item: format!("let `{}`", self.hint(*id)),
                        expected: "a value (a storage buffer cannot be bound with let)".into(),
                        found: value.ty.to_string(),
                    }
                    .into());
                }
                self.declare(*id);
                self.lets.insert(*id, value.clone());
            }
            Stmt::UniformLoad { id, place } => {
                self.expr(place)?;
                self.declare(*id);
            }
            Stmt::Var { id, init } => {
                if let Some(init) = init {
                    self.expr(init)?;
                    self.same_type(
                        &format!("var `{}`", self.hint(*id)),
                        &self.local_ty(*id),
                        &init.ty,
                    )?;
                }
                self.declare(*id);
            }
            Stmt::Assign { target, value, .. } => {
                self.expr(target)?;
                self.expr(value)?;
                self.assignable(target)?;
            }
            Stmt::If {
                cond,
                then,
                otherwise,
            } => {
                self.condition("if condition", cond)?;
                self.block(then)?;
                self.block(otherwise)?;
            }
            Stmt::For {
                counter,
                init,
                cond,
                step,
                body,
                ..
            } => {
                self.expr(init)?;
                self.visible.push(vec![*counter]);
                self.condition("for condition", cond)?;
                self.expr(step)?;
                self.block(body)?;
                self.visible.pop();
            }
            Stmt::While { cond, body } => {
                self.condition("while condition", cond)?;
                self.block(body)?;
            }
            Stmt::Loop { body } => self.block(body)?,
            Stmt::CoopStore {
                value,
                place,
                stride,
                major,
            } => {
                self.expr(value)?;
                if !matches!(value.ty, Ty::CoopMatrix { .. }) {
                    return Err(ErrorKind::TypeMismatch {
                        item: major.wgsl().1.into(),
                        expected: "a cooperative matrix".into(),
                        found: value.ty.to_string(),
                    }
                    .into());
                }
                self.coop_memory(major.wgsl().1, &value.ty, place, stride, true)?;
            }
            Stmt::Break
            | Stmt::Continue
            | Stmt::Return
            | Stmt::WorkgroupBarrier
            | Stmt::StorageBarrier
            | Stmt::Comment(_) => {}
        }
        Ok(())
    }

    fn hint(&self, id: VarId) -> &str {
        &self.k.locals[id.index as usize].hint
    }

    fn local_ty(&self, id: VarId) -> Ty {
        self.k.locals[id.index as usize].ty.clone()
    }

    fn same_type(&self, item: &str, expected: &Ty, found: &Ty) -> Result<(), ErrorKind> {
        if expected == found {
            Ok(())
        } else {
            Err(ErrorKind::TypeMismatch {
                item: item.into(),
                expected: expected.to_string(),
                found: found.to_string(),
            })
        }
    }

    fn condition(&mut self, item: &str, cond: &Node) -> Result<(), ErrorKind> {
        self.expr(cond)?;
        self.same_type(item, &Ty::BOOL, &cond.ty)
    }

    /// The place and stride of a cooperative load or store: an element of a storage buffer
    /// (read-write for a store) or workgroup array holding the matrix's element type, and a
    /// `u32` stride.
    fn coop_memory(
        &mut self,
        op: &str,
        matrix: &Ty,
        place: &Node,
        stride: &Node,
        store: bool,
    ) -> Result<(), ErrorKind> {
        self.expr(place)?;
        self.expr(stride)?;
        self.same_type(&format!("stride of `{op}`"), &Ty::U32, &stride.ty)?;
        let memory = match &place.kind {
            ExprKind::Index(base, _) => match &base.kind {
                ExprKind::Global(name) => {
                    let writable = self
                        .k
                        .bindings
                        .iter()
                        .any(|b| &b.name == name && b.access == Access::ReadWrite);
                    if store && !writable {
                        return Err(ErrorKind::StoreToReadOnly {
                            binding: name.clone(),
                        });
                    }
                    true
                }
                ExprKind::Local(id) => self.k.locals[id.index as usize].kind == VarKind::Workgroup,
                _ => false,
            },
            _ => false,
        };
        if !memory {
            return Err(ErrorKind::TypeMismatch {
                item: format!("memory of `{op}`"),
                expected: "an element of a storage buffer or workgroup array".into(),
                found: format!("{:?}", place.kind),
            });
        }
        let element = &place.ty;
        if !element.is_scalar_or_vector() || element.scalar() != matrix.scalar() {
            // A `vec4<u32>` view of f16 data passes naga and fails in the driver, silently.
            return Err(ErrorKind::TypeMismatch {
                item: format!("memory of `{op}` ({matrix})"),
                expected: format!(
                    "an array of {} (or of vectors of it)",
                    matrix.scalar().wgsl()
                ),
                found: format!("an array of {element}"),
            });
        }
        Ok(())
    }

    /// A cooperative-matrix type: allowed by the key, of a size WGSL spells.
    fn coop_type(&mut self, op: &str, ty: &Ty) -> Result<(), ErrorKind> {
        if !self.k.has_feature(Features::COOPERATIVE_MATRIX) {
            return Err(ErrorKind::CoopNotRequested { op: op.into() });
        }
        if let Ty::CoopMatrix { size, scalar, .. } = ty {
            if !matches!(size, 8 | 16) || !matches!(scalar, Scalar::F16 | Scalar::F32) {
                return Err(ErrorKind::TypeMismatch {
                    item: "cooperative matrix".into(),
                    expected: "8×8 or 16×16 (what WGSL spells) of f16 or f32".into(),
                    found: ty.to_string(),
                });
            }
            self.coop_type.get_or_insert_with(|| ty.clone());
        }
        Ok(())
    }

    fn assignable(&self, target: &Node) -> Result<(), ErrorKind> {
        let not = |what: String| Err(ErrorKind::NotAssignable { target: what });
        match &target.kind {
            ExprKind::Local(id) => match self.k.locals[id.index as usize].kind {
                VarKind::Var | VarKind::Workgroup => Ok(()),
                VarKind::Let => not(format!("let {}", self.hint(*id))),
                VarKind::LoopCounter => not(format!("loop counter {}", self.hint(*id))),
                VarKind::Param => not(format!("parameter {}", self.hint(*id))),
            },
            ExprKind::Global(name) => match self.k.bindings.iter().find(|b| &b.name == name) {
                Some(b) if b.access == Access::ReadWrite => Ok(()),
                Some(_) => Err(ErrorKind::StoreToReadOnly {
                    binding: name.clone(),
                }),
                None => Err(ErrorKind::OutOfScope { name: name.clone() }),
            },
            ExprKind::Index(base, _) => self.assignable(base),
            ExprKind::Swizzle(base, pattern) if pattern.len() == 1 => self.assignable(base),
            other => not(format!("{other:?}")),
        }
    }

    fn expr(&mut self, n: &Node) -> Result<(), ErrorKind> {
        self.expr_parts(n)?;
        // Children first, so the smallest failing constant subexpression is the one reported.
        let scope = consteval::Scope {
            key: self.k.key(),
            lets: &self.lets,
            memo: &self.memo,
        };
        let constant = match consteval::check(n, &scope) {
            Some(Err(why)) => Err(why),
            _ => consteval::check_operands(n, &scope),
        };
        constant.map_err(|why| ErrorKind::InvalidExpression {
            message: format!("a constant subexpression fails WGSL's shader-creation checks: {why}"),
        })
    }

    fn expr_parts(&mut self, n: &Node) -> Result<(), ErrorKind> {
        if n.ty.contains_f16() {
            self.uses_f16 = true;
        }
        if n.ty.contains_coop_matrix() {
            self.coop_type("a cooperative matrix", &n.ty)?;
        }
        match &n.kind {
            ExprKind::Error(message) => {
                return Err(ErrorKind::InvalidExpression {
                    message: message.clone(),
                });
            }
            ExprKind::Literal(l) => {
                if let Literal::F32(v) | Literal::F16(v) = l
                    && !v.is_finite()
                {
                    return Err(ErrorKind::InvalidExpression {
                        message: format!("WGSL has no literal for {v}"),
                    });
                }
            }
            ExprKind::Local(id) => {
                let ours = id.kernel == self.k.tag() && (id.index as usize) < self.k.locals.len();
                let visible = ours
                    && (self.k.locals[id.index as usize].kind == VarKind::Workgroup
                        || self.visible.iter().any(|s| s.contains(id)));
                if !visible {
                    let name = if ours {
                        self.hint(*id).to_string()
                    } else {
                        format!("local #{} of another kernel", id.index)
                    };
                    return Err(ErrorKind::OutOfScope { name });
                }
            }
            ExprKind::Global(name) | ExprKind::ArrayLength(name) => {
                let Some(b) = self.k.bindings.iter().find(|b| &b.name == name) else {
                    return Err(ErrorKind::OutOfScope { name: name.clone() });
                };
                if let ExprKind::Global(_) = n.kind {
                    self.same_type(
                        &format!("binding `{name}`"),
                        &Ty::Array(Box::new(b.elem.clone()), 0),
                        &n.ty,
                    )?;
                }
            }
            ExprKind::Param(name) => {
                let Some(p) = self.k.params.iter().find(|p| &p.name == name) else {
                    return Err(ErrorKind::OutOfScope { name: name.clone() });
                };
                self.same_type(
                    &format!("runtime scalar `{name}`"),
                    &Ty::Scalar(p.ty),
                    &n.ty,
                )?;
            }
            ExprKind::Const(name) => {
                let Some(v) = self.k.key().get(name) else {
                    return Err(ErrorKind::MissingShape {
                        name: name.clone(),
                        expected: n.ty.to_string(),
                    });
                };
                self.same_type(&format!("shape parameter `{name}`"), &v.ty(), &n.ty)?;
            }
            ExprKind::Builtin(b) if self.in_function => {
                return Err(ErrorKind::InvalidExpression {
                    message: format!(
                        "the builtin `{}` is used inside a WGSL function; pass it in as an argument",
                        b.info().0
                    ),
                });
            }
            ExprKind::Builtin(b) => {
                if b.needs_subgroups() && !self.k.has_feature(Features::SUBGROUPS) {
                    return Err(ErrorKind::SubgroupsNotRequested {
                        op: b.info().0.into(),
                    });
                }
                self.builtins.insert(*b);
            }
            ExprKind::Unary(_, a) | ExprKind::Swizzle(a, _) | ExprKind::Bitcast(a) => {
                self.expr(a)?
            }
            ExprKind::Binary(_, a, b) | ExprKind::Index(a, b) => {
                self.expr(a)?;
                self.expr(b)?;
            }
            ExprKind::Select(a, b, c) => {
                self.expr(a)?;
                self.expr(b)?;
                self.expr(c)?;
                if n.ty.contains_coop_matrix() {
                    return Err(ErrorKind::InvalidExpression {
                        message: format!("`select` between cooperative matrices ({})", n.ty),
                    });
                }
            }
            ExprKind::CoopLoad {
                place,
                stride,
                major,
            } => {
                let op = major.wgsl().0;
                self.coop_type(op, &n.ty)?;
                self.coop_memory(op, &n.ty, place, stride, false)?;
            }
            ExprKind::Call(f, args) => {
                if f.is_subgroup() && !self.k.has_feature(Features::SUBGROUPS) {
                    return Err(ErrorKind::SubgroupsNotRequested {
                        op: f.wgsl().into(),
                    });
                }
                if f.is_helper() {
                    self.helpers.insert(*f);
                }
                for a in args {
                    self.expr(a)?;
                }
                if let (Func::CoopMultiplyAdd, [a, _, c]) = (f, args.as_slice())
                    && let (Ty::CoopMatrix { size, scalar, .. }, Ty::CoopMatrix { scalar: sc, .. }) =
                        (&a.ty, &c.ty)
                {
                    self.coop_multiplies.insert(CoopMultiply {
                        size: *size as u32,
                        ab: *scalar,
                        c: *sc,
                    });
                }
            }
            ExprKind::Construct(args) => {
                for a in args {
                    self.expr(a)?;
                }
            }
            ExprKind::CallFunction(id, args) => {
                let f = (id.kernel == self.k.tag())
                    .then(|| self.k.functions.get(id.index as usize))
                    .flatten()
                    .ok_or_else(|| ErrorKind::OutOfScope {
                        name: format!("function #{} of another kernel", id.index),
                    })?;
                if args.len() != f.params.len() {
                    return Err(ErrorKind::TypeMismatch {
                        item: format!("call of `{}`", f.hint),
                        expected: format!("{} arguments", f.params.len()),
                        found: args.len().to_string(),
                    });
                }
                for (a, p) in args.iter().zip(&f.params) {
                    self.expr(a)?;
                    self.same_type(
                        &format!("argument of `{}`", f.hint),
                        &self.local_ty(*p),
                        &a.ty,
                    )?;
                }
            }
        }
        Ok(())
    }
}
