"""Plain references for the end-to-end tests, each made once per test session: the greedy
tokens of a plain (``auto``) engine of SmolLM2 and of its variants, and the completions of a
plain ``vllm serve``.  Every dedup engine's answers are compared with these."""

from __future__ import annotations

import pytest

from harness.engines import PROMPTS, EngineProcess, ServeProcess
from harness.oracle import differences
from harness.references import engine_reference


@pytest.fixture(scope="session")
def plain_completions(smollm2, variants):
    """model folder -> a plain engine's greedy completions for `PROMPTS` (``{"ids", "texts"}``,
    made on first use).  The first plain engine also shows that the guards let in-place writers
    through when nothing is shared."""
    made: dict = {}

    def completions(model) -> dict:
        if model not in made:
            with EngineProcess(model, "auto") as plain:
                plain.wait_ready()
                made[model] = plain.complete()
                if not made.get("guard-checked"):
                    assert plain.rpc("reset_weights") == "ok"  # no guard without shared weights
                    made["guard-checked"] = True
        return made[model]

    return completions


@pytest.fixture(scope="session")
def plain_tokens(plain_completions):
    """model folder -> greedy token ids of a plain engine for `PROMPTS`."""
    return lambda model: plain_completions(model)["ids"]


@pytest.fixture(scope="session")
def plain_smollm2(plain_tokens, smollm2) -> list[list[int]]:
    return plain_tokens(smollm2)


@pytest.fixture(scope="session")
def plain_serve_texts(smollm2, tmp_path_factory) -> list[str]:
    """Completions of a plain ``vllm serve`` of SmolLM2 for `PROMPTS`."""
    plain = ServeProcess(smollm2, "auto", tmp_path_factory.mktemp("plain-serve") / "auto.log", core=0).wait_ready()
    try:
        return plain.complete(PROMPTS)
    finally:
        plain.stop()


@pytest.fixture(scope="session")
def reference_tensors():
    """``(model folder, dtype="bfloat16") -> digests`` of the final tensors of a plain load of
    that checkpoint with the dedup loader's options (`harness.references`), made on first use."""
    made: dict = {}

    def reference(model, dtype: str = "bfloat16") -> dict[str, str]:
        key = (str(model), dtype)
        if key not in made:
            (made[key],) = engine_reference(model, dtype=dtype)["tensors"]
        return made[key]

    return reference


@pytest.fixture(scope="session")
def same_tensors(reference_tensors):
    """``(engine, model folder, dtype="bfloat16")``: assert that every worker of a running
    `EngineProcess` or `ServeProcess` holds exactly the reference's final tensors; a failure
    names the tensors that differ."""

    def check(engine, model, dtype: str = "bfloat16") -> None:
        reference = reference_tensors(model, dtype)
        for rank, tensors in enumerate(engine.final_tensors()):
            differ = differences(tensors, reference)
            assert not differ, f"worker {rank}: {len(differ)} tensors differ from a plain load's: {differ[:5]}"

    return check
