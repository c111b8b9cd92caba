//! Devices are recycled, never destroyed (NVIDIA's driver deadlocks when one is destroyed while
//! other threads use it): a dropped `Gpu`'s device goes to the next `Gpu` that asks for the same
//! adapter, features and limits, and a lost one is kept but never handed out. Alone in its test
//! binary, so that the pool's counts are this test's own.

use hesper::exec::{Gpu, GpuOptions, PooledDevices, pooled_devices};

fn idle_lost() -> (usize, usize) {
    let PooledDevices { idle, lost } = pooled_devices();
    (idle, lost)
}

#[test]
fn dropped_devices_are_reused_and_lost_ones_are_kept_aside() {
    assert_eq!(idle_lost(), (0, 0));
    let (a, b) = (Gpu::new().unwrap(), Gpu::new().unwrap());
    let buffer_of_a = a.upload(&[1u32, 2, 3]).unwrap();
    let a_id = a.id();
    drop((a, b));
    assert_eq!(idle_lost(), (2, 0), "both devices kept");

    // Same options: a kept device, under a new id that the old buffers do not match.
    let c = Gpu::new().unwrap();
    assert_eq!(idle_lost(), (1, 0));
    assert_ne!(c.id(), a_id);
    assert!(buffer_of_a.read(&c).is_err());
    assert_eq!(c.upload(&[9u32]).unwrap().read(&c).unwrap(), [9]);
    assert_eq!(c.cache_stats().misses, 0, "a fresh pipeline cache");

    // Other features: a device of its own.
    let no_subgroups = Gpu::with_options(GpuOptions {
        subgroups: false,
        ..GpuOptions::default()
    })
    .unwrap();
    assert_eq!(idle_lost(), (1, 0));
    drop(no_subgroups);
    assert_eq!(idle_lost(), (2, 0));

    // A lost device is kept apart, and the next `Gpu` gets a working one.
    c.device().0.destroy();
    drop(c);
    assert_eq!(idle_lost(), (2, 1));
    let d = Gpu::new().unwrap();
    assert!(d.lost_reason().is_none());
    assert_eq!(d.upload(&[4u32]).unwrap().read(&d).unwrap(), [4]);
    assert_eq!(idle_lost(), (1, 1));
}
