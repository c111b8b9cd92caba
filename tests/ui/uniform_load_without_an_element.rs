// `workgroup_uniform_load` takes `&tile[i]`, one element of a workgroup array: the whole array is an
// error at the call.
use hesper::dsl::prelude::*;

#[kernel(workgroup_size = 64)]
fn decide(y: &mut [u32], #[workgroup] flags: &mut [u32; 4]) {
    let f = workgroup_uniform_load(flags);
    y[global_index()] = f;
}

fn main() {}
