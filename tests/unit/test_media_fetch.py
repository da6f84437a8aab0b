"""Image URLs cannot make the router a proxy into its cluster: every address that is not public is
refused before any connection, on the literal URL, on what a host name resolves to and on every
redirect; `--allowed-media-domains` names the only hosts fetched; `--disable-image-urls` fetches
nothing. A listener on loopback counts the connections it gets."""

from __future__ import annotations

import asyncio
import contextlib
import re

import pytest
from yarl import URL

from gaudi_runtime.config import resolve
from gaudi_runtime.router.errors import ValidationError
from gaudi_runtime.router.media_fetch import FetchPolicy, address_problem, check_url, fetch_url

REFUSED = {
    "127.0.0.1": "loopback", "127.9.9.9": "loopback", "10.1.2.3": "private", "172.16.0.1": "private",
    "192.168.1.1": "private", "169.254.169.254": "link-local", "100.64.0.1": "private",
    "0.0.0.0": "unspecified", "224.0.0.1": "multicast", "239.255.255.250": "multicast",
    "240.0.0.1": "reserved", "255.255.255.255": "reserved", "192.0.2.1": "private",
    "::1": "loopback", "::": "unspecified", "fe80::1": "link-local", "fe80::1%eth0": "link-local",
    "fc00::1": "private", "fd12:3456::1": "private", "fec0::1": "site-local", "ff02::1": "multicast",
    "::ffff:127.0.0.1": "loopback", "::ffff:169.254.169.254": "link-local", "::ffff:10.0.0.1": "private",
    "2002:7f00:1::": "loopback", "64:ff9b::a9fe:a9fe": "link-local", "2001:db8::1": "private",
    "2001::1": "Teredo",
}


@pytest.mark.parametrize("address", sorted(REFUSED))
def test_every_address_that_is_not_public_is_refused(address):
    why = address_problem(address)
    assert why is not None and REFUSED[address] in why, why


@pytest.mark.parametrize("address", ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111", "::ffff:8.8.8.8",
                                     "64:ff9b::808:808"])
def test_public_addresses_are_allowed(address):
    assert address_problem(address) is None


def test_url_checks_before_any_lookup():
    default = FetchPolicy()
    check_url(URL("https://images.example.com/a.png"), default)  # a name: its addresses are checked later
    for url, message in [("http://169.254.169.254/latest/meta-data/", "link-local"),
                         ("http://[::ffff:7f00:1]/", "loopback"), ("ftp://example.com/a", "only http(s)"),
                         ("http:///a.png", "only http(s)")]:
        with pytest.raises(ValidationError, match=re.escape(message)):
            check_url(URL(url), default)
    with pytest.raises(ValidationError, match="--disable-image-urls"):
        check_url(URL("https://images.example.com/a.png"), FetchPolicy(urls_enabled=False))
    listed = FetchPolicy(allowed_hosts=frozenset({"images.internal", "10.0.0.5"}))
    check_url(URL("http://IMAGES.internal./a.png"), listed)
    check_url(URL("http://10.0.0.5:8080/a.png"), listed)
    with pytest.raises(ValidationError, match="not in --allowed-media-domains"):
        check_url(URL("https://images.example.com/a.png"), listed)


def test_the_policy_comes_from_the_settings():
    cfg = resolve(None, {"MODEL_ID": "m", "ALLOWED_MEDIA_DOMAINS": "Images.Internal., [::1] ,127.0.0.1"})
    assert cfg.limits.allowed_media_domains == ["images.internal", "::1", "127.0.0.1"]
    assert FetchPolicy.from_limits(cfg.limits) == FetchPolicy(frozenset({"images.internal", "::1", "127.0.0.1"}))
    off = FetchPolicy.from_limits(resolve(None, {"MODEL_ID": "m", "DISABLE_IMAGE_URLS": "true"}).limits)
    assert off == FetchPolicy(None, urls_enabled=False)
    assert FetchPolicy.from_limits(resolve(None, {"MODEL_ID": "m"}).limits) == FetchPolicy()


class Listener:
    """A bare HTTP/1.0 server on 127.0.0.1 that counts connections: `/a.png` is the image, `/to?URL`
    redirects there."""

    def __init__(self):
        self.connections = 0
        self.paths: list[str] = []

    async def __aenter__(self):
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc):
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader, writer):
        self.connections += 1
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            head = (await reader.readuntil(b"\r\n\r\n")).decode()
            path = head.split(" ", 2)[1]
            self.paths.append(path)
            if path.startswith("/to?"):
                writer.write(f"HTTP/1.0 302 Found\r\nLocation: {path[4:]}\r\nContent-Length: 0\r\n\r\n".encode())
            else:
                writer.write(b"HTTP/1.0 200 OK\r\nContent-Length: 5\r\n\r\nimage")
            await writer.drain()
        writer.close()

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"


async def _refused(url: str, policy: FetchPolicy) -> str:
    with pytest.raises(ValidationError) as e:
        await fetch_url(url, 1000, 5, policy)
    return str(e.value)


def test_loopback_is_refused_by_default_before_any_connection():
    async def run():
        async with Listener() as srv:
            errors = [await _refused(srv.url("/a.png", host), FetchPolicy())
                      for host in ("127.0.0.1", "localhost", "2130706433", "[::ffff:127.0.0.1]")]
            errors.append(await _refused(srv.url("/a.png"), FetchPolicy(urls_enabled=False)))
            return srv.connections, errors

    connections, errors = asyncio.run(run())
    assert connections == 0
    assert "127.0.0.1: the address is loopback" in errors[0]
    assert "localhost (127.0.0.1): the address is loopback" in errors[1]  # checked on what the name resolves to
    assert "2130706433" in errors[2]  # 127.0.0.1 written as one number: refused too
    assert "loopback" in errors[3]
    assert "--disable-image-urls" in errors[4]


def test_allow_listed_hosts_are_fetched_and_each_redirect_is_checked():
    async def run():
        async with Listener() as srv:
            listed = FetchPolicy(allowed_hosts=frozenset({"127.0.0.1"}))
            got = await fetch_url(srv.url("/a.png"), 1000, 5, listed)
            followed = await fetch_url(srv.url("/to?/a.png"), 1000, 5, listed)
            before = srv.connections
            error = await _refused(srv.url("/to?" + srv.url("/a.png", "localhost")), listed)
            refused_hop = srv.connections - before
            loop_error = await _refused(srv.url("/to?/to?/to?/to?/to?/to?/a.png"), listed)
            return got, followed, error, refused_hop, loop_error, srv.paths

    got, followed, error, refused_hop, loop_error, paths = asyncio.run(run())
    assert got == followed == b"image"
    assert "localhost" in error and "not in --allowed-media-domains" in error
    assert refused_hop == 1  # the redirect was answered; its private target never got a connection
    assert "more than 5 redirects" in loop_error
    assert paths[:3] == ["/a.png", "/to?/a.png", "/a.png"]
