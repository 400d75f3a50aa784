"""vllm-dedup: a vLLM load format that stores shared weight tensors once per device."""

__version__ = "0.1.0"
