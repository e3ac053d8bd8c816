"""The workers: three Ray actor kinds, each a thin shell over a plain engine.

Owns the actor shells (`encoder`, `prefill`, `decode`), the worker process set-up they share
(`runtime`, `idle_cores`, `inbox`) and the typed records that cross stages (`types`).
Sub-packages: `engine` (the loops, torch and no Ray), `models` (adapters over Hugging Face
families), `checkpoints` (a build tool for small seeded checkpoints, not the runtime).
The ingress, its media decoding and the fleet live in `cluster/`, which may import this
package; this package never imports `cluster/`.

Imports from this project: actors, router
"""
