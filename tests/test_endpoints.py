"""Every public endpoint has an explicit, meaningful name and is documented for gradio_client users in docs/app.md's
table, with its inputs in order; nothing else is public."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from app.main import build_app

DOC = Path(__file__).resolve().parent.parent / "docs" / "app.md"
AUTO_NAME = re.compile(r"(.*_\d+|lambda.*|unnamed.*|)")  # what gradio makes up when a name is missing or taken


def documented() -> dict[str, list[str]]:
    """The table between <!-- endpoints --> markers: {"/name": [input names, in order]}."""
    text = DOC.read_text()
    table = text[text.index("<!-- endpoints -->") : text.index("<!-- /endpoints -->")]
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0].startswith("`/"):
            rows[cells[0].strip("`")] = re.findall(r"`([^`]+)`", cells[2])
    return rows


@pytest.fixture(scope="module")
def demo():
    return build_app(lambda draft=None: None, drafts=[("the app's own", "self"), ("another", "embedded")])


def test_the_public_endpoints_are_the_documented_ones(demo):
    info = demo.get_api_info()
    assert not info["unnamed_endpoints"]
    public = info["named_endpoints"]
    docs = documented()
    assert sorted(public) == sorted(docs)
    for name, endpoint in public.items():
        params = [p["parameter_name"] for p in endpoint["parameters"]]
        assert len(params) == len(docs[name]), name
        for got, written in zip(params, docs[name]):
            # gradio names a handler's *args param_N: the table names what they are
            assert got == written or re.fullmatch(r"param_\d+", got), (name, got, written)


def test_no_endpoint_has_a_made_up_name(demo):
    """Public or private, every endpoint with a function of its own was named on purpose (gradio's own helper for
    the Stop button's cancels has no function, and stays private); none is public by default."""
    for fn in demo.fns.values():
        if fn.fn is None:
            assert fn.api_visibility == "private"
            continue
        assert not AUTO_NAME.fullmatch(fn.api_name or ""), fn.api_name
    names = [fn.api_name for fn in demo.fns.values() if fn.fn is not None]
    assert len(names) == len(set(names))
    public = {fn.api_name for fn in demo.fns.values() if fn.api_visibility == "public"}
    assert public == {name.lstrip("/") for name in documented()}
    assert {"browser_identity", "slider_defaults", "replay_tick", "replay_play", "step_mark"} <= {
        fn.api_name for fn in demo.fns.values() if fn.api_visibility == "private"
    }
