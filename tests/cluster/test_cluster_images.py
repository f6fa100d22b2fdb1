"""Cluster images from the installed stack (``modal_rl.cluster.images``, ``verl_modal.image``) and
the dry run's summary (``modal_rl.cluster.summary``): offline, real metadata, real modal.Image."""

from __future__ import annotations

from importlib.metadata import requires, version

import pytest
from omegaconf import OmegaConf

from modal_rl.cluster.images import (
    ImageRecipe,
    ImageRecipeError,
    extra_requirements,
    pins,
    unchecked_image_note,
)
from modal_rl.cluster.summary import MAX_LINES, WIDTH, render
from verl_modal.image import recipe_for


def test_extras_expand_self_references_and_read_verls_own_pins():
    reqs = extra_requirements("verl", ("vllm",))
    declared = [r for r in requires("verl") if 'extra == "vllm"' in r and not r.startswith("verl[")]
    assert all(r.split(";")[0].replace(" ", "") in {x.replace(" ", "") for x in reqs} for r in declared)
    # verl[verl-core] is pulled by the vllm extra: its members are here, verl itself is not
    assert any(r.startswith("ray") for r in reqs) and not any(r.startswith("verl") for r in reqs)
    assert pins(reqs)["vllm"] and pins(["a>=1", "b==2.0"]) == {"b": "2.0"}
    with pytest.raises(ImageRecipeError, match="not installed"):
        extra_requirements("no-such-dist-here", ("x",))


def test_recipe_pins_the_installed_version_and_builds_offline():
    recipe = ImageRecipe("verl", ("sglang", "megatron"), commands=("true",))
    assert recipe.framework() == f"verl[sglang,megatron]=={version('verl')}"
    pinned = recipe.pinned()
    assert pinned["verl"] == version("verl") and pinned["sglang"] and pinned["megatron-bridge"]
    reqs = recipe.requirements()
    assert reqs[0] == recipe.framework() and not any(r.startswith("torch>") for r in reqs)  # verl's pin wins
    # torch at verl's pin goes in first (flash-attn's build imports it), with the build tools
    assert f"torch=={pinned['torch']}" in recipe.build_first() and "setuptools" in recipe.build_first()
    import modal

    assert isinstance(recipe.build(), modal.Image)
    note = unchecked_image_note("me/img:1", recipe, ("verl", "torch"))
    assert "\n" not in note and f"verl=={version('verl')}" in note and "docker run --rm me/img:1" in note


@pytest.mark.parametrize(
    ("line", "extras"),
    [
        (
            {"actor_rollout_ref": {"rollout": {"name": "sglang"}, "actor": {"strategy": "megatron"}}},
            ("sglang", "megatron"),
        ),
        (
            {"actor_rollout_ref": {"rollout": {"name": "vllm"}, "actor": {"strategy": "fsdp2"}}},
            ("vllm", "fsdp"),
        ),
        (
            {"actor_rollout_ref": {"rollout": {"name": "modal_vllm"}, "actor": {"strategy": "veomni"}}},
            ("vllm", "veomni-sft"),
        ),
    ],
)
def test_verl_extras_follow_the_line(line, extras):
    assert recipe_for(OmegaConf.create(line)).extras == extras
    # a uv --extra the line asked for joins them; an unknown one does not
    asked = recipe_for(OmegaConf.create(line), requested=("megatron", "nonsense"))
    assert "megatron" in asked.extras and "nonsense" not in asked.extras


def test_summary_is_short_and_cuts_long_lines():
    plan = {
        "backend": "modal",
        "spec": {"nodes": 2, "gpu": "H100:8", "rdma": True, "volumes": {"d": "/d"}},
        "entrypoint": ["python", "-m", "x", "--", *[f"k{i}=v" for i in range(300)]],
        "big": {f"key{i}": "v" * 500 for i in range(80)},
    }
    lines = render(plan).splitlines()
    assert len(lines) == MAX_LINES and all(len(line) <= WIDTH for line in lines)
    assert lines[0] == "plan (modal): 2 node(s) x H100:8, RDMA on, timeout None s, retries None"
    assert "(+300 args)" in next(line for line in lines if line.startswith("job:"))
    assert lines[-1].startswith("preflight:") and "more line(s)" in lines[-2]
