"""``kill_process_tree``: slime calls it only for engines it launched itself, never here."""


def kill_process_tree(parent_pid, include_parent=True, skip_pid=None):
    raise NotImplementedError("the SGLang boundary of the tests launches no engine process")
