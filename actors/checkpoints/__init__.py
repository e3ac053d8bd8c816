"""A build tool: small, seeded checkpoints of every supported family, made locally.

Owns the recipes, the shared kit (tokenizer, weight draws), the trained `shapes-llava`
models and the pictures they learn from (`scenes`). The output is a directory that
`from_pretrained` loads as it would a published checkpoint; nothing at run time imports
this package except to build a missing built-in model. `python -m actors.checkpoints`.

Imports from this project: actors.checkpoints
Never imports: ray
"""
