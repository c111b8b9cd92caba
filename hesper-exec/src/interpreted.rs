//! The executor on the DSL's interpreter ([`GpuOptions::interpreter`](crate::GpuOptions::interpreter)):
//! no GPU and no Vulkan driver, every launch run by [`hesper_dsl::interp`] with its checks.
//!
//! Buffers live in wgpu's noop backend, which keeps them in host memory and runs copies,
//! clears and mappings at submit but does nothing for a dispatch. Everything above the
//! dispatch stays the executor's own — buffers, uploads and readbacks, the pipeline cache (the
//! WGSL is still emitted and validated by naga), the binding and parameter checks — so code
//! that runs on a GPU runs here unchanged. A recorder keeps its launches (the executor's copies
//! and fills are kernels too) and, at submit, runs them in order: each reads its buffers back,
//! is interpreted, and writes back the buffers it may write.

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
/// exercised at sizes an interpreter gets through.
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

/// A buffer as one binding sees it: the first `bytes` bytes of `raw` (the view's elements;
/// the interpreter's bounds are the buffer's length, not its padded allocation).
pub(crate) struct InterpretedBinding {
    pub name: String,
    pub raw: wgpu::Buffer,
    pub bytes: u64,
    /// Whether the kernel may write it (`read_write`): only those are written back.
    pub written: bool,
}

impl InterpretedLaunch {
    /// Interpret the launch over its buffers' contents now (what was submitted before has
    /// run: the noop backend runs a submit at once), and write back what it may write.
    pub fn run(self, gpu: &Gpu) -> Result<(), ExecError> {
        let name = self.kernel.name();
        let mut run = Run::new(self.workgroups);
        run.subgroup_size = SUBGROUP_SIZE;
        run.params = self.params.into_iter().collect();
        // Whole 4-byte words move (an odd number of f16 reads its padding, kept as it was).
        let mut words = Vec::with_capacity(self.buffers.len());
        for b in &self.buffers {
            let what = || format!("kernel `{name}` on the interpreter: reading `{}`", b.name);
            let read = match b.bytes {
                0 => vec![],
                n => gpu.read_raw(&b.raw, n.next_multiple_of(4), &what)?,
            };
            run.buffers
                .insert(b.name.clone(), read[..b.bytes as usize].to_vec());
            words.push(read);
        }
        interpret(&self.kernel, &mut run).map_err(|e| ExecError::Interpreter(Box::new(e)))?;
        for p in &run.printed {
            eprintln!("kernel `{name}`: {p}");
        }
        for (b, mut word) in self.buffers.into_iter().zip(words) {
            if !b.written || b.bytes == 0 {
                continue;
            }
            word[..b.bytes as usize].copy_from_slice(&run.buffers[&b.name]);
            let what = || format!("kernel `{name}` on the interpreter: writing `{}`", b.name);
            gpu.scoped(&what, || gpu.queue.write_buffer(&b.raw, 0, &word))?;
        }
        Ok(())
    }
}
