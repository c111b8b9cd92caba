//! The executor on the DSL's interpreter ([`GpuOptions::interpreter`](crate::GpuOptions::interpreter)):
//! no GPU and no Vulkan driver, every launch run by [`hesper_dsl::interp`] with its checks.
//!
//! Buffers live in wgpu's noop backend, which keeps them in host memory and runs copies,
//! clears and mappings at submit but does nothing for a dispatch. Everything above the
//! dispatch stays the executor's own — buffers, uploads and readbacks, the pipeline cache (the
//! WGSL is still emitted and validated by naga), the binding and parameter checks — so code
//! that runs on a GPU runs here unchanged. A recorder keeps its launches (the executor's copies
//! and fills are kernels too) and, at submit, runs them in order over host copies of their
//! buffers, written back once all have run ([`run_submit`]).

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::sync::Arc;

use hesper_dsl::Kernel;
use hesper_dsl::interp::{Run, ScalarValue, interpret};

use crate::error::ExecError;
use crate::gpu::Gpu;

/// Invocations of a subgroup on the interpreter (NVIDIA's size; `hesper_dsl::interp` runs any).
pub(crate) const SUBGROUP_SIZE: u32 = 32;

/// The noop adapter as the interpreter presents it: limits of a desktop GPU (NVIDIA's; a kernel sizes
/// itself to these), f16 and subgroups (of [`SUBGROUP_SIZE`]), cooperative matrices; no
/// timestamps (there is no GPU time to measure), immediates or driver pipeline cache. A
/// dispatch row holds 1024 workgroups, not 65 535: the 2-D layouts of long launches are
/// exercised at sizes an interpreter gets through (a launch of more workgroups along one side,
/// such as an f32 GEMM over a 128k vocabulary in 64-wide tiles, is refused by the executor's
/// dispatch check there, as a GPU's limit would refuse it).
pub(crate) fn noop_options() -> wgpu::NoopBackendOptions {
    let limits = wgpu::Limits {
        max_compute_workgroups_per_dimension: 1024,
        max_compute_invocations_per_workgroup: 1024,
        max_compute_workgroup_size_x: 1024,
        max_compute_workgroup_size_y: 1024,
        max_compute_workgroup_size_z: 64,
        max_compute_workgroup_storage_size: 48 * 1024,
        max_storage_buffers_per_shader_stage: 16,
        max_storage_buffer_binding_size: 1 << 30,
        max_buffer_size: 1 << 30,
        ..wgpu::Limits::default()
    };
    wgpu::NoopBackendOptions {
        enable: true,
        limits: Some(limits),
        features: Some(
            wgpu::Features::SHADER_F16
                | wgpu::Features::SUBGROUP
                | wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX,
        ),
        device_type: Some(wgpu::DeviceType::Cpu),
        subgroup_min_size: Some(SUBGROUP_SIZE),
        subgroup_max_size: Some(SUBGROUP_SIZE),
    }
}

/// The cooperative-matrix multiply-adds the interpreter runs (the noop adapter reports none):
/// 16×16×16 f16 inputs into f32 or f16, as the H200 has them.
pub(crate) fn coop_properties() -> Vec<wgpu::CooperativeMatrixProperties> {
    [
        wgpu::CooperativeScalarType::F32,
        wgpu::CooperativeScalarType::F16,
    ]
    .into_iter()
    .map(|cr_type| wgpu::CooperativeMatrixProperties {
        m_size: 16,
        n_size: 16,
        k_size: 16,
        ab_type: wgpu::CooperativeScalarType::F16,
        cr_type,
        saturating_accumulation: false,
    })
    .collect()
}

/// One checked launch, kept for the interpreter.
pub(crate) struct InterpretedLaunch {
    pub kernel: Arc<Kernel>,
    pub workgroups: [u32; 3],
    pub buffers: Vec<InterpretedBinding>,
    pub params: Vec<(String, ScalarValue)>,
}

/// A buffer as one binding sees it: `bytes` bytes of `raw` from `offset` (the elements; the
/// interpreter's bounds are the buffer's length, not its padded allocation).
pub(crate) struct InterpretedBinding {
    pub name: String,
    /// The buffer's number (`GpuBuffer`'s): two bindings of one buffer share its bytes.
    pub buffer: u64,
    pub raw: wgpu::Buffer,
    pub offset: u64,
    pub bytes: u64,
    /// Whether the kernel may write it (`read_write`).
    pub writable: bool,
}

/// A buffer's whole allocation on the host while a submit is interpreted.
struct HostCopy {
    raw: wgpu::Buffer,
    bytes: Vec<u8>,
    written: bool,
}

/// Run a recorder's launches in order, as one submit: every buffer they bind is read once,
/// the launches run over the host copies, and the copies they wrote go back only when every
/// launch ran — a fault leaves every buffer as it was (nothing is submitted, as on a GPU). One
/// submit at a time on a `Gpu`: another thread's submit cannot interleave its write-backs.
pub(crate) fn run_submit(gpu: &Gpu, launches: Vec<InterpretedLaunch>) -> Result<(), ExecError> {
    let _one_at_a_time = gpu.interpreting.lock().unwrap_or_else(|e| e.into_inner());
    let mut memory: HashMap<u64, HostCopy> = HashMap::new();
    for launch in launches {
        launch.run(gpu, &mut memory)?;
    }
    let what = || "writing back what the interpreted launches wrote".to_string();
    for copy in memory.values().filter(|c| c.written) {
        gpu.scoped(&what, || gpu.queue.write_buffer(&copy.raw, 0, &copy.bytes))?;
    }
    Ok(())
}

impl InterpretedLaunch {
    /// Interpret the launch over the host copies of its buffers (read on first use).
    fn run(self, gpu: &Gpu, memory: &mut HashMap<u64, HostCopy>) -> Result<(), ExecError> {
        let name = self.kernel.name();
        let mut run = Run::new(self.workgroups);
        run.subgroup_size = SUBGROUP_SIZE;
        run.params = self.params.into_iter().collect();
        for b in &self.buffers {
            let copy = match memory.entry(b.buffer) {
                Entry::Occupied(copy) => copy.into_mut(),
                Entry::Vacant(slot) => {
                    let what =
                        || format!("kernel `{name}` on the interpreter: reading `{}`", b.name);
                    slot.insert(HostCopy {
                        raw: b.raw.clone(),
                        bytes: gpu.read_raw(&b.raw, b.raw.size(), &what)?,
                        written: false,
                    })
                }
            };
            let view = &copy.bytes[b.offset as usize..(b.offset + b.bytes) as usize];
            run.buffers.insert(b.name.clone(), view.to_vec());
        }
        let result = interpret(&self.kernel, &mut run);
        // What `k.debug` printed, also (above all) when the launch faulted.
        for p in &run.printed {
            eprintln!("kernel `{name}`: {p}");
        }
        result.map_err(|e| ExecError::Interpreter(Box::new(e)))?;
        for b in self.buffers.iter().filter(|b| b.writable) {
            let copy = memory.get_mut(&b.buffer).expect("read above");
            let range = b.offset as usize..(b.offset + b.bytes) as usize;
            copy.bytes[range].copy_from_slice(&run.buffers[&b.name]);
            copy.written = true;
        }
        Ok(())
    }
}
