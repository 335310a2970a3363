"""Typed settings of PIPO: the student's shape, decoding, and training. CLI flags derive from
these fields (``cadence.cliargs``). Knows nothing about models or data."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from cadence.errors import CadenceError

MODES = ("prompt", "pairs")  # prompt: pairs in prefill only; pairs: pair-in / pair-out decoding
ACCEPTS = ("confidence", "verify")  # how pair-out's second token is kept


@dataclass
class StudentConfig:
    """The trainable parts added to a frozen backbone (saved in the PIPO directory's config.json)."""

    lora_rank: int = field(default=4, metadata={"help": "LoRA rank of the adapter read at pair positions"})
    lora_alpha: float = field(default=8.0, metadata={"help": "LoRA alpha (scale = alpha / rank)"})
    lora_targets: tuple[str, ...] = field(default=("q_proj", "k_proj", "v_proj", "o_proj"), metadata={
        "help": "attention projections that carry LoRA adapters"})
    compressor_hidden: int = field(default=256, metadata={
        "help": "hidden width of the compressor's MLP [e(a); e(b)] -> latent correction"})
    pair_head_hidden: int = field(default=256, metadata={
        "help": "hidden width of the pair-out (MTP) head's MLP [h; e(a)] -> residual"})
    confidence_hidden: int = field(default=64, metadata={"help": "hidden width of the confidence head"})

    def __post_init__(self):
        for name in ("lora_rank", "compressor_hidden", "pair_head_hidden", "confidence_hidden"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise CadenceError(f"{name} must be an integer >= 1, got {v!r}")
        self.lora_targets = tuple(self.lora_targets)
        if not self.lora_targets:
            raise CadenceError("lora_targets must name at least one projection")

    def to_dict(self) -> dict:
        return {**asdict(self), "lora_targets": list(self.lora_targets)}


@dataclass
class PipoDecodeConfig:
    """``cadence generate --pipo DIR`` settings (only read when --pipo is given)."""

    pipo: str = field(default="", metadata={
        "help": "LOSSY, opt-in: decode with a PIPO directory (from `cadence train-pipo`; `shipped` = the "
                "compressor shipped for the default model). Output differs from plain decoding"})
    pipo_mode: str = field(default="prompt", metadata={
        "help": "prompt: the prompt is read as token pairs (half the prefill positions), replies are decoded "
                "one token per forward by the unmodified weights | pairs: also the reply, one forward per "
                "two tokens when the second is accepted"})
    pipo_accept: str = field(default="confidence", metadata={
        "help": "--pipo-mode pairs: confidence = the confidence head keeps the second token unverified; "
                "verify = the unmodified weights verify it (lossless given the compressed prompt)"})
    pipo_threshold: float = field(default=0.5, metadata={
        "help": "--pipo-accept confidence: keep the second token when the head's confidence is at least this"})

    def __post_init__(self):
        if self.pipo_mode not in MODES:
            raise CadenceError(f"--pipo-mode must be one of {', '.join(MODES)}, not {self.pipo_mode!r}")
        if self.pipo_accept not in ACCEPTS:
            raise CadenceError(f"--pipo-accept must be one of {', '.join(ACCEPTS)}, not {self.pipo_accept!r}")
        if not 0.0 <= float(self.pipo_threshold) <= 1.0:
            raise CadenceError(f"--pipo-threshold must be in [0, 1], got {self.pipo_threshold!r}")


@dataclass
class TrainPipoConfig:
    """One ``cadence train-pipo`` run: on-policy distillation from the unmodified backbone."""

    data: str = field(default="data/selfdistill/smollm2", metadata={
        "help": "self-distillation store (prompts; its teacher replies for --teacher-mix and held-out NLL)"})
    out: str = field(default="runs/pipo", metadata={
        "help": "run directory: checkpoint.pt, train_log.jsonl, final/ and step-NNNNNN/ snapshots"})
    steps: int = field(default=400, metadata={"help": "optimizer steps"})
    batch_size: int = field(default=8, metadata={"help": "sequences per step"})
    max_prompt: int = field(default=192, metadata={"help": "prompt tokens kept (the last ones) per sequence"})
    max_reply: int = field(default=64, metadata={"help": "reply tokens per sequence (rollout length)"})
    pairs_share: float = field(default=0.5, metadata={
        "help": "share of sequences whose reply is also read as pairs (the rest: plain reply after a "
                "compressed prompt, the prompt mode)"})
    pair_rate: float = field(default=0.8, metadata={
        "help": "in a pairs sequence, chance that a step commits a pair (else one plain token, the fallback)"})
    teacher_mix: float = field(default=0.25, metadata={
        "help": "share of sequences whose reply is the store's teacher reply instead of a student rollout "
                "(off-policy; 0 = purely on-policy)"})
    temperature: float = field(default=1.0, metadata={"help": "student sampling temperature of rollouts"})
    lr: float = field(default=5e-4, metadata={"help": "peak learning rate (AdamW)"})
    warmup_steps: int = field(default=20, metadata={"help": "linear warm-up steps"})
    min_lr_ratio: float = field(default=0.1, metadata={"help": "cosine decay floor, as a share of --lr"})
    grad_clip: float = field(default=1.0, metadata={"help": "gradient-norm clip"})
    pair_head_weight: float = field(default=1.0, metadata={"help": "weight of the pair-out head's KL"})
    pair_grad: bool = field(default=False, metadata={
        "help": "let the pair-out head's KL train the adapter and compressor too (off: it trains the head "
                "alone; on SmolLM2-135M its gradient made the compressed prompt worse)"})
    confidence_weight: float = field(default=1.0, metadata={"help": "weight of the confidence head's BCE"})
    checkpoint_every: int = field(default=20, metadata={"help": "steps between checkpoints (resumable)"})
    snapshots: tuple[int, ...] = field(default=(25, 50, 100, 200), metadata={
        "help": "steps at which a loadable PIPO directory step-NNNNNN/ is also kept (training budgets)"})
    bf16: bool = field(default=True, metadata={
        "help": "hold the frozen backbone in bfloat16 and autocast the training forwards (trained tensors stay float32)"})
    threads: int = field(default=0, metadata={"help": "torch threads (0 = torch's default)"})
    seed: int = field(default=0, metadata={"help": "random seed (data order, rollouts)"})
    progress: bool = field(default=True, metadata={"help": "show a progress bar"})

    def __post_init__(self):
        for name in ("steps", "batch_size", "max_prompt", "max_reply", "checkpoint_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise CadenceError(f"--{name.replace('_', '-')} must be an integer >= 1, got {v!r}")
        for name in ("pairs_share", "pair_rate", "teacher_mix", "min_lr_ratio"):
            v = getattr(self, name)
            if not 0.0 <= float(v) <= 1.0:
                raise CadenceError(f"--{name.replace('_', '-')} must be in [0, 1], got {v!r}")
        if not float(self.temperature) > 0:
            raise CadenceError(f"--temperature must be > 0 (rollouts are sampled), got {self.temperature!r}")
        if self.threads < 0:
            raise CadenceError(f"--threads must be >= 0, got {self.threads!r}")
        self.snapshots = tuple(sorted(set(int(s) for s in self.snapshots)))

    def to_dict(self) -> dict:
        return {**asdict(self), "snapshots": list(self.snapshots)}
