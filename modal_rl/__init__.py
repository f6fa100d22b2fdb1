"""modal-rl: Modal infrastructure for slime and verl RL post-training.

The core is framework-neutral: nothing under ``modal_rl`` imports slime or verl.
Three capabilities, each a small port with a Modal and a local implementation:

- ``modal_rl.cluster``: multi-node Ray clusters (Modal RDMA clusters, or N local Ray nodes);
- ``modal_rl.sandboxes``: pools of isolated sandboxes (Modal Sandboxes, or bubblewrap);
- ``modal_rl.weightsync``: lossless delta-compressed trainer→rollout weight sync.
"""

__version__ = "0.1.0"
