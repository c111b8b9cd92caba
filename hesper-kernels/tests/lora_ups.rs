//! Several LoRA up-projections in one GEMM (`lora::LoraUps`), each over all of the output's
//! columns or a range of them, against f64: row-major `·Wᵀ` and `·W` GEMMs, the step's
//! block-major `[q | k | v]` output and its block-major `[dq | dk | dv]` input. On the tensor
//! cores (the DSL's interpreter's in CI, the test device's where it has them) the ups are
//! folded into the product as more depth: ups over ranges that do not overlap share one fold's
//! depth, each workgroup staging the one its tile lies in; ups that need more depth than a step
//! holds are folded a round after another; a range that is not whole tiles goes element by
//! element. On a device without tensor cores (lavapipe) the row-major GEMMs run them element
//! by element in the f32 tiled GEMM. Inputs are f16-exact, so both paths multiply the same
//! values.

use std::ops::Range;

use hesper_exec::Gpu;
use hesper_exec::half::f16;
use hesper_kernels::linear::coop::{self, CoopTile};
use hesper_kernels::linear::fusion::Fusion;
use hesper_kernels::linear::{
    self, Gemm, GemmFusion, GemmPath, HalfBuffers, Precision, Product, Weights,
};
use hesper_kernels::lora::{LoraUp, LoraUps, UpWeight};
use hesper_kernels::testing::{Rng, block_major_at, compare, gpu, interpreter_with_tensor_cores};

/// Not a power of two, so that a kernel that drops it cannot pass by luck.
const SCALE: f32 = 0.37;

/// 32×32 outputs, 16 deep: a rank-4 up takes a whole step (3·4 parts, rounded to 16), so two
/// ups over all columns take two rounds.
const SMALL: CoopTile = CoopTile {
    bm: 32,
    bn: 32,
    bk: 16,
    wm: 16,
    wn: 16,
};

/// How the GEMM lays out its operands.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Layout {
    /// `y = s·x·Wᵀ`, row-major.
    RowMajor,
    /// `y = s·x·W` (a backward's input gradient, the ups' `W` = `A`), row-major.
    RowMajorNn,
    /// `[y_0 | y_1 | …] = s·x·Wᵀ`, the output block-major along its columns (these widths).
    OutputBlocks(&'static [usize]),
    /// `y = s·[x_0 | x_1 | …]·W`, the input block-major along the depth (these widths).
    InputBlocks(&'static [usize]),
}

/// One case: the device, the layout, `m × cols` over `depth`, the tile, and each up's rank
/// and columns.
struct Case {
    gpu: &'static Gpu,
    layout: Layout,
    shape: (usize, usize, usize),
    tile: Option<CoopTile>,
    ups: &'static [(usize, Option<Range<usize>>)],
}

/// f16-exact values in about ±1.
fn f16_exact(rng: &mut Rng, n: usize) -> Vec<f32> {
    (rng.vec(n, 1.0).into_iter())
        .map(|v| f16::from_f32(v).to_f32())
        .collect()
}

/// The GEMM with its ups, into a poisoned output, against the f64 sum of the product and each
/// up over its columns; the error relative to the output's scale.
fn run(i: usize, case: &Case) -> f64 {
    let g = case.gpu;
    let (m, cols, depth) = case.shape;
    let product = match case.layout {
        Layout::InputBlocks(_) | Layout::RowMajorNn => Product::Nn,
        _ => Product::Nt,
    };
    // `Gemm::new` takes the weight's `[out, in]`: `[cols, depth]` through `·Wᵀ`, `[depth,
    // cols]` through `·W`.
    let weight = match product {
        Product::Nt => (cols, depth),
        Product::Nn => (depth, cols),
    };
    let gemm = Gemm {
        coop_tile: case.tile,
        ..Gemm::new(product, (m, weight.0, weight.1), false)
    }
    .with_precision(Precision::F16);
    let mut rng = Rng::new(90 + i as u64);
    let x = f16_exact(&mut rng, m * depth);
    // `W`: `[cols, depth]` through `·Wᵀ`, `[depth, cols]` through `·W`.
    let w = f16_exact(&mut rng, cols * depth);
    let terms: Vec<(Vec<f32>, Vec<f32>, f32)> = (case.ups.iter().enumerate())
        .map(|(t, (rank, columns))| {
            let width = columns.as_ref().map_or(cols, |c| c.len());
            let scale = 1.75 - 0.5 * t as f32;
            (rng.vec(m * rank, 1.0), rng.vec(width * rank, 1.0), scale)
        })
        .collect();
    // The input as the kernel reads it: block-major for `InputBlocks`.
    let x_in = match case.layout {
        Layout::InputBlocks(widths) => {
            let mut blocked = Vec::with_capacity(x.len());
            let mut start = 0;
            for &w in widths {
                for r in 0..m {
                    blocked.extend_from_slice(&x[r * depth + start..][..w]);
                }
                start += w;
            }
            blocked
        }
        _ => x.clone(),
    };
    let w16: Vec<f16> = w.iter().map(|v| f16::from_f32(*v)).collect();
    let (xb, wb) = (g.upload(&x_in).unwrap(), g.upload(&w16).unwrap());
    // A device without `shader-f16` takes the same (f16-exact) weight in f32.
    let w32 = g.upload(&w).unwrap();
    let buffers: Vec<_> = (terms.iter())
        .map(|(h, b, _)| (g.upload(h).unwrap(), g.upload(b).unwrap()))
        .collect();
    let ups: Vec<LoraUp> = (case.ups.iter().zip(&buffers).zip(&terms))
        .map(|(((rank, columns), (h, b)), (_, _, scale))| LoraUp {
            h,
            weight: match product {
                Product::Nt => UpWeight::B(b),
                Product::Nn => UpWeight::A(b),
            },
            rank: *rank,
            scale: *scale,
            columns: columns.clone(),
        })
        .collect();
    let ups = LoraUps { ups: &ups };
    let epilogues: [&dyn GemmFusion; 1] = [&ups];
    let fusion = Fusion {
        prologue: None,
        epilogues: &epilogues,
    };
    let weights = match g.supports_f16() {
        true => Weights::Half {
            w: &wb,
            scale: SCALE,
        },
        false => Weights::ScaledDense {
            w: &w32,
            scale: SCALE,
        },
    };
    let mut out = g.upload(&vec![f32::NAN; m * cols]).unwrap();
    let mut rec = g.recorder();
    match case.layout {
        Layout::RowMajor | Layout::RowMajorNn => {
            linear::execute_gemm_fused(&mut rec, &gemm, &fusion, &xb, weights, &mut out)
        }
        Layout::OutputBlocks(widths) => linear::execute_gemm_output_blocks(
            &mut rec, &gemm, widths, &fusion, &xb, weights, &mut out,
        ),
        Layout::InputBlocks(widths) => {
            linear::execute_gemm_blocks(&mut rec, &gemm, widths, &fusion, &xb, weights, &mut out)
        }
    }
    .unwrap_or_else(|e| panic!("case {i} on {}: {e}", g.describe()));
    rec.submit().unwrap();
    let got = out.read(g).unwrap();
    // Element (r, c) of the row-major output, where the kernel wrote it.
    let at = |r: usize, c: usize| match case.layout {
        Layout::OutputBlocks(widths) => block_major_at(widths, m, (r, c)),
        _ => r * cols + c,
    };
    let mut want = vec![0f64; m * cols];
    let mut got_rows = vec![0f32; m * cols];
    for r in 0..m {
        for c in 0..cols {
            let w_at = |d: usize| match product {
                Product::Nt => w[c * depth + d],
                Product::Nn => w[d * cols + c],
            };
            let dot: f64 = (0..depth)
                .map(|d| x[r * depth + d] as f64 * w_at(d) as f64)
                .sum();
            let mut v = SCALE as f64 * dot;
            for ((rank, columns), (h, b, scale)) in case.ups.iter().zip(&terms) {
                let (start, width) = columns.as_ref().map_or((0, cols), |c| (c.start, c.len()));
                if c < start || c >= start + width {
                    continue;
                }
                let wc = c - start;
                let sum: f64 = (0..*rank)
                    .map(|j| {
                        let wv = match product {
                            Product::Nt => b[wc * rank + j],
                            Product::Nn => b[j * width + wc],
                        };
                        h[r * rank + j] as f64 * wv as f64
                    })
                    .sum();
                v += *scale as f64 * sum;
            }
            want[r * cols + c] = v;
            got_rows[r * cols + c] = got[at(r, c)];
        }
    }
    let c = compare(&got_rows, &want, 1e-3);
    c.max_abs / c.scale
}

#[test]
fn several_ups_over_ranges_of_columns_match_reference() {
    let interpreter = interpreter_with_tensor_cores();
    let cases = [
        // The step's forward in small: `[q | k | v]` block-major, the query's and value's ups
        // sharing a fold's depth, the key's tiles folding zeros.
        Case {
            gpu: interpreter,
            layout: Layout::OutputBlocks(&[64, 32, 32]),
            shape: (45, 128, 48),
            tile: Some(SMALL),
            ups: &[(4, Some(0..64)), (4, Some(96..128))],
        },
        // The tiny models' `[q | k | v]`, the tile the interpreter's defaults choose.
        Case {
            gpu: interpreter,
            layout: Layout::OutputBlocks(&[64, 32, 32]),
            shape: (13, 128, 64),
            tile: None,
            ups: &[(4, Some(0..64)), (4, Some(96..128))],
        },
        // All three adapted, ranks of different depths (rank 2: 16 deep) in one slot.
        Case {
            gpu: interpreter,
            layout: Layout::OutputBlocks(&[64, 32, 32]),
            shape: (33, 128, 32),
            tile: Some(SMALL),
            ups: &[(2, Some(64..96)), (4, Some(0..64)), (3, Some(96..128))],
        },
        // Row-major: a range of whole tiles (folded), one over all columns (its own round),
        // and one that is not whole tiles (the whole up element by element).
        Case {
            gpu: interpreter,
            layout: Layout::RowMajor,
            shape: (40, 96, 48),
            tile: Some(SMALL),
            ups: &[(4, Some(32..64)), (4, None)],
        },
        Case {
            gpu: interpreter,
            layout: Layout::RowMajor,
            shape: (40, 96, 48),
            tile: Some(SMALL),
            ups: &[(4, Some(40..72)), (2, None)],
        },
        // `·W` with `A`'s rank-major layout over a range of whole tiles and one that is not.
        Case {
            gpu: interpreter,
            layout: Layout::RowMajorNn,
            shape: (37, 96, 48),
            tile: Some(SMALL),
            ups: &[(4, Some(64..96)), (3, Some(0..32))],
        },
        Case {
            gpu: interpreter,
            layout: Layout::RowMajorNn,
            shape: (37, 96, 48),
            tile: Some(SMALL),
            ups: &[(4, Some(8..40))],
        },
        // The step's backward in small: `[dq | dk | dv]` block-major along the depth, the
        // query's and value's `s·dh·A` over all columns, one round each.
        Case {
            gpu: interpreter,
            layout: Layout::InputBlocks(&[32, 16, 16]),
            shape: (70, 48, 64),
            tile: Some(SMALL),
            ups: &[(4, None), (4, None)],
        },
        // The tiny models' backward, the tile the interpreter's defaults choose: both ups in
        // one step's depth.
        Case {
            gpu: interpreter,
            layout: Layout::InputBlocks(&[64, 32, 32]),
            shape: (13, 64, 128),
            tile: None,
            ups: &[(4, None), (4, None)],
        },
        // The test device: row-major on any (element by element without tensor cores); the
        // step's shapes where it has tensor cores (below).
        Case {
            gpu: gpu(),
            layout: Layout::RowMajor,
            shape: (70, 160, 96),
            tile: None,
            // Two ups: with the GEMM's three, four storage bindings more fit WebGPU's
            // default of eight a stage, which CI's run of these tests keeps to.
            ups: &[(8, Some(32..96)), (4, None)],
        },
        Case {
            gpu: gpu(),
            layout: Layout::RowMajorNn,
            shape: (70, 160, 96),
            tile: None,
            ups: &[(8, Some(64..160)), (8, None)],
        },
    ];
    for (i, case) in cases.iter().enumerate() {
        let err = run(i, case);
        let depth = case.shape.2 as f64;
        let bound = 2e-6 * depth.sqrt();
        assert!(
            err <= bound,
            "case {i} ({:?}, {:?}, ups {:?}) on {}: error {err:.2e} of the scale (bound {bound:.1e})",
            case.layout,
            case.shape,
            case.ups,
            case.gpu.describe()
        );
    }
    // The step's own shapes, where the test device has tensor cores.
    let g = gpu();
    if coop::subgroup_size(g).is_none() {
        return;
    }
    let step = [
        Case {
            gpu: g,
            layout: Layout::OutputBlocks(&[576, 192, 192]),
            shape: (300, 960, 576),
            tile: None,
            ups: &[(8, Some(0..576)), (8, Some(768..960))],
        },
        Case {
            gpu: g,
            layout: Layout::InputBlocks(&[576, 192, 192]),
            shape: (300, 576, 960),
            tile: None,
            ups: &[(8, None), (8, None)],
        },
    ];
    for (i, case) in step.iter().enumerate() {
        let err = run(10 + i, case);
        let bound = 2e-6 * (case.shape.2 as f64).sqrt();
        assert!(err <= bound, "step case {i} on {}: {err:.2e}", g.describe());
    }
}

/// Bad ups are errors that name the kernel and what is wrong; nothing is recorded.
#[test]
fn bad_ups_are_errors() {
    let g = interpreter_with_tensor_cores();
    let gemm = Gemm {
        coop_tile: Some(SMALL),
        ..Gemm::new(Product::Nt, (32, 64, 32), false)
    }
    .with_precision(Precision::F16);
    let (x, w) = (
        g.zeros::<f32>(32 * 32).unwrap(),
        g.zeros::<f32>(64 * 32).unwrap(),
    );
    let h = g.zeros::<f32>(32 * 4).unwrap();
    let b = g.zeros::<f32>(32 * 4).unwrap();
    let up = |columns: Option<Range<usize>>| LoraUp {
        h: &h,
        weight: UpWeight::B(&b),
        rank: 4,
        scale: 1.0,
        columns,
    };
    let mut y = g.zeros::<f32>(32 * 64).unwrap();
    let five: Vec<LoraUp> = (0..5).map(|_| up(Some(0..32))).collect();
    let cases: [(Vec<LoraUp>, &str); 4] = [
        (vec![up(Some(48..80))], "columns 48..80"),
        (vec![up(Some(16..16))], "columns 16..16"),
        // `B` holds 32 rows where the whole width is 64.
        (vec![up(None)], "lora_w"),
        (five, "5 up-projections"),
    ];
    for (ups, named) in cases {
        let ups = LoraUps { ups: &ups };
        let epilogues: [&dyn GemmFusion; 1] = [&ups];
        let fusion = Fusion {
            prologue: None,
            epilogues: &epilogues,
        };
        let mut rec = g.recorder();
        let err =
            linear::execute_gemm_fused(&mut rec, &gemm, &fusion, &x, Weights::Dense(&w), &mut y)
                .unwrap_err();
        let err = err.to_string();
        assert!(err.contains(named) && err.contains("matmul_nt"), "{err}");
        assert!(rec.is_empty());
    }
    // A path is still chosen for the GEMM itself.
    let path = linear::gemm_path(g, &gemm, &Weights::Dense(&w), HalfBuffers::NONE);
    assert!(matches!(path, GemmPath::TensorCores { .. }), "{path:?}");
}
