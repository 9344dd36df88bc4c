"""A GGUF file's header is read and checked before any work: a file cut anywhere, or holding a type
this version cannot read, fails with one line naming where (the tensor and its type)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hispec_decode import HiSpecModel
from hispec_decode.errors import HiSpecError
from hispec_decode.models.gguf_file import read_header


def write_gguf(path: Path) -> Path:
    from gguf import GGMLQuantizationType, GGUFWriter, quants

    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_string("general.name", "tiny")
    writer.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(40)])
    values = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    writer.add_tensor("a.weight", values)
    q = quants.quantize(values, GGMLQuantizationType.Q8_0)
    writer.add_tensor("b.weight", q, raw_shape=q.shape, raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_header_matches_the_gguf_package(tmp_path):
    from gguf import GGUFReader

    path = write_gguf(tmp_path / "x.gguf")
    header = read_header(path)
    theirs = GGUFReader(str(path))
    assert [(t.name, t.offset, t.nbytes, t.type_name) for t in header.tensors] == [
        (t.name, t.data_offset, t.n_bytes, t.tensor_type.name) for t in theirs.tensors]
    assert header.metadata["general.name"] == "tiny" and len(header.metadata["tokenizer.ggml.tokens"]) == 40


def test_a_file_cut_anywhere_is_one_clear_error(tmp_path):
    full = write_gguf(tmp_path / "x.gguf").read_bytes()
    header = read_header(tmp_path / "x.gguf")
    cut = tmp_path / "cut.gguf"
    for n in sorted({0, 3, 4, 7, 8, 20, 24, 30, 60, 100, 150, 200, header.data_offset - 1, header.data_offset,
                     header.tensors[1].offset + 5,
                     header.tensors[1].offset + header.tensors[1].nbytes - 1}):
        cut.write_bytes(full[:n])
        with pytest.raises(HiSpecError) as err:
            read_header(cut)
        message = str(err.value)
        assert "\n" not in message and str(cut) in message
        if n >= header.data_offset:  # cut in the data: the tensor and its type are named
            name, kind = ("a.weight", "F32") if n < header.tensors[1].offset else ("b.weight", "Q8_0")
            assert f"tensor {name!r} ({kind})" in message, message


def test_an_unknown_tensor_type_is_named(tmp_path):
    path = write_gguf(tmp_path / "x.gguf")
    data = bytearray(path.read_bytes())
    header = read_header(path)
    # the last tensor record ends with its type (u32) and offset (u64), just before the padding
    record_end = data.rindex(b"b.weight") + len(b"b.weight") + 4 + 2 * 8
    data[record_end : record_end + 4] = (99).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(HiSpecError, match="tensor 'b.weight' of ggml type 99, which this version cannot read"):
        read_header(path)
    assert header.tensors[1].type_name == "Q8_0"


@pytest.mark.parametrize("cut", [100, 1_000_000, 50_000_000])
def test_a_truncated_packaged_gguf_fails_in_one_line(cut, tmp_path, capsys):
    """The embedded model's own file, cut in its header (100 bytes, 1 MB) or in its tensor data (50 MB)."""
    from hispec_decode.models.loading import DEFAULT_BASE
    from hispec_decode.tools import generate as generate_cli

    source = DEFAULT_BASE.gguf(tmp_path)
    path = tmp_path / "t.gguf"
    with open(source, "rb") as f:
        path.write_bytes(f.read(cut))
    with pytest.raises(HiSpecError, match="is cut"):
        HiSpecModel.from_pretrained(str(path))
    assert generate_cli.main(["--base", str(path), "--prompt", "hi", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is cut" in err[0] and "Traceback" not in err[0], err
