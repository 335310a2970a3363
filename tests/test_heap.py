"""``system.heap.settled``: the loaded model's objects frozen out of the cyclic collector while
the command-line entry points decode, thawed on the way out."""

import gc
from contextlib import contextmanager

from test_cli import PROMPT, json_lines, run  # noqa: F401  (the module's fixtures come along)
from test_cli import loaded, model_dir  # noqa: F401

import cadence.cli
from cadence.system.heap import settled


def test_settled_freezes_what_is_alive_and_thaws_it():
    keep = [[i] for i in range(1000)]  # tracked containers alive before the block
    assert gc.get_freeze_count() == 0
    with settled() as frozen:
        assert frozen >= len(keep) and gc.get_freeze_count() >= len(keep)
        fresh = [[0]]
        assert gc.is_tracked(fresh)  # objects made inside are collected as before
    assert gc.get_freeze_count() == 0


def test_settled_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("CADENCE_GC_FREEZE", "0")
    with settled() as frozen:
        assert frozen == 0 and gc.get_freeze_count() == 0


def test_generate_decodes_inside_a_settled_heap(capsys, monkeypatch, model_dir, loaded):  # noqa: F811
    seen = []

    @contextmanager
    def recording():
        with settled() as frozen:
            seen.append(frozen)
            yield frozen

    monkeypatch.setattr(cadence.cli, "settled", recording)
    rc, out, err = run(capsys, "--model", model_dir, "--prompt", PROMPT, "--method", "vanilla",
                       "--max-new-tokens", 4, "--json")
    assert rc == 0, err
    assert len(json_lines(out)) == 1
    assert len(seen) == 1 and seen[0] > 0  # the model loaded before the freeze
    assert gc.get_freeze_count() == 0
