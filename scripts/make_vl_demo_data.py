"""Generate the visual demo task: small pictures of coloured shapes and counting questions about them.

Every picture is 64x64 pixels (16 image tokens for tiny-vl) with one to four shapes (circle, square, triangle; red,
green, blue) in the cells of a 2x2 grid. Each question has one exact numeric answer and asks about colour ("How many
red shapes are there?"), shape ("How many circles are there?"), count ("How many shapes are in the picture?") or
position ("How many shapes are in the left half?"), so the demo's verifier (the number after "Answer:") scores it.

Records are in LLaMA-Factory's multimodal layouts: sharegpt ``messages`` with an ``images`` column and an ``<image>``
placeholder (SFT, KTO, prompts with answers for GRPO and evaluation) and ranking records with ``conversations`` /
``chosen`` / ``rejected`` / ``images`` (rlhf_v's layout) for DPO. Images are written under ``images/`` and named by
their content's number, so the same seed writes the same files byte for byte.

``--lf-demo`` also writes data/mllm_demo.json and data/mllm_dpo_demo.json (+ data/mllm_demo_data/): a few records in
the layouts of LLaMA-Factory's mllm_demo and RLHF-V, so its multimodal example configs run on bundled data.

    python scripts/make_vl_demo_data.py            # data/demo_vl
    python scripts/make_vl_demo_data.py --lf-demo  # and the LLaMA-Factory-style demo files in data/
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "data" / "demo_vl"
SIZE = 64
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220)}
SHAPES = ("circle", "square", "triangle")
CELLS = ((0, 0), (1, 0), (0, 1), (1, 1))  # (column, row) of the 2x2 grid
TRAIN_PICTURES, EVAL_PICTURES = 400, 60
SYSTEM = "Look at the picture and answer with one line: Answer: <number>."


@dataclass(frozen=True)
class Shape:
    kind: str
    colour: str
    cell: tuple[int, int]


def random_picture(rng: random.Random) -> tuple[Shape, ...]:
    cells = rng.sample(CELLS, rng.randint(1, 4))
    return tuple(Shape(rng.choice(SHAPES), rng.choice(list(COLOURS)), cell) for cell in sorted(cells))


def draw(picture: tuple[Shape, ...]) -> Image.Image:
    image = Image.new("RGB", (SIZE, SIZE), (255, 255, 255))
    pen = ImageDraw.Draw(image)
    half = SIZE // 2
    for shape in picture:
        x0, y0 = shape.cell[0] * half + 5, shape.cell[1] * half + 5
        x1, y1 = x0 + half - 10, y0 + half - 10
        fill = COLOURS[shape.colour]
        if shape.kind == "circle":
            pen.ellipse((x0, y0, x1, y1), fill=fill)
        elif shape.kind == "square":
            pen.rectangle((x0, y0, x1, y1), fill=fill)
        else:
            pen.polygon(((x0 + x1) // 2, y0, x1, y1, x0, y1), fill=fill)
    return image


def questions(picture: tuple[Shape, ...], rng: random.Random) -> list[tuple[str, int]]:
    """One question of each kind, with its answer."""
    colour, kind = rng.choice(list(COLOURS)), rng.choice(SHAPES)
    side = rng.choice(("left", "right", "top", "bottom"))
    on_side = {"left": lambda s: s.cell[0] == 0, "right": lambda s: s.cell[0] == 1,
               "top": lambda s: s.cell[1] == 0, "bottom": lambda s: s.cell[1] == 1}[side]
    return [("How many shapes are in the picture?", len(picture)),
            (f"How many {colour} shapes are there?", sum(s.colour == colour for s in picture)),
            (f"How many {kind}s are there?", sum(s.kind == kind for s in picture)),
            (f"How many shapes are in the {side} half?", sum(map(on_side, picture)))]


def picture_file(picture: tuple[Shape, ...]) -> str:
    code = "-".join(f"{s.kind[0]}{s.colour[0]}{s.cell[0]}{s.cell[1]}" for s in picture)
    return f"images/{code}.png"


def user_turn(question: str) -> dict:
    return {"role": "user", "content": f"<image>{question}"}


def answer(number: int) -> str:
    return f"Answer: {number}"


def wrong(number: int, rng: random.Random) -> int:
    return number + 1 if number == 0 or rng.random() < 0.5 else number - 1


def make_split(count: int, rng: random.Random, seen: set[str]) -> list[tuple[str, str, int, tuple[Shape, ...]]]:
    """(image file, question, answer, picture) rows of ``count`` distinct pictures not in ``seen``."""
    rows = []
    while len({r[0] for r in rows}) < count:
        picture = random_picture(rng)
        name = picture_file(picture)
        if name in seen:
            continue
        seen.add(name)
        rows += [(name, q, a, picture) for q, a in questions(picture, rng)]
    return rows


def write_json(path: Path, records: list[dict] | dict) -> None:
    """A JSON array with one record per line (a dict, dataset_info.json, indented)."""
    if isinstance(records, dict):
        text = json.dumps(records, indent=2, ensure_ascii=False)
    else:
        text = "[\n" + ",\n".join(json.dumps(record, ensure_ascii=False) for record in records) + "\n]"
    path.write_text(text + "\n", encoding="utf-8")


def write_images(folder: Path, rows: list[tuple[str, str, int, tuple[Shape, ...]]]) -> None:
    for name, _, _, picture in rows:
        path = folder / name
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            draw(picture).save(path, optimize=True)


DATASET_INFO = {
    "demo_vl_sft": {"file_name": "sft.json", "formatting": "sharegpt",
                    "columns": {"messages": "messages", "system": "system", "images": "images"},
                    "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                             "assistant_tag": "assistant"}},
    "demo_vl_preference": {"file_name": "preference.json", "formatting": "sharegpt", "ranking": True,
                           "columns": {"messages": "conversations", "system": "system", "chosen": "chosen",
                                       "rejected": "rejected", "images": "images"}},
    "demo_vl_kto": {"file_name": "kto.json", "formatting": "sharegpt",
                    "columns": {"messages": "messages", "system": "system", "kto_tag": "label", "images": "images"},
                    "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                             "assistant_tag": "assistant"}},
    "demo_vl_rl": {"file_name": "rl_prompts.json", "formatting": "sharegpt",
                   "columns": {"messages": "messages", "system": "system", "answer": "answer", "images": "images"},
                   "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                            "assistant_tag": "assistant"}},
    "demo_vl_eval": {"file_name": "eval.json", "formatting": "sharegpt",
                     "columns": {"messages": "messages", "system": "system", "answer": "answer", "images": "images"},
                     "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                              "assistant_tag": "assistant"}},
}


def generate(out_dir: Path, seed: int = 0) -> dict[str, int]:
    rng = random.Random(seed)
    seen: set[str] = set()
    evaluation = make_split(EVAL_PICTURES, rng, seen)
    train = make_split(TRAIN_PICTURES, rng, seen)
    rng.shuffle(train)
    half = len(train) // 2  # SFT sees the first half; DPO, KTO and GRPO the other (new pictures and questions)
    sft_rows, later_rows = train[:half], train[half:]
    files = {
        "sft.json": [{"system": SYSTEM, "messages": [user_turn(q), {"role": "assistant", "content": answer(a)}],
                      "images": [name]} for name, q, a, _ in sft_rows],
        "preference.json": [{"system": SYSTEM, "conversations": [{"from": "human", "value": f"<image>{q}"}],
                             "chosen": {"from": "gpt", "value": answer(a)},
                             "rejected": {"from": "gpt", "value": answer(wrong(a, rng))}, "images": [name]}
                            for name, q, a, _ in later_rows],
        "kto.json": [{"system": SYSTEM, "messages": [user_turn(q), {"role": "assistant", "content": answer(shown)}],
                      "label": shown == a, "images": [name]}
                     for name, q, a, _ in later_rows for shown in [a if rng.random() < 0.5 else wrong(a, rng)]],
        "rl_prompts.json": [{"system": SYSTEM, "messages": [user_turn(q)], "answer": str(a), "images": [name]}
                            for name, q, a, _ in later_rows],
        "eval.json": [{"system": SYSTEM, "messages": [user_turn(q)], "answer": str(a), "images": [name]}
                      for name, q, a, _ in evaluation],
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    write_images(out_dir, evaluation + train)
    for name, records in files.items():
        write_json(out_dir / name, records)
    write_json(out_dir / "dataset_info.json", DATASET_INFO)
    return {name: len(records) for name, records in files.items()}


def generate_lf_demo(data_dir: Path, seed: int = 0) -> dict[str, int]:
    """data/mllm_demo.json and data/mllm_dpo_demo.json: LLaMA-Factory's mllm_demo layout (messages + images, a
    multi-turn record with two images) and RLHF-V's (conversations + chosen / rejected + images)."""
    rng = random.Random(seed + 1)
    rows = make_split(6, rng, set())
    folder = data_dir / "mllm_demo_data"
    write_images(folder, rows)
    by_picture: dict[str, list[tuple[str, int]]] = {}
    for name, q, a, _ in rows:
        by_picture.setdefault(name, []).append((q, a))
    sft, dpo = [], []
    for name, asked in by_picture.items():
        path = f"mllm_demo_data/{name}"
        (q1, a1), (q2, a2) = asked[0], asked[1]
        sft.append({"messages": [{"role": "user", "content": f"<image>{q1}"},
                                 {"role": "assistant", "content": answer(a1)},
                                 {"role": "user", "content": f"{q2}<image>"},
                                 {"role": "assistant", "content": answer(a2)}],
                    "images": [path, path]})
        for q, a in asked:
            dpo.append({"conversations": [{"from": "human", "value": f"<image>{q}"}],
                        "chosen": {"from": "gpt", "value": answer(a)},
                        "rejected": {"from": "gpt", "value": answer(wrong(a, rng))}, "images": [path]})
    write_json(data_dir / "mllm_demo.json", sft)
    write_json(data_dir / "mllm_dpo_demo.json", dpo)
    return {"mllm_demo.json": len(sft), "mllm_dpo_demo.json": len(dpo)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: data/demo_vl)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lf-demo", action="store_true",
                        help="also write data/mllm_demo.json and data/mllm_dpo_demo.json")
    args = parser.parse_args()
    counts = generate(args.out, args.seed)
    if args.lf_demo:
        counts.update(generate_lf_demo(ROOT / "data", args.seed))
    for name, count in counts.items():
        print(f"{name}: {count} records")


if __name__ == "__main__":
    main()
