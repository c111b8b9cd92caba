//! Every kernel of the catalog (but the cooperative-matrix GEMMs, which the interpreter does not
//! run yet) on the DSL's interpreter against lavapipe: the same inputs, the same grid, the same
//! outputs — bit for bit where the arithmetic is exact, within a few f32 ulps where the two
//! evaluate a transcendental (`exp`, `log`, `inverseSqrt`) differently. The interpreter also
//! checks every run for out-of-bounds accesses and races, so the library's kernels are shown
//! free of both at these shapes.

use hesper_dsl::Kernel;
use hesper_dsl::interp::{Run, ScalarValue, interpret};
use hesper_dsl::ty::{Access, Scalar, Ty};
use hesper_exec::half::f16;
use hesper_exec::{Args, Gpu, GpuBuffer, Grid};
use hesper_kernels::catalog;
use hesper_kernels::testing::{Rng, gpu_without_subgroups, worst};

/// Elements each binding gets (of its element type): enough for every kernel's reads at the
/// runtime values below.
const LEN: usize = 16_384;

/// A runtime scalar's value: small, consistent sizes (rows, tokens, positions) for every
/// kernel; an `f32` of moderate size.
fn param(kernel: &str, name: &str, ty: Scalar) -> ScalarValue {
    let n = match (kernel, name) {
        // Blocks of 16 tokens: 20 tokens are 2 blocks, as the executor counts them.
        ("lora_up", "tokens") => 20,
        // One head of the catalog's 128 a token (64 pairs), three tokens.
        ("rope", "pairs_per_token") => 64,
        ("rope", "pairs") => 192,
        // Two heads of the catalog's 64 a token (8 vec4s of pairs each), three tokens.
        ("rope_vec4", "quads_per_token") => 16,
        ("rope_vec4", "quads") => 48,
        // Of the three workgroups, two for the first gradient and one for the second, whose
        // partials start past the first's.
        ("lora_weight_grad_partials", "end1") => 2,
        ("lora_weight_grad_partials", "base2") => 4096,
        // Two query heads and one key head of 64 a token, three tokens.
        ("rope_qk_vec4", "q_quads_per_token") => 16,
        ("rope_qk_vec4", "q_quads") => 48,
        ("rope_qk_vec4", "k_quads_per_token") => 8,
        ("rope_qk_vec4", "k_quads") => 24,
        _ => match name {
            "rows" | "heads" | "tokens" | "count" => 3,
            "kv_heads" | "pos" | "offset" | "first" | "base" => 1,
            "len" | "blocks" => 2,
            "max_seq" | "seq_len" | "width" | "pairs_per_token" => 4,
            "vocab" => 40,
            "n4" | "pairs" => 48,
            // argmax's row length, the grad norm's elements, embedding's values.
            "n" => match kernel {
                "add_bias" | "embedding" => 64,
                _ => 60,
            },
            _ => 3,
        },
    };
    match ty {
        Scalar::U32 => ScalarValue::U32(n),
        Scalar::I32 => ScalarValue::I32(n as i32),
        _ => ScalarValue::F32(match name {
            "beta1" => 0.9,
            "beta2" => 0.99,
            "one_minus_beta1" => 0.1,
            "one_minus_beta2" => 0.01,
            "eps" => 1e-8,
            "lr" => 1e-2,
            "bias_correction1" => 0.19,
            "bias_correction2" => 0.0199,
            _ => 0.5,
        }),
    }
}

/// Host values for one binding: `f32`s in [-1, 1) (non-negative where they are second
/// moments, probabilities or saved statistics), small integers.
fn values(rng: &mut Rng, name: &str, elem: &Ty) -> Vec<u8> {
    let (lanes, scalar) = match elem {
        Ty::Scalar(s) => (1, *s),
        Ty::Vector(n, s) => (*n as usize, *s),
        other => panic!("binding of {other:?}"),
    };
    let n = LEN * lanes;
    match scalar {
        Scalar::F32 => {
            let positive = matches!(name, "v" | "rstd" | "p" | "attn" | "stats" | "lse");
            let v: Vec<f32> = (0..n)
                .map(|_| {
                    let x = rng.next_f32();
                    if positive { x.abs() + 0.05 } else { x }
                })
                .collect();
            bytemuck::cast_slice(&v).to_vec()
        }
        Scalar::F16 => {
            let v: Vec<f16> = (0..n).map(|_| f16::from_f32(rng.next_f32())).collect();
            bytemuck::cast_slice(&v).to_vec()
        }
        Scalar::U32 => {
            let v: Vec<u32> = (0..n).map(|_| rng.next_u32() % 7).collect();
            bytemuck::cast_slice(&v).to_vec()
        }
        Scalar::I32 => {
            // Labels: targets, the masked −100, ids past the vocabulary.
            let v: Vec<i32> = (0..n)
                .map(|_| match rng.next_u32() % 6 {
                    0 => -100,
                    1 => 45,
                    r => (r * 7) as i32,
                })
                .collect();
            bytemuck::cast_slice(&v).to_vec()
        }
        other => panic!("a binding of {other:?}"),
    }
}

/// A binding's buffer on the GPU, of its element's scalar type.
enum Typed {
    F32(GpuBuffer<f32>),
    F16(GpuBuffer<f16>),
    U32(GpuBuffer<u32>),
    I32(GpuBuffer<i32>),
}

fn scalar_of(elem: &Ty) -> Scalar {
    match elem {
        Ty::Scalar(s) | Ty::Vector(_, s) => *s,
        other => panic!("a binding of {other:?}"),
    }
}

/// How `a` (lavapipe's) and `b` (the interpreter's) differ read as `f32`s (f16s widened; NaN
/// equal to NaN): the elements that differ at all, and the largest difference over the largest
/// magnitude.
fn differ(a: &[u8], b: &[u8], scalar: Scalar) -> (usize, f64) {
    let floats = |bytes: &[u8]| -> Vec<f32> {
        match scalar {
            Scalar::F16 => bytemuck::cast_slice::<u8, f16>(bytes)
                .iter()
                .map(|x| x.to_f32())
                .collect(),
            _ => bytemuck::cast_slice(bytes).to_vec(),
        }
    };
    let (a, b) = (floats(a), floats(b));
    let scale = a.iter().fold(0f64, |m, v| {
        if v.is_finite() {
            m.max(v.abs() as f64)
        } else {
            m
        }
    });
    let (mut count, mut worst) = (0, 0f64);
    for (x, y) in a.iter().zip(&b) {
        if x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()) {
            continue;
        }
        count += 1;
        worst = worst.max((*x as f64 - *y as f64).abs());
    }
    (count, worst / scale.max(f64::MIN_POSITIVE))
}

/// Run `kernel` on lavapipe and on the interpreter from the same inputs: over its written
/// buffers, the elements that differ and the largest difference relative to the buffer's size.
fn compare(g: &Gpu, kernel: &Kernel, workgroups: u32, seed: u64) -> (usize, f64) {
    let mut rng = Rng::new(seed);
    let mut run = Run::new([workgroups, 1, 1]);
    run.subgroup_size = 8;
    for b in kernel.bindings() {
        run.buffers
            .insert(b.name.clone(), values(&mut rng, &b.name, &b.elem));
    }
    for p in kernel.params() {
        run.params
            .insert(p.name.clone(), param(kernel.name(), &p.name, p.ty));
    }
    let buffers: Vec<Typed> = kernel
        .bindings()
        .iter()
        .map(|b| {
            let bytes = &run.buffers[&b.name];
            match scalar_of(&b.elem) {
                Scalar::F32 => Typed::F32(g.upload::<f32>(bytemuck::cast_slice(bytes)).unwrap()),
                Scalar::F16 => Typed::F16(g.upload::<f16>(bytemuck::cast_slice(bytes)).unwrap()),
                Scalar::U32 => Typed::U32(g.upload::<u32>(bytemuck::cast_slice(bytes)).unwrap()),
                Scalar::I32 => Typed::I32(g.upload::<i32>(bytemuck::cast_slice(bytes)).unwrap()),
                other => panic!("a binding of {other:?}"),
            }
        })
        .collect();
    let mut args = Args::new();
    for (b, buf) in kernel.bindings().iter().zip(&buffers) {
        let vec4 = matches!(b.elem, Ty::Vector(4, _));
        args = match (buf, vec4) {
            (Typed::F32(x), true) => args.buffer_vec4(&b.name, x),
            (Typed::F32(x), false) => args.buffer(&b.name, x),
            (Typed::F16(x), true) => args.buffer_vec4(&b.name, x),
            (Typed::F16(x), false) => args.buffer(&b.name, x),
            (Typed::U32(x), true) => args.buffer_vec4(&b.name, x),
            (Typed::U32(x), false) => args.buffer(&b.name, x),
            (Typed::I32(x), true) => args.buffer_vec4(&b.name, x),
            (Typed::I32(x), false) => args.buffer(&b.name, x),
        };
    }
    for p in kernel.params() {
        args = match run.params[&p.name] {
            ScalarValue::U32(v) => args.param(&p.name, v),
            ScalarValue::I32(v) => args.param(&p.name, v),
            ScalarValue::F32(v) => args.param(&p.name, v),
            other => panic!("a parameter of {other:?}"),
        };
    }
    let grid = Grid::Workgroups([workgroups, 1, 1]);
    g.run(kernel, &args, grid)
        .unwrap_or_else(|e| panic!("{}: lavapipe: {e}", kernel.name()));
    interpret(kernel, &mut run).unwrap_or_else(|e| panic!("{}: interpreter: {e}", kernel.name()));
    let mut result = (0, 0f64);
    for (b, buf) in kernel.bindings().iter().zip(&buffers) {
        if b.access != Access::ReadWrite {
            continue;
        }
        let gpu: Vec<u8> = match buf {
            Typed::F32(x) => bytemuck::cast_slice(&x.read(g).unwrap()).to_vec(),
            Typed::F16(x) => bytemuck::cast_slice(&x.read(g).unwrap()).to_vec(),
            Typed::U32(x) => bytemuck::cast_slice(&x.read(g).unwrap()).to_vec(),
            Typed::I32(x) => bytemuck::cast_slice(&x.read(g).unwrap()).to_vec(),
        };
        let (count, worst) = differ(&gpu, &run.buffers[&b.name], scalar_of(&b.elem));
        result = (result.0 + count, result.1.max(worst));
    }
    result
}

/// The workgroups of a launch: as many as the executor launches where a kernel assumes its
/// grid (a GEMM's column tiles: one past them would write into the next row; the one workgroup
/// of a final sum), else 3.
fn workgroups(kernel: &Kernel) -> u32 {
    let shape = |name: &str| match kernel.key().get(name) {
        Some(hesper_dsl::ShapeValue::U32(v)) => v,
        other => panic!("{}: shape `{name}` is {other:?}", kernel.name()),
    };
    match kernel.name() {
        "matmul_nt" | "matmul_nn" | "bitlinear_forward" | "bitlinear_transpose" => {
            shape("cols").div_ceil(16)
        }
        // One workgroup reduces everything.
        "cross_entropy_count" | "cross_entropy_mean" | "grad_norm_finish" => 1,
        _ => 3,
    }
}

#[test]
fn every_kernel_matches_lavapipe_on_the_interpreter() {
    // Without subgroups: the workgroup reductions are then shared-memory trees, the same
    // additions in the same order on both.
    let g = gpu_without_subgroups();
    let mut exact = vec![];
    let mut report = vec![];
    for entry in catalog::entries() {
        if entry.name.starts_with("coop_") || entry.name == "lora_down_subgroups" {
            continue;
        }
        let mut shape = vec![];
        if entry.param("subgroups").is_some() {
            shape.push(("subgroups".to_string(), "false".to_string()));
        }
        // Within the device's limits: under HESPER_WEBGPU_LIMITS (16 KiB of workgroup memory)
        // the attention kernels take a smaller tile, as `SeqTile::for_device` does.
        let limits = g.kernel_limits();
        let mut kernel = entry.build_with_limits(&shape, &limits);
        for smaller in ["medium", "portable"] {
            if kernel.is_err() && entry.param("tile").is_some() {
                shape.retain(|(name, _)| name != "tile");
                shape.push(("tile".to_string(), smaller.to_string()));
                kernel = entry.build_with_limits(&shape, &limits);
            }
        }
        let kernel = match kernel {
            Ok(kernel) => kernel,
            // A device smaller than lavapipe: the run at lavapipe's limits covers the rest.
            Err(e) if limits != hesper_dsl::Limits::default() => {
                report.push(format!("{}: not at these limits ({e})", entry.name));
                continue;
            }
            Err(e) => panic!("{}: {e}", entry.name),
        };
        // Under WebGPU's limits there are no f16 buffers: the run without them covers these.
        if kernel.uses_f16() && !g.supports_f16() {
            report.push(format!(
                "{}: not on a device without SHADER_F16",
                entry.name
            ));
            continue;
        }
        let (count, worst) = compare(g, &kernel, workgroups(&kernel), 7);
        report.push(format!(
            "{}: {count} differ, by {worst:.1e} of the largest",
            entry.name
        ));
        if count == 0 {
            exact.push(entry.name);
        }
        // Where lavapipe evaluates `exp` (softmax, SiLU, cross-entropy) its own way, or a sum
        // cancels: f32's rounding of the result's size.
        let inexact = [
            "decode_attention",
            "attention_backward_kv",
            "attention_backward_q",
            "swiglu_forward",
            "swiglu_backward",
            "swiglu_packed_forward",
            "swiglu_packed_backward",
            "swiglu_packed_forward_f16",
            "swiglu_packed_backward_f16",
            "cross_entropy",
            "cross_entropy_forward",
            "cross_entropy_stats",
            "rms_norm_backward",
        ];
        // The same, then rounded to f16 as it is stored: where the two `exp`s straddle a
        // rounding boundary, one ulp of f16 (2^−10 of the value, at most the largest's).
        if entry.name == "swiglu_packed_forward_half" {
            assert!(
                worst <= 1e-3,
                "{}: {count} elements differ, by {worst:e}",
                entry.name
            );
        } else if inexact.contains(&entry.name) {
            assert!(
                worst <= 1e-6,
                "{}: {count} elements differ, by {worst:e}",
                entry.name
            );
        } else {
            assert_eq!(count, 0, "{}: not bit for bit ({worst:e})", entry.name);
        }
    }
    println!("{}", report.join("\n"));
    println!("bit for bit: {} kernels: {}", exact.len(), exact.join(" "));
}

/// The tensor-core GEMM (cooperative matrices), which lavapipe cannot run, on the interpreter
/// against the f64 reference of its f16-rounded inputs: both products, f32 inputs rounded as they
/// are loaded and f16 inputs, f32 and f16 outputs, accumulation and scale, ragged rows, columns
/// and depth.
#[test]
fn the_tensor_core_gemm_is_right_on_the_interpreter() {
    use hesper_exec::half::f16;
    struct Case {
        name: &'static str,
        rows: usize,
        shape: &'static [(&'static str, &'static str)],
    }
    let cases = [
        Case {
            name: "coop_matmul_nt",
            rows: 50,
            shape: &[],
        },
        Case {
            name: "coop_matmul_nn",
            rows: 40,
            shape: &[],
        },
        Case {
            name: "coop_matmul_nt",
            rows: 33,
            shape: &[
                ("input_f16", "true"),
                ("weight_f16", "true"),
                ("output_f16", "false"),
                ("accumulate", "true"),
            ],
        },
        // A whole number of steps deep, rows of 4 (vec4 reads): the tiles inside `rows` and
        // `cols` read by one index a operand, the ragged ones clamp each row.
        Case {
            name: "coop_matmul_nt",
            rows: 50,
            shape: &[("cols", "48"), ("depth", "64")],
        },
        Case {
            name: "coop_matmul_nn",
            rows: 70,
            shape: &[("cols", "40"), ("depth", "48"), ("input_f16", "false")],
        },
        // One subgroup of four fragments, ragged, f16 out: the staged epilogue stores each
        // fragment into the subgroup's 16×16 of `c_tile` and reads it back (a race if a
        // fragment's store met an earlier one's reads).
        Case {
            name: "coop_matmul_nt",
            rows: 45,
            shape: &[("tile", "32x32x16_32x32"), ("output_f16", "true")],
        },
        // A tile 48 deep (three 16-deep fragments a step), six subgroups, ragged on both sides.
        Case {
            name: "coop_matmul_nt",
            rows: 130,
            shape: &[("tile", "64x96x48_32x32"), ("cols", "200"), ("depth", "96")],
        },
        // The standard `wide` tile (six subgroups of 64×64, 48 deep): `·W` ragged in rows,
        // columns and depth; `·Wᵀ` a whole number of steps deep with tiles inside the output.
        Case {
            name: "coop_matmul_nn",
            rows: 140,
            shape: &[("tile", "wide"), ("cols", "200"), ("depth", "100")],
        },
        Case {
            name: "coop_matmul_nt",
            rows: 256,
            shape: &[
                ("tile", "wide"),
                ("cols", "384"),
                ("depth", "144"),
                ("input_f16", "true"),
                ("weight_f16", "true"),
            ],
        },
        // Rows of 30 (not a multiple of 4): f16 elements read one by one.
        Case {
            name: "coop_matmul_nt",
            rows: 37,
            shape: &[
                ("cols", "36"),
                ("depth", "30"),
                ("input_f16", "true"),
                ("weight_f16", "true"),
            ],
        },
    ];
    for case in cases {
        let shape: Vec<(String, String)> = case
            .shape
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        // The H200's 48 KiB of workgroup memory, which the `wide` tile needs.
        let limits = hesper_dsl::Limits {
            max_workgroup_storage_bytes: 48 * 1024,
            ..hesper_dsl::Limits::default()
        };
        let entry = catalog::find(case.name).unwrap();
        let kernel = entry.build_with_limits(&shape, &limits).unwrap();
        let key = kernel.key();
        let u = |name: &str| match key.get(name) {
            Some(hesper_dsl::ShapeValue::U32(v)) => v as usize,
            other => panic!("{name}: {other:?}"),
        };
        let flag = |name: &str| key.get(name) == Some(hesper_dsl::ShapeValue::Bool(true));
        let (cols, depth, m) = (u("cols"), u("depth"), case.rows);
        let nt = case.name.ends_with("nt");
        let (input, output) = if nt { ("x", "y") } else { ("dy", "dx") };
        let mut rng = Rng::new(cols as u64 * 31 + m as u64);
        let x: Vec<f32> = (0..m * depth).map(|_| rng.next_f32()).collect();
        // NT: W [cols, depth]; NN: W [depth, cols].
        let w: Vec<f32> = (0..cols * depth).map(|_| rng.next_f32()).collect();
        let prior: Vec<f32> = (0..m * cols).map(|_| rng.next_f32()).collect();
        let scale = 0.75f32;
        let bytes = |v: &[f32], half: bool| -> Vec<u8> {
            if half {
                let h: Vec<f16> = v.iter().map(|x| f16::from_f32(*x)).collect();
                bytemuck::cast_slice(&h).to_vec()
            } else {
                bytemuck::cast_slice(v).to_vec()
            }
        };
        let accumulate = flag("accumulate");
        let start = if accumulate {
            prior.clone()
        } else {
            vec![f32::NAN; m * cols]
        };
        let (bm, bn) = (u("bm"), u("bn"));
        let mut run = Run::new([cols.div_ceil(bn) as u32, m.div_ceil(bm) as u32, 1]);
        run.subgroup_size = u("subgroup") as u32;
        run.buffers
            .insert(input.into(), bytes(&x, flag("input_f16")));
        run.buffers
            .insert("w".into(), bytes(&w, flag("weight_f16")));
        run.buffers
            .insert(output.into(), bytes(&start, flag("output_f16")));
        run.params.insert("rows".into(), ScalarValue::U32(m as u32));
        run.params.insert("scale".into(), ScalarValue::F32(scale));
        // An f32 input is multiplied by `input_scale` before it is rounded to f16.
        let input_scale = if flag("input_f16") { 1.0 } else { 4.0 };
        if !flag("input_f16") {
            let value = ScalarValue::F32(input_scale);
            run.params.insert("input_scale".into(), value);
        }
        interpret(&kernel, &mut run).unwrap_or_else(|e| panic!("{}: {e}", case.name));

        let h = |v: f32| f16::from_f32(v).to_f64();
        let mut want = vec![0f64; m * cols];
        for r in 0..m {
            for c in 0..cols {
                let sum: f64 = (0..depth)
                    .map(|k| {
                        let wv = if nt {
                            w[c * depth + k]
                        } else {
                            w[k * cols + c]
                        };
                        h(x[r * depth + k] * input_scale) * h(wv)
                    })
                    .sum();
                let before = if accumulate {
                    prior[r * cols + c] as f64
                } else {
                    0.0
                };
                want[r * cols + c] = before + scale as f64 * sum;
            }
        }
        let got: Vec<f64> = if flag("output_f16") {
            let v: Vec<f16> = run.read(output).unwrap();
            v.iter().map(|x| x.to_f64()).collect()
        } else {
            let v: Vec<f32> = run.read(output).unwrap();
            v.iter().map(|x| *x as f64).collect()
        };
        let largest = want.iter().fold(0f64, |a, v| a.max(v.abs()));
        // f32 sums of `depth` products; an f16 output rounds to half an f16 ulp more.
        let tol = if flag("output_f16") { 1e-3 } else { 1e-6 } * largest;
        for (i, (g, v)) in got.iter().zip(&want).enumerate() {
            assert!(
                (g - v).abs() <= tol,
                "{} {shape:?}: element {i} is {g}, {v} expected",
                case.name
            );
        }
    }
}

/// The tensor-core attention (cooperative matrices), which lavapipe cannot run, on the
/// interpreter against the f64 attention: the forward's output and log-sum-exp, and the
/// backward's dQ, dK, dV, over a padded batch (one sequence cut short), GQA, several blocks of
/// rows and steps of keys. `dO` is small (a mean loss's gradient) and scaled by 2^10 on the
/// way in, as the step does. Errors against f64 come from the f16 rounding of `Q`, `K`, `V`,
/// `dO`, `P`, `dS` (2⁻¹¹ relative each). Subgroups of 32 (NVIDIA's: two invocations a score
/// row), 16 (one) and 64 (four), each with a tile the executor may choose; the first three
/// read each step's rows a step ahead (the query gradients' keys in two buffers), the fourth
/// (16 invocations holding 32 rows) stages them as it reads them. The next three are the tiles
/// NVIDIA's devices take (`CoopSeqTile::standard`): the forward's 4 × 16, the key gradients' 2
/// × 64 with each step split between two subgroups a row tile, the query gradients' 4 × 32
/// (from the scores' gradients: split two ways too).
/// Where the fourth number is more than 1, the forward's, the key gradients' and the query
/// gradients' (from the scores' gradients) steps are split among that many subgroups a row
/// tile (their partial sums added as they are stored).
#[test]
fn the_tensor_core_attention_is_right_on_the_interpreter() {
    let tiles = [
        (32, 2, 16, 1),
        (16, 2, 16, 1),
        (64, 1, 32, 2),
        (16, 1, 32, 1),
    ];
    let standard = [(32, 4, 16, 1), (32, 2, 64, 2), (32, 4, 32, 1)];
    let split = [(32, 1, 64, 4), (16, 2, 64, 2)];
    for (subgroup, row_tiles, step, split) in tiles.into_iter().chain(standard).chain(split) {
        tensor_core_attention_on_the_interpreter(subgroup, row_tiles, step, split);
    }
}

fn tensor_core_attention_on_the_interpreter(
    subgroup: u32,
    row_tiles: usize,
    step: usize,
    split: usize,
) {
    use hesper_kernels::attention::{SeqShape, reference};
    println!(
        "subgroups of {subgroup}, {row_tiles} tiles of 16 rows, steps of {step}, the forward's \
         and key gradients' split {split} ways:"
    );
    let (batch, seq, heads, kv_heads, hd) = (2usize, 40usize, 2usize, 1usize, 32usize);
    let lens = [40usize, 29];
    let shape = SeqShape::new(batch, seq, heads, kv_heads, hd);
    let tau = shape.scale;
    let params = [
        ("head_dim", hd.to_string()),
        ("heads", heads.to_string()),
        ("kv_heads", kv_heads.to_string()),
        ("padded", "true".to_string()),
        ("row_tiles", row_tiles.to_string()),
        ("step", step.to_string()),
        ("subgroup", subgroup.to_string()),
    ];
    let params: Vec<(String, String)> = params
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect();
    // The H200's 48 KiB of workgroup memory (the executor's tiles take up to 47 KiB).
    let limits = hesper_dsl::Limits {
        max_workgroup_storage_bytes: 48 * 1024,
        ..hesper_dsl::Limits::default()
    };
    // `changed`: parameters set anew or added.
    let build_with = |name: &str, changed: &[(&str, String)]| {
        let entry = catalog::find(name).unwrap();
        let mut params = params.clone();
        params.retain(|(k, _)| changed.iter().all(|(c, _)| c != k));
        params.extend(changed.iter().map(|(k, v)| (k.to_string(), v.clone())));
        entry.build_with_limits(&params, &limits).unwrap()
    };
    let build = |name: &str| build_with(name, &[]);
    let mut rng = Rng::new(77);
    let q: Vec<f32> = (0..shape.q_len()).map(|_| rng.next_f32()).collect();
    let k: Vec<f32> = (0..shape.kv_len()).map(|_| rng.next_f32()).collect();
    let v: Vec<f32> = (0..shape.kv_len()).map(|_| rng.next_f32()).collect();
    let d_out: Vec<f32> = (0..shape.q_len()).map(|_| rng.next_f32() * 1e-3).collect();
    let to64 = |x: &[f32]| x.iter().map(|&v| v as f64).collect::<Vec<_>>();
    let (q64, k64, v64, do64) = (to64(&q), to64(&k), to64(&v), to64(&d_out));
    let (want_o, want_lse) = reference::attention_forward(&shape, Some(&lens), &q64, &k64, &v64);
    let (want_dq, want_dk, want_dv) =
        reference::attention_backward(&shape, Some(&lens), (&q64, &k64, &v64), &do64);
    let lens32: Vec<u32> = lens.iter().map(|&l| l as u32).collect();
    let blocks = seq.div_ceil(16 * row_tiles) as u32;
    let base = |workgroups: [u32; 3]| {
        let mut run = Run::new(workgroups)
            .buffer("q", &q)
            .buffer("k", &k)
            .buffer("v", &v)
            .buffer("lens", &lens32)
            .param("seq_len", ScalarValue::U32(seq as u32))
            .param("scale", ScalarValue::F32(tau));
        run.subgroup_size = subgroup;
        run
    };
    let check = |what: &str, got: &[f32], want: &[f64], tol: f64| {
        let largest = want.iter().fold(0f64, |a, w| a.max(w.abs()));
        assert!(largest > 0.0, "{what}: a reference of zeros tests nothing");
        let worst = worst(got.iter().zip(want).map(|(g, w)| (*g as f64 - w).abs()));
        println!(
            "{what}: within {:.2e} of its largest value",
            worst / largest
        );
        assert!(
            worst <= tol * largest,
            "{what}: off by {worst:e} (largest {largest:e})"
        );
    };

    let nan = |n: usize| vec![f32::NAN; n];
    let rows = batch * seq * heads;
    let mut run = base([blocks, heads as u32, batch as u32])
        .buffer("o", &nan(shape.q_len()))
        .buffer("lse", &nan(rows));
    let split_param = ("split", split.to_string());
    interpret(
        &build_with("coop_attention_forward", std::slice::from_ref(&split_param)),
        &mut run,
    )
    .unwrap();
    let o: Vec<f32> = run.read("o").unwrap();
    let lse: Vec<f32> = run.read("lse").unwrap();
    check("O", &o, &want_o, 2e-3);
    let worst_lse = worst(
        lse.iter()
            .zip(&want_lse)
            .map(|(g, w)| (*g as f64 - w).abs()),
    );
    assert!(worst_lse < 2e-3, "lse off by {worst_lse:e}");

    // The backward's statistics from the f64 forward: (lse, D = rowsum(dO ⊙ O)), 0 when padded.
    let mut stats = vec![0f32; 2 * rows];
    for (i, stat) in stats.chunks_mut(2).enumerate() {
        let (t, h) = (i / heads, i % heads);
        let (b, s) = (t / seq, t % seq);
        if s < lens[b] {
            let at = (t * heads + h) * hd;
            let d: f64 = (0..hd).map(|c| do64[at + c] * want_o[at + c]).sum();
            stat.copy_from_slice(&[want_lse[i] as f32, d as f32]);
        }
    }
    let grad = |run: Run| {
        run.buffer("d_out", &d_out)
            .buffer("stats", &stats)
            .param("grad_scale", ScalarValue::F32(1024.0))
            .param("grad_unscale", ScalarValue::F32(1.0 / 1024.0))
    };
    let mut run = grad(base([blocks, kv_heads as u32, batch as u32]))
        .buffer("d_k", &nan(shape.kv_len()))
        .buffer("d_v", &nan(shape.kv_len()));
    interpret(
        &build_with(
            "coop_attention_backward_kv",
            std::slice::from_ref(&split_param),
        ),
        &mut run,
    )
    .unwrap();
    check("dK", &run.read::<f32>("d_k").unwrap(), &want_dk, 2e-3);
    check("dV", &run.read::<f32>("d_v").unwrap(), &want_dv, 2e-3);
    let mut run =
        grad(base([blocks, heads as u32, batch as u32])).buffer("d_q", &nan(shape.q_len()));
    interpret(&build("coop_attention_backward_q"), &mut run).unwrap();
    check("dQ", &run.read::<f32>("d_q").unwrap(), &want_dq, 2e-3);

    // The scores' gradients kept: the key gradients also write `dSᵀ` into a workspace poisoned
    // with NaN, and `dQ` is one product over it, which must mask what was never written: with
    // this tile, and with the executor's 4 × 32 (blocks of 64 queries over key blocks of 32),
    // unsplit and split two ways (each subgroup a partial dQ over 16 of a step's keys).
    let side = seq.next_multiple_of(64);
    let scores = vec![f16::NAN; batch * heads * side * side];
    let mut run = grad(base([blocks, kv_heads as u32, batch as u32]))
        .buffer("d_k", &nan(shape.kv_len()))
        .buffer("d_v", &nan(shape.kv_len()))
        .buffer("d_scores", &scores);
    let write = [("write_scores", "true".to_string()), split_param];
    interpret(&build_with("coop_attention_backward_kv", &write), &mut run).unwrap();
    check(
        "dK (writing dS)",
        &run.read::<f32>("d_k").unwrap(),
        &want_dk,
        2e-3,
    );
    check(
        "dV (writing dS)",
        &run.read::<f32>("d_v").unwrap(),
        &want_dv,
        2e-3,
    );
    let scores: Vec<f16> = run.read("d_scores").unwrap();
    for (q_tiles, q_step, q_split) in [(row_tiles, step, split), (4, 32, 1), (4, 32, 2)] {
        let q_blocks = seq.div_ceil(16 * q_tiles) as u32;
        let mut run = Run::new([q_blocks, heads as u32, batch as u32])
            .buffer("k", &k)
            .buffer("d_scores", &scores)
            .buffer("lens", &lens32)
            .buffer("d_q", &nan(shape.q_len()))
            .param("seq_len", ScalarValue::U32(seq as u32))
            .param("grad_unscale", ScalarValue::F32(1.0 / 1024.0));
        run.subgroup_size = subgroup;
        let tile = [
            ("row_tiles", q_tiles.to_string()),
            ("step", q_step.to_string()),
            ("split", q_split.to_string()),
        ];
        let kernel = build_with("coop_attention_backward_q_from_scores", &tile);
        interpret(&kernel, &mut run).unwrap();
        let what = format!("dQ (from dS, {q_tiles} × {q_step} split {q_split} ways)");
        check(&what, &run.read::<f32>("d_q").unwrap(), &want_dq, 2e-3);
    }
}
