#!/usr/bin/env bash
# Issue 13: the ablation table (docs/RESULTS.md §0b, §0e), the poorly aligned regime, the cost of a k-row draft
# step, and the measured-cost branch policy. CPU, 2 cores, 1 torch thread per worker; run from the
# repository root after `make install`. Each bench writes docs/<name>.json; `summarize` pools the seeds.
#   STEPS="1 2"   run only these steps (default: all, in order)
#   V=-0e         suffix for the JSON names of steps 1-4, so a rerun on a newer engine keeps the older tables
#   EXTRA=...     settings added to every bench, after (so overriding) COMMON's (§0b's: V and EXTRA unset; §0e's:
#                 V=-0e EXTRA="--head-start 0.3", the app's defaults then, so PEARL and SpecBranch both have the head
#                 start there)
#   DRAFT=self    the draft of steps 1, 4 and 5-7 (default embedded; §0f's, §0g's and §0h's: the target itself, read
#                 in 4 bits; §0h: STEPS="1" DRAFT=self V=-0h EXTRA="--gamma 6 --draft-stop 0 --head-start 0.02
#                 --epsilon 0.1", and step 2 with V=-0h EXTRA="--head-start 0.3")
set -euo pipefail
PY=${PY:-.venv/bin/python}
N=${N:-2}        # prompts per dataset (MT-Bench, GSM8K, HumanEval benchmark split)
TOK=${TOK:-64}
V=${V:-}
STEPS=${STEPS:-1 2 3 4 5 6 7}
DRAFT=${DRAFT:-embedded}
COMMON="--gamma 3 --draft-stop 0.3 --epsilon 0.5 --branches 3 ${EXTRA:-}"

# 1. every method and ablation, T=0 and T=1, seeds 0-2 (at T=0 the seed changes nothing but the clock);
#    --hrad: the specbranch row uses H-RAD (off by default), specbranch-no-hrad is confidence only
step1() {
  for t in 0 1; do
    for s in 0 1 2; do
      $PY -m engine bench --methods ar,sd,pearl,specbranch,specbranch-no-branch,specbranch-no-hrad,specbranch-fixed,hf-assisted \
          --draft $DRAFT --dataset all --limit $N --max-new-tokens $TOK --temperature $t --seed $s $COMMON --hrad \
          --json docs/ablation$V-t$t-s$s.json
    done
    $PY -m engine summarize docs/ablation$V-t$t-s{0,1,2}.json --json docs/ablation$V-t$t.json
  done
}

# 2. the poorly aligned regime: the weak draft on prompts in languages the 135M target barely knows
step2() {
  for s in 0 1 2; do
    $PY -m engine bench --methods ar,sd,pearl,specbranch --draft embedded-weak \
        --dataset data/foreign_prompts.jsonl --max-new-tokens $TOK --temperature 0 --seed $s $COMMON \
        --json docs/weak-foreign$V-s$s.json
  done
  $PY -m engine summarize docs/weak-foreign$V-s{0,1,2}.json --json docs/weak-foreign$V.json
}

# 3. what a k-row draft step costs against a 1-row step (and the target's forwards)
step3() {
  $PY -m engine costs --draft embedded --max-rows 3 --max-tokens 4 --json docs/costs-cpu-draft$V.json
}

# 4. the measured-cost branch policy (--branch-costs) against PEARL and the paper's k rule, same prompts
step4() {
  $PY -m engine bench --methods ar,pearl,specbranch-no-hrad --draft $DRAFT --dataset all --limit $N \
      --max-new-tokens $TOK --temperature 0 $COMMON --branch-costs --json docs/branch-costs$V-t0.json
}

# ar, sd, pearl, specbranch (the defaults: no H-RAD, no feed stop) on the same prompts, seeds 0-2, at each
# temperature given, into docs/NAME-t<T>-s<seed>.json and the pooled docs/NAME-t<T>.json
methods_by_seed() {
  local name=$1; shift
  for t in "$@"; do
    for s in 0 1 2; do
      $PY -m engine bench --methods ar,sd,pearl,specbranch --draft $DRAFT --dataset all --limit $N \
          --max-new-tokens $TOK --temperature $t --seed $s $COMMON --json docs/$name-t$t-s$s.json
    done
    $PY -m engine summarize docs/$name-t$t-s{0,1,2}.json --json docs/$name-t$t.json
  done
}

# Steps 5-7 are the same command, run as the engine changed; rerun now, each measures the current engine.
# 5. the engine as it was after the row-count layouts (docs/RESULTS.md §0c)
step5() { methods_by_seed layouts 0; }

# 6. the engine with oneDNN-packed weights for verify passes (docs/RESULTS.md §0d), T=0 and T=1
step6() { methods_by_seed packed 0 1; }

# 7. the engine with the draft's matmuls on bfloat16 weights (--draft-matmul auto; docs/RESULTS.md §0e), T=0 and T=1
step7() { methods_by_seed bf16draft 0 1; }

for step in $STEPS; do
  "step$step"
done
