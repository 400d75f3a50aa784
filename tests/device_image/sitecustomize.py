"""Imported at start-up by every Python process whose ``PYTHONPATH`` names this folder: it makes
the packages the lent GPU machines' image lacks unimportable, as they are there
(/work/.library/device/KINDS.md lists that image's packages: torch, cuda-bindings,
safetensors, xxhash, transformers and nvidia-ml-py, but neither vLLM, Ray, blake3 nor gguf).
`tests/integration/test_cuda.py` runs ``benchmarks/gpu_check.py`` under it, so that a module
the script reaches importing one of them at its top fails here, not on the GPU machine."""

import importlib.abc
import sys

ABSENT = frozenset({"vllm", "ray", "blake3", "gguf"})


class _Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in ABSENT:
            raise ModuleNotFoundError(f"No module named {fullname!r} (not on the GPU machines' image)",
                                      name=fullname)
        return None


sys.meta_path.insert(0, _Absent())
