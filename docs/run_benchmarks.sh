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

# ---------------------------------------------------------------- issue 10: the draft head (docs/RESULTS.md §0)
# 5. the draft head: how it was trained (features ~40 min, training 45 min on 2 cores; resumable work dir)
if [[ ${HEAD_TRAIN:-0} == 1 ]]; then
  $PY -m engine distill --kind head --corpus data/teacher_smollm2_135m.jsonl --corpus data/self_smollm2_135m.jsonl \
      --corpus data/self2_smollm2_135m.jsonl --layers 1 --unroll 3 --epochs 2 --batch-size 8 --lr 5e-4 --threads 2 \
      --max-minutes 45 --work-dir runs/head/work --out engine/drafts/smollm2-135m-head
fi

# 6. defaults, chosen on data/tuning_prompts.jsonl (benchmark split, none of the reported prompts)
for g in 2 3 4; do
  $PY -m engine bench --methods ar,pearl,specbranch,specbranch@embedded --draft embedded-head \
      --dataset data/tuning_prompts.jsonl --max-new-tokens $TOK --temperature 0 --gamma $g --json docs/tune-head-g$g-s0.json
done
$PY -m engine bench --methods ar,pearl,specbranch,specbranch@embedded --draft embedded-head \
    --dataset data/tuning_prompts.jsonl --max-new-tokens $TOK --temperature 0 --gamma 3 --draft-stop 0.3 \
    --json docs/tune-head-g3-s0.3.json

# 7. the head's acceptance (SD) is the sd row of step 8 (12 prompts, γ 3)

# 8. every method at T=0 and T=1 with the defaults chosen in step 6 (γ 3, draft stop 0.3); standalone-draft
#    peers in the same run (METHOD@DRAFT); then the forward costs and the modelled limit of each method
$PY -m engine bench --draft embedded-head --methods ar,sd,pearl,specbranch,pearl@embedded,specbranch@embedded,hf-assisted@embedded \
    --dataset all --limit $N --max-new-tokens $TOK --temperature 0 --gamma 3 --draft-stop 0.3 \
    --json docs/bench-cpu-head-t0.json
$PY -m engine bench --draft embedded-head --methods ar,pearl,specbranch,specbranch@embedded --dataset all --limit $N \
    --max-new-tokens $TOK --temperature 1 --gamma 3 --draft-stop 0.3 --json docs/bench-cpu-head-t1.json
$PY -m engine costs --draft embedded-head --reps 30 --bench docs/bench-cpu-head-t0.json --json docs/costs-cpu-head.json

# 9. issue 13: the ablation (3 seeds, T=0 and T=1), the poorly aligned regime, k-row costs and the
#    measured-cost branch policy: docs/run_ablation.sh (docs/RESULTS.md §0b)

# 10. where a verify pass's cost goes, the feed stop and measured-cost branching on the tuning prompts, and
#     bfloat16 (docs/RESULTS.md §0c)
PYTHONPATH=. $PY docs/profile_step.py
for dt in float32 bfloat16; do
  $PY -m engine costs --dtype $dt --draft embedded --max-tokens 8 --max-rows 1 --reps 15 --json docs/costs-cpu-$dt.json
done
$PY -m engine bench --dtype bfloat16 --methods ar,sd,pearl,specbranch --draft embedded --dataset all --limit 2 \
    --max-new-tokens 64 --temperature 0 --gamma 3 --draft-stop 0.3 --epsilon 0.5 --branches 3 \
    --json docs/bench-cpu-bf16-t0.json
TUNE="--methods ar,pearl,specbranch --draft embedded --dataset data/tuning_prompts.jsonl --max-new-tokens 128 \
      --temperature 0 --gamma 3 --draft-stop 0.3 --epsilon 0.5 --branches 3"
for f in 0 0.2 0.35 0.5; do
  $PY -m engine bench $TUNE --feed-stop $f --json docs/tune-feed-$f.json
done
$PY -m engine bench $TUNE --branch-costs --json docs/tune-branch-costs.json

# 11. oneDNN-packed weights for verify passes (docs/RESULTS.md §0d): the forward by tokens fed, packed copies off
#     and on (interleaved); the before/after bench pair was the command below from the previous commit's checkout
#     and this one, alternated twice (docs/ab-packed-{before,after}-{1,2}.json); then γ / draft stop on the tuning
#     prompts, and the continued draft's acceptance (docs/run_drafts.sh v3) beside the shipped one's
PYTHONPATH=. $PY docs/ab_layouts.py --json docs/ab-packed-forward.json
$PY -m engine bench --methods ar,sd,pearl,specbranch --draft embedded --dataset data/tuning_prompts.jsonl \
    --max-new-tokens 64 --temperature 0 --gamma 3 --draft-stop 0.3 --epsilon 0.5 --branches 3 \
    --json docs/ab-packed-after-1.json
for cfg in "4 0.3" "5 0.3" "5 0.15" "2 0.3"; do
  set -- $cfg
  $PY -m engine bench --methods ar,sd,pearl,specbranch --draft embedded --dataset data/tuning_prompts.jsonl \
      --max-new-tokens 64 --temperature 0 --gamma $1 --draft-stop $2 --epsilon 0.5 --branches 3 \
      --json docs/tune-g$1-s$2.json
done
$PY -m engine bench --methods sd,sd@runs/draft-v3 --draft embedded --dataset all --limit 10 --temperature 0 \
    --gamma 4 --max-new-tokens 128 --json docs/draft-v3-alpha.json

# 12. the draft's matmuls on bfloat16 weights (docs/RESULTS.md §0e): the bench with --draft-matmul float32 and
#     bfloat16, alternated twice (docs/ab-draft-{float32,bfloat16}-{1,2}.json); the forwards' costs each way; the
#     3-seed tables are docs/run_ablation.sh steps 1-4 (V=-0e) and 7
for i in 1 2; do
  for m in float32 bfloat16; do
    $PY -m engine bench --methods ar,sd,pearl,specbranch --draft embedded --dataset data/tuning_prompts.jsonl \
        --max-new-tokens 64 --temperature 0 --gamma 3 --draft-stop 0.3 --epsilon 0.5 --branches 3 \
        --draft-matmul $m --json docs/ab-draft-$m-$i.json
  done
done
PYTHONPATH=. $PY docs/draft_matmul_kernels.py
for m in float32 bfloat16; do  # with the modelled limit in the ablation's first T=0 seed (run_ablation.sh first)
  $PY -m engine costs --draft embedded --draft-matmul $m --max-rows 3 --max-tokens 4 \
      --bench docs/ablation-0e-t0-s0.json --json docs/costs-draft-$m.json
done
# the head start (--head-start), chosen on the tuning prompts: one run each of 0 (off), 0.25 and 0.5; the app
# default is 0.3, between the two that won (docs/tune-head-start-*.json)
for hs in 0 0.25 0.5; do
  $PY -m engine bench --methods ar,sd,pearl,specbranch --draft embedded --dataset data/tuning_prompts.jsonl \
      --max-new-tokens 64 --temperature 0 --gamma 3 --draft-stop 0.3 --epsilon 0.5 --branches 3 \
      --head-start $hs --json docs/tune-head-start-$hs.json
done

# 13. the target as its own draft, its weights read in 4 bits (--draft self; auto picks --draft-matmul int4 for it
#     on the CPU; docs/RESULTS.md §0f): the kernels, then γ and the head start chosen on the tuning prompts
#     (docs/tune-int4-*.json); the 3-seed tables are docs/run_ablation.sh step 1 with
#     STEPS="1" DRAFT=self V=-0f EXTRA="--gamma 6 --draft-stop 0 --head-start 0.02 --epsilon 0.1 $F0F".
#     §0f predates the lean decode path (§14), so its draft ran transformers' forward:
F0F="--draft-forward transformers"
PYTHONPATH=. $PY docs/draft_matmul_kernels.py
PYTHONPATH=. $PY docs/int4_self_draft_heads.py  # greedy agreement and step cost with four LM heads
$PY -m engine bench --methods sd --draft self $F0F --dataset all --limit 10 --max-new-tokens $TOK --temperature 0 \
    --gamma 4 --json docs/draft-self-int4-t0-n10.json  # α on §1's 30 prompts
for g in 4 6 8; do
  for hs in 0 0.3; do
    $PY -m engine bench --methods ar,sd,pearl,specbranch --draft self $F0F --dataset data/tuning_prompts.jsonl \
        --max-new-tokens 64 --temperature 0 --gamma $g --draft-stop 0.3 --epsilon 0.5 --branches 3 \
        --head-start $hs --json docs/tune-int4-g$g-hs$hs.json
  done
done
for cfg in "0.1 0.1 0.1" "0.1 0.1 0.25" "0 0.02 0.1" "0.2 0.2 0.25"; do  # γ 6: draft stop, head start, ε
  set -- $cfg
  $PY -m engine bench --methods ar,sd,pearl,specbranch --draft self $F0F --dataset data/tuning_prompts.jsonl \
      --max-new-tokens 64 --temperature 0 --gamma 6 --draft-stop $1 --epsilon $3 --branches 3 \
      --head-start $2 --json docs/tune-int4-g6-s$1-hs$2-e$3.json
done
for i in 1 2; do  # the self-draft's LM head in float32 or bfloat16, alternated
  for k in f32head bf16head; do PYTHONPATH=. $PY docs/ab_int4_head.py $k $i; done
done
$PY -m engine costs --draft self $F0F --max-rows 3 --max-tokens 8 --bench docs/ablation-0f-t0-s0.json \
    --json docs/costs-cpu-int4-0f.json
for th in 2 1; do  # torch threads per worker
  $PY -m engine bench --methods ar,sd,pearl --draft self $F0F --dataset data/tuning_prompts.jsonl --max-new-tokens 64 \
      --temperature 0 --gamma 6 --draft-stop 0 --head-start 0.02 --threads $th --json docs/threads-int4-$th.json
done

# 14. the lean decode path for the draft (engine/lean.py; --draft-forward lean, the default, against
#     transformers' forward), alternated twice on the tuning prompts with the app's settings for the 4-bit
#     self-draft; then γ with it; the 3-seed tables are docs/run_ablation.sh step 1 with
#     STEPS="1" DRAFT=self V=-0g EXTRA="--gamma 6 --draft-stop 0 --head-start 0.02 --epsilon 0.1" (docs/RESULTS.md §0g)
for i in 1 2; do
  for f in lean transformers; do
    $PY -m engine bench --methods ar,sd,pearl,specbranch --draft self --draft-forward $f \
        --dataset data/tuning_prompts.jsonl --max-new-tokens 64 --temperature 0 --gamma 6 --draft-stop 0 \
        --epsilon 0.1 --branches 3 --head-start 0.02 --json docs/ab-forward-$f-$i.json
  done
done
for g in 8 10 6; do
  $PY -m engine bench --methods ar,sd,pearl,specbranch --draft self --dataset data/tuning_prompts.jsonl \
      --max-new-tokens 64 --temperature 0 --gamma $g --draft-stop 0 --epsilon 0.1 --branches 3 --head-start 0.02 \
      --json docs/tune-lean-g$g.json
done
for f in lean transformers; do  # the distilled draft (bfloat16 matmuls) with the app's settings for it, one run each
  $PY -m engine bench --methods ar,sd,pearl,specbranch --draft embedded --draft-forward $f \
      --dataset data/tuning_prompts.jsonl --max-new-tokens 64 --temperature 0 --gamma 3 --draft-stop 0.3 \
      --epsilon 0.5 --branches 3 --head-start 0.3 --json docs/ab-forward-distilled-$f.json
done

# 15. the 4-bit self-draft's LM head: 4 bits with its 64 largest logits recomputed in float32 (lm_head.ShortlistHead,
#     docs/RESULTS.md §0h): greedy agreement and step cost of five heads; the bench alternated twice against the
#     float32 head; the 3-seed tables are docs/run_ablation.sh step 1 with STEPS="1" DRAFT=self V=-0h
#     EXTRA="--gamma 6 --draft-stop 0 --head-start 0.02 --epsilon 0.1", run at commit a7b036e (before §16's
#     calibration, so SpecBranch there forks by the paper's rule)
PYTHONPATH=. $PY docs/int4_self_draft_heads.py
for i in 1 2; do
  for k in f32head shortlist; do PYTHONPATH=. $PY docs/ab_int4_head.py $k $i lean; done
done
$PY -m engine costs --draft self --max-rows 3 --max-tokens 8 --bench docs/ablation-0h-t0-s0.json \
    --json docs/costs-cpu-int4-0h.json  # forward costs and the modelled limit next to the measured speedup

# 16. fork points from the acceptance the engine measured at each draft confidence (engine/calibration.py;
#     --calibrate, the default) against the paper's rule (--no-calibrate), alternated, T=1 then T=0, seeds 0-2, on
#     the ablation's 6 benchmark prompts with the app's settings for the 4-bit self-draft
for t in 1 0; do
  for s in 0 1 2; do
    for c in calibrate no-calibrate; do
      $PY -m engine bench --methods ar,pearl,specbranch --draft self --dataset all --limit 2 --max-new-tokens 64 \
          --temperature $t --seed $s --gamma 6 --draft-stop 0 --head-start 0.02 --epsilon 0.1 --branches 3 --$c \
          --json docs/calib-$c-t$t-s$s.json
    done
  done
  for c in calibrate no-calibrate; do
    $PY -m engine summarize docs/calib-$c-t$t-s{0,1,2}.json --json docs/calib-$c-t$t.json
  done
done

# 17. the same A/B with the distilled draft, where branches do rescue (α ~0.48), with the app's settings for it
for s in 0 1 2; do
  for c in calibrate no-calibrate; do
    $PY -m engine bench --methods ar,pearl,specbranch --draft embedded --dataset all --limit 2 --max-new-tokens 64 \
        --temperature 0 --seed $s --gamma 3 --draft-stop 0.3 --head-start 0.3 --epsilon 0.5 --branches 3 --$c \
        --json docs/calib-distilled-$c-t0-s$s.json
  done
done
for c in calibrate no-calibrate; do
  $PY -m engine summarize docs/calib-distilled-$c-t0-s{0,1,2}.json --json docs/calib-distilled-$c-t0.json
done

# the poorly aligned regime (docs/run_ablation.sh step 2's prompts and settings) with hold 0.5, seeds 0-2, into
# docs/NAME-s<seed>.json and the pooled docs/NAME.json; further arguments go to every bench
weak_with_hold() {
  local name=$1
  shift
  for s in 0 1 2; do
    $PY -m engine bench --methods ar,sd,pearl,specbranch,specbranch-no-branch --draft embedded-weak \
        --dataset data/foreign_prompts.jsonl --max-new-tokens 64 --temperature 0 --seed $s --gamma 3 \
        --draft-stop 0.3 --epsilon 0.5 --branches 3 --head-start 0.3 --hold 0.5 "$@" --json docs/$name-s$s.json
  done
  $PY -m engine summarize docs/$name-s{0,1,2}.json --json docs/$name.json
}

# the distilled draft with the app's settings for it on the 6 benchmark prompts, at temperature T, seed S and hold
# H, into docs/NAME.json
distilled_with_hold() {
  local t=$1 s=$2 h=$3 name=$4
  $PY -m engine bench --methods ar,pearl,specbranch --draft embedded --dataset all --limit 2 --max-new-tokens 64 \
      --temperature $t --seed $s --gamma 3 --draft-stop 0.3 --head-start 0.3 --epsilon 0.5 --branches 3 \
      --hold $h --json docs/$name.json
}

# the same settings with the layer-skipping self-draft self-skip:SKIP (the target without those layers, read in 4
# bits), at temperature T, seed S and hold H, into docs/NAME.json
skip_with_hold() {
  local skip=$1 t=$2 s=$3 h=$4 name=$5
  $PY -m engine bench --methods ar,pearl,specbranch --draft self-skip:$skip --dataset all --limit 2 \
      --max-new-tokens 64 --temperature $t --seed $s --gamma 3 --draft-stop 0.3 --head-start 0.3 --epsilon 0.5 \
      --branches 3 --hold $h --json docs/$name.json
}

# distilled_with_hold at hold 0.5, seeds 0-2, at each of TEMPS (default: 1 then 0), into docs/PREFIX-t$t-s$s.json
# and their summaries
distilled_seeds() {
  local prefix=$1 temps=${2:-1 0}
  for t in $temps; do
    for s in 0 1 2; do
      distilled_with_hold $t $s 0.5 $prefix-t$t-s$s
    done
    $PY -m engine summarize docs/$prefix-t$t-s{0,1,2}.json --json docs/$prefix-t$t.json
  done
}

# 18. SpecBranch's hold (--hold: draft nothing where the odds that it holds up fall below it; docs/RESULTS.md §0i)
#   a. the poorly aligned regime with hold 0.5, seeds 0-2
weak_with_hold hold-weak-foreign
#   b. the distilled draft with the app's settings for it, hold 0.5 against 0 (§0h's rule), alternated, T=0 and T=1
for t in 0 1; do
  for s in 0 1 2; do
    for h in 0.5 0; do
      distilled_with_hold $t $s $h hold-distilled-h$h-t$t-s$s
    done
  done
  for h in 0.5 0; do
    $PY -m engine summarize docs/hold-distilled-h$h-t$t-s{0,1,2}.json --json docs/hold-distilled-h$h-t$t.json
  done
done
#   c. the 4-bit self-draft with the app's settings for it, hold 0.5 against 0, one seed at each T
for t in 0 1; do
  for h in 0.5 0; do
    $PY -m engine bench --methods ar,pearl,specbranch --draft self --dataset all --limit 2 --max-new-tokens 64 \
        --temperature $t --gamma 6 --draft-stop 0 --head-start 0.02 --epsilon 0.1 --branches 3 --hold $h \
        --json docs/hold-self-h$h-t$t.json
  done
done
#   d. the app's default for the distilled drafts, chosen on the tuning prompts (no reported table uses them): hold
#      0.5 against 0, T=0 and T=1, one run each
for t in 0 1; do
  for h in 0.5 0; do
    $PY -m engine bench --methods ar,pearl,specbranch --draft embedded --dataset data/tuning_prompts.jsonl \
        --max-new-tokens 64 --temperature $t --gamma 3 --draft-stop 0.3 --head-start 0.3 --epsilon 0.5 --branches 3 \
        --hold $h --json docs/hold-tune-h$h-t$t.json
  done
done

# 19. The rescue table's pooled prior (docs/RESULTS.md §0j): §18a's poorly aligned regime and §18b's distilled runs
#     with hold 0.5 again, on the engine where a rescue bin with few verdicts reads what the other bins measured
#   a. the poorly aligned regime, seeds 0-2 (each SpecBranch variant with its own calibration tables)
weak_with_hold pooled-weak-foreign
#   b. the distilled draft with the app's settings for it, T=1 then T=0, seeds 0-2
distilled_seeds pooled-distilled

# 20. Every rejection teaches the rescue table (docs/RESULTS.md §0k): where the draft made no fork, the engine plays
#     the fork it could have made (parallel.missed_rescue). §19's runs again, distilled first, then the weak regime
#   a. the distilled draft with the app's settings for it, T=1 then T=0, seeds 0-2
distilled_seeds missed-distilled
#   b. the poorly aligned regime, seeds 0-2
weak_with_hold missed-weak-foreign
#   c. could a self-draft that skips some of the target's layers (untrained) be cheaper at a similar α? Its greedy
#      agreement with the full target, teacher-forced on the tuning prompts' greedy continuations
PYTHONPATH=. $PY docs/layer_skip_agreement.py docs/layer-skip.json
#   d. sampling by inverse CDF against torch.multinomial: the distilled draft at T=1, seed 0, alternated twice, each
#      side from a worktree at its commit (A: ce05604, multinomial; B: 1951f57, inverse CDF)
git worktree add -f /tmp/abA ce05604 && git worktree add -f /tmp/abB 1951f57
for r in 1 2; do
  for v in A B; do
    (cd /tmp/ab$v && PYTHONPATH=. "$(realpath "$OLDPWD/$PY")" -m engine bench --methods ar,pearl,specbranch \
        --draft embedded --dataset all --limit 2 --max-new-tokens 64 --temperature 1 --seed 0 --gamma 3 \
        --draft-stop 0.3 --head-start 0.3 --epsilon 0.5 --branches 3 --hold 0.5 --json "$OLDPWD/docs/sampler-$v-$r.json")
  done
done
#   e. the distilled draft at T=1 again, seeds 0-2, with the inverse-CDF sampler (at edebfc0)
distilled_seeds sampled-distilled 1

# 21. The regime the paper's branches are for: a draft right ~70-80 % of the time whose runners-up often hold the
#     target's token (docs/RESULTS.md §0l). The layer-skipping self-draft, without the 4 layers (3, 4, 5, 25) or the
#     2 (4, 5) whose loss §20c measured cheapest on the tuning prompts
#   a. exploratory, on the tuning prompts (one run each; the JSON is not committed): the 4-bit self-draft's settings,
#      then the distilled draft's with hold 0.5 and 0, head start 0 and 0.6, and the 2-layer skip
$PY -m engine bench --methods ar,pearl,specbranch --draft self-skip:3,4,5,25 --dataset data/tuning_prompts.jsonl \
    --max-new-tokens 64 --temperature 0 --gamma 6 --draft-stop 0 --head-start 0.02 --epsilon 0.3
for cfg in "3,4,5,25 0.5 0.3" "3,4,5,25 0 0.3" "4,5 0.5 0.3" "3,4,5,25 0.5 0" "3,4,5,25 0.5 0.6"; do
  set -- $cfg
  $PY -m engine bench --methods ar,pearl,specbranch --draft self-skip:$1 --dataset data/tuning_prompts.jsonl \
      --max-new-tokens 64 --temperature 0 --gamma 3 --draft-stop 0.3 --head-start $3 --epsilon 0.5 --hold $2
done
#   b. the benchmark split, seeds 0-2, hold 0.5: both drafts at T=0, then the 2-layer one at T=1
for skip in 3,4,5,25 4,5; do
  for s in 0 1 2; do
    skip_with_hold $skip 0 $s 0.5 skip${skip//,/-}-t0-s$s
  done
  $PY -m engine summarize docs/skip${skip//,/-}-t0-s{0,1,2}.json --json docs/skip${skip//,/-}-t0.json
done
for s in 0 1 2; do
  skip_with_hold 4,5 1 $s 0.5 skip4-5-t1-s$s
done
$PY -m engine summarize docs/skip4-5-t1-s{0,1,2}.json --json docs/skip4-5-t1.json

# 22. Where the wall time goes (docs/RESULTS.md §0m): the wall split of SD, PEARL and SpecBranch in one run each
#   a. the layer-skipping self-draft with the distilled draft's settings, and the 4-bit self-draft with its own
$PY -m engine bench --methods ar,sd,pearl,specbranch --draft self-skip:3,4,5,25 --dataset all --limit 2 \
    --max-new-tokens 64 --temperature 0 --seed 0 --gamma 3 --draft-stop 0.3 --head-start 0.3 --epsilon 0.5 \
    --branches 3 --hold 0.5 --json docs/wallsplit-skip3-4-5-25-t0.json
$PY -m engine bench --methods ar,sd,pearl,specbranch --draft self --dataset all --limit 2 --max-new-tokens 64 \
    --temperature 0 --seed 0 --gamma 6 --draft-stop 0 --head-start 0.02 --epsilon 0.1 --branches 3 --hold 0 \
    --json docs/wallsplit-self-t0.json
#   b. which phase of the parallel loop the target waits in: the head start, or the draft step in flight at a verdict
PYTHONPATH=. $PY docs/where_the_target_waits.py --draft self-skip:3,4,5,25 --json docs/waits-skip3-4-5-25.json
#   c. tried and dropped: fork where the draft would hold (docs/fork-at-hold.patch, on 57414b8), alternated with the
#      engine as it is, three pairs on the tuning prompts, from two worktrees
git worktree add -f /tmp/abH 57414b8 && git worktree add -f /tmp/abF 57414b8 && (cd /tmp/abF && git apply "$OLDPWD/docs/fork-at-hold.patch")
for r in 1 2 3; do
  for v in F H; do
    flag=$([[ $v == F ]] && echo --fork-at-hold || true)
    name=$([[ $v == F ]] && echo fork || echo hold)
    (cd /tmp/ab$v && PYTHONPATH=. "$(realpath "$OLDPWD/$PY")" -m engine bench --methods ar,pearl,specbranch \
        --draft self-skip:3,4,5,25 --dataset data/tuning_prompts.jsonl --limit 6 --max-new-tokens 64 --temperature 0 \
        --seed 0 --gamma 3 --draft-stop 0.3 --head-start 0.3 --epsilon 0.5 --branches 3 --hold 0.5 $flag \
        --json "$OLDPWD/docs/fork-at-hold-tune-$r-$name.json")
  done
done

# 23. Both cores for a draft step the target waits on (docs/RESULTS.md §0n): the 4-bit self-draft with its settings,
#     seeds 0-2, each with the default solo threads (2) and then --solo-threads 1; then the layer-skip draft, seed 0
SELF="--draft self --dataset all --limit 2 --max-new-tokens 64 --temperature 0 --gamma 6 --draft-stop 0 --head-start 0.02 --epsilon 0.1 --branches 3 --hold 0"
SKIP="--draft self-skip:3,4,5,25 --dataset all --limit 2 --max-new-tokens 64 --temperature 0 --gamma 3 --draft-stop 0.3 --head-start 0.3 --epsilon 0.5 --branches 3 --hold 0.5"
for s in 0 1 2; do
  $PY -m engine bench --methods ar,sd,pearl,specbranch $SELF --seed $s --json docs/solo-self-t0-s$s.json
  $PY -m engine bench --methods ar,sd,pearl,specbranch $SELF --seed $s --solo-threads 1 --json docs/solo1-self-t0-s$s.json
done
$PY -m engine summarize docs/solo-self-t0-s{0,1,2}.json --json docs/solo-self-t0.json
$PY -m engine summarize docs/solo1-self-t0-s{0,1,2}.json --json docs/solo1-self-t0.json
$PY -m engine bench --methods ar,sd,pearl,specbranch $SKIP --seed 0 --json docs/solo-skip-t0-s0.json
$PY -m engine bench --methods ar,sd,pearl,specbranch $SKIP --seed 0 --solo-threads 1 --json docs/solo1-skip-t0-s0.json
for s in 0 1 2; do
  $PY -m engine bench --methods ar,sd,pearl,specbranch ${SELF/--temperature 0/--temperature 1} --seed $s --json docs/solo-self-t1-s$s.json
done
$PY -m engine summarize docs/solo-self-t1-s{0,1,2}.json --json docs/solo-self-t1.json
#     and the engine's one-thread host loop for a caller whose thread runs 2 threads, before and after, alternated
PYTHONPATH=. $PY docs/host_thread_ab.py

# 24. SpecBranch's draft length reads the acceptance it measured (docs/RESULTS.md §0o): the 4-bit self-draft with its
#     settings, seeds 0-2 at T=1 and T=0; then an alternated A/B, seed 0, of a805781 (A) against e9ea3f3 (B)
for T in 1 0; do
  for s in 0 1 2; do
    $PY -m engine bench --methods ar,sd,pearl,specbranch,specbranch-no-branch ${SELF/--temperature 0/--temperature $T} \
        --seed $s --json docs/measured-self-t$T-s$s.json
  done
  $PY -m engine summarize docs/measured-self-t$T-s{0,1,2}.json --json docs/measured-self-t$T.json
done
git worktree add -f /tmp/abA a805781 && git worktree add -f /tmp/abB e9ea3f3
for T in 0 1; do
  for pair in "1 A B" "2 B A"; do
    set -- $pair; r=$1; shift
    for v in "$@"; do
      (cd /tmp/ab$v && PYTHONPATH=. "$(realpath "$OLDPWD/$PY")" -m engine bench --methods ar,pearl,specbranch \
          ${SELF/--temperature 0/--temperature $T} --seed 0 --json "$OLDPWD/docs/headstart-ab-t$T-$v-$r.json")
    done
  done
done
#   and the poorly aligned regime again (hold 0.5; the head start and feed stop read the measured acceptance)
weak_with_hold measured-weak-foreign

# 25. γ for the 4-bit self-draft now that SpecBranch's head start leads whole blocks (docs/RESULTS.md §0o): on the
#     tuning prompts, γ 6, 8 and 10 at T=1 and T=0 (one run each; the γ 6 runs have no sd row), then the benchmark
#     split with γ 8, seeds 0-4 at T=1 (3 and 4 were run after the others) and 0-2 at T=0
TUNE="--draft self --dataset data/tuning_prompts.jsonl --limit 6 --max-new-tokens 64 --draft-stop 0 --head-start 0.02 --epsilon 0.1 --branches 3 --hold 0 --seed 0"
for T in 1 0; do
  $PY -m engine bench --methods ar,pearl,specbranch $TUNE --gamma 6 --temperature $T --json docs/tune-gamma-self-t$T-g6.json
  for G in 8 10; do
    $PY -m engine bench --methods ar,sd,pearl,specbranch $TUNE --gamma $G --temperature $T --json docs/tune-gamma-self-t$T-g$G.json
  done
done
for T in 1 0; do
  seeds=$([[ $T == 1 ]] && echo "0 1 2 3 4" || echo "0 1 2")
  for s in $seeds; do
    $PY -m engine bench --methods ar,sd,pearl,specbranch,specbranch-no-branch ${SELF/--gamma 6/--gamma 8} \
        --temperature $T --seed $s --json docs/gamma8-self-t$T-s$s.json
  done
  $PY -m engine summarize $(for s in $seeds; do echo docs/gamma8-self-t$T-s$s.json; done) --json docs/gamma8-self-t$T.json
done

# 26. A draft that holds again after a hold follows the target: no head start before the pass (docs/RESULTS.md §0p).
#     A: worktree at d667e96 (before), B: at b846f28 (after), both in /tmp/ab$v
#   a. the tuning prompts, the distilled draft's settings, T=0, seed 0: A then B, then B then A (self-skip once)
TUNEH="--methods ar,pearl,specbranch --dataset data/tuning_prompts.jsonl --max-new-tokens 64 --temperature 0 --seed 0 --gamma 3 --draft-stop 0.3 --head-start 0.3 --epsilon 0.5 --branches 3 --hold 0.5"
for d in embedded-weak embedded self-skip:3,4,5,25; do
  pairs=$([[ $d == self-skip* ]] && echo "1:A:B" || echo "1:A:B 2:B:A")
  for pair in $pairs; do
    IFS=: read -r r first second <<< "$pair"
    for v in $first $second; do
      (cd /tmp/ab$v && PYTHONPATH=. "$(realpath "$OLDPWD/$PY")" -m engine bench $TUNEH --draft $d \
          --json "$OLDPWD/docs/follow-tune-$(echo $d | tr ':,' '__')-$v-$r.json")
    done
  done
done
#   b. the poorly aligned regime on B, seeds 0-2
weak_with_hold follow-weak-foreign
#   c. the distilled draft with the app's settings on the benchmark split, seed 0, A/B alternated, T=0 then T=1
for t in 0 1; do
  for pair in "1:A:B" "2:B:A"; do
    IFS=: read -r r first second <<< "$pair"
    for v in $first $second; do
      (cd /tmp/ab$v && PYTHONPATH=. "$(realpath "$OLDPWD/$PY")" -m engine bench --methods ar,pearl,specbranch \
          --draft embedded --dataset all --limit 2 --max-new-tokens 64 --temperature $t --seed 0 --gamma 3 \
          --draft-stop 0.3 --head-start 0.3 --epsilon 0.5 --branches 3 --hold 0.5 \
          --json "$OLDPWD/docs/follow-distilled-t$t-$v-$r.json")
    done
  done
done

# 27. The hold on a fork's branches, --hold-branches (docs/RESULTS.md §0q). Measured as A: worktree at a12eedb, B: at
#     41afda6 (the rule with no flag), both in /tmp/ab$v; at 9d3c5dc or later the same A/B is one tree, the bench
#     without (A) and with (B) --hold-branches.
#   a. the tuning prompts (and the foreign tuning prompts), the distilled draft's settings, seed 0: pairs A/B then B/A
HB_TUNE="--methods ar,pearl,specbranch --max-new-tokens 64 --seed 0 --gamma 3 --draft-stop 0.3 --head-start 0.3 --epsilon 0.5 --branches 3 --hold 0.5"
hb_tune() {  # name draft dataset temperature pairs
  local name=$1 d=$2 data=$3 t=$4 pairs=$5
  for pair in $pairs; do
    IFS=: read -r r first second <<< "$pair"
    for v in $first $second; do
      (cd /tmp/ab$v && PYTHONPATH=. "$(realpath "$OLDPWD/$PY")" -m engine bench $HB_TUNE --draft $d \
          --dataset "$OLDPWD/$data" --temperature $t --json "$OLDPWD/docs/holdbranches-tune-$name-$v-$r.json")
    done
  done
}
hb_tune weak-foreign embedded-weak data/foreign_tuning_prompts.jsonl 0 "1:A:B 2:B:A"
hb_tune weak embedded-weak data/tuning_prompts.jsonl 0 "1:A:B"
hb_tune distilled-t0 embedded data/tuning_prompts.jsonl 0 "1:A:B 2:B:A 3:B:A 4:A:B"
hb_tune distilled-t1 embedded data/tuning_prompts.jsonl 1 "1:A:B 2:B:A"
hb_tune self-skip self-skip:3,4,5,25 data/tuning_prompts.jsonl 0 "1:A:B 2:B:A"
#   b. the poorly aligned regime with --hold-branches, seeds 0-2 (at 9d3c5dc)
weak_with_hold holdbranches-weak-foreign --hold-branches

# 28. The target's static-cache forward, engine/static_forward.py (docs/RESULTS.md §0r). From a worktree at b369a1c
#     (/tmp/sfA; the JSON's --json names a scratch folder, copied to docs/static-ab-*.json)
#   a. A/B on the tuning prompts, T=0, seed 0: --target-forward static and transformers alternated, order flipped
SELFT="--methods ar,sd,pearl,specbranch --draft self --dataset data/tuning_prompts.jsonl --max-new-tokens 64 --temperature 0 --seed 0 --gamma 8 --draft-stop 0 --head-start 0.02 --epsilon 0.1 --branches 3 --hold 0"
DIST="--methods ar,sd,pearl,specbranch --draft embedded --dataset data/tuning_prompts.jsonl --max-new-tokens 64 --temperature 0 --seed 0 --gamma 3 --draft-stop 0.3 --head-start 0.3 --epsilon 0.5 --branches 3 --hold 0.5"
for name in self dist; do
  settings=$([[ $name == self ]] && echo "$SELFT" || echo "$DIST")
  for p in "1 static transformers" "2 transformers static"; do
    set -- $p; r=$1; shift
    for f in "$@"; do
      $PY -m engine bench $settings --target-forward $f --json docs/static-ab-$name-$f-$r.json
    done
  done
done
#   b. the benchmark split with the app's draft and settings (as §25's γ 8 runs), seeds 0-2 at T=0 and T=1 (at f59c80c)
for T in 0 1; do
  for s in 0 1 2; do
    $PY -m engine bench --methods ar,sd,pearl,specbranch,specbranch-no-branch ${SELF/--gamma 6/--gamma 8} \
        --temperature $T --seed $s --json docs/static-self-t$T-s$s.json
  done
  $PY -m engine summarize $(for s in 0 1 2; do echo docs/static-self-t$T-s$s.json; done) --json docs/static-self-t$T.json
done
#   c. tried and dropped: half the hold for branch steps (docs/branch-hold-scale.patch applied to a worktree at f9e147e
#      in /tmp/hbx; A: no flag, C: --hold-branches with SB_BHS=0.5)
HB="--methods ar,pearl,specbranch --max-new-tokens 64 --seed 0 --gamma 3 --draft-stop 0.3 --head-start 0.3 --epsilon 0.5 --branches 3 --hold 0.5"
for p in 1:A:C 2:C:A 3:C:A 4:A:C; do
  IFS=: read -r r x y <<< "$p"
  for v in $x $y; do
    extra=$([[ $v == C ]] && echo "--hold-branches" || true)
    (cd /tmp/hbx && SB_BHS=0.5 PYTHONPATH=. "$(realpath "$OLDPWD/$PY")" -m engine bench $HB --draft embedded \
        --dataset data/tuning_prompts.jsonl --temperature 0 $extra --json "$OLDPWD/docs/branchhold-scale-dist-t0-$v-$r.json")
  done
done
for r in 1 2; do
  (cd /tmp/hbx && SB_BHS=0.5 PYTHONPATH=. "$(realpath "$OLDPWD/$PY")" -m engine bench $HB --draft embedded-weak \
      --dataset data/foreign_tuning_prompts.jsonl --temperature 0 --hold-branches \
      --json "$OLDPWD/docs/branchhold-scale-weakf-C-$r.json")
done
#   d. a target step beside a draft in a thread and in another process (exploratory; prints a table)
PYTHONPATH=. $PY docs/beside_the_draft.py
#   e. the same with the draft asked over a pipe, step by step, as an engine would (exploratory)
for d in self embedded; do PYTHONPATH=. $PY docs/draft_in_a_process.py $d; done
#   f. hf-assisted against the faster ar, the app's draft and settings, seed 0, T=0
$PY -m engine bench --methods ar,specbranch,hf-assisted ${SELF/--gamma 6/--gamma 8} --seed 0 --json docs/static-hf-assisted-t0.json

# 29. The draft in a process of its own, engine/draft_process.py (docs/RESULTS.md §0s), at 1df17a7 (the JSON's
#     --json names a scratch folder, copied to docs/worker-*.json)
#   a. the benchmark split with the app's draft and settings, seeds 0-2 at T=0 and T=1, --draft-worker process and
#      thread alternated (the order flipped each seed); then the distilled draft's settings on the tuning prompts
SELF8="--draft self --dataset all --limit 2 --max-new-tokens 64 --gamma 8 --draft-stop 0 --head-start 0.02 --epsilon 0.1 --branches 3 --hold 0"
for T in 0 1; do
  for p in "0 process thread" "1 thread process" "2 process thread"; do
    set -- $p; s=$1; shift
    for w in "$@"; do
      $PY -m engine bench --methods ar,sd,pearl,specbranch $SELF8 --temperature $T --seed $s --draft-worker $w \
          --json docs/worker-$w-t$T-s$s.json
    done
  done
  for w in process thread; do
    $PY -m engine summarize $(for s in 0 1 2; do echo docs/worker-$w-t$T-s$s.json; done) --json docs/worker-$w-t$T.json
  done
done
for w in process thread; do
  $PY -m engine bench $DIST --draft-worker $w --json docs/worker-dist-$w-1.json  # §28a's distilled settings
done
#   b. the A/B on the tuning prompts with the self-draft's settings (§28a's SELFT), two alternated pairs, just before
#      1df17a7, and the recheck at 0fc4aab (process only)
for p in "1 process thread" "2 thread process"; do
  set -- $p; r=$1; shift
  for w in "$@"; do $PY -m engine bench $SELFT --draft-worker $w --json docs/worker-tuning-$w-$r.json; done
done
$PY -m engine bench $SELFT --draft-worker process --json docs/worker-recheck-process.json

# 30. Rechecks at 67e49a4 and the measured-cost branch policy that values a rescue at what it saves (docs/RESULTS.md
#     §0t). The reruns ran from a worktree at 67e49a4 (the JSON's command shows /tmp/abA), the A/B of the cost model
#     from that worktree (old) and this commit's tree (new); the JSON's --json names a scratch folder
#   a. every method and ablation with the app's draft and settings, seeds 0-2 at T=0 and T=1 (docs/ablation-0t-*.json)
STEPS="1" DRAFT=self V=-0t EXTRA="--gamma 8 --draft-stop 0 --head-start 0.02 --epsilon 0.1 --hold 0" \
    bash docs/run_ablation.sh
#   b. the poorly aligned regime, benchmark split, with and without --hold-branches, alternated by seed
WEAK="--methods ar,pearl,specbranch --draft embedded-weak --dataset data/foreign_prompts.jsonl --max-new-tokens 64 --temperature 0 --gamma 3 --draft-stop 0.3 --epsilon 0.5 --branches 3 --head-start 0.3 --hold 0.5"
for p in "0 off on" "1 on off" "2 off on"; do
  set -- $p; s=$1; shift
  for v in "$@"; do
    $PY -m engine bench $WEAK --seed $s $([[ $v == on ]] && echo --hold-branches) \
        --json docs/holdbranches-recheck-$v-s$s.json
  done
done
#   c. the layer-skipping self-draft on the tuning prompts, hold 0.5 with and without --hold-branches, hold 0, then
#      --draft-worker thread, specbranch-no-branch, --branches 2 and the measured-cost policy (one run each)
SKIP="--methods ar,pearl,specbranch --draft self-skip:3,4,5,25 --dataset data/tuning_prompts.jsonl --max-new-tokens 64 --temperature 0 --seed 0 --gamma 3 --draft-stop 0.3 --head-start 0.3 --epsilon 0.5 --branches 3"
for r in 1 2; do
  $PY -m engine bench $SKIP --hold 0.5 --hold-branches --json docs/skip-0t-holdbranches-$r.json
  $PY -m engine bench $SKIP --hold 0 --json docs/skip-0t-hold0-$r.json
  $PY -m engine bench $SKIP --hold 0.5 --json docs/skip-0t-hold05-$r.json
done
$PY -m engine bench $SKIP --hold 0 --draft-worker thread --json docs/skip-0t-thread.json
$PY -m engine bench ${SKIP/specbranch/specbranch-no-branch} --hold 0 --json docs/skip-0t-nobranch.json
$PY -m engine bench $SKIP --hold 0 --branches 2 --json docs/skip-0t-k2.json
$PY -m engine costs --draft self-skip:3,4,5,25 --draft-worker thread --max-rows 3 --max-tokens 1 --reps 30
$PY -m engine costs --draft self-skip:3,4,5,25 --draft-worker process --max-rows 3 --max-tokens 1 --reps 30
#   d. the cost model, old (the worktree at 67e49a4) against new, alternated twice, then the weak draft with it; the
#      new model's cost measurement changed twice during the session, so each version has its own JSON: "new" and
#      "rounds" (3 rounds of 5, medians), "interleaved" (the row counts in turn), "final" (and the slowdown clamped)
for p in "1 old new" "2 new old"; do
  set -- $p; r=$1; shift
  for v in "$@"; do
    $PY -m engine bench $SKIP --hold 0 --branch-costs --json docs/branchcosts-skip-$v-$r.json  # old: from the worktree
  done
done
$PY -m engine bench $WEAK --seed 0 --branch-costs --json docs/branchcosts-weak-rounds.json
for r in 3 4; do $PY -m engine bench $SKIP --hold 0 --branch-costs --json docs/branchcosts-skip-interleaved-$r.json; done
$PY -m engine bench $WEAK --seed 0 --branch-costs --json docs/branchcosts-weak-interleaved.json
for r in 5 6; do $PY -m engine bench $SKIP --hold 0 --branch-costs --json docs/branchcosts-skip-final-$r.json; done
$PY -m engine bench $WEAK --seed 0 --branch-costs --json docs/branchcosts-weak-final.json
# 31. A fork that shares the draft's cache (docs/RESULTS.md §0u): before (a worktree at 1ce968e, A) and after (B),
#     the layer-skipping self-draft on the tuning prompts, A B B A; then the k-row step, after and before
SKIP0="--methods ar,pearl,specbranch --draft self-skip:3,4,5,25 --dataset data/tuning_prompts.jsonl --max-new-tokens 64 --temperature 0 --seed 0 --gamma 3 --draft-stop 0.3 --head-start 0.3 --epsilon 0.5 --branches 3 --hold 0"
for v in A-0 B-0 B-1 A-1; do
  $PY -m engine bench $SKIP0 --json docs/branchkv-skip-$v.json  # A: from the worktree
done
for v in B A; do
  $PY -m engine costs --draft self-skip:3,4,5,25 --draft-worker thread --max-rows 3 --max-tokens 1 --reps 30 \
      --json docs/branchkv-costs-$v-self-skip.json
  $PY -m engine costs --draft self --draft-worker thread --max-rows 3 --max-tokens 1 --reps 30 \
      --json docs/branchkv-costs-$v-self.json
done
#     and the poorly aligned regime after the change, with --hold-branches (WEAK: §30 b)
$PY -m engine bench $WEAK --seed 0 --hold-branches --json docs/branchkv-weak-foreign-holdbranches-s0.json
#     and two branches against three after the change, alternated (SKIP0's own --branches 3 comes first: argparse
#     keeps the flag given last)
for v in 2-0 3-0 3-1 2-1; do
  $PY -m engine bench $SKIP0 --branches ${v%%-*} --json docs/branchkv-skip-k$v.json
done

# 32. The draft's one-token steps through torch.compile (docs/RESULTS.md §0v): the 4-bit self-draft with the app's
#     settings on the tuning prompts, eager (lean) and compiled (lean-compiled), alternated; the first compiled run
#     started with a cold inductor cache on disk, the second with a warm one; then the step alone
SELFT="--methods ar,sd,pearl,specbranch --draft self --dataset data/tuning_prompts.jsonl --max-new-tokens 64 --temperature 0 --seed 0 --gamma 8 --draft-stop 0 --head-start 0.02 --epsilon 0.1 --branches 3 --hold 0"
for v in lean-0 lean-compiled-0 lean-compiled-1 lean-1; do
  $PY -m engine bench $SELFT --draft-forward ${v%-*} --json docs/compiled-self-$v.json
done
for f in lean lean-compiled; do
  $PY -m engine costs --draft self --draft-forward $f --draft-worker thread --max-rows 3 --max-tokens 1 --reps 30 \
      --json docs/compiled-costs-$f.json
done
#     and the benchmark split at T=0 and T=1, in this order (a second T=1 pair after the first)
APP="--methods ar,sd,pearl,specbranch --draft self --dataset all --limit 2 --max-new-tokens 64 --seed 0 --gamma 8 --draft-stop 0 --head-start 0.02 --epsilon 0.1 --branches 3 --hold 0"
for v in lean-compiled-t0 lean-t0 lean-t1 lean-compiled-t1; do
  $PY -m engine bench $APP --temperature ${v##*-t} --draft-forward ${v%-t*} --json docs/compiled-split-$v.json
done
for v in lean lean-compiled; do
  $PY -m engine bench $APP --temperature 1 --draft-forward $v --json docs/compiled-split-$v-t1-1.json
done

# 33. The app compiles its draft's step in a second process (docs/RESULTS.md §0w): the app's path on the tuning
#     prompts, before, while and after, with a fresh inductor cache (cold); then §32's bench once more after the
#     recompile fixes, compiled then eager
PYTHONPATH=. $PY docs/background_compile.py --json docs/background-compile-cold.json
for v in lean-compiled-0 lean-0; do
  $PY -m engine bench $SELFT --draft-forward ${v%-*} --json docs/compiled-fixed-self-$v.json
done

# 34. Every method and ablation with the app's pair as it ships (docs/RESULTS.md §0x): the 4-bit self-draft, compiled,
#     with the app's settings, benchmark split, seeds 0-2, T=0 and T=1; then the compile at the lowest priority, the
#     app's path as in §33 with a fresh inductor cache each run: B (this change, committed as d3bdea1), A (before it,
#     a checkout of 790b856), B; the JSON was first written to /tmp/nice-$v.json and copied here
STEPS="1" DRAFT=self V=-0x EXTRA="--gamma 8 --draft-stop 0 --head-start 0.02 --epsilon 0.1 --hold 0 --draft-forward lean-compiled" \
    bash docs/run_ablation.sh
for v in B-0 A-0 B-1; do
  PYTHONPATH=. $PY docs/background_compile.py --json docs/lowprio-compile-$v.json  # A: from the checkout of 790b856
done
#     and the head start tried at 0 for the app's draft: the tuning prompts at T=1 (seeds 0-2) and T=0 (alternated),
#     then the benchmark split at T=1 with 0; first written to /tmp and copied here
HS="--methods ar,pearl,specbranch --draft self --max-new-tokens 64 --gamma 8 --draft-stop 0 --epsilon 0.1 --branches 3 --hold 0 --draft-forward lean-compiled"
for s in 0 1 2; do
  for h in 0.02 0; do
    $PY -m engine bench $HS --dataset data/tuning_prompts.jsonl --temperature 1 --seed $s --head-start $h \
        --json docs/headstart-tuning-t1-hs$h-s$s.json
  done
done
for v in 0.02-a 0-a 0-b 0.02-b; do
  $PY -m engine bench $HS --dataset data/tuning_prompts.jsonl --temperature 0 --seed 0 --head-start ${v%-*} \
      --json docs/headstart-tuning-t0-hs$v.json
done
for s in 0 1 2; do
  $PY -m engine bench $HS --dataset all --limit 2 --temperature 1 --seed $s --head-start 0 \
      --json docs/headstart0-split-t1-s$s.json
done
# 35. Sampled draft steps taken ahead (docs/RESULTS.md §0y): A = 3c2798b (before), B = a26338f (this change), each
#     from a worktree of its own (git worktree add /tmp/wtA 3c2798b; /tmp/wtB a26338f), alternated B A A B B A at T=1
#     and B A A B at T=0; the JSON was first written to /tmp/sa-$v-t$T-s$s.json and copied to
#     docs/sampled-ahead-$v-t$T-s$s.json
SA="--methods ar,sd,pearl,specbranch --draft self --max-new-tokens 64 --gamma 8 --draft-stop 0 --head-start 0.02 --epsilon 0.1 --branches 3 --hold 0 --draft-forward lean-compiled --dataset all --limit 2"
for run in "1 0 B" "1 0 A" "1 1 A" "1 1 B" "1 2 B" "1 2 A" "0 0 B" "0 0 A" "0 1 A" "0 1 B"; do
  set -- $run
  (cd /tmp/wt$3 && PYTHONPATH=. "$(realpath "$OLDPWD/$PY")" -m engine bench $SA --temperature $1 --seed $2 \
      --json "$OLDPWD/docs/sampled-ahead-$3-t$1-s$2.json")
done
# 36. Which model sets the pace, and the limit with no drafted token wasted (docs/RESULTS.md §0z): the ablation with
#     the app's pair as it ships, twice: at 6fc0f4d's engine (V=-0y, its draft spans timed by the engine's call) and
#     with the child's spans timed where it computed (V=-0z, 47acc8c); then each seed's model, from its JSON alone
for v in -0y -0z; do
  STEPS="1" DRAFT=self V=$v EXTRA="--gamma 8 --draft-stop 0 --head-start 0.02 --epsilon 0.1 --hold 0 --draft-forward lean-compiled" \
      bash docs/run_ablation.sh
done
for f in docs/ablation-0z-t{0,1}-s{0,1,2}.json; do
  $PY -m engine costs --bench $f --model-only --json ${f%.json}-model.json
done
#     and γ 8 / 16 / 12 on the tuning prompts at T=0 (seed 0; one run each, from a worktree at 6651f56, whose engine is
#     6fc0f4d's; the JSON was first written to /tmp/sweep/g$g-t0.json and copied to docs/gamma-0z-g$g-t0.json)
G0="--methods ar,pearl,specbranch --draft self --max-new-tokens 64 --draft-stop 0 --head-start 0.02 --epsilon 0.1 --branches 3 --hold 0 --draft-forward lean-compiled --dataset data/tuning_prompts.jsonl"
for g in 8 16 12; do
  $PY -m engine bench $G0 --gamma $g --temperature 0 --seed 0 --json docs/gamma-0z-g$g-t0.json
done
