"""Signals, reloads and the one-daemon-per-runtime-directory lock, on real daemon processes."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from conftest import metric_value, wait_for


def log_events(d, msg: str) -> list[dict]:
    out = []
    for line in d.log().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("msg") == msg:
            out.append(entry)
    return out


def reloads(d, outcome: str) -> float:
    return metric_value(d.scrape(), "sentinel_config_reloads_total", outcome=outcome) or 0.0


# -- signals --------------------------------------------------------------------------------------------
def test_a_storm_of_sighups_then_sigterm_exits_cleanly(tmp_path, sim_state, start_daemon):
    """A handler that called Event.set() could be re-entered by the next signal while it held the
    Event's lock: the nested call waited forever on its own thread's lock, which hung the daemon
    (SIGTERM included) when the storm stopped there, or overflowed the stack while it went on.
    Two seconds of SIGHUPs (hundreds of thousands; bounded in time and count), then one SIGTERM:
    the daemon is alive, has reloaded, and exits 0 within a few seconds."""
    cfg = tmp_path / "c.toml"
    cfg.write_text("[daemon]\npoll_interval_seconds = 0.02\n")
    d = start_daemon("--simulate", str(sim_state), "--config", str(cfg))
    sent, end = 0, time.monotonic() + 2.0
    while sent < 2_000_000 and time.monotonic() < end and d.proc.poll() is None:
        for _ in range(1000):
            os.kill(d.proc.pid, signal.SIGHUP)
        sent += 1000
    assert d.proc.poll() is None, f"died after {sent} SIGHUPs: {d.log()[-2000:]}"
    wait_for(lambda: reloads(d, "ok") >= 1, what="a reload applied")
    t0 = time.monotonic()
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(timeout=10) == 0, d.log()[-2000:]
    assert time.monotonic() - t0 < 5
    assert not log_events(d, "config reload rejected, keeping the old config")


BAD_FILES = [
    ("xid_superscript", "[daemon]\npoll_interval_seconds = 0.2\n[policy]\nxid_overrides = { \"\u00b2\" = \"alert\" }\n",
     "policy.xid_overrides"),
    ("nan", "[daemon]\npoll_interval_seconds = nan\n", "daemon.poll_interval_seconds"),
    ("huge", "[daemon]\npoll_interval_seconds = 1e308\n", "daemon.poll_interval_seconds"),
    ("negative_limit", "[daemon]\npoll_interval_seconds = 0.2\n[policy]\nretired_pages_limit = -1\n",
     "policy.retired_pages_limit"),
    ("latin1", b"[daemon]\nnode_name = \"n\xe9ud\"\n", "not a UTF-8 text file"),
]


def test_sighup_with_a_bad_file_keeps_the_daemon_and_its_config(tmp_path, sim_state, start_daemon):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[daemon]\npoll_interval_seconds = 0.2\n")
    d = start_daemon("--simulate", str(sim_state), "--config", str(cfg))
    for n, (name, content, named) in enumerate(BAD_FILES, start=1):
        if isinstance(content, bytes):
            cfg.write_bytes(content)
        else:
            cfg.write_text(content)
        d.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: reloads(d, "rejected") == n, what=f"{name}: rejected reload counted")
        rejected = log_events(d, "config reload rejected, keeping the old config")
        assert len(rejected) == n and named in rejected[-1]["error"], rejected
        assert rejected[-1]["reload_outcome"] == "rejected" and rejected[-1]["config"] == str(cfg)
        assert d.proc.poll() is None, f"{name}: the daemon died: {d.log()}"
    assert reloads(d, "ok") == 0  # nothing was applied
    # still polling under the old config: the iteration counter of status.json moves on
    t = d.status["time"]
    wait_for(lambda: d.status["time"] > t, what="polls go on")
    # and the old config is what a good file is compared with: only the policy change is applied
    cfg.write_text("[daemon]\npoll_interval_seconds = 0.2\n[policy]\nretired_pages_limit = 60\n")
    d.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: reloads(d, "ok") == 1, what="good reload applied")
    done = log_events(d, "config reload")[-1]
    assert done["applied"] == ["policy"] and done["needs_restart"] == [] and done["reload_outcome"] == "ok"
    assert d.stop() == 0


def test_reload_applies_live_keys_and_names_those_that_need_a_restart(tmp_path, sim_state, start_daemon):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[daemon]\npoll_interval_seconds = 0.2\n")
    d = start_daemon("--simulate", str(sim_state), "--config", str(cfg))
    cfg.write_text("[daemon]\npoll_interval_seconds = 0.1\nlog_level = \"debug\"\n"
                   "[ebpf]\nrank_signals = false\n[actions]\ndrain = false\n")
    d.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: reloads(d, "partial") == 1, what="partial reload counted")
    done = log_events(d, "config reload")[-1]
    assert done["reload_outcome"] == "partial" and done["level"] == "warning"
    assert sorted(done["applied"]) == ["actions", "daemon.log_level", "daemon.poll_interval_seconds"]
    assert done["needs_restart"] == ["ebpf.rank_signals"]
    # the restart is still pending on the next reload of the same file; nothing else changes
    d.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: reloads(d, "partial") == 2, what="second partial reload counted")
    again = log_events(d, "config reload")[-1]
    assert again["applied"] == [] and again["needs_restart"] == ["ebpf.rank_signals"]
    assert reloads(d, "rejected") == 0 and d.proc.poll() is None


# -- one daemon per runtime directory -------------------------------------------------------------------
def test_a_second_daemon_on_the_same_runtime_dir_touches_nothing(tmp_path, sim_state, start_daemon):
    from sentinel.channel import send_raw

    first = start_daemon("--simulate", str(sim_state))
    sock = first.runtime_dir / "daemon.sock"
    inode = sock.stat().st_ino
    status_pid = first.status["pid"]
    second = start_daemon("--simulate", str(sim_state), runtime_dir=first.runtime_dir, wait=False)
    assert second.proc.wait(timeout=30) == 2
    err = second.log().strip()
    assert err.count("\n") == 0, err
    assert f"pid {first.proc.pid}" in err and str(first.runtime_dir) in err and "Traceback" not in err
    assert sock.stat().st_ino == inode and first.status["pid"] == status_pid == first.proc.pid
    # the first daemon still receives on its socket: a malformed ack is read and counted
    before = metric_value(first.scrape(), "sentinel_channel_messages_total", kind="ack", outcome="malformed") or 0
    send_raw(sock, b"{not json")
    wait_for(lambda: (metric_value(first.scrape(), "sentinel_channel_messages_total", kind="ack",
                                   outcome="malformed") or 0) == before + 1, what="first daemon reads its socket")
    assert first.stop() == 0
    # once it is gone, the lock is free again
    third = start_daemon("--simulate", str(sim_state), runtime_dir=first.runtime_dir, wait=False)
    wait_for(lambda: third.proc.poll() is None and third.status["pid"] == third.proc.pid, timeout=20,
             what="a new daemon on the freed runtime directory")
    assert (first.runtime_dir / "daemon.lock").read_text() == f"{third.proc.pid}\n"


@pytest.mark.parametrize("plant", ["symlink", "foreign_owner", "hardlink"])
def test_an_untrusted_lock_file_is_refused(tmp_path, sim_state, start_daemon, plant):
    if os.geteuid() != 0:
        pytest.skip("chown needs root")
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o755)
    lock = runtime / "daemon.lock"
    target = tmp_path / "precious"
    target.write_text("keep me\n")
    if plant == "symlink":
        lock.symlink_to(target)
    elif plant == "hardlink":
        os.link(target, lock)
    else:
        lock.write_text("")
        os.chown(lock, 65534, 65534)
    d = start_daemon("--simulate", str(sim_state), runtime_dir=runtime, wait=False)
    assert d.proc.wait(timeout=30) == 2
    assert "daemon.lock" in d.log() and "Traceback" not in d.log()
    assert target.read_text() == "keep me\n"
    assert not (runtime / "daemon.sock").exists() and not (runtime / "status.json").exists()


def test_the_runtime_dir_is_created_with_the_lock_inside(tmp_path, sim_state, start_daemon):
    runtime = tmp_path / "not" / "yet"
    d = start_daemon("--simulate", str(sim_state), runtime_dir=runtime)
    st = (runtime / "daemon.lock").stat()
    assert (st.st_mode & 0o777) == 0o600 and (runtime.stat().st_mode & 0o777) == 0o755
    assert (runtime / "daemon.lock").read_text() == f"{d.proc.pid}\n"
