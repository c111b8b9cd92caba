use hesper::dsl::kernel;

fn square(v: f32) -> f32 {
    v * v
}

#[kernel(workgroup_size = 64)]
fn squares(x: &[f32], y: &mut [f32], #[runtime] n: u32) {
    let i = global_index();
    if i < n {
        y[i] = square(x[i]);
    }
}

fn main() {}
