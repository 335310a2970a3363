"""How much can any entropy-binned tree switching (EntMTP) gain over the static tree here?

An oracle bound from the heads' calibration and this machine's verify latency, no decoding:
for each acceptance profile (task) and entropy bin, the expected tokens/s of the bin's best
tree against that of the one static tree (``--tree auto``: the best tree under the heads'
pooled table), weighted by the bin's share of positions. The oracle knows every step's bin
exactly (EntMTP estimates it from an EMA of past entropies), so a measured EntMTP / static
ratio above this bound would be noise, and a bound near 1.0 means that on this CPU the
static tree is already close to the best choice at every entropy.

Both trees are valued with the same model the schedulers use (``tree_policy.best_tree``:
expected tau under the table, step = verify latency of the tree's size + one head call per
drafted level), with the shape filter of the backbone (chains only for lossless bf16).

Usage:  python benchmarks/analysis/entmtp_bound.py [--method hydra] [--heads DIR] [--dtype auto] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared module
import common  # noqa: E402
from cadence.latency import LatencyCurve
from cadence.methods import Method, MethodSpec, make_engine
from cadence.profiles import load_profiles
from cadence.sampling import SamplingParams
from cadence.tree_policy import best_tree, step_seconds
from cadence.trees import expected_tau


def tokens_per_s(paths: list, table: list[list[float]], latency, draft_s: float, num_heads: int) -> float:
    """Expected committed tokens per second of drafting ``paths`` when ``table`` holds."""
    depth = max(map(len, paths)) if paths else 0
    return expected_tau(paths, table) / step_seconds(latency, len(paths) + 1, depth, draft_s, num_heads)


def bound(profile, static_paths: list, copying: bool, policy, latency, num_heads: int, max_depth: int) -> dict:
    """Per bin: the static tree's and the bin's best tree's expected tokens/s; their
    count-weighted ratio (the oracle bound)."""
    tables = profile.copy_tables if copying and profile.copy_tables else profile.tables
    rows, static_sum, best_sum = [], 0.0, 0.0
    for i, (table, n) in enumerate(zip(tables, profile.counts)):
        shaped = policy.shape(table)
        best = best_tree(shaped, latency, policy.draft_s, num_heads, max_depth, policy.margin)
        s_static = tokens_per_s(static_paths, shaped, latency, policy.draft_s, num_heads)
        s_best = max(best.tau / best.seconds, s_static)
        static_sum, best_sum = static_sum + n * s_static, best_sum + n * s_best
        rows.append({"bin": i, "positions": n, "static_tok_s": round(s_static, 2), "best_tok_s": round(s_best, 2),
                     "best_nodes": len(best.paths) + 1})
    return {"bins": rows, "bound": round(best_sum / max(static_sum, 1e-12), 4)}


def linear_curve(t1: float, slope: float) -> LatencyCurve:
    """A synthetic verify curve T(n) = T(1) (1 + slope (n - 1)): what the bound would be on
    a machine where each added node costs ``slope`` of a one-token forward. Example: T(1)
    10 ms, slope 0.05 -> T(16) = 17.5 ms (ratio 1.75)."""
    sizes = list(range(1, 129))
    return LatencyCurve(sizes, [t1 * (1.0 + slope * (n - 1)) for n in sizes])


def bounds_for(latency, profiles: dict, engine, policy, heads) -> dict:
    """Every profile's bound, with and without copy, under one verify curve."""
    out = {}
    for copying in (True, False):
        max_depth = engine.drafter.max_depth(SamplingParams()) if copying else heads.K
        static = best_tree(policy.table(copying), latency, policy.draft_s, heads.K, max_depth, policy.margin)
        for name, profile in profiles.items():
            r = bound(profile, static.paths, copying, policy, latency, heads.K, max_depth)
            out[f"{name}{'+copy' if copying else ''}"] = {"static_nodes": len(static.paths) + 1, **r}
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
    args = ap.parse_args()
    bb = common.backbone(args.model, args.dtype)
    engine = make_engine(bb, MethodSpec(method=Method(args.method), heads=args.heads))
    policy, heads = engine.tree_policy, engine.drafter.heads
    profiles = load_profiles(getattr(heads, "source_dir", None))
    if not profiles:
        raise SystemExit("no profiles.json beside these heads: run `cadence calibrate --heads DIR` first")
    result = {"machine": common.machine(), "dtype": str(bb.dtype), "method": args.method, "heads": args.heads,
              "chains_only": policy.chains_only, "draft_s": policy.draft_s,
              "latency": {"sizes": policy.latency.sizes, "seconds": policy.latency.seconds},
              "profiles": bounds_for(policy.latency, profiles, engine, policy, heads), "slopes": {}}
    print("| profile | copy | static nodes | oracle EntMTP / static |\n|---|---|---:|---:|")
    for key, r in result["profiles"].items():
        name, copy = key.removesuffix("+copy"), key.endswith("+copy")
        print(f"| {name} | {'yes' if copy else 'no'} | {r['static_nodes']} | {r['bound']:.3f} |")
    t1 = policy.latency(1)
    print(f"\nThis machine: T(16)/T(1) {policy.latency.ratio(16):.2f}, T(32)/T(1) {policy.latency.ratio(32):.2f}; "
          f"draft {policy.draft_s * 1e3:.2f} ms per level.\n"
          "| synthetic slope | T(16)/T(1) | lowest bound | highest bound |\n|---:|---:|---:|---:|")
    for slope in args.slopes:
        rs = bounds_for(linear_curve(t1, slope), profiles, engine, policy, heads)
        result["slopes"][str(slope)] = {k: {"static_nodes": v["static_nodes"], "bound": v["bound"]} for k, v in rs.items()}
        b = [v["bound"] for v in rs.values()]
        print(f"| {slope} | {1 + 15 * slope:.2f} | {min(b):.3f} | {max(b):.3f} |")
    print(f"\n{common.machine_line(result['machine'])}; {type(bb).__name__} {bb.dtype}")
    if args.out:
        common.write_json(args.out, result)


if __name__ == "__main__":
    main()
