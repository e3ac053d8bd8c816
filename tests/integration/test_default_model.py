"""The embedded default model answers: over HTTP on a real local Ray + Serve, the trained
`shapes-llava-v2` of `configs/local_cpu.yaml` answers what it was taught (colour, shape, side) about
pictures it never saw (a held-out seed), greedy, with all requests in flight at once.
Concurrency also catches cross-request mix-ups (another request's picture or KV would
give another answer), which token-exactness on random weights can miss."""

from __future__ import annotations

import asyncio
from collections import Counter

import httpx
import pytest

from actors.checkpoints import scenes
from actors.checkpoints.shapes import SHAPES_RECIPES
from cluster.config import load_config
from cluster.prepare import ensure_model
from tests.integration.conftest import TEST_PORT, TRACE_PATH, deploy, png_data_url

HELD_OUT_SEED = 20261123  # the training stream uses the recipe's data_seed, never this
NUM_QUESTIONS = 64
MIN_ACCURACY = 0.90
MIN_PER_KIND = (
    0.75  # no kind of question hides behind the others (chance: 1/7 colour, 1/4 shape, 1/2 side)
)


@pytest.fixture(scope="module")
def default_app(ray_session, default_model_built):
    config = ensure_model(load_config())  # the embedded default, as `./scripts/serve` serves it
    return deploy(config.replace(server={"port": TEST_PORT, "trace_path": str(TRACE_PATH)}))


async def _ask_all(app, held_out: list[scenes.Sample]) -> list[str]:
    async with httpx.AsyncClient(base_url=app.root, timeout=300) as client:
        calls = [
            client.post(
                "/v1/chat/completions",
                json={
                    "model": app.config.model.served_name,
                    "temperature": 0,
                    "max_tokens": 8,
                    "messages": s.messages(
                        {"type": "image_url", "image_url": {"url": png_data_url(s.image)}}
                    ),
                },
            )
            for s in held_out
        ]
        responses = await asyncio.gather(*calls)
    for r in responses:
        assert r.status_code == 200, r.text
    return [r.json()["choices"][0]["message"]["content"] for r in responses]


def test_default_model_answers_held_out_questions(default_app):
    recipe = SHAPES_RECIPES[default_app.config.model.builtin]  # the default is a trained built-in
    held_out = scenes.samples(HELD_OUT_SEED, NUM_QUESTIONS, asks=recipe.asks)
    assert {s.ask for s in held_out} == set(recipe.asks), (
        "every kind of question it was taught is asked"
    )
    answers = asyncio.run(_ask_all(default_app, held_out))
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
