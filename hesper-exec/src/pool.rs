//! Devices are recycled, never destroyed while the process runs.
//!
//! NVIDIA's Vulkan driver (580.159 on the H200) deadlocks when `vkDestroyDevice` runs while
//! other threads of the process call into the driver: the destroying thread joins one of the
//! device's worker threads while holding the driver's process-wide lock, and every other
//! thread (submitting, creating a device, reading back) waits on that lock for ever. Backtraces
//! of the hung test binary showed exactly that, in every hang (BENCHMARKS.md, "The executor's
//! hang"). So a dropped [`Gpu`](crate::Gpu) hands its device back here, and the next `Gpu`
//! opened with the same adapter, features and limits takes it instead of creating one; a
//! device that was lost is kept too (its Vulkan object is never destroyed), but never handed
//! out again. There are never more devices than `Gpu`s were open at once, plus lost ones.
//! Instances are made once per set of backends for the same reason (`vkDestroyInstance` waits
//! on the loader's lock that a destroying device holds). And `Gpu`s open one at a time: the
//! same driver crashed, once in about 150 runs of the executor's tests, inside its physical
//! device queries while several threads enumerated adapters and created devices at once.

use std::sync::{Arc, Mutex, MutexGuard};

/// What two `Gpu`s must share to use the same device interchangeably.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct DeviceRequest {
    pub adapter: AdapterIdentity,
    pub features: wgpu::Features,
    pub limits: wgpu::Limits,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct AdapterIdentity {
    name: String,
    vendor: u32,
    device: u32,
    backend: wgpu::Backend,
    driver_info: String,
}

impl AdapterIdentity {
    pub fn of(info: &wgpu::AdapterInfo) -> Self {
        AdapterIdentity {
            name: info.name.clone(),
            vendor: info.vendor,
            device: info.device,
            backend: info.backend,
            driver_info: info.driver_info.clone(),
        }
    }
}

/// What the device's callbacks report, read by the `Gpu` that holds it.
#[derive(Default)]
pub(crate) struct DeviceState {
    /// Why the device was lost, once it is.
    pub lost: Mutex<Option<String>>,
    /// The first error wgpu reported outside every error scope (raw use of the device), not yet
    /// returned to a caller.
    pub uncaptured: Mutex<Option<String>>,
}

impl DeviceState {
    pub fn lost_reason(&self) -> Option<String> {
        lock(&self.lost).clone()
    }
    pub fn take_uncaptured(&self) -> Option<String> {
        lock(&self.uncaptured).take()
    }
}

/// A device with its queue, and the state its callbacks write.
pub(crate) struct PooledDevice {
    pub request: DeviceRequest,
    pub device: wgpu::Device,
    pub queue: wgpu::Queue,
    pub state: Arc<DeviceState>,
}

impl PooledDevice {
    /// Wrap a new device: its loss and its uncaptured errors are recorded in its state instead
    /// of wgpu's default (a panic on the first uncaptured error).
    pub fn new(request: DeviceRequest, device: wgpu::Device, queue: wgpu::Queue) -> Self {
        let state = Arc::new(DeviceState::default());
        let on_lost = state.clone();
        device.set_device_lost_callback(move |reason, message| {
            let why = match message.is_empty() {
                true => format!("{reason:?}"),
                false => format!("{reason:?}: {message}"),
            };
            lock(&on_lost.lost).get_or_insert(why);
        });
        let on_error = state.clone();
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            log::error!("wgpu error outside hesper's error scopes: {e}");
            lock(&on_error.uncaptured).get_or_insert(e.to_string());
        }));
        PooledDevice {
            request,
            device,
            queue,
            state,
        }
    }
}

static INSTANCES: Mutex<Vec<(wgpu::Backends, wgpu::Instance)>> = Mutex::new(vec![]);
/// Held while a `Gpu` opens: adapters are enumerated and devices created one at a time.
#[cfg(not(target_arch = "wasm32"))]
pub(crate) static OPENING: Mutex<()> = Mutex::new(());
static IDLE: Mutex<Vec<PooledDevice>> = Mutex::new(vec![]);
static RETIRED: Mutex<Vec<PooledDevice>> = Mutex::new(vec![]);

/// A poisoned lock only means a thread panicked while holding it; every update here is a
/// single push, pop or assignment, so the data is whole.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The process's instance for `desc.backends`, made on first use.
pub(crate) fn instance(desc: wgpu::InstanceDescriptor) -> wgpu::Instance {
    let mut instances = lock(&INSTANCES);
    if let Some((_, i)) = instances.iter().find(|(b, _)| *b == desc.backends) {
        return i.clone();
    }
    let backends = desc.backends;
    let instance = wgpu::Instance::new(desc);
    instances.push((backends, instance.clone()));
    instance
}

/// An idle device made for `request`, if one was handed back and is not lost since.
pub(crate) fn take(request: &DeviceRequest) -> Option<PooledDevice> {
    loop {
        let device = {
            let mut idle = lock(&IDLE);
            let i = idle.iter().position(|d| d.request == *request)?;
            idle.swap_remove(i)
        };
        if is_lost(&device) {
            lock(&RETIRED).push(device);
            continue;
        }
        return Some(device);
    }
}

/// Whether the device is lost. wgpu reports a loss through its callback during a poll, so poll
/// (without waiting) first.
fn is_lost(device: &PooledDevice) -> bool {
    let _ = device.device.poll(wgpu::PollType::Poll);
    device.state.lost_reason().is_some()
}

/// Keep a device for the next `Gpu`, or for ever if it was lost.
pub(crate) fn give_back(device: PooledDevice) {
    // Errors nobody was told of belong to the `Gpu` that made them, not to the next one.
    device.state.take_uncaptured();
    if is_lost(&device) {
        lock(&RETIRED).push(device);
    } else {
        lock(&IDLE).push(device);
    }
}

/// The devices this process keeps and no open `Gpu` holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PooledDevices {
    /// Devices of dropped `Gpu`s, waiting for the next `Gpu` that asks for the same.
    pub idle: usize,
    /// Lost devices, kept so that they are never destroyed, and never used again.
    pub lost: usize,
}

/// How many devices the process keeps that no open [`Gpu`](crate::Gpu) holds (see the `Gpu`
/// docs: devices are recycled, never destroyed).
pub fn pooled_devices() -> PooledDevices {
    PooledDevices {
        idle: lock(&IDLE).len(),
        lost: lock(&RETIRED).len(),
    }
}
