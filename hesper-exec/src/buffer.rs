//! `GpuBuffer<T>`: a typed, length-known storage buffer; upload, readback (through reused
//! staging buffers), fill and device-to-device copy, whole or of a range (compute kernels:
//! `copy_buffer_to_buffer` measured 5× slower on the H200).

use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

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
    half::f16 => Ty::F16,
    [half::f16; 2] => Ty::Vector(2, Scalar::F16),
    [half::f16; 4] => Ty::Vector(4, Scalar::F16),
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
    F16 => half::f16,
    Vec2<F16> => [half::f16; 2],
    Vec4<F16> => [half::f16; 4],
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
///
/// It may also be a view of a range of another buffer ([`GpuBuffer::view`]): one allocation
/// then holds several arrays (the `[W_gate; W_up]` a merged GEMM reads, and each of them for
/// the kernels that read one), each bound, read and written as a buffer of its own.
///
/// It belongs to the `Gpu` that made it: reading, writing or binding it with another is an
/// [`ExecError::WrongGpu`]. Host writes and reads happen when they are called, so while a
/// [`Recorder`] that uses the buffer is not submitted, they would see or overwrite the data
/// before the recorded launches run: they are refused ([`ExecError::InUse`]) until the
/// recorder is submitted or dropped.
pub struct GpuBuffer<T: Element> {
    raw: wgpu::Buffer,
    /// Where the elements start in `raw`, in bytes: 0, or a view's offset (a multiple of the
    /// device's storage-binding alignment).
    offset: u64,
    /// The bytes a binding covers: the elements padded to 16 bytes (within `raw`).
    size: u64,
    len: usize,
    pub(crate) tracking: Arc<BufferTracking>,
    _t: PhantomData<T>,
}

/// Who a buffer belongs to, and how many unsubmitted recorders use it.
pub(crate) struct BufferTracking {
    pub id: u64,
    pub gpu: u64,
    pub pending: AtomicU32,
}

static NEXT_BUFFER: AtomicU64 = AtomicU64::new(1);

impl BufferTracking {
    /// An error unless the buffer belongs to `gpu`.
    pub fn check_gpu(&self, gpu: &Gpu, what: impl FnOnce() -> String) -> Result<(), ExecError> {
        if self.gpu == gpu.id() {
            return Ok(());
        }
        Err(ExecError::WrongGpu {
            what: what(),
            owner: self.gpu,
            used_with: gpu.id(),
        })
    }
    /// An error if an unsubmitted recorder uses the buffer.
    fn check_idle(&self, buffer: String, operation: &str) -> Result<(), ExecError> {
        if self.pending.load(Ordering::Acquire) == 0 {
            return Ok(());
        }
        Err(ExecError::InUse {
            buffer,
            operation: operation.into(),
        })
    }
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
    /// The wgpu buffer the elements are in: for a view, the whole allocation, the elements
    /// from [`GpuBuffer::offset`] on.
    pub fn raw(&self) -> &wgpu::Buffer {
        &self.raw
    }
    /// Where the elements start in [`GpuBuffer::raw`], in bytes (0 unless a view).
    pub fn offset(&self) -> u64 {
        self.offset
    }
    /// The bytes a binding of the buffer covers: its elements, padded to 16 bytes.
    pub(crate) fn binding_size(&self) -> u64 {
        self.size
    }
    /// The elements, padded, as `vec4<u32>` words.
    fn vec4s(&self) -> usize {
        (self.size / 16) as usize
    }

    /// Elements `range` (not empty) of this buffer as a buffer of their own, in the same
    /// allocation: bound to a kernel, read, written, filled or copied, it is those elements and
    /// nothing around them. Views of one buffer share its tracking: while an unsubmitted
    /// recorder uses one, host access to any is refused; one kernel may bind several where no
    /// two overlap and either all are written or none is (wgpu tracks a buffer's use as a
    /// whole).
    ///
    /// The range must start at a byte offset that is a multiple of the device's
    /// `min_storage_buffer_offset_alignment` (256 bytes on most devices and in WebGPU), and end
    /// on a multiple of 16 bytes or at this buffer's end (the executor's fill and copy move
    /// whole 16-byte words: a view ending elsewhere would write its neighbour's first bytes).
    pub fn view(
        &self,
        gpu: &Gpu,
        range: std::ops::Range<usize>,
    ) -> Result<GpuBuffer<T>, ExecError> {
        self.tracking
            .check_gpu(gpu, || format!("buffer `{}` (a view)", self.label()))?;
        let err = |message: String| ExecError::Buffer {
            buffer: self.label(),
            message: format!("a view of elements {range:?}: {message}"),
        };
        if range.start >= range.end || range.end > self.len {
            return Err(err(format!(
                "expected a non-empty range within 0..{}",
                self.len
            )));
        }
        let elem = size_of::<T>() as u64;
        let start = self.offset + range.start as u64 * elem;
        let align = u64::from(gpu.wgpu_limits().min_storage_buffer_offset_alignment);
        if !start.is_multiple_of(align) {
            return Err(err(format!(
                "expected a start at a multiple of the device's storage-binding alignment of \
                 {align} bytes, given byte {start} of the allocation"
            )));
        }
        let bytes = (range.end - range.start) as u64 * elem;
        let size = if range.end == self.len {
            self.offset + self.size - start
        } else if bytes.is_multiple_of(16) {
            bytes
        } else {
            return Err(err(format!(
                "expected an end on a multiple of 16 bytes or at the buffer's end (fills and \
                 copies move 16-byte words), given {bytes} bytes ending at element {}",
                range.end
            )));
        };
        Ok(GpuBuffer {
            raw: self.raw.clone(),
            offset: start,
            size: size.max(16),
            len: range.end - range.start,
            tracking: Arc::clone(&self.tracking),
            _t: PhantomData,
        })
    }

    /// Check that the buffer belongs to `gpu` and no unsubmitted recorder uses it.
    fn check_host_access(&self, gpu: &Gpu, operation: &str) -> Result<(), ExecError> {
        self.tracking
            .check_gpu(gpu, || format!("buffer `{}` ({operation})", self.label()))?;
        self.tracking.check_idle(self.label(), operation)
    }

    /// Overwrite the contents from the host; `data` must have exactly `len` elements. Takes
    /// effect before anything submitted after it.
    pub fn write(&self, gpu: &Gpu, data: &[T]) -> Result<(), ExecError> {
        self.check_host_access(gpu, "a write from the host")?;
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
        if data.is_empty() {
            return Ok(());
        }
        // Copies move whole 4-byte words: an odd number of f16 goes with two bytes of padding
        // (the allocation has room: it is padded to 16 bytes).
        let bytes: &[u8] = bytemuck::cast_slice(data);
        let padded;
        let bytes = match bytes.len() % 4 {
            0 => bytes,
            r => {
                padded = [bytes, &[0u8; 4][r..]].concat();
                &padded
            }
        };
        gpu.scoped(&|| format!("writing buffer `{}`", self.label()), || {
            gpu.queue.write_buffer(&self.raw, self.offset, bytes)
        })
    }

    /// Copy every element back to the host, once everything submitted before has run (waits,
    /// at most [`GpuOptions::wait_timeout`](crate::GpuOptions::wait_timeout)).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn read(&self, gpu: &Gpu) -> Result<Vec<T>, ExecError> {
        self.read_start(gpu)?.wait(gpu)
    }

    /// [`GpuBuffer::read`] for code that must also run in a web page, where a readback is
    /// awaited (on native it waits, as `read` does).
    pub async fn read_async(&self, gpu: &Gpu) -> Result<Vec<T>, ExecError> {
        self.read_start(gpu)?.wait_async(gpu).await
    }

    /// Start a readback without waiting for it: the copy to the host is submitted now, after
    /// everything submitted before, and [`PendingRead::wait`] (or `wait_async`) collects it
    /// later, waiting only for the work submitted up to now. A training loop reads a step's
    /// loss this way while the next step runs: start the read after submitting step `n`,
    /// submit step `n + 1`, then wait for the read.
    pub fn read_start(&self, gpu: &Gpu) -> Result<PendingRead<T>, ExecError> {
        self.check_host_access(gpu, "a read to the host")?;
        let what = self.reading();
        // Whole 4-byte words (an odd number of f16 reads two bytes of padding, dropped).
        let words = self.bytes().next_multiple_of(4);
        let mapping = if self.len == 0 {
            None
        } else {
            Some(gpu.start_readback(&self.raw, self.offset, words, &|| what.clone())?)
        };
        Ok(PendingRead {
            mapping,
            bytes: words,
            len: self.len,
            what,
            _t: PhantomData,
        })
    }

    fn reading(&self) -> String {
        format!("reading buffer `{}` back", self.label())
    }

    /// How error messages name the buffer: its number, length and element type (and, for a
    /// view, where in its allocation it starts).
    pub(crate) fn label(&self) -> String {
        let at = match self.offset {
            0 => String::new(),
            offset => format!(" at byte {offset}"),
        };
        format!("#{}{at} ({} × {})", self.tracking.id, self.len, T::ty())
    }
}

/// A readback started by [`GpuBuffer::read_start`]: its copy is submitted; its values come by
/// [`PendingRead::wait`] (native) or [`PendingRead::wait_async`] (anywhere). Dropped unread, its
/// staging buffer is dropped once the GPU is done with it.
pub struct PendingRead<T: Element> {
    /// `None` for an empty buffer.
    mapping: Option<Mapping>,
    /// Bytes copied (whole words), and the elements among them.
    bytes: u64,
    len: usize,
    what: String,
    _t: PhantomData<T>,
}

impl<T: Element> PendingRead<T> {
    /// The values, once the copy has run (waits for it alone, at most
    /// [`GpuOptions::wait_timeout`](crate::GpuOptions::wait_timeout)).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn wait(self, gpu: &Gpu) -> Result<Vec<T>, ExecError> {
        let Some(mapping) = self.mapping else {
            return Ok(vec![]);
        };
        let what = || self.what.clone();
        let bytes = gpu.finish_readback_blocking(mapping, self.bytes, &what)?;
        Ok(elements(&bytes, self.len))
    }

    /// The values, awaited: in a web page the browser maps the staging buffer from its event
    /// loop; on native this waits, as [`PendingRead::wait`] does.
    pub async fn wait_async(self, gpu: &Gpu) -> Result<Vec<T>, ExecError> {
        #[cfg(not(target_arch = "wasm32"))]
        return self.wait(gpu);
        #[cfg(target_arch = "wasm32")]
        {
            let Some(mapping) = self.mapping else {
                return Ok(vec![]);
            };
            let what = || self.what.clone();
            let result = mapping.mapped.await;
            gpu.check_alive(&what)?;
            let bytes = gpu.finish_readback(mapping.staging, self.bytes, result, &what)?;
            Ok(elements(&bytes, self.len))
        }
    }
}

/// The first `len` elements of read-back bytes (copied: a byte vector need not be aligned for
/// `T`).
fn elements<T: Element>(bytes: &[u8], len: usize) -> Vec<T> {
    bytemuck::pod_collect_to_vec(&bytes[..len * size_of::<T>()])
}

/// A staging buffer whose copy is submitted and whose mapping is asked for.
struct Mapping {
    staging: wgpu::Buffer,
    #[cfg(not(target_arch = "wasm32"))]
    index: wgpu::SubmissionIndex,
    #[cfg(not(target_arch = "wasm32"))]
    mapped: std::sync::mpsc::Receiver<Result<(), wgpu::BufferAsyncError>>,
    #[cfg(target_arch = "wasm32")]
    mapped: web::Mapped,
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
        let what = || format!("allocating {label} of {len} × {}", T::ty());
        let raw = self.scoped(&what, || {
            self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size: padded,
                usage: wgpu::BufferUsages::STORAGE
                    | wgpu::BufferUsages::COPY_SRC
                    | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            })
        })?;
        Ok(GpuBuffer {
            offset: 0,
            size: raw.size(),
            raw,
            len,
            tracking: Arc::new(BufferTracking {
                id: NEXT_BUFFER.fetch_add(1, Ordering::Relaxed),
                gpu: self.id(),
                pending: AtomicU32::new(0),
            }),
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

    /// One new zeroed allocation holding arrays of `lens` elements, each starting at a
    /// multiple of the device's storage-binding alignment (and of 16 bytes): the whole, and a
    /// view of each array ([`GpuBuffer::view`]). Work over many small arrays then takes one
    /// launch over the whole where it took one an array (an optimizer step over every
    /// adapter's tensors).
    ///
    /// The whole holds the bytes between the arrays too, zero unless a kernel writes them: each
    /// view is padded to 16 bytes, as a buffer is, so a kernel binding it as vec4s may write
    /// the tail of its last vec4; nothing bound to a view reaches further.
    pub fn zeros_parts<T: Element>(
        &self,
        lens: &[usize],
    ) -> Result<(GpuBuffer<T>, Vec<GpuBuffer<T>>), ExecError> {
        let elem = size_of::<T>() as u64;
        let align = u64::from(self.wgpu_limits().min_storage_buffer_offset_alignment).max(16);
        let mut starts = Vec::with_capacity(lens.len());
        let mut end = 0u64;
        for &len in lens {
            starts.push(end);
            let bytes = (len as u64)
                .checked_mul(elem)
                .ok_or_else(|| ExecError::Buffer {
                    buffer: "hesper parts".into(),
                    message: format!("{len} elements of {elem} bytes do not fit in memory"),
                })?;
            end += bytes.max(1).next_multiple_of(align);
        }
        let whole = self.create_storage::<T>((end / elem) as usize, "hesper parts")?;
        let parts = lens
            .iter()
            .zip(&starts)
            .map(|(&len, &start)| GpuBuffer {
                raw: whole.raw.clone(),
                offset: start,
                size: (len as u64 * elem).next_multiple_of(16).max(16),
                len,
                tracking: Arc::clone(&whole.tracking),
                _t: PhantomData,
            })
            .collect();
        Ok((whole, parts))
    }

    /// A new buffer of `len` copies of `value`, filled on the GPU (use a poison such as NaN for
    /// outputs, so that elements a kernel fails to write show up).
    pub fn filled<T: Element>(&self, len: usize, value: T) -> Result<GpuBuffer<T>, ExecError> {
        let buf = self.create_storage(len, "hesper buffer")?;
        self.fill(&buf, value)?;
        Ok(buf)
    }

    /// Set every element of `buf` to `value` (one launch, submitted now: refused while an
    /// unsubmitted recorder uses `buf`; [`Recorder::fill`] records it in order instead).
    pub fn fill<T: Element>(&self, buf: &GpuBuffer<T>, value: T) -> Result<(), ExecError> {
        buf.check_host_access(self, "Gpu::fill")?;
        let mut rec = self.recorder();
        rec.fill(buf, value)?;
        rec.submit()
    }

    /// Copy `src` into `dst` (same length; one launch, submitted now: refused while an
    /// unsubmitted recorder uses either; [`Recorder::copy`] records it in order instead).
    pub fn copy<T: Element>(
        &self,
        src: &GpuBuffer<T>,
        dst: &GpuBuffer<T>,
    ) -> Result<(), ExecError> {
        src.check_host_access(self, "Gpu::copy")?;
        dst.check_host_access(self, "Gpu::copy")?;
        let mut rec = self.recorder();
        rec.copy(src, dst)?;
        rec.submit()
    }

    /// Submit the copy of `bytes` bytes of `buffer` from byte `offset` into a reused staging
    /// buffer and ask for its mapping. `what` names the readback in errors.
    fn start_readback(
        &self,
        buffer: &wgpu::Buffer,
        offset: u64,
        bytes: u64,
        what: &dyn Fn() -> String,
    ) -> Result<Mapping, ExecError> {
        let staging = self.take_staging(bytes, what)?;
        #[cfg(not(target_arch = "wasm32"))]
        let (on_mapped, mapped) = {
            let (tx, rx) = std::sync::mpsc::channel();
            let on_mapped = move |r| {
                let _ = tx.send(r);
            };
            (on_mapped, rx)
        };
        #[cfg(target_arch = "wasm32")]
        let (on_mapped, mapped) = {
            let mapped = web::Mapped::default();
            (mapped.callback(), mapped)
        };
        let _index = self.scoped(what, || {
            let mut enc = self.device.create_command_encoder(&Default::default());
            enc.copy_buffer_to_buffer(buffer, offset, &staging, 0, bytes);
            let index = self.queue.submit([enc.finish()]);
            staging
                .slice(..bytes)
                .map_async(wgpu::MapMode::Read, on_mapped);
            index
        })?;
        Ok(Mapping {
            staging,
            #[cfg(not(target_arch = "wasm32"))]
            index: _index,
            mapped,
        })
    }

    /// Copy `bytes` bytes of `buffer` to the host through a reused staging buffer; waits, at
    /// most `wait_timeout`.
    #[cfg(not(target_arch = "wasm32"))]
    pub(crate) fn read_raw(
        &self,
        buffer: &wgpu::Buffer,
        bytes: u64,
        what: &dyn Fn() -> String,
    ) -> Result<Vec<u8>, ExecError> {
        let mapping = self.start_readback(buffer, 0, bytes, what)?;
        self.finish_readback_blocking(mapping, bytes, what)
    }

    /// Wait for a started readback's copy (alone) and mapping, then take its bytes.
    #[cfg(not(target_arch = "wasm32"))]
    fn finish_readback_blocking(
        &self,
        mapping: Mapping,
        bytes: u64,
        what: &dyn Fn() -> String,
    ) -> Result<Vec<u8>, ExecError> {
        // On a timeout or a loss the staging buffer is dropped, not reused: its map is pending.
        self.wait_for(Some(mapping.index), what)?;
        // The wait ran the map's callback (here, or in another thread's poll).
        let mapped = mapping
            .mapped
            .recv_timeout(self.options.wait_timeout)
            .map_err(|_| ExecError::Timeout {
                what: format!("{} (the buffer's mapping)", what()),
                waited: self.options.wait_timeout,
            })?;
        self.finish_readback(mapping.staging, bytes, mapped, what)
    }

    /// The mapped staging buffer's bytes; the buffer goes back to the pool.
    fn finish_readback(
        &self,
        staging: wgpu::Buffer,
        bytes: u64,
        mapped: Result<(), wgpu::BufferAsyncError>,
        what: &dyn Fn() -> String,
    ) -> Result<Vec<u8>, ExecError> {
        mapped.map_err(|e| ExecError::Device(format!("{}: mapping failed: {e}", what())))?;
        let out = {
            let view = staging
                .slice(..bytes)
                .get_mapped_range()
                .map_err(|e| ExecError::Device(format!("{}: mapped range: {e}", what())))?;
            view.to_vec()
        };
        staging.unmap();
        self.return_staging(staging);
        Ok(out)
    }

    fn take_staging(
        &self,
        bytes: u64,
        what: &dyn Fn() -> String,
    ) -> Result<wgpu::Buffer, ExecError> {
        let mut pool = self.staging.lock().unwrap_or_else(|p| p.into_inner());
        let best = (0..pool.len())
            .filter(|&i| pool[i].size() >= bytes)
            .min_by_key(|&i| pool[i].size());
        if let Some(i) = best {
            return Ok(pool.swap_remove(i));
        }
        drop(pool);
        // Round up so that similar sizes share a buffer; never past what one read needs twice.
        let size = bytes
            .next_power_of_two()
            .clamp(64 * 1024, (2 * bytes).max(64 * 1024));
        self.scoped(what, || {
            self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("hesper readback"),
                size: size.min(self.wgpu_limits().max_buffer_size).max(bytes),
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            })
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

/// The executor's kernels' workgroup width: 256, or the device's most if that is less.
fn executor_workgroup(gpu: &Gpu) -> u32 {
    let limits = gpu.wgpu_limits();
    256.min(limits.max_compute_invocations_per_workgroup)
        .min(limits.max_compute_workgroup_size_x)
}

/// The fill kernel: `dst[i] = pattern` over `vec4<u32>` words.
fn fill_kernel(gpu: &Gpu) -> Result<Arc<crate::CompiledKernel>, ExecError> {
    let key = KernelKey::new("hesper_fill")
        .workgroup_size(executor_workgroup(gpu))
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
fn copy_kernel(gpu: &Gpu) -> Result<Arc<crate::CompiledKernel>, ExecError> {
    let key = KernelKey::new("hesper_copy")
        .workgroup_size(executor_workgroup(gpu))
        .features(gpu.kernel_features() & Features::IMMEDIATES);
    gpu.kernel(&key, |k| {
        let src = k.storage::<Vec4<u32>>("src");
        let dst = k.storage_rw::<Vec4<u32>>("dst");
        let n = k.param::<u32>("n");
        let i = k.global_index();
        k.if_(i.lt(&n), |k| k.store(&dst, &i, src.at(&i)));
    })
}

/// The range-copy kernel: `dst[dst_offset + i] = src[src_offset + i]` for `i < n`, over `u32`
/// words, one invocation a word (a `u32` count is within `Grid::Threads`' 2³² invocations). The
/// offsets and count are runtime, so every range shares one pipeline.
fn copy_range_kernel(gpu: &Gpu) -> Result<Arc<crate::CompiledKernel>, ExecError> {
    let key = KernelKey::new("hesper_copy_range")
        .workgroup_size(executor_workgroup(gpu))
        .features(gpu.kernel_features() & Features::IMMEDIATES);
    gpu.kernel(&key, |k| {
        let src = k.storage::<u32>("src");
        let dst = k.storage_rw::<u32>("dst");
        let src_offset = k.param::<u32>("src_offset");
        let dst_offset = k.param::<u32>("dst_offset");
        let n = k.param::<u32>("n");
        let i = k.global_index();
        k.if_(i.lt(&n), |k| {
            k.store(&dst, &(&dst_offset + &i), src.at(&(&src_offset + &i)))
        });
    })
}

/// The `u32` words of elements `start..start + len` of `buf`, checked against its length and
/// the kernel's `u32` indices; `binding` names the buffer in the error.
fn word_range<T: Element>(
    buf: &GpuBuffer<T>,
    start: usize,
    len: usize,
    binding: &str,
) -> Result<(u32, u32), ExecError> {
    let err = |expected: String| ExecError::Binding {
        kernel: "hesper_copy_range".into(),
        binding: binding.into(),
        expected,
        given: format!("{} elements", buf.len()),
    };
    let end = start
        .checked_add(len)
        .filter(|end| *end <= buf.len())
        .ok_or_else(|| err(format!("room for {len} elements from element {start}")))?;
    let words = size_of::<T>() / 4;
    // `end` is within the buffer, whose allocation is at most the device's binding size:
    // these only fail where that passes 16 GiB.
    let word = |x: usize| {
        x.checked_mul(words)
            .and_then(|w| u32::try_from(w).ok())
            .ok_or_else(|| err(format!("a range below 2^32 words (ends at element {end})")))
    };
    word(end)?;
    Ok((word(start)?, word(len)?))
}

impl Recorder<'_> {
    /// Record a fill of every element of `buf` with `value`.
    pub fn fill<T: Element>(&mut self, buf: &GpuBuffer<T>, value: T) -> Result<(), ExecError> {
        // Element sizes are 2, 4, 8 or 16 bytes: the pattern repeats exactly in a vec4.
        let bytes = bytemuck::bytes_of(&value);
        let w = |i: usize| {
            u32::from_le_bytes(std::array::from_fn(|b| bytes[(4 * i + b) % bytes.len()]))
        };
        let n = buf.vec4s();
        let kernel = fill_kernel(self.gpu())?;
        let args = Args::new()
            .raw("dst", buf, VEC4, n)
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
            .raw("src", src, VEC4, n)
            .raw("dst", dst, VEC4, n)
            .param("n", n as u32);
        self.launch(&kernel, &args, Grid::Threads(n as u64))
    }

    /// Record a copy of `len` elements of `src` starting at element `src_start` into `dst` at
    /// `dst_start` (for moving rows between buffers of different shapes, such as one chunk of a
    /// batch). Both ranges must lie inside their buffers, and `src` and `dst` must be different
    /// buffers. `len` 0 records nothing.
    pub fn copy_range<T: Element>(
        &mut self,
        src: &GpuBuffer<T>,
        src_start: usize,
        dst: &GpuBuffer<T>,
        dst_start: usize,
        len: usize,
    ) -> Result<(), ExecError> {
        if src.tracking.id == dst.tracking.id {
            return Err(ExecError::Binding {
                kernel: "hesper_copy_range".into(),
                binding: "dst".into(),
                expected: "a buffer other than src (a storage buffer cannot be bound both read \
                           and read_write in one dispatch, views of it included; copy through a \
                           second buffer)"
                    .into(),
                given: "src's buffer".into(),
            });
        }
        let (src_offset, n) = word_range(src, src_start, len, "src")?;
        let (dst_offset, _) = word_range(dst, dst_start, len, "dst")?;
        if len == 0 {
            return Ok(());
        }
        let kernel = copy_range_kernel(self.gpu())?;
        let args = Args::new()
            .raw("src", src, Ty::U32, 4 * src.vec4s())
            .raw("dst", dst, Ty::U32, 4 * dst.vec4s())
            .param("src_offset", src_offset)
            .param("dst_offset", dst_offset)
            .param("n", n);
        self.launch(&kernel, &args, Grid::Threads(n as u64))
    }
}

/// The browser's side of a readback.
#[cfg(target_arch = "wasm32")]
mod web {
    use std::future::Future;
    use std::pin::Pin;
    use std::sync::{Arc, Mutex};
    use std::task::{Context, Poll, Waker};

    type Slot = Option<Result<(), wgpu::BufferAsyncError>>;

    /// The result of a `map_async`, as a future: the browser calls the callback from its event
    /// loop, which wakes the task awaiting it.
    #[derive(Default)]
    pub(super) struct Mapped {
        state: Arc<Mutex<(Slot, Option<Waker>)>>,
    }

    impl Mapped {
        pub(super) fn callback(
            &self,
        ) -> impl FnOnce(Result<(), wgpu::BufferAsyncError>) + Send + 'static {
            let state = Arc::clone(&self.state);
            move |r| {
                let waker = {
                    let mut s = state.lock().unwrap_or_else(|p| p.into_inner());
                    s.0 = Some(r);
                    s.1.take()
                };
                if let Some(w) = waker {
                    w.wake();
                }
            }
        }
    }

    impl Future for Mapped {
        type Output = Result<(), wgpu::BufferAsyncError>;
        fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
            let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
            match s.0.take() {
                Some(r) => Poll::Ready(r),
                None => {
                    s.1 = Some(cx.waker().clone());
                    Poll::Pending
                }
            }
        }
    }
}
