"""Build any built-in checkpoint by recipe name (no downloads): for tests, benchmarks, `epd serve`.

`python -m actors.checkpoints RECIPE OUT_DIR` writes a dir that `AutoProcessor` and the
family's `from_pretrained` load, as they would a published checkpoint.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from actors.checkpoints.llava import RECIPES, Recipe, build_llava
from actors.checkpoints.qwen import QWEN_RECIPES, build_qwen
from actors.checkpoints.shapes import SHAPES_RECIPES, TrainedRecipe, build_shapes
from actors.checkpoints.vl import VL_RECIPES, VLRecipe, build_vl


def _recipes() -> dict:
    """Every recipe by name, of every family."""
    return {**RECIPES, **QWEN_RECIPES, **VL_RECIPES, **SHAPES_RECIPES}


def _build(recipe, progress: bool):
    """(model, processor) of any recipe; only the trained ones are slow enough to show progress."""
    if isinstance(recipe, Recipe):
        return build_llava(recipe)
    if isinstance(recipe, TrainedRecipe):
        return build_shapes(recipe, progress=progress)
    if isinstance(recipe, VLRecipe):
        return build_vl(recipe)
    return build_qwen(recipe)


def _save(recipe, model, processor, out: Path) -> None:
    if getattr(recipe, "family", None) == "qwen2_5_omni":
        from actors.checkpoints.omni import save_published

        return save_published(model, processor, out, recipe.seed)
    model.save_pretrained(out)
    processor.save_pretrained(out)  # also writes the tokenizer and chat_template.jinja
    getattr(recipe, "publish_layout", lambda _: None)(
        out
    )  # recipes that mirror a Hub repo's file names


def build_checkpoint(recipe: str, out_dir: str | Path, *, progress: bool = True) -> Path:
    """Build `recipe` into `out_dir` (absent or empty) via a hidden sibling dir renamed at the
    end, so a crash never leaves a half-written dir that `ensure_checkpoint` would accept."""
    recipes = _recipes()
    if recipe not in recipes:
        raise ValueError(f"unknown recipe {recipe!r}; known recipes: {', '.join(sorted(recipes))}")
    r, out = recipes[recipe], Path(out_dir).expanduser().resolve()
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty; refusing to overwrite it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.building-", dir=out.parent))
    try:
        with tqdm(total=2, desc=f"build {recipe}: model", disable=not progress, unit="step") as bar:
            model, processor = _build(r, progress)
            bar.update()
            bar.set_description(f"build {recipe}: save")
            _save(r, model, processor, tmp)
            bar.update()
        try:
            os.rename(tmp, out)  # atomic; replaces `out` only if it is an empty dir
        except OSError:
            if not (out / "config.json").is_file():
                raise  # else a concurrent builder won the race with an identical build
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def ensure_checkpoint(out_dir: str | Path, recipe: str | None, *, progress: bool = True) -> Path:
    """Return `out_dir` if it holds a checkpoint, else build `recipe` there."""
    out = Path(out_dir).expanduser()
    if (out / "config.json").is_file():
        return out.resolve()
    if recipe is None:
        raise FileNotFoundError(
            f"no checkpoint at {out} (config.json missing) and no recipe given to build one; "
            f"run `python -m actors.checkpoints RECIPE {out}` with RECIPE in {sorted(_recipes())}"
        )
    return build_checkpoint(recipe, out, progress=progress)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m actors.checkpoints", description=__doc__.splitlines()[0]
    )
    parser.add_argument("recipe", choices=sorted(_recipes()))
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    path = build_checkpoint(args.recipe, args.out_dir)
    size_mb = sum(f.stat().st_size for f in path.iterdir()) / 2**20
    print(
        f"built {args.recipe} at {path} in {time.perf_counter() - start:.1f}s ({size_mb:.1f} MiB)"
    )


if __name__ == "__main__":
    main()
