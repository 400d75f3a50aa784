"""An engine-like process holding one segment through a `Lease` on the standalone registry
daemon or a Ray registry actor (for tests/integration/test_registry_restart.py).

    python tests/peers/lease_peer.py SOCKET publish KEY NBYTES
    python tests/peers/lease_peer.py SOCKET map KEY

``LEASE_PEER_RESTART=none`` in the environment: the lease starts no daemon when the registry
goes away (as for an engine of a Ray registry actor, which its creator brings back).

``publish`` publishes a segment of NBYTES holding a pattern derived from KEY; ``map`` maps the
resident copy of KEY.  Either prints ``OK {"digest": ...}`` (XXH3-128 of the bytes it maps),
reports a load, starts watching the lease, then answers each stdin line with
``OK {"digest": ..., "reregistrations": n}`` until stdin closes.  Like segment_peer, no torch.
"""

from __future__ import annotations

import functools
import json
import os
import random
import sys
from pathlib import Path

import xxhash

from vllm_dedup.registry.client import BrokerClient
from vllm_dedup.registry.daemon import start_daemon
from vllm_dedup.registry.lease import Lease
from vllm_dedup.segments.host import SEGMENT_MEMFD_NAME, HostSegment


def main() -> None:
    sock, mode, key = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    restart = None if os.environ.get("LEASE_PEER_RESTART") == "none" else functools.partial(start_daemon,
                                                                                          keep_warm_s=0.0)
    lease = Lease(BrokerClient(sock), f"peer-{mode}", "cpu", "default", "sig", restart)
    if mode == "publish":
        nbytes = int(sys.argv[4])
        data = random.Random(xxhash.xxh3_64_intdigest(key.encode())).randbytes(nbytes)
        seg = HostSegment.from_bytes(data, name=SEGMENT_MEMFD_NAME)
        lease.publish(seg.fileno(), seg.nbytes, [(key, 0, nbytes)])
        seg.close_fd()
        view = seg.view()
        lease.put_recipe(json.dumps({"signature": "sig", "id": key, "final": {key: nbytes}}).encode())
    else:
        (found,) = lease.acquire([key])
        (hit,), fd = found.hits, found.fd
        seg = HostSegment.attach(fd, hit.offset + hit.nbytes)
        seg.close_fd()
        view = seg.view()[hit.offset : hit.offset + hit.nbytes]
    lease.report({"published_bytes": len(view) if mode == "publish" else 0, "load_path": mode})
    lease.watch()
    print("OK " + json.dumps({"digest": xxhash.xxh3_128_hexdigest(view)}), flush=True)
    for _ in sys.stdin:
        print("OK " + json.dumps({"digest": xxhash.xxh3_128_hexdigest(view),
                                  "reregistrations": lease.reregistrations}), flush=True)
    lease.close()


if __name__ == "__main__":
    main()
