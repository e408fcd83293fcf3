"""The shipped training corpora stay apart from every prompt a bench or a tuning run reads: the rule "never train on
benchmark prompts", checked on the files themselves with a word-run test of its own (not the generation tool's)."""

from __future__ import annotations

import functools
import gzip
import json
import re

import pytest

from engine.measure.datasets import DATA_DIR

SELF_CORPORA = sorted(DATA_DIR.glob("self*_smollm2_135m.jsonl.gz"))
RUN = 8  # words: a question sharing a run this long with a held-apart prompt counts as taken from it


def rows(path):
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def word_runs(text: str) -> set[tuple[str, ...]]:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i : i + RUN]) for i in range(len(words) - RUN + 1)}


@functools.cache
def held_apart_runs() -> frozenset[tuple[str, ...]]:
    return frozenset().union(*map(word_runs, held_apart_texts()))


def held_apart_texts() -> list[str]:
    """Every prompt a bench or a tuning run may read: the benchmark split (MT-Bench first turns, GSM8K rows from
    1000, HumanEval rows from 100), the tuning prompts and the foreign-language prompts, read from data/ directly."""
    mt = [json.loads(line)["turns"][0] for line in (DATA_DIR / "mt_bench.jsonl").read_text().splitlines() if line]
    gsm = [json.loads(line)["question"] for line in (DATA_DIR / "gsm8k.jsonl").read_text().splitlines() if line]
    he = [json.loads(line)["prompt"] for line in (DATA_DIR / "humaneval.jsonl").read_text().splitlines() if line]
    texts = mt + gsm[1000:] + he[100:]
    for name in ("tuning_prompts.jsonl", "foreign_prompts.jsonl", "foreign_tuning_prompts.jsonl"):
        texts += [json.loads(line)["prompt"] for line in (DATA_DIR / name).read_text().splitlines() if line]
    return texts


def test_word_runs_catch_a_copied_prompt_and_pass_a_fresh_one():
    """The check has teeth: a question quoting 8 words of a benchmark prompt is caught, a reworded one is not."""
    prompt = "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences"
    banned = word_runs(prompt)
    assert word_runs("Please compose an engaging travel blog post about a recent trip to Rome.") & banned
    assert not word_runs("Write a lively blog post about a holiday in Hawaii and its culture.") & banned


@pytest.mark.parametrize("path", SELF_CORPORA, ids=lambda p: p.name)
def test_no_self_question_shares_a_word_run_with_a_held_apart_prompt(path):
    corpus = rows(path)
    assert corpus and all(r["response_ids"] for r in corpus)
    taken = [r["prompt"] for r in corpus if word_runs(r["prompt"]) & held_apart_runs()]
    assert not taken, taken[:3]


def test_the_self_corpora_ask_no_question_twice():
    seen: dict[str, str] = {}
    for path in SELF_CORPORA:
        for r in rows(path):
            assert r["prompt"] not in seen, (r["prompt"], seen.get(r["prompt"]), path.name)
            seen[r["prompt"]] = path.name
    assert len(SELF_CORPORA) >= 2


def test_the_teacher_corpus_answers_training_split_rows_only():
    """GSM8K rows 0-999, HumanEval rows 0-99 and MT-Bench second turns (by question id): none of the benchmark
    split's GSM8K or HumanEval rows."""
    ids = {json.loads(line)["question_id"] for line in (DATA_DIR / "mt_bench.jsonl").read_text().splitlines() if line}
    splits = {"gsm8k": range(1000), "humaneval": range(100), "mt_bench_turn2": ids}
    for r in rows(DATA_DIR / "teacher_smollm2_135m.jsonl.gz"):
        assert r["index"] in splits[r["source"]], (r["source"], r["index"])
