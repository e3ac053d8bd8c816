"""Routing: the cluster view, the TTFT cost model and its calibration, the policies.

Owns the joint (encoder, prefill, decode) pick and its baselines, the records they read,
the prefill order the engine and the simulator share (`prefill_schedule`), each pool's
worker settings as one record that the workers and the simulator take (`worker_settings`),
and the discrete-event simulator (`sim`). Plain Python, so the simulator and notebook run
anywhere.

Imports from this project: nothing
Never imports: torch, ray, transformers
"""
