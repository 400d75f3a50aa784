"""`vllm_dedup.engine.onednn` against real vLLM oneDNN handlers (no engine): the packed weight
is found and validated on this CPU, a sealed memfd segment's mapping takes its place with
bit-identical results, the private copy is freed, destroying the handler is safe, and anything
unexpected declines without writing.  Child processes (faults, PSS): tests/integration/test_onednn_packed.py."""

from __future__ import annotations

import ctypes
import gc
import os
import subprocess
import sys
import types
import weakref

import pytest
import torch

from vllm_dedup.engine import onednn
from vllm_dedup.engine.onednn import library as onednn_library
from vllm_dedup.errors import PackedWeightError
from vllm_dedup.segments.host import HostSegment

from helpers import onednn_matmul_dtype, require_packed_sharing

ops = pytest.importorskip("vllm._custom_ops")

# (N, K) as vLLM hands them over: SmolLM2's and a 1B Llama's projections, the vocabulary head,
# and shapes whose packing pads (N or K not a multiple of the blocks).
SHAPES = [(576, 1536), (1536, 576), (2560, 2048), (49152, 576), (17, 33), (100, 200), (1, 64)]


DTYPE = onednn_matmul_dtype()  # bfloat16, or float32 where oneDNN cannot pack bfloat16 (AVX2)
DTYPE_NAME = str(DTYPE).removeprefix("torch.")
# The vLLM build an engine loads follows torch's CPU checks (vllm/platforms/cpu.py,
# ``import_kernels``): ``_C`` with AVX-512-BF16, ``_C_AVX512`` with AVX-512 alone, else
# ``_C_AVX2``.  A child that fakes those checks, and holds oneDNN and torch to the ISA, loads
# and runs the build such a machine would (`test_another_isas_build_in_a_child`).
FORCED_BUILD_ENV = "VLLM_DEDUP_TEST_FORCED_BUILD"
BUILDS = {  # build -> (environment, torch's AVX-512 check, its AVX-512-BF16 check)
    "_C_AVX2": ({"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}, False, False),
    "_C_AVX512": ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "ATEN_CPU_CAPABILITY": "avx512"}, True, False),
}
_CHILD = """
import sys, torch
torch.cpu._is_avx512_supported = lambda: {avx512}
torch.cpu._is_avx512_bf16_supported = lambda: {bf16}
import pytest
sys.exit(pytest.main(sys.argv[1:]))
"""


def _weight(n: int, k: int, seed: int = 0, dtype=DTYPE) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _segment_tensor(data: bytes) -> torch.Tensor:
    """A sealed memfd holding ``data``, mapped read-only, as a uint8 tensor (descriptor closed)."""
    seg = HostSegment.from_bytes(data, name="vllm-dedup")
    seg.close_fd()
    return seg.tensor(0, torch.uint8, (len(data),), (1,))


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]


def _heap_in_use() -> int:
    """Bytes glibc's main arena and its mmapped chunks hold for the program (mallinfo2)."""
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


def _mapped(address: int) -> bool:
    with open("/proc/self/maps") as maps:
        for line in maps:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return True
    return False


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


@pytest.fixture(scope="module", autouse=True)
def _supported():
    require_packed_sharing(DTYPE)


def test_probe_names_the_build():
    support = onednn.probe(DTYPE_NAME)
    flags = _cpu_flags()
    assert support.details["library"] in ("_C", "_C_AVX512", "_C_AVX2")
    if os.environ.get(FORCED_BUILD_ENV):
        assert support.details["library"] == os.environ[FORCED_BUILD_ENV]
    elif "avx512_bf16" in flags:
        assert support.details["library"] == "_C"  # platforms/cpu.py import_kernels
    elif "avx512f" not in flags:
        assert support.details["library"] == "_C_AVX2"
    assert support.details["vllm"] == __import__("vllm").__version__


def test_a_dtype_onednn_cannot_pack_here_declines_with_its_reason():
    """On AVX2 a bfloat16 matmul cannot be made: the probe says so (and the loader then runs
    ``plain``, README "Packed linear weights"); where it can be made, it is supported."""
    support = onednn.probe("bfloat16")
    if DTYPE is torch.bfloat16:
        assert support.supported, support.reason
    else:
        assert not support.supported and support.reason


_PROBE_ANSWERS = """
import sys, torch
import vllm._custom_ops  # imported on the CPU, as in an engine: only the probes run under meta
from vllm_dedup.engine.onednn import probe, vllm_packs
if sys.argv[1] == "meta":
    torch.set_default_device("meta")  # as a replay's create_model runs: torch.device("meta")
print([(vllm_packs(d), probe(d).supported) for d in ("float32", "bfloat16")])
"""


def test_probes_asked_first_while_a_model_is_made_on_the_meta_device_answer_as_on_the_cpu():
    """A replay makes its model under ``torch.device("meta")``, and the loader may ask
    `vllm_packs` about a dtype for the first time there (a float32 router gate): each probe's
    tensors are made on the CPU (Note [probes under a device context]); a meta tensor's null
    pointer crashed the engine in oneDNN's reorder (SIGSEGV).  In children: a crash is their
    exit code, and each child asks first."""
    answers = [subprocess.run([sys.executable, "-c", _PROBE_ANSWERS, where], capture_output=True, text=True,
                              timeout=300) for where in ("cpu", "meta")]
    for a in answers:
        assert a.returncode == 0, (a.returncode, a.stderr[-3000:])
    assert answers[0].stdout.splitlines()[-1] == answers[1].stdout.splitlines()[-1]
    assert answers[0].stdout.splitlines()[-1].startswith("[(True, True)"), answers[0].stdout  # float32 packs


@pytest.mark.heavy
@pytest.mark.skipif(bool(os.environ.get(FORCED_BUILD_ENV)), reason="this is the child")
@pytest.mark.parametrize("build", list(BUILDS))
def test_another_isas_build_in_a_child(build):
    """This module again, in the vLLM build a machine of another ISA loads, with oneDNN and torch
    held to that ISA, whatever this machine's: ``_C_AVX2`` (bfloat16 declines, float32 packs)
    and ``_C_AVX512`` (AVX-512 without BF16), each with its own symbols and layouts; every test
    passes, and the probe names that build.  (An ISA this CPU cannot run is not tried.)"""
    env, avx512, bf16 = BUILDS[build]
    if avx512 and "avx512f" not in _cpu_flags():
        pytest.skip(f"{build} needs AVX-512, which this CPU lacks")
    result = subprocess.run([sys.executable, "-c", _CHILD.format(avx512=avx512, bf16=bf16), "-q",
                             "-p", "no:cacheprovider", __file__],
                            env={**os.environ, **env, FORCED_BUILD_ENV: build}, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and " failed" not in result.stdout


@pytest.mark.parametrize("n,k", SHAPES)
def test_found_and_validated(n, k):
    weight = _weight(n, k)
    handler = ops.create_onednn_mm(weight.t(), 32)
    packed = onednn.find_packed(handler)
    layout = packed.layout
    assert layout.kind == "matmul" and layout.dtype == DTYPE_NAME and layout.dims == (k, n)
    assert layout.nbytes >= n * k * DTYPE.itemsize and packed.address % 64 == 0
    assert all(p >= d for p, d in zip(layout.padded_dims, layout.dims))
    onednn.check_packing(packed, weight.t(), sample=None if n * k <= 1 << 21 else 4096)
    assert layout.descriptor in layout.identity and layout.build_id in layout.identity and layout.tag
    assert not packed.shared


def test_identity_tells_layouts_apart():
    a = onednn.find_packed(ops.create_onednn_mm(_weight(576, 1536).t(), 32)).layout
    b = onednn.find_packed(ops.create_onednn_mm(_weight(1536, 576).t(), 32)).layout
    c = onednn.find_packed(ops.create_onednn_mm(_weight(576, 1536, seed=1).t(), 32)).layout
    assert a.nbytes == b.nbytes and a.identity != b.identity  # same size, other layout
    assert a.identity == c.identity  # other values, same layout


def test_check_packing_catches_another_weight():
    packed = onednn.find_packed(ops.create_onednn_mm(_weight(100, 200).t(), 32))
    with pytest.raises(PackedWeightError, match="other bits"):
        onednn.check_packing(packed, _weight(100, 200, seed=1).t())
    with pytest.raises(PackedWeightError, match="not a"):
        onednn.check_packing(packed, _weight(200, 100).t())


@pytest.mark.parametrize("n,k", [(576, 1536), (2560, 2048), (17, 33)])
def test_segment_in_place_gives_identical_results_and_frees_the_private_copy(n, k):
    weight = _weight(n, k)
    handler = ops.create_onednn_mm(weight.t(), 32)
    packed = onednn.find_packed(handler)
    x = _weight(33, k, seed=2)
    bias = _weight(1, n, seed=3).reshape(n)
    before = [ops.onednn_mm(handler, x[:m], b) for m in (1, 8, 33) for b in (None, bias)]
    data = _segment_tensor(bytes(packed.view()))
    in_use = _heap_in_use()
    assert onednn.install(packed, data) == packed.nbytes
    assert in_use - _heap_in_use() >= packed.nbytes - (64 << 10)  # oneDNN freed its buffer (give or take small allocations)
    assert onednn.find_packed(handler).address == data.data_ptr() and packed.shared
    after = [ops.onednn_mm(handler, x[:m], b) for m in (1, 8, 33) for b in (None, bias)]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    with pytest.raises(PackedWeightError, match="moved"):
        packed.view()
    again = onednn.find_packed(handler)
    assert onednn.install(again, _segment_tensor(bytes(again.view()))) == 0  # no double free


def test_a_handler_is_checked_once_and_found_again_after_install(monkeypatch):
    """Note [a handler found once]: a second look reads nothing through /proc/self/mem, `install`
    leaves the new address behind, and a data handle changed by anyone else means a full check."""
    handler = ops.create_onednn_mm(_weight(576, 1536).t(), 32)
    packed = onednn.find_packed(handler)
    lib = onednn_library.library()
    reads = []
    words = lib.words
    monkeypatch.setattr(lib, "words", lambda *a: reads.append(a) or words(*a))
    assert onednn.find_packed(handler) == packed and not reads
    data = _segment_tensor(bytes(packed.view()))
    onednn.install(packed, data)
    again = onednn.find_packed(handler)
    assert again.address == data.data_ptr() and again.shared and not reads
    checked = onednn.find_packed(types.SimpleNamespace(handler_tensor=handler.handler_tensor, n=576, k=1536))
    assert reads and (checked.memory, checked.address, checked.layout) == (again.memory, again.address, again.layout)
    other = _segment_tensor(bytes(again.view()))  # behind find_packed's back: the kept one is stale
    assert lib.set_data_handle(again.memory, other.data_ptr()) == onednn_library.SUCCESS
    reads.clear()
    assert onednn.find_packed(handler).address == other.data_ptr() and reads
    setattr(handler, onednn.handler.HOLDS, [other])  # what install would have kept, so the mapping outlives it
    held = weakref.ref(handler)  # no reference cycle through what is kept: dropped, it goes at once
    del handler, packed, again, checked
    assert held() is None


def test_the_kernel_reads_the_segment():
    """A segment holding another weight's packing (same layout) changes the results to that
    weight's: the kernel reads the new address, not a stale one."""
    w1, w2 = _weight(576, 1536, seed=1), _weight(576, 1536, seed=2)
    h1, h2 = ops.create_onednn_mm(w1.t(), 32), ops.create_onednn_mm(w2.t(), 32)
    p1, p2 = onednn.find_packed(h1), onednn.find_packed(h2)
    x = _weight(4, 1536, seed=3)
    want = ops.onednn_mm(h2, x, None)
    assert not torch.equal(ops.onednn_mm(h1, x, None), want)
    onednn.install(p1, _segment_tensor(bytes(p2.view())), compare=False)
    assert torch.equal(ops.onednn_mm(h1, x, None), want)


def test_other_bytes_are_refused_and_nothing_changes():
    w1, w2 = _weight(576, 1536, seed=1), _weight(576, 1536, seed=2)
    h1 = ops.create_onednn_mm(w1.t(), 32)
    p1, p2 = onednn.find_packed(h1), onednn.find_packed(ops.create_onednn_mm(w2.t(), 32))
    x = _weight(4, 1536, seed=3)
    before = ops.onednn_mm(h1, x, None)
    with pytest.raises(PackedWeightError, match="differ"):
        onednn.install(p1, _segment_tensor(bytes(p2.view())))
    with pytest.raises(PackedWeightError, match="contiguous CPU uint8"):
        onednn.install(p1, torch.zeros(p1.nbytes - 1, dtype=torch.uint8))
    misaligned = torch.zeros(p1.nbytes + 64, dtype=torch.uint8)[1:p1.nbytes + 1]
    with pytest.raises(PackedWeightError, match="aligned"):
        onednn.install(p1, misaligned)
    assert onednn.find_packed(h1).address == p1.address and not p1.shared
    assert torch.equal(ops.onednn_mm(h1, x, None), before)


def test_a_handle_onednn_takes_but_does_not_read_stops_the_load(monkeypatch):
    """`onednn.install`'s check after oneDNN took the new handle: where the handler then reads
    another buffer (a oneDNN that misbehaves, made here by swapping the address it is given),
    its own buffer may be gone, so there is no private copy to go on with: the load stops
    (SharedWeightsError, which the sharing pass and staging never swallow), with what to do."""
    from vllm_dedup.errors import SharedWeightsError

    weight = _weight(576, 1536, seed=1)
    handler = ops.create_onednn_mm(weight.t(), 32)
    packed = onednn.find_packed(handler)
    data = _segment_tensor(bytes(packed.view()))
    other = torch.zeros(packed.nbytes + 64, dtype=torch.uint8)
    other = other[(-other.data_ptr()) % 64:][:packed.nbytes]  # aligned, as oneDNN's own would be
    lib = onednn_library.library()
    set_handle = lib.set_data_handle
    monkeypatch.setattr(lib, "set_data_handle", lambda memory, address: set_handle(memory, other.data_ptr()))
    with pytest.raises(SharedWeightsError, match="reads another buffer.*cpu_linear='private'"):
        onednn.install(packed, data)
    monkeypatch.undo()
    assert any(t is data for t in getattr(handler, onednn.handler.HOLDS))  # kept: it may be read


def test_destroying_the_handler_is_safe_and_unmaps_the_segment():
    weight = _weight(2560, 2048)
    handler = ops.create_onednn_mm(weight.t(), 32)
    packed = onednn.find_packed(handler)
    data = _segment_tensor(bytes(packed.view()))
    address = data.data_ptr()
    fds = len(os.listdir("/proc/self/fd"))
    onednn.install(packed, data)
    del data, packed
    gc.collect()
    assert _mapped(address)  # the handler keeps its segment
    del handler
    gc.collect()
    assert not _mapped(address)  # gone with the handler: nothing leaks
    assert len(os.listdir("/proc/self/fd")) <= fds
    handler = ops.create_onednn_mm(weight.t(), 32)  # oneDNN's heap is intact
    assert onednn.find_packed(handler).nbytes == 2560 * 2048 * DTYPE.itemsize


@pytest.mark.parametrize("n,k,dynamic,azp", [(576, 1536, True, False), (1536, 576, False, False),
                                             (256, 512, False, True), (17, 64, True, False)])
def test_w8a8_int8_handler(n, k, dynamic, azp):
    """vLLM's W8A8 int8 path (kernels/linear/scaled_mm/cpu.py, process_weights_for_onednn)."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen).t()
    scales = torch.rand(n, 1, generator=gen) * 0.01
    handler = ops.create_onednn_scaled_mm(weight, scales, torch.bfloat16, dynamic, azp, 32)
    packed = onednn.find_packed(handler)
    assert packed.layout.kind == "w8a8" and packed.layout.dtype == "int8"
    onednn.check_packing(packed, weight, sample=None)
    x = _weight(4, k, seed=1)
    x_q, x_s, x_zp = ops.onednn_scaled_int8_quant(x, None if dynamic else torch.tensor(0.02),
                                                  torch.tensor(3, dtype=torch.int32) if azp else None, not azp)
    adj = weight.sum(dim=0, keepdim=True, dtype=torch.float32) * scales.squeeze() if dynamic or azp else None

    def run():
        out = torch.empty(4, n, dtype=torch.bfloat16)
        ops.onednn_scaled_mm(handler, x_q, out, x_s, x_zp, adj, None)
        return out

    before = run()
    assert onednn.install(packed, _segment_tensor(bytes(packed.view()))) == packed.nbytes
    assert torch.equal(run(), before)


def _fake(handler_address: int, n: int, k: int):
    """An object shaped like vLLM's Python handler (never a CPUDNNLGEMMHandler: its __del__
    would delete whatever the address points at)."""
    return types.SimpleNamespace(handler_tensor=torch.tensor(handler_address, dtype=torch.int64), n=n, k=k)


def test_unexpected_objects_decline_without_writing():
    weight = _weight(576, 1536)
    handler = ops.create_onednn_mm(weight.t(), 32)
    real = handler.handler_tensor.item()
    raw = bytes((ctypes.c_uint8 * 160).from_address(real))
    cases = {
        "not a handler": torch.zeros(160, dtype=torch.uint8),
        "unmapped": None,
    }
    for what, buf in cases.items():
        address = buf.data_ptr() if buf is not None else 8
        with pytest.raises(PackedWeightError):
            onednn.find_packed(_fake(address, 576, 1536))
    with pytest.raises(PackedWeightError, match="N=576"):
        onednn.find_packed(_fake(real, 577, 1536))
    # a copy of the real handler with its map's element count changed: the vtable matches,
    # the layout does not
    for offset, value in ((48 + 24, 0), (48 + 24, 99), (48 + 8, 0), (104 + 8, 0)):
        copy = bytearray(raw)
        copy[offset:offset + 8] = value.to_bytes(8, "little")
        fake_mem = torch.frombuffer(copy, dtype=torch.uint8)
        with pytest.raises(PackedWeightError):
            onednn.find_packed(_fake(fake_mem.data_ptr(), 576, 1536))
        assert bytes(copy[:offset]) == raw[:offset] and bytes(copy[offset + 8:]) == raw[offset + 8:]
    assert bytes((ctypes.c_uint8 * 160).from_address(real)) == raw  # the real handler is untouched
    packed = onednn.find_packed(handler)
    onednn.check_packing(packed, weight.t())


def test_handlers_in_a_model():
    from torch import nn

    class Layer(nn.Module):
        pass

    model = nn.Module()
    model.a, model.b, model.c = Layer(), Layer(), Layer()
    h1 = ops.create_onednn_mm(_weight(64, 128).t(), 32)
    h2 = ops.create_onednn_mm(_weight(64, 128, seed=1).t(), 32)
    model.a.cpu_linear = lambda x, weight, bias: ops.onednn_mm(h1, x, bias)
    model.b.cpu_linear = model.a.cpu_linear  # tied: found once
    kernel = type("Kernel", (), {"__module__": "vllm.fake"})()  # as vLLM's W8A8 kernel objects
    kernel.dnnl_handler = h2
    model.c.scheme = kernel
    model.c.cpu_linear = torch.nn.functional.linear
    found = onednn.handlers_in(model)
    assert [(name, h) for name, h in found] == [("a", h1), ("c", h2)]
    model.c.second = kernel  # the same handler twice in one module: once
    assert onednn.module_handlers(model.c) == [h2]
    walked = onednn.ModelHandlers(model)  # the sharing pass's one walk answers as the functions do
    assert walked.named() == onednn.handlers_in(model)
    assert walked.pinned_tensors() == onednn.pinned_tensors(model) == []  # no W8A8 layer: nothing pinned


def test_a_library_without_symbols_declines(tmp_path):
    plain = tmp_path / "stripped.so"
    plain.write_bytes(b"\x7fELF\x02\x01" + bytes(58))
    assert onednn_library.elf_symbols(str(plain), ["dnnl_memory_set_data_handle"]) == {}
    with pytest.raises(PackedWeightError, match="ELF"):
        (tmp_path / "not-elf").write_bytes(b"hello")
        onednn_library.elf_symbols(str(tmp_path / "not-elf"), ["x"])


def test_the_tensors_a_w8a8_handler_reads_by_pointer_are_pinned():
    """A W8A8 handler keeps a raw pointer to its layer's weight scale (Note [lifetimes]): the
    sharing pass must never swap that storage.  Unquantized layers pin nothing."""
    from torch import nn
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    gen = torch.Generator().manual_seed(0)
    weight = torch.randint(-127, 128, (64, 128), dtype=torch.int8, generator=gen).t()
    quantized, plain = nn.Module(), nn.Module()
    quantized.weight_scale = nn.Parameter(torch.rand(64, 1, generator=gen), requires_grad=False)
    quantized.bias = nn.Parameter(torch.zeros(64), requires_grad=False)
    kernel = type("Kernel", (), {"__module__": "vllm.fake"})()  # as vLLM's W8A8 kernel objects
    kernel.dnnl_handler = ops.create_onednn_scaled_mm(weight, quantized.weight_scale.data, torch.bfloat16,
                                                      True, False, 32)
    quantized.scheme = kernel
    h = ops.create_onednn_mm(_weight(64, 128).t(), 32)
    plain.quant_method = UnquantizedLinearMethod()
    plain.cpu_linear = lambda x, w, bias: ops.onednn_mm(h, x, bias)
    plain.bias = nn.Parameter(torch.zeros(64), requires_grad=False)
    model = nn.Module()
    model.q, model.p = quantized, plain
    assert [id(t) for t in onednn.pinned_tensors(model)] == [id(quantized.weight_scale), id(quantized.bias)]


def test_a_replay_placeholder_packs_zeros_and_a_write_to_it_faults():
    """Note [packed weights replayed]: a replay's placeholder weight reads zeros (one row,
    broadcast), vLLM packs it into the layout and size a plain weight of its shape packs into,
    and the pages are read-only: a write dies with SIGSEGV (in a child) instead of changing
    what the next layer packs from the same pages."""
    from vllm_dedup.engine.packed import ZeroPages

    zeros = ZeroPages()
    placeholder = zeros.tensor(DTYPE, torch.Size((96, 320)))
    assert not placeholder.any() and placeholder.shape == (96, 320) and placeholder.stride() == (0, 1)
    handler = ops.create_onednn_mm(placeholder.t(), 32)
    x = torch.randn(3, 320, generator=torch.Generator().manual_seed(1)).to(DTYPE)
    assert not ops.onednn_mm(handler, x, None).any()
    packed, plain = (onednn.find_packed(h) for h in (handler, ops.create_onednn_mm(_weight(96, 320).t(), 32)))
    assert (packed.layout, packed.nbytes) == (plain.layout, plain.nbytes)
    assert packed.view().tobytes().count(0) == packed.nbytes  # every byte zero, padding included
    larger = zeros.tensor(DTYPE, torch.Size((4096, 1024)))  # grows by a new mapping
    assert not larger.any() and not placeholder.any()
    assert zeros.holds(placeholder) and zeros.holds(larger)
    del placeholder, handler, packed  # the first mapping goes with its last view: its span too
    gc.collect()
    assert zeros.holds(larger) and len(zeros._spans) == 1
    child = subprocess.run([sys.executable, "-c", (
        "import torch\nfrom vllm_dedup.engine.packed import ZeroPages\n"
        "t = ZeroPages().tensor(torch.float32, torch.Size((64, 64)))\nprint('made', flush=True)\nt[3, 5] = 1.0\n")],
        capture_output=True, text=True, timeout=120)
    assert child.stdout.strip() == "made", child.stderr[-2000:]
    assert child.returncode == -11, (child.returncode, child.stderr[-2000:])  # SIGSEGV


def test_reads_in_a_forked_child_see_the_childs_memory():
    """Issue 28, fork: the handle on the process's own memory is opened by the process that
    reads; a child made by ``fork`` after the parent read must not read the parent's bytes."""
    lib = onednn_library.library()
    buf = ctypes.create_string_buffer(b"parent", 16)
    address = ctypes.addressof(buf)
    assert lib.read(address, 6) == b"parent"
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: change its copy of the page, read it through the library
        try:
            ctypes.memmove(address, b"child!", 6)
            os.write(w, onednn_library.library().read(address, 6))
        finally:
            os._exit(0)
    os.close(w)
    try:
        got = os.read(r, 16)
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    assert got == b"child!"
    assert lib.read(address, 6) == b"parent"


def test_a_word_that_is_no_pointer_is_a_layout_not_understood():
    """A handler of another vLLM build may hold garbage where a pointer was expected: reading
    it is a `PackedWeightError` (the layer keeps its private copy), never the OverflowError
    ``os.pread`` raises past 2**63, which would stop the engine."""
    lib = onednn_library.library()
    for address in (-1, 0, 1 << 63, (1 << 64) - 8, 1 << 56):
        with pytest.raises(PackedWeightError, match="is not in user space"):
            lib.read(address, 8)


def _elf_with_note(kind: int, name: bytes, desc: bytes) -> bytes:
    """A minimal ELF64 little-endian file: a header and one SHT_NOTE section holding one note."""
    import struct

    pad = lambda b: b + b"\0" * (-len(b) % 4)  # noqa: E731
    note = struct.pack("<III", len(name), len(desc), kind) + pad(name) + pad(desc)
    note_at, shoff = 64, 64 + len(note)
    header = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9) + struct.pack("<HHIQQQIHHHHHH", 3, 62, 1, 0, 0, shoff, 0, 64,
                                                                     0, 0, 64, 1, 0)
    section = struct.pack("<IIQQQQIIQQ", 0, 7, 0, 0, note_at, len(note), 0, 0, 4, 0)
    return header + note + section


def test_the_packed_layout_identity_is_onednns_descriptor_and_the_build(tmp_path):
    """Issue 28, item 6: a packed weight's identity is oneDNN's serialized memory descriptor and
    the extension's GNU build id (not its path or file), and a build without an id declines."""
    lib = onednn_library.library()
    layout = onednn.find_packed(ops.create_onednn_mm(_weight(96, 320).t(), 32)).layout
    assert layout.build_id == lib.build_id and len(lib.build_id) >= 16
    assert f"|md={layout.descriptor}|build={lib.build_id}|" in layout.identity
    assert lib.name not in layout.identity  # the binary is named by its build, not its file name
    ident = bytes(range(20))
    (tmp_path / "with.so").write_bytes(_elf_with_note(3, b"GNU\0", ident))
    assert onednn_library.elf_build_id(str(tmp_path / "with.so")) == ident.hex()
    (tmp_path / "without.so").write_bytes(_elf_with_note(1, b"GNU\0", ident))  # another note: no build id
    with pytest.raises(PackedWeightError, match="has no GNU build id"):
        onednn_library.elf_build_id(str(tmp_path / "without.so"))


_PROBE_OUT_OF_DESCRIPTORS = """
import os, resource, sys
import vllm._custom_ops
from vllm_dedup.engine.onednn import probe, vllm_packs
vllm_packs(sys.argv[1])  # vLLM's own answer, asked while descriptors are left
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) - 1, hard))  # no descriptor left
starved = probe(sys.argv[1])
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
print(repr((starved.supported, starved.passing, starved.reason, probe(sys.argv[1]).supported)))
"""


def test_a_probe_that_failed_for_want_of_descriptors_is_asked_again():
    """The probe needs descriptors (the extension's file, /proc/self/mem, a memfd): run out of
    them (a real ``RLIMIT_NOFILE`` in a child), it fails with a reason that passes, and the
    next call, with descriptors again, answers as on a healthy process instead of keeping
    the failure for the engine's life."""
    child = subprocess.run([sys.executable, "-c", _PROBE_OUT_OF_DESCRIPTORS, DTYPE_NAME], capture_output=True,
                           text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]
    supported, passing, reason, then = eval(child.stdout.splitlines()[-1])  # noqa: S307  (our child's repr)
    assert (supported, passing) == (False, True), reason
    assert then, "the probe kept its failure"
