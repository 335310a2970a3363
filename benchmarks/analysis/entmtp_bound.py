"""How much can any entropy-binned tree switching (EntMTP) gain over the static tree here?

An oracle bound from the heads' calibration and this machine's verify latency, no decoding:
for each acceptance profile (task) and entropy bin, the expected tokens/s of the bin's best
tree against that of the one static tree (``--tree auto``: the best tree under the heads'
pooled table), weighted by the bin's share of positions. The oracle knows every step's bin
exactly (EntMTP estimates it from an EMA of past entropies), so a measured EntMTP / static
ratio above this bound would be noise, and a bound near 1.0 means that on this CPU the
static tree is already close to the best choice at every entropy.

Both trees are valued with the same model the schedulers use (``tree_choice.best_tree``:
expected tau under the table, step = verify latency of the tree's size + one head call per
drafted level), with the shape filter of the backbone (chains only for lossless bf16).

With ``--curve FILE`` (a result of ``benchmarks/kernels/shapes.py``) the verify curve, the drafting
cost per level and the tree shape filter come from that file instead of this backbone: the
heads' acceptance on another model's measured costs. Every figure is then a *prediction*
(it assumes heads trained for that model accept as these do), and each row also gives the
static tree's expected speedup over plain decoding under that curve.

Usage:  python benchmarks/analysis/entmtp_bound.py [--method hydra] [--heads DIR] [--dtype auto] [--out FILE]
        python benchmarks/analysis/entmtp_bound.py --method eagle --heads eagle-taps --curve runs/shapes-llama-3.2-1b.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared module
import common  # noqa: E402
from cadence.costs.latency import LatencyCurve
from cadence.methods import MethodSpec, make_engine
from cadence.heads.profiles import load_profiles
from cadence.verify.sampling import SamplingParams
from cadence.costs.tree_choice import best_tree, step_seconds
from cadence.trees.tree import expected_tau


def tokens_per_s(paths: list, table: list[list[float]], latency, draft_s: float, num_heads: int) -> float:
    """Expected committed tokens per second of drafting ``paths`` when ``table`` holds."""
    depth = max(map(len, paths)) if paths else 0
    return expected_tau(paths, table) / step_seconds(latency, len(paths) + 1, depth, draft_s, num_heads)


def bound(profile, static_paths: list, copying: bool, policy, latency, num_heads: int, max_depth: int) -> dict:
    """Per bin: the static tree's and the bin's best tree's expected tokens/s; their
    count-weighted ratio (the oracle bound)."""
    tables = profile.copy_tables if copying and profile.copy_tables else profile.tables
    rows, static_sum, best_sum, total = [], 0.0, 0.0, 0
    for i, (table, n) in enumerate(zip(tables, profile.counts)):
        shaped = policy.shape(table)
        best = best_tree(shaped, latency, policy.draft_s, num_heads, max_depth, policy.margin)
        s_static = tokens_per_s(static_paths, shaped, latency, policy.draft_s, num_heads)
        s_best = max(best.tau / best.seconds, s_static)
        static_sum, best_sum, total = static_sum + n * s_static, best_sum + n * s_best, total + n
        rows.append({"bin": i, "positions": n, "static_tok_s": round(s_static, 2), "best_tok_s": round(s_best, 2),
                     "best_nodes": len(best.paths) + 1})
    base = 1.0 / latency(1)  # plain decoding: one token per one-node forward
    return {"bins": rows, "bound": round(best_sum / max(static_sum, 1e-12), 4),
            "static_speedup": round(static_sum / max(total, 1) / base, 4),
            "best_speedup": round(best_sum / max(total, 1) / base, 4)}


def linear_curve(t1: float, slope: float) -> LatencyCurve:
    """A synthetic verify curve T(n) = T(1) (1 + slope (n - 1)): what the bound would be on
    a machine where each added node costs ``slope`` of a one-token forward. Example: T(1)
    10 ms, slope 0.05 -> T(16) = 17.5 ms (ratio 1.75)."""
    sizes = list(range(1, 129))
    return LatencyCurve(sizes, [t1 * (1.0 + slope * (n - 1)) for n in sizes])


def bounds_for(latency, profiles: dict, policy, num_heads: int, copy_depth: int) -> dict:
    """Every profile's bound, with and without copy, under one verify curve; ``copy_depth``:
    the deepest level the drafter fills with copies (without copies: the K heads)."""
    out = {}
    for copying in (True, False):
        max_depth = copy_depth if copying else num_heads
        static = best_tree(policy.table(copying), latency, policy.draft_s, num_heads, max_depth, policy.margin)
        for name, profile in profiles.items():
            r = bound(profile, static.paths, copying, policy, latency, num_heads, max_depth)
            out[f"{name}{'+copy' if copying else ''}"] = {"static_nodes": len(static.paths) + 1, **r}
    return out


def curve_from_file(path: str | Path, dtype: str | None = None) -> tuple[LatencyCurve, dict, bool, str]:
    """(verify curve, drafting seconds per level by head kind, chains_only, dtype) of one
    dtype of a ``benchmarks/kernels/shapes.py`` result (default: its first measured dtype)."""
    data = json.loads(Path(path).read_text())
    measured = {dt: e for dt, e in data.get("by_dtype", {}).items() if "curve" in e}
    if not measured:
        raise SystemExit(f"{path} holds no measured verify curve")
    dtype = dtype or next(iter(measured))
    if dtype not in measured:
        raise SystemExit(f"{path} has no {dtype} curve (it has {', '.join(measured)})")
    e = measured[dtype]
    c = e["curve"]
    return (LatencyCurve(list(c["sizes"]), list(c["seconds"]), c.get("context", 256), f"file:{path}:{dtype}"),
            e.get("draft_s", {}), bool(e.get("chains_only", False)), dtype)


PREDICTED_HEADS = {"hydra": ("hydra", "hydra"), "mtp": ("mtp", "mtp"), "eagle-taps": ("eagle", "eagle-taps")}
SHIPPED = Path(__file__).resolve().parents[2] / "src" / "cadence" / "assets" / "heads" / "smollm2"


def with_curve(engine, path: str | Path, dtype: str | None, method: str):
    """Point ``engine``'s tree policy at a curve file's costs (``curve_from_file``); the
    drafting cost is the file's for ``method``'s head kind, else this machine's."""
    latency, drafts, chains_only, dtype = curve_from_file(path, dtype)
    policy = engine.tree_policy
    policy.latency, policy.chains_only = latency, chains_only
    policy.draft_s = drafts.get(method, policy.draft_s)
    return policy, dtype


def curve_predictions(path: str | Path, dtype: str | None = None, heads_root: str | Path = SHIPPED) -> dict:
    """*Predicted* figures for a curve file, from the heads' files alone (no backbone, no
    model download): for each shipped heads set with profiles, per profile and with / without
    copy, the best static tree's size, its expected speedup over plain decoding and EntMTP's
    oracle bound over it. The drafting cost per level is the file's, timed for the heads'
    kind at that shape; trees are those ``--tree auto`` grows (copies to ``--copy-depth``
    or the calibrated table's depth, whichever is deeper, as ``cadence.methods`` sets it)."""
    from types import SimpleNamespace

    from cadence.heads.tables import load_policy
    from cadence.costs.tree_choice import TreePolicy

    latency, drafts, chains_only, _ = curve_from_file(path, dtype)
    out = {}
    for name, (kind, folder) in PREDICTED_HEADS.items():
        directory = Path(heads_root) / folder
        profiles = load_profiles(directory)
        if not profiles or kind not in drafts:
            continue
        k = json.loads((directory / "config.json").read_text())["num_heads"]
        draft = load_policy(directory)
        policy = TreePolicy("auto", SimpleNamespace(policy=draft, K=k), None, latency, drafts[kind],
                            chains_only=chains_only)
        copy_depth = max(k, MethodSpec().copy_depth, len(draft.copy_acceptance or []))
        out[name] = bounds_for(latency, profiles, policy, k, copy_depth)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", default="hydra", help="head family; its heads need a profiles.json "
                                                      "(shipped: hydra, mtp, eagle-taps)")
    ap.add_argument("--heads", default="default", help="heads directory (default: the shipped ones for --method)")
    ap.add_argument("--slopes", type=float, nargs="*", default=[0.01, 0.02, 0.05, 0.1, 0.2],
                    help="also bound under synthetic linear verify curves with these per-node slopes")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", default="")
    ap.add_argument("--curve", default="", help="a benchmarks/kernels/shapes.py result: take the verify curve, drafting cost "
                                                "and tree shapes from it (figures are then predictions for that shape)")
    ap.add_argument("--curve-dtype", default=None, help="which dtype's curve of --curve (default: its first)")
    args = ap.parse_args()
    bb = common.backbone(args.model, args.dtype)
    latency = curve_from_file(args.curve, args.curve_dtype)[0] if args.curve else None
    engine = make_engine(bb, MethodSpec.parse(args.method, MethodSpec(heads=args.heads)), latency=latency)
    policy, heads = engine.tree_policy, engine.drafter.heads
    if args.curve:
        policy, curve_dtype = with_curve(engine, args.curve, args.curve_dtype, args.method)
        print(f"Costs from {args.curve} ({curve_dtype}): every figure below is *predicted*.\n")
    copy_depth = engine.drafter.max_depth(SamplingParams())
    profiles = load_profiles(getattr(heads, "source_dir", None))
    if not profiles:
        raise SystemExit("no profiles.json beside these heads: run `cadence calibrate --heads DIR` first")
    result = {"machine": common.machine(), "dtype": str(bb.dtype), "method": args.method, "heads": args.heads,
              "curve_file": args.curve or None, "chains_only": policy.chains_only, "draft_s": policy.draft_s,
              "latency": {"sizes": policy.latency.sizes, "seconds": policy.latency.seconds},
              "profiles": bounds_for(policy.latency, profiles, policy, heads.K, copy_depth), "slopes": {}}
    print("| profile | copy | static nodes | static tree / plain decoding | oracle EntMTP / static |\n"
          "|---|---|---:|---:|---:|")
    for key, r in result["profiles"].items():
        name, copy = key.removesuffix("+copy"), key.endswith("+copy")
        print(f"| {name} | {'yes' if copy else 'no'} | {r['static_nodes']} | {r['static_speedup']:.2f}x | {r['bound']:.3f} |")
    t1 = policy.latency(1)
    print(f"\n{'Curve file' if args.curve else 'This machine'}: T(16)/T(1) {policy.latency.ratio(16):.2f}, T(32)/T(1) {policy.latency.ratio(32):.2f}; "
          f"draft {policy.draft_s * 1e3:.2f} ms per level.\n"
          "| synthetic slope | T(16)/T(1) | lowest bound | highest bound |\n|---:|---:|---:|---:|")
    for slope in args.slopes:
        rs = bounds_for(linear_curve(t1, slope), profiles, policy, heads.K, copy_depth)
        result["slopes"][str(slope)] = {k: {"static_nodes": v["static_nodes"], "bound": v["bound"]} for k, v in rs.items()}
        b = [v["bound"] for v in rs.values()]
        print(f"| {slope} | {1 + 15 * slope:.2f} | {min(b):.3f} | {max(b):.3f} |")
    print(f"\n{common.machine_line(result['machine'])}; {type(bb).__name__} {bb.dtype}")
    if args.out:
        common.write_json(args.out, result)


if __name__ == "__main__":
    main()
