"""Qwen3-Next MTP checkpoint keys (docs/model_math.md D.1) and the device loader.

The MTP module lives under `mtp.` (vLLM maps it to `model.`); the embedding and LM head are the target's
(`model.embed_tokens.weight`, `lm_head.weight`). A dense-FFN head has `mlp.{gate,up,down}_proj` where a MoE
head has the router `mlp.gate`, `mlp.experts.{e}.*`, `mlp.shared_expert.*` and `mlp.shared_expert_gate`."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import WeightError
from ..runtime.backend import Backend
from ..runtime.ptr import DevicePtr
from .config import Qwen3NextConfig
from .linear import Linear
from .loader import WeightLoader

EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"
MTP = "mtp."
LAYER = "mtp.layers.0."
ATTN = LAYER + "self_attn."
MLP = LAYER + "mlp."

NORMS = {"pre_fc_norm_embedding": MTP + "pre_fc_norm_embedding.weight",
         "pre_fc_norm_hidden": MTP + "pre_fc_norm_hidden.weight",
         "input_layernorm": LAYER + "input_layernorm.weight",
         "post_attention_layernorm": LAYER + "post_attention_layernorm.weight",
         "norm": MTP + "norm.weight",
         "q_norm": ATTN + "q_norm.weight", "k_norm": ATTN + "k_norm.weight"}
# linear role -> module prefix (the tensor is `<prefix>.weight` plus its scales)
ATTN_LINEARS = {"fc": MTP + "fc", "q_proj": ATTN + "q_proj", "k_proj": ATTN + "k_proj",
                "v_proj": ATTN + "v_proj", "o_proj": ATTN + "o_proj"}
DENSE_FFN = {"gate_proj": MLP + "gate_proj", "up_proj": MLP + "up_proj", "down_proj": MLP + "down_proj"}
ROUTER = MLP + "gate"
SHARED_GATE = MLP + "shared_expert_gate"
SHARED_EXPERT = tuple(f"{MLP}shared_expert.{p}" for p in ("gate_proj", "up_proj", "down_proj"))


def expert(e: int) -> tuple[str, str, str]:
    """(gate, up, down) module prefixes of routed expert e."""
    return tuple(f"{MLP}experts.{e}.{p}" for p in ("gate_proj", "up_proj", "down_proj"))


def is_dense_ffn(keys) -> bool:
    """A head whose checkpoint has a dense SwiGLU FFN instead of the MoE (decided from the keys)."""
    keys = set(keys)
    return DENSE_FFN["gate_proj"] + ".weight" in keys and ROUTER + ".weight" not in keys


# -- loading -----------------------------------------------------------------------------------------
@dataclass
class Qwen3NextMtpWeights:
    """The head's tensors on the device. Linears keep their stored format until `quantize`."""
    embed: DevicePtr                                   # bf16 [vocab, hidden]
    lm_head: Linear
    norms: dict[str, DevicePtr]                        # NORMS roles -> bf16 vectors
    linears: dict[str, Linear]                         # fc, q/k/v/o_proj (+ gate/up/down_proj when dense)
    dense_ffn: bool
    router: Linear | None = None
    shared_gate: Linear | None = None
    experts: dict[int, tuple[Linear, Linear, Linear]] = field(default_factory=dict)
    shared: tuple[Linear, Linear, Linear] | None = None
    owners: list = field(default_factory=list, repr=False)

    def quantize(self, gpu: Backend, fmt: str) -> list[str]:
        """BF16 projections -> `fmt` on the device (fp8_row / nvfp4); stored FP8/NVFP4 ones stay as they are.
        The router and the shared-expert gate stay BF16: they pick experts, and they are tiny. Returns the
        roles quantised (experts counted once)."""
        if fmt == "bf16":
            return []
        from ..ops import quantize_linear
        done: list[str] = []

        def q(w: Linear, role: str) -> Linear:
            if w.fmt != "bf16":
                return w
            if role not in done:
                done.append(role)
            return quantize_linear(gpu, w, fmt)
        self.linears = {r: q(w, r) for r, w in self.linears.items()}
        self.experts = {e: tuple(q(w, "experts") for w in gud) for e, gud in self.experts.items()}
        if self.shared is not None:
            self.shared = tuple(q(w, "shared_expert") for w in self.shared)
        return done


def _first_key(ckpt, keys: tuple[str, ...], what: str) -> str:
    for k in keys:
        if ckpt.has(k):
            return k
    raise WeightError(f"no {what} in the checkpoint (looked for {', '.join(keys)})", keys[0])


def load_qwen3_next(gpu: Backend, path, cfg: Qwen3NextConfig, progress: bool | None = None) -> Qwen3NextMtpWeights:
    """The MTP head of the checkpoint at `path` (shapes checked against `cfg`), each projection in the format
    the checkpoint stores it."""
    D, V, H, KV, hd = cfg.hidden_size, cfg.vocab_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    with WeightLoader(gpu, path, progress) as wl:
        ck = wl.ckpt
        dense = is_dense_ffn(ck.keys())
        if not dense and not cfg.mtp_is_moe:
            raise WeightError("config.json has num_experts = 0 but the checkpoint has a MoE head", ROUTER + ".weight")
        owners = []

        def vec(key: str, n: int) -> DevicePtr:
            owners.append(wl.tensor(key, (n,), as_dtype="bf16"))
            return owners[-1].ptr
        emb_key = _first_key(ck, cfg.embed_keys, "embedding")
        owners.append(wl.tensor(emb_key, (V, D), as_dtype="bf16"))
        embed = owners[-1].ptr
        if any(ck.has(k) for k in cfg.head_keys) or not cfg.tie_word_embeddings:
            lm_head = wl.linear(_first_key(ck, cfg.head_keys, "LM head")[:-len(".weight")], V, D)
        else:   # tied: the embedding table is the head
            lm_head = Linear("bf16", V, D, embed, owners=[owners[-1]])
        norms = {r: vec(k, hd if r in ("q_norm", "k_norm") else D) for r, k in NORMS.items()}
        shapes = {"fc": (D, 2 * D), "q_proj": (2 * H * hd, D), "k_proj": (KV * hd, D), "v_proj": (KV * hd, D),
                  "o_proj": (D, H * hd)}
        linears = {r: wl.linear(m, *shapes[r]) for r, m in ATTN_LINEARS.items()}
        w = Qwen3NextMtpWeights(embed, lm_head, norms, linears, dense, owners=owners)
        if dense:
            inter = ck.info(DENSE_FFN["gate_proj"] + ".weight").shape[0]
            w.linears.update(gate_proj=wl.linear(DENSE_FFN["gate_proj"], inter, D),
                             up_proj=wl.linear(DENSE_FFN["up_proj"], inter, D),
                             down_proj=wl.linear(DENSE_FFN["down_proj"], D, inter))
            return w
        E, inter, sh = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size

        def swiglu(prefixes: tuple[str, str, str], i: int) -> tuple[Linear, Linear, Linear]:
            g, u, d = prefixes
            return wl.linear(g, i, D), wl.linear(u, i, D), wl.linear(d, D, i)
        w.router = wl.linear(ROUTER, E, D)
        w.shared_gate = wl.linear(SHARED_GATE, 1, D)
        w.experts = {e: swiglu(expert(e), inter) for e in range(E)}
        w.shared = swiglu(SHARED_EXPERT, sh)
        return w
