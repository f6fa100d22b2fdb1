"""Sandboxed code never sees the run's key, Modal credentials or the host's environment.

Local: a real bubblewrap sandbox started from a process whose environment holds the run key,
Ray's token and Modal credentials; the code inside looks for them everywhere it can (its env,
every /proc/*/environ and cmdline it can read, the files it can open). Modal: the create and
exec requests, built offline against the real modal 1.6 signatures, carry none of them.
"""

from __future__ import annotations

import asyncio
import inspect

import modal
import pytest

from modal_rl.run_key import new_run_key
from modal_rl.sandboxes import LocalProvider, SandboxSpec
from modal_rl.sandboxes.envguard import SandboxEnvError
from modal_rl.sandboxes.modal_provider import ModalProvider
from tests._sandboxes_helpers import needs_bwrap

HOST_ONLY = "host-only-value-7f3a"

# Prints every place a secret could reach sandboxed code: its env, readable /proc entries and
# the home directories and token files of the host.
_PROBE = r"""
import glob, os
seen = [k + "=" + v for k, v in os.environ.items()]
for path in glob.glob("/proc/*/environ") + glob.glob("/proc/*/cmdline"):
    try:
        seen.append(open(path, "rb").read().decode(errors="replace"))
    except OSError:
        pass
for path in ("/root/.modal.toml", "/root/.ray/auth_token", "/root/.modal-rl"):
    seen.append(path + (" visible" if os.path.exists(path) else " absent"))
print("\n".join(seen))
"""


@pytest.fixture
def run_env(monkeypatch):
    key = new_run_key()
    for name, value in {
        "MODAL_RL_RUN_KEY": key,
        "RAY_AUTH_TOKEN": key,
        "MODAL_TOKEN_ID": "ak-" + HOST_ONLY,
        "MODAL_TOKEN_SECRET": "as-" + HOST_ONLY,
        "SOME_HOST_SETTING": HOST_ONLY,
    }.items():
        monkeypatch.setenv(name, value)
    return key


@needs_bwrap
def test_local_sandbox_sees_no_key_credentials_or_host_env(tmp_path, run_env):
    async def main():
        provider = LocalProvider(registry_dir=tmp_path / "reg")
        sb = await provider.create(SandboxSpec(env={"TASK": "t1"}), tags={"test": "secrets"})
        try:
            await asyncio.wait_for(sb.ready(), 10)
            return await sb.exec(["python3", "-c", _PROBE], timeout_s=20, env={"STEP": "s1"})
        finally:
            await sb.terminate()

    result = asyncio.run(main())
    assert result.ok, result.stderr
    out = result.stdout
    assert "TASK=t1" in out and "STEP=s1" in out  # the probe really read the env
    for leaked in (run_env, HOST_ONLY, "MODAL_RL_RUN_KEY", "RAY_AUTH_TOKEN", "MODAL_TOKEN"):
        assert leaked not in out, f"{leaked!r} reached the sandbox"
    assert "/root/.modal.toml absent" in out and "/root/.modal-rl absent" in out


def test_modal_requests_carry_no_key_credentials_or_host_env(run_env):
    provider = ModalProvider()
    app = modal.App("modal-rl-offline-test")
    kw = provider.create_kwargs(SandboxSpec(env={"TASK": "t1"}), {"t": "1"}, app)
    inspect.signature(modal.Sandbox.create).bind(**kw)
    assert kw["env"] == {"TASK": "t1"}
    assert "secrets" not in kw  # a sandbox is its own container: no Modal Secret is attached
    assert run_env not in repr(kw) and HOST_ONLY not in repr(kw)
    with pytest.raises(ValueError, match="sandboxes take no secrets"):
        ModalProvider(extra_create_kwargs={"secrets": [modal.Secret.from_dict({"A": "b"})]})


@pytest.mark.parametrize(
    "env",
    [
        {"MODAL_RL_RUN_KEY": "x"},
        {"RAY_AUTH_TOKEN": "x"},
        {"MODAL_TOKEN_SECRET": "x"},
        {"RAY_ADDRESS": "x"},
        {"INNOCENT_NAME": "KEY"},  # the run key under another name
    ],
)
def test_both_providers_refuse_a_credential_handed_in(tmp_path, run_env, env):
    env = {k: (run_env if v == "KEY" else v) for k, v in env.items()}
    with pytest.raises(SandboxEnvError) as err:
        ModalProvider().create_kwargs(SandboxSpec(env=env), {}, modal.App("offline"))
    assert run_env not in str(err.value)  # the error names the variable, never the key
    with pytest.raises(SandboxEnvError):
        LocalProvider(registry_dir=tmp_path / "reg").command(SandboxSpec(env=env), "id0")


def test_a_part_holding_only_derived_keys_cannot_hand_one_in(monkeypatch, tmp_path):
    """An engine process holds no run key, only its bearer and frame-read key: a value carrying
    either, under an innocent name, is refused too (and the error never shows it)."""
    from modal_rl.run_key import ENGINE_BEARER_ENV, FRAME_READ_ENV, RUN_KEY_ENV

    monkeypatch.delenv(RUN_KEY_ENV, raising=False)
    for name in (ENGINE_BEARER_ENV, FRAME_READ_ENV):
        secret = f"derived-{name.lower()}-0123456789abcdef"
        monkeypatch.setenv(name, secret)
        env = {"INNOCENT_NAME": f"prefix {secret} suffix"}
        with pytest.raises(SandboxEnvError) as err:
            LocalProvider(registry_dir=tmp_path / "reg").command(SandboxSpec(env=env), "id0")
        assert secret not in str(err.value)
        monkeypatch.delenv(name)
