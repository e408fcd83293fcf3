"""The "How to read this" tab: SD, PEARL and SpecBranch in plain words, and how to read each chart."""

from __future__ import annotations

import html

import gradio as gr

from ..regime import load_map, regime_figure, regime_table

TEACHING = """
### How to read this
**Speculative decoding (SD).** A small *draft* model guesses the next few tokens; the big *target* model
checks all of them in one forward pass. A guess x is kept with probability min(1, p(x)/q(x)) (p: target,
q: draft). At the first rejected guess the target supplies a *correction*; if all pass, it adds a *bonus*
token. The output has exactly the target's distribution (at temperature 0: exactly its greedy text).
In plain SD the two models take turns, so each waits while the other works: the red *bubbles* in the timeline.

**PEARL.** The draft keeps drafting the next block *while* the target verifies the current one, so the
bubbles shrink. But a rejection throws away everything drafted after it (the ↶ markers: click one to see).
Right after a rejection nothing drafted is left to verify, so the target's next pass can return one token
only. The *head start* slider lets the draft lead that pass by a few tokens while it is sure enough: a short
bubble on the target's lane in exchange for a longer block (0 = PEARL as published).

**SpecBranch.** Where a rejection is likely (the draft is unsure, or the H-RAD classifier reading the
target's hidden state says so), the draft forks *k branches* from its top candidates and drafts them
all at once. The target verifies along the draft's first choice, through the branch point, so a fork
never shortens a round; if the target's token is another candidate instead, that branch's tokens are
already drafted and survive (purple *rescued* tokens); only the other branches are rolled back.
"Unsure" is measured, not assumed: the engine counts how often the target accepted tokens the draft drafted at
each confidence (each method keeps its own counts, for as long as the app runs), and forks where that rate is
below ε. A draft that is right even when unsure (the app's 4-bit draft) then stops forking after its first few
rounds; the paper's rule, which trusts the confidence as is, is `--no-calibrate` on the CLI.
The same counts set how far the draft leads the target (the head start): sampled, a near-copy of the target is
accepted even where it drew a token it gave little mass, so SpecBranch leads whole blocks where PEARL, which reads
each drawn token's probability, starts the target's pass early (docs/methods.md).
The *hold* slider makes SpecBranch rollback-aware: where the odds that what it would draft is accepted (those of
the tokens still pending times its own, or a fork's, as measured) fall below the hold, the draft drafts nothing,
and the target takes that token itself, as in plain decoding. The step's caption says "the draft held back". With
a draft that is often wrong, this is what keeps the rollback markers rare. *Hold the branches too* (on by default
for `embedded-weak` and `self-skip:...`, off for the distilled draft) also stops a fork's branches where one more
token would take their odds below the hold; the step's caption then says "the branches held back"
(docs/results/README.md
docs/methods.md). A fork's odds are counted the same way:
wherever the target rejects the draft's token, fork or not, the engine plays the fork the draft could have made
there and counts whether it would have rescued that position. Where, in this run, the draft has more often held
back again than drafted right after a hold, the target's next pass starts at once: on the timeline the draft's next
step runs beside that pass instead of before it, and the step's caption says the pass did not wait on a draft step
(docs/methods.md).

**Which draft.** On a CPU the app drafts with the target itself, its weights read in 4 bits (the GGUF file they came
from stores them so; docs/models.md). A draft step then costs about a third of a target step, and the
draft agrees with the target on over 99 % of tokens, so speculation pays, but there is little to reject, roll back
or branch. To watch those, pick another draft in the Draft menu: `embedded` (a distilled 6-layer draft, right about
half the time, read in 4 bits about 10 times cheaper than the target: the paper's regime, and the *Watch branches
rescue* scenario, where a fork that rescues a rejection keeps its branch's tokens for the next pass) or
`embedded-weak`. `self-skip:3,4,5,25` (the target without 4 of its 30 layers, right about 70 % of the time) forks
often too, and about a quarter of its forks rescue.
The regime map below shows, for every draft, where speculation and branches pay. A draft loads on first use
(seconds), and picking one sets the sliders to the settings the bench chose for its kind.

**The charts.** *Branch tree*: one step, left to right: the committed prefix, the drafted path, the fork
with its k candidates and each branch. Green accepted, purple rescued, red rejected, orange the target's
correction, blue its bonus, dashed never verified; the orange outline follows what survives the step.
Hover a node for p, q, p/q and u. Pick a step with ◀ ▶, the slider, or a marker under the timeline.
*Timeline*: measured forward passes of each model; overlap means both computed at once. The metric panel's *wall
split* divides the run's time four ways: both models compute, the target alone, the draft alone (the target waits
on it) and neither. On this 2-core CPU two models computing at once share the memory bus, so each forward runs
slower beside the other: in one bench run a target pass cost 66 ms in SD and 87 ms in PEARL (docs/metrics.md).
*Per-position acceptance*: how often the i-th draft token survives given the ones before it did.
*Race* (Compare, Replay): the runs, recorded one after another, replayed side by side on one clock.
"""


REGIME = """
### Which draft, which method: the regime map
Each marker is one method with one draft, from one bench run on the benchmark prompts: its speed against `ar` at the
draft's acceptance α. Each faint line is the same method's limit if only the two models' forward passes took time,
with that run's forward costs and every drafted token accepted with probability α (docs/results/README.md, "The
regime map"). c is how many of the draft's steps one target step costs. A draft that is cheap (large c) but often
wrong is where the target sets the pace and a fork that rescues a rejection keeps work that PEARL throws away: there
SpecBranch's markers can stand above PEARL's. A draft that is right almost always leaves nothing to rescue, and with a
small c the draft sets the pace, so no branch policy can add much.
"""


class HowToReadTab:
    def __init__(self, ctx=None):
        self.ctx = ctx

    def create_ui(self) -> None:
        with gr.Tab("How to read this"):
            gr.Markdown(TEACHING)
            gr.Markdown(REGIME)
            data, why = load_map()
            if data is None:
                gr.Markdown(html.escape(why), elem_id="regime-missing")
                return
            gr.Plot(regime_figure(data), elem_id="regime-map", label="Regime map")
            when = f" Measured {html.escape(data['when'])}." if data["when"] else ""
            gr.Markdown(regime_table(data) + "\n\n" + when, elem_id="regime-table")

    def create_event_handlers(self) -> None:
        """Nothing to wire: the tab is text."""
