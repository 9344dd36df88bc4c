"""A new drafter is one module in ``engine/drafters/`` plus its knob in ``knobs.KNOBS``: the proof.

A copy of the package gets exactly those two additions: ``repeat``, a point-mass drafter that proposes
the sequence's last token again up to ``repeat`` times, with per-sequence state (its budget halves after
a rejection and grows back after a full acceptance). In a subprocess importing that copy, with no other
change, the knob is a field of ``Policy`` and ``SpeculativeConfig``, a command-line option, validated,
reported in the statistics and shown in a candidate's label; the drafter drafts, keeps its state per
sequence, runs under a round chooser's arms (``copy`` turns it on, ``plain`` and ``exit`` off), and the
greedy output equals transformers'.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import hispec_decode
from conftest import save_tiny

DRAFTER = '''
"""A test drafter: the sequence's last token again, up to ``policy.repeat`` times (0: off)."""

from __future__ import annotations

from dataclasses import dataclass

from ..sequence import Sequence
from .base import Draft, Drafter, DraftLoop


@dataclass
class Budget:
    tokens: int = 0  # 0: the policy's
    proposed: int = 0


class Repeat(Drafter):
    name = "repeat"
    order = 20  # after prompt lookup, before the draft exit
    point_mass = True
    off = {"repeat": 0}
    on = {"repeat": 2}

    def new_state(self) -> Budget:
        return Budget()

    def active(self, seq: Sequence) -> bool:
        return seq.policy.repeat > 0 and seq.policy.floor(seq.batch_size) <= 1

    def can_propose(self, seq: Sequence) -> bool:
        return seq.room() > 1 and len(seq.tokens) >= 2 and seq.tokens[-1] == seq.tokens[-2]

    def tokens(self, seq: Sequence, context: list[int], count: int) -> list[int]:
        budget = self.state(seq)
        n = min(budget.tokens or seq.policy.repeat, seq.policy.repeat, count)
        budget.proposed += n
        return [context[-1]] * n

    def propose(self, seq: Sequence, threshold: float) -> DraftLoop:
        if not self.can_propose(seq):
            return None
        drafted = self.tokens(seq, seq.tokens, seq.room())
        seq.tokens += drafted
        return Draft(self, len(drafted))
        yield

    def feedback(self, seq: Sequence, draft: Draft, accepted: int) -> None:
        budget = self.state(seq)
        full = budget.tokens or seq.policy.repeat
        budget.tokens = max(1, full // 2) if accepted < draft.count else min(seq.policy.repeat, full + 1)
'''

KNOB = '''    Knob("repeat", int, 0, "test drafter: the last token again, this many times at most (0: off)", minimum=0,
         search=(0, 2), symbol="rep"),
'''

CHECK = r'''
import json, sys
import hispec_decode
from hispec_decode import HiSpecModel
from hispec_decode.config import SpeculativeConfig
from hispec_decode.decoding.policy import Policy
from hispec_decode.errors import HiSpecError
from hispec_decode.engine import chooser
from hispec_decode.engine.drafters import registered
from hispec_decode.tools.generate import build_parser
from hispec_decode.tuning.candidates import Candidate

copy, path, prompts, want = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
assert hispec_decode.__file__.startswith(copy), hispec_decode.__file__
assert [d.name for d in registered()] == ["lookup", "repeat", "exit"]
assert Policy(draft_layer=1, verify_layer=3).repeat == 0 and SpeculativeConfig(repeat=3).repeat == 3
assert "--repeat" in build_parser().format_help()
try:
    SpeculativeConfig(repeat=-1)
    raise SystemExit("repeat=-1 was accepted")
except HiSpecError as exc:
    assert "repeat" in str(exc)
assert "rep=2" in Candidate("hispec", Policy(draft_layer=1, verify_layer=3, repeat=2), 6).label()
arms = chooser.arm_policies(Policy(draft_layer=1, verify_layer=3, repeat=3))
assert arms["plain"].repeat == 0 and arms["exit"].repeat == 0 and arms["copy"].repeat == 3
assert arms["copy"].draft_threshold > 1 and chooser.arm_policies(Policy(draft_layer=1, verify_layer=3))["copy"].repeat == 2

model = HiSpecModel.from_pretrained(path)
kw = dict(max_new_tokens=40, method="hispec", draft_layer=1, verify_layer=3, num_draft=2)
out = model.generate(prompts, repeat=3, **kw)
assert out.sequences == want, (out.sequences, want)
assert out.stats["repeat"] == 3
states = [s.drafter_state.get("repeat") for s in out.seqs]
assert all(s is not None for s in states) and len({id(s) for s in states}) == len(states)
assert sum(s.proposed for s in states) > 0, "the drafter never drafted"

rounds = {}
real = chooser.RoundChooser.choose
def counting(self, seq):
    policy = real(self, seq)
    rounds[self.arm] = rounds.get(self.arm, 0) + 1
    return policy
chooser.RoundChooser.choose = counting
flat = {r: 1e-4 for r in (1, 2, 4, 8, 16, 32)}
costs = {"call_rows": flat, "layer_rows": flat, "call_seqs": flat, "layer_seqs": flat,
         "exits": {str(k): flat for k in (1, 3, 6)}}
model._machine = {"costs": costs}
for prompt, expected in zip(prompts, want):
    out = model.generate([prompt], repeat=3, **kw)
    assert out.sequences == [expected]
assert rounds, "no round was chosen"
print(json.dumps(rounds))
'''


def _package_with_repeat_drafter(root: Path) -> Path:
    """A copy of the package with the drafter's module and its knob added, nothing else."""
    src = Path(hispec_decode.__file__).parent
    dst = root / "hispec_decode"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "default_heads"))
    (dst / "engine" / "drafters" / "repeat.py").write_text(DRAFTER)
    knobs = (dst / "knobs.py").read_text()
    end = re.search(r"^\)\nKNOB = ", knobs, re.M)
    assert end, "KNOBS is no longer one tuple closed before KNOB"
    (dst / "knobs.py").write_text(knobs[: end.start()] + KNOB + knobs[end.start():])
    return root


def test_a_drafter_with_its_own_state_and_knob_is_one_module_and_one_knob(tmp_path):
    tiny = save_tiny("llama", tmp_path / "tiny")
    prompts = [[5, 5, 5, 9, 9, 9, 2, 2], [7, 1, 4], [3, 3, 3, 3]]
    want = [tiny.hf_generate(p, 40) for p in prompts]
    copy = _package_with_repeat_drafter(tmp_path / "copy")
    # the copy's kernels would build again from its own sources (a minute): its fp32 decode takes the torch paths
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(copy), str(Path(__file__).parent)]), HISPEC_KERNELS="0")
    run = subprocess.run([sys.executable, "-c", CHECK, str(copy), str(tiny.path), json.dumps(prompts), json.dumps(want)],
                         env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    rounds = json.loads(run.stdout.strip().splitlines()[-1])
    assert rounds.get("policy") or rounds.get("copy"), rounds
