"""Products on a GGUF file's own blocks (``fast/native/gemm_q.cpp``, ``--quant gguf``).

What must hold: the kernel's weights are ``gguf.quants.dequantize`` of the same bytes bit for
bit; its products are the dequantize-then-fp32-matmul ones up to float rounding; a row's bits
do not depend on the other rows of the call, the thread count or (slow test) the instruction
set the extension was built for; a backbone on a GGUF file's blocks speculates to its own
plain greedy tokens, every tree node getting the bits of a one-token forward. Blocks are made
here with numpy and ``gguf`` (no model download).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cadence.fast import native

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType
ops = native.module()
needs_native = pytest.mark.skipif(ops is None, reason="needs the native extension")
TYPES = [T.Q4_0, T.Q4_1, T.Q8_0, T.F16, T.F32]


def blocks(w: np.ndarray, qtype) -> torch.Tensor:
    """w (out, in) float32 in GGML type qtype -> (out, row bytes) uint8, as a GGUF file stores it."""
    if qtype == T.F32:
        data = np.ascontiguousarray(w, dtype=np.float32)
    elif qtype == T.F16:
        data = w.astype(np.float16)
    else:
        data = gguf.quants.quantize(w.astype(np.float32), qtype)
    return torch.from_numpy(np.ascontiguousarray(data).view(np.uint8).reshape(w.shape[0], -1).copy())


def dequantized(b: torch.Tensor, qtype, k: int) -> torch.Tensor:
    """``gguf.quants.dequantize`` of the bytes -> (out, k) float32 (F16 / F32 rows: their values)."""
    raw = b.numpy()
    if qtype == T.F32:
        return torch.from_numpy(raw.view(np.float32).copy())
    if qtype == T.F16:
        return torch.from_numpy(raw.view(np.float16).astype(np.float32))
    return torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32).reshape(-1, k))


def weights(out: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((out, k)).astype(np.float32) * 0.05
    w[0, :32] = 0.0  # an all-zero block (scale 0)
    w[1, 32:64] = 3.0  # a constant block (Q4_1: step 0, minimum 3)
    return w


@needs_native
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_the_kernels_weights_are_gguf_dequantize_bit_for_bit(qtype):
    w = weights(40, 96, int(qtype))
    b = blocks(w, qtype)
    assert b.shape[1] == ops.q_row_bytes(int(qtype), 96)
    ref = dequantized(b, qtype, 96)
    got = ops.q_dequantize(b, int(qtype), 96)
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32))


@needs_native
def test_q4_1_bytes_sit_where_the_kernel_comment_says():
    """gemm_q.cpp's worked example: in a Q4_1 row of 576 weights (20-byte blocks: d, m, then
    16 bytes of nibbles), weight 37 is the low nibble of byte 29, weight 53 its high nibble."""
    row = np.zeros((1, 360), dtype=np.uint8)
    row[0, 0::20] = 0x00
    row[0, 1::20] = 0x3C  # d = 1.0 (fp16 0x3C00, little-endian), m = 0
    row[0, 29] = 0x95  # low nibble 5, high nibble 9
    want = np.zeros(576, dtype=np.float32)
    want[37], want[53] = 5.0, 9.0
    assert np.array_equal(gguf.quants.dequantize(row, T.Q4_1).reshape(-1), want)
    assert torch.equal(ops.q_dequantize(torch.from_numpy(row), int(T.Q4_1), 576)[0], torch.from_numpy(want))


@needs_native
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("shape", [(100, 64), (49, 576), (24, 1536)])
def test_products_match_the_dequantized_matmul_and_rows_do_not_depend_on_the_others(qtype, shape):
    out, k = shape
    w = weights(out, k, out + k)
    b = blocks(w, qtype)
    dense = dequantized(b, qtype, k)
    gen = torch.Generator().manual_seed(out)
    x = torch.randn(33, k, generator=gen)
    bias = torch.randn(out, generator=gen)
    y = ops.q_linear(x, b, int(qtype), out, bias)
    ref = x.double() @ dense.double().T + bias.double()
    bound = (x.abs().double() @ dense.abs().double().T) * (k * 2 ** -24) + 1e-6  # a fp32 sum's error bound
    assert ((y.double() - ref).abs() <= bound).all()
    assert (y.double() - ref).abs().max() < 1e-4
    for n in range(1, 34):  # every row count: the first n rows, and row 0 alone
        assert torch.equal(ops.q_linear(x[:n], b, int(qtype), out, bias), y[:n]), n
    for i in (5, 17, 32):  # a row alone, and inside calls that start elsewhere
        assert torch.equal(ops.q_linear(x[i:i + 1], b, int(qtype), out, bias), y[i:i + 1])
        assert torch.equal(ops.q_linear(x[i - 3:i + 1], b, int(qtype), out, bias)[-1], y[i])
    assert torch.equal(ops.q_linear(x.view(3, 11, k), b, int(qtype), out, bias), y.view(3, 11, out))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(ops.q_linear(x, b, int(qtype), out, bias), y)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(ops.q_linear(x, b, int(qtype), out, None) + bias, y)  # the bias is added last


@needs_native
def test_bad_weights_are_clear_errors():
    b = blocks(weights(8, 64, 0), T.Q4_1)
    with pytest.raises(RuntimeError, match="not one of"):
        ops.q_linear(torch.randn(2, 64), b, int(T.Q6_K), 8, None)
    with pytest.raises(RuntimeError, match="rows of"):
        ops.q_linear(torch.randn(2, 96), b, int(T.Q4_1), 8, None)
    with pytest.raises(RuntimeError, match="fp32"):
        ops.q_linear(torch.randn(2, 64).bfloat16(), b, int(T.Q4_1), 8, None)


def test_head_rows_undo_llama_cpps_permutation():
    from cadence.fast.gguf import head_rows

    assert head_rows(8, 1).tolist() == [0, 2, 4, 6, 1, 3, 5, 7]  # the docstring's example
    # transformers' reverse permutation of a file's rows, applied to row ids
    rows = np.arange(24)
    want = rows.reshape(3, 4, 2).swapaxes(2, 1).reshape(24)
    assert head_rows(24, 3).tolist() == want.tolist()


@pytest.mark.slow
@needs_native
@pytest.mark.parametrize("level", ["avx2", "avx512", "x86-64"])
def test_the_avx2_avx512_and_generic_builds_give_the_same_bits(level):
    """The kernel as CADENCE_ISA=avx2 / avx512 builds it (-march=haswell / skylake-avx512) and
    for plain x86-64 (std::fma per lane): the native build's bits, since every operation is a
    lane-wise IEEE one and the lane sums are added in one fixed order. About two minutes each
    to compile (a build CADENCE_ISA made already is reused)."""
    import platform

    from cadence.system.machine import _hardware_flags

    need = {"avx2": "avx2", "avx512": "avx512bw", "x86-64": "sse2"}[level]
    if platform.machine() not in ("x86_64", "AMD64") or need not in _hardware_flags():
        pytest.skip(f"x86-64 with {need} only")
    other = native.build_for(level) if level != "x86-64" else native.build_variant("cadence_layers_x86_64", level)
    assert other.q_isa() == {"avx2": "avx2", "avx512": "avx512", "x86-64": "generic"}[level]
    for qtype in TYPES:
        b = blocks(weights(24, 576, 7), qtype)
        x = torch.randn(5, 576, generator=torch.Generator().manual_seed(1))
        assert torch.equal(other.q_dequantize(b, int(qtype), 576), ops.q_dequantize(b, int(qtype), 576))
        assert torch.equal(other.q_linear(x, b, int(qtype), 24, None), ops.q_linear(x, b, int(qtype), 24, None)), qtype


# -- a backbone on a GGUF file's blocks ------------------------------------------------------

LAYER_TYPES = {  # per layer, the GGML type of each projection (layer 1 mixes formats)
    0: {"q_proj": T.Q4_1, "k_proj": T.Q4_1, "v_proj": T.Q4_1, "o_proj": T.Q4_1,
        "gate_proj": T.Q4_1, "up_proj": T.Q4_1, "down_proj": T.Q4_1},
    1: {"q_proj": T.Q8_0, "k_proj": T.Q8_0, "v_proj": T.Q8_0, "o_proj": T.Q4_0,
        "gate_proj": T.Q4_0, "up_proj": T.Q8_0, "down_proj": T.F32},
}


def gguf_model(tmp_path, family: str = "llama-tied"):
    """A tiny random model whose weights are a GGUF file's dequantized blocks, as
    ``cadence.backbone.load`` loads one, and that file (q and k rows permuted as llama.cpp
    writes them). -> (transformers model, tokenizer, path)."""
    from test_fast_model import FAMILIES
    from tiny import byte_tokenizer

    from cadence.fast.gguf import NAMES, head_rows

    torch.manual_seed(5)
    model = FAMILIES[family]().float()
    cfg = model.config
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")

    def put(name: str, w: torch.Tensor, qtype, heads: int = 0) -> torch.Tensor:
        rows = w.detach().numpy().astype(np.float32)
        if heads:  # the file's row order: file[head_rows[i]] = model row i
            perm = np.empty_like(rows)
            perm[head_rows(rows.shape[0], heads).numpy()] = rows
            rows = perm
        b = blocks(rows, qtype)
        writer.add_tensor(name, b.numpy(), raw_dtype=qtype)
        deq = dequantized(b, qtype, rows.shape[1])
        return deq[head_rows(rows.shape[0], heads)] if heads else deq

    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb.copy_(put("token_embd.weight", emb, T.Q8_0))
        for i, block in enumerate(model.model.layers):
            for mod_name, qtype in LAYER_TYPES[i].items():
                attn = mod_name in ("q_proj", "k_proj", "v_proj", "o_proj")
                mod = getattr(block.self_attn if attn else block.mlp, mod_name)
                heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}.get(mod_name, 0)
                mod.weight.copy_(put(f"blk.{i}.{NAMES[mod_name]}.weight", mod.weight, qtype, heads))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model, byte_tokenizer(), path


@needs_native
@pytest.mark.parametrize("int8", ["1", "0"], ids=["int8-activations", "fp32-activations"])
def test_a_backbone_on_gguf_blocks_is_the_fp32_model_and_speculates_to_its_own_tokens(tmp_path, monkeypatch, int8):
    monkeypatch.setenv("CADENCE_GGUF_INT8", int8)  # 1: gemm_qi.cpp (8-bit activations); 0: gemm_q.cpp (fp32)
    from test_fast_model import assert_tree_rows_are_one_token_forwards, reference_greedy, tree_greedy

    from cadence.fast.model import FastBackbone

    model, tok, path = gguf_model(tmp_path)
    weights = {k: v.clone() for k, v in model.state_dict().items()}  # the file's dequantized weights
    dense_model = type(model)(model.config).float()
    dense_model.load_state_dict(weights)
    dense = FastBackbone(dense_model, tok, "dense")
    q = FastBackbone(model, tok, "q", quant="gguf", gguf_path=path)
    assert q.quant == "gguf" and q.consistent and q.listed
    kinds = {c.name: c.qtype for c in q.gguf_report.choices}
    assert kinds["blk.0.attn_q+blk.0.attn_k+blk.0.attn_v"] == T.Q4_1  # q, k rows matched through head_rows
    assert kinds["blk.1.attn_q+blk.1.attn_k+blk.1.attn_v"] == T.Q8_0
    assert kinds["blk.1.attn_output"] == T.Q4_0 and kinds["token_embd"] == T.Q8_0  # the tied head
    assert kinds["blk.1.ffn_gate+blk.1.ffn_up"] == 0 and kinds["blk.1.ffn_down"] == 0  # mixed; F32: fp32 fallback
    assert len(q.gguf_report.fallbacks()) == 2
    assert q.kernels.startswith("gguf-") and q._layers[0].qkv.kind == "gguf"
    assert torch.equal(q._layers[0].qkv.to_dense(), torch.cat([weights[f"model.layers.0.self_attn.{n}_proj.weight"]
                                                              for n in "qkv"]))
    prompt = list(range(40, 60))
    ids = torch.tensor([prompt])
    assert (q._layers[0].qkv.qtype > 256) == (int8 == "1") and q._layers[1].down.qtype == 0
    # the same weights; other sums (fp32), or the activations rounded to 8 bits per 32 (int8)
    tol = 1e-4 if int8 == "0" else 0.1 * dense.forward(ids).logits.abs().max()
    assert (q.forward(ids).logits - dense.forward(ids).logits).abs().max() < tol
    assert_tree_rows_are_one_token_forwards(q, prompt)  # a token's logits in a tree: its one-token forward's
    expected = reference_greedy(q, prompt, 24)
    got, steps = tree_greedy(q, prompt, 24, expected)
    assert got == expected and steps < 20
    out = q.model(ids).logits  # transformers' forward rebuilds the released weights from the blocks
    assert (out - dense_model(ids).logits).abs().max() < 1e-4


@needs_native
def test_quant_auto_takes_gguf_only_where_it_applies(tmp_path):
    from cadence.errors import CadenceError
    from cadence.fast.model import FastBackbone
    from cadence.fast.quant import resolve_quant

    from cadence.fast import gguf as gguf_module

    model, tok, path = gguf_model(tmp_path)
    cpu = torch.device("cpu")
    assert resolve_quant("auto", cpu, torch.float32, path)[0] == ("gguf" if gguf_module.AUTO else "none")
    assert resolve_quant("gguf", cpu, torch.float32, path)[0] == "gguf"
    quant, why = resolve_quant("auto", cpu, torch.bfloat16, path)
    assert quant == "none" and "float32" in why
    assert resolve_quant("auto", cpu, torch.float32, None)[0] == "none"
    with pytest.raises(CadenceError, match="GGUF file"):
        resolve_quant("gguf", cpu, torch.float32, None)
    with pytest.raises(CadenceError, match="float32"):
        FastBackbone(type(model)(model.config).bfloat16(), tok, "q", quant="gguf", gguf_path=path)


@needs_native
def test_dtype_auto_runs_a_gguf_on_its_blocks_where_bf16_is_native(tmp_path, monkeypatch):
    """On a CPU with native bf16, ``--dtype auto --quant auto`` takes fp32 for a GGUF model the
    integer kernel reads (its blocks decode 2.5x faster than bf16), and bf16 otherwise."""
    from cadence.backbone import load
    from cadence.system import machine

    model, _, path = gguf_model(tmp_path)
    cpu = torch.device("cpu")
    monkeypatch.delenv("CADENCE_CPU_AUTO_DTYPE", raising=False)
    monkeypatch.setattr(machine, "native_bf16", lambda: True)
    monkeypatch.setattr(machine, "onednn_available", lambda: True)
    dtype, why = load.auto_precision(model.config, cpu, "auto", "auto", path)
    assert dtype == torch.float32 and "own blocks" in why
    assert load.auto_precision(model.config, cpu, "auto", "none", path)[0] == torch.bfloat16  # --quant none
    assert load.auto_precision(model.config, cpu, "auto", "auto", None)[0] == torch.bfloat16  # not a GGUF
    assert load.auto_precision(model.config, cpu, "transformers", "auto", path)[0] is None
    monkeypatch.setattr(load, "GGUF_FIRST", False)
    assert load.auto_precision(model.config, cpu, "auto", "auto", path)[0] == torch.bfloat16
    monkeypatch.setattr(machine, "native_bf16", lambda: False)  # AVX2: fp32 either way
    assert load.auto_precision(model.config, cpu, "auto", "auto", path)[0] is None


def test_the_isa_switch_narrows_the_flags_and_names_the_build(monkeypatch):
    from cadence import cli
    from cadence.system import machine as cpu

    assert cli._ISA_ENV == cpu.ISA_ENV  # the command line sets what cpu.isa_mismatch checks
    full = cpu._hardware_flags()
    monkeypatch.setenv("CADENCE_ISA", "avx2")
    assert not any(f.startswith(("avx512", "amx")) for f in cpu.cpu_flags())
    assert native.cflags()[2] == "-march=haswell" and native.name().startswith("cadence_layers_avx2_")
    monkeypatch.setenv("CADENCE_ISA", "avx512")
    flags = cpu.cpu_flags()
    assert not any(f.startswith(("avx512_", "amx")) for f in flags) and ("avx512f" in flags) == ("avx512f" in full)
    assert native.cflags()[2] == "-march=skylake-avx512"
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    if "avx512f" in full:
        assert "ATEN_CPU_CAPABILITY=avx512" in cpu.isa_mismatch()
    monkeypatch.setenv("CADENCE_ISA", "sse")
    with pytest.raises(ValueError, match="CADENCE_ISA"):
        cpu.isa()
    monkeypatch.delenv("CADENCE_ISA")
    assert cpu.cpu_flags() == full and cpu.isa_mismatch() is None and native.cflags()[2] == "-march=native"
