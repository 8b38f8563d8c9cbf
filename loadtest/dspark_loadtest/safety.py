"""Where a load test may send traffic: loopback by default, elsewhere only where the user says."""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

DEFAULT_HOST = "http://127.0.0.1:8000"


def is_loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_target(url: str, user_given: bool) -> str:
    """The base URL to load, normalised; ValueError for a malformed URL or a non-loopback default.

    A non-loopback address is accepted only when the user named it (`--host`): no configuration
    file, default or environment may point a load test at someone else's server.
    """
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"host must be an http(s) URL such as {DEFAULT_HOST}, got {url!r}")
    if parts.username or parts.password:
        raise ValueError("host must not carry credentials; pass --api-key instead")
    if parts.query or parts.fragment or parts.path not in ("", "/"):
        raise ValueError(f"host must be a base URL without path or query, got {url!r}")
    if not user_given and not is_loopback(url):
        raise ValueError(f"refusing non-loopback target {url!r} that was not given with --host")
    return f"{parts.scheme}://{parts.netloc}"
