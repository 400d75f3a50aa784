"""The plugin in real vLLM: the entry point, the load format and its configuration.

Greedy outputs of real engines with dedup and auto are compared in test_engines.py."""

from __future__ import annotations

from importlib.metadata import entry_points
from unittest import mock

import pytest
from vllm.config.load import LoadConfig

from vllm_dedup.engine.loader import DedupModelLoader


def test_entry_point_is_in_vllms_plugin_group():
    (ep,) = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "dedup"]
    assert ep.value == "vllm_dedup.plugin:register"


def test_vllm_loads_the_plugin_and_knows_the_format():
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    load_general_plugins()  # idempotent
    loader = get_model_loader(LoadConfig(load_format="dedup"))
    assert isinstance(loader, DedupModelLoader)
    assert type(loader.inner).__name__ == "DefaultModelLoader"


def test_a_plugin_that_cannot_register_stops_no_engine_and_leaves_the_format_unknown(monkeypatch, caplog):
    """vLLM calls ``register`` unguarded in every process: raising there would stop plain
    engines too.  It logs instead, and the load format is not registered without its guards."""
    from vllm.model_executor import model_loader

    from vllm_dedup import plugin
    from vllm_dedup.engine import worker_hooks

    def broken():
        raise RuntimeError("a vLLM this plugin does not know")

    monkeypatch.setattr(worker_hooks, "install", broken)
    monkeypatch.setattr(model_loader, "_LOAD_FORMAT_TO_MODEL_LOADER",
                        {k: v for k, v in model_loader._LOAD_FORMAT_TO_MODEL_LOADER.items() if k != "dedup"})
    plugin.register()
    assert "dedup" not in model_loader._LOAD_FORMAT_TO_MODEL_LOADER
    assert "the plugin could not register" in caplog.text and "a vLLM this plugin does not know" in caplog.text


def test_unknown_config_key_lists_the_valid_ones():
    with pytest.raises(ValueError) as err:
        DedupModelLoader(LoadConfig(load_format="dedup", model_loader_extra_config={"share_grup": "a"}))
    assert "'share_grup'" in str(err.value) and "inner_load_format" in str(err.value)


def test_inner_loader_gets_only_its_own_config():
    loader = DedupModelLoader(
        LoadConfig(
            load_format="dedup",
            model_loader_extra_config={"inner_load_format": "safetensors", "inner_extra_config": {"num_threads": 2}},
        )
    )
    assert loader.inner.load_config.load_format == "safetensors"
    assert loader.inner.load_config.model_loader_extra_config == {"num_threads": 2}
    with pytest.raises(ValueError, match="cannot be 'dedup'"):
        DedupModelLoader(LoadConfig(load_format="dedup", model_loader_extra_config={"inner_load_format": "dedup"}))


@pytest.mark.parametrize("extra, words", [
    ({"inner_load_format": "safetensor"}, "inner_load_format 'safetensor'.*not supported.*load formats: .*safetensors"),
    ({"inner_extra_config": {"num_thread": 2}}, "inner_extra_config {'num_thread': 2}.*num_thread"),
])
def test_an_inner_loader_vllm_cannot_make_is_named_by_our_keys_and_refused_in_the_serve_driver(extra, words):
    """vLLM's own words ("Load format `safetensor` is not supported") name neither of our keys;
    and the Serve helper refuses it in the driver, not in every replica."""
    from vllm_dedup.serve import dedup_engine_kwargs

    with pytest.raises(ValueError, match=words):
        DedupModelLoader(LoadConfig(load_format="dedup", model_loader_extra_config=extra))
    with pytest.raises(ValueError, match=words):
        dedup_engine_kwargs({}, {**extra, "registry_address": "local"})


def test_where_packed_sharing_cannot_work_linears_keep_vllms_private_packed_copies(monkeypatch):
    """Issue 28, fallback: where vLLM packs but sharing cannot (a failed probe), the engine runs
    ``private`` (vLLM's own oneDNN kernels on private packed copies: plain's speed and numerics),
    not ``plain`` (``F.linear``, slower), and every load report says which linears and why."""
    import types

    from vllm_dedup.engine import onednn

    monkeypatch.setattr(onednn, "probe", lambda dtype: onednn.Support(False, f"no {dtype} here (test)"))
    monkeypatch.setattr(onednn, "vllm_packs", lambda dtype: True)
    loader = DedupModelLoader(LoadConfig(load_format="dedup"))
    assert loader.cpu_linear(types.SimpleNamespace(dtype="bfloat16")) == "private"
    assert loader.packed_declined == "every linear: packed sharing cannot work here (no bfloat16 here (test))"
    # Where vLLM itself runs F.linear (bfloat16 on AVX2), so does the engine, on shared weights,
    # and every layer as vLLM runs it ("vllm": a float32 gate vLLM packs runs on its packed copy,
    # shared where the float32 probe passes; tests/e2e/test_avx2_linear.py); a load signature of
    # its own, not plain's.
    monkeypatch.setattr(onednn, "vllm_packs", lambda dtype: False)
    loader = DedupModelLoader(LoadConfig(load_format="dedup"))
    assert loader.cpu_linear(types.SimpleNamespace(dtype="bfloat16")) == "vllm" and loader.packed_declined == ""
    assert not loader.shares_packed(types.SimpleNamespace(dtype="bfloat16"))  # the float32 probe fails too
    asked = DedupModelLoader(LoadConfig(load_format="dedup", model_loader_extra_config={"cpu_linear": "plain"}))
    assert asked.cpu_linear(types.SimpleNamespace(dtype="bfloat16")) == "plain" and asked.packed_declined == ""
    assert not asked.shares_packed(types.SimpleNamespace(dtype="bfloat16"))
    # The packed weights vLLM still makes under "vllm" (float32) are shared where that probe passes.
    monkeypatch.setattr(onednn, "probe", lambda dtype: onednn.Support(dtype == "float32", "" if dtype == "float32"
                                                                      else f"no {dtype} here (test)"))
    loader = DedupModelLoader(LoadConfig(load_format="dedup"))
    assert loader.cpu_linear(types.SimpleNamespace(dtype="bfloat16")) == "vllm"
    assert loader.shares_packed(types.SimpleNamespace(dtype="bfloat16"))
    packed = DedupModelLoader(LoadConfig(load_format="dedup"))
    monkeypatch.setattr(onednn, "probe", lambda dtype: onednn.Support(True))
    assert packed.cpu_linear(types.SimpleNamespace(dtype="bfloat16")) == "packed"
    assert packed.shares_packed(types.SimpleNamespace(dtype="bfloat16"))


@pytest.mark.parametrize("on_error", ["fallback", "fail"])
def test_plain_linears_whose_graph_the_compile_cache_cannot_key_run_vllms_graph(on_error, caplog):
    """``cpu_linear="plain"`` changes the compiled graph, which vLLM's compile-cache key must
    say (`compile_cache.key_compile_cache`); with an ``additional_config`` object it cannot, so
    the engine runs vLLM's own graph on private packed copies (``private``), warning, rather
    than stopping; under ``fail`` it stops with that message."""
    import types

    from vllm.config import VllmConfig

    from vllm_dedup.errors import DedupError

    class Opaque:  # vLLM's SupportsHash
        def compute_hash(self) -> str:
            return "x"

    extra = {"cpu_linear": "plain", "on_registry_error": on_error}
    loader = DedupModelLoader(LoadConfig(load_format="dedup", model_loader_extra_config=extra))
    config, model_config = VllmConfig(additional_config=Opaque()), types.SimpleNamespace(dtype="bfloat16")
    if on_error == "fail":
        with pytest.raises(DedupError, match="additional_config is a Opaque, not a dict"):
            loader.cpu_linear(model_config, config)
        return
    assert loader.cpu_linear(model_config, config) == "private"
    assert "additional_config is a Opaque, not a dict" in caplog.text and "cpu_linear=private" in caplog.text
    assert loader.packed_declined and loader.cpu_linear(model_config) == "private"
    # A dict carries the key: plain as asked.
    keyed = DedupModelLoader(LoadConfig(load_format="dedup", model_loader_extra_config=extra))
    assert keyed.cpu_linear(model_config, VllmConfig(additional_config={"user": 1})) == "plain"


def test_a_linear_marked_for_f_linear_keeps_its_weight():
    """`packed.packed_and_dropped`: vLLM packs and drops an unmarked linear's weight; one marked
    ``_cpu_skip_gemm_dispatch`` (``plain``, ``vllm``, or vLLM's own mark on MLA's kv_b_proj)
    keeps it, so an in-place load places it and staging leaves it (nothing of it is packed)."""
    from torch import nn
    from vllm.model_executor.layers.linear import LinearBase

    from vllm_dedup.engine.packed import packed_and_dropped

    class Linear(LinearBase):  # only the class matters here
        def __init__(self):
            nn.Module.__init__(self)

    layer = Linear()
    assert packed_and_dropped(layer, "weight") and not packed_and_dropped(layer, "bias")
    layer._cpu_skip_gemm_dispatch = True
    assert not packed_and_dropped(layer, "weight")
    assert not packed_and_dropped(nn.Linear(2, 2), "weight")  # not vLLM's: nothing packs it


@pytest.mark.parametrize("vllm_packs", [True, False])
def test_where_nothing_is_staged_a_weight_vllm_packs_and_drops_stays_out_of_the_in_place_load(monkeypatch,
                                                                                               vllm_packs):
    """With ``cpu_linear="private"`` (or ``plain``, ``vllm``) nothing is staged, yet vLLM still
    packs and drops every unmarked linear weight of a dtype its oneDNN matmul takes: loaded into
    a memfd, such a weight would cost shmem page faults and descriptors for nothing.  Of a dtype
    it cannot pack (bfloat16 on AVX2), vLLM runs ``F.linear`` on the weight: it is placed."""
    from types import SimpleNamespace

    import torch
    from torch import nn
    from vllm.model_executor.layers.linear import LinearBase

    from vllm_dedup.config import DedupConfig
    from vllm_dedup.engine import onednn
    from vllm_dedup.engine.loader import DedupModelLoader

    class Linear(LinearBase):  # only the class matters here
        def __init__(self):
            nn.Module.__init__(self)
            self.weight = nn.Parameter(torch.empty(4, 4, dtype=torch.bfloat16), requires_grad=False)

    asked = []
    monkeypatch.setattr(onednn, "vllm_packs", lambda dtype: asked.append(dtype) or vllm_packs)
    ctx = SimpleNamespace(config=DedupConfig(), device_type="cpu", model_name="m")
    placed = DedupModelLoader._in_place(ctx, staging=None)
    layer = Linear()
    assert placed.skip(layer, "weight") is vllm_packs and asked == ["bfloat16"]
    layer._cpu_skip_gemm_dispatch = True  # marked for F.linear: vLLM keeps it
    assert not placed.skip(layer, "weight") and not placed.skip(nn.Linear(2, 2), "weight")


@pytest.mark.parametrize("extra, words", [
    ({"registry_namespace": "team a"}, "registry_namespace must be a name of letters, digits"),
    ({"registry_namespace": "team/a"}, "registry_namespace must be a name of letters, digits"),
    ({"registry_namespace": ".."}, "registry_namespace must be a name of letters, digits"),
    ({"min_tensor_bytes": True}, "min_tensor_bytes must be an integer >= 0"),
    ({"keep_warm_s": False}, "keep_warm_s must be a finite number >= 0"),
    ({"startup_lock_timeout_s": True}, "startup_lock_timeout_s must be a finite number > 0"),
    # vLLM's json.loads reads 1e999 and Infinity as inf: a registry kept warm for ever could not
    # encode its stats, and every later engine on the node would load privately.
    ({"keep_warm_s": float("inf")}, "keep_warm_s must be a finite number >= 0"),
    ({"keep_warm_s": float("nan")}, "keep_warm_s must be a finite number >= 0"),
    ({"startup_lock_timeout_s": float("inf")}, "startup_lock_timeout_s must be a finite number > 0"),
    # An integer past a float's range: time.monotonic() + 10**400 raises OverflowError.
    ({"startup_lock_timeout_s": 10**400}, "startup_lock_timeout_s must be a finite number > 0"),
    ({"min_tensor_bytes": 10**400}, "min_tensor_bytes must be an integer >= 0"),
    # Ray would answer "Invalid address format", and the engine would blame the registry.
    ({"registry_address": "LOCAL"}, "registry_address must be null, 'local' \\(lower case\\)"),
    ({"registry_address": " local"}, "registry_address must be null, 'local'"),
    ({"registry_address": ""}, "registry_address must be null, 'local'"),
    ({"share_group": "g" * 4097}, "share_group must be a non-empty string of at most 4096"),  # the registry's limit
])
def test_a_value_that_would_fail_later_is_refused_with_the_config(extra, words):
    """Caught when the engine is configured, not when its load first reaches the registry
    (a namespace names the socket file: `registry.wire.socket_path` raised ValueError there,
    which stopped the engine under fallback too); JSON's true is no number."""
    with pytest.raises(ValueError, match=words):
        DedupModelLoader(LoadConfig(load_format="dedup", model_loader_extra_config=extra))


def test_the_inner_load_format_is_vllms_lower_case_name():
    """vLLM's load formats are lower case; the fast path and the load signature compare the
    name as kept, so "AUTO" and "auto" must be one format (and "Safetensors" keep recipes)."""
    from vllm_dedup.config import DedupConfig

    assert DedupConfig.from_extra_config({"inner_load_format": " Safetensors"}).inner_load_format == "safetensors"
    with pytest.raises(ValueError, match="cannot be 'dedup' itself"):
        DedupConfig.from_extra_config({"inner_load_format": "DEDUP"})
    with pytest.raises(ValueError, match="must be a load format name"):  # not '' in every worker
        DedupConfig.from_extra_config({"inner_load_format": "   "})


def test_the_cli_refuses_a_bad_namespace_or_number_in_one_line():
    from vllm_dedup.cli import main

    for argv in (["status", "--namespace", "my ns"], ["scan", "--threads", "x", "."], ["scan", "--threads", "0", "."]):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 2, argv


@pytest.mark.parametrize("on_error", ["fallback", "fail"])
def test_a_model_folder_file_the_signature_cannot_read_makes_the_load_private(monkeypatch, caplog, on_error):
    """A remote-code file or processor config that cannot be read (another user's, mode 0600)
    may be one vLLM never needs: the engine loads privately and says which file; under
    ``fail`` the load stops with that message."""
    import types

    import vllm_dedup.engine.loader as loader_module
    from vllm_dedup.errors import CheckpointError

    def load_signature(*args):
        raise PermissionError(13, "Permission denied", "/models/m/modeling_m.py")

    monkeypatch.setattr(loader_module, "load_signature", load_signature)
    loader = DedupModelLoader(LoadConfig(load_format="dedup", model_loader_extra_config={"on_registry_error": on_error}))
    monkeypatch.setattr(loader, "cpu_linear", lambda model_config, vllm_config=None: "packed")
    monkeypatch.setattr(loader, "shares_packed", lambda model_config: True)
    vllm_config = types.SimpleNamespace(load_config=types.SimpleNamespace(device=None),
                                        device_config=types.SimpleNamespace(device="cpu"))
    model_config = types.SimpleNamespace(model="/models/m")
    if on_error == "fail":
        with pytest.raises(CheckpointError, match="modeling_m.py: vllm-dedup cannot read it for the load signature"):
            loader._context(vllm_config, model_config, "")
        return
    assert loader._context(vllm_config, model_config, "") is None
    assert "/models/m/modeling_m.py: vllm-dedup cannot read it for the load signature (Permission denied)" in caplog.text
    assert "loading privately" in caplog.text


HOOKED_MODULES = ("vllm.v1.worker.gpu_worker", "vllm.v1.worker.cpu_worker", "vllm.distributed.eplb.eplb_state")
FRESH_PROCESS = """
import json, sys
import torch
import vllm
event = torch.cuda.Event
from vllm_dedup.engine import worker_hooks
wrapped = worker_hooks.install()
imported = [m for m in %r if m in sys.modules]
from vllm.v1.worker.gpu_worker import Worker
print(json.dumps({"wrapped": wrapped, "imported": imported, "event_kept": torch.cuda.Event is event,
                  "hooked_on_import": getattr(Worker.__dict__["sleep"], "__vllm_dedup_hook__", False)}))
""" % (HOOKED_MODULES,)


def test_the_hooks_import_no_module_and_wrap_each_when_vllm_imports_it():
    """The plugin loads in every vLLM process: it imports none of the modules it hooks (1.6 s
    of imports; vLLM's CPU worker module replaces torch's CUDA events and streams,
    ``synchronize`` and ``get_memory_info`` for the whole process, vllm/v1/worker/cpu/shm.py),
    and wraps each class when vLLM imports its module, or at once where it has already."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", FRESH_PROCESS], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["imported"] == [] and "Worker.sleep" not in got["wrapped"], got
    assert got["hooked_on_import"] and got["event_kept"], got
    # Imported already (this process): wrapped at once.
    from vllm.v1.worker.cpu_worker import CPUWorker

    from vllm_dedup.engine import worker_hooks

    worker_hooks.install()
    assert getattr(CPUWorker.sleep, worker_hooks._MARK, False)


def test_a_hook_that_cannot_wrap_never_fails_vllms_import(caplog):
    """A hook runs inside vLLM's import of its module: a class that is not there, or a wrapper
    that cannot be made, is a warning and the method runs unguarded, never an ImportError."""
    import types

    from vllm_dedup.engine import worker_hooks

    class Worker:
        def sleep(self):
            return "slept"

    module = types.ModuleType("vllm_like")
    module.Worker = Worker

    def broken(method):
        raise RuntimeError("cannot wrap")

    assert worker_hooks._on_import(module, [("Missing", "sleep", broken, None),
                                            ("Worker", "sleep", broken, None)]) == []
    assert Worker().sleep() == "slept"
    assert "vllm_like has no Missing" in caplog.text and "Worker.sleep could not be hooked" in caplog.text


@pytest.mark.parametrize("workers", [[0, 0], [0, 4096], "unreachable"])
@pytest.mark.parametrize("level", [0, 1, 2])
def test_the_engine_core_asks_its_workers_before_it_pauses_for_sleep(workers, level):
    """``EngineCore.sleep`` pauses the scheduler before the workers' ``sleep`` runs (their guard
    would refuse too late): the engine core asks every worker first, for the levels that reach
    the workers, and sleeps as vLLM does where none shares or they cannot be asked."""
    from vllm.v1.engine.core import EngineCore

    from vllm_dedup.engine import worker_hooks
    from vllm_dedup.errors import SharedWeightsError

    worker_hooks.install()
    assert getattr(EngineCore.__dict__["sleep"], worker_hooks._MARK, False)
    executor = mock.Mock()
    if workers == "unreachable":
        executor.collective_rpc.side_effect = TimeoutError("no answer")
    else:
        executor.collective_rpc.return_value = workers
    core = object.__new__(EngineCore)
    core.model_executor = executor
    core.pause_scheduler = mock.Mock(return_value=None)  # the step that must not run if refused
    if level >= 1 and workers == [0, 4096]:
        with pytest.raises(SharedWeightsError, match="sleep is refused"):
            core.sleep(level=level)
        core.pause_scheduler.assert_not_called()
        executor.sleep.assert_not_called()
    else:
        core.sleep(level)
        core.pause_scheduler.assert_called_once()
    if level >= 1:  # asked by name: a module function, as the workers' processes import it
        executor.collective_rpc.assert_called_once_with(worker_hooks.shared_weight_bytes)
    else:
        executor.collective_rpc.assert_not_called()


def test_a_declined_replays_model_is_collected_before_the_usual_load(monkeypatch):
    """A model a replay gave up lives in reference cycles (a parameter's ``weight_loader`` is a
    bound method of its layer): without a collection it stayed, mapped and loaded tensors and
    all, while the usual load made the model again (vLLM collects only after ``load_weights``)."""
    import gc
    import types
    import weakref

    import torch

    import vllm_dedup.engine.loader as loader_module
    from vllm_dedup.engine.recipe import RecipeDeclined
    from vllm_dedup.errors import CheckpointError

    given_up = []

    class Replay:
        def __init__(self, *args):
            pass

        def build(self):
            layer = torch.nn.Linear(64, 64)
            layer.weight.weight_loader = layer.forward  # the cycle vLLM's layers make
            given_up.append(weakref.ref(layer))
            raise RecipeDeclined("a write into a mapped tensor")

    seen = {}

    def load_as_usual(*args):
        seen["alive"] = given_up[0]() is not None
        return "usual"

    def no_recorded_load(files):
        raise CheckpointError("f", "not recorded here")

    monkeypatch.setattr(loader_module, "fast_path_files", lambda ctx, inner: (["f"], ""))
    monkeypatch.setattr(loader_module, "decide", lambda ctx, files: types.SimpleNamespace(
        bytes_hashed=0, why="", match=object(), where={}, identities={}))
    monkeypatch.setattr(loader_module, "Replay", Replay)
    monkeypatch.setattr(loader_module, "RecordedLoad", no_recorded_load)
    loader = DedupModelLoader(LoadConfig(load_format="dedup"))
    monkeypatch.setattr(loader, "_load_as_usual", load_as_usual)
    ctx = types.SimpleNamespace(lease=None, model_name="m", vllm_config=None, model_config=None, prefix="")
    gc.disable()
    try:
        model = loader._load(ctx, types.SimpleNamespace(checkpoint_bytes_read=0))[0]
    finally:
        gc.enable()
    assert model == "usual" and seen == {"alive": False}


def test_a_hook_waits_for_a_module_another_thread_is_importing(tmp_path, monkeypatch):
    """wrapt runs a hook at once when its module is in ``sys.modules``, which it is while
    another thread still executes it: the hook waits for that import, or the class it wraps
    would be missing and stay unguarded."""
    import sys
    import threading
    import time

    from vllm_dedup.engine import worker_hooks

    (tmp_path / "slow_worker_module.py").write_text(
        "import time\ntime.sleep(0.5)\nclass Worker:\n    def sleep(self):\n        return 'slept'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importer = threading.Thread(target=__import__, args=("slow_worker_module",))
    importer.start()
    deadline = time.monotonic() + 10
    while "slow_worker_module" not in sys.modules and time.monotonic() < deadline:
        time.sleep(0.001)
    half = sys.modules["slow_worker_module"]
    assert not hasattr(half, "Worker")  # still executing in the other thread
    got = worker_hooks._on_import(half, [("Worker", "sleep", lambda method: lambda self: "guarded", None)])
    importer.join()
    monkeypatch.delitem(sys.modules, "slow_worker_module")
    assert got == ["Worker.sleep"] and half.Worker().sleep() == "guarded"


@pytest.mark.parametrize("decided", [True, False], ids=["no registry", "configured private"])
def test_an_engine_that_shares_nothing_runs_vllms_own_linears_not_plain_ones(monkeypatch, decided):
    """``cpu_linear="plain"`` runs ``F.linear`` on shared weights, at a third to two thirds of
    vLLM's oneDNN speed; an engine whose load stays private shares nothing, so it runs vLLM's
    own kernels (``private``): whether `_context` decided the mode before the registry failed,
    or returned before deciding it (a configuration that keeps weights private)."""
    import types

    from torch import nn
    from vllm.config import VllmConfig

    loader = DedupModelLoader(LoadConfig(load_format="dedup", model_loader_extra_config={"cpu_linear": "plain"}))
    config, model_config = VllmConfig(additional_config={}), types.SimpleNamespace(dtype="bfloat16")
    modes = []

    def private_load(vllm_config, model_config, prefix):
        if decided:
            loader.cpu_linear(model_config, vllm_config)  # decided on the way, as `_context` does
        return None

    def load_as_usual(*args):
        modes.append(loader.cpu_linear(model_config))
        return nn.Linear(2, 2)

    monkeypatch.setattr(loader, "_context", private_load)
    monkeypatch.setattr(loader, "_load_as_usual", load_as_usual)
    loader.load_model(config, model_config)
    assert modes == ["private"]


@pytest.mark.parametrize("on_error", ["fallback", "fail"])
def test_a_load_that_fails_inside_vllm_dedup_loads_again_privately_unless_fail(monkeypatch, caplog, on_error):
    """vLLM's ``load_weights`` runs with vllm-dedup's own code around it (recording, provenance,
    the in-place layout): an error of that code must not stop an engine that could load
    privately.  The model given up (in reference cycles, as vLLM's layers are) is collected
    before the private load makes the model again, and the layers it registered with vLLM by
    name are forgotten (vLLM refuses a name twice: "Duplicate layer name"); under ``fail`` the
    error stops the load.  Out of memory is raised at once: a second load would meet it too."""
    import gc
    import types
    import weakref

    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.attention import Attention

    config = VllmConfig()
    object.__setattr__(config, "model_config", types.SimpleNamespace(  # what Attention reads of it
        dtype=torch.float32, hf_config=None, is_attention_free=False, use_mla=False, is_mm_prefix_lm=False,
        rswa_window=None, get_sliding_window=lambda: None))
    given_up, seen = [], {}

    def build():  # as create_model makes a decoder layer: its attention registers by name
        layer = torch.nn.ModuleDict({"attn": Attention(4, 16, 0.25, prefix="model.layers.0.attn"),
                                     "proj": torch.nn.Linear(64, 64)})
        layer["proj"].weight.weight_loader = layer["proj"].forward  # the cycle vLLM's layers make
        return layer

    def fails_inside(ctx, report):
        given_up.append(weakref.ref(build()))
        raise RuntimeError("a bug in the recording (a test)")

    def load_as_usual(*args):
        seen["given up alive"] = given_up[0]() is not None
        return build()

    loader = DedupModelLoader(LoadConfig(load_format="dedup", model_loader_extra_config={"on_registry_error": on_error}))
    ctx = types.SimpleNamespace(model_name="m", device_type="cpu", failures_stop_the_engine=on_error == "fail")
    monkeypatch.setattr(loader, "_context", lambda *args: ctx)
    monkeypatch.setattr(loader, "_load_and_share", fails_inside)
    monkeypatch.setattr(loader, "_load_as_usual", load_as_usual)
    with set_current_vllm_config(config):
        if on_error == "fail":
            with pytest.raises(RuntimeError, match="a bug in the recording"):
                loader.load_model(config, config.model_config)
            return
        gc.disable()  # only the loader's own collection may free the model given up
        try:
            model = loader.load_model(config, config.model_config)
        finally:
            gc.enable()
        assert isinstance(model["attn"], Attention) and seen == {"given up alive": False} and loader.report is None
        assert "the load failed (RuntimeError: a bug in the recording" in caplog.text

        def out_of_memory(ctx, report):
            raise torch.OutOfMemoryError("out of memory (a test)")

        monkeypatch.setattr(loader, "_load_and_share", out_of_memory)
        with pytest.raises(torch.OutOfMemoryError):
            loader.load_model(config, config.model_config)


@pytest.mark.parametrize("workers", [[0, 0], [0, 4096]])
@pytest.mark.parametrize("method", ["reload_weights", "update_weights", "get_model", "a callable"])
def test_the_engine_core_asks_every_worker_before_it_calls_a_weight_writer_on_all(workers, method):
    """``EngineCore.collective_rpc("reload_weights")`` calls every worker: with tensor
    parallelism a rank that loaded privately would write while a rank that shares refuses,
    leaving a model half old and half new.  The engine core asks them all first, for the
    guarded methods only (by name; a callable or another method goes through unasked)."""
    from vllm.v1.engine.core import EngineCore

    from vllm_dedup.engine import worker_hooks
    from vllm_dedup.errors import SharedWeightsError

    worker_hooks.install()
    assert getattr(EngineCore.__dict__["collective_rpc"], worker_hooks._MARK, False)
    executor = mock.Mock()
    executor.collective_rpc.side_effect = lambda fn, *args, **kwargs: (
        workers if fn is worker_hooks.shared_weight_bytes else ["done"] * len(workers))
    core = object.__new__(EngineCore)
    core.model_executor = executor
    target = (lambda worker: None) if method == "a callable" else method
    guarded = method in ("reload_weights", "update_weights")
    if guarded and workers == [0, 4096]:
        with pytest.raises(SharedWeightsError, match=f"{method} is refused"):
            core.collective_rpc(target)
        executor.collective_rpc.assert_called_once_with(worker_hooks.shared_weight_bytes)  # nothing written
        return
    assert core.collective_rpc(target, kwargs={"x": 1}) == ["done", "done"]
    asked = [c for c in executor.collective_rpc.call_args_list if c.args[0] is worker_hooks.shared_weight_bytes]
    assert len(asked) == (1 if guarded else 0)
