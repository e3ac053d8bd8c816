"""Model adapters: the one interface between the workers and a Hugging Face model family.

Owns, per family, which parts of a checkpoint are the towers, the projector and the language
model, how many placeholder tokens an item expands to, where a checkpoint's files are on this
node (`source`), and loading only the part one worker runs (`part_load`). Families are named
by `model_type` in `adapter.FAMILIES`.

Imports from this project: actors.models, actors.engine.kv, actors.types, router.types
Never imports: ray
"""
