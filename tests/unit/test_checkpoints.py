"""Unit tests for actors.checkpoints.llava: the locally built tiny LLaVA checkpoint (no Ray)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from PIL import Image  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoProcessor, LlavaForConditionalGeneration  # noqa: E402

from actors.checkpoints import build, kit  # noqa: E402
from actors.checkpoints import llava as ck  # noqa: E402

TINY = ck.RECIPES["tiny-llava"]
REPO = Path(__file__).resolve().parents[2]
FILES = [
    "config.json",
    "generation_config.json",
    "processor_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
]


@pytest.fixture(scope="module")
def processor(ckpt):
    return AutoProcessor.from_pretrained(ckpt)


@pytest.fixture(scope="module")
def model(ckpt):
    return LlavaForConditionalGeneration.from_pretrained(ckpt).eval()


def _images() -> list[Image.Image]:
    """Deterministic synthetic images of different sizes and content."""
    rng = np.random.default_rng(0)
    ramp = np.linspace(0, 255, 64).astype(np.uint8)
    return [
        Image.fromarray(rng.integers(0, 256, (40, 50, 3), dtype=np.uint8)),
        Image.fromarray(np.stack([np.tile(ramp, (48, 1))] * 3, axis=-1)),
        Image.new("RGB", (32, 32), (255, 0, 0)),
        Image.new("RGB", (100, 30), (0, 0, 255)),
        Image.fromarray((np.indices((60, 60)).sum(0) % 2 * 255).astype(np.uint8)).convert("RGB"),
    ]


def _prompt(processor, text: str, n_images: int = 1) -> str:
    parts = [{"type": "image"}] * n_images + [{"type": "text", "text": text}]
    return processor.apply_chat_template(
        [{"role": "user", "content": parts}], add_generation_prompt=True
    )


def _greedy(processor, model, text: str, image: Image.Image) -> tuple[int, ...]:
    inputs = processor(text=_prompt(processor, text), images=[image], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    return tuple(out[0, inputs["input_ids"].shape[1] :].tolist())


def test_loads_with_auto_classes(processor, model):
    assert type(processor).__name__ == "LlavaProcessor"
    # AutoProcessor picks the torchvision backend when it is installed, the PIL one otherwise
    assert type(processor.image_processor).__name__ in (
        "CLIPImageProcessor",
        "CLIPImageProcessorPil",
    )
    assert model.dtype == torch.float32
    assert model.config.image_token_id == processor.tokenizer.convert_tokens_to_ids("<image>")
    gen = model.generation_config
    assert (gen.do_sample, gen.repetition_penalty in (None, 1.0)) == (False, True)
    assert (gen.eos_token_id, gen.pad_token_id, gen.bos_token_id) == (1, 2, 0)


def test_placeholder_count_matches_image_features(processor, model):
    images = _images()[:3]
    inputs = processor(text=_prompt(processor, "compare", 3), images=images, return_tensors="pt")
    n_tokens = int((inputs["input_ids"] == model.config.image_token_id).sum())
    with torch.no_grad():
        feats = model.get_image_features(pixel_values=inputs["pixel_values"])
    # transformers 5.23: a BaseModelOutputWithPooling whose pooler_output is a per-image list.
    per_image = [f.shape[0] for f in feats.pooler_output]
    assert per_image == [TINY.image_tokens] * 3 == [16] * 3
    assert n_tokens == sum(per_image)


def test_exactly_one_bos(processor):
    tok = processor.tokenizer
    rendered = _prompt(processor, "hi")
    ids = processor(text=rendered, images=_images()[:1])["input_ids"][0]
    assert ids[0] == tok.bos_token_id and list(ids).count(tok.bos_token_id) == 1
    for add in (True, False):  # the tokenizer never adds bos itself
        ids = tok(rendered, add_special_tokens=add)["input_ids"]
        assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id


def test_chat_template(processor):
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "text", "text": "What?"}, {"type": "video"}],
        },
        {"role": "assistant", "content": "A cat."},
        {"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "And?"}]},
    ]
    rendered = processor.apply_chat_template(messages, add_generation_prompt=True)
    assert rendered == (
        "<s>SYSTEM: Be brief.\nUSER: <image>What?<video>\nASSISTANT: A cat.</s>\n"
        "USER: <audio>And?\nASSISTANT:"
    )
    without_prompt = processor.tokenizer.apply_chat_template(messages, tokenize=False)
    assert without_prompt == rendered.removesuffix("\nASSISTANT:")


def test_tokenizer_round_trip_and_specials(processor):
    tok = processor.tokenizer
    assert len(tok) == TINY.vocab_size
    ids = {t: tok.convert_tokens_to_ids(t) for t in kit.SPECIAL_TOKENS}
    assert ids == {t: i for i, t in enumerate(kit.SPECIAL_TOKENS)}
    for text in [
        "Hello world!\n  two  spaces\n\nnew\tlines ",
        "ünïcödé 日本 😀",
        "The cat sees 42.",
    ]:
        assert tok.decode(tok(text)["input_ids"]) == text
    # Placeholders are single ids and never merge with neighbouring text.
    enc = tok("a<image>b<video><audio>c")["input_ids"]
    assert tok.convert_ids_to_tokens(enc) == ["a", "<image>", "b", "<video>", "<audio>", "c"]
    assert tok.decode(enc) == "a<image>b<video><audio>c"


def test_greedy_depends_on_image_and_prompt(processor, model):
    image = _images()[0]
    by_image = [_greedy(processor, model, "What is in this image?", im) for im in _images()]
    by_prompt = [
        _greedy(processor, model, p, image) for p in ["Describe it.", "Count the cats.", "Hello"]
    ]
    assert len(set(by_image)) == len(by_image) >= 3
    assert len(set(by_prompt)) == len(by_prompt)
    for out in by_image + by_prompt:
        assert len(out) == 12 and len(set(out)) > 1, out
        assert not set(out) & {0, 2, 3, 4, 5, 6}  # never bos/pad/unk/placeholders


def test_build_is_deterministic(ckpt, tmp_path):
    again = build.build_checkpoint("tiny-llava", tmp_path / "again", progress=False)
    build.main(["tiny-llava", str(tmp_path / "cli")])
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "again",
        "cli",
    ]  # no temp dirs left behind
    ref = load_file(ckpt / "model.safetensors")
    assert all(t.dtype == torch.float32 for t in ref.values())
    for other in (again, tmp_path / "cli"):
        weights = load_file(other / "model.safetensors")
        assert ref.keys() == weights.keys() and all(torch.equal(ref[k], weights[k]) for k in ref)
        for name in FILES:
            assert (ckpt / name).read_bytes() == (other / name).read_bytes(), name


def test_bpe_is_deterministic_across_processes(ckpt):
    """BPE training hashes words; a process with another hash seed must learn the same merges."""
    code = (
        "from actors.checkpoints import kit, llava; "
        "print(kit.train_bpe(llava.RECIPES['tiny-llava']).to_str())"
    )
    env = {**os.environ, "PYTHONHASHSEED": "123", "TOKENIZERS_PARALLELISM": "true"}
    cmd = [sys.executable, "-c", code]
    out = subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True, text=True)
    saved = json.loads((ckpt / "tokenizer.json").read_text())
    assert json.loads(out.stdout)["model"] == saved["model"]


def test_unknown_recipe_and_existing_dirs(ckpt, tmp_path):
    with pytest.raises(ValueError, match="tiny-llava.*bench-llava|bench-llava.*tiny-llava"):
        build.build_checkpoint("huge-llava", tmp_path / "x")
    with pytest.raises(FileExistsError):
        build.build_checkpoint("tiny-llava", ckpt, progress=False)
    with pytest.raises(FileNotFoundError, match="config.json"):
        build.ensure_checkpoint(tmp_path / "missing", None)
    before = [(ckpt / f).stat().st_mtime_ns for f in ("config.json", "model.safetensors")]
    assert build.ensure_checkpoint(ckpt, "tiny-llava") == ckpt
    assert build.ensure_checkpoint(ckpt, None) == ckpt
    assert [(ckpt / f).stat().st_mtime_ns for f in ("config.json", "model.safetensors")] == before
    built = build.ensure_checkpoint(tmp_path / "new", "tiny-llava", progress=False)
    assert (built / "config.json").is_file() and (built / "model.safetensors").is_file()


def test_failed_build_leaves_nothing(tmp_path, monkeypatch):
    def boom(*_a, **_k):
        raise RuntimeError("boom")

    monkeypatch.setattr(ck, "build_model", boom)
    with pytest.raises(RuntimeError):
        build.build_checkpoint("tiny-llava", tmp_path / "out", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_bench_recipe_sizes():
    bench = ck.RECIPES["bench-llava"]
    cfg = ck.llava_config(bench, ck.build_tokenizer(bench))
    text, vision = cfg.text_config, cfg.vision_config
    assert (text.vocab_size, text.hidden_size, text.num_hidden_layers) == (4000, 512, 8)
    assert (text.num_attention_heads, text.intermediate_size, text.max_position_embeddings) == (
        8,
        1536,
        2048,
    )
    assert (vision.image_size, vision.patch_size, vision.hidden_size, vision.num_hidden_layers) == (
        224,
        16,
        384,
        6,
    )
    assert bench.image_tokens == 196
    assert (cfg.vision_feature_layer, cfg.vision_feature_select_strategy) == (-1, "default")
