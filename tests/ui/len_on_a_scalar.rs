// `#[len(…)]` states a buffer's length; on anything else it is an error at the attribute.
use hesper::dsl::kernel;

#[kernel(workgroup_size = 64)]
fn scale(x: &mut [f32], #[runtime] #[len(n)] n: u32) {
    let i = global_index();
    if i < n {
        x[i] = x[i] * 2.0;
    }
}

fn main() {}
