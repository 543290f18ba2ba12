"""Which Host headers the two servers (the dashboard and a run's /metrics) answer.

Each server answers only requests that name it, as Jupyter does for loopback:

- a loopback address in the Host header (127.0.0.1, [::1]) or `localhost`, on any port;
- when bound beyond loopback, also any IP address, the bound name, this machine's host name, and
  the names given (`--allow-host`, `monitor.metrics_allowed_hosts`).

A request without a Host header (HTTP/1.0, `nc`) is answered.
"""

# The threat is DNS rebinding: a web page can have its own domain re-pointed at 127.0.0.1 or at
# the machine's address; the browser then sends that page's requests to the server, with the
# page's domain in the Host header, and lets the page read the answers (run names, model paths,
# losses). The page cannot choose that header, so the header decides.

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable
from dataclasses import dataclass

LOCAL_NAMES = frozenset({"localhost"})


def _address(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None


def is_loopback(host: str) -> bool:
    """Whether binding `host` serves this machine only (127.0.0.0/8, ::1 or localhost)."""
    address = _address(host)
    return host.lower() in LOCAL_NAMES if address is None else address.is_loopback


def host_name(header: str) -> str | None:
    """The name or address a Host header gives, lower case, without its port or IPv6 brackets
    (None when it is not `name`, `name:port`, `[v6]` or `[v6]:port`)."""
    text = header.strip().lower()
    if text.startswith("["):
        address, bracket, rest = text[1:].partition("]")
        if not bracket or (rest and not (rest.startswith(":") and rest[1:].isdigit())):
            return None
        return address if _address(address) is not None else None
    # The port is dropped: a tunnel (`ssh -L 9999:localhost:8470`) sends its own local port,
    # and the name, not the port, is what a rebinding page cannot fake.
    name, colon, port = text.partition(":")
    if colon and not port.isdigit():
        return None
    name = name.removesuffix(".")  # "localhost." is the same name, fully qualified
    # Anything but a plain host name is refused rather than matched loosely.
    return name if name and all(c.isalnum() or c in "-._" for c in name) else None


@dataclass(frozen=True)
class HostCheck:
    """The Host headers one server answers (see the module's docstring)."""

    names: frozenset[str]
    """Names (not addresses) accepted besides `localhost`."""
    any_address: bool
    """Whether any IP address is accepted, not only loopback ones (a bind beyond loopback)."""

    @classmethod
    def for_bind(cls, host: str, allowed: Iterable[str] = ()) -> HostCheck:
        """The check for a server bound to `host`, also accepting the names `allowed`."""
        names = {n.strip().lower().removesuffix(".") for n in allowed if n.strip()}
        if is_loopback(host):
            return cls(frozenset(names | LOCAL_NAMES), any_address=False)
        # The names a user on another machine would type: the bound one and the host's own.
        names |= {host.lower(), socket.gethostname().lower()}
        return cls(frozenset(names | LOCAL_NAMES), any_address=True)

    def allows(self, header: str | None) -> bool:
        """Whether to answer a request whose Host header is `header` (None: there is none)."""
        # HTTP/1.0 clients and nc send none; every browser sends one, so no rebound page lacks it.
        if header is None:
            return True
        name = host_name(header)
        if name is None:
            return False
        address = _address(name)
        if address is None:
            return name in self.names
        # A browser that sends an IP address connected to that address: no name was resolved,
        # so none was rebound. Behind a loopback bind, only loopback addresses name this server.
        return self.any_address or address.is_loopback


REFUSED = (
    b"this server answers only requests that name it (localhost, 127.0.0.1, or the names it "
    b"was given); the Host header named another: a web page re-pointed here?\n"
)
"""The body of a refused request (403)."""


def exposure_warning(host: str, port: int, what: str, flag: str, allow_flag: str) -> str | None:
    """The one-line warning for a server bound beyond loopback, or None for a loopback bind.

    Args:
        host: The bound address.
        port: The bound port.
        what: What anyone who reaches the port can read.
        flag: The setting that chose `host`: a flag (`--host`) or a config field
            (`monitor.metrics_host`).
        allow_flag: The setting that adds accepted Host names.
    """
    if is_loopback(host):
        return None
    sep = " " if flag.startswith("-") else "="
    return (
        f"warning: {flag}{sep}{host} is not a loopback address: anyone who can reach port {port} "
        f"can read {what} (there is no login); keep {flag}{sep}127.0.0.1 unless another machine "
        f"must connect; requests must name this machine (an address, its host name, or a name "
        f"given with {allow_flag})"
    )
