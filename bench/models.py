"""Whole-model forward time: eager vs torch.compile (Inductor) vs torch.compile(backend="fusednorm"), one run.

    python bench/models.py --out bench/out [--models whisper,t5,unet,torch] [--dtype bf16] [--no-cudagraphs]
                           [--variants inductor,fusednorm_plan,inductor_cg,fusednorm_plan_cg]

Models are built from base-size configs with random weights (no downloads). For each: GPU time per forward of
eager, Inductor and fusednorm, the number of blocks fusednorm fused, and the output difference of each compiled
model from eager (relative L2). All variants are compiled and warmed up first, then timed interleaved (eager,
Inductor, fusednorm, eager, ... for --rounds rounds), medians reported, two ways:
  * "graph": GPU time of one forward, replayed from a CUDA graph captured from the variant (the host's launch
    costs drop out, so these are reproducible and compare the GPU work);
  * "call": one ordinary forward between CUDA events behind a short GPU spin (host costs included where the host
    cannot keep the GPU busy, which is what a user without CUDA graphs sees).
With CUDA graphs in the compile (unless --no-cudagraphs), three more variants give what a user of them sees, by
"call" time: Inductor with mode="reduce-overhead", fusednorm with options cudagraphs=True and plan="measure" (the
plan judged on GPU time alone), and the same with every block on the plan.
A variant that cannot be captured gets its call time only, with the reason recorded. A model whose library
(transformers, diffusers) is missing is skipped with a message. Writes models.json under --out and prints a
markdown table last.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import time

import torch

import fusednorm
from fusednorm.plans.weights import GraphWeights
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


MODELS = {"torch": torch_decoder, "whisper": whisper_base, "t5": t5_base, "unet": unet_sd15}  # quickest first
LIBRARY = {"whisper": "transformers", "t5": "transformers", "unet": "diffusers"}  # what each builder imports


SPIN_US = 50  # GPU spin before each timed forward: the GPU is busy while the host starts queuing the forward


def capture_graph(fn):
    """A CUDA graph holding one call of ``fn``, warmed up on a side stream first as capture requires. The plan's
    folded weights are held for the graph (as option cudagraphs does), not folded again in every replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with GraphWeights().capture(), torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph


def gpu_time_ms(fns, warmup=3, rounds=20):
    """Median GPU ms per call of each of ``fns`` ({label: fn}).

    Every variant is warmed up before any is timed, then the variants are timed round-robin, so that a clock or
    cache state drifting during the run falls on all of them alike (timing them one after the other made the first
    look faster than an identical second). Each call sits between two events behind a GPU spin.
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    clock_khz = getattr(torch.cuda.get_device_properties(0), "clock_rate", None)
    cycles = int(SPIN_US * clock_khz / 1e3) if clock_khz else 100_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = {label: [] for label in fns}
    for _ in range(rounds):
        for label, fn in fns.items():
            torch.cuda._sleep(cycles)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times[label].append(start.elapsed_time(end))
    return {label: statistics.median(t) for label, t in times.items()}


def rel_l2(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


REPORTS = ("fusednorm", "measure", "plan", "measure_cg")  # the variants whose report a run keeps


def variants(reports, cudagraphs=True, only=None):
    """(label, backend, torch.compile keywords) of every compiled variant. "fusednorm": the backend as shipped;
    "fusednorm_measure": each projection block measured, plan or Inductor, whichever is faster (plan="measure");
    "fusednorm_plan": every matched block forced onto the plan (plan="always"); the "_cg" variants replay CUDA
    graphs (Inductor's mode="reduce-overhead", fusednorm's option cudagraphs)."""
    out = [("inductor", "inductor", {}),
           ("fusednorm", "fusednorm", {"options": {"report": reports["fusednorm"]}}),
           ("fusednorm_measure", "fusednorm", {"options": {"report": reports["measure"], "plan": "measure"}}),
           ("fusednorm_plan", "fusednorm", {"options": {"report": reports["plan"], "plan": "always"}})]
    if cudagraphs:
        out += [("inductor_cg", "inductor", {"mode": "reduce-overhead"}),
                ("fusednorm_measure_cg", "fusednorm",
                 {"options": {"report": reports["measure_cg"], "plan": "measure", "cudagraphs": True}}),
                ("fusednorm_plan_cg", "fusednorm", {"options": {"plan": "always", "cudagraphs": True}})]
    return [v for v in out if only is None or v[0] in only]


def bench_one(name, device, dtype, rounds=20, cudagraphs=True, only=None):
    title, model, inputs, pick = MODELS[name](device, dtype)
    row = {"model": name, "title": title}
    torch._dynamo.reset()
    for name in ("recompile_limit", "cache_size_limit"):  # one cache entry per variant for each frame of the model
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    with torch.no_grad():
        ref = pick(model(**inputs)).float()
        fns = {"eager": lambda: model(**inputs)}
        # both compiled models wrap the same module; Dynamo keeps one cache entry per backend, so no reset between
        reports = {key: Report() for key in REPORTS}
        report, measured, forced = reports["fusednorm"], reports["measure"], reports["plan"]
        for label, backend, kw in variants(reports, cudagraphs, only):
            compiled = torch.compile(model, backend=backend, **kw)
            t0 = time.time()
            out = pick(compiled(**inputs)).float()  # (a CUDA-graph variant's output is read before its next call)
            row[f"{label}_compile_s"] = round(time.time() - t0, 1)
            row[f"{label}_rel_l2_vs_eager"] = rel_l2(out, ref)
            fns[label] = lambda compiled=compiled: compiled(**inputs)
        row["variants"] = sorted(fns)
        row["fused_blocks"] = len(report.matches)
        row["not_fused"] = sorted({n.reason for n in report.near_misses})
        row["runs"] = sorted({m.runs for m in report.matches})
        row["plan_blocks"] = len(forced.matches)
        row["measure_plan_blocks"] = len(measured.matches)
        row["measure_choices"] = sorted({m.runs for m in measured.matches} |
                                        {n.reason for n in measured.near_misses if "measured" in n.reason})
        if "fusednorm_measure_cg" in fns:
            graphs = reports["measure_cg"]
            row["measure_cg_plan_blocks"] = len(graphs.matches)
            row["measure_cg_choices"] = sorted({m.runs for m in graphs.matches} |
                                               {n.reason for n in graphs.near_misses if "measured" in n.reason})
        for label, ms in gpu_time_ms(fns, rounds=rounds).items():
            row[f"{label}_ms"] = ms
        replays = {}
        for label, fn in fns.items():
            if label.endswith("_cg"):
                continue  # already replays CUDA graphs: its call time is the figure
            try:
                replays[label] = capture_graph(fn).replay
            except Exception as e:  # noqa: BLE001 - e.g. a host sync inside the forward: call time only
                row[f"{label}_graph_error"] = f"{type(e).__name__}: {str(e)[:200]}"
                torch.cuda.synchronize()
        for label, ms in gpu_time_ms(replays, rounds=rounds).items():
            row[f"{label}_graph_ms"] = ms
    print(json.dumps(row), flush=True)
    return row


def run_models(names, device, dtype, rounds=20, save=None, cudagraphs=True, only=None):
    """One row per model; a missing library skips its model, any other failure is recorded, and the rest run.
    ``save(rows)`` runs after each model, so a run cut short by a time limit keeps the models it finished."""
    rows = []
    for name in names:
        lib = LIBRARY.get(name)
        if lib and importlib.util.find_spec(lib) is None:
            rows.append({"model": name, "skipped": f"needs {lib}, which is not installed"})
            print(f"skipping {name}: {rows[-1]['skipped']}", flush=True)
            continue
        try:
            rows.append(bench_one(name, device, dtype, rounds, cudagraphs, only))
        except Exception as e:  # one model's failure is reported, the others still run
            rows.append({"model": name, "error": f"{type(e).__name__}: {e}"})
            print(json.dumps(rows[-1]), flush=True)
        if save is not None:
            save(rows)
        torch._dynamo.reset()  # drop the compiled code (and the model its guards hold) before the next model
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/out")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--rounds", type=int, default=20, help="timed forwards per variant (interleaved)")
    p.add_argument("--cudagraphs", action=argparse.BooleanOptionalAction, default=True,
                   help="also time the variants that replay CUDA graphs")
    p.add_argument("--variants", default=None,
                   help="only these compiled variants (comma-separated labels; eager always runs)")
    args = p.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    unknown = [n for n in args.models.split(",") if n not in MODELS]
    if unknown:
        p.error(f"unknown model(s) {', '.join(unknown)}; known: {', '.join(MODELS)}")
    only = set(args.variants.split(",")) if args.variants else None
    known = {label for label, _, _ in variants(dict.fromkeys(REPORTS))}
    if only and only - known:
        p.error(f"unknown variant(s) {', '.join(sorted(only - known))}; known: {', '.join(sorted(known))}")
    os.makedirs(args.out, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "dtype": args.dtype,
            "date": time.strftime("%Y-%m-%d"), "fusednorm": fusednorm.__version__}

    def save(rows):
        with open(os.path.join(args.out, "models.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)

    rows = run_models(args.models.split(","), "cuda", dtype, args.rounds, save, args.cudagraphs, only)
    print_tables(meta, rows)


def print_tables(meta, rows):
    """The markdown tables of a run; a variant the run left out reads "—"."""
    print(f"\n{meta}\n")
    print("GPU ms from CUDA-graph replay (call ms: one ordinary forward, host costs included)\n")
    print("| model | eager | Inductor | fusednorm | vs Inductor | fused blocks | rel L2 (fusednorm vs eager) "
          "| all on the plan: ms, blocks, rel L2 | measured choice: ms, blocks on the plan |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r or "skipped" in r:
            why = f"error: {r['error'][:80]}" if "error" in r else f"skipped: {r['skipped']}"
            print(f"| {r['model']} | {why} | | | | | | | |")
            continue
        def ms(label):
            if f"{label}_ms" not in r:
                return "—"
            graph = r.get(f"{label}_graph_ms")
            return (f"{graph:.2f} (call {r[f'{label}_ms']:.2f})" if graph is not None
                    else f"call {r[f'{label}_ms']:.2f}" + ("" if label.endswith("_cg") else " (no graph)"))

        def best(label):
            return r.get(f"{label}_graph_ms", r.get(f"{label}_ms"))

        speed = (f"{best('inductor') / best('fusednorm'):.2f}x" if best("inductor") and best("fusednorm")
                 else "—")
        print(f"| {r['title']} | {ms('eager')} | {ms('inductor')} | {ms('fusednorm')} | {speed} | "
              f"{r['fused_blocks']} | {rel_of(r, 'fusednorm')} | {ms('fusednorm_plan')}, "
              f"{r['plan_blocks']}, {rel_of(r, 'fusednorm_plan')} | {ms('fusednorm_measure')}, "
              f"{r['measure_plan_blocks']} |")
    cg = [r for r in rows if any(k.endswith("_cg_ms") for k in r)]
    if cg:
        print("\nWith CUDA graphs, call ms (one ordinary forward that replays them)\n")
        print("| model | Inductor reduce-overhead | fusednorm cudagraphs, plan measured: ms, blocks on the plan | "
              "fusednorm cudagraphs, all on the plan | rel L2 (all on the plan vs eager) |")
        print("|---|---|---|---|---|")
        for r in cg:
            print(f"| {r['title']} | {ms_of(r, 'inductor_cg')} | {ms_of(r, 'fusednorm_measure_cg')}, "
                  f"{r.get('measure_cg_plan_blocks', '—')} | {ms_of(r, 'fusednorm_plan_cg')} | "
                  f"{rel_of(r, 'fusednorm_plan_cg')} |")


def ms_of(r, label):
    value = r.get(f"{label}_ms")
    return "—" if value is None else f"{value:.2f}"


def rel_of(r, label):
    value = r.get(f"{label}_rel_l2_vs_eager")
    return "—" if value is None else f"{value:.2e}"


if __name__ == "__main__":
    main()
