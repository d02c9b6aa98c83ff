"""``epd bench serve`` command line: flags, usage errors (exit 2 before anything starts), model resolution."""

from __future__ import annotations

import json

import pytest

from services.bench.serve import command as serve
from services.cli import build_parser


def parse(*flags: str):
    argv = ["bench", "serve", *flags]
    return build_parser(argv).parse_args(argv)


def test_defaults_describe_the_issue_run():
    args = parse()
    assert args.workload == "mixed" and args.model == "bench"
    assert args.configs == "colocated,replicas,disagg"
    assert args.rates == () and args.rate_multipliers == (0.5, 1.0, 1.5, 2.0, 3.0)
    assert args.replica_proxy == "shared" and args.plots and args.progress
    assert args.encoder_placement == "own" and args.encoder_threads == 0 and not args.images_first


def test_placement_and_message_order_flags():
    args = parse("--encoder-placement", "shared", "--encoder-threads", "1", "--images-first")
    assert args.encoder_placement == "shared" and args.encoder_threads == 1 and args.images_first
    with pytest.raises(SystemExit):
        parse("--encoder-placement", "beside")


def test_epd_configuration_and_long_mixed_workload_flags():
    args = parse("--configs", "disagg,epd", "--prefills", "1", "--decodes", "2", "--workload", "long-mixed")
    assert (args.configs, args.prefills, args.decodes, args.workload) == ("disagg,epd", 1, 2, "long-mixed")
    assert parse().prefills == 0 and parse().decodes == 0


def test_lists_parse_and_bad_lists_are_refused():
    args = parse("--rates", "0.5,1,2", "--cores", "0,1")
    assert args.rates == (0.5, 1.0, 2.0) and args.cores == (0, 1)
    for bad in (["--rates", "fast"], ["--rates", "1,-2"], ["--cores", "a"]):
        with pytest.raises(SystemExit):
            parse(*bad)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--configs", "monolith"], "unknown configuration"),
        (["--max-tokens", "1"], "--max-tokens must be >= 2"),
        (["--num-requests", "0"], "must be >= 1"),
        (["--slo-tpot-ms", "-1"], "must be >= 0"),
        (["--cores", "0", "--configs", "disagg"], "at least 2 cores"),
        (["--encoder-threads", "-1", "--configs", "disagg"], "encoder threads"),
        (["--cores", "0,1", "--configs", "epd"], "--encoder-placement shared"),
    ],
)
def test_usage_errors_exit_2_before_starting_anything(flags, message, tmp_path, capsys):
    assert serve.run(parse(*flags, "--out", str(tmp_path / "out"))) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_an_existing_checkpoint_directory_is_used_as_is(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vision_config": {"image_size": 48}}))
    assert serve._model_dir(str(tmp_path)) == str(tmp_path.resolve())
    assert serve._image_size(str(tmp_path)) == 48
    assert serve._image_size(str(tmp_path / "missing")) == 336


def test_the_video_workload_needs_a_qwen_model(tmp_path, capsys):
    llava = tmp_path / "llava"
    llava.mkdir()
    (llava / "config.json").write_text(json.dumps({"model_type": "llava"}))
    assert serve.run(parse("--workload", "video", "--model", str(llava), "--out", str(tmp_path / "out"))) == 2
    assert "needs a Qwen2-VL family model" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    assert serve._model_type(str(tmp_path / "missing")) == ""
