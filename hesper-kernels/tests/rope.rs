//! RoPE on the GPU against the f64 reference; the backward against the forward's transpose.

use hesper_kernels::rope::{self, Positions, reference};
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
        // Angles of thousands of radians (long contexts), which sin/cos are reduced from.
        (3, 2, 64, 1, 8000),
    ];
    for (seed, (t, heads, hd, seq_len, offset)) in cases.into_iter().enumerate() {
        let mut rng = Rng::new(seed as u64 + 3);
        let x = rng.vec(t * heads * hd, 1.0);
        let inv = rope::inverse_frequencies(hd, 10_000.0);
        let ib = g.upload(&inv).unwrap();
        let pos = Positions {
            seq_len: seq_len as u32,
            offset: offset as u32,
        };
        for backward in [false, true] {
            let mut xb = g.upload(&x).unwrap();
            let mut rec = g.recorder();
            rope::execute_rope(&mut rec, &mut xb, &ib, heads, pos, backward).unwrap();
            rec.submit().unwrap();
            let want = reference::rope(&f64s(&x), &inv, heads, seq_len, offset, backward);
            // The angle is formed in f32: |θ|·6e-8 absolute error, θ up to the last position.
            let theta_max = (offset + seq_len) as f64;
            let atol = 1e-6 + theta_max * 1.2e-7;
            assert_close(
                &format!("rope T={t} heads={heads} hd={hd} backward={backward}"),
                &xb.read(g).unwrap(),
                &want,
                1e-6,
                atol,
            );
        }
    }
}

/// The backward is the transpose of the forward: `<R·x, y> = <x, Rᵀ·y>` for every x, y.
#[test]
fn backward_reference_is_the_transpose_of_the_forward() {
    let mut rng = Rng::new(17);
    let (t, heads, hd) = (5, 2, 16);
    let inv = rope::inverse_frequencies(hd, 500_000.0);
    let (x, y) = (
        f64s(&rng.vec(t * heads * hd, 1.0)),
        f64s(&rng.vec(t * heads * hd, 1.0)),
    );
    let rx = reference::rope(&x, &inv, heads, t, 3, false);
    let rty = reference::rope(&y, &inv, heads, t, 3, true);
    let lhs: f64 = rx.iter().zip(&y).map(|(a, b)| a * b).sum();
    let rhs: f64 = x.iter().zip(&rty).map(|(a, b)| a * b).sum();
    assert!(
        (lhs - rhs).abs() < 1e-12 * lhs.abs().max(1.0),
        "{lhs} vs {rhs}"
    );
    // And it undoes the forward (rotations are orthogonal).
    let back = reference::rope(&rx, &inv, heads, t, 3, true);
    assert!(back.iter().zip(&x).all(|(a, b)| (a - b).abs() < 1e-12));
}

#[test]
fn position_is_a_runtime_value() {
    // Its own device: other tests compiling on the shared one would move the miss counter.
    let g = &hesper_exec::Gpu::new().unwrap();
    let inv = g.upload(&rope::inverse_frequencies(8, 10_000.0)).unwrap();
    let mut x = g.upload(&[1.0f32; 8]).unwrap();
    let before = g.cache_stats().misses;
    let mut rec = g.recorder();
    for pos in 0..20 {
        let p = Positions {
            seq_len: 1,
            offset: pos,
        };
        rope::execute_rope_forward(&mut rec, &mut x, &inv, 1, p).unwrap();
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
    let inv = g.upload(&rope::inverse_frequencies(8, 10_000.0)).unwrap();
    let mut x = g.zeros::<f32>(12).unwrap();
    let mut rec = g.recorder();
    let err = rope::execute_rope_forward(
        &mut rec,
        &mut x,
        &inv,
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
}

/// Each kernel's WGSL at a small key (its first line), the snapshot named by the key.
#[test]
fn wgsl_snapshots() {
    let names = ["rope_half64_forward", "rope_half64_backward"];
    let kernels = rope::kernels().unwrap();
    for (name, k) in hesper_kernels::testing::named_by_key(&kernels, &names) {
        insta::assert_snapshot!(name, k.wgsl());
    }
}
