"""What a backbone of a real model's shape costs on this machine, and what speculation would gain there.

A model with random weights in a published model's shape (``cadence.fast.shapes``: its
config.json, no weights) costs per forward what that model costs on the same kernels. For
one shape this script measures, in one run:

1. per dtype (bf16 and fp32 by default; a dtype whose weights do not fit in the memory
   available is skipped and the result says so): the time to build the backbone, the
   process's resident memory after building it and after the measurements, plain greedy
   decoding tokens/s (cadence's engine with no drafter, a random prompt, every token run:
   the random model has no EOS), the verify curve T(n) over binary trees after a fixed
   context (``benchmarks/kernels/verify_cost.py``'s timing loop), and the drafting cost per
   level of random heads of each shipped kind at this shape (hydra, mtp, eagle);
2. llama.cpp (when ``llama_cpp`` imports) on the same weights: the random model converted to
   GGUF with llama.cpp's own ``convert_hf_to_gguf.py`` in bf16, then quantized to Q4_0 with
   llama.cpp's quantizer (``llama_model_quantize``), each decoded greedily in a child process
   (2 threads); the GGUF files are kept under ``--gguf-dir`` and reused;
3. *predicted* speedups: the shipped SmolLM2 heads' acceptance profiles
   (``benchmarks/analysis/entmtp_bound.py``) on this shape's measured curve and drafting
   cost: the expected tokens/s of the best static tree over plain decoding, and EntMTP's
   oracle bound over that tree. These assume the heads a user would train for this model
   accept as SmolLM2's do; nothing about acceptance is measured here.

Does not know: acceptance on these shapes (random weights accept nothing meaningful), GPUs.

Usage:  python benchmarks/kernels/shapes.py --shape llama-3.2-1b [--quick] [--json] [--out FILE]
        python benchmarks/kernels/shapes.py --shape llama-3.1-8b --dtypes bfloat16 --sizes 1 4 8 16 32 64 --reps 3 --decode-tokens 16
``--quick`` (bf16 only, a few sizes, 3 reps, 24 decoded tokens; llama.cpp only from GGUF files
already converted) finishes within a minute on the 1B shape on a 2-core AMX Xeon.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared module
import common  # noqa: E402

common.use("analysis")
from cadence.errors import CadenceError  # noqa: E402
from cadence.fast import shapes  # noqa: E402

SIZES = list(range(1, 65))  # the full curve: every n from 1 to 64
QUICK_SIZES = [1, 2, 4, 8, 16, 32, 64]
DRAFT_KINDS = ("hydra", "mtp", "eagle")  # random heads timed at the shape (eagle stands for eagle-taps)
Q4 = "Q4_0"  # llama.cpp's quantization measured beside bf16
LLAMA_THREADS = 2
CONVERTER = common.ROOT / "runs" / "llama.cpp-src" / "convert_hf_to_gguf.py"  # default place of llama.cpp's converter


def rss() -> int:
    return shapes.rss_bytes()


@torch.inference_mode()
def decode(bb, tokens: int, prompt: int = 32, seed: int = 0) -> dict:
    """Greedy decoding through cadence's engine without a drafter (``vanilla``): one untimed
    warm-up, then one timed generation of ``tokens`` tokens after a random prompt."""
    from cadence.decode.engine import Engine
    from cadence.decode.generation import GenerationConfig

    engine = Engine(bb)
    ids = torch.randint(0, min(bb.vocab_size, 10000), (prompt,), generator=torch.Generator().manual_seed(seed)).tolist()
    engine.generate(ids, GenerationConfig(max_new_tokens=4))
    t = time.perf_counter()
    out = engine.generate(ids, GenerationConfig(max_new_tokens=tokens))
    wall = time.perf_counter() - t
    n, prefill = len(out.tokens), out.stats.prefill_s
    return {"tokens": n, "prompt_tokens": prompt, "seconds": round(wall, 3), "prefill_s": round(prefill, 3),
            "decode_tok_s": round((n - 1) / (wall - prefill), 3), "tok_s": round(n / wall, 3),
            "note": "decode_tok_s: the tokens after the first (which the prefill gives) over the time after the "
                    "prefill, as llama.cpp's figure here; tok_s: every token over the whole wall time"}


def draft_costs(bb, kinds=DRAFT_KINDS) -> dict:
    """Seconds per drafted level of random heads of each kind at this shape (K = 3, no copy)."""
    from cadence.draft.head_drafter import HeadDrafter
    from cadence.heads.io import new_heads
    from cadence.costs.tree_choice import draft_seconds

    out = {}
    for kind in kinds:
        heads = new_heads(kind, bb, 3, random=True, seed=0).to(bb.dtype)
        out[kind] = draft_seconds(HeadDrafter(heads), bb.hidden_size, bb.device, bb.dtype, reps=5)
        del heads
        gc.collect()
    return out


def measure_dtype(shape: str, dtype: str, sizes: list[int], reps: int, context: int, tokens: int, seed: int) -> dict:
    """Build, measure and free one backbone of ``shape`` in ``dtype``."""
    import verify_cost

    before = rss()
    t = time.perf_counter()
    bb = shapes.random_backbone(shape, dtype, seed=seed)
    load_s = time.perf_counter() - t
    t = time.perf_counter()
    bb.forward(torch.tensor([[1, 2]]), bb.new_cache())  # builds / loads the native extension once
    first_s = time.perf_counter() - t
    loaded = rss()
    entry = {"load_s": round(load_s, 2), "first_forward_s": round(first_s, 2), "rss_bytes": loaded,
             "rss_before_bytes": before, "kernels": bb.kernels, "resident_bytes": bb.resident_bytes(),
             "chains_only": bool(bb.chains_only)}
    entry["decode"] = decode(bb, tokens, seed=seed)
    c = verify_cost.curve({"fast": bb}, context, sizes, reps)["fast"]
    ms = [c["ms"][str(n)] for n in sizes]
    entry["curve"] = {"sizes": sizes, "seconds": [m / 1000 for m in ms], "ms": ms,
                      "relative": [c["relative"][str(n)] for n in sizes], "knee_1.3x": c["knee_1.3x"],
                      "context": context, "reps": reps, "tree": "binary", "statistic": "median"}
    entry["draft_s"] = draft_costs(bb)
    entry["rss_peak_bytes"] = max(loaded, rss())
    del bb
    gc.collect()
    return entry


# -- llama.cpp on the same weights ---------------------------------------------------------
def _run(args: list[str], what: str, timeout: int = 3600) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise CadenceError(f"{what} failed ({proc.returncode}): {(proc.stderr or proc.stdout)[-1500:]}")
    return proc


SAVE = """
import shutil, sys, torch
from pathlib import Path
from cadence.backbone.load import resolve_model_dir
from cadence.fast import shapes
shape, seed, out = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
model = shapes.random_model(shapes.load_config(shape), torch.bfloat16, seed)
model.config.eos_token_id = 2
model.save_pretrained(out, safe_serialization=True, max_shard_size="1GB")  # 1 GB shards: a small extra peak
tok = resolve_model_dir("smollm2")[0]  # a real tokenizer for the converter; its 49,152 ids pad to the shape's vocabulary
for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt"):
    if (tok / f).is_file():
        shutil.copy(tok / f, out / f)
"""

CONVERT = """
import importlib.util, runpy, sys
from pathlib import Path
converter = Path(sys.argv[1])
sys.argv = sys.argv[1:]
sys.path.insert(0, str(converter.parent))
if importlib.util.find_spec("sentencepiece") is None:
    # llama.cpp's converter imports sentencepiece before it looks for a tokenizer.model; the
    # BPE tokenizer given here never needs it: without the file, go on to the BPE path
    import conversion.base as base
    original = base.TextModel._create_vocab_sentencepiece
    def create(self):
        if not (self.dir_model / "tokenizer.model").is_file():
            raise FileNotFoundError("no tokenizer.model")
        return original(self)
    base.TextModel._create_vocab_sentencepiece = create
import conversion.base as base
recognise = base.TextModel.get_vocab_base_pre
def pre_tokenizer(self, tokenizer):
    # the converter names a BPE pre-tokenizer by a hash of how the tokenizer splits a test
    # text; the tokenizer lent here is not the model's own, and the benchmark feeds token
    # ids, so an unrecognised one is written as llama.cpp's "default"
    try:
        return recognise(self, tokenizer)
    except NotImplementedError:
        return "default"
base.TextModel.get_vocab_base_pre = pre_tokenizer
runpy.run_path(str(converter), run_name="__main__")
"""

QUANTIZE = """
import sys, llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + sys.argv[3])
params.nthread = int(sys.argv[4])
rc = llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), params)
sys.exit(rc)
"""

DECODE = """
import json, os, sys, time
import llama_cpp
path, tokens, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def rss():
    for line in open(f"/proc/{os.getpid()}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
t = time.perf_counter()
llm = llama_cpp.Llama(model_path=path, n_ctx=512, n_threads=threads, n_threads_batch=threads, n_batch=512, verbose=False)
load = time.perf_counter() - t
prompt = [100 + (i * 7919) % 9000 for i in range(32)]
def run(n):
    llm.reset()
    out, t0, first = [], time.perf_counter(), None
    for tok in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
        if first is None:
            first = time.perf_counter()
        out.append(tok)
        if len(out) >= n:
            break
    return out, t0, first, time.perf_counter()
run(4)
out, t0, first, end = run(tokens)
print(json.dumps({"load_s": round(load, 2), "tokens": len(out), "prefill_s": round(first - t0, 3),
                  "decode_tok_s": round((len(out) - 1) / (end - first), 3),
                  "tok_s": round(len(out) / (end - t0), 3), "rss_bytes": rss(),
                  "system_info": llama_cpp.llama_print_system_info().decode(errors="replace")}))
"""


def llama_cpp_peer(shape: str, seed: int, gguf_dir: Path, converter: Path, tokens: int, convert: bool) -> dict:
    """llama.cpp's bf16 and Q4_0 decoding of the random model (converted once, kept)."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return {"status": "skipped: llama_cpp is not importable (benchmarks/peers/build_llama_cpp.py builds it)"}
    name = shapes.config_path(shape).parent.name
    folder = gguf_dir / f"{name}-seed{seed}"
    bf16, q4 = folder / "model-bf16.gguf", folder / f"model-{Q4.lower()}.gguf"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(common.ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    result = {"gguf_dir": str(folder), "threads": LLAMA_THREADS, "steps": {}}
    if not (bf16.is_file() and q4.is_file()) and not convert:
        return {**result, "status": "skipped: no converted GGUF files yet (run without --quick once)"}
    folder.mkdir(parents=True, exist_ok=True)
    if not bf16.is_file():
        if not converter.is_file():
            return {**result, "status": f"skipped: llama.cpp's converter not found at {converter} (--converter)"}
        hf = folder / "hf"
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", SAVE, shape, str(seed), str(hf)], check=True, env=env, timeout=3600)
        result["steps"]["save_hf_s"] = round(time.perf_counter() - t, 1)
        t = time.perf_counter()
        tmp = bf16.with_suffix(".tmp")
        _run([sys.executable, "-c", CONVERT, str(converter), str(hf), "--outtype", "bf16", "--outfile", str(tmp)], "convert_hf_to_gguf.py")
        tmp.rename(bf16)
        result["steps"]["convert_bf16_s"] = round(time.perf_counter() - t, 1)
        subprocess.run(["rm", "-rf", str(hf)], check=False)
    if not q4.is_file():
        t = time.perf_counter()
        tmp = q4.with_suffix(".tmp")
        _run([sys.executable, "-c", QUANTIZE, str(bf16), str(tmp), Q4, str(LLAMA_THREADS)], "llama_model_quantize")
        tmp.rename(q4)
        result["steps"]["quantize_s"] = round(time.perf_counter() - t, 1)
    for label, path in (("bf16", bf16), (Q4, q4)):
        proc = _run([sys.executable, "-c", DECODE, str(path), str(tokens), str(LLAMA_THREADS)], f"llama.cpp {label}")
        result[label] = {**json.loads(proc.stdout.strip().splitlines()[-1]), "file_bytes": path.stat().st_size}
    result["status"] = "measured"
    return result


# -- predictions ----------------------------------------------------------------------------
def predict(curve_file: Path, dtypes: list[str]) -> dict:
    """``entmtp_bound.curve_predictions`` for each measured dtype (the heads' files only)."""
    import entmtp_bound

    return {dt: entmtp_bound.curve_predictions(curve_file, dt) for dt in dtypes}


def markdown(result: dict) -> str:
    s = result["shape"]
    lines = [f"## {s['name']} ({s['parameters'] / 1e9:.2f}B parameters, random weights)", "",
             f"`{result['command']}`  ", f"{result['date']}, commit {result['machine'].get('commit')}, "
             f"{result['machine'].get('cpu')}", ""]
    lines += ["| dtype | build s | RSS GiB | decoding tok/s (measured) | T(1) ms | T(8)/T(1) | T(32)/T(1) | T(64)/T(1) |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for dt, e in result["by_dtype"].items():
        if "skipped" in e:
            lines.append(f"| {dt} | skipped: {e['skipped']} |||||||")
            continue
        c = e["curve"]
        rel = dict(zip(c["sizes"], c["relative"]))
        lines.append(f"| {dt} | {e['load_s']} | {e['rss_bytes'] / 2**30:.2f} | {e['decode']['decode_tok_s']} | "
                     f"{c['ms'][0]} | {rel.get(8, '-')} | {rel.get(32, '-')} | {rel.get(64, '-')} |")
    lc = result.get("llama_cpp", {})
    lines += ["", f"llama.cpp: {lc.get('status')}"]
    for label in ("bf16", Q4):
        if label in lc:
            r = lc[label]
            lines.append(f"- {label}: {r['decode_tok_s']} tok/s decoding (measured, {r['tokens']} tokens, "
                         f"{LLAMA_THREADS} threads), load {r['load_s']} s, RSS {r['rss_bytes'] / 2**30:.2f} GiB")
    for dt, p in (result.get("predicted") or {}).items():
        lines += ["", f"*Predicted* ({dt} curve, SmolLM2 heads' acceptance; no acceptance measured on this shape):", "",
                  "| heads | copy | best static tree nodes | *predicted* speedup over plain decoding | "
                  "*predicted* EntMTP oracle bound over that tree |", "|---|---|---:|---:|---:|"]
        for method, rows in p.items():
            for key, r in rows.items():
                name, copy = key.removesuffix("+copy"), key.endswith("+copy")
                lines.append(f"| {method} ({name}) | {'yes' if copy else 'no'} | {r['static_nodes']} | "
                             f"{r['static_speedup']:.2f}x | {r['bound']:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", required=True, help=f"a kept shape ({', '.join(shapes.shape_names())}), "
                                                   "a folder with a config.json, or a config.json")
    ap.add_argument("--quick", action="store_true", help=f"bf16 only, sizes {QUICK_SIZES}, 3 reps, 24 decoded tokens, llama.cpp "
                                                         "only from GGUF files converted before")
    ap.add_argument("--dtypes", nargs="+", default=None,
                    help="dtypes measured (default bfloat16 float32; quick: bfloat16), each skipped (and said so) "
                         "when its weights do not fit in memory")
    ap.add_argument("--sizes", type=int, nargs="+", default=None, help="tree sizes n of the verify curve (default 1..64)")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions per size (median; default 7, quick 3)")
    ap.add_argument("--context", type=int, default=200, help="committed tokens before each verify forward")
    ap.add_argument("--decode-tokens", type=int, default=None, help="tokens decoded greedily (default 64, quick 24)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    ap.add_argument("--no-llama-cpp", action="store_true", help="do not run llama.cpp")
    ap.add_argument("--gguf-dir", default=str(common.RUNS / "shapes-gguf"), help="where converted GGUF files are kept")
    ap.add_argument("--converter", default=os.environ.get("LLAMA_CPP_CONVERTER", str(CONVERTER)),
                    help="llama.cpp's convert_hf_to_gguf.py (with its gguf-py and conversion/ beside it)")
    ap.add_argument("--no-predict", action="store_true", help="skip the predicted speedups")
    ap.add_argument("--llama-cpp-only", action="store_true",
                    help="run llama.cpp alone (convert if needed, decode); no cadence backbone is built")
    ap.add_argument("--json", action="store_true", help="print the result as JSON instead of markdown")
    ap.add_argument("--out", default=None, help="write the JSON result here (default runs/shapes-<shape>.json)")
    args = ap.parse_args()
    sizes = args.sizes or (QUICK_SIZES if args.quick else SIZES)
    reps = args.reps or (3 if args.quick else 7)
    tokens = args.decode_tokens or (24 if args.quick else 64)
    dtypes = args.dtypes or (["bfloat16"] if args.quick else ["bfloat16", "float32"])
    info = shapes.describe(args.shape)
    out = common.out_path(args.out, f"shapes-{info['name']}.json")
    t0 = time.perf_counter()
    result = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "command": "python " + " ".join([sys.argv[0].removeprefix(str(common.ROOT) + "/"), *sys.argv[1:]]),
              "shape": info, "quick": args.quick, "seed": args.seed, "machine": common.machine(),
              "threads": torch.get_num_threads(), "by_dtype": {}, "llama_cpp": {}}
    for dt in ([] if args.llama_cpp_only else dtypes):
        try:
            result["by_dtype"][dt] = measure_dtype(args.shape, dt, sizes, reps, args.context, tokens, args.seed)
        except CadenceError as exc:
            if "needs about" not in str(exc):
                raise
            result["by_dtype"][dt] = {"skipped": str(exc)}
        common.write_json(out, result, indent=1, quiet=True)
    if args.no_llama_cpp:
        result["llama_cpp"] = {"status": "skipped: --no-llama-cpp"}
    else:
        try:
            result["llama_cpp"] = llama_cpp_peer(args.shape, args.seed, Path(args.gguf_dir), Path(args.converter),
                                                 tokens, convert=not args.quick)
        except (CadenceError, subprocess.SubprocessError) as exc:
            result["llama_cpp"] = {"status": f"failed: {exc}"}
    common.write_json(out, result, indent=1, quiet=True)
    measured = [dt for dt, e in result["by_dtype"].items() if "curve" in e]
    if not args.no_predict and measured:
        try:
            result["predicted"] = predict(out, measured)
        except CadenceError as exc:  # no default model or heads here
            result["predicted"] = {}
            result["predicted_skipped"] = str(exc)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    common.write_json(out, result, indent=1, quiet=True)
    print(json.dumps(result, indent=1) if args.json else markdown(result))
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
