"""`pdserve profile` refuses flags it cannot measure with before building an engine."""

from __future__ import annotations

import pytest

from cluster.cli.main import build_parser, main


@pytest.mark.parametrize("flag", ["--chunk-len", "--decode-steps", "--max-num-batched-tokens"])
def test_a_count_below_one_is_refused_by_the_parser(flag, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["profile", "--output", str(tmp_path / "p.json"), flag, "0"])
    assert exit_info.value.code == 2 and "expected positive integers" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "expected"), [
    (["--max-num-batched-tokens", "16", "--batch-sizes", "1,16"], "must exceed the largest of --batch-sizes (16)"),
    (["--output", "{tmp}"], "is a directory"),
    (["--output", "{tmp}/a_file/p.json"], "a_file is a file, not a directory"),    # (after the profile, a traceback)
])
def test_flags_that_cannot_be_measured_with_are_refused_before_the_engine_starts(flags, expected, tmp_path,
                                                                                 capsys):
    (tmp_path / "a_file").write_text("")
    flags = [f.replace("{tmp}", str(tmp_path)) for f in flags]
    output = [] if "--output" in flags else ["--output", str(tmp_path / "p.json")]
    assert main(["profile", *output, *flags]) == 2
    assert expected in capsys.readouterr().err


def test_the_built_in_models_are_names_profile_and_plan_take(capsys):
    from cluster.cli.plan_command import resolve_model_dir
    from engine.tiny_model import preset_model_dir
    assert resolve_model_dir("tiny") == preset_model_dir("tiny")       # built on first use
    assert resolve_model_dir("llama-3-8b").name == "llama-3-8b"       # configs/models/
    assert main(["plan", "--model", "tiny", "--tp", "1"]) == 0        # before: no config.json in tiny
    assert "fits: yes" in capsys.readouterr().out
    assert main(["plan", "--model", "no-such-model", "--tp", "1"]) == 2
    assert "built-in names: llama-3-70b, llama-3-8b, tiny," in capsys.readouterr().err


def test_a_grid_past_the_context_is_refused_or_fitted_within_it(tmp_path, capsys):
    # every --prompt-lens past the context: said so (before: the warm-up's prompt failed with
    # the engine's own error); a short context: the chunks shrink to fit (before: refused)
    assert main(["profile", "--prompt-lens", "2000", "--output", str(tmp_path / "p.json")]) == 2
    assert "the grid has no prompt length that fits: prompts must be <= 1023 tokens" in capsys.readouterr().err
    assert main(["profile", "--max-model-len", "64", "--prompt-lens", "16,32", "--batch-sizes", "1,2",
                 "--contexts", "16", "--output", str(tmp_path / "short.json")]) == 0
    import json
    profile = json.loads((tmp_path / "short.json").read_text())
    assert {p["kind"] for p in profile["points"]} == {"prefill", "decode", "mixed"}
    assert profile["eager_floor_s"] == 0.0           # a CPU profile has no eager floor to fit
