"""cluster/request_path.py: the ingress decodes each media part with the config's limits and the
model's options."""

from __future__ import annotations

import base64
import io
from types import SimpleNamespace

import numpy as np
import pytest
import soundfile as sf
from PIL import Image

from cluster.config import ClusterConfig
from cluster.protocol import MediaPart
from router.types import Modality

request_path = pytest.importorskip("cluster.request_path")  # imports ray (no cluster is started)
from cluster.intake import Intake  # noqa: E402


def path(modalities=(Modality.IMAGE, Modality.AUDIO, Modality.VIDEO), **spec) -> Intake:
    """The request path's intake; only the config and the planner's spec are used to decode."""
    config = ClusterConfig.model_validate(
        {
            "model": {"checkpoint": "/tmp/x", "served_name": "m"},
            "limits": {"max_audio_s": 5},
            "media": {"video_fps": 4},
        }
    )
    spec = {"audio_sample_rate_hz": 16_000, **spec}
    planner = SimpleNamespace(
        spec=SimpleNamespace(modalities=set(modalities), **spec), check_item=lambda item: None
    )
    return Intake(config, planner)


def wav(seconds: float = 1.0, rate_hz: int = 8_000) -> str:
    buf = io.BytesIO()
    sf.write(buf, np.zeros(int(rate_hz * seconds), np.float32), rate_hz, format="WAV")
    return base64.b64encode(buf.getvalue()).decode()


def gif() -> str:
    frames = [Image.new("RGB", (8, 8), (i * 40, 0, 0)) for i in range(5)]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)
    return "data:image/gif;base64," + base64.b64encode(buf.getvalue()).decode()


def test_audio_and_video_parts_decode_with_the_model_rate_and_the_sampling_config() -> None:
    parts = [
        MediaPart(Modality.AUDIO, wav(), "messages[0].content[0].input_audio", format="wav"),
        MediaPart(Modality.VIDEO, gif(), "messages[0].content[1].video_url"),
    ]
    audio, video = path()._decode_media(parts)
    assert audio.sample_rate_hz == 16_000 and len(audio.data) == 16_000  # the model's rate
    assert video.frames_per_s == 4.0 and video.data.shape == (
        2,
        8,
        8,
        3,
    )  # 0.5 s at media.video_fps 4
    [audio] = path(audio_sample_rate_hz=24_000)._decode_media(parts[:1])
    assert audio.sample_rate_hz == 24_000 and len(audio.data) == 24_000


def test_media_errors_become_400s_naming_the_part() -> None:
    part = MediaPart(
        Modality.AUDIO, wav(seconds=6), "messages[0].content[0].input_audio", format="wav"
    )
    with pytest.raises(request_path.RequestError) as info:
        path()._decode_media([part])
    assert (
        info.value.status == 400
        and info.value.param == part.param
        and "limit of 5 s" in info.value.message
    )
    wrong = MediaPart(Modality.AUDIO, wav(), part.param, format="mp4")
    with pytest.raises(request_path.RequestError, match="unsupported audio format 'mp4'"):
        path()._decode_media([wrong])
