"""The tests' HTTP requests, on one client.

``httpx.post`` and ``httpx.get`` build a client for each call, and building one loads the
CA bundle for TLS: about 30 ms of CPU a request, although every server here is plain HTTP.
This client is built once. It keeps no connection alive, so each request opens its own, as
a new client's would, and a server with several workers may answer any of them."""

from __future__ import annotations

from typing import Any

import httpx

_CLIENT = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0), timeout=5.0)


def get(url: str, **kwargs: Any) -> httpx.Response:
    """``httpx.get``, on the shared client."""
    return _CLIENT.get(url, **kwargs)


def post(url: str, **kwargs: Any) -> httpx.Response:
    """``httpx.post``, on the shared client."""
    return _CLIENT.post(url, **kwargs)
