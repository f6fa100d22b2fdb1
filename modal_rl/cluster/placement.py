"""How many identical nodes a set of pools needs, each pool asking for ``nodes`` shares of
``per_node`` GPUs (Ray places a pool's node-sized bundles one per node, first fit)."""

from __future__ import annotations


def nodes_needed(shares: list[tuple[int, int]], gpus_per_node: int) -> int | None:
    """Nodes of ``gpus_per_node`` GPUs holding every ``(per_node, count)`` share: first fit,
    largest first; ``None`` when a share is larger than a node."""
    sizes = sorted((per for per, count in shares for _ in range(count)), reverse=True)
    if sizes and sizes[0] > gpus_per_node:
        return None
    free: list[int] = []
    for size in sizes:
        for i, left in enumerate(free):
            if left >= size:
                free[i] -= size
                break
        else:
            free.append(gpus_per_node - size)
    return len(free)
