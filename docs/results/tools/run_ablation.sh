#!/usr/bin/env bash
# Every method and ablation over 3 seeds (step 1), the poorly aligned regime (2), the cost of a k-row draft step (3),
# the measured-cost branch policy (4), and methods_by_seed (5-7). CPU, 1 torch thread per worker; run from the
# repository root after `make install`. Each bench writes docs/results/json/<name>.json; `summarize` pools the seeds.
#   STEPS="1 2"   run only these steps (default: all, in order)
#   V=-0z         suffix for the JSON names, so a rerun keeps the older files
#   EXTRA=...     settings added to every bench, after (so overriding) COMMON's
#   DRAFT=self    the draft of steps 1, 4 and 5-7 (default embedded)
# The results' speed table (docs/results/README.md), the app's pair and settings:
#   STEPS="1" DRAFT=self V=-0z EXTRA="--gamma 8 --draft-stop 0 --head-start 0.02 --epsilon 0.1 --hold 0
#     --draft-forward lean-compiled" bash docs/results/tools/run_ablation.sh
# The distilled draft's ablation there: STEPS="1" V=-0e EXTRA="--head-start 0.3" bash docs/results/tools/run_ablation.sh
set -euo pipefail
PY=${PY:-.venv/bin/python}
N=${N:-2}        # prompts per dataset (MT-Bench, GSM8K, HumanEval benchmark split)
TOK=${TOK:-64}
V=${V:-}
OUT=${OUT:-docs/results/json}
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
          --json $OUT/ablation$V-t$t-s$s.json
    done
    $PY -m engine summarize $OUT/ablation$V-t$t-s{0,1,2}.json --json $OUT/ablation$V-t$t.json
  done
}

# 2. the poorly aligned regime: the weak draft on prompts in languages the 135M target barely knows
step2() {
  for s in 0 1 2; do
    $PY -m engine bench --methods ar,sd,pearl,specbranch --draft embedded-weak \
        --dataset data/foreign_prompts.jsonl --max-new-tokens $TOK --temperature 0 --seed $s $COMMON \
        --json $OUT/weak-foreign$V-s$s.json
  done
  $PY -m engine summarize $OUT/weak-foreign$V-s{0,1,2}.json --json $OUT/weak-foreign$V.json
}

# 3. what a k-row draft step costs against a 1-row step (and the target's forwards)
step3() {
  $PY -m engine costs --draft embedded --max-rows 3 --max-tokens 4 --json $OUT/costs-cpu-draft$V.json
}

# 4. the measured-cost branch policy (--branch-costs) against PEARL and the paper's k rule, same prompts
step4() {
  $PY -m engine bench --methods ar,pearl,specbranch-no-hrad --draft $DRAFT --dataset all --limit $N \
      --max-new-tokens $TOK --temperature 0 $COMMON --branch-costs --json $OUT/branch-costs$V-t0.json
}

# ar, sd, pearl, specbranch (the defaults: no H-RAD, no feed stop) on the same prompts, seeds 0-2, at each
# temperature given, into $OUT/NAME-t<T>-s<seed>.json and the pooled $OUT/NAME-t<T>.json
methods_by_seed() {
  local name=$1; shift
  for t in "$@"; do
    for s in 0 1 2; do
      $PY -m engine bench --methods ar,sd,pearl,specbranch --draft $DRAFT --dataset all --limit $N \
          --max-new-tokens $TOK --temperature $t --seed $s $COMMON --json $OUT/$name-t$t-s$s.json
    done
    $PY -m engine summarize $OUT/$name-t$t-s{0,1,2}.json --json $OUT/$name-t$t.json
  done
}

# Steps 5-7 are the same command, run as the engine changed; rerun now, each measures the current engine.
# 5. the engine as it was after the row-count layouts
step5() { methods_by_seed layouts 0; }

# 6. the engine with oneDNN-packed weights for verify passes, T=0 and T=1
step6() { methods_by_seed packed 0 1; }

# 7. the engine with the draft's matmuls on bfloat16 weights (--draft-matmul auto), T=0 and T=1
step7() { methods_by_seed bf16draft 0 1; }

for step in $STEPS; do
  "step$step"
done
