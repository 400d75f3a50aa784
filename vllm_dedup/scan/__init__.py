"""`vllm-dedup scan`: how much co-serving checkpoints would share, read offline.  Checkpoint
readers (`readers`), a model's files and keys (`files`), the manifest cache of keys
(`manifest`), and the report (`report`)."""
