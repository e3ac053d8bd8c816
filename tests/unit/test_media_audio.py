"""cluster/media/audio.py: any accepted format -> mono float32 at the model's rate; bad input names
itself."""

from __future__ import annotations

import base64
import io
import struct

import numpy as np
import pytest
import soundfile as sf

from cluster.config import LimitsConfig
from cluster.media import audio as media_audio
from cluster.media.audio import AUDIO_FORMATS, decode_audio, resample
from cluster.media.decoders import MediaOptions
from cluster.media.errors import MediaError
from cluster.media.load import load_media_item
from router.types import Modality

PARAM = "messages[0].content[1].input_audio"
TARGET_HZ = 16_000


def sine(
    rate_hz: int, seconds: float = 2.0, freq_hz: float = 440.0, channels: int = 1
) -> np.ndarray:
    """float32 sines, channel c at freq_hz * (c + 1); frames x channels (1-D for mono)."""
    t = np.arange(int(rate_hz * seconds)) / rate_hz
    wave = np.stack(
        [0.5 * np.sin(2 * np.pi * freq_hz * (c + 1) * t) for c in range(channels)], axis=1
    )
    return (wave[:, 0] if channels == 1 else wave).astype(np.float32)


def encode(
    samples: np.ndarray, rate_hz: int, fmt: str = "WAV", subtype: str | None = None
) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, samples, rate_hz, format=fmt, subtype=subtype)
    return buf.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def decode(
    data: bytes | str, fmt: str = "wav", *, rate_hz: int = TARGET_HZ, max_s: float = 600.0
) -> np.ndarray:
    payload = data if isinstance(data, str) else b64(data)
    return decode_audio(payload, fmt, sample_rate_hz=rate_hz, max_duration_s=max_s, param=PARAM)


def rejects(data: bytes | str, fmt: str, *fragments: str, max_s: float = 600.0) -> MediaError:
    with pytest.raises(MediaError) as info:
        decode(data, fmt, max_s=max_s)
    assert info.value.param == PARAM
    for fragment in fragments:
        assert fragment in info.value.message, info.value.message
    return info.value


def dominant_hz(samples: np.ndarray, rate_hz: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples))
    return float(np.fft.rfftfreq(len(samples), 1 / rate_hz)[np.argmax(spectrum)])


# ----------------------------------------------------------------------------- accepted inputs

CASES = [
    ("wav", "WAV", "PCM_16", 44_100),
    ("wav", "WAV", "PCM_24", 22_050),
    ("wav", "WAV", "PCM_U8", 8_000),
    ("wav", "WAV", "FLOAT", 8_000),
    ("wav", "WAV", "DOUBLE", 48_000),
    ("flac", "FLAC", "PCM_16", 44_100),
    ("mp3", "MP3", "MPEG_LAYER_III", 44_100),
    ("ogg", "OGG", "VORBIS", 44_100),
]


@pytest.mark.parametrize(
    "name,fmt,subtype,rate_hz", CASES, ids=[f"{c[0]}-{c[2]}-{c[3]}" for c in CASES]
)
def test_formats_decode_to_mono_float32_at_the_target_rate(
    name: str, fmt: str, subtype: str, rate_hz: int
) -> None:
    if name not in AUDIO_FORMATS:
        pytest.skip(f"this libsndfile cannot read {name}")
    out = decode(encode(sine(rate_hz), rate_hz, fmt, subtype), name)
    assert out.dtype == np.float32 and out.ndim == 1 and out.flags.c_contiguous
    assert abs(len(out) - 2 * TARGET_HZ) <= 1, len(out)
    assert abs(dominant_hz(out, TARGET_HZ) - 440.0) <= 1.0
    assert 0.4 < np.abs(out[len(out) // 4 :]).max() < 0.6  # the amplitude survives


def test_other_target_rates() -> None:
    wav = encode(sine(44_100), 44_100)
    for rate_hz in (24_000, 44_100, 22_050, 11_025):
        out = decode(wav, rate_hz=rate_hz)
        assert abs(len(out) - 2 * rate_hz) <= 1 and abs(dominant_hz(out, rate_hz) - 440.0) <= 1.0


def test_same_rate_is_not_resampled() -> None:
    samples = sine(TARGET_HZ)
    np.testing.assert_array_equal(decode(encode(samples, TARGET_HZ, subtype="FLOAT")), samples)


def test_resample_uses_the_exact_reduced_ratio() -> None:
    samples = sine(44_100, seconds=1.0)
    assert len(resample(samples, 44_100, 16_000)) == int(np.ceil(44_100 * 160 / 441))
    odd = resample(samples, 44_101, 16_000)  # gcd 1: up 16000, down 44101, still exact
    assert odd.dtype == np.float32 and len(odd) == int(np.ceil(44_100 * 16_000 / 44_101))


def test_stereo_is_downmixed_to_the_channel_mean() -> None:
    stereo = sine(TARGET_HZ, channels=2)
    out = decode(encode(stereo, TARGET_HZ, subtype="FLOAT"))
    np.testing.assert_allclose(out, stereo.mean(axis=1), atol=1e-7)
    stereo = sine(
        44_100, channels=2
    )  # downmixed before resampling: the same as resampling the mean
    resampled = decode(encode(stereo, 44_100, subtype="FLOAT"))
    np.testing.assert_allclose(
        resampled, resample(stereo.mean(axis=1), 44_100, TARGET_HZ), atol=1e-6
    )


def test_multichannel_and_wrapped_base64_and_data_urls() -> None:
    wav = encode(sine(8_000, channels=6), 8_000, subtype="PCM_16")
    raw = b64(wav)
    wrapped = "\n".join(raw[i : i + 76] for i in range(0, len(raw), 76))
    np.testing.assert_array_equal(decode(wrapped), decode(wav))
    np.testing.assert_array_equal(decode(f"data:audio/wav;base64,{raw}"), decode(wav))
    assert decode(wav, "WAV").shape == decode(wav).shape  # the format name is case-insensitive


# ----------------------------------------------------------------------------- rejections


def test_bad_base64_and_empty_data() -> None:
    rejects("@@@not*base64", "wav", "invalid base64 in input_audio data")
    rejects("abc", "wav", "invalid base64")  # bad padding
    rejects("", "wav", "empty audio data")


@pytest.mark.parametrize(
    "fmt,shown", [("m4a", "'m4a'"), ("aiff", "'aiff'"), (None, "(none)"), ("", "(none)")]
)
def test_unsupported_format_names_the_accepted_ones(fmt: str | None, shown: str) -> None:
    err = rejects(encode(sine(8_000), 8_000), fmt, f"unsupported audio format {shown}")
    assert ", ".join(AUDIO_FORMATS) in err.message and "wav" in err.message


def test_data_that_is_not_audio_of_the_declared_format() -> None:
    rejects(
        b"hello, this is not audio at all" * 10,
        "wav",
        "does not decode as wav audio",
        "Format not recognised",
    )
    flac = encode(sine(8_000), 8_000, "FLAC")
    rejects(flac, "wav", "data is FLAC audio, not wav as input_audio.format declares")
    rejects(encode(sine(8_000), 8_000), "flac", "data is WAV audio, not flac")


@pytest.mark.parametrize("fmt,name", [("FLAC", "flac"), ("OGG", "ogg")])
def test_truncated_compressed_audio_is_refused(fmt: str, name: str) -> None:
    data = encode(sine(44_100), 44_100, fmt)
    rejects(data[: len(data) // 2], name, name)


def test_zero_length_audio() -> None:
    rejects(encode(np.zeros(0, np.float32), 8_000), "wav", "audio has no samples")
    if "ogg" in AUDIO_FORMATS:
        rejects(encode(np.zeros(0, np.float32), 8_000, "OGG"), "ogg", "audio has no samples")


def test_too_long_is_refused_from_the_header_before_decoding(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    wav = encode(sine(8_000), 8_000)
    monkeypatch.setattr(sf.SoundFile, "read", lambda *a, **k: pytest.fail("decoded samples"))
    rejects(wav, "wav", "audio is 2.0 s long", "limit of 1.5 s", max_s=1.5)


def test_decoded_length_is_capped_even_without_the_header_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(media_audio, "_check_header", lambda *a, **k: None)
    rejects(
        encode(sine(8_000), 8_000), "wav", "longer than this server's limit of 1.5 s", max_s=1.5
    )


def wav_with_rate(rate_hz: int) -> bytes:
    data = bytearray(encode(sine(8_000, seconds=0.1), 8_000, subtype="PCM_16"))
    data[24:28] = struct.pack("<I", rate_hz)  # the fmt chunk's sample rate
    return bytes(data)


@pytest.mark.parametrize("rate_hz", [1, 999, 1_000_000])
def test_absurd_sample_rates(rate_hz: int) -> None:
    rejects(wav_with_rate(rate_hz), "wav", f"sample rate {rate_hz} Hz is outside")


def test_absurd_channel_counts() -> None:
    rejects(encode(np.zeros((10, 40), np.float32), 8_000, subtype="PCM_16"), "wav", "40 channels")


def test_non_finite_samples() -> None:
    samples = sine(8_000)
    samples[100] = np.nan
    rejects(encode(samples, 8_000, subtype="FLOAT"), "wav", "NaN or infinite")


def test_bad_target_rate_is_a_server_bug_not_a_media_error() -> None:
    with pytest.raises(ValueError, match="target sample rate"):
        decode(encode(sine(8_000), 8_000), rate_hz=0)


# ------------------------------------------------------------------------------ through the front d


def Limits(**overrides) -> LimitsConfig:
    """The real limits config (every field decoding reads), with overrides."""
    return LimitsConfig(**{"max_image_pixels": 1_000_000, **overrides})


def load(
    data: bytes,
    fmt: str,
    namespace: str = "model-a",
    rate_hz: int = TARGET_HZ,
    max_s: float = 600.0,
):
    return load_media_item(
        Modality.AUDIO,
        b64(data),
        namespace=namespace,
        limits=Limits(max_audio_s=max_s),
        param=PARAM,
        format=fmt,
        options=MediaOptions(audio_sample_rate_hz=rate_hz),
    )


def test_load_media_item_carries_rate_duration_and_a_content_identifier() -> None:
    samples = (sine(44_100) * 32767).astype(np.int16)  # integers: WAV and FLAC store them alike
    item = load(encode(samples, 44_100, subtype="PCM_16"), "wav")
    assert (
        item.modality == Modality.AUDIO
        and item.sample_rate_hz == TARGET_HZ
        and item.frames_per_s is None
    )
    assert item.size == len(item.data) and abs(item.duration_s - 2.0) <= 1 / TARGET_HZ
    # Lossless FLAC of the same PCM decodes to the same samples, hence the same identifier.
    assert load(encode(samples, 44_100, "FLAC", "PCM_16"), "flac").identifier == item.identifier
    assert (
        load(encode(samples, 44_100, subtype="PCM_16"), "wav", namespace="model-b").identifier
        != item.identifier
    )
    other_rate = load(encode(samples, 44_100, subtype="PCM_16"), "wav", rate_hz=24_000)
    assert other_rate.sample_rate_hz == 24_000 and other_rate.identifier != item.identifier


def test_load_media_item_uses_the_audio_limit() -> None:
    with pytest.raises(MediaError, match="limit of 1 s") as info:
        load(encode(sine(8_000), 8_000), "wav", max_s=1.0)
    assert info.value.param == PARAM


def test_limits_config_satisfies_media_limits() -> None:
    item = load_media_item(
        Modality.AUDIO,
        b64(encode(sine(8_000), 8_000)),
        namespace="m",
        limits=LimitsConfig(),
        param=PARAM,
        format="wav",
    )
    assert item.sample_rate_hz == 16_000 and len(item.data) == 32_000
