#!/usr/bin/env python3
"""Write tests/data/peft-tiny/{f32,f64,f16,bf16}/, the independent fixture of tests/peft.rs: a
LoRA adapter of `ModelConfig::tiny(Family::Llama)` (2 layers, D = 64, FFN 128, 4 query and 2 KV
heads of 16) as a PEFT user would have it, written by Python's `safetensors` (numpy's
save_file, and for BF16, which numpy lacks, the package's `serialize_file` on the raw bits) and
`json`, not by hesper. pip install safetensors numpy; safetensors 0.8.0 and numpy 2.4.6 made the
committed files.

The adapter: r = 3, lora_alpha = 6, use_rslora, all seven projections, target_modules in the
arbitrary order PEFT's set gives them. Tensor t (t = 2·(7·layer + k) + (1 for B), k the
projection's index in q, k, v, o, gate, up, down) holds, for its element i (row-major):
  - f32 and f64: (10000·t + i)·1e-4, computed in f64 (and rounded to f32 for f32);
  - f16 and bf16: ((37·t + i) mod 255 − 127) / 64, exact in both.
tests/peft.rs computes the same values. adapter_config.json is the fields PEFT 0.18.0 writes, at
their defaults but for the adapter's own: a current PEFT's file, with fields hesper ignores.
Usage: tests/data/peft-tiny/generate.py
"""
import json
import os

import numpy as np
import safetensors
from safetensors.numpy import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
D, I, Q, KV, LAYERS, R = 64, 128, 64, 32, 2, 3
MODULES = [  # (path, out, in), in the order of hesper's Projection::ALL
    ("self_attn.q_proj", Q, D),
    ("self_attn.k_proj", KV, D),
    ("self_attn.v_proj", KV, D),
    ("self_attn.o_proj", D, Q),
    ("mlp.gate_proj", I, D),
    ("mlp.up_proj", I, D),
    ("mlp.down_proj", D, I),
]
TARGETS = ["v_proj", "down_proj", "q_proj", "up_proj", "o_proj", "k_proj", "gate_proj"]

CONFIG = {  # PEFT 0.18.0's LoraConfig.to_dict(), sorted by json.dumps
    "alora_invocation_tokens": None,
    "alpha_pattern": {},
    "arrow_config": None,
    "auto_mapping": None,
    "base_model_name_or_path": "hesper/tiny-llama",
    "bias": "none",
    "corda_config": None,
    "ensure_weight_tying": False,
    "eva_config": None,
    "exclude_modules": None,
    "fan_in_fan_out": False,
    "inference_mode": True,
    "init_lora_weights": True,
    "layer_replication": None,
    "layers_pattern": None,
    "layers_to_transform": None,
    "loftq_config": {},
    "lora_alpha": 6,
    "lora_bias": False,
    "lora_dropout": 0.05,
    "megatron_config": None,
    "megatron_core": "megatron.core",
    "modules_to_save": None,
    "peft_type": "LORA",
    "peft_version": "0.18.0",
    "qalora_group_size": 16,
    "r": R,
    "rank_pattern": {},
    "revision": None,
    "target_modules": TARGETS,
    "target_parameters": None,
    "task_type": "CAUSAL_LM",
    "trainable_token_indices": None,
    "use_dora": False,
    "use_qalora": False,
    "use_rslora": True,
}


def tensors():
    """(key, shape, t) of every tensor."""
    for layer in range(LAYERS):
        for k, (path, out, inp) in enumerate(MODULES):
            prefix = f"base_model.model.model.layers.{layer}.{path}"
            t = 2 * (7 * layer + k)
            yield f"{prefix}.lora_A.weight", (R, inp), t
            yield f"{prefix}.lora_B.weight", (out, R), t + 1


def wide(shape, t):
    i = np.arange(shape[0] * shape[1], dtype=np.float64)
    return ((10000 * t + i) * 1e-4).reshape(shape)


def narrow(shape, t):
    i = np.arange(shape[0] * shape[1], dtype=np.int64)
    return (((37 * t + i) % 255 - 127) / 64).reshape(shape)


def bf16_bits(x):
    """x (exact in bf16) as little-endian bf16 bits: the top half of each f32."""
    bits = np.ascontiguousarray(x, dtype="<f4").view("<u4")
    assert np.all(bits & 0xFFFF == 0), "not exact in bf16"
    return (bits >> 16).astype("<u2")


def save_bf16(path):
    arrays = {k: bf16_bits(narrow(s, t)) for k, s, t in tensors()}  # alive while serializing
    specs = {k: safetensors.TensorSpec(dtype="bfloat16", shape=list(a.shape), data_ptr=a.ctypes.data, data_len=a.nbytes) for k, a in arrays.items()}
    safetensors.serialize_file(specs, path, metadata=meta)


def write(variant, save):
    out = os.path.join(HERE, variant)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "adapter_config.json"), "w") as f:
        f.write(json.dumps(CONFIG, indent=2, sort_keys=True))
    save(os.path.join(out, "adapter_model.safetensors"))


meta = {"format": "pt"}
write("f64", lambda p: save_file({k: wide(s, t) for k, s, t in tensors()}, p, meta))
write("f32", lambda p: save_file({k: wide(s, t).astype(np.float32) for k, s, t in tensors()}, p, meta))
write("f16", lambda p: save_file({k: narrow(s, t).astype(np.float16) for k, s, t in tensors()}, p, meta))
write("bf16", save_bf16)
print("wrote", HERE)
