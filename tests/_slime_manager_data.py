"""A prompt list for slime's ``--data-source-path`` hook in the rollout-manager tests.

slime's rollout actor builds its data source from that path with ``cls(args)`` and asks it for
its length (``get_num_rollout_per_epoch``); its default one needs a tokenizer and a prompt file,
which have nothing to do with the engines under test.
"""


class PromptList:
    def __init__(self, args):
        self.prompts = ["1+1=", "2+2="]

    def __len__(self) -> int:
        return len(self.prompts)
