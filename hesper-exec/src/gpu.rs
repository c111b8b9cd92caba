//! `Gpu`: instance, adapter, device and queue; the features and limits kernels can use; the
//! pipeline cache and its optional persistence.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use hesper_dsl::{CoopMultiply, Features, Limits, Scalar};

use crate::cache::PipelineCache;
use crate::error::ExecError;
#[cfg(not(target_arch = "wasm32"))]
use crate::interpreted;
use crate::pool::{self, AdapterIdentity, DeviceRequest, PooledDevice};
use crate::tune::{TuneCache, TuneFileStatus};

/// The device features hesper asks for when the adapter has them.
const WANTED: wgpu::Features = wgpu::Features::SHADER_F16
    .union(wgpu::Features::SUBGROUP)
    .union(wgpu::Features::TIMESTAMP_QUERY)
    .union(wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES)
    .union(wgpu::Features::TIMESTAMP_QUERY_INSIDE_ENCODERS)
    .union(wgpu::Features::IMMEDIATES)
    .union(wgpu::Features::PIPELINE_CACHE);

/// What to do when no adapter is found.
#[cfg(not(target_arch = "wasm32"))]
const NO_ADAPTER_HINT: &str = "On headless Linux install Mesa's lavapipe (`apt-get install \
    mesa-vulkan-drivers libvulkan1`, or run through scripts/with-gpu) and set \
    WGPU_BACKEND=vulkan. With an NVIDIA driver, the Vulkan loader also needs the glvnd libraries \
    (libglvnd0, libglx0, libegl1); VK_LOADER_DEBUG=error shows why a driver was not loaded";
#[cfg(target_arch = "wasm32")]
const NO_ADAPTER_HINT: &str = "This browser offers no WebGPU adapter: WebGPU is missing or \
    turned off (it needs a recent Chrome, Edge, Safari or Firefox; headless Chromium needs \
    --enable-unsafe-webgpu)";

/// How to open a [`Gpu`].
#[derive(Clone, Debug)]
pub struct GpuOptions {
    /// Backends to try; `None` reads `WGPU_BACKEND` (e.g. `vulkan`), else tries all.
    pub backends: Option<wgpu::Backends>,
    /// Ask for `EXPERIMENTAL_COOPERATIVE_MATRIX` (tensor cores from WGSL) when the adapter has
    /// it, with `SHADER_F16`. Experimental in wgpu (off unless asked for); without it the
    /// kernels that can use tensor cores take their portable paths. The testing kit's devices
    /// (hesper-kernels' `testing::gpu`) ask for it.
    pub cooperative_matrix: bool,
    /// Keep the driver's pipeline cache in this file (where the device has `PIPELINE_CACHE`):
    /// loaded when the `Gpu` opens if it was written for the same adapter, driver and wgpu
    /// version (else ignored with a warning), written by [`Gpu::save_pipeline_cache`].
    pub pipeline_cache_file: Option<PathBuf>,
    /// Measure a kernel's variants (a GEMM's tiles) on this device the first time a shape asks
    /// for one, and keep the fastest ([`Gpu::tuned`]); off, kernels take their deterministic
    /// default. Off by default. Native only (measuring needs timestamp queries and waits).
    pub autotune: bool,
    /// Keep the tuned choices in this file (read when the `Gpu` opens if it was written for the
    /// same adapter and driver, else ignored; a damaged line is ignored alone), written by
    /// [`Gpu::save_tune_cache`].
    pub tune_cache_file: Option<PathBuf>,
    /// Rebuild the kernel on every pipeline-cache hit and check that its WGSL is unchanged, so a
    /// kernel whose text depends on something outside its key is caught. On in debug builds.
    pub verify_cache_hits: bool,
    /// Ask for `SUBGROUP` when the adapter has it (the default). Off, kernels take their paths
    /// for devices without subgroups: how those paths are tested on a device that has them.
    pub subgroups: bool,
    /// Compile every kernel with wgpu's runtime bounds checks, also those whose key says
    /// `assume_in_bounds` (slower): to tell whether a kernel misbehaves because one of its
    /// indices leaves its range. Off by default.
    pub force_bounds_checks: bool,
    /// Ask for at most this many invocations per workgroup (and that workgroup width), as on a
    /// device that allows no more (WebGPU promises 256): how the kernels that size their
    /// workgroups to the device are tested at smaller sizes. `None`: the adapter's. At least 1.
    pub max_invocations_per_workgroup: Option<u32>,
    /// Open the device with only what WebGPU guarantees in every browser: its default limits
    /// (256 invocations per workgroup, 8 storage buffers per stage, 16 KiB of workgroup memory,
    /// 128 MiB bindings) and, of the optional features hesper uses, only timestamps (no
    /// subgroups, f16, immediates or pipeline cache). How the kernels' portable paths are tested
    /// on native; `HESPER_WEBGPU_LIMITS=1` turns it on for the testing kit's devices.
    pub webgpu_limits: bool,
    /// The longest any wait for the GPU may take (a readback, [`Gpu::wait`], a timed submit)
    /// before it returns [`ExecError::Timeout`] naming what it waited for. Five minutes by
    /// default: raise it for long submissions on a software device.
    pub wait_timeout: Duration,
    /// Run every launch on the DSL's interpreter ([`hesper_dsl::interp`]) instead of a device:
    /// no GPU or Vulkan driver needed, and each launch is checked for what a GPU hides (an
    /// out-of-bounds read or write, a race, a read of unwritten workgroup memory, a barrier
    /// reached by part of a workgroup), reported as [`ExecError::Interpreter`] at submit.
    /// Buffers live in host memory (wgpu's noop backend); everything else — buffers, readbacks,
    /// the pipeline cache, the launch checks — is the executor's own, so code that runs on a
    /// GPU runs here unchanged, slowly. A fault leaves every buffer of the submit as it was.
    /// The device reports a desktop GPU's limits (but 1024 workgroups a dispatch row), f16,
    /// subgroups of 32 and (with [`GpuOptions::cooperative_matrix`]) 16×16 f16 cooperative
    /// matrices; no timestamps. `k.debug` values print to stderr. Native only. Off by default,
    /// unless the environment sets `HESPER_INTERPRETER=1` (so any program or test suite runs
    /// on the interpreter without a change).
    pub interpreter: bool,
}

// Not derived: `verify_cache_hits` is on in debug builds (clippy only sees release's `false`).
#[allow(clippy::derivable_impls)]
impl Default for GpuOptions {
    fn default() -> Self {
        GpuOptions {
            backends: None,
            cooperative_matrix: false,
            pipeline_cache_file: None,
            autotune: false,
            tune_cache_file: None,
            verify_cache_hits: cfg!(debug_assertions),
            subgroups: true,
            force_bounds_checks: false,
            max_invocations_per_workgroup: None,
            webgpu_limits: false,
            wait_timeout: Duration::from_secs(300),
            interpreter: std::env::var("HESPER_INTERPRETER").is_ok_and(|v| v == "1"),
        }
    }
}

/// What happened to the pipeline cache file when the `Gpu` opened.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DriverCacheStatus {
    /// No file was asked for, or the device has no `PIPELINE_CACHE`.
    Off,
    /// No file yet: an empty cache, written on save.
    Empty,
    /// The file was loaded.
    Loaded { bytes: usize },
    /// The file was not trusted and an empty cache is used instead; why.
    Ignored(String),
}

/// One GPU (or lavapipe): the device, its queue, what it can do, and its compiled kernels.
///
/// # Threads
/// A `Gpu` is `Send + Sync`: share it between threads by reference (or in an `Arc`). Each
/// thread may build and submit its own [`Recorder`](crate::Recorder)s, upload, read back and
/// compile kernels concurrently; submissions run in the order they reach the queue. A
/// recorder itself belongs to one thread at a time. Several `Gpu`s may be open in one process,
/// on one adapter or several; each buffer and compiled kernel belongs to the `Gpu` that made
/// it, and using it with another is an [`ExecError::WrongGpu`].
///
/// # Devices are recycled
/// Dropping a `Gpu` does not destroy its wgpu device: the next `Gpu` opened with the same
/// adapter, features and limits takes it over (NVIDIA's driver deadlocks when a device is
/// destroyed while other threads use the driver; see the `pool` module). The new `Gpu` has
/// its own id, pipeline cache and staging buffers; buffers of the old one stay refused.
pub struct Gpu {
    id: u64,
    /// The device, queue and callback state, handed back to the pool on drop (`None` only
    /// then); `device` and `queue` below are clones of its handles, for short access.
    pooled: Option<PooledDevice>,
    pub(crate) device: wgpu::Device,
    pub(crate) queue: wgpu::Queue,
    info: wgpu::AdapterInfo,
    /// What the adapter offers, and (below) what this device was opened with.
    adapter_features: wgpu::Features,
    features: wgpu::Features,
    limits: wgpu::Limits,
    pub(crate) options: GpuOptions,
    pub(crate) cache: PipelineCache,
    pub(crate) driver_cache: Option<wgpu::PipelineCache>,
    driver_cache_status: DriverCacheStatus,
    /// Mappable buffers kept for reuse by readbacks.
    pub(crate) staging: Mutex<Vec<wgpu::Buffer>>,
    timestamp_period_ns: f32,
    /// The adapter's cooperative-matrix configurations, when the device was opened with them,
    /// and the kinds of multiply-add among them that WGSL spells (read on every GEMM launch).
    coop_properties: Vec<wgpu::CooperativeMatrixProperties>,
    coop_kinds: Vec<CoopMultiply>,
    /// Tuned kernel variants, and what the tune cache file held.
    pub(crate) tune: TuneCache,
    pub(crate) tune_status: TuneFileStatus,
    /// Held while a recorder's launches are interpreted ([`GpuOptions::interpreter`]).
    #[cfg(not(target_arch = "wasm32"))]
    pub(crate) interpreting: Mutex<()>,
}

impl Gpu {
    /// Open the first high-performance adapter with default [`GpuOptions`].
    #[cfg(not(target_arch = "wasm32"))]
    pub fn new() -> Result<Gpu, ExecError> {
        Gpu::with_options(GpuOptions::default())
    }

    /// Open the first high-performance adapter. The device gets the adapter's full limits (wgpu's
    /// defaults are WebGPU's, far below a real GPU's) and the features hesper uses that it has.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn with_options(options: GpuOptions) -> Result<Gpu, ExecError> {
        // One `Gpu` opens at a time (see the `pool` module).
        let _opening = pool::lock(&pool::OPENING);
        pollster::block_on(Gpu::open(options))
    }

    /// [`Gpu::new`] for code that must also run in a web page, where opening a device is
    /// asynchronous (on native it completes at once).
    pub async fn new_async() -> Result<Gpu, ExecError> {
        Gpu::with_options_async(GpuOptions::default()).await
    }

    /// [`Gpu::with_options`], asynchronously: in a web page it awaits the browser; on native it
    /// opens at once (native adapters answer without waiting).
    pub async fn with_options_async(options: GpuOptions) -> Result<Gpu, ExecError> {
        #[cfg(not(target_arch = "wasm32"))]
        return Gpu::with_options(options);
        // One thread in a page: nothing opens concurrently.
        #[cfg(target_arch = "wasm32")]
        return Gpu::open(options).await;
    }

    async fn open(options: GpuOptions) -> Result<Gpu, ExecError> {
        check_options(&options)?;
        let mut desc = wgpu::InstanceDescriptor::new_without_display_handle_from_env();
        if let Some(b) = options.backends {
            desc.backends = b;
        }
        // The noop backend runs nothing: only the interpreter opens it.
        desc.backends.remove(wgpu::Backends::NOOP);
        #[cfg(not(target_arch = "wasm32"))]
        if options.interpreter {
            desc.backends = wgpu::Backends::NOOP;
            desc.backend_options.noop = interpreted::noop_options();
        }
        let backends = format!("{:?}", desc.backends);
        let instance = pool::instance(desc);
        let adapter = instance
            .request_adapter(&wgpu::RequestAdapterOptions {
                power_preference: wgpu::PowerPreference::HighPerformance,
                ..Default::default()
            })
            .await
            .map_err(|_| ExecError::NoAdapter {
                backends,
                hint: NO_ADAPTER_HINT,
            })?;
        let info = adapter.get_info();
        let mut wanted = WANTED;
        if options.cooperative_matrix {
            wanted |= wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX;
        }
        if !options.subgroups {
            wanted.remove(wgpu::Features::SUBGROUP);
        }
        let adapter_features = adapter.features();
        let mut features = adapter_features & wanted;
        let mut limits = adapter.limits();
        if options.webgpu_limits {
            features &= wgpu::Features::TIMESTAMP_QUERY;
            // wgpu's defaults are WebGPU's guarantees.
            limits = wgpu::Limits::default();
        }
        if let Some(most) = options.max_invocations_per_workgroup {
            let clamp = |limit: &mut u32| *limit = (*limit).min(most);
            clamp(&mut limits.max_compute_invocations_per_workgroup);
            clamp(&mut limits.max_compute_workgroup_size_x);
            clamp(&mut limits.max_compute_workgroup_size_y);
            clamp(&mut limits.max_compute_workgroup_size_z);
        }
        let request = DeviceRequest {
            adapter: AdapterIdentity::of(&info),
            features,
            limits: limits.clone(),
        };
        let pooled = match pool::take(&request) {
            Some(pooled) => pooled,
            None => {
                let experimental_features =
                    if features.contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX) {
                        // SAFETY: asked for explicitly through `GpuOptions::cooperative_matrix`;
                        // wgpu requires this acknowledgement for experimental features.
                        unsafe { wgpu::ExperimentalFeatures::enabled() }
                    } else {
                        wgpu::ExperimentalFeatures::default()
                    };
                let (device, queue) = adapter
                    .request_device(&wgpu::DeviceDescriptor {
                        label: Some("hesper"),
                        required_features: features,
                        required_limits: limits.clone(),
                        experimental_features,
                        ..Default::default()
                    })
                    .await
                    .map_err(|e| ExecError::RequestDevice {
                        adapter: info.name.clone(),
                        message: e.to_string(),
                    })?;
                PooledDevice::new(request, device, queue)
            }
        };
        let timestamp_period_ns = pooled.queue.get_timestamp_period();
        let coop_properties =
            match features.contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX) {
                #[cfg(not(target_arch = "wasm32"))]
                true if options.interpreter => interpreted::coop_properties(),
                true => adapter.cooperative_matrix_properties(),
                false => vec![],
            };
        let mut gpu = Gpu {
            id: NEXT_GPU.fetch_add(1, Ordering::Relaxed),
            device: pooled.device.clone(),
            queue: pooled.queue.clone(),
            pooled: Some(pooled),
            info,
            adapter_features,
            features,
            limits,
            options,
            cache: PipelineCache::default(),
            driver_cache: None,
            driver_cache_status: DriverCacheStatus::Off,
            staging: Mutex::new(vec![]),
            timestamp_period_ns,
            coop_kinds: coop_kinds(&coop_properties),
            coop_properties,
            tune: TuneCache::default(),
            tune_status: TuneFileStatus::Off,
            #[cfg(not(target_arch = "wasm32"))]
            interpreting: Mutex::new(()),
        };
        gpu.open_driver_cache();
        if let Some(path) = gpu.options.tune_cache_file.clone() {
            gpu.tune_status = gpu.tune.load(&path, &gpu.tune_header());
            if let TuneFileStatus::Ignored(why) = &gpu.tune_status {
                log::warn!("tune cache file ignored: {why}");
            }
        }
        Ok(gpu)
    }

    /// This `Gpu`'s number, unique in the process (error messages name it).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Why the device was lost, once it is (wgpu reports a loss during a poll: every wait and
    /// submit polls).
    pub fn lost_reason(&self) -> Option<String> {
        self.state().lost_reason()
    }

    fn state(&self) -> &pool::DeviceState {
        &self.pooled.as_ref().expect("taken only in drop").state
    }

    /// An error if the device is lost, or if wgpu reported an error outside every error scope
    /// (raw use of [`Gpu::device`]) that nobody was told of yet: `what` could not run.
    pub(crate) fn check_alive(&self, what: &dyn Fn() -> String) -> Result<(), ExecError> {
        if let Some(reason) = self.lost_reason() {
            return Err(ExecError::DeviceLost {
                adapter: self.info.name.clone(),
                reason,
                what: what(),
            });
        }
        if let Some(message) = self.state().take_uncaptured() {
            return Err(ExecError::Wgpu {
                what: format!(
                    "{} (an earlier wgpu call outside hesper's error scopes failed)",
                    what()
                ),
                kind: "an error",
                message,
            });
        }
        Ok(())
    }

    /// In a web page: the browser answers error scopes asynchronously, so `f`'s errors come
    /// through the uncaptured-error handler instead, reported by the next check.
    #[cfg(target_arch = "wasm32")]
    pub(crate) fn scoped<T>(
        &self,
        what: &dyn Fn() -> String,
        f: impl FnOnce() -> T,
    ) -> Result<T, ExecError> {
        self.check_alive(what)?;
        Ok(f())
    }

    /// Run `f`, which calls wgpu, inside error scopes: a validation error, an allocation that
    /// failed or an internal error becomes an [`ExecError::Wgpu`] naming `what`, not a panic in
    /// wgpu's default handler. Scopes are per thread, so concurrent calls do not mix errors.
    #[cfg(not(target_arch = "wasm32"))]
    pub(crate) fn scoped<T>(
        &self,
        what: &dyn Fn() -> String,
        f: impl FnOnce() -> T,
    ) -> Result<T, ExecError> {
        self.check_alive(what)?;
        let scopes = [
            wgpu::ErrorFilter::OutOfMemory,
            wgpu::ErrorFilter::Internal,
            wgpu::ErrorFilter::Validation,
        ]
        .map(|filter| self.device.push_error_scope(filter));
        let out = f();
        let mut first = None;
        for scope in scopes.into_iter().rev() {
            let e = pollster::block_on(scope.pop());
            first = first.or(e);
        }
        match first {
            None => Ok(out),
            // An operation on a lost device fails for that reason: say so, not what followed.
            // wgpu reports the loss once the queue is empty, so let it drain (rare path).
            Some(_) if self.poll_lost(true) => self.check_alive(what).map(|()| out),
            Some(e) => Err(ExecError::Wgpu {
                what: what(),
                kind: match e {
                    wgpu::Error::OutOfMemory { .. } => "out of memory",
                    wgpu::Error::Validation { .. } => "a validation error",
                    wgpu::Error::Internal { .. } => "an internal error",
                },
                message: e.to_string(),
            }),
        }
    }

    /// Whether the device is lost, after a poll (which runs wgpu's device-lost callback, once
    /// the queue is empty): without waiting, or waiting for the queue (at most a second).
    pub(crate) fn poll_lost(&self, wait: bool) -> bool {
        let _ = self.device.poll(match wait {
            true => wgpu::PollType::Wait {
                submission_index: None,
                timeout: Some(self.options.wait_timeout.min(Duration::from_secs(1))),
            },
            false => wgpu::PollType::Poll,
        });
        self.lost_reason().is_some()
    }

    /// Wait until `index` (or everything submitted, for `None`) has finished, at most
    /// [`GpuOptions::wait_timeout`].
    #[cfg(not(target_arch = "wasm32"))]
    pub(crate) fn wait_for(
        &self,
        index: Option<wgpu::SubmissionIndex>,
        what: &dyn Fn() -> String,
    ) -> Result<(), ExecError> {
        let waited = self.options.wait_timeout;
        let result = self.device.poll(wgpu::PollType::Wait {
            submission_index: index,
            timeout: Some(waited),
        });
        self.check_alive(what)?;
        match result {
            Ok(_) => Ok(()),
            Err(wgpu::PollError::Timeout) => Err(ExecError::Timeout {
                what: what(),
                waited,
            }),
            Err(e) => Err(ExecError::Device(format!("{}: {e}", what()))),
        }
    }

    /// The adapter's name, backend and driver.
    pub fn adapter_info(&self) -> &wgpu::AdapterInfo {
        &self.info
    }

    /// The most loop iterations one invocation may run here, on a device known to cut them off
    /// silently: Mesa's llvmpipe (lavapipe) ends an invocation's loops after 65 535 iterations in
    /// all, nested loops counted together (BENCHMARKS.md), and the kernel then returns wrong
    /// numbers. `None` where no such limit is known. Kernels whose per-invocation loop counts
    /// grow with a runtime size refuse the sizes past it.
    pub fn max_loop_iterations(&self) -> Option<u64> {
        self.info
            .name
            .to_lowercase()
            .contains("llvmpipe")
            .then_some(65_535)
    }

    /// A one-line description: `llvmpipe (LLVM 15.0.6, 256 bits) (Vulkan, Mesa 22.3.6)`.
    /// A browser names neither: `a BrowserWebGpu adapter`.
    pub fn describe(&self) -> String {
        if self.interprets() {
            return "the DSL's interpreter (on wgpu's noop backend)".into();
        }
        let info = &self.info;
        match (info.name.is_empty(), info.driver_info.is_empty()) {
            (true, true) => format!("a {:?} adapter", info.backend),
            _ => format!("{} ({:?}, {})", info.name, info.backend, info.driver_info),
        }
    }

    /// The wgpu features the device was created with.
    pub fn wgpu_features(&self) -> wgpu::Features {
        self.features
    }

    /// The wgpu features the adapter offers (a superset of [`Gpu::wgpu_features`]).
    pub fn adapter_features(&self) -> wgpu::Features {
        self.adapter_features
    }

    pub fn wgpu_limits(&self) -> &wgpu::Limits {
        &self.limits
    }

    /// Whether launches run on the DSL's interpreter ([`GpuOptions::interpreter`]).
    pub fn interprets(&self) -> bool {
        self.options.interpreter
    }

    /// The raw wgpu device and queue, for work hesper does not wrap.
    pub fn device(&self) -> (&wgpu::Device, &wgpu::Queue) {
        (&self.device, &self.queue)
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
        if !self.coop_multiplies().is_empty() {
            f = f | Features::COOPERATIVE_MATRIX;
        }
        f
    }

    /// The size of every subgroup, when the device has subgroups of one fixed size (NVIDIA: 32,
    /// lavapipe: 8 on x86 hosts): kernels that lay data out by lane need it when they are built.
    pub fn subgroup_size(&self) -> Option<u32> {
        let (min, max) = (self.info.subgroup_min_size, self.info.subgroup_max_size);
        (self.features.contains(wgpu::Features::SUBGROUP) && min == max).then_some(min)
    }

    pub fn supports_f16(&self) -> bool {
        self.features.contains(wgpu::Features::SHADER_F16)
    }

    pub fn supports_timestamps(&self) -> bool {
        self.features.contains(wgpu::Features::TIMESTAMP_QUERY)
    }

    pub fn supports_cooperative_matrix(&self) -> bool {
        self.features
            .contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX)
    }

    /// Whether autotuning is on ([`GpuOptions::autotune`]; never in a web page).
    pub fn autotunes(&self) -> bool {
        self.options.autotune && cfg!(not(target_arch = "wasm32"))
    }

    /// Every cooperative-matrix configuration the adapter reports (`M×N×K`, the element types
    /// of `A`/`B` and of `C`), when this device was opened with the feature
    /// ([`GpuOptions::cooperative_matrix`]); empty otherwise. The H200 reports 16×16×16,
    /// 16×8×16 and 16×8×8 with f16 inputs, accumulated in f16 or f32.
    pub fn cooperative_matrix_properties(&self) -> &[wgpu::CooperativeMatrixProperties] {
        &self.coop_properties
    }

    /// The kinds of cooperative multiply-add a kernel can make here: the configurations of
    /// [`Gpu::cooperative_matrix_properties`] that WGSL spells (square, 8 or 16, of f16 or
    /// f32), sorted. Empty where the device has no tensor cores reachable from WGSL.
    pub fn coop_multiplies(&self) -> &[CoopMultiply] {
        &self.coop_kinds
    }

    /// Nanoseconds per timestamp tick.
    pub fn timestamp_period_ns(&self) -> f32 {
        self.timestamp_period_ns
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

    /// Wait until the GPU has finished all work submitted so far, at most
    /// [`GpuOptions::wait_timeout`].
    #[cfg(not(target_arch = "wasm32"))]
    pub fn wait(&self) -> Result<(), ExecError> {
        self.wait_for(None, &|| "Gpu::wait (all submitted work)".into())
    }

    /// What happened to [`GpuOptions::pipeline_cache_file`] when the device opened.
    pub fn driver_cache_status(&self) -> &DriverCacheStatus {
        &self.driver_cache_status
    }

    /// The header that ties a cache file to this adapter, driver and wgpu version.
    fn driver_cache_header(&self) -> Option<String> {
        let key = wgpu::util::pipeline_cache_key(&self.info)?;
        Some(format!(
            "{CACHE_MAGIC}{key}\n{}\n{}\n{}\n{:?}\nwgpu {}\n",
            self.info.name,
            self.info.driver,
            self.info.driver_info,
            self.info.backend,
            WGPU_VERSION
        ))
    }

    fn open_driver_cache(&mut self) {
        let Some(path) = self.options.pipeline_cache_file.clone() else {
            return;
        };
        let header = match self.driver_cache_header() {
            Some(h) if self.features.contains(wgpu::Features::PIPELINE_CACHE) => h,
            _ => return,
        };
        let (data, status) = match std::fs::read(&path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => (None, DriverCacheStatus::Empty),
            Err(e) => (
                None,
                DriverCacheStatus::Ignored(format!("cannot read {}: {e}", path.display())),
            ),
            Ok(bytes) => match parse_cache_file(&bytes, &header) {
                Ok(data) => (
                    Some(data.to_vec()),
                    DriverCacheStatus::Loaded { bytes: data.len() },
                ),
                Err(why) => (
                    None,
                    DriverCacheStatus::Ignored(format!("{}: {why}", path.display())),
                ),
            },
        };
        // SAFETY: `data` is only ever bytes that `PipelineCache::get_data` produced on an
        // adapter with the same name, driver, driver version, backend and wgpu version (checked
        // by the header) and that are intact (checked by the checksum); `fallback` makes wgpu
        // start empty if the driver still refuses them.
        let created = self.scoped(&|| format!("loading {}", path.display()), || unsafe {
            self.device
                .create_pipeline_cache(&wgpu::PipelineCacheDescriptor {
                    label: Some("hesper"),
                    data: data.as_deref(),
                    fallback: true,
                })
        });
        let (cache, status) = match created {
            Ok(cache) => (Some(cache), status),
            Err(e) => (None, DriverCacheStatus::Ignored(e.to_string())),
        };
        if let DriverCacheStatus::Ignored(why) = &status {
            log::warn!("pipeline cache file ignored: {why}");
        }
        self.driver_cache = cache;
        self.driver_cache_status = status;
    }

    /// Write the driver's pipeline cache to [`GpuOptions::pipeline_cache_file`] (atomically: a
    /// crash mid-write leaves the old file). Does nothing when no file was asked for.
    pub fn save_pipeline_cache(&self) -> Result<(), ExecError> {
        let (Some(path), Some(cache), Some(header)) = (
            self.options.pipeline_cache_file.as_ref(),
            self.driver_cache.as_ref(),
            self.driver_cache_header(),
        ) else {
            return Ok(());
        };
        let Some(data) = cache.get_data() else {
            return Ok(());
        };
        let mut file = header.into_bytes();
        file.extend_from_slice(&(data.len() as u64).to_le_bytes());
        file.extend_from_slice(&fnv1a(&data).to_le_bytes());
        file.extend_from_slice(&data);
        write_atomically(path, &file)
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        if let Some(pooled) = self.pooled.take() {
            pool::give_back(pooled);
        }
    }
}

static NEXT_GPU: AtomicU64 = AtomicU64::new(1);

/// The square configurations of 8 or 16, of f16 or f32, that WGSL spells, sorted.
fn coop_kinds(properties: &[wgpu::CooperativeMatrixProperties]) -> Vec<CoopMultiply> {
    let scalar = |t: wgpu::CooperativeScalarType| match t {
        wgpu::CooperativeScalarType::F16 => Some(Scalar::F16),
        wgpu::CooperativeScalarType::F32 => Some(Scalar::F32),
        _ => None,
    };
    let mut kinds: Vec<CoopMultiply> = properties
        .iter()
        .filter(|p| p.m_size == p.n_size && p.n_size == p.k_size)
        .filter(|p| matches!(p.m_size, 8 | 16))
        .filter_map(|p| {
            Some(CoopMultiply {
                size: p.m_size,
                ab: scalar(p.ab_type)?,
                c: scalar(p.cr_type)?,
            })
        })
        .collect();
    kinds.sort();
    kinds.dedup();
    kinds
}

fn check_options(options: &GpuOptions) -> Result<(), ExecError> {
    if cfg!(target_arch = "wasm32") && options.interpreter {
        return Err(ExecError::Options {
            option: "interpreter",
            expected: "false in a web page (the interpreter reads buffers back blocking)".into(),
            given: "true".into(),
        });
    }
    if let Some(n @ 0) = options.max_invocations_per_workgroup {
        return Err(ExecError::Options {
            option: "max_invocations_per_workgroup",
            expected: "None or at least 1 invocation".into(),
            given: format!("Some({n})"),
        });
    }
    if options.wait_timeout.is_zero() {
        return Err(ExecError::Options {
            option: "wait_timeout",
            expected: "a duration above zero".into(),
            given: "0 s".into(),
        });
    }
    Ok(())
}

/// Write `bytes` to `path` so that a reader sees the old file or the new one, never part of
/// one: through a temporary file of our own beside it (a fresh name, created new, removed if
/// anything fails), renamed over `path`.
pub(crate) fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), ExecError> {
    use std::io::Write;
    static NEXT_TMP: AtomicU64 = AtomicU64::new(0);
    let io = |e: std::io::Error| ExecError::Io {
        path: path.display().to_string(),
        message: e.to_string(),
    };
    let name = path.file_name().ok_or_else(|| ExecError::Io {
        path: path.display().to_string(),
        message: "not a file name".into(),
    })?;
    let mut tmp_name = name.to_os_string();
    tmp_name.push(format!(
        ".{}.{}.hesper-tmp",
        std::process::id(),
        NEXT_TMP.fetch_add(1, Ordering::Relaxed)
    ));
    let tmp = path.with_file_name(tmp_name);
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&tmp)
        .and_then(|mut f| {
            f.write_all(bytes)?;
            f.sync_all()
        })
        .and_then(|()| std::fs::rename(&tmp, path));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(io(e));
    }
    Ok(())
}

const WGPU_VERSION: &str = "30";

const CACHE_MAGIC: &str = "hesper pipeline cache v1\n";

/// The cache data in a file, if its header matches and its checksum holds.
fn parse_cache_file<'a>(bytes: &'a [u8], header: &str) -> Result<&'a [u8], String> {
    if bytes.is_empty() {
        return Err("empty".into());
    }
    if !bytes.starts_with(CACHE_MAGIC.as_bytes()) {
        return Err(match CACHE_MAGIC.as_bytes().starts_with(bytes) {
            true => format!("truncated: {} bytes, within its header", bytes.len()),
            false => "not a hesper pipeline cache file".into(),
        });
    }
    if header.as_bytes().starts_with(bytes) {
        return Err(format!(
            "truncated: {} bytes, within its header",
            bytes.len()
        ));
    }
    let rest = bytes
        .strip_prefix(header.as_bytes())
        .ok_or("written for another adapter, driver or wgpu version")?;
    if rest.len() < 16 {
        return Err("truncated".into());
    }
    let len = u64::from_le_bytes(rest[..8].try_into().expect("8 bytes")) as usize;
    let sum = u64::from_le_bytes(rest[8..16].try_into().expect("8 bytes"));
    let data = &rest[16..];
    if data.len() != len {
        return Err(format!("truncated: {} of {len} bytes", data.len()));
    }
    if fnv1a(data) != sum {
        return Err("checksum mismatch (corrupt)".into());
    }
    Ok(data)
}

/// FNV-1a, 64-bit: enough to notice a corrupt file (not an adversary).
fn fnv1a(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ *b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_file_checks() {
        let header = "hesper pipeline cache v1\nx\n";
        let data = b"driver bytes";
        let mut file = header.as_bytes().to_vec();
        file.extend_from_slice(&(data.len() as u64).to_le_bytes());
        file.extend_from_slice(&fnv1a(data).to_le_bytes());
        file.extend_from_slice(data);
        assert_eq!(parse_cache_file(&file, header), Ok(&data[..]));
        assert!(parse_cache_file(&file, "hesper pipeline cache v1\ny\n").is_err());
        let mut corrupt = file.clone();
        *corrupt.last_mut().unwrap() ^= 1;
        assert!(
            parse_cache_file(&corrupt, header)
                .unwrap_err()
                .contains("checksum")
        );
        assert!(
            parse_cache_file(&file[..file.len() - 1], header)
                .unwrap_err()
                .contains("truncated")
        );
    }
}
