"""The embedded default model answers: over HTTP, the trained `shapes-llava-v2` of
`configs/local_cpu.yaml` answers what it was taught (colour, shape, side) about pictures it
never saw (a held-out seed), greedy, with all requests in flight at once. Concurrency also
catches cross-request mix-ups (another request's picture or KV would give another answer),
which token-exactness on random weights can miss.

The questions go to the `serve run configs/serve.yaml` run (serve_run_check.py), which serves
that default config on a Ray of its own in the background: a fleet of the default model
fewer on the shared cluster."""

from __future__ import annotations

from collections import Counter

import pytest

from actors.checkpoints.shapes import SHAPES_RECIPES
from cluster.config import load_config
from tests import background
from tests.integration import test_serve_run
from tests.integration.serve_run_check import held_out_samples

MIN_ACCURACY = 0.90
MIN_PER_KIND = (
    0.75  # no kind of question hides behind the others (chance: 1/7 colour, 1/4 shape, 1/2 side)
)


@pytest.fixture(scope="module")
def answers() -> list[str]:
    outcome = background.json_outcome("serve-run", test_serve_run.start_run, timeout_s=600)
    assert "error" not in outcome, outcome["error"] + outcome["log_tail"]
    replies = outcome["held_out"]
    assert all(status == 200 for status, _ in replies), replies
    return [answer for _, answer in replies]


def test_default_model_answers_held_out_questions(answers):
    held_out = held_out_samples()
    recipe = SHAPES_RECIPES[load_config().model.builtin]
    assert {s.ask for s in held_out} == set(recipe.asks)  # every kind it was taught is asked
    assert len(answers) == len(held_out)
    right, asked = Counter(), Counter()
    for sample, answer in zip(held_out, answers):
        asked[sample.ask] += 1
        right[sample.ask] += answer.strip() == sample.answer
    by_kind = {a.value: f"{right[a]}/{asked[a]}" for a in asked}
    accuracy = sum(right.values()) / len(held_out)
    wrong = [(s.question, s.answer, a) for s, a in zip(held_out, answers) if a.strip() != s.answer]
    print(f"default model over HTTP: accuracy {accuracy:.3f} ({by_kind})")  # shown with -rA
    assert accuracy >= MIN_ACCURACY, f"accuracy {accuracy:.2f} ({by_kind}); wrong: {wrong[:10]}"
    assert all(right[a] >= MIN_PER_KIND * asked[a] for a in asked), (
        f"{by_kind}; wrong: {wrong[:10]}"
    )
