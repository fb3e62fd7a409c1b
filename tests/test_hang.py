"""The hang culprit rule, the timeout, and the parsers against recorded evidence."""

from pathlib import Path

import pytest

from sentinel.hang import (Entered, HangConfigError, HangSettings, RasParseError, Verdict, find_culprit,
                           hang_timeout, parse_flight_recorder, parse_ras_report)

CORPUS = Path(__file__).parent / "corpus" / "hang"


def e(rank, host, step, seq, op="gloo:all_reduce"):
    return Entered(rank=rank, host=host, pid=1000 + rank, step=step, seqs={"default_pg": seq}, ops={"default_pg": op})


def test_a_rank_that_does_not_answer_is_the_culprit_with_its_host():
    reports = {0: e(0, "n0", 41, 200), 1: e(1, "n0", 41, 200), 2: None, 3: e(3, "n1", 41, 200)}
    v = find_culprit(reports, 4, hosts={2: "n1"})
    assert v.kind == "stopped" and v.culprits == (2,) and v.hosts == ("n1",)
    assert "rank(s) 2" in v.evidence


def test_the_rank_behind_in_the_collective_sequence_is_the_culprit():
    reports = {r: e(r, f"n{r // 2}", 41, 200) for r in range(6)}
    reports[5] = e(5, "n2", 41, 198)
    v = find_culprit(reports, 6)
    assert v.kind == "not_entered" and v.culprits == (5,) and v.hosts == ("n2",)
    assert v.waiting_seq == 200 and "#200" in v.evidence and "#198" in v.evidence


def test_the_group_with_the_largest_spread_decides():
    reports = {r: Entered(r, f"n{r}", 1, 10, {"default_pg": 50, "ctl": 7}) for r in range(3)}
    reports[1] = Entered(1, "n1", 1, 10, {"default_pg": 49, "ctl": 7})
    reports[2] = Entered(2, "n2", 1, 10, {"default_pg": 50, "ctl": 9})
    v = find_culprit(reports, 3)
    assert v.group == "ctl" and set(v.culprits) == {0, 1}


def test_all_in_the_same_collective_is_not_decided():
    reports = {r: e(r, f"n{r}", 41, 200) for r in range(4)}
    v = find_culprit(reports, 4)
    assert v.kind == "unknown" and not v.decided and v.culprits == ()


def test_same_collectives_but_an_older_step_is_behind():
    reports = {r: e(r, f"n{r}", 41, 200) for r in range(3)}
    reports[2] = e(2, "n2", 40, 200)
    v = find_culprit(reports, 3)
    assert v.kind == "behind" and v.culprits == (2,)


def test_verdict_and_report_round_trip_and_bad_reports_are_refused():
    v = find_culprit({0: e(0, "a", 1, 3), 1: None}, 2, hosts={1: "b"})
    assert Verdict.decode(v.encode()) == v
    r = e(3, "h", 7, 9)
    assert Entered.decode(r.encode()) == r
    for bad in (b"", b"[]", b'{"rank": 1}', b'{"rank": "1", "host": "h", "pid": 1, "step": 1}',
                b'{"rank": 1, "host": "h", "pid": 1, "step": 1, "seqs": {"a": "x"}}'):
        with pytest.raises(ValueError):
            Entered.decode(bad)


def test_timeout_is_a_multiple_of_the_p99_floored_and_configurable():
    fast = [0.1] * 99 + [0.5]
    assert hang_timeout(fast) == 30.0  # 5 x 0.5 s is under the floor
    slow = [10.0] * 98 + [20.0] * 2
    assert hang_timeout(slow) == 100.0  # 5 x p99
    assert hang_timeout([]) == 30.0  # before any step: the floor
    assert hang_timeout(fast, HangSettings(timeout_seconds=5.0)) == 5.0
    assert hang_timeout(fast, HangSettings(floor_seconds=2.0, p99_multiple=3)) == 2.0


@pytest.mark.parametrize("kw,key", [({"timeout_seconds": 0.2}, "hang.timeout_seconds"),
                                    ({"floor_seconds": -1}, "hang.floor_seconds"),
                                    ({"p99_multiple": 0.5}, "hang.p99_multiple"),
                                    ({"gather_seconds": 0}, "hang.gather_seconds"),
                                    ({"p99_multiple": float("nan")}, "hang.p99_multiple")])
def test_bad_settings_name_the_key(kw, key):
    with pytest.raises(HangConfigError, match=key):
        HangSettings(**kw)


def test_flight_recorder_dumps_of_a_real_gloo_hang_name_the_rank_behind():
    waiting = parse_flight_recorder((CORPUS / "fr_gloo_rank0_waiting.json").read_text())
    behind = parse_flight_recorder((CORPUS / "fr_gloo_rank1_behind.json").read_text())
    assert waiting["default_pg"].last_entered == 4 and waiting["default_pg"].last_op == "gloo:all_reduce"
    assert behind["default_pg"].last_entered == 3
    reports = {r: Entered(r, f"n{r}", 1, 2, {g: t.last_entered for g, t in trace.items()})
               for r, trace in ((0, waiting), (1, behind))}
    v = find_culprit(reports, 2)
    assert v.kind == "not_entered" and v.culprits == (1,) and v.group == "default_pg" and v.waiting_seq == 4


def test_flight_recorder_parser_refuses_other_json():
    for bad in ("not json", "[]", '{"entries": 3}', '{"entries": [{"process_group": ["0", "x"]}]}'):
        with pytest.raises(ValueError):
            parse_flight_recorder(bad)
    assert parse_flight_recorder('{"entries": []}') == {}


def test_ras_incomplete_report_names_the_missing_process_and_node():
    r = parse_ras_report((CORPUS / "ras_incomplete_nccl1762.txt").read_text())
    assert r.nccl_version == "2.27.3" and r.nodes == 2 and r.processes == 10
    assert [g["errors"] for g in r.groups] == [["INCOMPLETE"], ["MISMATCH"]]
    suspects = r.suspects()
    assert [(s.rank, s.pid, s.node, s.gpu) for s in suspects] == [(1, 60004, "10.4.109.13", 0)]
    assert r.suspect_nodes() == ("10.4.109.13",)


def test_ras_mismatch_with_the_minority_ahead_names_nobody():
    r = parse_ras_report((CORPUS / "ras_mismatch_nccl1911.txt").read_text())
    assert r.nccl_version == "2.26.2" and r.nodes == 4 and r.processes == 32
    (issue,) = r.issues
    assert issue.kind == "MISMATCH" and issue.counts == ((30, 640), (2, 641))
    assert [x.rank for x in issue.ranks] == [12, 13]
    # ranks 12 and 13 launched one more AllGather than the 30 others: they wait, they are not the laggards
    assert r.suspects() == ()


def test_ras_mismatch_with_the_minority_behind_names_it():
    text = (CORPUS / "ras_mismatch_nccl1911.txt").read_text().replace(
        "30 ranks have launched up to operation 640", "30 ranks have launched up to operation 642")
    r = parse_ras_report(text)
    assert [s.rank for s in r.suspects()] == [12, 13] and r.suspect_nodes() == ("10.137.190.124",)


def test_ras_parser_refuses_other_text():
    with pytest.raises(RasParseError):
        parse_ras_report("HTTP/1.1 404 Not Found\n")


def test_settings_from_the_environment_name_the_variable():
    from sentinel.hang import settings_from_env

    assert settings_from_env({"SENTINEL_HANG_TIMEOUT_SECONDS": "10"}).timeout_seconds == 10.0
    assert settings_from_env({}) == HangSettings()
    with pytest.raises(HangConfigError, match="SENTINEL_HANG_TIMEOUT_SECONDS"):
        settings_from_env({"SENTINEL_HANG_TIMEOUT_SECONDS": "soon"})
    with pytest.raises(HangConfigError, match="SENTINEL_HANG_GATHER_SECONDS"):
        settings_from_env({"SENTINEL_HANG_GATHER_SECONDS": "0"})
