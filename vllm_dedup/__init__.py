"""vllm-dedup: a vLLM load format that stores shared weight tensors once per device.

The public names: the loader (``--load-format dedup``), its options, the errors it raises, and
the offline scan.  The package's folders are its architecture (docs/architecture.md): ``engine``
(inside a vLLM worker), ``content`` (content keys), ``segments`` (shareable memory),
``registry`` (what is resident where), ``scan`` (offline report).
"""

from .config import DedupConfig
from .errors import CheckpointError, DedupError, ProtocolError, RegistryUnavailable, SegmentError, SharedWeightsError

__version__ = "0.1.0"

__all__ = [
    "CheckpointError", "DedupConfig", "DedupError", "ProtocolError", "RegistryUnavailable", "SegmentError",
    "SharedWeightsError", "__version__",
]
