"""slime example lines as their scripts write them (``slime_modal.examples``): the entry script,
the example folders on PYTHONPATH, servers expected on the job's own node."""

from __future__ import annotations

import pytest

from slime_modal import examples as X

ASYNC = ["--rollout-function-path", "fully_async_rollout.generate_rollout_fully_async"]


def test_fully_async_rollout_picks_train_async_unless_entry_is_given():
    assert X.entry_for(["--lr", "1"], None) == ("train.py", None)
    entry, note = X.entry_for(ASYNC, None)
    assert entry == "train_async.py" and "--entry train.py to override" in note
    assert X.entry_for(ASYNC, "train.py") == ("train.py", None)


def test_bare_example_modules_put_their_folder_on_pythonpath():
    line = [
        *ASYNC,
        "--custom-rm-path",
        "generate_with_search.reward_func",
        "--custom-config-path",
        "/a/b.yaml",
    ]
    assert X.example_dirs(line, "/root/slime") == [
        "/root/slime/examples/fully_async",
        "/root/slime/examples/search-r1",
    ]
    # examples.<folder>.<module> resolves from the slime checkout itself; slime's own modules too
    assert X.example_dirs(["--custom-generate-function-path", "examples.multi_agent.x.f"], "/s") == []
    assert X.example_dirs(["--custom-rm-path", "slime.rollout.rm_hub.f"], "/s") == []


@pytest.mark.parametrize(
    ("argv", "given", "want"),
    [
        (["python3", "train_async.py", "--lr", "1"], None, (["--lr", "1"], "train_async.py")),
        (["train.py", "--lr", "1"], None, (["--lr", "1"], "train.py")),
        (["--lr", "1"], "x.py", (["--lr", "1"], "x.py")),
    ],
)
def test_a_pasted_script_head_becomes_the_entry(argv, given, want):
    assert X.split_script(argv, given) == want


@pytest.mark.parametrize(
    ("argv", "given", "needle"),
    [
        (["python3", "train.py"], "train_async.py", "drop one of them"),
        (["python3", "-m", "slime"], None, "give the script and its arguments"),
    ],
)
def test_a_script_head_that_cannot_be_the_entry_is_one_line(argv, given, needle):
    with pytest.raises(ValueError, match=needle):
        X.split_script(argv, given)


def test_a_teacher_on_localhost_is_named():
    (line,) = X.loopback_servers(["--rm-url", "http://localhost:13141/generate"])
    assert "nothing starts it on Modal" in line and "\n" not in line
    assert X.loopback_servers(["--rm-url", "https://teacher.example.org/generate"]) == []
