"""transformers' Qwen3-Next full-attention decoder layer as an oracle for the MTP head.

transformers drops `mtp.*` on load, so the MTP wrapper (pre-fc norms, fc, final norm, LM head) is composed
here by hand around `Qwen3NextForCausalLM(...).model.layers[0]` of a one-layer tiny model whose only layer is
`full_attention`. Weights are float arrays under the checkpoint's keys (dequantised by the caller); the
whole model runs in float64 (its RMSNorm computes in float32, as upstream)."""
from __future__ import annotations

import numpy as np


class HfQwenMtp:
    def __init__(self, w: dict[str, np.ndarray], cfg: dict):
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

        self.torch = torch
        keep = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "partial_rotary_factor",
                "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
                "intermediate_size", "vocab_size", "rope_theta", "rms_norm_eps", "norm_topk_prob")
        hc = AutoConfig.for_model("qwen3_next", num_hidden_layers=1, layer_types=["full_attention"],
                                  **{k: cfg[k] for k in keep if k in cfg})
        model = AutoModelForCausalLM.from_config(hc, attn_implementation="eager",
                                                   experts_implementation="eager").to(torch.float64).eval()
        self.layer, self.rotary = model.model.layers[0], model.model.rotary_emb
        D, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.pre_e, self.pre_h, self.final = (Qwen3NextRMSNorm(D, eps).to(torch.float64) for _ in range(3))
        self.fc = torch.nn.Linear(2 * D, D, bias=False).to(torch.float64)
        t = {k: torch.tensor(np.asarray(v, np.float64)) for k, v in w.items()}
        self.embed, self.lm_head = t["model.embed_tokens.weight"], t["lm_head.weight"]
        L = "mtp.layers.0."
        with torch.no_grad():
            self.pre_e.weight.copy_(t["mtp.pre_fc_norm_embedding.weight"])
            self.pre_h.weight.copy_(t["mtp.pre_fc_norm_hidden.weight"])
            self.final.weight.copy_(t["mtp.norm.weight"])
            self.fc.weight.copy_(t["mtp.fc.weight"])
            lay = self.layer
            lay.input_layernorm.weight.copy_(t[L + "input_layernorm.weight"])
            lay.post_attention_layernorm.weight.copy_(t[L + "post_attention_layernorm.weight"])
            for name in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
                getattr(lay.self_attn, name).weight.copy_(t[f"{L}self_attn.{name}.weight"])
            mlp, m = lay.mlp, L + "mlp."
            if cfg.get("num_experts", 0) > 0:
                mlp.gate.weight.copy_(t[m + "gate.weight"])
                mlp.shared_expert_gate.weight.copy_(t[m + "shared_expert_gate.weight"])
                for p in ("gate_proj", "up_proj", "down_proj"):
                    getattr(mlp.shared_expert, p).weight.copy_(t[f"{m}shared_expert.{p}.weight"])
                for e in range(cfg["num_experts"]):
                    pe = f"{m}experts.{e}."
                    mlp.experts.gate_up_proj[e].copy_(torch.cat([t[pe + "gate_proj.weight"], t[pe + "up_proj.weight"]]))
                    mlp.experts.down_proj[e].copy_(t[pe + "down_proj.weight"])
            else:
                for p in ("gate_proj", "up_proj", "down_proj"):
                    getattr(mlp, p).weight.copy_(t[f"{m}{p}.weight"])
        self.rows: list[tuple[int, np.ndarray, int]] = []    # (token, hidden, position) for write_row / step

    def run(self, tokens, hiddens, positions) -> tuple[np.ndarray, np.ndarray]:
        """Rows r = 0..T-1 pair embed(tokens[r]) with hiddens[r] at positions[r], each attending to rows
        0..r. Returns (logits [T, vocab], carried hidden g [T, hidden]) in float64."""
        torch = self.torch
        with torch.no_grad():
            e = self.embed[torch.as_tensor(np.asarray(tokens, np.int64))]
            h = torch.tensor(np.asarray(hiddens, np.float64))
            x = self.fc(torch.cat([self.pre_e(e), self.pre_h(h)], dim=-1))[None]
            T = x.shape[1]
            pos = torch.as_tensor(np.asarray(positions, np.int64))[None]
            mask = torch.full((T, T), float("-inf"), dtype=torch.float64).triu(1)[None, None]
            y = self.layer(x, position_embeddings=self.rotary(x, pos), attention_mask=mask, position_ids=pos)
            g = self.final(y[0])
            return (g @ self.lm_head.T).numpy(), g.numpy()

    def write_row(self, token: int, hidden, pos: int) -> None:
        self.rows.append((int(token), np.asarray(hidden, np.float64), int(pos)))

    def step(self, token: int, hidden, pos: int) -> tuple[np.ndarray, np.ndarray]:
        """A draft step after the rows held (appends its row): (logits, carried hidden) of the newest row."""
        self.write_row(token, hidden, pos)
        toks, hs, ps = zip(*self.rows)
        logits, g = self.run(toks, np.stack(hs), ps)
        return logits[-1], g[-1]

    def truncate(self, rows: int) -> None:
        del self.rows[rows:]
