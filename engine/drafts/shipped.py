"""Where the shipped drafts for the embedded target live, and their names as model specs."""

from pathlib import Path

DRAFTS_DIR = Path(__file__).resolve().parents[2] / "weights"  # outside the package: weights/<name>/
EMBEDDED_DRAFTS = {
    "embedded": "smollm2-135m-draft",
    "embedded-weak": "smollm2-135m-draft-weak",
    "embedded-head": "smollm2-135m-head",
}
