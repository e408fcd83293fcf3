"""The 4-bit self-draft's LM head, A/B on the tuning prompts with the app's settings for this draft: `shortlist`, a
4-bit head whose largest logits are recomputed in float32 (lm_head.ShortlistHead, shipped since docs/RESULTS.md §0h),
against `f32head`, float32 (shipped in §0f and §0g), or `bf16head`. Alternate them, e.g. §0h's:
  for i in 1 2; do for k in f32head shortlist; do PYTHONPATH=. .venv/bin/python docs/ab_int4_head.py $k $i lean; done; done
and §0f's (before the lean decode path, so the draft ran transformers' forward, the third argument's default):
  for i in 1 2; do for k in f32head bf16head; do PYTHONPATH=. .venv/bin/python docs/ab_int4_head.py $k $i; done; done
f32head and bf16head route the head through HeadMatmul or Bf16Matmul for this run only."""
import sys

import engine.lm_head as lh
import engine.models as models
from engine.__main__ import main

kind, run = sys.argv[1], sys.argv[2]
forward = sys.argv[3] if len(sys.argv) > 3 else "transformers"
if kind in ("f32head", "bf16head"):
    shipped, other = lh.draft_matmul, lh.HeadMatmul if kind == "f32head" else lh.Bf16Matmul

    def head_of(k, w, head=False, keep_weight=True):
        return other(w) if k == "int4" and head else shipped(k, w, head, keep_weight)

    models.draft_matmul = head_of  # what models.LM calls for its head
name = f"ab-int4-{kind}-{run}" if forward == "transformers" else f"ab-int4-{kind}-{forward}-{run}"
sys.exit(main(["bench", "--methods", "ar,sd,pearl,specbranch", "--draft", "self", "--draft-forward", forward,
               "--dataset", "data/tuning_prompts.jsonl", "--max-new-tokens", "64", "--temperature", "0",
               "--gamma", "6", "--draft-stop", "0", "--head-start", "0.02", "--epsilon", "0.1", "--branches", "3",
               "--json", f"docs/{name}.json"]))
