"""sentinel.rdzv_store (root) against a job's etcd that lies: the job's user runs the members, so
the member list it answers is the user's to write. Here a real HTTP server, run as an
unprivileged user, stands in for such a member."""

from __future__ import annotations

import json
import os
import threading

from sentinel.rdzv_store import DEADLINE_SECONDS, RendezvousStoreWatch

FAKE_ETCD = r"""
import json, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
base = sys.argv[1]
class H(BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        port = self.server.server_address[1]
        if self.path.endswith("/member/list"):
            urls = [f"file://{base}/rootonly.json#", f"file://{base}/fifo#", f"http://127.0.0.1:{port}/drip#",
                    f"http://127.0.0.1:{port}/drip", f"http://127.0.0.1:{port}", f"http://localhost:{port}"]
            body = {"members": [{"ID": i + 1, "name": f"m{i}\x1b[2J", "clientURLs": [u]} for i, u in enumerate(urls)]}
            body["members"] += [{"ID": 100 + i, "name": f"x{i}", "clientURLs": []} for i in range(100)]
        elif self.path.startswith("/drip") or self.headers.get("Host", "").startswith("localhost"):
            self.send_response(200); self.send_header("Content-Length", "100000"); self.end_headers()
            for _ in range(600):
                self.wfile.write(b" "); self.wfile.flush(); time.sleep(0.5)
            return
        else:
            body = {"leader": 5}
        data = json.dumps(body).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(data))); self.end_headers()
        self.wfile.write(data)
    def log_message(self, *a):
        pass
s = ThreadingHTTPServer(("127.0.0.1", 0), H)
s.daemon_threads = True
print(s.server_address[1], flush=True)
s.serve_forever()
"""


def test_a_lying_member_list_makes_the_daemon_read_no_file_and_never_hang(attacker, shared_tmp):
    (shared_tmp / "rootonly.json").write_text(json.dumps({"leader": 1}))
    os.chmod(shared_tmp / "rootonly.json", 0o600)
    os.chmod(shared_tmp, 0o777)  # the user makes its FIFO here
    assert attacker.run(["mkfifo", str(shared_tmp / "fifo")]).returncode == 0
    os.chmod(shared_tmp, 0o755)
    import subprocess
    fake = attacker.popen(["python3", "-c", FAKE_ETCD, str(shared_tmp)], stdout=subprocess.PIPE, text=True)
    try:
        port = int(fake.stdout.readline())
        watch = RendezvousStoreWatch([f"127.0.0.1:{port}"])
        got: list[dict] = []
        t = threading.Thread(target=lambda: got.append(watch.check()), daemon=True)
        t.start()
        # the bound: one check asks at most MAX_MEMBERS members, each cut off at its deadline
        t.join(timeout=16 * (2 * DEADLINE_SECONDS + 1))
        assert not t.is_alive(), "the watch hung on a member the job's etcd named (a FIFO, or a dripping answer)"
        members = got[0]["members"]
        assert len(members) == 16  # 105 listed: no unbounded labels on /metrics
        # file:// (the root-only file and the FIFO), a path, a fragment: never asked
        assert [m["client_url"] for m in members[:4]] == ["", "", "", ""]
        assert not any(m["reachable"] for m in members[:4])
        assert members[4]["reachable"] and members[4]["leader"] and got[0]["leader"] == "m4??2J"
        assert members[5]["client_url"] and not members[5]["reachable"]  # asked: its answer drips, cut off
        assert all("\x1b" not in m["name"] for m in members)
    finally:
        fake.kill()
        fake.wait()


def test_the_job_user_cannot_hang_the_daemon_start_with_a_fifo_for_its_key(attacker, shared_tmp):
    """The job's certificates live in the job user's directory (docs/security.md); the daemon (root)
    loads them at start. A FIFO there made that start wait for ever; a symlink made root read any
    file. Both are now refused at once (OSError: the daemon's StartupError)."""
    import subprocess
    from sentinel.etcd_pki import make_job_pki

    job = shared_tmp / "job"
    pki = make_job_pki(job, "j", {"m0": []}, uid=attacker.uid, gid=attacker.gid)
    assert attacker.run(["mv", str(pki.client_key), str(job / "real.key")]).returncode == 0
    for plant in (["mkfifo", str(pki.client_key)], ["ln", "-s", str(job / "real.key"), str(pki.client_key)]):
        attacker.run(["rm", "-f", str(pki.client_key)])
        assert attacker.run(plant).returncode == 0
        got: list = []

        def load():
            try:
                got.append(RendezvousStoreWatch(["127.0.0.1:1"], cacert=str(pki.cacert), cert=str(pki.client_cert),
                                                key=str(pki.client_key)))
            except OSError as exc:
                got.append(exc)

        t = threading.Thread(target=load, daemon=True)
        t.start()
        t.join(timeout=30)
        if t.is_alive():  # unblock the open before failing, so no thread is left behind
            subprocess.run(["timeout", "5", "sh", "-c", f"echo > {pki.client_key}"])
        assert not t.is_alive() and isinstance(got[0], OSError), f"{plant[0]}: {got}"
    attacker.run(["rm", "-f", str(pki.client_key)])
    assert attacker.run(["mv", str(job / "real.key"), str(pki.client_key)]).returncode == 0
    RendezvousStoreWatch(["127.0.0.1:1"], cacert=str(pki.cacert), cert=str(pki.client_cert), key=str(pki.client_key))
