"""The live routing bench (scripts/bench_routing_live.py) and the replay of its saved runs
(scripts/bench_routing_replay.py): its command line and fleet (config), saved runs and
traces (runs), the simulator calibrated from a run (sim), and the printed report (report)."""
