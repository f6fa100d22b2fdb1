"""slime on a ``modal_rl.cluster`` cluster: the Ray job we submit, and the argv rewrites.

slime is launched as ``ray job submit --runtime-env-json=... -- python3 train.py <args>``; we
submit the same job, through ``modal_rl.cluster.run_job``, with the runtime env slime's own
scripts build (``slime/utils/external_utils/command_utils.py``, the examples' run scripts):

- ``PYTHONPATH`` = Megatron-LM checkout : slime checkout : whatever the node had (Ray expands
  ``${PYTHONPATH}`` on the node), because Megatron's ``megatron.training`` is not pip-installed;
- ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (Megatron's TP/SP overlap relies on it);
- ``NCCL_NVLS_ENABLE=0``: slime sets it from ``nvidia-smi topo`` on the submitting host; we
  submit from a host that has no view of the cluster's GPUs, and NVLS (NVLink SHARP) needs
  multicast support that containers do not reliably get, so off unless ``--env`` sets it;
- cluster addresses, known only once the nodes exist, filled in at bring-up
  (``JobRequest.address_env``): ``SLIME_HOST_IP`` = each node's own cluster address (slime's
  ``get_host_info`` otherwise guesses the default-route address, which on Modal is not the
  cluster network), ``MASTER_ADDR`` = the head's, ``no_proxy``/``NO_PROXY`` = loopback + all
  node addresses (slime and sglang talk HTTP between nodes);
- ``MODAL_RL_VOLUMES`` = ``{mount path: volume name}`` as JSON, for the weight-sync hooks;
- on Modal, ``MODAL_RL_SANDBOX_BACKEND=modal`` (``slime_modal.reward``'s sandboxes).

A ``--env`` value always wins over these defaults. The user's slime argv is passed through
unchanged except for two documented additions (:func:`with_volume_hooks`,
:func:`with_reward_groups`), each only where the user named no function of their own.
"""

from __future__ import annotations

import json
import os

from slime_modal.preflight import SlimeArgs, under

# slime's published image (docker/README.md: "`slimerl/slime:latest` tracks the CUDA 12 build");
# docker/Dockerfile clones slime to /root/slime and Megatron-LM to /root/Megatron-LM.
SLIME_IMAGE = "slimerl/slime:latest"
SLIME_PATH = "/root/slime"
MEGATRON_PATH = "/root/Megatron-LM"
HF_CACHE_PATH = "/root/.cache/huggingface"
HF_CACHE_VOLUME = "slime-hf-cache"
DATA_PATH = "/data"
CKPT_PATH = "/ckpt"

POST_WRITE_FLAG = "--custom-update-weight-post-write-path"
PRE_READ_FLAG = "--sglang-custom-pull-weights-pre-read-hook"
POST_WRITE_HOOK = "slime_modal.weight_hooks.post_write_commit"
PRE_READ_HOOK = "slime_modal.weight_hooks.pre_read_reload"

ADDRESS_ENV = {"SLIME_HOST_IP": "node", "MASTER_ADDR": "head", "no_proxy": "no_proxy", "NO_PROXY": "no_proxy"}
VOLUMES_ENV = "MODAL_RL_VOLUMES"


def image_note(tag: str, slime_path: str, megatron_path: str) -> str:
    """One line for the cluster image, which is never inspected here: what it must hold."""
    moving = " (a moving tag: pin a digest, --image slimerl/slime@sha256:..., for repeatable runs)"
    return (
        f"image {tag} is used as given (not inspected{moving if tag.endswith(':latest') else ''}): it must "
        f"hold slime at {slime_path} and Megatron-LM at {megatron_path} (--slime-path/--megatron-path), "
        f"sglang and ray; check with `docker run --rm {tag} ls {slime_path}/train.py {megatron_path}`"
    )


def entry_path(entry: str, slime_path: str) -> str:
    """``train.py`` and friends live in the slime checkout; an absolute path is used as is."""
    return entry if os.path.isabs(entry) else os.path.join(slime_path, entry)


def runtime_env(
    user_env: dict[str, str],
    slime_path: str,
    megatron_path: str,
    volumes: dict[str, str],
    backend: str = "local",
    extra_paths: list[str] = (),
) -> dict:
    """The Ray job's runtime env (see the module docstring); keys the user set with ``--env``
    are left out, so the user's value (in every node's env) reaches the job unchanged.
    ``extra_paths``: slime example folders the line's modules live in (``examples.example_dirs``)."""
    env = {
        "PYTHONPATH": ":".join([megatron_path, slime_path, *extra_paths, "${PYTHONPATH}"]),
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
        "NCCL_NVLS_ENABLE": "0",
        VOLUMES_ENV: json.dumps({path: name for name, path in volumes.items()}, sort_keys=True),
    }
    if any(path == HF_CACHE_PATH for path in volumes.values()):
        env["HF_HOME"] = HF_CACHE_PATH
    if backend == "modal":
        # Sandboxes for slime_modal.reward from inside a Modal container are Modal Sandboxes
        # (the pool's local default needs bubblewrap, which slime's image lacks).
        env["MODAL_RL_SANDBOX_BACKEND"] = "modal"
    return {"env_vars": {k: v for k, v in env.items() if k not in user_env}}


def address_env(user_env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in ADDRESS_ENV.items() if k not in user_env}


def with_volume_hooks(argv: list[str], mounts: list[str]) -> tuple[list[str], list[str]]:
    """``(argv, added)``: with disk weight sync (full or delta) into a Modal Volume, append our
    Volume commit / reload hooks, unless the user chose hooks of their own.

    A Volume shows one container's writes to another only after ``commit`` on the writer and
    ``reload`` on the reader; slime's hooks are exactly those two points. ``added`` lists the
    appended tokens (empty: argv unchanged)."""
    args = SlimeArgs(argv)
    disk_dir = args.get("--update-weight-disk-dir")
    if args.get("--update-weight-transport") != "disk" or not disk_dir or not under(disk_dir, mounts):
        return list(argv), []
    added: list[str] = []
    if not args.has(POST_WRITE_FLAG):
        added += [POST_WRITE_FLAG, POST_WRITE_HOOK]
    if not args.has(PRE_READ_FLAG):
        added += [PRE_READ_FLAG, PRE_READ_HOOK]
    return [*argv, *added], added


def with_reward_groups(argv: list[str]) -> tuple[list[str], list[str]]:
    """``(argv, added)``: with our sandboxed reward (``--custom-rm-path slime_modal.reward...``),
    append our reward post-processing (``slime_modal.reward_groups``: masked samples move no
    sibling's group statistics), unless the user chose a post-process function of their own."""
    from slime_modal import reward_groups

    args = SlimeArgs(argv)
    rm_path = args.get("--custom-rm-path") or ""
    if not rm_path.startswith("slime_modal.reward.") or args.has(reward_groups.FLAG):
        return list(argv), []
    added = [reward_groups.FLAG, reward_groups.PATH]
    return [*argv, *added], added


def with_cpu_mode(runtime_env: dict, user_env: dict[str, str]) -> None:
    """CPU mode (``--cpu``): the boundary's start-up directory first on ``PYTHONPATH`` and its
    env (``slime_modal.cpu.activate.job_env``), keys the user set with ``--env`` left out."""
    from slime_modal.cpu.activate import BOOT_DIR, job_env

    env = runtime_env["env_vars"]
    env["PYTHONPATH"] = f"{BOOT_DIR}:{env.get('PYTHONPATH', '${PYTHONPATH}')}"
    env.update({k: v for k, v in job_env().items() if k not in user_env})


# Ray CPUs of a CPU-mode local node: slime's placement bundles take one CPU per logical GPU,
# beside its rollout manager and the reward's actors (logical, like the GPUs).
CPU_MODE_RAY_CPUS = 8


def cpu_cluster(slime_argv: list[str], external_engines: bool, gpu_given: bool) -> dict:
    """ClusterSpec fields of a CPU-mode local run: as many logical GPUs as slime asks for
    (unless ``--gpu`` gave a count) and :data:`CPU_MODE_RAY_CPUS` Ray CPUs."""
    from slime_modal.preflight import SlimeArgs, required_gpus

    fields: dict = {"cpu": CPU_MODE_RAY_CPUS}
    if not gpu_given:
        fields["local_gpus_per_node"] = max(1, required_gpus(SlimeArgs(slime_argv), external_engines).total)
    return fields
