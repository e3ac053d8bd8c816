"""Stage-only weight loading (actors/models/part_load.py): an encoder worker never holds the
language model, peak memory included; each part reads exactly its own tensors of the
checkpoint (Hub layouts, sharded ones, the published Omni's talker never); what a part holds
and computes equals the whole model's, bit for bit; tied embeddings stay tied."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from safetensors import safe_open  # noqa: E402
from transformers import LlavaForConditionalGeneration  # noqa: E402
from transformers.cache_utils import DynamicCache  # noqa: E402

from actors.models import part_load  # noqa: E402
from actors.models.adapter import Part, load_adapter  # noqa: E402
from router.types import Modality  # noqa: E402
from tests.unit.test_families import image, item, tone  # noqa: E402

PARTS = (Part.ENCODER, Part.LANGUAGE_MODEL)
TOWERS = ("vision_tower", "visual", "audio_tower", "multi_modal_projector")
LM_ONLY = ("language_model", "lm_head")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def big_lm(tmp_path_factory) -> tuple[Path, int]:
    """A seeded LLaVA whose language model (~100 MB in bfloat16) dwarfs its tower (~0.2 MB),
    and the language model's bytes in bfloat16."""
    from actors.checkpoints.llava import RECIPES, build_llava

    recipe = dataclasses.replace(
        RECIPES["tiny-llava"],
        name="big-lm-llava",
        text_hidden=1024,
        text_layers=3,
        text_heads=8,
        text_kv_heads=8,
        text_intermediate=4096,
    )
    model, processor = build_llava(recipe)
    out = tmp_path_factory.mktemp("ck") / recipe.name
    model.save_pretrained(out)
    processor.save_pretrained(out)
    lm = [*model.model.language_model.parameters(), *model.lm_head.parameters()]
    return out, sum(p.numel() for p in lm) * 2


# Runs in a fresh interpreter, so that nothing this session loaded blurs the peaks: the encoder
# part first, then the whole model. Each peak counts from the resident size just before the
# load, the high-water mark reset where Linux allows it (else it is an upper bound). bfloat16,
# as GPU workers load it: a float32 tensor kept float32 on the host would stay in the page cache,
# unread until used.
_PEAKS = """
import gc, json, sys
from pathlib import Path
import torch
from transformers import AutoProcessor, LlavaForConditionalGeneration
from actors.models.adapter import load_adapter

def kib(field):
    lines = Path("/proc/self/status").read_text().splitlines()
    return next(int(line.split()[1]) for line in lines if line.startswith(field + ":"))

torch.set_num_threads(1)
ckpt, peaks = Path(sys.argv[1]), {}
AutoProcessor.from_pretrained(ckpt)  # its imports are no part of the weights' cost
for what in sys.argv[2:]:
    gc.collect()
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM
    except OSError:
        pass
    before = kib("VmRSS")
    if what == "whole":
        held = LlavaForConditionalGeneration.from_pretrained(ckpt, dtype=torch.bfloat16)
    else:
        held = load_adapter(ckpt, part=what, dtype="bfloat16", device="cpu")
    peaks[what] = (kib("VmHWM") - before) * 1024
    del held
print(json.dumps(peaks))
"""


def _peak_growths(ckpt: Path, *what: str) -> dict[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", _PEAKS, str(ckpt), *what],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc/self/status")
def test_encoder_part_peak_memory_stays_below_the_language_model(big_lm):
    ckpt, lm_bytes = big_lm
    peaks = _peak_growths(ckpt, Part.ENCODER, "whole")
    report = f"peak growth {peaks}, language model {lm_bytes} B"
    assert peaks["whole"] > lm_bytes, report  # the probe sees a whole load
    assert peaks[Part.ENCODER] < lm_bytes, report


@pytest.fixture
def reads(monkeypatch) -> set[str]:
    """Checkpoint keys whose tensors transformers' loader reads from here on (it opens files
    with `safe_open` and reads a tensor by slicing the lazy slice it got)."""
    from transformers import modeling_utils

    keys: set[str] = set()
    real = modeling_utils.safe_open

    class Slice:
        def __init__(self, inner, key):
            self._inner, self._key = inner, key

        def __getitem__(self, index):
            keys.add(self._key)
            return self._inner[index]

        def __getattr__(self, name):
            return getattr(self._inner, name)

    class Opened:
        def __init__(self, *args, **kwargs):
            self._file = real(*args, **kwargs)

        def __enter__(self):
            self._file.__enter__()
            return self

        def __exit__(self, *exc):
            return self._file.__exit__(*exc)

        def get_slice(self, key):
            return Slice(self._file.get_slice(key), key)

        def get_tensor(self, key):
            keys.add(key)
            return self._file.get_tensor(key)

        def __getattr__(self, name):
            return getattr(self._file, name)

    monkeypatch.setattr(modeling_utils, "safe_open", Opened)
    return keys


def _checkpoint_keys(ckpt: Path) -> set[str]:
    keys: set[str] = set()
    for shard in ckpt.glob("*.safetensors"):
        with safe_open(shard, "pt") as f:
            keys.update(f.keys())
    return keys


def _expected_reads(ckpt: Path) -> dict[str, set[str]]:
    """Each part's checkpoint keys, by the Hub layouts' names: LLaVA and Qwen2-Audio nest the
    LM under `language_model.`, Qwen2.5-VL and Omni name it `model.` beside `lm_head.`; the
    published Omni prefixes the thinker's with `thinker.` (its talker and token2wav: neither);
    LLaVA-NeXT's `image_newline` (one row) is kept by both."""
    parts = {part: set() for part in PARTS}
    for key in _checkpoint_keys(ckpt):
        inner = key.removeprefix("thinker.")
        if key.startswith(("talker.", "token2wav.")):
            continue
        if inner == "image_newline":
            parts[Part.LANGUAGE_MODEL].add(key)
        lm = inner.startswith(("language_model.", "model.", "lm_head."))
        parts[Part.LANGUAGE_MODEL if lm else Part.ENCODER].add(key)
    return parts


def held(adapter) -> dict[str, torch.Tensor]:
    """Every parameter and buffer the adapter holds, by attribute and name."""
    return {
        f"{attr}.{name}": tensor
        for attr, module in vars(adapter).items()
        if isinstance(module, torch.nn.Module)
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]
    }


CHECKPOINTS = (
    "ckpt",
    "llava_next_ckpt",
    "qwen_vl_ckpt",
    "audio_ckpt",
    "omni_ckpt",
    "published_omni_ckpt",
)


@pytest.mark.parametrize("fixture", CHECKPOINTS)
def test_each_part_reads_only_its_own_tensors(request, reads, fixture):
    """Through the real entry point (load_adapter), each part reads exactly its own tensors,
    on every family's Hub layout, and holds no tensor of the other part (none on meta)."""
    ckpt = request.getfixturevalue(fixture)
    want = _expected_reads(ckpt)
    for part in PARTS:
        reads.clear()
        adapter = load_adapter(ckpt, part=part, dtype="float32", device="cpu")
        assert reads == want[part], (part, sorted(reads ^ want[part])[:10])
        names = held(adapter)
        assert names and all(t.device.type == "cpu" for t in names.values())
        others = TOWERS if part == Part.LANGUAGE_MODEL else LM_ONLY
        assert not [n for n in names if any(other in n for other in others)], part


def _logits(adapter) -> torch.Tensor:
    ids = torch.arange(10, 40, device=adapter.device).unsqueeze(0)
    positions, _ = adapter.prompt_positions(ids, ())
    hidden = adapter.forward(adapter.embed_tokens(ids), positions, DynamicCache())
    return adapter.logits(hidden)


ITEMS = {
    "ckpt": lambda: [image(32, 32), image(50, 20)],
    "llava_next_ckpt": lambda: [image(40, 70)],
    "qwen_vl_ckpt": lambda: [image(56, 84)],
    "audio_ckpt": lambda: [item(Modality.AUDIO, tone(1.5, 440))],
    "omni_ckpt": lambda: [image(56, 56), item(Modality.AUDIO, tone(1.0, 330))],
}


@pytest.mark.parametrize("fixture", list(ITEMS))
def test_parts_equal_the_whole_model(request, monkeypatch, fixture):
    """Encoder outputs and logits of part-loaded adapters equal, bit for bit, those of the same
    adapters over the whole model loaded by plain `from_pretrained`; so does every tensor."""
    _check_parts_equal_the_whole(request, monkeypatch, fixture, "float32", "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("fixture", ["ckpt", "qwen_vl_ckpt"])
def test_parts_load_onto_the_gpu_in_the_dtype_it_supports(request, monkeypatch, fixture):
    """On a GPU, with `auto` as a worker resolves it there (bfloat16 from compute capability 8,
    else float16): every tensor a part holds is on the GPU, every parameter in that dtype, and its
    outputs equal a whole-model load's on the same GPU."""
    from actors.models.adapter import device_dtype

    dtype = device_dtype("auto", "cuda")
    adapters = _check_parts_equal_the_whole(request, monkeypatch, fixture, dtype, "cuda")
    for adapter in adapters:
        assert all(t.is_cuda for t in held(adapter).values())
        # Parameters only: the rotary `inv_freq` buffers stay float32 by the model's own
        # choice, in a whole-model load too (the helper checks every tensor against it).
        params = [
            p
            for m in vars(adapter).values()
            if isinstance(m, torch.nn.Module)
            for p in m.parameters()
        ]
        assert params and all(p.dtype == getattr(torch, dtype) for p in params)


def _check_parts_equal_the_whole(request, monkeypatch, fixture, dtype: str, device: str):
    """The part-loaded encoder and LM adapters, once checked equal to whole-model ones."""
    ckpt = request.getfixturevalue(fixture)

    def load(part):
        return load_adapter(ckpt, part=part, dtype=dtype, device=device)

    part_encoder, part_lm = load(Part.ENCODER), load(Part.LANGUAGE_MODEL)
    with monkeypatch.context() as patched:
        patched.setattr(part_load, "_variant", lambda model_class, part: model_class)
        whole_encoder, whole_lm = load(Part.ENCODER), load(Part.LANGUAGE_MODEL)
    for part, whole in ((part_encoder, whole_encoder), (part_lm, whole_lm)):
        mine, theirs = held(part), held(whole)
        assert mine and mine.keys() <= theirs.keys()
        assert all(
            torch.equal(t, theirs[n]) and t.dtype == theirs[n].dtype for n, t in mine.items()
        )
    with torch.inference_mode():
        for media in ITEMS[fixture]():
            got, want = part_encoder.encode([media])[0], whole_encoder.encode([media])[0]
            assert got.shape[0] > 0 and torch.equal(got, want), media.modality
        assert torch.equal(_logits(part_lm), _logits(whole_lm))
    return part_encoder, part_lm


def test_tied_embeddings_stay_tied_in_the_lm_part(tmp_path):
    """A checkpoint that ties lm_head to embed_tokens stores one of them; the LM part ties them
    again (one tensor, in the requested dtype), the encoder part holds neither."""
    from actors.checkpoints.llava import RECIPES, build_processor, build_tokenizer, llava_config

    recipe = RECIPES["tiny-llava"]
    tokenizer = build_tokenizer(recipe)
    config = llava_config(recipe, tokenizer)
    config.tie_word_embeddings = config.text_config.tie_word_embeddings = True
    torch.manual_seed(0)
    LlavaForConditionalGeneration(config).save_pretrained(tmp_path)
    build_processor(recipe, tokenizer).save_pretrained(tmp_path)
    assert not any("lm_head" in key for key in _checkpoint_keys(tmp_path))
    whole = LlavaForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.bfloat16)
    lm = load_adapter(tmp_path, part=Part.LANGUAGE_MODEL, dtype="bfloat16", device="cpu")
    assert lm._lm_head.weight is lm._lm.embed_tokens.weight
    assert lm._lm_head.weight.dtype == torch.bfloat16
    assert torch.equal(lm._lm_head.weight, whole.lm_head.weight)
    encoder = load_adapter(tmp_path, part=Part.ENCODER, dtype="bfloat16", device="cpu")
    assert not [n for n in held(encoder) if any(other in n for other in LM_ONLY)]
