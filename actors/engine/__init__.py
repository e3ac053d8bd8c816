"""The worker loops as plain objects: torch and transformers, no Ray, driven directly by tests.

Owns the prefill engine (scheduled chunks, prefix cache, KV out), the decode engine
(continuous batching, its bookkeeping, the sampler), the one place that runs the language
model (`lm_runner`), the KV layout, the encoder's batching and embedding cache, and when a
long forward makes way for a short prompt elsewhere on the node (`node_priority`).
The prefill order itself is torch-free and lives in `router.prefill_schedule`, so that the
simulator runs the same order.

Imports from this project: actors.engine, actors.models, actors.types, router
Never imports: ray, cluster
"""
