use hesper::dsl::kernel;

#[kernel(workgroup_size = 64)]
fn scale(x: &[f32], #[runtime] a: f32) {
    let i = global_index();
    x[i] = x[i] * a;
}

fn main() {}
