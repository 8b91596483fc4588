"""MoE transformer language model.

tokens (B, S) -> embedding -> n_layers x [RMSNorm -> causal self-attention (RoPE, SDPA)
-> residual -> RMSNorm -> MoE (or dense SwiGLU) feed-forward -> residual] -> RMSNorm ->
LM head -> float32 logits -> cross entropy (+ weighted load-balancing and z losses).

Precision: parameters are float32 master weights; activations flow in
``ModelConfig.dtype`` (bf16 by default). The recipe applies to the GEMMs named in
``ModelConfig.quantized`` ("experts", "attention", "dense", "lm_head"); the router,
embedding and norms always stay in high precision, the LM head too unless listed.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..nn.args import MAX_SIZE
from ..nn.moe import MoELayer, SwiGLU
from ..ops import mx_linear
from ..recipe import Recipe, get_recipe

QUANTIZABLE = ("experts", "attention", "dense", "lm_head")
_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
# the largest vocabulary accepted: 4x the largest tokenizers in use (about 256k ids)
MAX_VOCAB_SIZE = 2**20
# the most parameters a config may describe: 2**40 (1.1T) float32 weights with their
# gradients and AdamW state take 16 TiB, beyond any one machine mxmoe trains on
MAX_PARAMETERS = 2**40


@dataclass
class ModelConfig:
    """Shape and options of the MoE language model.

    Attributes:
        vocab_size: token ids are in [0, vocab_size) (256 for bytes).
        d_model: residual width D. n_layers: transformer blocks. n_heads: attention heads
            (head dim = D / n_heads, even for RoPE).
        n_experts: E experts per MoE layer. top_k: experts per token.
        d_expert: hidden width F of each SwiGLU expert.
        moe_every: MoE feed-forward in every n-th block (blocks n-1, 2n-1, ...), dense
            SwiGLU of width ``d_ff_dense`` in the others. 1: every block is MoE.
        shared_expert: hidden width of a shared expert (0: none).
        max_seq_len: longest sequence (RoPE table length).
        aux_loss_coef, z_loss_coef: weights of the load-balancing and router z losses.
        quantized: which GEMMs follow the recipe (subset of
            "experts", "attention", "dense", "lm_head").
        dtype: activation dtype name ("bfloat16", "float32", "float16").
        mx_dispatch: round the MoE expert inputs to MXFP8 along D before the experts
            (what the expert-parallel MXFP8 dispatch sends; see :class:`~mxmoe.nn.moe.MoELayer`).
            Needs "experts" in ``quantized`` and a quantizing recipe.
        hf_config: None for :class:`MoETransformer`; else the dict of a Hugging Face
            transformers config (``PretrainedConfig.to_dict()``, with "model_type") whose
            causal LM :func:`~mxmoe.models.build_model` builds instead (through
            :mod:`mxmoe.integrations.transformers`). The size fields above then mirror it
            (for reports); ``moe_every``, ``d_ff_dense``, ``shared_expert``, ``rope_theta``,
            ``norm_eps`` and ``z_loss_coef`` are the transformers config's business and unused.
    """

    vocab_size: int = 256
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_experts: int = 8
    top_k: int = 2
    d_expert: int = 128
    moe_every: int = 1
    d_ff_dense: int = 512
    shared_expert: int = 0
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.001
    quantized: tuple[str, ...] = field(default=("experts", "attention", "dense"))
    dtype: str = "bfloat16"
    mx_dispatch: bool = False
    hf_config: dict | None = None

    def __post_init__(self):
        if isinstance(self.quantized, str) or not isinstance(self.quantized, (tuple, list, set, frozenset)):
            raise ValueError(f"quantized must be a tuple of names from {QUANTIZABLE}, got {self.quantized!r}; e.g. "
                             f"quantized=('experts',) or () for none")
        self.quantized = tuple(self.quantized)
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first bad field and what would work."""
        positive = ("vocab_size", "d_model", "n_layers", "n_heads", "n_experts", "top_k", "d_expert",
                    "moe_every", "d_ff_dense", "max_seq_len")
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
            if value > MAX_SIZE and name != "vocab_size":  # the vocabulary has its own bound below
                raise ValueError(f"{name} must be at most {MAX_SIZE:,} (2**31 - 1, an int32 size), got {value!r}")
        if self.vocab_size > MAX_VOCAB_SIZE:
            raise ValueError(f"vocab_size {self.vocab_size:,} exceeds {MAX_VOCAB_SIZE:,} (its embedding and LM head "
                             f"alone would take {2 * 4 * self.vocab_size * self.d_model / 2**30:,.1f} GiB in float32); "
                             f"use the corpus's vocabulary (256 for bytes, at most 65,536 for a uint16 .bin file)")
        if isinstance(self.shared_expert, bool) or not isinstance(self.shared_expert, int) \
                or not 0 <= self.shared_expert <= MAX_SIZE:
            raise ValueError(f"shared_expert must be an integer in [0, {MAX_SIZE:,}] (0: none), got "
                             f"{self.shared_expert!r}")
        if self.hf_config is None and self.moe_every > self.n_layers:
            raise ValueError(f"moe_every={self.moe_every} exceeds n_layers={self.n_layers}: no block would have an "
                             f"MoE layer; use moe_every <= n_layers")
        for name in ("aux_loss_coef", "z_loss_coef"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        for name in ("rope_theta", "norm_eps"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        params = self.parameter_count()
        if params > MAX_PARAMETERS:
            raise ValueError(f"the model would have {params:.3g} parameters (d_model={self.d_model}, "
                             f"n_layers={self.n_layers}, n_experts={self.n_experts}, d_expert={self.d_expert}, "
                             f"d_ff_dense={self.d_ff_dense}, shared_expert={self.shared_expert}), more than "
                             f"{MAX_PARAMETERS:.3g} (2**40); use smaller sizes")
        if self.top_k > self.n_experts:
            raise ValueError(f"top_k={self.top_k} exceeds n_experts={self.n_experts}; use top_k <= n_experts")
        if self.hf_config is not None:
            if not isinstance(self.hf_config, dict) or not self.hf_config.get("model_type"):
                raise ValueError(f"hf_config must be a transformers config dict with a model_type, got "
                                 f"{str(self.hf_config)[:80]!r}")
            if self.mx_dispatch:
                raise ValueError("mx_dispatch is a setting of mxmoe's own MoE layer; a transformers model "
                                 "(hf_config) does not take it")
        elif self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
            raise ValueError(
                f"d_model={self.d_model} must split into n_heads={self.n_heads} heads of even width (RoPE)"
            )
        bad = [q for q in self.quantized if not isinstance(q, str) or q not in QUANTIZABLE]
        if bad:
            raise ValueError(f"quantized has unknown entries {bad}; choose from {QUANTIZABLE}")
        if not isinstance(self.dtype, str) or self.dtype not in _DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(_DTYPES)}")
        if not isinstance(self.mx_dispatch, bool):
            raise ValueError(f"mx_dispatch must be True or False, got {self.mx_dispatch!r}")
        if self.mx_dispatch and "experts" not in self.quantized:
            raise ValueError("mx_dispatch rounds the expert inputs to MXFP8: it needs 'experts' in quantized")

    def parameter_count(self) -> int:
        """Parameters of :class:`MoETransformer` built from this config, computed from the
        sizes without building it (exact: embedding and LM head 2 V D, final norm D; per
        block two norms 2 D, attention 4 D^2, and either an MoE FFN, router D E plus experts
        3 D F E plus a shared expert 3 D S, or a dense SwiGLU 3 D F_dense). For an
        ``hf_config`` model it is the same formula over the mirrored sizes, an estimate.

        Returns:
            int, a Python int (no overflow for any sizes).
        """
        d = self.d_model
        moe = d * self.n_experts + 3 * d * self.d_expert * self.n_experts + 3 * d * self.shared_expert
        dense = 3 * d * self.d_ff_dense
        n_moe = self.n_layers // self.moe_every
        per_block = 2 * d + 4 * d * d
        return 2 * self.vocab_size * d + d + self.n_layers * per_block + n_moe * moe + (self.n_layers - n_moe) * dense

    @property
    def torch_dtype(self) -> torch.dtype:
        """The activation dtype as a torch.dtype (``dtype`` is its name)."""
        return _DTYPES[self.dtype]

    def is_moe_layer(self, i: int) -> bool:
        """Whether block ``i`` (from 0) has an MoE FFN: every ``moe_every``-th block, the last of each group."""
        return i % self.moe_every == self.moe_every - 1

    def to_dict(self) -> dict:
        """JSON-ready dict of the fields (what checkpoints store); :meth:`from_dict` reverses it."""
        d = dataclasses.asdict(self)
        d["quantized"] = list(self.quantized)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """The config from :meth:`to_dict`'s dict; unknown keys (from newer versions) are ignored.

        Raises:
            TypeError: ``d`` is not a dict. ValueError: a field :meth:`validate` refuses.
        """
        if not isinstance(d, dict):
            raise TypeError(f"ModelConfig.from_dict takes a dict (what to_dict wrote), got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


def _high_precision_linear(x: Tensor, w: Tensor) -> Tensor:
    return F.linear(x, w.to(x.dtype))


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, output in the input dtype (Zhang & Sennrich 2019)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        """x (..., dim) -> same shape and dtype: x / rms(x) * weight, computed in float32."""
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
        return y.to(x.dtype)


def rope_tables(seq_len: int, head_dim: int, theta: float, device=None) -> tuple[Tensor, Tensor]:
    """cos, sin (seq_len, head_dim / 2) float32 for rotary embeddings (Su et al. 2021)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (B, H, S, hd): rotate pairs (x[..., :hd/2], x[..., hd/2:]) by the position angle."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    c, s = cos[: x.shape[-2]], sin[: x.shape[-2]]
    return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).to(x.dtype)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: fused QKV projection, RoPE, SDPA, output projection."""

    def __init__(self, cfg: ModelConfig, recipe: Recipe):
        super().__init__()
        D = cfg.d_model
        self.n_heads = cfg.n_heads
        self.recipe = recipe
        self.quantize = "attention" in cfg.quantized
        self.wqkv = nn.Parameter(torch.empty(3 * D, D))
        self.wo = nn.Parameter(torch.empty(D, D))
        nn.init.normal_(self.wqkv, std=0.02)
        nn.init.normal_(self.wo, std=0.02 / math.sqrt(2 * cfg.n_layers))

    def _linear(self, x: Tensor, w: Tensor) -> Tensor:
        return mx_linear(x, w, self.recipe) if self.quantize else _high_precision_linear(x, w)

    def forward(self, x_BSD: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x (B, S, D) -> (B, S, D); cos, sin: RoPE tables (>= S, head_dim / 2) float32."""
        B, S, D = x_BSD.shape
        H = self.n_heads
        qkv = self._linear(x_BSD, self.wqkv).view(B, S, 3, H, D // H)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (B, H, S, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, S, hd)
        return self._linear(o.transpose(1, 2).reshape(B, S, D), self.wo)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then + ffn(norm(x)); the FFN is a
    :class:`~mxmoe.nn.moe.MoELayer` where ``cfg.is_moe_layer(layer_idx)``, else a dense SwiGLU.
    The expert / dense GEMMs use ``recipe`` when "experts" / "dense" is in
    ``cfg.quantized``, bf16 otherwise."""

    def __init__(self, cfg: ModelConfig, recipe: Recipe, layer_idx: int):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = CausalSelfAttention(cfg, recipe)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.is_moe = cfg.is_moe_layer(layer_idx)
        expert_recipe = recipe if "experts" in cfg.quantized else get_recipe("bf16")
        dense_recipe = recipe if "dense" in cfg.quantized else get_recipe("bf16")
        if self.is_moe:
            self.ffn = MoELayer(cfg.d_model, cfg.n_experts, cfg.top_k, cfg.d_expert, cfg.n_layers,
                                expert_recipe, shared_expert_hidden=cfg.shared_expert,
                                mx_dispatch=cfg.mx_dispatch)
        else:
            self.ffn = SwiGLU(cfg.d_model, cfg.d_ff_dense, cfg.n_layers)
            self.dense_recipe = dense_recipe

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor):
        """x (B, S, D) -> (x', aux): aux is the MoE layer's :class:`~mxmoe.nn.moe.MoEAux`
        or None for a dense block."""
        x = x + self.attn(self.attn_norm(x), cos, sin)
        h = self.ffn_norm(x)
        if self.is_moe:
            y, aux = self.ffn(h)
        else:
            y, aux = self.ffn(h, self.dense_recipe), None
        return x + y, aux


@dataclass
class LMOutput:
    """Model output.

    Attributes:
        logits: float32 (B, S, vocab).
        loss: total training loss = ce + aux_loss_coef * aux + z_loss_coef * z (None
            without targets).
        ce_loss: mean cross entropy in nats per token (None without targets).
        aux_loss, z_loss: means over MoE layers (float32 scalars; 0 without MoE layers).
        tokens_per_expert: one (E,) int64 tensor per MoE layer.
    """

    logits: Tensor
    loss: Tensor | None
    ce_loss: Tensor | None
    aux_loss: Tensor
    z_loss: Tensor
    tokens_per_expert: list[Tensor]


class MoETransformer(nn.Module):
    """Decoder-only MoE language model.

    Args:
        cfg: :class:`ModelConfig`.
        recipe: precision recipe (name or :class:`~mxmoe.recipe.Recipe`) of the GEMMs in
            ``cfg.quantized``.

    Forward: ``idx`` int64 (B, S) token ids, S <= max_seq_len; optional ``targets``
    (B, S) -> :class:`LMOutput`.
    """

    def __init__(self, cfg: ModelConfig, recipe: Recipe | str = "mxfp8"):
        super().__init__()
        self.cfg = cfg
        self.recipe = get_recipe(recipe)
        self.embed = nn.Parameter(torch.empty(cfg.vocab_size, cfg.d_model))
        nn.init.normal_(self.embed, std=0.02)
        self.blocks = nn.ModuleList(Block(cfg, self.recipe, i) for i in range(cfg.n_layers))
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Parameter(torch.empty(cfg.vocab_size, cfg.d_model))
        nn.init.normal_(self.lm_head, std=0.02)
        cos, sin = rope_tables(cfg.max_seq_len, cfg.d_model // cfg.n_heads, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def num_params(self) -> dict[str, int]:
        """Parameter counts: total, and active per token (top_k of the experts)."""
        total = sum(p.numel() for p in self.parameters())
        expert = sum(b.ffn.experts.w13.numel() + b.ffn.experts.w2.numel() for b in self.blocks if b.is_moe)
        active = total - expert + expert * self.cfg.top_k // self.cfg.n_experts
        return {"total": total, "active": active}

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward = 3x forward): 6 x active matmul
        parameters (embedding lookup excluded, LM head included) plus causal attention,
        6 * n_layers * S * D (QK^T and AV, 2 FLOPs each, halved by the causal mask, x3)."""
        matmul_active = self.num_params()["active"] - self.embed.numel()
        return 6.0 * matmul_active + 6.0 * self.cfg.n_layers * seq_len * self.cfg.d_model

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> LMOutput:
        """idx (B, S) int64 token ids -> :class:`LMOutput` (logits float32 (B, S, vocab),
        mean aux and z losses of the MoE layers, and with ``targets`` (B, S) the cross
        entropy). Raises ValueError if S > cfg.max_seq_len."""
        cfg = self.cfg
        B, S = idx.shape
        if S > cfg.max_seq_len:
            raise ValueError(f"sequence length {S} exceeds max_seq_len={cfg.max_seq_len}")
        x = F.embedding(idx, self.embed).to(cfg.torch_dtype)
        aux_losses, z_losses, counts = [], [], []
        for block in self.blocks:
            x, aux = block(x, self.rope_cos, self.rope_sin)
            if aux is not None:
                aux_losses.append(aux.aux_loss)
                z_losses.append(aux.z_loss)
                counts.append(aux.tokens_per_expert)
        x = self.final_norm(x)
        if "lm_head" in cfg.quantized:
            logits = mx_linear(x, self.lm_head, self.recipe).float()
        else:
            logits = _high_precision_linear(x, self.lm_head).float()
        zero = torch.zeros((), device=idx.device)
        aux_loss = torch.stack(aux_losses).mean() if aux_losses else zero
        z_loss = torch.stack(z_losses).mean() if z_losses else zero
        loss = ce = None
        if targets is not None:
            ce = F.cross_entropy(logits.view(B * S, -1), targets.reshape(-1))
            loss = ce + cfg.aux_loss_coef * aux_loss + cfg.z_loss_coef * z_loss
        return LMOutput(logits, loss, ce, aux_loss, z_loss, counts)
