"""Gather the target's answers to questions it wrote itself (distill --self-prompts ... --generate-only, one work dir
per seed) into one training corpus, and write the fixed held-out rows the drafts are scored on.

  python docs/results/tools/build_self_corpus.py --out data/self3_smollm2_135m.jsonl.gz \\
      --held-out runs/held_out.jsonl runs/self-s2 runs/self-s3 ...

Row i of a work dir's self_generated.jsonl answers its self_prompts.jsonl row i. A row is dropped when its question
was seen before (in the shipped corpora, or in an earlier seed: exact text or prompt ids), or shares an 8-word run
with a benchmark-split or tuning prompt (the generation tool drops those already; checked again here), or has no
answer. The held-out rows are those `distill` holds out of the three shipped corpora (by prompt, 3 %, seed 0), so
every draft is scored on the same 258 rows whatever corpora it trained on.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from engine.measure.datasets import DATASETS, benchmark_prompts  # noqa: E402
from engine.training.common import read_jsonl, split_by_prompt  # noqa: E402
from engine.training.distill import shingles  # noqa: E402

SHIPPED = [f"data/{n}_smollm2_135m.jsonl.gz" for n in ("teacher", "self", "self2")]


def excluded_shingles() -> set:
    """8-word runs of every benchmark-split prompt and of the tuning prompts."""
    texts = [p.text for d in DATASETS for p in benchmark_prompts(d)]
    texts += [r["prompt"] for r in read_jsonl(Path("data/tuning_prompts.jsonl")) if "prompt" in r]
    return set().union(*(shingles(t) for t in texts))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("work_dirs", nargs="*", help="distill --generate-only work dirs, in order")
    p.add_argument("--out", help="the corpus, .jsonl.gz (none: only --held-out)")
    p.add_argument("--held-out", help="also write the shipped corpora's held-out rows here")
    args = p.parse_args()
    shipped = [r for path in SHIPPED for r in read_jsonl(Path(path))]
    seen_text = {r["prompt"] for r in shipped if "prompt" in r}
    seen_ids = {tuple(r["prompt_ids"]) for r in shipped}
    exclude = excluded_shingles()
    kept, dropped = [], {"seen": 0, "benchmark": 0, "empty": 0}
    for work in map(Path, args.work_dirs):
        prompts = read_jsonl(work / "self_prompts.jsonl")
        answers = read_jsonl(work / "self_generated.jsonl")
        for q, a in zip(prompts, answers):
            if q["prompt"] in seen_text or tuple(a["prompt_ids"]) in seen_ids:
                dropped["seen"] += 1
            elif shingles(q["prompt"]) & exclude:
                dropped["benchmark"] += 1
            elif not a["response_ids"]:
                dropped["empty"] += 1
            else:
                row = {"source": f"self:{work.name}", "index": len(kept), "prompt": q["prompt"]}
                kept.append(row | {"prompt_ids": a["prompt_ids"], "response_ids": a["response_ids"]})
            seen_text.add(q["prompt"])
            seen_ids.add(tuple(a["prompt_ids"]))
    if args.out:
        with gzip.open(args.out, "wt") as f:
            for row in kept:
                f.write(json.dumps(row) + "\n")
    tokens = sum(len(r["response_ids"]) for r in kept)
    print(json.dumps({"rows": len(kept), "response_tokens": tokens, "dropped": dropped}))
    if args.held_out:
        rows = [{"prompt_ids": r["prompt_ids"], "response_ids": r["response_ids"]} for r in shipped]
        _, val = split_by_prompt([r for r in rows if r["response_ids"]], 0.03, 0)
        Path(args.held_out).write_text("".join(json.dumps(r) + "\n" for r in val))
        print(json.dumps({"held_out_rows": len(val)}))


if __name__ == "__main__":
    main()
