"""WeightLoader on the NumPy device: every Linear format, bytes as stored, checks, progress; and `info`."""
import numpy as np
import pytest

from mtp_cupy.errors import WeightError
from mtp_cupy.runtime.dtypes import BF16, FP8, to_bf16
from mtp_cupy.weights import quant_host as qh
from mtp_cupy.weights.info import describe, format_info
from mtp_cupy.weights.loader import WeightLoader, dequant_linear, detect_linear
from mtp_cupy.weights.safetensors_io import Checkpoint
from mtp_cupy.weights.writer import write_checkpoint, write_safetensors

N, K = 200, 320        # not multiples of 128: block formats have partial edge blocks


def _w(rng, n=N, k=K):
    return (rng.standard_normal((n, k)) * 0.05).astype(np.float32)


def _format_tensors(rng) -> dict[str, np.ndarray]:
    """One projection per checkpoint format, named after the Linear format it must load as."""
    t = {}
    t["bf16.weight"] = _w(rng).astype(BF16)
    t["f16.weight"] = _w(rng).astype(np.float16)
    t["f32.weight"] = _w(rng)
    t["fp8b.weight"], t["fp8b.weight_scale_inv"] = qh.quant_fp8_block(_w(rng))
    t["fp8e.weight"], t["fp8e.scale"] = qh.quant_fp8_block_e8m0(_w(rng))          # DeepSeek-V4 naming
    t["fp8ct.weight"], t["fp8ct.weight_scale"] = qh.quant_fp8_block(_w(rng))     # compressed-tensors block
    q, s = qh.quant_fp8_row(_w(rng))
    t["fp8r.weight"], t["fp8r.weight_scale"] = q, s
    t["fp8r1.weight"], t["fp8r1.weight_scale"] = q, s[:, None]
    t["fp8t.weight"], st = qh.quant_fp8_tensor(_w(rng))
    t["fp8t.weight_scale"] = st
    t["fp8t1.weight"], t["fp8t1.weight_scale"] = t["fp8t.weight"], st.reshape(1)
    p, bs, s2 = qh.quant_nvfp4(_w(rng))
    t["nv.weight"], t["nv.weight_scale"], t["nv.weight_scale_2"] = p, bs, np.array(s2, np.float32)
    t["nv.input_scale"] = np.array(0.01, np.float32)
    p, bs, s2 = qh.quant_nvfp4(_w(rng))
    t["ct.weight_packed"], t["ct.weight_scale"] = p, bs
    t["ct.weight_global_scale"] = np.array([np.float32(1) / s2], np.float32)
    p, s = qh.quant_mxfp4(_w(rng))
    t["mx.weight"], t["mx.scale"] = p.view(np.int8), s                          # V4 experts: "int8"
    return t


FORMAT_OF = {"bf16": "bf16", "f16": "bf16", "f32": "bf16", "fp8b": "fp8_block", "fp8e": "fp8_block_e8m0",
             "fp8ct": "fp8_block", "fp8r": "fp8_row", "fp8r1": "fp8_row", "fp8t": "fp8_row", "fp8t1": "fp8_row",
             "nv": "nvfp4", "ct": "nvfp4", "mx": "mxfp4"}


@pytest.fixture
def ckpt(tmp_path, rng):
    t = _format_tensors(rng)
    write_checkpoint(tmp_path, t, shards=3)
    return Checkpoint(tmp_path), t


@pytest.mark.parametrize("name", list(FORMAT_OF))
def test_linear_formats_bytes_as_stored(ref, ckpt, name):
    ck, t = ckpt
    with WeightLoader(ref, ck, progress=False) as wl:
        W = wl.linear(name, N, K)
    fmt = FORMAT_OF[name]
    assert (W.fmt, W.n, W.k) == (fmt, N, K) and detect_linear(ck, name).fmt == fmt
    wkey = "ct.weight_packed" if name == "ct" else f"{name}.weight"
    stored = t[wkey]
    if name in ("f16", "f32"):            # converted on the host, round to nearest even
        assert ref.read(W.weight, "u16", (N, K)).tobytes() == to_bf16(stored.astype(np.float32)).tobytes()
    else:
        assert ref.copy_d2h(W.weight, stored.nbytes).tobytes() == stored.tobytes()
    skey = {"fp8b": "weight_scale_inv", "fp8e": "scale", "mx": "scale"}.get(name, "weight_scale")
    if fmt in ("fp8_block", "fp8_block_e8m0", "nvfp4", "mxfp4"):
        s = t[f"{name}.{skey}"]
        assert ref.copy_d2h(W.scale, s.nbytes).tobytes() == s.tobytes()
    if fmt == "fp8_row":                  # always f32 [n] on the device
        s = np.broadcast_to(t[f"{name}.weight_scale"].reshape(-1), (N,)).astype(np.float32)
        assert np.array_equal(ref.read(W.scale, "f32", N), s)
    if name == "nv":
        assert W.scale2 == float(t["nv.weight_scale_2"])
    elif name == "ct":
        assert W.scale2 == float(np.float32(1) / t["ct.weight_global_scale"][0])
    else:
        assert W.scale2 == 1.0
    if name not in ("fp8t", "fp8t1"):     # a per-tensor scale is read as n copies
        assert W.weight_bytes <= sum(a.nbytes for k, a in t.items() if k.startswith(name + "."))


def test_dequant_linear_matches_quant_host(ckpt):
    ck, t = ckpt
    assert np.array_equal(dequant_linear(ck, "fp8b"), qh.dequant_fp8_block(t["fp8b.weight"], t["fp8b.weight_scale_inv"]))
    assert np.array_equal(dequant_linear(ck, "fp8e.weight"), qh.dequant_fp8_block(t["fp8e.weight"], t["fp8e.scale"]))
    assert np.array_equal(dequant_linear(ck, "fp8t"), qh.dequant_fp8_row(t["fp8t.weight"], t["fp8t.weight_scale"]))
    assert np.array_equal(dequant_linear(ck, "nv"), qh.dequant_nvfp4(t["nv.weight"], t["nv.weight_scale"],
                                                                    t["nv.weight_scale_2"]))
    assert np.array_equal(dequant_linear(ck, "mx"), qh.dequant_mxfp4(t["mx.weight"], t["mx.scale"]))
    assert np.array_equal(dequant_linear(ck, "bf16"), t["bf16.weight"].astype(np.float32))
    assert np.array_equal(dequant_linear(ck, "f16"), to_bf16(t["f16.weight"].astype(np.float32)).astype(np.float32))


def test_bytes_loaded_and_progress(ref, ckpt, capsys):
    ck, t = ckpt
    wl = WeightLoader(ref, ck, progress=True, total=ck.nbytes_total("nv."))
    wl.linear("nv", N, K)
    wl.close()
    want = sum(t[f"nv.{s}"].nbytes for s in ("weight", "weight_scale", "weight_scale_2"))
    assert wl.bytes_loaded == want
    assert "loading weights" in capsys.readouterr().err
    for progress in (False, None):        # None: small checkpoint, no bar
        with WeightLoader(ref, ck, progress=progress) as wl:
            wl.linear("bf16", N, K)
        assert capsys.readouterr().err == "" and wl.bytes_loaded == N * K * 2


def test_tensor_as_stored_and_converted(ref, tmp_path, rng):
    v32 = rng.standard_normal(64).astype(np.float32)
    t = {"n.bf16": v32.astype(BF16), "n.f16": v32.astype(np.float16), "n.f32": v32,
         "ids": rng.integers(0, 100, (4, 3)).astype(np.int64)}
    write_safetensors(tmp_path / "model.safetensors", t)
    with WeightLoader(ref, tmp_path, progress=False) as wl:
        b = wl.tensor("n.bf16", (64,), "BF16")
        assert ref.copy_d2h(b.ptr, 128).tobytes() == t["n.bf16"].tobytes()
        b = wl.tensor("n.f16", (64,), ("BF16", "F16"), as_dtype="bf16")
        assert ref.read(b.ptr, "bf16", 64).tobytes() == to_bf16(t["n.f16"].astype(np.float32)).tobytes()
        b = wl.tensor("n.f32", as_dtype="bf16")
        assert ref.read(b.ptr, "bf16", 64).tobytes() == to_bf16(v32).tobytes()
        b = wl.tensor("n.bf16", as_dtype="f32")
        assert np.array_equal(ref.read(b.ptr, "f32", 64), t["n.bf16"].astype(np.float32))
        b = wl.tensor("n.f32", as_dtype="f32")
        assert np.array_equal(ref.read(b.ptr, "f32", 64), v32)
        b = wl.tensor("ids", (4, 3), "I64")
        assert np.array_equal(ref.read(b.ptr, "i64", (4, 3)), t["ids"])
        with pytest.raises(WeightError, match=r"expected dtype F32, found BF16.*n\.bf16.*model\.safetensors"):
            wl.tensor("n.bf16", dtypes="F32")
        with pytest.raises(WeightError, match=r"expected shape \[65\], found \[64\].*n\.f32"):
            wl.tensor("n.f32", (65,))
        with pytest.raises(WeightError, match=r"cannot convert I64.*\[key ids\]"):
            wl.tensor("ids", as_dtype="bf16")
        with pytest.raises(ValueError):
            wl.tensor("n.f32", as_dtype="f64")


def test_linear_errors(ref, ckpt, tmp_path, rng):
    ck, t = ckpt
    wl = WeightLoader(ref, ck, progress=False)
    file_of = ck.file_of
    with pytest.raises(WeightError) as e:
        wl.linear("fp8b", N, K + 128)
    assert "expected shape [200, 448], found [200, 320]" in str(e.value) and file_of("fp8b.weight") in str(e.value)
    with pytest.raises(WeightError, match=r"expected shape \[200, 320\], found \[200, 160\].*\[key nv\.weight\]"):
        wl.linear("nv", N, 2 * K)                       # packed: [n, k/2]
    with pytest.raises(WeightError, match=r"format bf16 or fp8_block, found mxfp4.*mx\.weight"):
        wl.linear("mx", N, K, allow=("bf16", "fp8_block"))
    with pytest.raises(WeightError, match=r"not found.*\[key nope\.weight\]"):
        wl.linear("nope", N, K)
    bad = {
        "noscale.weight": t["fp8b.weight"],
        "badscale.weight": t["fp8b.weight"], "badscale.weight_scale_inv": np.ones((2, 2), np.float32),
        "bf16scale.weight": t["fp8b.weight"], "bf16scale.weight_scale_inv": np.ones((2, 3), BF16),
        "rowscale.weight": t["fp8b.weight"], "rowscale.weight_scale": np.ones((7,), np.float32),
        "nvbad.weight": t["nv.weight"], "nvbad.weight_scale": t["nv.weight_scale"][:, :10],
        "nvbad.weight_scale_2": t["nv.weight_scale_2"],
        "nv2.weight": t["nv.weight"], "nv2.weight_scale": t["nv.weight_scale"],
        "nv2.weight_scale_2": np.ones((2,), np.float32),
        "fp4.weight": t["nv.weight"],
        "vec.weight": np.ones((4,), BF16), "i32.weight": np.ones((4, 4), np.int32),
    }
    write_safetensors(tmp_path / "bad" / "model.safetensors", bad)
    wl = WeightLoader(ref, tmp_path / "bad", progress=False)
    cases = [("noscale", "without a scale.*noscale\\.weight"),
             ("badscale", "expected shape \\[2, 3\\], found \\[2, 2\\].*badscale\\.weight_scale_inv"),
             ("bf16scale", "expected dtype F32 or F8_E8M0, found BF16.*bf16scale\\.weight_scale_inv"),
             ("rowscale", "expected weight_scale of shape.*found \\[7\\].*rowscale\\.weight_scale"),
             ("nvbad", "expected shape \\[200, 20\\], found \\[200, 10\\].*nvbad\\.weight_scale"),
             ("nv2", "expected a scalar.*nv2\\.weight_scale_2"),
             ("fp4", "packed FP4 weight.*fp4\\.weight"),
             ("vec", "2-D projection weight.*vec\\.weight"),
             ("i32", "unsupported projection weight dtype I32.*i32\\.weight")]
    for name, msg in cases:
        with pytest.raises(WeightError, match=msg + ".*model\\.safetensors"):
            wl.linear(name, N, K)


# -- info ------------------------------------------------------------------------------------------
def _v3_tiny(tmp_path, rng):
    """A DeepSeek-V3-shaped checkpoint: 1 main layer, MTP at model.layers.1 with fp8 blocks and 4 experts."""
    D, V, E = 64, 96, 4
    cfg = {"model_type": "deepseek_v3", "hidden_size": D, "vocab_size": V, "num_hidden_layers": 1,
           "num_attention_heads": 2, "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
           "qk_rope_head_dim": 8, "v_head_dim": 16, "moe_intermediate_size": 32, "n_routed_experts": E,
           "num_experts_per_tok": 2, "first_k_dense_replace": 0, "n_group": 1, "topk_group": 1,
           "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    p = "model.layers.1."
    t = {"model.embed_tokens.weight": np.zeros((V, D), BF16), "lm_head.weight": np.zeros((V, D), BF16),
         "model.layers.0.input_layernorm.weight": np.ones(D, BF16),
         p + "embed_tokens.weight": np.zeros((V, D), BF16), p + "shared_head.head.weight": np.zeros((V, D), BF16),
         p + "enorm.weight": np.ones(D, BF16), p + "hnorm.weight": np.ones(D, BF16),
         p + "eh_proj.weight": np.zeros((D, 2 * D), BF16), p + "mlp.gate.weight": np.zeros((E, D), BF16),
         p + "mlp.gate.e_score_correction_bias": np.zeros(E, np.float32)}
    for name, (n, k) in {"self_attn.q_a_proj": (32, D), "self_attn.o_proj": (D, 32),
                         "mlp.shared_experts.up_proj": (32, D)}.items():
        t[p + name + ".weight"], t[p + name + ".weight_scale_inv"] = qh.quant_fp8_block(_w(rng, n, k))
    for e in range(E):
        for name, (n, k) in {"gate_proj": (32, D), "down_proj": (D, 32)}.items():
            key = f"{p}mlp.experts.{e}.{name}"
            t[key + ".weight"], t[key + ".weight_scale_inv"] = qh.quant_fp8_block(_w(rng, n, k))
    write_checkpoint(tmp_path, t, config=cfg, shards=2)
    return t, p


def test_describe_deepseek_v3(tmp_path, rng):
    t, p = _v3_tiny(tmp_path, rng)
    d = describe(tmp_path)
    assert (d["family"], d["mtp_prefix"], d["hidden_size"], d["routed_experts"], d["experts_per_token"]) == \
        ("deepseek_v3", p, 64, 4, 2)
    assert d["formats"] == {"bf16": 2, "fp8_block": 3 + 8}          # eh_proj + router; the copies are skipped
    assert d["embed_key"] == "model.embed_tokens.weight" and d["head_key"] == "lm_head.weight"
    mtp = {k: a for k, a in t.items() if k.startswith(p)}
    assert d["mtp_bytes"] == sum(a.nbytes for a in mtp.values()) and d["mtp_tensors"] == len(mtp)
    expert = sum(a.nbytes for k, a in mtp.items() if ".experts.0." in k)
    dense = sum(a.nbytes for k, a in mtp.items() if ".experts." not in k and "embed_tokens" not in k
                and "shared_head.head" not in k)
    assert d["step_breakdown"] == {"embedding_row": 64 * 2, "mtp_layer_without_experts": dense,
                                   "routed_experts": 2 * expert, "lm_head": 96 * 64 * 2}
    assert d["bytes_per_draft_step"] == 128 + dense + 2 * expert + 96 * 64 * 2
    text = format_info(d)
    assert "deepseek_v3" in text and "fp8_block x11" in text and "draft step" in text


def test_describe_v4_and_qwen(tmp_path, rng):
    D, V = 64, 50
    v4 = {"model_type": "deepseek_v4", "hidden_size": D, "vocab_size": V, "num_hidden_layers": 2,
          "num_attention_heads": 2, "head_dim": 64, "q_lora_rank": 32, "o_groups": 1, "o_lora_rank": 32,
          "moe_intermediate_size": 32, "n_routed_experts": 2, "num_experts_per_tok": 1, "hc_mult": 2}
    t = {"embed.weight": np.zeros((V, D), BF16), "head.weight": np.zeros((V, D), BF16),
         "mtp.0.hc_head_fn": np.zeros((2, 2 * D), np.float32), "mtp.0.norm.weight": np.ones(D, BF16)}
    t["mtp.0.e_proj.weight"], t["mtp.0.e_proj.scale"] = qh.quant_fp8_block_e8m0(_w(rng, D, D))
    for e in range(2):
        t[f"mtp.0.ffn.experts.{e}.w1.weight"], t[f"mtp.0.ffn.experts.{e}.w1.scale"] = qh.quant_mxfp4(_w(rng, 32, D))
    write_checkpoint(tmp_path / "v4", t, config=v4)
    d = describe(tmp_path / "v4")
    assert d["family"] == "deepseek_v4" and d["formats"] == {"fp8_block_e8m0": 1, "mxfp4": 2}
    assert d["embed_key"] == "embed.weight" and d["head_key"] == "head.weight"
    assert d["step_breakdown"]["routed_experts"] == 32 * 32 + 32 * 2

    qw = {"model_type": "qwen3_next", "hidden_size": D, "vocab_size": V, "num_hidden_layers": 4,
          "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "intermediate_size": 48,
          "tie_word_embeddings": True}
    t = {"model.embed_tokens.weight": np.zeros((V, D), BF16), "mtp.norm.weight": np.ones(D, BF16)}
    p, bs, s2 = qh.quant_nvfp4(_w(rng, 48, D))
    t["mtp.layers.0.mlp.up_proj.weight"], t["mtp.layers.0.mlp.up_proj.weight_scale"] = p, bs
    t["mtp.layers.0.mlp.up_proj.weight_scale_2"] = np.array(s2, np.float32)
    t["mtp.fc.weight"] = np.zeros((D, 2 * D), FP8)
    t["mtp.fc.weight_scale"] = np.ones((), np.float32)
    write_checkpoint(tmp_path / "qw", t, config=qw)
    d = describe(tmp_path / "qw")
    assert d["family"] == "qwen3_next" and d["formats"] == {"fp8_row": 1, "nvfp4": 1}
    assert d["routed_experts"] == 0 and d["head_key"] == "model.embed_tokens.weight"   # tied
    assert "dense FFN" in format_info(d)
    write_checkpoint(tmp_path / "none", {"model.embed_tokens.weight": np.zeros((V, D), BF16)}, config=qw)
    with pytest.raises(WeightError, match="no MTP tensors under 'mtp.'"):
        describe(tmp_path / "none")
