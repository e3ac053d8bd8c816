"""Memory a worker holds for a Qwen2.5-Omni checkpoint in the published layout: the thinker
alone (what epd loads) against the whole model (thinker + talker + token2wav), the baseline,
each loaded in a fresh process. Reports parameter bytes and the process's resident-memory
growth while loading (after a warm-up load, so lazy imports do not count).

    python scripts/omni_thinker_memory.py [CHECKPOINT_DIR]   # default: builds tiny-qwen2.5-omni
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

_PROBE = """
import gc, json, sys, torch
from actors.models.omni import load_thinker
from transformers import Qwen2_5OmniForConditionalGeneration
def rss_mib(): return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
path, which = sys.argv[1], sys.argv[2]
if which == "thinker":
    load = lambda: load_thinker(path, torch.float32)
else:
    load = lambda: Qwen2_5OmniForConditionalGeneration.from_pretrained(path)
load(); gc.collect()  # warm-up: imports and allocator
before = rss_mib()
model = load(); gc.collect()
param_mib = sum(p.nbytes for p in model.parameters()) / 2**20
print(json.dumps({"param_mib": param_mib, "rss_growth_mib": rss_mib() - before}))
"""


def probe(checkpoint: Path, which: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, str(checkpoint), which],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("checkpoint", nargs="?", type=Path, help="default: tiny-qwen2.5-omni")
    args = parser.parse_args()
    from actors.checkpoints.build import ensure_checkpoint

    checkpoint = args.checkpoint or ensure_checkpoint(
        Path("~/.cache/epd/models/tiny-qwen2.5-omni").expanduser(), "tiny-qwen2.5-omni"
    )
    thinker, whole = probe(checkpoint, "thinker"), probe(checkpoint, "whole")
    print(f"checkpoint {checkpoint}")
    for name, row in (("thinker only (epd)", thinker), ("whole model (baseline)", whole)):
        print(
            f"{name:24s} params {row['param_mib']:8.2f} MiB   "
            f"RSS growth {row['rss_growth_mib']:8.2f} MiB"
        )
    print(f"ratio thinker/whole: params {thinker['param_mib'] / whole['param_mib']:.3f}")


if __name__ == "__main__":
    main()
