//! `argmax` on the GPU against the host's first-maximum rule: random rows, planted ties (the
//! first wins), NaN and `−∞` (never chosen), a row of nothing above `−∞` (0), `+∞`, rows past
//! one dimension of workgroups, with and without subgroups; an offset into the output; errors.

use hesper_exec::Gpu;
use hesper_kernels::argmax::{self, execute_argmax, reference};
use hesper_kernels::testing::{Rng, gpu, gpu_without_subgroups};

fn run(g: &Gpu, logits: &[f32], n: usize, offset: usize) -> Vec<u32> {
    let rows = logits.len() / n;
    let buf = g.upload(logits).unwrap();
    let mut out = g.upload(&vec![u32::MAX - 7; offset + rows + 2]).unwrap();
    let mut rec = g.recorder();
    execute_argmax(&mut rec, &buf, n, &mut out, offset).unwrap();
    rec.submit().unwrap();
    let got = out.read(g).unwrap();
    // Nothing written outside `offset .. offset + rows`.
    assert!(got[..offset].iter().all(|&v| v == u32::MAX - 7));
    assert!(got[offset + rows..].iter().all(|&v| v == u32::MAX - 7));
    got[offset..offset + rows].to_vec()
}

fn rows_of(rng: &mut Rng, rows: usize, n: usize) -> Vec<f32> {
    let mut z = rng.vec(rows * n, 4.0);
    for r in 0..rows {
        let row = &mut z[r * n..][..n];
        // A tie for the maximum at two random places, in every other row.
        if r % 2 == 0 && n > 1 {
            let (a, b) = (rng.next_u32() as usize % n, rng.next_u32() as usize % n);
            row[a] = 9.5;
            row[b] = 9.5;
        }
        if r % 3 == 0 {
            row[rng.next_u32() as usize % n] = f32::NAN;
            row[rng.next_u32() as usize % n] = f32::NEG_INFINITY;
        }
    }
    z
}

#[test]
fn matches_the_first_maximum_of_the_host() {
    for g in [gpu(), gpu_without_subgroups()] {
        let mut rng = Rng::new(5);
        // Past one dispatch row of workgroups (lavapipe's 65 535; the interpreter's 1024): the
        // 2-D layout.
        let past_a_row = g.wgpu_limits().max_compute_workgroups_per_dimension as usize + 5;
        for (rows, n, offset) in [(1, 1, 0), (3, 7, 2), (5, 49_152, 1), (past_a_row, 3, 0)] {
            let z = rows_of(&mut rng, rows, n);
            let want: Vec<u32> = z.chunks(n).map(reference::argmax).collect();
            assert_eq!(run(g, &z, n, offset), want, "{rows} rows of {n}");
        }
        // Ties across invocations' strides: the first index, not a later lane's.
        let mut z = vec![1.0f32; 1000];
        z[300] = 2.0;
        z[44] = 2.0;
        z[999] = 2.0;
        assert_eq!(run(g, &z, 1000, 0), [44]);
        // Nothing above −∞ (NaN and −∞ only): 0, as the host. +∞ wins.
        let z = [f32::NAN, f32::NEG_INFINITY, f32::NAN, f32::NEG_INFINITY];
        assert_eq!(run(g, &z, 4, 0), [0]);
        let z = [1.0, f32::INFINITY, f32::NAN, f32::INFINITY];
        assert_eq!(run(g, &z, 4, 0), [1]);
        let z = [f32::NEG_INFINITY, -f32::MAX, -3.0e38];
        assert_eq!(run(g, &z, 3, 0), [2]);
    }
}

#[test]
fn bad_shapes_name_the_kernel_and_buffer() {
    let g = gpu();
    let logits = g.upload(&[1.0f32; 10]).unwrap();
    let mut out = g.upload(&[0u32; 2]).unwrap();
    let mut rec = g.recorder();
    let err = |r: Result<(), hesper_exec::ExecError>| r.unwrap_err().to_string();
    assert_eq!(
        err(execute_argmax(&mut rec, &logits, 4, &mut out, 0)),
        "kernel `argmax`, binding `logits`: expected a non-empty multiple of 4 elements \
         ([rows, n]), given 10 elements"
    );
    assert_eq!(
        err(execute_argmax(&mut rec, &logits, 5, &mut out, 1)),
        "kernel `argmax`, binding `out`: expected at least 3 elements (offset + rows), given 2 \
         elements"
    );
    assert!(err(execute_argmax(&mut rec, &logits, 0, &mut out, 0)).contains("empty row"));
    assert!(rec.is_empty());
}

#[test]
fn wgsl_snapshot() {
    let kernels = argmax::kernels().unwrap();
    insta::assert_snapshot!("argmax", kernels[0].wgsl());
}
