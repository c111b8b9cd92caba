//! Fused GEMMs (`linear::execute_gemm_fused`): SwiGLU as the input's prologue, the LoRA
//! up-projection, a bias and a residual as the output's epilogues, against an f64 reference of
//! the unfused math — on the GPU (the f32 tiled GEMM on lavapipe; the tensor cores where the
//! device has them), and the tensor-core kernel on the DSL's interpreter (which lavapipe cannot
//! run); their WGSL snapshots; and the errors of a fusion's buffers.

use hesper_dsl::Limits;
use hesper_dsl::interp::{Run, ScalarValue, interpret};
use hesper_exec::half::f16;
use hesper_exec::{ExecError, GpuBuffer};
use hesper_kernels::ffn::SwigluInput;
use hesper_kernels::linear::coop::CoopTile;
use hesper_kernels::linear::fusion::{Bias, Residual};
use hesper_kernels::linear::{
    self, Fusion, Gemm, GemmFusion, GemmPath, HalfBuffers, Precision, Product, Tile, Weights,
};
use hesper_kernels::lora::{LoraUp, UpWeight};
use hesper_kernels::testing::{Rng, gpu};

/// Not a power of two, so that a kernel that drops it cannot pass by luck.
const SCALE: f32 = 0.37;
const LORA_SCALE: f32 = 1.75;
/// LoRA's rank, unless a case says otherwise.
const RANK: usize = 3;

fn h16(v: f64) -> f64 {
    f16::from_f64(v).to_f64()
}

/// Host values of one fused GEMM's buffers.
struct Case {
    product: Product,
    /// `(m, cols, depth)`.
    dims: (usize, usize, usize),
    accumulate: bool,
    prologue: bool,
    epilogues: bool,
    /// Whether the epilogues include the bias (the one that is not an addition of a matrix
    /// or a low-rank product: with it, the tensor cores store element by element).
    bias_on: bool,
    /// The LoRA weight as `B: [cols, r]` (else `A: [r, cols]`).
    lora_b: bool,
    rank: usize,
    x: Vec<f32>,
    up: Vec<f32>,
    w: Vec<f32>,
    lora_h: Vec<f32>,
    lora_w: Vec<f32>,
    bias: Vec<f32>,
    residual: Vec<f32>,
    prior: Vec<f32>,
}

impl Case {
    fn new(product: Product, dims: (usize, usize, usize), accumulate: bool, seed: u64) -> Case {
        Case::with_rank(product, dims, accumulate, seed, RANK)
    }

    fn with_rank(
        product: Product,
        dims: (usize, usize, usize),
        accumulate: bool,
        seed: u64,
        rank: usize,
    ) -> Case {
        let (m, cols, depth) = dims;
        let mut rng = Rng::new(seed);
        Case {
            product,
            dims,
            accumulate,
            prologue: true,
            epilogues: true,
            bias_on: true,
            lora_b: product == Product::Nt,
            rank,
            x: rng.vec(m * depth, 2.0),
            up: rng.vec(m * depth, 1.0),
            w: rng.vec(cols * depth, 1.0),
            lora_h: rng.vec(m * rank, 1.0),
            lora_w: rng.vec(cols * rank, 1.0),
            bias: rng.vec(cols, 1.0),
            residual: rng.vec(m * cols, 1.0),
            prior: rng.vec(m * cols, 1.0),
        }
    }

    /// `(m, n, k)` of the linear layer.
    fn gemm(&self) -> Gemm {
        let (m, cols, depth) = self.dims;
        let mnk = match self.product {
            Product::Nt => (m, cols, depth),
            Product::Nn => (m, depth, cols),
        };
        Gemm::new(self.product, mnk, self.accumulate)
    }

    /// The f64 result, the input rounded to f16 where `input_f16` (the tensor cores, which keep
    /// LoRA's operands to about 22 bits in two f16 parts each), the weight where `weight_f16`
    /// (an f16 buffer, or the tensor cores).
    fn reference(&self, (input_f16, weight_f16): (bool, bool)) -> Vec<f64> {
        let rank = self.rank;
        let (m, cols, depth) = self.dims;
        let round = |v: f64| if input_f16 { h16(v) } else { v };
        let round_w = |v: f64| if weight_f16 { h16(v) } else { v };
        let a: Vec<f64> = (0..m * depth)
            .map(|i| {
                let x = self.x[i] as f64;
                match self.prologue {
                    true => round(x / (1.0 + (-x).exp()) * self.up[i] as f64),
                    false => round(x),
                }
            })
            .collect();
        // B(d, c): `·Wᵀ` reads W [cols, depth]; `·W` reads W [depth, cols].
        let b = |d: usize, c: usize| {
            round_w(match self.product {
                Product::Nt => self.w[c * depth + d] as f64,
                Product::Nn => self.w[d * cols + c] as f64,
            })
        };
        let mut out = vec![0.0; m * cols];
        for r in 0..m {
            for c in 0..cols {
                let sum: f64 = (0..depth).map(|d| a[r * depth + d] * b(d, c)).sum();
                let mut v = SCALE as f64 * sum;
                if self.epilogues {
                    let lora: f64 = (0..rank)
                        .map(|j| {
                            let w = match self.lora_b {
                                true => self.lora_w[c * rank + j],
                                false => self.lora_w[j * cols + c],
                            };
                            self.lora_h[r * rank + j] as f64 * w as f64
                        })
                        .sum();
                    v += LORA_SCALE as f64 * lora;
                    v += self.residual[r * cols + c] as f64;
                    if self.bias_on {
                        v += self.bias[c] as f64;
                    }
                }
                if self.accumulate {
                    v += self.prior[r * cols + c] as f64;
                }
                out[r * cols + c] = v;
            }
        }
        out
    }
}

/// The case's fusions over its buffers.
struct Fusions<'a> {
    swiglu: SwigluInput<'a>,
    lora: LoraUp<'a>,
    bias: Bias<'a>,
    residual: Residual<'a>,
}

impl<'a> Fusions<'a> {
    fn new(case: &Case, buffers: &'a [GpuBuffer<f32>; 5]) -> Self {
        let [up, lora_h, lora_w, bias, residual] = buffers;
        Fusions {
            swiglu: SwigluInput { up },
            lora: LoraUp {
                h: lora_h,
                weight: match case.lora_b {
                    true => UpWeight::B(lora_w),
                    false => UpWeight::A(lora_w),
                },
                rank: case.rank,
                scale: LORA_SCALE,
                columns: None,
            },
            bias: Bias { bias },
            residual: Residual { residual },
        }
    }

    fn epilogues(&self, case: &Case) -> Vec<&dyn GemmFusion> {
        match (case.epilogues, case.bias_on) {
            (true, true) => vec![&self.lora, &self.bias, &self.residual],
            // The residual first: the low-rank product still goes on the tensor cores.
            (true, false) => vec![&self.residual, &self.lora],
            (false, _) => vec![],
        }
    }
}

fn upload_fusion_buffers(case: &Case) -> [GpuBuffer<f32>; 5] {
    let g = gpu();
    [
        &case.up,
        &case.lora_h,
        &case.lora_w,
        &case.bias,
        &case.residual,
    ]
    .map(|v| g.upload(v).unwrap())
}

/// Run the case on the GPU at `precision` (output poisoned with NaN unless accumulating);
/// returns the largest error over the largest value and the path taken, or `None` where the
/// device cannot run it (f16 weights without `shader-f16`).
fn run_on_gpu(case: &Case, precision: Precision) -> Option<(f64, GemmPath)> {
    let g = gpu();
    let half_weight = precision == Precision::F16;
    if half_weight && !g.supports_f16() {
        return None;
    }
    let gemm = case.gemm().with_precision(precision).with_input_exponent(3);
    let x = g.upload(&case.x).unwrap();
    let start = match case.accumulate {
        true => case.prior.clone(),
        false => vec![f32::NAN; case.prior.len()],
    };
    let mut out = g.upload(&start).unwrap();
    let w32 = g.upload(&case.w).unwrap();
    let w16: Vec<f16> = case.w.iter().map(|v| f16::from_f32(*v)).collect();
    let w16 = g.upload(&w16).unwrap();
    let weights = match half_weight {
        true => Weights::Half {
            w: &w16,
            scale: SCALE,
        },
        false => Weights::ScaledDense {
            w: &w32,
            scale: SCALE,
        },
    };
    let buffers = upload_fusion_buffers(case);
    let fusions = Fusions::new(case, &buffers);
    let epilogues = fusions.epilogues(case);
    let fusion = Fusion {
        prologue: case.prologue.then_some(&fusions.swiglu as &dyn GemmFusion),
        epilogues: &epilogues,
    };
    let half = HalfBuffers {
        weight: half_weight,
        ..HalfBuffers::NONE
    };
    let path = linear::gemm_path(g, &gemm, &weights, half);
    let mut rec = g.recorder();
    linear::execute_gemm_fused(&mut rec, &gemm, &fusion, &x, weights, &mut out).unwrap();
    rec.submit().unwrap();
    let got = out.read(g).unwrap();
    let tensor_cores = matches!(path, GemmPath::TensorCores { .. });
    let want = case.reference((tensor_cores, tensor_cores || half_weight));
    let largest = want.iter().fold(0f64, |a, v| a.max(v.abs()));
    let worst = got
        .iter()
        .zip(&want)
        .map(|(g, w)| (*g as f64 - w).abs())
        .fold(
            0f64,
            |a, e| if e.is_nan() { f64::INFINITY } else { a.max(e) },
        );
    Some((worst / largest, path))
}

/// Both products at a ragged and a whole shape, every fusion on and each alone, with and
/// without accumulation, at both precisions (a dozen kernels: lavapipe compiles each for
/// seconds): within f32's rounding of the unfused f64 math (f16's on the tensor cores, where
/// the reference rounds the inputs as they do).
#[test]
fn fused_gemms_match_the_unfused_math() {
    // (prologue, epilogues, accumulate, precision)
    let variants = [
        (true, true, false, Precision::F32),
        (true, false, true, Precision::F16),
        (false, true, true, Precision::F16),
    ];
    let mut seed = 1;
    let mut report = vec![];
    for product in [Product::Nt, Product::Nn] {
        for dims in [(37, 53, 29), (130, 192, 96)] {
            for (prologue, epilogues, accumulate, precision) in variants {
                seed += 1;
                let mut case = Case::new(product, dims, accumulate, seed);
                case.prologue = prologue;
                case.epilogues = epilogues;
                // Without the bias at the whole shape: the tensor cores' direct stores.
                case.bias_on = dims.0 != 130;
                // The other layout of the LoRA weight on every other case.
                case.lora_b ^= seed % 2 == 0;
                let Some((err, path)) = run_on_gpu(&case, precision) else {
                    continue;
                };
                // On the tensor cores the reference rounds the operands as they do: what is
                // left is f32's rounding, and the prologue's `exp` at a rounding boundary
                // (1e-7 – 3e-6 on the H200). LoRA's product with its operands rounded to f16
                // alone (as the H200 once computed it) is off by ~1e-4.
                let tol = match path {
                    GemmPath::TensorCores { .. } => 2e-5,
                    _ => 2e-6,
                };
                let what = format!(
                    "{product:?} {dims:?} accumulate {accumulate} prologue {prologue} \
                     epilogues {epilogues} {precision:?} on {path:?}"
                );
                report.push(format!("{what}: {err:.1e}"));
                assert!(err <= tol, "{what}: error {err:e} of the largest value");
            }
        }
    }
    println!("{}", report.join("\n"));
}

/// The tensor-core fused GEMM, which lavapipe cannot run, on the interpreter: both products,
/// f32 input rounded to f16 after the prologue (and the input scale), ragged rows, columns and
/// depth, accumulation.
#[test]
fn the_fused_tensor_core_gemm_is_right_on_the_interpreter() {
    // The H200's 48 KiB of workgroup memory, which the `wide` tile needs.
    let limits = Limits {
        max_workgroup_storage_bytes: 48 * 1024,
        ..Limits::default()
    };
    let small = CoopTile {
        bm: 32,
        bn: 32,
        bk: 16,
        wm: 16,
        wn: 16,
    };
    // (tile, product, dims, accumulate, bias, rank): without the bias the tiles inside the
    // output are stored directly, the low-rank product added on the tensor cores; with it,
    // through workgroup memory. Rank 5 takes all of the small tile's 16 of depth (three parts
    // of 5); rank 12 does not fit and goes element by element. The `wide` tile's step (48)
    // holds rank 8's 32 of depth with 16 to spare.
    for (tile, product, dims, accumulate, bias_on, rank) in [
        (small, Product::Nt, (50, 60, 36), false, true, RANK),
        (small, Product::Nn, (33, 64, 40), true, true, RANK),
        (small, Product::Nt, (70, 64, 36), true, false, RANK),
        (small, Product::Nn, (64, 36, 40), false, false, RANK),
        (small, Product::Nt, (40, 32, 20), false, false, 5),
        (small, Product::Nn, (40, 36, 20), true, true, 12),
        (CoopTile::WIDE, Product::Nt, (140, 200, 100), true, false, 8),
        (CoopTile::WIDE, Product::Nn, (130, 384, 96), false, false, 8),
    ] {
        let path = GemmPath::TensorCores { tile, subgroup: 32 };
        let mut case = Case::with_rank(product, dims, accumulate, 99 + dims.0 as u64, rank);
        case.bias_on = bias_on;
        let buffers = upload_fusion_buffers(&case);
        let fusions = Fusions::new(&case, &buffers);
        let epilogues = fusions.epilogues(&case);
        let fusion = Fusion {
            prologue: Some(&fusions.swiglu),
            epilogues: &epilogues,
        };
        let half = HalfBuffers {
            input: false,
            weight: false,
            output: false,
        };
        let kernel = linear::fused_kernel(&case.gemm(), path, half, &fusion, &limits).unwrap();
        let (m, cols, _) = dims;
        let (input, output) = match product {
            Product::Nt => ("x", "y"),
            Product::Nn => ("dy", "dx"),
        };
        let bytes = |v: &[f32]| bytemuck::cast_slice(v).to_vec();
        let start = match accumulate {
            true => case.prior.clone(),
            false => vec![f32::NAN; m * cols],
        };
        let grid = [
            cols.div_ceil(tile.bn as usize),
            m.div_ceil(tile.bm as usize),
            1,
        ];
        let mut run = Run::new(grid.map(|n| n as u32));
        run.subgroup_size = 32;
        for (name, v) in [
            (input, &case.x),
            ("w", &case.w),
            (output, &start),
            ("up", &case.up),
            ("lora_h", &case.lora_h),
            ("lora_w", &case.lora_w),
            ("bias", &case.bias),
            ("residual", &case.residual),
        ] {
            run.buffers.insert(name.into(), bytes(v));
        }
        run.params.insert("rows".into(), ScalarValue::U32(m as u32));
        run.params
            .insert("scale".into(), ScalarValue::F32(SCALE / 8.0));
        run.params
            .insert("input_scale".into(), ScalarValue::F32(8.0));
        run.params
            .insert("lora_scale".into(), ScalarValue::F32(LORA_SCALE));
        interpret(&kernel, &mut run).unwrap_or_else(|e| panic!("{product:?}: {e}"));
        let got: Vec<f32> = run.read(output).unwrap();
        let want = case.reference((true, true));
        let largest = want.iter().fold(0f64, |a, v| a.max(v.abs()));
        // The operands are rounded as the reference rounds them: what is left is f32's
        // rounding (and the prologue's f32 `exp` against f64's at a rounding boundary). LoRA's
        // `h` or weight rounded to f16 alone would be off by ~1e-4 of the largest value.
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (*g as f64 - w).abs() <= 2e-5 * largest,
                "{product:?} {dims:?} rank {rank}: element {i} is {g}, {w} expected"
            );
        }
    }
}

/// The fused kernels' WGSL: the f32 tiled GEMM at a small tile (ragged columns and depth) and
/// the tensor cores', both with every fusion.
#[test]
fn fused_wgsl_snapshots() {
    let case = Case::new(Product::Nt, (8, 60, 36), false, 5);
    let buffers = upload_fusion_buffers(&case);
    let fusions = Fusions::new(&case, &buffers);
    let epilogues = fusions.epilogues(&case);
    let fusion = Fusion {
        prologue: Some(&fusions.swiglu),
        epilogues: &epilogues,
    };
    let small = Tile {
        bm: 16,
        bn: 16,
        bk: 4,
        tm: 4,
        tn: 4,
    };
    let coop_tile = CoopTile {
        bm: 32,
        bn: 32,
        bk: 16,
        wm: 16,
        wn: 16,
    };
    for (name, path) in [
        (
            "matmul_nt_swiglu_lora_bias_residual",
            GemmPath::Tiled(small),
        ),
        (
            "coop_matmul_nt_swiglu_lora_bias_residual",
            GemmPath::TensorCores {
                tile: coop_tile,
                subgroup: 32,
            },
        ),
    ] {
        let kernel = linear::fused_kernel(
            &case.gemm(),
            path,
            HalfBuffers::NONE,
            &fusion,
            &Limits::default(),
        )
        .unwrap();
        insta::assert_snapshot!(name, kernel.wgsl());
    }
}

/// A fusion's buffers are checked with the GEMM's, and nothing is recorded when one is wrong.
#[test]
fn a_fusions_bad_buffers_are_errors_that_name_them() {
    let g = gpu();
    let case = Case::new(Product::Nt, (4, 8, 12), false, 7);
    let x = g.upload(&case.x).unwrap();
    let w = g.upload(&case.w).unwrap();
    let mut y = g.upload(&case.prior).unwrap();
    let short = g.upload(&[0f32; 5]).unwrap();
    let buffers = upload_fusion_buffers(&case);
    let fusions = Fusions::new(&case, &buffers);
    let gemm = case.gemm();
    let mut err = |fusion: &Fusion<'_>, gemm: &Gemm| {
        let mut rec = g.recorder();
        let e: ExecError =
            linear::execute_gemm_fused(&mut rec, gemm, fusion, &x, Weights::Dense(&w), &mut y)
                .unwrap_err();
        assert!(rec.is_empty(), "{e}");
        e.to_string()
    };
    let bad_residual = Residual { residual: &short };
    let msg = err(
        &Fusion {
            prologue: None,
            epilogues: &[&bad_residual as &dyn GemmFusion],
        },
        &gemm,
    );
    assert!(
        msg.contains("`matmul_nt`") && msg.contains("`residual`") && msg.contains("32"),
        "{msg}"
    );
    let bad_up = SwigluInput { up: &short };
    let msg = err(
        &Fusion {
            prologue: Some(&bad_up),
            epilogues: &[],
        },
        &gemm,
    );
    assert!(msg.contains("`up`") && msg.contains("48"), "{msg}");
    let wide = LoraUp {
        rank: 65,
        ..LoraUp {
            h: &buffers[1],
            weight: UpWeight::B(&buffers[2]),
            rank: RANK,
            scale: 1.0,
            columns: None,
        }
    };
    let msg = err(
        &Fusion {
            prologue: None,
            epilogues: &[&wide as &dyn GemmFusion],
        },
        &gemm,
    );
    assert!(msg.contains("rank 65"), "{msg}");
    let msg = err(
        &Fusion {
            prologue: None,
            epilogues: &[&fusions.bias as &dyn GemmFusion, &fusions.bias],
        },
        &gemm,
    );
    assert!(msg.contains("bias"), "{msg}");
    let empty = Gemm::new(Product::Nt, (4, 8, 0), false);
    let msg = err(
        &Fusion {
            prologue: None,
            epilogues: &[&fusions.bias as &dyn GemmFusion],
        },
        &empty,
    );
    assert!(msg.contains("depth of at least 1"), "{msg}");
}
