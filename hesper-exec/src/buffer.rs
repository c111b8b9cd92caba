//! `GpuBuffer<T>`: a typed, length-known storage buffer; upload, readback (through reused
//! staging buffers), fill and device-to-device copy (compute kernels: `copy_buffer_to_buffer`
//! measured 5× slower on the H200).

use std::marker::PhantomData;

use bytemuck::Pod;
use hesper_dsl::prelude::*;
use hesper_dsl::{Scalar, Ty};

use crate::error::ExecError;
use crate::gpu::Gpu;
use crate::launch::{Args, Grid, Recorder};

/// Host types that match a WGSL element type byte for byte, stride included (so no `[f32; 3]`:
/// `array<vec3<f32>>` has a 16-byte stride).
pub trait Element: Pod {
    fn ty() -> Ty;
}

macro_rules! element {
    ($($t:ty => $ty:expr),* $(,)?) => {$(
        impl Element for $t {
            fn ty() -> Ty {
                $ty
            }
        }
    )*};
}
element!(
    f32 => Ty::F32,
    u32 => Ty::U32,
    i32 => Ty::I32,
    [f32; 2] => Ty::Vector(2, Scalar::F32),
    [f32; 4] => Ty::Vector(4, Scalar::F32),
    [u32; 2] => Ty::Vector(2, Scalar::U32),
    [u32; 4] => Ty::Vector(4, Scalar::U32),
    [i32; 4] => Ty::Vector(4, Scalar::I32),
);

/// The host type of a DSL element type: what a `GpuBuffer` bound to an `array<T>` holds
/// (`Vec4<f32>` → `[f32; 4]`). Typed launchers use it, so a buffer of the wrong element type
/// does not compile.
pub trait HostElement {
    type Host: Element;
}

macro_rules! host_element {
    ($($dsl:ty => $host:ty),* $(,)?) => {$(
        impl HostElement for $dsl {
            type Host = $host;
        }
    )*};
}
host_element!(
    f32 => f32,
    u32 => u32,
    i32 => i32,
    Vec2<f32> => [f32; 2],
    Vec4<f32> => [f32; 4],
    Vec2<u32> => [u32; 2],
    Vec4<u32> => [u32; 4],
    Vec4<i32> => [i32; 4],
);

/// A storage buffer of `len` elements of `T` on one [`Gpu`]. Its allocation is padded to a
/// multiple of 16 bytes, so the executor's fill and copy kernels can move it as `vec4<u32>`.
pub struct GpuBuffer<T: Element> {
    raw: wgpu::Buffer,
    len: usize,
    _t: PhantomData<T>,
}

const VEC4: Ty = Ty::Vector(4, Scalar::U32);

impl<T: Element> GpuBuffer<T> {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Bytes of the elements (without padding).
    pub fn bytes(&self) -> u64 {
        (self.len * size_of::<T>()) as u64
    }
    /// The WGSL element type this buffer binds as.
    pub fn elem_ty(&self) -> Ty {
        T::ty()
    }
    pub fn raw(&self) -> &wgpu::Buffer {
        &self.raw
    }
    /// The allocation as `vec4<u32>` words.
    fn vec4s(&self) -> usize {
        (self.raw.size() / 16) as usize
    }

    /// Overwrite the contents from the host; `data` must have exactly `len` elements.
    pub fn write(&self, gpu: &Gpu, data: &[T]) -> Result<(), ExecError> {
        if data.len() != self.len {
            return Err(ExecError::Buffer {
                buffer: self.label(),
                message: format!(
                    "write of {} elements into a buffer of {}",
                    data.len(),
                    self.len
                ),
            });
        }
        if !data.is_empty() {
            gpu.queue
                .write_buffer(&self.raw, 0, bytemuck::cast_slice(data));
        }
        Ok(())
    }

    /// Copy every element back to the host (submits nothing else; waits for the GPU).
    pub fn read(&self, gpu: &Gpu) -> Result<Vec<T>, ExecError> {
        if self.len == 0 {
            return Ok(vec![]);
        }
        let bytes = gpu.read_raw(&self.raw, self.bytes())?;
        Ok(bytemuck::cast_slice(&bytes).to_vec())
    }

    fn label(&self) -> String {
        format!("{} × {}", self.len, T::ty())
    }
}

/// Staging buffers kept for reuse: a few, the largest first to go when over.
const STAGING_KEPT: usize = 4;

impl Gpu {
    fn create_storage<T: Element>(
        &self,
        len: usize,
        label: &str,
    ) -> Result<GpuBuffer<T>, ExecError> {
        let too_big = || ExecError::Buffer {
            buffer: label.into(),
            message: format!(
                "{len} elements of {} bytes do not fit in memory",
                size_of::<T>()
            ),
        };
        let bytes = len.checked_mul(size_of::<T>()).ok_or_else(too_big)? as u64;
        let padded = bytes
            .checked_next_multiple_of(16)
            .ok_or_else(too_big)?
            .max(16);
        let max = self.wgpu_limits().max_storage_buffer_binding_size;
        if padded > max {
            return Err(ExecError::Buffer {
                buffer: label.into(),
                message: format!(
                    "{bytes} bytes is over the device's storage binding limit of {max}"
                ),
            });
        }
        let raw = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: padded,
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_SRC
                | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        Ok(GpuBuffer {
            raw,
            len,
            _t: PhantomData,
        })
    }

    /// A new buffer holding a copy of `data`.
    pub fn upload<T: Element>(&self, data: &[T]) -> Result<GpuBuffer<T>, ExecError> {
        let buf = self.create_storage::<T>(data.len(), "hesper upload")?;
        buf.write(self, data)?;
        Ok(buf)
    }

    /// A new zeroed buffer of `len` elements.
    pub fn zeros<T: Element>(&self, len: usize) -> Result<GpuBuffer<T>, ExecError> {
        self.create_storage(len, "hesper buffer")
    }

    /// A new buffer of `len` copies of `value`, filled on the GPU (use a poison such as NaN for
    /// outputs, so that elements a kernel fails to write show up).
    pub fn filled<T: Element>(&self, len: usize, value: T) -> Result<GpuBuffer<T>, ExecError> {
        let buf = self.create_storage(len, "hesper buffer")?;
        self.fill(&buf, value)?;
        Ok(buf)
    }

    /// Set every element of `buf` to `value` (one launch, submitted now).
    pub fn fill<T: Element>(&self, buf: &GpuBuffer<T>, value: T) -> Result<(), ExecError> {
        let mut rec = self.recorder();
        rec.fill(buf, value)?;
        rec.submit()
    }

    /// Copy `src` into `dst` (same length; one launch, submitted now).
    pub fn copy<T: Element>(
        &self,
        src: &GpuBuffer<T>,
        dst: &GpuBuffer<T>,
    ) -> Result<(), ExecError> {
        let mut rec = self.recorder();
        rec.copy(src, dst)?;
        rec.submit()
    }

    /// Copy `bytes` bytes of `buffer` to the host through a reused staging buffer; waits.
    pub(crate) fn read_raw(&self, buffer: &wgpu::Buffer, bytes: u64) -> Result<Vec<u8>, ExecError> {
        let staging = self.take_staging(bytes);
        let mut enc = self.device.create_command_encoder(&Default::default());
        enc.copy_buffer_to_buffer(buffer, 0, &staging, 0, bytes);
        self.queue.submit([enc.finish()]);
        let (tx, rx) = std::sync::mpsc::channel();
        staging
            .slice(..bytes)
            .map_async(wgpu::MapMode::Read, move |r| {
                let _ = tx.send(r);
            });
        self.wait()?;
        let mapped = rx.recv().map_err(|e| ExecError::Device(e.to_string()))?;
        mapped.map_err(|e| ExecError::Device(format!("mapping a readback buffer failed: {e}")))?;
        let out = {
            let view = staging
                .slice(..bytes)
                .get_mapped_range()
                .map_err(|e| ExecError::Device(format!("mapped range: {e}")))?;
            view.to_vec()
        };
        staging.unmap();
        self.return_staging(staging);
        Ok(out)
    }

    fn take_staging(&self, bytes: u64) -> wgpu::Buffer {
        let mut pool = self.staging.lock().unwrap_or_else(|p| p.into_inner());
        let best = (0..pool.len())
            .filter(|&i| pool[i].size() >= bytes)
            .min_by_key(|&i| pool[i].size());
        if let Some(i) = best {
            return pool.swap_remove(i);
        }
        drop(pool);
        // Round up so that similar sizes share a buffer; never past what one read needs twice.
        let size = bytes
            .next_power_of_two()
            .clamp(64 * 1024, (2 * bytes).max(64 * 1024));
        self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("hesper readback"),
            size: size.min(self.wgpu_limits().max_buffer_size).max(bytes),
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        })
    }

    fn return_staging(&self, buffer: wgpu::Buffer) {
        let mut pool = self.staging.lock().unwrap_or_else(|p| p.into_inner());
        pool.push(buffer);
        if pool.len() > STAGING_KEPT {
            pool.sort_by_key(|b| b.size());
            pool.pop();
        }
    }

    /// How many staging buffers are kept for readbacks (for tests of reuse).
    pub fn staging_buffers(&self) -> usize {
        self.staging.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}

/// The fill kernel: `dst[i] = pattern` over `vec4<u32>` words.
fn fill_kernel(gpu: &Gpu) -> Result<std::sync::Arc<crate::CompiledKernel>, ExecError> {
    let key = KernelKey::new("hesper_fill")
        .workgroup_size(256)
        .features(gpu.kernel_features() & Features::IMMEDIATES);
    gpu.kernel(&key, |k| {
        let dst = k.storage_rw::<Vec4<u32>>("dst");
        let words: Vec<Expr<u32>> = (0..4).map(|w| k.param::<u32>(&format!("w{w}"))).collect();
        let n = k.param::<u32>("n");
        let i = k.global_index();
        let pattern = vec4(&words[0], &words[1], &words[2], &words[3]);
        k.if_(i.lt(&n), |k| k.store(&dst, &i, pattern));
    })
}

/// The copy kernel: `dst[i] = src[i]` over `vec4<u32>` words.
fn copy_kernel(gpu: &Gpu) -> Result<std::sync::Arc<crate::CompiledKernel>, ExecError> {
    let key = KernelKey::new("hesper_copy")
        .workgroup_size(256)
        .features(gpu.kernel_features() & Features::IMMEDIATES);
    gpu.kernel(&key, |k| {
        let src = k.storage::<Vec4<u32>>("src");
        let dst = k.storage_rw::<Vec4<u32>>("dst");
        let n = k.param::<u32>("n");
        let i = k.global_index();
        k.if_(i.lt(&n), |k| k.store(&dst, &i, src.at(&i)));
    })
}

impl Recorder<'_> {
    /// Record a fill of every element of `buf` with `value`.
    pub fn fill<T: Element>(&mut self, buf: &GpuBuffer<T>, value: T) -> Result<(), ExecError> {
        let words: &[u32] = bytemuck::cast_slice(std::slice::from_ref(&value));
        // Element sizes are 4, 8 or 16 bytes: the pattern repeats exactly in a vec4.
        let w = |i: usize| words[i % words.len()];
        let n = buf.vec4s();
        let kernel = fill_kernel(self.gpu())?;
        let args = Args::new()
            .raw("dst", buf.raw(), VEC4, n)
            .param("w0", w(0))
            .param("w1", w(1))
            .param("w2", w(2))
            .param("w3", w(3))
            .param("n", n as u32);
        self.launch(&kernel, &args, Grid::Threads(n as u64))
    }

    /// Record a copy of `src` into `dst`, which must have the same length.
    pub fn copy<T: Element>(
        &mut self,
        src: &GpuBuffer<T>,
        dst: &GpuBuffer<T>,
    ) -> Result<(), ExecError> {
        if src.len() != dst.len() {
            return Err(ExecError::Binding {
                kernel: "hesper_copy".into(),
                binding: "dst".into(),
                expected: format!("{} elements, as src has", src.len()),
                given: format!("{} elements", dst.len()),
            });
        }
        let n = src.vec4s();
        let kernel = copy_kernel(self.gpu())?;
        let args = Args::new()
            .raw("src", src.raw(), VEC4, n)
            .raw("dst", dst.raw(), VEC4, n)
            .param("n", n as u32);
        self.launch(&kernel, &args, Grid::Threads(n as u64))
    }
}
