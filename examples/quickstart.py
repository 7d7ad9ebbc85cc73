"""Compile a real (tiny, randomly initialised) Whisper decoder with the fusednorm backend.

    python examples/quickstart.py            # CUDA when there is a GPU (bf16), else CPU (float32)

Prints what fusednorm fused (and what it left alone, and why) and the largest difference from eager PyTorch.
"""
from __future__ import annotations

import torch
from transformers import WhisperConfig, WhisperForConditionalGeneration

import fusednorm
from fusednorm.report import Report


def build(device: str, dtype: torch.dtype):
    config = WhisperConfig(
        vocab_size=1000, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
        num_mel_bins=80, d_model=256,
        encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=512,
        decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=512,
        max_source_positions=1500, max_target_positions=448, attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    decoder = WhisperForConditionalGeneration(config).model.decoder.eval().to(device, dtype)
    tokens = torch.randint(0, config.vocab_size, (4, 64), device=device)
    audio_features = torch.randn(4, 1500, config.d_model, device=device, dtype=dtype)  # the encoder's output
    return decoder, tokens, audio_features


def main() -> None:
    device, dtype = ("cuda", torch.bfloat16) if torch.cuda.is_available() else ("cpu", torch.float32)
    decoder, tokens, audio_features = build(device, dtype)

    def run(model):
        return model(input_ids=tokens, encoder_hidden_states=audio_features, use_cache=False).last_hidden_state

    report = Report()
    compiled = torch.compile(decoder, backend="fusednorm", options={"report": report})
    with torch.no_grad():
        expected = run(decoder)
        got = run(compiled)

    print(f"device={device} dtype={dtype} torch={torch.__version__} fusednorm={fusednorm.__version__}")
    print(report)
    diff = (got.float() - expected.float()).abs().max().item()
    print(f"largest |compiled - eager| = {diff:.3e}  (output {tuple(got.shape)})")


if __name__ == "__main__":
    main()
