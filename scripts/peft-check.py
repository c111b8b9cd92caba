#!/usr/bin/env python3
"""Check an adapter hesper saved (hesper::io::save_peft_adapter) with Hugging Face's own stack:
transformers loads the base model from the GGUF (dequantized by the `gguf` package, f32, Llama's
Q/K rows un-permuted by transformers' loader, as hesper's loader does), PEFT wraps it with the
adapter (`PeftModel.from_pretrained`), and the adapted model runs the given tokens on the CPU.

It asserts that PEFT loaded the adapter as saved: no warning from PEFT while loading (unexpected
config fields, missing adapter keys), the adapter's state dict in the model has exactly the
file's keys (nothing missing, nothing unexpected) and their values, and the adapter changes the
logits (a zero B would pass every other check). Then it writes the JSON `output`:
  tokens            the token ids
  losses            per position t < n-1, the cross-entropy of token t+1 (f64 of f32 logits)
  mean_loss         their mean (hesper's loss over one unpadded sequence)
  logits_last       the logits of the last position
  base_mean_loss    the mean loss without the adapter (model.disable_adapter())
  scaling           PEFT's scale s of each adapted module kind (alpha/r, or alpha/sqrt(r))
  versions          torch, transformers, peft
Compare losses and logits_last with hesper's on the same GGUF, adapter and tokens.

Needs torch, transformers, peft, gguf and safetensors (pure Python but torch).
Usage: scripts/peft-check.py MODEL.gguf ADAPTER_DIR 504,3575,282,4649 out.json
"""
import json
import os
import sys
import warnings

import torch
import transformers
import peft
from peft import PeftModel, get_peft_model_state_dict
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

if len(sys.argv) != 5:
    sys.exit(__doc__)
gguf_path, adapter_dir, ids_arg, output = sys.argv[1:]
ids = [int(t) for t in ids_arg.split(",")]
assert len(ids) >= 2, "at least two tokens: the losses predict token t+1 from t"

gguf_path = os.path.abspath(gguf_path)
base = AutoModelForCausalLM.from_pretrained(
    os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path), torch_dtype=torch.float32
)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    model = PeftModel.from_pretrained(base, adapter_dir)
peft_warnings = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if f"{os.sep}peft{os.sep}" in w.filename]
assert not peft_warnings, "PEFT warned while loading the adapter:\n" + "\n".join(peft_warnings)
model.eval()

# The adapter in the model is the file's, key for key and value for value.
saved = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
loaded = get_peft_model_state_dict(model)
missing = sorted(set(loaded) - set(saved))
unexpected = sorted(set(saved) - set(loaded))
assert not missing, f"keys PEFT's model has that the file lacks: {missing[:5]} ({len(missing)})"
assert not unexpected, f"keys of the file PEFT's model lacks: {unexpected[:5]} ({len(unexpected)})"
for key, value in saved.items():
    assert torch.equal(loaded[key].float().cpu(), value.float()), f"{key}: loaded values differ from the file's"

scaling = {}
for name, module in model.named_modules():
    if isinstance(module, LoraLayer):
        scaling.setdefault(name.rsplit(".", 1)[-1], module.scaling["default"])


def run():
    """(per-token losses, last position's logits), in f64 from the f32 logits."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    lp = torch.log_softmax(logits, -1)
    losses = [-(lp[t, ids[t + 1]]).item() for t in range(len(ids) - 1)]
    return losses, logits[-1].tolist()


losses, logits_last = run()
with model.disable_adapter():
    base_losses, base_logits_last = run()
change = max(abs(a - b) for a, b in zip(logits_last, base_logits_last))
assert change > 0, "the adapter does not change the logits (is every B zero?)"

result = {
    "tokens": ids,
    "losses": losses,
    "mean_loss": sum(losses) / len(losses),
    "logits_last": logits_last,
    "base_mean_loss": sum(base_losses) / len(base_losses),
    "scaling": scaling,
    "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__},
}
with open(output, "w") as f:
    json.dump(result, f, indent=1)
print("peft", peft.__version__, "transformers", transformers.__version__, "torch", torch.__version__)
print(f"adapter {adapter_dir}: {len(saved)} tensors, all loaded; scaling {scaling}")
print(f"mean loss {result['mean_loss']:.7f} (without the adapter {result['base_mean_loss']:.7f}); max logit change {change:.3g}")
print("wrote", output)
