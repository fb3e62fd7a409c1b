"""Values in the rendezvous store that the slot rendezvous did not write (trainer/slot_marks.py).

On a TCPStore anyone who reaches the port writes any key (docs/security.md). A foreign or
half-written ``latest``, arrival mark or vacancy used to end a node's agent with a bare
``ValueError``/``JSONDecodeError`` from inside the rendezvous (review F5, session 18). Now: a mark
that is no arrival record is nobody's (never read as "mine", so never two nodes on one rank), a
malformed vacancy is skipped and counted, a malformed ``latest`` is a clear error naming the key
for a node that needs it, a skipped turn for a watcher, and ``leave`` still posts its vacancy.
Real c10d TCPStore, real handlers (fixtures of tests/test_slot_rendezvous.py)."""

from __future__ import annotations

import json

import pytest

from store_intruder import plant
from test_slot_rendezvous import first_join, handler, rendezvous, server  # noqa: F401 (server: a fixture)
from trainer import slot_marks
from trainer.slot_marks import MalformedRecord
from trainer.slot_rendezvous import SlotTakenError

pytestmark = [pytest.mark.needs_torch]

KEY = "sentinel.rdzv.job/"
DEEP = b"[" * 100_000  # nesting past the recursion limit: json.loads raises RecursionError (review s19)
FOREIGN = [b"", b"not json", b"\x1b[2Jforged\nline", b"[1, 2]", b'{"id": 7}', b'{"slot": 0}', b"null", DEEP,
           b'{"id": "x", "probe": ' + DEEP + b"}", b"\xff\xfe{"]


@pytest.mark.parametrize("raw", FOREIGN, ids=lambda raw: ascii(raw[:24]))
def test_a_value_that_is_no_arrival_record_belongs_to_nobody(raw):
    assert slot_marks.arrival(raw) is None
    assert not slot_marks.owns(raw, "7") and not slot_marks.owns(raw, "")
    assert slot_marks.arrival_id(raw) == "?"
    before = slot_marks.MALFORMED["vacancy"]
    assert slot_marks.vacancy(raw, "k", 4) is None
    assert slot_marks.MALFORMED["vacancy"] == before + 1
    with pytest.raises(MalformedRecord, match="store key k holds"):
        slot_marks.generation(raw, "k")


def test_a_record_nested_past_the_recursion_limit_is_a_malformed_record():
    for raw in (DEEP, b'{"master_addr": "a", "master_port": 1, "x": ' + DEEP + b"}"):
        with pytest.raises(MalformedRecord, match="store key k holds"):
            slot_marks.record(raw, "k", ("master_addr",))
        with pytest.raises(MalformedRecord):
            slot_marks.endpoint(raw, "k")


def test_malformed_values_log_once_per_key_even_past_the_logged_keys_bound(monkeypatch, caplog):
    """Review s19: once 1,024 keys were logged, every further read of a malformed key logged again
    (a watcher reading a planted ``latest`` each pass: a line each pass, for good)."""
    monkeypatch.setattr(slot_marks, "_logged", set())
    with caplog.at_level("WARNING", logger=slot_marks.log.name):
        for n in range(slot_marks.LOGGED_KEYS + 1):
            slot_marks.vacancy(b"x", f"vacancy/{n}", 4)  # a writer plants many malformed vacancies
        caplog.clear()
        for _ in range(50):
            assert slot_marks.next_generation(_Store({"latest": b"x"}), "latest") is None
            slot_marks.vacancy(b"x", "vacancy/0", 4)
    assert len(caplog.records) <= 1


class _Store:
    def __init__(self, values):
        self.values = values

    def check(self, keys):
        return all(k in self.values for k in keys)

    def get(self, key):
        return self.values[key]


def test_records_the_rendezvous_writes_read_back_whole():
    assert slot_marks.owns(json.dumps({"id": "n1", "probe": "1.2.3.4:5"}), "n1")
    assert not slot_marks.owns("LEFT:n1", "n1") and not slot_marks.owns("LEFT:n1#ab12cd34", "n1")
    assert slot_marks.generation(b"12", "k") == 12
    vac = {"slot": 3, "gen": 2, "left": "LEFT:n1#ab12cd34"}
    assert slot_marks.vacancy(json.dumps(vac), "k", 4) == vac
    assert slot_marks.vacancy(json.dumps({**vac, "slot": 4}), "k", 4) is None  # no slot 4 in a 4-node job
    assert slot_marks.endpoint(json.dumps({"addr": "198.18.0.2", "port": 29500}), "k") == ("198.18.0.2", 29500)
    for bad in ({"addr": "h", "port": 0}, {"addr": "h", "port": True}, {"addr": "", "port": 1}, {"port": 1}):
        with pytest.raises(MalformedRecord, match="no valid address and port"):
            slot_marks.endpoint(bad, "g1")


def test_a_forged_vacancy_is_skipped_and_the_spare_takes_the_real_one(server):  # noqa: F811
    hs = first_join(server, 2)
    # a local user bumps the vacancy count and writes garbage where spare ticket 1 looks
    assert server.add(KEY + "vacancies", 1) == 1
    server.set(KEY + "vacancy/1", "\x1b[2J{not a vacancy")
    before = slot_marks.MALFORMED["vacancy"]
    assert "left slot 1" in hs[1].leave()  # the real vacancy: number 2
    spare = handler(server, 2)
    infos = rendezvous([hs[0], spare])
    assert [i.rank for i in infos] == [0, 1] and {h.gen for h in (hs[0], spare)} == {2}
    assert slot_marks.MALFORMED["vacancy"] > before


def test_a_survivor_whose_slot_holds_a_foreign_value_is_fenced_not_crashed(server):  # noqa: F811
    hs = first_join(server, 2)
    server.set(KEY + "g2/s0", "garbage")  # a foreign "arrival" in slot 0 of a generation ...
    server.set(KEY + "latest", "2")  # ... presented as committed
    with pytest.raises(SlotTakenError, match="slot 0 belongs to another node since generation 2"):
        hs[0].next_rendezvous()


def test_a_mark_that_is_no_utf8_is_nobodys_for_a_survivor_and_a_watcher(server):  # noqa: F811
    """Review s19: the rendezvous decoded marks strictly; a non-UTF-8 value (or one nested past the
    recursion limit) planted by another user ended a survivor's rendezvous and a watcher's probe
    pass with a bare UnicodeDecodeError (RecursionError)."""
    hs = first_join(server, 2)
    # as nobody, over the wire: slot 1's "arrival" in generation 2 before slot 1 arrives, slot 0's
    # nested past the recursion limit, and generation 2 presented as committed
    plant(server.port, {KEY + "g2/s1": b"\xff\xfe", KEY + "g2/s0": DEEP, KEY + "latest": b"2"})
    assert hs[0].recovery.probe_pass(3, "review") == 0  # their holders are nobody: not probed, not declared
    with pytest.raises(SlotTakenError, match="slot 0 belongs to another node since generation 2"):
        hs[0].next_rendezvous()


def test_a_malformed_latest_is_a_clear_error_for_a_node_a_skipped_turn_for_a_watcher(server):  # noqa: F811
    hs = first_join(server, 2)
    spare = handler(server, 2)  # the silence rule is on by default: its watcher reads ``latest``
    server.set(KEY + "latest", "\x1b]0;owned\x07")
    before = slot_marks.MALFORMED["latest"]
    assert spare.watch_silence() > 0  # no exception: the pass waits for its next turn
    with pytest.raises(MalformedRecord, match=r"store key sentinel\.rdzv\.job/latest holds .*not a generation number"):
        hs[0].next_rendezvous()
    assert slot_marks.MALFORMED["latest"] >= before + 2


def test_leave_with_a_malformed_latest_still_posts_its_vacancy(server):  # noqa: F811
    hs = first_join(server, 2)
    server.set(KEY + "latest", "two")
    said = hs[1].leave()
    assert said == "left slot 1: vacant in generation 2", said
    count = server.add(KEY + "vacancies", 0)
    vac = slot_marks.vacancy(server.get(KEY + f"vacancy/{count}"), "v", 2)
    assert vac is not None and vac["slot"] == 1 and vac["gen"] == 2
