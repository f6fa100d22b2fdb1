"""ModalProvider: request building and error mapping offline against the real modal 1.6 API;
a live round trip only when MODAL_TOKEN_ID is set."""

from __future__ import annotations

import asyncio
import inspect
import os

import modal
import modal.exception as me
import pytest
from modal.sandbox import Probe

from modal_rl.sandboxes import RateLimitedError, SandboxSpec, TransientProviderError
from modal_rl.sandboxes.modal_provider import ModalProvider, map_modal_error


def test_create_kwargs_bind_to_the_real_signature():
    provider = ModalProvider(region="us-east")
    spec = SandboxSpec(
        image="python:3.11-slim", cpu=2.0, memory_mb=2048, timeout_s=90.5, network=False, env={"A": "b"}
    )
    app = modal.App("modal-rl-offline-test")
    kw = provider.create_kwargs(spec, {"modal-rl-run": "r1", "modal-rl-pool": "p"}, app)
    inspect.signature(modal.Sandbox.create).bind(**kw)  # raises on a wrong name or a positional
    assert kw["app"] is app
    assert isinstance(kw["image"], modal.Image)
    assert (kw["cpu"], kw["memory"], kw["timeout"], kw["block_network"]) == (2.0, 2048, 91, True)
    assert kw["tags"] == {"modal-rl-run": "r1", "modal-rl-pool": "p"}
    assert kw["env"] == {"A": "b"} and kw["region"] == "us-east"
    assert isinstance(kw["readiness_probe"], Probe)
    assert list(kw["readiness_probe"].exec_argv) == ["mkdir", "-p", "/workspace"]
    assert provider.create_kwargs(SandboxSpec(network=True), {}, app)["block_network"] is False


def test_image_validation():
    provider = ModalProvider()
    assert isinstance(provider.image_for(SandboxSpec()), modal.Image)
    img = modal.Image.debian_slim().pip_install("numpy")
    assert provider.image_for(SandboxSpec(image=img)) is img
    with pytest.raises(ValueError, match="registry tag or a modal.Image"):
        provider.image_for(SandboxSpec(image=3))


def test_error_mapping():
    assert isinstance(map_modal_error(me.ResourceExhaustedError("too many")), RateLimitedError)
    assert isinstance(map_modal_error(me.ConnectionError("reset")), TransientProviderError)
    assert isinstance(map_modal_error(me.InternalFailure("x")), TransientProviderError)
    perm = me.InvalidError("bad image")
    assert map_modal_error(perm) is perm


def test_aio_entry_points_exist():
    # The provider calls these .aio variants; fail loudly if a modal upgrade renames them.
    for fn in (modal.Sandbox.create, modal.Sandbox.list, modal.App.lookup):
        assert hasattr(fn, "aio")
    for name in ("exec", "terminate", "wait_until_ready"):
        assert hasattr(getattr(modal.Sandbox, name), "aio")


@pytest.mark.modal_live
@pytest.mark.skipif(not os.environ.get("MODAL_TOKEN_ID"), reason="needs MODAL_TOKEN_ID")
def test_live_round_trip():
    from modal_rl.sandboxes import SandboxPool

    async def main():
        spec = SandboxSpec(image="python:3.11-slim", timeout_s=300)
        async with (
            SandboxPool(ModalProvider(), spec, min_warm=1, max_live=2, run_id="modal-rl-live-test") as pool,
            pool.lease() as sb,
        ):
            r = await sb.exec(["python3", "-c", "print(6*7)"], timeout_s=60)
            assert r.stdout == "42\n" and r.returncode == 0
            await sb.write_file("x.txt", "hi")
            assert await sb.read_file("x.txt") == b"hi"
            r = await sb.exec(["sleep", "30"], timeout_s=2)
            assert r.timed_out
        assert await ModalProvider().sweep({"modal-rl-run": "modal-rl-live-test"}) == 0

    asyncio.run(main())


class _Aio:
    """A callable with an ``.aio`` coroutine twin, the shape of Modal's synchronicity methods."""

    def __init__(self, fn):
        self.fn = fn

    async def aio(self, *a, **kw):
        return self.fn(*a, **kw)


class _FakeProcess:
    def __init__(self, rc, out, err):
        self.fed = b""
        self.stdin = type(
            "W",
            (),
            {
                "write": lambda _, d: setattr(self, "fed", self.fed + d),
                "write_eof": lambda _: None,
                "drain": _Aio(lambda: None),
            },
        )()
        self.stdout, self.stderr = (
            type("R", (), {"read": _Aio(lambda: out)})(),
            type("R", (), {"read": _Aio(lambda: err)})(),
        )
        self.wait = _Aio(lambda: rc)


class _FakeModalSandbox:
    """Stands in for the Modal server side of one sandbox (the only fake in these tests)."""

    object_id = "sb-fake"
    returncode = None

    def __init__(self, rc=0, out=b"out", err=b""):
        self.calls, self.files, self.proc = [], {}, _FakeProcess(rc, out, err)
        self.exec = _Aio(lambda *argv, **kw: self.calls.append((argv, kw)) or self.proc)
        self.terminate = _Aio(lambda: self.calls.append("terminate"))
        self.filesystem = type("FS", (), {})()
        self.filesystem.write_bytes = _Aio(lambda data, path: self.files.__setitem__(path, data))
        self.filesystem.read_bytes = _Aio(lambda path: self.files[path])


def test_modal_handle_maps_exec_and_files():
    from modal_rl.sandboxes.modal_provider import ModalSandbox

    async def main():
        fake = _FakeModalSandbox(rc=0, out=b"hi\n")
        sb = ModalSandbox(fake, SandboxSpec(), {"t": "1"})
        r = await sb.exec(["python3", "-c", "x"], timeout_s=2.5, stdin="abc", env={"A": "b"})
        assert (r.returncode, r.stdout, r.timed_out) == (0, "hi\n", False)
        (argv, kw) = fake.calls[0]
        assert (
            argv == ("python3", "-c", "x")
            and kw["timeout"] == 3
            and kw["env"] == {"A": "b"}
            and kw["text"] is False
        )
        assert kw["workdir"] == "/workspace" and fake.proc.fed == b"abc"
        await sb.write_file("a.txt", "data")
        assert (
            fake.files == {"/workspace/a.txt": b"data"} and await sb.read_file("/workspace/a.txt") == b"data"
        )
        timed = ModalSandbox(_FakeModalSandbox(rc=-1), SandboxSpec(), {})
        r = await timed.exec(["sleep", "9"], timeout_s=1)
        assert r.timed_out and r.returncode == -9  # Modal 1.6 reports an exec deadline as -1
        await sb.terminate()
        await sb.terminate()
        assert fake.calls.count("terminate") == 1 and not sb.is_alive()

    asyncio.run(main())
