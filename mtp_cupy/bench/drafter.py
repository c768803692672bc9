"""The mtp_cupy proposer of a family at its real dims, ready to time: random weights in the real formats,
states prefilled with `ctx` rows, a host hidden and token per batch slot, and the bytes a step reads."""
from __future__ import annotations

import time

import numpy as np

from ..runtime.dtypes import to_bf16
from . import deepseek_v3, deepseek_v4, glm5, qwen3_next

FAMILIES = ("deepseek_v4", "deepseek_v3", "qwen3_next", "glm5")
TITLES = {"deepseek_v4": "DeepSeek-V4-Flash", "deepseek_v3": "DeepSeek-V3/R1", "qwen3_next": "Qwen3-Next-80B-A3B",
          "glm5": "GLM-5"}
DIMS = {"deepseek_v4": deepseek_v4, "deepseek_v3": deepseek_v3, "qwen3_next": qwen3_next, "glm5": glm5}


def real_config(fam: str, tiny: bool = False) -> dict:
    """The config dict of `fam` at its real dims (or tiny dims); the torch peers read the same dims.

    Parameters
    ----------
    fam : str
        One of `FAMILIES`.
    tiny : bool, default False
        The tiny dims of the family's smoke runs.
    """
    m = DIMS[fam]
    return m.TINY if tiny else m.REAL


def _build(fam: str, gpu, cfgd: dict, seed: int, max_seq: int, kmax: int, bmax: int, qwen_quant: str,
           glm_head_fp8: bool, batch_invariant: bool = True):
    """(proposer, host hidden shape) of `fam`, sized for bmax sequences of max_seq rows."""
    size = dict(max_seq_len=max_seq, max_drafts=kmax, max_batch=bmax, max_sequences=bmax,
                batch_invariant=batch_invariant)
    if fam == "deepseek_v3":
        from ..models.deepseek_v3 import DeepseekV3MtpProposer
        from ..weights.config import DeepseekV3Config
        cfg = DeepseekV3Config.from_dict(cfgd)
        return DeepseekV3MtpProposer(gpu, cfg, deepseek_v3.random_weights(gpu, cfg, seed), **size), (cfg.hidden_size,)
    if fam == "deepseek_v4":
        from ..models.deepseek_v4 import DeepseekV4MtpProposer
        from ..weights.config import DeepseekV4Config
        cfg = DeepseekV4Config.from_dict(cfgd)
        prop = DeepseekV4MtpProposer(gpu, cfg, deepseek_v4.random_weights(gpu, cfg, seed), device_hidden="streams",
                                     **size)
        return prop, (cfg.hc_mult, cfg.hidden_size)
    if fam == "glm5":
        from ..models.glm5 import Glm5MtpProposer
        from ..weights.config import GlmMoeDsaConfig
        cfg = GlmMoeDsaConfig.from_dict(cfgd)
        prop = Glm5MtpProposer(gpu, cfg, glm5.random_weights(gpu, cfg, None, seed, "fp8"), head_fp8=glm_head_fp8,
                               **size)
        return prop, (cfg.hidden_size,)
    from ..models.qwen3_next import Qwen3NextMtpProposer
    from ..weights.config import Qwen3NextConfig
    cfg = Qwen3NextConfig.from_dict(cfgd)
    prop = Qwen3NextMtpProposer(gpu, cfg, qwen3_next.random_weights(gpu, cfg, seed), quantization=qwen_quant, **size)
    return prop, (cfg.hidden_size,)


def _formats(fam: str, prop, qwen_quant: str) -> str:
    if fam == "deepseek_v3":
        return "FP8 block (f32 scales) projections + experts; BF16 eh_proj, router, embed, head"
    if fam == "deepseek_v4":
        return "FP8 (e8m0 scales) projections, MXFP4 routed experts, FP8 shared; BF16 router, embed, head"
    if fam == "glm5":
        return ("FP8 block (f32 scales) projections + experts + indexer wq_b/wk; BF16 eh_proj, router, "
                f"weights_proj, embed, {'FP8 row' if prop.head.fmt == 'fp8_row' else 'BF16'} head")
    return f"{qwen_quant} projections + experts (run_real_dims_qwen), BF16 router + shared gate"


class Drafter:
    """A family's proposer at real (or tiny) dims with `bmax` prefilled states, timed by `call`.

    Parameters
    ----------
    fam : str
        One of `FAMILIES`.
    gpu : mtp_cupy Backend
        The device.
    ctx : int
        Drafter rows prefilled per state.
    kmax, bmax : int
        Most drafts per propose, widest batch.
    tiny : bool, default False
        Tiny dims.
    seed : int, default 0
        Seed of the weights, the prefill and the inputs.
    qwen_quant : {"bf16", "fp8", "nvfp4"}, default "bf16"
        Qwen3-Next's projection format.
    glm_head_fp8 : bool, default False
        GLM-5 drafts from an FP8 copy of its head.

    Attributes
    ----------
    prop, states, cfgd, hshape, formats, build_s, prefill_s, kv_rows, kv_row_bytes, kv_step_bytes
        The proposer, its states, its config dict, the host hidden shape, a note on its weight formats, build
        and prefill seconds, KV rows / bytes per row / bytes one step reads.
    """

    def __init__(self, fam: str, gpu, ctx: int, kmax: int, bmax: int, tiny: bool = False, seed: int = 0,
                 batch_invariant: bool = True,
                 qwen_quant: str = "bf16", glm_head_fp8: bool = False, hidden_on: str = "host",
                 catch_up_room: int = 0):
        """`catch_up_room`: rows past ctx a sequence may grow by between rewinds (`call(..., catch_up=True)`)."""
        self.fam, self.gpu, self.ctx = fam, gpu, ctx
        max_seq = ctx + kmax + 16 + catch_up_room
        t0 = time.perf_counter()
        self.cfgd = real_config(fam, tiny)
        self.prop, self.hshape = _build(fam, gpu, self.cfgd, seed, max_seq, kmax, bmax, qwen_quant, glm_head_fp8,
                                        batch_invariant)
        p = self.prop
        self.formats = _formats(fam, p, qwen_quant)
        gpu.synchronize()
        self.build_s = time.perf_counter() - t0
        self.kv_rows = min(ctx + 1, p.cfg.sliding_window) if fam == "deepseek_v4" else ctx + 1
        self.kv_row_bytes = sum(s.row_bytes * s.num_layers for s in p.kv.specs.values())
        self.kv_step_bytes = self.kv_rows * self.kv_row_bytes
        if fam == "glm5":    # the indexer reads every key row, MLA only the index_topk latent rows it picked
            lat = p.kv.specs["latent"]
            self.kv_step_bytes -= (self.kv_rows - min(p.cfg.index_topk, self.kv_rows)) * lat.row_bytes * lat.num_layers
        rng = np.random.default_rng(seed)
        V = p.vocab_size
        hs = to_bf16(rng.standard_normal((ctx, *self.hshape), dtype=np.float32))
        self.states = [p.alloc_state() for _ in range(bmax)]
        t0 = time.perf_counter()
        for st in self.states:
            p.prefill(st, rng.integers(0, V, ctx + 1), hs)
        gpu.synchronize()
        self.prefill_s = time.perf_counter() - t0
        self.toks = [int(t) for t in rng.integers(0, V, len(self.states))]
        self.h = to_bf16(rng.standard_normal((len(self.states), *self.hshape), dtype=np.float32))
        # hidden_on="device": the rows as a device pointer, what a GPU target hands over (read in place, unchecked)
        self._hdev = gpu.upload(self.h) if hidden_on == "device" else None

    def call(self, k: int, B: int, catch_up: bool = False):
        """A callable: ``propose_batch`` of k drafts for B sequences, then ``after_verify_batch`` of none accepted
        (``propose`` and ``after_verify`` when B = 1). `catch_up`: a serving step instead, the sequences first
        rewound to ctx rows: ``after_verify_batch`` of none accepted, the dropped row caught up
        (``prefill_batch``, one row each), ``propose_batch`` one position on; each call advances every sequence
        a row."""
        p, ctx = self.prop, self.ctx
        dev = self._hdev.ptr if self._hdev is not None else None
        if catch_up:
            return self._serving_step(k, B, dev)
        if B == 1:
            st, tok, h = self.states[0], self.toks[0], self.h[0] if dev is None else dev

            def run():
                p.propose(st, tok, h, ctx, k)
                p.after_verify(st, 0)
            return run
        sts, toks, none = self.states[:B], self.toks[:B], [0] * B
        h = np.ascontiguousarray(self.h[:B]) if dev is None else dev

        def run_batch():
            p.propose_batch(sts, toks, h, [ctx] * B, k)
            p.after_verify_batch(sts, none)
        return run_batch

    def _serving_step(self, k: int, B: int, dev):
        p, sts = self.prop, self.states[:B]
        for st in sts:   # rewind: the rows past ctx go (a benchmark's reset, not a serving call)
            if st.blocks.rows > self.ctx:
                st.blocks.truncate(self.ctx)
                st._cut(self.ctx)
            st.last_num_drafted = 0
        return serving_step(p, sts, self.toks[:B], np.ascontiguousarray(self.h[:B]) if dev is None else dev, k)

    def experts_selected(self, B: int) -> int | None:
        """Distinct routed experts the last step's B real rows chose (None for a dense-FFN head)."""
        moe = getattr(self.prop, "moe", None) or getattr(self.prop, "ffn", None)
        return len(moe.selected_experts(B)) if hasattr(moe, "selected_experts") else None

    def weight_bytes(self, B: int, experts: int | None = None) -> int:
        """Weight bytes one step of B rows reads (with `experts` distinct routed experts when given)."""
        return self.prop.weight_bytes_per_step(B, experts)

    def kv_bytes(self, B: int) -> int:
        """Cache bytes one step of B sequences reads."""
        return B * self.kv_step_bytes

    def close(self) -> None:
        """Free the states and drop the proposer."""
        for st in self.states:
            self.prop.free_state(st)
        self.prop = self.states = self._hdev = None


def serving_step(p, states: list, toks: list, h, k: int):
    """A callable: one step of a batched serving loop's drafter calls, every draft of the last step rejected:
    ``after_verify_batch``, the row it dropped caught up (``prefill_batch``, one row a sequence, `h` row s and
    token s), ``propose_batch`` of k drafts at the next positions. Each call advances every sequence a row."""
    none, one = [0] * len(states), [1] * len(states)

    def step():
        p.after_verify_batch(states, none)
        p.prefill_batch(states, toks, h, one)
        p.propose_batch(states, toks, h, None, k)
    return step
