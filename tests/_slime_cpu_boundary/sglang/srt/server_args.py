"""``ServerArgs``: the fields of SGLang's dataclass that slime sets or checks (same names).

slime's ``_compute_server_args`` reads ``dataclasses.fields(ServerArgs)`` to drop keys the
installed SGLang lacks; an external engine is never constructed from it.
"""

import dataclasses


@dataclasses.dataclass
class ServerArgs:
    model_path: str | None = None
    trust_remote_code: bool = False
    random_seed: int | None = None
    enable_memory_saver: bool = False
    host: str = "127.0.0.1"
    port: int = 30000
    nccl_port: int | None = None
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    gpu_id_step: int = 1
    base_gpu_id: int = 0
    tp_size: int = 1
    dp_size: int = 1
    pp_size: int = 1
    ep_size: int = 1
    skip_server_warmup: bool = False
    enable_draft_weights_cpu_backup: bool = False
    enable_metrics: bool = False
    dtype: str = "auto"
    enable_return_routed_experts: bool = False
