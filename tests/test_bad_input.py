"""Bad input gets a clear one-line error from the CLI (exit code 2), never a traceback."""

from __future__ import annotations

import pytest

from engine.cli import main


def run_cli(capsys, *argv):
    code = main(list(argv))
    err = capsys.readouterr().err
    return code, err


@pytest.fixture
def tiny_args(tiny_dirs):
    return ["--target", str(tiny_dirs["target"]), "--draft", str(tiny_dirs["draft"]), "--device", "cpu"]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--temperature", "-0.5"], "temperature must be >= 0"),
        (["--top-p", "0"], "top-p must be in (0, 1]"),
        (["--top-p", "1.5"], "top-p must be in (0, 1]"),
        (["--max-new-tokens", "0"], "max-new-tokens must be a positive integer"),
        (["--max-new-tokens", "-3"], "max-new-tokens must be a positive integer"),
        (["--gamma", "0"], "gamma (draft length) must be an integer >= 1"),
        (["--hold", "1.5"], "hold must be in [0, 1] (0 = off)"),
        (["--hold", "0", "--hold-branches"], "hold-branches needs a hold above 0"),
    ],
)
def test_invalid_settings(capsys, tiny_args, extra, message):
    code, err = run_cli(capsys, "generate", *tiny_args, "--prompt", "a b", *extra)
    assert code == 2 and message in err and "Traceback" not in err


def test_unwritable_bench_output_is_refused_before_any_model_loads(capsys, tmp_path):
    """A --json that could not be written fails at once, not after the whole bench ran (the model path here does
    not exist either: the output is checked first)."""
    (tmp_path / "a-file").write_text("")
    for out, message in (
        (tmp_path / "a-file" / "x.json", "cannot write the bench results"),
        (tmp_path, "it is a folder"),
    ):
        code, err = run_cli(capsys, "bench", "--target", "/no/such/model", "--methods", "ar", "--json", str(out))
        assert code == 2 and message in err and "Traceback" not in err
    code, err = run_cli(
        capsys, "bench", "--target", "/no/such/model", "--methods", "ar", "--json", str(tmp_path / "new" / "x.json")
    )
    assert code == 2 and "model path not found" in err and (tmp_path / "new").is_dir()  # its folder is made


def test_unknown_model_path(capsys):
    code, err = run_cli(capsys, "generate", "--target", "/no/such/model", "--prompt", "hi", "--method", "ar")
    assert code == 2 and "model path not found" in err


def test_directory_that_is_not_a_model(capsys, tmp_path):
    code, err = run_cli(capsys, "generate", "--target", str(tmp_path), "--prompt", "hi", "--method", "ar")
    assert code == 2 and "no config.json" in err


def test_missing_gguf(capsys):
    code, err = run_cli(capsys, "generate", "--target", "/tmp/nothing-here.gguf", "--prompt", "hi", "--method", "ar")
    assert code == 2 and "GGUF file not found" in err


def test_incompatible_tokenizers(capsys, tiny_dirs):
    code, err = run_cli(
        capsys,
        "generate",
        "--target",
        str(tiny_dirs["target"]),
        "--draft",
        str(tiny_dirs["other_vocab"]),
        "--prompt",
        "a b",
        "--device",
        "cpu",
    )
    assert code == 2 and "incompatible tokenizers" in err


def test_empty_prompt(capsys, tiny_args):
    code, err = run_cli(capsys, "generate", *tiny_args, "--prompt", "   ")
    assert code == 2 and "prompt is empty" in err


def test_prompt_longer_than_context(capsys, tiny_args):
    code, err = run_cli(capsys, "generate", *tiny_args, "--prompt", " ".join(["a"] * 80))  # context is 64
    assert code == 2 and "context holds 64" in err


def test_generation_near_context_end_is_cut_with_notice(tiny_engine):
    from engine.config import GenerationConfig
    from engine.events import Notice

    r = tiny_engine.run([2] * 60, GenerationConfig(method="sd", max_new_tokens=50, gamma=3))
    assert len(r.token_ids) == 4  # 64 - 60
    assert any(isinstance(e, Notice) and "context" in e.message for e in r.events)


def test_chat_without_template(capsys, tiny_args):
    code, err = run_cli(capsys, "generate", *tiny_args, "--prompt", "a b", "--chat")
    assert code == 2 and "chat template" in err


def test_malformed_prompt_file(capsys, tiny_args, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a b"}\nnot json\n')
    code, err = run_cli(capsys, "generate", *tiny_args, "--prompt-file", str(bad))
    assert code == 2 and "bad.jsonl:2" in err
