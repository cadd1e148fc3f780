"""pagellm's quick GGUF header reader reads what gguf-py's GGUFReader reads (metadata of every
value type, tensors of plain and block types, their views of the file), except that a string
array is kept as its length; and it refuses what is not a whole GGUF file."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import quantize

from pagellm.loader.gguf_file import GGUFFile


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "small.gguf"
    w = GGUFWriter(path, "llama")
    w.add_uint8("t.u8", 7)
    w.add_int8("t.i8", -7)
    w.add_uint16("t.u16", 65000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 1e-5)
    w.add_uint64("t.u64", 2 ** 63 + 5)
    w.add_int64("t.i64", -(2 ** 62))
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo")
    w.add_array("t.ints", [1, 2, 3])
    w.add_array("t.floats", [0.5, 0.25])
    w.add_array("t.strings", ["a", "bb", "ccc", ""])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((4, 8)).astype(np.float16))
    w.add_tensor("q8", quantize(rng.standard_normal((2, 64)).astype(np.float32), T.Q8_0), raw_dtype=T.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_reads_what_gguf_py_reads(small_gguf):
    ref, ours = GGUFReader(small_gguf), GGUFFile(str(small_gguf))
    keys = [k for k in ref.fields if not k.startswith("GGUF.")]  # GGUFReader's own header entries
    assert keys == list(ours.fields)
    for key in keys:
        theirs, mine = ref.fields[key], ours.fields[key]
        assert theirs.types == mine.types, key
        if theirs.types == [GGUFValueType.ARRAY, GGUFValueType.STRING]:
            assert mine.value == len(theirs.data) == 4
        else:
            assert theirs.contents() == mine.contents(), key
    assert [t.name for t in ref.tensors] == [t.name for t in ours.tensors] == ["f32", "f16", "q8"]
    for a, b in zip(ref.tensors, ours.tensors):
        assert a.tensor_type == b.tensor_type and list(a.shape) == list(b.shape)
        assert a.data_offset == b.data_offset and a.n_bytes == b.n_bytes
        assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data), a.name


def test_refuses_what_is_not_a_whole_gguf(small_gguf, tmp_path):
    data = small_gguf.read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUX" + data[4:])
    with pytest.raises(ValueError, match="magic"):
        GGUFFile(str(bad))
    bad.write_bytes(data[:4] + (2).to_bytes(4, "big") + data[8:])
    with pytest.raises(ValueError, match="other byte order"):
        GGUFFile(str(bad))
    bad.write_bytes(data[:200])  # cut inside the metadata
    with pytest.raises(Exception):
        GGUFFile(str(bad))
    last = GGUFFile(str(small_gguf)).tensors[-1]
    bad.write_bytes(data[:last.data_offset + 10])  # cut inside the last tensor: its view comes back short
    cut = GGUFFile(str(bad)).tensors[-1]
    assert cut.data.nbytes == 10 < cut.n_bytes  # (open_gguf refuses such a file, naming the tensor)
