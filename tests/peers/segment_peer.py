"""A process that publishes or maps one segment through a registry (for the registry tests).

    python tests/peers/segment_peer.py SOCKET publish KEY NBYTES [GROUP]
    python tests/peers/segment_peer.py SOCKET map KEY [GROUP]
    python tests/peers/segment_peer.py SOCKET write KEY [GROUP]
    python tests/peers/segment_peer.py SOCKET lock NAME[,NAME...] [OWNER [DEVICE]]

``publish`` fills a segment of NBYTES with a pattern derived from KEY and publishes it; ``map``
maps the resident copy and prints its XXH3-128 digest; ``write`` maps it and then writes into
the mapping (which must fault); ``lock`` takes the registry locks NAMEs (all or none, for
OWNER).  Each prints one ``OK {...}`` line, then holds its lease until stdin closes.  It needs
no torch (a peer starts in a tenth of the time): segments are bytes here.
"""

from __future__ import annotations

import ctypes
import json
import random
import sys

import numpy as np
import xxhash

from vllm_dedup.registry.client import RegistryClient
from vllm_dedup.segments.host import HostSegment


def pattern(key: str, nbytes: int) -> bytes:
    return random.Random(xxhash.xxh3_64_intdigest(key.encode())).randbytes(nbytes)


def main() -> None:
    sock, mode, key = sys.argv[1], sys.argv[2], sys.argv[3]
    client = RegistryClient(sock)
    if mode == "lock":
        owner = sys.argv[4] if len(sys.argv) > 4 else None
        client.hello("peer", sys.argv[5] if len(sys.argv) > 5 else "cpu", "default")
        with client.locked(key.split(","), owner=owner):
            print("OK " + json.dumps({"locked": key}), flush=True)
            sys.stdin.read()
        return
    if mode == "publish":
        nbytes = int(sys.argv[4])
        group = sys.argv[5] if len(sys.argv) > 5 else "default"
        client.hello("peer", "cpu", group)
        seg = HostSegment.from_bytes(pattern(key, nbytes), name="vllm-dedup")
        seg_id = client.publish(seg.fileno(), seg.nbytes, [(key, 0, seg.nbytes)])
        seg.close_fd()
        print("OK " + json.dumps({"segment": seg_id, "digest": xxhash.xxh3_128_hexdigest(seg.view())}), flush=True)
    else:
        group = sys.argv[4] if len(sys.argv) > 4 else "default"
        client.hello("peer", "cpu", group)
        hits = client.acquire([key])
        if not hits:
            print("OK " + json.dumps({"hit": False}), flush=True)
        else:
            (found,) = hits
            (hit,), fd = found.hits, found.fd
            seg = HostSegment.attach(fd, hit.offset + hit.nbytes)
            view = seg.view()[hit.offset :]
            if mode == "write":
                print("WRITING", flush=True)
                ctypes.memset(np.frombuffer(view, np.uint8).ctypes.data, 0, 1)  # must fault: read-only
                print("WROTE", flush=True)
            print("OK " + json.dumps({"hit": True, "digest": xxhash.xxh3_128_hexdigest(view)}), flush=True)
    sys.stdin.read()
    client.close()


if __name__ == "__main__":
    main()
