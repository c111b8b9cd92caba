//! LoRA forward and backward on the GPU against the f64 reference, and the reference against
//! finite differences.

use hesper_exec::Gpu;
use hesper_kernels::lora::{self, LoraBackward, WeightBackward, reference};
use hesper_kernels::testing::{
    Rng, assert_close, check_gradient, f64s, gpu, gpu_without_subgroups,
};

/// (tokens, in, out, rank): widths that are and are not multiples of 4 (wide or scalar
/// loads), of `lora_down`'s 256-column step (a ragged last step), ranks that are not multiples
/// of 4 or of its rounds of 8, ranks past 16 (more sums than a subgroup of 8 or 16 has lanes) up
/// to the register kernels' 32; tokens past one `lora_down` tile (16), one weight-gradient block
/// (256) and not a multiple of either. The last has a rank past the register kernels' limit (32):
/// its products go through the GEMM. The weight gradients' blocks shrink for fewer than 16 384
/// tokens (`lane_tokens` 8 below 4096 tokens; 16 at 5000, 32 at 8200, both ragged), and so do
/// `lora_down_subgroups`' workgroups (8 tokens below 8192 tokens, 16 at 8200).
const SHAPES: [(usize, usize, usize, usize); 12] = [
    (1, 7, 5, 1),
    (5000, 64, 48, 8),
    (8200, 512, 8, 2),
    (8200, 8, 1024, 2),
    (5, 100, 130, 4),
    (37, 256, 96, 16),
    (130, 64, 300, 8),
    (300, 644, 131, 12),
    (531, 384, 260, 6),
    (40, 132, 64, 17),
    (70, 96, 130, 32),
    (5, 64, 48, 40),
];
const SCALE: f32 = 2.0; // α/r with α = 2r: a scale of 0 (entrenar's bug) would fail every check

#[test]
fn forward_and_backward_match_reference() {
    forward_and_backward_match_reference_on(gpu());
}

/// The paths for devices without subgroups, on this one.
#[test]
fn forward_and_backward_match_reference_without_subgroups() {
    forward_and_backward_match_reference_on(gpu_without_subgroups());
}

/// Two adapters' products into `r` over one input (`execute_lora_down_pair`) against the
/// reference for each, on the pair kernel and on the paths without it (no subgroups, or
/// `2r` past 32), at the shapes of `SHAPES`.
#[test]
fn down_pair_matches_reference() {
    for g in [gpu(), gpu_without_subgroups()] {
        for (seed, (t, input, _, r)) in SHAPES.into_iter().enumerate() {
            let mut rng = Rng::new(seed as u64 + 70);
            let x = rng.vec(t * input, 1.0);
            let (a1, a2) = (rng.vec(r * input, 0.5), rng.vec(r * input, 0.5));
            let xb = g.upload(&x).unwrap();
            let (a1b, a2b) = (g.upload(&a1).unwrap(), g.upload(&a2).unwrap());
            let mut h1 = g.filled(t * r, f32::NAN).unwrap();
            let mut h2 = g.filled(t * r, f32::NAN).unwrap();
            let mut rec = g.recorder();
            lora::execute_lora_down_pair(&mut rec, &xb, (&a1b, &a2b), r, (&mut h1, &mut h2))
                .unwrap();
            let launches = rec.len();
            rec.submit().unwrap();
            let paired = g.subgroup_size().is_some_and(|s| (8..=256).contains(&s)) && 2 * r <= 32;
            assert_eq!(
                launches,
                if paired { 1 } else { 2 },
                "T={t} in={input} r={r}"
            );
            for (what, h, a) in [("h1", &h1, &a1), ("h2", &h2, &a2)] {
                let zeros = vec![0.0; 0];
                let (want, _) =
                    reference::lora_forward(&f64s(&x), &f64s(a), &zeros, &zeros, r, 0.0);
                let got = h.read(g).unwrap();
                let label = format!("down pair {what} T={t} in={input} r={r} paired={paired}");
                assert_close(&label, &got, &want, 1e-4, 1e-4);
            }
        }
    }
}

/// Two adapters' `dh = dy·B` over inputs of their own (`execute_grad_dh_pair`) against the f64
/// product, on the pair kernel and on the paths without it (no subgroups, `2r` past 32, one
/// width a multiple of 4 and the other not): the query and value widths of a layer and
/// others, tokens past one workgroup's and ragged.
#[test]
fn grad_dh_pair_matches_reference() {
    // (tokens, out1, out2, rank)
    let shapes = [
        (1100, 576, 192, 8),
        (37, 64, 48, 16),
        (5, 7, 13, 3),
        (130, 100, 20, 17),
        (9, 130, 64, 4),
        (300, 8, 1028, 2),
    ];
    for g in [gpu(), gpu_without_subgroups()] {
        for (seed, (t, out1, out2, r)) in shapes.into_iter().enumerate() {
            let mut rng = Rng::new(seed as u64 + 110);
            let (dy1, dy2) = (rng.vec(t * out1, 1.0), rng.vec(t * out2, 1.0));
            let (b1, b2) = (rng.vec(out1 * r, 0.5), rng.vec(out2 * r, 0.5));
            let up = |v: &Vec<f32>| g.upload(v).unwrap();
            let (dy1b, dy2b, b1b, b2b) = (up(&dy1), up(&dy2), up(&b1), up(&b2));
            let mut dh1 = g.filled(t * r, f32::NAN).unwrap();
            let mut dh2 = g.filled(t * r, f32::NAN).unwrap();
            let mut rec = g.recorder();
            lora::execute_grad_dh_pair(
                &mut rec,
                (&dy1b, &dy2b),
                (&b1b, &b2b),
                r,
                (&mut dh1, &mut dh2),
            )
            .unwrap();
            let launches = rec.len();
            rec.submit().unwrap();
            let paired = g.subgroup_size().is_some_and(|s| (8..=256).contains(&s))
                && 2 * r <= 32
                && (out1 % 4 == 0) == (out2 % 4 == 0);
            let label = format!("dh pair T={t} out={out1}, {out2} r={r} paired={paired}");
            assert_eq!(launches, if paired { 1 } else { 2 }, "{label}");
            for (what, dh, dy, b, out) in [
                ("dh1", &dh1, &dy1, &b1, out1),
                ("dh2", &dh2, &dy2, &b2, out2),
            ] {
                let want: Vec<f64> = (0..t * r)
                    .map(|i| {
                        let (tok, k) = (i / r, i % r);
                        (0..out)
                            .map(|j| dy[tok * out + j] as f64 * b[j * r + k] as f64)
                            .sum()
                    })
                    .collect();
                assert_close(
                    &format!("{what} {label}"),
                    &dh.read(g).unwrap(),
                    &want,
                    1e-4,
                    1e-4,
                );
            }
        }
    }
}

#[test]
fn grad_dh_pair_of_different_tokens_is_an_error() {
    let g = gpu();
    let (dy1, dy2) = (
        g.zeros::<f32>(3 * 8).unwrap(),
        g.zeros::<f32>(4 * 4).unwrap(),
    );
    let (b1, b2) = (
        g.zeros::<f32>(8 * 2).unwrap(),
        g.zeros::<f32>(4 * 2).unwrap(),
    );
    let (mut dh1, mut dh2) = (g.zeros::<f32>(6).unwrap(), g.zeros::<f32>(6).unwrap());
    let mut rec = g.recorder();
    let err =
        lora::execute_grad_dh_pair(&mut rec, (&dy1, &dy2), (&b1, &b2), 2, (&mut dh1, &mut dh2))
            .unwrap_err()
            .to_string();
    assert!(
        err.contains("grad_dh_pair") && err.contains("dy1 of 3 tokens and dy2 of 4"),
        "{err}"
    );
    assert!(rec.is_empty(), "nothing recorded on an error");
}

#[test]
fn down_pair_of_different_inputs_is_an_error() {
    let g = gpu();
    let x = g.zeros::<f32>(3 * 8).unwrap();
    let (a1, a2) = (
        g.zeros::<f32>(2 * 8).unwrap(),
        g.zeros::<f32>(2 * 4).unwrap(),
    );
    let (mut h1, mut h2) = (g.zeros::<f32>(6).unwrap(), g.zeros::<f32>(6).unwrap());
    let mut rec = g.recorder();
    let err = lora::execute_lora_down_pair(&mut rec, &x, (&a1, &a2), 2, (&mut h1, &mut h2))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("lora_down_pair") && err.contains("a1 of 8 inputs and a2 of 4"),
        "{err}"
    );
    let a2 = g.zeros::<f32>(2 * 8).unwrap();
    let mut h2 = g.zeros::<f32>(5).unwrap();
    let err = lora::execute_lora_down_pair(&mut rec, &x, (&a1, &a2), 2, (&mut h1, &mut h2))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("`h2`") && err.contains("[tokens, rank]"),
        "{err}"
    );
    assert!(rec.is_empty(), "nothing recorded on an error");
}

fn forward_and_backward_match_reference_on(g: &Gpu) {
    for (seed, (t, input, output, r)) in SHAPES.into_iter().enumerate() {
        let mut rng = Rng::new(seed as u64 + 11);
        let x = rng.vec(t * input, 1.0);
        let (a, b) = (rng.vec(r * input, 0.5), rng.vec(output * r, 0.5));
        let (y0, dy, dx0) = (
            rng.vec(t * output, 1.0),
            rng.vec(t * output, 1.0),
            rng.vec(t * input, 1.0),
        );
        let (xb, ab, bb, dyb) = (
            g.upload(&x).unwrap(),
            g.upload(&a).unwrap(),
            g.upload(&b).unwrap(),
            g.upload(&dy).unwrap(),
        );
        let mut y = g.upload(&y0).unwrap();
        let mut h = g.filled(t * r, f32::NAN).unwrap();
        let mut dh = g.filled(t * r, f32::NAN).unwrap();
        let mut scratch = g
            .filled(lora::lora_scratch_len(t, input + output, r), f32::NAN)
            .unwrap();
        let (mut da, mut db) = (
            g.filled(r * input, f32::NAN).unwrap(),
            g.filled(output * r, f32::NAN).unwrap(),
        );
        let mut dx = g.upload(&dx0).unwrap();

        let mut rec = g.recorder();
        lora::execute_lora_forward(&mut rec, &xb, &ab, &bb, r, SCALE, &mut h, &mut y).unwrap();
        let inputs = LoraBackward {
            x: &xb,
            a: &ab,
            b: &bb,
            h: &h,
            dy: &dyb,
        };
        lora::execute_lora_backward(
            &mut rec,
            &inputs,
            r,
            SCALE,
            &mut dh,
            &mut scratch,
            &mut da,
            &mut db,
            &mut dx,
        )
        .unwrap();
        rec.submit().unwrap();

        let (x64, a64, b64) = (f64s(&x), f64s(&a), f64s(&b));
        let (want_h, want_y) =
            reference::lora_forward(&x64, &a64, &b64, &f64s(&y0), r, SCALE as f64);
        let (want_da, want_db, want_dx) =
            reference::lora_backward(&x64, &a64, &b64, &f64s(&dy), r, SCALE as f64);
        let want_dx: Vec<f64> = want_dx
            .iter()
            .zip(&dx0)
            .map(|(d, x)| d + *x as f64)
            .collect();
        let what = format!("T={t} in={input} out={output} r={r}");
        assert_close(
            &format!("h {what}"),
            &h.read(g).unwrap(),
            &want_h,
            1e-5,
            1e-5,
        );
        assert_close(
            &format!("y {what}"),
            &y.read(g).unwrap(),
            &want_y,
            1e-5,
            1e-5,
        );
        assert_close(
            &format!("dA {what}"),
            &da.read(g).unwrap(),
            &want_da,
            1e-5,
            1e-4,
        );
        assert_close(
            &format!("dB {what}"),
            &db.read(g).unwrap(),
            &want_db,
            1e-5,
            1e-4,
        );
        assert_close(
            &format!("dx {what}"),
            &dx.read(g).unwrap(),
            &want_dx,
            1e-5,
            1e-4,
        );
    }
}

/// Two adapters' weight backward in one call (`execute_lora_weight_backward_pair`: four
/// launches) against the reference for each: outputs of different widths (a layer's query
/// and value), widths that are not multiples of 4, several token counts and ranks.
#[test]
fn weight_backward_pair_matches_reference() {
    let g = gpu();
    // (tokens, in, out of the first, out of the second, rank)
    for (seed, (t, input, out1, out2, r)) in [
        (37, 64, 48, 20, 8),
        (5000, 96, 96, 32, 8),
        (130, 33, 21, 7, 3),
        (531, 64, 130, 64, 16),
    ]
    .into_iter()
    .enumerate()
    {
        let mut rng = Rng::new(seed as u64 + 90);
        let x = rng.vec(t * input, 1.0);
        let adapters: Vec<_> = [out1, out2]
            .into_iter()
            .map(|out| {
                let (a, b) = (rng.vec(r * input, 0.5), rng.vec(out * r, 0.5));
                let dy = rng.vec(t * out, 1.0);
                (out, a, b, dy)
            })
            .collect();
        let xb = g.upload(&x).unwrap();
        let uploads: Vec<_> = adapters
            .iter()
            .map(|(_, a, b, dy)| {
                let (ab, bb) = (g.upload(a).unwrap(), g.upload(b).unwrap());
                let mut h = g.filled(t * r, f32::NAN).unwrap();
                let mut rec = g.recorder();
                lora::execute_lora_down(&mut rec, &xb, &ab, r, &mut h).unwrap();
                rec.submit().unwrap();
                let dyb = g.upload(dy).unwrap();
                (ab, bb, h, dyb)
            })
            .collect();
        let inputs: Vec<LoraBackward> = uploads
            .iter()
            .map(|(a, b, h, dy)| LoraBackward {
                x: &xb,
                a,
                b,
                h,
                dy,
            })
            .collect();
        let nan = |n: usize| g.filled(n, f32::NAN).unwrap();
        let (mut dh1, mut da1, mut db1) = (nan(t * r), nan(r * input), nan(out1 * r));
        let (mut dh2, mut da2, mut db2) = (nan(t * r), nan(r * input), nan(out2 * r));
        let widths = 2 * input + out1 + out2;
        let mut scratch = g
            .filled(lora::lora_scratch_len(t, widths, r), f32::NAN)
            .unwrap();
        let mut rec = g.recorder();
        let pair = [
            WeightBackward {
                inputs: &inputs[0],
                dh: &mut dh1,
                da: &mut da1,
                db: &mut db1,
            },
            WeightBackward {
                inputs: &inputs[1],
                dh: &mut dh2,
                da: &mut da2,
                db: &mut db2,
            },
        ];
        lora::execute_lora_weight_backward_pair(&mut rec, pair, r, SCALE, &mut scratch).unwrap();
        // Both dh in one launch where the device's subgroups allow and the widths are both
        // multiples of 4 or neither (as in `grad_dh_pair_matches_reference`).
        let dh_paired = g.subgroup_size().is_some_and(|s| (8..=256).contains(&s))
            && 2 * r <= 32
            && (out1 % 4 == 0) == (out2 % 4 == 0);
        assert_eq!(
            rec.len(),
            if dh_paired { 4 } else { 5 },
            "dh (one launch or two), two of partials, the sums: T={t} out={out1}, {out2}"
        );
        rec.submit().unwrap();
        for ((out, a, b, dy), (da, db)) in adapters.iter().zip([(&da1, &db1), (&da2, &db2)]) {
            let (want_da, want_db, _) =
                reference::lora_backward(&f64s(&x), &f64s(a), &f64s(b), &f64s(dy), r, SCALE as f64);
            let what = format!("pair T={t} in={input} out={out} r={r}");
            assert_close(
                &format!("dA {what}"),
                &da.read(g).unwrap(),
                &want_da,
                1e-5,
                1e-4,
            );
            assert_close(
                &format!("dB {what}"),
                &db.read(g).unwrap(),
                &want_db,
                1e-5,
                1e-4,
            );
        }
    }
}

#[test]
fn weight_backward_pair_of_different_tokens_is_an_error() {
    let g = gpu();
    let (r, input, out) = (2, 8, 4);
    let buf = |n: usize| g.zeros::<f32>(n).unwrap();
    let (x1, x2) = (buf(3 * input), buf(5 * input));
    let (a, b) = (buf(r * input), buf(out * r));
    let (h1, dy1, h2, dy2) = (buf(3 * r), buf(3 * out), buf(5 * r), buf(5 * out));
    let first = LoraBackward {
        x: &x1,
        a: &a,
        b: &b,
        h: &h1,
        dy: &dy1,
    };
    let second = LoraBackward {
        x: &x2,
        a: &a,
        b: &b,
        h: &h2,
        dy: &dy2,
    };
    let (mut dh1, mut dh2) = (buf(3 * r), buf(5 * r));
    let (mut da1, mut db1, mut da2, mut db2) =
        (buf(r * input), buf(out * r), buf(r * input), buf(out * r));
    let mut scratch = buf(lora::lora_scratch_len(5, 2 * (input + out), r));
    let mut rec = g.recorder();
    let pair = [
        WeightBackward {
            inputs: &first,
            dh: &mut dh1,
            da: &mut da1,
            db: &mut db1,
        },
        WeightBackward {
            inputs: &second,
            dh: &mut dh2,
            da: &mut da2,
            db: &mut db2,
        },
    ];
    let err = lora::execute_lora_weight_backward_pair(&mut rec, pair, r, SCALE, &mut scratch)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("lora_backward_pair") && err.contains("adapters over 3 and 5 tokens"),
        "{err}"
    );
    assert!(rec.is_empty(), "nothing recorded on an error");
}

/// The single pieces agree with the fused backward's pieces (Hesper's names).
#[test]
fn pieces_match_reference() {
    let g = gpu();
    let (t, input, output, r) = (9, 33, 21, 3);
    let mut rng = Rng::new(5);
    let (x, a, b, dy) = (
        rng.vec(t * input, 1.0),
        rng.vec(r * input, 0.5),
        rng.vec(output * r, 0.5),
        rng.vec(t * output, 1.0),
    );
    let (xb, ab, bb, dyb) = (
        g.upload(&x).unwrap(),
        g.upload(&a).unwrap(),
        g.upload(&b).unwrap(),
        g.upload(&dy).unwrap(),
    );
    let mut dh = g.filled(t * r, f32::NAN).unwrap();
    let mut rec = g.recorder();
    lora::execute_grad_dh(&mut rec, &dyb, &bb, r, &mut dh).unwrap();
    rec.submit().unwrap();
    let want_dh: Vec<f64> = (0..t * r)
        .map(|i| {
            (0..output)
                .map(|o| dy[(i / r) * output + o] as f64 * b[o * r + i % r] as f64)
                .sum()
        })
        .collect();
    assert_close("dh", &dh.read(g).unwrap(), &want_dh, 1e-5, 1e-5);
    // dx gets only the LoRA part when it starts at zero.
    let mut dx = g.zeros::<f32>(t * input).unwrap();
    let mut rec = g.recorder();
    lora::execute_input_grad(&mut rec, &dh, &ab, r, SCALE, &mut dx).unwrap();
    rec.submit().unwrap();
    let (_, _, want_dx) =
        reference::lora_backward(&f64s(&x), &f64s(&a), &f64s(&b), &f64s(&dy), r, SCALE as f64);
    assert_close("input_grad", &dx.read(g).unwrap(), &want_dx, 1e-5, 1e-5);
    // The weight gradients one at a time, each with a scratch buffer of its own width (and
    // one element short of it: an error naming the function and the buffer).
    let zeros = vec![0.0; t * output];
    let (h_ref, _) = reference::lora_forward(&f64s(&x), &f64s(&a), &f64s(&b), &zeros, r, 1.0);
    let h: Vec<f32> = h_ref.iter().map(|v| *v as f32).collect();
    let hb = g.upload(&h).unwrap();
    let (want_da, want_db, _) =
        reference::lora_backward(&f64s(&x), &f64s(&a), &f64s(&b), &f64s(&dy), r, SCALE as f64);
    let mut db = g.filled(output * r, f32::NAN).unwrap();
    let mut da = g.filled(r * input, f32::NAN).unwrap();
    let mut scratch_b = g
        .filled(lora::lora_scratch_len(t, output, r), f32::NAN)
        .unwrap();
    let mut scratch_a = g
        .filled(lora::lora_scratch_len(t, input, r), f32::NAN)
        .unwrap();
    let mut rec = g.recorder();
    lora::execute_grad_b(&mut rec, &dyb, &hb, r, SCALE, &mut scratch_b, &mut db).unwrap();
    lora::execute_grad_a(&mut rec, &dh, &xb, r, SCALE, &mut scratch_a, &mut da).unwrap();
    rec.submit().unwrap();
    assert_close("grad_b", &db.read(g).unwrap(), &want_db, 1e-5, 1e-5);
    assert_close("grad_a", &da.read(g).unwrap(), &want_da, 1e-5, 1e-5);
    let mut short = g
        .zeros::<f32>(lora::lora_scratch_len(t, output, r) - 1)
        .unwrap();
    let err = lora::execute_grad_b(&mut g.recorder(), &dyb, &hb, r, SCALE, &mut short, &mut db)
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        format!(
            "kernel `grad_b`, binding `scratch`: expected at least {} elements (lora_scratch_len), given {} elements",
            lora::lora_scratch_len(t, output, r),
            short.len()
        )
    );
}

/// The reference backward is the gradient of `L = Σ dy ⊙ y` with `y = s·(x·Aᵀ)·Bᵀ`.
#[test]
fn backward_reference_matches_finite_differences() {
    let (t, input, output, r) = (3, 5, 4, 2);
    let mut rng = Rng::new(3);
    let (x, a, b, dy) = (
        f64s(&rng.vec(t * input, 1.0)),
        f64s(&rng.vec(r * input, 0.5)),
        f64s(&rng.vec(output * r, 0.5)),
        f64s(&rng.vec(t * output, 1.0)),
    );
    let s = SCALE as f64;
    let loss = |x: &[f64], a: &[f64], b: &[f64]| {
        let (_, y) = reference::lora_forward(x, a, b, &vec![0.0; t * output], r, s);
        y.iter().zip(&dy).map(|(y, d)| y * d).sum::<f64>()
    };
    let (da, db, dx) = reference::lora_backward(&x, &a, &b, &dy, r, s);
    check_gradient("dA", &a, &da, a.len(), |a| loss(&x, a, &b));
    check_gradient("dB", &b, &db, b.len(), |b| loss(&x, &a, b));
    check_gradient("dx", &x, &dx, x.len(), |x| loss(x, &a, &b));
}

#[test]
fn bad_shapes_name_kernel_and_buffer() {
    let g = gpu();
    // 2 tokens, in = 10, out = 3, rank 2
    let (x, a, b) = (
        g.zeros::<f32>(20).unwrap(),
        g.zeros::<f32>(2 * 10).unwrap(),
        g.zeros::<f32>(3 * 2).unwrap(),
    );
    let (mut h, mut y_short) = (g.zeros::<f32>(4).unwrap(), g.zeros::<f32>(5).unwrap());
    let mut rec = g.recorder();
    let err =
        lora::execute_lora_forward(&mut rec, &x, &a, &b, 2, 1.0, &mut h, &mut y_short).unwrap_err();
    assert_eq!(
        err.to_string(),
        "kernel `lora_forward`, binding `y`: expected 6 elements ([tokens, out]), given 5 elements"
    );
    let x_ragged = g.zeros::<f32>(21).unwrap();
    let mut y = g.zeros::<f32>(6).unwrap();
    let err = lora::execute_lora_forward(&mut rec, &x_ragged, &a, &b, 2, 1.0, &mut h, &mut y)
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "kernel `lora_forward`, binding `x`: expected a whole number of rows of 10 (in), given 21 elements"
    );
    let err = lora::execute_lora_forward(&mut rec, &x, &a, &b, 3, 1.0, &mut h, &mut y).unwrap_err();
    assert_eq!(
        err.to_string(),
        "kernel `lora_forward`, binding `a`: expected a non-empty multiple of 3 elements (the rank), given 20 elements"
    );
    assert!(rec.is_empty());
    // The fused backward checks every buffer before it records any launch.
    let (dy, mut dh) = (g.zeros::<f32>(6).unwrap(), g.zeros::<f32>(4).unwrap());
    let mut scratch = g
        .zeros::<f32>(lora::lora_scratch_len(2, 10 + 3, 2))
        .unwrap();
    let (mut da, mut db, mut dx_short) = (
        g.zeros::<f32>(20).unwrap(),
        g.zeros::<f32>(6).unwrap(),
        g.zeros::<f32>(19).unwrap(),
    );
    let inputs = LoraBackward {
        x: &x,
        a: &a,
        b: &b,
        h: &h,
        dy: &dy,
    };
    let err = lora::execute_lora_backward(
        &mut rec,
        &inputs,
        2,
        1.0,
        &mut dh,
        &mut scratch,
        &mut da,
        &mut db,
        &mut dx_short,
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "kernel `lora_backward`, binding `dx`: expected 20 elements ([tokens, in]), given 19 elements"
    );
    assert!(rec.is_empty(), "nothing recorded before the error");
}

/// Each kernel's WGSL at a small key (its first line), the snapshot named by the key.
#[test]
fn wgsl_snapshots() {
    let names = [
        "lora_down_n64_r1_rank_minor",
        "lora_down_subgroups_n64_r2_rank_minor_lanes32",
        "lora_down_subgroups_n64_r2_rank_major_pair_lanes32",
        "lora_down_subgroups_n64_r2_rank_minor_pair_second48_lanes32",
        "lora_up_n64_r4_rank_major",
        "lora_weight_grad_partials_n64_second48_r2",
        "lora_weight_grad_partials_n6_r2",
        "lora_weight_grad_sum_n64_r2_rank_minor_four_parts",
        "lora_weight_grad_sum_n6_r2_rank_major",
    ];
    let kernels = lora::kernels().unwrap();
    for (name, k) in hesper_kernels::testing::named_by_key(&kernels, &names) {
        insta::assert_snapshot!(name, k.wgsl());
    }
}
