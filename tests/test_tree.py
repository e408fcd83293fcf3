"""The branch tree (app/tree.py) on constructed event lists: verdicts, the survivor, hover numbers, a layout
whose label boxes never overlap, and escaping. No model is needed."""

from __future__ import annotations

import html
import itertools
import re

from app.tree import (
    CELL_PX,
    PAD_X,
    boxes_overlap,
    build_tree,
    cells,
    layout,
    step_caption,
    tree_html,
    tree_svg,
    visible,
)
from engine.events import BranchResolved, DraftProposed, Rollback, StepStarted, TimingSpan, TokensEmitted, Verified

START = 10  # committed tokens when the step begins


def verdicts(root) -> list[tuple[str, str, bool]]:
    return [(n.text, n.verdict, n.survivor) for n in root.walk()]


def node_count(svg: str) -> int:
    return len(re.findall(r'<g class="node ', svg))


def linear_rejection():
    return [
        StepStarted(1, START, 0.0),
        DraftProposed(1, [1, 2, 3, 4], ["a", "b", "c", "d"], [0.9, 0.8, 0.7, 0.6], parent_position=START),
        Verified(
            1,
            4,
            2,
            [0.95, 0.5, 0.1],
            [0.9, 0.8, 0.7],
            [0.2, 0.4, 0.9],
            9,
            "correction",
            0.6,
            tokens=[1, 2, 3, 4],
            pieces=["a", "b", "c", "d"],
        ),
        Rollback(1, "draft", [3, 4], ["c", "d"], "rejected"),
        TokensEmitted(1, [1, 2, 9], ["a", "b", "X"], ["accepted", "accepted", "correction"], "abX"),
    ]


def fork(survivor: int, rescued: bool, tried: int):
    """A verified path of one token, then a fork of 3 candidates, each with a branch of 2 tokens."""
    branches = [[20 + b, 30 + b] for b in range(3)]
    pieces = [[f"x{b}", f"y{b}"] for b in range(3)]
    token = [11, 12, 13][survivor] if survivor >= 0 else 99
    losers = [t for b in range(3) if b != survivor for t in [11 + b, *branches[b]]]
    kinds = ["accepted", ("rescued" if rescued else "accepted") if survivor >= 0 else "correction"]
    return [
        StepStarted(2, START, 0.0),
        DraftProposed(
            2, [11, 12, 13], ["c1", "c2", "c3"], [0.5, 0.3, 0.1], parent_position=START + 1, kind="candidates"
        ),
        *[
            DraftProposed(
                2, [branches[b][j]], [pieces[b][j]], [0.7], branch=b + 1, parent_position=START + 2 + j, kind="branch"
            )
            for j in range(2)
            for b in range(3)
        ],
        Verified(2, 1, 1, [0.9], [0.8], [0.1], -1, "", 0.0, tokens=[5], pieces=["p"]),
        BranchResolved(
            2,
            START + 1,
            [11, 12, 13],
            ["c1", "c2", "c3"],
            [0.5, 0.3, 0.1],
            [0.2, 0.6, 0.1],
            [0.9, 0.3, 0.95][:tried],
            "without_replacement",
            branches,
            pieces,
            survivor,
            token,
            rescued,
        ),
        Rollback(2, "draft", losers, ["?"] * len(losers), "losing branches"),
        TokensEmitted(2, [5, token], ["p", "Z" if survivor < 0 else f"c{survivor + 1}"], kinds, ""),
    ]


def test_a_linear_rejection():
    root = build_tree(linear_rejection(), "the prefix")
    assert verdicts(root) == [
        ("the prefix", "prefix", True),
        ("a", "accepted", True),
        ("b", "accepted", True),
        ("c", "rejected", False),
        ("d", "unverified", False),
        ("X", "correction", True),
    ]
    svg = tree_svg(linear_rejection(), "the prefix")
    assert node_count(svg) == 6
    assert svg.count('class="node v-accepted survivor"') == 2 and svg.count("v-rejected") == 1
    # hover numbers where the events carry them: p, q, p/q and u for verified tokens
    assert "p=0.950 q=0.900 p/q=1.056 u=0.200" in svg and "p=0.100 q=0.700 p/q=0.143 u=0.900" in svg
    assert "drawn with probability 0.600" in svg
    assert svg.count('class="edge survivor"') == 3  # prefix → a → b → X, highlighted end to end


def test_a_fork_of_three_where_candidate_two_wins():
    root = build_tree(fork(survivor=1, rescued=True, tried=2))
    got = verdicts(root)
    assert got[:2] == [("", "prefix", True), ("p", "accepted", True)]
    by_text = {text: (verdict, survivor) for text, verdict, survivor in got}
    assert by_text["c1"] == ("rejected", False)
    assert by_text["c2"] == ("rescued", True)  # survived, and it was not the draft's first choice
    assert by_text["c3"] == ("unverified", False)  # never tried: an earlier candidate survived
    assert by_text["x1"] == by_text["y1"] == ("unverified", True)  # the surviving branch: next step's path
    assert by_text["x0"] == by_text["y2"] == ("unverified", False)
    survivors = [text for text, _, survivor in got if survivor]
    assert survivors == ["", "p", "c2", "x1", "y1"]
    svg = tree_svg(fork(survivor=1, rescued=True, tried=2))
    assert node_count(svg) == 2 + 3 * 3
    assert svg.count('class="edge survivor"') == 4
    assert "candidate 2 of 3 (without_replacement): survived" in svg and "p=0.600 q=0.300 p/q=2.000 u=0.300" in svg
    assert "+" not in "".join(text for text, _, _ in got)  # every rolled-back token is placed: no summary node


def test_the_first_branch_verified_in_the_same_step():
    """Candidate 1 survives and its branch was fed to the target too: x0 accepted, y0 rejected, then the
    target's correction after x0, all in this step."""
    events = fork(survivor=0, rescued=False, tried=1)
    events.insert(
        -2,
        Verified(
            2,
            2,
            1,
            [0.9, 0.05],
            [0.7, 0.7],
            [0.3, 0.8],
            77,
            "correction",
            0.4,
            branch=1,
            tokens=[20, 30],
            pieces=["x0", "y0"],
        ),
    )
    events[-1] = TokensEmitted(
        2, [5, 11, 20, 77], ["p", "c1", "x0", "W"], ["accepted", "accepted", "accepted", "correction"], ""
    )
    got = verdicts(build_tree(events))
    by_text = {text: (verdict, survivor) for text, verdict, survivor in got}
    assert by_text["c1"] == ("accepted", True)
    assert by_text["x0"] == ("accepted", True) and by_text["y0"] == ("rejected", False)
    assert by_text["W"] == ("correction", True)
    assert [text for text, _, survivor in got if survivor] == ["", "p", "c1", "x0", "W"]
    svg = tree_svg(events)
    assert "its branch, verified in this step along with the path" in svg
    assert "p=0.050 q=0.700 p/q=0.071 u=0.800" in svg


def test_a_fork_where_every_candidate_loses():
    root = build_tree(fork(survivor=-1, rescued=False, tried=3))
    path = root.children[0]
    assert [(c.text, c.verdict, c.survivor) for c in path.children] == [
        ("c1", "rejected", False),
        ("c2", "rejected", False),
        ("c3", "rejected", False),
        ("Z", "correction", True),
    ]
    assert all(not n.survivor for c in path.children[:3] for n in c.walk())


def test_depth_16_by_k_6_labels_never_overlap_or_clip():
    words = ["a", " the", "\n\n", "переменная", "東京タワー", "🙂🙂", "x" * 40, "\t", "<img>", "ok"]
    path = [words[i % len(words)] for i in range(10)]
    k, depth = 6, 5
    branches = [[words[(b + j) % len(words)] for j in range(depth)] for b in range(k)]
    events = [
        StepStarted(3, START, 0.0),
        Verified(3, 10, 10, [0.9] * 10, [0.8] * 10, [-1.0] * 10, -1, "", 0.0, tokens=list(range(10)), pieces=path),
        BranchResolved(
            3,
            START + 10,
            list(range(k)),
            [f"cand{'≈' * b}" for b in range(k)],
            [0.1] * k,
            [0.1] * k,
            [0.5] * k,
            "topk",
            [list(range(depth))] * k,
            branches,
            3,
            3,
            True,
        ),
        TokensEmitted(3, list(range(11)), path + ["cand≈≈≈"], ["accepted"] * 10 + ["rescued"], ""),
    ]
    prefix = "a long committed prefix " * 5
    boxes = layout(build_tree(events, prefix))
    assert max(b.depth for b in boxes) == 16 and len(boxes) == 1 + 10 + k * (1 + depth)
    for a, b in itertools.combinations(boxes, 2):
        assert not boxes_overlap(a, b), (a.label, b.label)
    for b in boxes:  # the label's text fits its box (the SVG also pins the text to that width)
        assert cells(b.label) * CELL_PX <= b.w - 2 * PAD_X + 1e-6
    svg = tree_svg(events, prefix)
    width, height = map(float, re.search(r'width="([\d.]+)" height="([\d.]+)"', svg).groups())
    assert all(b.x + b.w <= width and b.y + b.h <= height for b in boxes)  # nothing is clipped by the canvas


def test_token_text_is_escaped_and_whitespace_visible():
    hostile = '<img src=x onerror="alert(1)">'
    events = linear_rejection()
    events[1] = DraftProposed(1, [1, 2, 3, 4], [hostile, " b\n", "c", "d"], [0.9] * 4, parent_position=START)
    events[2] = Verified(
        1,
        4,
        2,
        [0.9, 0.9, 0.1],
        [0.9] * 3,
        [-1.0] * 3,
        9,
        "correction",
        0.6,
        tokens=[1, 2, 3, 4],
        pieces=[hostile, " b\n", "c", "d"],
    )
    svg = tree_svg(events, prefix="</svg><script>alert(2)</script>")
    assert "<img" not in svg and "<script" not in svg and 'onerror="' not in svg
    assert "&lt;img␣src=x␣onerror=&quot;alert(1)&quot;&gt;" in svg  # shown as text (spaces made visible)
    assert "␣b⏎" in svg and visible(" \t\r\x00") == "␣⇥␍\\x00"


def test_the_caption_says_when_the_pass_did_not_wait_on_the_draft_after_a_hold():
    """After a step where the draft held back, the caption says so when the target's pass started before the draft's
    first step of the step ended (the draft followed it, engine.methods.drafting.DraftState.follows), and not when the
    draft
    led (its step ended before the pass began) or when nothing was held."""
    held = [
        StepStarted(1, START, 0.0),
        DraftProposed(1, [], [], [], parent_position=START + 1, kind="held", confidence=0.2, odds=0.1),
        TokensEmitted(1, [5], ["e"], ["target"], "e"),
    ]

    def step(draft_start: float, draft_end: float) -> list:
        return [
            StepStarted(2, START + 1, 0.1),
            TimingSpan("draft", "draft", 2, draft_start, draft_end),
            TimingSpan("target", "verify", 2, 0.105, 0.15),
            TokensEmitted(2, [6], ["f"], ["target"], "f"),
        ]

    words = "the target's pass started without waiting on a draft step"
    followed, led = step(0.1051, 0.11), step(0.1, 0.104)
    assert words in step_caption(followed, 2, held)
    assert words not in step_caption(led, 2, held)
    assert words not in step_caption(followed, 2, held[:1] + held[2:])  # nothing held the step before
    shown = html.escape(words)  # the tree view escapes its caption
    assert shown in tree_html(held + followed, 2) and shown not in tree_html(held + led, 2)


def test_the_caption_tells_a_branch_hold_from_a_path_hold():
    """A hold on a fork's branches (a "held" proposal on branch 1) is captioned as such, with the line's odds it
    read, and is not a path hold: the target takes no position for it, and the next step's pass did not follow it."""
    branch_held = [
        *fork(survivor=0, rescued=False, tried=1)[:-1],
        DraftProposed(2, [], [], [], branch=1, parent_position=START + 4, kind="held", confidence=0.4, odds=0.3125),
        fork(survivor=0, rescued=False, tried=1)[-1],
    ]
    caption = step_caption(branch_held, 2)
    assert "the branches held back (odds that the first branch's line holds up with one more token 0.31)" in caption
    assert "the target takes that token itself" not in caption
    nxt = [
        StepStarted(3, START + 2, 0.1),
        TimingSpan("draft", "draft", 3, 0.1051, 0.11),
        TimingSpan("target", "verify", 3, 0.105, 0.15),
        TokensEmitted(3, [6], ["f"], ["target"], "f"),
    ]
    assert "started without waiting on a draft step" not in step_caption(nxt, 3, branch_held)


def test_the_headline_says_which_branch_won_in_large_type():
    """A fork's step opens with its outcome in a few large words: which branch won, its token in its verdict's
    colour, and whether that was a rescue; a step without a fork says how many drafted tokens were accepted."""
    from app.tree import STYLE, step_headline

    won = step_headline(fork(survivor=1, rescued=True, tried=2))
    assert "branch 2 of 3 won" in won and ">c2</span>" in won and STYLE["rescued"][0] in won and "a rescue" in won
    first = step_headline(fork(survivor=0, rescued=False, tried=1))
    assert "branch 1 of 3 won" in first and STYLE["accepted"][0] in first and "rescue" not in first
    lost = step_headline(fork(survivor=-1, rescued=False, tried=3))
    assert "every branch lost" in lost and ">Z</span>" in lost
    assert "2 of 4 drafted tokens accepted, no fork" in step_headline(linear_rejection())
    assert tree_html(fork(survivor=1, rescued=True, tried=2), 2).index("tree-headline") < tree_html(
        fork(survivor=1, rescued=True, tried=2), 2
    ).index("tree-caption")
    evil = fork(survivor=1, rescued=True, tried=2)
    evil[next(i for i, e in enumerate(evil) if isinstance(e, BranchResolved))] = BranchResolved(
        2,
        START + 1,
        [11, 12, 13],
        ["c1", "<img src=x onerror=alert(1)>", "c3"],
        [0.5] * 3,
        [0.2] * 3,
        [0.9, 0.3],
        "topk",
        [[1], [2], [3]],
        [["a"], ["b"], ["c"]],
        1,
        12,
        True,
    )
    assert "<img" not in step_headline(evil) and "&lt;img" in step_headline(evil)


def test_a_forking_step_is_drawn_large_enough_to_read_from_afar():
    """20 px labels (the page's body text is about 14 px) and thick survivor edges; a fork of 3 with γ 3 and
    short tokens still fits a 1280-px-wide page without scrolling."""
    from app.tree import FONT_PX, NODE_H, SURVIVOR_W

    assert FONT_PX >= 20 and NODE_H >= FONT_PX + 12 and SURVIVOR_W >= 4
    events = fork(survivor=1, rescued=True, tried=2)
    svg = tree_svg(events, "Why is the sky blue? The sky")
    assert f'font-size="{FONT_PX}"' in svg and f'stroke-width="{SURVIVOR_W}"' in svg
    width = float(re.search(r'<svg[^>]* width="([\d.]+)"', svg).group(1))
    assert width <= 1200
