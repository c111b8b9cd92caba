//! RoPE on the GPU against the f64 reference; the backward against the forward's transpose.

use hesper_kernels::rope::{self, Positions, RopeTable, reference};
use hesper_kernels::testing::{Rng, assert_close, f64s, gpu};

#[test]
fn forward_and_backward_match_reference() {
    let g = gpu();
    // (tokens, heads, head_dim, seq_len, offset): batches of sequences, one decoded token far
    // into its sequence, and a head_dim whose half is not a power of two.
    let cases = [
        (8, 2, 8, 4, 0),
        (6, 3, 64, 3, 5),
        (1, 4, 128, 1, 300),
        (10, 1, 6, 10, 0),
        // Angles of thousands of radians (long contexts): formed in f32 they would be 5e-4 off.
        (3, 2, 64, 1, 8000),
        (4, 1, 16, 2, 1500),
        (2100, 1, 8, 2100, 0),
    ];
    for (seed, (t, heads, hd, seq_len, offset)) in cases.into_iter().enumerate() {
        let mut rng = Rng::new(seed as u64 + 3);
        let x = rng.vec(t * heads * hd, 1.0);
        let table = RopeTable::new(g, hd, 10_000.0, offset + seq_len).unwrap();
        let pos = Positions {
            seq_len: seq_len as u32,
            offset: offset as u32,
        };
        for backward in [false, true] {
            let mut xb = g.upload(&x).unwrap();
            let mut rec = g.recorder();
            rope::execute_rope(&mut rec, &mut xb, &table, heads, pos, backward).unwrap();
            rec.submit().unwrap();
            let want = reference::rope(&f64s(&x), (hd, 10_000.0), heads, seq_len, offset, backward);
            // The same tolerance at every position: the table's cos and sin are f64 rounded.
            assert_close(
                &format!("rope T={t} heads={heads} hd={hd} offset={offset} backward={backward}"),
                &xb.read(g).unwrap(),
                &want,
                1e-6,
                1e-6,
            );
        }
    }
}

/// Queries and keys rotated together (one launch where hd/2 is a multiple of 4, two where
/// not) against the reference for each: GQA's fewer key heads, a decoded token, both ways.
#[test]
fn queries_and_keys_together_match_reference() {
    let g = gpu();
    // (tokens, heads, kv_heads, head_dim, seq_len, offset)
    let cases = [
        (6, 3, 1, 64, 3, 0),
        (5, 2, 2, 8, 5, 2),
        (1, 4, 2, 128, 1, 300),
        (7, 3, 1, 12, 7, 0),
        (2100, 2, 1, 16, 700, 0),
    ];
    for (seed, (t, heads, kv_heads, hd, seq_len, offset)) in cases.into_iter().enumerate() {
        let mut rng = Rng::new(seed as u64 + 40);
        let (q, k) = (
            rng.vec(t * heads * hd, 1.0),
            rng.vec(t * kv_heads * hd, 1.0),
        );
        let table = RopeTable::new(g, hd, 10_000.0, offset + seq_len).unwrap();
        let pos = Positions {
            seq_len: seq_len as u32,
            offset: offset as u32,
        };
        for backward in [false, true] {
            let (mut qb, mut kb) = (g.upload(&q).unwrap(), g.upload(&k).unwrap());
            let mut rec = g.recorder();
            let heads_of = (heads, kv_heads);
            rope::execute_rope_qk(
                &mut rec,
                (&mut qb, &mut kb),
                &table,
                heads_of,
                pos,
                backward,
            )
            .unwrap();
            let launches = rec.len();
            rec.submit().unwrap();
            let want_launches = if (hd / 2) % 4 == 0 { 1 } else { 2 };
            assert_eq!(launches, want_launches, "hd {hd}");
            let rope_of = (hd, 10_000.0);
            for (what, got, x, n) in [("q", &qb, &q, heads), ("k", &kb, &k, kv_heads)] {
                let want = reference::rope(&f64s(x), rope_of, n, seq_len, offset, backward);
                assert_close(
                    &format!(
                        "rope_qk {what} T={t} heads={heads}/{kv_heads} hd={hd} backward={backward}"
                    ),
                    &got.read(g).unwrap(),
                    &want,
                    1e-6,
                    1e-6,
                );
            }
        }
    }
}

#[test]
fn queries_and_keys_of_different_tokens_are_an_error() {
    let g = gpu();
    let table = RopeTable::new(g, 8, 10_000.0, 4).unwrap();
    let (mut q, mut k) = (
        g.zeros::<f32>(3 * 16).unwrap(),
        g.zeros::<f32>(2 * 8).unwrap(),
    );
    let mut rec = g.recorder();
    let at = Positions {
        seq_len: 4,
        offset: 0,
    };
    let err = rope::execute_rope_qk(&mut rec, (&mut q, &mut k), &table, (2, 1), at, false)
        .unwrap_err()
        .to_string();
    assert_eq!(
        err,
        "kernel `rope_qk_vec4`: cannot dispatch q of 3 rows and k of 2 rows: the queries and keys \
         of the same tokens: as many rows each"
    );
    let err = rope::execute_rope_qk(&mut rec, (&mut q, &mut k), &table, (2, 3), at, false)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("binding `k`") && err.contains("3 × 8"),
        "{err}"
    );
    assert!(rec.is_empty(), "nothing recorded on an error");
}

/// The backward is the transpose of the forward: `<R·x, y> = <x, Rᵀ·y>` for every x, y.
#[test]
fn backward_reference_is_the_transpose_of_the_forward() {
    let mut rng = Rng::new(17);
    let (t, heads, hd) = (5, 2, 16);
    let rope_of = (hd, 500_000.0);
    let (x, y) = (
        f64s(&rng.vec(t * heads * hd, 1.0)),
        f64s(&rng.vec(t * heads * hd, 1.0)),
    );
    let rx = reference::rope(&x, rope_of, heads, t, 3, false);
    let rty = reference::rope(&y, rope_of, heads, t, 3, true);
    let lhs: f64 = rx.iter().zip(&y).map(|(a, b)| a * b).sum();
    let rhs: f64 = x.iter().zip(&rty).map(|(a, b)| a * b).sum();
    assert!(
        (lhs - rhs).abs() < 1e-12 * lhs.abs().max(1.0),
        "{lhs} vs {rhs}"
    );
    // And it undoes the forward (rotations are orthogonal).
    let back = reference::rope(&rx, rope_of, heads, t, 3, true);
    assert!(back.iter().zip(&x).all(|(a, b)| (a - b).abs() < 1e-12));
}

#[test]
fn position_is_a_runtime_value() {
    // Its own device: other tests compiling on the shared one would move the miss counter.
    let g = &hesper_exec::Gpu::new().unwrap();
    let table = RopeTable::new(g, 8, 10_000.0, 20).unwrap();
    let mut x = g.upload(&[1.0f32; 8]).unwrap();
    let before = g.cache_stats().misses;
    let mut rec = g.recorder();
    for pos in 0..20 {
        let p = Positions {
            seq_len: 1,
            offset: pos,
        };
        rope::execute_rope_forward(&mut rec, &mut x, &table, 1, p).unwrap();
    }
    rec.submit().unwrap();
    assert!(
        g.cache_stats().misses - before <= 1,
        "one pipeline for every position"
    );
}

#[test]
fn bad_shapes_name_kernel_and_buffer() {
    let g = gpu();
    let table = RopeTable::new(g, 8, 10_000.0, 4).unwrap();
    let mut x = g.zeros::<f32>(12).unwrap();
    let mut rec = g.recorder();
    let err = rope::execute_rope_forward(
        &mut rec,
        &mut x,
        &table,
        1,
        Positions {
            seq_len: 1,
            offset: 0,
        },
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "kernel `rope`, binding `x`: expected a whole number of rows of 8 (heads × head_dim = 1 × 8), given 12 elements"
    );
    // Positions past the table, and an odd head dimension.
    let mut x = g.zeros::<f32>(16).unwrap();
    let at = Positions {
        seq_len: 2,
        offset: 3,
    };
    let err = rope::execute_rope_forward(&mut rec, &mut x, &table, 1, at).unwrap_err();
    assert!(
        err.to_string().contains("positions up to 4") && err.to_string().contains("below 4"),
        "{err}"
    );
    let err = RopeTable::new(g, 5, 10_000.0, 4).err().unwrap().to_string();
    assert!(
        err.contains("head_dim = 5") && err.contains("even"),
        "{err}"
    );
    assert!(rec.is_empty(), "nothing recorded on an error");
}

/// Each kernel's WGSL at a small key (its first line), the snapshot named by the key.
#[test]
fn wgsl_snapshots() {
    let names = [
        "rope_half64_forward",
        "rope_half64_backward",
        "rope_vec4_half32_forward",
        "rope_vec4_half32_backward",
        "rope_qk_vec4_half32_forward",
        "rope_qk_vec4_half32_backward",
    ];
    let kernels = rope::kernels().unwrap();
    for (name, k) in hesper_kernels::testing::named_by_key(&kernels, &names) {
        insta::assert_snapshot!(name, k.wgsl());
    }
}
