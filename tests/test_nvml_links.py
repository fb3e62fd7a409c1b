"""NVLink counters read link by link only when their totals moved (issue 45: 66 of a GPU's ~85
field values a poll are per-link counters): what the rules see, poll by poll, is what a read of
every link gives, on the simulated H100 and on the pynvml fake; a driver whose totals are not
the sum of the counters read falls back to reading every link every poll."""

from __future__ import annotations

import dataclasses
import random

import pynvml

from fake_pynvml import Err, FakePynvml
from sentinel import config
from sentinel.policy import Policy, PolicyState
from sentinel.readings import NodeReadings, sum_links
from sentinel.sources import simulated
from sentinel.sources.nvml import NvmlSource
from sentinel.sources.nvml_batch import NVLINK_AUDIT_POLLS

KINDS = ("replay", "recovery", "crc_flit", "crc_data")


class Entries:
    """Counts the field values a source asks nvmlDeviceGetFieldValues for (any pynvml look-alike)."""

    def __init__(self, nvml) -> None:
        self._nvml = nvml
        self.entries = 0

    def __getattr__(self, name):
        value = getattr(self._nvml, name)
        if name == "nvmlDeviceGetFieldValues":
            def counted(handle, ids):
                self.entries += len(ids)
                return value(handle, ids)
            return counted
        return value


def started(nvml, **kw) -> NvmlSource:
    src = NvmlSource(nvml, deadline_seconds=2.0, event_wait_ms=20, **kw)
    src.start()
    return src


class Twins:
    """The same GPUs read by a source that reads the totals (gated) and one that reads every link
    every poll (every), each feeding its own policy: ``step`` polls both and checks they agree."""

    def __init__(self, gated_nvml, every_nvml) -> None:
        self.counted = Entries(gated_nvml)
        self.gated = started(self.counted)
        self.every = started(every_nvml, nvlink_totals=False)
        cfg = dataclasses.replace(config.parse("").policy, cooldown_seconds=0.0)
        self.policy = Policy(cfg)
        self.states = [PolicyState(), PolicyState()]
        self.now = 0.0
        self.trips: list[list[tuple[str, str, int]]] = []

    def step(self) -> list:
        self.now += 1.0
        a, b = self.gated.poll(), self.every.poll()
        assert [g.nvlink_sums for g in a] == [g.nvlink_sums for g in b]  # what the rules sum
        # the sums the source made on its reading thread are those of the counters it reports
        assert all(g.summed is not None and g.nvlink_sums == sum_links(g.nvlink) for g in a + b)
        assert [(g.values, g.errors, g.lost, g.hung) for g in a] == [(g.values, g.errors, g.lost, g.hung) for g in b]
        decided = []
        for i, gpus in enumerate((a, b)):
            self.states[i], trips = self.policy.decide(self.states[i], NodeReadings(self.now, "x", tuple(gpus)), self.now)
            decided.append(sorted((t.rule, t.action, t.gpu) for t in trips))
        assert decided[0] == decided[1]
        assert [s.health for s in self.states[0].gpus.values()] == [s.health for s in self.states[1].gpus.values()]
        self.trips.append(decided[0])
        return a

    def close(self) -> None:
        self.gated.close()
        self.every.close()


def _bump(state_path, gpu: int, link: int, kind: str, n: int) -> None:
    with simulated.locked_state(state_path) as state:
        counters = state["gpus"][gpu]["nvlink"][link]
        if kind in counters:
            counters[kind] += n


def test_the_rules_see_what_a_read_of_every_link_gives_on_the_simulated_h100(tmp_path):
    state = tmp_path / "gpus.json"
    simulated.write_state(state, simulated.healthy_state(2))
    twins = Twins(simulated.SimulatedNvml(state, recheck_seconds=0, call_cost_seconds=0),
                  simulated.SimulatedNvml(state, recheck_seconds=0, call_cost_seconds=0))
    rng = random.Random(45)
    try:
        quiet = []
        for poll in range(40):
            moved = poll % 3 == 1
            if moved:  # a few counters move, on any link and kind, on either GPU
                for _ in range(rng.randint(1, 3)):
                    _bump(state, rng.randrange(2), rng.randrange(simulated.NVLINK_LINKS), rng.choice(KINDS), rng.randint(1, 40))
            if 10 <= poll < 16:  # a CRC storm on one link: 150/s for 6 polls (nvlink_crc_rate: 100/s on 3)
                _bump(state, 1, 13, "crc_flit", 150)
                moved = True
            if poll == 30:  # a GPU reset: every counter back to 0
                with simulated.locked_state(state) as s:
                    s["gpus"][0]["nvlink"] = simulated.gpu_state(0)["nvlink"]
                moved = True
            before = twins.counted.entries
            gpus = twins.step()
            assert [g.nvlink for g in gpus] == [g.nvlink for g in twins.every.poll()]  # link by link too
            if not moved and poll > 0:
                quiet.append(twins.counted.entries - before)
        assert any(("nvlink_crc_rate", "migrate", 1) in trips for trips in twins.trips)  # the storm decided
        # a quiet poll asks for the fields and the four totals only: 2 GPUs x 18, not 2 x 84
        assert set(quiet) == {2 * 18}
    finally:
        twins.close()


def test_the_rules_see_what_a_read_of_every_link_gives_on_the_pynvml_fake():
    gated, every = FakePynvml(2), FakePynvml(2)
    twins = Twins(gated, every)
    try:
        assert [len(g.nvlink) for g in twins.step()] == [8, 8]  # 2 links x 4 kinds
        counter = {kind: f"nvlink{getattr(pynvml, 'NVML_NVLINK_ERROR_DL_' + kind.upper())}" for kind in KINDS}
        for poll, (kind, gpu, value) in enumerate([("crc_flit", 0, 3), ("replay", 1, 1), ("crc_data", 0, 2),
                                                   ("recovery", 1, 5), ("crc_flit", 0, 3), ("crc_flit", 0, 0)]):
            for fake in (gated, every):
                fake.behaviour[(counter[kind], gpu)] = value
            got = twins.step()
            assert got[gpu].nvlink_sums[kind] == 2 * value  # both links, as the fake serves a kind
            twins.step()  # and a quiet poll after each
    finally:
        twins.close()


_TOTALS = {getattr(pynvml, f"NVML_FI_DEV_NVLINK_{k}_ERROR_COUNT_TOTAL") for k in ("CRC_FLIT", "CRC_DATA", "REPLAY", "RECOVERY")}


class TotalsOff(FakePynvml):
    """A driver whose NVLink totals are not the sum of the counters read: ``offset`` added to each
    total, and ``link1_crc`` CRC errors on link 1 that its counter shows and its total does not."""

    def __init__(self, gpus: int, offset: int = 0) -> None:
        super().__init__(gpus)
        self.offset = offset
        self.link1_crc = 0

    def nvmlDeviceGetFieldValues(self, h, field_ids):
        values = super().nvmlDeviceGetFieldValues(h, field_ids)
        for fv in values:
            if fv.nvmlReturn != pynvml.NVML_SUCCESS:
                continue
            if fv.fieldId in _TOTALS:
                fv.value.ullVal += self.offset
            elif fv.fieldId == pynvml.NVML_FI_DEV_NVLINK_ERROR_DL_CRC and fv.scopeId == 1:
                fv.value.ullVal += self.link1_crc
        return values


def test_totals_that_never_add_up_make_every_poll_read_every_link():
    off, every = TotalsOff(1, offset=3), FakePynvml(1)
    twins = Twins(off, every)
    try:
        for poll in range(5):
            before = twins.counted.entries
            (g,) = twins.step()
            assert twins.counted.entries - before == 14 + 4 + 8  # the fields, the totals, every link
            assert g.nvlink_sums["crc_flit"] == 2 * max(0, poll - 1)
            off.behaviour[("nvlink2", 0)] = every.behaviour[("nvlink2", 0)] = poll  # crc_flit, both links
    finally:
        twins.close()


def test_a_total_that_misses_a_link_is_caught_by_the_audit_then_every_link_is_read():
    """The residual case, bounded: a driver whose total leaves out a link's counter, which then
    moves alone, is seen at the latest NVLINK_AUDIT_POLLS + 1 polls later (the first per-link read
    finds the counters no longer add up to the totals), and from then on every poll reads every
    link. A driver's total is the sum over its links ("total for all lanes", nvml.h)."""
    off = TotalsOff(1)
    src = started(off)
    try:
        src.poll()
        off.link1_crc = 500
        seen = [src.poll()[0].nvlink_sums["crc_flit"] for _ in range(NVLINK_AUDIT_POLLS + 5)]
        first = seen.index(500)
        assert first <= NVLINK_AUDIT_POLLS and set(seen[first:]) == {500}
    finally:
        src.close()


class TotalsFail(FakePynvml):
    """The totals answer an error; the per-link counters read fine."""

    def nvmlDeviceGetFieldValues(self, h, field_ids):
        values = super().nvmlDeviceGetFieldValues(h, field_ids)
        for fv in values:
            if fv.fieldId == pynvml.NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL and self.fail:
                fv.nvmlReturn = pynvml.NVML_ERROR_UNKNOWN
        return values

    fail = False


def test_a_total_that_fails_is_counted_reads_every_link_and_is_no_reading_error():
    failing, every = TotalsFail(1), FakePynvml(1)
    twins = Twins(failing, every)
    try:
        twins.step()
        failing.fail = True
        for value in (0, 4, 4):
            failing.behaviour[("nvlink2", 0)] = every.behaviour[("nvlink2", 0)] = value
            (g,) = twins.step()
            assert g.errors == {} and g.nvlink_sums["crc_flit"] == 2 * value
        assert twins.gated.errors[("nvlink_crc_flit_total", pynvml.NVML_ERROR_UNKNOWN)] == 3
    finally:
        twins.close()


def test_a_gpu_lost_with_its_totals_is_lost_and_a_failed_link_read_is_that_fields():
    fake, every = FakePynvml(2), FakePynvml(2)
    twins = Twins(fake, every)
    try:
        twins.step()
        for f in (fake, every):  # a per-link counter fails: its kind's error, on both sources alike
            f.behaviour[("nvlink3", 1)] = Err(pynvml.NVML_ERROR_UNKNOWN)
        g = twins.step()[1]
        assert g.errors == {"nvlink_crc_data": pynvml.NVML_ERROR_UNKNOWN}
        for f in (fake, every):
            f.behaviour.pop(("nvlink3", 1))
            f.behaviour[("ecc_corrected_volatile", 0)] = Err(pynvml.NVML_ERROR_GPU_IS_LOST)
        a, b = twins.gated.poll()[0], twins.every.poll()[0]
        assert a.lost and b.lost and a.values == b.values
    finally:
        twins.close()


def test_the_audit_reads_every_link_at_least_every_so_many_polls(tmp_path):
    state = tmp_path / "gpus.json"
    simulated.write_state(state, simulated.healthy_state(1))
    counted = Entries(simulated.SimulatedNvml(state, recheck_seconds=0, call_cost_seconds=0))
    src = started(counted)
    try:
        per_poll = []
        for _ in range(2 * NVLINK_AUDIT_POLLS + 2):
            before = counted.entries
            src.poll()
            per_poll.append(counted.entries - before)
        full = [i for i, n in enumerate(per_poll) if n > 18]
        assert full[0] == 0 and all(b - a <= NVLINK_AUDIT_POLLS + 1 for a, b in zip(full, full[1:] + [len(per_poll)]))
    finally:
        src.close()


def test_pynvml_arrays_read_from_their_buffer_as_entry_by_entry():
    """A driver's answer (pynvml's ctypes array) is unpacked from its buffer; every value type
    reads as ctypes reads that union member, and a failed entry is its field's error."""
    import math
    from types import SimpleNamespace

    from sentinel.sources.nvml_batch import FieldValues
    from sentinel.sources.nvml_worker import PollRead

    cases = [("dVal", pynvml.NVML_VALUE_TYPE_DOUBLE, 1.5), ("dVal", pynvml.NVML_VALUE_TYPE_DOUBLE, -math.inf),
             ("uiVal", pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, 2**32 - 1), ("ulVal", pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG, 2**63 + 5),
             ("ullVal", pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, 2**64 - 1), ("sllVal", pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG, -5),
             ("siVal", pynvml.NVML_VALUE_TYPE_SIGNED_INT, -7), ("usVal", pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT, 65535),
             ("ullVal", pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, 0)]
    names = ["ecc_corrected_volatile", "ecc_uncorrected_volatile", "ecc_corrected_aggregate", "ecc_uncorrected_aggregate",
             "pcie_replay", "remapped_rows_correctable", "remapped_rows_uncorrectable", "retired_pages_sbe", "retired_pages_dbe"]
    chunk = [("field", name, (i, 0)) for i, name in enumerate(names)] + [("link", (3, "replay"), (161, 3)),
                                                                          ("link", (4, "replay"), (161, 4))]
    answer = (pynvml.c_nvmlFieldValue_t * len(chunk))()
    for fv, (attr, kind, number) in zip(answer, cases + [("sllVal", pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG, -1)]):
        fv.valueType, fv.nvmlReturn = kind, pynvml.NVML_SUCCESS
        fv.value.ullVal = 2**64 - 1  # stale bytes a shorter member leaves in place: not its value
        setattr(fv.value, attr, number)
    answer[-1].nvmlReturn = pynvml.NVML_ERROR_UNKNOWN
    got = []
    for served in (answer, list(answer)):  # the array, and its entries one by one (ctypes' attributes)
        errors = []
        reader = FieldValues(pynvml, lambda gpu, name, exc: errors.append((name, exc.value)))
        gpu = SimpleNamespace(handle=0, links=None, calls=SimpleNamespace(call=lambda fn, h, ids, served=served: served))
        read = PollRead()
        assert reader.read(gpu, chunk, read) is False
        got.append((read.close(), errors))
    assert got[0] == got[1]
    (_, values, errs, links), errors = got[0]
    assert [values[n] for n in names] == [float(n) for n in (1.5, -math.inf, 2**32 - 1, 2**63 + 5, 2**64 - 1, -5, -7, 65535, 0)]
    assert links == {(3, "replay"): -1} and errs == {"nvlink_replay": pynvml.NVML_ERROR_UNKNOWN}
    assert errors == [("nvlink_replay", pynvml.NVML_ERROR_UNKNOWN)]
