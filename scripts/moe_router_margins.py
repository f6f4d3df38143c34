#!/usr/bin/env python3
# Diagnosis for issue 28, run on the GPU machine (transformers and PyTorch are there): the float64
# router margin between the k-th and (k+1)-th expert probability at every (position, sparse layer)
# of a mixture-of-experts fixture, smallest first, and per layer at the positions given. A margin
# near zero is where any bf16 path may route a token to other experts than the float64 truth.
#   python3 scripts/moe_router_margins.py tests/data/fixtures/qwen3_5-moe-tiny 237
import json, sys, torch, numpy as np
from transformers import AutoModelForCausalLM
fx = sys.argv[1]
ref = json.load(open(f"{fx}/ref.json"))
ids = torch.tensor([ref["prompt_ids"]])
try:  # float64 needs the eager experts loop (grouped_mm takes no doubles)
    m = AutoModelForCausalLM.from_pretrained(f"{fx}/bf16", dtype=torch.float64, experts_implementation="eager").eval()
except TypeError:
    m = AutoModelForCausalLM.from_pretrained(f"{fx}/bf16", dtype=torch.float64).eval()
    m.config._experts_implementation = "eager"
cfg = m.config.get_text_config() if hasattr(m.config, "get_text_config") else m.config
k = cfg.num_experts_per_tok
caught = []
def hook(mod, inp, out):
    x = inp[0].reshape(-1, inp[0].shape[-1])
    logits = x @ mod.weight.T
    caught.append(torch.softmax(logits.double(), -1))
for name, mod in m.named_modules():
    if name.endswith("mlp.gate") and hasattr(mod, "weight"):
        mod.register_forward_hook(hook)
with torch.no_grad():
    m(ids)
p = torch.stack(caught)  # [layers, T, E]
s = p.sort(-1, descending=True).values
margin = (s[..., k - 1] - s[..., k])  # [layers, T]
mins = margin.min(0).values.numpy()
order = np.argsort(mins)
print("smallest router margins (position: margin, layer):")
for t in order[:12]:
    print(f"  {t}: {mins[t]:.2e} layer {int(margin[:, t].argmin())}")
for t in [int(a) for a in sys.argv[2:]]:
    print(f"position {t}: margins per layer {[f'{v:.2e}' for v in margin[:, t].tolist()]}")
