"""SIGKILL the PD holding a conversation under the cache-aware PD policy.

The victim is a real process (``python -m services.cli pd``); a surviving PD,
the encoder and the proxy (default flags but ``--pd-policy cache-aware``) run
in this process. A chat (system prompt, an image, follow-ups resending the
history) is steered to the victim by the policy itself: its follow-up stays
there, the image not sent to an encoder again. Then the victim is killed.

Checks: the victim's entries leave the proxy's cache index within one health
interval (the proxy's ``--load-poll-s``, 0.5 s) of the kill; the chat goes on
on the survivor (its image encoded again there once, then found in cache);
every answer, before and after the kill, is token-exact against
``transformers`` ``generate()``; nothing is left reserved or pending. Run with
``-s`` to see how long the entries outlived the process.
"""

from __future__ import annotations

import time

import openai
import pytest
from cluster_support import InProcessCluster, free_ports
from oracle_support import make_image, user_message
from reliability_support import ProxyView, ServiceProcess, wait_until
from test_e2e_handoff_support import ProxyOnly

from services.proxy.config import ProxyConfig

pytestmark = pytest.mark.e2e

MAX_TOKENS = 6
SYSTEM = "You are a careful assistant. " * 12  # a long shared prefix, as chat applications send
HEALTH_INTERVAL_S = ProxyConfig.load_poll_s  # the proxy's default polling period of its PDs


class Chat:
    """One conversation through the proxy, each answer checked against the oracle."""

    def __init__(self, client: openai.OpenAI, oracle, seed: int) -> None:
        self.client, self.oracle = client, oracle
        self.model = client.models.list().data[0].id
        self.image = make_image(seed, (48, 40))
        self.messages = [
            {"role": "system", "content": f"{SYSTEM} Conversation {seed}."},
            user_message("Describe the picture.", [self.image]),
        ]
        self.usages: list = []

    def turn(self):
        reply = self.client.chat.completions.create(
            model=self.model,
            messages=self.messages,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"return_token_ids": True},
        )
        token_ids = reply.choices[0].model_extra["token_ids"]
        assert token_ids == self.oracle.generate(self.messages, [self.image], MAX_TOKENS), len(self.usages)
        self.usages.append(reply.usage)
        self.messages += [
            {"role": "assistant", "content": reply.choices[0].message.content},
            {"role": "user", "content": f"And what else, part {len(self.usages)}?"},
        ]
        return reply.usage


def test_a_killed_pds_entries_leave_the_index_within_a_health_interval_and_its_chat_goes_on(
    tiny_model_dir, tmp_path, oracle
) -> None:
    model_dir = str(tiny_model_dir)
    (pd_port,) = free_ports(1)
    victim = ServiceProcess("pd", model_dir, pd_port, tmp_path / "pd.log")
    victim.start()
    survivors = proxy = None
    try:
        survivors = InProcessCluster(model_dir, with_proxy=False).start()
        proxy = ProxyOnly(
            model_dir, [victim.address, *survivors.pd_addresses], survivors.encoder_addresses, pd_policy="cache-aware"
        ).start()
        index = proxy.app.state.proxy.backends.monitor.cache_index
        view = ProxyView(f"http://127.0.0.1:{proxy.port}")
        victim.wait_ready()
        wait_until(lambda: all(view.health()["pd"].values()), 60, "the proxy to see both PDs ready")
        wait_until(lambda: victim.address in index.sizes(), 30, "the victim's cache events to be followed")

        with openai.OpenAI(base_url=proxy.base_url, api_key="unused", max_retries=0, timeout=120) as client:
            chat = None
            for seed in range(40, 44):  # new chats go where the load is lowest: one lands on the victim
                served = view.num_served("pd", victim.address)
                candidate = Chat(client, oracle, seed)
                candidate.turn()
                if view.num_served("pd", victim.address) > served:
                    chat = candidate
                    break
            assert chat is not None, "no new chat went to the victim"
            served = view.num_served("pd", victim.address)
            wait_until(lambda: index.sizes().get(victim.address, 0) > 0, 10, "the victim's events to arrive")
            usage = chat.turn()  # the follow-up stays where its conversation is
            assert view.num_served("pd", victim.address) == served + 1
            assert usage.prompt_tokens_details.cached_tokens >= chat.usages[0].prompt_tokens - 16
            assert usage.model_extra["epd"]["num_images_ready"] == 1  # not sent to an encoder

            killed = victim.kill()  # when SIGKILL was sent (it returns once the process has exited)
            wait_until(lambda: victim.address not in index.sizes(), 10, "the victim's entries to leave the index")
            left_s = time.monotonic() - killed
            print(f"\nthe killed PD's index entries left within {left_s * 1000:.0f} ms of SIGKILL")
            assert left_s <= HEALTH_INTERVAL_S, "its entries outlived it by a health interval"

            usage = chat.turn()  # on the survivor: the image encoded there, the system prompt possibly cached
            assert usage.model_extra["epd"]["num_images_ready"] == 0
            usage = chat.turn()  # and it stays there
            assert usage.prompt_tokens_details.cached_tokens >= chat.usages[-2].prompt_tokens - 16
            assert usage.model_extra["epd"]["num_images_ready"] == 1
            assert victim.address not in index.sizes()
        assert survivors.leaks() == {}
    finally:
        if proxy is not None:
            proxy.stop()
        victim.stop()
        if survivors is not None:
            survivors.stop()
