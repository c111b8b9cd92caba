//! Helpers for the kernels' tests and benchmarks: random data, comparisons, finite differences.

use std::sync::OnceLock;

use hesper_exec::Gpu;

/// One device for a whole test binary (device creation costs ~0.3 s on lavapipe).
pub fn gpu() -> &'static Gpu {
    static GPU: OnceLock<Gpu> = OnceLock::new();
    GPU.get_or_init(|| match Gpu::new() {
        Ok(g) => g,
        Err(e) => panic!("the GPU tests need an adapter: {e}"),
    })
}

/// A second device on the same adapter without subgroups, for the paths of devices that lack
/// them.
pub fn gpu_without_subgroups() -> &'static Gpu {
    static GPU: OnceLock<Gpu> = OnceLock::new();
    GPU.get_or_init(|| {
        let options = hesper_exec::GpuOptions {
            subgroups: false,
            ..Default::default()
        };
        match Gpu::with_options(options) {
            Ok(g) => g,
            Err(e) => panic!("the GPU tests need an adapter: {e}"),
        }
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

/// Largest `|got - want| / (atol + |want|)`; NaN anywhere counts as infinitely wrong.
pub fn max_rel_err(got: &[f32], want: &[f64], atol: f64) -> f64 {
    assert_eq!(got.len(), want.len(), "lengths differ");
    got.iter()
        .zip(want)
        .map(|(g, w)| {
            if g.is_nan() || w.is_nan() {
                f64::INFINITY
            } else {
                (*g as f64 - w).abs() / (atol + w.abs())
            }
        })
        .fold(0.0, f64::max)
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
