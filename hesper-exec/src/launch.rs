//! Launching a kernel: compile, bind buffers by the kernel's declared names (checked before
//! anything is dispatched), pass runtime scalars, size the dispatch (2-D past 65535 groups).

use hesper_dsl::{Kernel, Scalar, Ty};
use wgpu::util::DeviceExt;

use crate::buffer::{Element, GpuBuffer};
use crate::error::ExecError;
use crate::gpu::Gpu;

/// A runtime scalar's value.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ParamValue {
    F32(f32),
    U32(u32),
    I32(i32),
}

impl ParamValue {
    fn scalar(self) -> Scalar {
        match self {
            ParamValue::F32(_) => Scalar::F32,
            ParamValue::U32(_) => Scalar::U32,
            ParamValue::I32(_) => Scalar::I32,
        }
    }
    fn bytes(self) -> [u8; 4] {
        match self {
            ParamValue::F32(v) => v.to_le_bytes(),
            ParamValue::U32(v) => v.to_le_bytes(),
            ParamValue::I32(v) => v.to_le_bytes(),
        }
    }
}

impl From<f32> for ParamValue {
    fn from(v: f32) -> Self {
        ParamValue::F32(v)
    }
}
impl From<u32> for ParamValue {
    fn from(v: u32) -> Self {
        ParamValue::U32(v)
    }
}
impl From<i32> for ParamValue {
    fn from(v: i32) -> Self {
        ParamValue::I32(v)
    }
}

struct BoundBuffer<'a> {
    name: &'a str,
    raw: &'a wgpu::Buffer,
    ty: Ty,
    len: usize,
}

/// The buffers and runtime scalars of one launch, by the names the kernel declared.
#[derive(Default)]
pub struct Args<'a> {
    buffers: Vec<BoundBuffer<'a>>,
    params: Vec<(&'a str, ParamValue)>,
}

impl<'a> Args<'a> {
    pub fn new() -> Self {
        Args::default()
    }
    /// Bind `buffer` to the kernel's storage binding `name`.
    pub fn buffer<T: Element>(mut self, name: &'a str, buffer: &'a GpuBuffer<T>) -> Self {
        self.buffers.push(BoundBuffer {
            name,
            raw: buffer.raw(),
            ty: T::ty(),
            len: buffer.len(),
        });
        self
    }
    /// Set the kernel's runtime scalar `name`.
    pub fn param(mut self, name: &'a str, value: impl Into<ParamValue>) -> Self {
        self.params.push((name, value.into()));
        self
    }
}

/// How many invocations to launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Grid {
    /// At least `n` invocations in 1-D: `ceil(n / workgroup invocations)` workgroups, laid out
    /// 2-D past 65535 (pair with `KernelBuilder::global_index`, which flattens them back).
    Threads(u64),
    /// Exactly these workgroup counts.
    Workgroups([u32; 3]),
}

/// A compiled kernel: its pipeline and bind group layout.
pub struct Pipeline {
    pub(crate) pipeline: wgpu::ComputePipeline,
    pub(crate) layout: wgpu::BindGroupLayout,
}

fn err_binding(
    k: &Kernel,
    binding: &str,
    expected: impl Into<String>,
    given: impl Into<String>,
) -> ExecError {
    ExecError::Binding {
        kernel: k.name().into(),
        binding: binding.into(),
        expected: expected.into(),
        given: given.into(),
    }
}

impl Gpu {
    /// Check the kernel against this device and compile it.
    pub fn compile(&self, kernel: &Kernel) -> Result<Pipeline, ExecError> {
        let missing = |feature| ExecError::MissingFeature {
            kernel: kernel.name().into(),
            feature,
            adapter: self.adapter_info().name.clone(),
        };
        let has = |f| self.wgpu_features().contains(f);
        if kernel.uses_subgroups() && !has(wgpu::Features::SUBGROUP) {
            return Err(missing("SUBGROUP"));
        }
        if kernel.uses_f16() && !has(wgpu::Features::SHADER_F16) {
            return Err(missing("SHADER_F16"));
        }
        if kernel.params_as_immediates()
            && !kernel.params().is_empty()
            && !has(wgpu::Features::IMMEDIATES)
        {
            return Err(missing("IMMEDIATES"));
        }
        kernel.check_limits(&self.kernel_limits())?;

        let storage = |binding, read_only| wgpu::BindGroupLayoutEntry {
            binding,
            visibility: wgpu::ShaderStages::COMPUTE,
            ty: wgpu::BindingType::Buffer {
                ty: wgpu::BufferBindingType::Storage { read_only },
                has_dynamic_offset: false,
                min_binding_size: None,
            },
            count: None,
        };
        let mut entries: Vec<_> = kernel
            .bindings()
            .iter()
            .map(|b| storage(b.binding, b.access == hesper_dsl::Access::Read))
            .collect();
        if let Some(binding) = kernel.params_binding() {
            entries.push(wgpu::BindGroupLayoutEntry {
                binding,
                visibility: wgpu::ShaderStages::COMPUTE,
                ty: wgpu::BindingType::Buffer {
                    ty: wgpu::BufferBindingType::Uniform,
                    has_dynamic_offset: false,
                    min_binding_size: None,
                },
                count: None,
            });
        }
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let layout = self
            .device
            .create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
                label: Some(kernel.name()),
                entries: &entries,
            });
        let immediate_size = if kernel.params_as_immediates() {
            kernel.params_size()
        } else {
            0
        };
        let pipeline_layout = self
            .device
            .create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
                label: Some(kernel.name()),
                bind_group_layouts: &[Some(&layout)],
                immediate_size,
            });
        let module = self
            .device
            .create_shader_module(wgpu::ShaderModuleDescriptor {
                label: Some(kernel.name()),
                source: wgpu::ShaderSource::Wgsl(kernel.wgsl().into()),
            });
        let pipeline = self
            .device
            .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(kernel.name()),
                layout: Some(&pipeline_layout),
                module: &module,
                entry_point: Some("main"),
                compilation_options: Default::default(),
                cache: None,
            });
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(ExecError::Pipeline {
                kernel: kernel.name().into(),
                message: e.to_string(),
            });
        }
        Ok(Pipeline { pipeline, layout })
    }

    /// Compile `kernel`, check `args` against its declarations, and submit one launch of `grid`.
    /// Does not wait; reading a buffer back does.
    pub fn run(&self, kernel: &Kernel, args: &Args<'_>, grid: Grid) -> Result<(), ExecError> {
        let pipeline = self.compile(kernel)?;
        self.launch(kernel, &pipeline, args, grid)
    }

    /// Submit one launch of an already compiled kernel.
    pub fn launch(
        &self,
        kernel: &Kernel,
        pipeline: &Pipeline,
        args: &Args<'_>,
        grid: Grid,
    ) -> Result<(), ExecError> {
        let entries = bind_entries(kernel, args)?;
        let params = param_bytes(kernel, args)?;
        let groups = self.workgroups(kernel, grid)?;
        let uniform = kernel.params_binding().map(|_| {
            self.device
                .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                    label: Some("hesper params"),
                    contents: &params,
                    usage: wgpu::BufferUsages::UNIFORM,
                })
        });
        let mut entries: Vec<wgpu::BindGroupEntry> = entries
            .into_iter()
            .map(|(binding, raw)| wgpu::BindGroupEntry {
                binding,
                resource: raw.as_entire_binding(),
            })
            .collect();
        if let (Some(binding), Some(u)) = (kernel.params_binding(), &uniform) {
            entries.push(wgpu::BindGroupEntry {
                binding,
                resource: u.as_entire_binding(),
            });
        }
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let bind_group = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some(kernel.name()),
            layout: &pipeline.layout,
            entries: &entries,
        });
        let mut enc = self.device.create_command_encoder(&Default::default());
        {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some(kernel.name()),
                timestamp_writes: None,
            });
            pass.set_pipeline(&pipeline.pipeline);
            pass.set_bind_group(0, &bind_group, &[]);
            if kernel.params_as_immediates() && !params.is_empty() {
                pass.set_immediates(0, &params);
            }
            pass.dispatch_workgroups(groups[0], groups[1], groups[2]);
        }
        self.queue.submit([enc.finish()]);
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(ExecError::Pipeline {
                kernel: kernel.name().into(),
                message: e.to_string(),
            });
        }
        Ok(())
    }

    /// Workgroup counts for `grid`, checked against the device's per-dimension limit.
    pub fn workgroups(&self, kernel: &Kernel, grid: Grid) -> Result<[u32; 3], ExecError> {
        let max = self.wgpu_limits().max_compute_workgroups_per_dimension;
        let groups = match grid {
            Grid::Workgroups(g) => g,
            Grid::Threads(n) => {
                let total = n.div_ceil(kernel.key().invocations() as u64).max(1);
                let x = total.min(max as u64);
                [x as u32, total.div_ceil(x).min(u32::MAX as u64) as u32, 1]
            }
        };
        if groups.iter().any(|g| *g > max) {
            return Err(ExecError::Dispatch {
                kernel: kernel.name().into(),
                what: format!("{grid:?} = {groups:?} workgroups"),
                why: format!("the device allows {max} per dimension"),
            });
        }
        Ok(groups)
    }
}

/// Match `args` to the kernel's bindings: every binding given once, nothing extra, element
/// types equal, no empty buffer.
fn bind_entries<'a>(
    kernel: &Kernel,
    args: &Args<'a>,
) -> Result<Vec<(u32, &'a wgpu::Buffer)>, ExecError> {
    for (i, a) in args.buffers.iter().enumerate() {
        if kernel.binding(a.name).is_none() {
            let declared: Vec<&str> = kernel.bindings().iter().map(|b| b.name.as_str()).collect();
            return Err(err_binding(
                kernel,
                a.name,
                format!("one of {declared:?}"),
                "a buffer for a binding the kernel does not declare",
            ));
        }
        if args.buffers[..i].iter().any(|b| b.name == a.name) {
            return Err(err_binding(kernel, a.name, "one buffer", "two"));
        }
    }
    kernel
        .bindings()
        .iter()
        .map(|b| {
            let Some(a) = args.buffers.iter().find(|a| a.name == b.name) else {
                return Err(err_binding(
                    kernel,
                    &b.name,
                    format!("a buffer of {}", b.elem),
                    "none",
                ));
            };
            if a.ty != b.elem {
                return Err(err_binding(
                    kernel,
                    &b.name,
                    format!("elements of {}", b.elem),
                    format!("elements of {}", a.ty),
                ));
            }
            if a.len == 0 {
                return Err(err_binding(
                    kernel,
                    &b.name,
                    "at least one element",
                    "an empty buffer",
                ));
            }
            Ok((b.binding, a.raw))
        })
        .collect()
}

/// The params block: each runtime scalar at its offset, padded to 16 bytes.
fn param_bytes(kernel: &Kernel, args: &Args<'_>) -> Result<Vec<u8>, ExecError> {
    let err = |param: &str, expected: String, given: String| ExecError::Param {
        kernel: kernel.name().into(),
        param: param.into(),
        expected,
        given,
    };
    for (name, _) in &args.params {
        if !kernel.params().iter().any(|p| p.name == *name) {
            return Err(err(
                name,
                "a runtime scalar the kernel declares".into(),
                "a value for an undeclared one".into(),
            ));
        }
    }
    let mut bytes = vec![0u8; kernel.params_size() as usize];
    for p in kernel.params() {
        let given: Vec<_> = args.params.iter().filter(|(n, _)| *n == p.name).collect();
        match given.as_slice() {
            [] => return Err(err(&p.name, p.ty.wgsl().into(), "no value".into())),
            [(_, v)] if v.scalar() == p.ty => {
                let at = p.offset as usize;
                bytes[at..at + 4].copy_from_slice(&v.bytes());
            }
            [(_, v)] => return Err(err(&p.name, p.ty.wgsl().into(), format!("{v:?}"))),
            _ => {
                return Err(err(
                    &p.name,
                    "one value".into(),
                    format!("{} values", given.len()),
                ));
            }
        }
    }
    Ok(bytes)
}
