"""A child started with exit_with_parent stops when its parent dies, even while it was still loading."""

import os
import subprocess
import sys
import time

from megatron_gkd import child_process

# The child imports the module, says so, then "loads" for 2 s; its parent exits as soon as it has heard.
CHILD = ("import sys, time, megatron_gkd.child_process as c; print('imported', flush=True); sys.stdout.close(); "
         "time.sleep(2); c.exit_with_parent(); time.sleep(30)")
PARENT = ("import subprocess, sys; child = subprocess.Popen([sys.executable, '-c', sys.argv[1]], "
          "stdout=subprocess.PIPE, stderr=subprocess.DEVNULL); child.stdout.readline(); print(child.pid, flush=True)")


def test_a_parent_that_dies_while_the_child_loads_still_stops_the_child():
    # Once os.getppid() was read inside exit_with_parent: the child, already adopted, took its new
    # parent for the one that started it and lived on (an orphaned teacher server held 560 MB for 2 h).
    parent = subprocess.run([sys.executable, "-c", PARENT, CHILD], capture_output=True, text=True, check=True,
                            env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert _stops(int(parent.stdout.split()[0])), "the orphaned child outlived its parent"


def _stops(pid: int, timeout_s: float = 20) -> bool:
    """Whether ``pid`` ends within ``timeout_s`` (it is killed otherwise)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end and _alive(pid):
        time.sleep(0.2)
    if _alive(pid):
        os.kill(pid, 9)
        return False
    return True


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_a_fork_of_the_importing_process_takes_that_process_as_its_parent():
    # A fork inherits the import-time record of its parent's parent; it must not mistake that for a death.
    script = ("import os, sys, time, megatron_gkd.child_process as c\n"
              "pid = os.fork()\n"
              "if pid == 0:\n"
              "    c.exit_with_parent(); time.sleep(0.5); os._exit(7)\n"
              "_, status = os.waitpid(pid, 0)\n"
              "print(os.waitstatus_to_exitcode(status))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert done.stdout.strip() == "7", f"the fork was stopped: exit code {done.stdout.strip()}"


def test_a_parent_that_dies_before_the_child_imports_anything_still_stops_it():
    # The child's interpreter starts slowly (here: 2 s before any import); its parent is gone by then, and the
    # parent pid the child reads at import is already its adopter's. The pid its parent put into its
    # environment (as ServiceProcess does) is the one it must outlive.
    child = ("import time; time.sleep(2); import megatron_gkd.child_process as c; c.exit_with_parent(); "
             "time.sleep(30)")
    parent = ("import os, subprocess, sys; child = subprocess.Popen([sys.executable, '-c', sys.argv[1]], "
              "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ, "
              "MEGATRON_GKD_PARENT_PID=str(os.getpid()))); print(child.pid, flush=True)")
    done = subprocess.run([sys.executable, "-c", parent, child], capture_output=True, text=True, check=True,
                          env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert _stops(int(done.stdout.split()[0])), "the child outlived a parent that died before it imported the module"


# A subreaper that starts a shell, which leaves an orphan in a session of its own and waits: the orphan is re-parented
# to the subreaper, not to init.
SUBREAPER = ("import subprocess, sys, time, megatron_gkd.child_process as c; c.become_subreaper(); "
             "subprocess.Popen(['sh', '-c', '(setsid sleep 300 &); sleep 300']); print('started', flush=True); "
             "time.sleep(300)")


def test_kill_descendants_finds_orphans_in_sessions_of_their_own_and_spares_the_root():
    root = subprocess.Popen([sys.executable, "-c", SUBREAPER], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=os.getcwd()))
    try:
        root.stdout.readline()
        deadline = time.monotonic() + 20
        while len(child_process.descendants(root.pid)) < 3:  # the shell, its sleep, and the orphan
            assert time.monotonic() < deadline, child_process.descendants(root.pid)
            time.sleep(0.05)
        found = child_process.descendants(root.pid)
        assert any(os.getsid(pid) == pid for pid in found)  # the orphan leads a session of its own
        assert child_process.kill_descendants(root.pid)
        assert not child_process.descendants(root.pid) and all(_stops(pid, 5) for pid in found)
        assert root.poll() is None  # the root itself is spared
    finally:
        root.kill()
        root.wait()
