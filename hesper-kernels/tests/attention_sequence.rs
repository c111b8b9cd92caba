//! Causal attention over whole sequences (forward and backward, GQA, padded batches) on the GPU
//! against f64 references; the backward reference against finite differences.

use hesper_exec::half::f16;
use hesper_exec::{Gpu, GpuBuffer};
use hesper_kernels::attention::reference as ar;
use hesper_kernels::attention::{self, SeqGrads, SeqInputs, SeqSaved, SeqShape, ValidLengths};
use hesper_kernels::linear::Precision;
use hesper_kernels::testing::{Rng, assert_close, check_gradient, compare, f64s, gpu, worst};

/// A shape and the valid lengths of its sequences (`None`: unpadded).
struct Case {
    shape: SeqShape,
    lens: Option<Vec<usize>>,
}

fn case(b: usize, s: usize, (h, kv, hd): (usize, usize, usize), lens: Option<&[usize]>) -> Case {
    Case {
        shape: SeqShape::new(b, s, h, kv, hd),
        lens: lens.map(|l| l.to_vec()),
    }
}

/// Awkward shapes: one position; lengths that are no multiple of any block (the blocks are 64
/// or 32 rows); hd 12, 64 and 128; groups of 1, 2 and 3; three sequences of unequal lengths
/// including 1; a sequence that is all padding.
fn cases() -> Vec<Case> {
    vec![
        case(1, 1, (2, 1, 12), None),
        case(2, 37, (3, 1, 12), None),
        case(3, 70, (4, 2, 64), Some(&[70, 1, 45])),
        case(1, 130, (2, 2, 128), None),
        case(2, 65, (6, 2, 128), Some(&[33, 65])),
        case(3, 20, (2, 1, 64), Some(&[0, 20, 7])),
    ]
}

/// The inputs of one case on the host: Q, K, V, dO.
struct Data {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    d_out: Vec<f32>,
}

fn data(shape: &SeqShape, seed: u64) -> Data {
    let mut rng = Rng::new(seed);
    // Scores of a few units: softmax rows neither flat nor one-hot.
    Data {
        q: rng.vec(shape.q_len(), 1.5),
        k: rng.vec(shape.kv_len(), 1.5),
        v: rng.vec(shape.kv_len(), 1.0),
        d_out: rng.vec(shape.q_len(), 1.0),
    }
}

fn to_f32(v: &[f64]) -> Vec<f32> {
    v.iter().map(|x| *x as f32).collect()
}

fn lengths(g: &Gpu, c: &Case) -> Option<ValidLengths> {
    c.lens
        .as_ref()
        .map(|l| ValidLengths::upload(g, l, c.shape.seq_len).unwrap())
}

/// The forward of case `c` on the GPU: `(O, lse)`, poisoned with NaN first.
fn forward_on_gpu(g: &Gpu, c: &Case, d: &Data) -> (Vec<f32>, Vec<f32>) {
    let shape = c.shape;
    let lens = lengths(g, c);
    let (qb, kb, vb) = (
        g.upload(&d.q).unwrap(),
        g.upload(&d.k).unwrap(),
        g.upload(&d.v).unwrap(),
    );
    let mut o = g.filled(shape.q_len(), f32::NAN).unwrap();
    let mut lse = g.filled(shape.tokens() * shape.heads, f32::NAN).unwrap();
    let inputs = SeqInputs {
        q: &qb,
        k: &kb,
        v: &vb,
        lens: lens.as_ref(),
    };
    let mut rec = g.recorder();
    attention::execute_attention_forward(&mut rec, shape, inputs, &mut o, &mut lse).unwrap();
    rec.submit().unwrap();
    (o.read(g).unwrap(), lse.read(g).unwrap())
}

fn reference_forward(c: &Case, d: &Data) -> (Vec<f64>, Vec<f64>) {
    ar::attention_forward(
        &c.shape,
        c.lens.as_deref(),
        &f64s(&d.q),
        &f64s(&d.k),
        &f64s(&d.v),
    )
}

#[test]
fn forward_matches_reference() {
    let g = gpu();
    for (seed, c) in cases().into_iter().enumerate() {
        let d = data(&c.shape, 700 + seed as u64);
        let (o, lse) = forward_on_gpu(g, &c, &d);
        let (want_o, want_lse) = reference_forward(&c, &d);
        let what = format!("{:?} lens {:?}", c.shape, c.lens);
        assert_close(&format!("O {what}"), &o, &want_o, 1e-4, 1e-5);
        assert_close(&format!("lse {what}"), &lse, &want_lse, 1e-5, 1e-5);
    }
}

/// At `Precision::F16` the device's tensor cores run attention where it has them (the H200:
/// `attention::coop`), with `Q`, `K`, `V`, `dO`, `P`, `dS` rounded to f16 (2⁻¹¹ relative);
/// elsewhere the f32 kernels. `dO` is a mean loss's gradient here (~1e-4, near f16's
/// subnormals), which `grad_exponent` lifts before the rounding. Every case whose head
/// dimension is a multiple of 16 (ragged lengths, padding, a sequence of padding alone, GQA),
/// against the f64 attention: the largest error within 1% of the largest value. The backward
/// twice: recomputing the scores for `dQ`, and with a workspace that keeps the scores'
/// gradients (taken on the tensor cores; poisoned with NaN first, so that an unmasked read of
/// what the key gradients did not write shows).
#[test]
fn f16_precision_matches_reference_within_f16_rounding() {
    let g = gpu();
    let tensor_cores = hesper_kernels::linear::coop::subgroup_size(g).is_some();
    let within = |what: &str, got: &[f32], want: &[f64]| {
        let largest = want.iter().fold(0f64, |a, w| a.max(w.abs()));
        let worst = worst(got.iter().zip(want).map(|(g, w)| (*g as f64 - w).abs()));
        eprintln!(
            "{what}: within {:.1e} of the largest value",
            worst / largest
        );
        assert!(
            worst <= 1e-2 * largest,
            "{what}: off by {worst:e} (largest {largest:e})"
        );
    };
    for (seed, c) in cases().into_iter().enumerate() {
        if !c.shape.head_dim.is_multiple_of(16) {
            continue;
        }
        let c = Case {
            shape: c
                .shape
                .with_precision(Precision::F16)
                .with_grad_exponent(13),
            lens: c.lens,
        };
        let mut d = data(&c.shape, 900 + seed as u64);
        d.d_out.iter_mut().for_each(|v| *v *= 1e-4);
        let what = format!(
            "{:?} lens {:?} (tensor cores: {tensor_cores})",
            c.shape, c.lens
        );
        let (o, lse) = forward_on_gpu(g, &c, &d);
        let (want_o, want_lse) = reference_forward(&c, &d);
        within(&format!("O {what}"), &o, &want_o);
        assert_close(&format!("lse {what}"), &lse, &want_lse, 0.0, 2e-3);
        let (want_dq, want_dk, want_dv) = reference_backward(&c, &d);
        for keep_scores in [false, true] {
            let (dq, dk, dv) = backward_on_gpu(g, &c, &d, keep_scores);
            let what = format!("{what}, scores' gradients kept: {keep_scores}");
            within(&format!("dQ {what}"), &dq, &want_dq);
            within(&format!("dK {what}"), &dk, &want_dk);
            within(&format!("dV {what}"), &dv, &want_dv);
        }
    }
}

/// The backward given the reference's `O` and `lse` (rounded to f32), so that it is checked on
/// its own; with `keep_scores`, a NaN-poisoned workspace for the scores' gradients where the
/// device takes one.
fn backward_on_gpu(
    g: &Gpu,
    c: &Case,
    d: &Data,
    keep_scores: bool,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let shape = c.shape;
    let (o, lse) = ar::attention_forward(
        &shape,
        c.lens.as_deref(),
        &f64s(&d.q),
        &f64s(&d.k),
        &f64s(&d.v),
    );
    let lens = lengths(g, c);
    let up = |v: &[f32]| g.upload(v).unwrap();
    let (qb, kb, vb, dob) = (up(&d.q), up(&d.k), up(&d.v), up(&d.d_out));
    let (ob, lseb) = (up(&to_f32(&o)), up(&to_f32(&lse)));
    let nan = |n: usize| -> GpuBuffer<f32> { g.filled(n, f32::NAN).unwrap() };
    let mut stats = nan(2 * shape.tokens() * shape.heads);
    let (mut dq, mut dk, mut dv) = (nan(shape.q_len()), nan(shape.kv_len()), nan(shape.kv_len()));
    let mut scores = attention::scores_workspace_len(g, &shape)
        .filter(|_| keep_scores)
        .map(|n| g.filled(n, f16::NAN).unwrap());
    let saved = SeqSaved {
        inputs: SeqInputs {
            q: &qb,
            k: &kb,
            v: &vb,
            lens: lens.as_ref(),
        },
        o: &ob,
        lse: &lseb,
    };
    let grads = SeqGrads {
        stats: &mut stats,
        scores: scores.as_mut(),
        d_q: &mut dq,
        d_k: &mut dk,
        d_v: &mut dv,
    };
    let mut rec = g.recorder();
    attention::execute_attention_backward(&mut rec, shape, saved, &dob, grads).unwrap();
    rec.submit().unwrap();
    (
        dq.read(g).unwrap(),
        dk.read(g).unwrap(),
        dv.read(g).unwrap(),
    )
}

fn reference_backward(c: &Case, d: &Data) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    ar::attention_backward(
        &c.shape,
        c.lens.as_deref(),
        (&f64s(&d.q), &f64s(&d.k), &f64s(&d.v)),
        &f64s(&d.d_out),
    )
}

#[test]
fn backward_matches_reference() {
    let g = gpu();
    for (seed, c) in cases().into_iter().enumerate() {
        let d = data(&c.shape, 800 + seed as u64);
        let (dq, dk, dv) = backward_on_gpu(g, &c, &d, false);
        let (want_dq, want_dk, want_dv) = reference_backward(&c, &d);
        let what = format!("{:?} lens {:?}", c.shape, c.lens);
        assert_close(&format!("dQ {what}"), &dq, &want_dq, 2e-4, 1e-4);
        assert_close(&format!("dK {what}"), &dk, &want_dk, 2e-4, 1e-4);
        assert_close(&format!("dV {what}"), &dv, &want_dv, 2e-4, 1e-4);
    }
}

/// The seeds' mistakes, made in the reference, are far from what the kernels compute: the
/// comparison above would fail on a backward that drops the keys' gradients from later query
/// rows, or keeps one query head of a group.
#[test]
fn dropped_contributions_are_told_apart() {
    let g = gpu();
    let c = case(1, 70, (6, 2, 64), None);
    let d = data(&c.shape, 900);
    let (_, dk, dv) = backward_on_gpu(g, &c, &d, false);
    let (_, want_dk, want_dv) = reference_backward(&c, &d);
    assert_close("dK", &dk, &want_dk, 2e-4, 1e-4);
    assert_close("dV", &dv, &want_dv, 2e-4, 1e-4);

    // Only the diagonal: each key's gradient from its own query row.
    let diagonal = |i: usize| -> Data {
        let mut d2 = Data {
            q: d.q.clone(),
            k: d.k.clone(),
            v: d.v.clone(),
            d_out: vec![0.0; d.d_out.len()],
        };
        let row = c.shape.heads * c.shape.head_dim;
        d2.d_out[i * row..(i + 1) * row].copy_from_slice(&d.d_out[i * row..(i + 1) * row]);
        d2
    };
    let mut diag_dv = vec![0.0; want_dv.len()];
    for s in 0..c.shape.seq_len {
        let (_, _, dv_s) = reference_backward(&c, &diagonal(s));
        let row = c.shape.kv_heads * c.shape.head_dim;
        diag_dv[s * row..(s + 1) * row].copy_from_slice(&dv_s[s * row..(s + 1) * row]);
    }
    let off = compare(&dv, &diag_dv, 1e-4);
    assert!(off.max_rel > 0.5, "dV without later rows is close: {off}");

    // One query head per group: the other heads' dO set to zero.
    let mut one_head = Data {
        q: d.q.clone(),
        k: d.k.clone(),
        v: d.v.clone(),
        d_out: d.d_out.clone(),
    };
    let (hd, group) = (c.shape.head_dim, c.shape.group());
    for (i, x) in one_head.d_out.iter_mut().enumerate() {
        if !((i / hd) % c.shape.heads).is_multiple_of(group) {
            *x = 0.0;
        }
    }
    let (_, one_dk, one_dv) = reference_backward(&c, &one_head);
    for (name, got, wrong) in [("dK", &dk, &one_dk), ("dV", &dv, &one_dv)] {
        let off = compare(got, wrong, 1e-4);
        assert!(
            off.max_rel > 0.5,
            "{name} of one head per group is close: {off}"
        );
    }
}

/// `Σ dO ⊙ O` differentiated by finite differences w.r.t. Q, K and V, with GQA and padding.
#[test]
fn backward_reference_matches_finite_differences() {
    let shape = SeqShape::new(2, 5, 4, 2, 4);
    let lens = [5, 3];
    let mut rng = Rng::new(12);
    let (q, k, v, d_out) = (
        f64s(&rng.vec(shape.q_len(), 1.5)),
        f64s(&rng.vec(shape.kv_len(), 1.5)),
        f64s(&rng.vec(shape.kv_len(), 1.0)),
        f64s(&rng.vec(shape.q_len(), 1.0)),
    );
    let loss = |q: &[f64], k: &[f64], v: &[f64]| {
        let (o, _) = ar::attention_forward(&shape, Some(&lens), q, k, v);
        o.iter().zip(&d_out).map(|(a, b)| a * b).sum::<f64>()
    };
    let (dq, dk, dv) = ar::attention_backward(&shape, Some(&lens), (&q, &k, &v), &d_out);
    check_gradient("dQ", &q, &dq, q.len(), |q| loss(q, &k, &v));
    check_gradient("dK", &k, &dk, k.len(), |k| loss(&q, k, &v));
    check_gradient("dV", &v, &dv, v.len(), |v| loss(&q, &k, v));
    // Padded keys and rows have no gradient.
    let row = shape.kv_heads * shape.head_dim;
    assert!(dk[(5 + 3) * row..].iter().all(|x| *x == 0.0));
}

/// `lse` is the log of the softmax's normaliser: `exp(τ·q·k − lse)` sums to 1 over a row.
#[test]
fn forward_reference_is_a_softmax() {
    let shape = SeqShape::new(1, 6, 2, 1, 4);
    let mut rng = Rng::new(3);
    let (q, k) = (
        f64s(&rng.vec(shape.q_len(), 2.0)),
        f64s(&rng.vec(shape.kv_len(), 2.0)),
    );
    // V = identity-like rows: O's first column is the probability of key 0.
    let mut v = vec![0.0; shape.kv_len()];
    for s in 0..6 {
        v[s * 4] = 1.0;
    }
    let (o, lse) = ar::attention_forward(&shape, None, &q, &k, &v);
    for s in 0..6 {
        for h in 0..2 {
            let qr = &q[(s * 2 + h) * 4..][..4];
            let total: f64 = (0..=s)
                .map(|c| {
                    let dot: f64 = (0..4).map(|d| qr[d] * k[c * 4 + d]).sum();
                    (shape.scale as f64 * dot - lse[s * 2 + h]).exp()
                })
                .sum();
            assert!((total - 1.0).abs() < 1e-12, "row {s} head {h}: {total}");
        }
    }
    assert!(
        (o[0] - 1.0).abs() < 1e-12,
        "position 0 attends only to itself"
    );
}

#[test]
fn bad_shapes_are_errors() {
    let g = gpu();
    let buf = |n: usize| g.zeros::<f32>(n).unwrap();
    let run = |shape: SeqShape, q: usize, kv: usize, lens: Option<&ValidLengths>| {
        let (qb, kb, vb) = (buf(q), buf(kv), buf(kv));
        let (mut o, mut lse) = (buf(q), buf(shape.tokens() * shape.heads));
        let inputs = SeqInputs {
            q: &qb,
            k: &kb,
            v: &vb,
            lens,
        };
        let mut rec = g.recorder();
        let err = attention::execute_attention_forward(&mut rec, shape, inputs, &mut o, &mut lse)
            .unwrap_err();
        assert!(rec.is_empty(), "nothing recorded on an error");
        err.to_string()
    };
    let ok = SeqShape::new(2, 8, 4, 2, 8);
    let err = run(
        SeqShape::new(2, 8, 3, 2, 8),
        2 * 8 * 3 * 8,
        2 * 8 * 2 * 8,
        None,
    );
    assert!(err.contains("heads = 3, kv_heads = 2"), "{err}");
    let err = run(
        SeqShape::new(2, 8, 4, 2, 6),
        2 * 8 * 4 * 6,
        2 * 8 * 2 * 6,
        None,
    );
    assert!(
        err.contains("head_dim = 6") && err.contains("multiple of 4"),
        "{err}"
    );
    let err = run(SeqShape::new(1, 2, 1, 1, 132), 264, 264, None);
    assert!(
        err.contains("head_dim = 132") && err.contains("at most 128"),
        "{err}"
    );
    let err = run(ok, ok.q_len(), ok.kv_len() - 1, None);
    assert_eq!(
        err,
        "kernel `attention_forward`, binding `k`: expected 256 elements ([batch·seq_len, kv_heads·head_dim]), given 255 elements"
    );
    let lens = ValidLengths::upload(g, &[8, 8, 8], 8).unwrap();
    let err = run(ok, ok.q_len(), ok.kv_len(), Some(&lens));
    assert!(err.contains("binding `lens`: expected 2 lengths"), "{err}");
    let err = ValidLengths::upload(g, &[8, 9], 8)
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("lengths[1] = 9") && err.contains("at most the sequence length 8"),
        "{err}"
    );
}

#[test]
fn shapes_that_overflow_are_errors() {
    let g = gpu();
    let b = g.zeros::<f32>(8).unwrap();
    let (mut o, mut lse) = (g.zeros::<f32>(8).unwrap(), g.zeros::<f32>(8).unwrap());
    let inputs = SeqInputs {
        q: &b,
        k: &b,
        v: &b,
        lens: None,
    };
    let mut rec = g.recorder();
    let shape = SeqShape::new(1 << 40, 1 << 30, 4, 2, 8);
    let err = attention::execute_attention_forward(&mut rec, shape, inputs, &mut o, &mut lse)
        .unwrap_err()
        .to_string();
    assert!(err.contains("must fit the kernels' u32 indices"), "{err}");
    assert!(rec.is_empty());
}

/// On a device that cuts loops off (lavapipe: 65 535 iterations an invocation), a backward whose
/// dK/dV kernel would loop longer is an error before anything is recorded, not wrong numbers.
#[test]
fn a_backward_past_the_device_loop_limit_is_an_error() {
    let g = gpu();
    if g.max_loop_iterations().is_none() {
        println!("skipped: {} has no known loop limit", g.describe());
        return;
    }
    // 8 query heads per KV head over 40 000 positions: ~130 000 iterations in the dK/dV kernel.
    let shape = SeqShape::new(1, 40_000, 8, 1, 128);
    let b = g.zeros::<f32>(4).unwrap();
    let (mut s, mut dq, mut dk, mut dv) = (
        g.zeros::<f32>(4).unwrap(),
        g.zeros::<f32>(4).unwrap(),
        g.zeros::<f32>(4).unwrap(),
        g.zeros::<f32>(4).unwrap(),
    );
    let saved = SeqSaved {
        inputs: SeqInputs {
            q: &b,
            k: &b,
            v: &b,
            lens: None,
        },
        o: &b,
        lse: &b,
    };
    let grads = SeqGrads {
        stats: &mut s,
        scores: None,
        d_q: &mut dq,
        d_k: &mut dk,
        d_v: &mut dv,
    };
    let mut rec = g.recorder();
    let err = attention::execute_attention_backward(&mut rec, shape, saved, &b, grads)
        .unwrap_err()
        .to_string();
    assert!(err.contains("stops loops after 65535 iterations"), "{err}");
    assert!(rec.is_empty());
}

/// A workspace for the scores' gradients of another length is an error that names it, on any
/// device (whether or not its kernels would take it), before anything is recorded.
#[test]
fn a_scores_workspace_of_the_wrong_length_is_an_error() {
    let g = gpu();
    let shape = SeqShape::new(2, 40, 4, 2, 16).with_precision(Precision::F16);
    let want = shape.scores_len().unwrap();
    assert_eq!(want, 2 * 4 * 64 * 64, "S' = 40 rounded up to 64");
    let zeros = |n: usize| g.zeros::<f32>(n).unwrap();
    let (q, kv) = (zeros(shape.q_len()), zeros(shape.kv_len()));
    let rows = shape.tokens() * shape.heads;
    let (o, lse, d_out) = (zeros(shape.q_len()), zeros(rows), zeros(shape.q_len()));
    let mut stats = zeros(2 * rows);
    let (mut dq, mut dk, mut dv) = (
        zeros(shape.q_len()),
        zeros(shape.kv_len()),
        zeros(shape.kv_len()),
    );
    let mut scores = g.zeros::<f16>(want - 1).unwrap();
    let saved = SeqSaved {
        inputs: SeqInputs {
            q: &q,
            k: &kv,
            v: &kv,
            lens: None,
        },
        o: &o,
        lse: &lse,
    };
    let grads = SeqGrads {
        stats: &mut stats,
        scores: Some(&mut scores),
        d_q: &mut dq,
        d_k: &mut dk,
        d_v: &mut dv,
    };
    let mut rec = g.recorder();
    let err = attention::execute_attention_backward(&mut rec, shape, saved, &d_out, grads)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("scores") && err.contains(&want.to_string()),
        "{err}"
    );
    assert!(rec.is_empty());
}
