"""A real Slurm cluster on this machine for the launch tests: Debian's packages, munge, one slurmctld and
two slurmd daemons (virtual nodes ``n1`` and ``n2`` on 127.0.0.1, Slurm's "multiple slurmd" setup), so
jobs of two nodes run their steps through the real srun, signals and requeue.

    cluster = SlurmCluster(directory).start()   # installs the packages first if they are missing (root)
    job_id = cluster.submit(["launch/slurm/student.sbatch", ...], cwd=REPO)
    cluster.wait_for(job_id, "COMPLETED")
    cluster.stop()
"""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import subprocess
import time

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
NODES = ("n1", "n2")


def install_packages() -> None:
    """``apt-get install`` Debian's Slurm and munge packages (root; package index reachable).

    Raises:
        RuntimeError: with apt's output, when they cannot be installed.
    """
    if shutil.which("slurmctld") and shutil.which("slurmd") and shutil.which("sbatch") and shutil.which("munged"):
        return
    for command in (["apt-get", "update"],
                    ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES]):
        result = subprocess.run(command, capture_output=True, text=True, timeout=900,
                                env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))
        if result.returncode:
            raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}):\n{result.stdout[-2000:]}"
                               f"\n{result.stderr[-2000:]}")


def _config(directory: pathlib.Path, port: int, cpus: int, memory_mb: int) -> str:
    nodes = "\n".join(f"NodeName={name} NodeHostname={os.uname().nodename} NodeAddr=127.0.0.1 Port={port + 1 + i} "
                      f"CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN" for i, name in enumerate(NODES))
    return f"""ClusterName=gkdtest
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation={directory}/state
SlurmdSpoolDir={directory}/spool/%n
SlurmctldPidFile={directory}/slurmctld.pid
SlurmdPidFile={directory}/slurmd-%n.pid
SlurmctldLogFile={directory}/log/slurmctld.log
SlurmdLogFile={directory}/log/slurmd-%n.log
SlurmctldPort={port}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
KillWait=60
{nodes}
PartitionName=debug Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""


class SlurmCluster:
    """Two virtual nodes on localhost, run from ``directory`` (config, state, logs)."""

    def __init__(self, directory: pathlib.Path, port: int = 16917):
        self.directory, self.port = directory, port
        self.conf = directory / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self._started_munge = False

    def run(self, *args: str, check: bool = True) -> str:
        result = subprocess.run(list(args), capture_output=True, text=True, env=self.env, timeout=60)
        if check and result.returncode:
            raise RuntimeError(f"{' '.join(args)} failed: {result.stderr.strip()}")
        return result.stdout

    def start(self) -> SlurmCluster:
        install_packages()
        for sub in ("state", "log", *(f"spool/{name}" for name in NODES)):
            (self.directory / sub).mkdir(parents=True, exist_ok=True)
        self.conf.write_text(_config(self.directory, self.port, os.cpu_count() or 2, 8000))
        if subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode:
            pathlib.Path("/run/munge").mkdir(parents=True, exist_ok=True)
            shutil.chown("/run/munge", "munge", "munge")
            subprocess.run(["runuser", "-u", "munge", "--", "munged"], check=True)
            self._started_munge = True
        subprocess.run(["slurmctld", "-c"], check=True, env=self.env)
        for name in NODES:
            subprocess.run(["slurmd", "-N", name], check=True, env=self.env)
        deadline = time.monotonic() + 60
        while self.run("sinfo", "-h", "-o", "%D %T", check=False).split() != [str(len(NODES)), "idle"]:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Slurm nodes did not come up: {self.run('sinfo', check=False)}")
            time.sleep(1)
        return self

    def submit(self, args: list[str], cwd: pathlib.Path, env: dict | None = None) -> str:
        result = subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True, cwd=cwd,
                                env={**self.env, **(env or {})}, timeout=60)
        if result.returncode:
            raise RuntimeError(f"sbatch failed: {result.stderr}")
        return result.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields of ``job_id`` (empty once Slurm forgot it)."""
        text = self.run("scontrol", "show", "job", "--oneliner", job_id, check=False)
        return dict(part.split("=", 1) for part in text.split() if "=" in part)

    def wait_for(self, job_id: str, states: tuple[str, ...], timeout_s: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            fields = self.job(job_id)
            if fields.get("JobState") in states:
                return fields
            time.sleep(2)
        raise TimeoutError(f"job {job_id} not in {states} after {timeout_s:.0f} s: {self.job(job_id)}")

    def stop(self) -> None:
        self.run("scancel", "--user=root", check=False)
        self.run("scontrol", "shutdown", check=False)
        time.sleep(2)
        for pid_file in self.directory.glob("*.pid"):  # the daemons this cluster started, by their ids
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except (ValueError, ProcessLookupError):
                pass
        if self._started_munge:
            try:
                os.kill(int(pathlib.Path("/run/munge/munged.pid").read_text()), signal.SIGTERM)
            except (OSError, ValueError):
                pass
