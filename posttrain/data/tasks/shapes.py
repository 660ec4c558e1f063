"""``--task shapes``: count the shapes in a small drawn image, a task for a vision-language model.

Each image is 32x32 RGB, drawn with Pillow from a seeded spec: 1 to 9 filled circles and squares (diameter or
side 4-7 pixels) in four colours on a white background, each inside its own cell of a 4x4 grid of 8-pixel cells
(the grid is not drawn) at a random offset that leaves the cell's last row and column white, so no two shapes
touch and the answer is also the number of connected non-white regions. The count is drawn uniformly from 1-9,
so always answering one number is right a ninth of the time.

Why a grid: with shapes placed anywhere, a shape straddles the tiny model's 8-pixel patches, and GRPO, which
trains the language model with the vision tower frozen, left held-out accuracy where the warm start had put
it. One shape per patch makes counting the language model's work (attend to the image tokens, count the
non-white ones), which RL then improves.

Rows follow TRL's vision-language convention: the prompt is one user message whose content is an image
placeholder and the question (``[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text":
"How many shapes?"}]}]``), the image sits in the ``images`` column (a list of one PIL image) and ``answer`` is
the count as a string. The split is deterministic: specs are drawn in a fixed order from ``seed``, duplicates
dropped, the first ``n_test`` form the held-out split and the next ``n_train`` the training split, so the two
are disjoint. Drawing 5,500 images takes about a quarter of a second, so the rows are drawn eagerly.

Reward: ``accuracy``, 1.0 when the completion is exactly the count (surrounding whitespace aside), else 0.0.
``correct`` is the same check. The built-in starting model is ``tiny-vision``
(:mod:`posttrain.models.tiny_vision`); :data:`RUN_DEFAULTS` are the run settings tuned on it.
"""

from __future__ import annotations

import random
from typing import Any, NamedTuple

from PIL import Image, ImageDraw

from posttrain.data.rewards import completion_text
from posttrain.data.tasks.task import Task

IMAGE_SIZE = 32
"""Width and height of every image, in pixels."""
CELL = 8
"""Side of a grid cell, in pixels: the tiny model's patch."""
GRID = IMAGE_SIZE // CELL
BACKGROUND = (255, 255, 255)
COLOURS = ((220, 40, 40), (40, 160, 60), (40, 80, 220), (230, 170, 20))
"""Red, green, blue, amber: each far from the white background in every channel but one."""
KINDS = ("circle", "square")
SIZES = range(4, CELL)
"""A circle's diameter or a square's side, in pixels: at most ``CELL - 1``, so a cell's last row and column stay
white."""
MAX_SHAPES = 9
QUESTION = "How many shapes?"
RUN_DEFAULTS = {"learning_rate": 5e-4, "warmup_steps": 10, "prompts_per_step": 16, "group_size": 8,
                "max_steps": 200, "max_minutes": 8.0}
"""A run of the task on ``tiny-vision`` (GRPO unless said): 16 prompts x 8 samples a step, 200 steps at 5e-4
after 10 steps of warm-up, stopped after 8 minutes of training whatever the step, so that the whole command
ends within 10 minutes on 2 loaded CPU cores. The config's defaults (32 x 8, 250 steps, 1e-4) take longer
than that and, at 1e-4, barely move held-out accuracy."""


class Shape(NamedTuple):
    """One filled shape: its kind, its box's top-left corner and side, and its colour (an index into COLOURS)."""

    kind: str
    x: int
    y: int
    size: int
    colour: int


def draw_spec(rng: random.Random) -> tuple[Shape, ...]:
    """1 to :data:`MAX_SHAPES` shapes (the count uniform), each in its own grid cell, in cell order."""
    count = rng.randint(1, MAX_SHAPES)
    shapes = []
    for cell in sorted(rng.sample(range(GRID * GRID), count)):
        size = rng.choice(SIZES)
        column, row = cell % GRID, cell // GRID
        shapes.append(Shape(rng.choice(KINDS), column * CELL + rng.randint(0, CELL - 1 - size),
                            row * CELL + rng.randint(0, CELL - 1 - size), size, rng.randrange(len(COLOURS))))
    return tuple(shapes)


def render(shapes: tuple[Shape, ...]) -> Image.Image:
    """The spec drawn on a white :data:`IMAGE_SIZE` square; each shape covers exactly its ``size`` x ``size`` box
    (a square fully, a circle as the box's inscribed ellipse)."""
    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), BACKGROUND)
    pen = ImageDraw.Draw(image)
    for shape in shapes:
        box = (shape.x, shape.y, shape.x + shape.size - 1, shape.y + shape.size - 1)  # PIL's box is inclusive
        fill = COLOURS[shape.colour]
        if shape.kind == "circle":
            pen.ellipse(box, fill=fill)
        else:
            pen.rectangle(box, fill=fill)
    return image


def prompt() -> list[dict[str, Any]]:
    """The question as one user message with the image's placeholder first (a fresh list per row)."""
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]


def final_answer(completion: str) -> str | None:
    """The completion, stripped, when it is a whole number; else None."""
    answer = completion.strip()
    return answer if answer.isdigit() else None


def correct(prompts: list, completions: list, answer: list[str], **columns: Any) -> list[bool]:
    """Whether each completion is exactly the ``answer`` count."""
    return [final_answer(completion_text(c)) == str(gold) for c, gold in zip(completions, answer)]


def accuracy(prompts: list, completions: list, answer: list[str], **columns: Any) -> list[float]:
    """1.0 for the right count, 0.0 otherwise."""
    return [float(ok) for ok in correct(prompts, completions, answer)]


def make_specs(seed: int, n: int) -> list[tuple[Shape, ...]]:
    """The first ``n`` distinct specs drawn from ``seed``."""
    rng = random.Random(seed)
    seen: set[tuple[Shape, ...]] = set()
    specs: list[tuple[Shape, ...]] = []
    while len(specs) < n:
        spec = draw_spec(rng)
        if spec not in seen:
            seen.add(spec)
            specs.append(spec)
    return specs


def make_rows(seed: int, n_train: int, n_test: int) -> tuple[list[dict], list[dict]]:
    """Disjoint (train, test) rows: ``prompt`` (chat messages), ``images`` (one PIL image), ``answer``."""
    rows = [{"prompt": prompt(), "images": [render(spec)], "answer": str(len(spec))}
            for spec in make_specs(seed, n_test + n_train)]
    return rows[n_test:], rows[:n_test]


def make_task(seed: int = 0, n_train: int = 5_000, n_test: int = 500) -> Task:
    """500 held out: a gain of 0.20 is about nine standard errors of one evaluation's accuracy (at most
    sqrt(0.25 / 500) = 0.022)."""
    train, test = make_rows(seed, n_train, n_test)
    return Task(
        name="shapes",
        description="count the 1-9 circles and squares in a 32x32 image (a vision-language task); reward 1 for "
                    "the right count",
        train=train,
        test=test,
        reward_funcs=(accuracy,),
        reward_weights=(1.0,),
        correct=correct,
        max_new_tokens=4,  # one digit and EOS, with room for a wrong longer answer to be cut and scored 0
        final_answer=final_answer,
        default_model="tiny-vision",
        run_defaults=RUN_DEFAULTS,
    )
