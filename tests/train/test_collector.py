"""Training steps run with what existed before them frozen out of the garbage collector's walks."""
from __future__ import annotations

import gc
import weakref

from sft_shard_helpers import write_shard

import cflib.train.trainer
from cflib.data.tasks import generate
from cflib.train import train
from cflib.train.collector import steady_collector


def test_steady_collector_freezes_once_for_nested_holders_and_unfreezes_on_exit(collector_unfrozen):
    """Frozen objects that die meanwhile (a frame, another thread's garbage) leave the count, so the inner holder
    is told apart by what it would add or remove: the 1,000 lists made after the outer freeze, or everything."""
    before = gc.get_freeze_count()
    assert before == 0
    alive = [[] for _ in range(1000)]  # lists: objects the collector tracks
    with steady_collector():
        outer = gc.get_freeze_count()
        assert outer >= before + len(alive)
        newer = [[] for _ in range(1000)]
        with steady_collector():
            assert outer - len(newer) // 2 < gc.get_freeze_count() <= outer  # neither refrozen nor unfrozen
        assert outer - len(newer) // 2 < gc.get_freeze_count() <= outer
    assert gc.get_freeze_count() == 0  # every frozen object is collectable again


def test_a_process_that_froze_objects_itself_keeps_them_frozen(collector_unfrozen):
    class Node:
        pass

    garbage = Node()
    garbage.self = garbage  # a cycle: only a collection frees it, and none frees it while frozen
    still_there = weakref.ref(garbage)
    del garbage
    gc.freeze()  # the process's own freeze, the cycle in it
    mine = gc.get_freeze_count()
    with steady_collector():
        newer = [[] for _ in range(1000)]
        assert mine - len(newer) // 2 < gc.get_freeze_count() <= mine  # nothing more frozen
    gc.collect()
    assert still_there() is not None  # nor unfrozen on exit
    assert mine - len(newer) // 2 < gc.get_freeze_count() <= mine


def test_a_cycle_made_by_a_step_is_still_collected(collector_unfrozen):
    class Node:
        pass

    with steady_collector():
        node = Node()
        node.self = node
        del node
        assert gc.collect() >= 1
    assert not any(type(o) is Node for o in gc.get_objects())


def test_every_training_step_runs_with_the_setup_frozen(tmp_path, monkeypatch, collector_unfrozen):
    train_examples, eval_examples = generate(seed=1)
    shard = write_shard(tmp_path / "shard", train_examples[:40], eval_examples[:12], max_seq_len=64)
    frozen = []
    step = cflib.train.trainer.Trainer.train_step

    def watched(self, *args, **kwargs):
        frozen.append(gc.get_freeze_count())
        return step(self, *args, **kwargs)

    monkeypatch.setattr(cflib.train.trainer.Trainer, "train_step", watched)
    train({"model": "smoke", "seq_len": 64, "micro_batch_per_rank": 8, "global_batch": 16, "device": "cpu",
           "data": str(shard), "out_dir": str(tmp_path / "run"), "max_steps": 3, "eval_at_start": False,
           "exact_match_limit": 0}, progress=False)
    assert len(frozen) == 3 and min(frozen) > 0
    assert gc.get_freeze_count() == 0
