"""Content: what names a tensor's bytes.  XXH3-128 content keys on the host (`keys`), device
fingerprints and the exact byte compare on a GPU (`fingerprint`), byte views (`views`)."""
