"""The fast decoder: a lean forward for Llama-family backbones, same interface as ``Backbone``.

Knows: how to run the decoder layers of a loaded transformers Llama/Mistral/Qwen2/Qwen3
model with fused QKV and gate/up projections (``kernels.Linear``), RMSNorm through
``F.rms_norm``, RoPE from a table (``rope``), attention through
``scaled_dot_product_attention`` with one boolean mask shared by all layers (in
row-consistent bf16, decode and verify forwards attend through the extension's
``listed_attention`` instead: each row over its own listed keys, ``listed``), and a
preallocated cache (``cache.StaticKVCache``) written in place. The layer loop runs in C++
where the extension builds (``fast.native``: same ATen calls, fused RMSNorm/RoPE); the
Python loop below is its reference and its fallback, and both give the same bits.

Weights (one copy resident): the fused QKV and gate/up matrices are built once and the
transformers modules' ``weight`` parameters are turned into views of them (``dense``
kernels), so ``model.model`` keeps working, unchanged. With the prepacked oneDNN kernel
(the CPU default) the fused matrices are packed into oneDNN's layout and the dense
decoder-layer weights are released; the first call into the transformers model itself
(``bb.model(...)``, ``bb.model.generate``) rebuilds them from the packed ones (a second
copy from then on). Embedding and LM head stay the transformers tensors (the heads share
them); with ``pack_head`` (the default with oneDNN) the LM head is also packed: a copy of
vocab x hidden (56 MB for SmolLM2 in bf16), read at twice the speed of the dense one (cold,
2-4 rows, AMX Xeon: 2.6-2.8 ms against 4.5-4.8; the Zen 5 EPYC, fp32: 2.0-2.4 against 2.3-4.1).
Does not know: trees, heads, verification; the engine passes tokens, positions and an
(n, n) tree mask like it does to ``Backbone``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from cadence.backbone.base import Backbone, ForwardOut, check_taps
from cadence.errors import CadenceError
from cadence.fast import arch, consistent, gguf, native, rope
from cadence.fast.cache import StaticKVCache, stored, widened
from cadence.fast import kernels
from cadence.fast.kernels import ROW_FREE, Linear, resolve_kind
from cadence.fast.blocks import SELF_QUANTS, Quantizer
from cadence.fast.quant import resolve_kv_dtype, resolve_quant
from cadence.fast.rows import RowsForward

LISTED_HEAD_DIMS = (16, 32, 64, 96, 128, 192, 256)  # head sizes ``listed_attention`` has kernels for


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: normalise in fp32, cast back, scale by the weight."""
    y = torch.rms_norm(x.float(), (x.shape[-1],), None, eps)  # F.rms_norm's checks cost ~1 us, 61 calls
    return weight * y.to(x.dtype)


def _right_padded(pad: torch.Tensor) -> bool:
    """True when every row of a (batch, n) 1/0 padding mask is ones then zeros. Then a real
    token only ever attends to real tokens under the causal mask alone, so the forward
    attends with ``is_causal`` (its kernel skips the blocks above the diagonal; an explicit
    mask made SmolLM2's attention about 2x slower over 8 rows of ~440 tokens, 20% of a
    hidden-cache forward) and the padding rows' outputs, never read, are not masked.
    Example: [[1, 1, 0], [1, 1, 1]] -> True; [[0, 1, 1]] (left padding) -> False."""
    p = pad.to(torch.bool)
    return bool((p[:, 1:] <= p[:, :-1]).all())


def _bias(*linears) -> torch.Tensor | None:
    biases = [m.bias for m in linears]
    if all(b is None for b in biases):
        return None
    return torch.cat([b.detach() if b is not None else torch.zeros(m.out_features, dtype=m.weight.dtype,
                                                                  device=m.weight.device)
                      for b, m in zip(biases, linears)])


class _Layer:
    __slots__ = ("down", "gate_up", "k_norm", "ln1", "ln2", "o", "q_norm", "qkv")


class FastBackbone(RowsForward, Backbone):
    """``Backbone`` with a lean forward; every other attribute is the transformers one."""

    def __init__(self, model, tokenizer=None, name: str = "model", kernel: str = "auto",
                 pack_head: bool = True, quant: str = "none", gguf_path=None, kv_dtype: str = "auto"):
        super().__init__(model, tokenizer, name=name)
        self.gguf_path = gguf_path
        self.spec = arch.check(model.config)
        self.kernel = resolve_kind(kernel, self.device, self.dtype)
        self.quant, self.quant_reason = resolve_quant(quant, self.device, self.dtype, gguf_path)
        # the projections' kernel: a GGUF's blocks and weights quantized into blocks at load share ``gguf``
        self.layer_kind = "gguf" if self.quant in SELF_QUANTS else self.quant if self.quant != "none" else self.kernel
        self.kv_dtype = resolve_kv_dtype(kv_dtype, self.device, self.dtype, self.layer_kind)  # the KV cache's dtype
        self._kv_asked = kv_dtype  # checked against the attention path at the first cache (``_cache_dtype``)
        self.pack_head = pack_head and self.kernel in ("onednn", "amx")
        self._layers: list[_Layer] = []
        self._released: list = []  # (module, name, fused Linear, row slice) to rebuild on demand
        self._gguf = None  # ``fast.gguf.GGUFWeights`` (or ``blocks.Quantizer``) while building a ``gguf`` backbone
        self.gguf_report = None  # ``fast.gguf.Report``: what each matrix runs on (``gguf`` only)
        if self.quant == "gguf":
            self._gguf = gguf.GGUFWeights(gguf_path)
            self.gguf_report = gguf.Report(str(gguf_path))
        elif self.quant in SELF_QUANTS:
            self._gguf = Quantizer(self.quant)
            self.gguf_report = gguf.Report(self._gguf.path)
        self._build()
        self.rope = rope.RopeTable(model.model.rotary_emb, self.max_positions, self.dtype, self.device)
        head_kind = self.kernel if self.pack_head else ("onednn-dense" if self.kernel != "aten" else "aten")
        if self.quant == "int4" and self.kernel in ("onednn", "amx"):
            head_kind = self.kernel  # packed: the int4 layers release their dense copies anyway
        # int4 leaves the LM head unquantized, as 4-bit GGUF files keep the embedding / output at
        # 8 bits or more (the default model's Q4_1 file: token_embd Q8_0): a 4-bit head cost 7
        # points of top-1 agreement with the unquantized model (``benchmarks/analysis/quant_quality.py``),
        # and torch's int8 kernel took 3.0 ms against bf16's 1.6 ms for 4 rows on a Zen 5 EPYC
        self._head = self._gguf_head() if self._gguf is not None else None
        if self._head is None:
            self._head = Linear(self.lm_head.weight, self.lm_head.bias, "int8" if self.quant == "int8" else head_kind)
        self._gguf = None  # the file's tensors were copied out of the reader's map
        # see ``fast.consistent``; ``gguf`` products and fp32 ``listed_attention`` are row-consistent
        # too, so a fp32 forward on the file's blocks gives a token the same bits in any tree
        self.consistent = consistent.wanted(self.kernel, self.dtype) or self.layer_kind == "gguf"
        if self.consistent:  # weight-only int8/int4 and AMX rows do not depend on the row count (tested): no padding or blocks
            for lin in [self._head] + [getattr(layer, n) for layer in self._layers for n in ("qkv", "o", "gate_up", "down")]:
                lin.min_rows = 1 if lin.kind in ROW_FREE else consistent.MIN_ROWS
        # GEMMs whose row bits depend on the row count past MAX_ROWS (bf16 oneDNN on AMX): run in
        # blocks of MAX_ROWS in steady forwards (decode, verify); a prefill runs whole (``_block_rows``)
        self._blockable = [lin for lin in [self._head] + [getattr(layer, n) for layer in self._layers
                           for n in ("qkv", "o", "gate_up", "down")] if lin.kind not in ROW_FREE] \
            if self.consistent else []
        # a forward of fewer than MIN_QUERIES rows is padded up front when its GEMMs would pad
        # anyway (bf16 oneDNN: 2 rows cost what 4 do); over AMX, int8 or int4 projections it
        # runs its real rows and only attention (and a oneDNN head) pad themselves: fewer rows, same bits
        self.pad_up_front = self.consistent and self.layer_kind not in ROW_FREE
        self._native = None  # the C++ layer loop (``fast.native``), built at the first forward; False: none
        self._ops = None  # the extension module (fused kernels for the Python loop too), when built
        self._hook = None
        if self._released:
            self._hook = self.model.register_forward_pre_hook(lambda mod, args: self._restore())
        if self.kv_dtype != self.dtype:
            self._cache_dtype()  # a float16 cache the attention path cannot read: an error now, not at decode

    # the fast path's weights never move once built: device and dtype are read once, not by
    # walking the model's parameters (8 walks per forward, about 0.2 ms)
    @property
    def device(self) -> torch.device:
        if getattr(self, "_device", None) is None:
            self._device = next(self.model.parameters()).device
        return self._device

    @property
    def dtype(self) -> torch.dtype:
        if getattr(self, "_dtype", None) is None:
            self._dtype = next(self.model.parameters()).dtype
        return self._dtype

    @classmethod
    def from_backbone(cls, bb: Backbone, **kwargs) -> FastBackbone:
        kwargs.setdefault("gguf_path", getattr(bb, "gguf_path", None))
        return cls(bb.model, bb.tokenizer, name=bb.name, **kwargs)

    # -- weights -------------------------------------------------------------------------
    @torch.no_grad()
    def _fuse(self, modules: list, swiglu: bool = False, tensors: list[str] | None = None) -> Linear:
        """One Linear for the stacked ``modules``; ``tensors``: their GGUF tensors (``gguf``)."""
        fused = self._gguf_linear(modules, tensors) if self._gguf is not None else None
        if fused is None:
            weight = torch.cat([m.weight.detach() for m in modules], dim=0)
            kind = self.kernel if self.layer_kind == "gguf" else self.layer_kind
            fused = Linear(weight, _bias(*modules), kind, swiglu=swiglu)
        start = 0
        for m in modules:
            rows = slice(start, start + m.out_features)
            start += m.out_features
            self._share(m, fused, rows)
        return fused

    def _own(self, module, tensor: str | None = None) -> Linear:
        return self._fuse([module], tensors=[tensor] if tensor else None)

    def _gguf_linear(self, modules: list, tensors: list[str] | None) -> Linear | None:
        """The ``gguf`` Linear of ``modules`` from their GGUF tensors (``fast.gguf.build``:
        the file's blocks, or their fp32 weights through the same kernel), None where neither
        fits (an input size not a multiple of 32: the dense kernel runs)."""
        tensors = tensors or [None] * len(modules)
        label = "+".join(t.removesuffix(".weight") for t in tensors if t) or "?"
        parts = [(t, m.weight.detach().float()) for t, m in zip(tensors, modules)]
        if isinstance(self._gguf, Quantizer):
            lin, choice = self._gguf.build(label, [w for _, w in parts], _bias(*modules))
        else:
            lin, choice = gguf.build(native.module(), self._gguf, label, parts, (self.spec.heads, self.spec.kv_heads),
                                     _bias(*modules))
        self.gguf_report.choices.append(choice)
        return lin

    def _gguf_head(self) -> Linear | None:
        """The LM head on the file's ``output`` tensor, or ``token_embd`` where the model ties them."""
        if isinstance(self._gguf, Quantizer):
            lin, choice = self._gguf.build("output", [self.lm_head.weight.detach().float()], _bias(self.lm_head),
                                           head=True)
            self.gguf_report.choices.append(choice)
            return lin
        tied = self.lm_head.weight.data_ptr() == self.embed.weight.data_ptr()
        name = "output.weight" if "output.weight" in self._gguf or not tied else "token_embd.weight"
        lin, choice = gguf.build(native.module(), self._gguf, name.removesuffix(".weight"),
                                 [(name, self.lm_head.weight.detach().float())], (), _bias(self.lm_head))
        self.gguf_report.choices.append(choice)
        return lin

    def _share(self, module, lin: Linear, rows: slice) -> None:
        if lin.dense is not None:  # the module's weight becomes a view of the fused matrix
            module.weight = torch.nn.Parameter(lin.dense[rows], requires_grad=False)
        else:  # packed: drop the dense copy, rebuild it if transformers' forward is ever used
            module.weight = torch.nn.Parameter(module.weight.new_empty(0), requires_grad=False)
            self._released.append((module, lin, rows))

    @torch.no_grad()
    def _restore(self) -> None:
        """Rebuild the released dense weights (from the packed ones) for transformers' forward."""
        cache = {}
        for module, lin, rows in self._released:
            if id(lin) not in cache:
                cache[id(lin)] = lin.to_dense()
            module.weight = torch.nn.Parameter(cache[id(lin)][rows], requires_grad=False)
        self._released = []
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _build(self) -> None:

        for i, block in enumerate(self.model.model.layers):
            at, mlp = block.self_attn, block.mlp
            layer = _Layer()
            layer.ln1 = block.input_layernorm.weight.detach()
            layer.ln2 = block.post_attention_layernorm.weight.detach()
            layer.qkv = self._fuse([at.q_proj, at.k_proj, at.v_proj],
                                   tensors=[gguf.layer_tensor(i, n) for n in ("q_proj", "k_proj", "v_proj")])
            layer.o = self._own(at.o_proj, gguf.layer_tensor(i, "o_proj"))
            layer.gate_up = self._fuse([mlp.gate_proj, mlp.up_proj], swiglu=True,  # the gate in its epilogue where it can
                                       tensors=[gguf.layer_tensor(i, "gate_proj"), gguf.layer_tensor(i, "up_proj")])
            layer.down = self._own(mlp.down_proj, gguf.layer_tensor(i, "down_proj"))
            layer.q_norm = at.q_norm.weight.detach() if self.spec.qk_norm else None
            layer.k_norm = at.k_norm.weight.detach() if self.spec.qk_norm else None
            self._layers.append(layer)
        self.final_norm = self.model.model.norm.weight.detach()

    @property
    def kernels(self) -> str:
        """The projections' and the LM head's kernels and the layer loop, e.g. ``int4/onednn/cpp``
        (latency curves are cached per kernels: the C++ loop changed them by a third)."""
        self._resolve_native()
        attention = ("/listed-amx" if self._listed_amx() else "/listed") if self.listed else ""
        isa = f"-{self._ops.q_isa()}" if self._ops is not None else ""  # gguf: the vector code of its kernel
        layer = self.layer_kind + (isa if self.layer_kind == "gguf" else "")
        head = self._head.kind + (isa if self._head.kind == "gguf" else "")
        kv = f"/kv-{str(self.kv_dtype).replace('torch.', '')}" if self.kv_dtype != self.dtype else ""
        return f"{layer}/{head}/{'cpp' if self._native else 'python'}{attention}{kv}"

    @property
    def native_build(self) -> str:
        """The C++ extension build this backbone runs ('' for the Python loop): latency
        curves are cached per build, since a kernel edit changes them (the 2026-12-04 GEMM work,
        74609e8 and 1e88e28, moved T(32)/T(1) from 1.42 to 1.30 under the same ``kernels``)."""
        self._resolve_native()
        return native.build_id() if self._native else ""

    def _listed_amx(self) -> bool:
        """Whether ``listed_attention`` runs on AMX tiles for this model (``attention_amx.cpp``:
        bf16, head size a multiple of 32, at most 16 query heads per kv head, a CPU with AMX)."""
        s = self.spec
        return bool(self._ops is not None and self.dtype == torch.bfloat16 and s.head_dim % 32 == 0
                    and s.heads // s.kv_heads <= 16 and self._ops.listed_attention_amx())

    def resident_bytes(self) -> dict:
        """Bytes held by the fast path's weights and by the transformers tensors it shares."""
        fused = sum(lin.nbytes() for layer in self._layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))
        emb = self.embed.weight
        head_shared = self.lm_head.weight.data_ptr() == emb.data_ptr()
        out = {"layers": fused, "embed": emb.numel() * emb.element_size(),
               "lm_head": 0 if head_shared else self._head.nbytes(),
               "packed_head_copy": self._head.nbytes() if self._head.kind in ("onednn", "amx", "int8", "int4", "gguf") else 0,
               "dense_layer_copy": 0 if self.layer_kind not in ("onednn", "amx", "int8", "int4", "gguf") or self._released
               else fused}
        out["total"] = sum(out.values())
        return out

    # -- the Backbone interface ----------------------------------------------------------
    def new_cache(self, batch: int = 1, capacity: int | None = None) -> StaticKVCache:
        s = self.spec
        return StaticKVCache(s.layers, s.kv_heads, s.head_dim, self.max_positions, self._cache_dtype(),
                             self.device, batch=batch, capacity=capacity)

    def _cache_dtype(self) -> torch.dtype:
        """``kv_dtype``, once it is known that every forward reads the cache through
        ``listed_attention`` or widens it (a float16 cache needs the listed path: the
        per-path attention of ``consistent.PathAttention`` stores in the backbone's dtype)."""
        if self.kv_dtype != self.dtype:
            self._resolve_native()
            if not self.listed:
                if self._kv_asked != "auto":
                    raise CadenceError(f"--kv-dtype {self._kv_asked} needs the listed attention kernel "
                                       "(the native extension; CADENCE_LISTED=0 turns it off)")
                self.kv_dtype = self.dtype
        return self.kv_dtype

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._head(hidden.to(self.dtype)).float()

    def _forward_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """A forward's logits: in bf16 on a bf16 CPU backbone (the head's own output, exact;
        widening a 32-node tree's to float32 cost 0.42 ms, 2.5% of a one-token forward, on the
        AMX Xeon; readers widen the rows they use), else float32 as ``logits``."""
        if self.dtype == torch.bfloat16 and self.device.type == "cpu":
            return self._head(hidden.to(self.dtype))
        return self.logits(hidden)

    def _block_rows(self, steady: bool) -> None:
        """Row-consistent forwards that decode or verify (``steady``) run their bf16 GEMMs in
        blocks of at most ``consistent.MAX_ROWS`` rows (the head too, for the logits taken
        after them); a prefill, the same in plain and speculative decoding, runs whole (a
        2,000-row cache-building forward in 32-row blocks ran 63 calls per matrix)."""
        want = consistent.MAX_ROWS if steady else 0
        if self._blockable and self._blockable[0].max_rows != want:
            for lin in self._blockable:
                lin.max_rows = want

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, cache: StaticKVCache | None = None,
                position_ids: torch.Tensor | None = None, tree_mask: torch.Tensor | None = None,
                need_logits: bool = True, attention_mask: torch.Tensor | None = None,
                taps: tuple[int, ...] = ()) -> ForwardOut:
        """Same contract as ``Backbone.forward``; ``cache`` must come from ``new_cache``.
        attention_mask: (batch, n) 1/0 padding mask, only for cache-free causal forwards.
        taps: as ``Backbone.forward`` (every form of forward: prefill, decode, tree verify);
        tapping copies states out and never changes ``hidden`` or ``logits``."""
        if cache is not None and not isinstance(cache, StaticKVCache):
            raise CadenceError("FastBackbone.forward needs a cache from its own new_cache()")
        if attention_mask is not None and (cache is not None or tree_mask is not None):
            raise CadenceError("attention_mask (padding) is for cache-free forwards without a tree mask")
        # the frozen backbone computes in its own dtype, also inside a caller's autocast
        # (training under bf16 autocast): packed kernels take the weights' dtype only
        with torch.autocast(self.device.type, enabled=False):
            if taps:
                check_taps(taps, self.spec.layers)
            hidden, tapped = self._states(input_ids, cache, position_ids, tree_mask, attention_mask, tuple(taps))
            return ForwardOut(hidden=hidden, logits=self._forward_logits(hidden) if need_logits else None, taps=tapped)

    def _mask(self, n: int, past: int, tree_mask, cached: bool, keys: int | None = None):
        """One (n, past + n) bool mask for every layer, or None when none is needed.
        ``keys`` > past + n: that many columns, the extra ones masked (``fast.consistent``)."""
        if keys is None and tree_mask is None and (n == 1 or not cached or past == 0):
            return None  # single query, or plain causal (is_causal) over the new tokens only
        allowed = torch.zeros(n, keys or past + n, dtype=torch.bool, device=self.device)
        allowed[:, :past] = True
        block = torch.ones(n, n, dtype=torch.bool, device=self.device).tril_() if tree_mask is None \
            else tree_mask.to(device=self.device, dtype=torch.bool)
        allowed[:, past:past + n] = block
        return allowed

    def _padded_mask(self, pad: torch.Tensor) -> torch.Tensor:
        """(batch, n) padding mask -> (batch, 1, n, n) bool: causal and not padding. The
        diagonal stays allowed so a padding query never has an empty row (its output is
        ignored; an empty row would be NaN)."""
        n = pad.shape[-1]
        causal = torch.ones(n, n, dtype=torch.bool, device=self.device).tril_()
        allowed = causal & pad.to(device=self.device, dtype=torch.bool)[:, None, None, :]
        return allowed | torch.eye(n, dtype=torch.bool, device=self.device)

    def hidden_states(self, input_ids, cache, position_ids, tree_mask, pad=None) -> torch.Tensor:
        return self._states(input_ids, cache, position_ids, tree_mask, pad)[0]

    def _states(self, input_ids, cache, position_ids, tree_mask, pad=None, taps: tuple[int, ...] = ()):
        """(hidden (b, n, d), taps (b, n, len(taps), d) or None)."""
        b, n = input_ids.shape
        past = cache.length() if cache is not None else 0
        real = n  # rows asked for; a row-consistent forward pads fewer to MIN_QUERIES up front
        given_tree = tree_mask is not None  # no mask = a chain: no layout check, padded or not
        if cache is not None and (past > 0 or tree_mask is not None) and self.listed:  # decode or verify
            return self._listed_forward(input_ids, cache, position_ids, tree_mask, taps)
        if (self.pad_up_front and cache is not None and (past > 0 or tree_mask is not None)
                and n < consistent.MIN_QUERIES):
            if position_ids is None:
                position_ids = torch.arange(past, past + n, device=self.device).expand(b, n)
            input_ids, position_ids, tree_mask = consistent.pad_rows(
                input_ids, position_ids.to(self.device).expand(b, n), tree_mask)
            n = input_ids.shape[1]
        if cache is not None:
            self._reserve(cache, b, n)
        position_ids, cos, sin = self._positions(position_ids, b, n, past)
        mask = self._mask(n, past, tree_mask, cache is not None)
        causal = mask is None and tree_mask is None and n > 1  # plain causal over new tokens only
        if pad is not None and not bool(pad.all()) and not _right_padded(pad):
            mask, causal = self._padded_mask(pad), False  # right padding stays causal (``_right_padded``)
        keys = past + n  # keys attended to: the real ones, or (consistent) whole blocks per row group
        steady = self.consistent and cache is not None and (past > 0 or tree_mask is not None)
        self._block_rows(steady)
        groups = None
        if steady:
            rows = position_ids.amax(dim=0).tolist()  # (n,): one sequence, or the batch's furthest
            groups = consistent.row_groups(rows, cache.max_positions)
            keys = max(keys, groups[-1][1])
            cache.reserve(keys - past)
            mask, causal = self._mask(n, past, tree_mask, True, keys), False
        store = None
        if cache is not None:
            def store(i, k, v):  # append at [past, past + n); attend to [0, keys)
                cache.k[i, :, :, past:past + n] = stored(k, self.kv_dtype, self._ops)
                cache.v[i, :, :, past:past + n] = stored(v, self.kv_dtype, self._ops)
                return cache.k[i, :, :, :keys], cache.v[i, :, :, :keys]
        paths = None
        if steady and given_tree:
            ancestors = [row.nonzero().flatten().tolist() for row in tree_mask[:real].to(torch.bool)]
            if not consistent.is_laid_out(ancestors):  # a branching tree: paths in decoding's slots
                paths = consistent.PathAttention(cache.k, cache.v, past, ancestors, cache.max_positions)
        x, tap_out = None, self._tap_buffer(input_ids, taps)
        if paths is None and (groups is None or len(groups) == 1):
            x = self._native_forward(input_ids, cos, sin, cache, past, groups[0][1] if groups else keys, mask,
                                     causal, steady, taps, tap_out)
        if x is None:
            attention = self._path_attention(paths) if paths is not None else \
                self._attention(store, mask, causal, groups)  # same positions, so the keys reserved above
            x = self._layers_forward(input_ids, cos, sin, attention, taps, tap_out)
        if cache is not None:
            cache.advance(real)
        return x[:, :real], (tap_out[:, :real] if taps else None)

    def _tap_buffer(self, input_ids, taps) -> torch.Tensor | None:
        """(b, n, len(taps), d) for the forward's tapped states, or None without taps."""
        if not taps:
            return None
        b, n = input_ids.shape
        return torch.empty(b, n, len(taps), self.spec.hidden, dtype=self.dtype, device=self.device)

    @property
    def listed(self) -> bool:
        """Whether decode and verify forwards attend through ``listed_attention`` (the C++
        extension's ``attention.cpp``): each row over its own keys in list order, so a row's
        bits never depend on the rest of the forward, and a branching tree costs one call.
        On in row-consistent mode (bf16 oneDNN) when the extension is built, on CPU, for the
        head sizes it has kernels for; ``CADENCE_LISTED=0`` turns it off (then branching trees
        attend once per path, ``PathAttention``)."""
        if getattr(self, "_listed_on", None) is None:
            self._resolve_native()
            self._listed_on = bool(self.consistent and self._ops is not None and self.device.type == "cpu"
                                   and self.spec.head_dim in LISTED_HEAD_DIMS and native.listed_enabled())
        return self._listed_on

    @property
    def chains_only(self) -> bool:
        """True when a branching tree costs more than a chain of its size (``PathAttention``:
        one attention call per path): the tree policy then grows chains only."""
        return self.consistent and not self.listed

    @staticmethod
    def _reserve(cache: StaticKVCache, b: int, n: int) -> None:
        """Room for n more entries in a cache of batch b (an error for another batch)."""
        if cache.k.shape[1] != b:
            raise CadenceError(f"cache holds batch {cache.k.shape[1]}, forward got batch {b}")
        cache.reserve(n)

    def _positions(self, position_ids, b: int, n: int, past: int):
        """(position_ids (b, n), cos, sin) for n new tokens after ``past`` (default positions
        past .. past + n - 1), RoPE looked up once for the forward."""
        if position_ids is None:
            position_ids = torch.arange(past, past + n, device=self.device).expand(b, n)
            top = past + n - 1
        else:
            position_ids = position_ids.to(self.device).expand(b, n)
            top = int(position_ids.max())
        cos, sin = self.rope.lookup(position_ids, top)
        return position_ids, cos, sin

    def _listed_forward(self, input_ids, cache, position_ids, tree_mask, taps=()):
        """A decode or verify forward (``listed``): every row attends to the committed entries
        then to its own tree ancestors (itself included; a chain when ``tree_mask`` is None),
        listed in slot order, which are the keys plain decoding gives a token at its position.
        input_ids: (b, n); tree_mask: (n, n) or None -> (hidden (b, n, d), taps or None)."""
        b, n = input_ids.shape
        past, real = cache.length(), n
        if self.pad_up_front and n < consistent.MIN_ROWS and past + consistent.MIN_ROWS <= cache.max_positions:
            # one GEMM pad for the whole forward instead of one per projection (same bits:
            # the extra row repeats the last one, as ``Linear``'s padding does)
            if position_ids is None:
                position_ids = torch.arange(past, past + n, device=self.device).expand(b, n)
            input_ids, position_ids, tree_mask = consistent.pad_rows(
                input_ids, position_ids.to(self.device).expand(b, n), tree_mask, consistent.MIN_ROWS)
            n = input_ids.shape[1]
        self._reserve(cache, b, n)
        _, cos, sin = self._positions(position_ids, b, n, past)
        lists = consistent.chain_lists(n, [past] * b) if tree_mask is None else \
            consistent.key_lists(tree_mask.to("cpu", torch.bool).expand(b, n, n), [past] * b)
        self._block_rows(True)
        tap_out = self._tap_buffer(input_ids, taps)
        if self._native:
            x = self._native.forward(input_ids.to(self.device), cos, sin, cache.k, cache.v, past, 0, None, False, False,
                                     0, bool(self._blockable), None, list(lists), list(taps), tap_out)
        else:  # the Python loop (tests compare the two): same kernel, same bits
            scale = 1.0 / math.sqrt(self.spec.head_dim)

            def attend(i, q, k, v):
                cache.k[i, :, :, past:past + n] = stored(k, self.kv_dtype, self._ops)
                cache.v[i, :, :, past:past + n] = stored(v, self.kv_dtype, self._ops)
                return self._ops.listed_attention(q, cache.k[i], cache.v[i], *lists, scale)
            x = self._layers_forward(input_ids, cos, sin, attend, taps, tap_out)
        cache.advance(real)
        return x[:, :real], (tap_out[:, :real] if taps else None)

    def _resolve_native(self) -> None:
        """At the first forward: the C++ loop and fused kernels (``fast.native``), or neither.
        Decided once per backbone, so all its forwards (C++ or Python loop) share arithmetic."""
        if self._native is None:
            mod = native.module()
            self._ops = mod
            self._native = False if mod is None else kernels.build_layers(mod, self)

    def _fusable(self, x: torch.Tensor) -> bool:
        """Whether the fused kernels take x (CPU, fp32 or bf16; ``fusable`` in layers.cpp)."""
        return self._ops is not None and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)

    def _add_norm(self, x: torch.Tensor, d: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + d, the norm of it) as the C++ loop computes them: one fused call where it
        takes them, else the add and ``_norm`` (the same bits either way)."""
        if self._fusable(x) and d.dtype == x.dtype and weight.dtype == x.dtype and d.shape == x.shape:
            return tuple(self._ops.add_rms_norm(x, d, weight, self.spec.eps))
        s = x + d
        return s, self._norm(s, weight)

    def _swiglu(self, gu: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of gu = [gate | up] as the C++ loop computes it: the fused kernel
        where it takes gu, else ATen's two calls."""
        if self._fusable(gu):
            return self._ops.silu_mul(gu)
        g, u = gu.chunk(2, dim=-1)
        return F.silu(g) * u

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm as the C++ loop computes it: the fused kernel on CPU, else ``_rms``."""
        return self._ops.rms_norm(x, weight, self.spec.eps) if self._fusable(x) else _rms(x, weight, self.spec.eps)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``rope.apply`` as the C++ loop computes it (fused on CPU)."""
        return self._ops.rope(x, cos, sin) if self._fusable(x) else rope.apply(x, cos, sin)

    def _native_forward(self, input_ids, cos, sin, cache, past: int, keys: int, mask, causal: bool,
                        steady: bool, taps: tuple[int, ...] = (), tap_out=None) -> torch.Tensor | None:
        """``_layers_forward`` with ``_attention``'s single-call forms, through the C++ loop
        (``fast.native``: same ATen calls, same bits); None when it is off or unavailable.
        keys: the cache entries attended to (``steady``: the one row group's key count)."""
        self._resolve_native()
        if self._native is False:
            return None
        n = input_ids.shape[1]
        g = self.spec.heads // self.spec.kv_heads
        min_queries = 0
        if steady:  # ``consistent.attend``: queries padded to MIN_QUERIES, the mask folded
            mask = mask[:, :keys]
            if n < consistent.MIN_QUERIES:
                min_queries = consistent.MIN_QUERIES
                mask = consistent.pad_mask_rows(mask)
            mask, folded = consistent.fold_mask(mask, g, self.dtype), True
        elif g > 1 and mask is not None:  # ``consistent.grouped_sdpa`` over the whole mask
            mask, folded = consistent.fold_mask(mask, g, self.dtype), True
        else:
            folded = False
        k, v = (cache.k, cache.v) if cache is not None else (None, None)
        return self._native.forward(input_ids.to(self.device), cos, sin, k, v, past, keys if cache is not None else n,
                                    mask, folded, causal, min_queries, steady and bool(self._blockable), None, None,
                                    list(taps), tap_out)

    def _attention(self, store, mask, causal: bool, groups=None):
        """``attend(layer, q, k, v)`` for ``_layers_forward``: ``store(layer, k, v)`` (k, v of
        shape (b, kv_heads, n, head_dim)) writes the new keys/values to a cache and returns the
        keys/values to attend to (None: attend to the new tokens only); ``groups``: through
        ``consistent.attend_groups`` (rows grouped by key count, at least 4 query rows per
        call; ``consistent.row_groups``), None for one plain call."""
        gqa = self.spec.heads != self.spec.kv_heads
        memo = consistent.Folded(self.spec.heads // self.spec.kv_heads, self.dtype)  # masks made once, not per layer

        def attend(i, q, k, v):
            if store is not None:
                k, v = store(i, k, v)
                k, v = widened(k, self.dtype), widened(v, self.dtype)  # a float16 cache, for these kernels
            if groups is not None:
                return consistent.attend_groups(q, k, v, mask, gqa, groups, memo)
            if gqa and mask is not None:
                return consistent.grouped_sdpa(q, k, v, mask, memo.get((), mask))
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)
        return attend

    def _path_attention(self, paths: consistent.PathAttention):
        gqa = self.spec.heads != self.spec.kv_heads
        return lambda i, q, k, v: paths(i, q, k, v, gqa)

    def _layers_forward(self, input_ids, cos, sin, attend, taps: tuple[int, ...] = (),
                        tap_out: torch.Tensor | None = None) -> torch.Tensor:
        """Embedding, decoder layers and final norm -> (b, n, d); ``attend(layer, q, k, v)``
        (``_attention``) gives each layer's attention output (b, heads, n, head_dim). With
        ``taps``, the residual stream after tapped layer taps[j] (1-based) is copied to
        ``tap_out[:, :, j]``."""
        s = self.spec
        self._resolve_native()
        if self._native:  # the C++ loop, calling ``attend`` back for each layer's attention
            blocked = bool(self._blockable) and self._blockable[0].max_rows > 0  # as ``_block_rows`` left them
            return self._native.forward(input_ids.to(self.device), cos, sin, None, None, 0, 0, None, False, False, 0,
                                        blocked, attend, None, list(taps), tap_out)
        b, n = input_ids.shape
        H, KV, hd = s.heads, s.kv_heads, s.head_dim
        x = F.embedding(input_ids.to(self.device), self.embed.weight)
        h = self._norm(x, self._layers[0].ln1 if self._layers else self.final_norm)
        for i, layer in enumerate(self._layers):
            qkv = layer.qkv(h)
            if s.qk_norm:
                q = self._rope(self._norm(qkv[..., :H * hd].view(b, n, H, hd), layer.q_norm), cos, sin)
                k = self._rope(self._norm(qkv[..., H * hd:(H + KV) * hd].view(b, n, KV, hd), layer.k_norm), cos, sin)
            else:
                qk = self._rope(qkv[..., :(H + KV) * hd].view(b, n, H + KV, hd), cos, sin)
                q, k = qk[:, :, :H], qk[:, :, H:]
            v = qkv[..., (H + KV) * hd:].view(b, n, KV, hd)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            att = attend(i, q, k, v)
            x, h = self._add_norm(x, layer.o(att.transpose(1, 2).reshape(b, n, H * hd)), layer.ln2)
            gu = layer.gate_up(h)
            nxt = self._layers[i + 1].ln1 if i + 1 < len(self._layers) else self.final_norm
            act = gu if layer.gate_up.swiglu else self._swiglu(gu)  # swiglu: the gate ran in the product's epilogue
            x, h = self._add_norm(x, layer.down(act), nxt)  # and the next layer's first norm
            for j, layer_no in enumerate(taps):
                if layer_no == i + 1:
                    tap_out[:, :, j] = x
        return h
