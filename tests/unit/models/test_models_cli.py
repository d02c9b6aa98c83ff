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
