"""A tiny random Llama and a byte-level BPE tokenizer for it, made on the spot (no downloads).

Shared by the vLLM integration tests and the vLLM benchmark. The model is small enough for
vLLM's CPU engine to start in seconds, with vLLM's CPU attention (head size 32) and logits
spread wide enough (the output layer is scaled up) that sampling choices depend on the
prompt rather than on the noise alone.
"""

from __future__ import annotations

import random
from pathlib import Path

VOCAB_SIZE = 512
BOS, EOS = 1, 2
# Logit standard deviation of the scaled output layer: a few units, as a trained model's.
LOGIT_SCALE = 12.0


def _corpus(lines: int = 4000) -> list[str]:
    words = ("the of and to in is that for it as with was on be by at this from or have an "
             "are not but what all were when we there can more if will one about up out them "
             "true false null name value items count text data list key id type number").split()
    rng = random.Random(0)
    out = []
    for _ in range(lines):
        sentence = " ".join(rng.choice(words) for _ in range(rng.randint(3, 12)))
        out.append(sentence)
        out.append('{"%s": %d, "%s": "%s"}' % (rng.choice(words), rng.randint(0, 999),
                                               rng.choice(words), rng.choice(words)))
    return out


def make_tokenizer(path: Path):
    """Train a byte-level BPE tokenizer with exactly VOCAB_SIZE tokens (ids 0-2: <unk>, <s>,
    </s>) and save it as a transformers fast tokenizer in ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(_corpus(), trainer)
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer has {tokenizer.get_vocab_size()} tokens, not {VOCAB_SIZE}")
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
    fast.save_pretrained(str(path))
    return fast


def make_model(path: Path, seed: int = 0, layers: int = 2, vocab_size: int = VOCAB_SIZE):
    """Save a random float32 LlamaForCausalLM (hidden 128, 4 heads of 32, 2 KV heads) in
    ``path``, with its tokenizer when ``vocab_size`` is the tokenizer's (VOCAB_SIZE); returns
    the model (eval mode, on the CPU)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, bos_token_id=BOS, eos_token_id=EOS,
                         tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(LOGIT_SCALE)
    model.save_pretrained(str(path))
    model.generation_config.save_pretrained(str(path))
    if vocab_size == VOCAB_SIZE:
        make_tokenizer(path)
    return model
