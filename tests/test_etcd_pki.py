"""sentinel.etcd_pki run by root into a directory the job's user already owns (a requeued Slurm
job: the prolog runs again on the same /run/sentinel/jobs/JOB), attacked by that user."""

from __future__ import annotations

import os
import subprocess

from sentinel import etcd_pki

SWAP = """
import os, sys
jobdir, att = sys.argv[1:3]
try:
    names = os.listdir(jobdir)
except OSError as exc:
    sys.exit(print("refused", exc.errno))
for n in names:
    if n.startswith("tmp"):
        try:
            os.rename(f"{jobdir}/{n}", f"{jobdir}/.moved-{n}")
            os.symlink(att, f"{jobdir}/{n}")
            print("swapped")
        except OSError as exc:
            print("refused", exc.errno)
"""


def test_the_job_user_cannot_make_a_rerun_chown_a_file_of_its_choice(attacker, shared_tmp, monkeypatch):
    """Between root's openssl calls the job's user swaps root's work directory (inside the job
    directory it owns) for a symlink to a directory of its own, holding a CA of its own (so that
    root's next openssl calls go on) and ``zz.pem`` -> a root-only file. Before the fix root then
    chmod/chowned ``zz.pem``: the root-only file became the attacker's. Now the job directory is
    taken back (root, 0700) for the run: the swap is refused and the files are the job's."""
    job = shared_tmp / "job"
    etcd_pki.make_job_pki(job, "j", {"m0": []}, uid=attacker.uid, gid=attacker.gid)  # the first run
    assert os.stat(job).st_uid == attacker.uid
    victim = shared_tmp / "victim"
    victim.write_text("root only\n")
    os.chmod(victim, 0o600)
    att = shared_tmp / "att"
    att.mkdir()
    os.chown(att, attacker.uid, attacker.gid)
    r = attacker.run(["openssl", "req", "-x509", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                      "-nodes", "-keyout", str(att / "ca.key"), "-out", str(att / "ca.pem"), "-days", "1",
                      "-subj", "/CN=attacker CA"])
    assert r.returncode == 0, r.stderr
    assert attacker.run(["ln", "-s", str(victim), str(att / "zz.pem")]).returncode == 0

    real, said = etcd_pki._openssl, []

    def openssl_then_attack(*args, cwd):
        real(*args, cwd=cwd)
        if not said:  # after root's first openssl call, the attacker moves
            said.append(attacker.run(["python3", "-c", SWAP, str(job), str(att)]).stdout.strip())

    monkeypatch.setattr(etcd_pki, "_openssl", openssl_then_attack)
    try:
        pki = etcd_pki.make_job_pki(job, "j", {"m0": [], "m1": []}, uid=attacker.uid, gid=attacker.gid)
    except (RuntimeError, OSError):
        pki = None
    st = os.stat(victim)
    assert (st.st_uid, st.st_mode & 0o777) == (0, 0o600), f"the attacker's swap: {said}; victim now {st}"
    assert said and said[0].startswith("refused"), said
    assert pki is not None  # the rerun itself went through, and handed the job its files
    assert (os.stat(job).st_uid, os.stat(job).st_mode & 0o777) == (attacker.uid, 0o700)
    key = os.lstat(pki.client_key)
    assert (key.st_uid, key.st_mode & 0o777) == (attacker.uid, 0o600)
    subject = subprocess.run(["openssl", "x509", "-noout", "-subject", "-in", str(pki.cacert)],
                             capture_output=True, text=True, check=True).stdout
    assert "sentinel job j CA" in subject
    for name in ("client.pem", "member-m1.pem"):
        ok = subprocess.run(["openssl", "verify", "-CAfile", str(pki.cacert), str(job / name)], capture_output=True)
        assert ok.returncode == 0, name


def test_a_parent_another_user_can_write_is_refused(attacker, shared_tmp):
    parent = shared_tmp / "theirs"
    parent.mkdir()
    os.chown(parent, attacker.uid, attacker.gid)
    try:
        etcd_pki.make_job_pki(parent / "job", "j", {"m0": []})
    except RuntimeError as exc:
        assert "another user" in str(exc)
    else:
        raise AssertionError("a job directory in another user's directory was used")
