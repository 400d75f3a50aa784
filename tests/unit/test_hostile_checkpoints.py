"""A checkpoint is untrusted input: a crafted or broken safetensors file, index or pickle gives
`CheckpointError` naming the file and what is wrong, never another exception (which would stop
an engine that could load as usual), never bytes outside a tensor's own range, never unbounded
memory.  Real files on disk; Hypothesis writes headers of every shape."""

from __future__ import annotations

import json
import os
import re
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_dedup.checkpoint.loading import changed_files, checkpoint_files, checkpoint_keys
from vllm_dedup.checkpoint.manifest import ManifestCache, file_manifest
from vllm_dedup.checkpoint import manifest as manifest_module
from vllm_dedup.checkpoint.readers import SafetensorsFile, TorchFile, index_shards
from vllm_dedup.errors import CheckpointError


def _write(path, header, data: bytes = b"\0" * 64) -> None:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def _entry(begin=0, end=64, shape=(16,), dtype="F32"):  # default: the whole 64-byte data section
    return {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, end]}


CRAFTED = {
    "a float offset": ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8.0]}}, "data_offsets"),
    "string offsets": ({"w": {"dtype": "F32", "shape": [2], "data_offsets": ["0", "8"]}}, "data_offsets"),
    "a string dimension": ({"w": {"dtype": "F32", "shape": ["2"], "data_offsets": [0, 8]}}, "shape"),
    "negative dimensions": ({"w": {"dtype": "F32", "shape": [-2, -1], "data_offsets": [0, 8]}}, "shape"),
    "a boolean dimension": ({"w": {"dtype": "F32", "shape": [True, 2], "data_offsets": [0, 8]}}, "shape"),
    "shape not a list": ({"w": {"dtype": "F32", "shape": 2, "data_offsets": [0, 8]}}, "shape"),
    "three offsets": ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8, 9]}}, "data_offsets"),
    "entry not an object": ({"w": [1, 2]}, "malformed"),
    "unknown dtype": ({"w": _entry(dtype="F13")}, "which vllm-dedup does not read"),
    "a sub-byte dtype": ({"w": _entry(0, 64, (128,), dtype="F4")}, "which vllm-dedup does not read"),
    "a gap before a tensor": ({"w": _entry(8, 64, (14,))}, "8 bytes before tensor 'w' belong to no tensor"),
    "bytes after the last": ({"w": _entry(0, 60, (15,))}, "the last 4 bytes of the data section belong to no tensor"),
    "metadata not a map": ({"__metadata__": 5, "w": _entry()}, "__metadata__ is not a map"),
    "metadata of numbers": ({"__metadata__": {"format": 1}, "w": _entry()}, "__metadata__ is not a map"),
    "NaN in the metadata": (b'{"__metadata__": {"x": NaN}, "w": {"dtype": "F32", "shape": [16], '
                            b'"data_offsets": [0, 64]}}', "NaN is not a number JSON allows"),
    "a UTF-16 header": ('{"w": {"dtype": "F32", "shape": [16], "data_offsets": [0, 64]}}'.encode("utf-16"), "JSON"),
    "a byte-order mark": (b'\xef\xbb\xbf{"w": {"dtype": "F32", "shape": [16], "data_offsets": [0, 64]}}', "JSON"),
    "a lone surrogate in a name": (b'{"w\\ud800": {"dtype": "F32", "shape": [16], "data_offsets": [0, 64]}}',
                                   "not valid Unicode"),
    "end before begin": ({"w": _entry(8, 0)}, "does not fit"),
    "past the data": ({"w": _entry(60, 68)}, "does not fit"),
    "size not the shape's": ({"w": _entry(0, 12)}, "does not fit"),
    "overlapping tensors": ({"a": _entry(0, 16, (4,)), "b": _entry(8, 24, (4,))}, "overlap"),
    "a tensor inside another": ({"a": _entry(0, 32, (8,)), "b": _entry(8, 16, (2,))}, "overlap"),
    "a huge rank": ({"w": {"dtype": "F32", "shape": [1] * 65, "data_offsets": [0, 4]}}, "shape"),
    "a huge shape": ({"w": {"dtype": "F32", "shape": [2] * 63, "data_offsets": [0, 8]}}, "does not fit"),
    "a shape past 64 bits": ({"w": {"dtype": "F32", "shape": [2] * 64, "data_offsets": [0, 8]}}, "overflows 64 bits"),
    "past 64 bits, then 0": ({"w": {"dtype": "F32", "shape": [2**62, 2**62, 0], "data_offsets": [0, 0]}},
                             "overflows 64 bits"),
    "a dimension past 64 bits and 0": ({"w": {"dtype": "F32", "shape": [2**70, 0], "data_offsets": [0, 0]}},
                                       "overflows 64 bits"),
    "a repeated name": (b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, '
                        b'"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}', "repeated"),
    "deeply nested": (b"[" * 100_000, "JSON"),
    "not an object": (b"[1, 2]", "not a JSON object"),
}


@pytest.mark.parametrize("case", CRAFTED)
def test_a_crafted_header_is_a_checkpoint_error_naming_the_file(tmp_path, case):
    header, words = CRAFTED[case]
    path = tmp_path / "model.safetensors"
    _write(path, header)
    with pytest.raises(CheckpointError, match=words) as caught:
        SafetensorsFile(path)
    assert caught.value.path == str(path)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(
    st.text(max_size=4),
    st.one_of(st.fixed_dictionaries({
        "dtype": st.sampled_from(["F32", "BF16", "U8", "I64", "F8_E4M3", "X"]),
        "shape": st.one_of(st.lists(st.one_of(st.integers(-2, 40), st.floats(0, 4), st.text(max_size=1)), max_size=4),
                           st.integers()),
        "data_offsets": st.lists(st.one_of(st.integers(-4, 80), st.floats(0, 80)), max_size=3)}),
        st.integers(), st.none()),
    max_size=4))
def test_any_header_is_read_within_its_file_or_refused(tmp_path, header):
    path = tmp_path / "model.safetensors"
    _write(path, header)
    try:
        f = SafetensorsFile(path)
    except CheckpointError:
        return
    with f:
        spans = []
        for entry in f.entries():
            begin, end = f.byte_range(entry.name)
            assert 0 <= end - begin == entry.nbytes == len(f.data(entry.name))
            assert end <= path.stat().st_size
            spans.append((begin, end))
        reach = 0
        for begin, end in sorted(spans):  # no byte belongs to two tensors
            assert begin >= reach or begin == end
            reach = max(reach, end)


def test_a_file_shortened_after_its_header_was_read_is_an_error_not_short_bytes(tmp_path):
    path = tmp_path / "model.safetensors"
    _write(path, {"a": _entry(0, 32, (8,)), "b": _entry(32, 64, (8,))})
    with SafetensorsFile(path) as f:
        os.truncate(path, path.stat().st_size - 16)
        assert len(f.data("a")) == 32
        with pytest.raises(CheckpointError, match="past the file"):
            f.data("b")
    _write(path, {"a": _entry(0, 32, (8,))}, b"\0" * 32)
    with SafetensorsFile(path) as f:  # emptied before its first tensor is read
        os.truncate(path, 0)
        with pytest.raises(CheckpointError, match="cannot map"):
            f.data("a")


@pytest.mark.parametrize("weight_map", [None, [], {"w": 5}, {"w": "../other/model.safetensors"},
                                        {"w": "/etc/passwd"}, {"w": ".."}])
def test_an_index_naming_no_plain_file_beside_it_is_not_followed(tmp_path, weight_map):
    _write(tmp_path / "model.safetensors", {"w": _entry()})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert index_shards(tmp_path / "model.safetensors.index.json") is None
    assert checkpoint_files(tmp_path) is None  # the fast paths stand aside: the usual load decides


def test_an_index_names_its_shards(tmp_path):
    (tmp_path / "i.json").write_text(json.dumps({"weight_map": {"a": "x.safetensors", "b": "y.safetensors"}}))
    assert index_shards(tmp_path / "i.json") == {"x.safetensors", "y.safetensors"}


def test_an_expanded_tensor_in_a_pickle_is_refused_not_allocated(tmp_path):
    path = tmp_path / "pytorch_model.bin"
    torch.save({"w": torch.zeros(1).expand(1 << 20, 1 << 20)}, path)
    with pytest.raises(CheckpointError, match="views .* bytes of a 4-byte storage"):
        TorchFile(path)


class _NotATensor:
    """A class a weights-only load refuses to build."""


def test_a_pickle_holding_a_class_is_refused_in_one_line_without_torchs_advice_to_trust_it(tmp_path):
    """torch's refusal spans several lines and suggests ``weights_only=False`` or allow-listing
    the class: advice that would run an untrusted file's pickle.  The error keeps what was
    refused, on one line."""
    path = tmp_path / "pytorch_model.bin"
    torch.save({"weight": torch.ones(4), "extra": _NotATensor()}, path)
    with pytest.raises(CheckpointError) as refused:
        TorchFile(path)
    said = str(refused.value)
    assert "\n" not in said and "\x1b" not in said and "weights_only" not in said and "allowlist" not in said, said
    assert f"Unsupported global: GLOBAL {__name__}._NotATensor was not an allowed global by default" in said, said


def test_a_file_written_while_it_is_hashed_has_no_keys_and_no_cached_manifest(tmp_path, monkeypatch):
    path = tmp_path / "model.safetensors"
    _write(path, {"w": _entry()})
    hash_keys = manifest_module.content_keys

    def written_meanwhile(*args, **kwargs):
        st_ = path.stat()
        os.utime(path, ns=(st_.st_atime_ns, st_.st_mtime_ns + 10**9))
        return hash_keys(*args, **kwargs)

    monkeypatch.setattr(manifest_module, "content_keys", written_meanwhile)
    cache = ManifestCache(tmp_path / "cache")
    with pytest.raises(CheckpointError, match="changed while it was read"):
        file_manifest(path, cache)
    assert not any(p.is_file() for p in (tmp_path / "cache").rglob("*"))


TRUNCATED_WHILE_HASHED = """
import os, sys
from pathlib import Path
from vllm_dedup.checkpoint import manifest
from vllm_dedup.errors import CheckpointError
path = Path(sys.argv[1])

def saved_again_meanwhile(chunks):  # after its first MiB: open(path, "wb") truncates first
    for i, chunk in enumerate(chunks):
        yield chunk
        if i == 0:
            os.truncate(path, 0)

key = manifest.source_key_of_chunks
manifest.source_key_of_chunks = lambda chunks, *rest: key(saved_again_meanwhile(chunks), *rest)
try:
    manifest.file_manifest(path, manifest.ManifestCache(None))
except CheckpointError as e:
    print("CheckpointError:", e)
"""


def test_a_file_shortened_while_it_is_hashed_is_an_error_not_a_crash(tmp_path):
    """A mapping read past the file's new end would kill the process with SIGBUS (Note
    [reading, not mapping, to hash]); so the hashing runs in a child here."""
    import subprocess
    import sys

    path = tmp_path / "model.safetensors"
    _write(path, {"w": _entry(0, 4 << 20, (1 << 20,))}, b"\1" * (4 << 20))
    child = subprocess.run([sys.executable, "-c", TRUNCATED_WHILE_HASHED, str(path)], capture_output=True,
                           text=True, timeout=60)
    assert child.returncode == 0, (child.returncode, child.stderr[-2000:])
    assert "CheckpointError:" in child.stdout and "shortened while it was read" in child.stdout, child.stdout


def test_changed_files_names_a_file_rewritten_since_its_keys_were_taken(tmp_path):
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    _write(a, {"w": _entry()})
    _write(b, {"v": _entry()})
    *_, identities = checkpoint_keys([a, b], ManifestCache(None))
    assert changed_files(identities) == []
    _write(b, {"v": _entry()}, b"\1" * 64)
    st_ = b.stat()
    os.utime(b, ns=(st_.st_atime_ns, st_.st_mtime_ns + 10**9))
    assert changed_files(identities) == [b]


def test_a_fifo_named_as_a_weight_file_is_refused_not_waited_on(tmp_path):
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)  # opened for reading, it would block until a writer came
    with pytest.raises(CheckpointError, match="not a regular file"):
        file_manifest(fifo, ManifestCache(None))
    with pytest.raises(CheckpointError, match="not a regular file"):
        SafetensorsFile(fifo)  # as an engine's usual load opens its files (`fast_path.RecordedLoad`)
    (tmp_path / "shard.safetensors").mkdir()
    with pytest.raises(CheckpointError, match="a folder"):
        file_manifest(tmp_path / "shard.safetensors", ManifestCache(None))


def test_hashing_in_many_threads_opens_the_file_once(tmp_path):
    """`WeightFile.chunks` in `content_keys`' threads: one descriptor, closed with the file
    (two threads opening it at once left one open, 2 leaks in 30 runs)."""
    path = tmp_path / "model.safetensors"
    _write(path, {f"t{i}": _entry(64 * i, 64 * (i + 1), (16,)) for i in range(64)}, b"\1" * 64 * 64)
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(30):
        file_manifest(path, ManifestCache(None), threads=8)
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_header_of_many_names_one_repeated_is_refused_at_once(tmp_path):
    """Finding the repeated name once was quadratic in the names: 40,000 took 18 s."""
    import time

    names = {f"t{i}": _entry(0, 0, (0,)) for i in range(40_000)}
    raw = json.dumps(names)[:-1] + ', "t0": ' + json.dumps(_entry(0, 0, (0,))) + "}"
    path = tmp_path / "model.safetensors"
    _write(path, raw.encode(), b"")
    start = time.monotonic()
    with pytest.raises(CheckpointError, match="'t0'"):
        SafetensorsFile(path)
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("shape", [[0], [3, 0], [1, 0, 7]])
def test_an_empty_tensor_of_any_shape_is_read(tmp_path, shape):
    """safetensors writes them: a zero dimension makes a tensor of no bytes, in a file of no
    tensor data at all."""
    from safetensors.torch import save_file

    path = tmp_path / "model.safetensors"
    save_file({"e": torch.zeros(shape)}, path)
    with SafetensorsFile(path) as f:
        assert [(e.name, e.shape, e.nbytes) for e in f.entries()] == [("e", tuple(shape), 0)]


def test_an_index_whose_values_are_not_names_is_not_followed(tmp_path):
    (tmp_path / "i.json").write_text(json.dumps({"weight_map": {"w": ["model.safetensors"]}}))
    assert index_shards(tmp_path / "i.json") is None


def test_a_file_replaced_since_its_keys_were_taken_is_not_read_by_a_replay(tmp_path):
    """`read_tensors` with the identities `checkpoint_keys` took: the file now at the path is
    another (a download replacing it by rename), so its bytes are not mixed with mapped ones."""
    from vllm_dedup.checkpoint.loading import read_tensors

    path = tmp_path / "model.safetensors"
    _write(path, {"w": _entry()}, b"\1" * 64)
    keys, where, _, identities = checkpoint_keys([path], ManifestCache(None))
    assert [n for n, _ in read_tensors(["w"], where, identities)] == ["w"]
    _write(tmp_path / "new.safetensors", {"w": _entry()}, b"\2" * 64)
    os.replace(tmp_path / "new.safetensors", path)
    with pytest.raises(CheckpointError, match="changed since its keys were taken"):
        list(read_tensors(["w"], where, identities))


def test_a_file_replaced_after_it_was_opened_is_read_and_named_as_the_version_opened(tmp_path):
    """Note [one descriptor per weight file]: header, bytes (mapped and read) and identity all
    come from the file as opened, even once a rename put another file of the same header at
    its path; the path's identity is then the other's, and the file opened, unlinked by the
    rename, has a new ctime: a replay checking it declines."""
    from vllm_dedup.checkpoint.manifest import FileIdentity

    path = tmp_path / "model.safetensors"
    _write(path, {"w": _entry(0, 64, (16,))}, b"\1" * 64)
    with SafetensorsFile(path) as f:
        opened = FileIdentity.of(path, f.header())
        _write(tmp_path / "new.safetensors", {"w": _entry(0, 64, (16,))}, b"\2" * 64)
        os.replace(tmp_path / "new.safetensors", path)
        assert bytes(f.data("w")) == b"\1" * 64
        assert b"".join(bytes(c) for c in f.chunks("w")) == b"\1" * 64
        now = FileIdentity.of(path, f.header(), f.descriptor())  # unlinked: a new ctime, so "changed"
        assert (now.dev, now.ino, now.size) == (opened.dev, opened.ino, opened.size)
        assert FileIdentity.of(path, f.header()).ino != opened.ino


def test_a_closed_file_is_never_opened_again_by_its_path(tmp_path):
    """After `close`, the path may name another file: reading is an error, not a new open."""
    path = tmp_path / "model.safetensors"
    _write(path, {"w": _entry(0, 64, (16,))}, b"\1" * 64)
    f = SafetensorsFile(path)
    f.close()
    for read in (lambda: f.data("w"), lambda: list(f.chunks("w")), f.descriptor):
        with pytest.raises(CheckpointError, match="closed"):
            read()


def test_views_of_one_storage_in_a_pickle_are_each_read_and_never_copied_past_the_file(tmp_path):
    x = torch.arange(16, dtype=torch.float32)
    path = tmp_path / "pytorch_model.bin"
    torch.save({"a": x, "tied": x, "grid": x.view(4, 4), "t": x.view(4, 4).t()}, path)
    with TorchFile(path) as f:
        assert [e.name for e in f.entries()] == ["a", "grid", "t"]  # the tie once, each other view
        assert bytes(f.data("t")) == x.view(4, 4).t().contiguous().numpy().tobytes()
    big = torch.zeros(256, 256)  # 256 KiB, saved once; 20 transposed views would copy 5 MiB
    torch.save({f"t{i}": big[i:].t() for i in range(20)}, path)
    with pytest.raises(CheckpointError, match="not contiguous add up to more than the file"):
        TorchFile(path)
    # Contiguous but overlapping slices: nothing is copied, yet each would be hashed in full.
    torch.save({f"s{i}": big.view(-1)[i * 64:] for i in range(20)}, path)
    with pytest.raises(CheckpointError, match="more than 4 times the file's"):
        TorchFile(path)


NOT_PLAIN = {
    "sparse": (lambda: torch.eye(4).to_sparse(), "not dense"),
    "sparse CSR": (lambda: torch.eye(4).to_sparse_csr(), "not dense"),
    "quantized": (lambda: torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8), "quantized"),
    "on meta": (lambda: torch.empty(4, device="meta"), "on meta"),
    "a conjugate view": (lambda: torch.ones(4, dtype=torch.complex64).conj(), "conjugate or negative"),
}


@pytest.mark.parametrize("case", NOT_PLAIN)
def test_a_pickled_tensor_whose_bytes_are_not_its_values_is_refused(tmp_path, case):
    """Its bytes alone would give another tensor's key (a quantized tensor without its scale)
    or no bytes at all: a CheckpointError, never a raw exception or a misread."""
    make, words = NOT_PLAIN[case]
    path = tmp_path / "model.pt"
    import warnings

    with warnings.catch_warnings():  # quantized tensors are deprecated: still loadable, so still refused
        warnings.simplefilter("ignore")
        torch.save({"w": make(), "b": torch.ones(2)}, path)
        with pytest.raises(CheckpointError, match=words) as caught:
            TorchFile(path)
    assert caught.value.path == str(path)


@pytest.mark.parametrize("reader", ["TorchFile", "GGUFFile"])
def test_a_file_replaced_while_a_reader_opens_it_by_path_has_no_keys_and_no_cached_manifest(tmp_path, monkeypatch,
                                                                                          reader):
    """Pickle and GGUF readers open the path themselves (no descriptor of ours): a file saved by
    rename right after their open would otherwise be keyed with the old bytes under the new
    file's identity, and that manifest served to every later scan and engine."""
    from vllm_dedup.checkpoint import readers

    if reader == "TorchFile":
        path, new = tmp_path / "model.pt", tmp_path / "new.pt"
        torch.save({"w": torch.ones(64)}, path)
        torch.save({"w": torch.zeros(64)}, new)
    else:
        import gguf

        path, new = tmp_path / "model.gguf", tmp_path / "new.gguf"
        for where, value in ((path, 1.0), (new, 0.0)):
            writer = gguf.GGUFWriter(str(where), "llama")
            writer.add_tensor("w", torch.full((64,), value).numpy())
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
            writer.close()
    cls = getattr(readers, reader)
    opened = cls.__init__

    def then_replaced(self, p):
        opened(self, p)
        os.replace(new, path)

    monkeypatch.setattr(cls, "__init__", then_replaced)
    cache = ManifestCache(tmp_path / "cache")
    with pytest.raises(CheckpointError, match="changed while it was opened"):
        file_manifest(path, cache)
    assert not list((tmp_path / "cache").glob("manifests/*.json"))


@pytest.mark.parametrize("shape", ["shared", "within itself", "deep"])
def test_a_pickle_whose_containers_are_not_a_shallow_tree_is_refused_at_once(tmp_path, shape):
    """A pickle may point at one list from many places: 40 levels of ``[x, x]`` (1.9 KB) would
    be 2**40 visits walked as a tree (the walk has a budget); a list may hold itself; nesting
    has a limit (the walk does not recurse).  Each is refused in one line, in seconds."""
    import time

    x = [torch.ones(1)]
    if shape == "shared":
        for _ in range(40):
            x = [x, x]
    elif shape == "within itself":
        x.append(x)
    else:
        for _ in range(200):  # past MAX_NESTING (64); torch.save itself recurses at thousands
            x = [x]
    path = tmp_path / "model.bin"
    torch.save({"w": x}, path)
    begin = time.monotonic()
    words = {"shared": "visits over", "within itself": "lies within itself", "deep": "nest deeper than"}[shape]
    with pytest.raises(CheckpointError, match=words) as e:
        TorchFile(path)
    assert time.monotonic() - begin < 30 and "flat state_dict" in str(e.value)


@pytest.mark.parametrize("state", [{"x.y": torch.ones(2), "x": {"y": torch.zeros(2)}},
                                   {1: torch.ones(2), "1": torch.zeros(2)}])
def test_two_tensors_that_flatten_to_one_name_are_refused_not_one_dropped(tmp_path, state):
    torch.save(state, tmp_path / "model.bin")
    with pytest.raises(CheckpointError, match="flatten to the name"):
        TorchFile(tmp_path / "model.bin")


def test_an_optimizers_shared_containers_are_read_not_refused(tmp_path):
    """AdamW with two parameter groups (the usual weight-decay split) shares one ``betas``
    tuple between them, and every ``()`` is one object: a container reached twice is no fault."""
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW([{"params": [model.weight]}, {"params": [model.bias], "weight_decay": 0.0}])
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "meta": {"a": (), "b": ()}},
               tmp_path / "m.bin")
    with TorchFile(tmp_path / "m.bin") as f:
        names = [e.name for e in f.entries()]
    assert names[:2] == ["model.weight", "model.bias"] and "optimizer.state.0.exp_avg" in names


def test_a_nested_state_dict_and_tied_tensors_still_read(tmp_path):
    tied = torch.arange(4.0)
    torch.save({"state_dict": {"a": tied, "b": tied, "layers": [torch.ones(2), torch.zeros(3)]}}, tmp_path / "m.bin")
    with TorchFile(tmp_path / "m.bin") as f:
        assert [e.name for e in f.entries()] == ["state_dict.a", "state_dict.layers.0", "state_dict.layers.1"]


def test_a_header_past_safetensors_own_limit_is_refused_before_it_is_read(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", 100_000_001) + b"{}")  # safetensors: 100,000,000 bytes at most
    with pytest.raises(CheckpointError, match="over the 100000000-byte limit"):
        SafetensorsFile(path)


def test_a_dtype_safetensors_reads_but_its_save_table_lacks_is_read(tmp_path):
    """``F8_E8M0`` (MX block scales): safetensors reads it into torch's float8_e8m0fnu, though
    the private table of its save path lacks it (this reader keeps a table of its own)."""
    path = tmp_path / "model.safetensors"
    _write(path, {"s": _entry(0, 64, (8, 8), dtype="F8_E8M0")}, bytes(range(64)))
    with SafetensorsFile(path) as f:
        (entry,) = f.entries()
        assert (entry.dtype, entry.shape, entry.nbytes) == ("float8_e8m0fnu", (8, 8), 64)
        assert bytes(f.data("s")) == bytes(range(64))
    from safetensors import safe_open

    with safe_open(path, "pt") as f:  # what vLLM's iterator reads
        assert f.get_tensor("s").dtype == torch.float8_e8m0fnu


def _gguf_header(tensor_count: int, kv: bytes, kv_count: int = 1, order: str = "<") -> bytes:
    return b"GGUF" + struct.pack(order + "IQQ", 3, tensor_count, kv_count) + kv


def _gguf_array(item: int, count: int, order: str = "<") -> bytes:
    """One key ("k") whose value is an array of ``count`` items of type ``item``."""
    return struct.pack(order + "Q", 1) + b"k" + struct.pack(order + "IIQ", 9, item, count)


GGUF_CLAIMS = {  # header, what the error says
    "2**40 strings": (_gguf_header(0, _gguf_array(8, 1 << 40)), "arrays hold over"),
    "2**40 strings, big-endian": (_gguf_header(0, _gguf_array(8, 1 << 40, ">"), order=">"), "arrays hold over"),
    "two million strings": (_gguf_header(0, _gguf_array(8, (1 << 21) + 1)), "arrays hold over"),
    "three million bytes": (_gguf_header(0, _gguf_array(0, 3 << 20)), "arrays hold over"),
    "strings after an array of arrays": (
        _gguf_header(0, struct.pack("<Q", 1) + b"a" + struct.pack("<IIQ", 9, 9, 1) + struct.pack("<IQ", 0, 0)
                     + _gguf_array(8, (1 << 21) + 1), kv_count=2), "arrays hold over"),
    "2**40 keys": (_gguf_header(0, b"", 1 << 40), "the file is corrupt or crafted"),
    "2**40 tensors": (_gguf_header(1 << 40, b""), "the file is corrupt or crafted"),
    "an array past the file": (_gguf_header(0, _gguf_array(10, 1 << 21)), "runs past the end of the file"),
    "a string past the file": (_gguf_header(0, struct.pack("<Q", 1) + b"k" + struct.pack("<IQ", 8, 1 << 40)),
                               "runs past the end of the file"),
}


@pytest.mark.parametrize("case", GGUF_CLAIMS)
def test_a_gguf_whose_metadata_claims_more_than_it_holds_is_refused_before_it_is_parsed(tmp_path, case):
    """The gguf reader builds numpy objects for each element of a metadata array (about 1.6 KB
    per string): a sparse file of 32 MiB (4 KB on disk) claiming 2**40 strings took 6.4 GB and
    a minute before it failed (here 16 MiB).  Counts are checked against the file and limits first, in the
    file's byte order, through nested arrays.  Opened in a child, whose peak memory is its own."""
    import subprocess
    import sys
    import textwrap

    header, words = GGUF_CLAIMS[case]
    path = tmp_path / "model.gguf"
    with open(path, "wb") as f:
        f.write(header)
        f.truncate(16 << 20)  # zeros: strings of length 0, sparse on disk
    code = textwrap.dedent("""
        import resource, sys, time
        from pathlib import Path
        from vllm_dedup.checkpoint.readers import GGUFFile
        from vllm_dedup.errors import CheckpointError
        before, begin = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.monotonic()
        try:
            GGUFFile(Path(sys.argv[1]))
            print("read")
        except CheckpointError as e:
            print(e)
        print(round(time.monotonic() - begin, 1), (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) >> 10)
    """)
    proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    said, figures = proc.stdout.strip().splitlines()[-2:]
    seconds, grown_mib = figures.split()
    assert words in said, said
    assert float(seconds) < 20 and int(grown_mib) < 100, (seconds, grown_mib)


@pytest.mark.parametrize("endianess", ["LITTLE", "BIG"])
def test_a_gguf_of_either_byte_order_with_nested_and_empty_arrays_is_read(tmp_path, endianess):
    import gguf

    from vllm_dedup.checkpoint.readers import GGUFFile

    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(str(path), "llama", endianess=getattr(gguf.GGUFEndian, endianess))
    writer.add_array("tokenizer.ggml.tokens", ["a", "bc", ""])
    writer.add_array("x.nested", [[1, 2], [3]])
    writer.add_array("x.empty", [])
    writer.add_tensor("w", torch.arange(64, dtype=torch.float32).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with GGUFFile(path) as f:
        assert [(e.name, e.nbytes) for e in f.entries()] == [("w", 256)]
        # The dtype says the byte order: the same bytes in a big-endian file are other values.
        assert f.entries()[0].dtype == {"LITTLE": "gguf:F32", "BIG": "gguf-be:F32"}[endianess]
        assert bytes(f.data("w")) == torch.arange(64, dtype=torch.float32).numpy().astype(
            {"LITTLE": "<f4", "BIG": ">f4"}[endianess]).tobytes()


def test_a_real_gguf_passes_the_metadata_check(gguf_path):
    from vllm_dedup.checkpoint.readers import GGUFFile

    with GGUFFile(gguf_path) as f:
        assert len(f.entries()) > 100


@pytest.mark.parametrize("ggml_type, said", [(4, "tensor type 4 (Q4_2) is one ggml removed"),
                                             (31, "tensor type 31 (Q4_0_4_4) is one ggml removed"),
                                             (77, "unknown GGML tensor type")])
def test_a_gguf_tensor_type_no_reader_knows_says_what_helps(tmp_path, ggml_type, said):
    """A type ggml removed cannot be helped by a newer gguf package: the error says to convert
    the model again; a type the installed package does not know yet says to upgrade it."""
    import gguf

    from vllm_dedup.checkpoint.readers import GGUFFile

    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("w", torch.arange(64, dtype=torch.float32).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    data = bytearray(path.read_bytes())
    info = struct.pack("<Q", 1) + b"w" + struct.pack("<IQ", 1, 64)  # name, dimensions, then the type
    at = data.index(info) + len(info)
    struct.pack_into("<I", data, at, ggml_type)
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=re.escape(said)) as e:
        GGUFFile(path)
    assert ("upgrade gguf" in str(e.value)) == (ggml_type == 77)


def test_gguf_tensors_whose_bytes_overlap_are_refused(tmp_path):
    """The gguf reader takes any offsets: two tensors over the same bytes would each be read
    and hashed, so a small file could claim any number of bytes."""
    import gguf

    from vllm_dedup.checkpoint.readers import GGUFFile

    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for name in ("a", "b"):
        writer.add_tensor(name, torch.arange(64, dtype=torch.float32).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with GGUFFile(path) as f:  # as written: one after the other
        assert [f.byte_range(n) for n in ("a", "b")] == [(f.byte_range("a")[0], f.byte_range("b")[0]),
                                                         (f.byte_range("b")[0], f.byte_range("b")[0] + 256)]
    data = bytearray(path.read_bytes())
    info = struct.pack("<Q", 1) + b"b" + struct.pack("<IQI", 1, 64, 0)  # name, dimensions, type F32, then the offset
    struct.pack_into("<Q", data, data.index(info) + len(info), 128)  # b starts in the middle of a
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="tensors 'a' and 'b' overlap"):
        GGUFFile(path)
