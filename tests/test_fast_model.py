"""The fast decoder computes what transformers computes.

Tiny random models of each supported family; logits compared with the transformers
``Backbone`` for prefill, one-token steps, tree forwards (tree mask, explicit positions),
after cache compaction and without a cache; greedy tree decoding with compaction gives
the transformers model's plain greedy tokens.
"""

from __future__ import annotations

import pytest
import torch
from tiny import byte_tokenizer
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from cadence.backbone.base import Backbone
from cadence.fast.model import FastBackbone

ATOL = 1e-4  # logits are O(10) here; fp32 reassociation differences are ~1e-5

COMMON = {"vocab_size": 260, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
          "tie_word_embeddings": False, "initializer_range": 0.3, "eos_token_id": 256}

FAMILIES = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**COMMON)),
    "llama-tied": lambda: LlamaForCausalLM(LlamaConfig(**{**COMMON, "tie_word_embeddings": True})),
    "llama-bias": lambda: LlamaForCausalLM(LlamaConfig(**COMMON, attention_bias=True, mlp_bias=True)),
    "llama3-rope": lambda: LlamaForCausalLM(LlamaConfig(**COMMON, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "llama-linear-rope": lambda: LlamaForCausalLM(LlamaConfig(**COMMON, rope_parameters={
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0})),
    "llama-yarn-rope": lambda: LlamaForCausalLM(LlamaConfig(**COMMON, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128})),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**COMMON, sliding_window=None)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**COMMON)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**COMMON, head_dim=16)),
}


def pair(family: str, kernel: str = "auto", seed: int = 0) -> tuple[Backbone, FastBackbone]:
    """The same random weights as a transformers Backbone and as a FastBackbone."""
    torch.manual_seed(seed)
    a = FAMILIES[family]().float()
    b = type(a)(a.config).float()
    b.load_state_dict(a.state_dict())
    return Backbone(a, byte_tokenizer(), "ref"), FastBackbone(b, byte_tokenizer(), "fast", kernel=kernel)


def tree_mask(parents: list[int]) -> torch.Tensor:
    n = len(parents)
    m = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            m[i, j] = True
            j = parents[j]
    return m


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape
    err = (a - b).abs().max().item()
    assert err < ATOL, f"max |diff| {err}"


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("kernel", ["auto", "aten"])
def test_logits_match_transformers(family, kernel):
    ref, fast = pair(family, kernel)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (1, 11), generator=g)
    c_ref, c_fast = ref.new_cache(), fast.new_cache()
    close(ref.forward(ids, c_ref).logits, fast.forward(ids, c_fast).logits)  # prefill
    step = torch.randint(0, 256, (1, 1), generator=g)
    close(ref.forward(step, c_ref).logits, fast.forward(step, c_fast).logits)  # one token
    past = c_ref.length()
    assert fast.new_cache().length() == 0 and c_fast.length() == past == 12
    parents = [-1, 0, 0, 1, 2, 2]
    depths = [0, 1, 1, 2, 2, 2]
    mask, pos = tree_mask(parents), torch.tensor([depths]) + past
    toks = torch.randint(0, 256, (1, 6), generator=g)
    close(ref.forward(toks, c_ref, pos, mask).logits, fast.forward(toks, c_fast, pos, mask).logits)
    keep = [0, 2, 5]  # not a prefix: exercises the index copy
    c_ref.compact(past, keep)
    c_fast.compact(past, keep)
    assert c_fast.length() == c_ref.length() == past + 3
    nxt = torch.randint(0, 256, (1, 3), generator=g)  # a causal multi-token step after compaction
    close(ref.forward(nxt, c_ref).logits, fast.forward(nxt, c_fast).logits)
    batch = torch.randint(0, 256, (3, 9), generator=g)  # no cache, batch > 1 (training, calibration)
    out_ref, out_fast = ref.forward(batch), fast.forward(batch)
    close(out_ref.logits, out_fast.logits)
    close(out_ref.hidden, out_fast.hidden)
    assert fast.forward(batch, need_logits=False).logits is None


def reference_greedy(bb: Backbone, prompt: list[int], n: int) -> list[int]:
    cache, out = bb.new_cache(), []
    logits = bb.forward(torch.tensor([prompt]), cache).logits[0, -1]
    while len(out) < n:
        out.append(int(logits.argmax()))
        logits = bb.forward(torch.tensor([[out[-1]]]), cache).logits[0, -1]
    return out


def assert_tree_rows_are_one_token_forwards(bb, prompt: list[int]) -> None:
    """After ``prompt``, token 7's logits as the root of a branching 5-node tree equal its
    one-token forward's, bit for bit (what makes speculation identical to plain decoding)."""
    cache = bb.new_cache()
    bb.forward(torch.tensor([prompt]), cache)
    past = cache.length()
    alone = bb.forward(torch.tensor([[7]]), cache).logits[0, 0]
    cache.compact(past, [])
    tree = bb.forward(torch.tensor([[7, 8, 9, 10, 11]]), cache, torch.tensor([[0, 1, 1, 2, 1]]) + past,
                      tree_mask([-1, 0, 0, 2, 0])).logits[0]
    assert torch.equal(tree[0], alone)


def tree_greedy(bb, prompt: list[int], n: int, reference: list[int]) -> tuple[list[int], int]:
    """Greedy tree decoding with a 4-node tree per step: root, a wrong sibling, the right
    token (from ``reference``) and, every other step, its right child. Accepted paths like
    [0, 2, 3] make compaction copy entries. Returns the tokens and the number of steps."""
    cache = bb.new_cache()
    logits = bb.forward(torch.tensor([prompt]), cache).logits[0, -1]
    out, steps = [int(logits.argmax())], 0
    while len(out) < n:
        past, i = cache.length(), len(out)
        right = reference[i] if i < len(reference) else 0
        child = reference[i + 1] if i + 1 < len(reference) and steps % 2 else (right + 7) % 256
        toks = [out[-1], (right + 1) % 256, right, child]
        parents, depths = [-1, 0, 0, 2], [0, 1, 1, 2]
        logits = bb.forward(torch.tensor([toks]), cache, torch.tensor([depths]) + past,
                            tree_mask(parents)).logits[0]
        path, node = [0], 0
        while True:
            want = int(logits[node].argmax())
            kids = [c for c in range(len(toks)) if parents[c] == node and toks[c] == want]
            if not kids:
                break
            node = kids[0]
            path.append(node)
            out.append(toks[node])
        out.append(int(logits[node].argmax()))  # the bonus token
        cache.compact(past, path)
        steps += 1
    return out[:n], steps


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_greedy_generation_identical(family):
    ref, fast = pair(family, seed=3)
    prompt = list(range(40, 52))
    expected = reference_greedy(ref, prompt, 24)
    assert reference_greedy(fast, prompt, 24) == expected
    got, steps = tree_greedy(fast, prompt, 24, expected)
    assert got == expected
    assert steps < 20  # drafts were accepted, so compaction ran on real paths
    assert tree_greedy(ref, prompt, 24, expected)[0] == expected


def test_cache_grows_without_changing_results():
    ref, fast = pair("llama")
    ids = torch.randint(0, 256, (1, 7), generator=torch.Generator().manual_seed(2))
    small = fast.new_cache(capacity=4)
    c_ref = ref.new_cache()
    close(ref.forward(ids, c_ref).logits, fast.forward(ids, small).logits)
    assert small.capacity >= 7
    for t in (3, 9, 11):  # steps past the grown capacity
        step = torch.tensor([[t]])
        close(ref.forward(step, c_ref).logits, fast.forward(step, small).logits)
    small.reset()
    assert small.length() == 0


def test_padded_batch_without_cache_matches_transformers():
    ref, fast = pair("qwen3")
    ids = torch.randint(0, 256, (3, 8), generator=torch.Generator().manual_seed(4))
    pad = torch.ones(3, 8, dtype=torch.long)
    pad[1, 5:] = 0  # right padding, as batched training features use
    pad[2, 2:] = 0
    a = ref.forward(ids, attention_mask=pad).hidden
    b = fast.forward(ids, attention_mask=pad).hidden
    for i, n in enumerate(pad.sum(1).tolist()):
        close(a[i, :n], b[i, :n])
    assert not torch.isnan(b).any()


def test_right_padding_attends_causally_and_left_padding_through_the_mask(monkeypatch):
    """Right padding needs no mask (a real token only sees real tokens under the causal
    one): the forward must not build it, and real rows keep transformers' values; left
    padding still goes through the padding mask."""
    from cadence.fast import model as fast_model
    assert fast_model._right_padded(torch.tensor([[1, 1, 0], [1, 1, 1]]))
    assert not fast_model._right_padded(torch.tensor([[0, 1, 1]]))
    assert not fast_model._right_padded(torch.tensor([[1, 0, 1]]))
    ref, fast = pair("llama")
    built = []
    real = fast._padded_mask
    monkeypatch.setattr(fast, "_padded_mask", lambda pad: built.append(1) or real(pad))
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(5))
    right = torch.ones(2, 7, dtype=torch.long)
    right[1, 4:] = 0
    b = fast.forward(ids, attention_mask=right).hidden
    assert not built
    a = ref.forward(ids, attention_mask=right).hidden
    for i, n in enumerate(right.sum(1).tolist()):
        close(a[i, :n], b[i, :n])
    left = torch.ones(2, 7, dtype=torch.long)
    left[1, :3] = 0
    b = fast.forward(ids, attention_mask=left).hidden
    assert built and not torch.isnan(b).any()
    a = ref.forward(ids, attention_mask=left).hidden
    close(a[0], b[0])
    close(a[1, 3:], b[1, 3:])


def test_forward_inside_bf16_autocast_keeps_backbone_dtype():
    ref, fast = pair("llama")
    ids = torch.randint(0, 256, (2, 6))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fast.forward(ids)
        logits = fast.logits(out.hidden.bfloat16())
    assert out.hidden.dtype == torch.float32
    close(ref.forward(ids).logits, out.logits)
    assert (logits - out.logits).abs().max() < 0.5  # the head ran on bf16-rounded hidden states
