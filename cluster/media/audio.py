"""Audio decoding: an `input_audio` part (base64 data + format) -> mono float32 at the model's rate.

libsndfile (through soundfile) reads WAV (any PCM width or float), FLAC, MP3 and OGG;
channels are averaged to mono and the result is resampled with an exact rational
polyphase filter. The clip's length is checked from the file header before any sample
is decoded, so a long clip is refused cheaply. No torch here.
"""

from __future__ import annotations

import io
import math

import numpy as np
import soundfile as sf

from cluster.media.budget import PixelBudget
from cluster.media.errors import MediaError
from cluster.media.fetch import FetchPolicy
from cluster.media.payload import UrlKind, data_url_bytes, decode_base64

# input_audio.format -> the libsndfile container names that format may arrive as.
_CONTAINERS = {"wav": ("WAV", "WAVEX", "RF64"), "flac": ("FLAC",), "mp3": ("MP3",), "ogg": ("OGG",)}
# Only what this libsndfile can read: MP3 needs libsndfile >= 1.1, and builds may leave codecs out.
AUDIO_FORMATS: tuple[str, ...] = tuple(
    name for name, containers in _CONTAINERS.items() if containers[0] in sf.available_formats()
)

# audio_url (vLLM's extension of OpenAI's content parts): the MIME type names the format.
_FORMAT_OF_MIME = {
    "audio/wav": "wav",
    "audio/x-wav": "wav",
    "audio/wave": "wav",
    "audio/vnd.wave": "wav",
    "audio/flac": "flac",
    "audio/x-flac": "flac",
    "audio/mpeg": "mp3",
    "audio/mp3": "mp3",
    "audio/ogg": "ogg",
}
AUDIO_URL = UrlKind(
    "audio",
    frozenset(m for m, f in _FORMAT_OF_MIME.items() if f in AUDIO_FORMATS),
    "audio/wav, audio/flac, audio/mpeg or audio/ogg",
    "data:audio/wav;base64,...",
)

# Outside these a header is corrupt or hostile, not a recording worth resampling.
MIN_SAMPLE_RATE_HZ = 1_000
MAX_SAMPLE_RATE_HZ = 384_000
MAX_CHANNELS = 32
# Frames read per call: the decoded multi-channel block stays small, only the mono result grows.
_BLOCK_FRAMES = 1 << 16


def decode_audio(
    data_b64: str,
    audio_format: str | None,
    *,
    sample_rate_hz: int,
    max_duration_s: float,
    param: str,
    budget: PixelBudget | None = None,
) -> np.ndarray:
    """base64 audio declared as `audio_format` -> 1-D float32 mono samples at `sample_rate_hz`.

    Raises MediaError for an unsupported format, bad base64, data that is not audio of the
    declared format, absurd sample rates or channel counts, no samples, non-finite samples
    and clips longer than `max_duration_s`. `budget` is charged its samples' bytes from the
    header, before any is decoded.
    """
    name = _format_name(audio_format, param)
    data = decode_base64(
        _strip_data_url(data_b64), noun="audio", where="input_audio data", param=param
    )
    return decode_audio_bytes(
        data,
        name,
        sample_rate_hz=sample_rate_hz,
        max_duration_s=max_duration_s,
        param=param,
        budget=budget,
    )


def decode_audio_url(
    url: str,
    *,
    remote: FetchPolicy | None,
    sample_rate_hz: int,
    max_duration_s: float,
    param: str,
    budget: PixelBudget | None = None,
) -> np.ndarray:
    """An audio_url (a data URL, or http(s) fetched under `remote`) -> samples, as decode_audio."""
    mime, data = data_url_bytes(url, kind=AUDIO_URL, remote=remote, param=param)
    return decode_audio_bytes(
        data,
        _FORMAT_OF_MIME[mime],
        sample_rate_hz=sample_rate_hz,
        max_duration_s=max_duration_s,
        param=param,
        budget=budget,
    )


def decode_audio_bytes(
    data: bytes,
    name: str,
    *,
    sample_rate_hz: int,
    max_duration_s: float,
    param: str,
    budget: PixelBudget | None = None,
) -> np.ndarray:
    if sample_rate_hz <= 0:
        raise ValueError(f"target sample rate must be positive, got {sample_rate_hz}")
    sound = _open(data, name, param)
    with sound:
        _check_header(sound, max_duration_s=max_duration_s, param=param)
        if budget is not None:  # the header's length (an estimate for MP3) at the model's rate
            samples = math.ceil(sound.frames * sample_rate_hz / sound.samplerate)
            budget.charge_samples(samples, param=param)
        mono = _read_mono(sound, name, max_duration_s=max_duration_s, param=param)
    return resample(mono, sound.samplerate, sample_rate_hz)


def resample(samples: np.ndarray, from_hz: int, to_hz: int) -> np.ndarray:
    """1-D float32 samples from one rate to another: up/down by the exact ratio (reduced by gcd)."""
    if from_hz == to_hz:
        return samples
    # Imported here: scipy.signal costs most of a second to import, which an ingress that
    # never sees audio should not pay at start-up.
    from scipy.signal import resample_poly

    common = math.gcd(from_hz, to_hz)
    out = resample_poly(samples, to_hz // common, from_hz // common)
    return np.ascontiguousarray(out, dtype=np.float32)


def _format_name(audio_format: str | None, param: str) -> str:
    name = (audio_format or "").strip().lower()
    if name not in AUDIO_FORMATS:
        shown = f"'{audio_format}'" if audio_format else "(none)"
        raise MediaError(
            f"unsupported audio format {shown}; send one of {', '.join(AUDIO_FORMATS)}", param
        )
    return name


def _strip_data_url(data: str) -> str:
    # OpenAI's input_audio.data is bare base64, but some clients wrap it in a data URL;
    # the declared format, not the URL's MIME type, decides how it is read.
    if data[:5].lower() == "data:" and ";base64," in data[:100].lower():
        return data.split(",", 1)[1]
    return data


def _reason(exc: Exception) -> str:
    # LibsndfileError's str() embeds the repr of our BytesIO; its error_string is the useful part.
    return str(getattr(exc, "error_string", None) or exc).strip()


def _open(data: bytes, name: str, param: str) -> sf.SoundFile:
    """Open (header only) and check that the container is the declared one."""
    try:
        sound = sf.SoundFile(io.BytesIO(data))
    except (RuntimeError, ValueError, TypeError) as exc:  # LibsndfileError is a RuntimeError
        raise MediaError(f"data does not decode as {name} audio: {_reason(exc)}", param) from None
    if sound.format not in _CONTAINERS[name]:
        sound.close()
        raise MediaError(
            f"data is {sound.format} audio, not {name} as input_audio.format declares", param
        )
    return sound


def _check_header(sound: sf.SoundFile, *, max_duration_s: float, param: str) -> None:
    """Refuse from the header alone: nothing has been decoded yet."""
    rate, channels = sound.samplerate, sound.channels
    if not MIN_SAMPLE_RATE_HZ <= rate <= MAX_SAMPLE_RATE_HZ:
        raise MediaError(
            f"audio sample rate {rate} Hz is outside the accepted "
            f"{MIN_SAMPLE_RATE_HZ}..{MAX_SAMPLE_RATE_HZ} Hz",
            param,
        )
    if not 1 <= channels <= MAX_CHANNELS:
        raise MediaError(
            f"audio has {channels} channels; at most {MAX_CHANNELS} are accepted", param
        )
    if sound.frames <= 0:
        raise MediaError("audio has no samples", param)
    duration_s = sound.frames / rate
    if duration_s > max_duration_s:
        raise MediaError(
            f"audio is {duration_s:.1f} s long, over this server's limit of {max_duration_s:g} s",
            param,
        )


def _read_mono(sound: sf.SoundFile, name: str, *, max_duration_s: float, param: str) -> np.ndarray:
    """All samples as float32 mono (the channel mean), block by block.

    Why count again while reading when the header was checked: for compressed formats (MP3
    above all) the header's length is an estimate, and memory must stay bounded whatever it says.
    """
    limit = int(max_duration_s * sound.samplerate)
    blocks: list[np.ndarray] = []
    total = 0
    while True:
        try:
            block = sound.read(_BLOCK_FRAMES, dtype="float32", always_2d=True)
        except (RuntimeError, ValueError) as exc:
            raise MediaError(f"corrupt or truncated {name} audio: {_reason(exc)}", param) from None
        if not len(block):
            break
        total += len(block)
        if total > limit:
            raise MediaError(
                f"audio is longer than this server's limit of {max_duration_s:g} s", param
            )
        blocks.append(block.mean(axis=1, dtype=np.float32) if block.shape[1] > 1 else block[:, 0])
    if not total:
        raise MediaError("audio has no samples", param)
    mono = np.concatenate(blocks)
    if not np.isfinite(mono).all():
        raise MediaError("audio contains NaN or infinite samples", param)
    return mono
