//! Cross-entropy on the GPU against the f64 reference, and the reference's gradient against
//! finite differences of its loss.

use std::sync::OnceLock;

use hesper_exec::{ExecError, Gpu, GpuBuffer, GpuOptions};
use hesper_kernels::loss::{self, IGNORE_INDEX, LossOutputs, reference};
use hesper_kernels::testing::{
    Rng, assert_close, check_gradient, f64s, gpu, gpu_without_subgroups,
};

/// `(T, V)`: vocabularies below and far past the row kernel's 1024 invocations (on lavapipe and
/// the H200; 256 in the test that asks for them); multiples of 4 go as vec4s, the others as
/// floats. 40 000 and 20 001 run past whole unrolled strides (8 × 1024 elements) and end in a
/// ragged one, 32 768 fills one exactly. 1500 tokens make the count and mean kernels stride over
/// more tokens than invocations.
const SHAPES: [(usize, usize); 13] = [
    (1, 7),
    (5, 7),
    (33, 7),
    (1, 1000),
    (5, 1000),
    (33, 1000),
    (1, 5003),
    (5, 5003),
    (33, 5003),
    (1500, 7),
    (3, 40_000),
    (2, 32_768),
    (2, 20_001),
];

/// Relative tolerance of every comparison: the kernels' `exp` and `log` are accurate to a few
/// f32 ulps each for these arguments (|z − max| ≤ 8), and the sums add O(log V) roundings.
const RTOL: f64 = 1e-5;
/// Absolute tolerance of a token's loss and of the mean: a well-predicted token's loss cancels
/// towards 0 and keeps `log`'s absolute error (~1e-7).
const LOSS_ATOL: f64 = 1e-6;

/// Absolute tolerance of `dz`: at the target `p − 1` cancels while `p` carries up to ~1e-6·p of
/// absolute error, and the row is scaled by `1/N`.
fn dz_atol(n: usize) -> f64 {
    1e-6 / n.max(1) as f64
}

/// Labels uniform over the vocabulary, one in four masked: by [`IGNORE_INDEX`], or — one in
/// twelve — by a label just outside `0..V`, which the kernels mask as well.
fn labels(rng: &mut Rng, t: usize, v: usize) -> Vec<i32> {
    (0..t)
        .map(|_| match rng.next_u32() % 12 {
            0 | 1 => IGNORE_INDEX,
            2 => [-1, v as i32][rng.next_u32() as usize % 2],
            _ => (rng.next_u32() as usize % v) as i32,
        })
        .collect()
}

/// The outputs, poisoned: a kernel that leaves any element unwritten fails the comparison.
struct Outputs {
    d_logits: GpuBuffer<f32>,
    token_loss: GpuBuffer<f32>,
    loss: GpuBuffer<f32>,
    count: GpuBuffer<u32>,
}

impl Outputs {
    fn poisoned(g: &Gpu, t: usize, v: usize) -> Self {
        Outputs {
            d_logits: g.filled(t * v, f32::NAN).unwrap(),
            token_loss: g.filled(t, f32::NAN).unwrap(),
            loss: g.filled(1, f32::NAN).unwrap(),
            count: g.filled(1, u32::MAX).unwrap(),
        }
    }
    fn loss_outputs(&mut self) -> LossOutputs<'_> {
        LossOutputs {
            token_loss: &mut self.token_loss,
            loss: &mut self.loss,
            count: &mut self.count,
        }
    }
}

/// Run the fused kernel (or the forward only) on the GPU.
fn run(g: &Gpu, logits: &[f32], labels: &[i32], v: usize, with_grad: bool) -> Outputs {
    let (zb, yb) = (g.upload(logits).unwrap(), g.upload(labels).unwrap());
    let mut out = Outputs::poisoned(g, labels.len(), v);
    let Outputs {
        d_logits,
        token_loss,
        loss,
        count,
    } = &mut out;
    let losses = LossOutputs {
        token_loss,
        loss,
        count,
    };
    let mut rec = g.recorder();
    if with_grad {
        loss::execute_cross_entropy(&mut rec, &zb, &yb, v, d_logits, losses).unwrap();
    } else {
        loss::execute_cross_entropy_forward(&mut rec, &zb, &yb, v, losses).unwrap();
    }
    rec.submit().unwrap();
    out
}

/// Compare the losses and `N` (and `dz`, `with_grad`) with the reference; masked rows must be
/// exactly 0.
fn check(what: &str, logits: &[f32], labels: &[i32], v: usize, with_grad: bool) {
    check_on(gpu(), what, logits, labels, v, with_grad)
}

fn check_on(g: &Gpu, what: &str, logits: &[f32], labels: &[i32], v: usize, with_grad: bool) {
    let out = run(g, logits, labels, v, with_grad);
    let z = f64s(logits);
    let (want_token, want_loss, n) = reference::cross_entropy_forward(&z, labels, v);
    assert_eq!(out.count.read(g).unwrap(), [n as u32], "{what}: N");
    let token_loss = out.token_loss.read(g).unwrap();
    assert_close(
        &format!("{what} token_loss"),
        &token_loss,
        &want_token,
        RTOL,
        LOSS_ATOL,
    );
    assert_close(
        &format!("{what} loss"),
        &out.loss.read(g).unwrap(),
        &[want_loss],
        RTOL,
        LOSS_ATOL,
    );
    let masked: Vec<usize> = (0..labels.len())
        .filter(|&t| !reference::is_target(labels[t], v))
        .collect();
    for &t in &masked {
        assert_eq!(token_loss[t], 0.0, "{what}: masked token {t}'s loss");
    }
    if !with_grad {
        return;
    }
    let d_logits = out.d_logits.read(g).unwrap();
    let want_d = reference::cross_entropy_backward(&z, labels, v);
    assert_close(
        &format!("{what} d_logits"),
        &d_logits,
        &want_d,
        RTOL,
        dz_atol(n),
    );
    for &t in &masked {
        assert!(
            d_logits[t * v..(t + 1) * v].iter().all(|d| *d == 0.0),
            "{what}: masked row {t} of d_logits is not 0"
        );
    }
}

#[test]
fn cross_entropy_matches_reference() {
    for (seed, (t, v)) in SHAPES.into_iter().enumerate() {
        let mut rng = Rng::new(seed as u64);
        let (logits, labels) = (rng.vec(t * v, 4.0), labels(&mut rng, t, v));
        check(
            &format!("cross_entropy T={t} V={v}"),
            &logits,
            &labels,
            v,
            true,
        );
    }
}

#[test]
fn cross_entropy_forward_matches_reference() {
    for (seed, (t, v)) in SHAPES.into_iter().enumerate() {
        let mut rng = Rng::new(seed as u64 + 100);
        let (logits, labels) = (rng.vec(t * v, 4.0), labels(&mut rng, t, v));
        let what = format!("cross_entropy_forward T={t} V={v}");
        check(&what, &logits, &labels, v, false);
    }
}

/// The row reductions through workgroup memory alone, as on a device without subgroups.
#[test]
fn cross_entropy_without_subgroups_matches_reference() {
    for (seed, (t, v)) in [(5, 1000), (3, 40_000), (2, 20_001)]
        .into_iter()
        .enumerate()
    {
        let mut rng = Rng::new(seed as u64 + 200);
        let (logits, labels) = (rng.vec(t * v, 4.0), labels(&mut rng, t, v));
        let what = format!("cross_entropy without subgroups T={t} V={v}");
        check_on(gpu_without_subgroups(), &what, &logits, &labels, v, true);
    }
}

/// On a device that allows only 256 invocations a workgroup, every kernel here takes 256: the
/// row kernel's strides, the count and mean kernels' token loops, with and without the gradient.
#[test]
fn cross_entropy_with_256_invocations_matches_reference() {
    static SMALL: OnceLock<Gpu> = OnceLock::new();
    let g = SMALL.get_or_init(|| {
        Gpu::with_options(GpuOptions {
            max_invocations_per_workgroup: Some(256),
            ..Default::default()
        })
        .unwrap()
    });
    let shapes = [(5, 1000), (3, 40_000), (2, 20_001), (300, 7)];
    for (seed, (t, v)) in shapes.into_iter().enumerate() {
        let mut rng = Rng::new(seed as u64 + 300);
        let (logits, labels) = (rng.vec(t * v, 4.0), labels(&mut rng, t, v));
        for with_grad in [true, false] {
            let what = format!("256 invocations T={t} V={v} gradient {with_grad}");
            check_on(g, &what, &logits, &labels, v, with_grad);
        }
    }
}

/// Logits around 1000, where an `exp` without the maximum subtracted overflows f32.
#[test]
fn large_logits_subtract_the_row_maximum() {
    let (t, v) = (9, 3001);
    let mut rng = Rng::new(11);
    let logits: Vec<f32> = rng.vec(t * v, 4.0).iter().map(|z| z + 1000.0).collect();
    let labels = labels(&mut rng, t, v);
    check("large logits", &logits, &labels, v, true);
    check("large logits forward", &logits, &labels, v, false);
}

/// More tokens than one dispatch row of workgroups (lavapipe's 65 535; the interpreter's 1024):
/// one workgroup per token needs the 2-D dispatch.
#[test]
fn more_tokens_than_one_dispatch_row() {
    let t = gpu().wgpu_limits().max_compute_workgroups_per_dimension as usize + 5;
    let v = 3;
    let mut rng = Rng::new(12);
    let (logits, labels) = (rng.vec(t * v, 4.0), labels(&mut rng, t, v));
    check(&format!("T={t}"), &logits, &labels, v, true);
}

/// `N = 0` is defined, not NaN: the loss and `N` are 0, every token loss and all of `dz` are 0.
#[test]
fn all_masked_gives_zero_loss_and_gradient() {
    let g = gpu();
    let (t, v) = (5, 1000);
    let logits = Rng::new(13).vec(t * v, 4.0);
    let labels = [IGNORE_INDEX, -1, 1000, IGNORE_INDEX, i32::MAX];
    for with_grad in [true, false] {
        let out = run(gpu(), &logits, &labels, v, with_grad);
        assert_eq!(out.count.read(g).unwrap(), [0]);
        assert_eq!(out.loss.read(g).unwrap(), [0.0]);
        assert_eq!(out.token_loss.read(g).unwrap(), [0.0; 5]);
        if with_grad {
            assert!(out.d_logits.read(g).unwrap().iter().all(|d| *d == 0.0));
        }
    }
}

/// No tokens at all: the loss and `N` are still written (0).
#[test]
fn no_tokens_gives_zero_loss() {
    let g = gpu();
    let v = 7;
    for with_grad in [true, false] {
        let out = run(gpu(), &[], &[], v, with_grad);
        assert_eq!(out.count.read(g).unwrap(), [0]);
        assert_eq!(out.loss.read(g).unwrap(), [0.0]);
    }
}

/// The backward reference is the gradient of the forward reference's mean loss; masked rows
/// (including a label past the vocabulary) get 0 from both.
#[test]
fn backward_reference_matches_finite_differences() {
    let (t, v) = (6, 9);
    let mut rng = Rng::new(14);
    let z = f64s(&rng.vec(t * v, 3.0));
    let labels = [3, IGNORE_INDEX, 0, 8, 9, 5];
    let d = reference::cross_entropy_backward(&z, &labels, v);
    check_gradient("cross_entropy d_logits", &z, &d, t * v, |z| {
        reference::cross_entropy_forward(z, &labels, v).1
    });
    assert!(
        d[v..2 * v]
            .iter()
            .chain(&d[4 * v..5 * v])
            .all(|d| *d == 0.0)
    );
}

#[test]
fn mismatched_lengths_name_kernel_and_buffer() {
    let g = gpu();
    let (t, v) = (5, 10);
    let logits = g.zeros::<f32>(t * v).unwrap();
    let labels = g.zeros::<i32>(t).unwrap();
    let mut d_short = g.zeros::<f32>(t * v - 1).unwrap();
    let mut out = Outputs::poisoned(gpu(), t, v);
    let mut rec = g.recorder();

    let err = loss::execute_cross_entropy(
        &mut rec,
        &logits,
        &labels,
        v,
        &mut d_short,
        out.loss_outputs(),
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "kernel `cross_entropy`, binding `d_logits`: expected 50 elements (as logits), given 49 elements"
    );
    let err =
        loss::execute_cross_entropy_forward(&mut rec, &logits, &labels, v + 1, out.loss_outputs())
            .unwrap_err();
    assert_eq!(
        err.to_string(),
        "kernel `cross_entropy_forward`, binding `logits`: expected 55 elements (labels × vocab), given 50 elements"
    );
    let mut short_losses = Outputs::poisoned(gpu(), t - 1, v);
    let err = loss::execute_cross_entropy_forward(
        &mut rec,
        &logits,
        &labels,
        v,
        short_losses.loss_outputs(),
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "kernel `cross_entropy_forward`, binding `token_loss`: expected 5 elements (one per label), given 4 elements"
    );
    let mut two_counts = g.zeros::<u32>(2).unwrap();
    let err = loss::execute_cross_entropy_forward(
        &mut rec,
        &logits,
        &labels,
        v,
        LossOutputs {
            count: &mut two_counts,
            ..out.loss_outputs()
        },
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "kernel `cross_entropy_count`, binding `count`: expected 1 elements (N), given 2 elements"
    );
    let err =
        loss::execute_cross_entropy_forward(&mut rec, &logits, &labels, 0, out.loss_outputs())
            .unwrap_err();
    assert!(matches!(err, ExecError::Dispatch { .. }), "{err}");
    assert!(err.to_string().contains("vocab = 0"), "{err}");
    assert!(rec.is_empty());
}

/// The lm-head chunked over tokens: `N` counted once over the whole batch, the rows of three
/// uneven chunks (masked labels in two, the middle one all masked) each divided by that one
/// `N`, their token losses gathered into one `[T]` buffer, and the mean over it. The same
/// `d_logits`, token losses, mean and `N` as the reference over the whole batch — and, bit for
/// bit, as the fused launch over it.
#[test]
fn chunks_with_one_global_count_match_the_whole_batch() {
    let g = gpu();
    let chunks = [5, 3, 9];
    let t: usize = chunks.iter().sum();
    for (seed, v) in [(0, 1000), (1, 5003)] {
        let mut rng = Rng::new(seed + 400);
        let logits = rng.vec(t * v, 4.0);
        let mut labels: Vec<i32> = (0..t)
            .map(|_| (rng.next_u32() as usize % v) as i32)
            .collect();
        labels[1] = IGNORE_INDEX;
        labels[5..8].fill(IGNORE_INDEX);
        labels[12] = IGNORE_INDEX;
        labels[15] = v as i32;

        let all_labels = g.upload(&labels).unwrap();
        let mut count = g.filled(1, u32::MAX).unwrap();
        let token_loss = g.filled(t, f32::NAN).unwrap();
        let mut mean = g.filled(1, f32::NAN).unwrap();
        let mut rec = g.recorder();
        loss::execute_cross_entropy_count(&mut rec, &all_labels, v, &mut count).unwrap();
        let mut outs = vec![];
        let mut start = 0;
        for c in chunks {
            let z = g.upload(&logits[start * v..(start + c) * v]).unwrap();
            let y = g.upload(&labels[start..start + c]).unwrap();
            let mut d = g.filled(c * v, f32::NAN).unwrap();
            let mut tl = g.filled(c, f32::NAN).unwrap();
            loss::execute_cross_entropy_rows(&mut rec, &z, &y, v, &count, &mut d, &mut tl).unwrap();
            rec.copy_range(&tl, 0, &token_loss, start, c).unwrap();
            outs.push((start, c, d, tl, z, y));
            start += c;
        }
        loss::execute_cross_entropy_mean(&mut rec, &token_loss, &count, &mut mean).unwrap();
        rec.submit().unwrap();

        let what = format!("chunks {chunks:?} V={v}");
        let z = f64s(&logits);
        let (want_token, want_loss, n) = reference::cross_entropy_forward(&z, &labels, v);
        let want_d = reference::cross_entropy_backward(&z, &labels, v);
        assert_eq!(n, t - 6, "labels 1, 5..8, 12 and 15 are masked");
        assert_eq!(count.read(g).unwrap(), [n as u32], "{what}: N");
        let fused = run(g, &logits, &labels, v, true);
        let fused_d = fused.d_logits.read(g).unwrap();
        let fused_token = fused.token_loss.read(g).unwrap();
        for (start, c, d, tl, _, _) in &outs {
            let (d, tl) = (d.read(g).unwrap(), tl.read(g).unwrap());
            let rows = start * v..(start + c) * v;
            let what = format!("{what}, chunk at {start}");
            assert_close(
                &format!("{what} d_logits"),
                &d,
                &want_d[rows.clone()],
                RTOL,
                dz_atol(n),
            );
            let tokens = *start..start + c;
            assert_close(
                &format!("{what} token_loss"),
                &tl,
                &want_token[tokens.clone()],
                RTOL,
                LOSS_ATOL,
            );
            assert_eq!(bits(&d), bits(&fused_d[rows]), "{what}: d_logits vs fused");
            assert_eq!(
                bits(&tl),
                bits(&fused_token[tokens]),
                "{what}: token_loss vs fused"
            );
        }
        let (_, _, middle, middle_loss, _, _) = &outs[1];
        assert!(
            middle.read(g).unwrap().iter().all(|d| *d == 0.0),
            "{what}: masked chunk"
        );
        assert_eq!(
            middle_loss.read(g).unwrap(),
            [0.0; 3],
            "{what}: masked chunk"
        );
        let token_loss = token_loss.read(g).unwrap();
        assert_close(
            &format!("{what} token_loss"),
            &token_loss,
            &want_token,
            RTOL,
            LOSS_ATOL,
        );
        let mean = mean.read(g).unwrap();
        assert_close(
            &format!("{what} loss"),
            &mean,
            &[want_loss],
            RTOL,
            LOSS_ATOL,
        );
        assert_eq!(
            bits(&mean),
            bits(&fused.loss.read(g).unwrap()),
            "{what}: mean vs fused"
        );
    }
}

/// `cross_entropy_stats`: each row's `(lse, 1/N)` against the f64 reference (`(0, 0)` exactly on
/// masked rows) and the same token losses as the row kernel, into poisoned buffers.
#[test]
fn stats_match_reference() {
    let g = gpu();
    for (seed, (t, v)) in SHAPES.into_iter().enumerate() {
        let mut rng = Rng::new(seed as u64 + 500);
        let (logits, labels) = (rng.vec(t * v, 4.0), labels(&mut rng, t, v));
        let (z, y) = (g.upload(&logits).unwrap(), g.upload(&labels).unwrap());
        let mut count = g.filled(1, u32::MAX).unwrap();
        let mut stats = g.filled(t * loss::STATS_PER_TOKEN, f32::NAN).unwrap();
        let mut token_loss = g.filled(t, f32::NAN).unwrap();
        let mut rec = g.recorder();
        loss::execute_cross_entropy_count(&mut rec, &y, v, &mut count).unwrap();
        loss::execute_cross_entropy_stats(&mut rec, &z, &y, v, &count, &mut stats, &mut token_loss)
            .unwrap();
        rec.submit().unwrap();

        let what = format!("cross_entropy_stats T={t} V={v}");
        let z = f64s(&logits);
        let (want_token, _, n) = reference::cross_entropy_forward(&z, &labels, v);
        let want_stats: Vec<f64> = (0..t)
            .flat_map(|r| match reference::is_target(labels[r], v) {
                true => [
                    want_token[r] + z[r * v + labels[r] as usize],
                    1.0 / n as f64,
                ],
                false => [0.0, 0.0],
            })
            .collect();
        let (stats, token_loss) = (stats.read(g).unwrap(), token_loss.read(g).unwrap());
        assert_close(
            &format!("{what} stats"),
            &stats,
            &want_stats,
            RTOL,
            LOSS_ATOL,
        );
        assert_close(
            &format!("{what} token_loss"),
            &token_loss,
            &want_token,
            RTOL,
            LOSS_ATOL,
        );
        for r in (0..t).filter(|&r| !reference::is_target(labels[r], v)) {
            assert_eq!(
                stats[2 * r..2 * r + 2],
                [0.0, 0.0],
                "{what}: masked row {r}"
            );
        }
    }
}

/// `dn = dz·E` with `dz` computed from the logits as the GEMM reads them
/// (`loss::CrossEntropyGrad` as a prologue), against the f64 product of the reference's `dz`:
/// on the test device (lavapipe: the f32 GEMM, whole and ragged vocabularies; a device with
/// tensor cores splits the depth in two at the standard tile for f32 logits) and on the DSL's
/// interpreter's tensor cores (CI: lavapipe has none), where the depth is split into four parts
/// (each part's prologue sees its own columns: the one-hot lands in one of them) and `dz` is
/// multiplied by `2^e` and rounded to f16 as it is staged, as in the step. Labels masked in both
/// ways, `E` f16-exact. The tolerance is the rounding's: `dz` to f16 (2⁻¹¹ relative, or 2⁻²⁵
/// absolute where subnormal, before `2^e`) on the tensor cores, f32's elsewhere.
#[test]
fn the_gradient_as_a_gemm_prologue_matches_reference() {
    use hesper_exec::half::f16;
    use hesper_kernels::linear::coop::CoopTile;
    use hesper_kernels::linear::fusion::Fusion;
    use hesper_kernels::linear::split::{
        execute_gemm_split_fused, gemm_split_scratch_len, split_plan,
    };
    use hesper_kernels::linear::{Gemm, Precision, Product, Weights};
    let interpreter = hesper_kernels::testing::interpreter_with_tensor_cores();
    let small = CoopTile {
        bm: 32,
        bn: 32,
        bk: 32,
        wm: 32,
        wn: 32,
    };
    // (device, tokens, vocab, dim, tile, parts the interpreter splits the depth into)
    type Case<'a> = (&'a Gpu, usize, usize, usize, Option<CoopTile>, usize);
    let cases: [Case; 4] = [
        (gpu(), 40, 4096, 48, None, 0),
        (gpu(), 7, 1001, 24, None, 0),
        // On a device with tensor cores, split in two at the standard tile for f32 logits,
        // `WIDE_12` where it fits (its 48-deep step cuts 3072, not 4096, into two parts of 32
        // steps): the step's lm-head backward at its tile. Too slow for the interpreter in CI.
        (gpu(), 40, 3072, 48, None, 0),
        (interpreter, 40, 4096, 48, Some(small), 4),
    ];
    for (i, (g, t, v, d, tile, parts)) in cases.into_iter().enumerate() {
        let mut rng = Rng::new(600 + i as u64);
        let logits = rng.vec(t * v, 4.0);
        let labels = labels(&mut rng, t, v);
        let e: Vec<f32> = rng
            .vec(v * d, 1.0)
            .iter()
            .map(|x| f16::from_f32(*x).to_f32())
            .collect();
        let n = labels
            .iter()
            .filter(|&&y| reference::is_target(y, v))
            .count();
        let exponent = n.max(1).ilog2() as i32;
        let gemm = Gemm {
            coop_tile: tile,
            ..Gemm::new(Product::Nn, (t, v, d), false)
                .with_precision(Precision::F16)
                .with_input_exponent(exponent)
        };
        let scratch_len = gemm_split_scratch_len(g, &gemm);
        let tensor_cores = hesper_kernels::linear::coop::subgroup_size(g).is_some();
        if tile.is_some() {
            assert_eq!(
                scratch_len,
                parts * t * d,
                "the interpreter splits the depth"
            );
        }
        let plan = split_plan(g, &gemm, false);
        if tensor_cores && v == 3072 {
            let plan = plan.expect("the tensor cores split 40 × 48 over 3072");
            assert_eq!(plan.parts, 2, "{plan:?}");
        }
        let (z, y, w) = (
            g.upload(&logits).unwrap(),
            g.upload(&labels).unwrap(),
            g.upload(&e).unwrap(),
        );
        let mut count = g.filled(1, u32::MAX).unwrap();
        let mut stats = g.filled(t * loss::STATS_PER_TOKEN, f32::NAN).unwrap();
        let mut token_loss = g.filled(t, f32::NAN).unwrap();
        let mut dn = g.filled(t * d, f32::NAN).unwrap();
        let mut scratch = g.filled(scratch_len.max(1), f32::NAN).unwrap();
        let mut rec = g.recorder();
        loss::execute_cross_entropy_count(&mut rec, &y, v, &mut count).unwrap();
        loss::execute_cross_entropy_stats(&mut rec, &z, &y, v, &count, &mut stats, &mut token_loss)
            .unwrap();
        let grad = loss::CrossEntropyGrad {
            stats: &stats,
            labels: &y,
        };
        let fusion = Fusion {
            prologue: Some(&grad),
            epilogues: &[],
        };
        let weights = Weights::Dense(&w);
        execute_gemm_split_fused(&mut rec, &gemm, &fusion, &z, weights, &mut dn, &mut scratch)
            .unwrap();
        rec.submit().unwrap();

        let dz = reference::cross_entropy_backward(&f64s(&logits), &labels, v);
        let (mut want, mut tol) = (vec![0f64; t * d], vec![0f64; t * d]);
        let unscale = 2f64.powi(-exponent);
        for r in 0..t {
            for c in 0..d {
                let (mut sum, mut bound, mut weight) = (0.0, 0.0, 0.0);
                for k in 0..v {
                    let (a, b) = (dz[r * v + k], e[k * d + c] as f64);
                    sum += a * b;
                    bound += (a * b).abs();
                    weight += b.abs();
                }
                want[r * d + c] = sum;
                tol[r * d + c] = match tensor_cores {
                    true => 2f64.powi(-11) * bound + 2f64.powi(-25) * unscale * weight,
                    false => 0.0,
                } + 1e-5 * bound
                    + 1e-9;
            }
        }
        let got = dn.read(g).unwrap();
        let what = format!("dz·E by the prologue, T={t} V={v} D={d} (case {i}, split {plan:?})");
        for (j, ((got, want), tol)) in got.iter().zip(&want).zip(&tol).enumerate() {
            let err = (*got as f64 - want).abs();
            assert!(
                err <= *tol,
                "{what}: element {j} is {got} where {want} is expected (tolerance {tol:.1e})"
            );
        }
    }
}

/// A split GEMM takes a prologue only, and `CrossEntropyGrad` checks its buffers: errors that
/// name the kernel and binding, before anything is recorded.
#[test]
fn the_gradient_prologue_checks_its_buffers() {
    use hesper_kernels::linear::fusion::{Fusion, GemmFusion, Residual};
    use hesper_kernels::linear::split::execute_gemm_split_fused;
    use hesper_kernels::linear::{Gemm, Precision, Product, Weights};
    let g = gpu();
    let (t, v, d) = (4, 12, 8);
    let logits = g.zeros::<f32>(t * v).unwrap();
    let labels = g.zeros::<i32>(t).unwrap();
    let w = g.zeros::<f32>(v * d).unwrap();
    let short = g.zeros::<f32>(2 * t - 1).unwrap();
    let mut dn = g.zeros::<f32>(t * d).unwrap();
    let mut scratch = g.zeros::<f32>(1).unwrap();
    let gemm = Gemm::new(Product::Nn, (t, v, d), false).with_precision(Precision::F16);
    let grad = loss::CrossEntropyGrad {
        stats: &short,
        labels: &labels,
    };
    let fusion = Fusion {
        prologue: Some(&grad),
        epilogues: &[],
    };
    let mut rec = g.recorder();
    let mut error_of = |fusion: &Fusion| {
        let weights = Weights::Dense(&w);
        execute_gemm_split_fused(
            &mut rec,
            &gemm,
            fusion,
            &logits,
            weights,
            &mut dn,
            &mut scratch,
        )
        .unwrap_err()
        .to_string()
    };
    let err = error_of(&fusion);
    assert!(
        err.contains("`ce_stats`")
            && err.contains("expected 8 elements")
            && err.contains("given 7"),
        "{err}"
    );
    let residual = g.zeros::<f32>(t * d).unwrap();
    let residual = Residual {
        residual: &residual,
    };
    let epilogues: [&dyn GemmFusion; 1] = [&residual];
    let err = error_of(&Fusion {
        prologue: None,
        epilogues: &epilogues,
    });
    assert!(err.contains("prologue only"), "{err}");
    assert!(rec.is_empty());
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// The split launches check their own buffers, each error naming its kernel and binding.
#[test]
fn split_launches_name_kernel_and_buffer() {
    let g = gpu();
    let (c, v) = (4, 10);
    let logits = g.zeros::<f32>(c * v).unwrap();
    let labels = g.zeros::<i32>(c).unwrap();
    let count = g.zeros::<u32>(1).unwrap();
    let mut two = g.zeros::<u32>(2).unwrap();
    let mut d = g.zeros::<f32>(c * v).unwrap();
    let mut tl = g.zeros::<f32>(c).unwrap();
    let mut rec = g.recorder();
    let err = loss::execute_cross_entropy_count(&mut rec, &labels, v, &mut two).unwrap_err();
    assert_eq!(
        err.to_string(),
        "kernel `cross_entropy_count`, binding `count`: expected 1 elements (N), given 2 elements"
    );
    let err = loss::execute_cross_entropy_count(&mut rec, &labels, 0, &mut two).unwrap_err();
    assert_eq!(
        err.to_string(),
        "kernel `cross_entropy_count`: cannot dispatch vocab = 0: a softmax needs at least one \
         class"
    );
    let err =
        loss::execute_cross_entropy_rows(&mut rec, &logits, &labels, v, &two, &mut d, &mut tl)
            .unwrap_err();
    assert_eq!(
        err.to_string(),
        "kernel `cross_entropy`, binding `count`: expected 1 elements (N), given 2 elements"
    );
    let mut short = g.zeros::<f32>(c - 1).unwrap();
    let err =
        loss::execute_cross_entropy_rows(&mut rec, &logits, &labels, v, &count, &mut d, &mut short)
            .unwrap_err();
    assert_eq!(
        err.to_string(),
        "kernel `cross_entropy`, binding `token_loss`: expected 4 elements (one per label), given \
         3 elements"
    );
    let err = loss::execute_cross_entropy_rows(
        &mut rec, &logits, &labels, v, &count, &mut short, &mut tl,
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "kernel `cross_entropy`, binding `d_logits`: expected 40 elements (as logits), given 3 \
         elements"
    );
    let err = loss::execute_cross_entropy_mean(&mut rec, &tl, &count, &mut short).unwrap_err();
    assert_eq!(
        err.to_string(),
        "kernel `cross_entropy_mean`, binding `loss`: expected 1 elements (the mean), given 3 \
         elements"
    );
    assert!(rec.is_empty());
}

/// Each kernel's WGSL at a small key (its first line), the snapshot named by the key.
#[test]
fn wgsl_snapshots() {
    let names = [
        "cross_entropy_count_vocab2000_wg256",
        "cross_entropy_vocab2000_wg256_subgroups",
        "cross_entropy_forward_vocab2000_wg256_subgroups",
        "cross_entropy_stats_vocab2000_wg256_subgroups",
        "cross_entropy_vocab1001_wg256_subgroups",
        "cross_entropy_mean_wg256",
    ];
    let kernels = loss::kernels().unwrap();
    for (name, k) in hesper_kernels::testing::named_by_key(&kernels, &names) {
        insta::assert_snapshot!(name, k.wgsl());
    }
}
