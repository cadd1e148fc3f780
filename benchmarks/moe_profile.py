"""Run: .venv/bin/python benchmarks/moe_profile.py /tmp/moe-model

Profile one 64-token step of the Qwen3-MoE test model (8 experts, top-2) through the engine."""
import sys
from pathlib import Path
sys.path.insert(0, ".")
import torch
from torch.profiler import ProfilerActivity, profile
from pagellm import LLM, SamplingParams
from tests.models.families import build

path = build("qwen3_moe", Path(sys.argv[1]))
llm = LLM(str(path), num_kv_blocks=64)
params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
prompt = {"prompt_token_ids": list(range(3, 67))}  # 64 tokens: one prefill step
llm.generate([prompt], params, use_tqdm=False)  # warm
with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
    llm.generate([{"prompt_token_ids": list(range(4, 68))}], params, use_tqdm=False)
rows = prof.key_averages(group_by_input_shape=True)
print("aten::linear calls in one 64-token step (2 layers; layer 1 is dense, mlp_only_layers=[1]):")
for e in sorted((e for e in rows if e.key == "aten::linear"), key=lambda e: str(e.input_shapes)):
    print(f"  {e.count:3d} x linear{e.input_shapes[:2]}")
