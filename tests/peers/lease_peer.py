"""An engine-like process holding one segment through a `Lease` on the standalone registry
daemon or a Ray registry actor (for tests/integration/test_registry_restart.py).

    python tests/peers/lease_peer.py SOCKET publish KEY NBYTES
    python tests/peers/lease_peer.py SOCKET map KEY
    python tests/peers/lease_peer.py SOCKET publish-locked KEY1,KEY2 NBYTES
    python tests/peers/lease_peer.py SOCKET share KEY1,KEY2,... NBYTES [hold]

``LEASE_PEER_RESTART=none`` in the environment: the lease starts no daemon when the registry
goes away (as for an engine of a Ray registry actor, which its creator brings back).

``publish`` publishes a segment of NBYTES holding a pattern derived from KEY; ``map`` maps the
resident copy of KEY.  Either prints ``OK {"digest": ...}`` (XXH3-128 of the bytes it maps),
reports a load, starts watching the lease, then answers each stdin line with
``OK {"digest": ..., "reregistrations": n}`` until stdin closes.  Like segment_peer, no torch.

The two others share as an engine's load does (`engine.share`), under the publish lock
``publish:cpu:default``, each key's bytes being the pattern ``publish`` makes:

- ``publish-locked``: takes the lock, publishes KEY1, prints ``OK {"published": [KEY1]}``, waits
  for a stdin line, publishes KEY2, gives the lock back and prints ``OK {"digests": {...},
  "reregistrations": n}``, or ``ERR <message>`` when the lease refuses (a lock lost);
- ``share``: prints ``LOCKING``, takes the lock, acquires every key (mapping the hits), publishes
  the misses, (with ``hold``: prints ``HOLDING`` and waits for a stdin line,) gives the lock back
  and prints ``OK {"mapped": [...], "published": [...], "digests": {...}, "reregistrations": n}``.

Both then wait for stdin to close.
"""

from __future__ import annotations

import functools
import json
import os
import random
import sys
from pathlib import Path

import xxhash

from vllm_dedup.errors import RegistryUnavailable
from vllm_dedup.registry.client import RegistryClient
from vllm_dedup.registry.daemon import start_daemon
from vllm_dedup.registry.lease import Lease
from vllm_dedup.segments.host import SEGMENT_MEMFD_NAME, HostSegment


LOCK = "publish:cpu:default"


def pattern(key: str, nbytes: int) -> bytes:
    return random.Random(xxhash.xxh3_64_intdigest(key.encode())).randbytes(nbytes)


def publish_key(lease: Lease, key: str, nbytes: int) -> memoryview:
    seg = HostSegment.from_bytes(pattern(key, nbytes), name=SEGMENT_MEMFD_NAME)
    lease.publish(seg.fileno(), seg.nbytes, [(key, 0, nbytes)])
    seg.close_fd()
    return seg.view()


def locked_modes(lease: Lease, mode: str, keys: list[str], nbytes: int, hold: bool) -> None:
    views: dict[str, memoryview] = {}
    if mode == "publish-locked":
        lease.lock(LOCK)
        views[keys[0]] = publish_key(lease, keys[0], nbytes)
        print("OK " + json.dumps({"published": keys[:1]}), flush=True)
        sys.stdin.readline()
        try:
            for key in keys[1:]:
                views[key] = publish_key(lease, key, nbytes)
        except RegistryUnavailable as e:
            print("ERR " + str(e).replace("\n", " "), flush=True)
        else:
            print("OK " + json.dumps({"digests": {k: xxhash.xxh3_128_hexdigest(v) for k, v in views.items()},
                                      "reregistrations": lease.reregistrations}), flush=True)
        lease.unlock(LOCK)
    else:
        print("LOCKING", flush=True)
        with lease.locked(LOCK):
            mapped = []
            for found in lease.acquire(keys):
                seg = HostSegment.attach(found.fd, max(h.offset + h.nbytes for h in found.hits))
                seg.close_fd()
                for hit in found.hits:
                    views[hit.key] = seg.view()[hit.offset : hit.offset + hit.nbytes]
                    mapped.append(hit.key)
            published = [k for k in keys if k not in views]
            for key in published:
                views[key] = publish_key(lease, key, nbytes)
            if hold:
                print("HOLDING", flush=True)
                sys.stdin.readline()
        print("OK " + json.dumps({"mapped": mapped, "published": published,
                                  "digests": {k: xxhash.xxh3_128_hexdigest(v) for k, v in views.items()},
                                  "reregistrations": lease.reregistrations}), flush=True)
    for _ in sys.stdin:
        pass
    lease.close()


def main() -> None:
    sock, mode, key = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    restart = None if os.environ.get("LEASE_PEER_RESTART") == "none" else functools.partial(start_daemon,
                                                                                          keep_warm_s=0.0)
    lease = Lease(RegistryClient(sock), f"peer-{mode}", "cpu", "default", "sig", restart)
    if mode in ("publish-locked", "share"):
        locked_modes(lease, mode, key.split(","), int(sys.argv[4]), sys.argv[5:] == ["hold"])
        return
    if mode == "publish":
        nbytes = int(sys.argv[4])
        view = publish_key(lease, key, nbytes)
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
