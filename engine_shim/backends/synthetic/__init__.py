"""BENCHMARK ONLY: the `synthetic` shim backend, an engine that computes nothing and emits
tokens on a schedule measured on a GPU, so the control plane's capacity can be measured on a
CPU machine (`microserving bench capacity`). Never use it to test the engine itself."""
