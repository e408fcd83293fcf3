"""`--record` on the engine CLI writes runs to the session store; a broken store never stops generation."""

from __future__ import annotations

import json

from engine.cli import main
from sessions import Store


def test_generate_and_bench_record(tmp_path, tiny_dirs, capsys):
    db = tmp_path / "s.db"
    model = ["--target", str(tiny_dirs["target"]), "--draft", str(tiny_dirs["draft"]), "--device", "cpu"]
    assert (
        main(
            [
                "generate",
                *model,
                "--method",
                "specbranch",
                "--prompt",
                "a b c",
                "--max-new-tokens",
                "10",
                "--json",
                "--record",
                "--db",
                str(db),
            ]
        )
        == 0
    )
    live = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a b", "chat": false}\n')
    assert (
        main(
            [
                "bench",
                *model,
                "--methods",
                "ar,sd",
                "--dataset",
                str(prompts),
                "--max-new-tokens",
                "6",
                "--record",
                "--db",
                str(db),
                "--warmup",
                "0",
            ]
        )
        == 0
    )
    with Store(db) as store:
        sessions = store.list_sessions()
        assert len(sessions) == 2
        gen = next(s for s in sessions if s["prompt"] == "a b c")
        run = store.get_session(gen["id"])["runs"][0]
        events = store.load_run_events(run["id"])
        assert [t for e in events if e.type == "tokens_emitted" for t in e.tokens] == live["token_ids"]
        bench = next(s for s in sessions if s["prompt"] == "a b")
        assert sorted(r["method"] for r in store.get_session(bench["id"])["runs"]) == ["ar", "sd"]


def test_unusable_store_still_generates(tmp_path, tiny_dirs, capsys):
    bad = tmp_path / "bad.db"
    bad.write_bytes(b"this is not a database" * 100)
    code = main(
        [
            "generate",
            "--target",
            str(tiny_dirs["target"]),
            "--method",
            "ar",
            "--prompt",
            "a b",
            "--max-new-tokens",
            "5",
            "--json",
            "--record",
            "--db",
            str(bad),
            "--device",
            "cpu",
        ]
    )
    captured = capsys.readouterr()
    assert code == 0 and len(json.loads(captured.out.strip())["token_ids"]) == 5
    assert "not recording" in captured.err
