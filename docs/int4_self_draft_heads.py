"""The target as its own draft, its decoder layers read in 4 bits (Int4Matmul), with five LM heads
(docs/RESULTS.md §0f and §0h, engine/lm_head.py draft_matmul): how often its greedy token equals the float32
target's, fed the target's own greedy continuation (5 chat prompts × 48 tokens), and its step's median ms (1 thread).
Run from the repository root: PYTHONPATH=. .venv/bin/python docs/int4_self_draft_heads.py"""
import time

import torch
from safetensors.torch import load_file

from engine.drafts import twin_of
from engine.lm_head import Bf16Matmul, HeadMatmul, Int4Matmul, ShortlistHead, fast_linears
from engine.models import DRAFTS_DIR, LM, load_pair

torch.set_num_threads(1)
PROMPTS = ["Why is the sky blue?", "Write a haiku about autumn.", "What is 17 times 23? Explain step by step.",
           "Give three tips for staying healthy.", "Explain recursion to a child."]
pair = load_pair("embedded", None)
target, tok = pair.target, pair.tokenizer
head = target.model.get_output_embeddings().weight
subset = load_file(str(DRAFTS_DIR / "smollm2-135m-draft" / "vocab_subset.safetensors"))["ids"]  # the 8k-row head
HEADS = {"4-bit, float32 shortlist (shipped)": (None, ShortlistHead), "float32": (None, HeadMatmul),
         "bfloat16": (None, Bf16Matmul), "4-bit": (None, Int4Matmul), "float32, 8k rows": (subset, HeadMatmul)}

for name, (ids_kept, matmul) in HEADS.items():
    twin = twin_of(target.model)
    fast_linears(twin, "int4")
    draft = LM("self-int4", twin, tok, target.vocab_size, ids_kept)  # float32 head first, then the one tried
    draft._head = matmul(head if ids_kept is None else head[ids_kept])
    agree = n = 0
    ms = []
    for p in PROMPTS:
        ids = torch.tensor([tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                    tokenize=True, return_dict=False)])
        t_cache, d_cache = target.new_cache(), draft.new_cache()
        t_logits, d_logits = target.forward(ids, t_cache)[:, -1], draft.forward(ids, d_cache)[:, -1]
        for _ in range(48):
            nxt = t_logits.argmax(-1)
            agree, n = agree + int(nxt == d_logits.argmax(-1)), n + 1
            t_logits = target.forward(nxt.view(1, 1), t_cache)[:, -1]
            start = time.perf_counter()
            d_logits = draft.forward(nxt.view(1, 1), d_cache)[:, -1]
            ms.append((time.perf_counter() - start) * 1e3)
    print(f"head {name}: agreement {agree / n:.3f} over {n} tokens, draft step {sorted(ms)[len(ms) // 2]:.1f} ms")
