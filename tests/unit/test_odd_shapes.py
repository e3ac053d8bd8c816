"""Media shapes a family's processor cannot take are refused at intake with a 400 that names
the part and the limit, before any encode or prefill: an aspect ratio Qwen's resize refuses
(over 200:1), audio too short to make one embedding."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import soundfile as sf
from PIL import Image

from cluster.config import ClusterConfig
from cluster.errors import RequestError
from cluster.intake import Intake
from cluster.prompt_plan import PromptPlanner
from cluster.protocol import MediaPart
from router.types import Modality


@pytest.fixture(scope="module")
def intake(omni_ckpt) -> Intake:
    config = ClusterConfig.model_validate(
        {"model": {"checkpoint": str(omni_ckpt), "served_name": "omni"}}
    )
    return Intake(config, PromptPlanner(omni_ckpt))


def png(width: int, height: int) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def wav(num_samples: int, rate_hz: int = 16_000) -> str:
    buf = io.BytesIO()
    sf.write(buf, np.full(num_samples, 0.1, np.float32), rate_hz, format="WAV")
    return base64.b64encode(buf.getvalue()).decode()


def refusal(intake: Intake, part: MediaPart) -> RequestError:
    with pytest.raises(RequestError) as info:
        intake._decode_media([part])
    assert info.value.status == 400 and info.value.param == part.param
    return info.value


@pytest.mark.parametrize("size", [(1, 201), (402, 2)])
def test_an_aspect_ratio_the_processor_refuses_is_a_400_naming_it(intake, size):
    part = MediaPart(Modality.IMAGE, png(*size), "messages[0].content[0].image_url")
    message = refusal(intake, part).message
    assert f"{size[0]}x{size[1]} pixels" in message and "aspect ratio" in message, message


def test_audio_too_short_for_one_embedding_is_a_400_naming_the_shortest(intake):
    shortest = intake.planner._shortest_audio_samples()
    assert 1 < shortest < 16_000
    param = "messages[0].content[0].input_audio"
    for num_samples in (1, shortest - 1):
        part = MediaPart(Modality.AUDIO, wav(num_samples), param, format="wav")
        message = refusal(intake, part).message
        assert f"at least {shortest / 16:.1f} ms" in message, message
    [item] = intake._decode_media([MediaPart(Modality.AUDIO, wav(shortest), param, format="wav")])
    assert len(item.data) == shortest  # the shortest clip it takes goes through


def test_ordinary_shapes_pass(intake):
    parts = [
        MediaPart(Modality.IMAGE, png(200, 1), "messages[0].content[0].image_url"),  # 200:1
        MediaPart(Modality.IMAGE, png(3, 3), "messages[0].content[1].image_url"),
    ]
    assert [item.data.shape for item in intake._decode_media(parts)] == [(1, 200, 3), (3, 3, 3)]
