//! Views of a buffer (`GpuBuffer::view`): ranges of one allocation, each read, written, filled,
//! copied and bound to kernels as a buffer of its own, nothing around it touched; the ranges
//! the device cannot bind, and bindings that would race, refused with what was expected.

mod common;

use common::{Rng, gpu};
use hesper::dsl::prelude::*;
use hesper::exec::{Args, Grid};

/// Random u32 values (exact on every path, the interpreter's included).
fn values(rng: &mut Rng, n: usize) -> Vec<u32> {
    (0..n).map(|_| rng.next_u32() >> 4).collect()
}

/// `y[i] = x[i] * 2 + 1` for `i < n`.
fn double_plus_one(k: &mut KernelBuilder) {
    let x = k.storage::<u32>("x");
    let y = k.storage_rw::<u32>("y");
    let n = k.param::<u32>("n");
    let i = k.global_index();
    k.if_(i.lt(&n), |k| k.store(&y, &i, x.at(&i) * 2u32 + 1u32));
}

/// `double_plus_one`, compiled on `g`.
fn double_plus_one_kernel(g: &hesper::exec::Gpu) -> std::sync::Arc<hesper::exec::CompiledKernel> {
    let key = KernelKey::new("double_plus_one").workgroup_size(64);
    g.kernel(&key, double_plus_one).unwrap()
}

/// Elements a view may start at on this device: its storage-binding alignment, in u32s.
fn aligned(g: &hesper::exec::Gpu) -> usize {
    g.wgpu_limits().min_storage_buffer_offset_alignment as usize / 4
}

#[test]
fn views_read_write_fill_and_copy_only_their_range() {
    let g = gpu();
    let mut rng = Rng::new(71);
    let a = aligned(g);
    // Three views: two whole-word ranges and a ragged tail that ends at the buffer's end.
    let n = 2 * a + 7;
    let host = values(&mut rng, n);
    let buf = g.upload(&host).unwrap();
    let (first, second, tail) = (
        buf.view(g, 0..a).unwrap(),
        buf.view(g, a..2 * a).unwrap(),
        buf.view(g, 2 * a..n).unwrap(),
    );
    assert_eq!(second.offset(), 4 * a as u64);
    assert_eq!(
        (first.len(), second.len(), tail.len()),
        (a, a, 7),
        "view lengths"
    );
    assert_eq!(first.read(g).unwrap(), host[..a]);
    assert_eq!(second.read(g).unwrap(), host[a..2 * a]);
    assert_eq!(tail.read(g).unwrap(), host[2 * a..]);

    // A write, a fill and a copy into views: each changes its range alone.
    let mut expect = host.clone();
    let written = values(&mut rng, a);
    second.write(g, &written).unwrap();
    expect[a..2 * a].copy_from_slice(&written);
    g.fill(&tail, 0xDEAD_BEEF).unwrap();
    expect[2 * a..].fill(0xDEAD_BEEF);
    let other_host = values(&mut rng, a + 3);
    let other = g.upload(&other_host).unwrap();
    g.copy(&other.view(g, 0..a).unwrap(), &first).unwrap();
    expect[..a].copy_from_slice(&other_host[..a]);
    assert_eq!(buf.read(g).unwrap(), expect);
    // A view of a view is the range of the whole it names.
    let inner = buf.view(g, a..n).unwrap().view(g, a..n - a).unwrap();
    assert_eq!(inner.offset(), tail.offset());
    assert_eq!(inner.read(g).unwrap(), expect[2 * a..]);
}

#[test]
fn kernels_bind_views_as_buffers_of_their_own() {
    let g = gpu();
    let mut rng = Rng::new(72);
    let a = aligned(g);
    let kernel = double_plus_one_kernel(g);
    let x_host = values(&mut rng, 3 * a);
    let xs = g.upload(&x_host).unwrap();
    let ys = g.filled(3 * a, 0x7FFF_FFFFu32).unwrap();
    // x's middle third into y's last third, then x's first third into y's first: the launch
    // sees only its views (element 0 of each is the view's first).
    let mut rec = g.recorder();
    for (from, to) in [(a, 2 * a), (0, 0)] {
        let (x, y) = (
            xs.view(g, from..from + a).unwrap(),
            ys.view(g, to..to + a).unwrap(),
        );
        let args = Args::new()
            .buffer("x", &x)
            .buffer("y", &y)
            .param("n", a as u32);
        rec.launch(&kernel, &args, Grid::Threads(a as u64)).unwrap();
    }
    rec.submit().unwrap();
    let mut expect = vec![0x7FFF_FFFFu32; 3 * a];
    for (from, to) in [(a, 2 * a), (0, 0)] {
        for i in 0..a {
            expect[to + i] = x_host[from + i] * 2 + 1;
        }
    }
    assert_eq!(ys.read(g).unwrap(), expect);
}

/// Two views of one buffer written by one kernel: allowed where they are apart, refused where
/// they overlap, and a view read beside one written is refused (wgpu tracks the whole buffer).
#[test]
fn views_bound_together_are_checked_for_races() {
    let g = gpu();
    let a = aligned(g);
    let kernel = g
        .kernel(&KernelKey::new("two_outputs").workgroup_size(64), |k| {
            let x = k.storage::<u32>("x");
            let p = k.storage_rw::<u32>("p");
            let q = k.storage_rw::<u32>("q");
            let i = k.global_index();
            k.if_(i.lt(4u32), |k| {
                k.store(&p, &i, x.at(&i) + 1u32);
                k.store(&q, &i, x.at(&i) + 2u32);
            });
        })
        .unwrap();
    let x = g.upload(&[10u32, 20, 30, 40]).unwrap();
    let buf = g.filled(2 * a, 0u32).unwrap();
    let (p, q) = (buf.view(g, 0..a).unwrap(), buf.view(g, a..2 * a).unwrap());
    let mut rec = g.recorder();
    rec.launch(
        &kernel,
        &Args::new().buffer("x", &x).buffer("p", &p).buffer("q", &q),
        Grid::Threads(4),
    )
    .unwrap();
    rec.submit().unwrap();
    let out = buf.read(g).unwrap();
    assert_eq!(out[..4], [11, 21, 31, 41]);
    assert_eq!(out[a..a + 4], [12, 22, 32, 42]);
    assert!(out[4..a].iter().chain(&out[a + 4..]).all(|&v| v == 0));

    let wide = buf.view(g, 0..2 * a).unwrap();
    let mut rec = g.recorder();
    let err = rec
        .launch(
            &kernel,
            &Args::new()
                .buffer("x", &x)
                .buffer("p", &wide)
                .buffer("q", &q),
            Grid::Threads(4),
        )
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "kernel `two_outputs`, binding `p`: expected a buffer of its own (it is written, and `q` \
         is written), given the buffer also bound to `q`"
    );
    let err = rec
        .launch(
            &kernel,
            &Args::new().buffer("x", &p).buffer("p", &q).buffer("q", &x),
            Grid::Threads(4),
        )
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "kernel `two_outputs`, binding `p`: expected a buffer of its own (it is written, and \
         `x` is read from a view of the same buffer: wgpu tracks a buffer's use as a whole), \
         given the buffer also bound to `x`"
    );
    assert!(rec.is_empty());
    // A copy between views of one buffer is refused the same way.
    let err = rec.copy_range(&p, 0, &q, 0, 4).unwrap_err();
    assert!(err.to_string().contains("views of it included"), "{err}");
}

#[test]
fn ranges_a_device_cannot_bind_are_refused() {
    let g = gpu();
    let a = aligned(g);
    let n = 2 * a + 3;
    let buf = g.zeros::<u32>(n).unwrap();
    let err = |buf: &hesper::exec::GpuBuffer<u32>, range| match buf.view(g, range) {
        Ok(_) => panic!("the view was made"),
        Err(e) => e.to_string(),
    };
    // Each message: the buffer (`#id (n × u32)`), the range, what was expected and given.
    let refused = [
        (
            1..a,
            format!(
                " ({n} × u32)`: a view of elements 1..{a}: expected a start at a multiple of the \
                 device's storage-binding alignment of {} bytes, given byte 4 of the allocation",
                4 * a
            ),
        ),
        (
            0..a + 1,
            format!(
                " ({n} × u32)`: a view of elements 0..{}: expected an end on a multiple of 16 \
                 bytes or at the buffer's end (fills and copies move 16-byte words), given {} \
                 bytes ending at element {}",
                a + 1,
                4 * (a + 1),
                a + 1
            ),
        ),
        (
            a..n + 1,
            format!(
                " ({n} × u32)`: a view of elements {a}..{}: expected a non-empty range within \
                 0..{n}",
                n + 1
            ),
        ),
    ];
    for (range, expected) in refused {
        let message = err(&buf, range);
        assert!(message.starts_with("buffer `#"), "{message}");
        assert!(
            message.ends_with(&expected),
            "{message}\nexpected …{expected}"
        );
    }
    #[allow(clippy::reversed_empty_ranges)]
    let backwards = a..0;
    assert!(err(&buf, backwards).contains(&format!("expected a non-empty range within 0..{n}")));
    assert!(err(&buf, a..a).contains("non-empty"));
    // A view's own errors say where in the allocation it starts.
    let view = buf.view(g, a..n).unwrap();
    let message = err(&view, 1..2);
    assert!(
        message.contains(&format!(" at byte {} ({} × u32)`", 4 * a, n - a)),
        "{message}"
    );
}

/// A recorder reusing bind groups ([`hesper::exec::LaunchCache`]) tells apart views that start
/// at the same byte but end elsewhere: the longer view's launch writes all of it.
#[test]
fn reused_bind_groups_tell_views_of_one_start_apart() {
    let g = gpu();
    let mut rng = Rng::new(73);
    let a = aligned(g);
    let kernel = double_plus_one_kernel(g);
    let x_host = values(&mut rng, 2 * a);
    let xs = g.upload(&x_host).unwrap();
    let ys = g.filled(2 * a, 0u32).unwrap();
    let cache = hesper::exec::LaunchCache::new();
    for n in [a, 2 * a] {
        let (x, y) = (xs.view(g, 0..n).unwrap(), ys.view(g, 0..n).unwrap());
        let mut rec = g.recorder_reusing(&cache);
        let args = Args::new()
            .buffer("x", &x)
            .buffer("y", &y)
            .param("n", n as u32);
        rec.launch(&kernel, &args, Grid::Threads(n as u64)).unwrap();
        rec.submit().unwrap();
    }
    let expect: Vec<u32> = x_host.iter().map(|v| v * 2 + 1).collect();
    assert_eq!(ys.read(g).unwrap(), expect);
}

/// `Gpu::zeros_parts`: arrays at aligned starts in one zeroed allocation; each view is its
/// array, a fill of a ragged one stops before the next, and the whole sees them all.
#[test]
fn parts_of_one_allocation_are_arrays_of_their_own() {
    let g = gpu();
    let mut rng = Rng::new(74);
    let align = (4 * aligned(g)).max(16);
    let lens = [3usize, 0, 70, 1, 64];
    let (whole, parts) = g.zeros_parts::<u32>(&lens).unwrap();
    assert_eq!(parts.len(), lens.len());
    let mut start = 0;
    for (part, &len) in parts.iter().zip(&lens) {
        assert_eq!((part.len(), part.offset()), (len, start as u64));
        assert!(part.read(g).unwrap().iter().all(|&v| v == 0));
        start += (4 * len).max(1).next_multiple_of(align);
    }
    assert_eq!(whole.len() * 4, start);
    let values: Vec<Vec<u32>> = lens.iter().map(|&n| values(&mut rng, n)).collect();
    for (part, v) in parts.iter().zip(&values) {
        part.write(g, v).unwrap();
    }
    // A fill of the ragged first part (3 elements, a vec4 with padding) leaves the rest.
    g.fill(&parts[0], 7u32).unwrap();
    let got = whole.read(g).unwrap();
    let mut expect = vec![0u32; whole.len()];
    for (i, (part, v)) in parts.iter().zip(&values).enumerate() {
        let at = part.offset() as usize / 4;
        expect[at..at + v.len()].copy_from_slice(v);
        if i == 0 {
            expect[at..at + 4].fill(7);
        }
    }
    assert_eq!(got, expect);
    assert_eq!(parts[2].read(g).unwrap(), values[2]);
}
