"""Builds a PD instance (model, caches, scheduler, engine) and serves it over gRPC."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch

from services.common import grpc_utils, host_memory, image_files, openmp, push_wire, tensors
from services.common.devices import exact_float32, resolve_device, resolve_dtype
from services.common.metrics_http import MetricsHttpServer
from services.common.models import ensure_model, load_adapter
from services.common.watchdog import Probe, set_alive, watch_engine
from services.pd import faults
from services.pd.bridge import EngineBridge
from services.pd.cache_feed import CacheFeed
from services.pd.colocated import Colocated
from services.pd.config import PdConfig
from services.pd.engine.core import EngineCore
from services.pd.engine.embedding_cache import EmbeddingCache
from services.pd.engine.engine_stats import EngineStats
from services.pd.engine.errors import EngineError, ErrorKind
from services.pd.engine.kv_cache import KVCacheManager
from services.pd.engine.kv_handoff import ReservationLimits, Role
from services.pd.engine.preallocated import PreallocationLimits
from services.pd.engine.request import Request, SamplingParams
from services.pd.engine.scheduler import Scheduler, SchedulerConfig
from services.pd.engine.step_budget import BudgetConfig, StepBudget
from services.pd.metrics import PdMetrics
from services.pd.runner.decode_plan import StaticDecodeConfig
from services.pd.runner.grammar import (
    MISSING_EXTRA_MESSAGE,
    CompileLimits,
    GrammarCompiler,
    structured_outputs_installed,
)
from services.pd.runner.kv_sizing import CudaMemoryReader, size_kv_cache
from services.pd.runner.model_runner import ModelRunner
from services.pd.servicer import PrefillDecodeServicer
from services.pd.shared_cores import yield_cores_to_encoder
from services.pd.step_calibration import calibrate_step_time, generate

log = logging.getLogger(__name__)

SERVICE_NAME = "epd.v1.PrefillDecode"


@dataclass
class PdServer:
    """A running PD instance: its gRPC server and its engine."""

    grpc: grpc_utils.GrpcServer
    engine: EngineBridge
    config: PdConfig
    colocated: Colocated | None = None  # the in-process encoder of ``--encoder local``
    watchdog: asyncio.Task | None = None  # readiness and liveness (services/pd/watchdog.py)
    engine_dead: asyncio.Event = field(default_factory=asyncio.Event)  # set once if the engine thread dies
    metrics_http: MetricsHttpServer | None = None  # ``GET /metrics`` (services/pd/metrics.py), when enabled
    servicer: PrefillDecodeServicer | None = None  # refuses new work while draining

    @property
    def port(self) -> int:
        return self.grpc.port

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.grpc.port}"

    async def stop(self, grace: float | None = None) -> None:
        """Drains, then stops; all within ``grace`` seconds (default ``config.grace_s``).

        NOT_SERVING -> new Preallocate/Generate refused with UNAVAILABLE (the
        proxy tries another PD) -> requests already admitted run to the end,
        their embedding pushes still accepted -> the gRPC server stops (calls
        still open get what is left of ``grace``) -> the engine stops,
        failing whatever is left with UNAVAILABLE.
        """
        grace = self.config.grace_s if grace is None else grace
        deadline = time.monotonic() + grace
        if self.watchdog is not None:
            self.watchdog.cancel()  # it must not report ready again while stopping
        if self.colocated is not None:
            await self.colocated.set_ready(self.grpc, False)
        await self.grpc.set_ready(False)
        if self.servicer is not None:
            self.servicer.draining = True
            if self.servicer.cache_feed is not None:
                self.servicer.cache_feed.close()  # its streams never end by themselves
        if grace > 0:
            await self._wait_idle(deadline)
        await self.grpc.stop(max(0.0, deadline - time.monotonic()))
        await asyncio.to_thread(self.engine.shutdown)
        if self.servicer is not None:
            await self.servicer.kv.close()
            if self.servicer.grammars is not None:  # its compile thread and process
                await asyncio.to_thread(self.servicer.grammars.shutdown)
        if self.metrics_http is not None:  # last: a scrape can still see the drain
            await self.metrics_http.stop()

    async def _wait_idle(self, deadline: float, poll_s: float = 0.05) -> None:
        """Waits until nothing is running, queued, reserved or pinned, or until ``deadline``."""
        started = time.monotonic()
        stats = None
        while time.monotonic() < deadline:
            try:
                stats = await self.engine.stats()
            except EngineError:
                return  # the engine is gone: nothing left to wait for
            if stats.is_idle:
                log.info("drained in %.1fs", time.monotonic() - started)
                return
            await asyncio.sleep(poll_s)
        log.warning("grace period over with work left (%s); stopping anyway", _held(stats))

    async def stats(self) -> EngineStats:
        return await self.engine.stats()


def _held(stats: EngineStats | None) -> str:
    """What keeps a drain from ending, for its log line."""
    if stats is None:
        return "unknown"
    return (
        f"live={stats.num_live_requests} reservations={stats.num_reservations} "
        f"kv_leases={stats.num_kv_leases} referenced_tokens={stats.referenced_tokens}"
    )


def _describe_target(setting_ms: float | None, measured_s: float) -> str:
    """An SLO flag for the ready line; auto shows the target the warm-up's measured steps gave."""
    if setting_ms is None:
        return f"auto({measured_s * 1000:.1f}ms)" if measured_s else "auto"
    return f"{setting_ms:g}ms" if setting_ms else "off"


def _step_budget(config: PdConfig) -> StepBudget:
    """The step budget of ``config``'s caps and SLO targets."""

    def seconds(ms: float | None) -> float | None:
        return None if ms is None else ms / 1000.0

    return StepBudget(
        BudgetConfig(
            config.max_num_batched_tokens,
            target_itl_s=seconds(config.slo_itl_ms),
            min_prefill_tokens=config.min_prefill_tokens,
            target_ttft_s=seconds(config.slo_ttft_ms),
        )
    )


def _describe_paths(paths: dict[str, bool]) -> str:
    """The decode paths in use for the ready line, e.g. ``static_decode+flex_kernel+cuda_graphs``, or ``packed``."""
    return "+".join(name for name, used in paths.items() if used) or "packed"


def max_receive_bytes(config: PdConfig, max_model_len: int) -> int:
    """The largest message PD's methods take: a push chunk, or a prompt of the whole context
    (at most 5 bytes per token id) with its items and stop strings. A colocated PD also serves
    Encode, whose image file is bounded as on an encoder (its default ``--max-message-mib``)."""
    prompt = 5 * max_model_len + 128 * config.max_items_per_request + 64 * 1024
    encode = image_files.MAX_FILE_BYTES + image_files.ENCODE_ENVELOPE_BYTES if config.encoder == "local" else 0
    return max(2 * tensors.CHUNK_BYTES, prompt, encode)


def build_engine(config: PdConfig) -> tuple[EngineBridge, dict]:
    """Loads the LM half of the checkpoint and wires the engine core and its thread; returns them with model facts."""
    adapter = load_adapter(str(ensure_model(config.model)))
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    if config.threads > 0:
        torch.set_num_threads(config.threads)
    host_memory.keep_freed_memory()  # a step's activations stay mapped for the next step
    exact_float32(device, dtype)
    memory = CudaMemoryReader(device) if device.type == "cuda" else None  # before the weights: what others use
    model = adapter.load_language_model(device, dtype)
    tokenizer = adapter.load_tokenizer()
    max_model_len = config.max_model_len or adapter.max_model_len
    sizing = size_kv_cache(config, model, device, dtype, max_model_len, memory)
    num_blocks = sizing.num_blocks
    log.info(
        "KV cache: %d blocks of %d = %d tokens (%s)", num_blocks, config.block_size, sizing.num_tokens, sizing.source
    )
    runner = ModelRunner(
        model,
        num_blocks=num_blocks,
        block_size=config.block_size,
        device=device,
        dtype=dtype,
        linear_backend=config.linear_backend,
        static_decode=StaticDecodeConfig(
            cuda_graphs=not config.enforce_eager, max_num_seqs=config.max_num_seqs, max_model_len=max_model_len
        ),
    )
    embedding_cache = EmbeddingCache(config.embedding_cache_tokens)
    kv_cache = KVCacheManager(num_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching)
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            max_model_len=max_model_len,
            max_waiting_requests=config.max_waiting_requests,
            max_waiting_tokens=config.max_waiting_tokens,
            retry_after_s=config.waiting_retry_after_ms / 1000.0,
            share_prefill_with_queue=True,
        ),
        kv_cache,
        embedding_cache,
    )
    core = EngineCore(
        scheduler=scheduler,
        runner=runner,
        tokenizer=tokenizer,
        hidden_size=adapter.hidden_size,
        lease_sweep_interval_s=config.lease_sweep_interval_s,
        step_budget=_step_budget(config),
        preallocation_limits=PreallocationLimits(config.max_preallocations, config.max_preallocations_per_peer),
        role=Role(config.role),
        reservation_limits=ReservationLimits(config.max_kv_reservation_share),
        num_deepstack_levels=adapter.num_deepstack_levels,
    )
    _log_embedding_cache(config, adapter, dtype)
    # The engine thread runs the model with the thread count chosen here.
    engine = EngineBridge(core, thread_init=functools.partial(torch.set_num_threads, torch.get_num_threads()))
    facts = {
        "eos_token_ids": adapter.eos_token_ids,
        "vocab_size": int(model.config.vocab_size),
        "max_model_len": max_model_len,
        "uses_mrope": adapter.uses_mrope,
        "tokens_per_second": adapter.tokens_per_second,
        "model_id": adapter.model_id,
        "num_kv_blocks": num_blocks,
        "num_cuda_graphs": runner.static_decoder.num_graphs if runner.static_decoder is not None else 0,
        "decode_paths": runner.decode_paths(),
        "linear_backend": runner.linear_backend,
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        # Structured outputs: constraints compiled for this tokenizer and LM head (runner/grammar.py);
        # None without the optional xgrammar, whose absence refuses only constrained requests.
        "grammars": _grammar_compiler(
            tokenizer,
            int(model.config.vocab_size),
            adapter.eos_token_ids,
            CompileLimits(
                config.grammar_compile_timeout_s, config.max_pending_grammar_compiles, config.grammar_cache_mb << 20
            ),
        ),
    }
    return engine, facts


def _log_embedding_cache(config: PdConfig, adapter: Any, dtype: torch.dtype) -> None:
    """The embedding cache's size in bytes: rows of ``hidden_size``, times ``1 + levels`` with DeepStack features."""
    row_bytes = (1 + adapter.num_deepstack_levels) * adapter.hidden_size * torch.empty((), dtype=dtype).element_size()
    log.info(
        "embedding cache: %d rows of %d bytes (%d DeepStack levels) = %.1f MiB at most",
        config.embedding_cache_tokens,
        row_bytes,
        adapter.num_deepstack_levels,
        config.embedding_cache_tokens * row_bytes / (1 << 20),
    )


def _grammar_compiler(
    tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...], limits: CompileLimits
) -> GrammarCompiler | None:
    """The structured-output compiler, or None (logged once) where the ``structured`` extra is not installed."""
    if not structured_outputs_installed():
        log.warning("structured outputs are off: xgrammar is not installed (%s)", MISSING_EXTRA_MESSAGE)
        return None
    return GrammarCompiler(tokenizer, vocab_size=vocab_size, stop_token_ids=eos_token_ids, limits=limits)


_WARM_UP_PROMPT = tuple(range(1, 41))  # two full 16-token KV blocks and a tail: its repeat hits the prefix cache


async def warm_up(engine: EngineBridge, every_path: bool = False) -> None:
    """Generates through the engine before ready, then seeds the step-time model
    (``step_calibration.py``); raises if the engine cannot.

    One greedy token first. ``every_path`` (on CUDA) also runs each kind of
    step a request can take, so that none meets a cold kernel after ready:
    greedy decodes (the static decode step), a sampled request with top-k,
    top-p, a seed and logprobs, then a repeat of the prompt that hits the
    prefix cache (a prefill over cached context).
    """
    greedy = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    if every_path:
        greedy = dataclasses.replace(greedy, max_tokens=3)
        sampled = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=1, logprobs=2, max_tokens=3, ignore_eos=True)
        prompt = list(_WARM_UP_PROMPT)
        await asyncio.gather(
            generate(engine, _warm_up_request(prompt, greedy)),
            generate(engine, _warm_up_request(prompt[::-1], sampled)),
        )
        await generate(engine, _warm_up_request(prompt, greedy))
    else:
        await generate(engine, _warm_up_request([1, 2, 3], greedy))
    await calibrate_step_time(engine)


def _warm_up_request(prompt: list[int], sampling: SamplingParams) -> Request:  # no EOS ids: runs to max_tokens
    return Request(request_id=f"warmup-{uuid.uuid4().hex}", prompt_token_ids=prompt, sampling=sampling)


async def start_pd(config: PdConfig) -> PdServer:
    """Loads the model, starts the engine and the gRPC server, warms up, then reports ready."""
    engine, facts = await asyncio.to_thread(openmp.on_own_thread, build_engine, config)
    colocated = await Colocated.load(config, engine) if config.encoder == "local" else None  # before engine.start()
    if colocated is None and engine.core.runner.device.type == "cpu":  # an encoder computes beside it
        yield_cores_to_encoder(engine, max_hold_period_s=config.image_hold_s)
    cache_feed = CacheFeed(engine, max_subscribers=config.max_cache_subscribers)  # hooks the loop: before start
    engine.start()
    servicer = PrefillDecodeServicer(
        engine,
        config,
        eos_token_ids=facts["eos_token_ids"],
        vocab_size=facts["vocab_size"],
        max_model_len=facts["max_model_len"],
        uses_grids=facts["uses_mrope"],
        grammars=facts["grammars"],
        tokens_per_second=facts["tokens_per_second"],
        cache_feed=cache_feed,
    )

    def register(grpc_server) -> None:
        push_wire.add_prefill_decode_servicer(servicer, grpc_server)
        if colocated is not None:
            colocated.register(grpc_server)  # epd.v1.Encoder on this same port

    server = await grpc_utils.start_server(
        config.host,
        config.port,
        SERVICE_NAME,
        register,
        security=config.security,
        max_receive_bytes=max_receive_bytes(config, facts["max_model_len"]),
    )
    metrics_http = None
    try:
        if config.metrics_port >= 0:
            metrics_http = await PdMetrics(
                engine, decode_paths=facts["decode_paths"], transfer=servicer.kv.stats
            ).serve(config.metrics_host or config.host, config.metrics_port, token=config.security.metrics_token)
        if config.warmup:
            await warm_up(engine, every_path=facts["device"].startswith("cuda"))
        if colocated is not None:
            await colocated.become_ready(server, warm_up=config.warmup)
        budget = (await engine.stats()).budget
        targets = (
            f"slo_itl={_describe_target(config.slo_itl_ms, budget.itl_target_s)} "
            f"slo_ttft={_describe_target(config.slo_ttft_ms, budget.ttft_target_s)}"
        )
    except (TimeoutError, RuntimeError, EngineError, OSError):
        if metrics_http is not None:
            await metrics_http.stop()
        await server.stop(0)
        engine.shutdown()
        raise
    if config.faults.enabled:  # after warm-up, so that step 0 is the first client step
        await engine.call(faults.install, engine.core, config.faults)
        log.warning("FAULT INJECTION ENABLED (test only): %s", config.faults.describe())
    await server.set_ready(True)
    log.info(
        "pd ready on %s:%d model=%s device=%s dtype=%s eos_ids=%s kv_blocks=%d cuda_graphs=%d decode_paths=%s %s",
        config.host,
        server.port,
        facts["model_id"],
        facts["device"],
        facts["dtype"],
        ",".join(map(str, facts["eos_token_ids"])) or "none",
        facts["num_kv_blocks"],
        facts["num_cuda_graphs"],
        _describe_paths(facts["decode_paths"]),
        targets,
    )
    pd = PdServer(
        grpc=server, engine=engine, config=config, colocated=colocated, servicer=servicer, metrics_http=metrics_http
    )
    pd.watchdog = asyncio.create_task(
        watch_engine(
            engine,
            [
                Probe("ready", server.set_ready, config.stall_timeout_s),
                Probe("alive", functools.partial(set_alive, server), config.liveness_timeout_s),
            ],
            on_dead=pd.engine_dead.set,
        )
    )
    return pd


__all__ = ["PdServer", "SERVICE_NAME", "build_engine", "start_pd", "warm_up", "ErrorKind"]
