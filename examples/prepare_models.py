"""Make the real sample checkpoints ready and print their paths, one per line.

SmolLM2-135M-Instruct is converted from its packaged GGUF into an HF folder (once, cached),
then the variants of `vllm_dedup.variants` are built from it; all-MiniLM-L6-v2 and the GGUF
itself are printed as they are installed.  Everything goes under the cache directory
(``$VLLM_DEDUP_CACHE_DIR``, default ``~/.cache/vllm-dedup``).

    python examples/prepare_models.py [--kinds last-layers,vocab-extended]
"""

from __future__ import annotations

import argparse

from vllm_dedup.manifest import default_cache_dir
from vllm_dedup.sample_models import minilm_dir, smollm2_gguf, smollm2_hf
from vllm_dedup.variants import VARIANT_KINDS, build_variant


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", default=",".join(VARIANT_KINDS), help="variant kinds to build, comma-separated")
    parser.add_argument("--no-extra", action="store_true", help="print only SmolLM2 and its variants")
    args = parser.parse_args()
    base = smollm2_hf()
    paths = [base]
    for kind in filter(None, args.kinds.split(",")):
        out = default_cache_dir() / "variants" / f"{base.name}-{kind}"
        paths.append(out if (out / "config.json").exists() else build_variant(base, kind, out))
    if not args.no_extra:
        paths += [smollm2_gguf(), minilm_dir()]
    print("\n".join(map(str, paths)))


if __name__ == "__main__":
    main()
