#!/usr/bin/env python3
"""Write tests/data/dequant.gguf, the reference of tests/gguf.rs: gguf-py's own writer and
dequantizers (pip install gguf numpy; gguf 0.19.0, numpy 2.4 made the committed file).

For each type T of F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K: tensor `T` holds random
bytes forming valid blocks of T (numpy shape [2, cols], so GGUF dims [cols, 2]), and tensor
`T.expected` (F32, same shape) holds gguf.quants.dequantize of those bytes. The f16 scales of
the quantized blocks are overwritten with finite values (random in ±4, and a subnormal), so the
expected values hold no NaN; F16 and BF16 hold every kind of value but NaN (numpy may quiet a
signalling NaN, which says nothing of a dequantizer).

With the real model (argument 1, default models/SmolLM2-135M-Instruct.Q4_1.gguf) present, it
also records `smollm2/NAME` (F32 [k, cols]): rows `smollm2/NAME.rows` of tensor NAME, dequantized
by gguf-py; and `smollm2/hf/blk.0.attn_q.weight` / `..attn_k..`: the same rows after undoing
llama.cpp's Q/K permutation as transformers' GGUF loader does (`reverse_permute_weights`,
restated below), an independent check of hesper's own un-permutation.
Usage: scripts/gguf-fixture.py [path-to-SmolLM2.gguf]
"""
import os
import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "dequant.gguf")
rng = np.random.default_rng(20250)


def finite_f16(n):
    v = rng.uniform(-4, 4, n).astype(np.float16)
    v[0] = np.float16(3e-7)  # a subnormal
    return v.view(np.uint8).reshape(n, 2)


# Byte offsets of the f16 scale fields inside a block, per type (ggml-common.h).
SCALES = {T.Q8_0: [0], T.Q4_0: [0], T.Q4_1: [0, 2], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208]}


def quant_blocks(qtype, n_blocks):
    _, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    for off in SCALES[qtype]:
        blocks[:, off:off + 2] = finite_f16(n_blocks)
    return blocks


def half_bits(n, dtype_nan):
    bits = rng.integers(0, 1 << 16, n, dtype=np.uint32).astype(np.uint16)
    bits[:8] = [0x0000, 0x8000, 0x0001, 0x83FF, 0x7C00, 0xFC00, 0x3C00, 0x7BFF] if dtype_nan == "f16" \
        else [0x0000, 0x8000, 0x0001, 0x807F, 0x7F80, 0xFF80, 0x3F80, 0x7F7F]
    exp_mask, man_mask = (0x7C00, 0x03FF) if dtype_nan == "f16" else (0x7F80, 0x007F)
    nan = ((bits & exp_mask) == exp_mask) & ((bits & man_mask) != 0)
    bits[nan] &= ~np.uint16(man_mask)  # NaN -> ±inf
    return bits


w = gguf.GGUFWriter(OUT, "fixture")
rows = 2
for qtype in [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_K, T.Q6_K]:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    cols = 512 if block == 256 else 64
    if qtype == T.F32:
        raw = rng.standard_normal(rows * cols).astype(np.float32).view(np.uint8)
    elif qtype in (T.F16, T.BF16):
        raw = half_bits(rows * cols, "f16" if qtype == T.F16 else "bf16").view(np.uint8)
    else:
        raw = quant_blocks(qtype, rows * cols // block)
    raw = raw.reshape(rows, cols // block * size)
    expected = dequantize(raw, qtype).astype(np.float32).reshape(rows, cols)
    w.add_tensor(qtype.name, raw, raw_shape=raw.shape, raw_dtype=qtype)
    w.add_tensor(qtype.name + ".expected", expected)


def hf_unpermute(rows_gguf, n_head):
    """transformers' reverse_permute_weights: (n, hd/2, 2, in) -> (n, 2, hd/2, in)."""
    dim = rows_gguf.shape[0] // n_head // 2
    w_ = rows_gguf.reshape(n_head, dim, 2, *rows_gguf.shape[1:])
    return w_.swapaxes(2, 1).reshape(rows_gguf.shape)


model = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
    os.path.dirname(__file__), "..", "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
if os.path.exists(model):
    r = gguf.GGUFReader(model)
    tensors = {t.name: t for t in r.tensors}

    def full(name):
        t = tensors[name]
        return dequantize(t.data, t.tensor_type).astype(np.float32).reshape(
            [int(d) for d in reversed(t.shape)])

    picks = {
        "token_embd.weight": [0, 1, 4242, 49151],
        "blk.0.attn_q.weight": [0, 1, 63, 64, 575],
        "blk.0.attn_k.weight": [0, 1, 32, 191],
        "blk.0.ffn_down.weight": [0, 575],
        "blk.29.attn_norm.weight": None,
        "output_norm.weight": None,
    }
    for name, idx in picks.items():
        x = full(name)
        if idx is None:
            x, idx = x.reshape(1, -1), [0]
        else:
            x = x[idx]
        w.add_array(f"smollm2/{name}.rows", [int(i) for i in idx])
        w.add_tensor(f"smollm2/{name}", np.ascontiguousarray(x))
    for name, heads in [("blk.0.attn_q.weight", 9), ("blk.0.attn_k.weight", 3)]:
        idx = picks[name]
        w.add_tensor(f"smollm2/hf/{name}", np.ascontiguousarray(hf_unpermute(full(name), heads)[idx]))
else:
    print(f"gguf-fixture: {model} absent; no SmolLM2 values recorded", file=sys.stderr)

w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
print(f"wrote {OUT}: {os.path.getsize(OUT)} bytes")
