"""Stopping a CP group after a one-sided failure, so that no rank ever goes on with ring exchanges out of step.

The ring is a lock-step protocol: every rank makes the same exchanges in the same order. When an error
escapes a rank in the middle of that sequence (an out-of-memory error inside a layer, an exception in its
backward) while its peers carry on, the peers wait in an exchange it will never make. If its code catches
the error and calls the model again (``accelerate.utils.find_executable_batch_size`` does), its next
exchanges would pair with the wrong ones: a hang, or one layer's key/value blocks matched with another's.

So such a failure is made final and loud. The rank that failed *stops the group*:

1. it records which rank failed, in which call, with which error, in the group's c10d store (the key
   ``hf_ring/stopped``; the first record wins);
2. on gloo it breaks the group's connections (a receive that times out makes gloo close every connection of
   the group, by design), so each peer waiting in an exchange of that group fails at once;
3. it remembers the group as stopped: every later ring-attention call on it raises before communicating.

A peer whose exchange fails then reads the record, raises an error naming the rank and the call that
failed, and stops the group on its side too (so ranks further round the ring learn it in turn).

Only failures that can leave a peer waiting stop the group: an error inside a ring-attention call of a group
of more than one rank, an error escaping a model's forward after its first ring exchange, and a backward of such
a forward that began but did not finish (found when the model is called again). Bad input found by the
pre-flight check raises on every rank at the same point and leaves the group usable, as does a forward refused by
a hook that runs before hf_ring's own (``ring_generate``'s checks, a vision-language model's text-only check);
except where the world has ranks outside the CP group (other DP groups, which did not raise): a refusal escaping a
patched model's forward then stops the group too (``Progress.refused``).

Nothing here runs while all is well: no collective, no store access, no host sync; a few host counters per
call. Caveats: on NCCL the connections are not broken (aborting communicators from one side does not release
the peers' kernels); the peers' waits there end by the process group's timeout and NCCL's watchdog, and the
record names the failure when they raise. A backward that fails before reaching the model's outputs' hooks
(a loss computed outside the model) is not seen here; a backward failure is found when the model is called again,
so another collective before that waits for its own timeout; ``timeout=`` bounds the ring's waits. The break on
gloo is best effort: on a loaded host a peer's pending exchange sometimes misses it and keeps waiting (seen in 1 to
6 runs in 100 of ``tests/test_reliability.py``'s failure inside a ring call, four runs at a time on 2 busy cores). With ``timeout=`` that wait ends within the
timeout, and the error names the recorded failure all the same (``StoppedError``); without one it waits for the
process group's timeout. Set ``timeout=`` where a caught failure must end every rank promptly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import sys

import torch
import torch.distributed as dist
import torch.utils.checkpoint

__all__ = ["InStepError", "Progress", "StoppedError", "failed", "in_backward", "raise_if_stopped", "record_of", "stop"]

KEY = "hf_ring/stopped"
_BREAK_TAG = 0x7FFF0000  # a tag no exchange uses: the receive posted on it times out at once
_STOPPED: dict = {}  # id(group) -> (group, record): groups this process stopped or saw stopped


class StoppedError(RuntimeError):
    """The CP group was stopped after a one-sided failure; its ranks cannot exchange in step any more."""


def _resolve(group):
    return dist.distributed_c10d._get_default_group() if group is None else group


def _store(group):
    try:
        return dist.distributed_c10d._get_process_group_store(_resolve(group))
    except Exception:  # noqa: BLE001 - no store, no record: the errors then say less, nothing else changes
        return None


def global_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def record_of(group) -> str | None:
    """What stopped ``group`` (the first record in its store, else this process's own), or None."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    store = _store(group)
    if store is not None:
        with contextlib.suppress(Exception):  # the store's host may be gone with the rank that failed
            if store.check([KEY]):
                return store.get(KEY).decode()
    entry = _STOPPED.get(id(_resolve(group)))
    return None if entry is None else entry[1]


def raise_if_stopped(group) -> None:
    """``StoppedError`` when ``group`` was stopped (a dictionary lookup; no communication)."""
    if _STOPPED and dist.is_available() and dist.is_initialized():
        entry = _STOPPED.get(id(_resolve(group)))
        if entry is not None:
            raise StoppedError(_advice(entry[1]))


def _advice(record: str) -> str:
    return (
        f"hf_ring: the CP group was stopped: {record}. Its ranks can no longer exchange in step, so every rank "
        "raises; restart the job (from its last checkpoint)"
    )


def stop(groups, record: str) -> None:
    """Stop every group of ``groups`` (None: the default group): record why, break its connections, remember it."""
    for group in dict.fromkeys(groups):
        g = _resolve(group)
        if id(g) in _STOPPED:
            continue
        _STOPPED[id(g)] = (g, record)
        store = _store(g)
        if store is not None:
            with contextlib.suppress(Exception):
                store.compare_set(KEY, "", record)  # only if absent: the first failure is the cause
        _break(g)


def _break(group) -> None:
    """Close the group's gloo connections (each peer's pending exchange with this rank fails at once).

    A receive whose wait times out makes gloo close every connection of the group; one posted on a connection
    that already failed raises at once without closing the others, so the peers are tried in turn."""
    if "gloo" not in str(dist.get_backend(group)) or dist.get_world_size(group) < 2:
        return
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    for step in range(1, n):
        try:
            peer = dist.get_global_rank(group, (rank + step) % n)
            dist.irecv(torch.empty(1), src=peer, group=group, tag=_BREAK_TAG).wait(datetime.timedelta(milliseconds=1))
        except Exception as e:  # noqa: BLE001 - the wait is meant to fail
            if "timed out" in str(e).lower():
                return


# what non-reentrant checkpointing raises to stop a recomputation early (a private name: () if it ever goes)
_RECOMPUTATION_STOP = getattr(torch.utils.checkpoint, "_StopRecomputationError", ())


def failed(groups, error: BaseException, what: str) -> None:
    """This rank failed out of step with its peers (``what``: where, after "failed", e.g. " in layer 3"): stop
    ``groups``, naming this rank, the place and the error. An exchange that failed because a group was stopped
    elsewhere spreads that record instead. Not a failure: a checkpointed layer's recomputation stopped early by
    PyTorch once it has what the backward needs (non-reentrant checkpointing), at the same point on every rank."""
    if isinstance(error, _RECOMPUTATION_STOP):
        return
    if isinstance(error, StoppedError):
        stop(groups, record_of(groups[0]) or str(error))
        return
    stop(groups, f"global rank {global_rank()} failed{what}: {type(error).__name__}: {error}")


def stopped_by_peers(who: str, record: str) -> StoppedError:
    """The error of a rank whose exchange failed because its peers stopped the group (``who``: the rank and where
    it was waiting)."""
    return StoppedError(
        f"ring_attention: {who} because its peers stopped the CP group: {record}. The ranks can no longer exchange "
        "in step; restart the job (from its last checkpoint)"
    )


def lost(groups, what: str) -> str | None:
    """After this rank's exchange failed: the record of a group stopped elsewhere (and stop it here too, so the
    ranks that wait for this one learn it), or None (no record: a peer died or timed out)."""
    for group in groups:
        record = record_of(group)
        if record is not None:
            stop(groups, record)
            return record
    stop(groups, f"global rank {global_rank()} lost its peers {what}")
    return None


@dataclasses.dataclass
class Progress:
    """Where one model's forward and backward stand in their ring calls (held by its ``PlanCache``).

    ``begin_forward`` (at the start of every forward) first checks the previous step: a backward that began (a
    hook on the model's outputs fired) but never finished (the callback it queued on autograd's engine, which
    runs when a backward completes without error, did not run) means this rank failed in that backward and is
    being called again: the group is stopped and ``StoppedError`` raised. (Counting ring backward calls instead
    would misfire where autograd rightly skips some: layers below the lowest trainable parameter.) Each backward
    (each autograd graph task) reaching the outputs is watched anew: a second backward with ``retain_graph``, or
    the backward of an earlier forward, counts as well.

    Forwards that run inside a backward (a checkpointed model's recomputation) are not new steps: the hooks skip
    them (``in_backward``).
    """

    calls: int = 0  # ring calls with exchanges begun in this forward (outside any backward)
    grad_calls: int = 0  # of them, those whose backward is owed
    backward_calls: int = 0  # ring backward calls finished since this forward began
    backward_began: bool = False
    backward_ended: bool = False
    task: int = -1  # the autograd graph task of the backward being watched
    label: str = ""  # the call under way, as the model names it ("layer 3")
    groups: list = dataclasses.field(default_factory=list)  # groups this forward exchanged on
    # model forwards begun (hf_ring's pre-hook ran) and not ended: a forward refused by a hook that runs before it
    # (``ring_generate``'s, a vision-language model's text-only check) must not read the counts of the one before
    depth: int = 0
    # the model's CP group (None: the default group), set where the model is patched: a refusal of its input is
    # one-sided when the world has ranks outside it (``refused``)
    group: object = None

    def begin_forward(self) -> None:
        if self.backward_began and not self.backward_ended:
            stop(
                self.groups,
                f"global rank {global_rank()} failed in its backward (after {self.backward_calls} ring-attention "
                "backward calls of the step) and was called again",
            )
        for group in (*self.groups, self.group):
            raise_if_stopped(group)
        self.calls = self.grad_calls = self.backward_calls = 0
        self.backward_began = self.backward_ended = False
        self.label, self.groups = "", []

    def call(self, groups, needs_grad: bool) -> str:
        """Count a ring call on ``groups`` (counted before its pre-flight check: from then on a one-sided failure
        can leave peers waiting); returns its name for errors ("ring-attention call 3 (layer 2)")."""
        if not in_backward():  # not a recomputation inside a backward
            self.calls += 1
            self.grad_calls += int(needs_grad)
        for group in groups:
            if not any(g is group for g in self.groups):
                self.groups.append(group)
        return self.name()

    def name(self) -> str:
        return f"ring-attention call {self.calls}" + (f" ({self.label})" if self.label else "")

    def end_forward(self, output) -> None:
        """After the model's forward (``output`` None: it raised): stop the group if it raised after exchanging;
        otherwise watch for the backward to begin (a hook on the output tensors that need a gradient). Nothing for
        a forward that was refused before it began (``depth`` 0), except what ``refused`` stops."""
        if output is None:
            self.refused(sys.exc_info()[1])
        if self.depth == 0:
            return
        self.depth -= 1
        self._end_forward(output)

    def _end_forward(self, output) -> None:
        if output is None:  # the forward raised (torch passes no output then); the error is being handled
            error = sys.exc_info()[1]
            if self.calls and not isinstance(error, (StoppedError, InStepError)):
                stop(
                    self.groups,
                    f"global rank {global_rank()} failed in its forward after {self.name()}: "
                    f"{type(error).__name__}: {error}",
                )
            return
        if not self.calls:  # (not grad_calls: under reentrant checkpointing the layers run without grad)
            return
        values = output.values() if isinstance(output, dict) else output if isinstance(output, tuple) else (output,)
        for t in values:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self._began)

    def refused(self, error) -> None:
        """A refusal (``InStepError``) escaped the model's forward while the world has ranks outside its CP group
        (other DP groups): every rank of this CP group raised it, but those ranks did not, and go on to their next
        collective (a ZeRO-3 or FSDP2 parameter gather, DDP's gradient reduction) with this group's ranks; were this
        group's ranks to catch it and go on, their next collectives would pair with the wrong ones (a hang, or
        mixed-up data). So the group is stopped: the error propagates as it is, and a later call of the model on
        this group raises ``StoppedError``. (Each model level's closing hook calls this; ``stop`` acts once.)"""
        if not isinstance(error, InStepError) or not (dist.is_available() and dist.is_initialized()):
            return
        group = _resolve(self.group)
        if dist.get_world_size() == dist.get_world_size(group):
            return  # (no rank outside the group: every rank raised it; the group stays usable)
        stop(
            [self.group],
            f"global rank {global_rank()} refused its input while ranks outside its CP group (other DP groups) "
            f"went on: {error}",
        )

    def _began(self, grad):
        task = torch._C._current_graph_task_id()
        if task != self.task:  # a backward not watched yet
            self.task, self.backward_began, self.backward_ended = task, True, False
            torch.autograd.Variable._execution_engine.queue_callback(self._ended)

    def _ended(self):
        self.backward_ended = True


def in_backward() -> bool:
    """True inside a backward pass (autograd is running a graph task on this thread)."""
    return torch._C._current_graph_task_id() != -1


class InStepError(ValueError):
    """Bad input that every rank of the group raises at the same point (the pre-flight check): nothing is
    out of step, the group stays usable (unless ranks outside it went on: ``Progress.refused``)."""
