"""Media decoding for the ingress: untrusted bytes -> pixels, samples and frames, under limits.

Owns payload parsing (`payload`, `fetch`), the decoders per modality (`image`, `audio`,
`video`, `probe`), budgets, the capped child processes that decode (`procs`, `child`), and
content identifiers. `load.load_media_item` is the entry point. No model is involved here.

Imports from this project: cluster.media, actors.types, router.types
Never imports: torch, ray, transformers
"""
