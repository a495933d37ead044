"""The Coral pipeline engine: serving instances that run any template (uneven pipeline stages, data-parallel nodes
inside a stage, mixed node types) on real model code, with a layer-resharded KV hand-off from prefill to decode."""
