"""Draw this example's pictures: triangles (the built-in task draws squares and circles) in a 4x4 grid of
8-pixel cells on 32x32 images, and the JSONL files that name them. The PNG files and the JSONL files are
committed; rerunning this rewrites them identically (seeded)."""

import json
import random
from pathlib import Path

from PIL import Image, ImageDraw

HERE = Path(__file__).parent
COLOURS = [(200, 30, 120), (20, 120, 120), (90, 60, 200), (160, 110, 20)]
QUESTION = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many shapes?"}]}]


def picture(rng: random.Random, count: int) -> Image.Image:
    image = Image.new("RGB", (32, 32), "white")
    draw = ImageDraw.Draw(image)
    for cell in rng.sample(range(16), count):
        x, y, size = 8 * (cell % 4) + rng.randint(0, 1), 8 * (cell // 4) + rng.randint(0, 1), rng.randint(5, 6)
        draw.polygon([(x, y + size), (x + size, y + size), (x + size // 2, y)], fill=rng.choice(COLOURS))
    return image


def main() -> None:
    rng = random.Random(7)
    (HERE / "pictures").mkdir(exist_ok=True)
    rows = []
    for number in range(72):
        count = rng.randint(1, 9)
        name = f"pictures/{number:03d}.png"
        picture(rng, count).save(HERE / name)
        rows.append({"prompt": QUESTION, "images": [name], "answer": str(count)})
    train, held_out = rows[:48], rows[48:]

    def pair(row: dict) -> dict:
        wrong = str(int(row["answer"]) % 9 + 1)  # a neighbouring count: the mistake a counter makes
        return {"prompt": row["prompt"], "images": row["images"],
                "chosen": [{"role": "assistant", "content": row["answer"]}],
                "rejected": [{"role": "assistant", "content": wrong}]}

    for name, part in (("prompts", train), ("eval", held_out)):
        (HERE / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    for name, part in (("pairs", train), ("eval_pairs", held_out)):
        (HERE / f"{name}.jsonl").write_text("".join(json.dumps(pair(r)) + "\n" for r in part))


if __name__ == "__main__":
    main()
