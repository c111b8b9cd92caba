//! Property: any well-typed program the builder accepts emits WGSL that naga parses and
//! validates. Programs are drawn from a tape of random choices (shrinking the tape simplifies
//! the program), covering every expression form, nested scopes, loops, barriers, reductions,
//! uniform loads, subgroups, f16, cooperative matrices and both runtime-scalar paths. A kernel with
//! cooperative matrices must also get every SPIR-V capability they need from naga's writer.

use hesper_dsl::prelude::*;
use hesper_dsl::{ErrorKind, ReadBuffer, RwBuffer, Var, WorkgroupArray};
use proptest::prelude::*;

mod spirv;
use spirv::has_coop_capabilities;

struct Scope {
    f: Vec<Expr<f32>>,
    u: Vec<Expr<u32>>,
    i: Vec<Expr<i32>>,
    b: Vec<Expr<bool>>,
    vars: Vec<Var<f32>>,
}

struct Gen<'t> {
    tape: &'t [u32],
    pos: usize,
    scopes: Vec<Scope>,
    xf: Option<ReadBuffer<f32>>,
    xu: Option<ReadBuffer<u32>>,
    out_f: Option<RwBuffer<f32>>,
    out_u: Option<RwBuffer<u32>>,
    pf: Option<Expr<f32>>,
    pu: Option<Expr<u32>>,
    subgroups: bool,
    coop: Option<CoopMemory>,
}

type C32 = CoopMat<f32, CoopC>;

/// What a program with cooperative matrices loads them from and stores them to.
struct CoopMemory {
    half: ReadBuffer<Vec4<F16>>,
    staged: WorkgroupArray<F16>,
    staged_f32: WorkgroupArray<f32>,
    acc: Vec<Var<C32>>,
}

const FLOATS: [f32; 8] = [
    0.0,
    1.0,
    -2.5,
    1e-7,
    3.4028235e38,
    -1.1754944e-38,
    0.1,
    6.5e4,
];

impl Gen<'_> {
    fn pick(&mut self, n: u32) -> u32 {
        let v = self.tape.get(self.pos).copied().unwrap_or(0);
        self.pos += 1;
        v % n
    }
    fn local<T: Clone>(&mut self, all: fn(&Scope) -> &Vec<T>) -> Option<T> {
        let vis: Vec<T> = self
            .scopes
            .iter()
            .flat_map(|s| all(s).iter().cloned())
            .collect();
        if vis.is_empty() {
            return None;
        }
        let i = self.pick(vis.len() as u32) as usize;
        Some(vis[i].clone())
    }

    fn f32(&mut self, k: &mut KernelBuilder, d: u32) -> Expr<f32> {
        let choice = if d == 0 { self.pick(4) } else { self.pick(22) };
        match choice {
            0 => lit(FLOATS[self.pick(8) as usize]),
            1 => self.local(|s| &s.f).unwrap_or_else(|| lit(0.5f32)),
            2 => self.pf.clone().unwrap_or_else(|| lit(2.0f32)),
            3 => match self.xf.clone() {
                Some(x) => x.at(self.u32(k, 0) % x.len().max(1u32)),
                None => lit(-1.0f32),
            },
            4 => self.f32(k, d - 1) + self.f32(k, d - 1),
            5 => self.f32(k, d - 1) - self.f32(k, d - 1),
            6 => self.f32(k, d - 1) * self.f32(k, d - 1),
            7 => self.f32(k, d - 1) / self.f32(k, d - 1),
            8 => -self.f32(k, d - 1),
            9 => self.f32(k, d - 1).abs().sqrt(),
            10 => self.f32(k, d - 1).exp().min(self.f32(k, d - 1)),
            11 => self.f32(k, d - 1).clamp(-1.0f32, 1.0f32).tanh(),
            12 => select(self.bool(k, d - 1), self.f32(k, d - 1), self.f32(k, d - 1)),
            13 => self.u32(k, d - 1).cast::<f32>(),
            14 => self.i32(k, d - 1).cast::<f32>(),
            15 => self.u32(k, d - 1).bitcast::<f32>(),
            16 => self
                .f32(k, d - 1)
                .fma(self.f32(k, d - 1), self.f32(k, d - 1)),
            17 => vec4(self.f32(k, d - 1), 1.0f32, self.f32(k, d - 1), 2.0f32)
                .swizzle::<Vec2<f32>>("wx")
                .dot(vec2(0.5f32, 0.25f32)),
            18 => (Expr::<Vec4<f32>>::splat(self.f32(k, d - 1)) * self.f32(k, d - 1)).z(),
            19 => self
                .f32(k, d - 1)
                .cast::<F16>()
                .max(Expr::<F16>::lit(0.5))
                .cast::<f32>(),
            20 => {
                bf16::low(self.u32(k, d - 1)) + bf16::high(bf16::pack(self.f32(k, d - 1), 3.0f32))
            }
            _ => self.f32(k, d - 1).pow(2.0f32).log().floor(),
        }
    }

    fn u32(&mut self, k: &mut KernelBuilder, d: u32) -> Expr<u32> {
        let choice = if d == 0 { self.pick(4) } else { self.pick(18) };
        match choice {
            0 => lit([0u32, 1, 7, 65535, u32::MAX][self.pick(5) as usize]),
            1 => self.local(|s| &s.u).unwrap_or_else(|| lit(3u32)),
            2 => k.local_index(),
            3 => self.pu.clone().unwrap_or_else(|| k.workgroup_id().y()),
            4 => self.u32(k, d - 1) + self.u32(k, d - 1),
            5 => self.u32(k, d - 1) * self.u32(k, d - 1),
            6 => self.u32(k, d - 1) % self.u32(k, d - 1),
            7 => self.u32(k, d - 1) & self.u32(k, d - 1),
            8 => self.u32(k, d - 1) | self.u32(k, d - 1) ^ self.u32(k, d - 1),
            9 => self.u32(k, d - 1) << (self.u32(k, d - 1) & 31u32),
            10 => self.u32(k, d - 1) >> self.u32(k, d - 1),
            11 => !self.u32(k, d - 1),
            12 => self.f32(k, d - 1).cast::<u32>(),
            13 => self.i32(k, d - 1).bitcast::<u32>(),
            14 => k.global_id().x() - self.u32(k, d - 1),
            15 => match self.xu.clone() {
                Some(x) => x.at(self.u32(k, d - 1)) + x.len(),
                None => lit(9u32),
            },
            16 if self.subgroups => k.subgroup_size() + k.subgroup_invocation_id(),
            _ => self.u32(k, d - 1).max(self.u32(k, d - 1)) / 3u32,
        }
    }

    fn i32(&mut self, k: &mut KernelBuilder, d: u32) -> Expr<i32> {
        let choice = if d == 0 { self.pick(3) } else { self.pick(8) };
        match choice {
            0 => lit([0i32, -1, i32::MIN, i32::MAX, 42][self.pick(5) as usize]),
            1 => self.local(|s| &s.i).unwrap_or_else(|| lit(-3i32)),
            2 => self.u32(k, 0).cast::<i32>(),
            3 => self.i32(k, d - 1) - self.i32(k, d - 1),
            4 => -self.i32(k, d - 1),
            5 => self.i32(k, d - 1).abs() * self.i32(k, d - 1).sign(),
            6 => self.i32(k, d - 1) >> self.u32(k, d - 1),
            _ => self.f32(k, d - 1).cast::<i32>() & self.i32(k, d - 1),
        }
    }

    fn bool(&mut self, k: &mut KernelBuilder, d: u32) -> Expr<bool> {
        let choice = if d == 0 { self.pick(2) } else { self.pick(9) };
        match choice {
            0 => lit(self.pick(2) == 1),
            1 => self.local(|s| &s.b).unwrap_or_else(|| lit(true)),
            2 => self.f32(k, d - 1).lt(self.f32(k, d - 1)),
            3 => self
                .u32(k, d - 1)
                .lt(self.u32(k, d - 1) >> self.u32(k, d - 1)),
            4 => self.i32(k, d - 1).ne(self.i32(k, d - 1)),
            5 => self.bool(k, d - 1).and(self.bool(k, d - 1)),
            6 => self.bool(k, d - 1).or(self.bool(k, d - 1)),
            7 => !self.bool(k, d - 1),
            _ => self.bool(k, d - 1).eq(self.bool(k, d - 1)),
        }
    }

    fn block(&mut self, k: &mut KernelBuilder, depth: u32, top: bool) {
        self.scopes.push(Scope {
            f: vec![],
            u: vec![],
            i: vec![],
            b: vec![],
            vars: vec![],
        });
        let n = self.pick(5);
        for _ in 0..n {
            self.stmt(k, depth, top);
        }
        self.scopes.pop();
    }

    fn stmt(&mut self, k: &mut KernelBuilder, depth: u32, top: bool) {
        let d = 1 + self.pick(3);
        let last = self.scopes.len() - 1;
        match self.pick(if depth >= 2 { 7 } else { 13 }) {
            0 => {
                let e = self.f32(k, d);
                let e = k.let_("f", e);
                self.scopes[last].f.push(e);
            }
            1 => {
                let e = self.u32(k, d);
                let e = k.let_("u", e);
                self.scopes[last].u.push(e);
            }
            2 => {
                let e = self.bool(k, d);
                let e = k.let_("b", e);
                self.scopes[last].b.push(e);
            }
            3 => {
                let e = self.f32(k, d);
                let v = k.var("v", e);
                self.scopes[last].f.push(v.get());
                self.scopes[last].vars.push(v);
            }
            4 => {
                if let Some(v) = self.local(|s| &s.vars) {
                    let e = self.f32(k, d);
                    if self.pick(2) == 0 {
                        k.assign(&v, e)
                    } else {
                        k.add_assign(&v, e)
                    }
                }
            }
            5 => {
                if let Some(out) = self.out_f.clone() {
                    let (i, e) = (self.u32(k, d), self.f32(k, d));
                    k.store(&out, i, e);
                }
            }
            6 => {
                if let Some(out) = self.out_u.clone() {
                    let (i, e) = (self.u32(k, d), self.u32(k, d));
                    k.store(&out, i, e);
                }
            }
            7 => {
                let c = self.bool(k, d);
                if self.pick(2) == 0 {
                    k.if_(c, |k| self.block(k, depth + 1, false));
                } else {
                    // Both branches draw from the same generator; they run one after the other.
                    let this = std::cell::RefCell::new(&mut *self);
                    k.if_else(
                        c,
                        |k| this.borrow_mut().block(k, depth + 1, false),
                        |k| this.borrow_mut().block(k, depth + 1, false),
                    );
                }
            }
            8 => {
                let end = self.u32(k, 1);
                k.for_range("j", 0u32, end, |k, j| {
                    self.scopes.push(Scope {
                        f: vec![],
                        u: vec![j],
                        i: vec![],
                        b: vec![],
                        vars: vec![],
                    });
                    self.block(k, depth + 1, false);
                    let c = self.bool(k, 1);
                    k.break_if(c);
                    self.scopes.pop();
                });
            }
            // Barriers and reductions only at the top level, where control flow is uniform.
            9 if top => {
                let e = self.f32(k, d);
                let op = if self.pick(2) == 0 {
                    Reduce::Sum
                } else {
                    Reduce::Max
                };
                let r = k.workgroup_reduce(e, op);
                self.scopes[last].f.push(r);
            }
            // Cooperative operations too (subgroup-wide): loads from storage or workgroup memory
            // in either major, a multiply-add into a `var` or a `let`, scaling, sums, a store.
            11 if top && self.coop.is_some() => self.coop_stmt(k, d),
            // A value one invocation writes for the workgroup, read back uniform
            // (`workgroupUniformLoad`: a barrier each side).
            12 if top => {
                let flags = k.workgroup_array::<u32>("flags", 4);
                let (at, e) = (self.pick(4), self.u32(k, d));
                let lid = k.local_index();
                k.if_(lid.eq(0u32), |k| k.store(&flags, at, e));
                let v = k.workgroup_uniform_load("w", &flags, at);
                self.scopes[last].u.push(v);
            }
            10 if top && self.subgroups => {
                let e = self.f32(k, d);
                let s = k.subgroup_shuffle_xor(e, 1u32);
                let s = k.subgroup_add(s);
                self.scopes[last].f.push(s);
            }
            _ => {
                let e = self.i32(k, d);
                let e = k.let_("i", e);
                self.scopes[last].i.push(e);
            }
        }
    }
}

impl Gen<'_> {
    fn major(&mut self) -> Major {
        [Major::Row, Major::Column][self.pick(2) as usize]
    }

    fn coop_stmt(&mut self, k: &mut KernelBuilder, d: u32) {
        let (major_a, major_b, major_c) = (self.major(), self.major(), self.major());
        let index = self.u32(k, d);
        let stride = self.u32(k, 1);
        let mem = self.coop.as_ref().unwrap();
        let (half, staged) = (mem.half.clone(), mem.staged.clone());
        let a = if self.pick(2) == 0 {
            k.coop_load::<CoopMat<F16, CoopA>, _>(&half, &index, &stride, major_a)
        } else {
            k.coop_load::<CoopMat<F16, CoopA>, _>(&staged, &index, 16u32, major_a)
        };
        let b = k.coop_load::<CoopMat<F16, CoopB>, _>(&staged, 0u32, &stride, major_b);
        let acc = self.coop.as_ref().unwrap().acc.clone();
        let c = match (self.pick(3), acc.last()) {
            (0, Some(v)) => v.get(),
            (1, _) => {
                let from = self.coop.as_ref().unwrap().staged_f32.clone();
                k.coop_load::<C32, _>(&from, 0u32, 16u32, major_c)
            }
            _ => Expr::<C32>::zero(),
        };
        let product = coop_multiply_add(a, b, c.clone());
        let value = match self.pick(3) {
            0 => product * self.f32(k, 1),
            1 => product - c,
            _ => product,
        };
        match (self.pick(3), acc.last()) {
            (0, Some(v)) => k.assign(v, value),
            (1, _) => {
                let v = k.var("acc", value);
                self.coop.as_mut().unwrap().acc.push(v);
            }
            _ => {
                let v = k.let_("tile", value);
                if self.pick(2) == 0 {
                    let out = self.out_f.clone().unwrap();
                    k.coop_store(&out, index, stride, major_c, v);
                } else {
                    let to = self.coop.as_ref().unwrap().staged_f32.clone();
                    k.coop_store(&to, 0u32, 16u32, major_c, v);
                }
            }
        }
    }
}

fn program(tape: &[u32]) -> Result<Kernel, hesper_dsl::DslError> {
    let flags = tape.first().copied().unwrap_or(0);
    let mut features = Features::NONE;
    if flags & 1 == 1 {
        features = features | Features::SUBGROUPS;
    }
    if flags & 2 == 2 {
        features = features | Features::IMMEDIATES;
    }
    if flags & 1024 == 1024 {
        features = features | Features::COOPERATIVE_MATRIX;
    }
    let wg = [1u32, 32, 64, 100, 256][(flags >> 2) as usize % 5];
    let key = KernelKey::new("random")
        .workgroup_size(wg)
        .features(features);
    Kernel::build(&key, |k| {
        let mut g = Gen {
            tape: &tape[1.min(tape.len())..],
            pos: 0,
            scopes: vec![],
            xf: (flags & 32 == 0).then(|| k.storage::<f32>("xf")),
            xu: (flags & 64 == 0).then(|| k.storage::<u32>("xu")),
            out_f: Some(k.storage_rw::<f32>("out_f")),
            out_u: (flags & 128 == 0).then(|| k.storage_rw::<u32>("out_u")),
            pf: (flags & 256 == 0).then(|| k.param::<f32>("pf")),
            pu: (flags & 512 == 0).then(|| k.param::<u32>("pu")),
            subgroups: features.contains(Features::SUBGROUPS),
            coop: features
                .contains(Features::COOPERATIVE_MATRIX)
                .then(|| CoopMemory {
                    half: k.storage("half"),
                    staged: k.workgroup_array("staged", 256),
                    staged_f32: k.workgroup_array("staged_f32", 256),
                    acc: vec![],
                }),
        };
        g.block(k, 0, true);
        // Always write something, so the program is never empty.
        let e = g.f32(k, 2);
        k.store(g.out_f.as_ref().unwrap(), k.local_index(), e);
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]
    #[test]
    fn well_typed_programs_pass_naga(tape in prop::collection::vec(any::<u32>(), 1..400)) {
        // `Kernel::build` runs naga's parser and validator on every kernel it returns. Random
        // constants may overflow or leave a function's domain (`pow(-2.5f, 2.0f)`): the builder
        // must report those itself; naga must never be the one to reject a kernel.
        match program(&tape) {
            Ok(kernel) => {
                prop_assert!(kernel.wgsl().contains("fn main("));
                if kernel.uses_cooperative_matrix() {
                    prop_assert!(has_coop_capabilities(&kernel), "{}", kernel.wgsl());
                }
            }
            Err(e) => prop_assert!(
                matches!(&e.kind, ErrorKind::InvalidExpression { message } if message.starts_with("a constant subexpression")),
                "{e}"
            ),
        }
    }
}
