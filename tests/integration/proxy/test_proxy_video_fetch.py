"""Remote videos go through the same opt-in, SSRF-guarded fetcher as images; the encoder gets the file."""

from __future__ import annotations

import httpx
from proxy_doubles import proxy_config, start_doubles
from video_support import make_video

from services.proxy.app import create_app
from services.proxy.prompt.media import MediaFetcher, MediaPolicy

SECRET = "zq-remote-video-5521"


def _video_message(url) -> dict:
    return {
        "role": "user",
        "content": [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "?"}],
    }


async def test_an_allowed_https_video_is_fetched_pinned_and_sent_to_the_encoder_as_its_file(build_model):
    clip = make_video(11, num_frames=8, size=(48, 32), fps=4)
    requests: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        requests.append(request)
        return httpx.Response(200, content=clip)

    async def resolver(host: str, port: int) -> list[str]:
        return {"video.example.com": ["93.184.215.14"]}[host]

    media = MediaFetcher(MediaPolicy(("video.example.com",)), resolver=resolver, transport=httpx.MockTransport(handler))
    cluster = await start_doubles(1, 1)
    app = create_app(proxy_config(build_model("qwen2.5-vl-tiny"), cluster), fetcher=media)
    lifespan = app.router.lifespan_context(app)
    await lifespan.__aenter__()
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy", timeout=30)
    try:
        body = {"messages": [_video_message("https://video.example.com/clip.mp4")], "max_tokens": 3}
        reply = await client.post("/v1/chat/completions", json=body)
        assert reply.status_code == 200, reply.text
        assert requests[0].url.host == "93.184.215.14" and requests[0].headers["host"] == "video.example.com"
        (item,) = cluster.encoders[0].encodes[0].items
        assert item.video_file == clip and item.grid.t == 2 and item.video_sampling.fps == 2.0
        (span,) = cluster.pds[0].preallocates[0].items
        assert span.num_tokens == 12
        assert cluster.pds[0].generates[0].mm_items[0].second_per_grid_t == 1.0
        body = {"messages": [_video_message(f"https://evil.example.net/{SECRET}.mp4")], "max_tokens": 3}
        refused = await client.post("/v1/chat/completions", json=body)
        assert refused.status_code == 400 and SECRET not in refused.text
        assert refused.json()["error"]["code"] == "image_url_not_allowed"
        assert len(requests) == 1
    finally:
        await client.aclose()
        await lifespan.__aexit__(None, None, None)
        await media.aclose()
        for server in cluster.servers:
            await server.stop(0)
