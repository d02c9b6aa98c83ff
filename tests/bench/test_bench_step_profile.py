"""``python -m services.bench.step_profile`` on CPU: every section runs and lands in its summary.

Its figures matter on a GPU (deploy/gpu/measure.sh); here it proves the tool
(the engine driven step by step, the profiler tables, the encoder timing).
No timing is asserted.
"""

from __future__ import annotations

import json

from services.bench import step_profile


def test_step_profile_times_decode_steps_a_mixed_step_and_the_encoder(tiny_model_dir, tmp_path):
    out = tmp_path / "profile"
    argv = ["--model", str(tiny_model_dir), "--batches", "1,3", "--steps", "2", "--mixed-prompt", "40"]
    assert step_profile.main([*argv, "--encoder-batch", "2", "--image-size", "64", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert [d["batch"] for d in summary["decode"]] == [1, 3]
    assert all(d["step_ms_p50"] > 0 and "profile" in d for d in summary["decode"])
    assert summary["mixed"]["batch"] == 2  # one row of --max-num-seqs left for the prefilled request
    assert summary["mixed"]["mixed_step_ms"]
    assert summary["encoder"]["batch2"]["images_s"] > 0
    names = sorted(p.name for p in out.glob("profile-*.txt"))
    assert names == ["profile-decode-b1.txt", "profile-decode-b3.txt", "profile-mixed-b2.txt"]
    assert "Self CPU" in (out / "profile-decode-b1.txt").read_text()


def test_sections_can_be_left_out(tiny_model_dir, tmp_path):
    out = tmp_path / "decode-only"
    argv = ["--model", str(tiny_model_dir), "--batches", "2", "--steps", "2", "--block-size", "32"]
    assert step_profile.main([*argv, "--no-profile", "--no-mixed", "--no-encoder", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["block_size"] == 32 and "mixed" not in summary and "encoder" not in summary
    assert not list(out.glob("profile-*.txt"))
