"""Generated media for benchmarks: noise images, GIF clips and WAV audio as chat content
parts, photo-like pictures (megabytes to send, tens of MB to decode) and encoded videos."""

from __future__ import annotations

import base64
import io

import numpy as np
import soundfile
from PIL import Image

VIDEO_FRAMES, VIDEO_FPS, AUDIO_S, IMAGE_SIDE = 30, 3, 30.0, 336
AUDIO_RATE_HZ = 16000
STRIPE_BITS = 5  # encoded videos: frame i shows i in binary as black/white stripes


def image_part(rng: np.random.Generator) -> dict:
    """An IMAGE_SIDE px noise PNG as an image_url part."""
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (IMAGE_SIDE, IMAGE_SIDE, 3), dtype=np.uint8)).save(
        buf, format="PNG"
    )
    return {
        "type": "image_url",
        "image_url": {"url": "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()},
    }


def video_part(rng: np.random.Generator) -> dict:
    """A 10 s clip at 3 fps (30 frames, 224 px) as an animated GIF. Frames are palette images
    (random indices into one random 256-colour palette): RGB frames make Pillow quantize each
    one, 3.6 s a clip, which on a GPU host took longer than the phases the clips were for."""
    palette = rng.integers(0, 256, 768, dtype=np.uint8).tobytes()
    frames = [
        Image.frombytes("P", (224, 224), rng.integers(0, 256, 224 * 224, dtype=np.uint8).tobytes())
        for _ in range(VIDEO_FRAMES)
    ]
    for frame in frames:
        frame.putpalette(palette)
    buf = io.BytesIO()
    frames[0].save(
        buf,
        format="GIF",
        save_all=True,
        append_images=frames[1:],
        duration=1000 // VIDEO_FPS,
        loop=0,
    )
    return {
        "type": "video_url",
        "video_url": {"url": "data:image/gif;base64," + base64.b64encode(buf.getvalue()).decode()},
    }


def audio_part(rng: np.random.Generator) -> dict:
    """AUDIO_S seconds of quiet noise, 16 kHz WAV, as an input_audio part."""
    buf = io.BytesIO()
    samples = (0.1 * rng.standard_normal(int(AUDIO_S * AUDIO_RATE_HZ))).astype(np.float32)
    soundfile.write(buf, samples, AUDIO_RATE_HZ, format="WAV")
    return {
        "type": "input_audio",
        "input_audio": {"data": base64.b64encode(buf.getvalue()).decode(), "format": "wav"},
    }


def photo(megapixels: float, seed: int, fmt: str, alpha: bool = False, **save) -> bytes:
    """A photo-like picture (smooth ramps plus noise) in `fmt` (a Pillow format name), with an
    opaque alpha band if `alpha`; `save` goes to Pillow's writer."""
    side = int((megapixels * 1e6) ** 0.5)
    ramp = np.linspace(0, 255, side, dtype=np.float32)
    noise = np.random.default_rng(seed).integers(0, 16, (side, side), dtype=np.uint8)
    channel = (ramp[None, :] * 0.5 + ramp[:, None] * 0.5).astype(np.uint8) + noise
    bands = [channel, channel[::-1], channel.T] + ([np.full_like(channel, 200)] if alpha else [])
    out = io.BytesIO()
    Image.fromarray(np.dstack(bands)).save(out, fmt, **save)
    return out.getvalue()


def stripes(index: int, height: int, width: int) -> np.ndarray:
    """Frame `index` of an encoded video: its bits as white stripes (survive lossy codecs)."""
    rgb = np.zeros((height, width, 3), np.uint8)
    stripe = width // STRIPE_BITS
    for bit in range(STRIPE_BITS):
        if index >> bit & 1:
            rgb[:, bit * stripe : (bit + 1) * stripe] = 255
    return rgb


def _codec(fmt: str) -> str:
    import av

    wanted = ("mpeg4", "libx264", "h264") if fmt == "mp4" else ("libvpx", "libvpx-vp9")
    for name in wanted:
        if name in av.codecs_available:
            return name
    raise RuntimeError(f"no {fmt} encoder in this PyAV build")


def encoded_video(
    fmt: str = "mp4",
    *,
    codec: str | None = None,
    num_frames: int = 20,
    fps: int = 10,
    width: int = 48,
    height: int = 32,
) -> bytes:
    """width x height yuv420p, `fps` frames per second; frame i shows stripes(i). Needs PyAV
    (the `video` extra)."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as container:
        stream = container.add_stream(codec or _codec(fmt), rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(num_frames):
            frame = av.VideoFrame.from_ndarray(stripes(i, height, width), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return buf.getvalue()
