use hesper::dsl::kernel;

#[kernel(workgroup_size = 64)]
fn takes_a_vec(x: Vec<f32>) {}

#[kernel(workgroup_size = 64)]
fn assigns_a_let(out: &mut [f32]) {
    let a = 1.0;
    a = 2.0;
    out[0] = a;
}

fn main() {}
