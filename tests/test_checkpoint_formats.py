"""Issue 17.5: the checkpoint's formats, and 17.6 / `info`.

A Qwen3-Next NVFP4 (ModelOpt) checkpoint whose MTP block is quantised and whose `mtp.fc` and `lm_head` are BF16
(listed in exclude_modules): with quantization="stored" every tensor runs as stored and the K/V stay BF16, so
the drafts follow the checkpoint's own numerics (the oracle: transformers' layer with the tensors dequantised
from the file by width_oracles.read_checkpoint); the seed's NVFP4 mode re-quantises fc and the head and keeps
FP8 K/V, a large departure from those numerics (the issue measured 35% against 2% once the reference
quantises head and fc too). FP8 block checkpoints whose weights end in partial 128-blocks (DeepSeek-V3's
kv_a_proj_with_mqa is 576 rows) decode exactly. `python -m mtp_cupy info` shows what the proposer runs."""
import logging

import numpy as np
import pytest

import mtp_cupy
from mtp_cupy import ops
from mtp_cupy.errors import ConfigError
from mtp_cupy.models import qwen3_next as qwen
from mtp_cupy.runtime.dtypes import BF16, FP8
from helpers import get, out, rand_bf16, up

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from width_oracles import QwenMtp, chain_errors, fp4_values, read_checkpoint, rel, tiny  # noqa: E402
from test_attention_widths import CountingRef  # noqa: E402

TOL0, TOL = 1.5e-2, 2.5e-2


def nvfp4_ckpt():
    return tiny("qwen3_next", quant="nvfp4")


def load(path, dev=None, **kw):
    return mtp_cupy.load_proposer(path, dev or mtp_cupy.device("ref"), max_seq_len=64, **kw)


def device_weight(gpu, L) -> torch.Tensor:
    """float64 [n, k] of a device Linear (bf16 or nvfp4), decoded here."""
    if L.fmt == "bf16":
        return torch.as_tensor(gpu.read(L.weight, BF16, (L.n, L.k)).astype(np.float64))
    assert L.fmt == "nvfp4"
    w = fp4_values(torch.as_tensor(gpu.read(L.weight, np.uint8, (L.n, L.k // 2))))
    s = torch.as_tensor(gpu.read(L.scale, FP8, (L.n, L.k // 16)).astype(np.float64))
    return w * s.repeat_interleave(16, 1) * L.scale2


def test_stored_formats_follow_the_checkpoint(dev):
    """quantization='stored': fc and lm_head stay BF16 (exclude_modules), the quantised block stays NVFP4, K/V
    BF16; the drafts match the checkpoint's own numerics."""
    path = nvfp4_ckpt()
    prop = load(path, dev, quantization="stored")
    assert prop.quantization is None and prop.kv.specs["k"].dtype == "bf16"
    assert (prop.w.linears["fc"].fmt, prop.lm_head.fmt, prop.w.router.fmt) == ("bf16", "bf16", "bf16")
    assert {prop.w.linears[r].fmt for r in ("q_proj", "k_proj", "v_proj", "o_proj")} == {"nvfp4"}
    assert {L.fmt for e in prop.w.experts.values() for L in e} == {"nvfp4"}
    w, cfg = read_checkpoint(path)
    errs, _ = chain_errors(prop, QwenMtp(w, cfg))
    assert errs[0] <= TOL0 and max(errs) <= TOL, errs


def test_the_seed_nvfp4_mode_is_a_lossy_trade_made_explicit(caplog):
    """quantization='nvfp4' re-quantises fc and the head and keeps FP8 K/V: far from the checkpoint's numerics,
    close to a reference that quantises fc and the head the same way. The default is "stored": nothing is
    re-quantised, silently or otherwise."""
    path = nvfp4_ckpt()
    w, cfg = read_checkpoint(path)
    seed = load(path, quantization="nvfp4")
    assert seed.quantization is qwen.MtpQuantization.NVFP4 and seed.kv.specs["k"].dtype == "fp8"
    assert seed.w.linears["fc"].fmt == seed.lm_head.fmt == "nvfp4"
    off, _ = chain_errors(seed, QwenMtp(w, cfg), k=1)
    stored, _ = chain_errors(load(path, quantization="stored"), QwenMtp(w, cfg), k=1)
    requant = dict(w, **{"mtp.fc.weight": device_weight(seed.gpu, seed.w.linears["fc"]),
                         "lm_head.weight": device_weight(seed.gpu, seed.w.lm_head)})
    near, _ = chain_errors(load(path, quantization="nvfp4"), QwenMtp(requant, cfg), k=1)
    assert off[0] > 0.1 and off[0] > 5 * near[0] and stored[0] < near[0], (off, near, stored)
    caplog.set_level(logging.INFO, logger="mtp_cupy")
    default = load(path)
    assert default.quantization is None and default.kv.specs["k"].dtype == "bf16"
    assert (default.w.linears["fc"].fmt, default.lm_head.fmt) == ("bf16", "bf16")
    assert not any("quantised" in r.getMessage() for r in caplog.records)
    caplog.clear()
    load(path, quantization="nvfp4")
    msg = " ".join(r.getMessage() for r in caplog.records)
    assert "fc" in msg and "lm_head" in msg and "FP8" in msg


@pytest.mark.parametrize("quant", ["fp8", "bf16"])
def test_other_checkpoints_as_stored(dev, quant):
    """FP8-block and BF16 Qwen checkpoints under 'stored': each projection in its stored format, BF16 K/V, the
    drafts against the checkpoint's numerics."""
    path = tiny("qwen3_next", quant=quant)
    prop = load(path, dev, quantization="stored")
    want = "fp8_block" if quant == "fp8" else "bf16"
    assert prop.w.linears["q_proj"].fmt == want and prop.lm_head.fmt == "bf16" and prop.kv.specs["v"].dtype == "bf16"
    w, cfg = read_checkpoint(path)
    errs, _ = chain_errors(prop, QwenMtp(w, cfg))
    assert errs[0] <= TOL0 and max(errs) <= TOL, errs


def test_format_options_are_checked_before_any_allocation():
    gpu = CountingRef()
    with pytest.raises(ConfigError, match="Unknown MTP quantization: int4"):
        mtp_cupy.load_proposer(nvfp4_ckpt(), gpu.dev, quantization="int4")
    with pytest.raises(ConfigError, match="kv_cache_dtype='int8'"):
        mtp_cupy.load_proposer(nvfp4_ckpt(), gpu.dev, kv_cache_dtype="int8")
    assert gpu.allocs == 0
    prop = load(tiny("qwen3_next"), quantization="stored", kv_cache_dtype="fp8", kv_scale=0.5)
    assert prop.kv.specs["k"].dtype == "fp8"


# -- FP8 block weights with partial edge blocks (DeepSeek-V3's kv_a_proj_with_mqa: 576 = 4.5 blocks of 128) ---
EDGE = dict(hidden_size=320, kv_lora_rank=160, qk_rope_head_dim=32, q_lora_rank=96)   # 192 x 320: 1.5 x 2.5


def test_fp8_partial_edge_blocks_decode_exactly(dev, rng):
    """kv_a_proj_with_mqa of 192 rows x 320 columns (half a block at both edges) and q_a_proj of 96 rows: the
    device GEMV against the float64 product with the file's dequantised weight; the whole proposer against
    transformers."""
    path = tiny("deepseek_v3", **EDGE)
    prop = load(path, dev)
    w, cfg = read_checkpoint(path)
    P = f"model.layers.{cfg['num_hidden_layers']}.self_attn."
    for name, L in (("kv_a_proj_with_mqa", prop.w.kv_a), ("q_a_proj", prop.w.q_a)):
        assert L.fmt == "fp8_block" and (L.n % 128, L.k % 128) != (0, 0)
        x = rand_bf16(rng, (3, L.k))
        y = out(dev, "f32", (3, L.n))
        xb = up(dev, x)
        ops.linear(dev, xb.ptr, L, y.ptr, 3, out_dtype="f32")
        want = x.astype(np.float64) @ w[P + name + ".weight"].numpy().T
        assert rel(get(dev, y, "f32", (3, L.n)), want) < 1e-5, name
    from width_oracles import MlaMtp
    errs, _ = chain_errors(prop, MlaMtp(w, cfg), seed=4)   # seed 3: a routing near-tie
    assert errs[0] <= TOL0 and max(errs) <= TOL, errs


# -- info --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family,dims,expect", [
    ("deepseek_v3", {}, ["DSA           off", "KV cache      bf16 latent rows of 128",
                         "carried       post_norm (after shared_head.norm)", "options       carried_hidden"]),
    ("deepseek_v3", dict(model_type="deepseek_v32"), ["DSA           on", "half-split RoPE",
                                                      "+ bf16 indexer rows of 128", "shared_head.head.weight"]),
    ("glm5", {}, ["DSA           on", "interleaved RoPE", "carried       post_norm (after shared_head.norm)"]),
    ("deepseek_v4", {}, ["DSA           off", "KV cache      fp8: e4m3 x 48 in 64-blocks", "options       kv_cache_dtype"]),
    ("qwen3_next", dict(quant="nvfp4"), ["KV cache      ", "formats       ", "carried       post_norm (after mtp.norm)",
                                         "quantization: 'stored'"]),
])
def test_info_shows_what_the_proposer_runs(capsys, family, dims, expect):
    from mtp_cupy.cli import main
    assert main(["info", str(tiny(family, **dims))]) == 0
    text = capsys.readouterr().out
    for e in expect:
        assert e in text, f"{e!r} not in\n{text}"
