"""Which network addresses a webhook may reach, and which URL hosts are spelled plainly (pure).

A webhook is a request cronbus makes on a tenant's behalf, from inside the operator's network:
without a guard, any tenant could call the cloud metadata service, a database's admin port or
another tenant's internal service. The executor resolves a target's host once per new
connection, asks ``AddressPolicy.allows`` about every address it got, and connects only to an
address that passed (so a name cannot resolve to a public address for the check and to a
private one for the connection).

Every address that is not plainly on the public internet is denied unless the operator lists it
in ``CRONBUS_WEBHOOK_ALLOWED_NETWORKS``: loopback, RFC 1918, link-local, shared address space
(100.64.0.0/10), unique-local IPv6 (fc00::/7), "this network" (0.0.0.0/8), multicast, reserved
and documentation ranges, and IPv6 forms that carry one of these IPv4 addresses inside
(IPv4-mapped, IPv4-compatible, NAT64, 6to4). ``CRONBUS_WEBHOOK_DENIED_NETWORKS`` carves
exceptions out of what is allowed (it always wins).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

#: Denied unless allowed: named here so the list reads like the documentation (and so the
#: answer does not depend on the Python version's idea of ``is_global`` alone).
RESTRICTED_NETWORKS: tuple[Network, ...] = tuple(
    ipaddress.ip_network(net)
    for net in (
        "0.0.0.0/8",  # "this network"
        "10.0.0.0/8",  # RFC 1918
        "100.64.0.0/10",  # shared address space (carrier-grade NAT)
        "127.0.0.0/8",  # loopback
        "169.254.0.0/16",  # link-local (cloud metadata lives here)
        "172.16.0.0/12",  # RFC 1918
        "192.0.0.0/24",  # IETF protocol assignments
        "192.168.0.0/16",  # RFC 1918
        "198.18.0.0/15",  # benchmarking
        "224.0.0.0/4",  # multicast
        "240.0.0.0/4",  # reserved, and the broadcast address
        "::/128",  # unspecified
        "::1/128",  # loopback
        "fc00::/7",  # unique local
        "fe80::/10",  # link-local
        "fec0::/10",  # site-local (deprecated, still routed by some stacks)
        "ff00::/8",  # multicast
    )
)
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_IPV4_COMPATIBLE = ipaddress.IPv6Network("::/96")


def parse_networks(text: Iterable[str]) -> tuple[Network, ...]:
    """CIDRs -> networks; ValueError naming the first bad one."""
    networks = []
    for item in text:
        try:
            networks.append(ipaddress.ip_network(item.strip(), strict=False))
        except ValueError:
            raise ValueError(f"{item.strip()!r} is not a network (CIDR)") from None
    return tuple(networks)


def embedded_ipv4(address: Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address stands for, when it carries one (mapped, compatible,
    NAT64 or 6to4): a connection to it may end up at that IPv4 address."""
    if isinstance(address, ipaddress.IPv4Address):
        return None
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address in _NAT64 or (address in _IPV4_COMPATIBLE and int(address) > 0xFFFF):
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def is_restricted(address: Address) -> bool:
    """True for an address that is not plainly public (see the module's docstring)."""
    if any(address in network for network in RESTRICTED_NETWORKS):
        return True
    if not address.is_global or address.is_multicast or address.is_reserved:
        return True
    inner = embedded_ipv4(address)
    return inner is not None and is_restricted(inner)


@dataclass(frozen=True)
class AddressPolicy:
    """The operator's choice: restricted addresses are denied unless ``allowed`` lists them;
    ``denied`` is always denied."""

    allowed: tuple[Network, ...] = ()
    denied: tuple[Network, ...] = ()
    _cache: dict[Address, bool] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_text(cls, allowed: Iterable[str], denied: Iterable[str] = ()) -> AddressPolicy:
        return cls(parse_networks(allowed), parse_networks(denied))

    def allows(self, address: Address) -> bool:
        # Few distinct addresses per executor, asked about on every new connection.
        known = self._cache.get(address)
        if known is None:
            known = self._decide(address)
            if len(self._cache) < 65_536:
                self._cache[address] = known
        return known

    def denied_by_operator(self, address: Address) -> bool:
        """True when the operator's denied networks hold it (not merely a restricted one)."""
        inner = embedded_ipv4(address)
        return _in_any((address,) if inner is None else (address, inner), self.denied)

    def _decide(self, address: Address) -> bool:
        inner = embedded_ipv4(address)
        forms = (address,) if inner is None else (address, inner)
        if _in_any(forms, self.denied):
            return False
        if _in_any(forms, self.allowed):
            return True
        return not is_restricted(address)


def _in_any(addresses: tuple[Address, ...], networks: tuple[Network, ...]) -> bool:
    return any(
        address in network
        for address in addresses
        for network in networks
        if address.version == network.version
    )


# --- how a host is spelled in a URL -------------------------------------------------------------

#: A DNS name: ASCII letters, digits and hyphens in labels (international names in punycode).
_HOSTNAME_RE = re.compile(
    r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9_-]{1,63}(?<!-))*\.?\Z", re.ASCII
)
#: A label a browser or libc would read as a number (decimal, octal or hex).
_NUMERIC_LABEL_RE = re.compile(r"(0[xX][0-9A-Fa-f]*|[0-9]+)\Z", re.ASCII)


def host_problem(host: str) -> str | None:
    """Why a URL host is refused, or None. ``host`` is as written in the URL, brackets kept.

    Numbers written any other way than canonical dotted decimal (``2130706433``, ``0x7f.0.0.1``,
    ``127.1``, ``0177.0.0.1``) are refused: resolvers disagree on what they mean, so a check on
    one reading could be bypassed by another."""
    if not host:
        return "has no host"
    if not host.isascii():
        return "host must be ASCII (write international names in punycode, xn--)"
    if host.startswith("["):
        return _ipv6_literal_problem(host)
    last_label = host.rstrip(".").rsplit(".", 1)[-1]
    if _NUMERIC_LABEL_RE.match(last_label):
        try:
            canonical = str(ipaddress.IPv4Address(host))
        except ValueError:
            canonical = ""
        if canonical != host:
            return f"host {host!r} is not an IPv4 address in canonical dotted-decimal form"
        return None
    if not _HOSTNAME_RE.match(host):
        return f"host {host!r} is not a valid host name"
    return None


def _ipv6_literal_problem(host: str) -> str | None:
    if not host.endswith("]"):
        return f"host {host!r} is not a valid IPv6 literal"
    try:
        address = ipaddress.IPv6Address(host[1:-1])
    except ValueError:
        return f"host {host!r} is not a valid IPv6 literal"
    if "%" in host:
        return "IPv6 zone identifiers are not allowed"
    if embedded_ipv4(address) is not None and address.ipv4_mapped is not None:
        return f"host {host!r} is an IPv4-mapped IPv6 address: write the IPv4 address"
    if address in _IPV4_COMPATIBLE and int(address) > 0xFFFF:
        return f"host {host!r} is an IPv4-compatible IPv6 address: write the IPv4 address"
    return None


_URL_RE = re.compile(r"https?://(?P<authority>[^/?#]*)", re.ASCII)
_PORT_RE = re.compile(r"[0-9]{1,5}\Z", re.ASCII)


def url_problem(url: str) -> str | None:
    """Why a webhook URL is refused (control characters, non-ASCII, a host spelled oddly, a
    port outside 1-65535), or None. The scheme and credentials are checked by the model."""
    if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in url):
        return "must not contain control characters"
    if not url.isascii():
        return "must be ASCII (percent-encode other characters, punycode for host names)"
    found = _URL_RE.match(url)
    if found is None:
        return "must be an absolute http:// or https:// URL"
    authority = found["authority"].rpartition("@")[2]
    if authority.startswith("["):
        end = authority.find("]") + 1
        host, rest = (authority[:end], authority[end:]) if end else (authority, "")
    else:
        host, _, port = authority.partition(":")
        rest = f":{port}" if ":" in authority else ""
    if rest and (not rest.startswith(":") or not _PORT_RE.match(rest[1:])):
        return "port must be a number between 1 and 65535"
    if rest and not 1 <= int(rest[1:]) <= 65535:
        return "port must be a number between 1 and 65535"
    return host_problem(host)


#: What local setups allow (``cronbus dev``, the tests, the bench): sinks on loopback.
LOOPBACK = ("127.0.0.0/8", "::1/128")
LOOPBACK_NETWORKS = ",".join(LOOPBACK)
