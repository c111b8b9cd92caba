use hesper::dsl::kernel;

#[kernel(workgroup_size = 64)]
fn store_int(out: &mut [f32]) {
    let i = global_index();
    out[i] = i;
}

fn main() {}
