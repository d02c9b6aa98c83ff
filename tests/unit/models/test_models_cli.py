"""``epd make-model`` builds, refuses to overwrite silently, and replaces with --force."""

from services.cli import main


def test_make_model_builds_then_refuses_then_replaces(tmp_path, capsys):
    out = tmp_path / "m"
    assert main(["make-model", "--preset", "tiny", "--out", str(out)]) == 0
    assert (out / "config.json").is_file()
    assert "gibberish by design" in capsys.readouterr().out
    assert main(["make-model", "--out", str(out)]) == 2
    assert "--force" in capsys.readouterr().err
    assert main(["make-model", "--out", str(out), "--force"]) == 0
    assert (out / "config.json").is_file()


def test_every_command_has_help(capsys):
    import pytest

    for command in ("up", "encoder", "pd", "proxy", "make-model", "bench"):
        with pytest.raises(SystemExit) as exit_info:
            main([command, "--help"])
        assert exit_info.value.code == 0
        assert "EPD_" in capsys.readouterr().out or command == "bench"


def test_the_7b_preset_is_refused_where_there_is_no_cuda(tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "big"
    assert main(["make-model", "--preset", "llava-1.5-7b-random", "--device", "cuda", "--out", str(out)]) == 2
    error = capsys.readouterr().err
    assert "built on a CUDA device in bfloat16 (7.06B parameters, about 14 GB" in error and "no CUDA device" in error
    assert main(["make-model", "--preset", "tiny", "--device", "cuda", "--out", str(out)]) == 2
    assert "built on cpu, not cuda" in capsys.readouterr().err
    assert not out.exists()
