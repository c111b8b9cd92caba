use hesper_dsl::prelude::*;
fn main() {
    let key = KernelKey::new("relu_sqr_mul_backward").workgroup_size(256);
    let kernel = Kernel::build(&key, |k| {
        let gate = k.storage::<f32>("gate");
        let up = k.storage::<f32>("up");
        let d_h = k.storage::<f32>("d_h");
        let d_gate = k.storage_rw::<f32>("d_gate");
        let d_up = k.storage_rw::<f32>("d_up");
        let n = k.param::<u32>("n");
        let i = k.global_index();
        k.if_(i.lt(&n), |k| {
            let r = k.let_("r", gate.at(&i).max(0.0));
            let dh = k.let_("dh", d_h.at(&i));
            k.store(&d_gate, &i, &dh * up.at(&i) * 2.0 * &r);
            k.store(&d_up, &i, &dh * &r * &r);
        });
    });
    match kernel { Ok(k) => println!("{}", k.wgsl()), Err(e) => println!("{e}") }
    for feats in [Features::NONE, Features::SUBGROUPS] {
    let key = KernelKey::new("row_sum").workgroup_size(100).shape("cols", 300u32).features(feats);
    let kernel = Kernel::build(&key, |k| {
        let x = k.storage::<f32>("x");
        let out = k.storage_rw::<f32>("out");
        let cols = k.shape_const::<u32>("cols");
        let row = k.workgroup_id().x();
        let base = k.let_("base", &row * &cols);
        let acc = k.var("acc", 0.0f32);
        k.row_loop(&cols, |k, c| { k.add_assign(&acc, x.at(&base + c)); });
        let s = k.workgroup_reduce(acc.get(), Reduce::Sum);
        k.if_(k.local_index().eq(0u32), |k| k.store(&out, &row, &s));
    });
    match kernel { Ok(k) => println!("{}", k.wgsl()), Err(e) => println!("{e}") }
    }
}
