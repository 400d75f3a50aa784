"""Test and demo scaffolding for vllm-dedup: real engines in child processes, memory (PSS),
the sample checkpoints and their variants.  Not shipped in the wheel; the tests, benchmarks and
examples import it from the repository root."""
