"""The tiny local model both frameworks' CPU runs train, made here (nothing downloaded): a
~0.4 M-parameter Qwen2, a byte-level BPE tokenizer trained on the task's own text, and the
"write a program" code task whose answers are stdin/stdout test cases
(``modal_rl.sandboxes.coderun`` format).

The adapters put these in their framework's form (``verl_modal.cpu.tiny``: parquet rows and
Hydra overrides; ``slime_modal.cpu.tiny``: JSONL and Megatron's shape flags), so a verl and a
slime CPU run train the same model on the same prompts.

Invariants: the same seed gives the same tasks, tokenizer and initial weights; a task is a
dict ``{"question", "ground_truth", "solution"}`` (``solution`` may be absent), and the
tokenizer's corpus is the tasks' questions with their ground truth, their solutions as python
blocks, and runs of integers (so numbers in answers tokenize), in that order.
"""

from __future__ import annotations

import json
import random

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen2 shape giving ~0.4 M parameters; head_dim 32 is a size vLLM's CPU attention supports.
MODEL_SHAPE = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
CODE_OPS = {"+": "sum", "-": "difference", "*": "product"}


def code_tasks(n: int, seed: int, split: str, n_cases: int = 2) -> list[dict]:
    """``n`` tasks asking for a program that reads ``a b`` on stdin and prints ``a op b``;
    ``ground_truth`` is the JSON ``{"inputs": [...], "outputs": [...]}``."""
    rng = random.Random(f"{seed}-{split}-code")
    tasks = []
    for _ in range(n):
        op = rng.choice("+-*")
        pairs = [(rng.randint(-50, 99), rng.randint(-50, 99)) for _ in range(n_cases)]
        results = [{"+": a + b, "-": a - b, "*": a * b}[op] for a, b in pairs]
        tests = {"inputs": [f"{a} {b}\n" for a, b in pairs], "outputs": [f"{r}\n" for r in results]}
        question = f"Write Python: read a b, print their {CODE_OPS[op]}. Reply with a python block."
        solution = f"a, b = map(int, input().split())\nprint(a {op} b)"
        tasks.append({"question": question, "ground_truth": json.dumps(tests), "solution": solution})
    return tasks


def corpus(tasks: list[dict]) -> list[str]:
    """The tokenizer's training text for ``tasks`` (see the module's invariants)."""
    text = [t["question"] + f" #### {t['ground_truth']}" for t in tasks]
    text += [f"```python\n{t['solution']}\n```" for t in tasks if t.get("solution")]
    return text + [" ".join(str(k) for k in range(start, start + 50)) for start in range(-100, 10000, 50)]


def make_tokenizer(tasks: list[dict], vocab_size: int):
    """A byte-level BPE trained here on ``tasks``' text, as a ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(tasks), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )


def make_model(tokenizer, seed: int):
    """A random-init Qwen2 causal LM sized by :data:`MODEL_SHAPE`, vocab padded to 64."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    vocab = (len(tokenizer) + 63) // 64 * 64
    config = Qwen2Config(
        vocab_size=vocab,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        torch_dtype="bfloat16",
        **MODEL_SHAPE,
    )
    return Qwen2ForCausalLM(config).to(torch.bfloat16)
