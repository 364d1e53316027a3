"""The pipeline schedules' point-to-point traffic is correct under NCCL semantics.

NCCL ignores tags: on a pair of ranks, the k-th send from a to b is matched with the k-th
receive b posts from a, and a send may block until that receive is posted. So the test
records what the real schedule code issues and checks it without looking at tags:

1. Recording. Each rank of a pipeline (PP = 2 or 4; one chunk = 1F1B, two or three =
   interleaved; several micro-batch counts; training and forward-only) is run in this
   process in turn, with torch's fake process-group backend standing in for the pipeline
   group (collectives do nothing) and a tiny real GPT split into that rank's chunks (bf16,
   one layer per virtual stage). `dist.batch_isend_irecv` and the single
   isend / irecv / send / recv are replaced by a recorder: every call becomes a posted
   group of operations (kind, peer, shape, dtype, tag), every wait on one of its requests
   a wait event, and received buffers are filled with random values so the computation
   goes on. A rank's program is the resulting sequence of posts and waits.
2. Order. For every pair (a, b), the operations a posts towards b, in issue order, must
   be one to one the mirror of those b posts towards a: a send of shape/dtype S where b
   has a receive of shape/dtype S, at the same position. Tags play no part in the
   matching; they only name the message, and position-matched send and receive must name
   the same one (so an activation is never taken for a same-shaped gradient).
3. Progress. An event simulation of NCCL's strictest behaviour (every send waits for its
   receive): each rank issues its posts in program order until it waits on a group that
   has not completed; a rank's groups run one after another (one stream); an operation
   completes when its group and the group holding its matched operation on the peer are
   both running; a group completes when all of its operations have. Every rank must reach
   the end of its program; otherwise the test fails with where each rank is stuck.
Received buffers must also have the parameters' dtype (bf16, not the fp32 default) and
device: the schedule runs with "meta" as the default device, so a buffer allocated
without an explicit device= would be caught. The check functions themselves are tested on
hand-written programs (a ring of ranks that all send first deadlocks; swapped messages of
one shape are caught by their tags).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.testing._internal.distributed.fake_pg import FakeStore

from megamoe.config import ModelConfig, pipeline_layer_ranges
from megamoe.model.gpt_model import GPTModel
from megamoe.model.pipeline_stage import split_pipeline
from megamoe.training.schedules.pipeline import forward_backward_pipelining

DTYPE = torch.bfloat16


@dataclass
class Op:
    kind: str  # "send" | "recv"
    peer: int
    shape: tuple
    dtype: torch.dtype
    tag: int


@dataclass
class Recorder:
    """Stands in for torch.distributed's point-to-point calls on one rank at a time."""

    programs: dict[int, list[tuple]] = field(default_factory=dict)
    rank: int = 0
    param: tuple = (None, None)  # the model's (dtype, device)
    next_id: itertools.count = field(default_factory=itertools.count)

    def _post(self, ops: list[tuple[str, torch.Tensor, int, int]]) -> list[_Work]:
        gid = next(self.next_id)
        recorded = []
        for kind, tensor, peer, tag in ops:
            if kind == "recv":
                got = (tensor.dtype, tensor.device)
                assert got == self.param, f"receive buffer {got}, parameters {self.param}"
                with torch.no_grad():
                    tensor.normal_(0.0, 0.1)
            recorded.append(Op(kind, peer, tuple(tensor.shape), tensor.dtype, tag))
        self.programs.setdefault(self.rank, []).append(("post", gid, recorded))
        return [_Work(self, gid) for _ in ops]

    def batch_isend_irecv(self, ops):
        return self._post([("send" if op.op == self.isend else "recv", op.tensor, op.peer,
                            op.tag) for op in ops])

    def isend(self, tensor, dst=None, group=None, tag=0, group_dst=None):
        return self._post([("send", tensor, dst, tag)])[0]

    def irecv(self, tensor, src=None, group=None, tag=0, group_src=None):
        return self._post([("recv", tensor, src, tag)])[0]

    def send(self, tensor, dst=None, group=None, tag=0, group_dst=None):
        self.isend(tensor, dst, group, tag).wait()

    def recv(self, tensor, src=None, group=None, tag=0, group_src=None):
        self.irecv(tensor, src, group, tag).wait()
        return src


@dataclass
class _Work:
    recorder: Recorder
    gid: int

    def wait(self, timeout=None) -> bool:
        self.recorder.programs[self.recorder.rank].append(("wait", self.gid))
        return True

    def is_completed(self) -> bool:
        return True


def _config(num_layers: int) -> ModelConfig:
    return ModelConfig(num_layers=num_layers, hidden_size=8, ffn_hidden_size=16,
                       num_attention_heads=2, seq_length=4, max_position_embeddings=4,
                       vocab_size=16, make_vocab_size_divisible_by=8, hidden_dropout=0.0,
                       attention_dropout=0.0)


def record(pp: int, chunks: int, m: int, forward_only: bool) -> dict[int, list[tuple]]:
    """Every rank's program (posts and waits) for one global batch of `m` micro-batches."""
    config = _config(pp * chunks)
    ranges = pipeline_layer_ranges(config.num_layers, pp, 1 if chunks > 1 else None)
    g = torch.Generator().manual_seed(0)
    batches = [{"tokens": torch.randint(0, 16, (2, 4), generator=g),
                "labels": torch.randint(0, 16, (2, 4), generator=g),
                "loss_mask": torch.ones(2, 4)} for _ in range(m)]
    rec = Recorder()
    with pytest.MonkeyPatch.context() as mp:
        for module in (dist, c10d):  # P2POp checks its op against c10d's isend / irecv
            for name in ("batch_isend_irecv", "isend", "irecv", "send", "recv"):
                mp.setattr(module, name, getattr(rec, name))
        for rank in range(pp):
            torch.manual_seed(0)
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=pp)
            try:
                model = split_pipeline(GPTModel(config).to(DTYPE), ranges, rank, None,
                                       list(range(pp)))
                param = next(model.parameters())
                rec.rank, rec.param = rank, (param.dtype, param.device)
                rec.programs[rank] = []
                with torch.device("meta"):  # a buffer allocated without device= lands here
                    forward_backward_pipelining(model, iter(batches), m,
                                                forward_only=forward_only)
            finally:
                dist.destroy_process_group()
    return rec.programs


def pair_sequences(programs: dict[int, list[tuple]]) -> dict[tuple[int, int], list[Op]]:
    """{(a, b): the operations rank a posts towards rank b, in issue order}."""
    out: dict[tuple[int, int], list[Op]] = {}
    for rank, program in programs.items():
        for event in program:
            if event[0] == "post":
                for op in event[2]:
                    out.setdefault((rank, op.peer), []).append(op)
    return out


def assert_mirrored(programs: dict[int, list[tuple]]) -> None:
    seqs = pair_sequences(programs)
    for (a, b), mine in seqs.items():
        theirs = seqs.get((b, a), [])
        assert len(mine) == len(theirs), f"ranks {a}->{b}: {len(mine)} vs {len(theirs)} ops"
        for i, (x, y) in enumerate(zip(mine, theirs)):
            assert {x.kind, y.kind} == {"send", "recv"} and (x.shape, x.dtype) == (
                y.shape, y.dtype), f"ranks {a}<->{b}, operation {i}: {x} vs {y}"
            assert x.tag == y.tag, f"ranks {a}<->{b}, operation {i}: other message {x} vs {y}"


def simulate(programs: dict[int, list[tuple]]) -> None:
    """NCCL-like rendezvous (see the module docstring); AssertionError on a deadlock.
    Operations are matched as NCCL does: the k-th send from a to b with the k-th receive
    b posts from a."""
    key, count = {}, {}  # (rank, group, index) -> (sender, receiver, k)
    for rank, program in programs.items():
        for event in program:
            for i, op in enumerate(event[2] if event[0] == "post" else ()):
                link = (rank, op.peer) if op.kind == "send" else (op.peer, rank)
                k = count[(op.kind, *link)] = count.get((op.kind, *link), -1) + 1
                key[(rank, event[1], i)] = (*link, k)
    pos = dict.fromkeys(programs, 0)
    queues: dict[int, list[tuple[int, list]]] = {r: [] for r in programs}  # stream order
    completed: set[int] = set()
    finished: set[tuple] = set()  # operations whose peer was running at the same time
    while True:
        progressed = False
        for r, program in programs.items():  # issue until a wait on an unfinished group
            while pos[r] < len(program):
                event = program[pos[r]]
                if event[0] == "post":
                    queues[r].append((event[1], [(r, event[1], i)
                                                 for i in range(len(event[2]))]))
                elif event[1] not in completed:
                    break
                pos[r] += 1
                progressed = True
        running = [key[op] for q in queues.values() if q for op in q[0][1]]
        finished.update(k for k in running if running.count(k) == 2)
        for q in queues.values():
            if q and all(key[op] in finished for op in q[0][1]):
                completed.add(q.pop(0)[0])
                progressed = True
        if all(pos[r] == len(p) and not queues[r] for r, p in programs.items()):
            return
        assert progressed, (f"deadlock: program positions {pos}, running groups "
                            f"{ {r: q[0][0] for r, q in queues.items() if q} }")


CASES = [  # (pp, chunks, micro-batches, forward_only)
    (2, 1, 1, False), (2, 1, 2, False), (2, 1, 5, False), (2, 1, 3, True),
    (2, 2, 2, False), (2, 2, 4, False), (2, 2, 6, False), (2, 2, 4, True),
    (2, 3, 2, False),
    (4, 1, 1, False), (4, 1, 3, False), (4, 1, 8, False), (4, 1, 5, True),
    (4, 2, 4, False), (4, 2, 8, False), (4, 2, 8, True),
]


@pytest.mark.parametrize("pp, chunks, m, forward_only", CASES)
def test_every_rank_pair_posts_mirrored_operations_that_complete(pp, chunks, m, forward_only):
    programs = record(pp, chunks, m, forward_only)
    seqs = pair_sequences(programs)
    messages = (pp * chunks - 1) * m * (1 if forward_only else 2)
    assert sum(len(s) for s in seqs.values()) == 2 * messages  # a send and a receive each
    assert all(op.dtype == DTYPE for s in seqs.values() for op in s)
    assert_mirrored(programs)
    simulate(programs)


def _post(gid: int, *ops: tuple[str, int, int]) -> tuple:
    return ("post", gid, [Op(kind, peer, (4,), DTYPE, tag) for kind, peer, tag in ops])


def test_the_checks_catch_a_deadlock_and_a_swap():
    """Separate blocking calls, each neighbour sending before it receives: two ranks post
    unmirrored sequences; three in a ring mirror each other and deadlock. Swapped messages
    of the same shape pass the shape check and must fail on the tag."""
    with pytest.raises(AssertionError, match="operation 0"):
        assert_mirrored({0: [_post(0, ("send", 1, 0)), ("wait", 0), _post(1, ("recv", 1, 1)),
                             ("wait", 1)],
                         1: [_post(2, ("send", 0, 1)), ("wait", 2), _post(3, ("recv", 0, 0)),
                             ("wait", 3)]})
    ring = {r: [_post(2 * r, ("send", (r + 1) % 3, r)), ("wait", 2 * r),
                _post(2 * r + 1, ("recv", (r - 1) % 3, (r - 1) % 3)), ("wait", 2 * r + 1)]
            for r in range(3)}
    assert_mirrored(ring)
    with pytest.raises(AssertionError, match="deadlock"):
        simulate(ring)
    paired = {r: [_post(r, ("send", (r + 1) % 3, r), ("recv", (r - 1) % 3, (r - 1) % 3)),
                  ("wait", r)] for r in range(3)}
    assert_mirrored(paired)
    simulate(paired)
    swapped = {0: [_post(0, ("send", 1, 0), ("send", 1, 1)), ("wait", 0)],
               1: [_post(1, ("recv", 0, 1), ("recv", 0, 0)), ("wait", 1)]}
    with pytest.raises(AssertionError, match="other message"):
        assert_mirrored(swapped)
