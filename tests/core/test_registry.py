"""``modal_rl.registry``: the one registry idiom (lazy ``pkg.mod:Name`` loaders, entry points),
and the sandbox providers found through it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from modal_rl.registry import Registry


def test_targets_load_lazily_and_unknown_names_are_one_line_errors():
    reg = Registry("widget")
    reg.add("dec", "json.decoder:JSONDecoder.decode")
    assert reg.names() == ["dec"]
    import json.decoder

    assert reg.load("dec") is json.decoder.JSONDecoder.decode
    with pytest.raises(ValueError, match=r"unknown widget 'nope'; known: \['dec'\]"):
        reg.load("nope")
    reg.add("broken", "modal_rl_no_such_module:X")
    with pytest.raises(ValueError, match="widget 'broken': cannot load"):
        reg.load("broken")
    with pytest.raises(ValueError, match="pkg.module:Name"):
        reg.add("bad", "no_colon")


def test_a_provider_package_plugs_in_through_the_entry_point_group(tmp_path):
    """A package that is not modal_rl adds a sandbox backend with an entry point only; choosing
    another backend never imports it, and registering imports nothing."""
    (tmp_path / "fakeprov.py").write_text(
        "from modal_rl.sandboxes.local import LocalProvider\n\nclass FakeProvider(LocalProvider):\n    name = 'fake'\n"
    )
    dist = tmp_path / "fakeprov-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fakeprov\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[modal_rl.sandbox_providers]\nfake = fakeprov:FakeProvider\n")
    code = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        from modal_rl.sandboxes import shared
        from modal_rl.sandboxes.providers import PROVIDERS
        assert "fake" in PROVIDERS.names() and "fakeprov" not in sys.modules
        assert shared.settings(backend="local")["backend"] == "local"
        assert "fakeprov" not in sys.modules and "modal_rl.sandboxes.modal_provider" not in sys.modules
        assert shared.settings(backend="fake")["backend"] == "fake"
        cls = PROVIDERS.load("fake")
        assert cls.__name__ == "FakeProvider" and cls.from_settings({{}}).name == "fake"
        try:
            shared.settings(backend="nope")
        except ValueError as exc:
            assert "unknown sandbox backend 'nope'" in str(exc) and "fake" in str(exc), exc
        else:
            raise AssertionError("an unknown backend was accepted")
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "ok", out.stderr


def test_light_imports_load_only_what_they_use():
    """Importing the weight-sync package, the Volume helpers slime's hooks need, or the store
    transport (with its file reader and the ports), loads no codec (numba, numpy, zstd); the
    package's names still resolve, on first use."""
    code = (
        "import sys\nimport modal_rl.weightsync, modal_rl.weightsync.transport.volumes, slime_modal.weight_hooks\n"
        "import modal_rl.weightsync.transport.store, modal_rl.weightsync.transport.base\n"
        "heavy = sorted(k for k in ('numba', 'numpy', 'zstandard', 'torch') if k in sys.modules)\n"
        "assert not heavy, heavy\nfrom modal_rl.weightsync import VersionChain, CodecConfig\n"
        "assert 'zstandard' in sys.modules and modal_rl.weightsync.codec.encode.CodecConfig is CodecConfig\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr
