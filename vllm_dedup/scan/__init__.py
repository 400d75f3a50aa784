"""`vllm-dedup scan`: how much co-serving checkpoints would share, read offline.  A model's
files and keys (`files`), the report (`report`) and its plot (`plot`); the checkpoint readers
and the manifest cache of keys are in `vllm_dedup.checkpoint`."""
