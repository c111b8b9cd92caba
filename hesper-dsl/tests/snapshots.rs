//! Snapshots of representative kernels' WGSL, one file per kernel under `snapshots/`. They are
//! reviewed like code: a change to the emitter shows up here as a diff.

use hesper_dsl::prelude::*;

/// An elementwise map: SwiGLU backward on vec4 lanes, `du = dh·g·σ(g)`,
/// `dg = dh·u·σ(g)·(1 + g·(1 − σ(g)))`.
#[test]
fn elementwise_map() {
    let key = KernelKey::new("swiglu_backward_vec4").workgroup_size(256);
    let k = Kernel::build(&key, |k| {
        let gate = k.storage::<Vec4<f32>>("gate");
        let up = k.storage::<Vec4<f32>>("up");
        let d_h = k.storage::<Vec4<f32>>("d_h");
        let d_gate = k.storage_rw::<Vec4<f32>>("d_gate");
        let d_up = k.storage_rw::<Vec4<f32>>("d_up");
        let n = k.param::<u32>("n_vec4");
        k.grid_stride(&n, |k, i| {
            let g = k.let_("g", gate.at(&i));
            let dh = k.let_("dh", d_h.at(&i));
            let sig = k.let_("sig", 1.0f32 / (1.0f32 + (-&g).exp()));
            k.store(&d_up, &i, &dh * &g * &sig);
            k.store(
                &d_gate,
                &i,
                &dh * up.at(&i) * &sig * (1.0f32 + &g * (1.0f32 - &sig)),
            );
        });
    })
    .unwrap();
    insta::assert_snapshot!("elementwise_map", k.wgsl());
}

/// A row reduction through workgroup memory: RMSNorm backward's two row sums in one vec2,
/// then `dx = r·m − (r³/n)·(Σ m·x)·x` with `m = dy·γ`.
fn rms_norm_backward(features: Features) -> Kernel {
    let key = KernelKey::new("rms_norm_backward")
        .workgroup_size(256)
        .shape("cols", 2560u32)
        .shape("eps", 1e-6f32)
        .features(features);
    Kernel::build(&key, |k| {
        let x = k.storage::<f32>("x");
        let dy = k.storage::<f32>("dy");
        let gamma = k.storage::<f32>("gamma");
        let dx = k.storage_rw::<f32>("dx");
        let cols = k.shape_const::<u32>("cols");
        let eps = k.shape_const::<f32>("eps");
        let base = k.let_("base", k.workgroup_id().x() * &cols);
        let acc = k.var("acc", Expr::<Vec2<f32>>::splat(0.0f32));
        k.row_loop(&cols, |k, c| {
            let xv = k.let_("xv", x.at(&base + &c));
            let m = k.let_("m", dy.at(&base + &c) * gamma.at(&c));
            k.add_assign(&acc, vec2(&xv * &xv, &m * &xv));
        });
        let tot = k.workgroup_reduce(acc.get(), Reduce::Sum);
        let n = k.let_("n", cols.cast::<f32>());
        let r = k.let_("r", (tot.x() / &n + &eps).inverse_sqrt());
        let coef = k.let_("coef", &r * &r * &r * tot.y() / &n);
        k.row_loop(&cols, |k, c| {
            let xv = k.let_("xv", x.at(&base + &c));
            k.store(
                &dx,
                &base + &c,
                &r * dy.at(&base + &c) * gamma.at(&c) - &coef * &xv,
            );
        });
    })
    .unwrap()
}

#[test]
fn row_reduction() {
    insta::assert_snapshot!("row_reduction", rms_norm_backward(Features::NONE).wgsl());
}

#[test]
fn subgroup_reduction() {
    insta::assert_snapshot!(
        "subgroup_reduction",
        rms_norm_backward(Features::SUBGROUPS).wgsl()
    );
}

/// An f16 kernel: a row max in f16 (softmax's first pass), with runtime scalars as immediates.
#[test]
fn f16_kernel() {
    let key = KernelKey::new("row_max_f16")
        .workgroup_size(64)
        .features(Features::IMMEDIATES);
    let k = Kernel::build(&key, |k| {
        let x = k.storage::<F16>("x");
        let out = k.storage_rw::<F16>("row_max");
        let cols = k.param::<u32>("cols");
        let scale = k.param::<f32>("scale");
        let row = k.let_("row", k.workgroup_id().x());
        let best = k.var("best", Expr::<F16>::lit(-65504.0));
        k.row_loop(&cols, |k, c| {
            k.assign(&best, best.get().max(x.at(&row * &cols + c)));
        });
        let m = k.workgroup_reduce(best.get(), Reduce::Max);
        k.if_(k.local_index().eq(0u32), |k| {
            k.store(&out, &row, &m * scale.cast::<F16>())
        });
    })
    .unwrap();
    insta::assert_snapshot!("f16_kernel", k.wgsl());
}

/// bf16 storage: two values per u32, helpers emitted once as WGSL functions.
#[test]
fn bf16_packed_kernel() {
    let key = KernelKey::new("relu_sqr_mul_backward_bf16").workgroup_size(256);
    let k = Kernel::build(&key, |k| {
        let gate = k.storage::<u32>("gate");
        let up = k.storage::<u32>("up");
        let d_h = k.storage::<u32>("d_h");
        let d_gate = k.storage_rw::<u32>("d_gate");
        let d_up = k.storage_rw::<u32>("d_up");
        let i = k.global_index();
        k.if_(i.lt(gate.len()), |k| {
            let (g, u, dh) = (
                k.let_("g", gate.at(&i)),
                k.let_("u", up.at(&i)),
                k.let_("dh", d_h.at(&i)),
            );
            let r_lo = k.let_("r_lo", bf16::low(&g).max(0.0f32));
            let r_hi = k.let_("r_hi", bf16::high(&g).max(0.0f32));
            let (dh_lo, dh_hi) = (
                k.let_("dh_lo", bf16::low(&dh)),
                k.let_("dh_hi", bf16::high(&dh)),
            );
            k.store(
                &d_up,
                &i,
                bf16::pack(&dh_lo * &r_lo * &r_lo, &dh_hi * &r_hi * &r_hi),
            );
            k.store(
                &d_gate,
                &i,
                bf16::pack(
                    2.0f32 * &dh_lo * bf16::low(&u) * &r_lo,
                    2.0f32 * &dh_hi * bf16::high(&u) * &r_hi,
                ),
            );
        });
    })
    .unwrap();
    insta::assert_snapshot!("bf16_packed_kernel", k.wgsl());
}
