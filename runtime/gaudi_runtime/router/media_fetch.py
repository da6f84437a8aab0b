"""Fetching a prompt's image URL without becoming a proxy into the cluster (server-side request forgery).

A model server is reachable by every workload of its cluster, so a URL in a prompt must not make it
GET what those workloads cannot: the cloud's metadata service (169.254.169.254), the node's loopback,
other services' private addresses. By default a URL is fetched only when every address its host
resolves to is public; `--allowed-media-domains` names the only hosts fetched instead (whatever
their addresses: an image service inside the cluster), and `--disable-image-urls` fetches nothing.

The check runs on the addresses the connection would use, in the resolver of the connection itself,
so no address is connected to before it is checked, and a host name cannot resolve one way for the
check and another for the connection. Redirects are followed here, one at a time, each new URL
checked as the first was.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import dataclass

from gaudi_runtime.config import LimitsConfig, normalize_host
from gaudi_runtime.router.errors import ValidationError

MAX_REDIRECTS = 5
_NAT64 = ipaddress.ip_network("64:ff9b::/96")  # a NAT64 gateway forwards to the embedded IPv4 address
_SHARED = ipaddress.ip_network("100.64.0.0/10")  # carrier-grade NAT, used inside clusters too


class RefusedURL(ValidationError):
    """The policy forbids fetching this URL (HTTP 422)."""


@dataclass(frozen=True)
class FetchPolicy:
    """Which image URLs the router may fetch."""

    allowed_hosts: frozenset[str] | None = None  # None: any host whose addresses are all public
    urls_enabled: bool = True

    @classmethod
    def from_limits(cls, limits: LimitsConfig) -> FetchPolicy:
        hosts = limits.allowed_media_domains
        return cls(None if hosts is None else frozenset(hosts), not limits.disable_image_urls)

    def trusts(self, host: str) -> bool:
        """An allow-listed host: fetched whatever its addresses."""
        return self.allowed_hosts is not None and normalize_host(host) in self.allowed_hosts


def _ipv4_inside(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one stands for (mapped, 6to4, NAT64), whose rules then apply."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def address_problem(address: str) -> str | None:
    """Why an address must not be fetched from (None: it is public). Pure."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])  # drop an IPv6 zone (fe80::1%eth0)
    except ValueError:
        return "not an IP address"
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.teredo is not None:
            return "a Teredo tunnel address"
        inner = _ipv4_inside(ip)
        if inner is not None:
            why = address_problem(str(inner))
            return None if why is None else f"{why} (inside {ip})"
    for kind in ("unspecified", "loopback", "link_local", "multicast", "reserved"):
        if getattr(ip, f"is_{kind}"):
            return kind.replace("_", "-")
    if isinstance(ip, ipaddress.IPv6Address) and ip.is_site_local:
        return "site-local"
    if ip.is_private or (isinstance(ip, ipaddress.IPv4Address) and ip in _SHARED):
        return "private"
    if not ip.is_global:
        return "not globally routable"
    return None


def check_url(url, policy: FetchPolicy) -> None:
    """Refuse a URL (a `yarl.URL`) by its scheme, its host, or its host's literal address. Pure.

    A host name's addresses are checked when it is resolved (`PublicAddressResolver`)."""
    if not policy.urls_enabled:
        raise RefusedURL("image URLs are disabled on this server (--disable-image-urls): "
                         "send the image inline as a data:image/...;base64 URL")
    if url.scheme not in ("http", "https") or not url.host:
        raise RefusedURL(f"refused to fetch {url}: only http(s) URLs with a host are fetched")
    if policy.allowed_hosts is not None:
        if not policy.trusts(url.host):
            raise RefusedURL(f"refused to fetch {url}: its host is not in --allowed-media-domains")
        return
    refuse_if_not_public(url.host, [url.host] if _is_ip(url.host) else [])


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    return True


def refuse_if_not_public(host: str, addresses: list[str]) -> None:
    for address in addresses:
        why = address_problem(address)
        if why is not None:
            named = host if host == address else f"{host} ({address})"
            raise RefusedURL(f"refused to fetch from {named}: the address is {why}, not public; "
                             "allow the host with --allowed-media-domains")


def public_address_resolver(policy: FetchPolicy):
    """An aiohttp resolver that refuses a host (not allow-listed) any of whose addresses is not public."""
    from aiohttp.abc import AbstractResolver
    from aiohttp.resolver import DefaultResolver

    class PublicAddressResolver(AbstractResolver):
        def __init__(self) -> None:
            self.inner = DefaultResolver()

        async def resolve(self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET):
            infos = await self.inner.resolve(host, port, family)
            if not policy.trusts(host):
                refuse_if_not_public(host, [i["host"] for i in infos])
            return infos

        async def close(self) -> None:
            await self.inner.close()

    return PublicAddressResolver()


async def fetch_url(url: str, max_bytes: int, timeout_s: float, policy: FetchPolicy | None = None) -> bytes:
    """GET an http(s) image that `policy` allows (default: public addresses only), following up to
    MAX_REDIRECTS redirects, refusing more than `max_bytes` and anything slower than `timeout_s`."""
    import aiohttp

    policy = policy or FetchPolicy()
    connector = aiohttp.TCPConnector(resolver=public_address_resolver(policy))
    try:
        async with aiohttp.ClientSession(connector=connector, trust_env=False) as session:
            return await asyncio.wait_for(_follow(session, url, max_bytes, policy), timeout_s)
    except asyncio.TimeoutError:
        raise ValidationError(f"could not fetch image {url}: no answer within {timeout_s:g}s") from None
    except aiohttp.ClientError as e:
        raise ValidationError(f"could not fetch image {url}: {e}") from None
    except ValueError as e:  # yarl: a URL that does not parse
        if isinstance(e, ValidationError):
            raise
        raise ValidationError(f"could not fetch image {url}: invalid URL ({e})") from None


async def _follow(session, url: str, max_bytes: int, policy: FetchPolicy) -> bytes:
    from yarl import URL

    current = URL(url)
    for _ in range(MAX_REDIRECTS + 1):
        check_url(current, policy)
        async with session.get(current, allow_redirects=False) as resp:
            location = resp.headers.get("Location")
            if resp.status in (301, 302, 303, 307, 308) and location:
                current = current.join(URL(location))
                continue
            if resp.status != 200:
                raise ValidationError(f"could not fetch image {url}: HTTP {resp.status}")
            return await _read_body(resp, url, max_bytes)
    raise ValidationError(f"could not fetch image {url}: more than {MAX_REDIRECTS} redirects")


async def _read_body(resp, url: str, max_bytes: int) -> bytes:
    if resp.content_length is not None and resp.content_length > max_bytes:
        raise ValidationError(f"image too large: {url} has {resp.content_length} bytes, "
                              f"more than {max_bytes} (MAX_IMAGE_BYTES)")
    data = bytearray()
    async for chunk in resp.content.iter_chunked(64 << 10):
        data += chunk
        if len(data) > max_bytes:
            raise ValidationError(f"image too large: {url} has more than {max_bytes} bytes (MAX_IMAGE_BYTES)")
    return bytes(data)
