"""The branch tree of one decoding step, drawn as SVG from that step's events alone (live and replay share it).

Left to right: the committed prefix (root), the drafted path, the fork with its k candidates fanning out,
and each branch's tokens. Every node is coloured by its verdict; the path that survives the step (what is
committed, or stays speculative for the next step) is highlighted end to end. The layout is computed here,
not by a plotting library, so that labels never overlap or clip: each column is as wide as its longest
label, each leaf gets its own row and a parent sits midway between its first and last child (a tidy tree).

Token text is model output (or an imported file's): it is HTML-escaped wherever it becomes markup.
"""

from __future__ import annotations

import html
import unicodedata
from dataclasses import dataclass, field

from engine.events import (
    BranchResolved,
    DraftProposed,
    Event,
    Rollback,
    RunStarted,
    StepStarted,
    TimingSpan,
    TokensEmitted,
    Verified,
)

# Verdicts a node can have, with (fill, stroke, text colour, dashed border).
STYLE = {
    "prefix": ("#616161", "#424242", "#ffffff", False),
    "accepted": ("#c8f7c5", "#2e7d32", "#1b1b1b", False),
    "rescued": ("#e3c8ff", "#6a1b9a", "#1b1b1b", False),
    "rejected": ("#f8c4c4", "#c62828", "#1b1b1b", False),
    "correction": ("#ffd7a8", "#e65100", "#1b1b1b", False),
    "bonus": ("#b9dcff", "#1565c0", "#1b1b1b", False),
    "target": ("#eeeeee", "#616161", "#1b1b1b", False),
    "unverified": ("#ffffff", "#9e9e9e", "#616161", True),
}
VERDICT_TEXT = {
    "prefix": "committed prefix",
    "accepted": "accepted draft token",
    "rescued": "rescued by a branch",
    "rejected": "rejected draft token",
    "correction": "target's correction",
    "bonus": "target's bonus",
    "target": "target token",
    "unverified": "never verified",
}
SURVIVOR = "#ff8f00"  # the survivor's highlight: border and edges

# Sized to be read from the back of a room on a projected 1280x720 page: 20 px labels, thick survivor edges
FONT_PX = 20
CELL_PX = 12.3  # advance of one monospace cell at FONT_PX (DejaVu Sans Mono: 0.602 em), with a little slack
PAD_X, NODE_H, ROW_H, COL_GAP, MARGIN = 8, 34, 44, 34, 12
EDGE_W, SURVIVOR_W = 2, 5  # stroke widths: an edge, and the survivor's border and edges
MAX_CELLS, PREFIX_CELLS = 16, 12  # longer labels are cut (the full text is in the hover)


@dataclass
class Node:
    text: str  # the token text as the model produced it (unescaped, whitespace as is)
    verdict: str
    hover: str = ""
    survivor: bool = False
    children: list[Node] = field(default_factory=list)

    def add(self, child: Node) -> Node:
        self.children.append(child)
        return child

    def walk(self):
        yield self
        for child in self.children:
            yield from child.walk()


@dataclass(frozen=True)
class Box:
    """A node placed on the canvas: its label's box is (x, y, w, h), y the top edge."""

    node: Node
    label: str
    depth: int
    x: float
    y: float
    w: float
    h: float


# -- token text as a label ---------------------------------------------------------------------------


def visible(text: str) -> str:
    """Whitespace and control characters made visible (a space is a real token difference)."""
    if not text:
        return "∅"
    out = []
    for ch in text:
        if ch == " ":
            out.append("␣")
        elif ch == "\n":
            out.append("⏎")
        elif ch == "\t":
            out.append("⇥")
        elif ch == "\r":
            out.append("␍")
        elif unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp"):
            out.append(f"\\x{ord(ch):02x}" if ord(ch) < 256 else f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return "".join(out)


def cells(text: str) -> int:
    """Monospace cells a label takes: wide (CJK, emoji) characters take two, combining marks none."""
    n = 0
    for ch in text:
        if unicodedata.combining(ch):
            continue
        n += 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1
    return n


def cut(text: str, limit: int, from_end: bool = False) -> str:
    """At most `limit` cells, with an ellipsis where text was cut."""
    if cells(text) <= limit:
        return text
    chars = list(reversed(text)) if from_end else list(text)
    kept, used = [], 1
    for ch in chars:
        used += cells(ch)
        if used > limit:
            break
        kept.append(ch)
    return "…" + "".join(reversed(kept)) if from_end else "".join(kept) + "…"


def label_of(node: Node) -> str:
    if node.verdict == "prefix":
        return cut(visible(node.text), PREFIX_CELLS, from_end=True) if node.text else "▶ prefix"
    return cut(visible(node.text), MAX_CELLS)


# -- the tree of a step, from its events ---------------------------------------------------------------


def ratio(p: float, q: float) -> str:
    return f"{p / q:.3f}" if q else "∞"


def draw(u: float) -> str:
    return "greedy" if u < 0 else f"{u:.3f}"


def pqu(p: float | None, q: float | None, u: float | None = None) -> str:
    """The verification numbers the events carry for one token, as hover text."""
    parts = []
    if p is not None:
        parts.append(f"p={p:.3f}")
    if q is not None:
        parts.append(f"q={q:.3f}")
    if p is not None and q is not None:
        parts.append(f"p/q={ratio(p, q)}")
    if u is not None:
        parts.append(f"u={draw(u)}")
    return " ".join(parts)


def hover(text: str, what: str, numbers: str = "") -> str:
    return f"«{visible(text)}» · {what}" + (f" · {numbers}" if numbers else "")


def first(events: list[Event], kind: type):
    return next((e for e in events if isinstance(e, kind)), None)


@dataclass
class StepFacts:
    """What one step's events say, gathered once."""

    start: int | None  # committed length when the step began
    verdict: Verified | None
    fork: BranchResolved | None
    proposals: list[DraftProposed]
    emitted_pieces: list[str]
    emitted_kinds: list[str]
    dropped: int  # draft tokens rolled back in this step
    branch_verdict: Verified | None = None  # the target's verdict on the surviving branch, where the pass that
    # resolved the fork was fed it (the path and the branches verified as one token tree)

    @classmethod
    def of(cls, step_events: list[Event]) -> StepFacts:
        started = first(step_events, StepStarted)
        emitted = [e for e in step_events if isinstance(e, TokensEmitted)]
        return cls(
            started.position if started else None,
            next((e for e in step_events if isinstance(e, Verified) and e.branch == 0), None),
            first(step_events, BranchResolved),
            [e for e in step_events if isinstance(e, DraftProposed)],
            [p for e in emitted for p in e.pieces],
            [k for e in emitted for k in e.kinds],
            sum(len(e.tokens) for e in step_events if isinstance(e, Rollback) and e.model == "draft"),
            next((e for e in step_events if isinstance(e, Verified) and e.branch >= 1), None),
        )

    def index(self, parent_position: int) -> int | None:
        """A drafted token's place after the committed prefix (0: the first speculative position)."""
        return None if self.start is None else parent_position - self.start


def drafted_path(facts: StepFacts) -> list[tuple[str, float | None]]:
    """The linear path as far as this step knows it: the verified tokens, then tokens drafted meanwhile
    (a parallel method drafts on while the target verifies). A position no event of this step names
    (drafted in an earlier step, not verified now) is a gap: None."""
    known: dict[int, tuple[str, float | None]] = {}
    for d in facts.proposals:
        at = facts.index(d.parent_position)
        if d.kind == "path" and at is not None:
            for j, (piece, q) in enumerate(zip(d.pieces, d.q)):
                known.setdefault(at + j, (piece, q))
    v = facts.verdict
    if v is not None:
        for i, piece in enumerate(v.pieces):
            known[i] = (piece, v.q[i] if i < len(v.q) else known.get(i, (piece, None))[1])
    if not known:
        return []
    return [known.get(i, ("…", None)) for i in range(max(known) + 1)]


def add_path(root: Node, facts: StepFacts) -> tuple[list[Node], bool]:
    """Chain the path's nodes under the root; returns them and whether the target rejected one of them."""
    v = facts.verdict
    accepted = v.accepted if v else 0
    rejected = v is not None and accepted < len(v.tokens)
    committed = len(facts.emitted_pieces)
    nodes, parent = [], root
    for i, (piece, q) in enumerate(drafted_path(facts)):
        p = v.p[i] if v and i < len(v.p) else None
        u = v.u[i] if v and i < len(v.u) else None
        if i < accepted:
            node = Node(
                piece, "accepted", hover(piece, f"accepted draft token {i + 1}", pqu(p, q, u)), survivor=i < committed
            )
        elif rejected and i == accepted:
            node = Node(piece, "rejected", hover(piece, "rejected by the target", pqu(p, q, u)))
        elif rejected:
            node = Node(
                piece,
                "unverified",
                hover(piece, "drafted after a rejection: thrown away, never verified", pqu(None, q)),
            )
        else:
            node = Node(
                piece,
                "unverified",
                hover(piece, "still speculative: verified in a later step", pqu(None, q)),
                survivor=True,
            )
        nodes.append(parent.add(node))
        parent = node
    return nodes, rejected


def add_target_token(parent: Node, facts: StepFacts) -> None:
    """The token the target drew itself after the verified path (a correction or a bonus), where it was committed."""
    v = facts.verdict
    if v is None or v.next_token < 0 or len(facts.emitted_pieces) <= v.accepted:
        return
    add_target_node(parent, facts.emitted_pieces[v.accepted], v)


def add_target_node(parent: Node, piece: str, v: Verified) -> None:
    kind = v.next_kind if v.next_kind in ("correction", "bonus") else "correction"
    what = (
        "correction: drawn from the residual max(0, p - q)"
        if kind == "correction"
        else "bonus: every draft token was accepted"
    )
    parent.add(
        Node(piece, kind, hover(piece, f"target's {what}", f"drawn with probability {v.next_p:.3f}"), survivor=True)
    )


def branch_q(facts: StepFacts, branch: int, fork_at: int | None) -> dict[int, float]:
    """q of each branch token drafted in this step, by its place in the branch."""
    out = {}
    for d in facts.proposals:
        if d.kind == "branch" and d.branch == branch and fork_at is not None:
            at = facts.index(d.parent_position)
            if at is not None and d.q:
                out[at - fork_at - 1] = d.q[0]
    return out


def add_branch_target_token(parent: Node, facts: StepFacts, v: Verified) -> None:
    """The target's own token after the accepted part of the surviving branch (the step's last committed token)."""
    if v.next_token >= 0 and facts.emitted_pieces:
        add_target_node(parent, facts.emitted_pieces[-1], v)


def add_resolved_fork(parent: Node, facts: StepFacts) -> None:
    """A branch point the target resolved in this step: the candidates fan out, each with its branch."""
    f = facts.fork
    at = facts.index(f.position)
    tried = len(f.u)
    for b, piece in enumerate(f.pieces):
        p, q = (f.p[b] if b < len(f.p) else None), (f.q[b] if b < len(f.q) else None)
        u = f.u[b] if b < tried else None
        name = f"candidate {b + 1} of {len(f.candidates)} ({f.scheme})"
        if b == f.survivor:
            verdict, what = (
                ("rescued", f"{name}: survived, rescuing a rejection")
                if f.rescued
                else ("accepted", f"{name}: survived")
            )
        elif b < tried:
            verdict, what = "rejected", f"{name}: rejected"
        else:
            verdict, what = "unverified", f"{name}: not tried, an earlier candidate survived"
        node = parent.add(Node(piece, verdict, hover(piece, what, pqu(p, q, u)), survivor=b == f.survivor))
        qs = branch_q(facts, b + 1, at)
        v = facts.branch_verdict
        judged = v if b == f.survivor and v is not None and v.branch == b + 1 else None  # fed, and judged by its rows
        candidate = node
        for j, token_piece in enumerate(f.branch_pieces[b] if b < len(f.branch_pieces) else []):
            verdict, what, numbers = (
                "unverified",
                (
                    "its branch: the next path, verified in a later step"
                    if b == f.survivor
                    else "on a losing branch: rolled back, never verified"
                ),
                pqu(None, qs.get(j)),
            )
            if judged is not None and j < judged.drafted:
                numbers = pqu(judged.p[j], judged.q[j], judged.u[j])
                verdict, what = (
                    ("accepted", "its branch, verified in this step along with the path")
                    if j < judged.accepted
                    else ("rejected", "its branch: rejected in this step")
                )
            elif judged is not None and judged.accepted < judged.drafted:
                what = "its branch, drafted after a rejection: rolled back, never verified"
            survives = b == f.survivor and (judged is None or j < judged.accepted or judged.accepted == judged.drafted)
            node = node.add(Node(token_piece, verdict, hover(token_piece, what, numbers), survivor=survives))
            if judged is not None and j + 1 == judged.accepted:
                add_branch_target_token(node, facts, judged)
        if judged is not None and judged.accepted == 0:
            add_branch_target_token(candidate, facts, judged)
    if f.survivor < 0 and facts.emitted_pieces:
        piece = facts.emitted_pieces[-1]
        what = "no candidate survived: the target's token from the residual"
        parent.add(Node(piece, "correction", hover(piece, what), survivor=True))


def add_pending_fork(path: list[Node], root: Node, facts: StepFacts, rejected: bool) -> None:
    """A branch point drafted in this step but not resolved in it: all of it unverified; it survives
    (stays speculative) unless the path before it was rejected."""
    cands = next((d for d in facts.proposals if d.kind == "candidates"), None)
    if cands is None:
        return
    at = facts.index(cands.parent_position)
    parent = path[at - 1] if at is not None and 0 < at <= len(path) else (path[-1] if path else root)
    what = "thrown away with the rejected path" if rejected else "a branch point still speculative"
    for b, (piece, q) in enumerate(zip(cands.pieces, cands.q)):
        node = parent.add(
            Node(
                piece,
                "unverified",
                hover(piece, f"candidate {b + 1} of {len(cands.tokens)}: {what}", pqu(None, q)),
                survivor=not rejected,
            )
        )
        tokens = sorted(
            (d.parent_position, d.pieces[0], d.q[0])
            for d in facts.proposals
            if d.kind == "branch" and d.branch == b + 1 and d.pieces
        )
        for _, token_piece, tq in tokens:
            node = node.add(
                Node(
                    token_piece,
                    "unverified",
                    hover(token_piece, f"its branch: {what}", pqu(None, tq)),
                    survivor=not rejected,
                )
            )


def add_unseen_rollback(path: list[Node], root: Node, facts: StepFacts) -> None:
    """Rolled-back draft tokens that no event of this step places (drafted in an earlier step, e.g. a fork
    beyond the verified block): one summary node, so the count on the tree matches the rollback."""
    shown = sum(1 for n in root.walk() if n.verdict in ("rejected", "unverified") and not n.survivor)
    missing = facts.dropped - shown
    if missing > 0:
        (path[-1] if path else root).add(
            Node(
                f"+{missing}",
                "unverified",
                f"{missing} more drafted tokens (drafted in an earlier step) rolled back, never verified",
            )
        )


def build_tree(step_events: list[Event], prefix: str = "") -> Node:
    """One step as a tree of nodes. `prefix`: the committed text before the step (the root's label)."""
    facts = StepFacts.of(step_events)
    root = Node(
        prefix,
        "prefix",
        f"committed prefix{'' if facts.start is None else f' ({facts.start} tokens)'}: …{visible(prefix[-200:])}",
        survivor=True,
    )
    if facts.verdict is None and facts.fork is None:  # AR, a prefill, or a target-only step: the target's tokens
        parent = root
        for piece, kind in zip(facts.emitted_pieces, facts.emitted_kinds):
            parent = parent.add(
                Node(
                    piece,
                    kind if kind in STYLE else "target",
                    hover(piece, VERDICT_TEXT.get(kind, kind)),
                    survivor=True,
                )
            )
        return root
    path, rejected = add_path(root, facts)
    accepted = facts.verdict.accepted if facts.verdict else 0
    anchor = path[accepted - 1] if accepted else root  # where the target's own token hangs
    add_target_token(anchor, facts)
    if facts.fork is not None:
        at = facts.index(facts.fork.position)
        at = len(path) if at is None else at
        add_resolved_fork(path[at - 1] if 0 < at <= len(path) else root, facts)
    else:
        add_pending_fork(path, root, facts, rejected)
    add_unseen_rollback(path, root, facts)
    return root


# -- layout ----------------------------------------------------------------------------------------------


def layout(root: Node) -> list[Box]:
    """Place every node: column = depth (as wide as its widest label), row = tidy-tree leaf order."""
    rows: dict[int, float] = {}
    depth_of: dict[int, int] = {}
    next_leaf = [0]

    def place(node: Node, depth: int) -> float:
        depth_of[id(node)] = depth
        if not node.children:
            rows[id(node)] = float(next_leaf[0])
            next_leaf[0] += 1
        else:
            child_rows = [place(c, depth + 1) for c in node.children]
            rows[id(node)] = (child_rows[0] + child_rows[-1]) / 2
        return rows[id(node)]

    place(root, 0)
    nodes = list(root.walk())
    labels = {id(n): label_of(n) for n in nodes}
    widths: dict[int, float] = {}
    for n in nodes:
        d = depth_of[id(n)]
        widths[d] = max(widths.get(d, 0.0), cells(labels[id(n)]) * CELL_PX + 2 * PAD_X)
    lefts, x = {}, float(MARGIN)
    for d in sorted(widths):
        lefts[d] = x
        x += widths[d] + COL_GAP
    return [
        Box(
            n,
            labels[id(n)],
            depth_of[id(n)],
            lefts[depth_of[id(n)]],
            MARGIN + rows[id(n)] * ROW_H,
            widths[depth_of[id(n)]],
            NODE_H,
        )
        for n in nodes
    ]


def boxes_overlap(a: Box, b: Box) -> bool:
    return a.x < b.x + b.w and b.x < a.x + a.w and a.y < b.y + b.h and b.y < a.y + a.h


# -- SVG ---------------------------------------------------------------------------------------------------


def edge_svg(a: Box, b: Box) -> str:
    x1, y1, x2, y2 = a.x + a.w, a.y + a.h / 2, b.x, b.y + b.h / 2
    mid = (x1 + x2) / 2
    survivor = a.node.survivor and b.node.survivor
    style = (
        f'stroke="{SURVIVOR}" stroke-width="{SURVIVOR_W}"' if survivor else f'stroke="#9e9e9e" stroke-width="{EDGE_W}"'
    )
    return (
        f'<path class="edge{" survivor" if survivor else ""}" d="M{x1:.1f},{y1:.1f} C{mid:.1f},{y1:.1f} '
        f'{mid:.1f},{y2:.1f} {x2:.1f},{y2:.1f}" fill="none" {style}/>'
    )


def node_svg(box: Box) -> str:
    n = box.node
    fill, stroke, ink, dashed = STYLE.get(n.verdict, STYLE["unverified"])
    border = (
        f'stroke="{SURVIVOR}" stroke-width="{SURVIVOR_W}"'
        if n.survivor
        else f'stroke="{stroke}" stroke-width="{EDGE_W}"'
    )
    dash = ' stroke-dasharray="6 4"' if dashed and not n.survivor else ""
    text_w = cells(box.label) * CELL_PX
    fit = f' textLength="{text_w:.1f}" lengthAdjust="spacingAndGlyphs"' if cells(box.label) > 1 else ""
    classes = f"node v-{html.escape(n.verdict)}" + (" survivor" if n.survivor else "")
    return (
        f'<g class="{classes}" data-depth="{box.depth}"><title>{html.escape(n.hover)}</title>'
        f'<rect x="{box.x:.1f}" y="{box.y:.1f}" width="{box.w:.1f}" height="{box.h:.1f}" rx="4" fill="{fill}" '
        f'{border}{dash}/><text x="{box.x + box.w / 2:.1f}" y="{box.y + box.h / 2:.1f}" fill="{ink}" '
        f'text-anchor="middle" dominant-baseline="central"{fit}>{html.escape(box.label)}</text></g>'
    )


def tree_svg(step_events: list[Event], prefix: str = "") -> str:
    """The step's branch tree as a self-contained <svg> (colours inline, hover text in <title>)."""
    boxes = layout(build_tree(step_events, prefix))
    where = {id(b.node): b for b in boxes}
    edges = [edge_svg(b, where[id(c)]) for b in boxes for c in b.node.children]
    edges.sort(key=lambda e: "survivor" in e)  # the highlighted path is drawn last, on top
    width = max(b.x + b.w for b in boxes) + MARGIN
    height = max(b.y + b.h for b in boxes) + MARGIN
    return (
        f'<svg class="branch-tree" xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
        f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="DejaVu Sans Mono, ui-monospace, monospace" '
        f'font-size="{FONT_PX}">{"".join(edges)}{"".join(node_svg(b) for b in boxes)}</svg>'
    )


# -- a step of a stream ----------------------------------------------------------------------------------


def step_events(events: list[Event], step: int) -> list[Event]:
    """The events that belong to one step (every event that carries a step number)."""
    return [e for e in events if getattr(e, "step", None) == step]


def prefix_before(events: list[Event], step: int) -> str:
    """The committed text before a step: the prompt and every token emitted in earlier steps."""
    start = first(events, RunStarted)
    text = "".join(e.text for e in events if isinstance(e, TokensEmitted) and e.step < step)
    return (start.prompt_text if start else "") + text


TREE_LEGEND = (
    "".join(
        f'<span class="tree-key" style="background:{STYLE[v][0]};border:1px {"dashed" if STYLE[v][3] else "solid"} '
        f'{STYLE[v][1]};color:{STYLE[v][2]}">{html.escape(VERDICT_TEXT[v])}</span>'
        for v in ("accepted", "rescued", "rejected", "correction", "bonus", "target", "unverified")
    )
    + f'<span class="tree-key" style="border:3px solid {SURVIVOR}">survives the step</span>'
)


def fork_reason(facts: StepFacts) -> str:
    """Why the draft forked where it did, when this step drafted the candidates and the run recorded it: its
    confidence there and the acceptance odds the policy read it as (the measured rate, or the confidence itself)."""
    cands = next((d for d in facts.proposals if d.kind == "candidates" and d.odds >= 0), None)
    if cands is None:
        return ""
    return f" (draft confidence {cands.confidence:.2f}, acceptance odds {cands.odds:.2f})"


def followed(step_events_: list[Event], previous: list[Event]) -> bool:
    """SpecBranch's draft held back in the previous step, and in this one the target's pass did not wait on a draft
    step: the draft's first step here ended after the pass began (a head start ends before it). This is how the
    draft follows the target where it has more often held again than not after a hold (drafting.DraftState.follows).
    It reads the measured spans only, so a replay shows what the live run did."""
    if not any(isinstance(e, DraftProposed) and e.kind == "held" and e.branch == 0 for e in previous):
        return False
    spans = [e for e in step_events_ if isinstance(e, TimingSpan)]
    target = next((e for e in spans if e.worker == "target"), None)
    draft = next((e for e in spans if e.worker == "draft"), None)
    return target is not None and draft is not None and draft.end > target.start


def step_caption(step_events_: list[Event], step: int, previous: list[Event] = ()) -> str:
    """One sentence on what the target decided in the step (plain text). `previous`: the step before's events."""
    facts = StepFacts.of(step_events_)
    parts = []
    if facts.verdict is not None and facts.verdict.tokens:
        v = facts.verdict
        parts.append(f"{v.accepted} of {len(v.tokens)} drafted tokens accepted")
    if facts.fork is not None:
        f = facts.fork
        parts.append(
            f"fork of {len(f.candidates)}{fork_reason(facts)}: "
            + (
                f"candidate {f.survivor + 1} survived" + (" (rescued)" if f.rescued else "")
                if f.survivor >= 0
                else "every candidate lost"
            )
        )
    if followed(step_events_, previous):
        parts.append("after the hold, the target's pass started without waiting on a draft step")
    holds = [d for d in facts.proposals if d.kind == "held"]
    path_hold = next((d for d in holds if d.branch == 0), None)
    if path_hold is not None:  # SpecBranch's hold: nothing was drafted where it would likely be rolled back
        parts.append(
            f"the draft held back (acceptance odds {path_hold.odds:.2f}, draft confidence "
            f"{path_hold.confidence:.2f}): the target takes that token itself"
        )
    branch_hold = next((d for d in holds if d.branch > 0), None)
    if branch_hold is not None:  # ... and on a fork's branches: no branch token past where the line would likely fail
        parts.append(
            f"the branches held back (odds that the first branch's line holds up with one more token "
            f"{branch_hold.odds:.2f}): no branch token until the target's verdict"
        )
    parts.append(f"{len(facts.emitted_pieces)} token(s) committed, {facts.dropped} rolled back")
    return f"Step {step}: " + "; ".join(parts)


def step_headline(step_events_: list[Event]) -> str:
    """The step's outcome in a few large words (HTML, token text escaped): which branch of a fork won, with its
    token in the colour of its verdict, else how many drafted tokens the target accepted."""
    facts = StepFacts.of(step_events_)
    if facts.fork is not None:
        f = facts.fork
        if f.survivor < 0:
            return (
                f'<div class="tree-headline">Fork of {len(f.candidates)}: every branch lost; the target '
                f"wrote {chip(visible(facts.emitted_pieces[-1]) if facts.emitted_pieces else '?', 'correction')}"
                "</div>"
            )
        verdict = "rescued" if f.rescued else "accepted"
        won = f"branch {f.survivor + 1} of {len(f.candidates)} won"
        return (
            f'<div class="tree-headline">Fork: {won} {chip(visible(f.pieces[f.survivor]), verdict)}'
            + (' <span class="tree-rescue">a rescue: not the draft\'s first choice</span>' if f.rescued else "")
            + "</div>"
        )
    if facts.verdict is not None and facts.verdict.tokens:
        v = facts.verdict
        return f'<div class="tree-headline">{v.accepted} of {len(v.tokens)} drafted tokens accepted, no fork</div>'
    return ""


def chip(text: str, verdict: str) -> str:
    fill, stroke, ink, _ = STYLE[verdict]
    return (
        f'<span class="tree-chip" style="background:{fill};border:3px solid {SURVIVOR};color:{ink}">'
        f"{html.escape(text)}</span>"
    )


def tree_html(events: list[Event], step: int | None) -> str:
    """The tree of `step` of a stream, with its caption and legend (what the Live and Replay tabs show)."""
    if step is None:
        return '<div class="tree-view"><p>No steps yet.</p></div>'
    mine = step_events(events, step)
    caption = step_caption(mine, step, step_events(events, step - 1))
    return (
        f'<div class="tree-view" data-step="{int(step)}">{step_headline(mine)}<div class="tree-caption">'
        f'{html.escape(caption)}</div><div class="tree-scroll">{tree_svg(mine, prefix_before(events, step))}</div>'
        f'<div class="tree-legend">{TREE_LEGEND}</div></div>'
    )
