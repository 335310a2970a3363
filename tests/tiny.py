"""Tiny random backbones and drafters for tests (no downloads, seconds on a CPU)."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from cadence.backbone import Backbone
from cadence.drafter import Draft

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level tokenizer: 256 byte tokens + <eos>, <pad>, <|user|>, <|assistant|> (vocab 260)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for s in ("<eos>", "<pad>", "<|user|>", "<|assistant|>"):
        vocab[s] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>",
                                   additional_special_tokens=["<|user|>", "<|assistant|>"])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_backbone(arch: str = "llama", vocab: int = 260, seed: int = 0, hidden: int = 64,
                  layers: int = 2, tokenizer: bool = True, eos: int | None = None) -> Backbone:
    """A random tiny Llama or Qwen2 as a frozen Backbone (float32, CPU)."""
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=False, initializer_range=0.3, eos_token_id=256 if eos is None and vocab > 256 else eos)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        raise ValueError(arch)
    return Backbone(model.float(), byte_tokenizer() if tokenizer else None, name=f"tiny-{arch}")


class OracleDrafter:
    """Proposes the backbone's own continuation (known in advance) as every rank-0 candidate.

    ``reference`` is the plain greedy output for this prompt; the drafter looks up the
    tokens after the current position. Other ranks get wrong tokens. With it every
    rank-0 path is accepted, so tau = min(depth + 1, tokens left).
    """

    def __init__(self, reference: list[int], prompt_len: int, num_heads: int, vocab: int):
        self.reference, self.prompt_len = reference, prompt_len
        self.num_heads, self.vocab = num_heads, vocab

    def draft(self, tree, root, hidden, context, sampling, generator) -> Draft:
        pos = len(context) - self.prompt_len  # index of root in the reference
        tokens = torch.empty(tree.size, dtype=torch.long)
        tokens[0] = root
        on_path = {0: True}
        for node in range(1, tree.size):
            parent = tree.parents[node]
            right = on_path[parent] and tree.ranks[node] == 0
            idx = pos + tree.depths[node]
            true_tok = self.reference[idx] if idx < len(self.reference) else 0
            tokens[node] = true_tok if right else (true_tok + tree.ranks[node] + 1) % self.vocab
            on_path[node] = right and idx < len(self.reference)
        return Draft(tokens=tokens, q=None)
