"""Which processes each benchmarked configuration runs, and on which cores (pure; no processes here).

Every configuration gets the same cores. Each encoder and PD is pinned to
its own contiguous group of cores and runs as many torch threads as it has
cores; groups are as even as possible, extra cores going to the later
groups (PDs in the disaggregated layout). The proxy is pinned too: it
cannot have a core of its own without taking one from the model servers,
so it shares ``proxy_core`` (default: the first core) with whichever
server is pinned there, and the layout says so in ``notes``.

- ``colocated`` (a): one PD that encodes in its own step loop, on all cores.
- ``replicas`` (b): K colocated PDs, data-parallel, one core group each.
- ``disagg`` (c): E encoders + P PDs splitting the cores (``own`` placement),
  or P PDs splitting the cores with the E encoders pinned over them
  (``shared`` placement: the kernel time-slices an encode against the decode
  steps on that core instead of the encode blocking a step loop).
- ``epd`` (d): E+P+D, the same encoders with the PD cores split between
  prefill PDs (``epd pd --role prefill``) and decode PDs (``--role decode``);
  prefill PDs push the KV of each finished prefill to a decode PD. ``own``
  placement: E + P + D groups of cores (needs that many cores); ``shared``:
  P and D split the cores and the encoders are pinned over the *prefill*
  cores only, so that neither an encode nor a long prefill ever shares a
  core with the decode steps (that separation is what E+P+D is for).
"""

from __future__ import annotations

from dataclasses import dataclass

CONFIG_NAMES = ("colocated", "replicas", "disagg", "epd")
"""In report order; ratios are taken against ``disagg`` (E+PD, the configuration ``epd`` is compared with)."""

DEFAULT_CONFIGS = ("colocated", "replicas", "disagg")
"""What ``epd bench serve`` runs without ``--configs``: ``epd`` is opt-in (with encoders on cores of their
own it needs three cores, and it answers a different question: E+P+D against E+PD)."""

REPLICA_PROXY_MODES = ("per-replica", "shared")

ENCODER_PLACEMENTS = ("own", "shared")
"""(c): encoders on cores of their own, or pinned over the PDs' cores."""


@dataclass(frozen=True)
class ProcessSpec:
    """One process of a configuration."""

    name: str  # "pd-0", "prefill-0", "decode-0", "encoder-0", "proxy-0"
    role: str  # "pd" | "encoder" | "proxy"
    cores: tuple[int, ...]  # CPU ids it is pinned to
    threads: int  # torch intra-op threads (proxy: preprocessing threads)
    encoder_local: bool = False  # PD only: ``--encoder local`` (colocated)
    pd_names: tuple[str, ...] = ()  # proxy only: the PDs it routes new requests to (E+P+D: the prefill PDs)
    encoder_names: tuple[str, ...] = ()  # proxy only: its encoder services (a colocated PD serves its own)
    pd_role: str = "both"  # PD only: ``epd pd --role`` (both | prefill | decode)
    decode_names: tuple[str, ...] = ()  # proxy only, E+P+D: the decode PDs (``epd proxy --decode``)
    # Encoder: the PDs it may push embeddings to (``--pd-allow``); prefill PD: the decode PDs it
    # may push KV to (``--decode-allow``). Empty = the services' loopback-only default.
    push_to: tuple[str, ...] = ()


@dataclass(frozen=True)
class Topology:
    """One configuration: its processes and what a reader must know about their placement."""

    name: str
    label: str
    processes: tuple[ProcessSpec, ...]
    notes: tuple[str, ...] = ()

    @property
    def proxies(self) -> tuple[ProcessSpec, ...]:
        return tuple(p for p in self.processes if p.role == "proxy")

    @property
    def servers(self) -> tuple[ProcessSpec, ...]:
        """Encoders and PDs (started before the proxies)."""
        return tuple(p for p in self.processes if p.role != "proxy")


@dataclass(frozen=True)
class LayoutConfig:
    """The knobs of ``build_topologies`` (from the command line)."""

    cores: tuple[int, ...]
    replicas: int = 0  # 0 = one per core
    encoders: int = 0  # 0 = max(1, cores // 4)
    pds: int = 0  # 0 = the remaining cores, one PD each
    proxy_core: int | None = None  # None = the first core
    proxy_threads: int = 1
    replica_proxy: str = "shared"
    encoder_placement: str = "own"
    encoder_threads: int = 0  # 0 = one per core it is pinned to
    prefills: int = 0  # (d): prefill PDs (0 = 1)
    decodes: int = 0  # (d): decode PDs (0 = 1)


def split_cores(cores: tuple[int, ...], num_groups: int) -> list[tuple[int, ...]]:
    """``cores`` cut into ``num_groups`` contiguous groups, sizes differing by at most one (larger last)."""
    if num_groups < 1:
        raise ValueError("need at least one group")
    if num_groups > len(cores):
        raise ValueError(f"{num_groups} processes need at least {num_groups} cores, have {len(cores)}")
    base, extra = divmod(len(cores), num_groups)
    sizes = [base + (1 if i >= num_groups - extra else 0) for i in range(num_groups)]
    groups, start = [], 0
    for size in sizes:
        groups.append(tuple(cores[start : start + size]))
        start += size
    return groups


def default_encoders(num_cores: int) -> int:
    """vLLM's published ratio, 1 encoder per 3 PDs, with at least one encoder."""
    return max(1, num_cores // 4)


def build_topologies(config: LayoutConfig, names: tuple[str, ...] = DEFAULT_CONFIGS) -> dict[str, Topology]:
    """The requested configurations, in ``CONFIG_NAMES`` order; ValueError when a layout cannot fit."""
    cores = tuple(config.cores)
    if not cores:
        raise ValueError("no cores to run on")
    proxy_core = cores[0] if config.proxy_core is None else config.proxy_core
    if proxy_core not in cores:
        raise ValueError(f"proxy core {proxy_core} is not one of the benchmark cores {list(cores)}")
    builders = {"colocated": _colocated, "replicas": _replicas, "disagg": _disagg, "epd": _epd}
    unknown = [n for n in names if n not in builders]
    if unknown:
        raise ValueError(f"unknown configuration(s): {', '.join(unknown)}; choose from {', '.join(CONFIG_NAMES)}")
    return {n: builders[n](config, cores, proxy_core) for n in CONFIG_NAMES if n in names}


def _proxy(
    name: str,
    core: int,
    threads: int,
    pds: list[ProcessSpec],
    encoders: list[ProcessSpec],
    decodes: list[ProcessSpec] | None = None,
) -> ProcessSpec:
    return ProcessSpec(
        name=name,
        role="proxy",
        cores=(core,),
        threads=threads,
        pd_names=tuple(p.name for p in pds),
        encoder_names=tuple(e.name for e in encoders),
        decode_names=tuple(d.name for d in decodes or ()),
    )


def _colocated(config: LayoutConfig, cores: tuple[int, ...], proxy_core: int) -> Topology:
    pd = ProcessSpec("pd-0", "pd", cores, len(cores), encoder_local=True)
    proxy = _proxy("proxy-0", proxy_core, config.proxy_threads, [pd], [pd])
    label = f"(a) colocated: 1 PD encoding in its loop, {len(cores)} cores"
    return _with_notes(Topology("colocated", label, (pd, proxy)))


def _replicas(config: LayoutConfig, cores: tuple[int, ...], proxy_core: int) -> Topology:
    if config.replica_proxy not in REPLICA_PROXY_MODES:
        raise ValueError(f"replica proxy mode must be one of {', '.join(REPLICA_PROXY_MODES)}")
    count = config.replicas or len(cores)
    groups = split_cores(cores, count)
    pds = [ProcessSpec(f"pd-{i}", "pd", group, len(group), encoder_local=True) for i, group in enumerate(groups)]
    if config.replica_proxy == "shared":
        proxies = [_proxy("proxy-0", proxy_core, config.proxy_threads, pds, pds)]
    else:
        # One proxy per replica, on its replica's first core; the client balances
        # over them (least outstanding requests), as a data-parallel front end would.
        proxies = [_proxy(f"proxy-{i}", pd.cores[0], config.proxy_threads, [pd], [pd]) for i, pd in enumerate(pds)]
    label = f"(b) replicas: {count} colocated PDs x {len(groups[0])}-{len(groups[-1])} cores, data-parallel"
    extra: tuple[str, ...] = ()
    if config.replica_proxy == "per-replica":
        extra = (
            (
                "one proxy per replica; the benchmark client sends each request to the proxy with the fewest "
                "requests in flight"
            ),
        )
    return _with_notes(Topology("replicas", label, (*pds, *proxies)), extra)


def _check_encoder_settings(config: LayoutConfig) -> None:
    if config.encoder_placement not in ENCODER_PLACEMENTS:
        raise ValueError(f"encoder placement must be one of {', '.join(ENCODER_PLACEMENTS)}")
    if config.encoder_threads < 0:
        raise ValueError("encoder threads must be >= 0")


def _disagg(config: LayoutConfig, cores: tuple[int, ...], proxy_core: int) -> Topology:
    _check_encoder_settings(config)
    num_encoders = config.encoders or default_encoders(len(cores))
    if config.encoder_placement == "shared":
        num_pds = config.pds or len(cores)
        encoder_groups = split_cores(cores, num_encoders)
        pd_groups = split_cores(cores, num_pds)
    else:
        num_pds = config.pds or max(1, len(cores) - num_encoders)
        groups = split_cores(cores, num_encoders + num_pds)
        encoder_groups, pd_groups = groups[:num_encoders], groups[num_encoders:]
    pds = [ProcessSpec(f"pd-{j}", "pd", g, len(g)) for j, g in enumerate(pd_groups)]
    encoders = [
        ProcessSpec(f"encoder-{i}", "encoder", g, config.encoder_threads or len(g), push_to=tuple(p.name for p in pds))
        for i, g in enumerate(encoder_groups)
    ]
    proxy = _proxy("proxy-0", proxy_core, config.proxy_threads, pds, encoders)
    label = f"(c) disaggregated: {num_encoders}E + {num_pds}PD on {len(cores)} cores"
    extra: tuple[str, ...] = ()
    if config.encoder_placement == "shared":
        label += ", encoders over the PD cores"
        extra = ("encoders are pinned over the PDs' cores: the kernel time-slices image encoding against decode steps",)
    return _with_notes(Topology("disagg", label, (*encoders, *pds, proxy)), extra)


def _epd(config: LayoutConfig, cores: tuple[int, ...], proxy_core: int) -> Topology:
    """(d) E+P+D: encoders, prefill PDs and decode PDs, each group on cores of its own where it can be.

    With ``shared`` placement the encoders go over the prefill cores and not
    over the decode cores: an encoder's only consumer is a prefill PD, and
    keeping every compute burst (encode, long prefill) off the decode cores
    is the point of splitting prefill from decode. On two cores that is
    1 prefill PD + encoders on one core, 1 decode PD on the other.
    """
    _check_encoder_settings(config)
    if config.prefills < 0 or config.decodes < 0:
        raise ValueError("prefill and decode PD counts must be >= 0")
    num_encoders = config.encoders or default_encoders(len(cores))
    num_prefills, num_decodes = config.prefills or 1, config.decodes or 1
    num_pds = num_prefills + num_decodes
    if config.encoder_placement == "shared":
        pd_groups = split_cores(cores, num_pds)
        prefill_cores = tuple(c for g in pd_groups[:num_prefills] for c in g)
        if num_encoders > len(prefill_cores):
            raise ValueError(
                f"{num_encoders} encoders pinned over the prefill cores need at least {num_encoders} prefill cores, "
                f"have {len(prefill_cores)}"
            )
        encoder_groups = split_cores(prefill_cores, num_encoders)
    else:
        if num_encoders + num_pds > len(cores):
            raise ValueError(
                f"E+P+D with encoders on cores of their own needs {num_encoders + num_pds} cores "
                f"({num_encoders}E + {num_prefills}P + {num_decodes}D), have {len(cores)}; "
                "use --encoder-placement shared (encoders over the prefill cores)"
            )
        # Extra cores go to the later groups (split_cores): the decode PDs get them first.
        groups = split_cores(cores, num_encoders + num_pds)
        encoder_groups, pd_groups = groups[:num_encoders], groups[num_encoders:]
    decodes = [
        ProcessSpec(f"decode-{k}", "pd", g, len(g), pd_role="decode") for k, g in enumerate(pd_groups[num_prefills:])
    ]
    prefills = [
        ProcessSpec(f"prefill-{j}", "pd", g, len(g), pd_role="prefill", push_to=tuple(d.name for d in decodes))
        for j, g in enumerate(pd_groups[:num_prefills])
    ]
    encoders = [
        ProcessSpec(
            f"encoder-{i}", "encoder", g, config.encoder_threads or len(g), push_to=tuple(p.name for p in prefills)
        )
        for i, g in enumerate(encoder_groups)
    ]
    proxy = _proxy("proxy-0", proxy_core, config.proxy_threads, prefills, encoders, decodes)
    label = f"(d) E+P+D: {num_encoders}E + {num_prefills}P + {num_decodes}D on {len(cores)} cores"
    extra: tuple[str, ...] = ()
    if config.encoder_placement == "shared":
        label += ", encoders over the prefill cores"
        extra = (
            "encoders are pinned over the prefill PDs' cores only: encodes and prefills time-slice one core group, "
            "the decode PDs' cores only decode",
        )
    return _with_notes(Topology("epd", label, (*encoders, *prefills, *decodes, proxy)), extra)


def _with_notes(topology: Topology, extra: tuple[str, ...] = ()) -> Topology:
    """Adds a note for every proxy that shares a core with a model server."""
    notes = list(extra)
    for proxy in topology.proxies:
        sharing = [s.name for s in topology.servers if set(s.cores) & set(proxy.cores)]
        if sharing:
            notes.append(
                f"{proxy.name} is pinned to core {','.join(map(str, proxy.cores))}, shared with {', '.join(sharing)}"
            )
    return Topology(topology.name, topology.label, topology.processes, tuple(notes))
