"""The kernel-log signature catalog: every line of the public corpus classified as expected,
benign look-alikes match nothing, user text cannot forge a signature, the parser never raises."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from sentinel import signatures
from sentinel.sources.xid import MAX_BPF_PREFIXES, XidSource, prefix_cflags

CORPUS = tomllib.loads((Path(__file__).parent / "corpus" / "kernel_lines.toml").read_text())["line"]
CATALOG = signatures.default_catalog()


def test_the_corpus_has_sources_and_both_kinds_of_line():
    assert len(CORPUS) >= 50
    for entry in CORPUS:
        assert set(entry) <= {"text", "kind", "bus", "xid", "source"}, entry
        assert entry["source"].strip(), entry["text"]
    kinds = {e["kind"] for e in CORPUS}
    assert "" in kinds and len([e for e in CORPUS if not e["kind"]]) >= 20  # the look-alikes
    # every kind the issue names is in the corpus at least once
    assert {"gpu_fallen_off_bus", "gsp_timeout", "rm_init_failed", "reset_required", "nvswitch_sxid", "host_memory_ue",
            "host_memory_ce", "machine_check", "hardware_error_fatal", "pcie_aer_uncorrected", "pcie_aer_corrected",
            "xid", "gsp_pmu_halted", "nvlink_discovery_failed", "rm_assertion", "host_memory_error_reported",
            "machine_check_uncorrected", "hardware_error_reported"} <= kinds


def records_of(text: str) -> list[signatures.Match]:
    """The catalog's matches for a corpus text read as ``sentinel scan`` reads a log: its lines
    through the one log-format reader and the record assembly (sentinel/records.py)."""
    from sentinel.scan import KernelLogStats, logical_lines

    lines = enumerate(text.split("\n"), 1)
    matches = (CATALOG.classify(record) for _, record in logical_lines(lines, KernelLogStats("corpus"), CATALOG))
    return [m for m in matches if m is not None]


@pytest.mark.parametrize("entry", CORPUS, ids=[f"{i}:{e['kind'] or 'benign'}" for i, e in enumerate(CORPUS)])
def test_corpus_line_is_classified_as_expected(entry):
    found = records_of(entry["text"])
    if not entry["kind"]:
        assert found == [], f"a look-alike matched {found}"
        return
    assert [m.kind for m in found] == [entry["kind"]], found
    m = found[0]
    if "bus" in entry:
        assert m.pci_bus_id == entry["bus"]
    if "xid" in entry:
        assert m.xid == entry["xid"]
    assert m.severity in (*signatures.SEVERITIES, "xid") and m.action in (*signatures.ACTIONS, "xid")
    if "\n" not in entry["text"]:  # one line: the catalog's own line reader agrees
        assert CATALOG.classify_line(entry["text"]) == m


def message_of(entry) -> str:
    from sentinel.sources.xidparse import strip_prefix

    return strip_prefix(entry["text"])


MATCHING = [e for e in CORPUS if e["kind"] and "\n" not in e["text"]]  # one line each


@pytest.mark.parametrize("entry", MATCHING, ids=[e["kind"] for e in MATCHING])
def test_user_text_cannot_forge_a_signature(entry):
    """Kernel messages that start with a task name ("<comm>[pid]: segfault at ...", comm <= 15
    characters) or that quote user text anywhere after their start never classify."""
    msg = message_of(entry)
    comm = msg[:15]
    assert CATALOG.classify(f"{comm}[4242]: segfault at 0 ip 0000000000401000 sp 00007ffd00000000 error 4 in a.out") is None
    assert CATALOG.classify(f"process 'sh' launched '/tmp/{msg}' with NULL argv: empty string added") is None
    sig = signature_of(entry)
    # anchored: never searched for further in (a family any driver prints starts with the driver's name,
    # so it is text before that name that must break it)
    assert CATALOG.classify(("x " if sig.needle else "x") + msg) is None


def signature_of(entry) -> signatures.Signature:
    m = CATALOG.classify_line(entry["text"])
    return next(s for s in CATALOG.signatures if s.name == m.signature)


def test_every_signature_has_a_corpus_line_and_starts_with_its_prefix():
    seen = {CATALOG.classify_line(e["text"]).signature for e in MATCHING}
    for sig in CATALOG.signatures:
        if sig.name in ("nvswitch_sxid_fatal", "mce_exception", "ghes_corrected"):
            continue  # driver/kernel strings without a public sample line in the corpus (their sources say why)
        assert sig.name in seen, f"{sig.name}: add a real line to tests/corpus/kernel_lines.toml"
    for e in MATCHING:
        sig = signature_of(e)
        msg = message_of(e).replace("\\x0a", "\n")
        assert msg.startswith(sig.prefixes) or (sig.needle is not None and sig.needle in msg)


def test_prefixes_fit_the_ebpf_filter_as_cflags():
    prefixes = CATALOG.prefixes()
    assert 1 <= len(prefixes) <= MAX_BPF_PREFIXES
    assert all(len(p) <= signatures.MAX_PREFIX for p in prefixes)
    flags = prefix_cflags(prefixes)
    assert flags["PREFIX_0"] == f'"{prefixes[0]}"' and len(flags) == len(prefixes)
    # every corpus line that classifies passes the kernel-side filter, but a family any driver prints
    # from another driver than the port's or the GPU's (the daemon reads AER from ras:aer_event there)
    for e in MATCHING:
        assert message_of(e).startswith(prefixes) or signature_of(e).needle, e["text"]
    assert "NVRM: Xid (" not in CATALOG.prefixes(without_xid=True) and "NVRM" in CATALOG.prefixes(without_xid=True)
    with pytest.raises(ValueError):
        prefix_cflags(tuple(f"p{i}" for i in range(MAX_BPF_PREFIXES + 1)))


@pytest.mark.parametrize("mutation,error", [
    (lambda t: t.replace('name = "edac_ce"', 'name = "edac_ue"'), r"edac_ue.* used twice"),
    (lambda t: t.replace('severity = "warning"', 'severity = "meh"', 1), r"severity must be one of"),
    (lambda t: t.replace('source = "https://github.com/Bumblebee-Project/Bumblebee/issues/554 (older drivers)"',
                         'source = "x"\ncolour = "red"'), r"unknown key 'colour'"),
    (lambda t: t.replace("pattern = 'mce: CPUs not responding", "pattern = 'mce: (CPUs not responding"),
     r"mce_broadcast_timeout.*pattern does not compile"),
    (lambda t: t.replace('prefix = "EDAC "', 'prefix = "say \\"hi\\""', 1), r"prefix must be"),
    (lambda t: t + "\n[extra]\nx = 1\n", r"unknown table 'extra'"),
    (lambda t: t.replace('needle = "AER: "', '', 1), r"aer_uncorrected.*prefix '\*' and needle"),
    (lambda t: t.replace('prefix = ["pcieport ", "nvidia ", "*"]', 'prefix = ["pcieport ", "nvidia "]', 1),
     r"prefix '\*' and needle \(a literal the message contains\) go together"),
    (lambda t: t.replace('joins = ["NVRM: (PCI ID: "', 'joins = [7, "NVRM: (PCI ID: "', 1), r"joins must be a list"),
])
def test_a_wrong_catalog_is_refused_naming_the_entry(mutation, error):
    text = (Path(signatures.__file__).parent / "signatures.toml").read_text()
    changed = mutation(text)
    assert changed != text
    with pytest.raises(signatures.CatalogError, match=error):
        signatures.parse(changed, "test.toml")


def test_an_unreadable_catalog_is_a_clear_error(tmp_path):
    with pytest.raises(signatures.CatalogError, match=r"cannot read"):
        signatures.load(tmp_path / "missing.toml")


LINES = st.one_of(
    st.text(max_size=300),
    st.builds(lambda p, s: p + s, st.sampled_from([*CATALOG.prefixes(), "NVRM: GPU 0000:", "[ 12.3] ", "<3>",
                                                    "4,1,2,-;", "Nov 30 05:02:27 h kernel: "]),
              st.text(max_size=200)),
    st.sampled_from([e["text"] for e in CORPUS]).flatmap(
        lambda t: st.integers(0, len(t)).map(lambda i: t[:i] + "\x00\ud800\\x0a" + t[i:])),
)


@settings(max_examples=800, deadline=None)
@given(LINES)
def test_the_classifier_never_raises(line):
    for result in (CATALOG.classify_line(line), CATALOG.classify(line)):
        assert result is None or isinstance(result, signatures.Match)
    assert CATALOG.classify(None) is None and CATALOG.classify_line(b"bytes") is None


def test_kmsg_path_turns_matches_into_events_for_the_gpu_its_port_or_the_node(tmp_path):
    """Per-GPU where the bus id, or the PCIe port above exactly one GPU, maps to a GPU; else the node's."""
    devices = tmp_path / "devices"
    tree = tmp_path / "sys" / "pci0000:00" / "0000:00:01.0" / "0000:01:00.0" / "0000:02:08.0"
    for gpu, port in (("0000:18:00.0", "0000:02:08.0"), ("0000:2a:00.0", "0000:02:10.0")):
        (tree.parent / port / gpu).mkdir(parents=True, exist_ok=True)
    devices.mkdir()
    for path in (tree.parent / "0000:02:08.0" / "0000:18:00.0", tree.parent / "0000:02:10.0" / "0000:2a:00.0",
                 tree.parent / "0000:02:08.0", tree.parent, tree.parent.parent):
        (devices / path.name).symlink_to(path)
    src = XidSource(use_ebpf=False, kmsg_fallback=False, pci_devices=devices)
    src.set_gpus({"0000:18:00.0": 0, "0000:2a:00.0": 1})
    assert src.port_to_gpu == {"0000:02:08.0": 0, "0000:02:10.0": 1}  # 01:00.0 and 00:01.0 are above both
    src._on_line("NVRM: GPU 0000:2a:00.0: GPU has fallen off the bus.")
    src._on_line("pcieport 0000:02:08.0: PCIe Bus Error: severity=Uncorrected (Non-Fatal), type=Transaction Layer, (Requester ID)")
    src._on_line("pcieport 0000:00:01.0: PCIe Bus Error: severity=Uncorrected (Fatal), type=Transaction Layer, (Requester ID)")
    src._on_line("EDAC MC0: 1 UE memory read error on CPU_SrcID#0_Ha#0_Chan#1_DIMM#0")
    src._on_line("process 'sh' launched '/tmp/NVRM: GPU 0000:18:00.0: GPU has fallen off the bus.' with NULL argv")
    src._on_line("usb 1-1: new high-speed USB device")
    xids, events = src.drain()
    assert xids == []
    assert [(e.detail["kind"], e.gpu, e.detail["action"]) for e in events] == [
        ("gpu_fallen_off_bus", 1, "migrate"), ("pcie_aer_nonfatal", 0, "alert"),  # non-fatal: the link survives
        ("pcie_aer_uncorrected", None, "snapshot"), ("host_memory_ue", None, "snapshot")]
    counts = src.counters()
    assert counts[("sentinel_kernel_events", (("source", "kmsg"), ("kind", "gpu_fallen_off_bus")))] == 1
    assert counts[("sentinel_kernel_events", (("source", "kmsg"), ("kind", "pcie_aer_uncorrected")))] == 1
    assert counts[("sentinel_kernel_events", (("source", "kmsg"), ("kind", "pcie_aer_nonfatal")))] == 1
    assert counts[("sentinel_kernel_events", (("source", "kmsg"), ("kind", "line")))] == 6


def test_policy_migrates_the_gpu_of_a_fallen_off_the_bus_line_and_snapshots_on_edac_ue():
    from sentinel.config import PolicyConfig
    from sentinel.policy import NODE, Health, Policy, PolicyState
    from sentinel.readings import GpuReading, KernelEvent, NodeReadings

    gone = KernelEvent("kernel_log", "kmsg", {"kind": "gpu_fallen_off_bus", "severity": "critical", "action": "migrate",
                                              "message": "NVRM: GPU 0000:2a:00.0: GPU has fallen off the bus."}, gpu=1)
    ue = KernelEvent("kernel_log", "kmsg", {"kind": "host_memory_ue", "severity": "critical", "action": "snapshot",
                                            "message": "EDAC MC0: 1 UE memory read error", "count": 1})
    ce = KernelEvent("kernel_log", "kmsg", {"kind": "host_memory_ce", "severity": "info", "action": "alert", "message": "CE"})
    gpus = tuple(GpuReading(i, f"GPU-{i}", f"0000:{b}:00.0") for i, b in ((0, "18"), (1, "2a")))
    state, trips = Policy(PolicyConfig()).decide(PolicyState(), NodeReadings(0, "t", gpus, kernel_events=(gone, ue, ce)), 1.0)
    assert [(t.rule, t.action, t.gpu) for t in trips] == [("kernel_log", "migrate", 1), ("kernel_log", "snapshot", NODE)]
    assert state.gpus[1].health == Health.FAILED and state.gpus.get(0) is None or state.gpus[0].health == Health.HEALTHY
    assert re.search(r"fallen off the bus", trips[0].message) and trips[1].cause == "host_memory:uncorrected"
