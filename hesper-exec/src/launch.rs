//! Launching kernels: buffers bound by the kernel's declared names and checked before anything
//! is dispatched, runtime scalars, dispatch sizes (2-D past 65535 groups), and a [`Recorder`]
//! that takes many launches into one compute pass and submits them at once.

use std::collections::{HashMap, HashSet};
use std::num::NonZeroU64;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use hesper_dsl::{Access, Kernel, Scalar, Ty};

use crate::buffer::{BufferTracking, Element, GpuBuffer};
use crate::cache::CompiledKernel;
use crate::error::ExecError;
use crate::gpu::Gpu;
#[cfg(not(target_arch = "wasm32"))]
use crate::interpreted::{self, InterpretedBinding, InterpretedLaunch};
#[cfg(not(target_arch = "wasm32"))]
use hesper_dsl::interp::ScalarValue;

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

/// `1000 (i32)`: the value and its type, as error messages show it.
impl std::fmt::Display for ParamValue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ParamValue::F32(v) => write!(f, "{v} (f32)"),
            ParamValue::U32(v) => write!(f, "{v} (u32)"),
            ParamValue::I32(v) => write!(f, "{v} (i32)"),
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
    /// The bytes of `raw` bound: from `offset` (a view's), `size` of them.
    offset: u64,
    size: u64,
    tracking: &'a Arc<BufferTracking>,
    ty: Ty,
    len: usize,
    /// The fewest elements the launch reads or writes through this binding, and how that was
    /// reckoned (`#[len(rows * cols)]`), for the error.
    min_len: usize,
    rule: Option<&'a str>,
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
    pub fn buffer<T: Element>(self, name: &'a str, buffer: &'a GpuBuffer<T>) -> Self {
        self.buffer_at_least(name, buffer, 1)
    }
    /// Bind `buffer` to `name`, and check that it holds at least `min_len` elements (what the
    /// launch will touch): a shorter one is an error before dispatch, not a clamped read.
    pub fn buffer_at_least<T: Element>(
        mut self,
        name: &'a str,
        buffer: &'a GpuBuffer<T>,
        min_len: usize,
    ) -> Self {
        self.buffers.push(BoundBuffer {
            name,
            raw: buffer.raw(),
            offset: buffer.offset(),
            size: buffer.binding_size(),
            tracking: &buffer.tracking,
            ty: T::ty(),
            len: buffer.len(),
            min_len: min_len.max(1),
            rule: None,
        });
        self
    }
    /// [`Args::buffer_at_least`], with the rule `min_len` came from (`#[len(rows * cols)]`,
    /// as `#[kernel]`'s launcher gives it) named in the error.
    pub fn buffer_at_least_by<T: Element>(
        self,
        name: &'a str,
        buffer: &'a GpuBuffer<T>,
        min_len: usize,
        rule: &'a str,
    ) -> Self {
        let mut args = self.buffer_at_least(name, buffer, min_len);
        if let Some(bound) = args.buffers.last_mut() {
            bound.rule = Some(rule);
        }
        args
    }
    /// Bind a buffer of scalars (f32, f16, u32, i32) as `array<vec4<…>>` (four elements per
    /// load, for bandwidth-bound kernels). Its allocation is padded to 16 bytes, so the last
    /// vec4 is whole; the kernel must not rely on the padding's values, and may write it.
    pub fn buffer_vec4<T: Element>(mut self, name: &'a str, buffer: &'a GpuBuffer<T>) -> Self {
        let len = buffer.len().div_ceil(4);
        // A vector buffer's view stays its own type, which the kernel's binding then refuses.
        let ty = match T::ty() {
            Ty::Scalar(s) => Ty::Vector(4, s),
            other => other,
        };
        self.buffers.push(BoundBuffer {
            name,
            raw: buffer.raw(),
            offset: buffer.offset(),
            size: buffer.binding_size(),
            tracking: &buffer.tracking,
            ty,
            len,
            min_len: len.max(1),
            rule: None,
        });
        self
    }
    /// Bind a buffer under another element type (the executor's own fill and copy kernels
    /// view any buffer as `vec4<u32>`).
    pub(crate) fn raw<T: Element>(
        mut self,
        name: &'a str,
        buffer: &'a GpuBuffer<T>,
        ty: Ty,
        len: usize,
    ) -> Self {
        self.buffers.push(BoundBuffer {
            name,
            raw: buffer.raw(),
            offset: buffer.offset(),
            size: buffer.binding_size(),
            tracking: &buffer.tracking,
            ty,
            len,
            min_len: len.max(1),
            rule: None,
        });
        self
    }
    /// Set the kernel's runtime scalar `name`.
    pub fn param(mut self, name: &'a str, value: impl Into<ParamValue>) -> Self {
        self.params.push((name, value.into()));
        self
    }
}

/// How many invocations to launch. A dispatch holds at most 2³² invocations (flat indices are
/// `u32`); a larger one is refused rather than left to wrap.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Grid {
    /// At least `n` invocations in 1-D: `ceil(n / workgroup invocations)` workgroups, laid out
    /// 2-D past 65535 (pair with `KernelBuilder::global_index`, which flattens them back; the
    /// layout is not a 2-D problem's). Refused for a kernel with a 2-D or 3-D workgroup.
    Threads(u64),
    /// One workgroup per item (a row, a head, a block), `n` of them, laid out 2-D past 65535
    /// like `Threads` (pair with `KernelBuilder::workgroup_index`, and guard it by `n`: a few
    /// spare workgroups may run). For a kernel that indexes by workgroup, `Threads(rows)` would
    /// launch `rows / invocations` workgroups and leave most rows unwritten, so a kernel that
    /// calls `workgroup_index()` and never `global_index()` is refused a `Threads` grid.
    WorkgroupPerItem(u64),
    /// Exactly these workgroup counts: for 2-D tiles, `[cols.div_ceil(TX), rows.div_ceil(TY), 1]`
    /// with a `TX×TY` workgroup, read back as `workgroup_id()` and `local_id()`.
    Workgroups([u32; 3]),
}

/// `total` workgroups in as few rows of at most `max` as fit, each as full as it can be: the
/// spare workgroups (which only run their bounds check) are fewer than the rows.
fn flat_layout(total: u64, max: u32) -> [u32; 3] {
    let total = total.max(1);
    let rows = total.div_ceil(max as u64);
    let x = total.div_ceil(rows);
    [x as u32, rows.min(u32::MAX as u64) as u32, 1]
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

/// Uniform bytes of one recorder, in 64 KiB chunks; written to the GPU at submit.
struct UniformChunk {
    buffer: wgpu::Buffer,
    bytes: Vec<u8>,
}

const UNIFORM_CHUNK: u64 = 64 * 1024;

/// The largest params block one launch can take in a uniform buffer on `gpu`.
pub(crate) fn max_uniform_params(gpu: &Gpu) -> u32 {
    UNIFORM_CHUNK.min(gpu.wgpu_limits().max_uniform_buffer_binding_size) as u32
}

/// Launches one timed recorder can time: wgpu's query sets hold at most 4096 queries.
pub const MAX_TIMED_LAUNCHES: u32 = 2048;

/// Per-launch GPU time from timestamp queries.
#[derive(Clone, Debug, PartialEq)]
pub struct LaunchTiming {
    pub kernel: String,
    /// The kernel's whole key (its shape parameters: which GEMM, which tile) and the
    /// launch's workgroups, e.g. `coop_matmul_nt cols=576 … wg=256x1x1 [3, 32, 1]`.
    pub launch: String,
    pub gpu_ns: f64,
}

struct Timing {
    queries: wgpu::QuerySet,
    capacity: u32,
    /// Each launch's kernel name and [`LaunchTiming::launch`], in order.
    launches: Vec<(String, String)>,
}

/// Bind groups and params buffers kept from one recorder to the next, for work that repeats
/// the same launches on the same buffers (decoding: every token runs the same kernels): a
/// recorder made by [`Gpu::recorder_reusing`] takes a launch's bind group from here when the
/// same kernel ran on the same buffers at the same params offset before, rather than creating
/// one (about half of a small launch's recording time on the H200's host and here).
///
/// What it holds keeps the buffers it bound alive (a wgpu bind group refers to them), so keep
/// one beside the buffers it serves, not for all of a program's work; past
/// [`LaunchCache::MAX_BIND_GROUPS`] it starts again empty. Cloning shares it.
#[derive(Clone, Default)]
pub struct LaunchCache {
    inner: Arc<Mutex<LaunchCacheInner>>,
}

#[derive(Default)]
struct LaunchCacheInner {
    /// The params chunks, in the order a recorder fills them.
    uniforms: Vec<wgpu::Buffer>,
    bind_groups: HashMap<BindKey, wgpu::BindGroup>,
}

/// A bind group's identity: its layout (wgpu compares layouts by identity), its buffers by id
/// in binding order (ids are never reused) with the range of each bound, and its params
/// chunk and offset.
#[derive(Hash, PartialEq, Eq)]
struct BindKey {
    layout: wgpu::BindGroupLayout,
    /// Each binding's buffer and the bytes of it bound (a view's offset and size).
    buffers: Vec<(u64, u64, u64)>,
    uniform: Option<(usize, u64)>,
}

impl LaunchCache {
    /// The most bind groups it keeps before it starts again empty (a recorder of many
    /// launches at growing params offsets would otherwise add a bind group per launch).
    pub const MAX_BIND_GROUPS: usize = 8192;

    pub fn new() -> LaunchCache {
        LaunchCache::default()
    }

    /// Bind groups it holds now.
    pub fn len(&self) -> usize {
        self.lock().bind_groups.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Drop every bind group and params buffer (and so its hold on the buffers they bound).
    pub fn clear(&self) {
        let mut inner = self.lock();
        inner.bind_groups.clear();
        inner.uniforms.clear();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, LaunchCacheInner> {
        // Nothing panics while holding it; a poisoned lock still holds consistent maps.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Records launches into one compute pass (wgpu orders dependent dispatches inside a pass) and
/// submits them in one command buffer. One recorder per training step, one submit.
///
/// A timing recorder ([`Gpu::timed_recorder`]) gives each launch its own pass with timestamp
/// queries instead, and [`Recorder::submit_timed`] returns each launch's GPU time.
///
/// Until it is submitted (or dropped), the buffers its launches use refuse host reads and writes
/// ([`ExecError::InUse`]): those would take effect before the recorded launches run.
pub struct Recorder<'g> {
    gpu: &'g Gpu,
    // Field order matters: the pass must drop before the encoder it records into.
    pass: Option<wgpu::ComputePass<'static>>,
    encoder: Option<wgpu::CommandEncoder>,
    uniforms: Vec<UniformChunk>,
    launches: usize,
    timing: Option<Timing>,
    /// The buffers the recorded launches use, each counted once in its `pending`.
    uses: Vec<Arc<BufferTracking>>,
    used_ids: HashSet<u64>,
    reuse: Option<LaunchCache>,
    /// On the interpreter ([`GpuOptions::interpreter`](crate::GpuOptions::interpreter)): the
    /// launches, run in order at submit.
    #[cfg(not(target_arch = "wasm32"))]
    interpreted: Vec<InterpretedLaunch>,
}

impl Gpu {
    /// A recorder for many launches and one submit.
    pub fn recorder(&self) -> Recorder<'_> {
        Recorder {
            gpu: self,
            pass: None,
            encoder: None,
            uniforms: vec![],
            launches: 0,
            timing: None,
            uses: vec![],
            used_ids: HashSet::new(),
            reuse: None,
            #[cfg(not(target_arch = "wasm32"))]
            interpreted: vec![],
        }
    }

    /// A recorder whose launches take their bind groups and params buffers from `cache` where
    /// it has them (and leave theirs there): for work that records the same launches again
    /// and again, such as decoding one token after another ([`LaunchCache`]).
    pub fn recorder_reusing(&self, cache: &LaunchCache) -> Recorder<'_> {
        let mut rec = self.recorder();
        rec.reuse = Some(cache.clone());
        rec
    }

    /// A recorder that times each of up to `capacity` launches with timestamp queries.
    pub fn timed_recorder(&self, capacity: u32) -> Result<Recorder<'_>, ExecError> {
        if capacity > MAX_TIMED_LAUNCHES {
            return Err(ExecError::Device(format!(
                "a timed recorder holds at most {MAX_TIMED_LAUNCHES} launches (wgpu's 4096 queries, two each); {capacity} asked for"
            )));
        }
        if !self.supports_timestamps() {
            return Err(ExecError::Device(format!(
                "{} has no TIMESTAMP_QUERY: launches cannot be timed",
                self.describe()
            )));
        }
        let queries = self.scoped(&|| format!("a timed recorder of {capacity}"), || {
            self.device.create_query_set(&wgpu::QuerySetDescriptor {
                label: Some("hesper timestamps"),
                ty: wgpu::QueryType::Timestamp,
                count: 2 * capacity.max(1),
            })
        })?;
        let mut rec = self.recorder();
        rec.timing = Some(Timing {
            queries,
            capacity,
            launches: vec![],
        });
        Ok(rec)
    }

    /// Compile (through the cache) and submit one launch. Does not wait; reading a buffer does.
    pub fn run(&self, kernel: &Kernel, args: &Args<'_>, grid: Grid) -> Result<(), ExecError> {
        let compiled = self.compile(kernel)?;
        let mut rec = self.recorder();
        rec.launch(&compiled, args, grid)?;
        rec.submit()
    }

    /// Workgroup counts for `grid`, checked against the device's per-dimension limit.
    pub fn workgroups(&self, kernel: &Kernel, grid: Grid) -> Result<[u32; 3], ExecError> {
        let max = self.wgpu_limits().max_compute_workgroups_per_dimension;
        let too_many = |invocations: u64| ExecError::Dispatch {
            kernel: kernel.name().into(),
            what: format!("{grid:?}: {invocations} invocations"),
            why: "a dispatch holds at most 2^32 invocations (flat indices are u32 and would \
                  wrap); split the work or loop over it (grid_stride)"
                .into(),
        };
        if let Grid::Threads(n) = grid
            && n > 1 << 32
        {
            return Err(too_many(n));
        }
        let [wx, wy, wz] = kernel.key().wg_size();
        if matches!(grid, Grid::Threads(_)) && (wy, wz) != (1, 1) {
            return Err(ExecError::Dispatch {
                kernel: kernel.name().into(),
                what: format!("{grid:?}"),
                why: format!(
                    "Threads is a 1-D grid, and the kernel's workgroup is {wx}×{wy}×{wz}: launch \
                     a 2-D (3-D) kernel with Grid::Workgroups([cols.div_ceil({wx}), \
                     rows.div_ceil({wy}), {}])",
                    if wz == 1 {
                        "1".to_string()
                    } else {
                        format!("depth.div_ceil({wz})")
                    }
                ),
            });
        }
        if let (Grid::Threads(n), Some(at)) = (grid, kernel.indexes_by_workgroup()) {
            return Err(ExecError::Dispatch {
                kernel: kernel.name().into(),
                what: format!("{grid:?}"),
                why: format!(
                    "the kernel indexes by workgroup (`workgroup_index()` at {at}): launch it \
                     with Grid::WorkgroupPerItem(items); Grid::Threads({n}) runs {n} / {} \
                     workgroups, which leaves items undone unless {n} is exactly items × {}",
                    kernel.key().invocations(),
                    kernel.key().invocations()
                ),
            });
        }
        let groups = match grid {
            Grid::Workgroups(g) => g,
            Grid::Threads(n) => flat_layout(n.div_ceil(kernel.key().invocations() as u64), max),
            Grid::WorkgroupPerItem(n) => flat_layout(n, max),
        };
        if groups.iter().any(|g| *g > max) || groups.contains(&0) {
            let hint = match grid {
                Grid::Workgroups(_) => {
                    "; for one workgroup per item use Grid::WorkgroupPerItem, which lays them out \
                     in 2-D (KernelBuilder::workgroup_index flattens them back)"
                }
                Grid::Threads(_) | Grid::WorkgroupPerItem(_) => "",
            };
            return Err(ExecError::Dispatch {
                kernel: kernel.name().into(),
                what: format!("{grid:?} = {groups:?} workgroups"),
                why: format!("each dimension must be 1..={max}{hint}"),
            });
        }
        let invocations =
            groups.iter().map(|g| *g as u64).product::<u64>() * kernel.key().invocations() as u64;
        if invocations > 1 << 32 {
            return Err(too_many(invocations));
        }
        Ok(groups)
    }
}

impl<'g> Recorder<'g> {
    /// The device this recorder records for.
    pub fn gpu(&self) -> &'g Gpu {
        self.gpu
    }

    /// Launches recorded so far.
    pub fn len(&self) -> usize {
        self.launches
    }

    pub fn is_empty(&self) -> bool {
        self.launches == 0
    }

    /// Check `args` against the kernel's declarations and record one launch of `grid`. Nothing
    /// is recorded when the check fails.
    pub fn launch(
        &mut self,
        compiled: &CompiledKernel,
        args: &Args<'_>,
        grid: Grid,
    ) -> Result<(), ExecError> {
        let kernel = compiled.kernel();
        if compiled.gpu() != self.gpu.id() {
            return Err(ExecError::WrongGpu {
                what: format!("compiled kernel `{}`", kernel.name()),
                owner: compiled.gpu(),
                used_with: self.gpu.id(),
            });
        }
        let groups = self.gpu.workgroups(kernel, grid)?;
        check_buffers(self.gpu, kernel, args)?;
        let params = param_bytes(kernel, args)?;
        if let Some(t) = &self.timing
            && t.launches.len() as u32 >= t.capacity
        {
            return Err(ExecError::Dispatch {
                kernel: kernel.name().into(),
                what: format!("launch {} in a timed recorder", t.launches.len() + 1),
                why: format!("it was made for {} launches", t.capacity),
            });
        }
        self.record(compiled, args, &params, groups)?;
        for a in &args.buffers {
            if self.used_ids.insert(a.tracking.id) {
                a.tracking.pending.fetch_add(1, Ordering::AcqRel);
                self.uses.push(a.tracking.clone());
            }
        }
        self.launches += 1;
        Ok(())
    }

    /// The wgpu side of a checked launch: its params, bind group and dispatch. Only what wgpu
    /// checks at once (a new params buffer, a bind group) runs inside error scopes: a pass's
    /// commands are checked when the pass ends, at submit, which has scopes of its own (a
    /// launch whose bind group is reused pushes none, half its recording time here).
    fn record(
        &mut self,
        compiled: &CompiledKernel,
        args: &Args<'_>,
        params: &[u8],
        groups: [u32; 3],
    ) -> Result<(), ExecError> {
        #[cfg(not(target_arch = "wasm32"))]
        if self.gpu.interprets() {
            self.interpreted
                .push(interpreted_launch(compiled, args, groups));
            return Ok(());
        }
        let kernel = compiled.kernel();
        let what = || format!("kernel `{}`: recording a launch", kernel.name());
        let gpu = self.gpu;
        let uniform = match kernel.params_binding() {
            Some(binding) => Some((binding, gpu.scoped(&what, || self.push_uniform(params))?)),
            None => None,
        };

        let mut entries: Vec<wgpu::BindGroupEntry> =
            Vec::with_capacity(kernel.bindings().len() + 1);
        for b in kernel.bindings() {
            let a = args
                .buffers
                .iter()
                .find(|a| a.name == b.name)
                .expect("checked above");
            entries.push(wgpu::BindGroupEntry {
                binding: b.binding,
                resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                    buffer: a.raw,
                    offset: a.offset,
                    size: NonZeroU64::new(a.size),
                }),
            });
        }
        if let Some((binding, (chunk, offset))) = uniform {
            entries.push(wgpu::BindGroupEntry {
                binding,
                resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                    buffer: &self.uniforms[chunk].buffer,
                    offset,
                    size: NonZeroU64::new(kernel.params_size() as u64),
                }),
            });
        }
        let create = || {
            gpu.scoped(&what, || {
                gpu.device.create_bind_group(&wgpu::BindGroupDescriptor {
                    label: None,
                    layout: &compiled.layout,
                    entries: &entries,
                })
            })
        };
        let bind_group = match &self.reuse {
            Some(cache) if self.timing.is_none() => {
                let key = BindKey {
                    layout: compiled.layout.clone(),
                    buffers: kernel
                        .bindings()
                        .iter()
                        .map(|b| {
                            let a = args.buffers.iter().find(|a| a.name == b.name);
                            let a = a.expect("checked above");
                            (a.tracking.id, a.offset, a.size)
                        })
                        .collect(),
                    uniform: uniform.map(|(_, (chunk, offset))| (chunk, offset)),
                };
                let mut inner = cache.lock();
                match inner.bind_groups.get(&key) {
                    Some(group) => group.clone(),
                    None => {
                        if inner.bind_groups.len() >= LaunchCache::MAX_BIND_GROUPS {
                            inner.bind_groups.clear();
                        }
                        let group = create()?;
                        inner.bind_groups.insert(key, group.clone());
                        group
                    }
                }
            }
            _ => create()?,
        };

        if let Some(t) = &mut self.timing {
            // A pass per launch, so each one's time is its own.
            let i = t.launches.len() as u32;
            let launch = format!("{} {groups:?}", kernel.key());
            t.launches.push((kernel.name().to_string(), launch));
            let timestamp_writes = wgpu::ComputePassTimestampWrites {
                query_set: &t.queries,
                beginning_of_pass_write_index: Some(2 * i),
                end_of_pass_write_index: Some(2 * i + 1),
            };
            self.pass = None;
            let encoder = self
                .encoder
                .get_or_insert_with(|| self.gpu.device.create_command_encoder(&Default::default()));
            let pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some(kernel.name()),
                timestamp_writes: Some(timestamp_writes),
            });
            self.pass = Some(pass.forget_lifetime());
        }
        let pass = self.pass();
        pass.set_pipeline(&compiled.pipeline);
        pass.set_bind_group(0, &bind_group, &[]);
        if kernel.params_as_immediates() && !params.is_empty() {
            pass.set_immediates(0, params);
        }
        pass.dispatch_workgroups(groups[0], groups[1], groups[2]);
        Ok(())
    }

    fn pass(&mut self) -> &mut wgpu::ComputePass<'static> {
        if self.pass.is_none() {
            let encoder = self
                .encoder
                .get_or_insert_with(|| self.gpu.device.create_command_encoder(&Default::default()));
            let pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("hesper"),
                timestamp_writes: None,
            });
            self.pass = Some(pass.forget_lifetime());
        }
        self.pass.as_mut().expect("set just above")
    }

    /// Place a launch's params block in a uniform chunk: (chunk index, byte offset).
    fn push_uniform(&mut self, params: &[u8]) -> (usize, u64) {
        let align = self.gpu.wgpu_limits().min_uniform_buffer_offset_alignment as usize;
        let fits = |c: &UniformChunk| {
            c.bytes.len().next_multiple_of(align) + params.len() <= UNIFORM_CHUNK as usize
        };
        if !self.uniforms.last().is_some_and(fits) {
            let create = || {
                self.gpu.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("hesper params"),
                    size: UNIFORM_CHUNK,
                    usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
                    mapped_at_creation: false,
                })
            };
            // A reusing recorder's chunk `i` is its cache's chunk `i`: its bytes are written
            // at each submit, before that submit's launches (and after earlier submits').
            let buffer = match &self.reuse {
                Some(cache) => {
                    let mut inner = cache.lock();
                    let i = self.uniforms.len();
                    if inner.uniforms.len() <= i {
                        inner.uniforms.push(create());
                    }
                    inner.uniforms[i].clone()
                }
                None => create(),
            };
            self.uniforms.push(UniformChunk {
                buffer,
                bytes: vec![],
            });
        }
        let chunk = self.uniforms.len() - 1;
        let c = &mut self.uniforms[chunk];
        let offset = c.bytes.len().next_multiple_of(align);
        c.bytes.resize(offset, 0);
        c.bytes.extend_from_slice(params);
        (chunk, offset as u64)
    }

    /// End the pass and stage the uniform bytes (queue writes land before the next submit).
    fn finish(&mut self) -> Option<wgpu::CommandEncoder> {
        self.pass = None;
        for c in &self.uniforms {
            if !c.bytes.is_empty() {
                self.gpu.queue.write_buffer(&c.buffer, 0, &c.bytes);
            }
        }
        self.encoder.take()
    }

    /// Submit everything recorded, in one command buffer. Does not wait. An error wgpu reports
    /// for the recorded work (or a lost device) is returned here, and nothing is submitted.
    pub fn submit(mut self) -> Result<(), ExecError> {
        self.submit_inner().map(|_| ())
    }

    fn submit_inner(&mut self) -> Result<Option<wgpu::SubmissionIndex>, ExecError> {
        #[cfg(not(target_arch = "wasm32"))]
        if !self.interpreted.is_empty() {
            interpreted::run_submit(self.gpu, std::mem::take(&mut self.interpreted))?;
        }
        if self.encoder.is_none() {
            return Ok(None);
        }
        let gpu = self.gpu;
        // A poll reports a device lost since the last one (through its callback).
        gpu.poll_lost(false);
        let launches = self.launches;
        let what = || format!("submitting a recorder of {launches} launches");
        let commands = gpu.scoped(&what, || self.finish().map(|e| e.finish()))?;
        let Some(commands) = commands else {
            return Ok(None);
        };
        gpu.scoped(&what, || gpu.queue.submit([commands])).map(Some)
    }

    /// Submit, wait, and return each launch's GPU time (a timing recorder only).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn submit_timed(mut self) -> Result<Vec<LaunchTiming>, ExecError> {
        let Some(timing) = self.timing.take() else {
            return Err(ExecError::Device(
                "submit_timed needs a recorder from Gpu::timed_recorder".into(),
            ));
        };
        let n = timing.launches.len() as u32;
        if n == 0 {
            return Ok(vec![]);
        }
        let gpu = self.gpu;
        let bytes = 16 * n as u64;
        let what = || format!("resolving the timestamps of {n} timed launches");
        let resolve = gpu.scoped(&what, || {
            let resolve = gpu.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("hesper timestamps"),
                size: bytes,
                usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
                mapped_at_creation: false,
            });
            // After the last launch's pass, in the same command buffer.
            self.pass = None;
            if let Some(encoder) = &mut self.encoder {
                encoder.resolve_query_set(&timing.queries, 0..2 * n, &resolve, 0);
            }
            resolve
        })?;
        self.submit_inner()?;
        let raw: Vec<u64> = bytemuck::cast_slice(&gpu.read_raw(&resolve, bytes, &what)?).to_vec();
        let period = self.gpu.timestamp_period_ns() as f64;
        Ok(timing
            .launches
            .into_iter()
            .enumerate()
            .map(|(i, (kernel, launch))| LaunchTiming {
                kernel,
                launch,
                gpu_ns: raw[2 * i + 1].wrapping_sub(raw[2 * i]) as f64 * period,
            })
            .collect())
    }
}

/// A checked launch as the interpreter takes it: each binding's buffer and view, the scalars.
#[cfg(not(target_arch = "wasm32"))]
fn interpreted_launch(
    compiled: &CompiledKernel,
    args: &Args<'_>,
    workgroups: [u32; 3],
) -> InterpretedLaunch {
    let kernel = &compiled.kernel;
    let buffers = kernel
        .bindings()
        .iter()
        .map(|b| {
            let a = args.buffers.iter().find(|a| a.name == b.name);
            let a = a.expect("checked above");
            InterpretedBinding {
                name: b.name.clone(),
                buffer: a.tracking.id,
                raw: a.raw.clone(),
                offset: a.offset,
                bytes: a.len as u64 * a.ty.size() as u64,
                writable: b.access == Access::ReadWrite,
            }
        })
        .collect();
    let params = args
        .params
        .iter()
        .map(|(name, v)| {
            let v = match *v {
                ParamValue::F32(v) => ScalarValue::F32(v),
                ParamValue::U32(v) => ScalarValue::U32(v),
                ParamValue::I32(v) => ScalarValue::I32(v),
            };
            (name.to_string(), v)
        })
        .collect();
    InterpretedLaunch {
        kernel: kernel.clone(),
        workgroups,
        buffers,
        params,
    }
}

/// Match `args` to the kernel's bindings: every binding given once, nothing extra, each buffer
/// of this device, no buffer bound twice where one of the bindings writes it, element types
/// equal, long enough.
fn check_buffers(gpu: &Gpu, kernel: &Kernel, args: &Args<'_>) -> Result<(), ExecError> {
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
    for a in &args.buffers {
        a.tracking.check_gpu(gpu, || {
            format!(
                "kernel `{}`, binding `{}`: the buffer",
                kernel.name(),
                a.name
            )
        })?;
    }
    // A buffer written through one binding and read or written through another is a race
    // inside the dispatch, unless they are views of disjoint ranges that are both written
    // (wgpu tracks a buffer's use as a whole: it refuses read-only beside read-write, views
    // of disjoint ranges included, reporting it only as an uncaptured error): say which
    // bindings alias.
    let writes = |a: &BoundBuffer<'_>| {
        kernel
            .binding(a.name)
            .is_some_and(|b| b.access == Access::ReadWrite)
    };
    let overlap = |a: &BoundBuffer<'_>, b: &BoundBuffer<'_>| {
        a.offset < b.offset + b.size && b.offset < a.offset + a.size
    };
    for (i, a) in args.buffers.iter().enumerate() {
        for b in &args.buffers[i + 1..] {
            if a.tracking.id != b.tracking.id || !(writes(a) || writes(b)) {
                continue;
            }
            let (w, other) = if writes(a) { (a, b) } else { (b, a) };
            let expected = match (writes(other), overlap(a, b)) {
                (true, false) => continue,
                (written, true) => {
                    let how = if written { "written" } else { "read" };
                    format!(
                        "a buffer of its own (it is written, and `{}` is {how})",
                        other.name
                    )
                }
                (false, false) => format!(
                    "a buffer of its own (it is written, and `{}` is read from a view of the \
                     same buffer: wgpu tracks a buffer's use as a whole)",
                    other.name
                ),
            };
            return Err(err_binding(
                kernel,
                w.name,
                expected,
                format!("the buffer also bound to `{}`", other.name),
            ));
        }
    }
    for b in kernel.bindings() {
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
        if a.len < a.min_len {
            return Err(err_binding(
                kernel,
                &b.name,
                match a.rule {
                    Some(rule) => format!("at least {} elements ({rule})", a.min_len),
                    None => format!("at least {} elements", a.min_len),
                },
                format!("{} elements", a.len),
            ));
        }
    }
    Ok(())
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
            [(_, v)] => return Err(err(&p.name, p.ty.wgsl().into(), v.to_string())),
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

impl Drop for Recorder<'_> {
    /// Submitted or not, its buffers are free for host reads and writes again.
    fn drop(&mut self) {
        for t in self.uses.drain(..) {
            t.pending.fetch_sub(1, Ordering::AcqRel);
        }
    }
}
