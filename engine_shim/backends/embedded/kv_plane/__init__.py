"""The embedded backend's KV data plane between shims (`microserving.v1.KVTransfer`): the
`kv_addr_info` format (`addr`), chunk encoding (`codec`), reservations and the receiving
servicer (`reservations`, `receiver`), pushes (`sender`), the same-host shared-memory path
(`shm`), the NIXL path (`nixl*`, `hold`) and the peer allow-list (`peers`)."""
