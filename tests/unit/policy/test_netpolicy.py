"""Where webhooks may go: the address policy and the spelling of URL hosts (pure)."""

from __future__ import annotations

import ipaddress
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.contract import commands, validation
from shared.contract.errors import ValidationFailed
from shared.policy import netpolicy

DEFAULT = netpolicy.AddressPolicy()
#: Each network the contract names as denied unless allowed, with one of its addresses.
PINNED = [
    "127.0.0.0/8",
    "::1/128",
    "10.0.0.0/8",
    "172.16.0.0/12",
    "192.168.0.0/16",
    "169.254.0.0/16",
    "fe80::/10",
    "100.64.0.0/10",
    "fc00::/7",
    "0.0.0.0/8",
    "224.0.0.0/4",
    "ff00::/8",
    "240.0.0.0/4",
]


def address_in(network: str) -> st.SearchStrategy[netpolicy.Address]:
    net = ipaddress.ip_network(network)
    first = int(net.network_address)
    kind = type(net.network_address)
    return st.integers(first, first + net.num_addresses - 1).map(kind)


@st.composite
def restricted_ipv4(draw: st.DrawFn) -> ipaddress.IPv4Address:
    network = draw(st.sampled_from([n for n in PINNED if ":" not in n]))
    found = draw(address_in(network))
    assert isinstance(found, ipaddress.IPv4Address)
    return found


@given(st.sampled_from(PINNED).flatmap(lambda n: st.tuples(st.just(n), address_in(n))))
def test_every_pinned_network_is_denied_unless_listed(case: tuple[str, Any]) -> None:
    network, address = case
    assert not DEFAULT.allows(address)
    assert netpolicy.AddressPolicy.from_text([network]).allows(address)
    # A carve-out wins over what is allowed.
    assert not netpolicy.AddressPolicy.from_text([network], [network]).allows(address)


@given(restricted_ipv4())
def test_ipv6_forms_carrying_a_restricted_ipv4_address_are_denied(
    inner: ipaddress.IPv4Address,
) -> None:
    mapped = ipaddress.IPv6Address(f"::ffff:{inner}")
    compatible = ipaddress.IPv6Address(int(inner))
    nat64 = ipaddress.IPv6Address(f"64:ff9b::{inner}")
    sixtofour = ipaddress.IPv6Address((0x2002 << 112) | (int(inner) << 80))
    for form in (mapped, nat64, sixtofour):
        assert not DEFAULT.allows(form), form
    if int(inner) > 0xFFFF:
        assert not DEFAULT.allows(compatible), compatible
    # Allowing the IPv4 network allows its mapped form too: the connection ends up there.
    allowed = netpolicy.AddressPolicy.from_text([f"{inner}/32"])
    assert allowed.allows(mapped)


@given(st.ip_addresses())
def test_only_public_addresses_pass_the_default_policy(address: Any) -> None:
    public = address.is_global and not any(address in ipaddress.ip_network(n) for n in PINNED)
    inner = netpolicy.embedded_ipv4(address)
    if DEFAULT.allows(address):
        assert public, address
        assert inner is None or DEFAULT.allows(inner)


def test_public_addresses_are_allowed() -> None:
    for text in ("93.184.216.34", "8.8.8.8", "2606:4700:4700::1111"):
        assert DEFAULT.allows(ipaddress.ip_address(text)), text


def test_bad_cidrs_are_named() -> None:
    with pytest.raises(ValueError, match=r"'10\.0\.0\.0/33' is not a network"):
        netpolicy.parse_networks(["127.0.0.0/8", "10.0.0.0/33"])


ODD_SPELLINGS = [
    "http://2130706433/",
    "http://0x7f.0.0.1/",
    "http://0x7f000001/",
    "http://127.1/",
    "http://127.0.1/",
    "http://0177.0.0.1/",
    "http://127.000.000.001/",
    "http://[::ffff:127.0.0.1]/",
    "http://[::ffff:7f00:1]/",
    "http://[::127.0.0.1]/",
    "http://\uff11\uff12\uff17.0.0.1/",  # full-width digits
    "http://127.0.0.1\uff0e/",
    "http://example.com:0/",
    "http://example.com:99999/",
    "http://example.com:+80/",
    "http://example.com:8_0/",
    "http://exa\x00mple.com/",
    "http://example.com/a\x7fb",
    "http://example.com/a\x1bb",
    "http://[fe80::1%25eth0]/",
    "http://ex ample.com/",
    "http://-bad-.example/",
]


def upsert_errors(url: str) -> list[dict[str, str]]:
    body = {
        "schedule": {
            "id": "s",
            "spec": {"kind": "interval", "every_s": 60},
            "target": {"kind": "webhook", "url": url},
        }
    }
    with pytest.raises(ValidationFailed) as caught:
        command = validation.parse_command("upsert", body)
        assert isinstance(command, commands.UpsertCommand)
        validation.check_schedule(
            command.schedule, 1, 1_800_000_000_000, validation.TargetPolicy(), namespace="ns"
        )
    return caught.value.details


@pytest.mark.parametrize("url", ODD_SPELLINGS)
def test_odd_spellings_are_refused_at_upsert_with_a_field_error(url: str) -> None:
    details = upsert_errors(url)
    assert [d["field"] for d in details] == ["target.url"], details


@given(st.integers(0, 2**32 - 1))
def test_only_the_canonical_spelling_of_an_ipv4_address_passes(number: int) -> None:
    address = ipaddress.IPv4Address(number)
    octets = [int(o) for o in str(address).split(".")]
    assert netpolicy.host_problem(str(address)) is None
    odd = [
        str(number),
        hex(number),
        ".".join(hex(o) for o in octets),
        ".".join(f"0{o:o}" for o in octets),
        f"{octets[0]}.{(octets[1] << 16) | (octets[2] << 8) | octets[3]}",
    ]
    for spelling in odd:
        if spelling != str(address):
            assert netpolicy.host_problem(spelling) is not None, spelling


def test_plain_hosts_and_ports_pass() -> None:
    for url in (
        "http://billing:8080/remind",
        "https://api.example.com/x?y=1",
        "http://127.0.0.1:65535/",
        "http://[2001:db8::1]:8080/",
        "https://xn--bcher-kva.example/",
        "http://1.2.3.4/",
        "http://a.b-c.d9/",
    ):
        assert netpolicy.url_problem(url) is None, url


def test_literal_addresses_are_checked_at_upsert_against_the_policy() -> None:
    details = upsert_errors("http://10.1.2.3:8080/x")
    assert [d["field"] for d in details] == ["target.url"]
    assert details[0]["reason"].startswith("host 10.1.2.3 is not allowed: ")
    assert "CRONBUS_WEBHOOK_ALLOWED_NETWORKS" in details[0]["reason"]
    allowed = validation.TargetPolicy(allowed_networks=("10.0.0.0/8",))
    command = validation.parse_command(
        "upsert",
        {
            "schedule": {
                "id": "s",
                "spec": {"kind": "interval", "every_s": 60},
                "target": {"kind": "webhook", "url": "http://10.1.2.3:8080/x"},
            }
        },
    )
    assert isinstance(command, commands.UpsertCommand)
    validation.check_schedule(command.schedule, 1, 1_800_000_000_000, allowed, namespace="ns")
