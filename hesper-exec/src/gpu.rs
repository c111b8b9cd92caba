//! `Gpu`: instance, adapter, device and queue, with the features kernels can use.

use hesper_dsl::{Features, Limits};

use crate::error::ExecError;

/// The device features hesper asks for when the adapter has them.
const WANTED: wgpu::Features = wgpu::Features::SHADER_F16
    .union(wgpu::Features::SUBGROUP)
    .union(wgpu::Features::TIMESTAMP_QUERY)
    .union(wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES)
    .union(wgpu::Features::TIMESTAMP_QUERY_INSIDE_ENCODERS)
    .union(wgpu::Features::IMMEDIATES);

/// One GPU (or lavapipe): the device, its queue and what it can do.
pub struct Gpu {
    pub(crate) device: wgpu::Device,
    pub(crate) queue: wgpu::Queue,
    info: wgpu::AdapterInfo,
    features: wgpu::Features,
    limits: wgpu::Limits,
}

impl Gpu {
    /// Open the first high-performance adapter. The backend follows `WGPU_BACKEND` (e.g.
    /// `vulkan`), else every backend wgpu knows; the device gets the adapter's full limits and
    /// the features of [`WANTED`] it has.
    pub fn new() -> Result<Gpu, ExecError> {
        pollster::block_on(Gpu::new_async())
    }

    async fn new_async() -> Result<Gpu, ExecError> {
        let desc = wgpu::InstanceDescriptor::new_without_display_handle_from_env();
        let backends = format!("{:?}", desc.backends);
        let instance = wgpu::Instance::new(desc);
        let adapter = instance
            .request_adapter(&wgpu::RequestAdapterOptions {
                power_preference: wgpu::PowerPreference::HighPerformance,
                ..Default::default()
            })
            .await
            .map_err(|_| ExecError::NoAdapter { backends })?;
        let info = adapter.get_info();
        let features = adapter.features() & WANTED;
        let limits = adapter.limits();
        let (device, queue) = adapter
            .request_device(&wgpu::DeviceDescriptor {
                label: Some("hesper"),
                required_features: features,
                required_limits: limits.clone(),
                ..Default::default()
            })
            .await
            .map_err(|e| ExecError::RequestDevice {
                adapter: info.name.clone(),
                message: e.to_string(),
            })?;
        Ok(Gpu {
            device,
            queue,
            info,
            features,
            limits,
        })
    }

    /// The adapter's name, backend and driver.
    pub fn adapter_info(&self) -> &wgpu::AdapterInfo {
        &self.info
    }

    /// A one-line description: `llvmpipe (LLVM 15.0.6, 256 bits) (Vulkan, Mesa 22.3.6)`.
    pub fn describe(&self) -> String {
        format!(
            "{} ({:?}, {})",
            self.info.name, self.info.backend, self.info.driver_info
        )
    }

    /// The wgpu features the device was created with.
    pub fn wgpu_features(&self) -> wgpu::Features {
        self.features
    }

    pub fn wgpu_limits(&self) -> &wgpu::Limits {
        &self.limits
    }

    /// The kernel features this device can run (for choosing a kernel's path).
    pub fn kernel_features(&self) -> Features {
        let mut f = Features::NONE;
        if self.features.contains(wgpu::Features::SUBGROUP) {
            f = f | Features::SUBGROUPS;
        }
        if self.features.contains(wgpu::Features::IMMEDIATES) {
            f = f | Features::IMMEDIATES;
        }
        f
    }

    pub fn supports_f16(&self) -> bool {
        self.features.contains(wgpu::Features::SHADER_F16)
    }

    /// The device limits a kernel is checked against before it is compiled.
    pub fn kernel_limits(&self) -> Limits {
        let l = &self.limits;
        Limits {
            max_workgroup_storage_bytes: l.max_compute_workgroup_storage_size,
            max_invocations_per_workgroup: l.max_compute_invocations_per_workgroup,
            max_workgroup_size: [
                l.max_compute_workgroup_size_x,
                l.max_compute_workgroup_size_y,
                l.max_compute_workgroup_size_z,
            ],
            max_immediate_bytes: l.max_immediate_size,
        }
    }

    /// Wait until the GPU has finished all submitted work.
    pub fn wait(&self) -> Result<(), ExecError> {
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map(|_| ())
            .map_err(|e| ExecError::Device(e.to_string()))
    }
}
