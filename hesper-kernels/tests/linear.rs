//! The linear GEMMs (dense and ternary, `·Wᵀ` and `·W`, every tile) on the GPU against the f64
//! reference, the backward references against finite differences, ternary packing, shape errors
//! and snapshots.

use hesper_kernels::linear::{self, Gemm, Product, Tile, Weights, reference};
use hesper_kernels::testing::{Rng, assert_close, check_gradient, f64s, gpu};

/// (m, n, k): tiny; no dimension a multiple of anything; widths that are multiples of 4 (rows
/// as vec4s) with partial depth steps and one row in the last row of tiles; a moderate size
/// whose depths fill every step.
const SHAPES: [(usize, usize, usize); 4] =
    [(1, 1, 1), (37, 53, 29), (65, 100, 44), (256, 192, 320)];
/// The three standard tiles, and a rectangular one whose invocations load two vec4s of `B` a step.
const TILES: [Tile; 4] = [
    Tile::SMALL,
    Tile::MEDIUM,
    Tile::LARGE,
    Tile {
        bm: 64,
        bn: 128,
        bk: 16,
        tm: 4,
        tn: 8,
    },
];
const PRODUCTS: [Product; 2] = [Product::Nt, Product::Nn];
/// Not a power of two, so that a kernel that drops it cannot pass by luck.
const SCALE: f32 = 0.37;

/// f32 dot products of length `depth` over values in [-1, 1): relative error ~1e-6, and an
/// absolute error that grows like √depth for sums that cancel to near zero.
fn tolerance(depth: usize) -> (f64, f64) {
    (1e-5, 1e-5 * (depth.max(1) as f64).sqrt())
}

fn random_ternary(rng: &mut Rng, len: usize) -> Vec<i8> {
    (0..len).map(|_| (rng.next_u32() % 3) as i8 - 1).collect()
}

/// `(input length, output length, depth)` of a product.
fn dims(product: Product, (m, n, k): (usize, usize, usize)) -> (usize, usize, usize) {
    match product {
        Product::Nt => (m * k, m * n, k),
        Product::Nn => (m * n, m * k, n),
    }
}

fn reference_product(
    product: Product,
    input: &[f64],
    w: &[f64],
    (m, n, k): (usize, usize, usize),
) -> Vec<f64> {
    match product {
        Product::Nt => reference::matmul_nt(input, w, m, n, k),
        Product::Nn => reference::matmul_nn(input, w, m, n, k),
    }
}

/// Run one GEMM on the GPU (output poisoned with NaN, or random when accumulating) and compare
/// it with the reference.
fn check(gemm: &Gemm, ternary: bool, seed: u64) {
    let g = gpu();
    let mut rng = Rng::new(seed);
    let shape = (gemm.m, gemm.n, gemm.k);
    let (in_len, out_len, depth) = dims(gemm.product, shape);
    let input = rng.vec(in_len, 1.0);
    let start = if gemm.accumulate {
        rng.vec(out_len, 1.0)
    } else {
        vec![f32::NAN; out_len]
    };
    let input_buf = g.upload(&input).unwrap();
    let mut output = g.upload(&start).unwrap();
    let mut rec = g.recorder();
    let w64 = if ternary {
        let t = random_ternary(&mut rng, gemm.n * gemm.k);
        let packed = g.upload(&linear::pack_ternary(&t).unwrap()).unwrap();
        let weights = Weights::Ternary {
            packed: &packed,
            scale: SCALE,
        };
        linear::execute_gemm(&mut rec, gemm, &input_buf, weights, &mut output).unwrap();
        rec.submit().unwrap();
        reference::dequantize(&t, SCALE as f64)
    } else {
        let w = rng.vec(gemm.n * gemm.k, 1.0);
        let w_buf = g.upload(&w).unwrap();
        linear::execute_gemm(
            &mut rec,
            gemm,
            &input_buf,
            Weights::Dense(&w_buf),
            &mut output,
        )
        .unwrap();
        rec.submit().unwrap();
        f64s(&w)
    };
    let mut want = reference_product(gemm.product, &f64s(&input), &w64, shape);
    if gemm.accumulate {
        want.iter_mut()
            .zip(&start)
            .for_each(|(w, s)| *w += *s as f64);
    }
    let (rtol, atol) = tolerance(depth);
    let what = format!("{gemm:?} ternary={ternary}");
    assert_close(&what, &output.read(g).unwrap(), &want, rtol, atol);
}

/// Every shape through both products and every tile; each (product, tile) overwrites for two
/// shapes and accumulates for the other two.
fn check_all(ternary: bool) {
    for (i, &(m, n, k)) in SHAPES.iter().enumerate() {
        for (p, &product) in PRODUCTS.iter().enumerate() {
            for (t, &tile) in TILES.iter().enumerate() {
                let gemm = Gemm {
                    tile,
                    ..Gemm::new(product, (m, n, k), (i + t) % 2 == 1)
                };
                check(&gemm, ternary, (i * 6 + p * 3 + t) as u64 + 1);
            }
        }
    }
}

#[test]
fn dense_products_match_reference() {
    check_all(false);
}

/// `gemv_lora` against `x·Wᵀ + s·(x·Aᵀ)·Bᵀ` in f64: depths that are and are not multiples of
/// 4, ranks from 1 to the largest, a 2-D grid, every row count up to the limit; the output
/// poisoned (or random, accumulating) first. Then the checks of its arguments.
#[test]
fn gemv_lora_matches_reference() {
    use hesper_kernels::linear::gemv::{Adapter, MAX_RANK, execute_gemv_lora};
    use hesper_kernels::lora::reference::lora_forward;
    let g = gpu();
    let shapes = [
        (1, 53, 29, 3),
        (2, 100, 44, 8),
        (4, 19, 576, 16),
        (1, 70_001, 8, 1),
        (3, 37, 1537, MAX_RANK),
    ];
    for (i, &(m, n, k, rank)) in shapes.iter().enumerate() {
        for accumulate in [false, true] {
            let mut rng = Rng::new(200 + 2 * i as u64 + accumulate as u64);
            let (x, w) = (rng.vec(m * k, 1.0), rng.vec(n * k, 1.0));
            let (a, b) = (rng.vec(rank * k, 1.0), rng.vec(n * rank, 1.0));
            let start = if accumulate {
                rng.vec(m * n, 1.0)
            } else {
                vec![f32::NAN; m * n]
            };
            let up = |v: &[f32]| g.upload(v).unwrap();
            let (xb, wb, ab, bb, mut y) = (up(&x), up(&w), up(&a), up(&b), up(&start));
            let adapter = Adapter {
                a: &ab,
                b: &bb,
                rank,
                scale: SCALE,
            };
            let mut rec = g.recorder();
            execute_gemv_lora(&mut rec, (&xb, &wb), adapter, &mut y, (m, n, k), accumulate)
                .unwrap();
            rec.submit().unwrap();
            let mut base = reference::matmul_nt(&f64s(&x), &f64s(&w), m, n, k);
            if accumulate {
                base.iter_mut()
                    .zip(&start)
                    .for_each(|(v, s)| *v += *s as f64);
            }
            let (_, want) =
                lora_forward(&f64s(&x), &f64s(&a), &f64s(&b), &base, rank, SCALE as f64);
            let (rtol, atol) = tolerance(k * (rank + 1));
            let what = format!("gemv_lora {m}×{n}×{k} r={rank} accumulate={accumulate}");
            assert_close(&what, &y.read(g).unwrap(), &want, rtol, atol);
        }
    }
    let buf = |n: usize| g.upload(&vec![0.5f32; n]).unwrap();
    let (x, w, a, b, mut y) = (buf(8), buf(24), buf(8), buf(3), buf(6));
    let mut rec = g.recorder();
    let adapter = |rank| Adapter {
        a: &a,
        b: &b,
        rank,
        scale: 1.0,
    };
    let err = |r: Result<(), hesper_exec::ExecError>| r.unwrap_err().to_string();
    let too_many = execute_gemv_lora(&mut rec, (&x, &w), adapter(1), &mut y, (5, 3, 8), false);
    assert!(err(too_many).contains("1 to 4 rows"));
    let no_rank = execute_gemv_lora(&mut rec, (&x, &w), adapter(0), &mut y, (1, 3, 8), false);
    assert!(err(no_rank).contains("a rank of 1 to 32"));
    assert_eq!(
        err(execute_gemv_lora(
            &mut rec,
            (&x, &w),
            adapter(1),
            &mut y,
            (2, 3, 4),
            false
        )),
        "kernel `gemv_lora`, binding `w`: expected 12 elements ([n, k]), given 24 elements"
    );
    assert_eq!(
        err(execute_gemv_lora(
            &mut rec,
            (&x, &w),
            adapter(2),
            &mut y,
            (1, 3, 8),
            false
        )),
        "kernel `gemv_lora`, binding `a`: expected 16 elements ([rank, k]), given 8 elements"
    );
    assert!(rec.is_empty());
}

/// `·Wᵀ` over at most `gemv::MAX_ROWS` rows goes to `gemv`: depths that are and are not
/// multiples of 4, one that needs several steps of the workgroup, more outputs than a
/// dimension of workgroups holds (a 2-D grid), and every row count up to the limit.
#[test]
fn few_rows_match_reference() {
    let shapes = [
        (1, 1, 1),
        (1, 53, 29),
        (2, 100, 44),
        (3, 37, 576),
        (4, 19, 1537),
        (1, 70_001, 8),
    ];
    assert_eq!(linear::gemv::MAX_ROWS, 4);
    for (i, &(m, n, k)) in shapes.iter().enumerate() {
        for accumulate in [false, true] {
            let gemm = Gemm::new(Product::Nt, (m, n, k), accumulate);
            check(&gemm, false, 100 + 2 * i as u64 + accumulate as u64);
        }
    }
}

#[test]
fn ternary_products_match_reference() {
    check_all(true);
}

/// The four named entry points, with the tile they pick, against the reference.
#[test]
fn entry_points_match_reference() {
    let g = gpu();
    let (m, n, k) = (70, 36, 52);
    let mut rng = Rng::new(99);
    let (x, dy, w) = (
        rng.vec(m * k, 1.0),
        rng.vec(m * n, 1.0),
        rng.vec(n * k, 1.0),
    );
    let t = random_ternary(&mut rng, n * k);
    let y0 = rng.vec(m * n, 1.0);
    let (xb, dyb, wb) = (
        g.upload(&x).unwrap(),
        g.upload(&dy).unwrap(),
        g.upload(&w).unwrap(),
    );
    let packed = g.upload(&linear::pack_ternary(&t).unwrap()).unwrap();
    let mut y = g.filled(m * n, f32::NAN).unwrap();
    let mut y_acc = g.upload(&y0).unwrap();
    let mut dx = g.filled(m * k, f32::NAN).unwrap();
    let mut y_bit = g.filled(m * n, f32::NAN).unwrap();
    let mut dx_bit = g.filled(m * k, f32::NAN).unwrap();
    let mut rec = g.recorder();
    linear::execute_matmul_nt(&mut rec, &xb, &wb, &mut y, m, n, k, false).unwrap();
    linear::execute_matmul_nt(&mut rec, &xb, &wb, &mut y_acc, m, n, k, true).unwrap();
    linear::execute_matmul_nn(&mut rec, &dyb, &wb, &mut dx, m, n, k, false).unwrap();
    linear::execute_bitlinear_forward(&mut rec, &xb, &packed, SCALE, &mut y_bit, m, n, k, false)
        .unwrap();
    linear::execute_bitlinear_transpose(
        &mut rec,
        &dyb,
        &packed,
        SCALE,
        &mut dx_bit,
        m,
        n,
        k,
        false,
    )
    .unwrap();
    rec.submit().unwrap();

    let (x64, dy64, w64) = (f64s(&x), f64s(&dy), f64s(&w));
    let dequantized = reference::dequantize(&t, SCALE as f64);
    let want_y = reference::matmul_nt(&x64, &w64, m, n, k);
    let want_y_acc: Vec<f64> = want_y.iter().zip(&y0).map(|(a, b)| a + *b as f64).collect();
    let (rtol, atol_k) = tolerance(k);
    let (_, atol_n) = tolerance(n);
    assert_close("matmul_nt", &y.read(g).unwrap(), &want_y, rtol, atol_k);
    assert_close(
        "matmul_nt +=",
        &y_acc.read(g).unwrap(),
        &want_y_acc,
        rtol,
        atol_k,
    );
    let want_dx = reference::matmul_nn(&dy64, &w64, m, n, k);
    assert_close("matmul_nn", &dx.read(g).unwrap(), &want_dx, rtol, atol_n);
    let want = reference::matmul_nt(&x64, &dequantized, m, n, k);
    assert_close(
        "bitlinear_forward",
        &y_bit.read(g).unwrap(),
        &want,
        rtol,
        atol_k,
    );
    let want = reference::matmul_nn(&dy64, &dequantized, m, n, k);
    assert_close(
        "bitlinear_transpose",
        &dx_bit.read(g).unwrap(),
        &want,
        rtol,
        atol_n,
    );
}

#[test]
fn tile_choice_and_checks() {
    assert_eq!(
        Gemm::new(Product::Nt, (4096, 6912, 2560), false).tile,
        Tile::MEDIUM
    );
    Tile::LARGE.check("k").unwrap();
    Tile::MEDIUM.check("k").unwrap();
    Tile::SMALL.check("k").unwrap();
    let odd = Tile {
        tm: 6,
        ..Tile::LARGE
    };
    assert_eq!(
        odd.check("matmul_nt").unwrap_err().to_string(),
        "kernel `matmul_nt`: cannot dispatch tile Tile { bm: 128, bn: 128, bk: 8, tm: 6, tn: 8 }: \
         tm and tn must be multiples of 4 that divide bm and bn"
    );
    let thin = Tile {
        bk: 4,
        ..Tile::LARGE
    };
    assert_eq!(
        thin.check("matmul_nt").unwrap_err().to_string(),
        "kernel `matmul_nt`: cannot dispatch tile Tile { bm: 128, bn: 128, bk: 4, tm: 8, tn: 8 }: \
         the invocations must share out the bk·bm/4 and bk·bn/4 vec4s of a step evenly"
    );
}

/// The backward reference is the gradient of `L = Σ dy ⊙ (x·Wᵀ)` with respect to `x`, for a
/// dense `W` and for a dequantized ternary one.
#[test]
fn backward_reference_matches_finite_differences() {
    let (m, n, k) = (3, 4, 5);
    let mut rng = Rng::new(7);
    let x = f64s(&rng.vec(m * k, 1.0));
    let dy = f64s(&rng.vec(m * n, 1.0));
    let dense = f64s(&rng.vec(n * k, 1.0));
    let ternary = reference::dequantize(&random_ternary(&mut rng, n * k), SCALE as f64);
    for (what, w) in [("dense", &dense), ("ternary", &ternary)] {
        let loss = |x: &[f64]| {
            let y = reference::matmul_nt(x, w, m, n, k);
            y.iter().zip(&dy).map(|(y, d)| y * d).sum::<f64>()
        };
        let dx = reference::matmul_nn(&dy, w, m, n, k);
        check_gradient(what, &x, &dx, x.len(), loss);
    }
}

#[test]
fn ternary_packing_round_trips() {
    // Codes 0b01 = +1, 0b10 = −1, 0b00 = 0, element i at bits 2i.
    assert_eq!(
        linear::pack_ternary(&[1, -1, 0, 1]).unwrap(),
        vec![0b01_00_10_01]
    );
    let mut rng = Rng::new(3);
    for len in [0, 1, 15, 16, 17, 100] {
        let t = random_ternary(&mut rng, len);
        let packed = linear::pack_ternary(&t).unwrap();
        assert_eq!(packed.len(), len.div_ceil(16));
        assert_eq!(
            linear::unpack_ternary(&packed, len).unwrap(),
            t,
            "length {len}"
        );
    }
    let all: Vec<i8> = random_ternary(&mut rng, 64);
    assert!([-1, 0, 1].iter().all(|v| all.contains(v)));
    let err = linear::pack_ternary(&[0, 1, -1, 2]).unwrap_err();
    assert_eq!(
        err.to_string(),
        "buffer `ternary weights`: element 3 is 2, not -1, 0 or +1"
    );
    assert!(linear::pack_ternary(&[-2]).is_err());
    // More weights than the words hold: an error, not an index out of bounds.
    let err = linear::unpack_ternary(&[0], 17).unwrap_err();
    assert_eq!(
        err.to_string(),
        "buffer `ternary weights`: 17 weights asked for, 1 words hold at most 16"
    );
}

/// No rows: nothing to do. No depth: an empty sum, so zero (or nothing added).
#[test]
fn empty_dimensions() {
    let g = gpu();
    let empty = g.zeros::<f32>(0).unwrap();
    let mut y = g.zeros::<f32>(0).unwrap();
    let mut rec = g.recorder();
    let w = g.zeros::<f32>(6).unwrap();
    linear::execute_matmul_nt(&mut rec, &empty, &w, &mut y, 0, 2, 3, false).unwrap();
    assert!(rec.is_empty());
    let (m, n) = (3, 5);
    let mut y = g.filled(m * n, f32::NAN).unwrap();
    let mut y_acc = g.filled(m * n, 2.5f32).unwrap();
    linear::execute_matmul_nt(&mut rec, &empty, &empty, &mut y, m, n, 0, false).unwrap();
    linear::execute_matmul_nt(&mut rec, &empty, &empty, &mut y_acc, m, n, 0, true).unwrap();
    rec.submit().unwrap();
    assert_eq!(y.read(g).unwrap(), vec![0.0; m * n]);
    assert_eq!(y_acc.read(g).unwrap(), vec![2.5; m * n]);
}

#[test]
fn bad_shapes_name_kernel_and_buffer() {
    let g = gpu();
    // m = 2, n = 3, k = 5
    let x = g.zeros::<f32>(10).unwrap();
    let dy = g.zeros::<f32>(6).unwrap();
    let w = g.zeros::<f32>(15).unwrap();
    let packed = g.zeros::<u32>(1).unwrap();
    let mut y = g.zeros::<f32>(6).unwrap();
    let mut dx = g.zeros::<f32>(10).unwrap();
    let mut rec = g.recorder();
    let err = |r: Result<(), hesper_exec::ExecError>| r.unwrap_err().to_string();
    assert_eq!(
        err(linear::execute_matmul_nt(
            &mut rec, &dy, &w, &mut y, 2, 3, 5, false
        )),
        "kernel `matmul_nt`, binding `x`: expected 10 elements ([m, k]), given 6 elements"
    );
    assert_eq!(
        err(linear::execute_matmul_nt(
            &mut rec, &x, &x, &mut y, 2, 3, 5, false
        )),
        "kernel `matmul_nt`, binding `w`: expected 15 elements ([n, k]), given 10 elements"
    );
    assert_eq!(
        err(linear::execute_matmul_nt(
            &mut rec, &x, &w, &mut dx, 2, 3, 5, false
        )),
        "kernel `matmul_nt`, binding `y`: expected 6 elements ([m, n]), given 10 elements"
    );
    assert_eq!(
        err(linear::execute_matmul_nn(
            &mut rec, &x, &w, &mut dx, 2, 3, 5, true
        )),
        "kernel `matmul_nn`, binding `dy`: expected 6 elements ([m, n]), given 10 elements"
    );
    assert_eq!(
        err(linear::execute_matmul_nn(
            &mut rec, &dy, &w, &mut y, 2, 3, 5, true
        )),
        "kernel `matmul_nn`, binding `dx`: expected 10 elements ([m, k]), given 6 elements"
    );
    assert_eq!(
        err(linear::execute_bitlinear_forward(
            &mut rec, &x, &packed, 1.0, &mut y, 2, 3, 6, false
        )),
        "kernel `bitlinear_forward`, binding `x`: expected 12 elements ([m, k]), given 10 elements"
    );
    let mut dx12 = g.zeros::<f32>(12).unwrap();
    assert_eq!(
        err(linear::execute_bitlinear_transpose(
            &mut rec, &dy, &packed, 1.0, &mut dx12, 2, 3, 6, false
        )),
        "kernel `bitlinear_transpose`, binding `w`: expected 2 elements ([n, k] ternary, 16 per u32), given 1 elements"
    );
    let gemm = Gemm {
        tile: Tile {
            bn: 96,
            ..Tile::LARGE
        },
        ..Gemm::new(Product::Nt, (2, 3, 5), false)
    };
    assert!(
        err(linear::execute_gemm(
            &mut rec,
            &gemm,
            &x,
            Weights::Dense(&w),
            &mut y
        ))
        .starts_with("kernel `matmul_nt`: cannot dispatch tile")
    );
    assert!(rec.is_empty());
}

/// Each kernel's WGSL at a small key (its first line), the snapshot named by the key.
#[test]
fn wgsl_snapshots() {
    let names = [
        "matmul_nt_cols60_depth36_tile16x16x4_4x4",
        "matmul_nn_cols32_depth64_tile16x16x4_4x4_accumulate",
        "bitlinear_forward_cols64_depth32_tile16x16x4_4x4",
        "bitlinear_transpose_cols32_depth64_tile16x16x4_4x4_accumulate",
        "matmul_nn_cols32_depth64_tile16x16x4_4x4_f16_weight_output",
        "coop_matmul_nt_cols60_depth36_tile32x32x16_16x16_f32_to_f16",
        "coop_matmul_nn_cols64_depth32_tile32x32x16_16x16_f16_accumulate",
        "coop_matmul_nn_cols64_depth64_tile32x32x16_16x16_f16_splits2",
        "gemv_depth36_subgroups",
        "gemv_depth29_accumulate",
        "gemv_lora_depth36_rank2_subgroups",
        "gemv_lora_depth29_rank3_accumulate",
        "gemm_split_sum_parts4_accumulate",
    ];
    let kernels = linear::kernels().unwrap();
    for (name, k) in hesper_kernels::testing::named_by_key(&kernels, &names) {
        insta::assert_snapshot!(name, k.wgsl());
    }
}
