"""The 4-bit self-draft's LM head in float32 (shipped) or bfloat16, A/B on the tuning prompts with the app's settings
for this draft (docs/RESULTS.md §0f). Alternate the two, e.g.:
  for i in 1 2; do for k in f32head bf16head; do PYTHONPATH=. .venv/bin/python docs/ab_int4_head.py $k $i; done; done
bf16head routes the head through Bf16Matmul for this run only (lm_head.draft_matmul keeps it float32). The draft runs
transformers' forward, as it did for §0f (before the lean decode path, §0g)."""
import sys

import engine.lm_head as lh
import engine.models as models
from engine.__main__ import main

kind, run = sys.argv[1], sys.argv[2]
if kind == "bf16head":
    shipped = lh.draft_matmul

    def bf16_head(k, w, head=False):
        return lh.Bf16Matmul(w) if k == "int4" and head else shipped(k, w, head)

    models.draft_matmul = bf16_head  # what models.LM calls for its head
sys.exit(main(["bench", "--methods", "ar,sd,pearl,specbranch", "--draft", "self", "--draft-forward", "transformers",
               "--dataset", "data/tuning_prompts.jsonl", "--max-new-tokens", "64", "--temperature", "0",
               "--gamma", "6", "--draft-stop", "0", "--head-start", "0.02", "--epsilon", "0.1", "--branches", "3",
               "--json", f"docs/ab-int4-{kind}-{run}.json"]))
