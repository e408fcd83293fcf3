#!/usr/bin/env bash
# How the shipped distilled drafts and their data-size curve (docs/models.md) were made (CPU, 2 cores). Run from the
# repository root after `make install`. Stages are resumable: a work dir keeps generations and labels.
set -euo pipefail
PY=${PY:-.venv/bin/python}
STAGE=${1:-all}
CORPORA="--corpus data/teacher_smollm2_135m.jsonl.gz --corpus data/self_smollm2_135m.jsonl.gz"
COMMON="$CORPORA --vocab 8192 --batch-size 16 --label-batch-size 16 --seed 0 --threads 2 --work-dir runs/distill-v2"

if [[ $STAGE == corpus ]]; then  # already in data/ (35 min on CPU): the target's own questions and answers
  $PY -m engine distill --self-prompts 3000 --gen-batch-size 64 --threads 2 --seed 0 --generate-only \
      --work-dir runs/distill-self --out unused
  $PY - <<'EOF'
import gzip, json
prompts = [json.loads(l) for l in open("runs/distill-self/self_prompts.jsonl")]
answers = [json.loads(l) for l in open("runs/distill-self/self_generated.jsonl")]
with gzip.open("data/self_smollm2_135m.jsonl.gz", "wt") as f:
    for i, (p, a) in enumerate(zip(prompts, answers)):
        f.write(json.dumps({"source": "self", "index": i, "prompt": p["prompt"], "prompt_ids": a["prompt_ids"],
                            "response_ids": a["response_ids"]}) + "\n")
EOF
  exit
fi

if [[ $STAGE == all || $STAGE == main ]]; then  # labels 18 min, then ~13 min an epoch
  $PY -m engine distill $COMMON --layers 6 --epochs 3 --lr 1e-3 --out runs/drafts/main-v2
fi

if [[ $STAGE == v3 ]]; then  # the shipped draft, trained on with self2 added (v3; its history: docs/results/history.md)
  # On the 2-core machine the top-32 labels of 971k tokens took 60 min (cached in the work dir, reused) and the
  # 759 training steps 52 min.
  mkdir -p runs/v2-init && git archive 75303b3 engine/drafts/smollm2-135m-draft | tar -x -C runs/v2-init
  $PY -m engine distill $CORPORA --corpus data/self2_smollm2_135m.jsonl.gz \
      --init runs/v2-init/engine/drafts/smollm2-135m-draft --vocab 8192 --epochs 1.5 --lr 5e-4 --batch-size 16 \
      --label-batch-size 16 --seed 0 --threads 2 --max-minutes 75 --work-dir runs/distill-v3 --out runs/draft-v3
fi

if [[ $STAGE == grown ]]; then  # not shipped: v3 with 4 layers grown on top, the answers' own tokens as labels
  # (no target pass labels them); 3.3-6 s a step on the 2-core AVX-512 machine. The measured draft: this was
  # stopped by hand at step 550, then rerun with --max-minutes 0.05, which resumes from the step-500 checkpoint,
  # takes one step and writes the draft (step 501, held-out agreement 0.6268)
  $PY -m engine distill $CORPORA --corpus data/self2_smollm2_135m.jsonl.gz --init weights/smollm2-135m-draft \
      --grow 4 --hard-labels --vocab 8192 --epochs 1.5 --lr 5e-4 --batch-size 16 --label-batch-size 16 --seed 0 \
      --threads 2 --max-minutes 70 --work-dir runs/distill-grown --out runs/draft-grown
fi

# data/self3_smollm2_135m.jsonl.gz: task-style questions (the leads), two seeds at a time, 1 thread each
if [[ $STAGE == self3 ]]; then
  LEADS="Write,Explain,Describe,Summarize,Create,List,Compare,Give,Suggest,Imagine,Act as,Rewrite,Solve,Implement"
  LEADS="$LEADS,Identify,Discuss,Draft,Classify,Outline,Analyze"
  for pair in "2 1500" "3 1500" "4 1000" "5 1000"; do
    set -- $pair
    $PY -m engine distill --self-prompts $2 --self-prompt-leads "$LEADS" --gen-batch-size 64 --threads 1 --seed $1 \
        --generate-only --work-dir runs/self-s$1 --out unused &
    [[ $1 == 3 || $1 == 5 ]] && wait
  done
  $PY docs/results/tools/build_self_corpus.py --out data/self3_smollm2_135m.jsonl.gz --held-out runs/held_out.jsonl \
      runs/self-s2 runs/self-s3 runs/self-s4 runs/self-s5
  exit
fi

if [[ $STAGE == v4 ]]; then  # not shipped: the shipped draft, one more epoch on all four corpora, hard labels
  # (818 steps, 90 CPU-minutes on the 2-core AVX-512 machine); held-out rows as build_self_corpus.py wrote them
  $PY -m engine distill $CORPORA --corpus data/self2_smollm2_135m.jsonl.gz --corpus data/self3_smollm2_135m.jsonl.gz \
      --init weights/smollm2-135m-draft --hard-labels --held-out runs/held_out.jsonl --vocab 8192 --epochs 1 \
      --lr 5e-4 --batch-size 16 --label-batch-size 16 --seed 0 --threads 2 --work-dir runs/distill-v4 --out runs/draft-v4
fi

if [[ $STAGE == all || $STAGE == curve ]]; then  # data-size curve: 2 layers, 1 epoch, same held-out rows
  for n in 75000 150000 300000 0; do
    $PY -m engine distill $COMMON --layers 2 --epochs 1 --lr 1e-3 --max-tokens $n --out runs/drafts/curve-l2-$n
  done
fi

if [[ $STAGE == all || $STAGE == repro ]]; then  # the same command again: same weights, same acceptance
  $PY -m engine distill $COMMON --layers 2 --epochs 1 --lr 1e-3 --max-tokens 75000 --out runs/drafts/repro-l2-75000
  sha256sum runs/drafts/curve-l2-75000/*.safetensors runs/drafts/repro-l2-75000/*.safetensors
fi
