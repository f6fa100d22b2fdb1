"""Every exec of a local sandbox runs in a PID namespace of its own, below a non-dumpable agent.

The program is the adversary: whatever one exec starts (setsid'd, double-forked) is gone before
the next exec starts, and no exec can open the memory or the file descriptors of a process it
did not start (the agent's request/answer pipes above all) or kill the agent.
"""

from __future__ import annotations

from tests._sandboxes_helpers import descendants, needs_bwrap
from tests.sandboxes.test_sandboxes_local import run

pytestmark = needs_bwrap

DETACH = """
import os, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        sys.stdout.close(); sys.stderr.close()
        time.sleep(60)
    os._exit(0)
print("detached")
"""

PROBE = """
import os, signal
me = os.readlink("/proc/self")
opened = []
for pid in (p for p in os.listdir("/proc") if p.isdigit() and p != me):
    paths = [f"/proc/{pid}/mem", f"/proc/{pid}/environ"]
    try:
        paths += [f"/proc/{pid}/fd/{fd}" for fd in os.listdir(f"/proc/{pid}/fd")]
    except OSError:
        paths += [f"/proc/{pid}/fd/0", f"/proc/{pid}/fd/1"]
    for path in paths:
        for mode in (os.O_RDONLY, os.O_WRONLY):
            try:
                os.close(os.open(path, mode))
                opened.append(path)
            except OSError:
                pass
print(len(opened), opened[:5])
try:
    os.kill(-1, signal.SIGKILL)  # every process this one may signal, but itself
except ProcessLookupError:
    print("nothing to kill")
"""


def test_nothing_of_one_exec_is_alive_when_the_next_starts(tmp_path):
    async def body(sb):
        baseline = descendants(sb.pid)  # bwrap's init and the agent
        r = await sb.exec(["python3", "-c", DETACH], timeout_s=10)
        assert r.returncode == 0 and r.stdout == "detached\n", r
        assert descendants(sb.pid) == baseline, "a detached grandchild outlived its exec"
        r = await sb.exec(["sh", "-c", "(setsid sleep 60 &) ; sleep 60"], timeout_s=0.5)
        assert r.timed_out
        assert descendants(sb.pid) == baseline, "a process outlived its timed-out exec"

    run(tmp_path, body)


def test_an_exec_opens_no_memory_or_fd_of_the_agent_and_cannot_kill_it(tmp_path):
    async def body(sb):
        r = await sb.exec(["python3", "-c", PROBE], timeout_s=10)
        assert r.stdout.startswith("0 []"), f"opened another process's memory or fds: {r.stdout}"
        assert "nothing to kill" in r.stdout  # the agent is outside the exec's namespace
        r = await sb.exec(["echo", "still here"], timeout_s=10)
        assert r.stdout == "still here\n"
        assert sb.is_alive()

    run(tmp_path, body)


def test_an_exec_keeps_its_exit_status_and_signal(tmp_path):
    async def body(sb):
        assert (await sb.exec(["sh", "-c", "exit 7"], timeout_s=10)).returncode == 7
        assert (await sb.exec(["sh", "-c", "kill -TERM $$"], timeout_s=10)).returncode == -15
        missing = await sb.exec(["no-such-binary"], timeout_s=10)
        assert missing.returncode == 127 and "no-such-binary" in missing.stderr

    run(tmp_path, body)
