//! On a GPU with memory of its own, allocating past it is an error from the allocation, and the
//! device stays usable. Alone in its binary: filling the GPU's memory disturbs other tests'
//! timing.

use hesper::exec::{ExecError, Gpu};

/// Not on a CPU device: there the memory is the host's, and a test must not exhaust it.
#[test]
fn an_allocation_beyond_the_devices_memory_is_an_error() {
    let g = Gpu::new().unwrap();
    if g.adapter_info().device_type == hesper::exec::wgpu::DeviceType::Cpu {
        eprintln!("skipped: {} allocates host memory", g.describe());
        return;
    }
    let chunk = (g.wgpu_limits().max_storage_buffer_binding_size / 4) as usize & !3;
    let mut held = vec![];
    let err = loop {
        match g.zeros::<f32>(chunk) {
            Ok(b) => held.push(b),
            Err(e) => break e,
        }
        let bytes = held.len() as u64 * chunk as u64 * 4;
        assert!(bytes < 1 << 40, "1 TiB allocated without an error");
    };
    assert!(
        matches!(
            err,
            ExecError::Wgpu {
                kind: "out of memory",
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().starts_with("allocating"), "{err}");
    eprintln!("refused after {} buffers of {chunk} f32: {err}", held.len());
    drop(held);
    assert_eq!(
        g.upload(&[5u32]).unwrap().read(&g).unwrap(),
        [5],
        "usable afterwards"
    );
}
