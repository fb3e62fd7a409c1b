"""The root textfile recipe (deploy/node_exporter/sentinel-memory-textfile) exports only what a
job's user wrote into that user's own holder: planted directories named like a holder, links and
other users' files are skipped, and only lines of the two memory-tier metrics are copied, with the uid."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from conftest import REPO, SYSTEM_PYTHON

pytestmark = pytest.mark.needs_root

SCRIPT = REPO / "deploy" / "node_exporter" / "sentinel-memory-textfile"
JOB_UID = 65534  # nobody: the job's user
LINE = 'sentinel_trainer_memory_snapshot_bytes{rank="%d",copy="own"} %d\n'
SKIPPED = 'sentinel_trainer_memory_replica_skipped_total{rank="%d"} %d\n'


def as_user(user, argv):
    if user is None:
        r = subprocess.run(argv, user=JOB_UID, group=JOB_UID, extra_groups=[], capture_output=True, text=True, timeout=30)
    else:
        r = user.run(argv)
    assert r.returncode == 0, r.stderr
    return r


def recipe_dirs(shared_tmp):
    """A stand-in /dev/shm (1777, as the real one) and the textfile directory the recipe writes."""
    shm, out = shared_tmp / "shm", shared_tmp / "textfile"
    shm.mkdir()
    shm.chmod(0o1777)
    out.mkdir()
    return shm, out


def swapped_link_leaks(attacker, shared_tmp, holder, secret, marker: str, *, make_holder: bool) -> int:
    """Runs the recipe 40 times while the attacker swaps its holder's file for a link to ``secret``
    as fast as it can; how many of the exports carried ``marker`` (``secret``'s value)."""
    shm, out, stop = shared_tmp / "shm", shared_tmp / "textfile", shared_tmp / "stop"
    mkdir = "os.mkdir(d, 0o700)" if make_holder else ""
    swapper = attacker.popen([SYSTEM_PYTHON, "-c", f"""
import os, time
d, f = {str(holder)!r}, {str(holder / 'metrics-rank0.prom')!r}
{mkdir}
end = time.monotonic() + 60
while time.monotonic() < end and not os.path.exists({str(stop)!r}):
    with open(d + "/tmp", "w") as t:
        t.write({LINE % (0, 1)!r})
    os.replace(d + "/tmp", f)
    os.symlink({str(secret)!r}, d + "/lnk")
    os.replace(d + "/lnk", f)
"""])
    try:
        leaked = 0
        for _ in range(40):
            r = subprocess.run([str(SCRIPT), str(out)], capture_output=True, text=True, timeout=60,
                               env={"PATH": "/usr/bin:/bin", "SENTINEL_SHM": str(shm),
                                    "SENTINEL_RUN_USER": str(shared_tmp / "none")})
            assert r.returncode == 0, r.stderr
            leaked += marker in (out / "sentinel_memory.prom").read_text()
        return leaked
    finally:
        stop.touch()
        swapper.wait(timeout=90)


def test_the_recipe_exports_only_holders_their_users_own(attacker, shared_tmp):
    shm, out = recipe_dirs(shared_tmp)
    run_user = shared_tmp / "run-user"
    run_user.mkdir()
    a = attacker.uid
    # the job's own holder (what trainer.memory creates) and its /run/user one
    as_user(None, ["sh", "-c", f"mkdir -m 700 {shm}/sentinel-{JOB_UID} && printf '{LINE % (0, 111)}{SKIPPED % (0, 7)}' > {shm}/sentinel-{JOB_UID}/metrics-rank0.prom"])
    (run_user / str(JOB_UID)).mkdir(mode=0o700)
    os.chown(run_user / str(JOB_UID), JOB_UID, JOB_UID)
    as_user(None, ["sh", "-c", f"mkdir -m 700 {run_user}/{JOB_UID}/sentinel && printf '{LINE % (1, 222)}' > {run_user}/{JOB_UID}/sentinel/metrics-rank1.prom"])
    # the attacker: holders named for the job's uid, a link to the real one, its own open directory,
    # a name that is not a holder, and its own holder with a foreign series in it
    plant = " && ".join([
        f"mkdir -m 700 {shm}/sentinel-{JOB_UID}-deadbeef",
        f"printf '{LINE % (0, 999)}{SKIPPED % (0, 999)}' > {shm}/sentinel-{JOB_UID}-deadbeef/metrics-rank0.prom",
        f"ln -s {shm}/sentinel-{JOB_UID}-deadbeef {shm}/sentinel-{JOB_UID}-cafe",
        f"mkdir -m 755 {shm}/sentinel-{a}-00",
        f"printf '{LINE % (0, 998)}' > {shm}/sentinel-{a}-00/metrics-rank0.prom",
        f"mkdir -m 700 {shm}/sentinel-evil",
        f"printf '{LINE % (0, 997)}' > {shm}/sentinel-evil/metrics-rank0.prom",
        f"mkdir -m 700 {shm}/sentinel-{a}",
        f"printf '{SKIPPED % (3, 4)}{LINE % (3, 333)}node_load1 999\\nsentinel_trainer_memory_replica_skipped_total{{rank=\"3\",x=\"1\"}} 9\\n' > {shm}/sentinel-{a}/metrics-rank3.prom",
        f"ln -s /etc/passwd {shm}/sentinel-{a}/metrics-rank4.prom",
    ])
    as_user(attacker, ["sh", "-c", plant])
    r = subprocess.run([str(SCRIPT), str(out)], capture_output=True, text=True, timeout=60,
                       env={"PATH": "/usr/bin:/bin", "SENTINEL_SHM": str(shm), "SENTINEL_RUN_USER": str(run_user)})
    assert r.returncode == 0, r.stderr
    text = (out / "sentinel_memory.prom").read_text()
    samples = sorted(line for line in text.splitlines() if not line.startswith("#"))
    assert samples == sorted([
        f'sentinel_trainer_memory_snapshot_bytes{{uid="{JOB_UID}",rank="0",copy="own"}} 111',
        f'sentinel_trainer_memory_snapshot_bytes{{uid="{JOB_UID}",rank="1",copy="own"}} 222',
        f'sentinel_trainer_memory_snapshot_bytes{{uid="{a}",rank="3",copy="own"}} 333',  # its own job, as itself
        f'sentinel_trainer_memory_replica_skipped_total{{uid="{JOB_UID}",rank="0"}} 7',  # per rank, beside the bytes
        f'sentinel_trainer_memory_replica_skipped_total{{uid="{a}",rank="3"}} 4',
    ])
    assert (out / "sentinel_memory.prom").stat().st_mode & 0o777 == 0o644
    assert [p.name for p in out.iterdir()] == ["sentinel_memory.prom"]  # no temporary left behind
    promtool = shutil.which("promtool")
    assert promtool, "promtool is needed to check the exposition (apt-get install prometheus)"
    check = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr


def test_a_file_swapped_for_a_link_after_the_checks_is_read_with_the_users_rights(attacker, shared_tmp):
    """The user owns its holder, so it can swap a checked file for a link between the recipe's
    checks and its read. Root then read the link's target: here a root-only file whose line
    would be exported (a /dev/zero or FIFO there would have grown or stalled root's job). The
    file is read as its owner, at most 4 KiB, with a time limit."""
    shm, out = recipe_dirs(shared_tmp)
    secret_dir = shared_tmp / "root-only"
    secret_dir.mkdir(mode=0o700)
    secret = secret_dir / "x.prom"
    secret.write_text(LINE % (9, 424242))
    holder = shm / f"sentinel-{attacker.uid}"
    leaked = swapped_link_leaks(attacker, shared_tmp, holder, secret, "424242", make_holder=True)
    assert leaked == 0, f"root exported a root-only file's line through a swapped link in {leaked} of 40 runs"


def test_a_user_cannot_grow_the_export_without_bound_nor_repeat_a_series(attacker, shared_tmp):
    """Root's output is every user's: one user's holders (it may make as many as it likes, each
    named sentinel-<uid>-<hex>) and files must not make it as large as they like (a scrape over
    Prometheus' sample_limit fails the whole node's target, and each file read is a process and
    up to its time limit), nor repeat a series (two holders with the same rank: node_exporter
    drops the repeat as an error). Per uid at most 64 files and 256 series are exported, each
    series once; the job's own lines are exported whatever the attacker planted."""
    shm, out = recipe_dirs(shared_tmp)
    a = attacker.uid
    as_user(None, ["sh", "-c", f"mkdir -m 700 {shm}/sentinel-{JOB_UID} && printf '{LINE % (0, 111)}' > {shm}/sentinel-{JOB_UID}/metrics-rank0.prom"])
    plant = (f"for h in sentinel-{a} sentinel-{a}-01 sentinel-{a}-02; do mkdir -m 700 {shm}/$h; "
             f"for i in $(seq 0 99); do printf 'sentinel_trainer_memory_snapshot_bytes{{rank=\"0\",copy=\"own\"}} 5\\n"
             f"sentinel_trainer_memory_snapshot_bytes{{rank=\"%d%d\",copy=\"own\"}} 5\\n"
             f"sentinel_trainer_memory_snapshot_bytes{{rank=\"%d%d\",copy=\"replica\"}} 5\\n' $i ${{#h}} $i ${{#h}} "
             f"> {shm}/$h/metrics-rank$i.prom; done; done")
    as_user(attacker, ["sh", "-c", plant])
    r = subprocess.run([str(SCRIPT), str(out)], capture_output=True, text=True, timeout=300,
                       env={"PATH": "/usr/bin:/bin", "SENTINEL_SHM": str(shm),
                            "SENTINEL_RUN_USER": str(shared_tmp / "none")})
    assert r.returncode == 0, r.stderr
    samples = [line for line in (out / "sentinel_memory.prom").read_text().splitlines() if not line.startswith("#")]
    series = [line.rsplit(" ", 1)[0] for line in samples]
    assert len(series) == len(set(series)), "a series is exported twice"
    mine = [s for s in series if f'uid="{a}"' in s]
    assert 0 < len(mine) <= 256
    assert f'sentinel_trainer_memory_snapshot_bytes{{uid="{JOB_UID}",rank="0",copy="own"}} 111' in samples


def test_a_holder_carrying_a_foreign_group_reads_nothing_with_that_group(attacker, shared_tmp):
    """A directory made in a world-writable setgid directory (here one of group 4242, which the
    attacker is not in) takes that group, and its owner may move it to /dev/shm as its holder. The
    recipe read each file with the holder's group: a file swapped for a link to a group-4242-only
    file after the checks was read with a group its owner does not have. It reads as nogroup."""
    shm, out = recipe_dirs(shared_tmp)
    setgid = shared_tmp / "setgid-dir"
    setgid.mkdir()
    os.chown(setgid, 0, 4242)
    setgid.chmod(0o2777)
    secret = shared_tmp / "group-only.prom"
    secret.write_text(LINE % (9, 434343))
    os.chown(secret, 0, 4242)
    secret.chmod(0o640)
    holder = shm / f"sentinel-{attacker.uid}"
    # (it takes the set-group-id bit too: its owner clears it, the group stays)
    as_user(attacker, ["sh", "-c", f"mkdir {setgid}/h && chmod 700 {setgid}/h && mv {setgid}/h {holder}"])
    assert (holder.stat().st_gid, holder.stat().st_uid, holder.stat().st_mode & 0o7777) == (4242, attacker.uid, 0o700)
    leaked = swapped_link_leaks(attacker, shared_tmp, holder, secret, "434343", make_holder=False)
    assert leaked == 0, f"a group-only file's line was exported through a swapped link in {leaked} of 40 runs"
