//! The embedding lookup, the bias broadcast and the residual add on the GPU against the f64
//! reference. They are exact (a copy, one f32 addition), so the comparison is exact: the GPU's
//! f32 equals the reference rounded to f32, bit for bit, and a NaN (an unwritten, poisoned
//! element) never does.

use hesper_exec::{GpuBuffer, Recorder};
use hesper_kernels::elementwise::{self, reference};
use hesper_kernels::testing::{Rng, f64s, gpu};

/// Row widths: scalar rows (3, 5), `vec4` rows (4, 576).
const WIDTHS: [usize; 4] = [3, 4, 5, 576];
/// Token (row) counts: one, a few, past one workgroup's reach.
const ROWS: [usize; 3] = [1, 7, 1000];

/// `got` is `want` rounded to f32, bit for bit.
fn assert_exact(what: &str, got: &[f32], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(
            g.to_bits(),
            (*w as f32).to_bits(),
            "{what}: element {i}: got {g}, want {w}"
        );
    }
}

fn run_embedding(table: &[f32], tokens: &[u32], dim: usize) -> Vec<f32> {
    let g = gpu();
    let (tb, ib) = (g.upload(table).unwrap(), g.upload(tokens).unwrap());
    let mut out = g.filled(tokens.len() * dim, f32::NAN).unwrap();
    let mut rec = g.recorder();
    elementwise::execute_embedding(&mut rec, &tb, &ib, dim, &mut out).unwrap();
    rec.submit().unwrap();
    out.read(g).unwrap()
}

#[test]
fn embedding_matches_reference() {
    for (seed, (dim, t)) in WIDTHS
        .into_iter()
        .flat_map(|d| ROWS.map(|t| (d, t)))
        .enumerate()
    {
        let mut rng = Rng::new(seed as u64);
        let v = 1 + rng.next_u32() as usize % 300;
        let table = rng.vec(v * dim, 2.0);
        let tokens: Vec<u32> = (0..t).map(|_| rng.next_u32() % v as u32).collect();
        let got = run_embedding(&table, &tokens, dim);
        let want = reference::embedding(&f64s(&table), &tokens, dim);
        assert_exact(&format!("embedding V={v} dim={dim} T={t}"), &got, &want);
    }
}

/// An id at or past `V` (a GPU cannot raise an error) gives a row of zeros; the rows around it
/// are still looked up.
#[test]
fn embedding_of_an_out_of_range_token_is_zeros() {
    for dim in [3, 576] {
        let v = 11;
        let table = Rng::new(dim as u64 + 50).vec(v * dim, 2.0);
        let tokens = [0, 11, 10, 12, u32::MAX, 5, 1 << 31];
        let got = run_embedding(&table, &tokens, dim);
        assert_exact(
            &format!("out-of-range ids dim={dim}"),
            &got,
            &reference::embedding(&f64s(&table), &tokens, dim),
        );
        for t in [1, 3, 4, 6] {
            assert!(
                got[t * dim..(t + 1) * dim].iter().all(|x| x.to_bits() == 0),
                "dim={dim}: token {t} ({}) is not a row of zeros",
                tokens[t]
            );
        }
    }
}

#[test]
fn add_bias_matches_reference() {
    let g = gpu();
    for (seed, (n, rows)) in WIDTHS
        .into_iter()
        .flat_map(|n| ROWS.map(|r| (n, r)))
        .enumerate()
    {
        let mut rng = Rng::new(seed as u64 + 100);
        let (y, bias) = (rng.vec(rows * n, 3.0), rng.vec(n, 1.0));
        let mut yb = g.upload(&y).unwrap();
        let bb = g.upload(&bias).unwrap();
        let mut rec = g.recorder();
        elementwise::execute_add_bias(&mut rec, &mut yb, &bb).unwrap();
        rec.submit().unwrap();
        let want = reference::add_bias(&f64s(&y), &f64s(&bias));
        assert_exact(
            &format!("add_bias n={n} rows={rows}"),
            &yb.read(g).unwrap(),
            &want,
        );
    }
}

#[test]
fn add_matches_reference() {
    let g = gpu();
    for (seed, len) in [1usize, 3, 5, 576, 1000 * 5, 70_001]
        .into_iter()
        .enumerate()
    {
        let mut rng = Rng::new(seed as u64 + 200);
        let (x, y) = (rng.vec(len, 2.0), rng.vec(len, 2.0));
        let xb = g.upload(&x).unwrap();
        let mut yb = g.upload(&y).unwrap();
        let mut rec = g.recorder();
        elementwise::execute_add(&mut rec, &xb, &mut yb).unwrap();
        rec.submit().unwrap();
        let want = reference::add(&f64s(&x), &f64s(&y));
        assert_exact(&format!("add len={len}"), &yb.read(g).unwrap(), &want);
    }
}

#[test]
fn empty_inputs_record_nothing() {
    let g = gpu();
    let table = g.zeros::<f32>(12).unwrap();
    let tokens = g.zeros::<u32>(0).unwrap();
    let mut out = g.zeros::<f32>(0).unwrap();
    let (mut y, bias) = (g.zeros::<f32>(0).unwrap(), g.zeros::<f32>(3).unwrap());
    let mut rec = g.recorder();
    elementwise::execute_embedding(&mut rec, &table, &tokens, 3, &mut out).unwrap();
    elementwise::execute_add_bias(&mut rec, &mut y, &bias).unwrap();
    elementwise::execute_add(&mut rec, &out, &mut y).unwrap();
    assert!(rec.is_empty());
}

#[test]
fn wrong_lengths_name_kernel_and_binding() {
    let g = gpu();
    let z = |n| g.zeros::<f32>(n).unwrap();
    let tokens = g.zeros::<u32>(4).unwrap();
    let mut rec = g.recorder();
    let embedding =
        |rec: &mut Recorder<'_>, table: &GpuBuffer<f32>, dim, out: &mut GpuBuffer<f32>| {
            elementwise::execute_embedding(rec, table, &tokens, dim, out)
                .unwrap_err()
                .to_string()
        };
    assert_eq!(
        embedding(&mut rec, &z(10), 3, &mut z(12)),
        "kernel `embedding`, binding `table`: expected a non-empty multiple of 3 elements \
         ([V, dim]), given 10 elements"
    );
    assert_eq!(
        embedding(&mut rec, &z(0), 3, &mut z(12)),
        "kernel `embedding`, binding `table`: expected a non-empty multiple of 3 elements \
         ([V, dim]), given 0 elements"
    );
    assert_eq!(
        embedding(&mut rec, &z(12), 3, &mut z(13)),
        "kernel `embedding`, binding `out`: expected 12 elements (tokens × dim), given 13 \
         elements"
    );
    assert_eq!(
        embedding(&mut rec, &z(12), 0, &mut z(0)),
        "kernel `embedding`, binding `table`: expected a non-empty multiple of 0 elements \
         ([V, dim]), given 12 elements"
    );
    let err = elementwise::execute_add_bias(&mut rec, &mut z(10), &z(3)).unwrap_err();
    assert_eq!(
        err.to_string(),
        "kernel `add_bias`, binding `y`: expected a whole number of rows of 3 (bias's length), \
         given 10 elements"
    );
    let err = elementwise::execute_add_bias(&mut rec, &mut z(10), &z(0)).unwrap_err();
    assert_eq!(
        err.to_string(),
        "kernel `add_bias`, binding `y`: expected a whole number of rows of 0 (bias's length), \
         given 10 elements"
    );
    let err = elementwise::execute_add(&mut rec, &z(10), &mut z(9)).unwrap_err();
    assert_eq!(
        err.to_string(),
        "kernel `add`, binding `y`: expected 10 elements (as x), given 9 elements"
    );
    assert!(rec.is_empty());
}

/// Each kernel's WGSL at a small key (its first line), the snapshot named by the key.
#[test]
fn wgsl_snapshots() {
    let names = [
        "embedding_dim64",
        "embedding_dim5",
        "add_bias_cols64",
        "add_bias_cols5",
        "add",
    ];
    let kernels = elementwise::kernels().unwrap();
    for (name, k) in hesper_kernels::testing::named_by_key(&kernels, &names) {
        insta::assert_snapshot!(name, k.wgsl());
    }
}
