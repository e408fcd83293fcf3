#!/usr/bin/env bash
# Issue 13: the ablation table (docs/RESULTS.md §0b), the poorly aligned regime, the cost of a k-row draft
# step, and the measured-cost branch policy. CPU, 2 cores, 1 torch thread per worker; run from the
# repository root after `make install`. Each bench writes docs/<name>.json; `summarize` pools the seeds.
set -euo pipefail
PY=${PY:-.venv/bin/python}
N=${N:-2}        # prompts per dataset (MT-Bench, GSM8K, HumanEval benchmark split)
TOK=${TOK:-64}
COMMON="--gamma 3 --draft-stop 0.3 --epsilon 0.5 --branches 3"

# 1. every method and ablation, T=0 and T=1, seeds 0-2 (at T=0 the seed changes nothing but the clock);
#    --hrad: the specbranch row uses H-RAD (off by default), specbranch-no-hrad is confidence only
for t in 0 1; do
  for s in 0 1 2; do
    $PY -m engine bench --methods ar,sd,pearl,specbranch,specbranch-no-branch,specbranch-no-hrad,specbranch-fixed,hf-assisted \
        --draft embedded --dataset all --limit $N --max-new-tokens $TOK --temperature $t --seed $s $COMMON --hrad \
        --json docs/ablation-t$t-s$s.json
  done
  $PY -m engine summarize docs/ablation-t$t-s{0,1,2}.json --json docs/ablation-t$t.json
done

# 2. the poorly aligned regime: the weak draft on prompts in languages the 135M target barely knows
for s in 0 1 2; do
  $PY -m engine bench --methods ar,sd,pearl,specbranch --draft embedded-weak \
      --dataset data/foreign_prompts.jsonl --max-new-tokens $TOK --temperature 0 --seed $s $COMMON \
      --json docs/weak-foreign-s$s.json
done
$PY -m engine summarize docs/weak-foreign-s{0,1,2}.json --json docs/weak-foreign.json

# 3. what a k-row draft step costs against a 1-row step (and the target's forwards)
$PY -m engine costs --draft embedded --max-rows 3 --max-tokens 4 --json docs/costs-cpu-draft.json

# 4. the measured-cost branch policy (--branch-costs) against PEARL and the paper's k rule, same prompts
$PY -m engine bench --methods ar,pearl,specbranch-no-hrad --draft embedded --dataset all --limit $N \
    --max-new-tokens $TOK --temperature 0 $COMMON --branch-costs --json docs/branch-costs-t0.json

# ar, sd, pearl, specbranch (the defaults: no H-RAD, no feed stop) on the same prompts, seeds 0-2, at each
# temperature given, into docs/NAME-t<T>-s<seed>.json and the pooled docs/NAME-t<T>.json
methods_by_seed() {
  local name=$1; shift
  for t in "$@"; do
    for s in 0 1 2; do
      $PY -m engine bench --methods ar,sd,pearl,specbranch --draft embedded --dataset all --limit $N \
          --max-new-tokens $TOK --temperature $t --seed $s $COMMON --json docs/$name-t$t-s$s.json
    done
    $PY -m engine summarize docs/$name-t$t-s{0,1,2}.json --json docs/$name-t$t.json
  done
}

# 5. the engine as it was after the row-count layouts (docs/RESULTS.md §0c; rerun now, it measures §6's engine)
methods_by_seed layouts 0

# 6. the engine with oneDNN-packed weights for verify passes (docs/RESULTS.md §0d), T=0 and T=1
methods_by_seed packed 0 1
