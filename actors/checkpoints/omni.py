"""The published Qwen2.5-Omni layout, tiny and seeded: thinker + talker + token2wav in one
`Qwen2_5OmniForConditionalGeneration` (`model_type: qwen2_5_omni`), saved with the file names
of the Qwen/Qwen2.5-Omni-7B repo: `config.json` nesting `thinker_config` / `talker_config` /
`token2wav_config`, sharded `model-0000k-of-0000n.safetensors` + `model.safetensors.index.json`
(keys `thinker.*`, `talker.*`, `token2wav.*`), `spk_dict.pt`, `preprocessor_config.json`
(feature extractor and image processor in one file, no video processor config),
`chat_template.json`, tokenizer files.

The tiny talker is sized about 40 times the tiny thinker (in the published 7B it is about a
sixth of the thinker), so a test can tell a thinker-only load from a whole one by memory.
"""

from __future__ import annotations

import json
from pathlib import Path

SHARD_SIZE = "8MB"  # the tiny model spreads over several shards, as the published one does
SPEAKERS = ("Chelsie", "Ethan")  # the published spk_dict.pt's speakers
TALKER_HIDDEN, TALKER_LAYERS = 512, 2


def _talker_config(recipe, thinker_config) -> dict:
    t = thinker_config
    text_ids = dict(
        audio_token_index=t.audio_token_index,
        image_token_index=t.image_token_index,
        video_token_index=t.video_token_index,
        vision_start_token_id=t.vision_start_token_id,
        vision_end_token_id=t.vision_end_token_id,
        audio_start_token_id=t.audio_start_token_id,
        audio_end_token_id=t.audio_end_token_id,
    )
    head_dim = TALKER_HIDDEN // 4
    third = head_dim // 2 // 4
    # the tts text ids are thinker tokens: any ids the tiny vocabulary has
    return dict(
        **text_ids,
        vocab_size=8448,
        embedding_size=recipe.text_hidden,
        hidden_size=TALKER_HIDDEN,
        intermediate_size=4 * TALKER_HIDDEN,
        num_hidden_layers=TALKER_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=recipe.max_positions,
        tts_text_start_token_id=t.vision_start_token_id,
        tts_text_end_token_id=t.vision_end_token_id,
        tts_text_pad_token_id=t.text_config.pad_token_id,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [head_dim // 2 - 2 * third, third, third],
        },
    )


_TOKEN2WAV = dict(
    dit_config=dict(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        head_dim=16,
        emb_dim=16,
        enc_emb_dim=16,
        enc_dim=16,
        enc_channels=[16, 16, 16, 16, 48],
        enc_attention_channels=8,
        enc_se_channels=8,
        look_ahead_layers=[1],
        look_backward_layers=[0],
    ),
    bigvgan_config=dict(upsample_initial_channel=32),
)


def with_talker(thinker, recipe):
    """The whole published model around an already initialised thinker; talker and
    token2wav weights drawn from the recipe's seed."""
    import torch
    from transformers import Qwen2_5OmniConfig, Qwen2_5OmniForConditionalGeneration

    from actors.checkpoints.kit import init_weights

    config = Qwen2_5OmniConfig(
        thinker_config=thinker.config.to_dict(),
        token2wav_config=_TOKEN2WAV,
        talker_config=_talker_config(recipe, thinker.config),
    )
    model = Qwen2_5OmniForConditionalGeneration(config).to(torch.float32).eval()
    model.thinker = thinker
    init_weights(model.talker, recipe)
    init_weights(model.token2wav, recipe)
    return model


def _speakers(model, seed: int) -> dict:
    import torch

    gen = torch.Generator().manual_seed(seed)
    dit = model.config.token2wav_config.dit_config
    return {
        name: {
            "cond": torch.randn(1, dit.enc_emb_dim, generator=gen),
            "bos_token": model.config.thinker_config.vision_start_token_id,
            "ref_mel": torch.randn(1, 30, dit.mel_dim, generator=gen),
        }
        for name in SPEAKERS
    }


def save_published(model, processor, out: Path, seed: int) -> None:
    """Write `model` and `processor` into `out` under the published repo's file names."""
    import torch

    model.save_pretrained(out, max_shard_size=SHARD_SIZE)
    torch.save(_speakers(model, seed), out / "spk_dict.pt")
    processor.save_pretrained(out)
    # The published repo predates processor_config.json / chat_template.jinja: one
    # preprocessor_config.json (feature extractor + image processor) and chat_template.json.
    merged = json.loads((out / "processor_config.json").read_text())
    legacy = {
        **merged["feature_extractor"],
        **merged["image_processor"],
        "processor_class": merged["processor_class"],
    }
    (out / "preprocessor_config.json").write_text(
        json.dumps(legacy, indent=2, sort_keys=True) + "\n"
    )
    template = (out / "chat_template.jinja").read_text()
    (out / "chat_template.json").write_text(
        json.dumps({"chat_template": template}, indent=2) + "\n"
    )
    (out / "processor_config.json").unlink()
    (out / "chat_template.jinja").unlink()
