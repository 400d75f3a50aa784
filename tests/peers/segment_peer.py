"""A process that publishes or maps one segment through a broker (for the broker tests).

    python tests/segment_peer.py SOCKET publish KEY NBYTES [GROUP]
    python tests/segment_peer.py SOCKET map KEY [GROUP]
    python tests/segment_peer.py SOCKET write KEY [GROUP]
    python tests/segment_peer.py SOCKET lock NAME[,NAME...] [OWNER [DEVICE]]

``publish`` fills a tensor of NBYTES with a pattern derived from KEY and publishes it;
``map`` maps the resident copy and prints its XXH3-128 digest; ``write`` maps it and then
writes into the mapping (which must fault); ``lock`` takes the registry locks NAMEs (all or none, for OWNER).  Each prints one ``OK {...}`` line, then holds its
lease until stdin closes.
"""

from __future__ import annotations

import ctypes
import json
import sys

import torch
import xxhash

from vllm_dedup.registry.client import BrokerClient
from vllm_dedup.segments.host import HostSegment


def pattern(key: str, nbytes: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(int(xxhash.xxh3_64_intdigest(key.encode())) % (1 << 62))
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)


def main() -> None:
    sock, mode, key = sys.argv[1], sys.argv[2], sys.argv[3]
    client = BrokerClient(sock)
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
        seg = HostSegment.create(pattern(key, nbytes))
        seg_id = client.publish(seg.fileno(), seg.nbytes, [(key, 0, seg.nbytes)])
        seg.close_fd()
        view = seg.tensor(0, torch.uint8, (nbytes,), (1,))
        print("OK " + json.dumps({"segment": seg_id, "digest": xxhash.xxh3_128_hexdigest(view.numpy())}), flush=True)
    else:
        group = sys.argv[4] if len(sys.argv) > 4 else "default"
        client.hello("peer", "cpu", group)
        hits = client.acquire([key])
        if not hits:
            print("OK " + json.dumps({"hit": False}), flush=True)
        else:
            (hit, fd), = hits
            seg = HostSegment.attach(fd, hit.nbytes)
            view = seg.tensor(hit.offset, torch.uint8, (hit.nbytes,), (1,))
            if mode == "write":
                print("WRITING", flush=True)
                ctypes.memset(view.data_ptr(), 0, 1)  # must fault: the mapping is read-only
                print("WROTE", flush=True)
            print("OK " + json.dumps({"hit": True, "digest": xxhash.xxh3_128_hexdigest(view.numpy())}), flush=True)
    sys.stdin.read()
    client.close()


if __name__ == "__main__":
    main()
