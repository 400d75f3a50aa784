"""Checkpoints: reading weight files zero-copy in every format we know (`readers.py`), the
manifest cache of their tensors' source keys (`manifest.py`), and what vLLM's default loader
reads of a model folder (`loading.py`).  Used by the engine side and by ``vllm-dedup scan``."""
