"""A real one-node Slurm cluster on this host, for tests/integration/test_slurm.py.

`slurm_missing()` says why Slurm cannot be had (None when munged, slurmctld, slurmd and sbatch are there, or
`apt-get install -y slurm-wlm munge` as root put them there). `SlurmCluster.start(root)` writes a slurm.conf for
this host (NodeName = the hostname at 127.0.0.1, the machine's CPUs shared by up to 4 jobs each, no GPUs,
select/cons_tres, proctrack/pgid, no cgroups, SlurmUser root, every state and spool folder, pid and log file under
`root`, free ports), starts munged (its own key and socket), slurmctld and slurmd in the foreground as our own
children, and waits until the node is idle; `stop()` ends exactly those three processes. Jobs are submitted with
`sbatch` and followed with `squeue` and `scontrol show job` (no accounting database here, so not `sacct`).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.helpers.train import free_port

BINARIES = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel")
SBIN = ("/usr/sbin", "/usr/bin")


def _which(name: str) -> str | None:
    return shutil.which(name) or next((f"{d}/{name}" for d in SBIN if Path(f"{d}/{name}").exists()), None)


def slurm_missing() -> str | None:
    """None when Slurm and munge are installed (installing Debian's slurm-wlm and munge first when root can);
    else why not, in one line."""
    missing = [b for b in BINARIES if _which(b) is None]
    if missing and os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        cmd = ["apt-get", "install", "-y", "--no-install-recommends", "slurm-wlm", "munge"]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if out.returncode != 0:
            upd = subprocess.run(["apt-get", "update"], capture_output=True, text=True, env=env)
            out = subprocess.run(cmd, capture_output=True, text=True, env=env) if upd.returncode == 0 else out
        missing = [b for b in BINARIES if _which(b) is None]
        if missing:
            return f"apt-get install slurm-wlm munge failed ({out.stderr.strip()[-300:]}); missing: {missing}"
    if missing:
        return f"Slurm is not installed ({', '.join(missing)} missing) and apt-get as root is not available"
    return None


@dataclass
class SlurmCluster:
    root: Path
    conf: Path
    node: str
    procs: list[tuple[str, subprocess.Popen]] = field(default_factory=list)

    @property
    def env(self) -> dict:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *cmd: str, check: bool = True) -> str:
        out = subprocess.run([_which(cmd[0]), *cmd[1:]], capture_output=True, text=True, env=self.env)
        if check and out.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)}: exit {out.returncode}: {out.stderr.strip()}")
        return out.stdout.strip()

    @classmethod
    def start(cls, root: Path) -> SlurmCluster:
        root.mkdir(parents=True, exist_ok=True)
        for d in ("state", "spool", "log", "munge"):
            (root / d).mkdir(exist_ok=True)
        os.chmod(root / "munge", 0o700)
        key, sock = root / "munge/munge.key", root / "munge/munge.sock"
        subprocess.run([_which("mungekey"), "--create", f"--keyfile={key}", "--force"], check=True)
        os.chmod(key, 0o600)
        node = socket.gethostname()
        conf = root / "slurm.conf"
        conf.write_text(
            "\n".join(
                [
                    "ClusterName=dflashtest",
                    f"SlurmctldHost={node}(127.0.0.1)",
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    f"SlurmctldPort={free_port()}",
                    f"SlurmdPort={free_port()}",
                    "AuthType=auth/munge",
                    "CredType=cred/munge",
                    f"AuthInfo=socket={sock}",
                    f"StateSaveLocation={root / 'state'}",
                    f"SlurmdSpoolDir={root / 'spool'}",
                    f"SlurmctldPidFile={root / 'slurmctld.pid'}",
                    f"SlurmdPidFile={root / 'slurmd.pid'}",
                    f"SlurmctldLogFile={root / 'log/slurmctld.log'}",
                    f"SlurmdLogFile={root / 'log/slurmd.log'}",
                    "ProctrackType=proctrack/pgid",
                    "TaskPlugin=task/none",
                    "JobAcctGatherType=jobacct_gather/none",
                    "AccountingStorageType=accounting_storage/none",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_Core",
                    "SchedulerType=sched/backfill",
                    "SchedulerParameters=sched_interval=2",
                    "ReturnToService=2",
                    "MpiDefault=none",
                    "KillWait=10",
                    "MinJobAge=600",
                    "JobRequeue=1",
                    "SlurmdTimeout=60",
                    "InactiveLimit=0",
                    f"NodeName={node} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} State=UNKNOWN",
                    "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4",
                    "",
                ]
            )
        )
        cluster = cls(root, conf, node)
        try:
            cluster._spawn(
                "munged",
                "--foreground",
                "--force",
                f"--socket={sock}",
                f"--key-file={key}",
                f"--log-file={root / 'log/munged.log'}",
                f"--pid-file={root / 'munge/munged.pid'}",
                f"--seed-file={root / 'munge/seed'}",
            )
            cluster._wait(lambda: sock.exists(), "munged's socket")
            cluster._spawn("slurmctld", "-D", "-i", "-f", str(conf))
            cluster._spawn("slurmd", "-D", "-f", str(conf), "-N", node)
            cluster._wait(lambda: "idle" in cluster.run("sinfo", "-h", "-o", "%T", check=False), "an idle node")
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _spawn(self, name: str, *args: str) -> None:
        log = open(self.root / "log" / f"{name}.out", "w")  # noqa: SIM115 (the process holds it)
        proc = subprocess.Popen([_which(name), *args], stdout=log, stderr=subprocess.STDOUT, env=self.env)
        log.close()
        self.procs.append((name, proc))

    def _wait(self, ok, what: str, timeout_s: float = 120) -> None:
        end = time.monotonic() + timeout_s
        while not ok():
            for name, proc in self.procs:
                if proc.poll() is not None:
                    raise AssertionError(f"{name} exited ({proc.returncode}): {self.logs()}")
            if time.monotonic() > end:
                raise AssertionError(f"no {what} after {timeout_s} s: {self.logs()}")
            time.sleep(0.5)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}:\n{p.read_text()[-2500:]}" for p in sorted((self.root / "log").glob("*")))

    def stop(self) -> None:
        """End the daemons this cluster started (their process ids, nothing else), slurmd first."""
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        for _, proc in reversed(self.procs):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()

    # ---------------------------------------------------------------------------------------------- jobs

    def sbatch(self, script: Path, *args: str, env: dict | None = None, cwd: Path | None = None) -> str:
        """Submit `script` (from `cwd`, the job's SLURM_SUBMIT_DIR); its job id."""
        cmd = [_which("sbatch"), "--parsable", *args, str(script)]
        out = subprocess.run(cmd, capture_output=True, text=True, env={**self.env, **(env or {})}, cwd=cwd)
        if out.returncode != 0:
            raise AssertionError(f"sbatch {script.name}: {out.stderr.strip()}")
        return out.stdout.strip().split(";")[0]

    def states(self, job: str) -> dict[str, str]:
        """{job id (array tasks: JOB_TASK): state} from scontrol (jobs stay listed MinJobAge s after the end)."""
        out = self.run("scontrol", "-o", "show", "job", job, check=False)
        states = {}
        for line in out.splitlines():
            fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
            task = fields.get("ArrayTaskId")
            key = f"{fields['ArrayJobId']}_{task}" if task and task != "N/A" else fields.get("JobId", "")
            states[key] = fields.get("JobState", "")
        return states

    def in_queue(self, job: str) -> bool:
        return bool(self.run("squeue", "-h", "-j", job, "-o", "%i", check=False))

    def wait_done(self, job: str, timeout_s: float) -> dict[str, str]:
        """Until `job` (every task) has left squeue; the final states."""
        self._wait(lambda: not self.in_queue(job), f"end of job {job}", timeout_s)
        return self.states(job)
