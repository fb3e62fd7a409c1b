from __future__ import annotations

import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sentinel.sources.xidparse import XidReport, format_line, parse, parse_message

XID79 = "NVRM: Xid (PCI:0000:18:00): 79, pid=1, name=x, GPU has fallen off the bus."

LINES = [
    ("[ 1234.567890] NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python3, GPU has fallen off the bus.",
     XidReport("0000:3b:00.0", 79, 1234, "python3", "GPU has fallen off the bus")),
    ("[Mon Nov 30 05:02:27 2026] NVRM: Xid (PCI:0001:c1:00): 13, pid='<unknown>', name=<unknown>, Graphics Exception: ESR 0x1",
     XidReport("0001:c1:00.0", 13, None, "<unknown>", "Graphics Exception: ESR 0x1")),
    ("Nov 30 05:02:27 gpu-node-17 kernel: NVRM: Xid (0000:01:00): 13, 0000 00000000 0000a1c0 00000004",
     XidReport("0000:01:00.0", 13, None, "", "0000 00000000 0000a1c0 00000004")),
    ("2026-11-30T05:02:27.123456+00:00 gpu-node-17 kernel: NVRM: Xid (PCI:0000:5d:00): 48, pid=77, name=train, "
     "An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at partition 0, subpartition 0.",
     XidReport("0000:5d:00.0", 48, 77, "train", "An uncorrectable double bit error (DBE) has been detected on GPU in the "
               "framebuffer at partition 0, subpartition 0")),
    ("NVRM: Xid (PCI:0000:18:00): 94, pid=9, name=a.out, Contained: CE User Channel (0x9). RST: No, D-RST: No",
     XidReport("0000:18:00.0", 94, 9, "a.out", "Contained: CE User Channel (0x9). RST: No, D-RST: No")),
    ("<4>NVRM: Xid (PCI:0000:9a:00): 119, pid=2, name=kworker, Timeout after 6s of waiting for RPC response;",
     XidReport("0000:9a:00.0", 119, 2, "kworker", "Timeout after 6s of waiting for RPC response")),
    ("NVRM: Xid (PCI:0000:ab:00): 64", XidReport("0000:ab:00.0", 64, None, "", "")),
]


@pytest.mark.parametrize("line,want", LINES)
def test_real_log_shapes(line, want):
    assert parse(line) == want


@pytest.mark.parametrize("line", ["", "NVRM: GPU at PCI:0000:3b:00: GPU-abc", "NVRM: Xid (PCI:zz): 79",
                                  "NVRM: Xid (PCI:0000:3b:00): notanumber", "kernel: usb 1-1: new device"])
def test_non_xid_lines(line):
    assert parse(line) is None


@settings(max_examples=400, deadline=None)
@given(st.text())
def test_never_raises_on_arbitrary_input(text):
    parse(text)
    parse("NVRM: Xid (" + text)


reports = st.builds(
    XidReport,
    pci_bus_id=st.builds(lambda d, b: f"{d:04x}:{b:02x}:00.0", st.integers(0, 0xFFFF), st.integers(0, 255)),
    xid=st.integers(1, 99999),
    pid=st.one_of(st.none(), st.integers(0, 2**22)),
    process=st.text(string.ascii_letters + string.digits + "_-./", min_size=1, max_size=15),
    message=st.text(string.ascii_letters + string.digits + " :()_-", max_size=80).map(str.strip).filter(
        lambda m: not m.startswith(("pid=", "name="))),
)
prefixes = st.sampled_from(["", "[ 8.123456] ", "[Mon Nov 30 05:02:27 2026] ", "Nov 30 05:02:27 host kernel: ",
                            "2026-11-30T05:02:27.123456+00:00 host kernel: ", "<4>"])


@settings(max_examples=400, deadline=None)
@given(reports, prefixes, st.sampled_from(["", ".", ";"]))
def test_round_trip(report, prefix, punct):
    assert parse(prefix + format_line(report) + punct) == report


def test_driver_tracepoint_event_goes_through_the_same_parser():
    """nvidia:nvidia_dev_xid (absent on this VM) hands (dev, error_code, msg); the loader rebuilds the
    driver's line and parses it like the printk path."""
    from types import SimpleNamespace

    from sentinel.sources.xid import XidSource

    src = XidSource(use_ebpf=False, kmsg_fallback=False)
    src.set_gpus({"0000:3b:00.0": 2})
    src._on_driver_tracepoint(SimpleNamespace(dev=b"0000:3b:00.0\0junk", error_code=79,
                                              msg=b"pid=77, name=train, GPU has fallen off the bus.\0"))
    (event,), _ = src.drain()
    assert (event.gpu, event.xid, event.pid, event.process, event.message) == (2, 79, 77, "train",
                                                                               "GPU has fallen off the bus")


# The kernel's own message, echoing a file name a user chose (fs/exec.c, execve with NULL argv).
SPOOF = ("process 'sh' launched '/tmp/NVRM: Xid (PCI:0000:18:00): 79, pid=1, name=x, GPU has fallen off the bus.' "
         "with NULL argv: empty string added")


@pytest.mark.parametrize("prefix", ["", "[ 8.123456] ", "[Mon Nov 30 05:02:27 2026] ", "Nov 30 05:02:27 host kernel: ",
                                    "2026-11-30T05:02:27.123456+00:00 host kernel: ", "<4>", "6,1234,5678,-;"])
def test_xid_text_echoed_inside_a_kernel_message_is_not_a_report(prefix):
    assert parse(prefix + SPOOF) is None
    assert parse_message(prefix + SPOOF) is None


@pytest.mark.parametrize("junk", ["x ", "sh: ", "kernel: x ", "[ 8.1] x ", "Nov 30 05:02:27 host sshd: ", "<4>x ",
                                  "6,1,2,-;x ", "[drm] ", "host kernel: ", "<14>", "14,1,2,-;",
                                  "user  :warn  : [ 8.1] ", "Nov 30 05:02:27 host sshd[7]: "])
def test_only_the_documented_prefixes_may_stand_before_the_report(junk):
    assert parse(junk + XID79) is None


@pytest.mark.parametrize("prefix", ["Nov 30 05:02:27 host kernel: [ 1234.567890] ", "<4>[ 1234.567890] ", "kernel: ",
                                    "Nov 3 05:02:27 kernel: ", "Nov 03 05:02:27.123456 host kernel: ",
                                    "[Nov 3 05:02] ", "[  +0.000123] ", "kern  :warn  : [ 1234.567890] ",
                                    "2026-11-30T05:02:27,123456+00:00 ", "[ 1234.567890 <    0.000123>] ",
                                    "[    1.234567] host kernel: ", "Mon 2026-11-30 05:02:27 UTC host kernel: ",
                                    "1764478947.123456 host kernel: ",
                                    "6,1234,5678,-,caller=T42;", "2026-11-30T05:02:27Z host kernel: "])
def test_combined_and_extended_prefixes_still_parse(prefix):
    assert parse(prefix + XID79) == XidReport("0000:18:00.0", 79, 1, "x", "GPU has fallen off the bus")


def test_a_bare_kernel_message_takes_no_prefix_at_all():
    """The kernel paths hand over the message text alone: nothing may precede the marker."""
    assert parse_message(XID79) == XidReport("0000:18:00.0", 79, 1, "x", "GPU has fallen off the bus")
    assert parse_message("[ 8.123456] " + XID79) is None
    assert parse_message("<4>" + XID79) is None


def test_the_kmsg_path_ignores_the_spoof_and_counts_it():
    from sentinel.sources.xid import XidSource

    src = XidSource(use_ebpf=False, kmsg_fallback=False)
    src.set_gpus({"0000:18:00.0": 0})
    src._on_line(SPOOF)
    src._on_line(XID79)
    xids, _ = src.drain()
    assert [(x.gpu, x.xid) for x in xids] == [(0, 79)]
    counters = src.counters()
    assert counters[("sentinel_kernel_events", (("source", "kmsg"), ("kind", "xid_not_at_start")))] == 1
    assert counters[("sentinel_kernel_events", (("source", "kmsg"), ("kind", "xid")))] == 1
    assert ("sentinel_kmsg_malformed_lines", (("source", "kmsg"),)) not in counters


@pytest.mark.parametrize("dev", ["0000:18:00.0): 79, x", "NVRM", "", "0000:18:00.0 "])
def test_driver_tracepoint_with_a_device_name_that_is_not_a_pci_name_is_refused(dev):
    from types import SimpleNamespace

    from sentinel.sources.xid import XidSource

    src = XidSource(use_ebpf=False, kmsg_fallback=False)
    src._on_driver_tracepoint(SimpleNamespace(dev=dev.encode() + b"\0", error_code=13, msg=b"pid=1, name=x, m\0"))
    assert src.drain() == ([], [])
    assert src.counters()[("sentinel_kmsg_malformed_lines", (("source", "ebpf_xid"),))] == 1
