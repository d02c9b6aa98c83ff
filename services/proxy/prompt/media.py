"""Remote images: https URLs from allow-listed hosts only, fetched defensively.

Off unless ``allowed_media_domains`` is set. Each check runs before the
work it protects, and none of them trusts DNS twice:

1. the URL: https only, no credentials, host on the allow-list
   (``example.com`` exactly, ``*.example.com`` any subdomain);
2. the addresses: the host is resolved once; if *any* address is not
   globally routable (private, loopback, link-local, CGNAT, reserved,
   multicast, IPv4-mapped forms of those) the URL is refused;
3. the connection goes to the address just checked (the request URL carries
   the IP; ``Host`` and TLS SNI / certificate checks use the name), so a
   second lookup cannot swap in an internal address (DNS rebinding);
4. redirects are followed by hand, only to the same host over https, each
   hop re-checked; at most ``MAX_REDIRECTS``;
5. the body is read with a byte cap on the bytes as they arrive, the whole
   fetch under one timeout (itself capped by the request's deadline); no
   proxies from the environment, no connection reuse. Bodies are asked for
   uncompressed (``Accept-Encoding: identity``, images are compressed
   already) and one sent with a ``Content-Encoding`` anyway is refused
   unread: decoding it first would let a few KiB of gzip expand to
   gigabytes before any cap could apply.

Errors are ``ImageUrlNotAllowedError`` / ``ImageFetchError`` (HTTP 400) with
fixed messages: the URL is never echoed.
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from services.proxy.backends.discovery import Resolver, is_ip, system_resolver
from services.proxy.errors import ImageFetchError, ImageUrlNotAllowedError, InvalidImageUrlError

MAX_REDIRECTS = 3
_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})


@dataclass(frozen=True)
class MediaPolicy:
    """What remote images may be fetched, and how much of them."""

    allowed_domains: tuple[str, ...]
    timeout_s: float = 10.0
    max_bytes: int = 16 * 1024 * 1024

    def allows_host(self, host: str) -> bool:
        host = host.lower().rstrip(".")
        for pattern in self.allowed_domains:
            if pattern.startswith("*."):
                if host.endswith(pattern[1:]) and len(host) > len(pattern) - 1:
                    return True
            elif host == pattern.rstrip("."):
                return True
        return False


# IPv6 ranges whose last 32 bits are an IPv4 address that packets may end up at: NAT64's well-known
# prefix (RFC 6052), SIIT's IPv4-translated addresses (RFC 2765) and the deprecated IPv4-compatible ones.
_EMBEDS_IPV4_LOW_BITS = tuple(ipaddress.ip_network(n) for n in ("64:ff9b::/96", "::ffff:0:0:0/96", "::/96"))
# IPv6 ranges refused whatever they hold: NAT64 local-use (its IPv4 may sit at other bit positions) and
# the deprecated site-local range, which Python still counts as global.
_NEVER_PUBLIC_V6 = tuple(ipaddress.ip_network(n) for n in ("64:ff9b:1::/48", "fec0::/10"))


def is_public_address(address: str) -> bool:
    """True only for globally routable unicast addresses; an IPv6 address that carries an IPv4 one
    (mapped, 6to4, NAT64, SIIT, IPv4-compatible) is judged by the IPv4 address it carries."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # drop an IPv6 zone id
    if isinstance(ip, ipaddress.IPv6Address):
        if any(ip in network for network in _NEVER_PUBLIC_V6):
            return False
        carried = ip.ipv4_mapped or ip.sixtofour
        if carried is None and any(ip in network for network in _EMBEDS_IPV4_LOW_BITS):
            carried = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if carried is not None:
            ip = carried
    return ip.is_global and not ip.is_multicast


def _refused(reason: str) -> ImageUrlNotAllowedError:
    return ImageUrlNotAllowedError(f"The image URL is not allowed: {reason}.", "image_url")


class MediaFetcher:
    """Fetches allow-listed https images (see the module docstring for the checks)."""

    def __init__(
        self,
        policy: MediaPolicy,
        *,
        resolver: Resolver = system_resolver,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.policy = policy
        self._resolver = resolver
        self._client = httpx.AsyncClient(
            transport=transport,
            trust_env=False,  # no HTTP(S)_PROXY: the proxy would bypass every address check
            follow_redirects=False,  # redirects are checked by hand
            limits=httpx.Limits(max_keepalive_connections=0),
            headers={"User-Agent": "epd-proxy", "Accept": "image/*", "Accept-Encoding": "identity"},
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    def check_url(self, url: str) -> httpx.URL:
        """Syntax, scheme and host policy (no I/O)."""
        try:
            parsed = httpx.URL(url)
        except (httpx.InvalidURL, ValueError):
            raise InvalidImageUrlError("The image URL is malformed.", "image_url") from None
        if parsed.scheme != "https":
            raise _refused("only https URLs are fetched")
        if parsed.userinfo:
            raise _refused("URLs with credentials are refused")
        if not parsed.host or not self.policy.allows_host(parsed.host):
            raise _refused("its host is not on the allow-list")
        return parsed

    async def _pinned_address(self, url: httpx.URL) -> str:
        """The address to connect to, after refusing hosts with any non-public address."""
        host, port = url.host, url.port or 443
        try:
            addresses = [host] if is_ip(host) else await self._resolver(host, port)
        except (OSError, ValueError):
            raise ImageFetchError("The image host could not be resolved.", "image_url") from None
        if not addresses:
            raise ImageFetchError("The image host could not be resolved.", "image_url")
        if not all(is_public_address(a) for a in addresses):
            raise _refused("its host resolves to a private, loopback or link-local address")
        return addresses[0]

    async def fetch(self, url: str, timeout_s: float) -> bytes:
        """The image bytes behind ``url``; raises a 400 ``ImageError`` for every refusal or failure."""
        timeout = max(0.001, min(timeout_s, self.policy.timeout_s))
        try:
            return await asyncio.wait_for(self._fetch(self.check_url(url)), timeout)
        except TimeoutError:
            raise ImageFetchError("Fetching the image timed out.", "image_url") from None

    async def _fetch(self, url: httpx.URL) -> bytes:
        for _ in range(MAX_REDIRECTS + 1):
            address = await self._pinned_address(url)
            pinned = url.copy_with(host=address)
            headers = {"Host": url.netloc.decode("ascii")}
            request = self._client.build_request("GET", pinned, headers=headers, extensions={"sni_hostname": url.host})
            try:
                response = await self._client.send(request, stream=True)
            except httpx.HTTPError:
                raise ImageFetchError("The image could not be fetched.", "image_url") from None
            try:
                if response.status_code in _REDIRECT_STATUSES:
                    url = self._redirect_target(url, response)
                    continue
                if response.status_code != 200:
                    raise ImageFetchError(f"The image URL answered HTTP {response.status_code}.", "image_url")
                return await self._read_capped(response)
            finally:
                await response.aclose()
        raise ImageFetchError("The image URL redirected too many times.", "image_url")

    def _redirect_target(self, url: httpx.URL, response: httpx.Response) -> httpx.URL:
        location = response.headers.get("location")
        if not location:
            raise ImageFetchError("The image URL redirected without a location.", "image_url")
        try:
            target = url.join(location)
        except (httpx.InvalidURL, ValueError):
            raise ImageFetchError("The image URL redirected to a malformed location.", "image_url") from None
        if target.scheme != "https" or target.host != url.host or (target.port or 443) != (url.port or 443):
            raise _refused("it redirects to another host")
        return target

    async def _read_capped(self, response: httpx.Response) -> bytes:
        limit = self.policy.max_bytes
        if response.headers.get("content-encoding", "identity").strip().lower() not in ("", "identity"):
            raise ImageFetchError("The image URL answered with an encoded (compressed) body.", "image_url")
        declared = response.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ImageFetchError(f"The image is larger than {limit} bytes.", "image_url")
        chunks, size = [], 0
        try:
            # Identity encoding (checked above): these are the bytes as sent, capped before anything else.
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                if size > limit:
                    raise ImageFetchError(f"The image is larger than {limit} bytes.", "image_url")
                chunks.append(chunk)
        except httpx.HTTPError:
            raise ImageFetchError("The image could not be fetched.", "image_url") from None
        return b"".join(chunks)


async def image_sources(urls: Sequence[str], fetcher: MediaFetcher | None, timeout_s: float) -> list[str | bytes]:
    """Each image as the preprocessor takes it: data URLs as they are, https URLs fetched (concurrently).

    Without a fetcher (no allow-list) every non-data URL is refused here,
    before any network work.
    """
    sources: list[str | bytes] = list(urls)
    remote = [i for i, url in enumerate(urls) if not url.startswith("data:")]
    if not remote:
        return sources
    if fetcher is None:
        raise InvalidImageUrlError(
            "Only data: URLs with base64 image payloads are accepted (remote image URLs are disabled).", "image_url"
        )
    for i in remote:
        fetcher.check_url(urls[i])  # refuse a bad URL before fetching any good one
    tasks = {i: asyncio.create_task(fetcher.fetch(urls[i], timeout_s)) for i in remote}
    try:
        # The first failure ends the request: the other fetches are cancelled, not awaited.
        done, _ = await asyncio.wait(tasks.values(), return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            error = task.exception()
            if error is not None:
                raise error
        for i, task in tasks.items():  # no failure: all are done
            sources[i] = task.result()
    finally:
        for task in tasks.values():
            task.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
    return sources
