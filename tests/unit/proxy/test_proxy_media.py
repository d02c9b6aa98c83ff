"""Remote image fetching: allow-list, address checks, pinning, redirects, caps. No network.

The happy path runs through ``httpx.MockTransport`` (it sees exactly what
would go on the wire: the pinned IP, the Host header, the SNI name); the
refusals that must happen before any connection use a real transport and a
local TCP listener that counts connections.
"""

from __future__ import annotations

import asyncio
import io
import socket

import httpx
import pytest
from PIL import Image

from services.proxy.errors import ImageFetchError, ImageUrlNotAllowedError, InvalidImageUrlError
from services.proxy.prompt.media import MediaFetcher, MediaPolicy, image_sources, is_public_address

PUBLIC_IP = "93.184.215.14"


def png_bytes() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (8, 6), (10, 20, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


class FakeResolver:
    def __init__(self, table: dict[str, list[str]]) -> None:
        self.table = table
        self.calls: list[str] = []

    async def __call__(self, host: str, port: int) -> list[str]:
        self.calls.append(host)
        if host not in self.table:
            raise socket.gaierror("no such host")
        return self.table[host]


def fetcher(handler=None, table=None, domains=("img.example.com", "*.cdn.example.org"), **policy) -> MediaFetcher:
    transport = httpx.MockTransport(handler) if handler else None
    resolver = FakeResolver(
        table if table is not None else {"img.example.com": [PUBLIC_IP], "a.cdn.example.org": [PUBLIC_IP]}
    )
    return MediaFetcher(MediaPolicy(tuple(domains), **policy), resolver=resolver, transport=transport)


def test_host_patterns():
    policy = MediaPolicy(("img.example.com", "*.cdn.example.org"))
    assert policy.allows_host("img.example.com") and policy.allows_host("IMG.example.com.")
    assert policy.allows_host("a.cdn.example.org") and policy.allows_host("x.y.cdn.example.org")
    assert not policy.allows_host("cdn.example.org")  # "*." means subdomains only
    assert not policy.allows_host("evilcdn.example.org") and not policy.allows_host("img.example.com.evil.net")


@pytest.mark.parametrize(
    ("address", "public"),
    [
        (PUBLIC_IP, True),
        ("8.8.8.8", True),
        ("2606:4700::1111", True),
        ("127.0.0.1", False),
        ("10.1.2.3", False),
        ("172.16.0.1", False),
        ("192.168.1.1", False),
        ("169.254.169.254", False),
        ("100.64.0.1", False),
        ("0.0.0.0", False),
        ("224.0.0.1", False),
        ("::1", False),
        ("fe80::1", False),
        ("fd00::1", False),
        ("::ffff:127.0.0.1", False),
        ("::ffff:10.0.0.1", False),
        # IPv6 forms that carry an IPv4 address are judged by it (first review: these counted as public)
        ("64:ff9b::a9fe:a9fe", False),  # NAT64 to 169.254.169.254
        ("64:ff9b::808:808", True),  # NAT64 to 8.8.8.8
        ("64:ff9b:1::a9fe:a9fe", False),  # NAT64 local-use
        ("2002:7f00:1::1", False),  # 6to4 of 127.0.0.1
        ("2002:808:808::1", True),  # 6to4 of 8.8.8.8
        ("::ffff:0:7f00:1", False),  # SIIT of 127.0.0.1
        ("::7f00:1", False),  # IPv4-compatible 127.0.0.1
        ("fec0::1", False),  # deprecated site-local
    ],
)
def test_only_globally_routable_addresses_are_public(address, public):
    assert is_public_address(address) is public


async def test_fetch_pins_the_checked_address_and_keeps_the_name_for_host_and_tls():
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, content=png_bytes())

    media = fetcher(handler)
    data = await media.fetch("https://img.example.com/cat.png?x=1", 5.0)
    assert data == png_bytes()
    [request] = seen
    assert request.url.host == PUBLIC_IP and request.url.path == "/cat.png" and request.url.query == b"x=1"
    assert request.headers["host"] == "img.example.com"
    assert request.extensions["sni_hostname"] == "img.example.com"
    await media.aclose()


async def test_same_host_redirect_is_followed_and_rechecked():
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/old":
            return httpx.Response(302, headers={"location": "/new"})
        return httpx.Response(200, content=png_bytes())

    media = fetcher(handler)
    assert await media.fetch("https://img.example.com/old", 5.0) == png_bytes()
    assert media._resolver.calls == ["img.example.com", "img.example.com"]


@pytest.mark.parametrize(
    "location",
    [
        "https://other.example.net/a.png",
        "http://img.example.com/a.png",
        "https://img.example.com:8443/a.png",
        "https://a.cdn.example.org/a.png",
    ],  # another host, even an allowed one
)
async def test_redirects_to_another_host_or_scheme_are_refused(location):
    media = fetcher(lambda request: httpx.Response(301, headers={"location": location}))
    with pytest.raises(ImageUrlNotAllowedError):
        await media.fetch("https://img.example.com/a.png", 5.0)


async def test_redirect_loops_are_bounded():
    media = fetcher(lambda request: httpx.Response(302, headers={"location": "/again"}))
    with pytest.raises(ImageFetchError, match="too many"):
        await media.fetch("https://img.example.com/a", 5.0)


async def test_byte_cap_by_header_and_while_streaming():
    big = b"\x89PNG" + b"\0" * 5000
    media = fetcher(lambda request: httpx.Response(200, content=big), max_bytes=1000)
    with pytest.raises(ImageFetchError, match="larger"):
        await media.fetch("https://img.example.com/a", 5.0)

    async def stream():
        for _ in range(10):
            yield b"\0" * 300

    media = fetcher(lambda request: httpx.Response(200, content=stream()), max_bytes=1000)  # no length
    with pytest.raises(ImageFetchError, match="larger"):
        await media.fetch("https://img.example.com/a", 5.0)


async def test_an_encoded_body_is_refused_before_it_is_decoded():
    # Defect 4: the byte cap applied to decoded bytes, so a small gzip body was inflated first.
    import gzip
    import tracemalloc

    bomb = gzip.compress(b"\0" * (64 << 20))  # 64 MiB of zeros in ~64 KiB
    seen: list[httpx.Request] = []

    async def body():
        for start in range(0, len(bomb), 16384):
            yield bomb[start : start + 16384]

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, content=body(), headers={"content-encoding": "gzip"})  # streamed, unread

    media = fetcher(handler, max_bytes=1 << 20)
    assert len(bomb) < media.policy.max_bytes
    tracemalloc.start()
    try:
        with pytest.raises(ImageFetchError, match="encoded"):
            await media.fetch("https://img.example.com/a.png", 5.0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20  # nothing was inflated
    assert seen[0].headers["accept-encoding"] == "identity"
    await media.aclose()


async def test_timeout_and_error_statuses():
    async def slow(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(5)
        return httpx.Response(200)

    with pytest.raises(ImageFetchError, match="timed out"):
        await fetcher(slow).fetch("https://img.example.com/a", 0.05)
    with pytest.raises(ImageFetchError, match="HTTP 404"):
        await fetcher(lambda request: httpx.Response(404)).fetch("https://img.example.com/a", 5.0)

    def broken(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused")

    with pytest.raises(ImageFetchError, match="could not be fetched"):
        await fetcher(broken).fetch("https://img.example.com/a", 5.0)
    with pytest.raises(ImageFetchError, match="resolved"):
        await fetcher(broken, table={}).fetch("https://img.example.com/a", 5.0)


@pytest.mark.parametrize(
    ("url", "error"),
    [
        ("http://img.example.com/a.png", ImageUrlNotAllowedError),
        ("https://user:pw@img.example.com/a.png", ImageUrlNotAllowedError),
        ("https://evil.example.net/a.png", ImageUrlNotAllowedError),
        ("https://[::1/a.png", InvalidImageUrlError),
    ],
)
async def test_url_refusals_need_no_io(url, error):
    media = fetcher(lambda request: pytest.fail("no request may be sent"))
    with pytest.raises(error):
        await media.fetch(url, 5.0)
    assert media._resolver.calls == []


@pytest.fixture
def counting_listener():
    """A TCP listener on 127.0.0.1 that counts connection attempts (it never answers)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.setblocking(False)
    yield server
    server.close()


def accepted(server: socket.socket) -> int:
    count = 0
    while True:
        try:
            connection, _ = server.accept()
        except BlockingIOError:
            return count
        connection.close()
        count += 1


@pytest.mark.parametrize(
    ("host", "addresses"),
    [
        ("img.example.com", ["127.0.0.1"]),  # an allowed name pointing at loopback
        ("img.example.com", [PUBLIC_IP, "10.0.0.7"]),  # one private address among public ones
        ("127.0.0.1", None),
        ("169.254.169.254", None),
    ],  # IP literals, allowed by name but private
)
async def test_private_addresses_are_refused_before_connecting(counting_listener, host, addresses):
    port = counting_listener.getsockname()[1]
    table = {} if addresses is None else {host: addresses}
    media = fetcher(table=table, domains=(host,))  # real transport: would really connect
    with pytest.raises(ImageUrlNotAllowedError, match="private"):
        await media.fetch(f"https://{host}:{port}/a.png", 5.0)
    assert accepted(counting_listener) == 0
    await media.aclose()


async def test_image_sources_keeps_data_urls_and_fetches_the_rest():
    media = fetcher(lambda request: httpx.Response(200, content=png_bytes()))
    sources = await image_sources(["data:image/png;base64,AAAA", "https://img.example.com/a"], media, 5.0)
    assert sources == ["data:image/png;base64,AAAA", png_bytes()]
    with pytest.raises(InvalidImageUrlError, match="disabled"):
        await image_sources(["https://img.example.com/a"], None, 5.0)
    # One refused URL fails the request before anything is fetched.
    calls = []
    media = fetcher(lambda request: calls.append(request) or httpx.Response(200, content=png_bytes()))
    with pytest.raises(ImageUrlNotAllowedError):
        await image_sources(["https://img.example.com/a", "ftp://img.example.com/b"], media, 5.0)
    assert calls == []
