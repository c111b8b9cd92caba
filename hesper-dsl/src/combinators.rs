//! Combinators: the loops and reductions every kernel family needs, written once.
//!
//! - [`KernelBuilder::global_index`]: a flat 1-D index that stays right past 65535 workgroups
//!   (the executor dispatches 2-D, `x` up to 65535 and `y` the rest).
//! - [`KernelBuilder::grid_stride`]: each invocation walks `i, i + total, …` below `n`.
//! - [`KernelBuilder::row_loop`]: the invocations of one workgroup stride over one row.
//! - [`KernelBuilder::workgroup_reduce`]: sum, max or min over the workgroup (shared-memory tree, or
//!   subgroup operations when the kernel key asks for subgroups).

use crate::builder::{Indexable, KernelBuilder};
use crate::expr::{Expr, IntoExpr, lit};
use crate::ir::BinaryOp;
use crate::kernel::Features;
use crate::ty::{F16, HostShareable, Numeric, Vec2, Vec3, Vec4};

/// What a reduction computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reduce {
    Sum,
    Max,
    Min,
}

/// Types a workgroup reduction works on: their identity elements for sum, max and min.
pub trait Reducible: Numeric + HostShareable + Sized {
    fn zero() -> Expr<Self>;
    /// The lowest finite value (the identity of max over finite values).
    fn lowest() -> Expr<Self>;
    /// The highest finite value (the identity of min over finite values).
    fn highest() -> Expr<Self>;
}

macro_rules! reducible_scalar {
    ($t:ty, $zero:expr, $lowest:expr, $highest:expr) => {
        impl Reducible for $t {
            fn zero() -> Expr<$t> {
                $zero
            }
            fn lowest() -> Expr<$t> {
                $lowest
            }
            fn highest() -> Expr<$t> {
                $highest
            }
        }
    };
}
reducible_scalar!(f32, lit(0.0f32), lit(f32::MIN), lit(f32::MAX));
reducible_scalar!(u32, lit(0u32), lit(0u32), lit(u32::MAX));
reducible_scalar!(i32, lit(0i32), lit(i32::MIN), lit(i32::MAX));
reducible_scalar!(
    F16,
    Expr::<F16>::lit(0.0),
    Expr::<F16>::lit(-65504.0),
    Expr::<F16>::lit(65504.0)
);

macro_rules! reducible_vector {
    ($($v:ident<$s:ty>),*) => {$(
        impl Reducible for $v<$s> {
            fn zero() -> Expr<$v<$s>> {
                Expr::<$v<$s>>::splat(<$s as Reducible>::zero())
            }
            fn lowest() -> Expr<$v<$s>> {
                Expr::<$v<$s>>::splat(<$s as Reducible>::lowest())
            }
            fn highest() -> Expr<$v<$s>> {
                Expr::<$v<$s>>::splat(<$s as Reducible>::highest())
            }
        }
    )*};
}
reducible_vector!(
    Vec2<f32>,
    Vec3<f32>,
    Vec4<f32>,
    Vec2<u32>,
    Vec4<u32>,
    Vec2<i32>,
    Vec4<i32>
);

fn combine<T: Reducible>(op: Reduce, a: Expr<T>, b: Expr<T>) -> Expr<T> {
    match op {
        Reduce::Sum => a + b,
        Reduce::Max => a.max(b),
        Reduce::Min => a.min(b),
    }
}

fn identity<T: Reducible>(op: Reduce) -> Expr<T> {
    match op {
        Reduce::Sum => T::zero(),
        Reduce::Max => T::lowest(),
        Reduce::Min => T::highest(),
    }
}

impl KernelBuilder {
    /// This invocation's flat index over a 1-D problem, bound once:
    /// `(workgroup_id.y * num_workgroups.x + workgroup_id.x) * WG + local_index`.
    /// Right for any number of workgroups up to 65535², given a 2-D dispatch.
    #[track_caller]
    pub fn global_index(&mut self) -> Expr<u32> {
        self.invocation_indexed.set(true);
        let lid = self.local_index();
        let wg = self.invocations();
        let group = self.workgroup_index();
        self.within("global_index", |k| {
            k.let_library_named("index", group * wg + lid)
        })
    }

    /// This workgroup's flat index over a 1-D grid of workgroups,
    /// `workgroup_id.y * num_workgroups.x + workgroup_id.x` (for one workgroup per row: the
    /// executor lays more than 65535 out 2-D). Not bound: the caller names it.
    #[track_caller]
    pub fn workgroup_index(&self) -> Expr<u32> {
        if self.workgroup_indexed.get().is_none() {
            self.workgroup_indexed.set(Some(self.origin()));
        }
        let wid = self.workgroup_id();
        wid.y() * self.num_workgroups().x() + wid.x()
    }

    /// All invocations of the dispatch: `num_workgroups.x * num_workgroups.y * WG`, bound once.
    #[track_caller]
    pub fn total_invocations(&mut self) -> Expr<u32> {
        let nwg = self.num_workgroups();
        let wg = self.invocations();
        self.within("total_invocations", |k| {
            k.let_library_named("total_invocations", nwg.x() * nwg.y() * wg)
        })
    }

    /// A grid-stride loop: `body(i)` for `i = global_index; i < n; i += total_invocations`, so any
    /// dispatch size covers any `n`.
    #[track_caller]
    pub fn grid_stride(&mut self, n: impl IntoExpr<u32>, body: impl FnOnce(&mut Self, Expr<u32>)) {
        self.grid_stride_as("i", n, body);
    }

    /// [`KernelBuilder::grid_stride`] with its counter named from `hint` in the WGSL.
    #[track_caller]
    pub fn grid_stride_as(
        &mut self,
        hint: &str,
        n: impl IntoExpr<u32>,
        body: impl FnOnce(&mut Self, Expr<u32>),
    ) {
        self.within("grid_stride", |k| {
            let start = k.global_index();
            let step = k.total_invocations();
            k.for_step(hint, start, n, step, |k, i| k.unpinned(|k| body(k, i)));
        })
    }

    /// A row loop: the workgroup's invocations stride over `0..len`, each starting at its
    /// `local_index` (`body(column)`).
    #[track_caller]
    pub fn row_loop(&mut self, len: impl IntoExpr<u32>, body: impl FnOnce(&mut Self, Expr<u32>)) {
        self.row_loop_as("col", len, body);
    }

    /// [`KernelBuilder::row_loop`] with its counter named from `hint` in the WGSL.
    #[track_caller]
    pub fn row_loop_as(
        &mut self,
        hint: &str,
        len: impl IntoExpr<u32>,
        body: impl FnOnce(&mut Self, Expr<u32>),
    ) {
        let lid = self.local_index();
        let wg = self.invocations();
        self.within("row_loop", |k| {
            k.for_step(hint, lid, len, wg, |k, c| k.unpinned(|k| body(k, c)))
        });
    }

    /// Reduce `value` over the whole workgroup; every invocation gets the result. Call it where
    /// all invocations of the workgroup arrive (it has barriers). Uses subgroup operations when
    /// the key asks for `Features::SUBGROUPS`, else a shared-memory tree. Each call has its own
    /// workgroup scratch; inside a loop the call ends with a barrier, so that the next
    /// iteration's call cannot overwrite the scratch before every invocation has read it (out of
    /// loops that barrier would only delay the invocations that are done).
    #[track_caller]
    pub fn workgroup_reduce<T: Reducible>(
        &mut self,
        value: impl IntoExpr<T>,
        op: Reduce,
    ) -> Expr<T> {
        let value = value.into_expr();
        self.within("workgroup_reduce", |k| k.workgroup_reduce_here(value, op))
    }

    fn workgroup_reduce_here<T: Reducible>(&mut self, value: Expr<T>, op: Reduce) -> Expr<T> {
        let wg = self.invocations();
        let (what, result_hint) = match op {
            Reduce::Sum => ("sum", "sum"),
            Reduce::Max => ("max", "maximum"),
            Reduce::Min => ("min", "minimum"),
        };
        if self.has_feature(Features::SUBGROUPS) {
            self.comment(&format!(
                "workgroup_reduce({what}): subgroups, then one partial per subgroup"
            ));
            let partial = match op {
                Reduce::Sum => self.subgroup_add(value),
                Reduce::Max => self.subgroup_max(value),
                Reduce::Min => self.subgroup_min(value),
            };
            // One slot per invocation: at most that many subgroups, whatever size the device
            // runs them at (WGSL promises at least 4, not every driver does).
            let scratch = self.workgroup_array::<T>("partials", wg);
            let lane = self.subgroup_invocation_id();
            let sg = self.subgroup_id();
            self.if_(lane.eq(0u32), |k| k.store(&scratch, sg, partial));
            self.workgroup_barrier();
            let acc = self.var("acc", identity::<T>(op));
            let count = self.num_subgroups();
            self.for_range("s", 0u32, count, |k, s| {
                k.assign(&acc, combine(op, acc.get(), scratch.at(s)));
            });
            if self.may_repeat() {
                self.workgroup_barrier();
            }
            return self.let_library_named(result_hint, acc.get());
        }
        self.comment(&format!("workgroup_reduce({what}): shared-memory tree"));
        let scratch = self.workgroup_array::<T>("scratch", wg);
        let lid = self.local_index();
        self.store(&scratch, &lid, value);
        self.workgroup_barrier();
        // Checked: a size past 2³¹ has no next power of two in u32 (the limits refuse it later).
        let top = wg.checked_next_power_of_two().map_or(1 << 31, |p| p / 2);
        let pow2 = wg.is_power_of_two();
        if top > 0 {
            self.for_loop(
                "stride",
                top,
                |s| s.gt(0u32),
                BinaryOp::Shr,
                1u32,
                |k, s| {
                    let partner = &lid + &s;
                    let active = if pow2 {
                        lid.lt(&s)
                    } else {
                        lid.lt(&s).and(partner.lt(wg))
                    };
                    k.if_(active, |k| {
                        k.store(
                            &scratch,
                            &lid,
                            combine(op, scratch.at(&lid), scratch.at(partner)),
                        );
                    });
                    k.workgroup_barrier();
                },
            );
        }
        let result = self.let_library_named(result_hint, scratch.at(0u32));
        if self.may_repeat() {
            self.workgroup_barrier();
        }
        result
    }
}
