"""Synthetic pictures of coloured shapes with questions about them and their answers.

What the built-in `shapes-llava(-v2)` checkpoints are trained on, and what its accuracy tests ask.
A scene is copies of one shape in one colour on a dark grey background; a picture of one
shape also has a side (left or right). Everything is drawn from a numpy Generator,
so a seed gives the same pictures and questions on every machine.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 190, 40),
    "blue": (40, 70, 230),
    "yellow": (235, 220, 30),
    "white": (240, 240, 240),
    "purple": (150, 40, 190),
    "orange": (245, 140, 20),
}
SHAPES = ("circle", "square", "triangle", "cross")
COUNT_WORDS = ("one", "two", "three")
SIDES = ("left", "right")
MAX_COUNT = 1  # shapes per scene; more (and the count question) not taught yet


class Ask(enum.Enum):
    """What a question asks about a scene."""

    COLOUR = "colour"
    SHAPE = "shape"
    COUNT = "count"
    SIDE = "side"  # only asked of one-shape scenes


QUESTIONS: dict[Ask, tuple[str, ...]] = {
    Ask.COLOUR: (
        "What colour is the shape?",
        "What color is the shape?",
        "What colour is it?",
        "Which colour are the shapes?",
    ),
    Ask.SHAPE: (
        "What shape is it?",
        "What shape is this?",
        "Which shape is shown?",
        "What shape are they?",
    ),
    Ask.COUNT: ("How many shapes are there?", "How many shapes?", "Count the shapes."),
    Ask.SIDE: (
        "Is the shape on the left or the right?",
        "Where is the shape?",
        "Which side is it on?",
    ),
}


@dataclass(frozen=True)
class Scene:
    """What a picture shows; `side` is None when it shows more than one shape."""

    colour: str
    shape: str
    count: int
    side: str | None

    def answer(self, ask: Ask) -> str:
        if ask is Ask.COLOUR:
            return self.colour
        if ask is Ask.SHAPE:
            return self.shape
        if ask is Ask.COUNT:
            return COUNT_WORDS[self.count - 1]
        if self.side is None:
            raise ValueError("a scene of several shapes has no side")
        return self.side


@dataclass(frozen=True)
class Sample:
    """One picture, a question about it, and its one-word answer."""

    image: Image.Image
    scene: Scene
    ask: Ask
    question: str
    image_first: bool  # whether the picture comes before the question in the message

    @property
    def answer(self) -> str:
        return self.scene.answer(self.ask)

    def messages(self, image_part: dict) -> list[dict]:
        """OpenAI-style user message with `image_part` placed as this sample says."""
        text = {"type": "text", "text": self.question}
        return [
            {
                "role": "user",
                "content": [image_part, text] if self.image_first else [text, image_part],
            }
        ]


def _draw(
    draw: ImageDraw.ImageDraw, shape: str, cx: float, cy: float, r: float, fill: tuple[int, ...]
) -> None:
    if shape == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    elif shape == "square":
        s = r * 0.85  # same area as a circle of radius r, roughly
        draw.rectangle((cx - s, cy - s, cx + s, cy + s), fill=fill)
    elif shape == "triangle":
        draw.polygon([(cx, cy - r), (cx - r, cy + r * 0.8), (cx + r, cy + r * 0.8)], fill=fill)
    else:  # cross
        w = r * 0.38
        draw.rectangle((cx - r, cy - w, cx + r, cy + w), fill=fill)
        draw.rectangle((cx - w, cy - r, cx + w, cy + r), fill=fill)


def _centres(
    rng: np.random.Generator, count: int, side: str | None, size_px: int, r: float
) -> list[tuple[float, float]]:
    """Centres of `count` shapes of radius `r` that do not touch; one sits clearly on `side`."""
    lo, hi = r + 1, size_px - r - 1
    if side is not None:
        x_lo, x_hi = (lo, size_px * 0.38) if side == "left" else (size_px * 0.62, hi)
        return [(rng.uniform(x_lo, x_hi), rng.uniform(lo, hi))]
    while True:  # rejection sampling: a handful of tries at these sizes
        pts = [(rng.uniform(lo, hi), rng.uniform(lo, hi)) for _ in range(count)]
        if all(
            np.hypot(a[0] - b[0], a[1] - b[1]) > 2.2 * r for i, a in enumerate(pts) for b in pts[:i]
        ):
            return pts


def render(scene: Scene, rng: np.random.Generator, size_px: int = 64) -> Image.Image:
    """Draw `scene` on a dark grey, slightly noisy background, with jittered colour and size."""
    background = rng.integers(0, 60)  # grey, so that every colour in the picture is the shape's
    pixels = (
        np.clip(background + rng.normal(0, 5, (size_px, size_px, 1)), 0, 255)
        .repeat(3, axis=2)
        .astype(np.uint8)
    )
    image = Image.fromarray(pixels)
    draw = ImageDraw.Draw(image)
    r = size_px * (rng.uniform(0.24, 0.32) if scene.count == 1 else rng.uniform(0.12, 0.16))
    fill = tuple(int(np.clip(c + rng.integers(-20, 21), 0, 255)) for c in COLOURS[scene.colour])
    for cx, cy in _centres(rng, scene.count, scene.side, size_px, r):
        _draw(draw, scene.shape, cx, cy, r, fill)
    return image


def random_scene(rng: np.random.Generator, max_count: int = MAX_COUNT) -> Scene:
    count = int(rng.integers(1, max_count + 1))
    side = SIDES[int(rng.integers(2))] if count == 1 else None
    return Scene(
        colour=list(COLOURS)[int(rng.integers(len(COLOURS)))],
        shape=SHAPES[int(rng.integers(len(SHAPES)))],
        count=count,
        side=side,
    )


def random_sample(
    rng: np.random.Generator, size_px: int = 64, asks: tuple[Ask, ...] = tuple(Ask)
) -> Sample:
    """A random scene, a question of one of `asks` it can answer, and where the picture goes."""
    scene = random_scene(rng)
    fit = [
        a
        for a in asks
        if (a is not Ask.SIDE or scene.side is not None) and (a is not Ask.COUNT or MAX_COUNT > 1)
    ]
    ask = fit[int(rng.integers(len(fit)))]
    questions = QUESTIONS[ask]
    return Sample(
        image=render(scene, rng, size_px),
        scene=scene,
        ask=ask,
        question=questions[int(rng.integers(len(questions)))],
        image_first=bool(rng.integers(2)),
    )


def samples(
    seed: int, n: int, size_px: int = 64, asks: tuple[Ask, ...] = tuple(Ask)
) -> list[Sample]:
    """`n` samples from `seed`: the training stream and each held-out set use their own seed."""
    rng = np.random.default_rng(seed)
    return [random_sample(rng, size_px, asks) for _ in range(n)]
