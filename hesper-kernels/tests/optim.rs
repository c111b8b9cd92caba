//! AdamW, the global gradient norm and clipping on the GPU against the f64 reference over
//! several steps, and the reference against closed forms and PyTorch's formulation.

use hesper_exec::{Gpu, GpuBuffer, Recorder};
use hesper_kernels::optim::{self, AdamW, Clip, LoraPlus, Step, reference};
use hesper_kernels::testing::{Rng, assert_close, f64s, gpu};

/// Lengths that are and are not multiples of 4 and of the workgroup (1024 elements).
const LENGTHS: [usize; 5] = [1, 3, 1000, 4099, 70_001];

/// Large enough that weight decay and the Adam step both move θ far past the tolerances.
const OPT: AdamW = AdamW {
    beta1: 0.9,
    beta2: 0.999,
    eps: 1e-8,
    weight_decay: 0.1,
};

/// A varying schedule, so a kernel that caches or bakes `lr` shows.
fn lr(t: u32) -> f32 {
    1e-2 / t as f32
}

/// One trained tensor on the GPU and its f64 twin.
struct Tensor {
    theta: GpuBuffer<f32>,
    m: GpuBuffer<f32>,
    v: GpuBuffer<f32>,
    want: reference::State,
}

/// Random θ, and m, v as after some training (v ≥ 0), so that the clipping scale matters
/// (from m = v = 0, Adam's first step does not depend on the gradient's scale).
fn random_tensor(g: &Gpu, rng: &mut Rng, n: usize) -> Tensor {
    let theta = rng.vec(n, 1.0);
    let m = rng.vec(n, 0.1);
    let v: Vec<f32> = rng.vec(n, 0.1).iter().map(|x| x * x).collect();
    Tensor {
        theta: g.upload(&theta).unwrap(),
        m: g.upload(&m).unwrap(),
        v: g.upload(&v).unwrap(),
        want: reference::State {
            theta: f64s(&theta),
            m: f64s(&m),
            v: f64s(&v),
        },
    }
}

impl Tensor {
    fn step(&mut self, rec: &mut Recorder<'_>, step: &Step<'_>, grad: &GpuBuffer<f32>) {
        optim::execute_adamw(
            rec,
            &OPT,
            step,
            &mut self.theta,
            grad,
            &mut self.m,
            &mut self.v,
        )
        .unwrap();
    }

    /// Errors grow by a few f32 ulps of O(1) values per step: after 5 steps on lavapipe, θ is
    /// within 2e-7 and m within 6e-8 (absolute), v within 3.2e-7 (relative) — a third of these
    /// tolerances or less. `atol` covers θ and m cancelling to near zero; v is a sum of
    /// non-negative terms, so relative error alone bounds it.
    fn check(&self, g: &Gpu, what: &str) {
        let s = &self.want;
        assert_close(
            &format!("{what} theta"),
            &self.theta.read(g).unwrap(),
            &s.theta,
            1e-6,
            1e-6,
        );
        assert_close(
            &format!("{what} m"),
            &self.m.read(g).unwrap(),
            &s.m,
            1e-6,
            1e-7,
        );
        assert_close(
            &format!("{what} v"),
            &self.v.read(g).unwrap(),
            &s.v,
            1e-6,
            0.0,
        );
    }
}

#[test]
fn adamw_matches_reference_over_steps() {
    let g = gpu();
    for (seed, n) in LENGTHS.into_iter().enumerate() {
        let mut rng = Rng::new(seed as u64 + 200);
        let mut tensor = random_tensor(g, &mut rng, n);
        for t in 1..=5 {
            let grad = rng.vec(n, 1.0);
            let grad_buf = g.upload(&grad).unwrap();
            let step = Step {
                lr: lr(t),
                t,
                clip: Clip::None,
            };
            let mut rec = g.recorder();
            tensor.step(&mut rec, &step, &grad_buf);
            rec.submit().unwrap();
            reference::adamw_step(&OPT, lr(t) as f64, t, &f64s(&grad), &mut tensor.want);
            tensor.check(g, &format!("adamw n={n} t={t}"));
        }
    }
}

/// With θ = 0, lr = 1 and no decay, θ after one step is the Adam direction itself, so its
/// relative error shows. All of m, v, g positive (no cancellation): a few ulps per operation,
/// under 1e-6. Bias corrections formed in f32 are off by 1e-5..1e-4 at these steps with
/// β2 = 0.9999 (`1 − β2^t` cancels), which this catches.
#[test]
fn adam_direction_is_precise_at_any_step() {
    let g = gpu();
    let opt = AdamW {
        beta2: 0.9999,
        weight_decay: 0.0,
        ..OPT
    };
    let n = 1000;
    let mut rng = Rng::new(250);
    let positive = |rng: &mut Rng, lo: f32, width: f32| -> Vec<f32> {
        rng.vec(n, 1.0)
            .iter()
            .map(|x| lo + width * x.abs())
            .collect()
    };
    for t in [2, 3, 10, 100, 1000, 100_000] {
        let (m, grad) = (positive(&mut rng, 0.05, 0.1), positive(&mut rng, 0.5, 1.0));
        let v: Vec<f32> = positive(&mut rng, 0.01, 0.1)
            .iter()
            .map(|x| x * x)
            .collect();
        let mut tensor = Tensor {
            theta: g.zeros(n).unwrap(),
            m: g.upload(&m).unwrap(),
            v: g.upload(&v).unwrap(),
            want: reference::State {
                theta: vec![0.0; n],
                m: f64s(&m),
                v: f64s(&v),
            },
        };
        let step = Step {
            lr: 1.0,
            t,
            clip: Clip::None,
        };
        let mut rec = g.recorder();
        let grad_buf = g.upload(&grad).unwrap();
        optim::execute_adamw(
            &mut rec,
            &opt,
            &step,
            &mut tensor.theta,
            &grad_buf,
            &mut tensor.m,
            &mut tensor.v,
        )
        .unwrap();
        rec.submit().unwrap();
        reference::adamw_step(&opt, 1.0, t, &f64s(&grad), &mut tensor.want);
        let got = tensor.theta.read(g).unwrap();
        assert_close(
            &format!("direction t={t}"),
            &got,
            &tensor.want.theta,
            1e-6,
            0.0,
        );
    }
}

/// From m = v = 0 at t = 1, m̂ = g and v̂ = g²: θ moves by lr·(g/(|g| + ε) + λθ).
#[test]
fn reference_first_step_is_sign_descent_with_decoupled_decay() {
    let (theta, grad) = ([0.5, -2.0, 0.0, 1.0], [3.0, -1e-3, 0.25, 0.0]);
    let mut s = reference::State {
        theta: theta.to_vec(),
        m: vec![0.0; 4],
        v: vec![0.0; 4],
    };
    let lr = 0.1;
    reference::adamw_step(&OPT, lr, 1, &grad, &mut s);
    let (b1, b2) = (OPT.beta1, OPT.beta2);
    let (eps, wd) = (OPT.eps, OPT.weight_decay);
    for i in 0..4 {
        let (th, gr) = (theta[i], grad[i]);
        let want = th - lr * (gr / (gr.abs() + eps) + wd * th);
        assert!((s.theta[i] - want).abs() < 1e-12, "theta[{i}]");
        assert!((s.m[i] - (1.0 - b1) * gr).abs() < 1e-15, "m[{i}]");
        assert!((s.v[i] - (1.0 - b2) * gr * gr).abs() < 1e-15, "v[{i}]");
    }
}

/// The reference agrees with `torch.optim.AdamW`'s formulation: decay θ by `1 − lr·λ` first,
/// then `θ −= (lr / (1 − β1^t))·m / (√v / √(1 − β2^t) + ε)`.
#[test]
fn reference_matches_pytorch_formulation() {
    let mut rng = Rng::new(5);
    let n = 50;
    let init = reference::State {
        theta: f64s(&rng.vec(n, 1.0)),
        m: vec![0.0; n],
        v: vec![0.0; n],
    };
    let (mut ours, mut torch) = (init.clone(), init);
    let (b1, b2) = (OPT.beta1, OPT.beta2);
    let (eps, wd) = (OPT.eps, OPT.weight_decay);
    for t in 1..=10u32 {
        let grad = f64s(&rng.vec(n, 1.0));
        let lr = lr(t) as f64;
        reference::adamw_step(&OPT, lr, t, &grad, &mut ours);
        let step_size = lr / (1.0 - b1.powi(t as i32));
        let bc2_sqrt = (1.0 - b2.powi(t as i32)).sqrt();
        for (i, g) in grad.iter().enumerate() {
            torch.theta[i] *= 1.0 - lr * wd;
            torch.m[i] = b1 * torch.m[i] + (1.0 - b1) * g;
            torch.v[i] = b2 * torch.v[i] + (1.0 - b2) * g * g;
            let denom = torch.v[i].sqrt() / bc2_sqrt + eps;
            torch.theta[i] -= step_size * torch.m[i] / denom;
        }
        for (i, (a, b)) in ours.theta.iter().zip(&torch.theta).enumerate() {
            assert!((a - b).abs() < 1e-12, "t={t} theta[{i}]: {a} vs {b}");
        }
    }
}

/// Gradient buffers of these lengths, with their f64 copies. Their padding past the last
/// element is NaN, as a vec4 kernel may leave it.
fn random_grads(g: &Gpu, rng: &mut Rng, lens: &[usize]) -> (Vec<GpuBuffer<f32>>, Vec<Vec<f64>>) {
    lens.iter()
        .map(|&n| {
            let x = rng.vec(n, 1.0);
            let buf = g.filled(n, f32::NAN).unwrap();
            buf.write(g, &x).unwrap();
            (buf, f64s(&x))
        })
        .unzip()
}

/// Run both passes into NaN-poisoned scratch and return the norm.
fn gpu_norm(g: &Gpu, grads: &[GpuBuffer<f32>]) -> f32 {
    let refs: Vec<&GpuBuffer<f32>> = grads.iter().collect();
    let len = optim::grad_norm_partials_len(grads.iter().map(|b| b.len()));
    let mut partials = g.filled(len, f32::NAN).unwrap();
    let mut norm = g.filled(1, f32::NAN).unwrap();
    let mut rec = g.recorder();
    optim::execute_global_grad_norm(&mut rec, &refs, &mut partials, &mut norm).unwrap();
    rec.submit().unwrap();
    norm.read(g).unwrap()[0]
}

/// f32 sums of squares, all terms ≥ 0: the relative error is bounded by the depth of the
/// summation (lanes, grid-stride, two 256-wide trees, pass 2's loop: about 25 additions) times
/// 2⁻²⁴, 1.5e-6, and halved by the square root, so under 1e-6 (measured: 4e-8).
#[test]
fn global_grad_norm_matches_reference() {
    let g = gpu();
    let cases: [&[usize]; 5] = [&[70_001, 1000, 3], &[1], &[300_001, 5, 4099], &[0, 17], &[]];
    for (seed, lens) in cases.into_iter().enumerate() {
        let mut rng = Rng::new(seed as u64 + 300);
        let (bufs, host) = random_grads(g, &mut rng, lens);
        let refs: Vec<&[f64]> = host.iter().map(|h| h.as_slice()).collect();
        let want = reference::global_grad_norm(&refs);
        assert_close(
            &format!("grad norm of {lens:?}"),
            &[gpu_norm(g, &bufs)],
            &[want],
            1e-6,
            0.0,
        );
    }
}

/// Norm and AdamW of three tensors in one recorder per step (the norm never visits the CPU),
/// clipping engaged (max_norm a quarter of the norm) and not (four times it).
#[test]
fn clipping_scales_the_gradient_only_when_the_norm_is_over_max_norm() {
    let g = gpu();
    let lens = [1000, 70_001, 3];
    for (ratio, engaged) in [(0.25, true), (4.0, false)] {
        let mut rng = Rng::new(400 + engaged as u64);
        let mut tensors: Vec<Tensor> = lens
            .iter()
            .map(|&n| random_tensor(g, &mut rng, n))
            .collect();
        let mut partials = g
            .filled(optim::grad_norm_partials_len(lens), f32::NAN)
            .unwrap();
        let mut norm = g.filled(1, f32::NAN).unwrap();
        for t in 1..=3 {
            let (grads, host) = random_grads(g, &mut rng, &lens);
            let host_refs: Vec<&[f64]> = host.iter().map(|h| h.as_slice()).collect();
            let want_norm = reference::global_grad_norm(&host_refs);
            let max_norm = (ratio * want_norm) as f32;
            let coef = reference::clip_coefficient(want_norm, max_norm as f64);
            assert_eq!(coef < 1.0, engaged, "coefficient {coef}");

            let mut rec = g.recorder();
            let refs: Vec<&GpuBuffer<f32>> = grads.iter().collect();
            optim::execute_global_grad_norm(&mut rec, &refs, &mut partials, &mut norm).unwrap();
            let step = Step {
                lr: lr(t),
                t,
                clip: Clip::GlobalNorm {
                    norm: &norm,
                    max_norm,
                },
            };
            for (tensor, grad) in tensors.iter_mut().zip(&grads) {
                tensor.step(&mut rec, &step, grad);
            }
            rec.submit().unwrap();

            let what = format!("engaged={engaged} t={t}");
            assert_close(&what, &norm.read(g).unwrap(), &[want_norm], 1e-6, 0.0);
            for ((tensor, grad), n) in tensors.iter_mut().zip(&host).zip(lens) {
                let clipped: Vec<f64> = grad.iter().map(|x| x * coef).collect();
                reference::adamw_step(&OPT, lr(t) as f64, t, &clipped, &mut tensor.want);
                tensor.check(g, &format!("{what} n={n}"));
            }
        }
    }
}

/// LoRA+: B's learning rate is `ratio` times A's. From m = v = 0 without decay, the first step
/// moves every element by about its learning rate, so B moves 16 times as far as A.
#[test]
fn lora_plus_gives_b_ratio_times_the_learning_rate() {
    let lora_plus = LoraPlus { ratio: 16.0 };
    assert_eq!(lora_plus.learning_rates(1e-4), (1e-4, 1.6e-3));

    let g = gpu();
    let opt = AdamW {
        weight_decay: 0.0,
        ..OPT
    };
    let (lr_a, lr_b) = lora_plus.learning_rates(1e-3);
    let mut rng = Rng::new(500);
    let mut moved = vec![];
    // A is [r, in] and B is [out, r], here with r = 4 and in = out = 300.
    for (n, lr) in [(4 * 300, lr_a), (300 * 4, lr_b)] {
        // Gradients away from 0, where ε would shorten the step.
        let grad: Vec<f32> = rng.vec(n, 1.0).iter().map(|x| x + x.signum()).collect();
        let theta = rng.vec(n, 1.0);
        let mut theta_buf = g.upload(&theta).unwrap();
        let (mut m, mut v) = (g.zeros(n).unwrap(), g.zeros(n).unwrap());
        let step = Step {
            lr,
            t: 1,
            clip: Clip::None,
        };
        let mut rec = g.recorder();
        let grad_buf = g.upload(&grad).unwrap();
        optim::execute_adamw(
            &mut rec,
            &opt,
            &step,
            &mut theta_buf,
            &grad_buf,
            &mut m,
            &mut v,
        )
        .unwrap();
        rec.submit().unwrap();
        let after = theta_buf.read(g).unwrap();
        let delta: Vec<f32> = (0..n)
            .map(|i| (theta[i] - after[i]) * grad[i].signum())
            .collect();
        // Δθ is read off f32 θ of O(1): its rounding, 6e-8, is 6e-5 of lr_A = 1e-3.
        assert_close("|Δθ| = lr", &delta, &vec![lr as f64; n], 1e-4, 0.0);
        moved.push(delta.iter().sum::<f32>() / n as f32);
    }
    assert!((moved[1] / moved[0] - 16.0).abs() < 1e-3, "{moved:?}");
}

/// Every per-step value is a runtime scalar: after the first step compiles AdamW (with and
/// without clipping) and the norm's two passes, later steps with other lr, t and max_norm hit
/// the cache. Its own device, since other tests compile on the shared one meanwhile.
#[test]
fn a_new_step_makes_no_new_pipeline() {
    let g = Gpu::new().unwrap();
    let mut rng = Rng::new(600);
    let mut tensor = random_tensor(&g, &mut rng, 1000);
    let grad = g.upload(&rng.vec(1000, 1.0)).unwrap();
    let mut partials = g.zeros(optim::grad_norm_partials_len([1000])).unwrap();
    let mut norm = g.zeros(1).unwrap();
    let mut misses = vec![];
    for t in 1..=5 {
        let mut rec = g.recorder();
        optim::execute_global_grad_norm(&mut rec, &[&grad], &mut partials, &mut norm).unwrap();
        let clipped = Step {
            lr: lr(t),
            t,
            clip: Clip::GlobalNorm {
                norm: &norm,
                max_norm: t as f32,
            },
        };
        tensor.step(&mut rec, &clipped, &grad);
        let plain = Step {
            lr: 2.0 * lr(t),
            t,
            clip: Clip::None,
        };
        tensor.step(&mut rec, &plain, &grad);
        rec.submit().unwrap();
        misses.push(g.cache_stats().misses);
    }
    assert_eq!(misses[0], 4, "AdamW ×2 and the norm's two passes");
    assert!(misses.iter().all(|m| *m == misses[0]), "{misses:?}");
}

#[test]
fn mismatched_lengths_name_kernel_and_buffer() {
    let g = gpu();
    let (mut theta, a) = (g.zeros::<f32>(10).unwrap(), g.zeros::<f32>(10).unwrap());
    let (mut m, mut short) = (g.zeros::<f32>(10).unwrap(), g.zeros::<f32>(9).unwrap());
    let mut rec = g.recorder();
    let step = Step {
        lr: 1e-3,
        t: 1,
        clip: Clip::None,
    };
    let err = optim::execute_adamw(&mut rec, &OPT, &step, &mut theta, &a, &mut m, &mut short)
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "kernel `adamw`, binding `v`: expected 10 elements (as theta), given 9 elements"
    );

    let mut v = g.zeros::<f32>(10).unwrap();
    let clipped = Step {
        clip: Clip::GlobalNorm {
            norm: &a,
            max_norm: 1.0,
        },
        ..step
    };
    let err =
        optim::execute_adamw(&mut rec, &OPT, &clipped, &mut theta, &a, &mut m, &mut v).unwrap_err();
    assert_eq!(
        err.to_string(),
        "kernel `adamw`, binding `grad_norm`: expected 1 elements (the global gradient norm), \
         given 10 elements"
    );

    let t0 = Step { t: 0, ..step };
    let err =
        optim::execute_adamw(&mut rec, &OPT, &t0, &mut theta, &a, &mut m, &mut v).unwrap_err();
    assert_eq!(
        err.to_string(),
        "kernel `adamw`, runtime scalar `t`: expected a step number ≥ 1, given 0"
    );

    let big = g.zeros::<f32>(5000).unwrap();
    let mut norm = g.zeros::<f32>(1).unwrap();
    let err =
        optim::execute_global_grad_norm(&mut rec, &[&a, &big], &mut short, &mut norm).unwrap_err();
    assert_eq!(
        err.to_string(),
        "kernel `grad_norm_partials`, binding `partials`: expected 6 elements \
         (grad_norm_partials_len of the 2 gradient buffers), given 9 elements"
    );
    let mut partials = g.zeros::<f32>(6).unwrap();
    let err =
        optim::execute_global_grad_norm(&mut rec, &[&a, &big], &mut partials, &mut m).unwrap_err();
    assert_eq!(
        err.to_string(),
        "kernel `grad_norm_finish`, binding `norm`: expected 1 elements (the norm), given 10 elements"
    );
    assert!(rec.is_empty());
}

/// Each kernel's WGSL at a small key (its first line), the snapshot named by the key.
#[test]
fn wgsl_snapshots() {
    let names = [
        "adamw",
        "adamw_clip",
        "grad_norm_partials",
        "grad_norm_finish",
    ];
    let kernels = optim::kernels().unwrap();
    for (name, k) in hesper_kernels::testing::named_by_key(&kernels, &names) {
        insta::assert_snapshot!(name, k.wgsl());
    }
}

/// Hyper-parameters that would break the update are errors, before anything is recorded: a
/// negative `max_norm` (gradient ascent), NaN anywhere, ε = 0 (0/0 at a zero gradient), a
/// negative decay or learning rate.
#[test]
fn hyperparameters_that_break_the_update_are_errors() {
    let g = gpu();
    let z = || g.zeros::<f32>(8).unwrap();
    let (mut theta, grad, mut m, mut v, norm) = (z(), z(), z(), g.zeros::<f32>(8).unwrap(), {
        g.upload(&[1.0f32]).unwrap()
    });
    let step = Step {
        lr: 1e-3,
        t: 1,
        clip: Clip::None,
    };
    let clip = |max_norm: f32| Step {
        clip: Clip::GlobalNorm {
            norm: &norm,
            max_norm,
        },
        ..step
    };
    let cases: Vec<(AdamW, Step<'_>, &str)> = vec![
        (
            OPT,
            clip(-1.0),
            "`max_norm`: expected a finite number above 0, given -1",
        ),
        (
            OPT,
            clip(f32::NAN),
            "`max_norm`: expected a finite number above 0, given NaN",
        ),
        (
            OPT,
            Step {
                lr: f32::NAN,
                ..step
            },
            "`lr`: expected a finite number at least 0, given NaN",
        ),
        (
            OPT,
            Step { lr: -1e-3, ..step },
            "`lr`: expected a finite number at least 0",
        ),
        (
            AdamW { eps: 0.0, ..OPT },
            step,
            "`eps`: expected a finite number above 0, given 0",
        ),
        (
            AdamW {
                weight_decay: -0.1,
                ..OPT
            },
            step,
            "`weight_decay`: expected a finite number at least 0",
        ),
        (
            AdamW {
                beta2: f64::NAN,
                ..OPT
            },
            step,
            "`beta2`: expected a value in [0, 1), given NaN",
        ),
    ];
    let mut rec = g.recorder();
    for (opt, step, want) in cases {
        let err = optim::execute_adamw(&mut rec, &opt, &step, &mut theta, &grad, &mut m, &mut v)
            .unwrap_err()
            .to_string();
        assert!(err.contains(want), "{err}\n  wanted: {want}");
    }
    assert!(rec.is_empty(), "nothing recorded on an error");
}

/// A clipped step whose gradient norm is NaN or infinite leaves θ, m and v as they were (the
/// trainer's guard against a bad batch); the same step with a finite norm moves them.
#[test]
fn a_step_with_a_non_finite_norm_is_skipped() {
    let g = gpu();
    let mut rng = Rng::new(31);
    let n = 1000;
    let (theta0, m0, grad) = (rng.vec(n, 1.0), rng.vec(n, 0.1), rng.vec(n, 1.0));
    let v0: Vec<f32> = rng.vec(n, 0.1).iter().map(|x| x * x).collect();
    for (norm, moves) in [(f32::NAN, false), (f32::INFINITY, false), (3.0, true)] {
        let (mut theta, mut m, mut v) = (
            g.upload(&theta0).unwrap(),
            g.upload(&m0).unwrap(),
            g.upload(&v0).unwrap(),
        );
        let (gb, nb) = (g.upload(&grad).unwrap(), g.upload(&[norm]).unwrap());
        let step = Step {
            lr: 1e-2,
            t: 3,
            clip: Clip::GlobalNorm {
                norm: &nb,
                max_norm: 1.0,
            },
        };
        let mut rec = g.recorder();
        optim::execute_adamw(&mut rec, &OPT, &step, &mut theta, &gb, &mut m, &mut v).unwrap();
        rec.submit().unwrap();
        let unchanged = theta.read(g).unwrap() == theta0
            && m.read(g).unwrap() == m0
            && v.read(g).unwrap() == v0;
        assert_eq!(unchanged, !moves, "norm {norm}: moved = {}", !unchanged);
    }
}
