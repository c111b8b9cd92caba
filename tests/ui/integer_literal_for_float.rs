use hesper::dsl::kernel;

#[kernel(workgroup_size = 64)]
fn double(x: &[f32], y: &mut [f32], #[runtime] n: u32) {
    let i = global_index();
    if i < n {
        y[i] = x[i] * 2;
    }
}

fn main() {}
