#!/usr/bin/env bash
# Every figure in docs/RESULTS.md comes from one of these commands (CPU, 2 cores, torch 1 thread per worker).
# Run from the repository root after `make install`. Each writes docs/<name>.json and prints a table.
set -euo pipefail
PY=${PY:-.venv/bin/python}
N=${N:-4}          # prompts per dataset (MT-Bench, GSM8K, HumanEval benchmark split)
TOK=${TOK:-128}

# 1. draft quality: acceptance of each shipped draft at temperature 0 (30 and 9 prompts) and 1 (SD, gamma 4)
for d in embedded embedded-weak; do
  $PY -m engine bench --methods sd --draft $d --dataset all --limit 10 --max-new-tokens $TOK \
      --temperature 0 --gamma 4 --json docs/draft-$d-t0-n10.json
  for t in 0 1; do
    $PY -m engine bench --methods sd --draft $d --dataset all --limit 3 --max-new-tokens $TOK \
        --temperature $t --gamma 4 --json docs/draft-$d-t$t.json
  done
done

# 2. the main comparison, greedy, embedded pair
$PY -m engine bench --methods ar,sd,hf-assisted,pearl,specbranch,specbranch-no-branch,specbranch-no-hrad,specbranch-fixed \
    --dataset all --limit $N --max-new-tokens $TOK --temperature 0 --gamma 6 --json docs/bench-cpu-t0.json

# 3. sampled (temperature 1)
$PY -m engine bench --methods ar,sd,pearl,specbranch --dataset all --limit $N --max-new-tokens $TOK \
    --temperature 1 --gamma 6 --json docs/bench-cpu-t1.json

# 4. the poorly aligned regime: rollback of PEARL vs SpecBranch with the weak draft
$PY -m engine bench --methods ar,sd,pearl,specbranch --draft embedded-weak --dataset all --limit $N \
    --max-new-tokens $TOK --temperature 0 --gamma 6 --json docs/bench-cpu-weak-t0.json
