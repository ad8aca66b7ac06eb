"""The zoo's decoder-only MoE language model in plain torch (built by `measure.zoo.build_model`).

embed_tokens → blocks[0..L-1] → final_norm → LM head (the embedding's weight when tied). A block:
x + attn(input_norm(x)), then + ffn(post_attn_norm(·)), where ffn is a dense SwiGLU `mlp` for the first
dense_blocks blocks and an `moe` otherwise: router → top-k → routed SwiGLU experts (+ a shared expert,
optionally sigmoid-gated). Attention: grouped-query (num_key_value_heads), RoPE, optional QK-norm over
all heads' features ("full") or per head ("head"), bias on q/k/v only if the shape says so, an explicit
causal softmax (no fused kernel).

Determinism: the same seed gives bit-identical weights; the experts run in a fixed loop over every expert
(an expert that gets no token runs on an empty batch, so every module runs in the same order every step
and every parameter gets a gradient); tokens reach an expert through index_select with distinct indices
and come back through a permutation, so no step accumulates with atomics, and the k expert outputs of a
token are summed in slot order. Activation checkpointing on or off gives bit-identical loss and gradients.

Not modelled: MiniCPM's embedding/depth scaling, Llama 4's chunked attention, NoPE layers and QK L2-norm,
capacity limits and token dropping, DeepSeek's device-limited routing; RoPE applies in every block.
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from traces import ModelShape

INIT_STD = 0.02


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) · up(x)), no biases: one expert, a shared expert or a dense FFN."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def rope_tables(seq_len: int, head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """(2, seq_len, head_dim) float32: cos and sin of the rotary angles (rotate-half convention)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64, device=device), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return torch.stack((angles.cos(), angles.sin())).float()


class Attention(nn.Module):
    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        h, d = shape.hidden_size, shape.head_dim
        self.heads, self.kv_heads, self.head_dim = shape.num_attention_heads, shape.num_key_value_heads, d
        bias = shape.attention_bias
        self.q_proj = nn.Linear(h, shape.q_width, bias=bias)
        self.k_proj = nn.Linear(h, shape.kv_width, bias=bias)
        self.v_proj = nn.Linear(h, shape.kv_width, bias=bias)
        self.o_proj = nn.Linear(shape.q_width, h, bias=False)
        self.qk_norm_scope = shape.qk_norm_scope if shape.qk_norm else None
        if self.qk_norm_scope == "full":
            self.q_norm = RMSNorm(shape.q_width, shape.rms_norm_eps)
            self.k_norm = RMSNorm(shape.kv_width, shape.rms_norm_eps)
        elif self.qk_norm_scope == "head":
            self.q_norm = RMSNorm(d, shape.rms_norm_eps)
            self.k_norm = RMSNorm(d, shape.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.qk_norm_scope == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(batch, seq, self.heads, self.head_dim)
        k = k.view(batch, seq, self.kv_heads, self.head_dim)
        v = v.view(batch, seq, self.kv_heads, self.head_dim)
        if self.qk_norm_scope == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (batch, heads, seq, head_dim)
        cos, sin = rope[0, :seq].to(x.dtype), rope[1, :seq].to(x.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        group = self.heads // self.kv_heads
        if group > 1:
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        scores = (q @ k.transpose(-2, -1)).float() / math.sqrt(self.head_dim)
        causal = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1)
        probs = scores.masked_fill(causal, float("-inf")).softmax(dim=-1).to(x.dtype)
        out = (probs @ v).transpose(1, 2).reshape(batch, seq, self.heads * self.head_dim)
        return self.o_proj(out)


class MoE(nn.Module):
    """Router → top-k → routed SwiGLU experts, plus an optional (gated) shared expert."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        h = shape.hidden_size
        self.num_experts, self.top_k = shape.num_experts, shape.experts_per_token
        self.router_score, self.norm_topk_prob = shape.router_score, shape.norm_topk_prob
        self.router = nn.Linear(h, shape.num_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(h, shape.moe_intermediate_size) for _ in range(shape.num_experts))
        self.shared_expert = None
        self.shared_expert_gate = None
        if shape.shared_expert_intermediate_size:
            self.shared_expert = SwiGLU(h, shape.shared_expert_intermediate_size)
            if shape.shared_expert_gate:
                self.shared_expert_gate = nn.Linear(h, 1, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(output, Switch load-balancing loss E·Σ f_e·P_e of this block's routing)."""
        batch_shape, h = x.shape[:-1], x.shape[-1]
        flat = x.reshape(-1, h)
        tokens, k = flat.shape[0], self.top_k
        logits = self.router(flat).float()
        probs = logits.softmax(dim=-1)
        if self.router_score == "softmax":
            weights, chosen = probs.topk(k, dim=-1)
            if self.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        else:  # sigmoid of the chosen logits (Llama 4; here too the weights scale the expert outputs)
            top_logits, chosen = logits.topk(k, dim=-1)
            weights = top_logits.sigmoid()
        # The shared expert runs before the routed ones: run after them, an ungated one had its
        # down-projection re-partitioned by DeepSpeed ZeRO-3 before autograd accumulated that weight's
        # gradient, and the first backward failed (DeepSeek-MoE, Llama 4). Its output is still added last,
        # so the forward values and the parameter gradients are as before; the input's gradient sums its
        # parts in another order (last-bit differences from runs before 2026-12-06).
        shared = None
        if self.shared_expert is not None:
            shared = self.shared_expert(flat)
            if self.shared_expert_gate is not None:
                shared = shared * self.shared_expert_gate(flat).sigmoid()
        slots = chosen.reshape(-1)  # (tokens·k,): slot t·k + j holds token t's j-th expert
        order = torch.argsort(slots, stable=True)
        counts = torch.bincount(slots, minlength=self.num_experts)
        token_of = order // k
        outputs, start = [], 0
        for expert, count in zip(self.experts, counts.tolist(), strict=True):
            rows = token_of[start : start + count]  # distinct tokens: each picks an expert at most once
            outputs.append(expert(flat.index_select(0, rows)))
            start += count
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        per_slot = torch.cat(outputs).index_select(0, inverse).view(tokens, k, h)
        out = (per_slot * weights.to(x.dtype).unsqueeze(-1)).sum(dim=1)
        if shared is not None:
            out = out + shared
        fraction = counts.float() / (tokens * k)
        balance = self.num_experts * (fraction * probs.mean(dim=0)).sum()
        return out.view(*batch_shape, h), balance


class Block(nn.Module):
    def __init__(self, shape: ModelShape, dense: bool) -> None:
        super().__init__()
        self.input_norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.attn = Attention(shape)
        self.post_attn_norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.mlp = SwiGLU(shape.hidden_size, shape.dense_intermediate_size) if dense else None
        self.moe = None if dense else MoE(shape)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(output, load-balancing loss; 0 for a dense block)."""
        x = x + self.attn(self.input_norm(x), rope)
        normed = self.post_attn_norm(x)
        if self.mlp is not None:
            return x + self.mlp(normed), torch.zeros((), device=x.device)
        out, balance = self.moe(normed)
        return x + out, balance


class ZooModel(nn.Module):
    """`model(input_ids)` → logits (batch, seq, vocab); `model(input_ids, targets)` → mean next-token
    cross-entropy (+ aux_loss_coef × the mean load-balancing loss over MoE blocks). After a loss forward,
    `last_lm_loss` and `last_balance_loss` hold the two parts, detached."""

    def __init__(
        self,
        shape: ModelShape,
        seed: int = 0,
        activation_checkpointing: bool = True,
        aux_loss_coef: float = 0.0,
        dtype: torch.dtype | None = None,
        device: str | torch.device = "cpu",
    ) -> None:
        super().__init__()
        self.shape = shape
        self.activation_checkpointing = activation_checkpointing
        self.aux_loss_coef = aux_loss_coef
        self.last_lm_loss: torch.Tensor | None = None
        self.last_balance_loss: torch.Tensor | None = None
        with torch.device("meta"):
            self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
            self.blocks = nn.ModuleList(
                Block(shape, dense=i < shape.dense_blocks) for i in range(shape.num_layers)
            )
            self.final_norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
            self.lm_head = (
                None
                if shape.tie_word_embeddings
                else nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
            )
        self.to_empty(device=device)
        if dtype is not None:
            self.to(dtype)
        if torch.device(device).type != "meta":
            self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Norm weights 1, biases 0, every other weight N(0, 0.02²) from its own generator seeded by
        (seed, parameter name): bit-identical for the same seed, and independent of depth."""
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
                generator = torch.Generator(device="cpu").manual_seed(int.from_bytes(digest, "little"))
                values = torch.empty(param.shape, dtype=torch.float32).normal_(
                    0.0, INIT_STD, generator=generator
                )
                param.copy_(values)

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        seq = input_ids.shape[-1]
        rope = rope_tables(seq, self.shape.head_dim, self.shape.rope_theta, input_ids.device)
        x = self.embed_tokens(input_ids)
        balances = []
        use_checkpoint = self.activation_checkpointing and torch.is_grad_enabled()
        for block in self.blocks:
            if use_checkpoint:
                x, balance = checkpoint(block, x, rope, use_reentrant=False)
            else:
                x, balance = block(x, rope)
            if block.moe is not None:
                balances.append(balance)
        x = self.final_norm(x)
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(x, weight)
        if targets is None:
            return logits
        lm_loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
        balance_loss = torch.stack(balances).mean() if balances else torch.zeros((), device=x.device)
        self.last_lm_loss, self.last_balance_loss = lm_loss.detach(), balance_loss.detach()
        if self.aux_loss_coef:
            return lm_loss + self.aux_loss_coef * balance_loss
        return lm_loss
