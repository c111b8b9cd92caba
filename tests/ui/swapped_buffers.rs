// The launcher takes the kernel's parameters in their declared order, written buffers by
// `&mut`: an input and an output swapped does not compile.
use hesper::dsl::kernel;
use hesper::exec::{Gpu, Grid};

#[kernel(workgroup_size = 64)]
fn scale(x: &[f32], y: &mut [f32], #[runtime] a: f32, #[runtime] n: u32) {
    let i = global_index();
    if i < n {
        y[i] = a * x[i];
    }
}

fn main() {
    let gpu = Gpu::new().unwrap();
    let (x, mut y) = (gpu.zeros::<f32>(8).unwrap(), gpu.zeros::<f32>(8).unwrap());
    let mut rec = gpu.recorder();
    scale::launch(&mut rec, &mut y, &x, 2.0, 8, Grid::Threads(8)).unwrap();
}
