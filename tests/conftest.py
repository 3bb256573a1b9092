"""Shared fixtures: tiny random targets saved as HF model directories (loadable by `load_target(path)`),
a tiny in-process ChatML tokenizer and a tiny ShareGPT file. No hub access; everything is built here."""
from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch

from drafthead.assets import cache_dir

# Triton's decorators (its own standard library included) read TRITON_INTERPRET when `triton` is first
# imported, and torch._dynamo imports triton as a side effect. On a machine without CUDA the interpreter is
# the only way the kernels run, so switch it on before any test module can import triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# train.py keeps freed memory in the heap (drafthead.trainer.memory.retain_freed_memory); in the long-lived pytest
# process that would pin every test's peak, so it is off here and tested in a subprocess of its own.
os.environ.setdefault("DRAFTHEAD_MALLOC_RETAIN", "0")
# Many tiny runs move their data caches to tmp (DRAFTHEAD_CACHE); the CPU kernels stay where the first build put
# them, so a training subprocess of such a test does not compile them again (~35-50 s each on 2 cores).
os.environ.setdefault("DRAFTHEAD_KERNEL_CACHE", str(cache_dir()))

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
WORDS = ("the a sea blue answer capital paris france poem write think about how are you hello there what is it "
         "one two three four five cat dog tree house river sun moon star light dark red green small big fast slow "
         "code python list sort number tell me why because").split()
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def make_tokenizer():
    """Byte-level BPE (~300 tokens) trained in-process, ChatML template, pad = <|endoftext|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [" ".join(WORDS) + " user assistant system. Hello, how are you? 1 2 3 4 5 6 7 8 9 0"] * 4
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    hf.chat_template = CHATML
    return hf


def _save_target(folder: Path, arch: str) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    tok = make_tokenizer()
    common = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None,
                  tie_word_embeddings=False)
    torch.manual_seed(0)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common))
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """HF directory of a random 4-layer Llama (hidden 64) with a ChatML tokenizer."""
    return _save_target(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory) -> Path:
    """HF directory of a random 4-layer Qwen3 (hidden 64, q/k norms) with a ChatML tokenizer."""
    return _save_target(tmp_path_factory.mktemp("tiny_qwen3"), "qwen3")


def make_sharegpt(path: Path, n: int = 40, seed: int = 0) -> Path:
    """`n` ShareGPT rows of random words; every third one is multi-turn (with a system prompt)."""
    rng = random.Random(seed)

    def say(lo: int, hi: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    rows = []
    for i in range(n):
        turns = [{"from": "human", "value": say(3, 10) + "?"}, {"from": "gpt", "value": say(5, 25) + "."}]
        if i % 3 == 0:
            turns = [{"from": "system", "value": say(2, 5)}, *turns,
                     {"from": "human", "value": say(2, 8) + "?"}, {"from": "gpt", "value": say(4, 15) + "."}]
        rows.append({"id": f"conv{i}", "conversations": turns})
    path.write_text(json.dumps(rows))
    return path


@pytest.fixture(scope="session")
def tiny_sharegpt(tmp_path_factory) -> Path:
    """A 40-conversation ShareGPT JSON file."""
    return make_sharegpt(tmp_path_factory.mktemp("data") / "tiny_sharegpt.json")


@pytest.fixture(scope="session")
def specforge_domino():
    """SpecForge 0.2.0's `specforge.modeling.draft.domino` from its peer site (tests/peers.py), or a skip naming why
    it could not be had."""
    import importlib

    from tests.peers import SPECFORGE, add_to_path

    try:
        add_to_path(SPECFORGE)
    except RuntimeError as e:  # no package index here
        pytest.skip(f"specforge 0.2.0 could not be fetched: {e}")
    return importlib.import_module("specforge.modeling.draft.domino")


@pytest.fixture(scope="session")
def speculators_models():
    """The `speculators.models` package (0.9.0) from its peer site (tests/peers.py), or a skip naming why it could
    not be had. The site goes at the END of sys.path: what is installed wins."""
    import importlib

    from tests.peers import SPECULATORS, add_to_path

    try:
        return importlib.import_module("speculators.models")
    except ImportError:
        pass
    try:
        add_to_path(SPECULATORS)
    except RuntimeError as e:  # no package index here
        pytest.skip(f"speculators 0.9.0 could not be fetched: {e}")
    return importlib.import_module("speculators.models")
