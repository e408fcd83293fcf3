"""Benchmark prompts from data/ (see data/README.md). Only the benchmark split is served here;
the training split (used for distillation and H-RAD) never appears in a benchmark:
  mt_bench   first turns of all 80 questions (chat)       -- training used second turns
  gsm8k      rows 1000-1318 (chat)                          -- training used rows 0-999
  humaneval  rows 100-163 (raw text, code completion)       -- training used rows 0-99
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from engine.config import SpecBranchError

DATA_DIR = Path(__file__).resolve().parents[2] / "data"
DATASETS = ("mt_bench", "gsm8k", "humaneval")


@dataclass(frozen=True)
class Prompt:
    dataset: str
    key: str
    text: str
    chat: bool


def _rows(name: str) -> list[dict]:
    with open(DATA_DIR / f"{name}.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def benchmark_prompts(name: str, limit: int = 0) -> list[Prompt]:
    if name == "mt_bench":
        out = [Prompt(name, str(r["question_id"]), r["turns"][0], True) for r in _rows(name)]
    elif name == "gsm8k":
        out = [Prompt(name, str(i), r["question"], True) for i, r in enumerate(_rows(name)) if i >= 1000]
    elif name == "humaneval":
        out = [Prompt(name, r["task_id"], r["prompt"], False) for i, r in enumerate(_rows(name)) if i >= 100]
    elif name == "all":
        return [p for d in DATASETS for p in benchmark_prompts(d, limit)]
    elif name.endswith(".jsonl"):
        path = Path(name)
        if not path.is_file():
            raise SpecBranchError(f"dataset file not found: {name}")
        out = []
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    r = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise SpecBranchError(f"{name}:{n}: not valid JSON ({exc.msg})") from None
                if not isinstance(r, dict) or not isinstance(r.get("prompt"), str):
                    raise SpecBranchError(f"{name}:{n}: each line needs a string field 'prompt'")
                out.append(Prompt(path.stem, str(n), r["prompt"], bool(r.get("chat", True))))
    else:
        raise SpecBranchError(f"unknown dataset {name!r}; choose mt_bench, gsm8k, humaneval, all or a .jsonl path")
    return out[:limit] if limit else out
