"""LocalProvider against real bubblewrap: exec semantics, isolation, limits, faults.

Every fault test also checks that no process of the sandbox survives it.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import threading

import pytest

from modal_rl.sandboxes import LocalProvider, ProviderUnavailableError, SandboxLostError, SandboxSpec
from tests._sandboxes_helpers import alive, descendants, needs_bwrap, wait_gone

pytestmark = needs_bwrap


async def _with_sandbox(tmp_path, body, **spec_kw):
    provider = LocalProvider(registry_dir=tmp_path / "reg")
    sb = await provider.create(SandboxSpec(**spec_kw), tags={"test": "local"})
    await asyncio.wait_for(sb.ready(), 10)
    try:
        return await body(sb)
    finally:
        procs = descendants(sb.pid) | {sb.pid}
        await sb.terminate()
        assert not wait_gone(procs), "sandbox processes survived terminate"
        assert not list((tmp_path / "reg").glob("*.json")), "registry entry left behind"


def run(tmp_path, body, **spec_kw):
    return asyncio.run(_with_sandbox(tmp_path, body, **spec_kw))


def test_exec_stdin_env_files(tmp_path):
    async def body(sb):
        r = await sb.exec(
            ["python3", "-c", "import sys,os; print(sys.stdin.read().upper(), os.environ['X'])"],
            timeout_s=20,
            stdin="hi",
            env={"X": "y"},
        )
        assert (r.returncode, r.stdout, r.timed_out) == (0, "HI y\n", False)
        assert r.duration_s > 0
        r = await sb.exec(["sh", "-c", "echo out; echo err >&2; exit 3"], timeout_s=10)
        assert (r.returncode, r.stdout, r.stderr) == (3, "out\n", "err\n")
        await sb.write_file("sub/a.bin", b"\x00\xff data")
        assert await sb.read_file("/workspace/sub/a.bin") == b"\x00\xff data"
        r = await sb.exec(["cat", "sub/a.bin"], timeout_s=10)
        assert r.stdout.endswith(" data")
        with pytest.raises(FileNotFoundError):
            await sb.read_file("missing.txt")
        r = await sb.exec(["no-such-binary-xyz"], timeout_s=10)
        assert r.returncode == 127 and "no-such-binary-xyz" in r.stderr
        with pytest.raises(ValueError, match="list of str"):
            await sb.exec("echo hi", timeout_s=10)
        with pytest.raises(ValueError, match="timeout_s"):
            await sb.exec(["true"], timeout_s=0)

    run(tmp_path, body)


def _loopback_server():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    threading.Thread(target=lambda: [srv.accept()[0].close() for _ in range(4)], daemon=True).start()
    return srv, srv.getsockname()[1]


PROBE = "import socket,sys\ns=socket.socket(); s.settimeout(2)\ntry:\n s.connect(('127.0.0.1', int(sys.argv[1]))); print('connected')\nexcept OSError as e: print('blocked', e)"


@pytest.mark.parametrize(
    "network",
    [
        False,
        pytest.param(
            True,
            marks=pytest.mark.skipif(not shutil.which("slirp4netns"), reason="slirp4netns not installed"),
        ),
    ],
)
def test_network_isolation(tmp_path, network):
    # network=True has a network namespace of its own too (tests/sandboxes/test_sandboxes_network.py):
    # neither reaches the host's loopback.
    srv, port = _loopback_server()

    async def body(sb):
        r = await sb.exec(["python3", "-c", PROBE, str(port)], timeout_s=20)
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith("blocked"), r.stdout
        r = await sb.exec(["cat", "/proc/net/dev"], timeout_s=10)
        devices = [ln.split(":")[0].strip() for ln in r.stdout.splitlines()[2:]]
        assert devices == (["lo", "tap0"] if network else ["lo"])  # network=False: nothing routable

    try:
        run(tmp_path, body, network=network)
    finally:
        srv.close()


def test_cannot_write_outside_workdir(tmp_path):
    host_dir = tmp_path / "host"
    host_dir.mkdir()
    target = host_dir / "pwned"

    async def body(sb):
        for path in ("/usr/pwned", "/etc/pwned", str(target), "/pwned"):
            r = await sb.exec(["sh", "-c", f"echo x > {path}"], timeout_s=10)
            assert r.returncode != 0, path
        with pytest.raises(OSError):
            await sb.write_file("/usr/pwned", "x")
        r = await sb.exec(
            ["sh", "-c", "echo ok > /workspace/f && echo t > /tmp/t && cat /workspace/f /workspace/.tmp/t"],
            timeout_s=10,
        )
        assert r.stdout == "ok\nt\n"
        r = await sb.exec(
            ["sh", "-c", "ls /root /work 2>&1; test -e /etc/shadow && echo shadow"], timeout_s=10
        )
        assert "shadow" not in r.stdout

    run(tmp_path, body)
    assert not target.exists()


def test_own_pid_namespace(tmp_path):
    async def body(sb):
        r = await sb.exec(["sh", "-c", "ls /proc | grep -c '^[0-9]'"], timeout_s=10)
        # bwrap's init, the agent, sh, ls, grep: a handful, not the host's hundreds
        assert int(r.stdout) < 10

    run(tmp_path, body)


def test_crash_returns_signal(tmp_path):
    async def body(sb):
        r = await sb.exec(["python3", "-c", "import os; os.abort()"], timeout_s=20)
        assert r.returncode == -6 and not r.timed_out
        r = await sb.exec(["python3", "-c", "raise SystemExit('boom')"], timeout_s=20)
        assert r.returncode == 1 and "boom" in r.stderr
        assert (await sb.exec(["true"], timeout_s=10)).returncode == 0  # sandbox survives

    run(tmp_path, body)


def test_hang_past_timeout_kills_group(tmp_path):
    async def body(sb):
        before = descendants(sb.pid)
        r = await sb.exec(["sh", "-c", "sleep 300 & sleep 300"], timeout_s=1)
        assert r.timed_out and r.returncode == -9
        assert 0.9 < r.duration_s < 5
        assert descendants(sb.pid) <= before, "timed-out command left processes"

    run(tmp_path, body)


def test_forked_children_do_not_outlive_exec(tmp_path):
    async def body(sb):
        before = descendants(sb.pid)
        r = await sb.exec(["sh", "-c", "sleep 300 & sleep 300 & echo started"], timeout_s=30)
        assert r.stdout == "started\n" and not r.timed_out
        assert r.duration_s < 5, "exec waited for background children"
        assert not wait_gone(descendants(sb.pid) - before, 2)
        # A setsid'ed escapee outlives the exec but not the sandbox (checked in _with_sandbox).
        r = await sb.exec(
            ["sh", "-c", "setsid sleep 300 >/dev/null 2>&1 < /dev/null & echo ok"], timeout_s=30
        )
        assert r.stdout == "ok\n"

    run(tmp_path, body)


def test_fill_memory_hits_limit(tmp_path):
    async def body(sb):
        code = "x = []\nwhile True: x.append(bytearray(16 << 20))"
        r = await sb.exec(["python3", "-c", code], timeout_s=30)
        assert r.returncode != 0 and not r.timed_out
        assert "MemoryError" in r.stderr or r.returncode < 0
        assert (await sb.exec(["true"], timeout_s=10)).returncode == 0

    run(tmp_path, body, memory_mb=256)


def test_cpu_time_limit(tmp_path):
    async def body(sb):
        # cpu=0.2 cores over a 10 s timeout = 3 CPU-seconds: SIGXCPU/SIGKILL before the wall clock.
        r = await sb.exec(["python3", "-c", "while True: pass"], timeout_s=10)
        assert r.returncode in (-24, -9) and not r.timed_out

    run(tmp_path, body, cpu=0.2)


def test_process_count_limit(tmp_path):
    async def body(sb):
        r = await sb.exec(["sh", "-c", "for i in $(seq 40); do sleep 30 & done; wait"], timeout_s=20)
        assert r.returncode != 0 and "process limit" in r.stderr
        assert (await sb.exec(["true"], timeout_s=10)).returncode == 0

    run(tmp_path, body, max_procs=12)


def test_lifetime_ends_sandbox(tmp_path):
    async def main():
        provider = LocalProvider(registry_dir=tmp_path / "reg")
        sb = await provider.create(SandboxSpec(timeout_s=1.0), tags={})
        await sb.ready()
        await asyncio.sleep(2.5)
        assert not sb.is_alive()
        with pytest.raises(SandboxLostError):
            await sb.exec(["true"], timeout_s=5)
        assert not alive(sb.pid)
        await sb.terminate()

    asyncio.run(main())


def test_killed_mid_exec_is_lost(tmp_path):
    async def body(sb):
        task = asyncio.ensure_future(sb.exec(["sleep", "30"], timeout_s=60))
        await asyncio.sleep(0.3)
        sb.kill_now()
        with pytest.raises(SandboxLostError):
            await task

    run(tmp_path, body)


def test_missing_bwrap_is_a_clear_error():
    with pytest.raises(ProviderUnavailableError, match="apt-get install bubblewrap"):
        LocalProvider(bwrap="definitely-not-bwrap")


def test_command_shape():
    argv = LocalProvider(registry_dir="/nonexistent").command(SandboxSpec(network=False), "x")
    for flag in ("--unshare-net", "--unshare-pid", "--die-with-parent", "--cap-drop", "--clearenv"):
        assert flag in argv
    assert "--unshare-net" in LocalProvider().command(SandboxSpec(network=True), "x")  # own netns always
    if shutil.which("setpriv"):
        assert argv[:4] == [shutil.which("setpriv"), "--pdeathsig", "KILL", "--"]
    with pytest.raises(ValueError, match="root-fs directory"):
        LocalProvider().command(SandboxSpec(image="/no/such/dir"), "x")


def test_unread_stdin_and_concurrent_execs(tmp_path):
    async def body(sb):
        # 4 MiB of stdin to a command that never reads it: the timeout still fires on time.
        r = await sb.exec(["sleep", "30"], timeout_s=1, stdin=b"x" * (4 << 20))
        assert r.timed_out and r.duration_s < 5
        results = await asyncio.gather(
            *(sb.exec(["sh", "-c", f"sleep 0.3; echo {i}"], timeout_s=10) for i in range(4))
        )
        assert [r.stdout for r in results] == [f"{i}\n" for i in range(4)]
        big = await sb.exec(["python3", "-c", "print('y' * 3_000_000)"], timeout_s=20)
        assert len(big.stdout) == 3_000_001

    run(tmp_path, body)
