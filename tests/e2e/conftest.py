"""Plain references for the end-to-end tests, each made once per test run: the greedy
tokens of a plain (``auto``) engine of SmolLM2 and of its variants, the completions of a
plain ``vllm serve``, and the final tensors of a plain load.  Every dedup engine's answers and
tensors are compared with these.

Under pytest-xdist each worker is a test session of its own; a reference is made by the first
worker that asks for it and read from a file by the others (`once_per_run`, the pattern
pytest-xdist documents for session fixtures that must run once), so the two workers of
``tests/run.sh`` do not each start the same plain engines.
"""

from __future__ import annotations

import hashlib
import json

import pytest
from filelock import FileLock

from harness.engines import PROMPTS, EngineProcess, ServeProcess
from harness.oracle import differences
from harness.references import engine_reference


@pytest.fixture(scope="session")
def once_per_run(tmp_path_factory, worker_id):
    """``(name, make) -> make()``, a JSON value made once per test run: by the first xdist worker
    that asks (the others wait on a file lock, then read its file)."""
    root = tmp_path_factory.getbasetemp()
    if worker_id != "master":  # .../pytest-N/popen-gwK: the run's folder is the parent
        root = root.parent
    root = root / "references"
    root.mkdir(exist_ok=True)

    def get(name: str, make):
        path = root / f"{hashlib.sha256(name.encode()).hexdigest()[:24]}.json"
        with FileLock(f"{path}.lock"):
            if path.is_file():
                return json.loads(path.read_text())
            value = make()
            path.write_text(json.dumps(value))
            return value

    return get


@pytest.fixture(scope="session")
def plain_completions(smollm2, variants, once_per_run):
    """model folder -> a plain engine's greedy completions for `PROMPTS` (``{"ids", "texts"}``,
    made on first use).  Each plain engine also shows that the guards let in-place writers
    through when nothing is shared."""

    def make(model) -> dict:
        with EngineProcess(model, "auto") as plain:
            plain.wait_ready()
            out = plain.complete()
            assert plain.rpc("reset_weights") == "ok"  # no guard without shared weights
        return {"ids": out["ids"], "texts": out["texts"]}

    return lambda model: once_per_run(f"plain-completions:{model}", lambda: make(model))


@pytest.fixture(scope="session")
def plain_tokens(plain_completions):
    """model folder -> greedy token ids of a plain engine for `PROMPTS`."""
    return lambda model: plain_completions(model)["ids"]


@pytest.fixture(scope="session")
def plain_smollm2(plain_tokens, smollm2) -> list[list[int]]:
    return plain_tokens(smollm2)


@pytest.fixture(scope="session")
def plain_serve_texts(smollm2, tmp_path_factory, once_per_run) -> list[str]:
    """Completions of a plain ``vllm serve`` of SmolLM2 for `PROMPTS`."""

    def make() -> list[str]:
        plain = ServeProcess(smollm2, "auto", tmp_path_factory.mktemp("plain-serve") / "auto.log", core=0).wait_ready()
        try:
            return plain.complete(PROMPTS)
        finally:
            plain.stop()

    return once_per_run(f"plain-serve-texts:{smollm2}", make)


@pytest.fixture(scope="session")
def reference_tensors(once_per_run):
    """``(model folder, dtype="bfloat16") -> digests`` of the final tensors of a plain load of
    that checkpoint with the dedup loader's options (`harness.references`), made on first use."""

    def make(model, dtype: str) -> dict[str, str]:
        (tensors,) = engine_reference(model, dtype=dtype)["tensors"]
        return tensors

    return lambda model, dtype="bfloat16": once_per_run(f"reference-tensors:{model}:{dtype}",
                                                        lambda: make(model, dtype))


@pytest.fixture(scope="session")
def same_tensors(reference_tensors):
    """``(engine, model folder, dtype="bfloat16")``: assert that every worker of a running
    `EngineProcess` or `ServeProcess` holds exactly the reference's final tensors; a failure
    names the tensors that differ."""

    def check(engine, model, dtype: str = "bfloat16") -> None:
        reference = reference_tensors(model, dtype)
        workers = engine.final_tensors()
        assert workers and all(workers), f"no worker answered with its tensors: {workers!r:.200}"
        for rank, tensors in enumerate(workers):
            differ = differences(tensors, reference)
            assert not differ, f"worker {rank}: {len(differ)} tensors differ from a plain load's: {differ[:5]}"

    return check
