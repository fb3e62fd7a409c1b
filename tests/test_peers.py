"""Hang verdicts between daemons (sentinel.peers): a verdict naming another node reaches that
node's daemon as a report of its own ranks; a datagram without the job's key, addressed to
another node, stale or replayed is refused; a verdict is never forwarded on by its receiver."""

from __future__ import annotations

import json
import os
import time

import pytest

from sentinel import peers
from sentinel.channel import Report
from sentinel.jobhealth import JobHealth
from sentinel_tools.ports import free_ports

KEY = b"k" * 32
VERDICT = {"kind": "stopped", "culprits": [2, 3], "hosts": ["node1"], "evidence": "ranks 2-3 did not answer"}


def body(**over) -> dict:
    b = {"v": 1, "kind": "hang", "from": "node0", "to": "node1", "time": 1000.0, "nonce": "n1", "rank": 0, "step": 25,
         "verdict": VERDICT}
    return {**b, **over}


def test_a_signed_fresh_message_for_this_node_verifies_once():
    seen: dict[str, float] = {}
    assert peers.verify(KEY, peers.sign(KEY, body()), node="node1", now=1010.0, seen=seen)["verdict"] == VERDICT
    with pytest.raises(peers.PeerError, match="replayed"):
        peers.verify(KEY, peers.sign(KEY, body()), node="node1", now=1010.0, seen=seen)


@pytest.mark.parametrize("data, why", [
    (peers.sign(b"x" * 32, body()), "bad MAC"),
    (peers.sign(KEY, body(to="node2")), "not this node"),
    (peers.sign(KEY, body(time=900.0)), "stale"),
    (peers.sign(KEY, body(kind="straggler")), "unknown message"),
    (b'{"body": "{}", "mac": 1}', "not a peer message"),
    (b"x" * 5000, "too large"),
])
def test_what_must_not_be_acted_on_is_refused(data, why):
    with pytest.raises(peers.PeerError, match=why):
        peers.verify(KEY, data, node="node1", now=1000.0, seen={})


def test_a_tampered_body_fails_its_mac():
    outer = json.loads(peers.sign(KEY, body()))
    outer["body"] = outer["body"].replace('"node1"', '"node2"', 1)
    with pytest.raises(peers.PeerError, match="bad MAC"):
        peers.verify(KEY, json.dumps(outer).encode(), node="node2", now=1000.0, seen={})


def test_the_key_file_must_be_root_s_and_private(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("the key file's owner check needs root (the daemon runs as root)")
    key = tmp_path / "key"
    key.write_text("0123456789abcdef0123")
    key.chmod(0o644)
    with pytest.raises(peers.PeerError, match="mode 0600"):
        peers.read_key(key)
    key.chmod(0o600)
    assert peers.read_key(key) == b"0123456789abcdef0123"
    key.write_text("short")
    with pytest.raises(peers.PeerError, match="shorter"):
        peers.read_key(key)


def test_a_verdict_naming_another_node_reaches_its_daemon_and_trips_the_hand_over(tmp_path):
    p0, p1 = free_ports(2)
    table = tmp_path / "peers.json"
    table.write_text(json.dumps({"node0": f"127.0.0.1:{p0}", "node1": f"127.0.0.1:{p1}"}))
    node0 = peers.Peers("node0", KEY, ("127.0.0.1", p0), table)
    node1 = peers.Peers("node1", KEY, ("127.0.0.1", p1), table)
    try:
        heard = Report("hang", 0, 25, dict(VERDICT))  # node0's rank 0 reported it to node0's daemon
        assert node0.forward(heard) == ["node1"]
        got: list[Report] = []
        end = time.monotonic() + 10
        while not got and time.monotonic() < end:
            got = node1.receive()
            time.sleep(0.01)
        assert len(got) == 1 and got[0].detail["hosts"] == ["node1"] and got[0].step == 25
        assert "forwarded by node0's daemon" in got[0].detail["evidence"]
        trips = JobHealth("node1").observe(got, 1000.0)
        assert [(t.rule, t.action) for t in trips] == [("hang", "migrate")]
        # the culprit's daemon never sends it on: it names only itself, and forward() skips this node
        assert node1.forward(got[0]) == []
        assert node0.receive() == []
    finally:
        node0.close()
        node1.close()


def test_undecided_or_own_verdicts_are_not_forwarded(tmp_path):
    (port,) = free_ports(1)
    table = tmp_path / "peers.json"
    table.write_text(json.dumps({"node1": "127.0.0.1:9"}))
    node0 = peers.Peers("node0", KEY, ("127.0.0.1", port), table)
    try:
        assert node0.forward(Report("hang", 0, 25, {**VERDICT, "kind": "unknown"})) == []
        assert node0.forward(Report("hang", 0, 25, {**VERDICT, "hosts": ["node0"]})) == []
        assert node0.forward(Report("straggler", 0, 25, {"relative": 1.5})) == []
    finally:
        node0.close()


def test_no_key_configured_costs_nothing():
    from sentinel.config import JobConfig

    p = peers.from_config("node0", JobConfig())
    assert isinstance(p, peers.NullPeers) and p.forward(Report("hang", 0, 1, dict(VERDICT))) == [] and p.receive() == []


def test_a_peer_key_without_its_peers_file_or_listen_address_is_a_config_error():
    from sentinel import config

    with pytest.raises(config.ConfigError, match="job.peers_file"):
        config.parse('[job]\npeer_key_file = "/etc/sentinel/peer.key"\npeer_listen_address = "10.0.0.1:9470"\n')
    with pytest.raises(config.ConfigError, match="job.peer_listen_address"):
        config.parse('[job]\npeer_key_file = "/k"\npeers_file = "/p"\npeer_listen_address = "10.0.0.1"\n')
    ok = config.parse('[job]\npeer_key_file = "/k"\npeers_file = "/p"\npeer_listen_address = "[fd00::1]:9470"\n')
    assert ok.job.peer_listen_address == "[fd00::1]:9470"
