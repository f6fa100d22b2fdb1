"""Settings objects that replaced long constructors: each refuses a bad value where it is made,
in one line that names the field and the fix, and the constructors take them whole."""

from __future__ import annotations

import pytest

from modal_rl.engines.sglang import DiskReload, SglangEngine
from modal_rl.engines.vllm_push import EnginePusher, LoadSettings
from modal_rl.run_key import new_run_key
from modal_rl.weightsync.transport.tcp_source import Dial, TcpSource


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: LoadSettings(pull_timeout_s=0), "pull_timeout_s=0: give a number of seconds > 0"),
        (lambda: LoadSettings(pull_timeout_s="9"), "pull_timeout_s='9': give a number of seconds > 0"),
        (lambda: LoadSettings(inplace=1), "inplace=1: give True or False"),
        (lambda: LoadSettings().with_settings(inplce=False), "unknown EnginePusher setting(s) inplce;"),
        (lambda: Dial(backoff_s=-1), "Dial backoff_s=-1: give a number of seconds >= 0"),
        (lambda: Dial(connect_timeout_s=0), "Dial connect_timeout_s=0: give a number of seconds > 0"),
        (lambda: DiskReload("nope"), "DiskReload newest='nope': give a function () -> (version, directory)"),
        (lambda: DiskReload(lambda: (0, None), None, "/ckpt"), "a local_checkpoint_dir needs the source_dir"),
    ],
)
def test_a_bad_setting_is_one_line_naming_the_field(make, message):
    with pytest.raises((ValueError, TypeError)) as info:
        make()
    assert message in str(info.value) and "\n" not in str(info.value)


def test_constructors_take_the_settings_objects():
    key = new_run_key()
    with EnginePusher(None, key=key, load=LoadSettings(pull_timeout_s=5.0), inplace=False) as pusher:
        assert (pusher.pull_timeout_s, pusher.inplace, pusher.hold_requests) == (5.0, False, False)
    source = TcpSource("127.0.0.1", 9, key=None, dial=Dial(connect_timeout_s=2.0, backoff_s=0.0))
    assert (source.connect_timeout, source.backoff) == (2.0, 0.0)
    reload = DiskReload(lambda: (0, None), "/disk")
    assert SglangEngine("m", reload=reload).reload is reload
