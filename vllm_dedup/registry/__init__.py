"""The registry: which content is resident where, and who holds it (`state`), behind a Unix
socket that carries segment descriptors (`wire`, `messages`, `server`, `client`), hosted by a Ray
actor per node (`ray_actor`, with `metrics`; each node's socket in its own place: `nodes`) or
a standalone daemon (`daemon`), found or started by `discovery`."""
