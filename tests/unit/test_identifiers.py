"""cluster/media/identifiers.py: identifiers follow the decoded content, the model and the
layout."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from cluster.media.identifiers import media_identifier
from cluster.media.image import decode_image_url
from router.types import Modality


def _url(array: np.ndarray, fmt: str, mime: str, **kwargs) -> str:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, fmt, **kwargs)
    return f"data:{mime};base64,{base64.b64encode(buf.getvalue()).decode()}"


def _decode(url: str) -> np.ndarray:
    return decode_image_url(url, max_pixels=10**6, remote=None, param="p")


@pytest.fixture
def picture() -> np.ndarray:
    return np.random.default_rng(7).integers(0, 256, (16, 24, 3), dtype=np.uint8)


def test_png_and_lossless_webp_share_an_identifier(picture: np.ndarray) -> None:
    png = _decode(_url(picture, "PNG", "image/png"))
    webp = _decode(_url(picture, "WEBP", "image/webp", lossless=True))
    assert media_identifier("m", Modality.IMAGE, png) == media_identifier("m", Modality.IMAGE, webp)


def test_is_a_blake3_hex_digest_and_deterministic(picture: np.ndarray) -> None:
    ident = media_identifier("m", Modality.IMAGE, picture)
    assert len(ident) == 64 and int(ident, 16) >= 0
    assert ident == media_identifier("m", Modality.IMAGE, picture.copy())


def test_namespaces_never_share(picture: np.ndarray) -> None:
    assert media_identifier("model-a", Modality.IMAGE, picture) != media_identifier(
        "model-b", Modality.IMAGE, picture
    )
    # Length-prefixed fields: moving bytes between namespace and modality changes the digest.
    assert media_identifier("ab", Modality.IMAGE, picture) != media_identifier(
        "a", Modality.IMAGE, picture
    )


def test_modality_dtype_shape_and_content_all_count(picture: np.ndarray) -> None:
    base = media_identifier("m", Modality.IMAGE, picture)
    assert media_identifier("m", Modality.VIDEO, picture) != base
    assert media_identifier("m", Modality.IMAGE, picture.reshape(24, 16, 3)) != base  # same bytes
    assert media_identifier("m", Modality.IMAGE, picture.view(np.int8)) != base  # same bytes
    changed = picture.copy()
    changed[0, 0, 0] ^= 1
    assert media_identifier("m", Modality.IMAGE, changed) != base


def test_non_contiguous_views_hash_like_their_copies(picture: np.ndarray) -> None:
    view = picture[:, ::2]
    assert not view.flags.c_contiguous
    assert media_identifier("m", Modality.IMAGE, view) == media_identifier(
        "m", Modality.IMAGE, view.copy()
    )


def test_audio_float_arrays_and_byte_order() -> None:
    samples = np.linspace(-1, 1, 100, dtype=np.float32)
    ident = media_identifier("m", Modality.AUDIO, samples)
    assert ident != media_identifier(
        "m", Modality.AUDIO, samples.astype(">f4")
    )  # dtype str differs
    assert media_identifier("m", "audio", samples) == ident  # plain strings coerce to Modality


def test_object_arrays_are_refused() -> None:
    with pytest.raises(ValueError, match="dtype=object"):
        media_identifier("m", Modality.IMAGE, np.array([object()]))


def test_rate_of_the_time_axis_is_part_of_the_identity() -> None:
    frames = np.zeros((4, 8, 8, 3), np.uint8)
    at_2 = media_identifier("m", Modality.VIDEO, frames, rate=2.0)
    assert at_2 == media_identifier("m", Modality.VIDEO, frames, rate=2)
    assert at_2 != media_identifier("m", Modality.VIDEO, frames, rate=2.5)
    assert at_2 != media_identifier("m", Modality.VIDEO, frames)
