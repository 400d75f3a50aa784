"""Segments: memory that several processes map, freed when the last holder lets go.

`base.Segment` is the protocol; one module per backend (`host`: memfd, `cuda`: CUDA VMM);
`packing` plans how small tensors share one granularity-sized segment.
"""

from .base import Segment, segment_class

__all__ = ["Segment", "segment_class"]
