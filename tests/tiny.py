"""Tiny random backbones and drafters for tests (no downloads, seconds on a CPU)."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from cadence.backbone.base import Backbone
from cadence.draft.base import Draft

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

    def __init__(self, reference: list[int], prompt_len: int, num_heads: int, vocab: int,
                 right_rank=0):
        self.reference, self.prompt_len = reference, prompt_len
        self.num_heads, self.vocab = num_heads, vocab
        # which candidate rank carries the right token: an int, or a function of the token's
        # index in the reference (then some right tokens may be missing from the tree)
        self.right_rank = right_rank

    def max_depth(self, sampling) -> int:
        return self.num_heads

    def new_index(self):
        return None

    def draft(self, tree, root, hidden, context, sampling, generator, copies=None) -> Draft:
        pos = len(context) - self.prompt_len  # index of root in the reference
        tokens = torch.empty(tree.size, dtype=torch.long)
        tokens[0] = root
        on_path = {0: True}
        for node in range(1, tree.size):
            parent = tree.parents[node]
            idx = pos + tree.depths[node]
            want = self.right_rank(idx) if callable(self.right_rank) else self.right_rank
            right = on_path[parent] and tree.ranks[node] == want
            true_tok = self.reference[idx] if idx < len(self.reference) else 0
            tokens[node] = true_tok if right else (true_tok + tree.ranks[node] + 1 + want) % self.vocab
            on_path[node] = right and idx < len(self.reference)
        return Draft(tokens=tokens, q=None)


class BackboneDrafter:
    """An oracle-like drafter for T > 0: q is the backbone's own (filtered) distribution.

    For every node with children it runs the backbone (no cache) on context + the
    node's path and draws the children i.i.d. from ``q = (1 - mix) * p + mix * uniform``.
    ``mix = 0`` gives q = p (every first child is accepted with probability 1);
    ``mix > 0`` gives partial acceptance. At T = 0 the children are p's top-ranked tokens.
    """

    def __init__(self, backbone: Backbone, num_heads: int, mix: float = 0.0):
        self.backbone, self.num_heads, self.mix = backbone, num_heads, mix

    def max_depth(self, sampling) -> int:
        return self.num_heads

    def new_index(self):
        return None

    @torch.inference_mode()
    def draft(self, tree, root, hidden, context, sampling, generator, copies=None) -> Draft:
        from cadence.verify.sampling import categorical, probs

        n = tree.size
        tokens = torch.empty(n, dtype=torch.long)
        tokens[0] = root
        q = None if sampling.greedy else torch.zeros(n, self.backbone.vocab_size)
        for node in range(n):  # parents come before children in node order
            if not tree.children[node]:
                continue
            path, j = [], node
            while j >= 0:
                path.append(int(tokens[j]))
                j = tree.parents[j]
            ids = torch.tensor([list(context) + path[::-1]])
            logits = self.backbone.forward(ids).logits[0, -1]
            width = tree.width(node)
            if sampling.greedy:
                cand = logits.topk(width).indices
            else:
                dist = (1 - self.mix) * probs(logits, sampling) + self.mix / logits.shape[-1]
                q[node] = dist
                cand = categorical(dist, width, generator)
            for child in tree.children[node]:
                tokens[child] = cand[tree.ranks[child]]
        return Draft(tokens=tokens, q=q)


def save_tiny(directory, arch: str = "llama", **kwargs):
    """Save a tiny backbone and its byte tokenizer as a HF model directory; return the Backbone."""
    bb = tiny_backbone(arch, **kwargs)
    bb.model.save_pretrained(directory)
    if bb.tokenizer is not None:
        bb.tokenizer.save_pretrained(directory)
    return bb
