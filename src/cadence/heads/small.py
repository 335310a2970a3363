"""Small heads trained after the draft heads, for the lossy/adaptive schedulers (METHODS §5).

* ``CLP`` (collocation-length predictor): one ``Linear(d_model -> K+1)`` on the backbone
  state h_t that produced the root token; class L = how many of the heads' top-1 drafts
  (depths 1..L) are the backbone's greedy continuation. Parameters: d*(K+1) + K+1
  (2,308 for SmolLM2-135M, d = 576, K = 3).
* ``ConfidenceHead`` (PIPO-style): an MLP on ``[h_t ; g_k ; onehot(k) ; log q_k(x_k)]``
  with a sigmoid, the probability that draft k is accepted given that drafts 1..k-1
  were. g_k is head k's feature vector (the input of the LM head that drafted x_k);
  log q_k(x_k) is the head's log-probability of its own top-1 draft **(choice: added to
  PIPO's [h_t ; g_k]; it is a cheap, strong signal the MLP cannot compute from g_k
  without the LM head)**.

Both normalise their inputs with the training set's mean and standard deviation
(stored as buffers; for the CLP folded into the linear layer when saved, so the saved
layer is exactly ``Linear(d -> K+1)``).

Files, beside the draft heads they were trained for (``HEADS_DIR``):
``clp.safetensors`` + ``clp.json`` and ``confidence.safetensors`` + ``confidence.json``
(json: K, hidden size, parameter count, training data, held-out accuracy).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from cadence.errors import CadenceError
from cadence.system.atomic import atomic_write, atomic_write_json

CLP_FILE, CONF_FILE = "clp", "confidence"


class CLP(nn.Module):
    """Linear(d -> K+1) on h_t; ``predict(h)`` = argmax class = draft length 0..K."""

    def __init__(self, hidden_size: int, num_heads: int):
        super().__init__()
        self.K, self.hidden_size = num_heads, hidden_size
        self.linear = nn.Linear(hidden_size, num_heads + 1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.linear(h.to(self.linear.weight.dtype))

    @torch.inference_mode()
    def predict(self, h: torch.Tensor) -> int:
        return int(self.forward(h.reshape(1, -1)).argmax(-1))

    def fold_normalisation(self, mean: torch.Tensor, std: torch.Tensor) -> "CLP":
        """Turn a layer trained on (h - mean) / std into one on raw h."""
        with torch.no_grad():
            w = self.linear.weight / std
            self.linear.bias -= w @ mean
            self.linear.weight.copy_(w)
        return self

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


class ConfidenceHead(nn.Module):
    """sigmoid(MLP([h ; g_k ; onehot(k) ; log q_k])) = P(draft k accepted | drafts < k were)."""

    def __init__(self, hidden_size: int, num_heads: int, width: int = 64):
        super().__init__()
        self.K, self.hidden_size, self.width = num_heads, hidden_size, width
        n_in = 2 * hidden_size + num_heads + 1
        self.register_buffer("mean", torch.zeros(n_in))
        self.register_buffer("std", torch.ones(n_in))
        self.mlp = nn.Sequential(nn.Linear(n_in, width), nn.SiLU(), nn.Linear(width, 1))

    @staticmethod
    def inputs(h: torch.Tensor, g: torch.Tensor, k: torch.Tensor, logq: torch.Tensor, K: int) -> torch.Tensor:
        """Rows [h ; g ; onehot(k-1) ; logq]: h, g (n, d); k (n,) in 1..K; logq (n,)."""
        onehot = nn.functional.one_hot(k.long() - 1, K).to(h.dtype)
        return torch.cat([h, g.to(h.dtype), onehot, logq.to(h.dtype)[:, None]], dim=-1)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.mean.dtype)
        return self.mlp((x - self.mean) / self.std).squeeze(-1)

    @torch.inference_mode()
    def confidence(self, h: torch.Tensor, g: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
        """Per-depth confidences (K',) for one step: h (d,), g (K', d) features of depths 1..K'."""
        n = g.shape[0]
        k = torch.arange(1, n + 1, device=g.device)
        return torch.sigmoid(self.logits(self.inputs(h.float().expand(n, -1), g.float(), k, logq.float(), self.K)))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.mlp.parameters())


def save_small(module: nn.Module, directory: str | Path, name: str, info: dict) -> Path:
    """Write ``name``.safetensors and ``name``.json (K, hidden size, params, ``info``)."""
    directory = Path(directory)
    state = {k: v.detach().float().cpu().contiguous() for k, v in module.state_dict().items()}
    atomic_write(directory / f"{name}.safetensors", lambda tmp: save_file(state, str(tmp)))
    meta = {"kind": name, "num_heads": module.K, "hidden_size": module.hidden_size,
            "params": module.num_params(), **({"width": module.width} if hasattr(module, "width") else {}), **info}
    atomic_write_json(directory / f"{name}.json", meta)
    return directory / f"{name}.safetensors"


def load_small(path: str | Path, name: str, heads) -> nn.Module:
    """Load a CLP (``name="clp"``) or confidence head from its .safetensors (or the heads
    directory holding it) and check it fits ``heads``."""
    path = Path(path)
    if path.is_dir():
        path = path / f"{name}.safetensors"
    meta_path = path.with_suffix(".json")
    if not path.is_file() or not meta_path.is_file():
        cmd = "train-clp" if name == CLP_FILE else "train-confidence"
        raise CadenceError(f"no trained {name} head at {path} (with {meta_path.name}); "
                           f"make one with `cadence {cmd} --heads DIR --data DIR`")
    try:
        meta = json.loads(meta_path.read_text())
        K, d = int(meta["num_heads"]), int(meta["hidden_size"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise CadenceError(f"{meta_path} is malformed: {exc}") from exc
    if (K, d) != (heads.K, heads.cfg.hidden_size):
        raise CadenceError(f"{path} was trained for K={K}, hidden {d}; these heads have K={heads.K}, "
                           f"hidden {heads.cfg.hidden_size}")
    module = CLP(d, K) if name == CLP_FILE else ConfidenceHead(d, K, int(meta.get("width", 64)))
    try:
        module.load_state_dict(load_file(str(path)))
    except Exception as exc:
        raise CadenceError(f"{path} is corrupt or does not match {meta_path.name}: {exc}") from exc
    return module.eval()
