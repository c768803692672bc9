"""DeepseekV3Target: the whole DeepSeek-V3-layout target model (MLA + MoE) on the same kernels as the
drafters, over its own paged latent cache. `forward(seq, tokens)` appends len(tokens) rows at the next
positions and returns f32 logits and the final-normed hiddens (what the MTP drafter pairs with the next
token). Prefill, decode and the (k+1)-row verify are the same call: each row is its own metadata slab
(position, slot, seq_len = position + 1, the shared block table), so the decode attention kernel attends
each row causally, rows of the same call included."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import ops
from ..cache.paged import CacheSpec, PagedKvCache, SeqBlocks
from ..errors import CapacityError, ConfigError, InputError
from ..layers.dense_ffn import DenseFFN
from ..layers.mla import MlaAttention, MlaDims, MlaRope
from ..layers.moe import MoE, MoeConfig
from ..runtime import slab as slab_spec
from ..runtime.arena import ForwardBuffers, pack_mtp_attn_meta
from ..runtime.backend import Backend
from ..weights.config import DeepseekV3Config, load_config
from ..weights.loader import WeightLoader
from ..weights.safetensors_io import Checkpoint
from .layer_weights import load_layer


@dataclass
class TargetSeq:
    blocks: SeqBlocks

    @property
    def rows(self) -> int:
        return self.blocks.rows


class DeepseekV3Target:
    def __init__(self, gpu: Backend, path, max_seq_len: int = 4096, max_sequences: int = 2, rows_per_pass: int = 16,
                 progress: bool | None = None):
        cfg = load_config(Path(path))
        if not isinstance(cfg, DeepseekV3Config):
            raise ConfigError(f"{path} is a {cfg.family} checkpoint; the target runner reads deepseek_v3")
        self.gpu, self.cfg, self.max_seq_len, self.R = gpu, cfg, int(max_seq_len), int(rows_per_pass)
        # verify rows must compute exactly as decode rows do, or greedy speculation drifts at near-ties: every
        # layer runs with batch-invariant launch geometry
        D, V, eps = cfg.hidden_size, cfg.vocab_size, float(cfg.rms_norm_eps)
        self.vocab_size, self.hidden_size, self.eps = V, D, eps
        dims, rope = MlaDims.from_config(cfg), MlaRope.from_config(cfg)
        L = cfg.num_hidden_layers
        self.kv = PagedKvCache(gpu, CacheSpec("latent", dims.row_width, "bf16", num_layers=L),
                               num_blocks=PagedKvCache.blocks_for(max_seq_len) * max_sequences)
        self.slab = slab_spec.stride(max_seq_len)
        R = self.R
        self.bufs = ForwardBuffers(gpu, {"ids": 4 * R, "x": 2 * D * R, "xn": 2 * D * R, "tmp": 2 * D * R,
                                         "h": 2 * D * R, "logits": 4 * V * R, "meta": self.slab * R})
        ckpt = Checkpoint(Path(path))
        with WeightLoader(gpu, ckpt, progress=progress) as wl:
            self.embed = wl.tensor(cfg.embed_keys[0], (V, D), as_dtype="bf16")
            self.norm = wl.tensor("model.norm.weight", (D,), as_dtype="bf16")
            self.head = wl.linear(cfg.head_keys[0].removesuffix(".weight"), V, D)
            self.layers = []
            for i in range(L):
                moe = i >= cfg.first_k_dense_replace
                lw = load_layer(wl, cfg, f"model.layers.{i}.", moe)
                attn = MlaAttention(gpu, lw.mla, dims, rope, self.kv, layer=i, max_rows=R, max_kv_rows=R, invariant=True)
                if moe:
                    mlp = MoE(gpu, MoeConfig.from_config(cfg), lw.router, lw.experts, bias=lw.bias, shared=lw.shared,
                              max_rows=R, invariant=True)
                else:
                    mlp = DenseFFN(gpu, lw.dense, max_rows=R, invariant=True)
                self.layers.append((lw, attn, mlp))

    def alloc(self) -> TargetSeq:
        return TargetSeq(SeqBlocks(self.kv))

    def free(self, seq: TargetSeq) -> None:
        seq.blocks.release()

    def truncate(self, seq: TargetSeq, rows: int) -> None:
        seq.blocks.truncate(rows)

    def forward(self, seq: TargetSeq, tokens) -> tuple[np.ndarray, np.ndarray]:
        toks = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if toks.size == 0:
            raise InputError("forward needs at least one token")
        if toks.min() < 0 or toks.max() >= self.vocab_size:
            raise InputError(f"token id out of range [0, {self.vocab_size})")
        p0 = seq.rows
        if p0 + toks.size > self.max_seq_len:
            raise CapacityError(f"{p0} + {toks.size} rows exceed max_seq_len {self.max_seq_len}")
        seq.blocks.reserve(p0 + toks.size)
        logits, hid = [], []
        try:
            for c0 in range(0, toks.size, self.R):
                lg, h = self._pass(seq, toks[c0:c0 + self.R], p0 + c0)
                logits.append(lg)
                hid.append(h)
        except Exception:
            seq.blocks.truncate(p0)
            raise
        return np.concatenate(logits), np.concatenate(hid)

    def _pass(self, seq: TargetSeq, toks: np.ndarray, p0: int) -> tuple[np.ndarray, np.ndarray]:
        gpu, b, D, m = self.gpu, self.bufs, self.hidden_size, toks.size
        slabs = np.zeros((m, self.slab), np.uint8)
        for j in range(m):
            p = p0 + j
            raw = pack_mtp_attn_meta(p, seq.blocks.slot(p), p + 1, seq.blocks.table, self.slab)
            slabs[j, :len(raw)] = np.frombuffer(raw, np.uint8)
        gpu.copy_h2d(b.meta, slabs)
        gpu.copy_h2d(b.ids, toks.astype(np.int32))
        ops.embed_rows(gpu, self.embed.ptr, b.ids, b.x, m, D, vocab=self.vocab_size)
        for lw, attn, mlp in self.layers:
            ops.rms_norm(gpu, b.x, lw.input_norm, b.xn, m, D, self.eps)
            attn.forward(b.xn, b.tmp, m, b.meta, self.slab)
            ops.bf16_residual_add(gpu, b.x, b.tmp, m * D)
            ops.rms_norm(gpu, b.x, lw.post_norm, b.xn, m, D, self.eps)
            mlp.forward(b.xn, b.tmp, m)
            ops.bf16_residual_add(gpu, b.x, b.tmp, m * D)
        ops.rms_norm(gpu, b.x, self.norm.ptr, b.h, m, D, self.eps)
        ops.linear(gpu, b.h, self.head, b.logits, m, out_dtype="f32", invariant=True)
        seq.blocks.rows = p0 + m
        return (gpu.read(b.logits, np.float32, (m, self.vocab_size)),
                gpu.read(b.h, "bf16", (m, D)).astype(np.float32))
