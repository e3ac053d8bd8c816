"""Qwen2.5-Omni in the published layout (`qwen2_5_omni`: thinker + talker + token2wav in one
repo): the files and config nesting of the published repo; the workers load the thinker's
weights only; the served path equals the whole published model's own (text) generate."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
from safetensors import safe_open  # noqa: E402
from transformers import AutoProcessor, Qwen2_5OmniForConditionalGeneration  # noqa: E402

from actors.engine.lm_runner import LMRunner  # noqa: E402
from actors.models.adapter import Part, load_adapter  # noqa: E402
from actors.models.omni import load_thinker  # noqa: E402
from cluster.prompt_plan import PromptPlanner  # noqa: E402
from tests.integration.reference import TextOnly  # noqa: E402
from tests.unit.test_families import OMNI_CASES, check_matches_generate  # noqa: E402

PUBLISHED_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors.index.json",
    "spk_dict.pt",
    "preprocessor_config.json",
    "chat_template.json",
    "tokenizer.json",
    "tokenizer_config.json",
}


@pytest.fixture(scope="module")
def published(published_omni_ckpt):
    whole = Qwen2_5OmniForConditionalGeneration.from_pretrained(published_omni_ckpt).eval()
    ckpt = published_omni_ckpt
    return (
        TextOnly(whole),
        AutoProcessor.from_pretrained(ckpt),
        PromptPlanner(ckpt),
        load_adapter(ckpt, part=Part.ENCODER, dtype="float32", device="cpu"),
        LMRunner(
            load_adapter(ckpt, part=Part.LANGUAGE_MODEL, dtype="float32", device="cpu"),
            max_chunk_tokens=64,
        ),
    )


def _tensor_bytes(ckpt) -> dict[str, int]:
    """Bytes per top-level part (thinker, talker, token2wav) as the shards store them."""
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    sizes: dict[str, int] = {}
    for shard in set(index.values()):
        with safe_open(ckpt / shard, "pt") as f:
            for key in f.keys():
                part = key.split(".", 1)[0]
                sizes[part] = sizes.get(part, 0) + f.get_tensor(key).nbytes
    return sizes


def test_layout_is_the_published_one(published_omni_ckpt):
    names = {p.name for p in published_omni_ckpt.iterdir()}
    assert PUBLISHED_FILES <= names, PUBLISHED_FILES - names
    shards = sorted(n for n in names if n.startswith("model-"))
    assert (
        len(shards) > 1
        and shards[-1] == f"model-{len(shards):05d}-of-{len(shards):05d}.safetensors"
    )
    assert not {"processor_config.json", "chat_template.jinja", "model.safetensors"} & names
    config = json.loads((published_omni_ckpt / "config.json").read_text())
    assert config["model_type"] == "qwen2_5_omni" and config["architectures"] == [
        "Qwen2_5OmniForConditionalGeneration"
    ]
    assert {"thinker_config", "talker_config", "token2wav_config"} <= set(config)
    assert config["thinker_config"]["model_type"] == "qwen2_5_omni_thinker"
    assert set(_tensor_bytes(published_omni_ckpt)) == {"thinker", "talker", "token2wav"}
    assert (
        json.loads((published_omni_ckpt / "preprocessor_config.json").read_text())[
            "processor_class"
        ]
        == "Qwen2_5OmniProcessor"
    )
    assert (
        "<|im_start|>"
        in json.loads((published_omni_ckpt / "chat_template.json").read_text())["chat_template"]
    )


def test_workers_hold_the_thinker_only(published_omni_ckpt, published):
    """The talker (most of this tiny checkpoint's bytes) never reaches a worker: what is loaded
    is exactly the `thinker.*` tensors, byte for byte."""
    sizes = _tensor_bytes(published_omni_ckpt)
    assert sizes["talker"] > 10 * sizes["thinker"]  # else this test could not tell the two apart
    thinker = load_thinker(published_omni_ckpt, torch.float32)
    loaded = sum(p.nbytes for p in thinker.parameters())
    assert loaded == sizes["thinker"]
    whole = published[0].model
    want = whole.thinker.state_dict()
    got = thinker.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    _, _, _, encoder, runner = published
    for adapter in (encoder, runner.adapter):
        names = {n for n, _ in adapter._model.named_parameters()}
        assert names and not any("talker" in n or "token2wav" in n for n in names)
        assert sum(p.nbytes for p in adapter._model.parameters()) <= sizes["thinker"]


CASES = ("image", "video", "audio", "image+audio+text")


@pytest.mark.parametrize("case", CASES)
def test_published_omni_matches_its_own_generate(published, case):
    check_matches_generate(published, OMNI_CASES[case]())
