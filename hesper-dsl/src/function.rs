//! WGSL functions a kernel declares: `k.function("silu", &["x"], |k, (x,)| x / (1.0 + (-&x).exp()))`
//! emits `fn silu(x: f32) -> f32 { … }` once, and `.call((e,))` calls it.

use std::marker::PhantomData;

use crate::builder::KernelBuilder;
use crate::error::ErrorKind;
use crate::expr::Expr;
use crate::ir::{ExprKind, Node, VarId, node};
use crate::ir::{FunctionDef, VarKind};
use crate::ty::{Ty, WgslType};

/// Argument lists of WGSL functions: tuples of one to four WGSL types.
pub trait FnArgs {
    /// The argument expressions: `(Expr<A>, Expr<B>, …)`.
    type Exprs;
    fn tys() -> Vec<Ty>;
    fn wrap(params: &[Node]) -> Self::Exprs;
    fn nodes(args: Self::Exprs) -> Vec<Node>;
}

macro_rules! fn_args {
    ($($t:ident $i:tt),*) => {
        impl<$($t: WgslType),*> FnArgs for ($($t,)*) {
            type Exprs = ($(Expr<$t>,)*);
            fn tys() -> Vec<Ty> {
                vec![$($t::ty()),*]
            }
            fn wrap(params: &[Node]) -> Self::Exprs {
                ($(Expr::<$t>::wrap(params[$i].clone()),)*)
            }
            fn nodes(args: Self::Exprs) -> Vec<Node> {
                vec![$(args.$i.node),*]
            }
        }
    };
}
fn_args!(A 0);
fn_args!(A 0, B 1);
fn_args!(A 0, B 1, C 2);
fn_args!(A 0, B 1, C 2, D 3);

/// A declared WGSL function taking `A` (a tuple) and returning `R`.
pub struct Function<A, R> {
    id: VarId,
    _t: PhantomData<fn(A) -> R>,
}

impl<A, R> Clone for Function<A, R> {
    fn clone(&self) -> Self {
        Function {
            id: self.id,
            _t: PhantomData,
        }
    }
}

impl<A: FnArgs, R: WgslType> Function<A, R> {
    /// A call of the function.
    pub fn call(&self, args: A::Exprs) -> Expr<R> {
        Expr::wrap(node(
            ExprKind::CallFunction(self.id, A::nodes(args)),
            R::ty(),
        ))
    }
}

impl KernelBuilder {
    /// Declare a WGSL function named from `name` (made fresh if taken), with parameters named
    /// `params`, whose body `body` records and whose value it returns. Declaring the same name
    /// again returns the first declaration (so helpers can declare on every call); with other
    /// types it is an error. Inside, the entry point's builtins are not available (pass them in)
    /// and `return_` is not allowed.
    #[track_caller]
    pub fn function<A: FnArgs, R: WgslType>(
        &mut self,
        name: &str,
        params: &[&str],
        body: impl FnOnce(&mut Self, A::Exprs) -> Expr<R>,
    ) -> Function<A, R> {
        let tys = A::tys();
        let at = self.origin();
        if let Some(i) = self.functions.iter().position(|f| f.hint == name) {
            let f = &self.functions[i];
            let same = f.ret == R::ty()
                && f.params.len() == tys.len()
                && f.params
                    .iter()
                    .zip(&tys)
                    .all(|(p, t)| self.locals[p.index as usize].ty == *t);
            if !same {
                self.error(ErrorKind::TypeMismatch {
                    item: format!("function `{name}` declared twice"),
                    expected: "the same parameter and return types".into(),
                    found: "other types".into(),
                });
            }
            return Function {
                id: VarId {
                    kernel: self.tag(),
                    index: i as u32,
                },
                _t: PhantomData,
            };
        }
        if params.len() != tys.len() {
            self.error(ErrorKind::TypeMismatch {
                item: format!("parameter names of function `{name}`"),
                expected: format!("{} names", tys.len()),
                found: format!("{}", params.len()),
            });
        }
        let ids: Vec<VarId> = tys
            .iter()
            .enumerate()
            .map(|(i, t)| {
                self.new_local(
                    params.get(i).copied().unwrap_or("arg"),
                    t.clone(),
                    VarKind::Param,
                )
            })
            .collect();
        let nodes: Vec<Node> = ids
            .iter()
            .zip(&tys)
            .map(|(id, t)| node(ExprKind::Local(*id), t.clone()))
            .collect();
        let (body, value) = self.function_body(|k| body(k, A::wrap(&nodes)).node);
        self.functions.push(FunctionDef {
            hint: name.into(),
            params: ids,
            ret: R::ty(),
            body,
            value,
            at,
        });
        Function {
            id: VarId {
                kernel: self.tag(),
                index: self.functions.len() as u32 - 1,
            },
            _t: PhantomData,
        }
    }
}
