"""Fetch an image row's ``http(s)`` URL once, at upload, without letting a row reach inside the network.

A training file is the tenant's input, and the API fetches its URLs from inside the operator's network:
an SSRF vector unless every request is held to the public internet. So each request, and each redirect
hop (at most ``image_fetch_max_redirects``), resolves its host once, refuses it if any of its addresses
is not a global unicast one (loopback, private, link-local — cloud metadata at 169.254.169.254 —,
shared, multicast, reserved, unspecified; IPv4-mapped IPv6 read as IPv4) unless the operator allows
private addresses (``image_fetch_allow_private``), and connects to that checked address itself, with the
URL's host as ``Host`` and as the TLS name (SNI and the certificate), so a second DNS answer cannot
swap the address after the check. Only ``http`` and ``https`` on their URL's port; no credentials in
the URL; no proxy from the environment.

The body streams into a temporary file, refused past ``image_max_bytes`` (by ``Content-Length`` at once,
else as it comes) and past ``image_fetch_timeout_seconds`` in all (connect, every read, and the whole
fetch). The response must be a 200; its ``Content-Type``, when it names an image type, is the media type
the bytes are then checked against (``service.files.images``).
"""

from __future__ import annotations

import ipaddress
import socket
import tempfile
import time
from typing import IO
from urllib.parse import urljoin, urlsplit

import httpx

from service.files.images import ImageProblem

_REDIRECTS = (301, 302, 303, 307, 308)


def _allowed(address: str, allow_private: bool) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_unspecified or ip.is_multicast:
        return False
    return allow_private or ip.is_global


def _resolve(host: str, port: int, allow_private: bool) -> str:
    """The address to connect to for ``host``: its first, once every one of them is allowed."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise ImageProblem(f"cannot resolve the image URL's host {host!r}") from exc
    addresses = [str(info[4][0]) for info in infos]
    refused = [a for a in addresses if not _allowed(a, allow_private)]
    if refused or not addresses:
        shown = refused[0] if refused else "no address"
        raise ImageProblem(
            f"the image URL's host {host!r} is a private, loopback or reserved address ({shown}); "
            "only public addresses are fetched"
        )
    return addresses[0]


class ImageFetcher:
    """Fetches image URLs (module docstring); one per upload, closed at its end."""

    def __init__(
        self, *, max_bytes: int, timeout_seconds: float, max_redirects: int, allow_private: bool
    ) -> None:
        self.max_bytes, self.timeout, self.max_redirects = max_bytes, timeout_seconds, max_redirects
        self.allow_private = allow_private
        self.client = httpx.Client(trust_env=False, follow_redirects=False, timeout=timeout_seconds)

    def close(self) -> None:
        self.client.close()

    def __call__(self, url: str) -> tuple[IO[bytes], int, str | None]:
        """(a temporary file holding the image, its size, the media type the response declared)."""
        deadline = time.monotonic() + self.timeout
        for _ in range(self.max_redirects + 1):
            response = self._get(url, deadline)
            try:
                if response.status_code in _REDIRECTS:
                    location = response.headers.get("location")
                    if not location:
                        raise ImageProblem(
                            f"the image URL answered {response.status_code} without a Location"
                        )
                    url = urljoin(url, location)
                    continue
                if response.status_code != 200:
                    raise ImageProblem(f"fetching the image URL answered HTTP {response.status_code}")
                return self._body(response, deadline)
            finally:
                response.close()
        raise ImageProblem(f"the image URL redirects more than {self.max_redirects} times")

    def _get(self, url: str, deadline: float) -> httpx.Response:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ImageProblem("an image URL must be http or https with a host")
        if parts.username or parts.password:
            raise ImageProblem("an image URL must not carry credentials")
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError as exc:
            raise ImageProblem("the image URL's port is not valid") from exc
        host = parts.hostname
        address = _resolve(host, port, self.allow_private)
        literal = f"[{address}]" if ":" in address else address
        target = parts._replace(netloc=f"{literal}:{port}").geturl()
        request = self.client.build_request(
            "GET",
            target,
            headers={"Host": parts.netloc, "Accept": "image/jpeg, image/png, image/webp"},
            extensions={"sni_hostname": host, "timeout": self._timeouts(deadline)},
        )
        try:
            return self.client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise ImageProblem(f"fetching the image URL failed ({type(exc).__name__})") from exc

    def _timeouts(self, deadline: float) -> dict[str, float]:
        left = max(0.01, deadline - time.monotonic())
        return {"connect": left, "read": left, "write": left, "pool": left}

    def _body(self, response: httpx.Response, deadline: float) -> tuple[IO[bytes], int, str | None]:
        length = response.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            raise ImageProblem(f"the image is {length} bytes, more than the limit of {self.max_bytes}")
        media = response.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        file = tempfile.TemporaryFile()  # noqa: SIM115 - handed to the caller, who closes it
        size = 0
        try:
            for block in response.iter_bytes():
                size += len(block)
                if size > self.max_bytes:
                    raise ImageProblem(f"the image is more than {self.max_bytes} bytes (the limit)")
                if time.monotonic() > deadline:
                    raise ImageProblem(f"fetching the image took more than {self.timeout:g} s")
                file.write(block)
        except httpx.HTTPError as exc:
            file.close()
            raise ImageProblem(f"fetching the image URL failed ({type(exc).__name__})") from exc
        except BaseException:
            file.close()
            raise
        return file, size, media if media.startswith("image/") else None
