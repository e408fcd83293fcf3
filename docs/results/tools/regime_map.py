"""The regime map (engine/measure/regime.py) of one bench run, for docs/results/README.md and the app's "How to read
this" tab:

    python docs/results/tools/regime_map.py --bench docs/results/json/regime-map-bench.json \
        --json docs/results/json/regime-map.json

The bench run names every draft with METHOD@DRAFT and runs `sd@DRAFT` for each (its c and α); the command that made
the committed one is in docs/results/README.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from engine.config import write_json  # noqa: E402
from engine.measure.regime import regime_map  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bench", required=True, help="a bench JSON (python -m engine bench --json)")
    parser.add_argument("--json", required=True, help="where to write the map")
    args = parser.parse_args()
    report = json.loads(Path(args.bench).read_text())
    out = {"bench": Path(args.bench).name, **regime_map(report)}
    write_json(args.json, out)
    for draft, e in out["drafts"].items():
        speeds = ", ".join(f"{m} {v['measured']}" for m, v in e["methods"].items())
        print(f"{draft}: c {e['c']}, α {e['alpha']}: {speeds}")


if __name__ == "__main__":
    main()
