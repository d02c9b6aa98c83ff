"""The proxy's ``--fault slow-decode-ms=N`` through a real cluster.

Slow image decoding must stay off the event loop (other requests and health
checks are served meanwhile), a request whose deadline allows the delay still
gets the exact answer, and one whose ``X-Request-Timeout`` is shorter gets a
clean 504 at its deadline rather than whenever the decode finishes.
"""

from __future__ import annotations

import argparse
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from cluster_support import InProcessCluster
from oracle_support import make_image, user_message
from test_e2e_handoff_support import MAX_TOKENS, chat, client_for

from services.proxy.faults import ProxyFaults
from services.proxy.main import add_arguments, config_from_args

SLOW_DECODE_MS = 3000


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    # Four image threads: a decode abandoned at its deadline keeps one busy
    # until it finishes, and the other tests need free ones.
    proxy = {"faults": ProxyFaults(slow_decode_ms=SLOW_DECODE_MS), "preprocess_threads": 4, "image_threads": 4}
    cluster = InProcessCluster(str(tiny_model_dir), proxy=proxy).start()
    yield cluster
    cluster.stop()


def test_the_switch_is_off_by_default_and_parsed_from_the_flag() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert config_from_args(parser.parse_args([])).faults == ProxyFaults()
    assert not ProxyFaults().enabled
    assert config_from_args(parser.parse_args(["--fault", "slow-decode-ms=250"])).faults.slow_decode_ms == 250
    for bad in ("slow-decode-ms", "slow-decode-ms=x", "slow-decode-ms=-1", "freeze"):
        with pytest.raises(ValueError):
            ProxyFaults.parse(bad)


def test_a_slow_decode_within_the_deadline_still_gives_the_exact_answer(cluster, oracle) -> None:
    image = make_image(600)
    messages = [user_message("Describe the picture.", [image])]
    tokens, epd = chat(client_for(cluster), messages)
    assert tokens == oracle.generate(messages, [image], MAX_TOKENS)
    assert epd["timings_ms"]["preprocess"] >= SLOW_DECODE_MS  # the fault really delayed it
    assert cluster.leaks() == {}


def test_the_event_loop_serves_others_while_an_image_decodes(cluster, oracle) -> None:
    client = client_for(cluster)
    text = [user_message("Only text here.", [])]
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(chat, client, [user_message("Slow one.", [make_image(601)])])
        # Served while the slow request is still decoding (it takes SLOW_DECODE_MS).
        assert httpx.get(cluster.base_url.removesuffix("/v1") + "/health").status_code == 200
        assert chat(client, text)[0] == oracle.generate(text, [], MAX_TOKENS)
        assert not slow.done()
        slow.result()
    assert cluster.leaks() == {}


def test_a_deadline_shorter_than_the_decode_is_a_clean_504_at_the_deadline(cluster) -> None:
    # The client gives up well before the decode finishes: only a 504 sent at the
    # request's deadline reaches it.
    client = client_for(cluster, timeout=SLOW_DECODE_MS / 1000 - 1.0)
    with pytest.raises(openai.APIStatusError) as failure:
        client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=[user_message("Too slow.", [make_image(602)])],
            max_tokens=4,
            extra_headers={"X-Request-Timeout": "0.5"},
        )
    assert failure.value.status_code == 504
    assert failure.value.body["code"] == "timeout"
    assert cluster.leaks() == {}
