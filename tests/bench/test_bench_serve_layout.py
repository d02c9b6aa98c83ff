"""``epd bench serve`` layouts: the same cores for every configuration, explicit pinning, proxy placement."""

from __future__ import annotations

import pytest

from services.bench.serve.layout import LayoutConfig, build_topologies, split_cores
from services.bench.serve.procs import Cluster, ServiceArgs, child_env


def test_split_cores_is_contiguous_and_even_with_extra_cores_last():
    assert split_cores((0, 1), 2) == [(0,), (1,)]
    assert split_cores((0, 1, 2, 3, 4), 2) == [(0, 1), (2, 3, 4)]
    assert split_cores((4, 5, 6, 7), 1) == [(4, 5, 6, 7)]
    with pytest.raises(ValueError, match="at least 3 cores"):
        split_cores((0, 1), 3)
    with pytest.raises(ValueError):
        split_cores((0, 1), 0)


def test_two_core_defaults_match_the_issue():
    topologies = build_topologies(LayoutConfig(cores=(0, 1)))
    assert list(topologies) == ["colocated", "replicas", "disagg"]
    colocated = {p.name: p for p in topologies["colocated"].processes}
    assert colocated["pd-0"].cores == (0, 1) and colocated["pd-0"].threads == 2 and colocated["pd-0"].encoder_local
    replicas = {p.name: p for p in topologies["replicas"].processes}
    assert [replicas[n].cores for n in ("pd-0", "pd-1")] == [(0,), (1,)]
    # One proxy in front of both replicas (as the issue's baseline asks).
    assert replicas["proxy-0"].cores == (0,) and replicas["proxy-0"].pd_names == ("pd-0", "pd-1")
    assert "proxy-1" not in replicas
    per_replica = build_topologies(LayoutConfig(cores=(0, 1), replica_proxy="per-replica"), ("replicas",))
    per_replica = {p.name: p for p in per_replica["replicas"].processes}
    assert per_replica["proxy-1"].cores == (1,) and per_replica["proxy-1"].pd_names == ("pd-1",)
    disagg = {p.name: p for p in topologies["disagg"].processes}
    assert disagg["encoder-0"].cores == (0,) and disagg["pd-0"].cores == (1,)
    assert not disagg["pd-0"].encoder_local
    assert disagg["proxy-0"].cores == (0,) and disagg["proxy-0"].encoder_names == ("encoder-0",)
    # Every configuration uses exactly the same cores, and the sharing proxy is said out loud.
    for topology in topologies.values():
        assert {c for p in topology.servers for c in p.cores} == {0, 1}
        assert any("shared with" in note for note in topology.notes)


def test_larger_machines_follow_vllms_one_encoder_per_three_pds():
    topologies = build_topologies(LayoutConfig(cores=(0, 1, 2, 3)), ("disagg", "replicas"))
    assert list(topologies) == ["replicas", "disagg"]
    disagg = topologies["disagg"]
    assert [p.name for p in disagg.servers] == ["encoder-0", "pd-0", "pd-1", "pd-2"]
    shared = build_topologies(LayoutConfig(cores=(0, 1, 2, 3), replicas=2, replica_proxy="shared"), ("replicas",))
    proxies = shared["replicas"].proxies
    assert len(proxies) == 1 and proxies[0].pd_names == ("pd-0", "pd-1") == proxies[0].encoder_names


def test_shared_placement_pins_encoders_over_one_pd_per_core():
    config = LayoutConfig(cores=(0, 1), encoder_placement="shared", encoder_threads=1)
    disagg = {p.name: p for p in build_topologies(config, ("disagg",))["disagg"].processes}
    assert [disagg[n].cores for n in ("pd-0", "pd-1")] == [(0,), (1,)]
    assert disagg["encoder-0"].cores == (0, 1) and disagg["encoder-0"].threads == 1
    two = build_topologies(LayoutConfig(cores=(0, 1), encoders=2, encoder_placement="shared"), ("disagg",))["disagg"]
    assert [(p.name, p.cores, p.threads) for p in two.servers] == [
        ("encoder-0", (0,), 1),
        ("encoder-1", (1,), 1),
        ("pd-0", (0,), 1),
        ("pd-1", (1,), 1),
    ]
    assert "encoders over the PD cores" in two.label
    assert any("time-slices" in note for note in two.notes)


def test_layout_errors_are_reported():
    with pytest.raises(ValueError, match="encoder placement"):
        build_topologies(LayoutConfig(cores=(0, 1), encoder_placement="beside"), ("disagg",))
    with pytest.raises(ValueError, match="encoder threads"):
        build_topologies(LayoutConfig(cores=(0, 1), encoder_threads=-1), ("disagg",))
    with pytest.raises(ValueError, match="unknown configuration"):
        build_topologies(LayoutConfig(cores=(0, 1)), ("monolith",))
    with pytest.raises(ValueError, match="proxy core"):
        build_topologies(LayoutConfig(cores=(0, 1), proxy_core=5))
    with pytest.raises(ValueError, match="at least 3 cores"):
        build_topologies(LayoutConfig(cores=(0, 1), encoders=2, pds=1), ("disagg",))
    with pytest.raises(ValueError, match="no cores"):
        build_topologies(LayoutConfig(cores=()))
    with pytest.raises(ValueError, match="replica proxy"):
        build_topologies(LayoutConfig(cores=(0, 1), replica_proxy="nope"), ("replicas",))


def test_command_lines_carry_placement_and_routing(tmp_path):
    topology = build_topologies(LayoutConfig(cores=(0, 1)), ("colocated",))["colocated"]
    service = ServiceArgs(model_dir="/models/x", pd_args=("--max-num-seqs", "8"))
    cluster = Cluster(topology, service, tmp_path)
    argv = {c.spec.name: c.argv for c in cluster.children}
    pd_address = next(c.address for c in cluster.children if c.spec.name == "pd-0")
    assert argv["pd-0"][0] == "pd" and argv["pd-0"][-2:] == ["--max-num-seqs", "8"]
    assert argv["pd-0"][argv["pd-0"].index("--encoder") :][:2] == ["--encoder", "local"]
    assert argv["pd-0"][argv["pd-0"].index("--threads") + 1] == "2"
    proxy = argv["proxy-0"]
    assert proxy[proxy.index("--pd") + 1] == pd_address == proxy[proxy.index("--encoder") + 1]
    assert cluster.proxy_urls[0].startswith("http://127.0.0.1:")


def test_children_get_no_epd_settings_and_fixed_threads(monkeypatch):
    monkeypatch.setenv("EPD_MAX_NUM_SEQS", "1")
    monkeypatch.setenv("EPD_CACHE_DIR", "/tmp/cache")
    env = child_env(3)
    assert "EPD_MAX_NUM_SEQS" not in env and env["EPD_CACHE_DIR"] == "/tmp/cache"
    assert env["OMP_NUM_THREADS"] == "3" and env["MKL_NUM_THREADS"] == "3"


def test_epd_on_two_cores_puts_prefill_and_encoders_on_one_core_and_decode_alone_on_the_other():
    config = LayoutConfig(cores=(0, 1), encoder_placement="shared")
    # Not in the default configurations: it is asked for.
    assert "epd" not in build_topologies(config)
    topology = build_topologies(config, ("epd", "disagg"))
    assert list(topology) == ["disagg", "epd"]
    epd = {p.name: p for p in topology["epd"].processes}
    assert list(epd) == ["encoder-0", "prefill-0", "decode-0", "proxy-0"]
    assert (epd["prefill-0"].cores, epd["prefill-0"].pd_role) == ((0,), "prefill")
    assert (epd["decode-0"].cores, epd["decode-0"].pd_role) == ((1,), "decode")
    # The encoder feeds the prefill PD only, and never shares a core with decoding.
    assert epd["encoder-0"].cores == (0,) and epd["encoder-0"].threads == 1
    assert epd["encoder-0"].push_to == ("prefill-0",) and epd["prefill-0"].push_to == ("decode-0",)
    proxy = epd["proxy-0"]
    assert proxy.pd_names == ("prefill-0",) and proxy.decode_names == ("decode-0",)
    assert proxy.encoder_names == ("encoder-0",) and proxy.cores == (0,)
    assert topology["epd"].label == "(d) E+P+D: 1E + 1P + 1D on 2 cores, encoders over the prefill cores"
    assert any("decode PDs' cores only decode" in note for note in topology["epd"].notes)
    # The same cores as every other configuration.
    assert {c for p in topology["epd"].servers for c in p.cores} == {0, 1}


def test_epd_with_encoders_on_their_own_cores_and_more_prefills_and_decodes():
    topology = build_topologies(LayoutConfig(cores=tuple(range(8)), prefills=2, decodes=2), ("epd",))["epd"]
    servers = [(p.name, p.cores, p.pd_role) for p in topology.servers]
    assert servers == [
        ("encoder-0", (0,), "both"),
        ("encoder-1", (1,), "both"),
        ("prefill-0", (2,), "prefill"),
        ("prefill-1", (3,), "prefill"),
        ("decode-0", (4, 5), "decode"),  # extra cores go to the decode PDs
        ("decode-1", (6, 7), "decode"),
    ]
    by_name = {p.name: p for p in topology.processes}
    assert by_name["encoder-1"].push_to == ("prefill-0", "prefill-1")
    assert by_name["prefill-1"].push_to == ("decode-0", "decode-1")
    assert by_name["proxy-0"].decode_names == ("decode-0", "decode-1")
    # One P and one D by default, splitting what the encoder leaves.
    default = {p.name: p.cores for p in build_topologies(LayoutConfig(cores=(0, 1, 2, 3)), ("epd",))["epd"].servers}
    assert default == {"encoder-0": (0,), "prefill-0": (1,), "decode-0": (2, 3)}


def test_epd_layout_errors_say_what_to_do():
    with pytest.raises(ValueError, match="needs 3 cores .*--encoder-placement shared"):
        build_topologies(LayoutConfig(cores=(0, 1)), ("epd",))
    with pytest.raises(ValueError, match="2 encoders pinned over the prefill cores"):
        build_topologies(LayoutConfig(cores=(0, 1), encoders=2, encoder_placement="shared"), ("epd",))
    with pytest.raises(ValueError, match=">= 0"):
        build_topologies(LayoutConfig(cores=(0, 1), decodes=-1, encoder_placement="shared"), ("epd",))


def test_epd_command_lines_give_roles_allow_lists_and_the_decode_pool(tmp_path):
    topology = build_topologies(LayoutConfig(cores=(0, 1), encoder_placement="shared"), ("epd",))["epd"]
    cluster = Cluster(topology, ServiceArgs(model_dir="/m"), tmp_path)
    address = {c.spec.name: c.address for c in cluster.children}
    argv = {c.spec.name: c.argv for c in cluster.children}

    def flag(name, option):
        args = argv[name]
        return args[args.index(option) + 1] if option in args else None

    assert flag("encoder-0", "--pd-allow") == address["prefill-0"]
    assert (flag("prefill-0", "--role"), flag("prefill-0", "--decode-allow")) == ("prefill", address["decode-0"])
    assert (flag("decode-0", "--role"), flag("decode-0", "--decode-allow")) == ("decode", None)
    assert flag("decode-0", "--encoder") == "remote"
    assert flag("proxy-0", "--pd") == address["prefill-0"] and flag("proxy-0", "--decode") == address["decode-0"]
    assert flag("proxy-0", "--encoder") == address["encoder-0"]
    assert [c.describe()["pd_role"] for c in cluster.children] == [None, "prefill", "decode", None]
    # E+PD keeps PDs of both roles and no decode pool; its encoders may push to every PD.
    disagg = Cluster(build_topologies(LayoutConfig(cores=(0, 1)), ("disagg",))["disagg"], ServiceArgs("/m"), tmp_path)
    by_name = {c.spec.name: c for c in disagg.children}
    assert "--role" not in by_name["pd-0"].argv and "--decode" not in by_name["proxy-0"].argv
    assert by_name["encoder-0"].argv[by_name["encoder-0"].argv.index("--pd-allow") + 1] == by_name["pd-0"].address
