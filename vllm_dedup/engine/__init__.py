"""What runs inside a vLLM worker: the loader (`loader`), this engine's session (`session`),
sharing a loaded model (`share`, over `slots`), and the Worker wrappers (`worker_hooks`)."""
