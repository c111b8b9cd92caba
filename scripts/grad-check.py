#!/usr/bin/env python3
"""Check the LoRA gradients `hesper grad` wrote against PyTorch autograd in f64.

transformers loads the base model from the GGUF (dequantized by the `gguf` package, Llama's Q/K
rows un-permuted by its loader, as hesper's loader does); PEFT wraps it with the adapter
(`PeftModel.from_pretrained(..., is_trainable=True)`); the whole model is cast to f64. The loss
is Hugging Face's causal-LM loss over the data file's `input_ids` rows (the mean over every
predicted token of the batch, rows of one length so that nothing is padded) — what
`hesper grad` computes on the same rows. Each adapter matrix's gradient is compared with the
file's (keys as PEFT saves them, `lora_A.weight` / `lora_B.weight`): the largest
|hesper - torch| over the largest |torch| of each tensor, and over all of them.

Usage: scripts/grad-check.py MODEL.gguf ADAPTER_DIR DATA.jsonl GRADS.safetensors [TOLERANCE]
Exits non-zero when a tensor is missing or its error passes TOLERANCE (default 1e-3). The same
gradients from PyTorch in f32 are reported beside (what f32 arithmetic alone gives).
"""
import json
import os
import sys

import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

if len(sys.argv) not in (5, 6):
    sys.exit(__doc__)
gguf_path, adapter_dir, data_path, grads_path = sys.argv[1:5]
tolerance = float(sys.argv[5]) if len(sys.argv) == 6 else 1e-3

rows = [json.loads(line)["input_ids"] for line in open(data_path) if line.strip()]
assert len({len(r) for r in rows}) == 1, "rows of one length: nothing padded"
gguf_path = os.path.abspath(gguf_path)
base = AutoModelForCausalLM.from_pretrained(
    os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path), torch_dtype=torch.float32
)
model = PeftModel.from_pretrained(base, adapter_dir, is_trainable=True)
ids = torch.tensor(rows)


def gradients():
    """(loss, {PEFT key: gradient}) of the model in its present precision."""
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n.replace(".default.", "."): p.grad.double().clone() for n, p in model.named_parameters() if "lora_" in n}
    return loss.item(), grads


# PyTorch in f32 first: how far f32 arithmetic alone lands from f64 on this batch.
loss32, torch32 = gradients()
model.double()
loss, want = gradients()

ours = load_file(grads_path)


def relative_errors(got):
    """Per key, max |got - f64| / max |f64|."""
    return {k: (got[k].double() - w).abs().max().item() / max(w.abs().max().item(), 1e-30) for k, w in want.items() if k in got}


errors, errors32 = relative_errors(ours), relative_errors(torch32)
missing = sorted(set(want) - set(ours))
extra = sorted(set(ours) - set(want))
for key, w in want.items():
    assert key not in ours or ours[key].shape == w.shape, f"{key}: shape {tuple(ours[key].shape)}, torch's {tuple(w.shape)}"
for key, err in errors.items():
    if err > tolerance:
        print(f"{key}: relative error {err:.3g} (PyTorch f32's {errors32[key]:.3g})")
checked = len(errors)
worst, worst32 = max(errors.values(), default=0.0), max(errors32.values())
median = sorted(errors.values())[checked // 2] if checked else 0.0
median32 = sorted(errors32.values())[len(errors32) // 2]
print(f"loss: torch f64 {loss:.7f}, torch f32 {loss32:.7f}")
print(f"{checked} gradients compared with PyTorch f64: hesper worst relative error {worst:.3g}, median {median:.3g}; PyTorch f32 worst {worst32:.3g}, median {median32:.3g} (tolerance {tolerance:g})")
assert not missing, f"gradients the file lacks: {missing[:4]} ({len(missing)})"
assert not extra, f"gradients of the file torch has no parameter for: {extra[:4]}"
assert checked > 0 and worst <= tolerance, "gradients differ"
print("gradients match")
if os.environ.get("GRAD_CHECK_LAYERS"):
    for layer in sorted({int(k.split(".layers.")[1].split(".")[0]) for k in errors}):
        ks = [k for k in errors if f".layers.{layer}." in k]
        worst_k = max(ks, key=lambda k: errors[k])
        print(f"layer {layer}: hesper {max(errors[k] for k in ks):.3g} ({worst_k.split('.')[-3]}.{worst_k.split('.')[-2]}), f32 {max(errors32[k] for k in ks):.3g}")
