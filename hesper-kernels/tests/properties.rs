//! Random shapes and parameters for every `execute_*` family: each call either returns `Ok`
//! with the f64 reference's answer, or an `Err` that names the kernel and leaves its recorder
//! empty (nothing half-recorded) — never a panic, an abort or a hang. Shapes are small and
//! often degenerate (zero rows, one column, odd widths, ranks and head sizes out of range), and
//! a share of the cases mis-sizes one buffer or breaks one documented rule on purpose.
//!
//! `HESPER_PROPERTY_CASES` sets the cases per family (default 6, for CI);
//! `HESPER_PROPERTY_SECONDS` instead runs each family for that long. A failure names the
//! family and the case's seed: `HESPER_PROPERTY_SEED=N` reruns from that case.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::{Duration, Instant};

use hesper_exec::{ExecError, Gpu, GpuBuffer, Recorder};
use hesper_kernels::attention::reference as ar;
use hesper_kernels::attention::{
    self, DecodeShape, SeqGrads, SeqInputs, SeqSaved, SeqShape, ValidLengths,
};
use hesper_kernels::linear::{self, Gemm, Product, Weights, execute_gemm, gemv, pack_ternary};
use hesper_kernels::lora::{self, LoraBackward, lora_scratch_len};
use hesper_kernels::loss::{IGNORE_INDEX, LossOutputs};
use hesper_kernels::optim::{self, AdamW, Clip, Step, grad_norm_partials_len};
use hesper_kernels::rope::{Positions, RopeTable};
use hesper_kernels::testing::{Rng, compare, f64s, gpu};
use hesper_kernels::{argmax, elementwise, ffn, loss as ce, norm, rope};

/// What a case's call must do.
#[derive(Debug)]
enum Expect {
    /// Return `Ok` and the reference's answer.
    Valid,
    /// Return an `Err` naming the kernel: the inputs break this rule.
    Invalid(String),
}

/// A case's outcome: `Ok(true)` to compare the outputs next, `Ok(false)` when the call was
/// rightly refused, `Err` with what went wrong.
type Outcome = Result<bool, String>;

/// Record `call` into a fresh recorder and submit it, then judge the result against `expect`:
/// a refusal must name `kernel` and leave the recorder empty.
fn judge(
    g: &Gpu,
    expect: &Expect,
    kernel: &str,
    call: impl FnOnce(&mut Recorder<'_>) -> Result<(), ExecError>,
) -> Outcome {
    let mut rec = g.recorder();
    match (call(&mut rec), expect) {
        (Ok(()), Expect::Valid) => {
            rec.submit().map_err(|e| format!("submit: {e}"))?;
            Ok(true)
        }
        (Ok(()), Expect::Invalid(why)) => Err(format!("accepted, although {why}")),
        (Err(e), Expect::Valid) => Err(format!("refused a valid call: {e}")),
        (Err(e), Expect::Invalid(why)) => {
            let text = e.to_string();
            if !text.contains(kernel) {
                return Err(format!(
                    "the error for `{why}` does not name {kernel}: {text}"
                ));
            }
            if !rec.is_empty() {
                return Err(format!(
                    "refused ({text}) with {} launches left recorded",
                    rec.len()
                ));
            }
            Ok(false)
        }
    }
}

/// `got` against `want`, the largest error relative to the largest reference value (a NaN, an
/// unwritten poisoned element, is infinitely wrong).
fn close(what: &str, got: &[f32], want: &[f64], tol: f64) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!(
            "{what}: {} values, {} expected",
            got.len(),
            want.len()
        ));
    }
    if got.is_empty() {
        return Ok(());
    }
    let c = compare(got, want, 1e-6);
    let scale = c.scale.max(1e-3);
    if c.max_abs / scale <= tol {
        Ok(())
    } else {
        Err(format!("{what}: {c}"))
    }
}

/// `got` against `want` within `tol` of the larger of 1 and the largest `|want|` (values that
/// are differences of terms of about 1, as losses of logits are).
fn close_abs(what: &str, got: &[f32], want: &[f64], tol: f64) -> Result<(), String> {
    let c = compare(got, want, 1e-6);
    if got.len() == want.len() && c.max_abs <= tol * c.scale.max(1.0) {
        Ok(())
    } else {
        Err(format!("{what}: {c}"))
    }
}

fn read(g: &Gpu, b: &GpuBuffer<f32>) -> Vec<f32> {
    b.read(g).expect("read back")
}

fn up(g: &Gpu, v: &[f32]) -> GpuBuffer<f32> {
    g.upload(v).expect("upload")
}

fn poison(g: &Gpu, n: usize) -> GpuBuffer<f32> {
    g.filled(n, f32::NAN).expect("allocate")
}

fn below(rng: &mut Rng, n: usize) -> usize {
    rng.next_u32() as usize % n
}

fn coin(rng: &mut Rng, percent: u32) -> bool {
    rng.next_u32() % 100 < percent
}

/// One of a case's buffers, mis-sized by one element when `wrong` names it (in which case the
/// call must refuse it).
struct Sizes {
    wrong: Option<usize>,
    names: Vec<&'static str>,
}

impl Sizes {
    /// With a 30% chance, one of `names` will be mis-sized.
    fn draw(rng: &mut Rng, names: &[&'static str]) -> Sizes {
        let wrong = coin(rng, 30).then(|| below(rng, names.len()));
        Sizes {
            wrong,
            names: names.to_vec(),
        }
    }

    /// `len`, or `len ± 1` for the mis-sized buffer.
    fn len(&self, name: &str, len: usize) -> usize {
        match self.wrong {
            Some(w) if self.names[w] == name => {
                if len == 0 {
                    1
                } else {
                    len + 1
                }
            }
            _ => len,
        }
    }

    fn expect(&self, rules: Option<String>) -> Expect {
        match (self.wrong, rules) {
            (_, Some(rule)) => Expect::Invalid(rule),
            (Some(w), None) => Expect::Invalid(format!("{} is mis-sized", self.names[w])),
            (None, None) => Expect::Valid,
        }
    }
}

/// Run `case` over the family's seeds; a panic or a failure names the family and the seed.
fn run_family(family: &str, case: fn(&Gpu, &mut Rng) -> Result<String, String>) {
    let g = gpu();
    let env = |name: &str| std::env::var(name).ok().and_then(|v| v.parse::<u64>().ok());
    let first = env("HESPER_PROPERTY_SEED").unwrap_or(0);
    let (cases, until) = match env("HESPER_PROPERTY_SECONDS") {
        Some(s) => (u64::MAX, Some(Instant::now() + Duration::from_secs(s))),
        None => (env("HESPER_PROPERTY_CASES").unwrap_or(6), None),
    };
    let (mut valid, mut refused) = (0, 0);
    for seed in first..first.saturating_add(cases) {
        if until.is_some_and(|t| Instant::now() > t) {
            break;
        }
        let mut rng = Rng::new(seed.wrapping_mul(0x9E37_79B9) + 1);
        match catch_unwind(AssertUnwindSafe(|| case(g, &mut rng))) {
            Ok(Ok(what)) if what.starts_with("refused") => refused += 1,
            Ok(Ok(_)) => valid += 1,
            Ok(Err(e)) => panic!("{family}, seed {seed}: {e}"),
            Err(_) => panic!("{family}, seed {seed}: the call panicked (above)"),
        }
    }
    println!("{family}: {valid} cases matched the reference, {refused} were refused");
}

fn verdict(outcome: Outcome, what: String) -> Result<Option<String>, String> {
    match outcome {
        Ok(true) => Ok(Some(what)),
        Ok(false) => Ok(None),
        Err(e) => Err(format!("{what}: {e}")),
    }
}

/// `Ok("refused …")` for a rightly refused case.
fn refused(what: &str) -> Result<String, String> {
    Ok(format!("refused {what}"))
}

// ---- GEMM: dense, scaled, ternary; both products; accumulation ------------------------------

fn gemm_case(g: &Gpu, rng: &mut Rng) -> Result<String, String> {
    let (m, n, k) = (below(rng, 40), below(rng, 40), below(rng, 40));
    let product = if coin(rng, 50) {
        Product::Nt
    } else {
        Product::Nn
    };
    let accumulate = coin(rng, 50);
    let kind = below(rng, 3);
    let (in_cols, out_cols) = match product {
        Product::Nt => (k, n),
        Product::Nn => (n, k),
    };
    let sizes = Sizes::draw(rng, &["input", "w", "output"]);
    let x = rng.vec(sizes.len("input", m * in_cols), 1.0);
    let prior = rng.vec(sizes.len("output", m * out_cols), 1.0);
    let scale = 0.5 + rng.next_f32().abs();
    let ternary: Vec<i8> = (0..n * k).map(|_| below(rng, 3) as i8 - 1).collect();
    let dense = rng.vec(n * k, 1.0);
    let w_host: Vec<f64> = match kind {
        0 => f64s(&dense),
        1 => dense.iter().map(|&v| v as f64 * scale as f64).collect(),
        _ => linear::reference::dequantize(&ternary, scale as f64),
    };
    let xb = up(g, &x);
    let mut out = if accumulate {
        up(g, &prior)
    } else {
        poison(g, prior.len())
    };
    // A mis-sized weight has one element (dense) or one packed word (ternary) too many.
    let extra = sizes.len("w", n * k) - n * k;
    let dense_b = up(g, &[dense.clone(), vec![0.0; extra]].concat());
    let packed = pack_ternary(&ternary).map_err(|e| e.to_string())?;
    let packed = [packed, vec![0; extra]].concat();
    let packed_b = g.upload(&packed).map_err(|e| e.to_string())?;
    let weights = match kind {
        0 => Weights::Dense(&dense_b),
        1 => Weights::ScaledDense { w: &dense_b, scale },
        _ => Weights::Ternary {
            packed: &packed_b,
            scale,
        },
    };
    let gemm = Gemm::new(product, (m, n, k), accumulate);
    let kernel = match (product, kind) {
        (Product::Nt, 2) => "bitlinear_forward",
        (Product::Nn, 2) => "bitlinear_transpose",
        (Product::Nt, _) => "matmul_nt",
        (Product::Nn, _) => "matmul_nn",
    };
    let expect = sizes.expect(None);
    let what = format!("{product:?} {m}×{n}×{k} kind {kind} accumulate {accumulate} {expect:?}");
    let outcome = judge(g, &expect, kernel, |rec| {
        execute_gemm(rec, &gemm, &xb, weights, &mut out)
    });
    let Some(what) = verdict(outcome, what.clone())? else {
        return refused(&what);
    };
    let mut want = match product {
        Product::Nt => linear::reference::matmul_nt(&f64s(&x), &w_host, m, n, k),
        Product::Nn => linear::reference::matmul_nn(&f64s(&x), &w_host, m, n, k),
    };
    if accumulate {
        for (w, p) in want.iter_mut().zip(&prior) {
            *w += *p as f64;
        }
    }
    close(&what, &read(g, &out), &want, 1e-5)?;
    Ok(what)
}

#[test]
fn gemm_calls_match_the_reference_or_are_refused() {
    run_family("gemm", gemm_case);
}

// ---- gemv_lora: decoding's projection with its adapter --------------------------------------

fn gemv_lora_case(g: &Gpu, rng: &mut Rng) -> Result<String, String> {
    let (m, n, k) = (below(rng, 6), below(rng, 20), below(rng, 20));
    let rank = below(rng, gemv::MAX_RANK + 2);
    let accumulate = coin(rng, 50);
    let sizes = Sizes::draw(rng, &["x", "w", "a", "b", "y"]);
    let x = rng.vec(sizes.len("x", m * k), 1.0);
    let w = rng.vec(sizes.len("w", n * k), 1.0);
    let a = rng.vec(sizes.len("a", rank * k), 1.0);
    let b = rng.vec(sizes.len("b", n * rank), 1.0);
    let prior = rng.vec(sizes.len("y", m * n), 1.0);
    let scale = 2.0 * rng.next_f32();
    let rule = if !(1..=gemv::MAX_ROWS).contains(&m) {
        Some(format!("{m} rows"))
    } else if !(1..=gemv::MAX_RANK).contains(&rank) {
        Some(format!("rank {rank}"))
    } else if n == 0 || k == 0 {
        Some(format!("n = {n}, k = {k}"))
    } else {
        None
    };
    let expect = sizes.expect(rule);
    let (xb, wb, ab, bb) = (up(g, &x), up(g, &w), up(g, &a), up(g, &b));
    let mut y = if accumulate {
        up(g, &prior)
    } else {
        poison(g, prior.len())
    };
    let what = format!("{m}×{n}×{k} rank {rank} accumulate {accumulate} {expect:?}");
    let adapter = gemv::Adapter {
        a: &ab,
        b: &bb,
        rank,
        scale,
    };
    let outcome = judge(g, &expect, "gemv_lora", |rec| {
        gemv::execute_gemv_lora(rec, (&xb, &wb), adapter, &mut y, (m, n, k), accumulate)
    });
    let Some(what) = verdict(outcome, what.clone())? else {
        return refused(&what);
    };
    let mut base = linear::reference::matmul_nt(&f64s(&x), &f64s(&w), m, n, k);
    if accumulate {
        for (v, p) in base.iter_mut().zip(&prior) {
            *v += *p as f64;
        }
    }
    let (_, want) =
        lora::reference::lora_forward(&f64s(&x), &f64s(&a), &f64s(&b), &base, rank, scale as f64);
    close(&what, &read(g, &y), &want, 1e-5)?;
    Ok(what)
}

#[test]
fn gemv_lora_calls_match_the_reference_or_are_refused() {
    run_family("gemv_lora", gemv_lora_case);
}

// ---- elementwise: embedding, bias, residual add ---------------------------------------------

fn elementwise_case(g: &Gpu, rng: &mut Rng) -> Result<String, String> {
    match below(rng, 3) {
        0 => {
            let (vocab, dim, t) = (1 + below(rng, 20), below(rng, 12), below(rng, 10));
            let sizes = Sizes::draw(rng, &["table", "out"]);
            let table = rng.vec(sizes.len("table", vocab * dim), 1.0);
            // Ids past the table give rows of zeros.
            let tokens: Vec<u32> = (0..t).map(|_| below(rng, vocab + 3) as u32).collect();
            // The table is any whole number of rows: one more row of one column is as good.
            let sizes = match sizes.wrong.map(|w| sizes.names[w]) {
                Some("table") if dim == 1 => Sizes {
                    wrong: None,
                    ..sizes
                },
                _ => sizes,
            };
            let rule = (dim == 0).then(|| "dim = 0".to_string());
            let expect = sizes.expect(rule);
            let (tb, ids) = (up(g, &table), g.upload(&tokens).map_err(|e| e.to_string())?);
            let mut out = poison(g, sizes.len("out", t * dim));
            let what = format!("embedding V {vocab} dim {dim} T {t} {expect:?}");
            let outcome = judge(g, &expect, "embedding", |rec| {
                elementwise::execute_embedding(rec, &tb, &ids, dim, &mut out)
            });
            let Some(what) = verdict(outcome, what.clone())? else {
                return refused(&what);
            };
            let want = elementwise::reference::embedding(&f64s(&table), &tokens, dim);
            close(&what, &read(g, &out), &want, 0.0)?;
            Ok(what)
        }
        1 => {
            let (rows, cols) = (below(rng, 6), below(rng, 12));
            let sizes = Sizes::draw(rng, &["y", "bias"]);
            let y = rng.vec(sizes.len("y", rows * cols), 1.0);
            let bias = rng.vec(sizes.len("bias", cols), 1.0);
            // `y` is any whole number of rows of the bias's width (a mis-sized buffer can still
            // be one: 20 elements are 4 rows of a bias of 5).
            let whole_rows = !bias.is_empty() && y.len().is_multiple_of(bias.len());
            let sizes = match sizes.wrong {
                Some(_) if whole_rows => Sizes {
                    wrong: None,
                    ..sizes
                },
                _ => sizes,
            };
            let rule = bias.is_empty().then(|| "the bias is empty".to_string());
            let expect = sizes.expect(rule);
            let (mut yb, bb) = (up(g, &y), up(g, &bias));
            let what = format!("add_bias {rows}×{cols} {expect:?}");
            let outcome = judge(g, &expect, "add_bias", |rec| {
                elementwise::execute_add_bias(rec, &mut yb, &bb)
            });
            let Some(what) = verdict(outcome, what.clone())? else {
                return refused(&what);
            };
            let want = elementwise::reference::add_bias(&f64s(&y), &f64s(&bias));
            close(&what, &read(g, &yb), &want, 1e-7)?;
            Ok(what)
        }
        _ => {
            let n = below(rng, 40);
            let sizes = Sizes::draw(rng, &["y"]);
            let x = rng.vec(n, 1.0);
            let y = rng.vec(sizes.len("y", n), 1.0);
            let expect = sizes.expect(None);
            let (xb, mut yb) = (up(g, &x), up(g, &y));
            let what = format!("add {n} {expect:?}");
            let outcome = judge(g, &expect, "add", |rec| {
                elementwise::execute_add(rec, &xb, &mut yb)
            });
            let Some(what) = verdict(outcome, what.clone())? else {
                return refused(&what);
            };
            let want = elementwise::reference::add(&f64s(&x), &f64s(&y));
            close(&what, &read(g, &yb), &want, 1e-7)?;
            Ok(what)
        }
    }
}

#[test]
fn elementwise_calls_match_the_reference_or_are_refused() {
    run_family("elementwise", elementwise_case);
}

// ---- FFN activations: SwiGLU and ReLU² gating, forward and backward -------------------------

fn ffn_case(g: &Gpu, rng: &mut Rng) -> Result<String, String> {
    let n = below(rng, 50);
    let swiglu = coin(rng, 50);
    let backward = coin(rng, 50);
    let sizes = Sizes::draw(rng, &["up", "d_h", "out"]);
    let gate = rng.vec(n, 3.0);
    let upv = rng.vec(sizes.len("up", n), 3.0);
    let d_h = rng.vec(sizes.len("d_h", n), 1.0);
    let sizes = if !backward && sizes.wrong.is_some_and(|w| sizes.names[w] == "d_h") {
        Sizes {
            wrong: None,
            ..sizes
        }
    } else {
        sizes
    };
    let expect = sizes.expect(None);
    let (gb, ub, db) = (up(g, &gate), up(g, &upv), up(g, &d_h));
    let mut out = poison(g, sizes.len("out", n));
    let mut out2 = poison(g, n);
    let name = match (swiglu, backward) {
        (true, false) => "swiglu_forward",
        (true, true) => "swiglu_backward",
        (false, false) => "relu_sqr_mul_forward",
        (false, true) => "relu_sqr_mul_backward",
    };
    let what = format!("{name} {n} {expect:?}");
    let outcome = judge(g, &expect, name, |rec| match (swiglu, backward) {
        (true, false) => ffn::execute_swiglu_forward(rec, &gb, &ub, &mut out),
        (true, true) => ffn::execute_swiglu_backward(rec, &gb, &ub, &db, &mut out, &mut out2),
        (false, false) => ffn::execute_relu_sqr_mul_forward(rec, &gb, &ub, &mut out),
        (false, true) => {
            ffn::execute_relu_sqr_mul_backward(rec, &gb, &ub, &db, &mut out, &mut out2)
        }
    });
    let Some(what) = verdict(outcome, what.clone())? else {
        return refused(&what);
    };
    let (gate, upv, d_h) = (f64s(&gate), f64s(&upv), f64s(&d_h));
    let r = |v| close(&what, &read(g, &out), v, 1e-5);
    match (swiglu, backward) {
        (true, false) => r(&ffn::reference::swiglu_forward(&gate, &upv))?,
        (false, false) => r(&ffn::reference::relu_sqr_mul_forward(&gate, &upv))?,
        (s, true) => {
            let (dg, du) = if s {
                ffn::reference::swiglu_backward(&gate, &upv, &d_h)
            } else {
                ffn::reference::relu_sqr_mul_backward(&gate, &upv, &d_h)
            };
            r(&dg)?;
            close(&what, &read(g, &out2), &du, 1e-5)?;
        }
    }
    Ok(what)
}

#[test]
fn ffn_calls_match_the_reference_or_are_refused() {
    run_family("ffn", ffn_case);
}

// ---- RMSNorm forward and backward -----------------------------------------------------------

fn norm_case(g: &Gpu, rng: &mut Rng) -> Result<String, String> {
    let (rows, cols) = (below(rng, 6), below(rng, 40));
    let eps = match below(rng, 5) {
        0 => 0.0,
        1 => -1e-5,
        2 => f32::NAN,
        _ => 1e-5,
    };
    let backward = coin(rng, 50);
    let accumulate = coin(rng, 50);
    let sizes = Sizes::draw(rng, &["gamma", "rstd", "dy"]);
    let x = rng.vec(rows * cols, 2.0);
    let gamma = rng.vec(sizes.len("gamma", cols), 1.0);
    let dy = rng.vec(sizes.len("dy", rows * cols), 1.0);
    let prior = rng.vec(rows * cols, 1.0);
    let host_x = f64s(&x);
    // The backward's saved `rstd`, from the reference (no rows of no columns have none).
    let want_rstd = match cols {
        0 => vec![],
        _ => {
            norm::reference::rms_norm_forward(&host_x, &f64s(&gamma[..cols.min(gamma.len())]), 1e-5)
                .1
        }
    };
    let rstd_host: Vec<f32> = (0..sizes.len("rstd", rows))
        .map(|i| want_rstd.get(i).copied().unwrap_or(1.0) as f32)
        .collect();
    let (xb, gb, rb, db) = (up(g, &x), up(g, &gamma), up(g, &rstd_host), up(g, &dy));
    let mut out = if backward && accumulate {
        up(g, &prior)
    } else {
        poison(g, rows * cols)
    };
    let mut rstd_out = poison(g, sizes.len("rstd", rows));
    // The columns are gamma's length (a mis-sized gamma of one over no rows is fine).
    let rule = if gamma.is_empty() {
        Some("no columns".to_string())
    } else if !(backward || eps.is_finite() && eps >= 0.0) {
        Some(format!("eps = {eps}"))
    } else {
        None
    };
    // The forward takes no dy; `x` is rows of gamma's width, and no rows are rows of any.
    let sizes = match sizes.wrong.map(|w| sizes.names[w]) {
        Some("dy") if !backward => Sizes {
            wrong: None,
            ..sizes
        },
        Some("gamma") if rows == 0 => Sizes {
            wrong: None,
            ..sizes
        },
        _ => sizes,
    };
    let expect = sizes.expect(rule);
    let name = if backward {
        "rms_norm_backward"
    } else {
        "rms_norm_forward"
    };
    let what = format!("{name} {rows}×{cols} eps {eps} accumulate {accumulate} {expect:?}");
    let outcome = judge(g, &expect, name, |rec| {
        if backward {
            norm::execute_rms_norm_backward(rec, &xb, &gb, &rb, &db, &mut out, accumulate)
        } else {
            norm::execute_rms_norm_forward(rec, &xb, &gb, &mut out, &mut rstd_out, eps)
        }
    });
    let Some(what) = verdict(outcome, what.clone())? else {
        return refused(&what);
    };
    let gamma = f64s(&gamma);
    if backward {
        let (dx, _) = norm::reference::rms_norm_backward(&host_x, &gamma, &f64s(&dy), 1e-5);
        let mut want = dx;
        if accumulate {
            for (w, p) in want.iter_mut().zip(&prior) {
                *w += *p as f64;
            }
        }
        // Against inputs of about 1: one column's gradient cancels to about 0.
        close_abs(&what, &read(g, &out), &want, 1e-5)?;
    } else {
        let (y, rstd) = norm::reference::rms_norm_forward(&host_x, &gamma, eps as f64);
        close(&what, &read(g, &out), &y, 1e-5)?;
        close(&what, &read(g, &rstd_out), &rstd, 1e-5)?;
    }
    Ok(what)
}

#[test]
fn rms_norm_calls_match_the_reference_or_are_refused() {
    run_family("rms_norm", norm_case);
}

// ---- Cross-entropy, fused forward and backward ----------------------------------------------

fn loss_case(g: &Gpu, rng: &mut Rng) -> Result<String, String> {
    let (t, vocab) = (below(rng, 6), below(rng, 40));
    let sizes = Sizes::draw(rng, &["logits", "d_logits", "token_loss"]);
    let logits = rng.vec(sizes.len("logits", t * vocab), 4.0);
    // Targets, masked rows and ids past the vocabulary (masked too).
    let labels: Vec<i32> = (0..t)
        .map(|_| match below(rng, 5) {
            0 => IGNORE_INDEX,
            1 => vocab as i32 + below(rng, 3) as i32,
            _ => below(rng, vocab.max(1)) as i32,
        })
        .collect();
    let rule = (vocab == 0).then(|| "vocab = 0".to_string());
    let expect = sizes.expect(rule);
    let lb = up(g, &logits);
    let labels_b = g.upload(&labels).map_err(|e| e.to_string())?;
    let mut d_logits = poison(g, sizes.len("d_logits", t * vocab));
    let mut token_loss = poison(g, sizes.len("token_loss", t));
    let mut mean = poison(g, 1);
    let mut count = g.filled(1, u32::MAX).map_err(|e| e.to_string())?;
    let what = format!("cross_entropy T {t} V {vocab} {expect:?}");
    let outcome = judge(g, &expect, "cross_entropy", |rec| {
        let out = LossOutputs {
            token_loss: &mut token_loss,
            loss: &mut mean,
            count: &mut count,
        };
        ce::execute_cross_entropy(rec, &lb, &labels_b, vocab, &mut d_logits, out)
    });
    let Some(what) = verdict(outcome, what.clone())? else {
        return refused(&what);
    };
    let host = f64s(&logits);
    let (per_token, want_mean, want_count) =
        ce::reference::cross_entropy_forward(&host, &labels, vocab);
    let d = ce::reference::cross_entropy_backward(&host, &labels, vocab);
    // Losses are `lse − z` of logits up to 4: f32's error is absolute, of their size.
    close_abs(&what, &read(g, &token_loss), &per_token, 1e-6)?;
    close_abs(&what, &read(g, &mean), &[want_mean], 1e-6)?;
    close_abs(&what, &read(g, &d_logits), &d, 1e-6)?;
    let got_count = count.read(g).map_err(|e| e.to_string())?[0];
    if got_count as usize != want_count {
        return Err(format!("{what}: N = {got_count}, {want_count} expected"));
    }
    Ok(what)
}

#[test]
fn cross_entropy_calls_match_the_reference_or_are_refused() {
    run_family("cross_entropy", loss_case);
}

// ---- LoRA forward and the whole LoRA backward -----------------------------------------------

fn lora_case(g: &Gpu, rng: &mut Rng) -> Result<String, String> {
    let (t, input, output, rank) = (below(rng, 8), below(rng, 12), below(rng, 12), below(rng, 6));
    let backward = coin(rng, 50);
    let scale = 2.0 * rng.next_f32();
    let sizes = Sizes::draw(rng, &["x", "a", "b", "dy", "dx"]);
    let x = rng.vec(sizes.len("x", t * input), 1.0);
    let a = rng.vec(sizes.len("a", rank * input), 1.0);
    let b = rng.vec(sizes.len("b", output * rank), 1.0);
    let dy = rng.vec(sizes.len("dy", t * output), 1.0);
    let prior = rng.vec(sizes.len("dx", t * input), 1.0);
    let y0 = rng.vec(t * output, 1.0);
    let sizes = match sizes.wrong.map(|w| sizes.names[w]) {
        // The forward reads no dy and writes no dx.
        Some("dy" | "dx") if !backward => Sizes {
            wrong: None,
            ..sizes
        },
        // The forward takes its widths from A and B: over no tokens, any whole rows will do.
        Some("a") if !backward && t == 0 && rank > 0 && a.len().is_multiple_of(rank) => Sizes {
            wrong: None,
            ..sizes
        },
        Some("b") if !backward && t == 0 && rank > 0 && b.len().is_multiple_of(rank) => Sizes {
            wrong: None,
            ..sizes
        },
        _ => sizes,
    };
    // The widths the call sees (a mis-sized A or B over no tokens is another width).
    let (seen_in, seen_out) = match (backward, t, rank) {
        (false, 0, 1..) => (a.len() / rank, b.len() / rank),
        _ => (input, output),
    };
    let rule = if rank == 0 || seen_in == 0 || seen_out == 0 {
        Some(format!("rank {rank}, in {seen_in}, out {seen_out}"))
    } else {
        None
    };
    let expect = sizes.expect(rule);
    let (xh, ah, bh) = (f64s(&x), f64s(&a), f64s(&b));
    let what = format!("lora T {t} in {input} out {output} r {rank} bwd {backward} {expect:?}");
    let (xb, ab, bb) = (up(g, &x), up(g, &a), up(g, &b));
    if !backward {
        let mut h = poison(g, t * rank);
        let mut y = up(g, &y0);
        let outcome = judge(g, &expect, "lora", |rec| {
            lora::execute_lora_forward(rec, &xb, &ab, &bb, rank, scale, &mut h, &mut y)
        });
        let Some(what) = verdict(outcome, what.clone())? else {
            return refused(&what);
        };
        let (want_h, want_y) =
            lora::reference::lora_forward(&xh, &ah, &bh, &f64s(&y0), rank, scale as f64);
        close(&what, &read(g, &h), &want_h, 1e-5)?;
        close(&what, &read(g, &y), &want_y, 1e-5)?;
        return Ok(what);
    }
    // The forward's saved h, from the reference (the backward takes it as given).
    let h_host: Vec<f32> =
        if rank > 0 && input > 0 && x.len() == t * input && a.len() == rank * input {
            let zero = vec![0.0; t * output.max(1)];
            let b1 = vec![0.0; output.max(1) * rank];
            let (h, _) = lora::reference::lora_forward(&xh, &ah, &b1, &zero, rank, 1.0);
            h.iter().map(|&v| v as f32).collect()
        } else {
            vec![0.5; t * rank]
        };
    let (hb, dyb) = (up(g, &h_host), up(g, &dy));
    let mut dh = poison(g, t * rank);
    let mut scratch = poison(g, lora_scratch_len(t, input + output, rank.max(1)).max(1));
    let mut da = poison(g, rank * input);
    let mut db = poison(g, output * rank);
    let mut dx = up(g, &prior);
    let outcome = judge(g, &expect, "lora", |rec| {
        let inputs = LoraBackward {
            x: &xb,
            a: &ab,
            b: &bb,
            h: &hb,
            dy: &dyb,
        };
        lora::execute_lora_backward(
            rec,
            &inputs,
            rank,
            scale,
            &mut dh,
            &mut scratch,
            &mut da,
            &mut db,
            &mut dx,
        )
    });
    let Some(what) = verdict(outcome, what.clone())? else {
        return refused(&what);
    };
    let (want_da, want_db, want_dx) =
        lora::reference::lora_backward(&xh, &ah, &bh, &f64s(&dy), rank, scale as f64);
    let want_dx: Vec<f64> = want_dx
        .iter()
        .zip(&prior)
        .map(|(d, p)| d + *p as f64)
        .collect();
    close(&what, &read(g, &da), &want_da, 1e-5)?;
    close(&what, &read(g, &db), &want_db, 1e-5)?;
    close(&what, &read(g, &dx), &want_dx, 1e-5)?;
    Ok(what)
}

#[test]
fn lora_calls_match_the_reference_or_are_refused() {
    run_family("lora", lora_case);
}

// ---- AdamW (hyper-parameters in and out of range) and the global gradient norm --------------

fn optim_case(g: &Gpu, rng: &mut Rng) -> Result<String, String> {
    let n = below(rng, 40);
    let pick = |rng: &mut Rng, good: f64, bad: &[f64]| {
        if coin(rng, 95) {
            good
        } else {
            bad[below(rng, bad.len())]
        }
    };
    let opt = AdamW {
        beta1: pick(rng, 0.9, &[1.0, -0.1, f64::NAN]),
        beta2: pick(rng, 0.999, &[1.5, f64::INFINITY]),
        eps: pick(rng, 1e-8, &[0.0, -1e-8, f64::NAN]),
        weight_decay: {
            let decay = 0.01 * below(rng, 3) as f64;
            pick(rng, decay, &[-0.1, f64::NAN])
        },
    };
    let lr = pick(rng, 1e-3, &[-1e-3, f64::NAN, f64::INFINITY]) as f32;
    let t = 1.0 + below(rng, 5) as f64;
    let t = pick(rng, t, &[0.0]) as u32;
    let clip = coin(rng, 50);
    let max_norm = pick(rng, 0.5, &[0.0, -1.0, f64::NAN]) as f32;
    let sizes = Sizes::draw(rng, &["grad", "m", "v"]);
    let theta = rng.vec(n, 1.0);
    let grad = rng.vec(sizes.len("grad", n), 1.0);
    let m0 = rng.vec(sizes.len("m", n), 0.1);
    let v0: Vec<f32> = (0..sizes.len("v", n))
        .map(|_| rng.next_f32().abs() * 0.01)
        .collect();
    let rule = if t == 0 {
        Some("t = 0".to_string())
    } else if !(0.0..1.0).contains(&opt.beta1) || !(0.0..1.0).contains(&opt.beta2) {
        Some(format!("betas {} {}", opt.beta1, opt.beta2))
    } else if !(opt.eps.is_finite() && opt.eps > 0.0) {
        Some(format!("eps {}", opt.eps))
    } else if !(opt.weight_decay.is_finite() && opt.weight_decay >= 0.0) {
        Some(format!("weight decay {}", opt.weight_decay))
    } else if !(lr.is_finite() && lr >= 0.0) {
        Some(format!("lr {lr}"))
    } else if clip && !(max_norm.is_finite() && max_norm > 0.0) {
        Some(format!("max_norm {max_norm}"))
    } else {
        None
    };
    let expect = sizes.expect(rule);
    let (gb, mut mb, mut vb) = (up(g, &grad), up(g, &m0), up(g, &v0));
    let mut theta_b = up(g, &theta);
    // The norm of this one gradient, as execute_global_grad_norm writes it.
    let mut partials = poison(g, grad_norm_partials_len([grad.len()]));
    let mut norm_b = poison(g, 1);
    let what = format!("adamw n {n} {opt:?} lr {lr} t {t} clip {clip} {max_norm} {expect:?}");
    if clip {
        // The norm first, in a submission of its own (over `grad` as it is, mis-sized or not).
        let mut rec = g.recorder();
        optim::execute_global_grad_norm(&mut rec, &[&gb], &mut partials, &mut norm_b)
            .and_then(|()| rec.submit())
            .map_err(|e| format!("{what}: the gradient norm: {e}"))?;
    }
    let step = Step {
        lr,
        t,
        clip: if clip {
            Clip::GlobalNorm {
                norm: &norm_b,
                max_norm,
            }
        } else {
            Clip::None
        },
    };
    let outcome = judge(g, &expect, "adamw", |rec| {
        optim::execute_adamw(rec, &opt, &step, &mut theta_b, &gb, &mut mb, &mut vb)
    });
    let Some(what) = verdict(outcome, what.clone())? else {
        return refused(&what);
    };
    let host_grad = f64s(&grad);
    let norm = optim::reference::global_grad_norm(&[&host_grad]);
    let coefficient = if clip {
        optim::reference::clip_coefficient(norm, max_norm as f64)
    } else {
        1.0
    };
    let clipped: Vec<f64> = host_grad.iter().map(|v| v * coefficient).collect();
    let mut state = optim::reference::State {
        theta: f64s(&theta),
        m: f64s(&m0),
        v: f64s(&v0),
    };
    optim::reference::adamw_step(&opt, lr as f64, t, &clipped, &mut state);
    if clip {
        close(&what, &read(g, &norm_b), &[norm], 1e-5)?;
    }
    close(&what, &read(g, &theta_b), &state.theta, 1e-4)?;
    close(&what, &read(g, &mb), &state.m, 1e-5)?;
    close(&what, &read(g, &vb), &state.v, 1e-5)?;
    Ok(what)
}

#[test]
fn adamw_calls_match_the_reference_or_are_refused() {
    run_family("adamw", optim_case);
}

// ---- RoPE forward and backward --------------------------------------------------------------

fn rope_case(g: &Gpu, rng: &mut Rng) -> Result<String, String> {
    // Mostly even head sizes (RoPE rotates pairs), sometimes odd or 0.
    let head_dim = if coin(rng, 80) {
        2 * (1 + below(rng, 5))
    } else {
        below(rng, 10)
    };
    let (heads, seq_len, offset) = (below(rng, 4), below(rng, 6), below(rng, 4));
    let table_positions = 1 + below(rng, 12);
    let backward = coin(rng, 50);
    let base = 10_000.0;
    let table = match RopeTable::new(g, head_dim, base, table_positions) {
        Ok(table) => table,
        Err(e) if head_dim == 0 || head_dim % 2 == 1 => {
            return if e.to_string().contains("rope") {
                refused(&format!("rope table hd {head_dim}"))
            } else {
                Err(format!(
                    "the error for hd {head_dim} does not name rope: {e}"
                ))
            };
        }
        Err(e) => return Err(format!("RopeTable hd {head_dim}: {e}")),
    };
    if head_dim == 0 || head_dim % 2 == 1 {
        return Err(format!("RopeTable took head_dim {head_dim}"));
    }
    let sizes = Sizes::draw(rng, &["x"]);
    let tokens = 2 * seq_len.max(1);
    let x = rng.vec(sizes.len("x", tokens * heads * head_dim), 1.0);
    let rule = if heads == 0 || seq_len == 0 {
        Some(format!("heads {heads}, seq_len {seq_len}"))
    } else if offset + seq_len > table_positions {
        Some(format!(
            "positions to {} of a table of {table_positions}",
            offset + seq_len
        ))
    } else {
        None
    };
    let expect = sizes.expect(rule);
    let mut xb = up(g, &x);
    let positions = Positions {
        seq_len: seq_len as u32,
        offset: offset as u32,
    };
    let what =
        format!("rope hd {head_dim} H {heads} S {seq_len} +{offset} bwd {backward} {expect:?}");
    let outcome = judge(g, &expect, "rope", |rec| {
        rope::execute_rope(rec, &mut xb, &table, heads, positions, backward)
    });
    let Some(what) = verdict(outcome, what.clone())? else {
        return refused(&what);
    };
    let want = rope::reference::rope(
        &f64s(&x),
        (head_dim, base),
        heads,
        seq_len,
        offset,
        backward,
    );
    close(&what, &read(g, &xb), &want, 1e-5)?;
    Ok(what)
}

#[test]
fn rope_calls_match_the_reference_or_are_refused() {
    run_family("rope", rope_case);
}

// ---- Sequence attention, forward and backward -----------------------------------------------

fn attention_case(g: &Gpu, rng: &mut Rng) -> Result<String, String> {
    let (batch, seq_len) = (1 + below(rng, 3), 1 + below(rng, 9));
    let kv_heads = if coin(rng, 10) { 0 } else { 1 + below(rng, 2) };
    let heads = kv_heads * (1 + below(rng, 3)) + usize::from(coin(rng, 15));
    let head_dim = [4, 8, 12, 16, 4, 8, 12, 16, 3, 6, 0, 132][below(rng, 12)];
    let shape = SeqShape::new(batch, seq_len, heads, kv_heads, head_dim);
    let lens: Option<Vec<usize>> =
        coin(rng, 50).then(|| (0..batch).map(|_| below(rng, seq_len + 1)).collect());
    let backward = coin(rng, 50);
    let sizes = Sizes::draw(rng, &["q", "k", "v", "o", "d_out"]);
    let sizes = match sizes.wrong.map(|w| sizes.names[w]) {
        Some("d_out") if !backward => Sizes {
            wrong: None,
            ..sizes
        },
        _ => sizes,
    };
    let q = rng.vec(sizes.len("q", shape.q_len()), 1.5);
    let k = rng.vec(sizes.len("k", shape.kv_len()), 1.5);
    let v = rng.vec(sizes.len("v", shape.kv_len()), 1.0);
    let d_out = rng.vec(sizes.len("d_out", shape.q_len()), 1.0);
    let rule = if kv_heads == 0 || heads == 0 || !heads.is_multiple_of(kv_heads) {
        Some(format!("heads {heads}, kv_heads {kv_heads}"))
    } else if head_dim == 0 || head_dim % 4 != 0 || head_dim > 128 {
        Some(format!("head_dim {head_dim}"))
    } else {
        None
    };
    let expect = sizes.expect(rule.clone());
    let valid = lens
        .as_deref()
        .map(|l| ValidLengths::upload(g, l, seq_len).map_err(|e| e.to_string()))
        .transpose()?;
    let (qb, kb, vb, db) = (up(g, &q), up(g, &k), up(g, &v), up(g, &d_out));
    let tokens = shape.tokens();
    let mut o = poison(g, sizes.len("o", shape.q_len()));
    let mut lse = poison(g, tokens * heads);
    let what = format!("attention {shape:?} lens {lens:?} bwd {backward} {expect:?}");
    let inputs = SeqInputs {
        q: &qb,
        k: &kb,
        v: &vb,
        lens: valid.as_ref(),
    };
    // The forward takes no dO.
    let forward_expect = match (&expect, sizes.wrong.map(|w| sizes.names[w])) {
        (Expect::Invalid(why), Some("d_out")) if why.contains("d_out") => Expect::Valid,
        _ => sizes.expect(rule.clone()),
    };
    let outcome = judge(g, &forward_expect, "attention", |rec| {
        attention::execute_attention_forward(rec, shape, inputs, &mut o, &mut lse)
    });
    let Some(what) = verdict(outcome, what.clone())? else {
        return refused(&what);
    };
    let (qh, kh, vh) = (f64s(&q), f64s(&k), f64s(&v));
    let (want_o, want_lse) = ar::attention_forward(&shape, lens.as_deref(), &qh, &kh, &vh);
    close(&what, &read(g, &o), &want_o, 1e-5)?;
    close(&what, &read(g, &lse), &want_lse, 1e-5)?;
    if !backward {
        return Ok(what);
    }
    let mut stats = poison(g, 2 * tokens * heads);
    let mut d_q = poison(g, shape.q_len());
    let mut d_k = poison(g, shape.kv_len());
    let mut d_v = poison(g, shape.kv_len());
    let saved = SeqSaved {
        inputs,
        o: &o,
        lse: &lse,
    };
    let outcome = judge(g, &expect, "attention", |rec| {
        let grads = SeqGrads {
            stats: &mut stats,
            scores: None,
            d_q: &mut d_q,
            d_k: &mut d_k,
            d_v: &mut d_v,
        };
        attention::execute_attention_backward(rec, shape, saved, &db, grads)
    });
    if verdict(outcome, what.clone())?.is_none() {
        return refused(&what);
    }
    let (want_dq, want_dk, want_dv) =
        ar::attention_backward(&shape, lens.as_deref(), (&qh, &kh, &vh), &f64s(&d_out));
    // A sequence of one position has gradients of exactly 0 in f64 and of f32's rounding on
    // the GPU: the error is measured against inputs of about 1.
    close_abs(&what, &read(g, &d_q), &want_dq, 1e-4)?;
    close_abs(&what, &read(g, &d_k), &want_dk, 1e-4)?;
    close_abs(&what, &read(g, &d_v), &want_dv, 1e-4)?;
    Ok(what)
}

#[test]
fn sequence_attention_calls_match_the_reference_or_are_refused() {
    run_family("attention", attention_case);
}

// ---- Decoding: the KV cache's append and one token's attention ------------------------------

fn decode_case(g: &Gpu, rng: &mut Rng) -> Result<String, String> {
    let kv_heads = if coin(rng, 10) { 0 } else { 1 + below(rng, 2) };
    let heads = kv_heads * (1 + below(rng, 3)) + usize::from(coin(rng, 15));
    let head_dim = if coin(rng, 10) {
        0
    } else {
        1 + below(rng, 130)
    };
    let max_seq = 1 + below(rng, 8);
    let past_the_end = usize::from(coin(rng, 15));
    let pos = below(rng, max_seq + past_the_end);
    let shape = DecodeShape {
        heads,
        kv_heads,
        head_dim,
        max_seq,
        pos,
    };
    let sizes = Sizes::draw(rng, &["q", "k_cache", "v_cache", "k_new", "o"]);
    let cache = kv_heads * max_seq * head_dim;
    let q = rng.vec(sizes.len("q", heads * head_dim), 1.5);
    let k_cache = rng.vec(sizes.len("k_cache", cache), 1.5);
    let v_cache = rng.vec(sizes.len("v_cache", cache), 1.0);
    let k_new = rng.vec(sizes.len("k_new", kv_heads * head_dim), 1.5);
    let v_new = rng.vec(kv_heads * head_dim, 1.0);
    let rule = if kv_heads == 0 || heads == 0 || !heads.is_multiple_of(kv_heads) {
        Some(format!("heads {heads}, kv_heads {kv_heads}"))
    } else if head_dim == 0 || pos >= max_seq {
        Some(format!("head_dim {head_dim}, pos {pos} of {max_seq}"))
    } else {
        None
    };
    // One invocation per output column: at most 128.
    let attention_rule = rule
        .clone()
        .or_else(|| (head_dim > 128).then(|| format!("head_dim {head_dim}")));
    let expect = sizes.expect(attention_rule);
    let (qb, knb, vnb) = (up(g, &q), up(g, &k_new), up(g, &v_new));
    let (mut kc, mut vc) = (up(g, &k_cache), up(g, &v_cache));
    let mut attn = poison(g, heads * (pos + 1));
    let mut o = poison(g, sizes.len("o", heads * head_dim));
    let what = format!("decode {shape:?} {expect:?}");
    // The append first: it refuses a broken shape and any mis-sized cache or new row.
    let append_expect = match sizes.wrong.map(|w| sizes.names[w]) {
        Some("q" | "o") if rule.is_none() => Expect::Valid,
        _ => sizes.expect(rule),
    };
    let outcome = judge(g, &append_expect, "kv_cache_append", |rec| {
        attention::execute_kv_cache_append(rec, shape, (&knb, &vnb), &mut kc, &mut vc)
    });
    if verdict(outcome, what.clone())?.is_none() {
        return refused(&what);
    }
    let outcome = judge(g, &expect, "decode_attention", |rec| {
        attention::execute_decode_attention(rec, shape, &qb, (&kc, &vc), &mut attn, &mut o)
    });
    let Some(what) = verdict(outcome, what.clone())? else {
        return refused(&what);
    };
    let mut kh = f64s(&k_cache);
    let mut vh = f64s(&v_cache);
    for kv in 0..kv_heads {
        let at = (kv * max_seq + pos) * head_dim;
        for d in 0..head_dim {
            kh[at + d] = k_new[kv * head_dim + d] as f64;
            vh[at + d] = v_new[kv * head_dim + d] as f64;
        }
    }
    let a = ar::decode_probs(&shape, &f64s(&q), &kh);
    let want = ar::decode_out(&shape, &a, &vh);
    close(&what, &read(g, &attn), &a, 1e-5)?;
    close(&what, &read(g, &o), &want, 1e-5)?;
    Ok(what)
}

#[test]
fn decode_calls_match_the_reference_or_are_refused() {
    run_family("decode", decode_case);
}

// ---- argmax ---------------------------------------------------------------------------------

fn argmax_case(g: &Gpu, rng: &mut Rng) -> Result<String, String> {
    let (rows, n) = (below(rng, 4), below(rng, 50));
    let offset = below(rng, 3);
    let out_len = 1 + below(rng, 6);
    // Ties (rounded values) and a NaN now and then.
    let mut logits: Vec<f32> = rng.vec(rows * n, 4.0).iter().map(|v| v.round()).collect();
    if coin(rng, 20) && !logits.is_empty() {
        let i = below(rng, logits.len());
        logits[i] = f32::NAN;
    }
    let rule = if n == 0 || rows == 0 {
        Some(format!("{rows} rows of {n}"))
    } else if offset + rows > out_len {
        Some(format!("rows {offset}..{} of {out_len}", offset + rows))
    } else {
        None
    };
    let expect = match rule {
        Some(r) => Expect::Invalid(r),
        None => Expect::Valid,
    };
    let lb = up(g, &logits);
    let mut out = g.filled(out_len, u32::MAX).map_err(|e| e.to_string())?;
    let what = format!("argmax {rows}×{n} at {offset} of {out_len} {expect:?}");
    let outcome = judge(g, &expect, "argmax", |rec| {
        argmax::execute_argmax(rec, &lb, n, &mut out, offset)
    });
    let Some(what) = verdict(outcome, what.clone())? else {
        return refused(&what);
    };
    let got = out.read(g).map_err(|e| e.to_string())?;
    for r in 0..rows {
        let want = argmax::reference::argmax(&logits[r * n..][..n]);
        if got[offset + r] != want {
            return Err(format!(
                "{what}: row {r}: {} where {want} is expected",
                got[offset + r]
            ));
        }
    }
    Ok(what)
}

#[test]
fn argmax_calls_match_the_reference_or_are_refused() {
    run_family("argmax", argmax_case);
}
