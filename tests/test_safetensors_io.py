"""safetensors reading/writing: round trips for every dtype, sharding, and precise errors."""
import json
import struct

import ml_dtypes
import numpy as np
import pytest

from mtp_cupy.errors import WeightError
from mtp_cupy.runtime.dtypes import BF16, E8M0, FP8
from mtp_cupy.weights.safetensors_io import DTYPES, INDEX_NAME, Checkpoint
from mtp_cupy.weights.writer import dtype_name, write_checkpoint, write_config, write_safetensors


def _random(rng, name, shape):
    dt = DTYPES[name]
    if name == "BOOL":
        return rng.integers(0, 2, shape).astype(bool)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, shape, dtype=dt, endpoint=True)
    if name == "F8_E8M0":
        return rng.integers(0, 255, shape).astype(np.uint8).view(E8M0)   # 255 is NaN: leave it out
    return (rng.standard_normal(shape) * 8).astype(np.float32).clip(-400, 400).astype(dt)


def _raw_file(path, header: dict, data: bytes, hlen: int | None = None):
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob) if hlen is None else hlen) + blob + data)
    return path


def test_round_trip_every_dtype(tmp_path, rng):
    tensors = {f"t.{name.lower()}": _random(rng, name, (3, 5)) for name in DTYPES}
    tensors["scalar"] = np.array(rng.standard_normal(), np.float32)
    tensors["empty"] = np.zeros((0, 4), BF16)
    tensors["odd"] = _random(rng, "U8", (7,))          # forces unaligned neighbours if layout were naive
    write_safetensors(tmp_path / "x.safetensors", tensors, metadata={"format": "pt"})
    ck = Checkpoint(tmp_path / "x.safetensors")
    assert ck.keys() == sorted(tensors)
    for k, a in tensors.items():
        info = ck.info(k)
        assert info.dtype == dtype_name(a) and info.shape == a.shape and info.nbytes == a.nbytes
        assert info.file == "x.safetensors" and info.offset % a.dtype.itemsize == 0
        got = ck.numpy(k)
        assert got.dtype == a.dtype and got.shape == a.shape
        assert ck.raw(k).tobytes() == a.tobytes()
    assert ck.numpy("t.bf16").dtype == BF16 and ck.numpy("t.f8_e4m3").dtype == FP8
    assert ck.numpy("t.f8_e8m0").dtype == np.dtype(ml_dtypes.float8_e8m0fnu)
    assert ck.nbytes_total() == sum(a.nbytes for a in tensors.values())
    assert ck.nbytes_total("t.") == sum(a.nbytes for k, a in tensors.items() if k.startswith("t."))


def test_interop_with_safetensors_torch(tmp_path, rng):
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file, save_file
    w = _random(rng, "F8_E4M3", (4, 6))
    s = _random(rng, "F8_E8M0", (2, 3))
    b = _random(rng, "BF16", (5,))
    write_safetensors(tmp_path / "ours.safetensors", {"w": w, "s": s, "b": b})
    theirs = load_file(tmp_path / "ours.safetensors")
    assert theirs["w"].dtype == torch.float8_e4m3fn and theirs["s"].dtype == torch.float8_e8m0fnu
    for k, a in (("w", w), ("s", s), ("b", b)):
        assert theirs[k].view(torch.uint8).numpy().tobytes() == a.tobytes()
    # the other way round: safetensors' own layout (unaligned f8 after bf16) reads back identically
    save_file({k: theirs[k] for k in theirs}, tmp_path / "theirs.safetensors")
    ck = Checkpoint(tmp_path / "theirs.safetensors")
    for k, a in (("w", w), ("s", s), ("b", b)):
        assert ck.numpy(k).tobytes() == a.tobytes() and ck.numpy(k).dtype == a.dtype


def test_sharded_index(tmp_path, rng):
    tensors = {f"model.layers.{i}.w": _random(rng, "BF16", (4, 8)) for i in range(7)}
    tensors["lm_head.weight"] = _random(rng, "F32", (3, 8))
    write_checkpoint(tmp_path, tensors, config={"model_type": "x"}, shards=3)
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert len(set(index["weight_map"].values())) == 3
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in tensors.values())
    ck = Checkpoint(tmp_path)
    ck.validate()
    assert ck.keys() == sorted(tensors) and len(ck.files) == 3
    for k, a in tensors.items():
        assert ck.info(k).file == index["weight_map"][k]
        assert ck.get(k, a.shape, dtype_name(a)).tobytes() == a.tobytes()
    assert (tmp_path / "config.json").is_file()
    write_checkpoint(tmp_path, {"only": np.ones(3, np.float32)})       # rewritten unsharded: index dropped
    assert Checkpoint(tmp_path).keys() == ["only"]


def test_directory_without_index(tmp_path, rng):
    write_safetensors(tmp_path / "a.safetensors", {"x": _random(rng, "F32", (2,))})
    write_safetensors(tmp_path / "b.safetensors", {"y": _random(rng, "I64", (2,))})
    ck = Checkpoint(tmp_path)
    assert ck.keys() == ["x", "y"] and ck.info("y").file == "b.safetensors"
    write_safetensors(tmp_path / "c.safetensors", {"x": _random(rng, "F32", (2,))})
    with pytest.raises(WeightError, match=r"two files.*\[key x\].*c\.safetensors"):
        Checkpoint(tmp_path)


def test_get_checks_shape_and_dtype(tmp_path, rng):
    write_safetensors(tmp_path / "m.safetensors", {"a.weight": _random(rng, "BF16", (4, 6))})
    ck = Checkpoint(tmp_path / "m.safetensors")
    assert ck.get("a.weight", (4, None), ("BF16", "F16")).shape == (4, 6)
    with pytest.raises(WeightError) as e:
        ck.get("a.weight", (4, 7))
    assert "expected shape [4, 7], found [4, 6]" in str(e.value)
    assert e.value.key == "a.weight" and e.value.file == "m.safetensors" and "m.safetensors" in str(e.value)
    with pytest.raises(WeightError, match=r"expected dtype F32, found BF16.*a\.weight.*m\.safetensors"):
        ck.get("a.weight", dtypes="F32")
    with pytest.raises(WeightError, match=r"expected shape \[24\]"):
        ck.get("a.weight", (24,))


def test_missing_key(tmp_path, rng):
    write_safetensors(tmp_path / "m.safetensors", {"a": _random(rng, "F32", (2,))})
    with pytest.raises(WeightError, match=r"not found.*\[key b\].*m\.safetensors"):
        Checkpoint(tmp_path / "m.safetensors").info("b")
    write_checkpoint(tmp_path / "sh", {"a": np.zeros(2, np.float32), "c": np.zeros(1, np.float32)}, shards=2)
    with pytest.raises(WeightError, match=rf"not found.*\[key b\].*{INDEX_NAME}"):
        Checkpoint(tmp_path / "sh").raw("b")


def test_truncated_file_names_the_tensor_past_the_end(tmp_path, rng):
    t = {"big": _random(rng, "F32", (16,)), "small": _random(rng, "U8", (5,))}
    p = write_safetensors(tmp_path / "m.safetensors", t)
    p.write_bytes(p.read_bytes()[:-3])                 # "small" is laid out last (1-byte elements)
    with pytest.raises(WeightError) as e:
        Checkpoint(p)
    assert "runs past the end" in str(e.value) and e.value.key == "small" and "m.safetensors" in str(e.value)


def test_truncated_shard_found_lazily(tmp_path, rng):
    t = {f"k{i}": _random(rng, "BF16", (8,)) for i in range(4)}
    write_checkpoint(tmp_path, t, shards=2)
    shard = tmp_path / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1])
    ck = Checkpoint(tmp_path)                          # headers are read on use
    assert ck.raw("k0").tobytes() == t["k0"].tobytes()
    with pytest.raises(WeightError, match=r"runs past the end.*\[key k3\].*model-00002-of-00002"):
        ck.raw("k2")
    with pytest.raises(WeightError, match="model-00002-of-00002"):
        ck.validate()


def test_header_length_past_eof(tmp_path):
    p = _raw_file(tmp_path / "m.safetensors", {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}},
                  b"\0" * 4, hlen=10_000)
    with pytest.raises(WeightError, match=r"header length 10000 runs past the end.*m\.safetensors"):
        Checkpoint(p)
    # through an index the tensor asked for is named too
    write_config(tmp_path / INDEX_NAME, {"weight_map": {"a": "m.safetensors"}})
    with pytest.raises(WeightError, match=r"header length.*\[key a\].*\[file m\.safetensors\]"):
        Checkpoint(tmp_path).info("a")
    (tmp_path / "tiny.safetensors").write_bytes(b"\1\2\3")
    with pytest.raises(WeightError, match=r"shorter than the 8-byte.*tiny\.safetensors"):
        Checkpoint(tmp_path / "tiny.safetensors")


@pytest.mark.parametrize("entry, data, msg", [
    ({"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}, 8, "runs past the end"),
    ({"dtype": "F32", "shape": [3], "data_offsets": [0, 16]}, 16, "holds 16 bytes but F32 [3] needs 12"),
    ({"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}, 16, "not an ordered range"),
    ({"dtype": "F32", "shape": [1]}, 16, "malformed header entry"),
])
def test_bad_header_entries(tmp_path, entry, data, msg):
    p = _raw_file(tmp_path / "bad.safetensors", {"w": entry}, b"\0" * data)
    with pytest.raises(WeightError) as e:
        Checkpoint(p)
    assert msg in str(e.value) and "[key w]" in str(e.value) and "bad.safetensors" in str(e.value)


def test_overlapping_ranges(tmp_path):
    h = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
         "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}
    with pytest.raises(WeightError, match=r"overlaps tensor a.*\[key b\].*ov\.safetensors"):
        Checkpoint(_raw_file(tmp_path / "ov.safetensors", h, b"\0" * 12))


def test_bad_json_header(tmp_path):
    p = tmp_path / "j.safetensors"
    p.write_bytes(struct.pack("<Q", 5) + b"{nope")
    with pytest.raises(WeightError, match=r"not valid JSON.*j\.safetensors"):
        Checkpoint(p)


def test_index_to_missing_shard_and_missing_key(tmp_path, rng):
    write_safetensors(tmp_path / "s1.safetensors", {"a": _random(rng, "F32", (2,))})
    write_config(tmp_path / INDEX_NAME, {"weight_map": {"a": "s1.safetensors", "b": "s1.safetensors",
                                                        "c": "s2.safetensors"}})
    ck = Checkpoint(tmp_path)
    assert ck.keys() == ["a", "b", "c"] and ck.has("c")
    with pytest.raises(WeightError, match=r"does not exist.*\[key c\].*\[file s2\.safetensors\]"):
        ck.info("c")
    with pytest.raises(WeightError, match=r"does not hold it.*\[key b\].*\[file s1\.safetensors\]"):
        ck.numpy("b")
    with pytest.raises(WeightError):
        ck.validate()
    (tmp_path / INDEX_NAME).write_text("{}")
    with pytest.raises(WeightError, match=rf"weight_map.*{INDEX_NAME}"):
        Checkpoint(tmp_path)


def test_missing_path_and_empty_dir(tmp_path):
    with pytest.raises(WeightError, match="does not exist"):
        Checkpoint(tmp_path / "nope")
    with pytest.raises(WeightError, match="no model.safetensors"):
        Checkpoint(tmp_path)


def test_unsupported_dtype_has_raw_bytes_only(tmp_path):
    p = _raw_file(tmp_path / "f4.safetensors", {"w": {"dtype": "F4", "shape": [4], "data_offsets": [0, 2]}},
                  b"\x21\x43")
    ck = Checkpoint(p)
    assert ck.raw("w").tobytes() == b"\x21\x43" and ck.info("w").dtype == "F4"
    with pytest.raises(WeightError, match=r"F4 has no numpy view.*\[key w\]"):
        ck.numpy("w")
