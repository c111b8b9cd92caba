//! The testing kit for kernel authors (the library's own tests use it): a shared device,
//! reproducible random inputs, comparisons against an f64 reference, and finite-difference
//! checks of a backward reference.
//!
//! A kernel test in four steps: fresh random inputs ([`Rng`]); outputs poisoned with NaN
//! (`gpu.filled(n, f32::NAN)`), so an element the kernel never writes fails; the kernel against
//! its f64 reference ([`assert_close`], or [`compare`] for the numbers); and, for a backward
//! kernel, its reference against finite differences of the forward ([`check_gradient`]).
//!
//! ```
//! use hesper_kernels::testing::{Rng, assert_close, check_gradient, compare, f64s};
//!
//! // The reference of y = x², and its gradient dy/dx = 2x, checked by finite differences.
//! let x = Rng::new(1).vec(8, 1.0);
//! let grad: Vec<f64> = f64s(&x).iter().map(|v| 2.0 * v).collect();
//! check_gradient("d(x²)/dx", &f64s(&x), &grad, 8, |x| x.iter().map(|v| v * v).sum());
//!
//! // What a kernel returned (here: the reference rounded to f32) against the reference.
//! let want: Vec<f64> = f64s(&x).iter().map(|v| v * v).collect();
//! let got: Vec<f32> = want.iter().map(|v| *v as f32).collect();
//! assert_close("x²", &got, &want, 1e-6, 1e-7);
//! let c = compare(&got, &want, 1e-7);
//! assert!(c.max_rel < 1e-6 && c.max_abs < 1e-6, "{c}");
//! ```

#[cfg(not(target_arch = "wasm32"))]
use std::sync::OnceLock;

use hesper_dsl::Kernel;
#[cfg(not(target_arch = "wasm32"))]
use hesper_exec::{Gpu, GpuOptions};

/// One device for a whole test binary (device creation costs ~0.3 s on lavapipe), with the
/// tensor cores where the adapter offers them ([`GpuOptions::cooperative_matrix`](hesper_exec::GpuOptions::cooperative_matrix)).
/// With `HESPER_WEBGPU_LIMITS=1` it has only what WebGPU guarantees ([`GpuOptions::webgpu_limits`](hesper_exec::GpuOptions::webgpu_limits)),
/// so the library's tests check that every kernel runs in any browser. With
/// `HESPER_INTERPRETER=1` (read by `GpuOptions::default`) it is the DSL's interpreter
/// ([`GpuOptions::interpreter`](hesper_exec::GpuOptions::interpreter)): the tests run with no
/// GPU or Vulkan driver, every launch checked for out-of-bounds accesses and races. Native
/// only: a test in a web page opens its device with `Gpu::new_async().await`.
#[cfg(not(target_arch = "wasm32"))]
pub fn gpu() -> &'static Gpu {
    static GPU: OnceLock<Gpu> = OnceLock::new();
    GPU.get_or_init(|| open(GpuOptions::default()))
}

#[cfg(not(target_arch = "wasm32"))]
fn open(options: GpuOptions) -> Gpu {
    let webgpu_limits = std::env::var("HESPER_WEBGPU_LIMITS").is_ok_and(|v| v == "1");
    let options = GpuOptions {
        webgpu_limits,
        cooperative_matrix: true,
        ..options
    };
    match Gpu::with_options(options) {
        Ok(g) => g,
        Err(e) => panic!("the GPU tests need an adapter: {e}"),
    }
}

/// The DSL's interpreter as a device with tensor cores
/// ([`GpuOptions::interpreter`](hesper_exec::GpuOptions::interpreter) with cooperative
/// matrices): the cooperative-matrix kernels, which lavapipe cannot run, checked in CI.
#[cfg(not(target_arch = "wasm32"))]
pub fn interpreter_with_tensor_cores() -> &'static Gpu {
    static GPU: OnceLock<Gpu> = OnceLock::new();
    GPU.get_or_init(|| {
        let options = GpuOptions {
            interpreter: true,
            cooperative_matrix: true,
            ..GpuOptions::default()
        };
        Gpu::with_options(options).expect("the interpreter needs no adapter")
    })
}

/// A second device on the same adapter without subgroups, for the paths of devices that lack
/// them.
#[cfg(not(target_arch = "wasm32"))]
pub fn gpu_without_subgroups() -> &'static Gpu {
    static GPU: OnceLock<Gpu> = OnceLock::new();
    GPU.get_or_init(|| {
        open(GpuOptions {
            subgroups: false,
            ..Default::default()
        })
    })
}

/// A module's `kernels()` paired with the snapshot names a test gives them, one a kernel in
/// order, each checked to start with its kernel's name (name the rest by the key's shapes, the
/// first line of the WGSL). For `insta::assert_snapshot!(name, kernel.wgsl())`, which must
/// stand in the test file itself.
pub fn named_by_key<'a>(
    kernels: &'a [Kernel],
    names: &'a [&'a str],
) -> impl Iterator<Item = (&'a str, &'a Kernel)> {
    assert_eq!(kernels.len(), names.len(), "one snapshot name per kernel");
    names.iter().zip(kernels).map(|(&name, k)| {
        assert!(name.starts_with(k.name()), "{name} for {}", k.key());
        (name, k)
    })
}

/// xorshift64*: fresh, reproducible inputs per seed.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next_u32(&mut self) -> u32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 32) as u32
    }
    /// Uniform in [-1, 1).
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u32() >> 8) as f32 / (1u32 << 23) as f32 - 1.0
    }
    /// `n` values uniform in [-scale, scale).
    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.next_f32() * scale).collect()
    }
}

/// How far a result is from its reference, over all elements. A NaN or infinity where the
/// reference is finite (an unwritten, poisoned element) counts as infinitely wrong.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Comparison {
    /// Largest `|got − want| / (atol + |want|)`.
    pub max_rel: f64,
    /// Largest `|got − want|`.
    pub max_abs: f64,
    /// Largest `|want|`: `max_abs / scale` is the error relative to the result's size, the
    /// measure for long f32 sums whose error grows with the result, not with each element.
    pub scale: f64,
    /// The element with the largest relative error, and its values.
    pub worst: usize,
    pub worst_got: f32,
    pub worst_want: f64,
}

impl Comparison {
    /// `max_abs` relative to the largest reference value.
    pub fn scaled(&self) -> f64 {
        self.max_abs / self.scale.max(f64::MIN_POSITIVE)
    }
}

impl std::fmt::Display for Comparison {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "max relative error {:.3e}, max absolute {:.3e}; worst element {}: {} where {} is \
             expected",
            self.max_rel, self.max_abs, self.worst, self.worst_got, self.worst_want
        )
    }
}

/// Compare `got` with its f64 reference `want` (equal lengths), `atol` keeping the relative
/// error of values that cancel to near zero finite.
pub fn compare(got: &[f32], want: &[f64], atol: f64) -> Comparison {
    assert_eq!(got.len(), want.len(), "lengths differ");
    let mut c = Comparison {
        max_rel: 0.0,
        max_abs: 0.0,
        scale: 0.0,
        worst: 0,
        worst_got: got.first().copied().unwrap_or(0.0),
        worst_want: want.first().copied().unwrap_or(0.0),
    };
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let abs = if g.is_finite() && w.is_finite() {
            (*g as f64 - w).abs()
        } else if *g as f64 == *w {
            0.0
        } else {
            f64::INFINITY
        };
        let rel = abs / (atol + w.abs());
        c.max_abs = c.max_abs.max(abs);
        c.scale = c.scale.max(w.abs());
        if rel > c.max_rel || i == 0 {
            (c.max_rel, c.worst, c.worst_got, c.worst_want) = (rel, i, *g, *w);
        }
    }
    c
}

/// Where element `(r, c)` of a row-major `[rows, Σ widths]` matrix lies in its block-major
/// layout along the columns (`[y_0 | y_1 | …]`, block `(start, width)` a row-major
/// `[rows, width]` matrix at `rows·start`): `rows·start + r·width + (c − start)`.
pub fn block_major_at(widths: &[usize], rows: usize, (r, c): (usize, usize)) -> usize {
    let mut start = 0;
    for &w in widths {
        if c < start + w {
            return rows * start + r * w + (c - start);
        }
        start += w;
    }
    panic!("column {c} past the blocks {widths:?}")
}

/// The largest of `errors`, infinite where one is NaN (`f64::max` would pass a NaN over).
pub fn worst(errors: impl IntoIterator<Item = f64>) -> f64 {
    errors.into_iter().fold(0.0, |a, e| match e.is_nan() {
        true => f64::INFINITY,
        false => a.max(e),
    })
}

/// Largest `|got - want| / (atol + |want|)`: [`compare`]'s `max_rel`.
pub fn max_rel_err(got: &[f32], want: &[f64], atol: f64) -> f64 {
    compare(got, want, atol).max_rel
}

/// Panic with the worst element unless every `|got − want| ≤ atol + rtol·|want|` (numpy's
/// `allclose`): `rtol` for values of ordinary size, `atol` for those that cancel to near zero.
pub fn assert_close(what: &str, got: &[f32], want: &[f64], rtol: f64, atol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    let mut worst = (0.0f64, 0usize);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let e = if g.is_nan() || w.is_nan() {
            f64::INFINITY
        } else {
            (*g as f64 - w).abs() / (atol + rtol * w.abs())
        };
        if e > worst.0 {
            worst = (e, i);
        }
    }
    let (e, i) = worst;
    assert!(
        e <= 1.0,
        "{what}: element {i} is {} where {} is expected (|error| is {e:.2} × (atol {atol:.0e} + rtol {rtol:.0e}·|expected|))",
        got[i],
        want[i]
    );
}

/// Central finite difference of a scalar function of `x` with respect to `x[i]` (f64, so the
/// step can be small).
pub fn finite_difference(x: &[f64], i: usize, h: f64, f: impl Fn(&[f64]) -> f64) -> f64 {
    let mut xp = x.to_vec();
    let mut xm = x.to_vec();
    xp[i] += h;
    xm[i] -= h;
    (f(&xp) - f(&xm)) / (2.0 * h)
}

/// Check an analytic gradient `grad` of `f` at `x` against finite differences at every index
/// (or at `samples` indices spread over `x` when it is long).
pub fn check_gradient(
    what: &str,
    x: &[f64],
    grad: &[f64],
    samples: usize,
    f: impl Fn(&[f64]) -> f64,
) {
    assert_eq!(x.len(), grad.len(), "{what}: gradient length");
    let step = (x.len() / samples.max(1)).max(1);
    for i in (0..x.len()).step_by(step) {
        let fd = finite_difference(x, i, 1e-6, &f);
        let err = (fd - grad[i]).abs() / (1e-6 + fd.abs().max(grad[i].abs()));
        assert!(
            err < 1e-5,
            "{what}: d/dx[{i}] is {} analytically but {fd} by finite differences",
            grad[i]
        );
    }
}

/// f32 data widened for a reference.
pub fn f64s(x: &[f32]) -> Vec<f64> {
    x.iter().map(|v| *v as f64).collect()
}

/// f32 data widened for a reference, NaN read as 0: a buffer whose unused rows were poisoned
/// (a KV cache past its cached positions), for a reference that never reads them.
pub fn f64s_nan_as_zero(x: &[f32]) -> Vec<f64> {
    x.iter()
        .map(|v| if v.is_nan() { 0.0 } else { *v as f64 })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compare_finds_the_worst_element_and_poison() {
        let want = [1.0, -2.0, 0.0, 4.0];
        let c = compare(&[1.0, -2.5, 0.0, 4.0], &want, 1e-6);
        assert_eq!((c.worst, c.worst_got, c.worst_want), (1, -2.5, -2.0));
        assert!((c.max_abs - 0.5).abs() < 1e-12 && (c.max_rel - 0.25).abs() < 1e-6);
        assert_eq!(c.scale, 4.0);
        assert!((c.scaled() - 0.125).abs() < 1e-12);
        // An unwritten (NaN-poisoned) element is infinitely wrong, wherever it is.
        let c = compare(&[1.0, -2.0, f32::NAN, 4.0], &want, 1e-6);
        assert_eq!((c.worst, c.max_rel), (2, f64::INFINITY));
        assert!(
            c.to_string()
                .contains("worst element 2: NaN where 0 is expected"),
            "{c}"
        );
        assert_eq!(
            compare(&[f32::INFINITY], &[1.0], 0.0).max_abs,
            f64::INFINITY
        );
    }
}
