"""Failures that are not bad input: a peer that is killed or stuck inside the ring (plain multiprocessing, no
``torchrun`` to end the job), with ``timeout=``: the waiting rank raises, naming the ring step and its peers,
within the timeout (plus a margin) instead of the process group's 30 minutes."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest
import torch

from .dist_utils import free_port

TIMEOUT = 4.0  # seconds, the ring's bound under test
MARGIN = 10.0  # the budget beyond the timeout: process start, gloo's connection teardown


def _peer(rank: int, port: int, fate: str, out) -> None:
    import torch.distributed as dist

    import hf_ring

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(rank)
    q, k, v = (torch.randn(1, 2, 32, 16, requires_grad=True) for _ in range(3))
    o = hf_ring.ring_attention(q, k, v, timeout=TIMEOUT)  # both ranks complete the forward
    if rank == 1:  # then rank 1 never joins the backward's exchange
        if fate == "killed":
            os._exit(0)
        time.sleep(TIMEOUT + MARGIN + 20)  # stuck elsewhere, alive
        os._exit(0)
    t0 = time.perf_counter()
    try:
        o.sum().backward()
        out.put(("no error", None, time.perf_counter() - t0))
    except (TimeoutError, RuntimeError) as e:
        out.put((type(e).__name__, str(e), time.perf_counter() - t0))
    out.close()
    out.join_thread()  # flushed before the hard exit
    os._exit(0)  # the group is broken: leave without destroy_process_group, which would wait for the peer


def _launch(fate: str):
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_peer, args=(r, port, fate, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        return out.get(timeout=TIMEOUT + MARGIN + 60)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()


@pytest.mark.parametrize("fate", ["stuck", "killed"])
def test_a_peer_that_never_arrives_raises_within_the_timeout_naming_step_and_peer(fate):
    kind, message, seconds = _launch(fate)
    assert kind != "no error", "the backward completed without its peer"
    assert seconds <= TIMEOUT + MARGIN, f"{fate}: raised after {seconds:.1f} s"
    assert "in the backward at ring step" in message and "global rank 1" in message, message
    if fate == "stuck":  # alive but silent: only the timeout can tell
        assert kind == "TimeoutError" and f"waited more than {TIMEOUT:g} s" in message, message


def test_timeout_reaches_every_attention_module_and_is_validated():
    import hf_ring

    from .test_hf_parity import make_model

    model = hf_ring.apply_ring_attention(make_model("llama"), timeout=3)
    assert {m.hf_ring_config.timeout for m in model.modules() if hasattr(m, "hf_ring_config")} == {3}
    with pytest.raises(ValueError, match="timeout must be a positive number of seconds or None, got 0"):
        hf_ring.apply_ring_attention(make_model("llama"), timeout=0)
