"""Latency-aware tree choice (``--tree auto``) and per-request tree resolution."""

import pytest

from cadence.draft.head_drafter import HeadDrafter
from cadence.draft.context_copy import CopyConfig
from cadence.decode.generation import GenerationConfig
from cadence.heads import new_heads
from cadence.costs.latency import LatencyCurve
from cadence.verify.sampling import SamplingParams
from cadence.costs.tree_choice import TreePolicy, best_tree
from cadence.trees.tree import chain, expected_tau

TABLE = [[0.7, 0.15, 0.05], [0.6, 0.1, 0.05], [0.5, 0.1, 0.0]]  # a[k][i], K = 3


def test_latency_curve_interpolates():
    c = LatencyCurve([1, 4, 8], [0.04, 0.07, 0.07])
    assert c(1) == 0.04 and c(2) == pytest.approx(0.05) and c(6) == pytest.approx(0.07)
    assert c(16) == pytest.approx(0.07) and c.ratio(4) == pytest.approx(1.75)


def test_costly_verification_means_no_speculation():
    steep = LatencyCurve([1, 2, 64], [0.01, 0.03, 1.0])  # one draft costs 2 tokens: tau <= 1.7 cannot pay
    assert best_tree(TABLE, steep, 0.0, 3, 3).paths == []


def test_free_verification_means_a_big_tree():
    flat = LatencyCurve([1, 64], [0.01, 0.01])
    c = best_tree(TABLE, flat, 0.0, 3, 3)
    assert len(c.paths) >= 9 and c.speedup == pytest.approx(expected_tau(c.paths, TABLE))


def test_a_pathological_size_is_skipped():
    """Measured on a Zen 5 EPYC through transformers: 3 nodes cost more than 4 or 8."""
    curve = LatencyCurve([1, 2, 3, 4, 8, 16], [0.041, 0.063, 0.077, 0.059, 0.063, 0.079])
    c = best_tree(TABLE, curve, 0.001, 3, 3)
    assert len(c.paths) + 1 not in (2, 3) and c.speedup > 1.05
    # the chosen tree beats the chain of 2 that a latency-blind choice would take
    chain2 = expected_tau(chain(2), TABLE) / (curve(3) + 0.002)
    assert c.tau / c.seconds > chain2


def test_margin_keeps_the_root_for_tiny_gains():
    curve = LatencyCurve([1, 2, 64], [0.010, 0.0135, 0.5])
    table = [[0.4]]  # tau 1.4 for 1.35x the cost: 3.7% faster, under the 5% margin
    assert best_tree(table, curve, 0.0, 1, 1).paths == []
    assert best_tree(table, curve, 0.0, 1, 1, margin=0.0).paths == [(0,)]


def test_tree_follows_the_drafters_copies_at_any_temperature(llama):
    """A drafter with copies gets the copy tree (deeper than K), greedy or sampled (copies are
    point-mass proposals at T > 0); one without gets the heads' own."""
    heads = new_heads("hydra", llama, 3, random=True)
    heads.policy.acceptance = TABLE
    heads.policy.copy_acceptance = TABLE + [[0.8, 0.0, 0.0]] * 3  # past K: the copy only
    flat = LatencyCurve([1, 64], [0.01, 0.01])
    policy = TreePolicy("auto", heads, HeadDrafter(heads, CopyConfig(), copy_depth=6), flat)
    greedy, sampled = policy.tree_for(SamplingParams()), policy.tree_for(SamplingParams(temperature=0.7))
    assert greedy.name.endswith("+copy") and greedy.max_depth == 6 and sampled.paths == greedy.paths
    own = TreePolicy("auto", heads, HeadDrafter(heads), flat).tree_for(SamplingParams(temperature=0.7))
    assert not own.name.endswith("+copy") and own.max_depth <= 3
    assert list(own.paths) == best_tree(TABLE, flat, 0.0, 3, 3).paths
    assert GenerationConfig(temperature=0.7).sampling == SamplingParams(temperature=0.7)


# EntMTP: entropy estimate, bins and hysteresis.

def test_entropy_ema_is_bias_corrected():
    from cadence.schedulers.entmtp import EntropyEMA

    e = EntropyEMA(window=2)
    assert e.update(4.0) == pytest.approx(4.0)
    assert e.update(0.0) == pytest.approx(1.0 / 0.75)


def _entmtp():
    from cadence.schedulers.entmtp import EntMTPScheduler
    from cadence.trees.tree import compile_tree

    trees = [compile_tree(chain(d), name=f"c{d}") for d in (3, 2, 0)]
    return EntMTPScheduler([0.5, 1.5], trees, window=1, hysteresis=0.1)  # window 1: no smoothing


def test_entmtp_switches_when_the_signal_crosses_a_threshold():
    s = _entmtp()
    seq = [0.2, 0.3, 1.0, 1.2, 2.5, 3.0, 0.1]
    assert [s.update(h) for h in seq] == [0, 0, 1, 1, 2, 2, 0]


def test_entmtp_does_not_flap_on_noise_at_an_edge():
    s = _entmtp()
    s.update(1.0)  # bin 1
    noisy = [1.45, 1.55, 1.52, 1.48, 1.58, 1.44, 0.45, 0.55, 0.42]  # within 0.1 of the edges
    assert {s.update(h) for h in noisy} == {1} and s.switches == 0


def test_entmtp_smoothing_ignores_a_single_spike():
    from cadence.schedulers.entmtp import EntMTPScheduler
    from cadence.trees.tree import compile_tree

    trees = [compile_tree(chain(d), name=f"c{d}") for d in (3, 2, 0)]
    s = EntMTPScheduler([0.5, 1.5], trees, window=8, hysteresis=0.1)
    for _ in range(10):
        s.update(0.2)
    assert s.update(2.0) == 0  # one harder token does not change the tree (EMA W=8: estimate 0.49)
    for _ in range(12):
        b = s.update(3.0)
    assert b == 2


def test_a_chains_only_backbone_gets_chains_from_every_tree_choice(llama):
    """Row-consistent bf16 attends once per root-to-leaf path: there the policy grows chains,
    the adaptive frontier holds chains only, and the latency probe measures chains."""
    from cadence.costs.latency import probe_tree
    from cadence.schedulers.adaptive import frontier

    heads = new_heads("hydra", llama, 3, random=True)
    heads.policy.acceptance = TABLE
    drafter = HeadDrafter(heads, None)
    flat = LatencyCurve([1, 64], [0.01, 0.01])
    bushy = TreePolicy("auto", heads, drafter, flat)
    assert not bushy.tree_for(SamplingParams()).is_chain  # free verification: a bushy tree
    policy = TreePolicy("auto", heads, drafter, flat, chains_only=True)
    assert policy.shape([[0.6, 0.1], [0.5, 0.1]]) == [[0.6], [0.5]]
    assert policy.tree_for(SamplingParams()).is_chain and policy.tree_for(SamplingParams()).max_depth == 3
    for cand in frontier(policy.table(False), flat, 0.0, 3, 3):
        assert cand.tree.is_chain
    assert probe_tree(8, chains_only=True).is_chain and not probe_tree(8).is_chain
    asked = TreePolicy("auto-5", heads, drafter, flat, chains_only=True).tree_for(SamplingParams())
    assert asked.size == 6 and not asked.is_chain  # auto-N is the user's shape: N drafts, any tree


def test_auto_dtype_takes_bf16_only_where_it_is_lossless(monkeypatch):
    import torch

    import cadence.system.machine as cpu
    from cadence.backbone.load import lossless_bf16
    from tiny import tiny_backbone

    config = tiny_backbone("llama").config
    monkeypatch.delenv("CADENCE_CPU_AUTO_DTYPE", raising=False)
    monkeypatch.setattr(cpu, "native_bf16", lambda: True)
    monkeypatch.setattr(cpu, "onednn_available", lambda: True)
    cpu_dev = torch.device("cpu")
    assert lossless_bf16(config, cpu_dev, "auto") and lossless_bf16(config, cpu_dev, "fast")
    assert not lossless_bf16(config, cpu_dev, "transformers")  # no row-consistent forward there
    monkeypatch.setenv("CADENCE_CPU_AUTO_DTYPE", "float32")
    assert not lossless_bf16(config, cpu_dev, "auto")
    monkeypatch.delenv("CADENCE_CPU_AUTO_DTYPE")
    monkeypatch.setattr(cpu, "native_bf16", lambda: False)  # an AVX2-only CPU
    assert not lossless_bf16(config, cpu_dev, "auto")


def test_isa_limits_turn_an_avx512_bf16_cpu_into_an_avx2_one(monkeypatch):
    """``ONEDNN_MAX_CPU_ISA`` / ``ATEN_CPU_CAPABILITY`` narrow what the kernels may use; the
    precision choice and the reports follow them, not the raw /proc/cpuinfo flags."""
    import torch

    import cadence.system.machine as cpu
    from cadence.system.machine import machine_line

    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "avx512_bf16", "amx_tile"}))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    for var in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"):
        monkeypatch.delenv(var, raising=False)
    assert cpu.native_bf16() and cpu.has_amx() and cpu.isa_note() is None
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "avx512_core_bf16")
    assert cpu.native_bf16() and not cpu.has_amx()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert not cpu.native_bf16() and not cpu.has_amx()
    assert "oneDNN AVX2" in cpu.isa_note()
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert not cpu.native_bf16() and "torch AVX2" in cpu.isa_note()
    info = {"cpu": "Some CPU", "cores": 2, "ram_gib": 1.0, "gpu": None, "torch": "t", "transformers": "x",
            "commit": "c", "isa_limit": cpu.isa_note()}
    assert "Some CPU (instruction set limited to torch AVX2" in machine_line(info)


@pytest.mark.parametrize("name", ("hydra", "mtp", "eagle-taps"))
def test_shipped_profiles_give_every_task_one_tree_per_entropy_bin(name):
    """Each shipped profiles.json holds the five tasks with one acceptance table per bin, and
    EntMTP derives one tree per bin from it that pays under a flat verify curve."""
    from cadence.costs.latency import LatencyCurve
    from cadence.heads.shipped import SHIPPED_HEADS
    from cadence.heads.profiles import load_profiles
    from cadence.schedulers.entmtp import bin_trees
    from cadence.trees.tree import expected_tau

    profiles = load_profiles(SHIPPED_HEADS / "smollm2" / name)
    assert set(profiles) == {"general", "humaneval", "gsm8k", "sharegpt", "writing"}
    flat = LatencyCurve([1, 64], [0.01, 0.01])
    for p in profiles.values():
        assert p.edges == sorted(p.edges) and len(p.tables) == len(p.edges) + 1 == len(p.counts)
        assert all(0.0 <= a <= 1.0 for t in p.tables for row in t for a in row) and min(p.counts) > 0
        trees = bin_trees(p, False, flat, 0.0, len(p.tables[0]), len(p.tables[0]), 0.05)
        assert len(trees) == len(p.tables)
        assert all(expected_tau(t.paths, table) > 1.5 for t, table in zip(trees, p.tables))


def test_auto_scheduler_grows_dynamic_trees_only_on_a_flat_verify_curve():
    """``--scheduler auto``: dynamic trees where 8 nodes verify in about one forward (bf16),
    adaptive's small candidates where the curve is steep (a GGUF model's blocks)."""
    from types import SimpleNamespace

    from cadence.methods import MethodSpec, resolve_scheduler_name

    calibrated = SimpleNamespace(policy=SimpleNamespace(calibrated=True))
    flat = LatencyCurve([1, 8, 16], [0.020, 0.022, 0.025])  # bf16, Zen 4: T(8)/T(1) 1.1
    steep = LatencyCurve([1, 8, 16], [0.0070, 0.0123, 0.0185])  # GGUF blocks, Zen 4: 1.76
    spec = MethodSpec()
    assert resolve_scheduler_name(spec, calibrated, flat) == "dynamic"
    assert resolve_scheduler_name(spec, calibrated, steep) == "adaptive"
    assert resolve_scheduler_name(spec, calibrated, None) == "dynamic"
    assert resolve_scheduler_name(MethodSpec(scheduler="dynamic"), calibrated, steep) == "dynamic"
    assert resolve_scheduler_name(MethodSpec(tree="chain"), calibrated, steep) == "static"
    assert resolve_scheduler_name(spec, SimpleNamespace(policy=SimpleNamespace(calibrated=False)), steep) == "static"
