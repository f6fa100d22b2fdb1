"""What happens to running requests when a version is committed between their tokens.

A request that is generating when version ``v+1`` lands has keys/values (its KV cache) for
its prompt and first ``i`` tokens computed by version ``v``. Three choices, one per run:

- ``keep``: the KV cache stays; token ``i`` onward is sampled by ``v+1`` attending to keys
  and values ``v`` made. The sample's record says tokens ``[0, i)`` came from ``v`` and
  ``[i, n)`` from ``v+1`` -- true of the sampling weights, but the distribution of token
  ``i`` is neither policy's exactly (a mixture at the attention level). For the policy
  gradient the behaviour log-probabilities the engine returns are still the ones it sampled
  with, so an importance ratio against them stays correct; what is lost is that they equal
  ``pi_v+1``'s own log-probabilities of those tokens. Cheapest: no pause beyond the scatter
  and no recomputation. Needs the engine's prefix cache off (vLLM cannot drop cached
  prefixes while running requests hold blocks, and a new request must not start on another
  version's keys/values).
- ``recompute``: running requests are preempted and their KV cache recomputed with ``v+1``
  before their next token (vLLM's ``reset_prefix_cache?reset_running_requests=true``). Token
  ``i`` onward is exactly ``pi_v+1`` given the prefix; tokens before ``i`` were still
  sampled by ``v``, which the record says. Costs one prefill per running request.
- ``abort``: running requests are aborted (vLLM's ``/pause?mode=abort``) and come back
  unfinished; every finished sample is single-version, at the cost of the work thrown away
  (the caller resubmits).

Invariant: the choice changes only what running requests see; the commit itself (the
scatter between two decoding steps) and the version records are the same in all three.
"""

from __future__ import annotations

RUNNING = ("keep", "recompute", "abort")


def check_running(choice: str) -> str:
    if choice not in RUNNING:
        raise ValueError(
            f"running={choice!r}: choose keep, recompute or abort (see modal_rl.asyncrl.kv_policy)"
        )
    return choice
