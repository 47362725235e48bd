"""`microserving bench capacity`: the control plane's token relay capacity on a CPU machine,
against synthetic engines that keep a measured GPU schedule (engine_shim/backends/synthetic)."""
