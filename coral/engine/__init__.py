"""The Coral pipeline engine: serving instances that run any template (uneven pipeline stages, data-parallel nodes
inside a stage, mixed node types) on real model code, with a layer-resharded KV hand-off from prefill to decode.
Each micro-batch runs as one flattened batch of tokens over a paged KV cache per node (`coral.engine.shard`);
the scheduler forms micro-batches under a token budget and admits and preempts by KV blocks
(`coral.engine.scheduler`).

Entry points:
- `CoralInstance.from_plan(plan_instance, checkpoint, EngineConfig(...)).start()`: one process per node, the
  scheduler and an OpenAI-compatible server on `.url`; `.stop()`. `EngineConfig(local=True)` runs the nodes as
  threads (tests); `http=False` leaves `.scheduler` to drive directly (benchmarks).
- `CoralEngineBackend`, in the runtime's `coral_backend` module: the controller backend (`coral serve --backend
  coral`). The engine imports nothing from the runtime (its HTTP serving is `coral.http_serving`, below both).
- `python -m coral.engine.instance PLAN INSTANCE_ID CHECKPOINT [--no-launch ...]`: one instance across machines.
- `coral.engine.reference.WholeModel`: the same checkpoint run whole by transformers (exactness reference).
"""
