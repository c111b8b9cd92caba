use hesper::dsl::kernel;
use hesper::exec::{Gpu, Grid};

#[kernel(workgroup_size = 64)]
fn double(x: &mut [f32], #[runtime] n: u32) {
    let i = global_index();
    if i < n {
        x[i] = x[i] * 2.0;
    }
}

fn main() {
    let gpu = Gpu::new().unwrap();
    let mut ints = gpu.zeros::<u32>(8).unwrap();
    let mut rec = gpu.recorder();
    double::launch(&mut rec, &mut ints, 8, Grid::Threads(8)).unwrap();
}
