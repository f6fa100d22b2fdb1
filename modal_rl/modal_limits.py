"""Limits of the Modal platform that more than one part of modal-rl must respect, defined once."""

# The longest `timeout` Modal accepts for a function or sandbox (24 hours). A cluster's
# containers and a standalone engine pool ask for at most this much; a longer job must
# checkpoint and resume.
MAX_MODAL_TIMEOUT_S = 24 * 3600
