"""Whole-model forward time: eager vs torch.compile (Inductor) vs torch.compile(backend="fusednorm"), one run.

    python bench/models.py --out bench/out [--models whisper,t5,unet,torch] [--dtype bf16]

Models are built from base-size configs with random weights (no downloads). For each: GPU time per forward as
the median of timed repeats (CUDA events, after warm-up), the number of blocks fusednorm fused, and the output
difference of each compiled model from eager (relative L2, and both against a float32 eager run).
Writes models.json under --out and prints a markdown table last.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import fusednorm
from fusednorm.report import Report


def whisper_base(device, dtype):
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    cfg = WhisperConfig(d_model=512, encoder_layers=6, decoder_layers=6, encoder_attention_heads=8,
                        decoder_attention_heads=8, encoder_ffn_dim=2048, decoder_ffn_dim=2048,
                        vocab_size=51865, max_source_positions=1500, max_target_positions=448,
                        attn_implementation="sdpa")
    model = WhisperForConditionalGeneration(cfg).model.decoder.eval().to(device, dtype)
    B = 16
    inputs = dict(input_ids=torch.randint(0, cfg.vocab_size, (B, 448), device=device),
                  encoder_hidden_states=torch.randn(B, 1500, 512, device=device, dtype=dtype), use_cache=False)
    return "HF Whisper-base decoder (B16, Lq 448, Lk 1500)", model, inputs, lambda out: out.last_hidden_state


def t5_base(device, dtype):
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(d_model=768, d_kv=64, d_ff=3072, num_layers=12, num_decoder_layers=12, num_heads=12,
                   vocab_size=32128, attn_implementation="eager")
    model = T5ForConditionalGeneration(cfg).eval().to(device, dtype)
    B = 32
    inputs = dict(decoder_input_ids=torch.randint(0, cfg.vocab_size, (B, 128), device=device),
                  encoder_outputs=(torch.randn(B, 512, 768, device=device, dtype=dtype),), use_cache=False)
    return "HF T5-base (B32, Lq 128, Lk 512)", model, inputs, lambda out: out.logits


def unet_sd15(device, dtype):
    from diffusers import UNet2DConditionModel

    model = UNet2DConditionModel(sample_size=64, cross_attention_dim=768, attention_head_dim=8,
                                 block_out_channels=(320, 640, 1280, 1280)).eval().to(device, dtype)
    B = 2
    inputs = dict(sample=torch.randn(B, 4, 64, 64, device=device, dtype=dtype),
                  timestep=torch.tensor(500, device=device),
                  encoder_hidden_states=torch.randn(B, 77, 768, device=device, dtype=dtype))
    return "diffusers UNet2DConditionModel SD-1.5 sizes (B2, 64x64, ctx 77)", model, inputs, lambda out: out.sample


def torch_decoder(device, dtype):
    layer = torch.nn.TransformerDecoderLayer(1024, 16, 4096, dropout=0.0, batch_first=True, norm_first=True)
    model = torch.nn.TransformerDecoder(layer, num_layers=6).eval().to(device, dtype)
    inputs = dict(tgt=torch.randn(8, 1024, 1024, device=device, dtype=dtype),
                  memory=torch.randn(8, 77, 1024, device=device, dtype=dtype))
    return "nn.TransformerDecoder norm_first (6 x d1024 h16, B8, Lq 1024, Lk 77)", model, inputs, lambda out: out


MODELS = {"whisper": whisper_base, "t5": t5_base, "unet": unet_sd15, "torch": torch_decoder}


def gpu_time_ms(fn, warmup=3, repeats=20):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def rel_l2(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def bench_one(name, device, dtype):
    title, model, inputs, pick = MODELS[name](device, dtype)
    row = {"model": name, "title": title}
    with torch.no_grad():
        ref = pick(model(**inputs)).float()
        row["eager_ms"] = gpu_time_ms(lambda: model(**inputs))
        for label, backend, options in (("inductor", "inductor", None), ("fusednorm", "fusednorm", "report")):
            torch._dynamo.reset()
            report = Report()
            kw = {"options": {"report": report}} if options else {}
            compiled = torch.compile(model, backend=backend, **kw)
            t0 = time.time()
            out = pick(compiled(**inputs)).float()
            row[f"{label}_compile_s"] = round(time.time() - t0, 1)
            row[f"{label}_ms"] = gpu_time_ms(lambda: compiled(**inputs))
            row[f"{label}_rel_l2_vs_eager"] = rel_l2(out, ref)
            if options:
                row["fused_blocks"] = len(report.matches)
                row["not_fused"] = [n.reason for n in report.near_misses]
                row["runs"] = sorted({m.runs for m in report.matches})
    print(json.dumps(row), flush=True)
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/out")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    args = p.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for name in args.models.split(","):
        try:
            rows.append(bench_one(name, "cuda", dtype))
        except Exception as e:  # one model's failure is reported, the others still run
            rows.append({"model": name, "error": f"{type(e).__name__}: {e}"})
            print(json.dumps(rows[-1]), flush=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "dtype": args.dtype,
            "date": time.strftime("%Y-%m-%d"), "fusednorm": fusednorm.__version__}
    with open(os.path.join(args.out, "models.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"\n{meta}\n")
    print("| model | eager ms | Inductor ms | fusednorm ms | vs Inductor | fused blocks | rel L2 (fusednorm vs eager) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['model']} | error: {r['error'][:80]} | | | | | |")
            continue
        speed = r["inductor_ms"] / r["fusednorm_ms"]
        print(f"| {r['title']} | {r['eager_ms']:.2f} | {r['inductor_ms']:.2f} | {r['fusednorm_ms']:.2f} | "
              f"{speed:.2f}x | {r['fused_blocks']} | {r['fusednorm_rel_l2_vs_eager']:.2e} |")


if __name__ == "__main__":
    main()
