"""The Llama-family decoder (Llama, Mistral, Qwen2) over a flat batch of tokens.

There is no batch dimension and no padding: the forward takes the concatenated tokens of every
scheduled chunk, their positions and one AttentionMetadata, and returns logits only for the rows
that will be sampled (the last token of each sequence that reaches its end this step), so a long
prefill chunk never pays for a [T, vocab] projection it does not need.

q/k/v and gate/up projections are fused into one matmul each (fewer, larger GEMMs matter on a
CPU); the checkpoint loader fills the fused weights from the separate HF tensors.
"""
from __future__ import annotations

import torch
from torch import nn

from tokenyard.engines.model.attention import AttentionMetadata, attend
from tokenyard.engines.model.model_config import ModelConfig
from tokenyard.engines.model.rotary import RotaryEmbedding


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.scale = cfg.head_dim ** -0.5
        # Set by tokenyard.engines.tp.tensor_parallel.shard_model_: o_proj and down_proj then hold one rank's
        # slice of their input and their outputs are summed across ranks.
        self.tp_enabled = False
        self.tp_group = None
        # Set by tokenyard.engines.lora.lora_linear.attach when the engine serves LoRA adapters: it adds
        # the step's adapter products to each projection's output (a no-op in steps without adapters).
        self.lora = None

    def forward(self, h: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                kv: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv(h, positions, rotary)
        return self.finish(h, attend(q, k, v, kv[0], kv[1], meta, self.scale))

    # The two halves around attention, shared with the compiled decode step
    # (tokenyard/engines/model/compiled_decoder.py), which attends differently.
    def qkv(self, h: torch.Tensor, positions: torch.Tensor,
            rotary: RotaryEmbedding) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, heads, head_dim], k and v [T, kv_heads, head_dim], rotary applied to q and k."""
        cfg = self.cfg
        x = self.input_layernorm(h)
        qkv = self.qkv_proj(x)
        if self.lora is not None:
            qkv = self.lora.apply("qkv", x, qkv)
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.view(-1, cfg.num_heads, cfg.head_dim)
        k = k.view(-1, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(-1, cfg.num_kv_heads, cfg.head_dim)
        q, k = rotary(positions, q, k)
        return q, k, v

    def finish(self, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """The residual stream after this layer, given the attention output o [T, heads, head_dim]."""
        o = o.reshape(-1, self.cfg.q_size)
        attn = self.o_proj(o)
        if self.lora is not None:
            attn = self.lora.apply("o", o, attn)
        h = h + self._reduce(attn, self.o_proj)
        x = self.post_attention_layernorm(h)
        gate_up = self.gate_up_proj(x)
        if self.lora is not None:
            gate_up = self.lora.apply("gate_up", x, gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        act = nn.functional.silu(gate) * up
        down = self.down_proj(act)
        if self.lora is not None:
            down = self.lora.apply("down", act, down)
        return h + self._reduce(down, self.down_proj)

    def _reduce(self, x: torch.Tensor, proj: nn.Module) -> torch.Tensor:
        if self.tp_enabled:
            # a projection that gives fp32 partials finishes its own sum (tokenyard/engines/tp/fp32_partials.py)
            reduce = getattr(proj, "tp_reduce", None)
            if reduce is not None:
                return reduce(x, self.tp_group)
            torch.distributed.all_reduce(x, group=self.tp_group)
        return x


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.cfg = cfg
        # Loaders build this skeleton on the meta device (empty_model), where a random init means
        # nothing and meta math (nn.Embedding's normal_, the rotary tables) imports torch._dynamo
        # (1-2 s of start-up): skip both there.
        on_meta = torch.empty(0).device.type == "meta"
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(
            cfg.vocab_size, cfg.hidden_size) if on_meta else None)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        if on_meta:  # tables of one position (meta math on them also imports dynamo): loaders rebuild them
            with torch.device("cpu"):
                self.rotary = RotaryEmbedding(cfg, 1)
        else:
            self.rotary = RotaryEmbedding(cfg, max_positions)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], logits_rows: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        for layer, kv in zip(self.layers, kv_caches):
            h = layer(h, positions, self.rotary, kv, meta)
        h = self.norm(h.index_select(0, logits_rows))
        return self.lm_head(h).float()


def empty_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, max_positions: int) -> CausalLM:
    """A model with uninitialised parameters in the target dtype/device, ready for a loader to fill
    (built on the meta device first so no memory is spent on random weights)."""
    with torch.device("meta"):
        model = CausalLM(cfg, max_positions)
    materialize(model, device)
    model.rotary = type(model.rotary)(cfg, max_positions).to(device)
    model = model.to(dtype)
    model.rotary.cos = model.rotary.cos.float()
    model.rotary.sin = model.rotary.sin.float()
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model


def materialize(model: nn.Module, device: torch.device) -> None:
    """`model.to_empty(device=device)` for a model built on the meta device, in place: uninitialised
    storage for every meta parameter and buffer (shared ones stay shared). Not to_empty itself: its
    empty_like on meta tensors imports sympy (0.4-0.5 s of a replica's start-up)."""
    made: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is None or not t.is_meta:
                    continue
                new = made.get(id(t))
                if new is None:
                    new = torch.empty(t.shape, dtype=t.dtype, device=device)
                    if isinstance(t, nn.Parameter):
                        new = nn.Parameter(new, requires_grad=t.requires_grad)
                    made[id(t)] = new
                table[name] = new
