"""What the benchmarks and probes in scripts/ share, one concept per module; each script keeps
only its own command (argparse, main and what no other script does).

    stats           percentiles of measured latencies
    workload        the load benchmark's seeded Poisson requests (prompts, some with a PNG)
    http_client     streaming chat client: request bodies, one SSE request timed, replays
    modality_mix    the mixed-modality benchmark's requests per kind and their replay
    media           generated media: noise images, GIF clips, WAV audio, photos, encoded videos
    cpu             CPU seconds per process (CpuWatch) and the /proc process table
    live_server     a served app for a benchmark: started on an own Ray, always shut down
    server_metrics  a served app's Prometheus /metrics between phases
    sim_shapes      simulated clusters and workloads the simulator benchmarks share
    routing/        the live routing bench: command line, saved runs, calibrated simulator, report
    probe_cases     the hardening probe's bad-input request bodies and media
    probe_client    one probe request sent and classified; many at once with a progress bar
    probe_faults    the probe's kill and disconnect phases
    probe_report    the probe's results and tables
    rss             the server's worker and ingress pids, and their RSS sampled over time
    dashboard       the Grafana dashboard over /metrics (docs/grafana/epd.json)
    decode_engine   the decode engine's step against the plain forward, and its host syncs
    decode_http     TPOT of concurrent streams over HTTP against `generate` on the same batch
    detok           the ingress detokenizer's cost per token

A script run as `python scripts/<name>.py` has scripts/ first on sys.path, so `import benchkit`
works without a path edit; pytest gets it from `pythonpath = ["scripts"]` (pyproject.toml).
`cluster`, `actors` and `router` come from the venv's editable install, the tree it was made
from, whichever folder the script runs in: compare two commits with `scripts/bench_ab`, which
puts each side's own tree first (PYTHONPATH, inherited by Ray's workers).
"""
