//! ggml's block formats to f32, exactly as ggml's `dequantize_row_*` (and gguf-py's
//! `gguf.quants`) compute them: the same f32 operations in the same order, so the results are
//! bit-identical (tests/gguf.rs checks them against gguf-py's on random blocks).

use super::gguf::GgmlType;

/// The ggml types [`GgufFile::tensor_f32`](crate::io::GgufFile::tensor_f32) dequantizes.
pub const SUPPORTED: [&str; 9] = [
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K",
];

/// `data` (whole blocks of `ty`) as f32s; `None` when `ty` is not one of [`SUPPORTED`].
/// `data.len()` must be a multiple of `ty.block_bytes` (the reader checked it).
pub fn dequantize(ty: GgmlType, data: &[u8]) -> Option<Vec<f32>> {
    let block: fn(&[u8], &mut Vec<f32>) = match ty.name {
        "F32" => |b, out| out.push(f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        "F16" => |b, out| out.push(f16(b, 0)),
        "BF16" => |b, out| out.push(f32::from_bits(u32::from(u16_at(b, 0)) << 16)),
        "Q8_0" => q8_0,
        "Q4_0" => q4_0,
        "Q4_1" => q4_1,
        "Q4_K" => q4_k,
        "Q5_K" => q5_k,
        "Q6_K" => q6_k,
        _ => return None,
    };
    let blocks = data.chunks_exact(ty.block_bytes as usize);
    let mut out = Vec::with_capacity(blocks.len() * ty.block_elems as usize);
    for b in blocks {
        block(b, &mut out);
    }
    Some(out)
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

/// The IEEE half at byte `at`, widened (exactly: every half is an f32).
fn f16(b: &[u8], at: usize) -> f32 {
    let h = u32::from(u16_at(b, at));
    let sign = (h & 0x8000) << 16;
    let (exp, man) = ((h >> 10) & 0x1f, h & 0x3ff);
    let bits = match (exp, man) {
        (0, 0) => sign,
        // A subnormal: man·2^−24, exact in f32.
        (0, _) => {
            let magnitude = man as f32 * f32::from_bits(0x3380_0000);
            return if sign == 0 { magnitude } else { -magnitude };
        }
        (0x1f, _) => sign | 0x7f80_0000 | (man << 13),
        _ => sign | ((exp + 127 - 15) << 23) | (man << 13),
    };
    f32::from_bits(bits)
}

/// `block_q8_0`: `d` (f16), 32 × i8; `x = q·d`.
fn q8_0(b: &[u8], out: &mut Vec<f32>) {
    let d = f16(b, 0);
    out.extend(b[2..34].iter().map(|&q| f32::from(q as i8) * d));
}

/// `block_q4_0`: `d`, 16 bytes of nibbles (low nibbles are elements 0..16, high 16..32);
/// `x = (q − 8)·d`.
fn q4_0(b: &[u8], out: &mut Vec<f32>) {
    let (d, qs) = (f16(b, 0), &b[2..18]);
    out.extend(qs.iter().map(|&q| d * f32::from((q & 0xf) as i8 - 8)));
    out.extend(qs.iter().map(|&q| d * f32::from((q >> 4) as i8 - 8)));
}

/// `block_q4_1`: `d`, `m`, 16 bytes of nibbles; `x = q·d + m`.
fn q4_1(b: &[u8], out: &mut Vec<f32>) {
    let (d, m, qs) = (f16(b, 0), f16(b, 2), &b[4..20]);
    out.extend(qs.iter().map(|&q| d * f32::from(q & 0xf) + m));
    out.extend(qs.iter().map(|&q| d * f32::from(q >> 4) + m));
}

/// ggml's `get_scale_min_k4`: the 6-bit scale and min of sub-block `j` (of 8) from the 12
/// packed bytes.
fn scale_min_k4(j: usize, q: &[u8]) -> (f32, f32) {
    let (sc, m) = if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    };
    (f32::from(sc), f32::from(m))
}

/// `block_q4_K` (256 elements): `d`, `dmin`, 12 bytes of scales and mins, 128 bytes of nibbles;
/// sub-block `j` of 32 is `x = (d·sc_j)·q − dmin·m_j`.
fn q4_k(b: &[u8], out: &mut Vec<f32>) {
    let (d, dmin, scales, qs) = (f16(b, 0), f16(b, 2), &b[4..16], &b[16..144]);
    for (chunk, q) in qs.chunks_exact(32).enumerate() {
        for (half, shift) in [(0, 0), (1, 4)] {
            let (sc, m) = scale_min_k4(2 * chunk + half, scales);
            let (d1, m1) = (d * sc, dmin * m);
            out.extend(q.iter().map(|&q| d1 * f32::from((q >> shift) & 0xf) - m1));
        }
    }
}

/// `block_q5_K`: `d`, `dmin`, 12 bytes of scales, 32 bytes of high bits, 128 of nibbles; as
/// Q4_K with a fifth bit (bit `j` of `qh[l]` for sub-block `j`).
fn q5_k(b: &[u8], out: &mut Vec<f32>) {
    let (d, dmin, scales) = (f16(b, 0), f16(b, 2), &b[4..16]);
    let (qh, qs) = (&b[16..48], &b[48..176]);
    for (chunk, ql) in qs.chunks_exact(32).enumerate() {
        for (half, shift) in [(0, 0), (1, 4)] {
            let j = 2 * chunk + half;
            let (sc, m) = scale_min_k4(j, scales);
            let (d1, m1) = (d * sc, dmin * m);
            out.extend(ql.iter().zip(qh).map(|(&l, &h)| {
                let q = ((l >> shift) & 0xf) | (((h >> j) & 1) << 4);
                d1 * f32::from(q) - m1
            }));
        }
    }
}

/// `block_q6_K`: 128 bytes of low nibbles, 64 of high bit pairs, 16 i8 scales, `d` last;
/// `x = (d·sc)·(q − 32)` with a scale per 16 elements.
fn q6_k(b: &[u8], out: &mut Vec<f32>) {
    let (ql, qh, sc, d) = (&b[0..128], &b[128..192], &b[192..208], f16(b, 208));
    for half in 0..2 {
        let (ql, qh, sc) = (&ql[64 * half..], &qh[32 * half..], &sc[8 * half..]);
        let start = out.len();
        out.resize(start + 128, 0.0);
        let y = &mut out[start..];
        for l in 0..32 {
            let is = l / 16;
            let q = [
                (ql[l] & 0xf) | ((qh[l] & 3) << 4),
                (ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4),
                (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4),
                (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4),
            ];
            for (k, q) in q.into_iter().enumerate() {
                let scale = f32::from(sc[is + 2 * k] as i8);
                y[l + 32 * k] = d * scale * f32::from(q as i8 - 32);
            }
        }
    }
}
