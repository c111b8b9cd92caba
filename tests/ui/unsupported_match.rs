use hesper::dsl::kernel;

#[kernel(workgroup_size = 64)]
fn pick(x: &mut [f32], #[shape] mode: u32) {
    let i = global_index();
    x[i] = match mode {
        0 => 1.0,
        _ => 2.0,
    };
}

fn main() {}
