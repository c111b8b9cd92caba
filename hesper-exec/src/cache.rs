//! `PipelineCache`: every kernel is built, validated and compiled once per `KernelKey`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::time::Instant;

use hesper_dsl::{Kernel, KernelBuilder, KernelKey};

use crate::error::ExecError;
use crate::gpu::Gpu;

/// A kernel compiled for one device: its IR and WGSL, the pipeline, and its bind group layout.
/// It belongs to the [`Gpu`] that compiled it (launching it on another is an error).
pub struct CompiledKernel {
    /// Shared with the launches an interpreting recorder keeps until it submits.
    pub(crate) kernel: Arc<Kernel>,
    gpu: u64,
    pub(crate) pipeline: wgpu::ComputePipeline,
    pub(crate) layout: wgpu::BindGroupLayout,
    compile_time: Duration,
}

impl CompiledKernel {
    pub fn kernel(&self) -> &Kernel {
        &self.kernel
    }
    pub fn name(&self) -> &str {
        self.kernel.name()
    }
    /// Time to build the IR, emit and validate WGSL, and create the pipeline.
    pub fn compile_time(&self) -> Duration {
        self.compile_time
    }
    /// The id of the [`Gpu`] it was compiled for.
    pub fn gpu(&self) -> u64 {
        self.gpu
    }
}

impl std::fmt::Debug for CompiledKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompiledKernel")
            .field("key", &self.kernel.key().to_string())
            .field("gpu", &self.gpu)
            .field("compile_time", &self.compile_time)
            .finish_non_exhaustive()
    }
}

/// Which code built a kernel: the place that called [`Gpu::kernel`] and the type of the builder
/// it passed. Two builders under one key are told apart by it, so they never share a pipeline
/// (a user kernel named like one of the executor's, two `#[kernel]`s of one name in two
/// modules). [`Gpu::compile`]'s kernels, already built, are told apart by their WGSL instead.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Origin {
    Builder {
        file: &'static str,
        line: u32,
        column: u32,
        builder: &'static str,
    },
    Built,
}

/// What the cache has done so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    pub hits: u64,
    pub misses: u64,
    /// Total time spent building and compiling on misses.
    pub compile_time: Duration,
}

/// For each key, its compiled kernels and the origins that asked for each (one pipeline per
/// distinct WGSL, shared by every origin whose builder emits that text).
type CacheMap = HashMap<KernelKey, Vec<(Origin, Arc<CompiledKernel>)>>;

/// Compiled kernels by key and origin. Lookups take a lock for a hash-map probe; compiles
/// happen outside it.
#[derive(Default)]
pub struct PipelineCache {
    map: Mutex<CacheMap>,
    hits: AtomicU64,
    misses: AtomicU64,
    compile_nanos: AtomicU64,
}

impl PipelineCache {
    pub fn stats(&self) -> CacheStats {
        CacheStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            compile_time: Duration::from_nanos(self.compile_nanos.load(Ordering::Relaxed)),
        }
    }

    /// How many kernels are compiled.
    pub fn len(&self) -> usize {
        let map = self.lock();
        let mut pipelines: Vec<*const CompiledKernel> = map
            .values()
            .flatten()
            .map(|(_, c)| Arc::as_ptr(c))
            .collect();
        pipelines.sort();
        pipelines.dedup();
        pipelines.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, CacheMap> {
        // A panic while holding the lock cannot leave the map half-updated (inserts are single
        // calls), so a poisoned lock is still sound to use.
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Gpu {
    /// The compiled kernel for `key`: from the cache, or built with `build` and compiled once.
    ///
    /// The cache tells builders apart by where `kernel` is called from and by the builder's type,
    /// so two different kernels under one key each get their own pipeline. `build` must read
    /// every compile-time value from the key (`KernelBuilder::shape`), so that one key and one
    /// builder always mean one WGSL text: a builder whose text depends on a value it captures
    /// would reuse the pipeline of the first value. When [`GpuOptions::verify_cache_hits`] is
    /// on (the default in debug builds) every hit rebuilds the kernel and checks that, and a
    /// mismatch is an error; it is off in release builds because a rebuild costs 0.2–5 ms.
    ///
    /// [`GpuOptions::verify_cache_hits`]: crate::GpuOptions::verify_cache_hits
    #[track_caller]
    pub fn kernel<F: FnOnce(&mut KernelBuilder)>(
        &self,
        key: &KernelKey,
        build: F,
    ) -> Result<Arc<CompiledKernel>, ExecError> {
        let at = std::panic::Location::caller();
        let origin = Origin::Builder {
            file: at.file(),
            line: at.line(),
            column: at.column(),
            builder: std::any::type_name::<F>(),
        };
        let cache = &self.cache;
        let cached = cache
            .lock()
            .get(key)
            .and_then(|v| v.iter().find(|(o, _)| *o == origin).map(|(_, c)| c.clone()));
        if let Some(compiled) = cached {
            cache.hits.fetch_add(1, Ordering::Relaxed);
            if self.options.verify_cache_hits {
                let again = Kernel::build_with_limits(key, &self.kernel_limits(), build)?;
                if again.wgsl() != compiled.kernel.wgsl() {
                    return Err(ExecError::KeyMismatch {
                        kernel: key.name().into(),
                        key: key.to_string(),
                    });
                }
            }
            return Ok(compiled);
        }
        let start = Instant::now();
        let kernel = Kernel::build_with_limits(key, &self.kernel_limits(), build)?;
        self.compile_and_insert(kernel, origin, start)
    }

    /// The cached kernel of `kernel`'s key and WGSL, now also known under `origin`.
    fn same_text(&self, kernel: &Kernel, origin: &Origin) -> Option<Arc<CompiledKernel>> {
        let mut map = self.cache.lock();
        let entries = map.get_mut(kernel.key())?;
        let c = entries
            .iter()
            .find(|(_, c)| c.kernel.wgsl() == kernel.wgsl())
            .map(|(_, c)| c.clone())?;
        if !entries.iter().any(|(o, _)| o == origin) {
            entries.push((origin.clone(), c.clone()));
        }
        Some(c)
    }

    /// Compile an already built kernel (through the cache: the same key and WGSL is a hit).
    pub fn compile(&self, kernel: &Kernel) -> Result<Arc<CompiledKernel>, ExecError> {
        if let Some(c) = self.same_text(kernel, &Origin::Built) {
            self.cache.hits.fetch_add(1, Ordering::Relaxed);
            return Ok(c);
        }
        let start = Instant::now();
        kernel.check_limits(&self.kernel_limits())?;
        self.compile_and_insert(kernel.clone(), Origin::Built, start)
    }

    fn compile_and_insert(
        &self,
        kernel: Kernel,
        origin: Origin,
        start: Instant,
    ) -> Result<Arc<CompiledKernel>, ExecError> {
        // Another origin with the same text (the same builder called from two places, or
        // another thread that compiled it meanwhile): share its pipeline.
        if let Some(c) = self.same_text(&kernel, &origin) {
            self.cache.hits.fetch_add(1, Ordering::Relaxed);
            return Ok(c);
        }
        let (pipeline, layout) = self.create_pipeline(&kernel)?;
        let compile_time = start.elapsed();
        let cache = &self.cache;
        cache.misses.fetch_add(1, Ordering::Relaxed);
        cache
            .compile_nanos
            .fetch_add(compile_time.as_nanos() as u64, Ordering::Relaxed);
        let key = kernel.key().clone();
        let compiled = Arc::new(CompiledKernel {
            kernel: Arc::new(kernel),
            gpu: self.id(),
            pipeline,
            layout,
            compile_time,
        });
        let mut map = cache.lock();
        let entries = map.entry(key).or_default();
        // Another thread may have compiled the same kernel meanwhile: keep the first.
        if let Some((_, first)) = entries
            .iter()
            .find(|(_, c)| c.kernel.wgsl() == compiled.kernel.wgsl())
        {
            let first = first.clone();
            entries.push((origin, first.clone()));
            return Ok(first);
        }
        entries.push((origin, compiled.clone()));
        Ok(compiled)
    }

    /// Hits, misses and compile time of this device's pipeline cache.
    pub fn cache_stats(&self) -> CacheStats {
        self.cache.stats()
    }

    /// Check the kernel's needs against the device and create its pipeline.
    fn create_pipeline(
        &self,
        kernel: &Kernel,
    ) -> Result<(wgpu::ComputePipeline, wgpu::BindGroupLayout), ExecError> {
        let has = |f| self.wgpu_features().contains(f);
        let missing = |feature, f: wgpu::Features| ExecError::MissingFeature {
            kernel: kernel.name().into(),
            feature,
            why: match self.adapter_features().contains(f) {
                true => "this Gpu was opened without (GpuOptions)".into(),
                false => format!("`{}` does not have", self.adapter_info().name),
            },
        };
        if kernel.uses_subgroups() && !has(wgpu::Features::SUBGROUP) {
            return Err(missing("SUBGROUP", wgpu::Features::SUBGROUP));
        }
        if kernel.uses_cooperative_matrix() {
            let coop = wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX;
            if !has(coop) {
                return Err(missing("EXPERIMENTAL_COOPERATIVE_MATRIX", coop));
            }
            let offered = self.coop_multiplies();
            if let Some(kind) = kernel
                .coop_multiplies()
                .iter()
                .find(|kind| !offered.contains(kind))
            {
                let offered: Vec<String> = offered.iter().map(|k| k.to_string()).collect();
                return Err(ExecError::CoopUnsupported {
                    kernel: kernel.name().into(),
                    kind: kind.to_string(),
                    adapter: self.adapter_info().name.clone(),
                    offered: match offered.is_empty() {
                        true => "none".into(),
                        false => offered.join(", "),
                    },
                });
            }
        }
        if kernel.uses_f16() && !has(wgpu::Features::SHADER_F16) {
            return Err(missing("SHADER_F16", wgpu::Features::SHADER_F16));
        }
        if kernel.params_as_immediates()
            && !kernel.params().is_empty()
            && !has(wgpu::Features::IMMEDIATES)
        {
            return Err(missing("IMMEDIATES", wgpu::Features::IMMEDIATES));
        }
        let most = crate::launch::max_uniform_params(self);
        if kernel.params_binding().is_some() && kernel.params_size() > most {
            return Err(ExecError::Pipeline {
                kernel: kernel.name().into(),
                message: format!(
                    "its {} runtime scalars take {} bytes of uniform buffer; at most {most} bytes \
                     ({} scalars) fit in one uniform binding",
                    kernel.params().len(),
                    kernel.params_size(),
                    most / 4
                ),
            });
        }
        let buffer_entry = |binding, ty| wgpu::BindGroupLayoutEntry {
            binding,
            visibility: wgpu::ShaderStages::COMPUTE,
            ty: wgpu::BindingType::Buffer {
                ty,
                has_dynamic_offset: false,
                min_binding_size: None,
            },
            count: None,
        };
        let mut entries: Vec<_> = kernel
            .bindings()
            .iter()
            .map(|b| {
                let read_only = b.access == hesper_dsl::Access::Read;
                buffer_entry(b.binding, wgpu::BufferBindingType::Storage { read_only })
            })
            .collect();
        if let Some(binding) = kernel.params_binding() {
            entries.push(buffer_entry(binding, wgpu::BufferBindingType::Uniform));
        }
        let what = || format!("kernel `{}`: creating its pipeline", kernel.name());
        let (layout, pipeline) =
            self.scoped(&what, || self.create_layout_and_pipeline(kernel, &entries))?;
        Ok((pipeline, layout))
    }

    fn create_layout_and_pipeline(
        &self,
        kernel: &Kernel,
        entries: &[wgpu::BindGroupLayoutEntry],
    ) -> (wgpu::BindGroupLayout, wgpu::ComputePipeline) {
        let layout = self
            .device
            .create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
                label: Some(kernel.name()),
                entries,
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
        let source = wgpu::ShaderModuleDescriptor {
            label: Some(kernel.name()),
            source: wgpu::ShaderSource::Wgsl(kernel.wgsl().into()),
        };
        let module = match runtime_checks(kernel, self.options.force_bounds_checks) {
            // SAFETY: the kernel's author vouches that its indices stay in range
            // (`KernelKey::assume_in_bounds`); only bounds checks are dropped, so every loop
            // stays bounded, and buffer accesses stay bounded where the driver does it itself.
            Some(checks) => unsafe { self.device.create_shader_module_trusted(source, checks) },
            None => self.device.create_shader_module(source),
        };
        let pipeline = self
            .device
            .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(kernel.name()),
                layout: Some(&pipeline_layout),
                module: &module,
                entry_point: Some("main"),
                compilation_options: Default::default(),
                cache: self.driver_cache.as_ref(),
            });
        (layout, pipeline)
    }
}

/// The runtime checks to compile `kernel` with, when they differ from wgpu's defaults: bounds
/// checks off for a kernel whose key assumes its indices in bounds, unless `force_bounds_checks`.
fn runtime_checks(kernel: &Kernel, force_bounds_checks: bool) -> Option<wgpu::ShaderRuntimeChecks> {
    (kernel.assumes_in_bounds() && !force_bounds_checks).then(|| wgpu::ShaderRuntimeChecks {
        bounds_checks: false,
        ..wgpu::ShaderRuntimeChecks::checked()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn build(key: KernelKey) -> Kernel {
        Kernel::build(&key, |k| {
            let out = k.storage_rw::<f32>("out");
            k.store(&out, 0u32, 1.0f32);
        })
        .unwrap()
    }

    #[test]
    fn only_kernels_assuming_in_bounds_drop_bounds_checks() {
        let checked = build(KernelKey::new("plain"));
        let trusted = build(KernelKey::new("trusted").assume_in_bounds());
        assert!(runtime_checks(&checked, false).is_none());
        assert!(runtime_checks(&checked, true).is_none());
        assert!(runtime_checks(&trusted, true).is_none());
        let checks = runtime_checks(&trusted, false).unwrap();
        assert!(!checks.bounds_checks);
        assert!(checks.force_loop_bounding, "loops stay bounded");
        assert!(
            trusted
                .wgsl()
                .lines()
                .next()
                .unwrap()
                .ends_with(" assume_in_bounds")
        );
    }
}
