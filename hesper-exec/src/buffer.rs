//! `GpuBuffer<T>`: a typed, length-known storage buffer.

use std::marker::PhantomData;

use bytemuck::Pod;
use hesper_dsl::{Scalar, Ty};

use crate::error::ExecError;
use crate::gpu::Gpu;

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

/// A storage buffer of `len` elements of `T` on one [`Gpu`].
pub struct GpuBuffer<T: Element> {
    pub(crate) raw: wgpu::Buffer,
    len: usize,
    _t: PhantomData<T>,
}

impl<T: Element> GpuBuffer<T> {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The WGSL element type this buffer binds as.
    pub fn elem_ty(&self) -> Ty {
        T::ty()
    }
    pub fn raw(&self) -> &wgpu::Buffer {
        &self.raw
    }

    /// Overwrite the buffer's contents; `data` must have exactly `len` elements.
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

    /// Copy the whole buffer back to the host (waits for the GPU).
    pub fn read(&self, gpu: &Gpu) -> Result<Vec<T>, ExecError> {
        let bytes = (self.len * size_of::<T>()) as u64;
        if bytes == 0 {
            return Ok(vec![]);
        }
        let staging = gpu.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("hesper readback"),
            size: bytes,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let mut enc = gpu.device.create_command_encoder(&Default::default());
        enc.copy_buffer_to_buffer(&self.raw, 0, &staging, 0, bytes);
        gpu.queue.submit([enc.finish()]);
        let (tx, rx) = std::sync::mpsc::channel();
        staging.map_async(wgpu::MapMode::Read, .., move |r| {
            let _ = tx.send(r);
        });
        gpu.wait()?;
        rx.recv()
            .map_err(|e| ExecError::Device(e.to_string()))?
            .map_err(|e| ExecError::Buffer {
                buffer: self.label(),
                message: format!("map for reading failed: {e}"),
            })?;
        let view = staging
            .get_mapped_range(..)
            .map_err(|e| ExecError::Buffer {
                buffer: self.label(),
                message: format!("mapped range: {e}"),
            })?;
        let out = bytemuck::cast_slice(&view).to_vec();
        drop(view);
        staging.unmap();
        Ok(out)
    }

    fn label(&self) -> String {
        format!("{} × {}", self.len, T::ty())
    }
}

impl Gpu {
    fn create_storage<T: Element>(
        &self,
        len: usize,
        label: &str,
    ) -> Result<GpuBuffer<T>, ExecError> {
        let bytes = (len * size_of::<T>()) as u64;
        let max = self.wgpu_limits().max_storage_buffer_binding_size;
        if bytes > max {
            return Err(ExecError::Buffer {
                buffer: label.into(),
                message: format!(
                    "{bytes} bytes is over the device's storage binding limit of {max}"
                ),
            });
        }
        // wgpu cannot bind an empty buffer: keep at least one element of backing store.
        let raw = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: bytes.max(size_of::<T>() as u64),
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

    /// A new buffer of `len` copies of `value` (use a poison value such as NaN for outputs, so
    /// that elements a kernel fails to write show up).
    pub fn filled<T: Element>(&self, len: usize, value: T) -> Result<GpuBuffer<T>, ExecError> {
        self.upload(&vec![value; len])
    }

    /// A new zeroed buffer of `len` elements.
    pub fn zeros<T: Element>(&self, len: usize) -> Result<GpuBuffer<T>, ExecError> {
        self.create_storage(len, "hesper zeros")
    }
}
