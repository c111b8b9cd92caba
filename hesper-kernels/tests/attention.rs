//! One decoded token's attention (the cache append, the forward, the backward) and the softmax
//! backward on the GPU against f64 references; the references against finite differences.

use hesper_exec::Gpu;
use hesper_kernels::attention::{self, DecodeGrads, DecodeInputs, DecodeShape, reference};
use hesper_kernels::rope::{self, reference as rope_ref};
use hesper_kernels::testing::{
    Rng, assert_close, check_gradient, f64s, f64s_nan_as_zero, gpu, gpu_without_subgroups,
};

#[test]
fn softmax_backward_matches_reference() {
    softmax_backward_matches_reference_on(gpu());
}

/// The paths for devices without subgroups, on this one.
#[test]
fn softmax_backward_matches_reference_without_subgroups() {
    softmax_backward_matches_reference_on(gpu_without_subgroups());
}

fn softmax_backward_matches_reference_on(g: &Gpu) {
    for (seed, (rows, cols)) in [(1, 1), (3, 7), (20, 512), (5, 1000)]
        .into_iter()
        .enumerate()
    {
        let mut rng = Rng::new(seed as u64 + 40);
        // Rows of real probabilities.
        let mut p = rng.vec(rows * cols, 3.0);
        for row in p.chunks_mut(cols) {
            let m = row.iter().cloned().fold(f32::MIN, f32::max);
            let z: f32 = row.iter().map(|v| (v - m).exp()).sum();
            row.iter_mut().for_each(|v| *v = (*v - m).exp() / z);
        }
        let dp = rng.vec(rows * cols, 1.0);
        let (pb, dpb) = (g.upload(&p).unwrap(), g.upload(&dp).unwrap());
        let mut ds = g.filled(rows * cols, f32::NAN).unwrap();
        let mut rec = g.recorder();
        attention::execute_softmax_backward(&mut rec, &pb, &dpb, cols, &mut ds).unwrap();
        rec.submit().unwrap();
        let want = reference::softmax_backward(&f64s(&p), &f64s(&dp), cols);
        assert_close(
            &format!("softmax_backward {rows}x{cols}"),
            &ds.read(g).unwrap(),
            &want,
            1e-5,
            1e-7,
        );
    }
}

#[test]
fn softmax_backward_reference_matches_finite_differences() {
    let mut rng = Rng::new(4);
    let (rows, cols) = (2, 6);
    let (z, dp) = (
        f64s(&rng.vec(rows * cols, 2.0)),
        f64s(&rng.vec(rows * cols, 1.0)),
    );
    let softmax = |z: &[f64]| -> Vec<f64> {
        z.chunks(cols)
            .flat_map(|r| {
                let m = r.iter().cloned().fold(f64::MIN, f64::max);
                let s: f64 = r.iter().map(|v| (v - m).exp()).sum();
                r.iter().map(move |v| (v - m).exp() / s).collect::<Vec<_>>()
            })
            .collect()
    };
    let ds = reference::softmax_backward(&softmax(&z), &dp, cols);
    check_gradient("dz", &z, &ds, z.len(), |z| {
        softmax(z).iter().zip(&dp).map(|(a, b)| a * b).sum()
    });
}

/// Caches with rows past `L` set to NaN: a kernel that reads past the cached positions, or uses
/// stride `L` for `max_seq` (Hesper), shows up.
fn cache(rng: &mut Rng, shape: &DecodeShape) -> Vec<f32> {
    let mut c = rng.vec(shape.kv_heads * shape.max_seq * shape.head_dim, 1.0);
    for kv in 0..shape.kv_heads {
        for s in shape.pos + 1..shape.max_seq {
            let at = (kv * shape.max_seq + s) * shape.head_dim;
            c[at..at + shape.head_dim].fill(f32::NAN);
        }
    }
    c
}

#[test]
fn decode_attention_backward_matches_reference() {
    let g = gpu();
    let shapes = [
        DecodeShape {
            heads: 4,
            kv_heads: 2,
            head_dim: 8,
            max_seq: 16,
            pos: 0,
        },
        DecodeShape {
            heads: 4,
            kv_heads: 2,
            head_dim: 8,
            max_seq: 16,
            pos: 9,
        },
        DecodeShape {
            heads: 3,
            kv_heads: 1,
            head_dim: 64,
            max_seq: 40,
            pos: 33,
        },
        DecodeShape {
            heads: 2,
            kv_heads: 2,
            head_dim: 128,
            max_seq: 300,
            pos: 299,
        },
    ];
    for (seed, shape) in shapes.into_iter().enumerate() {
        let mut rng = Rng::new(seed as u64 + 60);
        let (h, hd, len) = (shape.heads, shape.head_dim, shape.pos + 1);
        let q = rng.vec(h * hd, 1.0);
        let (k_cache, v_cache) = (cache(&mut rng, &shape), cache(&mut rng, &shape));
        let d_out = rng.vec(h * hd, 1.0);
        let a: Vec<f32> = reference::decode_probs(&shape, &f64s(&q), &f64s(&k_cache))
            .iter()
            .map(|v| *v as f32)
            .collect();
        let table = rope::RopeTable::new(g, hd, 10_000.0, shape.max_seq).unwrap();
        let cache_len = k_cache.len();
        let (dk0, dv0) = (rng.vec(cache_len, 1.0), rng.vec(cache_len, 1.0));

        let up = |v: &[f32]| g.upload(v).unwrap();
        let (qb, ab, dob, kb, vb) = (up(&q), up(&a), up(&d_out), up(&k_cache), up(&v_cache));
        let mut d_attn = g.filled(h * len, f32::NAN).unwrap();
        let mut d_scores = g.filled(h * len, f32::NAN).unwrap();
        let mut d_q = g.filled(h * hd, f32::NAN).unwrap();
        let (mut dk, mut dv) = (up(&dk0), up(&dv0));
        let mut rec = g.recorder();
        let inputs = DecodeInputs {
            q: &qb,
            attn: &ab,
            d_out: &dob,
            k_cache: &kb,
            v_cache: &vb,
            rope: &table,
        };
        let grads = DecodeGrads {
            d_attn: &mut d_attn,
            d_scores: &mut d_scores,
            d_q: &mut d_q,
            d_k_cache: &mut dk,
            d_v_cache: &mut dv,
        };
        attention::execute_decode_attention_backward(&mut rec, shape, &inputs, grads).unwrap();
        rec.submit().unwrap();

        // The reference takes the A the kernel was given (f32-rounded) through its own math.
        let (want_dq, want_dk, want_dv) = reference::decode_backward(
            &shape,
            &f64s(&q),
            &f64s_nan_as_zero(&k_cache),
            &f64s_nan_as_zero(&v_cache),
            &f64s(&d_out),
        );
        let want_dq = rope_ref::rope(&want_dq, (hd, 10_000.0), h, 1, shape.pos, true);
        let what = format!("{shape:?}");
        assert_close(
            &format!("dQ {what}"),
            &d_q.read(g).unwrap(),
            &want_dq,
            1e-4,
            1e-5,
        );
        let plus = |base: &[f32], add: &[f64]| -> Vec<f64> {
            base.iter().zip(add).map(|(b, a)| *b as f64 + a).collect()
        };
        assert_close(
            &format!("dK {what}"),
            &dk.read(g).unwrap(),
            &plus(&dk0, &want_dk),
            1e-4,
            1e-5,
        );
        assert_close(
            &format!("dV {what}"),
            &dv.read(g).unwrap(),
            &plus(&dv0, &want_dv),
            1e-4,
            1e-5,
        );
    }
}

/// The token's keys and values land in row `pos` of each KV head, stride `max_seq`; the other
/// rows keep what they held.
#[test]
fn kv_cache_append_writes_one_row() {
    let g = gpu();
    let shape = DecodeShape {
        heads: 6,
        kv_heads: 3,
        head_dim: 12,
        max_seq: 9,
        pos: 4,
    };
    let mut rng = Rng::new(70);
    let cache = shape.kv_heads * shape.max_seq * shape.head_dim;
    let (k0, v0) = (rng.vec(cache, 1.0), rng.vec(cache, 1.0));
    let row = shape.kv_heads * shape.head_dim;
    let (k_new, v_new) = (rng.vec(row, 1.0), rng.vec(row, 1.0));
    let (mut kc, mut vc) = (g.upload(&k0).unwrap(), g.upload(&v0).unwrap());
    let (kn, vn) = (g.upload(&k_new).unwrap(), g.upload(&v_new).unwrap());
    let mut rec = g.recorder();
    attention::execute_kv_cache_append(&mut rec, shape, (&kn, &vn), &mut kc, &mut vc).unwrap();
    rec.submit().unwrap();
    let expect = |old: &[f32], new: &[f32]| -> Vec<f64> {
        let mut c = f64s(old);
        for kv in 0..shape.kv_heads {
            let at = (kv * shape.max_seq + shape.pos) * shape.head_dim;
            for d in 0..shape.head_dim {
                c[at + d] = new[kv * shape.head_dim + d] as f64;
            }
        }
        c
    };
    assert_close(
        "k_cache",
        &kc.read(g).unwrap(),
        &expect(&k0, &k_new),
        0.0,
        0.0,
    );
    assert_close(
        "v_cache",
        &vc.read(g).unwrap(),
        &expect(&v0, &v_new),
        0.0,
        0.0,
    );
}

/// The decode forward's probabilities and output against the reference, over caches whose rows
/// past the cached positions are NaN; a token appended then attended at each position of a
/// short generation matches the reference at every step.
#[test]
fn decode_attention_matches_reference() {
    let g = gpu();
    let shapes = [
        (1, 1, 4, 4, 0),
        (4, 2, 8, 16, 9),
        (9, 3, 64, 40, 33),
        (2, 2, 128, 300, 299),
        (3, 1, 12, 700, 600),
    ];
    for (seed, (heads, kv_heads, head_dim, max_seq, pos)) in shapes.into_iter().enumerate() {
        let shape = DecodeShape {
            heads,
            kv_heads,
            head_dim,
            max_seq,
            pos,
        };
        let mut rng = Rng::new(seed as u64 + 80);
        let q = rng.vec(heads * head_dim, 1.5);
        let (k_cache, v_cache) = (cache(&mut rng, &shape), cache(&mut rng, &shape));
        let (qb, kb, vb) = (
            g.upload(&q).unwrap(),
            g.upload(&k_cache).unwrap(),
            g.upload(&v_cache).unwrap(),
        );
        let mut attn = g.filled(heads * (pos + 1), f32::NAN).unwrap();
        let mut o = g.filled(heads * head_dim, f32::NAN).unwrap();
        let mut rec = g.recorder();
        attention::execute_decode_attention(&mut rec, shape, &qb, (&kb, &vb), &mut attn, &mut o)
            .unwrap();
        rec.submit().unwrap();
        let want_a = reference::decode_probs(&shape, &f64s(&q), &f64s_nan_as_zero(&k_cache));
        let want_o = reference::decode_out(&shape, &want_a, &f64s_nan_as_zero(&v_cache));
        let what = format!("{shape:?}");
        assert_close(
            &format!("A {what}"),
            &attn.read(g).unwrap(),
            &want_a,
            1e-4,
            1e-6,
        );
        assert_close(
            &format!("O {what}"),
            &o.read(g).unwrap(),
            &want_o,
            1e-4,
            1e-5,
        );
    }
}

/// Generation: each step appends its token and attends over everything cached so far.
#[test]
fn decode_steps_append_then_attend() {
    let g = gpu();
    let (heads, kv_heads, head_dim, max_seq) = (4, 2, 8, 6);
    let mut rng = Rng::new(90);
    let cache = kv_heads * max_seq * head_dim;
    let (mut kc, mut vc) = (
        g.zeros::<f32>(cache).unwrap(),
        g.zeros::<f32>(cache).unwrap(),
    );
    let (mut k_host, mut v_host) = (vec![0.0f64; cache], vec![0.0f64; cache]);
    for pos in 0..5 {
        let shape = DecodeShape {
            heads,
            kv_heads,
            head_dim,
            max_seq,
            pos,
        };
        let q = rng.vec(heads * head_dim, 1.5);
        let (k_new, v_new) = (
            rng.vec(kv_heads * head_dim, 1.5),
            rng.vec(kv_heads * head_dim, 1.0),
        );
        for kv in 0..kv_heads {
            for d in 0..head_dim {
                let at = (kv * max_seq + pos) * head_dim + d;
                k_host[at] = k_new[kv * head_dim + d] as f64;
                v_host[at] = v_new[kv * head_dim + d] as f64;
            }
        }
        let (qb, kn, vn) = (
            g.upload(&q).unwrap(),
            g.upload(&k_new).unwrap(),
            g.upload(&v_new).unwrap(),
        );
        let mut attn = g.filled(heads * (pos + 1), f32::NAN).unwrap();
        let mut o = g.filled(heads * head_dim, f32::NAN).unwrap();
        let mut rec = g.recorder();
        attention::execute_kv_cache_append(&mut rec, shape, (&kn, &vn), &mut kc, &mut vc).unwrap();
        attention::execute_decode_attention(&mut rec, shape, &qb, (&kc, &vc), &mut attn, &mut o)
            .unwrap();
        rec.submit().unwrap();
        let a = reference::decode_probs(&shape, &f64s(&q), &k_host);
        let want = reference::decode_out(&shape, &a, &v_host);
        assert_close(
            &format!("O at {pos}"),
            &o.read(g).unwrap(),
            &want,
            1e-4,
            1e-5,
        );
    }
}

/// `Σ dO ⊙ O` differentiated by finite differences w.r.t. q, the cached keys and values.
#[test]
fn decode_attention_reference_matches_finite_differences() {
    let shape = DecodeShape {
        heads: 4,
        kv_heads: 2,
        head_dim: 4,
        max_seq: 6,
        pos: 3,
    };
    let mut rng = Rng::new(8);
    let n = shape.kv_heads * shape.max_seq * shape.head_dim;
    let (q, k, v, d_out) = (
        f64s(&rng.vec(16, 1.0)),
        f64s(&rng.vec(n, 1.0)),
        f64s(&rng.vec(n, 1.0)),
        f64s(&rng.vec(16, 1.0)),
    );
    let loss = |q: &[f64], k: &[f64], v: &[f64]| {
        let a = reference::decode_probs(&shape, q, k);
        reference::decode_out(&shape, &a, v)
            .iter()
            .zip(&d_out)
            .map(|(o, d)| o * d)
            .sum::<f64>()
    };
    let (dq, dk, dv) = reference::decode_backward(&shape, &q, &k, &v, &d_out);
    check_gradient("dQ", &q, &dq, q.len(), |q| loss(q, &k, &v));
    check_gradient("dK", &k, &dk, k.len(), |k| loss(&q, k, &v));
    check_gradient("dV", &v, &dv, v.len(), |v| loss(&q, &k, v));
}

#[test]
fn bad_shapes_are_errors() {
    let g = gpu();
    let shape = DecodeShape {
        heads: 3,
        kv_heads: 2,
        head_dim: 4,
        max_seq: 4,
        pos: 1,
    };
    let b = g.zeros::<f32>(16).unwrap();
    let mut out = g.zeros::<f32>(6).unwrap();
    let mut rec = g.recorder();
    let err = attention::execute_apply_backward(&mut rec, shape, &b, &b, &mut out).unwrap_err();
    assert!(
        err.to_string()
            .contains("heads must be a positive multiple of kv_heads"),
        "{err}"
    );
    let shape = DecodeShape {
        heads: 2,
        kv_heads: 1,
        head_dim: 4,
        max_seq: 4,
        pos: 1,
    };
    let err = attention::execute_apply_backward(&mut rec, shape, &b, &b, &mut out).unwrap_err();
    assert_eq!(
        err.to_string(),
        "kernel `apply_backward`, binding `d_out`: expected 8 elements ([heads, head_dim]), given 16 elements"
    );
}

/// Each kernel's WGSL at a small key (its first line), the snapshot named by the key.
#[test]
fn wgsl_snapshots() {
    let names = [
        "kv_cache_append_hd128",
        "decode_attention_hd128_group4_tau0.088388346_subgroups",
        "softmax_backward_lanes4_subgroups",
        "apply_backward_hd128_group4",
        "score_backward_q_hd128_group4",
        "cache_backward_hd128_group4",
        "attention_forward_hd64_heads9_kv_heads3_block64_bk16_vk32_padded",
        "attention_backward_stats_hd64_heads9_padded_lanes1",
        "attention_backward_stats_hd64_heads9_padded_lanes16",
        "attention_backward_kv_hd64_heads9_kv_heads3_block64_bk16_vk32_padded",
        "attention_backward_q_hd64_heads9_kv_heads3_block64_bk16_vk32_padded",
        "coop_attention_forward_hd64_heads9_kv_heads3_row_tiles2_step32_padded",
        "coop_attention_backward_kv_hd64_heads9_kv_heads3_row_tiles2_step32_padded",
        "coop_attention_backward_q_hd64_heads9_kv_heads3_row_tiles2_step32_padded",
        "coop_attention_backward_kv_hd64_heads9_kv_heads3_row_tiles2_step32_padded_writes_scores",
        "coop_attention_backward_q_from_scores_hd64_heads9_kv_heads3_row_tiles2_step32_padded",
        "coop_attention_backward_kv_hd64_heads9_kv_heads3_row_tiles2_step32_split2_padded_writes_scores",
        "coop_attention_forward_hd64_heads9_kv_heads3_row_tiles2_step32_split2_padded",
    ];
    let kernels = attention::kernels().unwrap();
    for (name, k) in hesper_kernels::testing::named_by_key(&kernels, &names) {
        insta::assert_snapshot!(name, k.wgsl());
    }
}

/// Shapes whose element counts overflow are errors, not a panic (debug) or a wrapped length
/// (release).
#[test]
fn shapes_that_overflow_are_errors() {
    let g = gpu();
    let b = g.zeros::<f32>(8).unwrap();
    let mut out = g.zeros::<f32>(8).unwrap();
    let mut rec = g.recorder();
    for shape in [
        DecodeShape {
            heads: 1 << 62,
            kv_heads: 1 << 61,
            head_dim: 8,
            max_seq: 4,
            pos: 1,
        },
        DecodeShape {
            heads: 2,
            kv_heads: 1,
            head_dim: 1 << 40,
            max_seq: 1 << 40,
            pos: 1,
        },
    ] {
        let err = attention::execute_apply_backward(&mut rec, shape, &b, &b, &mut out)
            .unwrap_err()
            .to_string();
        assert!(err.contains("must fit the kernels' u32 indices"), "{err}");
    }
    assert!(rec.is_empty());
}

/// On a device that cuts loops off (lavapipe: 65 535 iterations an invocation), a decode whose
/// loops would pass that is an error, not silently wrong numbers. The forward's count is
/// `⌈L/256⌉·(hd + 3) + L/groups`: at hd = 128, 64 200 positions are right and 64 400 are refused
/// (at 65 535 its `O` was 16% off when only `L` was checked); the backward's `dQ` loops over
/// every position, so 65 536 positions are refused even at hd = 4.
#[test]
fn decode_past_the_device_loop_limit_is_an_error() {
    let g = gpu();
    let Some(max) = g.max_loop_iterations() else {
        println!("skipped: {} has no known loop limit", g.describe());
        return;
    };
    assert_eq!(max, 65_535, "the lengths below are lavapipe's");
    let hd = 128;
    for (len, fits) in [(64_200, true), (64_400, false)] {
        let shape = DecodeShape {
            heads: 1,
            kv_heads: 1,
            head_dim: hd,
            max_seq: len,
            pos: len - 1,
        };
        let mut rng = Rng::new(len as u64);
        let (q, k_cache, v_cache) = (
            rng.vec(hd, 0.3),
            rng.vec(len * hd, 0.3),
            rng.vec(len * hd, 1.0),
        );
        let (qb, kb, vb) = (
            g.upload(&q).unwrap(),
            g.upload(&k_cache).unwrap(),
            g.upload(&v_cache).unwrap(),
        );
        let (mut attn, mut o) = (
            g.filled(len, f32::NAN).unwrap(),
            g.filled(hd, f32::NAN).unwrap(),
        );
        let mut rec = g.recorder();
        let result = attention::execute_decode_attention(
            &mut rec,
            shape,
            &qb,
            (&kb, &vb),
            &mut attn,
            &mut o,
        );
        if !fits {
            let err = result.unwrap_err().to_string();
            assert!(err.contains("stops loops after 65535 iterations"), "{err}");
            assert!(rec.is_empty());
            continue;
        }
        result.unwrap();
        rec.submit().unwrap();
        let a = reference::decode_probs(&shape, &f64s(&q), &f64s(&k_cache));
        let want = reference::decode_out(&shape, &a, &f64s(&v_cache));
        assert_close(
            "O at 64 200 positions",
            &o.read(g).unwrap(),
            &want,
            1e-3,
            1e-5,
        );
    }

    let shape = DecodeShape {
        heads: 1,
        kv_heads: 1,
        head_dim: 4,
        max_seq: max as usize + 2,
        pos: max as usize,
    };
    let len = shape.pos + 1;
    let cache = g.zeros::<f32>(shape.max_seq * 4).unwrap();
    let (q, d_out) = (g.zeros::<f32>(4).unwrap(), g.zeros::<f32>(4).unwrap());
    let attn = g.zeros::<f32>(len).unwrap();
    let (mut d_attn, mut d_scores) = (g.zeros::<f32>(len).unwrap(), g.zeros::<f32>(len).unwrap());
    let mut d_q = g.zeros::<f32>(4).unwrap();
    let (mut dk, mut dv) = (
        g.zeros::<f32>(shape.max_seq * 4).unwrap(),
        g.zeros::<f32>(shape.max_seq * 4).unwrap(),
    );
    let table = rope::RopeTable::new(g, 4, 10_000.0, shape.max_seq).unwrap();
    let inputs = DecodeInputs {
        q: &q,
        attn: &attn,
        d_out: &d_out,
        k_cache: &cache,
        v_cache: &cache,
        rope: &table,
    };
    let grads = DecodeGrads {
        d_attn: &mut d_attn,
        d_scores: &mut d_scores,
        d_q: &mut d_q,
        d_k_cache: &mut dk,
        d_v_cache: &mut dv,
    };
    let mut rec = g.recorder();
    let err = attention::execute_decode_attention_backward(&mut rec, shape, &inputs, grads)
        .unwrap_err()
        .to_string();
    assert!(err.contains("stops loops after 65535 iterations"), "{err}");
    assert!(rec.is_empty());
}
