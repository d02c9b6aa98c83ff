"""The start-up warm-up: one greedy token, or (as on CUDA) every kind of step before ready."""

from __future__ import annotations

from cluster_support import pd_config

from services.pd import step_calibration as calibration
from services.pd.server import build_engine, warm_up


async def test_warm_up_of_every_path_runs_decodes_sampling_and_a_prefix_hit(tiny_model_dir):
    engine, _ = build_engine(pd_config(str(tiny_model_dir)))
    engine.start()
    try:
        await warm_up(engine, every_path=True)
        stats = await engine.stats()
    finally:
        engine.shutdown()
    calibrated = (
        calibration.NUM_PASSES
        * (len(calibration.PROMPT_LENGTHS) + calibration.BATCH_SIZE)
        * calibration.NUM_OUTPUT_TOKENS
    )  # then the step-time calibration's requests
    assert stats.steps.num_generation_tokens == 9 + calibrated  # three requests of three tokens
    assert stats.num_prefix_hit_tokens == 32  # the repeat's two full blocks
    assert stats.is_idle and stats.num_kv_blocks_used == 0
